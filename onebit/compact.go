package onebit

// The compact mode of 1-bit Adam: the same steps as StateFull, bit for
// bit, in less memory. After the compressed allreduce every rank's
// momentum is sign x scale, one bit per element and one scale per chunk:
// the compact mode keeps it in that form, in the collective's own
// gathered buffer, and never as float32. The momentum of the warm-up,
// which is float32, lives in the buffer that becomes the worker error
// buffer: the first compression step forms x = 0 + m in place.

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/signpack"
)

// compact is the state of StateCompact on more than one rank.
type compact struct {
	layout
	// mw holds every bucket's padded region, bucket after bucket (bucket
	// k from off[k]): the momentum in the warm-up and until the first
	// compression step (fresh), the worker error buffers after it (each
	// bucket's State.WorkerError is its region).
	mw    []float32
	off   []int
	fresh bool
	mask  [][]float32 // per parameter, nil when unmasked
	// loose holds the momentum as float32, per parameter, from the Load
	// of a checkpoint whose momentum another group gathered (Regroup's:
	// IntForeignMomentum) and whose chunks this group cannot pack, until
	// the next compression step has formed x from it; nil otherwise.
	loose [][]float32
}

// newCompact makes the buckets and the shared momentum and worker error
// buffer of StateCompact on world > 1 ranks.
func newCompact(params []*optim.Param, masks [][]float32, world, bytes int) (*compact, error) {
	b, err := newBuckets(params, world, bytes, true)
	if err != nil {
		return nil, err
	}
	c := &compact{layout: newLayout(params, b), mask: masks, fresh: true}
	n := 0
	c.off = make([]int, len(b.states))
	for k, st := range b.states {
		c.off[k] = n
		n += len(st.WorkerError)
	}
	c.mw = make([]float32, n)
	for k, st := range b.states {
		st.WorkerError = c.mw[c.off[k] : c.off[k]+len(st.WorkerError) : c.off[k]+len(st.WorkerError)]
		st.keep = true
	}
	return c, nil
}

// momentum is segment sg of bucket k's float32 momentum (fresh only).
func (c *compact) momentum(k int, sg segment) []float32 {
	return c.mw[c.off[k]+sg.lo : c.off[k]+sg.hi]
}

// warmup is StateFull's warm-up update on the averaged gradients, segment
// by segment (the same elementwise arithmetic).
func (c *compact) warmup(cfg optim.AdamConfig, v [][]float32, lr, c1, c2 float32) {
	for k, segs := range c.segs {
		for _, sg := range segs {
			p := c.params[sg.param]
			m := c.momentum(k, sg)
			vs := v[sg.param][sg.off : sg.off+len(m)]
			optim.AdamMoments(m, vs, p.GradData()[sg.off:sg.off+len(m)], cfg.Beta1, cfg.Beta2)
			optim.AdamUpdate(p.Data()[sg.off:sg.off+len(m)], m, vs, lr, cfg.WeightDecay, c1, c2, cfg.Eps)
		}
	}
}

// compressed is StateFull's compression step: per bucket, the local
// momentum formed straight into the worker error buffer (x = worker_error
// + (beta1*m + (1-beta1)*g), m read from the bits of the last step), the
// compressed allreduce, and the update from the bits it gathered.
func (c *compact) compressed(ctx context.Context, cm comm.Comm, cfg optim.AdamConfig, v [][]float32, lr, c1, c2 float32) error {
	bound := ratioBound(cfg.Beta1, cfg.Beta2)
	a1 := optim.OneMinus(cfg.Beta1)
	nb := len(c.bkt.states)
	for k, st := range c.bkt.states {
		switch {
		case c.fresh:
			// x = 0 + (beta1*m + (1-beta1)*g), m the warm-up's, in place.
			for _, sg := range c.segs[k] {
				m := c.momentum(k, sg)
				g := c.params[sg.param].GradData()[sg.off : sg.off+len(m)]
				for i := range m {
					m[i] = 0 + (float32(cfg.Beta1*m[i]) + float32(a1*g[i]))
				}
			}
		case c.loose != nil:
			// x = worker_error + (beta1*m + (1-beta1)*g), m the loaded one.
			for _, sg := range c.segs[k] {
				x := st.WorkerError[sg.lo:sg.hi]
				addMomentum(x, c.loose[sg.param][sg.off:], c.params[sg.param].GradData()[sg.off:], cfg.Beta1, a1)
			}
		default:
			for lo, m := range st.outputs() {
				c.formX(k, st, lo, m, cfg.Beta1, a1)
			}
		}
		if err := st.allReduce(ctx, cm, nil); err != nil {
			return fmt.Errorf("momentum: bucket %d of %d: %w", k, nb, samePackage{err})
		}
		for lo, m := range st.outputs() {
			c.update(k, lo, m, v, cfg, lr, c1, c2, bound)
		}
	}
	c.fresh, c.loose = false, nil
	return nil
}

// masked multiplies the block m of bucket k's elements from lo by their
// masks, as StateFull masks its momentum after the allreduce.
func (c *compact) masked(k, lo int, m []float32) {
	for sp := range c.spans(k, lo, lo+len(m)) {
		if mk := c.mask[sp.sg.param]; mk != nil {
			optim.Mul(sp.at(m, lo), sp.of(mk))
		}
	}
}

// formX is step 1 with the local momentum on a block: x = worker_error +
// (beta1*m + (1-beta1)*g), m the block of the last step's momentum
// (unmasked as gathered), rounded as optim.Momentum and the compressed
// allreduce round it; x stays in the worker error buffer.
func (c *compact) formX(k int, st *State, lo int, m []float32, beta1, a1 float32) {
	c.masked(k, lo, m)
	for sp := range c.spans(k, lo, lo+len(m)) {
		addMomentum(st.WorkerError[sp.a:sp.b], sp.at(m, lo), sp.of(c.params[sp.sg.param].GradData()), beta1, a1)
	}
}

// addMomentum adds the local momentum to x: x += beta1*m + (1-beta1)*g,
// rounded as optim.Momentum and the compressed allreduce round it.
func addMomentum(x, m, g []float32, beta1, a1 float32) {
	m, g = m[:len(x)], g[:len(x)]
	for j := range x {
		x[j] = x[j] + (float32(beta1*m[j]) + float32(a1*g[j]))
	}
}

// update is StateFull's update on a block of the gathered momentum: the
// mask, then optim.AdamUpdateBounded with the frozen v.
func (c *compact) update(k, lo int, m []float32, v [][]float32, cfg optim.AdamConfig, lr, c1, c2 float32, bound optim.RatioBound) {
	c.masked(k, lo, m)
	for sp := range c.spans(k, lo, lo+len(m)) {
		p, vs := sp.of(c.params[sp.sg.param].Data()), sp.of(v[sp.sg.param])
		optim.AdamUpdateBounded(p, sp.at(m, lo), vs, lr, cfg.WeightDecay, c1, c2, cfg.Eps, bound)
	}
}

// moments returns every parameter's momentum as StateFull holds it, in
// new buffers: the warm-up's float32 one while fresh, the loaded one while
// loose, else the gathered one, masked; and the worker errors (zero while
// fresh).
func (c *compact) moments() (m [][]float32, we [][]float32) {
	m = make([][]float32, len(c.params))
	for i, p := range c.params {
		m[i] = make([]float32, p.Numel())
		if c.loose != nil {
			copy(m[i], c.loose[i])
		}
	}
	we = make([][]float32, len(c.bkt.states))
	for k, st := range c.bkt.states {
		if c.loose != nil {
			we[k] = st.WorkerError
			continue
		}
		if c.fresh {
			for _, sg := range c.segs[k] {
				copy(m[sg.param][sg.off:], c.momentum(k, sg))
			}
			we[k] = make([]float32, len(st.WorkerError))
			continue
		}
		we[k] = st.WorkerError
		for lo, blk := range st.outputs() {
			c.masked(k, lo, blk)
			for sp := range c.spans(k, lo, lo+len(blk)) {
				copy(sp.of(m[sp.sg.param]), sp.at(blk, lo))
			}
		}
	}
	return m, we
}

// load prepares taking a checkpoint's momentum m (per parameter) and
// worker errors we (per bucket): with every worker error zero (or none,
// in the warm-up), the momentum goes into the shared buffer as float32
// (fresh); otherwise it must be a gathered momentum, ±scale per chunk
// (masked), which load packs into each State's gathered buffer. A
// momentum that is not is refused, unless foreign says another group
// gathered it (IntForeignMomentum): it is then held as float32 (loose)
// until the next compression step. Nothing changes before the returned
// commit is called; m and we may be the checkpoint's (load copies them).
func (c *compact) load(m, we [][]float32, compressing, foreign bool) (commit func(), err error) {
	fresh := !compressing
	if compressing {
		fresh = true
		for _, w := range we {
			for _, x := range w {
				if x != 0 {
					fresh = false
				}
			}
		}
	}
	if fresh {
		return func() {
			c.fresh, c.loose = true, nil
			clear(c.mw)
			for k, segs := range c.segs {
				for _, sg := range segs {
					copy(c.momentum(k, sg), m[sg.param][sg.off:])
				}
			}
		}, nil
	}
	// Pack the momentum into new gathered buffers and check that the bits
	// and scales give it back exactly.
	gathered := make([][]byte, len(c.bkt.states))
	scales := make([][]float32, len(c.bkt.states))
	for k, st := range c.bkt.states {
		g, sc, err := c.pack(k, st, m)
		if err != nil && foreign {
			return c.loadLoose(m, we), nil
		}
		if err != nil {
			return nil, err
		}
		gathered[k], scales[k] = g, sc
	}
	return func() {
		c.fresh, c.loose = false, nil
		for k, st := range c.bkt.states {
			copy(st.gathered, gathered[k])
			copy(st.scales, scales[k])
			copy(st.WorkerError, we[k])
		}
	}, nil
}

// loadLoose is load's commit of a momentum held as float32 (loose).
func (c *compact) loadLoose(m, we [][]float32) func() {
	loose := make([][]float32, len(m))
	for i, x := range m {
		loose[i] = slices.Clone(x)
	}
	return func() {
		c.fresh, c.loose = false, loose
		for k, st := range c.bkt.states {
			copy(st.WorkerError, we[k])
		}
	}
}

// pack is bucket k's momentum m (per parameter) as the phase 2 messages
// of st would gather it: signs and a scale per chunk, in a buffer laid out
// as st.gathered, and the scales; or an error if m is not ±scale per chunk
// times the masks.
func (c *compact) pack(k int, st *State, m [][]float32) ([]byte, []float32, error) {
	chunkLen := len(st.ServerError)
	maskOf := func(e int) float32 { // the mask of element e of bucket k
		sg := c.segs[k][c.segsFrom(k, e)]
		if mk := c.mask[sg.param]; mk != nil {
			return mk[sg.off+e-sg.lo]
		}
		return 1
	}
	value := func(e int) float32 {
		sg := c.segs[k][c.segsFrom(k, e)]
		return m[sg.param][sg.off+e-sg.lo]
	}
	scales := make([]float32, st.world)
	for j := range scales {
		for e := j * chunkLen; e < min((j+1)*chunkLen, st.numel); e++ {
			if mk := maskOf(e); mk == 1 {
				scales[j] = float32(math.Abs(float64(value(e))))
				break
			} else if mk != 0 && scales[j] == 0 {
				scales[j] = float32(math.Abs(float64(value(e)) / float64(mk)))
			}
		}
	}
	saved, savedScales := st.gathered, st.scales
	g := make([]byte, len(st.gathered))
	st.gathered, st.scales = g, scales
	defer func() { st.gathered, st.scales = saved, savedScales }()
	sgn := make([]float32, min(len(st.server), chunkLen))
	for j := range st.world {
		for p := range st.pieces {
			signs := st.msgPiece(p, j)
			if p == 0 {
				binary.LittleEndian.PutUint32(signs, math.Float32bits(scales[j]))
				signs = signs[4:]
			}
			lo := j*chunkLen + p*st.pieceBytes*8
			hi := min(lo+len(signs)*8, st.numel)
			if lo >= hi {
				continue
			}
			for b := lo; b < hi; b += len(sgn) {
				e := min(b+len(sgn), hi)
				for i := b; i < e; i++ {
					sgn[i-b] = 1
					if math.Signbit(float64(value(i))) != math.Signbit(float64(maskOf(i))) {
						sgn[i-b] = -1
					}
				}
				signpack.Pack(signs[(b-lo)/8:(e-lo+7)/8], sgn[:e-b])
			}
		}
	}
	for lo, blk := range st.outputs() {
		c.masked(k, lo, blk)
		for i, x := range blk {
			if want := value(lo + i); math.Float32bits(x) != math.Float32bits(want) {
				return nil, nil, fmt.Errorf("%w: its momentum is not a compressed one (element %d of bucket %d is %v, not ±%v times its mask): "+
					"load it with StateFull", optim.ErrIncompatibleCheckpoint, lo+i, k, want, scales[(lo+i)/chunkLen])
			}
		}
	}
	return g, scales, nil
}

// stateBytes is the bytes of the shared momentum and worker error buffer
// and every bucket's State (whose worker error buffers are in it).
func (c *compact) stateBytes() int64 {
	n := optim.Float32Bytes(c.mw) + optim.Float32Bytes(c.loose...) + c.bkt.stateBytes()
	for _, st := range c.bkt.states {
		n -= optim.Float32Bytes(st.WorkerError)
	}
	return n
}
