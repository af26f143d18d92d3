package signpack

import "math"

// The portable kernels. They are the reference the fast path is tested
// against, and the only path on architectures without one.

const signBit = 0x80000000

// bitOf is 1 when v counts as +1: v >= 0 or NaN.
func bitOf(v float32) byte {
	if v < 0 {
		return 0
	}
	return 1
}

func packGeneric(dst []byte, src []float32) {
	n := len(src)
	full := n / 8
	for i := 0; i < full; i++ {
		s := src[i*8 : i*8+8 : i*8+8]
		dst[i] = bitOf(s[0])<<7 | bitOf(s[1])<<6 | bitOf(s[2])<<5 | bitOf(s[3])<<4 |
			bitOf(s[4])<<3 | bitOf(s[5])<<2 | bitOf(s[6])<<1 | bitOf(s[7])
	}
	if rem := n - full*8; rem > 0 {
		var b byte
		for j := 0; j < rem; j++ {
			b |= bitOf(src[full*8+j]) << (7 - j)
		}
		dst[full] = b
	}
}

func packResidualGeneric(dst []byte, x []float32, scale float32) {
	n := len(x)
	for i := 0; i < n; i += 8 {
		var b byte
		end := min(i+8, n)
		for j := i; j < end; j++ {
			if x[j] < 0 {
				x[j] += scale
			} else {
				b |= 1 << (7 - (j - i))
				x[j] -= scale
			}
		}
		dst[i/8] = b
	}
}

func unpackScaleGeneric(dst []float32, src []byte, scale float32) {
	pos := scale
	neg := math.Float32frombits(math.Float32bits(scale) ^ signBit)
	for i := range dst {
		if src[i>>3]&(0x80>>(i&7)) != 0 {
			dst[i] = pos
		} else {
			dst[i] = neg
		}
	}
}

func unpackScaleAddGeneric(acc []float32, src []byte, scale float32) {
	pos := scale
	neg := math.Float32frombits(math.Float32bits(scale) ^ signBit)
	for i := range acc {
		if src[i>>3]&(0x80>>(i&7)) != 0 {
			acc[i] += pos
		} else {
			acc[i] += neg
		}
	}
}

// readGeneric ORs together the bits of every element of p: the portable
// streaming read that the benchmarks compare the kernels against.
func readGeneric(p []float32) uint32 {
	var r0, r1, r2, r3 uint32
	for len(p) >= 4 {
		r0 |= math.Float32bits(p[0])
		r1 |= math.Float32bits(p[1])
		r2 |= math.Float32bits(p[2])
		r3 |= math.Float32bits(p[3])
		p = p[4:]
	}
	for _, v := range p {
		r0 |= math.Float32bits(v)
	}
	return r0 | r1 | r2 | r3
}
