package gomlx

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
)

// countingComm is a comm.Comm that counts the collectives it forwards and,
// with a latency, sleeps that long before each one, as a slow link's round
// trip would cost: the per-step agreements are latency-bound allreduces of
// a few bytes. It forwards every call one for one (it is a comm.Wrapper, so
// the 1-bit allreduce keeps its fast paths).
type countingComm struct {
	comm.Comm
	latency time.Duration
	// calls counts every collective; agreements the AllReduces with
	// comm.Max, which only the per-step agreements use (the lowbit
	// optimizers average gradients with Sum or Mean, and the 1-bit
	// allreduce moves its bits with other collectives).
	calls, agreements atomic.Int64
}

func newCountingComm(c comm.Comm, latency time.Duration) *countingComm {
	return &countingComm{Comm: c, latency: latency}
}

// Unwrap implements comm.Wrapper.
func (c *countingComm) Unwrap() comm.Comm { return c.Comm }

func (c *countingComm) call() {
	c.calls.Add(1)
	if c.latency > 0 {
		time.Sleep(c.latency)
	}
}

func (c *countingComm) AllReduce(ctx context.Context, buf []float32, op comm.Op) error {
	if op == comm.Max {
		c.agreements.Add(1)
	}
	c.call()
	return c.Comm.AllReduce(ctx, buf, op)
}

func (c *countingComm) ReduceScatter(ctx context.Context, send, recv []float32, op comm.Op) error {
	c.call()
	return c.Comm.ReduceScatter(ctx, send, recv, op)
}

func (c *countingComm) AllGather(ctx context.Context, send, recv []float32) error {
	c.call()
	return c.Comm.AllGather(ctx, send, recv)
}

func (c *countingComm) AllGatherBytes(ctx context.Context, send, recv []byte) error {
	c.call()
	return c.Comm.AllGatherBytes(ctx, send, recv)
}

func (c *countingComm) AllToAll(ctx context.Context, send, recv []float32) error {
	c.call()
	return c.Comm.AllToAll(ctx, send, recv)
}

func (c *countingComm) AllToAllBytes(ctx context.Context, send, recv []byte) error {
	c.call()
	return c.Comm.AllToAllBytes(ctx, send, recv)
}

func (c *countingComm) Broadcast(ctx context.Context, buf []float32, root int) error {
	c.call()
	return c.Comm.Broadcast(ctx, buf, root)
}

func (c *countingComm) BroadcastBytes(ctx context.Context, buf []byte, root int) error {
	c.call()
	return c.Comm.BroadcastBytes(ctx, buf, root)
}

func (c *countingComm) Barrier(ctx context.Context) error {
	c.call()
	return c.Comm.Barrier(ctx)
}

// callCount is what a countingComm counted.
type callCount struct{ calls, agreements int64 }

func (c *countingComm) count() callCount {
	return callCount{c.calls.Load(), c.agreements.Load()}
}

func (a callCount) sub(b callCount) callCount {
	return callCount{a.calls - b.calls, a.agreements - b.agreements}
}
