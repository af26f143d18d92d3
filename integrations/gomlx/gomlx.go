// Package gomlx trains a GoMLX model data-parallel with any lowbit optimizer
// (exact Adam or LAMB, 1-bit Adam, 1-bit LAMB, 0/1 Adam, sharded Adam, the
// DiLoCo-style outer optimizer of package outer, Muon: NewMuon, which
// gives Muon the hidden matrices and AdamW the rest) inside GoMLX's own
// training loop: train.NewTrainer, train.Loop, the progress bar, the
// metrics and the checkpoint package stay as they are.
// Its errors and warnings start "lbgomlx:", the name the README imports it
// as; the README holds a complete program, the table of GoMLX settings and
// their lowbit equivalents, and the recipes to resume, change the number
// of ranks and run on several machines.
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
// (MuonConfig.AdamLR), compared at the first step.
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
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"

	"github.com/gomlx/compute"
	"github.com/gomlx/compute/dtypes"
	"github.com/gomlx/compute/shapes"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/optimizer"
	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
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
	skipped  int64
	steps    int64 // Steps the hook ran (skipped included)
	restored bool  // whether the lowbit state came from a checkpoint
	closed   bool
	attached bool // AttachToLoop was called
	manual   bool // WithManualStep: the program calls Step itself

	// The learning rate (see lr.go): its source, GoMLX's variable that
	// holds it for lrStore and lrGraph, and the lowbit optimizer as an
	// optim.LRSetter (nil when it is not one).
	lrSrc   lrSource
	lrVar   *model.Variable
	lrParam float64
	lrs     optim.LRSetter

	meanMetrics bool
	meanBuf     []float32

	warnOut  io.Writer
	warnings []string

	// loadedDir and loadedStep are the directory and the global step
	// (-1: none) Checkpoint loaded, for Save before the first step.
	loadedDir  string
	loadedStep int64
	// saved is, per Handler, the global step and the count of steps of
	// the last Save: a Save with nothing trained since writes nothing.
	saved map[*checkpoint.Handler][2]int64
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
	return o.opt.Close()
}

// AttachToLoop adds the hook that runs the lowbit step after every training
// step of loop, at HookPriority. Call it before the loop's first step: a
// training graph built while the Optimizer is neither attached nor made
// WithManualStep is refused.
func (o *Optimizer) AttachToLoop(loop *train.Loop) {
	o.attached = true
	loop.OnStep("lowbit", HookPriority, func(_ *train.Loop, metrics []*tensors.Tensor) error {
		if len(metrics) == 0 {
			return errors.New("lbgomlx: the training step returned no metrics")
		}
		loss := math.NaN()
		if err := tensors.ConstFlatData(metrics[0], func(f []float32) { loss = float64(f[0]) }); err != nil {
			// A loss of another dtype.
			v, ok := metrics[0].Value().(float64)
			if !ok {
				return fmt.Errorf("lbgomlx: reading the loss: %w", err)
			}
			loss = v
		}
		if err := o.Step(loss); err != nil {
			return err
		}
		if o.meanMetrics {
			return o.meanOverRanks(metrics)
		}
		return nil
	})
}

// meanOverRanks replaces every scalar float32 or float64 metric with its
// mean over the ranks, in one allreduce.
func (o *Optimizer) meanOverRanks(metrics []*tensors.Tensor) error {
	w := o.size()
	if w == 1 {
		return nil
	}
	if cap(o.meanBuf) < len(metrics) {
		o.meanBuf = make([]float32, len(metrics))
	}
	buf := o.meanBuf[:len(metrics)]
	for i, m := range metrics {
		buf[i] = 0
		if m != nil && m.Shape().IsScalar() {
			switch v := m.Value().(type) {
			case float32:
				buf[i] = v
			case float64:
				buf[i] = float32(v)
			}
		}
	}
	if err := o.c.AllReduce(o.ctx, buf, comm.Sum); err != nil {
		return fmt.Errorf("lbgomlx: the mean of the metrics over the ranks: %w", err)
	}
	for i, m := range metrics {
		if m == nil || !m.Shape().IsScalar() {
			continue
		}
		mean := buf[i] / float32(w)
		var err error
		switch m.Shape().DType {
		case dtypes.Float32:
			err = tensors.MutableFlatData(m, func(f []float32) { f[0] = mean })
		case dtypes.Float64:
			err = tensors.MutableFlatData(m, func(f []float64) { f[0] = float64(mean) })
		}
		if err != nil {
			return fmt.Errorf("lbgomlx: writing the mean of metric %d: %w", i, err)
		}
	}
	return nil
}

// UpdateGraph implements optimizer.Interface: it hands the gradient of
// every trainable variable out of the graph (a variable the loss does not
// use gets zeros). The first call also initializes the variables,
// broadcasts rank 0's values, builds the lowbit optimizer and restores its
// state from a loaded checkpoint, and agrees with the other ranks on what
// decides training (see the package documentation), communicating with
// the other ranks, which build their first training graph at the same
// time. Like every GoMLX graph building function it panics on error.
func (o *Optimizer) UpdateGraph(scope *model.Scope, g *graph.Graph, loss *graph.Node) {
	store := scope.Store()
	if o.failed != nil {
		panic(o.failed)
	}
	if o.closed {
		panic(fmt.Errorf("lbgomlx: %w", optim.ErrClosed))
	}
	if !loss.IsScalar() {
		panic(fmt.Errorf("lbgomlx: the loss must be a scalar, got shape %s", loss.Shape()))
	}
	if !o.attached && !o.manual {
		panic(errors.New("lbgomlx: the Optimizer runs no step: call opt.AttachToLoop(loop) before the loop runs " +
			"(or make it with WithManualStep and call opt.Step after every TrainStep)"))
	}
	src, lrVar, param, lrErr := gomlxLR(scope, g)
	if o.store == nil {
		o.lrSrc, o.lrVar, o.lrParam = src, lrVar, param
		if err := o.init(store, g.Backend(), lrErr); err != nil {
			o.failed = err
			panic(err)
		}
	} else if store != o.store {
		panic(errors.New("lbgomlx: the Optimizer is used with a second model.Store"))
	} else if lrErr != nil {
		o.pending = lrErr
		return
	} else if src != o.lrSrc || lrVar != o.lrVar {
		// Reported on every rank by the next step's agreement.
		o.pending = fmt.Errorf("lbgomlx: this training graph takes its learning rate from %s, the first one from %s; no variable changed", src, o.lrSrc)
		return
	}
	if err := o.checkVars(); err != nil {
		// Reported on every rank by the next step's agreement.
		o.pending = err
		return
	}
	var used []*graph.Node
	var usedIdx []int
	for i, v := range o.vars {
		if v.InUseByGraph(g) {
			used = append(used, v.NodeValue(g))
			usedIdx = append(usedIdx, i)
		}
	}
	grads := make([]*graph.Node, len(o.vars))
	if len(used) > 0 {
		for i, gr := range graph.Gradient(loss, used...) {
			grads[usedIdx[i]] = gr
		}
	}
	for i, v := range o.vars {
		gr := grads[i]
		if gr == nil {
			gr = graph.Zeros(g, v.Shape())
		}
		o.grads[i].SetNodeValue(graph.ConvertDType(gr, dtypes.Float32))
	}
}

// Clear implements optimizer.Interface: it deletes the gradient and state
// variables from the store.
func (o *Optimizer) Clear(scope *model.Scope) error {
	store := scope.Store()
	if err := store.DeleteVariablesInScope(GradientScope); err != nil {
		return fmt.Errorf("lbgomlx: %w", err)
	}
	if err := store.DeleteVariable(StateVariable); err != nil {
		return fmt.Errorf("lbgomlx: %w", err)
	}
	return nil
}

// Step runs the lowbit step of one training step, with this rank's loss:
// it reads the gradients the graph handed out and the step's learning rate
// (see the package documentation, "Learning rate"), agrees with the other
// ranks (in the lowbit optimizer's own per-step agreement, see the package
// documentation), runs the lowbit optimizer and writes the new values into
// the variables, then increments GoMLX's global step. AttachToLoop calls it
// after every TrainStep; in a loop of your own, make the Optimizer
// WithManualStep and call it after every Trainer.TrainStep. Every rank
// calls it together.
func (o *Optimizer) Step(loss float64) error {
	if o.closed {
		return fmt.Errorf("lbgomlx: %w", optim.ErrClosed)
	}
	if o.failed != nil {
		return o.failed
	}
	if o.opt == nil {
		return errors.New("lbgomlx: Step before the first training graph was built")
	}
	localErr := o.pending
	if localErr == nil {
		localErr = o.checkVars()
	}
	if localErr == nil {
		localErr = o.readGradients()
	}
	if localErr == nil {
		localErr = o.stepLR()
	}
	o.loss = loss
	var err error
	if o.sf != nil {
		err = o.carriedStep(localErr)
	} else {
		err = o.ownStep(localErr)
	}
	if err != nil {
		return err
	}
	o.steps++
	// A skipped step changes nothing, but for an optimizer whose ranks run
	// apart: its local skip may come with an exchange that moved the
	// parameters to the global ones.
	skipped := o.opt.Stats().Skipped
	write := skipped == o.skipped || o.global() != nil
	o.skipped = skipped
	if write {
		if err := o.writeBack(); err != nil {
			return err
		}
	}
	return o.setGlobalStep(o.globalStep() + 1)
}

// GlobalHolder is implemented by the lowbit optimizers whose ranks'
// parameters differ between synchronizations and which keep global
// parameters every rank agrees on: outer.Optimizer (DiLoCo-style), whose
// ranks take inner steps of their own and average every H steps. Global
// returns those global parameters, the flat concatenation of the
// parameters in order; the caller does not change them.
type GlobalHolder interface {
	Global() []float32
}

// global returns the lowbit optimizer's global parameters, nil when it
// keeps none (every rank's parameters are the same after every step) or
// before the first training graph.
func (o *Optimizer) global() []float32 {
	if g, ok := o.opt.(GlobalHolder); ok {
		return g.Global()
	}
	return nil
}

// Global returns the global parameters of a lowbit optimizer whose ranks
// run apart between synchronizations (a GlobalHolder, such as
// outer.Optimizer): the flat concatenation of every trainable variable's
// values in the order of Params, the same on every rank. It returns nil
// for any other optimizer, whose ranks' variables are the same after
// every step, and before the first training graph. The slice is the
// optimizer's own: do not change it.
func (o *Optimizer) Global() []float32 { return o.global() }

// WithGlobalValues runs fn, typically an evaluation, with the trainable
// variables holding the lowbit optimizer's global parameters (see Global),
// then puts this rank's own values back, whatever fn returns: between two
// exchanges of an optimizer whose ranks run apart, each rank's variables
// hold its own parameters, and the model every rank agrees on is the
// global one. For any other optimizer, or before the first training
// graph, it just runs fn. It communicates nothing; fn may (an evaluation
// summed over the ranks), as every rank calls WithGlobalValues together.
func (o *Optimizer) WithGlobalValues(fn func() error) (err error) {
	g := o.global()
	if g == nil {
		return fn()
	}
	n := 0
	for _, p := range o.params {
		n += len(p.Data())
	}
	if len(g) != n {
		return fmt.Errorf("lbgomlx: WithGlobalValues: the optimizer's global parameters hold %d elements, the trainable variables %d", len(g), n)
	}
	defer func() {
		if werr := o.writeBack(); werr != nil {
			err = errors.Join(err, fmt.Errorf("lbgomlx: WithGlobalValues: putting this rank's values back: %w", werr))
		}
	}()
	off := 0
	for i, v := range o.vars {
		m := len(o.params[i].Data())
		val, err := v.Value()
		if err == nil {
			err = tensors.AssignFlatData(val, g[off:off+m])
		}
		if err != nil {
			return fmt.Errorf("lbgomlx: WithGlobalValues: writing the global values of %q: %w", v.Path(), err)
		}
		off += m
	}
	return fn()
}

// stepLR sets o.lr to the learning rate of the step in progress: GoMLX's,
// which it hands to the lowbit optimizer, or the lowbit optimizer's own.
func (o *Optimizer) stepLR() error {
	o.lr = 0
	if o.lrSrc == lrLowbit {
		if o.lrs != nil {
			o.lr = o.lrs.LR()
		}
		return nil
	}
	lr, err := storeLR(o.lrVar)
	if err != nil {
		return err
	}
	if err := o.lrs.SetLR(lr); err != nil {
		return fmt.Errorf("lbgomlx: GoMLX's learning rate: %w", err)
	}
	o.lr = lr
	return nil
}

// setFlags writes this rank's flags into f.
func (o *Optimizer) setFlags(f []float32, localErr error) {
	f[flagFailed], f[flagLoss] = 0, 0
	if localErr != nil {
		f[flagFailed] = 1
	}
	if math.IsNaN(o.loss) || math.IsInf(o.loss, 0) {
		f[flagLoss] = 1
	}
	f[flagLR], f[flagNegLR] = o.lr, -o.lr
}

// carriedStep runs the lowbit optimizer's Step with the flags carried in
// its agreement: a rank with localErr refuses the step there, and veto
// stops it on every rank when some loss is not finite or the ranks'
// learning rates differ, before anything changes.
func (o *Optimizer) carriedStep(localErr error) error {
	sf := o.sf
	o.setFlags(sf.Local, localErr)
	clear(sf.Agreed)
	sf.Refuse = localErr
	o.vetoed = false
	err := o.opt.Step(o.ctx)
	sf.Refuse = nil
	switch {
	case err == nil:
		return nil
	case localErr != nil, o.vetoed:
		// This rank's own error (joined with the agreement's, if that
		// failed too), or the veto's.
		return err
	case sf.Agreed[flagFailed] != 0:
		return fmt.Errorf("lbgomlx: another rank failed to get its gradients; no variable changed: %w", err)
	}
	return fmt.Errorf("lbgomlx: %w", err)
}

// veto is the StepFlags.Veto of the carried flags: it stops the step on
// every rank when some rank's loss is not finite or the ranks' learning
// rates differ.
func (o *Optimizer) veto(agreed []float32) error {
	if err := o.agreedError(agreed); err != nil {
		o.vetoed = true
		return err
	}
	return nil
}

// agreedError is the error of agreed flags in which no rank failed.
func (o *Optimizer) agreedError(agreed []float32) error {
	if agreed[flagLoss] != 0 {
		return fmt.Errorf("lbgomlx: global step %d: the loss is not finite on some rank (here %g); the step is skipped on every rank and no variable changed",
			o.globalStep()+1, o.loss)
	}
	if hi, lo := agreed[flagLR], -agreed[flagNegLR]; hi != lo {
		return fmt.Errorf("lbgomlx: global step %d: the ranks' learning rates differ, from %v to %v (here %v, from %s): "+
			"every rank must set the same; no variable changed", o.globalStep()+1, lo, hi, o.lr, o.lrSrc)
	}
	return nil
}

// ownStep agrees on the flags in an allreduce of its own, then runs the
// lowbit optimizer's Step: the path of an optimizer that cannot carry
// them.
func (o *Optimizer) ownStep(localErr error) error {
	o.setFlags(o.flags, localErr)
	if o.size() > 1 {
		if err := o.c.AllReduce(o.ctx, o.flags, comm.Max); err != nil {
			return errors.Join(localErr, fmt.Errorf("lbgomlx: %w", err))
		}
	}
	switch {
	case localErr != nil:
		return localErr
	case o.flags[flagFailed] != 0:
		return errors.New("lbgomlx: another rank failed to get its gradients; no variable changed")
	}
	if err := o.agreedError(o.flags); err != nil {
		return err
	}
	if err := o.opt.Step(o.ctx); err != nil {
		return fmt.Errorf("lbgomlx: %w", err)
	}
	return nil
}

// readGradients copies the gradient variables into the parameters'
// gradients.
func (o *Optimizer) readGradients() error {
	for i, p := range o.params {
		val, err := o.grads[i].Value()
		if err != nil {
			return fmt.Errorf("lbgomlx: gradient of %q: %w; no variable changed", p.Name, err)
		}
		if s := val.Shape(); !s.Equal(o.shapes[i]) {
			return fmt.Errorf("lbgomlx: gradient of %q has shape %s, the variable %s; no variable changed", p.Name, s, o.shapes[i])
		}
		g := p.GradData()
		if err := tensors.ConstFlatData(val, func(f []float32) { copy(g, f) }); err != nil {
			return fmt.Errorf("lbgomlx: gradient of %q: %w; no variable changed", p.Name, err)
		}
	}
	return nil
}

// checkVars reports a trainable variable that changed since the first
// training graph: added, removed, replaced, or reshaped.
func (o *Optimizer) checkVars() error {
	i := 0
	for v := range o.store.IterVariables() {
		if !v.Trainable {
			continue
		}
		if i >= len(o.vars) || v != o.vars[i] {
			return fmt.Errorf("lbgomlx: the trainable variables changed since the first training graph (%q is new or moved); no variable changed", v.Path())
		}
		if s := v.Shape(); !s.Equal(o.shapes[i]) {
			return fmt.Errorf("lbgomlx: variable %q changed shape from %s to %s since the first training graph; no variable changed", v.Path(), o.shapes[i], s)
		}
		i++
	}
	if i != len(o.vars) {
		return fmt.Errorf("lbgomlx: %d trainable variables, %d at the first training graph; no variable changed", i, len(o.vars))
	}
	return nil
}

// writeBack copies the parameters into the variables, in place.
func (o *Optimizer) writeBack() error {
	for i, v := range o.vars {
		val, err := v.Value()
		if err == nil {
			err = tensors.AssignFlatData(val, o.params[i].Data())
		}
		if err != nil {
			return fmt.Errorf("lbgomlx: writing %q back: %w", v.Path(), err)
		}
	}
	return nil
}

func globalStepOf(store *model.Store) int64 {
	v := optimizer.GetGlobalStepVar(store)
	val, err := v.Value()
	if err != nil {
		return 0
	}
	s, _ := val.Value().(int64)
	return s
}

func (o *Optimizer) globalStep() int64 { return globalStepOf(o.store) }

func (o *Optimizer) setGlobalStep(s int64) error {
	if err := optimizer.GetGlobalStepVar(o.store).SetValue(tensors.FromScalar(s)); err != nil {
		return fmt.Errorf("lbgomlx: global step: %w", err)
	}
	return nil
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

// init runs in the first training graph: it collects and initializes the
// variables, agrees on them and on the global step with the other ranks,
// broadcasts rank 0's values, builds the lowbit optimizer, restores its
// state and agrees on what decides training (see agree.go). lrErr is this
// rank's error reading GoMLX's learning-rate setting.
func (o *Optimizer) init(store *model.Store, backend compute.Backend, lrErr error) error {
	localErr := o.collect(store, backend)
	if localErr == nil {
		localErr = lrErr
	}
	if err := o.agreeOnModel(localErr); err != nil {
		return err
	}
	if o.size() > 1 {
		for _, p := range o.params {
			if err := o.c.Broadcast(o.ctx, p.Data(), 0); err != nil {
				return fmt.Errorf("lbgomlx: broadcasting %q: %w", p.Name, err)
			}
		}
		if err := o.writeBack(); err != nil {
			return err
		}
	}
	opt, err := o.build(o.ctx, o.c, o.params)
	if err != nil {
		return fmt.Errorf("lbgomlx: building the optimizer: %w", err)
	}
	if opt == nil {
		return errors.New("lbgomlx: the optimizer builder returned nil")
	}
	o.opt = opt
	o.lrs, _ = opt.(optim.LRSetter)
	o.skipped = opt.Stats().Skipped
	localErr = o.carryFlags()
	var ck *optim.Checkpoint
	if localErr == nil {
		ck, localErr = o.restoreLocal()
	}
	var set *settings
	if localErr == nil {
		set, localErr = o.settings(ck)
	}
	ck = nil
	if err := o.agreeOnSettings(set, localErr); err != nil {
		_ = opt.Close()
		o.opt, o.sf, o.lrs, o.restored = nil, nil, nil, false
		return err
	}
	o.warnUnusedSettings()
	o.log.Info("lowbit optimizer ready", zap.Int("rank", o.rank()), zap.Int("ranks", o.size()),
		zap.Int("variables", len(o.vars)), zap.Bool("restored", o.restored),
		zap.Int64("global_step", o.globalStep()), zap.Bool("flags_carried", o.sf != nil),
		zap.Stringer("learning_rate", o.lrSrc))
	return nil
}

// carryFlags makes the lowbit optimizer carry the step's flags in its own
// agreement, when it can.
func (o *Optimizer) carryFlags() error {
	fc, ok := o.opt.(optim.FlagCarrier)
	if !ok {
		return nil
	}
	sf := &optim.StepFlags{Local: make([]float32, numFlags), Veto: o.veto}
	if err := fc.CarryFlags(sf); err != nil {
		return fmt.Errorf("lbgomlx: %w", err)
	}
	o.sf = sf
	return nil
}

// restoreLocal loads into the lowbit optimizer the state of the model's
// global step: from the StateVariable of an older checkpoint (which it
// then removes from the store, so that it neither stays resident nor is
// saved again), or from the state file of that step. It returns the
// checkpoint loaded, nil when none was.
func (o *Optimizer) restoreLocal() (*optim.Checkpoint, error) {
	gs := o.globalStep()
	var ck *optim.Checkpoint
	if sv := o.store.GetVariable(StateVariable); sv != nil {
		var err error
		ck, err = o.legacyState(sv, gs)
		if derr := o.store.DeleteVariable(StateVariable); err == nil && derr != nil {
			err = fmt.Errorf("lbgomlx: removing %s: %w", StateVariable, derr)
		}
		if err != nil {
			return nil, err
		}
	} else {
		var err error
		if ck, err = o.stateFile(gs); err != nil || ck == nil {
			return nil, err
		}
	}
	lrBefore := float32(0)
	if o.lrs != nil {
		lrBefore = o.lrs.LR()
	}
	if err := o.opt.Load(ck); err != nil {
		return nil, fmt.Errorf("lbgomlx: restoring the lowbit state of global step %d: %w", gs, err)
	}
	o.skipped = o.opt.Stats().Skipped
	o.restored = true
	o.warnLoaded(ck, gs, lrBefore)
	return ck, o.writeBack()
}

// warnLoaded warns, on rank 0, about what the load of ck changed that a
// user must know: the checkpoint's learning rate replaced the optimizer's
// own (lowbit's rule, as PyTorch's), or its error feedback was reset.
func (o *Optimizer) warnLoaded(ck *optim.Checkpoint, gs int64, lrBefore float32) {
	if o.rank() != 0 {
		return
	}
	in := innermost(ck) // the outer optimizer's learning rate is its inner one's
	if lr, ok := in.Floats[optim.FloatLR]; ok && o.lrSrc == lrLowbit && in.Ints[optim.IntLRSchedule] == 0 && float32(lr) != lrBefore {
		o.warn(fmt.Sprintf("resumed at global step %d with the checkpoint's learning rate %v instead of the optimizer's %v (its config's LR): "+
			"the lowbit optimizer's Load restores it, as PyTorch's load_state_dict does. To train on with another, set it in the store "+
			"(store.SetParam(optimizer.ParamLearningRate, lr)): the hook hands GoMLX's learning rate to the optimizer every step",
			gs, float32(lr), lrBefore),
			zap.Int64("global_step", gs), zap.Float64("checkpoint_lr", lr), zap.Float32("replaced_lr", lrBefore))
	}
	if ck.ErrorsReset {
		o.warn(fmt.Sprintf("resumed at global step %d from a checkpoint whose error buffers were reset (made on %d ranks, by rank %d): "+
			"error feedback starts again from zero", gs, ck.World, ck.Rank),
			zap.Int64("global_step", gs), zap.Int("made_on_world", ck.World), zap.Int("made_by_rank", ck.Rank))
	}
}

// legacyState decodes the state an older checkpoint held in sv, in place.
func (o *Optimizer) legacyState(sv *model.Variable, gs int64) (*optim.Checkpoint, error) {
	val, err := sv.Value()
	if err != nil {
		return nil, fmt.Errorf("lbgomlx: %s: %w", StateVariable, err)
	}
	ck := new(optim.Checkpoint)
	var derr error
	if err := tensors.ConstFlatData(val, func(b []uint8) {
		if len(b) < 8 {
			derr = fmt.Errorf("lbgomlx: %s holds %d bytes: %w", StateVariable, len(b), optim.ErrCorruptCheckpoint)
			return
		}
		if step := int64(binary.LittleEndian.Uint64(b)); step != gs {
			derr = fmt.Errorf("lbgomlx: the checkpoint's lowbit state is from global step %d, its model from step %d (save with Optimizer.Save, not Handler.Save): %w",
				step, gs, optim.ErrIncompatibleCheckpoint)
			return
		}
		if err := ck.UnmarshalBinary(b[8:]); err != nil {
			derr = fmt.Errorf("lbgomlx: %s: %w", StateVariable, err)
		}
	}); err != nil {
		return nil, fmt.Errorf("lbgomlx: %s: %w", StateVariable, err)
	}
	if derr != nil {
		return nil, derr
	}
	return ck, nil
}

// stateFile reads the state file of global step gs from the directory of
// the store's checkpoint.Handler. It returns nil, with no error, when no
// checkpoint was loaded (a fresh start, whatever state files the
// directory holds) or when the loaded checkpoint has no lowbit state at
// all (a warning says the lowbit optimizer starts afresh).
func (o *Optimizer) stateFile(gs int64) (*optim.Checkpoint, error) {
	h, _ := o.store.Loader().(*checkpoint.Handler)
	dir := h.Dir()
	if dir == "" {
		if gs > 0 && o.rank() == 0 {
			o.warn(fmt.Sprintf("the model is at global step %d but no checkpoint directory holds its lowbit state: the lowbit optimizer starts afresh", gs),
				zap.Int64("global_step", gs))
		}
		return nil, nil
	}
	path := filepath.Join(dir, stateFileName(gs))
	ck, err := optim.LoadFile(path)
	if err == nil {
		return ck, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("lbgomlx: %w", err)
	}
	if list, err := h.ListCheckpoints(); err != nil || len(list) == 0 {
		return nil, nil // nothing was loaded: a fresh start
	}
	steps, err := stateSteps(dir)
	if err != nil {
		return nil, fmt.Errorf("lbgomlx: %w", err)
	}
	if len(steps) > 0 {
		return nil, fmt.Errorf("lbgomlx: the checkpoint's lowbit state is from global step %d, its model from step %d (save with Optimizer.Save, not Handler.Save; %s holds no %s): %w",
			steps[len(steps)-1], gs, dir, stateFileName(gs), optim.ErrIncompatibleCheckpoint)
	}
	if gs > 0 {
		o.warn(fmt.Sprintf("the model's checkpoint of global step %d in %s holds no lowbit state (%s): the lowbit optimizer starts afresh",
			gs, dir, stateFileName(gs)), zap.Int64("global_step", gs), zap.String("dir", dir))
	}
	return nil, nil
}

// collect initializes the variables and makes one parameter and one
// gradient variable per trainable variable. It communicates nothing.
func (o *Optimizer) collect(store *model.Store, backend compute.Backend) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("lbgomlx: initializing the variables: %v", r)
		}
	}()
	o.store = store
	if sv := store.GetVariable(StateVariable); sv != nil {
		sv.SetTrainable(false) // a loaded variable starts trainable
	}
	if err := store.InitializeVariables(backend, nil); err != nil {
		return fmt.Errorf("lbgomlx: initializing the variables: %w", err)
	}
	var vars, grads []*model.Variable
	var shp []shapes.Shape
	var params []*optim.Param
	for v := range store.IterVariables() {
		if !v.Trainable {
			continue
		}
		s := v.Shape()
		if s.DType != dtypes.Float32 {
			return fmt.Errorf("lbgomlx: trainable variable %q is %s; lowbit trains float32 variables", v.Path(), s.DType)
		}
		val, err := v.Value()
		if err != nil {
			return fmt.Errorf("lbgomlx: %w", err)
		}
		var data []float32
		if err := tensors.ConstFlatData(val, func(f []float32) { data = append([]float32(nil), f...) }); err != nil {
			return fmt.Errorf("lbgomlx: %q: %w", v.Path(), err)
		}
		dims := s.Dimensions
		if len(dims) == 0 {
			dims = []int{1} // a scalar: one element
		}
		p, err := optim.NewParamFrom(v.Path(), data, dims...)
		if err != nil {
			return fmt.Errorf("lbgomlx: %q: %w", v.Path(), err)
		}
		vars, shp, params = append(vars, v), append(shp, s.Clone()), append(params, p)
	}
	if len(params) == 0 {
		return errors.New("lbgomlx: the model has no trainable variables")
	}
	for i, v := range vars {
		gv, err := store.CreateVariable(GradientScope+v.Path(), tensors.FromShape(shp[i]))
		if err != nil {
			return fmt.Errorf("lbgomlx: %w", err)
		}
		gv.SetTrainable(false)
		grads = append(grads, gv)
	}
	o.vars, o.shapes, o.params, o.grads = vars, shp, params, grads
	if h, ok := store.Loader().(*checkpoint.Handler); ok {
		h.ExcludeVarsFromSaving(grads...)
	}
	return nil
}

// Save saves a checkpoint of this rank with h: the lowbit optimizer's
// state of the current global step to its state file in h's directory
// (written atomically, see StateFilePrefix), then the model with
// checkpoint.Handler.Save, without the gradient variables; then it removes
// the state files of the steps whose GoMLX checkpoint h no longer keeps.
// The state is streamed to its file: beyond the optimizer it costs one
// copy of the state (optim.Optimizer's State) while Save runs, and nothing
// afterwards. It is not a collective: each rank saves its own state, to
// its own directory. A Save to h at the global step of the last Save to h,
// with no step since, writes nothing: a last Save after a RunSteps whose
// train.EveryNSteps already saved its last step adds no second checkpoint.
//
// Before the first training step of this process (no lowbit optimizer
// yet) Save works as GoMLX's Handler.Save does then: it saves the
// variables there are. When the store's variables came from a checkpoint
// with a lowbit state (its state file, of the loaded global step, in the
// directory of the Handler Checkpoint returned or of the store's loader),
// that state is saved with them: it is already in h's directory when h
// loaded it, or it is copied there. Otherwise (a fresh start) no lowbit
// state is saved: there is none yet, and a run resumed from that
// checkpoint starts the lowbit optimizer afresh.
func (o *Optimizer) Save(h *checkpoint.Handler) error {
	if h == nil {
		return errors.New("lbgomlx: Save: nil checkpoint.Handler")
	}
	dir := h.Dir()
	if dir == "" {
		return fmt.Errorf("lbgomlx: Save: %s has no directory to save the lowbit state to", h)
	}
	if o.opt == nil {
		return o.saveUnbuilt(h)
	}
	at := [2]int64{o.globalStep(), o.steps}
	if last, ok := o.saved[h]; ok && last == at {
		return nil // saved already, nothing trained since
	}
	if err := o.saveState(filepath.Join(dir, stateFileName(at[0]))); err != nil {
		return err
	}
	h.ExcludeVarsFromSaving(o.grads...)
	if err := h.Save(); err != nil {
		return fmt.Errorf("lbgomlx: Save: %w", err)
	}
	if o.saved == nil {
		o.saved = map[*checkpoint.Handler][2]int64{}
	}
	o.saved[h] = at
	o.pruneStates(h)
	return nil
}

// saveUnbuilt is Save before the lowbit optimizer is built.
func (o *Optimizer) saveUnbuilt(h *checkpoint.Handler) error {
	if o.failed != nil {
		return fmt.Errorf("lbgomlx: Save after the first training graph failed: %w", o.failed)
	}
	srcDir, step := o.loadedDir, o.loadedStep
	if o.store != nil {
		src, _ := o.store.Loader().(*checkpoint.Handler)
		srcDir, step = src.Dir(), globalStepOf(o.store)
	}
	if srcDir != "" && srcDir != h.Dir() && step >= 0 {
		name := stateFileName(step)
		if err := copyFile(filepath.Join(srcDir, name), filepath.Join(h.Dir(), name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("lbgomlx: Save: copying the loaded lowbit state: %w", err)
		}
	}
	h.ExcludeVarsFromSaving(o.grads...)
	if err := h.Save(); err != nil {
		return fmt.Errorf("lbgomlx: Save: %w", err)
	}
	o.pruneStates(h)
	return nil
}

// copyFile copies src to dst atomically (a temporary file, synced, then
// renamed).
func copyFile(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o770); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), filepath.Base(dst)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err = io.Copy(tmp, in); err != nil {
		return err
	}
	if err = tmp.Sync(); err != nil {
		return err
	}
	if err = tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}

// saveState writes the lowbit state to path; the checkpoint State returns
// is garbage once it returns.
func (o *Optimizer) saveState(path string) error {
	ck, err := o.opt.State()
	if err != nil {
		return fmt.Errorf("lbgomlx: Save: %w", err)
	}
	if err := optim.SaveFile(path, ck); err != nil {
		return fmt.Errorf("lbgomlx: Save: %w", err)
	}
	return nil
}

// pruneStates removes the state files of the steps of which h's directory
// holds no GoMLX checkpoint any more (checkpoint.Config.Keep removed
// them). A failure is logged, not returned: the checkpoint is saved.
func (o *Optimizer) pruneStates(h *checkpoint.Handler) {
	list, err := h.ListCheckpoints()
	if err == nil {
		kept := map[int64]bool{}
		for _, base := range list {
			if s, ok := checkpointStep(base); ok {
				kept[s] = true
			}
		}
		var steps []int64
		if steps, err = stateSteps(h.Dir()); err == nil {
			for _, s := range steps {
				if !kept[s] {
					if rerr := os.Remove(filepath.Join(h.Dir(), stateFileName(s))); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
						err = rerr
					}
				}
			}
		}
	}
	if err != nil {
		o.log.Warn("removing lowbit state files of checkpoints no longer kept", zap.String("dir", h.Dir()), zap.Error(err))
	}
}

// SaveOnStepFn returns a train.OnStepFn that calls Save(h): use it where a
// GoMLX program uses h.SaveOnStepFn, e.g. with train.EveryNSteps (which
// runs at the last step of a RunSteps only when it is a multiple of N:
// call Save(h) once more after the loop, which writes nothing when that
// step is saved already).
func (o *Optimizer) SaveOnStepFn(h *checkpoint.Handler) train.OnStepFn {
	return func(*train.Loop, []*tensors.Tensor) error { return o.Save(h) }
}
