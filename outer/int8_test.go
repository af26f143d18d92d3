package outer

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// emuQuantize is the int8 codec's quantizer as its doc states it, in
// float32, written apart from it: one group of at most Int8GroupSize
// elements, its codes and scale.
func emuQuantize(x []float32) (codes []int8, scale float32) {
	var amax float32
	for _, v := range x {
		amax = max(amax, float32(math.Abs(float64(v))))
	}
	scale = amax / 127
	var q float32
	if amax > 0 {
		q = min(127/amax, math.MaxFloat32)
	}
	for _, v := range x {
		y := max(-127, min(127, v*q))
		codes = append(codes, int8(math.RoundToEven(float64(y))))
	}
	return codes, scale
}

// emuRoundTrip quantizes and dequantizes x group by group.
func emuRoundTrip(x []float32) []float32 {
	out := make([]float32, len(x))
	for lo := 0; lo < len(x); lo += Int8GroupSize {
		hi := min(lo+Int8GroupSize, len(x))
		codes, s := emuQuantize(x[lo:hi])
		for i, c := range codes {
			out[lo+i] = float32(float32(c) * s)
		}
	}
	return out
}

// emuAllReduce is the two-phase int8 average of xs (one per rank) as the
// codec's doc states it: chunks of C = ceil(m/W) elements, zero padded;
// each rank quantizes every chunk, the chunk's owner sums the W
// dequantized versions in rank order in float32, divides by W, quantizes
// the mean, and every rank dequantizes the owners' means.
func emuAllReduce(xs [][]float32) []float32 {
	w, m := len(xs), len(xs[0])
	c := (m + w - 1) / w
	padded := make([][]float32, w)
	for r, x := range xs {
		padded[r] = make([]float32, w*c)
		copy(padded[r], x)
	}
	out := make([]float32, w*c)
	for j := range w {
		acc := make([]float32, c)
		for r := range w {
			for i, v := range emuRoundTrip(padded[r][j*c : (j+1)*c]) {
				acc[i] += v
			}
		}
		for i := range acc {
			acc[i] /= float32(w)
		}
		copy(out[j*c:], emuRoundTrip(acc))
	}
	return out[:m]
}

// int8AllReduce runs the codec on w in-process ranks, rank r averaging
// xs[r] (copied), and returns every rank's result.
func int8AllReduce(t *testing.T, xs [][]float32) [][]float32 {
	t.Helper()
	w := len(xs)
	out := make([][]float32, w)
	var mu sync.Mutex
	require.NoError(t, local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		buf := append([]float32(nil), xs[c.Rank()]...)
		if err := newInt8Codec(len(buf), w).allReduce(ctx, c, buf); err != nil {
			return err
		}
		mu.Lock()
		out[c.Rank()] = buf
		mu.Unlock()
		return nil
	}))
	return out
}

// The codec is symmetric: the codes of -x are those of x negated, so
// decode(encode(-x)) = -decode(encode(x)), and the extremes ±amax come
// back as ±127*scale: a pseudo-gradient of +1 and -1 on every rank comes
// back exactly (the formula of quant.Quantize gave +0.98444 and -1).
func TestInt8Symmetric(t *testing.T) {
	for _, w := range []int{2, 3, 4} {
		xs := make([][]float32, w)
		for r := range xs {
			xs[r] = []float32{1, -1, 0.5, -0.25, 0}
		}
		for r, got := range int8AllReduce(t, xs) {
			assert.Equal(t, []float32{1, -1}, got[:2], "W%d rank %d", w, r)
			assert.Equal(t, emuAllReduce(xs), got, "W%d rank %d", w, r)
		}
	}
	q := newInt8Codec(600, 1)
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 200 {
		n := 1 + rng.IntN(600)
		x, neg := make([]float32, n), make([]float32, n)
		mag := float32(math.Pow(10, float64(rng.IntN(40)-20)))
		for i := range x {
			x[i] = float32(rng.NormFloat64()) * mag
		}
		if trial%2 == 0 {
			x[rng.IntN(n)] = 3 * mag // a positive extreme
		}
		for i := range x {
			neg[i] = -x[i]
		}
		dec := func(v []float32) []float32 {
			msg := make([]byte, int8MsgLen(n))
			q.encode(msg, v)
			ng := (n + Int8GroupSize - 1) / Int8GroupSize
			require.NotContains(t, string(msg[4*ng:]), "\x80", "trial %d: code -128", trial)
			out := make([]float32, n)
			require.NoError(t, q.decodeAdd(out, msg))
			return out
		}
		pos, minus := dec(x), dec(neg)
		for i := range x {
			require.True(t, minus[i] == -pos[i], "trial %d element %d: decode(encode(-x)) = %v, -decode(encode(x)) = %v", trial, i, minus[i], -pos[i])
		}
		assert.Equal(t, emuRoundTrip(x), pos, "trial %d: against the emulation", trial)
	}
}

// The two-phase average matches its float32 emulation bit for bit, on
// sizes that leave the last chunks short (and some ranks' chunks empty).
func TestInt8AllReduceEmulation(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, w := range []int{2, 3, 4} {
		for _, m := range []int{1, 5, 255, 256, 257, 3*256 + 1, 1000} {
			t.Run(fmt.Sprintf("W%d/m%d", w, m), func(t *testing.T) {
				xs := make([][]float32, w)
				for r := range xs {
					xs[r] = make([]float32, m)
					for i := range xs[r] {
						xs[r][i] = float32(rng.NormFloat64()) * float32(1+r)
					}
				}
				want := emuAllReduce(xs)
				for r, got := range int8AllReduce(t, xs) {
					require.Equal(t, want, got, "rank %d", r)
				}
			})
		}
	}
}

// The padding of a short last chunk is zero, whatever the chunk before it
// held there: large values at the end of the next-to-last chunk must not
// enter the scale of the last chunk's last group, whose small values
// would then all quantize to 0.
func TestInt8PaddingCleared(t *testing.T) {
	const w, c = 2, 300 // chunks of 300: groups of 256 and 44
	m := w*c - 1        // the last chunk is one element short
	xs := make([][]float32, w)
	for r := range xs {
		xs[r] = make([]float32, m)
		for i := range xs[r] {
			xs[r][i] = 1e-3 * float32(1+(i+r)%7)
		}
		xs[r][c-1] = 1000 // the first chunk's last element: the place of the last chunk's padding
	}
	want := emuAllReduce(xs)
	for r, got := range int8AllReduce(t, xs) {
		require.Equal(t, want, got, "rank %d", r)
		for i := c + 256; i < m; i++ {
			exact := (xs[0][i] + xs[1][i]) / 2
			require.InEpsilon(t, exact, got[i], 0.02, "rank %d element %d", r, i)
		}
	}
}
