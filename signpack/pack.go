// Package signpack packs the signs of float32 values into bits and back, in
// the wire format of the 1-bit compressed allreduce:
//
//   - one bit per element, 8 elements per byte, the first element in the
//     most significant bit;
//   - bit 1 means +1 and bit 0 means -1, where a value counts as +1 when it
//     is >= 0 or NaN (so +0.0 and -0.0 both pack as 1) and as -1 otherwise;
//   - n elements pack into PackedLen(n) = ceil(n/8) bytes and the unused low
//     bits of the last byte are 0.
//
// The kernels have an AVX2 fast path on amd64 and a portable path everywhere
// else (and under the purego build tag); both give identical bytes and
// identical floats. None of them allocates.
package signpack

// PackedLen is the number of bytes that n packed signs occupy.
func PackedLen(n int) int { return (n + 7) / 8 }

// Pack writes the signs of src into dst. dst must hold at least
// PackedLen(len(src)) bytes; Pack panics otherwise, like copy into a short
// slice would lose data silently.
func Pack(dst []byte, src []float32) {
	checkPacked("Pack", len(dst), len(src))
	pack(dst, src)
}

// PackResidual packs the signs of x into dst like Pack and, in the same pass,
// replaces every x[i] with x[i] - scale*sgn(x[i]): the residual that error
// feedback keeps.
func PackResidual(dst []byte, x []float32, scale float32) {
	checkPacked("PackResidual", len(dst), len(x))
	packResidual(dst, x, scale)
}

// Unpack writes +1 or -1 into every element of dst from the packed bits in
// src, which must hold at least PackedLen(len(dst)) bytes.
func Unpack(dst []float32, src []byte) {
	checkPacked("Unpack", len(src), len(dst))
	unpackScale(dst, src, 1)
}

// UnpackScale writes scale*(+1 or -1) into every element of dst.
func UnpackScale(dst []float32, src []byte, scale float32) {
	checkPacked("UnpackScale", len(src), len(dst))
	unpackScale(dst, src, scale)
}

// UnpackScaleStream is UnpackScale for an output larger than the cache
// that is not read again soon (the 1-bit allreduce's output of a large
// tensor): on amd64 with AVX2, and where dst[0] is 32-byte aligned (as in
// a large slice made by make, and in its blocks at multiples of 8
// elements), it writes dst with non-temporal stores, which skip the read
// for ownership of every line an ordinary store makes first; a write-only
// pass then moves half the bytes, but leaves none of dst in the cache.
// Elsewhere it is UnpackScale. The values are UnpackScale's, bit for bit.
func UnpackScaleStream(dst []float32, src []byte, scale float32) {
	checkPacked("UnpackScaleStream", len(src), len(dst))
	unpackScaleStream(dst, src, scale)
}

// UnpackScaleAdd adds scale*(+1 or -1) into every element of acc: the fused
// "unpack, multiply by a scale, add into an accumulator" of the server side.
// The product is exact (a sign flip of scale), so the result equals
// acc[i] + (±scale) rounded once.
func UnpackScaleAdd(acc []float32, src []byte, scale float32) {
	checkPacked("UnpackScaleAdd", len(src), len(acc))
	unpackScaleAdd(acc, src, scale)
}

func checkPacked(fn string, nbytes, nelems int) {
	if nbytes < PackedLen(nelems) {
		panic("signpack: " + fn + ": packed buffer too short")
	}
}
