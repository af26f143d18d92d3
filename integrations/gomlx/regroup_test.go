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
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
	"github.com/lowbit-ml/lowbit/outer"
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

// newGroupDirs makes in dir the checkpoint directories of a group of to
// ranks from those of the from ranks in old, at global step step: each new
// rank's is a copy of old rank 0's, whose lowbit state of step, where
// state is not nil, state makes from every old rank's.
func newGroupDirs(t *testing.T, old, dir string, from, to int, step int64, state func(old []*optim.Checkpoint, world, r int) (*optim.Checkpoint, error)) {
	t.Helper()
	rankDir := func(base string, r int) string { return filepath.Join(base, fmt.Sprintf("rank-%d", r)) }
	name := stateFileName(step)
	olds := make([]*optim.Checkpoint, from)
	for r := range olds {
		var err error
		olds[r], err = optim.LoadFile(filepath.Join(rankDir(old, r), name))
		require.NoError(t, err)
	}
	for r := range to {
		require.NoError(t, os.CopyFS(rankDir(dir, r), os.DirFS(rankDir(old, 0))))
		if state != nil {
			ck, err := state(olds, to, r)
			require.NoError(t, err)
			require.NoError(t, optim.SaveFile(filepath.Join(rankDir(dir, r), name), ck))
		}
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
			resumeAll(t, ctx, 2, old, resumeConfig{hidden: 16, steps: 4, build: tc.build})
			newGroupDirs(t, old, dir, 2, 3, 4, onebit.Regroup)
			for r, run := range resumeAll(t, ctx, 3, dir, resumeConfig{hidden: 16, steps: 1, build: tc.build}) {
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

// TestRankChangeRecipes: the rows of docs/gomlx.md's table "Changing the
// number of ranks" that go through this package, each from 4 ranks to 2
// and from 2 to 3: every new rank starts from a copy of old rank 0's
// directory whose newest lowbit state is the table's (the copy as it is,
// onebit.Regroup, ResetErrors, zero.Consolidate, outer.Regroup of every
// old rank's), resumes from the old step and trains; rank 0 warns only
// where something restarted from zero, saying what was carried.
func TestRankChangeRecipes(t *testing.T) {
	for _, row := range []struct {
		name  string // the table's row
		build Builder
		// state makes new rank r's lowbit state of a group of world from
		// every old rank's (nil: the copy as it is).
		state func(old []*optim.Checkpoint, world, r int) (*optim.Checkpoint, error)
		warn  string // rank 0's one warning ("": none)
		// errors is 1 where the error feedback is carried (not all zero
		// after a step), -1 where it restarted from zero (all zero after a
		// step that exchanges nothing), 0 where a step tells them apart.
		errors int
	}{
		{"exact-adam", adam, nil, "", 0},
		{"exact-muon", muon, nil, "", 0},
		{"onebit-adam-regroup", onebitAdam, onebit.Regroup, "", 1},
		{"onebit-adam-reset", onebitAdam, func(old []*optim.Checkpoint, _, r int) (*optim.Checkpoint, error) {
			return old[0].ResetErrors(), nil
		}, "error buffers were reset (made on %d ranks, by rank 0): the error feedback starts again from zero; " +
			"the parameters, moments and counters of the rank that made it are carried (onebit.Regroup of every old rank's state keeps the error feedback", 0},
		{"zero-adam", zeroAdam, func(old []*optim.Checkpoint, _, _ int) (*optim.Checkpoint, error) {
			return zero.Consolidate(old)
		}, "", 0},
		{"outer-sparse", outerBuilder(4, outer.CodecSparse), outer.Regroup, "", 1},
		{"outer-onebit", outerBuilder(4, outer.CodecOneBit), outer.Regroup, "", 1},
		{"outer-onebit-reset", outerBuilder(4, outer.CodecOneBit), func(old []*optim.Checkpoint, _, _ int) (*optim.Checkpoint, error) {
			return old[0].ResetErrors(), nil
		}, "error buffers were reset (made on %d ranks, by rank 0): " +
			"the 1-bit codec's error feedback starts again from zero (outer.Regroup of every old rank's state carries it); " +
			"θ_g and u, and the inner optimizer's state and local parameters of the rank that made it, are carried", -1},
	} {
		for _, move := range [][2]int{{4, 2}, {2, 3}} {
			from, to := move[0], move[1]
			t.Run(fmt.Sprintf("%s/%dto%d", row.name, from, to), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				old, dir := t.TempDir(), t.TempDir()
				resumeAll(t, ctx, from, old, resumeConfig{hidden: 16, steps: 5, build: row.build})
				newGroupDirs(t, old, dir, from, to, 5, row.state)
				for r, run := range resumeAll(t, ctx, to, dir, resumeConfig{hidden: 16, steps: 1, build: row.build}) {
					assert.True(t, run.opt.Restored(), "rank %d", r)
					assert.Equal(t, int64(5), run.start, "rank %d", r)
					switch row.errors {
					case 1:
						assert.Positive(t, nonZeroErrors(run.state), "rank %d: error buffers all zero", r)
					case -1:
						assert.Zero(t, nonZeroErrors(run.state), "rank %d: error buffers not reset", r)
					}
					if r > 0 || row.warn == "" {
						assert.Empty(t, run.opt.Warnings(), "rank %d", r)
						continue
					}
					if assert.Len(t, run.opt.Warnings(), 1) {
						assert.Contains(t, run.opt.Warnings()[0], fmt.Sprintf(row.warn, from))
					}
				}
			})
		}
	}
}
