package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// TestBenchCheckCatchesCorruptResults runs --check's onebit check (the
// mean of onebitCheckCalls calls from zeroed error buffers) on 1, 2, 4 and
// 8 ranks, and requires the true result to pass and corrupted ones to
// fail: all zeros (relative error 1), halved (0.5: one call's own error,
// about 0.8, would hide it), the last rank's chunk zeroed (sqrt(1/W) at
// least, 0.35 on 8 ranks), and every eighth element's sign flipped.
func TestBenchCheckCatchesCorruptResults(t *testing.T) {
	const elems = 4096
	corruptions := []struct {
		name string
		f    func(x []float32, w int)
	}{
		{"none", func([]float32, int) {}},
		{"zeros", func(x []float32, _ int) { clear(x) }},
		{"halved", func(x []float32, _ int) {
			for i := range x {
				x[i] /= 2
			}
		}},
		{"last chunk zeroed", func(x []float32, w int) { clear(x[len(x)-len(x)/max(w, 2):]) }},
		{"signs flipped", func(x []float32, _ int) {
			for i := 0; i < len(x); i += 8 {
				x[i] = -x[i]
			}
		}},
	}
	for _, w := range []int{1, 2, 4, 8} {
		t.Run(fmt.Sprintf("W=%d", w), func(t *testing.T) {
			rel := make(map[string]float64)
			var mu sync.Mutex
			errSq, refSq := make(map[string]float64), make(map[string]float64)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
				bc, err := newBenchCase("onebit", c, elems, comm.Mean)
				if err != nil {
					return err
				}
				if err := bc.checkRun(ctx); err != nil {
					return err
				}
				good := append([]float32(nil), bc.result...)
				for _, cr := range corruptions {
					copy(bc.result, good)
					cr.f(bc.result, w)
					e, r := bc.check()
					mu.Lock()
					errSq[cr.name] += e
					refSq[cr.name] += r
					mu.Unlock()
				}
				return nil
			})
			require.NoError(t, err)
			for _, cr := range corruptions {
				rel[cr.name] = math.Sqrt(errSq[cr.name] / refSq[cr.name])
				t.Logf("%-18s relative error %.4f", cr.name, rel[cr.name])
				if cr.name == "none" {
					assert.LessOrEqual(t, rel[cr.name], onebitTolerance, "the true result must pass")
				} else {
					assert.Greater(t, rel[cr.name], onebitTolerance, "%s must fail the check", cr.name)
				}
			}
		})
	}
}

// TestBenchCheckFailsAboveTolerance: the reporter fails a row above its
// collective's tolerance (NaN included) and passes one at or below it.
func TestBenchCheckFailsAboveTolerance(t *testing.T) {
	for _, tc := range []struct {
		collective string
		tolerance  float64 // a case's own bound, 0 for the default
		rel        float64
		fail       bool
	}{
		{"onebit", 0, onebitTolerance, false},
		{"onebit", 0, onebitTolerance * 1.01, true},
		{"onebit", 0, 0.99, true},
		{"onebit", 0, math.NaN(), true},
		{"allreduce", 0, exactTolerance, false},
		{"allreduce", 0, 2 * exactTolerance, true},
		{"qgz4", qgz4Tolerance, 0.2, true},
		{"qgz8", qgz8Tolerance, 0.009, false},
		{"fp16", fp16Tolerance, 5e-4, true},
		{"bf16", bf16Tolerance, 3e-3, false},
	} {
		r := &benchReporter{w: io.Discard, cfg: &benchConfig{format: "json"}, res: &benchResult{}}
		rel := tc.rel
		require.NoError(t, r.row(benchRow{Collective: tc.collective, Bytes: 1024, RelError: &rel, tolerance: tc.tolerance}))
		assert.Equal(t, tc.fail, len(r.failed) == 1, "%s at relative error %v: failed %q", tc.collective, tc.rel, r.failed)
	}
}
