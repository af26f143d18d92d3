package main

import (
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func loadTestdata(t testing.TB) (train, test *dataset) {
	t.Helper()
	train, test, err := loadMNIST("testdata")
	require.NoError(t, err)
	require.Equal(t, 500, train.len())
	require.Equal(t, 200, test.len())
	return train, test
}

// TestGradient compares the analytic gradient with central finite
// differences of the loss on a few coordinates of every parameter.
func TestGradient(t *testing.T) {
	train, _ := loadTestdata(t)
	m := newMLP(7, 8)
	idx := []int{0, 1, 2, 3, 4, 5, 6, 7}
	labels := make([]byte, len(idx))
	for i, j := range idx {
		labels[i] = train.labels[j]
	}
	n := m.load(train, idx)
	m.lossGrad(n, labels, 1)
	grads := map[string][]float32{}
	for _, p := range m.params() {
		grads[p.Name] = append([]float32(nil), p.GradData()...)
	}
	loss := func() float64 {
		m.forward(n)
		var l float64
		for r := range n {
			l += crossEntropy(f32(m.p)[r*numClasses:(r+1)*numClasses], int(labels[r]))
		}
		return l
	}
	for _, p := range m.params() {
		g := grads[p.Name]
		// The coordinates with the largest gradients, where float32
		// differences are accurate.
		best := []int{0}
		for i, v := range g {
			if math.Abs(float64(v)) > math.Abs(float64(g[best[len(best)-1]])) {
				best = append(best, i)
			}
		}
		for _, i := range best[max(0, len(best)-3):] {
			const h = 1e-2
			v := p.Data()[i]
			p.Data()[i] = v + h
			up := loss()
			p.Data()[i] = v - h
			down := loss()
			p.Data()[i] = v
			num := (up - down) / (2 * h)
			assert.InDelta(t, num, g[i], 2e-2*math.Max(1, math.Abs(num)), "%s[%d]", p.Name, i)
		}
	}
}

func TestSameSeedSameParams(t *testing.T) {
	a, b, c := newMLP(1, 4), newMLP(1, 4), newMLP(2, 4)
	for i, p := range a.params() {
		assert.Equal(t, p.Data(), b.params()[i].Data(), p.Name)
	}
	assert.NotEqual(t, a.w1.Data(), c.w1.Data())
	// He initialisation: the variance of w1 is about 2/784.
	var ss float64
	for _, v := range a.w1.Data() {
		ss += float64(v) * float64(v)
	}
	assert.InEpsilon(t, 2.0/numInputs, ss/float64(a.w1.Numel()), 0.05)
}

func BenchmarkLossGrad(b *testing.B) {
	train, _ := loadTestdata(b)
	for _, n := range []int{32, 128} {
		b.Run(itoa(n), func(b *testing.B) {
			m := newMLP(1, n)
			idx := make([]int, n)
			labels := make([]byte, n)
			for i := range idx {
				idx[i] = i
				labels[i] = train.labels[i]
			}
			b.ReportAllocs()
			for b.Loop() {
				m.load(train, idx)
				m.lossGrad(n, labels, 1)
			}
			// One forward and backward: about 2*(2*in*hidden + 3*hidden*classes) flops per example.
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(n), "ns/example")
		})
	}
}

func itoa(n int) string {
	s := ""
	for ; n > 0; n /= 10 {
		s = string(rune('0'+n%10)) + s
	}
	return s
}
