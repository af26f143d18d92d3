package onebit

// 0/1 Adam, following the spec page onebit.md, section "0/1 Adam".

import (
	"context"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// ZeroOneAdamConfig holds the hyper-parameters of 0/1 Adam. Start from
// DefaultZeroOneAdamConfig and change what you need: the zero value is not
// the defaults.
type ZeroOneAdamConfig struct {
	// AdamConfig holds the learning rate, betas, eps, decoupled weight
	// decay and bias correction; see optim.DefaultAdamConfig for their
	// defaults.
	//
	// With BiasCorrection off the update is exactly the spec's (and the
	// reference's) m/(sqrt(v)+eps). With it on, m is corrected for the
	// current step and v for the number of variance updates it has had
	// (frozen with v in phase B); the accumulated learning rate lrs then
	// sums the corrected step sizes lr/(1-beta1^t), so that m = -u/lrs
	// stays an average of uncorrected momenta.
	optim.AdamConfig
	// VarFreezeStep is the last step of phase A, after which the variance
	// is frozen and local steps begin; at least 1. Default 100000. In
	// every step, local steps and synchronizations included, the ratio
	// m_hat/(sqrt(v_hat)+eps) of an element whose v is tiny, or zero (no
	// gradient at the variance updates so far) and then given gradient, is
	// bounded, so that it trains at about exact Adam's rate instead of
	// stepping by lr*m/eps; one whose gradient is always zero does not
	// move: see the package doc.
	VarFreezeStep int
	// VarUpdateScaler (kappa) is the number of variance updates after
	// which the interval between them doubles; at least 1. Default 16.
	VarUpdateScaler int
	// LocalStepScaler is the number of phase-B steps after which the
	// interval between synchronizations doubles (up to LocalStepClipper);
	// at least 1. Default 32678 (sic, as in the reference).
	LocalStepScaler int
	// LocalStepClipper (H) caps the interval between synchronizations in
	// phase B; at least 1. Default 16.
	LocalStepClipper int
	// ExpAvgMask optionally maps a parameter name to a mask of that
	// parameter's size, multiplied into what comes out of every
	// compressed allreduce (the gradient in phase A, the momentum
	// accumulator in phase B), also with one rank, where the allreduce is
	// skipped; finite. Default none.
	ExpAvgMask map[string][]float32
	// BucketBytes is the size of the fused buckets of the compressed
	// allreduce, in the convention of optim.DefaultBucketBytes: what it
	// compresses (the gradients in phase A, the accumulators in phase B)
	// is copied into one flat buffer, cut into buckets of BucketBytes,
	// each one compressed allreduce with its own error feedback. 0 means
	// optim.DefaultBucketBytes (25 MiB); optim.PerParameter compresses
	// each parameter on its own. DefaultZeroOneAdamConfig chooses
	// optim.PerParameter: one scale for
	// the accumulators of all parameters cost 0/1 Adam 1.3 points of
	// accuracy in the convergence test (onebit/convergence_test.go), where
	// per-parameter scales (or buckets of a few parameters) match exact
	// Adam; fuse when the collectives' latency dominates.
	BucketBytes int
}

// DefaultZeroOneAdamConfig returns optim.DefaultAdamConfig (lr 1e-3, betas
// (0.9, 0.999), eps 1e-8, no weight decay, bias correction on) with
// VarFreezeStep 100000, VarUpdateScaler 16, LocalStepScaler 32678 and
// LocalStepClipper 16, each parameter compressed on its own
// (BucketBytes optim.PerParameter).
func DefaultZeroOneAdamConfig() ZeroOneAdamConfig {
	return ZeroOneAdamConfig{
		AdamConfig:       optim.DefaultAdamConfig(),
		VarFreezeStep:    100000,
		VarUpdateScaler:  16,
		LocalStepScaler:  32678,
		LocalStepClipper: 16,
		BucketBytes:      optim.PerParameter,
	}
}

// ZeroOneAdam is 0/1 Adam. In phase A (steps 1..VarFreezeStep) the
// variance is updated, from an exactly averaged gradient, only on steps
// that are multiples of an interval that doubles after every
// VarUpdateScaler such updates; on the other steps the gradient goes
// through the 1-bit compressed allreduce and only the momentum is updated.
// In phase B the variance is frozen and every rank takes local steps,
// accumulating them in u; only on steps that are multiples of a second
// interval (doubling every LocalStepScaler steps, up to LocalStepClipper)
// does u go through the compressed allreduce, which resynchronizes the
// parameters and the momentum. Between those steps the ranks' parameters
// differ (that is the point of local steps); after each of them they are
// identical again, bit for bit. A synchronization due after steps at
// learning rate 0 only has nothing to average (no parameter has moved,
// and u, which weights the momenta by the step sizes, is zero): it is
// taken as a local step, and the ranks' momenta stay their own until the
// next synchronization with lr > 0.
//
// The accumulator u is kept as the parameters at the last
// synchronization (the anchor): at a synchronization u = p - anchor, which
// is the spec's u in exact arithmetic and, unlike a separately
// accumulated u (the reference's), leaves no rounding difference between
// the ranks' parameters afterwards: p = anchor + u_avg/(sqrt(v)+eps) is
// computed from the same values on every rank. It costs the same memory.
//
// What the compressed allreduce carries is fused into buckets of
// BucketBytes (by default one per parameter), each with its own
// error-feedback state; both error buffers of every bucket are zeroed once
// when phase B begins. With one rank (or a nil communicator) the
// compressed allreduce is skipped. Stats.BytesSent counts what this
// rank sent in Step, the finite-gradient flag included.
type ZeroOneAdam struct {
	f      *optim.Frame
	cfg    ZeroOneAdamConfig
	params []*optim.Param
	masks  [][]float32

	m, v   [][]float32 // per parameter: momentum, variance
	anchor [][]float32 // per parameter: its value at the last synchronization
	flat   []float32   // what the compressed allreduce carries, fused
	fused  [][]float32 // per parameter: its part of flat
	bkt    *buckets    // the buckets of flat (none when world == 1)

	varUpdates    int64   // variance updates so far (for its bias correction)
	varInterval   int64   // phase A: variance update when step % varInterval == 0
	varCounter    int64   // variance updates since varInterval last doubled
	localInterval int64   // phase B: synchronize when step % localInterval == 0
	localCounter  int64   // phase-B steps since localInterval last doubled
	lrs           float64 // learning rates summed since the last synchronization
	avg           *optim.GradAverager
	// late: the elements whose v is zero, which take no step (late.go);
	// their momentum is kept at zero on every synchronization.
	late unseen
}

var (
	_ optim.Optimizer   = (*ZeroOneAdam)(nil)
	_ optim.LRSetter    = (*ZeroOneAdam)(nil)
	_ optim.FlagCarrier = (*ZeroOneAdam)(nil)
)

// Checkpoint names of 0/1 Adam's state beyond optim's common ones and
// WorkerErrorPrefix and ServerErrorPrefix (this rank's error buffers of
// every parameter, as in 1-bit Adam).
const (
	// AnchorPrefix, followed by the parameter name, names the value of
	// the parameter at the last synchronization (the accumulator u is the
	// parameter minus it).
	AnchorPrefix = "sync_anchor/"
	// FloatLRS is lrs, the step sizes summed since the last
	// synchronization.
	FloatLRS = "lrs"
	// The counters of the schedule; IntVarUpdates is the number of
	// variance updates so far.
	IntVarUpdates    = "var_updates"
	IntVarInterval   = "var_interval"
	IntVarCounter    = "var_counter"
	IntLocalInterval = "local_interval"
	IntLocalCounter  = "local_counter"
)

// NewZeroOneAdam returns 0/1 Adam over params on the ranks of c (nil means
// one rank). Every rank must construct it together, with the same
// parameter shapes, in the same order, and the same config; it does not
// communicate (ctx: see optim's package doc). An invalid cfg is refused
// with cfg.Validate's error. All buffers are allocated here,
// once.
func NewZeroOneAdam(ctx context.Context, c comm.Comm, params []*optim.Param, cfg ZeroOneAdamConfig, opts ...optim.Option) (*ZeroOneAdam, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := optim.CheckParams(params); err != nil {
		return nil, fmt.Errorf("onebit: 0/1 Adam: %w", err)
	}
	masks, err := compileMasks(params, cfg.ExpAvgMask)
	if err != nil {
		return nil, fmt.Errorf("onebit: 0/1 Adam: %w", err)
	}
	o := &ZeroOneAdam{
		cfg:           cfg,
		params:        append([]*optim.Param(nil), params...),
		masks:         masks,
		m:             make([][]float32, len(params)),
		v:             make([][]float32, len(params)),
		anchor:        make([][]float32, len(params)),
		varInterval:   1,
		localInterval: 1,
	}
	if o.avg, err = optim.NewGradAverager(c, o.params, cfg.Reduce, cfg.RanksPerNode); err != nil {
		return nil, fmt.Errorf("onebit: 0/1 Adam: %w", err)
	}
	o.f = optim.NewFrame(optim.FrameConfig{
		Name: "onebit: 0/1 Adam", Algorithm: optim.AlgorithmZeroOneAdam, Comm: c,
		Params: o.params, Sizes: o.m, LR: cfg.LR, Stage: optim.StagePhaseA,
		Logger: optim.ApplyOptions(opts).Logger, Averager: o.avg, Hypers: cfg.hypers(masks),
	})
	sizes := make([]int, len(params))
	for i, p := range params {
		n := p.Numel()
		sizes[i] = n
		o.m[i] = make([]float32, n)
		o.v[i] = make([]float32, n)
		o.anchor[i] = make([]float32, n)
	}
	if world := o.f.World(); world > 1 {
		o.flat, o.fused = flatten[float32](sizes)
	}
	// On one rank: no buckets, but their size in the checkpoints (Regroup).
	if o.bkt, err = newBuckets(o.params, o.f.World(), cfg.BucketBytes, false); err != nil {
		return nil, fmt.Errorf("onebit: 0/1 Adam: %w", err)
	}
	o.f.Handle(optim.StagePhaseA, o.phaseA)
	o.f.Handle(optim.StagePhaseB, o.phaseB)
	o.late.stale = true
	return o, nil
}

// lateReady says whether some element has v zero (see unseen.ready).
func (o *ZeroOneAdam) lateReady() bool { return o.late.ready(o.f.World(), o.v...) }

// exchangeLate writes, when some element's v is zero, whether this rank
// gave it gradient (since the last synchronization when moved: its
// momentum too), and or-s every rank's (see unseen); markLate, at the end
// of the step, marks the v of those some rank gave gradient.
func (o *ZeroOneAdam) exchangeLate(ctx context.Context, moved bool) error {
	o.late.start()
	off := 0
	for i, p := range o.params {
		g := p.GradData()[:len(o.v[i])]
		if moved {
			o.late.packMoved(off, o.m[i], g)
		} else {
			o.late.pack(off, g)
		}
		off += len(g)
	}
	return o.late.exchange(ctx, o.f.Comm())
}

// markLate: see exchangeLate.
func (o *ZeroOneAdam) markLate() {
	off := 0
	for _, v := range o.v {
		o.late.mark(off, v)
		off += len(v)
	}
	o.late.done()
}

// Params returns the parameters, in the order given to NewZeroOneAdam.
func (o *ZeroOneAdam) Params() []*optim.Param { return o.params }

// Stats reports the steps taken, the skipped ones, the phase of the next
// step and the bytes this rank sent.
func (o *ZeroOneAdam) Stats() optim.Stats { return o.f.Stats() }

// SetLR fixes the learning rate of the following steps, replacing any
// schedule; see optim.LRSetter. lrs sums the step sizes actually applied,
// so the momentum recovered at the next synchronization stays an average.
func (o *ZeroOneAdam) SetLR(lr float32) error { return o.f.SetLR(lr) }

// CarryFlags makes every following Step carry sf in its per-step
// agreement; see optim.FlagCarrier.
func (o *ZeroOneAdam) CarryFlags(sf *optim.StepFlags) error { return o.f.CarryFlags(sf) }

// SetSchedule makes s choose the learning rate of every following step
// (nil: back to the fixed one); see optim.LRSetter.
func (o *ZeroOneAdam) SetSchedule(s optim.Schedule) error { return o.f.SetSchedule(s) }

// LR returns the learning rate of the next step.
func (o *ZeroOneAdam) LR() float32 { return o.f.LR() }

// Intervals reports the current intervals and counters of the schedule:
// the variance-update interval and the number of variance updates since it
// last doubled (phase A), and the synchronization interval and the number
// of phase-B steps since it last doubled.
func (o *ZeroOneAdam) Intervals() (varInterval, varCounter, localInterval, localCounter int64) {
	return o.varInterval, o.varCounter, o.localInterval, o.localCounter
}

// Step applies one update from the gradients in the parameters. Every rank
// calls it together. A step in which some rank's gradient is not finite is
// skipped on every rank and changes nothing but the counters. Step may
// overwrite the gradients (with their exact or compressed average). An
// error from the communicator leaves the optimizer in an undefined state.
func (o *ZeroOneAdam) Step(ctx context.Context) error {
	return o.f.Step(ctx)
}

// Stage is the phase the next step runs in: optim.StagePhaseA or
// optim.StagePhaseB.
func (o *ZeroOneAdam) Stage() optim.Stage { return o.f.Stage() }

// corrections returns the bias-correction multipliers of m at step t and
// of v after its variance updates (1 and 1 without bias correction).
func (o *ZeroOneAdam) corrections(t int64) (c1, c2 float32) {
	if !o.cfg.BiasCorrection {
		return 1, 1
	}
	return optim.BiasCorrection(o.cfg.Beta1, t), optim.BiasCorrection(o.cfg.Beta2, o.varUpdates)
}

// phaseA is a step of phase A. An element whose v is zero takes no step;
// on the steps that compress the gradient its momentum stays as it is
// (the compressed gradient is ±scale everywhere) and its v is marked at
// the end of the step if some rank gave it gradient (see unseen); a
// variance step gives it the variance of its averaged gradient.
func (o *ZeroOneAdam) phaseA(ctx context.Context, t int64, lr float32) error {
	cfg := &o.cfg
	varStep := t%o.varInterval == 0
	if varStep {
		if err := o.avg.Average(ctx); err != nil {
			return err
		}
		o.varUpdates++
	}
	c1, c2 := o.corrections(t)
	bound := ratioBound(cfg.Beta1, cfg.Beta2)
	late := !varStep && o.lateReady()
	if late {
		if err := o.exchangeLate(ctx, false); err != nil {
			return err
		}
	}
	if !varStep {
		if err := o.allReduceGrads(ctx); err != nil {
			return err
		}
	}
	off := 0 // parameter i's first element in the order of o.late
	for i, p := range o.params {
		g := p.GradData()
		lo := off
		off += len(g)
		if len(g) == 0 {
			continue
		}
		if varStep {
			optim.AdamMoments(o.m[i], o.v[i], g, cfg.Beta1, cfg.Beta2)
		} else {
			if o.masks[i] != nil {
				optim.Mul(g, o.masks[i])
			}
			if late {
				o.late.erase(lo, g)
			}
			optim.Momentum(o.m[i], g, cfg.Beta1)
		}
		optim.AdamUpdateBounded(p.Data(), o.m[i], o.v[i], lr, cfg.WeightDecay, c1, c2, cfg.Eps, bound)
	}
	if late {
		o.markLate()
	}
	if varStep {
		o.late.stale = true
		o.varCounter++
		if o.varCounter == int64(cfg.VarUpdateScaler) {
			o.varCounter = 0
			o.varInterval *= 2
		}
	}
	if t >= int64(cfg.VarFreezeStep) {
		// The error buffers held gradient errors; phase B compresses the
		// accumulated momentum, so they start again from zero.
		o.bkt.reset()
		for i, p := range o.params {
			copy(o.anchor[i], p.Data())
		}
		o.f.Enter(optim.StagePhaseB)
	}
	return nil
}

// phaseB is a step of phase B. An element whose v is zero takes no step
// (its weight decay aside), in the local steps as at the
// synchronizations, which set its momentum to zero; a synchronization
// marks its v if some rank gave it gradient since the last one (see
// unseen).
func (o *ZeroOneAdam) phaseB(ctx context.Context, t int64, lr float32) error {
	cfg := &o.cfg
	c1, c2 := o.corrections(t)
	// The step size applied to m/(sqrt(v)+eps) this step: lr, or
	// lr/(1-beta1^t) with bias correction (the same float32 product as in
	// zeroOneLocalStep).
	o.lrs += float64(float32(lr * c1))
	lrs := float32(o.lrs)
	// A synchronization after steps at learning rate 0 only (lrs 0) has
	// nothing to average: no parameter has moved from the anchor, and u,
	// the momentum weighted by the step sizes, is zero. It is taken as a
	// local step, and the momenta stay the ranks' own until the next one;
	// the elements whose v is zero are marked as at any synchronization.
	due := t%o.localInterval == 0
	sync := due && lrs != 0
	bound := ratioBound(cfg.Beta1, cfg.Beta2)
	late := due && o.lateReady()
	if late {
		if err := o.exchangeLate(ctx, true); err != nil {
			return err
		}
	}
	for i, p := range o.params {
		g := p.GradData()
		if len(g) == 0 {
			continue
		}
		m, v := o.m[i], o.v[i]
		if !sync {
			zeroOneLocalStep(p.Data(), m, v, g, nil, cfg.Beta1, lr, cfg.WeightDecay, c1, c2, cfg.Eps, bound)
			continue
		}
		// The local step, then u = p - anchor (in the gradient's buffer,
		// used up); p -= u, which is p = anchor; u *= sqrt(v)+eps.
		zeroOneLocalStep(p.Data(), m, v, g, o.anchor[i], cfg.Beta1, lr, cfg.WeightDecay, c1, c2, cfg.Eps, bound)
	}
	if sync {
		// The accumulators u, in the gradients' buffers, go through the
		// compressed allreduce together.
		if err := o.allReduceGrads(ctx); err != nil {
			return err
		}
		for i, p := range o.params {
			u := p.GradData()
			if len(u) == 0 {
				continue
			}
			if o.masks[i] != nil {
				optim.Mul(u, o.masks[i])
			}
			// m = -u/lrs; p = anchor + u/(sqrt(v)+eps), the new anchor,
			// moved by at most lrs times its ratio bound.
			zeroOneArrive(p.Data(), o.m[i], o.anchor[i], u, o.v[i], lrs, bound)
		}
	}
	if late {
		o.markLate()
	}
	if sync {
		o.lrs = 0
	}
	o.localCounter++
	if o.localCounter == int64(cfg.LocalStepScaler) {
		o.localCounter = 0
		o.localInterval = min(int64(cfg.LocalStepClipper), 2*o.localInterval)
	}
	return nil
}

// allReduceGrads replaces every parameter's gradient buffer with its
// compressed average over the ranks: the buffers are copied into the flat
// buffer, each bucket goes through AllReduce, and the results are copied
// back. With one rank it does nothing.
func (o *ZeroOneAdam) allReduceGrads(ctx context.Context) error {
	if len(o.bkt.states) == 0 {
		return nil
	}
	for i, p := range o.params {
		copy(o.fused[i], p.GradData())
	}
	if err := o.bkt.allReduce(ctx, o.f.Comm(), o.flat); err != nil {
		return err
	}
	for i, p := range o.params {
		copy(p.GradData(), o.fused[i])
	}
	return nil
}

// zeroOneLocalStep is the local step of phase B for one parameter (u,
// the accumulated -lr*upd, is implicit in p - anchor):
//
//	m    = b1*m + (1-b1)*g
//	upd  = m*c1/(sqrt(v*c2)+eps) + wd*p
//	p   -= lr*upd
//
// With an anchor (a synchronization step) it then overwrites g with
// u*(sqrt(v*c2)+eps), u = p - anchor: the momentum accumulated since the
// last synchronization, weighted by the step sizes; and m, which
// zeroOneArrive replaces, with the denominator sqrt(v*c2)+eps, for
// zeroOneArrive to use.
func zeroOneLocalStep(p, m, v, g, anchor []float32, b1, lr, wd, c1, c2, eps float32, b optim.RatioBound) {
	a1 := optim.OneMinus(b1)
	m, v, g = m[:len(p)], v[:len(p)], g[:len(p)]
	if anchor == nil {
		for i := range p {
			mi := float32(b1*m[i]) + float32(a1*g[i])
			m[i] = mi
			d := float32(math.Sqrt(float64(float32(v[i]*c2)))) + eps
			upd := b.Of(float32(mi*c1)/d, v[i]) + float32(wd*p[i])
			p[i] -= float32(lr * upd)
		}
		return
	}
	anchor = anchor[:len(p)]
	for i := range p {
		mi := float32(b1*m[i]) + float32(a1*g[i])
		m[i] = mi
		d := float32(math.Sqrt(float64(float32(v[i]*c2)))) + eps
		upd := b.Of(float32(mi*c1)/d, v[i]) + float32(wd*p[i])
		pi := p[i] - float32(lr*upd)
		p[i] = pi
		g[i] = (pi - anchor[i]) * d
		m[i] = d
	}
}

// zeroOneArrive sets, with m holding the denominators sqrt(v*c2)+eps on
// entry (see zeroOneLocalStep), p = anchor + lrs*b.Clip(u/(d*lrs)) with
// d = sqrt(v*c2)+eps, and m = -u/lrs, and makes p the new anchor: the
// synchronization moves p from the anchor as far as steps of ratio u/(d*lrs)
// would, bounded as every step's ratio is. Where that ratio is within
// b.Cap, p = anchor + u/d exactly as without the bound. Where v is zero,
// p stays where the local steps left it (its weight decay only: the same
// on every rank), m is zero, and p is the new anchor.
func zeroOneArrive(p, m, anchor, u, v []float32, lrs float32, b optim.RatioBound) {
	m, anchor, u, v = m[:len(p)], anchor[:len(p)], u[:len(p)], v[:len(p)]
	for i := range p {
		if v[i] == 0 {
			m[i], anchor[i] = 0, p[i]
			continue
		}
		ui := u[i]
		du := ui / m[i]
		if r := du / lrs; r > b.Cap || r < -b.Cap {
			du = lrs * b.Clip(r)
		}
		pi := anchor[i] + du
		m[i] = -ui / lrs
		p[i] = pi
		anchor[i] = pi
	}
}

// State returns a checkpoint of this rank's optimizer: the parameters, m,
// v, the anchor (and with it u), the counters, the phase, the intervals,
// lrs, and, on more than one rank, the bucket layout and this rank's
// worker and server errors of every bucket.
func (o *ZeroOneAdam) State() (*optim.Checkpoint, error) {
	ck := o.f.Checkpoint()
	ck.Ints[IntVarUpdates] = o.varUpdates
	ck.Ints[IntVarInterval] = o.varInterval
	ck.Ints[IntVarCounter] = o.varCounter
	ck.Ints[IntLocalInterval] = o.localInterval
	ck.Ints[IntLocalCounter] = o.localCounter
	ck.Floats[FloatLRS] = o.lrs
	for i, p := range o.params {
		shape := p.Shape()
		ck.AddTensor(optim.ParamTensorName(p.Name), shape, p.Data())
		ck.AddTensor(optim.ExpAvgPrefix+p.Name, shape, o.m[i])
		ck.AddTensor(optim.ExpAvgSqPrefix+p.Name, shape, o.v[i])
		ck.AddTensor(AnchorPrefix+p.Name, shape, o.anchor[i])
	}
	o.bkt.save(ck, nil, nil)
	return ck, nil
}

// Load restores a checkpoint made by State on the same rank of a group of
// the same size, over parameters of the same names and shapes. It refuses
// anything else with an error wrapping optim.ErrIncompatibleCheckpoint and
// then leaves the optimizer unchanged.
//
// A checkpoint whose error buffers were reset on request
// (optim.Checkpoint.ResetErrors) loads on any group size and rank: the
// error buffers start at zero, and Load logs a warning that says so. In
// phase B, between two synchronizations, this rank then continues from the
// parameters and momentum of the rank that made the checkpoint (the
// anchor, the last synchronization point, is the same on every rank), and
// the next synchronization averages the new ranks' progress since it.
func (o *ZeroOneAdam) Load(ck *optim.Checkpoint) error {
	if err := o.load(ck); err != nil {
		return fmt.Errorf("onebit: 0/1 Adam: %w", err)
	}
	return nil
}

func (o *ZeroOneAdam) load(ck *optim.Checkpoint) error {
	fs, err := o.f.CheckLoad(ck, optim.StagePhaseA, optim.StagePhaseB)
	if err != nil {
		return err
	}
	if err := checkRank(ck, o.f.Rank()); err != nil {
		return err
	}
	ints, err := checkpointInts(ck, IntVarUpdates, IntVarInterval, IntVarCounter, IntLocalInterval, IntLocalCounter)
	if err != nil {
		return err
	}
	for _, v := range ints {
		if v < 0 {
			return fmt.Errorf("%w: negative schedule counter %d", optim.ErrIncompatibleCheckpoint, v)
		}
	}
	if ints[1] < 1 || ints[3] < 1 {
		return fmt.Errorf("%w: intervals %d and %d must be at least 1", optim.ErrIncompatibleCheckpoint, ints[1], ints[3])
	}
	if err := o.bkt.check(ck); err != nil {
		return err
	}
	lrs, err := ck.Float(FloatLRS)
	if err != nil {
		return err
	}
	if math.IsNaN(lrs) || math.IsInf(lrs, 0) {
		return fmt.Errorf("%w: lrs is %v", optim.ErrIncompatibleCheckpoint, lrs)
	}
	// Gather and check everything before changing anything.
	rs := ck.Restore()
	for i, p := range o.params {
		rs.Tensor(optim.ParamTensorName(p.Name), p.Data())
		rs.Tensor(optim.ExpAvgPrefix+p.Name, o.m[i])
		rs.Tensor(optim.ExpAvgSqPrefix+p.Name, o.v[i])
		rs.Tensor(AnchorPrefix+p.Name, o.anchor[i])
	}
	o.bkt.restore(ck, rs)
	if err := rs.Apply(); err != nil {
		return err
	}
	if ck.ErrorsReset {
		o.bkt.reset()
		warnErrorsReset(o.f.Logger(), ck, o.f.World(), o.f.Rank())
	}
	o.varUpdates, o.varInterval, o.varCounter = ints[0], ints[1], ints[2]
	o.localInterval, o.localCounter = ints[3], ints[4]
	o.lrs = lrs
	o.f.Restore(fs)
	o.late.stale = true
	return nil
}

// Close releases the communicators that ReduceTwoLevel averaging split off
// the group (none in the other modes); see optim.Optimizer.Close: not a
// collective, idempotent, every rank calls it, Step fails after it.
func (o *ZeroOneAdam) Close() error {
	o.f.Close()
	return o.avg.Close()
}
