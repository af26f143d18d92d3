package onebit_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

// The probe of elements that never get a gradient: 3 ranks, an embedding
// "emb" of 10 rows of 6, a parameter "dense" of 23 elements and a matrix
// "mat" of 4 x 5 (1-bit Muon's Muon group; emb and dense are its AdamW
// group's), 30 steps at lr 0.01. Rows 0-2 of emb and dense get noisy gradient on every rank
// from the start; rows 4 and 5 never get any, on any rank; rows 8 and 9
// get noisy gradient but for their first three columns, which never get
// any; row 6 gets gradient from step ngLate on (after every warm-up) on
// rank 0 only; row 7 gets gradient at step ngPulse only, on the last rank
// only (a local step of 0/1 Adam's phase B); row 3 gets gradient at steps
// ngLate and ngLate+1 only, on rank 1 only (a variance step of 0/1 Adam's
// phase A, then a step that compresses the gradient).
const (
	ngWorld, ngSteps, ngLate, ngPulse = 3, 30, 6, 19
	ngRows, ngCols                    = 10, 6
)

// ngNever says whether element j of emb never gets a gradient.
func ngNever(j int) bool {
	row, col := j/ngCols, j%ngCols
	return row == 4 || row == 5 || row >= 8 && col < 3
}

// ngGrads writes rank r's gradients of step s.
func ngGrads(ps []*optim.Param, r, s int) {
	probeGrads(ps, r, s, func(j int, g float32) float32 {
		switch row := j / ngCols; {
		case ngNever(j), row == 6 && (r != 0 || s < ngLate), row == 7 && (r != ngWorld-1 || s != ngPulse),
			row == 3 && (r != 1 || s < ngLate || s > ngLate+1):
			return 0
		}
		return g
	})
}

// ngParams are the probe's parameters at the start.
func ngParams(t testing.TB) []*optim.Param {
	ps := adamParams(t, []int{ngRows, ngCols}, []int{23}, []int{4, 5})
	ps[0].Name, ps[1].Name, ps[2].Name = "emb", "dense", "mat"
	return ps
}

type ngBuild func(ctx context.Context, c comm.Comm, ps []*optim.Param, lr, wd float32) (optim.Optimizer, error)

// ngOptimizers are every optimizer and state mode, at the learning rate
// and weight decay given: the 1-bit ones with short warm-ups and buckets of 16
// elements (several per parameter, none aligned with the rows), 0/1 Adam
// with variance steps at 1, 2, 3, 4, 6, 8, 10, 12, phase B from step 13
// with synchronizations every 1, then 2, then 4 steps.
func ngOptimizers() map[string]ngBuild {
	adamCfg := func(lr, wd float32) optim.AdamConfig {
		cfg := optim.DefaultAdamConfig()
		cfg.LR, cfg.WeightDecay = lr, wd
		return cfg
	}
	onebitAdam := func(mode onebit.StateMode, bf onebit.BF16State, freeze int) ngBuild {
		return func(ctx context.Context, c comm.Comm, ps []*optim.Param, lr, wd float32) (optim.Optimizer, error) {
			cfg := onebit.DefaultAdamConfig()
			cfg.AdamConfig = adamCfg(lr, wd)
			cfg.FreezeStep, cfg.BucketBytes, cfg.StateMode, cfg.BF16 = freeze, 64, mode, bf
			return onebit.NewAdam(ctx, c, ps, cfg)
		}
	}
	onebitLamb := func(mode onebit.StateMode) ngBuild {
		return func(ctx context.Context, c comm.Comm, ps []*optim.Param, lr, wd float32) (optim.Optimizer, error) {
			cfg := onebit.DefaultLambConfig()
			cfg.AdamConfig = adamCfg(lr, wd)
			cfg.FreezeStep, cfg.StateMode = 3, mode
			return onebit.NewLamb(ctx, c, ps, cfg)
		}
	}
	zeroAdam := func(r zero.Reduce) ngBuild {
		return func(ctx context.Context, c comm.Comm, ps []*optim.Param, lr, wd float32) (optim.Optimizer, error) {
			cfg := zero.DefaultConfig()
			cfg.AdamConfig = adamCfg(lr, wd)
			cfg.ReduceScatter, cfg.BucketBytes = r, 64
			return zero.NewAdam(ctx, c, ps, cfg)
		}
	}
	onebitMuon := func(mode string, freeze int, warmupAdamW bool) ngBuild {
		return func(ctx context.Context, c comm.Comm, ps []*optim.Param, lr, wd float32) (optim.Optimizer, error) {
			cfg := onebit.DefaultMuonConfig()
			cfg.Params, cfg.LR, cfg.AdamLR, cfg.WeightDecay, cfg.AdamWeightDecay = []string{"mat"}, lr, lr, wd, wd
			cfg.FreezeStep, cfg.BucketBytes, cfg.WarmupAdamWOnly = freeze, 64, warmupAdamW
			var err error
			if cfg.StateMode, cfg.MomentumBF16, err = onebit.ParseMuonStateMode(mode); err != nil {
				return nil, err
			}
			return onebit.NewMuon(ctx, c, ps, cfg)
		}
	}
	bf := onebit.BF16WorkerError | onebit.BF16Variance
	return map[string]ngBuild{
		"adam": func(ctx context.Context, c comm.Comm, ps []*optim.Param, lr, wd float32) (optim.Optimizer, error) {
			return optim.NewAdam(ctx, c, ps, adamCfg(lr, wd))
		},
		"lamb": func(ctx context.Context, c comm.Comm, ps []*optim.Param, lr, wd float32) (optim.Optimizer, error) {
			cfg := optim.DefaultLambConfig()
			cfg.AdamConfig = adamCfg(lr, wd)
			return optim.NewLamb(ctx, c, ps, cfg)
		},
		"zero":                     zeroAdam(zero.ReduceFP32),
		"zero-int8":                zeroAdam(zero.ReduceInt8),
		"onebit-adam/full":         onebitAdam(onebit.StateFull, 0, 3),
		"onebit-adam/compact":      onebitAdam(onebit.StateCompact, 0, 3),
		"onebit-adam/sharded":      onebitAdam(onebit.StateSharded, 0, 3),
		"onebit-adam/sharded-bf16": onebitAdam(onebit.StateSharded, bf, 3),
		"onebit-adam/full-freeze0": onebitAdam(onebit.StateFull, 0, 0),
		"onebit-adam/sharded-frz0": onebitAdam(onebit.StateSharded, 0, 0),
		"onebit-lamb/full":         onebitLamb(onebit.StateFull),
		"onebit-lamb/compact":      onebitLamb(onebit.StateCompact),
		"onebit-muon/full":         onebitMuon("full", 3, false),
		"onebit-muon/compact":      onebitMuon("compact", 3, false),
		"onebit-muon/compact-bf16": onebitMuon("compact-bf16", 3, false),
		"onebit-muon/full+adamw":   onebitMuon("full", 3, true),
		"onebit-muon/bf16+adamw":   onebitMuon("compact-bf16", 3, true),
		"onebit-muon/full-freeze0": onebitMuon("full", 0, true),
		"onebit-muon/cpt-freeze0":  onebitMuon("compact", 0, false),
		"zeroone-adam": func(ctx context.Context, c comm.Comm, ps []*optim.Param, lr, wd float32) (optim.Optimizer, error) {
			cfg := onebit.DefaultZeroOneAdamConfig()
			cfg.AdamConfig = adamCfg(lr, wd)
			cfg.VarFreezeStep, cfg.VarUpdateScaler, cfg.LocalStepScaler, cfg.LocalStepClipper = 12, 2, 3, 4
			cfg.BucketBytes = 64
			return onebit.NewZeroOneAdam(ctx, c, ps, cfg)
		},
	}
}

// ngRun trains steps from+1..to of the probe on ngWorld ranks: see
// historyRun.
func ngRun(t *testing.T, build ngBuild, lr, wd float32, ck []*optim.Checkpoint, from, to int) ([][][][]float32, []*optim.Checkpoint) {
	t.Helper()
	return historyRun(t, ngWorld, ck, 0, from, to, ngParams, ngGrads,
		func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return build(ctx, c, ps, lr, wd)
		})
}

// historyRun trains steps from+1..to on w ranks of comm/local, the
// parameters made by params, the gradients of rank r at step s written by
// grads, after loading ck if not nil (after before steps of gradients
// that are nowhere zero: a Load into an optimizer that has stepped); it
// returns each rank's parameters after every step (rank, step, parameter)
// and its state at the end.
func historyRun(t *testing.T, w int, ck []*optim.Checkpoint, before, from, to int,
	params func(testing.TB) []*optim.Param, grads func(ps []*optim.Param, r, s int),
	build func(context.Context, comm.Comm, []*optim.Param) (optim.Optimizer, error)) ([][][][]float32, []*optim.Checkpoint) {
	t.Helper()
	hist := make([][][][]float32, w)
	states := make([]*optim.Checkpoint, w)
	err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		ps := params(t)
		opt, err := build(ctx, c, ps)
		if err != nil {
			return err
		}
		defer opt.Close()
		for range before {
			for _, p := range ps {
				for j := range p.GradData() {
					p.GradData()[j] = 0.01
				}
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		if ck != nil {
			if err := opt.Load(ck[c.Rank()]); err != nil {
				return err
			}
		}
		for s := from + 1; s <= to; s++ {
			grads(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return fmt.Errorf("step %d: %w", s, err)
			}
			var snap [][]float32
			for _, p := range ps {
				snap = append(snap, append([]float32(nil), p.Data()...))
			}
			hist[c.Rank()] = append(hist[c.Rank()], snap)
		}
		states[c.Rank()], err = opt.State()
		return err
	})
	require.NoError(t, err)
	return hist, states
}

// TestNoGradientNoStep: in every optimizer and state mode (1-bit Adam
// full, compact, sharded and sharded with bfloat16 state, from a warm-up
// and from FreezeStep 0; 1-bit LAMB full and compact; 1-bit Muon's AdamW
// group in every state mode, with either warm-up and from FreezeStep 0;
// 0/1 Adam's phase A, local steps and synchronizations; and the exact
// Adam, LAMB and sharded Adam, fp32 and int8), an element whose gradient is zero on every rank
// at every step stays bit for bit where it started, at every step and on
// every rank, without weight decay; the ranks stay identical (0/1 Adam:
// its anchors, the parameters at the last synchronization); the rows that
// get gradient train, those first given it late on one rank and at one
// step on another included; and a resume in the middle of the run is
// bit-identical to not stopping.
func TestNoGradientNoStep(t *testing.T) {
	const stop = 17 // 0/1 Adam: phase B, between two synchronizations
	init := ngParams(t)
	for name, build := range ngOptimizers() {
		t.Run(name, func(t *testing.T) {
			hist, cks := ngRun(t, build, 0.01, 0, nil, 0, ngSteps)
			for r := range ngWorld {
				for s := range ngSteps {
					emb := hist[r][s][0]
					for j, x := range emb {
						if ngNever(j) {
							require.Equal(t, math.Float32bits(init[0].Data()[j]), math.Float32bits(x),
								"rank %d step %d: element %d (row %d) of emb moved without ever a gradient", r, s+1, j, j/ngCols)
						}
					}
					if name != "zeroone-adam" {
						require.Equal(t, hist[0][s], hist[r][s], "step %d: rank %d's parameters differ from rank 0's", s+1, r)
					}
				}
				last := hist[r][ngSteps-1]
				for row := range ngRows {
					if row == 4 || row == 5 {
						continue
					}
					moved := 0.0
					for j := row * ngCols; j < (row+1)*ngCols; j++ {
						if !ngNever(j) {
							moved = max(moved, math.Abs(float64(last[0][j]-init[0].Data()[j])))
						}
					}
					assert.Greater(t, moved, 1e-3, "rank %d: row %d of emb did not train", r, row)
				}
				assert.NotEqual(t, init[1].Data(), last[1], "rank %d: dense did not train", r)
			}
			for _, tn := range cks[0].Tensors {
				if name != "zeroone-adam" || !strings.HasPrefix(tn.Name, onebit.AnchorPrefix) {
					continue
				}
				for r := 1; r < ngWorld; r++ {
					require.Equal(t, tn.Data, cks[r].Tensor(tn.Name).Data, "rank %d's %s differs from rank 0's", r, tn.Name)
				}
			}
			if name == "zeroone-adam" {
				// Row 3's v is its variance from step ngLate, a variance
				// step, not the mark of an element first given gradient
				// at a step that compresses it.
				v := cks[0].Tensor(optim.ExpAvgSqPrefix + "emb").Data
				for j := 3 * ngCols; j < 4*ngCols; j++ {
					assert.Greater(t, v[j], float32(1e-20), "element %d of emb: v", j)
				}
			}
			// Resumed at step stop, in an optimizer that had taken 5
			// steps of its own.
			build := func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				return build(ctx, c, ps, 0.01, 0)
			}
			_, mid := historyRun(t, ngWorld, nil, 0, 0, stop, ngParams, ngGrads, build)
			resumed, _ := historyRun(t, ngWorld, mid, 5, stop, ngSteps, ngParams, ngGrads, build)
			for r := range ngWorld {
				require.Equal(t, hist[r][ngSteps-1], resumed[r][ngSteps-stop-1], "rank %d: resumed at step %d", r, stop)
			}
		})
	}
}

// TestNoGradientDecays: with weight decay, an element that never gets a
// gradient decays in every Adam-style optimizer and mode exactly as exact
// Adam decays it, p -= lr*(wd*p) at every step, bit for bit (LAMB scales
// its steps by trust ratios).
func TestNoGradientDecays(t *testing.T) {
	const lr, wd = 0.01, 0.5
	init := ngParams(t)[0].Data()
	want := make([][]float32, ngSteps)
	p := append([]float32(nil), init...)
	for s := range want {
		for j := range p {
			p[j] -= float32(lr * float32(wd*p[j]))
		}
		want[s] = append([]float32(nil), p...)
	}
	for name, build := range ngOptimizers() {
		if name == "lamb" || name == "onebit-lamb/full" || name == "onebit-lamb/compact" {
			continue
		}
		t.Run(name, func(t *testing.T) {
			hist, _ := ngRun(t, build, lr, wd, nil, 0, ngSteps)
			for r := range ngWorld {
				for s := range ngSteps {
					for j, x := range hist[r][s][0] {
						if ngNever(j) {
							require.Equal(t, math.Float32bits(want[s][j]), math.Float32bits(x),
								"rank %d step %d: element %d of emb: %v, exact Adam's decay gives %v", r, s+1, j, x, want[s][j])
						}
					}
				}
			}
		})
	}
}

// TestNoGradientStepAllocatesNothing: with elements that never get a
// gradient (their bits exchanged at every compressed step), a running
// Step of every 1-bit optimizer and mode allocates nothing, collectives
// included (rank 0 measured while the others step alongside; the count is
// process-wide). Each measured run is 4 steps: 0/1 Adam synchronizes
// every 4 steps by then.
func TestNoGradientStepAllocatesNothing(t *testing.T) {
	const warm, runs, per = 16, 5, 4
	for name, build := range ngOptimizers() {
		if !strings.Contains(name, "onebit") && name != "zeroone-adam" {
			continue
		}
		t.Run(name, func(t *testing.T) {
			cs, err := local.New(ngWorld)
			require.NoError(t, err)
			ctx := adamCtx(t)
			opts := make([]optim.Optimizer, ngWorld)
			// The gradients of step ngLate at every step (0/1 Adam
			// overwrites them with their average).
			step := func(r int) error {
				ngGrads(opts[r].Params(), r, ngLate)
				return opts[r].Step(ctx)
			}
			errs := make([]error, ngWorld)
			var wg sync.WaitGroup
			for r := range cs { // together: 1-bit Muon's construction is a collective
				wg.Add(1)
				go func() {
					defer wg.Done()
					opts[r], errs[r] = build(ctx, cs[r], ngParams(t), 0.01, 0)
				}()
			}
			wg.Wait()
			require.NoError(t, errors.Join(errs...))
			done := make(chan struct{})
			go func() {
				defer close(done)
				for r := 1; r < ngWorld; r++ {
					go func() {
						for range warm + per*(runs+1) { // AllocsPerRun makes one extra call
							if err := step(r); err != nil {
								t.Error(err)
								return
							}
						}
					}()
				}
			}()
			for range warm {
				require.NoError(t, step(0))
			}
			allocs := testing.AllocsPerRun(runs, func() {
				for range per {
					if err := step(0); err != nil {
						t.Error(err)
					}
				}
			})
			<-done
			assert.Zero(t, allocs)
		})
	}
}
