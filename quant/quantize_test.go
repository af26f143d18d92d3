package quant

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// paths are the implementations every kernel test runs on.
var paths = []struct {
	name string
	k    *kernels
}{{"generic", &generic}, {"fast", &fast}}

// quantizeRef is a direct transcription of the spec, one value at a time.
func quantizeRef(src []float32, bits, g int) (codes []int8, scales []float32) {
	lo, hi := float32(-(int32(1) << (bits - 1))), float32(int32(1)<<(bits-1)-1)
	codes = make([]int8, len(src))
	for s := 0; s < len(src); s += g {
		e := min(s+g, len(src))
		var amax float32
		for _, v := range src[s:e] {
			amax = max(amax, float32(math.Abs(float64(v))))
		}
		qs := float32(1)
		if amax != 0 {
			qs = float32(math.Pow(2, float64(bits))) / (2 * amax)
		}
		scales = append(scales, 1/qs)
		for i := s; i < e; i++ {
			y := float64(src[i] * qs)
			codes[i] = int8(math.Max(float64(lo), math.Min(float64(hi), math.RoundToEven(y))))
		}
	}
	return codes, scales
}

func randValues(r *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		switch r.IntN(10) {
		case 0:
			x[i] = 0
		case 1:
			x[i] = float32(r.IntN(33)-16) / 2 // ties after scaling
		default:
			x[i] = float32(r.NormFloat64()) * float32(math.Pow(10, float64(r.IntN(7)-3)))
		}
	}
	return x
}

func TestQuantizeMatchesSpec(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	lengths := []int{0, 1, 2, 3, 31, 32, 33, 63, 64, 65, 95, 127, 128, 200, 1000, 4099}
	groups := []int{1, 2, 3, 7, 31, 32, 33, 64, 100, 2048}
	for _, p := range paths {
		for _, bits := range []int{4, 8} {
			for _, n := range lengths {
				for _, g := range groups {
					src := randValues(r, n)
					wantCodes, wantScales := quantizeRef(src, bits, g)
					codes := make([]byte, CodesLen(n, bits))
					for i := range codes {
						codes[i] = 0xa5 // garbage that must be overwritten
					}
					scales := make([]float32, NumGroups(n, g))
					quantizeWith(p.k, codes, scales, src, bits, g)
					require.Equal(t, wantScales, nilIfEmpty(scales), "%s bits %d n %d g %d", p.name, bits, n, g)
					got := make([]int8, n)
					if bits == 8 {
						for i, b := range codes {
							got[i] = int8(b)
						}
					} else {
						require.NoError(t, Unpack4(got, codes))
						if n%2 == 1 {
							require.Zero(t, codes[len(codes)-1]&0x0f, "odd count leaves the last low nibble 0")
						}
					}
					require.Equal(t, wantCodes, got, "%s bits %d n %d g %d", p.name, bits, n, g)

					// Dequantize-accumulate on top of a non-zero buffer.
					dst := make([]float32, n)
					want := make([]float32, n)
					for i := range dst {
						dst[i] = float32(i) * 0.25
						want[i] = dst[i] + float32(float32(wantCodes[i])*wantScales[i/g])
					}
					dequantizeAddWith(p.k, dst, codes, scales, bits, g)
					require.Equal(t, want, nilIfEmptyF(dst, want), "%s bits %d n %d g %d", p.name, bits, n, g)
				}
			}
		}
	}
}

func nilIfEmpty(s []float32) []float32 {
	if len(s) == 0 {
		return nil
	}
	return s
}

func nilIfEmptyF(s, like []float32) []float32 {
	if len(s) == 0 {
		return like
	}
	return s
}

func TestQuantizeTiesAndClamp(t *testing.T) {
	for _, p := range paths {
		// int8: amax 128 gives q_scale 1: the products are the values.
		src := []float32{2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 127.5, -128, 128, 1.5}
		codes := make([]byte, len(src))
		scales := make([]float32, 1)
		quantizeWith(p.k, codes, scales, src, 8, 64)
		assert.Equal(t, []float32{1}, scales, p.name)
		want := []int8{2, 4, -2, -4, 0, 0, 127, -128, 127, 2}
		for i, b := range codes {
			assert.Equal(t, want[i], int8(b), "%s: int8 code of %g", p.name, src[i])
		}
		// int4: amax 8 gives q_scale 1.
		src = []float32{0.5, 1.5, -0.5, -1.5, 6.5, 7.5, -8, 8, 2.5}
		codes = make([]byte, CodesLen(len(src), 4))
		quantizeWith(p.k, codes, scales, src, 4, 64)
		assert.Equal(t, []float32{1}, scales, p.name)
		got := make([]int8, len(src))
		require.NoError(t, Unpack4(got, codes))
		assert.Equal(t, []int8{0, 2, 0, -2, 6, 7, -8, 7, 2}, got, p.name)
		assert.Equal(t, byte(0x02), codes[0], "first element in the high nibble")
		assert.Equal(t, byte(0x20), codes[4], "odd count: last low nibble 0")
		// A zero group has scale 1 and zero codes.
		zeros := make([]float32, 40)
		codes = make([]byte, 40)
		quantizeWith(p.k, codes, scales, zeros, 8, 64)
		assert.Equal(t, []float32{1}, scales)
		assert.Equal(t, make([]byte, 40), codes)
	}
}

// TestVectorsBothPaths checks the spec's quant vectors on both paths.
func TestVectorsBothPaths(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "quant_*.json"))
	require.NoError(t, err)
	require.NotEmpty(t, files)
	for _, f := range files {
		b, err := os.ReadFile(f)
		require.NoError(t, err)
		var v struct {
			Bits        int       `json:"bits"`
			GroupSize   int       `json:"group_size"`
			Input       []float64 `json:"input"`
			Scales      []float64 `json:"scales"`
			Dequantized []float64 `json:"dequantized"`
			Packed      []byte    `json:"packed"`
		}
		require.NoError(t, json.Unmarshal(b, &v))
		src := make([]float32, len(v.Input))
		for i, x := range v.Input {
			src[i] = float32(x)
		}
		for _, p := range paths {
			codes := make([]byte, CodesLen(len(src), v.Bits))
			scales := make([]float32, NumGroups(len(src), v.GroupSize))
			quantizeWith(p.k, codes, scales, src, v.Bits, v.GroupSize)
			require.Equal(t, v.Packed, codes, "%s %s", f, p.name)
			for i, s := range v.Scales {
				require.Equal(t, float32(s), scales[i], "%s %s scale %d", f, p.name, i)
			}
			dst := make([]float32, len(src))
			dequantizeAddWith(p.k, dst, codes, scales, v.Bits, v.GroupSize)
			for i, d := range v.Dequantized {
				require.InDelta(t, d, float64(dst[i]), 1e-5*math.Max(1, math.Abs(d)), "%s %s element %d", f, p.name, i)
			}
		}
	}
}

func TestQuantizeErrors(t *testing.T) {
	src := make([]float32, 10)
	codes := make([]byte, 10)
	scales := make([]float32, 1)
	require.ErrorContains(t, Quantize(codes, scales, src, 5, 16), "want 4 or 8")
	require.ErrorContains(t, Quantize(codes, scales, src, 8, 0), "group size")
	require.ErrorContains(t, Quantize(codes, scales, src, 8, -3), "group size")
	require.ErrorContains(t, Quantize(codes[:9], scales, src, 8, 16), "code bytes")
	require.ErrorContains(t, Quantize(codes, scales, src, 4, 16), "code bytes")
	require.ErrorContains(t, Quantize(codes, scales, src, 8, 5), "scales")
	require.ErrorContains(t, DequantizeAdd(src, codes, scales, 2, 16), "want 4 or 8")
	require.ErrorContains(t, DequantizeAdd(src, codes[:5], scales, 8, 16), "code bytes")
	require.ErrorContains(t, Unpack4(make([]int8, 3), codes), "bytes")
	require.NoError(t, Quantize(codes, scales, src, 8, 16))
	require.NoError(t, Quantize(codes[:5], scales, src, 4, 16))
	require.Zero(t, CodesLen(10, 3))
	require.Zero(t, NumGroups(10, 0))
}

func TestQuantizeNoAllocs(t *testing.T) {
	src := randValues(rand.New(rand.NewPCG(3, 4)), 10000)
	for _, bits := range []int{4, 8} {
		codes := make([]byte, CodesLen(len(src), bits))
		scales := make([]float32, NumGroups(len(src), 512))
		dst := make([]float32, len(src))
		allocs := testing.AllocsPerRun(10, func() {
			_ = Quantize(codes, scales, src, bits, 512)
			_ = DequantizeAdd(dst, codes, scales, bits, 512)
		})
		require.Zero(t, allocs)
	}
}

// fuzzValues turns fuzz bytes into float32 values: raw bit patterns
// (NaN, Inf and subnormals included) when raw is set, else small
// multiples of 1/4 that land on rounding ties.
func fuzzValues(data []byte, raw bool) []float32 {
	if raw {
		x := make([]float32, len(data)/4)
		for i := range x {
			x[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
		}
		return x
	}
	x := make([]float32, len(data))
	for i, b := range data {
		x[i] = float32(int8(b)) / 4
	}
	return x
}

// FuzzQuantize compares the fast and the portable kernels on arbitrary
// input: codes, scales and the dequantized sums must be identical bit for
// bit.
func FuzzQuantize(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8}, uint8(8), uint16(3), false)
	f.Add(make([]byte, 300), uint8(4), uint16(32), true)
	f.Add([]byte{0x00, 0x00, 0xc0, 0x7f, 0, 0, 0x80, 0x7f, 1, 0, 0, 0}, uint8(4), uint16(1), true)
	f.Fuzz(func(t *testing.T, data []byte, bitsSel uint8, g uint16, raw bool) {
		bits := 4 + 4*int(bitsSel&1)
		gs := int(g%300) + 1
		src := fuzzValues(data, raw)
		n := len(src)
		cg, cf := make([]byte, CodesLen(n, bits)), make([]byte, CodesLen(n, bits))
		sg, sf := make([]float32, NumGroups(n, gs)), make([]float32, NumGroups(n, gs))
		quantizeWith(&generic, cg, sg, src, bits, gs)
		quantizeWith(&fast, cf, sf, src, bits, gs)
		require.Equal(t, cg, cf, "codes")
		for i := range sg {
			require.Equal(t, math.Float32bits(sg[i]), math.Float32bits(sf[i]), "scale %d", i)
		}
		dg, df := make([]float32, n), make([]float32, n)
		for i := range dg {
			dg[i] = float32(i%7) - 3
			df[i] = dg[i]
		}
		dequantizeAddWith(&generic, dg, cg, sg, bits, gs)
		dequantizeAddWith(&fast, df, cg, sg, bits, gs)
		for i := range dg {
			require.Equal(t, math.Float32bits(dg[i]), math.Float32bits(df[i]), "dequantized %d", i)
		}
	})
}

// FuzzUnpack4 decodes arbitrary packed int4 bytes with the reference
// decoder and both dequantize paths (scale 1), and packs the codes back.
func FuzzUnpack4(f *testing.F) {
	f.Add([]byte{0x00, 0x7f, 0x80, 0xff, 0x12}, uint16(9), uint16(4))
	f.Add(make([]byte, 100), uint16(199), uint16(33))
	f.Fuzz(func(t *testing.T, packed []byte, count, g uint16) {
		n := min(int(count), 2*len(packed))
		packed = packed[:CodesLen(n, 4)]
		gs := int(g%200) + 1
		codes := make([]int8, n)
		require.NoError(t, Unpack4(codes, packed))
		scales := make([]float32, NumGroups(n, gs))
		for i := range scales {
			scales[i] = 1
		}
		for _, p := range paths {
			dst := make([]float32, n)
			dequantizeAddWith(p.k, dst, packed, scales, 4, gs)
			for i, c := range codes {
				require.GreaterOrEqual(t, c, int8(-8))
				require.LessOrEqual(t, c, int8(7))
				require.Equal(t, float32(c), dst[i], "%s element %d", p.name, i)
			}
		}
		// Packing the decoded codes again gives the bytes back (bar a
		// trailing low nibble beyond n).
		repacked := make([]byte, len(packed))
		for i, c := range codes {
			if i%2 == 0 {
				repacked[i/2] = byte(c) << 4
			} else {
				repacked[i/2] |= byte(c) & 0x0f
			}
		}
		for i := range packed {
			want := packed[i]
			if 2*i+1 >= n {
				want &= 0xf0
			}
			require.Equal(t, want, repacked[i])
		}
	})
}
