package onebit

// The compact state of 1-bit Muon (MuonConfig.StateMode StateCompact) on
// more than one rank: StateFull's steps without the float32 slot of the
// exchange. Each rank adds its updates (a matrix's orthogonalized
// momentum times sqrt(max(rows, cols)), an AdamW parameter's momentum
// times k_p) straight into the worker error buffer, kept in bfloat16, so
// that the compressed allreduce forms x = worker_error with the input
// already in it; the average it gathers stays packed (one bit per element
// and a scale per chunk) and is applied a block at a time. The Muon
// momentum is float32, or bfloat16 with MomentumBF16 in the compression
// stage.

import (
	"context"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/quant"
)

// muonCompact is the state of StateCompact beside Muon's own fields.
type muonCompact struct {
	layout
	bf16mom bool
	// psegs lists every parameter's segments: bucket and segment.
	psegs [][]bucketSegment
	// padded is every bucket's padded length.
	padded []int
	// In the compression stage: the worker errors in bfloat16, per
	// bucket (each bucket's State forms x from them through a
	// bf16Residual and has no WorkerError), and with bf16mom the Muon
	// momenta in bfloat16, per parameter (nil for AdamW's, and Muon's
	// float32 momenta are then nil). None in the warm-up.
	we     [][]uint16
	weFlat []uint16
	mb     [][]uint16
	mbFlat []uint16
	// block is where an AdamW parameter's momentum is scaled by k_p
	// before it is added into the worker errors.
	block []float32
}

// bucketSegment is a segment of bucket k.
type bucketSegment struct {
	k int
	segment
}

// compactBlock is the elements of muonCompact.block.
const compactBlock = 4 << 10

// newMuonCompact lays the compact state out over the buckets of b, whose
// States keep their output packed and whose worker errors it keeps
// itself; b's layout holds the parameters in order (params[order[k]] is
// its k-th), and the segments name them by their index in params.
func newMuonCompact(params []*optim.Param, order []int, b *buckets, bf16mom bool) *muonCompact {
	ordered := make([]*optim.Param, len(order))
	for k, i := range order {
		ordered[k] = params[i]
	}
	c := &muonCompact{layout: newLayout(ordered, b), bf16mom: bf16mom, block: make([]float32, compactBlock)}
	c.params = params
	for _, segs := range c.segs {
		for j := range segs {
			segs[j].param = order[segs[j].param]
		}
	}
	c.psegs = make([][]bucketSegment, len(params))
	for k, segs := range c.segs {
		for _, sg := range segs {
			c.psegs[sg.param] = append(c.psegs[sg.param], bucketSegment{k, sg})
		}
	}
	c.padded = make([]int, len(b.states))
	for k, st := range b.states {
		c.padded[k] = len(st.WorkerError)
		st.WorkerError = nil
		st.keep = true
	}
	return c
}

// bf16Residual is a worker error kept in bfloat16, as a workerSource:
// x is the residual widened (the input added into it beforehand), the new
// residual is rounded to nearest even.
type bf16Residual []uint16

func (e bf16Residual) form(x []float32, lo int) {
	quant.Widen(quant.BF16, x, e[lo:lo+len(x)])
}

func (e bf16Residual) keep(r []float32, lo int) {
	quant.Narrow(quant.BF16, e[lo:lo+len(r)], r)
}

// foldBF16 adds x into the bfloat16 worker error e: e = bf16(e + x),
// rounded to nearest even; x is overwritten with the float32 sum.
func foldBF16(e []uint16, x []float32) {
	e = e[:len(x)]
	for j, h := range e {
		x[j] += math.Float32frombits(uint32(h) << 16)
	}
	quant.Narrow(quant.BF16, e, x)
}

// setCompressing lays the state out for the compression stage (on) or
// the warm-up, with the float32 momenta mom (per parameter, nil for
// AdamW's: Muon's fields, replaced where the layout changes) and the
// worker errors we (per bucket, float32; nil: zero), which it narrows
// into bfloat16 ones. With bf16mom the float32 momenta are released
// before the bfloat16 worker errors are made, so that the switch does not
// raise the peak memory beyond the warm-up's float32 momenta and the
// bfloat16 ones they are rounded into.
func (c *muonCompact) setCompressing(on bool, mom [][]float32, we [][]float32) {
	c.weFlat, c.we = nil, nil
	c.mbFlat, c.mb = nil, nil
	for _, st := range c.bkt.states {
		st.worker = nil
	}
	if !on {
		return
	}
	if c.bf16mom {
		sizes := make([]int, len(mom))
		for i, m := range mom {
			sizes[i] = len(m)
		}
		c.mbFlat, c.mb = flatten[uint16](sizes)
		for i, m := range mom {
			quant.Narrow(quant.BF16, c.mb[i], m)
			mom[i] = nil
		}
	}
	c.weFlat, c.we = flatten[uint16](c.padded)
	for k, st := range c.bkt.states {
		if we != nil {
			quant.Narrow(quant.BF16, c.we[k], we[k])
		}
		st.worker = bf16Residual(c.we[k])
	}
}

// momenta returns the float32 momenta of the compression stage's bfloat16
// ones, widened exactly, in new buffers (mom where they are float32).
func (c *muonCompact) momenta(mom [][]float32) [][]float32 {
	if c.mb == nil {
		return mom
	}
	out := make([][]float32, len(c.mb))
	for i, h := range c.mb {
		if len(h) > 0 || mom[i] != nil {
			out[i] = make([]float32, len(h))
			quant.Widen(quant.BF16, out[i], h)
		}
	}
	return out
}

// workerErrors returns the worker errors widened into new float32
// buffers, zero in the warm-up.
func (c *muonCompact) workerErrors() [][]float32 {
	_, out := flatten[float32](c.padded)
	if c.we != nil {
		for k := range out {
			quant.Widen(quant.BF16, out[k], c.we[k])
		}
	}
	return out
}

// foldParam adds x, parameter i's input to the exchange, into the worker
// errors of the buckets it lies in; x is overwritten.
func (c *muonCompact) foldParam(i int, x []float32) {
	for _, bs := range c.psegs[i] {
		foldBF16(c.we[bs.k][bs.lo:bs.hi], x[bs.off:bs.off+bs.hi-bs.lo])
	}
}

// foldScaled adds m*k (each product rounded to float32, StateFull's
// scaling of an AdamW momentum) into parameter i's worker errors, a
// block at a time.
func (c *muonCompact) foldScaled(i int, m []float32, k float32) {
	for _, bs := range c.psegs[i] {
		src, dst := m[bs.off:bs.off+bs.hi-bs.lo], c.we[bs.k][bs.lo:bs.hi]
		for b := 0; b < len(src); b += len(c.block) {
			e := min(b+len(c.block), len(src))
			x := c.block[:e-b]
			for j, v := range src[b:e] {
				x[j] = float32(v * k)
			}
			foldBF16(dst[b:e], x)
		}
	}
}

// stateBytes is the bytes of the bfloat16 buffers and the block.
func (c *muonCompact) stateBytes() int64 {
	if c == nil {
		return 0
	}
	return 2*int64(cap(c.weFlat)+cap(c.mbFlat)) + optim.Float32Bytes(c.block)
}

// compressedCompact is the compression-stage step of StateCompact on more
// than one rank: StateFull's formulas, the inputs added into the worker
// errors, the output applied from the packed form. Without aux it is the
// Muon group's step alone, through its buckets (the first bkt.split: the
// warm-up of WarmupAdamWOnly).
func (o *Muon) compressedCompact(ctx context.Context, t int64, lr, alr float32, aux bool) error {
	cfg, c := o.cfg, o.cm
	nb := c.bkt.split
	if aux {
		nb = len(c.bkt.states)
		for _, i := range o.aux {
			optim.Momentum(o.slot[i], o.params[i].GradData(), cfg.AdamBeta1)
		}
	}
	rank, np := o.f.Rank(), len(o.params)
	for _, mt := range o.mats {
		p := o.params[mt.i]
		m := o.mom[mt.i]
		if c.mb != nil {
			m = o.scratch[:p.Numel()]
			optim.MomentumBF16(c.mb[mt.i], m, p.GradData(), cfg.Momentum, optim.RoundingSeed(t, rank*np+mt.i))
		} else {
			optim.Momentum(m, p.GradData(), cfg.Momentum)
		}
		if mt.orth == nil {
			continue
		}
		x := o.scratch[:p.Numel()]
		mt.orth.Orthogonalize(x, m, p.GradData(), mt.rows, mt.cols, cfg.MuonConfig, mt.unit)
		c.foldParam(mt.i, x)
	}
	if aux {
		for _, i := range o.aux {
			c.foldScaled(i, o.slot[i], o.unit[i])
		}
	}
	decay := float32(1 - float64(lr)*float64(cfg.WeightDecay))
	for _, mt := range o.mats {
		o.step[mt.i] = float32(float64(lr) / math.Sqrt(float64(mt.cols)))
	}
	c1 := optim.BiasCorrection(cfg.AdamBeta1, t)
	for k, st := range c.bkt.states[:nb] {
		if err := st.allReduce(ctx, o.f.Comm(), nil); err != nil {
			return fmt.Errorf("the exchange: bucket %d of %d: %w", k, len(c.bkt.states), samePackage{err})
		}
		for lo, a := range st.outputs() {
			for sp := range c.spans(k, lo, lo+len(a)) {
				i := sp.sg.param
				p, u := sp.of(o.params[i].Data()), sp.at(a, lo)
				if o.v[i] == nil {
					descend(p, u, decay, o.step[i])
					continue
				}
				m := sp.of(o.slot[i])
				copy(m, u)
				unscaleBy(m, o.unit[i])
				optim.AdamUpdateBounded(p, m, sp.of(o.v[i]), alr, cfg.AdamWeightDecay, c1, o.c2, cfg.AdamEps, o.bound)
			}
		}
	}
	return nil
}

// saveMode records the state mode of cfg in ck: nothing for StateFull,
// else StateCompact with its bfloat16 worker errors and, with
// MomentumBF16, optim.IntMomentsBF16.
func saveMuonMode(ck *optim.Checkpoint, cfg MuonConfig) {
	if cfg.StateMode != StateCompact {
		return
	}
	ck.Ints[IntStateMode] = int64(StateCompact)
	ck.Ints[IntBF16] = int64(BF16WorkerError)
	if cfg.MomentumBF16 {
		ck.Ints[optim.IntMomentsBF16] = 1
	}
}

// checkMuonMode refuses a checkpoint made in another state mode than
// cfg's, naming both.
func checkMuonMode(ck *optim.Checkpoint, cfg MuonConfig) error {
	name := func(mode StateMode, bf16 bool) string {
		if mode == StateCompact && bf16 {
			return "StateCompact with MomentumBF16"
		}
		return mode.String()
	}
	want := &optim.Checkpoint{Ints: map[string]int64{}}
	saveMuonMode(want, cfg)
	for _, key := range []string{IntStateMode, IntBF16, optim.IntMomentsBF16} {
		if ck.Ints[key] != want.Ints[key] {
			return fmt.Errorf("%w: made with StateMode %s, this optimizer has %s (the state is kept and rounded differently: use the same StateMode and MomentumBF16)",
				optim.ErrIncompatibleCheckpoint, name(modeOf(ck), ck.Ints[optim.IntMomentsBF16] == 1), name(cfg.StateMode, cfg.MomentumBF16))
		}
	}
	return nil
}
