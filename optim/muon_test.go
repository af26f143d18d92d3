package optim

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/muonref"
)

// refMuon is Muon with an auxiliary Adam in float64, written from the
// formulas of MuonConfig (the published algorithm).
type refMuon struct {
	cfg     MuonConfig
	shapes  [][]int
	muon    []bool
	p, m, v [][]float64
	t       int
}

func newRefMuon(cfg MuonConfig, ps []*Param, muon []bool) *refMuon {
	r := &refMuon{cfg: cfg, muon: muon}
	for _, p := range ps {
		r.shapes = append(r.shapes, p.Shape())
		x := make([]float64, p.Numel())
		for i, v := range p.Data() {
			x[i] = float64(v)
		}
		r.p = append(r.p, x)
		r.m = append(r.m, make([]float64, p.Numel()))
		r.v = append(r.v, make([]float64, p.Numel()))
	}
	return r
}

func (r *refMuon) step(grads [][]float64) {
	r.t++
	c := r.cfg
	for i, g := range grads {
		p, m := r.p[i], r.m[i]
		if !r.muon[i] {
			b1, b2 := float64(c.AdamBeta1), float64(c.AdamBeta2)
			for k := range p {
				m[k] = b1*m[k] + (1-b1)*g[k]
				r.v[i][k] = b2*r.v[i][k] + (1-b2)*g[k]*g[k]
				mh := m[k] / (1 - math.Pow(b1, float64(r.t)))
				vh := r.v[i][k] / (1 - math.Pow(b2, float64(r.t)))
				p[k] = p[k]*(1-float64(c.AdamLR)*float64(c.AdamWeightDecay)) - float64(c.AdamLR)*mh/(math.Sqrt(vh)+float64(c.AdamEps))
			}
			continue
		}
		rows, cols := r.shapes[i][0], len(p)/r.shapes[i][0]
		mu := float64(c.Momentum)
		u := make([]float64, len(p))
		for k := range p {
			m[k] = mu*m[k] + (1-mu)*g[k]
			u[k] = m[k]
			if c.Nesterov {
				u[k] = (1-mu)*g[k] + mu*m[k]
			}
		}
		coef := [3]float64{float64(c.NSCoefficients[0]), float64(c.NSCoefficients[1]), float64(c.NSCoefficients[2])}
		x := muonref.Orthogonalize(u, rows, cols, coef, c.NSSteps, float64(c.NSEps))
		scale := math.Sqrt(math.Max(1, float64(rows)/float64(cols)))
		lr := float64(c.LR)
		for k := range p {
			p[k] = p[k]*(1-lr*float64(c.WeightDecay)) - lr*scale*x[k]
		}
	}
}

// muonShapes are wide, tall (transposed for the iteration), 3-D (viewed
// as 4 x 15), one-row and square matrices, a vector and a scalar.
var muonShapes = [][]int{{6, 10}, {10, 6}, {4, 3, 5}, {1, 8}, {5, 5}, {7}, {}}

// muonGrads writes a pseudo-random gradient that depends on rank and step:
// full rank, unlike fillGrads' (a cosine of the element index is a rank-2
// matrix, whose null directions hold only rounding, which Newton-Schulz
// lifts by up to a^NSSteps, 480 with the defaults: float32 then differs
// from float64 by far more than its rounding of a full-rank matrix).
func muonGrads(ps []*Param, rank, step int) {
	for i, p := range ps {
		muonref.Noise(p.GradData(), uint32(step*7919+rank*104729+i*31+1), float32(1+rank))
	}
}

func grads64(ps []*Param) [][]float64 {
	out := make([][]float64, len(ps))
	for i, p := range ps {
		for _, g := range p.GradData() {
			out[i] = append(out[i], float64(g))
		}
	}
	return out
}

func TestMuonMatchesFloat64Reference(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  func(*MuonConfig)
	}{
		{"defaults", func(*MuonConfig) {}},
		{"plain-momentum", func(c *MuonConfig) { c.Nesterov = false }},
		{"weight-decay", func(c *MuonConfig) { c.WeightDecay = 0.1; c.AdamWeightDecay = 0.05; c.AdamLR = 1e-2 }},
		{"three-steps", func(c *MuonConfig) { c.NSSteps = 3; c.Momentum = 0.5; c.LR = 0.05 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultMuonConfig()
			tc.cfg(&cfg)
			ps := testParams(t, 4, muonShapes...)
			opt, err := NewMuon(context.Background(), nil, ps, cfg)
			require.NoError(t, err)
			assert.Equal(t, []string{"a-param", "b-param", "c-param", "d-param", "e-param"}, opt.MuonParams())
			ref := newRefMuon(cfg, ps, []bool{true, true, true, true, true, false, false})
			for s := 1; s <= 8; s++ {
				muonGrads(ps, 0, s)
				ref.step(grads64(ps))
				require.NoError(t, opt.Step(context.Background()))
				for i, p := range ps {
					for k, x := range p.Data() {
						require.InDelta(t, ref.p[i][k], float64(x), 1e-6, "step %d %s[%d]", s, p.Name, k)
					}
				}
			}
			assert.Equal(t, Stats{Steps: 8, Stage: StageExact}, opt.Stats())
		})
	}
}

// The default selection gives Muon the parameters of rank 2 or more; a
// list overrides it, a 3-D tensor included.
func TestMuonSelection(t *testing.T) {
	ps := testParams(t, 1, []int{4, 4}, []int{4}, []int{2, 2, 3}, []int{8, 4})
	opt, err := NewMuon(context.Background(), nil, ps, DefaultMuonConfig())
	require.NoError(t, err)
	assert.Equal(t, []string{"a-param", "c-param", "d-param"}, opt.MuonParams())
	cfg := DefaultMuonConfig()
	cfg.Params = []string{"c-param"}
	opt, err = NewMuon(context.Background(), nil, ps, cfg)
	require.NoError(t, err)
	assert.Equal(t, []string{"c-param"}, opt.MuonParams())
}

// muonRun runs steps 1..steps of Muon on w in-process ranks, each with its
// own gradients (fillGrads), calling before(opt, rank) after construction,
// and returns every rank's parameters.
func muonRun(t *testing.T, w, steps int, cfg MuonConfig, before func(*Muon, int) error) [][][]float32 {
	t.Helper()
	var mu sync.Mutex
	out := make([][][]float32, w)
	err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 5, muonShapes...)
		opt, err := NewMuon(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		defer opt.Close()
		if before != nil {
			if err := before(opt, c.Rank()); err != nil {
				return err
			}
		}
		for s := 1; s <= steps; s++ {
			muonGrads(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		mu.Lock()
		out[c.Rank()] = snapshot(ps)
		mu.Unlock()
		return nil
	})
	require.NoError(t, err)
	return out
}

// Every rank ends every step with bit-identical parameters, close to the
// float64 reference fed the mean gradient.
func TestMuonRanksBitIdentical(t *testing.T) {
	for _, w := range []int{2, 3} {
		t.Run(fmt.Sprint("W=", w), func(t *testing.T) {
			cfg := DefaultMuonConfig()
			cfg.WeightDecay = 0.01
			got := muonRun(t, w, 5, cfg, nil)
			ps := testParams(t, 5, muonShapes...)
			ref := newRefMuon(cfg, ps, []bool{true, true, true, true, true, false, false})
			for s := 1; s <= 5; s++ {
				mean := make([][]float64, len(ps))
				for r := range w {
					muonGrads(ps, r, s)
					for i, g := range grads64(ps) {
						if mean[i] == nil {
							mean[i] = make([]float64, len(g))
						}
						for k := range g {
							mean[i][k] += g[k] / float64(w)
						}
					}
				}
				ref.step(mean)
			}
			for r := range w {
				for i := range got[r] {
					require.Equal(t, bits(got[0][i]), bits(got[r][i]), "rank %d parameter %d differs from rank 0", r, i)
					for k, x := range got[r][i] {
						require.InDelta(t, ref.p[i][k], float64(x), 1e-6, "parameter %d[%d]", i, k)
					}
				}
			}
		})
	}
}

// fixedSchedule is a test schedule: lr[t-1], NaN beyond.
type fixedSchedule []float32

func (f fixedSchedule) LR(t int64) float32 {
	if t < 1 || int(t) > len(f) {
		return float32(math.NaN())
	}
	return f[t-1]
}

func (f fixedSchedule) String() string { return fmt.Sprint("fixed", []float32(f)) }

// Stopping at step k and resuming from a checkpoint file (both groups on
// schedules) gives bit-identical parameters and state, also when the run
// before or after the checkpoint splits the orthogonalization
// (MuonConfig.Split changes neither the state nor the checkpoint).
func TestMuonResumeIsBitIdentical(t *testing.T) {
	const w, total, k = 2, 6, 3
	cfg := DefaultMuonConfig()
	cfg.WeightDecay = 0.02
	muonLR := fixedSchedule{0.01, 0.02, 0.03, 0.02, 0.01, 0.005}
	adamLR := fixedSchedule{1e-3, 2e-3, 3e-3, 2e-3, 1e-3, 5e-4}
	setup := func(o *Muon) error {
		if err := o.SetSchedule(muonLR); err != nil {
			return err
		}
		return o.SetAdamSchedule(adamLR)
	}
	dir := t.TempDir()
	var mu sync.Mutex
	states := make([]*Checkpoint, w)
	run := func(from int, load, save, split bool) [][][]float32 {
		out := make([][][]float32, w)
		err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
			ps := testParams(t, 6, muonShapes...)
			cfg := cfg
			cfg.Split = split
			opt, err := NewMuon(ctx, c, ps, cfg)
			if err != nil {
				return err
			}
			if err := setup(opt); err != nil {
				return err
			}
			path := fmt.Sprintf("%s/rank%d.ckpt", dir, c.Rank())
			if load {
				ck, err := LoadFile(path)
				if err != nil {
					return err
				}
				if err := opt.Load(ck); err != nil {
					return err
				}
			}
			to := total
			if save {
				to = k
			}
			for s := from; s <= to; s++ {
				muonGrads(ps, c.Rank(), s)
				if err := opt.Step(ctx); err != nil {
					return err
				}
			}
			ck, err := opt.State()
			if err != nil {
				return err
			}
			if save {
				if err := SaveFile(path, ck); err != nil {
					return err
				}
			}
			mu.Lock()
			out[c.Rank()] = snapshot(ps)
			if !save {
				states[c.Rank()] = ck
			}
			mu.Unlock()
			return nil
		})
		require.NoError(t, err)
		return out
	}
	want := run(1, false, false, false)
	wantState := states[0]
	for _, split := range [][2]bool{{false, false}, {true, false}, {false, true}} {
		run(1, false, true, split[0])
		got := run(k+1, true, false, split[1])
		for r := range want {
			for i := range want[r] {
				assert.Equal(t, bits(want[r][i]), bits(got[r][i]), "split %v: rank %d param %d", split, r, i)
			}
		}
		assert.Equal(t, wantState, states[0], "split %v: the resumed run's state differs", split)
	}
}

// A non-finite gradient on one rank skips the step on every rank and
// changes nothing; the step count of bias correction does not advance.
func TestMuonSkipsNonFiniteStep(t *testing.T) {
	const w = 2
	cfg := DefaultMuonConfig()
	want := muonRun(t, w, 3, cfg, nil) // steps 1, 2, 3
	var mu sync.Mutex
	got := make([][][]float32, w)
	err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 5, muonShapes...)
		opt, err := NewMuon(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		for _, s := range []int{1, 2, -1, 3} {
			muonGrads(ps, c.Rank(), max(s, 1))
			if s < 0 && c.Rank() == 1 {
				ps[2].GradData()[3] = float32(math.Inf(-1))
			}
			var before *Checkpoint
			if s < 0 {
				if before, err = opt.State(); err != nil {
					return err
				}
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if s < 0 {
				after, err := opt.State()
				if err != nil {
					return err
				}
				after.Ints[IntSteps]--
				after.Ints[IntSkipped]--
				if !assert.Equal(t, before, after, "rank %d: the skipped step changed the state", c.Rank()) {
					return fmt.Errorf("changed")
				}
			}
		}
		if st := opt.Stats(); st.Steps != 4 || st.Skipped != 1 {
			return fmt.Errorf("rank %d: stats %+v", c.Rank(), st)
		}
		mu.Lock()
		got[c.Rank()] = snapshot(ps)
		mu.Unlock()
		return nil
	})
	require.NoError(t, err)
	for r := range want {
		for i := range want[r] {
			assert.Equal(t, bits(want[r][i]), bits(got[r][i]), "rank %d param %d", r, i)
		}
	}
}

// A zero momentum matrix gives a zero update (the weight decay aside),
// even with NSEps 0, never a NaN.
func TestMuonZeroMomentum(t *testing.T) {
	for _, eps := range []float32{1e-7, 0} {
		cfg := DefaultMuonConfig()
		cfg.NSEps = eps
		cfg.WeightDecay = 0.5
		ps := testParams(t, 2, []int{3, 4}, []int{4, 3}, []int{2})
		before := snapshot(ps)
		opt, err := NewMuon(context.Background(), nil, ps, cfg)
		require.NoError(t, err)
		require.NoError(t, opt.Step(context.Background())) // gradients are zero
		decay := float32(1 - float64(cfg.LR)*0.5)
		for i := range 2 {
			for k, x := range ps[i].Data() {
				require.Equal(t, before[i][k]*decay, x, "eps %g: %s[%d]", eps, ps[i].Name, k)
			}
		}
		assert.Equal(t, before[2], ps[2].Data(), "AdamW's zero gradient moves nothing")
	}
}

// A momentum that is not finite (here loaded, on every rank) is an error on
// every rank that changes nothing.
func TestMuonNonFiniteMomentum(t *testing.T) {
	for _, split := range []bool{false, true} {
		testMuonNonFiniteMomentum(t, split)
	}
}

func testMuonNonFiniteMomentum(t *testing.T, split bool) {
	cfg := DefaultMuonConfig()
	cfg.Split = split
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 3, []int{4, 6}, []int{3})
		opt, err := NewMuon(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		muonGrads(ps, c.Rank(), 1)
		if err := opt.Step(ctx); err != nil {
			return err
		}
		opt.m[0][5] = float32(math.NaN())
		before, err := opt.State()
		if err != nil {
			return err
		}
		muonGrads(ps, c.Rank(), 2)
		err = opt.Step(ctx)
		assert.ErrorContains(t, err, `optim: Muon step 2: the momentum of "a-param" would not be finite`)
		after, err2 := opt.State()
		if err2 != nil {
			return err2
		}
		assert.Equal(t, fmt.Sprint(before), fmt.Sprint(after), "split %v: rank %d: the refused step changed the state", split, c.Rank())
		if err == nil {
			return fmt.Errorf("rank %d: no error", c.Rank())
		}
		return nil
	})
	require.NoError(t, err)
}

func TestMuonConfigValidate(t *testing.T) {
	require.NoError(t, DefaultMuonConfig().Validate())
	for field, f := range map[string]func(*MuonConfig){
		"LR":              func(c *MuonConfig) { c.LR = -1 },
		"Momentum":        func(c *MuonConfig) { c.Momentum = 1 },
		"NSSteps":         func(c *MuonConfig) { c.NSSteps = 0 },
		"NSCoefficients":  func(c *MuonConfig) { c.NSCoefficients[1] = float32(math.Inf(-1)) },
		"NSEps":           func(c *MuonConfig) { c.NSEps = float32(math.NaN()) },
		"WeightDecay":     func(c *MuonConfig) { c.WeightDecay = -0.1 },
		"AdamLR":          func(c *MuonConfig) { c.AdamLR = float32(math.NaN()) },
		"AdamBeta1":       func(c *MuonConfig) { c.AdamBeta1 = -0.1 },
		"AdamBeta2":       func(c *MuonConfig) { c.AdamBeta2 = 1 },
		"AdamEps":         func(c *MuonConfig) { c.AdamEps = -1 },
		"AdamWeightDecay": func(c *MuonConfig) { c.AdamWeightDecay = float32(math.Inf(1)) },
		"Reduce":          func(c *MuonConfig) { c.Reduce = 99 },
		"RanksPerNode":    func(c *MuonConfig) { c.RanksPerNode = -1 },
		"Params":          func(c *MuonConfig) { c.Params = []string{"w", "b", "w"} },
	} {
		cfg := DefaultMuonConfig()
		f(&cfg)
		err := cfg.Validate()
		var ce *ConfigError
		require.ErrorAs(t, err, &ce, field)
		assert.Equal(t, field, ce.Field)
		_, nerr := NewMuon(context.Background(), nil, testParams(t, 1, []int{2, 2}), cfg)
		assert.EqualError(t, nerr, err.Error(), "NewMuon returns Validate's error")
		assert.ErrorAs(t, nerr, &ce)
	}
}

// Bad parameters and disagreements between ranks are errors on every
// rank, never a hang.
func TestMuonRejectsBadInput(t *testing.T) {
	ps := testParams(t, 1, []int{3, 4}, []int{4})
	for name, tc := range map[string]struct {
		ps   []*Param
		sel  []string
		want string
	}{
		"vector marked":  {ps, []string{"a-param", "b-param"}, `parameter "b-param" of shape [4] is marked for Muon but is not a matrix`},
		"unknown name":   {ps, []string{"nope"}, `names "nope", which is not a parameter`},
		"nothing":        {ps[1:], nil, "no parameter has rank 2 or more"},
		"empty list":     {ps, []string{}, "selects no parameter"},
		"nil parameter":  {[]*Param{ps[0], nil}, nil, "parameter 1 is nil"},
		"scalar matrix?": {testParams(t, 1, []int{}), []string{"a-param"}, "is not a matrix"},
	} {
		cfg := DefaultMuonConfig()
		cfg.Params = tc.sel
		_, err := NewMuon(context.Background(), nil, tc.ps, cfg)
		assert.ErrorContains(t, err, tc.want, name)
		assert.ErrorContains(t, err, "optim: Muon: ", name)
	}

	// On several ranks, every rank fails, whichever rank is at fault.
	for name, tc := range map[string]struct {
		mod  func(rank int, cfg *MuonConfig, shapes *[][]int)
		want [2]string
	}{
		"one rank marks a vector": {func(r int, c *MuonConfig, _ *[][]int) {
			if r == 1 {
				c.Params = []string{"a-param", "b-param"}
			}
		}, [2]string{"rank 1 was given an invalid configuration or invalid parameters", "is not a matrix"}},
		"one rank's config is invalid": {func(r int, c *MuonConfig, _ *[][]int) {
			if r == 0 {
				c.NSSteps = -1
			}
		}, [2]string{"MuonConfig.NSSteps = -1", "rank 0 was given an invalid configuration"}},
		"selections differ": {func(r int, c *MuonConfig, sh *[][]int) {
			*sh = [][]int{{3, 4}, {4, 2}}
			if r == 1 {
				c.Params = []string{"a-param"}
			}
		}, [2]string{"the parameters that use Muon differ between rank 1 and rank 0"}},
		"settings differ": {func(r int, c *MuonConfig, _ *[][]int) {
			if r == 1 {
				c.AdamBeta2 = 0.99
			}
		}, [2]string{"the settings differ"}},
		"shapes differ": {func(r int, c *MuonConfig, sh *[][]int) {
			if r == 1 {
				*sh = [][]int{{4, 3}, {4}}
			}
		}, [2]string{"the parameters (names, shapes or order) differ"}},
	} {
		errs := make([]error, 3)
		err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
			cfg := DefaultMuonConfig()
			shapes := [][]int{{3, 4}, {4}}
			tc.mod(c.Rank(), &cfg, &shapes)
			_, errs[c.Rank()] = NewMuon(ctx, c, testParams(t, 1, shapes...), cfg)
			return nil
		})
		require.NoError(t, err, name)
		for r, err := range errs {
			require.Error(t, err, "%s: rank %d", name, r)
			// The rank at fault has its own error first, the others the agreement's.
			assert.True(t, containsAny(err.Error(), tc.want[:]), "%s: rank %d: %v", name, r, err)
		}
	}
}

func containsAny(s string, subs []string) bool {
	for _, sub := range subs {
		if sub != "" && strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

// Muon refuses another optimizer's checkpoint, and a checkpoint of another
// selection or setting, and changes nothing; Adam refuses Muon's.
func TestMuonCheckpointRefusals(t *testing.T) {
	ctx := context.Background()
	ps := testParams(t, 8, []int{4, 6}, []int{6, 4}, []int{5})
	opt, err := NewMuon(ctx, nil, ps, DefaultMuonConfig())
	require.NoError(t, err)
	muonGrads(ps, 0, 1)
	require.NoError(t, opt.Step(ctx))
	before, err := opt.State()
	require.NoError(t, err)

	other := testParams(t, 8, []int{4, 6}, []int{6, 4}, []int{5})
	adam, err := NewAdam(ctx, nil, other, DefaultAdamConfig())
	require.NoError(t, err)
	fromAdam, err := adam.State()
	require.NoError(t, err)
	err = adam.Load(before)
	assert.ErrorContains(t, err, `made by algorithm "muon", this optimizer is "adam"`)

	selCfg := DefaultMuonConfig()
	selCfg.Params = []string{"a-param"}
	sel, err := NewMuon(ctx, nil, other, selCfg)
	require.NoError(t, err)
	fromSel, err := sel.State()
	require.NoError(t, err)
	nsCfg := DefaultMuonConfig()
	nsCfg.NSSteps = 6
	ns, err := NewMuon(ctx, nil, other, nsCfg)
	require.NoError(t, err)
	fromNS, err := ns.State()
	require.NoError(t, err)
	sched, err := NewMuon(ctx, nil, other, DefaultMuonConfig())
	require.NoError(t, err)
	require.NoError(t, sched.SetAdamSchedule(fixedSchedule{1e-3, 1e-3}))
	fromSched, err := sched.State()
	require.NoError(t, err)

	for name, tc := range map[string]struct {
		ck   *Checkpoint
		want string
	}{
		"adam":      {fromAdam, `made by algorithm "adam", this optimizer is "muon"`},
		"selection": {fromSel, "made with muon_params"},
		"ns steps":  {fromNS, "made with ns_steps 6, this optimizer has 5"},
		"schedule":  {fromSched, `AdamW group: optim: incompatible checkpoint: made with a learning-rate schedule`},
	} {
		err := opt.Load(tc.ck)
		assert.ErrorIs(t, err, ErrIncompatibleCheckpoint, name)
		assert.ErrorContains(t, err, tc.want, name)
		after, err := opt.State()
		require.NoError(t, err)
		assert.Equal(t, before, after, "%s: a refused load changed the optimizer", name)
	}
}

// The two groups have their own learning rates: SetLR and SetSchedule
// drive the Muon group, SetAdamLR and SetAdamSchedule the AdamW group, and
// a scheduled learning rate that is not usable refuses the step on every
// rank with nothing changed.
func TestMuonLearningRates(t *testing.T) {
	ps := testParams(t, 1, []int{3, 4}, []int{4})
	opt, err := NewMuon(context.Background(), nil, ps, DefaultMuonConfig())
	require.NoError(t, err)
	assert.Equal(t, float32(0.02), opt.LR())
	assert.Equal(t, float32(3e-4), opt.AdamLR())
	require.NoError(t, opt.SetLR(0.1))
	require.NoError(t, opt.SetAdamLR(0.01))
	assert.Equal(t, float32(0.1), opt.LR())
	assert.Equal(t, float32(0.01), opt.AdamLR())
	assert.Error(t, opt.SetAdamLR(float32(math.NaN())))
	assert.Error(t, opt.SetAdamSchedule(fixedSchedule{}))
	require.NoError(t, opt.SetAdamSchedule(fixedSchedule{0.5, 0.25}))
	assert.Equal(t, float32(0.1), opt.LR())
	assert.Equal(t, float32(0.5), opt.AdamLR())

	// One step with a known AdamW learning rate: Adam's first step moves
	// every element by lr*g/(|g|+eps), about lr.
	before := snapshot(ps)
	copy(ps[1].GradData(), []float32{1, -1, 2, -2})
	require.NoError(t, opt.Step(context.Background()))
	for k, x := range ps[1].Data() {
		assert.InDelta(t, float64(before[1][k])-0.5*math.Copysign(1, float64(ps[1].GradData()[k])), float64(x), 1e-6)
	}
	assert.Equal(t, float32(0.25), opt.AdamLR())

	// Step 3 is beyond the AdamW schedule: refused on every rank.
	err = local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 1, []int{3, 4}, []int{4})
		o, err := NewMuon(ctx, c, ps, DefaultMuonConfig())
		if err != nil {
			return err
		}
		if c.Rank() == 1 {
			if err := o.SetAdamSchedule(fixedSchedule{0.5}); err != nil {
				return err
			}
		}
		muonGrads(ps, c.Rank(), 1)
		if err := o.Step(ctx); err != nil {
			return err
		}
		before := snapshot(ps)
		err = o.Step(ctx)
		if c.Rank() == 1 {
			assert.ErrorContains(t, err, "AdamW group's schedule fixed[0.5]: learning rate NaN")
		} else {
			assert.ErrorContains(t, err, "rank 1 refused the step")
		}
		assert.Equal(t, before, snapshot(ps))
		assert.Equal(t, int64(1), o.Stats().Steps)
		return nil
	})
	require.NoError(t, err)
}

// StateBytes counts the momentum of each matrix, AdamW's two moments and
// one set of work matrices per shape, to the byte.
func TestMuonStateBytes(t *testing.T) {
	// Two 8x16 views (one transposed) share their work matrices.
	ps := testParams(t, 1, []int{8, 16}, []int{16, 8}, []int{16})
	opt, err := NewMuon(context.Background(), nil, ps, DefaultMuonConfig())
	require.NoError(t, err)
	momentum := 4 * (128 + 128)
	adam := 8 * 16
	work := 4 * (2*8*16 + 2*8*8)
	assert.Equal(t, int64(momentum+adam+work), opt.StateBytes())
}

// Step allocates nothing, with matrices large enough that one product over
// them would make gonum's Sgemm spawn goroutines.
func TestMuonStepAllocatesNothing(t *testing.T) {
	ps := testParams(t, 3, []int{130, 200}, []int{200, 130}, []int{10})
	opt, err := NewMuon(context.Background(), nil, ps, DefaultMuonConfig())
	require.NoError(t, err)
	sf := &StepFlags{Local: []float32{0}}
	require.NoError(t, opt.CarryFlags(sf))
	muonGrads(ps, 0, 1)
	require.NoError(t, opt.Step(context.Background()))
	allocs := testing.AllocsPerRun(3, func() {
		if err := opt.Step(context.Background()); err != nil {
			t.Fatal(err)
		}
	})
	assert.Zero(t, allocs)
}

// The Newton-Schulz iteration maps a matrix to one whose singular values
// are all near 1 (the published coefficients leave them in about
// [0.7, 1.2]).
func TestNewtonSchulzOrthogonalizes(t *testing.T) {
	w := newNSWork(20, 70)
	x := uint32(7)
	for i := range w.x {
		x = x*1664525 + 1013904223
		w.x[i] = float32(int32(x)>>8) / (1 << 23) * float32(1+i%5)
	}
	require.True(t, w.normalize(1e-7))
	w.iterate(DefaultMuonConfig().NSCoefficients, 5)
	// X X^T has the squared singular values as eigenvalues: its diagonal
	// (a weighted mean of them) and its trace tell.
	gemm(true, 20, 20, 70, 1, w.x, 70, w.x, 70, 0, w.a, 20)
	for i := range 20 {
		d := float64(w.a[i*20+i])
		assert.True(t, d > 0.4 && d < 1.5, "diagonal %d = %g", i, d)
	}
}

// A checkpoint keeps both groups' fixed learning rates (the last SetLR's
// and SetAdamLR's), which a Load restores, as PyTorch restores a param
// group's lr.
func TestMuonCheckpointKeepsLearningRates(t *testing.T) {
	ctx := context.Background()
	ps := testParams(t, 1, []int{3, 4}, []int{4})
	opt, err := NewMuon(ctx, nil, ps, DefaultMuonConfig())
	require.NoError(t, err)
	require.NoError(t, opt.SetLR(0.03))
	require.NoError(t, opt.SetAdamLR(0.005))
	ck, err := opt.State()
	require.NoError(t, err)
	back, err := NewMuon(ctx, nil, testParams(t, 1, []int{3, 4}, []int{4}), DefaultMuonConfig())
	require.NoError(t, err)
	require.NoError(t, back.Load(ck))
	assert.Equal(t, float32(0.03), back.LR())
	assert.Equal(t, float32(0.005), back.AdamLR())
}

// Muon's Step carries the training loop's flags in its agreement, as the
// other optimizers' do.
func TestMuonCarriesFlags(t *testing.T) {
	for _, split := range []bool{false, true} {
		testMuonCarriesFlags(t, split)
	}
}

func testMuonCarriesFlags(t *testing.T, split bool) {
	cfg := DefaultMuonConfig()
	cfg.Split = split
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 1, []int{3, 4}, []int{4})
		opt, err := NewMuon(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		sf := &StepFlags{Local: []float32{float32(c.Rank() + 1), 0}}
		if err := opt.CarryFlags(sf); err != nil {
			return err
		}
		muonGrads(ps, c.Rank(), 1)
		if err := opt.Step(ctx); err != nil {
			return err
		}
		assert.Equal(t, []float32{2, 0}, sf.Agreed)
		if c.Rank() == 0 {
			sf.Refuse = fmt.Errorf("stop")
		}
		err = opt.Step(ctx)
		if c.Rank() == 0 {
			assert.EqualError(t, err, "stop")
		} else {
			assert.ErrorContains(t, err, "rank 0 refused the step")
		}
		assert.Equal(t, int64(1), opt.Stats().Steps)
		return nil
	})
	require.NoError(t, err)
}

// In every reduction mode the ranks end bit-identical, with Split as
// without.
func TestMuonReduceModes(t *testing.T) {
	for _, mode := range []ReduceMode{ReduceFP16, ReduceBF16, ReduceTwoLevel} {
		cfg := DefaultMuonConfig()
		cfg.Reduce = mode
		got := muonRun(t, 2, 3, cfg, nil)
		cfg.Split = true
		split := muonRun(t, 2, 3, cfg, nil)
		for i := range got[0] {
			require.Equal(t, bits(got[0][i]), bits(got[1][i]), "%s: parameter %d", mode, i)
			require.Equal(t, bits(got[0][i]), bits(split[0][i]), "%s: parameter %d with Split", mode, i)
			require.Equal(t, bits(got[0][i]), bits(split[1][i]), "%s: parameter %d with Split on rank 1", mode, i)
		}
	}
}

// MuonConfig.Params' errors name the parameters at fault, all of them,
// and the matrices Params could name, at most 10 of each with a count of
// the rest.
func TestMuonParamsErrorsListNames(t *testing.T) {
	var ps []*Param
	for i := range 12 {
		ps = append(ps, NewParam(fmt.Sprintf("m%02d", i), 2, 3))
	}
	ps = append(ps, NewParam("bias", 3))
	const matrices = `the matrices: "m00", "m01", "m02", "m03", "m04", "m05", "m06", "m07", "m08", "m09" and 2 more`
	for name, tc := range map[string]struct {
		sel  []string
		want []string
	}{
		"unknown names": {[]string{"nope", "m03", "gone"}, []string{
			`MuonConfig.Params names "nope", "gone", which are not parameters (` + matrices +
				`; all 13 parameters: "m00", "m01", "m02", "m03", "m04", "m05", "m06", "m07", "m08", "m09" and 3 more)`}},
		"one unknown name": {[]string{"m1"}, []string{`MuonConfig.Params names "m1", which is not a parameter (`}},
		"empty list":       {[]string{}, []string{"MuonConfig.Params selects no parameter", "the matrices it could name: " + matrices[len("the matrices: "):]}},
		"vector marked":    {[]string{"m00", "bias"}, []string{`parameter "bias" of shape [3] is marked for Muon but is not a matrix`, matrices + ")"}},
	} {
		cfg := DefaultMuonConfig()
		cfg.Params = tc.sel
		_, err := NewMuon(context.Background(), nil, ps, cfg)
		require.Error(t, err, name)
		for _, w := range tc.want {
			assert.Contains(t, err.Error(), w, name)
		}
	}
	assert.Equal(t, "none", listNames(nil))
	assert.Equal(t, `"a", "b"`, listNames([]string{"a", "b"}))
}
