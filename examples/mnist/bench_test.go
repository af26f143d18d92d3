package main

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/commtest"
)

// BenchmarkStepLatency times the training steps of this example with
// -checkpoint, and so with its stop request, on 4 in-process ranks whose
// every collective first sleeps -latency (0, and 1 ms: a latency-bound
// link): 1-bit Adam in its compression stage (freeze step 1), 150 steps
// of the 500-example test set per run, one checkpoint at the end. It
// reports the training time per step (the example's wall column, the
// checkpoint included, evaluations excluded) and the agreements and
// collectives per step of rank 0. The stop request rides in the
// optimizer's own per-step agreement: 1 agreement per step (it was 2 with
// an allreduce of its own).
func BenchmarkStepLatency(b *testing.B) {
	train, test := loadTestdata(b)
	for _, lat := range []time.Duration{0, time.Millisecond} {
		b.Run(fmt.Sprintf("latency=%s", lat), func(b *testing.B) {
			cfg := smallConfig("onebit-adam")
			cfg.epochs = 10
			cfg.evalsPerEpoch = 1
			cfg.hyper.freezeStep = 1
			cfg.stop = func(int, int) bool { return false }
			var wall time.Duration
			var steps, calls, agreements int64
			for b.Loop() {
				cfg.checkpoint = checkpointConfig{dir: b.TempDir(), every: 1 << 30}
				comms, err := local.New(4)
				require.NoError(b, err)
				var c0, a0 atomic.Int64
				var mu sync.Mutex
				var res0 *result
				var wg sync.WaitGroup
				errs := make([]error, len(comms))
				for r, c := range comms {
					// Every collective goes through lc (no Unwrap).
					lc := commtest.New(c, lat)
					if r == 0 {
						lc.Calls, lc.Agreements = &c0, &a0
					}
					wg.Add(1)
					go func() {
						defer wg.Done()
						res, err := trainRank(context.Background(), lc, train, test, cfg, nil)
						errs[r] = err
						if err != nil {
							_ = c.Close()
						}
						if r == 0 {
							mu.Lock()
							res0 = res
							mu.Unlock()
						}
					}()
				}
				wg.Wait()
				for r, err := range errs {
					require.NoError(b, err, "rank %d", r)
				}
				for _, c := range comms {
					_ = c.Close()
				}
				wall += res0.wall
				steps += int64(res0.steps)
				calls += c0.Load()
				agreements += a0.Load()
			}
			b.ReportMetric(float64(wall)/float64(steps)/1e6, "ms/step")
			b.ReportMetric(float64(agreements)/float64(steps), "agreements/step")
			b.ReportMetric(float64(calls)/float64(steps), "collectives/step")
		})
	}
}
