package main

import (
	"bytes"
	"context"
	"io"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/cliflag/flagtest"
)

// testdata is the real 500-example MNIST subset of lowbit's own example.
const testdata = "../../../../examples/mnist/testdata"

var rowRE = regexp.MustCompile(`(?m)^\s*(adam|onebit-adam)\s+([0-9.]+)%\s+([0-9.]+)\s`)

// TestRun trains the GoMLX model on 4 in-process ranks with Adam and 1-bit
// Adam and checks that both learn and that 1-bit Adam sends less.
func TestRun(t *testing.T) {
	var out, errOut bytes.Buffer
	err := run(context.Background(), []string{
		"-data", testdata, "-workers", "4", "-steps", "30", "-batch", "48", "-freeze-step", "10", "-lr", "2e-3",
	}, &out, &errOut)
	require.NoError(t, err, errOut.String())
	rows := rowRE.FindAllStringSubmatch(out.String(), -1)
	require.Len(t, rows, 2, out.String())
	for _, r := range rows {
		acc, err := strconv.ParseFloat(r[2], 64)
		require.NoError(t, err)
		assert.Greater(t, acc, 60.0, "%s learns: %s", r[1], out.String())
	}
	assert.Regexp(t, `onebit-adam vs adam: [0-9.]+x fewer bytes sent`, out.String())
}

func TestRunErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-optimizers", "sgd"}, `unknown optimizer "sgd"`},
		{[]string{"-backend", "tcp"}, `invalid value "tcp" for --backend`},
		{[]string{"-data", "no/such/dir"}, "make mnist-data"},
		{[]string{"-data", testdata, "-batch", "2", "-workers", "4"}, "must be between the 4 ranks"},
		{[]string{"-data", testdata, "-backend", "mpi"}, "-backend mpi"},
	} {
		err := run(context.Background(), c.args, &bytes.Buffer{}, &bytes.Buffer{})
		require.Error(t, err, "%v", c.args)
		assert.Contains(t, err.Error(), c.want, "%v", c.args)
	}
}

// TestRunCheckpoint: 20 steps straight and 10 + 10 resumed from the GoMLX
// checkpoints (with the lowbit state) reach the same test accuracy and
// sent bytes.
func TestRunCheckpoint(t *testing.T) {
	dir := t.TempDir()
	args := []string{"-data", testdata, "-workers", "2", "-batch", "32", "-freeze-step", "5", "-lr", "2e-3",
		"-optimizers", "onebit-adam", "-checkpoint-every", "10"}
	var out bytes.Buffer
	row := func(extra ...string) string {
		out.Reset()
		require.NoError(t, run(context.Background(), append(args, extra...), &out, &bytes.Buffer{}))
		m := regexp.MustCompile(`(?m)^\s*onebit-adam\s+([0-9.]+%)\s`).FindStringSubmatch(out.String())
		require.NotNil(t, m, out.String())
		return m[1]
	}
	whole := row("-steps", "20")
	row("-steps", "10", "-checkpoint", dir)
	assert.NotContains(t, out.String(), "resumed")
	assert.Equal(t, whole, row("-steps", "20", "-checkpoint", dir))
	// The resume says so, and from which step, at the default log level.
	assert.Contains(t, out.String(), "onebit-adam: resumed from global step 10 ("+dir+")")
}

// TestBadFlagValues gives every flag an empty, a negative, a huge and a
// misspelled value: one-line usage errors, no panic.
func TestBadFlagValues(t *testing.T) {
	flagtest.BadValues(t, func(args []string, stderr io.Writer) error {
		_, err := parseFlags(args, stderr)
		return err
	}, 12, "data", "checkpoint", "optimizers")
}

// TestCountFlags: -batch, a count of examples, takes counts as the field
// writes them where they are in its bounds (137k; 7B is refused as out of
// range) and refuses sizes in bytes (64MiB) with one line.
func TestCountFlags(t *testing.T) {
	flagtest.Options(t, parseFlags, map[string]flagtest.OptionCount[*options]{
		"batch": {Min: 1, Max: 1 << 20, Get: func(o *options) int64 { return int64(o.batch) }},
	})
}

// TestBadFlagExit: the binary prints one line for a bad value and exits 2.
func TestBadFlagExit(t *testing.T) {
	flagtest.Exit(t, "mnist", []string{"-batch", "12Q"}, []string{"-optimizers", "sgd"}, []string{"-nosuch"}, []string{"stray"})
}

// TestInprocessUnderMPI: started by mpirun (the environment says this
// process is one rank of a job of 2) without -backend mpi, the example
// refuses to run its in-process ranks, which would make every process of
// the job train on its own and write the same checkpoints, before it
// reads anything; -allow-inprocess-under-mpi goes on (to the bad -data).
func TestInprocessUnderMPI(t *testing.T) {
	for _, v := range comm.MPIEnvVars() {
		t.Setenv(v, "")
	}
	t.Setenv("OMPI_COMM_WORLD_SIZE", "2")
	args := []string{"-data", "no/such/dir"}
	err := run(context.Background(), args, io.Discard, io.Discard)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "-backend local: local: this process is one rank of an MPI job of 2 ranks (OMPI_COMM_WORLD_SIZE=2)")
	assert.Contains(t, err.Error(), "give -backend mpi (a binary built with -tags mpi), or -allow-inprocess-under-mpi")
	err = run(context.Background(), append(args, "-allow-inprocess-under-mpi"), io.Discard, io.Discard)
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "MPI job")
	assert.Contains(t, err.Error(), "make mnist-data")
}
