package main

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
)

// timedComm is a comm.Comm that adds the wall time of every collective call
// to a counter, so the training loop can split the time an optimizer spends
// in Step into communication (inside collectives) and the rest
// (compression and the update). Communicators made by Split and SplitNode
// share the counter.
//
// It keeps the capabilities of the communicator it wraps (the argument
// check the 1-bit allreduce skips, the node layout, overlapping
// collectives) by implementing comm.Wrapper: comm.As finds them through it.
type timedComm struct {
	comm.Comm
	ns *atomic.Int64
}

func newTimedComm(c comm.Comm) *timedComm {
	return &timedComm{Comm: c, ns: new(atomic.Int64)}
}

// elapsed is the total time spent in collectives so far.
func (t *timedComm) elapsed() time.Duration { return time.Duration(t.ns.Load()) }

func (t *timedComm) since(start time.Time) { t.ns.Add(int64(time.Since(start))) }

func (t *timedComm) AllReduce(ctx context.Context, buf []float32, op comm.Op) error {
	defer t.since(time.Now())
	return t.Comm.AllReduce(ctx, buf, op)
}

func (t *timedComm) ReduceScatter(ctx context.Context, send, recv []float32, op comm.Op) error {
	defer t.since(time.Now())
	return t.Comm.ReduceScatter(ctx, send, recv, op)
}

func (t *timedComm) AllGather(ctx context.Context, send, recv []float32) error {
	defer t.since(time.Now())
	return t.Comm.AllGather(ctx, send, recv)
}

func (t *timedComm) AllGatherBytes(ctx context.Context, send, recv []byte) error {
	defer t.since(time.Now())
	return t.Comm.AllGatherBytes(ctx, send, recv)
}

func (t *timedComm) AllToAll(ctx context.Context, send, recv []float32) error {
	defer t.since(time.Now())
	return t.Comm.AllToAll(ctx, send, recv)
}

func (t *timedComm) AllToAllBytes(ctx context.Context, send, recv []byte) error {
	defer t.since(time.Now())
	return t.Comm.AllToAllBytes(ctx, send, recv)
}

func (t *timedComm) Broadcast(ctx context.Context, buf []float32, root int) error {
	defer t.since(time.Now())
	return t.Comm.Broadcast(ctx, buf, root)
}

func (t *timedComm) BroadcastBytes(ctx context.Context, buf []byte, root int) error {
	defer t.since(time.Now())
	return t.Comm.BroadcastBytes(ctx, buf, root)
}

func (t *timedComm) Barrier(ctx context.Context) error {
	defer t.since(time.Now())
	return t.Comm.Barrier(ctx)
}

func (t *timedComm) Split(ctx context.Context, color, key int) (comm.Comm, error) {
	defer t.since(time.Now())
	c, err := t.Comm.Split(ctx, color, key)
	if c == nil || err != nil {
		return c, err
	}
	return &timedComm{Comm: c, ns: t.ns}, nil
}

// Unwrap returns the wrapped communicator (comm.Wrapper): every call of
// timedComm is one call of it.
func (t *timedComm) Unwrap() comm.Comm { return t.Comm }

// SplitNode splits off the ranks of this rank's node through the wrapped
// communicator's comm.NodeSplitter, timed like Split, and wraps the result
// so its calls are counted too. Without one it returns
// errors.ErrUnsupported (the layout then takes one rank per node, as it
// would for the wrapped communicator).
func (t *timedComm) SplitNode(ctx context.Context) (comm.Comm, error) {
	ns, ok := comm.As[comm.NodeSplitter](t.Comm)
	if !ok {
		return nil, fmt.Errorf("gpt: timed communicator: node split: %w", errors.ErrUnsupported)
	}
	defer t.since(time.Now())
	c, err := ns.SplitNode(ctx)
	if c == nil || err != nil {
		return c, err
	}
	return &timedComm{Comm: c, ns: t.ns}, nil
}

var (
	_ comm.Comm         = (*timedComm)(nil)
	_ comm.Wrapper      = (*timedComm)(nil)
	_ comm.NodeSplitter = (*timedComm)(nil)
)
