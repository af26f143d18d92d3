package onebit_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// The step benchmarks of 1-bit LAMB and 0/1 Adam run one rank (a nil
// communicator, so the compressed allreduce is skipped) and so measure the
// optimizers' arithmetic. They time exact Adam's step on the same model in
// the same loop (optimBenchCompare), and report the ratio x-exact-adam.
// Buffers are allocated inside the benchmarks only.
//
//	go test ./onebit -run '^$' -bench 'LambStep|ZeroOneAdamStep' -benchtime 10x

// lzBenchModel returns a model of n parameters in four tensors (one half,
// one quarter, two eighths of n) with cheap deterministic values and
// gradients.
func lzBenchModel(n int) []*optim.Param {
	sizes := []int{n / 2, n / 4, n / 8, n - n/2 - n/4 - n/8}
	ps := make([]*optim.Param, len(sizes))
	x := uint32(1)
	for i, k := range sizes {
		ps[i] = optim.NewParam(fmt.Sprintf("w%d", i), k)
		g, p := ps[i].GradData(), ps[i].Data()
		for j := range g {
			x = x*1664525 + 1013904223
			g[j] = float32(int32(x)>>8) / (1 << 23)
			p[j] = g[j] * 0.5
		}
	}
	return ps
}

// lzBenchStep builds the optimizer on a fresh model, takes warm untimed
// steps, checks that it is in stage want, and times it against exact
// Adam on the same parameters.
func lzBenchStep(b *testing.B, n, warm int, want optim.Stage, build func(ps []*optim.Param) (optim.Optimizer, error)) {
	ps := lzBenchModel(n)
	opt, err := build(ps)
	if err != nil {
		b.Fatal(err)
	}
	for range warm {
		if err := opt.Step(context.Background()); err != nil {
			b.Fatal(err)
		}
	}
	if got := opt.Stats().Stage; got != want {
		b.Fatalf("stage %s, want %s", got, want)
	}
	adam, err := optim.NewAdam(context.Background(), nil, ps, optim.DefaultAdamConfig())
	if err != nil {
		b.Fatal(err)
	}
	optimBenchCompare(b, n, opt, adam)
}

// BenchmarkLambStep is 1-bit LAMB's step without communication: in
// warm-up (exact LAMB: moments, direction, trust ratio, update) and in
// the compression stage (momentum into the fused buffer, then v_fresh,
// the factor and the update with frozen v).
func BenchmarkLambStep(b *testing.B) {
	for _, size := range optimBenchSizes {
		for _, stage := range []struct {
			want   optim.Stage
			freeze int
		}{{optim.StageWarmup, 1 << 30}, {optim.StageCompression, 1}} {
			b.Run(fmt.Sprintf("%s/%s", size.name, stage.want), func(b *testing.B) {
				lzBenchStep(b, size.n, 2, stage.want, func(ps []*optim.Param) (optim.Optimizer, error) {
					cfg := onebit.DefaultLambConfig()
					cfg.FreezeStep = stage.freeze
					return onebit.NewLamb(context.Background(), nil, ps, cfg)
				})
			})
		}
	}
}
