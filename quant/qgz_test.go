package quant_test

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/quant"
)

// runLayout runs fn on nodes*rpn in-process ranks laid out node-major.
func runLayout(t testing.TB, nodes, rpn int, fn func(ctx context.Context, l *comm.Layout) error) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return local.Run(ctx, nodes*rpn, func(ctx context.Context, c comm.Comm) error {
		l, err := comm.NewLayout(ctx, c, 0)
		if err != nil {
			return err
		}
		defer l.Close()
		return fn(ctx, l)
	}, local.WithRanksPerNode(rpn))
}

// testInput is rank r's deterministic input of n values in [-1, 1).
func testInput(r, n int) []float32 {
	g := rand.New(rand.NewPCG(uint64(r), 77))
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(g.Float64()*2 - 1)
	}
	return x
}

// simulate computes every rank's qgZ output from all inputs by following
// the spec's steps literally with the package's quantizer.
func simulate(t *testing.T, inputs [][]float32, nodes, rpn, bits, g int) [][]float32 {
	w := nodes * rpn
	n := len(inputs[0])
	p := (n + w - 1) / w
	roundTrip := func(x []float32) []float32 {
		codes := make([]byte, quant.CodesLen(len(x), bits))
		scales := make([]float32, quant.NumGroups(len(x), g))
		require.NoError(t, quant.Quantize(codes, scales, x, bits, g))
		out := make([]float32, len(x))
		require.NoError(t, quant.DequantizeAdd(out, codes, scales, bits, g))
		return out
	}
	part := func(r, k int) []float32 {
		x := make([]float32, p)
		for i := range x {
			if j := k*p + i; j < n {
				x[i] = inputs[r][j]
			}
		}
		return x
	}
	outs := make([][]float32, w)
	for node := 0; node < nodes; node++ {
		for b := 0; b < rpn; b++ {
			k := node*rpn + b // the partition this rank ends with
			out := make([]float32, p)
			for a := 0; a < nodes; a++ {
				// Node a's local rank b sums the partition k from every
				// rank of node a, then re-quantizes.
				sum := make([]float32, p)
				for l := 0; l < rpn; l++ {
					d := roundTrip(part(a*rpn+l, k))
					for i := range sum {
						sum[i] += d[i]
					}
				}
				d := roundTrip(sum)
				for i := range out {
					out[i] += d[i]
				}
			}
			for i := range out {
				out[i] /= float32(w)
			}
			outs[k] = out
		}
	}
	return outs
}

func TestQGZLayouts(t *testing.T) {
	layouts := [][2]int{{2, 2}, {3, 2}, {4, 2}, {1, 4}, {4, 1}, {1, 1}, {2, 3}}
	for _, lay := range layouts {
		nodes, rpn := lay[0], lay[1]
		w := nodes * rpn
		for _, bits := range []int{4, 8} {
			for _, n := range []int{w * 256, w*100 + 3, 5} {
				for _, g := range []int{0, 32, 7} {
					name := fmt.Sprintf("%dx%d/int%d/n%d/g%d", nodes, rpn, bits, n, g)
					t.Run(name, func(t *testing.T) {
						inputs := make([][]float32, w)
						for r := range inputs {
							inputs[r] = testInput(r, n)
						}
						gs := g
						if gs == 0 {
							gs = quant.DefaultGroupSize
						}
						want := simulate(t, inputs, nodes, rpn, bits, gs)
						outs := make([][]float32, w)
						require.NoError(t, runLayout(t, nodes, rpn, func(ctx context.Context, l *comm.Layout) error {
							q, err := quant.NewQGZ(context.Background(), l, n, quant.QGZConfig{Bits: bits, GroupSize: g})
							if err != nil {
								return err
							}
							recv := make([]float32, q.PartLen())
							if err := q.ReduceScatter(ctx, inputs[l.World.Rank()], recv); err != nil {
								return err
							}
							outs[l.World.Rank()] = recv
							return nil
						}))
						p := (n + w - 1) / w
						// Inputs in [-1, 1): round 1 loses at most a step, 2/2^bits, per
						// rank (the largest value clamps), round 2 at most 2R(1+2/2^bits)/2^bits per node.
						bound := 4.5 / math.Pow(2, float64(bits))
						var errSq, refSq float64
						for r := 0; r < w; r++ {
							require.Len(t, outs[r], p)
							require.Equal(t, want[r], outs[r], "rank %d: the spec's steps", r)
							for i, got := range outs[r] {
								j := r*p + i
								if j >= n {
									require.Zero(t, got, "rank %d: pad element %d", r, j)
									continue
								}
								var mean float64
								for k := range inputs {
									mean += float64(inputs[k][j])
								}
								mean /= float64(w)
								require.InDelta(t, mean, got, bound, "rank %d element %d", r, i)
								errSq += (float64(got) - mean) * (float64(got) - mean)
								refSq += mean * mean
							}
						}
						rel := math.Sqrt(errSq / refSq)
						limit := map[int]float64{4: 0.35, 8: 0.02}[bits]
						if w > 1 {
							assert.Less(t, rel, limit, "relative error")
						}
					})
				}
			}
		}
	}
}

func TestQGZPadding(t *testing.T) {
	require.NoError(t, runLayout(t, 2, 2, func(ctx context.Context, l *comm.Layout) error {
		q, err := quant.NewQGZ(context.Background(), l, 10, quant.QGZConfig{Bits: 8})
		if err != nil {
			return err
		}
		if q.Padded() != 12 || q.PartLen() != 3 || q.Len() != 10 {
			return fmt.Errorf("padded %d part %d len %d", q.Padded(), q.PartLen(), q.Len())
		}
		send := make([]float32, 10)
		for i := range send {
			send[i] = 1
		}
		recv := []float32{9, 9, 9}
		if err := q.ReduceScatter(ctx, send, recv); err != nil {
			return err
		}
		want := []float32{1, 1, 1}
		if l.World.Rank() == 3 {
			want = []float32{1, 0, 0}
		}
		for i := range want {
			if math.Abs(float64(recv[i]-want[i])) > 0.02 {
				return fmt.Errorf("rank %d: recv %v, want %v", l.World.Rank(), recv, want)
			}
		}
		return nil
	}))
}

// checkNoLeak fails when goroutines started during the test outlive it.
func checkNoLeak(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Cleanup(func() {
		deadline := time.Now().Add(2 * time.Second)
		for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		assert.LessOrEqual(t, runtime.NumGoroutine(), before, "goroutines leaked")
	})
}

// everyRankFails runs fn on a 2x2 layout and requires an error containing
// want from every rank, in well under the test's deadline.
func everyRankFails(t *testing.T, want string, fn func(ctx context.Context, l *comm.Layout) error) {
	t.Helper()
	checkNoLeak(t)
	errs := make([]error, 4)
	start := time.Now()
	_ = runLayout(t, 2, 2, func(ctx context.Context, l *comm.Layout) error {
		errs[l.World.Rank()] = fn(ctx, l)
		return nil
	})
	require.Less(t, time.Since(start), 10*time.Second)
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		require.ErrorContains(t, err, want, "rank %d", r)
	}
}

func TestQGZBadInput(t *testing.T) {
	t.Run("length mismatch", func(t *testing.T) {
		everyRankFails(t, "tensor length mismatch", func(ctx context.Context, l *comm.Layout) error {
			_, err := quant.NewQGZ(ctx, l, 100+l.World.Rank()/3, quant.QGZConfig{Bits: 8})
			return err
		})
	})
	t.Run("bits", func(t *testing.T) {
		everyRankFails(t, "rank 2: QGZConfig.Bits = 5: want 4 or 8", func(ctx context.Context, l *comm.Layout) error {
			bits := 8
			if l.World.Rank() == 2 {
				bits = 5
			}
			_, err := quant.NewQGZ(ctx, l, 100, quant.QGZConfig{Bits: bits})
			return err
		})
	})
	t.Run("group size", func(t *testing.T) {
		everyRankFails(t, "QGZConfig.GroupSize = -1", func(ctx context.Context, l *comm.Layout) error {
			_, err := quant.NewQGZ(ctx, l, 100, quant.QGZConfig{Bits: 4, GroupSize: -1})
			return err
		})
	})
	t.Run("group size differs", func(t *testing.T) {
		everyRankFails(t, "group size mismatch", func(ctx context.Context, l *comm.Layout) error {
			_, err := quant.NewQGZ(ctx, l, 100, quant.QGZConfig{Bits: 4, GroupSize: 32 + l.World.Rank()})
			return err
		})
	})
	t.Run("empty", func(t *testing.T) {
		everyRankFails(t, "tensor length 0", func(ctx context.Context, l *comm.Layout) error {
			_, err := quant.NewQGZ(ctx, l, 0, quant.QGZConfig{Bits: 4})
			return err
		})
	})
	t.Run("call lengths", func(t *testing.T) {
		// Rank 1 (node 0) calls with a short send buffer: every rank,
		// those of node 1 included, reports it, and the next call works.
		everyRankFails(t, "rank 1 called ReduceScatter with len(send) 99", func(ctx context.Context, l *comm.Layout) error {
			q, err := quant.NewQGZ(ctx, l, 100, quant.QGZConfig{Bits: 4, ErrorFeedback: true})
			if err != nil {
				return err
			}
			send := make([]float32, 100)
			if l.World.Rank() == 1 {
				send = send[:99]
			}
			recv := make([]float32, q.PartLen())
			err = q.ReduceScatter(ctx, send, recv)
			if err == nil {
				return nil
			}
			if err2 := q.ReduceScatter(ctx, make([]float32, 100), recv); err2 != nil {
				return fmt.Errorf("call after the bad one: %w", err2)
			}
			return err
		})
	})
	t.Run("recv length", func(t *testing.T) {
		everyRankFails(t, "rank 3 called ReduceScatter with len(send) 100 and len(recv) 24", func(ctx context.Context, l *comm.Layout) error {
			q, err := quant.NewQGZ(ctx, l, 100, quant.QGZConfig{Bits: 8})
			if err != nil {
				return err
			}
			recv := make([]float32, q.PartLen())
			if l.World.Rank() == 3 {
				recv = recv[:24]
			}
			return q.ReduceScatter(ctx, make([]float32, 100), recv)
		})
	})
	t.Run("ranks per node", func(t *testing.T) {
		checkNoLeak(t)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		errs := make([]error, 6)
		_ = local.Run(ctx, 6, func(ctx context.Context, c comm.Comm) error {
			_, errs[c.Rank()] = comm.NewLayout(ctx, c, 4)
			return nil
		})
		for r, err := range errs {
			require.ErrorContains(t, err, "does not divide", "rank %d", r)
		}
	})
	t.Run("hand-built layout", func(t *testing.T) {
		// Rank 3's layout claims 4 nodes of 1: it is refused inside the
		// agreement, so its peers return too (before, they waited).
		everyRankFails(t, "inconsistent layout", func(ctx context.Context, l *comm.Layout) error {
			if l.World.Rank() == 3 {
				bad := *l
				bad.Nodes, bad.RanksPerNode = 4, 1
				l = &bad
			}
			_, err := quant.NewQGZ(ctx, l, 100, quant.QGZConfig{Bits: 4})
			return err
		})
	})
	t.Run("nil layout", func(t *testing.T) {
		_, err := quant.NewQGZ(context.Background(), nil, 10, quant.QGZConfig{Bits: 4})
		require.ErrorContains(t, err, "quant: qgz")
	})
}

// TestQGZNoAllocs: a call allocates nothing. On one rank the backend never
// blocks, so testing.AllocsPerRun sees this package's allocations only.
// On 2x2 ranks the whole process is counted over many calls: the
// goroutine hand-offs of the in-process backend allocate now and then
// (a few dozen per hundred calls, the same as bare all-to-alls of the
// same buffers), so the bound there is well below one per call.
func TestQGZNoAllocs(t *testing.T) {
	for _, ef := range []bool{false, true} {
		require.NoError(t, runLayout(t, 1, 1, func(ctx context.Context, l *comm.Layout) error {
			q, err := quant.NewQGZ(context.Background(), l, 10001, quant.QGZConfig{Bits: 4, GroupSize: 64, ErrorFeedback: ef})
			if err != nil {
				return err
			}
			send := testInput(0, 10001)
			recv := make([]float32, q.PartLen())
			var callErr error
			allocs := testing.AllocsPerRun(20, func() {
				if err := q.ReduceScatter(ctx, send, recv); err != nil {
					callErr = err
				}
			})
			if callErr != nil {
				return callErr
			}
			if allocs != 0 {
				return fmt.Errorf("%v allocations per call (error feedback %v)", allocs, ef)
			}
			return nil
		}))
	}
	const calls = 50
	for _, ef := range []bool{false, true} {
		var before, after runtime.MemStats
		require.NoError(t, runLayout(t, 2, 2, func(ctx context.Context, l *comm.Layout) error {
			q, err := quant.NewQGZ(context.Background(), l, 10001, quant.QGZConfig{Bits: 4, GroupSize: 64, ErrorFeedback: ef})
			if err != nil {
				return err
			}
			send := testInput(l.World.Rank(), 10001)
			recv := make([]float32, q.PartLen())
			for i := 0; i < 3; i++ {
				if err := q.ReduceScatter(ctx, send, recv); err != nil {
					return err
				}
			}
			if err := l.World.Barrier(ctx); err != nil {
				return err
			}
			if l.World.Rank() == 0 {
				runtime.ReadMemStats(&before)
			}
			if err := l.World.Barrier(ctx); err != nil {
				return err
			}
			for i := 0; i < calls; i++ {
				if err := q.ReduceScatter(ctx, send, recv); err != nil {
					return err
				}
			}
			if err := l.World.Barrier(ctx); err != nil {
				return err
			}
			if l.World.Rank() == 0 {
				runtime.ReadMemStats(&after)
			}
			return nil
		}))
		allocs := after.Mallocs - before.Mallocs
		t.Logf("error feedback %v: %d allocations in the process over %d calls on 4 ranks", ef, allocs, calls)
		require.Less(t, allocs, uint64(2*calls), "error feedback %v", ef)
	}
}

// runningMeanError averages k repeated qgZ reductions of the same inputs
// and returns the relative RMS error of the running mean against the exact
// mean, after each call.
func runningMeanError(t testing.TB, nodes, rpn, n, bits, k int, ef bool) []float64 {
	w := nodes * rpn
	inputs := make([][]float32, w)
	for r := range inputs {
		inputs[r] = testInput(r, n)
	}
	exact := make([]float64, n)
	for i := range exact {
		for r := range inputs {
			exact[i] += float64(inputs[r][i])
		}
		exact[i] /= float64(w)
	}
	errSq := make([][]float64, w)
	var refSq float64
	for _, v := range exact {
		refSq += v * v
	}
	require.NoError(t, runLayout(t, nodes, rpn, func(ctx context.Context, l *comm.Layout) error {
		q, err := quant.NewQGZ(context.Background(), l, n, quant.QGZConfig{Bits: bits, GroupSize: 128, ErrorFeedback: ef})
		if err != nil {
			return err
		}
		r := l.World.Rank()
		recv := make([]float32, q.PartLen())
		sum := make([]float64, q.PartLen())
		errSq[r] = make([]float64, k)
		for step := 0; step < k; step++ {
			if err := q.ReduceScatter(ctx, inputs[r], recv); err != nil {
				return err
			}
			for i, v := range recv {
				sum[i] += float64(v)
				if j := r*q.PartLen() + i; j < n {
					d := sum[i]/float64(step+1) - exact[j]
					errSq[r][step] += d * d
				}
			}
		}
		return nil
	}))
	out := make([]float64, k)
	for step := range out {
		var e float64
		for r := range errSq {
			e += errSq[r][step]
		}
		out[step] = math.Sqrt(e / refSq)
	}
	return out
}

// TestQGZErrorFeedback: without feedback the running mean of repeated
// reductions keeps the quantization bias; with it the error shrinks.
func TestQGZErrorFeedback(t *testing.T) {
	const k = 32
	plain := runningMeanError(t, 2, 2, 4096, 4, k, false)
	fed := runningMeanError(t, 2, 2, 4096, 4, k, true)
	t.Logf("int4 2x2, relative error of the running mean after 1 and %d calls: without feedback %.4f, %.4f; with %.4f, %.4f",
		k, plain[0], plain[k-1], fed[0], fed[k-1])
	require.InDelta(t, plain[0], fed[0], 1e-12, "the first call is the same")
	require.Less(t, fed[k-1], plain[k-1]/4, "feedback removes the bias")
	require.InDelta(t, plain[0], plain[k-1], 1e-12, "without feedback every call is the same")

	require.NoError(t, runLayout(t, 2, 2, func(ctx context.Context, l *comm.Layout) error {
		plain, err := quant.NewQGZ(context.Background(), l, 100, quant.QGZConfig{Bits: 4})
		if err != nil {
			return err
		}
		if r1, r2 := plain.Residuals(); r1 != nil || r2 != nil {
			return fmt.Errorf("residuals without feedback")
		}
		fed, err := quant.NewQGZ(context.Background(), l, 100, quant.QGZConfig{Bits: 4, ErrorFeedback: true})
		if err != nil {
			return err
		}
		recv := make([]float32, fed.PartLen())
		if err := fed.ReduceScatter(ctx, testInput(l.World.Rank(), 100), recv); err != nil {
			return err
		}
		r1, r2 := fed.Residuals()
		if len(r1) != fed.Padded() || len(r2) != 2*fed.PartLen() {
			return fmt.Errorf("residual lengths %d and %d", len(r1), len(r2))
		}
		nonzero := 0
		for _, v := range r1 {
			if v != 0 {
				nonzero++
			}
		}
		fed.Reset()
		for _, v := range append(r1, r2...) {
			if v != 0 {
				return fmt.Errorf("Reset left %g", v)
			}
		}
		if nonzero == 0 {
			return fmt.Errorf("round 1 lost nothing")
		}
		return nil
	}))
}

// BenchmarkQGZErrorFeedback measures what error feedback does to repeated
// reductions: the relative RMS error of the running mean of k = 32 qgZ
// calls (2x2 ranks, 4096 values in [-1, 1), groups of 128) against the
// exact mean, without ("plain-err") and with feedback ("fed-err"), for
// int4 and int8, and their ratio.
func BenchmarkQGZErrorFeedback(b *testing.B) {
	const k = 32
	for _, bits := range []int{4, 8} {
		b.Run(fmt.Sprintf("int%d", bits), func(b *testing.B) {
			var plain, fed []float64
			for b.Loop() {
				plain = runningMeanError(b, 2, 2, 4096, bits, k, false)
				fed = runningMeanError(b, 2, 2, 4096, bits, k, true)
			}
			b.ReportMetric(plain[0], "one-call-err")
			b.ReportMetric(plain[k-1], "plain-err")
			b.ReportMetric(fed[k-1], "fed-err")
			b.ReportMetric(plain[k-1]/fed[k-1], "plain/fed")
		})
	}
}

// TestQGZConfigValidate: each field's bad value is refused by Validate,
// and by NewQGZ with Validate's message (naming the rank, on every rank).
func TestQGZConfigValidate(t *testing.T) {
	require.NoError(t, quant.QGZConfig{Bits: 4}.Validate())
	require.NoError(t, quant.QGZConfig{Bits: 8, GroupSize: 64, ErrorFeedback: true}.Validate())
	for _, c := range []struct {
		field string
		cfg   quant.QGZConfig
	}{
		{"Bits", quant.QGZConfig{Bits: 5}},
		{"Bits", quant.QGZConfig{}},
		{"GroupSize", quant.QGZConfig{Bits: 4, GroupSize: -1}},
	} {
		verr := c.cfg.Validate()
		require.Error(t, verr, c.field)
		assert.Contains(t, verr.Error(), "quant: QGZConfig."+c.field+" = ")
		err := local.Run(context.Background(), 1, func(ctx context.Context, cm comm.Comm) error {
			l, err := comm.NewLayout(ctx, cm, 1)
			if err != nil {
				return err
			}
			defer l.Close()
			_, err = quant.NewQGZ(ctx, l, 100, c.cfg)
			return err
		})
		require.Error(t, err, c.field)
		assert.Contains(t, err.Error(), strings.TrimPrefix(verr.Error(), "quant: "), c.field)
	}
}
