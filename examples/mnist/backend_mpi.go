package main

import (
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/mpi"
)

// openMPI opens the MPI world communicator: this process is one rank of an
// mpirun job. A binary built without -tags mpi gets comm/mpi's explanatory
// error.
func openMPI() (comm.Comm, error) {
	c, err := mpi.Open()
	if err != nil {
		return nil, fmt.Errorf("-backend mpi: %w; then start this binary under mpirun -np W", err)
	}
	return c, nil
}
