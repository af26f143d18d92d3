package gomlx

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// outerAdam is a Builder of the outer optimizer (DiLoCo-style) with inner
// Adam at learning rate 1e-2, every H steps an exchange of codec, in
// fragments with delay.
func outerAdam(h, fragments, delay int, codec outer.Codec) Builder {
	return func(ctx context.Context, c comm.Comm, p []*optim.Param) (optim.Optimizer, error) {
		cfg := outer.DefaultConfig()
		cfg.H, cfg.Fragments, cfg.Delay, cfg.Codec = h, fragments, delay, codec
		in := optim.DefaultAdamConfig()
		in.LR = 1e-2
		return outer.NewAdam(ctx, c, p, cfg, in)
	}
}

// outerMuon is NewOuterMuon's Builder with muonConfig (on mlp(16), Muon
// updates /hidden/dense/weights through its transpose), an exchange of
// codec every H steps (the sparse codec's chunks fit the model: 4 of 16
// entries).
func outerMuon(h int, codec outer.Codec) Builder {
	cfg := outer.DefaultConfigFor(codec)
	cfg.H = h
	if codec == outer.CodecSparse {
		cfg.SparseChunk, cfg.Density = 16, 0.25
		cfg.SparseWithMuon = true // refused otherwise (TestOuterMuonSparseRefused)
	}
	return NewOuterMuon(cfg, muonConfig())
}

// outerRankRun is what one rank of TestLoopOuter reports.
type outerRankRun struct {
	losses []float32
	// After every step: this rank's variables and the optimizer's global
	// parameters (a copy of Global), cut per variable.
	vars, global [][][]float32
	// At the end: the variables inside WithGlobalValues and after it.
	inside, after [][]float32
	stats         outer.OuterStats
	err           error
}

// cutLike cuts flat into slices of the lengths of like's.
func cutLike(flat []float32, like [][]float32) [][]float32 {
	out := make([][]float32, len(like))
	off := 0
	for i, l := range like {
		out[i] = slices.Clone(flat[off : off+len(l)])
		off += len(l)
	}
	return out
}

// runOuterLoop trains steps on w in-process ranks with train.Loop and the
// outer optimizer that build makes, each rank on its own shard of the
// regression set (the same rows every step: the ranks' inner steps pull
// their parameters apart), from differently seeded stores.
func runOuterLoop(t *testing.T, w, steps int, build Builder) []*outerRankRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	runs := make([]*outerRankRun, w)
	var mu sync.Mutex
	err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		m := newRankModel(t, ctx, c, newStore(int64(100+r)), 16, build)
		defer m.opt.Close()
		run := &outerRankRun{}
		m.loop.OnStep("after lowbit", HookPriority+1, func(*train.Loop, []*tensors.Tensor) error {
			vars := trainable(t, m.store)
			run.vars = append(run.vars, vars)
			run.global = append(run.global, cutLike(m.opt.Global(), vars))
			return nil
		})
		_, err := m.loop.RunSteps(&shard{rank: r, world: w}, steps)
		run.losses, run.err = m.losses, err
		if err == nil {
			run.err = m.opt.WithGlobalValues(func() error {
				run.inside = trainable(t, m.store)
				return nil
			})
			run.after = trainable(t, m.store)
			run.stats = m.opt.Optimizer().(*outer.Optimizer).OuterStats()
		}
		mu.Lock()
		runs[r] = run
		mu.Unlock()
		return run.err
	})
	require.NoError(t, err)
	return runs
}

// meanLoss is the mean over the ranks of the losses of steps [lo, hi).
func meanLoss(runs []*outerRankRun, lo, hi int) float64 {
	var s float64
	for _, r := range runs {
		for _, l := range r.losses[lo:hi] {
			s += float64(l)
		}
	}
	return s / float64(len(runs)*(hi-lo))
}

// TestLoopOuter trains with the outer optimizer (outer.NewAdam, and
// NewOuterMuon: Muon inside, through the transposes) inside
// train.Loop through the Builder, on 3 ranks whose initializers are seeded
// differently and whose shards differ: the loss falls; the global
// parameters (Optimizer.Global) are bit-identical on every rank after
// every step; with one fragment and no delay every rank's variables equal
// them after each exchange (every H steps) and differ between the ranks
// between exchanges (the ranks run apart: nothing expects them equal);
// the global parameters change at the exchanges only; WithGlobalValues
// shows the global parameters to its function and puts the rank's own
// back; and OuterStats counts the exchanges.
func TestLoopOuter(t *testing.T) {
	const w, steps = 3, 16
	for _, tc := range []struct {
		name             string
		h, frags, delay  int
		codec            outer.Codec
		exchangesPerRank int64
		muon             bool // inner Muon (NewOuterMuon), not Adam
	}{
		{"fp32 H4", 4, 1, 0, outer.CodecFP32, 4, false},
		{"1bit H4", 4, 1, 0, outer.CodecOneBit, 4, false},
		{"int8 H4 2 fragments delay 1", 4, 2, 1, outer.CodecInt8, 7, false}, // fragment 1 at 2, 6, 10, 14; fragment 0 at 4, 8, 12 (16 merges at 17)
		{"muon fp32 H4", 4, 1, 0, outer.CodecFP32, 4, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			build := outerAdam(tc.h, tc.frags, tc.delay, tc.codec)
			if tc.muon {
				build = outerMuon(tc.h, tc.codec)
			}
			runs := runOuterLoop(t, w, steps, build)
			first, last := meanLoss(runs, 0, 4), meanLoss(runs, steps-4, steps)
			t.Logf("mean loss over the ranks: steps 1-4 %.4f, steps %d-%d %.4f", first, steps-3, steps, last)
			assert.Less(t, last, 0.7*first, "the loss falls")
			apart := false
			for s := range steps {
				for r := 1; r < w; r++ {
					require.Equal(t, runs[0].global[s], runs[r].global[s], "step %d: rank %d's global parameters differ from rank 0's", s+1, r)
					apart = apart || !slices.EqualFunc(runs[0].vars[s], runs[r].vars[s], slices.Equal)
				}
				if tc.frags > 1 {
					continue
				}
				exchange := (s+1)%tc.h == 0
				for r := range w {
					if exchange {
						assert.Equal(t, runs[r].global[s], runs[r].vars[s], "step %d, an exchange: rank %d's variables are not the global parameters", s+1, r)
					}
					if s > 0 {
						assert.Equal(t, exchange, !slices.EqualFunc(runs[r].global[s-1], runs[r].global[s], slices.Equal),
							"step %d: the global parameters change at the exchanges only (exchange: %t)", s+1, exchange)
					}
				}
			}
			assert.True(t, apart, "the ranks' variables never differed between exchanges")
			for r, run := range runs {
				assert.Equal(t, run.global[steps-1], run.inside, "rank %d: WithGlobalValues shows the global parameters", r)
				assert.Equal(t, run.vars[steps-1], run.after, "rank %d: WithGlobalValues puts the rank's own values back", r)
				if tc.frags > 1 {
					// Fragment 0's exchange of step 16 is in flight: the
					// rank's own values are not the global ones.
					assert.NotEqual(t, run.inside, run.after, "rank %d", r)
				}
				assert.Equal(t, tc.exchangesPerRank, run.stats.Exchanges, "rank %d: exchanges", r)
				assert.Zero(t, run.stats.Skipped, "rank %d", r)
				u := run.stats.Utilization()
				assert.True(t, u > 0 && u <= 1, "rank %d: utilization %v", r, u)
			}
		})
	}
}

// TestResumeOuter: the outer optimizer saved mid-period (the ranks'
// parameters apart), through Optimizer.Save and Optimizer.Checkpoint, and
// resumed into fresh stores, trainers, loops and optimizers with other
// initial values, ends bit-identical to the run never stopped, on every
// rank; the global parameters in the lowbit state are the same on every
// rank at the save and at the end. With 2 fragments and delay 1 the save
// at step 6 has fragment 1's exchange in flight (launched at 6, merged at
// 7).
func TestResumeOuter(t *testing.T) {
	for _, tc := range []resumeCase{
		{name: "fp32", build: outerAdam(4, 1, 0, outer.CodecFP32), steps: 12, cut: 6, apart: true, same: outer.TensorGlobal},
		{name: "1bit", build: outerAdam(4, 1, 0, outer.CodecOneBit), steps: 12, cut: 6, apart: true, compressed: true, same: outer.TensorGlobal},
		{name: "fp32 2 fragments delay 1", build: outerAdam(4, 2, 1, outer.CodecFP32), steps: 12, cut: 6,
			apart: true, endApart: true, same: outer.TensorGlobal},
		{name: "muon 1bit", build: outerMuon(4, outer.CodecOneBit), steps: 12, cut: 6, apart: true, compressed: true, same: outer.TensorGlobal},
	} {
		t.Run(tc.name, func(t *testing.T) { checkResume(t, tc) })
	}
}

// TestOuterGlobalAgreement: ranks that restore checkpoints whose global
// parameters differ (one rank's outer/global changed) fail at the first
// step, on every rank, naming a variable; their own parameters, which
// differ between exchanges anyway, are not compared.
func TestOuterGlobalAgreement(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	rc := resumeConfig{hidden: 16, steps: 6, build: outerAdam(4, 1, 0, outer.CodecFP32)}
	resumeAll(t, ctx, 2, dir, rc)
	path := fmt.Sprintf("%s/rank-1/%s", dir, stateFileName(6))
	ck, err := optim.LoadFile(path)
	require.NoError(t, err)
	g := stateTensor(ck, outer.TensorGlobal)
	require.NotNil(t, g)
	g[len(g)-1] += 0.5 // the last variable's last element
	require.NoError(t, optim.SaveFile(path, ck))

	rc.steps = 1
	for r, run := range requireResumeRefused(t, ctx, 2, dir, rc, "global parameters") {
		assert.Regexp(t, `"/[^"]+" differs between rank 0 .* and rank 1 .*restored its own checkpoint`, run.err.Error(), "rank %d", r)
	}
}
