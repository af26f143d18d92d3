package quant

import (
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/lowbit-ml/lowbit/internal/samerun"
)

// halfBenchElems float32s make a 256 MiB buffer, far larger than any
// last-level cache, so every benchmark streams from memory.
const halfBenchElems = 256 << 20 / 4

// The benchmark buffers, allocated and filled on first use only.
var halfBench struct {
	once   sync.Once
	src    []float32 // real values
	halves []uint16  // narrowed src
	dst    []float32 // widening output
}

func halfBuffers(b *testing.B) ([]float32, []uint16, []float32) {
	b.Helper()
	halfBench.once.Do(func() {
		r := rand.New(rand.NewPCG(3, 4))
		halfBench.src = make([]float32, halfBenchElems)
		halfBench.dst = make([]float32, halfBenchElems)
		halfBench.halves = make([]uint16, halfBenchElems)
		for i := range halfBench.src {
			// Touch every page with a real value: pages never written
			// all read as the one shared zero page.
			halfBench.src[i] = float32(r.NormFloat64())
			halfBench.dst[i] = 1
			halfBench.halves[i] = 1
		}
	})
	return halfBench.src, halfBench.halves, halfBench.dst
}

var halfSink uint32

// BenchmarkHalf times, in the same run and in alternation, a plain
// streaming read of the 256 MiB float32 buffer (the memory-bandwidth
// baseline) and the conversions of that buffer. Each conversion is
// reported as input bytes per second relative to the read ("x-read":
// 1 is read speed; narrowing also writes half as many bytes, widening
// reads half and writes all of them). ns/op is one round of all passes.
// Run with -benchtime 5x or more.
func BenchmarkHalf(b *testing.B) {
	src, halves, dst := halfBuffers(b)
	names := []string{"read", "narrow-fp16", "narrow-bf16", "widen-fp16", "widen-bf16"}
	med := samerun.Medians(b,
		func() { halfSink |= readBaseline(src) },
		func() { Narrow(FP16, halves, src) },
		func() { Narrow(BF16, halves, src) },
		func() { Widen(FP16, dst, halves) },
		func() { Widen(BF16, dst, halves) },
	)
	const gb = 4 * halfBenchElems / 1e9
	b.ReportMetric(gb/med[0], "read-GB/s")
	for k := 1; k < len(med); k++ {
		b.ReportMetric(med[0]/med[k], names[k]+"-x-read")
	}
}

// BenchmarkHalfGeneric is BenchmarkHalf's narrowing with the portable
// kernels, beside the same read.
func BenchmarkHalfGeneric(b *testing.B) {
	src, halves, _ := halfBuffers(b)
	med := samerun.Medians(b,
		func() { halfSink |= readBaseline(src) },
		func() { narrowFP16Generic(halves, src) },
		func() { narrowBF16Generic(halves, src) },
	)
	const gb = 4 * halfBenchElems / 1e9
	b.ReportMetric(gb/med[0], "read-GB/s")
	b.ReportMetric(med[0]/med[1], "narrow-fp16-x-read")
	b.ReportMetric(med[0]/med[2], "narrow-bf16-x-read")
}
