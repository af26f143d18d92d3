package accel_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/accel/internal/acceltest"
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
