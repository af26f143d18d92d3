package optim

import (
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/quant"
)

// Adam's moments in bfloat16 (AdamConfig.MomentsBF16).
//
// A bfloat16 keeps 8 significant bits: consecutive values lie 2^-8 to
// 2^-7 apart relative to their size. v moves by (1-beta2)*(g^2-v) per
// step, 0.1% of v at beta2 0.999: rounded to nearest, a step that lowers
// v never changes it (0.001*v is below half a spacing), so v would only
// ever grow. The moments are therefore rounded stochastically: up with
// probability equal to the dropped fraction of a spacing, so that the
// rounded value's expectation is the float32 value and the moments follow
// their recursions on average (a linear recursion of unbiased roundings
// stays unbiased). The noise this adds to v is about 5% of v (the rounding
// error of one step, about 0.2% of v, accumulated over the 1/(1-beta2^2)
// steps v remembers), to m about 0.5%.
//
// The random bits are a hash of the step counter t, the parameter's index
// and the element's index (splitmix64's finalizer): no state, no
// allocation, the same on every rank, and a run resumed from a checkpoint
// (which keeps t) draws the same bits as one that was not interrupted.

// stochasticBF16 rounds x to bfloat16, up (away from zero) with
// probability (dropped 16 bits)/2^16 for r uniform in [0, 2^16): adding r
// to the bits carries into the kept ones exactly then. NaN stays a quiet
// NaN, ±Inf stays ±Inf, and a finite x is never rounded to infinity (it
// keeps bfloat16's largest finite value of its sign instead).
func stochasticBF16(x float32, r uint32) uint16 {
	b := math.Float32bits(x)
	a := b & 0x7fffffff
	if a > 0x7f800000 {
		return uint16(b>>16) | 0x40
	}
	h := uint16((b + r&0xffff) >> 16)
	if h&0x7fff == 0x7f80 && a != 0x7f800000 {
		h-- // a finite x carried into infinity
	}
	return h
}

// widenBF16 is the float32 value of bfloat16 h, exactly.
func widenBF16(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// mix64 is splitmix64's finalizer, a bijection of uint64 whose output bits
// each depend on every input bit.
func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// roundingSeed is the seed of the stochastic rounding of step t's moments
// of parameter k.
func roundingSeed(t int64, k int) uint64 {
	return mix64(mix64(uint64(t)) + uint64(k)*0x9e3779b97f4a7c15)
}

// roundingBits returns 32 random bits for element i under seed: the low 16
// round m, the high 16 round v.
func roundingBits(seed uint64, i int) uint32 {
	return uint32(mix64(seed + uint64(i+1)*0x9e3779b97f4a7c15))
}

// adamStepBF16 is AdamStep on bfloat16 moments: each element's m and v are
// widened, updated in float32 exactly as AdamMoments rounds them, rounded
// back to bfloat16 stochastically (stochasticBF16, with roundingBits(seed,
// i)), and the parameter takes AdamUpdate's step computed from the rounded
// moments.
func adamStepBF16(p []float32, m, v []uint16, g []float32, beta1, beta2, lr, wd, c1, c2, eps float32, seed uint64) {
	a1, a2 := OneMinus(beta1), OneMinus(beta2)
	m = m[:len(p)]
	v = v[:len(p)]
	g = g[:len(p)]
	for i := range p {
		gi := g[i]
		mi := float32(beta1*widenBF16(m[i])) + float32(a1*gi)
		vi := float32(beta2*widenBF16(v[i])) + float32(float32(a2*gi)*gi)
		r := roundingBits(seed, i)
		m[i], v[i] = stochasticBF16(mi, r), stochasticBF16(vi, r>>16)
		mi, vi = widenBF16(m[i]), widenBF16(v[i])
		d := sqrt32(float32(vi*c2)) + eps
		u := float32(mi*c1)/d + float32(wd*p[i])
		p[i] -= float32(lr * u)
	}
}

// widenedBF16 returns the float32 values of h in a new slice (a
// checkpoint's copy).
func widenedBF16(h []uint16) []float32 {
	out := make([]float32, len(h))
	quant.Widen(quant.BF16, out, h)
	return out
}

// checkMomentsBF16 refuses a checkpoint whose moments were kept in the
// other precision than bf16 says (see IntMomentsBF16): resuming would
// change how the moments are rounded. It names both settings.
func checkMomentsBF16(ck *Checkpoint, bf16 bool) error {
	v, ok := ck.Ints[IntMomentsBF16]
	switch {
	case ok && v != 0 && v != 1:
		return fmt.Errorf("%w: %s = %d: want 0 or 1", ErrIncompatibleCheckpoint, IntMomentsBF16, v)
	case (v == 1) != bf16:
		return fmt.Errorf("%w: made with MomentsBF16 %v, this optimizer has %v (the moments are kept and rounded differently: use the same MomentsBF16)",
			ErrIncompatibleCheckpoint, v == 1, bf16)
	}
	return nil
}

// RoundingSeed is the seed of the stochastic rounding of step t's
// bfloat16 buffer k (a parameter's index, say): a hash of both, the same
// wherever it is computed, so that a run resumed from a checkpoint (which
// keeps t) rounds as the run that was not interrupted. Optimizers outside
// this package (package onebit's 1-bit Muon) use it with MomentumBF16.
func RoundingSeed(t int64, k int) uint64 { return roundingSeed(t, k) }

// MomentumBF16 is Momentum on a bfloat16 momentum: each element of m is
// widened, updated in float32 as Momentum rounds it
// (m = beta*m + (1-beta)*g), rounded back to bfloat16 stochastically
// (unbiased: up with probability equal to the dropped fraction of a
// spacing, with the low 16 bits of element i's random bits under seed, as
// AdamConfig.MomentsBF16 rounds m) and its rounded value, exactly, written
// into wide, the float32 momentum the caller goes on with. wide and g hold
// at least len(m) elements; wide may not be g. It allocates nothing.
func MomentumBF16(m []uint16, wide, g []float32, beta float32, seed uint64) {
	a := OneMinus(beta)
	wide = wide[:len(m)]
	g = g[:len(m)]
	for i, h := range m {
		x := float32(beta*widenBF16(h)) + float32(a*g[i])
		m[i] = stochasticBF16(x, roundingBits(seed, i))
		wide[i] = widenBF16(m[i])
	}
}

// MomentumFiniteBF16 says whether MomentumBF16 would leave the bfloat16
// momentum m finite, and its Nesterov term (1-beta)*g + beta*m with it, as
// MomentumFinite does for a float32 momentum (the stochastic rounding
// never makes a finite value infinite).
func MomentumFiniteBF16(m []uint16, g []float32, beta float32) bool {
	a := OneMinus(beta)
	g = g[:len(m)]
	var s float32
	for i, h := range m {
		ag := float32(a * g[i])
		n := float32(beta*widenBF16(h)) + ag
		s += n*0 + (float32(beta*n)+ag)*0
	}
	return s == s
}
