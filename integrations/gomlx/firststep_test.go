package gomlx

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// TestFirstStepAgreement: ranks that differ in what decides training are
// refused at the first step, on every rank, before any variable changes,
// with an error naming each rank's value; before, they trained on apart
// (a 10x learning rate on one rank ended with different parameters on
// the ranks, with exact Adam too).
func TestFirstStepAgreement(t *testing.T) {
	for _, tc := range []struct {
		name string
		w    int
		spec func(rank int) rankSpec
		want string
	}{
		{"adam: 10x the learning rate on rank 1", 2, func(r int) rankSpec {
			return rankSpec{build: builderLR("adam", map[bool]float32{false: 0.01, true: 0.1}[r == 1])}
		}, "learning rate: 0.01 on rank 0 and 0.1 on rank 1"},
		{"onebit-adam: 10x the learning rate on rank 2 of 4", 4, func(r int) rankSpec {
			return rankSpec{build: builderLR("onebit-adam", map[bool]float32{false: 0.01, true: 0.1}[r == 2])}
		}, "learning rate: 0.01 on ranks 0, 1, 3 and 0.1 on rank 2"},
		{"onebit-adam: 10x GoMLX's learning rate on rank 1", 2, func(r int) rankSpec {
			return rankSpec{build: builderLR("onebit-adam", 0.01),
				params: map[string]any{optimizer.ParamLearningRate: map[bool]float64{false: 0.01, true: 0.1}[r == 1]}}
		}, "learning rate: 0.01 on rank 0 and 0.1 on rank 1"},
		{"onebit-adam: another beta2 and freeze step on rank 1", 2, func(r int) rankSpec {
			return rankSpec{build: func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
				cfg := onebit.DefaultAdamConfig()
				if r == 1 {
					cfg.Beta2, cfg.FreezeStep = 0.99, 50
				}
				return onebit.NewAdam(ctx, c, p, cfg)
			}}
		}, "hyper/beta2: 0.999 on rank 0 and 0.99 on rank 1; hyper/freeze_step: 100 on rank 0 and 50 on rank 1"},
		{"another optimizer on rank 1", 2, func(r int) rankSpec {
			return rankSpec{build: map[bool]Builder{false: adam, true: lamb}[r == 1]}
		}, "lowbit optimizer: adam on 2 ranks on rank 0 and lamb on 2 ranks on rank 1"},
		{"WithMeanMetrics on rank 0 only", 2, func(r int) rankSpec {
			s := rankSpec{build: adam}
			if r == 0 {
				s.opts = []Option{WithMeanMetrics()}
			}
			return s
		}, "WithMeanMetrics: true on rank 0 and false on rank 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runs := runSpecs(t, tc.w, 4, tc.spec)
			for r, run := range runs {
				require.Error(t, run.err, "rank %d", r)
				assert.Contains(t, run.err.Error(), "lbgomlx: the ranks disagree on what decides training, so none trains: ", "rank %d", r)
				assert.Contains(t, run.err.Error(), tc.want, "rank %d", r)
				assert.Empty(t, run.losses, "rank %d: a step ran", r)
				assert.Nil(t, run.opt.Optimizer(), "rank %d: the optimizer was kept", r)
			}
		})
	}
}

// TestFirstStepAgreementCheckpoint: a resume in which only rank 0 holds
// the lowbit state of the step both ranks' models are at (rank 1's state
// files lost) fails at the first step on every rank with an error naming
// each rank's state, and changes no file. Before, exact Adam trained on
// from a restored state on rank 0 and a fresh one on rank 1, and 1-bit
// Adam failed with "rank 1 called allreduce (bytes=false) while rank 0
// called allgather (bytes=true)". A rank whose restored parameters differ
// from the others' (its state file from another run, or changed) fails
// the same way, naming the variable.
func TestFirstStepAgreementCheckpoint(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, tc := range []struct {
		name  string
		build Builder
	}{{"adam", adam}, {"onebit-adam", withFreeze(2)}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 4, build: tc.build})
			state1 := filepath.Join(dir, "rank-1", stateFileName(4))
			saved, err := os.ReadFile(state1)
			require.NoError(t, err)

			lost, err := filepath.Glob(filepath.Join(dir, "rank-1", StateFilePrefix+"*"))
			require.NoError(t, err)
			require.Len(t, lost, 2, "Keep(2)")
			for _, f := range lost {
				require.NoError(t, os.Remove(f))
			}
			files := snapshot(t, dir)
			rc := resumeConfig{hidden: 16, steps: 2, build: tc.build}
			runs := requireResumeRefused(t, ctx, 2, dir, rc, "lowbit state: restored from its checkpoint of global step 4 on rank 0 and "+
				"none restored (the lowbit optimizer starts afresh) on rank 1. To fix: a rank whose checkpoint directory holds no lowbit state")
			assertOptimizerDropped(t, runs)
			for r, run := range runs {
				assert.NotContains(t, run.err.Error(), "called allreduce", "rank %d", r)
			}
			assert.Equal(t, files, snapshot(t, dir), "a file changed")

			// Rank 1's state, with one parameter changed.
			require.NoError(t, os.WriteFile(state1, saved, 0o600))
			ck, err := optim.LoadFile(state1)
			require.NoError(t, err)
			changed := false
			for _, tn := range ck.Tensors {
				if tn.Name == optim.ParamTensorName("/out/dense/biases") {
					tn.Data[0] += 1
					changed = true
				}
			}
			require.True(t, changed, "no parameter /out/dense/biases in %v", tensorNames(ck))
			require.NoError(t, optim.SaveFile(state1, ck))
			files = snapshot(t, dir)
			assertOptimizerDropped(t, requireResumeRefused(t, ctx, 2, dir, rc,
				`lbgomlx: the ranks' trainable variables hold different values, so none trains: "/out/dense/biases" differs between rank 0 (hash `,
				"after each rank restored its own checkpoint"))
			assert.Equal(t, files, snapshot(t, dir), "a file changed")
		})
	}
}

func tensorNames(ck *optim.Checkpoint) []string {
	var out []string
	for _, tn := range ck.Tensors {
		out = append(out, tn.Name)
	}
	return out
}
