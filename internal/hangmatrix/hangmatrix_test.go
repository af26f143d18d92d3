package hangmatrix_test

import (
	"context"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/hangmatrix"
)

// limit is how long every rank may take to return: the matrix asks for
// one second; a hang would be forever.
const limit = time.Second

// TestHangMatrixLocal runs every case of the matrix on 4 in-process ranks
// (2 nodes x 2 ranks) with rank 1 given the bad input, and checks that
// every rank returns an error within a second under context.Background().
// A case that hangs fails the test after 10 s rather than blocking it.
// Run with -v to print the matrix: collective or optimizer, backend, the
// time for every rank to return.
func TestHangMatrixLocal(t *testing.T) {
	const w, rpn, badRank = 4, 2, 1
	for _, k := range hangmatrix.Cases(rpn) {
		t.Run(k.Name, func(t *testing.T) {
			var mu sync.Mutex
			errs := make([]error, w)
			took := make([]time.Duration, w)
			done := make(chan error, 1)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			go func() {
				done <- local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
					callErr, d, err := hangmatrix.Run(ctx, c, k, c.Rank() == badRank)
					mu.Lock()
					errs[c.Rank()], took[c.Rank()] = callErr, d
					mu.Unlock()
					return err
				}, local.WithRanksPerNode(rpn))
			}()
			select {
			case err := <-done:
				require.NoError(t, err)
			case <-time.After(10 * time.Second):
				t.Fatal("a rank is still blocked after 10 s")
			}
			for r, err := range errs {
				if assert.Error(t, err, "rank %d returned no error", r) {
					assert.NotErrorIs(t, err, comm.ErrAborted, "rank %d: the group was aborted, not told", r)
					if r != badRank && !strings.HasPrefix(k.Name, "quant.Coalesced") {
						// (Coalesced's status is a reduced float: it says
						// "another rank".)
						assert.Contains(t, err.Error(), "rank 1", "rank %d's error does not name the bad rank", r)
					}
				}
			}
			slowest := slices.Max(took)
			assert.Less(t, slowest, limit)
			t.Logf("matrix | %s | local (4 ranks, 2x2) | %v", k.Name, slowest.Round(time.Microsecond))
			t.Logf("rank 0: %v; rank 1 (bad): %v", errs[0], errs[1])
		})
	}
}
