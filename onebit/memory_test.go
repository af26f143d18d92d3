package onebit_test

import (
	"context"
	"fmt"
	"math"
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
	{costmodel.OptOnebitAdam, 6, memAdam(onebit.StateFull, 0, optim.ReduceFP32)},
	// Its fp16 gradient averaging allocates on the first warm-up step.
	{costmodel.OptOnebitAdam + "/fp16", 6, memAdam(onebit.StateFull, 0, optim.ReduceFP16)},
	// Its moments sharded: everything allocated at construction, on one
	// rank as StateFull.
	{costmodel.OptOnebitAdamSharded, 6, memAdam(onebit.StateSharded, 0, optim.ReduceFP32)},
	// StateFull's steps with m kept in the packed signs gathered (and,
	// in the warm-up, in the worker error buffers): everything allocated
	// at construction, on one rank as StateFull.
	{costmodel.OptOnebitAdamCompact, 6, memAdam(onebit.StateCompact, 0, optim.ReduceFP32)},
	// Sharded with the worker errors and the frozen v in bfloat16: two
	// layouts, the warm-up's (v float32, no worker errors) from
	// construction, the compression stage's from the freezing step on.
	{costmodel.OptOnebitAdamShardedBF16, 6, memAdam(onebit.StateSharded, onebit.BF16WorkerError|onebit.BF16Variance, optim.ReduceFP32)},
	{costmodel.OptOnebitLamb, 6, memLamb(onebit.StateFull)},
	// StateFull's steps with m and m_last kept packed (m in the gathered
	// signs, m_last in a copy of them; in the warm-up m in v_fresh's
	// buffer and the update in the worker error buffer) and no scratch:
	// everything allocated at construction, on one rank as StateFull.
	{costmodel.OptOnebitLambCompact, 6, memLamb(onebit.StateCompact)},
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
	// The ranks' StateBytes summed after construction, then after every
	// step; and the stage every step ran in (none for an optimizer
	// without stages).
	sums   []int64
	stages []optim.Stage
	// Rank 0's StateBytes after construction, then after every step, and
	// the stage it was in then (none for an optimizer without stages).
	rank0 []int64
	after []optim.Stage
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
	row.sums = append(row.sums, peak)
	row.first = float64(peak) / (float64(w) * float64(n))
	row.state0 = opts[0].(optim.MemoryReporter).StateBytes()
	// now records rank 0's StateBytes and stage.
	now := func() {
		row.rank0 = append(row.rank0, opts[0].(optim.MemoryReporter).StateBytes())
		if sg, ok := opts[0].(interface{ Stage() optim.Stage }); ok {
			row.after = append(row.after, sg.Stage())
		}
	}
	now()
	heaps = append(heaps, heapNow())
	for step := range o.steps {
		if sg, ok := opts[0].(interface{ Stage() optim.Stage }); ok {
			row.stages = append(row.stages, sg.Stage())
		}
		each(func(r int) error {
			for i, p := range params[r] {
				g := p.GradData()
				for j := range g {
					g[j] = float32((j*7+i*13+r*29+step*31)%97-48) * 1e-3
				}
			}
			return opts[r].Step(ctx)
		})
		row.sums = append(row.sums, sum())
		peak = max(peak, row.sums[len(row.sums)-1])
		row.state0 = max(row.state0, opts[0].(optim.MemoryReporter).StateBytes())
		now()
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
	if raceOn {
		// 76 s of the race pass on 2 cores; it counts bytes, and the
		// concurrency of the steps it runs is the race tests' elsewhere.
		t.Skip("counts memory: run without the race detector")
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
	t.Logf("%-24s %2s %8s %8s %8s %10s %11s", "optimizer", "W", "built", "peak", "steady", "heap peak", "heap steady")
	worlds := []int{2, 4, 8}
	peaks := map[string][]float64{} // docs/measured.md's "Optimizer state per rank": peak per optimizer and world
	defer func() {
		t.Logf("peak bytes per parameter per rank (docs/measured.md, Optimizer state per rank):")
		t.Logf("%-24s %6s %6s %6s", "optimizer", "W = 2", "W = 4", "W = 8")
		for _, o := range memOptimizers {
			if p := peaks[o.name]; len(p) == len(worlds) {
				t.Logf("%-24s %6.2f %6.2f %6.2f", o.name, p[0], p[1], p[2])
			}
		}
	}()
	for _, w := range worlds {
		state0 := map[string]int64{} // rank 0's peak StateBytes on w ranks, by name
		for _, o := range memOptimizers {
			row := measureMemory(t, o, w)
			state0[o.name] = row.state0
			peaks[o.name] = append(peaks[o.name], row.peak)
			t.Logf("%-24s %2d %8.3f %8.3f %8.3f %10.3f %11.3f", o.name, w, row.first, row.peak, row.steady, row.heapPeak, row.heapSteady)
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
			case costmodel.OptOnebitLambCompact:
				// StateFull's StateBytes less m and the scratch buffer
				// (8 bytes per parameter), plus the packed copy of
				// m_last (the gathered messages and their scales) and
				// two unpacking blocks of 4Ki floats; costmodel's to
				// the byte.
				full, ok := state0[costmodel.OptOnebitLamb]
				require.True(t, ok, "StateFull measured first")
				c := int64(onebit.PaddedLen(n, w) / w)
				extra := int64(w)*(4+c/8) + 4*int64(w) + 2*4*4096
				assert.Equal(t, 8*int64(n)-extra, full-row.state0, "%s on %d ranks: StateFull's StateBytes against StateCompact's", o.name, w)
				assert.Equal(t, want, row.state0, "%s on %d ranks: costmodel.StateBytes against rank 0's StateBytes", o.name, w)
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
			case costmodel.OptOnebitAdamSharded:
				// Worker error 4, m, v and the update error of the own
				// chunk 12/W; then the packed signs sent (N/8) and
				// received (N/8 + 4W), the summing block: below exact
				// Adam's 8 from 4 ranks on (4 + 12/W is 10 on 2).
				lo := 4 + 12/float64(w)
				assert.GreaterOrEqual(t, row.peak, lo)
				assert.LessOrEqual(t, row.peak, lo+0.5)
				if w >= 4 {
					assert.Less(t, row.peak, 8.0)
				}
				// Everything is allocated at construction: the state
				// after it is the state after every warm-up and every
				// compression step, so its figure is the peak of the
				// whole run.
				require.Contains(t, row.stages, optim.StageWarmup)
				require.Contains(t, row.stages, optim.StageCompression)
				for i, s := range row.sums[1:] {
					assert.Equal(t, row.sums[0], s, "%s on %d ranks: StateBytes after step %d (%s) against after construction", o.name, w, i+1, row.stages[i])
				}
			case costmodel.OptOnebitAdamCompact:
				// StateFull's buffers but its float32 m: v, worker error
				// (the warm-up's m in it), server error 4/W; then the
				// same packed signs (the compression stage's m in the
				// gathered ones), blocks and pieces.
				full, ok := state0[costmodel.OptOnebitAdam]
				require.True(t, ok, "StateFull measured first")
				assert.Equal(t, 4*int64(n), full-row.state0, "%s on %d ranks: StateFull's StateBytes less the float32 m", o.name, w)
				lo := 8 + 4/float64(w)
				assert.GreaterOrEqual(t, row.peak, lo)
				assert.LessOrEqual(t, row.peak, lo+4/float64(w)+0.5)
				// Everything is allocated at construction, as in
				// StateSharded.
				require.Contains(t, row.stages, optim.StageWarmup)
				require.Contains(t, row.stages, optim.StageCompression)
				for i, s := range row.sums[1:] {
					assert.Equal(t, row.sums[0], s, "%s on %d ranks: StateBytes after step %d (%s) against after construction", o.name, w, i+1, row.stages[i])
				}
			case costmodel.OptOnebitLambCompact:
				// v, v_fresh, worker error, server error 4/W; then the
				// packed signs sent and received (m), their copy
				// (m_last), the summing block and the unpacking blocks.
				lo := 12 + 4/float64(w)
				assert.GreaterOrEqual(t, row.peak, lo)
				assert.LessOrEqual(t, row.peak, lo+4/float64(w)+0.5)
				// Everything is allocated at construction: its figure
				// is the peak of the whole run, warm-up included.
				require.Contains(t, row.stages, optim.StageWarmup)
				require.Contains(t, row.stages, optim.StageCompression)
				for i, s := range row.sums[1:] {
					assert.Equal(t, row.sums[0], s, "%s on %d ranks: StateBytes after step %d (%s) against after construction", o.name, w, i+1, row.stages[i])
				}
			case costmodel.OptOnebitAdamShardedBF16:
				// Two layouts, by the stage the optimizer is in (the
				// freezing step ends in the compression stage's): the
				// warm-up's after construction and after every warm-up
				// step, the compression stage's after every step from
				// the freezing one on. The model is one bucket.
				require.LessOrEqual(t, 4*n, costmodel.DefaultBucketBytes)
				require.Len(t, row.after, len(row.rank0))
				var warm, comp []int64
				for i, st := range row.after {
					if st == optim.StageWarmup {
						warm = append(warm, row.rank0[i])
					} else {
						require.Equal(t, optim.StageCompression, st)
						comp = append(comp, row.rank0[i])
					}
				}
				require.Equal(t, optim.StageWarmup, row.after[0], "constructed in the warm-up")
				require.GreaterOrEqual(t, len(warm), 2, "StateBytes after construction and after a warm-up step")
				require.GreaterOrEqual(t, len(comp), 2, "StateBytes after compression steps")
				for i, b := range warm {
					assert.Equal(t, warm[0], b, "%s on %d ranks: warm-up layout %d against after construction", o.name, w, i)
				}
				for i, b := range comp {
					assert.Equal(t, comp[0], b, "%s on %d ranks: compression layout %d against the first", o.name, w, i)
				}
				t.Logf("%-24s %2d rank 0: warm-up %.3f, compression %.3f bytes per parameter", o.name, w, float64(warm[0])/float64(n), float64(comp[0])/float64(n))
				// costmodel's figure is the peak of the run: the
				// compression stage's.
				assert.Equal(t, want, max(warm[0], comp[0]), "%s on %d ranks: costmodel against the larger layout", o.name, w)
				assert.Equal(t, want, row.state0)
				assert.Greater(t, comp[0], warm[0])
				// Against the float32 sharded mode, with N the padded
				// length and C = N/W: the warm-up has no worker error
				// (4N) but the staging block (4 min(N, 16Ki W)); the
				// compression stage has the bfloat16 worker error (2N)
				// and v (2C) in place of the float32 ones.
				full, ok := state0[costmodel.OptOnebitAdamSharded]
				require.True(t, ok, "StateSharded measured first")
				padded := int64(onebit.PaddedLen(n, w))
				block := 4 * min(padded, 16<<10*int64(w))
				assert.Equal(t, 4*padded-block, full-warm[0], "%s on %d ranks: warm-up against float32", o.name, w)
				assert.Equal(t, 2*padded+2*padded/int64(w)-block, full-comp[0], "%s on %d ranks: compression against float32", o.name, w)
				assert.Equal(t, 2*padded-2*padded/int64(w), comp[0]-warm[0], "%s on %d ranks: compression against warm-up", o.name, w)
				// Worker error 2, m, v and the update error of the own
				// chunk 10/W, the packed signs; the staging block (W/16
				// bytes per parameter here): below exact Adam's 8 from
				// 2 ranks on.
				lo := 2 + 10/float64(w)
				assert.GreaterOrEqual(t, row.peak, lo)
				assert.LessOrEqual(t, row.peak, lo+0.5+float64(block)/float64(n))
				assert.Less(t, row.peak, 8.0)
				assert.Less(t, row.state0, full)
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

// 1-bit Adam in every StateMode (sharded in float32 and bfloat16) holds
// what costmodel counts for it, on every rank, from construction on:
// with several buckets (and a last one shorter), whose wire buffers are
// one set as long as the longest bucket needs (buckets.shareWire), odd
// lengths (padding), buckets large enough to be pipelined, next to ones
// that are not, and staging blocks of both lengths
// (the largest bucket's padded length, 16Ki floats per rank), and on one
// rank, where they run as StateFull. The bfloat16 one is built in the
// compression stage (FreezeStep 0), whose layout is costmodel's figure,
// and in the warm-up, whose layout is less by the bfloat16 worker error
// and the bfloat16 v's saving: 2 (N - N/W) bytes per bucket of N padded
// elements.
func TestStateBytesSharded(t *testing.T) {
	modes := []struct {
		name   string
		mode   onebit.StateMode
		bf16   onebit.BF16State
		freeze int
	}{
		{costmodel.OptOnebitAdam, onebit.StateFull, 0, 100},
		{costmodel.OptOnebitAdamSharded, onebit.StateSharded, 0, 100},
		{costmodel.OptOnebitAdamCompact, onebit.StateCompact, 0, 100},
		{costmodel.OptOnebitAdamShardedBF16, onebit.StateSharded, onebit.BF16WorkerError | onebit.BF16Variance, 0},
		{costmodel.OptOnebitAdamShardedBF16 + "/warm-up", onebit.StateSharded, onebit.BF16WorkerError | onebit.BF16Variance, 100},
	}
	for _, c := range []struct {
		shapes [][]int
		bytes  int
	}{
		{[][]int{{1}}, 0},
		{[][]int{{3, 4115}, {7}}, 0},
		{[][]int{{300, 1000}, {12345}}, 64 << 10},
		{[][]int{{1 << 22}, {12345}}, 0},
		// Two buckets, one pipelined on 2 ranks: they share its pieces.
		{[][]int{{1 << 21}, {1 << 20}}, 8 << 20},
	} {
		var tensors []int64
		total := 0
		for _, s := range c.shapes {
			k := 1
			for _, d := range s {
				k *= d
			}
			tensors = append(tensors, int64(k))
			total += k
		}
		// The buckets' lengths: the flat buffer cut in buckets of bytes.
		per := c.bytes / 4
		if c.bytes == 0 {
			per = optim.DefaultBucketBytes / 4
		}
		var buckets []int
		for lo := 0; lo < total; lo += per {
			buckets = append(buckets, min(per, total-lo))
		}
		for _, md := range modes {
			base, variant, _ := strings.Cut(md.name, "/")
			for _, w := range []int{1, 2, 3, 8} {
				want, err := costmodel.StateBytes(base, tensors, w, int64(c.bytes))
				require.NoError(t, err)
				if variant == "warm-up" && w > 1 {
					for _, k := range buckets {
						padded := int64(onebit.PaddedLen(k, w))
						want -= 2 * (padded - padded/int64(w))
					}
				}
				got := make([]int64, w)
				require.NoError(t, local.Run(adamCtx(t), w, func(ctx context.Context, cm comm.Comm) error {
					var ps []*optim.Param
					for i, s := range c.shapes {
						ps = append(ps, optim.NewParam(fmt.Sprintf("p%d", i), s...))
					}
					cfg := onebit.DefaultAdamConfig()
					cfg.StateMode = md.mode
					cfg.BF16 = md.bf16
					cfg.FreezeStep = md.freeze
					cfg.BucketBytes = c.bytes
					a, err := onebit.NewAdam(ctx, cm, ps, cfg)
					if err != nil {
						return err
					}
					got[cm.Rank()] = a.StateBytes()
					return a.Close()
				}))
				for r := range w {
					assert.Equal(t, want, got[r], "%s: %v in buckets of %d bytes, rank %d of %d", md.name, tensors, c.bytes, r, w)
				}
			}
		}
	}
}

// memLamb builds 1-bit LAMB (FreezeStep 2) in mode.
func memLamb(mode onebit.StateMode) func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
	return func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultLambConfig()
		cfg.FreezeStep = 2
		cfg.StateMode = mode
		return onebit.NewLamb(ctx, c, ps, cfg)
	}
}

// memAdam builds 1-bit Adam (FreezeStep 2) in mode with the bfloat16
// buffers bf and the gradient averaging reduce.
func memAdam(mode onebit.StateMode, bf onebit.BF16State, reduce optim.ReduceMode) func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
	return func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.FreezeStep = 2
		cfg.StateMode, cfg.BF16, cfg.Reduce = mode, bf, reduce
		return onebit.NewAdam(ctx, c, ps, cfg)
	}
}

// States that share their wire buffers (ShareWire) give the same results
// bit for bit as states of their own, calls interleaved, and StatesBytes
// counts the shared buffers once: less than the states' own figures
// summed, by at least the smaller state's packed signs sent and received.
func TestShareWire(t *testing.T) {
	const w = 3
	sizes := []int{5000, 1234} // the second shorter, and padded
	run := func(share bool) ([][]float32, int64, int64) {
		out := make([][]float32, w)
		var shared, own int64
		var mu sync.Mutex
		err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
			var sts []*onebit.State
			var sum int64
			for _, n := range sizes {
				st, err := onebit.NewState(n, w)
				if err != nil {
					return err
				}
				sts = append(sts, st)
				sum += st.StateBytes()
			}
			if share {
				onebit.ShareWire(sts...)
			}
			var res []float32
			for call := range 3 {
				for k, st := range sts {
					buf := make([]float32, sizes[k])
					for i := range buf {
						buf[i] = float32(math.Sin(float64(i*(k+2)+7*call+13*c.Rank()))) * float32(1+i%3)
					}
					if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
						return err
					}
					res = append(res, buf...)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			out[c.Rank()] = res
			shared, own = onebit.StatesBytes(sts...), sum
			return nil
		})
		require.NoError(t, err)
		return out, shared, own
	}
	want, alone, sum := run(false)
	got, shared, _ := run(true)
	require.Equal(t, want, got)
	assert.Equal(t, sum, alone, "StatesBytes of states that share nothing")
	assert.LessOrEqual(t, shared, sum-int64(onebit.PaddedLen(sizes[1], w)/4), "StatesBytes of states that share their wire buffers")
}
