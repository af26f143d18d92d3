package gomlx

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

// TestNewConfigError: an invalid optimizer config is refused by New, with
// the config's own error, instead of at the first TrainStep; a builder
// that needs the real communicator, or fails over the probe parameter
// for another reason than its config, is left to the first step.
func TestNewConfigError(t *testing.T) {
	for _, tc := range []struct {
		name  string
		build Builder
		want  string
	}{
		{"adam LR -1", func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			cfg := optim.DefaultAdamConfig()
			cfg.LR = -1
			return optim.NewAdam(ctx, c, p, cfg)
		}, "lbgomlx: New: the optimizer's config: optim: AdamConfig.LR = -1: want finite and >= 0"},
		{"onebit-adam FreezeStep -1", func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			cfg := onebit.DefaultAdamConfig()
			cfg.FreezeStep = -1
			return onebit.NewAdam(ctx, c, p, cfg)
		}, "onebit: AdamConfig.FreezeStep = -1"},
		{"zero-adam Beta1 1", func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			cfg := zero.DefaultConfig()
			cfg.Beta1 = 1
			return zero.NewAdam(ctx, c, p, cfg)
		}, "Beta1 = 1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opt, err := New(context.Background(), nil, tc.build)
			require.Error(t, err)
			assert.Nil(t, opt)
			assert.Contains(t, err.Error(), tc.want)
			var ce *optim.ConfigError
			assert.ErrorAs(t, err, &ce)
		})
	}
	// Builders New cannot judge alone: they pass.
	for name, build := range map[string]Builder{
		"uses the communicator": func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			cfg := optim.DefaultAdamConfig()
			cfg.LR *= float32(c.Size())
			return optim.NewAdam(ctx, c, p, cfg)
		},
		"names a variable": func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			cfg := onebit.DefaultAdamConfig()
			cfg.ExpAvgMask = map[string][]float32{"/out/dense/biases": {1}}
			return onebit.NewAdam(ctx, c, p, cfg)
		},
	} {
		_, err := New(context.Background(), nil, build)
		assert.NoError(t, err, name)
	}
	runs := runSpecs(t, 2, 2, func(int) rankSpec {
		return rankSpec{build: func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
			cfg := optim.DefaultAdamConfig()
			cfg.LR *= float32(c.Size())
			return optim.NewAdam(ctx, c, p, cfg)
		}}
	})
	for r, run := range runs {
		assert.NoError(t, run.err, "rank %d", r)
	}
}

// TestSaveBeforeFirstStep: Save before the first step of this process
// works as GoMLX's Handler.Save does. A fresh start saves the variables
// and no lowbit state; a resumed run saves the loaded model again with its
// lowbit state (in the Handler's directory already, or copied into
// another Handler's), and a run resumed from either continues
// bit-identically to one never stopped. Before, Save failed: "Save before
// the first training graph was built".
func TestSaveBeforeFirstStep(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir, other := t.TempDir(), t.TempDir()
	rankDir := func(base string, r int) string { return filepath.Join(base, fmt.Sprintf("rank-%d", r)) }
	// run trains steps on 2 ranks from what base holds, saving with
	// Optimizer.Save before the first step (to saveTo's directory) and at
	// the end; it returns each rank's variables and whether it restored.
	run := func(base, saveTo string, steps int) (finals [2]map[string][]byte, restored [2]bool) {
		require.NoError(t, local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
			r := c.Rank()
			backend, err := gobackend.New("")
			require.NoError(t, err)
			defer backend.Finalize()
			store := newStore(int64(50 + r))
			opt, err := New(ctx, c, withFreeze(2))
			require.NoError(t, err)
			defer opt.Close()
			h, err := opt.Checkpoint(checkpoint.Build(store).Keep(3), rankDir(base, r))
			require.NoError(t, err)
			trainer := train.NewTrainer(backend, store, mlp(16), loss.MeanSquaredError, opt, nil, nil)
			loop := train.NewLoop(trainer)
			opt.AttachToLoop(loop)
			first := h
			if saveTo != base {
				first, err = checkpoint.Build(store).Dir(rankDir(saveTo, r)).Done()
				require.NoError(t, err)
			}
			require.NoError(t, opt.Save(first), "rank %d: Save before the first step", r)
			if _, err := loop.RunSteps(&shard{rank: r, world: 2}, steps); err != nil {
				return err
			}
			require.NoError(t, opt.Save(h))
			finals[r], restored[r] = variables(t, store), opt.Restored()
			return nil
		}))
		return finals, restored
	}
	alone := t.TempDir()
	straight, _ := run(alone, alone, 6)

	fresh, restored := run(dir, dir, 3)
	assert.Equal(t, [2]bool{false, false}, restored)
	assert.NotEqual(t, straight, fresh)
	for r := range 2 {
		// The fresh start's save before the first step: GoMLX's files, no
		// lowbit state; then step 3's checkpoint with its state.
		held, err := listCheckpoints(rankDir(dir, r))
		require.NoError(t, err)
		assert.Equal(t, []int64{0, 3}, heldSteps(held), "rank %d", r)
		steps, err := stateSteps(rankDir(dir, r))
		require.NoError(t, err)
		assert.Equal(t, []int64{3}, steps, "rank %d", r)
	}

	// Resumed: Save before the first step, into the same directory, and
	// into another one (the lowbit state is copied).
	resumed, restored := run(dir, other, 3)
	assert.Equal(t, [2]bool{true, true}, restored)
	assert.Equal(t, straight, resumed, "resumed from step 3 after a Save before the first step")
	for r := range 2 {
		steps, err := stateSteps(rankDir(other, r))
		require.NoError(t, err)
		assert.Equal(t, []int64{3}, steps, "rank %d: the loaded lowbit state saved with the model", r)
	}
	fromOther, restored := run(other, other, 3)
	assert.Equal(t, [2]bool{true, true}, restored)
	assert.Equal(t, straight, fromOther, "resumed from the checkpoint saved before the first step")
}

// TestWarnings: what a user must know although training goes on reaches
// them without a logger, through Warnings and WithWarnings: the
// checkpoint's learning rate replacing the config's on resume, error
// feedback reset (the change of ranks recipe of docs/gomlx.md: 2 ranks' 1-bit
// Adam in compression resumed on 3, every new rank from rank 0's files
// with optim.Checkpoint.ResetErrors), GoMLX optimizer settings of the
// store that the lowbit optimizer does not use. Before, they went to the
// lowbit optimizer's logger (a no-op unless its constructor was given
// one) or to WithLogger's.
func TestWarnings(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	rankDir := func(r int) string { return filepath.Join(dir, fmt.Sprintf("rank-%d", r)) }
	// run trains steps on w ranks with build from dir, saving every step,
	// and returns each rank's warnings and what WithWarnings wrote.
	run := func(w, steps int, build Builder, params map[string]any) (warnings [][]string, out []string) {
		warnings, out = make([][]string, w), make([]string, w)
		require.NoError(t, local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
			r := c.Rank()
			backend, err := gobackend.New("")
			require.NoError(t, err)
			defer backend.Finalize()
			store := newStore(int64(r))
			for k, v := range params {
				store.RootScope().SetParam(k, v)
			}
			var buf bytes.Buffer
			opt, err := New(ctx, c, build, WithWarnings(&buf))
			require.NoError(t, err)
			defer opt.Close()
			h, err := opt.Checkpoint(checkpoint.Build(store).Keep(2), rankDir(r))
			require.NoError(t, err)
			trainer := train.NewTrainer(backend, store, mlp(16), loss.MeanSquaredError, opt, nil, nil)
			loop := train.NewLoop(trainer)
			opt.AttachToLoop(loop)
			train.EveryNSteps(loop, 1, "checkpoint", 100, opt.SaveOnStepFn(h))
			_, err = loop.RunSteps(&shard{rank: r, world: w}, steps)
			warnings[r], out[r] = opt.Warnings(), buf.String()
			return err
		}))
		return warnings, out
	}
	lines := func(ws []string) string {
		var b strings.Builder
		for _, w := range ws {
			b.WriteString("lbgomlx: warning: " + w + "\n")
		}
		return b.String()
	}

	warnings, _ := run(2, 4, builderLR("onebit-adam", 0.01), nil)
	assert.Equal(t, [][]string{nil, nil}, warnings, "a fresh start")

	warnings, out := run(2, 1, builderLR("onebit-adam", 0.02), map[string]any{optimizer.ParamAdamEpsilon: 1e-7})
	require.Len(t, warnings[0], 2, "%q", warnings[0])
	assert.Contains(t, warnings[0][0], "resumed at global step 4 with the checkpoint's learning rate 0.01 instead of the optimizer's 0.02 (its config's LR)")
	assert.Contains(t, warnings[0][0], "store.SetParam(optimizer.ParamLearningRate, lr)")
	assert.Contains(t, warnings[0][1], "the store sets GoMLX's optimizer parameter adam_epsilon = 1e-07, which the lowbit optimizer does not use: set Eps")
	assert.Equal(t, lines(warnings[0]), out[0])
	assert.Empty(t, warnings[1], "rank 1 repeats rank 0's warnings")

	// From 2 ranks to 3: every new rank starts from rank 0's checkpoint
	// directory, its lowbit state with the error buffers reset.
	old := rankDir(0) + ".old"
	require.NoError(t, os.Rename(rankDir(0), old))
	require.NoError(t, os.RemoveAll(rankDir(1)))
	steps, err := stateSteps(old)
	require.NoError(t, err)
	last := steps[len(steps)-1]
	for r := range 3 {
		require.NoError(t, os.CopyFS(rankDir(r), os.DirFS(old)))
		path := filepath.Join(rankDir(r), stateFileName(last))
		ck, err := optim.LoadFile(path)
		require.NoError(t, err)
		require.Equal(t, optim.StageCompression, ck.Stage)
		require.NoError(t, optim.SaveFile(path, ck.ResetErrors()))
	}
	warnings, out = run(3, 2, builderLR("onebit-adam", 0.01), nil)
	require.Len(t, warnings[0], 2, "%q", warnings[0])
	assert.Contains(t, warnings[0][0], "resumed at global step 5 from a checkpoint whose error buffers were reset (made on 2 ranks, by rank 0): the error feedback starts again from zero; "+
		"the parameters, moments and counters of the rank that made it are carried (onebit.Regroup of every old rank's state keeps the error feedback")
	assert.Contains(t, warnings[0][1], "adam_epsilon", "GoMLX's checkpoint restores the store's parameters")
	assert.Equal(t, lines(warnings[0]), out[0])
	for r := 1; r < 3; r++ {
		assert.Empty(t, warnings[r], "rank %d", r)
	}

	// From 3 ranks to 2 with onebit.Regroup (docs/gomlx.md's recipe that
	// keeps the error feedback): every new rank's newest lowbit state is
	// made from all 3 old ranks', and nothing warns of a reset.
	steps, err = stateSteps(rankDir(0))
	require.NoError(t, err)
	last = steps[len(steps)-1]
	olds := make([]*optim.Checkpoint, 3)
	for r := range olds {
		olds[r], err = optim.LoadFile(filepath.Join(rankDir(r), stateFileName(last)))
		require.NoError(t, err)
	}
	for r := range 2 {
		ck, err := onebit.Regroup(olds, 2, r)
		require.NoError(t, err)
		require.NoError(t, optim.SaveFile(filepath.Join(rankDir(r), stateFileName(last)), ck))
	}
	require.NoError(t, os.RemoveAll(rankDir(2)))
	warnings, _ = run(2, 2, builderLR("onebit-adam", 0.01), nil)
	for r := range 2 {
		for _, w := range warnings[r] {
			assert.NotContains(t, w, "reset", "rank %d", r)
		}
	}
}

// TestErrorsNameTheVariables: ranks whose models differ fail at the first
// step with an error that names each differing variable with its shape
// on each rank, behind GoMLX's wrapper and this package's prefix.
func TestErrorsNameTheVariables(t *testing.T) {
	runs := runLoopModel(t, func(r int) any { return mlp(8 + 8*r) }, nil)
	for r, run := range runs {
		require.Error(t, run.err, "rank %d", r)
		assert.Contains(t, run.err.Error(), `panicked: lbgomlx: the ranks have other trainable variables (every rank must build the same model): `+
			`/hidden/dense/weights is (Float32)[8, 8] on rank 0 and (Float32)[8, 16] on rank 1; `+
			`/hidden/dense/biases is (Float32)[8] on rank 0 and (Float32)[16] on rank 1`, "rank %d", r)
	}
	lists := []string{"/a (Float32)[2]\n/b (Float32)[3]\n", "/a (Float32)[2]\n/c (Float32)[4]\n", "/b (Float32)[3]\n/a (Float32)[2]\n"}
	assert.EqualError(t, varsError(lists), "lbgomlx: the ranks have other trainable variables (every rank must build the same model): "+
		"/b (Float32)[3] is on rank 0, not on rank 1; /c (Float32)[4] is on rank 1, not on rank 0; rank 2 holds the same variables in another order")
}

// TestMeanMetrics: with WithMeanMetrics, every hook after the
// Optimizer's, as GoMLX's progress bar, and the metrics RunSteps returns
// see each training metric's mean over the 3 ranks instead of the rank's
// own; without it, the rank's own.
func TestMeanMetrics(t *testing.T) {
	for _, mean := range []bool{true, false} {
		own := make([][][]float32, 3)  // rank, step, metric: before the Optimizer's hook
		seen := make([][][]float32, 3) // after it
		runs := runSpecs(t, 3, 4, func(r int) rankSpec {
			s := rankSpec{build: adam, hook: func(m *rankModel) {
				read := func(metrics []*tensors.Tensor) []float32 {
					out := make([]float32, len(metrics))
					for i, x := range metrics {
						out[i] = x.Value().(float32)
					}
					return out
				}
				m.loop.OnStep("own", HookPriority-1, func(_ *train.Loop, metrics []*tensors.Tensor) error {
					own[r] = append(own[r], read(metrics))
					return nil
				})
				m.loop.OnStep("progress bar", 1000, func(_ *train.Loop, metrics []*tensors.Tensor) error {
					seen[r] = append(seen[r], read(metrics))
					return nil
				})
			}}
			if mean {
				s.opts = []Option{WithMeanMetrics()}
			}
			return s
		})
		for r, run := range runs {
			require.NoError(t, run.err, "rank %d", r)
		}
		for s := range 4 {
			for i := range own[0][s] {
				want := (own[0][s][i] + own[1][s][i] + own[2][s][i]) / 3
				for r := range 3 {
					if mean {
						assert.InDelta(t, want, seen[r][s][i], 1e-6, "rank %d, step %d, metric %d", r, s+1, i)
					} else {
						assert.Equal(t, own[r][s][i], seen[r][s][i], "rank %d, step %d, metric %d", r, s+1, i)
					}
				}
			}
			assert.NotEqual(t, own[0][s][0], own[1][s][0], "step %d: the ranks' losses are equal: nothing to average", s+1)
		}
	}
}
