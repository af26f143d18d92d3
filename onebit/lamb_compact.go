package onebit

// The compact mode of 1-bit LAMB: StateFull's steps, bit for bit, in less
// memory. After the compressed allreduce every rank's momentum is sign x
// scale (one bit per element, one scale per chunk) divided by the
// parameter's scaling and times its mask: the compact mode keeps it in the
// collective's own gathered buffer, and the last step's (m_last, which
// the fresh variance needs) in a packed copy of it, never as float32. The
// update, which StateFull keeps in its scratch buffer until the factor of
// the parameter is known, is computed twice instead, block by block: once
// for the sums the factor needs, once to descend.
//
// The warm-up's float32 momentum lives in v_fresh's buffer, which the
// warm-up has no use for, and its update in the worker error buffer, which
// is zero until the first compression step. v_fresh starts as a copy of
// the frozen v: the first compression step reads v in its place, and
// writes v_fresh over the warm-up's m element by element once it has read
// it. So the whole run, warm-up included, holds v, v_fresh, the worker and
// server errors and the packed buffers: about 12.4 + 4/W bytes per
// parameter against StateFull's 20.3 + 4/W.
//
// Checkpoints are StateFull's. Loading one repacks m, which must then be
// exactly what the compressed allreduce of this group gathers, or (before
// the first compression step) takes the warm-up's m as float32. The one
// exception is a checkpoint whose momentum another group gathered (its
// error buffers reset to move it, or regrouped by Regroup, which says so
// with IntForeignMomentum), whose chunks cannot pack m: m stays float32
// in a buffer of its own (loose) until the next compression step has used
// it as m_last.

import (
	"context"
	"encoding/binary"
	"fmt"
	"iter"
	"math"

	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/signpack"
)

// lambBlockLen is the elements the compact mode unpacks at a time.
const lambBlockLen = 4 << 10

// lambCompact is the state of 1-bit LAMB's StateCompact on more than one
// rank, beyond what Lamb keeps (v, v_fresh's buffer and the fused State,
// whose gathered buffer holds m).
type lambCompact struct {
	st   *State // the fused buffer's, keeping its output packed
	offs []int  // Lamb.offs
	// blocks cut the fused buffer's elements (padding left out) into runs
	// that lie in one piece of one chunk of the gathered messages.
	blocks []lambBlock
	// fresh: m is the float32 momentum of the warm-up, in v_fresh's
	// buffer (until the first compression step); otherwise it is the
	// gathered output of the last compressed allreduce.
	fresh bool
	// loose holds m as float32 in a buffer of its own from the Load of a
	// checkpoint whose momentum another group gathered (errors reset, or
	// IntForeignMomentum) and which this group cannot pack (other chunks)
	// until the next compression step, which needs it as m_last; nil
	// otherwise.
	loose []float32
	// last and lastScales are the gathered messages and scales of the
	// step before (m_last), copied before the allreduce overwrites them.
	last       []byte
	lastScales []float32
	blkM, blkL []float32 // unpacking blocks of m and m_last
	// Per parameter, for the factor: the largest ratio and the sums of
	// squares of the first pass, then the step of the second.
	ratio        []float32
	preSq, updSq []float64
	step         []float32
}

// lambBlock is a run [lo, hi) of the fused buffer's elements whose signs
// start at byte off of the gathered messages, in chunk j (whose scale is
// scales[j]).
type lambBlock struct{ lo, hi, off, j int }

// lambSegment is parameter k's elements [a, b) of the fused buffer within
// one block.
type lambSegment struct{ k, a, b int }

// segments yields the parameters with elements in block bk, each with the
// elements it has there. from is the first parameter that can have
// elements in bk: the blocks come in order, and the caller keeps it from
// one block to the next.
func (o *Lamb) segments(bk lambBlock, from *int) iter.Seq[lambSegment] {
	return func(yield func(lambSegment) bool) {
		for ; o.offs[*from+1] <= bk.lo; *from++ {
		}
		for k := *from; k < len(o.params) && o.offs[k] < bk.hi; k++ {
			a, b := max(o.offs[k], bk.lo), min(o.offs[k+1], bk.hi)
			if a < b && !yield(lambSegment{k, a, b}) {
				return
			}
		}
	}
}

// newLambCompact makes the compact state over st, the State of the fused
// buffer of parameters at offs, and sets st to keep its output packed.
func newLambCompact(st *State, offs []int) (*lambCompact, error) {
	st.keep = true
	np := len(offs) - 1
	c := &lambCompact{
		st: st, offs: offs, fresh: true,
		last:       make([]byte, len(st.gathered)),
		lastScales: make([]float32, len(st.scales)),
		ratio:      make([]float32, np),
		preSq:      make([]float64, np),
		updSq:      make([]float64, np),
		step:       make([]float32, np),
	}
	longest := 0
	for g := range st.gatheredPieces() {
		if g.lo >= g.hi {
			continue
		}
		off := cap(st.gathered) - cap(g.signs)
		if &st.gathered[off] != &g.signs[0] {
			return nil, fmt.Errorf("onebit: StateCompact: the gathered messages are not in the State's gathered buffer")
		}
		for b := g.lo; b < g.hi; b += lambBlockLen {
			e := min(b+lambBlockLen, g.hi)
			c.blocks = append(c.blocks, lambBlock{lo: b, hi: e, off: off + (b-g.lo)/8, j: g.j})
			longest = max(longest, e-b)
		}
	}
	c.blkM, c.blkL = make([]float32, longest), make([]float32, longest)
	return c, nil
}

// unpack writes the values (±scale) of block bk of the messages g and
// scales into dst and returns them.
func (c *lambCompact) unpack(dst []float32, bk lambBlock, g []byte, scales []float32) []float32 {
	n := bk.hi - bk.lo
	signpack.UnpackScale(dst[:n], g[bk.off:bk.off+(n+7)/8], scales[bk.j])
	return dst[:n]
}

// lambUnscale turns gathered values x, ±scale of one chunk, into the
// momentum StateFull keeps: divided by the parameter's scaling s (not
// when it is 1), then times the mask (nil: none), rounded as StateFull
// rounds them. Every element has the same magnitude and rounding to
// nearest is symmetric, so each x/s is ±(scale/s), divided once.
func lambUnscale(x []float32, s float32, mask []float32) {
	if s != 1 && len(x) > 0 {
		q := math.Float32bits(float32(math.Abs(float64(x[0]))) / s)
		for i, xi := range x {
			x[i] = math.Float32frombits(q | math.Float32bits(xi)&(1<<31))
		}
	}
	if mask != nil {
		optim.Mul(x, mask)
	}
}

// maskOf is parameter i's mask of its elements [off, off+n) (nil: none).
func (o *Lamb) maskOf(i, off, n int) []float32 {
	if o.masks[i] == nil {
		return nil
	}
	return o.masks[i][off : off+n]
}

// lambAddMomentum is steps 1 and 3 of StateFull with x = worker_error +
// m added as the compressed allreduce adds it: x += (b1*m + (1-b1)*g)*s,
// rounded as lambMomentum (no product when s is 1).
func lambAddMomentum(x, m, g []float32, b1, s float32) {
	a1 := optim.OneMinus(b1)
	m, g = m[:len(x)], g[:len(x)]
	if s == 1 {
		for i, mi := range m {
			x[i] = x[i] + float32(float32(b1*mi)+float32(a1*g[i]))
		}
		return
	}
	for i, mi := range m {
		x[i] = x[i] + float32((float32(b1*mi)+float32(a1*g[i]))*s)
	}
}

// lambFreshRatio is lambFresh (s = 1) without the update and its sums,
// which the factor needs only with weight decay: v_fresh from g_rec and
// the largest ratio, computed as lambFresh computes them.
func lambFreshRatio(mLast, m, v, vfIn, vfOut []float32, b1, b2, c2, c2Fresh, eps float32, ratio float32) float32 {
	a1, a2 := optim.OneMinus(b1), optim.OneMinus(b2)
	m, v, vfIn, vfOut = m[:len(mLast)], v[:len(mLast)], vfIn[:len(mLast)], vfOut[:len(mLast)]
	for i := range mLast {
		g := float32(m[i]-float32(b1*mLast[i])) / a1
		vf := float32(b2*vfIn[i]) + float32(float32(a2*g)*g)
		vfOut[i] = vf
		d := lambDenom(v[i], c2, eps)
		dr := lambDenom(vf, c2Fresh, eps)
		if r := d / dr; r > ratio {
			ratio = r
		}
	}
	return ratio
}

// lambDescend is the second pass of step 5 on a run of a parameter's
// elements, m unscaled and masked: the update lambFresh computes, element
// by element, and p -= step*update, rounded as optim.Descend.
func lambDescend(p, m, v []float32, wd, c1, c2, eps float32, b optim.RatioBound, step float32) {
	m, v = m[:len(p)], v[:len(p)]
	for i := range p {
		d := lambDenom(v[i], c2, eps)
		pre := b.Of(float32(m[i]*c1)/d, v[i])
		up := pre + float32(wd*p[i])
		p[i] -= float32(step * up)
	}
}

// compactStep is StateFull's compression step (compressed) in
// StateCompact.
func (o *Lamb) compactStep(ctx context.Context, t int64, lr float32) error {
	cfg, c, st := &o.cfg, o.cp, o.ef
	// m_last as float32: the warm-up's, or a loaded one (loose).
	mFloat := c.loose
	if c.fresh {
		mFloat = o.vFresh
	}
	// 2. The scaling, from m before this step's update.
	if !o.scaled {
		o.setScaling(mFloat)
	}
	// 1. and 3. x = worker_error + m, m = (b1*m_last + (1-b1)*g)*scaling,
	// formed in the worker error buffer; m_last is the warm-up's (the
	// worker errors are zero then) or the last step's, from its bits.
	we := st.WorkerError
	if mFloat != nil {
		if c.fresh {
			clear(we) // the warm-up's updates
		}
		for i, p := range o.params {
			lo, hi := o.offs[i], o.offs[i+1]
			if lo < hi {
				lambAddMomentum(we[lo:hi], mFloat[lo:hi], p.GradData(), cfg.Beta1, o.scaling[i])
			}
		}
	} else {
		copy(c.last, st.gathered)
		copy(c.lastScales, st.scales)
		i := 0
		for _, bk := range c.blocks {
			ml := c.unpack(c.blkL, bk, c.last, c.lastScales)
			for sg := range o.segments(bk, &i) {
				k, a, b := sg.k, sg.a, sg.b
				off := a - o.offs[k]
				x := ml[a-bk.lo : b-bk.lo]
				lambUnscale(x, o.scaling[k], o.maskOf(k, off, b-a))
				lambAddMomentum(we[a:b], x, o.params[k].GradData()[off:], cfg.Beta1, o.scaling[k])
			}
		}
	}
	// 4. One compressed allreduce of the fused buffer, its output kept
	// packed.
	if err := st.allReduce(ctx, o.f.Comm(), nil); err != nil {
		return fmt.Errorf("momentum: %w", samePackage{err})
	}
	// 5. Per parameter: unscale, mask, v_fresh, factor (first pass), then
	// the update (second pass).
	bound := ratioBound(cfg.Beta1, cfg.Beta2)
	c1, c2, c2Fresh := o.corrections(t)
	clear(c.ratio)
	clear(c.preSq)
	clear(c.updSq)
	i := 0
	for _, bk := range c.blocks {
		m := c.unpack(c.blkM, bk, st.gathered, st.scales)
		var ml []float32
		if mFloat == nil {
			ml = c.unpack(c.blkL, bk, c.last, c.lastScales)
		}
		for sg := range o.segments(bk, &i) {
			k, a, b := sg.k, sg.a, sg.b
			off, s := a-o.offs[k], o.scaling[k]
			mask := o.maskOf(k, off, b-a)
			mm := m[a-bk.lo : b-bk.lo]
			lambUnscale(mm, s, mask)
			vfOut, vfIn := o.vFresh[a:b], o.vFresh[a:b]
			var u []float32 // m_last on entry
			switch {
			case c.fresh:
				// m_last is the warm-up's m, in v_fresh's buffer, and
				// v_fresh is v.
				u = c.blkL[:b-a]
				copy(u, vfOut)
				vfIn = o.v[a:b]
			case mFloat != nil:
				u = c.blkL[:b-a]
				copy(u, mFloat[a:b])
			default:
				u = ml[a-bk.lo : b-bk.lo]
				lambUnscale(u, s, mask)
			}
			if cfg.WeightDecay > 0 {
				c.ratio[k], c.preSq[k], c.updSq[k] = lambFresh(u, o.params[k].Data()[off:], mm, o.v[a:b], vfIn, vfOut,
					1, cfg.Beta1, cfg.Beta2, cfg.WeightDecay, c1, c2, c2Fresh, cfg.Eps, bound, c.ratio[k], c.preSq[k], c.updSq[k])
			} else {
				// The factor needs the ratio only.
				c.ratio[k] = lambFreshRatio(u, mm, o.v[a:b], vfIn, vfOut, cfg.Beta1, cfg.Beta2, c2, c2Fresh, cfg.Eps, c.ratio[k])
			}
		}
	}
	for k := range o.params {
		if o.offs[k] == o.offs[k+1] {
			continue
		}
		f := o.factor(k, c.ratio[k], c.preSq[k], c.updSq[k])
		c.step[k] = float32(float64(lr) * o.coeffFreeze[k] * f)
	}
	i = 0
	for _, bk := range c.blocks {
		m := c.unpack(c.blkM, bk, st.gathered, st.scales)
		for sg := range o.segments(bk, &i) {
			k, a, b := sg.k, sg.a, sg.b
			off := a - o.offs[k]
			mm := m[a-bk.lo : b-bk.lo]
			lambUnscale(mm, o.scaling[k], o.maskOf(k, off, b-a))
			lambDescend(o.params[k].Data()[off:off+b-a], mm, o.v[a:b], cfg.WeightDecay, c1, c2, cfg.Eps, bound, c.step[k])
		}
	}
	c.fresh, c.loose = false, nil
	return nil
}

// compactState returns m, v_fresh and the worker errors as StateFull
// holds them (new buffers where they are not kept as such; we nil: the
// worker error buffer's own).
func (o *Lamb) compactState() (m, vFresh, we []float32) {
	c := o.cp
	if c.fresh {
		// The worker error buffer holds the warm-up's updates: StateFull's
		// are zero. So is its v_fresh in the warm-up, a copy of v after.
		vFresh = o.v
		if o.f.Stage() == optim.StageWarmup {
			vFresh = make([]float32, len(o.v))
		}
		return o.vFresh, vFresh, make([]float32, len(o.ef.WorkerError))
	}
	if c.loose != nil {
		return c.loose, o.vFresh, nil
	}
	m = make([]float32, o.offs[len(o.params)])
	o.unpackMomentum(m, o.ef.gathered, o.ef.scales, o.scaling)
	return m, o.vFresh, nil
}

// unpackMomentum writes the momentum that the messages g and scales hold
// into m, unscaled by scaling and masked.
func (o *Lamb) unpackMomentum(m []float32, g []byte, scales, scaling []float32) {
	c := o.cp
	i := 0
	for _, bk := range c.blocks {
		x := c.unpack(m[bk.lo:], bk, g, scales)
		for ; o.offs[i+1] <= bk.lo; i++ {
		}
		for k := i; k < len(o.params) && o.offs[k] < bk.hi; k++ {
			a, b := max(o.offs[k], bk.lo), min(o.offs[k+1], bk.hi)
			if a < b {
				lambUnscale(x[a-bk.lo:b-bk.lo], scaling[k], o.maskOf(k, a-o.offs[k], b-a))
			}
		}
	}
}

// compactLoad prepares taking a checkpoint's m, v_fresh, v and worker
// errors (flat; we nil when reset) with its scaling. Before the first
// compression step (warm-up, or scaled false) m goes into v_fresh's
// buffer as float32, which needs StateFull's v_fresh then (zero in the
// warm-up, v after) and zero worker errors; otherwise m must be a gathered
// momentum, ±scale per chunk divided by the scaling and times the masks,
// which is packed into the State's gathered buffer. In the compression
// stage a checkpoint whose momentum another group gathered (foreign: its
// errors reset to move it, or IntForeignMomentum, as Regroup sets it) may
// hold any m: m then stays float32 in a buffer of its own (loose) until
// the next compression step, and the worker errors (we) are taken as they
// are. Anything else is refused. Nothing changes before the returned
// commit is called.
//
// m and vFresh are new buffers that compactLoad may keep; v is the
// checkpoint's, per parameter.
func (o *Lamb) compactLoad(m, vFresh []float32, v [][]float32, we []float32, scaling []float32, stage optim.Stage, scaled, foreign bool) (commit func(), err error) {
	c := o.cp
	refuse := func(what string) error {
		return fmt.Errorf("%w: %s, a state StateCompact cannot hold: load it with StateFull", optim.ErrIncompatibleCheckpoint, what)
	}
	loose := func() {
		c.fresh, c.loose = false, m
		copy(o.vFresh, vFresh)
		if we != nil {
			copy(o.ef.WorkerError, we)
		}
	}
	if stage == optim.StageWarmup || !scaled {
		bad := ""
		for _, x := range we {
			if x != 0 {
				bad = "its worker errors are not zero before the first compression step"
				break
			}
		}
		for k := range o.params {
			for j, x := range vFresh[o.offs[k]:o.offs[k+1]] {
				if bad != "" {
					break
				}
				if stage == optim.StageWarmup && math.Float32bits(x) != 0 {
					bad = fmt.Sprintf("its v_fresh is not zero in the warm-up (element %d of %q is %v)", j, o.params[k].Name, x)
				}
				if stage == optim.StageCompression && math.Float32bits(x) != math.Float32bits(v[k][j]) {
					bad = fmt.Sprintf("its v_fresh is not the frozen v before the first compression step (element %d of %q is %v, v %v)",
						j, o.params[k].Name, x, v[k][j])
				}
			}
		}
		switch {
		case bad == "":
			return func() {
				c.fresh, c.loose = true, nil
				copy(o.vFresh, m)
				clear(o.ef.WorkerError)
			}, nil
		case foreign && stage == optim.StageCompression:
			return loose, nil
		}
		return nil, refuse(bad)
	}
	g, scales, err := o.pack(m, scaling)
	if err != nil {
		if foreign {
			return loose, nil
		}
		return nil, err
	}
	return func() {
		c.fresh, c.loose = false, nil
		copy(o.ef.gathered, g)
		copy(o.ef.scales, scales)
		copy(o.vFresh, vFresh)
		if we != nil {
			copy(o.ef.WorkerError, we)
		}
	}, nil
}

// pack is the momentum m (flat) as the gathered messages of the fused
// State would hold it with the scaling given: signs and a scale per chunk,
// in a buffer laid out as the State's gathered one, and the scales; or an
// error if no scale per chunk gives m back exactly.
func (o *Lamb) pack(m, scaling []float32) ([]byte, []float32, error) {
	c, st := o.cp, o.ef
	chunkLen := len(st.ServerError)
	total := o.offs[len(o.params)]
	// maskAt is the mask of element e of parameter k (1 when unmasked).
	maskAt := func(k, e int) float32 {
		if o.masks[k] == nil {
			return 1
		}
		return o.masks[k][e-o.offs[k]]
	}
	// fits says whether the scale sc gives back elements [lo, hi) of m.
	fits := func(sc float32, lo, hi int) bool {
		k := 0
		for e := lo; e < hi; e++ {
			for o.offs[k+1] <= e {
				k++
			}
			mk := maskAt(k, e)
			x := sc
			if math.Signbit(float64(m[e])) != math.Signbit(float64(mk)) {
				x = -sc
			}
			if s := scaling[k]; s != 1 {
				x /= s
			}
			if o.masks[k] != nil {
				x *= mk
			}
			if math.Float32bits(x) != math.Float32bits(m[e]) {
				return false
			}
		}
		return true
	}
	scales := make([]float32, st.world)
	for j := range scales {
		lo, hi := j*chunkLen, min((j+1)*chunkLen, total)
		// The scale that gives back the first element with a mask (the
		// others are ±0 whatever it is), or one of its neighbours.
		var guess float32
		k := 0
		for e := lo; e < hi; e++ {
			for o.offs[k+1] <= e {
				k++
			}
			if mk := maskAt(k, e); mk != 0 {
				guess = float32(math.Abs(float64(m[e])) * float64(scaling[k]) / math.Abs(float64(mk)))
				break
			}
		}
		found := false
		for d := range 33 {
			step := (d + 1) / 2
			if d%2 == 1 {
				step = -step
			}
			bits := int64(math.Float32bits(guess)) + int64(step)
			if bits < 0 || bits >= 0x7f800000 {
				continue
			}
			if sc := math.Float32frombits(uint32(bits)); fits(sc, lo, hi) {
				scales[j], found = sc, true
				break
			}
		}
		if !found {
			return nil, nil, o.notPacked(m, lo, guess)
		}
	}
	g := make([]byte, len(st.gathered))
	for j := range st.world {
		scale := st.msgPiece(0, j)
		binary.LittleEndian.PutUint32(g[cap(st.gathered)-cap(scale):], math.Float32bits(scales[j]))
	}
	sgn := c.blkM
	k := 0
	for _, bk := range c.blocks {
		for e := bk.lo; e < bk.hi; e++ {
			for o.offs[k+1] <= e {
				k++
			}
			sgn[e-bk.lo] = 1
			if math.Signbit(float64(m[e])) != math.Signbit(float64(maskAt(k, e))) {
				sgn[e-bk.lo] = -1
			}
		}
		n := bk.hi - bk.lo
		signpack.Pack(g[bk.off:bk.off+(n+7)/8], sgn[:n])
	}
	// What the steps will read back must be m, bit for bit.
	k = 0
	for _, bk := range c.blocks {
		x := c.unpack(c.blkM, bk, g, scales)
		for ; o.offs[k+1] <= bk.lo; k++ {
		}
		for i := k; i < len(o.params) && o.offs[i] < bk.hi; i++ {
			a, b := max(o.offs[i], bk.lo), min(o.offs[i+1], bk.hi)
			if a < b {
				lambUnscale(x[a-bk.lo:b-bk.lo], scaling[i], o.maskOf(i, a-o.offs[i], b-a))
			}
		}
		for j, xj := range x {
			if math.Float32bits(xj) != math.Float32bits(m[bk.lo+j]) {
				return nil, nil, o.notPacked(m, bk.lo+j, xj)
			}
		}
	}
	return g, scales, nil
}

// notPacked is the error of a momentum whose element e cannot be packed
// (x: what packing gave instead, or the scale tried).
func (o *Lamb) notPacked(m []float32, e int, x float32) error {
	return fmt.Errorf("%w: its momentum is not a compressed one (element %d of the fused buffer is %v, not ±%v divided by its scaling "+
		"and times its mask): load it with StateFull", optim.ErrIncompatibleCheckpoint, e, m[min(e, len(m)-1)], x)
}

// stateBytes is the bytes of the buffers c keeps beyond Lamb's and the
// fused State's (the loose m, 4 bytes per parameter, only from a Load
// that needs it to the next compression step).
func (c *lambCompact) stateBytes() int64 {
	if c == nil {
		return 0
	}
	return int64(cap(c.last)) + optim.Float32Bytes(c.lastScales, c.blkM, c.blkL, c.loose)
}
