package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
)

// trainTo runs the program on n in-process ranks to global step to, from
// the checkpoints in ckpt, and returns what it printed.
func trainTo(t *testing.T, n, to int, ckpt string) string {
	t.Helper()
	*ranks, *steps, *dir, *progress = n, to, ckpt, false
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	stdout := os.Stdout
	os.Stdout = w
	printed := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		printed <- string(b)
	}()
	err = run(ctx)
	os.Stdout = stdout
	require.NoError(t, w.Close())
	out := <-printed
	require.NoError(t, r.Close())
	require.NoError(t, err)
	return out
}

// TestMinimal runs the README's program on 2 ranks: to step 90 (past
// 1-bit Adam's warm-up of 80), then from its checkpoints on to step 120 at
// once, and, from a copy of them, to 105 and then 120: the lowbit states
// saved at step 120 are byte-identical, rank by rank (the dataset restarts
// at the global step). The last Save adds no second checkpoint of a step
// EveryNSteps saved, and a run asked for a step the checkpoint is at
// already trains nothing and says so. A resumed run says from which step.
func TestMinimal(t *testing.T) {
	once, twice := t.TempDir(), t.TempDir()
	out := trainTo(t, 2, 90, once)
	assert.Regexp(t, `^global step 90: loss [0-9.]+ over 2 ranks\n$`, out, "a fresh start")
	require.NoError(t, os.CopyFS(twice, os.DirFS(once)))
	out = trainTo(t, 2, 120, once)
	assert.Regexp(t, `^resumed from global step 90 \(.*\)\nglobal step 120: loss [0-9.]+ over 2 ranks\n$`, out, "a resume says so")
	trainTo(t, 2, 105, twice)
	trainTo(t, 2, 120, twice)
	for r := range 2 {
		state := fmt.Sprintf("rank-%d/lowbit-state-step-00000120.ckpt", r)
		want, err := os.ReadFile(filepath.Join(once, state))
		require.NoError(t, err)
		got, err := os.ReadFile(filepath.Join(twice, state))
		require.NoError(t, err)
		assert.Equal(t, want, got, "rank %d: the lowbit state at step 120", r)
	}
	// Run again at or past -steps: it says it resumed and trains nothing.
	out = trainTo(t, 2, 100, once)
	assert.Equal(t, "resumed from global step 120 ("+once+")\nglobal step 120: nothing to train up to -steps 100; raise it to train on\n", out)
	trainTo(t, 2, 200, once)
	files, err := filepath.Glob(filepath.Join(once, "rank-0", "checkpoint-*.json"))
	require.NoError(t, err)
	require.Len(t, files, 2, "Keep(2)")
	assert.Contains(t, files[0], "-step-00000120.json", "Keep(2): steps 120 and 200, once each")
	assert.Contains(t, files[1], "-step-00000200.json")
}

// TestInprocessUnderMPI: started by mpirun (the environment says this
// process is one rank of a job of 2) without -mpi, the program refuses to
// run its in-process ranks, which would make every process of the job
// train on its own and write the same checkpoints.
func TestInprocessUnderMPI(t *testing.T) {
	for _, v := range comm.MPIEnvVars() {
		t.Setenv(v, "")
	}
	t.Setenv("OMPI_COMM_WORLD_SIZE", "2")
	*ranks, *steps, *dir, *progress = 2, 10, t.TempDir(), false
	err := run(context.Background())
	require.Error(t, err)
	assert.Contains(t, err.Error(), "local: this process is one rank of an MPI job of 2 ranks (OMPI_COMM_WORLD_SIZE=2)")
	assert.Contains(t, err.Error(), ": give -mpi")
	assert.NoDirExists(t, filepath.Join(*dir, "rank-0"), "nothing written")
}
