package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// tableRows returns the optimizers of the main table's rows in out.
func tableRows(out string) []string {
	var rows []string
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) > 2 && (f[0] == "adam" || f[0] == "onebit-adam") && strings.HasSuffix(f[1], "%") {
			rows = append(rows, f[0])
		}
	}
	return rows
}

// runCommand runs the test binary as the mnist command with args and env
// and returns its output and how it ended.
func runCommand(t *testing.T, args []string, env ...string) (string, error) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(append(os.Environ(), asCommandEnv+"=1"), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// requireKilled checks that a command ended by SIGKILL.
func requireKilled(t *testing.T, out string, err error) {
	t.Helper()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "the run must be killed, got %v:\n%s", err, out)
	ws, ok := exit.Sys().(syscall.WaitStatus)
	require.True(t, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL, "killed by SIGKILL: %v\n%s", err, out)
}

// TestResumeCompare interrupts a -compare run (adam, then onebit-adam)
// during its first optimizer, resumes it and interrupts the resumed run
// during the second, then resumes again: the first is resumed where it
// was interrupted and its result kept once it finished, the second
// resumed in turn, and the last resume prints the whole table, both rows,
// with the final parameters of an uninterrupted run. Once with SIGKILL
// right after step 12's checkpoint (-kill-at), once with SIGTERM after
// step 10 (the preemption hook), in a directory that holds a finished
// run's checkpoints and results: the interrupted run starts afresh, so
// those results must not be taken for its own.
func TestResumeCompare(t *testing.T) {
	args := []string{
		"-data", "testdata", "-workers", "2", "-epochs", "2", "-batch", "50", "-compare", "-optimizer", "onebit-adam",
		"-freeze-step", "4", "-lr", "2e-3", "-evals", "2", "-checkpoint-every", "4", "-quiet",
	}
	var whole bytes.Buffer
	require.NoError(t, run(context.Background(), append(args, "-checkpoint", t.TempDir()), &whole, &bytes.Buffer{}))
	want := finalHashes(t, whole.String())
	require.Len(t, want, 2)

	for _, c := range []struct {
		name  string
		flags []string // of the interrupted runs
		env   []string
		at    string
		dirty bool // the directory holds a finished run
		check func(t *testing.T, name string, out string, err error)
	}{
		{"kill", []string{"-kill-at", "12"}, nil, "12", false, func(t *testing.T, name string, out string, err error) {
			requireKilled(t, out, err)
		}},
		{"term", nil, []string{termAtEnv + "=10"}, "10", true, func(t *testing.T, name string, out string, err error) {
			require.NoError(t, err, "a preempted run exits 0:\n%s", out)
			assert.Contains(t, out, name+" preempted at step 10 of 20")
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			ckArgs := append(append([]string{}, args...), "-checkpoint", dir)
			if c.dirty {
				require.NoError(t, run(context.Background(), ckArgs, &bytes.Buffer{}, &bytes.Buffer{}))
				require.FileExists(t, filepath.Join(dir, "onebit-adam.result"))
			}
			// Interrupted during adam.
			out, err := runCommand(t, append(ckArgs, c.flags...), c.env...)
			c.check(t, "adam", out, err)
			assert.NoFileExists(t, filepath.Join(dir, "adam.result"), "a run that starts adam afresh removes its old result")
			assert.NotContains(t, out, "final parameters")

			// Resumed: adam continues where it stopped and finishes, then
			// onebit-adam starts and is interrupted in turn.
			out, err = runCommand(t, append(append(ckArgs, "-resume"), c.flags...), c.env...)
			c.check(t, "onebit-adam", out, err)
			assert.Contains(t, out, "mnist: -resume: adam continues from step "+c.at+" of 20")
			assert.NotContains(t, out, "no checkpoint")
			assert.FileExists(t, filepath.Join(dir, "adam.result"), "adam's result is kept once it finished")
			assert.NoFileExists(t, filepath.Join(dir, "onebit-adam.result"))

			// Resumed again: adam's row is the one kept, onebit-adam
			// resumes, the table has both.
			var resumed, warns bytes.Buffer
			require.NoError(t, run(context.Background(), append(ckArgs, "-resume"), &resumed, &warns), warns.String())
			assert.Contains(t, warns.String(), "mnist: -resume: adam had finished: its result is kept from "+filepath.Join(dir, "adam.result"))
			assert.Contains(t, warns.String(), "mnist: -resume: onebit-adam continues from step "+c.at+" of 20")
			assert.NotContains(t, warns.String(), "adam continues from step 20")
			assert.Equal(t, []string{"adam", "onebit-adam"}, tableRows(resumed.String()), resumed.String())
			assert.Contains(t, resumed.String(), "onebit-adam vs adam:")
			assert.Contains(t, resumed.String(), "\nadam resumed from step "+c.at+" of 20\n", "adam's row is that of the run that finished it")
			assert.Contains(t, resumed.String(), "\nonebit-adam resumed from step "+c.at+" of 20\n")
			assert.Equal(t, want, finalHashes(t, resumed.String()), "both end bit-identical to the uninterrupted run")
		})
	}

	// Interrupted between the end of adam and the first checkpoint of
	// onebit-adam: the resume starts onebit-adam from step 0.
	t.Run("before the second's first save", func(t *testing.T) {
		dir := t.TempDir()
		ckArgs := append(append([]string{}, args...), "-checkpoint", dir)
		require.NoError(t, run(context.Background(), ckArgs, &bytes.Buffer{}, &bytes.Buffer{}))
		files, err := filepath.Glob(filepath.Join(dir, "onebit-adam.*"))
		require.NoError(t, err)
		require.NotEmpty(t, files)
		for _, f := range files {
			require.NoError(t, os.Remove(f))
		}
		var resumed, warns bytes.Buffer
		require.NoError(t, run(context.Background(), append(ckArgs, "-resume"), &resumed, &warns), warns.String())
		assert.Contains(t, warns.String(), "mnist: -resume: onebit-adam had not saved a checkpoint: it starts from step 0")
		assert.Equal(t, []string{"adam", "onebit-adam"}, tableRows(resumed.String()))
		assert.Equal(t, want, finalHashes(t, resumed.String()))
	})

	// A single optimizer resumed from an empty directory is still an
	// error: the first optimizer of a run must have saved something.
	t.Run("nothing saved", func(t *testing.T) {
		dir := t.TempDir()
		err := run(context.Background(), append(append([]string{}, args...), "-checkpoint", dir, "-resume"), &bytes.Buffer{}, &bytes.Buffer{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "no checkpoint of adam in "+dir+" that every rank holds")
	})
}
