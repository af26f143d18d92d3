package gomlx

import (
	"errors"
	"fmt"
	"math"

	"github.com/gomlx/compute/dtypes"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/optimizer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

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
	skipped := o.opt.Stats().Skipped
	var err error
	if o.sf != nil {
		err = o.carriedStep(localErr)
	} else {
		err = o.ownStep(localErr)
	}
	if err != nil {
		return err
	}
	// A skipped step changes nothing, but for an optimizer whose ranks run
	// apart: its local skip may come with an exchange that moved the
	// parameters to the global ones.
	if o.opt.Stats().Skipped == skipped || o.global() != nil {
		if err := o.writeBack(); err != nil {
			return err
		}
	}
	return o.incGlobalStep()
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
// learning rates differ, before anything changes. With the flags carried
// at the exchanges only (quiet) the step is quietStep's.
func (o *Optimizer) carriedStep(localErr error) error {
	if o.quiet {
		return o.quietStep(localErr)
	}
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

// quietStep runs the Step of a lowbit optimizer whose ranks run apart and
// that carries the flags in its exchanges' agreements only (see the
// package documentation): nothing is agreed between exchanges. A rank with
// localErr refuses the step, a failure the other ranks hear of at the next
// exchange; a rank whose loss is not finite skips its own inner step (its
// gradient made non-finite, which the inner optimizer skips and counts)
// while the others step on; vetoExchange stops an exchange on every rank
// when the ranks' learning rates differ there.
func (o *Optimizer) quietStep(localErr error) error {
	sf := o.sf
	o.setFlags(sf.Local, localErr)
	clear(sf.Agreed)
	sf.Refuse = localErr
	o.vetoed = false
	if localErr == nil && sf.Local[flagLoss] != 0 {
		o.skipInnerStep()
	}
	err := o.opt.Step(o.ctx)
	sf.Refuse = nil
	switch {
	case err == nil:
		return nil
	case localErr != nil:
		return err
	case o.vetoed:
		// The exchange did not run; the call's inner steps did, and the
		// optimizer counted the call: so do the variables and the global
		// step.
		if werr := o.writeBack(); werr != nil {
			return errors.Join(err, werr)
		}
		return errors.Join(err, o.incGlobalStep())
	case sf.Agreed[flagFailed] != 0:
		return fmt.Errorf("lbgomlx: another rank failed to get its gradients; nothing changed at this exchange: %w", err)
	}
	return fmt.Errorf("lbgomlx: %w", err)
}

// skipInnerStep makes this rank's coming inner step a skipped one: its
// loss is not finite. It writes a NaN into the first gradient, which every
// lowbit optimizer skips (counted in Stats().Skipped) with nothing
// changed.
func (o *Optimizer) skipInnerStep() {
	o.params[0].GradData()[0] = float32(math.NaN())
	text := fmt.Sprintf("global step %d: the loss is not finite on this rank (%g): its own inner step is skipped, the other ranks step on", o.globalStep()+1, o.loss)
	if o.warnedSkip {
		o.log.Warn(text)
		return
	}
	o.warnedSkip = true
	o.warn(text + " (warned once; Stats().Skipped counts them)")
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

// vetoExchange is the StepFlags.Veto of flags carried at the exchanges
// only: it stops an exchange on every rank when the ranks' learning rates
// differ at its step. A non-finite loss is each rank's own business there
// (see quietStep).
func (o *Optimizer) vetoExchange(agreed []float32) error {
	if err := o.lrError(agreed, "the exchange of this step did not run on any rank (the global parameters did not change; "+
		"each rank's own inner step did)"); err != nil {
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
	return o.lrError(agreed, "no variable changed")
}

// lrError is the error of agreed flags whose learning rates differ, ending
// with what the step did; nil when they are the same.
func (o *Optimizer) lrError(agreed []float32, did string) error {
	if hi, lo := agreed[flagLR], -agreed[flagNegLR]; hi != lo {
		return fmt.Errorf("lbgomlx: global step %d: the ranks' learning rates differ, from %v to %v (here %v, from %s): "+
			"every rank must set the same; %s", o.globalStep()+1, lo, hi, o.lr, o.lrSrc, did)
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

// incGlobalStep adds one to GoMLX's global step, in place: its variable
// keeps its tensor.
func (o *Optimizer) incGlobalStep() error {
	val, err := optimizer.GetGlobalStepVar(o.store).Value()
	if err == nil {
		err = tensors.MutableFlatData(val, func(f []int64) { f[0]++ })
	}
	if err != nil {
		return fmt.Errorf("lbgomlx: global step: %w", err)
	}
	return nil
}
