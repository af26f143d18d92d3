// Package optim holds what every lowbit optimizer shares: the trainable
// parameter type, the Optimizer interface a training loop calls once per
// step, the exact baselines (Adam/AdamW and LAMB, whose gradients are
// averaged with an exact allreduce), exact Muon (momentum orthogonalized by
// Newton-Schulz for the matrices, an auxiliary AdamW for the other
// parameters, in one Step: NewMuon, docs/muon.md), and the checkpoint
// format.
//
// Checkpoints are per rank (SaveFile streams them to disk atomically,
// LoadFile refuses a damaged file, Load refuses another algorithm, world
// size, rank or shapes, and another value of any hyperparameter that
// decides the next step: see Hyper). The exact optimizers' state is the
// same on every rank, so their checkpoints load on a group of any size
// (Replicated). RankChange says how every other optimizer's moves to a
// group of another size, losslessly (onebit.Regroup, zero.Consolidate,
// outer.Regroup) or, with Checkpoint.ResetErrors, at the price of the
// error feedback: the copy it returns loads on any group and restarts the
// error feedback from zero (IsErrorBuffer names the buffers it drops).
//
// The learning rate of every optimizer can be changed between steps
// (LRSetter: SetLR, or SetSchedule with a Schedule such as LinearWarmup,
// CosineDecay or StepDecay); checkpoints keep it. The exact stages average
// gradients in a ReduceMode chosen in the config: exact float32 (the
// default), fp16 or bf16 on the wire, or a two-level (node-aware)
// allreduce; see GradAverager.
//
// # Compact moments
//
// AdamConfig.MomentsBF16 keeps Adam's m and v in bfloat16: 4 bytes per
// parameter instead of 8 (what outer.NewAdam's inner AdamW needs to stay
// within 12 bytes per parameter, docs/outer.md, "Memory"). A step widens
// the moments to float32, updates them as the float32 mode does and
// rounds them back stochastically, then takes the update from the rounded
// moments. Rounding to nearest would not do: at beta2 0.999, v moves by
// 0.1% of itself per step, under half a bfloat16 spacing (2^-9 to 2^-8 of
// v), so a v that should fall never does (measured: v held at 0.25 where
// the recursion falls to 0.062). Stochastic rounding is unbiased, so the
// moments follow their recursions on average; it adds noise of about 5%
// of v (0.5% of m) per element. The random bits are a hash of the step
// counter, the parameter's index and the element's index: nothing is
// stored, nothing is allocated, every rank of a data-parallel Adam rounds
// alike (ranks stay bit-identical), and a run resumed from a checkpoint
// continues bit for bit. Checkpoints hold the moments as float32 tensors
// with bfloat16 values and record IntMomentsBF16; a checkpoint of the
// other mode is refused (not converted), as onebit's and outer's bfloat16
// options refuse theirs. Measured on the MLP of outer's convergence test
// (4 ranks, 5 seeds; data-parallel Adam and the outer optimizer's fp32
// and 1-bit codecs): the loss with bfloat16 moments is within 0.2% of
// float32 moments' at 600 steps (worst seed) and within 2.6% at 1800;
// not measured on a language model yet, so the default is off. LAMB, and
// the optimizers of onebit and optim/zero, refuse the setting.
//
// Conventions shared by every optimizer of lowbit (optim, onebit,
// optim/zero):
//
//   - Constructors: New<Optimizer>(ctx, c, params, cfg, opts...). Every
//     rank of c calls it together. The rule for contexts in lowbit is that
//     a constructor takes a context.Context first exactly when every rank
//     must call it together (it may communicate): every optimizer
//     constructor (zero.NewAdam agrees on its arguments with one
//     all-gather; the others do not communicate today but keep the same
//     form), comm.NewLayout, quant.NewQGZ and quant.NewCoalesced.
//     Constructors that never communicate (NewGradAverager,
//     quant.NewTwoLevel, onebit.NewState, ...) take none.
//   - Configs: every config has a Validate method that checks every
//     field and returns a *ConfigError; the constructor returns exactly
//     that error for an invalid config and checks nothing about the
//     config that Validate does not.
//   - Buckets: one field, BucketBytes, in bytes; see DefaultBucketBytes.
//   - Close: part of Optimizer; every holder of an optimizer calls it.
//   - Errors carry each package's prefix once ("onebit: 1-bit LAMB step
//     3: momentum: phase 1 all-to-all: local: ...").
//
// The 1-bit optimizers live in package onebit and implement the same
// interface. They reuse what this package exports for them: the step
// frame (Frame: size check, learning rate, skip on non-finite gradients,
// stage dispatch, traffic and counters, the shared part of checkpoints),
// which every optimizer, present and future, runs its steps in; the update
// kernels (AdamStep, AdamMoments, Momentum, AdamUpdate, AdamDirection,
// LambCoeff, Descend, Mul, SumSquares, BiasCorrection), which round every
// product to float32 so that results are bit-identical across ranks and
// architectures; the step helpers (FiniteGuard and AllFinite for the
// skip-on-non-finite agreement, GradAverager and AverageGrads,
// CheckParams, CommBytes); and the checkpoint format
// (Checkpoint, SaveFile, LoadFile, CheckCompatible and the
// shared tensor names).
package optim

import (
	"context"
	"errors"
	"fmt"

	"gorgonia.org/tensor"
)

// Param is one trainable tensor: its value and the gradient the training
// loop writes before each Step. Both are float32 dense tensors of the same
// shape; Data and GradData give direct access to their backing slices.
type Param struct {
	Name  string
	Value *tensor.Dense
	Grad  *tensor.Dense
}

// NewParam returns a parameter of the given shape with value and gradient
// zeroed.
func NewParam(name string, shape ...int) *Param {
	return &Param{
		Name:  name,
		Value: tensor.New(tensor.WithShape(shape...), tensor.Of(tensor.Float32)),
		Grad:  tensor.New(tensor.WithShape(shape...), tensor.Of(tensor.Float32)),
	}
}

// NewParamFrom returns a parameter whose value is a copy of value, shaped
// by shape (the product of shape must be len(value)).
func NewParamFrom(name string, value []float32, shape ...int) (*Param, error) {
	n := 1
	for _, d := range shape {
		n *= d
	}
	if n != len(value) {
		return nil, fmt.Errorf("optim: parameter %q: shape %v holds %d elements, value has %d", name, shape, n, len(value))
	}
	p := NewParam(name, shape...)
	copy(p.Data(), value)
	return p, nil
}

// Data is the backing slice of the value; nil when the value is missing or
// not float32. It does not allocate.
func (p *Param) Data() []float32 { return float32s(p.Value) }

// GradData is the backing slice of the gradient; nil when the gradient is
// missing or not float32. It does not allocate.
func (p *Param) GradData() []float32 { return float32s(p.Grad) }

func float32s(t *tensor.Dense) []float32 {
	if t == nil || t.Dtype() != tensor.Float32 {
		return nil
	}
	return t.Float32s()
}

// CheckParams reports the first problem that makes params unusable by an
// optimizer: a nil parameter, a missing or non-float32 value or gradient,
// a gradient shaped unlike its value, a backing slice that does not hold
// exactly the tensor's elements (a view), or a name used twice
// (checkpoints find buffers by parameter name).
func CheckParams(params []*Param) error {
	if err := checkParams(params); err != nil {
		return fmt.Errorf("optim: %w", err)
	}
	return nil
}

// checkParams is CheckParams without the package prefix, for callers in
// this package that add their own.
func checkParams(params []*Param) error {
	seen := make(map[string]bool, len(params))
	for i, p := range params {
		if p == nil {
			return fmt.Errorf("parameter %d is nil", i)
		}
		if p.Value == nil || p.Grad == nil {
			return fmt.Errorf("parameter %q: value or gradient is nil", p.Name)
		}
		if p.Value.Dtype() != tensor.Float32 || p.Grad.Dtype() != tensor.Float32 {
			return fmt.Errorf("parameter %q: value is %v and gradient %v, want float32", p.Name, p.Value.Dtype(), p.Grad.Dtype())
		}
		if !p.Value.Shape().Eq(p.Grad.Shape()) {
			return fmt.Errorf("parameter %q: value shape %v, gradient shape %v", p.Name, p.Value.Shape(), p.Grad.Shape())
		}
		n := p.Numel()
		if len(p.Data()) != n || len(p.GradData()) != n {
			return fmt.Errorf("parameter %q: %d elements but backing slices of %d and %d (views are not supported)",
				p.Name, n, len(p.Data()), len(p.GradData()))
		}
		if seen[p.Name] {
			return fmt.Errorf("parameter name %q is used twice", p.Name)
		}
		seen[p.Name] = true
	}
	return nil
}

// Numel is the number of elements.
func (p *Param) Numel() int { return p.Value.Shape().TotalSize() }

// Shape is the value's shape.
func (p *Param) Shape() []int { return []int(p.Value.Shape().Clone()) }

// Stage names where an optimizer is in its schedule.
type Stage string

// The stages.
const (
	StageExact       Stage = "exact"       // an exact optimizer: every step averages gradients exactly
	StageWarmup      Stage = "warmup"      // 1-bit Adam/LAMB before freeze_step
	StageCompression Stage = "compression" // 1-bit Adam/LAMB after freeze_step
	StagePhaseA      Stage = "phase-a"     // 0/1 Adam up to var_freeze_step
	StagePhaseB      Stage = "phase-b"     // 0/1 Adam after var_freeze_step
)

// Stats is what an optimizer reports about its run so far.
type Stats struct {
	Steps         int64 // steps taken, skipped ones included
	Skipped       int64 // steps skipped because some rank's gradient was not finite
	Stage         Stage // the stage the next step runs in
	BytesSent     int64 // bytes this rank put on the wire in Step, all steps
	LastStepBytes int64 // bytes this rank put on the wire in the last Step
}

// ErrClosed is returned (wrapped) by the Step of an optimizer after its
// Close.
var ErrClosed = errors.New("optim: step after Close")

// Optimizer updates a fixed list of parameters from their gradients. Every
// rank of the communicator calls Step once per training step, after writing
// its local gradients; on return the parameters are identical on every rank,
// except between the synchronizations of 0/1 Adam's local steps (phase B),
// where each rank runs ahead on its own gradients by design.
type Optimizer interface {
	// Step applies one update. A step in which any rank's gradient holds a
	// NaN or Inf is skipped on every rank (counted in Stats.Skipped) and
	// changes nothing.
	Step(ctx context.Context) error
	// Params returns the parameters, in the order given at construction.
	Params() []*Param
	// Stats reports progress and traffic.
	Stats() Stats
	// State returns a checkpoint of everything that decides the next step
	// on this rank. It shares no memory with the optimizer.
	State() (*Checkpoint, error)
	// Load restores a checkpoint made by State of an optimizer of the same
	// algorithm, world size and parameter shapes; it refuses anything else
	// with an error and leaves the optimizer unchanged. The learning rate
	// is part of the state (see Frame.CheckLoad): a checkpoint made with a
	// schedule loads only with the same schedule set, and a checkpoint
	// that predates the learning-rate entries leaves the optimizer's own
	// learning rate and schedule as they are.
	Load(*Checkpoint) error
	// Close releases what the optimizer made for itself: communicators
	// split off the group (the node layout of two-level or quantized
	// reductions, and with comm/mpi their watchdogs). It never closes the
	// communicator the optimizer was given. Close is not a collective: it
	// does not communicate and never waits for other ranks, but every rank
	// must call it (once the optimizer is done with, typically deferred
	// after a successful construction). It is idempotent: a second call
	// does nothing and returns nil. A Step after Close returns an error;
	// Params, Stats and State still work.
	Close() error
}
