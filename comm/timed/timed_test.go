package timed_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/comm/timed"
)

// skipRecorder stands in for comm/mpi's argument check (comm/local has
// none): it records the promises that reach it.
type skipRecorder struct {
	comm.Comm
	got []int
}

func (s *skipRecorder) SkipChecks(n int) { s.got = append(s.got, n) }

func (s *skipRecorder) Unwrap() comm.Comm { return s.Comm }

// TestKeepsCapabilities: the wrapper keeps what the communicator can do:
// the 1-bit allreduce's skipped argument check reaches it, collectives may overlap,
// and the node layout is the backend's (2 x 2), with the node
// communicator's time counted too.
func TestKeepsCapabilities(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := local.Run(ctx, 4, func(ctx context.Context, c comm.Comm) error {
		rec := &skipRecorder{Comm: c}
		tc := timed.New(rec)
		comm.SkipChecks(tc, 2)
		assert.Equal(t, []int{2}, rec.got, "SkipChecks reaches the wrapped communicator")
		assert.True(t, comm.CanOverlap(timed.New(c)), "Concurrent kept")
		assert.False(t, comm.CanOverlap(tc), "not over a wrapper that does not say so itself")

		l, err := comm.NewLayout(ctx, tc, 0)
		if err != nil {
			return err
		}
		defer l.Close()
		assert.Equal(t, 2, l.Nodes)
		assert.Equal(t, 2, l.RanksPerNode)
		require.IsType(t, &timed.Comm{}, l.Intra, "the node communicator is timed too")
		before := tc.Elapsed()
		if err := l.Intra.Barrier(ctx); err != nil {
			return err
		}
		assert.Greater(t, tc.Elapsed(), before, "the node communicator shares the counter")
		return nil
	}, local.WithRanksPerNode(2))
	require.NoError(t, err)
}

// TestWithoutNodes: over a communicator that cannot tell nodes
// apart, the layout is one rank per node, as without the wrapper.
func TestWithoutNodes(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		l, err := comm.NewLayout(ctx, timed.New(struct{ comm.Comm }{c}), 0)
		if err != nil {
			return err
		}
		defer l.Close()
		assert.Equal(t, 2, l.Nodes)
		assert.Equal(t, 1, l.RanksPerNode)
		return nil
	})
	require.NoError(t, err)
}

// starter stands in for comm/mpi's started collectives over comm/local:
// it runs the blocking one at the start and counts the starts.
type starter struct {
	comm.Comm
	starts int
}

func (s *starter) Starts() bool { return true }

func (s *starter) StartAllToAllBytes(ctx context.Context, send, recv []byte) (comm.Request, error) {
	s.starts++
	return comm.Done{}, s.Comm.AllToAllBytes(ctx, send, recv)
}

func (s *starter) StartAllGatherBytes(ctx context.Context, send, recv []byte) (comm.Request, error) {
	s.starts++
	return comm.Done{}, s.Comm.AllGatherBytes(ctx, send, recv)
}

// TestStarted: a timed communicator starts collectives through the one it
// wraps when that one can, runs them blocking otherwise, moves the same
// bytes either way and counts the time of the start, Test and Wait.
func TestStarted(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	const w, k = 3, 5
	err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		inner := &starter{Comm: c}
		for _, tc := range []*timed.Comm{timed.New(inner), timed.New(c)} {
			send, recv := make([]byte, w*k), make([]byte, w*k)
			for i := range send {
				send[i] = byte(10*r + i)
			}
			before := tc.Elapsed()
			req, err := tc.StartAllToAllBytes(ctx, send, recv)
			require.NoError(t, err)
			require.NoError(t, req.Wait())
			done, err := req.Test()
			assert.True(t, done)
			require.NoError(t, err)
			for from := range w {
				for i := range k {
					require.Equal(t, byte(10*from+r*k+i), recv[from*k+i])
				}
			}
			gathered := make([]byte, w*k)
			req, err = tc.StartAllGatherBytes(ctx, send[:k], gathered)
			require.NoError(t, err)
			require.NoError(t, req.Wait())
			for from := range w {
				require.Equal(t, byte(10*from), gathered[from*k])
			}
			assert.Greater(t, tc.Elapsed(), before)
		}
		assert.Equal(t, 2, inner.starts, "started through the wrapped communicator")
		assert.True(t, timed.New(inner).Starts())
		assert.False(t, timed.New(c).Starts(), "comm/local does not start collectives")
		return nil
	})
	require.NoError(t, err)
}
