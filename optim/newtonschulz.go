package optim

import (
	"math"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/gonum"
)

// The Newton-Schulz iteration of Muon, in float32, with gonum's BLAS
// (gonum.Implementation, the pure-Go one, whose float32 kernels are
// assembly on amd64) for the matrix products. The implementation is used
// directly rather than through blas32, whose implementation is a global
// that another package could swap.
//
// Determinism: every element of a product is accumulated by one kernel
// call over the whole inner dimension, in index order, whatever the tiling
// below, so the result depends only on the inputs and the architecture's
// kernels, never on timing: ranks on the same architecture compute the
// same bits. (gonum's Go kernels, used where it has no assembly, may be
// compiled with fused multiply-adds: ranks of different architectures may
// then differ in the last bits.)

// Tiles of the products: no call to gonum's Sgemm covers more than 3 of its
// 64x64 blocks of the result, below the 4 at which it spawns goroutines
// (allocating on every call). A tile of gemmRows x gemmCols outputs also
// keeps the slice of the right-hand matrix it reads (its k rows of
// gemmCols columns) in cache across the tile's rows.
const (
	gemmRows = 64
	gemmCols = 192
)

// gemm computes c = alpha*a*op(b) + beta*c for row-major a (m x k, leading
// dimension lda), op(b) (k x n: b itself, leading dimension ldb, or, with
// bT, the transpose of the n x k matrix b) and c (m x n, leading dimension
// ldc), tile by tile (see gemmRows). It allocates nothing.
func gemm(bT bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	tb := blas.NoTrans
	if bT {
		tb = blas.Trans
	}
	for i := 0; i < m; i += gemmRows {
		mi := min(gemmRows, m-i)
		for j := 0; j < n; j += gemmCols {
			nj := min(gemmCols, n-j)
			bj := b[j:]
			if bT {
				bj = b[j*ldb:]
			}
			gonum.Implementation{}.Sgemm(blas.NoTrans, tb, mi, nj, k, alpha, a[i*lda:], lda, bj, ldb, beta, c[i*ldc+j:], ldc)
		}
	}
}

// syrk computes the symmetric c = a a^T for row-major a (m x k) and c
// (m x m) with gonum's Ssyrk, which computes each element of the upper
// triangle as one dot product over the whole inner dimension in index order,
// and copies it to the lower one: half the multiply-adds of a general
// product, and c exactly symmetric (the upper triangle has the bits that
// gemm(true, ...) gives it; gemm's lower triangle can differ from its upper
// one in the last bit). It allocates nothing.
func syrk(m, k int, a, c []float32) {
	gonum.Implementation{}.Ssyrk(blas.Upper, blas.NoTrans, m, k, 1, a, k, 0, c, m)
	for i := 1; i < m; i++ {
		for j := range i {
			c[i*m+j] = c[j*m+i]
		}
	}
}

// nsWork holds the work matrices of the Newton-Schulz iteration for one
// matrix shape, m x n with m <= n (a wider-than-tall view of the
// parameter): x and y are m x n, a and b are m x m. Parameters of the same
// shape share one nsWork.
type nsWork struct {
	m, n       int
	x, y, a, b []float32
}

func newNSWork(m, n int) *nsWork {
	return &nsWork{
		m: m, n: n,
		x: make([]float32, m*n), y: make([]float32, m*n),
		a: make([]float32, m*m), b: make([]float32, m*m),
	}
}

// bytes is the memory of w's matrices.
func (w *nsWork) bytes() int64 { return Float32Bytes(w.x, w.y, w.a, w.b) }

// normalize divides x by its Frobenius norm plus eps (the norm summed in
// float64, the divisor rounded once to float32). A divisor beyond
// float32's range (a finite x whose norm exceeds it) would be +Inf and
// zero x: x is then divided in float64 by the unrounded divisor, each
// quotient rounded once to float32. It returns false, leaving x as it is,
// when x is zero (the update of a zero matrix is zero, even with eps 0).
func (w *nsWork) normalize(eps float32) bool {
	ss := SumSquares(w.x)
	if ss == 0 {
		return false
	}
	d64 := math.Sqrt(ss) + float64(eps)
	d := float32(d64)
	if math.IsInf(float64(d), 0) {
		for i, v := range w.x {
			w.x[i] = float32(float64(v) / d64)
		}
		return true
	}
	for i, v := range w.x {
		w.x[i] = v / d
	}
	return true
}

// iterate runs steps Newton-Schulz iterations on x, in place:
//
//	A = X X^T
//	B = b*A + c*A A
//	X = a*X + B X
//
// with (a, b, c) = coef, products rounded to float32 and added in
// float32.
func (w *nsWork) iterate(coef [3]float32, steps int) {
	m, n := w.m, w.n
	ca, cb, cc := coef[0], coef[1], coef[2]
	for range steps {
		syrk(m, n, w.x, w.a)
		syrk(m, m, w.a, w.b) // A A = A A^T: A is symmetric, bit for bit
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

// Orthogonalizer runs Muon's orthogonalization on matrices of one shape,
// rows x cols or its transpose, with work matrices of its own: for
// optimizers built on Muon outside this package (package onebit's 1-bit
// Muon). Its arithmetic is Muon's, bit for bit. Orthogonalize allocates
// nothing.
type Orthogonalizer struct{ w *nsWork }

// NewOrthogonalizer returns an Orthogonalizer for matrices of rows x cols
// or cols x rows, both at least 1.
func NewOrthogonalizer(rows, cols int) *Orthogonalizer {
	return &Orthogonalizer{newNSWork(min(rows, cols), max(rows, cols))}
}

// StateBytes is the memory of o's work matrices: 4(2rc + 2r²) bytes, r
// the smaller dimension and c the larger.
func (o *Orthogonalizer) StateBytes() int64 { return o.w.bytes() }

// Orthogonalize writes into dst, a rows x cols matrix in the parameter's
// row-major layout, scale times Muon's orthogonalized update from the
// momentum m (already updated with the gradient g) and g, with cfg's
// Momentum, Nesterov, NSEps, NSCoefficients and NSSteps (see Muon):
//
//	u = (1-mu)*g + mu*m   (Nesterov; else u = m)
//	X = u, transposed when rows > cols
//	X = X / (||X||_F + eps)
//	NSSteps times: A = X X^T; B = b*A + c*A A; X = a*X + B X
//	dst = scale * X, transposed back
//
// each product rounded to float32. It returns false, with dst zeroed, when
// u is zero. dst may be m or g. With scale 1, p = p*(1-lr*wd) -
// lr*max(1, rows/cols)^0.5*dst (the factor rounded once to float32, each
// product to float32) is Muon's update bit for bit. It panics when the
// matrix is not o's shape or a slice is shorter than rows*cols.
func (o *Orthogonalizer) Orthogonalize(dst, m, g []float32, rows, cols int, cfg MuonConfig, scale float32) bool {
	if min(rows, cols) != o.w.m || max(rows, cols) != o.w.n {
		panic("optim: Orthogonalize: a matrix of another shape than the Orthogonalizer's")
	}
	return o.w.orthogonalize(dst, m, g, rows, cols, cfg, scale)
}

// orthogonalize is Orthogonalize on w's work matrices, which must be of
// the matrix's shape.
func (w *nsWork) orthogonalize(dst, m, g []float32, rows, cols int, cfg MuonConfig, scale float32) bool {
	loadNS(w.x, m[:rows*cols], g, rows, cols, cfg.Momentum, cfg.Nesterov)
	dst = dst[:rows*cols]
	if !w.normalize(cfg.NSEps) {
		clear(dst)
		return false
	}
	w.iterate(cfg.NSCoefficients, cfg.NSSteps)
	storeNS(dst, w.x, rows, cols, scale)
	return true
}
