package gomlx

import (
	"context"
	"testing"
	"time"

	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// The checks that read the lowbit optimizer's state see through the outer
// optimizer, which records its inner optimizer's learning rate, schedule
// and counters under outer.InnerPrefix (its SetLR, SetSchedule and LR are
// the inner optimizer's).

// TestOuterLearningRateConflict: a lowbit schedule on the outer optimizer
// (its inner Adam's) together with GoMLX's learning rate is refused at the
// first step on every rank, as it is for any other optimizer, instead of
// training at GoMLX's learning rate with the schedule dropped.
func TestOuterLearningRateConflict(t *testing.T) {
	scheduled := func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		cfg := outer.DefaultConfig()
		cfg.H = 4
		o, err := outer.NewAdam(ctx, c, p, cfg, optim.DefaultAdamConfig())
		if err != nil {
			return nil, err
		}
		s, err := optim.CosineDecay(0.01, 0.001, 100)
		if err == nil {
			err = o.SetSchedule(s)
		}
		return o, err
	}
	runs := runSpecs(t, 2, 3, func(int) rankSpec {
		return rankSpec{build: scheduled, params: map[string]any{optimizer.ParamLearningRate: 0.05}}
	})
	for r, run := range runs {
		require.Error(t, run.err, "rank %d", r)
		assert.Contains(t, run.err.Error(), "lbgomlx: the store sets GoMLX's learning rate (learning_rate = 0.05) and the lowbit optimizer has a schedule", "rank %d", r)
		assert.Empty(t, run.losses, "rank %d", r)
	}
}

// TestOuterResumeLRWarning: a resume of the outer optimizer whose
// checkpoint's (inner) learning rate, 0.01, replaces the config's, 0.02,
// warns on rank 0, as it does for any other optimizer.
func TestOuterResumeLRWarning(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	require.NoError(t, local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		return resumeRank(t, ctx, c, dir, resumeConfig{hidden: 16, steps: 4, build: builderLR("outer", 0.01)}).err
	}))
	var runs [2]*resumeRun
	require.NoError(t, local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		runs[c.Rank()] = resumeRank(t, ctx, c, dir, resumeConfig{hidden: 16, steps: 1, build: builderLR("outer", 0.02)})
		return runs[c.Rank()].err
	}))
	require.True(t, runs[0].opt.Restored())
	w := runs[0].opt.Warnings()
	require.Len(t, w, 1, "%q", w)
	assert.Contains(t, w[0], "resumed at global step 4 with the checkpoint's learning rate 0.01 instead of the optimizer's 0.02 (its config's LR)")
	assert.Empty(t, runs[1].opt.Warnings(), "rank 1 repeats rank 0's warnings")
	assert.Equal(t, float32(0.01), runs[0].opt.Optimizer().(optim.LRSetter).LR(), "Load restored the checkpoint's")
}
