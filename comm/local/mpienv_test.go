package local_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// TestCheckNotUnderMPI: in-process ranks are refused in a rank of an MPI
// job of several ranks or of an unknown number, with the job named, and
// allowed outside one and in a one-rank job.
func TestCheckNotUnderMPI(t *testing.T) {
	for _, v := range comm.MPIEnvVars() {
		t.Setenv(v, "")
	}
	require.NoError(t, local.CheckNotUnderMPI(), "no launcher")
	t.Setenv("OMPI_COMM_WORLD_SIZE", "1")
	t.Setenv("PMIX_RANK", "0")
	require.NoError(t, local.CheckNotUnderMPI(), "mpirun -np 1")
	t.Setenv("OMPI_COMM_WORLD_SIZE", "4")
	err := local.CheckNotUnderMPI()
	require.Error(t, err)
	assert.Equal(t, "local: this process is one rank of an MPI job of 4 ranks (OMPI_COMM_WORLD_SIZE=4), "+
		"and in-process ranks would make each of its 4 processes train a model of its own and write the same files as the others", err.Error())
	t.Setenv("OMPI_COMM_WORLD_SIZE", "")
	err = local.CheckNotUnderMPI()
	require.Error(t, err)
	assert.Contains(t, err.Error(), "one rank of an MPI job (PMIX_RANK=0), and in-process ranks would make each of its processes train")
}

// TestNewRefusesUnderMPI: New and Run refuse in-process ranks in a rank of
// an MPI job of several ranks, saying how to insist, and AllowUnderMPI
// starts them there; outside a job and in a one-rank job they start.
func TestNewRefusesUnderMPI(t *testing.T) {
	for _, v := range comm.MPIEnvVars() {
		t.Setenv(v, "")
	}
	cs, err := local.New(2)
	require.NoError(t, err, "no launcher")
	require.Len(t, cs, 2)
	t.Setenv("OMPI_COMM_WORLD_SIZE", "1")
	_, err = local.New(2)
	require.NoError(t, err, "mpirun -np 1")

	t.Setenv("OMPI_COMM_WORLD_SIZE", "4")
	_, err = local.New(2)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "local: this process is one rank of an MPI job of 4 ranks (OMPI_COMM_WORLD_SIZE=4)")
	assert.Contains(t, err.Error(), "; pass local.AllowUnderMPI() to start in-process ranks anyway")
	ran := false
	err = local.Run(context.Background(), 2, func(context.Context, comm.Comm) error { ran = true; return nil })
	require.Error(t, err)
	assert.Contains(t, err.Error(), "pass local.AllowUnderMPI()")
	assert.False(t, ran, "Run called fn under mpirun")

	cs, err = local.New(2, local.AllowUnderMPI(), local.WithRanksPerNode(1))
	require.NoError(t, err)
	require.Len(t, cs, 2)
	require.NoError(t, local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		return c.AllReduce(ctx, []float32{1}, comm.Sum)
	}, local.AllowUnderMPI()))
}
