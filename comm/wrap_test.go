package comm_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// wrapped forwards every call to the communicator it embeds and says so
// with Unwrap: it keeps the inner one's capabilities.
type wrapped struct{ comm.Comm }

func (w wrapped) Unwrap() comm.Comm { return w.Comm }

// opaque forwards every call too but hides what it wraps: the trap that
// Wrapper exists for.
type opaque struct{ comm.Comm }

// skipper records the promises it is given (a stand-in for comm/mpi's
// argument check, which comm/local does not have).
type skipper struct {
	comm.Comm
	got []int
}

func (s *skipper) SkipChecks(n int) { s.got = append(s.got, n) }

// noNodes is a wrapper that implements NodeSplitter itself but whose inner
// communicator cannot tell: it reports errors.ErrUnsupported.
type noNodes struct{ wrapped }

func (noNodes) SplitNode(context.Context) (comm.Comm, error) {
	return nil, fmt.Errorf("no node information: %w", errors.ErrUnsupported)
}

func TestWrapperKeepsCapabilities(t *testing.T) {
	cs, err := local.New(1)
	require.NoError(t, err)
	inner := cs[0]
	for name, c := range map[string]comm.Comm{
		"inner":  inner,
		"once":   wrapped{inner},
		"nested": wrapped{wrapped{wrapped{inner}}},
	} {
		t.Run(name, func(t *testing.T) {
			assert.True(t, comm.CanOverlap(c), "Concurrent found through the wrappers")
			_, ok := comm.As[comm.NodeSplitter](c)
			assert.True(t, ok, "NodeSplitter found through the wrappers")
		})
	}
	assert.False(t, comm.CanOverlap(opaque{inner}), "a wrapper without Unwrap hides the capability")
	_, ok := comm.As[comm.NodeSplitter](opaque{inner})
	assert.False(t, ok)
	_, ok = comm.As[comm.NodeSplitter](nil)
	assert.False(t, ok, "nil has no capabilities")
}

func TestWrapperSkipChecksReachesInner(t *testing.T) {
	cs, err := local.New(1)
	require.NoError(t, err)
	s := &skipper{Comm: cs[0]}
	comm.SkipChecks(wrapped{wrapped{s}}, 3)
	comm.SkipChecks(wrapped{s}, 0)
	assert.Equal(t, []int{3, 0}, s.got, "the promise reaches the communicator that checks")
	comm.SkipChecks(opaque{s}, 5)
	assert.Equal(t, []int{3, 0}, s.got, "an opaque wrapper loses it")

	// A wrapper with a capability of its own is found first.
	outer := &skipper{Comm: wrapped{s}}
	comm.SkipChecks(wrapped{outer}, 7)
	assert.Equal(t, []int{7}, outer.got)
	assert.Equal(t, []int{3, 0}, s.got)
}

// TestWrapperNodeLayout: comm.NewLayout sees the backend's nodes (2 x 2
// here) through wrappers, a wrapper that implements SplitNode itself and
// reports errors.ErrUnsupported gives one rank per node, and an opaque
// wrapper gives one rank per node too (what the MNIST example's timing
// wrapper did before it implemented Unwrap).
func TestWrapperNodeLayout(t *testing.T) {
	cases := []struct {
		name  string
		wrap  func(comm.Comm) comm.Comm
		nodes int
	}{
		{"inner", func(c comm.Comm) comm.Comm { return c }, 2},
		{"nested", func(c comm.Comm) comm.Comm { return wrapped{wrapped{c}} }, 2},
		{"unsupported", func(c comm.Comm) comm.Comm { return noNodes{wrapped{c}} }, 4},
		{"opaque", func(c comm.Comm) comm.Comm { return opaque{c} }, 4},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var nodes, perNode atomic.Int64
			err := local.Run(ctx, 4, func(ctx context.Context, c comm.Comm) error {
				l, err := comm.NewLayout(ctx, tc.wrap(c), 0)
				if err != nil {
					return err
				}
				defer l.Close()
				nodes.Store(int64(l.Nodes))
				perNode.Store(int64(l.RanksPerNode))
				return nil
			}, local.WithRanksPerNode(2))
			require.NoError(t, err)
			assert.Equal(t, int64(tc.nodes), nodes.Load())
			assert.Equal(t, int64(4/tc.nodes), perNode.Load())
		})
	}
}
