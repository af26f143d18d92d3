package local_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

var worlds = []int{1, 2, 3, 4, 5, 8}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// input is rank r's deterministic test buffer.
func input(r, n int) []float32 {
	rng := rand.New(rand.NewPCG(uint64(r), uint64(n)))
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	return x
}

func TestAllReduce(t *testing.T) {
	for _, w := range worlds {
		for _, n := range []int{0, 1, 7, 100, 1001} {
			want := map[comm.Op][]float32{}
			for _, op := range []comm.Op{comm.Sum, comm.Mean, comm.Max} {
				exp := make([]float32, n)
				for i := range exp {
					acc := input(0, n)[i]
					for r := 1; r < w; r++ {
						v := input(r, n)[i]
						if op == comm.Max {
							acc = max(acc, v)
						} else {
							acc += v
						}
					}
					if op == comm.Mean {
						acc /= float32(w)
					}
					exp[i] = acc
				}
				want[op] = exp
			}
			err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
				for _, op := range []comm.Op{comm.Sum, comm.Mean, comm.Max} {
					buf := input(c.Rank(), n)
					if err := c.AllReduce(ctx, buf, op); err != nil {
						return err
					}
					// Ascending-rank summation: bit-identical to the serial sum.
					if !assert.Equal(t, want[op], buf, "w=%d n=%d op=%v", w, n, op) {
						return errors.New("mismatch")
					}
				}
				return nil
			})
			require.NoError(t, err)
		}
	}
}

func TestCollectives(t *testing.T) {
	for _, w := range worlds {
		const k = 5 // elements per chunk
		err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
			r := c.Rank()
			// AllGather: rank j contributes j*10+i.
			send := make([]float32, k)
			for i := range send {
				send[i] = float32(r*10 + i)
			}
			recv := make([]float32, w*k)
			require.NoError(t, c.AllGather(ctx, send, recv))
			for j := 0; j < w; j++ {
				for i := 0; i < k; i++ {
					assert.Equal(t, float32(j*10+i), recv[j*k+i])
				}
			}
			// AllGatherBytes.
			bs := []byte{byte(r), byte(r + 100)}
			br := make([]byte, 2*w)
			require.NoError(t, c.AllGatherBytes(ctx, bs, br))
			for j := 0; j < w; j++ {
				assert.Equal(t, []byte{byte(j), byte(j + 100)}, br[2*j:2*j+2])
			}
			// AllToAll: chunk j of rank r holds r*100+j; rank r receives j*100+r from j.
			a := make([]float32, w*k)
			for j := 0; j < w; j++ {
				for i := 0; i < k; i++ {
					a[j*k+i] = float32(r*100 + j)
				}
			}
			ar := make([]float32, w*k)
			require.NoError(t, c.AllToAll(ctx, a, ar))
			for j := 0; j < w; j++ {
				for i := 0; i < k; i++ {
					assert.Equal(t, float32(j*100+r), ar[j*k+i])
				}
			}
			ab := make([]byte, w)
			for j := range ab {
				ab[j] = byte(r*16 + j)
			}
			abr := make([]byte, w)
			require.NoError(t, c.AllToAllBytes(ctx, ab, abr))
			for j := range abr {
				assert.Equal(t, byte(j*16+r), abr[j])
			}
			// ReduceScatter: sum over ranks of chunk r.
			rs := make([]float32, w*k)
			for i := range rs {
				rs[i] = float32(r + i)
			}
			rr := make([]float32, k)
			require.NoError(t, c.ReduceScatter(ctx, rs, rr, comm.Sum))
			for i := 0; i < k; i++ {
				idx := r*k + i
				assert.Equal(t, float32(w*idx+w*(w-1)/2), rr[i])
			}
			// Broadcast from the last rank.
			root := w - 1
			bb := []float32{float32(r), float32(r)}
			require.NoError(t, c.Broadcast(ctx, bb, root))
			assert.Equal(t, []float32{float32(root), float32(root)}, bb)
			bbb := []byte{byte(r)}
			require.NoError(t, c.BroadcastBytes(ctx, bbb, 0))
			assert.Equal(t, []byte{0}, bbb)
			return c.Barrier(ctx)
		})
		require.NoError(t, err, "w=%d", w)
	}
}

func TestStats(t *testing.T) {
	const w, n = 4, 1024
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		buf := make([]float32, n)
		require.NoError(t, c.AllReduce(ctx, buf, comm.Sum))
		require.NoError(t, c.AllToAll(ctx, buf, make([]float32, n)))
		require.NoError(t, c.AllGather(ctx, buf[:8], make([]float32, 8*w)))
		s := c.Stats()
		assert.Equal(t, comm.Traffic{Calls: 1, BytesSent: 2 * 3 * n, BytesRecv: 2 * 3 * n}, s.PerCollective[comm.CAllReduce])
		assert.Equal(t, comm.Traffic{Calls: 1, BytesSent: 3 * n, BytesRecv: 3 * n}, s.PerCollective[comm.CAllToAll])
		assert.Equal(t, comm.Traffic{Calls: 1, BytesSent: 3 * 32, BytesRecv: 3 * 32}, s.PerCollective[comm.CAllGather])
		assert.Equal(t, int64(3), s.Total().Calls)
		return nil
	})
	require.NoError(t, err)
}

func TestSplit(t *testing.T) {
	const w = 6
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		color := r % 2
		if r == 5 {
			color = -1 // joins no group
		}
		sub, err := c.Split(ctx, color, -r) // key reverses the order
		if err != nil {
			return err
		}
		if r == 5 {
			assert.Nil(t, sub)
			return nil
		}
		members := map[int][]int{0: {4, 2, 0}, 1: {3, 1}}[color]
		require.Equal(t, len(members), sub.Size())
		assert.Equal(t, r, members[sub.Rank()])
		buf := []float32{float32(r)}
		require.NoError(t, sub.AllReduce(ctx, buf, comm.Sum))
		sum := 0
		for _, m := range members {
			sum += m
		}
		assert.Equal(t, float32(sum), buf[0])
		return sub.Close()
	})
	require.NoError(t, err)
}

func TestMismatchedLengths(t *testing.T) {
	for _, w := range []int{2, 3, 5} {
		err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
			n := 10
			if c.Rank() == w-1 {
				n = 12
			}
			err := c.AllReduce(ctx, make([]float32, n), comm.Sum)
			var me *comm.MismatchError
			require.ErrorAs(t, err, &me, "rank %d", c.Rank())
			assert.Equal(t, w-1, me.Rank)
			assert.Equal(t, 12, me.Got)
			assert.Equal(t, 10, me.Want)
			assert.Contains(t, err.Error(), "12")
			assert.Contains(t, err.Error(), "10")
			// The group is still usable after a mismatch every rank saw.
			return c.AllReduce(ctx, make([]float32, 3), comm.Sum)
		})
		require.NoError(t, err)
	}
}

func TestMismatchedCollective(t *testing.T) {
	err := local.Run(ctxT(t), 2, func(ctx context.Context, c comm.Comm) error {
		var err error
		if c.Rank() == 0 {
			err = c.AllGather(ctx, make([]float32, 2), make([]float32, 4))
		} else {
			err = c.AllToAll(ctx, make([]float32, 2), make([]float32, 2))
		}
		require.Error(t, err)
		assert.Contains(t, err.Error(), "rank 1 called alltoall")
		return nil
	})
	require.NoError(t, err)
}

// TestBadArguments: a rank whose own arguments are invalid still meets its
// peers, so every rank returns an error (the bad rank its own, the others
// one naming it) and the group stays usable.
func TestBadArguments(t *testing.T) {
	const w = 3
	bad := map[string]func(ctx context.Context, c comm.Comm, wrong bool) error{
		"allgather": func(ctx context.Context, c comm.Comm, wrong bool) error {
			n := 6
			if wrong {
				n = 5
			}
			return c.AllGather(ctx, make([]float32, 2), make([]float32, n))
		},
		"alltoall": func(ctx context.Context, c comm.Comm, wrong bool) error {
			n := 3
			if wrong {
				n = 4
			}
			return c.AllToAll(ctx, make([]float32, n), make([]float32, n))
		},
		"alltoall-lengths": func(ctx context.Context, c comm.Comm, wrong bool) error {
			n := 3
			if wrong {
				n = 6
			}
			return c.AllToAllBytes(ctx, make([]byte, 3), make([]byte, n))
		},
		"reducescatter": func(ctx context.Context, c comm.Comm, wrong bool) error {
			n := 6
			if wrong {
				n = 7
			}
			return c.ReduceScatter(ctx, make([]float32, n), make([]float32, 2), comm.Sum)
		},
		"reducescatter-op": func(ctx context.Context, c comm.Comm, wrong bool) error {
			op := comm.Sum
			if wrong {
				op = comm.Op(9)
			}
			return c.ReduceScatter(ctx, make([]float32, 6), make([]float32, 2), op)
		},
		"broadcast": func(ctx context.Context, c comm.Comm, wrong bool) error {
			root := 0
			if wrong {
				root = 3
			}
			return c.Broadcast(ctx, make([]float32, 1), root)
		},
		"allreduce-op": func(ctx context.Context, c comm.Comm, wrong bool) error {
			op := comm.Sum
			if wrong {
				op = comm.Op(9)
			}
			return c.AllReduce(ctx, make([]float32, 1), op)
		},
	}
	for name, call := range bad {
		t.Run(name, func(t *testing.T) {
			err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
				err := call(ctx, c, c.Rank() == 1)
				if !assert.Error(t, err, "rank %d", c.Rank()) {
					return nil
				}
				assert.NotErrorIs(t, err, comm.ErrAborted)
				if c.Rank() != 1 {
					assert.ErrorContains(t, err, "rank 1 called it with invalid arguments")
				}
				// The group is still usable.
				return c.Barrier(ctx)
			})
			require.NoError(t, err)
		})
	}
	_, err := local.New(0)
	assert.Error(t, err)
}

// TestRunReturnAborts: a rank whose function returns an error while its
// peers wait in a collective (or call one later) does not strand them: they
// get an error wrapping comm.ErrAborted that carries the cause, promptly,
// also under context.Background(); and the joined error puts the cause
// first.
func TestRunReturnAborts(t *testing.T) {
	boom := errors.New("boom")
	for _, w := range []int{2, 3, 5} {
		for _, bad := range []int{0, w - 1} {
			start := time.Now()
			err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
				if c.Rank() == bad {
					time.Sleep(5 * time.Millisecond) // let the others block first
					return boom
				}
				err := c.Barrier(ctx)
				require.ErrorIs(t, err, comm.ErrAborted)
				assert.ErrorContains(t, err, "boom")
				assert.NotErrorIs(t, err, boom, "the peers' errors carry the cause's text, not the cause")
				// Later calls fail at once too.
				return c.AllReduce(ctx, make([]float32, 3), comm.Sum)
			})
			require.ErrorIs(t, err, boom)
			assert.Less(t, time.Since(start), 5*time.Second)
			msg := err.Error()
			assert.True(t, strings.HasPrefix(msg, fmt.Sprintf("rank %d: boom", bad)), "the cause comes first: %s", msg)
			assert.Equal(t, w-1, strings.Count(msg, fmt.Sprintf("rank %d gave up", bad)), "every other rank reports the abort: %s", msg)
		}
	}
}

// TestRunReturnNilAfterLastCollective: a rank that returns nil right after
// its last collective does not break peers still finishing it: thousands of
// rounds where every rank leaves as soon as its last call returns, and none
// sees an error.
func TestRunReturnNilAfterLastCollective(t *testing.T) {
	for i := range 1000 {
		w := 2 + i%4
		var failed atomic.Int32
		err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
			buf := make([]float32, 1+i%7)
			buf[0] = float32(c.Rank())
			if err := c.AllReduce(ctx, buf, comm.Sum); err != nil {
				failed.Add(1)
				return err
			}
			if c.Rank()%2 == 1 && i%2 == 1 {
				// A call the even ranks, gone, never make: it must fail
				// (not hang), and the AllReduce above must not.
				return c.Barrier(ctx)
			}
			return nil
		})
		require.Zero(t, failed.Load(), "round %d: a rank that left after the last collective broke a peer still in it", i)
		if i%2 == 1 {
			require.ErrorIs(t, err, comm.ErrAborted, "round %d", i)
		} else {
			require.NoError(t, err, "round %d", i)
		}
	}
}

// TestRunReturnAbortsSplits: a rank that returns leaves the communicators
// it split off too, so peers waiting in a sub-group are not stranded.
func TestRunReturnAbortsSplits(t *testing.T) {
	boom := errors.New("boom")
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
		sub, err := c.Split(ctx, c.Rank()%2, c.Rank())
		if err != nil {
			return err
		}
		if c.Rank() == 0 {
			return boom
		}
		return sub.Barrier(ctx) // rank 2 waits for rank 0 in the sub-group
	}, local.WithRanksPerNode(2))
	require.ErrorIs(t, err, boom)
	require.ErrorIs(t, err, comm.ErrAborted)
}

// TestCancelMidCollective cancels one rank's context while its peers wait
// for a rank that never comes: every rank returns an error and no goroutine
// stays blocked.
func TestCancelMidCollective(t *testing.T) {
	before := runtime.NumGoroutine()
	const w = 4
	cs, err := local.New(w)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, w)
	for r := 0; r < w-1; r++ { // rank w-1 never calls
		go func() { errs <- cs[r].AllReduce(ctx, make([]float32, 1<<16), comm.Sum) }()
	}
	time.Sleep(20 * time.Millisecond)
	cancel()
	for r := 0; r < w-1; r++ {
		select {
		case err := <-errs:
			require.ErrorIs(t, err, comm.ErrAborted)
			assert.ErrorIs(t, err, context.Canceled)
		case <-time.After(5 * time.Second):
			t.Fatal("a rank stayed blocked after cancellation")
		}
	}
	// The broken group refuses further work at once.
	assert.ErrorIs(t, cs[w-1].Barrier(context.Background()), comm.ErrAborted)
	// A plain loop: assert.Eventually would add a goroutine of its own.
	for deadline := time.Now().Add(5 * time.Second); runtime.NumGoroutine() > before; {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<16)
			t.Fatalf("goroutines left blocked: %d > %d\n%s", runtime.NumGoroutine(), before, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestDeadline: one rank's deadline passes while the others have none; all
// of them fail.
func TestDeadline(t *testing.T) {
	const w = 3
	err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		if c.Rank() == 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, 10*time.Millisecond)
			defer cancel()
			time.Sleep(20 * time.Millisecond)
		}
		if c.Rank() == 2 {
			return nil // never joins
		}
		err := c.Barrier(ctx)
		assert.ErrorIs(t, err, comm.ErrAborted)
		return nil
	})
	require.NoError(t, err)
}

// TestEarlyClose: a rank that closes its communicator makes peers waiting
// for it fail instead of hanging.
func TestEarlyClose(t *testing.T) {
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
		if c.Rank() == 1 {
			return c.Close()
		}
		err := c.AllGather(ctx, []float32{1}, make([]float32, 3))
		assert.ErrorIs(t, err, comm.ErrClosed)
		return nil
	})
	require.NoError(t, err)
}

func TestDeterministic(t *testing.T) {
	run := func() [][]float32 {
		out := make([][]float32, 5)
		require.NoError(t, local.Run(ctxT(t), 5, func(ctx context.Context, c comm.Comm) error {
			buf := input(c.Rank(), 4097)
			for i := 0; i < 3; i++ {
				if err := c.AllReduce(ctx, buf, comm.Mean); err != nil {
					return err
				}
			}
			out[c.Rank()] = buf
			return nil
		}))
		return out
	}
	a, b := run(), run()
	for r := range a {
		for i := range a[r] {
			require.Equal(t, math.Float32bits(a[0][i]), math.Float32bits(a[r][i]), "rank %d differs from rank 0", r)
			require.Equal(t, math.Float32bits(a[r][i]), math.Float32bits(b[r][i]), "run-to-run difference")
		}
	}
}

func TestAllReduceAllocs(t *testing.T) {
	cs, err := local.New(2)
	require.NoError(t, err)
	ctx := context.Background()
	done := make(chan struct{})
	buf1 := make([]float32, 1000)
	go func() {
		defer close(done)
		for i := 0; i < 102; i++ {
			_ = cs[1].AllReduce(ctx, buf1, comm.Sum)
		}
	}()
	buf0 := make([]float32, 1000)
	_ = cs[0].AllReduce(ctx, buf0, comm.Sum) // warm-up sizes the scratch
	allocs := testing.AllocsPerRun(100, func() { _ = cs[0].AllReduce(ctx, buf0, comm.Sum) })
	<-done
	assert.Zero(t, allocs)
}

// TestConcurrent: in-process communicators may overlap their collectives
// with the rank's other communicators' (quant's pipelined two-level
// allreduce relies on it; its tests run it).
func TestConcurrent(t *testing.T) {
	cs, err := local.New(2)
	require.NoError(t, err)
	assert.True(t, comm.CanOverlap(cs...))
	assert.False(t, comm.CanOverlap(cs[0], nil), "a communicator that does not say so may not")
}
