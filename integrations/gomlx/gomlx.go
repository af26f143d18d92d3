// Package gomlx trains a GoMLX model data-parallel with any lowbit optimizer
// (exact Adam or LAMB, 1-bit Adam, 1-bit LAMB, 0/1 Adam, sharded Adam, the
// DiLoCo-style outer optimizer of package outer, Muon: NewMuon, which
// gives Muon the hidden matrices and AdamW the rest, and NewOuterMuon, the
// outer optimizer with that Muon inside) inside GoMLX's own
// training loop: train.NewTrainer, train.Loop, the progress bar, the
// metrics and the checkpoint package stay as they are.
// Its errors and warnings start "lbgomlx:", the name the README imports it
// as; the README holds a complete program, and docs/gomlx.md at the
// repository root the table of GoMLX settings and their lowbit
// equivalents, and the recipes to resume, change the number of ranks and
// run on several machines.
//
// An Optimizer is a GoMLX optimizer.Interface. Its UpdateGraph does not
// update a variable: it hands the gradient of every trainable variable out
// of the graph, as the new value of a non-trainable variable under
// /lowbit/gradients. A hook on the train.Loop (AttachToLoop), which runs
// before every other hook of the step, copies the gradients into lowbit
// optim.Params, runs the lowbit optimizer's Step on the host (averaging
// over the ranks, exactly or compressed), and writes the new values back
// into the GoMLX variables. GoMLX v0.28.2 has no host callback inside a
// graph, so this is the one place where host code runs between steps.
//
// What a GoMLX user changes to go data-parallel:
//
//	opt, err := lbgomlx.New(ctx, c, func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
//		return onebit.NewAdam(ctx, c, p, onebit.DefaultAdamConfig())
//	}, lbgomlx.WithWarnings(os.Stderr), lbgomlx.WithMeanMetrics())
//	defer opt.Close()
//	ckpt, err := opt.Checkpoint(checkpoint.Build(store).Keep(2), rankDir) // instead of checkpoint.Build(store).Dir(rankDir).Keep(2).Done()
//	trainer := train.NewTrainer(backend, store, modelFn, lossFn, opt, trainMetrics, evalMetrics) // opt instead of optimizer.Adam()...
//	loop := train.NewLoop(trainer)
//	opt.AttachToLoop(loop)                                           // new line
//	commandline.AttachProgressBar(loop)
//	train.EveryNSteps(loop, 100, "checkpoint", 100, opt.SaveOnStepFn(ckpt)) // instead of ckpt.SaveOnStepFn
//	_, err = loop.RunToGlobalStep(lbgomlx.Shard(globalBatches, c, trainer.GlobalStep), steps)
//	err = opt.Save(ckpt)                                             // the last step
//
// and each rank runs that code: a goroutine of local.Run, or a process of
// mpirun with mpi.Open, each with its own backend, its shard of every
// global batch (Shard) and, for checkpoints, its own checkpoint directory.
//
// # Learning rate
//
// GoMLX's learning rate, when the store sets it (the learning_rate
// parameter, optimizer.ParamLearningRate) or the training graph computes it
// (GoMLX's cosineschedule), decides every step's: after each TrainStep the
// hook reads the value GoMLX's own optimizer would have used in that step
// (the variable /optimizers/learning_rate) and hands it to the lowbit
// optimizer (optim.LRSetter.SetLR) before its step; the lowbit config's LR
// is then not used. Otherwise the lowbit optimizer's own learning rate
// applies: its config's LR, its schedule (SetSchedule in the Builder), or,
// after a resume, the checkpoint's fixed learning rate (lowbit's rule, with
// a warning). A lowbit schedule together with GoMLX's setting is refused at
// the first step. A learning rate of 0 from GoMLX (the first step of its
// cosine warm-up) updates the lowbit optimizer's moments and moves no
// parameter. The ranks' learning rates are compared at every step, in the
// per-step agreement. With Muon (NewMuon) that learning rate is the Muon
// group's; the AdamW group's is the lowbit optimizer's own
// (MuonConfig.AdamLR), compared at the first step. After a resume the
// checkpoint's replaces it, with a warning; to resume with another, call
// the Muon optimizer's SetAdamLR once Restored is true, before the first
// lowbit step (a train.Loop hook of priority below HookPriority).
//
// # Warnings
//
// What a user must know although training goes on (a resume from an older
// checkpoint than a rank's newest, the checkpoint's learning rate replacing
// the config's, error feedback reset, a checkpoint without lowbit state,
// GoMLX optimizer settings the lowbit optimizer does not use) is kept by
// Warnings, written where WithWarnings says as it happens, and logged with
// WithLogger's logger. By default nothing is printed: a program's main
// passes WithWarnings(os.Stderr).
//
// # Guarantees
//
// The first training graph built (the first TrainStep) initializes the
// variables, checks with one allgather that every rank has the same
// trainable variables (paths, shapes) at the same global step, broadcasts
// rank 0's values to every rank, builds the lowbit optimizer and restores
// its state, and checks with a second allgather that every rank agrees on
// what decides training: whether a lowbit state was restored, the
// optimizer, its stage and counters, the learning rate and its source,
// every hyperparameter its state records, WithMeanMetrics, and the
// trainable variables' values (but in 0/1 Adam's phase B, whose local
// steps leave the ranks apart; with an optimizer whose ranks run apart
// between exchanges and keep global parameters, a GlobalHolder such as
// outer.Optimizer, the global parameters instead). A difference fails
// every rank, before any gradient is computed, with an error naming each
// rank's value. Every rank starts from rank 0's initial values whatever
// its initializers' seeds. Every rank builds its first training graph
// together.
//
// An optimizer whose ranks run apart (outer.Optimizer: inner steps of
// each rank's own, an exchange every H steps) leaves each rank's variables
// holding its own parameters between exchanges; its global parameters
// are Global, and WithGlobalValues runs an evaluation on them. Nothing in
// this package expects the ranks' variables to be equal after a step.
//
// Each step's hook agrees with the other ranks on whether every rank got
// its gradients, whether every rank's loss is finite and whether the
// ranks' learning rates are the same. Those flags
// ride in the lowbit optimizer's own per-step agreement, the allreduce of a
// few bytes in which the ranks agree that every gradient is finite
// (optim.FlagCarrier, which every lowbit optimizer implements): a step pays
// one latency-bound agreement for all of it, not one of the hook's and one
// of the optimizer's. (With an optimizer that does not implement
// optim.FlagCarrier the hook agrees in an allreduce of its own first.) An
// error on one rank (a trainable variable added or reshaped since the first
// graph, a gradient that cannot be read) is returned on every rank and
// changes nothing on any rank: that rank refuses the step in the agreement
// (optim.StepFlags.Refuse) before any update, so no rank updates with what
// it failed to read. A step whose loss is not finite on some rank changes
// nothing and stops the loop on every rank with an error naming the step
// (GoMLX's train.Loop stops on a non-finite loss; this makes every rank
// stop, not only the one that saw it). A step whose gradient is not finite
// on some rank while every loss is finite is skipped on every rank by the
// lowbit optimizer (optim.Stats.Skipped counts it) and the loop goes on.
//
// The outer optimizer (outer.Optimizer) has no per-step agreement, and its
// ranks run apart between exchanges: the hook's flags ride in its
// exchanges' agreements only (outer.Optimizer.CarryFlagsAtExchanges), so
// that a step that does not exchange communicates nothing. What each rank
// does alone, its inner step, it decides alone; what the ranks share, the
// exchange, waits for every rank's word. A rank that fails to read its
// gradients between exchanges returns its error once the others reach the
// next exchange (its Step waits there: at most H steps of their compute),
// where every other rank's step fails naming it and the step it failed at;
// from there every rank is failed, at the same lowbit step count (resume
// from a checkpoint to go on). A rank whose loss is not finite skips its
// own inner step (the optimizer's Stats().Skipped counts it, a warning says
// so the first time) while the others step on, and the step counts on
// every rank; at the exchange its pseudo-gradient is what its other inner
// steps made. (GoMLX's train.Loop then stops on that rank with its own
// error: run the loop on there to go on with the others, or end the
// program, which releases them: a rank's function returning under
// local.Run, mpirun ending every rank.) The ranks' learning rates are
// compared at each exchange, those of its step: ranks that differ there
// fail that step on every rank with an error naming both values, the
// exchange not run (the global parameters unchanged; each rank's own
// inner step of that step is taken, and counted in the global step).
//
// An error inside GoMLX's own TrainStep (a graph that fails to build or to
// run on one rank) never reaches the hook on that rank: train.Loop returns
// it there. The other ranks are released by the communicator: under
// local.Run a rank whose function returns closes its communicator, which
// aborts its peers' collectives; under mpirun a process that exits with an
// error makes mpirun end every rank. So a rank's function returns the loop's
// error (it does not retry the loop on its own).
//
// # Checkpoints
//
// Each rank saves its own checkpoints, to its own directory: the lowbit
// state is per rank (1-bit error buffers, sharded moments). Save (or
// SaveOnStepFn) writes the lowbit optimizer's state (moments, error
// buffers, counters, the parameters: an optim.Checkpoint) of global step S
// to the file StateFilePrefix+S+StateFileSuffix next to GoMLX's checkpoint
// files, atomically (optim.SaveFile: a temporary file synced and renamed),
// and then calls checkpoint.Handler.Save, which writes the model and, last,
// the .json that makes GoMLX list the checkpoint; after it, the state files
// of steps GoMLX no longer keeps (checkpoint.Config.Keep) are removed. A
// save costs one copy of the lowbit state on the heap (optim.Optimizer's
// State) while it is streamed to the file, and nothing of it stays
// resident afterwards. The gradient variables are excluded from the
// checkpoint.
//
// The ranks must resume from the same step. A crash between two ranks'
// saves leaves one rank's newest checkpoint a step ahead of another's, so
// build each rank's Handler with Checkpoint, a collective, instead of
// checkpoint.Config.Done: the ranks exchange the steps their directories
// hold and every rank loads the newest step they all hold. A rank's newer
// checkpoints are moved into the subdirectory SetAsideDir (so that GoMLX
// loads the common one) and a warning names the step chosen. When the
// ranks hold checkpoints but none in common, every rank fails with an
// error naming each rank's steps. Ranks whose Handlers were built
// otherwise and loaded different global steps fail at the first training
// step, on every rank, with an error naming the ranks and their steps:
// they never train on from different steps.
//
// Save works before the first step of a process too, as GoMLX's
// Handler.Save does (see Save).
//
// The first training graph restores the lowbit state of the loaded
// model's global step, and the run continues bit-identically. A
// checkpoint made by another optimizer, another number of ranks, another
// rank or another model is refused on every rank with an error, and the
// lowbit optimizer is not changed. So is a checkpoint saved with
// Handler.Save directly after Save (its lowbit state is from an older
// step). A GoMLX checkpoint without lowbit state (made with one of GoMLX's
// optimizers, say) starts the lowbit optimizer afresh, with a warning.
// Checkpoints written before the state had a file of its own (in the
// variable StateVariable) still load; the variable is then removed from
// the store.
//
// The package is a module of its own (github.com/lowbit-ml/lowbit/integrations/gomlx),
// so that lowbit's core keeps its small set of dependencies. It is pinned to
// GoMLX v0.28.2 and tested with GoMLX's pure-Go backend.
package gomlx

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"

	"github.com/gomlx/compute/shapes"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/optimizer"
	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

const (
	// GradientScope is the scope of the non-trainable variables through
	// which the gradients leave the graph: the gradient of the variable at
	// path P is the variable GradientScope+P.
	GradientScope = "/lowbit/gradients"
	// StateVariable is the path of the non-trainable uint8 variable in
	// which earlier versions saved the lowbit optimizer's state inside the
	// GoMLX checkpoint: the global step (8 bytes, little-endian) followed
	// by the optim.Checkpoint in its binary form. Such checkpoints still
	// load; Save writes the state to its own file (StateFilePrefix).
	StateVariable = "/lowbit/optimizer_state"
	// StateFilePrefix and StateFileSuffix name the file, in a Handler's
	// directory, that holds the lowbit optimizer's state of a global step
	// (optim.SaveFile's format): StateFilePrefix, the step in at least 8
	// digits, StateFileSuffix; e.g. lowbit-state-step-00000012.ckpt.
	StateFilePrefix = "lowbit-state-step-"
	StateFileSuffix = ".ckpt"
	// SetAsideDir is the subdirectory of a rank's checkpoint directory
	// into which Checkpoint moves the checkpoints newer than the newest
	// step every rank holds. Nothing reads it again: delete it, or move
	// its files back by hand.
	SetAsideDir = "lowbit-set-aside"
	// HookPriority is the priority of the OnStep hook AttachToLoop adds:
	// lower than any hook GoMLX or a user normally adds, so that the
	// variables are updated before the progress bar, evaluations or
	// checkpoints of the same step run.
	HookPriority train.Priority = -1 << 30
)

// Builder builds the lowbit optimizer over the trainable variables'
// parameters, one per variable in the store's order, named by the
// variable's path; every rank calls it together, on c, while the first
// training graph is built. New also calls it once, alone, to check the
// optimizer's config (see New). For example:
//
//	func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
//		return onebit.NewAdam(ctx, c, p, onebit.DefaultAdamConfig())
//	}
type Builder func(ctx context.Context, c comm.Comm, params []*optim.Param) (optim.Optimizer, error)

// Option configures New.
type Option func(*Optimizer)

// WithLogger logs what the Optimizer does once (initialization, a restored
// or a missing lowbit state) and every warning (see Warnings) to l. The
// default is zap.NewNop(). It does not reach the lowbit optimizer, whose
// own logger is an option of its constructor (optim.WithLogger).
func WithLogger(l *zap.Logger) Option {
	return func(o *Optimizer) {
		if l != nil {
			o.log = l
		}
	}
}

// WithWarnings writes every warning a user must see (see Warnings) to w as
// it happens, one line each, starting "lbgomlx: warning: ". The default is
// to write them nowhere: read them with Warnings, or give a logger
// (WithLogger). A program's main usually passes os.Stderr.
func WithWarnings(w io.Writer) Option {
	return func(o *Optimizer) { o.warnOut = w }
}

// WithManualStep declares that the program calls Step itself after every
// Trainer.TrainStep instead of attaching the Optimizer to a train.Loop.
// Without it (or AttachToLoop) the first training graph is refused: the
// variables would otherwise never change, without a word.
func WithManualStep() Option {
	return func(o *Optimizer) { o.manual = true }
}

// WithMeanMetrics makes the hook of AttachToLoop replace, after every step,
// each scalar training metric GoMLX's TrainStep returned (the batch loss,
// its moving average, the program's train metrics) with its mean over the
// ranks, in place: GoMLX's progress bar, every later hook and the metrics
// train.Loop.RunSteps returns then show the mean over all ranks instead of
// this rank's own. It costs one allreduce of a few floats per step, beside
// the lowbit optimizer's own. Every rank sets it or none (checked at the
// first step).
func WithMeanMetrics() Option {
	return func(o *Optimizer) { o.meanMetrics = true }
}

// Optimizer is a GoMLX optimizer.Interface that trains the trainable
// variables of one rank's model.Store with a lowbit optimizer. Give it to
// train.NewTrainer and attach it to the train.Loop (AttachToLoop). It is
// used by one goroutine at a time and with one model.Store.
type Optimizer struct {
	ctx   context.Context
	c     comm.Comm
	build Builder
	log   *zap.Logger

	store   *model.Store
	opt     optim.Optimizer
	vars    []*model.Variable // trainable variables, in store order
	shapes  []shapes.Shape    // their shapes at the first graph
	params  []*optim.Param    // one per variable, named by its path
	grads   []*model.Variable // the gradient variables, one per trainable variable
	failed  error             // set when the first graph failed: Optimizer unusable
	pending error             // a local error found while building a later graph
	// sf carries the step's flags (see flagFailed) in the lowbit
	// optimizer's own agreement; nil when the optimizer is not an
	// optim.FlagCarrier, and then flags is agreed on in an allreduce of
	// its own. Both are allocated once.
	sf       *optim.StepFlags
	flags    []float32
	loss     float64 // the loss of the step in progress, for the veto's error
	lr       float32 // the learning rate of the step in progress
	vetoed   bool    // the veto stopped the step in progress
	restored bool    // whether the lowbit state came from a checkpoint
	closed   bool
	attached bool // AttachToLoop was called
	manual   bool // WithManualStep: the program calls Step itself

	// quiet is set when sf rides in the exchanges' agreements only (an
	// exchangeFlagCarrier, outer.Optimizer): the steps between exchanges
	// communicate nothing, and each rank decides its own inner steps.
	quiet bool
	// warnedSkip is set once quiet's first local skip of an inner step
	// (a non-finite loss) went to Warnings.
	warnedSkip bool

	// The learning rate (see lr.go): its source, GoMLX's variable that
	// holds it for lrStore and lrGraph, and the lowbit optimizer as an
	// optim.LRSetter (nil when it is not one).
	lrSrc   lrSource
	lrVar   *model.Variable
	lrParam lrParam
	lrs     optim.LRSetter

	meanMetrics bool
	meanBuf     []float32

	warnOut  io.Writer
	warnings []string

	// loadedDir and loadedStep are the directory and the global step
	// (-1: none) Checkpoint loaded, for Save before the first step.
	loadedDir  string
	loadedStep int64
	// saved is, per Handler, the global step and the lowbit optimizer's
	// count of steps (optim.Stats.Steps) of the last Save: a Save with
	// nothing trained since writes nothing.
	saved map[*checkpoint.Handler][2]int64
	// carry is the lowbit state Checkpoint made from a checkpoint of
	// another number of ranks, until the first training graph loads it;
	// change says what it did (RankChange).
	carry  *carried
	change *RankChange
}

var _ optimizer.Interface = (*Optimizer)(nil)

// The flags of the per-step agreement: 1 when this rank failed to get its
// gradients (it refuses the step), 1 when its loss is not finite, and the
// step's learning rate and its negation (their maxima over the ranks are
// the largest and minus the smallest learning rate: equal when every rank
// uses the same).
const (
	flagFailed = iota
	flagLoss
	flagLR
	flagNegLR
	numFlags
)

// ProbeParam is the name of the one-element parameter New builds the
// lowbit optimizer over, alone, to check its config.
const ProbeParam = "lbgomlx-config-probe"

// New returns an Optimizer that averages over c (nil or a communicator of
// size 1 for a single process) with the lowbit optimizer build returns.
// ctx is the context of every collective the Optimizer runs (GoMLX's
// interfaces carry none): give it a deadline or cancel it to bound a wait
// for a rank that is gone.
//
// New checks the optimizer's config at once: it calls build with a nil
// communicator (one process) and one parameter of one element named
// ProbeParam, and returns the *optim.ConfigError of an invalid config
// (every lowbit constructor returns its config's Validate error as it is),
// so that LR = 0 fails here and not at the first TrainStep. The optimizer
// so built is closed at once; any other error (or panic) of that call is
// left to the real build, over the model's parameters, in the first
// training graph. New communicates nothing.
func New(ctx context.Context, c comm.Comm, build Builder, opts ...Option) (*Optimizer, error) {
	switch {
	case ctx == nil:
		return nil, errors.New("lbgomlx: New: nil context")
	case build == nil:
		return nil, errors.New("lbgomlx: New: nil optimizer builder")
	}
	o := &Optimizer{ctx: ctx, c: c, build: build, log: zap.NewNop(), flags: make([]float32, numFlags), loadedStep: -1}
	for _, opt := range opts {
		if opt != nil {
			opt(o)
		}
	}
	if err := probe(ctx, build); err != nil {
		return nil, fmt.Errorf("lbgomlx: New: the optimizer's config: %w", err)
	}
	return o, nil
}

// probe builds the optimizer over one parameter of one element, alone,
// and returns the *optim.ConfigError it fails with, if any.
func probe(ctx context.Context, build Builder) error {
	p, err := optim.NewParamFrom(ProbeParam, []float32{0}, 1)
	if err != nil {
		return nil
	}
	var opt optim.Optimizer
	func() {
		defer func() {
			if recover() != nil {
				opt, err = nil, nil // a builder that needs the real communicator
			}
		}()
		opt, err = build(ctx, nil, []*optim.Param{p})
	}()
	if ce := (*optim.ConfigError)(nil); errors.As(err, &ce) {
		return err
	}
	if err == nil && opt != nil {
		func() {
			defer func() { _ = recover() }()
			_ = opt.Close()
		}()
	}
	return nil
}

// Optimizer returns the lowbit optimizer, nil before the first training
// graph is built.
func (o *Optimizer) Optimizer() optim.Optimizer { return o.opt }

// Params returns the lowbit parameters, one per trainable variable in the
// store's order and named by the variable's path; nil before the first
// training graph is built. After every step their values equal the
// variables'.
func (o *Optimizer) Params() []*optim.Param { return o.params }

// Restored reports whether the lowbit optimizer's state was restored from a
// GoMLX checkpoint when the first training graph was built.
func (o *Optimizer) Restored() bool { return o.restored }

// LR returns the learning rate of the last step the hook ran (0 before
// the first): GoMLX's, when the store sets it, or the lowbit optimizer's
// (see the package documentation, "Learning rate").
func (o *Optimizer) LR() float32 { return o.lr }

// Warnings returns the warnings of this rank so far, oldest first: what a
// user must know although training goes on (a resume from an older
// checkpoint than a rank's newest, the checkpoint's learning rate replacing
// the config's, error feedback reset, a GoMLX checkpoint without lowbit
// state, GoMLX optimizer settings of the store that the lowbit optimizer
// does not use). Each is also logged (WithLogger) and written where
// WithWarnings says, when it happens.
func (o *Optimizer) Warnings() []string { return slices.Clone(o.warnings) }

// warn records a warning: text is the whole sentence, fields repeat its
// values for the log.
func (o *Optimizer) warn(text string, fields ...zap.Field) {
	o.warnings = append(o.warnings, text)
	o.log.Warn(text, fields...)
	if o.warnOut != nil {
		fmt.Fprintf(o.warnOut, "lbgomlx: warning: %s\n", text)
	}
}

// Close releases what the lowbit optimizer made for itself (see
// optim.Optimizer.Close); it does not close the communicator. Every rank
// calls it once training is done. It is idempotent; steps fail after it.
func (o *Optimizer) Close() error {
	if o.closed {
		return nil
	}
	o.closed = true
	if o.opt == nil {
		return nil
	}
	o.warnNoExchange()
	return o.opt.Close()
}

// warnNoExchange warns, on rank 0, when the lowbit optimizer is the outer
// optimizer (package outer) and took inner steps but never an exchange,
// counted over the whole run, resumes included: its global model (Global,
// and the checkpoints' global parameters) is the initial one; an H above
// the run's steps does that, which the outer optimizer, not knowing the
// run's length, cannot tell at its construction.
func (o *Optimizer) warnNoExchange() {
	x, ok := o.opt.(*outer.Optimizer)
	if !ok || o.rank() != 0 {
		return
	}
	steps, st := x.Stats().Steps, x.OuterStats()
	if steps == 0 || st.Exchanges > 0 || st.Skipped > 0 {
		return
	}
	cfg := x.Config()
	o.warn(fmt.Sprintf("the outer optimizer took %d inner steps and no exchange: its first merges at inner step %d (H %d, %d fragment(s), delay %d), "+
		"so its global model is the initial one; lower H or train longer", steps, cfg.FirstMerge(), cfg.H, max(1, cfg.Fragments), cfg.Delay),
		zap.Int64("inner_steps", steps), zap.Int("first_merge_step", cfg.FirstMerge()))
}

func (o *Optimizer) size() int {
	if o.c == nil {
		return 1
	}
	return o.c.Size()
}

func (o *Optimizer) rank() int {
	if o.c == nil {
		return 0
	}
	return o.c.Rank()
}
