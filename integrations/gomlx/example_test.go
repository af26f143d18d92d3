package gomlx_test

import (
	"context"
	"fmt"
	"iter"
	"os"
	"path/filepath"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/layers/activation"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/integrations/gomlx"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// half is a train.Dataset: rank's half of y = 2x - 1 on 8 points, every step.
type half struct{ rank int }

func (h half) Name() string { return "line" }

func (h half) Iter() iter.Seq2[train.Batch, error] {
	return func(yield func(train.Batch, error) bool) {
		xs := []float32{-1, -0.75, -0.5, -0.25, 0.25, 0.5, 0.75, 1}[4*h.rank : 4*h.rank+4]
		for {
			ys := make([]float32, len(xs))
			for i, x := range xs {
				ys[i] = 2*x - 1
			}
			b := train.Batch{
				Inputs: []*tensors.Tensor{tensors.FromFlatDataAndDimensions(xs, 4, 1)},
				Labels: []*tensors.Tensor{tensors.FromFlatDataAndDimensions(ys, 4, 1)},
			}
			if !yield(b, nil) {
				return
			}
		}
	}
}

// A GoMLX linear regression trained with train.Loop, data-parallel on 2
// in-process ranks with 1-bit Adam: the GoMLX code is the usual one, but
// for the optimizer given to train.NewTrainer and the AttachToLoop line.
func Example() {
	linear := func(scope *model.Scope, x *graph.Node) *graph.Node {
		return layers.DenseWithBias(scope.In("linear"), x, 1)
	}
	losses := make([]float32, 2)
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		backend, err := gobackend.New("")
		if err != nil {
			return err
		}
		opt, err := gomlx.New(ctx, c, func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			cfg := onebit.DefaultAdamConfig()
			cfg.LR, cfg.FreezeStep = 0.05, 20
			return onebit.NewAdam(ctx, c, p, cfg)
		})
		if err != nil {
			return err
		}
		defer opt.Close()
		trainer := train.NewTrainer(backend, model.NewStore(), linear, loss.MeanSquaredError, opt, nil, nil)
		loop := train.NewLoop(trainer)
		opt.AttachToLoop(loop)
		metrics, err := loop.RunSteps(half{rank: c.Rank()}, 300)
		if err != nil {
			return err
		}
		losses[c.Rank()] = tensors.ToScalar[float32](metrics[0])
		return nil
	})
	fmt.Println("error:", err)
	fmt.Println("loss below 0.01 on both ranks:", losses[0] < 0.01 && losses[1] < 0.01)
	// Output:
	// error: <nil>
	// loss below 0.01 on both ranks: true
}

// The outer optimizer with Muon inside (MuLoCo) on 2 in-process ranks:
// each rank takes Muon steps on the hidden layer's matrix and AdamW steps
// on the rest, on its own half of the points, and every 10 steps the
// ranks exchange their pseudo-gradients in 1 bit per element. The model
// the ranks agree on, the global parameters, is evaluated with
// WithGlobalValues.
func ExampleNewOuterMuon() {
	mlp := func(scope *model.Scope, x *graph.Node) *graph.Node {
		h := activation.Relu(layers.DenseWithBias(scope.In("hidden"), x, 8))
		return layers.DenseWithBias(scope.In("out"), h, 1)
	}
	cfg := outer.DefaultConfigFor(outer.CodecOneBit)
	cfg.H = 10
	muon := optim.DefaultMuonConfig()
	muon.AdamLR = 0.02
	losses := make([]float32, 2)
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		backend, err := gobackend.New("")
		if err != nil {
			return err
		}
		opt, err := gomlx.New(ctx, c, gomlx.NewOuterMuon(cfg, muon))
		if err != nil {
			return err
		}
		defer opt.Close()
		store := model.NewStore()
		store.RootScope().SetParam(model.ParamInitialSeed, int64(3)) // rank 0's initial values reach every rank
		trainer := train.NewTrainer(backend, store, mlp, loss.MeanSquaredError, opt, nil, nil)
		loop := train.NewLoop(trainer)
		opt.AttachToLoop(loop)
		if _, err := loop.RunSteps(half{rank: c.Rank()}, 200); err != nil {
			return err
		}
		// The global parameters' loss on this rank's half.
		ds := half{rank: c.Rank()}
		return opt.WithGlobalValues(func() error {
			for b := range ds.Iter() {
				metrics, err := trainer.EvalStep(b)
				if err != nil {
					return err
				}
				losses[c.Rank()] = tensors.ToScalar[float32](metrics[0])
				return nil
			}
			return nil
		})
	})
	fmt.Println("error:", err)
	fmt.Println("global parameters' loss below 0.05 on both halves:", losses[0] < 0.05 && losses[1] < 0.05)
	// Output:
	// error: <nil>
	// global parameters' loss below 0.05 on both halves: true
}

// Checkpoints on 2 ranks, each in its own directory, saved every step: a
// second run resumes every rank from the newest step they all hold. Before
// it, rank 1's newest checkpoint is removed, as a crash between the ranks'
// last saves would leave it: both ranks resume from step 3, rank 0's step
// 4 is set aside.
func ExampleOptimizer_Checkpoint() {
	dir, err := os.MkdirTemp("", "lowbit-gomlx-example-")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)
	linear := func(scope *model.Scope, x *graph.Node) *graph.Node {
		return layers.DenseWithBias(scope.In("linear"), x, 1)
	}
	run := func(steps int) ([]int64, error) {
		start := make([]int64, 2)
		err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
			backend, err := gobackend.New("")
			if err != nil {
				return err
			}
			opt, err := gomlx.New(ctx, c, func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
				return optim.NewAdam(ctx, c, p, optim.DefaultAdamConfig())
			})
			if err != nil {
				return err
			}
			defer opt.Close()
			store := model.NewStore()
			// Instead of checkpoint.Build(store).Dir(rankDir).Keep(2).Done():
			ckpt, err := opt.Checkpoint(checkpoint.Build(store).Keep(2), filepath.Join(dir, fmt.Sprintf("rank-%d", c.Rank())))
			if err != nil {
				return err
			}
			trainer := train.NewTrainer(backend, store, linear, loss.MeanSquaredError, opt, nil, nil)
			loop := train.NewLoop(trainer)
			opt.AttachToLoop(loop)
			train.EveryNSteps(loop, 1, "checkpoint", 100, opt.SaveOnStepFn(ckpt))
			start[c.Rank()] = trainer.GlobalStep()
			_, err = loop.RunSteps(half{rank: c.Rank()}, steps)
			return err
		})
		return start, err
	}
	start, err := run(4)
	fmt.Println("first run starts at", start, "error:", err)
	lost, _ := filepath.Glob(filepath.Join(dir, "rank-1", "*step-00000004*"))
	for _, f := range lost {
		os.Remove(f)
	}
	start, err = run(2)
	fmt.Println("rank 1 lost", len(lost), "files of step 4; the second run starts at", start, "error:", err)
	// Output:
	// first run starts at [0 0] error: <nil>
	// rank 1 lost 3 files of step 4; the second run starts at [3 3] error: <nil>
}
