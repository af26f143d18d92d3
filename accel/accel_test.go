package accel_test

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/accel/internal/acceltest"
	"github.com/lowbit-ml/lowbit/signpack"
)

// TestCPU runs the shared device suite on the CPU device, which must give
// the host code's results bit for bit.
func TestCPU(t *testing.T) {
	acceltest.Run(t, accel.NewCPU(), true)
}

func TestCPUClosed(t *testing.T) {
	d := accel.NewCPU()
	b, err := d.Alloc(8)
	require.NoError(t, err)
	require.NoError(t, d.Close())
	assert.True(t, errors.Is(d.Zero(accel.Whole(b)), accel.ErrFreed))
	_, err = d.Alloc(8)
	assert.Error(t, err)
}

func TestSpan(t *testing.T) {
	d := accel.NewCPU()
	b, err := d.Alloc(40)
	require.NoError(t, err)
	s := accel.Floats(b, 2, 5)
	assert.Equal(t, accel.Span{Buf: b, Off: 8, Len: 20}, s)
	assert.Equal(t, 5, s.Elems())
	assert.Equal(t, accel.Span{Buf: b, Off: 12, Len: 8}, s.Sub(4, 12))
	assert.Equal(t, accel.Span{}, accel.Whole(nil))
	assert.Equal(t, 2, accel.PackedLen(9))
}

func TestCPUAllocs(t *testing.T) {
	d := accel.NewCPU()
	x, _ := d.Alloc(4 * 4096)
	p, _ := d.Alloc(512)
	in, _ := d.Alloc(4 * 4000)
	allocs := testing.AllocsPerRun(50, func() {
		_, _ = d.Compress(accel.Whole(p), accel.Whole(x), accel.Whole(in))
		_ = d.UnpackScaleAdd(accel.Whole(x), accel.Whole(p), 0.5)
	})
	assert.Zero(t, allocs)
}

// TestResidual checks Residuals against signpack.PackResidual, the kernel
// that leaves Compress's residuals, bit for bit, on the special values and
// on random bit patterns.
func TestResidual(t *testing.T) {
	xs := []float32{0, float32(math.Copysign(0, -1)), 1, -1, float32(math.Inf(1)), float32(math.Inf(-1)),
		math.Float32frombits(1), math.Float32frombits(0x80000001), math.MaxFloat32, -math.MaxFloat32,
		math.Float32frombits(0x7fc00000), math.Float32frombits(0xffc00000), math.Float32frombits(0x7f800001),
		math.Float32frombits(0xff800001)}
	rng := rand.New(rand.NewPCG(5, 6))
	for range 100_000 {
		xs = append(xs, math.Float32frombits(rng.Uint32()))
	}
	packed := make([]byte, signpack.PackedLen(len(xs)))
	for _, s := range []float32{0, 0.75, 3e-39, float32(math.Inf(1)), float32(math.NaN())} {
		want := append([]float32(nil), xs...)
		signpack.PackResidual(packed, want, s)
		got := append([]float32(nil), xs...)
		accel.Residuals(got, s)
		for i, x := range xs {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("Residual(%g (%#08x), %g) = %g (%#08x), PackResidual %g (%#08x)",
					x, math.Float32bits(x), s, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
			}
		}
	}
}
