package local_test

import (
	"context"
	"errors"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// collected forces collections until n cleanups have counted themselves in
// freed, and reports whether they did within a few seconds.
func collected(freed *atomic.Int64, n int64) bool {
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); {
		runtime.GC()
		if freed.Load() >= n {
			return true
		}
		time.Sleep(time.Millisecond)
	}
	return false
}

// watch registers a cleanup that counts in freed when buf's memory is freed.
func watch[T any](buf []T, freed *atomic.Int64) {
	runtime.AddCleanup(&buf[0], func(f *atomic.Int64) { f.Add(1) }, freed)
}

// TestBuffersNotRetained: once a collective has returned, the group keeps
// no reference to the callers' buffers (comm.Comm: buffers are never
// retained after a call returns), so they are freed while the
// communicators live on. It covers every collective, a call whose
// arguments mismatch across ranks, and a call cut short by a closed peer.
func TestBuffersNotRetained(t *testing.T) {
	const n = 1 << 20 // elements per buffer
	cases := []struct {
		name string
		// call runs rank r's part of the collective on fresh buffers,
		// handing each to watch.
		call func(ctx context.Context, c comm.Comm, w func(any)) error
		// fails: the call is meant to return an error.
		fails bool
	}{
		{"allreduce", func(ctx context.Context, c comm.Comm, w func(any)) error {
			buf := make([]float32, n)
			w(buf)
			return c.AllReduce(ctx, buf, comm.Sum)
		}, false},
		{"reducescatter", func(ctx context.Context, c comm.Comm, w func(any)) error {
			send, recv := make([]float32, n), make([]float32, n/c.Size())
			w(send)
			w(recv)
			return c.ReduceScatter(ctx, send, recv, comm.Sum)
		}, false},
		{"allgather", func(ctx context.Context, c comm.Comm, w func(any)) error {
			send, recv := make([]float32, n/c.Size()), make([]float32, n)
			w(send)
			w(recv)
			return c.AllGather(ctx, send, recv)
		}, false},
		{"allgatherbytes", func(ctx context.Context, c comm.Comm, w func(any)) error {
			send, recv := make([]byte, n/c.Size()), make([]byte, n)
			w(send)
			w(recv)
			return c.AllGatherBytes(ctx, send, recv)
		}, false},
		{"alltoall", func(ctx context.Context, c comm.Comm, w func(any)) error {
			send, recv := make([]float32, n), make([]float32, n)
			w(send)
			w(recv)
			return c.AllToAll(ctx, send, recv)
		}, false},
		{"alltoallbytes", func(ctx context.Context, c comm.Comm, w func(any)) error {
			send, recv := make([]byte, n), make([]byte, n)
			w(send)
			w(recv)
			return c.AllToAllBytes(ctx, send, recv)
		}, false},
		{"broadcast", func(ctx context.Context, c comm.Comm, w func(any)) error {
			buf := make([]float32, n)
			w(buf)
			return c.Broadcast(ctx, buf, 1)
		}, false},
		{"broadcastbytes", func(ctx context.Context, c comm.Comm, w func(any)) error {
			buf := make([]byte, n)
			w(buf)
			return c.BroadcastBytes(ctx, buf, 1)
		}, false},
		{"mismatched lengths", func(ctx context.Context, c comm.Comm, w func(any)) error {
			buf := make([]float32, n+c.Rank())
			w(buf)
			return c.AllReduce(ctx, buf, comm.Sum)
		}, true},
		{"peer closed", func(ctx context.Context, c comm.Comm, w func(any)) error {
			if c.Rank() == 0 {
				time.Sleep(10 * time.Millisecond) // let the others publish
				return c.Close()
			}
			buf := make([]float32, n)
			w(buf)
			err := c.AllReduce(ctx, buf, comm.Sum)
			if err == nil {
				return errors.New("allreduce succeeded without rank 0")
			}
			return nil
		}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			const w = 4 // divides n
			cs, err := local.New(w)
			require.NoError(t, err)
			var freed, watched atomic.Int64
			errs := make(chan error, w)
			for r := range cs {
				go func() {
					errs <- tc.call(ctxT(t), cs[r], func(b any) {
						watched.Add(1)
						switch b := b.(type) {
						case []float32:
							watch(b, &freed)
						case []byte:
							watch(b, &freed)
						}
					})
				}()
			}
			for range cs {
				if err := <-errs; tc.fails {
					require.Error(t, err)
				} else {
					require.NoError(t, err)
				}
			}
			assert.True(t, collected(&freed, watched.Load()),
				"%d of %d buffers still referenced after the collective returned", watched.Load()-freed.Load(), watched.Load())
			runtime.KeepAlive(cs)
		})
	}
}

// TestClosedSplitReleased: a split that is closed is dropped by its parent,
// so it is freed while the parent lives on.
func TestClosedSplitReleased(t *testing.T) {
	const w = 4
	var freed atomic.Int64
	err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
		for range 3 {
			sub, err := c.Split(ctx, c.Rank()%2, c.Rank())
			if err != nil {
				return err
			}
			runtime.AddCleanup(sub.(*local.Comm), func(f *atomic.Int64) { f.Add(1) }, &freed)
			if err := sub.Barrier(ctx); err != nil {
				return err
			}
			assert.Equal(t, 1, local.NumSplits(c))
			if err := sub.Close(); err != nil {
				return err
			}
			assert.Equal(t, 0, local.NumSplits(c), "the parent keeps a closed split")
		}
		if err := c.Barrier(ctx); err != nil { // every rank has closed its splits
			return err
		}
		if c.Rank() == 0 {
			assert.True(t, collected(&freed, 3*w), "%d of %d closed splits still referenced", 3*w-freed.Load(), 3*w)
		}
		return c.Barrier(ctx)
	})
	require.NoError(t, err)
}

// TestRunReturnAbortsSplitsOfClosedSplit: the communicators split off a
// split that was closed pass to its parent, so a rank that returns still
// leaves them and peers waiting in them are not stranded.
func TestRunReturnAbortsSplitsOfClosedSplit(t *testing.T) {
	boom := errors.New("boom")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := local.Run(ctx, 4, func(ctx context.Context, c comm.Comm) error {
		mid, err := c.Split(ctx, 0, c.Rank())
		if err != nil {
			return err
		}
		sub, err := mid.Split(ctx, c.Rank()%2, c.Rank())
		if err != nil {
			return err
		}
		if err := mid.Close(); err != nil {
			return err
		}
		assert.Equal(t, 1, local.NumSplits(c), "the parent does not hold the closed split's split")
		if c.Rank() == 0 {
			return boom
		}
		err = sub.Barrier(ctx) // rank 2 waits for rank 0 in the sub-group
		if c.Rank() == 2 {
			// Left by rank 0, not given up on at the deadline.
			assert.ErrorIs(t, err, comm.ErrClosed)
			assert.NotErrorIs(t, err, context.DeadlineExceeded)
		}
		return err
	}, local.WithRanksPerNode(2))
	require.ErrorIs(t, err, boom)
	require.ErrorIs(t, err, comm.ErrAborted)
}
