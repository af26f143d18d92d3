package gomlx

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// removeNewest removes the newest checkpoint of dir, GoMLX's files and the
// lowbit state file, as a crash before that rank's last save would have
// left it, and returns its step.
func removeNewest(t *testing.T, dir string) int64 {
	t.Helper()
	held, err := listCheckpoints(dir)
	require.NoError(t, err)
	require.NotEmpty(t, held)
	last := held[len(held)-1]
	for _, name := range []string{last.base + gomlxJSON, last.base + gomlxBin, stateFileName(last.step)} {
		require.NoError(t, os.Remove(filepath.Join(dir, name)))
	}
	return last.step
}

// TestResumeCommonStep: a crash between the ranks' saves (2 ranks, 1-bit
// Adam compressing from step 4, saved every step with Keep(2), rank 1's
// newest checkpoint removed: rank 0 holds steps 5 and 6, rank 1 step 5).
//
//   - Handlers built with checkpoint.Config.Done, each rank loading its own
//     newest checkpoint: every rank fails at the first step with an error
//     naming the ranks' steps, and no file changes.
//   - Built with Optimizer.Checkpoint: both ranks resume from step 5 and
//     their next step is bit-identical to step 6 of the uninterrupted run,
//     on both ranks; rank 0's step 6 is set aside, and rank 0 warns that
//     it resumes from an older checkpoint.
//   - Ranks with no step in common (rank 1 holds none, then other steps
//     than rank 0): an error on every rank naming each rank's steps, and no
//     file changes.
func TestResumeCommonStep(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	rankDir := func(r int) string { return filepath.Join(dir, fmt.Sprintf("rank-%d", r)) }
	rc := resumeConfig{hidden: 16, steps: 6, build: withFreeze(3)}
	straight := resumeAll(t, ctx, 2, dir, rc)
	require.Equal(t, straight[0].final, straight[1].final)
	require.Equal(t, int64(6), removeNewest(t, rankDir(1)))
	rc.steps = 1

	t.Run("plain Done", func(t *testing.T) {
		files := snapshot(t, dir)
		rc := rc
		rc.plain = true
		for r, run := range requireResumeRefused(t, ctx, 2, dir, rc, "different global steps (rank 0 at 6, rank 1 at 5)") {
			assert.Nil(t, run.opt.Optimizer(), "rank %d", r)
		}
		assert.Equal(t, files, snapshot(t, dir), "a file changed")
	})

	t.Run("Checkpoint", func(t *testing.T) {
		core, logs := observer.New(zapcore.InfoLevel)
		rc := rc
		rc.log = zap.New(core)
		for r, run := range resumeAll(t, ctx, 2, dir, rc) {
			assert.Equal(t, int64(5), run.start, "rank %d: resumed from", r)
			assert.True(t, run.opt.Restored(), "rank %d", r)
			assert.Equal(t, straight[r].final, run.final, "rank %d: step 6 differs from the uninterrupted run's", r)
		}
		aside, err := os.ReadDir(filepath.Join(rankDir(0), SetAsideDir))
		require.NoError(t, err)
		var names []string
		for _, e := range aside {
			names = append(names, e.Name())
		}
		assert.Len(t, names, 3, "rank 0's step 6 set aside: %v", names)
		assert.Contains(t, names, stateFileName(6))
		_, err = os.Stat(filepath.Join(rankDir(1), SetAsideDir))
		assert.ErrorIs(t, err, os.ErrNotExist, "rank 1 set something aside")
		warned := logs.FilterMessageSnippet("resuming from an older checkpoint").FilterField(zap.Int64("global_step", 5))
		assert.Equal(t, 1, warned.Len(), "rank 0's warning: %v", logs.All())
	})

	t.Run("no common step", func(t *testing.T) {
		// Every rank holds 5 and 6 again. Rank 1 then holds none; then
		// steps 3 and 4 (its files renamed).
		require.NoError(t, os.Rename(rankDir(1), rankDir(1)+".away"))
		require.NoError(t, os.Mkdir(rankDir(1), 0o770))
		check := func(want string) {
			t.Helper()
			files := snapshot(t, dir)
			requireResumeRefused(t, ctx, 2, dir, rc, want, "delete every rank's checkpoint directory")
			assert.Equal(t, files, snapshot(t, dir), "a file changed")
		}
		check("(rank 0: steps 5, 6; rank 1: none)")
		require.NoError(t, os.Remove(rankDir(1)))
		entries, err := os.ReadDir(rankDir(1) + ".away")
		require.NoError(t, err)
		require.NoError(t, os.Mkdir(rankDir(1), 0o770))
		for _, e := range entries {
			name := strings.NewReplacer("-step-00000005", "-step-00000003", "-step-00000006", "-step-00000004",
				"step-00000005.ckpt", "step-00000003.ckpt", "step-00000006.ckpt", "step-00000004.ckpt").Replace(e.Name())
			require.NoError(t, os.Rename(filepath.Join(rankDir(1)+".away", e.Name()), filepath.Join(rankDir(1), name)))
		}
		check("(rank 0: steps 5, 6; rank 1: steps 3, 4)")
	})
}

// TestCommonStepAdvice: ranks of which some hold no checkpoint (a resume on
// more ranks than saved) are told to make the new ranks' lowbit state from
// every old rank's by each optimizer's lossless way (onebit.Regroup, which
// keeps the error feedback, outer.Regroup, zero.Consolidate, or the copy
// as it is), not to reset its error buffers, which drops the error
// feedback and which 1-bit Adam's StateSharded refuses.
func TestCommonStepAdvice(t *testing.T) {
	_, err := commonStep([][]int64{{5, 6}, nil})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "(rank 0: steps 5, 6; rank 1: none)")
	for _, way := range []string{"onebit.Regroup (the 1-bit optimizers)", "outer.Regroup (the outer optimizer)", "zero.Consolidate (zero.Adam)", "left as it is (the exact optimizers)"} {
		assert.Contains(t, err.Error(), way)
	}
	assert.NotContains(t, err.Error(), "reset")
}
