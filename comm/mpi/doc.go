// Package mpi is the Open MPI backend of comm: each process started by
// mpirun is one rank, and collectives run as MPI collectives through a thin
// cgo layer over Open MPI 4.1.
//
// The implementation is behind the build tag mpi, so that the module builds
// and tests without MPI headers:
//
//	go build -tags mpi ./...   # needs libopenmpi-dev and pkg-config
//
// Built reports which build a binary has. Without the tag, Open returns
// ErrNotBuilt.
//
// # Opening
//
// Open initializes MPI on its first call (MPI_Init_thread, asking for
// MPI_THREAD_MULTIPLE and accepting no less than MPI_THREAD_SERIALIZED; with
// SERIALIZED, the package serializes its own MPI calls with a lock, and
// collectives of different communicators must then not overlap in time).
// Goroutines are not locked to OS threads. Every call of Open returns a new
// communicator over all ranks (a duplicate of MPI_COMM_WORLD, so its traffic
// never mixes with other MPI users of the process) and must be made by every
// rank. Closing the last communicator Open returned finalizes MPI; MPI cannot
// be initialized twice, so Open fails after that. A binary started without
// mpirun is a valid job of one rank.
//
// MPI state is process-wide by nature: it is the one piece of global state
// in this package.
//
// Every communicator has MPI_ERRORS_RETURN set: an MPI error becomes a Go
// error (*Error, carrying MPI's error string), and the communicator is broken
// afterwards (later calls return errors wrapping comm.ErrAborted).
//
// # Argument agreement
//
// Before each collective, the ranks agree on its arguments with one tiny
// MPI_Iallreduce of a few integers (the collective's kind, buffer lengths,
// operator and root, and whether each rank's arguments are valid). The data
// collective runs only when all agree; otherwise every rank returns an error
// (a *comm.MismatchError naming the first rank that differs from rank 0 and
// both values, or the invalid-argument error of the rank that made it), and
// the communicator stays usable. Ranks never hang or truncate on a mismatch.
// The agreement is not counted in Stats.
//
// An all-gather of at most 16 bytes per rank, in a group of at most 64
// ranks, needs no collective of its own: every agreement vector has a slot
// of 16 bytes per rank, zero but where a rank in such an all-gather writes
// its send buffer, and the reduction that agrees on the arguments hands
// every rank every rank's bytes. Its cost is the agreement's alone: one
// round trip where the call would take two. (onebit's header, 8 bytes per
// rank, is one: a 4 KiB 1-bit allreduce on 4 ranks sharing 2 cores took
// 17-21 us at p50 where it took 25-46 us, in 6 interleaved runs.)
//
// The agreement is where a rank waits for late peers, and past the skew of
// ranks arriving together it waits without keeping a core busy: it polls
// the MPI_Iallreduce with MPI_Test, for the first 20 milliseconds without
// pause, then with naps of a sixteenth of the
// time waited so far (at most 10ms), so that it wakes within a sixteenth of
// its wait. A blocking MPI call, by contrast, spins in Open MPI's progress
// loop at full speed for as long as it waits (Open MPI's mpi_yield_when_idle
// only adds sched_yield to that loop: the core stays busy). The data
// collectives themselves are blocking MPI calls, which run once every rank
// has arrived; a call under comm.SkipChecks has no agreement, so it waits
// for late peers in the data collective.
//
// # Started collectives
//
// A communicator is a comm.Starter: StartAllToAllBytes and
// StartAllGatherBytes agree on their arguments like the blocking calls,
// then start MPI_Ialltoall or MPI_Iallgather (Open MPI's libnbc) on buffers
// pinned until the collective is done (runtime.Pinner: MPI keeps their
// addresses after the call returns) and return its Request. Open MPI's TCP
// transport moves the data only inside MPI calls, so the caller calls Test
// (MPI_Test) between pieces of its work and Wait (MPI_Wait) at the end.
// Test does not yield the core when it finds nothing to do, as Open MPI's
// progress engine does under mpi_yield_when_idle (set where ranks
// outnumber cores): the caller is working between its tests, not waiting,
// and a yield there handed its core to another rank in the middle of its
// pass (4 ranks on 2 cores, 64 MiB at 10 Gbit: 26.7-31.3 ms against
// 27.6-32.0 ms with the yield, faster in 6 of 6 interleaved runs). Wait
// and the argument agreement keep it. Up
// to 16 started collectives may be in flight on a communicator; every
// blocking call, Close included, is refused until they are done. MPI's
// non-blocking collectives do not match blocking ones, so every rank must
// start the same collective: the argument agreement includes it (a rank
// that calls the blocking variant is a mismatch on every rank), and onebit,
// which skips the agreement, agrees on it in its header. The watchdog
// guards the collectives in flight at once together, from the first start
// to the end of the last: the context of every one of them counts (one
// that ends aborts the job, as below), and the collective timeout counts
// from the first start.
//
// A tiny all-gather (see above) started is its argument agreement started:
// the MPI_Iallreduce that carries its payload travels while the caller
// works, and Test and Wait finish it (Test without the yield, as for the
// data collectives). It is the same exchange as the blocking call, so
// ranks may mix the two; a mismatch is an error from Wait, and the
// communicator stays usable. No other collective may be in flight with it.
// onebit starts its header so, during its first pass: on 4 ranks sharing 2
// cores, 64 MiB at 10 Gbit, the header then ended 0-1.8 ms after the
// last rank's first pass, where it ended 3.7-4.5 ms after it exchanged
// blocking at that point.
//
// # Contexts and aborts
//
// MPI cannot cancel a collective. A context that is already done when a call
// starts makes it return an error wrapping ctx.Err() and comm.ErrAborted,
// without communicating; the communicator is broken afterwards, like every
// comm backend after a cancellation. A context that ends while a collective
// is in flight aborts the whole MPI job, and so does a collective that is
// still in flight after the collective timeout, with any context: 30
// minutes by default (DefaultCollectiveTimeout, the default of PyTorch's
// Gloo process groups), set with WithCollectiveTimeout, and off with a
// timeout of 0. Whichever of the context's deadline and the timeout comes
// first ends the wait. The timeout is what ends a job in which a rank will
// never reach a collective that its peers wait in (a rank that ran one
// training step fewer and went on to close, or hangs elsewhere) when the
// calls have no deadline.
//
// A watchdog goroutine (one per communicator, fed through channels for a
// context that can end and through atomics otherwise, so a call allocates
// nothing) then finds out which ranks had reached the collective: in its
// argument agreement, it asks every other rank, on a duplicate of the
// communicator, and the ranks waiting in the agreement answer within
// milliseconds; the ranks that have not answered within a second had not
// reached it. It prints, on stderr, for example
//
//	lowbit/mpi: rank 0: collective timeout of 2s (mpi.WithCollectiveTimeout) exceeded during allreduce; aborting the MPI job because MPI cannot cancel a collective: rank 0 waited 2.001s in allreduce #3 of its communicator of 3 ranks; ranks that had not reached it: [2]; ranks waiting in it: [0 1]
//
// or, for a context, "context deadline exceeded during allreduce; ...". The
// number after the collective counts the collectives this rank started on
// the communicator; ranks are those of MPI_COMM_WORLD. A collective past its
// agreement was reached by every rank ("every rank had reached it"); one
// under comm.SkipChecks has no agreement, and then which ranks had reached
// it is unknown. The watchdog then ends the job with status 3: under Open
// MPI's mpirun by exiting without finalizing, which makes mpirun kill every
// rank (MPI_Abort after a peer has finalized can leave Open MPI 4.1's
// mpirun hanging), elsewhere by MPI_Abort(MPI_COMM_WORLD, 3).
//
// Closing a communicator leaves the duplicate allocated until MPI is
// finalized: a peer's question can arrive at any time, and Open MPI
// delivers a message for a freed communicator to the next one that reuses
// its context id.
//
// # Reductions
//
// By default AllReduce is MPI_Allreduce and ReduceScatter is
// MPI_Reduce_scatter_block (Mean is MPI_SUM followed by a division by the
// group size, made in C right after the MPI call, four floats at a time,
// rounding as Go's float32 division does), so their summation order is Open MPI's choice: results are
// identical on every rank, but on three or more ranks may differ in the last
// bits from comm/local's. WithOrderedReduce builds both on MPI_Alltoallv /
// MPI_Alltoall and MPI_Allgatherv instead and sums in ascending rank order,
// exactly as comm/local does, so results are bit-identical to comm/local's;
// the bytes on the wire are the same (2(W-1)/W of the buffer for AllReduce),
// at the cost of one scratch buffer the size of the largest buffer reduced.
//
// Buffers are passed to MPI directly, without copies; a call allocates
// nothing once the communicator's buffers have grown. Stats counts bytes
// exactly as comm.Stats documents, the same numbers comm/local reports for
// the same calls.
package mpi

import (
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
)

// ErrNotBuilt is returned by Open in a binary built without the mpi build
// tag.
var ErrNotBuilt = errors.New("lowbit was built without MPI support: rebuild with `go build -tags mpi` (needs libopenmpi-dev and pkg-config)")

// Error is an error code returned by an MPI function.
type Error struct {
	Func string // the MPI function, such as "MPI_Allreduce"
	Code int    // the MPI error code
	Msg  string // MPI_Error_string of Code
}

// Error names the MPI function, its message and its code.
func (e *Error) Error() string {
	return fmt.Sprintf("%s failed: %s (MPI error code %d)", e.Func, e.Msg, e.Code)
}

// Option configures Open.
type Option func(*options)

type options struct {
	log     *zap.Logger
	ordered bool
	timeout time.Duration // collective timeout; 0: none
}

func newOptions(opts []Option) options {
	o := options{log: zap.NewNop(), timeout: DefaultCollectiveTimeout}
	for _, f := range opts {
		if f != nil {
			f(&o)
		}
	}
	return o
}

// WithLogger sets the logger for opening, splitting, closing and aborts.
// The default, and a nil logger, is zap.NewNop().
func WithLogger(l *zap.Logger) Option {
	return func(o *options) {
		if l == nil {
			l = zap.NewNop()
		}
		o.log = l
	}
}

// WithOrderedReduce makes AllReduce and ReduceScatter sum in ascending rank
// order, bit-identical to comm/local, instead of using MPI's own reduction
// (see the package documentation). Communicators split from this one
// inherit the setting.
func WithOrderedReduce() Option {
	return func(o *options) { o.ordered = true }
}

// DefaultCollectiveTimeout is how long a collective may wait before the
// job is aborted when Open is not given WithCollectiveTimeout: 30 minutes,
// the default of PyTorch's CPU process groups (Gloo). It only has to end a
// job whose ranks will never meet again, so it is far longer than any real
// collective, including one that waits while a peer loads or saves a large
// checkpoint.
const DefaultCollectiveTimeout = 30 * time.Minute

// WithCollectiveTimeout sets how long any one collective may wait, with the
// caller's context or without one, before this rank aborts the whole MPI
// job, naming the collective and the ranks that had not reached it (see
// the package documentation). A context with an earlier deadline still
// ends the wait first. d <= 0 turns the timeout off: a collective under a
// context that can never end (context.Background) then waits forever for
// a rank that never arrives. The default is DefaultCollectiveTimeout.
// Communicators split from this one inherit the setting.
func WithCollectiveTimeout(d time.Duration) Option {
	return func(o *options) { o.timeout = max(d, 0) }
}
