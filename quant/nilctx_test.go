package quant_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/quant"
)

// TestNilContext: a nil context is context.Background() (comm's rule), on
// the one rank that passes it too: every collective of the package
// completes with the exact result, and no rank panics or waits.
func TestNilContext(t *testing.T) {
	for _, w := range []int{1, 4} {
		done := make(chan error, 1)
		go func() {
			done <- local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
				var nilCtx context.Context
				use := ctx
				if c.Rank() == 0 {
					use = nilCtx
				}
				want := float32(w-1) / 2 // mean of the ranks
				buf := make([]float32, 8)
				fill := func() {
					for i := range buf {
						buf[i] = float32(c.Rank())
					}
				}

				fill()
				if err := quant.NewDownCast(quant.FP16).AllReduce(use, c, buf); err != nil {
					return err
				}
				assert.Equal(t, want, buf[0], "downcast")

				co, err := quant.NewCoalesced(use, c, []int{4 * w})
				if err != nil {
					return err
				}
				tensor := make([]float32, 4*w)
				for i := range tensor {
					tensor[i] = float32(c.Rank())
				}
				outs, err := co.ReduceScatter(use, [][]float32{tensor})
				if err != nil {
					return err
				}
				for _, v := range outs[0] {
					assert.Equal(t, want, v, "coalesced")
				}

				rpn := 1
				if w == 4 {
					rpn = 2
				}
				l, err := comm.NewLayout(use, c, rpn)
				if err != nil {
					return err
				}
				tl, err := quant.NewTwoLevel(l)
				if err != nil {
					return err
				}
				fill()
				if err := tl.AllReduce(use, buf); err != nil {
					return err
				}
				assert.Equal(t, want, buf[0], "two-level")
				return nil
			})
		}()
		select {
		case err := <-done:
			require.NoError(t, err, "%d ranks", w)
		case <-time.After(20 * time.Second):
			t.Fatalf("%d ranks: a rank with a nil context left the group waiting", w)
		}
	}
}
