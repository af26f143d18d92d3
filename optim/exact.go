package optim

import (
	"context"
	"fmt"

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
	// IntMomentsBF16 is 1 in the checkpoint of an Adam whose moments are
	// in bfloat16 (AdamConfig.MomentsBF16); a checkpoint without it was
	// made with float32 moments. Either way the checkpoint holds the
	// moments as float32 tensors (bfloat16 values widened exactly).
	IntMomentsBF16 = "moments_bf16"
)

// exact is the engine of Adam and Lamb: exact gradient averaging, then one
// update kernel per parameter.
type exact struct {
	*Frame
	algorithm string
	params    []*Param
	adam      AdamConfig
	lamb      LambConfig // bounds used when algorithm is AlgorithmLamb

	m, v    [][]float32
	m16     [][]uint16 // with MomentsBF16: the moments, m and v nil
	v16     [][]uint16
	scratch []float32 // LAMB's update, as long as the largest parameter
	avg     *GradAverager
}

// newExact returns the engine of the optimizer called name ("Adam" or
// "LAMB"); its errors carry the package prefix once.
func newExact(name, algorithm string, c comm.Comm, params []*Param, adam AdamConfig, opts []Option) (*exact, error) {
	if err := checkParams(params); err != nil {
		return nil, fmt.Errorf("optim: %s: %w", name, err)
	}
	o := ApplyOptions(opts)
	e := &exact{
		algorithm: algorithm,
		params:    append([]*Param(nil), params...),
		adam:      adam,
	}
	// sizes are the buffers Step's size check compares with the
	// parameters: the float32 moments, or with bfloat16 moments the
	// values' slices as they are now (only their lengths are read).
	sizes := make([][]float32, len(params))
	if adam.MomentsBF16 {
		e.m16, e.v16 = make([][]uint16, len(params)), make([][]uint16, len(params))
	} else {
		e.m, e.v = make([][]float32, len(params)), make([][]float32, len(params))
	}
	largest := 0
	for i, p := range params {
		if adam.MomentsBF16 {
			e.m16[i], e.v16[i] = make([]uint16, p.Numel()), make([]uint16, p.Numel())
			sizes[i] = p.Data()
		} else {
			e.m[i], e.v[i] = make([]float32, p.Numel()), make([]float32, p.Numel())
			sizes[i] = e.m[i]
		}
		largest = max(largest, p.Numel())
	}
	if algorithm == AlgorithmLamb {
		e.scratch = make([]float32, largest)
	}
	avg, err := NewGradAverager(c, e.params, adam.Reduce, adam.RanksPerNode)
	if err != nil {
		return nil, err
	}
	e.avg = avg
	e.Frame = NewFrame(FrameConfig{
		Name: "optim: " + name, Algorithm: algorithm, Comm: c, Params: e.params, Sizes: sizes,
		LR: adam.LR, Stage: StageExact, Logger: o.Logger, Averager: avg,
		Hypers: AdamHypers(adam),
	})
	e.Handle(StageExact, e.update)
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

// checkSizes returns an error (without the package prefix: the Frame adds
// its name) when the value or gradient of params[i] does not hold
// len(bufs[i]) elements: the caller replaced a tensor after the optimizer
// sized its buffers from it.
func checkSizes(params []*Param, bufs [][]float32) error {
	for i, p := range params {
		if n := len(bufs[i]); len(p.Data()) != n || len(p.GradData()) != n {
			return fmt.Errorf("parameter %q: value or gradient no longer holds the %d elements it had at construction", p.Name, n)
		}
	}
	return nil
}

// close releases the averager's communicators; step fails afterwards.
func (e *exact) close() error {
	e.Frame.Close()
	return e.avg.Close()
}

// update is the exact stage's StepFunc.
func (e *exact) update(ctx context.Context, t int64, lr float32) error {
	if err := e.avg.Average(ctx); err != nil {
		return samePackage{err}
	}
	cfg := e.adam
	c1, c2 := float32(1), float32(1)
	if cfg.BiasCorrection {
		c1, c2 = BiasCorrection(cfg.Beta1, t), BiasCorrection(cfg.Beta2, t)
	}
	for i, p := range e.params {
		if e.m16 != nil {
			adamStepBF16(p.Data(), e.m16[i], e.v16[i], p.GradData(), cfg.Beta1, cfg.Beta2, lr, cfg.WeightDecay, c1, c2, cfg.Eps, roundingSeed(t, i))
			continue
		}
		if e.algorithm != AlgorithmLamb {
			AdamStep(p.Data(), e.m[i], e.v[i], p.GradData(), cfg.Beta1, cfg.Beta2, lr, cfg.WeightDecay, c1, c2, cfg.Eps)
			continue
		}
		AdamMoments(e.m[i], e.v[i], p.GradData(), cfg.Beta1, cfg.Beta2)
		u := e.scratch[:len(e.m[i])]
		pSq, uSq := AdamDirection(u, p.Data(), e.m[i], e.v[i], cfg.WeightDecay, c1, c2, cfg.Eps)
		coeff := LambCoeff(pSq, uSq, e.lamb.MinCoeff, e.lamb.MaxCoeff)
		Descend(p.Data(), u, lr*coeff)
	}
	return nil
}

func (e *exact) State() (*Checkpoint, error) {
	ck := e.Checkpoint()
	if e.m16 != nil {
		ck.Ints[IntMomentsBF16] = 1
	}
	for i, p := range e.params {
		shape := p.Shape()
		ck.AddTensor(ParamTensorName(p.Name), shape, p.Data())
		if e.m16 != nil {
			ck.Tensors = append(ck.Tensors,
				Tensor{Name: ExpAvgPrefix + p.Name, Shape: shape, Data: widenedBF16(e.m16[i])},
				Tensor{Name: ExpAvgSqPrefix + p.Name, Shape: shape, Data: widenedBF16(e.v16[i])})
			continue
		}
		ck.AddTensor(ExpAvgPrefix+p.Name, shape, e.m[i])
		ck.AddTensor(ExpAvgSqPrefix+p.Name, shape, e.v[i])
	}
	return ck, nil
}

func (e *exact) Load(ck *Checkpoint) error {
	st, err := e.CheckLoad(ck, StageExact)
	if err != nil {
		return err
	}
	if err := checkMomentsBF16(ck, e.m16 != nil); err != nil {
		return err
	}
	rs := ck.Restore()
	for i, p := range e.params {
		rs.Tensor(ParamTensorName(p.Name), p.Data())
		if e.m16 != nil {
			rs.tensorBF16(ExpAvgPrefix+p.Name, e.m16[i])
			rs.tensorBF16(ExpAvgSqPrefix+p.Name, e.v16[i])
			continue
		}
		rs.Tensor(ExpAvgPrefix+p.Name, e.m[i])
		rs.Tensor(ExpAvgSqPrefix+p.Name, e.v[i])
	}
	if err := rs.Apply(); err != nil {
		return err
	}
	e.Restore(st)
	return nil
}

// loadCounters reads the step counters every optimizer stores (IntStep,
// IntSteps, IntSkipped) and checks that they are consistent: non-negative,
// with step + skipped == steps.
func loadCounters(ck *Checkpoint) (step, steps, skipped int64, err error) {
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
