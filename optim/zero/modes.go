package zero

import (
	"context"
	"fmt"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/quant"
)

// qgzReducer is the qgZ reduce-scatter of one bucket size.
type qgzReducer struct{ q *quant.QGZ }

func (r qgzReducer) reduceScatter(ctx context.Context, send, recv []float32) error {
	return r.q.ReduceScatter(ctx, send, recv)
}

// initQGZ builds the qgZ reduce-scatter of a bucket of b elements per rank
// on the layout l, which Adam then owns.
func (a *Adam) initQGZ(ctx context.Context, l *comm.Layout, b int) error {
	qc := quant.QGZConfig{Bits: a.cfg.ReduceScatter.bits(), GroupSize: a.cfg.GroupSize}
	q, err := quant.NewQGZ(ctx, l, a.world*b, qc)
	if err == nil && (q.PartLen() != b || q.Padded() != a.world*b) {
		err = fmt.Errorf("qgZ of %d elements on %d ranks has partitions of %d, padded to %d; want %d and %d",
			a.world*b, a.world, q.PartLen(), q.Padded(), b, a.world*b)
	}
	if err != nil {
		l.Close()
		return fmt.Errorf("zero: Adam: %w", err)
	}
	a.rs = qgzReducer{q}
	g := a.cfg.GroupSize
	if g == 0 {
		g = quant.DefaultGroupSize
	}
	// The qgZ's own float32 buffers: the partial sums of every node, one
	// partition and two scales per group.
	a.qgzFloats = l.Nodes*b + b + 2*quant.NumGroups(b, g)
	a.sub = []comm.Comm{l.Intra, l.Inter}
	a.close = l.Close
	return nil
}

// coalesced is the state of ReduceCoalesced: the coalesced reduce-scatter
// and the layout of its output, one slot of S elements per rank in which
// tensor i's chunk of ceil(n_i/W) sits at offset coffs[i]. The all-gather
// sends that output slot, overwritten with the updated parameters, bucket
// by bucket through Adam's staging buffer.
type coalesced struct {
	rs    *quant.Coalesced
	grads [][]float32 // the gradients, refreshed every step
	chunk []int       // ceil(n_i/W)
	coffs []int       // offset of tensor i's chunk in a slot; coffs[len] == S
	w     int
}

// floats counts the float32 buffers of the coalesced reduce-scatter: its
// flat input of W slots and its output slot, each with one status element.
func (co *coalesced) floats() int {
	return (co.w + 1) * (co.coffs[len(co.chunk)] + 1)
}

func (a *Adam) initCoalesced(ctx context.Context) error {
	w := a.world
	sizes := make([]int, len(a.params))
	for i, p := range a.params {
		sizes[i] = p.Numel()
	}
	rs, err := quant.NewCoalesced(ctx, a.c, sizes)
	if err != nil {
		return fmt.Errorf("zero: Adam: %w", err)
	}
	co := &coalesced{rs: rs, grads: make([][]float32, len(sizes)), chunk: make([]int, len(sizes)), coffs: make([]int, len(sizes)+1), w: w}
	off := 0
	for i, n := range sizes {
		c := (n + w - 1) / w
		co.chunk[i] = c
		co.coffs[i+1] = co.coffs[i] + c
		lo, hi := min(a.rank*c, n), min(a.rank*c+c, n)
		if glo, ghi := rs.Owned(i); glo != lo || ghi != hi {
			return fmt.Errorf("zero: Adam: coalesced reduce-scatter gives rank %d elements [%d, %d) of tensor %d, want [%d, %d)", a.rank, glo, ghi, i, lo, hi)
		}
		a.segs[i] = segment{lo, hi, off}
		off += hi - lo
	}
	slot := co.coffs[len(sizes)]
	if len(rs.Flat()) != slot {
		return fmt.Errorf("zero: Adam: coalesced reduce-scatter output of %d elements, want %d", len(rs.Flat()), slot)
	}
	a.co = co
	if slot > 0 {
		a.bucket = a.bucketLen(slot)
		a.stage = make([]float32, w*a.bucket)
	}
	return nil
}

// stepCoalesced reduce-scatters every gradient in one call, updates the
// owned chunks and all-gathers them.
func (a *Adam) stepCoalesced(ctx context.Context, lr, c1, c2 float32) error {
	co := a.co
	for i, p := range a.params {
		co.grads[i] = p.GradData()
	}
	outs, err := co.rs.ReduceScatter(ctx, co.grads)
	if err != nil {
		return fmt.Errorf("coalesced reduce-scatter of the gradients: %w", err)
	}
	for i := range a.params {
		a.adam(i, outs[i], lr, c1, c2)
	}
	send := co.rs.Flat()
	for i, p := range a.params {
		s := a.segs[i]
		dst := send[co.coffs[i]:co.coffs[i+1]]
		clear(dst[copy(dst, p.Data()[s.lo:s.hi]):])
	}
	b := a.bucket
	for x := 0; x < len(send); x += b {
		b = min(b, len(send)-x)
		stage := a.stage[:a.world*b]
		if err := a.c.AllGather(ctx, send[x:x+b], stage); err != nil {
			return fmt.Errorf("all-gather of the parameters: %w", err)
		}
		for j := range a.world {
			if j == a.rank {
				continue
			}
			src := stage[j*b : (j+1)*b]
			// Slot elements [x, x+b) of rank j: the chunks of the tensors
			// that intersect them.
			i, _ := slices.BinarySearch(co.coffs, x+1)
			for i--; i < len(a.params) && co.coffs[i] < x+b; i++ {
				ylo, yhi := max(x, co.coffs[i]), min(x+b, co.coffs[i+1])
				d := a.params[i].Data()
				lo := min(j*co.chunk[i]+ylo-co.coffs[i], len(d))
				hi := min(j*co.chunk[i]+yhi-co.coffs[i], len(d))
				copy(d[lo:hi], src[ylo-x:])
			}
		}
	}
	return nil
}
