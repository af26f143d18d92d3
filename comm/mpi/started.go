//go:build mpi

package mpi

// The started collectives of a communicator (mpi.go, comm.Starter): MPI's
// non-blocking all-to-all and all-gather, their Requests, and the tiny
// all-gather that rides in the argument agreement.

import (
	"context"
	"runtime"
	"unsafe"

	"github.com/lowbit-ml/lowbit/comm"
)

// Starts reports true: the Start methods start MPI's non-blocking
// collectives.
func (c *mpiComm) Starts() bool { return true }

// StartAllToAllBytes starts AllToAllBytes as MPI_Ialltoall (see
// comm.Starter).
func (c *mpiComm) StartAllToAllBytes(ctx context.Context, send, recv []byte) (comm.Request, error) {
	a := c.allToAllArgs(true, len(send), len(recv))
	n := int64(len(send)/c.size) * int64(c.size-1)
	return c.start(ctx, &a, send, recv, len(send)/c.size, n, cIAllToAll)
}

// StartAllGatherBytes starts AllGatherBytes as MPI_Iallgather (see
// comm.Starter).
//
// A tiny all-gather (at most 16 bytes per rank, in a group of at most 64
// ranks: see the package documentation) rides in the argument agreement
// alone, and then it is the agreement that is started: its MPI_Iallreduce
// travels while the caller works, Test and Wait finish it, and an argument
// mismatch or another rank's invalid arguments are their error (the
// communicator stays usable, as after a blocking call's mismatch; a rank's
// own invalid arguments are its error at once, as for any start). It is
// the same MPI operation as the blocking AllGatherBytes, so ranks may mix
// the two. It needs no other collective in flight, and no other may start
// until it is done.
func (c *mpiComm) StartAllGatherBytes(ctx context.Context, send, recv []byte) (comm.Request, error) {
	a := c.allGatherArgs(true, len(send), len(recv))
	n := int64(len(send)) * int64(c.size-1)
	if tiny(len(send), c.size) && c.skip == 0 && a.invalid == nil {
		return c.startTiny(ctx, &a, send, recv, n)
	}
	return c.start(ctx, &a, send, recv, len(send), n, cIAllGather)
}

// start begins a started collective like a blocking one (the agreement,
// unless skipped, in which the ranks also agree that they all start it,
// and the watchdog, armed until it is done), pins its buffers, which MPI
// uses after the call returns, and starts it with call in a free request
// slot (count bytes per rank; moved is the bytes it sends and receives,
// for Stats).
func (c *mpiComm) start(ctx context.Context, a *args, send, recv []byte, count int, moved int64,
	call func(h handle, s cstate, i int, send, recv unsafe.Pointer, count int) error) (comm.Request, error) {
	a.started = true
	armed, err := c.begin(ctx, a)
	if err != nil {
		return nil, err
	}
	i := 0
	for c.reqs[i].active {
		i++ // begin made sure that a slot is free
	}
	r := &c.reqs[i]
	r.c, r.slot, r.kind, r.moved, r.err = c, i, a.kind, moved, nil
	if c.inFlight == 0 {
		c.group = armed
	}
	if count == 0 {
		return r, r.finish(nil)
	}
	r.pin.Pin(unsafe.SliceData(send))
	r.pin.Pin(unsafe.SliceData(recv))
	if err := call(c.h, c.st, i, ptr(send), ptr(recv), count); err != nil {
		return nil, r.finish(err)
	}
	r.active = true
	c.inFlight++
	return r, nil
}

// startTiny starts a tiny all-gather (StartAllGatherBytes): the agreement
// that carries its payload, encoded as the blocking call's (no data
// collective follows, so the two are the same MPI operation), in request
// slot 0; Test and Wait finish it (tinyDone). The watchdog guards it from
// here, as it guards a blocking call's agreement.
func (c *mpiComm) startTiny(ctx context.Context, a *args, send, recv []byte, moved int64) (comm.Request, error) {
	a.payload = send
	armed, _, err := c.open(ctx, a) // no other collective in flight: a is not started
	if err != nil {
		return nil, err
	}
	r := &c.reqs[0]
	r.c, r.slot, r.kind, r.moved, r.err = c, 0, a.kind, moved, nil
	r.tiny, r.targs, r.recv = true, *a, recv
	c.group, c.agreeing = armed, true
	r.active = true
	c.inFlight++
	return r, nil
}

// tinyDone finishes a started tiny all-gather whose agreement is done, or
// failed with err: the arguments checked, the payloads copied out. A
// mismatch or another rank's invalid arguments (a rank with invalid ones
// runs the blocking exchange and returns its own error) leave the
// communicator usable.
func (r *request) tinyDone(err error) error {
	c, a, recv := r.c, r.targs, r.recv
	r.tiny, c.agreeing = false, false
	r.targs, r.recv = args{}, nil // the caller's buffers are its own again
	if err == nil {
		if err := c.agreed(&a); err != nil {
			c.wd.disarm(r.settle())
			r.err = err
			return err
		}
		payloads(c.agree, recv, len(a.payload))
	}
	return r.finish(err)
}

// request is the comm.Request of a started collective, in one of a
// communicator's slots, reused by later starts once it is done.
type request struct {
	c      *mpiComm
	slot   int // its MPI request in the communicator's C state
	kind   comm.Collective
	moved  int64 // bytes sent, and received, for Stats
	active bool  // started and not yet seen done
	err    error // the collective's error, once done
	pin    runtime.Pinner
	tiny   bool   // a started tiny all-gather, until done (startTiny)
	targs  args   // its arguments
	recv   []byte // its receive buffer
}

// Test progresses the collectives in flight (MPI_Test) and reports
// whether this one is done.
func (r *request) Test() (bool, error) {
	if !r.active {
		return true, r.err
	}
	if r.tiny {
		done, err := cAgreeTest(r.c.st, false)
		if !done && err == nil {
			return false, nil
		}
		return true, r.tinyDone(err)
	}
	done, err := cDataTest(r.c.st, r.slot)
	if !done && err == nil {
		return false, nil
	}
	return true, r.finish(err)
}

// Wait waits for the collective (MPI_Wait).
func (r *request) Wait() error {
	if !r.active {
		return r.err
	}
	if r.tiny {
		return r.tinyDone(r.c.agreeWait(r.kind))
	}
	return r.finish(cDataWait(r.c.st, r.slot))
}

// finish ends a started collective that is done, or failed to start, with
// the error of its MPI call: its buffers unpinned, the watchdog disarmed
// if it was the last in flight, the traffic counted or the communicator
// broken.
func (r *request) finish(err error) error {
	c := r.c
	r.err = c.end(r.kind, r.settle(), err)
	if r.err == nil {
		c.stats.Add(r.kind, r.moved, r.moved)
	}
	return r.err
}

// settle takes r out of the collectives in flight and unpins its buffers;
// it returns the watchdog's guard of those in flight if r was the last.
func (r *request) settle() guard {
	c := r.c
	if r.active {
		r.active = false
		c.inFlight--
	}
	r.pin.Unpin()
	g := unguarded
	if c.inFlight == 0 {
		g, c.group = c.group, unguarded
	}
	return g
}
