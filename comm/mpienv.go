package comm

import (
	"fmt"
	"os"
	"strconv"
)

// MPIJob is the MPI job a launcher (mpirun, mpiexec, srun) started this
// process in, as the variables it sets in every rank's environment tell
// it.
type MPIJob struct {
	// Size is the number of ranks the launcher started; 0 when its
	// variables give this process's rank only (PMIx), or a size that is
	// not a number.
	Size int
	// Variable and Value are the environment variable that says so and
	// its value, such as OMPI_COMM_WORLD_SIZE and "4".
	Variable, Value string
}

// String describes the job for a message: "an MPI job of 4 ranks
// (OMPI_COMM_WORLD_SIZE=4)".
func (j MPIJob) String() string {
	switch {
	case j.Size == 1:
		return fmt.Sprintf("an MPI job of 1 rank (%s=%s)", j.Variable, j.Value)
	case j.Size > 1:
		return fmt.Sprintf("an MPI job of %d ranks (%s=%s)", j.Size, j.Variable, j.Value)
	}
	return fmt.Sprintf("an MPI job (%s=%s)", j.Variable, j.Value)
}

// mpiSizeVars are the variables MPI launchers set to the number of ranks:
// Open MPI's mpirun, MPICH's and Intel MPI's Hydra (and Slurm's PMI-2),
// MVAPICH2's.
var mpiSizeVars = [...]string{"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"}

// mpiRankVars are variables that say only that this process is a rank:
// PMIx (Open MPI 5, srun --mpi=pmix), PMI.
var mpiRankVars = [...]string{"PMIX_RANK", "PMI_RANK"}

// MPIEnvVars returns the environment variables MPIEnvironment reads, in
// the order it reads them (a test that must not see a launcher's clears
// them).
func MPIEnvVars() []string {
	return append(mpiSizeVars[:len(mpiSizeVars):len(mpiSizeVars)], mpiRankVars[:]...)
}

// MPIEnvironment reports whether this process's environment says it is one
// rank of an MPI job, and that job: the first of OMPI_COMM_WORLD_SIZE,
// PMI_SIZE and MV2_COMM_WORLD_SIZE that is set gives its size; PMIX_RANK
// or PMI_RANK alone say it is one rank of a job of unknown size (Size 0).
// An empty variable counts as unset. It reads the environment at each call
// and keeps nothing.
//
// A program that runs its ranks in process (comm/local) under such a
// launcher runs as many independent jobs as the launcher started
// processes; comm/local's CheckNotUnderMPI says so.
func MPIEnvironment() (MPIJob, bool) {
	for _, v := range mpiSizeVars {
		if s := os.Getenv(v); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil || n < 1 {
				n = 0
			}
			return MPIJob{Size: n, Variable: v, Value: s}, true
		}
	}
	for _, v := range mpiRankVars {
		if s := os.Getenv(v); s != "" {
			return MPIJob{Variable: v, Value: s}, true
		}
	}
	return MPIJob{}, false
}
