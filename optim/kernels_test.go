package optim

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
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
