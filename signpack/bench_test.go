package signpack_test

import (
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/lowbit-ml/lowbit/internal/samerun"
	"github.com/lowbit-ml/lowbit/signpack"
)

// benchElems float32s make a 256 MiB buffer, far larger than any last-level
// cache, so every benchmark streams from memory.
const benchElems = 256 << 20 / 4

// The benchmark buffers, allocated and filled on first use only, so that a
// plain go test stays light.
var bench struct {
	once   sync.Once
	src    []float32 // real values of both signs
	packed []byte    // PackedLen(benchElems)
	dst    []float32 // output of the unpack benchmarks
}

func benchBuffers(b *testing.B) ([]float32, []byte, []float32) {
	b.Helper()
	bench.once.Do(func() {
		r := rand.New(rand.NewPCG(11, 12))
		bench.src = make([]float32, benchElems)
		bench.dst = make([]float32, benchElems)
		for i := range bench.src {
			// Touch every page with a non-zero value: pages never written
			// all read as the one shared zero page.
			bench.src[i] = float32(r.NormFloat64())
			bench.dst[i] = 1
		}
		bench.packed = make([]byte, signpack.PackedLen(benchElems))
		signpack.Pack(bench.packed, bench.src)
	})
	return bench.src, bench.packed, bench.dst
}

var sink uint32

// BenchmarkRead is the baseline: the fastest plain streaming read of the
// buffer (AVX2 loads ORed together on amd64).
func BenchmarkRead(b *testing.B) {
	src, _, _ := benchBuffers(b)
	b.SetBytes(4 * benchElems)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		sink |= signpack.ReadBaseline(src)
	}
}

func BenchmarkPack(b *testing.B) {
	src, packed, _ := benchBuffers(b)
	b.SetBytes(4 * benchElems)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		signpack.Pack(packed, src)
	}
}

func BenchmarkPackGeneric(b *testing.B) {
	src, packed, _ := benchBuffers(b)
	b.SetBytes(4 * benchElems)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		signpack.Generic.Pack(packed, src)
	}
}

// BenchmarkPackResidual reads and writes the whole buffer (SetBytes counts
// the input once). Repeated calls keep the values real: each pass moves
// them by ±scale towards zero and across it.
func BenchmarkPackResidual(b *testing.B) {
	src, packed, _ := benchBuffers(b)
	x := make([]float32, len(src))
	copy(x, src)
	b.SetBytes(4 * benchElems)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		signpack.PackResidual(packed, x, 0.01)
	}
}

// BenchmarkUnpack writes the whole float32 buffer.
func BenchmarkUnpack(b *testing.B) {
	_, packed, dst := benchBuffers(b)
	b.SetBytes(4 * benchElems)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		signpack.Unpack(dst, packed)
	}
}

// BenchmarkUnpackScaleAdd reads and writes the whole float32 accumulator.
func BenchmarkUnpackScaleAdd(b *testing.B) {
	_, packed, dst := benchBuffers(b)
	b.SetBytes(4 * benchElems)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		signpack.UnpackScaleAdd(dst, packed, 1e-3)
	}
}

// BenchmarkPackVsRead times the read baseline, Pack and the generic Pack
// in alternation over the same buffer (rotating which goes first) and
// reports pack speed as a fraction of read speed measured in the same run:
// "pack/read" (1 = as fast as reading the input) and "generic/read". The
// ratios and the MB/s figures use the median time of each kind of pass, so
// that passes disturbed by other work on a shared machine count little;
// run it with -benchtime 20x or more.
func BenchmarkPackVsRead(b *testing.B) {
	src, packed, _ := benchBuffers(b)
	med := samerun.Medians(b,
		func() { sink |= signpack.ReadBaseline(src) },
		func() { signpack.Pack(packed, src) },
		func() { signpack.Generic.Pack(packed, src) },
	)
	mbs := func(sec float64) float64 { return 4 * benchElems / 1e6 / sec }
	b.ReportMetric(med[0]/med[1], "pack/read")
	b.ReportMetric(med[0]/med[2], "generic/read")
	b.ReportMetric(mbs(med[0]), "read-MB/s")
	b.ReportMetric(mbs(med[1]), "pack-MB/s")
	b.ReportMetric(mbs(med[2]), "generic-MB/s")
}

// BenchmarkUnpackStreamVsUnpack times UnpackScale and UnpackScaleStream in
// alternation over the same output (rotating which goes first) and reports
// the speed of the non-temporal stores as a multiple of the ordinary ones
// measured in the same run ("stream/unpack"), from the median pass of
// each, with both rates in MB/s of output written. Run it with -benchtime
// 20x or more.
func BenchmarkUnpackStreamVsUnpack(b *testing.B) {
	_, packed, dst := benchBuffers(b)
	med := samerun.Medians(b,
		func() { signpack.UnpackScale(dst, packed, 1e-3) },
		func() { signpack.UnpackScaleStream(dst, packed, 1e-3) },
	)
	mbs := func(sec float64) float64 { return 4 * benchElems / 1e6 / sec }
	b.ReportMetric(med[0]/med[1], "stream/unpack")
	b.ReportMetric(mbs(med[0]), "unpack-MB/s")
	b.ReportMetric(mbs(med[1]), "stream-MB/s")
}
