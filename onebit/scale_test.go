package onebit_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
)

// With ScaleMeanAbs both scales are means of |x|: a call's output and
// error buffers follow onebit.md's steps with them, on whole and
// pipelined calls alike, and the error feedback still telescopes.
func TestScaleMeanAbs(t *testing.T) {
	const w = 3
	for _, n := range []int{1000, 3<<20 + 5} { // one call whole, one pipelined
		inputs := make([][]float32, w)
		for r := range inputs {
			inputs[r] = make([]float32, n)
			for i := range inputs[r] {
				v := math.Sin(float64(i)*0.37+float64(r)) * math.Exp(float64(i%11)/3) // heavy-tailed
				inputs[r][i] = float32(v)
			}
		}
		outs := make([][]float32, w)
		errs := make([][2][]float32, w)
		require.NoError(t, local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
			st, err := onebit.NewState(n, w)
			if err != nil {
				return err
			}
			st.SetScale(onebit.ScaleMeanAbs)
			if (n > 1<<20) != (onebit.Pieces(st) > 1) {
				return fmt.Errorf("%d elements in %d pieces", n, onebit.Pieces(st))
			}
			buf := append([]float32(nil), inputs[c.Rank()]...)
			if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
				return err
			}
			outs[c.Rank()] = buf
			errs[c.Rank()] = [2][]float32{append([]float32(nil), st.WorkerError...), append([]float32(nil), st.ServerError...)}
			return nil
		}))
		// The reference, in float64: worker scale mean|x| over the padded
		// tensor, server scale mean|c| over the chunk.
		N := onebit.PaddedLen(n, w)
		C := N / w
		ws := make([]float64, w)
		for r := range w {
			var a float64
			for _, v := range inputs[r] {
				a += math.Abs(float64(v))
			}
			ws[r] = a / float64(N)
		}
		sgn := func(v float64) float64 {
			if v < 0 {
				return -1
			}
			return 1
		}
		at := func(r, i int) float64 {
			if i < n {
				return float64(inputs[r][i])
			}
			return 0
		}
		var worst float64
		for j := range w {
			c := make([]float64, C)
			var a float64
			for i := range C {
				for r := range w {
					c[i] += ws[r] / w * sgn(at(r, j*C+i))
				}
				a += math.Abs(c[i])
			}
			ss := a / float64(C)
			for i := range C {
				want := ss * sgn(c[i])
				if j*C+i < n {
					for r := range w {
						worst = max(worst, math.Abs(float64(outs[r][j*C+i])-want))
					}
				}
				worst = max(worst, math.Abs(float64(errs[j][1][i])-(c[i]-want)))
			}
		}
		for r := range w {
			for i := range N {
				x := at(r, i)
				worst = max(worst, math.Abs(float64(errs[r][0][i])-(x-ws[r]*sgn(x))))
			}
		}
		assert.Less(t, worst, 1e-4, "n %d: largest difference from the float64 reference", n)
	}
}
