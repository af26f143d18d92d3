package zero_test

import (
	"context"
	"fmt"
	"log"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

// Four in-process ranks fit the 1000 elements of w to the mean of their
// targets: rank r pulls every element towards r, so the mean gradient
// pulls towards 1.5. Each rank keeps the Adam moments of 250 of the
// 1000 elements; the gradients travel as int8 codes.
func ExampleAdam() {
	var final [4][]float32
	var floats [4]int
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
		w := optim.NewParam("w", 1000)
		cfg := zero.DefaultConfig()
		cfg.LR = 0.05
		cfg.ReduceScatter = zero.ReduceInt8
		// Buckets of 64 elements (16 per rank): the default, 25 MiB,
		// is meant for real models and would stage this one whole.
		cfg.BucketBytes = 256
		opt, err := zero.NewAdam(ctx, c, []*optim.Param{w}, cfg)
		if err != nil {
			return err
		}
		defer opt.Close()
		target := float32(c.Rank())
		for range 300 {
			for i, x := range w.Data() {
				w.GradData()[i] = 2 * (x - target) // d/dx (x - target)^2
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		final[c.Rank()] = w.Data()
		floats[c.Rank()] = opt.StateFloats()
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("w[0] = %.2f and w[999] = %.2f on every rank: %v\n", final[0][0], final[0][999],
		fmt.Sprint(final[0]) == fmt.Sprint(final[3]))
	fmt.Printf("optimizer float32s per rank: %d (optim.Adam: 2000)\n", floats[0])
	// Output:
	// w[0] = 1.50 and w[999] = 1.50 on every rank: true
	// optimizer float32s per rank: 614 (optim.Adam: 2000)
}
