package mpi

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
)

// alsoMax is the most collectives also may add to one guard: at least the
// started collectives a communicator may have in flight at once (capi.go
// checks).
const alsoMax = 16

// abortCode is the error code the watchdog passes to MPI_Abort; mpirun
// exits with it.
const abortCode = 3

// watch is the call a watchdog guards.
type watch struct {
	ctx  context.Context
	kind comm.Collective
	seq  int64 // the call's number on its communicator, from 1
	// since is when the call was armed, where it was guarded byTimeout
	// before (see also); zero: when the watchdog receives it.
	since time.Time
}

// The phases of a guarded call, which tell what the watchdog can know
// about the ranks that did not arrive.
const (
	// phaseAgree: in the argument agreement, which every rank enters
	// first; the ranks waiting in it answer a roll call.
	phaseAgree int32 = iota
	// phaseData: past the agreement, so every rank reached the call.
	phaseData
	// phaseUnchecked: the call skips the agreement (SkipChecks).
	phaseUnchecked
)

// answer is one rank's reply to a roll call.
type answer struct {
	ok   bool            // the rank answered
	seq  int64           // the call it is waiting in
	kind comm.Collective // and that call's kind
}

// roller runs roll calls: it asks the other ranks of the communicator
// which call they are waiting in. The ranks waiting in an argument
// agreement answer; the others cannot.
type roller interface {
	// ask asks every other rank, without blocking.
	ask(seq int64) error
	// collect records in got (indexed by rank of the communicator) the
	// answers to ask(seq) received so far, without blocking.
	collect(seq int64, got []answer) error
}

// The roll call waits up to rollCallWait for the answers, polling every
// rollCallPoll. A rank waiting in an agreement answers within about
// maxNap (see agreeWait), so the wait is generous.
const (
	rollCallWait = time.Second
	rollCallPoll = 10 * time.Millisecond
)

// guard is how arm guards a call, for disarm.
type guard uint8

const (
	// unguarded: the call's context can never end and there is no
	// collective timeout.
	unguarded guard = iota
	// byTimeout: the context can never end; the collective timeout
	// guards the call through atomics, which the watchdog checks every
	// tick, so arming costs no more than a few atomic stores.
	byTimeout
	// byContext: the context guards the call through the channels, and
	// the collective timeout, if shorter, too.
	byContext
)

// watchdog aborts the job when a context ends, or the collective timeout
// passes, while a collective is in flight, since MPI cannot cancel one. One
// long-lived goroutine per communicator serves every call, so guarding a
// call allocates nothing.
type watchdog struct {
	armc     chan watch
	alsoc    chan watch // see also; buffered, drained when a guard ends
	disarmc  chan struct{}
	quit     chan struct{}
	inflight atomic.Bool
	phase    atomic.Int32 // of the call in flight

	// A call guarded byTimeout: its number while in flight, its negation
	// once the watchdog took it over (then disarm must send on disarmc),
	// else 0; its kind, and when it was armed, since epoch.
	lazy      atomic.Int64
	lazyKind  atomic.Int64
	lazyStart atomic.Int64
	epoch     time.Time

	timeout time.Duration
	rank    int              // this process's rank in MPI_COMM_WORLD, named in messages
	ranks   []int            // the world rank of each rank of the communicator
	self    int              // this rank in the communicator
	peers   roller           // nil: no roll call
	abort   func(msg string) // prints msg and ends the job; need not return
}

// newWatchdog starts the watchdog of the rank self of a communicator whose
// ranks are, in MPI_COMM_WORLD, ranks (self's world rank is ranks[self]).
func newWatchdog(ranks []int, self int, timeout time.Duration, peers roller, abort func(msg string)) *watchdog {
	w := &watchdog{
		armc:    make(chan watch),
		alsoc:   make(chan watch, alsoMax),
		disarmc: make(chan struct{}),
		quit:    make(chan struct{}),
		epoch:   time.Now(),
		timeout: timeout,
		rank:    ranks[self],
		ranks:   ranks,
		self:    self,
		peers:   peers,
		abort:   abort,
	}
	go w.run()
	return w
}

// tickOf is how often the watchdog checks whether the call in flight has
// outlived the collective timeout: an eighth of the timeout, from 1ms to
// 1s, so that the call is aborted within the timeout and an eighth (or a
// second) more.
func tickOf(timeout time.Duration) time.Duration {
	return min(max(timeout/8, time.Millisecond), time.Second)
}

// arm starts guarding call seq of kind, in phase, with ctx and the
// collective timeout; the caller must pass the result to disarm.
func (w *watchdog) arm(ctx context.Context, kind comm.Collective, seq int64, phase int32) guard {
	if ctx.Done() == nil {
		if w.timeout <= 0 {
			return unguarded
		}
		w.phase.Store(phase)
		w.inflight.Store(true)
		w.lazyKind.Store(int64(kind))
		w.lazyStart.Store(int64(time.Since(w.epoch)))
		w.lazy.Store(seq) // last: the watchdog reads the others after it
		return byTimeout
	}
	w.phase.Store(phase)
	w.inflight.Store(true)
	w.armc <- watch{ctx: ctx, kind: kind, seq: seq}
	return byContext
}

// also guards, beside the call that g (arm's result) guards and until it
// is disarmed, a collective started while that call is in flight
// (comm.Starter: started collectives in flight at once share one guard)
// with a context that can end otherwise than the guarded call's, and
// returns the guard that disarm must then be given. Its context ending
// aborts the job as the guarded call's does: a guard byContext watches
// both from here (registering the context allocates: the caller adds
// only contexts it has not); a call guarded byTimeout is guarded
// byContext from here, its timeout counted from its own start, with ctx
// beside it; an unguarded one (no timeout) is guarded by ctx alone.
func (w *watchdog) also(ctx context.Context, kind comm.Collective, seq int64, phase int32, g guard) guard {
	switch g {
	case unguarded:
		return w.arm(ctx, kind, seq, phase)
	case byTimeout:
		s := w.lazy.Load()
		if s <= 0 || !w.lazy.CompareAndSwap(s, 0) {
			// The watchdog has taken the call over: its timeout
			// passed, and the job ends.
			return g
		}
		// The same call, now guarded byContext, and ctx beside it.
		w.armc <- watch{
			ctx:   context.Background(),
			kind:  comm.Collective(w.lazyKind.Load()),
			seq:   s,
			since: w.epoch.Add(time.Duration(w.lazyStart.Load())),
		}
		g = byContext
	}
	w.alsoc <- watch{ctx: ctx, kind: kind, seq: seq}
	return g
}

// disarm ends the guard arm started, once the call has returned.
func (w *watchdog) disarm(g guard) {
	switch g {
	case byTimeout:
		w.inflight.Store(false)
		if seq := w.lazy.Load(); seq > 0 && w.lazy.CompareAndSwap(seq, 0) {
			return
		}
		// The watchdog has taken the call over and waits for this; the
		// next call may be armed as soon as it has it.
		w.lazy.Store(0)
		w.disarmc <- struct{}{}
	case byContext:
		w.inflight.Store(false)
		w.disarmc <- struct{}{}
	}
}

// stop ends the watchdog's goroutine. No call may be armed.
func (w *watchdog) stop() { close(w.quit) }

func (w *watchdog) run() {
	var tick <-chan time.Time
	if w.timeout > 0 {
		t := time.NewTicker(tickOf(w.timeout))
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case a := <-w.armc:
			w.guard(a, tick)
		case <-tick:
			w.checkLazy()
		case <-w.quit:
			return
		}
	}
}

// guard watches call a, guarded byContext, and the collectives that also
// added, until it is disarmed.
func (w *watchdog) guard(a watch, tick <-chan time.Time) {
	start := a.since
	if start.IsZero() {
		start = time.Now()
	}
	var (
		ended chan watch // the added collectives whose context ended; nil (never ready) until one is added
		stops []func() bool
	)
	defer func() {
		for _, stop := range stops {
			stop()
		}
		// Every collective added to this guard was sent before the
		// disarm that ended it: none is left for the next.
		for len(w.alsoc) > 0 {
			<-w.alsoc
		}
	}()
	for {
		select {
		case <-a.ctx.Done():
			w.expired(a, start, a.ctx.Err().Error())
			return
		case x := <-w.alsoc:
			if ended == nil {
				ended = make(chan watch, 1)
			}
			// The callback takes a copy: capturing ended itself would move
			// it to the heap on every guard, also those that add nothing.
			e := ended // this guard's: a late callback's send is lost
			stops = append(stops, context.AfterFunc(x.ctx, func() {
				select {
				case e <- x:
				default: // one is enough
				}
			}))
		case x := <-ended:
			w.expired(x, start, x.ctx.Err().Error())
			return
		case <-tick:
			if time.Since(start) >= w.timeout {
				w.expired(a, start, w.timeoutCause())
				return
			}
		case <-w.disarmc:
			return
		}
	}
}

// checkLazy aborts the job if the call guarded byTimeout, if any, has
// been in flight for longer than the timeout.
func (w *watchdog) checkLazy() {
	seq := w.lazy.Load()
	if seq <= 0 {
		return
	}
	kind := comm.Collective(w.lazyKind.Load())
	start := w.epoch.Add(time.Duration(w.lazyStart.Load()))
	if time.Since(start) < w.timeout || !w.lazy.CompareAndSwap(seq, -seq) {
		// Not yet, or the call returned (kind and start may then be a
		// later call's, but are not used).
		return
	}
	w.expired(watch{ctx: context.Background(), kind: kind, seq: seq}, start, w.timeoutCause())
}

func (w *watchdog) timeoutCause() string {
	return fmt.Sprintf("collective timeout of %v (mpi.WithCollectiveTimeout) exceeded", w.timeout)
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

// expired handles a context that ended, or a timeout that passed, while
// call a, armed at start, was in flight: it finds out which ranks had not
// reached the call and, after the rank's stagger, aborts the job unless the
// call has returned by then. It returns once the call is disarmed.
func (w *watchdog) expired(a watch, start time.Time, cause string) {
	waited := time.Since(start)
	who, returned := w.rollCall(a)
	if returned {
		return // the call returned during the roll call: no reason to abort
	}
	t := time.NewTimer(min(time.Duration(w.rank)*abortStagger, maxStagger))
	defer t.Stop()
	select {
	case <-t.C:
	case <-w.disarmc:
		return // the call returned during the stagger: no reason to abort
	}
	// A context ending just after the call returned is no reason to abort.
	if w.inflight.Load() {
		w.abort(abortMessage(w.rank, a, cause, waited, len(w.ranks), who))
	}
	<-w.disarmc
}

// rollCall says which ranks had reached call a, asking them if the call is
// still in its argument agreement. returned reports that the call was
// disarmed meanwhile.
func (w *watchdog) rollCall(a watch) (who string, returned bool) {
	switch {
	case len(w.ranks) == 1:
		return "this rank is the communicator's only one", false
	case w.phase.Load() == phaseData:
		return "every rank had reached it (its argument agreement completed), so a rank stalled or died inside it", false
	case w.phase.Load() == phaseUnchecked:
		return "which ranks had reached it is unknown: it skipped the argument agreement (comm.SkipChecks)", false
	case w.peers == nil:
		return "which ranks had reached it is unknown", false
	}
	if err := w.peers.ask(a.seq); err != nil {
		return fmt.Sprintf("which ranks had reached it is unknown: the roll call failed: %v", err), false
	}
	got := make([]answer, len(w.ranks))
	got[w.self] = answer{ok: true, seq: a.seq, kind: a.kind}
	deadline := time.NewTimer(rollCallWait)
	defer deadline.Stop()
	tick := time.NewTicker(rollCallPoll)
	defer tick.Stop()
	var err error
poll:
	for {
		select {
		case <-w.disarmc:
			return "", true
		case <-deadline.C:
			break poll
		case <-tick.C:
			if err = w.peers.collect(a.seq, got); err != nil {
				break poll
			}
			if answered(got) == len(got) {
				break poll
			}
		}
	}
	return w.roster(a, got, err), false
}

func answered(got []answer) int {
	n := 0
	for _, g := range got {
		if g.ok {
			n++
		}
	}
	return n
}

// roster describes the answers to the roll call for call a: the ranks that
// did not answer had not reached it.
func (w *watchdog) roster(a watch, got []answer, err error) string {
	var missing, waiting []int
	var elsewhere []string
	for j, g := range got {
		r := w.ranks[j]
		switch {
		case !g.ok:
			missing = append(missing, r)
		case g.seq == a.seq:
			waiting = append(waiting, r)
		default:
			elsewhere = append(elsewhere, fmt.Sprintf("rank %d is waiting in %s #%d", r, g.kind, g.seq))
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "ranks that had not reached it: %v; ranks waiting in it: %v", missing, waiting)
	if len(elsewhere) > 0 {
		fmt.Fprintf(&b, "; %s", strings.Join(elsewhere, "; "))
	}
	if err != nil {
		fmt.Fprintf(&b, " (the roll call failed, so some of those may have: %v)", err)
	}
	return b.String()
}

// abortMessage is the line a rank prints before it aborts the job of size
// ranks because of cause, after waiting waited in call a; who says which
// ranks had reached the call.
func abortMessage(rank int, a watch, cause string, waited time.Duration, size int, who string) string {
	return fmt.Sprintf("lowbit/mpi: rank %d: %s during %s; aborting the MPI job because MPI cannot cancel a collective: "+
		"rank %d waited %v in %s #%d of its communicator of %d ranks; %s",
		rank, cause, a.kind, rank, waited.Round(time.Millisecond), a.kind, a.seq, size, who)
}
