package outer_test

// The sparse codec's two-phase exchange (SparseTwoPhase): identical
// results on every rank, its bytes, its checkpoints, Regroup, a veto.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// Every rank holds the same θ_g, bit for bit, after every call, on 2, 3
// and 4 ranks, with and without fragments and delay (some ranks owning no
// chunk of a fragment: 20 elements in chunks of 4 are 5 chunks, 2 per
// owner on 3 ranks and 4; 10 elements are 3 chunks, 1 per owner).
func TestTwoPhaseIdenticalOnEveryRank(t *testing.T) {
	const calls = 13
	for _, w := range []int{2, 3, 4} {
		for _, cfg := range []outer.Config{twoPhase(config(outer.CodecSparse, 4, 1, 0)), twoPhase(config(outer.CodecSparse, 4, 2, 2))} {
			t.Run(fmt.Sprintf("W%d/F%d/D%d", w, cfg.Fragments, cfg.Delay), func(t *testing.T) {
				requireSameGlobals(t, w, cfg, calls)
			})
		}
	}
}

// The bytes each rank sends per exchange, as the communicator counts
// them: 32768 elements in 8 chunks of 4096, each chunk's message a 4-byte
// scale and 85 entries of 12 + 1 bits, 143 bytes. The all-gather sends
// the 8 chunks to each of the W-1 others; the two-phase exchange sends
// each owner's segment (ceil(8/W) chunks, the largest run, to which the
// others are padded) to each of the W-1 others twice (all-to-all, then
// all-gather). Both add the agreement's 4 bytes to each other rank. At 2
// ranks they send the same; from 3 on the two-phase exchange sends less,
// and never more than 2 messages of the fragment and 2(W-1) chunks'.
func TestTwoPhaseBytes(t *testing.T) {
	const h, msg = 3, 8 * 143
	sent := func(w int, x outer.SparseExchange, serverDensity float32) int64 {
		cfg := defaultSparse(h, x)
		cfg.SparseServerDensity = serverDensity
		return exchangeBytes(t, w, cfg)
	}
	for _, w := range []int{2, 3, 4, 5, 8} {
		per := (8 + w - 1) / w // chunks per owner
		twoPhase, allGather := sent(w, outer.SparseTwoPhase, 0), sent(w, outer.SparseAllGather, 0)
		assert.Equal(t, int64(2*(w-1)*per*143+4*(w-1)), twoPhase, "W %d: two-phase", w)
		assert.Equal(t, int64((w-1)*msg+4*(w-1)), allGather, "W %d: all-gather", w)
		assert.LessOrEqual(t, twoPhase-int64(4*(w-1)), int64(2*msg+2*(w-1)*143), "W %d: at most 2 messages and 2(W-1) chunks'", w)
		if w > 2 {
			assert.Less(t, twoPhase, allGather, "W %d", w)
		}
		t.Logf("W %d: two-phase %d bytes, all-gather %d", w, twoPhase, allGather)
	}
	// A second phase of twice the density: 171 entries of 13 bits a
	// chunk, 282 bytes, in the all-gather's segments.
	assert.Equal(t, int64(3*2*143+3*2*282+12), sent(4, outer.SparseTwoPhase, 2.0/48))
}

// The server accumulator is in the checkpoint, an error buffer for
// optim (ResetErrors drops it), this rank's runs only; a checkpoint of
// the other exchange is refused both ways, naming both.
func TestTwoPhaseCheckpoint(t *testing.T) {
	cks := requireServerAccumulators(t, twoPhase(config(outer.CodecSparse, 2, 2, 0)))
	assert.True(t, optim.IsErrorBuffer(outer.ServerAccumulatorName))
	for r, ck := range cks {
		nonzero := 0
		for _, v := range ck.Tensor(outer.ServerAccumulatorName).Data {
			if v != 0 {
				nonzero++
			}
		}
		assert.Positive(t, nonzero, "rank %d keeps some error", r)
	}

	for _, k := range []struct {
		made, into outer.SparseExchange
		want       string
	}{
		{outer.SparseTwoPhase, outer.SparseAllGather, "made with outer_sparse_exchange twophase, this optimizer has allgather"},
		{outer.SparseAllGather, outer.SparseTwoPhase, "made with outer_sparse_exchange allgather, this optimizer has twophase"},
		{outer.SparseTwoPhase, outer.SparseTwoPhase, "made with outer_sparse_server_density 0.25, this optimizer has 0.5"},
	} {
		made, into := config(outer.CodecSparse, 2, 1, 0), config(outer.CodecSparse, 2, 1, 0)
		made.SparseExchange, into.SparseExchange = k.made, k.into
		if k.made == k.into {
			made.SparseServerDensity = 0.25
		}
		ck, err := stepped(t, made, 3).State()
		require.NoError(t, err)
		requireLoadRefused(t, stepped(t, into, 1), ck, k.want, "%s into %s", k.made, k.into)
	}
}

// A two-phase run regrouped from 3 ranks onto 2 resumes with, on every
// new rank, the mean of the old worker accumulators plus the old owners'
// server accumulators, each at the elements its rank owned, and server
// accumulators of zero; it trains on with θ_g the same everywhere. A
// server accumulator of the wrong length is refused.
func TestRegroupTwoPhase(t *testing.T) {
	old := requireRegroupFolds(t, twoPhase(config(outer.CodecSparse, 2, 2, 0)))

	bad := []*optim.Checkpoint{old[0], old[1].Clone(), old[2]}
	bad[1].Tensor(outer.ServerAccumulatorName).Data = bad[1].Tensor(outer.ServerAccumulatorName).Data[:7]
	_, err := outer.Regroup(bad, 2, 0)
	require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
	assert.ErrorContains(t, err, "checkpoint 1's server accumulator has 7 elements, rank 1 of 3 owns 8")
	mixed := []*optim.Checkpoint{old[0], old[1].ResetErrors(), old[2]}
	mixed[1].AddTensor(outer.AccumulatorName, []int{20}, old[1].Tensor(outer.AccumulatorName).Data)
	_, err = outer.Regroup(mixed, 2, 0)
	assert.ErrorContains(t, err, "checkpoint 1 and checkpoint 0 differ in holding a server accumulator")
}

// A vetoed exchange (flags carried at the exchanges) leaves the worker
// and server accumulators as they were, on every rank.
func TestTwoPhaseVetoKeepsAccumulators(t *testing.T) {
	const w, h, calls = 3, 4, 8
	cfg := twoPhase(config(outer.CodecSparse, h, 1, 0))
	runRanksWithin(t, w, 10*time.Second, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, veto, err := newVetoing(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		defer o.Close()
		for i := 1; i <= calls; i++ {
			setGrads(ps, c.Rank(), i)
			veto.set(c.Rank() == 1 && i == 8)
			before, err := o.State()
			if err != nil {
				return err
			}
			err = o.Step(ctx)
			if i != 8 {
				if err != nil {
					return fmt.Errorf("call %d: %w", i, err)
				}
				continue
			}
			require.ErrorIs(t, err, errVeto)
			after, err := o.State()
			if err != nil {
				return err
			}
			for _, name := range []string{outer.AccumulatorName, outer.ServerAccumulatorName, outer.TensorGlobal} {
				assert.Equal(t, before.Tensor(name).Data, after.Tensor(name).Data, "rank %d: %s", c.Rank(), name)
			}
			assert.NotEqual(t, make([]float32, 20), after.Tensor(outer.AccumulatorName).Data, "rank %d: the exchange at call 4 kept some error", c.Rank())
		}
		return nil
	})
}

// requireServerAccumulators runs cfg (an exchange with owners and server
// accumulators, 2 fragments of 10 elements in chunks of 4) on 3 ranks for
// 5 calls and requires every rank's checkpoint to hold its server
// accumulator, an error buffer (ResetErrors drops it), as long as the
// rank's run: one chunk per owner, rank 2's the short one. It returns the
// checkpoints.
func requireServerAccumulators(t *testing.T, cfg outer.Config) []*optim.Checkpoint {
	t.Helper()
	cks := states(t, 3, 5, cfg)
	for r, want := range []int{8, 8, 4} {
		srv := cks[r].Tensor(outer.ServerAccumulatorName)
		require.NotNil(t, srv, "rank %d", r)
		assert.Len(t, srv.Data, want, "rank %d", r)
		assert.Nil(t, cks[r].ResetErrors().Tensor(outer.ServerAccumulatorName))
	}
	return cks
}

// requireRegroupFolds regroups a run of cfg (an exchange with owners and
// server accumulators) from 3 ranks onto 2 and requires, on every new
// rank, the mean of the old worker accumulators plus the old owners'
// server accumulators, each at the elements its rank owned, server
// accumulators of zero, and θ_g the same everywhere as it trains on. It
// returns the old ranks' states.
func requireRegroupFolds(t *testing.T, cfg outer.Config) []*optim.Checkpoint {
	t.Helper()
	old := states(t, 3, 5, cfg)
	// The owners' elements (2 fragments of 10, chunks of 4, one chunk
	// per rank): rank 0 owns 0-3 and 10-13, rank 1 4-7 and 14-17, rank 2
	// 8-9 and 18-19.
	owned := [][]int{{0, 1, 2, 3, 10, 11, 12, 13}, {4, 5, 6, 7, 14, 15, 16, 17}, {8, 9, 18, 19}}
	want := make([]float64, 20)
	for _, ck := range old {
		for i, v := range ck.Tensor(outer.AccumulatorName).Data {
			want[i] += float64(v) / 3
		}
	}
	for r, ck := range old {
		for j, v := range ck.Tensor(outer.ServerAccumulatorName).Data {
			want[owned[r][j]] += float64(v)
		}
	}
	mean := make([]float32, 20)
	for i, v := range want {
		mean[i] = float32(v)
	}

	regroupAndTrain(t, old, cfg, 2, func(r int, ck, got *optim.Checkpoint) {
		assert.InDeltaSlice(t, mean, ck.Tensor(outer.TensorRegroupedAccumulator).Data, 1e-6)
		assert.InDeltaSlice(t, mean, got.Tensor(outer.AccumulatorName).Data, 1e-6, "rank %d", r)
		srv := got.Tensor(outer.ServerAccumulatorName).Data
		assert.Equal(t, make([]float32, len(srv)), srv, "rank %d: the server accumulator restarts from zero", r)
	})
	return old
}
