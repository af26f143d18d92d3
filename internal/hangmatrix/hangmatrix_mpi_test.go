//go:build mpi

// The hang matrix under mpirun (scripts/test-mpi.sh): every rank runs every
// case with rank 1 given the bad input and context.Background(), so a rank
// left waiting would hang the job (the script's timeout ends it). Run only
// this test with -test.run MPI.

package hangmatrix_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/mpi"
	"github.com/lowbit-ml/lowbit/internal/hangmatrix"
)

var mpiWorld comm.Comm

func TestMain(m *testing.M) {
	var err error
	if mpiWorld, err = mpi.Open(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	code := m.Run()
	if err := mpiWorld.Close(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	os.Exit(code)
}

// TestHangMatrixMPI: every case, every rank returns an error within a
// second; rank 0 logs the slowest rank's time (one float allreduce of the
// times, after the call).
func TestHangMatrixMPI(t *testing.T) {
	c := mpiWorld
	if c.Size() < 2 {
		t.Skip("needs 2 ranks or more")
	}
	rpn := 1
	if c.Size()%2 == 0 {
		rpn = 2
	}
	const badRank = 1
	for _, k := range hangmatrix.Cases(rpn) {
		t.Run(k.Name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			callErr, took, err := hangmatrix.Run(ctx, c, k, c.Rank() == badRank)
			require.NoError(t, err)
			if assert.Error(t, callErr, "rank %d returned no error", c.Rank()) {
				assert.NotErrorIs(t, callErr, comm.ErrAborted)
			}
			slowest := []float32{float32(took.Seconds())}
			require.NoError(t, c.AllReduce(ctx, slowest, comm.Max))
			assert.Less(t, slowest[0], float32(time.Second.Seconds()))
			if c.Rank() == 0 {
				t.Logf("matrix | %s | mpi (%d ranks, %d per node) | %v", k.Name, c.Size(), rpn,
					time.Duration(float64(slowest[0])*1e9).Round(time.Microsecond))
				t.Logf("rank 0: %v", callErr)
			}
		})
	}
}
