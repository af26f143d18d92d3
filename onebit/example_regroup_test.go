package onebit_test

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// A run of sharded 1-bit Adam on 4 ranks continues on 3: Regroup makes
// each new rank's checkpoint from all 4 old ones, with the moments
// re-sharded and the error feedback kept (no reset).
func ExampleRegroup() {
	train := func(world int, from []*optim.Checkpoint, steps int) []*optim.Checkpoint {
		out := make([]*optim.Checkpoint, world)
		err := local.Run(context.Background(), world, func(ctx context.Context, c comm.Comm) error {
			p := optim.NewParam("w", 1000)
			cfg := onebit.DefaultAdamConfig()
			cfg.FreezeStep, cfg.StateMode = 2, onebit.StateSharded
			opt, err := onebit.NewAdam(ctx, c, []*optim.Param{p}, cfg)
			if err != nil {
				return err
			}
			if from != nil {
				if err := opt.Load(from[c.Rank()]); err != nil {
					return err
				}
			}
			for range steps {
				for i := range p.GradData() {
					p.GradData()[i] = p.Data()[i] - 1 + float32(c.Rank())*0.01 // pulls w towards 1
				}
				if err := opt.Step(ctx); err != nil {
					return err
				}
			}
			out[c.Rank()], err = opt.State()
			return err
		})
		if err != nil {
			panic(err)
		}
		return out
	}
	four := train(4, nil, 5)
	three := make([]*optim.Checkpoint, 3)
	for r := range three {
		var err error
		if three[r], err = onebit.Regroup(four, 3, r); err != nil {
			fmt.Println(err)
			return
		}
	}
	after := train(3, three, 5)
	fmt.Println("world", after[0].World, "step", after[0].Ints[optim.IntStep], "errors reset:", after[0].ErrorsReset)
	// Output:
	// world 3 step 10 errors reset: false
}
