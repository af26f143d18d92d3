package errorfeedback_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/errorfeedback"
	"github.com/lowbit-ml/lowbit/signpack"
)

// TestTelescopes: over many steps, everything emitted plus the final
// residual equals everything put in, element by element.
func TestTelescopes(t *testing.T) {
	for _, n := range []int{1, 5, 8, 33, 1000} {
		for _, pad := range []int{0, 3} {
			rng := rand.New(rand.NewPCG(uint64(n), uint64(pad)))
			r := errorfeedback.NewResidual(n + pad)
			packed := make([]byte, signpack.PackedLen(n+pad))
			signs := make([]float32, n+pad)
			in64 := make([]float64, n+pad)
			out64 := make([]float64, n+pad)
			for step := 0; step < 50; step++ {
				prev := append(errorfeedback.Residual(nil), r...)
				in := make([]float32, n)
				for i := range in {
					in[i] = float32(rng.NormFloat64() * 3)
					in64[i] += float64(in[i])
				}
				scale, err := r.Compress(packed, in)
				require.NoError(t, err)
				// The scale is the RMS of x = in + prev over the padded length.
				var ss float64
				for i := range prev {
					x := float64(prev[i])
					if i < n {
						x = float64(prev[i] + in[i])
					}
					ss += x * x
				}
				assert.InDelta(t, math.Sqrt(ss/float64(n+pad)), float64(scale), 1e-6*float64(scale)+1e-30)
				signpack.UnpackScale(signs, packed, scale)
				for i := range signs {
					out64[i] += float64(signs[i])
					x := prev[i]
					if i < n {
						x += in[i]
					}
					// One step, exactly in float32: x = emitted + residual.
					require.Equal(t, x-signs[i], r[i], "n=%d step %d element %d", n, step, i)
				}
			}
			for i := range r {
				assert.InDelta(t, in64[i], out64[i]+float64(r[i]), 1e-3)
			}
		}
	}
}

func TestErrors(t *testing.T) {
	r := errorfeedback.NewResidual(8)
	_, err := r.Compress(make([]byte, 1), make([]float32, 9))
	assert.ErrorContains(t, err, "longer")
	_, err = r.Compress(make([]byte, 0), make([]float32, 8))
	assert.ErrorContains(t, err, "cannot hold")
	scale, err := errorfeedback.Residual(nil).Compress(nil, nil)
	assert.NoError(t, err)
	assert.Zero(t, scale)
}

// TestCompensateInPieces: Compensate followed by PackResidual over any
// split into whole bytes gives Compress's scale, bytes and residual.
func TestCompensateInPieces(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	for _, c := range []struct{ n, in, piece int }{{64, 64, 8}, {1024, 1000, 24}, {4096, 4093, 1024}, {8, 3, 8}} {
		prev := make([]float32, c.n)
		for i := range prev {
			prev[i] = float32(rng.NormFloat64())
		}
		in := make([]float32, c.in)
		for i := range in {
			in[i] = float32(rng.NormFloat64())
		}
		whole := errorfeedback.Residual(append([]float32(nil), prev...))
		wantPacked := make([]byte, c.n/8)
		wantScale, err := whole.Compress(wantPacked, in)
		require.NoError(t, err)

		split := errorfeedback.Residual(append([]float32(nil), prev...))
		scale, err := split.Compensate(in)
		require.NoError(t, err)
		require.Equal(t, wantScale, scale, "n=%d", c.n)
		packed := make([]byte, c.n/8)
		for lo := 0; lo < c.n; lo += c.piece {
			hi := min(lo+c.piece, c.n)
			signpack.PackResidual(packed[lo/8:hi/8], split[lo:hi], scale)
		}
		assert.Equal(t, wantPacked, packed, "n=%d", c.n)
		assert.Equal(t, whole, split, "n=%d", c.n)
	}
	_, err := errorfeedback.NewResidual(4).Compensate(make([]float32, 5))
	assert.ErrorContains(t, err, "longer")
}

func TestResetAndAllocs(t *testing.T) {
	r := errorfeedback.NewResidual(4096)
	packed := make([]byte, 512)
	in := make([]float32, 4000)
	for i := range in {
		in[i] = float32(i%7) - 3
	}
	allocs := testing.AllocsPerRun(20, func() { _, _ = r.Compress(packed, in) })
	assert.Zero(t, allocs)
	r.Reset()
	assert.Equal(t, errorfeedback.NewResidual(4096), r)
}

func ExampleResidual_Compress() {
	r := errorfeedback.NewResidual(8)
	packed := make([]byte, 1)
	scale, _ := r.Compress(packed, []float32{3, -1, 1, -3, 1, 1, -1, -1})
	fmt.Printf("scale %.4f, signs %08b\n", scale, packed[0])
	fmt.Println("residual", []float32(r))
	// Output:
	// scale 1.7321, signs 10101100
	// residual [1.2679492 0.7320508 -0.7320508 -1.2679492 -0.7320508 -0.7320508 0.7320508 0.7320508]
}
