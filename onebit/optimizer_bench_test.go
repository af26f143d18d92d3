package onebit_test

import (
	"context"
	"testing"

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
