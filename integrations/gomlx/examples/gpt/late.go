package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"

	"github.com/gomlx/compute"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ml/zoo/transformer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
)

// Bytes first seen after the warm-up (-late-bytes, -late-from): before step
// -late-from no training window holding one of the late bytes is drawn, so
// that their embedding rows get their first gradient then, after the 1-bit
// optimizers froze their variance. The validation reports the loss on the
// positions whose target byte is a late byte besides the overall loss.

// lateDelay is how many steps after the freeze step the late bytes first
// occur when -late-from is left at 0.
const lateDelay = 10

// lateOptions are -late-bytes and -late-from.
type lateOptions struct {
	chars string // the late bytes: every byte of the string; "" for none
	from  int    // the first step whose windows may hold them; 0: the freeze step + lateDelay
}

// flags defines -late-bytes and -late-from on fs.
func (l *lateOptions) flags(fs *flag.FlagSet) {
	fs.StringVar(&l.chars, "late-bytes", "", "bytes first seen after the warm-up: every byte of this string (\"0123456789\", \"{}\"); training windows holding one are not drawn before -late-from, and the validation also reports the loss on the positions whose next byte is one of them")
	fs.IntVar(&l.from, "late-from", 0, "the first step whose training windows may hold the -late-bytes (0: the freeze step + 10)")
}

// check refuses -late-bytes and -late-from values parseFlags cannot
// use, with fs's usage errors.
func (l *lateOptions) check(fs *flag.FlagSet) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	switch {
	case given["late-bytes"] && l.chars == "":
		return cliflag.Bad(fs, "late-bytes", "want the bytes to withhold, such as 0123456789")
	case l.from < 0 || l.from > maxSteps:
		return cliflag.Bad(fs, "late-from", "want 0 (the freeze step + %d) to %d", lateDelay, maxSteps)
	case given["late-from"] && l.chars == "":
		return cliflag.Bad(fs, "late-from", "only with -late-bytes, the bytes it withholds")
	}
	return nil
}

// set is the late bytes as a set.
func (l *lateOptions) set() *[256]bool {
	var s [256]bool
	for i := range len(l.chars) {
		s[l.chars[i]] = true
	}
	return &s
}

// lateFrom is the first step whose training windows may hold the late
// bytes.
func (o *options) lateFrom() int {
	if o.late.from > 0 {
		return o.late.from
	}
	return o.hyper().freezeStep + lateDelay
}

// lateWindows are the training windows free of the late bytes, the ones
// drawn before step from: the offsets of the windows of context+1 bytes
// that hold none of them, as runs of consecutive offsets.
type lateWindows struct {
	set    *[256]bool
	from   int
	starts []int // the first offset of each run
	ends   []int // the free windows of runs 0..k together: strictly increasing
	free   int   // free windows
	total  int   // windows
}

// newLateWindows finds the windows of context+1 bytes of text that hold
// none of the bytes of set.
func newLateWindows(text []byte, context int, set *[256]bool, from int) *lateWindows {
	l := &lateWindows{set: set, from: from, total: len(text) - context}
	// The free offsets lie between two late bytes at p and q: p+1 up to
	// q-context-1, the window ending before q. The end of the text counts
	// as a late byte at len(text).
	prev := -1
	for q := 0; q <= len(text); q++ {
		if q < len(text) && !set[text[q]] {
			continue
		}
		if lo, hi := prev+1, q-context; hi > lo {
			l.free += hi - lo
			l.starts = append(l.starts, lo)
			l.ends = append(l.ends, l.free)
		}
		prev = q
	}
	return l
}

// batcher is newBatcher over the training text, the windows before
// -late-from drawn from those free of the late bytes.
// With own (-rank-data files) the rank draws from its own training files
// (corpus.rankText); -late-bytes is refused with it.
func (c *corpus) batcher(context, batch, rank, workers int, seed uint64, own bool) *batcher {
	if own {
		text, _ := c.rankText(rank, workers)
		b := newBatcher(text, context, batch, rank, workers, seed)
		b.own, b.rank = true, rank
		return b
	}
	b := newBatcher(c.train, context, batch, rank, workers, seed)
	b.late = c.late
	return b
}

// draw returns a free window's offset, uniformly among them, drawn from
// rng (one draw: the same on every rank).
func (l *lateWindows) draw(rng *rand.Rand) int {
	u := rng.IntN(l.free)
	k, _ := slices.BinarySearch(l.ends, u+1) // the first run ending past u
	before := 0
	if k > 0 {
		before = l.ends[k-1]
	}
	return l.starts[k] + u - before
}

// lateWindows returns the free windows of -late-bytes in the training text
// (nil without it), or an error if none is free or none holds one.
func (o *options) lateWindows(data *corpus) (*lateWindows, error) {
	if o.late.chars == "" {
		return nil, nil
	}
	l := newLateWindows(data.train, o.model.context, o.late.set(), o.lateFrom())
	switch {
	case l.free == l.total:
		return nil, fmt.Errorf("-late-bytes %q: no training window holds any of them; name bytes of the corpus", o.late.chars)
	case l.free == 0:
		return nil, fmt.Errorf("-late-bytes %q: every training window of %d bytes holds one of them; withhold fewer bytes", o.late.chars, o.model.context+1)
	}
	return l, nil
}

// lateMask is 1 at the positions of y whose byte is in set, 0 elsewhere,
// and the count of the ones.
func lateMask(y []int32, set *[256]bool) ([]float32, int) {
	w := make([]float32, len(y))
	n := 0
	for i, b := range y {
		if set[b] {
			w[i] = 1
			n++
		}
	}
	return w, n
}

// maskedSumLossFn is sumLossFn weighted by position: the validation graph
// of the late-byte loss, the sum of the losses at the positions where w
// ([windows, context], float32) is 1.
func maskedSumLossFn(m modelConfig) func(scope *model.Scope, x, y, w *graph.Node) *graph.Node {
	return func(scope *model.Scope, x, y, w *graph.Node) *graph.Node {
		logits := gpt(scope, m).Logits(x, transformer.CallOptions{})
		// The mean over every position of the weighted losses.
		mean := loss.SparseCategoricalCrossEntropyLogits([]*graph.Node{y, w}, []*graph.Node{logits})
		return graph.MulScalar(mean, float64(x.Shape().Size()))
	}
}

// lateEval is a rank's late-byte validation: the loss on the positions of
// its validation windows whose target byte is a late byte.
type lateEval struct {
	exec    *model.Exec
	x, y    []int32
	w       []float32
	n       int // windows
	context int
	count   int // late positions among them
	sums    []float32
}

// newLateEval returns the late-byte validation of the validation windows
// x, y (n windows of context bytes), nil without late bytes.
func newLateEval(backend compute.Backend, store *model.Store, m modelConfig, late *lateWindows, x, y []int32, n int) (*lateEval, error) {
	if late == nil {
		return nil, nil
	}
	exec, err := model.NewExec(backend, store, maskedSumLossFn(m))
	if err != nil {
		return nil, err
	}
	w, count := lateMask(y, late.set)
	return &lateEval{exec: exec, x: x, y: y, w: w, n: n, context: m.context, count: count, sums: make([]float32, 2)}, nil
}

// loss returns the late-byte validation loss over every rank's windows
// (every rank calls it together), nil if e is nil or no position's target
// is a late byte.
func (e *lateEval) loss(ctx context.Context, c comm.Comm) (*float64, error) {
	if e == nil {
		return nil, nil
	}
	e.sums[0], e.sums[1] = 0, float32(e.count)
	if e.count > 0 {
		out, err := e.exec.Exec(tensors.FromFlatDataAndDimensions(e.x, e.n, e.context),
			tensors.FromFlatDataAndDimensions(e.y, e.n, e.context, 1),
			tensors.FromFlatDataAndDimensions(e.w, e.n, e.context))
		if err != nil {
			return nil, fmt.Errorf("late-byte validation: %w", err)
		}
		e.sums[0] = tensors.ToScalar[float32](out[0])
	}
	if err := c.AllReduce(ctx, e.sums, comm.Sum); err != nil {
		return nil, err
	}
	if e.sums[1] == 0 {
		return nil, nil
	}
	v := float64(e.sums[0]) / float64(e.sums[1])
	return &v, nil
}

// lateLoss is the run's last late-byte validation loss, nil for none.
func (r *result) lateLoss() *float64 {
	if len(r.evals) == 0 {
		return nil
	}
	return r.evals[len(r.evals)-1].LateLoss
}

// lateHeader is the late-byte column's header in the text table ("" without
// -late-bytes), lateCell its cell of r.
func lateHeader(o *options) string {
	if o.late.chars == "" {
		return ""
	}
	return "late-byte loss\t"
}

func lateCell(o *options, r *result) string {
	if o.late.chars == "" {
		return ""
	}
	return formatLate(r.lateLoss()) + "\t"
}

// formatLate formats a late-byte loss, "-" for none.
func formatLate(v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%.4f", *v)
}

// lateDesc describes the late bytes for the headers, "" without them.
func lateDesc(o *options, data *corpus) string {
	l := data.late
	if l == nil {
		return ""
	}
	_, y, _ := valWindows(data.val, o.model.context, o.valWindows, 0, 1)
	_, n := lateMask(y, l.set)
	return fmt.Sprintf("late bytes %q: training windows holding one (%.1f%% of them) are not drawn before step %d; they are %d of the %d validation targets",
		o.late.chars, 100*float64(l.total-l.free)/float64(l.total), l.from, n, len(y))
}
