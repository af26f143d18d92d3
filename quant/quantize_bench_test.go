package quant

import (
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/lowbit-ml/lowbit/internal/samerun"
)

// quantBenchElems float32s make a 256 MiB buffer, far larger than any
// last-level cache, so that every benchmark streams from memory.
const quantBenchElems = 256 << 20 / 4

// The benchmark buffers, allocated and filled on first use only.
var quantBench struct {
	once   sync.Once
	src    []float32
	codes  []byte // int8 codes of src, also used for int4 (first half)
	scales []float32
	dst    []float32
}

func quantBuffers(b *testing.B) (src []float32, codes []byte, scales []float32, dst []float32) {
	b.Helper()
	quantBench.once.Do(func() {
		r := rand.New(rand.NewPCG(21, 22))
		quantBench.src = make([]float32, quantBenchElems)
		quantBench.dst = make([]float32, quantBenchElems)
		for i := range quantBench.src {
			// Real values on every page: untouched pages all read as
			// the one shared zero page.
			quantBench.src[i] = float32(r.NormFloat64())
			quantBench.dst[i] = 1
		}
		quantBench.codes = make([]byte, quantBenchElems)
		quantBench.scales = make([]float32, NumGroups(quantBenchElems, DefaultGroupSize))
	})
	return quantBench.src, quantBench.codes, quantBench.scales, quantBench.dst
}

var quantSink uint32

// BenchmarkQuantizeVsRead times a plain streaming read of the 256 MiB
// buffer (the memory-bandwidth baseline), Quantize int8 and Quantize int4
// (groups of DefaultGroupSize) in alternation, rotating which goes first,
// and reports the quantizers' speed as a fraction of the read's measured
// in the same run ("int8/read", "int4/read"; 1 = as fast as reading the
// input) from the median time of each kind of pass. Run it with
// -benchtime 10x or more.
func BenchmarkQuantizeVsRead(b *testing.B) {
	src, codes, scales, _ := quantBuffers(b)
	c4 := codes[:CodesLen(len(src), 4)]
	med := samerun.Medians(b,
		func() { quantSink |= readBaseline(src) },
		func() { quantizeWith(&fast, codes, scales, src, 8, DefaultGroupSize) },
		func() { quantizeWith(&fast, c4, scales, src, 4, DefaultGroupSize) },
	)
	mbs := func(sec float64) float64 { return 4 * quantBenchElems / 1e6 / sec }
	b.ReportMetric(med[0]/med[1], "int8/read")
	b.ReportMetric(med[0]/med[2], "int4/read")
	b.ReportMetric(mbs(med[0]), "read-MB/s")
	b.ReportMetric(mbs(med[1]), "int8-MB/s")
	b.ReportMetric(mbs(med[2]), "int4-MB/s")
}

// BenchmarkDequantizeAddVsRead compares DequantizeAdd (which reads codes
// and reads and writes the float32 accumulator) with the same read.
func BenchmarkDequantizeAddVsRead(b *testing.B) {
	src, codes, scales, dst := quantBuffers(b)
	quantizeWith(&fast, codes, scales, src, 8, DefaultGroupSize)
	c4 := codes[:CodesLen(len(src), 4)]
	med := samerun.Medians(b,
		func() { quantSink |= readBaseline(src) },
		func() { dequantizeAddWith(&fast, dst, codes, scales, 8, DefaultGroupSize) },
		func() { dequantizeAddWith(&fast, dst, c4, scales, 4, DefaultGroupSize) },
	)
	b.ReportMetric(med[0]/med[1], "int8/read")
	b.ReportMetric(med[0]/med[2], "int4/read")
}

// BenchmarkQuantize8 and the rest time one kernel alone (SetBytes counts
// the float32 input), the portable path beside the fast one.
func BenchmarkQuantize8(b *testing.B)        { benchQuantize(b, &fast, 8) }
func BenchmarkQuantize4(b *testing.B)        { benchQuantize(b, &fast, 4) }
func BenchmarkQuantize8Generic(b *testing.B) { benchQuantize(b, &generic, 8) }

func benchQuantize(b *testing.B, k *kernels, bits int) {
	src, codes, scales, _ := quantBuffers(b)
	codes = codes[:CodesLen(len(src), bits)]
	b.SetBytes(4 * quantBenchElems)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		quantizeWith(k, codes, scales, src, bits, DefaultGroupSize)
	}
}
