package gomlx

import (
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/commtest"
)

// newCountingComm returns a comm.Comm that counts the collectives it
// forwards and, with a latency, sleeps that long before each one, as a
// slow link's round trip would cost: the per-step agreements are
// latency-bound allreduces of a few bytes. It forwards every call one for
// one and is a comm.Wrapper, so the 1-bit allreduce keeps its fast paths.
func newCountingComm(c comm.Comm, latency time.Duration) commtest.Transparent {
	return commtest.Transparent{Counting: commtest.New(c, latency)}
}
