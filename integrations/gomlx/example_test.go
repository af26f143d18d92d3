package gomlx_test

import (
	"context"
	"fmt"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/model"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/integrations/gomlx"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// A GoMLX linear regression trained data-parallel on 2 in-process ranks
// with 1-bit Adam: each rank builds its own model.Store and feeds its own
// half of the batch; the Trainer averages the gradients through lowbit.
func Example() {
	// y = 2x - 1 on 8 points, 4 per rank.
	xs := []float32{-1, -0.75, -0.5, -0.25, 0.25, 0.5, 0.75, 1}
	ys := make([]float32, len(xs))
	for i, x := range xs {
		ys[i] = 2*x - 1
	}
	loss := func(scope *model.Scope, in []*graph.Node) *graph.Node {
		pred := layers.DenseWithBias(scope.In("linear"), in[0], 1)
		return graph.ReduceAllMean(graph.Square(graph.Sub(pred, in[1])))
	}
	newOpt := func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.LR, cfg.FreezeStep = 0.05, 20
		return onebit.NewAdam(ctx, c, p, cfg)
	}
	losses := make([]float32, 2)
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		backend, err := gobackend.New("")
		if err != nil {
			return err
		}
		tr, err := gomlx.New(c, backend, model.NewStore(), loss, newOpt)
		if err != nil {
			return err
		}
		defer tr.Close()
		lo := 4 * c.Rank()
		x := tensors.FromFlatDataAndDimensions(xs[lo:lo+4], 4, 1)
		y := tensors.FromFlatDataAndDimensions(ys[lo:lo+4], 4, 1)
		for range 300 {
			if losses[c.Rank()], err = tr.Step(ctx, x, y); err != nil {
				return err
			}
		}
		return nil
	})
	fmt.Println("error:", err)
	fmt.Println("loss below 0.01 on both ranks:", losses[0] < 0.01 && losses[1] < 0.01)
	// Output:
	// error: <nil>
	// loss below 0.01 on both ranks: true
}
