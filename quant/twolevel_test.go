package quant

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// twoLevelLayouts are machines x ranks per machine.
var twoLevelLayouts = [][2]int{{1, 1}, {1, 4}, {4, 1}, {2, 2}, {3, 2}, {2, 3}}

// runTwoLevel runs fn on every rank of an in-process group of m machines
// of d ranks, each with its TwoLevel on the layout the backend reports.
func runTwoLevel(t *testing.T, m, d int, fn func(ctx context.Context, c comm.Comm, tl *TwoLevel) error) error {
	t.Helper()
	return local.Run(ctxT(t), m*d, func(ctx context.Context, c comm.Comm) error {
		l, err := comm.NewLayout(ctx, c, 0)
		if err != nil {
			return err
		}
		defer l.Close()
		if l.Nodes != m || l.RanksPerNode != d {
			return fmt.Errorf("layout %v, want %d nodes x %d ranks", l, m, d)
		}
		tl, err := NewTwoLevel(l)
		if err != nil {
			return err
		}
		return fn(ctx, c, tl)
	}, local.WithRanksPerNode(d))
}

// relErr is ||got - want|| / ||want||.
func relErr(got, want []float32) float64 {
	var e, r float64
	for i := range got {
		x := float64(got[i]) - float64(want[i])
		e += x * x
		r += float64(want[i]) * float64(want[i])
	}
	if r == 0 {
		return math.Sqrt(e)
	}
	return math.Sqrt(e / r)
}

func TestTwoLevelAllReduce(t *testing.T) {
	for _, ly := range twoLevelLayouts {
		m, d := ly[0], ly[1]
		w := m * d
		exact := m == 1 || d == 1 // the summation order is the exact one's
		for _, n := range []int{0, 1, 5, 7 * w, 1000, 4099} {
			err := runTwoLevel(t, m, d, func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
				in := randInput(c.Rank(), n)
				want := append([]float32(nil), in...)
				if err := c.AllReduce(ctx, want, comm.Mean); err != nil {
					return err
				}
				buf := append([]float32(nil), in...)
				for range 2 { // the second call reuses the buffers
					copy(buf, in)
					if err := tl.AllReduce(ctx, buf); err != nil {
						return err
					}
				}
				msg := fmt.Sprintf("%dx%d n=%d rank %d", m, d, n, c.Rank())
				if exact {
					for i := range want {
						if math.Float32bits(want[i]) != math.Float32bits(buf[i]) {
							return fmt.Errorf("%s: element %d is %g, exact allreduce %g", msg, i, buf[i], want[i])
						}
					}
				} else if e := relErr(buf, want); e > 1e-6 {
					return fmt.Errorf("%s: relative error %g against the exact allreduce", msg, e)
				}
				// Every rank sends (M-1)*K floats across machines and
				// (D-1)*M*K inside, in each half.
				k := int64((n + w - 1) / w)
				st := tl.Stats()
				assert.EqualValues(t, 2, st.Calls, msg)
				if n > 0 {
					assert.Equal(t, 2*2*int64(m-1)*k*4, st.InterBytes, msg)
					assert.Equal(t, 2*2*int64(d-1)*int64(m)*k*4, st.IntraBytes, msg)
				}
				return nil
			})
			require.NoError(t, err)
		}
	}
}

func TestTwoLevelReduceScatter(t *testing.T) {
	for _, ly := range twoLevelLayouts {
		m, d := ly[0], ly[1]
		w := m * d
		exact := m == 1 || d == 1
		for _, k := range []int{0, 1, 3, 1000} {
			err := runTwoLevel(t, m, d, func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
				send := randInput(c.Rank(), w*k)
				orig := append(make([]float32, 0, len(send)), send...)
				want := make([]float32, k)
				if err := c.ReduceScatter(ctx, send, want, comm.Mean); err != nil {
					return err
				}
				got := make([]float32, k)
				if err := tl.ReduceScatter(ctx, send, got); err != nil {
					return err
				}
				assert.Equal(t, orig, send, "send is not modified")
				msg := fmt.Sprintf("%dx%d k=%d rank %d", m, d, k, c.Rank())
				if exact {
					for i := range want {
						if math.Float32bits(want[i]) != math.Float32bits(got[i]) {
							return fmt.Errorf("%s: element %d is %g, exact reduce-scatter %g", msg, i, got[i], want[i])
						}
					}
				} else if e := relErr(got, want); e > 1e-6 {
					return fmt.Errorf("%s: relative error %g against the exact reduce-scatter", msg, e)
				}
				assert.Equal(t, int64(m-1)*int64(k)*4, tl.Stats().InterBytes, msg)
				return nil
			})
			require.NoError(t, err)
		}
	}
}

// TestTwoLevelSpecialValues: NaN and Inf pass through the sums.
func TestTwoLevelSpecialValues(t *testing.T) {
	inf := float32(math.Inf(1))
	err := runTwoLevel(t, 2, 2, func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
		buf := []float32{1, 1, 1, 1, 1}
		switch c.Rank() {
		case 0:
			buf[0], buf[1] = float32(math.NaN()), inf
		case 3:
			buf[2], buf[4] = inf, -inf
		}
		if err := tl.AllReduce(ctx, buf); err != nil {
			return err
		}
		assert.True(t, math.IsNaN(float64(buf[0])))
		assert.Equal(t, inf, buf[1])
		assert.Equal(t, inf, buf[2])
		assert.Equal(t, float32(1), buf[3])
		assert.Equal(t, -inf, buf[4])
		return nil
	})
	require.NoError(t, err)
}

func TestTwoLevelMismatch(t *testing.T) {
	cases := []struct {
		name string
		call func(ctx context.Context, c comm.Comm, tl *TwoLevel) error
		want string
	}{
		{"allreduce length", func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
			n := 12
			if c.Rank() == 3 {
				n = 11 // pads to the same 12
			}
			return tl.AllReduce(ctx, make([]float32, n))
		}, "tensor length mismatch"},
		{"allreduce empty on one rank", func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
			n := 12
			if c.Rank() == 1 {
				n = 0
			}
			return tl.AllReduce(ctx, make([]float32, n))
		}, "tensor length mismatch"},
		{"reduce-scatter lengths", func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
			return tl.ReduceScatter(ctx, make([]float32, 10), make([]float32, 2))
		}, "send length 10 is not 4 ranks x receive length 2"},
		{"reduce-scatter on one rank", func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
			k := 3
			if c.Rank() == 2 {
				k = 4
			}
			return tl.ReduceScatter(ctx, make([]float32, 4*k), make([]float32, k))
		}, "send length mismatch"},
		{"different calls", func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
			if c.Rank() == 0 {
				return tl.AllReduce(ctx, make([]float32, 8))
			}
			return tl.ReduceScatter(ctx, make([]float32, 8), make([]float32, 2))
		}, "call mismatch"},
	}
	for _, tc := range cases {
		errs := make([]error, 4)
		_ = runTwoLevel(t, 2, 2, func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
			errs[c.Rank()] = tc.call(ctx, c, tl)
			return errs[c.Rank()]
		})
		for r, err := range errs {
			require.Error(t, err, "%s: rank %d", tc.name, r)
			assert.Contains(t, err.Error(), tc.want, "%s: rank %d", tc.name, r)
			assert.Contains(t, err.Error(), "quant: two-level")
			if tc.name != "different calls" { // each names its own call
				assert.Equal(t, errs[0].Error(), err.Error(), "%s: the same error on every rank", tc.name)
			}
		}
	}
}

func TestTwoLevelBadLayout(t *testing.T) {
	_, err := NewTwoLevel(nil)
	assert.ErrorContains(t, err, "incomplete layout")
	errs := make([]error, 4)
	_ = local.Run(ctxT(t), 4, func(ctx context.Context, c comm.Comm) error {
		l, err := comm.NewLayout(ctx, c, 2)
		if err != nil {
			return err
		}
		defer l.Close()
		bad := *l
		bad.Nodes = 3 // D*M != W
		_, errs[c.Rank()] = NewTwoLevel(&bad)
		return nil
	})
	for r, err := range errs {
		assert.ErrorContains(t, err, "does not cover the 4 ranks", "rank %d", r)
	}
	// Ranks per node that do not divide the group: comm.NewLayout refuses
	// on every rank.
	errs = make([]error, 6)
	_ = local.Run(ctxT(t), 6, func(ctx context.Context, c comm.Comm) error {
		_, errs[c.Rank()] = comm.NewLayout(ctx, c, 4)
		return errs[c.Rank()]
	})
	for r, err := range errs {
		assert.Error(t, err, "rank %d", r)
	}
}

func TestTwoLevelCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(ctxT(t))
	err := runTwoLevel(t, 2, 2, func(_ context.Context, c comm.Comm, tl *TwoLevel) error {
		if c.Rank() == 0 {
			cancel()
		}
		return tl.AllReduce(ctx, make([]float32, 100))
	})
	assert.True(t, err != nil || errors.Is(ctx.Err(), context.Canceled))
}

func TestTwoLevelAllocs(t *testing.T) {
	const m, d, n = 2, 2, 10001
	cs, err := local.New(m*d, local.WithRanksPerNode(d))
	require.NoError(t, err)
	ctx := ctxT(t)
	tls := make([]*TwoLevel, m*d)
	bufs := make([][]float32, m*d)
	ready := make(chan error, m*d)
	for r := range cs {
		go func() {
			l, err := comm.NewLayout(ctx, cs[r], 0)
			if err == nil {
				tls[r], err = NewTwoLevel(l)
			}
			bufs[r] = randInput(r, n)
			ready <- err
		}()
	}
	for range cs {
		require.NoError(t, <-ready)
	}
	done := make(chan struct{}, m*d)
	for r := 1; r < m*d; r++ {
		go func() {
			defer func() { done <- struct{}{} }()
			for range 101 {
				_ = tls[r].AllReduce(ctx, bufs[r])
				_ = tls[r].ReduceScatter(ctx, bufs[r][:4*100], bufs[r][n-100:])
			}
		}()
	}
	allocs := testing.AllocsPerRun(100, func() {
		_ = tls[0].AllReduce(ctx, bufs[0])
		_ = tls[0].ReduceScatter(ctx, bufs[0][:4*100], bufs[0][n-100:])
	})
	for r := 1; r < m*d; r++ {
		<-done
	}
	assert.Zero(t, allocs)
	assert.EqualValues(t, 202, tls[0].Stats().Calls)
}

// A pipelined allreduce allocates, per call and rank, only its second
// goroutine and cancellable context: at most pipeAllocs small objects,
// whatever the tensor's size (the staging buffers and the channels are
// kept), after the first call.
func TestTwoLevelPipelinedAllocs(t *testing.T) {
	const m, d, calls = 2, 2, 50
	for _, n := range []int{10001, 100003} {
		per := runTwoLevelAllocs(t, m, d, n, calls)
		t.Logf("n=%d: %.2f allocations per pipelined call and rank", n, per)
		assert.LessOrEqual(t, per, float64(pipeAllocs)+1, "n=%d", n) // +1: the test's own goroutines, a new g now and then
	}
}

// pipeAllocs is what TwoLevel's doc says a pipelined allreduce allocates
// per call (measured: 4 on Go 1.26, the context, its cancel function, the
// goroutine's closure and the context's registration with its parent).
const pipeAllocs = 4

// runTwoLevelAllocs runs calls pipelined allreduces of n elements on every
// rank of an m x d layout, after one call that grows the buffers, and
// returns the heap allocations per call and rank.
func runTwoLevelAllocs(t *testing.T, m, d, n, calls int) float64 {
	t.Helper()
	w := m * d
	cs, err := local.New(w, local.WithRanksPerNode(d))
	require.NoError(t, err)
	ctx := ctxT(t)
	tls := make([]*TwoLevel, w)
	bufs := make([][]float32, w)
	errs := make(chan error, w)
	each := func(fn func(r int) error) {
		for r := range w {
			go func() { errs <- fn(r) }()
		}
		for range w {
			require.NoError(t, <-errs)
		}
	}
	each(func(r int) error {
		l, err := comm.NewLayout(ctx, cs[r], 0)
		if err != nil {
			return err
		}
		if tls[r], err = NewTwoLevel(l); err != nil {
			return err
		}
		tls[r].pieces = 3
		bufs[r] = randInput(r, n)
		return tls[r].AllReduce(ctx, bufs[r]) // grows the buffers
	})
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	each(func(r int) error {
		for range calls {
			if err := tls[r].AllReduce(ctx, bufs[r]); err != nil {
				return err
			}
		}
		return nil
	})
	runtime.ReadMemStats(&after)
	require.EqualValues(t, calls+1, tls[0].Stats().Calls)
	require.Greater(t, tls[0].pipePieces((n+w-1)/w), 1, "not pipelined")
	return float64(after.Mallocs-before.Mallocs) / float64(calls*w)
}

// TestTwoLevelPipelined: the allreduce cut into pieces, with the node's and
// the rail's collectives overlapping, gives the unpipelined allreduce's
// result bit for bit (the same sums in the same order) and the same
// traffic, for any number of pieces, even ones that do not divide the
// slices.
func TestTwoLevelPipelined(t *testing.T) {
	for _, ly := range [][2]int{{2, 2}, {3, 2}, {2, 3}} {
		m, d := ly[0], ly[1]
		w := m * d
		for _, n := range []int{7 * w, 10 * w, 1000, 4099, 40000} {
			for _, pieces := range []int{2, 3, 7, 8} {
				err := runTwoLevel(t, m, d, func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
					in := randInput(c.Rank(), n)
					want := append([]float32(nil), in...)
					if err := tl.AllReduce(ctx, want); err != nil {
						return err
					}
					before := tl.Stats()
					tl.pieces = pieces
					// At most as many pieces as asked for (and slices have
					// elements), none of them empty, and no fewer than half
					// (k=10 in 7 is 5 pieces of 2: 7 of ceil(10/7) = 2 would
					// leave the last two empty).
					k := (n + w - 1) / w
					p := tl.pipePieces(k)
					piece := (k + p - 1) / p
					if asked := min(pieces, k); p > asked || 2*p < asked || (p-1)*piece >= k {
						return fmt.Errorf("pipePieces(%d) = %d with %d asked for: pieces of %d, the last %d elements",
							k, p, pieces, piece, k-(p-1)*piece)
					}
					buf := append([]float32(nil), in...)
					if err := tl.AllReduce(ctx, buf); err != nil {
						return err
					}
					msg := fmt.Sprintf("%dx%d n=%d pieces=%d rank %d", m, d, n, pieces, c.Rank())
					for i := range want {
						if math.Float32bits(want[i]) != math.Float32bits(buf[i]) {
							return fmt.Errorf("%s: element %d is %g, unpipelined %g", msg, i, buf[i], want[i])
						}
					}
					after := tl.Stats()
					assert.Equal(t, before.InterBytes, after.InterBytes-before.InterBytes, msg)
					assert.Equal(t, before.IntraBytes, after.IntraBytes-before.IntraBytes, msg)
					return nil
				})
				require.NoError(t, err)
			}
		}
	}
}

// TestTwoLevelPipelinedCancel: a pipelined allreduce whose context ends
// returns its error on every rank and leaves no goroutine behind.
func TestTwoLevelPipelinedCancel(t *testing.T) {
	before := runtime.NumGoroutine()
	ctx, cancel := context.WithCancel(ctxT(t))
	err := runTwoLevel(t, 2, 2, func(_ context.Context, c comm.Comm, tl *TwoLevel) error {
		tl.pieces = 4
		if c.Rank() == 3 {
			cancel()
			return nil // never joins
		}
		return tl.AllReduce(ctx, make([]float32, 4000))
	})
	assert.Error(t, err)
	for deadline := time.Now().Add(5 * time.Second); runtime.NumGoroutine() > before; {
		require.False(t, time.Now().After(deadline), "goroutines left blocked")
		time.Sleep(10 * time.Millisecond)
	}
}

// promised wraps a node or rail communicator to check TwoLevel's promises
// (comm.SkipChecks): every collective must come under one, and none may
// be left over after a call, or a later collective would go unchecked.
type promised struct {
	comm.Comm
	skip   int
	broken int // collectives called with no promise left
}

func (p *promised) SkipChecks(n int) { p.skip = n }
func (p *promised) Concurrent() bool { return true }

func (p *promised) use() {
	if p.skip == 0 {
		p.broken++
		return
	}
	p.skip--
}

func (p *promised) AllToAll(ctx context.Context, send, recv []float32) error {
	p.use()
	return p.Comm.AllToAll(ctx, send, recv)
}

func (p *promised) AllGather(ctx context.Context, send, recv []float32) error {
	p.use()
	return p.Comm.AllGather(ctx, send, recv)
}

// TestTwoLevelPromises: the two-level collectives promise exactly the
// node and rail collectives they make (each call agrees on its lengths
// over the whole group first), pipelined or not, reduce-scatter or
// allreduce, so no check is skipped on a collective that was not promised
// and none is left over for the next one.
func TestTwoLevelPromises(t *testing.T) {
	for _, ly := range [][2]int{{2, 2}, {2, 3}, {3, 1}, {1, 3}} {
		m, d := ly[0], ly[1]
		w := m * d
		err := runTwoLevel(t, m, d, func(ctx context.Context, c comm.Comm, tl *TwoLevel) error {
			intra, inter := &promised{Comm: tl.l.Intra}, &promised{Comm: tl.l.Inter}
			l := *tl.l
			l.Intra, l.Inter = intra, inter
			tl.l = &l
			for _, pieces := range []int{0, 3} {
				tl.pieces = pieces
				for _, n := range []int{1, 7 * w, 4099} {
					msg := fmt.Sprintf("%dx%d pieces=%d n=%d", m, d, pieces, n)
					if err := tl.AllReduce(ctx, randInput(c.Rank(), n)); err != nil {
						return err
					}
					k := (n + w - 1) / w
					if err := tl.ReduceScatter(ctx, randInput(c.Rank(), w*k), make([]float32, k)); err != nil {
						return err
					}
					for name, p := range map[string]*promised{"node": intra, "rail": inter} {
						assert.Zero(t, p.broken, "%s: %s collectives without a promise", msg, name)
						assert.Zero(t, p.skip, "%s: %s promises left over", msg, name)
					}
				}
			}
			return nil
		})
		require.NoError(t, err)
	}
}
