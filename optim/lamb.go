package optim

import (
	"context"

	"github.com/lowbit-ml/lowbit/comm"
)

// Lamb is exact data-parallel LAMB: every step averages the gradients over
// the ranks with an exact allreduce, updates the moments as Adam does, and
// scales each parameter's Adam/AdamW update by its trust ratio:
//
//	update = m_hat / (sqrt(v_hat) + eps) + wd*p
//	coeff  = ||p|| / ||update||, clipped to [MinCoeff, MaxCoeff], 1 when either norm is 0
//	p     -= lr * coeff * update
//
// Bias correction follows the config. Norms are accumulated in float64 (see
// AdamDirection and LambCoeff).
//
// Step overwrites the gradients with their average. A step in which some
// rank's gradient is not finite is skipped on every rank. After an error
// from the communicator the state is undefined: load a checkpoint.
type Lamb struct {
	e *exact
}

var (
	_ Optimizer   = (*Lamb)(nil)
	_ LRSetter    = (*Lamb)(nil)
	_ FlagCarrier = (*Lamb)(nil)
)

// NewLamb returns LAMB over params, averaging gradients over c (nil for a
// single process). Every rank of c calls it together; it does not
// communicate (ctx: see the package doc). An invalid cfg is refused with
// cfg.Validate's error. It allocates both moments and one scratch buffer as
// long as the largest parameter; the first Step may allocate the
// averaging buffers of cfg.Reduce (see NewAdam); later steps allocate
// nothing.
func NewLamb(ctx context.Context, c comm.Comm, params []*Param, cfg LambConfig, opts ...Option) (*Lamb, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	e, err := newExact("LAMB", AlgorithmLamb, c, params, cfg.AdamConfig, opts)
	if err != nil {
		return nil, err
	}
	e.lamb = cfg
	e.hypers = LambHypers(cfg) // the frame's, replacing newExact's AdamHypers
	return &Lamb{e: e}, nil
}

// Step applies one update; see Optimizer.
func (l *Lamb) Step(ctx context.Context) error { return l.e.Step(ctx) }

// Params returns the parameters in construction order.
func (l *Lamb) Params() []*Param { return l.e.params }

// Stats reports progress and traffic; Stage is always StageExact.
func (l *Lamb) Stats() Stats { return l.e.Stats() }

// State returns a checkpoint holding the parameters, both moments and the
// step counters.
func (l *Lamb) State() (*Checkpoint, error) { return l.e.State() }

// Load restores a checkpoint made by Lamb.State over the same parameters,
// any rank's, on a group of any size (see Replicated); anything else is
// refused and changes nothing.
func (l *Lamb) Load(ck *Checkpoint) error { return l.e.Load(ck) }

// SetLR fixes the learning rate of the following steps, replacing any
// schedule; see LRSetter.
func (l *Lamb) SetLR(lr float32) error { return l.e.SetLR(lr) }

// CarryFlags makes every following Step carry sf in its per-step
// agreement; see FlagCarrier.
func (l *Lamb) CarryFlags(sf *StepFlags) error { return l.e.CarryFlags(sf) }

// SetSchedule makes s choose the learning rate of every following step
// (nil: back to the fixed one); see LRSetter.
func (l *Lamb) SetSchedule(s Schedule) error { return l.e.SetSchedule(s) }

// LR returns the learning rate of the next step.
func (l *Lamb) LR() float32 { return l.e.LR() }

// Close releases the communicators that ReduceTwoLevel averaging split off
// the group (none in the other modes); see Optimizer.Close: not a
// collective, idempotent, every rank calls it, Step fails after it.
func (l *Lamb) Close() error { return l.e.close() }
