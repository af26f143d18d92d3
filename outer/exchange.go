package outer

// A fragment's exchange: its launch, the codec's average and the outer
// step, and the delayed merge.

import (
	"cmp"
	"context"
	"fmt"
	"slices"

	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// launch starts the exchange of fragment f at call t: pseudo-gradient,
// agreement, then the exchange itself, here (Delay 0, merged at once) or
// in the background.
func (o *Optimizer) launch(ctx context.Context, t int64, f int) error {
	lo := o.bounds[f]
	finite := true
	for _, s := range o.spans[f] {
		d := o.params[s.param].Data()[s.at : s.at+s.n]
		g := o.global[s.flat : s.flat+s.n]
		if o.direct {
			// The codec forms the pseudo-gradients again in its exchange.
			for j := range d {
				if v := g[j] - d[j]; v-v != 0 {
					finite = false
				}
			}
		} else {
			x := o.work[s.flat-lo : s.flat-lo+s.n]
			for j := range d {
				v := g[j] - d[j]
				x[j] = v
				if v-v != 0 {
					finite = false
				}
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
	if o.mom != nil {
		copy(o.mom[lo:hi], o.work)
	}
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

// exchange averages the pseudo-gradient of fragment f (in work, or
// formed by a direct codec) with the codec and takes the outer step: the
// new θ_g and u of the fragment go in place with Delay 0, and into stage
// and work with Delay > 0 (merge applies them). It writes only work, xb,
// stage, the codec's state and, with Delay 0, the fragment's θ_g and u.
func (o *Optimizer) exchange(ctx context.Context, f int) error {
	if o.split {
		// Counted here, on the goroutine that sends them: the caller's
		// Step counts what it sends on c.
		before := optim.CommBytes(o.xc)
		defer func() { o.flightBytes = optim.CommBytes(o.xc) - before }()
	}
	lo, hi := o.bounds[f], o.bounds[f+1]
	g, u := o.global[lo:hi], part(o.mom, lo, hi)
	gOut, uOut := g, u // the new θ_g and u: in place, or staged for merge
	if o.stage != nil {
		gOut, uOut = o.stage[:hi-lo], part(o.work, 0, hi-lo)
		if u == nil {
			uOut = nil
		}
	}
	switch {
	case o.cfg.Codec == CodecOneBit:
		return o.exchangeOneBit(ctx, f, gOut, uOut, g, u)
	case o.direct: // CodecSparse
		delta := func(a int, x []float32) { o.delta(f, a, x) }
		apply := func(a int, avg []float32) {
			b := a + len(avg)
			o.outerStep(gOut[a:b], part(uOut, a, b), g[a:b], part(u, a, b), avg)
		}
		var err error
		switch {
		case o.sp.shared:
			err = o.sp.allReduceShared(ctx, o.xc, f, lo, hi-lo, delta, apply)
		case o.sp.twoPhase():
			err = o.sp.allReduceTwoPhase(ctx, o.xc, f, lo, hi-lo, delta, apply)
		default:
			err = o.sp.allReduce(ctx, o.xc, lo, hi-lo, delta, apply)
		}
		if err != nil {
			return fmt.Errorf("%s average: %w", o.cfg.Codec, err)
		}
		return nil
	}
	w := o.work[:hi-lo]
	if o.world > 1 {
		var err error
		switch o.cfg.Codec {
		case CodecFP32:
			err = o.xc.AllReduce(ctx, w, comm.Mean)
		case CodecBF16:
			err = o.down.AllReduce(ctx, o.xc, w)
		case CodecInt8:
			err = o.i8.allReduce(ctx, o.xc, w)
		}
		if err != nil {
			return fmt.Errorf("%s average: %w", o.cfg.Codec, err)
		}
	}
	o.outerStep(gOut, uOut, g, u, w)
	return nil
}

// exchangeOneBit is exchange with CodecOneBit, a bucket at a time: x =
// mu*u + delta formed in xb, compressed with error feedback (its average
// ū is the new momentum; the averaged pseudo-gradient it implies is ū -
// mu*u), and the outer step on the bucket. An error of a bucket's
// allreduce leaves the buckets before it stepped (and every 1-bit state
// before it updated): the optimizer is then failed until Load.
func (o *Optimizer) exchangeOneBit(ctx context.Context, f int, gOut, uOut, g, u []float32) error {
	lr, mu := o.cfg.LR, o.cfg.Momentum
	whole := [2]int{0, len(g)}
	b := whole[:]
	if o.world > 1 {
		b = o.buckets[f]
	}
	for k := range len(b) - 1 {
		x := o.xb[:b[k+1]-b[k]]
		o.delta(f, b[k], x)
		uk := part(u, b[k], b[k+1])
		for j := range x {
			x[j] = float32(mu*at(uk, j)) + x[j]
		}
		if o.world > 1 {
			if err := onebit.AllReduce(ctx, o.xc, x, o.states[f][k]); err != nil {
				return fmt.Errorf("1-bit allreduce, bucket %d of %d: %w", k, len(o.states[f]), err)
			}
		}
		gk, gOutk, uOutk := g[b[k]:b[k+1]], gOut[b[k]:b[k+1]], part(uOut, b[k], b[k+1])
		for j, ub := range x {
			step := ub
			if o.cfg.Nesterov {
				step = (ub - float32(mu*at(uk, j))) + float32(mu*ub)
			}
			gOutk[j] = gk[j] - float32(lr*step)
			if uOutk != nil {
				uOutk[j] = ub
			}
		}
	}
	return nil
}

// outerStep is the outer SGD step of the codecs other than CodecOneBit
// on the averaged pseudo-gradients d: m = mu*u + d, θ_g -= lr*m (heavy
// ball) or lr*(d + mu*m) (Nesterov), into gOut and uOut (nil: u is not
// kept, and counts as 0). uOut may be d.
func (o *Optimizer) outerStep(gOut, uOut, g, u, d []float32) {
	lr, mu := o.cfg.LR, o.cfg.Momentum
	for j, dj := range d {
		m := float32(mu*at(u, j)) + dj
		step := m
		if o.cfg.Nesterov {
			step = dj + float32(mu*m)
		}
		gOut[j] = g[j] - float32(lr*step)
		if uOut != nil {
			uOut[j] = m
		}
	}
}

// delta writes the pseudo-gradient θ_g - θ_local of elements [a,
// a+len(x)) of fragment f into x: θ_local at the launch (snap) with Delay
// > 0, the parameters as they are with Delay 0.
func (o *Optimizer) delta(f, a int, x []float32) {
	lo := o.bounds[f] + a
	hi := lo + len(x)
	if o.snap != nil {
		g, sn := o.global[lo:hi], o.snap[a:a+len(x)]
		for j := range x {
			x[j] = g[j] - sn[j]
		}
		return
	}
	sp := o.spans[f]
	i, _ := slices.BinarySearchFunc(sp, lo, func(s span, t int) int { return cmp.Compare(s.flat+s.n, t+1) })
	for ; i < len(sp) && sp[i].flat < hi; i++ {
		s := sp[i]
		p, q := max(s.flat, lo), min(s.flat+s.n, hi)
		d := o.params[s.param].Data()[s.at+p-s.flat : s.at+q-s.flat]
		g, xs := o.global[p:q], x[p-lo:q-lo]
		for j := range xs {
			xs[j] = g[j] - d[j]
		}
	}
}

// part is s[lo:hi], or nil for a nil s (a buffer not kept).
func part(s []float32, lo, hi int) []float32 {
	if s == nil {
		return nil
	}
	return s[lo:hi]
}

// at is s[j], or 0 for a nil s.
func at(s []float32, j int) float32 {
	if s == nil {
		return 0
	}
	return s[j]
}
