package outer

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// testTwoPhase is a two-phase codec of rank rank of w over one fragment
// of m elements in chunks of 7, 0.3 of each sent in 2 bits, decay 0.9.
func testTwoPhase(m, w, rank int) *sparseCodec {
	return testOwners(m, w, rank, 2, SparseTwoPhase)
}

// testOwners is a codec of exchange x (one with owners and server
// accumulators) of rank rank of w over one fragment of m elements in
// chunks of 7, 0.3 of each sent in vbits bits, decay 0.9.
func testOwners(m, w, rank, vbits int, x SparseExchange) *sparseCodec {
	cfg := DefaultConfig()
	cfg.Codec, cfg.SparseChunk, cfg.Density, cfg.SparseBits, cfg.Decay = CodecSparse, 7, 0.3, vbits, 0.9
	cfg.SparseExchange = x
	s := newSparseCodec(cfg, m, m, w)
	s.setServer([]int{0, m}, w, rank)
	return s
}

// The owners' runs: ceil(chunks/W) chunks each from the fragment's start,
// the last ranks fewer or none.
func TestSparseRun(t *testing.T) {
	run := func(m, chunk, w int) [][2]int {
		var out [][2]int
		for j := range w {
			lo, hi := sparseRun(m, chunk, w, j)
			out = append(out, [2]int{lo, hi})
		}
		return out
	}
	assert.Equal(t, [][2]int{{0, 14}, {14, 28}, {28, 40}}, run(40, 7, 3))       // 6 chunks, 2 each, the last one short
	assert.Equal(t, [][2]int{{0, 7}, {7, 14}, {14, 17}}, run(17, 7, 3))         // 3 chunks: 1 each
	assert.Equal(t, [][2]int{{0, 7}, {7, 10}, {10, 10}}, run(10, 7, 3))         // 2 chunks: 1, 1 and none
	assert.Equal(t, [][2]int{{0, 5}, {5, 5}}, run(5, 7, 2))                     // one chunk
	assert.Equal(t, [][2]int{{0, 4}, {4, 8}, {8, 10}, {10, 10}}, run(10, 4, 4)) // 3 chunks on 4 ranks
}

// What the owners send plus their server accumulators at the end is the
// sum of the averages they were given (error feedback telescopes on the
// server side), each exchange's weighted by Decay^(exchanges after it) as
// the server accumulator decays (Decay 1: the plain sums), and every rank
// gets the same average, bit for bit, on 3 ranks over 6 exchanges of a
// fragment of 40 elements (rank 2 owning a short last chunk) and of 10
// (rank 2 owning none).
func TestTwoPhaseTelescopes(t *testing.T) {
	const w, exchanges = 3, 6
	for _, k := range []struct {
		m     int
		decay float32
	}{{40, 0.9}, {10, 0.9}, {40, 1}} {
		m := k.m
		t.Run(fmt.Sprintf("%d/decay%g", m, k.decay), func(t *testing.T) {
			mk := func(rank int) *sparseCodec {
				s := testTwoPhase(m, w, rank)
				s.decay = k.decay
				return s
			}
			avgs, outs, srvs := ownerExchanges(t, w, m, exchanges, mk, (*sparseCodec).allReduceTwoPhase)
			requireTelescopes(t, w, m, float64(k.decay), avgs, outs, srvs)
			nonzero := 0
			for _, v := range srvs[0] {
				if v != 0 {
					nonzero++
				}
			}
			assert.Positive(t, nonzero, "the owner kept some error")
		})
	}
}

// spoiling corrupts what one of its collectives receives.
type spoiling struct {
	comm.Comm
	allToAll bool // spoil the all-to-all (phase 1), else the all-gather
	spoil    func(recv []byte)
}

func (s *spoiling) AllToAllBytes(ctx context.Context, send, recv []byte) error {
	err := s.Comm.AllToAllBytes(ctx, send, recv)
	if err == nil && s.allToAll {
		s.spoil(recv)
	}
	return err
}

func (s *spoiling) AllGatherBytes(ctx context.Context, send, recv []byte) error {
	err := s.Comm.AllGatherBytes(ctx, send, recv)
	if err == nil && !s.allToAll {
		s.spoil(recv)
	}
	return err
}

// Malformed segments are refused in either phase, before the server
// accumulator or anything applied changes, on every rank that receives
// them: a non-zero padding byte, a scale that is not finite, offsets out
// of their chunk.
func TestTwoPhaseRefusesMalformed(t *testing.T) {
	// 10 elements in 2 chunks of 7 and 3 on 3 ranks: rank 1 owns the
	// short one (1 byte of padding in its segments), rank 2 none (all
	// padding).
	const w, m = 3, 10
	seg := testTwoPhase(m, w, 0).segLen(m, w)
	for _, k := range []struct {
		name     string
		allToAll bool
		spoil    func(recv []byte)
		detect   []int // the ranks that see the malformed bytes
		want     string
	}{
		{"padding", true, func(recv []byte) { recv[seg-1] = 1 }, []int{1, 2}, "phase 1: segment of rank 0"},
		{"padding", false, func(recv []byte) { recv[2*seg-1] = 1 }, []int{0, 1, 2}, "phase 2: segment of rank 1"},
		{"scale", false, func(recv []byte) { binary32(recv[seg:], float32(math.NaN())) }, []int{0, 1, 2}, "phase 2: segment of rank 1"},
		{"offsets", true, func(recv []byte) { recv[8], recv[9] = 0xff, 0xff }, []int{0, 1, 2}, "phase 1: segment of rank 0"},
	} {
		t.Run(fmt.Sprintf("%s/alltoall%v", k.name, k.allToAll), func(t *testing.T) {
			errs, applied, kept := spoiledExchange(t, w, m, func(rank int) *sparseCodec { return testTwoPhase(m, w, rank) }, (*sparseCodec).allReduceTwoPhase,
				func(c comm.Comm) comm.Comm { return &spoiling{Comm: c, allToAll: k.allToAll, spoil: k.spoil} })
			for r := range w {
				assert.Error(t, errs[r], "rank %d", r)
				assert.False(t, applied[r], "rank %d applied an average", r)
				if k.allToAll {
					assert.True(t, kept[r], "rank %d: the server accumulator changed", r)
				}
			}
			for _, r := range k.detect {
				assert.ErrorIs(t, errs[r], errSparseMessage, "rank %d", r)
				assert.ErrorContains(t, errs[r], k.want, "rank %d", r)
			}
		})
	}
}

func binary32(b []byte, v float32) {
	u := math.Float32bits(v)
	b[0], b[1], b[2], b[3] = byte(u), byte(u>>8), byte(u>>16), byte(u>>24)
}

// Any bytes as the W segments of a fragment are refused or decode to at
// most k entries per chunk, never a panic.
func FuzzSparseSegments(f *testing.F) {
	const w, m = 3, 17 // 3 chunks of 7, 7 and 3, one per rank
	s := testTwoPhase(m, w, 0)
	seg := s.segLen(m, w)
	good := make([]byte, w*seg)
	x := make([]float32, m)
	for i := range x {
		x[i] = float32(i%5) - 2.5
	}
	for j := range w {
		lo, hi := sparseRun(m, s.chunk, w, j)
		at := j * seg
		for a := lo; a < hi; a += s.chunk {
			b := min(a+s.chunk, hi)
			at += s.encode(good[at:], x[a:b])
		}
	}
	f.Add(good)
	f.Add(make([]byte, w*seg))
	f.Fuzz(func(t *testing.T, recv []byte) {
		if len(recv) != w*seg {
			return // the collectives fix the length
		}
		runLen := func(j int) int {
			lo, hi := sparseRun(m, s.chunk, w, j)
			return hi - lo
		}
		if err := s.checkSegments(recv, seg, runLen); err != nil {
			return
		}
		dst := make([]float32, m)
		for j := range w {
			lo, hi := sparseRun(m, s.chunk, w, j)
			if err := s.decode(dst[lo:hi], hi-lo, recv[j*seg:j*seg+s.msgLen(hi-lo)]); err != nil {
				t.Fatalf("checked segment %d: %v", j, err)
			}
		}
		checkDecoded(t, dst, 2*s.k(7)+s.k(3))
	})
}

// randomExchanges runs exchanges calls of reduce, one of s's exchanges,
// over m elements of standard normal deltas drawn per rank, and returns
// per exchange what this rank sent (its accumulator's decayed value plus
// the delta, less what the accumulator kept) and the average it got.
func randomExchanges(ctx context.Context, c comm.Comm, s *sparseCodec, m, exchanges int,
	reduce ownerReduce) (sent, got [][]float32, err error) {
	rng := rand.New(rand.NewPCG(uint64(c.Rank()), 7))
	for range exchanges {
		d := make([]float32, m)
		for i := range d {
			d[i] = float32(rng.NormFloat64())
		}
		before := slices.Clone(s.acc)
		out := make([]float32, m)
		err := reduce(s, ctx, c, 0, 0, m,
			func(lo int, x []float32) { copy(x, d[lo:]) },
			func(lo int, avg []float32) { copy(out[lo:], avg) })
		if err != nil {
			return nil, nil, err
		}
		x := make([]float32, m)
		for i := range x {
			x[i] = (s.decay*before[i] + d[i]) - s.acc[i]
		}
		sent, got = append(sent, x), append(got, out)
	}
	return sent, got, nil
}

// ownerReduce is one of the exchanges with owners, as a method
// expression: (*sparseCodec).allReduceTwoPhase or allReduceShared.
type ownerReduce = func(s *sparseCodec, ctx context.Context, c comm.Comm, f, first, m int, delta func(lo int, x []float32), apply func(lo int, avg []float32)) error

// ownerExchanges runs randomExchanges of reduce on w ranks, rank r with
// the codec mk(r), and returns per rank what it sent and the average it
// got per exchange ([rank][exchange]) and its server accumulator at the
// end. It requires every rank to get the same averages, bit for bit.
func ownerExchanges(t *testing.T, w, m, exchanges int, mk func(rank int) *sparseCodec, reduce ownerReduce) (sents, outs [][][]float32, srvs [][]float32) {
	t.Helper()
	var mu sync.Mutex
	sents, outs, srvs = make([][][]float32, w), make([][][]float32, w), make([][]float32, w)
	require.NoError(t, local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		s := mk(c.Rank())
		sent, got, err := randomExchanges(ctx, c, s, m, exchanges, reduce)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		sents[c.Rank()], outs[c.Rank()], srvs[c.Rank()] = sent, got, slices.Clone(s.srv)
		return nil
	}))
	for r := 1; r < w; r++ {
		require.Equal(t, outs[0], outs[r], "rank %d's averages", r)
	}
	return sents, outs, srvs
}

// requireTelescopes requires what was applied (outs[0], per exchange)
// plus the owners' server accumulators at the end (srvs, each at its
// rank's run of chunks of 7) to be the sum of the ranks' mean of what
// they sent, each exchange's weighted by decay^(exchanges after it).
func requireTelescopes(t *testing.T, w, m int, decay float64, sents, outs [][][]float32, srvs [][]float32) {
	t.Helper()
	exchanges := len(outs[0])
	lhs, rhs := make([]float64, m), make([]float64, m)
	for x := range exchanges {
		weight := math.Pow(decay, float64(exchanges-1-x))
		for i := range m {
			lhs[i] += weight * float64(outs[0][x][i])
			for r := range w {
				rhs[i] += weight * float64(sents[r][x][i]) / float64(w)
			}
		}
	}
	for r := range w {
		lo, _ := sparseRun(m, 7, w, r)
		for j, v := range srvs[r] {
			lhs[lo+j] += float64(v)
		}
	}
	for i := range m {
		require.InDelta(t, rhs[i], lhs[i], 1e-5*(1+math.Abs(rhs[i])), "element %d", i)
	}
}

// spoiledExchange runs one exchange of reduce over m elements on w
// ranks, rank r with the codec mk(r) and the communicator wrap(c), every
// rank's delta at element i (i+1)(1+r). It requires the run to fail and
// returns per rank its error, whether it applied an average and whether
// its server accumulator kept its value.
func spoiledExchange(t *testing.T, w, m int, mk func(rank int) *sparseCodec, reduce ownerReduce, wrap func(c comm.Comm) comm.Comm) (errs []error, applied, kept []bool) {
	t.Helper()
	errs, applied, kept = make([]error, w), make([]bool, w), make([]bool, w)
	runErr := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		s := mk(c.Rank())
		srv := slices.Clone(s.srv)
		err := reduce(s, ctx, wrap(c), 0, 0, m,
			func(lo int, x []float32) {
				for i := range x {
					x[i] = float32(lo+i+1) * float32(1+c.Rank())
				}
			},
			func(int, []float32) { applied[c.Rank()] = true })
		errs[c.Rank()], kept[c.Rank()] = err, slices.Equal(srv, s.srv)
		return err
	})
	require.Error(t, runErr)
	return errs, applied, kept
}
