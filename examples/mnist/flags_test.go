package main

import (
	"bytes"
	"context"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/cliflag/flagtest"
)

// TestBadFlagValues gives every flag of the example an empty, a negative,
// a huge and a misspelled value: each is refused before anything runs with
// a one-line usage error, or accepted where the value is valid; nothing
// panics. Names of files and directories are checked when the run opens
// them.
func TestBadFlagValues(t *testing.T) {
	flagtest.BadValues(t, func(args []string, stderr io.Writer) error {
		_, err := parseFlags(args, stderr)
		return err
	}, 16, "plot", "data", "cpuprofile", "checkpoint")
}

// TestBadFlagExit: the binary prints one line for a bad value and exits 2.
func TestBadFlagExit(t *testing.T) {
	flagtest.Exit(t, "mnist", []string{"-batch", "64Q"}, []string{"-workers", "0"}, []string{"-backend", "tcp"},
		[]string{"-nosuch"}, []string{"stray"})
}

// TestCountFlags: -batch, a count of examples, takes counts as the field
// writes them where they are in its bounds (137k; 7B is refused as out of
// range) and refuses sizes in bytes (64MiB) with one line.
func TestCountFlags(t *testing.T) {
	flagtest.Options(t, parseFlags, map[string]flagtest.OptionCount[*options]{
		"batch": {Min: 1, Max: 1 << 20, Get: func(o *options) int64 { return int64(o.batch) }},
	})
}

// TestInprocessUnderMPI: started by mpirun (the environment says this
// process is one rank of a job of 2) without -backend mpi, the example
// refuses to run its in-process ranks, which would make every process of
// the job train on its own and write the same checkpoints, unless
// -allow-inprocess-under-mpi asks for them.
func TestInprocessUnderMPI(t *testing.T) {
	for _, v := range comm.MPIEnvVars() {
		t.Setenv(v, "")
	}
	t.Setenv("OMPI_COMM_WORLD_SIZE", "2")
	args := []string{"-data", "testdata", "-workers", "2", "-epochs", "1", "-batch", "100", "-evals", "1", "-quiet", "-optimizer", "adam"}
	err := run(context.Background(), args, io.Discard, io.Discard)
	require.Error(t, err)
	assert.Equal(t, "-backend local: local: this process is one rank of an MPI job of 2 ranks (OMPI_COMM_WORLD_SIZE=2), "+
		"and in-process ranks would make each of its 2 processes train a model of its own and write the same files as the others; "+
		"give -backend mpi (a binary built with -tags mpi), or -allow-inprocess-under-mpi to run in-process ranks anyway", err.Error())
	var out bytes.Buffer
	require.NoError(t, run(context.Background(), append(args, "-allow-inprocess-under-mpi"), &out, io.Discard))
	assert.Contains(t, out.String(), "adam")
}

// TestDilocoHAboveSteps: diloco with an -outer-h past the run's steps
// would exchange nothing and leave the global model the initial one: the
// example, which knows both, warns; it does not where an exchange merges.
func TestDilocoHAboveSteps(t *testing.T) {
	args := []string{"-data", "testdata", "-workers", "2", "-epochs", "1", "-batch", "100", "-evals", "1", "-quiet", "-optimizer", "diloco"}
	var errOut bytes.Buffer
	require.NoError(t, run(context.Background(), append(args, "-outer-h", "1000"), io.Discard, &errOut))
	assert.Contains(t, errOut.String(), "mnist: warning: diloco: the outer optimizer's first exchange merges at inner step 1000 (H 1000, 1 fragment(s), delay 0), after this run's ")
	assert.Contains(t, errOut.String(), "its global model stays the initial one")
	errOut.Reset()
	require.NoError(t, run(context.Background(), append(args, "-outer-h", "2"), io.Discard, &errOut))
	assert.NotContains(t, errOut.String(), "first exchange merges")
}

// TestSparseExchangeFlags: -outer-sparse-exchange takes each exchange's
// name into the outer config and refuses others naming the flag;
// -outer-sparse-bits takes 1 or 2.
func TestSparseExchangeFlags(t *testing.T) {
	for _, name := range []string{"allgather", "twophase", "shared", "Shared"} {
		o, err := parseFlags([]string{"-optimizer", "diloco", "-outer-sparse-exchange", name, "-outer-sparse-bits", "2"}, io.Discard)
		require.NoError(t, err, name)
		assert.Equal(t, strings.ToLower(name), o.outer.SparseExchange.String())
		assert.Equal(t, 2, o.outer.SparseBits)
	}
	_, err := parseFlags([]string{"-optimizer", "diloco", "-outer-sparse-exchange", "ring"}, io.Discard)
	require.Error(t, err)
	assert.ErrorContains(t, err, "outer-sparse-exchange")
	assert.ErrorContains(t, err, "allgather, twophase, shared")
	_, err = parseFlags([]string{"-optimizer", "diloco", "-outer-sparse-bits", "3"}, io.Discard)
	require.Error(t, err)
	assert.ErrorContains(t, err, "outer-sparse-bits")
}
