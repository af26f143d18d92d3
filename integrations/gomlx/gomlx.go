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
// Each step's hook agrees with the other ranks, in one two-element
// allreduce, on whether every rank got its gradients and whether every
// rank's loss is finite. An error on one rank (a trainable variable added
// or reshaped since the first graph, a gradient that cannot be read) is
// returned on every rank and changes nothing on any rank. A step whose loss
// is not finite on some rank changes nothing and stops the loop on every
// rank with an error (GoMLX's train.Loop stops on a non-finite loss; this
// makes every rank stop, not only the one that saw it). A step whose
// gradient is not finite on some rank while every loss is finite is skipped
// on every rank by the lowbit optimizer (optim.Stats.Skipped counts it) and
// the loop goes on.
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
// The lowbit optimizer's state (moments, error buffers, counters: an
// optim.Checkpoint) is saved in the GoMLX checkpoint, as the non-trainable
// uint8 variable /lowbit/optimizer_state, by Save or SaveOnStepFn, which
// write the state into that variable and then call checkpoint.Handler.Save.
// The gradient variables are excluded from the checkpoint. Loading needs
// nothing new: checkpoint.Build(store).Dir(dir).Done() before the first
// step, as usual; the first training graph restores the lowbit state from
// the loaded variable, and the run continues bit-identically. The state is
// per rank (1-bit error buffers, sharded moments), so every rank saves to
// and loads from its own directory. A checkpoint made by another optimizer,
// another number of ranks, another rank or another model is refused on
// every rank with an error, and the lowbit optimizer is not changed. A
// checkpoint saved with Handler.Save directly (whose lowbit state, if any,
// is from another step) is refused too.
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
	"math"

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
	// StateVariable is the path of the non-trainable uint8 variable that
	// holds the lowbit optimizer's state in a GoMLX checkpoint: the global
	// step (8 bytes, little-endian) followed by the optim.Checkpoint in its
	// binary form.
	StateVariable = "/lowbit/optimizer_state"
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

	store    *model.Store
	opt      optim.Optimizer
	vars     []*model.Variable // trainable variables, in store order
	shapes   []shapes.Shape    // their shapes at the first graph
	params   []*optim.Param    // one per variable, named by its path
	grads    []*model.Variable // the gradient variables, one per trainable variable
	failed   error             // set when the first graph failed: Optimizer unusable
	pending  error             // a local error found while building a later graph
	flags    []float32         // the per-step agreement, allocated once
	skipped  int64
	steps    int64 // Steps the hook ran (skipped included)
	restored bool  // whether the lowbit state came from a checkpoint
	closed   bool
	attached bool // AttachToLoop was called
	manual   bool // WithManualStep: the program calls Step itself
}

var _ optimizer.Interface = (*Optimizer)(nil)

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
	o := &Optimizer{ctx: ctx, c: c, build: build, log: zap.NewNop(), flags: make([]float32, 2)}
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
// it reads the gradients the graph handed out, agrees with the other ranks,
// runs the lowbit optimizer and writes the new values into the variables,
// then increments GoMLX's global step. AttachToLoop calls it after every
// TrainStep; in a loop of your own, make the Optimizer WithManualStep and
// call it after every Trainer.TrainStep. Every rank calls it together.
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
	o.flags[0], o.flags[1] = 0, 0
	if localErr != nil {
		o.flags[0] = 1
	}
	if math.IsNaN(loss) || math.IsInf(loss, 0) {
		o.flags[1] = 1
	}
	if o.c != nil && o.c.Size() > 1 {
		if err := o.c.AllReduce(o.ctx, o.flags, comm.Max); err != nil {
			return fmt.Errorf("gomlx: %w", err)
		}
	}
	switch {
	case localErr != nil:
		return localErr
	case o.flags[0] != 0:
		return errors.New("gomlx: another rank failed to get its gradients; no variable changed")
	case o.flags[1] != 0:
		return fmt.Errorf("gomlx: step %d: the loss is not finite on some rank (here %g); the step is skipped on every rank and no variable changed", o.globalStep(), loss)
	}
	if err := o.opt.Step(o.ctx); err != nil {
		return fmt.Errorf("gomlx: %w", err)
	}
	o.steps++
	if s := o.opt.Stats().Skipped; s != o.skipped {
		o.skipped = s
	} else if err := o.writeBack(); err != nil {
		return err
	}
	return o.setGlobalStep(o.globalStep() + 1)
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
// variables, agrees on them with the other ranks, broadcasts rank 0's
// values, builds the lowbit optimizer and restores its state.
func (o *Optimizer) init(store *model.Store, backend compute.Backend) error {
	localErr := o.collect(store, backend)
	// Every rank sends the fingerprint of its variables (0 after a local
	// failure), so that a mismatch or a failure stops every rank.
	fp := make([]byte, 8)
	if localErr == nil {
		binary.LittleEndian.PutUint64(fp, o.fingerprint())
	}
	size := o.size()
	all := make([]byte, 8*size)
	copy(all, fp)
	if size > 1 {
		if err := o.c.AllGatherBytes(o.ctx, fp, all); err != nil {
			return fmt.Errorf("gomlx: %w", err)
		}
	}
	if localErr != nil {
		return localErr
	}
	for r := range size {
		switch got := binary.LittleEndian.Uint64(all[8*r:]); {
		case got == 0:
			return fmt.Errorf("gomlx: rank %d failed to build the model", r)
		case got != binary.LittleEndian.Uint64(fp):
			return fmt.Errorf("gomlx: rank %d has other trainable variables (paths, shapes) than rank %d", r, o.rank())
		}
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
	if err := o.restore(); err != nil {
		_ = opt.Close()
		o.opt = nil
		return err
	}
	o.log.Info("lowbit optimizer ready", zap.Int("rank", o.rank()), zap.Int("ranks", size),
		zap.Int("variables", len(o.vars)), zap.Bool("restored", o.restored))
	return nil
}

// restore loads the lowbit state from the state variable a GoMLX
// checkpoint brought, if any; the ranks agree on the outcome.
func (o *Optimizer) restore() error {
	localErr := o.restoreLocal()
	o.flags[0] = 0
	if localErr != nil {
		o.flags[0] = 1
	}
	if o.size() > 1 {
		if err := o.c.AllReduce(o.ctx, o.flags[:1], comm.Max); err != nil {
			return fmt.Errorf("gomlx: %w", err)
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

func (o *Optimizer) restoreLocal() error {
	sv := o.store.GetVariable(StateVariable) // a loaded checkpoint's value, if any
	if sv == nil {
		if s := o.globalStep(); s > 0 {
			o.log.Warn("the model is at a global step > 0 but holds no lowbit state: the lowbit optimizer starts afresh", zap.Int64("global_step", s))
		}
		return nil
	}
	sv.SetTrainable(false)
	val, err := sv.Value()
	if err != nil {
		return fmt.Errorf("gomlx: %s: %w", StateVariable, err)
	}
	var b []byte
	if err := tensors.ConstFlatData(val, func(f []uint8) { b = append([]byte(nil), f...) }); err != nil {
		return fmt.Errorf("gomlx: %s: %w", StateVariable, err)
	}
	if len(b) < 8 {
		return fmt.Errorf("gomlx: %s holds %d bytes: %w", StateVariable, len(b), optim.ErrCorruptCheckpoint)
	}
	step := int64(binary.LittleEndian.Uint64(b))
	if gs := o.globalStep(); gs != step {
		return fmt.Errorf("gomlx: the checkpoint's lowbit state is from global step %d, its model from step %d (save with Optimizer.Save, not Handler.Save): %w",
			step, gs, optim.ErrIncompatibleCheckpoint)
	}
	ck := new(optim.Checkpoint)
	if err := ck.UnmarshalBinary(b[8:]); err != nil {
		return fmt.Errorf("gomlx: %s: %w", StateVariable, err)
	}
	if err := o.opt.Load(ck); err != nil {
		return fmt.Errorf("gomlx: restoring the lowbit state: %w", err)
	}
	o.skipped = o.opt.Stats().Skipped
	o.restored = true
	return o.writeBack()
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

// Save writes the lowbit optimizer's state into the store's StateVariable
// and saves a GoMLX checkpoint with h (checkpoint.Handler.Save), without
// the gradient variables. It is not a collective: each rank saves its own
// state, to its own directory.
func (o *Optimizer) Save(h *checkpoint.Handler) error {
	if h == nil {
		return errors.New("gomlx: nil checkpoint.Handler")
	}
	if o.opt == nil {
		return errors.New("gomlx: Save before the first training graph was built")
	}
	ck, err := o.opt.State()
	if err != nil {
		return fmt.Errorf("gomlx: %w", err)
	}
	b, err := ck.MarshalBinary()
	if err != nil {
		return fmt.Errorf("gomlx: %w", err)
	}
	buf := make([]byte, 8+len(b))
	binary.LittleEndian.PutUint64(buf, uint64(o.globalStep()))
	copy(buf[8:], b)
	t := tensors.FromFlatDataAndDimensions(buf, len(buf))
	if sv := o.store.GetVariable(StateVariable); sv != nil {
		if err := sv.SetValue(t); err != nil {
			return fmt.Errorf("gomlx: %w", err)
		}
		sv.SetTrainable(false)
	} else {
		sv, err := o.store.CreateVariable(StateVariable, t)
		if err != nil {
			return fmt.Errorf("gomlx: %w", err)
		}
		sv.SetTrainable(false)
	}
	h.ExcludeVarsFromSaving(o.grads...)
	if err := h.Save(); err != nil {
		return fmt.Errorf("gomlx: %w", err)
	}
	return nil
}

// SaveOnStepFn returns a train.OnStepFn that calls Save(h): use it where a
// GoMLX program uses h.SaveOnStepFn, e.g. with train.EveryNSteps.
func (o *Optimizer) SaveOnStepFn(h *checkpoint.Handler) train.OnStepFn {
	return func(*train.Loop, []*tensors.Tensor) error { return o.Save(h) }
}
