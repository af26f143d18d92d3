package onebit_test

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
)

// span is one phase a recorder saw.
type span struct {
	ph         onebit.Phase
	piece      int
	start, end time.Time
}

// recorder is a Tracer that keeps every span.
type recorder struct {
	mu    sync.Mutex
	spans []span
}

func (r *recorder) Span(ph onebit.Phase, piece int, start, end time.Time) {
	r.mu.Lock()
	r.spans = append(r.spans, span{ph, piece, start, end})
	r.mu.Unlock()
}

// tracedRun makes calls AllReduce calls on w ranks, on n elements in at
// most pieces pieces, with the same random inputs, with or without a
// recorder per rank; it returns every rank's outputs and error buffers
// after the last call, and the recorders.
func tracedRun(t *testing.T, w, n, pieces, calls int, traced bool) (out [][]float32, recs []*recorder) {
	out = make([][]float32, 3*w)
	recs = make([]*recorder, w)
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		st, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		onebit.SetPieces(st, pieces)
		if traced {
			recs[r] = &recorder{}
			st.SetTracer(recs[r])
		}
		rng := rand.New(rand.NewPCG(uint64(r), 7))
		buf := make([]float32, n)
		for range calls {
			copy(buf, randn(rng, n))
			if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
				return err
			}
		}
		out[r] = buf
		out[w+r] = slices.Clone(st.WorkerError)
		out[2*w+r] = slices.Clone(st.ServerError)
		return nil
	})
	require.NoError(t, err)
	return out, recs
}

// Tracing changes nothing: outputs and error buffers are bit-identical,
// pipelined or not.
func TestTraceBitIdentical(t *testing.T) {
	for _, w := range []int{2, 3, 4} {
		for _, pieces := range []int{1, 4} {
			plain, _ := tracedRun(t, w, 1000*w, pieces, 3, false)
			traced, _ := tracedRun(t, w, 1000*w, pieces, 3, true)
			for i := range plain {
				assert.Equal(t, plain[i], traced[i], "w=%d pieces=%d buffer %d", w, pieces, i)
			}
		}
	}
}

// Not pipelined, on a communicator that runs its collectives blocking, a
// call reports its phases once each, in order, one after the other, but
// the output twice (the rank's own chunk, then the others').
func TestTracePhasesInOrder(t *testing.T) {
	want := []onebit.Phase{onebit.PhaseHeader, onebit.PhaseCompress, onebit.PhaseAllToAll, onebit.PhaseWorkerError,
		onebit.PhaseServerReduce, onebit.PhaseAllGather, onebit.PhaseServerCompress, onebit.PhaseDecompress,
		onebit.PhaseDecompress}
	for _, w := range []int{2, 3, 4} {
		_, recs := tracedRun(t, w, 100*w, 1, 2, true)
		for r, rec := range recs {
			require.Len(t, rec.spans, 2*len(want), "w=%d rank %d", w, r)
			for i, s := range rec.spans {
				assert.Equal(t, want[i%len(want)], s.ph, "w=%d rank %d span %d", w, r, i)
				assert.Zero(t, s.piece, "w=%d rank %d span %d", w, r, i)
				assert.False(t, s.end.Before(s.start), "w=%d rank %d span %d", w, r, i)
				if i > 0 {
					assert.False(t, s.start.Before(rec.spans[i-1].end), "w=%d rank %d span %d overlaps the one before", w, r, i)
				}
			}
		}
	}
}

// Pipelined, every piece goes through its phases in order: packed, sent,
// summed (its signs packed again), gathered, unpacked; step 3 and step 8
// are passes over the whole tensor (piece -1), step 8 once the server has
// summed every piece, and so is the output of the rank's own chunk.
func TestTracePipelinedPieces(t *testing.T) {
	const pieces = 4
	chain := []onebit.Phase{onebit.PhaseCompress, onebit.PhaseAllToAll, onebit.PhaseServerReduce,
		onebit.PhaseAllGather, onebit.PhaseDecompress}
	for _, w := range []int{2, 4} {
		_, recs := tracedRun(t, w, 1000*w, pieces, 1, true)
		for r, rec := range recs {
			byPhase := map[onebit.Phase][]span{}
			whole := map[onebit.Phase][]span{}
			for _, s := range rec.spans {
				if s.piece < 0 {
					whole[s.ph] = append(whole[s.ph], s)
					continue
				}
				byPhase[s.ph] = append(byPhase[s.ph], s)
			}
			require.Len(t, byPhase[onebit.PhaseHeader], 1, "w=%d rank %d", w, r)
			require.NotEmpty(t, whole[onebit.PhaseWorkerError], "w=%d rank %d", w, r)
			require.Len(t, whole[onebit.PhaseServerCompress], 1, "w=%d rank %d", w, r)
			require.Len(t, whole[onebit.PhaseDecompress], 1, "w=%d rank %d: the own chunk", w, r)
			assert.NotEmpty(t, whole[onebit.PhaseWait], "w=%d rank %d", w, r)
			for _, ph := range chain {
				require.Len(t, byPhase[ph], pieces, "w=%d rank %d %s", w, r, ph)
				for p, s := range byPhase[ph] {
					assert.Equal(t, p, s.piece, "w=%d rank %d %s", w, r, ph)
				}
			}
			for p := range pieces {
				for i := 1; i < len(chain); i++ {
					prev, next := byPhase[chain[i-1]][p], byPhase[chain[i]][p]
					assert.False(t, next.end.Before(prev.end), "w=%d rank %d piece %d: %s ends before %s",
						w, r, p, chain[i], chain[i-1])
				}
				assert.False(t, whole[onebit.PhaseServerCompress][0].start.Before(byPhase[onebit.PhaseServerReduce][p].end),
					"w=%d rank %d: step 8 starts before piece %d is summed", w, r, p)
			}
		}
	}
}

// nopTracer records nothing.
type nopTracer struct{}

func (nopTracer) Span(onebit.Phase, int, time.Time, time.Time) {}

// Tracing off, a call allocates nothing, pipelined or not (measured over
// both ranks' goroutines); on, with a tracer that allocates nothing,
// neither does the hook.
func TestTraceAllocatesNothing(t *testing.T) {
	const n, runs = 4096, 20
	ctx := ctxT(t)
	for _, pieces := range []int{1, 4} {
		for _, tr := range []onebit.Tracer{nil, nopTracer{}} {
			cs, err := local.New(2)
			require.NoError(t, err)
			sts := make([]*onebit.State, 2)
			bufs := make([][]float32, 2)
			for r := range sts {
				sts[r], err = onebit.NewState(n, 2)
				require.NoError(t, err)
				onebit.SetPieces(sts[r], pieces)
				require.Equal(t, pieces, onebit.Pieces(sts[r]))
				sts[r].SetTracer(tr)
				bufs[r] = randn(rand.New(rand.NewPCG(uint64(r), 2)), n)
			}
			call := func(r int) error { return onebit.AllReduce(ctx, cs[r], bufs[r], sts[r]) }
			// A first call on both ranks, then rank 1 keeps pace with
			// AllocsPerRun's calls on rank 0 (one extra warm-up call).
			var wg sync.WaitGroup
			wg.Go(func() { assert.NoError(t, call(1)) })
			require.NoError(t, call(0))
			wg.Wait()
			wg.Go(func() {
				for range runs + 1 {
					if err := call(1); err != nil {
						t.Error(err)
						return
					}
				}
			})
			allocs := testing.AllocsPerRun(runs, func() {
				if err := call(0); err != nil {
					t.Error(err)
				}
			})
			wg.Wait()
			assert.Zero(t, allocs, "pieces=%d tracer %T", pieces, tr)
		}
	}
}

func TestPhaseString(t *testing.T) {
	assert.Equal(t, "all-to-all", onebit.PhaseAllToAll.String())
	assert.Equal(t, "wait", onebit.PhaseWait.String())
	assert.Equal(t, "phase?", onebit.Phase(onebit.NumPhases).String())
	assert.True(t, onebit.PhaseAllGather.Collective())
	assert.False(t, onebit.PhaseDecompress.Collective())
}
