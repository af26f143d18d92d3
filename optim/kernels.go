package optim

import "math"

// The update kernels below are shared by the exact optimizers of this
// package and the 1-bit optimizers of package onebit, so that both compute
// bit for bit the same thing. They work in float32. Every product is
// rounded to float32 before it is added (an explicit conversion), so the
// compiler cannot fuse it into an FMA and the results are the same on every
// architecture: ranks on different machines stay identical. Scalars derived
// from hyper-parameters (1-beta, bias corrections) are computed in float64
// and rounded once.
//
// The kernels allocate nothing. They panic if a slice is shorter than the
// first one: callers size their buffers once, at construction.

// BiasCorrection returns 1/(1-beta^step), computed in float64 and rounded
// once to float32: the multiplier that turns a moment into its
// bias-corrected estimate (m_hat = m * BiasCorrection(beta1, t)). It
// returns 1 when step < 1.
func BiasCorrection(beta float32, step int64) float32 {
	if step < 1 {
		return 1
	}
	return float32(1 / (1 - math.Pow(float64(beta), float64(step))))
}

// OneMinus returns 1-beta computed in float64 and rounded to float32, the
// weight the moment kernels give the new gradient.
func OneMinus(beta float32) float32 { return float32(1 - float64(beta)) }

// AdamMoments updates both moments from the gradient g:
//
//	m = beta1*m + (1-beta1)*g
//	v = beta2*v + (1-beta2)*g*g
func AdamMoments(m, v, g []float32, beta1, beta2 float32) {
	a1, a2 := OneMinus(beta1), OneMinus(beta2)
	v = v[:len(m)]
	g = g[:len(m)]
	for i := range m {
		gi := g[i]
		m[i] = float32(beta1*m[i]) + float32(a1*gi)
		v[i] = float32(beta2*v[i]) + float32(float32(a2*gi)*gi)
	}
}

// Momentum updates the first moment only: m = beta1*m + (1-beta1)*g,
// rounding exactly as AdamMoments does.
func Momentum(m, g []float32, beta1 float32) {
	a1 := OneMinus(beta1)
	g = g[:len(m)]
	for i := range m {
		m[i] = float32(beta1*m[i]) + float32(a1*g[i])
	}
}

// AdamUpdate applies the Adam/AdamW update to p in place:
//
//	update = (m*c1) / (sqrt(v*c2) + eps) + wd*p
//	p     -= lr * update
//
// where c1 and c2 are the bias-correction multipliers
// BiasCorrection(beta1, t) and BiasCorrection(beta2, t) (1 and 1 without
// bias correction; 1-bit Adam passes a frozen c2). wd is decoupled weight
// decay. The square root is correctly rounded.
func AdamUpdate(p, m, v []float32, lr, wd, c1, c2, eps float32) {
	m = m[:len(p)]
	v = v[:len(p)]
	for i := range p {
		d := sqrt32(float32(v[i]*c2)) + eps
		u := float32(m[i]*c1)/d + float32(wd*p[i])
		p[i] -= float32(lr * u)
	}
}

// AdamStep is AdamMoments followed by AdamUpdate, fused into one pass over
// memory; the result is bit-identical to calling the two in turn.
func AdamStep(p, m, v, g []float32, beta1, beta2, lr, wd, c1, c2, eps float32) {
	a1, a2 := OneMinus(beta1), OneMinus(beta2)
	m = m[:len(p)]
	v = v[:len(p)]
	g = g[:len(p)]
	for i := range p {
		gi := g[i]
		mi := float32(beta1*m[i]) + float32(a1*gi)
		vi := float32(beta2*v[i]) + float32(float32(a2*gi)*gi)
		m[i], v[i] = mi, vi
		d := sqrt32(float32(vi*c2)) + eps
		u := float32(mi*c1)/d + float32(wd*p[i])
		p[i] -= float32(lr * u)
	}
}

// AdamDirection writes the Adam/AdamW update of AdamUpdate into dst
// instead of applying it, and returns the float64 sums of squares of p and
// of the update (for a LAMB trust ratio, see LambCoeff and Descend).
func AdamDirection(dst, p, m, v []float32, wd, c1, c2, eps float32) (pSq, uSq float64) {
	p = p[:len(dst)]
	m = m[:len(dst)]
	v = v[:len(dst)]
	for i := range dst {
		d := sqrt32(float32(v[i]*c2)) + eps
		pi := p[i]
		u := float32(m[i]*c1)/d + float32(wd*pi)
		dst[i] = u
		pSq += float64(pi) * float64(pi)
		uSq += float64(u) * float64(u)
	}
	return pSq, uSq
}

// LambCoeff returns the LAMB trust ratio ||p|| / ||update|| from the two
// sums of squares (see AdamDirection), computed in float64, rounded to
// float32 and clipped to [minCoeff, maxCoeff]. It is 1 when either norm is
// 0.
func LambCoeff(pSq, uSq float64, minCoeff, maxCoeff float32) float32 {
	if pSq == 0 || uSq == 0 {
		return 1
	}
	c := float32(math.Sqrt(pSq) / math.Sqrt(uSq))
	if c > maxCoeff {
		c = maxCoeff
	}
	if c < minCoeff {
		c = minCoeff
	}
	return c
}

// Descend applies p -= step*u.
func Descend(p, u []float32, step float32) {
	u = u[:len(p)]
	for i := range p {
		p[i] -= float32(step * u[i])
	}
}

// Mul multiplies x by y element-wise in place (an exp_avg_mask, for
// example).
func Mul(x, y []float32) {
	y = y[:len(x)]
	for i := range x {
		x[i] *= y[i]
	}
}

// SumSquares returns the sum of x[i]^2 accumulated in float64, four
// accumulators wide.
func SumSquares(x []float32) float64 {
	var s0, s1, s2, s3 float64
	i := 0
	for ; i+4 <= len(x); i += 4 {
		a, b, c, d := float64(x[i]), float64(x[i+1]), float64(x[i+2]), float64(x[i+3])
		s0 += a * a
		s1 += b * b
		s2 += c * c
		s3 += d * d
	}
	for ; i < len(x); i++ {
		a := float64(x[i])
		s0 += a * a
	}
	return (s0 + s1) + (s2 + s3)
}

// sqrt32 is the correctly rounded float32 square root (the compiler emits
// one SQRTSS on amd64).
func sqrt32(x float32) float32 { return float32(math.Sqrt(float64(x))) }
