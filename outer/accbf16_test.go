package outer_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// The sparse codec's accumulator in bfloat16 (Config.AccumulatorBF16):
// 2 bytes per element less, every value it checkpoints a bfloat16 one,
// a checkpoint of the other kind refused both ways, and the MLP of
// TestConvergence trained to within 5% of the float32 accumulator's
// loss. Measured (4 ranks, 600 steps, H 10, chunks of 64, lr 4, decays
// 0.949, 0.95, 0.951): density 1/4, float32 0.3779, 0.3790, 0.3861,
// bfloat16 0.3849, 0.3768, 0.3837 (mean +0.2%); density 1/16, float32
// 0.3024, 0.3001, 0.3168, bfloat16 0.3441, 0.3117, 0.2925 (mean +3.2%).
func TestAccumulatorBF16(t *testing.T) {
	const w, n = 2, 20
	base := config(outer.CodecSparse, 4, 1, 0)
	half := base
	half.AccumulatorBF16 = true
	bytes := newPerRank[[2]int64](w)
	cks := newPerRank[[2]*optim.Checkpoint](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		var got [2]int64
		var ck [2]*optim.Checkpoint
		for i, cfg := range []outer.Config{base, half} {
			o, err := steppedOn(ctx, c, newParams(t, sizes), cfg, 6)
			if err != nil {
				return err
			}
			got[i] = o.StateBytes()
			if ck[i], err = o.State(); err != nil {
				return err
			}
			o.Close()
		}
		bytes.set(c.Rank(), got)
		cks.set(c.Rank(), ck)
		return nil
	})
	assert.Equal(t, bytes.v[0][0]-2*n+4*int64(base.SparseChunk), bytes.v[0][1], "2 bytes per element less, a chunk's float32 more")
	acc := cks.v[0][1].Tensor(outer.AccumulatorName)
	require.NotNil(t, acc)
	nonzero := 0
	for i, v := range acc.Data {
		assert.Zero(t, math.Float32bits(v)&0xffff, "element %d: %v is not a bfloat16", i, v)
		if v != 0 {
			nonzero++
		}
	}
	assert.Positive(t, nonzero)
	for i, k := range []struct {
		cfg  outer.Config
		want string
	}{
		{base, "made with outer_accumulator_bf16 true, this optimizer has false"},
		{half, "made with outer_accumulator_bf16 false, this optimizer has true"},
	} {
		runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
			o, err := outer.NewAdam(ctx, c, newParams(t, sizes), k.cfg, innerConfig())
			if err != nil {
				return err
			}
			defer o.Close()
			err = o.Load(cks.v[c.Rank()][1-i])
			assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
			assert.ErrorContains(t, err, k.want)
			return nil
		})
	}

	if testing.Short() || raceOn {
		return // the training: 0.2 s, 5 s under the race detector
	}
	inner := optim.DefaultAdamConfig()
	inner.LR = 3e-3
	var loss [2]float64
	for i, bf := range []bool{false, true} {
		cfg := outer.DefaultConfigFor(outer.CodecSparse)
		cfg.H, cfg.SparseChunk, cfg.Density, cfg.LR, cfg.AccumulatorBF16 = 10, 64, 0.25, 4, bf
		loss[i] = train(t, 4, 600, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return outer.NewAdam(ctx, c, ps, cfg, inner)
		})
	}
	t.Logf("MLP, sparse codec, density 1/4: loss %.4f with a float32 accumulator, %.4f with a bfloat16 one", loss[0], loss[1])
	assert.InEpsilon(t, loss[0], loss[1], 0.05)
}
