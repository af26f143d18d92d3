package gomlx

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"iter"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gomlx/compute/dtypes"
	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/compute/shapes"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/layers/activation"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

const (
	features = 8
	rows     = 64 // global batch
)

// mlp returns a two-layer perceptron of the given hidden width.
func mlp(hidden int) func(scope *model.Scope, x *graph.Node) *graph.Node {
	return func(scope *model.Scope, x *graph.Node) *graph.Node {
		h := activation.Relu(layers.DenseWithBias(scope.In("hidden"), x, hidden))
		return layers.DenseWithBias(scope.In("out"), h, 1)
	}
}

// regression returns rows [lo, hi) of a fixed regression data set, as new
// tensors (the Trainer finalizes what a Dataset yields).
func regression(lo, hi int) (x, y *tensors.Tensor) {
	rng := rand.New(rand.NewPCG(1, 2))
	w := make([]float32, features)
	for i := range w {
		w[i] = float32(rng.NormFloat64())
	}
	xs := make([]float32, rows*features)
	ys := make([]float32, rows)
	for r := range rows {
		for f := range features {
			xs[r*features+f] = float32(rng.NormFloat64())
			ys[r] += w[f] * xs[r*features+f]
		}
		ys[r] = float32(math.Sin(float64(ys[r])))
	}
	return tensors.FromFlatDataAndDimensions(xs[lo*features:hi*features], hi-lo, features),
		tensors.FromFlatDataAndDimensions(ys[lo:hi], hi-lo, 1)
}

// shard is a train.Dataset: rank's shard of the regression set, every step;
// edit, if not nil, may replace a step's batch.
type shard struct {
	rank, world int
	step        int
	edit        func(step int, b train.Batch) train.Batch
}

func (d *shard) Name() string { return "regression" }

func (d *shard) Iter() iter.Seq2[train.Batch, error] {
	return func(yield func(train.Batch, error) bool) {
		for {
			x, y := regression(d.rank*rows/d.world, (d.rank+1)*rows/d.world)
			b := train.Batch{Inputs: []*tensors.Tensor{x}, Labels: []*tensors.Tensor{y}}
			if d.edit != nil {
				b = d.edit(d.step, b)
			}
			d.step++
			if !yield(b, nil) {
				return
			}
		}
	}
}

// newStore returns a store whose initializer is seeded by seed, so that
// ranks start from different values unless the Optimizer broadcasts.
func newStore(seed int64) *model.Store {
	s := model.NewStore()
	s.RootScope().SetParam(model.ParamInitialSeed, seed)
	return s
}

func adam(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
	cfg := optim.DefaultAdamConfig()
	cfg.LR = 1e-2
	return optim.NewAdam(ctx, c, p, cfg)
}

func lamb(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
	cfg := optim.DefaultLambConfig()
	cfg.LR = 1e-2
	return optim.NewLamb(ctx, c, p, cfg)
}

func onebitAdam(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
	cfg := onebit.DefaultAdamConfig()
	cfg.LR = 1e-2
	cfg.FreezeStep = 5
	return onebit.NewAdam(ctx, c, p, cfg)
}

func onebitLamb(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
	cfg := onebit.DefaultLambConfig()
	cfg.LR = 1e-2
	cfg.FreezeStep = 5
	return onebit.NewLamb(ctx, c, p, cfg)
}

func zeroOneAdam(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
	cfg := onebit.DefaultZeroOneAdamConfig()
	cfg.LR = 1e-2
	return onebit.NewZeroOneAdam(ctx, c, p, cfg)
}

// withFreeze is onebitAdam with freeze step f.
func withFreeze(f int) Builder {
	return func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.LR = 1e-2
		cfg.FreezeStep = f
		return onebit.NewAdam(ctx, c, p, cfg)
	}
}

// withShardedFreeze is withFreeze(f) with the moments sharded over the
// ranks (onebit.StateSharded).
func withShardedFreeze(f int) Builder {
	return func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.LR = 1e-2
		cfg.FreezeStep = f
		cfg.StateMode = onebit.StateSharded
		return onebit.NewAdam(ctx, c, p, cfg)
	}
}

// withLambFreeze is onebitLamb with freeze step f.
func withLambFreeze(f int) Builder {
	return func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultLambConfig()
		cfg.LR = 1e-2
		cfg.FreezeStep = f
		return onebit.NewLamb(ctx, c, p, cfg)
	}
}

// zeroOneAdamLocal is 0/1 Adam with a schedule that reaches every part of
// the algorithm within a few steps (the defaults take 16 exact steps
// first): variance updates at steps 1 and 2, a compressed step at 3 (the
// end of phase A), then phase B's synchronizations at steps 4, 8, 12, ...
// with local steps in between.
func zeroOneAdamLocal(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
	cfg := onebit.DefaultZeroOneAdamConfig()
	cfg.LR = 1e-2
	cfg.VarFreezeStep = 3
	cfg.VarUpdateScaler = 1
	cfg.LocalStepScaler = 1
	cfg.LocalStepClipper = 4
	return onebit.NewZeroOneAdam(ctx, c, p, cfg)
}

func zeroAdam(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
	cfg := zero.DefaultConfig()
	cfg.LR = 1e-2
	return zero.NewAdam(ctx, c, p, cfg)
}

// rankModel is one rank's GoMLX training set-up, as a user writes it.
type rankModel struct {
	store   *model.Store
	opt     *Optimizer
	trainer *train.Trainer
	loop    *train.Loop
	losses  []float32
}

func newRankModel(t testing.TB, ctx context.Context, c comm.Comm, store *model.Store, hidden int, build Builder) *rankModel {
	t.Helper()
	backend, err := gobackend.New("")
	require.NoError(t, err)
	opt, err := New(ctx, c, build)
	require.NoError(t, err)
	m := &rankModel{store: store, opt: opt}
	m.trainer = train.NewTrainer(backend, store, mlp(hidden), loss.MeanSquaredError, opt, nil, nil)
	m.loop = train.NewLoop(m.trainer)
	opt.AttachToLoop(m.loop)
	m.loop.OnStep("record", 0, func(_ *train.Loop, metrics []*tensors.Tensor) error {
		m.losses = append(m.losses, metrics[0].Value().(float32))
		return nil
	})
	return m
}

// variables returns copies of the values of the store's trainable
// variables and global step, by path.
func variables(t testing.TB, s *model.Store) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	for v := range s.IterVariables() {
		if !v.Trainable && v.Path() != "/global_step" {
			continue
		}
		val, err := v.Value()
		require.NoError(t, err, v.Path())
		require.NoError(t, val.ConstBytes(func(b []byte) { out[v.Path()] = append([]byte(nil), b...) }))
	}
	return out
}

// trainable returns copies of the trainable variables' values, in order.
func trainable(t testing.TB, s *model.Store) [][]float32 {
	t.Helper()
	var out [][]float32
	for v := range s.IterVariables() {
		if v.Trainable {
			d, err := tensors.CopyFlatData[float32](v.MustValue())
			require.NoError(t, err)
			out = append(out, d)
		}
	}
	return out
}

// rankRun is what one rank of a test run reports.
type rankRun struct {
	losses []float32
	final  map[string][]byte
	stats  optim.Stats
	err    error
	// After every step: the trainable variables, and whether the
	// algorithm guarantees that they are the same on every rank (always
	// but after 0/1 Adam's local steps).
	vars   [][][]float32
	synced []bool
}

// synchronizes reports whether the next step of opt leaves every rank
// with the same parameters: every step does, except 0/1 Adam's phase-B
// steps that are not a synchronization.
func synchronizes(opt optim.Optimizer) bool {
	z, ok := opt.(*onebit.ZeroOneAdam)
	if !ok || z.Stage() != optim.StagePhaseB {
		return true
	}
	_, _, interval, _ := z.Intervals()
	return (z.Stats().Steps+1)%interval == 0
}

// runLoop trains steps on w in-process ranks with train.Loop, each with a
// differently seeded store and its shard of the batch.
func runLoop(t *testing.T, w, steps int, build Builder, edit func(rank, step int, b train.Batch) train.Batch) []*rankRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	runs := make([]*rankRun, w)
	var mu sync.Mutex
	_ = local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		m := newRankModel(t, ctx, c, newStore(int64(100+r)), 16, build)
		defer m.opt.Close()
		ds := &shard{rank: r, world: w}
		if edit != nil {
			ds.edit = func(step int, b train.Batch) train.Batch { return edit(r, step, b) }
		}
		run := &rankRun{}
		// Before and after the Optimizer's hook.
		m.loop.OnStep("before lowbit", HookPriority-1, func(*train.Loop, []*tensors.Tensor) error {
			run.synced = append(run.synced, synchronizes(m.opt.Optimizer()))
			return nil
		})
		m.loop.OnStep("after lowbit", HookPriority+1, func(*train.Loop, []*tensors.Tensor) error {
			run.vars = append(run.vars, trainable(t, m.store))
			return nil
		})
		_, err := m.loop.RunSteps(ds, steps)
		run.losses, run.err = m.losses, err
		if err == nil {
			run.final = variables(t, m.store)
			run.stats = m.opt.Optimizer().Stats()
		}
		mu.Lock()
		runs[r] = run
		mu.Unlock()
		return err
	})
	return runs
}

// TestLoopEveryOptimizer trains on 2 ranks whose initializers are seeded
// differently, with every lowbit optimizer inside train.Loop: the loss
// falls, the ranks are bit-identical after every step that the algorithm
// synchronizes (every step but 0/1 Adam's local steps; 0/1 Adam once with
// its defaults, all phase A, and once with local steps from step 5), and
// GoMLX's global step counts the steps.
func TestLoopEveryOptimizer(t *testing.T) {
	for _, tc := range []struct {
		name  string
		build Builder
		local bool // the run takes local steps, on which the ranks differ
	}{
		{"adam", adam, false}, {"lamb", lamb, false}, {"onebit-adam", onebitAdam, false},
		{"onebit-adam-sharded", withShardedFreeze(5), false}, {"onebit-lamb", onebitLamb, false},
		{"zeroone-adam", zeroOneAdam, false}, {"zeroone-adam-local", zeroOneAdamLocal, true}, {"zero-adam", zeroAdam, false},
		{"muon", muon, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const steps = 30
			runs := runLoop(t, 2, steps, tc.build, nil)
			for r, run := range runs {
				require.NoError(t, run.err, "rank %d", r)
				require.Len(t, run.losses, steps)
				assert.Less(t, run.losses[steps-1], run.losses[0]/2, "rank %d: %v", r, run.losses)
				assert.Equal(t, int64(steps), run.stats.Steps)
				assert.Zero(t, run.stats.Skipped)
				require.Len(t, run.vars, steps)
				require.Len(t, run.synced, steps)
			}
			assert.Equal(t, runs[0].synced, runs[1].synced)
			apart := 0
			for s := range steps {
				if runs[0].synced[s] {
					require.Equal(t, runs[0].vars[s], runs[1].vars[s], "ranks differ after step %d", s+1)
				} else if !assert.ObjectsAreEqual(runs[0].vars[s], runs[1].vars[s]) {
					apart++
				}
			}
			if tc.local {
				assert.Positive(t, apart, "no local step left the ranks apart")
				assert.Contains(t, runs[0].synced[4:], true, "no synchronization in phase B")
			} else {
				assert.NotContains(t, runs[0].synced, false)
			}
			if !slices.Contains(runs[0].synced[steps-1:], false) {
				assert.Equal(t, runs[0].final, runs[1].final, "ranks differ")
			}
			for r, run := range runs {
				assert.Equal(t, int64(steps), int64(binary.LittleEndian.Uint64(run.final["/global_step"])), "rank %d", r)
			}
		})
	}
}

// TestLoopMatchesOneRank: 2 ranks with half batches each, whose
// initializers are seeded differently, follow the trajectory of 1 rank
// with the whole batch and rank 0's seed (exact Adam): every rank starts
// from rank 0's values before the first gradient is computed.
func TestLoopMatchesOneRank(t *testing.T) {
	const steps = 10
	two := runLoop(t, 2, steps, adam, nil)
	one := runLoop(t, 1, steps, adam, nil)
	require.NoError(t, two[0].err)
	require.NoError(t, one[0].err)
	for s := range steps {
		mean := (float64(two[0].losses[s]) + float64(two[1].losses[s])) / 2
		assert.InDelta(t, float64(one[0].losses[s]), mean, 1e-5, "step %d", s)
	}
	for path, b := range one[0].final {
		if path == "/global_step" {
			continue
		}
		assert.InDeltaSlice(t, floats(b), floats(two[0].final[path]), 1e-5, path)
	}
}

func floats(b []byte) []float64 {
	out := make([]float64, len(b)/4)
	for i := range out {
		out[i] = float64(math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:])))
	}
	return out
}

// nanAt makes rank's batch at step hold a NaN (its loss is then NaN).
func nanAt(rank, step int) func(r, s int, b train.Batch) train.Batch {
	return func(r, s int, b train.Batch) train.Batch {
		if r == rank && s == step {
			require.NoError(nil, tensors.MutableFlatData(b.Inputs[0], func(f []float32) { f[0] = float32(math.NaN()) }))
		}
		return b
	}
}

// TestLoopNonFiniteLoss: a NaN loss on rank 1 at step 3 stops the loop on
// every rank with an error, and no variable changed in that step; a
// second RunSteps goes on from there.
func TestLoopNonFiniteLoss(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		m := newRankModel(t, ctx, c, newStore(int64(100+r)), 16, onebitAdam)
		defer m.opt.Close()
		ds := &shard{rank: r, world: 2, edit: func(s int, b train.Batch) train.Batch { return nanAt(1, 3)(r, s, b) }}
		_, err := m.loop.RunSteps(ds, 3)
		require.NoError(t, err)
		before := variables(t, m.store)
		_, err = m.loop.RunSteps(ds, 5)
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "not finite", "rank %d", r)
		assert.Equal(t, before, variables(t, m.store), "rank %d: a variable changed", r)
		_, err = m.loop.RunSteps(ds, 5)
		require.NoError(t, err, "rank %d", r)
		assert.Equal(t, int64(8), m.opt.Optimizer().Stats().Steps)
		assert.Equal(t, int64(8), optimizerGlobalStep(m.store))
		return nil
	})
	require.NoError(t, err)
}

func optimizerGlobalStep(s *model.Store) int64 {
	return s.GetVariable("/global_step").MustValue().Value().(int64)
}

// TestLoopNonFiniteGradient: a gradient that is NaN on rank 1 at step 4
// while every loss is finite (0*sqrt(0)) is skipped on every rank and the
// loop goes on (1-bit Adam, and Muon, whose transposed copies of the
// matrices take the skip too).
func TestLoopNonFiniteGradient(t *testing.T) {
	for _, tc := range []struct {
		name  string
		build Builder
	}{{"onebit-adam", onebitAdam}, {"muon", muon}} {
		t.Run(tc.name, func(t *testing.T) { checkNonFiniteGradient(t, tc.build) })
	}
}

func checkNonFiniteGradient(t *testing.T, build Builder) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const steps = 8
	finals := make([]map[string][]byte, 2)
	err := local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		backend, err := gobackend.New("")
		require.NoError(t, err)
		opt, err := New(ctx, c, build)
		require.NoError(t, err)
		defer opt.Close()
		store := newStore(int64(100 + r))
		// The second label is a gate: 1, or 0 to make the gradient of
		// sqrt(|w*gate|) infinite, times 0: NaN, with a finite loss.
		lossFn := func(labels, pred []*graph.Node) *graph.Node {
			mse := loss.MeanSquaredError(labels[:1], pred)
			w := store.RootScope().In("gate").VariableWithValue("w", float32(1)).NodeValue(pred[0].Graph())
			trap := graph.Sqrt(graph.Abs(graph.Mul(w, graph.ReduceAllSum(labels[1]))))
			return graph.Add(mse, graph.MulScalar(trap, 0))
		}
		trainer := train.NewTrainer(backend, store, mlp(16), lossFn, opt, nil, nil)
		loop := train.NewLoop(trainer)
		opt.AttachToLoop(loop)
		var before map[string][]byte
		loop.OnStep("watch", 0, func(l *train.Loop, _ []*tensors.Tensor) error {
			if l.LoopStep == 3 {
				before = variables(t, store)
			}
			if l.LoopStep == 4 {
				after := variables(t, store)
				delete(after, "/global_step")
				delete(before, "/global_step")
				assert.Equal(t, before, after, "rank %d: the skipped step changed a variable", r)
			}
			return nil
		})
		ds := &shard{rank: r, world: 2, edit: func(s int, b train.Batch) train.Batch {
			gate := float32(1)
			if r == 1 && s == 4 {
				gate = 0
			}
			b.Labels = append(b.Labels, tensors.FromFlatDataAndDimensions([]float32{gate}, 1))
			return b
		}}
		_, err = loop.RunSteps(ds, steps)
		require.NoError(t, err, "rank %d", r)
		st := opt.Optimizer().Stats()
		assert.Equal(t, int64(1), st.Skipped, "rank %d", r)
		assert.Equal(t, int64(steps), st.Steps, "rank %d", r)
		finals[r] = variables(t, store)
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, finals[0], finals[1])
}

// TestLoopErrorReachesEveryRank: a failure on one rank, in the hook
// (a trainable variable added) or inside GoMLX's TrainStep (a batch of
// another width), ends the loop on every rank with an error, no hang.
func TestLoopErrorReachesEveryRank(t *testing.T) {
	t.Run("new variable", func(t *testing.T) {
		runs := runLoopModel(t, func(r int) any {
			return func(scope *model.Scope, spec any, in []*graph.Node) []*graph.Node {
				out := mlp(16)(scope, in[0])
				if spec == "extra" {
					out = graph.Add(out, scope.In("extra").VariableWithValue("b", float32(0)).NodeValue(out.Graph()))
				}
				return []*graph.Node{out}
			}
		}, func(r, s int, b train.Batch) train.Batch {
			if r == 1 && s == 3 {
				b.Spec = "extra"
			}
			return b
		})
		for r, run := range runs {
			require.Error(t, run.err, "rank %d", r)
			assert.Len(t, run.losses, 3, "rank %d", r)
		}
		assert.Contains(t, runs[1].err.Error(), "trainable variables changed")
		assert.Contains(t, runs[0].err.Error(), "another rank failed")
	})
	t.Run("graph fails on one rank", func(t *testing.T) {
		runs := runLoopModel(t, func(int) any { return mlp(16) }, func(r, s int, b train.Batch) train.Batch {
			if r == 1 && s == 2 {
				b.Inputs[0] = tensors.FromShape(shapes.Make(dtypes.Float32, rows/2, features+1))
			}
			return b
		})
		for r, run := range runs {
			require.Error(t, run.err, "rank %d", r)
		}
		assert.ErrorIs(t, runs[0].err, comm.ErrAborted)
	})
}

// runLoopModel is runLoop with a model function per rank (a
// train.ModelFn or a compatible function) and exact Adam.
func runLoopModel(t *testing.T, modelFn func(rank int) any, edit func(rank, step int, b train.Batch) train.Batch) []*rankRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	runs := make([]*rankRun, 2)
	var mu sync.Mutex
	_ = local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		backend, err := gobackend.New("")
		require.NoError(t, err)
		opt, err := New(ctx, c, adam)
		require.NoError(t, err)
		defer opt.Close()
		var trainer *train.Trainer
		switch fn := modelFn(r).(type) {
		case func(*model.Scope, *graph.Node) *graph.Node:
			trainer = train.NewTrainer(backend, newStore(int64(r)), fn, loss.MeanSquaredError, opt, nil, nil)
		case func(*model.Scope, any, []*graph.Node) []*graph.Node:
			trainer = train.NewTrainer(backend, newStore(int64(r)), fn, loss.MeanSquaredError, opt, nil, nil)
		default:
			t.Fatalf("model function %T", fn)
		}
		loop := train.NewLoop(trainer)
		opt.AttachToLoop(loop)
		run := &rankRun{}
		loop.OnStep("record", 0, func(_ *train.Loop, metrics []*tensors.Tensor) error {
			run.losses = append(run.losses, metrics[0].Value().(float32))
			return nil
		})
		_, run.err = loop.RunSteps(&shard{rank: r, world: 2, edit: func(s int, b train.Batch) train.Batch {
			if edit == nil {
				return b
			}
			return edit(r, s, b)
		}}, 6)
		mu.Lock()
		runs[r] = run
		mu.Unlock()
		return run.err
	})
	return runs
}

// TestLoopDifferentModels: ranks whose models differ fail on every rank
// at the first step, before any collective of the optimizer.
func TestLoopDifferentModels(t *testing.T) {
	runs := runLoopModel(t, func(r int) any { return mlp(8 + 8*r) }, nil)
	for r, run := range runs {
		require.Error(t, run.err, "rank %d", r)
		assert.Contains(t, run.err.Error(), "other trainable variables", "rank %d", r)
		assert.Empty(t, run.losses)
	}
}

func TestNewErrors(t *testing.T) {
	//lint:ignore SA1012 a nil context is the bad input
	_, err := New(nil, nil, adam)
	assert.Error(t, err)
	_, err = New(context.Background(), nil, nil)
	assert.Error(t, err)
	// A builder that fails or returns nil fails the first step.
	for _, build := range []Builder{
		func(context.Context, comm.Comm, []*optim.Param) (optim.Optimizer, error) { return nil, assert.AnError },
		func(context.Context, comm.Comm, []*optim.Param) (optim.Optimizer, error) { return nil, nil },
	} {
		runs := runLoop(t, 1, 3, build, nil)
		require.Error(t, runs[0].err)
		assert.Contains(t, runs[0].err.Error(), "optimizer")
	}
}

// TestNotAttached: an Optimizer neither attached to the loop nor made
// WithManualStep refuses the first training graph, instead of training
// nothing without a word; WithManualStep and Step train.
func TestNotAttached(t *testing.T) {
	backend, err := gobackend.New("")
	require.NoError(t, err)
	for _, manual := range []bool{false, true} {
		var opts []Option
		if manual {
			opts = append(opts, WithManualStep())
		}
		opt, err := New(context.Background(), nil, adam, opts...)
		require.NoError(t, err)
		store := newStore(1)
		trainer := train.NewTrainer(backend, store, mlp(4), loss.MeanSquaredError, opt, nil, nil)
		loop := train.NewLoop(trainer)
		_, err = loop.RunSteps(&shard{rank: 0, world: 1}, 2)
		if !manual {
			require.Error(t, err)
			assert.Contains(t, err.Error(), "AttachToLoop")
			continue
		}
		require.NoError(t, err, "a manual Optimizer builds its graph")
		before := variables(t, store)
		require.NotEmpty(t, before)
		require.NoError(t, opt.Step(1))
		assert.NotEqual(t, before, variables(t, store), "Step trained")
		require.NoError(t, opt.Close())
	}
}

// resumeConfig describes one rank's part of a checkpointed run.
type resumeConfig struct {
	hidden, steps int
	build         Builder
	// plain builds the Handler with checkpoint.Config.Done, each rank
	// loading its own newest checkpoint, instead of Optimizer.Checkpoint.
	plain bool
	// log, when not nil, is the Optimizer's logger.
	log *zap.Logger
	// legacy saves as before the state had a file of its own (legacySave).
	legacy bool
}

// resumeRun is what one rank of a checkpointed run reports.
type resumeRun struct {
	final map[string][]byte // the variables and the global step at the end
	opt   *Optimizer
	state *optim.Checkpoint // the lowbit state at the end: what the last save wrote
	start int64             // the global step the run started from
	err   error
}

// resumeAll runs resumeRank with rc on w ranks in dir, requires every
// rank to succeed, and returns their runs.
func resumeAll(t *testing.T, ctx context.Context, w int, dir string, rc resumeConfig) []*resumeRun {
	t.Helper()
	runs := make([]*resumeRun, w)
	require.NoError(t, local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		runs[c.Rank()] = resumeRank(t, ctx, c, dir, rc)
		return runs[c.Rank()].err
	}))
	return runs
}

// requireResumeRefused runs resumeRank with rc on w ranks in dir,
// requires every rank to fail with an error that contains each of wants,
// and returns their runs.
func requireResumeRefused(t *testing.T, ctx context.Context, w int, dir string, rc resumeConfig, wants ...string) []*resumeRun {
	t.Helper()
	runs := make([]*resumeRun, w)
	_ = local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		runs[c.Rank()] = resumeRank(t, ctx, c, dir, rc)
		return runs[c.Rank()].err
	})
	for r, run := range runs {
		require.Error(t, run.err, "rank %d", r)
		for _, want := range wants {
			assert.Contains(t, run.err.Error(), want, "rank %d", r)
		}
	}
	return runs
}

// assertOptimizerDropped fails t for each of runs that kept its lowbit
// optimizer.
func assertOptimizerDropped(t *testing.T, runs []*resumeRun) {
	t.Helper()
	for r, run := range runs {
		if run.opt.Optimizer() != nil {
			t.Errorf("rank %d: the optimizer was kept", r)
		}
	}
}

// resumeRank is one rank of a checkpointed run: rc.steps steps with
// rc.build, saved every step to dir/rank-R with Optimizer.SaveOnStepFn
// (Keep(2)), starting from what dir holds.
func resumeRank(t *testing.T, ctx context.Context, c comm.Comm, dir string, rc resumeConfig) *resumeRun {
	t.Helper()
	r := c.Rank()
	rankDir := filepath.Join(dir, fmt.Sprintf("rank-%d", r))
	// Initial values that differ by rank and by checkpoint directory state:
	// a resumed run must take its values from the checkpoint.
	seed := int64(7 + r)
	if entries, _ := os.ReadDir(rankDir); len(entries) > 0 {
		seed += 1000
	}
	store := newStore(seed)
	m := newRankModel(t, ctx, c, store, rc.hidden, rc.build)
	if rc.log != nil {
		WithLogger(rc.log)(m.opt)
	}
	run := &resumeRun{opt: m.opt}
	var h *checkpoint.Handler
	if rc.plain {
		var err error
		h, err = checkpoint.Build(store).Dir(rankDir).Keep(2).Done()
		require.NoError(t, err)
	} else if h, run.err = m.opt.Checkpoint(checkpoint.Build(store).Keep(2), rankDir); run.err != nil {
		return run
	}
	run.start = optimizerGlobalStep(store)
	save := m.opt.SaveOnStepFn(h)
	if rc.legacy {
		save = func(*train.Loop, []*tensors.Tensor) error { return legacySave(m.opt, h) }
	}
	train.EveryNSteps(m.loop, 1, "checkpoint", 100, save)
	if _, run.err = m.loop.RunSteps(&shard{rank: r, world: c.Size()}, rc.steps); run.err != nil {
		return run
	}
	run.final = variables(t, store)
	var err error
	run.state, err = m.opt.Optimizer().State()
	require.NoError(t, err)
	require.NoError(t, m.opt.Close())
	return run
}

// nonZeroErrors counts the non-zero elements of ck's error buffers.
func nonZeroErrors(ck *optim.Checkpoint) int {
	n := 0
	for _, tn := range ck.Tensors {
		if optim.IsErrorBuffer(tn.Name) {
			for _, x := range tn.Data {
				if x != 0 {
					n++
				}
			}
		}
	}
	return n
}

// resumeCase is a run of TestResumeBitIdentical or TestResumeFromWarmup:
// steps straight against cut, a save and a restore, steps-cut.
type resumeCase struct {
	name       string
	build      Builder
	steps, cut int
	// atCut and atEnd, when not empty, are the stage of the lowbit state
	// saved at the cut and at the end; compressed, that some error buffer
	// is not zero at the cut; apart, that the ranks' parameters differ at
	// the cut (0/1 Adam between two synchronizations).
	atCut, atEnd      optim.Stage
	compressed, apart bool
	// endApart: the ranks' parameters may differ at the end too (the
	// outer optimizer with staggered fragments is never synchronized
	// everywhere at once).
	endApart bool
	// same, when not empty, names a tensor of the lowbit state that must
	// be the same on every rank at the cut and at the end (the outer
	// optimizer's global parameters).
	same string
}

// checkResume runs tc on 2 ranks: tc.steps steps straight against tc.cut,
// a GoMLX checkpoint with the lowbit state, a restore into fresh objects
// (other initial values), tc.steps-tc.cut: every trainable variable and
// the global step are bit-identical, on every rank.
func checkResume(t *testing.T, tc resumeCase) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var whole, cut, resumed [2]*resumeRun
	dirWhole, dirCut := t.TempDir(), t.TempDir()
	rc := resumeConfig{hidden: 16, build: tc.build}
	err := local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		rc := rc
		rc.steps = tc.steps
		whole[r] = resumeRank(t, ctx, c, dirWhole, rc)
		rc.steps = tc.cut
		cut[r] = resumeRank(t, ctx, c, dirCut, rc)
		rc.steps = tc.steps - tc.cut
		resumed[r] = resumeRank(t, ctx, c, dirCut, rc)
		return errors.Join(whole[r].err, cut[r].err, resumed[r].err)
	})
	require.NoError(t, err)
	for r := range 2 {
		assert.True(t, resumed[r].opt.Restored(), "rank %d", r)
		assert.Equal(t, int64(tc.cut), resumed[r].start, "rank %d", r)
		require.NotEmpty(t, whole[r].final)
		assert.Equal(t, whole[r].final, resumed[r].final, "rank %d", r)
		if tc.atCut != "" {
			assert.Equal(t, tc.atCut, cut[r].state.Stage, "rank %d: stage of the saved state", r)
			assert.Equal(t, tc.atEnd, resumed[r].state.Stage, "rank %d: stage at the end", r)
		}
		if tc.compressed {
			assert.Positive(t, nonZeroErrors(cut[r].state), "rank %d: the saved error buffers are all zero: nothing was compressed before the save", r)
		}
	}
	if tc.apart {
		assert.NotEqual(t, paramTensors(cut[0].state), paramTensors(cut[1].state), "the ranks' parameters are equal at the cut: no local step before the save")
	}
	if !tc.endApart {
		assert.Equal(t, paramTensors(resumed[0].state), paramTensors(resumed[1].state), "the ranks' parameters differ at the end")
	}
	if tc.same != "" {
		for _, st := range [][2]*resumeRun{{cut[0], cut[1]}, {resumed[0], resumed[1]}} {
			a, b := stateTensor(st[0].state, tc.same), stateTensor(st[1].state, tc.same)
			require.NotNil(t, a, "no tensor %s in the lowbit state", tc.same)
			assert.Equal(t, a, b, "%s differs between the ranks", tc.same)
		}
	}
}

// stateTensor returns the data of the tensor called name in ck, nil if
// there is none.
func stateTensor(ck *optim.Checkpoint, name string) []float32 {
	for _, tn := range ck.Tensors {
		if tn.Name == name {
			return tn.Data
		}
	}
	return nil
}

// paramTensors returns the parameters a lowbit state holds, by name.
func paramTensors(ck *optim.Checkpoint) map[string][]float32 {
	out := map[string][]float32{}
	for _, tn := range ck.Tensors {
		if strings.HasPrefix(tn.Name, optim.ParamTensorName("")) {
			out[tn.Name] = tn.Data
		}
	}
	return out
}

// TestResumeBitIdentical: 12 steps straight against a save and a restore
// in the middle, with every optimizer that has state worth the name, with
// settings under which the compressed optimizers compress before the save
// (their error buffers are not zero when saved): 1-bit Adam and LAMB
// freeze at step 3 and save at 6; 0/1 Adam reaches phase B at step 4 and
// saves at step 7, a local step between the synchronizations of steps 4
// and 8, when the ranks' parameters differ.
func TestResumeBitIdentical(t *testing.T) {
	for _, tc := range []resumeCase{
		{name: "adam", build: adam, steps: 12, cut: 6},
		{name: "lamb", build: lamb, steps: 12, cut: 6},
		{name: "onebit-adam", build: withFreeze(3), steps: 12, cut: 6,
			atCut: optim.StageCompression, atEnd: optim.StageCompression, compressed: true},
		{name: "onebit-adam-sharded", build: withShardedFreeze(3), steps: 12, cut: 6,
			atCut: optim.StageCompression, atEnd: optim.StageCompression, compressed: true},
		{name: "onebit-lamb", build: withLambFreeze(3), steps: 12, cut: 6,
			atCut: optim.StageCompression, atEnd: optim.StageCompression, compressed: true},
		{name: "zeroone-adam", build: zeroOneAdamLocal, steps: 12, cut: 7,
			atCut: optim.StagePhaseB, atEnd: optim.StagePhaseB, compressed: true, apart: true},
		{name: "zero-adam", build: zeroAdam, steps: 12, cut: 6},
		{name: "muon", build: muon, steps: 12, cut: 6},
	} {
		t.Run(tc.name, func(t *testing.T) { checkResume(t, tc) })
	}
}

// TestResumeFromWarmup: a checkpoint saved in the warm-up (1-bit Adam and
// LAMB, freeze step 5; 0/1 Adam's phase A, before its first compressed
// step), resumed past the freeze into compression (and 0/1 Adam's local
// steps), ends bit-identical to the uninterrupted run.
func TestResumeFromWarmup(t *testing.T) {
	for _, tc := range []resumeCase{
		{name: "onebit-adam", build: withFreeze(5), steps: 10, cut: 3,
			atCut: optim.StageWarmup, atEnd: optim.StageCompression},
		{name: "onebit-adam-sharded", build: withShardedFreeze(5), steps: 10, cut: 3,
			atCut: optim.StageWarmup, atEnd: optim.StageCompression},
		{name: "onebit-lamb", build: withLambFreeze(5), steps: 10, cut: 3,
			atCut: optim.StageWarmup, atEnd: optim.StageCompression},
		{name: "zeroone-adam", build: zeroOneAdamLocal, steps: 12, cut: 2,
			atCut: optim.StagePhaseA, atEnd: optim.StagePhaseB},
	} {
		t.Run(tc.name, func(t *testing.T) { checkResume(t, tc) })
	}
}

// TestResumeLegacyState: a checkpoint whose lowbit state is in
// StateVariable, as Save wrote it before the state had a file of its own,
// resumes bit-identically (1-bit Adam, compressing before the save), and
// the checkpoints saved after it no longer hold that variable.
func TestResumeLegacyState(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var whole, resumed [2]*resumeRun
	dirWhole, dirCut := t.TempDir(), t.TempDir()
	rc := resumeConfig{hidden: 16, build: withFreeze(3)}
	require.NoError(t, local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		rc := rc
		rc.steps = 10
		whole[r] = resumeRank(t, ctx, c, dirWhole, rc)
		rc.steps, rc.legacy = 5, true
		cut := resumeRank(t, ctx, c, dirCut, rc)
		rc.legacy = false
		resumed[r] = resumeRank(t, ctx, c, dirCut, rc)
		return errors.Join(whole[r].err, cut.err, resumed[r].err)
	}))
	for r := range 2 {
		assert.True(t, resumed[r].opt.Restored(), "rank %d", r)
		assert.Equal(t, whole[r].final, resumed[r].final, "rank %d", r)
		rankDir := filepath.Join(dirCut, fmt.Sprintf("rank-%d", r))
		held, err := listCheckpoints(rankDir)
		require.NoError(t, err)
		require.Len(t, held, 2)
		for _, c := range held {
			js, err := os.ReadFile(filepath.Join(rankDir, c.base+gomlxJSON))
			require.NoError(t, err)
			assert.NotContains(t, string(js), StateVariable, "rank %d: %s", r, c.base)
			_, err = os.Stat(filepath.Join(rankDir, stateFileName(c.step)))
			assert.NoError(t, err, "rank %d: the state file of step %d", r, c.step)
		}
	}
}

// TestResumeRefused: a checkpoint of another optimizer, another model
// size (on the same or another number of ranks), another state mode, or
// saved with Handler.Save after the
// lowbit state: an error on every rank, and the checkpoint and the lowbit
// optimizer unchanged.
func TestResumeRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 4, build: onebitAdam})
	files := snapshot(t, dir)
	try := func(w, hidden int, build Builder, want string) {
		t.Helper()
		assertOptimizerDropped(t, requireResumeRefused(t, ctx, w, dir, resumeConfig{hidden: hidden, steps: 2, build: build}, want))
		assert.Equal(t, files, snapshot(t, dir), "the checkpoint changed")
	}
	try(2, 16, adam, "incompatible checkpoint")
	try(2, 32, onebitAdam, "shape")
	// One rank lost resumes on the other (TestRankChangeAutomatic), but
	// not with another optimizer, nor another model size.
	try(1, 16, adam, "incompatible checkpoint")
	try(1, 32, onebitAdam, "shape")
	try(2, 16, withShardedFreeze(5), "StateMode") // the moments are kept otherwise

	// A checkpoint of 1-bit Adam with sharded moments resumes only in
	// that state mode (on any number of ranks: TestRankChangeAutomatic).
	dir = t.TempDir()
	resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 4, build: withShardedFreeze(2)})
	files = snapshot(t, dir)
	try(1, 16, withFreeze(2), "StateMode")
	try(2, 16, withFreeze(2), "StateMode")

	// A checkpoint saved with Handler.Save after the lowbit state was saved.
	dir2 := t.TempDir()
	require.NoError(t, local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		store := newStore(int64(r))
		h, err := checkpoint.Build(store).Dir(filepath.Join(dir2, fmt.Sprintf("rank-%d", r))).Done()
		require.NoError(t, err)
		m := newRankModel(t, ctx, c, store, 16, adam)
		train.EveryNSteps(m.loop, 2, "lowbit", 100, m.opt.SaveOnStepFn(h))
		train.EveryNSteps(m.loop, 3, "direct", 200, h.SaveOnStepFn)
		_, err = m.loop.RunSteps(&shard{rank: r, world: 2}, 3)
		return err
	}))
	requireResumeRefused(t, ctx, 2, dir2, resumeConfig{hidden: 16, steps: 2, build: adam}, "global step 2, its model from step 3")
}

// snapshot returns the contents of every file under dir.
func snapshot(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	require.NoError(t, filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		out[p] = string(b)
		return err
	}))
	return out
}
