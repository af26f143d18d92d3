// Package local is the in-process backend of comm: W goroutines in one
// process act as W ranks. It is the embedded default, needs nothing outside
// Go, and is what tests and single-machine runs use.
//
// Collectives exchange data through shared memory with no intermediate
// copies: every rank publishes its buffers, all ranks meet at a barrier, and
// each rank then reads its peers' buffers directly. Reductions sum in
// ascending rank order, so results are bit-identical on every rank and on
// every run.
//
// A cancelled context, a passed deadline or a Close on any rank aborts the
// whole group: every rank waiting in a collective returns an error wrapping
// comm.ErrAborted, and the communicators are unusable afterwards. Under Run,
// a rank whose function returns closes its communicators (those it split
// off included), so a rank that fails never leaves its peers blocked. Buffers
// passed to one call must not overlap each other.
package local

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/lowbit-ml/lowbit/comm"
)

// Option configures New and Run.
type Option func(*options)

type options struct {
	ranksPerNode int
	underMPI     bool // AllowUnderMPI
}

// AllowUnderMPI lets New and Run start in-process ranks even where the
// environment says this process is one rank of an MPI job of several ranks
// (CheckNotUnderMPI), which they refuse by default: each of the job's
// processes then runs a group of its own. A test that compares an MPI
// backend with in-process ranks under mpirun, or a program whose user asked
// for independent groups, passes it.
func AllowUnderMPI() Option { return func(o *options) { o.underMPI = true } }

// WithRanksPerNode pretends that the ranks run on size/k machines of k
// ranks each, node-major (ranks [0, k) on node 0, and so on), so that
// hierarchical collectives can be laid out and tested on one machine:
// SplitNode, and so comm.NewLayout with ranks per node 0, see this layout.
// k must divide the group size. The default is one node holding every rank,
// which is what an in-process group is.
func WithRanksPerNode(k int) Option { return func(o *options) { o.ranksPerNode = k } }

// New returns size communicators of one in-process group; comms[r] is rank
// r and must be used by one goroutine at a time.
//
// Where the environment says this process is one rank of an MPI job of
// several ranks (CheckNotUnderMPI), New returns an error unless given
// AllowUnderMPI: there every process of the job would train a model of
// its own.
func New(size int, opts ...Option) ([]comm.Comm, error) {
	if size < 1 {
		return nil, fmt.Errorf("local: group size must be at least 1, got %d", size)
	}
	o := options{ranksPerNode: size}
	for _, opt := range opts {
		opt(&o)
	}
	if !o.underMPI {
		if err := CheckNotUnderMPI(); err != nil {
			return nil, fmt.Errorf("%w; pass local.AllowUnderMPI() to start in-process ranks anyway", err)
		}
	}
	if o.ranksPerNode < 1 || size%o.ranksPerNode != 0 {
		return nil, fmt.Errorf("local: %d ranks per node does not divide the group size %d", o.ranksPerNode, size)
	}
	w := newWorld(size)
	cs := make([]comm.Comm, size)
	for r := range cs {
		cs[r] = &Comm{w: w, rank: r, node: r / o.ranksPerNode, fam: new(sync.Mutex)}
	}
	return cs, nil
}

// Run starts size ranks, calls fn on each from its own goroutine, waits for
// all of them, closes the communicators and returns the errors joined (nil
// when every rank succeeded).
//
// A rank's communicator is closed as soon as its fn returns, with or
// without an error, as a process's would be when it exits: peers that still
// wait for it in a collective, or call one later, get an error wrapping
// comm.ErrAborted (whose text carries the returned error) instead of
// blocking forever. Collectives that every rank has already entered finish
// normally, so a rank that returns nil after its last collective does not
// disturb peers still completing theirs. In the joined error, the errors
// that caused the abort come first (in rank order), then the errors of the
// ranks it stranded.
//
// Like New, Run refuses to start where this process is one rank of an MPI
// job of several ranks, unless given AllowUnderMPI.
func Run(ctx context.Context, size int, fn func(ctx context.Context, c comm.Comm) error, opts ...Option) error {
	cs, err := New(size, opts...)
	if err != nil {
		return err
	}
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range cs {
		wg.Go(func() {
			c := cs[r].(*Comm)
			err := fn(ctx, c)
			if err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
			}
			c.leave(err)
		})
	}
	wg.Wait()
	// Causes first: the errors that do not come from the abort.
	slices.SortStableFunc(errs, func(a, b error) int {
		return cmp.Compare(rankOfAbort(a), rankOfAbort(b))
	})
	return errors.Join(errs...)
}

// rankOfAbort orders Run's errors: 0 for a cause, 1 for an error that only
// reports the group's abort, 2 for none.
func rankOfAbort(err error) int {
	switch {
	case err == nil:
		return 2
	case errors.Is(err, comm.ErrAborted):
		return 1
	}
	return 0
}

// leave is Close for a rank whose function has returned err: the group's
// abort names the rank and, when there is one, its error.
// The communicators split off c on this rank leave with it.
func (c *Comm) leave(err error) {
	c.fam.Lock()
	splits := slices.Clone(c.splits)
	c.fam.Unlock()
	for _, s := range splits {
		s.leave(err)
	}
	if c.closed {
		return
	}
	c.closed = true
	if c.w.size == 1 {
		return
	}
	cause := fmt.Errorf("%w by rank %d: its function returned", comm.ErrClosed, c.rank)
	if err != nil {
		cause = fmt.Errorf("%w by rank %d: its function returned an error: %v", comm.ErrClosed, c.rank, err)
	}
	c.w.abort(c.rank, cause)
}

// slot is what one rank publishes for the collective it is in.
type slot struct {
	kind       comm.Collective
	bytes      bool // byte variant
	send, recv []float32
	bsend      []byte
	brecv      []byte
	op         comm.Op
	root       int
	color, key int
	node       int   // Split: the rank's node, inherited by its new communicator
	split      *Comm // Split's result for this rank, written by rank 0
	invalid    bool  // the rank's own arguments are invalid (see check)
}

// world is the state one group shares.
type world struct {
	size  int
	slots []slot

	mu      sync.Mutex
	arrived int
	gen     uint64
	waiting []bool
	wake    []chan struct{} // one per rank, capacity 1: the barrier's wake-up token
	abortCh chan struct{}
	err     error // set once, when the group is aborted

	// busy counts ranks that have passed the barrier opening a data phase
	// and not yet reached the barrier closing it. An aborting rank waits for
	// it to drain, so no peer still reads its buffers when it returns.
	busy atomic.Int32

	scratch []float32 // AllReduce's reduced values, one chunk per rank
}

func newWorld(size int) *world {
	w := &world{
		size:    size,
		slots:   make([]slot, size),
		waiting: make([]bool, size),
		wake:    make([]chan struct{}, size),
		abortCh: make(chan struct{}),
	}
	for i := range w.wake {
		w.wake[i] = make(chan struct{}, 1)
	}
	return w
}

// Barrier kinds: whether a barrier closes a data phase (the arriving rank
// was reading peers' buffers) and whether it opens one.
const (
	closes = 1 << iota
	opens
)

// wait is the group barrier for rank r. It does not allocate.
func (w *world) wait(ctx context.Context, r int, flags int) error {
	if ctx == nil {
		ctx = context.Background() // the comm package's rule for a nil context
	}
	if flags&closes != 0 {
		w.busy.Add(-1)
	}
	w.mu.Lock()
	if w.err != nil {
		err := w.err
		w.mu.Unlock()
		return err
	}
	if err := ctx.Err(); err != nil {
		w.mu.Unlock()
		return w.abort(r, err)
	}
	w.arrived++
	if w.arrived == w.size {
		w.arrived = 0
		w.gen++
		if flags&opens != 0 {
			w.busy.Add(int32(w.size))
			w.grow()
		}
		for i, wt := range w.waiting {
			if wt {
				w.waiting[i] = false
				w.wake[i] <- struct{}{}
			}
		}
		w.mu.Unlock()
		return nil
	}
	gen := w.gen
	w.waiting[r] = true
	w.mu.Unlock()

	woken := false
	var cause error
	select {
	case <-w.wake[r]:
		woken = true
	case <-w.abortCh:
	case <-ctx.Done():
		cause = ctx.Err()
	}
	w.mu.Lock()
	passed := w.gen != gen
	w.waiting[r] = false
	w.mu.Unlock()
	if passed {
		if !woken {
			<-w.wake[r] // the token was sent before gen moved on
		}
		return nil
	}
	if cause != nil {
		return w.abort(r, cause)
	}
	w.mu.Lock()
	err := w.err
	w.mu.Unlock()
	return err
}

// abort breaks the group with cause and returns the group's error. It waits
// until no rank is inside a data phase, which takes bounded time because
// data phases only compute.
func (w *world) abort(r int, cause error) error {
	w.mu.Lock()
	if w.err == nil {
		w.err = fmt.Errorf("%w: rank %d gave up: %w", comm.ErrAborted, r, cause)
		close(w.abortCh)
	}
	err := w.err
	w.mu.Unlock()
	for w.busy.Load() > 0 {
		runtime.Gosched()
	}
	return err
}

// grow sizes the AllReduce scratch for the collective every rank has just
// published. Called with mu held by the rank completing the barrier.
func (w *world) grow() {
	s := &w.slots[0]
	if s.kind == comm.CAllReduce && len(s.send) > len(w.scratch) {
		w.scratch = make([]float32, len(s.send))
	}
}

// Comm is one rank of an in-process group. It implements comm.Comm.
type Comm struct {
	w      *world
	rank   int
	node   int // the pretended machine this rank runs on (WithRanksPerNode)
	closed bool
	stats  comm.Counter
	// splits are the live communicators Split made for this rank: a rank
	// that leaves (see Run) leaves them too. A split that is closed leaves
	// its parent's list (see detach), so that the parent does not keep it,
	// and the memory it holds, for the parent's whole life.
	splits []*Comm
	parent *Comm // the communicator this one was split off; nil for New's
	// fam guards splits and parent of every communicator of this rank's
	// family (New's and all split off it, at any depth): a split may be
	// closed by another goroutine than the one using its parent (see
	// Concurrent).
	fam *sync.Mutex
}

var (
	_ comm.Comm         = (*Comm)(nil)
	_ comm.NodeSplitter = (*Comm)(nil)
	_ comm.Concurrent   = (*Comm)(nil)
)

// Concurrent reports true: the communicators of an in-process group share
// nothing with the rank's other communicators.
func (c *Comm) Concurrent() bool { return true }

// Rank returns this rank's index.
func (c *Comm) Rank() int { return c.rank }

// Size returns the number of ranks.
func (c *Comm) Size() int { return c.w.size }

// Stats returns this rank's traffic so far.
func (c *Comm) Stats() comm.Stats { return c.stats.Stats() }

// Close releases this rank. Peers still waiting for it in a collective get
// an error wrapping comm.ErrClosed instead of blocking.
func (c *Comm) Close() error {
	if c.closed {
		return nil
	}
	c.closed = true
	c.detach()
	if c.w.size > 1 {
		c.w.abort(c.rank, fmt.Errorf("%w by rank %d", comm.ErrClosed, c.rank))
	}
	return nil
}

// detach removes the closed split c from its parent's list and hands the
// communicators split off c to the parent, so that a rank leaving (Run)
// still reaches them while nothing keeps c. New's communicators have no
// parent and keep their lists: Run leaves them, and so their splits.
func (c *Comm) detach() {
	c.fam.Lock()
	defer c.fam.Unlock()
	p := c.parent
	if p == nil {
		return
	}
	if i := slices.Index(p.splits, c); i >= 0 {
		p.splits = slices.Delete(p.splits, i, i+1)
	}
	for _, s := range c.splits {
		s.parent = p
	}
	p.splits = append(p.splits, c.splits...)
	c.splits, c.parent = nil, nil
}

// begin publishes s and waits for every rank; it then checks that all ranks
// are in the same kind of collective with agreeing lengths and arguments.
// On success the caller is inside a data phase and must call end.
func (c *Comm) begin(ctx context.Context, s slot) (err error) {
	if c.closed {
		return fmt.Errorf("local: %s: %w", s.kind, comm.ErrClosed)
	}
	c.w.slots[c.rank] = s
	if err := c.w.wait(ctx, c.rank, opens); err != nil {
		c.unpublish(err)
		return fmt.Errorf("local: %s: %w", s.kind, err)
	}
	return nil
}

// end closes the data phase and unpublishes the rank's slot. err is the
// caller's validation result, which every rank computes alike; it wins over
// a barrier error.
func (c *Comm) end(ctx context.Context, kind comm.Collective, err error) error {
	werr := c.w.wait(ctx, c.rank, closes)
	c.unpublish(werr)
	if err != nil {
		return err
	}
	if werr != nil {
		return fmt.Errorf("local: %s: %w", kind, werr)
	}
	return nil
}

// unpublish clears the rank's slot once its collective is over, so that
// the group keeps no reference to the caller's buffers (nor to a Split's
// result) after the call returns. werr is the result of the barrier that
// ended the rank's part. When it passed, every rank has left the data
// phase and no peer reads the slot any more. When it failed, peers may
// still be reading it in a data phase the failure cut short: the group is
// broken, so busy only drains, and the rank waits for it as abort does.
func (c *Comm) unpublish(werr error) {
	if werr != nil {
		for c.w.busy.Load() > 0 {
			runtime.Gosched()
		}
	}
	c.w.slots[c.rank] = slot{}
}

// check compares every rank's published slot with rank 0's. bad is this
// rank's own argument error, found before the collective: a rank with
// invalid arguments still publishes its slot (marked invalid) and meets its
// peers, so that every rank returns an error rather than waiting for it.
// The lowest such rank is named; it returns its own error.
func (c *Comm) check(bad error) error {
	s0 := &c.w.slots[0]
	for j := range c.w.size {
		if c.w.slots[j].invalid {
			if bad != nil {
				return bad
			}
			return fmt.Errorf("local: %s: rank %d called it with invalid arguments (its error says which)", s0.kind, j)
		}
	}
	for j := 1; j < c.w.size; j++ {
		s := &c.w.slots[j]
		mismatch := func(what string, got, want int) error {
			return &comm.MismatchError{Collective: s0.kind, What: what, Rank: j, Got: got, Want: want}
		}
		switch {
		case s.kind != s0.kind || s.bytes != s0.bytes:
			return fmt.Errorf("local: rank %d called %s (bytes=%v) while rank 0 called %s (bytes=%v): %w",
				j, s.kind, s.bytes, s0.kind, s0.bytes, mismatch("kind", int(s.kind), int(s0.kind)))
		case len(s.send) != len(s0.send):
			return mismatch("send length", len(s.send), len(s0.send))
		case len(s.recv) != len(s0.recv):
			return mismatch("receive length", len(s.recv), len(s0.recv))
		case len(s.bsend) != len(s0.bsend):
			return mismatch("send length", len(s.bsend), len(s0.bsend))
		case len(s.brecv) != len(s0.brecv):
			return mismatch("receive length", len(s.brecv), len(s0.brecv))
		case s.op != s0.op:
			return mismatch("op", int(s.op), int(s0.op))
		case s.root != s0.root:
			return mismatch("root", s.root, s0.root)
		}
	}
	return nil
}

// AllReduce reduces buf over all ranks in place. Each rank reduces one
// chunk into a shared scratch buffer, then every rank copies the whole
// result: two passes over memory and no per-call allocation.
func (c *Comm) AllReduce(ctx context.Context, buf []float32, op comm.Op) error {
	var bad error
	if !op.Valid() {
		bad = fmt.Errorf("local: allreduce: invalid op %v", op)
	}
	if err := c.begin(ctx, slot{kind: comm.CAllReduce, send: buf, op: op, invalid: bad != nil}); err != nil {
		return err
	}
	if err := c.check(bad); err != nil {
		// Every rank found the same error: leave together.
		return c.end(ctx, comm.CAllReduce, err)
	}
	lo, hi := chunk(len(buf), c.w.size, c.rank)
	c.reduce(c.w.scratch[lo:hi], lo, op, sendOf)
	// The scratch is complete once every rank has passed this barrier.
	if err := c.w.wait(ctx, c.rank, closes|opens); err != nil {
		c.unpublish(err)
		return fmt.Errorf("local: allreduce: %w", err)
	}
	copy(buf, c.w.scratch[:len(buf)])
	if err := c.end(ctx, comm.CAllReduce, nil); err != nil {
		return err
	}
	n := comm.RingAllReduceBytes(int64(len(buf))*4, c.w.size)
	c.stats.Add(comm.CAllReduce, n, n)
	return nil
}

func sendOf(s *slot) []float32 { return s.send }

// reduce writes into dst the reduction over ranks, in ascending rank order,
// of elements [off, off+len(dst)) of each rank's buffer.
func (c *Comm) reduce(dst []float32, off int, op comm.Op, buf func(*slot) []float32) {
	n := len(dst)
	copy(dst, buf(&c.w.slots[0])[off:off+n])
	for j := 1; j < c.w.size; j++ {
		src := buf(&c.w.slots[j])[off : off+n]
		if op == comm.Max {
			for i, v := range src {
				if v > dst[i] {
					dst[i] = v
				}
			}
			continue
		}
		for i, v := range src {
			dst[i] += v
		}
	}
	if op == comm.Mean {
		inv := float32(c.w.size)
		for i := range dst {
			dst[i] /= inv
		}
	}
}

// chunk returns the bounds of rank r's part when n elements are cut into
// size parts of ceil(n/size).
func chunk(n, size, r int) (lo, hi int) {
	per := (n + size - 1) / size
	lo = min(r*per, n)
	hi = min(lo+per, n)
	return lo, hi
}

// ReduceScatter reduces send over all ranks and keeps chunk Rank() in recv.
func (c *Comm) ReduceScatter(ctx context.Context, send, recv []float32, op comm.Op) error {
	var bad error
	if !op.Valid() {
		bad = fmt.Errorf("local: reducescatter: invalid op %v", op)
	} else if len(send) != c.w.size*len(recv) {
		bad = fmt.Errorf("local: reducescatter: send length %d is not %d ranks x receive length %d",
			len(send), c.w.size, len(recv))
	}
	if err := c.begin(ctx, slot{kind: comm.CReduceScatter, send: send, recv: recv, op: op, invalid: bad != nil}); err != nil {
		return err
	}
	err := c.check(bad)
	if err == nil {
		c.reduce(recv, c.rank*len(recv), op, sendOf)
	}
	if err := c.end(ctx, comm.CReduceScatter, err); err != nil {
		return err
	}
	n := int64(len(send)-len(recv)) * 4
	c.stats.Add(comm.CReduceScatter, n, n)
	return nil
}

// AllGather concatenates every rank's send into recv.
func (c *Comm) AllGather(ctx context.Context, send, recv []float32) error {
	return allGather(c, ctx, slot{kind: comm.CAllGather, send: send, recv: recv}, send, recv,
		func(s *slot) []float32 { return s.send })
}

// AllGatherBytes concatenates every rank's send into recv.
func (c *Comm) AllGatherBytes(ctx context.Context, send, recv []byte) error {
	return allGather(c, ctx, slot{kind: comm.CAllGather, bytes: true, bsend: send, brecv: recv}, send, recv,
		func(s *slot) []byte { return s.bsend })
}

func allGather[T byte | float32](c *Comm, ctx context.Context, s slot, send, recv []T, peer func(*slot) []T) error {
	var bad error
	if len(recv) != c.w.size*len(send) {
		bad = fmt.Errorf("local: allgather: receive length %d is not %d ranks x send length %d",
			len(recv), c.w.size, len(send))
	}
	s.invalid = bad != nil
	if err := c.begin(ctx, s); err != nil {
		return err
	}
	err := c.check(bad)
	if err == nil {
		for j := 0; j < c.w.size; j++ {
			copy(recv[j*len(send):], peer(&c.w.slots[j]))
		}
	}
	if err := c.end(ctx, comm.CAllGather, err); err != nil {
		return err
	}
	n := int64(len(send)) * int64(sizeOf[T]()) * int64(c.w.size-1)
	c.stats.Add(comm.CAllGather, n, n)
	return nil
}

// AllToAll sends chunk j of send to rank j.
func (c *Comm) AllToAll(ctx context.Context, send, recv []float32) error {
	return allToAll(c, ctx, slot{kind: comm.CAllToAll, send: send, recv: recv}, send, recv,
		func(s *slot) []float32 { return s.send })
}

// AllToAllBytes sends chunk j of send to rank j.
func (c *Comm) AllToAllBytes(ctx context.Context, send, recv []byte) error {
	return allToAll(c, ctx, slot{kind: comm.CAllToAll, bytes: true, bsend: send, brecv: recv}, send, recv,
		func(s *slot) []byte { return s.bsend })
}

func allToAll[T byte | float32](c *Comm, ctx context.Context, s slot, send, recv []T, peer func(*slot) []T) error {
	var bad error
	if len(send) != len(recv) {
		bad = fmt.Errorf("local: alltoall: send length %d differs from receive length %d", len(send), len(recv))
	} else {
		bad = comm.CheckLen(comm.CAllToAll, "send", len(send), c.w.size)
	}
	s.invalid = bad != nil
	if err := c.begin(ctx, s); err != nil {
		return err
	}
	err := c.check(bad)
	if err == nil {
		k := len(send) / c.w.size
		for j := 0; j < c.w.size; j++ {
			copy(recv[j*k:(j+1)*k], peer(&c.w.slots[j])[c.rank*k:(c.rank+1)*k])
		}
	}
	if err := c.end(ctx, comm.CAllToAll, err); err != nil {
		return err
	}
	n := int64(len(send)/c.w.size) * int64(sizeOf[T]()) * int64(c.w.size-1)
	c.stats.Add(comm.CAllToAll, n, n)
	return nil
}

// Broadcast copies root's buf to every rank.
func (c *Comm) Broadcast(ctx context.Context, buf []float32, root int) error {
	return broadcast(c, ctx, slot{kind: comm.CBroadcast, send: buf, root: root}, buf, root,
		func(s *slot) []float32 { return s.send })
}

// BroadcastBytes copies root's buf to every rank.
func (c *Comm) BroadcastBytes(ctx context.Context, buf []byte, root int) error {
	return broadcast(c, ctx, slot{kind: comm.CBroadcast, bytes: true, bsend: buf, root: root}, buf, root,
		func(s *slot) []byte { return s.bsend })
}

func broadcast[T byte | float32](c *Comm, ctx context.Context, s slot, buf []T, root int, peer func(*slot) []T) error {
	var bad error
	if root < 0 || root >= c.w.size {
		bad = fmt.Errorf("local: broadcast: root %d out of range [0, %d)", root, c.w.size)
	}
	s.invalid = bad != nil
	if err := c.begin(ctx, s); err != nil {
		return err
	}
	err := c.check(bad)
	if err == nil && c.rank != root {
		copy(buf, peer(&c.w.slots[root]))
	}
	if err := c.end(ctx, comm.CBroadcast, err); err != nil {
		return err
	}
	n := int64(len(buf)) * int64(sizeOf[T]())
	if c.rank == root {
		c.stats.Add(comm.CBroadcast, n*int64(c.w.size-1), 0)
	} else {
		c.stats.Add(comm.CBroadcast, 0, n)
	}
	return nil
}

func sizeOf[T byte | float32]() int {
	var z T
	switch any(z).(type) {
	case float32:
		return 4
	}
	return 1
}

// Barrier waits for every rank.
func (c *Comm) Barrier(ctx context.Context) error {
	if err := c.begin(ctx, slot{kind: comm.CBarrier}); err != nil {
		return err
	}
	if err := c.end(ctx, comm.CBarrier, c.check(nil)); err != nil {
		return err
	}
	c.stats.Add(comm.CBarrier, 0, 0)
	return nil
}

// Split makes new groups of the ranks that pass the same color, ordered by
// key and then by rank. A negative color returns a nil Comm.
func (c *Comm) Split(ctx context.Context, color, key int) (comm.Comm, error) {
	if err := c.begin(ctx, slot{kind: comm.CSplit, color: color, key: key, node: c.node}); err != nil {
		return nil, err
	}
	err := c.check(nil)
	if err == nil && c.rank == 0 {
		c.w.split()
	}
	// end, reading this rank's result before the slot is unpublished.
	werr := c.w.wait(ctx, c.rank, closes)
	s := c.w.slots[c.rank].split
	c.unpublish(werr)
	if err != nil {
		return nil, err
	}
	if werr != nil {
		return nil, fmt.Errorf("local: %s: %w", comm.CSplit, werr)
	}
	c.stats.Add(comm.CSplit, 0, 0)
	if s == nil {
		return nil, nil
	}
	s.fam, s.parent = c.fam, c
	c.fam.Lock()
	c.splits = append(c.splits, s)
	c.fam.Unlock()
	return s, nil
}

// SplitNode returns the ranks of this rank's node (see WithRanksPerNode),
// ordered by rank. Communicators made by Split keep their ranks' nodes.
func (c *Comm) SplitNode(ctx context.Context) (comm.Comm, error) {
	return c.Split(ctx, c.node, c.rank)
}

// split builds the groups of a Split from the published colors and keys.
func (w *world) split() {
	groups := map[int][]int{}
	for r := range w.slots {
		if col := w.slots[r].color; col >= 0 {
			groups[col] = append(groups[col], r)
		}
	}
	for r := range w.slots {
		w.slots[r].split = nil
	}
	for _, members := range groups {
		slices.SortStableFunc(members, func(a, b int) int {
			return cmp.Or(cmp.Compare(w.slots[a].key, w.slots[b].key), cmp.Compare(a, b))
		})
		nw := newWorld(len(members))
		for i, r := range members {
			w.slots[r].split = &Comm{w: nw, rank: i, node: w.slots[r].node}
		}
	}
}

// CheckNotUnderMPI returns an error when the environment says this process
// is one rank of an MPI job of more than one rank, or of an unknown number
// (comm.MPIEnvironment), and nil otherwise (a one-rank job included).
// There, a program that runs its ranks in this process (New, Run) runs, in
// each of the job's processes, a group of its own: as many independent
// trainings as the launcher started processes, each writing the same
// files. New and Run call it themselves (AllowUnderMPI skips it); a program
// that picks its backend may call it first, to name its own flags in the
// error.
func CheckNotUnderMPI() error {
	job, ok := comm.MPIEnvironment()
	if !ok || job.Size == 1 {
		return nil
	}
	n := "each of its processes"
	if job.Size > 1 {
		n = fmt.Sprintf("each of its %d processes", job.Size)
	}
	return fmt.Errorf("local: this process is one rank of %s, and in-process ranks would make %s train a model of its own and write the same files as the others",
		job, n)
}
