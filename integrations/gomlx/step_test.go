package gomlx

import (
	"context"
	"testing"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestStepBookkeeping: the hook's Step keeps no state of its own beyond
// the lowbit optimizer's Stats and GoMLX's global step. It adds one to the
// global step in place (the variable keeps its tensor: no new tensor per
// step), and a Save with nothing trained since writes nothing while a Save
// after a step writes a checkpoint (the count of steps is the lowbit
// optimizer's Stats.Steps). It logs Step's allocations.
func TestStepBookkeeping(t *testing.T) {
	backend, err := gobackend.New("")
	require.NoError(t, err)
	opt, err := New(context.Background(), nil, adam, WithManualStep())
	require.NoError(t, err)
	defer opt.Close()
	store := newStore(1)
	h, err := checkpoint.Build(store).Dir(t.TempDir()).Keep(10).Done()
	require.NoError(t, err)
	trainer := train.NewTrainer(backend, store, mlp(4), loss.MeanSquaredError, opt, nil, nil)
	x, y := regression(0, rows)
	m, err := trainer.TrainStep(train.Batch{Inputs: []*tensors.Tensor{x}, Labels: []*tensors.Tensor{y}})
	require.NoError(t, err)
	l := float64(tensors.ToScalar[float32](m[0]))
	gs, err := optimizer.GetGlobalStepVar(store).Value()
	require.NoError(t, err)
	for s := int64(1); s <= 3; s++ {
		require.NoError(t, opt.Step(l))
		now, err := optimizer.GetGlobalStepVar(store).Value()
		require.NoError(t, err)
		require.Same(t, gs, now, "step %d: the global step's tensor", s)
		require.Equal(t, s, tensors.ToScalar[int64](now), "global step")
	}
	saves := func() int {
		list, err := h.ListCheckpoints()
		require.NoError(t, err)
		return len(list)
	}
	require.NoError(t, opt.Save(h))
	require.NoError(t, opt.Save(h))
	assert.Equal(t, 1, saves(), "a second Save with nothing trained since")
	require.NoError(t, opt.Step(l))
	require.NoError(t, opt.Save(h))
	assert.Equal(t, 2, saves(), "a Save after a step")
	t.Logf("allocations per Step: %v", testing.AllocsPerRun(20, func() { _ = opt.Step(l) }))
}
