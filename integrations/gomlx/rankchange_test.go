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

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// onebitMuon is 1-bit Muon through MuonBuilder, in its compression stage
// from step 3.
var onebitMuon = MuonBuilder(func(ctx context.Context, c comm.Comm, params []*optim.Param, sel []string) (optim.Optimizer, error) {
	cfg := onebit.DefaultMuonConfig()
	cfg.AdamLR, cfg.FreezeStep, cfg.Params = 1e-2, 2, sel
	return onebit.NewMuon(ctx, c, params, cfg)
})

// outerBuilder is the outer optimizer with codec, an exchange every h
// inner steps, AdamW inside.
func outerBuilder(h int, codec outer.Codec) Builder {
	return func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		cfg := outer.DefaultConfigFor(codec)
		cfg.H = h
		if codec == outer.CodecSparse {
			cfg.SparseChunk, cfg.Density = 16, 0.25
		}
		in := optim.DefaultAdamConfig()
		in.LR = 1e-2
		return outer.NewAdam(ctx, c, p, cfg, in)
	}
}

// TestRankChangeAutomatic: a run resumed on another number of ranks in the
// same checkpoint directories (each rank's "rank-R") needs nothing of the
// user: Checkpoint finds the old group's newest step, makes each new
// rank's lowbit state by its optimizer's way (the copy, onebit.Regroup,
// zero.Consolidate, outer.Regroup), gives the new ranks old rank 0's GoMLX
// checkpoint, and rank 0 warns once naming the way and what the check of
// the carried state found. For each family of optimizers, 4 ranks to 2
// then 3 (each resume continuing the previous one's newest step), and 2
// ranks to 3.
func TestRankChangeAutomatic(t *testing.T) {
	for _, row := range []struct {
		name  string
		build Builder
		path  string
		// carried is true where the error feedback is carried (not all
		// zero after a step).
		carried bool
		checked string // in rank 0's warning ("": no check)
	}{
		{"exact-adam", adam, PathCopy, false, ""},
		{"exact-muon", muon, PathCopy, false, ""},
		{"onebit-adam", onebitAdam, PathRegroup, true, "the mean of"},
		{"onebit-adam-sharded", withShardedFreeze(3), PathRegroup, true, "worker errors"},
		{"onebit-lamb", withLambFreeze(3), PathRegroup, true, "worker errors"},
		{"zeroone-adam", zeroOneAdamLocal, PathRegroup, true, "worker errors"},
		{"onebit-muon", onebitMuon, PathRegroup, true, "momenta"},
		{"zero-adam", zeroAdam, PathConsolidate, false, "the sum of"},
		{"outer-sparse", outerBuilder(5, outer.CodecSparse), PathOuter, true, "sparse accumulators"},
		{"outer-onebit", outerBuilder(5, outer.CodecOneBit), PathOuter, true, "worker errors"},
	} {
		for _, sizes := range [][]int{{4, 2, 3}, {2, 3}} {
			t.Run(fmt.Sprintf("%s/%v", row.name, sizes), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				dir := t.TempDir()
				step := int64(5)
				resumeAll(t, ctx, sizes[0], dir, resumeConfig{hidden: 16, steps: 5, build: row.build})
				for i, w := range sizes[1:] {
					from := sizes[i]
					old := snapshotStates(t, dir, from, step)
					runs := resumeAll(t, ctx, w, dir, resumeConfig{hidden: 16, steps: 1, build: row.build})
					for r, run := range runs {
						assert.True(t, run.opt.Restored(), "rank %d", r)
						assert.Equal(t, step, run.start, "rank %d", r)
						ch, ok := run.opt.RankChange()
						if assert.True(t, ok, "rank %d", r) {
							assert.Equal(t, RankChange{Step: step, FromRanks: from, ToRanks: w, Path: ch.Path, Checked: ch.Checked}, ch)
							assert.Contains(t, ch.Path, row.path)
						}
						if row.carried {
							assert.Positive(t, nonZeroErrors(run.state), "rank %d: error buffers all zero", r)
						}
						if r > 0 {
							assert.Empty(t, run.opt.Warnings(), "rank %d", r)
							continue
						}
						ws := run.opt.Warnings()
						require.NotEmpty(t, ws)
						assert.Contains(t, ws[0], fmt.Sprintf("resumed on %d ranks from the checkpoint of global step %d made on %d ranks", w, step, from))
						assert.Contains(t, ws[0], row.path)
						if row.checked != "" {
							assert.Contains(t, ws[0], "carried state checked: ")
							assert.Contains(t, ws[0], row.checked)
						} else {
							assert.NotContains(t, ws[0], "checked")
						}
					}
					// The old group's state files are as they were: only
					// the new step's were added.
					assert.Equal(t, old, snapshotStates(t, dir, from, step), "the old group's state files changed")
					step++
				}
			})
		}
	}
}

// snapshotStates reads the state files of step of ranks 0 to world-1.
func snapshotStates(t *testing.T, dir string, world int, step int64) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	for r := range world {
		p := filepath.Join(dir, fmt.Sprintf("rank-%d", r), stateFileName(step))
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		out[p] = b
	}
	return out
}

// TestRankChangeIncomplete: the old group's newest step is missing on one
// of its ranks (its state file, or its whole checkpoint): the new group
// resumes from the newest step every old rank holds, and rank 0 names the
// missing file; with no step held by every old rank, every new rank
// refuses, naming the files, and nothing is written.
func TestRankChangeIncomplete(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	resumeAll(t, ctx, 4, dir, resumeConfig{hidden: 16, steps: 5, build: onebitAdam})
	lost := filepath.Join(dir, "rank-2", stateFileName(5))
	require.NoError(t, os.Remove(lost))
	runs := resumeAll(t, ctx, 3, dir, resumeConfig{hidden: 16, steps: 1, build: onebitAdam})
	for r, run := range runs {
		assert.Equal(t, int64(4), run.start, "rank %d", r)
	}
	ws := runs[0].opt.Warnings()
	require.Len(t, ws, 3)
	assert.Contains(t, ws[0], "resumed on 3 ranks from the checkpoint of global step 4 made on 4 ranks")
	assert.Contains(t, ws[1], lost+" is missing")
	assert.Contains(t, ws[2], "rank 0 moved its checkpoints newer than global step 4")

	// A damaged state file of the newest step on one old rank only: the
	// step before.
	dir = t.TempDir()
	resumeAll(t, ctx, 4, dir, resumeConfig{hidden: 16, steps: 5, build: onebitAdam})
	damaged := filepath.Join(dir, "rank-1", stateFileName(5))
	b, err := os.ReadFile(damaged)
	require.NoError(t, err)
	b[len(b)-3] ^= 0xff
	require.NoError(t, os.WriteFile(damaged, b, 0o600))
	runs = resumeAll(t, ctx, 3, dir, resumeConfig{hidden: 16, steps: 1, build: onebitAdam})
	for r, run := range runs {
		assert.Equal(t, int64(4), run.start, "rank %d", r)
	}
	ws = runs[0].opt.Warnings()
	require.NotEmpty(t, ws)
	assert.Contains(t, ws[0], "resumed on 3 ranks from the checkpoint of global step 4 made on 4 ranks")
	assert.Contains(t, strings.Join(ws, "\n"), damaged)

	// No step every old rank holds: rank 3's checkpoints are all gone.
	dir = t.TempDir()
	resumeAll(t, ctx, 4, dir, resumeConfig{hidden: 16, steps: 5, build: onebitAdam})
	require.NoError(t, os.RemoveAll(filepath.Join(dir, "rank-3")))
	files := snapshot(t, dir)
	requireResumeRefused(t, ctx, 5, dir, resumeConfig{hidden: 16, steps: 1, build: onebitAdam},
		"no checkpoint of a global step that every rank holds", filepath.Join(dir, "rank-3")+" holds no whole GoMLX checkpoint of it")
	assert.Equal(t, files, snapshot(t, dir), "the checkpoints changed")
}

// TestRankChangeTwoRuns: state files of another run (another optimizer)
// in one old rank's directory make no group with the others': a resume
// on another number of ranks refuses them rather than mixing two runs.
func TestRankChangeTwoRuns(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir, other := t.TempDir(), t.TempDir()
	for _, d := range []struct {
		dir   string
		build Builder
	}{{dir, onebitAdam}, {other, withLambFreeze(3)}} {
		resumeAll(t, ctx, 2, d.dir, resumeConfig{hidden: 16, steps: 5, build: d.build})
	}
	for _, s := range []int64{4, 5} {
		require.NoError(t, os.Rename(filepath.Join(other, "rank-1", stateFileName(s)), filepath.Join(dir, "rank-1", stateFileName(s))))
	}
	requireResumeRefused(t, ctx, 3, dir, resumeConfig{hidden: 16, steps: 1, build: onebitAdam}, "not one group's")
}

// TestPeekState: peekState reads what optim.SaveFile wrote (the format's
// start), and refuses what is no state file.
func TestPeekState(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "s.ckpt")
	ck := &optim.Checkpoint{Algorithm: "onebit-adam", World: 5, Rank: 3, Ints: map[string]int64{"x": 1}}
	ck.AddTensor("param/w", []int{2}, []float32{1, 2})
	require.NoError(t, optim.SaveFile(p, ck))
	h, err := peekState(p)
	require.NoError(t, err)
	assert.Equal(t, stateHeader{algorithm: "onebit-adam", world: 5, rank: 3}, h)
	require.NoError(t, os.WriteFile(p, []byte("not a state file at all, really"), 0o600))
	_, err = peekState(p)
	assert.ErrorIs(t, err, optim.ErrCorruptCheckpoint)
	_, err = peekState(filepath.Join(dir, "none"))
	assert.ErrorContains(t, err, "is missing")
}

// TestRankPrefix: the prefix of a rank's directory, only where it ends in
// the rank.
func TestRankPrefix(t *testing.T) {
	assert.Equal(t, "ck/run-rank-", rankPrefix("ck/run-rank-3", 3))
	assert.Equal(t, "ck/rank-", rankPrefix("ck/rank-10/", 10))
	assert.Equal(t, "", rankPrefix("ck/rank-10", 0))
	assert.Equal(t, "", rankPrefix("ck/rank-3", 2))
	assert.Equal(t, "", rankPrefix("3", 3))
}

// TestCheckCarried: the check of a carried state takes onebit.Regroup's
// worker errors (their padding aside) and 1-bit Muon's momenta, and
// refuses a state whose mean is not the saved one.
func TestCheckCarried(t *testing.T) {
	old := make([]*optim.Checkpoint, 2)
	for r := range old {
		old[r] = &optim.Checkpoint{Algorithm: onebit.AlgorithmMuon, World: 2, Rank: r}
		we := make([]float32, onebit.PaddedLen(20, 2))
		mom := make([]float32, 6)
		for i := range 20 {
			we[i] = float32(i*(r+1)) / 7
		}
		for i := range mom {
			mom[i] = float32(i-r) / 3
		}
		we[len(we)-1] = 5 // old padding need not be zero
		old[r].AddTensor(optim.WorkerErrorName+"/w", []int{len(we)}, we)
		old[r].AddTensor(optim.MomentumBufferPrefix+"w", []int{2, 3}, mom)
	}
	ck, err := onebit.Regroup(old, 3, 1)
	if err != nil {
		// The synthetic checkpoints lack what Regroup needs: make the
		// regrouped state by hand, as Regroup documents it.
		ck = &optim.Checkpoint{Algorithm: onebit.AlgorithmMuon, World: 3, Rank: 1}
		we := make([]float32, onebit.PaddedLen(20, 3))
		for i := range 20 {
			we[i] = float32((float64(old[0].Tensors[0].Data[i]) + float64(old[1].Tensors[0].Data[i])) / 2)
		}
		mom := make([]float32, 6)
		for i := range mom {
			mom[i] = float32((float64(old[0].Tensors[1].Data[i]) + float64(old[1].Tensors[1].Data[i])) / 2)
		}
		ck.AddTensor(optim.WorkerErrorName+"/w", []int{len(we)}, we)
		ck.AddTensor(optim.MomentumBufferPrefix+"w", []int{2, 3}, mom)
	}
	got, err := checkCarried(old, ck, 3)
	require.NoError(t, err)
	assert.Contains(t, got, "the mean of 2 buffers (worker errors, momenta, 26 elements) equals the saved mean")
	for _, name := range []string{optim.WorkerErrorName + "/w", optim.MomentumBufferPrefix + "w"} {
		bad := ck.Clone()
		bad.Tensor(name).Data[3] += 0.5
		_, err = checkCarried(old, bad, 3)
		assert.ErrorContains(t, err, name+": the carried mean is", name)
	}
	// A buffer zeroed past the padding is no carried mean either.
	bad := ck.Clone()
	clear(bad.Tensor(optim.WorkerErrorName + "/w").Data)
	_, err = checkCarried(old, bad, 3)
	assert.ErrorContains(t, err, "is zero, old rank")
}

// TestRankChangeSameRunOnly: the states of two runs of one optimizer on
// as many ranks, at the same step (one old rank's state files from
// another run, whose parameters differ), are refused on a resume on
// another number of ranks, naming both files.
func TestRankChangeSameRunOnly(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 5, build: onebitAdam})
	for _, s := range []int64{4, 5} {
		path := filepath.Join(dir, "rank-1", stateFileName(s))
		ck, err := optim.LoadFile(path)
		require.NoError(t, err)
		require.True(t, strings.HasPrefix(ck.Tensors[0].Name, optim.ParamTensorName("")))
		ck.Tensors[0].Data[0] += 1 // another run's parameters
		require.NoError(t, optim.SaveFile(path, ck))
	}
	requireResumeRefused(t, ctx, 3, dir, resumeConfig{hidden: 16, steps: 1, build: onebitAdam},
		"states of two runs?", filepath.Join(dir, "rank-1", stateFileName(5)))
}
