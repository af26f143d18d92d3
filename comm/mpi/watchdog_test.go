package mpi

import (
	"context"
	"errors"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
)

// unitOnly skips a test of the watchdog's own logic (fake peers, no MPI
// call) in an Open MPI job of more than one rank (OMPI_COMM_WORLD_SIZE):
// it runs in the plain build and on one rank, not again at every world
// size of scripts/test-mpi.sh.
func unitOnly(t *testing.T) {
	t.Helper()
	if n, _ := strconv.Atoi(os.Getenv("OMPI_COMM_WORLD_SIZE")); n > 1 {
		t.Skip("the watchdog's own logic: tested without MPI and on one rank")
	}
}

func TestCollectiveTimeoutOption(t *testing.T) {
	assert.Equal(t, 30*time.Minute, DefaultCollectiveTimeout)
	assert.Equal(t, DefaultCollectiveTimeout, newOptions(nil).timeout)
	for _, c := range []struct {
		set, want time.Duration
	}{
		{2 * time.Second, 2 * time.Second},
		{time.Nanosecond, time.Nanosecond},
		{0, 0},
		{-time.Second, 0},
	} {
		o := newOptions([]Option{WithLogger(nil), WithCollectiveTimeout(c.set), WithOrderedReduce()})
		assert.Equal(t, c.want, o.timeout, "WithCollectiveTimeout(%v)", c.set)
	}
	// The last option wins.
	o := newOptions([]Option{WithCollectiveTimeout(0), WithCollectiveTimeout(time.Minute)})
	assert.Equal(t, time.Minute, o.timeout)
}

// fakePeers answers roll calls as the ranks in answers would.
type fakePeers struct {
	answers map[int]answer // by rank; missing ranks never answer
	asked   atomic.Int64   // the call last asked about
	err     error
}

func (p *fakePeers) ask(seq int64) error {
	p.asked.Store(seq)
	return p.err
}

func (p *fakePeers) collect(seq int64, got []answer) error {
	for j, a := range p.answers {
		got[j] = a
	}
	return nil
}

// abortRecorder stands for the job's end: it records the messages.
type abortRecorder chan string

func (r abortRecorder) abort(msg string) { r <- msg }

// next returns the next abort message, failing after d.
func (r abortRecorder) next(t *testing.T, d time.Duration) string {
	t.Helper()
	select {
	case msg := <-r:
		return msg
	case <-time.After(d):
		t.Fatalf("no abort within %v", d)
		return ""
	}
}

func (r abortRecorder) none(t *testing.T) {
	t.Helper()
	select {
	case msg := <-r:
		t.Fatalf("unexpected abort: %s", msg)
	default:
	}
}

func TestWatchdog(t *testing.T) {
	unitOnly(t)
	fired := make(abortRecorder, 1)
	w := newWatchdog([]int{0, 1, 2, 3, 4, 5}, 5, 0, nil, fired.abort)
	defer w.stop()

	// Without a collective timeout, a context that can never end is not
	// watched.
	assert.Equal(t, unguarded, w.arm(context.Background(), comm.CAllReduce, 1, phaseAgree))

	// A call that returns before its context ends is not aborted.
	ctx, cancel := context.WithCancel(context.Background())
	armed := w.arm(ctx, comm.CAllReduce, 2, phaseAgree)
	require.NotEqual(t, unguarded, armed)
	w.disarm(armed)
	cancel()

	// A context that ends while the call is in flight aborts.
	ctx, cancel = context.WithCancel(context.Background())
	armed = w.arm(ctx, comm.CAllToAll, 3, phaseData)
	cancel()
	msg := fired.next(t, 5*time.Second)
	w.disarm(armed)
	assert.Regexp(t, "^"+regexp.QuoteMeta("lowbit/mpi: rank 5: context canceled during alltoall; aborting the MPI job because MPI cannot cancel a collective: rank 5 waited ")+
		"[0-9.]+[mµn]?s"+regexp.QuoteMeta(" in alltoall #3 of its communicator of 6 ranks; every rank had reached it (its argument agreement completed), so a rank stalled or died inside it")+"$", msg)
	fired.none(t)
}

func TestWatchdogTimeout(t *testing.T) {
	unitOnly(t)
	fired := make(abortRecorder, 1)
	// Rank 1 of a communicator of world ranks 4, 2, 7, 9: 2 answers the
	// roll call, 4 waits in another call, 9 does not answer.
	p := &fakePeers{answers: map[int]answer{
		0: {ok: true, seq: 6, kind: comm.CBarrier},
		2: {ok: true, seq: 7, kind: comm.CAllReduce},
	}}
	w := newWatchdog([]int{4, 2, 7, 9}, 1, 50*time.Millisecond, p, fired.abort)
	defer w.stop()

	// With a collective timeout, every call is watched, and one that
	// returns in time is not aborted.
	armed := w.arm(context.Background(), comm.CAllReduce, 6, phaseAgree)
	require.NotEqual(t, unguarded, armed)
	w.disarm(armed)
	fired.none(t)

	start := time.Now()
	armed = w.arm(context.Background(), comm.CAllReduce, 7, phaseAgree)
	require.NotEqual(t, unguarded, armed)
	msg := fired.next(t, 5*time.Second)
	w.disarm(armed)
	took := time.Since(start)
	assert.Equal(t, int64(7), p.asked.Load())
	assert.Regexp(t, "^"+regexp.QuoteMeta("lowbit/mpi: rank 2: collective timeout of 50ms (mpi.WithCollectiveTimeout) exceeded during allreduce; "+
		"aborting the MPI job because MPI cannot cancel a collective: rank 2 waited ")+"[0-9.]+m?s"+
		regexp.QuoteMeta(" in allreduce #7 of its communicator of 4 ranks; ranks that had not reached it: [9]; ranks waiting in it: [2 7]; rank 4 is waiting in barrier #6")+"$", msg)
	// The timeout, the roll call's wait for rank 9 and rank 2's stagger.
	assert.GreaterOrEqual(t, took, 50*time.Millisecond+rollCallWait)
	assert.Less(t, took, 50*time.Millisecond+rollCallWait+2*abortStagger+time.Second)
	fired.none(t)
}

func TestWatchdogTimeoutPhases(t *testing.T) {
	unitOnly(t)
	for _, c := range []struct {
		phase int32
		peers roller
		want  string
	}{
		{phaseData, &fakePeers{}, "every rank had reached it (its argument agreement completed), so a rank stalled or died inside it"},
		{phaseUnchecked, &fakePeers{}, "which ranks had reached it is unknown: it skipped the argument agreement (comm.SkipChecks)"},
		{phaseAgree, nil, "which ranks had reached it is unknown"},
		{phaseAgree, &fakePeers{err: errors.New("no")}, "which ranks had reached it is unknown: the roll call failed: no"},
	} {
		fired := make(abortRecorder, 1)
		w := newWatchdog([]int{0, 1}, 0, 20*time.Millisecond, c.peers, fired.abort)
		armed := w.arm(context.Background(), comm.CBroadcast, 1, c.phase)
		msg := fired.next(t, 5*time.Second)
		w.disarm(armed)
		w.stop()
		assert.Contains(t, msg, "during broadcast; aborting the MPI job")
		assert.True(t, strings.HasSuffix(msg, "; "+c.want), "%q does not end with %q", msg, c.want)
	}
}

// The shorter of the context's deadline and the collective timeout ends
// the wait.
func TestWatchdogShorterWins(t *testing.T) {
	unitOnly(t)
	fired := make(abortRecorder, 1)
	w := newWatchdog([]int{0, 1}, 0, time.Hour, &fakePeers{}, fired.abort)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	armed := w.arm(ctx, comm.CAllGather, 1, phaseData)
	assert.Contains(t, fired.next(t, 5*time.Second), "rank 0: context deadline exceeded during allgather")
	w.disarm(armed)
	w.stop()

	w = newWatchdog([]int{0, 1}, 0, 20*time.Millisecond, &fakePeers{}, fired.abort)
	defer w.stop()
	ctx, cancel = context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	armed = w.arm(ctx, comm.CAllGather, 1, phaseData)
	assert.Contains(t, fired.next(t, 5*time.Second), "rank 0: collective timeout of 20ms (mpi.WithCollectiveTimeout) exceeded during allgather")
	w.disarm(armed)
}

// A call that returns during the roll call is not aborted.
func TestWatchdogReturnsDuringRollCall(t *testing.T) {
	unitOnly(t)
	fired := make(abortRecorder, 1)
	p := &fakePeers{}
	w := newWatchdog([]int{0, 1}, 0, 10*time.Millisecond, p, fired.abort)
	defer w.stop()
	armed := w.arm(context.Background(), comm.CAllReduce, 3, phaseAgree)
	require.Eventually(t, func() bool { return p.asked.Load() == 3 }, 5*time.Second, time.Millisecond)
	w.disarm(armed)
	time.Sleep(rollCallWait + 100*time.Millisecond)
	fired.none(t)
	// The watchdog still serves calls.
	armed = w.arm(context.Background(), comm.CAllReduce, 4, phaseData)
	assert.Contains(t, fired.next(t, 5*time.Second), "allreduce #4")
	w.disarm(armed)
}

// Calls that return around the timeout, under both guards, with or
// without a collective's context added, either return unaborted or are
// aborted once, and the watchdog never blocks a call.
func TestWatchdogRace(t *testing.T) {
	unitOnly(t)
	var aborts atomic.Int64
	w := newWatchdog([]int{0, 1}, 0, 2*time.Millisecond, &fakePeers{}, func(string) { aborts.Add(1) })
	defer w.stop()
	deadline, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	other, cancelOther := context.WithTimeout(context.Background(), time.Hour)
	defer cancelOther()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 300 {
			ctx := context.Background()
			if i%3 == 0 {
				ctx = deadline
			}
			g := w.arm(ctx, comm.CAllReduce, int64(i+1), phaseData)
			if i%2 == 1 {
				// A collective started beside it, with a context of
				// its own.
				g = w.also(other, comm.CAllGather, int64(i+1), phaseUnchecked, g)
			}
			time.Sleep(time.Duration(i%5) * time.Millisecond)
			w.disarm(g)
		}
	}()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("arm or disarm blocked")
	}
	t.Logf("%d of 300 calls aborted", aborts.Load())
	assert.Equal(t, int64(0), w.lazy.Load())
}

// A collective started while another is in flight shares its guard
// (also): its context ending aborts the job as the first one's does,
// whatever guarded the first, and only while the group is in flight.
func TestWatchdogAlso(t *testing.T) {
	unitOnly(t)
	for _, c := range []struct {
		name    string
		timeout time.Duration
		first   func() context.Context
		want    guard // the first call's guard
	}{
		{"unguarded", 0, context.Background, unguarded},
		{"byTimeout", time.Hour, context.Background, byTimeout},
		{"byContext", 0, func() context.Context {
			ctx, cancel := context.WithCancel(context.Background())
			t.Cleanup(cancel)
			return ctx
		}, byContext},
	} {
		t.Run(c.name, func(t *testing.T) {
			fired := make(abortRecorder, 1)
			w := newWatchdog([]int{0, 1}, 1, c.timeout, &fakePeers{}, fired.abort)
			defer w.stop()

			// Added, then done with the group before its context ends:
			// no abort, now or in the next group.
			g := w.arm(c.first(), comm.CAllToAll, 1, phaseUnchecked)
			require.Equal(t, c.want, g)
			ctx, cancel := context.WithCancel(context.Background())
			g = w.also(ctx, comm.CAllGather, 2, phaseUnchecked, g)
			assert.Equal(t, byContext, g)
			w.disarm(g)
			cancel()
			g = w.arm(c.first(), comm.CAllToAll, 3, phaseUnchecked)
			time.Sleep(20 * time.Millisecond)
			fired.none(t)
			w.disarm(g)

			// Its context ending while the group is in flight aborts.
			g = w.arm(c.first(), comm.CAllToAll, 4, phaseUnchecked)
			ctx, cancel = context.WithCancel(context.Background())
			defer cancel()
			g = w.also(ctx, comm.CAllGather, 5, phaseUnchecked, g)
			cancel()
			msg := fired.next(t, 5*time.Second)
			w.disarm(g)
			assert.Contains(t, msg, "lowbit/mpi: rank 1: context canceled during allgather; aborting the MPI job")
			assert.Contains(t, msg, "in allgather #5 of its communicator of 2 ranks")
			fired.none(t)

			// The watchdog still serves calls.
			g = w.arm(context.Background(), comm.CAllReduce, 6, phaseData)
			w.disarm(g)
			fired.none(t)
		})
	}
}

// A call guarded byTimeout that a collective's context joins keeps its
// start: the timeout ends the group as it would have.
func TestWatchdogAlsoKeepsTimeout(t *testing.T) {
	unitOnly(t)
	fired := make(abortRecorder, 1)
	w := newWatchdog([]int{0, 1}, 0, 200*time.Millisecond, &fakePeers{}, fired.abort)
	defer w.stop()
	start := time.Now()
	g := w.arm(context.Background(), comm.CAllToAll, 1, phaseUnchecked)
	require.Equal(t, byTimeout, g)
	time.Sleep(150 * time.Millisecond)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	g = w.also(ctx, comm.CAllGather, 2, phaseUnchecked, g)
	require.Equal(t, byContext, g)
	msg := fired.next(t, 5*time.Second)
	w.disarm(g)
	assert.Contains(t, msg, "collective timeout of 200ms (mpi.WithCollectiveTimeout) exceeded during alltoall")
	// From the first call's start, not the join's (which would be 350 ms
	// at the earliest).
	assert.Less(t, time.Since(start), 340*time.Millisecond)
	assert.Equal(t, int64(0), w.lazy.Load())
}
