package outer_test

// The sparse codec's shared-index exchange (SparseShared): identical
// results on every rank, its bytes, its checkpoints, Regroup.

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// shared is cfg with the sparse codec's shared-index exchange.
func shared(cfg outer.Config) outer.Config {
	cfg.SparseExchange = outer.SparseShared
	return cfg
}

// Every rank holds the same θ_g, bit for bit, after every call, on 2, 3
// and 4 ranks, with and without fragments and delay, 1 and 2 value bits
// (some ranks owning no chunk of a fragment).
func TestSharedIdenticalOnEveryRank(t *testing.T) {
	const calls = 13
	voted := func(cfg outer.Config) outer.Config { cfg.SparseExchange = outer.SparseVoted; return cfg }
	for _, w := range []int{2, 3, 4} {
		for _, cfg := range []outer.Config{shared(config(outer.CodecSparse, 4, 1, 0)), shared(config(outer.CodecSparse, 4, 2, 2)), voted(config(outer.CodecSparse, 4, 2, 2))} {
			for _, vbits := range []int{1, 2} {
				cfg.SparseBits = vbits
				t.Run(fmt.Sprintf("W%d/F%d/D%d/bits%d/%s", w, cfg.Fragments, cfg.Delay, vbits, cfg.SparseExchange), func(t *testing.T) {
					requireSameGlobals(t, w, cfg, calls)
				})
			}
		}
	}
}

// The bytes each rank sends per exchange, as the communicator counts
// them, on 2 to 16 ranks: 32768 elements in 8 chunks of 4096, 85 entries
// each. Per chunk the owner's offsets are 85 x 12 bits, 128 bytes; the
// values sent to the owner a 4-byte scale and 85 bits, 15 bytes; the
// owner's average a 4-byte scale and 85 int8 codes, 89 bytes: 232 bytes
// a chunk, each of the three collectives sending the owner's run
// (ceil(8/W) chunks, the largest, to which the others are padded) to
// each of the W-1 others, plus the agreement's 4 bytes to each. From 3
// ranks on it sends less than the all-gather; the cost model's
// outer-sparse-shared row predicts it to the byte
// (costmodel.TestOuterSparseBytesMatchOptimizer).
func TestSharedBytes(t *testing.T) {
	const h = 3
	sent := func(w int, x outer.SparseExchange) int64 { return exchangeBytes(t, w, defaultSparse(h, x)) }
	for w := 2; w <= 16; w++ {
		per := int64((8 + w - 1) / w) // chunks per owner
		sh := sent(w, outer.SparseShared)
		assert.Equal(t, int64(w-1)*(per*232+4), sh, "W %d: shared", w)
		if w == 2 || w == 4 || w == 8 {
			ag := sent(w, outer.SparseAllGather)
			assert.Equal(t, int64(w-1)*(8*143+4), ag, "W %d: all-gather", w)
			if w > 2 {
				assert.Less(t, sh, ag, "W %d", w)
			}
			t.Logf("W %d: shared %d bytes, all-gather %d", w, sh, ag)
		}
	}
}

// The server accumulator is in the checkpoint (this rank's runs, an
// error buffer); a checkpoint of another exchange is refused both ways,
// naming both, and the optimizer is unchanged.
func TestSharedCheckpoint(t *testing.T) {
	for _, ck := range requireServerAccumulators(t, shared(config(outer.CodecSparse, 2, 2, 0))) {
		assert.Equal(t, float64(outer.SparseShared), ck.Floats[optim.HyperPrefix+"outer_sparse_exchange"])
		_, ok := ck.Floats[optim.HyperPrefix+"outer_sparse_server_density"]
		assert.False(t, ok, "the second phase's density is the two-phase exchange's")
	}
	for _, k := range []struct {
		made, into outer.SparseExchange
		want       string
	}{
		{outer.SparseShared, outer.SparseAllGather, "made with outer_sparse_exchange shared, this optimizer has allgather"},
		{outer.SparseAllGather, outer.SparseShared, "made with outer_sparse_exchange allgather, this optimizer has shared"},
		{outer.SparseShared, outer.SparseTwoPhase, "made with outer_sparse_exchange shared, this optimizer has twophase"},
		{outer.SparseTwoPhase, outer.SparseShared, "made with outer_sparse_exchange twophase, this optimizer has shared"},
	} {
		made, into := config(outer.CodecSparse, 2, 1, 0), config(outer.CodecSparse, 2, 1, 0)
		made.SparseExchange, into.SparseExchange = k.made, k.into
		ck, err := stepped(t, made, 3).State()
		require.NoError(t, err)
		requireLoadRefused(t, stepped(t, into, 1), ck, k.want, "%s into %s", k.made, k.into)
	}
	// Its own checkpoint loads, and the run goes on alike.
	cfg := shared(config(outer.CodecSparse, 2, 1, 0))
	ck, err := stepped(t, cfg, 3).State()
	require.NoError(t, err)
	require.NoError(t, stepped(t, cfg, 1).Load(ck))
}

// A shared-index run regrouped from 3 ranks onto 2 resumes as a two-phase
// one does: the mean of the old accumulators plus the old owners' server
// accumulators at the elements they owned, server accumulators of zero,
// and θ_g the same everywhere as it trains on.
func TestRegroupShared(t *testing.T) {
	requireRegroupFolds(t, shared(config(outer.CodecSparse, 2, 2, 0)))
}
