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

// AdamRatioBound returns the largest |m|/sqrt(v) that exact Adam's moments
// reach at any step, for any gradient sequence: by Cauchy-Schwarz on
// m = (1-beta1)*sum beta1^k g_k and v = (1-beta2)*sum beta2^k g_k^2,
//
//	|m|/sqrt(v) <= (1-beta1)/sqrt((1-beta2)*(1-r)),  r = beta1^2/beta2 < 1,
//
// approached by a gradient proportional to (beta1/beta2)^k over many
// steps: 7.27 for betas 0.9 and 0.999, 2.35 for 0.9 and 0.99. Bias
// correction only lowers the ratio of the corrected moments early on, so it
// bounds m_hat/sqrt(v_hat) too. It is +Inf where r >= 1 (exact Adam's own
// ratio is then unbounded) and computed in float64, rounded once.
func AdamRatioBound(beta1, beta2 float32) float32 {
	b1, b2 := float64(beta1), float64(beta2)
	r := b1 * b1 / b2
	if !(r < 1) || b2 >= 1 {
		return float32(math.Inf(1))
	}
	return float32((1 - b1) / math.Sqrt((1-b2)*(1-r)))
}

// RatioBound bounds the ratio r = m_hat/(sqrt(v_hat)+eps) of an
// Adam-style update whose momentum is not the exact one (a compressed
// momentum) or whose v is frozen: package onebit's rule for elements first
// given gradient after the warm-up, or with a tiny v (see its package
// doc). A ratio within Cap is left alone. Beyond Cap it is clipped to Cap,
// up to Knee, where the variance is so small next to the momentum that it
// no longer tells the element's scale: there the bound falls as Cap*Knee/|r|
// down to 1, the ratio of exact Adam under a steady gradient. The bound
// is continuous in r.
//
// An element whose v is exactly zero has had no gradient reach its
// variance: Of gives it the ratio 0, the one exact Adam gives an element
// whose gradient has always been zero, where Clip would give it a step of
// its compressed momentum, which 1-bit compression makes ±scale for every
// element (package onebit marks the variance of an element that is then
// given gradient, so that it trains).
type RatioBound struct {
	// Cap is the largest ratio left to any element, >= 1.
	Cap float32
	// Knee is the ratio beyond which the bound falls, >= Cap.
	Knee float32
}

// Clip returns r bounded as the type's doc says; a NaN r is returned as
// it is.
func (b RatioBound) Clip(r float32) float32 {
	a := r
	if a < 0 {
		a = -a
	}
	if !(a > b.Cap) {
		return r
	}
	c := b.Cap
	if a > b.Knee {
		c = max(1, b.Cap*(b.Knee/a))
	}
	if r < 0 {
		return -c
	}
	return c
}

// Of is the ratio r of an element whose variance is v, bounded: 0 where v
// is exactly zero, b.Clip(r) elsewhere.
func (b RatioBound) Of(r, v float32) float32 {
	if v == 0 {
		return 0
	}
	return b.Clip(r)
}

// AdamUpdateBounded is AdamUpdate with the per-element ratio
// (m*c1)/(sqrt(v*c2)+eps) bounded by b before the weight decay is added:
//
//	update = b.Of((m*c1) / (sqrt(v*c2) + eps), v) + wd*p
//	p     -= lr * update
//
// Where the ratio is within b.Cap (NaN included) and v is not zero, the
// result is bit for bit AdamUpdate's; where v is exactly zero, p takes
// its weight decay only (with wd 0 it does not move), as in AdamUpdate
// when m is zero too.
func AdamUpdateBounded(p, m, v []float32, lr, wd, c1, c2, eps float32, b RatioBound) {
	m = m[:len(p)]
	v = v[:len(p)]
	for i := range p {
		d := sqrt32(float32(v[i]*c2)) + eps
		u := b.Of(float32(m[i]*c1)/d, v[i]) + float32(wd*p[i])
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
