package optim

import (
	"fmt"
	"hash/fnv"
	"math"
	"strconv"
)

// Schedule gives the learning rate of every step. Every lowbit optimizer
// takes one through SetSchedule (see LRSetter) and calls it once per
// applied step, before anything else happens in that step.
//
// A schedule must be a pure function of the step, the same on every rank:
// resuming from a checkpoint evaluates it again from the saved step on.
type Schedule interface {
	// LR returns the learning rate of step t, counted from 1 over the
	// steps actually applied (a step skipped for a non-finite gradient
	// does not advance t, as it does not advance Adam's bias correction).
	// It must be finite and >= 0; an optimizer refuses to take a step
	// whose learning rate is not, and changes nothing. A step at 0 is a
	// step: the moments and counters update, the parameters do not move.
	LR(t int64) float32
	// String describes the schedule and all its parameters. Checkpoints
	// record a fingerprint of it (see IntLRSchedule), and Load refuses a
	// checkpoint made with another schedule, so two schedules that behave
	// differently must describe themselves differently.
	String() string
}

// LRSetter is implemented by every lowbit optimizer, exact and 1-bit: the
// learning rate can be changed between steps, either fixed (SetLR) or as a
// function of the step (SetSchedule). Changing the learning rate changes
// nothing else: the 1-bit optimizers keep their frozen variance, and 0/1
// Adam sums the step sizes it actually applied.
type LRSetter interface {
	// SetLR fixes the learning rate of the following steps, replacing any
	// schedule. lr must be finite and >= 0 (0, as PyTorch allows, updates
	// the optimizer's state and leaves the parameters where they are):
	// anything else is refused with an error and changes nothing.
	SetLR(lr float32) error
	// SetSchedule makes s choose the learning rate of every following
	// step; nil returns to the fixed learning rate (the config's, or the
	// last SetLR's). A schedule whose learning rate for the next step is
	// not finite and >= 0 is refused with an error and changes nothing.
	SetSchedule(s Schedule) error
	// LR returns the learning rate the next step will use.
	LR() float32
}

// checkLR returns an error (without the package prefix: its callers add
// theirs) unless lr is a usable learning rate: finite and >= 0. A
// learning rate of 0 is one (a warm-up that starts at 0): its steps update
// the moments and leave the parameters where they are.
func checkLR(lr float32) error {
	if !(lr >= 0) || math.IsInf(float64(lr), 1) {
		return fmt.Errorf("learning rate %v must be finite and >= 0", lr)
	}
	return nil
}

// ScheduleFingerprint returns the fingerprint of s that checkpoints
// record under IntLRSchedule: the 64-bit FNV-1a hash of s.String(),
// never 0, or 0 for a nil s (a fixed learning rate).
func ScheduleFingerprint(s Schedule) int64 {
	if s == nil {
		return 0
	}
	h := fnv.New64a()
	h.Write([]byte(s.String()))
	fp := int64(h.Sum64())
	if fp == 0 {
		fp = 1
	}
	return fp
}

// fmtF formats a float32 exactly and briefly, for schedule descriptions.
func fmtF(x float32) string { return strconv.FormatFloat(float64(x), 'g', -1, 32) }

// ConstantLR returns the schedule whose learning rate is lr at every step,
// for use as the schedule after LinearWarmup. lr must be finite and >= 0.
func ConstantLR(lr float32) (Schedule, error) {
	if err := checkLR(lr); err != nil {
		return nil, fmt.Errorf("optim: constant schedule: %w", err)
	}
	return constantLR(lr), nil
}

type constantLR float32

func (c constantLR) LR(int64) float32 { return float32(c) }
func (c constantLR) String() string   { return "constant(" + fmtF(float32(c)) + ")" }

// LinearWarmup returns the schedule that ramps the learning rate up
// linearly over the first steps steps, to then's first learning rate, and
// then follows then, delayed by the warm-up:
//
//	LR(t) = then.LR(1) * t/steps   for t <= steps
//	LR(t) = then.LR(t - steps)     for t > steps
//
// The first step runs at then.LR(1)/steps, step steps at then.LR(1). steps
// must be at least 1 and then not nil.
func LinearWarmup(steps int64, then Schedule) (Schedule, error) {
	if steps < 1 {
		return nil, fmt.Errorf("optim: linear warm-up over %d steps, want at least 1", steps)
	}
	if then == nil {
		return nil, fmt.Errorf("optim: linear warm-up needs the schedule that follows it")
	}
	return &linearWarmup{steps: steps, then: then}, nil
}

type linearWarmup struct {
	steps int64
	then  Schedule
}

func (w *linearWarmup) LR(t int64) float32 {
	if t > w.steps {
		return w.then.LR(t - w.steps)
	}
	return float32(float64(w.then.LR(1)) * float64(max(t, 1)) / float64(w.steps))
}

func (w *linearWarmup) String() string {
	return "linear_warmup(" + strconv.FormatInt(w.steps, 10) + ", " + w.then.String() + ")"
}

// CosineDecay returns the schedule that decays the learning rate from
// base at step 1 to final at step steps+1 along half a cosine, and stays
// at final after that:
//
//	LR(t) = final + (base-final) * (1 + cos(pi * min(t-1, steps)/steps)) / 2
//
// computed in float64 and rounded once. It needs 0 <= final <= base, both
// finite, and steps >= 1. With final 0 the learning rate reaches 0 at
// step steps+1 and stays there: the steps after it update the moments
// and leave the parameters where they are.
func CosineDecay(base, final float32, steps int64) (Schedule, error) {
	if err := checkLR(base); err != nil {
		return nil, fmt.Errorf("optim: cosine decay: base %w", err)
	}
	if !(final >= 0 && final <= base) {
		return nil, fmt.Errorf("optim: cosine decay: final learning rate %v must be in [0, base %v]", final, base)
	}
	if steps < 1 {
		return nil, fmt.Errorf("optim: cosine decay over %d steps, want at least 1", steps)
	}
	return &cosineDecay{base: base, final: final, steps: steps}, nil
}

type cosineDecay struct {
	base, final float32
	steps       int64
}

func (c *cosineDecay) LR(t int64) float32 {
	k := min(max(t-1, 0), c.steps)
	b, f := float64(c.base), float64(c.final)
	return float32(f + (b-f)*(1+math.Cos(math.Pi*float64(k)/float64(c.steps)))/2)
}

func (c *cosineDecay) String() string {
	return "cosine_decay(" + fmtF(c.base) + ", " + fmtF(c.final) + ", " + strconv.FormatInt(c.steps, 10) + ")"
}

// StepDecay returns the schedule that multiplies the learning rate by
// gamma every every steps, starting from base:
//
//	LR(t) = base * gamma^floor((t-1)/every)
//
// computed in float64 and rounded once. It needs base finite and >= 0,
// gamma in (0, 1] and every >= 1. A learning rate that decays so far that
// it rounds to 0 in float32 is a learning rate of 0: the parameters stop
// moving.
func StepDecay(base, gamma float32, every int64) (Schedule, error) {
	if err := checkLR(base); err != nil {
		return nil, fmt.Errorf("optim: step decay: base %w", err)
	}
	if !(gamma > 0 && gamma <= 1) {
		return nil, fmt.Errorf("optim: step decay: gamma %v must be in (0, 1]", gamma)
	}
	if every < 1 {
		return nil, fmt.Errorf("optim: step decay every %d steps, want at least 1", every)
	}
	return &stepDecay{base: base, gamma: gamma, every: every}, nil
}

type stepDecay struct {
	base, gamma float32
	every       int64
}

func (s *stepDecay) LR(t int64) float32 {
	k := max(t-1, 0) / s.every
	return float32(float64(s.base) * math.Pow(float64(s.gamma), float64(k)))
}

func (s *stepDecay) String() string {
	return "step_decay(" + fmtF(s.base) + ", " + fmtF(s.gamma) + ", " + strconv.FormatInt(s.every, 10) + ")"
}
