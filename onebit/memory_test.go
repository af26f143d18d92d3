package onebit_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/costmodel"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

// memShapes is the model of the memory table: 1,048,576 parameters in
// four tensors.
var memShapes = [][]int{{600, 1000}, {300, 1000}, {100, 1000}, {48576}}

// memOptimizer is one row of the memory table: how to build it and how
// many steps cover its warm-up and its compression stage.
type memOptimizer struct {
	name  string // costmodel's name
	steps int
	build func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)
}

var memOptimizers = []memOptimizer{
	{costmodel.OptAdam, 3, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewAdam(ctx, c, ps, optim.DefaultAdamConfig())
	}},
	{costmodel.OptLamb, 3, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewLamb(ctx, c, ps, optim.DefaultLambConfig())
	}},
	{costmodel.OptZeroAdam, 3, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return zero.NewAdam(ctx, c, ps, zero.DefaultConfig())
	}},
	// The qgZ int8 reduce-scatter: its codes and work buffers.
	{costmodel.OptZeroAdam + "/int8", 3, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := zero.DefaultConfig()
		cfg.ReduceScatter = zero.ReduceInt8
		return zero.NewAdam(ctx, c, ps, cfg)
	}},
	{costmodel.OptOnebitAdam, 6, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.FreezeStep = 2
		return onebit.NewAdam(ctx, c, ps, cfg)
	}},
	// Its fp16 gradient averaging allocates on the first warm-up step.
	{costmodel.OptOnebitAdam + "/fp16", 6, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.FreezeStep = 2
		cfg.Reduce = optim.ReduceFP16
		return onebit.NewAdam(ctx, c, ps, cfg)
	}},
	{costmodel.OptOnebitLamb, 6, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultLambConfig()
		cfg.FreezeStep = 2
		return onebit.NewLamb(ctx, c, ps, cfg)
	}},
	{costmodel.OptZeroOneAdam, 6, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultZeroOneAdamConfig()
		cfg.VarFreezeStep = 2
		return onebit.NewZeroOneAdam(ctx, c, ps, cfg)
	}},
}

// memRow is what measureMemory finds, in bytes per parameter per rank.
type memRow struct {
	state0               int64   // rank 0's StateBytes at its peak
	first                float64 // StateBytes after construction, mean over the ranks
	peak, steady         float64 // StateBytes, mean over the ranks
	heapPeak, heapSteady float64 // the process heap's, divided by the ranks
}

// heapNow is the live heap after a collection.
func heapNow() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// measureMemory runs o on w ranks of comm/local, all in this process, and
// measures its state after construction and after every step: StateBytes,
// and the growth of the live heap since just before construction (the
// parameters, gradients and group made), divided by w.
func measureMemory(t *testing.T, o memOptimizer, w int) memRow {
	t.Helper()
	ctx := adamCtx(t)
	cs, err := local.New(w)
	require.NoError(t, err)
	params := make([][]*optim.Param, w)
	n := 0
	for r := range params {
		for i, s := range memShapes {
			params[r] = append(params[r], optim.NewParam(fmt.Sprintf("p%d", i), s...))
		}
	}
	for _, s := range memShapes[:] {
		k := 1
		for _, d := range s {
			k *= d
		}
		n += k
	}
	opts := make([]optim.Optimizer, w)
	// each runs fn on every rank at once, as the ranks of a group do.
	each := func(fn func(r int) error) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make([]error, w)
		for r := range w {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[r] = fn(r)
			}()
		}
		wg.Wait()
		for _, err := range errs {
			require.NoError(t, err)
		}
	}
	// comm/local sizes its AllReduce scratch to the longest call so far
	// (the group's, not an optimizer's): grow it to the largest tensor
	// first. Each rank's slot keeps the buffers of its last collective: a
	// tiny one lets go of the larger.
	largest := 0
	for _, p := range params[0] {
		largest = max(largest, p.Numel())
	}
	each(func(r int) error { return cs[r].AllReduce(ctx, make([]float32, largest), comm.Sum) })
	each(func(r int) error { return cs[r].AllReduce(ctx, make([]float32, 1), comm.Sum) })
	base := heapNow()
	each(func(r int) error {
		var err error
		opts[r], err = o.build(ctx, cs[r], params[r])
		return err
	})
	var row memRow
	var heaps []int64
	sum := func() int64 {
		var s int64
		for _, op := range opts {
			s += op.(optim.MemoryReporter).StateBytes()
		}
		return s
	}
	peak := sum()
	row.first = float64(peak) / (float64(w) * float64(n))
	row.state0 = opts[0].(optim.MemoryReporter).StateBytes()
	heaps = append(heaps, heapNow())
	for step := range o.steps {
		each(func(r int) error {
			for i, p := range params[r] {
				g := p.GradData()
				for j := range g {
					g[j] = float32((j*7+i*13+r*29+step*31)%97-48) * 1e-3
				}
			}
			return opts[r].Step(ctx)
		})
		peak = max(peak, sum())
		row.state0 = max(row.state0, opts[0].(optim.MemoryReporter).StateBytes())
		heaps = append(heaps, heapNow())
	}
	steady := sum()
	each(func(r int) error { return opts[r].Close() })
	per := float64(w) * float64(n)
	row.peak, row.steady = float64(peak)/per, float64(steady)/per
	row.heapSteady = float64(heaps[len(heaps)-1]-base) / per
	for _, h := range heaps {
		row.heapPeak = max(row.heapPeak, float64(h-base)/per)
	}
	return row
}

// TestStateBytes measures every optimizer's state on 2, 4 and 8 ranks,
// checks StateBytes against the process heap and against costmodel's
// formulas, and checks the figures known in advance.
func TestStateBytes(t *testing.T) {
	if testing.Short() {
		t.Skip("runs every optimizer on a model of 1M parameters")
	}
	var tensors []int64
	n := 0
	for _, s := range memShapes {
		k := 1
		for _, d := range s {
			k *= d
		}
		tensors = append(tensors, int64(k))
		n += k
	}
	require.Equal(t, optim.DefaultBucketBytes, costmodel.DefaultBucketBytes)
	t.Logf("bytes per parameter per rank, %d parameters in %d tensors, default buckets", n, len(memShapes))
	t.Logf("%-18s %2s %8s %8s %8s %10s %11s", "optimizer", "W", "built", "peak", "steady", "heap peak", "heap steady")
	for _, w := range []int{2, 4, 8} {
		for _, o := range memOptimizers {
			row := measureMemory(t, o, w)
			t.Logf("%-18s %2d %8.3f %8.3f %8.3f %10.3f %11.3f", o.name, w, row.first, row.peak, row.steady, row.heapPeak, row.heapSteady)
			// The heap holds what StateBytes counts, to 1% and 0.05
			// bytes per parameter (small allocations, the runtime's
			// rounding of large ones).
			assert.InDelta(t, row.peak, row.heapPeak, 0.01*row.peak+0.05, "%s on %d ranks: peak", o.name, w)
			assert.InDelta(t, row.steady, row.heapSteady, 0.01*row.steady+0.05, "%s on %d ranks: steady", o.name, w)
			base, variant, _ := strings.Cut(o.name, "/")
			want, err := costmodel.StateBytes(base, tensors, w, 0)
			require.NoError(t, err)
			switch o.name {
			case costmodel.OptZeroAdam + "/int8":
				assert.Greater(t, row.state0, want, "qgZ's codes and residuals")
			case costmodel.OptOnebitAdam + "/fp16":
				// The flat float32 gradient and the fp16 wire buffers
				// (2N sent and received, C and N gathered, a sum block).
				assert.Greater(t, row.state0, want+4*int64(n))
				assert.Greater(t, row.peak, row.first)
			default:
				require.Empty(t, variant)
				assert.Equal(t, want, row.state0, "%s on %d ranks: costmodel.StateBytes against rank 0's StateBytes", o.name, w)
			}
			switch o.name {
			case costmodel.OptAdam:
				assert.InDelta(t, 8, row.peak, 1e-9, "exact Adam: m and v")
			case costmodel.OptOnebitAdam:
				// m, v, worker error, server error; then the server
				// accumulator, the packed signs and messages.
				lo := 12 + 4/float64(w)
				assert.GreaterOrEqual(t, row.peak, lo)
				assert.LessOrEqual(t, row.peak, lo+4/float64(w)+0.5)
			}
		}
	}
}

// A State large enough to be pipelined (its pieces' buffers) and one of an
// odd length (padding) hold what costmodel counts for them.
func TestStateBytesOfState(t *testing.T) {
	for _, w := range []int{2, 3, 4, 8} {
		for _, numel := range []int{1, 12345, 1<<22 + 12345} {
			st, err := onebit.NewState(numel, w)
			require.NoError(t, err)
			// 1-bit LAMB's state is 16 bytes per element and one State.
			want, err := costmodel.StateBytes(costmodel.OptOnebitLamb, []int64{int64(numel)}, w, 0)
			require.NoError(t, err)
			assert.Equal(t, want-16*int64(numel), st.StateBytes(), "%d elements on %d ranks", numel, w)
		}
	}
}
