package onebit_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// unseenOptimizers builds each 1-bit optimizer with a short warm-up.
var unseenOptimizers = map[string]func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error){
	"onebit-adam": func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.LR, cfg.FreezeStep = 0.01, 3
		return onebit.NewAdam(ctx, c, ps, cfg)
	},
	"onebit-lamb": func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultLambConfig()
		cfg.LR, cfg.FreezeStep = 0.01, 3
		return onebit.NewLamb(ctx, c, ps, cfg)
	},
	"zeroone-adam": func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultZeroOneAdamConfig()
		cfg.LR, cfg.VarFreezeStep, cfg.VarUpdateScaler, cfg.LocalStepScaler = 0.01, 8, 1, 2
		return onebit.NewZeroOneAdam(ctx, c, ps, cfg)
	},
}

// unseenGrads writes the gradients of step s on rank r: the embedding
// "emb" (8 rows of 4) gets gradient in rows 0-3 only, as a byte embedding
// whose bytes 4-7 never occur; "dense" everywhere.
func unseenGrads(ps []*optim.Param, r, s int) {
	for i, p := range ps {
		g := p.GradData()
		for j := range g {
			g[j] = float32(math.Cos(float64(s*7919+r*104729+i*31+3*j))) * 0.1
			if p.Name == "emb" && j >= 16 {
				g[j] = 0
			}
		}
	}
}

// TestUnseenElementsStayStill: elements that got no gradient in the
// warm-up (frozen v exactly zero) do not move in the compression stage,
// as under exact Adam, instead of steps of lr*scale/eps; on 2 ranks, for
// every 1-bit optimizer, and a run resumed from a checkpoint taken in
// compression continues bit-identically (the list of such elements is
// rebuilt from v on Load).
func TestUnseenElementsStayStill(t *testing.T) {
	const w, steps, stop = 2, 24, 14
	for name, build := range unseenOptimizers {
		t.Run(name, func(t *testing.T) {
			// run trains from step from+1 to to, after loading ck if not nil;
			// it returns each rank's parameters and its state at the end.
			run := func(ck []*optim.Checkpoint, from, to int) ([][][]float32, []*optim.Checkpoint) {
				params := make([][][]float32, w)
				states := make([]*optim.Checkpoint, w)
				err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
					ps := adamParams(t, []int{8, 4}, []int{6})
					ps[0].Name, ps[1].Name = "emb", "dense"
					opt, err := build(ctx, c, ps)
					if err != nil {
						return err
					}
					defer opt.Close()
					if ck != nil {
						if err := opt.Load(ck[c.Rank()]); err != nil {
							return err
						}
					}
					for s := from + 1; s <= to; s++ {
						unseenGrads(ps, c.Rank(), s)
						if err := opt.Step(ctx); err != nil {
							return fmt.Errorf("step %d: %w", s, err)
						}
					}
					for _, p := range ps {
						params[c.Rank()] = append(params[c.Rank()], append([]float32(nil), p.Data()...))
					}
					states[c.Rank()], err = opt.State()
					return err
				})
				require.NoError(t, err)
				return params, states
			}
			init := adamParams(t, []int{8, 4})[0].Data()
			whole, _ := run(nil, 0, steps)
			for r := range w {
				assert.Equal(t, init[16:], whole[r][0][16:], "rank %d: rows with no gradient moved", r)
				assert.NotEqual(t, init[:16], whole[r][0][:16], "rank %d: rows with gradients trained", r)
				for _, x := range whole[r][0] {
					require.Less(t, math.Abs(float64(x)), 2.0, "rank %d: a parameter ran away", r)
				}
			}
			_, ck := run(nil, 0, stop)
			resumed, _ := run(ck, stop, steps)
			assert.Equal(t, whole, resumed, "resumed in compression")
		})
	}
}
