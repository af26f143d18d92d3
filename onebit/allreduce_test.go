package onebit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
)

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func randn(rng *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	return x
}

func TestPaddedLen(t *testing.T) {
	// The spec's table of multiples.
	for w, m := range map[int]int{1: 8, 2: 16, 3: 72, 4: 32, 8: 64, 16: 256} {
		assert.Equal(t, m, onebit.PaddedLen(1, w), "w=%d", w)
		assert.Equal(t, m, onebit.PaddedLen(m, w), "w=%d", w)
		assert.Equal(t, 2*m, onebit.PaddedLen(m+1, w), "w=%d", w)
	}
	assert.Equal(t, 0, onebit.PaddedLen(0, 4))
}

// trace runs steps calls of the compressed allreduce on w ranks with random
// inputs and returns, per step, every rank's input and output and every
// rank's error buffers after the step.
type stepRecord struct {
	in, out     [][]float32
	worker, srv [][]float32
}

func trace(t *testing.T, w, n, steps int, seed uint64) []stepRecord {
	recs := make([]stepRecord, steps)
	for k := range recs {
		recs[k] = stepRecord{
			in: make([][]float32, w), out: make([][]float32, w),
			worker: make([][]float32, w), srv: make([][]float32, w),
		}
	}
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		rng := rand.New(rand.NewPCG(seed, uint64(r)))
		st, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		for k := 0; k < steps; k++ {
			in := randn(rng, n)
			buf := append([]float32(nil), in...)
			if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
				return err
			}
			recs[k].in[r] = in
			recs[k].out[r] = buf
			recs[k].worker[r] = append([]float32(nil), st.WorkerError...)
			recs[k].srv[r] = append([]float32(nil), st.ServerError...)
		}
		return nil
	})
	require.NoError(t, err)
	return recs
}

// TestTelescoping checks, per element and per step, that
//
//	output + mean_r(worker_error_r) + server_error = mean_r(input_r) + previous errors
//
// and therefore, summed over all steps, that the outputs plus the final
// errors equal the sum of the inputs: error feedback loses nothing.
func TestTelescoping(t *testing.T) {
	for _, w := range []int{1, 2, 3, 4, 5, 8} {
		for _, n := range []int{1, 3, 7, 8, 65, 1000, 4099} {
			recs := trace(t, w, n, 12, uint64(w*10000+n))
			N := onebit.PaddedLen(n, w)
			C := N / w
			prev := make([]float64, N) // mean worker error + server error before the step
			sumIn := make([]float64, N)
			sumOut := make([]float64, N)
			for k, rec := range recs {
				for r := 1; r < w; r++ {
					require.Equal(t, rec.out[0], rec.out[r], "w=%d n=%d step %d: rank %d output differs", w, n, k, r)
				}
				// Pad lanes carry errors too, but their output is dropped:
				// the identity is checked on the n real elements.
				for i := 0; i < n; i++ {
					var in, we float64
					for r := 0; r < w; r++ {
						in += float64(rec.in[r][i])
						we += float64(rec.worker[r][i])
					}
					in /= float64(w)
					we /= float64(w)
					se := float64(rec.srv[i/C][i%C])
					out := float64(rec.out[0][i])
					lhs := out + we + se
					rhs := in + prev[i]
					require.InDelta(t, rhs, lhs, 1e-5*math.Max(1, math.Abs(rhs)),
						"w=%d n=%d step %d element %d", w, n, k, i)
					prev[i] = we + se
					sumIn[i] += in
					sumOut[i] += out
				}
			}
			for i := 0; i < n; i++ {
				require.InDelta(t, sumIn[i], sumOut[i]+prev[i], 1e-4*math.Max(1, math.Abs(sumIn[i])),
					"w=%d n=%d element %d: outputs + final errors != inputs", w, n, i)
			}
		}
	}
}

// TestConvergesToMean: with a constant input, the running average of the
// outputs approaches the exact mean at rate 1/steps, as error feedback
// promises.
func TestConvergesToMean(t *testing.T) {
	const w, n, steps = 4, 257, 400
	rng := rand.New(rand.NewPCG(1, 2))
	inputs := make([][]float32, w)
	mean := make([]float64, n)
	for r := range inputs {
		inputs[r] = randn(rng, n)
		for i, v := range inputs[r] {
			mean[i] += float64(v) / w
		}
	}
	avg := make([]float64, n)
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		st, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		buf := make([]float32, n)
		for k := 0; k < steps; k++ {
			copy(buf, inputs[c.Rank()])
			if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
				return err
			}
			if c.Rank() == 0 {
				for i, v := range buf {
					avg[i] += float64(v) / steps
				}
			}
		}
		return nil
	})
	require.NoError(t, err)
	var num, den float64
	for i := range mean {
		num += (avg[i] - mean[i]) * (avg[i] - mean[i])
		den += mean[i] * mean[i]
	}
	assert.Less(t, math.Sqrt(num/den), 0.05, "relative error of the averaged output")
}

func TestEmpty(t *testing.T) {
	err := local.Run(ctxT(t), 3, func(ctx context.Context, c comm.Comm) error {
		st, err := onebit.NewState(0, 3)
		require.NoError(t, err)
		before := c.Stats()
		require.NoError(t, onebit.AllReduce(ctx, c, nil, st))
		// An empty tensor sends its header only (8 bytes to each of the 2
		// peers), so that a rank with a non-empty one is told.
		d := c.Stats().Sub(before)
		assert.Equal(t, comm.Traffic{Calls: 1, BytesSent: 16, BytesRecv: 16}, d.PerCollective[comm.CAllGather])
		assert.Equal(t, int64(1), d.Total().Calls, "the header is the only collective")
		assert.Empty(t, st.WorkerError)
		assert.Empty(t, st.ServerError)
		return nil
	})
	require.NoError(t, err)
}

// TestStateMismatch: a rank whose state does not fit its call (or is nil)
// refuses it on every rank: it returns its own error, and the others, which
// called correctly, return one naming it instead of waiting for it.
func TestStateMismatch(t *testing.T) {
	cases := map[string]struct {
		make func() (*onebit.State, []float32)
		want string
	}{
		"length": {func() (*onebit.State, []float32) { return mustState(t, 10, 2), make([]float32, 11) }, "state made for 10"},
		"world":  {func() (*onebit.State, []float32) { return mustState(t, 10, 4), make([]float32, 10) }, "on 4 ranks"},
		"nil":    {func() (*onebit.State, []float32) { return nil, make([]float32, 10) }, "nil state"},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			err := local.Run(ctxT(t), 2, func(ctx context.Context, c comm.Comm) error {
				st, buf := mustState(t, 10, 2), make([]float32, 10)
				if c.Rank() == 0 {
					st, buf = tc.make()
				}
				err := onebit.AllReduce(ctx, c, buf, st)
				if c.Rank() == 0 {
					assert.ErrorContains(t, err, tc.want)
				} else {
					assert.ErrorContains(t, err, "rank 0 refused the call")
				}
				assert.NotErrorIs(t, err, comm.ErrAborted)
				return nil
			})
			require.NoError(t, err)
		})
	}
	_, err := onebit.NewState(-1, 2)
	assert.Error(t, err)
	assert.ErrorContains(t, onebit.AllReduce(context.Background(), nil, nil, nil), "nil communicator")
}

// TestEmptyAmongNonEmpty: a rank with an empty tensor among ranks with
// non-empty ones is an error on every rank (it still sends the header); an
// empty tensor on every rank is fine.
func TestEmptyAmongNonEmpty(t *testing.T) {
	for _, sizes := range [][2]int{{0, 5}, {5, 0}, {0, 0}} {
		err := local.Run(ctxT(t), 2, func(ctx context.Context, c comm.Comm) error {
			n := sizes[c.Rank()]
			st := mustState(t, n, 2)
			err := onebit.AllReduce(ctx, c, make([]float32, n), st)
			if sizes[0] == sizes[1] {
				require.NoError(t, err)
				return nil
			}
			var me *comm.MismatchError
			assert.ErrorAs(t, err, &me, "rank %d sizes %v", c.Rank(), sizes)
			return nil
		})
		require.NoError(t, err)
	}
}

func mustState(t *testing.T, n, w int) *onebit.State {
	st, err := onebit.NewState(n, w)
	require.NoError(t, err)
	return st
}

// TestMismatchedSizes: ranks whose tensors differ get an error on every
// rank, also when the lengths pad to the same N.
func TestMismatchedSizes(t *testing.T) {
	for _, sizes := range [][2]int{{5, 6}, {5, 100}} {
		err := local.Run(ctxT(t), 2, func(ctx context.Context, c comm.Comm) error {
			n := sizes[c.Rank()]
			st, err := onebit.NewState(n, 2)
			require.NoError(t, err)
			err = onebit.AllReduce(ctx, c, make([]float32, n), st)
			var me *comm.MismatchError
			require.ErrorAs(t, err, &me, "rank %d sizes %v", c.Rank(), sizes)
			assert.Equal(t, sizes[1], me.Got)
			assert.Equal(t, sizes[0], me.Want)
			return nil
		})
		require.NoError(t, err)
	}
}

// TestCancel: a rank that never joins leaves the others waiting until their
// deadline; they all fail with the deadline error and no goroutine stays.
func TestCancel(t *testing.T) {
	before := runtime.NumGoroutine()
	const w = 4
	cs, err := local.New(w)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	var wg sync.WaitGroup
	for r := 0; r < w-1; r++ {
		wg.Go(func() {
			st, _ := onebit.NewState(1000, w)
			err := onebit.AllReduce(ctx, cs[r], make([]float32, 1000), st)
			assert.ErrorIs(t, err, context.DeadlineExceeded, "rank %d", r)
		})
	}
	wg.Wait()
	for deadline := time.Now().Add(5 * time.Second); runtime.NumGoroutine() > before; {
		require.False(t, time.Now().After(deadline), "goroutines left blocked")
		time.Sleep(10 * time.Millisecond)
	}
}

// TestTraffic: each rank sends 2(W-1)/W * N/8 bytes plus the scales, at
// least 30 times less than a float32 ring allreduce of the same buffer.
func TestTraffic(t *testing.T) {
	const w, n = 4, 1 << 20
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		st, err := onebit.NewState(n, w)
		require.NoError(t, err)
		buf := make([]float32, n)
		require.NoError(t, onebit.AllReduce(ctx, c, buf, st))
		sent := c.Stats().Total().BytesSent
		N := int64(onebit.PaddedLen(n, w))
		assert.Equal(t, 2*int64(w-1)*N/8/w+int64(w-1)*(12+4), sent)
		ring := comm.RingAllReduceBytes(4*n, w)
		assert.GreaterOrEqual(t, float64(ring)/float64(sent), 30.0)
		return nil
	})
	require.NoError(t, err)
}

func TestAllocs(t *testing.T) {
	const w, n = 2, 4096
	cs, err := local.New(w)
	require.NoError(t, err)
	ctx := context.Background()
	states := make([]*onebit.State, w)
	bufs := make([][]float32, w)
	for r := range states {
		states[r], _ = onebit.NewState(n, w)
		bufs[r] = randn(rand.New(rand.NewPCG(3, uint64(r))), n)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 101; i++ {
			_ = onebit.AllReduce(ctx, cs[1], bufs[1], states[1])
		}
	}()
	allocs := testing.AllocsPerRun(100, func() { _ = onebit.AllReduce(ctx, cs[0], bufs[0], states[0]) })
	<-done
	assert.Zero(t, allocs)
}
