package outer_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// The inner AdamW with bfloat16 moments (optim.AdamConfig.MomentsBF16)
// through outer.NewAdam: 4 bytes per element less, a checkpoint round
// trip that resumes bit for bit, a checkpoint of the other mode refused,
// and the MLP of TestConvergence trained to the float32 moments' loss.
// Measured on that MLP (4 ranks, 5 seeds of the student and the data,
// float32 -> bfloat16 moments, mean and worst seed; docs/outer.md,
// "Memory"): at 600 steps data-parallel Adam -0.1% (worst +0.0%), the
// fp32 codec -0.1% (+0.2%), the 1-bit codec -0.1% (+0.2%); at 1800
// steps -2.2% (+0.1%), -4.4% (+2.6%), +0.5% (+2.4%). The sparse codec's
// runs are chaotic (a learning rate 0.1% higher moves their mean by up to
// 39%), and bfloat16 moments move them by amounts of the same size.
func TestInnerMomentsBF16(t *testing.T) {
	const w = 2
	base := config(outer.CodecSparse, 4, 1, 0)
	half := innerConfig()
	half.MomentsBF16 = true
	stepped := func(ctx context.Context, c comm.Comm, ps []*optim.Param, inner optim.AdamConfig, from, to int) (*outer.Optimizer, error) {
		o, err := outer.NewAdam(ctx, c, ps, base, inner)
		if err != nil {
			return nil, err
		}
		for i := from; i <= to; i++ {
			setGrads(ps, c.Rank(), i)
			if err := o.Step(ctx); err != nil {
				o.Close()
				return nil, err
			}
		}
		return o, nil
	}
	type result struct {
		bytes [2]int64
		ck    [2]*optim.Checkpoint
		want  []float32 // θ_local after 10 calls
		got   []float32 // the same, resumed after 6
	}
	res := newPerRank[result](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		var r result
		for i, inner := range []optim.AdamConfig{innerConfig(), half} {
			o, err := stepped(ctx, c, newParams(t, sizes), inner, 1, 6)
			if err != nil {
				return err
			}
			r.bytes[i] = o.StateBytes()
			if r.ck[i], err = o.State(); err != nil {
				return err
			}
			o.Close()
		}
		ps := newParams(t, sizes)
		o, err := stepped(ctx, c, ps, half, 1, 10)
		if err != nil {
			return err
		}
		o.Close()
		r.want = flat(ps)
		ps = newParams(t, sizes)
		o, err = outer.NewAdam(ctx, c, ps, base, half)
		if err != nil {
			return err
		}
		defer o.Close()
		if err := o.Load(r.ck[1]); err != nil {
			return err
		}
		for i := 7; i <= 10; i++ {
			setGrads(ps, c.Rank(), i)
			if err := o.Step(ctx); err != nil {
				return err
			}
		}
		r.got = flat(ps)
		err = o.Load(r.ck[0])
		assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
		assert.ErrorContains(t, err, "made with MomentsBF16 false, this optimizer has true")
		res.set(c.Rank(), r)
		return nil
	})
	n := int64(0)
	for _, s := range sizes {
		n += int64(s)
	}
	for r := range w {
		got := res.v[r]
		assert.Equal(t, got.bytes[0]-4*n, got.bytes[1], "rank %d: 4 bytes per element less", r)
		assert.Equal(t, int64(1), got.ck[1].Ints[outer.InnerPrefix+optim.IntMomentsBF16], "rank %d: the checkpoint records the mode", r)
		assert.Equal(t, got.want, got.got, "rank %d: the resumed run differs", r)
	}

	if testing.Short() || raceOn {
		return // the training: 1 s, 20 s under the race detector
	}
	inner := optim.DefaultAdamConfig()
	inner.LR = 3e-3
	for _, k := range []struct {
		name string
		cfg  *outer.Config
		tol  float64
	}{
		{"data-parallel Adam", nil, 0.01},
		{"fp32 codec", func() *outer.Config { c := config(outer.CodecFP32, 10, 1, 0); return &c }(), 0.01},
	} {
		var loss [2]float64
		for i, bf := range []bool{false, true} {
			in := inner
			in.MomentsBF16 = bf
			loss[i] = train(t, 4, 600, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				if k.cfg == nil {
					return optim.NewAdam(ctx, c, ps, in)
				}
				return outer.NewAdam(ctx, c, ps, *k.cfg, in)
			})
		}
		t.Logf("MLP, %s: loss %.4f with float32 moments, %.4f with bfloat16 ones", k.name, loss[0], loss[1])
		require.Positive(t, loss[0])
		assert.InEpsilon(t, loss[0], loss[1], k.tol, k.name)
	}
}
