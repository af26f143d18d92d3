package errorfeedback

import (
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/signpack"
)

// splitRun feeds x + in to a fresh Norm in the pieces cuts gives (each cut
// an end offset into x), with kernel k, and returns the Norm and the x it
// left.
func splitRun(x, in []float32, cuts []int, k lanesKernel) (Norm, []float32) {
	var m Norm
	xs := append([]float32(nil), x...)
	lo := 0
	for _, hi := range append(cuts, len(xs)) {
		if hi < lo {
			continue
		}
		m.add(xs[lo:hi], in[min(lo, len(in)):min(hi, len(in))], k)
		lo = hi
	}
	return m, xs
}

// TestNormSplitInvariant: a run cut anywhere, fed by either kernel, gives
// the same lanes and so the same sum, bit for bit, and leaves x + in in x.
func TestNormSplitInvariant(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	for _, n := range []int{0, 1, 31, 32, 33, 100, 1000, 4099} {
		for _, m := range []int{n, n - 5, n / 3, 0} {
			if m < 0 {
				continue
			}
			x, in := randomSlice(rng, n, 3), randomSlice(rng, m, 2)
			whole, stored := splitRun(x, in, nil, lanesGeneric)
			want := make([]float32, n)
			for i := range want {
				want[i] = x[i]
				if i < m {
					want[i] += in[i]
				}
			}
			requireSameBits(t, want, stored, "n=%d m=%d: Compensate's x", n, m)
			requireSameSum(t, refSumSquares(want), whole.Sum(), 1e-12, "n=%d m=%d", n, m)
			for trial := range 20 {
				var cuts []int
				for c := rng.IntN(6); c > 0; c-- {
					cuts = append(cuts, rng.IntN(n+1))
				}
				if trial%2 == 1 {
					// Whole blocks of 32, as a pipelined collective cuts.
					cuts = []int{32 * rng.IntN(n/32+1)}
				}
				for _, k := range []struct {
					name string
					f    lanesKernel
				}{{"generic", lanesGeneric}, {"fast", lanesFast}} {
					got, gx := splitRun(x, in, cuts, k.f)
					require.Equal(t, whole, got, "n=%d m=%d cuts=%v %s", n, m, cuts, k.name)
					requireSameBits(t, want, gx, "n=%d m=%d cuts=%v %s: x", n, m, cuts, k.name)
				}
			}
		}
	}
}

// TestNormSpecials: infinities and NaNs reach the sum as in plain
// summation, on both kernels alike.
func TestNormSpecials(t *testing.T) {
	x := make([]float32, 96)
	for i := range x {
		x[i] = float32(i) - 40
	}
	in := make([]float32, 96)
	in[50] = float32(math.Inf(1))
	var a, b Norm
	a.add(append([]float32(nil), x...), in, lanesGeneric)
	b.add(append([]float32(nil), x...), in, lanesFast)
	assert.True(t, math.IsInf(a.Sum(), 1))
	assert.Equal(t, a, b)
	in[70] = float32(math.NaN())
	a.Reset()
	a.Compensate(x, in)
	assert.True(t, math.IsNaN(a.Sum()))
	assert.Zero(t, ScaleOf(123, 0))
	assert.Equal(t, float32(2), ScaleOf(16, 4))
}

func TestRunNormAllocs(t *testing.T) {
	x := make([]float32, 4099)
	in := make([]float32, 4000)
	var m Norm
	assert.Zero(t, testing.AllocsPerRun(20, func() {
		m.Reset()
		m.Compensate(x[3:], in)
		m.Compensate(x, in)
		_ = m.Sum()
	}))
}

// TestNormCompensatePack: the fused pass gives Compensate's lanes and x,
// and signpack.Pack's bytes of the sums, however the run is cut, on the
// fast kernel and on the portable path alike.
func TestNormCompensatePack(t *testing.T) {
	rng := rand.New(rand.NewPCG(23, 24))
	none := func(*[lanes]float64, []byte, []float32, []float32) int { return 0 }
	for _, n := range []int{0, 8, 13, 32, 96, 1000, 4096, 4099} {
		for _, m := range []int{n, n - 5, n / 3, 0} {
			if m < 0 {
				continue
			}
			x, in := randomSlice(rng, n, 3), randomSlice(rng, m, 2)
			if n > 3 {
				x[n/2] = float32(math.NaN())
				x[3] = float32(math.Copysign(0, -1))
				x[1] = float32(math.Inf(-1))
			}
			want, wantX := splitRun(x, in, nil, lanesGeneric)
			wantP := make([]byte, signpack.PackedLen(n))
			signpack.Pack(wantP, wantX)
			for trial := range 10 {
				cuts := packCuts(rng, n, trial)
				for _, k := range []struct {
					name string
					f    packKernel
				}{{"fast", packLanesFast}, {"portable", none}} {
					var got Norm
					gx := append([]float32(nil), x...)
					gp := make([]byte, len(wantP))
					lo := 0
					for _, hi := range append(cuts, n) {
						got.compensatePack(gp[lo/8:], gx[lo:hi], in[min(lo, m):min(hi, m)], k.f)
						lo = hi
					}
					msg := fmt.Sprintf("n=%d m=%d cuts=%v %s", n, m, cuts, k.name)
					require.Equal(t, normBits(want), normBits(got), msg)
					requireSameBits(t, wantX, gx, "%s: x", msg)
					require.Equal(t, wantP, gp, "%s: packed", msg)
				}
			}
		}
	}
	var m Norm
	assert.Panics(t, func() { m.CompensatePack(make([]byte, 1), make([]float32, 9), nil) })
}

// nanLanes is a Norm's state as bits with every NaN lane the same NaN.
func nanLanes(m Norm) [lanes + 1]uint64 {
	b := normBits(m)
	for i, v := range m.acc {
		if math.IsNaN(v) {
			b[i] = math.Float64bits(math.NaN())
		}
	}
	return b
}

// packCuts is where trial cuts a run of n elements that is packed as it
// goes: nowhere in trial 0, then at a whole packed byte, in even trials
// at a whole block of lanes.
func packCuts(rng *rand.Rand, n, trial int) []int {
	if trial == 0 {
		return nil
	}
	cuts := []int{8 * rng.IntN(n/8+1)}
	if trial%2 == 0 {
		cuts = []int{32 * rng.IntN(n/32+1)}
	}
	return cuts
}

// normBits is a Norm's state as bits, so that NaN lanes compare equal.
func normBits(m Norm) [lanes + 1]uint64 {
	var b [lanes + 1]uint64
	for i, v := range m.acc {
		b[i] = math.Float64bits(v)
	}
	b[lanes] = uint64(m.n)
	return b
}

// FuzzNorm runs the fast kernels and the portable path of Norm on
// arbitrary float32 bit patterns, NaNs and infinities included, cut at an
// arbitrary point: the lanes must agree bit for bit, and so must x and the
// packed bytes, but where x[i] and in[i] are both NaN (which of the two
// their sum is, is not defined; requireSums allows either).
func FuzzNorm(f *testing.F) {
	f.Add(make([]byte, 8*70), uint16(33))
	f.Add([]byte{0, 0, 0x80, 0x7f, 0, 0, 0xc0, 0x7f, 1, 2, 3, 4, 5, 6, 7, 8}, uint16(1))
	f.Fuzz(func(t *testing.T, data []byte, cut uint16) {
		n := len(data) / 8
		x := make([]float32, n)
		in := make([]float32, n)
		for i := range n {
			x[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
			in[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*(n+i):]))
		}
		c := 0
		if n > 0 {
			c = int(cut) % (n + 1)
		}
		none := func(*[lanes]float64, []byte, []float32, []float32) int { return 0 }
		run := func(lk lanesKernel, pk packKernel, pack bool) (Norm, []float32, []byte) {
			var m Norm
			xs := append([]float32(nil), x...)
			p := make([]byte, signpack.PackedLen(n))
			for _, r := range [][2]int{{0, c}, {c, n}} {
				if pack {
					m.compensatePack(p[r[0]/8:], xs[r[0]:r[1]], in[r[0]:r[1]], pk)
				} else {
					m.add(xs[r[0]:r[1]], in[r[0]:r[1]], lk)
				}
			}
			return m, xs, p
		}
		for _, pack := range []bool{false, true} {
			if pack && c%8 != 0 {
				continue // packing cuts fall on whole bytes
			}
			gm, gx, gp := run(lanesGeneric, none, pack)
			fm, fx, fp := run(lanesFast, packLanesFast, pack)
			requireSums(t, x, in, gx, "generic x")
			requireSums(t, x, in, fx, "fast x")
			for l := range lanes {
				g, h := gm.acc[l], fm.acc[l]
				if !(math.IsNaN(g) && math.IsNaN(h)) && math.Float64bits(g) != math.Float64bits(h) {
					t.Fatalf("lane %d: generic %v, fast %v (pack %v, cut %d)", l, g, h, pack, c)
				}
			}
			if pack {
				for i := range x {
					if isNaN32(x[i]) && isNaN32(in[i]) {
						// Either NaN packs as 1.
						continue
					}
					bit := func(p []byte) byte { return p[i/8] >> (7 - i%8) & 1 }
					require.Equal(t, bit(gp), bit(fp), "packed bit %d", i)
				}
			}
		}
	})
}

// TestNormCompensatePackSigns: the summing pass gives what unpacking every
// source into a buffer (signpack.UnpackScale, then UnpackScaleAdd in
// order) and CompensatePack of that buffer give, bit for bit (x, packed
// bytes and lanes), for 1 to 5 sources, scales of either sign, zero and
// NaN, however the run is cut, on the fast kernel and on the portable
// path alike.
func TestNormCompensatePackSigns(t *testing.T) {
	rng := rand.New(rand.NewPCG(25, 26))
	none := func(*[lanes]float64, []byte, []float32, [][]byte, []float32) int { return 0 }
	for _, n := range []int{0, 8, 13, 32, 96, 1000, 4096, 4099} {
		for nsrc := 1; nsrc <= 5; nsrc++ {
			x := randomSlice(rng, n, 3)
			if n > 3 && nsrc != 4 { // not both NaN: which of two NaNs a sum keeps is the compiler's choice
				x[n/2] = float32(math.NaN())
				x[3] = float32(math.Copysign(0, -1))
			}
			srcs := make([][]byte, nsrc)
			scales := make([]float32, nsrc)
			for j := range srcs {
				srcs[j] = make([]byte, signpack.PackedLen(n))
				for i := range srcs[j] {
					srcs[j][i] = byte(rng.Uint32())
				}
				scales[j] = float32(rng.NormFloat64())
			}
			switch nsrc {
			case 3:
				scales[1] = 0
			case 4:
				scales[2] = float32(math.NaN())
			}
			in := make([]float32, n)
			if n > 0 {
				signpack.UnpackScale(in, srcs[0], scales[0])
				for j := 1; j < nsrc; j++ {
					signpack.UnpackScaleAdd(in, srcs[j], scales[j])
				}
			}
			var want Norm
			wantX := append([]float32(nil), x...)
			wantP := make([]byte, signpack.PackedLen(n))
			want.compensatePack(wantP, wantX, in, packLanesFast)
			for trial := range 6 {
				cuts := packCuts(rng, n, trial)
				for _, k := range []struct {
					name string
					f    sumKernel
				}{{"fast", sumPackLanesFast}, {"portable", none}} {
					var got Norm
					gx := append([]float32(nil), x...)
					gp := make([]byte, len(wantP))
					sub := make([][]byte, nsrc)
					lo := 0
					for _, hi := range append(cuts, n) {
						for j := range sub {
							sub[j] = srcs[j][lo/8:]
						}
						got.compensatePackSigns(gp[lo/8:], gx[lo:hi], sub, scales, k.f)
						lo = hi
					}
					msg := fmt.Sprintf("n=%d sources=%d cuts=%v %s", n, nsrc, cuts, k.name)
					if nsrc == 4 {
						// A NaN scale makes every sum NaN, and a lane
						// adds NaN to NaN: which one it keeps is the
						// compiler's choice, so only NaN-ness counts.
						require.Equal(t, nanLanes(want), nanLanes(got), msg)
					} else {
						require.Equal(t, normBits(want), normBits(got), msg)
					}
					requireSameBits(t, wantX, gx, "%s: x", msg)
					require.Equal(t, wantP, gp, "%s: packed", msg)
				}
			}
		}
	}
	var m Norm
	src := [][]byte{make([]byte, 2)}
	assert.Panics(t, func() { m.CompensatePackSigns(make([]byte, 1), make([]float32, 9), src, []float32{1}) })
	assert.Panics(t, func() { m.CompensatePackSigns(make([]byte, 2), make([]float32, 9), [][]byte{{0}}, []float32{1}) })
	assert.Panics(t, func() { m.CompensatePackSigns(make([]byte, 2), make([]float32, 9), src, nil) })
}

// FuzzCompensatePackSigns: on any values, signs and scales the fast
// kernel and the portable path of CompensatePackSigns agree: the same x
// and lanes, bit for bit, but for which NaN a sum of two NaNs keeps, and
// the same packed bytes. The data holds x (4 bytes a value), then, per
// source, its scale and its packed bytes.
func FuzzCompensatePackSigns(f *testing.F) {
	f.Add([]byte{}, uint8(1), uint16(0))
	seed := make([]byte, 4*100+3*(4+13))
	for i := range seed {
		seed[i] = byte(i * 37)
	}
	f.Add(seed, uint8(3), uint16(100))
	f.Add(seed, uint8(1), uint16(64))
	f.Fuzz(func(t *testing.T, data []byte, nsrc uint8, n16 uint16) {
		k := int(nsrc%6) + 1
		n := int(n16 % 512)
		pl := signpack.PackedLen(n)
		if len(data) < 4*n+k*(4+pl) {
			return
		}
		x := make([]float32, n)
		for i := range x {
			x[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
		}
		srcs := make([][]byte, k)
		scales := make([]float32, k)
		off := 4 * n
		for j := range k {
			scales[j] = math.Float32frombits(binary.LittleEndian.Uint32(data[off:]))
			srcs[j] = data[off+4 : off+4+pl]
			off += 4 + pl
		}
		none := func(*[lanes]float64, []byte, []float32, [][]byte, []float32) int { return 0 }
		var fast, slow Norm
		xf, xs := append([]float32(nil), x...), append([]float32(nil), x...)
		pf, ps := make([]byte, pl), make([]byte, pl)
		fast.compensatePackSigns(pf, xf, srcs, scales, sumPackLanesFast)
		slow.compensatePackSigns(ps, xs, srcs, scales, none)
		for i := range xf {
			if !(isNaN32(xf[i]) && isNaN32(xs[i])) {
				require.Equal(t, math.Float32bits(xs[i]), math.Float32bits(xf[i]), "x[%d]", i)
			}
		}
		require.Equal(t, ps, pf, "packed")
		require.Equal(t, nanLanes(slow), nanLanes(fast), "lanes")
	})
}
