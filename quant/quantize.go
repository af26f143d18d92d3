package quant

import (
	"encoding/binary"
	"fmt"
	"math"
)

// The symmetric block quantizer of the spec (quant.md):
//
//	amax    = max |x| over the group
//	q_scale = 2^bits / (2*amax)             (1 when amax = 0)
//	code    = clamp(round_half_even(x * q_scale), -2^(bits-1), 2^(bits-1)-1)
//	scale   = 1 / q_scale                   (stored, float32)
//
// everything in float32, so that the fast and the portable kernels and the
// reference agree bit for bit. A value dequantizes to code * scale.
//
// The formula is DeepSpeed's, and it is not symmetric: +amax maps to
// 2^(bits-1), clamped to 2^(bits-1)-1, so +amax comes back as
// amax*(1-1/2^(bits-1)) (1/128 less with int8, 1/8 less with int4) while
// -amax comes back exactly. (package outer's int8 codec, which quantizes
// twice per exchange with no error feedback, uses a symmetric scale,
// amax/127, instead.)
//
// Non-finite inputs: NaN is skipped when the group's amax is taken and
// quantizes to the lowest code; a group holding ±Inf (or values above
// MaxFloat32/2) has q_scale 0 and dequantizes to NaN. Gradients that need
// them should be checked before they are quantized.

// DefaultGroupSize is the quantization group used when a configuration
// leaves it 0: 2048 elements (8 KiB of float32, which stays in the L1
// cache between the two passes over a group), as in ZeRO++.
const DefaultGroupSize = 2048

// CodesLen returns the number of code bytes n values take with bits-bit
// codes: n for int8, ceil(n/2) for int4 (two per byte, first element in
// the high nibble). It returns 0 for other bit widths.
func CodesLen(n, bits int) int {
	switch bits {
	case 8:
		return n
	case 4:
		return (n + 1) / 2
	}
	return 0
}

// NumGroups returns the number of quantization groups (and so of scales)
// of n values in groups of groupSize: ceil(n/groupSize), the last group
// possibly shorter. It returns 0 when groupSize <= 0.
func NumGroups(n, groupSize int) int {
	if groupSize <= 0 || n <= 0 {
		return 0
	}
	return (n + groupSize - 1) / groupSize
}

// checkArgs validates the arguments shared by Quantize and DequantizeAdd.
func checkArgs(op string, n, ncodes, nscales, bits, groupSize int) error {
	if bits != 4 && bits != 8 {
		return fmt.Errorf("quant: %s: %d-bit codes: want 4 or 8", op, bits)
	}
	if groupSize <= 0 {
		return fmt.Errorf("quant: %s: group size %d: want > 0", op, groupSize)
	}
	if want := CodesLen(n, bits); ncodes != want {
		return fmt.Errorf("quant: %s: %d code bytes for %d values, want %d", op, ncodes, n, want)
	}
	if want := NumGroups(n, groupSize); nscales != want {
		return fmt.Errorf("quant: %s: %d scales for %d values in groups of %d, want %d", op, nscales, n, groupSize, want)
	}
	return nil
}

// Quantize quantizes src in groups of groupSize elements into bits-bit
// codes (4 or 8) and one scale per group. len(codes) must be
// CodesLen(len(src), bits) and len(scales) NumGroups(len(src), groupSize).
// It allocates nothing.
//
// To keep groups from straddling partitions, quantize each partition with
// its own call.
func Quantize(codes []byte, scales []float32, src []float32, bits, groupSize int) error {
	if err := checkArgs("quantize", len(src), len(codes), len(scales), bits, groupSize); err != nil {
		return err
	}
	quantizeWith(&fast, codes, scales, src, bits, groupSize)
	return nil
}

// DequantizeAdd adds the values that codes and scales stand for (code *
// scale, in float32) to dst: dst[i] += code[i]*scale[i/groupSize]. The
// lengths follow Quantize's rules with len(dst) values. It allocates
// nothing.
func DequantizeAdd(dst []float32, codes []byte, scales []float32, bits, groupSize int) error {
	if err := checkArgs("dequantize", len(dst), len(codes), len(scales), bits, groupSize); err != nil {
		return err
	}
	dequantizeAddWith(&fast, dst, codes, scales, bits, groupSize)
	return nil
}

// kernels is one implementation of the per-group kernels. quant4 and
// dequantAdd4 start at an even element, that is at a byte boundary.
type kernels struct {
	amax        func(x []float32) float32
	quant8      func(dst []byte, src []float32, qs float32)
	quant4      func(dst []byte, src []float32, qs float32)
	dequantAdd8 func(dst []float32, src []byte, scale float32)
	dequantAdd4 func(dst []float32, src []byte, scale float32)
}

// generic is the portable implementation; fast is the one this CPU uses
// (set per architecture, generic where there is no fast path).
var generic = kernels{
	amax:        amaxGeneric,
	quant8:      quant8Generic,
	quant4:      quant4Generic,
	dequantAdd8: dequantAdd8Generic,
	dequantAdd4: dequantAdd4Generic,
}

// scaleFor returns q_scale and the stored scale of a group whose largest
// magnitude is amax, exactly as the spec computes them in float32.
func scaleFor(amax float32, bits int) (qs, scale float32) {
	if amax == 0 {
		return 1, 1
	}
	qs = float32(int32(1)<<bits) / (2 * amax)
	return qs, 1 / qs
}

func quantizeWith(k *kernels, codes []byte, scales []float32, src []float32, bits, groupSize int) {
	for gi := range scales {
		s := gi * groupSize
		e := min(s+groupSize, len(src))
		x := src[s:e]
		qs, scale := scaleFor(k.amax(x), bits)
		scales[gi] = scale
		if bits == 8 {
			k.quant8(codes[s:e], x, qs)
			continue
		}
		if s&1 == 1 {
			// The group starts in the low nibble of a byte whose high
			// nibble the previous group wrote.
			codes[s/2] |= byte(code(x[0], qs, -8, 7)) & 0x0f
			s++
			x = x[1:]
		}
		k.quant4(codes[s/2:(e+1)/2], x, qs)
	}
}

func dequantizeAddWith(k *kernels, dst []float32, codes []byte, scales []float32, bits, groupSize int) {
	for gi, scale := range scales {
		s := gi * groupSize
		e := min(s+groupSize, len(dst))
		if bits == 8 {
			k.dequantAdd8(dst[s:e], codes[s:e], scale)
			continue
		}
		if s&1 == 1 {
			dst[s] += float32(float32(lowNibble(codes[s/2])) * scale)
			s++
		}
		k.dequantAdd4(dst[s:e], codes[s/2:(e+1)/2], scale)
	}
}

// code quantizes one value with q_scale qs into [lo, hi]: the product is
// clamped first (NaN goes to lo, as VMAXPS does) and then rounded half to
// even.
func code(x, qs, lo, hi float32) int32 {
	y := x * qs
	if !(y > lo) {
		y = lo
	}
	if !(y < hi) {
		y = hi
	}
	return int32(math.RoundToEven(float64(y)))
}

func abs32(x float32) float32 { return math.Float32frombits(math.Float32bits(x) &^ (1 << 31)) }

func amaxGeneric(x []float32) float32 {
	var m float32
	for _, v := range x {
		if a := abs32(v); a > m {
			m = a
		}
	}
	return m
}

func quant8Generic(dst []byte, src []float32, qs float32) {
	dst = dst[:len(src)]
	for i, v := range src {
		dst[i] = byte(int8(code(v, qs, -128, 127)))
	}
}

// quant4Generic writes ceil(len(src)/2) bytes; an odd count leaves the
// last low nibble 0.
func quant4Generic(dst []byte, src []float32, qs float32) {
	dst = dst[:(len(src)+1)/2]
	for i := 0; i+1 < len(src); i += 2 {
		h := byte(code(src[i], qs, -8, 7))
		l := byte(code(src[i+1], qs, -8, 7))
		dst[i/2] = h<<4 | l&0x0f
	}
	if len(src)&1 == 1 {
		dst[len(src)/2] = byte(code(src[len(src)-1], qs, -8, 7)) << 4
	}
}

// highNibble and lowNibble decode the two's-complement int4 codes of b.
func highNibble(b byte) int8 { return int8(b) >> 4 }
func lowNibble(b byte) int8  { return int8(b<<4) >> 4 }

// The float32 conversions around each product keep the compiler from
// fusing the multiply and the add, so that every path rounds the product
// on its own, as the spec does.

func dequantAdd8Generic(dst []float32, src []byte, scale float32) {
	src = src[:len(dst)]
	for i, c := range src {
		dst[i] += float32(float32(int8(c)) * scale)
	}
}

func dequantAdd4Generic(dst []float32, src []byte, scale float32) {
	src = src[:(len(dst)+1)/2]
	for i := 0; i+1 < len(dst); i += 2 {
		b := src[i/2]
		dst[i] += float32(float32(highNibble(b)) * scale)
		dst[i+1] += float32(float32(lowNibble(b)) * scale)
	}
	if len(dst)&1 == 1 {
		dst[len(dst)-1] += float32(float32(highNibble(src[len(dst)/2])) * scale)
	}
}

// Unpack4 decodes packed int4 codes into one int8 per value: dst[i] is the
// code of value i (high nibble first). len(src) must be CodesLen(len(dst), 4).
// It is the reference decoder of the packed wire format.
func Unpack4(dst []int8, src []byte) error {
	if want := CodesLen(len(dst), 4); len(src) != want {
		return fmt.Errorf("quant: unpack4: %d bytes for %d codes, want %d", len(src), len(dst), want)
	}
	for i := range dst {
		if i&1 == 0 {
			dst[i] = highNibble(src[i/2])
		} else {
			dst[i] = lowNibble(src[i/2])
		}
	}
	return nil
}

// putScales writes scales as little-endian float32 into b (4*len(scales)
// bytes), the wire form of the spec.
func putScales(b []byte, scales []float32) {
	b = b[:4*len(scales)]
	for i, s := range scales {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(s))
	}
}

// getScales reads len(scales) little-endian float32 from b.
func getScales(scales []float32, b []byte) {
	b = b[:4*len(scales)]
	for i := range scales {
		scales[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
}
