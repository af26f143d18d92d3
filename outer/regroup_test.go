package outer_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// states runs cfg on w ranks for calls calls and returns every rank's
// checkpoint.
func states(t *testing.T, w, calls int, cfg outer.Config) []*optim.Checkpoint {
	cks, _ := runFrom(t, w, cfg, nil, calls, false)
	return cks
}

// runFrom runs cfg on w ranks up to call upTo, from call 1 or, with from,
// from outer.Regroup of from onto w ranks, with grad(rank, call, ·) or,
// with same, grad(0, call, ·) on every rank. It returns every rank's
// checkpoint at the end and rank 0's parameters followed by θ_g.
func runFrom(t *testing.T, w int, cfg outer.Config, from []*optim.Checkpoint, upTo int, same bool) ([]*optim.Checkpoint, []float32) {
	cks := newPerRank[*optim.Checkpoint](w)
	outs := newPerRank[[]float32](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		start := 1
		if from != nil {
			ck, err := outer.Regroup(from, w, c.Rank())
			if err != nil {
				return err
			}
			if err := o.Load(ck); err != nil {
				return err
			}
			start = int(ck.Ints[outer.IntCalls]) + 1
		}
		gr := c.Rank()
		if same {
			gr = 0
		}
		for i := start; i <= upTo; i++ {
			setGrads(ps, gr, i)
			if err := o.Step(ctx); err != nil {
				return err
			}
		}
		ck, err := o.State()
		cks.set(c.Rank(), ck)
		outs.set(c.Rank(), append(flat(ps), o.Global()...))
		return err
	})
	return cks.v, outs.v[0]
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
	regroupAndTrainWith(t, old, cfg, world, nil, check)
}

// regroupAndTrainWith is regroupAndTrain with opts for the optimizers.
func regroupAndTrainWith(t *testing.T, old []*optim.Checkpoint, cfg outer.Config, world int, opts []optim.Option, check func(r int, regrouped, got *optim.Checkpoint)) {
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
		o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig(), opts...)
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

// The 1-bit codec's error buffers are carried onto another number of
// ranks, bucket by bucket (fragments of several buckets): on every new
// rank the worker error is the old ranks' mean, the server errors put
// back together are the old ones, element for element; the checkpoint
// loads as it is, says so in the log, and trains on with θ_g the same on
// every rank. From one rank (no error buffers) and onto one, the buffers
// start at zero.
func TestRegroupOneBitCarriesTheErrorFeedback(t *testing.T) {
	cfg := config(outer.CodecOneBit, 2, 2, 0)
	cfg.BucketBytes = 16 // fragments of 10 elements: buckets of 4, 4 and 2
	for _, move := range [][2]int{{3, 2}, {2, 5}, {4, 3}} {
		from, to := move[0], move[1]
		t.Run(fmt.Sprintf("%dto%d", from, to), func(t *testing.T) {
			old := states(t, from, 5, cfg)
			news := make([]*optim.Checkpoint, to)
			for r := range to {
				ck, err := outer.Regroup(old, to, r)
				require.NoError(t, err)
				assert.False(t, ck.ErrorsReset)
				assert.Equal(t, int64(from), ck.Ints[outer.IntRegroupedFrom])
				news[r] = ck
			}
			buckets := 0
			for f, m := range []int{10, 10} {
				for k, lo := 0, 0; lo < m; k, lo = k+1, lo+4 {
					n := min(lo+4, m) - lo
					wn, sn := outer.WorkerErrorName(f, k), outer.ServerErrorName(f, k)
					want := meanOver(old, wn, n)
					require.NotEqual(t, old[0].Tensor(wn).Data[:n], old[1].Tensor(wn).Data[:n], "%s: the ranks' worker errors differ", wn)
					for r, ck := range news {
						got := ck.Tensor(wn).Data
						require.Len(t, got, onebit.PaddedLen(n, to))
						assert.Equal(t, bitsOf(want), bitsOf(got[:n]), "rank %d: %s is the old ranks' mean", r, wn)
						assert.Equal(t, make([]float32, len(got)-n), got[n:], "rank %d: %s's padding is zero", r, wn)
					}
					assert.Equal(t, bitsOf(joined(old, sn)[:n]), bitsOf(joined(news, sn)[:n]), "%s re-cut, unchanged", sn)
					buckets++
				}
			}
			assert.Equal(t, 6, buckets)

			core, logs := observer.New(zapcore.InfoLevel)
			regroupAndTrainWith(t, old, cfg, to, []optim.Option{optim.WithLogger(zap.New(core))}, func(r int, regrouped, got *optim.Checkpoint) {
				for _, tn := range regrouped.Tensors {
					if optim.IsErrorBuffer(tn.Name) {
						assert.Equal(t, bitsOf(tn.Data), bitsOf(got.Tensor(tn.Name).Data), "rank %d: %s loaded as regrouped", r, tn.Name)
					}
				}
			})
			lines := logs.FilterMessageSnippet("the 1-bit codec's error feedback is carried").All()
			assert.Len(t, lines, to, "one line per new rank")
			for _, e := range logs.All() {
				assert.NotEqual(t, zapcore.WarnLevel, e.Level, e.Message)
			}
		})
	}
	t.Run("from and onto one rank", func(t *testing.T) {
		one := states(t, 1, 5, cfg)
		ck, err := outer.Regroup(one, 3, 1)
		require.NoError(t, err)
		assert.True(t, ck.ErrorsReset, "one rank kept no error buffers")
		regroupAndTrain(t, one, cfg, 3, func(r int, _, got *optim.Checkpoint) {
			for _, tn := range got.Tensors {
				if optim.IsErrorBuffer(tn.Name) {
					assert.Equal(t, make([]float32, len(tn.Data)), tn.Data, "rank %d: %s starts at zero", r, tn.Name)
				}
			}
		})
		ck, err = outer.Regroup(states(t, 3, 5, cfg), 1, 0)
		require.NoError(t, err)
		assert.True(t, ck.ErrorsReset, "one rank keeps none")
	})
}

// meanOver is the mean over the ranks of cks of the first n elements of
// their tensor called name, summed in float64 and rounded once.
func meanOver(cks []*optim.Checkpoint, name string, n int) []float32 {
	out := make([]float32, n)
	for i := range out {
		s := 0.0
		for _, ck := range cks {
			s += float64(ck.Tensor(name).Data[i])
		}
		out[i] = float32(s / float64(len(cks)))
	}
	return out
}

// joined is the concatenation over the ranks of cks of their tensors
// called name.
func joined(cks []*optim.Checkpoint, name string) []float32 {
	var out []float32
	for _, ck := range cks {
		out = append(out, ck.Tensor(name).Data...)
	}
	return out
}

// A checkpoint with an exchange in flight regroups onto another number of
// ranks: each new rank takes old rank r % W's parameters at the launch
// with the exchange's result, and the merge at its step gives what a run
// on the new number of ranks gives. With the same gradients on every rank
// (every average exact: 2 ranks to 4; not int8's or 1-bit's, whose
// scales depend on the number of ranks), the run resumed on 4 ranks from
// 2 ranks' files of a step with an exchange in flight ends bit for bit
// where the run on 4 ranks throughout does, for every codec.
func TestRegroupInFlight(t *testing.T) {
	const calls = 12
	for _, cfg := range []outer.Config{
		config(outer.CodecFP32, 6, 2, 2), config(outer.CodecSparse, 6, 2, 2),
		twoPhase(config(outer.CodecSparse, 6, 2, 2)), config(outer.CodecBF16, 6, 2, 2),
	} {
		t.Run(fmt.Sprintf("%s/%s", cfg.Codec, cfg.SparseExchange), func(t *testing.T) {
			run := func(w, upTo int, from []*optim.Checkpoint) ([]*optim.Checkpoint, []float32) {
				return runFrom(t, w, cfg, from, upTo, true) // the same gradients on every rank
			}
			old, _ := run(2, 4, nil) // fragment 0 launched at call 3, merged at 5
			require.GreaterOrEqual(t, old[0].Ints[outer.IntPending], int64(0), "an exchange in flight")
			_, resumed := run(4, calls, old)
			_, whole := run(4, calls, nil)
			assert.Equal(t, bitsOf(whole), bitsOf(resumed), "resumed on 4 ranks from 2 ranks' in-flight step = 4 ranks throughout")
		})
	}
	t.Run("1bit", func(t *testing.T) {
		cfg := config(outer.CodecOneBit, 6, 2, 2)
		old := states(t, 3, 4, cfg)
		require.GreaterOrEqual(t, old[0].Ints[outer.IntPending], int64(0), "an exchange in flight")
		regroupAndTrain(t, old, cfg, 2, func(r int, _, got *optim.Checkpoint) {
			for _, name := range []string{outer.TensorLaunch, outer.TensorPendingGlobal, outer.TensorGlobal} {
				assert.Equal(t, bitsOf(old[r].Tensor(name).Data), bitsOf(got.Tensor(name).Data), "rank %d: old rank %d's %s", r, r, name)
			}
			assert.Equal(t, old[r].Ints[outer.IntPending], got.Ints[outer.IntPending])
		})
	})
}

// Checkpoints of another optimizer or out of order, and bad groups, are
// refused; an exchange in flight is not.
func TestRegroupRefuses(t *testing.T) {
	old := states(t, 2, 3, config(outer.CodecOneBit, 2, 1, 0))
	inFlight := states(t, 2, 4, config(outer.CodecSparse, 4, 2, 1)) // fragment 0 launched at call 4, merged at 5
	require.GreaterOrEqual(t, inFlight[0].Ints[outer.IntPending], int64(0), "an exchange in flight")
	_, err := outer.Regroup(inFlight, 3, 0)
	assert.NoError(t, err, "in flight, onto another number of ranks")

	swapped := []*optim.Checkpoint{old[1], old[0]}
	short := []*optim.Checkpoint{old[0].Clone(), old[1].Clone()}
	short[1].Tensor(outer.WorkerErrorName(0, 0)).Data = short[1].Tensor(outer.WorkerErrorName(0, 0)).Data[:3]
	noBucket := []*optim.Checkpoint{old[0].Clone(), old[1].Clone()}
	delete(noBucket[0].Ints, outer.IntBucketBytes)
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
		{short, 3, 0, "old rank 1's worker error has 3 elements, want 20"},
		{noBucket, 3, 0, "bucket size of checkpoint 0 are not recorded"},
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
