// Package gomlx lets a GoMLX training loop average its gradients over
// data-parallel ranks with any lowbit optimizer (exact Adam or LAMB, 1-bit
// Adam, 1-bit LAMB, 0/1 Adam).
//
// A Trainer runs one step in three parts. The GoMLX graph computes the loss
// and the gradient of every trainable variable; the gradients are exported
// to the host, into the gradients of lowbit optim.Params; the lowbit
// optimizer's Step averages them over the ranks (exactly or compressed) and
// updates the parameters on the host; the new values are written back into
// the GoMLX variables. The graph never updates a trainable variable itself.
//
// On its first Step the Trainer builds the graph, which creates and
// initializes the variables, checks that every rank has the same trainable
// variables (names, shapes, dtypes), and broadcasts rank 0's initial values
// to every rank, so ranks whose initializers were seeded differently start
// alike. Only then is the optimizer built, by the function given to New.
//
// Every rank calls Step together. A step whose gradient is not finite on some
// rank is skipped on every rank by the lowbit optimizer (optim.Stats.Skipped
// counts it) and changes no variable. An error found on one rank before the
// optimizer runs (a variable that changed shape, a failed graph execution) is
// reported on every rank, through one small allreduce per step, and changes
// nothing on any rank, so no rank is left waiting in a collective.
//
// The package is a module of its own (github.com/lowbit-ml/lowbit/integrations/gomlx),
// so that lowbit's core keeps its small set of dependencies. It is pinned to
// GoMLX v0.28.2 and tested with GoMLX's pure-Go backend
// (github.com/gomlx/compute/gobackend); any backend works.
package gomlx

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"

	"github.com/gomlx/compute"
	"github.com/gomlx/compute/dtypes"
	"github.com/gomlx/compute/shapes"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// LossFn builds the graph of one batch's scalar loss from the inputs given
// to Step, creating or reusing the model's variables in scope. Like every
// GoMLX graph-building function it may panic; Step reports the panic as an
// error. Each rank's loss is that of its own shard of the batch; the lowbit
// optimizer averages the gradients over the ranks.
type LossFn func(scope *model.Scope, inputs []*graph.Node) *graph.Node

// NewOptimizer builds the lowbit optimizer over the trainable variables'
// parameters, communicating on c (every rank calls it together, with the
// context of Init or of the first Step): for example
//
//	func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
//		return onebit.NewAdam(ctx, c, p, onebit.DefaultAdamConfig())
//	}
type NewOptimizer func(ctx context.Context, c comm.Comm, params []*optim.Param) (optim.Optimizer, error)

// Trainer trains the trainable variables of one rank's GoMLX model.Store
// with a lowbit optimizer. It is used by one goroutine at a time.
type Trainer struct {
	c       comm.Comm
	backend compute.Backend
	store   *model.Store
	exec    *model.Exec
	newOpt  NewOptimizer

	opt    optim.Optimizer
	vars   []*model.Variable // trainable variables, in store order
	shapes []shapes.Shape    // their shapes when the optimizer was built
	params []*optim.Param    // one per variable, named by the variable's path

	flag    []float32 // the per-step error agreement, allocated once
	skipped int64
	closed  bool
}

// New returns a Trainer for the model whose loss is loss, with its variables
// in store, running graphs on backend and averaging over c (nil or a
// communicator of size 1 for a single process). newOpt builds the optimizer
// on the first Step, once the variables exist.
func New(c comm.Comm, backend compute.Backend, store *model.Store, loss LossFn, newOpt NewOptimizer) (*Trainer, error) {
	switch {
	case backend == nil:
		return nil, errors.New("gomlx: nil backend")
	case store == nil:
		return nil, errors.New("gomlx: nil model.Store")
	case loss == nil:
		return nil, errors.New("gomlx: nil loss function")
	case newOpt == nil:
		return nil, errors.New("gomlx: nil optimizer constructor")
	}
	t := &Trainer{c: c, backend: backend, store: store, newOpt: newOpt, flag: make([]float32, 1)}
	exec, err := model.NewExec(backend, store, func(scope *model.Scope, inputs []*graph.Node) []*graph.Node {
		l := loss(scope, inputs)
		if !l.IsScalar() {
			panic(fmt.Sprintf("gomlx: the loss must be a scalar, got shape %s", l.Shape()))
		}
		g := l.Graph()
		// The gradient of every trainable variable, in store order; a
		// variable this graph does not use gets a zero gradient.
		var used []*graph.Node
		var usedIdx []int
		var trainable []*model.Variable
		for v := range scope.Store().IterVariables() {
			if !v.Trainable {
				continue
			}
			if v.InUseByGraph(g) {
				used = append(used, v.NodeValue(g))
				usedIdx = append(usedIdx, len(trainable))
			}
			trainable = append(trainable, v)
		}
		grads := make([]*graph.Node, len(trainable))
		if len(used) > 0 {
			for i, gr := range graph.Gradient(l, used...) {
				grads[usedIdx[i]] = gr
			}
		}
		for i, v := range trainable {
			if grads[i] == nil {
				grads[i] = graph.Zeros(g, v.Shape())
			}
		}
		return append([]*graph.Node{graph.ConvertDType(l, dtypes.Float32)}, grads...)
	})
	if err != nil {
		return nil, fmt.Errorf("gomlx: %w", err)
	}
	t.exec = exec
	return t, nil
}

// Optimizer returns the lowbit optimizer, nil before Init or the first Step.
func (t *Trainer) Optimizer() optim.Optimizer { return t.opt }

// Close releases what the optimizer made for itself (see
// optim.Optimizer.Close); it does not close the communicator. It is not a
// collective, but every rank calls it once training is done (defer it
// after New). It is idempotent; Init and Step fail after it.
func (t *Trainer) Close() error {
	t.closed = true
	if t.opt == nil {
		return nil
	}
	return t.opt.Close()
}

// Params returns the lowbit parameters, one per trainable variable in the
// store's order and named by the variable's path; nil before Init or the
// first Step. Their values mirror the variables after every Step and Load.
func (t *Trainer) Params() []*optim.Param { return t.params }

// Step trains on one batch: inputs are the loss function's inputs
// (*tensors.Tensor or Go values GoMLX accepts), this rank's shard of the
// global batch. It returns this rank's loss. Every rank calls Step together.
// If the step is skipped because some rank's gradient was not finite, the
// variables are unchanged and Step returns the (non-finite, on that rank)
// loss and no error.
func (t *Trainer) Step(ctx context.Context, inputs ...any) (float32, error) {
	if err := t.Init(ctx, inputs...); err != nil {
		return 0, err
	}
	loss, localErr := t.gradients(inputs)
	// Agree on whether every rank got its gradients: 1 for a failure.
	t.flag[0] = 0
	if localErr != nil {
		t.flag[0] = 1
	}
	if t.c != nil && t.c.Size() > 1 {
		if err := t.c.AllReduce(ctx, t.flag, comm.Max); err != nil {
			return 0, fmt.Errorf("gomlx: %w", err)
		}
	}
	if localErr != nil {
		return 0, localErr
	}
	if t.flag[0] != 0 {
		return 0, errors.New("gomlx: another rank failed to compute its gradients; no variable changed")
	}
	if err := t.opt.Step(ctx); err != nil {
		return 0, fmt.Errorf("gomlx: %w", err)
	}
	if s := t.opt.Stats().Skipped; s != t.skipped {
		t.skipped = s
		return loss, nil
	}
	return loss, t.writeBack()
}

// checkVars reports a trainable variable that changed since the optimizer
// was built: added, removed, replaced, or reshaped.
func (t *Trainer) checkVars() error {
	i := 0
	for v := range t.store.IterVariables() {
		if !v.Trainable {
			continue
		}
		if i >= len(t.vars) || v != t.vars[i] {
			return fmt.Errorf("gomlx: the trainable variables changed since the first step (%q is new or moved); no variable changed", v.Path())
		}
		if s := v.Shape(); !s.Equal(t.shapes[i]) {
			return fmt.Errorf("gomlx: variable %q changed shape from %s to %s since the first step; no variable changed", v.Path(), t.shapes[i], s)
		}
		i++
	}
	if i != len(t.vars) {
		return fmt.Errorf("gomlx: %d trainable variables, %d at the first step; no variable changed", i, len(t.vars))
	}
	return nil
}

// gradients runs the graph and copies the gradients into the parameters'
// gradients. It changes no variable and communicates nothing.
func (t *Trainer) gradients(inputs []any) (loss float32, err error) {
	if err := t.checkVars(); err != nil {
		return 0, err
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("gomlx: graph execution: %v", r)
		}
	}()
	outs, err := t.exec.Exec(inputs...)
	if err != nil {
		return 0, fmt.Errorf("gomlx: graph execution: %w", err)
	}
	defer func() {
		for _, o := range outs {
			_ = o.FinalizeAll()
		}
	}()
	return t.export(outs)
}

// export checks the graph's outputs and copies the loss out and the
// gradients into the parameters' gradients.
func (t *Trainer) export(outs []*tensors.Tensor) (loss float32, err error) {
	if len(outs) != 1+len(t.params) {
		return 0, fmt.Errorf("gomlx: the graph has %d trainable variables, %d at the first step; no variable changed", len(outs)-1, len(t.params))
	}
	for i, p := range t.params {
		if s := outs[1+i].Shape(); !s.Equal(t.shapes[i]) {
			return 0, fmt.Errorf("gomlx: gradient of %q has shape %s, the variable %s; no variable changed", p.Name, s, t.shapes[i])
		}
	}
	if err := tensors.ConstFlatData(outs[0], func(f []float32) { loss = f[0] }); err != nil {
		return 0, fmt.Errorf("gomlx: %w", err)
	}
	for i, p := range t.params {
		g := p.GradData()
		if err := tensors.ConstFlatData(outs[1+i], func(f []float32) { copy(g, f) }); err != nil {
			return 0, fmt.Errorf("gomlx: %w", err)
		}
	}
	return loss, nil
}

// writeBack copies the parameters into the variables.
func (t *Trainer) writeBack() error {
	for i, v := range t.vars {
		val, err := v.Value()
		if err == nil {
			err = tensors.AssignFlatData(val, t.params[i].Data())
		}
		if err != nil {
			return fmt.Errorf("gomlx: writing %q back: %w", v.Path(), err)
		}
	}
	return nil
}

// Init prepares training without training: it builds the graph for the
// shapes of inputs (a batch like those Step gets), which creates the
// variables, initializes them, checks that every rank has the same trainable
// variables, broadcasts rank 0's values to every rank, and builds the
// optimizer. Every rank calls it together. Step calls it on first use; call
// it yourself to Load a checkpoint before the first Step. Once it has
// succeeded it does nothing.
func (t *Trainer) Init(ctx context.Context, inputs ...any) error {
	if t.closed {
		return fmt.Errorf("gomlx: Init: %w", optim.ErrClosed)
	}
	if t.opt != nil {
		return nil
	}
	localErr := t.collect(inputs)
	// Every rank sends the fingerprint of its variables (0 after a local
	// failure), so that a mismatch or a failure stops every rank.
	fp := make([]byte, 8)
	if localErr == nil {
		binary.LittleEndian.PutUint64(fp, t.fingerprint())
	}
	size := 1
	if t.c != nil {
		size = t.c.Size()
	}
	all := make([]byte, 8*size)
	copy(all, fp)
	if size > 1 {
		if err := t.c.AllGatherBytes(ctx, fp, all); err != nil {
			return fmt.Errorf("gomlx: %w", err)
		}
	}
	if localErr != nil {
		return localErr
	}
	for r := range size {
		if string(all[8*r:8*r+8]) == string(make([]byte, 8)) {
			return fmt.Errorf("gomlx: rank %d failed to build the model", r)
		}
		if string(all[8*r:8*r+8]) != string(fp) {
			return fmt.Errorf("gomlx: rank %d has other trainable variables (names, shapes or dtypes) than rank %d", r, t.rank())
		}
	}
	if size > 1 {
		for _, p := range t.params {
			if err := t.c.Broadcast(ctx, p.Data(), 0); err != nil {
				return fmt.Errorf("gomlx: broadcasting %q: %w", p.Name, err)
			}
		}
		if err := t.writeBack(); err != nil {
			return err
		}
	}
	opt, err := t.newOpt(ctx, t.c, t.params)
	if err != nil {
		return fmt.Errorf("gomlx: building the optimizer: %w", err)
	}
	if opt == nil {
		return errors.New("gomlx: the optimizer constructor returned nil")
	}
	t.opt = opt
	t.skipped = opt.Stats().Skipped
	return nil
}

// collect compiles the graph for inputs, initializes the variables and makes
// one parameter per trainable variable. It communicates nothing.
func (t *Trainer) collect(inputs []any) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("gomlx: building the graph: %v", r)
		}
	}()
	in := make([]shapes.Shape, len(inputs))
	for i, x := range inputs {
		tx, ok := x.(*tensors.Tensor)
		if !ok {
			if tx, err = tensors.FromAnyValue(x); err != nil {
				return fmt.Errorf("gomlx: input %d: %w", i, err)
			}
		}
		in[i] = tx.Shape()
	}
	if _, err := t.exec.Compile(in...); err != nil {
		return fmt.Errorf("gomlx: building the graph: %w", err)
	}
	if err := t.store.InitializeVariables(t.backend, nil); err != nil {
		return fmt.Errorf("gomlx: initializing the variables: %w", err)
	}
	var vars []*model.Variable
	var shp []shapes.Shape
	var params []*optim.Param
	for v := range t.store.IterVariables() {
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
	t.vars, t.shapes, t.params = vars, shp, params
	return nil
}

// fingerprint hashes the names, dtypes and shapes of the trainable variables.
func (t *Trainer) fingerprint() uint64 {
	h := fnv.New64a()
	for i, v := range t.vars {
		fmt.Fprintf(h, "%s|%s;", v.Path(), t.shapes[i])
	}
	s := h.Sum64()
	if s == 0 {
		s = 1 // 0 means a failed rank
	}
	return s
}

func (t *Trainer) rank() int {
	if t.c == nil {
		return 0
	}
	return t.c.Rank()
}

// State returns the optimizer's checkpoint (see optim.Optimizer.State);
// it fails before Init or the first Step.
func (t *Trainer) State() (*optim.Checkpoint, error) {
	if t.opt == nil {
		return nil, errors.New("gomlx: no optimizer before Init or the first Step")
	}
	return t.opt.State()
}

// Load restores a checkpoint made by State into the optimizer and writes
// the restored parameters into the variables. Call it after Init (or a
// Step), on every rank, each with its own rank's checkpoint. A refused checkpoint changes nothing.
func (t *Trainer) Load(ck *optim.Checkpoint) error {
	if t.opt == nil {
		return errors.New("gomlx: no optimizer before Init or the first Step")
	}
	if err := t.checkVars(); err != nil {
		return err
	}
	if err := t.opt.Load(ck); err != nil {
		return fmt.Errorf("gomlx: %w", err)
	}
	t.skipped = t.opt.Stats().Skipped
	return t.writeBack()
}
