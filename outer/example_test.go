package outer_test

import (
	"context"
	"fmt"
	"log"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// Two ranks fit w, each to its own data: rank r minimises (w - t_r)^2
// with t_0 = 1 and t_1 = 5, so the consensus is w = 3. Each rank runs 10
// inner AdamW steps on its own gradient without communicating, then the
// ranks average their pseudo-gradients, 1-bit compressed, and take an
// outer Nesterov step.
func ExampleNewAdam() {
	var global [2]float32
	var exchanges [2]int64
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		w := optim.NewParam("w", 64)
		cfg := outer.DefaultConfig()
		cfg.H, cfg.Codec = 10, outer.CodecOneBit
		cfg.Momentum = 0.5 // a toy problem: less momentum than DiLoCo's 0.9
		inner := optim.DefaultAdamConfig()
		inner.LR = 0.05
		opt, err := outer.NewAdam(ctx, c, []*optim.Param{w}, cfg, inner)
		if err != nil {
			return err
		}
		defer opt.Close()
		for step := range 400 {
			noise := float32(1 - 2*((step+c.Rank())%2)) // +1 or -1
			for i, x := range w.Data() {
				w.GradData()[i] = 2*(x-3) + noise
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		global[c.Rank()] = opt.Global()[0]
		exchanges[c.Rank()] = opt.OuterStats().Exchanges
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("θ_g[0] = %.3f on both ranks: %v, after %d outer steps\n", global[0], global[0] == global[1], exchanges[0])
	// Output: θ_g[0] = 3.000 on both ranks: true, after 40 outer steps
}
