package errorfeedback

import (
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/lowbit-ml/lowbit/internal/samerun"
	"github.com/lowbit-ml/lowbit/signpack"
)

// benchElems float32s are 64 MiB, the per-rank tensor of the onebit
// allreduce benchmark and far larger than any last-level cache.
const benchElems = 16 << 20

// The benchmark buffers, allocated and filled on first use only, so that a
// plain go test stays light.
var bench struct {
	once   sync.Once
	input  []float32 // real values of both signs
	r      Residual  // starts as a copy of input
	packed []byte
}

func benchBuffers(b *testing.B) (Residual, []float32, []byte) {
	b.Helper()
	bench.once.Do(func() {
		rng := rand.New(rand.NewPCG(5, 6))
		bench.input = make([]float32, benchElems)
		for i := range bench.input {
			bench.input[i] = float32(rng.NormFloat64())
		}
		// Every page of r is written, so none reads as the shared zero page.
		bench.r = append(NewResidual(0), bench.input...)
		bench.packed = make([]byte, signpack.PackedLen(benchElems))
	})
	return bench.r, bench.input, bench.packed
}

// compressGeneric is Compress with the portable norm kernels (sign packing
// still uses its own fast path).
func compressGeneric(r Residual, packed []byte, input []float32) float32 {
	return r.compress(packed, input, addSumSquaresGeneric, sumSquaresGeneric)
}

var sinkF32 float32

var sinkF64 float64

// BenchmarkCompress times Compress on 64 MiB; SetBytes counts the input
// once (the residual is read and written twice more). Repeated calls keep
// the residual real: it stays within about one scale of the input.
func BenchmarkCompress(b *testing.B) {
	r, input, packed := benchBuffers(b)
	b.SetBytes(4 * benchElems)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		s, err := r.Compress(packed, input)
		if err != nil {
			b.Fatal(err)
		}
		sinkF32 = s
	}
}

// BenchmarkCompressGeneric is BenchmarkCompress with the portable norm
// kernels, the baseline of the fast path.
func BenchmarkCompressGeneric(b *testing.B) {
	r, input, packed := benchBuffers(b)
	b.SetBytes(4 * benchElems)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		sinkF32 = compressGeneric(r, packed, input)
	}
}

func mbPerSec(sec float64) float64 { return 4 * benchElems / 1e6 / sec }

// BenchmarkCompressSpeedup times Compress with the fast norm kernels and
// with the generic ones in alternation over the same buffers and reports
// "speedup", the generic/fast ratio of their median times measured in the
// same run, and the speed of each on the input's 64 MiB. The fast path is
// what Compress uses on this machine (FastPath in the log); run it with
// -benchtime 10x or more.
func BenchmarkCompressSpeedup(b *testing.B) {
	r, input, packed := benchBuffers(b)
	b.Logf("fast path: %s", fastPath())
	med := samerun.Medians(b,
		func() { sinkF32, _ = r.Compress(packed, input) },
		func() { sinkF32 = compressGeneric(r, packed, input) },
	)
	b.ReportMetric(med[1]/med[0], "speedup")
	b.ReportMetric(mbPerSec(med[0]), "fast-MB/s")
	b.ReportMetric(mbPerSec(med[1]), "generic-MB/s")
}

// BenchmarkNormSpeedup is BenchmarkCompressSpeedup for the norm kernels
// alone: addSumSquares (x += in, then the sum of squares, as Compress does
// on the unpadded part) and sumSquares (a read-only pass, as on the pad),
// each fast against generic. It adds the input into a residual again and
// again, so the values grow, but only linearly in the number of passes.
func BenchmarkNormSpeedup(b *testing.B) {
	r, input, _ := benchBuffers(b)
	med := samerun.Medians(b,
		func() { sinkF64 = addSumSquares(r, input) },
		func() { sinkF64 = addSumSquaresGeneric(r, input) },
		func() { sinkF64 = sumSquares(r) },
		func() { sinkF64 = sumSquaresGeneric(r) },
	)
	// The residual is shared with the Compress benchmarks; start them again
	// from the input.
	copy(r, input)
	b.ReportMetric(med[1]/med[0], "add-speedup")
	b.ReportMetric(med[3]/med[2], "sum-speedup")
	b.ReportMetric(mbPerSec(med[0]), "add-fast-MB/s")
	b.ReportMetric(mbPerSec(med[1]), "add-generic-MB/s")
	b.ReportMetric(mbPerSec(med[2]), "sum-fast-MB/s")
	b.ReportMetric(mbPerSec(med[3]), "sum-generic-MB/s")
}

// BenchmarkServerSumSpeedup times the 1-bit allreduce's server sum on one
// chunk of the onebit benchmark (4 ranks, 64 MiB: 4M elements, a packed
// chunk from each of 4 ranks) two ways in alternation, in the same run:
// CompensatePackSigns, and what it replaces, the packed bytes unpacked
// into a summing block of 16K elements (signpack.UnpackScale, then
// UnpackScaleAdd per rank) and CompensatePack of the block into the
// server error. Each run takes the next of the four chunks of the
// benchmark's 64 MiB residual as its server error, so that it comes from
// memory, as in a call, not from the cache. It reports "speedup", the
// ratio of their median times, and the speed of each on a chunk's 16 MiB
// of floats. Run it with -benchtime 10x or more.
func BenchmarkServerSumSpeedup(b *testing.B) {
	const w, c, block = 4, benchElems / 4, 16 << 10
	r, _, packed := benchBuffers(b)
	srcs := make([][]byte, w)
	for j := range srcs {
		srcs[j] = packed[j*c/8 : (j+1)*c/8]
	}
	scales := []float32{0.25, 0.5, 0.125, 1}
	dst := make([]byte, c/8)
	acc := make([]float32, block)
	var m Norm
	next := 0
	chunk := func() []float32 {
		next = (next + 1) % w
		return r[next*c : (next+1)*c]
	}
	med := samerun.Medians(b,
		func() {
			m.Reset()
			m.CompensatePackSigns(dst, chunk(), srcs, scales)
		},
		func() {
			m.Reset()
			x := chunk()
			for lo := 0; lo < c; lo += block {
				signpack.UnpackScale(acc, srcs[0][lo/8:], scales[0])
				for j := 1; j < w; j++ {
					signpack.UnpackScaleAdd(acc, srcs[j][lo/8:], scales[j])
				}
				m.CompensatePack(dst[lo/8:], x[lo:lo+block], acc)
			}
		},
	)
	// The residual is shared with the Compress benchmarks; start them again
	// from the input.
	copy(r, bench.input)
	b.ReportMetric(med[1]/med[0], "speedup")
	b.ReportMetric(mbPerSec(med[0])/w, "fused-MB/s")
	b.ReportMetric(mbPerSec(med[1])/w, "blocked-MB/s")
}
