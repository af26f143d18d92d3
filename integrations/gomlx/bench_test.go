package gomlx

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/layers/activation"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/internal/samerun"
)

// mnistMLP is the MNIST-shaped 784-128-10 perceptron of the benchmark.
func mnistMLP(scope *model.Scope, x *graph.Node) *graph.Node {
	h := activation.Relu(layers.DenseWithBias(scope.In("hidden"), x, 128))
	return layers.DenseWithBias(scope.In("out"), h, 10)
}

// BenchmarkStepVsGoMLXAdam times, in alternation in the same loop, one
// train.Trainer step of the same model on one rank three ways:
//
//   - lowbit: Trainer.TrainStep with this package's Optimizer (lowbit's
//     exact Adam) followed by its host Step, what train.Loop runs;
//   - gomlx-adam: Trainer.TrainStep with GoMLX's own Adam inside the graph
//     (optimizer.Adam), the baseline;
//   - host: the Optimizer's Step alone (gradients copied out, lowbit's
//     Adam, values copied back, global step).
//
// It reports the median milliseconds of each, lowbit/gomlx-adam
// (x-gomlx-adam) and host/gomlx-adam. Batch 32 of random 784-pixel inputs;
// one rank, so nothing is communicated. Use -benchtime 30x or more.
func BenchmarkStepVsGoMLXAdam(b *testing.B) {
	rng := rand.New(rand.NewPCG(3, 4))
	const n = 32
	px := make([]float32, n*784)
	for i := range px {
		px[i] = rng.Float32()
	}
	lab := make([]int32, n)
	for i := range lab {
		lab[i] = int32(rng.IntN(10))
	}
	batch := func() train.Batch {
		return train.Batch{
			Inputs: []*tensors.Tensor{tensors.FromFlatDataAndDimensions(px, n, 784)},
			Labels: []*tensors.Tensor{tensors.FromFlatDataAndDimensions(lab, n, 1)},
		}
	}
	backend, err := gobackend.New("")
	require.NoError(b, err)
	opt, err := New(context.Background(), nil, adam, WithManualStep())
	require.NoError(b, err)
	defer opt.Close()
	lowbit := train.NewTrainer(backend, newStore(1), mnistMLP, loss.SparseCategoricalCrossEntropyLogits, opt, nil, nil)
	gomlxAdam := train.NewTrainer(backend, newStore(1), mnistMLP, loss.SparseCategoricalCrossEntropyLogits,
		optimizer.Adam().LearningRate(1e-2).Done(), nil, nil)

	var lastLoss float64
	step := func() {
		m, err := lowbit.TrainStep(batch())
		require.NoError(b, err)
		lastLoss = float64(tensors.ToScalar[float32](m[0]))
		require.NoError(b, opt.Step(lastLoss))
	}
	base := func() {
		_, err := gomlxAdam.TrainStep(batch())
		require.NoError(b, err)
	}
	host := func() { require.NoError(b, opt.Step(lastLoss)) }
	for range 3 { // compile and warm both
		step()
		base()
	}
	med := samerun.Medians(b, step, base, host)
	b.ReportMetric(med[0]*1e3, "lowbit-ms")
	b.ReportMetric(med[1]*1e3, "gomlx-adam-ms")
	b.ReportMetric(med[2]*1e3, "host-ms")
	b.ReportMetric(med[0]/med[1], "x-gomlx-adam")
	b.ReportMetric(med[2]/med[1], "host/gomlx-adam")
}
