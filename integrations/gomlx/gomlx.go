// Package gomlx trains a GoMLX model data-parallel with any lowbit optimizer
// (exact Adam or LAMB, 1-bit Adam, 1-bit LAMB, 0/1 Adam, sharded Adam)
// inside GoMLX's own training loop: train.NewTrainer, train.Loop, the
// progress bar, the metrics and the checkpoint package stay as they are.
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
//	opt, err := gomlx.New(ctx, c, func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
//		return onebit.NewAdam(ctx, c, p, onebit.DefaultAdamConfig())
//	})
//	defer opt.Close()
//	ckpt, err := opt.Checkpoint(checkpoint.Build(store).Keep(2), rankDir) // instead of checkpoint.Build(store).Dir(rankDir).Keep(2).Done()
//	trainer := train.NewTrainer(backend, store, modelFn, lossFn, opt, trainMetrics, evalMetrics) // opt instead of optimizer.Adam()...
//	loop := train.NewLoop(trainer)
//	opt.AttachToLoop(loop)                                           // new line
//	commandline.AttachProgressBar(loop)
//	train.EveryNSteps(loop, 100, "checkpoint", 100, opt.SaveOnStepFn(ckpt)) // instead of ckpt.SaveOnStepFn
//
// and each rank runs that code: a goroutine of local.Run, or a process of
// mpirun with mpi.Open, each with its own shard of every global batch and,
// for checkpoints, its own checkpoint directory.
//
// # Guarantees
//
// The first training graph built (the first TrainStep) initializes the
// variables, checks with one allgather that every rank has the same
// trainable variables (paths, shapes), broadcasts rank 0's values to every
// rank, and builds the lowbit optimizer, all before the first gradient is
// computed: every rank starts from rank 0's initial values whatever its
// initializers' seeds. Every rank builds its first training graph together.
//
// Each step's hook agrees with the other ranks on whether every rank got
// its gradients and whether every rank's loss is finite. Those two flags
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
	"hash/fnv"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"

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
// training graph is built. For example:
//
//	func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
//		return onebit.NewAdam(ctx, c, p, onebit.DefaultAdamConfig())
//	}
type Builder func(ctx context.Context, c comm.Comm, params []*optim.Param) (optim.Optimizer, error)

// Option configures New.
type Option func(*Optimizer)

// WithLogger logs what the Optimizer does once (initialization, a restored
// or a missing lowbit state) to l. The default is zap.NewNop().
func WithLogger(l *zap.Logger) Option {
	return func(o *Optimizer) {
		if l != nil {
			o.log = l
		}
	}
}

// WithManualStep declares that the program calls Step itself after every
// Trainer.TrainStep instead of attaching the Optimizer to a train.Loop.
// Without it (or AttachToLoop) the first training graph is refused: the
// variables would otherwise never change, without a word.
func WithManualStep() Option {
	return func(o *Optimizer) { o.manual = true }
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
	// sf carries the step's flags (flagFailed, flagLoss) in the lowbit
	// optimizer's own agreement; nil when the optimizer is not an
	// optim.FlagCarrier, and then flags is agreed on in an allreduce of
	// its own. Both are allocated once.
	sf       *optim.StepFlags
	flags    []float32
	loss     float64 // the loss of the step in progress, for the veto's error
	vetoed   bool    // the veto stopped the step in progress
	skipped  int64
	steps    int64 // Steps the hook ran (skipped included)
	restored bool  // whether the lowbit state came from a checkpoint
	closed   bool
	attached bool // AttachToLoop was called
	manual   bool // WithManualStep: the program calls Step itself
}

var _ optimizer.Interface = (*Optimizer)(nil)

// The flags of the per-step agreement: 1 when this rank failed to get its
// gradients (it refuses the step), 1 when its loss is not finite.
const (
	flagFailed = iota
	flagLoss
	numFlags
)

// New returns an Optimizer that averages over c (nil or a communicator of
// size 1 for a single process) with the lowbit optimizer build returns.
// ctx is the context of every collective the Optimizer runs (GoMLX's
// interfaces carry none): give it a deadline or cancel it to bound a wait
// for a rank that is gone.
func New(ctx context.Context, c comm.Comm, build Builder, opts ...Option) (*Optimizer, error) {
	switch {
	case ctx == nil:
		return nil, errors.New("gomlx: nil context")
	case build == nil:
		return nil, errors.New("gomlx: nil optimizer builder")
	}
	o := &Optimizer{ctx: ctx, c: c, build: build, log: zap.NewNop(), flags: make([]float32, numFlags)}
	for _, opt := range opts {
		opt(o)
	}
	return o, nil
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
			return errors.New("gomlx: the training step returned no metrics")
		}
		loss := math.NaN()
		if err := tensors.ConstFlatData(metrics[0], func(f []float32) { loss = float64(f[0]) }); err != nil {
			// A loss of another dtype.
			v, ok := metrics[0].Value().(float64)
			if !ok {
				return fmt.Errorf("gomlx: reading the loss: %w", err)
			}
			loss = v
		}
		return o.Step(loss)
	})
}

// UpdateGraph implements optimizer.Interface: it hands the gradient of
// every trainable variable out of the graph (a variable the loss does not
// use gets zeros). The first call also initializes the variables,
// broadcasts rank 0's values, builds the lowbit optimizer and restores its
// state from a loaded checkpoint, communicating with the other ranks, which
// build their first training graph at the same time. Like every GoMLX graph
// building function it panics on error.
func (o *Optimizer) UpdateGraph(scope *model.Scope, g *graph.Graph, loss *graph.Node) {
	store := scope.Store()
	if o.failed != nil {
		panic(o.failed)
	}
	if o.closed {
		panic(fmt.Errorf("gomlx: %w", optim.ErrClosed))
	}
	if !loss.IsScalar() {
		panic(fmt.Errorf("gomlx: the loss must be a scalar, got shape %s", loss.Shape()))
	}
	if !o.attached && !o.manual {
		panic(errors.New("gomlx: the Optimizer runs no step: call opt.AttachToLoop(loop) before the loop runs " +
			"(or make it with WithManualStep and call opt.Step after every TrainStep)"))
	}
	if o.store == nil {
		if err := o.init(store, g.Backend()); err != nil {
			o.failed = err
			panic(err)
		}
	} else if store != o.store {
		panic(errors.New("gomlx: the Optimizer is used with a second model.Store"))
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
		return fmt.Errorf("gomlx: %w", err)
	}
	if err := store.DeleteVariable(StateVariable); err != nil {
		return fmt.Errorf("gomlx: %w", err)
	}
	return nil
}

// Step runs the lowbit step of one training step, with this rank's loss:
// it reads the gradients the graph handed out, agrees with the other ranks
// (in the lowbit optimizer's own per-step agreement, see the package
// documentation), runs the lowbit optimizer and writes the new values into
// the variables, then increments GoMLX's global step. AttachToLoop calls it
// after every TrainStep; in a loop of your own, make the Optimizer
// WithManualStep and call it after every Trainer.TrainStep. Every rank
// calls it together.
func (o *Optimizer) Step(loss float64) error {
	if o.closed {
		return fmt.Errorf("gomlx: %w", optim.ErrClosed)
	}
	if o.failed != nil {
		return o.failed
	}
	if o.opt == nil {
		return errors.New("gomlx: Step before the first training graph was built")
	}
	localErr := o.pending
	if localErr == nil {
		localErr = o.checkVars()
	}
	if localErr == nil {
		localErr = o.readGradients()
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
	if s := o.opt.Stats().Skipped; s != o.skipped {
		o.skipped = s
	} else if err := o.writeBack(); err != nil {
		return err
	}
	return o.setGlobalStep(o.globalStep() + 1)
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
}

// carriedStep runs the lowbit optimizer's Step with the flags carried in
// its agreement: a rank with localErr refuses the step there, and veto
// stops it on every rank when some loss is not finite, before anything
// changes.
func (o *Optimizer) carriedStep(localErr error) error {
	sf := o.sf
	o.setFlags(sf.Local, localErr)
	sf.Agreed[flagFailed], sf.Agreed[flagLoss] = 0, 0
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
		return fmt.Errorf("gomlx: another rank failed to get its gradients; no variable changed: %w", err)
	}
	return fmt.Errorf("gomlx: %w", err)
}

// veto is the StepFlags.Veto of the carried flags: it stops the step on
// every rank when some rank's loss is not finite.
func (o *Optimizer) veto(agreed []float32) error {
	if agreed[flagLoss] == 0 {
		return nil
	}
	o.vetoed = true
	return o.lossError()
}

func (o *Optimizer) lossError() error {
	return fmt.Errorf("gomlx: step %d: the loss is not finite on some rank (here %g); the step is skipped on every rank and no variable changed",
		o.globalStep(), o.loss)
}

// ownStep agrees on the flags in an allreduce of its own, then runs the
// lowbit optimizer's Step: the path of an optimizer that cannot carry
// them.
func (o *Optimizer) ownStep(localErr error) error {
	o.setFlags(o.flags, localErr)
	if o.size() > 1 {
		if err := o.c.AllReduce(o.ctx, o.flags, comm.Max); err != nil {
			return errors.Join(localErr, fmt.Errorf("gomlx: %w", err))
		}
	}
	switch {
	case localErr != nil:
		return localErr
	case o.flags[flagFailed] != 0:
		return errors.New("gomlx: another rank failed to get its gradients; no variable changed")
	case o.flags[flagLoss] != 0:
		return o.lossError()
	}
	if err := o.opt.Step(o.ctx); err != nil {
		return fmt.Errorf("gomlx: %w", err)
	}
	return nil
}

// readGradients copies the gradient variables into the parameters'
// gradients.
func (o *Optimizer) readGradients() error {
	for i, p := range o.params {
		val, err := o.grads[i].Value()
		if err != nil {
			return fmt.Errorf("gomlx: gradient of %q: %w; no variable changed", p.Name, err)
		}
		if s := val.Shape(); !s.Equal(o.shapes[i]) {
			return fmt.Errorf("gomlx: gradient of %q has shape %s, the variable %s; no variable changed", p.Name, s, o.shapes[i])
		}
		g := p.GradData()
		if err := tensors.ConstFlatData(val, func(f []float32) { copy(g, f) }); err != nil {
			return fmt.Errorf("gomlx: gradient of %q: %w; no variable changed", p.Name, err)
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
			return fmt.Errorf("gomlx: the trainable variables changed since the first training graph (%q is new or moved); no variable changed", v.Path())
		}
		if s := v.Shape(); !s.Equal(o.shapes[i]) {
			return fmt.Errorf("gomlx: variable %q changed shape from %s to %s since the first training graph; no variable changed", v.Path(), o.shapes[i], s)
		}
		i++
	}
	if i != len(o.vars) {
		return fmt.Errorf("gomlx: %d trainable variables, %d at the first training graph; no variable changed", i, len(o.vars))
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
			return fmt.Errorf("gomlx: writing %q back: %w", v.Path(), err)
		}
	}
	return nil
}

func (o *Optimizer) globalStep() int64 {
	v := optimizer.GetGlobalStepVar(o.store)
	val, err := v.Value()
	if err != nil {
		return 0
	}
	s, _ := val.Value().(int64)
	return s
}

func (o *Optimizer) setGlobalStep(s int64) error {
	if err := optimizer.GetGlobalStepVar(o.store).SetValue(tensors.FromScalar(s)); err != nil {
		return fmt.Errorf("gomlx: global step: %w", err)
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
// broadcasts rank 0's values, builds the lowbit optimizer and restores its
// state.
func (o *Optimizer) init(store *model.Store, backend compute.Backend) error {
	localErr := o.collect(store, backend)
	// Every rank sends the fingerprint of its variables (0 after a local
	// failure) and its global step, so that a mismatch or a failure stops
	// every rank.
	const rec = 16
	mine := make([]byte, rec)
	if localErr == nil {
		binary.LittleEndian.PutUint64(mine, o.fingerprint())
		binary.LittleEndian.PutUint64(mine[8:], uint64(o.globalStep()))
	}
	size := o.size()
	all := make([]byte, rec*size)
	copy(all, mine)
	if size > 1 {
		if err := o.c.AllGatherBytes(o.ctx, mine, all); err != nil {
			return errors.Join(localErr, fmt.Errorf("gomlx: %w", err))
		}
	}
	if localErr != nil {
		return localErr
	}
	for r := range size {
		switch got := binary.LittleEndian.Uint64(all[rec*r:]); {
		case got == 0:
			return fmt.Errorf("gomlx: rank %d failed to build the model", r)
		case got != binary.LittleEndian.Uint64(mine):
			return fmt.Errorf("gomlx: rank %d has other trainable variables (paths, shapes) than rank %d", r, o.rank())
		}
	}
	if err := checkSteps(all, rec, size); err != nil {
		return err
	}
	if size > 1 {
		for _, p := range o.params {
			if err := o.c.Broadcast(o.ctx, p.Data(), 0); err != nil {
				return fmt.Errorf("gomlx: broadcasting %q: %w", p.Name, err)
			}
		}
		if err := o.writeBack(); err != nil {
			return err
		}
	}
	opt, err := o.build(o.ctx, o.c, o.params)
	if err != nil {
		return fmt.Errorf("gomlx: building the optimizer: %w", err)
	}
	if opt == nil {
		return errors.New("gomlx: the optimizer builder returned nil")
	}
	o.opt = opt
	o.skipped = opt.Stats().Skipped
	err = o.carryFlags()
	if err == nil {
		err = o.restore()
	}
	if err != nil {
		_ = opt.Close()
		o.opt, o.sf = nil, nil
		return err
	}
	o.log.Info("lowbit optimizer ready", zap.Int("rank", o.rank()), zap.Int("ranks", size),
		zap.Int("variables", len(o.vars)), zap.Bool("restored", o.restored),
		zap.Int64("global_step", o.globalStep()), zap.Bool("flags_carried", o.sf != nil))
	return nil
}

// checkSteps refuses ranks whose models are at different global steps:
// every rank loaded its own newest checkpoint, and they are not of the
// same step. all holds each rank's record of rec bytes, the step at 8.
func checkSteps(all []byte, rec, size int) error {
	steps := make([]int64, size)
	same := true
	for r := range size {
		steps[r] = int64(binary.LittleEndian.Uint64(all[rec*r+8:]))
		same = same && steps[r] == steps[0]
	}
	if same {
		return nil
	}
	var b strings.Builder
	for r, s := range steps {
		if r > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "rank %d at %d", r, s)
	}
	return fmt.Errorf("gomlx: the ranks' models are at different global steps (%s): each rank loaded its own newest checkpoint. "+
		"Build every rank's checkpoint.Handler with Optimizer.Checkpoint, which resumes every rank from the newest step they all hold, "+
		"or delete every rank's checkpoints to start afresh", b.String())
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
		return fmt.Errorf("gomlx: %w", err)
	}
	o.sf = sf
	return nil
}

// restore loads the lowbit state that came with the loaded checkpoint,
// if any; the ranks agree on the outcome.
func (o *Optimizer) restore() error {
	localErr := o.restoreLocal()
	o.flags[0] = 0
	if localErr != nil {
		o.flags[0] = 1
	}
	if o.size() > 1 {
		if err := o.c.AllReduce(o.ctx, o.flags[:1], comm.Max); err != nil {
			return errors.Join(localErr, fmt.Errorf("gomlx: %w", err))
		}
	}
	if localErr != nil {
		return localErr
	}
	if o.flags[0] != 0 {
		return errors.New("gomlx: another rank refused its checkpoint's lowbit state")
	}
	return nil
}

// restoreLocal loads into the lowbit optimizer the state of the model's
// global step: from the StateVariable of an older checkpoint (which it
// then removes from the store, so that it neither stays resident nor is
// saved again), or from the state file of that step.
func (o *Optimizer) restoreLocal() error {
	gs := o.globalStep()
	var ck *optim.Checkpoint
	if sv := o.store.GetVariable(StateVariable); sv != nil {
		var err error
		ck, err = o.legacyState(sv, gs)
		if derr := o.store.DeleteVariable(StateVariable); err == nil && derr != nil {
			err = fmt.Errorf("gomlx: removing %s: %w", StateVariable, derr)
		}
		if err != nil {
			return err
		}
	} else {
		var err error
		if ck, err = o.stateFile(gs); err != nil || ck == nil {
			return err
		}
	}
	if err := o.opt.Load(ck); err != nil {
		return fmt.Errorf("gomlx: restoring the lowbit state: %w", err)
	}
	o.skipped = o.opt.Stats().Skipped
	o.restored = true
	return o.writeBack()
}

// legacyState decodes the state an older checkpoint held in sv, in place.
func (o *Optimizer) legacyState(sv *model.Variable, gs int64) (*optim.Checkpoint, error) {
	val, err := sv.Value()
	if err != nil {
		return nil, fmt.Errorf("gomlx: %s: %w", StateVariable, err)
	}
	ck := new(optim.Checkpoint)
	var derr error
	if err := tensors.ConstFlatData(val, func(b []uint8) {
		if len(b) < 8 {
			derr = fmt.Errorf("gomlx: %s holds %d bytes: %w", StateVariable, len(b), optim.ErrCorruptCheckpoint)
			return
		}
		if step := int64(binary.LittleEndian.Uint64(b)); step != gs {
			derr = fmt.Errorf("gomlx: the checkpoint's lowbit state is from global step %d, its model from step %d (save with Optimizer.Save, not Handler.Save): %w",
				step, gs, optim.ErrIncompatibleCheckpoint)
			return
		}
		if err := ck.UnmarshalBinary(b[8:]); err != nil {
			derr = fmt.Errorf("gomlx: %s: %w", StateVariable, err)
		}
	}); err != nil {
		return nil, fmt.Errorf("gomlx: %s: %w", StateVariable, err)
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
		if gs > 0 {
			o.log.Warn("the model is at a global step > 0 but no checkpoint directory holds its lowbit state: the lowbit optimizer starts afresh",
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
		return nil, fmt.Errorf("gomlx: %w", err)
	}
	if list, err := h.ListCheckpoints(); err != nil || len(list) == 0 {
		return nil, nil // nothing was loaded: a fresh start
	}
	steps, err := stateSteps(dir)
	if err != nil {
		return nil, fmt.Errorf("gomlx: %w", err)
	}
	if len(steps) > 0 {
		return nil, fmt.Errorf("gomlx: the checkpoint's lowbit state is from global step %d, its model from step %d (save with Optimizer.Save, not Handler.Save; %s holds no %s): %w",
			steps[len(steps)-1], gs, dir, stateFileName(gs), optim.ErrIncompatibleCheckpoint)
	}
	o.log.Warn("the model's checkpoint holds no lowbit state: the lowbit optimizer starts afresh", zap.Int64("global_step", gs), zap.String("dir", dir))
	return nil, nil
}

// collect initializes the variables and makes one parameter and one
// gradient variable per trainable variable. It communicates nothing.
func (o *Optimizer) collect(store *model.Store, backend compute.Backend) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("gomlx: initializing the variables: %v", r)
		}
	}()
	o.store = store
	if sv := store.GetVariable(StateVariable); sv != nil {
		sv.SetTrainable(false) // a loaded variable starts trainable
	}
	if err := store.InitializeVariables(backend, nil); err != nil {
		return fmt.Errorf("gomlx: initializing the variables: %w", err)
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
			return fmt.Errorf("gomlx: trainable variable %q is %s; lowbit trains float32 variables", v.Path(), s.DType)
		}
		val, err := v.Value()
		if err != nil {
			return fmt.Errorf("gomlx: %w", err)
		}
		var data []float32
		if err := tensors.ConstFlatData(val, func(f []float32) { data = append([]float32(nil), f...) }); err != nil {
			return fmt.Errorf("gomlx: %q: %w", v.Path(), err)
		}
		dims := s.Dimensions
		if len(dims) == 0 {
			dims = []int{1} // a scalar: one element
		}
		p, err := optim.NewParamFrom(v.Path(), data, dims...)
		if err != nil {
			return fmt.Errorf("gomlx: %q: %w", v.Path(), err)
		}
		vars, shp, params = append(vars, v), append(shp, s.Clone()), append(params, p)
	}
	if len(params) == 0 {
		return errors.New("gomlx: the model has no trainable variables")
	}
	for i, v := range vars {
		gv, err := store.CreateVariable(GradientScope+v.Path(), tensors.FromShape(shp[i]))
		if err != nil {
			return fmt.Errorf("gomlx: %w", err)
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

// fingerprint hashes the paths and shapes of the trainable variables.
func (o *Optimizer) fingerprint() uint64 {
	h := fnv.New64a()
	for i, v := range o.vars {
		fmt.Fprintf(h, "%s|%s;", v.Path(), o.shapes[i])
	}
	s := h.Sum64()
	if s == 0 {
		s = 1 // 0 means a failed rank
	}
	return s
}

// Save saves a checkpoint of this rank with h: the lowbit optimizer's
// state of the current global step to its state file in h's directory
// (written atomically, see StateFilePrefix), then the model with
// checkpoint.Handler.Save, without the gradient variables; then it removes
// the state files of the steps whose GoMLX checkpoint h no longer keeps.
// The state is streamed to its file: beyond the optimizer it costs one
// copy of the state (optim.Optimizer's State) while Save runs, and nothing
// afterwards. It is not a collective: each rank saves its own state, to
// its own directory.
func (o *Optimizer) Save(h *checkpoint.Handler) error {
	if h == nil {
		return errors.New("gomlx: nil checkpoint.Handler")
	}
	if o.opt == nil {
		return errors.New("gomlx: Save before the first training graph was built")
	}
	dir := h.Dir()
	if dir == "" {
		return fmt.Errorf("gomlx: %s has no directory to save the lowbit state to", h)
	}
	if err := o.saveState(filepath.Join(dir, stateFileName(o.globalStep()))); err != nil {
		return err
	}
	h.ExcludeVarsFromSaving(o.grads...)
	if err := h.Save(); err != nil {
		return fmt.Errorf("gomlx: %w", err)
	}
	o.pruneStates(h)
	return nil
}

// saveState writes the lowbit state to path; the checkpoint State returns
// is garbage once it returns.
func (o *Optimizer) saveState(path string) error {
	ck, err := o.opt.State()
	if err != nil {
		return fmt.Errorf("gomlx: %w", err)
	}
	if err := optim.SaveFile(path, ck); err != nil {
		return fmt.Errorf("gomlx: %w", err)
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
// GoMLX program uses h.SaveOnStepFn, e.g. with train.EveryNSteps.
func (o *Optimizer) SaveOnStepFn(h *checkpoint.Handler) train.OnStepFn {
	return func(*train.Loop, []*tensors.Tensor) error { return o.Save(h) }
}
