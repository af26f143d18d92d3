//go:build mpi

package mpi

// The frame of every collective of a communicator (mpi.go): the checks
// before a call, the watchdog armed for it, the agreement of every rank on
// its arguments (args.go) and the roll calls of a watchdog that fired.

import (
	"context"
	"fmt"
	"time"
	"unsafe"

	"github.com/lowbit-ml/lowbit/comm"
	"go.uber.org/zap"
)

// begin checks the communicator and ctx, arms the watchdog and agrees on
// the call's arguments with every rank. On success the caller runs the
// data collective and then calls end with armed.
func (c *mpiComm) begin(ctx context.Context, a *args) (armed guard, err error) {
	armed, agreeing, err := c.open(ctx, a)
	if err != nil || !agreeing {
		return armed, err
	}
	if err := c.agreeWait(a.kind); err != nil {
		c.wd.disarm(armed)
		return unguarded, c.fail(a.kind, err)
	}
	if err := c.agreed(a); err != nil {
		c.wd.disarm(armed)
		return unguarded, err
	}
	return armed, nil
}

// open is begin up to the agreement: it checks the communicator and ctx,
// arms the watchdog and starts the agreement on a's arguments (agreeing),
// unless the caller promised agreeing arguments (SkipChecks).
func (c *mpiComm) open(ctx context.Context, a *args) (armed guard, agreeing bool, err error) {
	if err := c.usable(a.kind); err != nil {
		return unguarded, false, err
	}
	switch {
	case !a.started:
		if err := c.idle(a.kind); err != nil {
			return unguarded, false, err
		}
	case c.agreeing:
		return unguarded, false, fmt.Errorf("mpi: %s: a started tiny all-gather is in flight (finish it with its Request first)", a.kind)
	case c.inFlight == maxStarted:
		return unguarded, false, fmt.Errorf("mpi: %s: %d started collectives are in flight already, the most there may be", a.kind, maxStarted)
	}
	if ctx == nil {
		ctx = context.Background() // the comm package's rule for a nil context
	}
	if err := ctx.Err(); err != nil {
		return unguarded, false, c.giveUp(a.kind, err)
	}
	c.seq++
	if c.skip > 0 {
		armed = c.arm(ctx, a, phaseUnchecked)
		// The caller promised agreeing arguments (SkipChecks): every rank
		// computes the same validity, so a local error is every rank's.
		// No agreement carries a tiny all-gather's payload.
		c.skip--
		a.payload = nil
		if a.invalid != nil {
			c.skip = 0
			c.wd.disarm(armed)
			return unguarded, false, a.invalid
		}
		return armed, false, nil
	}
	armed = c.arm(ctx, a, phaseAgree)
	a.encode(c.agree, c.rank, c.size)
	if err := cAgreeStart(c.h, c.st, len(c.agree)); err != nil {
		c.wd.disarm(armed)
		return unguarded, false, c.fail(a.kind, err)
	}
	return armed, true, nil
}

// agreed reads the agreement every rank has reached on a's arguments: nil,
// or the error of a rank's invalid arguments or of a mismatch (after which
// the communicator stays usable).
func (c *mpiComm) agreed(a *args) error {
	c.wd.phase.Store(phaseData) // every rank has reached the call
	agree, invalid := decode(c.agree)
	switch {
	case invalid < c.size && a.invalid != nil:
		return a.invalid
	case invalid < c.size:
		return invalidError(a.kind, invalid)
	case !agree:
		return c.mismatch(a)
	}
	return nil
}

// arm arms the watchdog for call a, in phase, and returns its guard. The
// first of the started collectives in flight at once guards them all,
// until the last is done (the watchdog guards one call at a time); the
// others' contexts join its guard (watchdog.also) where they can end
// otherwise than its own.
func (c *mpiComm) arm(ctx context.Context, a *args, phase int32) guard {
	if a.started && c.inFlight > 0 {
		c.wd.phase.Store(phase) // the watchdog's messages tell of the newest
		if d := ctx.Done(); d != nil && d != c.groupDone && d != c.alsoDone {
			if c.group == byContext {
				c.alsoDone = d
			} else {
				c.groupDone = d // the guard's context from here
			}
			c.group = c.wd.also(ctx, a.kind, c.seq, phase, c.group)
		}
		return unguarded
	}
	c.groupDone, c.alsoDone = ctx.Done(), nil
	return c.wd.arm(ctx, a.kind, c.seq, phase)
}

// The agreement is non-blocking, polled: for spinFor with MPI_Test alone,
// then with naps of a 16th of the time waited so far, up to maxNap, between
// tests, so that a rank waiting for a late peer does not keep a core busy
// as a blocking MPI collective does, and wakes within a 16th of its wait.
// spinFor covers the skew of ranks arriving at a collective a few
// milliseconds apart: Open MPI's TCP transport progresses the agreement's
// MPI_Iallreduce only inside MPI calls, so a rank napping through those
// milliseconds held back the others (with 1 ms, the header of a 64 MiB
// 1-bit call on 4 ranks over 1 Gbit ended 5-10 ms into the call).
const (
	spinFor = 20 * time.Millisecond
	maxNap  = 10 * time.Millisecond
)

// agreeWait waits for the agreement in flight, the MPI_MAX allreduce of
// the agreement vector. While it waits for late ranks, it answers the roll
// calls of ranks whose watchdog fired.
func (c *mpiComm) agreeWait(kind comm.Collective) error {
	var start time.Time
	for {
		done, err := cAgreeTest(c.st, true)
		if done || err != nil {
			return err
		}
		if start.IsZero() {
			start = time.Now()
			continue
		}
		waited := time.Since(start)
		if waited < spinFor {
			continue
		}
		if err := cAnswer(c.st, c.seq, int(kind)); err != nil {
			// The roll call is best effort: finish the agreement.
			c.opts.log.Warn("mpi: answering a roll call failed", zap.Int("rank", c.rank), zap.Error(err))
		}
		time.Sleep(min(waited/16, maxNap))
	}
}

// rollCaller runs the watchdog's roll calls on a communicator's state.
type rollCaller struct {
	st  cstate
	got []int64 // msgLen per rank
}

func (p *rollCaller) ask(seq int64) error {
	clear(p.got)
	return cAsk(p.st, seq)
}

func (p *rollCaller) collect(seq int64, got []answer) error {
	err := cCollect(p.st, seq, p.got)
	for j := range got {
		m := p.got[j*msgLen : (j+1)*msgLen]
		if m[0] == seq {
			got[j] = answer{ok: true, seq: m[1], kind: comm.Collective(m[2])}
		}
	}
	return err
}

// mismatch gathers every rank's arguments and returns the error every
// rank reports; the slow path of begin.
func (c *mpiComm) mismatch(a *args) error {
	mine := a.fields(c.rank, c.size)
	all := make([][nFields]int64, c.size)
	if err := cAllGather(c.h, unsafe.Pointer(&mine[0]), unsafe.Pointer(&all[0][0]), nFields, tInt64); err != nil {
		return c.fail(a.kind, err)
	}
	return mismatch(all)
}

// end disarms the watchdog and reports the data collective's error, which
// breaks the communicator.
func (c *mpiComm) end(kind comm.Collective, armed guard, err error) error {
	c.wd.disarm(armed)
	if err != nil {
		return c.fail(kind, err)
	}
	return nil
}
