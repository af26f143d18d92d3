package onebit_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

func shardedBF16(freeze int, bf onebit.BF16State) onebit.AdamConfig {
	cfg := shardedConfig(freeze, 0)
	cfg.BF16 = bf
	return cfg
}

func shardedConfig(freeze, bucketBytes int) onebit.AdamConfig {
	cfg := adamConfigForResume(freeze)
	cfg.StateMode = onebit.StateSharded
	cfg.BucketBytes = bucketBytes
	return cfg
}

// The sharded mode resumes bit-identically in warm-up, in compression and
// around the switch, with one bucket and with parameters spread over
// several buckets, and every rank holds the same parameters.
func TestShardedResumeIsBitIdentical(t *testing.T) {
	const freeze, total = 3, 9
	for _, w := range []int{2, 3, 4} {
		for _, bb := range []int{0, 24, 25} {
			cfg := shardedConfig(freeze, bb)
			if bb == 25 {
				// Buckets of 24 bytes with both buffers in bfloat16.
				cfg.BucketBytes, cfg.BF16 = 24, onebit.BF16WorkerError|onebit.BF16Variance
			}
			want := adamRun(t, w, cfg, t.TempDir(), 1, total, false, false)
			for r := 1; r < w; r++ {
				require.Equal(t, want[0], want[r], "W=%d: rank %d differs from rank 0", w, r)
			}
			for _, k := range []int{1, freeze, freeze + 2} {
				t.Run(fmt.Sprintf("W=%d/buckets=%d/k=%d", w, bb, k), func(t *testing.T) {
					dir := t.TempDir()
					adamRun(t, w, cfg, dir, 1, k, false, true)
					got := adamRun(t, w, cfg, dir, k+1, total, true, false)
					assert.Equal(t, want, got)
				})
			}
		}
	}
}

// The bfloat16 buffers leave the warm-up alone and change the steps after
// it (they round), and a run that starts compressing at once (FreezeStep
// 0) works with them.
func TestShardedBF16(t *testing.T) {
	want := adamRun(t, 2, shardedConfig(2, 0), t.TempDir(), 1, 5, false, false)
	warm := adamRun(t, 2, shardedConfig(2, 0), t.TempDir(), 1, 2, false, false)
	for _, bf := range []onebit.BF16State{onebit.BF16WorkerError, onebit.BF16Variance} {
		got := adamRun(t, 2, shardedBF16(2, bf), t.TempDir(), 1, 5, false, false)
		assert.NotEqual(t, want, got, "%v", bf)
		assert.Equal(t, warm, adamRun(t, 2, shardedBF16(2, bf), t.TempDir(), 1, 2, false, false), "%v in the warm-up", bf)
	}
	got := adamRun(t, 2, shardedBF16(0, onebit.BF16WorkerError|onebit.BF16Variance), t.TempDir(), 1, 3, false, false)
	assert.Equal(t, got[0], got[1])
}

// After the warm-up the sharded mode is another algorithm than the full
// mode (it compresses gradients and updates, not the momentum): the
// parameters part.
func TestShardedCompressionDiffers(t *testing.T) {
	full := adamRun(t, 2, adamConfigForResume(2), t.TempDir(), 1, 4, false, false)
	sharded := adamRun(t, 2, shardedConfig(2, 0), t.TempDir(), 1, 4, false, false)
	assert.NotEqual(t, full, sharded)
}

// In the warm-up the sharded mode is exact Adam: the same parameters as
// the full mode's warm-up, bit for bit (the mean gradient is the same sum
// divided the same way, and the update rounds as optim.AdamUpdate).
func TestShardedWarmupIsExactAdam(t *testing.T) {
	for _, w := range []int{2, 4} {
		full := adamConfigForResume(100)
		want := adamRun(t, w, full, t.TempDir(), 1, 6, false, false)
		got := adamRun(t, w, shardedConfig(100, 24), t.TempDir(), 1, 6, false, false)
		assert.Equal(t, want, got, "W=%d", w)
	}
}

// A pipelined bucket (its chunks travel in pieces) gives the same
// parameters as the same bucket sent whole, with the worker error in
// float32 and in bfloat16 (formed a block at a time: chunks of 20000
// elements are more than one block); and the warm-up, which stages its
// exchanges in pieces when the worker errors are in bfloat16, gives the
// same parameters as the float32 one staged whole.
func TestShardedPipelinedIsTheSame(t *testing.T) {
	const w, n = 2, 40000
	run := func(pieces, freeze, steps int, bf onebit.BF16State) [][]float32 {
		out := make([][]float32, w)
		err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
			ps := adamParams(t, []int{n - 13}, []int{13})
			cfg := shardedBF16(freeze, bf)
			opt, err := onebit.NewAdam(ctx, c, ps, cfg)
			if err != nil {
				return err
			}
			for _, st := range onebit.AdamBucketStates(opt) {
				onebit.SetPieces(st, pieces)
				if onebit.Pieces(st) != pieces {
					return fmt.Errorf("%d pieces, want %d", onebit.Pieces(st), pieces)
				}
			}
			for s := 1; s <= steps; s++ {
				adamGrads(ps, c.Rank(), s)
				if err := opt.Step(ctx); err != nil {
					return err
				}
			}
			out[c.Rank()] = append(append([]float32(nil), ps[0].Data()...), ps[1].Data()...)
			return nil
		})
		require.NoError(t, err)
		return out
	}
	for _, bf := range []onebit.BF16State{0, onebit.BF16WorkerError} {
		assert.Equal(t, run(1, 2, 6, bf), run(4, 2, 6, bf), "%v", bf)
	}
	assert.Equal(t, run(1, 100, 3, 0), run(1, 100, 3, onebit.BF16WorkerError), "warm-up")
}

// Loading a checkpoint of the other mode, of another rank or of other
// buckets is refused, naming what differs, and changes nothing.
func TestShardedLoadRefusals(t *testing.T) {
	const w, freeze, k = 2, 2, 4
	dir := t.TempDir()
	adamRun(t, w, shardedConfig(freeze, 0), dir, 1, k, false, true)
	fullDir := t.TempDir()
	adamRun(t, w, adamConfigForResume(freeze), fullDir, 1, k, false, true)
	load := func(t *testing.T, cfg onebit.AdamConfig, path string, rank int) error {
		var got error
		err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
			ps := adamParams(t, []int{3, 7}, []int{13}, []int{1})
			opt, err := onebit.NewAdam(ctx, c, ps, cfg)
			if err != nil {
				return err
			}
			if c.Rank() != rank {
				return nil
			}
			ck, err := optim.LoadFile(path)
			if err != nil {
				return err
			}
			before := adamBits(ps)
			got = opt.Load(ck)
			assert.Equal(t, before, adamBits(ps), "a refused load changes nothing")
			return nil
		})
		require.NoError(t, err)
		return got
	}
	rank0 := filepath.Join(dir, "rank0.ckpt")
	for _, tc := range []struct {
		name string
		cfg  onebit.AdamConfig
		path string
		rank int
		msg  string
	}{
		{"full into sharded", shardedConfig(freeze, 0), filepath.Join(fullDir, "rank0.ckpt"), 0, "made with StateMode StateFull, this optimizer has StateSharded"},
		{"sharded into full", adamConfigForResume(freeze), rank0, 0, "made with StateMode StateSharded, this optimizer has StateFull"},
		{"another rank", shardedConfig(freeze, 0), rank0, 1, "made by rank 0"},
		{"other buckets", shardedConfig(freeze, 24), rank0, 0, "buckets"},
		{"other precision", shardedBF16(freeze, onebit.BF16Variance), rank0, 0, "made with BF16 0, this optimizer has BF16Variance"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := load(t, tc.cfg, tc.path, tc.rank)
			require.Error(t, err)
			assert.True(t, errors.Is(err, optim.ErrIncompatibleCheckpoint), "%v", err)
			assert.Contains(t, err.Error(), tc.msg)
		})
	}
	t.Run("reset errors on another group size", func(t *testing.T) {
		ck, err := optim.LoadFile(rank0)
		require.NoError(t, err)
		reset := filepath.Join(t.TempDir(), "reset.ckpt")
		require.NoError(t, optim.SaveFile(reset, ck.ResetErrors()))
		err = local.Run(adamCtx(t), 3, func(ctx context.Context, c comm.Comm) error {
			opt, err := onebit.NewAdam(ctx, c, adamParams(t, []int{3, 7}, []int{13}, []int{1}), shardedConfig(freeze, 0))
			if err != nil {
				return err
			}
			ck, err := optim.LoadFile(reset)
			if err != nil {
				return err
			}
			err = opt.Load(ck)
			if err == nil || !errors.Is(err, optim.ErrIncompatibleCheckpoint) {
				return fmt.Errorf("rank %d: want a refusal, got %v", c.Rank(), err)
			}
			return nil
		})
		require.NoError(t, err)
	})
}

// The sharded mode refuses a warm-up averaging other than float32 and an
// unknown mode, at construction.
func TestShardedConfigErrors(t *testing.T) {
	cfg := shardedConfig(2, 0)
	cfg.Reduce = optim.ReduceBF16
	_, err := onebit.NewAdam(context.Background(), nil, adamParams(t, []int{4}), cfg)
	var ce *optim.ConfigError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "Reduce", ce.Field)
	cfg = adamConfigForResume(2)
	cfg.BF16 = onebit.BF16Variance
	_, err = onebit.NewAdam(context.Background(), nil, adamParams(t, []int{4}), cfg)
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "BF16", ce.Field)
	cfg = shardedConfig(2, 0)
	cfg.StateMode = 7
	_, err = onebit.NewAdam(context.Background(), nil, adamParams(t, []int{4}), cfg)
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "StateMode", ce.Field)
	assert.Contains(t, err.Error(), "StateMode(7)")
}

// ParseStateMode reads the names a command line gives the modes, and
// refuses others.
func TestParseStateMode(t *testing.T) {
	for s, want := range map[string]struct {
		mode onebit.StateMode
		bf   onebit.BF16State
	}{
		"": {onebit.StateFull, 0}, "full": {onebit.StateFull, 0}, "compact": {onebit.StateCompact, 0},
		"sharded": {onebit.StateSharded, 0}, "sharded-bf16": {onebit.StateSharded, onebit.BF16WorkerError | onebit.BF16Variance},
	} {
		mode, bf, err := onebit.ParseStateMode(s)
		require.NoError(t, err, s)
		assert.Equal(t, want.mode, mode, s)
		assert.Equal(t, want.bf, bf, s)
	}
	_, _, err := onebit.ParseStateMode("shard")
	require.Error(t, err)
	assert.Contains(t, err.Error(), `unknown state mode "shard"`)
}
