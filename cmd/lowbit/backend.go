package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/comm/mpi"
)

// backends lists the names runRanks accepts, for flag help.
const backends = "local|mpi"

// runRanks runs fn on every rank this process hosts and returns the
// ranks' errors joined.
//
// With backend "local" it starts ranks goroutine ranks of one in-process
// group (ranks must be at least 1). When a rank fails, its communicator is
// closed at once, so that its peers get an error instead of waiting for it
// in a collective.
//
// With backend "mpi" this process is one rank of the MPI world started by
// mpirun: runRanks opens the world, calls fn once and closes it (which
// finalizes MPI). ranks <= 0 accepts any world size; a positive ranks must
// equal it. When fn fails, runRanks returns without closing: the caller
// should exit with a non-zero status, which makes mpirun end the other
// ranks, possibly blocked in a collective with this one. A binary built
// without the mpi build tag returns mpi.Open's error, which says how to
// build one with it.
func runRanks(ctx context.Context, backend string, ranks int, fn func(ctx context.Context, c comm.Comm) error) error {
	switch backend {
	case "local":
		if ranks < 1 {
			return fmt.Errorf("local backend: need at least 1 rank, got %d", ranks)
		}
		return local.Run(ctx, ranks, func(ctx context.Context, c comm.Comm) error {
			err := fn(ctx, c)
			if err != nil {
				c.Close() // wake peers blocked in a collective with this rank
			}
			return err
		})
	case "mpi":
		c, err := mpi.Open()
		if err != nil {
			return fmt.Errorf("mpi backend: %w", err)
		}
		if ranks > 0 && ranks != c.Size() {
			err := fmt.Errorf("mpi backend: %d ranks requested but the MPI world has %d (set the count with mpirun -np)",
				ranks, c.Size())
			return errors.Join(err, c.Close())
		}
		if err := fn(ctx, c); err != nil {
			// Peers may be blocked in a collective with this rank, and
			// freeing the communicator is itself collective: leave MPI
			// as it is, so that this process's non-zero exit makes
			// mpirun end the job instead of every rank hanging.
			return fmt.Errorf("rank %d: %w", c.Rank(), err)
		}
		if err := c.Close(); err != nil {
			return fmt.Errorf("mpi backend: close: %w", err)
		}
		return nil
	}
	return fmt.Errorf("unknown backend %q (want %s)", backend, backends)
}
