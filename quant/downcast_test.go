package quant

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// randInput is rank r's deterministic test buffer of n normal values.
func randInput(r, n int) []float32 {
	rng := rand.New(rand.NewPCG(uint64(r)+100, uint64(n)))
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	return x
}

// downCastRef computes the down-cast mean element by element with the
// scalar conversions: narrow each input, sum widened in ascending rank
// order in float32, divide by W, narrow, widen.
func downCastRef(f Format, inputs [][]float32) []float32 {
	nar, wid := f32ToF16, f16ToF32
	if f == BF16 {
		nar, wid = f32ToBF16, bf16ToF32
	}
	w := len(inputs)
	out := make([]float32, len(inputs[0]))
	for i := range out {
		s := wid(nar(inputs[0][i]))
		for r := 1; r < w; r++ {
			s += wid(nar(inputs[r][i]))
		}
		if w > 1 {
			s /= float32(w)
		}
		out[i] = wid(nar(s))
	}
	return out
}

func TestDownCastAllReduce(t *testing.T) {
	for _, f := range []Format{FP16, BF16} {
		for _, w := range []int{1, 2, 3, 4, 5} {
			for _, n := range []int{0, 1, 7, 100, 4097, 10001} {
				inputs := make([][]float32, w)
				for r := range inputs {
					inputs[r] = randInput(r, n)
				}
				want := downCastRef(f, inputs)
				outs := make([][]float32, w)
				err := local.Run(ctxT(t), w, func(ctx context.Context, c comm.Comm) error {
					d := NewDownCast(f)
					buf := append([]float32(nil), inputs[c.Rank()]...)
					for range 2 { // the second call reuses the buffers
						copy(buf, inputs[c.Rank()])
						if err := d.AllReduce(ctx, c, buf); err != nil {
							return err
						}
					}
					outs[c.Rank()] = buf
					st := d.Stats()
					assert.EqualValues(t, 2, st.Calls)
					assert.Zero(t, st.Overflow)
					// Wire bytes: the all-to-all with its headers and the
					// all-gather, 2 bytes per element.
					chunk := (n + w - 1) / w
					wire := int64(w-1) * (2*int64(chunk) + 8)
					if n > 0 {
						wire += int64(w-1) * 2 * int64(chunk)
					}
					assert.Equal(t, 2*wire, c.Stats().Total().BytesSent, "%s w=%d n=%d", f, w, n)
					return nil
				})
				require.NoError(t, err, "%s w=%d n=%d", f, w, n)
				var errSq, refSq float64
				for r := range outs {
					for i := range want {
						require.Equal(t, math.Float32bits(want[i]), math.Float32bits(outs[r][i]),
							"%s w=%d n=%d rank %d element %d", f, w, n, r, i)
					}
				}
				for i := range want {
					var m float64
					for r := range inputs {
						m += float64(inputs[r][i])
					}
					m /= float64(w)
					errSq += (float64(want[i]) - m) * (float64(want[i]) - m)
					refSq += m * m
				}
				if n >= 100 { // a few elements may cancel to near zero
					tol := 1e-3 // two roundings to 11 bits
					if f == BF16 {
						tol = 8e-3 // two roundings to 8 bits
					}
					assert.Less(t, math.Sqrt(errSq/refSq), tol, "%s w=%d n=%d", f, w, n)
				}
			}
		}
	}
}

func TestDownCastSpecialValues(t *testing.T) {
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	// Element: 0 NaN on rank 1; 1 +Inf on rank 0; 2 +Inf and -Inf; 3 -Inf;
	// 4 beyond fp16's range on rank 2 (counted); 5 ordinary; 6 beyond
	// fp16's range with both signs; 7 float32's largest (bf16 overflow).
	inputs := [][]float32{
		{1, inf, inf, -inf, 1, 1, 1e6, 1},
		{nan, 1, -inf, 1, 1, 2, -1e6, 1},
		{1, 1, 1, 1, 1e5, 3, 1, math.MaxFloat32},
	}
	for _, f := range []Format{FP16, BF16} {
		core, logs := observer.New(zapcore.WarnLevel)
		outs := make([][]float32, len(inputs))
		overflow := make([]int64, len(inputs))
		err := local.Run(ctxT(t), len(inputs), func(ctx context.Context, c comm.Comm) error {
			d := NewDownCast(f, WithOverflowLogger(zap.New(core)))
			buf := append([]float32(nil), inputs[c.Rank()]...)
			err := d.AllReduce(ctx, c, buf)
			outs[c.Rank()], overflow[c.Rank()] = buf, d.Stats().Overflow
			return err
		})
		require.NoError(t, err)
		for r, out := range outs {
			assert.True(t, math.IsNaN(float64(out[0])), "%s rank %d: NaN lost", f, r)
			assert.Equal(t, inf, out[1], "%s rank %d", f, r)
			assert.True(t, math.IsNaN(float64(out[2])), "%s rank %d: Inf-Inf", f, r)
			assert.Equal(t, -inf, out[3], "%s rank %d", f, r)
			assert.Equal(t, float32(2), out[5], "%s rank %d", f, r)
			if f == FP16 {
				assert.Equal(t, inf, out[4], "%s rank %d: overflow", f, r)
				assert.True(t, math.IsNaN(float64(out[6])), "%s rank %d: overflow both signs", f, r)
				assert.Equal(t, inf, out[7], "%s rank %d", f, r)
			} else {
				assert.InDelta(t, (1e5+2)/3, out[4], 100, "%s rank %d", f, r)
				assert.Equal(t, inf, out[7], "%s rank %d", f, r)
			}
		}
		if f == FP16 {
			assert.Equal(t, []int64{1, 1, 2}, overflow)
			assert.Equal(t, 3, logs.Len(), "one warning per rank that overflowed")
		} else {
			assert.Equal(t, []int64{0, 0, 1}, overflow)
			assert.Equal(t, 1, logs.Len())
		}
		for _, e := range logs.All() {
			assert.Contains(t, e.Message, "beyond the format's range")
		}
	}
}

func TestDownCastMismatch(t *testing.T) {
	// 10 and 11 elements pad to the same 12 on 4 ranks: the header catches
	// it; 10 and 30 differ on the wire: the backend catches it. Every rank
	// gets an error either way.
	for _, other := range []int{11, 30, 0} {
		errs := make([]error, 4)
		_ = local.Run(ctxT(t), 4, func(ctx context.Context, c comm.Comm) error {
			n := 10
			if c.Rank() == 2 {
				n = other
			}
			errs[c.Rank()] = NewDownCast(FP16).AllReduce(ctx, c, make([]float32, n))
			return errs[c.Rank()]
		})
		for r, err := range errs {
			require.Error(t, err, "other=%d rank %d", other, r)
			var me *comm.MismatchError
			assert.True(t, errors.As(err, &me), "rank %d: %v", r, err)
			assert.Contains(t, err.Error(), "quant: down-cast allreduce")
		}
	}
}

func TestDownCastBadInput(t *testing.T) {
	ctx := ctxT(t)
	err := NewDownCast(FP16).AllReduce(ctx, nil, []float32{1})
	assert.ErrorContains(t, err, "nil communicator")
	err = local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		return NewDownCast(Format(9)).AllReduce(ctx, c, []float32{1})
	})
	assert.ErrorContains(t, err, "invalid format")
	// A cancelled context is an error, not a hang.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	err = local.Run(cctx, 2, func(ctx context.Context, c comm.Comm) error {
		return NewDownCast(BF16).AllReduce(ctx, c, []float32{1, 2, 3})
	})
	assert.Error(t, err)
}

// TestDownCastAllocs: after the first call a call allocates nothing, also
// when inputs overflow the format (the warning goes to the default no-op
// logger) and when a bfloat16 sum overflows float32 (the float64 re-sum).
// Every call starts from the same inputs, since the mean replaces them.
func TestDownCastAllocs(t *testing.T) {
	const w, n = 3, 10000
	for _, f := range []Format{FP16, BF16} {
		cs, err := local.New(w)
		require.NoError(t, err)
		ctx := ctxT(t)
		ds := make([]*DownCast, w)
		srcs, bufs := make([][]float32, w), make([][]float32, w)
		for r := range ds {
			ds[r] = NewDownCast(f)
			srcs[r] = randInput(r, n)
			srcs[r][0] = 1e6             // beyond fp16's range
			srcs[r][1] = 3e38            // a bfloat16 sum over float32's range
			srcs[r][2] = math.MaxFloat32 // beyond bfloat16's range
			bufs[r] = make([]float32, n)
		}
		call := func(r int) {
			copy(bufs[r], srcs[r])
			_ = ds[r].AllReduce(ctx, cs[r], bufs[r])
		}
		done := make(chan struct{}, w)
		for r := 1; r < w; r++ {
			go func() {
				defer func() { done <- struct{}{} }()
				for range 101 {
					call(r)
				}
			}()
		}
		allocs := testing.AllocsPerRun(100, func() { call(0) })
		for r := 1; r < w; r++ {
			<-done
		}
		assert.Zero(t, allocs, "%s", f)
		st := ds[0].Stats()
		assert.EqualValues(t, 101, st.Calls)
		assert.Positive(t, st.Overflow, "%s: the overflow path ran", f)
		assert.False(t, f == BF16 && math.IsInf(float64(bufs[0][1]), 0), "bf16: the float64 re-sum ran")
		assert.Positive(t, st.Convert)
		assert.Positive(t, st.Comm)
	}
}

// TestDownCastBF16SumOverflow: bfloat16 holds values up to float32's
// largest, so the float32 sum of a chunk can overflow where the mean of
// the ranks' values is representable (4 ranks x 2e38). Such elements are
// summed again in float64: the mean comes out finite, with nothing counted
// as overflow; an infinite input still gives an infinite mean.
func TestDownCastBF16SumOverflow(t *testing.T) {
	inf := float32(math.Inf(1))
	inputs := [][]float32{
		{2e38, 3e38, 3e38, 1, inf, -3e38},
		{2e38, 3e38, 3e38, 2, 3e38, -3e38},
		{2e38, -3e38, 3e38, 3, 3e38, -3e38},
		{2e38, 1, 3e38, 4, 3e38, -3e38},
	}
	// The float64 mean of the bfloat16 values, narrowed once more.
	want := make([]float32, len(inputs[0]))
	for i := range want {
		var s float64
		for _, in := range inputs {
			s += float64(bf16ToF32(f32ToBF16(in[i])))
		}
		want[i] = bf16ToF32(f32ToBF16(float32(s / float64(len(inputs)))))
	}
	outs := make([][]float32, len(inputs))
	overflow := make([]int64, len(inputs))
	err := local.Run(ctxT(t), len(inputs), func(ctx context.Context, c comm.Comm) error {
		d := NewDownCast(BF16)
		buf := append([]float32(nil), inputs[c.Rank()]...)
		err := d.AllReduce(ctx, c, buf)
		outs[c.Rank()], overflow[c.Rank()] = buf, d.Stats().Overflow
		return err
	})
	require.NoError(t, err)
	for r, out := range outs {
		assert.Equal(t, want, out, "rank %d", r)
		for i := range 4 {
			assert.False(t, math.IsInf(float64(out[i]), 0), "rank %d element %d: a representable mean became Inf", r, i)
		}
		assert.Equal(t, float32(2.5), out[3], "an ordinary element keeps the float32 sum")
		assert.Equal(t, inf, out[4], "an infinite input stays infinite")
		assert.Equal(t, bf16ToF32(f32ToBF16(-3e38)), out[5], "the negative side too")
	}
	assert.Equal(t, []int64{0, 0, 0, 0}, overflow)
}
