//go:build mpi

package mpi

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// cDivide, the C layer's vectorized division (comm.Mean), rounds every
// element as divide, Go's scalar float32 division, does: by powers of two
// (where it multiplies by the reciprocal) and by other rank counts, at
// every length around its 4-wide vectors, on normal, tiny (subnormal
// quotients), huge, infinite and NaN values.
func TestCDivideMatchesDivide(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	special := []float32{0, float32(math.Copysign(0, -1)), 1, -3, 1e-45, -1e-44, 1.1754942e-38, 3e-38,
		math.MaxFloat32, -math.MaxFloat32, float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN())}
	for _, w := range []int{1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 64, 100, 1024, 4097} {
		for n := 0; n <= 41; n++ {
			x := make([]float32, n)
			for i := range x {
				switch i % 3 {
				case 0:
					x[i] = float32(rng.NormFloat64() * 1000)
				case 1:
					x[i] = special[rng.IntN(len(special))]
				default:
					x[i] = math.Float32frombits(rng.Uint32()) // any bit pattern
				}
			}
			want := append([]float32(nil), x...)
			divide(want, w)
			cDivide(x, w)
			for i := range x {
				require.Equal(t, math.Float32bits(want[i]), math.Float32bits(x[i]),
					"w=%d n=%d element %d: %g / %d", w, n, i, want[i], w)
			}
		}
	}
}
