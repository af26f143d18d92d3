// Package gorgonia adapts lowbit's optimizers to Gorgonia: a Solver is a
// gorgonia.Solver whose Step averages the gradients over data-parallel
// ranks with any lowbit optimizer (exact Adam or LAMB, 1-bit Adam, 1-bit
// LAMB, 0/1 Adam) and updates the values.
//
// lowbit's optim.Param wraps Gorgonia's own *tensor.Dense, so the Solver
// hands the nodes' value and gradient tensors to the optimizer as they are:
// nothing is copied. Like Gorgonia's own solvers, Step zeroes the gradients
// after using them.
//
// The package is a module of its own
// (github.com/lowbit-ml/lowbit/integrations/gorgonia), so that lowbit's
// core does not depend on gorgonia.org/gorgonia. It is pinned to Gorgonia
// v0.9.18; binaries built with Go 1.26 need
// go4.org/unsafe/assume-no-moving-gc v0.0.0-20231121144256-b99613f794b6
// or newer, which this module's go.mod requires.
package gorgonia

import (
	"context"
	"errors"
	"fmt"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// NewOptimizer builds the lowbit optimizer over the model's parameters,
// communicating on c (every rank calls it together, with the context of
// Init or of the first Step), for example
//
//	func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
//		return onebit.NewAdam(ctx, c, p, onebit.DefaultAdamConfig())
//	}
type NewOptimizer func(ctx context.Context, c comm.Comm, params []*optim.Param) (optim.Optimizer, error)

// Solver implements gorgonia.Solver with a lowbit optimizer. It is used by
// one goroutine at a time, one Solver per rank.
type Solver struct {
	ctx    context.Context
	c      comm.Comm
	newOpt NewOptimizer

	opt    optim.Optimizer
	params []*optim.Param
	shapes []tensor.Shape
	flag   []float32 // the per-step error agreement, allocated once
	closed bool
}

var _ G.Solver = (*Solver)(nil)

// NewSolver returns a Solver averaging over c (nil or a communicator of
// size 1 for a single process). newOpt builds the optimizer at Init or the
// first Step. gorgonia.Solver's Step takes no context, so ctx bounds the
// collectives of every Step; StepContext takes its own.
func NewSolver(ctx context.Context, c comm.Comm, newOpt NewOptimizer) (*Solver, error) {
	if ctx == nil {
		return nil, errors.New("gorgonia: nil context")
	}
	if newOpt == nil {
		return nil, errors.New("gorgonia: nil optimizer constructor")
	}
	return &Solver{ctx: ctx, c: c, newOpt: newOpt, flag: make([]float32, 1)}, nil
}

// Optimizer returns the lowbit optimizer, nil before Init or the first Step.
func (s *Solver) Optimizer() optim.Optimizer { return s.opt }

// Close releases what the optimizer made for itself (see
// optim.Optimizer.Close); it does not close the communicator. It is not a
// collective, but every rank calls it once training is done (defer it
// after NewSolver). It is idempotent; Init and Step fail after it.
func (s *Solver) Close() error {
	s.closed = true
	if s.opt == nil {
		return nil
	}
	return s.opt.Close()
}

// Params returns the parameters given to the optimizer (sharing the nodes'
// tensors), nil before Init or the first Step.
func (s *Solver) Params() []*optim.Param { return s.params }

// Init checks that every rank has the same model (sizes and order of the
// values), broadcasts rank 0's values to every rank, and builds the
// optimizer. Every rank calls it together, before the first forward pass, so
// that the first gradients are computed from the same values everywhere;
// Step calls it if it was not called. Once it has succeeded it does nothing.
func (s *Solver) Init(ctx context.Context, model []G.ValueGrad) error {
	if s.closed {
		return fmt.Errorf("gorgonia: Init: %w", optim.ErrClosed)
	}
	if s.opt != nil {
		return nil
	}
	params, shapes, localErr := collect(model)
	// Every rank sends its element counts (-1 after a local failure) so
	// that a mismatch or a failure stops every rank.
	sizes := make([]float32, 1+len(params))
	sizes[0] = float32(len(params))
	for i, p := range params {
		sizes[1+i] = float32(p.Numel())
	}
	if localErr != nil {
		sizes = []float32{-1}
	}
	if err := s.agree(ctx, sizes); err != nil || localErr != nil {
		if localErr != nil {
			return localErr
		}
		return err
	}
	if s.c != nil && s.c.Size() > 1 {
		for _, p := range params {
			if err := s.c.Broadcast(ctx, p.Data(), 0); err != nil {
				return fmt.Errorf("gorgonia: broadcasting %q: %w", p.Name, err)
			}
		}
	}
	opt, err := s.newOpt(ctx, s.c, params)
	if err != nil {
		return fmt.Errorf("gorgonia: building the optimizer: %w", err)
	}
	if opt == nil {
		return errors.New("gorgonia: the optimizer constructor returned nil")
	}
	s.opt, s.params, s.shapes = opt, params, shapes
	return nil
}

// agree checks that mine is the same on every rank: the ranks exchange its
// length, then its elements (the maximum and the negated minimum).
func (s *Solver) agree(ctx context.Context, mine []float32) error {
	if s.c == nil || s.c.Size() == 1 {
		if len(mine) == 1 && mine[0] < 0 {
			return errors.New("gorgonia: this rank failed")
		}
		return nil
	}
	n := []float32{float32(len(mine)), -float32(len(mine))}
	if err := s.c.AllReduce(ctx, n, comm.Max); err != nil {
		return fmt.Errorf("gorgonia: %w", err)
	}
	if n[0] != -n[1] {
		return errors.New("gorgonia: the ranks' models differ (or a rank failed to read its model)")
	}
	both := make([]float32, 2*len(mine))
	for i, v := range mine {
		both[i], both[len(mine)+i] = v, -v
	}
	if err := s.c.AllReduce(ctx, both, comm.Max); err != nil {
		return fmt.Errorf("gorgonia: %w", err)
	}
	for i := range mine {
		if both[i] != -both[len(mine)+i] {
			return errors.New("gorgonia: the ranks' models differ (or a rank failed to read its model)")
		}
	}
	return nil
}

// collect makes one parameter per node, sharing its value and gradient.
func collect(model []G.ValueGrad) ([]*optim.Param, []tensor.Shape, error) {
	if len(model) == 0 {
		return nil, nil, errors.New("gorgonia: empty model")
	}
	params := make([]*optim.Param, len(model))
	shapes := make([]tensor.Shape, len(model))
	seen := make(map[string]bool, len(model))
	for i, n := range model {
		p, err := param(i, n)
		if err != nil {
			return nil, nil, err
		}
		if seen[p.Name] {
			p.Name = fmt.Sprintf("%s#%d", p.Name, i)
		}
		seen[p.Name] = true
		params[i], shapes[i] = p, p.Value.Shape().Clone()
	}
	return params, shapes, nil
}

// param wraps node i's value, which must be a float32 *tensor.Dense, and
// its gradient if it is already there. Before the first forward pass a
// node's gradient may not exist yet: the parameter then gets a zeroed
// stand-in of the value's shape, and Step binds the real one.
func param(i int, n G.ValueGrad) (*optim.Param, error) {
	if n == nil {
		return nil, fmt.Errorf("gorgonia: model[%d] is nil", i)
	}
	name := fmt.Sprintf("param%d", i)
	if nm, ok := n.(G.Namer); ok && nm.Name() != "" {
		name = nm.Name()
	}
	v, ok := n.Value().(*tensor.Dense)
	if !ok || v.Dtype() != tensor.Float32 {
		return nil, fmt.Errorf("gorgonia: %q holds a %T; lowbit trains float32 *tensor.Dense values (make a scalar a 1-element vector)", name, n.Value())
	}
	gv, err := n.Grad()
	g, ok := gv.(*tensor.Dense)
	if err != nil || !ok || g.Dtype() != tensor.Float32 || !g.Shape().Eq(v.Shape()) {
		g = tensor.New(tensor.Of(tensor.Float32), tensor.WithShape(v.Shape().Clone()...))
	}
	p := &optim.Param{Name: name, Value: v, Grad: g}
	if err := optim.CheckParams([]*optim.Param{p}); err != nil {
		return nil, fmt.Errorf("gorgonia: %w", err)
	}
	return p, nil
}

// Step implements gorgonia.Solver: StepContext with the context given to
// NewSolver.
func (s *Solver) Step(model []G.ValueGrad) error { return s.StepContext(s.ctx, model) }

// StepContext averages the gradients of model over the ranks with the lowbit
// optimizer, updates the values and zeroes the gradients. Every rank calls
// it together, with the nodes in the same order as at Init. A step whose
// gradient is not finite on some rank is skipped on every rank (the values
// stay, the gradients are zeroed). A model whose nodes changed shape, or
// whose values or gradients are not float32 dense tensors, is an error on
// every rank, and nothing changes on any rank.
func (s *Solver) StepContext(ctx context.Context, model []G.ValueGrad) error {
	if err := s.Init(ctx, model); err != nil {
		return err
	}
	localErr := s.bind(model)
	s.flag[0] = 0
	if localErr != nil {
		s.flag[0] = 1
	}
	if s.c != nil && s.c.Size() > 1 {
		if err := s.c.AllReduce(ctx, s.flag, comm.Max); err != nil {
			return fmt.Errorf("gorgonia: %w", err)
		}
	}
	if localErr != nil {
		return localErr
	}
	if s.flag[0] != 0 {
		return errors.New("gorgonia: another rank's model changed; nothing changed")
	}
	if err := s.opt.Step(ctx); err != nil {
		return fmt.Errorf("gorgonia: %w", err)
	}
	for _, p := range s.params {
		p.Grad.Zero()
	}
	return nil
}

// bind points the parameters at model's current tensors (a VM may replace
// a node's tensors between steps), after checking that every node kept its
// shape. It changes nothing on error and allocates nothing.
func (s *Solver) bind(model []G.ValueGrad) error {
	if len(model) != len(s.params) {
		return fmt.Errorf("gorgonia: %d nodes, %d at Init; nothing changed", len(model), len(s.params))
	}
	for i, n := range model {
		if n == nil {
			return fmt.Errorf("gorgonia: model[%d] is nil; nothing changed", i)
		}
		v, ok := n.Value().(*tensor.Dense)
		gv, err := n.Grad()
		g, gok := gv.(*tensor.Dense)
		switch {
		case !ok || v.Dtype() != tensor.Float32:
			return fmt.Errorf("gorgonia: %q now holds a %T; nothing changed", s.params[i].Name, n.Value())
		case err != nil || !gok || g.Dtype() != tensor.Float32:
			return fmt.Errorf("gorgonia: %q has no float32 gradient (bind dual values, e.g. gorgonia.BindDualValues, and run the graph first); nothing changed", s.params[i].Name)
		case !v.Shape().Eq(s.shapes[i]) || !g.Shape().Eq(s.shapes[i]):
			return fmt.Errorf("gorgonia: %q changed shape from %v to %v (gradient %v); nothing changed", s.params[i].Name, s.shapes[i], v.Shape(), g.Shape())
		case v.IsView() || g.IsView():
			return fmt.Errorf("gorgonia: %q is a view; nothing changed", s.params[i].Name)
		}
	}
	for i, n := range model {
		g, _ := n.Grad()
		s.params[i].Value, s.params[i].Grad = n.Value().(*tensor.Dense), g.(*tensor.Dense)
	}
	return nil
}
