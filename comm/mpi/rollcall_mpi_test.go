//go:build mpi

package mpi

import (
	"context"
	"fmt"
	"regexp"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
)

// cpuTime returns the CPU time this process has used.
func cpuTime(t *testing.T) time.Duration {
	var ru syscall.Rusage
	require.NoError(t, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// The last rank enters a barrier 2.5 s late; the others' 200ms collective
// timeout fires meanwhile, and their roll call must name the last rank as
// the one that had not reached it (the job's end is replaced by a
// recorder, so the barrier then completes). While they wait, they must not
// keep a core busy.
func TestCollectiveTimeoutRollCall(t *testing.T) {
	c, err := Open(WithCollectiveTimeout(200 * time.Millisecond))
	require.NoError(t, err)
	defer c.Close()
	m := c.(*mpiComm)
	if m.size < 2 {
		t.Skip("needs at least 2 ranks")
	}
	fired := make(chan string, 1)
	m.wd.abort = func(msg string) { fired <- msg } // before any call, so before the watchdog reads it
	last := m.size - 1
	if m.rank == last {
		time.Sleep(2500 * time.Millisecond)
	}
	cpu0, wall0 := cpuTime(t), time.Now()
	require.NoError(t, c.Barrier(context.Background()))
	cpu, wall := cpuTime(t)-cpu0, time.Since(wall0)

	if m.rank == last {
		select {
		case msg := <-fired:
			t.Fatalf("the last rank aborted: %s", msg)
		default:
		}
		return
	}
	var msg string
	select {
	case msg = <-fired:
	default:
		t.Fatal("no abort while the last rank was late")
	}
	waiting := make([]int, last)
	for r := range waiting {
		waiting[r] = r
	}
	assert.Regexp(t, fmt.Sprintf(`^lowbit/mpi: rank %d: collective timeout of 200ms \(mpi.WithCollectiveTimeout\) exceeded during barrier; `+
		`aborting the MPI job because MPI cannot cancel a collective: rank %d waited [0-9.]+m?s in barrier #1 of its communicator of %d ranks; `+
		`ranks that had not reached it: \[%d\]; ranks waiting in it: %s$`,
		m.rank, m.rank, m.size, last, regexp.QuoteMeta(fmt.Sprint(waiting))), msg)
	assert.Greater(t, wall, 2*time.Second)
	// A blocking MPI collective spins a core for the whole wait.
	assert.Less(t, cpu, wall/4, "CPU time used while waiting %v for the last rank", wall)
	t.Logf("rank %d: waited %v for the last rank, using %v of CPU; abort message: %s", m.rank, wall, cpu, msg)
}

// A roll-call message can reach a rank after it closed the communicator:
// here rank 0 asks and closes, and only then does the last rank answer.
// The answer must not reach the communicators made afterwards (Open MPI
// delivers a message for a freed communicator to the next one that reuses
// its context id, and crashed when that one was smaller than the sender's
// rank).
func TestRollCallAfterClose(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	w, err := Open()
	require.NoError(t, err)
	defer w.Close()
	if w.Size() < 2 {
		t.Skip("needs at least 2 ranks")
	}
	c, err := Open()
	require.NoError(t, err)
	m := c.(*mpiComm)
	last := m.size - 1
	if m.rank == 0 {
		require.NoError(t, cAsk(m.st, 7))
	}
	if m.rank != last {
		require.NoError(t, c.Close())
	}
	require.NoError(t, w.Barrier(ctx))
	if m.rank == last {
		for range 10 {
			require.NoError(t, cAnswer(m.st, 7, int(comm.CBarrier)))
			time.Sleep(10 * time.Millisecond)
		}
		require.NoError(t, c.Close())
	}
	require.NoError(t, w.Barrier(ctx))
	for range 3 {
		s, err := w.Split(ctx, w.Rank(), 0) // one rank each
		require.NoError(t, err)
		require.NoError(t, s.Barrier(ctx))
		require.NoError(t, s.Close())
	}
	require.NoError(t, w.Barrier(ctx))
}
