package accel_test

import (
	"math/rand/v2"
	"testing"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/accel/internal/acceltest"
)

// BenchmarkCPU times the CPU device's compressions on 4 Mi elements: the
// carried ones against Compress (errorfeedback's, with its AVX2 kernels),
// and the server's SumCompressCarried of 4 chunks against the 4 unpacks
// and Compress it replaces. MB/s counts the tensor's float32 bytes.
func BenchmarkCPU(b *testing.B) {
	const n, w = 4 << 20, 4
	d := accel.NewCPU()
	alloc := func(bytes int) accel.Span {
		buf, err := d.Alloc(bytes)
		if err != nil {
			b.Fatal(err)
		}
		return accel.Whole(buf)
	}
	rng := rand.New(rand.NewPCG(1, 1))
	in := make([]float32, n)
	for i := range in {
		in[i] = float32(rng.NormFloat64())
	}
	input, x, acc, packed := alloc(4*n), alloc(4*n), alloc(4*n), alloc(n/8)
	chunks, scales := alloc(w*n/8), alloc(4*w)
	raw := make([]byte, w*n/8)
	for i := range raw {
		raw[i] = byte(rng.Uint32())
	}
	check := func(err error) {
		if err != nil {
			b.Fatal(err)
		}
	}
	check(d.CopyIn(input, acceltest.Bytes(in)))
	check(d.CopyIn(chunks, raw))
	check(d.CopyIn(scales, acceltest.Bytes([]float32{0.25, 0.25, 0.25, 0.25})))
	for _, k := range []struct {
		name string
		run  func() error
	}{
		{"compress", func() error { _, err := d.Compress(packed, x, input); return err }},
		{"compress-carried", func() error { _, err := d.CompressCarried(packed, x, 0.5, input); return err }},
		{"unpack4-compress", func() error {
			for j := range w {
				c := chunks.Sub(j*n/8, (j+1)*n/8)
				if j == 0 {
					check(d.UnpackScale(acc, c, 0.25))
				} else {
					check(d.UnpackScaleAdd(acc, c, 0.25))
				}
			}
			_, err := d.Compress(packed, x, acc)
			return err
		}},
		{"sum4-compress-carried", func() error { _, err := d.SumCompressCarried(packed, x, 0.5, chunks, scales); return err }},
	} {
		b.Run(k.name, func(b *testing.B) {
			b.SetBytes(4 * n)
			for b.Loop() {
				check(k.run())
			}
		})
	}
}
