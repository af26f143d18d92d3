package costmodel_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/costmodel"
	"github.com/lowbit-ml/lowbit/optim"
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
		// m, v, worker error, server error, then the packed signs sent
		// and received (2/8, the server messages and the gathered ones in
		// them), the server block and the pipelined pieces: those of one
		// bucket, which every bucket uses in turn (wire). 1-bit LAMB and
		// 0/1 Adam (one bucket per parameter) have one bucket here.
		bucket := float64(costmodel.DefaultBucketBytes / 4)
		wire := 0.25 * bucket / n
		assert.InDelta(t, 12+4/fw+wire, per(costmodel.OptOnebitAdam), 0.05)
		assert.InDelta(t, 20+4/fw+0.25, per(costmodel.OptOnebitLamb), 0.1)
		assert.InDelta(t, 20+4/fw+0.25, per(costmodel.OptZeroOneAdam), 0.1)
		// Sharded: the worker error, and m, v and the update error of
		// the own chunk; then the same wire buffers, blocks and pieces.
		assert.InDelta(t, 4+12/fw+wire, per(costmodel.OptOnebitAdamSharded), 0.05)
		full, err := costmodel.StateBytes(costmodel.OptOnebitAdam, []int64{n}, w, 0)
		require.NoError(t, err)
		sharded, err := costmodel.StateBytes(costmodel.OptOnebitAdamSharded, []int64{n}, w, 0)
		require.NoError(t, err)
		assert.Equal(t, 8*n*(fw-1)/fw, float64(full-sharded), "the full mode keeps m and v whole")
		// Compact: the full mode without its float32 m, but with every
		// bucket's packed signs received, which keep m (1/8), where the
		// full mode has one bucket's.
		compact, err := costmodel.StateBytes(costmodel.OptOnebitAdamCompact, []int64{n}, w, 0)
		require.NoError(t, err)
		assert.InDelta(t, 4-0.125*(1-bucket/n), float64(full-compact)/n, 0.001, "the compact mode keeps m in the packed signs")
		assert.InDelta(t, 8+4/fw+0.125+wire/2, per(costmodel.OptOnebitAdamCompact), 0.05)
		// Sharded in bfloat16, at its peak (the compression stage): the
		// worker error 2, m and the update error of the own chunk 8/W, v
		// 2/W; the same wire buffers, and one staging block of 16Ki
		// floats per rank. Against the float32 one (every bucket's
		// length here is a multiple of the padding unit: N = n): 2N of
		// the worker error and 2N/W of v less, the block more.
		block := int64(4 * (16 << 10) * w)
		bf16, err := costmodel.StateBytes(costmodel.OptOnebitAdamShardedBF16, []int64{n}, w, 0)
		require.NoError(t, err)
		assert.InDelta(t, 2+10/fw+wire+float64(block)/n, per(costmodel.OptOnebitAdamShardedBF16), 0.05)
		assert.Equal(t, 2*n+2*n/int64(w)-block, sharded-bf16, "bfloat16 worker error and v, the staging block")
	}
	// On one rank the sharded and compact modes run as the full one.
	for _, n := range []int64{0, 1, n} {
		full, err := costmodel.StateBytes(costmodel.OptOnebitAdam, []int64{n}, 1, 0)
		require.NoError(t, err)
		for _, o := range []string{costmodel.OptOnebitAdamSharded, costmodel.OptOnebitAdamShardedBF16, costmodel.OptOnebitAdamCompact} {
			b, err := costmodel.StateBytes(o, []int64{n}, 1, 0)
			require.NoError(t, err)
			assert.Equal(t, 8*n, b, o)
			assert.Equal(t, full, b, o)
		}
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
	for _, o := range []string{costmodel.OptOnebitAdamSharded, costmodel.OptOnebitAdamShardedBF16, costmodel.OptOnebitAdamCompact} {
		b, err = costmodel.StateBytes(o, []int64{costmodel.MaxParams}, 4, 4)
		require.NoError(t, err, "%s, one bucket per float: closed form too", o)
		assert.Greater(t, b, int64(2*costmodel.MaxParams), o)
	}
	for _, o := range []string{costmodel.OptOnebitAdam, costmodel.OptOnebitAdamSharded, costmodel.OptOnebitAdamShardedBF16, costmodel.OptOnebitAdamCompact} {
		_, err = costmodel.StateBytes(o, []int64{costmodel.MaxParams}, 1<<20, 4)
		assert.EqualError(t, err, "costmodel: optimizer state too large to count in bytes", o)
	}
	_, err = costmodel.StateBytes("sgd", []int64{1}, 4, 0)
	assert.EqualError(t, err, `costmodel: unknown optimizer "sgd"`)
	_, err = costmodel.StateBytes(costmodel.OptAdam, []int64{-1}, 4, 0)
	assert.Error(t, err)
	_, err = costmodel.StateBytes(costmodel.OptAdam, []int64{1}, 0, 0)
	assert.Error(t, err)
	_, err = costmodel.StateBytes(costmodel.OptAdam, []int64{1}, 4, -4)
	assert.Error(t, err)
}

// MuonStateBytes is exact Muon's StateBytes to the byte: the momentum of
// every matrix, one set of Newton-Schulz work matrices per distinct shape
// (a matrix and its transpose share one), AdamW's moments of the rest.
func TestMuonStateBytes(t *testing.T) {
	shapes := [][]int{{8, 16}, {16, 8}, {12, 12}, {3, 2, 4}, {0, 5}, {16}, {7}}
	var params []*optim.Param
	var matrices [][2]int64
	var other int64
	for i, sh := range shapes {
		params = append(params, optim.NewParam(string(rune('a'+i)), sh...))
		if len(sh) < 2 {
			other += int64(sh[0])
			continue
		}
		rows, cols := int64(sh[0]), int64(1)
		for _, d := range sh[1:] {
			cols *= int64(d)
		}
		matrices = append(matrices, [2]int64{rows, cols})
	}
	m, err := optim.NewMuon(context.Background(), nil, params, optim.DefaultMuonConfig())
	require.NoError(t, err)
	defer m.Close()
	got, err := costmodel.MuonStateBytes(matrices, other)
	require.NoError(t, err)
	assert.Equal(t, m.StateBytes(), got)
	// The momentum, 4 bytes per Muon element, and AdamW's 8 per other.
	assert.Equal(t, 4*(128+128+144+24)+8*23+4*(2*128+2*64)+4*(2*144+2*144)+4*(2*24+2*9), int(got))
	_, err = costmodel.MuonStateBytes(nil, -1)
	assert.Error(t, err)
	_, err = costmodel.MuonStateBytes([][2]int64{{-1, 3}}, 0)
	assert.Error(t, err)
}
