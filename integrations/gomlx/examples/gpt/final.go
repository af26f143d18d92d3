package main

import (
	"context"
	"fmt"
	"math"

	"github.com/gomlx/compute"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/zoo/transformer"

	"github.com/lowbit-ml/lowbit/comm"
)

// The final evaluation of a run covers the validation text: the
// -val-windows windows of the curve (64 by default) are cheap enough to
// evaluate 20 times a run, but their mean is some 2% off the whole text's
// (the standard error of 64 windows), more than some of the differences
// the runs are compared by. The final one scores -final-windows windows of
// -context+1 bytes that tile the text (by default all of them: the whole
// text), and states the standard error of its mean. Fewer windows save
// time (the default corpus's validation text is about 24,500 windows of
// 65 bytes), at a cost: 8,192 left a standard error of 0.21% on the
// default model after 100 steps (docs/measured.md).

// finalBatch is the number of windows the final evaluation runs at once:
// a few MB of logits and attention weights with the default model, and
// two graphs (full batches and the last one) per run.
const finalBatch = 256

// tileWindows returns a rank's windows of the final evaluation, drawn
// from the windows of context+1 bytes at offsets 0, context, 2*context,
// ... that tile text (every byte but the first, and the last few, fewer
// than context, a target of exactly one of them): n of them evenly
// spaced, or all of them when n is 0 or at least their number. They are
// split over the ranks in contiguous runs. It returns the rank's inputs and
// targets (count windows of context bytes each) and every rank's windows
// (total).
func tileWindows(text []byte, context, n, rank, workers int) (x, y []int32, count, total int) {
	tiles := (len(text) - 1) / context
	total = tiles
	if n > 0 && n < tiles {
		total = n
	}
	lo, hi := rank*total/workers, (rank+1)*total/workers
	x, y = make([]int32, 0, (hi-lo)*context), make([]int32, 0, (hi-lo)*context)
	for i := lo; i < hi; i++ {
		off := int(int64(i)*int64(tiles)/int64(total)) * context
		w := text[off : off+context+1]
		for j := range context {
			x = append(x, int32(w[j]))
			y = append(y, int32(w[j+1]))
		}
	}
	return x, y, hi - lo, total
}

// windowLossFn is the final evaluation's graph: each window's loss summed
// over its positions ([windows]), the cross-entropy of the training loss
// (loss.SparseCategoricalCrossEntropyLogits) position by position.
func windowLossFn(m modelConfig) func(scope *model.Scope, x, y *graph.Node) *graph.Node {
	return func(scope *model.Scope, x, y *graph.Node) *graph.Node {
		logits := gpt(scope, m).Logits(x, transformer.CallOptions{})
		dims := x.Shape().Dimensions
		target := graph.OneHot(graph.Reshape(y, dims...), vocab, logits.DType())
		perPosition := graph.ReduceSum(graph.Neg(graph.Mul(target, graph.LogSoftmax(logits))), -1)
		return graph.ReduceSum(perPosition, -1)
	}
}

// finalEval is a rank's part of the final evaluation.
type finalEval struct {
	exec    *model.Exec
	x, y    []int32
	n       int // this rank's windows
	total   int // every rank's
	context int
	sums    []float32 // the collective's buffer: loss, window mean, its square
}

// finalResult is a run's final evaluation.
type finalResult struct {
	loss    float64 // nats per byte, over every target of the windows
	stderr  float64 // the standard error of loss, from the spread of the windows' losses
	windows int
}

// newFinalEval returns rank's part of the final evaluation of text over
// windows windows (0: all that tile it) on workers ranks.
func newFinalEval(backend compute.Backend, store *model.Store, m modelConfig, text []byte, windows, rank, workers int) (*finalEval, error) {
	exec, err := model.NewExec(backend, store, windowLossFn(m))
	if err != nil {
		return nil, err
	}
	x, y, n, total := tileWindows(text, m.context, windows, rank, workers)
	return &finalEval{exec: exec, x: x, y: y, n: n, total: total, context: m.context, sums: make([]float32, 3)}, nil
}

// eval evaluates the model every rank agrees on over every rank's windows:
// every rank calls it together and gets the same result. The loss is the
// mean over every target; its standard error is that of the mean of the
// windows' mean losses (the windows taken as independent samples), the
// noise a comparison of two runs' losses sees from the choice of text.
func (e *finalEval) eval(ctx context.Context, c comm.Comm) (finalResult, error) {
	var sum, sumMean, sumSq float64
	for lo := 0; lo < e.n; lo += finalBatch {
		k := min(finalBatch, e.n-lo)
		span := e.x[lo*e.context : (lo+k)*e.context]
		out, err := e.exec.Exec(tensors.FromFlatDataAndDimensions(span, k, e.context),
			tensors.FromFlatDataAndDimensions(e.y[lo*e.context:(lo+k)*e.context], k, e.context, 1))
		if err != nil {
			return finalResult{}, fmt.Errorf("final validation: %w", err)
		}
		losses, err := tensors.CopyFlatData[float32](out[0])
		if err != nil {
			return finalResult{}, fmt.Errorf("final validation: %w", err)
		}
		for _, s := range losses {
			mean := float64(s) / float64(e.context)
			sum += float64(s)
			sumMean += mean
			sumSq += mean * mean
		}
	}
	e.sums[0], e.sums[1], e.sums[2] = float32(sum), float32(sumMean), float32(sumSq)
	if err := c.AllReduce(ctx, e.sums, comm.Sum); err != nil {
		return finalResult{}, err
	}
	n := float64(e.total)
	r := finalResult{loss: float64(e.sums[0]) / (n * float64(e.context)), windows: e.total}
	r.stderr = meanStderr(e.total, float64(e.sums[1]), float64(e.sums[2]))
	return r, nil
}

// meanStderr is the standard error of the mean of n samples, given their
// sum and the sum of their squares: the square root of their sample
// variance (the squared deviations summed and divided by n-1) over n. It
// is 0 for fewer than 2 samples.
func meanStderr(n int, sum, sumSq float64) float64 {
	if n < 2 {
		return 0
	}
	k := float64(n)
	mean := sum / k
	variance := max(0, (sumSq-k*mean*mean)/(k-1))
	return math.Sqrt(variance / k)
}
