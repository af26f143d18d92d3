package optim

import (
	"context"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// mustSchedule returns s, or panics with err (a bug in the test).
func mustSchedule(s Schedule, err error) Schedule {
	if err != nil {
		panic(err)
	}
	return s
}

func TestSchedulesByHand(t *testing.T) {
	constant := mustSchedule(ConstantLR(0.1))
	warm := mustSchedule(LinearWarmup(4, constant))
	cos := mustSchedule(CosineDecay(1, 0, 4))
	step := mustSchedule(StepDecay(1, 0.5, 2))
	warmCos := mustSchedule(LinearWarmup(2, mustSchedule(CosineDecay(0.01, 0.001, 2))))
	for _, tc := range []struct {
		s    Schedule
		want []float64 // steps 1, 2, ...
	}{
		{constant, []float64{0.1, 0.1, 0.1}},
		{warm, []float64{0.025, 0.05, 0.075, 0.1, 0.1, 0.1}},
		{cos, []float64{1, (1 + math.Sqrt2/2) / 2, 0.5, (1 - math.Sqrt2/2) / 2, 0, 0, 0}},
		{step, []float64{1, 1, 0.5, 0.5, 0.25, 0.25, 0.125}},
		{warmCos, []float64{0.005, 0.01, 0.01, 0.0055, 0.001, 0.001}},
	} {
		for i, w := range tc.want {
			assert.InDelta(t, w, float64(tc.s.LR(int64(i+1))), 1e-7*math.Max(w, 1e-3), "%s at step %d", tc.s, i+1)
		}
	}
	assert.Equal(t, float32(0.1), warm.LR(4), "the warm-up ends exactly at the base learning rate")
	assert.Equal(t, "linear_warmup(4, constant(0.1))", warm.String())
	assert.Equal(t, "cosine_decay(1, 0, 4)", cos.String())
	assert.Equal(t, "step_decay(1, 0.5, 2)", step.String())
	// Schedules that differ describe themselves differently.
	fps := map[int64]string{}
	for _, s := range []Schedule{constant, warm, cos, step, warmCos,
		mustSchedule(CosineDecay(1, 0, 5)), mustSchedule(StepDecay(1, 0.5, 3)), mustSchedule(ConstantLR(0.10000001))} {
		fp := ScheduleFingerprint(s)
		require.NotZero(t, fp)
		_, dup := fps[fp]
		require.False(t, dup, "%s and %s share a fingerprint", s, fps[fp])
		fps[fp] = s.String()
	}
	assert.Zero(t, ScheduleFingerprint(nil))
}

func TestSchedulesRejectBadParameters(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	for name, err := range map[string]error{
		"constant -1":         second(ConstantLR(-1)),
		"constant NaN":        second(ConstantLR(nan)),
		"constant Inf":        second(ConstantLR(inf)),
		"warm-up 0 steps":     second(LinearWarmup(0, constantLR(1))),
		"warm-up nil":         second(LinearWarmup(3, nil)),
		"cosine base -1":      second(CosineDecay(-1, -1, 10)),
		"cosine final > base": second(CosineDecay(1, 2, 10)),
		"cosine final < 0":    second(CosineDecay(1, -1, 10)),
		"cosine final NaN":    second(CosineDecay(1, nan, 10)),
		"cosine 0 steps":      second(CosineDecay(1, 0, 0)),
		"step base Inf":       second(StepDecay(inf, 0.5, 10)),
		"step gamma 0":        second(StepDecay(1, 0, 10)),
		"step gamma 2":        second(StepDecay(1, 2, 10)),
		"step every 0":        second(StepDecay(1, 0.5, 0)),
	} {
		assert.Error(t, err, name)
	}
}

func second(_ Schedule, err error) error { return err }

// fnSchedule is a user-written schedule.
type fnSchedule struct {
	f    func(int64) float32
	name string
}

func (s fnSchedule) LR(t int64) float32 { return s.f(t) }
func (s fnSchedule) String() string     { return s.name }

// SetLR before every step and the equivalent schedule give the same
// parameters as each other, bit for bit, and as Adam built with that
// learning rate while it is constant.
func TestSetLRAndScheduleDriveTheStep(t *testing.T) {
	lrAt := func(t int64) float32 { return 0.01 / float32(t) }
	for _, mk := range []func(ps []*Param, lr float32) (Optimizer, error){
		func(ps []*Param, lr float32) (Optimizer, error) {
			c := DefaultAdamConfig()
			c.LR = lr
			return NewAdam(context.Background(), nil, ps, c)
		},
		func(ps []*Param, lr float32) (Optimizer, error) {
			c := DefaultLambConfig()
			c.LR = lr
			return NewLamb(context.Background(), nil, ps, c)
		},
	} {
		bySet, bySched, fixed := testParams(t, 2, []int{3, 4}), testParams(t, 2, []int{3, 4}), testParams(t, 2, []int{3, 4})
		o1, err := mk(bySet, 1)
		require.NoError(t, err)
		o2, err := mk(bySched, 1)
		require.NoError(t, err)
		o3, err := mk(fixed, 0.01)
		require.NoError(t, err)
		require.NoError(t, o2.(LRSetter).SetSchedule(fnSchedule{lrAt, "1/t"}))
		assert.Equal(t, float32(0.01), o2.(LRSetter).LR())
		for s := int64(1); s <= 6; s++ {
			require.NoError(t, o1.(LRSetter).SetLR(lrAt(s)))
			for _, ps := range [][]*Param{bySet, bySched, fixed} {
				fillGrads(ps, 0, int(s))
			}
			require.NoError(t, o1.Step(context.Background()))
			require.NoError(t, o2.Step(context.Background()))
			require.NoError(t, o3.Step(context.Background()))
			if s == 1 {
				assert.Equal(t, bits(fixed[0].Data()), bits(bySet[0].Data()))
			}
			assert.Equal(t, bits(bySet[0].Data()), bits(bySched[0].Data()), "step %d", s)
		}
		assert.NotEqual(t, bits(fixed[0].Data()), bits(bySet[0].Data()))
	}
}

func TestSetLRRejectsBadInput(t *testing.T) {
	ps := testParams(t, 1, []int{3})
	opt, err := NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
	require.NoError(t, err)
	require.NoError(t, opt.SetLR(0.5))
	for _, lr := range []float32{-1, -1e-30, float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
		assert.Error(t, opt.SetLR(lr), "%v", lr)
		assert.Equal(t, float32(0.5), opt.LR())
	}
	nanAt2 := fnSchedule{func(t int64) float32 {
		if t >= 2 {
			return float32(math.NaN())
		}
		return 0.1
	}, "nan-from-2"}
	require.NoError(t, opt.SetSchedule(nanAt2))
	fillGrads(ps, 0, 1)
	require.NoError(t, opt.Step(context.Background()))
	// The next step's learning rate is NaN: SetSchedule refuses it now.
	assert.ErrorContains(t, opt.SetSchedule(nanAt2), "NaN")
	before, err := opt.State()
	require.NoError(t, err)
	err = opt.Step(context.Background())
	assert.ErrorContains(t, err, "nan-from-2")
	assert.ErrorContains(t, err, "step 2")
	after, err := opt.State()
	require.NoError(t, err)
	assert.Equal(t, before, after, "a refused step changed the optimizer")
	assert.Equal(t, int64(1), opt.Stats().Steps)
	require.NoError(t, opt.SetSchedule(nil))
	assert.Equal(t, float32(0.5), opt.LR(), "back to the fixed learning rate")
	require.NoError(t, opt.Step(context.Background()))
}

// A schedule that gives a bad learning rate fails the step on every rank
// before anything is communicated.
func TestBadScheduleFailsEveryRankWithoutTraffic(t *testing.T) {
	var mu sync.Mutex
	var errs []error
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 1, []int{5})
		opt, err := NewAdam(ctx, c, ps, DefaultAdamConfig())
		if err != nil {
			return err
		}
		if err := opt.SetSchedule(fnSchedule{func(t int64) float32 { return 0.1 - 0.075*float32(t) }, "linear-to-negative"}); err != nil {
			return err
		}
		fillGrads(ps, c.Rank(), 1)
		if err := opt.Step(ctx); err != nil {
			return err
		}
		sent := opt.Stats().BytesSent
		err = opt.Step(ctx) // lr -0.05 at step 2
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
		assert.Equal(t, sent, opt.Stats().BytesSent)
		return nil
	})
	require.NoError(t, err)
	require.Len(t, errs, 3)
	for _, e := range errs {
		assert.ErrorContains(t, e, "must be finite and >= 0")
	}
}

func TestCheckpointKeepsLearningRate(t *testing.T) {
	ps := testParams(t, 1, []int{3})
	opt, err := NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
	require.NoError(t, err)
	require.NoError(t, opt.SetLR(0.25))
	fillGrads(ps, 0, 1)
	require.NoError(t, opt.Step(context.Background()))
	ck, err := opt.State()
	require.NoError(t, err)
	b, err := ck.MarshalBinary()
	require.NoError(t, err)
	var back Checkpoint
	require.NoError(t, back.UnmarshalBinary(b))

	fresh, err := NewAdam(context.Background(), nil, testParams(t, 1, []int{3}), DefaultAdamConfig())
	require.NoError(t, err)
	require.NoError(t, fresh.Load(&back))
	assert.Equal(t, float32(0.25), fresh.LR())

	// A checkpoint that predates the learning-rate entries loads and
	// keeps the optimizer's own learning rate.
	old := back
	old.Ints = map[string]int64{IntStep: 1, IntSteps: 1, IntSkipped: 0}
	old.Floats = nil
	cfg := DefaultAdamConfig()
	cfg.LR = 0.125
	fresh, err = NewAdam(context.Background(), nil, testParams(t, 1, []int{3}), cfg)
	require.NoError(t, err)
	require.NoError(t, fresh.Load(&old))
	assert.Equal(t, float32(0.125), fresh.LR())
	sched := mustSchedule(StepDecay(0.5, 0.5, 1))
	require.NoError(t, fresh.SetSchedule(sched))
	require.NoError(t, fresh.Load(&old))
	assert.Equal(t, float32(0.25), fresh.LR(), "step 2 of the schedule")
}

func TestLoadRefusesAnotherSchedule(t *testing.T) {
	cosine := mustSchedule(CosineDecay(0.01, 0, 100))
	other := mustSchedule(CosineDecay(0.01, 0, 200))
	mk := func(s Schedule) *Adam {
		ps := testParams(t, 1, []int{3})
		opt, err := NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
		require.NoError(t, err)
		if s != nil {
			require.NoError(t, opt.SetSchedule(s))
		}
		fillGrads(ps, 0, 1)
		require.NoError(t, opt.Step(context.Background()))
		return opt
	}
	state := func(o *Adam) *Checkpoint {
		ck, err := o.State()
		require.NoError(t, err)
		return ck
	}
	withCosine, withOther, fixed := mk(cosine), mk(other), mk(nil)
	for _, tc := range []struct {
		name string
		into *Adam
		ck   *Checkpoint
		want string
	}{
		{"another schedule", withOther, state(withCosine), "another learning-rate schedule"},
		{"schedule into fixed", fixed, state(withCosine), "SetSchedule the same schedule"},
		{"fixed into schedule", withCosine, state(fixed), "made with a fixed learning rate"},
	} {
		before := state(tc.into)
		err := tc.into.Load(tc.ck)
		assert.ErrorIs(t, err, ErrIncompatibleCheckpoint, tc.name)
		assert.ErrorContains(t, err, tc.want, tc.name)
		assert.Equal(t, before, state(tc.into), "%s: a refused load changed the optimizer", tc.name)
	}
	ck := state(withCosine)
	ck.Floats[FloatLR] = math.NaN()
	assert.ErrorContains(t, withCosine.Load(ck), "learning rate NaN")
	// The same schedule loads; deleting the entries switches on purpose.
	require.NoError(t, withCosine.Load(state(withCosine)))
	ck = state(withCosine)
	delete(ck.Ints, IntLRSchedule)
	delete(ck.Floats, FloatLR)
	require.NoError(t, withOther.Load(ck))
}

// Stopping at step k and resuming, with a schedule, is bit-identical to
// not stopping.
func TestScheduledResumeIsBitIdentical(t *testing.T) {
	const total, k = 10, 4
	sched := mustSchedule(LinearWarmup(3, mustSchedule(CosineDecay(0.02, 0.001, 7))))
	run := func(from, to int, ck *Checkpoint, ps []*Param) (*Checkpoint, []*Param) {
		if ps == nil {
			ps = testParams(t, 3, []int{4, 2}, []int{5})
		}
		opt, err := NewLamb(context.Background(), nil, ps, DefaultLambConfig())
		require.NoError(t, err)
		require.NoError(t, opt.SetSchedule(sched))
		if ck != nil {
			require.NoError(t, opt.Load(ck))
		}
		for s := from; s <= to; s++ {
			fillGrads(ps, 0, s)
			require.NoError(t, opt.Step(context.Background()))
		}
		out, err := opt.State()
		require.NoError(t, err)
		return out, ps
	}
	want, _ := run(1, total, nil, nil)
	mid, _ := run(1, k, nil, nil)
	got, _ := run(k+1, total, mid, testParams(t, 99, []int{4, 2}, []int{5}))
	assert.Equal(t, want, got)
}

// TestLRZero: a learning rate of 0 is one: Adam and LAMB take it in their
// config and from SetLR, ConstantLR(0) and a cosine decay to 0 are
// schedules, and a step at 0 updates the moments as one at 0.01 does
// while the parameters stay bit for bit where they are (weight decay
// included). Negative, NaN and infinite ones are still refused.
func TestLRZero(t *testing.T) {
	const steps = 6
	for _, name := range []string{"adam", "lamb", "muon"} {
		t.Run(name, func(t *testing.T) {
			build := func(lr float32) (Optimizer, []*Param) {
				ps := testParams(t, 1, []int{7}, []int{2, 3})
				cfg := DefaultAdamConfig()
				cfg.LR, cfg.WeightDecay = lr, 0.1
				var opt Optimizer
				var err error
				switch name {
				case "adam":
					opt, err = NewAdam(context.Background(), nil, ps, cfg)
				case "lamb":
					opt, err = NewLamb(context.Background(), nil, ps, LambConfig{AdamConfig: cfg, MaxCoeff: 10, MinCoeff: 0.01})
				default: // both groups at lr: the matrix by Muon, the vector by AdamW
					mc := DefaultMuonConfig()
					mc.LR, mc.AdamLR, mc.WeightDecay, mc.AdamWeightDecay = lr, lr, 0.1, 0.1
					opt, err = NewMuon(context.Background(), nil, ps, mc)
				}
				require.NoError(t, err)
				return opt, ps
			}
			zero, zps := build(0)
			on, _ := build(0.01)
			init := snapshot(zps)
			for s := 1; s <= steps; s++ {
				for _, o := range []Optimizer{zero, on} {
					fillGrads(o.Params(), 0, s)
					require.NoError(t, o.Step(context.Background()))
				}
				assert.Equal(t, init, snapshot(zps), "step %d: a parameter moved at lr 0", s)
			}
			a, err := zero.State()
			require.NoError(t, err)
			b, err := on.State()
			require.NoError(t, err)
			for _, tn := range b.Tensors {
				if !strings.HasPrefix(tn.Name, "param/") {
					assert.Equal(t, bits(tn.Data), bits(a.Tensor(tn.Name).Data), "%s after %d steps", tn.Name, steps)
				}
			}
			ls := on.(LRSetter)
			require.NoError(t, ls.SetLR(0))
			assert.Zero(t, ls.LR())
			c, err := ConstantLR(0)
			require.NoError(t, err)
			require.NoError(t, ls.SetSchedule(c))
			d, err := CosineDecay(0.01, 0, 2)
			require.NoError(t, err)
			require.NoError(t, ls.SetSchedule(d)) // 0 from step 3 on, the next is step 7
			if m, ok := on.(*Muon); ok {
				require.NoError(t, m.SetAdamSchedule(d)) // SetSchedule drives the Muon group
			}
			before := snapshot(on.Params())
			fillGrads(on.Params(), 0, steps+1)
			require.NoError(t, on.Step(context.Background()))
			assert.Equal(t, before, snapshot(on.Params()), "a step of the cosine decay at 0 moved a parameter")
			for _, bad := range []float32{-1e-30, float32(math.NaN()), float32(math.Inf(1))} {
				assert.Error(t, ls.SetLR(bad), "%v", bad)
			}
		})
	}
}
