package onebit_test

// MuonConfig.WarmupAdamWOnly: the Muon matrices through the 1-bit
// exchange from the first step, only the AdamW group exact in the
// warm-up. TestMuonMatchesFloat64Reference pins its steps;
// TestMuonRanksBitIdentical and TestMuonResumeIsBitIdentical run it in
// every state mode (muonWarmupModes).

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// muonStepBytes runs steps steps on w ranks of muonBigParams and returns
// rank 0's bytes of the last step and the stage after it.
func muonStepBytes(t *testing.T, w, steps int, mk muonMaker) (last int64, stage optim.Stage) {
	t.Helper()
	var mu sync.Mutex
	err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		ps := muonBigParams()
		opt, err := mk(ctx, c, ps)
		if err != nil {
			return err
		}
		defer opt.Close()
		for s := 1; s <= steps; s++ {
			muonGrad(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		if c.Rank() == 0 {
			mu.Lock()
			last, stage = opt.Stats().LastStepBytes, opt.Stats().Stage
			mu.Unlock()
		}
		return nil
	})
	require.NoError(t, err)
	return last, stage
}

// In the warm-up of WarmupAdamWOnly a step sends the Muon group's 1-bit
// messages and the AdamW group's float32 average: on these parameters
// (65,536 Muon elements, 256 AdamW ones) more than 25 times fewer bytes
// than a step of the exact warm-up, and no more than a compression step's
// plus the AdamW group's exact average (2(W-1)/W * 4 bytes per element,
// with the averager's headers).
func TestMuonWarmupAdamWOnlyBytes(t *testing.T) {
	const w = 4
	cfg := onebit.DefaultMuonConfig()
	cfg.FreezeStep, cfg.WarmupAdamWOnly = 10, false
	exact, stage := muonStepBytes(t, w, 3, newMuon1(cfg))
	require.Equal(t, optim.StageWarmup, stage)
	cfg.WarmupAdamWOnly = true
	mixed, stage := muonStepBytes(t, w, 3, newMuon1(cfg))
	require.Equal(t, optim.StageWarmup, stage)
	cfg.FreezeStep = 1
	compressed, stage := muonStepBytes(t, w, 3, newMuon1(cfg))
	require.Equal(t, optim.StageCompression, stage)
	adamW := int64(2 * (w - 1) * 256 * 4 / w)
	t.Logf("bytes sent by rank 0 in a step on %d ranks: exact warm-up %d, warm-up of the AdamW group only %d (%.1fx fewer), compression %d",
		w, exact, mixed, float64(exact)/float64(mixed), compressed)
	assert.Greater(t, float64(exact)/float64(mixed), 25.0)
	assert.Greater(t, mixed, compressed, "the AdamW group's exact average is sent besides")
	assert.LessOrEqual(t, mixed, compressed+adamW+256, "the Muon group's 1-bit messages and the AdamW group's average")
}

// A checkpoint of one layout does not load into the other: without
// WarmupAdamWOnly into with it (the buckets are cut elsewhere) and back
// (the hyperparameter it records), on every rank, nothing changed; a
// checkpoint with its errors reset loads across them.
func TestMuonWarmupAdamWOnlyLoadRefuses(t *testing.T) {
	const w = 2
	plain := muonModeConfig(t, 2, "full")
	plain.BucketBytes = 64
	mixed := plain
	mixed.WarmupAdamWOnly = true
	for _, tc := range []struct {
		name        string
		made, loads onebit.MuonConfig
		want        string
	}{
		{"without into with", plain, mixed, "cut"},
		{"with into without", mixed, plain, "warmup_adamw_only"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cks := muonStates(t, w, 1, 3, newMuon1(tc.made), nil)
			err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
				ps := muonParams()
				opt, err := onebit.NewMuon(ctx, c, ps, tc.loads)
				if err != nil {
					return err
				}
				before := muonBits(ps)
				err = opt.Load(cks[c.Rank()])
				if assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint) {
					assert.ErrorContains(t, err, tc.want)
				}
				assert.Equal(t, before, muonBits(ps), "nothing changed")
				assert.Equal(t, int64(0), opt.Stats().Steps)
				if tc.want == "cut" {
					assert.NoError(t, opt.Load(cks[c.Rank()].ResetErrors()))
				}
				return nil
			})
			require.NoError(t, err)
		})
	}
}

// Regroup carries a run of WarmupAdamWOnly, in the warm-up and in the
// compression stage, with buckets cut at BucketBytes and where the AdamW
// group begins, from 3 ranks to 2 and from one rank to 2: the new group
// loads the result and continues with bit-identical parameters on every
// rank, its worker errors the old ranks' mean.
func TestMuonWarmupAdamWOnlyRegroup(t *testing.T) {
	for _, mode := range []string{"full+warmup-adamw", "compact-bf16+warmup-adamw"} {
		for _, tc := range []struct {
			name      string
			from, at  int
			wantStage optim.Stage
		}{{"3 to 2 in the warm-up", 3, 2, optim.StageWarmup}, {"3 to 2 compressing", 3, 5, optim.StageCompression}, {"1 to 2", 1, 2, optim.StageWarmup}} {
			t.Run(mode+"/"+tc.name, func(t *testing.T) {
				cfg := muonModeConfig(t, 3, mode)
				cfg.BucketBytes = 64
				old := muonStates(t, tc.from, 1, tc.at, newMuon1(cfg), nil)
				require.Equal(t, tc.wantStage, old[0].Stage)
				two := regroupAll(t, old, 2)
				if tc.from > 1 {
					const n = 64 / 4 // bucket 0's elements, unpadded
					name := onebit.BucketWorkerErrorName(0)
					want := meanOf(old, name, n)
					require.NotZero(t, want[0])
					got := two[1].Tensor(name).Data
					for k := range want[:n] {
						require.InDelta(t, want[k], got[k], 1e-2*(1+abs64(want[k])), "%s[%d]", name, k)
					}
				}
				var mu sync.Mutex
				params := make([][][]uint32, 2)
				muonRunWith(t, 2, tc.at+1, tc.at+3, newMuon1(cfg), two, func(s, r int, _ optim.Optimizer, ps []*optim.Param) error {
					mu.Lock()
					params[r] = muonBits(ps)
					mu.Unlock()
					return nil
				})
				require.Equal(t, params[0], params[1])
			})
		}
	}
}

func abs64(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}

// A step of WarmupAdamWOnly's warm-up allocates nothing on two ranks
// (both ranks' goroutines counted), as the compression stage's.
func TestMuonWarmupAdamWOnlyAllocatesNothing(t *testing.T) {
	for _, mode := range []string{"full+warmup-adamw", "compact-bf16+warmup-adamw"} {
		cfg := muonModeConfig(t, 100, mode)
		ctx := adamCtx(t)
		cs, err := local.New(2)
		require.NoError(t, err)
		opts := make([]*onebit.Muon, 2)
		var wg sync.WaitGroup
		for r := range cs {
			wg.Go(func() {
				ps := muonParams()
				muonGrad(ps, r, 1)
				var err error
				opts[r], err = onebit.NewMuon(ctx, cs[r], ps, cfg)
				if assert.NoError(t, err) {
					assert.NoError(t, opts[r].Step(ctx))
				}
			})
		}
		wg.Wait()
		require.NotNil(t, opts[0])
		require.NotNil(t, opts[1])
		require.Equal(t, optim.StageWarmup, opts[0].Stage())
		assert.Zero(t, stepAllocsOnTwoRanks(t, func() error { return opts[0].Step(ctx) }, func() error { return opts[1].Step(ctx) }), mode)
	}
}
