package onebit_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// shardedLate is the sharded mode of 1-bit Adam on the probe of
// lateOptimizers, with bf (its bfloat16 buffers).
func shardedLate(bf onebit.BF16State) func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
	return func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.LR, cfg.FreezeStep, cfg.StateMode, cfg.BF16 = 0.01, 3, onebit.StateSharded, bf
		return onebit.NewAdam(ctx, c, ps, cfg)
	}
}

// TestShardedLateBound: the sharded mode bounds the owners' ratios as the
// full mode does (docs/sharded.md, step 6), with the variance in float32
// or in bfloat16: rows 4-5 of the probe, whose v is zero (no gradient in
// the warm-up) until their gradient starts at step 6, move at most lr
// times the cap per step, summed over any 8 steps (5.8 at lr 0.01; the
// error feedback of the compressed update lets one step go beyond it, not
// a sum), where an unbounded ratio m/eps moves them by 3.1e5.
func TestShardedLateBound(t *testing.T) {
	const w, steps, late, window = 2, 30, 6, 8
	cap := float64(onebit.CapFactor * optim.AdamRatioBound(0.9, 0.999))
	for _, bf := range []onebit.BF16State{0, onebit.BF16Variance, onebit.BF16WorkerError | onebit.BF16Variance} {
		hist, _ := lateRun(t, shardedLate(bf), w, nil, 0, steps, late, 0)
		init := adamParams(t, []int{8, 4})[0].Data()
		worst := 0.0
		for r := range w {
			for j := 16; j < 24; j++ {
				pos := make([]float64, 0, steps+1) // element j of emb after each step
				pos = append(pos, float64(init[j]))
				for s := range steps {
					pos = append(pos, float64(hist[r][s][0][j]))
				}
				for s := late - 1; s+window < len(pos); s++ {
					d := math.Abs(pos[s+window] - pos[s])
					worst = max(worst, d)
					require.LessOrEqual(t, d, window*0.01*cap, "BF16 %v rank %d: element %d moved %g in steps %d-%d", bf, r, j, d, s+1, s+window)
				}
			}
		}
		t.Logf("BF16 %v: the late rows moved at most %.3g in %d steps (bound %.3g)", bf, worst, window, window*0.01*cap)
	}
}
