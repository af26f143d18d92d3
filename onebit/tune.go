package onebit

// Choosing, call by call, whether a large tensor's chunks travel whole or
// in pieces.
//
// A pipelined call (chunks in pieces) hides the compression behind the
// wire when the wire is slow; when it is fast, the extra collectives (and,
// where they run on a goroutine, the goroutine that waits in them) cost
// more than they hide. Which one wins depends on the link, the
// CPU and what else runs, so a State measures: every call records how long
// it took on this rank, the next call's header carries that time to every
// rank, and every rank takes the same decision from the same headers. Each
// call's header also carries the piece count the rank uses, so ranks that
// disagree (SetPieces set differently) get an error instead of a hang.
// Both ways give bit-identical outputs and error buffers.
//
// The two fields ride in the high 24 bits of the header's length word,
// above the 40 bits of the tensor length, so the header keeps its 12 bytes:
// bits 40-42 hold the pieces per chunk of this call (1 to 4), bits 44-63
// the rank's previous call's time in units of 16 microseconds (0: none, or
// it failed; at most about 16 seconds). Bit 43 says that the rank can
// start the collectives of this call (a whole-chunk call on a
// comm.Starter, allReduceWhole).

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"time"
)

// TuningCalls is how many calls a new State makes before it sends its
// chunks the way that measured faster (whole or in pieces): its first
// calls try both ways, and a decision uses times from two calls back.
// Benchmarks warm up with at least as many.
const TuningCalls = tuneOpening + 2

const (
	lenBits   = 40
	lenMask   = 1<<lenBits - 1 // the tensor length in the header's length word
	pieceBits = 3
	startBit  = lenBits + pieceBits // the rank starts its collectives
	timeShift = startBit + 1
	timeUnit  = 16 // microseconds
	timeMax   = 1<<(64-timeShift) - 1

	// tuneOpening is the number of calls of the fixed opening, whose ways
	// are tuneOpeningWhole.
	tuneOpening = 5
	// tuneEvery: in every tuneEvery calls after the opening, two run the
	// way that measured slower, so that the choice follows a link or a
	// load that changes.
	tuneEvery = 32
	// tuneSamples is the number of times kept per way; the estimate is
	// their median.
	tuneSamples = 3
)

// tuneOpeningWhole is the way of each opening call: pieces first (the
// first call's time is not used: it pays for first touches of memory),
// then each way twice, alternately.
var tuneOpeningWhole = [tuneOpening]bool{false, false, true, false, true}

// tuner is a State's choice between whole chunks and pieces. Every field
// but start and last evolves identically on every rank: only what the
// headers carry changes it.
type tuner struct {
	fixed bool // SetPieces fixed the cut: no choice

	calls     int  // headers through so far
	whole     bool // this call sends whole chunks
	prevWhole bool // the way of the previous call
	nextWhole bool // the way of the next call, decided at this call's header

	start time.Time // when this call began on this rank
	last  uint64    // this rank's previous call, in units of timeUnit; 0: none, or it failed

	times [2][tuneSamples]uint64 // per way (0 pieces, 1 whole): the latest times, a ring
	n     [2]int                 // times recorded per way
}

// way is the index of times for a way.
func way(whole bool) int {
	if whole {
		return 1
	}
	return 0
}

// SetPieces fixes the number of pieces each chunk travels in on the
// following calls: 1 sends every chunk whole (no pipelining), k > 1 cuts
// each chunk into at most k pieces (and at most 4, the most a call
// uses). SetPieces(0), the default, lets the calls choose between whole
// chunks and pieces by how long earlier calls took (see AllReduce). Every
// rank must set the same: a call whose ranks differ fails on every rank.
// Tensors of less than about 16 MiB per rank always travel whole.
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

// tunes reports whether the calls choose between whole chunks and
// pieces: not when SetPieces fixed the cut, nor for a tensor too small
// for pieces, nor when the output stays packed in the gathered buffer
// (the compact and sharded modes), whose layout its owner reads across
// calls.
func (s *State) tunes() bool { return !s.tune.fixed && s.pipePieces > 1 && !s.keep }

// beginCall starts the clock of a call and sets its way.
func (s *State) beginCall() {
	s.tune.start = time.Now()
	if s.tunes() {
		s.useWhole(s.tune.whole)
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
	t.whole = t.nextWhole
}

// useWhole sets the cut of the calls: every chunk whole, or the pieces of
// setPieces.
func (s *State) useWhole(whole bool) {
	if whole {
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
	return w
}

// allStart reports whether every rank's header says it starts the
// collectives of this call.
func (s *State) allStart() bool {
	for j := range s.world {
		if binary.LittleEndian.Uint64(s.headers[j*headerLen+4:])&(1<<startBit) == 0 {
			return false
		}
	}
	return true
}

// headerTuning returns the piece count and the previous call's time in
// rank j's header.
func (s *State) headerTuning(j int) (pieces int, last uint64) {
	w := binary.LittleEndian.Uint64(s.headers[j*headerLen+4:])
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
	t := &s.tune
	if t.calls >= 2 { // the previous call is not the first
		var sum uint64
		all := true
		for j := range s.world {
			_, last := s.headerTuning(j)
			sum += last
			all = all && last > 0
		}
		if all { // every rank's previous call went through
			w := way(t.prevWhole)
			t.times[w][t.n[w]%tuneSamples] = sum / uint64(s.world)
			t.n[w]++
		}
	}
	t.calls++
	t.prevWhole = t.whole
	t.nextWhole = t.decide(t.calls)
	return nil
}

// decide returns the way of call u (counted from 0).
func (t *tuner) decide(u int) bool {
	if u < tuneOpening {
		return tuneOpeningWhole[u]
	}
	best := t.estimate(1) < t.estimate(0)
	if (u-tuneOpening)%tuneEvery >= tuneEvery-2 {
		return !best
	}
	return best
}

// estimate is the median of the times recorded for way w (the mean of
// two; +Inf for none).
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
