package onebit

import (
	"context"
	"fmt"
	"strconv"
	"unsafe"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// Checkpoint entries of the fused buckets of 1-bit Adam and 0/1 Adam.
const (
	// IntBucketBytes is the bucket size the error buffers were made for;
	// IntBuckets the number of buckets. A checkpoint without them holds
	// one error buffer pair per parameter (made before buckets).
	IntBucketBytes = "bucket_bytes"
	IntBuckets     = "buckets"
	// IntBucketCut, where present, is the flat element at which the
	// buckets were cut besides every BucketBytes: 1-bit Muon's
	// WarmupAdamWOnly lays the Muon group's elements out first and cuts
	// the buckets where the AdamW group's begin.
	IntBucketCut = "bucket_cut"
)

// BucketWorkerErrorName and BucketServerErrorName name bucket k's error
// buffers in a checkpoint. They follow optim's naming rule for error
// buffers (optim.IsErrorBuffer), which optim.Checkpoint.ResetErrors drops.
func BucketWorkerErrorName(k int) string { return WorkerErrorPrefix + "bucket:" + strconv.Itoa(k) }

// BucketServerErrorName: see BucketWorkerErrorName.
func BucketServerErrorName(k int) string { return ServerErrorPrefix + "bucket:" + strconv.Itoa(k) }

// buckets cuts the parameters' flat buffer (every parameter's elements, in
// order) into contiguous buckets of at most bytes/4 elements, each
// compressed by its own AllReduce with its own error feedback. One
// collective per bucket replaces one per parameter, which is what makes
// models of many small tensors cheap to communicate.
type buckets struct {
	bytes  int
	cut    int      // a flat element every bucket ends at or starts after (0: none)
	split  int      // the buckets that end at or before cut
	bounds []int    // bucket k is flat[bounds[k]:bounds[k+1]]
	states []*State // per bucket
	names  []string // optim.PerParameter: the parameter of each bucket
}

// newBuckets makes the buckets of the flat buffer of params, whose
// elements are the parameters' in order, on world ranks (bytes 0:
// optim.DefaultBucketBytes; optim.PerParameter: one bucket per parameter). With one
// rank nothing is communicated and there are no buckets. The buckets'
// collectives share one set of wire buffers (see shareWire); keep says that
// each State keeps its gathered messages from one call to the next
// (StateCompact's momentum), which are then its own.
func newBuckets(params []*optim.Param, world, bytes int, keep bool) (*buckets, error) {
	return newCutBuckets(params, world, bytes, keep, 0)
}

// newCutBuckets is newBuckets whose buckets are also cut at flat element
// cut (0: nowhere), which must be the end of a parameter: no bucket then
// holds elements of both sides, and the first b.split buckets are the
// elements before it.
func newCutBuckets(params []*optim.Param, world, bytes int, keep bool, cut int) (*buckets, error) {
	if bytes == 0 {
		bytes = optim.DefaultBucketBytes
	}
	b := &buckets{bytes: bytes, cut: cut}
	n := 0
	for _, p := range params {
		n += p.Numel()
	}
	if world < 2 || n == 0 {
		return b, nil
	}
	add := func(lo, hi int) error {
		st, err := NewState(hi-lo, world)
		if err != nil {
			return samePackage{err}
		}
		b.bounds = append(b.bounds, lo)
		b.states = append(b.states, st)
		return nil
	}
	if bytes == optim.PerParameter {
		lo := 0
		for _, p := range params {
			if err := add(lo, lo+p.Numel()); err != nil {
				return nil, err
			}
			b.names = append(b.names, p.Name)
			lo += p.Numel()
		}
	} else {
		bounds := bucketBounds(n, max(bytes/4, 1), cut)
		for k := range len(bounds) - 1 {
			if err := add(bounds[k], bounds[k+1]); err != nil {
				return nil, err
			}
		}
	}
	b.bounds = append(b.bounds, n)
	for b.split < len(b.states) && b.bounds[b.split+1] <= cut {
		b.split++
	}
	b.shareWire(keep)
	return b, nil
}

// bucketBounds cuts n elements into buckets of at most per elements, also
// cut at element cut (0: nowhere): bucket k is [bounds[k], bounds[k+1]).
func bucketBounds(n, per, cut int) []int {
	bounds := []int{0}
	for lo := 0; lo < n; {
		hi := min(lo+per, n)
		if lo < cut && cut < hi {
			hi = cut
		}
		bounds = append(bounds, hi)
		lo = hi
	}
	return bounds
}

// shareWire lets every bucket's collective use one set of wire buffers,
// each as long as the longest bucket needs: the buckets' collectives run
// one after another, and nothing a call leaves in them is read by the next
// (State.shareWire). With keep the gathered messages, and the phase 1
// receive buffer under them, stay each bucket's own. A model of K buckets
// then holds the wire buffers of one bucket instead of K: 1-bit Adam's
// N/8 + N/8 bytes of them become about (N/8 + N/8)/K.
func (b *buckets) shareWire(keep bool) {
	if len(b.states) < 2 {
		return
	}
	var send, recv, signs, midSend, midRecv, server int
	for _, st := range b.states {
		send, recv = max(send, len(st.sendSigns)), max(recv, len(st.gathered))
		signs, midSend, midRecv = max(signs, len(st.blockSigns)), max(midSend, len(st.midSend)), max(midRecv, len(st.midRecv))
		server = max(server, len(st.server))
	}
	sendBuf, recvBuf := make([]byte, send), make([]byte, recv)
	signsBuf, midSendBuf, midRecvBuf := make([]byte, signs), make([]byte, midSend), make([]byte, midRecv)
	serverBuf := make([]float32, server)
	for _, st := range b.states {
		if sameStart(st.serverMsg, st.sendSigns) {
			st.serverMsg = prefix(sendBuf, len(st.serverMsg))
		}
		st.sendSigns = prefix(sendBuf, len(st.sendSigns))
		if !keep {
			st.recvSigns, st.gathered = prefix(recvBuf, len(st.recvSigns)), prefix(recvBuf, len(st.gathered))
		}
		st.blockSigns = prefix(signsBuf, len(st.blockSigns))
		if st.midSend != nil {
			st.midSend, st.midRecv = prefix(midSendBuf, len(st.midSend)), prefix(midRecvBuf, len(st.midRecv))
		}
		st.server = prefix(serverBuf, len(st.server))
	}
}

// ShareWire lets the collectives of states share one set of wire
// buffers (the packed signs sent and received, the phase 2 messages, the
// server's block), each as long as the longest state needs, as 1-bit
// Adam's buckets do: a model of K tensors then holds the wire buffers of
// one instead of K (about N/8 + N/8 bytes for N elements). The states
// must be of one group size, and their AllReduce calls must run one after
// another, never two at once; nothing a call leaves in these buffers is
// read by the next, so the results are the same bit for bit. It must be
// called before their first AllReduce; the error buffers stay each
// state's own.
func ShareWire(states ...*State) {
	(&buckets{states: states}).shareWire(false)
}

// prefix is buf[:n], capped at n like a buffer of its own.
func prefix[T any](buf []T, n int) []T { return buf[:n:n] }

// sameStart says whether a and b start at the same element.
func sameStart(a, b []byte) bool {
	return cap(a) > 0 && cap(b) > 0 && unsafe.SliceData(a[:1]) == unsafe.SliceData(b[:1])
}

// errorNames returns the checkpoint names of bucket k's error buffers.
func (b *buckets) errorNames(k int) (worker, server string) {
	if b.names != nil {
		return WorkerErrorPrefix + b.names[k], ServerErrorPrefix + b.names[k]
	}
	return BucketWorkerErrorName(k), BucketServerErrorName(k)
}

// allReduce runs the compressed allreduce of every bucket of flat.
func (b *buckets) allReduce(ctx context.Context, c comm.Comm, flat []float32) error {
	return b.allReduceFirst(ctx, c, flat, len(b.states))
}

// allReduceFirst runs the compressed allreduce of the first nb buckets of
// flat.
func (b *buckets) allReduceFirst(ctx context.Context, c comm.Comm, flat []float32, nb int) error {
	for k, st := range b.states[:nb] {
		if err := AllReduce(ctx, c, flat[b.bounds[k]:b.bounds[k+1]], st); err != nil {
			return fmt.Errorf("bucket %d of %d: %w", k, len(b.states), samePackage{err})
		}
	}
	return nil
}

// reset zeroes every bucket's error buffers.
func (b *buckets) reset() {
	for _, st := range b.states {
		st.Reset()
	}
}

// save adds the buckets and their error buffers to ck; we and se, if not
// nil, hold the worker and server errors to save in place of the States'
// own.
func (b *buckets) save(ck *optim.Checkpoint, we, se [][]float32) {
	ck.Ints[IntBucketBytes] = int64(b.bytes)
	ck.Ints[IntBuckets] = int64(len(b.states))
	if b.cut > 0 {
		ck.Ints[IntBucketCut] = int64(b.cut)
	}
	for k, st := range b.states {
		wn, sn := b.errorNames(k)
		w, s := []float32(st.WorkerError), []float32(st.ServerError)
		if we != nil {
			w = we[k]
		}
		if se != nil {
			s = se[k]
		}
		ck.AddTensor(wn, []int{len(w)}, w)
		ck.AddTensor(sn, []int{len(s)}, s)
	}
}

// check refuses a checkpoint whose error buffers do not fit these buckets:
// one made before buckets (per-parameter buffers) or with another bucket
// size. A checkpoint whose errors were reset on request fits any buckets.
func (b *buckets) check(ck *optim.Checkpoint) error {
	if len(b.states) == 0 || ck.ErrorsReset {
		return nil
	}
	size, okSize := ck.Ints[IntBucketBytes]
	count, okCount := ck.Ints[IntBuckets]
	switch {
	case b.bytes == optim.PerParameter && (!okSize || size == optim.PerParameter):
		// Per-parameter buffers, named by parameter, as before buckets;
		// restore checks their names and lengths.
		return nil
	case !okSize || !okCount:
		return fmt.Errorf("%w: its error buffers are per parameter (made before fused buckets); "+
			"set BucketBytes to optim.PerParameter to load it as it is, or load ck.ResetErrors() to continue with the error feedback restarted from zero",
			optim.ErrIncompatibleCheckpoint)
	case size == optim.PerParameter:
		return fmt.Errorf("%w: its error buffers are per parameter (BucketBytes optim.PerParameter), this optimizer has %d buckets of %d bytes; "+
			"use the same BucketBytes, or load ck.ResetErrors() to restart the error feedback",
			optim.ErrIncompatibleCheckpoint, len(b.states), b.bytes)
	case ck.Ints[IntBucketCut] != int64(b.cut):
		return fmt.Errorf("%w: made with its buckets cut at element %d, this optimizer cuts them at %d (0: nowhere; 1-bit Muon's WarmupAdamWOnly cuts them); "+
			"use the same settings, or load ck.ResetErrors() to restart the error feedback",
			optim.ErrIncompatibleCheckpoint, ck.Ints[IntBucketCut], b.cut)
	case size != int64(b.bytes) || count != int64(len(b.states)):
		return fmt.Errorf("%w: made with %d buckets of %d bytes, this optimizer has %d of %d; "+
			"use the same BucketBytes, or load ck.ResetErrors() to restart the error feedback",
			optim.ErrIncompatibleCheckpoint, count, size, len(b.states), b.bytes)
	}
	return nil
}

// restore stages the error buffers of ck for rs (after check).
func (b *buckets) restore(ck *optim.Checkpoint, rs *optim.Restore) {
	if ck.ErrorsReset {
		return
	}
	for k, st := range b.states {
		wn, sn := b.errorNames(k)
		rs.Tensor(wn, st.WorkerError)
		rs.Tensor(sn, st.ServerError)
	}
}

// flatten returns one buffer of the lengths of parts, in order, and parts
// re-pointed as views into it.
func flatten[T any](sizes []int) (flat []T, parts [][]T) {
	flat = make([]T, sum(sizes))
	parts = make([][]T, len(sizes))
	off := 0
	for i, s := range sizes {
		parts[i] = flat[off : off+s : off+s]
		off += s
	}
	return flat, parts
}
