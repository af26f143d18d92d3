package onebit_test

import (
	"context"
	"sync"
	"testing"

	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/samerun"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// optimBenchSizes are the parameter counts of the optimizer step
// benchmarks: one tensor each, allocated only inside the benchmark.
var optimBenchSizes = []struct {
	name string
	n    int
}{{"1M", 1 << 20}, {"16M", 16 << 20}, {"64M", 64 << 20}}

// optimBenchParam returns one parameter of n elements with a cheap
// deterministic value and gradient.
func optimBenchParam(n int) *optim.Param {
	p := optim.NewParam("w", n)
	x := uint32(1)
	for i, g := 0, p.GradData(); i < n; i++ {
		x = x*1664525 + 1013904223
		g[i] = float32(int32(x)>>8) / (1 << 23)
		p.Data()[i] = g[i] * 0.5
	}
	return p
}

// optimBenchCompare times opt.Step as the benchmark's ns/op and exact
// Adam's step (not counted in ns/op nor allocs/op) in the same loop, and
// reports Adam's time per step (exact-adam-ns/op) and the ratio
// (x-exact-adam). The caller has warmed opt up.
func optimBenchCompare(b *testing.B, n int, opt, adam optim.Optimizer) {
	ctx := context.Background()
	samerun.Steps(b, n, "exact-adam",
		func() error { return opt.Step(ctx) },
		func() error { return adam.Step(ctx) })
}

// BenchmarkAdamCompressionStep is 1-bit Adam's compression-stage step
// without communication (c = nil, W = 1, so the compressed allreduce is
// skipped): the finite check, the momentum update and the update with
// frozen v. Exact Adam's step on the same parameter is timed in the same
// run.
func BenchmarkAdamCompressionStep(b *testing.B) {
	for _, sz := range optimBenchSizes {
		b.Run(sz.name, func(b *testing.B) {
			p := optimBenchParam(sz.n)
			cfg := onebit.DefaultAdamConfig()
			cfg.FreezeStep = 1
			opt, err := onebit.NewAdam(context.Background(), nil, []*optim.Param{p}, cfg)
			if err != nil {
				b.Fatal(err)
			}
			// The warm-up step, then a first compression step.
			for range 2 {
				if err := opt.Step(context.Background()); err != nil {
					b.Fatal(err)
				}
			}
			if opt.Stage() != optim.StageCompression {
				b.Fatalf("stage %s, want compression", opt.Stage())
			}
			adam, err := optim.NewAdam(context.Background(), nil, []*optim.Param{p}, cfg.AdamConfig)
			if err != nil {
				b.Fatal(err)
			}
			optimBenchCompare(b, sz.n, opt, adam)
		})
	}
}

// BenchmarkAdamShardedStep times a compression-stage step of 1-bit Adam
// with StateSharded (in float32, and with both BF16 flags), StateCompact
// and StateFull on 4 in-process ranks (comm/local), all in the same loop
// (each its own copy of the parameters), in turn: the wall time of one
// step of every rank, collectives included. It reports each median
// (sharded-ns/op, sharded-bf16-ns/op, compact-ns/op, full-ns/op), the
// ratios to the full mode (x-full, bf16-x-full, compact-x-full) and each
// one's bytes of state per parameter.
func BenchmarkAdamShardedStep(b *testing.B) {
	const w = 4
	for _, sz := range optimBenchSizes[:2] {
		b.Run(sz.name, func(b *testing.B) {
			cs, err := local.New(w)
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			mk := func(mode onebit.StateMode, bf onebit.BF16State) []optim.Optimizer {
				opts := make([]optim.Optimizer, w)
				for r := range w {
					cfg := onebit.DefaultAdamConfig()
					cfg.FreezeStep = 1
					cfg.StateMode, cfg.BF16 = mode, bf
					o, err := onebit.NewAdam(ctx, cs[r], []*optim.Param{optimBenchParam(sz.n)}, cfg)
					if err != nil {
						b.Fatal(err)
					}
					opts[r] = o
				}
				return opts
			}
			step := func(opts []optim.Optimizer) {
				var wg sync.WaitGroup
				for _, o := range opts {
					wg.Go(func() {
						if err := o.Step(ctx); err != nil {
							b.Error(err)
						}
					})
				}
				wg.Wait()
			}
			runs := [][]optim.Optimizer{
				mk(onebit.StateSharded, 0),
				mk(onebit.StateSharded, onebit.BF16WorkerError|onebit.BF16Variance),
				mk(onebit.StateCompact, 0),
				mk(onebit.StateFull, 0),
			}
			for _, opts := range runs {
				for range 2 { // the warm-up step, then a first compression step
					step(opts)
				}
				if s := opts[0].Stats().Stage; s != optim.StageCompression {
					b.Fatalf("stage %s, want compression", s)
				}
			}
			med := samerun.Medians(b, func() { step(runs[0]) }, func() { step(runs[1]) }, func() { step(runs[2]) }, func() { step(runs[3]) })
			perParam := func(o optim.Optimizer) float64 {
				return float64(o.(*onebit.Adam).StateBytes()) / float64(sz.n)
			}
			b.ReportMetric(med[0]*1e9, "sharded-ns/op")
			b.ReportMetric(med[1]*1e9, "sharded-bf16-ns/op")
			b.ReportMetric(med[2]*1e9, "compact-ns/op")
			b.ReportMetric(med[3]*1e9, "full-ns/op")
			b.ReportMetric(med[0]/med[3], "x-full")
			b.ReportMetric(med[1]/med[3], "bf16-x-full")
			b.ReportMetric(med[2]/med[3], "compact-x-full")
			b.ReportMetric(perParam(runs[0][0]), "sharded-B/param")
			b.ReportMetric(perParam(runs[1][0]), "sharded-bf16-B/param")
			b.ReportMetric(perParam(runs[2][0]), "compact-B/param")
			b.ReportMetric(perParam(runs[3][0]), "full-B/param")
		})
	}
}
