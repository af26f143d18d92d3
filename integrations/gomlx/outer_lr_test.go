package gomlx

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/optim"
)

// TestOuterResumeLRWarning: a resume of the outer optimizer whose
// checkpoint's learning rate, 0.01, replaces the config's, 0.02, warns on
// rank 0, as it does for any other optimizer: the check reads it where
// the outer optimizer records it, its inner optimizer's under
// outer.InnerPrefix.
func TestOuterResumeLRWarning(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 4, build: builderLR("outer", 0.01)})
	runs := resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 1, build: builderLR("outer", 0.02)})
	require.True(t, runs[0].opt.Restored())
	w := runs[0].opt.Warnings()
	require.Len(t, w, 1, "%q", w)
	assert.Contains(t, w[0], "resumed at global step 4 with the checkpoint's learning rate 0.01 instead of the optimizer's 0.02 (its config's LR)")
	assert.Empty(t, runs[1].opt.Warnings(), "rank 1 repeats rank 0's warnings")
	assert.Equal(t, float32(0.01), runs[0].opt.Optimizer().(optim.LRSetter).LR(), "Load restored the checkpoint's")
}
