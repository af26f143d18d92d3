package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/outer"
)

// TestOuterBF16: -outer-bf16 gives diloco its smallest state: with the
// sparse codec the inner Adam's moments and the accumulator in bfloat16,
// 6 bytes per parameter fewer than without it (m, v: 8 -> 4; the
// accumulator 4 -> 2; less a chunk of float32 scratch), with the 1-bit
// codec the moments only (4 fewer).
func TestOuterBF16(t *testing.T) {
	for _, tc := range []struct {
		codec outer.Codec
		saved int64 // bytes per parameter
	}{{outer.CodecSparse, 6}, {outer.CodecOneBit, 4}} {
		t.Run(tc.codec.String(), func(t *testing.T) {
			state := func(bf16 bool) int64 {
				cfg := smallConfig(diloco)
				cfg.hyper.outer = outer.DefaultConfigFor(tc.codec)
				cfg.hyper.outer.H = 4
				cfg.hyper.outer.SparseChunk = 256
				cfg.hyper.outer.Density = 1.0 / 16
				cfg.hyper.outerBF16 = bf16
				var n int64
				err := local.Run(t.Context(), 2, func(ctx context.Context, c comm.Comm) error {
					ps := newMLP(1, 1).params()
					opt, err := newOptimizer(ctx, diloco, c, ps, cfg.hyper)
					if err != nil {
						return err
					}
					defer opt.Close()
					if c.Rank() == 0 {
						n = opt.(interface{ StateBytes() int64 }).StateBytes()
					}
					return nil
				})
				require.NoError(t, err)
				return n
			}
			params := int64(numInputs*numHidden + numHidden + numHidden*numClasses + numClasses)
			full, small := state(false), state(true)
			// The bfloat16 accumulator keeps a float32 chunk of scratch.
			assert.InDelta(t, tc.saved*params, full-small, 4096, "StateBytes %d -> %d", full, small)
		})
	}
}
