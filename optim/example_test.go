package optim_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/lowbit-ml/lowbit/optim"
)

// Fit w to minimise (w - 3)^2 with Adam in a single process (no
// communicator), checkpointing halfway.
func ExampleAdam() {
	w, err := optim.NewParamFrom("w", []float32{0}, 1)
	if err != nil {
		log.Fatal(err)
	}
	cfg := optim.DefaultAdamConfig()
	cfg.LR = 0.1
	opt, err := optim.NewAdam(context.Background(), nil, []*optim.Param{w}, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer opt.Close() // every holder of an optimizer closes it (not a collective)
	dir, err := os.MkdirTemp("", "adam-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ctx := context.Background()
	for step := 1; step <= 200; step++ {
		w.GradData()[0] = 2 * (w.Data()[0] - 3) // d/dw (w-3)^2
		if err := opt.Step(ctx); err != nil {
			log.Fatal(err)
		}
		if step == 100 {
			ck, err := opt.State()
			if err != nil {
				log.Fatal(err)
			}
			if err := optim.SaveFile(filepath.Join(dir, "adam.ckpt"), ck); err != nil {
				log.Fatal(err)
			}
		}
	}
	fmt.Printf("w = %.2f after %d steps\n", w.Data()[0], opt.Stats().Steps)
	// Output: w = 3.00 after 200 steps
}
