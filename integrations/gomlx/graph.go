package gomlx

import (
	"errors"
	"fmt"

	"github.com/gomlx/compute"
	"github.com/gomlx/compute/dtypes"
	"github.com/gomlx/compute/shapes"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/optim"
)

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
		o.opt, o.sf, o.quiet, o.lrs, o.restored = nil, nil, false, nil, false
		return err
	}
	o.warnUnusedSettings()
	o.log.Info("lowbit optimizer ready", zap.Int("rank", o.rank()), zap.Int("ranks", o.size()),
		zap.Int("variables", len(o.vars)), zap.Bool("restored", o.restored),
		zap.Int64("global_step", o.globalStep()), zap.Bool("flags_carried", o.sf != nil), zap.Bool("flags_at_exchanges_only", o.quiet),
		zap.Stringer("learning_rate", o.lrSrc))
	return nil
}

// exchangeFlagCarrier is implemented by the lowbit optimizers whose ranks
// run apart between exchanges and that can carry the step's flags in the
// exchanges' agreements only (outer.Optimizer.CarryFlagsAtExchanges): the
// Optimizer carries them that way, so that no step between exchanges
// communicates.
type exchangeFlagCarrier interface {
	CarryFlagsAtExchanges(sf *optim.StepFlags) error
}

// carryFlags makes the lowbit optimizer carry the step's flags in its own
// agreements, when it can: at its exchanges only when it is an
// exchangeFlagCarrier, otherwise at every step.
func (o *Optimizer) carryFlags() error {
	sf := &optim.StepFlags{Local: make([]float32, numFlags)}
	var err error
	switch fc := o.opt.(type) {
	case exchangeFlagCarrier:
		sf.Veto = o.vetoExchange
		err = fc.CarryFlagsAtExchanges(sf)
		o.quiet = true
	case optim.FlagCarrier:
		sf.Veto = o.veto
		err = fc.CarryFlags(sf)
	default:
		return nil
	}
	if err != nil {
		o.quiet = false
		return fmt.Errorf("lbgomlx: %w", err)
	}
	o.sf = sf
	return nil
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
