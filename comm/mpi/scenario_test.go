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
//   - skip: the last rank runs one allreduce fewer than the others, under
//     context.Background(), then closes its communicator and exits with
//     status 0, as a training loop that runs one step fewer does; the
//     others' 2s collective timeout (WithCollectiveTimeout) must abort the
//     job with a message that names the allreduce and the last rank.
//   - started: every rank starts an all-gather (no deadline); then every
//     rank but the last starts an all-to-all beside it with a 2s deadline,
//     and the last stalls; the deadline must abort the job with the
//     watchdog's message, which names the all-to-all and the last rank.
//
// A rank returning from the collective is a failure of the scenario.
const scenarioEnv = "LOWBIT_MPI_SCENARIO"

func runScenario(name string) int {
	var opts []mpi.Option
	if name == "skip" {
		opts = append(opts, mpi.WithCollectiveTimeout(2*time.Second))
	}
	c, err := mpi.Open(opts...)
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
	case "skip":
		steps := 3
		if last {
			steps--
		}
		buf := make([]float32, 1<<10)
		for range steps {
			if err := c.AllReduce(context.Background(), buf, comm.Sum); err != nil {
				fmt.Fprintf(os.Stderr, "scenario skip: rank %d: %v\n", c.Rank(), err)
				return 1
			}
		}
		if last {
			fmt.Fprintf(os.Stderr, "scenario skip: rank %d ran one allreduce fewer on purpose and closes\n", c.Rank())
			if err := c.Close(); err != nil {
				fmt.Fprintln(os.Stderr, err)
			}
			return 0
		}
		fmt.Fprintf(os.Stderr, "scenario skip: rank %d: its last allreduce returned instead of aborting\n", c.Rank())
		return 1
	case "started":
		s, ok := c.(comm.Starter)
		if !ok {
			fmt.Fprintln(os.Stderr, "scenario started: the communicator starts no collectives")
			return 2
		}
		w := c.Size()
		// Not tiny: a data collective, in flight after its agreement.
		if _, err := s.StartAllGatherBytes(context.Background(), make([]byte, 64), make([]byte, 64*w)); err != nil {
			fmt.Fprintf(os.Stderr, "scenario started: rank %d: %v\n", c.Rank(), err)
			return 1
		}
		if last {
			fmt.Fprintf(os.Stderr, "scenario started: rank %d stalls on purpose\n", c.Rank())
			time.Sleep(time.Minute)
			return 0
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		req, err := s.StartAllToAllBytes(ctx, make([]byte, 64*w), make([]byte, 64*w))
		if err == nil {
			err = req.Wait()
		}
		fmt.Fprintf(os.Stderr, "scenario started: rank %d: the all-to-all returned (%v) instead of aborting\n", c.Rank(), err)
		return 1
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
