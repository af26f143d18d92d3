package onebit_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/testnet"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// lrTestSchedule warms up over 3 steps and then decays.
func lrTestSchedule(t testing.TB, base float32) optim.Schedule {
	t.Helper()
	cos, err := optim.CosineDecay(base, base/10, 20)
	require.NoError(t, err)
	s, err := optim.LinearWarmup(3, cos)
	require.NoError(t, err)
	return s
}

// On one rank, 1-bit Adam with a learning rate changed every step is the
// spec's formulas with that learning rate, bit for bit: the variance and
// its bias correction stay frozen whatever the learning rate does.
func TestAdamScheduleKeepsFrozenVariance(t *testing.T) {
	const freeze, total = 4, 12
	cfg := onebit.DefaultAdamConfig()
	cfg.FreezeStep = freeze
	cfg.WeightDecay = 0.05
	sched := lrTestSchedule(t, 0.01)
	ps := adamParams(t, []int{4, 5})
	opt, err := onebit.NewAdam(context.Background(), nil, ps, cfg)
	require.NoError(t, err)
	require.NoError(t, opt.SetSchedule(sched))
	ref := &adamFrozenRef{cfg: cfg.AdamConfig, freeze: freeze,
		p: append([]float32(nil), ps[0].Data()...), m: make([]float32, 20), v: make([]float32, 20)}
	var frozenV []float32
	for s := 1; s <= total; s++ {
		adamGrads(ps, 0, s)
		ref.cfg.LR = sched.LR(int64(s))
		ref.step(ps[0].GradData())
		require.NoError(t, opt.Step(adamCtx(t)))
		for i, x := range ps[0].Data() {
			require.Equal(t, math.Float32bits(ref.p[i]), math.Float32bits(x), "step %d element %d", s, i)
		}
		ck, err := opt.State()
		require.NoError(t, err)
		v := ck.Tensor(optim.ExpAvgSqPrefix + "w0").Data
		if s == freeze {
			frozenV = v
		}
		if s > freeze {
			require.Equal(t, frozenV, v, "step %d changed the frozen variance", s)
		}
	}
}

// With a schedule, each 1-bit optimizer on 3 ranks resumes bit-identically
// from per-rank checkpoint files, and the schedule is what drives it (the
// run differs from one at the fixed learning rate).
func TestOnebitScheduledResume(t *testing.T) {
	adam := onebit.DefaultAdamConfig()
	adam.LR, adam.FreezeStep = 0.01, 4
	for _, tc := range []struct {
		name string
		mk   func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)
	}{
		{"onebit.Adam", func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewAdam(context.Background(), c, ps, adam)
		}},
		{"onebit.Lamb", newLamb(lambTestConfig(4))},
		{"onebit.ZeroOneAdam", newZeroOne(zeroOneTestConfig())},
	} {
		t.Run(tc.name, func(t *testing.T) {
			scheduled := func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				o, err := tc.mk(c, ps)
				if err != nil {
					return nil, err
				}
				return o, o.(optim.LRSetter).SetSchedule(lrTestSchedule(t, 0.01))
			}
			const k, total = 6, 15
			s := lzSetup(3, scheduled)
			want, err := s.Uninterrupted(lzCtx(t), total, nil)
			require.NoError(t, err)
			got, err := s.Resumed(lzCtx(t), t.TempDir(), k, total)
			require.NoError(t, err)
			for r := range want {
				require.NoError(t, testnet.SameBits(want[r], got[r]), "rank %d", r)
			}
			fixed, err := lzSetup(3, tc.mk).Uninterrupted(lzCtx(t), total, nil)
			require.NoError(t, err)
			assert.Error(t, testnet.SameBits(want[0], fixed[0]))

		})
	}
}

func TestOnebitSetLRRejectsBadInput(t *testing.T) {
	for _, mk := range []func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error){
		func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewAdam(context.Background(), c, ps, onebit.DefaultAdamConfig())
		},
		newLamb(lambTestConfig(2)),
		newZeroOne(zeroOneTestConfig()),
	} {
		net := testnet.New(1, 8, 6, 3)
		opt, err := mk(nil, net.Params())
		require.NoError(t, err)
		o := opt.(optim.LRSetter)
		name := fmt.Sprintf("%T", opt)
		require.NoError(t, o.SetLR(0.5), name)
		for _, lr := range []float32{-1, float32(math.NaN()), float32(math.Inf(1))} {
			assert.Error(t, o.SetLR(lr), name)
		}
		assert.Equal(t, float32(0.5), o.LR(), name)
		// A schedule refused at the next step changes nothing.
		assert.Error(t, o.SetSchedule(badSchedule{}), name)
		assert.Equal(t, float32(0.5), o.LR(), name)
		// A fixed-rate optimizer refuses a scheduled checkpoint.
		require.NoError(t, o.SetSchedule(lrTestSchedule(t, 0.01)), name)
		ck, err := opt.State()
		require.NoError(t, err)
		fresh, err := mk(nil, testnet.New(2, 8, 6, 3).Params())
		require.NoError(t, err)
		before, err := fresh.State()
		require.NoError(t, err)
		err = fresh.Load(ck)
		assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint, name)
		assert.ErrorContains(t, err, "learning-rate schedule", name)
		after, err := fresh.State()
		require.NoError(t, err)
		assert.Equal(t, before, after, name)
	}
}

type badSchedule struct{}

func (badSchedule) LR(int64) float32 { return float32(math.NaN()) }
func (badSchedule) String() string   { return "nan" }
