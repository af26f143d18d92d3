package outer_test

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// states runs cfg on w ranks for calls calls and returns every rank's
// checkpoint.
func states(t *testing.T, w, calls int, cfg outer.Config) []*optim.Checkpoint {
	cks := newPerRank[*optim.Checkpoint](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		if err := stepCalls(ctx, o, ps, c.Rank(), calls); err != nil {
			return err
		}
		ck, err := o.State()
		cks.set(c.Rank(), ck)
		return err
	})
	return cks.v
}

// A sparse run regrouped onto another number of ranks resumes with the
// mean of the old accumulators on every new rank, and trains on with θ_g
// the same everywhere; on the same number of ranks Regroup is a copy.
func TestRegroupSparse(t *testing.T) {
	cfg := config(outer.CodecSparse, 2, 1, 0)
	old := states(t, 3, 5, cfg)
	acc := func(ck *optim.Checkpoint) []float32 { return ck.Tensor(outer.AccumulatorName).Data }
	mean := make([]float32, len(acc(old[0])))
	for i := range mean {
		s := 0.0
		for _, ck := range old {
			s += float64(acc(ck)[i])
		}
		mean[i] = float32(s / 3)
	}
	require.NotEqual(t, acc(old[0]), acc(old[1]), "the ranks' accumulators differ")

	regroupAndTrain(t, old, cfg, 2, func(r int, _, got *optim.Checkpoint) {
		assert.Equal(t, bitsOf(mean), bitsOf(acc(got)), "rank %d: the accumulator is the old ranks' mean", r)
		assert.Equal(t, old[r].Tensor(outer.TensorGlobal).Data, got.Tensor(outer.TensorGlobal).Data)
	})
}

// regroupAndTrain checks that Regroup of old onto as many ranks is a copy
// of each, then regroups old onto world ranks, loads each rank's
// checkpoint into an optimizer of cfg, calls check with the rank, the
// regrouped checkpoint and the optimizer's State after the Load, trains
// calls 6 to 9 and checks that θ_g is the same on every new rank.
func regroupAndTrain(t *testing.T, old []*optim.Checkpoint, cfg outer.Config, world int, check func(r int, regrouped, got *optim.Checkpoint)) {
	t.Helper()
	for r := range old {
		same, err := outer.Regroup(old, len(old), r)
		require.NoError(t, err)
		assert.Equal(t, old[r], same, "rank %d: on the same number of ranks, a copy", r)
	}
	globals := newPerRank[[]float32](world)
	runRanks(t, world, func(ctx context.Context, c comm.Comm) error {
		ck, err := outer.Regroup(old, world, c.Rank())
		if err != nil {
			return err
		}
		ps := newParams(t, sizes)
		o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		if err := o.Load(ck); err != nil {
			return err
		}
		got, err := o.State()
		if err != nil {
			return err
		}
		check(c.Rank(), ck, got)
		for i := 6; i <= 9; i++ {
			setGrads(ps, c.Rank(), i)
			if err := o.Step(ctx); err != nil {
				return err
			}
		}
		globals.set(c.Rank(), append([]float32(nil), o.Global()...))
		return nil
	})
	for r := 1; r < world; r++ {
		assert.Equal(t, bitsOf(globals.v[0]), bitsOf(globals.v[r]), "θ_g the same on every new rank")
	}
}

// The 1-bit codec's error buffers restart from zero on another number of
// ranks; an exchange in flight, checkpoints of another optimizer or out of
// order, and bad groups are refused.
func TestRegroupRefuses(t *testing.T) {
	old := states(t, 2, 3, config(outer.CodecOneBit, 2, 1, 0))
	ck, err := outer.Regroup(old, 3, 2)
	require.NoError(t, err)
	assert.True(t, ck.ErrorsReset)
	runRanks(t, 3, func(ctx context.Context, c comm.Comm) error {
		ck, err := outer.Regroup(old, 3, c.Rank())
		if err != nil {
			return err
		}
		o, err := outer.NewAdam(ctx, c, newParams(t, sizes), config(outer.CodecOneBit, 2, 1, 0), innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		return o.Load(ck)
	})

	inFlight := states(t, 2, 4, config(outer.CodecSparse, 4, 2, 1)) // fragment 0 launched at call 4, merged at 5
	require.GreaterOrEqual(t, inFlight[0].Ints[outer.IntPending], int64(0), "an exchange in flight")
	_, err = outer.Regroup(inFlight, 3, 0)
	assert.ErrorContains(t, err, "in flight")
	_, err = outer.Regroup(inFlight, 2, 1)
	assert.NoError(t, err, "the same number of ranks takes it")

	swapped := []*optim.Checkpoint{old[1], old[0]}
	for _, k := range []struct {
		old         []*optim.Checkpoint
		world, rank int
		want        string
	}{
		{swapped, 3, 0, "made by rank 1 of 2, want rank 0 of 2"},
		{nil, 3, 0, "no checkpoints"},
		{old, 3, 3, "rank 3 of a group of 3"},
		{old, 0, 0, "a group of 0 ranks"},
		{[]*optim.Checkpoint{old[0], nil}, 3, 0, "checkpoint 1 is nil"},
		{[]*optim.Checkpoint{{Algorithm: optim.AlgorithmOnebitAdam, World: 1}}, 2, 0, "onebit.Regroup"},
	} {
		_, err := outer.Regroup(k.old, k.world, k.rank)
		require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint, k.want)
		assert.ErrorContains(t, err, k.want)
	}
}

// bitsOf is the bit patterns of x, so that comparisons are bit for bit.
func bitsOf(x []float32) []uint32 {
	b := make([]uint32, len(x))
	for i, v := range x {
		b[i] = math.Float32bits(v)
	}
	return b
}
