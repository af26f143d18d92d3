package cuda_test

import (
	"context"
	"testing"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/accel/cuda"
	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/samerun"
	"github.com/lowbit-ml/lowbit/onebit"
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
	srvPacked, all, scales      accel.Span
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
		srvPacked: alloc(c / 8), all: alloc(n / 8), scales: alloc(4 * w),
		hostSend: make([]byte, n/8), hostRecv: make([]byte, n/8), hostAll: make([]byte, n/8),
	}
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(i%1000) - 499.5
	}
	if err := d.CopyIn(bb.input, f32bytes(x)); err != nil {
		b.Fatal(err)
	}
	sc := make([]float32, w)
	for j := range sc {
		sc[j] = 1 / float32(w)
	}
	if err := d.CopyIn(bb.scales, f32bytes(sc)); err != nil {
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

// BenchmarkCompressVsCopy: compensate+pack against a device-to-device
// copy of the same buffer, in bytes read plus written per second. Two
// kernels do it: carried (CompressCarried, one pass: read x and the
// input, write x and the signs) and two-pass (Compress: the norm pass
// reads residual and input and writes the residual; the pack pass reads
// and writes the residual and writes the signs). The target is bw-ratio
// >= 0.8; x-copy-time is the time against the copy's.
func BenchmarkCompressVsCopy(b *testing.B) {
	const n = benchElems
	for _, k := range []struct {
		name  string
		bytes float64
		run   func(bb *benchBufs) error
	}{
		{"carried", 12*n + n/8, func(bb *benchBufs) error {
			_, err := bb.dev.CompressCarried(bb.packed, bb.residual, 0.5, bb.input)
			return err
		}},
		{"two-pass", 20*n + n/8, func(bb *benchBufs) error {
			_, err := bb.dev.Compress(bb.packed, bb.residual, bb.input)
			return err
		}},
	} {
		b.Run(k.name, func(b *testing.B) {
			bb := newBenchBufs(b, n, 1)
			med := samerun.Medians(b, bb.copyPass(b), func() {
				if err := k.run(bb); err != nil {
					b.Fatal(err)
				}
			})
			copyBW, compressBW := float64(8*n)/med[0], k.bytes/med[1]
			b.ReportMetric(copyBW/1e9, "copy-GB/s")
			b.ReportMetric(compressBW/1e9, "compress-GB/s")
			b.ReportMetric(compressBW/copyBW, "bw-ratio")
			b.ReportMetric(med[1]/med[0], "x-copy-time")
		})
	}
}

// BenchmarkStepDeviceVsCopy: the device part of one 1-bit allreduce step
// of rank 0 of W=4 ranks, with the communication left out, against a
// device-to-device copy of the tensor. The target is x-copy < 3.
//
//   - allreduce: onebit.AllReduceDevice itself, on a stand-in
//     communicator whose all-to-all and all-gather copy the rank's own
//     message into every slot (host staging and the host<->device copies
//     of packed signs included: PCIe, page-locked host memory, the output
//     in one launch).
//   - allreduce/pageable-per-chunk: the same with the device wrapped so
//     that the collective sees neither AllocHost nor UnpackScaleChunks:
//     pageable staging and one output launch per chunk, as before both.
//   - carried/kernels: its kernels alone (CompressCarried of the tensor,
//     SumCompressCarried of the rank's chunk from 4 received chunks, the
//     output UnpackScaleChunks), no host copies: the kernels' share.
//   - two-pass/kernels: the same step with the kernels before the
//     carried ones (Compress, 4 unpacks into an accumulator, Compress,
//     UnpackScale), for comparison in the same run.
func BenchmarkStepDeviceVsCopy(b *testing.B) {
	b.Run("allreduce", func(b *testing.B) { benchAllReduceStep(b, false) })
	b.Run("allreduce/pageable-per-chunk", func(b *testing.B) { benchAllReduceStep(b, true) })
	b.Run("carried/kernels", func(b *testing.B) { benchStep(b, true) })
	b.Run("two-pass/kernels", func(b *testing.B) { benchStep(b, false) })
}

func benchStep(b *testing.B, carried bool) {
	const n, w = benchElems, 4
	bb := newBenchBufs(b, n, w)
	d := bb.dev
	c := n / w
	check := func(err error) {
		if err != nil {
			b.Fatal(err)
		}
	}
	step := func() {
		if carried {
			_, err := d.CompressCarried(bb.packed, bb.residual, 0.5, bb.input)
			check(err)
			_, err = d.SumCompressCarried(bb.srvPacked, bb.srvErr, 0.5, bb.recv, bb.scales)
			check(err)
		} else {
			_, err := d.Compress(bb.packed, bb.residual, bb.input)
			check(err)
			check(d.UnpackScale(bb.acc, bb.recv.Sub(0, c/8), 0.25))
			for j := 1; j < w; j++ {
				check(d.UnpackScaleAdd(bb.acc, bb.recv.Sub(j*c/8, (j+1)*c/8), 0.25))
			}
			_, err = d.Compress(bb.srvPacked, bb.srvErr, bb.acc)
			check(err)
		}
		if carried {
			check(d.UnpackScaleChunks(bb.input, bb.all, c, bb.scales))
		} else {
			check(d.UnpackScale(bb.input, bb.all, 1))
		}
		check(d.Synchronize())
	}
	med := samerun.Medians(b, bb.copyPass(b), step)
	b.ReportMetric(float64(8*n)/med[0]/1e9, "copy-GB/s")
	b.ReportMetric(med[1]*1e3, "step-ms")
	b.ReportMetric(med[1]/med[0], "x-copy")
}

func benchAllReduceStep(b *testing.B, plain bool) {
	const n, w = benchElems, 4
	bb := newBenchBufs(b, n, w)
	var dev accel.Device = bb.dev
	if plain {
		dev = plainDevice{dev}
	}
	st, err := onebit.NewDeviceState(dev, n, w)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { st.Close() })
	c := selfComm{size: w}
	ctx := context.Background()
	med := samerun.Medians(b, bb.copyPass(b), func() {
		if err := onebit.AllReduceDevice(ctx, c, bb.input, st); err != nil {
			b.Fatal(err)
		}
	})
	b.ReportMetric(float64(8*n)/med[0]/1e9, "copy-GB/s")
	b.ReportMetric(med[1]*1e3, "step-ms")
	b.ReportMetric(med[1]/med[0], "x-copy")
}

// plainDevice is a Device with none of the optional interfaces of package
// accel (ChunkUnpacker, HostAllocator).
type plainDevice struct{ accel.Device }

// selfComm stands in for W ranks that all send what rank 0 sends: its
// all-to-all and all-gather copy the caller's message into every slot, so
// that AllReduceDevice does all of its device and host work with no
// communication. Only the methods AllReduceDevice calls are implemented.
type selfComm struct {
	comm.Comm
	size int
}

func (c selfComm) Rank() int { return 0 }
func (c selfComm) Size() int { return c.size }

func (c selfComm) AllGatherBytes(_ context.Context, send, recv []byte) error {
	for j := range c.size {
		copy(recv[j*len(send):], send)
	}
	return nil
}

func (c selfComm) AllToAllBytes(_ context.Context, send, recv []byte) error {
	copy(recv, send)
	return nil
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
		{"compress-carried-N", 12*n + n/8, func(bb *benchBufs) error {
			_, err := bb.dev.CompressCarried(bb.packed, bb.residual, 0.5, bb.input)
			return err
		}},
		{"sum-compress-carried-N/4", float64(8*c + c/8 + w*c/8), func(bb *benchBufs) error {
			_, err := bb.dev.SumCompressCarried(bb.srvPacked, bb.srvErr, 0.5, bb.recv, bb.scales)
			return err
		}},
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
		{"unpack-chunks-N", 4*n + n/8, func(bb *benchBufs) error {
			if err := bb.dev.UnpackScaleChunks(bb.input, bb.all, c, bb.scales); err != nil {
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

// BenchmarkStagingVsCopy times the host<->device copies of one step's
// packed signs (N/8 bytes of the 64 Mi-element tensor) from and into
// pageable Go memory and page-locked memory of AllocHost, against the
// device-to-device copy of the whole tensor: what page-locked staging
// saves per copy.
func BenchmarkStagingVsCopy(b *testing.B) {
	const n = benchElems
	for _, k := range []struct {
		name   string
		pinned bool
		out    bool
	}{{"copy-out-N/8/pageable", false, true}, {"copy-out-N/8/pinned", true, true},
		{"copy-in-N/8/pageable", false, false}, {"copy-in-N/8/pinned", true, false}} {
		b.Run(k.name, func(b *testing.B) {
			bb := newBenchBufs(b, n, 1)
			host := bb.hostSend
			if k.pinned {
				h, err := bb.dev.AllocHost(n / 8)
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { h.Free() })
				host = h.Bytes()
			}
			med := samerun.Medians(b, bb.copyPass(b), func() {
				var err error
				if k.out {
					err = bb.dev.CopyOut(host, bb.packed)
				} else if err = bb.dev.CopyIn(bb.packed, host); err == nil {
					err = bb.dev.Synchronize() // a copy from page-locked memory returns at once
				}
				if err != nil {
					b.Fatal(err)
				}
			})
			b.ReportMetric(med[1]*1e6, "copy-us")
			b.ReportMetric(float64(n/8)/med[1]/1e9, "GB/s")
			b.ReportMetric(med[1]/med[0], "x-copy")
		})
	}
}
