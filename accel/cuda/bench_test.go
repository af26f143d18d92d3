package cuda_test

import (
	"testing"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/accel/cuda"
	"github.com/lowbit-ml/lowbit/internal/samerun"
)

// The benchmarks need a GPU; without one they skip with one line. Build
// them here and run them on a GPU machine:
//
//	CGO_ENABLED=0 go test -c -o cuda.test ./accel/cuda
//	./cuda.test -test.run '^$' -test.bench . -test.benchtime 20x
//
// Each reports its figure against a device-to-device copy of the same
// buffer timed in the same run (samerun.Medians, passes alternated).

const benchElems = 64 << 20 // 256 MiB of float32

type benchBufs struct {
	dev                         *cuda.Device
	input, residual, copyDst    accel.Span
	packed, recv, acc, srvErr   accel.Span
	srvPacked, all              accel.Span
	hostSend, hostRecv, hostAll []byte
}

func newBenchBufs(b *testing.B, n, w int) *benchBufs {
	d := openGPU(b)
	alloc := func(bytes int) accel.Span {
		buf, err := d.Alloc(bytes)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { buf.Free() })
		return accel.Whole(buf)
	}
	c := n / w
	bb := &benchBufs{
		dev: d, input: alloc(4 * n), residual: alloc(4 * n), copyDst: alloc(4 * n),
		packed: alloc(n / 8), recv: alloc(n / 8), acc: alloc(4 * c), srvErr: alloc(4 * c),
		srvPacked: alloc(c / 8), all: alloc(n / 8),
		hostSend: make([]byte, n/8), hostRecv: make([]byte, n/8), hostAll: make([]byte, n/8),
	}
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(i%1000) - 499.5
	}
	if err := d.CopyIn(bb.input, f32bytes(x)); err != nil {
		b.Fatal(err)
	}
	return bb
}

func (bb *benchBufs) copyPass(b *testing.B) func() {
	return func() {
		if err := bb.dev.Copy(bb.copyDst, bb.input); err != nil {
			b.Fatal(err)
		}
		if err := bb.dev.Synchronize(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCompressVsCopy: compensate+pack (Compress: the norm pass reads
// residual and input and writes the residual; the pack pass reads and
// writes the residual and writes the signs) against a device-to-device
// copy of the same buffer, in bytes read plus written per second. The
// target is bw-ratio >= 0.8.
func BenchmarkCompressVsCopy(b *testing.B) {
	const n = benchElems
	bb := newBenchBufs(b, n, 1)
	med := samerun.Medians(b, bb.copyPass(b), func() {
		if _, err := bb.dev.Compress(bb.packed, bb.residual, bb.input); err != nil {
			b.Fatal(err)
		}
	})
	copyBytes := float64(8 * n)
	compressBytes := float64(20*n + n/8)
	copyBW, compressBW := copyBytes/med[0], compressBytes/med[1]
	b.ReportMetric(copyBW/1e9, "copy-GB/s")
	b.ReportMetric(compressBW/1e9, "compress-GB/s")
	b.ReportMetric(compressBW/copyBW, "bw-ratio")
	b.ReportMetric(med[1]/med[0], "x-copy-time")
}

// BenchmarkStepDeviceVsCopy: the device part of one 1-bit allreduce step
// of rank 0 of W=4 ranks (worker Compress, packed signs to the host and
// back, 4 chunk unpacks into the server accumulator, server Compress,
// server signs to the host, the gathered signs back, the output unpack),
// with the communication left out, against a device-to-device copy of the
// tensor. Sub-benchmark kernels leaves out the host<->device copies of
// the packed signs (PCIe, pageable host memory) as well: the kernels'
// share. The target is x-copy < 3.
func BenchmarkStepDeviceVsCopy(b *testing.B) {
	for _, hostCopies := range []bool{true, false} {
		name := "with-host-copies"
		if !hostCopies {
			name = "kernels"
		}
		b.Run(name, func(b *testing.B) { benchStep(b, hostCopies) })
	}
}

func benchStep(b *testing.B, hostCopies bool) {
	const n, w = benchElems, 4
	bb := newBenchBufs(b, n, w)
	d := bb.dev
	c := n / w
	step := func() {
		check := func(err error) {
			if err != nil {
				b.Fatal(err)
			}
		}
		_, err := d.Compress(bb.packed, bb.residual, bb.input)
		check(err)
		if hostCopies {
			check(d.CopyOut(bb.hostSend, bb.packed))
			copy(bb.hostRecv, bb.hostSend) // stands in for the all-to-all
			check(d.CopyIn(bb.recv, bb.hostRecv))
		}
		check(d.UnpackScale(bb.acc, bb.recv.Sub(0, c/8), 0.25))
		for j := 1; j < w; j++ {
			check(d.UnpackScaleAdd(bb.acc, bb.recv.Sub(j*c/8, (j+1)*c/8), 0.25))
		}
		_, err = d.Compress(bb.srvPacked, bb.srvErr, bb.acc)
		check(err)
		if hostCopies {
			check(d.CopyOut(bb.hostAll[:c/8], bb.srvPacked))
			check(d.CopyIn(bb.all, bb.hostAll))
		}
		check(d.UnpackScale(bb.input, bb.all, 1))
		check(d.Synchronize())
	}
	med := samerun.Medians(b, bb.copyPass(b), step)
	b.ReportMetric(float64(8*n)/med[0]/1e9, "copy-GB/s")
	b.ReportMetric(med[1]*1e3, "step-ms")
	b.ReportMetric(med[1]/med[0], "x-copy")
}

// BenchmarkKernelsVsCopy times each kernel of the step on its own against
// the device-to-device copy of the whole tensor (64 Mi elements): where
// the step's time goes.
func BenchmarkKernelsVsCopy(b *testing.B) {
	const n, w = benchElems, 4
	c := n / w
	for _, k := range []struct {
		name  string
		bytes float64 // read plus written
		run   func(bb *benchBufs) error
	}{
		{"compress-N", 20*n + n/8, func(bb *benchBufs) error {
			_, err := bb.dev.Compress(bb.packed, bb.residual, bb.input)
			return err
		}},
		{"compress-N/4", float64(20*c + c/8), func(bb *benchBufs) error {
			_, err := bb.dev.Compress(bb.srvPacked, bb.srvErr, bb.acc)
			return err
		}},
		{"unpack-N", 4*n + n/8, func(bb *benchBufs) error {
			if err := bb.dev.UnpackScale(bb.input, bb.all, 1); err != nil {
				return err
			}
			return bb.dev.Synchronize()
		}},
		{"unpack-add-N/4", float64(8*c + c/8), func(bb *benchBufs) error {
			if err := bb.dev.UnpackScaleAdd(bb.acc, bb.recv.Sub(0, c/8), 0.25); err != nil {
				return err
			}
			return bb.dev.Synchronize()
		}},
	} {
		b.Run(k.name, func(b *testing.B) {
			bb := newBenchBufs(b, n, w)
			med := samerun.Medians(b, bb.copyPass(b), func() {
				if err := k.run(bb); err != nil {
					b.Fatal(err)
				}
			})
			b.ReportMetric(med[1]*1e6, "kernel-us")
			b.ReportMetric(med[1]/med[0], "x-copy")
			b.ReportMetric(k.bytes/med[1]/(float64(8*n)/med[0]), "bw-ratio")
		})
	}
}
