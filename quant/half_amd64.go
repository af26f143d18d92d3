//go:build amd64 && !purego

package quant

import (
	"unsafe"

	"golang.org/x/sys/cpu"
)

// The amd64 fast paths. The assembly kernels in half_amd64.s handle whole
// blocks of 32 elements; the portable kernels finish the tail and stand in
// for them on CPUs without the instructions.

// halfBlock is the number of elements one iteration of a kernel handles.
const halfBlock = 32

// maxKernelBlocks bounds one assembly call so that its 8 per-lane int32
// overflow counters cannot wrap.
const maxKernelBlocks = 1 << 24

// streamElems is the length from which narrowing writes with
// non-temporal stores, which bypass the caches: at this size the output
// would not stay in cache anyway, and the stores save reading every
// destination line before writing it.
const streamElems = 1 << 21

// streamAlign returns how many leading elements of dst to convert with the
// portable kernel so that the rest starts on a 32-byte boundary, as
// non-temporal stores need, and whether to stream at all.
func streamAlign(dst []uint16) (head int, stream bool) {
	if len(dst) < streamElems {
		return 0, false
	}
	mis := uintptr(unsafe.Pointer(unsafe.SliceData(dst))) % 32
	if mis%2 != 0 {
		return 0, false
	}
	return int((32-mis)%32) / 2, true
}

// useF16C reports whether the CPU converts fp16 in hardware (F16C, with
// AVX2 for the overflow count) and the OS saves the YMM registers;
// useAVX2 whether it has AVX2 for the bfloat16 kernels. golang.org/x/sys/cpu
// does not report F16C, so its CPUID bit (leaf 1, ECX bit 29) is read
// here. Both are detected once and never change.
var (
	useAVX2 = cpu.X86.HasAVX2
	useF16C = cpu.X86.HasAVX2 && hasF16C()
)

func hasF16C() bool {
	_, _, ecx, _ := cpuid(1, 0)
	return ecx&(1<<29) != 0
}

func narrowFP16(dst []uint16, src []float32) int {
	if !useF16C {
		return narrowFP16Generic(dst, src)
	}
	head, stream := streamAlign(dst)
	ov := narrowFP16Generic(dst[:head], src[:head])
	dst, src = dst[head:], src[head:]
	for nb := len(src) / halfBlock; nb > 0; nb = len(src) / halfBlock {
		nb = min(nb, maxKernelBlocks)
		_ = dst[nb*halfBlock-1]
		ov += int(narrowFP16F16C(&dst[0], &src[0], nb, stream))
		dst, src = dst[nb*halfBlock:], src[nb*halfBlock:]
	}
	return ov + narrowFP16Generic(dst, src)
}

func narrowBF16(dst []uint16, src []float32) int {
	if !useAVX2 {
		return narrowBF16Generic(dst, src)
	}
	head, stream := streamAlign(dst)
	ov := narrowBF16Generic(dst[:head], src[:head])
	dst, src = dst[head:], src[head:]
	for nb := len(src) / halfBlock; nb > 0; nb = len(src) / halfBlock {
		nb = min(nb, maxKernelBlocks)
		_ = dst[nb*halfBlock-1]
		ov += int(narrowBF16AVX2(&dst[0], &src[0], nb, stream))
		dst, src = dst[nb*halfBlock:], src[nb*halfBlock:]
	}
	return ov + narrowBF16Generic(dst, src)
}

func widenFP16(dst []float32, src []uint16) {
	if nb := len(dst) / halfBlock; nb > 0 && useF16C {
		_ = src[nb*halfBlock-1]
		widenFP16F16C(&dst[0], &src[0], nb)
		dst, src = dst[nb*halfBlock:], src[nb*halfBlock:]
	}
	widenFP16Generic(dst, src)
}

func widenBF16(dst []float32, src []uint16) {
	if nb := len(dst) / halfBlock; nb > 0 && useAVX2 {
		_ = src[nb*halfBlock-1]
		widenBF16AVX2(&dst[0], &src[0], nb)
		dst, src = dst[nb*halfBlock:], src[nb*halfBlock:]
	}
	widenBF16Generic(dst, src)
}

func widenAddFP16(acc []float32, src []uint16) {
	if nb := len(acc) / halfBlock; nb > 0 && useF16C {
		_ = src[nb*halfBlock-1]
		widenAddFP16F16C(&acc[0], &src[0], nb)
		acc, src = acc[nb*halfBlock:], src[nb*halfBlock:]
	}
	widenAddFP16Generic(acc, src)
}

func widenAddBF16(acc []float32, src []uint16) {
	if nb := len(acc) / halfBlock; nb > 0 && useAVX2 {
		_ = src[nb*halfBlock-1]
		widenAddBF16AVX2(&acc[0], &src[0], nb)
		acc, src = acc[nb*halfBlock:], src[nb*halfBlock:]
	}
	widenAddBF16Generic(acc, src)
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

// halfPath names the kernels of each format on this CPU.
func halfPath(f Format) string {
	switch {
	case f == FP16 && useF16C:
		return "f16c"
	case f == BF16 && useAVX2:
		return "avx2"
	}
	return "generic"
}

// Implemented in half_amd64.s.

// cpuid executes CPUID with the given leaf (EAX) and subleaf (ECX).
func cpuid(eax, ecx uint32) (a, b, c, d uint32)

// narrowFP16F16C narrows blocks*32 elements of src into dst with
// VCVTPS2PH and returns how many finite ones overflowed. With stream it
// writes with non-temporal stores; dst must then be 32-byte aligned.
//
//go:noescape
func narrowFP16F16C(dst *uint16, src *float32, blocks int, stream bool) int32

// narrowBF16AVX2 narrows blocks*32 elements of src into dst and returns
// how many finite ones overflowed. With stream it writes with
// non-temporal stores; dst must then be 32-byte aligned.
//
//go:noescape
func narrowBF16AVX2(dst *uint16, src *float32, blocks int, stream bool) int32

// widenFP16F16C widens blocks*32 elements of src into dst.
//
//go:noescape
func widenFP16F16C(dst *float32, src *uint16, blocks int)

// widenBF16AVX2 widens blocks*32 elements of src into dst.
//
//go:noescape
func widenBF16AVX2(dst *float32, src *uint16, blocks int)

// widenAddFP16F16C adds the widened blocks*32 elements of src to acc.
//
//go:noescape
func widenAddFP16F16C(acc *float32, src *uint16, blocks int)

// widenAddBF16AVX2 adds the widened blocks*32 elements of src to acc.
//
//go:noescape
func widenAddBF16AVX2(acc *float32, src *uint16, blocks int)

// readAVX2 ORs together the bits of blocks*64 elements of p.
//
//go:noescape
func readAVX2(p *float32, blocks int) uint32
