package gomlx

import (
	"context"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/gomlx/compute"
	"github.com/gomlx/compute/dtypes"
	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/compute/shapes"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/layers/activation"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

const (
	features = 8
	hidden   = 16
	rows     = 64 // global batch
)

// regression is a two-layer perceptron with a mean squared error loss.
func regression(scope *model.Scope, in []*graph.Node) *graph.Node {
	x, y := in[0], in[1]
	h := activation.Relu(layers.DenseWithBias(scope.In("hidden"), x, hidden))
	out := layers.DenseWithBias(scope.In("out"), h, 1)
	return graph.ReduceAllMean(graph.Square(graph.Sub(out, y)))
}

// batch returns rows [lo, hi) of a fixed regression data set.
func batch(lo, hi int) (x, y *tensors.Tensor) {
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

func newBackend(t testing.TB) compute.Backend {
	t.Helper()
	b, err := gobackend.New("")
	require.NoError(t, err)
	return b
}

// newStore returns a store whose initializer is seeded by seed, so that
// ranks start from different values unless the Trainer broadcasts.
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

func onebitAdam(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
	cfg := onebit.DefaultAdamConfig()
	cfg.LR = 1e-2
	cfg.FreezeStep = 5
	return onebit.NewAdam(ctx, c, p, cfg)
}

// values returns copies of the trainer's variables' values.
func values(t testing.TB, tr *Trainer) [][]float32 {
	t.Helper()
	var out [][]float32
	for _, v := range tr.vars {
		val, err := v.Value()
		require.NoError(t, err)
		d, err := tensors.CopyFlatData[float32](val)
		require.NoError(t, err)
		out = append(out, d)
	}
	return out
}

// rankRun is what one rank of a test run reports.
type rankRun struct {
	losses  []float32
	init    [][]float32 // variables after Init
	final   [][]float32 // variables at the end
	stats   optim.Stats
	stepErr []error
}

// train runs steps on w in-process ranks, each with a differently seeded
// store and its shard of the batch; hook, if not nil, runs on every rank
// before every step and may replace the inputs.
func train(t *testing.T, w, steps int, newOpt NewOptimizer, hook func(rank, step int, tr *Trainer, x, y *tensors.Tensor) (*tensors.Tensor, *tensors.Tensor)) []*rankRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	runs := make([]*rankRun, w)
	var mu sync.Mutex
	err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		tr, err := New(c, newBackend(t), newStore(int64(100+r)), regression, newOpt)
		if err != nil {
			return err
		}
		x, y := batch(r*rows/w, (r+1)*rows/w)
		if err := tr.Init(ctx, x, y); err != nil {
			return err
		}
		run := &rankRun{init: values(t, tr)}
		for s := range steps {
			xs, ys := x, y
			if hook != nil {
				xs, ys = hook(r, s, tr, x, y)
			}
			loss, err := tr.Step(ctx, xs, ys)
			run.stepErr = append(run.stepErr, err)
			run.losses = append(run.losses, loss)
		}
		run.final = values(t, tr)
		run.stats = tr.Optimizer().Stats()
		mu.Lock()
		runs[r] = run
		mu.Unlock()
		return nil
	})
	require.NoError(t, err)
	return runs
}

func meanLoss(runs []*rankRun, step int) float64 {
	var s float64
	for _, r := range runs {
		s += float64(r.losses[step])
	}
	return s / float64(len(runs))
}

// TestDataParallel trains on 4 ranks whose initializers are seeded
// differently: after Init every rank holds rank 0's values, the loss falls,
// and the ranks stay bit-identical, with exact and with 1-bit Adam.
func TestDataParallel(t *testing.T) {
	for _, c := range []struct {
		name string
		opt  NewOptimizer
	}{{"adam", adam}, {"onebit-adam", onebitAdam}} {
		t.Run(c.name, func(t *testing.T) {
			const steps = 30
			runs := train(t, 4, steps, c.opt, nil)
			for r, run := range runs {
				require.Len(t, run.stepErr, steps)
				for s, err := range run.stepErr {
					require.NoError(t, err, "rank %d step %d", r, s)
				}
				assert.Equal(t, runs[0].init, run.init, "rank %d starts from rank 0's values", r)
				assert.Equal(t, runs[0].final, run.final, "rank %d ends bit-identical to rank 0", r)
				assert.Equal(t, int64(steps), run.stats.Steps)
				assert.Zero(t, run.stats.Skipped)
			}
			first, last := meanLoss(runs, 0), meanLoss(runs, steps-1)
			assert.Less(t, last, first/2, "loss falls: %.4f -> %.4f", first, last)
			if c.name == "onebit-adam" {
				assert.Equal(t, optim.StageCompression, runs[0].stats.Stage)
			}
		})
	}
}

// TestMatchesOneRank: with exact Adam, 4 ranks on quarter batches follow
// the loss curve of 1 rank on the whole batch (the mean of the shards'
// mean-loss gradients is the whole batch's).
func TestMatchesOneRank(t *testing.T) {
	const steps = 10
	one := train(t, 1, steps, adam, nil)
	four := train(t, 4, steps, adam, nil)
	require.Equal(t, one[0].init, four[0].init, "seed 100 is rank 0's in both")
	for s := range steps {
		assert.InDelta(t, meanLoss(one, s), meanLoss(four, s), 1e-4*max(1, meanLoss(one, s)), "step %d", s)
	}
	for i := range one[0].final {
		assert.InDeltaSlice(t, one[0].final[i], four[0].final[i], 1e-4)
	}
}

// TestNonFiniteSkipped: a NaN in one rank's batch skips that step on every
// rank, changes no variable, and training goes on.
func TestNonFiniteSkipped(t *testing.T) {
	const steps, bad = 6, 3
	var before [][][]float32 = make([][][]float32, 4)
	var after [][][]float32 = make([][][]float32, 4)
	var mu sync.Mutex
	runs := train(t, 4, steps, onebitAdam, func(rank, step int, tr *Trainer, x, y *tensors.Tensor) (*tensors.Tensor, *tensors.Tensor) {
		mu.Lock()
		defer mu.Unlock()
		switch step {
		case bad:
			before[rank] = values(t, tr)
		case bad + 1:
			after[rank] = values(t, tr)
		}
		if step == bad && rank == 2 {
			d := tensors.MustCopyFlatData[float32](y)
			d[0] = float32(math.NaN())
			return x, tensors.FromFlatDataAndDimensions(d, y.Shape().Dimensions...)
		}
		return x, y
	})
	for r, run := range runs {
		for s, err := range run.stepErr {
			require.NoError(t, err, "rank %d step %d", r, s)
		}
		assert.Equal(t, int64(1), run.stats.Skipped, "rank %d", r)
		assert.Equal(t, before[r], after[r], "rank %d: the skipped step changed nothing", r)
		assert.Equal(t, runs[0].final, run.final)
	}
	assert.True(t, math.IsNaN(float64(runs[2].losses[bad])))
}

// TestShapeChange: a variable reshaped between steps on one rank gives an
// error on every rank and changes nothing anywhere; the next steps with
// the variable restored go on.
func TestShapeChange(t *testing.T) {
	const steps, bad = 4, 2
	var kept *tensors.Tensor
	var before, after [][][]float32 = make([][][]float32, 3), make([][][]float32, 3)
	var mu sync.Mutex
	runs := train(t, 3, steps, adam, func(rank, step int, tr *Trainer, x, y *tensors.Tensor) (*tensors.Tensor, *tensors.Tensor) {
		mu.Lock()
		defer mu.Unlock()
		v := tr.vars[0]
		switch {
		case step == bad:
			before[rank] = values(t, tr)
			if rank == 1 {
				kept = v.MustValue()
				require.NoError(t, v.SetValuePreservingOld(tensors.FromShape(shapes.Make(dtypes.Float32, 3, 3))))
			}
		case step == bad+1:
			if rank == 1 {
				require.NoError(t, v.SetValuePreservingOld(kept))
			}
			after[rank] = values(t, tr)
		}
		return x, y
	})
	for r, run := range runs {
		require.Error(t, run.stepErr[bad], "rank %d", r)
		if r == 1 {
			assert.Contains(t, run.stepErr[bad].Error(), "changed shape from")
			assert.Contains(t, run.stepErr[bad].Error(), "no variable changed")
		} else {
			assert.Contains(t, run.stepErr[bad].Error(), "another rank failed")
			assert.Equal(t, before[r], after[r], "rank %d: nothing changed", r)
		}
		for s, err := range run.stepErr {
			if s != bad {
				require.NoError(t, err, "rank %d step %d", r, s)
			}
		}
		assert.Equal(t, int64(steps-1), run.stats.Steps, "the failed step never reached the optimizer")
		assert.Equal(t, runs[0].final, run.final)
	}
}

// TestDifferentModels: ranks whose models differ are told so on every rank.
func TestDifferentModels(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	errs := make([]error, 2)
	_ = local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		loss := regression
		if c.Rank() == 1 {
			loss = func(scope *model.Scope, in []*graph.Node) *graph.Node {
				out := layers.DenseWithBias(scope.In("out"), in[0], 1)
				return graph.ReduceAllMean(graph.Square(graph.Sub(out, in[1])))
			}
		}
		tr, err := New(c, newBackend(t), newStore(1), loss, adam)
		require.NoError(t, err)
		x, y := batch(0, 8)
		_, errs[c.Rank()] = tr.Step(ctx, x, y)
		return errs[c.Rank()]
	})
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "other trainable variables", "rank %d", r)
	}
}

// TestCheckpoint: State after some steps, then Init and Load in a fresh
// trainer, continues bit-identically to the uninterrupted run.
func TestCheckpoint(t *testing.T) {
	const steps, cut = 12, 7
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	whole := train(t, 2, steps, onebitAdam, nil)
	err := local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		x, y := batch(r*rows/2, (r+1)*rows/2)
		b := newBackend(t)
		tr, err := New(c, b, newStore(int64(100+r)), regression, onebitAdam)
		require.NoError(t, err)
		for range cut {
			_, err := tr.Step(ctx, x, y)
			require.NoError(t, err)
		}
		ck, err := tr.State()
		require.NoError(t, err)

		// A fresh model with other initial values resumes.
		tr2, err := New(c, b, newStore(int64(7+r)), regression, onebitAdam)
		require.NoError(t, err)
		require.NoError(t, tr2.Init(ctx, x, y))
		require.NoError(t, tr2.Load(ck))
		for range steps - cut {
			_, err := tr2.Step(ctx, x, y)
			require.NoError(t, err)
		}
		assert.Equal(t, whole[r].final, values(t, tr2), "rank %d", r)
		return nil
	})
	require.NoError(t, err)
}

func TestNewErrors(t *testing.T) {
	b := newBackend(t)
	s := model.NewStore()
	for _, c := range []struct {
		name string
		err  func() error
		want string
	}{
		{"backend", func() error { _, err := New(nil, nil, s, regression, adam); return err }, "nil backend"},
		{"store", func() error { _, err := New(nil, b, nil, regression, adam); return err }, "nil model.Store"},
		{"loss", func() error { _, err := New(nil, b, s, nil, adam); return err }, "nil loss"},
		{"optimizer", func() error { _, err := New(nil, b, s, regression, nil); return err }, "nil optimizer"},
	} {
		err := c.err()
		require.Error(t, err, c.name)
		assert.Contains(t, err.Error(), c.want)
	}
	tr, err := New(nil, b, s, regression, adam)
	require.NoError(t, err)
	_, err = tr.State()
	assert.ErrorContains(t, err, "before Init")
	// A graph that cannot be built is an error, not a panic.
	x, _ := batch(0, 4)
	_, err = tr.Step(context.Background(), x)
	assert.ErrorContains(t, err, "building the graph")
}

// linear is a loss whose gradients are its inputs, bit for bit: the sum of
// w*gw plus the sum of b*gb, so that d/dw = gw and d/db = gb.
func linear(scope *model.Scope, in []*graph.Node) *graph.Node {
	w := scope.VariableWithShape("w", shapes.Make(dtypes.Float32, 3, 4)).NodeValue(in[0].Graph())
	b := scope.VariableWithShape("b", shapes.Make(dtypes.Float32, 5)).NodeValue(in[0].Graph())
	return graph.Add(graph.ReduceAllSum(graph.Mul(w, in[0])), graph.ReduceAllSum(graph.Mul(b, in[1])))
}

// linearGrads returns the gradients rank r feeds at step s.
func linearGrads(r, s int) (gw, gb []float32) {
	rng := rand.New(rand.NewPCG(uint64(r), uint64(s)))
	gw, gb = make([]float32, 12), make([]float32, 5)
	for i := range gw {
		gw[i] = float32(rng.NormFloat64())
	}
	for i := range gb {
		gb[i] = float32(rng.NormFloat64())
	}
	return gw, gb
}

// TestEqualsHostStep: a Trainer step is exactly the lowbit optimizer's Step
// on host parameters holding rank 0's initial values and each rank's graph
// gradients: the gradients reach the right parameters, the lowbit
// optimizer averages them over the ranks, and the results come back into
// the variables, bit for bit, for exact and for 1-bit Adam (its warm-up and
// its compression stage).
func TestEqualsHostStep(t *testing.T) {
	const w, steps = 4, 8
	onebitEarly := func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.LR, cfg.FreezeStep = 1e-2, 3
		return onebit.NewAdam(ctx, c, p, cfg)
	}
	for _, c := range []struct {
		name string
		opt  NewOptimizer
	}{{"adam", adam}, {"onebit-adam", onebitEarly}} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			names := make([]string, 2)
			var init [][]float32
			got := make([][][][]float32, w) // [rank][step] variables
			var mu sync.Mutex
			require.NoError(t, local.Run(ctx, w, func(ctx context.Context, cm comm.Comm) error {
				r := cm.Rank()
				tr, err := New(cm, newBackend(t), newStore(int64(10+r)), linear, c.opt)
				require.NoError(t, err)
				for s := range steps {
					gw, gb := linearGrads(r, s)
					xw := tensors.FromFlatDataAndDimensions(gw, 3, 4)
					xb := tensors.FromFlatDataAndDimensions(gb, 5)
					if s == 0 {
						require.NoError(t, tr.Init(ctx, xw, xb))
						if r == 0 {
							mu.Lock()
							init = values(t, tr)
							for i, p := range tr.Params() {
								names[i] = p.Name
							}
							mu.Unlock()
						}
					}
					_, err := tr.Step(ctx, xw, xb)
					require.NoError(t, err)
					v := values(t, tr)
					mu.Lock()
					got[r] = append(got[r], v)
					mu.Unlock()
				}
				return nil
			}))
			require.Len(t, init, 2)

			// The reference: the lowbit optimizer alone, on the host.
			want := make([][][][]float32, w)
			require.NoError(t, local.Run(ctx, w, func(ctx context.Context, cm comm.Comm) error {
				r := cm.Rank()
				params := make([]*optim.Param, 2)
				for i := range params {
					dims := []int{3, 4}
					if len(init[i]) == 5 {
						dims = []int{5}
					}
					p, err := optim.NewParamFrom(names[i], append([]float32(nil), init[i]...), dims...)
					require.NoError(t, err)
					params[i] = p
				}
				opt, err := c.opt(ctx, cm, params)
				require.NoError(t, err)
				for s := range steps {
					gw, gb := linearGrads(r, s)
					for _, p := range params {
						if p.Numel() == 12 {
							copy(p.GradData(), gw)
						} else {
							copy(p.GradData(), gb)
						}
					}
					require.NoError(t, opt.Step(ctx))
					var v [][]float32
					for _, p := range params {
						v = append(v, append([]float32(nil), p.Data()...))
					}
					mu.Lock()
					want[r] = append(want[r], v)
					mu.Unlock()
				}
				if c.name == "onebit-adam" {
					assert.Equal(t, optim.StageCompression, opt.Stats().Stage)
				}
				return nil
			}))
			for r := range w {
				assert.Equal(t, want[r], got[r], "rank %d", r)
			}
			assert.NotEqual(t, init, got[0][steps-1], "the variables moved")
		})
	}
}

// closeCounter counts the Close calls that reach the optimizer.
type closeCounter struct {
	optim.Optimizer
	n *int
}

func (c closeCounter) Close() error {
	*c.n++
	return c.Optimizer.Close()
}

// TestClose: Close reaches the optimizer, is idempotent, and Step and
// Init fail after it with optim.ErrClosed.
func TestClose(t *testing.T) {
	ctx := context.Background()
	closes := 0
	counted := func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		o, err := adam(ctx, c, p)
		return closeCounter{o, &closes}, err
	}
	b := newBackend(t)
	x, y := batch(0, 8)
	tr, err := New(nil, b, newStore(1), regression, counted)
	require.NoError(t, err)
	_, err = tr.Step(ctx, x, y)
	require.NoError(t, err)
	require.NoError(t, tr.Close())
	require.NoError(t, tr.Close())
	assert.Positive(t, closes, "Close reaches the optimizer")
	_, err = tr.Step(ctx, x, y)
	assert.ErrorIs(t, err, optim.ErrClosed)

	tr, err = New(nil, b, newStore(1), regression, counted)
	require.NoError(t, err)
	require.NoError(t, tr.Close())
	assert.ErrorIs(t, tr.Init(ctx, x, y), optim.ErrClosed)
}
