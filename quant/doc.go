// Package quant holds the lossy number formats lowbit puts on the wire and
// the collectives built on them.
//
// The symmetric block quantizer (Quantize, DequantizeAdd) turns float32
// values into int8 or int4 codes with one float32 scale per group of
// elements, as the spec page quant.md defines it bit for bit. QGZ is the
// hierarchical quantized reduce-scatter of ZeRO++ ("qgZ"): two quantization
// rounds and two all-to-all hops, one inside each node and one across
// nodes, whatever the number of ranks. Coalesced is the coalesced
// reduce-scatter: many tensors, one flat rank-interleaved buffer and one
// exact reduce-scatter. The 16-bit formats (fp16, bfloat16) and the
// collectives that down-cast to them live beside them.
//
// Every collective here returns the mean over ranks, takes a
// context.Context, and reports bad input (mismatched sizes across ranks, a
// bad configuration) as an error on every rank, never as a hang or a
// panic. Its buffers are allocated at construction (QGZ, Coalesced) or
// grown on the first call at a given size (DownCast, TwoLevel); after that
// a call allocates nothing, except that TwoLevel's pipelined allreduce
// starts its second goroutine with a cancellable context on every call (4
// small objects, whatever the size). The tests check each with
// testing.AllocsPerRun. The conversion kernels are plain functions, not
// collectives: Narrow and Widen panic on an invalid Format, as an index
// out of range would (Format.Valid checks one first), and convert
// min(len(dst), len(src)) elements, like copy.
//
// The kernels have a fast path (AVX2 assembly on amd64) and a portable Go
// path (build tag purego, or any other architecture) that give identical
// results, bit for bit.
package quant
