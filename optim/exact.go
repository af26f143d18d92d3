package optim

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
)

// The checkpoint algorithm names of lowbit's optimizers.
const (
	AlgorithmAdam        = "adam"         // optim.Adam
	AlgorithmLamb        = "lamb"         // optim.Lamb
	AlgorithmOnebitAdam  = "onebit-adam"  // onebit.Adam
	AlgorithmOnebitLamb  = "onebit-lamb"  // onebit.Lamb
	AlgorithmZeroOneAdam = "zeroone-adam" // onebit.ZeroOneAdam
)

// Checkpoint names of the per-parameter moments (followed by the parameter
// name) and of the step counters, shared by every optimizer.
const (
	ExpAvgPrefix   = "exp_avg/"    // first moment m
	ExpAvgSqPrefix = "exp_avg_sq/" // second moment v
	IntStep        = "step"        // steps applied (the t of bias correction)
	IntSteps       = "steps"       // Stats.Steps
	IntSkipped     = "skipped"     // Stats.Skipped
)

// exact is the engine of Adam and Lamb: exact gradient averaging, then one
// update kernel per parameter.
type exact struct {
	algorithm string
	c         comm.Comm
	world     int
	rank      int
	params    []*Param
	adam      AdamConfig
	lamb      LambConfig // bounds used when algorithm is AlgorithmLamb
	log       *zap.Logger

	m, v    [][]float32
	scratch []float32 // LAMB's update, as long as the largest parameter
	step    int64     // steps applied
	stats   Stats
	guard   FiniteGuard
}

func newExact(algorithm string, c comm.Comm, params []*Param, adam AdamConfig, opts []Option) (*exact, error) {
	if err := CheckParams(params); err != nil {
		return nil, err
	}
	o := ApplyOptions(opts)
	e := &exact{
		algorithm: algorithm,
		c:         c,
		world:     1,
		params:    append([]*Param(nil), params...),
		adam:      adam,
		log:       o.Logger,
		m:         make([][]float32, len(params)),
		v:         make([][]float32, len(params)),
	}
	if c != nil {
		e.world, e.rank = c.Size(), c.Rank()
	}
	e.stats.Stage = StageExact
	largest := 0
	for i, p := range params {
		e.m[i] = make([]float32, p.Numel())
		e.v[i] = make([]float32, p.Numel())
		largest = max(largest, p.Numel())
	}
	if algorithm == AlgorithmLamb {
		e.scratch = make([]float32, largest)
	}
	return e, nil
}

// CommBytes returns the bytes c has sent so far (0 for a nil c); optimizers
// take the difference around a step for Stats.BytesSent.
func CommBytes(c comm.Comm) int64 {
	if c == nil {
		return 0
	}
	return c.Stats().Total().BytesSent
}

// CheckSizes returns an error when the value or gradient of params[i] does
// not hold len(bufs[i]) elements: the caller replaced a tensor after the
// optimizer sized its buffers from it.
func CheckSizes(params []*Param, bufs [][]float32) error {
	for i, p := range params {
		if n := len(bufs[i]); len(p.Data()) != n || len(p.GradData()) != n {
			return fmt.Errorf("optim: parameter %q: value or gradient no longer holds the %d elements it had at construction", p.Name, n)
		}
	}
	return nil
}

func (e *exact) Step(ctx context.Context) error {
	before := CommBytes(e.c)
	if err := CheckSizes(e.params, e.m); err != nil {
		return err
	}
	ok, err := e.guard.Check(ctx, e.c, e.params)
	if err != nil {
		return err
	}
	if !ok {
		e.stats.Steps++
		e.stats.Skipped++
		e.log.Warn("skipping step: non-finite gradient on some rank",
			zap.String("algorithm", e.algorithm), zap.Int64("step", e.step+1), zap.Int64("skipped", e.stats.Skipped))
		e.account(before)
		return nil
	}
	if err := AverageGrads(ctx, e.c, e.params); err != nil {
		return err
	}
	t := e.step + 1
	cfg := e.adam
	c1, c2 := float32(1), float32(1)
	if cfg.BiasCorrection {
		c1, c2 = BiasCorrection(cfg.Beta1, t), BiasCorrection(cfg.Beta2, t)
	}
	for i, p := range e.params {
		if e.algorithm != AlgorithmLamb {
			AdamStep(p.Data(), e.m[i], e.v[i], p.GradData(), cfg.Beta1, cfg.Beta2, cfg.LR, cfg.WeightDecay, c1, c2, cfg.Eps)
			continue
		}
		AdamMoments(e.m[i], e.v[i], p.GradData(), cfg.Beta1, cfg.Beta2)
		{
			u := e.scratch[:len(e.m[i])]
			pSq, uSq := AdamDirection(u, p.Data(), e.m[i], e.v[i], cfg.WeightDecay, c1, c2, cfg.Eps)
			coeff := LambCoeff(pSq, uSq, e.lamb.MinCoeff, e.lamb.MaxCoeff)
			Descend(p.Data(), u, cfg.LR*coeff)
		}
	}
	e.step = t
	e.stats.Steps++
	e.account(before)
	return nil
}

func (e *exact) account(before int64) {
	e.stats.LastStepBytes = CommBytes(e.c) - before
	e.stats.BytesSent += e.stats.LastStepBytes
}

func (e *exact) State() (*Checkpoint, error) {
	ck := &Checkpoint{
		Algorithm: e.algorithm,
		World:     e.world,
		Rank:      e.rank,
		Stage:     StageExact,
		Ints:      map[string]int64{IntStep: e.step, IntSteps: e.stats.Steps, IntSkipped: e.stats.Skipped},
	}
	for i, p := range e.params {
		shape := p.Shape()
		ck.AddTensor(ParamTensorName(p.Name), shape, p.Data())
		ck.AddTensor(ExpAvgPrefix+p.Name, shape, e.m[i])
		ck.AddTensor(ExpAvgSqPrefix+p.Name, shape, e.v[i])
	}
	return ck, nil
}

func (e *exact) Load(ck *Checkpoint) error {
	if err := ck.CheckCompatible(e.algorithm, e.world, e.params); err != nil {
		return err
	}
	if ck.Stage != StageExact {
		return fmt.Errorf("%w: stage %q, an exact optimizer is always in stage %q", ErrIncompatibleCheckpoint, ck.Stage, StageExact)
	}
	step, steps, skipped, err := LoadCounters(ck)
	if err != nil {
		return err
	}
	rs := ck.Restore()
	for i, p := range e.params {
		rs.Tensor(ParamTensorName(p.Name), p.Data())
		rs.Tensor(ExpAvgPrefix+p.Name, e.m[i])
		rs.Tensor(ExpAvgSqPrefix+p.Name, e.v[i])
	}
	if err := rs.Apply(); err != nil {
		return err
	}
	e.step = step
	e.stats.Steps, e.stats.Skipped = steps, skipped
	e.log.Info("loaded checkpoint", zap.String("algorithm", e.algorithm), zap.Int64("step", step))
	return nil
}

// LoadCounters reads the step counters every optimizer stores (IntStep,
// IntSteps, IntSkipped) and checks that they are consistent: non-negative,
// with step + skipped == steps.
func LoadCounters(ck *Checkpoint) (step, steps, skipped int64, err error) {
	if step, err = ck.Int(IntStep); err != nil {
		return
	}
	if steps, err = ck.Int(IntSteps); err != nil {
		return
	}
	if skipped, err = ck.Int(IntSkipped); err != nil {
		return
	}
	if step < 0 || skipped < 0 || step+skipped != steps {
		return 0, 0, 0, fmt.Errorf("%w: inconsistent counters: step %d, skipped %d, steps %d", ErrIncompatibleCheckpoint, step, skipped, steps)
	}
	return step, steps, skipped, nil
}
