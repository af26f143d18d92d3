package optim

import (
	"context"
	"math"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// refAdam is Adam/AdamW in float64, written from the formulas.
type refAdam struct {
	cfg     AdamConfig
	p, m, v []float64
	t       int
}

func (r *refAdam) step(g []float32) {
	r.t++
	b1, b2 := float64(r.cfg.Beta1), float64(r.cfg.Beta2)
	bc1, bc2 := 1.0, 1.0
	if r.cfg.BiasCorrection {
		bc1 = 1 - math.Pow(b1, float64(r.t))
		bc2 = 1 - math.Pow(b2, float64(r.t))
	}
	for i := range r.p {
		gi := float64(g[i])
		r.m[i] = b1*r.m[i] + (1-b1)*gi
		r.v[i] = b2*r.v[i] + (1-b2)*gi*gi
		u := (r.m[i]/bc1)/(math.Sqrt(r.v[i]/bc2)+float64(r.cfg.Eps)) + float64(r.cfg.WeightDecay)*r.p[i]
		r.p[i] -= float64(r.cfg.LR) * u
	}
}

// adamCasesRef are the settings the float64 reference tests of Adam run.
var adamCasesRef = []struct {
	name string
	cfg  func(*AdamConfig)
}{
	{"adam", func(*AdamConfig) {}},
	{"adamw", func(c *AdamConfig) { c.WeightDecay = 0.1 }},
	{"no-bias-correction", func(c *AdamConfig) { c.BiasCorrection = false }},
	{"large-lr", func(c *AdamConfig) { c.LR = 0.05; c.Beta1 = 0.5; c.Beta2 = 0.9 }},
}

func TestAdamMatchesFloat64Reference(t *testing.T) {
	for _, tc := range adamCasesRef {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultAdamConfig()
			tc.cfg(&cfg)
			ps := testParams(t, 1, []int{3, 5})
			ref := &refAdam{cfg: cfg, p: make([]float64, 15), m: make([]float64, 15), v: make([]float64, 15)}
			for i, x := range ps[0].Data() {
				ref.p[i] = float64(x)
			}
			opt, err := NewAdam(context.Background(), nil, ps, cfg)
			require.NoError(t, err)
			for s := 1; s <= 20; s++ {
				fillGrads(ps, 0, s)
				ref.step(ps[0].GradData())
				require.NoError(t, opt.Step(context.Background()))
				for i, x := range ps[0].Data() {
					require.InDelta(t, ref.p[i], float64(x), 2e-6, "step %d element %d", s, i)
				}
			}
			st := opt.Stats()
			assert.Equal(t, int64(20), st.Steps)
			assert.Equal(t, StageExact, st.Stage)
			assert.Zero(t, st.BytesSent)
		})
	}
}

// With a constant gradient g and bias correction, m_hat = g and v_hat = g^2
// at every step, so Adam moves each element by lr*g/(|g|+eps) per step, plus
// lr*wd*p for AdamW.
func TestAdamConstantGradientByHand(t *testing.T) {
	cfg := DefaultAdamConfig()
	cfg.LR = 0.01
	cfg.WeightDecay = 0.5
	p, err := NewParamFrom("w", []float32{1, -2, 0.5}, 3)
	require.NoError(t, err)
	copy(p.GradData(), []float32{2, -0.25, 4})
	opt, err := NewAdam(context.Background(), nil, []*Param{p}, cfg)
	require.NoError(t, err)
	want := []float64{1, -2, 0.5}
	g := []float64{2, -0.25, 4}
	for s := 1; s <= 3; s++ {
		require.NoError(t, opt.Step(context.Background()))
		for i := range want {
			want[i] -= 0.01 * (g[i]/(math.Abs(g[i])+1e-8) + 0.5*want[i])
			assert.InDelta(t, want[i], float64(p.Data()[i]), 1e-6, "step %d element %d", s, i)
		}
	}
	// The first element by hand: p1 = 1 - 0.01*(1 + 0.5*1) = 0.985, then p2, p3 likewise.
	assert.InDelta(t, 0.985-0.01*(1+0.5*0.985)-0.01*(1+0.5*(0.985-0.01*(1+0.5*0.985))), float64(p.Data()[0]), 1e-6)
}

func TestAdamAveragesGradientsOverRanks(t *testing.T) {
	const w = 3
	cfg := DefaultAdamConfig()
	cfg.LR = 0.01
	// Single-process reference fed the mean gradient.
	ref := testParams(t, 2, []int{4, 4}, []int{7})
	refOpt, err := NewAdam(context.Background(), nil, ref, cfg)
	require.NoError(t, err)
	tmp := testParams(t, 2, []int{4, 4}, []int{7})
	want := make([][][]float32, 6)
	for s := 1; s <= 5; s++ {
		for i := range ref {
			clear(ref[i].GradData())
		}
		for r := 0; r < w; r++ {
			fillGrads(tmp, r, s)
			for i := range ref {
				for j, g := range tmp[i].GradData() {
					ref[i].GradData()[j] += g / w
				}
			}
		}
		require.NoError(t, refOpt.Step(context.Background()))
		want[s] = snapshot(ref)
	}
	var mu sync.Mutex
	got := make([][][]float32, w)
	err = local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 2, []int{4, 4}, []int{7})
		opt, err := NewAdam(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		for s := 1; s <= 5; s++ {
			fillGrads(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		st := opt.Stats()
		if st.LastStepBytes <= 0 || st.BytesSent < 5*st.LastStepBytes {
			t.Errorf("rank %d: traffic not accounted: %+v", c.Rank(), st)
		}
		mu.Lock()
		got[c.Rank()] = snapshot(ps)
		mu.Unlock()
		return nil
	})
	require.NoError(t, err)
	for r := 0; r < w; r++ {
		for i := range got[r] {
			assert.Equal(t, bits(got[0][i]), bits(got[r][i]), "rank %d differs from rank 0", r)
			assert.InDeltaSlice(t, want[5][i], got[r][i], 1e-5)
		}
	}
}

func TestAdamStepAllocatesNothing(t *testing.T) {
	ps := testParams(t, 3, []int{64, 3}, []int{10})
	for _, mk := range []func() (Optimizer, error){
		func() (Optimizer, error) { return NewAdam(context.Background(), nil, ps, DefaultAdamConfig()) },
		func() (Optimizer, error) { return NewLamb(context.Background(), nil, ps, DefaultLambConfig()) },
		func() (Optimizer, error) { return NewAdam(context.Background(), nil, ps, bf16Config()) },
	} {
		opt, err := mk()
		require.NoError(t, err)
		fillGrads(ps, 0, 1)
		require.NoError(t, opt.Step(context.Background()))
		allocs := testing.AllocsPerRun(20, func() {
			if err := opt.Step(context.Background()); err != nil {
				t.Fatal(err)
			}
		})
		assert.Zero(t, allocs)
	}
}

func TestAdamRejectsBadInput(t *testing.T) {
	ps := testParams(t, 1, []int{2})
	bad := []func(*AdamConfig){
		func(c *AdamConfig) { c.LR = -1 },
		func(c *AdamConfig) { c.LR = float32(math.NaN()) },
		func(c *AdamConfig) { c.Beta1 = 1 },
		func(c *AdamConfig) { c.Beta2 = -0.1 },
		func(c *AdamConfig) { c.Eps = float32(math.Inf(1)) },
		func(c *AdamConfig) { c.WeightDecay = -0.1 },
	}
	for i, f := range bad {
		cfg := DefaultAdamConfig()
		f(&cfg)
		_, err := NewAdam(context.Background(), nil, ps, cfg)
		assert.Error(t, err, "config %d", i)
	}
	_, err := NewAdam(context.Background(), nil, []*Param{ps[0], nil}, DefaultAdamConfig())
	assert.ErrorContains(t, err, "nil")
	dup := testParams(t, 1, []int{2})
	dup[0].Name = ps[0].Name
	_, err = NewAdam(context.Background(), nil, []*Param{ps[0], dup[0]}, DefaultAdamConfig())
	assert.ErrorContains(t, err, "used twice")
	mis := NewParam("mis", 2, 3)
	mis.Grad = NewParam("g", 3, 2).Grad
	_, err = NewAdam(context.Background(), nil, []*Param{mis}, DefaultAdamConfig())
	assert.ErrorContains(t, err, "shape")

	// A tensor replaced after construction is reported, not a panic.
	p := NewParam("x", 4)
	opt, err := NewAdam(context.Background(), nil, []*Param{p}, DefaultAdamConfig())
	require.NoError(t, err)
	p.Value = NewParam("x", 5).Value
	p.Grad = NewParam("x", 5).Grad
	assert.ErrorContains(t, opt.Step(context.Background()), "construction")
}

func TestAdamScalarAndEmptyParams(t *testing.T) {
	s := NewParam("scalar")
	e := NewParam("empty", 0)
	s.GradData()[0] = 1
	opt, err := NewAdam(context.Background(), nil, []*Param{s, e}, DefaultAdamConfig())
	require.NoError(t, err)
	require.NoError(t, opt.Step(context.Background()))
	assert.InDelta(t, -1e-3, s.Data()[0], 1e-9)
	ck, err := opt.State()
	require.NoError(t, err)
	b, err := ck.MarshalBinary()
	require.NoError(t, err)
	var back Checkpoint
	require.NoError(t, back.UnmarshalBinary(b))
	require.NoError(t, opt.Load(&back))
}
