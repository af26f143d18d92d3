package quant

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
)

// TwoLevel is the two-level (Fairring-style) reduce-scatter and the
// allreduce built on it, for M machines of D ranks each laid out
// node-major (comm.Layout: world rank = node*D + local). Exact float32,
// no compression: what it saves is cross-machine traffic, which it cuts to
// what the machines' sums need, two network hops whatever M is.
//
// Reduce-scatter of W = D*M chunks of K elements (rank r ends with chunk
// r, like comm.Comm's ReduceScatter):
//  1. inside the machine, reduce-scatter the tensor viewed as [D, M, K]
//     (chunk r = m*D+d seen as slice [d][m]): local rank d gets the
//     machine's sum of its slices [d][0..M), M*K elements (an all-to-all
//     and a sum in ascending local rank order);
//  2. on the rail (the ranks of local index d on every machine, the
//     layout's Inter communicator), all-to-all: slice [d][m] goes to
//     machine m;
//  3. sum what arrives in ascending machine order and divide by W.
//
// The allreduce runs the reduce-scatter and then the reverse: all-gather
// on the rail, then inside the machine. As no rank needs a given chunk in
// between, it works on the buffer itself as [D, M, K] (rank (m, d) reduces
// slice [d][m]) and moves no data but the collectives'. Each rank sends (M-1)*K elements
// across machines in each half (about 2(M-1)/W of the tensor for the
// allreduce, against 2(W-1)/W for a flat ring, whose slowest link carries
// that much whichever machines it joins) and (D-1)*M*K inside its machine.
//
// Results are the mean. The partial sums are float32 in ascending order
// inside each level; with D = 1 or M = 1 that is ascending rank order, so
// on comm/local the result is bit-identical to comm.Comm's AllReduce and
// ReduceScatter with comm.Mean (which sum in ascending rank order, then
// divide); otherwise it differs from them by float32 rounding only (the
// machine sums are added together instead of rank by rank).
//
// A large allreduce (slices of 128K elements and more, on communicators
// that can overlap their collectives: comm.CanOverlap) is pipelined: its
// slices are cut into up to 32 pieces of at least 64K elements, and the
// rail's collectives of one piece run on a second goroutine while the
// node's collectives of the next run on the caller's, with the same result
// bit for bit. Its pieces are messages of 256 KiB and more: over Open MPI's
// TCP transport, whose rendezvous costs a round trip per message beyond
// 64 KiB, raise the eager limit (mpirun --mca btl_tcp_eager_limit 4194304
// --mca btl_tcp_rndv_eager_limit 4194304; scripts/bench-twolevel.sh
// measured 580-610 ms instead of 690-770 ms at 64 MiB over 1 Gbit).
//
// Every call starts with a small all-gather of each rank's lengths, so
// that lengths that differ across ranks, or that do not fit the group, are
// the same clear error on every rank. A TwoLevel keeps its buffers between
// calls: after the first call at a given size a call allocates nothing
// (on comm/local), except that a pipelined allreduce allocates its second
// goroutine and a cancellable context on every call: a few small objects
// (4 on Go 1.26), whatever the tensor's size. It is used by one goroutine
// at a time.
type TwoLevel struct {
	l    *comm.Layout
	d, m int // ranks per machine, machines

	perm  []float32 // reduce-scatter: the send buffer as [D, M, K]; allreduce: the padded buffer
	inbox []float32 // the slices received inside the machine, [D, M, K]
	part  []float32 // this rank's machine sums of its slices, [M, K]
	rail  []float32 // the slices received on the rail, [M, K]
	own   []float32 // this rank's chunk of the mean, K

	// pieces, when > 0, overrides how many pieces a pipelined allreduce
	// cuts its slices into (tests); pipe holds its staging buffers.
	pieces int
	pipe   pipeBufs

	hdr  []byte // this rank's call and lengths
	hdrs []byte // every rank's

	calls          int64
	intra0, inter0 int64 // bytes sent on Intra and Inter when t was made
}

// TwoLevelStats is what a TwoLevel has done so far on this rank.
type TwoLevelStats struct {
	Calls int64 // completed calls (ReduceScatter and AllReduce)
	// IntraBytes and InterBytes are the bytes this rank sent inside its
	// machine and across machines (on the rail), from the layout's
	// communicators' Stats, since NewTwoLevel. The small length
	// all-gather runs on the whole group and is in neither.
	IntraBytes, InterBytes int64
}

// twoLevelHeader is one rank's entry of the length all-gather: the call
// (1 reduce-scatter, 2 allreduce) and two lengths, little-endian uint64.
const twoLevelHeader = 24

// NewTwoLevel returns the two-level collectives on layout l (see
// comm.NewLayout, whose checks make every rank agree on its shape). It
// checks that l is complete and consistent: D*M ranks in World, D in
// Intra, M in Inter. Any D >= 1 and M >= 1 work; with D = 1 or M = 1 the
// level of size 1 costs nothing.
func NewTwoLevel(l *comm.Layout) (*TwoLevel, error) {
	if l == nil || l.World == nil || l.Intra == nil || l.Inter == nil {
		return nil, errors.New("quant: two-level: incomplete layout (make it with comm.NewLayout)")
	}
	d, m := l.RanksPerNode, l.Nodes
	w := l.World.Size()
	switch {
	case d < 1 || m < 1:
		return nil, fmt.Errorf("quant: two-level: layout of %d nodes x %d ranks", m, d)
	case d*m != w:
		return nil, fmt.Errorf("quant: two-level: layout of %d nodes x %d ranks does not cover the %d ranks of the group", m, d, w)
	case l.Intra.Size() != d || l.Inter.Size() != m:
		return nil, fmt.Errorf("quant: two-level: layout of %d nodes x %d ranks has node communicators of %d ranks and rails of %d",
			m, d, l.Intra.Size(), l.Inter.Size())
	case l.Node*d+l.Local != l.World.Rank() || l.Intra.Rank() != l.Local || l.Inter.Rank() != l.Node:
		return nil, fmt.Errorf("quant: two-level: rank %d is not node-major in its layout (node %d, local %d)",
			l.World.Rank(), l.Node, l.Local)
	}
	return &TwoLevel{
		l: l, d: d, m: m,
		hdr:    make([]byte, twoLevelHeader),
		hdrs:   make([]byte, twoLevelHeader*w),
		intra0: l.Intra.Stats().Total().BytesSent,
		inter0: l.Inter.Stats().Total().BytesSent,
	}, nil
}

// Layout is the layout t runs on.
func (t *TwoLevel) Layout() *comm.Layout { return t.l }

// Stats returns t's call count and the bytes this rank sent per level.
func (t *TwoLevel) Stats() TwoLevelStats {
	return TwoLevelStats{
		Calls:      t.calls,
		IntraBytes: t.l.Intra.Stats().Total().BytesSent - t.intra0,
		InterBytes: t.l.Inter.Stats().Total().BytesSent - t.inter0,
	}
}

// ReduceScatter leaves in recv, on every rank r, chunk r of the mean over
// the ranks of send: len(send) == W*len(recv), and every rank must pass the
// same lengths (anything else is an error on every rank). send is not
// modified.
func (t *TwoLevel) ReduceScatter(ctx context.Context, send, recv []float32) error {
	if ctx == nil {
		ctx = context.Background() // comm's rule for a nil context
	}
	k := len(recv)
	if err := t.agree(ctx, 1, len(send), len(recv)); err != nil {
		return err
	}
	if k == 0 {
		t.calls++
		return nil
	}
	t.grow(k)
	t.promise(1)
	if err := t.reduce(ctx, t.arrange(send, k), k, recv); err != nil {
		t.promise(0)
		return fmt.Errorf("quant: two-level reduce-scatter: %w", err)
	}
	t.calls++
	return nil
}

// AllReduce replaces buf, on every rank, with the mean over the ranks of
// buf: the two-level reduce-scatter, then an all-gather on the rail and one
// inside the machine. Every rank must pass the same len(buf) (else an error
// on every rank); a length that is not a multiple of W is padded with
// zeros inside.
func (t *TwoLevel) AllReduce(ctx context.Context, buf []float32) error {
	if ctx == nil {
		ctx = context.Background() // comm's rule for a nil context
	}
	w := t.d * t.m
	n := len(buf)
	if err := t.agree(ctx, 2, n, 0); err != nil {
		return err
	}
	if n == 0 {
		t.calls++
		return nil
	}
	k := (n + w - 1) / w
	t.grow(k)
	// Which rank owns which slice is free here: this rank (node m, local
	// d) owns slice [d][m] of the buffer itself viewed as [D, M, K], so
	// nothing is transposed (only a length that is not a multiple of W is
	// copied, to pad it).
	perm := buf
	if n != w*k {
		perm = t.scratch(w * k)
		copy(perm, buf)
		clear(perm[n:])
	}
	var err error
	if p := t.pipePieces(k); p > 1 {
		t.promise(2 * p)
		err = t.pipelined(ctx, perm, k, p)
	} else {
		t.promise(2)
		err = t.allReduce(ctx, perm, k)
	}
	if err != nil {
		t.promise(0)
		return fmt.Errorf("quant: two-level allreduce: %w", err)
	}
	if n != w*k {
		copy(buf, perm)
	}
	t.calls++
	return nil
}

// allReduce is AllReduce on perm ([D, M, K]) in one piece: the
// reduce-scatter, then the reverse: a rail all-gather into this rank's
// slices [d][0..M), then an all-gather of the slices inside the machine.
func (t *TwoLevel) allReduce(ctx context.Context, perm []float32, k int) error {
	own := t.own[:k]
	if err := t.reduce(ctx, perm, k, own); err != nil {
		return err
	}
	part := perm[:t.m*k] // with one rank per machine, the slices are the tensor
	if t.d > 1 {
		part = t.part[:t.m*k]
	}
	if t.m > 1 {
		if err := t.l.Inter.AllGather(ctx, own, part); err != nil {
			return fmt.Errorf("rail all-gather: %w", err)
		}
	} else {
		copy(part, own)
	}
	if t.d > 1 {
		if err := t.l.Intra.AllGather(ctx, part, perm); err != nil {
			return fmt.Errorf("node all-gather: %w", err)
		}
	}
	return nil
}

// reduce runs the reduce-scatter proper on perm, the tensor viewed as
// [D, M, K], and leaves this rank's chunk of the mean in out (K elements).
func (t *TwoLevel) reduce(ctx context.Context, perm []float32, k int, out []float32) error {
	d, m := t.d, t.m
	// 1. Inside the machine: this rank gets the sums of its slices, as an
	// all-to-all and a sum in ascending local rank order (rather than the
	// backend's reduce-scatter: the order is then the same on every
	// backend, and Open MPI's MPI_Reduce_scatter_block can move the whole
	// tensor through one rank).
	part := perm[:m*k]
	if d > 1 {
		if cap(t.inbox) < d*m*k {
			t.inbox = make([]float32, d*m*k)
		}
		inbox := t.inbox[:d*m*k]
		if err := t.l.Intra.AllToAll(ctx, perm, inbox); err != nil {
			return fmt.Errorf("node all-to-all: %w", err)
		}
		part = t.part[:m*k]
		copy(part, inbox[:m*k])
		for j := 1; j < d; j++ {
			addTo(part, inbox[j*m*k:(j+1)*m*k])
		}
	}
	// 2. On the rail: slice [d][m] to machine m.
	rail := part
	if m > 1 {
		rail = t.rail[:m*k]
		if err := t.l.Inter.AllToAll(ctx, part, rail); err != nil {
			return fmt.Errorf("rail all-to-all: %w", err)
		}
	}
	// 3. Sum in ascending machine order, then the mean.
	copy(out, rail[:k])
	for j := 1; j < m; j++ {
		addTo(out, rail[j*k:(j+1)*k])
	}
	if w := d * m; w > 1 {
		fw := float32(w)
		for i := range out {
			out[i] /= fw
		}
	}
	return nil
}

// promise tells the node's and the rail's communicators that each of
// their next n collectives comes with arguments every rank has agreed on
// (comm.SkipChecks): every length of a call derives from the tensor length
// agree has just checked and from the layout, so the backend's own check
// of each collective (a round trip on MPI) would only add latency.
// promise(0) cancels what a failed call left of it.
func (t *TwoLevel) promise(n int) {
	if t.d > 1 {
		comm.SkipChecks(t.l.Intra, n)
	}
	if t.m > 1 {
		comm.SkipChecks(t.l.Inter, n)
	}
}

// addTo adds src to acc element by element.
func addTo(acc, src []float32) {
	src = src[:len(acc)]
	for i := range acc {
		acc[i] += src[i]
	}
}

// identity reports whether the [D, M, K] view is the tensor's own order:
// with one rank per machine or one machine.
func (t *TwoLevel) identity() bool { return t.d == 1 || t.m == 1 }

// arrange returns src (len(src) <= W*k) viewed as [D, M, K]: slice [d][m]
// is chunk m*D+d, zero-padded. That is src itself when the layout keeps
// the order and nothing needs padding; otherwise a copy in t.perm.
func (t *TwoLevel) arrange(src []float32, k int) []float32 {
	d, m := t.d, t.m
	if t.identity() && len(src) == d*m*k {
		return src
	}
	perm := t.scratch(d * m * k)
	for dd := 0; dd < d; dd++ {
		for mm := 0; mm < m; mm++ {
			dst := perm[(dd*m+mm)*k : (dd*m+mm+1)*k]
			lo := min((mm*d+dd)*k, len(src))
			hi := min(lo+k, len(src))
			copy(dst, src[lo:hi])
			clear(dst[hi-lo:])
		}
	}
	return perm
}

// scratch returns t.perm with n elements, grown if needed.
func (t *TwoLevel) scratch(n int) []float32 {
	if cap(t.perm) < n {
		t.perm = make([]float32, n)
	}
	return t.perm[:n]
}

// grow sizes the buffers for chunks of k elements; they only grow. The
// [D, M, K] copy is made by arrange, only where the layout needs one.
func (t *TwoLevel) grow(k int) {
	d, m := t.d, t.m
	if cap(t.own) < k {
		t.own = make([]float32, k)
	}
	if d > 1 && cap(t.part) < m*k {
		t.part = make([]float32, m*k)
	}
	if m > 1 && cap(t.rail) < m*k {
		t.rail = make([]float32, m*k)
	}
	t.own, t.part, t.rail = t.own[:cap(t.own)], t.part[:cap(t.part)], t.rail[:cap(t.rail)]
}

// agree all-gathers every rank's call and lengths over the whole group and
// returns the same error on every rank when they differ, or when the
// reduce-scatter's lengths do not fit the group.
func (t *TwoLevel) agree(ctx context.Context, call, a, b int) error {
	name := "reduce-scatter"
	if call == 2 {
		name = "allreduce"
	}
	binary.LittleEndian.PutUint64(t.hdr[0:], uint64(call))
	binary.LittleEndian.PutUint64(t.hdr[8:], uint64(a))
	binary.LittleEndian.PutUint64(t.hdr[16:], uint64(b))
	if err := t.l.World.AllGatherBytes(ctx, t.hdr, t.hdrs); err != nil {
		return fmt.Errorf("quant: two-level %s: exchanging lengths: %w", name, err)
	}
	w := t.d * t.m
	field := func(j, f int) int { return int(binary.LittleEndian.Uint64(t.hdrs[j*twoLevelHeader+8*f:])) }
	for j := 1; j < w; j++ {
		for f, what := range [3]string{"two-level call", "two-level send length", "two-level receive length"} {
			if call == 2 && f == 1 {
				what = "two-level tensor length"
			}
			if got, want := field(j, f), field(0, f); got != want {
				return fmt.Errorf("quant: two-level %s: %w", name, &comm.MismatchError{
					Collective: comm.CAllGather, What: what, Rank: j, Got: got, Want: want})
			}
		}
	}
	if call == 1 && a != w*b {
		return fmt.Errorf("quant: two-level reduce-scatter: send length %d is not %d ranks x receive length %d (%d nodes x %d ranks)",
			a, w, b, t.m, t.d)
	}
	return nil
}

// pipeMinPiece is the fewest elements per slice a piece of a pipelined
// allreduce carries, and pipeMaxPieces the most pieces it is cut into.
// Measured on 2 machines x 2 ranks joined by 1 Gbit TCP
// (scripts/bench-twolevel.sh, 64 MiB, runs of one session): with Open
// MPI's TCP rendezvous for messages beyond 64 KiB, pieces of 128K elements
// (32 of them) took 690-750 ms against 780-850 ms for 8 pieces of 512K;
// with the eager limit raised to 4 MiB, 580-590 ms against 640 ms.
const (
	pipeMinPiece  = 64 << 10
	pipeMaxPieces = 32
)

// pipePieces is how many pieces an allreduce with slices of k elements is
// pipelined in: 1 (not pipelined) with one machine or one rank per
// machine, when the communicators cannot overlap their collectives
// (comm.CanOverlap), or when the slices are small.
func (t *TwoLevel) pipePieces(k int) int {
	if t.d == 1 || t.m == 1 || !comm.CanOverlap(t.l.Intra, t.l.Inter) {
		return 1
	}
	p := max(1, min(k/pipeMinPiece, pipeMaxPieces))
	if t.pieces > 0 {
		p = min(t.pieces, k)
	}
	// As many pieces as ceil(k/p) elements make, so that none is empty.
	piece := (k + p - 1) / p
	return (k + piece - 1) / piece
}

// pipeBufs are the staging buffers of a pipelined allreduce: the steps on
// the node run on the caller's goroutine and those on the rail on another,
// each with buffers of its own.
type pipeBufs struct {
	nodeSend, nodeRecv []float32 // [D, M, piece]
	railSend, railRecv []float32 // [M, piece]

	// reduced carries the pieces of part the node has summed, gathered
	// those the rail has filled back, railErr the rail's result. They are
	// empty between calls; a failed call drops them (it may leave pieces
	// in them) and the next call makes new ones.
	reduced, gathered chan int
	railErr           chan error
}

// span cuts slices of k elements into pieces of piece elements.
type span struct{ piece, k int }

// bounds returns the range [lo, hi) of piece q.
func (s span) bounds(q int) (lo, hi int) { return q * s.piece, min((q+1)*s.piece, s.k) }

// pipelined is AllReduce's reduce-scatter and all-gathers on perm ([D, M,
// K]) with the slices cut into p pieces along K, so that the node's and the
// rail's collectives overlap: while the rail exchanges piece q, the node
// all-to-alls piece q+1. The caller's goroutine runs the node's steps
// (all-to-all and sum of every piece, then the all-gather of every piece
// as the rail hands it back), a second goroutine the rail's (all-to-all,
// sum and mean, all-gather, piece by piece). Every element is summed in
// the same order as in reduce, so the result is bit-identical to the
// unpipelined allreduce. The collectives on each communicator come in the
// same order on every rank.
func (t *TwoLevel) pipelined(ctx context.Context, perm []float32, k, p int) error {
	d, m := t.d, t.m
	piece := (k + p - 1) / p
	pb := &t.pipe
	if cap(pb.nodeSend) < d*m*piece {
		pb.nodeSend, pb.nodeRecv = make([]float32, d*m*piece), make([]float32, d*m*piece)
	}
	if cap(pb.railSend) < m*piece {
		pb.railSend, pb.railRecv = make([]float32, m*piece), make([]float32, m*piece)
	}
	if cap(pb.reduced) < p {
		pb.reduced, pb.gathered = make(chan int, p), make(chan int, p)
	}
	if pb.railErr == nil {
		pb.railErr = make(chan error, 1)
	}
	part := t.part[:m*k]
	sp := span{piece: piece, k: k}
	reduced, gathered, railErr := pb.reduced, pb.gathered, pb.railErr

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		err := t.railSteps(ctx, part, p, sp, reduced, gathered)
		if err != nil {
			cancel()
		}
		railErr <- err
	}()
	err := t.nodeSteps(ctx, perm, part, p, sp, reduced, gathered)
	if err != nil {
		cancel()
	}
	if rerr := <-railErr; err == nil || errors.Is(err, context.Canceled) && rerr != nil {
		err = rerr
	}
	if err != nil {
		pb.reduced, pb.gathered = nil, nil
	}
	return err
}

// nodeSteps is the node's half of pipelined: for every piece the node
// all-to-all and the sum of this rank's slices into part, then for every
// piece the rail has filled back the node all-gather into perm.
func (t *TwoLevel) nodeSteps(ctx context.Context, perm, part []float32, p int,
	sp span, reduced chan<- int, gathered <-chan int) error {
	d, m, k := t.d, t.m, sp.k
	pb := &t.pipe
	for q := range p {
		lo, hi := sp.bounds(q)
		n := hi - lo
		send, recv := pb.nodeSend[:d*m*n], pb.nodeRecv[:d*m*n]
		pieceOf(send, perm, d*m, k, lo, hi) // slice [dd][mm] goes to local rank dd
		if err := t.l.Intra.AllToAll(ctx, send, recv); err != nil {
			return fmt.Errorf("node all-to-all: %w", err)
		}
		for mm := range m {
			acc := part[mm*k+lo : mm*k+hi]
			copy(acc, recv[mm*n:(mm+1)*n])
			for j := 1; j < d; j++ {
				addTo(acc, recv[(j*m+mm)*n:(j*m+mm+1)*n])
			}
		}
		reduced <- q
	}
	for range p {
		q, err := receive(ctx, gathered)
		if err != nil {
			return err
		}
		lo, hi := sp.bounds(q)
		n := hi - lo
		send, recv := pb.nodeSend[:m*n], pb.nodeRecv[:d*m*n]
		pieceOf(send, part, m, k, lo, hi)
		if err := t.l.Intra.AllGather(ctx, send, recv); err != nil {
			return fmt.Errorf("node all-gather: %w", err)
		}
		setPiece(perm, recv, d*m, k, lo, hi)
	}
	return nil
}

// railSteps is the rail's half of pipelined: for every piece the node has
// summed, the rail all-to-all, the sum in ascending machine order and the
// mean, the rail all-gather back into part.
func (t *TwoLevel) railSteps(ctx context.Context, part []float32, p int,
	sp span, reduced <-chan int, gathered chan<- int) error {
	m, k := t.m, sp.k
	w := float32(t.d * m)
	pb := &t.pipe
	for range p {
		q, err := receive(ctx, reduced)
		if err != nil {
			return err
		}
		lo, hi := sp.bounds(q)
		n := hi - lo
		send, recv := pb.railSend[:m*n], pb.railRecv[:m*n]
		pieceOf(send, part, m, k, lo, hi)
		if err := t.l.Inter.AllToAll(ctx, send, recv); err != nil {
			return fmt.Errorf("rail all-to-all: %w", err)
		}
		own := t.own[lo:hi]
		copy(own, recv[:n])
		for j := 1; j < m; j++ {
			addTo(own, recv[j*n:(j+1)*n])
		}
		for i := range own {
			own[i] /= w
		}
		if err := t.l.Inter.AllGather(ctx, own, recv); err != nil {
			return fmt.Errorf("rail all-gather: %w", err)
		}
		setPiece(part, recv, m, k, lo, hi)
		gathered <- q
	}
	return nil
}

// receive returns the next piece from ch, or the context's error once it
// is done.
func receive(ctx context.Context, ch <-chan int) (int, error) {
	select {
	case q := <-ch:
		return q, nil
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// pieceOf copies piece [lo, hi) of each of the m slices of src ([m, k])
// into dst ([m, hi-lo]).
func pieceOf(dst, src []float32, m, k, lo, hi int) {
	n := hi - lo
	for s := range m {
		copy(dst[s*n:(s+1)*n], src[s*k+lo:s*k+hi])
	}
}

// setPiece is the reverse of pieceOf: it copies src ([m, hi-lo]) into
// piece [lo, hi) of each of the m slices of dst ([m, k]).
func setPiece(dst, src []float32, m, k, lo, hi int) {
	n := hi - lo
	for s := range m {
		copy(dst[s*k+lo:s*k+hi], src[s*n:(s+1)*n])
	}
}
