package mpi_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/mpi"
)

// Every process started by mpirun runs this: each rank contributes its
// rank, and every rank prints the sum. Build with -tags mpi and run with,
// for example, mpirun -np 4 ./prog.
func Example() {
	c, err := mpi.Open()
	if err != nil {
		log.Fatal(err) // mpi.ErrNotBuilt without the mpi build tag
	}
	defer c.Close() // finalizes MPI

	// A deadline bounds the wait for peers: if it passes during the
	// collective, the whole MPI job is aborted.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	buf := []float32{float32(c.Rank())}
	if err := c.AllReduce(ctx, buf, comm.Sum); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("rank %d of %d: sum of ranks = %g\n", c.Rank(), c.Size(), buf[0])
}

// A job whose collectives may rightly wait longer than
// DefaultCollectiveTimeout, say while one rank writes a very large
// checkpoint and the others wait in the next collective, raises the
// timeout; a test lowers it.
func ExampleWithCollectiveTimeout() {
	c, err := mpi.Open(mpi.WithCollectiveTimeout(2 * time.Hour))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// Even without a deadline, if a rank never reaches this allreduce,
	// the job is aborted after two hours with a message that names it.
	buf := []float32{float32(c.Rank())}
	if err := c.AllReduce(context.Background(), buf, comm.Sum); err != nil {
		log.Fatal(err)
	}
}
