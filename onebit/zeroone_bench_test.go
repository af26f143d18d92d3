package onebit_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// BenchmarkZeroOneAdamStep is 0/1 Adam's step without communication (see
// lamb_bench_test.go): in phase A with variance steps at intervals 1, 2,
// 4, ... (kappa 1: after the first steps nearly all are momentum-only),
// in phase B synchronizing at every step (the most arithmetic a step can
// do; one rank has nothing to send), and in phase B with 16 local steps
// per synchronization.
func BenchmarkZeroOneAdamStep(b *testing.B) {
	for _, size := range optimBenchSizes {
		for _, phase := range []struct {
			name             string
			want             optim.Stage
			varFreeze, local int
		}{
			{"phaseA", optim.StagePhaseA, 1 << 30, 1},
			{"phaseB-sync", optim.StagePhaseB, 1, 1},
			{"phaseB-local16", optim.StagePhaseB, 1, 16},
		} {
			b.Run(fmt.Sprintf("%s/%s", size.name, phase.name), func(b *testing.B) {
				lzBenchStep(b, size.n, 6, phase.want, func(ps []*optim.Param) (optim.Optimizer, error) {
					cfg := onebit.DefaultZeroOneAdamConfig()
					cfg.VarFreezeStep = phase.varFreeze
					cfg.VarUpdateScaler = 1
					cfg.LocalStepScaler = 1
					cfg.LocalStepClipper = phase.local
					return onebit.NewZeroOneAdam(context.Background(), nil, ps, cfg)
				})
			})
		}
	}
}
