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
)

// TestLostStateFileNamed: a program that saves with Optimizer.Save, whose
// newest state file was lost, is told so: the error names the missing
// file, the older step whose state file is beside its model checkpoint,
// and what to do; it does not tell it to save with Optimizer.Save, which
// it did.
func TestLostStateFileNamed(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 4, build: adam})
	for r := range 2 {
		require.NoError(t, os.Remove(filepath.Join(dir, fmt.Sprintf("rank-%d", r), stateFileName(4))))
	}
	runs := requireResumeRefused(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 2, build: adam},
		"so the state file of step 4 was removed or lost after it was written",
		"or set the model's checkpoint of step 4 aside to resume from step 3")
	for r, run := range runs {
		rankDir := filepath.Join(dir, fmt.Sprintf("rank-%d", r))
		assert.Contains(t, run.err.Error(), "the checkpoint's lowbit state is from global step 3, its model from step 4: "+rankDir+" holds no lowbit-state-step-00000004", "rank %d", r)
		assert.NotContains(t, run.err.Error(), "not Handler.Save", "rank %d", r)
	}
}
