// Command single is examples/minimal as a GoMLX user writes it for one
// process, with GoMLX's own Adam: the program examples/minimal makes
// data-parallel with lowbit. Compare the two with diff.
package main

import (
	"flag"
	"fmt"
	"iter"
	"math/rand/v2"
	"os"

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
)

var (
	dir      = flag.String("checkpoint", "checkpoints", "checkpoint directory; a run resumes from it")
	steps    = flag.Int("steps", 400, "global step to train to")
	progress = flag.Bool("progress", true, "GoMLX's progress bar")
)

func main() {
	flag.Parse()
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "single:", err)
		os.Exit(1)
	}
}

func run() error {
	backend, err := gobackend.New("")
	if err != nil {
		return err
	}
	defer backend.Finalize()
	store := model.NewStore()
	ckpt, err := checkpoint.Build(store).Dir(*dir).Keep(2).Done()
	if err != nil {
		return err
	}
	store.SetParam(optimizer.ParamLearningRate, 0.01)
	trainer := train.NewTrainer(backend, store, classifier, loss.SparseCategoricalCrossEntropyLogits, optimizer.Adam().Done(), nil, nil)
	loop := train.NewLoop(trainer)
	if *progress {
		commandline.AttachProgressBar(loop)
	}
	train.EveryNSteps(loop, 100, "checkpoint", 100, ckpt.SaveOnStepFn)
	metrics, err := loop.RunToGlobalStep(blobs{}, *steps)
	if err != nil || metrics == nil {
		return err
	}
	if err := ckpt.Save(); err != nil {
		return err
	}
	fmt.Printf("global step %d: loss %.4f\n", trainer.GlobalStep(), tensors.ToScalar[float32](metrics[0]))
	return nil
}

// classifier is the model: 2 inputs, 32 hidden units, 3 classes' logits.
func classifier(scope *model.Scope, x *graph.Node) *graph.Node {
	h := activation.Relu(layers.DenseWithBias(scope.In("hidden"), x, 32))
	return layers.DenseWithBias(scope.In("out"), h, 3)
}

// blobs yields the batches: batch i holds 96 points of three Gaussian
// blobs, drawn from seed i.
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
