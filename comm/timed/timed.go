// Package timed wraps a communicator so that the wall time of its
// collectives is counted: a training loop splits the time an optimizer
// spends in Step into communication (inside collectives) and the rest
// (compression, the update). The wrapper is a comm.Wrapper, so it keeps
// the fast paths of what it wraps.
package timed

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
)

// Comm is a comm.Comm that adds the wall time of every collective call to
// a counter. Communicators made by its Split and SplitNode share the
// counter. Its methods may be called concurrently, as the wrapped
// communicator's may.
//
// It keeps the capabilities of the communicator it wraps: the argument
// check the 1-bit allreduce skips by implementing comm.Wrapper (comm.As
// finds it through it), the node layout, overlapping collectives and
// started ones by implementing SplitNode, Concurrent and comm.Starter
// itself (a Comm is a Starter whatever it wraps: without one it runs the
// collective blocking and returns it done).
type Comm struct {
	comm.Comm
	ns *atomic.Int64

	// The Requests of started collectives, reused in turn (more than a
	// comm.Starter may have in flight).
	reqs [maxStarted]request
	next int
}

// maxStarted is how many started collectives' Requests a Comm keeps
// apart: comm/mpi has at most 16 in flight.
const maxStarted = 16

// New wraps c; the counter starts at zero.
func New(c comm.Comm) *Comm {
	return &Comm{Comm: c, ns: new(atomic.Int64)}
}

// Elapsed is the total time spent in collectives so far, by this
// communicator and those split off it.
func (t *Comm) Elapsed() time.Duration { return time.Duration(t.ns.Load()) }

func (t *Comm) since(start time.Time) { t.ns.Add(int64(time.Since(start))) }

// AllReduce calls the wrapped communicator's and counts its time.
func (t *Comm) AllReduce(ctx context.Context, buf []float32, op comm.Op) error {
	defer t.since(time.Now())
	return t.Comm.AllReduce(ctx, buf, op)
}

// ReduceScatter calls the wrapped communicator's and counts its time.
func (t *Comm) ReduceScatter(ctx context.Context, send, recv []float32, op comm.Op) error {
	defer t.since(time.Now())
	return t.Comm.ReduceScatter(ctx, send, recv, op)
}

// AllGather calls the wrapped communicator's and counts its time.
func (t *Comm) AllGather(ctx context.Context, send, recv []float32) error {
	defer t.since(time.Now())
	return t.Comm.AllGather(ctx, send, recv)
}

// AllGatherBytes calls the wrapped communicator's and counts its time.
func (t *Comm) AllGatherBytes(ctx context.Context, send, recv []byte) error {
	defer t.since(time.Now())
	return t.Comm.AllGatherBytes(ctx, send, recv)
}

// AllToAll calls the wrapped communicator's and counts its time.
func (t *Comm) AllToAll(ctx context.Context, send, recv []float32) error {
	defer t.since(time.Now())
	return t.Comm.AllToAll(ctx, send, recv)
}

// AllToAllBytes calls the wrapped communicator's and counts its time.
func (t *Comm) AllToAllBytes(ctx context.Context, send, recv []byte) error {
	defer t.since(time.Now())
	return t.Comm.AllToAllBytes(ctx, send, recv)
}

// Broadcast calls the wrapped communicator's and counts its time.
func (t *Comm) Broadcast(ctx context.Context, buf []float32, root int) error {
	defer t.since(time.Now())
	return t.Comm.Broadcast(ctx, buf, root)
}

// BroadcastBytes calls the wrapped communicator's and counts its time.
func (t *Comm) BroadcastBytes(ctx context.Context, buf []byte, root int) error {
	defer t.since(time.Now())
	return t.Comm.BroadcastBytes(ctx, buf, root)
}

// Barrier calls the wrapped communicator's and counts its time.
func (t *Comm) Barrier(ctx context.Context) error {
	defer t.since(time.Now())
	return t.Comm.Barrier(ctx)
}

// Split splits through the wrapped communicator, timed, and wraps the
// result so that its calls are counted too.
func (t *Comm) Split(ctx context.Context, color, key int) (comm.Comm, error) {
	defer t.since(time.Now())
	c, err := t.Comm.Split(ctx, color, key)
	if c == nil || err != nil {
		return c, err
	}
	return &Comm{Comm: c, ns: t.ns}, nil
}

// Unwrap returns the wrapped communicator (comm.Wrapper): every call of
// Comm is one call of it.
func (t *Comm) Unwrap() comm.Comm { return t.Comm }

// SplitNode splits off the ranks of this rank's node through the wrapped
// communicator's comm.NodeSplitter (comm.SplitNode), timed like Split, and
// wraps the result so its calls are counted too. Without one it returns
// errors.ErrUnsupported (the layout then takes one rank per node, as it
// would for the wrapped communicator).
func (t *Comm) SplitNode(ctx context.Context) (comm.Comm, error) {
	defer t.since(time.Now())
	c, err := comm.SplitNode(ctx, t.Comm)
	if c == nil || err != nil {
		return c, err
	}
	return &Comm{Comm: c, ns: t.ns}, nil
}

// Concurrent reports whether the wrapped communicator's collectives may
// overlap (comm.CanOverlap): the counter is atomic, so Comm adds no limit
// of its own.
func (t *Comm) Concurrent() bool { return comm.CanOverlap(t.Comm) }

// Starts reports whether the wrapped communicator starts collectives
// (comm.Starter).
func (t *Comm) Starts() bool {
	s, ok := t.Comm.(comm.Starter)
	return ok && s.Starts()
}

// StartAllToAllBytes starts the wrapped communicator's (comm.Starter) or,
// if it has none, runs its AllToAllBytes and returns it done. The time
// counted is the caller's: in the start and in the Request's Test and
// Wait, not the time the data travelled while the caller computed.
func (t *Comm) StartAllToAllBytes(ctx context.Context, send, recv []byte) (comm.Request, error) {
	defer t.since(time.Now())
	s, ok := t.Comm.(comm.Starter)
	if !ok {
		return comm.Done{}, t.Comm.AllToAllBytes(ctx, send, recv)
	}
	r, err := s.StartAllToAllBytes(ctx, send, recv)
	return t.wrap(r, err)
}

// StartAllGatherBytes is StartAllToAllBytes for AllGatherBytes.
func (t *Comm) StartAllGatherBytes(ctx context.Context, send, recv []byte) (comm.Request, error) {
	defer t.since(time.Now())
	s, ok := t.Comm.(comm.Starter)
	if !ok {
		return comm.Done{}, t.Comm.AllGatherBytes(ctx, send, recv)
	}
	r, err := s.StartAllGatherBytes(ctx, send, recv)
	return t.wrap(r, err)
}

// wrap returns a Request that counts the time in r's calls.
func (t *Comm) wrap(r comm.Request, err error) (comm.Request, error) {
	if err != nil {
		return nil, err
	}
	q := &t.reqs[t.next]
	t.next = (t.next + 1) % maxStarted
	q.t, q.r = t, r
	return q, nil
}

// request counts the time in a started collective's Test and Wait.
type request struct {
	t *Comm
	r comm.Request
}

func (q *request) Test() (bool, error) {
	defer q.t.since(time.Now())
	return q.r.Test()
}

func (q *request) Wait() error {
	defer q.t.since(time.Now())
	return q.r.Wait()
}

var (
	_ comm.Comm         = (*Comm)(nil)
	_ comm.Starter      = (*Comm)(nil)
	_ comm.Wrapper      = (*Comm)(nil)
	_ comm.NodeSplitter = (*Comm)(nil)
	_ comm.Concurrent   = (*Comm)(nil)
)
