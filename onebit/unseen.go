package onebit

// The rule for elements with no gradient (see the package doc): an
// element whose v is exactly zero takes no step (optim.RatioBound.Of),
// and unseen finds those some rank then gives gradient, so that they
// train.

import (
	"context"
	"fmt"
	"math"
	"math/bits"

	"github.com/lowbit-ml/lowbit/comm"
)

// vMark is the variance given to an element whose v was exactly zero once
// some rank gives it gradient (see unseen): far below the square of any
// gradient the variance could have taken from (2^-100, whose square root
// is 1e-15 of the default eps), so that the element's ratio is bounded as
// one of a v of zero was before the rule, and exact in bfloat16.
const vMark = 0x1p-100

// unseen finds, every step that runs it, which of the elements whose v is
// exactly zero (no gradient has reached their variance: they take no
// step) some rank has given gradient: each rank writes one bit per such
// element, in the order of the elements, the ranks' bits are gathered
// (one AllGatherBytes of n/8 bytes) and or-ed, and each element with its
// bit set has its v set to vMark, on every rank alike, so that it trains
// from the next step on. The decision depends on v and the gathered bits
// alone, the same on every rank; nothing is added to the state.
//
// zero marks the elements whose v is zero, one bit per element of the
// optimizer's order of them (its parameters' elements one after the
// other; StateSharded's padded buckets), so that a step visits them
// without reading v: it is built from v when the count is reset, kept
// while some element is left, and released with the buffers when none
// is.
type unseen struct {
	stale bool     // v changed (a freeze, a Load, a variance step): ready counts again
	n     int      // the elements with v exactly zero, the same on every rank
	zero  []uint64 // bit e set: element e has v zero; nil when n is 0
	bits  []byte   // this rank's bits, then every rank's or-ed
	all   []byte   // every rank's bits, gathered
	i     int      // the bit that put or next reads
	world int
}

// ready says whether some element has v zero, counting them from vs (see
// count) if v changed since they were last counted.
func (u *unseen) ready(world int, vs ...[]float32) bool {
	if u.stale {
		u.count(world, vs...)
	}
	return u.n > 0
}

// count sets zero and n from vs, the elements in order (the slices one
// after the other), on world ranks; zero grows to fit them (the only
// allocation besides start's).
func (u *unseen) count(world int, vs ...[]float32) {
	u.stale = false
	u.world = max(world, 1)
	total, n := 0, 0
	for _, v := range vs {
		total += len(v)
		for _, x := range v {
			if x == 0 {
				n++
			}
		}
	}
	u.n = n
	if n == 0 {
		u.done()
		return
	}
	u.zero = grow(u.zero, (total+63)/64)
	e := 0
	for _, v := range vs {
		for _, x := range v {
			if x == 0 {
				u.zero[e>>6] |= 1 << (e & 63)
			}
			e++
		}
	}
}

// grow is buf with length n, cleared, reallocated if it is shorter.
func grow[T any](buf []T, n int) []T {
	if cap(buf) < n {
		return make([]T, n)
	}
	buf = buf[:n]
	clear(buf)
	return buf
}

// start clears the bits of the n elements and starts writing them from
// the first. The buffers grow to fit n (at the first step after a count
// of more elements than they fit).
func (u *unseen) start() {
	nb := (u.n + 7) / 8
	u.bits = grow(u.bits, nb)
	if u.world > 1 && cap(u.all) < u.world*nb {
		u.all = make([]byte, u.world*nb)
	}
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

// pack writes the bits of the elements from off that zero has, g holding
// this rank's gradient of the elements [off, off+len(g)): whether it is
// not zero there.
func (u *unseen) pack(off int, g []float32) {
	end := off + len(g)
	for e := nextSet(u.zero, off, end); e < end; e = nextSet(u.zero, e+1, end) {
		u.put(g[e-off] != 0)
	}
}

// packMoved is pack for a rank that takes local steps (0/1 Adam's phase
// B): whether its momentum m, zero at the last synchronization where v is
// zero, or its gradient g is not zero there.
func (u *unseen) packMoved(off int, m, g []float32) {
	end := off + len(g)
	m = m[:len(g)]
	for e := nextSet(u.zero, off, end); e < end; e = nextSet(u.zero, e+1, end) {
		u.put(m[e-off] != 0 || g[e-off] != 0)
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

// take reads the bit of element e, the next zero has, and takes e out of
// zero if it is set.
func (u *unseen) take(e int) bool {
	if !u.next() {
		return false
	}
	u.zero[e>>6] &^= 1 << (e & 63)
	u.n--
	return true
}

// mark sets v, the elements [off, off+len(v)), to vMark where the bits
// read, in the order pack wrote them, are set.
func (u *unseen) mark(off int, v []float32) {
	end := off + len(v)
	for e := nextSet(u.zero, off, end); e < end; e = nextSet(u.zero, e+1, end) {
		if u.take(e) {
			v[e-off] = vMark
		}
	}
}

// erase zeroes x, the elements [off, off+len(x)), where zero has them.
func (u *unseen) erase(off int, x []float32) {
	end := off + len(x)
	for e := nextSet(u.zero, off, end); e < end; e = nextSet(u.zero, e+1, end) {
		x[e-off] = 0
	}
}

// done releases zero and the buffers once no element is left.
func (u *unseen) done() {
	if u.n == 0 {
		u.zero, u.bits, u.all = nil, nil, nil
	}
}

// bytes is the bytes of u's buffers.
func (u *unseen) bytes() int64 { return 8*int64(cap(u.zero)) + int64(cap(u.bits)+cap(u.all)) }

// shardLate is unseen in StateSharded, where a rank holds v of its own
// chunks only but applies the update of every element: zero, the same on
// every rank, in the buckets' padded layout (bit base[k]+e for element e
// of bucket k), says which elements have v exactly zero, so that every
// rank leaves them where they are (their update comes back compressed,
// ±scale like any other) and every rank writes their bits.
type shardLate struct {
	unseen
	// known says that zero is gathered: it is not from a change of the
	// state's layout (the end of the warm-up, a Load) to the next
	// compression step, which gathers it from the owners' v.
	known bool
	base  []int
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
	u := &s.late
	u.known = true
	w := c.Size()
	nb := (sum(s.chunks) + 7) / 8
	if nb == 0 { // no elements
		return nil
	}
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
	u.n, u.world = n, w
	if n == 0 {
		u.done()
		return nil
	}
	u.base = make([]int, len(s.chunks))
	total := 0
	for k := range s.chunks {
		u.base[k] = total
		total += s.padded[k]
	}
	u.zero = grow(u.zero, (total+63)/64)
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

// packLate writes the bits of the elements zero has, in order: whether
// this rank's gradient is not zero there.
func (s *sharded) packLate() {
	u := &s.late
	u.start()
	for k, segs := range s.segs {
		for _, sg := range segs {
			u.pack(u.base[k]+sg.lo, s.params[sg.param].GradData()[sg.off:sg.off+sg.hi-sg.lo])
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
				if !u.take(e) {
					continue
				}
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
	u.done()
}

// clearLate zeroes the update u of bucket k's elements from lo where
// zero has them.
func (s *sharded) clearLate(k, lo int, u []float32) {
	s.late.erase(s.late.base[k]+lo, u)
}
