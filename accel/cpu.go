package accel

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/lowbit-ml/lowbit/errorfeedback"
	"github.com/lowbit-ml/lowbit/signpack"
)

// CPU is the Device on host memory: its kernels are errorfeedback's and
// signpack's (with their AVX2 fast paths where the CPU has them), so the
// device version of an algorithm run on a CPU gives bit for bit the results
// of the host version. Operations run synchronously. The zero CPU is ready
// to use; it is not safe for concurrent use.
type CPU struct {
	closed bool
	acc    []float32 // SumCompressCarried's accumulator, grown on demand
}

// NewCPU returns a CPU device.
func NewCPU() *CPU { return &CPU{} }

var (
	_ Device        = (*CPU)(nil)
	_ ChunkUnpacker = (*CPU)(nil)
	_ RowCopier     = (*CPU)(nil)
)

// cpuBuffer is host memory, backed by float32s so that float spans are
// aligned.
type cpuBuffer struct {
	dev   *CPU
	words []float32 // backing, ceil(n/4) words
	bytes []byte    // the n bytes of words
}

func (b *cpuBuffer) Len() int { return len(b.bytes) }

func (b *cpuBuffer) Free() error {
	b.words, b.bytes = nil, nil
	b.dev = nil
	return nil
}

// Name returns "cpu".
func (d *CPU) Name() string { return "cpu" }

// Alloc returns a zeroed host buffer of n bytes.
func (d *CPU) Alloc(n int) (Buffer, error) {
	if d.closed {
		return nil, fmt.Errorf("accel: cpu: alloc on a closed device")
	}
	if n < 0 {
		return nil, fmt.Errorf("accel: cpu: alloc of %d bytes", n)
	}
	b := &cpuBuffer{dev: d, words: make([]float32, (n+3)/4)}
	if n > 0 {
		b.bytes = unsafe.Slice((*byte)(unsafe.Pointer(&b.words[0])), n)
	} else {
		b.bytes = []byte{}
	}
	return b, nil
}

// bytesOf checks s and returns its bytes.
func (d *CPU) bytesOf(what string, s Span) ([]byte, error) {
	if d.closed {
		return nil, fmt.Errorf("accel: cpu: %s: %w (device closed)", what, ErrFreed)
	}
	b, ok := s.Buf.(*cpuBuffer)
	if !ok || b == nil {
		return nil, fmt.Errorf("accel: cpu: %s: span of a %T, not of a cpu buffer", what, s.Buf)
	}
	if b.bytes == nil {
		return nil, fmt.Errorf("accel: cpu: %s: %w", what, ErrFreed)
	}
	if b.dev != d {
		return nil, fmt.Errorf("accel: cpu: %s: buffer of another device", what)
	}
	if err := CheckSpan(what, s, len(b.bytes)); err != nil {
		return nil, err
	}
	return b.bytes[s.Off : s.Off+s.Len : s.Off+s.Len], nil
}

// floatsOf checks s and returns its float32 values.
func (d *CPU) floatsOf(what string, s Span) ([]float32, error) {
	p, err := d.bytesOf(what, s)
	if err != nil {
		return nil, err
	}
	if err := CheckFloats(what, s, s.Buf.Len()); err != nil {
		return nil, err
	}
	if len(p) == 0 {
		return []float32{}, nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&p[0])), len(p)/4), nil
}

// CopyIn copies src into dst.
func (d *CPU) CopyIn(dst Span, src []byte) error {
	p, err := d.bytesOf("copy-in destination", dst)
	if err != nil {
		return err
	}
	if len(p) != len(src) {
		return fmt.Errorf("accel: cpu: copy-in of %d bytes into a %d-byte span", len(src), len(p))
	}
	copy(p, src)
	return nil
}

// CopyOut copies src into dst.
func (d *CPU) CopyOut(dst []byte, src Span) error {
	p, err := d.bytesOf("copy-out source", src)
	if err != nil {
		return err
	}
	if len(p) != len(dst) {
		return fmt.Errorf("accel: cpu: copy-out of a %d-byte span into %d bytes", len(p), len(dst))
	}
	copy(dst, p)
	return nil
}

// Copy copies src into dst.
func (d *CPU) Copy(dst, src Span) error {
	q, err := d.bytesOf("copy destination", dst)
	if err != nil {
		return err
	}
	p, err := d.bytesOf("copy source", src)
	if err != nil {
		return err
	}
	if len(p) != len(q) {
		return fmt.Errorf("accel: cpu: copy of a %d-byte span into a %d-byte span", len(p), len(q))
	}
	copy(q, p)
	return nil
}

// Zero clears dst.
func (d *CPU) Zero(dst Span) error {
	p, err := d.bytesOf("zero", dst)
	if err != nil {
		return err
	}
	clear(p)
	return nil
}

// Compress runs errorfeedback.Residual.Compress.
func (d *CPU) Compress(packed, residual, input Span) (float32, error) {
	r, err := d.floatsOf("compress residual", residual)
	if err != nil {
		return 0, err
	}
	in, err := d.floatsOf("compress input", input)
	if err != nil {
		return 0, err
	}
	p, err := d.bytesOf("compress packed", packed)
	if err != nil {
		return 0, err
	}
	if len(in) > len(r) {
		return 0, fmt.Errorf("accel: cpu: compress: input of %d elements is longer than the residual (%d)", len(in), len(r))
	}
	if err := CheckKernel("compress", len(p), len(r)); err != nil {
		return 0, err
	}
	scale, err := errorfeedback.Residual(r).Compress(p, in)
	if err != nil {
		return 0, fmt.Errorf("accel: cpu: %w", err)
	}
	return scale, nil
}

// CompressCarried forms the residuals in place with signpack.PackResidual,
// then runs errorfeedback.Residual.Compensate and signpack.Pack.
func (d *CPU) CompressCarried(packed, carried Span, prevScale float32, input Span) (float32, error) {
	x, p, err := d.kernelArgs("compress-carried", "compress-carried x", "compress-carried packed", carried, packed)
	if err != nil {
		return 0, err
	}
	in, err := d.floatsOf("compress-carried input", input)
	if err != nil {
		return 0, err
	}
	if len(in) > len(x) {
		return 0, fmt.Errorf("accel: cpu: compress-carried: input of %d elements is longer than x (%d)", len(in), len(x))
	}
	return compressCarried(p, x, prevScale, in)
}

// SumCompressCarried forms the residuals in place, accumulates the chunks
// with signpack.UnpackScale and UnpackScaleAdd into a scratch buffer the
// device keeps (it grows on the first call of a size), then runs
// errorfeedback.Residual.Compensate and signpack.Pack.
func (d *CPU) SumCompressCarried(packed, carried Span, prevScale float32, chunks, scales Span) (float32, error) {
	x, p, err := d.kernelArgs("sum-compress-carried", "sum-compress-carried x", "sum-compress-carried packed", carried, packed)
	if err != nil {
		return 0, err
	}
	c, err := d.bytesOf("sum-compress-carried chunks", chunks)
	if err != nil {
		return 0, err
	}
	sc, err := d.floatsOf("sum-compress-carried scales", scales)
	if err != nil {
		return 0, err
	}
	if err := CheckSum("sum-compress-carried", len(c), len(sc), len(x)); err != nil {
		return 0, err
	}
	if len(x) == 0 {
		return 0, nil
	}
	if cap(d.acc) < len(x) {
		d.acc = make([]float32, len(x))
	}
	acc := d.acc[:len(x)]
	stride := PackedLen(len(x))
	signpack.UnpackScale(acc, c[:stride], sc[0])
	for j := 1; j < len(sc); j++ {
		signpack.UnpackScaleAdd(acc, c[j*stride:(j+1)*stride], sc[j])
	}
	return compressCarried(p, x, prevScale, acc)
}

// compressCarried is CompressCarried after its checks: the residuals in
// one pass of signpack.PackResidual, the kernel that leaves Compress's
// residuals (its signs in packed are overwritten at the end; a scale of +0
// leaves every x as it is), then errorfeedback.Residual.Compensate and
// signpack.Pack.
func compressCarried(packed []byte, x []float32, prevScale float32, input []float32) (float32, error) {
	if len(x) == 0 {
		return 0, nil
	}
	if math.Float32bits(prevScale) != 0 {
		signpack.PackResidual(packed, x, prevScale)
	}
	scale, err := errorfeedback.Residual(x).Compensate(input)
	if err != nil {
		return 0, fmt.Errorf("accel: cpu: %w", err)
	}
	signpack.Pack(packed, x)
	return scale, nil
}

// UnpackScale runs signpack.UnpackScale.
func (d *CPU) UnpackScale(dst, packed Span, scale float32) error {
	x, p, err := d.kernelArgs("unpack-scale", "unpack-scale destination", "unpack-scale packed", dst, packed)
	if err != nil {
		return err
	}
	signpack.UnpackScale(x, p, scale)
	return nil
}

// UnpackScaleAdd runs signpack.UnpackScaleAdd.
func (d *CPU) UnpackScaleAdd(acc, packed Span, scale float32) error {
	x, p, err := d.kernelArgs("unpack-scale-add", "unpack-scale-add accumulator", "unpack-scale-add packed", acc, packed)
	if err != nil {
		return err
	}
	signpack.UnpackScaleAdd(x, p, scale)
	return nil
}

// UnpackScaleChunks runs signpack.UnpackScale on each chunk with its scale.
func (d *CPU) UnpackScaleChunks(dst, packed Span, chunk int, scales Span) error {
	x, p, err := d.kernelArgs("unpack-scale-chunks", "unpack-scale-chunks destination", "unpack-scale-chunks packed", dst, packed)
	if err != nil {
		return err
	}
	sc, err := d.floatsOf("unpack-scale-chunks scales", scales)
	if err != nil {
		return err
	}
	if err := CheckChunks("unpack-scale-chunks", len(p), len(x), chunk, len(sc)); err != nil {
		return err
	}
	for j := 0; j*chunk < len(x); j++ {
		lo, hi := j*chunk, min((j+1)*chunk, len(x))
		signpack.UnpackScale(x[lo:hi], p[lo/8:PackedLen(hi)], sc[j])
	}
	return nil
}

// CopyOutRows copies rows from src to dst at their pitches.
func (d *CPU) CopyOutRows(dst []byte, dstPitch int, src Span, srcPitch, width, rows int) error {
	b, err := d.bytesOf("copy-out-rows source", src)
	if err != nil {
		return err
	}
	if err := CheckRows("copy-out-rows", len(dst), dstPitch, len(b), srcPitch, width, rows); err != nil {
		return err
	}
	copyRows(dst, dstPitch, b, srcPitch, width, rows)
	return nil
}

// CopyInRows copies rows from src to dst at their pitches.
func (d *CPU) CopyInRows(dst Span, dstPitch int, src []byte, srcPitch, width, rows int) error {
	b, err := d.bytesOf("copy-in-rows destination", dst)
	if err != nil {
		return err
	}
	if err := CheckRows("copy-in-rows", len(b), dstPitch, len(src), srcPitch, width, rows); err != nil {
		return err
	}
	copyRows(b, dstPitch, src, srcPitch, width, rows)
	return nil
}

func copyRows(dst []byte, dstPitch int, src []byte, srcPitch, width, rows int) {
	for r := range rows {
		copy(dst[r*dstPitch:r*dstPitch+width], src[r*srcPitch:r*srcPitch+width])
	}
}

// kernelArgs checks a kernel's float32 span and the packed signs of its
// elements; the names are constants so that the check allocates nothing.
func (d *CPU) kernelArgs(op, dstName, packedName string, dst, packed Span) ([]float32, []byte, error) {
	x, err := d.floatsOf(dstName, dst)
	if err != nil {
		return nil, nil, err
	}
	p, err := d.bytesOf(packedName, packed)
	if err != nil {
		return nil, nil, err
	}
	if err := CheckKernel(op, len(p), len(x)); err != nil {
		return nil, nil, err
	}
	return x, p, nil
}

// Synchronize returns nil: CPU operations are synchronous.
func (d *CPU) Synchronize() error { return nil }

// Close marks the device closed; its buffers can no longer be used with it.
func (d *CPU) Close() error {
	d.closed = true
	return nil
}
