// Package accel is the small interface between the 1-bit compressed
// allreduce and the memory and kernels of a device (a GPU, an NPU, or the
// host itself): allocation, host<->device copies, one ordered stream, and
// the four kernels the collective runs on device buffers.
//
// The kernels are the ones of packages errorfeedback and signpack, with the
// same semantics and the same wire format for packed signs (one bit per
// element, first element in the most significant bit, bit 1 for +1):
//
//   - Compress: compensate and norm, then pack the signs with the new
//     error (errorfeedback.Residual.Compress);
//   - UnpackScale and UnpackScaleAdd (signpack.UnpackScale and
//     signpack.UnpackScaleAdd);
//   - CompressCarried and SumCompressCarried: Compress on a residual kept
//     in its carried form (below), the second with the server's sum of
//     scaled packed chunks as its input.
//
// # Carried residuals
//
// Compress leaves the residual r = x - scale*sgn(x) in its buffer, which
// costs a pass over the buffer after the norm is known. The carried form
// keeps x itself, the value the last compression packed, with that
// compression's scale: the residual is
//
//	r = x - scale  (x >= 0 or NaN)
//	r = x + scale  (otherwise)
//
// in float32, exactly the value Compress would have stored, and a carried
// kernel forms it where it reads x anyway. Compensate, norm and pack then
// take one pass (the signs do not depend on the scale): on a GPU about 12
// bytes per element read and written instead of 20. A residual r is the
// carried pair (r, 0) exactly; Residuals turns carried values back into
// residuals on the host (for checkpoints).
//
// Every operation of a Device is ordered on its one stream, as if it ran in
// the order it was called. Operations that hand results to the host
// (CopyOut, Compress, which returns a scale) wait for the stream; the others
// may return before the device has finished, and Synchronize waits for
// them. A Device is not safe for concurrent use unless its documentation
// says so.
//
// CPU, in this package, is the implementation on host memory: the
// errorfeedback and signpack code behind the interface. Packages accel/cuda
// and accel/npu bind native libraries loaded at run time.
package accel

import (
	"errors"
	"fmt"
)

// Device is memory and kernels on one device, with one ordered stream.
//
// Spans passed to a Device must lie in Buffers that it allocated. Float32
// spans (those of Compress, UnpackScale and UnpackScaleAdd that hold
// floats) must start and end on 4-byte boundaries. A span of the wrong
// size, a span of another device's buffer or a freed buffer gives an error
// that names the argument; no method panics on bad input.
type Device interface {
	// Name describes the device, for example "cpu" or "cuda:0 NVIDIA H100".
	Name() string

	// Alloc returns a zeroed buffer of n bytes.
	Alloc(n int) (Buffer, error)
	// CopyIn copies src to dst, which must be len(src) bytes long. src may
	// be reused as soon as CopyIn returns, unless it is memory of
	// HostAllocator.AllocHost (see there).
	CopyIn(dst Span, src []byte) error
	// CopyOut copies src to dst, which must be src.Len bytes long, and
	// returns when dst holds the data (it waits for the stream).
	CopyOut(dst []byte, src Span) error
	// Copy copies src to dst on the device; both must have the same length
	// and must not overlap.
	Copy(dst, src Span) error
	// Zero sets every byte of dst to 0.
	Zero(dst Span) error

	// Compress is errorfeedback.Residual.Compress on device buffers:
	//
	//	x        = pad(input) + residual   (input is zero beyond its length)
	//	scale    = ||x||_2 / sqrt(len(residual))
	//	residual = x - scale*sgn(x)
	//	packed   = the signs of x in the wire format
	//
	// residual and input hold float32 values; input may be shorter than
	// residual; packed must be PackedLen(len(residual)) bytes. It returns
	// scale, which it waits for. The sum of squares is accumulated in
	// float64 and rounded once to float32; implementations may sum in any
	// order (the spec allows 1e-5 relative on norms).
	Compress(packed, residual, input Span) (scale float32, err error)
	// CompressCarried is Compress on a carried residual (see the package
	// documentation): carried holds x from the last call, packed with
	// prevScale (0 and a zeroed buffer at the start), and
	//
	//	x        = pad(input) + residual(x, prevScale)
	//	packed   = the signs of x in the wire format
	//
	// leaving x in carried; it returns scale = ||x||_2 / sqrt(len(carried)),
	// the prevScale of the next call. Where the input is shorter the
	// residual is kept as it is (not added to zero, which would turn -0
	// into +0). The sizes are those of Compress. Given the same prevScale,
	// the packed signs are Compress's and x is pad(input) + residual bit
	// for bit on every device (no norm enters them); the scale agrees with
	// Compress's within its tolerance.
	CompressCarried(packed, carried Span, prevScale float32, input Span) (scale float32, err error)
	// SumCompressCarried is CompressCarried whose input is the average the
	// 1-bit allreduce's server forms from the chunks the ranks sent it:
	// chunks holds len(scales) packed chunks of PackedLen(n) bytes each,
	// back to back (n = elements of carried), scales a float32 per chunk
	// (onebit.AllReduceDevice passes the worker scales divided by the
	// number of ranks), and the input is
	//
	//	scales[0]*sgn(chunk 0) + scales[1]*sgn(chunk 1) + ...
	//
	// summed in float32 from the left, the values UnpackScale of chunk 0
	// followed by UnpackScaleAdd of the others would leave.
	SumCompressCarried(packed, carried Span, prevScale float32, chunks, scales Span) (scale float32, err error)
	// UnpackScale writes scale*(+1 or -1) into every float32 of dst from
	// the packed signs, which must be PackedLen(elements of dst) bytes.
	UnpackScale(dst, packed Span, scale float32) error
	// UnpackScaleAdd adds scale*(+1 or -1) into every float32 of acc.
	UnpackScaleAdd(acc, packed Span, scale float32) error

	// Synchronize waits until every operation called so far has finished
	// and returns the first error the device reported for them.
	Synchronize() error
	// Close frees the device's resources. Buffers it allocated must not
	// be used afterwards.
	Close() error
}

// ChunkUnpacker is a Device that writes the output of the 1-bit allreduce,
// every chunk with its own scale, in one operation with the scales in
// device memory. onebit.AllReduceDevice uses it where a device has it, and
// UnpackScale once per chunk where not.
type ChunkUnpacker interface {
	// UnpackScaleChunks writes scales[j]*(+1 or -1) into the float32
	// values of dst in chunk j, elements [j*chunk, (j+1)*chunk), from the
	// packed signs, which must be PackedLen(elements of dst) bytes; chunk
	// is a positive multiple of 8 (chunk j's signs start at byte
	// j*chunk/8), and scales holds at least one float32 per chunk that
	// dst reaches. The values are those of UnpackScale on each chunk with
	// its scale.
	UnpackScaleChunks(dst, packed Span, chunk int, scales Span) error
}

// RowCopier is a Device that copies rows at a stride between host and
// device memory in one operation, which is how the 1-bit allreduce moves
// its packed signs between the device's layout (chunk after chunk) and the
// wire's (piece after piece) without a pass over them on the host.
type RowCopier interface {
	// CopyOutRows copies rows rows of width bytes from src to dst: row r
	// from byte r*srcPitch of src to byte r*dstPitch of dst. The pitches
	// are at least width; src and dst must hold every row. It waits for the
	// copy as CopyOut does.
	CopyOutRows(dst []byte, dstPitch int, src Span, srcPitch, width, rows int) error
	// CopyInRows is CopyOutRows from host to device, as CopyIn.
	CopyInRows(dst Span, dstPitch int, src []byte, srcPitch, width, rows int) error
}

// CheckRows checks the arguments of a row copy: pitches at least the width,
// and both sides long enough for every row.
func CheckRows(op string, dstLen, dstPitch, srcLen, srcPitch, width, rows int) error {
	if width < 0 || rows < 0 || dstPitch < width || srcPitch < width {
		return fmt.Errorf("accel: %s: %d rows of %d bytes at pitches %d (destination) and %d (source)", op, rows, width, dstPitch, srcPitch)
	}
	if rows == 0 || width == 0 {
		return nil
	}
	if need := (rows-1)*dstPitch + width; dstLen < need {
		return fmt.Errorf("accel: %s: destination of %d bytes for %d rows at pitch %d, want %d", op, dstLen, rows, dstPitch, need)
	}
	if need := (rows-1)*srcPitch + width; srcLen < need {
		return fmt.Errorf("accel: %s: source of %d bytes for %d rows at pitch %d, want %d", op, srcLen, rows, srcPitch, need)
	}
	return nil
}

// HostAllocator is a Device that allocates page-locked host memory, which
// its copies move without staging it through memory of their own (on a
// GPU, by DMA at the bus's rate). A CopyIn from such memory may return
// before the copy is done, like a kernel: the memory must not change until
// an operation that waits for the stream (CopyOut, Compress and the
// carried compressions, Synchronize) has returned. CopyOut into it keeps
// its semantics.
type HostAllocator interface {
	// AllocHost returns n bytes of page-locked host memory, zeroed.
	AllocHost(n int) (HostBuffer, error)
}

// HostBuffer is host memory allocated by a HostAllocator.
type HostBuffer interface {
	// Bytes is the memory; it must not be used after Free.
	Bytes() []byte
	// Free releases the memory; a second Free is a no-op.
	Free() error
}

// CheckChunks checks the arguments of UnpackScaleChunks for n elements
// of dst: a chunk length that is a positive multiple of 8, the packed
// signs of n elements and a scale for every chunk.
func CheckChunks(op string, packedLen, n, chunk, scales int) error {
	if chunk <= 0 || chunk%8 != 0 {
		return fmt.Errorf("accel: %s: chunk of %d elements, want a positive multiple of 8", op, chunk)
	}
	if err := CheckKernel(op, packedLen, n); err != nil {
		return err
	}
	if need := (n + chunk - 1) / chunk; scales < need {
		return fmt.Errorf("accel: %s: %d scales for %d chunks of %d elements", op, scales, need, chunk)
	}
	return nil
}

// Buffer is memory allocated by a Device.
type Buffer interface {
	// Len is the buffer's length in bytes.
	Len() int
	// Free releases the buffer; using it afterwards is an error. Free of
	// a freed buffer is a no-op.
	Free() error
}

// Span is a byte range of a Buffer: Len bytes from byte Off. It is the
// argument type of copies and kernels.
type Span struct {
	Buf      Buffer
	Off, Len int
}

// Whole is the span of all of b.
func Whole(b Buffer) Span {
	if b == nil {
		return Span{}
	}
	return Span{Buf: b, Len: b.Len()}
}

// Floats is the span of n float32 values of b from element off.
func Floats(b Buffer, off, n int) Span { return Span{Buf: b, Off: 4 * off, Len: 4 * n} }

// Sub is the part of s from byte lo to byte hi of s. It does not check the
// bounds; the Device that receives the span does.
func (s Span) Sub(lo, hi int) Span { return Span{Buf: s.Buf, Off: s.Off + lo, Len: hi - lo} }

// Elems is the number of float32 values in s.
func (s Span) Elems() int { return s.Len / 4 }

// PackedLen is the number of bytes n packed signs occupy.
func PackedLen(n int) int { return (n + 7) / 8 }

// ErrFreed is returned (wrapped) for a buffer used after Free or after its
// Device was closed.
var ErrFreed = errors.New("accel: buffer freed")

// CheckSpan reports whether s is a valid range of its buffer, whose length
// is bufLen; what names the argument in the error. Device implementations
// use it.
func CheckSpan(what string, s Span, bufLen int) error {
	if s.Off < 0 || s.Len < 0 || s.Off > bufLen || s.Len > bufLen-s.Off {
		return fmt.Errorf("accel: %s: bytes [%d, %d+%d) out of a %d-byte buffer", what, s.Off, s.Off, s.Len, bufLen)
	}
	return nil
}

// CheckFloats is CheckSpan for a span of float32 values: it also checks
// that the span starts and ends on 4-byte boundaries.
func CheckFloats(what string, s Span, bufLen int) error {
	if err := CheckSpan(what, s, bufLen); err != nil {
		return err
	}
	if s.Off%4 != 0 || s.Len%4 != 0 {
		return fmt.Errorf("accel: %s: bytes [%d, %d+%d) are not whole float32 values", what, s.Off, s.Off, s.Len)
	}
	return nil
}

// Residuals turns carried values (see the package documentation), packed
// with scale, into the residuals they stand for, in place.
func Residuals(carried []float32, scale float32) {
	for i, x := range carried {
		carried[i] = Residual(x, scale)
	}
}

// Residual is the residual of one carried value x packed with scale:
// x - scale for x >= 0 or NaN, else x + scale.
func Residual(x, scale float32) float32 {
	if x < 0 {
		return x + scale
	}
	return x - scale
}

// CheckSum checks the sizes of SumCompressCarried's arguments: chunks must
// hold one packed chunk of n elements per scale, and there must be at least
// one scale.
func CheckSum(op string, chunksLen, scales, n int) error {
	if scales < 1 {
		return fmt.Errorf("accel: %s: no chunk scales", op)
	}
	if chunksLen != scales*PackedLen(n) {
		return fmt.Errorf("accel: %s: chunks span of %d bytes for %d chunks of %d elements, want %d bytes",
			op, chunksLen, scales, n, scales*PackedLen(n))
	}
	return nil
}

// CheckKernel checks the sizes of a kernel's arguments against each other:
// packed must hold the signs of n elements, and for Compress input must
// not be longer than residual. Device implementations call it after
// checking each span.
func CheckKernel(op string, packedLen, n int) error {
	if packedLen != PackedLen(n) {
		return fmt.Errorf("accel: %s: packed span of %d bytes for %d elements, want %d bytes",
			op, packedLen, n, PackedLen(n))
	}
	return nil
}
