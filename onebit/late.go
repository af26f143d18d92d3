package onebit

import (
	"context"
	"fmt"
	"math"
	"math/bits"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// The rule for elements whose v carries no information (see the package
// doc): the ratio m_hat/(sqrt(v_hat)+eps) of every compression-stage
// update is bounded by ratioBound's optim.RatioBound.
const (
	// CapFactor times optim.AdamRatioBound (7.27 at betas 0.9 and 0.999)
	// is the largest ratio any element's update may take: no element steps
	// more than CapFactor times farther than exact Adam ever could. The
	// compressed momentum is an estimate, and the frozen v an old one:
	// ordinary elements go beyond exact Adam's bound, up to 8 times it in
	// the spec's reference runs (random gradients, four warm-up steps,
	// betas 0.9 and 0.99), 7.6 times in ExampleNewLamb (elements whose
	// averaged gradient was nearly zero in the warm-up) and 3.6 times in
	// DeepSpeed's own 0/1 Adam run (a local step; TestDeepSpeedRuns). Clipping them
	// costs accuracy (the clipped part of a step is never made up, so the
	// error feedback no longer cancels in the parameters): 10 leaves them
	// untouched.
	CapFactor = 10
	// KneeRatio is the ratio beyond which v counts as carrying no
	// information about the element's scale: a v_hat a million times
	// below the square of the momentum the compression hands it (whose
	// magnitude is the scale of its chunk). Beyond it the bound falls
	// towards 1, the ratio exact Adam takes under a steady gradient, which
	// an element with v zero (first given gradient after the warm-up)
	// takes.
	KneeRatio = 1000
)

// ratioBound is the bound of the compression-stage updates: a cap of
// CapFactor*optim.AdamRatioBound (KneeRatio where that is infinite or
// larger) and the knee KneeRatio.
func ratioBound(beta1, beta2 float32) optim.RatioBound {
	c := min(CapFactor*optim.AdamRatioBound(beta1, beta2), KneeRatio)
	return optim.RatioBound{Cap: c, Knee: KneeRatio}
}

// vMark is the variance given to an element whose v was exactly zero once
// some rank gives it gradient (see unseen): far below the square of any
// gradient the variance could have taken from (2^-100, whose square root
// is 1e-15 of the default eps), so that the element's ratio is bounded as
// one of a v of zero was before the rule, and exact in bfloat16.
const vMark = 0x1p-100

// unseen finds, every step that runs it, which of the elements whose v is
// exactly zero (no gradient has reached their variance: they take no
// step, see optim.RatioBound.Of) some rank has given gradient: each rank
// writes one bit per such element, in the order of the elements, the
// ranks' bits are gathered (one AllGatherBytes of n/8 bytes, skipped when
// n is zero) and or-ed, and each element with its bit set has its v set
// to vMark, on every rank alike, so that it trains from the next step on.
// The decision depends on v and the gathered bits alone, the same on
// every rank. Nothing is added to the state: n is v's count of zeros.
type unseen struct {
	n     int    // the elements with v exactly zero, the same on every rank
	bits  []byte // this rank's bits, then every rank's or-ed
	all   []byte // every rank's bits, gathered
	i     int    // the bit that put or next reads
	world int
}

// reset sets the count of elements with v exactly zero to n on world
// ranks.
func (u *unseen) reset(n, world int) {
	u.n, u.world = n, max(world, 1)
}

// start clears the bits of the n elements and starts writing them from
// the first. The buffers grow to fit n (the only allocation: at the first
// step after a reset to more elements than they fit) and are released
// once no element is left.
func (u *unseen) start() {
	nb := (u.n + 7) / 8
	if cap(u.bits) < nb {
		u.bits = make([]byte, nb)
	}
	if u.world > 1 && cap(u.all) < u.world*nb {
		u.all = make([]byte, u.world*nb)
	}
	u.bits = u.bits[:nb]
	clear(u.bits)
	u.i = 0
}

// put writes the next element's bit.
func (u *unseen) put(on bool) {
	if on {
		u.bits[u.i>>3] |= 1 << (u.i & 7)
	}
	u.i++
}

// next reads the next element's bit.
func (u *unseen) next() bool {
	on := u.bits[u.i>>3]>>(u.i&7)&1 != 0
	u.i++
	return on
}

// pack writes the bits of the elements of v that are zero: whether g,
// this rank's gradient, is not zero there.
func (u *unseen) pack(v, g []float32) {
	g = g[:len(v)]
	for j, x := range v {
		if x == 0 {
			u.put(g[j] != 0)
		}
	}
}

// exchange or-s every rank's bits into this rank's (c nil or of one rank:
// nothing to exchange) and rewinds them for mark.
func (u *unseen) exchange(ctx context.Context, c comm.Comm) error {
	u.i = 0
	if u.world < 2 || c == nil || len(u.bits) == 0 {
		return nil
	}
	nb := len(u.bits)
	all := u.all[:u.world*nb]
	if err := c.AllGatherBytes(ctx, u.bits, all); err != nil {
		return fmt.Errorf("elements without variance: %w", err)
	}
	for r := 1; r < u.world; r++ {
		for j, b := range all[r*nb : (r+1)*nb] {
			all[j] |= b
		}
	}
	copy(u.bits, all[:nb])
	return nil
}

// mark sets v to vMark where it is zero and the bit read is set, in the
// order pack wrote them, and counts the elements it marks out of n.
func (u *unseen) mark(v []float32) {
	for j, x := range v {
		if x == 0 && u.next() {
			v[j] = vMark
			u.n--
		}
	}
}

// done releases the buffers once no element is left (after mark).
func (u *unseen) done() {
	if u.n == 0 {
		u.bits, u.all = nil, nil
	}
}

// countZeros is the number of elements of xs that are exactly zero.
func countZeros(xs ...[]float32) int {
	n := 0
	for _, x := range xs {
		for _, e := range x {
			if e == 0 {
				n++
			}
		}
	}
	return n
}

// bytes is the bytes of u's buffers.
func (u *unseen) bytes() int64 { return int64(cap(u.bits) + cap(u.all)) }

// shardLate is unseen in StateSharded, where a rank holds v of its own
// chunks only but applies the update of every element: zero, the same on
// every rank, says which elements have v exactly zero, so that every rank
// leaves them where they are (their update comes back compressed, ±scale
// like any other) and every rank writes their bits.
type shardLate struct {
	unseen
	// known says that zero is gathered: it is not from a change of the
	// state's layout (the end of the warm-up, a Load) to the next
	// compression step, which gathers it from the owners' v.
	known bool
	// zero has bit base[k]+e set for element e of bucket k (its padded
	// layout) when its v is exactly zero; nil when none is.
	zero []uint64
	base []int
}

// vZero says whether element e of the own chunk of bucket k has v exactly
// zero.
func (s *sharded) vZero(k, e int) bool {
	if s.vb != nil {
		return s.vb[k][e] == 0
	}
	return s.v[k][e] == 0
}

// gatherLate gathers zero from every rank's own chunks (one
// AllGatherBytes of a bit per element, after each change of layout).
func (s *sharded) gatherLate(ctx context.Context, c comm.Comm) error {
	w := c.Size()
	nb := (sum(s.chunks) + 7) / 8
	mine, all := make([]byte, nb), make([]byte, w*nb)
	i := 0
	for k, ck := range s.chunks {
		for e := range s.owned[k] {
			if s.vZero(k, e) {
				mine[(i+e)>>3] |= 1 << ((i + e) & 7)
			}
		}
		i += ck
	}
	if err := c.AllGatherBytes(ctx, mine, all); err != nil {
		return fmt.Errorf("elements without variance: %w", err)
	}
	n := 0
	for _, b := range all {
		n += bits.OnesCount8(b)
	}
	u := &s.late
	u.known, u.zero = true, nil
	u.reset(n, w)
	if n == 0 {
		return nil
	}
	u.base = make([]int, len(s.chunks))
	total := 0
	for k := range s.chunks {
		u.base[k] = total
		total += s.padded[k]
	}
	u.zero = make([]uint64, (total+63)/64)
	for r := range w {
		i := r * nb * 8
		for k, ck := range s.chunks {
			for e := range ck {
				if all[(i+e)>>3]>>((i+e)&7)&1 != 0 {
					z := u.base[k] + r*ck + e
					u.zero[z>>6] |= 1 << (z & 63)
				}
			}
			i += ck
		}
	}
	return nil
}

// nextSet is the first bit of z set in [i, end), or end.
func nextSet(z []uint64, i, end int) int {
	for i < end {
		if w := z[i>>6] >> (i & 63); w != 0 {
			return min(i+bits.TrailingZeros64(w), end)
		}
		i = (i | 63) + 1
	}
	return end
}

// packLate writes the bits of the elements zero has, in order: whether
// this rank's gradient is not zero there.
func (s *sharded) packLate() {
	u := &s.late
	u.start()
	for k, segs := range s.segs {
		b := u.base[k]
		for _, sg := range segs {
			g, at := s.params[sg.param].GradData(), sg.off-sg.lo-b
			for e := nextSet(u.zero, b+sg.lo, b+sg.hi); e < b+sg.hi; e = nextSet(u.zero, e+1, b+sg.hi) {
				u.put(g[at+e] != 0)
			}
		}
	}
}

// markLate takes the or-ed bits in packLate's order: an element whose bit
// is set leaves zero, and its owner sets its v to vMark.
func (s *sharded) markLate() {
	u := &s.late
	for k, segs := range s.segs {
		b := u.base[k]
		own := b + s.rank*s.chunks[k]
		for _, sg := range segs {
			for e := nextSet(u.zero, b+sg.lo, b+sg.hi); e < b+sg.hi; e = nextSet(u.zero, e+1, b+sg.hi) {
				if !u.next() {
					continue
				}
				u.zero[e>>6] &^= 1 << (e & 63)
				u.n--
				if x := e - own; x >= 0 && x < s.owned[k] {
					if s.vb != nil {
						s.vb[k][x] = uint16(math.Float32bits(vMark) >> 16)
					} else {
						s.v[k][x] = vMark
					}
				}
			}
		}
	}
	if u.n == 0 {
		u.zero = nil
	}
	u.done()
}

// clearLate zeroes the update u of bucket k's elements from lo where
// zero has them.
func (s *sharded) clearLate(k, lo int, u []float32) {
	b := s.late.base[k] + lo
	end := b + len(u)
	for e := nextSet(s.late.zero, b, end); e < end; e = nextSet(s.late.zero, e+1, end) {
		u[e-b] = 0
	}
}

// packMoved is pack for a rank that takes local steps (0/1 Adam's phase
// B): whether this rank's momentum m, zero at the last synchronization
// where v is zero, or its gradient g is not zero there.
func (u *unseen) packMoved(v, m, g []float32) {
	m, g = m[:len(v)], g[:len(v)]
	for j, x := range v {
		if x == 0 {
			u.put(m[j] != 0 || g[j] != 0)
		}
	}
}

// clearUnseen zeroes x where v is zero.
func clearUnseen(x, v []float32) {
	v = v[:len(x)]
	for j := range x {
		if v[j] == 0 {
			x[j] = 0
		}
	}
}
