package optim

import (
	"context"
	"fmt"
	"testing"

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
