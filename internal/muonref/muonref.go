// Package muonref is Muon's orthogonalization in float64, written from the
// published algorithm with plain matrix products: the reference of the
// tests of optim.Muon and onebit.Muon, sharing no code with optim's
// Newton-Schulz iteration.
package muonref

import "math"

// Orthogonalize returns the Newton-Schulz orthogonalization of the
// rows x cols matrix u (row-major), in u's layout:
//
//	X = u, transposed when rows > cols
//	X = X / (||X||_F + eps)
//	steps times: A = X X^T; B = b*A + c*A A; X = a*X + B X
//	X transposed back
//
// with (a, b, c) = coef. u is not changed.
func Orthogonalize(u []float64, rows, cols int, coef [3]float64, steps int, eps float64) []float64 {
	x, n1, n2 := append([]float64(nil), u...), rows, cols
	if rows > cols {
		x, n1, n2 = transpose(u, rows, cols), cols, rows
	}
	norm := 0.0
	for _, e := range x {
		norm += e * e
	}
	norm = math.Sqrt(norm) + eps
	for k := range x {
		x[k] /= norm
	}
	for range steps {
		A := matmul(x, transpose(x, n1, n2), n1, n2, n1)
		AA := matmul(A, A, n1, n1, n1)
		for k := range A {
			A[k] = coef[1]*A[k] + coef[2]*AA[k]
		}
		BX := matmul(A, x, n1, n1, n2)
		for k := range x {
			x[k] = coef[0]*x[k] + BX[k]
		}
	}
	if rows > cols {
		x = transpose(x, cols, rows)
	}
	return x
}

// matmul returns a (n x k) times b (k x m), row-major.
func matmul(a, b []float64, n, k, m int) []float64 {
	c := make([]float64, n*m)
	for i := range n {
		for l := range k {
			for j := range m {
				c[i*m+j] += a[i*k+l] * b[l*m+j]
			}
		}
	}
	return c
}

// transpose returns the transpose of the n x m matrix a.
func transpose(a []float64, n, m int) []float64 {
	t := make([]float64, len(a))
	for i := range n {
		for j := range m {
			t[j*n+i] = a[i*m+j]
		}
	}
	return t
}

// Noise fills x with pseudo-random values in [-scale/2, scale/2), a
// xorshift32 sequence from seed (not 0): test gradients that make
// full-rank matrices. A smooth function of the element index makes
// rank-deficient ones, whose null directions hold only rounding, which
// Newton-Schulz lifts by up to a^NSSteps (480 with Muon's defaults):
// float32 then differs from float64 by far more than its rounding.
func Noise(x []float32, seed uint32, scale float32) {
	for k := range x {
		seed ^= seed << 13
		seed ^= seed >> 17
		seed ^= seed << 5
		x[k] = (float32(seed>>8)/(1<<24) - 0.5) * scale
	}
}
