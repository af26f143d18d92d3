package optnames_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/lowbit-ml/lowbit/internal/optnames"
	"github.com/lowbit-ml/lowbit/onebit"
)

// Each 1-bit Adam name selects its state mode; every compressed
// optimizer -compare pairs with an exact one has that one as its
// baseline.
func TestStateOfAndPairs(t *testing.T) {
	for name, want := range map[string][2]int{
		optnames.OnebitAdam:  {int(onebit.StateFull), 0},
		optnames.Compact:     {int(onebit.StateCompact), 0},
		optnames.Sharded:     {int(onebit.StateSharded), 0},
		optnames.ShardedBF16: {int(onebit.StateSharded), int(onebit.BF16WorkerError | onebit.BF16Variance)},
	} {
		mode, bf := optnames.StateOf(name)
		assert.Equal(t, want, [2]int{int(mode), int(bf)}, name)
	}
	for exact, compressed := range optnames.CompressedOf {
		assert.Equal(t, exact, optnames.Baseline[compressed])
	}
}
