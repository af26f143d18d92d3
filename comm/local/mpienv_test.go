package local_test

import (
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
