// Command minimal is a complete GoMLX program that trains data-parallel
// with lowbit's 1-bit Adam: a small classifier of three Gaussian blobs,
// train.Loop with GoMLX's progress bar, checkpoints it resumes from.
//
//	go run . -ranks 4                           # 4 ranks in this process
//	go build -tags mpi . && mpirun --allow-run-as-root --oversubscribe -np 4 ./minimal -mpi   # 4 processes
package main

import (
	"context"
	"flag"
	"fmt"
	"iter"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/layers/activation"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/gomlx/gomlx/ui/commandline"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/comm/mpi"
	lbgomlx "github.com/lowbit-ml/lowbit/integrations/gomlx"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

var (
	ranks    = flag.Int("ranks", 2, "ranks in this process (without -mpi)")
	useMPI   = flag.Bool("mpi", false, "be one rank of an mpirun job (build with -tags mpi)")
	dir      = flag.String("checkpoint", "checkpoints", "checkpoint directory, one subdirectory per rank; a run resumes from it")
	steps    = flag.Int("steps", 400, "global step to train to")
	progress = flag.Bool("progress", true, "GoMLX's progress bar on rank 0")
	timeout  = flag.Duration("timeout", 24*time.Hour, "the run's deadline: no rank waits for a gone one past it")
)

func main() {
	flag.Parse()
	// Every collective gives up at the deadline: a rank that is gone cannot hang the others.
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	if err := run(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "minimal:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	if !*useMPI {
		if err := local.CheckNotUnderMPI(); err != nil { // started by mpirun without -mpi
			return fmt.Errorf("%w: give -mpi", err)
		}
		return local.Run(ctx, *ranks, trainRank) // a goroutine per rank
	}
	c, err := mpi.Open() // this process is one rank of mpirun -np W
	if err != nil {
		return err
	}
	defer c.Close()
	return trainRank(ctx, c)
}

// trainRank is one rank's GoMLX program: every rank runs it together.
func trainRank(ctx context.Context, c comm.Comm) error {
	config := "" // one backend per rank; ranks sharing a process run its ops in order
	if !*useMPI {
		config = "ops_sequential"
	}
	backend, err := gobackend.New(config)
	if err != nil {
		return err
	}
	defer backend.Finalize()
	store := model.NewStore()
	opt, err := lbgomlx.New(ctx, c, func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		cfg := onebit.DefaultAdamConfig()
		cfg.FreezeStep = 80 // exact warm-up steps: a fifth of the 400 planned; fixed on resume
		return onebit.NewAdam(ctx, c, p, cfg)
	}, lbgomlx.WithWarnings(os.Stderr), lbgomlx.WithMeanMetrics())
	if err != nil {
		return err
	}
	defer opt.Close()
	ckpt, err := opt.Checkpoint(checkpoint.Build(store).Keep(2), filepath.Join(*dir, fmt.Sprintf("rank-%d", c.Rank())))
	if err != nil {
		return err
	}
	// After the checkpoint, which restores the parameters it saved.
	store.SetParam(optimizer.ParamLearningRate, 0.01)
	trainer := train.NewTrainer(backend, store, classifier, loss.SparseCategoricalCrossEntropyLogits, opt, nil, nil)
	if c.Rank() == 0 && trainer.GlobalStep() > 0 { // the checkpoint's step: a resume
		fmt.Printf("resumed from global step %d (%s)\n", trainer.GlobalStep(), *dir)
	}
	loop := train.NewLoop(trainer)
	opt.AttachToLoop(loop)
	if *progress && c.Rank() == 0 {
		commandline.AttachProgressBar(loop) // the loss over all ranks: WithMeanMetrics
	}
	train.EveryNSteps(loop, 100, "checkpoint", 100, opt.SaveOnStepFn(ckpt))
	metrics, err := loop.RunToGlobalStep(lbgomlx.Shard(blobs{}, c, trainer.GlobalStep), *steps)
	if err != nil {
		return err
	}
	if metrics == nil { // the checkpoint is at -steps already
		if c.Rank() == 0 {
			fmt.Printf("global step %d: nothing to train up to -steps %d; raise it to train on\n", trainer.GlobalStep(), *steps)
		}
		return nil
	}
	if err := opt.Save(ckpt); err != nil { // EveryNSteps saves the last step only if a multiple of 100
		return err
	}
	if c.Rank() == 0 {
		fmt.Printf("global step %d: loss %.4f over %d ranks\n", trainer.GlobalStep(), tensors.ToScalar[float32](metrics[0]), c.Size())
	}
	return nil
}

// classifier is the model: 2 inputs, 32 hidden units, 3 classes' logits.
func classifier(scope *model.Scope, x *graph.Node) *graph.Node {
	h := activation.Relu(layers.DenseWithBias(scope.In("hidden"), x, 32))
	return layers.DenseWithBias(scope.In("out"), h, 3)
}

// blobs yields the global batches, the same on every rank: batch i holds
// 96 points of three Gaussian blobs, drawn from seed i.
type blobs struct{}

func (blobs) Name() string { return "blobs" }

func (blobs) Iter() iter.Seq2[train.Batch, error] {
	centers := [3][2]float64{{2, 0}, {-1, 1.7}, {-1, -1.7}}
	return func(yield func(train.Batch, error) bool) {
		for i := uint64(0); ; i++ {
			rng := rand.New(rand.NewPCG(i, 0))
			x, y := make([]float32, 2*96), make([]int32, 96)
			for r := range y {
				y[r] = int32(rng.IntN(3))
				x[2*r] = float32(centers[y[r]][0] + rng.NormFloat64())
				x[2*r+1] = float32(centers[y[r]][1] + rng.NormFloat64())
			}
			b := train.Batch{Inputs: []*tensors.Tensor{tensors.FromFlatDataAndDimensions(x, 96, 2)},
				Labels: []*tensors.Tensor{tensors.FromFlatDataAndDimensions(y, 96, 1)}}
			if !yield(b, nil) {
				return
			}
		}
	}
}
