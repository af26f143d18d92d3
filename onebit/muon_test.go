package onebit_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/commtest"
	"github.com/lowbit-ml/lowbit/internal/muonref"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// muonModel is the model of the 1-bit Muon tests: wide, tall (transposed
// for the iteration) and 3-D (viewed as 4 x 15) matrices for Muon, a
// vector and a scalar for the auxiliary AdamW.
var muonModel = []struct {
	name  string
	shape []int
}{{"wide", []int{6, 10}}, {"tall", []int{10, 6}}, {"conv", []int{4, 3, 5}}, {"bias", []int{7}}, {"gain", []int{}}}

// muonParams returns the model's parameters with deterministic values.
func muonParams() []*optim.Param {
	ps := make([]*optim.Param, len(muonModel))
	for i, pm := range muonModel {
		ps[i] = optim.NewParam(pm.name, pm.shape...)
		for k := range ps[i].Data() {
			ps[i].Data()[k] = float32(math.Sin(float64(1+100*i+k))) * 0.5
		}
	}
	return ps
}

// muonGrad writes rank r's gradients of step s: pseudo-random and full
// rank (muonref.Noise), of a scale that differs from parameter to
// parameter.
func muonGrad(ps []*optim.Param, r, s int) {
	for i, p := range ps {
		muonref.Noise(p.GradData(), uint32(s*7919+r*104729+i*31+1), float32((1+r)*(1+3*i)))
	}
}

// muonTestConfig is the tests' 1-bit Muon: weight decay in both groups,
// a short warm-up, larger learning rates than the defaults so that the
// steps move the parameters visibly.
func muonTestConfig(freeze int) onebit.MuonConfig {
	cfg := onebit.DefaultMuonConfig()
	cfg.FreezeStep = freeze
	cfg.WarmupAdamWOnly = false // the exact warm-up of both groups; muonWarmupModes set it
	cfg.LR, cfg.WeightDecay = 0.05, 0.1
	cfg.AdamLR, cfg.AdamWeightDecay = 0.01, 0.05
	return cfg
}

// muonMaker makes an optimizer of the tests on a rank.
type muonMaker func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)

// newMuon1 makes 1-bit Muon with cfg.
func newMuon1(cfg onebit.MuonConfig) muonMaker {
	return func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return onebit.NewMuon(ctx, c, ps, cfg)
	}
}

// muonRun runs steps steps of 1-bit Muon with cfg on w ranks of
// comm/local with the gradients of muonGrad, calling after(s, r, opt, ps)
// after every step s on every rank r (concurrently on the ranks).
func muonRun(t *testing.T, w, steps int, cfg onebit.MuonConfig, after func(s, r int, opt *onebit.Muon, ps []*optim.Param) error) {
	t.Helper()
	muonRunWith(t, w, 1, steps, newMuon1(cfg), nil, func(s, r int, opt optim.Optimizer, ps []*optim.Param) error {
		if after == nil {
			return nil
		}
		return after(s, r, opt.(*onebit.Muon), ps)
	})
}

// muonRunWith runs steps first..last of the optimizer mk makes on w ranks
// of comm/local with the gradients of muonGrad, loading cks[rank] first
// (unless cks is nil) and calling after(s, r, opt, ps) after every step.
func muonRunWith(t *testing.T, w, first, last int, mk muonMaker, cks []*optim.Checkpoint, after func(s, r int, opt optim.Optimizer, ps []*optim.Param) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		ps := muonParams()
		opt, err := mk(ctx, c, ps)
		if err != nil {
			return err
		}
		defer opt.Close()
		if cks != nil {
			if err := opt.Load(cks[c.Rank()]); err != nil {
				return err
			}
		}
		for s := first; s <= last; s++ {
			muonGrad(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if after != nil {
				if err := after(s, c.Rank(), opt, ps); err != nil {
					return err
				}
			}
		}
		return nil
	})
	require.NoError(t, err)
}

// muonBits is every parameter's bits.
func muonBits(ps []*optim.Param) [][]uint32 {
	out := make([][]uint32, len(ps))
	for i, p := range ps {
		for _, x := range p.Data() {
			out[i] = append(out[i], math.Float32bits(x))
		}
	}
	return out
}

// Every rank holds bit-identical parameters after every step, on 2, 3 and
// 4 ranks, across the switch from the warm-up to the compression stage,
// although the ranks' momenta differ there (each its own gradients'): the
// only way from a rank's own gradient to the parameters is the exchange.
// So in every state mode, in one bucket and in buckets that cut through
// the matrices.
func TestMuonRanksBitIdentical(t *testing.T) {
	const freeze, steps = 2, 7
	for _, mode := range slices.Concat(muonModes, muonWarmupModes) {
		for _, bucket := range []int{0, 64} {
			for _, w := range []int{2, 3, 4} {
				t.Run(fmt.Sprintf("%s/bucket=%d/W=%d", mode, bucket, w), func(t *testing.T) {
					cfg := muonModeConfig(t, freeze, mode)
					cfg.BucketBytes = bucket
					var mu sync.Mutex
					params := make([][][][]uint32, steps) // [step][rank]
					moms := make([][][]float32, steps)
					for s := range params {
						params[s], moms[s] = make([][][]uint32, w), make([][]float32, w)
					}
					muonRun(t, w, steps, cfg, func(s, r int, opt *onebit.Muon, ps []*optim.Param) error {
						ck, err := opt.State()
						if err != nil {
							return err
						}
						mu.Lock()
						defer mu.Unlock()
						params[s-1][r] = muonBits(ps)
						moms[s-1][r] = ck.Tensor(optim.MomentumBufferPrefix + "wide").Data
						return nil
					})
					for s := range steps {
						for r := 1; r < w; r++ {
							for i, pm := range muonModel {
								require.Equal(t, params[s][0][i], params[s][r][i], "step %d: %s differs between rank 0 and rank %d", s+1, pm.name, r)
							}
							if s+1 <= freeze && !cfg.WarmupAdamWOnly {
								require.Equal(t, moms[s][0], moms[s][r], "step %d (warm-up): the momenta are one", s+1)
							} else {
								require.NotEqual(t, moms[s][0], moms[s][r], "step %d: each rank has its own momentum", s+1)
							}
						}
					}
				})
			}
		}
	}
}

// regroupMuon is 1-bit Muon as the regroup tests run it (regroupCases):
// the warm-up ends at step 2, w0 (3 x 7) is Muon's.
func regroupMuon(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
	return onebit.NewMuon(context.Background(), c, ps, muonTestConfig(2))
}

// muonStates runs steps first..last on w ranks and returns every rank's
// checkpoint after the last step.
func muonStates(t *testing.T, w, first, last int, mk muonMaker, from []*optim.Checkpoint) []*optim.Checkpoint {
	t.Helper()
	out := make([]*optim.Checkpoint, w)
	var mu sync.Mutex
	muonRunWith(t, w, first, last, mk, from, func(s, r int, opt optim.Optimizer, _ []*optim.Param) error {
		if s < last {
			return nil
		}
		ck, err := opt.State()
		mu.Lock()
		out[r] = ck
		mu.Unlock()
		return err
	})
	return out
}

// The warm-up is exact Muon (optim.Muon) with its AdamW, bit for bit, on
// every rank; so is the Muon group on one rank in the compression stage.
// On one rank WarmupAdamWOnly changes nothing: there is nothing to
// exchange, and the warm-up is exact Muon's too.
func TestMuonWarmupIsExactMuon(t *testing.T) {
	const freeze = 4
	exact := func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewMuon(ctx, c, ps, muonTestConfig(freeze).MuonConfig)
	}
	for _, tc := range []struct {
		w           int
		warmupAdamW bool
	}{{1, false}, {3, false}, {1, true}} {
		t.Run(fmt.Sprintf("W=%d/WarmupAdamWOnly=%v", tc.w, tc.warmupAdamW), func(t *testing.T) {
			w, cfg := tc.w, muonTestConfig(freeze)
			cfg.WarmupAdamWOnly = tc.warmupAdamW
			steps := freeze
			if w == 1 {
				steps = freeze + 3
			}
			var mu sync.Mutex
			got := make([][][][]uint32, 2) // [optimizer][step][param] on rank 0
			for k, mk := range []muonMaker{exact, newMuon1(cfg)} {
				got[k] = make([][][]uint32, steps)
				muonRunWith(t, w, 1, steps, mk, nil, func(s, r int, _ optim.Optimizer, ps []*optim.Param) error {
					if r == 0 {
						mu.Lock()
						got[k][s-1] = muonBits(ps)
						mu.Unlock()
					}
					return nil
				})
			}
			for s := range steps {
				for i, pm := range muonModel {
					if s+1 > freeze && i >= 3 {
						continue // the AdamW group is 1-bit Adam's after the warm-up
					}
					require.Equal(t, got[0][s][i], got[1][s][i], "step %d: %s", s+1, pm.name)
				}
			}
		})
	}
}

// A run stopped in the warm-up or in the compression stage and resumed
// from every rank's checkpoint (through its binary form), both learning
// rates on schedules, continues bit for bit as the run that never
// stopped, in every state mode (the bfloat16 momentum's stochastic
// rounding included).
func TestMuonResumeIsBitIdentical(t *testing.T) {
	const w, freeze, total = 3, 2, 8
	muonLR, err := optim.CosineDecay(0.05, 0.005, total)
	require.NoError(t, err)
	adamLR, err := optim.StepDecay(0.01, 0.5, 3)
	require.NoError(t, err)
	for _, mode := range slices.Concat(muonModes, muonWarmupModes) {
		mk := func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			o, err := onebit.NewMuon(ctx, c, ps, muonModeConfig(t, freeze, mode))
			if err != nil {
				return nil, err
			}
			if err := o.SetSchedule(muonLR); err != nil {
				return nil, err
			}
			return o, o.SetAdamSchedule(adamLR)
		}
		want := muonStates(t, w, 1, total, mk, nil)
		for _, stop := range []int{1, 5} {
			t.Run(fmt.Sprintf("%s/stop=%d", mode, stop), func(t *testing.T) {
				mid := muonStates(t, w, 1, stop, mk, nil)
				for r, ck := range mid {
					b, err := ck.MarshalBinary()
					require.NoError(t, err)
					mid[r] = &optim.Checkpoint{}
					require.NoError(t, mid[r].UnmarshalBinary(b))
				}
				got := muonStates(t, w, stop+1, total, mk, mid)
				for r := range w {
					require.Equal(t, ckBits(want[r]), ckBits(got[r]), "rank %d", r)
				}
			})
		}
	}
}

// muonCheckpoints are every rank's checkpoints of a 2-rank run of 1-bit
// Muon in the compression stage, and of the same parameters under exact
// Muon and 1-bit Adam.
func muonCheckpoints(t *testing.T) (own, exact, adam []*optim.Checkpoint) {
	own = muonStates(t, 2, 1, 4, newMuon1(muonTestConfig(2)), nil)
	exact = muonStates(t, 2, 1, 1, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewMuon(ctx, c, ps, muonTestConfig(2).MuonConfig)
	}, nil)
	adam = muonStates(t, 2, 1, 1, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return onebit.NewAdam(ctx, c, ps, onebit.DefaultAdamConfig())
	}, nil)
	return own, exact, adam
}

// Load refuses, changing nothing, another rank's checkpoint, another
// optimizer's (exact Muon's, 1-bit Adam's), one of another freeze step,
// bucket size or state mode, and a truncated one; a checkpoint whose errors were reset
// loads on another rank, its error buffers zero, the momenta that rank's.
func TestMuonLoadRefuses(t *testing.T) {
	own, exact, adam := muonCheckpoints(t)
	otherFreeze := muonStates(t, 2, 1, 4, newMuon1(muonTestConfig(3)), nil)
	bucketCfg := muonTestConfig(2)
	bucketCfg.BucketBytes = 64
	truncated := make([]*optim.Checkpoint, 2)
	for r, ck := range own {
		truncated[r] = &optim.Checkpoint{Algorithm: ck.Algorithm, World: ck.World, Rank: ck.Rank, Stage: ck.Stage, Ints: ck.Ints, Floats: ck.Floats}
		for _, tn := range ck.Tensors {
			if tn.Name == optim.MomentumBufferPrefix+"wide" {
				tn.Data = tn.Data[:3]
			}
			truncated[r].Tensors = append(truncated[r].Tensors, tn)
		}
	}
	type refusal struct {
		name string
		cfg  onebit.MuonConfig
		ck   func(r int) *optim.Checkpoint
		msg  string
	}
	// Every state mode refuses every other's checkpoint, and each exchange
	// the other's.
	var modes []refusal
	for _, made := range muonModes {
		cks := muonStates(t, 2, 1, 3, newMuon1(muonModeConfig(t, 2, made)), nil)
		for _, have := range muonModes {
			if have != made {
				msg := "made with StateMode"
				owners := func(m string) bool { return strings.HasPrefix(m, "owners") }
				switch {
				case owners(made) && owners(have):
					msg = "made with muon_owner_bits"
				case owners(made):
					msg = "made with hyperparameter muon_exchange_owners 1"
				case owners(have) && made == "full":
					msg = "made with the polar exchange"
				}
				modes = append(modes, refusal{have + " loading " + made, muonModeConfig(t, 2, have), func(r int) *optim.Checkpoint { return cks[r] }, msg})
			}
		}
	}
	for _, tc := range append([]refusal{
		{"another rank's", muonTestConfig(2), func(r int) *optim.Checkpoint { return own[1-r] }, "this is rank"},
		{"exact Muon's", muonTestConfig(2), func(r int) *optim.Checkpoint { return exact[r] }, `made by algorithm "muon", this optimizer is "onebit-muon"`},
		{"1-bit Adam's", muonTestConfig(2), func(r int) *optim.Checkpoint { return adam[r] }, `made by algorithm "onebit-adam"`},
		{"another freeze step", muonTestConfig(2), func(r int) *optim.Checkpoint { return otherFreeze[r] }, "freeze_step"},
		{"another bucket size", bucketCfg, func(r int) *optim.Checkpoint { return own[r] }, "buckets of"},
		{"a tensor too short", muonTestConfig(2), func(r int) *optim.Checkpoint { return truncated[r] }, "momentum_buffer/wide"},
	}, modes...) {
		t.Run(tc.name, func(t *testing.T) {
			muonRunWith(t, 2, 1, 1, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				o, err := onebit.NewMuon(ctx, c, ps, tc.cfg)
				if err != nil {
					return nil, err
				}
				before, err := o.State()
				if err != nil {
					return nil, err
				}
				err = o.Load(tc.ck(c.Rank()))
				if !errors.Is(err, optim.ErrIncompatibleCheckpoint) || !strings.Contains(err.Error(), tc.msg) {
					return nil, fmt.Errorf("rank %d: want a refusal saying %q, got %v", c.Rank(), tc.msg, err)
				}
				after, err := o.State()
				if err != nil {
					return nil, err
				}
				if !assert.Equal(t, ckBits(before), ckBits(after), "rank %d: nothing changed", c.Rank()) {
					return nil, errors.New("changed")
				}
				return o, nil
			}, nil, nil)
		})
	}
	t.Run("errors reset", func(t *testing.T) {
		muonRunWith(t, 2, 5, 5, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			o, err := onebit.NewMuon(ctx, c, ps, muonTestConfig(2))
			if err != nil {
				return nil, err
			}
			if err := o.Load(own[c.Rank()]); err != nil { // error buffers not zero
				return nil, err
			}
			reset := own[1-c.Rank()].ResetErrors()
			if err := o.Load(reset); err != nil {
				return nil, err
			}
			ck, err := o.State()
			if err != nil {
				return nil, err
			}
			for _, tn := range ck.Tensors {
				if optim.IsErrorBuffer(tn.Name) {
					assert.Equal(t, make([]float32, len(tn.Data)), tn.Data, "%s starts at zero", tn.Name)
				}
			}
			assert.Equal(t, reset.Tensor(optim.MomentumBufferPrefix+"wide").Data, ck.Tensor(optim.MomentumBufferPrefix+"wide").Data, "the momenta of the rank that made it")
			return o, nil
		}, nil, nil)
	})
}

// Bad input at construction is an error on every rank, none left waiting:
// a parameter marked for Muon that is not a matrix, ranks that disagree on
// which parameters use Muon or on any setting (Muon's, the freeze step,
// the buckets), an invalid config on one rank.
func TestMuonBadInputOnEveryRank(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*onebit.MuonConfig)
		mine string // the error of rank 1, which the edit is applied on
		rest string // every other rank's
	}{
		{"not a matrix", func(c *onebit.MuonConfig) { c.Params = []string{"wide", "bias"} },
			`parameter "bias" of shape [7] is marked for Muon but is not a matrix (Muon needs rank 2 or more; a tensor of higher rank is viewed as rows x the product of the rest; the matrices: "wide", "tall", "conv")`,
			"rank 1 was given an invalid configuration"},
		{"unknown names", func(c *onebit.MuonConfig) { c.Params = []string{"wide", "wid", "tal"} },
			`MuonConfig.Params names "wid", "tal", which are not parameters (the matrices: "wide", "tall", "conv"; all 5 parameters: "wide", "tall", "conv", "bias", "gain")`,
			"rank 1 was given an invalid configuration"},
		{"selection", func(c *onebit.MuonConfig) { c.Params = []string{"wide", "tall"} },
			"the parameters that use Muon differ", "the parameters that use Muon differ"},
		{"freeze step", func(c *onebit.MuonConfig) { c.FreezeStep = 3 }, "the settings differ", "the settings differ"},
		{"warm-up of the AdamW group only", func(c *onebit.MuonConfig) { c.WarmupAdamWOnly = true }, "the settings differ", "the settings differ"},
		{"buckets", func(c *onebit.MuonConfig) { c.BucketBytes = optim.PerParameter }, "the settings differ", "the settings differ"},
		{"momentum", func(c *onebit.MuonConfig) { c.Momentum = 0.9 }, "the settings differ", "the settings differ"},
		{"invalid", func(c *onebit.MuonConfig) { c.FreezeStep = -1 }, "onebit: MuonConfig.FreezeStep = -1: want >= 0", "rank 1 was given an invalid configuration"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			errs := make([]error, 3)
			err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
				cfg := muonTestConfig(2)
				if c.Rank() == 1 {
					tc.edit(&cfg)
				}
				_, errs[c.Rank()] = onebit.NewMuon(ctx, c, muonParams(), cfg)
				return nil
			})
			require.NoError(t, err)
			for r, e := range errs {
				want := tc.rest
				if r == 1 {
					want = tc.mine
				}
				require.ErrorContains(t, e, want, "rank %d", r)
				assert.Contains(t, e.Error(), "onebit: Muon", "rank %d", r)
			}
		})
	}
}

// A zero momentum matrix gives a zero update (the weight decay aside) and
// no NaN, in the warm-up and in the compression stage, even with NSEps 0.
// (In a bucket it shares with other parameters its elements carry the
// bucket's compression noise, which the error feedback cancels over the
// steps; alone in its bucket, zero in, zero out.)
func TestMuonZeroMomentum(t *testing.T) {
	cfg := muonTestConfig(2)
	cfg.NSEps, cfg.BucketBytes = 0, optim.PerParameter
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		ps := muonParams()
		opt, err := onebit.NewMuon(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		defer opt.Close()
		for s := 1; s <= 5; s++ {
			muonGrad(ps, c.Rank(), s)
			clear(ps[0].GradData())
			before := append([]float32(nil), ps[0].Data()...)
			if err := opt.Step(ctx); err != nil {
				return err
			}
			decay := float32(1 - float64(cfg.LR)*float64(cfg.WeightDecay))
			for k, x := range before {
				if ps[0].Data()[k] != float32(x*decay) {
					return fmt.Errorf("step %d: wide[%d] = %v, want the decayed %v", s, k, ps[0].Data()[k], x*decay)
				}
			}
			for _, p := range ps {
				if !optim.Finite(p.Data()) {
					return fmt.Errorf("step %d: %s is not finite", s, p.Name)
				}
			}
		}
		return nil
	})
	require.NoError(t, err)
}

// A Load into a 1-bit Muon whose learning rates differ from the
// checkpoint's replaces each group's with the checkpoint's and logs a
// warning for each, naming the method that keeps its own: SetLR or
// SetAdamLR after Load, which then win.
func TestMuonLoadLRWarnings(t *testing.T) {
	cfg := muonTestConfig(2)
	from, err := onebit.NewMuon(context.Background(), nil, muonParams(), cfg)
	require.NoError(t, err)
	ck, err := from.State()
	require.NoError(t, err)
	cfg.LR, cfg.AdamLR = 0.07, 0.02
	core, logs := observer.New(zapcore.WarnLevel)
	o, err := onebit.NewMuon(context.Background(), nil, muonParams(), cfg, optim.WithLogger(zap.New(core)))
	require.NoError(t, err)
	require.NoError(t, o.Load(ck))
	assert.Equal(t, float32(0.05), o.LR())
	assert.Equal(t, float32(0.01), o.AdamLR())
	var msgs []string
	for _, e := range logs.All() {
		msgs = append(msgs, e.Message)
	}
	require.Len(t, msgs, 2, "%q", msgs)
	assert.Contains(t, msgs[0], "another learning rate: the checkpoint's replaces this optimizer's (call SetLR after Load to keep yours)")
	assert.Contains(t, msgs[1], "another AdamW group learning rate: the checkpoint's replaces this optimizer's (call SetAdamLR after Load to keep yours)")
	require.NoError(t, o.SetLR(0.07))
	require.NoError(t, o.SetAdamLR(0.02))
	assert.Equal(t, float32(0.07), o.LR())
	assert.Equal(t, float32(0.02), o.AdamLR())
}

// An AdamW parameter whose gradient was zero throughout the warm-up (its
// whole frozen v zero: k_p is 1, not the infinite 1/sqrt(0)) steps on
// without error or NaN in every state mode and warm-up once it is given
// gradient, and trains: it does not move in the first step it is given
// gradient, then does.
func TestMuonAllZeroVarianceParameter(t *testing.T) {
	const freeze, steps = 2, 6
	for _, mode := range slices.Concat(muonModes, muonWarmupModes) {
		t.Run(mode, func(t *testing.T) {
			cfg := muonModeConfig(t, freeze, mode)
			cfg.AdamWeightDecay = 0
			err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
				ps := muonParams()
				bias := ps[3]
				opt, err := onebit.NewMuon(ctx, c, ps, cfg)
				if err != nil {
					return err
				}
				defer opt.Close()
				start := append([]float32(nil), bias.Data()...)
				for s := 1; s <= steps; s++ {
					muonGrad(ps, c.Rank(), s)
					if s <= freeze+1 {
						clear(bias.GradData())
					}
					if err := opt.Step(ctx); err != nil {
						return fmt.Errorf("step %d: %w", s, err)
					}
					for _, p := range ps {
						if !optim.Finite(p.Data()) {
							return fmt.Errorf("step %d: %s is not finite", s, p.Name)
						}
					}
					if moved := !slices.Equal(start, bias.Data()); moved != (s > freeze+2) {
						return fmt.Errorf("step %d: bias moved: %v", s, moved)
					}
				}
				return nil
			})
			require.NoError(t, err)
		})
	}
}

// A step in which one rank's gradient is not finite is skipped on every
// rank with nothing changed (parameters, momenta, error buffers),
// counted, and the next steps run on.
func TestMuonSkipsNonFiniteStepOnEveryRank(t *testing.T) {
	const freeze, bad = 2, 4
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
		ps := muonParams()
		opt, err := onebit.NewMuon(ctx, c, ps, muonTestConfig(freeze))
		if err != nil {
			return err
		}
		defer opt.Close()
		for s := 1; s <= 6; s++ {
			muonGrad(ps, c.Rank(), s)
			if s == bad && c.Rank() == 2 {
				ps[1].GradData()[5] = float32(math.Inf(1))
			}
			before, err := opt.State()
			if err != nil {
				return err
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if s != bad {
				continue
			}
			after, err := opt.State()
			if err != nil {
				return err
			}
			delete(before.Ints, optim.IntSteps)
			delete(before.Ints, optim.IntSkipped)
			delete(after.Ints, optim.IntSteps)
			delete(after.Ints, optim.IntSkipped)
			if !assert.Equal(t, ckBits(before), ckBits(after), "rank %d: the skipped step changed the state", c.Rank()) {
				return errors.New("changed")
			}
		}
		if st := opt.Stats(); st.Skipped != 1 || st.Steps != 6 {
			return fmt.Errorf("rank %d: %d steps, %d skipped; want 6 and 1", c.Rank(), st.Steps, st.Skipped)
		}
		return nil
	})
	require.NoError(t, err)
}

// A momentum that would not be finite (here: a non-finite one loaded on
// rank 1) is an error on every rank that changes nothing, in the
// compression stage (where the momenta are each rank's own, refused in
// the step's agreement) and in the warm-up, in every state mode (the
// bfloat16 momentum of compact-bf16 included).
func TestMuonNonFiniteMomentumIsAnErrorOnEveryRank(t *testing.T) {
	for _, tc := range []struct {
		name   string
		freeze int
		mine   string
		modes  []string
	}{
		{"compression", 2, `the momentum of "tall" would not be finite on rank 1`, muonModes},
		{"warm-up", 10, `the momentum of "tall" is not finite on rank 1`, muonModes},
		{"warm-up", 10, `the momentum of "tall" would not be finite on rank 1`, muonWarmupModes},
	} {
		for _, mode := range tc.modes {
			t.Run(tc.name+"/"+mode, func(t *testing.T) {
				cfg := muonModeConfig(t, tc.freeze, mode)
				cks := muonStates(t, 3, 1, 3, newMuon1(cfg), nil)
				cks[1].Tensor(optim.MomentumBufferPrefix + "tall").Data[4] = float32(math.Inf(-1))
				errs := make([]error, 3)
				err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
					ps := muonParams()
					opt, err := onebit.NewMuon(ctx, c, ps, cfg)
					if err != nil {
						return err
					}
					defer opt.Close()
					if err := opt.Load(cks[c.Rank()]); err != nil {
						return err
					}
					muonGrad(ps, c.Rank(), 4)
					errs[c.Rank()] = opt.Step(ctx)
					after, err := opt.State()
					if err != nil {
						return err
					}
					assert.Equal(t, ckBits(cks[c.Rank()]), ckBits(after), "rank %d: nothing changed", c.Rank())
					return nil
				})
				require.NoError(t, err)
				for r, e := range errs {
					want := "rank 1 refused the step"
					if r == 1 {
						want = tc.mine
					}
					require.ErrorContains(t, e, want, "rank %d", r)
				}
			})
		}
	}
}

// Flags carried by the step's agreement reach every rank.
func TestMuonCarriesFlags(t *testing.T) {
	var agreed [3][]float32
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
		ps := muonParams()
		o, err := onebit.NewMuon(ctx, c, ps, muonTestConfig(1))
		if err != nil {
			return err
		}
		defer o.Close()
		sf := &optim.StepFlags{Local: []float32{float32(c.Rank()), 0}}
		if err := o.CarryFlags(sf); err != nil {
			return err
		}
		for s := 1; s <= 3; s++ {
			muonGrad(ps, c.Rank(), s)
			sf.Local[1] = float32(s * c.Rank())
			if err := o.Step(ctx); err != nil {
				return err
			}
		}
		agreed[c.Rank()] = sf.Agreed
		return nil
	})
	require.NoError(t, err)
	for r := range agreed {
		assert.Equal(t, []float32{2, 6}, agreed[r], "rank %d", r)
	}
}

// Regroup carries 1-bit Muon to another number of ranks with every new
// rank's momenta the mean of the old ranks' (which differ in the
// compression stage), and the regrouped run holds the same parameters on
// every rank.
func TestMuonRegroupMeansTheMomenta(t *testing.T) {
	three := muonStates(t, 3, 1, 4, newMuon1(muonTestConfig(2)), nil)
	require.Equal(t, optim.StageCompression, three[0].Stage)
	two := make([]*optim.Checkpoint, 2)
	for r := range two {
		var err error
		two[r], err = onebit.Regroup(three, 2, r)
		require.NoError(t, err)
		require.NotContains(t, two[r].Ints, onebit.IntForeignMomentum)
		for _, pm := range muonModel[:3] {
			name := optim.MomentumBufferPrefix + pm.name
			want := meanOf(three, name, len(three[0].Tensor(name).Data))
			got := two[r].Tensor(name).Data
			for k := range want {
				require.Equal(t, float32(want[k]), got[k], "%s[%d] on new rank %d", name, k, r)
			}
		}
	}
	require.NotEqual(t, three[0].Tensor(optim.MomentumBufferPrefix+"wide").Data, three[1].Tensor(optim.MomentumBufferPrefix+"wide").Data)
	var mu sync.Mutex
	params := make([][][]uint32, 2)
	muonRunWith(t, 2, 5, 7, newMuon1(muonTestConfig(2)), two, func(s, r int, _ optim.Optimizer, ps []*optim.Param) error {
		mu.Lock()
		params[r] = muonBits(ps)
		mu.Unlock()
		return nil
	})
	require.Equal(t, params[0], params[1])
}

// muonBigParams are matrices large enough for the traffic and memory
// figures to be the buffers', not the headers': two Muon matrices (256 x
// 128 and 128 x 256) and a bias for AdamW.
func muonBigParams() []*optim.Param {
	ps := []*optim.Param{optim.NewParam("up", 256, 128), optim.NewParam("down", 128, 256), optim.NewParam("bias", 256)}
	for i, p := range ps {
		for k := range p.Data() {
			p.Data()[k] = float32(math.Sin(float64(1+100*i+k))) * 0.1
		}
	}
	return ps
}

// After the warm-up a step of 1-bit Muon sends at least 30 times fewer
// bytes than a step of exact Muon on the same parameters and ranks
// (comm/local's count of every collective, the per-step agreement
// included).
func TestMuonBytesPerStep(t *testing.T) {
	const w, steps = 4, 3
	cfg := onebit.DefaultMuonConfig()
	cfg.FreezeStep = 1
	exact, _ := muonStepBytes(t, w, steps, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewMuon(ctx, c, ps, cfg.MuonConfig)
	})
	compressed, stage := muonStepBytes(t, w, steps, newMuon1(cfg))
	require.Equal(t, optim.StageCompression, stage)
	ratio := float64(exact) / float64(compressed)
	t.Logf("bytes sent by rank 0 in step %d on %d ranks: exact Muon %d, 1-bit Muon %d: %.1fx fewer", steps, w, exact, compressed, ratio)
	assert.GreaterOrEqual(t, ratio, 30.0)
}

// StateBytes counts every buffer: on 4 ranks 13 bytes per element of a
// Muon matrix (its momentum 4, its slot of the exchange 4, the worker
// error 4 and the server error 1) besides the wire buffers and the
// Newton-Schulz work matrices, as docs/muon.md says; here in one bucket
// (without WarmupAdamWOnly, which cuts it in two: costmodel's
// TestMuonStateBytesMatchOptimizers pins that layout to the byte).
func TestMuonStateBytes(t *testing.T) {
	const w = 4
	err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		ps := muonBigParams()
		cfg := onebit.DefaultMuonConfig()
		cfg.WarmupAdamWOnly = false
		opt, err := onebit.NewMuon(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		defer opt.Close()
		if c.Rank() != 0 {
			return nil
		}
		n, nMuon, nAux := 0, 256*128*2, 256
		for _, p := range ps {
			n += p.Numel()
		}
		sts := onebit.MuonBucketStates(opt)
		require.Len(t, sts, 1)
		work := int64(4 * (2*128*256 + 2*128*128)) // one set for both shapes
		own := int64(4*nMuon + 4*n + 4*nAux + 4*len(ps))
		assert.Equal(t, own+work+sts[0].StateBytes(), opt.StateBytes())
		pad := onebit.PaddedLen(n, w)
		errBytes := int64(4*pad + 4*pad/w)
		wire := sts[0].StateBytes() - errBytes
		perMuon := float64(4*nMuon+4*nMuon) / float64(nMuon)
		t.Logf("per element of a Muon matrix on %d ranks: momentum and slot %.2f, error buffers %.2f, wire buffers %.2f (these %d elements; a share that falls with the model), work matrices %.2f (one set per shape)",
			w, perMuon, float64(errBytes)/float64(n), float64(wire)/float64(n), n, float64(work)/float64(nMuon))
		assert.InDelta(t, 13, perMuon+float64(errBytes)/float64(n), 0.01)
		return nil
	})
	require.NoError(t, err)
}

// Once running, a step allocates nothing: on one rank in both stages, and
// on two ranks (both ranks' goroutines counted) in the compression stage.
func TestMuonStepAllocatesNothing(t *testing.T) {
	ctx := adamCtx(t)
	ps := muonParams()
	opt, err := onebit.NewMuon(ctx, nil, ps, muonTestConfig(4))
	require.NoError(t, err)
	muonGrad(ps, 0, 1)
	require.NoError(t, opt.Step(ctx))
	assert.Zero(t, testing.AllocsPerRun(1, func() { require.NoError(t, opt.Step(ctx)) }), "warm-up")
	require.NoError(t, opt.Step(ctx)) // the switch, which logs it
	require.Equal(t, optim.StageCompression, opt.Stage())
	assert.Zero(t, testing.AllocsPerRun(10, func() { require.NoError(t, opt.Step(ctx)) }), "compression")

	assert.Zero(t, muonStepAllocsOnTwoRanks(t, muonTestConfig(1)), "two ranks")
}

// muonStepAllocsOnTwoRanks is the allocations of a compression step of
// 1-bit Muon with cfg (FreezeStep 1) on two ranks, both ranks' counted.
func muonStepAllocsOnTwoRanks(t *testing.T, cfg onebit.MuonConfig) float64 {
	t.Helper()
	ctx := adamCtx(t)
	cs, err := local.New(2)
	require.NoError(t, err)
	opts := make([]*onebit.Muon, 2)
	var wg sync.WaitGroup
	for r := range cs {
		wg.Go(func() { // NewMuon is a collective
			ps := muonParams()
			muonGrad(ps, r, 1)
			var err error
			opts[r], err = onebit.NewMuon(ctx, cs[r], ps, cfg)
			if assert.NoError(t, err) {
				for range 2 {
					assert.NoError(t, opts[r].Step(ctx))
				}
			}
		})
	}
	wg.Wait()
	require.NotNil(t, opts[0])
	require.NotNil(t, opts[1])
	require.Equal(t, optim.StageCompression, opts[0].Stage())
	return stepAllocsOnTwoRanks(t, func() error { return opts[0].Step(ctx) }, func() error { return opts[1].Step(ctx) })
}

// stepAllocsOnTwoRanks is commtest.AllocsOnTwoRanks over 10 runs, a
// step's error a test error.
func stepAllocsOnTwoRanks(t *testing.T, step0, step1 func() error) float64 {
	t.Helper()
	allocs, err := commtest.AllocsOnTwoRanks(10, step0, step1)
	if err != nil {
		t.Error(err)
	}
	return allocs
}
