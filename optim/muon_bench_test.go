package optim

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/samerun"
)

// gptParams returns the parameters of a GPT of width d, feed-forward width
// ffn, the given blocks and context over 256 byte tokens (the shapes of
// the GPT example's model) with deterministic values and gradients, and
// the names of its hidden matrices, which the recipe gives Muon
// (embeddings and the output head go to AdamW, as norms and biases).
func gptParams(d, ffn, blocks, context int) ([]*Param, []string) {
	var ps []*Param
	var hidden []string
	add := func(muon bool, name string, shape ...int) {
		ps = append(ps, NewParam(name, shape...))
		if muon {
			hidden = append(hidden, name)
		}
	}
	add(false, "embed", 256, d)
	add(false, "pos", context, d)
	for l := range blocks {
		for _, m := range []string{"q", "k", "v", "o"} {
			add(true, fmt.Sprintf("block%d.%s", l, m), d, d)
		}
		add(true, fmt.Sprintf("block%d.ffn1", l), d, ffn)
		add(false, fmt.Sprintf("block%d.ffn1.bias", l), ffn)
		add(true, fmt.Sprintf("block%d.ffn2", l), ffn, d)
		add(false, fmt.Sprintf("block%d.ffn2.bias", l), d)
		for _, n := range []string{"ln1.gain", "ln1.bias", "ln2.gain", "ln2.bias"} {
			add(false, fmt.Sprintf("block%d.%s", l, n), d)
		}
	}
	add(false, "ln.gain", d)
	add(false, "ln.bias", d)
	add(false, "head", d, 256)
	add(false, "head.bias", 256)
	x := uint32(1)
	for _, p := range ps {
		for i, g := 0, p.GradData(); i < len(g); i++ {
			x = x*1664525 + 1013904223
			g[i] = float32(int32(x)>>8) / (1 << 23)
			p.Data()[i] = g[i] * 0.05
		}
	}
	return ps, hidden
}

// BenchmarkMuonStep times, in one run with the passes alternated (see
// samerun.Medians), Muon's step over the parameters of a GPT (one
// process, no communication), the orthogonalization alone (the
// Newton-Schulz iteration of every matrix, with its normalization, as the
// step runs it) and exact Adam's step over the same parameters, the
// baseline. ns-share is the orthogonalization's share of Muon's step,
// x-adam Muon's step over Adam's. Use -benchtime 3x or more.
func BenchmarkMuonStep(b *testing.B) {
	for _, m := range []struct {
		name                    string
		d, ffn, blocks, context int
	}{
		{"gpt-example", 64, 256, 2, 64}, // the GPT example's defaults
		{"d128", 128, 512, 4, 128},
	} {
		b.Run(m.name, func(b *testing.B) {
			ctx := context.Background()
			ps, hidden := gptParams(m.d, m.ffn, m.blocks, m.context)
			cfg := DefaultMuonConfig()
			cfg.Params = hidden
			muon, err := NewMuon(ctx, nil, ps, cfg)
			if err != nil {
				b.Fatal(err)
			}
			adam, err := NewAdam(ctx, nil, ps, DefaultAdamConfig())
			if err != nil {
				b.Fatal(err)
			}
			step := func(o Optimizer) func() {
				return func() {
					if err := o.Step(ctx); err != nil {
						b.Fatal(err)
					}
				}
			}
			orthogonalize := func() {
				for _, mt := range muon.mats {
					g := muon.params[mt.i].GradData()
					loadNS(mt.ns.x, muon.m[mt.i], g, mt.rows, mt.cols, cfg.Momentum, cfg.Nesterov)
					if mt.ns.normalize(cfg.NSEps) {
						mt.ns.iterate(cfg.NSCoefficients, cfg.NSSteps)
					}
				}
			}
			step(muon)()
			step(adam)()
			med := samerun.Medians(b, step(muon), orthogonalize, step(adam))
			var n, nm int
			for i, p := range ps {
				n += p.Numel()
				if muon.v[i] == nil {
					nm += p.Numel()
				}
			}
			b.ReportMetric(float64(n), "params")
			b.ReportMetric(float64(nm), "muon-params")
			b.ReportMetric(med[0]*1e3, "muon-ms/step")
			b.ReportMetric(med[1]*1e3, "ns-ms/step")
			b.ReportMetric(med[2]*1e3, "adam-ms/step")
			b.ReportMetric(med[1]/med[0], "ns-share")
			b.ReportMetric(med[0]/med[2], "x-adam")
		})
	}
}

// BenchmarkMuonStepSplit times, in one run with the passes alternated
// (see samerun.Medians), a step of Muon on 4 in-process ranks (comm/local)
// over the parameters of the GPT example (d 64, ffn 256, 2 blocks),
// without and with MuonConfig.Split. Each pass steps every rank once, in
// parallel. x-split is the step's time without Split over with; ns-flops
// is each rank's Newton-Schulz flops per step without and with Split.
// Give it at least as many cores as ranks, and -benchtime 10x or more.
func BenchmarkMuonStepSplit(b *testing.B) {
	const w = 4
	ctx := context.Background()
	group := func(split bool) ([]*Muon, func()) {
		cs, err := local.New(w)
		if err != nil {
			b.Fatal(err)
		}
		opts := make([]*Muon, w)
		errs := make([]error, w)
		var wg sync.WaitGroup
		for r := range cs {
			wg.Go(func() {
				ps, hidden := gptParams(64, 256, 2, 64)
				cfg := DefaultMuonConfig()
				cfg.Params, cfg.Split = hidden, split
				opts[r], errs[r] = NewMuon(ctx, cs[r], ps, cfg)
			})
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			b.Fatal(err)
		}
		return opts, func() {
			for r := range opts {
				wg.Go(func() { errs[r] = opts[r].Step(ctx) })
			}
			wg.Wait()
			if err := errors.Join(errs...); err != nil {
				b.Fatal(err)
			}
		}
	}
	whole, stepWhole := group(false)
	split, stepSplit := group(true)
	stepWhole()
	stepSplit()
	med := samerun.Medians(b, stepWhole, stepSplit)
	var flops, mine int64
	for k, mt := range whole[0].mats {
		c := int64(whole[0].cfg.NSSteps) * nsCost(mt.rows, mt.cols)
		flops += c
		if split[0].split.owner[k] == 0 {
			mine += c
		}
	}
	b.ReportMetric(med[0]*1e3, "whole-ms/step")
	b.ReportMetric(med[1]*1e3, "split-ms/step")
	b.ReportMetric(med[0]/med[1], "x-split")
	b.ReportMetric(float64(flops), "ns-flops/rank")
	b.ReportMetric(float64(mine), "split-ns-flops/rank0")
	b.ReportMetric(float64(split[0].split.share), "share-floats")
}
