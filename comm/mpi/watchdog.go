package mpi

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
)

// abortCode is the error code the watchdog passes to MPI_Abort; mpirun
// exits with it.
const abortCode = 3

// watch is the call a watchdog guards.
type watch struct {
	ctx  context.Context
	kind comm.Collective
}

// watchdog aborts the job when a context ends while a collective is in
// flight, since MPI cannot cancel one. One long-lived goroutine per
// communicator serves every call through unbuffered channels, so guarding a
// call allocates nothing.
type watchdog struct {
	armc     chan watch
	disarmc  chan struct{}
	quit     chan struct{}
	inflight atomic.Bool
	rank     int              // rank named in the message
	abort    func(msg string) // prints msg and ends the job; need not return
}

func newWatchdog(rank int, abort func(msg string)) *watchdog {
	w := &watchdog{
		armc:    make(chan watch),
		disarmc: make(chan struct{}),
		quit:    make(chan struct{}),
		rank:    rank,
		abort:   abort,
	}
	go w.run()
	return w
}

// arm starts guarding a call with ctx and reports whether the caller must
// disarm. A context that can never end needs no guard.
func (w *watchdog) arm(ctx context.Context, kind comm.Collective) bool {
	if ctx.Done() == nil {
		return false
	}
	w.inflight.Store(true)
	w.armc <- watch{ctx: ctx, kind: kind}
	return true
}

// disarm ends the guard arm started, once the call has returned.
func (w *watchdog) disarm(armed bool) {
	if !armed {
		return
	}
	w.inflight.Store(false)
	w.disarmc <- struct{}{}
}

// stop ends the watchdog's goroutine. No call may be armed.
func (w *watchdog) stop() { close(w.quit) }

func (w *watchdog) run() {
	for {
		select {
		case a := <-w.armc:
			select {
			case <-a.ctx.Done():
				w.expired(a)
			case <-w.disarmc:
			}
		case <-w.quit:
			return
		}
	}
}

// abortStagger is how long rank r waits, times r, after its context ended
// before it ends the job; maxStagger caps the wait. Ranks whose deadlines
// pass together would otherwise leave at the same moment, and Open MPI
// 4.1's mpirun can hang in its teardown when several ranks do so after a
// peer has finalized. Staggered, the first rank to leave normally ends the
// whole job.
const (
	abortStagger = 100 * time.Millisecond
	maxStagger   = 2 * time.Second
)

// expired handles a context that ended while call a was armed: after the
// rank's stagger, it aborts the job unless the call has returned by then.
// It returns once the call is disarmed.
func (w *watchdog) expired(a watch) {
	t := time.NewTimer(min(time.Duration(w.rank)*abortStagger, maxStagger))
	defer t.Stop()
	select {
	case <-t.C:
	case <-w.disarmc:
		return // the call returned during the stagger: no reason to abort
	}
	// A context ending just after the call returned is no reason to abort.
	if w.inflight.Load() {
		w.abort(abortMessage(w.rank, a))
	}
	<-w.disarmc
}

func abortMessage(rank int, a watch) string {
	return fmt.Sprintf("lowbit/mpi: rank %d: %v during %s; aborting the MPI job because MPI cannot cancel a collective",
		rank, a.ctx.Err(), a.kind)
}
