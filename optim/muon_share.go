package optim

import (
	"fmt"

	"go.uber.org/zap"
)

// What Muon shares with optimizers built on it outside this package
// (package onebit's 1-bit Muon): the selection of the Muon parameters,
// the matrix view, the recorded hyperparameters, the momentum check and
// the second parameter group's learning rate. Orthogonalizer
// (newtonschulz.go) and AgreeMuon (muon_agree.go) are the rest.

// SelectMuon returns, per parameter, whether Muon updates it under
// MuonConfig.Params = names (see there): the parameters named, or with
// nil names every parameter of rank 2 or more. A name that is not a
// parameter, a named parameter that is not a matrix, or a selection of no
// parameter is an error (without a package prefix).
func SelectMuon(params []*Param, names []string) ([]bool, error) { return selectMuon(params, names) }

// MatrixView is the matrix a parameter of the given shape (rank 2 or
// more) is viewed as by Muon: the first dimension by the product of the
// others.
func MatrixView(shape []int) (rows, cols int) { return matrixView(shape) }

// MuonHypers lists the hyperparameters of c that Muon records in its
// checkpoints and checks on Load (the learning rates and the reduction
// aside), muon[i] saying whether parameter i uses Muon.
func MuonHypers(c MuonConfig, muon []bool) []Hyper { return c.hypers(muon) }

// MomentumFinite reports whether the momentum mu*m + (1-mu)*g, and the
// Nesterov term (1-mu)*g + mu*m built from it, would be finite, rounded
// as Momentum rounds them, without changing m.
func MomentumFinite(m, g []float32, mu float32) bool { return momentumFinite(m, g, mu) }

// GroupLR is the learning rate of an optimizer's second parameter group
// (Muon's auxiliary AdamW), beside the one its Frame keeps: a fixed
// learning rate, or a Schedule that overrides it, with LRSetter's rules,
// kept in checkpoints under keys of its own with Frame.CheckLoad's rule.
// Make one with NewGroupLR.
type GroupLR struct {
	name            string // the group, in errors: "AdamW group"
	setter          string // the method that sets it, in the load warning
	lrKey, schedKey string
	lr              float32
	sched           Schedule
}

// NewGroupLR returns the learning rate of the group called name (in
// errors), fixed at lr, kept in checkpoints under lrKey and schedKey;
// setter names the method that sets it (in the warning of Load).
func NewGroupLR(name, setter string, lr float32, lrKey, schedKey string) *GroupLR {
	return &GroupLR{name: name, setter: setter, lr: lr, lrKey: lrKey, schedKey: schedKey}
}

// At is the group's learning rate of step t.
func (g *GroupLR) At(t int64) float32 {
	if g.sched != nil {
		return g.sched.LR(t)
	}
	return g.lr
}

// Check refuses a scheduled learning rate of step t that is not usable
// (for FrameConfig.Check).
func (g *GroupLR) Check(t int64) error {
	if g.sched == nil {
		return nil
	}
	if err := checkLR(g.sched.LR(t)); err != nil {
		return fmt.Errorf("%s's schedule %s: %w", g.name, g.sched, err)
	}
	return nil
}

// Set fixes the learning rate, replacing the schedule, as LRSetter.SetLR.
func (g *GroupLR) Set(lr float32) error {
	if err := checkLR(lr); err != nil {
		return fmt.Errorf("%s: %w", g.name, err)
	}
	g.lr, g.sched = lr, nil
	return nil
}

// SetSchedule makes s choose the learning rate from step next on (nil:
// back to the fixed one), s tried on step next first, as
// LRSetter.SetSchedule.
func (g *GroupLR) SetSchedule(s Schedule, next int64) error {
	if s != nil {
		if err := checkLR(s.LR(next)); err != nil {
			return fmt.Errorf("%s: schedule %s at step %d: %w", g.name, s, next, err)
		}
	}
	g.sched = s
	return nil
}

// Save records the learning rate and the schedule's fingerprint in ck.
func (g *GroupLR) Save(ck *Checkpoint) {
	ck.Floats[g.lrKey] = float64(g.lr)
	ck.Ints[g.schedKey] = ScheduleFingerprint(g.sched)
}

// CheckLoad checks the group's learning-rate state in ck by
// Frame.CheckLoad's rule, changing nothing, and returns what applies it
// (logging a warning, with log, when the checkpoint's learning rate
// replaces another). Its errors wrap ErrIncompatibleCheckpoint.
func (g *GroupLR) CheckLoad(ck *Checkpoint) (apply func(log *zap.Logger, algorithm string), err error) {
	lr, has, err := loadLR(ck, g.lrKey, g.schedKey, g.sched)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", g.name, err)
	}
	return func(log *zap.Logger, algorithm string) {
		if !has {
			return
		}
		if lr != g.lr {
			log.Warn(fmt.Sprintf("loaded a checkpoint with another %s learning rate: the checkpoint's replaces this optimizer's (call %s after Load to keep yours)", g.name, g.setter),
				zap.String("algorithm", algorithm), zap.Float32("checkpoint_lr", lr), zap.Float32("replaced_lr", g.lr))
		}
		g.lr = lr
	}, nil
}
