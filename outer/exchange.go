package outer

// A fragment's exchange: its launch, the codec's average and the outer
// step, and the delayed merge.

import (
	"context"
	"fmt"

	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// launch starts the exchange of fragment f at call t: pseudo-gradient,
// agreement, then the exchange itself, here (Delay 0, merged at once) or
// in the background.
func (o *Optimizer) launch(ctx context.Context, t int64, f int) error {
	lo, hi := o.bounds[f], o.bounds[f+1]
	w := o.work[:hi-lo]
	finite := true
	for _, s := range o.spans[f] {
		d := o.params[s.param].Data()[s.at : s.at+s.n]
		g := o.global[s.flat : s.flat+s.n]
		x := w[s.flat-lo : s.flat-lo+s.n]
		for j := range d {
			v := g[j] - d[j]
			x[j] = v
			if v-v != 0 {
				finite = false
			}
		}
		if o.snap != nil {
			copy(o.snap[s.flat-lo:s.flat-lo+s.n], d)
		}
	}
	status := float32(statusOK)
	if !finite {
		status = statusNonFinite
	}
	v, err := o.agree(ctx, status, t)
	switch {
	case err != nil:
		o.broken = err
		return fmt.Errorf("outer: step %d: exchange of fragment %d: %w", t, f, err)
	case v.failed >= 0:
		o.broken = v.failure()
		return fmt.Errorf("outer: step %d: exchange of fragment %d not run: %w; every later Step fails until Load", t, f, o.broken)
	case v.refused >= 0:
		// Only a flags agreement carries refusals: rank v.refused is at
		// another call than this one.
		o.broken = fmt.Errorf("rank %d refused a step where this rank launched an exchange: the ranks are at different calls (every rank must carry flags from the same call)", v.refused)
		return fmt.Errorf("outer: step %d: exchange of fragment %d: %w", t, f, o.broken)
	}
	if sf := o.flags; o.quiet && sf.Veto != nil {
		// Flags carried at the exchanges: the Veto decides the exchange,
		// from the flags agreed just now, before it changes anything.
		if err := sf.Veto(sf.Agreed); err != nil {
			return err
		}
	}
	switch {
	case v.nonFinite:
		o.outerSkipped++
		o.resetLocal(f)
		o.log.Warn("skipping an outer step: non-finite pseudo-gradient on some rank; every rank restarts the fragment from the global parameters",
			zap.Int64("step", t), zap.Int("fragment", f), zap.Int64("skipped", o.outerSkipped))
		return nil
	}
	if o.cfg.Delay == 0 {
		if err := o.exchange(ctx, f); err != nil {
			o.broken = err
			return fmt.Errorf("outer: step %d: exchange of fragment %d: %w", t, f, err)
		}
		o.resetLocal(f)
		o.outerSteps++
		return nil
	}
	o.pending, o.launchedAt = f, t
	if !o.async {
		err := o.exchange(ctx, f)
		o.xBytes += o.flightBytes
		if err != nil {
			o.broken = err
			return fmt.Errorf("outer: step %d: exchange of fragment %d: %w", t, f, err)
		}
		return nil
	}
	o.inFlight = true
	go o.flightFn()
	return nil
}

// resetLocal sets this rank's parameters of fragment f to θ_g.
func (o *Optimizer) resetLocal(f int) {
	for _, s := range o.spans[f] {
		copy(o.params[s.param].Data()[s.at:s.at+s.n], o.global[s.flat:s.flat+s.n])
	}
}

// settle waits for the exchange in flight, if any, and keeps its error.
func (o *Optimizer) settle() {
	if o.inFlight {
		o.inFlight = false
		err := <-o.flight
		o.xBytes += o.flightBytes
		if err != nil && o.broken == nil {
			o.broken = fmt.Errorf("exchange of fragment %d launched at step %d: %w", o.pending, o.launchedAt, err)
		}
	}
}

// merge waits for the exchange of the pending fragment and merges it:
// θ_local = θ_g + (θ_local - θ_local at launch).
func (o *Optimizer) merge() error {
	o.settle()
	if o.broken != nil {
		return o.broken
	}
	f := o.pending
	lo, hi := o.bounds[f], o.bounds[f+1]
	copy(o.global[lo:hi], o.stage)
	copy(o.mom[lo:hi], o.work)
	for _, s := range o.spans[f] {
		d := o.params[s.param].Data()[s.at : s.at+s.n]
		g := o.global[s.flat : s.flat+s.n]
		sn := o.snap[s.flat-lo : s.flat-lo+s.n]
		for j := range d {
			d[j] = g[j] + (d[j] - sn[j])
		}
	}
	o.pending = -1
	o.outerSteps++
	return nil
}

// exchange averages the pseudo-gradient of fragment f (in work) with the
// codec and takes the outer step: the new θ_g and u of the fragment go in
// place with Delay 0, and into stage and work with Delay > 0 (merge
// applies them). It writes only work, stage, the codec's state and, with
// Delay 0, the fragment's θ_g and u.
func (o *Optimizer) exchange(ctx context.Context, f int) error {
	if o.split {
		// Counted here, on the goroutine that sends them: the caller's
		// Step counts what it sends on c.
		before := optim.CommBytes(o.xc)
		defer func() { o.flightBytes = optim.CommBytes(o.xc) - before }()
	}
	lo, hi := o.bounds[f], o.bounds[f+1]
	w := o.work[:hi-lo]
	g, u := o.global[lo:hi], o.mom[lo:hi]
	gOut, uOut := g, u // the new θ_g and u: in place, or staged for merge
	if o.stage != nil {
		gOut, uOut = o.stage[:hi-lo], w
	}
	lr, mu := o.cfg.LR, o.cfg.Momentum
	if o.cfg.Codec == CodecOneBit {
		// x = mu*u + delta, compressed with error feedback: the average
		// ū is the new momentum; the averaged pseudo-gradient it implies
		// is ū - mu*u.
		for j := range w {
			w[j] = float32(mu*u[j]) + w[j]
		}
		if o.world > 1 {
			b := o.buckets[f]
			for k, st := range o.states[f] {
				if err := onebit.AllReduce(ctx, o.xc, w[b[k]:b[k+1]], st); err != nil {
					return fmt.Errorf("1-bit allreduce, bucket %d of %d: %w", k, len(o.states[f]), err)
				}
			}
		}
		for j, ub := range w {
			step := ub
			if o.cfg.Nesterov {
				step = (ub - float32(mu*u[j])) + float32(mu*ub)
			}
			gOut[j] = g[j] - float32(lr*step)
			uOut[j] = ub
		}
		return nil
	}
	if o.world > 1 {
		var err error
		switch o.cfg.Codec {
		case CodecFP32:
			err = o.xc.AllReduce(ctx, w, comm.Mean)
		case CodecBF16:
			err = o.down.AllReduce(ctx, o.xc, w)
		case CodecInt8:
			err = o.i8.allReduce(ctx, o.xc, w)
		case CodecSparse:
			err = o.sp.allReduce(ctx, o.xc, w, o.sp.acc[lo:hi])
		}
		if err != nil {
			return fmt.Errorf("%s average: %w", o.cfg.Codec, err)
		}
	}
	for j, d := range w {
		m := float32(mu*u[j]) + d
		step := m
		if o.cfg.Nesterov {
			step = d + float32(mu*m)
		}
		gOut[j] = g[j] - float32(lr*step)
		uOut[j] = m
	}
	return nil
}
