// Package commtest holds communicator wrappers for the tests and
// benchmarks of the examples and integrations: Counting counts the
// collectives it forwards and, with a delay, sleeps before each one, as a
// round trip on a slow link would cost; Spoiling damages what one rank
// receives in one byte collective.
package commtest

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
)

// Counting forwards every collective to Comm one for one, after sleeping
// Delay, and counts them: Calls every collective, Agreements the
// AllReduces with comm.Max, which only the per-step agreements use (the
// optimizers average with Sum or Mean, and the 1-bit allreduce moves its
// bits with other collectives). The counters are atomic: ranks in one
// process may share one. Counting implements no Unwrap, so that every
// collective goes through it (comm.As finds no capability of Comm); wrap
// it in Transparent to keep the wrapped communicator's fast paths.
type Counting struct {
	comm.Comm
	Delay time.Duration
	// Calls and Agreements are the counters; New allocates them, and
	// ranks may be given the same ones.
	Calls, Agreements *atomic.Int64
}

// New returns a Counting over c with its own counters.
func New(c comm.Comm, delay time.Duration) *Counting {
	return &Counting{Comm: c, Delay: delay, Calls: new(atomic.Int64), Agreements: new(atomic.Int64)}
}

// Count is what a Counting has counted.
type Count struct{ Calls, Agreements int64 }

// Count returns the counters now.
func (c *Counting) Count() Count { return Count{c.Calls.Load(), c.Agreements.Load()} }

// Sub returns a - b: what was counted between two Counts.
func (a Count) Sub(b Count) Count { return Count{a.Calls - b.Calls, a.Agreements - b.Agreements} }

func (c *Counting) call() {
	c.Calls.Add(1)
	if c.Delay > 0 {
		time.Sleep(c.Delay)
	}
}

// AllReduce implements comm.Comm.
func (c *Counting) AllReduce(ctx context.Context, buf []float32, op comm.Op) error {
	if op == comm.Max {
		c.Agreements.Add(1)
	}
	c.call()
	return c.Comm.AllReduce(ctx, buf, op)
}

// ReduceScatter implements comm.Comm.
func (c *Counting) ReduceScatter(ctx context.Context, send, recv []float32, op comm.Op) error {
	c.call()
	return c.Comm.ReduceScatter(ctx, send, recv, op)
}

// AllGather implements comm.Comm.
func (c *Counting) AllGather(ctx context.Context, send, recv []float32) error {
	c.call()
	return c.Comm.AllGather(ctx, send, recv)
}

// AllGatherBytes implements comm.Comm.
func (c *Counting) AllGatherBytes(ctx context.Context, send, recv []byte) error {
	c.call()
	return c.Comm.AllGatherBytes(ctx, send, recv)
}

// AllToAll implements comm.Comm.
func (c *Counting) AllToAll(ctx context.Context, send, recv []float32) error {
	c.call()
	return c.Comm.AllToAll(ctx, send, recv)
}

// AllToAllBytes implements comm.Comm.
func (c *Counting) AllToAllBytes(ctx context.Context, send, recv []byte) error {
	c.call()
	return c.Comm.AllToAllBytes(ctx, send, recv)
}

// Broadcast implements comm.Comm.
func (c *Counting) Broadcast(ctx context.Context, buf []float32, root int) error {
	c.call()
	return c.Comm.Broadcast(ctx, buf, root)
}

// BroadcastBytes implements comm.Comm.
func (c *Counting) BroadcastBytes(ctx context.Context, buf []byte, root int) error {
	c.call()
	return c.Comm.BroadcastBytes(ctx, buf, root)
}

// Barrier implements comm.Comm.
func (c *Counting) Barrier(ctx context.Context) error {
	c.call()
	return c.Comm.Barrier(ctx)
}

// Transparent is a Counting that is also a comm.Wrapper: comm.As finds
// the wrapped communicator's capabilities through it (the 1-bit
// allreduce keeps its fast paths), as a user's timing wrapper would.
type Transparent struct{ *Counting }

// Unwrap implements comm.Wrapper.
func (t Transparent) Unwrap() comm.Comm { return t.Comm }

// Spoiling forwards every collective to Comm and spoils what this rank
// receives in its Call-th byte collective (AllToAllBytes and
// AllGatherBytes counted together, from 0 at the wrapper's first): after
// that call succeeded, Spoil changes recv in place, as bytes damaged on
// the way would arrive. A Spoiling is one rank's and not safe for
// concurrent use.
type Spoiling struct {
	comm.Comm
	Call  int
	Spoil func(recv []byte)
	n     int
}

// AllToAllBytes forwards the call and spoils recv if it is the Call-th.
func (s *Spoiling) AllToAllBytes(ctx context.Context, send, recv []byte) error {
	return s.spoiled(s.Comm.AllToAllBytes(ctx, send, recv), recv)
}

// AllGatherBytes forwards the call and spoils recv if it is the Call-th.
func (s *Spoiling) AllGatherBytes(ctx context.Context, send, recv []byte) error {
	return s.spoiled(s.Comm.AllGatherBytes(ctx, send, recv), recv)
}

func (s *Spoiling) spoiled(err error, recv []byte) error {
	if err == nil && s.Call == s.n {
		s.Spoil(recv)
	}
	s.n++
	return err
}
