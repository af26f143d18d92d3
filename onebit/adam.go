package onebit

import (
	"context"
	"fmt"
	"math"

	"go.uber.org/zap"

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
	// momentum is communicated compressed. Default 100. 0 compresses from
	// the first step with v = 0 (rarely what you want).
	FreezeStep int
	// ExpAvgMask optionally maps a parameter name to a mask as long as the
	// parameter, multiplied into its momentum after every compressed
	// allreduce (to keep, say, padded embedding rows at zero). Parameters
	// without an entry are not masked. Default nil.
	ExpAvgMask map[string][]float32
}

// DefaultAdamConfig returns optim.DefaultAdamConfig with FreezeStep 100 and
// no mask.
func DefaultAdamConfig() AdamConfig {
	return AdamConfig{AdamConfig: optim.DefaultAdamConfig(), FreezeStep: 100}
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
// = 1), then the mask; then the same update as in warm-up,
// p -= lr * (m_hat/(sqrt(v_hat)+eps) + wd*p), with the frozen v_hat. There is
// no discarded first compression step.
//
// A step in which some rank's gradient is not finite is skipped on every
// rank (one tiny allreduce of a flag before anything changes). A checkpoint
// holds parameters, moments, counters, stage, the frozen bias correction and
// this rank's error buffers: resuming is bit-identical to not stopping.
// After an error from the communicator the state is undefined: load a
// checkpoint.
type Adam struct {
	c      comm.Comm
	world  int
	rank   int
	params []*optim.Param
	cfg    optim.AdamConfig
	freeze int64
	mask   [][]float32 // per parameter, nil when unmasked
	log    *zap.Logger

	m, v  [][]float32
	errs  []*State // per parameter when world > 1
	step  int64    // steps applied
	stage optim.Stage
	c2    float32 // frozen variance bias correction, valid in compression
	stats optim.Stats
	guard optim.FiniteGuard
}

var _ optim.Optimizer = (*Adam)(nil)

// NewAdam returns 1-bit Adam over params on the ranks of c (nil for a
// single process). It allocates both moments and, on more than one rank,
// one State of error buffers per parameter; Step allocates nothing.
func NewAdam(c comm.Comm, params []*optim.Param, cfg AdamConfig, opts ...optim.Option) (*Adam, error) {
	if err := cfg.AdamConfig.Validate(); err != nil {
		return nil, fmt.Errorf("onebit: Adam: %w", err)
	}
	if cfg.FreezeStep < 0 {
		return nil, fmt.Errorf("onebit: Adam: freeze step %d must be >= 0", cfg.FreezeStep)
	}
	if err := optim.CheckParams(params); err != nil {
		return nil, fmt.Errorf("onebit: Adam: %w", err)
	}
	o := optim.ApplyOptions(opts)
	a := &Adam{
		c:      c,
		world:  1,
		params: append([]*optim.Param(nil), params...),
		cfg:    cfg.AdamConfig,
		freeze: int64(cfg.FreezeStep),
		log:    o.Logger,
		m:      make([][]float32, len(params)),
		v:      make([][]float32, len(params)),
		stage:  optim.StageWarmup,
		c2:     1,
	}
	if c != nil {
		a.world, a.rank = c.Size(), c.Rank()
	}
	for i, p := range params {
		a.m[i] = make([]float32, p.Numel())
		a.v[i] = make([]float32, p.Numel())
	}
	masks, err := compileMasks(params, cfg.ExpAvgMask)
	if err != nil {
		return nil, fmt.Errorf("onebit: Adam: %w", err)
	}
	a.mask = masks
	if a.world > 1 {
		a.errs = make([]*State, len(params))
		for i := range params {
			st, err := NewState(len(a.m[i]), a.world)
			if err != nil {
				return nil, fmt.Errorf("onebit: Adam: %w", err)
			}
			a.errs[i] = st
		}
	}
	if a.freeze == 0 {
		a.enterCompression()
	}
	a.stats.Stage = a.stage
	return a, nil
}

// enterCompression freezes v's bias correction at the current step.
func (a *Adam) enterCompression() {
	a.stage = optim.StageCompression
	a.c2 = 1
	if a.cfg.BiasCorrection {
		a.c2 = optim.BiasCorrection(a.cfg.Beta2, a.step)
	}
}

// Step applies one update; see optim.Optimizer. In warm-up it overwrites
// the gradients with their average; in compression it leaves them alone.
func (a *Adam) Step(ctx context.Context) error {
	before := optim.CommBytes(a.c)
	if err := optim.CheckSizes(a.params, a.m); err != nil {
		return err
	}
	ok, err := a.guard.Check(ctx, a.c, a.params)
	if err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	if !ok {
		a.stats.Steps++
		a.stats.Skipped++
		a.log.Warn("skipping step: non-finite gradient on some rank",
			zap.String("algorithm", optim.AlgorithmOnebitAdam), zap.Int64("step", a.step+1), zap.Int64("skipped", a.stats.Skipped))
		a.account(before)
		return nil
	}
	t := a.step + 1
	cfg := a.cfg
	c1 := float32(1)
	if cfg.BiasCorrection {
		c1 = optim.BiasCorrection(cfg.Beta1, t)
	}
	if a.stage == optim.StageWarmup {
		if err := optim.AverageGrads(ctx, a.c, a.params); err != nil {
			return fmt.Errorf("onebit: Adam: %w", err)
		}
		c2 := float32(1)
		if cfg.BiasCorrection {
			c2 = optim.BiasCorrection(cfg.Beta2, t)
		}
		for i, p := range a.params {
			optim.AdamMoments(a.m[i], a.v[i], p.GradData(), cfg.Beta1, cfg.Beta2)
			optim.AdamUpdate(p.Data(), a.m[i], a.v[i], cfg.LR, cfg.WeightDecay, c1, c2, cfg.Eps)
		}
		a.step = t
		if t >= a.freeze {
			a.enterCompression()
			a.log.Info("1-bit Adam enters the compression stage", zap.Int64("after_step", t))
		}
	} else {
		for i, p := range a.params {
			optim.Momentum(a.m[i], p.GradData(), cfg.Beta1)
			if a.errs != nil {
				if err := AllReduce(ctx, a.c, a.m[i], a.errs[i]); err != nil {
					return fmt.Errorf("onebit: Adam: momentum of %q: %w", p.Name, err)
				}
			}
			if a.mask[i] != nil {
				optim.Mul(a.m[i], a.mask[i])
			}
			optim.AdamUpdate(p.Data(), a.m[i], a.v[i], cfg.LR, cfg.WeightDecay, c1, a.c2, cfg.Eps)
		}
		a.step = t
	}
	a.stats.Steps++
	a.account(before)
	return nil
}

func (a *Adam) account(before int64) {
	a.stats.Stage = a.stage
	a.stats.LastStepBytes = optim.CommBytes(a.c) - before
	a.stats.BytesSent += a.stats.LastStepBytes
}

// Params returns the parameters in construction order.
func (a *Adam) Params() []*optim.Param { return a.params }

// Stats reports progress and traffic; Stage is the stage the next step runs
// in (StageWarmup or StageCompression).
func (a *Adam) Stats() optim.Stats { return a.stats }

// Stage is the stage the next step runs in.
func (a *Adam) Stage() optim.Stage { return a.stage }

// State returns this rank's checkpoint: parameters, m, v, the step
// counters, the stage, the frozen bias correction of v and, on more than
// one rank, this rank's worker and server errors.
func (a *Adam) State() (*optim.Checkpoint, error) {
	ck := &optim.Checkpoint{
		Algorithm: optim.AlgorithmOnebitAdam,
		World:     a.world,
		Rank:      a.rank,
		Stage:     a.stage,
		Ints: map[string]int64{
			optim.IntStep: a.step, optim.IntSteps: a.stats.Steps, optim.IntSkipped: a.stats.Skipped,
		},
		Floats: map[string]float64{FloatFrozenBiasCorrection2: float64(a.c2)},
	}
	for i, p := range a.params {
		shape := p.Shape()
		ck.AddTensor(optim.ParamTensorName(p.Name), shape, p.Data())
		ck.AddTensor(optim.ExpAvgPrefix+p.Name, shape, a.m[i])
		ck.AddTensor(optim.ExpAvgSqPrefix+p.Name, shape, a.v[i])
		if a.errs != nil {
			st := a.errs[i]
			ck.AddTensor(WorkerErrorPrefix+p.Name, []int{len(st.WorkerError)}, st.WorkerError)
			ck.AddTensor(ServerErrorPrefix+p.Name, []int{len(st.ServerError)}, st.ServerError)
		}
	}
	return ck, nil
}

// Load restores a checkpoint made by State of a 1-bit Adam on the same
// world size, rank and parameters. Anything else is refused with an error
// wrapping optim.ErrIncompatibleCheckpoint, and the optimizer is left
// unchanged. A checkpoint whose error buffers were reset on request
// (optim.Checkpoint.ResetErrors) loads on any world size and rank: the
// error buffers start at zero, and Load logs a warning that says so.
func (a *Adam) Load(ck *optim.Checkpoint) error {
	if err := ck.CheckCompatible(optim.AlgorithmOnebitAdam, a.world, a.params); err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	if a.world > 1 && ck.Rank != a.rank && !ck.ErrorsReset {
		return fmt.Errorf("onebit: Adam: %w: made by rank %d, this is rank %d (error buffers are per rank)",
			optim.ErrIncompatibleCheckpoint, ck.Rank, a.rank)
	}
	if ck.Stage != optim.StageWarmup && ck.Stage != optim.StageCompression {
		return fmt.Errorf("onebit: Adam: %w: unknown stage %q", optim.ErrIncompatibleCheckpoint, ck.Stage)
	}
	step, steps, skipped, err := optim.LoadCounters(ck)
	if err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	c2, err := ck.Float(FloatFrozenBiasCorrection2)
	if err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	if float64(float32(c2)) != c2 || math.IsNaN(c2) || math.IsInf(c2, 0) {
		return fmt.Errorf("onebit: Adam: %w: frozen bias correction %v is not a finite float32", optim.ErrIncompatibleCheckpoint, c2)
	}
	rs := ck.Restore()
	for i, p := range a.params {
		rs.Tensor(optim.ParamTensorName(p.Name), p.Data())
		rs.Tensor(optim.ExpAvgPrefix+p.Name, a.m[i])
		rs.Tensor(optim.ExpAvgSqPrefix+p.Name, a.v[i])
		if a.errs != nil && !ck.ErrorsReset {
			rs.Tensor(WorkerErrorPrefix+p.Name, a.errs[i].WorkerError)
			rs.Tensor(ServerErrorPrefix+p.Name, a.errs[i].ServerError)
		}
	}
	if err := rs.Apply(); err != nil {
		return fmt.Errorf("onebit: Adam: %w", err)
	}
	if ck.ErrorsReset {
		for _, st := range a.errs {
			st.Reset()
		}
		warnErrorsReset(a.log, ck, a.world, a.rank)
	}
	a.step = step
	a.stage = ck.Stage
	a.c2 = float32(c2)
	a.stats.Steps, a.stats.Skipped = steps, skipped
	a.stats.Stage = a.stage
	a.log.Info("loaded checkpoint", zap.String("algorithm", optim.AlgorithmOnebitAdam),
		zap.Int64("step", step), zap.String("stage", string(a.stage)))
	return nil
}
