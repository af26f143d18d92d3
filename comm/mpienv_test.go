package comm_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/lowbit-ml/lowbit/comm"
)

// TestMPIEnvironment: the variables of Open MPI, MPICH/Intel MPI (Hydra)
// and MVAPICH2 give the job's size, PMIx's and PMI's rank alone a job of
// unknown size; none set (or set empty) is no job.
func TestMPIEnvironment(t *testing.T) {
	assert.Equal(t, []string{"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK"}, comm.MPIEnvVars())
	for _, c := range []struct {
		env  map[string]string
		ok   bool
		want comm.MPIJob
		text string
	}{
		{nil, false, comm.MPIJob{}, ""},
		{map[string]string{"OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "2"}, true,
			comm.MPIJob{Size: 4, Variable: "OMPI_COMM_WORLD_SIZE", Value: "4"}, "an MPI job of 4 ranks (OMPI_COMM_WORLD_SIZE=4)"},
		{map[string]string{"OMPI_COMM_WORLD_SIZE": "1", "PMIX_RANK": "0"}, true,
			comm.MPIJob{Size: 1, Variable: "OMPI_COMM_WORLD_SIZE", Value: "1"}, "an MPI job of 1 rank (OMPI_COMM_WORLD_SIZE=1)"},
		{map[string]string{"PMI_SIZE": "8", "PMI_RANK": "3"}, true, comm.MPIJob{Size: 8, Variable: "PMI_SIZE", Value: "8"}, "an MPI job of 8 ranks (PMI_SIZE=8)"},
		{map[string]string{"MV2_COMM_WORLD_SIZE": "2"}, true, comm.MPIJob{Size: 2, Variable: "MV2_COMM_WORLD_SIZE", Value: "2"}, "an MPI job of 2 ranks (MV2_COMM_WORLD_SIZE=2)"},
		{map[string]string{"PMIX_RANK": "0"}, true, comm.MPIJob{Variable: "PMIX_RANK", Value: "0"}, "an MPI job (PMIX_RANK=0)"},
		{map[string]string{"PMI_RANK": "1"}, true, comm.MPIJob{Variable: "PMI_RANK", Value: "1"}, "an MPI job (PMI_RANK=1)"},
		{map[string]string{"OMPI_COMM_WORLD_SIZE": "many"}, true, comm.MPIJob{Variable: "OMPI_COMM_WORLD_SIZE", Value: "many"}, "an MPI job (OMPI_COMM_WORLD_SIZE=many)"},
	} {
		t.Run(c.text, func(t *testing.T) {
			// Only what the test sets: the suite may run under mpirun.
			for _, v := range comm.MPIEnvVars() {
				t.Setenv(v, "")
			}
			for k, v := range c.env {
				t.Setenv(k, v)
			}
			job, ok := comm.MPIEnvironment()
			assert.Equal(t, c.ok, ok)
			assert.Equal(t, c.want, job)
			if ok {
				assert.Equal(t, c.text, job.String())
			}
		})
	}
}
