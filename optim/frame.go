package optim

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
)

// Checkpoint names of the learning-rate state every optimizer stores
// through its Frame.
const (
	// FloatLR is the fixed learning rate: the config's, or the last
	// SetLR's (also while a schedule is set, which overrides it).
	FloatLR = "lr"
	// IntLRSchedule is the fingerprint of the schedule (see
	// ScheduleFingerprint), 0 for a fixed learning rate.
	IntLRSchedule = "lr_schedule"
)

// StepFunc applies update t (counted from 1 over the applied steps;
// skipped steps do not count) with learning rate lr. A Frame calls it
// once every rank's gradients are known to be finite. An error leaves the
// optimizer in an undefined state (after a communicator error, say): the
// frame does not count the step.
type StepFunc func(ctx context.Context, t int64, lr float32) error

// ErrSkipStep is returned (wrapped or not) by a StepFunc that finds, on
// every rank alike and before it has changed any state, that the step must
// be skipped: for example an averaged gradient that overflowed the
// reduction's 16-bit format. The Frame then counts the step as skipped and
// returns nil.
var ErrSkipStep = errors.New("optim: skip this step")

// FrameConfig describes the optimizer a Frame runs.
type FrameConfig struct {
	// Name prefixes every error of Step, e.g. "optim: Adam" or
	// "onebit: 1-bit LAMB".
	Name string
	// Algorithm is the checkpoint algorithm name (AlgorithmAdam, ...),
	// written into checkpoints and log lines.
	Algorithm string
	// Comm is the group the optimizer runs on; nil means one process.
	Comm comm.Comm
	// Params are the optimizer's parameters.
	Params []*Param
	// Sizes holds, per parameter, a buffer the optimizer sized from it at
	// construction: Step refuses to run when a parameter's value or
	// gradient no longer holds that many elements (see checkSizes).
	Sizes [][]float32
	// LR is the initial fixed learning rate (the config's).
	LR float32
	// Stage is the stage of the first step.
	Stage Stage
	// Logger receives a warning for every skipped step and an info line
	// for every stage switch and checkpoint load. Nil: zap.NewNop().
	Logger *zap.Logger
	// Averager, when not nil, is the optimizer's gradient averager:
	// checkpoints record its mode (IntGradReduce), and loading one made
	// in another mode logs a warning (the mode is a setting, not state:
	// the load goes ahead, but the following steps round differently
	// from the run that made the checkpoint).
	Averager *GradAverager
	// Hypers are the hyperparameters that decide the optimizer's steps,
	// other than the learning rate (see Hyper): every checkpoint records
	// them and CheckLoad refuses one made with other values.
	Hypers []Hyper
	// Check, when not nil, is the optimizer's own check of step t (the
	// learning rate of a second parameter group, say), run with the
	// frame's checks before the finite-gradient agreement: an error is a
	// refusal of the step, as the frame's own are (see Step).
	Check func(t int64) error
}

// Frame is the part of an optimizer step that every lowbit optimizer
// shares, present and future: it checks that the parameters still have the
// sizes the optimizer was built for, takes the step's learning rate (fixed
// or from a Schedule), agrees with every rank on whether all gradients are
// finite (one tiny allreduce; see FiniteGuard), skips and counts the step
// when they are not, otherwise dispatches to the update of the current
// stage (see Handle), and accounts the traffic and the counters of Stats.
// It also writes and checks the shared part of checkpoints: header, step
// counters, stage and learning-rate state (see Checkpoint, CheckLoad and
// Restore).
//
// An optimizer embeds or holds one Frame, registers a StepFunc per stage
// with Handle, and implements Step, Stats, SetLR, SetSchedule and LR by
// calling the frame's. A Frame is used by one goroutine at a time; Step
// allocates nothing.
type Frame struct {
	name, algorithm string
	c               comm.Comm
	world, rank     int
	params          []*Param
	sizes           [][]float32
	log             *zap.Logger
	guard           FiniteGuard
	avg             *GradAverager
	closed          bool // Close was called: every later Step is refused
	hypers          []Hyper
	flags           *StepFlags // carried by every Step's agreement; nil: none
	check           func(t int64) error

	lr    float32  // the fixed learning rate
	sched Schedule // overrides lr when not nil

	stages []Stage
	fns    []StepFunc

	step  int64 // steps applied
	stage Stage
	stats Stats
}

// NewFrame returns a frame for cfg, in stage cfg.Stage with no step taken.
// It keeps cfg.Params and cfg.Sizes (not copies).
func NewFrame(cfg FrameConfig) *Frame {
	f := &Frame{
		name:      cfg.Name,
		algorithm: cfg.Algorithm,
		c:         cfg.Comm,
		world:     1,
		params:    cfg.Params,
		sizes:     cfg.Sizes,
		log:       cfg.Logger,
		lr:        cfg.LR,
		stage:     cfg.Stage,
		avg:       cfg.Averager,
		hypers:    slices.Clone(cfg.Hypers),
		check:     cfg.Check,
	}
	if f.log == nil {
		f.log = zap.NewNop()
	}
	if f.c != nil {
		f.world, f.rank = f.c.Size(), f.c.Rank()
	}
	return f
}

// Handle registers fn as the update of the steps taken in stage s,
// replacing any earlier one.
func (f *Frame) Handle(s Stage, fn StepFunc) {
	if i := slices.Index(f.stages, s); i >= 0 {
		f.fns[i] = fn
		return
	}
	f.stages = append(f.stages, s)
	f.fns = append(f.fns, fn)
}

// Step runs one step; every rank calls it together. In order: the size
// check; the learning rate of step t = Applied()+1 (an invalid scheduled
// one is an error before anything is communicated or changed); the
// finite-gradient agreement; then either a skip (Stats.Steps and
// Stats.Skipped counted, a warning logged, nothing else changed) or the
// stage's StepFunc, after which t counts as applied, unless it returned
// ErrSkipStep (then the step is skipped as above). The traffic of the
// call is accounted in Stats either way. Errors are prefixed with the
// frame's name and the step.
//
// The checks before the agreement (sizes, the scheduled learning rate,
// the stage's update, Close) can fail on one rank only. Such a
// rank does not return early: it refuses the step in the finite-gradient
// agreement, so that every rank returns an error (the refusing rank its
// own, the others one naming it) and none waits for it. This costs
// nothing on the wire: the agreement runs every step anyway. Nothing is
// changed or counted on any rank.
//
// With StepFlags set (CarryFlags), the agreement also carries them: a
// StepFlags.Refuse is a refusal as above, returned as it is on this rank;
// StepFlags.Veto runs on every rank right after the agreement, and its
// error is returned as it is, with nothing changed or counted.
func (f *Frame) Step(ctx context.Context) error {
	before := f.bytesSent()
	t := f.step + 1
	lr, i, refusal := f.prepare(t)
	if refusal == nil && f.flags != nil && f.flags.Refuse != nil {
		refusal = f.flags.Refuse
	}
	ok, by, err := f.guard.check(ctx, f.c, f.params, refusal != nil, f.flags)
	switch {
	case refusal != nil && err != nil:
		return errors.Join(refusal, fmt.Errorf("%s step %d: telling the other ranks: %w", f.name, t, err))
	case refusal != nil:
		return refusal
	case err != nil:
		return fmt.Errorf("%s step %d: %w", f.name, t, err)
	case by >= 0:
		return fmt.Errorf("%s step %d: rank %d refused the step (its error says why)", f.name, t, by)
	}
	if f.flags != nil && f.flags.Veto != nil {
		if err := f.flags.Veto(f.flags.Agreed); err != nil {
			return err
		}
	}
	if !ok {
		f.skip(before, t, nil)
		return nil
	}
	if err := f.fns[i](ctx, t, lr); err != nil {
		if errors.Is(err, ErrSkipStep) {
			f.skip(before, t, err)
			return nil
		}
		f.account(before)
		return fmt.Errorf("%s step %d: %w", f.name, t, err)
	}
	f.step = t
	f.stats.Steps++
	f.account(before)
	return nil
}

// prepare runs this rank's checks of step t and returns its learning
// rate and the index of its stage's update, or why this rank cannot take
// it.
func (f *Frame) prepare(t int64) (lr float32, i int, refusal error) {
	if err := checkSizes(f.params, f.sizes); err != nil {
		return 0, 0, fmt.Errorf("%s: %w", f.name, err)
	}
	lr = f.lr
	if f.sched != nil {
		lr = f.sched.LR(t)
		if err := checkLR(lr); err != nil {
			return 0, 0, fmt.Errorf("%s step %d: schedule %s: %w", f.name, t, f.sched, err)
		}
	}
	i = slices.Index(f.stages, f.stage)
	if i < 0 {
		return 0, 0, fmt.Errorf("%s step %d: no update registered for stage %q", f.name, t, f.stage)
	}
	if f.closed {
		return 0, 0, fmt.Errorf("%w (%s)", ErrClosed, f.name)
	}
	if f.check != nil {
		if err := f.check(t); err != nil {
			return 0, 0, fmt.Errorf("%s step %d: %w", f.name, t, err)
		}
	}
	return lr, i, nil
}

// StepFlags are values that a training loop has every rank agree on at
// each step (a stop request, a failure to get the gradients, a non-finite
// loss), carried by the optimizer's own per-step agreement, the
// finite-gradient allreduce that every Step runs, instead of a collective
// of their own: a step then pays one latency-bound allreduce for all of
// them. Set them with CarryFlags. The optimizer reads Local, Refuse and
// Veto during Step and writes Agreed; the caller must not change them
// while a Step runs. Every rank must carry flags of the same length.
type StepFlags struct {
	// Local holds this rank's values for the next Step; the caller sets
	// them before each Step. Its length is fixed when CarryFlags is
	// called.
	Local []float32
	// Agreed receives, in each Step whose agreement succeeds, the maximum
	// of Local over the ranks (Local itself on one rank), whatever Step
	// returns after the agreement. A Step that fails before or in the
	// agreement leaves it unchanged. CarryFlags allocates it.
	Agreed []float32
	// Refuse, when not nil at a Step, makes this rank refuse that step:
	// it takes part in the agreement, nothing changes or is counted on any
	// rank, this rank's Step returns Refuse and every other rank's an
	// error naming this rank. Agreed is still written.
	Refuse error
	// Veto, when not nil, is called on every rank with Agreed right after
	// a successful agreement in which no rank refused, before anything
	// changes. A non-nil result makes Step return it with nothing changed
	// or counted. Agreed is the same on every rank, so a Veto that decides
	// from Agreed alone vetoes on every rank alike.
	Veto func(agreed []float32) error
}

// FlagCarrier is implemented by the optimizers whose Step runs a per-step
// agreement (all of lowbit's: see Frame.Step).
type FlagCarrier interface {
	// CarryFlags makes every following Step carry sf in its agreement
	// (see StepFlags); nil stops carrying. It allocates sf.Agreed to the
	// length of sf.Local, and the agreement's buffer, so that Step still
	// allocates nothing. It communicates nothing; every rank calls it
	// before the same step, with flags of the same length (a difference is
	// an error of the next Step's agreement on every rank).
	CarryFlags(sf *StepFlags) error
}

// CarryFlags implements FlagCarrier.
func (f *Frame) CarryFlags(sf *StepFlags) error {
	if sf != nil {
		if len(sf.Agreed) != len(sf.Local) {
			sf.Agreed = make([]float32, len(sf.Local))
		}
		if f.world > 1 {
			f.guard.flag = make([]float32, 1+len(sf.Local))
		}
	}
	f.flags = sf
	return nil
}

// skip counts step t as skipped; why is nil for a non-finite gradient.
func (f *Frame) skip(before, t int64, why error) {
	f.stats.Steps++
	f.stats.Skipped++
	f.account(before)
	if why == nil {
		f.log.Warn("skipping step: non-finite gradient on some rank",
			zap.String("algorithm", f.algorithm), zap.Int64("step", t), zap.Int64("skipped", f.stats.Skipped))
		return
	}
	f.log.Warn("skipping step", zap.String("algorithm", f.algorithm), zap.Int64("step", t),
		zap.Int64("skipped", f.stats.Skipped), zap.String("reason", why.Error()))
}

// bytesSent is what this rank has sent so far on the group and on the
// averager's own communicators.
func (f *Frame) bytesSent() int64 { return CommBytes(f.c) + f.avg.bytesSent() }

func (f *Frame) account(before int64) {
	f.stats.LastStepBytes = f.bytesSent() - before
	f.stats.BytesSent += f.stats.LastStepBytes
}

// Enter switches to stage s from the next step on. Called from a StepFunc,
// it logs the switch as happening after the step being applied.
func (f *Frame) Enter(s Stage) {
	if s == f.stage {
		return
	}
	f.log.Info("stage switch", zap.String("algorithm", f.algorithm),
		zap.String("from", string(f.stage)), zap.String("to", string(s)), zap.Int64("after_step", f.step+1))
	f.stage = s
}

// Close marks the frame closed: every later Step is refused, on every
// rank (the refusal travels in the finite-gradient agreement, so a rank
// that closed early does not leave its peers waiting). An optimizer's
// Close calls it; it communicates nothing and may be called again.
func (f *Frame) Close() { f.closed = true }

// Stage is the stage the next step runs in.
func (f *Frame) Stage() Stage { return f.stage }

// Applied is the number of steps applied (skipped steps excluded): the t
// of the last update, and of bias correction.
func (f *Frame) Applied() int64 { return f.step }

// Stats reports progress and traffic, with Stage the stage of the next
// step.
func (f *Frame) Stats() Stats {
	s := f.stats
	s.Stage = f.stage
	return s
}

// Comm is the frame's communicator (nil for one process).
func (f *Frame) Comm() comm.Comm { return f.c }

// World and Rank are the group size and this rank (1 and 0 without a
// communicator).
func (f *Frame) World() int { return f.world }

// Rank is this rank's index in the group.
func (f *Frame) Rank() int { return f.rank }

// Params returns the parameters.
func (f *Frame) Params() []*Param { return f.params }

// Logger returns the frame's logger (never nil).
func (f *Frame) Logger() *zap.Logger { return f.log }

// SetLR implements LRSetter.SetLR.
func (f *Frame) SetLR(lr float32) error {
	if err := checkLR(lr); err != nil {
		return fmt.Errorf("%s: %w", f.name, err)
	}
	f.lr, f.sched = lr, nil
	return nil
}

// SetSchedule implements LRSetter.SetSchedule: s is tried on the next
// step before it is accepted.
func (f *Frame) SetSchedule(s Schedule) error {
	if s != nil {
		if err := checkLR(s.LR(f.step + 1)); err != nil {
			return fmt.Errorf("%s: schedule %s at step %d: %w", f.name, s, f.step+1, err)
		}
	}
	f.sched = s
	return nil
}

// LR implements LRSetter.LR: the schedule's learning rate for the next
// step, or the fixed one.
func (f *Frame) LR() float32 {
	if f.sched != nil {
		return f.sched.LR(f.step + 1)
	}
	return f.lr
}

// Schedule returns the schedule, nil for a fixed learning rate.
func (f *Frame) Schedule() Schedule { return f.sched }

// Checkpoint returns a checkpoint holding the frame's part of the state:
// algorithm, world size, rank, stage, the counters IntStep, IntSteps and
// IntSkipped, the learning-rate entries FloatLR and IntLRSchedule, and
// with an Averager its mode (IntGradReduce), and the hyperparameters of
// FrameConfig.Hypers (HyperPrefix + name). The optimizer adds its tensors
// and its own entries.
func (f *Frame) Checkpoint() *Checkpoint {
	ck := &Checkpoint{
		Algorithm: f.algorithm,
		World:     f.world,
		Rank:      f.rank,
		Stage:     f.stage,
		Ints: map[string]int64{
			IntStep: f.step, IntSteps: f.stats.Steps, IntSkipped: f.stats.Skipped,
			IntLRSchedule: ScheduleFingerprint(f.sched),
		},
		Floats: map[string]float64{FloatLR: float64(f.lr)},
	}
	if f.avg != nil {
		ck.Ints[IntGradReduce] = int64(f.avg.Mode())
	}
	f.writeHypers(ck)
	return ck
}

// FrameState is the frame's part of a checkpoint, read and checked by
// CheckLoad and applied by Restore.
type FrameState struct {
	Step    int64 // steps applied
	Steps   int64 // Stats.Steps
	Skipped int64 // Stats.Skipped
	Stage   Stage

	lr    float32
	hasLR bool
	mode  ReduceMode
	// unchecked are the hyperparameters the checkpoint does not record.
	unchecked []string
}

// CheckLoad checks, without changing anything, that ck can be loaded into
// the frame's optimizer: ck.CheckCompatible for the frame's algorithm,
// world size and parameters; a stage among stages; consistent counters
// (see loadCounters); and the learning-rate state. It returns what Restore
// applies once the optimizer has restored (Checkpoint.Restore) the rest.
// Errors wrap ErrIncompatibleCheckpoint and are not prefixed with the
// frame's name.
//
// Learning rate: a checkpoint made with a schedule (IntLRSchedule not 0)
// loads only into an optimizer with a schedule of the same fingerprint,
// and one made with a fixed learning rate (IntLRSchedule 0) only into an
// optimizer without a schedule, which then takes its FloatLR, as
// PyTorch's load_state_dict restores a param group's lr: the checkpoint's
// value wins, Restore logs a warning when it differs from the optimizer's
// own, and a caller that wants its configured learning rate (lower on
// resume, say) calls SetLR after Load. A checkpoint
// without these entries (made before they existed) loads into any
// optimizer, which keeps its own learning rate or schedule (the config's
// LR unless SetLR or SetSchedule changed it). To change the schedule on
// purpose when resuming, delete the two entries from the checkpoint.
//
// Reduction mode: an unknown IntGradReduce is refused; a known one that
// differs from the Averager's is accepted, and Restore logs a warning.
//
// Hyperparameters (FrameConfig.Hypers): a checkpoint that records another
// value for one of them, or records one the optimizer does not have, is
// refused with an error naming it and both values. One that does not
// record some of them (made before they were recorded) loads, the
// optimizer keeps its own values for those, and Restore logs a warning
// naming them. To change a hyperparameter on purpose when resuming,
// delete its entry (HyperPrefix + name) from the checkpoint's Floats.
func (f *Frame) CheckLoad(ck *Checkpoint, stages ...Stage) (FrameState, error) {
	var st FrameState
	if err := ck.CheckCompatible(f.algorithm, f.world, f.params); err != nil {
		return st, err
	}
	if !slices.Contains(stages, ck.Stage) {
		return st, fmt.Errorf("%w: unknown stage %q for %s (want one of %q)", ErrIncompatibleCheckpoint, ck.Stage, f.algorithm, stages)
	}
	var err error
	if st.Step, st.Steps, st.Skipped, err = loadCounters(ck); err != nil {
		return st, err
	}
	st.Stage = ck.Stage
	if st.lr, st.hasLR, err = loadLR(ck, FloatLR, IntLRSchedule, f.sched); err != nil {
		return st, err
	}
	if st.mode, err = modeOf(ck); err != nil {
		return st, err
	}
	if st.unchecked, err = f.checkHypers(ck); err != nil {
		return st, err
	}
	return st, nil
}

// loadLR reads and checks the learning-rate state of one parameter group
// from ck, by CheckLoad's rules: the schedule fingerprint under schedKey
// against own, the group's schedule (nil: a fixed learning rate), and the
// fixed learning rate under lrKey, returned with has true when ck holds
// it. Errors wrap ErrIncompatibleCheckpoint.
func loadLR(ck *Checkpoint, lrKey, schedKey string, own Schedule) (lr float32, has bool, err error) {
	if fp, ok := ck.Ints[schedKey]; ok {
		mine := ScheduleFingerprint(own)
		switch {
		case fp == mine:
		case fp == 0:
			return 0, false, fmt.Errorf("%w: made with a fixed learning rate, this optimizer has schedule %s (to switch on purpose, delete the checkpoint's %q and %q entries)",
				ErrIncompatibleCheckpoint, own, schedKey, lrKey)
		case mine == 0:
			return 0, false, fmt.Errorf("%w: made with a learning-rate schedule (fingerprint %016x), this optimizer has a fixed learning rate: SetSchedule the same schedule before Load (or delete the checkpoint's %q and %q entries)",
				ErrIncompatibleCheckpoint, uint64(fp), schedKey, lrKey)
		default:
			return 0, false, fmt.Errorf("%w: made with another learning-rate schedule (fingerprint %016x), this optimizer has %s (fingerprint %016x)",
				ErrIncompatibleCheckpoint, uint64(fp), own, uint64(mine))
		}
	}
	v, ok := ck.Floats[lrKey]
	if !ok {
		return 0, false, nil
	}
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || float64(float32(v)) != v {
		return 0, false, fmt.Errorf("%w: learning rate %v is not a finite, non-negative float32", ErrIncompatibleCheckpoint, v)
	}
	return float32(v), true, nil
}

// Restore applies what CheckLoad read: counters, stage and, when the
// checkpoint holds it, the fixed learning rate. It logs the load.
func (f *Frame) Restore(st FrameState) {
	f.step = st.Step
	f.stats.Steps, f.stats.Skipped = st.Steps, st.Skipped
	f.stats.LastStepBytes = 0
	f.stage = st.Stage
	if st.hasLR {
		if st.lr != f.lr {
			f.log.Warn("loaded a checkpoint with another learning rate: the checkpoint's replaces this optimizer's (call SetLR after Load to keep yours)",
				zap.String("algorithm", f.algorithm), zap.Float32("checkpoint_lr", st.lr), zap.Float32("replaced_lr", f.lr))
		}
		f.lr = st.lr
	}
	f.log.Info("loaded checkpoint", zap.String("algorithm", f.algorithm),
		zap.Int64("step", st.Step), zap.String("stage", string(st.Stage)))
	if len(st.unchecked) > 0 {
		f.log.Warn("loaded a checkpoint that does not record these hyperparameters: keeping this optimizer's values, unchecked",
			zap.String("algorithm", f.algorithm), zap.Strings("hyperparameters", st.unchecked))
	}
	if f.avg != nil && st.mode != f.avg.Mode() {
		f.log.Warn("loaded a checkpoint made with another gradient reduction mode: resuming is not bit-identical",
			zap.String("algorithm", f.algorithm), zap.String("checkpoint_mode", st.mode.String()),
			zap.String("mode", f.avg.Mode().String()))
	}
}
