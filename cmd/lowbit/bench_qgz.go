package main

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/quant"
)

// The quantized and coalesced reduce-scatters of package quant in lowbit
// bench: qgz4 and qgz8 (the hierarchical quantized reduce-scatter with
// int4 or int8 codes, on a layout of --ranks-per-node ranks per node) and
// rsc (the coalesced reduce-scatter of a list of tensors). All three
// return the mean; --check compares it with the exact float64 mean.

// Relative errors above which --check fails for the quantized
// reduce-scatters (one call, no error feedback, inputs uniform in [-1, 1)).
// Measured on the check's data, 2 to 8 ranks in nodes of 2 and 3, 256 B to
// 16 MiB: at most 0.127 (qgz4) and 0.0075 (qgz8), the quantization error
// of 4 and 8 bits, nearly independent of size and layout. The bounds leave
// a margin of about 25%; a misplaced partition (about 1.4), a lost node's
// share or a wrong scale is far above them.
const (
	qgz4Tolerance = 0.16
	qgz8Tolerance = 0.0095
)

// isQuantBench reports whether name is one of this file's collectives.
func isQuantBench(name string) bool { return name == "qgz4" || name == "qgz8" || name == "rsc" }

// newQuantBenchCase makes the case of qgz4, qgz8 or rsc for elems float32
// per rank on c. qgz cases build their layout here (a collective call on
// c); close releases it.
func newQuantBenchCase(ctx context.Context, name string, c comm.Comm, rpn, elems int) (*benchCase, error) {
	w, rank := c.Size(), c.Rank()
	switch name {
	case "qgz4", "qgz8":
		bits, tol := 4, qgz4Tolerance
		if name == "qgz8" {
			bits, tol = 8, qgz8Tolerance
		}
		l, err := comm.NewLayout(ctx, c, rpn)
		if err != nil {
			return nil, err
		}
		q, err := quant.NewQGZ(ctx, l, elems, quant.QGZConfig{Bits: bits})
		if err != nil {
			l.Close()
			return nil, err
		}
		send, recv := make([]float32, elems), make([]float32, q.PartLen())
		fillInput(send, rank, 0)
		p := q.PartLen()
		return &benchCase{
			elems: elems,
			run:   func(ctx context.Context) error { return q.ReduceScatter(ctx, send, recv) },
			check: func() (float64, float64) {
				valid := recv[:max(0, min(p, elems-rank*p))]
				return sqDist(valid, func(i int) float64 { return meanInput(w, rank*p+i) })
			},
			traffic: func() (intra, inter int64) {
				return l.Intra.Stats().Total().BytesSent, l.Inter.Stats().Total().BytesSent
			},
			exactWire: int64(w-1) * 4 * int64(p),
			tolerance: tol,
			layout:    l.String(),
			fp16Ring:  comm.RingAllReduceBytes(2*int64(elems), w),
			close:     l.Close,
		}, nil
	case "rsc":
		sizes := rscSizes(elems)
		rs, err := quant.NewCoalesced(ctx, c, sizes)
		if err != nil {
			return nil, err
		}
		inputs := make([][]float32, len(sizes))
		offs := make([]int, len(sizes))
		off := 0
		for i, n := range sizes {
			inputs[i] = make([]float32, n)
			fillInput(inputs[i], rank, off)
			offs[i] = off
			off += n
		}
		var outs [][]float32
		return &benchCase{
			elems: elems,
			run: func(ctx context.Context) (err error) {
				outs, err = rs.ReduceScatter(ctx, inputs)
				return err
			},
			check: func() (errSq, refSq float64) {
				for i, out := range outs {
					lo, _ := rs.Owned(i)
					e, r := sqDist(out, func(j int) float64 { return meanInput(w, offs[i]+lo+j) })
					errSq += e
					refSq += r
				}
				return errSq, refSq
			},
			// The exact collective: one float32 reduce-scatter of the
			// concatenated tensors.
			exactWire: int64(w-1) * 4 * int64((elems+w-1)/w),
		}, nil
	}
	return nil, fmt.Errorf("unknown collective %q", name)
}

// rscSizes cuts elems into the tensor sizes of the rsc benchmark, a mix
// like a model's parameters: halves down to a few odd-sized small tensors.
func rscSizes(elems int) []int {
	var sizes []int
	for left := elems; left > 0; {
		n := left / 2
		if n < 64 {
			n = left
		} else {
			n += 3 // odd sizes that W rarely divides
		}
		sizes = append(sizes, n)
		left -= n
	}
	return sizes
}
