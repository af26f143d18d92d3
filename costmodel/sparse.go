package costmodel

import (
	"fmt"
	"math"
	"math/bits"
)

// The outer optimizer's sparse codec (outer.CodecSparse, outer/sparse.go,
// docs/outer.md): per chunk of SparseChunk elements of a fragment (the
// last one shorter) every rank sends the k = round(Density*length) (at
// least 1) entries of its error accumulator of largest magnitude, each as
// an offset within the chunk (ceil(log2(SparseChunk)) bits) and a value of
// SparseBits bits, behind SparseBits float32 scales, the chunk's bit
// stream padded to a whole byte; the messages, all of one length, are
// all-gathered. The defaults and the layout are copied so that the cost
// model does not import the optimizers; TestOuterCopiesMatch and
// TestOuterBytesMatchOptimizer check them against package outer.

// Defaults of the sparse codec: outer.DefaultConfigFor(outer.CodecSparse)'s
// Density, SparseChunk and SparseBits.
const (
	DefaultSparseDensity = 1.0 / 48
	DefaultSparseChunk   = 4096
	DefaultSparseBits    = 1
	// MaxSparseChunk is the largest SparseChunk package outer accepts.
	MaxSparseChunk = 1 << 24
)

// SparsePlan is the sparse codec's settings in a Plan, and what they make
// of a message.
type SparsePlan struct {
	// Density, Chunk and Bits are Job.OuterDensity, OuterSparseChunk and
	// OuterSparseBits, the defaults filled in.
	Density float64 `json:"density"`
	Chunk   int     `json:"chunk"`
	Bits    int     `json:"value_bits"`
	// Entries is k, the entries sent of a full chunk, and OffsetBits the
	// bits of each one's offset.
	Entries    int `json:"entries_per_chunk"`
	OffsetBits int `json:"offset_bits"`
	// BitsPerElement is the bits one rank's message of the largest
	// fragment carries per element (scales and padding included): each
	// rank sends W-1 of them per exchange.
	BitsPerElement float64 `json:"bits_per_element"`
}

// sparseCodec is the sparse codec's layout for given settings (the
// defaults filled in).
type sparseCodec struct {
	density float32 // outer.Config.Density is a float32
	chunk   int64
	vbits   int64
}

// sparseOf is the sparse codec of j.
func sparseOf(j Job) sparseCodec {
	s := sparseCodec{density: float32(DefaultSparseDensity), chunk: DefaultSparseChunk, vbits: DefaultSparseBits}
	if j.OuterDensity != 0 {
		s.density = float32(j.OuterDensity)
	}
	if j.OuterSparseChunk != 0 {
		s.chunk = int64(j.OuterSparseChunk)
	}
	if j.OuterSparseBits != 0 {
		s.vbits = int64(j.OuterSparseBits)
	}
	return s
}

// offsetBits is the bits of an offset within a chunk: enough for chunk-1.
func (s sparseCodec) offsetBits() int64 { return int64(max(1, bits.Len64(uint64(s.chunk-1)))) }

// k is the entries sent of a chunk of l elements.
func (s sparseCodec) k(l int64) int64 {
	return max(1, min(l, int64(math.Round(float64(s.density)*float64(l)))))
}

// chunkLen is the bytes of the message of a chunk of l elements.
func (s sparseCodec) chunkLen(l int64) int64 {
	return 4*s.vbits + (s.k(l)*(s.offsetBits()+s.vbits)+7)/8
}

// msgLen is the bytes of one rank's message of a fragment of m elements.
func (s sparseCodec) msgLen(m int64) int64 {
	if m <= 0 {
		return 0
	}
	n := m / s.chunk * s.chunkLen(s.chunk)
	if r := m % s.chunk; r > 0 {
		n += s.chunkLen(r)
	}
	return n
}

// collective is the exchange of a fragment: one all-gather of the
// messages, W-1 latency-bound rounds (a ring), W-1 messages sent per
// rank. The selection, encoding and decoding are not modelled.
func (s sparseCodec) collective() collective {
	return collective{
		name:      "sparse",
		desc:      "all-gather of the sparse codec's messages",
		wireBytes: func(n int64, w int) int64 { return int64(max(w-1, 0)) * s.msgLen(n) },
		steps: func(n int64, w int, _ float64) []step {
			if w <= 1 || n <= 0 {
				return nil
			}
			return []step{{rounds: float64(w - 1), bytes: int64(w-1) * s.msgLen(n)}}
		},
	}
}

// segLen is the bytes of an owner's segment in the two-phase exchange
// (outer.SparseTwoPhase) of a fragment of m elements over w ranks: the
// message of the largest run of chunks an owner has, ceil(chunks/w)
// chunks from the fragment's start (rank 0's), to which the others'
// are padded.
func (s sparseCodec) segLen(m int64, w int) int64 {
	if m <= 0 || w < 1 {
		return 0
	}
	return s.msgLen(min(s.span(m, w), m))
}

// span is the elements of ceil(chunks/w) chunks of a fragment of m.
func (s sparseCodec) span(m int64, w int) int64 {
	chunks := (m + s.chunk - 1) / s.chunk
	return (chunks + int64(w) - 1) / int64(w) * s.chunk
}

// twoPhaseCollective is the two-phase exchange of a fragment
// (outer.SparseTwoPhase): an all-to-all of the messages, each owner's
// segment to it, then an all-gather of the owners' re-encoded segments
// (of the same density), each W-1 latency-bound rounds and W-1 segments
// sent per rank: 2(W-1) segments, about 2(W-1)/W messages while W is
// much less than the chunks.
// The owners' decoding, sums and re-encoding are not modelled.
func (s sparseCodec) twoPhaseCollective() collective {
	return collective{
		name:      "sparse-2p",
		desc:      "all-to-all of the sparse codec's messages to the owners of runs of chunks, all-gather of their re-encoded averages",
		wireBytes: func(n int64, w int) int64 { return 2 * int64(max(w-1, 0)) * s.segLen(n, w) },
		steps: func(n int64, w int, _ float64) []step {
			if w <= 1 || n <= 0 {
				return nil
			}
			seg := int64(w-1) * s.segLen(n, w)
			return []step{{rounds: float64(w - 1), bytes: seg}, {rounds: float64(w - 1), bytes: seg}}
		},
	}
}

// sharedSeg is the bytes of the largest owner's (rank 0's) run of chunks
// of a fragment of m elements over w ranks, per(l) bytes a chunk of l
// elements.
func (s sparseCodec) sharedSeg(m int64, w int, per func(l int64) int64) int64 {
	if m <= 0 || w < 1 {
		return 0
	}
	run := min(s.span(m, w), m)
	return run/s.chunk*per(s.chunk) + per(run%s.chunk)*min(1, run%s.chunk)
}

// sharedSegs are the three segments of the shared-index exchange
// (outer.SparseShared) of a fragment of m elements over w ranks: the
// owners' offsets (k offsets of offsetBits a chunk, padded to a byte),
// the values sent to the owners (vbits scales and k values of vbits a
// chunk) and the owners' averages (a scale and k int8 codes a chunk).
func (s sparseCodec) sharedSegs(m int64, w int) (idx, val, avg int64) {
	return s.sharedSeg(m, w, func(l int64) int64 { return (s.k(l)*s.offsetBits() + 7) / 8 }),
		s.sharedSeg(m, w, func(l int64) int64 { return 4*s.vbits + (s.k(l)*s.vbits+7)/8 }),
		s.sharedSeg(m, w, func(l int64) int64 { return 4 + s.k(l) })
}

// sharedCollective is the shared-index exchange of a fragment
// (outer.SparseShared): an all-gather of the owners' offsets, an
// all-to-all of the values at them to the owners, an all-gather of the
// owners' int8 averages, each W-1 latency-bound rounds and W-1 segments
// sent per rank: about (W-1)/W of Density*(offset bits + value bits + 8)
// bits per element, not growing with W while W is much less than the
// chunks. The selection, encodings and sums are not modelled.
//
// With votes (outer.SparseVoted) an all-to-all of every rank's own top-k
// offsets to the owners comes first: one more offsets' segment.
func (s sparseCodec) sharedCollective(votes bool) collective {
	nv := int64(0)
	name, desc := "sparse-shared", "all-gather of the owners' offsets, all-to-all of the values at them to the owners, all-gather of the owners' int8 averages"
	if votes {
		nv = 1
		name, desc = "sparse-voted", "all-to-all of every rank's top-k offsets to the owners, then "+desc
	}
	return collective{
		name: name, desc: desc,
		wireBytes: func(n int64, w int) int64 {
			i, v, a := s.sharedSegs(n, w)
			return int64(max(w-1, 0)) * ((1+nv)*i + v + a)
		},
		steps: func(n int64, w int, _ float64) []step {
			if w <= 1 || n <= 0 {
				return nil
			}
			i, v, a := s.sharedSegs(n, w)
			r := int64(w - 1)
			st := []step{{rounds: float64(w - 1), bytes: r * i}, {rounds: float64(w - 1), bytes: r * v}, {rounds: float64(w - 1), bytes: r * a}}
			if votes {
				st = append([]step{{rounds: float64(w - 1), bytes: r * i}}, st...)
			}
			return st
		},
	}
}

// plan is the SparsePlan of s for fragments of at most largest elements.
func (s sparseCodec) plan(largest int64) *SparsePlan {
	return &SparsePlan{Density: float64(s.density), Chunk: int(s.chunk), Bits: int(s.vbits), Entries: int(s.k(s.chunk)),
		OffsetBits: int(s.offsetBits()), BitsPerElement: 8 * float64(s.msgLen(largest)) / float64(largest)}
}

// validateSparse reports the first sparse field of j that Plan cannot
// use; with row (the plan has the outer-sparse row) also settings that
// package outer would refuse for j's fragments.
func (j Job) validateSparse(row bool, fail func(field, format string, args ...any) error) error {
	switch {
	case !(j.OuterDensity >= 0 && j.OuterDensity <= 1):
		return fail("OuterDensity", "must be in (0, 1] (0: the default %.6g), got %g", DefaultSparseDensity, j.OuterDensity)
	case j.OuterSparseChunk < 0 || j.OuterSparseChunk > MaxSparseChunk:
		return fail("OuterSparseChunk", "must be in [1, %d] elements (0: the default %d), got %d", MaxSparseChunk, DefaultSparseChunk, j.OuterSparseChunk)
	case j.OuterSparseBits < 0 || j.OuterSparseBits > 2:
		return fail("OuterSparseBits", "must be 1 or 2 (0: the default %d), got %d", DefaultSparseBits, j.OuterSparseBits)
	}
	s := sparseOf(j)
	if float64(s.chunk)*float64(s.density) < 1 {
		return fail("OuterSparseChunk", "must be at least 1/density = %g, so that every chunk sends an entry, got %d", math.Ceil(1/float64(s.density)), s.chunk)
	}
	if smallest := j.Params / int64(max(1, j.OuterFragments)); row && s.chunk > smallest {
		return fail("OuterSparseChunk", "must not exceed the smallest fragment, %d elements (package outer refuses a longer chunk), got %d", smallest, s.chunk)
	}
	return nil
}

// sparseFits reports whether the sparse codec's chunk fits j's smallest
// fragment: Plan adds the outer-sparse row to the default rows only then.
func (j Job) sparseFits() bool {
	return j.validateSparse(true, func(string, string, ...any) error { return fmt.Errorf("no") }) == nil
}
