package quant

import (
	"context"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
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

// BenchmarkDownCast times the down-cast allreduce of 4 Mi float32 on 4
// in-process ranks per format (ns/op is one call on every rank); the
// float32 allreduce of the same buffer on the same ranks runs beside it as
// the baseline.
func BenchmarkDownCast(b *testing.B) {
	const w, n = 4, 4 << 20
	run := func(b *testing.B, call func(ctx context.Context, c comm.Comm, buf []float32) error) {
		cs, err := local.New(w)
		if err != nil {
			b.Fatal(err)
		}
		bufs := make([][]float32, w)
		for r := range bufs {
			bufs[r] = randInput(r, n)
		}
		b.SetBytes(4 * n)
		b.ResetTimer()
		var wg sync.WaitGroup
		for r := range w {
			wg.Go(func() {
				for range b.N {
					if err := call(context.Background(), cs[r], bufs[r]); err != nil {
						b.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	b.Run("float32", func(b *testing.B) {
		run(b, func(ctx context.Context, c comm.Comm, buf []float32) error { return c.AllReduce(ctx, buf, comm.Mean) })
	})
	for _, f := range []Format{FP16, BF16} {
		b.Run(f.String(), func(b *testing.B) {
			ds := make([]*DownCast, w)
			for r := range ds {
				ds[r] = NewDownCast(f)
			}
			run(b, func(ctx context.Context, c comm.Comm, buf []float32) error {
				return ds[c.Rank()].AllReduce(ctx, c, buf)
			})
		})
	}
}
