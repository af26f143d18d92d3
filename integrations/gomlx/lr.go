package gomlx

import (
	"fmt"
	"math"
	"strconv"

	"github.com/gomlx/compute/dtypes"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/train/optimizer"
)

// lrSource is where the learning rate of every step comes from (see the
// package documentation, "Learning rate").
type lrSource int

const (
	// lrLowbit: the lowbit optimizer's own (its config's LR, its
	// optim.Schedule, or the fixed learning rate its checkpoint restored).
	lrLowbit lrSource = iota
	// lrStore: GoMLX's learning_rate parameter of the store
	// (optimizer.ParamLearningRate), as GoMLX's own optimizers read it
	// into the variable /optimizers/learning_rate.
	lrStore
	// lrGraph: the training graph computes each step's learning rate into
	// that variable (GoMLX's cosineschedule).
	lrGraph
)

func (s lrSource) String() string {
	switch s {
	case lrStore:
		return "GoMLX's learning_rate of the store"
	case lrGraph:
		return "GoMLX's schedule in the training graph"
	default:
		return "the lowbit optimizer (its config's LR, its schedule, or its checkpoint's)"
	}
}

// lrParam is the store's learning_rate parameter: its value, and the
// precision it was set in (32 for a float32, 64 otherwise), by which it is
// printed; bits 0 when the store does not set it.
type lrParam struct {
	value float64
	bits  int
}

// String formats p as the value it was set as: a float32's shortest
// decimal, not its float64 widening.
func (p lrParam) String() string {
	if p.bits == 0 {
		return "not set"
	}
	return strconv.FormatFloat(p.value, 'g', -1, p.bits)
}

// gomlxLR finds GoMLX's learning-rate setting for the training graph g,
// the way GoMLX's own optimizers do: the variable learning_rate of the
// scope optimizer.Scope under scope, which GoMLX's cosine schedule
// computes in the graph, or else the store's learning_rate parameter,
// from which that variable is created as GoMLX's Adam creates it. It
// returns lrLowbit (and no variable) when the store sets neither. param
// is the parameter. A parameter that is not a finite number in float32
// (NaN, ±Inf, or beyond float32's range) is an error.
func gomlxLR(scope *model.Scope, g *graph.Graph) (src lrSource, v *model.Variable, param lrParam, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("lbgomlx: GoMLX's learning rate (%s): %v", optimizer.ParamLearningRate, r)
		}
	}()
	if raw, ok := scope.GetParam(optimizer.ParamLearningRate); ok && raw != nil {
		if param, err = paramFloat(raw); err != nil {
			return lrLowbit, nil, param, err
		}
		if f := float32(param.value); math.IsNaN(param.value) || math.IsInf(float64(f), 0) {
			return lrLowbit, nil, param, fmt.Errorf("lbgomlx: GoMLX's %s parameter of the store is %s, want finite and >= 0 (in float32); no variable changed",
				optimizer.ParamLearningRate, param)
		}
	}
	lrScope := scope.At(optimizer.Scope)
	v = lrScope.GetVariable(optimizer.ParamLearningRate)
	switch {
	case v != nil && v.ChangedInGraph(g):
		return lrGraph, v, param, nil
	case v != nil:
		// Made by an earlier graph from the parameter, or by the program:
		// GoMLX's optimizers would read it as it is.
		return lrStore, v, param, nil
	case param.bits != 0:
		return lrStore, optimizer.LearningRateVar(scope, dtypes.Float32, param.value), param, nil
	}
	return lrLowbit, nil, param, nil
}

// paramFloat converts a learning_rate parameter to an lrParam.
func paramFloat(raw any) (lrParam, error) {
	switch x := raw.(type) {
	case float64:
		return lrParam{x, 64}, nil
	case float32:
		return lrParam{float64(x), 32}, nil
	case int:
		return lrParam{float64(x), 64}, nil
	case int64:
		return lrParam{float64(x), 64}, nil
	case string:
		f, err := strconv.ParseFloat(x, 64)
		if err != nil {
			return lrParam{}, fmt.Errorf("lbgomlx: GoMLX's %s parameter %q is not a number", optimizer.ParamLearningRate, x)
		}
		return lrParam{f, 64}, nil
	}
	return lrParam{}, fmt.Errorf("lbgomlx: GoMLX's %s parameter is a %T, want a float64", optimizer.ParamLearningRate, raw)
}

// storeLR reads GoMLX's learning rate of the step that just ran from v
// (the value GoMLX's own optimizer would have used in it) as a learning
// rate for the lowbit optimizer. 0 (where GoMLX's cosine schedule starts
// its warm-up) is handed on as it is: a lowbit optimizer's step at 0
// updates the moments, as GoMLX's Adam does at 0, and moves no parameter.
func storeLR(v *model.Variable) (float32, error) {
	val, err := v.Value()
	if err != nil {
		return 0, fmt.Errorf("lbgomlx: reading GoMLX's learning rate %s: %w", v.Path(), err)
	}
	var f lrParam
	switch x := val.Value().(type) {
	case float32:
		f = lrParam{float64(x), 32}
	case float64:
		f = lrParam{x, 64}
	default:
		return 0, fmt.Errorf("lbgomlx: GoMLX's learning rate %s is a %s scalar, want float32 or float64", v.Path(), val.Shape())
	}
	lr := float32(f.value)
	if math.IsNaN(f.value) || f.value < 0 || math.IsInf(float64(lr), 0) {
		return 0, fmt.Errorf("lbgomlx: GoMLX's learning rate %s is %s, want finite and >= 0", v.Path(), f)
	}
	return lr, nil
}

// lrConflict returns the error of a lowbit optimizer that has its own
// schedule while GoMLX's learning rate (src) is set too, or that cannot
// take a learning rate (not an optim.LRSetter).
func lrConflict(src lrSource, param lrParam, hasSchedule, isSetter bool) error {
	if src == lrLowbit {
		return nil
	}
	what := fmt.Sprintf("the store sets GoMLX's learning rate (%s = %s)", optimizer.ParamLearningRate, param)
	if src == lrGraph {
		what = "the training graph computes GoMLX's learning rate (cosineschedule, in the model function)"
	}
	switch {
	case !isSetter:
		return fmt.Errorf("lbgomlx: %s, but the lowbit optimizer cannot take a learning rate (it is not an optim.LRSetter): "+
			"remove GoMLX's setting and set the optimizer's own in its config", what)
	case hasSchedule:
		return fmt.Errorf("lbgomlx: %s and the lowbit optimizer has a schedule of its own (SetSchedule in the Builder): "+
			"two learning-rate settings; keep one: remove the store's %s (and the cosine schedule), or the lowbit schedule", what, optimizer.ParamLearningRate)
	}
	return nil
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
