package onebit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
)

// The tuner's decision: a fixed opening that tries every way five times,
// then the way whose median recent time is lowest (two slow calls of five
// do not count against a way, three do; a time more than five calls of
// its way old no longer counts), except two calls in every 32 that run
// each other way once.
func TestTuneDecide(t *testing.T) {
	P, W, B := onebit.WayPieces, onebit.WayWhole, onebit.WayBlocking
	opening := []int{P, P, W, B, P, W, B, P, W, B, P, W, B, P, W, B}
	for u, want := range opening {
		assert.Equal(t, want, onebit.TuneWay(u, []uint64{100}, []uint64{1}, []uint64{1}), "opening call %d", u)
	}
	for _, tc := range []struct {
		times [][]uint64
		best  int
	}{
		{[][]uint64{{300, 290, 310}, {200, 900, 210}, {250, 240, 260}}, W},
		{[][]uint64{{300, 290, 310}, {270, 900, 280, 950, 260}, {350, 340, 360}}, W},
		{[][]uint64{{300, 290, 310}, {270, 910, 900, 950, 940}, {350, 340, 360}}, P},
		{[][]uint64{{100, 400, 410, 420, 430}, {300, 310, 320}, {350, 340, 360}}, W},
		{[][]uint64{{280, 270}, {310, 305}, {350, 340, 360}}, P},
		// The other ways must beat whole chunks started beyond doubt (in 4
		// of 5 pairs of times); then the fastest of them runs.
		{[][]uint64{{300, 320, 290, 310, 305}, {310, 305, 300, 315, 295}, {350, 340, 360}}, W},
		{[][]uint64{{300, 290}, {310, 305}, {295, 300, 290}}, B},
		{[][]uint64{{300, 290, 310}, {400, 380, 410}, {310, 320, 305}}, P},
		{[][]uint64{{350, 360, 370}, {400, 380, 410}, {310, 320, 305}}, B},
		{[][]uint64{{101, 102, 101, 100, 101}, {104, 105, 104, 104, 105}, {110, 112, 109}}, P},
		{[][]uint64{{300, 290, 310}, {400, 380, 410}, {350, 340, 360}}, P},
		{[][]uint64{{300, 290, 310}, {400, 100, 410, 420, 430, 440, 450}, {250, 240, 230, 220, 900}}, B},
		// Blocking's 900 leaves doubt that it beats whole chunks started
		// (8 of 12 pairs); pieces beat them beyond doubt.
		{[][]uint64{{300, 290, 310}, {400, 100, 410, 420, 430, 440, 450}, {250, 240, 900}}, P},
	} {
		explored := map[int]int{}
		for u := len(opening); u < len(opening)+64; u++ {
			if got := onebit.TuneWay(u, tc.times...); got != tc.best {
				explored[got]++
			}
		}
		want := map[int]int{(tc.best + 1) % 3: 2, (tc.best + 2) % 3: 2}
		assert.Equal(t, want, explored, "best %d: in every 32 calls, each other way once", tc.best)
	}
	// Ways not measured yet: the measured one.
	assert.Equal(t, P, onebit.TuneWay(44, []uint64{5}))
	assert.Equal(t, W, onebit.TuneWay(44, nil, []uint64{5}))
	assert.Equal(t, B, onebit.TuneWay(44, nil, nil, []uint64{5}))
}

// A tuning State switches between whole chunks and pieces from call to
// call (the opening always tries both), and its outputs and error buffers
// are bit for bit those of a State that always sends whole chunks.
func TestTuningBitIdentical(t *testing.T) {
	const w, n, steps = 4, 1<<14 + 3, 18
	run := func(tune bool) (out [][][]float32, pieces [][]int, worker, server [][]float32) {
		out, pieces = make([][][]float32, steps), make([][]int, w)
		for s := range out {
			out[s] = make([][]float32, w)
		}
		worker, server = make([][]float32, w), make([][]float32, w)
		require.NoError(t, local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
			r := c.Rank()
			st, err := onebit.NewState(n, w)
			if err != nil {
				return err
			}
			if tune {
				onebit.TunePieces(st, 3)
			} else {
				st.SetPieces(1)
			}
			rng := rand.New(rand.NewPCG(7, uint64(r)))
			for s := range steps {
				buf := randn(rng, n)
				if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
					return err
				}
				out[s][r] = buf
				pieces[r] = append(pieces[r], st.Pieces())
			}
			worker[r] = append([]float32(nil), st.WorkerError...)
			server[r] = append([]float32(nil), st.ServerError...)
			return nil
		}))
		return out, pieces, worker, server
	}
	want, _, wantW, wantS := run(false)
	got, pieces, gotW, gotS := run(true)
	for r := range w {
		assert.Equal(t, pieces[0], pieces[r], "rank %d's ways", r)
	}
	assert.Equal(t, []int{3, 3, 1, 1, 3, 1, 1, 3, 1, 1, 3, 1, 1, 3, 1, 1}, pieces[0][:16], "the opening")
	for s := range steps {
		for r := range w {
			require.Equal(t, bitsOf(want[s][r]), bitsOf(got[s][r]), "step %d rank %d", s, r)
		}
	}
	for r := range w {
		assert.Equal(t, bitsOf(wantW[r]), bitsOf(gotW[r]), "rank %d worker error", r)
		assert.Equal(t, bitsOf(wantS[r]), bitsOf(gotS[r]), "rank %d server error", r)
	}
}

// Ranks that cut the chunks differently (SetPieces not the same
// everywhere) get an error on every rank, not a hang or a wrong result.
func TestPiecesMismatch(t *testing.T) {
	const w, n = 3, 1 << 14
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		st, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		st.SetPieces(1 + c.Rank()%2)
		err = onebit.AllReduce(ctx, c, make([]float32, n), st)
		if assert.Error(t, err, "rank %d", c.Rank()) {
			assert.Contains(t, err.Error(), "pieces", "rank %d", c.Rank())
		}
		return nil
	})
	require.NoError(t, err)
}

// bitsOf is the bit patterns of x, so that comparisons are bit for bit.
func bitsOf(x []float32) []uint32 {
	b := make([]uint32, len(x))
	for i, v := range x {
		b[i] = math.Float32bits(v)
	}
	return b
}

// tuneTimes is a run's group time per call: way w takes mean[w] plus a
// uniform draw of width spread, and the opening's calls of whole chunks
// started (calls 2, 5, ...) take open more, as when something else ran
// then.
func tuneTimes(seed uint64, mean [3]uint64, spread, open uint64) func(u, way int) uint64 {
	rng := rand.New(rand.NewPCG(seed, 11))
	return func(u, way int) uint64 {
		x := mean[way] + rng.Uint64N(spread+1)
		if u < onebit.TuningCalls && way == onebit.WayWhole {
			x += open
		}
		return x
	}
}

// settledWays counts, over the calls from call from on, the calls that
// ran each way outside the exploring calls (two in every 32) and the
// rechecking ones (one in every 8).
func settledWays(ways []int, from int) map[int]int {
	n := map[int]int{}
	for u := from; u < len(ways); u++ {
		if (u-16)%32 < 30 && (u-16)%8 != 7 {
			n[ways[u]]++
		}
	}
	return n
}

// A way chosen from an opening whose times misled (whole chunks' calls
// disturbed, or the ways' times overlapping by chance) is confirmed
// against fresh times of whole chunks started before it runs for good:
// the wrong choice runs a few calls, not until the exploring calls have
// replaced whole chunks' samples (up to 160 calls).
func TestTuneConfirms(t *testing.T) {
	P, W, B := onebit.WayPieces, onebit.WayWhole, onebit.WayBlocking
	// The opening's whole-chunk calls ran slow; after it whole chunks are
	// the fastest.
	ways := onebit.TuneRun(200, tuneTimes(1, [3]uint64{300, 280, 320}, 10, 200))
	assert.Equal(t, []int{W, P, W, P, W, P, W, P, W, P, W, P}, ways[16:28], "the confirmation of pieces")
	n := settledWays(ways, 30)
	assert.Equal(t, 0, n[P]+n[B], "after it, whole chunks started: %v", n)

	// Pieces faster beyond doubt (a slow link: 101 against 104 ms) are
	// confirmed once and then run.
	ways = onebit.TuneRun(200, tuneTimes(2, [3]uint64{1010, 1040, 1100}, 10, 0))
	n = settledWays(ways, 30)
	assert.Equal(t, 0, n[W]+n[B], "pieces, confirmed: %v", n)
	assert.Equal(t, []int{W, P, W, P, W, P, W, P, W, P, W, P}, ways[16:28], "the confirmation of pieces")

	// The link changes: pieces were faster and confirmed, then whole
	// chunks become faster. Rechecking them one call in eight finds it
	// within 24 calls (the exploring calls alone took up to 64).
	slow := tuneTimes(3, [3]uint64{1010, 1040, 1100}, 10, 0)
	fast := tuneTimes(4, [3]uint64{300, 280, 320}, 10, 0)
	ways = onebit.TuneRun(200, func(u, w int) uint64 {
		if u < 60 {
			return slow(u, w)
		}
		return fast(u, w)
	})
	assert.Equal(t, 0, settledWays(ways[:60], 30)[W], "pieces before the change")
	n = settledWays(ways, 60+24)
	assert.Equal(t, 0, n[P]+n[B], "whole chunks 24 calls after the change: %v", n)

	// Whole chunks 7% faster than pieces, their times overlapping, the
	// opening's whole-chunk calls a little slower than later (30 or 60
	// more): over 100 runs, the calls after call 30 that ran another way
	// outside the exploring and rechecking calls. Without confirmations
	// 131 and 4533 of 17000 (pieces kept up to 160 calls); with them 7
	// and 0.
	for _, open := range []uint64{30, 60} {
		other := 0
		for seed := range uint64(100) {
			ways := onebit.TuneRun(200, tuneTimes(100+seed, [3]uint64{300, 280, 320}, 40, open))
			n := settledWays(ways, 30)
			other += n[P] + n[B]
		}
		assert.LessOrEqual(t, other, 100*170/100, "opening slower by %d: calls that ran another way than whole chunks started", open)
	}
}
