//go:build amd64 && !purego

package signpack

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// The amd64 fast path. The assembly kernels in pack_amd64.s process whole
// blocks of 32 elements (4 packed bytes) with AVX2; the portable kernels
// finish the tail and stand in for them on CPUs without AVX2.

// block is the number of elements one iteration of an AVX2 kernel handles.
const block = 32

// useAVX2 reports whether the CPU and the operating system support AVX2.
// It is detected once and never changes.
var useAVX2 = cpu.X86.HasAVX2

func pack(dst []byte, src []float32) {
	if useAVX2 {
		packFast(dst, src)
		return
	}
	packGeneric(dst, src)
}

func packResidual(dst []byte, x []float32, scale float32) {
	if useAVX2 {
		packResidualFast(dst, x, scale)
		return
	}
	packResidualGeneric(dst, x, scale)
}

func unpackScale(dst []float32, src []byte, scale float32) {
	if useAVX2 {
		unpackScaleFast(dst, src, scale)
		return
	}
	unpackScaleGeneric(dst, src, scale)
}

// unpackScaleStream is unpackScale with non-temporal stores where dst is
// 32-byte aligned (VMOVNTPS requires it; Go's large allocations are
// page-aligned, and a block of them at a multiple of 8 elements keeps it).
// A dst that is not stays on the ordinary stores: its groups of 8 elements
// share their byte of src, so no head can be peeled off to align it.
func unpackScaleStream(dst []float32, src []byte, scale float32) {
	if streams(dst) {
		unpackScaleStreamFast(dst, src, scale)
		return
	}
	unpackScale(dst, src, scale)
}

// streams reports whether unpackScaleStream writes dst with non-temporal
// stores.
func streams(dst []float32) bool {
	return useAVX2 && len(dst) >= block && uintptr(unsafe.Pointer(&dst[0]))%32 == 0
}

func unpackScaleAdd(acc []float32, src []byte, scale float32) {
	if useAVX2 {
		unpackScaleAddFast(acc, src, scale)
		return
	}
	unpackScaleAddGeneric(acc, src, scale)
}

// The *Fast functions require AVX2: the assembly handles the whole blocks
// and the generic kernels the rest.

func packFast(dst []byte, src []float32) {
	if nb := len(src) / block; nb > 0 {
		_ = dst[nb*block/8-1]
		packAVX2(&dst[0], &src[0], nb)
		dst, src = dst[nb*block/8:], src[nb*block:]
	}
	packGeneric(dst, src)
}

func packResidualFast(dst []byte, x []float32, scale float32) {
	if nb := len(x) / block; nb > 0 {
		_ = dst[nb*block/8-1]
		packResidualAVX2(&dst[0], &x[0], nb, scale)
		dst, x = dst[nb*block/8:], x[nb*block:]
	}
	packResidualGeneric(dst, x, scale)
}

func unpackScaleFast(dst []float32, src []byte, scale float32) {
	if nb := len(dst) / block; nb > 0 {
		_ = src[nb*block/8-1]
		unpackScaleAVX2(&dst[0], &src[0], nb, scale)
		dst, src = dst[nb*block:], src[nb*block/8:]
	}
	unpackScaleGeneric(dst, src, scale)
}

func unpackScaleStreamFast(dst []float32, src []byte, scale float32) {
	if nb := len(dst) / block; nb > 0 {
		_ = src[nb*block/8-1]
		unpackScaleStreamAVX2(&dst[0], &src[0], nb, scale)
		dst, src = dst[nb*block:], src[nb*block/8:]
	}
	unpackScaleGeneric(dst, src, scale)
}

func unpackScaleAddFast(acc []float32, src []byte, scale float32) {
	if nb := len(acc) / block; nb > 0 {
		_ = src[nb*block/8-1]
		unpackScaleAddAVX2(&acc[0], &src[0], nb, scale)
		acc, src = acc[nb*block:], src[nb*block/8:]
	}
	unpackScaleAddGeneric(acc, src, scale)
}

// readBaseline reads every element of p (a plain streaming read, the
// memory-bandwidth baseline of the benchmarks) and returns the OR of their
// bits so that the read cannot be skipped.
func readBaseline(p []float32) uint32 {
	var r uint32
	const readBlock = 64
	if nb := len(p) / readBlock; nb > 0 && useAVX2 {
		r = readAVX2(&p[0], nb)
		p = p[nb*readBlock:]
	}
	return r | readGeneric(p)
}

// Implemented in pack_amd64.s.

// packAVX2 packs blocks*32 elements of src into blocks*4 bytes of dst.
//
//go:noescape
func packAVX2(dst *byte, src *float32, blocks int)

// packResidualAVX2 is packAVX2 that also replaces each x[i] with
// x[i] - scale (bit 1) or x[i] + scale (bit 0).
//
//go:noescape
func packResidualAVX2(dst *byte, x *float32, blocks int, scale float32)

// unpackScaleAVX2 writes ±scale into blocks*32 elements of dst.
//
//go:noescape
func unpackScaleAVX2(dst *float32, src *byte, blocks int, scale float32)

// unpackScaleStreamAVX2 is unpackScaleAVX2 with non-temporal stores; dst
// must be 32-byte aligned.
//
//go:noescape
func unpackScaleStreamAVX2(dst *float32, src *byte, blocks int, scale float32)

// unpackScaleAddAVX2 adds ±scale into blocks*32 elements of acc.
//
//go:noescape
func unpackScaleAddAVX2(acc *float32, src *byte, blocks int, scale float32)

// readAVX2 ORs together the bits of blocks*64 elements of p.
//
//go:noescape
func readAVX2(p *float32, blocks int) uint32

// fastPath names the kernels pack and friends use on this CPU.
func fastPath() string {
	if useAVX2 {
		return "avx2"
	}
	return "generic"
}
