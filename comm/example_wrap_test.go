package comm_test

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// countingComm counts the barriers of the communicator it wraps and of
// every communicator split off it. It overrides only what it needs and
// forwards the rest by embedding. Unwrap keeps the wrapped communicator's
// capabilities visible through it (skipped argument checks, the node
// layout); its Split wraps what it makes, so the node communicator of a
// layout is counted too; and, its counter being atomic, it says that its
// collectives may overlap whenever the wrapped communicator's may.
type countingComm struct {
	comm.Comm
	barriers *atomic.Int64
}

func (c countingComm) Barrier(ctx context.Context) error {
	c.barriers.Add(1)
	return c.Comm.Barrier(ctx)
}

func (c countingComm) Split(ctx context.Context, color, key int) (comm.Comm, error) {
	s, err := c.Comm.Split(ctx, color, key)
	if s == nil || err != nil {
		return s, err
	}
	return countingComm{Comm: s, barriers: c.barriers}, nil
}

func (c countingComm) Unwrap() comm.Comm { return c.Comm }

func (c countingComm) Concurrent() bool { return comm.CanOverlap(c.Comm) }

// A user's wrapper keeps the fast paths of the communicator it wraps by
// implementing comm.Wrapper.
func ExampleWrapper() {
	var barriers atomic.Int64
	var nodes, perNode atomic.Int64
	var overlap atomic.Bool
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
		w := countingComm{Comm: c, barriers: &barriers}
		if err := w.Barrier(ctx); err != nil {
			return err
		}
		l, err := comm.NewLayout(ctx, w, 0) // the backend's nodes, seen through w
		if err != nil {
			return err
		}
		defer l.Close()
		if err := l.Intra.Barrier(ctx); err != nil { // counted too
			return err
		}
		nodes.Store(int64(l.Nodes))
		perNode.Store(int64(l.RanksPerNode))
		overlap.Store(comm.CanOverlap(l.Intra, l.Inter))
		return nil
	}, local.WithRanksPerNode(2))
	fmt.Println(err)
	fmt.Println("barriers:", barriers.Load())
	fmt.Printf("layout: %d nodes x %d ranks\n", nodes.Load(), perNode.Load())
	fmt.Println("may overlap:", overlap.Load())
	// Output:
	// <nil>
	// barriers: 8
	// layout: 2 nodes x 2 ranks
	// may overlap: true
}
