package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
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
	"github.com/lowbit-ml/lowbit/internal/cliflag"
)

// lateText is text of lowercase letters with a digit at about one byte in
// every.
func lateText(n, every int, seed uint64) []byte {
	rng := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, n)
	for i := range b {
		if rng.IntN(every) == 0 {
			b[i] = byte('0' + rng.IntN(10))
		} else {
			b[i] = byte('a' + rng.IntN(26))
		}
	}
	return b
}

// TestLateWindowsFree: the free windows are exactly the windows that hold
// no late byte, and draw returns each of them and nothing else.
func TestLateWindowsFree(t *testing.T) {
	set := (&lateOptions{chars: "0123456789"}).set()
	for _, tc := range []struct {
		name string
		text []byte
	}{
		{"random", lateText(3000, 40, 1)},
		{"late at both ends", []byte("1abcdefghijklmnopqrstuv2wxyzabcdefghijk3")},
		{"one free window", []byte("1abcdefgh2")},
		{"none late", []byte("abcdefghijklmnop")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const context = 7
			l := newLateWindows(tc.text, context, set, 5)
			want := map[int]bool{}
			for off := range len(tc.text) - context {
				if !l.holds(tc.text, off, context) {
					want[off] = true
				}
			}
			require.Equal(t, len(tc.text)-context, l.total)
			require.Equal(t, len(want), l.free)
			got := map[int]bool{}
			before := 0
			for k, s := range l.starts {
				for off := s; off < s+l.ends[k]-before; off++ {
					got[off] = true
				}
				before = l.ends[k]
			}
			assert.Equal(t, want, got, "the runs are the free windows")
			drawn := map[int]bool{}
			rng := rand.New(rand.NewPCG(1, 2))
			for range 50 * l.free {
				off := l.draw(rng)
				require.True(t, want[off], "drew %d, a window holding a late byte", off)
				drawn[off] = true
			}
			assert.Equal(t, want, drawn, "every free window is drawn")
		})
	}
}

// TestLateBatches: before -late-from no rank's training window holds a
// late byte, from it on the batches are those of a run without
// -late-bytes (so they do hold late bytes), and the ranks' shards make up
// one global batch at every step, as without -late-bytes.
func TestLateBatches(t *testing.T) {
	o, err := parseFlags(tiny("-late-bytes", "{}", "-steps", "100", "-freeze-step", "10", "-late-from", "15"), io.Discard)
	require.NoError(t, err)
	root, err := defaultCorpus()
	require.NoError(t, err)
	data, err := loadCorpus(root, true, o.valFrac, o.seed, o.maxBytes)
	require.NoError(t, err)
	data.late, err = o.lateWindows(data)
	require.NoError(t, err)
	require.Equal(t, 15, data.late.from)
	set := o.late.set()
	ctx, batch := o.model.context, o.batch
	// holds reports whether a window of x and y holds a late byte.
	holds := func(x, y []int32, i int) bool {
		for j := range ctx {
			if set[x[i*ctx+j]] || set[y[i*ctx+j]] {
				return true
			}
		}
		return false
	}
	global := data.batcher(ctx, batch, 0, 1, o.seed, false)
	plain := newBatcher(data.train, ctx, batch, 0, 1, o.seed)
	shards := []*batcher{data.batcher(ctx, batch, 0, 2, o.seed, false), data.batcher(ctx, batch, 1, 2, o.seed, false)}
	lateAfter := 0
	for step := 1; step <= 40; step++ {
		gx, gy := global.next(step)
		var sx, sy []int32
		for _, b := range shards {
			x, y := b.next(step)
			sx, sy = append(sx, x...), append(sy, y...)
		}
		require.Equal(t, gx, sx, "step %d: the shards make up the global batch", step)
		require.Equal(t, gy, sy, "step %d", step)
		for i := range batch {
			if step < 15 {
				require.False(t, holds(gx, gy, i), "step %d, window %d holds a late byte", step, i)
			} else if holds(gx, gy, i) {
				lateAfter++
			}
		}
		if step >= 15 {
			px, py := plain.next(step)
			require.Equal(t, px, gx, "step %d: the batch of a run without -late-bytes", step)
			require.Equal(t, py, gy, "step %d", step)
		}
	}
	assert.Greater(t, lateAfter, 0, "late bytes occur from -late-from on")

	// The batches the training loop reads hold the same windows.
	d := &batches{b: data.batcher(ctx, batch, 0, 1, o.seed, false), context: ctx, start: 1}
	step := 1
	for b, err := range d.Iter() {
		require.NoError(t, err)
		x, y := tensors.MustCopyFlatData[int32](b.Inputs[0]), tensors.MustCopyFlatData[int32](b.Labels[0])
		for i := range batch {
			require.False(t, holds(x, y, i), "step %d, window %d", step, i)
		}
		if step++; step == 15 {
			break
		}
	}
}

// TestLateMask: the mask is 1 exactly at the targets that are late bytes.
func TestLateMask(t *testing.T) {
	w, n := lateMask([]int32{'a', '1', '{', '9', 0, 255, '0'}, (&lateOptions{chars: "0123456789"}).set())
	assert.Equal(t, []float32{0, 1, 0, 1, 0, 0, 1}, w)
	assert.Equal(t, 3, n)
	w, n = lateMask([]int32{'a', 0xe2, '{'}, (&lateOptions{chars: "{→"}).set()) // → is e2 86 92
	assert.Equal(t, []float32{0, 1, 1}, w)
	assert.Equal(t, 2, n)
}

// TestLateLoss: the late-byte validation loss over 2 ranks is the mean
// cross-entropy of the untrained model, computed here from its logits, at
// the positions whose target is a late byte and only there.
func TestLateLoss(t *testing.T) {
	m := modelConfig{dModel: 8, layers: 1, heads: 1, ffn: 8, context: 8}
	text := lateText(400, 8, 3)
	set := (&lateOptions{chars: "0123456789"}).set()
	late := &lateWindows{set: set}
	const windows = 7 // odd: the ranks hold 3 and 4
	newStore := func() *model.Store {
		store := model.NewStore()
		store.RootScope().SetParam(model.ParamInitialSeed, int64(5))
		return store
	}

	// The expected value, from the logits of every window.
	backend, err := gobackend.New("ops_sequential")
	require.NoError(t, err)
	defer backend.Finalize()
	x, y, n := valWindows(text, m.context, windows, 0, 1)
	require.Equal(t, windows, n)
	var sum, all float64
	count := 0
	for i, nll := range targetNLLs(t, m, newStore(), x, y, n) {
		all += nll
		if set[y[i]] {
			sum += nll
			count++
		}
	}
	require.Positive(t, count)
	require.Less(t, count, len(y)/4)
	want := sum / float64(count)
	assert.Greater(t, math.Abs(want-all/float64(len(y))), 1e-3, "the late positions' loss differs from the mean: the test can tell them apart")

	var mu sync.Mutex
	var got []float64
	require.NoError(t, local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		backend, err := gobackend.New("ops_sequential")
		if err != nil {
			return err
		}
		defer backend.Finalize()
		x, y, n := valWindows(text, m.context, windows, c.Rank(), c.Size())
		e, err := newLateEval(backend, newStore(), m, late, x, y, n)
		if err != nil {
			return err
		}
		v, err := e.loss(ctx, c)
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		got = append(got, *v)
		return nil
	}))
	require.Len(t, got, 2)
	for _, v := range got {
		assert.InDelta(t, want, v, 1e-4)
	}

	// No late target: no loss.
	var none *float64
	e, err := newLateEval(backend, newStore(), m, &lateWindows{set: (&lateOptions{chars: "#"}).set()}, x, y, n)
	require.NoError(t, err)
	require.NoError(t, local.Run(context.Background(), 1, func(ctx context.Context, c comm.Comm) error {
		none, err = e.loss(ctx, c)
		return err
	}))
	assert.Nil(t, none)
	var nilEval *lateEval
	none, err = nilEval.loss(context.Background(), nil)
	assert.NoError(t, err)
	assert.Nil(t, none)
}

// TestLateFlags: -late-bytes and -late-from as given, the default of
// -late-from, and bad values refused with a one-line usage error.
func TestLateFlags(t *testing.T) {
	o, err := parseFlags([]string{"-late-bytes", "{}", "-late-from", "30"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "{}", o.late.chars)
	assert.Equal(t, 30, o.lateFrom())
	o, err = parseFlags([]string{"-late-bytes", "0123456789", "-steps", "100"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 100/5+lateDelay, o.lateFrom(), "the freeze step (a fifth of -steps) + lateDelay")
	o, err = parseFlags([]string{"-late-bytes", "0", "-freeze-step", "7"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 7+lateDelay, o.lateFrom())

	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"-late-bytes", ""}, "late-bytes"},
		{[]string{"-late-bytes="}, "late-bytes"},
		{[]string{"-late-bytes", "{}", "-late-from", "-1"}, "late-from"},
		{[]string{"-late-bytes", "{}", "-late-from", "99999999"}, "late-from"},
		{[]string{"-late-bytes", "{}", "-late-from", "1e3"}, "late-from"},
		{[]string{"-late-bytes", "{}", "-late-from", ""}, "late-from"},
		{[]string{"-late-from", "30"}, "late-from"},
		{[]string{"-late-from", "0"}, "late-from"},
	} {
		_, err := parseFlags(tc.args, io.Discard)
		require.Error(t, err, "%q", tc.args)
		assert.True(t, cliflag.IsUsage(err), "%q: %v", tc.args, err)
		assert.NotContains(t, err.Error(), "\n", "%q", tc.args)
		assert.Contains(t, err.Error(), "--"+tc.flag, "%q", tc.args)
	}
}

// TestLateBadCorpus: late bytes the training text does not hold, or that
// every training window holds, are an error before any rank starts.
func TestLateBadCorpus(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"a.txt", "b.txt", "c.txt"} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(strings.Repeat("the quick brown fox jumps over the lazy dog\n", 200)), 0o644))
	}
	for _, tc := range []struct{ chars, want string }{
		{"Q7", "no training window holds any of them"},
		{"o ", "every training window of 33 bytes holds one of them"},
	} {
		err := run(context.Background(), tiny("-corpus", dir, "-steps", "1", "-late-bytes", tc.chars), io.Discard, io.Discard)
		require.Error(t, err, tc.chars)
		assert.Contains(t, err.Error(), tc.want)
		assert.Contains(t, err.Error(), "-late-bytes")
	}
}

// TestLateRun: a run with -late-bytes reports the late-byte validation
// loss at every validation, in the text table, the JSON and the Markdown;
// a run without has no such column or field.
func TestLateRun(t *testing.T) {
	dir := t.TempDir()
	md := filepath.Join(dir, "late.md")
	args := tiny("-optimizer", "adam,onebit-adam", "-steps", "12", "-freeze-step", "3", "-eval-every", "4")
	runs, out := runJSON(t, append(args, "-late-bytes", "0123456789", "-markdown", md)...)
	require.Len(t, runs, 2)
	for _, r := range runs {
		assert.Equal(t, "0123456789", r.LateBytes)
		assert.Equal(t, 3+lateDelay, r.LateFrom)
		require.NotNil(t, r.LateValLoss)
		require.Len(t, r.Curve, 3)
		for _, e := range r.Curve {
			require.NotNil(t, e.LateLoss, "step %d", e.Step)
			assert.Greater(t, *e.LateLoss, 0.0)
		}
		assert.Equal(t, *r.Curve[2].LateLoss, *r.LateValLoss)
	}
	assert.NotEqual(t, *runs[0].LateValLoss, runs[0].ValLoss)
	assert.Contains(t, out, "late-byte loss")
	assert.Contains(t, out, `late bytes "0123456789": training windows holding one`)
	b, err := os.ReadFile(md)
	require.NoError(t, err)
	assert.Contains(t, string(b), "| optimizer | val loss | s.e. | late-byte loss | bits/byte |")

	path := filepath.Join(dir, "plain.json")
	var plain bytes.Buffer
	require.NoError(t, run(context.Background(), append(args, "-json", path, "-markdown", md), &plain, io.Discard))
	assert.NotContains(t, plain.String(), "late")
	j, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.NotContains(t, string(j), "late")
	var rs []jsonRun
	require.NoError(t, json.Unmarshal(j, &rs))
	assert.Nil(t, rs[0].LateValLoss)
	b, err = os.ReadFile(md)
	require.NoError(t, err)
	assert.NotContains(t, string(b), "late")
}

// holds reports whether the window of context+1 bytes at off holds a late
// byte.
func (l *lateWindows) holds(text []byte, off, context int) bool {
	return slices.ContainsFunc(text[off:off+context+1], func(c byte) bool { return l.set[c] })
}
