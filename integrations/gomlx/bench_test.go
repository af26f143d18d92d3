package gomlx

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/layers/activation"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/internal/samerun"
)

// mlp is the MNIST-shaped 784-128-10 perceptron of the benchmark.
func mlp(scope *model.Scope, in []*graph.Node) *graph.Node {
	h := activation.Relu(layers.DenseWithBias(scope.In("hidden"), in[0], 128))
	logits := layers.DenseWithBias(scope.In("out"), h, 10)
	return graph.ReduceAllMean(loss.SparseCategoricalCrossEntropyLogits(in[1:2], []*graph.Node{logits}))
}

// BenchmarkStepVsGoMLXAdam times, in alternation in the same loop, four
// ways of running a training step of the same model on one rank:
//
//   - lowbit: the integration's Step with lowbit's exact Adam (the graph
//     computes loss and gradients, the gradients are copied out, Adam runs
//     on the host, the values are copied back);
//   - gomlx-adam: GoMLX's own Adam inside the graph (optimizer.Adam), the
//     baseline;
//   - graph: the integration's loss-and-gradient graph alone;
//   - host: what the integration adds to that graph, on kept gradients:
//     copying them out, lowbit's Adam, copying the values back.
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
	x := tensors.FromFlatDataAndDimensions(px, n, 784)
	y := tensors.FromFlatDataAndDimensions(lab, n, 1)
	ctx := context.Background()

	backend := newBackend(b)
	tr, err := New(nil, backend, newStore(1), mlp, adam)
	require.NoError(b, err)

	store := newStore(1)
	adamGraph := optimizer.Adam().LearningRate(1e-2).Done()
	own, err := model.NewExec(backend, store, func(scope *model.Scope, in []*graph.Node) *graph.Node {
		l := mlp(scope, in)
		adamGraph.UpdateGraph(scope, l.Graph(), l)
		return l
	})
	require.NoError(b, err)
	base := func() error {
		out, err := own.Exec(x, y)
		for _, o := range out {
			_ = o.FinalizeAll()
		}
		return err
	}
	step := func() error {
		_, err := tr.Step(ctx, x, y)
		return err
	}
	for range 3 { // compile and warm both
		require.NoError(b, step())
		require.NoError(b, base())
	}
	graphOnly := func() error {
		out, err := tr.exec.Exec(x, y)
		for _, o := range out {
			_ = o.FinalizeAll()
		}
		return err
	}
	require.NoError(b, graphOnly())
	// host is what the integration adds to the graph: copying the
	// gradients out, lowbit's Adam step, copying the values back.
	outs, err := tr.exec.Exec(x, y)
	require.NoError(b, err)
	host := func() {
		_, err := tr.export(outs)
		require.NoError(b, err)
		require.NoError(b, tr.opt.Step(ctx))
		require.NoError(b, tr.writeBack())
	}
	med := samerun.Medians(b,
		func() { require.NoError(b, step()) },
		func() { require.NoError(b, base()) },
		func() { require.NoError(b, graphOnly()) },
		host)
	b.ReportMetric(med[0]*1e3, "lowbit-ms")
	b.ReportMetric(med[1]*1e3, "gomlx-adam-ms")
	b.ReportMetric(med[2]*1e3, "graph-ms")
	b.ReportMetric(med[3]*1e3, "host-ms")
	b.ReportMetric(med[0]/med[1], "x-gomlx-adam")
	b.ReportMetric(med[3]/med[1], "host/gomlx-adam")
}
