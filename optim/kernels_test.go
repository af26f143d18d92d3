package optim

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestAdamStepEqualsMomentsThenUpdate(t *testing.T) {
	for _, n := range []int{0, 1, 7, 64} {
		p1, m1, v1, g := make([]float32, n), make([]float32, n), make([]float32, n), make([]float32, n)
		for i := range g {
			p1[i] = float32(math.Sin(float64(i)))
			m1[i] = float32(math.Cos(float64(i))) * 0.1
			v1[i] = float32(i%5) * 0.01
			g[i] = float32(math.Sin(float64(3*i+1))) * 4
		}
		p2, m2, v2 := append([]float32(nil), p1...), append([]float32(nil), m1...), append([]float32(nil), v1...)
		AdamMoments(m1, v1, g, 0.9, 0.999)
		AdamUpdate(p1, m1, v1, 1e-3, 0.01, BiasCorrection(0.9, 3), BiasCorrection(0.999, 3), 1e-8)
		AdamStep(p2, m2, v2, g, 0.9, 0.999, 1e-3, 0.01, BiasCorrection(0.9, 3), BiasCorrection(0.999, 3), 1e-8)
		assert.Equal(t, bits(p1), bits(p2))
		assert.Equal(t, bits(m1), bits(m2))
		assert.Equal(t, bits(v1), bits(v2))
		// Momentum rounds as AdamMoments does.
		m3 := append([]float32(nil), m2...)
		Momentum(m3, g, 0.9)
		AdamMoments(m2, v2, g, 0.9, 0.999)
		assert.Equal(t, bits(m2), bits(m3))
	}
}

func TestBiasCorrectionAndCoeff(t *testing.T) {
	assert.Equal(t, float32(1), BiasCorrection(0.9, 0))
	b := float64(float32(0.9)) // betas are float32: 0.9 is 0.89999998
	assert.Equal(t, float32(1/(1-b)), BiasCorrection(0.9, 1))
	assert.Equal(t, float32(1/(1-b*b)), BiasCorrection(0.9, 2))
	assert.Equal(t, float32(1), BiasCorrection(0, 5))
	assert.Equal(t, float32(1), LambCoeff(0, 4, 0.01, 10))
	assert.Equal(t, float32(1), LambCoeff(4, 0, 0.01, 10))
	assert.Equal(t, float32(2), LambCoeff(16, 4, 0.01, 10))
	assert.Equal(t, float32(10), LambCoeff(1e6, 1, 0.01, 10))
	assert.Equal(t, float32(0.01), LambCoeff(1, 1e6, 0.01, 10))
	assert.Equal(t, 30.0, SumSquares([]float32{1, 2, 3, 4}))
	assert.Equal(t, 55.0, SumSquares([]float32{1, 2, 3, 4, 5}))
}

// TestAdamRatioBound: exact Adam's |m|/sqrt(v) never exceeds
// AdamRatioBound, whatever the gradients (random ones of wildly different
// scales, and the extremal sequence g_k ~ (beta2/beta1)^k, fed oldest
// first, that approaches it).
func TestAdamRatioBound(t *testing.T) {
	for _, betas := range [][2]float32{{0.9, 0.999}, {0.9, 0.99}, {0.5, 0.9}} {
		b1, b2 := float64(betas[0]), float64(betas[1])
		bound := float64(AdamRatioBound(betas[0], betas[1]))
		rng := rand.New(rand.NewPCG(1, 2))
		for trial := range 200 {
			m, v := 0.0, 0.0
			for range 300 {
				g := rng.NormFloat64() * math.Pow(10, float64(rng.IntN(12)-6))
				if trial%2 == 1 {
					g = math.Abs(g)
				}
				m, v = b1*m+(1-b1)*g, b2*v+(1-b2)*g*g
				require.LessOrEqual(t, math.Abs(m)/math.Sqrt(v), bound*(1+1e-9), "betas %v", betas)
			}
		}
		// The extremal sequence: after n steps the ratio is within 1% of
		// the bound.
		const n = 2000
		m, v := 0.0, 0.0
		for k := n - 1; k >= 0; k-- {
			g := math.Pow(b1/b2, float64(k))
			m, v = b1*m+(1-b1)*g, b2*v+(1-b2)*g*g
		}
		r := m / math.Sqrt(v)
		require.LessOrEqual(t, r, bound*(1+1e-6), "betas %v", betas)
		require.Greater(t, r, 0.99*bound, "betas %v: the bound is not tight", betas)
	}
	require.InDelta(t, 7.27, AdamRatioBound(0.9, 0.999), 0.01)
	require.True(t, math.IsInf(float64(AdamRatioBound(0.99, 0.9)), 1), "beta1^2 >= beta2: unbounded")
}

// TestRatioBound: Clip leaves ratios within the cap alone (NaN too), clips
// to the cap up to the knee, then falls continuously as cap*knee/|r| down
// to 1, symmetrically; Of is 0 where v is exactly zero and Clip
// elsewhere; AdamUpdateBounded is AdamUpdate bit for bit where no ratio
// exceeds the cap, and moves an element whose v is zero by its weight
// decay only.
func TestRatioBound(t *testing.T) {
	b := RatioBound{Cap: 10, Knee: 1000}
	for _, tc := range []struct{ r, want float32 }{
		{0, 0}, {3, 3}, {-10, -10}, {10.5, 10}, {-999, -10}, {1000, 10},
		{2000, 5}, {-4000, -2.5}, {1e4, 1}, {1e9, 1}, {-1e30, -1},
	} {
		assert.Equal(t, tc.want, b.Clip(tc.r), "Clip(%g)", tc.r)
	}
	nan := float32(math.NaN())
	assert.True(t, math.IsNaN(float64(b.Clip(nan))))
	assert.Equal(t, float32(1), b.Clip(float32(math.Inf(1))))
	// Continuous at the knee and at 1.
	assert.InDelta(t, 10, b.Clip(1000.001), 1e-3)
	assert.InDelta(t, 1, b.Clip(9999), 1e-3)

	p := []float32{1, -2, 0.5, 3}
	m := []float32{0.1, -0.2, 0.05, 0.3}
	v := []float32{0.01, 0.04, 0.0025, 0.09}
	want := slices.Clone(p)
	AdamUpdate(want, m, v, 0.01, 0.1, 1.2, 1.5, 1e-8)
	got := slices.Clone(p)
	AdamUpdateBounded(got, m, v, 0.01, 0.1, 1.2, 1.5, 1e-8, b)
	assert.Equal(t, want, got, "within the cap")
	// v tiny: the step is lr*(1 + wd*p) in the direction of m.
	got = []float32{1}
	AdamUpdateBounded(got, []float32{0.3}, []float32{0x1p-126}, 0.01, 0, 1, 1, 1e-8, b)
	assert.Equal(t, float32(1-0.01), got[0])
	// v exactly zero: no gradient ever reached it; the weight decay only.
	assert.Equal(t, float32(0), b.Of(1e9, 0))
	assert.Equal(t, float32(1), b.Of(1e9, 0x1p-149))
	assert.Equal(t, b.Clip(-2000), b.Of(-2000, 1e-20))
	got = []float32{1, -2}
	AdamUpdateBounded(got, []float32{0.3, -0.7}, []float32{0, 0}, 0.01, 0, 1, 1, 1e-8, b)
	assert.Equal(t, []float32{1, -2}, got, "v = 0, no weight decay: no step")
	got = []float32{1}
	AdamUpdateBounded(got, []float32{0.3}, []float32{0}, 0.01, 0.1, 1, 1, 1e-8, b)
	assert.Equal(t, 1-float32(0.01*float32(0.1*1)), got[0], "v = 0: the weight decay only")
}
