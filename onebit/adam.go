package onebit

import (
	"context"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// AdamConfig holds the hyper-parameters of 1-bit Adam. Start from
// DefaultAdamConfig.
type AdamConfig struct {
	// AdamConfig holds lr, betas, eps, weight decay (decoupled, AdamW
	// style) and bias correction, with optim's defaults. Unlike the
	// reference implementation, BiasCorrection is honoured.
	optim.AdamConfig
	// FreezeStep is the number of warm-up steps, in which 1-bit Adam is
	// exact Adam; from step FreezeStep+1 on the variance is frozen and the
	// momentum is communicated compressed; >= 0. Default 100. 0
	// compresses from the first step with v = 0 (rarely what you want:
	// the first step moves nothing, and every later one is a sign step of
	// lr). An element whose frozen v is tiny, or zero and then given
	// gradient (first given gradient after the warm-up), steps by at most
	// lr*CapFactor*optim.AdamRatioBound; one whose gradient is always zero
	// does not move: see the package doc.
	FreezeStep int
	// ExpAvgMask optionally maps a parameter name to a mask as long as the
	// parameter, multiplied into its momentum after every compressed
	// allreduce (to keep, say, padded embedding rows at zero); finite.
	// Parameters without an entry are not masked. Default nil.
	ExpAvgMask map[string][]float32
	// BucketBytes is the size of the fused buckets the momentum is
	// compressed in, in the convention of optim.DefaultBucketBytes: the
	// momenta of all parameters form one flat buffer, cut into buckets of
	// BucketBytes (the last may be shorter), and each bucket is one
	// compressed allreduce with its own error feedback. 0 means
	// optim.DefaultBucketBytes (25 MiB, like DDP); optim.PerParameter
	// compresses each parameter on its own (one collective and one scale
	// per parameter, as lowbit did before buckets).
	BucketBytes int
	// StateMode chooses how the optimizer state is kept: StateFull (the
	// zero value, the default), StateCompact (the same steps bit for bit,
	// the momentum held packed) or StateSharded, the moments sharded over
	// the ranks (docs/sharded.md). Checkpoints record it; a checkpoint of
	// another mode is refused, StateFull's and StateCompact's aside (they
	// load each other's). On one rank every mode runs as StateFull.
	StateMode StateMode
	// BF16 keeps some of StateSharded's buffers in bfloat16 (see
	// BF16State); only with StateSharded. Checkpoints record it; a
	// checkpoint made with other flags is refused. Default 0: float32.
	BF16 BF16State
}

// DefaultAdamConfig returns optim.DefaultAdamConfig with FreezeStep 100,
// no mask and buckets of optim.DefaultBucketBytes.
func DefaultAdamConfig() AdamConfig {
	return AdamConfig{AdamConfig: optim.DefaultAdamConfig(), FreezeStep: 100, BucketBytes: optim.DefaultBucketBytes}
}

// Checkpoint names of 1-bit Adam's state beyond optim's common ones.
const (
	// WorkerErrorPrefix and ServerErrorPrefix (followed by the parameter
	// name) name this rank's error buffers, PaddedLen(n, W) and
	// PaddedLen(n, W)/W floats. They follow optim's naming rule for error
	// buffers (see optim.IsErrorBuffer), which optim.Checkpoint.ResetErrors
	// drops.
	WorkerErrorPrefix = optim.WorkerErrorName + "/"
	ServerErrorPrefix = optim.ServerErrorName + "/"
	// FloatFrozenBiasCorrection2 is the frozen multiplier 1/(1-beta2^t)
	// of the variance (1 without bias correction).
	FloatFrozenBiasCorrection2 = "bias_correction2_frozen"
)

// Adam is 1-bit Adam (Tang et al. 2021), as specified in the spec page
// onebit.md.
//
// Warm-up, steps 1..FreezeStep: exact Adam (gradients averaged with an exact
// allreduce). Compression, every later step: v and its bias correction are
// frozen; the local gradient updates m = beta1*m + (1-beta1)*g; m goes
// through the error-compensated 1-bit allreduce (AllReduce, skipped when W
// = 1) in fused buckets (all momenta form one flat buffer, cut into buckets
// of BucketBytes, one allreduce and one error feedback state each), then
// the mask; then the same update as in warm-up,
// p -= lr * (m_hat/(sqrt(v_hat)+eps) + wd*p), with the frozen v_hat and the
// ratio m_hat/(sqrt(v_hat)+eps) clipped to the largest exact Adam can reach
// (optim.AdamRatioBound; see the package doc on late and tiny-variance
// elements, and on elements with no gradient, which do not move). There is
// no discarded first compression step.
//
// A step in which some rank's gradient is not finite is skipped on every
// rank (one tiny allreduce of a flag before anything changes). A checkpoint
// holds parameters, moments, counters, stage, the frozen bias correction and
// this rank's error buffers: resuming is bit-identical to not stopping.
// After an error from the communicator the state is undefined: load a
// checkpoint.
type Adam struct {
	f      *optim.Frame
	params []*optim.Param
	cfg    optim.AdamConfig
	freeze int64
	mask   [][]float32 // per parameter, nil when unmasked

	m, v  [][]float32 // per parameter: views into mflat and vflat
	mflat []float32   // every parameter's momentum, in order
	vflat []float32
	bkt   *buckets // the fused buckets of mflat (none when world == 1)
	c2    float32  // frozen variance bias correction, valid in compression
	avg   *optim.GradAverager
	mode  StateMode
	bf16  BF16State
	sh    *sharded // StateSharded on more than one rank: m, v, bkt and avg are nil
	cp    *compact // StateCompact on more than one rank: m and mflat are nil
	late  unseen   // the elements whose frozen v is zero (not with sh)
}

var (
	_ optim.Optimizer   = (*Adam)(nil)
	_ optim.LRSetter    = (*Adam)(nil)
	_ optim.FlagCarrier = (*Adam)(nil)
)

// NewAdam returns 1-bit Adam over params on the ranks of c (nil for a
// single process). Every rank of c calls it together, with the same
// parameter shapes and config; it does not communicate (ctx: see optim's
// package doc). An invalid cfg is refused with cfg.Validate's error. It
// allocates both moments and, on more than one rank,
// one State of error buffers per bucket; the first warm-up Step may
// allocate the averaging buffers of cfg.Reduce (see optim.NewAdam); later
// steps allocate nothing.
func NewAdam(ctx context.Context, c comm.Comm, params []*optim.Param, cfg AdamConfig, opts ...optim.Option) (*Adam, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := optim.CheckParams(params); err != nil {
		return nil, fmt.Errorf("onebit: Adam: %w", err)
	}
	a := &Adam{
		params: append([]*optim.Param(nil), params...),
		cfg:    cfg.AdamConfig,
		freeze: int64(cfg.FreezeStep),
		c2:     1,
		mode:   cfg.StateMode,
		bf16:   cfg.BF16,
	}
	masks, err := compileMasks(params, cfg.ExpAvgMask)
	if err != nil {
		return nil, fmt.Errorf("onebit: Adam: %w", err)
	}
	a.mask = masks
	start := optim.StageWarmup
	if a.freeze == 0 {
		// Compression from the first step, with v = 0 and c2 = 1.
		start = optim.StageCompression
	}
	world, rank := 1, 0
	if c != nil {
		world, rank = c.Size(), c.Rank()
	}
	sizes := make([]int, len(params))
	for i, p := range params {
		sizes[i] = p.Numel()
	}
	frameSizes := make([][]float32, len(params))
	if a.mode == StateSharded && world > 1 {
		if a.sh, err = newSharded(a.params, masks, world, rank, cfg.BucketBytes, cfg.BF16); err != nil {
			return nil, fmt.Errorf("onebit: Adam: %w", err)
		}
		for i, p := range a.params {
			frameSizes[i] = p.Data()
		}
		if start == optim.StageCompression {
			a.sh.setCompressing(true)
		}
	} else {
		if a.mode == StateCompact && world > 1 {
			if a.cp, err = newCompact(a.params, masks, world, cfg.BucketBytes); err != nil {
				return nil, fmt.Errorf("onebit: Adam: %w", err)
			}
		} else {
			a.mflat, a.m = flatten[float32](sizes)
		}
		a.vflat, a.v = flatten[float32](sizes)
		frameSizes = a.v
		if a.avg, err = optim.NewGradAverager(c, a.params, cfg.Reduce, cfg.RanksPerNode); err != nil {
			return nil, fmt.Errorf("onebit: Adam: %w", err)
		}
	}
	a.f = optim.NewFrame(optim.FrameConfig{
		Name: "onebit: Adam", Algorithm: optim.AlgorithmOnebitAdam, Comm: c,
		Params: a.params, Sizes: frameSizes, LR: cfg.LR, Stage: start,
		Logger: optim.ApplyOptions(opts).Logger, Averager: a.avg, Hypers: cfg.hypers(masks),
	})
	switch {
	case a.sh != nil:
		a.bkt = a.sh.bkt
	case a.cp != nil:
		a.bkt = a.cp.bkt
	default:
		a.bkt, err = newBuckets(a.params, a.f.World(), cfg.BucketBytes, false)
	}
	if err != nil {
		return nil, fmt.Errorf("onebit: Adam: %w", err)
	}
	a.f.Handle(optim.StageWarmup, a.warmup)
	a.f.Handle(optim.StageCompression, a.compressed)
	a.late.stale = true
	return a, nil
}

// Step applies one update; see optim.Optimizer. In warm-up it overwrites
// the gradients with their average; in compression it leaves them alone.
func (a *Adam) Step(ctx context.Context) error {
	return a.f.Step(ctx)
}

// warmup is exact Adam; after step FreezeStep it freezes v's bias
// correction and enters the compression stage.
func (a *Adam) warmup(ctx context.Context, t int64, lr float32) error {
	cfg := a.cfg
	c1, c2 := float32(1), float32(1)
	if cfg.BiasCorrection {
		c1, c2 = optim.BiasCorrection(cfg.Beta1, t), optim.BiasCorrection(cfg.Beta2, t)
	}
	if a.sh != nil {
		if err := a.sh.warmup(ctx, a.f.Comm(), cfg, lr, c1, c2); err != nil {
			return err
		}
	} else {
		if err := a.avg.Average(ctx); err != nil {
			return err
		}
		if a.cp != nil {
			a.cp.warmup(cfg, a.v, lr, c1, c2)
		} else {
			for i, p := range a.params {
				optim.AdamMoments(a.m[i], a.v[i], p.GradData(), cfg.Beta1, cfg.Beta2)
				optim.AdamUpdate(p.Data(), a.m[i], a.v[i], lr, cfg.WeightDecay, c1, c2, cfg.Eps)
			}
		}
	}
	if t >= a.freeze {
		if a.sh != nil {
			a.sh.freeze()
		}
		a.c2 = 1
		if cfg.BiasCorrection {
			a.c2 = optim.BiasCorrection(cfg.Beta2, t)
		}
		a.f.Enter(optim.StageCompression)
		a.late.stale = true
	}
	return nil
}

// compressed is a compression-stage step: local momentum, compressed
// allreduce, mask, update with the frozen v, its ratio bounded as exact
// Adam's (see the package doc); an element whose v is zero takes no step,
// and has its v marked at the end of the step if some rank gave it
// gradient (see unseen).
func (a *Adam) compressed(ctx context.Context, t int64, lr float32) error {
	cfg := a.cfg
	c1 := float32(1)
	if cfg.BiasCorrection {
		c1 = optim.BiasCorrection(cfg.Beta1, t)
	}
	if a.sh != nil {
		return a.sh.compressed(ctx, a.f.Comm(), cfg, lr, c1, a.c2)
	}
	late := a.late.ready(a.f.World(), a.vflat)
	if late {
		a.late.start()
		off := 0
		for i, p := range a.params {
			a.late.pack(off, p.GradData()[:len(a.v[i])])
			off += len(a.v[i])
		}
		if err := a.late.exchange(ctx, a.f.Comm()); err != nil {
			return err
		}
	}
	if a.cp != nil {
		if err := a.cp.compressed(ctx, a.f.Comm(), cfg, a.v, lr, c1, a.c2); err != nil {
			return err
		}
	} else {
		bound := ratioBound(cfg.Beta1, cfg.Beta2)
		for i, p := range a.params {
			optim.Momentum(a.m[i], p.GradData(), cfg.Beta1)
		}
		if err := a.bkt.allReduce(ctx, a.f.Comm(), a.mflat); err != nil {
			return fmt.Errorf("momentum: %w", err)
		}
		for i, p := range a.params {
			if a.mask[i] != nil {
				optim.Mul(a.m[i], a.mask[i])
			}
			optim.AdamUpdateBounded(p.Data(), a.m[i], a.v[i], lr, cfg.WeightDecay, c1, a.c2, cfg.Eps, bound)
		}
	}
	if late {
		a.late.mark(0, a.vflat)
		a.late.done()
	}
	return nil
}

// SetLR fixes the learning rate of the following steps, replacing any
// schedule; see optim.LRSetter. The variance stays frozen as it was.
func (a *Adam) SetLR(lr float32) error { return a.f.SetLR(lr) }

// CarryFlags makes every following Step carry sf in its per-step
// agreement; see optim.FlagCarrier.
func (a *Adam) CarryFlags(sf *optim.StepFlags) error { return a.f.CarryFlags(sf) }

// SetSchedule makes s choose the learning rate of every following step
// (nil: back to the fixed one); see optim.LRSetter.
func (a *Adam) SetSchedule(s optim.Schedule) error { return a.f.SetSchedule(s) }

// LR returns the learning rate of the next step.
func (a *Adam) LR() float32 { return a.f.LR() }

// Params returns the parameters in construction order.
func (a *Adam) Params() []*optim.Param { return a.params }

// Stats reports progress and traffic; Stage is the stage the next step runs
// in (StageWarmup or StageCompression).
func (a *Adam) Stats() optim.Stats { return a.f.Stats() }

// Stage is the stage the next step runs in.
func (a *Adam) Stage() optim.Stage { return a.f.Stage() }

// State returns this rank's checkpoint: parameters, m, v, the step
// counters, the stage, the frozen bias correction of v and, on more than
// one rank, the bucket layout and this rank's worker and server errors of
// every bucket.
func (a *Adam) State() (*optim.Checkpoint, error) {
	ck := a.f.Checkpoint()
	ck.Floats[FloatFrozenBiasCorrection2] = float64(a.c2)
	if a.mode != StateFull {
		ck.Ints[IntStateMode] = int64(a.mode)
	}
	if a.bf16 != 0 {
		ck.Ints[IntBF16] = int64(a.bf16)
	}
	m, we := a.m, [][]float32(nil)
	if a.cp != nil {
		m, we = a.cp.moments()
		if a.cp.loose != nil {
			ck.Ints[IntForeignMomentum] = 1
		}
	}
	for i, p := range a.params {
		shape := p.Shape()
		ck.AddTensor(optim.ParamTensorName(p.Name), shape, p.Data())
		if a.sh == nil {
			ck.AddTensor(optim.ExpAvgPrefix+p.Name, shape, m[i])
			ck.AddTensor(optim.ExpAvgSqPrefix+p.Name, shape, a.v[i])
		}
	}
	if a.sh != nil {
		a.sh.save(ck)
	} else {
		a.bkt.save(ck, we, nil)
	}
	return ck, nil
}

// Load restores a checkpoint made by State of a 1-bit Adam on the same
// world size, rank and parameters. Anything else is refused with an error
// wrapping optim.ErrIncompatibleCheckpoint, and the optimizer is left
// unchanged. A checkpoint whose error buffers were reset on request
// (optim.Checkpoint.ResetErrors) loads on any world size and rank: the
// error buffers start at zero, and Load logs a warning that says so. A
// checkpoint made with another BucketBytes, or before buckets existed (with
// per-parameter error buffers), is refused unless its errors were reset
// that way.
//
// StateCompact refuses a momentum it cannot pack (not ±scale per chunk of
// this group, times the masks: a hand-made one), unless the checkpoint
// says another group gathered it (IntForeignMomentum, as Regroup sets
// it): it then holds it as float32, 4 more bytes per parameter, until the
// next compression step, which is StateFull's bit for bit.
func (a *Adam) Load(ck *optim.Checkpoint) error {
	fs, err := a.f.CheckLoad(ck, optim.StageWarmup, optim.StageCompression)
	if err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	if err := checkMode(ck, a.mode, a.bf16); err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	if a.f.World() > 1 && ck.Rank != a.f.Rank() && !ck.ErrorsReset {
		return fmt.Errorf("onebit: Adam: %w: made by rank %d, this is rank %d (error buffers are per rank: load this rank's own checkpoint, or onebit.Regroup of every rank's, which keeps the error feedback; ck.ResetErrors() is the lossy way, the error feedback restarting from zero)",
			optim.ErrIncompatibleCheckpoint, ck.Rank, a.f.Rank())
	}
	if a.sh != nil {
		if err := a.sh.check(ck, a.f.World()); err != nil {
			return fmt.Errorf("onebit: Adam: %w", err)
		}
	} else if err := a.bkt.check(ck); err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	c2, err := ck.Float(FloatFrozenBiasCorrection2)
	if err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	if float64(float32(c2)) != c2 || math.IsNaN(c2) || math.IsInf(c2, 0) {
		return fmt.Errorf("onebit: Adam: %w: frozen bias correction %v is not a finite float32", optim.ErrIncompatibleCheckpoint, c2)
	}
	var commit func()
	if a.cp != nil {
		if commit, err = a.loadCompact(ck, fs.Stage); err != nil {
			return fmt.Errorf("onebit: Adam: %w", err)
		}
	}
	rs := ck.Restore()
	for i, p := range a.params {
		rs.Tensor(optim.ParamTensorName(p.Name), p.Data())
		if a.m != nil {
			rs.Tensor(optim.ExpAvgPrefix+p.Name, a.m[i])
		}
		if a.v != nil {
			rs.Tensor(optim.ExpAvgSqPrefix+p.Name, a.v[i])
		}
	}
	var finish func(compressing bool)
	switch {
	case a.sh != nil:
		finish = a.sh.restore(ck, rs)
	case a.cp != nil:
		for k, st := range a.bkt.states {
			if _, sn := a.bkt.errorNames(k); !ck.ErrorsReset {
				rs.Tensor(sn, st.ServerError)
			}
		}
	default:
		a.bkt.restore(ck, rs)
	}
	if err := rs.Apply(); err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	if finish != nil {
		finish(fs.Stage == optim.StageCompression)
	}
	if commit != nil {
		commit()
	}
	if ck.ErrorsReset {
		if a.cp != nil {
			for _, st := range a.bkt.states {
				st.ServerError.Reset()
			}
		} else {
			a.bkt.reset()
		}
		warnErrorsReset(a.f.Logger(), ck, a.f.World(), a.f.Rank())
	}
	a.c2 = float32(c2)
	a.f.Restore(fs)
	a.late.stale = true
	return nil
}

// loadCompact reads the momentum and worker errors of ck for StateCompact
// and returns what takes them (see compact.load); nothing changes before.
func (a *Adam) loadCompact(ck *optim.Checkpoint, stage optim.Stage) (func(), error) {
	m := make([][]float32, len(a.params))
	for i, p := range a.params {
		var err error
		if m[i], err = ck.TensorData(optim.ExpAvgPrefix+p.Name, p.Numel()); err != nil {
			return nil, err
		}
	}
	we := make([][]float32, len(a.bkt.states))
	for k, st := range a.bkt.states {
		if ck.ErrorsReset {
			continue
		}
		var err error
		wn, _ := a.bkt.errorNames(k)
		if we[k], err = ck.TensorData(wn, len(st.WorkerError)); err != nil {
			return nil, err
		}
	}
	return a.cp.load(m, we, stage == optim.StageCompression, ck.Ints[IntForeignMomentum] != 0)
}

// Close releases the communicators that ReduceTwoLevel averaging split off
// the group (none in the other modes); see optim.Optimizer.Close: not a
// collective, idempotent, every rank calls it, Step fails after it.
func (a *Adam) Close() error {
	a.f.Close()
	if a.avg == nil {
		return nil
	}
	return a.avg.Close()
}
