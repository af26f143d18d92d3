package onebit

// Choosing, call by call, how a large tensor's calls run: its chunks
// whole or in pieces, and, whole, with their collectives started (run
// while the call computes, on a comm.Starter) or blocking.
//
// A pipelined call (chunks in pieces) hides the compression behind the
// wire when the wire is slow; when it is fast, the extra collectives (and,
// where they run on a goroutine, the goroutine that waits in them) cost
// more than they hide. Started collectives hide the wire behind the
// residual passes, but where there is no wire to hide (ranks that share
// memory) their own cost shows: 4 MPI ranks on one machine, 64 MiB, took
// 23.7-32.8 ms started against 22.8-27.9 ms blocking (8 interleaved runs
// each, medians 27.2 and 24.4 ms), where at 10 Gbit started took 27.4-32.2
// ms against 31.3-36.6 blocking (medians 29.4 and 33.5 ms). Which one wins
// depends on the link, the CPU and what else runs, so a State measures:
// every call records how long it took on this rank, the next call's header
// carries that time to every rank, and every rank takes the same decision
// from the same headers. Each call's header also carries the piece count
// the rank uses, so ranks that disagree (SetPieces set differently) get an
// error instead of a hang, and whether the rank can start its collectives
// and whether it runs them blocking, so that they are started only where
// every rank can and none runs them blocking. All ways give bit-identical
// outputs and error buffers.
//
// The fields ride in the high 24 bits of the header's length word, above
// the 40 bits of the tensor length, so the header is that word alone: bits
// 40-42 hold the pieces per chunk of this call (1 to 4); bit 43 says that
// the rank can start the collectives of this call (a call of at least
// startMin elements on a comm.Starter, with SetOverlap on), bit 44 that it
// runs them blocking (the tuner's third way); bits 45-63 the rank's
// previous call's time in units of 32 microseconds (0: none, or it
// failed; at most about 16 seconds).

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"time"
)

// TuningCalls is how many calls a new State makes before it runs the way
// that measured fastest: its first calls try every way, and a decision
// uses times from two calls back. Benchmarks warm up with at least as
// many.
const TuningCalls = tuneOpening + 2

const (
	lenBits      = 40
	lenMask      = 1<<lenBits - 1 // the tensor length in the header's length word
	pieceBits    = 3
	startBit     = lenBits + pieceBits // the rank can start its collectives
	blockingBit  = startBit + 1        // the rank runs them blocking
	timeShift    = blockingBit + 1
	timeUnit     = 32 // microseconds
	timeMax      = 1<<(64-timeShift) - 1
	tuneOpening  = len(tuneOpeningWays)
	numWays      = 3
	wayPieces    = 0 // chunks in pieces
	wayWhole     = 1 // chunks whole, collectives started where every rank can
	wayBlocking  = 2 // chunks whole, collectives blocking
	tuneEvery    = 32
	tuneSamples  = 5
	tuneExplored = numWays - 1
	// tuneConfirm is how many calls a confirmation runs: whole chunks
	// started and the challenger in turn, tuneSamples of each, and the
	// two calls whose times a decision does not have yet.
	tuneConfirm = 2 * (tuneSamples + 1)
	// tuneRecheck: while a confirmed way other than whole chunks started
	// runs, one call in every tuneRecheck runs whole chunks started, so
	// that their times stay fresh.
	tuneRecheck = 8
)

// tuneOpeningWays is the way of each opening call: pieces first (the first
// call's time is not used: it pays for first touches of memory), then each
// way five times, in turn. After the opening, whole chunks started run
// unless another way beats them beyond doubt (tuneConfidence), and then
// the one of those with the lowest estimate; but for tuneExplored calls in
// every tuneEvery, which run each other way once, so that the choice
// follows a link or a load that changes.
//
// A way's estimate is the median of its last tuneSamples times: one or
// two disturbed calls (4 ranks on 2 cores, memory whose speed changes from
// one moment to the next) move it little, and three of a way running
// slower than its estimate move it. Fewer opening calls chose wrongly
// where the ways' times overlap: with two of each and the median of
// three, pieces in 4 of 16 runs at 10 Gbit (31.6-43.6 ms where whole
// chunks took 28.1-31.7); with three of each and the second shortest of
// five, whole chunks blocking in 1 of 3 runs at 10 Gbit (40.1 ms against
// 26.4-28.1 started) and started in 1 of 3 unshaped (30.1 ms against 23.1
// blocking).
var tuneOpeningWays = [...]int{wayPieces,
	wayPieces, wayWhole, wayBlocking, wayPieces, wayWhole, wayBlocking, wayPieces, wayWhole, wayBlocking,
	wayPieces, wayWhole, wayBlocking, wayPieces, wayWhole, wayBlocking}

// tuneConfidence is how sure the times must be that another way is faster
// than whole chunks started for it to run: its times must be the shorter in
// this share of the pairs of its last times and theirs (with 5 of each,
// 20 of 25: where two ways' times come from one distribution, that happens
// in about 5% of draws). Where the ways tie, whole chunks started run; among
// the ways that beat them, the one with the lowest estimate. The mistakes
// do not cost the same: whole chunks started were never far from the
// fastest way (4 MPI ranks on 2 cores, 64 MiB: unshaped, medians 27.2
// against 24.4 ms blocking; at 1 Gbit 104-105 against 101 ms in pieces,
// steadily: the times on a slow link vary little, and pieces still run
// there), where the others lose by more where they lose (10 Gbit, fast
// memory: 26.6 ms started against 32.7-34.7 in pieces and 33-40 blocking)
// and tie with it elsewhere (10 Gbit, slow memory: 38.3-42.0 ms started,
// 38.3-49.1 in pieces); and the memory's speed, which decides between
// them, changes from minute to minute. With the lowest estimate alone,
// pieces or blocking ran in 5 of 18 runs at 10 Gbit (51-84% of the memory
// bound); with this rule whole chunks started ran in 6 of 6 interleaved
// with the last 6 of those (60-92%), and pieces in 3 of 3 at 1 Gbit.
const tuneConfidence = 0.8

// A way other than whole chunks started runs for good only once it has
// been confirmed: when the times first say it beats them, the next
// tuneConfirm calls run whole chunks started and it in turn, so that both
// ways' times are fresh and taken under the same conditions, and the
// decision after them stands (until the times change it again). Without
// it a way chosen from times that overlapped by chance (about 5% of draws
// for two ways of one distribution, see tuneConfidence) or from whole
// chunks' calls that something else disturbed ran until the samples of
// whole chunks were replaced one exploration at a time, up to
// tuneSamples*tuneEvery calls: one 10 Gbit bench-net row ran in pieces at
// 63% of the memory bound where whole chunks started reached 70-80%.

// tuner is a State's choice of way. Every field but start and last
// evolves identically on every rank: only what the headers carry changes
// it.
type tuner struct {
	fixed bool // SetPieces fixed the cut: no choice

	calls   int // headers through so far
	way     int // this call's way
	prevWay int // the way of the previous call
	nextWay int // the way of the next call, decided at this call's header

	start time.Time // when this call began on this rank
	last  uint64    // this rank's previous call, in units of timeUnit; 0: none, or it failed

	times [numWays][tuneSamples]uint64 // per way: the latest times, a ring
	n     [numWays]int                 // times recorded per way

	kept       int  // 1 + the way other than whole chunks started that a confirmation confirmed; 0: none
	cand       int  // the way under confirmation
	confirm    int  // calls of the running confirmation left; 0: none running
	confirming bool // the confirmation ran its last call: the next decision stands
}

// SetPieces fixes the number of pieces each chunk travels in on the
// following calls: 1 sends every chunk whole (no pipelining), k > 1 cuts
// each chunk into at most k pieces (and at most 4, the most a call
// uses). SetPieces(0), the default, lets the calls choose between whole
// chunks, started or blocking, and pieces by how long earlier calls took
// (see AllReduce). Every rank must set the same: a call whose ranks differ
// fails on every rank. Tensors of less than about 16 MiB per rank always
// travel whole, with their collectives started where every rank can.
func (s *State) SetPieces(k int) {
	if k <= 0 {
		s.setPieces(s.chunkBytes/pieceTarget, s.world)
		s.tune = tuner{}
		return
	}
	s.setPieces(k, s.world)
	s.tune = tuner{fixed: true}
}

// Pieces is the number of pieces each chunk travelled in on the last
// call (1: whole), or, before the first, on the next.
func (s *State) Pieces() int { return s.pieces }

// Started reports whether the last call started its collectives (see
// AllReduce).
func (s *State) Started() bool { return s.started }

// tunes reports whether the calls choose their way: not when SetPieces
// fixed the cut, nor for a tensor too small for pieces, nor when the
// output stays packed in the gathered buffer (the compact and sharded
// modes), whose layout its owner reads across calls.
func (s *State) tunes() bool { return !s.tune.fixed && s.pipePieces > 1 && !s.keep }

// beginCall starts the clock of a call and sets its way.
func (s *State) beginCall() {
	s.tune.start = time.Now()
	if s.tunes() {
		s.useWay(s.tune.way)
	}
}

// endCall records how long the call took on this rank (err == nil) or
// that it failed, and sets the next call's way.
func (s *State) endCall(err error) {
	t := &s.tune
	t.last = 0
	if err == nil {
		t.last = uint64(min(max(time.Since(t.start).Microseconds()/timeUnit, 1), timeMax))
	}
	t.way = t.nextWay
}

// useWay sets the cut of the calls: every chunk whole, or the pieces of
// setPieces.
func (s *State) useWay(way int) {
	if way != wayPieces {
		s.pieces, s.pieceBytes, s.mid = 1, s.chunkBytes, 0
		return
	}
	s.pieces, s.pieceBytes, s.mid = s.pipePieces, s.pipePieceBytes, s.pipeMid
}

// tuning is the tuning fields of this rank's header, in place in its
// length word: this call's piece count, whether it starts its collectives
// and the previous call's time.
func (s *State) tuning() uint64 {
	w := uint64(s.pieces)<<lenBits | s.tune.last<<timeShift
	if s.starts {
		w |= 1 << startBit
	}
	if s.tunes() && s.tune.way == wayBlocking {
		w |= 1 << blockingBit
	}
	return w
}

// allStart reports whether this call starts its collectives: every rank's
// header says it can, and none that it runs them blocking.
func (s *State) allStart() bool {
	for j := range s.world {
		w := binary.LittleEndian.Uint64(s.headers[j*headerLen:])
		if w&(1<<startBit) == 0 || w&(1<<blockingBit) != 0 {
			return false
		}
	}
	return true
}

// headerTuning returns the piece count and the previous call's time in
// rank j's header.
func (s *State) headerTuning(j int) (pieces int, last uint64) {
	w := binary.LittleEndian.Uint64(s.headers[j*headerLen:])
	return int(w >> lenBits & (1<<pieceBits - 1)), w >> timeShift
}

// takeTuning checks that every rank cuts this call the same, records the
// previous call's time, and decides the next call's way. The time
// recorded is the mean over the ranks of each one's time in the call,
// waiting for the others included: what the call costs the group. (The
// shortest rank's time, the call's own once the last rank is in it, chose
// whole chunks at 1 Gbit in 2 of 3 runs, where they took 110-112 ms at
// p50 against 103-104 ms in pieces: a way that leaves the early ranks
// waiting longer does not show in it.)
func (s *State) takeTuning() error {
	for j := range s.world {
		if got, _ := s.headerTuning(j); got != s.pieces {
			return fmt.Errorf("onebit: rank %d cuts the chunks into %d pieces where this rank cuts them into %d (SetPieces must be the same on every rank)",
				j, got, s.pieces)
		}
	}
	if !s.tunes() {
		return nil
	}
	var sum uint64
	all := true
	for j := range s.world {
		_, last := s.headerTuning(j)
		sum += last
		all = all && last > 0
	}
	if !all { // some rank's previous call failed, or there was none
		sum = 0
	}
	s.tune.take(sum / uint64(s.world))
	return nil
}

// take records the group's time of the previous call (0: none, or some
// rank's failed) and decides the next call's way.
func (t *tuner) take(last uint64) {
	if t.calls >= 2 && last > 0 { // the previous call is not the first
		w := t.prevWay
		t.times[w][t.n[w]%tuneSamples] = last
		t.n[w]++
	}
	t.calls++
	t.prevWay = t.way
	t.nextWay = t.next(t.calls)
}

// next returns the way of call u (counted from 0), running and starting
// confirmations: a way other than whole chunks started that the times
// choose runs once a confirmation has confirmed it.
func (t *tuner) next(u int) int {
	if u < tuneOpening {
		return tuneOpeningWays[u]
	}
	if t.confirm > 0 {
		t.confirm--
		t.confirming = t.confirm == 0
		if t.confirm%2 == 1 {
			return wayWhole
		}
		return t.cand
	}
	best := t.best()
	ended := t.confirming
	t.confirming = false
	switch {
	case best == wayWhole:
		t.kept = 0
	case ended: // a confirmation's fresh times chose it: it stands
		t.kept = 1 + best
	case t.kept != 1+best: // a challenger: confirm it first
		t.cand, t.confirm = best, tuneConfirm-1
		return wayWhole
	}
	if best != wayWhole && (u-tuneOpening)%tuneRecheck == tuneRecheck-1 {
		return wayWhole
	}
	return t.explore(u, best)
}

// decide returns the way of call u (counted from 0) from the times
// alone, without confirmations: the opening's, then the best way's but in
// the exploring calls.
func (t *tuner) decide(u int) int {
	if u < tuneOpening {
		return tuneOpeningWays[u]
	}
	return t.explore(u, t.best())
}

// best returns the way the times choose: whole chunks started, unless
// another way beats them beyond doubt, and then the one of those with the
// lowest estimate.
func (t *tuner) best() int {
	best := wayWhole
	for _, w := range [...]int{wayBlocking, wayPieces} {
		if t.beats(w, wayWhole) && t.estimate(w) < t.estimate(best) {
			best = w
		}
	}
	return best
}

// explore returns the way of call u when best is the way chosen: best,
// but for tuneExplored calls in every tuneEvery, which run each other way
// once.
func (t *tuner) explore(u, best int) int {
	if k := (u-tuneOpening)%tuneEvery - (tuneEvery - tuneExplored); k >= 0 {
		return (best + 1 + k) % numWays
	}
	return best
}

// beats reports whether way a measured faster than way b beyond doubt:
// in at least tuneConfidence of the pairs of a time of a and a time of b,
// a's is the shorter (a tie counts half); or a has times and b none.
func (t *tuner) beats(a, b int) bool {
	ka, kb := min(t.n[a], tuneSamples), min(t.n[b], tuneSamples)
	if ka == 0 || kb == 0 {
		return ka > 0
	}
	wins := 0 // in halves
	for _, x := range t.times[a][:ka] {
		for _, y := range t.times[b][:kb] {
			switch {
			case x < y:
				wins += 2
			case x == y:
				wins++
			}
		}
	}
	return float64(wins) >= 2*tuneConfidence*float64(ka*kb)
}

// estimate is the median of the times recorded for way w (the mean of the
// middle two of an even count; +Inf for none).
func (t *tuner) estimate(w int) float64 {
	k := min(t.n[w], tuneSamples)
	if k == 0 {
		return math.Inf(1)
	}
	var v [tuneSamples]uint64
	copy(v[:], t.times[w][:k])
	slices.Sort(v[:k])
	if k%2 == 0 {
		return (float64(v[k/2-1]) + float64(v[k/2])) / 2
	}
	return float64(v[k/2])
}
