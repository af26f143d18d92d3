package gorgonia_test

import (
	"context"
	"fmt"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	lbgorgonia "github.com/lowbit-ml/lowbit/integrations/gorgonia"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// Fitting y = 2x on 2 in-process ranks with 1-bit Adam: each rank runs its
// own Gorgonia graph on its half of the data and steps a lowbit Solver in
// place of a Gorgonia solver.
func Example() {
	xs := []float32{-1, -0.5, 0.5, 1}
	losses := make([]float32, 2)
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		g := G.NewGraph()
		lo := 2 * c.Rank()
		x := G.NewMatrix(g, tensor.Float32, G.WithShape(2, 1), G.WithName("x"),
			G.WithValue(tensor.New(tensor.WithShape(2, 1), tensor.WithBacking([]float32{xs[lo], xs[lo+1]}))))
		y := G.NewMatrix(g, tensor.Float32, G.WithShape(2, 1), G.WithName("y"),
			G.WithValue(tensor.New(tensor.WithShape(2, 1), tensor.WithBacking([]float32{2 * xs[lo], 2 * xs[lo+1]}))))
		// Each rank starts from its own weight; Init broadcasts rank 0's.
		w := G.NewMatrix(g, tensor.Float32, G.WithShape(1, 1), G.WithName("w"),
			G.WithValue(tensor.New(tensor.WithShape(1, 1), tensor.WithBacking([]float32{float32(c.Rank())}))))
		cost := G.Must(G.Mean(G.Must(G.Square(G.Must(G.Sub(G.Must(G.Mul(x, w)), y))))))
		if _, err := G.Grad(cost, w); err != nil {
			return err
		}
		vm := G.NewTapeMachine(g, G.BindDualValues(w))
		defer vm.Close()

		solver, err := lbgorgonia.NewSolver(ctx, c, func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			cfg := onebit.DefaultAdamConfig()
			cfg.LR, cfg.FreezeStep = 0.05, 20
			return onebit.NewAdam(ctx, c, p, cfg)
		})
		if err != nil {
			return err
		}
		defer solver.Close()
		model := []G.ValueGrad{w}
		if err := solver.Init(ctx, model); err != nil {
			return err
		}
		for range 200 {
			vm.Reset()
			if err := vm.RunAll(); err != nil {
				return err
			}
			if err := solver.Step(model); err != nil { // a gorgonia.Solver
				return err
			}
		}
		losses[c.Rank()] = cost.Value().Data().(float32)
		return nil
	})
	fmt.Println("error:", err)
	fmt.Println("loss below 0.01 on both ranks:", losses[0] < 0.01 && losses[1] < 0.01)
	// Output:
	// error: <nil>
	// loss below 0.01 on both ranks: true
}
