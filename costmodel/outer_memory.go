package costmodel

import "fmt"

// The outer optimizer's memory (outer.Optimizer.StateBytes, outer/memory.go
// and the buffers outer.Optimizer's build makes): outerBuffers is the one
// place that follows them, and TestOuterStateBytesMatchOptimizer compares
// it with outer.Optimizer.StateBytes for every codec, so that a change
// there fails here until outerBuffers follows it.

// outerStateCodecs are the codecs whose state OuterStateBytes counts, in
// the state table's order (the bf16 codec's buffers, which
// quant.DownCast allocates on its first calls, are not modelled).
var outerStateCodecs = []string{"fp32", "int8", "1bit", "sparse", "sparse-2p"}

// OuterStateBytes returns the bytes of the outer optimizer's own buffers
// (outer.Optimizer.StateBytes less its inner optimizer's) on one rank of
// j.Ranks, for codec ("fp32", "int8", "1bit" or "sparse", as
// outer.ParseCodec names them, or "sparse-2p", the sparse codec with
// outer.SparseTwoPhase, on rank 0, which owns the most) and j's Params, OuterFragments, OuterDelay,
// BucketBytes (the 1-bit codec's buckets) and sparse settings, each codec
// at outer.DefaultConfigFor (the sparse codec's accumulator in bfloat16).
// The inner optimizer's state comes on top (for outer.NewAdam's AdamW at
// outer.DefaultAdamConfigFor 4 bytes per parameter with the sparse codec,
// whose moments are bfloat16, 8 with the others).
func OuterStateBytes(codec string, j Job) (int64, error) {
	if j.Params < 0 || j.Ranks < 1 || j.OuterFragments < 0 || int64(j.OuterFragments) > max(j.Params, 1) || j.OuterDelay < 0 || j.BucketBytes < 0 {
		return 0, fmt.Errorf("costmodel: invalid outer state: %d parameters, %d ranks, %d fragments, delay %d, buckets of %d bytes",
			j.Params, j.Ranks, j.OuterFragments, j.OuterDelay, j.BucketBytes)
	}
	if codec == "1bit" && !fits(j.Params, j.Ranks, max(j.BucketBytes/4, 1)) {
		return 0, errTooLarge
	}
	for _, c := range outerStateCodecs {
		if c == codec {
			return outerBuffers(codec, j), nil
		}
	}
	return 0, fmt.Errorf("costmodel: unknown outer codec %q (want one of fp32, int8, 1bit, sparse, sparse-2p)", codec)
}

// outerBuffers is OuterStateBytes for a valid j, each codec at its
// default momentum (outer.DefaultConfigFor: fp32 and int8 0.9, 1bit and
// sparse 0): θ_g over every parameter; u over every parameter with a
// momentum; the exchange's buffer as long as the largest fragment for the
// codecs that average a fragment in place (fp32, int8; the sparse codec on
// one rank); with a delay the snapshot and the staging buffer of the
// fragment in flight; the 1-bit codec's x of one bucket; and on more than
// one rank the codec's state:
//   - int8: W messages sent, W received, one and W of phase 2 (each 4 bytes
//     per 256-element group of the chunk C = ceil(largest/W) and a byte per
//     element), C floats of chunk and of sums, its groups' scales;
//   - 1bit: a onebit.State per bucket of every fragment, the buckets'
//     wire buffers shared (onebit.ShareWire: one set, as long as the
//     longest bucket's);
//   - sparse: the error accumulator over every parameter (bfloat16, and
//     a chunk of float32 to widen it into: sparseBF16Delta), one chunk of
//     scratch, this rank's message of the largest fragment and W
//     received;
//   - sparse-2p: the error accumulator (likewise), one chunk of scratch, the server
//     accumulator over the run of chunks rank 0 owns in every fragment,
//     and W segments of the largest fragment sent and W received.
func outerBuffers(codec string, j Job) int64 {
	n, w := j.Params, int64(j.Ranks)
	frags := int64(max(1, j.OuterFragments))
	largest := (n + frags - 1) / frags
	momentum := codec == "fp32" || codec == "int8"
	sparse := codec == "sparse" || codec == "sparse-2p"
	direct := codec == "1bit" || sparse && w > 1
	b := 4 * n
	if momentum {
		b += 4 * n
	}
	if !direct || j.OuterDelay > 0 && momentum {
		b += 4 * largest
	}
	if j.OuterDelay > 0 {
		b += 2 * 4 * largest
	}
	bucket := j.BucketBytes
	if bucket == 0 {
		bucket = DefaultBucketBytes
	}
	per := max(bucket/4, 1)
	if codec == "1bit" {
		if w < 2 {
			b += 4 * largest
		} else {
			b += 4 * min(largest, per)
		}
	}
	if w < 2 {
		return b
	}
	switch codec {
	case "int8":
		c := (largest + w - 1) / w
		msg := outerInt8MsgLen(c)
		b += (3*w+1)*msg + 4*(2*c+(c+outerInt8GroupSize-1)/outerInt8GroupSize)
	case "1bit":
		// F-r fragments of q = n/F elements and r = n mod F of q+1, each
		// m/per whole buckets and one of m mod per.
		q, r := n/frags, n%frags
		var states []stateCount
		for _, cls := range [2][2]int64{{q, frags - r}, {q + 1, r}} {
			if m, count := cls[0], cls[1]; count > 0 {
				states = append(states, stateCount{onebitParts(per, w), count * (m / per)})
				if m%per > 0 {
					states = append(states, stateCount{onebitParts(m%per, w), count})
				}
			}
		}
		b += statesBytes(false, states)
	case "sparse":
		s := sparseOf(j)
		b += 4*(n+s.chunk) + sparseBF16Delta(j) + (1+w)*s.msgLen(largest)
	case "sparse-2p":
		s := sparseOf(j)
		b += 4*(n+s.chunk) + sparseBF16Delta(j) + 2*w*s.segLen(largest, int(w))
		// Fragments of q = n/F and q+1 elements: rank 0 owns the first
		// ceil(chunks/W) chunks of each.
		q, r := n/frags, n%frags
		b += 4 * ((frags-r)*min(s.span(q, int(w)), q) + r*min(s.span(q+1, int(w)), q+1))
	}
	return b
}
