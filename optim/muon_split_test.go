package optim

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// splitRun runs steps 1..steps of Muon on w in-process ranks over
// parameters of the given shapes and returns, per step, every rank's
// parameters and momenta (Muon's and AdamW's first moments). Step 3 is
// skipped (an infinite gradient on the last rank), and the gradient of the
// first matrix is zero on every rank at step 2 (a zero momentum with
// Momentum 0, after a step that was not).
func splitRun(t *testing.T, w, steps int, shapes [][]int, cfg MuonConfig, sched bool) (params, moms [][][][]float32) {
	t.Helper()
	params, moms = make([][][][]float32, steps), make([][][][]float32, steps)
	for s := range params {
		params[s], moms[s] = make([][][]float32, w), make([][][]float32, w)
	}
	var mu sync.Mutex
	err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 5, shapes...)
		opt, err := NewMuon(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		defer opt.Close()
		if (opt.split != nil) != (cfg.Split && w > 1) {
			return fmt.Errorf("rank %d: split plan %v with Split %v on %d ranks", c.Rank(), opt.split != nil, cfg.Split, w)
		}
		if sched {
			if err := opt.SetSchedule(fixedSchedule{0.01, 0.02, 0.03, 0.02, 0.01, 0.005}); err != nil {
				return err
			}
			if err := opt.SetAdamSchedule(fixedSchedule{1e-3, 2e-3, 3e-3, 2e-3, 1e-3, 5e-4}); err != nil {
				return err
			}
		}
		for s := 1; s <= steps; s++ {
			muonGrads(ps, c.Rank(), s)
			if s == 2 {
				clear(ps[0].GradData())
			}
			if s == 3 && c.Rank() == w-1 {
				ps[1].GradData()[2] = float32(math.Inf(1))
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
			m := make([][]float32, len(opt.m))
			for i := range m {
				m[i] = append([]float32(nil), opt.m[i]...)
			}
			mu.Lock()
			params[s-1][c.Rank()], moms[s-1][c.Rank()] = snapshot(ps), m
			mu.Unlock()
		}
		if st := opt.Stats(); st.Skipped != 1 {
			return fmt.Errorf("rank %d: stats %+v, want one skipped step", c.Rank(), st)
		}
		return nil
	})
	require.NoError(t, err)
	return params, moms
}

// With Split, every parameter and momentum is bit for bit what it is
// without, after every step, on 2, 3 and 4 ranks, with and without
// Nesterov, weight decay and schedules on both groups, a zero momentum
// and a skipped step; and on more ranks than matrices (ranks that own
// none).
func TestMuonSplitBitIdentical(t *testing.T) {
	const steps = 5
	for _, tc := range []struct {
		name   string
		shapes [][]int
		cfg    func(*MuonConfig)
		sched  bool
	}{
		{"defaults", muonShapes, func(*MuonConfig) {}, false},
		{"plain-momentum-decay", muonShapes, func(c *MuonConfig) { c.Nesterov = false; c.WeightDecay = 0.1; c.AdamWeightDecay = 0.05 }, false},
		{"no-momentum", muonShapes, func(c *MuonConfig) { c.Momentum = 0; c.WeightDecay = 0.1 }, false},
		{"schedules", muonShapes, func(c *MuonConfig) { c.WeightDecay = 0.02; c.NSSteps = 3 }, true},
		{"fewer-matrices", [][]int{{3, 4}, {6, 2}, {4}}, func(c *MuonConfig) { c.WeightDecay = 0.1 }, false},
	} {
		for _, w := range []int{2, 3, 4} {
			t.Run(fmt.Sprintf("%s/W=%d", tc.name, w), func(t *testing.T) {
				cfg := DefaultMuonConfig()
				tc.cfg(&cfg)
				wantP, wantM := splitRun(t, w, steps, tc.shapes, cfg, tc.sched)
				cfg.Split = true
				gotP, gotM := splitRun(t, w, steps, tc.shapes, cfg, tc.sched)
				for s := range steps {
					for r := range w {
						for i := range gotP[s][r] {
							require.Equal(t, bits(wantP[s][r][i]), bits(gotP[s][r][i]), "step %d rank %d parameter %d", s+1, r, i)
							require.Equal(t, bits(wantM[s][r][i]), bits(gotM[s][r][i]), "step %d rank %d momentum %d", s+1, r, i)
							require.Equal(t, bits(gotP[s][0][i]), bits(gotP[s][r][i]), "step %d: rank %d parameter %d differs from rank 0", s+1, r, i)
						}
					}
				}
				assert.NotEqual(t, bits(wantP[0][0][0]), bits(wantP[steps-1][0][0]), "the parameters moved")
			})
		}
	}
}

// The plan balances the Newton-Schulz cost: on the GPT example's shapes at
// W = 4 every rank orthogonalizes a quarter of the flops and a quarter of
// the elements (no padding); matrices without elements get no owner; a
// rank may own none; the plan depends only on the shapes and W.
func TestMuonSplitPlan(t *testing.T) {
	ps, hidden := gptParams(64, 256, 2, 64)
	cfg := DefaultMuonConfig()
	cfg.Params = hidden
	o, err := NewMuon(context.Background(), nil, ps, cfg)
	require.NoError(t, err)
	dims := make([][2]int, len(o.mats))
	var total int64
	var elems int
	for k, mt := range o.mats {
		dims[k] = [2]int{mt.rows, mt.cols}
		total += nsCost(mt.rows, mt.cols)
		elems += mt.rows * mt.cols
	}
	require.Len(t, dims, 12)
	assert.Equal(t, int64(3*64*64*256+64*64*64), nsCost(256, 64), "r <= c is the smaller dimension")
	owner, off, share := splitMatrices(dims, 4)
	load := make([]int64, 4)
	for k, r := range owner {
		load[r] += nsCost(dims[k][0], dims[k][1])
	}
	assert.Equal(t, []int64{total / 4, total / 4, total / 4, total / 4}, load)
	assert.Equal(t, elems/4, share)
	t.Logf("GPT (d 64, ffn 256, 2 blocks), %d NS steps: %d flops per rank per step without Split, %d with Split at W=4; S = %d of %d elements",
		cfg.NSSteps, int64(cfg.NSSteps)*total, int64(cfg.NSSteps)*load[0], share, elems)
	o2, off2, share2 := splitMatrices(dims, 4)
	assert.Equal(t, owner, o2)
	assert.Equal(t, off, off2)
	assert.Equal(t, share, share2)

	// Largest first onto the least-loaded rank; offsets in order within
	// each share; the empty matrix has no owner; on 5 ranks rank 4 owns
	// nothing.
	small := [][2]int{{2, 3}, {0, 5}, {8, 4}, {4, 8}, {1, 1}}
	owner, off, share = splitMatrices(small, 3)
	assert.Equal(t, []int{2, -1, 0, 1, 2}, owner)
	assert.Equal(t, []int{0, 0, 0, 0, 6}, off)
	assert.Equal(t, 32, share)
	owner, _, share = splitMatrices(small, 5)
	assert.Equal(t, []int{2, -1, 0, 1, 3}, owner)
	assert.Equal(t, 32, share)
	owner, _, share = splitMatrices([][2]int{{2, 3}, {8, 4}}, 1)
	assert.Equal(t, []int{0, 0}, owner)
	assert.Equal(t, 38, share)
}

// Ranks that disagree on Split get an error on every rank.
func TestMuonSplitAgreement(t *testing.T) {
	errs := make([]error, 3)
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
		cfg := DefaultMuonConfig()
		cfg.Split = c.Rank() == 1
		_, errs[c.Rank()] = NewMuon(ctx, c, testParams(t, 1, []int{3, 4}, []int{4}), cfg)
		return nil
	})
	require.NoError(t, err)
	for r, err := range errs {
		assert.ErrorContains(t, err, "optim: Muon: ranks disagree: the settings differ", "rank %d", r)
	}
}

// StateBytes adds the all-gather's buffers, (W+1)*S float32s, and a step
// sends (W-1)*S float32s more than without Split; Split does nothing on
// one rank.
func TestMuonSplitStateBytes(t *testing.T) {
	shapes := [][]int{{8, 16}, {16, 8}, {4, 4}, {16}}
	cfg := DefaultMuonConfig()
	base, err := NewMuon(context.Background(), nil, testParams(t, 1, shapes...), cfg)
	require.NoError(t, err)
	cfg.Split = true
	one, err := NewMuon(context.Background(), nil, testParams(t, 1, shapes...), cfg)
	require.NoError(t, err)
	assert.Nil(t, one.split, "Split on one process")
	assert.Equal(t, base.StateBytes(), one.StateBytes())
	require.NoError(t, local.Run(context.Background(), 1, func(ctx context.Context, c comm.Comm) error {
		o, err := NewMuon(ctx, c, testParams(t, 1, shapes...), cfg)
		if err != nil {
			return err
		}
		assert.Nil(t, o.split, "Split on one rank")
		assert.Equal(t, base.StateBytes(), o.StateBytes())
		return nil
	}))
	const w = 3
	run := func(split bool) (state, sent []int64) {
		state, sent = make([]int64, w), make([]int64, w)
		cfg.Split = split
		err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
			ps := testParams(t, 1, shapes...)
			o, err := NewMuon(ctx, c, ps, cfg)
			if err != nil {
				return err
			}
			muonGrads(ps, c.Rank(), 1)
			if err := o.Step(ctx); err != nil {
				return err
			}
			state[c.Rank()], sent[c.Rank()] = o.StateBytes(), o.Stats().LastStepBytes
			return nil
		})
		require.NoError(t, err)
		return state, sent
	}
	baseState, baseSent := run(false)
	state, sent := run(true)
	const share = 128 // the two 8x16 on ranks 0 and 1, the 4x4 on rank 2
	for r := range w {
		assert.Equal(t, base.StateBytes(), baseState[r], "rank %d without Split", r)
		assert.Equal(t, base.StateBytes()+4*(w+1)*share, state[r], "rank %d", r)
		assert.Equal(t, baseSent[r]+4*(w-1)*share, sent[r], "rank %d's bytes sent", r)
	}
}

// With Split, Step allocates nothing on either of two ranks, with
// matrices large enough that one product over them would make gonum's
// Sgemm spawn goroutines.
func TestMuonSplitStepAllocatesNothing(t *testing.T) {
	const runs = 3
	cs, err := local.New(2)
	require.NoError(t, err)
	ctx := context.Background()
	cfg := DefaultMuonConfig()
	cfg.Split = true
	opts := make([]*Muon, 2)
	var wg sync.WaitGroup
	for r := range cs {
		wg.Go(func() {
			ps := testParams(t, 3, []int{130, 200}, []int{200, 130}, []int{70, 70}, []int{10})
			muonGrads(ps, r, 1)
			var err error
			opts[r], err = NewMuon(ctx, cs[r], ps, cfg)
			if assert.NoError(t, err) {
				assert.NoError(t, opts[r].Step(ctx))
			}
		})
	}
	wg.Wait()
	require.NotNil(t, opts[0])
	require.NotNil(t, opts[1])
	allocs := allocsOnTwoRanks(t, runs, func() error { return opts[0].Step(ctx) }, func() error { return opts[1].Step(ctx) })
	assert.Zero(t, allocs)
	assert.Zero(t, opts[0].Stats().Skipped)
}

// With Split each rank runs Newton-Schulz on its own matrices only: the
// work matrices of a shape that another rank owns are never written.
func TestMuonSplitOrthogonalizesOwnShare(t *testing.T) {
	cfg := DefaultMuonConfig()
	cfg.Split = true
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 1, []int{6, 10}, []int{3, 4}, []int{5})
		o, err := NewMuon(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		muonGrads(ps, c.Rank(), 1)
		if err := o.Step(ctx); err != nil {
			return err
		}
		for k, mt := range o.mats {
			mine := o.split.owner[k] == c.Rank()
			assert.Equal(t, mine, slices.ContainsFunc(mt.ns.x, func(x float32) bool { return x != 0 }),
				"rank %d matrix %d (owner %d)", c.Rank(), k, o.split.owner[k])
		}
		return nil
	})
	require.NoError(t, err)
}
