package main

import (
	"context"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/outerstate"
	"github.com/lowbit-ml/lowbit/outer"
)

// TestOuterState: -outer-state gives diloco's state its precision. At the
// example's defaults (the sparse codec, -outer-state auto) the inner
// Adam's moments and the accumulator are bfloat16, as with -outer-state
// bf16 or -outer-bf16: at most 12 bytes per parameter on 8 ranks by
// StateBytes, 6 fewer than -outer-state fp32 (m, v: 8 -> 4; the
// accumulator 4 -> 2; less a chunk of float32 scratch). With the 1-bit
// codec auto is float32, and bf16 saves the moments only (4 fewer). The
// comparisons run on 2 ranks (the saving does not depend on W).
func TestOuterState(t *testing.T) {
	params := float64(numInputs*numHidden + numHidden + numHidden*numClasses + numClasses)
	// onRanks is rank 0's StateBytes per parameter of diloco as the
	// flags args build it on w ranks.
	onRanks := func(w int, args string) float64 {
		o, err := parseFlags(strings.Fields(args), io.Discard)
		require.NoError(t, err, args)
		h := o.hyper()
		var n int64
		err = local.Run(t.Context(), w, func(ctx context.Context, c comm.Comm) error {
			opt, err := newOptimizer(ctx, diloco, c, newMLP(1, 1).params(), h)
			if err != nil {
				return err
			}
			defer opt.Close()
			if c.Rank() == 0 {
				n = opt.(interface{ StateBytes() int64 }).StateBytes()
			}
			return nil
		})
		require.NoError(t, err, args)
		return float64(n) / params
	}
	o, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, outer.CodecSparse, o.outer.Codec, "the default codec")
	assert.Equal(t, outerstate.Auto, o.outerState, "the default state")

	def8 := onRanks(8, "")
	t.Logf("sparse at the defaults: %.2f bytes per parameter at W = 8", def8)
	assert.LessOrEqual(t, def8, 12.0, "issue 51's goal at the example's defaults")
	perParam := func(args string) float64 { return onRanks(2, args) }
	def := perParam("")
	assert.Equal(t, def, perParam("-outer-state bf16"))
	assert.Equal(t, def, perParam("-outer-bf16"))
	assert.InDelta(t, 6, perParam("-outer-state fp32")-def, 0.1)
	assert.Equal(t, perParam("-outer-state fp32"), perParam("-outer-bf16=false"))

	f32 := perParam("-outer-codec 1bit -outer-state fp32")
	assert.Equal(t, f32, perParam("-outer-codec 1bit"), "1bit: auto is float32")
	assert.InDelta(t, 4, f32-perParam("-outer-codec 1bit -outer-state bf16"), 0.01)
}
