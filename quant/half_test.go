package quant

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// halfKernels is one implementation of the conversions of one format.
type halfKernels struct {
	name      string
	narrow    func(dst []uint16, src []float32) int
	widen     func(dst []float32, src []uint16)
	widenAdd  func(acc []float32, src []uint16)
	scalarNar func(float32) uint16
}

// kernelsOf returns the portable kernels and the dispatched ones (the
// assembly where the CPU has it) of f: every case runs on both.
func kernelsOf(f Format) []halfKernels {
	if f == FP16 {
		return []halfKernels{
			{"generic", narrowFP16Generic, widenFP16Generic, widenAddFP16Generic, f32ToF16},
			{halfPath(FP16), narrowFP16, widenFP16, widenAddFP16, f32ToF16},
		}
	}
	return []halfKernels{
		{"generic", narrowBF16Generic, widenBF16Generic, widenAddBF16Generic, f32ToBF16},
		{halfPath(BF16), narrowBF16, widenBF16, widenAddBF16, f32ToBF16},
	}
}

func TestFormat(t *testing.T) {
	assert.Equal(t, "fp16", FP16.String())
	assert.Equal(t, "bf16", BF16.String())
	assert.Equal(t, "Format(7)", Format(7).String())
	assert.True(t, FP16.Valid())
	assert.True(t, BF16.Valid())
	assert.False(t, Format(0).Valid())
	assert.Panics(t, func() { Narrow(Format(0), nil, nil) })
	assert.Panics(t, func() { Widen(Format(3), nil, nil) })
	t.Logf("kernels: fp16 %s, bf16 %s", halfPath(FP16), halfPath(BF16))
}

func f32(b uint32) float32 { return math.Float32frombits(b) }

// padded repeats a case so that it lands in a whole assembly block and
// in the tail, at every position.
func padded(x float32) []float32 {
	s := make([]float32, 2*32+7)
	for i := range s {
		s[i] = x
	}
	return s
}

func TestNarrowCases(t *testing.T) {
	type tc struct {
		in       float32
		fp16     uint16
		bf16     uint16
		ovf, ovb int // overflow per element
	}
	cases := []tc{
		{0, 0, 0, 0, 0},
		{float32(math.Copysign(0, -1)), 0x8000, 0x8000, 0, 0},
		{1, 0x3c00, 0x3f80, 0, 0},
		{-2, 0xc000, 0xc000, 0, 0},
		{0.1, 0x2e66, 0x3dcd, 0, 0},
		{65504, 0x7bff, 0x4780, 0, 0},
		{65519.99, 0x7bff, 0x4780, 0, 0},
		{65520, 0x7c00, 0x4780, 1, 0},  // the tie goes to the even Inf
		{-65520, 0xfc00, 0xc780, 1, 0}, // overflow counts both signs
		{1e10, 0x7c00, 0x5015, 1, 0},   // far beyond fp16
		{math.MaxFloat32, 0x7c00, 0x7f80, 1, 1},
		{f32(0x7f7f7fff), 0x7c00, 0x7f7f, 1, 0}, // just below bf16's threshold
		{f32(0x7f7f8000), 0x7c00, 0x7f80, 1, 1}, // the bf16 tie goes to Inf
		{float32(math.Inf(1)), 0x7c00, 0x7f80, 0, 0},
		{float32(math.Inf(-1)), 0xfc00, 0xff80, 0, 0},
		{f32(0x7fc00000), 0x7e00, 0x7fc0, 0, 0}, // quiet NaN
		{f32(0xffc00000), 0xfe00, 0xffc0, 0, 0}, // negative NaN
		{f32(0x7f800001), 0x7e00, 0x7fc0, 0, 0}, // signalling NaN comes out quiet
		{f32(0x7fa00000), 0x7f00, 0x7fe0, 0, 0}, // leading payload kept
		{f32(0x7f810000), 0x7e08, 0x7fc1, 0, 0},
		{1 + 1.0/2048, 0x3c00, 0x3f80, 0, 0},    // fp16 tie, to even (down)
		{1 + 3.0/2048, 0x3c02, 0x3f80, 0, 0},    // fp16 tie, to even (up)
		{1 + 1.0/256, 0x3c04, 0x3f80, 0, 0},     // bf16 tie to even (down)
		{1 + 3.0/256, 0x3c0c, 0x3f82, 0, 0},     // bf16 tie to even (up)
		{0x1p-14, 0x0400, 0x3880, 0, 0},         // smallest fp16 normal
		{0x1p-24, 0x0001, 0x3380, 0, 0},         // smallest fp16 subnormal
		{0x1p-25, 0x0000, 0x3300, 0, 0},         // tie to even: zero
		{0x1.8p-25, 0x0001, 0x3340, 0, 0},       // above the tie
		{-0x1.8p-24, 0x8002, 0xb3c0, 0, 0},      // 1.5 steps: tie to even 2
		{0x1.ffcp-15, 0x0400, 0x3880, 0, 0},     // largest subnormal rounds up into the normals
		{0x1.ff8p-15, 0x03ff, 0x3880, 0, 0},     // largest subnormal
		{f32(0x00000001), 0x0000, 0x0000, 0, 0}, // float32 subnormal
		{f32(0x80400000), 0x8000, 0x8040, 0, 0}, // float32 subnormal, kept by bf16
		{f32(0x007fffff), 0x0000, 0x0080, 0, 0}, // rounds up to float32's smallest normal
	}
	for _, f := range []Format{FP16, BF16} {
		for _, k := range kernelsOf(f) {
			for _, c := range cases {
				want, wantOv := c.fp16, c.ovf
				if f == BF16 {
					want, wantOv = c.bf16, c.ovb
				}
				src := padded(c.in)
				dst := make([]uint16, len(src))
				ov := k.narrow(dst, src)
				for i := range dst {
					require.Equal(t, want, dst[i], "%s %s: narrow %g (%#08x) at %d: got %#04x want %#04x",
						f, k.name, c.in, math.Float32bits(c.in), i, dst[i], want)
				}
				assert.Equal(t, wantOv*len(src), ov, "%s %s: overflow count of %g", f, k.name, c.in)
				assert.Equal(t, want, k.scalarNar(c.in))
				// Round trip: Inf and NaN stay what they are.
				back := make([]float32, len(dst))
				k.widen(back, dst)
				for i := range back {
					switch {
					case math.IsNaN(float64(c.in)):
						require.True(t, math.IsNaN(float64(back[i])), "%s %s: NaN lost", f, k.name)
					case math.IsInf(float64(c.in), 0):
						require.Equal(t, c.in, back[i])
					}
				}
			}
		}
	}
}

// TestWidenAll widens every 16-bit pattern on both paths, checks them
// against each other and that narrowing gives the pattern back (NaNs come
// back quiet).
func TestWidenAll(t *testing.T) {
	src := make([]uint16, 1<<16)
	for i := range src {
		src[i] = uint16(i)
	}
	for _, f := range []Format{FP16, BF16} {
		ks := kernelsOf(f)
		var ref []float32
		for _, k := range ks {
			got := make([]float32, len(src))
			k.widen(got, src)
			if ref == nil {
				ref = got
			}
			back := make([]uint16, len(src))
			assert.Zero(t, k.narrow(back, got))
			for i, h := range src {
				require.Equal(t, math.Float32bits(ref[i]), math.Float32bits(got[i]), "%s %s: widen %#04x", f, k.name, h)
				wantBack := h
				if isNaN16(f, h) {
					wantBack |= quietBit(f)
				}
				require.Equal(t, wantBack, back[i], "%s %s: narrow(widen(%#04x))", f, k.name, h)
			}
			acc := make([]float32, len(src))
			for i := range acc {
				acc[i] = 1
			}
			k.widenAdd(acc, src)
			for i := range acc {
				want := 1 + ref[i]
				require.Equal(t, math.Float32bits(want), math.Float32bits(acc[i]), "%s %s: widenAdd %#04x", f, k.name, src[i])
			}
		}
		// Exact: the widened value is the value of the pattern.
		for i, h := range src {
			if !isNaN16(f, h) {
				require.Equal(t, value16(f, h), float64(ref[i]), "%s: %#04x", f, h)
			}
		}
	}
}

func isNaN16(f Format, h uint16) bool {
	if f == FP16 {
		return h&0x7c00 == 0x7c00 && h&0x3ff != 0
	}
	return h&0x7f80 == 0x7f80 && h&0x7f != 0
}

func quietBit(f Format) uint16 {
	if f == FP16 {
		return 0x200
	}
	return 0x40
}

// value16 decodes a non-NaN pattern from its definition, in float64.
func value16(f Format, h uint16) float64 {
	ebits, mbits, bias := 5, 10, 15
	if f == BF16 {
		ebits, mbits, bias = 8, 7, 127
	}
	sign := 1.0
	if h>>15 != 0 {
		sign = -1
	}
	e := int(h>>mbits) & (1<<ebits - 1)
	m := float64(int(h) & (1<<mbits - 1))
	switch e {
	case 0:
		return sign * math.Ldexp(m, 1-bias-mbits)
	case 1<<ebits - 1:
		return math.Inf(int(sign))
	}
	return sign * math.Ldexp(1+m/float64(int(1)<<mbits), e-bias)
}

// refNarrow is an independent reference for narrowing a non-NaN x: the
// nearest of the format's finite values (ties to the even pattern), by
// binary search over their float64 values, or Inf beyond the largest by
// half a step.
type refNarrow struct {
	f    Format
	vals []float64 // value of positive pattern p, for p up to the largest finite
}

func newRefNarrow(f Format) *refNarrow {
	top := uint16(0x7bff)
	if f == BF16 {
		top = 0x7f7f
	}
	r := &refNarrow{f: f, vals: make([]float64, int(top)+1)}
	for p := range r.vals {
		r.vals[p] = value16(f, uint16(p))
	}
	return r
}

func (r *refNarrow) narrow(x float32) (uint16, bool) {
	a := math.Abs(float64(x))
	var sign uint16
	if math.Signbit(float64(x)) {
		sign = 0x8000
	}
	inf := uint16(0x7c00)
	if r.f == BF16 {
		inf = 0x7f80
	}
	if math.IsInf(a, 0) {
		return sign | inf, false
	}
	top := len(r.vals) - 1
	step := r.vals[top] - r.vals[top-1]
	if a >= r.vals[top]+step/2 {
		return sign | inf, true
	}
	p := sort.Search(len(r.vals), func(i int) bool { return r.vals[i] > a }) - 1 // vals[p] <= a
	if p < top {
		lo, hi := a-r.vals[p], r.vals[p+1]-a
		if hi < lo || (hi == lo && p&1 == 1) {
			p++
		}
	}
	return sign | uint16(p), false
}

// TestNarrowReference narrows float32 patterns spread over the whole range
// on both paths and compares them with the reference.
func TestNarrowReference(t *testing.T) {
	n := 1 << 18
	if testing.Short() {
		n = 1 << 14
	}
	rng := rand.New(rand.NewPCG(1, 2))
	src := make([]float32, n)
	for i := range src {
		switch i % 3 {
		case 0: // uniform over bit patterns
			src[i] = f32(rng.Uint32())
		case 1: // near the fp16 range and its subnormals
			src[i] = f32(uint32(rng.IntN(0x47900000-0x33000000)+0x33000000) | rng.Uint32()&0x80000000)
		default: // exact ties and neighbours of fp16 and bf16 values
			b := rng.Uint32() &^ 0xfff
			src[i] = f32(b | []uint32{0x1000, 0x0fff, 0x1001, 0x8000, 0x7fff}[rng.IntN(5)])
		}
	}
	for _, f := range []Format{FP16, BF16} {
		ref := newRefNarrow(f)
		want := make([]uint16, n)
		wantOv := 0
		for i, x := range src {
			if math.IsNaN(float64(x)) {
				want[i] = f32ToNaN16(f, x)
				continue
			}
			var ov bool
			want[i], ov = ref.narrow(x)
			if ov {
				wantOv++
			}
		}
		for _, k := range kernelsOf(f) {
			got := make([]uint16, n)
			ov := k.narrow(got, src)
			for i := range got {
				require.Equal(t, want[i], got[i], "%s %s: narrow %#08x", f, k.name, math.Float32bits(src[i]))
			}
			assert.Equal(t, wantOv, ov, "%s %s: overflow count", f, k.name)
		}
	}
}

// f32ToNaN16 is the NaN rule: sign and leading payload kept, quiet bit set.
func f32ToNaN16(f Format, x float32) uint16 {
	b := math.Float32bits(x)
	if f == FP16 {
		return uint16(b>>16)&0x8000 | 0x7e00 | uint16(b>>13)&0x3ff
	}
	return uint16(b>>16) | 0x40
}

func TestNarrowWidenLengths(t *testing.T) {
	src := []float32{1, 2, 3, 4}
	dst := []uint16{9, 9}
	assert.Zero(t, Narrow(FP16, dst, src))
	assert.Equal(t, []uint16{0x3c00, 0x4000}, dst)
	back := make([]float32, 5)
	Widen(FP16, back, dst)
	assert.Equal(t, []float32{1, 2, 0, 0, 0}, back)
	assert.Zero(t, Narrow(BF16, nil, src))
	Widen(BF16, nil, dst)
}

// FuzzHalf checks the dispatched kernels against the portable ones on
// arbitrary bit patterns, lengths and offsets.
func FuzzHalf(f *testing.F) {
	f.Add([]byte{0, 0, 0x80, 0x7f, 0, 0xf0, 0x7f, 0x47}, uint8(0))
	f.Add(make([]byte, 4*100), uint8(3))
	f.Fuzz(func(t *testing.T, data []byte, off uint8) {
		n := len(data) / 4
		src := make([]float32, n)
		for i := range src {
			src[i] = f32(binary.LittleEndian.Uint32(data[4*i:]))
		}
		o := min(int(off)%8, n)
		src = src[o:]
		halves := make([]uint16, len(data)/2)
		for i := range halves {
			halves[i] = binary.LittleEndian.Uint16(data[2*i:])
		}
		for _, fm := range []Format{FP16, BF16} {
			ks := kernelsOf(fm)
			g, d := make([]uint16, len(src)), make([]uint16, len(src))
			og, od := ks[0].narrow(g, src), ks[1].narrow(d, src)
			require.Equal(t, og, od, "%s overflow count", fm)
			require.Equal(t, g, d, "%s narrow", fm)
			wg, wd := make([]float32, len(halves)), make([]float32, len(halves))
			ks[0].widen(wg, halves)
			ks[1].widen(wd, halves)
			for i := range wg {
				require.Equal(t, math.Float32bits(wg[i]), math.Float32bits(wd[i]), "%s widen %#04x", fm, halves[i])
			}
			// widenAdd of the narrowed input onto itself.
			ag, ad := append([]float32(nil), src...), append([]float32(nil), src...)
			ks[0].widenAdd(ag, g)
			ks[1].widenAdd(ad, g)
			for i := range ag {
				require.Equal(t, math.Float32bits(ag[i]), math.Float32bits(ad[i]), "%s widenAdd", fm)
			}
		}
	})
}

// TestNarrowLarge covers the streaming path of long buffers, at an offset
// that is not aligned, against the portable kernels.
func TestNarrowLarge(t *testing.T) {
	if testing.Short() {
		t.Skip("long buffer")
	}
	rng := rand.New(rand.NewPCG(5, 6))
	src := make([]float32, 1<<21+77)
	for i := range src {
		src[i] = f32(rng.Uint32())
	}
	for _, f := range []Format{FP16, BF16} {
		ks := kernelsOf(f)
		for _, off := range []int{0, 1, 5} {
			g := make([]uint16, len(src)+8)
			d := make([]uint16, len(src)+8)
			og := ks[0].narrow(g[off:off+len(src)-off], src[off:])
			od := ks[1].narrow(d[off:off+len(src)-off], src[off:])
			require.Equal(t, og, od, "%s at offset %d: overflow count", f, off)
			require.Equal(t, g, d, "%s at offset %d", f, off)
		}
	}
}
