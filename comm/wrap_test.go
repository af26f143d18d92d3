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
			_, ok := comm.As[comm.NodeSplitter](c)
			assert.True(t, ok, "NodeSplitter found through the wrappers")
		})
	}
	_, ok := comm.As[comm.NodeSplitter](opaque{inner})
	assert.False(t, ok, "a wrapper without Unwrap hides the capability")
	_, ok = comm.As[comm.NodeSplitter](nil)
	assert.False(t, ok, "nil has no capabilities")
	ns, ok := comm.As[comm.NodeSplitter](wrapped{wrapped{inner}})
	require.True(t, ok)
	assert.Equal(t, inner, ns, "As returns the capability it finds, whatever its type")
	_, err = comm.SplitNode(context.Background(), opaque{inner})
	assert.ErrorIs(t, err, errors.ErrUnsupported, "SplitNode without a NodeSplitter")
}

// safe is a wrapper that says it is goroutine-safe: it may overlap
// whenever what it wraps may.
type safe struct{ wrapped }

func (s safe) Concurrent() bool { return comm.CanOverlap(s.Comm) }

// TestWrapperConcurrentNotInherited: a wrapper's collectives overlap only
// when the wrapper itself says they may; the wrapped communicator's
// Concurrent speaks for the wrapped communicator, not for the wrapper's own
// state.
func TestWrapperConcurrentNotInherited(t *testing.T) {
	cs, err := local.New(1)
	require.NoError(t, err)
	inner := cs[0]
	assert.True(t, comm.CanOverlap(inner))
	assert.False(t, comm.CanOverlap(wrapped{inner}), "a wrapper does not inherit Concurrent")
	assert.False(t, comm.CanOverlap(wrapped{wrapped{inner}}))
	k, ok := comm.As[comm.Concurrent](wrapped{inner})
	assert.True(t, ok && k.Concurrent(), "As finds Concurrent through a wrapper like any capability; CanOverlap does not take it")
	assert.False(t, comm.CanOverlap(opaque{inner}))

	assert.True(t, comm.CanOverlap(safe{wrapped{inner}}), "a wrapper that says so may")
	assert.True(t, comm.CanOverlap(safe{wrapped{safe{wrapped{inner}}}}))
	assert.False(t, comm.CanOverlap(safe{wrapped{wrapped{inner}}}),
		"a goroutine-safe wrapper over one that is not may not")
	assert.False(t, comm.CanOverlap(safe{wrapped{opaque{inner}}}))
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

// counting is a wrapper that counts the barriers of every communicator
// split off it (its Split wraps what the wrapped Split returns), but does
// not implement SplitNode: it relies on comm.SplitNode to find the node
// layout.
type counting struct {
	comm.Comm
	barriers *atomic.Int64
}

func (c counting) Unwrap() comm.Comm { return c.Comm }

func (c counting) Barrier(ctx context.Context) error {
	c.barriers.Add(1)
	return c.Comm.Barrier(ctx)
}

func (c counting) Split(ctx context.Context, color, key int) (comm.Comm, error) {
	s, err := c.Comm.Split(ctx, color, key)
	if s == nil || err != nil {
		return s, err
	}
	return counting{Comm: s, barriers: c.barriers}, nil
}

// TestWrapperNodeCommIsWrapped: a wrapper that implements Unwrap and Split
// but not SplitNode still gets the backend's nodes (2 x 2), and the node
// communicator is one its own Split made, so the wrapper sees its calls;
// before, the wrapped backend's SplitNode handed out an unwrapped node
// communicator whose barriers the wrapper never counted. Also through
// further wrappers, and with the wrapped SplitNode's ErrUnsupported kept.
func TestWrapperNodeCommIsWrapped(t *testing.T) {
	cases := []struct {
		name  string
		wrap  func(comm.Comm, *atomic.Int64) comm.Comm
		nodes int
	}{
		{"counting", func(c comm.Comm, n *atomic.Int64) comm.Comm { return counting{c, n} }, 2},
		{"outside", func(c comm.Comm, n *atomic.Int64) comm.Comm { return wrapped{counting{c, n}} }, 2},
		{"inside", func(c comm.Comm, n *atomic.Int64) comm.Comm { return counting{wrapped{c}, n} }, 2},
		{"unsupported", func(c comm.Comm, n *atomic.Int64) comm.Comm { return counting{noNodes{wrapped{c}}, n} }, 4},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			var barriers atomic.Int64
			err := local.Run(ctx, 4, func(ctx context.Context, c comm.Comm) error {
				w := tc.wrap(c, &barriers)
				l, err := comm.NewLayout(ctx, w, 0)
				if err != nil {
					return err
				}
				defer l.Close()
				assert.Equal(t, tc.nodes, l.Nodes)
				assert.Equal(t, 4/tc.nodes, l.RanksPerNode)
				assert.Equal(t, l.Local, l.Intra.Rank(), "the node communicator is ordered by rank")
				assert.Equal(t, 4/tc.nodes, l.Intra.Size())
				assert.IsType(t, counting{}, l.Intra, "the node communicator is the wrapper's")
				return l.Intra.Barrier(ctx)
			}, local.WithRanksPerNode(2))
			require.NoError(t, err)
			assert.Equal(t, int64(4), barriers.Load(), "every rank's node barrier counted")
		})
	}
}

// TestWrapperNodeCommGroups: the node communicators comm.SplitNode makes
// through a wrapper group the ranks of each node (3 x 2 here): a broadcast
// from a node's first rank reaches that node's ranks and no others.
func TestWrapperNodeCommGroups(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var got [6]float32
	err := local.Run(ctx, 6, func(ctx context.Context, c comm.Comm) error {
		var n atomic.Int64
		node, err := comm.SplitNode(ctx, wrapped{counting{c, &n}})
		if err != nil {
			return err
		}
		defer node.Close()
		buf := []float32{float32(c.Rank())}
		if err := node.Broadcast(ctx, buf, 0); err != nil {
			return err
		}
		got[c.Rank()] = buf[0]
		return nil
	}, local.WithRanksPerNode(3))
	require.NoError(t, err)
	assert.Equal(t, [6]float32{0, 0, 0, 3, 3, 3}, got)
}
