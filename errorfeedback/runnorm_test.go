package errorfeedback

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// splitRun feeds x + in to a fresh Norm in the pieces cuts gives (each cut
// an end offset into x), with kernel k, storing if store, and returns the
// Norm and the x it left.
func splitRun(x, in []float32, cuts []int, store bool, k lanesKernel) (Norm, []float32) {
	var m Norm
	xs := append([]float32(nil), x...)
	lo := 0
	for _, hi := range append(cuts, len(xs)) {
		if hi < lo {
			continue
		}
		m.add(xs[lo:hi], in[min(lo, len(in)):min(hi, len(in))], store, k)
		lo = hi
	}
	return m, xs
}

// TestNormSplitInvariant: a run cut anywhere, fed by either kernel, with
// or without the store, gives the same lanes and so the same sum, bit for
// bit; Compensate leaves x + in in x and Add leaves x alone.
func TestNormSplitInvariant(t *testing.T) {
	rng := rand.New(rand.NewPCG(21, 22))
	for _, n := range []int{0, 1, 31, 32, 33, 100, 1000, 4099} {
		for _, m := range []int{n, n - 5, n / 3, 0} {
			if m < 0 {
				continue
			}
			x, in := randomSlice(rng, n, 3), randomSlice(rng, m, 2)
			whole, stored := splitRun(x, in, nil, true, lanesGeneric)
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
					got, gx := splitRun(x, in, cuts, true, k.f)
					require.Equal(t, whole, got, "n=%d m=%d cuts=%v %s", n, m, cuts, k.name)
					requireSameBits(t, want, gx, "n=%d m=%d cuts=%v %s: x", n, m, cuts, k.name)
					got, gx = splitRun(x, in, cuts, false, k.f)
					require.Equal(t, whole, got, "n=%d m=%d cuts=%v %s read-only", n, m, cuts, k.name)
					requireSameBits(t, x, gx, "n=%d m=%d cuts=%v %s: Add changed x", n, m, cuts, k.name)
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
	a.add(append([]float32(nil), x...), in, false, lanesGeneric)
	b.add(append([]float32(nil), x...), in, false, lanesFast)
	assert.True(t, math.IsInf(a.Sum(), 1))
	assert.Equal(t, a, b)
	in[70] = float32(math.NaN())
	a.Reset()
	a.Add(x, in)
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
		m.Add(x[3:], in)
		m.Compensate(x, in)
		_ = m.Sum()
	}))
}
