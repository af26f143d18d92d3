package optim

import (
	"context"

	"github.com/lowbit-ml/lowbit/comm"
)

// Adam is exact data-parallel Adam, AdamW when the weight decay is not
// zero: every step averages the gradients over the ranks with an exact
// allreduce, then on every rank
//
//	m = beta1*m + (1-beta1)*g
//	v = beta2*v + (1-beta2)*g^2
//	p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd*p)
//
// with m_hat = m/(1-beta1^t), v_hat = v/(1-beta2^t) when bias correction is
// on (see AdamUpdate for the exact float32 evaluation). It is the baseline
// the 1-bit optimizers are measured against.
//
// Step overwrites the gradients with their average. A step in which some
// rank's gradient is not finite is skipped on every rank. After an error
// from the communicator the state is undefined: load a checkpoint.
type Adam struct {
	e *exact
}

var (
	_ Optimizer   = (*Adam)(nil)
	_ LRSetter    = (*Adam)(nil)
	_ FlagCarrier = (*Adam)(nil)
)

// NewAdam returns Adam over params, averaging gradients over c (nil for a
// single process). Every rank of c calls it together; it does not
// communicate (ctx is there for the constructors' common form, see the
// package doc). An invalid cfg is refused with cfg.Validate's error. It
// allocates the moments, two float32 buffers per parameter (two bfloat16
// ones with cfg.MomentsBF16, see the package doc); in the fp16, bf16 and two-level reduction modes the first
// Step allocates the flat averaging buffers (and builds the layout, a
// collective); later steps allocate nothing.
func NewAdam(ctx context.Context, c comm.Comm, params []*Param, cfg AdamConfig, opts ...Option) (*Adam, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	e, err := newExact("Adam", AlgorithmAdam, c, params, cfg, opts)
	if err != nil {
		return nil, err
	}
	return &Adam{e: e}, nil
}

// Step applies one update; see Optimizer.
func (a *Adam) Step(ctx context.Context) error { return a.e.Step(ctx) }

// Params returns the parameters in construction order.
func (a *Adam) Params() []*Param { return a.e.params }

// Stats reports progress and traffic; Stage is always StageExact.
func (a *Adam) Stats() Stats { return a.e.Stats() }

// State returns a checkpoint holding the parameters, both moments and the
// step counters. Every rank's checkpoint of an exact optimizer is the same
// apart from its Rank field.
func (a *Adam) State() (*Checkpoint, error) { return a.e.State() }

// Load restores a checkpoint made by Adam.State over the same parameters,
// any rank's, on a group of any size (see Replicated); anything else is
// refused and changes nothing.
func (a *Adam) Load(ck *Checkpoint) error { return a.e.Load(ck) }

// SetLR fixes the learning rate of the following steps, replacing any
// schedule; see LRSetter.
func (a *Adam) SetLR(lr float32) error { return a.e.SetLR(lr) }

// CarryFlags makes every following Step carry sf in its per-step
// agreement; see FlagCarrier.
func (a *Adam) CarryFlags(sf *StepFlags) error { return a.e.CarryFlags(sf) }

// SetSchedule makes s choose the learning rate of every following step
// (nil: back to the fixed one); see LRSetter.
func (a *Adam) SetSchedule(s Schedule) error { return a.e.SetSchedule(s) }

// LR returns the learning rate of the next step.
func (a *Adam) LR() float32 { return a.e.LR() }

// Close releases the communicators that ReduceTwoLevel averaging split off
// the group (none in the other modes); see Optimizer.Close: not a
// collective, idempotent, every rank calls it, Step fails after it.
func (a *Adam) Close() error { return a.e.close() }
