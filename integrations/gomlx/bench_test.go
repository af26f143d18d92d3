package gomlx

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

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

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/commtest"
	"github.com/lowbit-ml/lowbit/internal/samerun"
	"github.com/lowbit-ml/lowbit/optim"
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

// noCarrier hides the lowbit optimizer's optim.FlagCarrier: the Optimizer
// then agrees on its flags in an allreduce of its own before the
// optimizer's step, as it does with an optimizer that cannot carry them.
type noCarrier struct{ optim.Optimizer }

// withoutCarrier is build with the optimizer's FlagCarrier hidden.
func withoutCarrier(build Builder) Builder {
	return func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		o, err := build(ctx, c, p)
		if err != nil || o == nil {
			return o, err
		}
		return noCarrier{o}, nil
	}
}

// BenchmarkStepAgreement times the host step of a training step
// (Optimizer.Step: the gradients copied out, the per-step agreement, the
// lowbit step, the values copied back) on 2 in-process ranks training a
// tiny perceptron (8-4-1, 41 parameters), where every collective costs
// about its latency: the communicator sleeps -latency before each
// collective, as a round trip on a slow link would take (1 ms: sleeps
// shorter than that take about 1.1 ms on the test machine anyway). Two
// ways, in
// alternation in the same loop, each on its own models and optimizers:
//
//   - carried: the hook's flags ride in the lowbit optimizer's own
//     agreement (optim.FlagCarrier), one agreement per step;
//   - own: the optimizer's FlagCarrier hidden, so that the hook agrees in
//     an allreduce of its own first, two agreements per step (what every
//     step paid before the flags were carried).
//
// It reports the median milliseconds of each, carried/own, and the
// agreements (comm.Max allreduces) and collectives per step of each. Exact Adam, and
// 1-bit Adam in its compression stage. Use -benchtime 30x or more.
func BenchmarkStepAgreement(b *testing.B) {
	for _, tc := range []struct {
		name  string
		build Builder
		warm  int // steps before the timing: 1-bit Adam's freeze step is 5
	}{{"adam", adam, 2}, {"onebit-adam", onebitAdam, 8}} {
		for _, lat := range []time.Duration{0, time.Millisecond} {
			b.Run(fmt.Sprintf("%s/latency=%s", tc.name, lat), func(b *testing.B) {
				benchAgreement(b, tc.build, tc.warm, lat)
			})
		}
	}
}

// agreementRank is one rank's pair of models of BenchmarkStepAgreement:
// [0] carried, [1] own.
type agreementRank struct {
	opts [2]*Optimizer
	loss [2]float64
}

func newAgreementRank(ctx context.Context, c comm.Comm, build Builder, warm int) (*agreementRank, error) {
	r := c.Rank()
	set := &agreementRank{}
	for v, bld := range []Builder{build, withoutCarrier(build)} {
		backend, err := gobackend.New("")
		if err != nil {
			return nil, err
		}
		opt, err := New(ctx, c, bld, WithManualStep())
		if err != nil {
			return nil, err
		}
		trainer := train.NewTrainer(backend, newStore(int64(r)), mlp(4), loss.MeanSquaredError, opt, nil, nil)
		for range warm {
			x, y := regression(r*rows/2, (r+1)*rows/2)
			m, err := trainer.TrainStep(train.Batch{Inputs: []*tensors.Tensor{x}, Labels: []*tensors.Tensor{y}})
			if err != nil {
				return nil, err
			}
			set.loss[v] = float64(tensors.ToScalar[float32](m[0]))
			if err := opt.Step(set.loss[v]); err != nil {
				return nil, err
			}
		}
		set.opts[v] = opt
	}
	return set, nil
}

func benchAgreement(b *testing.B, build Builder, warm int, latency time.Duration) {
	ctx := context.Background()
	comms, err := local.New(2)
	require.NoError(b, err)
	cc := []commtest.Transparent{newCountingComm(comms[0], latency), newCountingComm(comms[1], latency)}
	// Rank 1 mirrors rank 0's passes, which it receives on next.
	next := make(chan int)
	ready := make(chan *agreementRank, 1)
	done := make(chan error, 1)
	go func() {
		set, err := newAgreementRank(ctx, cc[1], build, warm)
		ready <- set
		if err != nil {
			_ = cc[1].Close()
			done <- err
			return
		}
		for v := range next {
			if err := set.opts[v].Step(set.loss[v]); err != nil {
				_ = cc[1].Close()
				done <- err
				return
			}
		}
		for _, o := range set.opts {
			_ = o.Close()
		}
		done <- nil
	}()
	set, err := newAgreementRank(ctx, cc[0], build, warm)
	require.NoError(b, err)
	require.NotNil(b, <-ready)
	pass := func(v int) func() {
		return func() {
			next <- v
			require.NoError(b, set.opts[v].Step(set.loss[v]))
		}
	}
	// Agreements and collectives per step of each way, counted on rank 0.
	var perStep, callsPerStep [2]float64
	for v := range 2 {
		before, calls := cc[0].Agreements.Load(), cc[0].Calls.Load()
		for range 4 {
			pass(v)()
		}
		perStep[v] = float64(cc[0].Agreements.Load()-before) / 4
		callsPerStep[v] = float64(cc[0].Calls.Load()-calls) / 4
	}
	med := samerun.Medians(b, pass(0), pass(1))
	close(next)
	require.NoError(b, <-done)
	b.ReportMetric(med[0]*1e3, "carried-ms")
	b.ReportMetric(med[1]*1e3, "own-ms")
	b.ReportMetric(med[0]/med[1], "carried/own")
	b.ReportMetric(perStep[0], "carried-agreements/step")
	b.ReportMetric(perStep[1], "own-agreements/step")
	b.ReportMetric(callsPerStep[0], "carried-collectives/step")
	b.ReportMetric(callsPerStep[1], "own-collectives/step")
	for _, s := range set.opts {
		require.NoError(b, s.Close())
	}
	for _, c := range cc {
		require.NoError(b, c.Close())
	}
}
