package onebit_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/conformance"
	"github.com/lowbit-ml/lowbit/onebit"
)

// runPieces runs steps calls on w ranks, each chunk cut into at most k
// pieces, and returns every rank's outputs and final error buffers.
func runPieces(t *testing.T, w, n, k, steps int) (out [][][]float32, worker, server [][]float32) {
	out = make([][][]float32, steps)
	for s := range out {
		out[s] = make([][]float32, w)
	}
	worker, server = make([][]float32, w), make([][]float32, w)
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		st, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		onebit.SetPieces(st, k)
		rng := rand.New(rand.NewPCG(uint64(n), uint64(r)))
		for s := range steps {
			buf := randn(rng, n)
			if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
				return err
			}
			out[s][r] = buf
		}
		worker[r] = append([]float32(nil), st.WorkerError...)
		server[r] = append([]float32(nil), st.ServerError...)
		return nil
	})
	require.NoError(t, err)
	return out, worker, server
}

// TestPipelineBitIdentical: cutting the chunks into pieces changes when
// bytes travel, not what is computed: outputs and both error buffers equal
// the unpipelined call's bit for bit, over several steps of error feedback.
func TestPipelineBitIdentical(t *testing.T) {
	for _, c := range []struct{ w, n int }{{2, 1 << 12}, {3, 5000}, {4, 1<<14 + 3}, {8, 1 << 13}} {
		want, wantW, wantS := runPieces(t, c.w, c.n, 1, 3)
		for _, k := range []int{2, 3, 7} {
			t.Run(fmt.Sprintf("w%d_n%d_k%d", c.w, c.n, k), func(t *testing.T) {
				st, _ := onebit.NewState(c.n, c.w)
				onebit.SetPieces(st, k)
				require.Greater(t, onebit.Pieces(st), 1)
				got, gotW, gotS := runPieces(t, c.w, c.n, k, 3)
				assert.Equal(t, want, got)
				assert.Equal(t, wantW, gotW)
				assert.Equal(t, wantS, gotS)
			})
		}
	}
}

// TestPipelineConformance runs the shipped onebit vectors with every chunk
// in as many pieces as it has bytes.
func TestPipelineConformance(t *testing.T) {
	cases, err := conformance.Load(conformance.Dir())
	require.NoError(t, err)
	ran := 0
	for _, v := range cases {
		if v.Kind != "onebit" || v.World < 2 {
			continue
		}
		ran++
		t.Run(v.Name, func(t *testing.T) {
			err := local.Run(ctxT(t), v.World, func(ctx context.Context, c comm.Comm) error {
				r := c.Rank()
				st, err := onebit.NewState(v.Numel, v.World)
				if err != nil {
					return err
				}
				onebit.SetPieces(st, 16)
				if onebit.Pieces(st) < 2 {
					return fmt.Errorf("not pipelined")
				}
				for s, step := range v.Steps {
					buf := conformance.Floats(step.Inputs[r])
					if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
						return err
					}
					if err := errors.Join(
						conformance.CompareFloats(fmt.Sprintf("step %d output", s), buf, step.Output),
						conformance.CompareFloats(fmt.Sprintf("step %d worker error", s), st.WorkerError, step.WorkerError[r]),
						conformance.CompareFloats(fmt.Sprintf("step %d server error", s), st.ServerError, step.ServerError[r]),
					); err != nil {
						return err
					}
				}
				return nil
			})
			require.NoError(t, err)
		})
	}
	require.NotZero(t, ran)
}

// TestPipelineCancel: ranks whose peer never comes end with the deadline's
// error, and no communicating goroutine is left behind.
func TestPipelineCancel(t *testing.T) {
	before := runtime.NumGoroutine()
	const w, n = 4, 1 << 14
	cs, err := local.New(w)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	var wg sync.WaitGroup
	for r := 0; r < w-1; r++ {
		wg.Go(func() {
			st, _ := onebit.NewState(n, w)
			onebit.SetPieces(st, 4)
			err := onebit.AllReduce(ctx, cs[r], make([]float32, n), st)
			assert.ErrorIs(t, err, context.DeadlineExceeded, "rank %d", r)
		})
	}
	wg.Wait()
	for deadline := time.Now().Add(5 * time.Second); runtime.NumGoroutine() > before; {
		require.False(t, time.Now().After(deadline), "goroutines left blocked")
		time.Sleep(10 * time.Millisecond)
	}
}

// TestPipelineAllocs: a pipelined call allocates nothing either.
func TestPipelineAllocs(t *testing.T) {
	const w, n = 2, 1 << 14
	cs, err := local.New(w)
	require.NoError(t, err)
	ctx := context.Background()
	states := make([]*onebit.State, w)
	bufs := make([][]float32, w)
	for r := range states {
		states[r], _ = onebit.NewState(n, w)
		onebit.SetPieces(states[r], 4)
		bufs[r] = randn(rand.New(rand.NewPCG(5, uint64(r))), n)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 101 {
			_ = onebit.AllReduce(ctx, cs[1], bufs[1], states[1])
		}
	}()
	allocs := testing.AllocsPerRun(100, func() { _ = onebit.AllReduce(ctx, cs[0], bufs[0], states[0]) })
	<-done
	assert.Zero(t, allocs)
}

// TestPipelineDefault: large tensors pipeline by default, small ones not.
func TestPipelineDefault(t *testing.T) {
	small, _ := onebit.NewState(1<<16, 4)
	assert.Equal(t, 1, onebit.Pieces(small))
	big, _ := onebit.NewState(16<<20, 4) // 64 MiB of float32
	assert.Equal(t, 4, onebit.Pieces(big))
	one, _ := onebit.NewState(16<<20, 1)
	assert.Equal(t, 1, onebit.Pieces(one))
}

// TestPipelineMismatchedSizes: in a pipelined call the header carries the
// length only, and still no tensor data moves before it is checked: ranks
// with different lengths get a MismatchError on every rank, whether both
// or only one of them pipelines, and no goroutine is left behind.
func TestPipelineMismatchedSizes(t *testing.T) {
	before := runtime.NumGoroutine()
	for _, sizes := range [][2]int{{1 << 14, 1<<14 + 8}, {1 << 14, 100}, {100, 1 << 15}} {
		err := local.Run(ctxT(t), 2, func(ctx context.Context, c comm.Comm) error {
			n := sizes[c.Rank()]
			st, err := onebit.NewState(n, 2)
			require.NoError(t, err)
			if n > 100 {
				onebit.SetPieces(st, 4) // the 100-element rank stays unpipelined
			}
			require.Equal(t, n > 100, onebit.Pieces(st) > 1)
			err = onebit.AllReduce(ctx, c, make([]float32, n), st)
			var me *comm.MismatchError
			require.ErrorAs(t, err, &me, "rank %d sizes %v", c.Rank(), sizes)
			assert.Equal(t, sizes[1], me.Got)
			assert.Equal(t, sizes[0], me.Want)
			// The communicator is usable again: a matching call goes through.
			m := sizes[0]
			st2, err := onebit.NewState(m, 2)
			require.NoError(t, err)
			onebit.SetPieces(st2, 4)
			return onebit.AllReduce(ctx, c, make([]float32, m), st2)
		})
		require.NoError(t, err)
	}
	for deadline := time.Now().Add(5 * time.Second); runtime.NumGoroutine() > before; {
		require.False(t, time.Now().After(deadline), "goroutines left blocked")
		time.Sleep(10 * time.Millisecond)
	}
}
