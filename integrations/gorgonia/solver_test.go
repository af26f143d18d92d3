package gorgonia

import (
	"context"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"

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

// data returns rows [lo, hi) of a fixed regression data set.
func data(lo, hi int) (x, y *tensor.Dense) {
	rng := rand.New(rand.NewPCG(1, 2))
	xs := make([]float32, rows*features)
	ys := make([]float32, rows)
	for r := range rows {
		var s float64
		for f := range features {
			xs[r*features+f] = float32(rng.NormFloat64())
			s += float64(xs[r*features+f]) * float64(f%3-1)
		}
		ys[r] = float32(math.Sin(s))
	}
	return tensor.New(tensor.WithShape(hi-lo, features), tensor.WithBacking(append([]float32(nil), xs[lo*features:hi*features]...))),
		tensor.New(tensor.WithShape(hi-lo, 1), tensor.WithBacking(append([]float32(nil), ys[lo:hi]...)))
}

// net is a two-layer perceptron with a mean squared error loss in a
// Gorgonia graph; its weights are drawn from seed.
type net struct {
	g       *G.ExprGraph
	x, y    *G.Node
	w1, w2  *G.Node
	cost    *G.Node
	machine G.VM
}

func newNet(t testing.TB, seed uint64, n int) *net {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 9))
	weights := func(r, c int) *tensor.Dense {
		d := make([]float32, r*c)
		for i := range d {
			d[i] = float32(rng.NormFloat64() / math.Sqrt(float64(r)))
		}
		return tensor.New(tensor.WithShape(r, c), tensor.WithBacking(d))
	}
	m := &net{g: G.NewGraph()}
	m.x = G.NewMatrix(m.g, tensor.Float32, G.WithShape(n, features), G.WithName("x"))
	m.y = G.NewMatrix(m.g, tensor.Float32, G.WithShape(n, 1), G.WithName("y"))
	m.w1 = G.NewMatrix(m.g, tensor.Float32, G.WithShape(features, hidden), G.WithName("w1"), G.WithValue(weights(features, hidden)))
	m.w2 = G.NewMatrix(m.g, tensor.Float32, G.WithShape(hidden, 1), G.WithName("w2"), G.WithValue(weights(hidden, 1)))
	h := G.Must(G.Rectify(G.Must(G.Mul(m.x, m.w1))))
	pred := G.Must(G.Mul(h, m.w2))
	m.cost = G.Must(G.Mean(G.Must(G.Square(G.Must(G.Sub(pred, m.y))))))
	_, err := G.Grad(m.cost, m.w1, m.w2)
	require.NoError(t, err)
	m.machine = G.NewTapeMachine(m.g, G.BindDualValues(m.w1, m.w2))
	return m
}

func (m *net) model() []G.ValueGrad { return []G.ValueGrad{m.w1, m.w2} }

// forward runs the graph on x, y and returns the loss.
func (m *net) forward(t testing.TB, x, y *tensor.Dense) float32 {
	t.Helper()
	require.NoError(t, G.Let(m.x, x))
	require.NoError(t, G.Let(m.y, y))
	m.machine.Reset()
	require.NoError(t, m.machine.RunAll())
	return m.cost.Value().Data().(float32)
}

func (m *net) values() [][]float32 {
	var out [][]float32
	for _, n := range m.model() {
		out = append(out, append([]float32(nil), n.Value().Data().([]float32)...))
	}
	return out
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

type rankRun struct {
	losses []float32
	init   [][]float32
	final  [][]float32
	stats  optim.Stats
}

// train runs steps on w in-process ranks, each with differently drawn
// weights and its shard of the batch; poison, if not nil, may change a
// rank's labels before a step.
func train(t *testing.T, w, steps int, newOpt NewOptimizer, poison func(rank, step int, y *tensor.Dense) *tensor.Dense) []*rankRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	runs := make([]*rankRun, w)
	var mu sync.Mutex
	err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		x, y := data(r*rows/w, (r+1)*rows/w)
		m := newNet(t, uint64(100+r), rows/w)
		defer m.machine.Close()
		s, err := NewSolver(ctx, c, newOpt)
		require.NoError(t, err)
		require.NoError(t, s.Init(ctx, m.model()))
		run := &rankRun{init: m.values()}
		for i, p := range s.Params() {
			require.Same(t, m.model()[i].Value(), p.Value, "the parameter is the node's own tensor")
		}
		for step := range steps {
			ys := y
			if poison != nil {
				ys = poison(r, step, y)
			}
			run.losses = append(run.losses, m.forward(t, x, ys))
			require.NoError(t, s.Step(m.model()))
			for _, n := range m.model() {
				gr, err := n.Grad()
				require.NoError(t, err)
				for _, v := range gr.Data().([]float32) {
					require.Zero(t, v, "gradients are zeroed after the step")
				}
			}
		}
		run.final, run.stats = m.values(), s.Optimizer().Stats()
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

func TestDataParallel(t *testing.T) {
	for _, c := range []struct {
		name string
		opt  NewOptimizer
	}{{"adam", adam}, {"onebit-adam", onebitAdam}} {
		t.Run(c.name, func(t *testing.T) {
			const steps = 30
			runs := train(t, 4, steps, c.opt, nil)
			for r, run := range runs {
				assert.Equal(t, runs[0].init, run.init, "rank %d starts from rank 0's values", r)
				assert.Equal(t, runs[0].final, run.final, "rank %d ends bit-identical to rank 0", r)
				assert.Equal(t, int64(steps), run.stats.Steps)
			}
			first, last := meanLoss(runs, 0), meanLoss(runs, steps-1)
			assert.Less(t, last, first/2, "loss falls: %.4f -> %.4f", first, last)
		})
	}
}

// TestMatchesOneRank: exact Adam on 4 quarter batches follows 1 rank on the
// whole batch.
func TestMatchesOneRank(t *testing.T) {
	const steps = 10
	one := train(t, 1, steps, adam, nil)
	four := train(t, 4, steps, adam, nil)
	require.Equal(t, one[0].init, four[0].init)
	for s := range steps {
		assert.InDelta(t, meanLoss(one, s), meanLoss(four, s), 1e-4*max(1, meanLoss(one, s)), "step %d", s)
	}
	for i := range one[0].final {
		assert.InDeltaSlice(t, one[0].final[i], four[0].final[i], 1e-4)
	}
}

func TestNonFiniteSkipped(t *testing.T) {
	const bad = 3
	runs := train(t, 4, 6, onebitAdam, func(rank, step int, y *tensor.Dense) *tensor.Dense {
		if rank != 1 || step != bad {
			return y
		}
		d := append([]float32(nil), y.Data().([]float32)...)
		d[0] = float32(math.Inf(1))
		return tensor.New(tensor.WithShape(y.Shape()...), tensor.WithBacking(d))
	})
	for r, run := range runs {
		assert.Equal(t, int64(1), run.stats.Skipped, "rank %d", r)
		assert.Equal(t, runs[0].final, run.final)
	}
}

// TestModelMismatch: ranks with different models, and a model that changes
// between steps, get errors on every rank and nothing changes.
func TestModelMismatch(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	errs := make([]error, 2)
	_ = local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		m := newNet(t, 1, 4)
		model := m.model()
		if c.Rank() == 1 {
			model = model[:1]
		}
		s, err := NewSolver(ctx, c, adam)
		require.NoError(t, err)
		errs[c.Rank()] = s.Init(ctx, model)
		return errs[c.Rank()]
	})
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "models differ", "rank %d", r)
	}

	errs = make([]error, 2)
	before := make([][][]float32, 2)
	after := make([][][]float32, 2)
	_ = local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		m := newNet(t, 1, 4)
		x, y := data(0, 4)
		s, err := NewSolver(ctx, c, adam)
		require.NoError(t, err)
		require.NoError(t, s.Init(ctx, m.model()))
		m.forward(t, x, y)
		model := m.model()
		if c.Rank() == 0 {
			model = []G.ValueGrad{m.w2, m.w1} // swapped: other shapes
		}
		before[c.Rank()] = m.values()
		errs[c.Rank()] = s.Step(model)
		after[c.Rank()] = m.values()
		return nil
	})
	assert.ErrorContains(t, errs[0], `"w1" changed shape from (8, 16) to (16, 1)`)
	assert.ErrorContains(t, errs[1], "another rank's model changed")
	assert.Equal(t, before, after, "nothing changed")
}

func TestErrors(t *testing.T) {
	ctx := context.Background()
	_, err := NewSolver(ctx, nil, nil)
	assert.ErrorContains(t, err, "nil optimizer")
	//lint:ignore SA1012 testing the nil check
	_, err = NewSolver(nil, nil, adam) //nolint:staticcheck
	assert.ErrorContains(t, err, "nil context")

	g := G.NewGraph()
	sc := G.NewScalar(g, tensor.Float32, G.WithName("s"), G.WithValue(float32(1)))
	s, err := NewSolver(ctx, nil, adam)
	require.NoError(t, err)
	assert.ErrorContains(t, s.Step([]G.ValueGrad{sc}), "lowbit trains float32 *tensor.Dense values")
	assert.ErrorContains(t, s.Step(nil), "empty model")

	m := newNet(t, 1, 4)
	unbound := G.NewMatrix(m.g, tensor.Float32, G.WithShape(2, 2), G.WithName("u"), G.WithValue(tensor.New(tensor.WithShape(2, 2), tensor.Of(tensor.Float32))))
	assert.ErrorContains(t, s.Step([]G.ValueGrad{unbound}), "has no float32 gradient")
}

// TestStepAllocs: a step on one rank allocates nothing.
func TestStepAllocs(t *testing.T) {
	m := newNet(t, 1, 8)
	x, y := data(0, 8)
	s, err := NewSolver(context.Background(), nil, adam)
	require.NoError(t, err)
	m.forward(t, x, y)
	model := m.model()
	require.NoError(t, s.Step(model))
	allocs := testing.AllocsPerRun(20, func() {
		if err := s.Step(model); err != nil {
			t.Fatal(err)
		}
	})
	assert.Zero(t, allocs)
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
	m := newNet(t, 1, 8)
	defer m.machine.Close()
	x, y := data(0, 8)
	s, err := NewSolver(ctx, nil, counted)
	require.NoError(t, err)
	m.forward(t, x, y)
	require.NoError(t, s.Step(m.model()))
	require.NoError(t, s.Close())
	require.NoError(t, s.Close())
	assert.Positive(t, closes, "Close reaches the optimizer")
	m.forward(t, x, y)
	assert.ErrorIs(t, s.Step(m.model()), optim.ErrClosed)

	// Closed before the optimizer exists: Init refuses to build one.
	s, err = NewSolver(ctx, nil, counted)
	require.NoError(t, err)
	require.NoError(t, s.Close())
	assert.ErrorIs(t, s.Init(ctx, m.model()), optim.ErrClosed)
}
