//go:build mpi

package mpi

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/lowbit-ml/lowbit/comm"
	"go.uber.org/zap"
)

// Built reports whether this binary was built with the mpi build tag, that
// is, whether Open can work.
const Built = true

// env is the process's MPI state, the one global state of the package:
// MPI itself is initialized and finalized once per process.
var env struct {
	mu        sync.Mutex
	started   bool // MPI is initialized, by this package or by someone else
	owned     bool // this package initialized MPI and finalizes it
	open      int  // communicators returned by Open and not yet closed
	finalized atomic.Bool

	serialize bool       // thread level is MPI_THREAD_SERIALIZED
	lock      sync.Mutex // serializes MPI calls when serialize is set
}

func lock() {
	if env.serialize {
		env.lock.Lock()
	}
}

func unlock() {
	if env.serialize {
		env.lock.Unlock()
	}
}

// rollCallLockWait is how long the watchdog waits for the serialization
// lock in a roll call; a rank waiting in an agreement takes it only for a
// moment at a time.
const rollCallLockWait = 100 * time.Millisecond

var errLockBusy = errors.New("another MPI call held the serialization lock (MPI_THREAD_SERIALIZED)")

// tryLock takes the serialization lock like lock, giving up after d.
func tryLock(d time.Duration) bool {
	if !env.serialize {
		return true
	}
	deadline := time.Now().Add(d)
	for !env.lock.TryLock() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

// Open initializes MPI on its first call and returns a new communicator
// over every rank of the job (a duplicate of MPI_COMM_WORLD). Every rank
// must call it. A process started without mpirun is a job of one rank.
// Closing the last communicator Open returned finalizes MPI, after which
// Open fails.
func Open(opts ...Option) (comm.Comm, error) {
	o := newOptions(opts)
	env.mu.Lock()
	defer env.mu.Unlock()
	if err := start(o.log); err != nil {
		return nil, err
	}
	h, err := cDupWorld()
	if err != nil {
		return nil, fmt.Errorf("mpi: open: %w", err)
	}
	c, err := newComm(h, o, true)
	if err != nil {
		return nil, fmt.Errorf("mpi: open: %w", err)
	}
	env.open++
	o.log.Debug("mpi: opened world communicator", zap.Int("rank", c.rank), zap.Int("size", c.size),
		zap.Bool("ordered_reduce", o.ordered))
	return c, nil
}

// start initializes MPI if needed. Called with env.mu held.
func start(log *zap.Logger) error {
	if env.finalized.Load() || mpiFinalized() {
		return errors.New("mpi: open: MPI was finalized (the last communicator from Open was closed) and cannot be initialized again in this process")
	}
	if env.started {
		return nil
	}
	var provided int
	var err error
	if mpiInitialized() {
		// Someone else initialized MPI: use it, leave finalizing to them.
		if provided, err = mpiQueryThread(); err != nil {
			return fmt.Errorf("mpi: open: %w", err)
		}
	} else {
		if provided, err = mpiInit(); err != nil {
			return fmt.Errorf("mpi: open: %w", err)
		}
		env.owned = true
	}
	if provided < threadSerialized {
		err := fmt.Errorf("mpi: open: MPI provides thread level %d; lowbit needs at least MPI_THREAD_SERIALIZED (%d)",
			provided, threadSerialized)
		if env.owned {
			mpiFinalize()
			env.finalized.Store(true)
		}
		return err
	}
	env.started = true
	env.serialize = provided < threadMultiple
	log.Debug("mpi: initialized", zap.Bool("owned", env.owned), zap.Int("thread_level", provided),
		zap.Bool("serialized", env.serialize))
	return nil
}

// mpiComm is one rank's handle on an MPI communicator.
type mpiComm struct {
	h          handle
	rank, size int
	fromOpen   bool // returned by Open: closing the last one finalizes MPI
	opts       options
	stats      comm.Counter
	closed     bool
	err        error // set once the communicator is broken
	wd         *watchdog
	st         cstate              // memory MPI uses after a call returns
	agree      []int64             // the agreement vector, in st
	seq        int64               // collectives started on c
	skip       int                 // collectives left that skip the agreement (SkipChecks)
	reqs       [maxStarted]request // the started collectives' slots (Starter)
	inFlight   int                 // started collectives not yet seen done
	group      guard               // the watchdog's guard of those in flight
	groupDone  <-chan struct{}     // the Done channel of the context group guards with
	alsoDone   <-chan struct{}     // the last one added to group (watchdog.also)
	agreeing   bool                // a started tiny all-gather's agreement is in flight (startTiny)

	// WithOrderedReduce's buffers.
	scratch              []float32
	cnt, dsp, rcnt, rdsp []int32
}

var (
	_ comm.Comm         = (*mpiComm)(nil)
	_ comm.NodeSplitter = (*mpiComm)(nil)
	_ comm.CheckSkipper = (*mpiComm)(nil)
	_ comm.Starter      = (*mpiComm)(nil)
)

func newComm(h handle, o options, fromOpen bool) (*mpiComm, error) {
	r, s, err := cSetup(h)
	if err != nil {
		cFree(&h)
		return nil, err
	}
	ranks, err := cWorldRanks(h, s)
	if err != nil {
		cFree(&h)
		return nil, err
	}
	st, err := cStateNew(h, agreeLenFor(s))
	if err != nil {
		cFree(&h)
		return nil, err
	}
	c := &mpiComm{
		h:        h,
		rank:     r,
		size:     s,
		fromOpen: fromOpen,
		opts:     o,
		st:       st,
		agree:    agreeVec(st, agreeLenFor(s)),
	}
	if o.ordered {
		c.cnt = make([]int32, c.size)
		c.dsp = make([]int32, c.size)
		c.rcnt = make([]int32, c.size)
		c.rdsp = make([]int32, c.size)
	}
	log := o.log
	c.wd = newWatchdog(ranks, r, o.timeout, &rollCaller{st: st, got: make([]int64, s*msgLen)}, func(msg string) {
		log.Error(msg)
		fmt.Fprintln(os.Stderr, msg)
		endJob(abortCode)
	})
	return c, nil
}

// endJob ends the whole MPI job from this rank, which cannot leave a stuck
// collective. Under Open MPI's mpirun (OMPI_COMM_WORLD_SIZE is set) it
// exits with code without finalizing, and mpirun then kills every rank;
// elsewhere it calls MPI_Abort, the portable way. Open MPI 4.1's mpirun can
// hang in its teardown when a peer has already finalized: in the
// early-close scenario it hung in 2 of 15 runs with MPI_Abort, in 3 of 25
// with plain exits at the same moment, and in none of 65 with plain exits
// staggered by rank (see abortStagger).
func endJob(code int) {
	if os.Getenv("OMPI_COMM_WORLD_SIZE") == "" {
		abortJob(code) // does not return
	}
	os.Exit(code)
}

// Rank returns this rank's index.
func (c *mpiComm) Rank() int { return c.rank }

// Size returns the number of ranks.
func (c *mpiComm) Size() int { return c.size }

// Stats returns this rank's traffic so far.
func (c *mpiComm) Stats() comm.Stats { return c.stats.Stats() }

// Close frees the communicator; closing the last one Open returned
// finalizes MPI, which every rank must then do too.
func (c *mpiComm) Close() error {
	if c.closed {
		return nil
	}
	if c.inFlight > 0 {
		return fmt.Errorf("mpi: close: %d started collectives are in flight (finish them with their Requests first)", c.inFlight)
	}
	c.closed = true
	c.wd.stop()
	env.mu.Lock()
	defer env.mu.Unlock()
	if env.finalized.Load() {
		return nil
	}
	cStateFree(c.st)
	h := c.h // cgo refuses a pointer into c, which holds Go pointers
	err := cFree(&h)
	c.h = h
	if c.fromOpen {
		env.open--
		if env.open == 0 && env.owned {
			err = errors.Join(err, mpiFinalize())
			env.finalized.Store(true)
			c.opts.log.Debug("mpi: finalized")
		}
	}
	if err != nil {
		return fmt.Errorf("mpi: close: %w", err)
	}
	return nil
}

// usable returns the error of a call on a closed or broken communicator.
func (c *mpiComm) usable(kind comm.Collective) error {
	switch {
	case c.closed:
		return fmt.Errorf("mpi: %s: %w", kind, comm.ErrClosed)
	case env.finalized.Load():
		return fmt.Errorf("mpi: %s: %w (MPI was finalized)", kind, comm.ErrClosed)
	case c.err != nil:
		return fmt.Errorf("mpi: %s: %w", kind, c.err)
	}
	return nil
}

// idle returns the error of a blocking call while started collectives are
// in flight.
func (c *mpiComm) idle(kind comm.Collective) error {
	if c.inFlight > 0 {
		return fmt.Errorf("mpi: %s: %d started collectives are in flight (finish them with their Requests first)", kind, c.inFlight)
	}
	return nil
}

// giveUp breaks the communicator because ctx ended before a call.
func (c *mpiComm) giveUp(kind comm.Collective, cause error) error {
	c.err = fmt.Errorf("%w: rank %d gave up: %w", comm.ErrAborted, c.rank, cause)
	return fmt.Errorf("mpi: %s: %w", kind, c.err)
}

// fail breaks the communicator because an MPI call failed.
func (c *mpiComm) fail(kind comm.Collective, err error) error {
	c.err = fmt.Errorf("%w: rank %d: %w", comm.ErrAborted, c.rank, err)
	return fmt.Errorf("mpi: %s: %w", kind, err)
}

func tooLong(kind comm.Collective, what string, n int) error {
	return fmt.Errorf("mpi: %s: %s of %d elements exceeds MPI's count limit of %d", kind, what, n, maxCount)
}

func mpiOp(op comm.Op) int {
	if op == comm.Max {
		return opMax
	}
	return opSum
}

// AllReduce reduces buf over all ranks in place.
func (c *mpiComm) AllReduce(ctx context.Context, buf []float32, op comm.Op) error {
	a := args{kind: comm.CAllReduce, send: len(buf), op: op}
	switch {
	case !op.Valid():
		a.invalid = fmt.Errorf("mpi: allreduce: invalid op %v", op)
	case c.opts.ordered && len(buf) > maxCount:
		a.invalid = tooLong(comm.CAllReduce, "buffer", len(buf))
	}
	armed, err := c.begin(ctx, &a)
	if err != nil {
		return err
	}
	// One rank's result is its input: Sum and Max copy, Mean divides by 1.
	if len(buf) > 0 && c.size > 1 {
		if c.opts.ordered {
			err = c.orderedAllReduce(buf, op)
		} else {
			err = c.nativeAllReduce(buf, op)
		}
	}
	if err := c.end(comm.CAllReduce, armed, err); err != nil {
		return err
	}
	n := comm.RingAllReduceBytes(int64(len(buf))*4, c.size)
	c.stats.Add(comm.CAllReduce, n, n)
	return nil
}

// nativeAllReduce is MPI_Allreduce, in pieces of at most maxCount; for
// Mean each piece is then divided by the rank count in the same cgo call.
func (c *mpiComm) nativeAllReduce(buf []float32, op comm.Op) error {
	for lo := 0; lo < len(buf); lo += maxCount {
		p := buf[lo:min(lo+maxCount, len(buf))]
		if err := cAllReduce(c.h, ptr(p), len(p), tFloat, mpiOp(op), divisor(op, c.size)); err != nil {
			return err
		}
	}
	return nil
}

// divisor is what the C layer divides a reduction's result by: the rank
// count for Mean, else 1 (no division).
func divisor(op comm.Op, size int) int {
	if op == comm.Mean {
		return size
	}
	return 1
}

// orderedAllReduce cuts buf into chunks as comm/local does, sends chunk j
// of every rank to rank j (MPI_Alltoallv), reduces this rank's chunk in
// ascending rank order into buf, and gathers the chunks back in place
// (MPI_Allgatherv).
func (c *mpiComm) orderedAllReduce(buf []float32, op comm.Op) error {
	n, w := len(buf), c.size
	lo, hi := chunk(n, w, c.rank)
	k := hi - lo
	for j := range w {
		jl, jh := chunk(n, w, j)
		c.cnt[j], c.dsp[j] = int32(jh-jl), int32(jl)
		c.rcnt[j], c.rdsp[j] = int32(k), int32(j*k)
	}
	recv := c.grow(w * k)
	if err := cAllToAllv(c.h, buf, c.cnt, c.dsp, recv, c.rcnt, c.rdsp); err != nil {
		return err
	}
	reduceOrdered(buf[lo:hi], recv, w, op)
	return cAllGathervInPlace(c.h, buf, c.cnt, c.dsp)
}

// grow returns the scratch buffer with length n, reallocating only when it
// is too small.
func (c *mpiComm) grow(n int) []float32 {
	if cap(c.scratch) < n {
		c.scratch = make([]float32, n)
	}
	return c.scratch[:n]
}

// ReduceScatter reduces send over all ranks and keeps chunk Rank() in recv.
func (c *mpiComm) ReduceScatter(ctx context.Context, send, recv []float32, op comm.Op) error {
	a := args{kind: comm.CReduceScatter, send: len(send), recv: len(recv), op: op}
	switch {
	case !op.Valid():
		a.invalid = fmt.Errorf("mpi: reducescatter: invalid op %v", op)
	case len(send) != c.size*len(recv):
		a.invalid = fmt.Errorf("mpi: reducescatter: send length %d is not %d ranks x receive length %d",
			len(send), c.size, len(recv))
	case len(recv) > maxCount:
		a.invalid = tooLong(comm.CReduceScatter, "receive buffer", len(recv))
	}
	armed, err := c.begin(ctx, &a)
	if err != nil {
		return err
	}
	switch k := len(recv); {
	case k == 0:
	case c.size == 1:
		copy(recv, send)
	case c.opts.ordered:
		scratch := c.grow(len(send))
		if err = cAllToAll(c.h, ptr(send), ptr(scratch), k, tFloat); err == nil {
			reduceOrdered(recv, scratch, c.size, op)
		}
	default:
		err = cReduceScatterBlock(c.h, send, recv, mpiOp(op), divisor(op, c.size))
	}
	if err := c.end(comm.CReduceScatter, armed, err); err != nil {
		return err
	}
	n := int64(len(send)-len(recv)) * 4
	c.stats.Add(comm.CReduceScatter, n, n)
	return nil
}

// elem is the element type of the float32 and byte variants.
type elem interface{ byte | float32 }

// asBytes returns the bytes of s (in this machine's byte order).
func asBytes[T elem](s []T) []byte {
	var z T
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), len(s)*int(unsafe.Sizeof(z)))
}

// typeOf returns T's MPI data type, its size and whether it is the byte
// variant.
func typeOf[T elem]() (t int, size int64, bytes bool) {
	var z T
	if _, ok := any(z).(float32); ok {
		return tFloat, 4, false
	}
	return tByte, 1, true
}

// AllGather concatenates every rank's send into recv.
func (c *mpiComm) AllGather(ctx context.Context, send, recv []float32) error {
	return allGather(c, ctx, send, recv)
}

// AllGatherBytes concatenates every rank's send into recv.
func (c *mpiComm) AllGatherBytes(ctx context.Context, send, recv []byte) error {
	return allGather(c, ctx, send, recv)
}

// allGatherArgs are an all-gather's arguments, checked.
func (c *mpiComm) allGatherArgs(bytes bool, send, recv int) args {
	a := args{kind: comm.CAllGather, bytes: bytes, send: send, recv: recv}
	switch {
	case recv != c.size*send:
		a.invalid = fmt.Errorf("mpi: allgather: receive length %d is not %d ranks x send length %d",
			recv, c.size, send)
	case send > maxCount:
		a.invalid = tooLong(comm.CAllGather, "send buffer", send)
	}
	return a
}

func allGather[T elem](c *mpiComm, ctx context.Context, send, recv []T) error {
	t, sz, bytes := typeOf[T]()
	a := c.allGatherArgs(bytes, len(send), len(recv))
	if p := asBytes(send); tiny(len(p), c.size) {
		a.payload = p // begin drops it where no agreement runs
	}
	armed, err := c.begin(ctx, &a)
	if err != nil {
		return err
	}
	if a.payload != nil {
		payloads(c.agree, asBytes(recv), len(a.payload))
	} else if len(send) > 0 {
		err = cAllGather(c.h, unsafe.Pointer(unsafe.SliceData(send)), unsafe.Pointer(unsafe.SliceData(recv)), len(send), t)
	}
	if err := c.end(comm.CAllGather, armed, err); err != nil {
		return err
	}
	n := int64(len(send)) * sz * int64(c.size-1)
	c.stats.Add(comm.CAllGather, n, n)
	return nil
}

// AllToAll sends chunk j of send to rank j.
func (c *mpiComm) AllToAll(ctx context.Context, send, recv []float32) error {
	return allToAll(c, ctx, send, recv)
}

// AllToAllBytes sends chunk j of send to rank j.
func (c *mpiComm) AllToAllBytes(ctx context.Context, send, recv []byte) error {
	return allToAll(c, ctx, send, recv)
}

// allToAllArgs are an all-to-all's arguments, checked.
func (c *mpiComm) allToAllArgs(bytes bool, send, recv int) args {
	a := args{kind: comm.CAllToAll, bytes: bytes, send: send, recv: recv}
	switch {
	case send != recv:
		a.invalid = fmt.Errorf("mpi: alltoall: send length %d differs from receive length %d", send, recv)
	case send%c.size != 0:
		a.invalid = comm.CheckLen(comm.CAllToAll, "send", send, c.size)
	case send/c.size > maxCount:
		a.invalid = tooLong(comm.CAllToAll, "chunk", send/c.size)
	}
	return a
}

func allToAll[T elem](c *mpiComm, ctx context.Context, send, recv []T) error {
	t, sz, bytes := typeOf[T]()
	a := c.allToAllArgs(bytes, len(send), len(recv))
	armed, err := c.begin(ctx, &a)
	if err != nil {
		return err
	}
	if len(send) > 0 {
		err = cAllToAll(c.h, unsafe.Pointer(unsafe.SliceData(send)), unsafe.Pointer(unsafe.SliceData(recv)), len(send)/c.size, t)
	}
	if err := c.end(comm.CAllToAll, armed, err); err != nil {
		return err
	}
	n := int64(len(send)/c.size) * sz * int64(c.size-1)
	c.stats.Add(comm.CAllToAll, n, n)
	return nil
}

// Broadcast copies root's buf to every rank.
func (c *mpiComm) Broadcast(ctx context.Context, buf []float32, root int) error {
	return broadcast(c, ctx, buf, root)
}

// BroadcastBytes copies root's buf to every rank.
func (c *mpiComm) BroadcastBytes(ctx context.Context, buf []byte, root int) error {
	return broadcast(c, ctx, buf, root)
}

func broadcast[T elem](c *mpiComm, ctx context.Context, buf []T, root int) error {
	t, sz, bytes := typeOf[T]()
	a := args{kind: comm.CBroadcast, bytes: bytes, send: len(buf), root: root}
	if root < 0 || root >= c.size {
		a.invalid = fmt.Errorf("mpi: broadcast: root %d out of range [0, %d)", root, c.size)
	}
	armed, err := c.begin(ctx, &a)
	if err != nil {
		return err
	}
	if c.size > 1 {
		for lo := 0; lo < len(buf) && err == nil; lo += maxCount {
			p := buf[lo:min(lo+maxCount, len(buf))]
			err = cBcast(c.h, unsafe.Pointer(unsafe.SliceData(p)), len(p), t, root)
		}
	}
	if err := c.end(comm.CBroadcast, armed, err); err != nil {
		return err
	}
	n := int64(len(buf)) * sz
	if c.rank == root {
		c.stats.Add(comm.CBroadcast, n*int64(c.size-1), 0)
	} else {
		c.stats.Add(comm.CBroadcast, 0, n)
	}
	return nil
}

// Barrier returns once every rank has entered it. The argument agreement
// is an allreduce, which no rank leaves before every rank has entered it,
// so it is the barrier.
func (c *mpiComm) Barrier(ctx context.Context) error {
	armed, err := c.begin(ctx, &args{kind: comm.CBarrier})
	if err != nil {
		return err
	}
	c.wd.disarm(armed)
	c.stats.Add(comm.CBarrier, 0, 0)
	return nil
}

// Concurrent reports whether MPI provides MPI_THREAD_MULTIPLE: then
// collectives on this communicator may run while the rank runs others on
// its other communicators.
func (c *mpiComm) Concurrent() bool { return !env.serialize }

// SkipChecks makes the next n collectives on c skip the agreement round
// that checks every rank's arguments before data moves (see
// comm.CheckSkipper); n = 0 cancels. A collective that fails cancels what
// is left.
func (c *mpiComm) SkipChecks(n int) { c.skip = max(n, 0) }

// SplitNode returns the ranks that share this rank's machine, ordered by
// rank (MPI_Comm_split_type with MPI_COMM_TYPE_SHARED). comm.NewLayout
// calls it when it is given no explicit ranks per node.
func (c *mpiComm) SplitNode(ctx context.Context) (comm.Comm, error) {
	// root 1 tells this call from a plain Split (root 0) in the agreement,
	// so that a rank in Split and another in SplitNode is a mismatch, not a
	// hang.
	armed, err := c.begin(ctx, &args{kind: comm.CSplit, root: 1})
	if err != nil {
		return nil, err
	}
	h, err := cSplitShared(c.h, c.rank)
	if err := c.end(comm.CSplit, armed, err); err != nil {
		return nil, err
	}
	c.stats.Add(comm.CSplit, 0, 0)
	nc, err := newComm(h, c.opts, false)
	if err != nil {
		return nil, c.fail(comm.CSplit, err)
	}
	c.opts.log.Debug("mpi: split by node", zap.Int("rank", nc.rank), zap.Int("size", nc.size))
	return nc, nil
}

// Split makes new communicators of the ranks that pass the same color,
// ordered by key and then by rank (MPI_Comm_split). A negative color
// returns a nil Comm.
func (c *mpiComm) Split(ctx context.Context, color, key int) (comm.Comm, error) {
	a := args{kind: comm.CSplit}
	if color > math.MaxInt32 || key > math.MaxInt32 || key < math.MinInt32 {
		a.invalid = fmt.Errorf("mpi: split: color %d or key %d does not fit in a C int", color, key)
	}
	armed, err := c.begin(ctx, &a)
	if err != nil {
		return nil, err
	}
	h, ok, err := cSplit(c.h, max(color, -1), key)
	if err := c.end(comm.CSplit, armed, err); err != nil {
		return nil, err
	}
	c.stats.Add(comm.CSplit, 0, 0)
	if !ok {
		return nil, nil
	}
	nc, err := newComm(h, c.opts, false)
	if err != nil {
		return nil, c.fail(comm.CSplit, err)
	}
	c.opts.log.Debug("mpi: split", zap.Int("color", color), zap.Int("key", key),
		zap.Int("rank", nc.rank), zap.Int("size", nc.size))
	return nc, nil
}
