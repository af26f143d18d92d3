// Package comm defines what a communicator is: a group of ranks that run
// collectives together. Backends live in their own packages below this one
// (comm/local for in-process goroutine ranks, comm/mpi for Open MPI) and each
// returns a Comm. Algorithms built on collectives, such as the 1-bit
// compressed allreduce, take a Comm and never know which backend is under it.
//
// Every collective takes a context.Context. What a cancelled context or a
// passed deadline does depends on the backend, because not every transport
// can cancel a collective:
//
//   - comm/local aborts the whole group: every rank waiting in a collective,
//     or calling one later, returns an error wrapping ErrAborted; no rank is
//     left blocked.
//   - comm/mpi cannot cancel an MPI collective. A context already done when
//     a call starts returns an error wrapping ErrAborted on that rank only,
//     without communicating: its peers are not told and wait for it until
//     their own context ends. A context that ends while a collective is in
//     flight aborts the whole MPI job (the process exits; mpirun ends every
//     rank): no rank returns an error. A context that can never end
//     (context.Background) waits as long as the peers do.
//
// Either way the communicator is broken afterwards: every later call returns
// ErrAborted, and the caller makes a new one.
//
// A nil context is treated as context.Background() by both backends (and by
// every algorithm built on them), rather than refused: refusing it on the one
// rank that passed it would leave its peers waiting under comm/mpi.
//
// Buffers whose lengths differ across ranks are detected and reported, with
// both lengths, on every rank (see MismatchError).
package comm

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
)

// Op is a reduction operator for AllReduce and ReduceScatter.
type Op int

// The reduction operators.
const (
	Sum  Op = iota // element-wise sum
	Mean           // element-wise sum divided by the number of ranks
	Max            // element-wise maximum
)

// String returns the operator's name.
func (o Op) String() string {
	switch o {
	case Sum:
		return "sum"
	case Mean:
		return "mean"
	case Max:
		return "max"
	}
	return fmt.Sprintf("Op(%d)", int(o))
}

// Valid reports whether o is one of the defined operators.
func (o Op) Valid() bool { return o >= Sum && o <= Max }

// Comm is a communicator: one rank's handle on a group of ranks. All ranks of
// the group must call the same collectives in the same order. A Comm is used
// by one goroutine at a time.
//
// Buffers are never retained after a call returns. Backends that hand
// buffers to C (comm/mpi) inherit cgo's rule: a buffer must not share its
// allocation with Go pointers, so pass slices made on their own (make or
// append), not arrays embedded in structs that hold pointers. Byte and float32 variants
// of a collective share one sequence: a rank calling AllGather while another
// calls AllGatherBytes is an error.
type Comm interface {
	// Rank is this rank's index in [0, Size()).
	Rank() int
	// Size is the number of ranks in the group.
	Size() int

	// AllReduce reduces buf element-wise over all ranks with op and leaves
	// the result, identical on every rank, in buf.
	AllReduce(ctx context.Context, buf []float32, op Op) error
	// ReduceScatter reduces send (Size() equal chunks) element-wise over all
	// ranks and leaves chunk Rank() of the result in recv:
	// len(send) == Size()*len(recv).
	ReduceScatter(ctx context.Context, send, recv []float32, op Op) error

	// AllGather concatenates every rank's send, in rank order, into recv:
	// len(recv) == Size()*len(send).
	AllGather(ctx context.Context, send, recv []float32) error
	// AllGatherBytes is AllGather on bytes.
	AllGatherBytes(ctx context.Context, send, recv []byte) error

	// AllToAll sends chunk j of send (Size() equal chunks) to rank j and
	// stores the chunk received from rank j as chunk j of recv:
	// len(send) == len(recv), a multiple of Size().
	AllToAll(ctx context.Context, send, recv []float32) error
	// AllToAllBytes is AllToAll on bytes.
	AllToAllBytes(ctx context.Context, send, recv []byte) error

	// Broadcast copies root's buf into buf on every other rank.
	Broadcast(ctx context.Context, buf []float32, root int) error
	// BroadcastBytes is Broadcast on bytes.
	BroadcastBytes(ctx context.Context, buf []byte, root int) error

	// Barrier returns once every rank has entered it.
	Barrier(ctx context.Context) error

	// Split partitions the group: ranks that pass the same color form a new
	// communicator, ordered by key and then by their rank in this one. A
	// negative color takes part in the call but joins no group and gets a
	// nil Comm (MPI_UNDEFINED).
	Split(ctx context.Context, color, key int) (Comm, error)

	// Stats returns the traffic this rank has put on the wire so far.
	Stats() Stats

	// Close releases the communicator. Collectives after Close fail.
	Close() error
}

// CheckSkipper is implemented by communicators that make the ranks agree on
// every collective's arguments (kind, lengths, op, root) with an extra small
// round trip before any data moves, as comm/mpi does. An algorithm that has
// just made every rank agree on the lengths of its next calls by other
// means (the 1-bit allreduce all-gathers every rank's tensor length in the
// header it sends anyway) may skip that round trip for them.
//
// Skipping is a promise: the next n collectives on this communicator are
// called by every rank in the same order with agreeing arguments. A broken
// promise is undefined behaviour of the backend (a hang or garbage), not a
// clear error, so only algorithms that derive every length from values all
// ranks have just exchanged should use it.
type CheckSkipper interface {
	// SkipChecks makes the next n collectives skip the agreement round;
	// SkipChecks(0) cancels what is left of an earlier promise.
	SkipChecks(n int)
}

// SkipChecks calls SkipChecks(n) on the CheckSkipper that As finds in c
// (through any wrappers) and does nothing when there is none.
func SkipChecks(c Comm, n int) {
	if s, ok := As[CheckSkipper](c); ok {
		s.SkipChecks(n)
	}
}

// Starter is implemented by communicators that can start the byte
// all-to-all and all-gather and return at once, so that the caller goes on
// computing while the data travels, and finishes them with the returned
// Requests. comm/mpi does, with MPI's non-blocking collectives: Open MPI's
// TCP transport moves their data only inside MPI calls, so the caller
// calls Test now and then while it computes (every few tens of
// microseconds of work), then Wait.
//
// A started collective is one collective of the sequence every rank calls
// in the same order, with the blocking variant's arguments and checks, and
// every rank must start it where the others start it: MPI's non-blocking
// collectives do not match blocking ones (comm/mpi reports a rank that
// calls the blocking variant as a mismatch, unless the checks are
// skipped). Several may be in flight at once (comm/mpi: up to 16); they
// may end in any order. Until every one is done, the communicator takes
// no blocking call (each returns an error), Close included; and send and
// recv must be neither written nor read by anyone else until their
// collective is done. A Request is valid until it is done and the
// communicator's next start.
//
// Algorithms look for a Starter on the communicator they were given
// itself, never through wrappers (As), and use it where Starts reports
// true: a wrapper that counts or injects faults in every collective must
// see these ones too, so a communicator wrapped by one that is not a
// Starter (comm/timed is one) runs them blocking.
type Starter interface {
	// Starts reports whether the Start methods really start the
	// collectives: a wrapper that is a Starter whatever it wraps runs
	// them blocking over a communicator that is not one, and says false.
	Starts() bool
	// StartAllToAllBytes starts AllToAllBytes(ctx, send, recv).
	StartAllToAllBytes(ctx context.Context, send, recv []byte) (Request, error)
	// StartAllGatherBytes starts AllGatherBytes(ctx, send, recv).
	StartAllGatherBytes(ctx context.Context, send, recv []byte) (Request, error)
}

// Done is the Request of a collective that has run to its end already: a
// Starter that ran it blocking returns it.
type Done struct{}

// Test reports done, without error (the collective's error came with it).
func (Done) Test() (bool, error) { return true, nil }

// Wait returns at once, without error.
func (Done) Wait() error { return nil }

// Request is a collective a Starter started. What a context that ends
// while it is in flight does is what it does to the blocking variant.
// Testing or waiting for one request moves the data of every collective in
// flight on its communicator.
type Request interface {
	// Test moves the collective's data as far as it can without waiting
	// and reports whether it is done, with its error once it is. It may be
	// called again after that and reports the same. It is meant for the
	// pauses of the caller's own work and does not give up the core (see
	// comm/mpi): to wait, call Wait, not Test in a loop.
	Test() (done bool, err error)
	// Wait returns when the collective is done, with its error.
	Wait() error
}

// Concurrent is implemented by communicators that say whether their
// collectives may run while this rank runs collectives on its other
// communicators, from other goroutines (each communicator still used by one
// goroutine at a time). comm/local always may; comm/mpi may when MPI
// provides MPI_THREAD_MULTIPLE (under MPI_THREAD_SERIALIZED its calls take
// turns, and two blocking collectives would wait for each other).
type Concurrent interface {
	// Concurrent reports whether collectives on this communicator may
	// overlap collectives on the rank's other communicators.
	Concurrent() bool
}

// CanOverlap reports whether collectives on every one of cs may run at the
// same time as collectives on the others: each implements Concurrent
// itself and says so. A communicator that does not may not, a wrapper
// included: the wrapped communicator's Concurrent is not the wrapper's
// (see Wrapper), so a goroutine-safe wrapper implements Concurrent,
// typically as CanOverlap(wrapped).
func CanOverlap(cs ...Comm) bool {
	for _, c := range cs {
		k, ok := c.(Concurrent) // never a wrapped one's (see Wrapper)
		if !ok || !k.Concurrent() {
			return false
		}
	}
	return true
}

// Collective names a kind of collective call in Stats.
type Collective int

// The collectives counted in Stats.
const (
	CAllReduce Collective = iota
	CReduceScatter
	CAllGather
	CAllToAll
	CBroadcast
	CBarrier
	CSplit
	NumCollectives // number of kinds; not a collective
)

var collectiveNames = [NumCollectives]string{
	"allreduce", "reducescatter", "allgather", "alltoall", "broadcast", "barrier", "split",
}

// String returns the collective's name.
func (c Collective) String() string {
	if c >= 0 && c < NumCollectives {
		return collectiveNames[c]
	}
	return fmt.Sprintf("Collective(%d)", int(c))
}

// Traffic is the volume one rank moved for one kind of collective.
type Traffic struct {
	Calls     int64 // completed calls
	BytesSent int64 // bytes this rank put on the wire
	BytesRecv int64 // bytes this rank took off the wire
}

// Stats is one rank's traffic, per kind of collective.
//
// Byte counts follow the bandwidth-optimal algorithm of each collective, so
// that backends are comparable and the numbers match what a ring or direct
// exchange moves between ranks (bytes a rank keeps for itself are not
// counted): for a buffer of B bytes on W ranks, AllReduce sends and receives
// 2(W-1)/W*B (ring), ReduceScatter (W-1)/W*B of its input, AllGather (W-1)
// times its send buffer, AllToAll (W-1)/W*B, and Broadcast B*(W-1) from the
// root and B on every other rank.
type Stats struct {
	PerCollective [NumCollectives]Traffic
}

// Total sums the traffic over all kinds of collective.
func (s Stats) Total() Traffic {
	var t Traffic
	for _, c := range s.PerCollective {
		t.Calls += c.Calls
		t.BytesSent += c.BytesSent
		t.BytesRecv += c.BytesRecv
	}
	return t
}

// Sub returns the traffic in s since an earlier snapshot prev.
func (s Stats) Sub(prev Stats) Stats {
	for i := range s.PerCollective {
		s.PerCollective[i].Calls -= prev.PerCollective[i].Calls
		s.PerCollective[i].BytesSent -= prev.PerCollective[i].BytesSent
		s.PerCollective[i].BytesRecv -= prev.PerCollective[i].BytesRecv
	}
	return s
}

// Counter accumulates Stats for a backend. Its methods are safe for
// concurrent use, so Stats may be read while a collective runs.
type Counter struct {
	c [NumCollectives][3]atomic.Int64
}

// Add records one completed call of kind c.
func (k *Counter) Add(c Collective, sent, recv int64) {
	k.c[c][0].Add(1)
	k.c[c][1].Add(sent)
	k.c[c][2].Add(recv)
}

// Stats returns a snapshot of the counts.
func (k *Counter) Stats() Stats {
	var s Stats
	for i := range k.c {
		s.PerCollective[i] = Traffic{
			Calls:     k.c[i][0].Load(),
			BytesSent: k.c[i][1].Load(),
			BytesRecv: k.c[i][2].Load(),
		}
	}
	return s
}

// RingAllReduceBytes is the number of bytes each of w ranks sends in a ring
// allreduce of a buffer of b bytes: 2(w-1)/w*b.
func RingAllReduceBytes(b int64, w int) int64 {
	if w <= 1 {
		return 0
	}
	return 2 * int64(w-1) * b / int64(w)
}

// ErrAborted is returned by every call on a communicator that an earlier
// cancellation, deadline or failure has broken. Errors that wrap it also
// wrap the cause where there is one.
var ErrAborted = errors.New("comm: communicator aborted")

// ErrClosed is returned by calls on a closed communicator.
var ErrClosed = errors.New("comm: communicator closed")

// MismatchError reports that ranks called a collective with buffers (or
// other arguments) that disagree. Every rank of the call gets it.
type MismatchError struct {
	Collective Collective
	What       string // "length", "op", "root", "kind"
	Rank       int    // the rank whose value differs from rank 0's
	Got        int    // that rank's value
	Want       int    // rank 0's value
}

// Error describes the mismatch, naming both values.
func (e *MismatchError) Error() string {
	return fmt.Sprintf("comm: %s: %s mismatch across ranks: rank %d has %d, rank 0 has %d",
		e.Collective, e.What, e.Rank, e.Got, e.Want)
}

// CheckLen returns an error when n is not a multiple of size (for chunked
// collectives), naming the collective.
func CheckLen(c Collective, what string, n, size int) error {
	if size <= 0 || n%size != 0 {
		return fmt.Errorf("comm: %s: %s length %d is not a multiple of the group size %d", c, what, n, size)
	}
	return nil
}
