package signpack_test

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/internal/conformance"
	"github.com/lowbit-ml/lowbit/signpack"
)

// kernelSets are the paths every case runs against.
var kernelSets = []signpack.Kernels{signpack.Generic, signpack.Fast}

func forEachKernels(t *testing.T, f func(t *testing.T, k signpack.Kernels)) {
	t.Helper()
	for _, k := range kernelSets {
		t.Run(k.Name, func(t *testing.T) { f(t, k) })
	}
}

func TestFastPath(t *testing.T) {
	t.Logf("fast path: %s", signpack.FastPath())
}

// The reference semantics, written independently of both kernels.

func refBit(v float32) bool { return !(v < 0) } // v >= 0 or NaN

func refPack(src []float32) []byte {
	out := make([]byte, signpack.PackedLen(len(src)))
	for i, v := range src {
		if refBit(v) {
			out[i/8] |= 0x80 >> (i % 8)
		}
	}
	return out
}

func refSigned(bit bool, scale float32) float32 {
	if bit {
		return scale
	}
	return math.Float32frombits(math.Float32bits(scale) ^ 0x80000000)
}

func packedBit(p []byte, i int) bool { return p[i/8]&(0x80>>(i%8)) != 0 }

func bitsOf(fs []float32) []uint32 {
	out := make([]uint32, len(fs))
	for i, f := range fs {
		out[i] = math.Float32bits(f)
	}
	return out
}

var (
	nan    = float32(math.NaN())
	negNaN = math.Float32frombits(math.Float32bits(nan) | 0x80000000)
	inf    = float32(math.Inf(1))
	denorm = math.Float32frombits(1)
	negZ   = math.Float32frombits(0x80000000)
)

// specials are the values whose sign is easy to get wrong.
var specials = []float32{
	0, negZ, 1, -1, inf, -inf, nan, negNaN, denorm, -denorm,
	math.Float32frombits(0x007fffff), -math.Float32frombits(0x007fffff),
	math.SmallestNonzeroFloat32, math.MaxFloat32, -math.MaxFloat32,
	math.Float32frombits(0x00800000), -math.Float32frombits(0x00800000),
	math.Float32frombits(0x7f800001), math.Float32frombits(0xff800001), // signaling NaNs
	1e-30, -1e-30, 3.5, -2.25,
}

// randFloats returns n values: mostly ordinary numbers of both signs, some
// specials, some arbitrary bit patterns.
func randFloats(r *rand.Rand, n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		switch r.IntN(8) {
		case 0:
			out[i] = specials[r.IntN(len(specials))]
		case 1:
			out[i] = math.Float32frombits(r.Uint32())
		default:
			out[i] = float32(r.NormFloat64())
		}
	}
	return out
}

func randBytes(r *rand.Rand, n int) []byte {
	out := make([]byte, n)
	for i := range out {
		out[i] = byte(r.Uint32())
	}
	return out
}

// testLengths covers 0..100 and the neighbourhoods of the 8-, 32- and
// 64-element boundaries of the kernels.
func testLengths() []int {
	var ns []int
	for n := 0; n <= 100; n++ {
		ns = append(ns, n)
	}
	ns = append(ns, 127, 128, 129, 191, 192, 193, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 4099)
	return ns
}

const sentinel = 0xa5

func TestConformanceVectors(t *testing.T) {
	paths, err := filepath.Glob(filepath.Join(conformance.Dir(), "signpack_*.json"))
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(paths), 2)
	for _, p := range paths {
		c, err := conformance.LoadFile(p)
		require.NoError(t, err)
		require.Equal(t, "signpack", c.Kind)
		in := conformance.Floats(c.Input)
		want := make([]byte, len(c.Packed))
		for i, b := range c.Packed {
			want[i] = byte(b)
		}
		require.Len(t, want, signpack.PackedLen(len(in)))
		t.Run(c.Name, func(t *testing.T) {
			forEachKernels(t, func(t *testing.T, k signpack.Kernels) {
				// Repeat the vector so the block kernels see it too,
				// once at every offset into a block.
				for rep := 0; rep < 40; rep++ {
					src := make([]float32, 0, rep+len(in)*3)
					for j := 0; j < rep; j++ {
						src = append(src, 1)
					}
					src = append(src, in...)
					src = append(src, in...)
					src = append(src, in...)
					got := make([]byte, signpack.PackedLen(len(src)))
					k.Pack(got, src)
					require.Equal(t, refPack(src), got)
					if rep == 0 {
						got = make([]byte, len(want))
						k.Pack(got, in)
						require.Equal(t, want, got, "packed bytes")
					}
				}

				signs := make([]float32, len(in))
				k.UnpackScale(signs, want, 1)
				for i, v := range in {
					assert.Equal(t, refSigned(refBit(v), 1), signs[i], "sign of %v", v)
				}

				x := append([]float32(nil), in...)
				got := make([]byte, len(want))
				k.PackResidual(got, x, 0.5)
				require.Equal(t, want, got, "packed bytes from PackResidual")
			})
		})
	}
}

func TestSpecialValues(t *testing.T) {
	// Every special at every position of a block, for lengths the block
	// kernels handle.
	src := make([]float32, 0, 3*len(specials)*33)
	for rep := 0; rep < 3*33; rep++ {
		src = append(src, specials[rep%len(specials):]...)
		src = append(src, specials[:rep%len(specials)]...)
	}
	want := refPack(src)
	forEachKernels(t, func(t *testing.T, k signpack.Kernels) {
		got := make([]byte, len(want))
		k.Pack(got, src)
		require.Equal(t, want, got)

		// +0, -0, NaN (both signs) and denormals pack as 1, negatives as 0.
		one := make([]byte, 1)
		k.Pack(one, []float32{0, negZ, nan, negNaN, denorm, -denorm, inf, -inf})
		require.Equal(t, byte(0b11111010), one[0])

		for _, scale := range []float32{1, 0.25, 0, negZ, -3, inf, nan, denorm, 1e30} {
			x := append([]float32(nil), src...)
			k.PackResidual(got, x, scale)
			require.Equal(t, want, got)
			for i := range x {
				var w float32
				if refBit(src[i]) {
					w = src[i] - scale
				} else {
					w = src[i] + scale
				}
				require.Equal(t, math.Float32bits(w), math.Float32bits(x[i]), "residual of %v with scale %v", src[i], scale)
			}

			dst := make([]float32, len(src))
			k.UnpackScale(dst, want, scale)
			acc := append([]float32(nil), src...)
			k.UnpackScaleAdd(acc, want, scale)
			for i := range dst {
				s := refSigned(refBit(src[i]), scale)
				require.Equal(t, math.Float32bits(s), math.Float32bits(dst[i]))
				if w := src[i] + s; w != w {
					// Which NaN operand x86 returns depends on the operand
					// order, which the compiler may pick for src[i]+s;
					// checkSame compares the paths bit for bit.
					require.True(t, acc[i] != acc[i], "%v + %v = %v", src[i], s, acc[i])
				} else {
					require.Equal(t, math.Float32bits(w), math.Float32bits(acc[i]))
				}
			}
		}
	})
}

func TestLengthsAndOffsets(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	forEachKernels(t, func(t *testing.T, k signpack.Kernels) {
		for _, n := range testLengths() {
			for off := 0; off < 9; off++ {
				name := fmt.Sprintf("n=%d off=%d", n, off)
				m := signpack.PackedLen(n)

				// Pack into the middle of a larger buffer: the bytes around
				// it stay untouched and the unused low bits are 0.
				backing := randFloats(r, off+n+3)
				src := backing[off : off+n]
				want := refPack(src)
				buf := make([]byte, off+m+3)
				for i := range buf {
					buf[i] = sentinel
				}
				dst := buf[off : off+m]
				k.Pack(dst, src)
				require.Equal(t, want, dst, name)
				for i, b := range buf {
					if i < off || i >= off+m {
						require.Equal(t, byte(sentinel), b, "%s: byte %d outside dst", name, i)
					}
				}
				if n%8 != 0 {
					require.Zero(t, dst[m-1]&(0xff>>(n%8)), "%s: unused bits", name)
				}

				// PackResidual packs the same bytes and leaves x outside
				// the slice alone.
				for i := range buf {
					buf[i] = sentinel
				}
				xb := append([]float32(nil), backing...)
				k.PackResidual(dst, xb[off:off+n], 0.75)
				require.Equal(t, want, dst, name)
				require.Equal(t, bitsOf(backing[:off]), bitsOf(xb[:off]), name)
				require.Equal(t, bitsOf(backing[off+n:]), bitsOf(xb[off+n:]), name)

				// Unpack from packed bytes whose unused bits are garbage.
				pbuf := randBytes(r, off+m+1)
				p := pbuf[off : off+m]
				fb := randFloats(r, off+n+3)
				orig := append([]float32(nil), fb...)
				out := fb[off : off+n]
				k.UnpackScale(out, p, 1.5)
				for i := range out {
					require.Equal(t, refSigned(packedBit(p, i), 1.5), out[i], "%s: element %d", name, i)
				}
				require.Equal(t, bitsOf(orig[:off]), bitsOf(fb[:off]), name)
				require.Equal(t, bitsOf(orig[off+n:]), bitsOf(fb[off+n:]), name)

				copy(fb, orig)
				k.UnpackScaleStream(out, p, 1.5)
				for i := range out {
					require.Equal(t, refSigned(packedBit(p, i), 1.5), out[i], "%s: stream element %d", name, i)
				}
				require.Equal(t, bitsOf(orig[:off]), bitsOf(fb[:off]), name)
				require.Equal(t, bitsOf(orig[off+n:]), bitsOf(fb[off+n:]), name)

				copy(fb, orig)
				k.UnpackScaleAdd(out, p, 1.5)
				for i := range out {
					w := orig[off+i] + refSigned(packedBit(p, i), 1.5)
					require.Equal(t, math.Float32bits(w), math.Float32bits(out[i]), "%s: element %d", name, i)
				}
				require.Equal(t, bitsOf(orig[:off]), bitsOf(fb[:off]), name)
				require.Equal(t, bitsOf(orig[off+n:]), bitsOf(fb[off+n:]), name)
			}
		}
	})
}

func TestRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	forEachKernels(t, func(t *testing.T, k signpack.Kernels) {
		for _, n := range testLengths() {
			x := randFloats(r, n)
			p := make([]byte, signpack.PackedLen(n))
			k.Pack(p, x)
			signs := make([]float32, n)
			k.UnpackScale(signs, p, 1)
			for i, v := range x {
				want := float32(-1)
				if v >= 0 || v != v {
					want = 1
				}
				require.Equal(t, want, signs[i], "n=%d element %d (%v)", n, i, v)
			}
			// Packing the unpacked signs gives the same bytes back.
			p2 := make([]byte, len(p))
			k.Pack(p2, signs)
			require.Equal(t, p, p2)
		}
	})
}

func TestResidualProperty(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	forEachKernels(t, func(t *testing.T, k signpack.Kernels) {
		for _, n := range testLengths() {
			before := make([]float32, n)
			for i := range before {
				before[i] = float32(r.NormFloat64())
			}
			scale := float32(r.Float64())
			x := append([]float32(nil), before...)
			p := make([]byte, signpack.PackedLen(n))
			k.PackResidual(p, x, scale)
			require.Equal(t, refPack(before), p)
			for i := range x {
				sgn := float32(1)
				if before[i] < 0 {
					sgn = -1
				}
				require.Equal(t, before[i]-scale*sgn, x[i], "n=%d element %d", n, i)
				// Where the float32 subtraction is exact, adding the
				// compressed value back recovers the input.
				if float64(before[i])-float64(scale*sgn) == float64(x[i]) {
					require.Equal(t, before[i], x[i]+scale*sgn)
				}
			}
		}
	})
}

// TestFastMatchesGeneric compares both paths bit for bit on arbitrary bit
// patterns, including NaN accumulators and NaN scales.
func TestFastMatchesGeneric(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	scales := []float32{1, -2, 0, negZ, nan, negNaN, inf, denorm, math.Float32frombits(0x7f800001)}
	for _, n := range testLengths() {
		for _, scale := range scales {
			checkSame(t, randFloats(r, n), randBytes(r, signpack.PackedLen(n)), scale)
		}
	}
}

// checkSame runs all four kernels of both paths on the same input and
// requires bit-identical results.
func checkSame(t *testing.T, x []float32, p []byte, scale float32) {
	t.Helper()
	n := len(x)
	var gotP [2][]byte
	var gotX, gotU, gotA [2][]uint32
	for i, k := range kernelSets {
		gotP[i] = make([]byte, signpack.PackedLen(n))
		k.Pack(gotP[i], x)
		rp := make([]byte, len(gotP[i]))
		xr := append([]float32(nil), x...)
		k.PackResidual(rp, xr, scale)
		require.Equal(t, gotP[i], rp, "PackResidual bytes %s", k.Name)
		gotX[i] = bitsOf(xr)

		u := make([]float32, n)
		k.UnpackScale(u, p, scale)
		gotU[i] = bitsOf(u)
		clear(u)
		k.UnpackScaleStream(u, p, scale)
		require.Equal(t, gotU[i], bitsOf(u), "UnpackScaleStream %s n=%d scale=%v", k.Name, n, scale)
		acc := append([]float32(nil), x...)
		k.UnpackScaleAdd(acc, p, scale)
		gotA[i] = bitsOf(acc)
	}
	require.Equal(t, gotP[0], gotP[1], "Pack n=%d", n)
	require.Equal(t, gotX[0], gotX[1], "PackResidual n=%d scale=%v", n, scale)
	require.Equal(t, gotU[0], gotU[1], "UnpackScale n=%d scale=%v", n, scale)
	require.Equal(t, gotA[0], gotA[1], "UnpackScaleAdd n=%d scale=%v", n, scale)
}

// TestUnpackScaleStreamAligned runs UnpackScaleStream where its
// non-temporal path applies (32-byte aligned blocks of a large slice, as
// the 1-bit allreduce's output is) and where it does not (every other
// offset), against the reference, with the floats around dst untouched.
func TestUnpackScaleStreamAligned(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	const big = 1 << 16
	backing := make([]float32, big+64) // a large allocation: page-aligned
	base := int(uintptr(unsafe.Pointer(&backing[0])) % 32 / 4)
	require.Zero(t, base, "a large slice starts 32-byte aligned")
	for _, n := range []int{32, 33, 63, 64, 1000, 4096 + 7, big} {
		p := randBytes(r, signpack.PackedLen(n))
		for off := range 16 {
			for i := range backing {
				backing[i] = sentinelFloat
			}
			dst := backing[off : off+n]
			aligned := off%8 == 0 && signpack.FastPath() != "generic"
			assert.Equal(t, aligned, signpack.Streams(dst), "n=%d off=%d: non-temporal stores", n, off)
			signpack.UnpackScaleStream(dst, p, -0.25)
			// testify only on a difference: a million calls of it cost
			// tens of seconds under the race detector.
			for i, v := range dst {
				if want := refSigned(packedBit(p, i), -0.25); v != want {
					require.Equal(t, want, v, "n=%d off=%d: element %d", n, off, i)
				}
			}
			for i, v := range backing {
				if (i < off || i >= off+n) && math.Float32bits(v) != math.Float32bits(sentinelFloat) {
					require.Equal(t, math.Float32bits(sentinelFloat), math.Float32bits(v), "n=%d off=%d: float %d outside dst", n, off, i)
				}
			}
		}
	}
}

func TestShortBufferPanics(t *testing.T) {
	assert.Panics(t, func() { signpack.Pack(make([]byte, 1), make([]float32, 9)) })
	assert.Panics(t, func() { signpack.PackResidual(make([]byte, 3), make([]float32, 33), 1) })
	assert.Panics(t, func() { signpack.Unpack(make([]float32, 17), make([]byte, 2)) })
	assert.Panics(t, func() { signpack.UnpackScale(make([]float32, 65), make([]byte, 8), 1) })
	assert.Panics(t, func() { signpack.UnpackScaleAdd(make([]float32, 8), nil, 1) })
	assert.Panics(t, func() { signpack.UnpackScaleStream(make([]float32, 64), make([]byte, 7), 1) })
	// Exactly PackedLen, and longer, are fine.
	assert.NotPanics(t, func() { signpack.Pack(make([]byte, 2), make([]float32, 9)) })
	assert.NotPanics(t, func() { signpack.Unpack(make([]float32, 9), make([]byte, 5)) })
}

func TestNoAllocs(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	x := randFloats(r, 1000)
	p := make([]byte, signpack.PackedLen(len(x)))
	out := make([]float32, len(x))
	for name, f := range map[string]func(){
		"Pack":              func() { signpack.Pack(p, x) },
		"PackResidual":      func() { signpack.PackResidual(p, x, 0.5) },
		"Unpack":            func() { signpack.Unpack(out, p) },
		"UnpackScale":       func() { signpack.UnpackScale(out, p, 2) },
		"UnpackScaleAdd":    func() { signpack.UnpackScaleAdd(out, p, 2) },
		"UnpackScaleStream": func() { signpack.UnpackScaleStream(out, p, 2) },
	} {
		assert.Zero(t, testing.AllocsPerRun(100, f), name)
	}
}

// floatsFromBytes interprets b as little-endian float32s.
func floatsFromBytes(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	for i := range out {
		out[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
	}
	return out
}

func FuzzPack(f *testing.F) {
	f.Add([]byte{}, byte(0), float32(1))
	f.Add(make([]byte, 4*37), byte(3), float32(0.5))
	seed := make([]byte, 0, 4*len(specials)*3)
	for range 3 {
		for _, v := range specials {
			seed = binary.LittleEndian.AppendUint32(seed, math.Float32bits(v))
		}
	}
	f.Add(seed, byte(1), float32(-2))
	f.Add(seed, byte(0), float32(math.NaN()))
	f.Fuzz(func(t *testing.T, data []byte, off byte, scale float32) {
		// off shifts the slice inside its backing array, so the fast path
		// also sees unaligned starts.
		xs := floatsFromBytes(data)
		o := int(off % 8)
		backing := make([]float32, o+len(xs))
		copy(backing[o:], xs)
		x := backing[o:]
		checkSame(t, x, refPack(x), scale)
		p := make([]byte, signpack.PackedLen(len(x)))
		signpack.Pack(p, x)
		require.Equal(t, refPack(x), p)
	})
}

func FuzzUnpack(f *testing.F) {
	f.Add([]byte{}, uint16(0), float32(1))
	f.Add([]byte{0xeb, 0x50}, uint16(12), float32(2))
	f.Add([]byte{0, 0, 0x3f, 0xff, 0xf8, 0x12, 0x34, 0x56, 0x78, 0x9a}, uint16(77), float32(-0.5))
	f.Fuzz(func(t *testing.T, packed []byte, n uint16, scale float32) {
		// n elements, at most as many as packed holds; the accumulator
		// is the packed bytes read as float32s, repeated.
		cnt := min(int(n), 8*len(packed))
		acc := make([]float32, cnt)
		if fs := floatsFromBytes(packed); len(fs) > 0 {
			for i := range acc {
				acc[i] = fs[i%len(fs)]
			}
		}
		checkSame(t, acc, packed[:signpack.PackedLen(cnt)], scale)
		out := make([]float32, cnt)
		signpack.UnpackScale(out, packed, scale)
		for i := range out {
			require.Equal(t, math.Float32bits(refSigned(packedBit(packed, i), scale)), math.Float32bits(out[i]))
		}
	})
}

// sentinelFloat marks the floats a kernel must not touch.
var sentinelFloat = math.Float32frombits(0x7fc0dead)
