package errorfeedback

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// normKernels is one set of the norm kernels.
type normKernels struct {
	name          string
	addSumSquares func(x, in []float32) float64
	sumSquares    func(x []float32) float64
}

// genericNorm is the portable path; fastNorm is what Compress uses on this machine
// (the AVX2 path on amd64 CPUs that have AVX2 and FMA).
var (
	genericNorm = normKernels{"generic", addSumSquaresGeneric, sumSquaresGeneric}
	fastNorm    = normKernels{"fast", addSumSquares, sumSquares}
)

// fastBlock is the number of elements one iteration of the amd64 assembly
// kernels handles; the tests cover both sides of its multiples on every
// architecture.
const fastBlock = 32

// normLengths are the lengths every test runs: all short ones, both sides
// of the block boundaries of the fast kernels, and an odd large one.
func normLengths() []int {
	var ns []int
	for n := 0; n <= 100; n++ {
		ns = append(ns, n)
	}
	for _, k := range []int{4, 8, 16, 32, 128} {
		ns = append(ns, k*fastBlock-1, k*fastBlock, k*fastBlock+1)
	}
	return append(ns, 4099)
}

// refSumSquares is the float64 sum of the squares of x, compensated
// (Neumaier), as the reference the kernels are held to. An infinite or NaN
// square makes the sum infinite or NaN, as in plain summation.
func refSumSquares(x []float32) float64 {
	var s, c float64
	for _, v := range x {
		q := float64(v) * float64(v)
		if math.IsInf(q, 0) || math.IsNaN(q) || math.IsInf(s, 0) || math.IsNaN(s) {
			s += q
			continue
		}
		t := s + q
		if math.Abs(s) >= q {
			c += (s - t) + q
		} else {
			c += (q - t) + s
		}
		s = t
	}
	if math.IsInf(s, 0) || math.IsNaN(s) {
		return s
	}
	return s + c
}

// requireSameBits fails unless got and want hold the same bit patterns.
func requireSameBits(t testing.TB, want, got []float32, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	require.Equal(t, len(want), len(got), msg)
	for i := range want {
		if math.Float32bits(want[i]) != math.Float32bits(got[i]) {
			require.Failf(t, "float32 bits differ",
				"element %d: want %v (%#08x), got %v (%#08x); %s", i, want[i], math.Float32bits(want[i]),
				got[i], math.Float32bits(got[i]), msg)
		}
	}
}

// requireSums fails unless got[i] is x[i] + in[i] in float32, bit for bit.
// The one freedom is where both operands are NaN: the result is then one of
// the two, quieted, and which one is not defined (the Go compiler, which
// may commute the operands of an addition, does not pick it consistently
// either).
func requireSums(t testing.TB, x, in, got []float32, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	require.Equal(t, len(x), len(got), msg)
	const quiet = 1 << 22
	for i := range x {
		g := math.Float32bits(got[i])
		if isNaN32(x[i]) && isNaN32(in[i]) {
			if g != math.Float32bits(x[i])|quiet && g != math.Float32bits(in[i])|quiet {
				require.Failf(t, "NaN + NaN is neither operand",
					"element %d: %#08x + %#08x, got %#08x; %s", i, math.Float32bits(x[i]), math.Float32bits(in[i]), g, msg)
			}
			continue
		}
		if w := math.Float32bits(x[i] + in[i]); w != g {
			require.Failf(t, "float32 bits differ",
				"element %d: %v + %v: want %v (%#08x), got %v (%#08x); %s", i, x[i], in[i],
				math.Float32frombits(w), w, got[i], g, msg)
		}
	}
}

func isNaN32(v float32) bool { return v != v }

// requireSameSum fails unless got equals want within rel relative error,
// with NaN matching NaN and infinities matching exactly.
func requireSameSum(t testing.TB, want, got, rel float64, msgAndArgs ...any) {
	t.Helper()
	switch {
	case math.IsNaN(want):
		require.True(t, math.IsNaN(got), "want NaN, got %v", got)
	case math.IsInf(want, 0):
		require.Equal(t, want, got, msgAndArgs...)
	default:
		require.InDelta(t, want, got, rel*math.Abs(want), msgAndArgs...)
	}
}

// checkNorm runs both kernel sets on copies of x and in (sub-slices at
// offset off of larger buffers, so that the fast kernels see unaligned
// data) and compares them with each other and with the reference.
func checkNorm(t testing.TB, x, in []float32, off int, rel float64) {
	t.Helper()
	n := len(x)
	want := make([]float32, n)
	for i := range want {
		want[i] = x[i] + in[i]
	}
	wantSum := refSumSquares(want)
	for _, k := range []normKernels{genericNorm, fastNorm} {
		// Guard elements around the sub-slice must not change.
		const guard = 1234.5
		xb := make([]float32, off+n+fastBlock)
		ib := make([]float32, off+n+fastBlock)
		for i := range xb {
			xb[i], ib[i] = guard, -guard
		}
		xs, is := xb[off:off+n], ib[off:off+n]
		copy(xs, x)
		copy(is, in)

		got := k.addSumSquares(xs, is)
		requireSums(t, x, in, xs, "%s addSumSquares n=%d off=%d: x", k.name, n, off)
		requireSameSum(t, wantSum, got, rel, "%s addSumSquares n=%d off=%d", k.name, n, off)
		requireSameBits(t, in, is, "%s addSumSquares n=%d off=%d: in changed", k.name, n, off)
		for i := range xb {
			if i < off || i >= off+n {
				require.Equal(t, float32(guard), xb[i], "%s n=%d off=%d: wrote outside x at %d", k.name, n, off, i)
			}
		}

		before := append([]float32(nil), xs...)
		got = k.sumSquares(xs)
		requireSameSum(t, wantSum, got, rel, "%s sumSquares n=%d off=%d", k.name, n, off)
		requireSameBits(t, before, xs, "%s sumSquares n=%d off=%d: x changed", k.name, n, off)
	}
}

func randomSlice(rng *rand.Rand, n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64() * scale)
	}
	return x
}

func TestNormLengths(t *testing.T) {
	t.Logf("fast path: %s", fastPath())
	for _, n := range normLengths() {
		for off := range 4 {
			rng := rand.New(rand.NewPCG(uint64(n), uint64(off)))
			scale := math.Pow(10, float64(rng.IntN(13)-6))
			checkNorm(t, randomSlice(rng, n, scale), randomSlice(rng, n, scale), off, 1e-12)
		}
	}
}

// TestNormAccuracy holds both kernel sets to 1e-12 relative of the
// compensated reference on long random inputs with mixed magnitudes.
func TestNormAccuracy(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{1 << 12, 1<<16 + 7} {
		x := make([]float32, n)
		in := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64() * math.Pow(2, float64(rng.IntN(40)-20)))
			in[i] = float32(rng.NormFloat64() * math.Pow(2, float64(rng.IntN(40)-20)))
		}
		checkNorm(t, x, in, 1, 1e-12)
	}
}

func TestNormSpecialValues(t *testing.T) {
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	// Two NaNs with different payloads and signs: when both operands of an
	// addition are NaN, the result must be x's, as in the generic code.
	nanA := math.Float32frombits(0x7fc00001)
	nanB := math.Float32frombits(0xffc12345)
	sub := math.Float32frombits(1) // the smallest subnormal
	const big = math.MaxFloat32
	cases := []struct {
		name  string
		x, in float32 // planted at one position
	}{
		{"inf", inf, 1},
		{"-inf", -inf, 1},
		{"inf-inf", inf, -inf}, // NaN
		{"nan", nan, 1},
		{"nan in", 1, nan},
		{"nan payloads", nanA, nanB},
		{"nan payloads swapped", nanB, nanA},
		{"overflow", big, big}, // +Inf in float32
		{"big", big, 0},        // its square is finite in float64
		{"-big", -big, 0},
		{"subnormal", sub, sub},
		{"-0", float32(math.Copysign(0, -1)), float32(math.Copysign(0, -1))},
	}
	for _, c := range cases {
		for _, n := range []int{1, 7, fastBlock, 3*fastBlock + 5, 200} {
			for _, pos := range []int{0, n / 2, n - 1} {
				rng := rand.New(rand.NewPCG(uint64(n), uint64(pos)))
				x, in := randomSlice(rng, n, 1), randomSlice(rng, n, 1)
				x[pos], in[pos] = c.x, c.in
				t.Run(c.name, func(t *testing.T) { checkNorm(t, x, in, pos%3, 1e-12) })
			}
		}
	}

	// All elements large: the sum is far beyond float32 but finite.
	x := make([]float32, 4099)
	in := make([]float32, 4099)
	for i := range x {
		x[i] = big / 2
		in[i] = big / 4
		if i%3 == 0 {
			x[i] = -x[i]
		}
	}
	checkNorm(t, x, in, 0, 1e-12)
	s := fastNorm.sumSquares(x)
	assert.False(t, math.IsInf(s, 0) || math.IsNaN(s), "sum of squares of large values: %v", s)
}

func TestNormAllocs(t *testing.T) {
	x := make([]float32, 4099)
	in := make([]float32, 4099)
	for i := range x {
		in[i] = float32(i%5) - 2
	}
	for _, k := range []normKernels{genericNorm, fastNorm} {
		allocs := testing.AllocsPerRun(20, func() {
			_ = k.addSumSquares(x, in)
			_ = k.sumSquares(x[1:])
		})
		assert.Zero(t, allocs, k.name)
	}
}

// FuzzSumSquares compares the fast kernels with the generic ones on
// arbitrary float32 bit patterns, NaNs and infinities included: x must be
// updated bit for bit the same, and the sums must agree to summation order.
func FuzzSumSquares(f *testing.F) {
	seed := func(n int, off uint8, fill func(i int) uint32) {
		b := make([]byte, 4*n)
		for i := range n {
			binary.LittleEndian.PutUint32(b[4*i:], fill(i))
		}
		f.Add(b, off)
	}
	seed(0, 0, nil)
	seed(7, 1, func(i int) uint32 { return math.Float32bits(float32(i) - 3) })
	seed(2*fastBlock+9, 2, func(i int) uint32 { return math.Float32bits(float32(i*i) / 7) })
	seed(5*fastBlock, 3, func(i int) uint32 { return uint32(i) * 0x9e3779b9 })
	seed(4*fastBlock+3, 0, func(i int) uint32 {
		if i == 70 {
			return 0x7f800000 // +Inf
		}
		return math.Float32bits(float32(i) * 1e30)
	})
	f.Fuzz(func(t *testing.T, data []byte, off uint8) {
		// The first half of the values is x, the second in.
		n := len(data) / 8
		x := make([]float32, n)
		in := make([]float32, n)
		for i := range n {
			x[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
			in[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*(n+i):]))
		}
		o := int(off % 8)
		xg := append(make([]float32, 0, n), x...)
		xf := append(make([]float32, o, o+n), x...)[o:]
		ig := append(make([]float32, 0, n), in...)
		inf := append(make([]float32, o, o+n), in...)[o:]

		sg, sf := genericNorm.addSumSquares(xg, ig), fastNorm.addSumSquares(xf, inf)
		requireSums(t, x, in, xg, "generic x after addSumSquares")
		requireSums(t, x, in, xf, "fast x after addSumSquares")
		requireSameSum(t, sg, sf, 1e-12, "addSumSquares")
		requireSameSum(t, genericNorm.sumSquares(xg), fastNorm.sumSquares(xf), 1e-12, "sumSquares")
		requireSameSum(t, genericNorm.sumSquares(x), fastNorm.sumSquares(x), 1e-12, "sumSquares of the input")
	})
}
