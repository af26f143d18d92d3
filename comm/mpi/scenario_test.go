//go:build mpi

package mpi_test

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/mpi"
)

// scenarioEnv selects a failure scenario instead of the tests. The test
// binary then plays one rank of a job that must die, and
// scripts/test-mpi.sh checks how it dies:
//
//   - exit: the last rank exits (status 0, without finalizing MPI) before
//     the first collective; the others must not hang.
//   - close: the last rank closes its communicator (finalizing MPI) and
//     exits with status 0 before the first collective; the others must not
//     hang.
//   - stall: the last rank never enters the collective; the others' 2s
//     deadline must abort the job with the watchdog's message.
//
// A rank returning from the collective is a failure of the scenario.
const scenarioEnv = "LOWBIT_MPI_SCENARIO"

func runScenario(name string) int {
	c, err := mpi.Open()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if c.Size() < 2 {
		fmt.Fprintf(os.Stderr, "scenario %s needs at least 2 ranks\n", name)
		return 2
	}
	last := c.Rank() == c.Size()-1
	switch name {
	case "exit":
		if last {
			fmt.Fprintf(os.Stderr, "scenario exit: rank %d exits early on purpose\n", c.Rank())
			os.Exit(0)
		}
	case "close":
		if last {
			fmt.Fprintf(os.Stderr, "scenario close: rank %d closes and exits early on purpose\n", c.Rank())
			if err := c.Close(); err != nil {
				fmt.Fprintln(os.Stderr, err)
			}
			return 0
		}
	case "stall":
		if last {
			fmt.Fprintf(os.Stderr, "scenario stall: rank %d stalls on purpose\n", c.Rank())
			time.Sleep(time.Minute)
			return 0
		}
	default:
		fmt.Fprintf(os.Stderr, "unknown scenario %q\n", name)
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err = c.AllReduce(ctx, make([]float32, 1<<10), comm.Sum)
	fmt.Fprintf(os.Stderr, "scenario %s: rank %d: allreduce returned (%v) instead of aborting\n", name, c.Rank(), err)
	return 1
}
