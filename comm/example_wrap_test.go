package comm_test

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// countingComm counts the barriers of the communicator it wraps. It
// overrides only what it needs and forwards the rest by embedding; Unwrap
// keeps the wrapped communicator's capabilities (node layout, overlap,
// skipped argument checks) visible through it.
type countingComm struct {
	comm.Comm
	barriers *atomic.Int64
}

func (c countingComm) Barrier(ctx context.Context) error {
	c.barriers.Add(1)
	return c.Comm.Barrier(ctx)
}

func (c countingComm) Unwrap() comm.Comm { return c.Comm }

// A user's wrapper keeps the fast paths of the communicator it wraps by
// implementing comm.Wrapper.
func ExampleWrapper() {
	var barriers atomic.Int64
	var nodes, perNode atomic.Int64
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
		nodes.Store(int64(l.Nodes))
		perNode.Store(int64(l.RanksPerNode))
		return nil
	}, local.WithRanksPerNode(2))
	fmt.Println(err)
	fmt.Println("barriers:", barriers.Load())
	fmt.Printf("layout: %d nodes x %d ranks\n", nodes.Load(), perNode.Load())
	// Output:
	// <nil>
	// barriers: 4
	// layout: 2 nodes x 2 ranks
}
