//go:build amd64 && !purego

package quant

import "golang.org/x/sys/cpu"

// The amd64 fast path of the block quantizer. The assembly kernels in
// quantize_amd64.s handle whole blocks of 32 elements with AVX2; the
// portable kernels finish each group's tail and stand in for them on CPUs
// without AVX2.

// quantBlock is the number of elements one iteration of a kernel handles.
const quantBlock = 32

// quantAVX2 reports whether the CPU and the OS support AVX2; detected once.
var quantAVX2 = cpu.X86.HasAVX2

// fast is the implementation this CPU uses.
var fast = func() kernels {
	if !quantAVX2 {
		return generic
	}
	return kernels{
		amax:        amaxFast,
		quant8:      quant8Fast,
		quant4:      quant4Fast,
		dequantAdd8: dequantAdd8Fast,
		dequantAdd4: dequantAdd4Fast,
	}
}()

func amaxFast(x []float32) float32 {
	var m float32
	if nb := len(x) / quantBlock; nb > 0 {
		m = amaxAVX2(&x[0], nb)
		x = x[nb*quantBlock:]
	}
	if t := amaxGeneric(x); t > m {
		m = t
	}
	return m
}

func quant8Fast(dst []byte, src []float32, qs float32) {
	if nb := len(src) / quantBlock; nb > 0 {
		_ = dst[nb*quantBlock-1]
		quant8AVX2(&dst[0], &src[0], nb, qs)
		dst, src = dst[nb*quantBlock:], src[nb*quantBlock:]
	}
	quant8Generic(dst, src, qs)
}

func quant4Fast(dst []byte, src []float32, qs float32) {
	if nb := len(src) / quantBlock; nb > 0 {
		_ = dst[nb*quantBlock/2-1]
		quant4AVX2(&dst[0], &src[0], nb, qs)
		dst, src = dst[nb*quantBlock/2:], src[nb*quantBlock:]
	}
	quant4Generic(dst, src, qs)
}

func dequantAdd8Fast(dst []float32, src []byte, scale float32) {
	if nb := len(dst) / quantBlock; nb > 0 {
		_ = src[nb*quantBlock-1]
		dequantAdd8AVX2(&dst[0], &src[0], nb, scale)
		dst, src = dst[nb*quantBlock:], src[nb*quantBlock:]
	}
	dequantAdd8Generic(dst, src, scale)
}

func dequantAdd4Fast(dst []float32, src []byte, scale float32) {
	if nb := len(dst) / quantBlock; nb > 0 {
		_ = src[nb*quantBlock/2-1]
		dequantAdd4AVX2(&dst[0], &src[0], nb, scale)
		dst, src = dst[nb*quantBlock:], src[nb*quantBlock/2:]
	}
	dequantAdd4Generic(dst, src, scale)
}

// Implemented in quantize_amd64.s; blocks > 0.

// amaxAVX2 returns the largest |x| of blocks*32 elements (NaN skipped).
//
//go:noescape
func amaxAVX2(x *float32, blocks int) float32

// quant8AVX2 writes the int8 codes of blocks*32 elements.
//
//go:noescape
func quant8AVX2(dst *byte, src *float32, blocks int, qs float32)

// quant4AVX2 writes the packed int4 codes of blocks*32 elements (16 bytes
// a block).
//
//go:noescape
func quant4AVX2(dst *byte, src *float32, blocks int, qs float32)

// dequantAdd8AVX2 adds code*scale of blocks*32 int8 codes to dst.
//
//go:noescape
func dequantAdd8AVX2(dst *float32, src *byte, blocks int, scale float32)

// dequantAdd4AVX2 adds code*scale of blocks*32 packed int4 codes to dst.
//
//go:noescape
func dequantAdd4AVX2(dst *float32, src *byte, blocks int, scale float32)
