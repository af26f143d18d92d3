package gomlx

import (
	"context"
	"encoding/binary"
	"iter"
	"math"
	"math/rand/v2"
	_ "path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/layers/activation"
	"github.com/gomlx/gomlx/ml/model"
	_ "github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
		_, err := m.loop.RunSteps(ds, steps)
		run := &rankRun{losses: m.losses, err: err}
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
// falls, the ranks end bit-identical (0/1 Adam at a synchronization) and
// GoMLX's global step counts the steps.
func TestLoopEveryOptimizer(t *testing.T) {
	for _, tc := range []struct {
		name  string
		build Builder
	}{
		{"adam", adam}, {"lamb", lamb}, {"onebit-adam", onebitAdam}, {"onebit-lamb", onebitLamb},
		{"zeroone-adam", zeroOneAdam}, {"zero-adam", zeroAdam},
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
			}
			if tc.name != "zeroone-adam" {
				assert.Equal(t, runs[0].final, runs[1].final, "ranks differ")
			}
			for r, run := range runs {
				assert.Equal(t, int64(steps), int64(binary.LittleEndian.Uint64(run.final["/global_step"])), "rank %d", r)
			}
		})
	}
}
