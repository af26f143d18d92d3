package optim

import (
	"context"
	"testing"

	"github.com/lowbit-ml/lowbit/internal/samerun"
)

// benchSizes are the parameter counts of the step benchmarks: one tensor
// each, allocated only inside the benchmark.
var benchSizes = []struct {
	name string
	n    int
}{{"1M", 1 << 20}, {"16M", 16 << 20}, {"64M", 64 << 20}}

// benchParam returns one parameter of n elements with a cheap
// deterministic value and gradient.
func benchParam(n int) *Param {
	p := NewParam("w", n)
	x := uint32(1)
	for i, g := 0, p.GradData(); i < n; i++ {
		x = x*1664525 + 1013904223
		g[i] = float32(int32(x)>>8) / (1 << 23)
		p.Data()[i] = g[i] * 0.5
	}
	return p
}

// BenchmarkAdamStep is the exact Adam step without communication (c = nil):
// the baseline of every optimizer benchmark.
func BenchmarkAdamStep(b *testing.B) {
	for _, sz := range benchSizes {
		b.Run(sz.name, func(b *testing.B) {
			p := benchParam(sz.n)
			opt, err := NewAdam(context.Background(), nil, []*Param{p}, DefaultAdamConfig())
			if err != nil {
				b.Fatal(err)
			}
			ctx := context.Background()
			if err := opt.Step(ctx); err != nil { // the first step, outside the count
				b.Fatal(err)
			}
			b.SetBytes(int64(sz.n) * 4)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := opt.Step(ctx); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(sz.n), "ns/param")
		})
	}
}

// BenchmarkLambStep is the exact LAMB step without communication, with
// exact Adam's step on the same parameter timed in the same run:
// x-exact-adam is LAMB's time over Adam's.
func BenchmarkLambStep(b *testing.B) {
	for _, sz := range benchSizes {
		b.Run(sz.name, func(b *testing.B) {
			p := benchParam(sz.n)
			lamb, err := NewLamb(context.Background(), nil, []*Param{p}, DefaultLambConfig())
			if err != nil {
				b.Fatal(err)
			}
			adam, err := NewAdam(context.Background(), nil, []*Param{p}, DefaultAdamConfig())
			if err != nil {
				b.Fatal(err)
			}
			compareSteps(b, sz.n, lamb, adam)
		})
	}
}

// compareSteps times opt.Step as the benchmark's ns/op and exact Adam's
// step (not counted in ns/op nor allocs/op) in the same loop, and reports
// Adam's time per step (exact-adam-ns/op) and the ratio (x-exact-adam).
// Each has taken one step before the timing starts.
func compareSteps(b *testing.B, n int, opt, adam Optimizer) {
	ctx := context.Background()
	if err := opt.Step(ctx); err != nil {
		b.Fatal(err)
	}
	samerun.Steps(b, n, "exact-adam",
		func() error { return opt.Step(ctx) },
		func() error { return adam.Step(ctx) })
}
