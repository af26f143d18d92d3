package quant

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"

	"github.com/lowbit-ml/lowbit/comm"
)

// Coalesced is the coalesced reduce-scatter of the spec (quant.md): a list
// of tensors, the same sizes on every rank, reduced with one exact
// reduce-scatter of one flat buffer.
//
// Tensor i of n_i elements is cut into W chunks of c_i = ceil(n_i/W); rank
// r owns [r*c_i, min((r+1)*c_i, n_i)) (trailing ranks may own fewer or no
// elements). The flat buffer holds W slots, slot r being the parts rank r
// owns of every tensor in order, each padded with zeros to c_i, followed by
// one status element (0, or 1 from a rank that called with tensors that
// do not match its sizes, so that every rank reports such a call). One
// reduce-scatter with comm.Mean leaves rank r its slot: the mean over
// ranks, returned as views into one buffer.
//
// A Coalesced allocates its buffers once; a call allocates nothing. It is
// used by one goroutine at a time; all ranks call ReduceScatter together.
type Coalesced struct {
	c     comm.Comm
	sizes []int
	off   []int // offset of tensor i in a slot
	chunk []int // c_i
	owned []int // elements of tensor i this rank owns
	slot  int   // sum of c_i, plus the status element
	send  []float32
	recv  []float32
	outs  [][]float32
}

// NewCoalesced returns a Coalesced for tensors of the given sizes
// (element counts) on c. Every rank of c must call it together: it runs
// one small all-gather so that a negative size on any rank, and tensor
// counts or sizes that differ across ranks, are an error on every rank.
func NewCoalesced(ctx context.Context, c comm.Comm, sizes []int) (*Coalesced, error) {
	if c == nil {
		return nil, errors.New("quant: coalesced: nil communicator")
	}
	w, rank := c.Size(), c.Rank()
	h := fnv.New64a()
	var b [8]byte
	bad := 0
	for i, n := range sizes {
		if n < 0 && bad == 0 {
			bad = i + 1
		}
		binary.LittleEndian.PutUint64(b[:], uint64(int64(n)))
		h.Write(b[:])
	}
	send := make([]byte, 24)
	binary.LittleEndian.PutUint64(send[0:], uint64(len(sizes)))
	binary.LittleEndian.PutUint64(send[8:], h.Sum64())
	binary.LittleEndian.PutUint64(send[16:], uint64(bad))
	all := make([]byte, 24*w)
	if err := c.AllGatherBytes(ctx, send, all); err != nil {
		return nil, fmt.Errorf("quant: coalesced: agreeing on the sizes: %w", err)
	}
	for r := 0; r < w; r++ {
		p := all[24*r:]
		if i := int(binary.LittleEndian.Uint64(p[16:])); i != 0 {
			return nil, fmt.Errorf("quant: coalesced: rank %d: tensor %d has a negative size", r, i-1)
		}
		if got, want := int(binary.LittleEndian.Uint64(p[0:])), int(binary.LittleEndian.Uint64(all[0:])); got != want {
			return nil, fmt.Errorf("quant: coalesced: %w", &comm.MismatchError{
				Collective: comm.CAllGather, What: "tensor count", Rank: r, Got: got, Want: want})
		}
		if binary.LittleEndian.Uint64(p[8:]) != binary.LittleEndian.Uint64(all[8:]) {
			return nil, fmt.Errorf("quant: coalesced: rank %d has tensor sizes that differ from rank 0's", r)
		}
	}

	rc := &Coalesced{c: c, sizes: append([]int(nil), sizes...),
		off: make([]int, len(sizes)), chunk: make([]int, len(sizes)), owned: make([]int, len(sizes))}
	s := 0
	for i, n := range sizes {
		rc.chunk[i] = (n + w - 1) / w
		rc.off[i] = s
		s += rc.chunk[i]
		lo, hi := rc.bounds(i, rank)
		rc.owned[i] = hi - lo
	}
	rc.slot = s + 1
	rc.send = make([]float32, w*rc.slot)
	rc.recv = make([]float32, rc.slot)
	rc.outs = make([][]float32, len(sizes))
	for i := range sizes {
		rc.outs[i] = rc.recv[rc.off[i] : rc.off[i]+rc.owned[i] : rc.off[i]+rc.owned[i]]
	}
	return rc, nil
}

// bounds is the range of tensor i that rank r owns.
func (r *Coalesced) bounds(i, rank int) (lo, hi int) {
	n := r.sizes[i]
	lo = min(rank*r.chunk[i], n)
	return lo, min(lo+r.chunk[i], n)
}

// Owned returns the range [lo, hi) of tensor i that this rank owns.
func (r *Coalesced) Owned(i int) (lo, hi int) { return r.bounds(i, r.c.Rank()) }

// Flat returns the whole owned buffer: every tensor's owned part in
// tensor order, each slot padded to ceil(n_i/W). It holds the last call's
// result.
func (r *Coalesced) Flat() []float32 { return r.recv[:r.slot-1] }

// ReduceScatter returns one output per tensor: the part of tensor i this
// rank owns (possibly empty), the mean over ranks, as views into one
// buffer owned by r, valid until the next call. inputs must match the
// sizes r was made with; a rank that calls with other tensors still takes
// part, so that every rank returns the error.
func (r *Coalesced) ReduceScatter(ctx context.Context, inputs [][]float32) ([][]float32, error) {
	mismatch := r.check(inputs)
	for k := 0; k*r.slot < len(r.send); k++ {
		slot := r.send[k*r.slot : (k+1)*r.slot]
		if mismatch != nil {
			slot[r.slot-1] = 1
			continue
		}
		slot[r.slot-1] = 0
		for i, x := range inputs {
			lo, hi := r.bounds(i, k)
			dst := slot[r.off[i] : r.off[i]+r.chunk[i]]
			clear(dst[copy(dst, x[lo:hi]):])
		}
	}
	if err := r.c.ReduceScatter(ctx, r.send, r.recv, comm.Mean); err != nil {
		return nil, fmt.Errorf("quant: coalesced: %w", err)
	}
	if mismatch != nil {
		return nil, mismatch
	}
	if r.recv[r.slot-1] != 0 {
		return nil, errors.New("quant: coalesced: another rank called ReduceScatter with tensors that differ from the sizes it was made with")
	}
	return r.outs, nil
}

func (r *Coalesced) check(inputs [][]float32) error {
	if len(inputs) != len(r.sizes) {
		return fmt.Errorf("quant: coalesced: rank %d: %d tensors, made for %d", r.c.Rank(), len(inputs), len(r.sizes))
	}
	for i, x := range inputs {
		if len(x) != r.sizes[i] {
			return fmt.Errorf("quant: coalesced: rank %d: tensor %d has %d elements, made for %d", r.c.Rank(), i, len(x), r.sizes[i])
		}
	}
	return nil
}
