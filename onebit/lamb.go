package onebit

// 1-bit LAMB, following the spec page onebit.md, section "1-bit LAMB".

import (
	"context"
	"fmt"
	"math"

	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// LambConfig holds the hyper-parameters of 1-bit LAMB. Start from
// DefaultLambConfig and change what you need: the zero value is not the
// defaults.
type LambConfig struct {
	// LambConfig holds the learning rate, betas, eps, decoupled weight
	// decay, bias correction and the trust-ratio bounds MaxCoeff and
	// MinCoeff; see optim.DefaultLambConfig for their defaults.
	//
	// With BiasCorrection off the update is exactly the spec's
	// m/(sqrt(v)+eps) (as in the reference, which has no bias
	// correction). With it on, the warm-up stage matches optim.Lamb; in
	// the compression stage m is corrected for the current step, the
	// frozen v for the step it was frozen at, and v_fresh for the current
	// step.
	optim.LambConfig
	// FreezeStep is the number of warm-up steps (plain LAMB with exactly
	// averaged gradients) before the compression stage; at least 1, since
	// the compression stage scales every update by the trust ratios
	// averaged over the warm-up. Default 100000. An element whose frozen
	// v is tiny, or zero and then given gradient (first given gradient
	// after the warm-up), has its update's ratio bounded, so that it
	// trains at about exact Adam's rate instead of stepping by
	// lr*scale/eps; one whose gradient is always zero does not move: see
	// the package doc.
	FreezeStep int
	// CoeffBeta is the decay of the running average of the warm-up trust
	// ratios (coeff_freeze) that scales every compression-stage update;
	// in [0, 1). Default 0.9.
	CoeffBeta float32
	// FactorMax and FactorMin bound the compression-stage factor that
	// stands in for the trust ratio's change, 0 < FactorMin <= FactorMax
	// < +Inf.
	// Defaults 4 and 0.5.
	FactorMax, FactorMin float32
	// FactorThreshold bounds the relative change of the factor from one
	// step to the next, in [0, 1). Default 0.1.
	FactorThreshold float32
	// ExpAvgMask optionally maps a parameter name to a mask of that
	// parameter's size, multiplied into its momentum after every
	// compressed allreduce (for momenta that must stay exactly zero,
	// which 1-bit compression cannot represent); finite. Default none.
	ExpAvgMask map[string][]float32
	// StateMode chooses how the optimizer state is kept: StateFull (the
	// zero value, the default) or StateCompact, the same steps bit for
	// bit with m and the m_last of the compression stage held as the
	// packed signs and scales the compressed allreduce gathers, and no
	// scratch buffer (see lamb_compact.go). Checkpoints record it; either
	// mode loads the other's. 1-bit LAMB has no StateSharded. On one rank
	// StateCompact runs as StateFull.
	StateMode StateMode
	// 1-bit LAMB has no BucketBytes: the momenta of the whole model go
	// through one compressed allreduce of the fused buffer, as the spec
	// says; see optim.DefaultBucketBytes for why.
}

// DefaultLambConfig returns optim.DefaultLambConfig (lr 1e-3, betas (0.9,
// 0.999), eps 1e-8, no weight decay, bias correction on, coefficients
// clipped to [0.01, 10]) with FreezeStep 100000, CoeffBeta 0.9, FactorMax
// 4, FactorMin 0.5 and FactorThreshold 0.1.
func DefaultLambConfig() LambConfig {
	return LambConfig{
		LambConfig:      optim.DefaultLambConfig(),
		FreezeStep:      100000,
		CoeffBeta:       0.9,
		FactorMax:       4,
		FactorMin:       0.5,
		FactorThreshold: 0.1,
	}
}

// Lamb is 1-bit LAMB: plain LAMB with exactly averaged gradients for
// FreezeStep warm-up steps, then a compression stage in which every rank
// updates its momentum from its local gradient and the momenta of the
// whole model, concatenated in one flat buffer, go through one
// error-compensated 1-bit allreduce per step. The second moment is frozen
// then; a fresh copy of it, fed by gradients reconstructed from the
// momentum, and the trust ratios averaged over the warm-up (coeff_freeze)
// steer a per-parameter factor that replaces the trust ratio.
//
// Parameters with zero elements take no part and never produce NaN. With
// one rank (or a nil communicator) the compressed allreduce is skipped.
// Stats.BytesSent counts what this rank sent in Step, the finite-gradient
// flag included.
type Lamb struct {
	f      *optim.Frame
	cfg    LambConfig
	params []*optim.Param
	masks  [][]float32 // per parameter; nil where none

	// offs[i] is parameter i's offset in the flat buffers; offs[len(params)]
	// is their length.
	offs []int
	// m, v and vFresh are the moments of every parameter, one after the
	// other. m is the fused buffer that the compressed allreduce reduces.
	// In StateCompact m is nil, and vFresh holds m until the first
	// compression step (see lambCompact).
	m, v, vFresh []float32
	// scratch holds m_last during a compression step, and the update of
	// each parameter once its m_last is used up (nil in StateCompact).
	scratch []float32
	ef      *State // error feedback of the fused buffer; nil when world == 1
	mode    StateMode
	cp      *lambCompact // StateCompact on more than one rank; nil otherwise

	frozenAt    int64     // the step at which v was frozen
	coeffFreeze []float64 // per parameter
	lastFactor  []float64 // per parameter, starts at 1
	scaling     []float32 // per parameter, set on the first compression step
	scaled      bool      // whether scaling has been set
	norms       []float64 // scratch for the scaling

	mViews [][]float32 // m per parameter, for the frame's size check
	avg    *optim.GradAverager
	late   unseen // the elements whose frozen v is zero
}

var (
	_ optim.Optimizer   = (*Lamb)(nil)
	_ optim.LRSetter    = (*Lamb)(nil)
	_ optim.FlagCarrier = (*Lamb)(nil)
)

// Checkpoint names of 1-bit LAMB's state beyond optim's common ones. The
// per-parameter entries are followed by the parameter name.
const (
	// ExpAvgSqFreshPrefix names v_fresh.
	ExpAvgSqFreshPrefix = "exp_avg_sq_fresh/"
	// FloatCoeffFreezePrefix, FloatLastFactorPrefix and FloatScalingPrefix
	// name coeff_freeze, last_factor and scaling.
	FloatCoeffFreezePrefix = "coeff_freeze/"
	FloatLastFactorPrefix  = "last_factor/"
	FloatScalingPrefix     = "scaling/"
	// FusedWorkerError and FusedServerError name this rank's error buffers
	// of the fused momentum buffer: PaddedLen(total, W) and
	// PaddedLen(total, W)/W floats. They follow optim's naming rule for
	// error buffers (see optim.IsErrorBuffer), which
	// optim.Checkpoint.ResetErrors drops.
	FusedWorkerError = optim.WorkerErrorName
	FusedServerError = optim.ServerErrorName
	// IntFrozenAt is the step at which v was frozen (0 in warm-up);
	// IntScaled is 1 once the scaling has been computed.
	IntFrozenAt = "frozen_at"
	IntScaled   = "scaled"
)

// NewLamb returns 1-bit LAMB over params on the ranks of c (nil means one
// rank). Every rank must construct it together, with the same parameter
// shapes, in the same order, and the same config; it does not communicate
// (ctx: see optim's package doc). An invalid cfg is refused with
// cfg.Validate's error. The moments, the fused momentum
// buffer and the error buffers are allocated here, once.
func NewLamb(ctx context.Context, c comm.Comm, params []*optim.Param, cfg LambConfig, opts ...optim.Option) (*Lamb, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := optim.CheckParams(params); err != nil {
		return nil, fmt.Errorf("onebit: 1-bit LAMB: %w", err)
	}
	masks, err := compileMasks(params, cfg.ExpAvgMask)
	if err != nil {
		return nil, fmt.Errorf("onebit: 1-bit LAMB: %w", err)
	}
	o := &Lamb{
		cfg:         cfg,
		params:      append([]*optim.Param(nil), params...),
		masks:       masks,
		offs:        make([]int, len(params)+1),
		coeffFreeze: make([]float64, len(params)),
		lastFactor:  make([]float64, len(params)),
		scaling:     make([]float32, len(params)),
		norms:       make([]float64, len(params)),
	}
	for i, p := range params {
		o.offs[i+1] = o.offs[i] + p.Numel()
		o.lastFactor[i] = 1
		o.scaling[i] = 1
	}
	total := o.offs[len(params)]
	world := 1
	if c != nil {
		world = c.Size()
	}
	o.mode = cfg.StateMode
	compact := o.mode == StateCompact && world > 1 && total > 0
	o.v = make([]float32, total)
	o.vFresh = make([]float32, total)
	sizes := o.v // the frame's size check: a buffer per parameter
	if !compact {
		o.m = make([]float32, total)
		o.scratch = make([]float32, total)
		sizes = o.m
	}
	o.mViews = make([][]float32, len(params))
	for i := range params {
		o.mViews[i] = sizes[o.offs[i]:o.offs[i+1]]
	}
	if o.avg, err = optim.NewGradAverager(c, o.params, cfg.Reduce, cfg.RanksPerNode); err != nil {
		return nil, fmt.Errorf("onebit: 1-bit LAMB: %w", err)
	}
	o.f = optim.NewFrame(optim.FrameConfig{
		Name: "onebit: 1-bit LAMB", Algorithm: optim.AlgorithmOnebitLamb, Comm: c,
		Params: o.params, Sizes: o.mViews, LR: cfg.LR, Stage: optim.StageWarmup,
		Logger: optim.ApplyOptions(opts).Logger, Averager: o.avg, Hypers: cfg.hypers(masks),
	})
	if w := o.f.World(); w > 1 {
		if o.ef, err = NewState(total, w); err != nil {
			return nil, fmt.Errorf("onebit: 1-bit LAMB: %w", samePackage{err})
		}
		if compact {
			if o.cp, err = newLambCompact(o.ef, o.offs); err != nil {
				return nil, fmt.Errorf("onebit: 1-bit LAMB: %w", samePackage{err})
			}
		}
	}
	o.f.Handle(optim.StageWarmup, o.warmup)
	o.f.Handle(optim.StageCompression, o.compressed)
	return o, nil
}

// Params returns the parameters, in the order given to NewLamb.
func (o *Lamb) Params() []*optim.Param { return o.params }

// Stats reports the steps taken, the skipped ones, the stage of the next
// step and the bytes this rank sent.
func (o *Lamb) Stats() optim.Stats { return o.f.Stats() }

// Step applies one update from the gradients in the parameters. Every rank
// calls it together. A step in which some rank's gradient is not finite
// is skipped on every rank and changes nothing but the counters. In the
// warm-up stage Step overwrites the gradients with their average over the
// ranks. An error from the communicator leaves the optimizer in an
// undefined state.
func (o *Lamb) Step(ctx context.Context) error {
	return o.f.Step(ctx)
}

// SetLR fixes the learning rate of the following steps, replacing any
// schedule; see optim.LRSetter. The frozen variance, coeff_freeze and the
// factors are not touched.
func (o *Lamb) SetLR(lr float32) error { return o.f.SetLR(lr) }

// CarryFlags makes every following Step carry sf in its per-step
// agreement; see optim.FlagCarrier.
func (o *Lamb) CarryFlags(sf *optim.StepFlags) error { return o.f.CarryFlags(sf) }

// SetSchedule makes s choose the learning rate of every following step
// (nil: back to the fixed one); see optim.LRSetter.
func (o *Lamb) SetSchedule(s optim.Schedule) error { return o.f.SetSchedule(s) }

// LR returns the learning rate of the next step.
func (o *Lamb) LR() float32 { return o.f.LR() }

// Stage is the stage the next step runs in: optim.StageWarmup or
// optim.StageCompression.
func (o *Lamb) Stage() optim.Stage { return o.f.Stage() }

// biasCorrections returns the multipliers of m and of v for step t (1
// and 1 without bias correction).
func (o *Lamb) biasCorrections(t int64) (c1, c2 float32) {
	if !o.cfg.BiasCorrection {
		return 1, 1
	}
	return optim.BiasCorrection(o.cfg.Beta1, t), optim.BiasCorrection(o.cfg.Beta2, t)
}

// warmup is one step of plain LAMB on exactly averaged gradients.
func (o *Lamb) warmup(ctx context.Context, t int64, lr float32) error {
	if err := o.avg.Average(ctx); err != nil {
		return err
	}
	cfg := &o.cfg
	c1, c2 := o.biasCorrections(t)
	cb := float64(cfg.CoeffBeta)
	// StateCompact keeps m in v_fresh's buffer and the update in the
	// worker error buffer, both free in the warm-up.
	mAll, updAll := o.m, o.scratch
	if o.cp != nil {
		mAll, updAll = o.vFresh, o.ef.WorkerError
	}
	for i, p := range o.params {
		lo, hi := o.offs[i], o.offs[i+1]
		if lo == hi {
			continue
		}
		m, v, upd := mAll[lo:hi], o.v[lo:hi], updAll[lo:hi]
		optim.AdamMoments(m, v, p.GradData(), cfg.Beta1, cfg.Beta2)
		pSq, uSq := optim.AdamDirection(upd, p.Data(), m, v, cfg.WeightDecay, c1, c2, cfg.Eps)
		coeff := optim.LambCoeff(pSq, uSq, cfg.MinCoeff, cfg.MaxCoeff)
		if coeff != 1 {
			o.coeffFreeze[i] = cb*o.coeffFreeze[i] + (1-cb)*float64(coeff)
		}
		optim.Descend(p.Data(), upd, lr*coeff)
	}
	if t >= int64(cfg.FreezeStep) {
		// v_fresh starts as a copy of the v that is frozen now (in
		// StateCompact its buffer holds m until the first compression
		// step, which reads v in its place).
		if o.cp == nil {
			copy(o.vFresh, o.v)
		}
		o.frozenAt = t
		o.f.Enter(optim.StageCompression)
		o.late.stale = true
	}
	return nil
}

// compressed is one step of the compression stage, numbered as in the
// spec; an element whose v is zero takes no step, and has its v marked at
// the end of the step if some rank gave it gradient (see unseen).
func (o *Lamb) compressed(ctx context.Context, t int64, lr float32) error {
	late := o.late.ready(o.f.World(), o.v)
	if late {
		if err := o.packLate(ctx); err != nil {
			return err
		}
	}
	var err error
	if o.cp != nil {
		err = o.compactStep(ctx, t, lr)
	} else {
		err = o.fullStep(ctx, t, lr)
	}
	if err == nil && late {
		o.markLate()
	}
	return err
}

// fullStep is a compression step in StateFull.
func (o *Lamb) fullStep(ctx context.Context, t int64, lr float32) error {
	cfg := &o.cfg
	// 2. The scaling, on the first compression step only (from m before
	// this step's update).
	if !o.scaled {
		o.setScaling(o.m)
	}
	// 1. and 3. m_last = m; m = b1*m + (1-b1)*g_local; m *= scaling_p.
	for i, p := range o.params {
		lo, hi := o.offs[i], o.offs[i+1]
		if lo == hi {
			continue
		}
		lambMomentum(o.scratch[lo:hi], o.m[lo:hi], p.GradData(), cfg.Beta1, o.scaling[i])
	}
	// 4. One compressed allreduce of the fused buffer.
	if o.ef != nil {
		if err := AllReduce(ctx, o.f.Comm(), o.m, o.ef); err != nil {
			return fmt.Errorf("momentum: %w", samePackage{err})
		}
	}
	// 5. Per parameter: unscale, mask, v_fresh, factor, update (its
	// ratio bounded as exact Adam's, see the package doc).
	bound := ratioBound(cfg.Beta1, cfg.Beta2)
	c1, c2, c2Fresh := o.corrections(t)
	for i, p := range o.params {
		lo, hi := o.offs[i], o.offs[i+1]
		if lo == hi {
			continue
		}
		m, s := o.m[lo:hi], o.scaling[i]
		if o.masks[i] != nil {
			// m /= scaling_p before the mask; the kernel then has nothing
			// left to divide.
			if s != 1 {
				divScalar(m, s)
			}
			optim.Mul(m, o.masks[i])
			s = 1
		}
		upd := o.scratch[lo:hi] // m_last on entry, the update on return
		ratio, preSq, updSq := lambFreshDirection(upd, p.Data(), m, o.v[lo:hi], o.vFresh[lo:hi],
			s, cfg.Beta1, cfg.Beta2, cfg.WeightDecay, c1, c2, c2Fresh, cfg.Eps, bound)
		f := o.factor(i, ratio, preSq, updSq)
		optim.Descend(p.Data(), upd, float32(float64(lr)*o.coeffFreeze[i]*f))
	}
	return nil
}

// setScaling computes, from the momenta at the end of the warm-up (m, the
// fused buffer), s_p = ||m_p||/sqrt(numel_p), u = mean_p(s_p) and
// scaling_p = u/s_p (1 where s_p is 0, or where the ratio is not a finite
// float32).
func (o *Lamb) setScaling(m []float32) {
	var sum float64
	n := 0
	for i := range o.params {
		lo, hi := o.offs[i], o.offs[i+1]
		if lo == hi {
			continue
		}
		o.norms[i] = math.Sqrt(optim.SumSquares(m[lo:hi])) / math.Sqrt(float64(hi-lo))
		sum += o.norms[i]
		n++
	}
	for i := range o.params {
		o.scaling[i] = 1
		if o.offs[i] == o.offs[i+1] || o.norms[i] == 0 {
			continue
		}
		if s := float32(sum / float64(n) / o.norms[i]); s > 0 && !math.IsInf(float64(s), 0) {
			o.scaling[i] = s
		}
	}
	o.scaled = true
}

// factor turns the largest ratio of frozen to fresh denominators of
// parameter i into the factor of its update: blended towards 1 by the
// share of the update that is not weight decay, clipped to [FactorMin,
// FactorMax] and to within FactorThreshold of the last factor, which it
// then replaces.
func (o *Lamb) factor(i int, ratio float32, preSq, updSq float64) float64 {
	cfg := &o.cfg
	f := float64(ratio)
	if cfg.WeightDecay > 0 {
		r := 1.0
		if updSq > 0 {
			r = min(1, math.Sqrt(preSq)/math.Sqrt(updSq))
		}
		f = f*r + (1 - r)
	}
	f = min(max(f, float64(cfg.FactorMin)), float64(cfg.FactorMax))
	last, th := o.lastFactor[i], float64(cfg.FactorThreshold)
	f = min(max(f, last*(1-th)), last*(1+th))
	o.lastFactor[i] = f
	return f
}

// lambMomentum is steps 1 and 3 for one parameter: mLast = m, then
// m = (b1*m + (1-b1)*g) * s, rounded as optim.Momentum and then the
// product (no product when s is 1).
func lambMomentum(mLast, m, g []float32, b1, s float32) {
	a1 := optim.OneMinus(b1)
	mLast, g = mLast[:len(m)], g[:len(m)]
	if s == 1 {
		for i, mi := range m {
			mLast[i] = mi
			m[i] = float32(b1*mi) + float32(a1*g[i])
		}
		return
	}
	for i, mi := range m {
		mLast[i] = mi
		m[i] = (float32(b1*mi) + float32(a1*g[i])) * s
	}
}

// corrections are the bias corrections of compression step t: of m at
// t, of the frozen v at the freezing step, of v_fresh at t (1 without
// BiasCorrection).
func (o *Lamb) corrections(t int64) (c1, c2, c2Fresh float32) {
	cfg := &o.cfg
	if !cfg.BiasCorrection {
		return 1, 1, 1
	}
	return optim.BiasCorrection(cfg.Beta1, t), optim.BiasCorrection(cfg.Beta2, o.frozenAt), optim.BiasCorrection(cfg.Beta2, t)
}

// lambFreshDirection is the per-element part of step 5 for one parameter:
// with u holding m_last on entry, m /= s (skipped when s is 1: a masked
// parameter is unscaled and masked before), then
//
//	g_rec   = (m - b1*m_last)/(1-b1)
//	v_fresh = b2*v_fresh + (1-b2)*g_rec^2
//	denom   = sqrt(v*c2) + eps
//	upd_pre = b.Of(m*c1/denom, v)
//	u       = upd_pre + wd*p
//
// It returns the largest denom/(sqrt(v_fresh*c2Fresh)+eps) (0 if none is
// larger) and the float64 sums of squares of upd_pre and of u.
func lambFreshDirection(u, p, m, v, vFresh []float32, s, b1, b2, wd, c1, c2, c2Fresh, eps float32, b optim.RatioBound) (ratio float32, preSq, updSq float64) {
	return lambFresh(u, p, m, v, vFresh, vFresh, s, b1, b2, wd, c1, c2, c2Fresh, eps, b, 0, 0, 0)
}

// lambFresh is lambFreshDirection on a run of a parameter's elements
// that continues the run before it: ratio, preSq and updSq carry the
// largest ratio and the sums so far, and the new ones are returned (the
// same as one call over the whole parameter). v_fresh is read from
// vfIn and written to vfOut, which may be the same buffer; u (m_last on
// entry) may not be vfOut.
func lambFresh(u, p, m, v, vfIn, vfOut []float32, s, b1, b2, wd, c1, c2, c2Fresh, eps float32, b optim.RatioBound,
	ratio float32, preSq, updSq float64) (float32, float64, float64) {
	a1, a2 := optim.OneMinus(b1), optim.OneMinus(b2)
	p, m, v, vfIn, vfOut = p[:len(u)], m[:len(u)], v[:len(u)], vfIn[:len(u)], vfOut[:len(u)]
	for i := range u {
		mi := m[i]
		if s != 1 {
			mi /= s
			m[i] = mi
		}
		g := float32(mi-float32(b1*u[i])) / a1
		vf := float32(b2*vfIn[i]) + float32(float32(a2*g)*g)
		vfOut[i] = vf
		d := lambDenom(v[i], c2, eps)
		dr := lambDenom(vf, c2Fresh, eps)
		if r := d / dr; r > ratio {
			ratio = r
		}
		pre := b.Of(float32(mi*c1)/d, v[i])
		up := pre + float32(wd*p[i])
		u[i] = up
		preSq += float64(pre) * float64(pre)
		updSq += float64(up) * float64(up)
	}
	return ratio, preSq, updSq
}

// lambDenom is sqrt(v*c2) + eps, rounded as every 1-bit LAMB kernel
// rounds it.
func lambDenom(v, c2, eps float32) float32 {
	return float32(math.Sqrt(float64(float32(v*c2)))) + eps
}

// divScalar divides x by s in place.
func divScalar(x []float32, s float32) {
	for i := range x {
		x[i] /= s
	}
}

// State returns a checkpoint of this rank's optimizer: the parameters, m,
// v, v_fresh, the counters, the stage, coeff_freeze, last_factor, the
// scaling, and this rank's worker and server errors of the fused buffer;
// and the StateMode unless StateFull. StateCompact's checkpoints are
// StateFull's, bit for bit, but for the mode.
func (o *Lamb) State() (*optim.Checkpoint, error) {
	ck := o.f.Checkpoint()
	ck.Ints[IntFrozenAt] = o.frozenAt
	ck.Ints[IntScaled] = boolInt(o.scaled)
	if o.mode != StateFull {
		ck.Ints[IntStateMode] = int64(o.mode)
	}
	m, vFresh, we := o.m, o.vFresh, []float32(nil)
	if o.cp != nil {
		m, vFresh, we = o.compactState()
		if o.cp.loose != nil {
			ck.Ints[IntForeignMomentum] = 1
		}
	}
	for i, p := range o.params {
		lo, hi := o.offs[i], o.offs[i+1]
		shape := p.Shape()
		ck.AddTensor(optim.ParamTensorName(p.Name), shape, p.Data())
		ck.AddTensor(optim.ExpAvgPrefix+p.Name, shape, m[lo:hi])
		ck.AddTensor(optim.ExpAvgSqPrefix+p.Name, shape, o.v[lo:hi])
		ck.AddTensor(ExpAvgSqFreshPrefix+p.Name, shape, vFresh[lo:hi])
		ck.Floats[FloatCoeffFreezePrefix+p.Name] = o.coeffFreeze[i]
		ck.Floats[FloatLastFactorPrefix+p.Name] = o.lastFactor[i]
		ck.Floats[FloatScalingPrefix+p.Name] = float64(o.scaling[i])
	}
	if o.ef != nil {
		if we == nil {
			we = o.ef.WorkerError
		}
		ck.AddTensor(FusedWorkerError, []int{len(we)}, we)
		ck.AddTensor(FusedServerError, []int{len(o.ef.ServerError)}, o.ef.ServerError)
	}
	return ck, nil
}

// Load restores a checkpoint made by State on the same rank of a group of
// the same size, over parameters of the same names and shapes, in
// StateFull or StateCompact (either loads the other's). It refuses
// anything else with an error wrapping optim.ErrIncompatibleCheckpoint and
// then leaves the optimizer unchanged. A checkpoint whose error buffers
// were reset on request (optim.Checkpoint.ResetErrors) loads on any group
// size and rank: the error buffers of the fused momentum start at zero,
// and Load logs a warning that says so.
//
// StateCompact refuses a state it cannot hold, which only a StateFull
// that loaded a hand-made checkpoint reaches: after the first compression
// step a momentum that is not what the compressed allreduce of this group
// gathers (±scale per chunk, divided by the scaling and times the mask);
// before it, non-zero worker errors, or a v_fresh other than StateFull's
// (zero in the warm-up, the frozen v after). A checkpoint whose error
// buffers were reset, or that Regroup made for another group size
// (IntForeignMomentum), is not refused for its momentum (it was gathered
// in other chunks): StateCompact then holds m as float32, 4 more bytes per
// parameter, until the next compression step, which is StateFull's bit
// for bit.
func (o *Lamb) Load(ck *optim.Checkpoint) error {
	if err := o.load(ck); err != nil {
		return fmt.Errorf("onebit: 1-bit LAMB: %w", err)
	}
	return nil
}

func (o *Lamb) load(ck *optim.Checkpoint) error {
	fs, err := o.f.CheckLoad(ck, optim.StageWarmup, optim.StageCompression)
	if err != nil {
		return err
	}
	if err := checkRank(ck, o.f.Rank()); err != nil {
		return err
	}
	if err := checkMode(ck, o.mode, 0); err != nil {
		return err
	}
	step := fs.Step
	ints, err := checkpointInts(ck, IntFrozenAt, IntScaled)
	if err != nil {
		return err
	}
	if ints[0] < 0 || ints[0] > step || ints[1] < 0 || ints[1] > 1 {
		return fmt.Errorf("%w: inconsistent counters: %s %d, %s %d at step %d",
			optim.ErrIncompatibleCheckpoint, IntFrozenAt, ints[0], IntScaled, ints[1], step)
	}
	// Gather and check everything before changing anything.
	rs := ck.Restore()
	floats := make([]float64, 0, 3*len(o.params))
	// StateCompact takes m, v_fresh and the worker errors through
	// compactLoad, from these.
	var cm, cvf, cwe, cscaling []float32
	var cv [][]float32
	if o.cp != nil {
		total := o.offs[len(o.params)]
		cm, cvf, cv, cscaling = make([]float32, total), make([]float32, total), make([][]float32, len(o.params)), make([]float32, len(o.params))
	}
	for i, p := range o.params {
		lo, hi := o.offs[i], o.offs[i+1]
		rs.Tensor(optim.ParamTensorName(p.Name), p.Data())
		rs.Tensor(optim.ExpAvgSqPrefix+p.Name, o.v[lo:hi])
		if o.cp == nil {
			rs.Tensor(optim.ExpAvgPrefix+p.Name, o.m[lo:hi])
			rs.Tensor(ExpAvgSqFreshPrefix+p.Name, o.vFresh[lo:hi])
		} else {
			for _, t := range []struct {
				name string
				dst  []float32
			}{{optim.ExpAvgPrefix, cm}, {ExpAvgSqFreshPrefix, cvf}} {
				x, err := ck.TensorData(t.name+p.Name, hi-lo)
				if err != nil {
					return err
				}
				copy(t.dst[lo:hi], x)
			}
			if cv[i], err = ck.TensorData(optim.ExpAvgSqPrefix+p.Name, hi-lo); err != nil {
				return err
			}
		}
		for _, k := range []string{FloatCoeffFreezePrefix, FloatLastFactorPrefix, FloatScalingPrefix} {
			f, err := ck.Float(k + p.Name)
			if err != nil {
				return err
			}
			if math.IsNaN(f) || math.IsInf(f, 0) || k == FloatScalingPrefix && !(float32(f) > 0) {
				return fmt.Errorf("%w: %s%s is %v", optim.ErrIncompatibleCheckpoint, k, p.Name, f)
			}
			floats = append(floats, f)
		}
	}
	var commit func()
	if o.ef != nil && !ck.ErrorsReset {
		if o.cp == nil {
			rs.Tensor(FusedWorkerError, o.ef.WorkerError)
		} else {
			x, err := ck.TensorData(FusedWorkerError, len(o.ef.WorkerError))
			if err != nil {
				return err
			}
			cwe = x
		}
		rs.Tensor(FusedServerError, o.ef.ServerError)
	}
	if o.cp != nil {
		for i := range o.params {
			cscaling[i] = float32(floats[3*i+2])
		}
		var err error
		foreign := ck.ErrorsReset || ck.Ints[IntForeignMomentum] != 0
		if commit, err = o.compactLoad(cm, cvf, cv, cwe, cscaling, fs.Stage, ints[1] != 0, foreign); err != nil {
			return err
		}
	}
	if err := rs.Apply(); err != nil {
		return err
	}
	if commit != nil {
		commit()
	}
	if ck.ErrorsReset {
		if o.ef != nil {
			o.ef.Reset()
		}
		warnErrorsReset(o.f.Logger(), ck, o.f.World(), o.f.Rank())
	}
	for i := range o.params {
		o.coeffFreeze[i] = floats[3*i]
		o.lastFactor[i] = floats[3*i+1]
		o.scaling[i] = float32(floats[3*i+2])
	}
	o.frozenAt, o.scaled = ints[0], ints[1] != 0
	o.f.Restore(fs)
	o.late.stale = true
	return nil
}

// packLate writes, when some element's v is zero, whether this rank
// gives it gradient, and or-s every rank's (see unseen); markLate, at the
// end of the step, marks the v of those some rank gave gradient.
func (o *Lamb) packLate(ctx context.Context) error {
	o.late.start()
	for i, p := range o.params {
		o.late.pack(o.offs[i], p.GradData()[:o.offs[i+1]-o.offs[i]])
	}
	return o.late.exchange(ctx, o.f.Comm())
}

// markLate: see packLate.
func (o *Lamb) markLate() {
	o.late.mark(0, o.v)
	o.late.done()
}

// compileMasks checks the exp_avg masks against params and returns them
// per parameter (nil where a parameter has none), copied.
func compileMasks(params []*optim.Param, masks map[string][]float32) ([][]float32, error) {
	out := make([][]float32, len(params))
	found := 0
	for i, p := range params {
		mask, ok := masks[p.Name]
		if !ok {
			continue
		}
		if len(mask) != p.Numel() {
			return nil, fmt.Errorf("exp_avg mask of %q has %d elements, the parameter %d", p.Name, len(mask), p.Numel())
		}
		out[i] = append([]float32(nil), mask...)
		found++
	}
	if found != len(masks) {
		for name := range masks {
			if !hasParam(params, name) {
				return nil, fmt.Errorf("exp_avg mask for %q, which is not a parameter", name)
			}
		}
	}
	return out, nil
}

func hasParam(params []*optim.Param, name string) bool {
	for _, p := range params {
		if p.Name == name {
			return true
		}
	}
	return false
}

// checkRank refuses a checkpoint made by another rank: it holds that
// rank's error buffers (unless they were reset).
func checkRank(ck *optim.Checkpoint, rank int) error {
	if ck.Rank != rank && !ck.ErrorsReset {
		return fmt.Errorf("%w: made by rank %d, this is rank %d (error buffers are per rank: load this rank's own checkpoint, or onebit.Regroup of every rank's, which keeps the error feedback; ck.ResetErrors() is the lossy way, the error feedback restarting from zero)", optim.ErrIncompatibleCheckpoint, ck.Rank, rank)
	}
	return nil
}

// warnErrorsReset logs the warning of every Load of a checkpoint whose
// error buffers were reset (optim.Checkpoint.ResetErrors), after the load:
// what restarted, what was carried and the lossless way (Regroup).
func warnErrorsReset(log *zap.Logger, ck *optim.Checkpoint, world, rank int) {
	log.Warn(errorsResetMessage(ck.Algorithm),
		zap.String("algorithm", ck.Algorithm), zap.Int64("step", ck.Ints[optim.IntStep]),
		zap.Int("made_on_world", ck.World), zap.Int("made_by_rank", ck.Rank),
		zap.Int("world", world), zap.Int("rank", rank))
}

// errorsResetMessage is warnErrorsReset's message for a checkpoint of
// algorithm.
func errorsResetMessage(algorithm string) string {
	const (
		reset   = "loaded a checkpoint whose error buffers were reset (optim.Checkpoint.ResetErrors): the error feedback starts again from zero; "
		regroup = "onebit.Regroup of every old rank's checkpoint keeps the error feedback"
	)
	if algorithm == AlgorithmMuon {
		return reset + "the parameters, the AdamW moments and the counters are carried, and the momenta are those of the rank that made it (made_by_rank) alone, " +
			"not the ranks' mean (" + regroup + " and takes the momenta's mean)"
	}
	return reset + "the parameters, the moments and the counters are carried, those of the rank that made it (made_by_rank) (" + regroup + ")"
}

// checkpointInts returns the named counters of ck, in order, or the error
// for the first missing one.
func checkpointInts(ck *optim.Checkpoint, names ...string) ([]int64, error) {
	out := make([]int64, len(names))
	for i, n := range names {
		v, err := ck.Int(n)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

func boolInt(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// Close releases the communicators that ReduceTwoLevel averaging split off
// the group (none in the other modes); see optim.Optimizer.Close: not a
// collective, idempotent, every rank calls it, Step fails after it.
func (o *Lamb) Close() error {
	o.f.Close()
	return o.avg.Close()
}
