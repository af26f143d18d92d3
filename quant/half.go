package quant

import (
	"fmt"
	"math"
)

// Format is a 16-bit floating-point format for the wire.
type Format int

// The 16-bit formats.
const (
	// FP16 is IEEE 754 binary16: 1 sign, 5 exponent and 10 fraction
	// bits. Its largest finite value is 65504; float32 values of
	// magnitude 65520 or more round to infinity.
	FP16 Format = iota + 1
	// BF16 is bfloat16, the top half of a float32: 1 sign, 8 exponent
	// and 7 fraction bits. It has float32's range and 8 bits of
	// precision.
	BF16
)

// String returns "fp16" or "bf16".
func (f Format) String() string {
	switch f {
	case FP16:
		return "fp16"
	case BF16:
		return "bf16"
	}
	return fmt.Sprintf("Format(%d)", int(f))
}

// Valid reports whether f is FP16 or BF16.
func (f Format) Valid() bool { return f == FP16 || f == BF16 }

// Narrow converts the float32 values of src to f and stores them in dst,
// rounding to the nearest representable value, ties to even. Like copy it
// converts min(len(dst), len(src)) elements.
//
// NaN stays NaN (made quiet, sign and leading payload bits kept), ±Inf
// stays ±Inf and ±0 stays ±0. A finite value too large for f becomes ±Inf:
// Narrow returns the number of such values, so that overflow never passes
// without a word. For FP16 that is every finite |x| >= 65520; for BF16 only
// values within half a bfloat16 step of float32's largest (|x| >= 0x1.ffp127).
// FP16 keeps subnormals (down to 2^-24); BF16 keeps float32's.
//
// On amd64 the FP16 path uses the CPU's F16C conversion (VCVTPS2PH) and the
// BF16 path an AVX2 integer kernel when the CPU has them; both give the same
// bits as the portable code. Narrow panics if f is not a valid Format.
func Narrow(f Format, dst []uint16, src []float32) (overflow int) {
	n := min(len(dst), len(src))
	switch f {
	case FP16:
		return narrowFP16(dst[:n], src[:n])
	case BF16:
		return narrowBF16(dst[:n], src[:n])
	}
	panic("quant: Narrow with invalid " + f.String())
}

// Widen converts the f values of src to float32 and stores them in dst.
// Every 16-bit value is exactly representable, so Widen is exact: Widen
// after Narrow returns the rounded value, and NaN, ±Inf and ±0 survive.
// Like copy it converts min(len(dst), len(src)) elements. Widen panics if f
// is not a valid Format.
func Widen(f Format, dst []float32, src []uint16) {
	n := min(len(dst), len(src))
	switch f {
	case FP16:
		widenFP16(dst[:n], src[:n])
		return
	case BF16:
		widenBF16(dst[:n], src[:n])
		return
	}
	panic("quant: Widen with invalid " + f.String())
}

// widenAdd adds the widened values of src to acc: acc[i] += Widen(src[i]),
// in float32, for len(acc) <= len(src) elements.
func widenAdd(f Format, acc []float32, src []uint16) {
	src = src[:len(acc)]
	if f == FP16 {
		widenAddFP16(acc, src)
		return
	}
	widenAddBF16(acc, src)
}

// Overflow thresholds on |x|'s float32 bits: a finite value at or above
// them narrows to infinity.
const (
	fp16OverflowBits = 0x477ff000 // 65520, halfway between 65504 and 2^16
	bf16OverflowBits = 0x7f7f8000 // halfway between bfloat16's largest and 2^128
	f32InfBits       = 0x7f800000
)

// The portable kernels. They define the results: the assembly kernels
// give the same bits, which the tests check case by case and by fuzzing.

// f32ToF16 narrows x to binary16, rounding to nearest even, as VCVTPS2PH
// with rounding control 0 does.
func f32ToF16(x float32) uint16 {
	b := math.Float32bits(x)
	sign := uint16(b>>16) & 0x8000
	a := b & 0x7fffffff
	switch {
	case a >= 0x47800000: // |x| >= 2^16: Inf, NaN or overflow
		if a > f32InfBits {
			return sign | 0x7e00 | uint16(a>>13)&0x3ff // quiet NaN, leading payload kept
		}
		return sign | 0x7c00
	case a < 0x38800000: // below 2^-14, binary16's smallest normal
		// 0.5 has an ulp of 2^-24, binary16's subnormal step: the
		// float32 addition does the rounding, and the fraction bits of
		// the sum are the subnormal's (1024 when it rounds up to 2^-14).
		s := math.Float32frombits(a) + 0.5
		return sign | uint16(math.Float32bits(s)-0x3f000000)
	default:
		// Rebias the exponent (127 -> 15), then round the 13 dropped
		// bits to nearest even; a carry correctly ripples into the
		// exponent, up to infinity for [65520, 65536).
		a += 0xc8000fff + (a>>13)&1
		return sign | uint16(a>>13)
	}
}

// f16ToF32 widens binary16 h to float32, exactly, as VCVTPH2PS does.
func f16ToF32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	e := uint32(h>>10) & 0x1f
	m := uint32(h & 0x3ff)
	switch e {
	case 0: // zero or subnormal: m * 2^-24, exact in float32
		return math.Float32frombits(sign | math.Float32bits(float32(m)*(1.0/(1<<24))))
	case 0x1f: // Inf or NaN
		if m != 0 {
			m |= 0x200 // a signalling NaN comes back quiet
		}
		return math.Float32frombits(sign | f32InfBits | m<<13)
	}
	return math.Float32frombits(sign | (e+112)<<23 | m<<13)
}

// f32ToBF16 narrows x to bfloat16, rounding to nearest even.
func f32ToBF16(x float32) uint16 {
	b := math.Float32bits(x)
	if b&0x7fffffff > f32InfBits {
		return uint16(b>>16) | 0x40 // quiet NaN, sign and leading payload kept
	}
	return uint16((b + 0x7fff + (b>>16)&1) >> 16)
}

// bf16ToF32 widens bfloat16 h to float32, exactly.
func bf16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// overflows reports whether float32 bits b are finite with |x| >= the
// overflow threshold limit, as 1 or 0.
func overflows(b, limit uint32) int {
	if a := b & 0x7fffffff; a-limit < f32InfBits-limit {
		return 1
	}
	return 0
}

func narrowFP16Generic(dst []uint16, src []float32) (overflow int) {
	dst = dst[:len(src)]
	for i, x := range src {
		dst[i] = f32ToF16(x)
		overflow += overflows(math.Float32bits(x), fp16OverflowBits)
	}
	return overflow
}

func narrowBF16Generic(dst []uint16, src []float32) (overflow int) {
	dst = dst[:len(src)]
	for i, x := range src {
		dst[i] = f32ToBF16(x)
		overflow += overflows(math.Float32bits(x), bf16OverflowBits)
	}
	return overflow
}

func widenFP16Generic(dst []float32, src []uint16) {
	src = src[:len(dst)]
	for i, h := range src {
		dst[i] = f16ToF32(h)
	}
}

func widenBF16Generic(dst []float32, src []uint16) {
	src = src[:len(dst)]
	for i, h := range src {
		dst[i] = bf16ToF32(h)
	}
}

func widenAddFP16Generic(acc []float32, src []uint16) {
	src = src[:len(acc)]
	for i, h := range src {
		acc[i] += f16ToF32(h)
	}
}

func widenAddBF16Generic(acc []float32, src []uint16) {
	src = src[:len(acc)]
	for i, h := range src {
		acc[i] += bf16ToF32(h)
	}
}

// readGeneric ORs together the bits of every element of p: the portable
// streaming-read baseline of the benchmarks.
func readGeneric(p []float32) uint32 {
	var r0, r1, r2, r3 uint32
	for len(p) >= 4 {
		r0 |= math.Float32bits(p[0])
		r1 |= math.Float32bits(p[1])
		r2 |= math.Float32bits(p[2])
		r3 |= math.Float32bits(p[3])
		p = p[4:]
	}
	for _, x := range p {
		r0 |= math.Float32bits(x)
	}
	return r0 | r1 | r2 | r3
}
