package gomlx

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// modeBuilder is 1-bit Adam, or 1-bit LAMB with lamb, freezing at step f,
// in state mode mode with the bfloat16 buffers bf (1-bit Adam's).
func modeBuilder(lamb bool, f int, mode onebit.StateMode, bf onebit.BF16State) Builder {
	return func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		if lamb {
			cfg := onebit.DefaultLambConfig()
			cfg.LR, cfg.FreezeStep, cfg.StateMode = 1e-2, f, mode
			return onebit.NewLamb(ctx, c, p, cfg)
		}
		cfg := onebit.DefaultAdamConfig()
		cfg.LR, cfg.FreezeStep, cfg.StateMode, cfg.BF16 = 1e-2, f, mode, bf
		return onebit.NewAdam(ctx, c, p, cfg)
	}
}

// TestRegroupEveryMode: docs/gomlx.md's recipe for changing the number of
// ranks (every new rank starts from a copy of old rank 0's directory
// whose newest lowbit state is onebit.Regroup of every old rank's) resumes
// every 1-bit optimizer and state mode from 2 ranks on 3 in the
// compression stage, with the error feedback kept: nothing warns of a
// reset, and the error buffers are not zero after a step. The compact
// modes too, whose regrouped momentum spans several of the new chunks
// (issue 49, finding 3).
func TestRegroupEveryMode(t *testing.T) {
	for _, tc := range []struct {
		name  string
		build Builder
	}{
		{"onebit-adam", modeBuilder(false, 3, onebit.StateFull, 0)},
		{"onebit-adam-compact", modeBuilder(false, 3, onebit.StateCompact, 0)},
		{"onebit-adam-sharded", modeBuilder(false, 3, onebit.StateSharded, 0)},
		{"onebit-adam-sharded-bf16", modeBuilder(false, 3, onebit.StateSharded, onebit.BF16WorkerError|onebit.BF16Variance)},
		{"onebit-lamb", modeBuilder(true, 3, onebit.StateFull, 0)},
		{"onebit-lamb-compact", modeBuilder(true, 3, onebit.StateCompact, 0)},
		{"zeroone-adam", zeroOneAdamLocal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			old, dir := t.TempDir(), t.TempDir()
			rankDir := func(base string, r int) string { return filepath.Join(base, fmt.Sprintf("rank-%d", r)) }
			require.NoError(t, local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
				return resumeRank(t, ctx, c, old, resumeConfig{hidden: 16, steps: 4, build: tc.build}).err
			}))
			name := stateFileName(4)
			olds := make([]*optim.Checkpoint, 2)
			for r := range olds {
				var err error
				olds[r], err = optim.LoadFile(filepath.Join(rankDir(old, r), name))
				require.NoError(t, err)
			}
			for r := range 3 {
				require.NoError(t, os.CopyFS(rankDir(dir, r), os.DirFS(rankDir(old, 0))))
				ck, err := onebit.Regroup(olds, 3, r)
				require.NoError(t, err)
				require.NoError(t, optim.SaveFile(filepath.Join(rankDir(dir, r), name), ck))
			}
			var runs [3]*resumeRun
			require.NoError(t, local.Run(ctx, 3, func(ctx context.Context, c comm.Comm) error {
				runs[c.Rank()] = resumeRank(t, ctx, c, dir, resumeConfig{hidden: 16, steps: 1, build: tc.build})
				return runs[c.Rank()].err
			}))
			for r, run := range runs {
				assert.True(t, run.opt.Restored(), "rank %d", r)
				assert.Equal(t, int64(4), run.start, "rank %d", r)
				for _, w := range run.opt.Warnings() {
					assert.NotContains(t, w, "reset", "rank %d", r)
				}
				assert.Positive(t, nonZeroErrors(run.state), "rank %d: error buffers all zero", r)
			}
		})
	}
}
