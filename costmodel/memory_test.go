package costmodel_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/costmodel"
)

// The formulas' leading terms; onebit's TestStateBytes checks them to the
// byte against the optimizers' StateBytes.
func TestStateBytesLeadingTerms(t *testing.T) {
	const n = 1 << 24 // 64 MiB of float32: three default buckets
	for _, w := range []int{2, 4, 8} {
		per := func(name string) float64 {
			b, err := costmodel.StateBytes(name, []int64{n}, w, 0)
			require.NoError(t, err, name)
			return float64(b) / n
		}
		fw := float64(w)
		assert.Equal(t, 8.0, per(costmodel.OptAdam))
		// m and v of 1/W, the staging bucket (W chunks) and the chunk, of
		// at most DefaultBucketBytes/(4W) elements each.
		assert.Greater(t, per(costmodel.OptZeroAdam), 8/fw)
		assert.LessOrEqual(t, per(costmodel.OptZeroAdam), 8/fw+(fw+1)*float64(costmodel.DefaultBucketBytes/w)/n)
		// m, v, worker error, server error, then the packed signs (2/8),
		// the gathered messages ((W+1)/(8W)), the server blocks and the pipelined pieces.
		assert.InDelta(t, 12+4/fw+0.25+(fw+1)/(8*fw), per(costmodel.OptOnebitAdam), 0.1)
		assert.InDelta(t, 20+4/fw+0.25+(fw+1)/(8*fw), per(costmodel.OptOnebitLamb), 0.1)
		assert.InDelta(t, 20+4/fw+0.25+(fw+1)/(8*fw), per(costmodel.OptZeroOneAdam), 0.1)
	}
}

func TestStateBytesLargeAndBad(t *testing.T) {
	b, err := costmodel.StateBytes(costmodel.OptOnebitAdam, []int64{costmodel.MaxParams}, 4, 4)
	require.NoError(t, err, "one bucket per float: closed form, no loop over buckets")
	assert.Greater(t, b, int64(12*costmodel.MaxParams))
	for _, o := range costmodel.StateOptimizers() {
		b, err := costmodel.StateBytes(o, nil, 4, 0)
		require.NoError(t, err, o)
		assert.Zero(t, b, o)
	}
	_, err = costmodel.StateBytes(costmodel.OptOnebitAdam, []int64{costmodel.MaxParams}, 1<<20, 4)
	assert.EqualError(t, err, "costmodel: optimizer state too large to count in bytes")
	_, err = costmodel.StateBytes("sgd", []int64{1}, 4, 0)
	assert.EqualError(t, err, `costmodel: unknown optimizer "sgd"`)
	_, err = costmodel.StateBytes(costmodel.OptAdam, []int64{-1}, 4, 0)
	assert.Error(t, err)
	_, err = costmodel.StateBytes(costmodel.OptAdam, []int64{1}, 0, 0)
	assert.Error(t, err)
	_, err = costmodel.StateBytes(costmodel.OptAdam, []int64{1}, 4, -4)
	assert.Error(t, err)
}
