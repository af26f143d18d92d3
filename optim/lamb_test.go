package optim

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lambOneStep runs one LAMB step from p with gradient g (bias correction on,
// so the first update is g/(|g|+eps) + wd*p) and returns the new value.
func lambOneStep(t *testing.T, cfg LambConfig, p, g []float32) []float32 {
	t.Helper()
	prm, err := NewParamFrom("w", p, len(p))
	require.NoError(t, err)
	copy(prm.GradData(), g)
	opt, err := NewLamb(context.Background(), nil, []*Param{prm}, cfg)
	require.NoError(t, err)
	require.NoError(t, opt.Step(context.Background()))
	return prm.Data()
}

func TestLambTrustRatioByHand(t *testing.T) {
	cfg := DefaultLambConfig()
	cfg.LR = 0.1
	sq2 := math.Sqrt2
	for _, tc := range []struct {
		name  string
		p     []float32
		coeff float64 // expected trust ratio
	}{
		{"inside", []float32{3, 4}, 5 / sq2},               // ||p|| = 5, ||update|| = sqrt(2)
		{"clipped-high", []float32{300, 400}, 10},          // 500/sqrt(2) > 10
		{"clipped-low", []float32{0.003, 0.004}, 0.01},     // 0.005/sqrt(2) < 0.01
		{"zero-weight-norm", []float32{0, 0}, 1},           // ||p|| = 0
		{"negative-inside", []float32{-0.6, 0.8}, 1 / sq2}, // ||p|| = 1
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := lambOneStep(t, cfg, tc.p, []float32{1, -1})
			for i, u := range []float64{1, -1} {
				want := float64(tc.p[i]) - 0.1*tc.coeff*u
				assert.InDelta(t, want, float64(got[i]), 1e-6*math.Max(1, math.Abs(want)), "element %d", i)
			}
		})
	}
	t.Run("zero-update-norm", func(t *testing.T) {
		got := lambOneStep(t, cfg, []float32{3, 4}, []float32{0, 0})
		assert.Equal(t, []float32{3, 4}, got)
	})
	t.Run("weight-decay", func(t *testing.T) {
		c := cfg
		c.WeightDecay = 0.5
		// update = [1, -1] + 0.5*[3, 4] = [2.5, 1]; coeff = 5/sqrt(7.25).
		got := lambOneStep(t, c, []float32{3, 4}, []float32{1, -1})
		coeff := 5 / math.Sqrt(7.25)
		assert.InDelta(t, 3-0.1*coeff*2.5, float64(got[0]), 1e-6)
		assert.InDelta(t, 4-0.1*coeff*1, float64(got[1]), 1e-6)
	})
}

// The reference below is LAMB in float64, written from the formulas.
func TestLambMatchesFloat64Reference(t *testing.T) {
	cfg := DefaultLambConfig()
	cfg.LR = 0.02
	cfg.WeightDecay = 0.01
	ps := testParams(t, 4, []int{6}, []int{2, 2})
	opt, err := NewLamb(context.Background(), nil, ps, cfg)
	require.NoError(t, err)
	type st struct{ p, m, v []float64 }
	ref := make([]st, len(ps))
	for i, p := range ps {
		ref[i] = st{make([]float64, p.Numel()), make([]float64, p.Numel()), make([]float64, p.Numel())}
		for j, x := range p.Data() {
			ref[i].p[j] = float64(x)
		}
	}
	b1, b2 := float64(cfg.Beta1), float64(cfg.Beta2)
	for s := 1; s <= 15; s++ {
		fillGrads(ps, 0, s)
		for i, p := range ps {
			r := ref[i]
			u := make([]float64, len(r.p))
			var pn, un float64
			for j, g32 := range p.GradData() {
				g := float64(g32)
				r.m[j] = b1*r.m[j] + (1-b1)*g
				r.v[j] = b2*r.v[j] + (1-b2)*g*g
				mh := r.m[j] / (1 - math.Pow(b1, float64(s)))
				vh := r.v[j] / (1 - math.Pow(b2, float64(s)))
				u[j] = mh/(math.Sqrt(vh)+float64(cfg.Eps)) + float64(cfg.WeightDecay)*r.p[j]
				pn += r.p[j] * r.p[j]
				un += u[j] * u[j]
			}
			coeff := 1.0
			if pn != 0 && un != 0 {
				coeff = math.Min(math.Max(math.Sqrt(pn)/math.Sqrt(un), float64(cfg.MinCoeff)), float64(cfg.MaxCoeff))
			}
			for j := range r.p {
				r.p[j] -= float64(cfg.LR) * coeff * u[j]
			}
		}
		require.NoError(t, opt.Step(context.Background()))
		for i, p := range ps {
			for j, x := range p.Data() {
				require.InDelta(t, ref[i].p[j], float64(x), 1e-5, "step %d param %d element %d", s, i, j)
			}
		}
	}
}

func TestLambConfigValidation(t *testing.T) {
	ps := testParams(t, 1, []int{2})
	for _, f := range []func(*LambConfig){
		func(c *LambConfig) { c.MinCoeff = -1 },
		func(c *LambConfig) { c.MinCoeff, c.MaxCoeff = 2, 1 },
		func(c *LambConfig) { c.MaxCoeff = float32(math.Inf(1)) },
		func(c *LambConfig) { c.LR = -1 },
		func(c *LambConfig) { c.LR = float32(math.Inf(1)) },
		func(c *LambConfig) { c.LR = float32(math.NaN()) },
	} {
		cfg := DefaultLambConfig()
		f(&cfg)
		_, err := NewLamb(context.Background(), nil, ps, cfg)
		assert.Error(t, err)
	}
}
