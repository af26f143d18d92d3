package optim

import (
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/internal/samerun"
)

// randMatrix returns m*n deterministic values in [-1, 1).
func randMatrix(m, n int, seed uint32) []float32 {
	x := make([]float32, m*n)
	for i := range x {
		seed = seed*1664525 + 1013904223
		x[i] = float32(int32(seed)>>8) / (1 << 23)
	}
	return x
}

// iterateGeneral is the Newton-Schulz iteration with general products
// (gemm) for A = X X^T and A A, as before syrk: the reference of
// TestSyrkProducts and the baseline of BenchmarkNewtonSchulzProducts.
func (w *nsWork) iterateGeneral(coef [3]float32, steps int) {
	m, n := w.m, w.n
	ca, cb, cc := coef[0], coef[1], coef[2]
	for range steps {
		gemm(true, m, m, n, 1, w.x, n, w.x, n, 0, w.a, m)
		gemm(false, m, m, m, 1, w.a, m, w.a, m, 0, w.b, m)
		for i, v := range w.a {
			w.b[i] = float32(cb*v) + float32(cc*w.b[i])
		}
		for i, v := range w.x {
			w.y[i] = ca * v
		}
		gemm(false, m, n, m, 1, w.b, m, w.x, n, 1, w.y, n)
		w.x, w.y = w.y, w.x
	}
}

// TestSyrkProducts checks the symmetric products of the Newton-Schulz
// iteration: X X^T exactly symmetric, its upper triangle bit for bit the
// general product's (the same dot product per element; the general
// product's lower triangle differs from its upper one in the last bit
// here and there), and A A within float32
// rounding of the general product (a dot product instead of a sum of
// row updates: another order of the same additions); and a whole
// orthogonalization within 1e-5 of the general products'.
func TestSyrkProducts(t *testing.T) {
	for _, sh := range [][2]int{{1, 1}, {3, 5}, {64, 64}, {64, 256}, {70, 200}, {130, 131}} {
		m, n := sh[0], sh[1]
		x := randMatrix(m, n, uint32(m*1000+n))
		nx := &nsWork{x: x}
		require.True(t, nx.normalize(0)) // as the iteration sees X: ||X|| = 1
		a, ref := make([]float32, m*m), make([]float32, m*m)
		syrk(m, n, x, a)
		gemm(true, m, m, n, 1, x, n, x, n, 0, ref, m)
		for i := range m {
			for j := i; j < m; j++ {
				require.Equal(t, math.Float32bits(ref[i*m+j]), math.Float32bits(a[i*m+j]), "%dx%d: X X^T (%d, %d)", m, n, i, j)
				require.Equal(t, a[i*m+j], a[j*m+i], "%dx%d: X X^T not symmetric at (%d, %d)", m, n, i, j)
				assert.InDelta(t, ref[j*m+i], a[j*m+i], 1e-6, "%dx%d: X X^T (%d, %d)", m, n, j, i)
			}
		}
		b := make([]float32, m*m)
		syrk(m, m, a, b)
		gemm(false, m, m, m, 1, a, m, a, m, 0, ref, m)
		for i := range m {
			for j := range m {
				require.Equal(t, b[i*m+j], b[j*m+i], "%dx%d: A A not symmetric at (%d, %d)", m, n, i, j)
				assert.InDelta(t, ref[i*m+j], b[i*m+j], 1e-6, "%dx%d: A A (%d, %d)", m, n, i, j)
			}
		}

		w, g := newNSWork(m, n), newNSWork(m, n)
		copy(w.x, x)
		copy(g.x, x)
		require.True(t, w.normalize(1e-7))
		require.True(t, g.normalize(1e-7))
		coef := DefaultMuonConfig().NSCoefficients
		w.iterate(coef, 5)
		g.iterateGeneral(coef, 5)
		for i := range w.x {
			assert.InDelta(t, g.x[i], w.x[i], 1e-5, "%dx%d: orthogonalized element %d", m, n, i)
		}
	}
}

// BenchmarkNewtonSchulzProducts times, in one run with the passes
// alternated (samerun.Medians), five Newton-Schulz iterations of the GPT
// example's matrix shapes (64 x 64 and 64 x 256) with the symmetric
// products (syrk, what Muon runs) and with general ones (the baseline).
// x-general is the symmetric pass's time over the general one's. Use
// -benchtime 20x or more.
func BenchmarkNewtonSchulzProducts(b *testing.B) {
	for _, sh := range [][2]int{{64, 64}, {64, 256}, {128, 512}} {
		m, n := sh[0], sh[1]
		b.Run(fmt.Sprintf("%dx%d", m, n), func(b *testing.B) {
			x := randMatrix(m, n, 7)
			w := newNSWork(m, n)
			coef := DefaultMuonConfig().NSCoefficients
			pass := func(general bool) func() {
				return func() {
					copy(w.x, x)
					w.normalize(1e-7)
					if general {
						w.iterateGeneral(coef, 5)
					} else {
						w.iterate(coef, 5)
					}
				}
			}
			med := samerun.Medians(b, pass(false), pass(true))
			b.ReportMetric(med[0]*1e6, "syrk-us")
			b.ReportMetric(med[1]*1e6, "general-us")
			b.ReportMetric(med[0]/med[1], "x-general")
		})
	}
}
