package onebit_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

func adamCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// adamParams returns deterministic parameters of the given shapes, named
// "w0", "w1", ...
func adamParams(t testing.TB, shapes ...[]int) []*optim.Param {
	t.Helper()
	ps := make([]*optim.Param, len(shapes))
	for i, sh := range shapes {
		ps[i] = optim.NewParam(fmt.Sprintf("w%d", i), sh...)
		for j := range ps[i].Data() {
			ps[i].Data()[j] = float32(math.Sin(float64(1000*i+j))) * 0.5
		}
	}
	return ps
}

// adamGrads writes a deterministic gradient depending on rank and step.
func adamGrads(ps []*optim.Param, rank, step int) {
	for i, p := range ps {
		for j := range p.GradData() {
			p.GradData()[j] = float32(math.Cos(float64(step*7919+rank*104729+i*31+3*j))) * float32(1+rank)
		}
	}
}

func adamBits(ps []*optim.Param) [][]uint32 {
	out := make([][]uint32, len(ps))
	for i, p := range ps {
		for _, x := range p.Data() {
			out[i] = append(out[i], math.Float32bits(x))
		}
	}
	return out
}

// adamFrozenRef is 1-bit Adam on one rank written from the spec's formulas
// in float32 (every product rounded before it is added): exact Adam up to
// freeze, then Adam with v and its bias correction frozen.
type adamFrozenRef struct {
	cfg     optim.AdamConfig
	freeze  int
	p, m, v []float32
	t       int
}

func (r *adamFrozenRef) step(g []float32) {
	r.t++
	b1, b2 := r.cfg.Beta1, r.cfg.Beta2
	a1, a2 := float32(1-float64(b1)), float32(1-float64(b2))
	corr := func(beta float32, t int) float32 { return float32(1 / (1 - math.Pow(float64(beta), float64(t)))) }
	c1 := corr(b1, r.t)
	c2 := corr(b2, min(r.t, r.freeze))
	for i := range r.p {
		r.m[i] = float32(b1*r.m[i]) + float32(a1*g[i])
		if r.t <= r.freeze {
			r.v[i] = float32(b2*r.v[i]) + float32(float32(a2*g[i])*g[i])
		}
		mhat := float32(r.m[i] * c1)
		vhat := float32(r.v[i] * c2)
		u := mhat/(float32(math.Sqrt(float64(vhat)))+r.cfg.Eps) + float32(r.cfg.WeightDecay*r.p[i])
		r.p[i] -= float32(r.cfg.LR * u)
	}
}

func TestAdamOneRankMatchesExactAdamThenFrozenVariance(t *testing.T) {
	const freeze, total = 6, 15
	for _, wd := range []float32{0, 0.05} {
		for _, withComm := range []bool{false, true} {
			t.Run(fmt.Sprintf("wd=%v/comm=%v", wd, withComm), func(t *testing.T) {
				cfg := onebit.DefaultAdamConfig()
				cfg.FreezeStep = freeze
				cfg.LR = 0.01
				cfg.WeightDecay = wd
				var c comm.Comm
				if withComm {
					cs, err := local.New(1)
					require.NoError(t, err)
					c = cs[0]
				}
				ps := adamParams(t, []int{4, 5})
				exactPs := adamParams(t, []int{4, 5})
				opt, err := onebit.NewAdam(context.Background(), c, ps, cfg)
				require.NoError(t, err)
				exact, err := optim.NewAdam(context.Background(), nil, exactPs, cfg.AdamConfig)
				require.NoError(t, err)
				ref := &adamFrozenRef{cfg: cfg.AdamConfig, freeze: freeze,
					p: append([]float32(nil), ps[0].Data()...), m: make([]float32, 20), v: make([]float32, 20)}
				for s := 1; s <= total; s++ {
					wantStage := optim.StageWarmup
					if s > freeze {
						wantStage = optim.StageCompression
					}
					require.Equal(t, wantStage, opt.Stage(), "step %d", s)
					adamGrads(ps, 0, s)
					adamGrads(exactPs, 0, s)
					ref.step(ps[0].GradData())
					require.NoError(t, opt.Step(adamCtx(t)))
					require.NoError(t, exact.Step(adamCtx(t)))
					if s <= freeze {
						require.Equal(t, adamBits(exactPs), adamBits(ps), "warm-up step %d differs from exact Adam", s)
					}
					for i, x := range ps[0].Data() {
						require.Equal(t, math.Float32bits(ref.p[i]), math.Float32bits(x), "step %d element %d: %v, reference %v", s, i, x, ref.p[i])
					}
				}
				assert.NotEqual(t, adamBits(exactPs), adamBits(ps), "compression should differ from exact Adam")
				st := opt.Stats()
				assert.Equal(t, optim.StageCompression, st.Stage)
				assert.Equal(t, int64(total), st.Steps)
				assert.Zero(t, st.BytesSent)
			})
		}
	}
}

func TestAdamStagesAndTraffic(t *testing.T) {
	const w, freeze = 4, 3
	n := 4096
	err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, []int{n})
		cfg := onebit.DefaultAdamConfig()
		cfg.FreezeStep = freeze
		opt, err := onebit.NewAdam(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		var warm, comp int64
		for s := 1; s <= freeze+2; s++ {
			adamGrads(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if s == 1 {
				warm = opt.Stats().LastStepBytes
			}
			comp = opt.Stats().LastStepBytes
			want := optim.StageWarmup
			if s >= freeze {
				want = optim.StageCompression
			}
			assert.Equal(t, want, opt.Stats().Stage, "after step %d", s)
		}
		exactBytes := comm.RingAllReduceBytes(int64(4*n), w)
		assert.GreaterOrEqual(t, warm, exactBytes, "warm-up averages gradients exactly")
		// 2(W-1)/W * N/8 bytes of signs plus scales and the flag: about
		// 32 times less than the exact allreduce.
		assert.Less(t, comp*16, exactBytes, "compression step sent %d bytes, exact %d", comp, exactBytes)
		return nil
	})
	require.NoError(t, err)
}

// adamConfigForResume exercises weight decay and the mask too.
func adamConfigForResume(freeze int) onebit.AdamConfig {
	cfg := onebit.DefaultAdamConfig()
	cfg.FreezeStep = freeze
	cfg.LR = 0.01
	cfg.WeightDecay = 0.01
	mask := make([]float32, 13)
	for i := range mask {
		mask[i] = float32(i % 2)
	}
	cfg.ExpAvgMask = map[string][]float32{"w1": mask}
	return cfg
}

// adamRun runs ranks of 1-bit Adam from step from to step to, loading
// per-rank checkpoints from dir first when load is set and saving them at
// the end when save is set, and returns every rank's parameters.
func adamRun(t *testing.T, w int, cfg onebit.AdamConfig, dir string, from, to int, load, save bool) [][][]uint32 {
	t.Helper()
	out, err := tryAdamRun(t, w, cfg, dir, from, to, load, save)
	require.NoError(t, err)
	return out
}

// tryAdamRun is adamRun returning the run's error.
func tryAdamRun(t *testing.T, w int, cfg onebit.AdamConfig, dir string, from, to int, load, save bool) ([][][]uint32, error) {
	t.Helper()
	var mu sync.Mutex
	out := make([][][]uint32, w)
	err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, []int{3, 7}, []int{13}, []int{1})
		opt, err := onebit.NewAdam(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		path := filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", c.Rank()))
		if load {
			ck, err := optim.LoadFile(path)
			if err != nil {
				return err
			}
			if err := opt.Load(ck); err != nil {
				return err
			}
		}
		for s := from; s <= to; s++ {
			adamGrads(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		if save {
			ck, err := opt.State()
			if err != nil {
				return err
			}
			if err := optim.SaveFile(path, ck); err != nil {
				return err
			}
		}
		mu.Lock()
		out[c.Rank()] = adamBits(ps)
		mu.Unlock()
		return nil
	})
	return out, err
}

// Stopping at step k and resuming from per-rank checkpoint files gives
// parameters bit-identical to a run that never stopped, in warm-up, in
// compression, and around the switch.
func TestAdamResumeIsBitIdentical(t *testing.T) {
	const freeze, total = 4, 10
	cfg := adamConfigForResume(freeze)
	for _, w := range []int{2, 3, 4} {
		want := adamRun(t, w, cfg, t.TempDir(), 1, total, false, false)
		for r := 1; r < w; r++ {
			require.Equal(t, want[0], want[r], "W=%d: rank %d differs from rank 0", w, r)
		}
		for _, k := range []int{1, freeze - 1, freeze, freeze + 1, freeze + 3} {
			t.Run(fmt.Sprintf("W=%d/k=%d", w, k), func(t *testing.T) {
				dir := t.TempDir()
				adamRun(t, w, cfg, dir, 1, k, false, true)
				got := adamRun(t, w, cfg, dir, k+1, total, true, false)
				assert.Equal(t, want, got)
			})
		}
	}
}

// Dropping the error buffers on resume (what the reference does) changes
// the result: the checkpoint really carries them.
func TestAdamCheckpointCarriesErrorBuffers(t *testing.T) {
	const w, freeze, k, total = 2, 2, 5, 8
	for _, tc := range []struct {
		name        string
		bucketBytes int
		buffers     int
	}{
		{"one fused bucket", 0, 2},
		{"buckets of 32 bytes", 32, 2 * 5}, // 35 elements in buckets of 8, 8, 8, 8, 3
		{"per parameter", optim.PerParameter, 2 * 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := adamConfigForResume(freeze)
			cfg.BucketBytes = tc.bucketBytes
			dir := t.TempDir()
			want := adamRun(t, w, cfg, dir, 1, total, false, false)
			adamRun(t, w, cfg, dir, 1, k, false, true)
			for r := 0; r < w; r++ {
				path := filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", r))
				ck, err := optim.LoadFile(path)
				require.NoError(t, err)
				found := 0
				for i := range ck.Tensors {
					tn := &ck.Tensors[i]
					if optim.IsErrorBuffer(tn.Name) {
						found++
						clear(tn.Data)
					}
				}
				require.Equal(t, tc.buffers, found, "a worker and a server error per bucket")
				require.NoError(t, optim.SaveFile(path, ck))
			}
			// The same run resumed from its own checkpoint is bit-exact; with
			// the error buffers cleared it is not.
			got := adamRun(t, w, cfg, dir, k+1, total, true, false)
			assert.NotEqual(t, want, got)
		})
	}
}

// TestAdamBucketsResumeBitExact: with several buckets on three ranks, a run
// resumed from its checkpoint ends bit-identical to an uninterrupted one.
func TestAdamBucketsResumeBitExact(t *testing.T) {
	const w, freeze, k, total = 3, 2, 5, 9
	for _, bb := range []int{0, 24, optim.PerParameter} {
		cfg := adamConfigForResume(freeze)
		cfg.BucketBytes = bb
		dir := t.TempDir()
		want := adamRun(t, w, cfg, dir, 1, total, false, false)
		adamRun(t, w, cfg, dir, 1, k, false, true)
		got := adamRun(t, w, cfg, dir, k+1, total, true, false)
		assert.Equal(t, want, got, "bucket bytes %d", bb)
	}
}

// TestAdamBucketCheckpointRefusal: a checkpoint made with other buckets, or
// with per-parameter error buffers, is refused with a message that says
// how to load it; ResetErrors loads it with the error feedback restarted.
func TestAdamBucketCheckpointRefusal(t *testing.T) {
	const w, freeze = 2, 2
	for _, tc := range []struct {
		saved, loaded int
		msg           string
	}{
		{optim.PerParameter, 0, "per parameter"},
		{0, 32, "buckets of"},
		{32, 0, "buckets of"},
		{0, optim.PerParameter, "buckets of"},
	} {
		cfg := adamConfigForResume(freeze)
		cfg.BucketBytes = tc.saved
		dir := t.TempDir()
		adamRun(t, w, cfg, dir, 1, 4, false, true)
		err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
			ps := adamParams(t, []int{3, 7}, []int{13}, []int{1})
			lc := adamConfigForResume(freeze)
			lc.BucketBytes = tc.loaded
			opt, err := onebit.NewAdam(ctx, c, ps, lc)
			if err != nil {
				return err
			}
			ck, err := optim.LoadFile(filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", c.Rank())))
			if err != nil {
				return err
			}
			before := append([]float32(nil), ps[0].Data()...)
			err = opt.Load(ck)
			if !errors.Is(err, optim.ErrIncompatibleCheckpoint) || !strings.Contains(err.Error(), tc.msg) {
				return fmt.Errorf("saved %d, loaded %d: got %v, want an incompatible checkpoint error about %q", tc.saved, tc.loaded, err, tc.msg)
			}
			if !slices.Equal(before, ps[0].Data()) {
				return fmt.Errorf("a refused load changed the parameters")
			}
			return opt.Load(ck.ResetErrors())
		})
		require.NoError(t, err)
	}
}

func TestAdamLoadRefusesIncompatibleCheckpoints(t *testing.T) {
	cfg := onebit.DefaultAdamConfig()
	cfg.FreezeStep = 1
	states := make([]*optim.Checkpoint, 2)
	err := local.Run(adamCtx(t), 2, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, []int{4}, []int{2, 3})
		opt, err := onebit.NewAdam(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		for s := 1; s <= 3; s++ {
			adamGrads(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		states[c.Rank()], err = opt.State()
		return err
	})
	require.NoError(t, err)

	exactPs := adamParams(t, []int{4}, []int{2, 3})
	exact, err := optim.NewAdam(context.Background(), nil, exactPs, cfg.AdamConfig)
	require.NoError(t, err)
	fromExact, err := exact.State()
	require.NoError(t, err)
	fromExact.World = 2

	err = local.Run(adamCtx(t), 2, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, []int{4}, []int{2, 3})
		opt, err := onebit.NewAdam(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		adamGrads(ps, c.Rank(), 1)
		if err := opt.Step(ctx); err != nil {
			return err
		}
		before, err := opt.State()
		if err != nil {
			return err
		}
		other := states[1-c.Rank()]
		badStage := *states[c.Rank()]
		badStage.Stage = optim.StagePhaseB
		for name, tc := range map[string]struct {
			ck   *optim.Checkpoint
			want string
		}{
			"algorithm": {fromExact, `algorithm "adam"`},
			"rank":      {other, "error buffers are per rank"},
			"stage":     {&badStage, "unknown stage"},
		} {
			err := opt.Load(tc.ck)
			assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint, name)
			assert.ErrorContains(t, err, tc.want, name)
			after, err := opt.State()
			if err != nil {
				return err
			}
			assert.Equal(t, before, after, "%s: a refused load changed the optimizer", name)
		}
		return opt.Load(states[c.Rank()])
	})
	require.NoError(t, err)

	// Another world size, and other shapes.
	err = local.Run(adamCtx(t), 4, func(ctx context.Context, c comm.Comm) error {
		opt, err := onebit.NewAdam(ctx, c, adamParams(t, []int{4}, []int{2, 3}), cfg)
		if err != nil {
			return err
		}
		assert.ErrorContains(t, opt.Load(states[0]), "made on 2 ranks, this group has 4")
		return nil
	})
	require.NoError(t, err)
	err = local.Run(adamCtx(t), 2, func(ctx context.Context, c comm.Comm) error {
		opt, err := onebit.NewAdam(ctx, c, adamParams(t, []int{4}, []int{3, 2}), cfg)
		if err != nil {
			return err
		}
		assert.ErrorContains(t, opt.Load(states[c.Rank()]), "shape [2 3] in the checkpoint, [3 2] here")
		return nil
	})
	require.NoError(t, err)
}

// One rank's NaN gradient makes every rank skip exactly that step, in
// warm-up and in compression; nothing changes, training goes on, and the
// ranks end finite and identical.
func TestAdamSkipsNonFiniteStepsOnEveryRank(t *testing.T) {
	const w, freeze, total = 4, 3, 8
	for _, bad := range []int{2, freeze + 2} {
		t.Run(fmt.Sprintf("step=%d", bad), func(t *testing.T) {
			var mu sync.Mutex
			final := make([][][]uint32, w)
			err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
				ps := adamParams(t, []int{5, 5}, []int{9})
				cfg := onebit.DefaultAdamConfig()
				cfg.FreezeStep = freeze
				opt, err := onebit.NewAdam(ctx, c, ps, cfg)
				if err != nil {
					return err
				}
				for s := 1; s <= total; s++ {
					adamGrads(ps, c.Rank(), s)
					if s == bad && c.Rank() == 1 {
						ps[1].GradData()[7] = float32(math.Inf(1))
						ps[0].GradData()[3] = float32(math.NaN())
					}
					before, err := opt.State()
					if err != nil {
						return err
					}
					if err := opt.Step(ctx); err != nil {
						return err
					}
					if s == bad {
						after, err := opt.State()
						if err != nil {
							return err
						}
						before.Ints[optim.IntSteps]++
						before.Ints[optim.IntSkipped]++
						assert.Equal(t, before, after, "rank %d: the skipped step changed the state", c.Rank())
					}
				}
				st := opt.Stats()
				assert.Equal(t, int64(1), st.Skipped, "rank %d", c.Rank())
				assert.Equal(t, int64(total), st.Steps, "rank %d", c.Rank())
				for _, p := range ps {
					assert.True(t, optim.Finite(p.Data()))
				}
				mu.Lock()
				final[c.Rank()] = adamBits(ps)
				mu.Unlock()
				return nil
			})
			require.NoError(t, err)
			for r := 1; r < w; r++ {
				assert.Equal(t, final[0], final[r], "rank %d", r)
			}
		})
	}
}

func TestAdamMaskKeepsMaskedMomentumAtZero(t *testing.T) {
	const w, freeze = 2, 2
	err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, []int{16})
		cfg := onebit.DefaultAdamConfig()
		cfg.FreezeStep = freeze
		mask := make([]float32, 16)
		for i := 8; i < 16; i++ {
			mask[i] = 1
		}
		cfg.ExpAvgMask = map[string][]float32{"w0": mask}
		opt, err := onebit.NewAdam(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		var atFreeze []float32
		for s := 1; s <= freeze+4; s++ {
			adamGrads(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if s == freeze {
				atFreeze = append([]float32(nil), ps[0].Data()...)
			}
		}
		ck, err := opt.State()
		if err != nil {
			return err
		}
		m := ck.Tensor(optim.ExpAvgPrefix + "w0").Data
		assert.Equal(t, make([]float32, 8), m[:8], "masked momentum")
		assert.Equal(t, atFreeze[:8], ps[0].Data()[:8], "masked parameters do not move in compression (no weight decay)")
		assert.NotEqual(t, atFreeze[8:], ps[0].Data()[8:])
		return nil
	})
	require.NoError(t, err)
}

func TestAdamRejectsBadConfig(t *testing.T) {
	ps := adamParams(t, []int{4})
	for name, f := range map[string]func(*onebit.AdamConfig){
		"freeze":        func(c *onebit.AdamConfig) { c.FreezeStep = -1 },
		"mask name":     func(c *onebit.AdamConfig) { c.ExpAvgMask = map[string][]float32{"nope": make([]float32, 4)} },
		"mask length":   func(c *onebit.AdamConfig) { c.ExpAvgMask = map[string][]float32{"w0": make([]float32, 3)} },
		"mask NaN":      func(c *onebit.AdamConfig) { c.ExpAvgMask = map[string][]float32{"w0": {0, 1, float32(math.NaN()), 1}} },
		"learning rate": func(c *onebit.AdamConfig) { c.LR = -1 },
		"beta":          func(c *onebit.AdamConfig) { c.Beta2 = 1 },
	} {
		cfg := onebit.DefaultAdamConfig()
		f(&cfg)
		_, err := onebit.NewAdam(context.Background(), nil, ps, cfg)
		assert.Error(t, err, name)
	}
	_, err := onebit.NewAdam(context.Background(), nil, []*optim.Param{nil}, onebit.DefaultAdamConfig())
	assert.Error(t, err)
}

// FreezeStep 0 compresses from the first step, with v = 0.
func TestAdamFreezeStepZero(t *testing.T) {
	ps := adamParams(t, []int{3})
	cfg := onebit.DefaultAdamConfig()
	cfg.FreezeStep = 0
	opt, err := onebit.NewAdam(context.Background(), nil, ps, cfg)
	require.NoError(t, err)
	assert.Equal(t, optim.StageCompression, opt.Stats().Stage)
	adamGrads(ps, 0, 1)
	require.NoError(t, opt.Step(adamCtx(t)))
	assert.True(t, optim.Finite(ps[0].Data()))
}

func TestAdamStepAllocatesNothing(t *testing.T) {
	ps := adamParams(t, []int{64, 3}, []int{10})
	cfg := onebit.DefaultAdamConfig()
	cfg.FreezeStep = 2
	cfg.ExpAvgMask = map[string][]float32{"w1": make([]float32, 10)}
	opt, err := onebit.NewAdam(context.Background(), nil, ps, cfg)
	require.NoError(t, err)
	adamGrads(ps, 0, 1)
	ctx := adamCtx(t)
	require.NoError(t, opt.Step(ctx))
	assert.Zero(t, testing.AllocsPerRun(5, func() { require.NoError(t, opt.Step(ctx)) }), "warm-up")
	require.Equal(t, optim.StageCompression, opt.Stage())
	assert.Zero(t, testing.AllocsPerRun(20, func() { require.NoError(t, opt.Step(ctx)) }), "compression")
}

// On more than one rank the whole step, collectives included, allocates
// nothing once running (measured over both ranks' goroutines), in both
// state modes.
func TestAdamStepAllocatesNothingOnTwoRanks(t *testing.T) {
	for _, mode := range []onebit.StateMode{onebit.StateFull, onebit.StateSharded, onebit.StateCompact} {
		t.Run(mode.String(), func(t *testing.T) { adamAllocsOnTwoRanks(t, mode) })
	}
}

func adamAllocsOnTwoRanks(t *testing.T, mode onebit.StateMode) {
	cs, err := local.New(2)
	require.NoError(t, err)
	ctx := adamCtx(t)
	opts := make([]*onebit.Adam, 2)
	for r := range cs {
		ps := adamParams(t, []int{256}, []int{3, 5})
		adamGrads(ps, r, 1)
		cfg := onebit.DefaultAdamConfig()
		cfg.FreezeStep = 1
		cfg.StateMode = mode
		cfg.ExpAvgMask = map[string][]float32{"w1": {1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1}}
		opts[r], err = onebit.NewAdam(ctx, cs[r], ps, cfg)
		require.NoError(t, err)
	}
	// Warm-up step and a first compression step on both ranks.
	var wg sync.WaitGroup
	for r := range cs {
		wg.Go(func() {
			for range 2 {
				assert.NoError(t, opts[r].Step(ctx))
			}
		})
	}
	wg.Wait()
	assert.Zero(t, stepAllocsOnTwoRanks(t, func() error { return opts[0].Step(ctx) }, func() error { return opts[1].Step(ctx) }))
}

// Four in-process ranks fit w to the mean of their targets 0, 1, 2, 3:
// rank r's loss is (w - r)^2. The first 50 steps are exact Adam; after
// that the momentum travels as 1-bit signs.
func ExampleAdam() {
	var final [4]float32
	var stats [4]optim.Stats
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
		w := optim.NewParam("w", 8)
		cfg := onebit.DefaultAdamConfig()
		cfg.LR = 0.05
		cfg.FreezeStep = 50
		opt, err := onebit.NewAdam(ctx, c, []*optim.Param{w}, cfg)
		if err != nil {
			return err
		}
		defer opt.Close() // every holder of an optimizer closes it (not a collective)
		target := float32(c.Rank())
		for step := 0; step < 300; step++ {
			for i, x := range w.Data() {
				w.GradData()[i] = 2 * (x - target)
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		final[c.Rank()] = w.Data()[0]
		stats[c.Rank()] = opt.Stats()
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("w = %.1f on every rank: %v\n", final[0], final[0] == final[1] && final[1] == final[2] && final[2] == final[3])
	fmt.Println("stage:", stats[0].Stage)
	// Output:
	// w = 1.5 on every rank: true
	// stage: compression
}
