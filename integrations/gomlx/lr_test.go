package gomlx

import (
	"context"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/gomlx/compute/dtypes"
	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/gomlx/gomlx/ml/train/optimizer/cosineschedule"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// rankSpec is one rank's GoMLX program in the tests that drive the
// Optimizer as a user does: train.NewTrainer, train.Loop, the lowbit
// optimizer build makes, the store's parameters, a model function (mlp(16)
// by default), the Optimizer's options, and more hooks.
type rankSpec struct {
	build  Builder
	params map[string]any
	model  func(scope *model.Scope, x *graph.Node) *graph.Node
	opts   []Option
	hook   func(m *rankModel)
}

// rankResult is what one rank of runSpecs reports.
type rankResult struct {
	losses []float32
	lrs    []float32         // Optimizer.LR after every step
	final  map[string][]byte // at the end, if the optimizer was built
	opt    *Optimizer
	err    error
}

// runSpecs trains steps on w in-process ranks, rank r running spec(r),
// each with a differently seeded store and its shard of the batch.
func runSpecs(t *testing.T, w, steps int, spec func(rank int) rankSpec) []*rankResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res := make([]*rankResult, w)
	var mu sync.Mutex
	_ = local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		s := spec(r)
		backend, err := gobackend.New("")
		require.NoError(t, err)
		defer backend.Finalize()
		opt, err := New(ctx, c, s.build, s.opts...)
		require.NoError(t, err)
		defer opt.Close()
		store := newStore(int64(100 + r))
		for k, v := range s.params {
			store.RootScope().SetParam(k, v)
		}
		fn := s.model
		if fn == nil {
			fn = mlp(16)
		}
		m := &rankModel{store: store, opt: opt}
		m.trainer = train.NewTrainer(backend, store, fn, loss.MeanSquaredError, opt, nil, nil)
		m.loop = train.NewLoop(m.trainer)
		opt.AttachToLoop(m.loop)
		out := &rankResult{opt: opt}
		m.loop.OnStep("record", 0, func(_ *train.Loop, metrics []*tensors.Tensor) error {
			out.losses = append(out.losses, metrics[0].Value().(float32))
			out.lrs = append(out.lrs, opt.LR())
			return nil
		})
		if s.hook != nil {
			s.hook(m)
		}
		_, out.err = m.loop.RunSteps(&shard{rank: r, world: w}, steps)
		if opt.Optimizer() != nil {
			out.final = variables(t, store) // also after an error of a step
		}
		mu.Lock()
		res[r] = out
		mu.Unlock()
		return out.err
	})
	return res
}

// builderLR is build with the learning rate lr in its config (1-bit Adam
// freezes at step 3, so that it compresses within the tests' steps; the
// outer optimizer's inner Adam takes lr, and it exchanges every 4 steps).
func builderLR(name string, lr float32) Builder {
	return func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		adam := optim.DefaultAdamConfig()
		adam.LR = lr
		switch name {
		case "adam":
			return optim.NewAdam(ctx, c, p, adam)
		case "outer":
			cfg := outer.DefaultConfig()
			cfg.H = 4
			return outer.NewAdam(ctx, c, p, cfg, adam)
		}
		cfg := onebit.DefaultAdamConfig()
		cfg.AdamConfig = adam
		cfg.FreezeStep = 3
		return onebit.NewAdam(ctx, c, p, cfg)
	}
}

// TestLearningRateFromStore: a GoMLX program that sets its learning rate
// the GoMLX way, store.SetParam(optimizer.ParamLearningRate, 0.05), on 2
// ranks with exact Adam, 1-bit Adam and the outer optimizer (its inner
// Adam) whose config says 0.01, trains
// bit-identically to the same program with 0.05 in the lowbit config and
// no store parameter, and not like the one with 0.01 (which is what it did
// before: the store's learning rate was ignored without a word).
func TestLearningRateFromStore(t *testing.T) {
	const steps = 8
	for _, name := range []string{"adam", "onebit-adam", "outer"} {
		t.Run(name, func(t *testing.T) {
			store := runSpecs(t, 2, steps, func(int) rankSpec {
				return rankSpec{build: builderLR(name, 0.01), params: map[string]any{optimizer.ParamLearningRate: 0.05}}
			})
			config := runSpecs(t, 2, steps, func(int) rankSpec { return rankSpec{build: builderLR(name, 0.05)} })
			ignored := runSpecs(t, 2, steps, func(int) rankSpec { return rankSpec{build: builderLR(name, 0.01)} })
			for r := range 2 {
				require.NoError(t, store[r].err, "rank %d", r)
				require.NoError(t, config[r].err, "rank %d", r)
				require.NoError(t, ignored[r].err, "rank %d", r)
				assert.Equal(t, config[r].final, store[r].final, "rank %d: the store's learning rate against the config's", r)
				assert.NotEqual(t, ignored[r].final, store[r].final, "rank %d: the store's learning rate was ignored", r)
				for s, lr := range store[r].lrs {
					assert.Equal(t, float32(0.05), lr, "rank %d, step %d", r, s+1)
				}
				assert.Equal(t, float32(0.01), ignored[r].lrs[0], "rank %d", r)
			}
		})
	}
}

// cosineModel is mlp(16) with GoMLX's cosine schedule in the model
// function, configured from the store, as GoMLX's examples use it.
func cosineModel(scope *model.Scope, x *graph.Node) *graph.Node {
	cosineschedule.New(scope, x.Graph(), dtypes.Float32).FromScope().Done()
	return mlp(16)(scope, x)
}

// cosineParams sets a cosine schedule with a warm-up: learning rate 0.05,
// warm-up 3 steps from the minimum, 0 (GoMLX's default), period 5 steps.
var cosineParams = map[string]any{
	optimizer.ParamLearningRate:     0.05,
	cosineschedule.ParamWarmUpSteps: 3,
	cosineschedule.ParamPeriodSteps: 5,
}

// TestLearningRateCosineSchedule: GoMLX's cosine schedule (cosineschedule
// in the model function, configured from the store) decides every step's
// learning rate on 2 ranks, exact Adam, 1-bit Adam and the outer
// optimizer (its inner Adam's; it exchanges every 4 steps): the learning rate
// handed to the lowbit optimizer at each step is the one GoMLX's own Adam
// uses in the same program on one process (its /optimizers/learning_rate
// after each step), the first warm-up step's 0 included (handed on as it
// is: no parameter moves in it); and the run differs from the one without
// the schedule.
func TestLearningRateCosineSchedule(t *testing.T) {
	const steps = 12
	// GoMLX's own Adam with the same schedule, one process.
	backend, err := gobackend.New("")
	require.NoError(t, err)
	defer backend.Finalize()
	store := newStore(1)
	for k, v := range cosineParams {
		store.RootScope().SetParam(k, v)
	}
	trainer := train.NewTrainer(backend, store, cosineModel, loss.MeanSquaredError, optimizer.Adam().Done(), nil, nil)
	loop := train.NewLoop(trainer)
	var want []float32
	loop.OnStep("lr", 0, func(*train.Loop, []*tensors.Tensor) error {
		want = append(want, store.GetVariable("/optimizers/learning_rate").MustValue().Value().(float32))
		return nil
	})
	_, err = loop.RunSteps(&shard{rank: 0, world: 1}, steps)
	require.NoError(t, err)
	require.Len(t, want, steps)
	require.Zero(t, want[0], "GoMLX's warm-up starts at 0")
	assert.InDelta(t, 0.05, want[3], 1e-7, "the end of the warm-up")
	assert.Less(t, want[5], want[4], "the cosine decays")

	for _, name := range []string{"adam", "onebit-adam", "outer"} {
		t.Run(name, func(t *testing.T) {
			var before [2][][]float32
			runs := runSpecs(t, 2, steps, func(r int) rankSpec {
				return rankSpec{build: builderLR(name, 0.01), params: cosineParams, model: cosineModel,
					hook: func(m *rankModel) {
						m.loop.OnStep("before", HookPriority-1, func(l *train.Loop, _ []*tensors.Tensor) error {
							if l.LoopStep == 0 {
								before[r] = trainable(t, m.store)
							}
							return nil
						})
						m.loop.OnStep("after", HookPriority+1, func(l *train.Loop, _ []*tensors.Tensor) error {
							if l.LoopStep == 0 {
								assert.Equal(t, before[r], trainable(t, m.store), "rank %d: a parameter moved at learning rate 0", r)
							}
							return nil
						})
					}}
			})
			plain := runSpecs(t, 2, steps, func(int) rankSpec { return rankSpec{build: builderLR(name, 0.05)} })
			for r := range 2 {
				require.NoError(t, runs[r].err, "rank %d", r)
				require.NoError(t, plain[r].err, "rank %d", r)
				got := runs[r].lrs
				require.Len(t, got, steps)
				assert.Zero(t, math.Float32bits(got[0]), "rank %d: step 1 runs at 0, not at a stand-in", r)
				assert.Equal(t, want, got, "rank %d: the learning rates against GoMLX's own Adam's", r)
				assert.NotEqual(t, plain[r].final, runs[r].final, "rank %d: the schedule changed nothing", r)
			}
			assert.Equal(t, runs[0].final, runs[1].final)
		})
	}
}

// TestLearningRateConflict: a lowbit schedule together with GoMLX's
// learning rate is refused at the first step, on every rank, with an
// error that says what to do, the outer optimizer's (its inner Adam's,
// which its state records under outer.InnerPrefix) too; so is GoMLX's
// learning rate set on one rank only.
func TestLearningRateConflict(t *testing.T) {
	for _, name := range []string{"adam", "outer"} {
		scheduled := func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			o, err := builderLR(name, 0.01)(ctx, c, p)
			if err != nil {
				return nil, err
			}
			s, err := optim.CosineDecay(0.01, 0.001, 100)
			if err == nil {
				err = o.(optim.LRSetter).SetSchedule(s)
			}
			return o, err
		}
		// A float32 parameter is named as the float32 it is.
		for _, lr := range []any{0.05, float32(0.05)} {
			runs := runSpecs(t, 2, 3, func(int) rankSpec {
				return rankSpec{build: scheduled, params: map[string]any{optimizer.ParamLearningRate: lr}}
			})
			for r, run := range runs {
				require.Error(t, run.err, "%s %T, rank %d", name, lr, r)
				assert.Contains(t, run.err.Error(), "lbgomlx: the store sets GoMLX's learning rate (learning_rate = 0.05) and the lowbit optimizer has a schedule", "%s %T, rank %d", name, lr, r)
				assert.Contains(t, run.err.Error(), "keep one", "%s %T, rank %d", name, lr, r)
				assert.Empty(t, run.losses, "%s %T, rank %d", name, lr, r)
			}
		}
	}

	runs := runSpecs(t, 2, 3, func(r int) rankSpec {
		s := rankSpec{build: adam}
		if r == 1 {
			s.params = map[string]any{optimizer.ParamLearningRate: 0.05}
		}
		return s
	})
	for r, run := range runs {
		require.Error(t, run.err, "rank %d", r)
		assert.Contains(t, run.err.Error(), "learning rate from: the lowbit optimizer (its config's LR, its schedule, or its checkpoint's) on rank 0 and GoMLX's learning_rate of the store on rank 1", "rank %d", r)
		assert.Contains(t, run.err.Error(), "learning rate: 0.01 on rank 0 and 0.05 on rank 1", "rank %d", r)
		assert.Empty(t, run.losses, "rank %d", r)
	}
}

// TestLearningRateEachStep: the ranks' learning rates are compared at
// every step, in the per-step agreement: GoMLX's learning rate changed on
// rank 1 only before the hook of step 3 stops that step on every rank,
// before any variable changes, with an error naming both values.
func TestLearningRateEachStep(t *testing.T) {
	var mu sync.Mutex
	before := map[int]map[string][]byte{}
	runs := runSpecs(t, 2, 5, func(r int) rankSpec {
		return rankSpec{build: withFreeze(2), params: map[string]any{optimizer.ParamLearningRate: 0.05},
			hook: func(m *rankModel) {
				m.loop.OnStep("change lr", HookPriority-1, func(l *train.Loop, _ []*tensors.Tensor) error {
					if l.LoopStep == 2 {
						mu.Lock()
						before[r] = variables(t, m.store)
						mu.Unlock()
						if r == 1 {
							return m.store.GetVariable("/optimizers/learning_rate").SetValue(tensors.FromScalar(float32(0.5)))
						}
					}
					return nil
				})
			}}
	})
	for r, run := range runs {
		require.Error(t, run.err, "rank %d", r)
		assert.Contains(t, run.err.Error(), "lbgomlx: global step 3: the ranks' learning rates differ, from 0.05 to 0.5", "rank %d", r)
		assert.Len(t, run.losses, 2, "rank %d", r)
		assert.Equal(t, int64(2), run.opt.Optimizer().Stats().Steps, "rank %d", r)
		assert.Equal(t, before[r], run.final, "rank %d: a variable changed", r)
	}
}

// TestLearningRateStoreRefused: a learning_rate in the store that is not
// a finite number in float32 (NaN, ±Inf, beyond float32's range), on
// every rank or on one, is an error on every rank at the first step,
// before the lowbit optimizer is built or any step runs (a NaN trained at
// the config's LR without a word); a negative one is refused too, printed
// as the float32 it is (-0.01, not -0.009999999776482582), as a float32
// parameter is where the error names it.
func TestLearningRateStoreRefused(t *testing.T) {
	for _, tc := range []struct {
		name   string
		lr     any
		rank1  bool // set on rank 1 only
		want   string
		others string // rank 0's error when it is not want
	}{
		{"NaN", math.NaN(), false, "lbgomlx: GoMLX's learning_rate parameter of the store is NaN, want finite and >= 0", ""},
		{"+Inf", math.Inf(1), false, "parameter of the store is +Inf, want finite", ""},
		{"-Inf", float32(math.Inf(-1)), false, "parameter of the store is -Inf, want finite", ""},
		{"1e39", 1e39, false, "parameter of the store is 1e+39, want finite and >= 0 (in float32)", ""},
		{"NaN string", "NaN", false, "parameter of the store is NaN, want finite", ""},
		{"NaN on rank 1", math.NaN(), true, "parameter of the store is NaN, want finite", "lbgomlx: rank 1 failed at the first training step"},
		{"-0.01", -0.01, false, "lbgomlx: GoMLX's learning rate /optimizers/learning_rate is -0.01, want finite and >= 0", ""},
		{"float32 -0.01", float32(-0.01), false, "lbgomlx: GoMLX's learning rate /optimizers/learning_rate is -0.01, want finite and >= 0", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runs := runSpecs(t, 2, 3, func(r int) rankSpec {
				s := rankSpec{build: adam}
				if !tc.rank1 || r == 1 {
					s.params = map[string]any{optimizer.ParamLearningRate: tc.lr}
				}
				return s
			})
			for r, run := range runs {
				require.Error(t, run.err, "rank %d", r)
				want := tc.want
				if r == 0 && tc.others != "" {
					want = tc.others
				}
				assert.Contains(t, run.err.Error(), want, "rank %d", r)
				assert.NotContains(t, run.err.Error(), "0.00999", "rank %d", r)
				assert.Empty(t, run.losses, "rank %d", r)
				if run.opt.Optimizer() != nil {
					assert.Zero(t, run.opt.Optimizer().Stats().Steps, "rank %d", r)
				}
			}
		})
	}
}
