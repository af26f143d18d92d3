package zero_test

import (
	"context"
	"sync"
	"testing"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/samerun"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

// benchGroup is one optimizer on every rank of its own in-process group.
type benchGroup struct {
	name string
	opts []optim.Optimizer
}

// step runs one Step on every rank at once.
func (g *benchGroup) step(b *testing.B, ctx context.Context) {
	var wg sync.WaitGroup
	for _, o := range g.opts {
		wg.Go(func() {
			if err := o.Step(ctx); err != nil {
				b.Error(err)
			}
		})
	}
	wg.Wait()
}

// BenchmarkStep times one step of sharded Adam in every reduce mode on 4
// in-process ranks (2 "nodes" of 2 for int8 and int4) and, in the same
// loop, optim.Adam on the same parameters (an exact allreduce of the
// gradients, then the update of every element on every rank). It reports
// each mode's median step time (ms/step), its ratio to optim.Adam's
// (x-adam), the bytes rank 0 puts on the wire per step and the optimizer
// float32s per rank. In-process ranks share memory, so time measures
// copying and quantizing, not a network.
func BenchmarkStep(b *testing.B) {
	const w, n = 4, 1 << 20
	ctx := context.Background()
	mk := func(name string, newOpt func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error), opts ...local.Option) *benchGroup {
		cs, err := local.New(w, opts...)
		if err != nil {
			b.Fatal(err)
		}
		g := &benchGroup{name: name, opts: make([]optim.Optimizer, w)}
		var wg sync.WaitGroup
		for r := range cs {
			wg.Go(func() {
				p := optim.NewParam("w", n)
				for i, gr := range p.GradData() {
					gr = float32((i*7919+r*104729)%2001-1000) / 1000
					p.GradData()[i] = gr
					p.Data()[i] = gr / 2
				}
				o, err := newOpt(ctx, cs[r], []*optim.Param{p})
				if err != nil {
					b.Error(err)
					return
				}
				g.opts[r] = o
			})
		}
		wg.Wait()
		if b.Failed() {
			b.FailNow()
		}
		b.Cleanup(func() {
			for r, o := range g.opts {
				if cl, ok := o.(interface{ Close() error }); ok {
					cl.Close()
				}
				cs[r].Close()
			}
		})
		g.step(b, ctx) // first step: allocations
		return g
	}
	groups := []*benchGroup{mk("adam", func(_ context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewAdam(ctx, c, ps, optim.DefaultAdamConfig())
	})}
	for _, mode := range []zero.Reduce{zero.ReduceFP32, zero.ReduceCoalesced, zero.ReduceInt8, zero.ReduceInt4} {
		cfg := zero.DefaultConfig()
		cfg.ReduceScatter = mode
		var opts []local.Option
		if mode == zero.ReduceInt8 || mode == zero.ReduceInt4 {
			opts = append(opts, local.WithRanksPerNode(2))
		}
		groups = append(groups, mk(mode.String(), func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return zero.NewAdam(ctx, c, ps, cfg)
		}, opts...))
	}
	passes := make([]func(), len(groups))
	for i, g := range groups {
		passes[i] = func() { g.step(b, ctx) }
	}
	med := samerun.Medians(b, passes...)
	for i, g := range groups {
		b.ReportMetric(med[i]*1e3, g.name+"-ms/step")
		b.ReportMetric(float64(g.opts[0].Stats().LastStepBytes), g.name+"-B/step")
		floats := 2 * n
		if sf, ok := g.opts[0].(stateFloats); ok {
			floats = sf.StateFloats()
		}
		b.ReportMetric(float64(floats), g.name+"-floats/rank")
		if i > 0 {
			b.ReportMetric(med[i]/med[0], g.name+"-x-adam")
		}
	}
}
