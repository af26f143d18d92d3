package main

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// targetNLLs returns the model's cross-entropy at every target of the
// windows x, y (n windows of m.context bytes), computed here in float64
// from its logits: what the validation graphs must compute.
func targetNLLs(t *testing.T, m modelConfig, store *model.Store, x, y []int32, n int) []float64 {
	t.Helper()
	backend, err := gobackend.New("ops_sequential")
	require.NoError(t, err)
	defer backend.Finalize()
	logits, err := model.NewExec(backend, store, logitsFn(m))
	require.NoError(t, err)
	out, err := logits.Exec(tensors.FromFlatDataAndDimensions(x, n, m.context))
	require.NoError(t, err)
	lg := tensors.MustCopyFlatData[float32](out[0])
	nll := make([]float64, len(y))
	for i, b := range y {
		row := lg[i*vocab : (i+1)*vocab]
		mx := math.Inf(-1)
		for _, v := range row {
			mx = max(mx, float64(v))
		}
		var z float64
		for _, v := range row {
			z += math.Exp(float64(v) - mx)
		}
		nll[i] = mx + math.Log(z) - float64(row[b])
	}
	return nll
}

// TestTileWindows: the final evaluation's windows tile the text: with 0
// windows (or more than there are) every byte but the first and the
// last few (fewer than context) is the target of exactly one window, in
// order, the ranks' windows together the one rank's; n windows are n of
// those, evenly spaced, none overlapping another.
func TestTileWindows(t *testing.T) {
	text := lateText(1003, 5, 1)
	const context = 10
	tiles := (len(text) - 1) / context
	x, y, n, total := tileWindows(text, context, 0, 0, 1)
	require.Equal(t, tiles, n)
	require.Equal(t, tiles, total)
	for i := range n * context {
		require.Equal(t, int32(text[i]), x[i], "input %d", i)
		require.Equal(t, int32(text[i+1]), y[i], "target %d", i)
	}
	for _, windows := range []int{0, tiles, 10 * tiles} {
		var xs, ys []int32
		for r := range 3 {
			x, y, _, total := tileWindows(text, context, windows, r, 3)
			require.Equal(t, tiles, total, "%d windows", windows)
			xs, ys = append(xs, x...), append(ys, y...)
		}
		assert.Equal(t, x, xs, "%d windows on 3 ranks", windows)
		assert.Equal(t, y, ys, "%d windows on 3 ranks", windows)
	}
	x, _, n, total = tileWindows(text, context, 7, 0, 1)
	require.Equal(t, 7, n)
	require.Equal(t, 7, total)
	last := -context
	for w := range n {
		off := strings.Index(string(text), string(int32sToBytes(x[w*context:(w+1)*context])))
		require.GreaterOrEqual(t, off, last+context, "window %d overlaps the one before", w)
		assert.Zero(t, off%context, "window %d is not a tile", w)
		last = off
	}
	assert.Greater(t, last, len(text)-3*len(text)/7, "spread over the text")
}

func int32sToBytes(v []int32) []byte {
	b := make([]byte, len(v))
	for i, c := range v {
		b[i] = byte(c)
	}
	return b
}

// TestFinalEval: the final validation loss over 2 ranks, in batches of
// finalBatch windows and a last smaller one, is the mean cross-entropy of
// the untrained model at every target of the tiled text, computed here
// from its logits, and its standard error that of the mean of the
// windows' mean losses.
func TestFinalEval(t *testing.T) {
	m := modelConfig{dModel: 8, layers: 1, heads: 1, ffn: 8, context: 8}
	text := lateText(8*(2*finalBatch+90)+5, 8, 3) // 602 windows: 301 per rank
	newStore := func() *model.Store {
		store := model.NewStore()
		store.RootScope().SetParam(model.ParamInitialSeed, int64(5))
		return store
	}
	x, y, n, _ := tileWindows(text, m.context, 0, 0, 1)
	require.Equal(t, 2*finalBatch+90, n)
	nll := targetNLLs(t, m, newStore(), x, y, n)
	var sum, sumMean, sumSq float64
	for w := range n {
		var s float64
		for _, v := range nll[w*m.context : (w+1)*m.context] {
			s += v
		}
		sum += s
		sumMean += s / float64(m.context)
		sumSq += s * s / float64(m.context*m.context)
	}
	want := sum / float64(len(nll))
	mean := sumMean / float64(n)
	wantSE := math.Sqrt((sumSq - float64(n)*mean*mean) / float64(n-1) / float64(n))
	require.Greater(t, wantSE, 1e-4)

	var mu sync.Mutex
	var got []finalResult
	require.NoError(t, local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		backend, err := gobackend.New("ops_sequential")
		if err != nil {
			return err
		}
		defer backend.Finalize()
		e, err := newFinalEval(backend, newStore(), m, text, 0, c.Rank(), c.Size())
		if err != nil {
			return err
		}
		r, err := e.eval(ctx, c)
		mu.Lock()
		defer mu.Unlock()
		got = append(got, r)
		return err
	}))
	require.Len(t, got, 2)
	for _, r := range got {
		assert.Equal(t, n, r.windows)
		assert.InEpsilon(t, want, r.loss, 1e-5)
		assert.InEpsilon(t, wantSE, r.stderr, 1e-3)
	}
	assert.Equal(t, got[0], got[1], "every rank the same")
}

// TestMeanStderr: the standard error of the windows' mean loss is the
// square root of their sample variance (divided by n-1, not n) over n,
// here of 2, 4, 4, 4, 5, 5, 7, 9 by hand: mean 5, squared deviations 32,
// variance 32/7, standard error sqrt(32/7/8) = sqrt(4/7) (dividing by n
// would give sqrt(1/2)).
func TestMeanStderr(t *testing.T) {
	samples := []float64{2, 4, 4, 4, 5, 5, 7, 9}
	var sum, sumSq float64
	for _, x := range samples {
		sum += x
		sumSq += x * x
	}
	assert.InDelta(t, math.Sqrt(4.0/7), meanStderr(len(samples), sum, sumSq), 1e-12)
	assert.InDelta(t, 0.5, meanStderr(2, 1+2, 1+4), 1e-12, "1 and 2: variance 1/2, standard error sqrt(1/4)")
	assert.Zero(t, meanStderr(1, 3, 9), "one window: no spread")
	assert.Zero(t, meanStderr(0, 0, 0))
	assert.Zero(t, meanStderr(3, 3, 3-1e-9), "rounding below zero: 0, not NaN")
}

// TestFinalValidation: a run's val loss (text table, JSON, Markdown) is
// the final evaluation over the whole validation text of the tiny corpus
// (its 652 tiles), with its standard error, and the curve's last
// evaluation on -val-windows windows is reported beside it; -final-windows
// takes fewer.
func TestFinalValidation(t *testing.T) {
	md := filepath.Join(t.TempDir(), "gpt.md")
	runs, out := runJSON(t, tiny("-optimizer", "adam", "-steps", "4", "-markdown", md, "-final-windows", "0")...)
	require.Len(t, runs, 1)
	r := runs[0]
	assert.Equal(t, 652, r.ValWindows)
	assert.Equal(t, r.Curve[len(r.Curve)-1].ValLoss, r.CurveValLoss)
	assert.NotEqual(t, r.CurveValLoss, r.ValLoss)
	assert.Positive(t, r.ValStderr)
	assert.Less(t, r.ValStderr, 0.005*r.ValLoss)
	assert.InDelta(t, r.ValLoss/math.Ln2, r.ValBitsPerByte, 1e-12)
	assert.Contains(t, out, "the curve on 16 windows, the final val loss on all 652 windows that tile the validation text")
	assert.Regexp(t, `optimizer\s+val loss\s+s\.e\.\s+bits/byte\s+curve val`, out)
	assert.Regexp(t, `adam\s+\d\.\d{4}\s+±0\.\d\d%\s+\d\.\d{4}\s+\d\.\d{4}`, out)
	b, err := os.ReadFile(md)
	require.NoError(t, err)
	assert.Contains(t, string(b), "| optimizer | val loss | s.e. | bits/byte | curve val | vs exact |")

	runs, _ = runJSON(t, tiny("-optimizer", "adam", "-steps", "4", "-final-windows", "100")...)
	assert.Equal(t, 100, runs[0].ValWindows)
	assert.Equal(t, r.CurveValLoss, runs[0].CurveValLoss, "the same curve")
	assert.NotEqual(t, r.ValLoss, runs[0].ValLoss)
}
