package zero_test

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
	"github.com/lowbit-ml/lowbit/quant"
)

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// testShapes cover sizes that no world size divides, a scalar-like
// tensor and an empty one.
var testShapes = [][]int{{7, 5}, {3}, {0}, {13}, {1}, {4, 4}}

// newParams returns parameters of the given shapes with deterministic
// values, named "p0", "p1", ...
func newParams(t testing.TB, shapes ...[]int) []*optim.Param {
	t.Helper()
	ps := make([]*optim.Param, len(shapes))
	for i, sh := range shapes {
		p := optim.NewParam(fmt.Sprintf("p%d", i), sh...)
		for j := range p.Data() {
			p.Data()[j] = float32(math.Sin(float64(1000+i*100+j))) * 0.5
		}
		ps[i] = p
	}
	return ps
}

// fillGrads writes a deterministic gradient that depends on rank and step.
func fillGrads(ps []*optim.Param, rank, step int) {
	for i, p := range ps {
		g := p.GradData()
		for j := range g {
			g[j] = float32(math.Cos(float64(step*7919+rank*104729+i*31+j*3))) * (1 + float32(rank))
		}
	}
}

func values(ps []*optim.Param) [][]float32 {
	out := make([][]float32, len(ps))
	for i, p := range ps {
		out[i] = append([]float32(nil), p.Data()...)
	}
	return out
}

func bits(x [][]float32) [][]uint32 {
	out := make([][]uint32, len(x))
	for i, s := range x {
		out[i] = make([]uint32, len(s))
		for j, v := range s {
			out[i][j] = math.Float32bits(v)
		}
	}
	return out
}

type newOpt func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)

func adamOpt(cfg optim.AdamConfig) newOpt {
	return func(_ context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewAdam(context.Background(), c, ps, cfg)
	}
}

func zeroOpt(cfg zero.Config) newOpt {
	return func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return zero.NewAdam(ctx, c, ps, cfg)
	}
}

// run trains steps steps of fillGrads gradients on w ranks (from step
// from) and returns every rank's final values and checkpoint. before, when
// not nil, may change rank r's gradients before step t. load, when not
// nil, gives the checkpoint rank r loads first.
type runSpec struct {
	w        int
	from, to int
	mk       newOpt
	before   func(rank, t int, ps []*optim.Param)
	load     func(rank int) *optim.Checkpoint
	opts     []local.Option
	shapes   [][]int
}

type runResult struct {
	vals  [][][]float32
	cks   []*optim.Checkpoint
	stats []optim.Stats
}

func run(t *testing.T, s runSpec) runResult {
	t.Helper()
	if s.shapes == nil {
		s.shapes = testShapes
	}
	if s.from == 0 {
		s.from = 1
	}
	res := runResult{vals: make([][][]float32, s.w), cks: make([]*optim.Checkpoint, s.w), stats: make([]optim.Stats, s.w)}
	err := local.Run(testCtx(t), s.w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		ps := newParams(t, s.shapes...)
		opt, err := s.mk(ctx, c, ps)
		if err != nil {
			return err
		}
		if s.load != nil {
			if err := opt.Load(s.load(r)); err != nil {
				return err
			}
		}
		for step := s.from; step <= s.to; step++ {
			fillGrads(ps, r, step)
			if s.before != nil {
				s.before(r, step, ps)
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		res.vals[r] = values(ps)
		res.stats[r] = opt.Stats()
		res.cks[r], err = opt.State()
		return err
	}, s.opts...)
	require.NoError(t, err)
	return res
}

// TestFP32MatchesAdam: with the exact reduce-scatter, sharded Adam ends
// bit for bit where optim.Adam does, on 1, 2 and 4 ranks, whatever the
// bucket size. comm/local computes the mean of ReduceScatter and AllReduce
// the same way (sum in ascending rank order, then one division by W), and
// the update is element-wise with the same kernel, so nothing may differ.
func TestFP32MatchesAdam(t *testing.T) {
	adam := optim.DefaultAdamConfig()
	adam.LR = 0.01
	adam.WeightDecay = 0.01
	for _, w := range []int{1, 2, 4} {
		want := run(t, runSpec{w: w, to: 6, mk: adamOpt(adam)})
		for _, bucket := range []int{0, 1, 3 * w, 1 << 20} {
			t.Run(fmt.Sprintf("W=%d/bucket=%d", w, bucket), func(t *testing.T) {
				cfg := zero.DefaultConfig()
				cfg.AdamConfig = adam
				cfg.BucketBytes = 4 * bucket
				got := run(t, runSpec{w: w, to: 6, mk: zeroOpt(cfg)})
				for r := range w {
					require.Equal(t, bits(want.vals[0]), bits(got.vals[r]), "rank %d", r)
					assert.Equal(t, int64(6), got.stats[r].Steps)
					if w > 1 {
						assert.Positive(t, got.stats[r].LastStepBytes)
					}
				}
				// The moments, joined from every rank's shard, are optim.Adam's.
				ck, err := zero.Consolidate(got.cks)
				require.NoError(t, err)
				for _, tn := range want.cks[0].Tensors {
					u := ck.Tensor(tn.Name)
					require.NotNil(t, u, tn.Name)
					assert.Equal(t, tn.Shape, u.Shape, tn.Name)
					assert.Equal(t, bits([][]float32{tn.Data}), bits([][]float32{u.Data}), tn.Name)
				}
			})
		}
	}
}

// TestSkipsNonFinite: a NaN or Inf in one rank's gradient makes every rank
// skip the step, exactly as optim.Adam does.
func TestSkipsNonFinite(t *testing.T) {
	poison := func(rank, step int, ps []*optim.Param) {
		if rank == 1 && step == 3 {
			ps[0].GradData()[2] = float32(math.NaN())
		}
		if rank == 2 && step == 5 {
			ps[3].GradData()[0] = float32(math.Inf(-1))
		}
	}
	want := run(t, runSpec{w: 4, to: 7, mk: adamOpt(optim.DefaultAdamConfig()), before: poison})
	got := run(t, runSpec{w: 4, to: 7, mk: zeroOpt(zero.DefaultConfig()), before: poison})
	for r := range 4 {
		assert.Equal(t, bits(want.vals[0]), bits(got.vals[r]), "rank %d", r)
		assert.Equal(t, int64(7), got.stats[r].Steps)
		assert.Equal(t, int64(2), got.stats[r].Skipped)
		assert.Equal(t, int64(5), got.cks[r].Ints[optim.IntStep])
	}
}

// TestStepAllocatesNothing measures both ranks' goroutines while rank 0
// runs under testing.AllocsPerRun.
func TestStepAllocatesNothing(t *testing.T) {
	for _, cfg := range allModes(t) {
		t.Run(cfg.ReduceScatter.String(), func(t *testing.T) {
			const runs = 20
			cs, err := local.New(2)
			require.NoError(t, err)
			ctx := testCtx(t)
			opts := make([]*zero.Adam, 2)
			pss := make([][]*optim.Param, 2)
			var wg sync.WaitGroup
			for r := range cs {
				pss[r] = newParams(t, []int{300}, []int{17, 3}, []int{0}, []int{5})
				wg.Go(func() {
					var err error
					opts[r], err = zero.NewAdam(ctx, cs[r], pss[r], cfg)
					assert.NoError(t, err)
					if err == nil {
						fillGrads(pss[r], r, 1)
						assert.NoError(t, opts[r].Step(ctx))
					}
				})
			}
			wg.Wait()
			require.NotNil(t, opts[0])
			require.NotNil(t, opts[1])
			done := make(chan struct{})
			go func() {
				defer close(done)
				for range runs + 1 { // AllocsPerRun makes one extra warm-up call
					if err := opts[1].Step(ctx); err != nil {
						t.Error(err)
						return
					}
				}
			}()
			allocs := testing.AllocsPerRun(runs, func() {
				if err := opts[0].Step(ctx); err != nil {
					t.Error(err)
				}
			})
			<-done
			assert.Zero(t, allocs)
			for r := range cs {
				assert.NoError(t, opts[r].Close())
				assert.NoError(t, cs[r].Close())
			}
		})
	}
}

// allModes returns the default configuration in every reduce mode.
func allModes(t testing.TB) []zero.Config {
	var out []zero.Config
	for _, m := range []zero.Reduce{zero.ReduceFP32, zero.ReduceCoalesced, zero.ReduceInt8, zero.ReduceInt4} {
		cfg := zero.DefaultConfig()
		cfg.ReduceScatter = m
		out = append(out, cfg)
	}
	return out
}

// TestMemory counts the float32s of optimizer state per rank (see
// Adam.StateFloats) against optim.Adam's two moments of n elements. The
// moments are a 1/W share (ceil(n/W) elements each at most). In the flat
// modes the buckets' staging and work buffers add about W+1 (W+Nodes+2
// with qgZ) buckets of BucketBytes/(4W) elements: with the default
// (25 MiB, larger than this model) a whole model's worth, with buckets of
// 1024 elements under 2/W of optim.Adam's in all. The coalesced mode's reduce-scatter (quant.Coalesced) needs
// a flat buffer as large as the model.
func TestMemory(t *testing.T) {
	const n = 10007
	shapes := [][]int{{100, 90}, {1007}}
	adam := 2 * n
	for _, w := range []int{2, 4, 8} {
		part := (n + w - 1) / w
		for _, small := range []bool{false, true} {
			for _, cfg := range allModes(t) {
				if small {
					if cfg.ReduceScatter == zero.ReduceCoalesced {
						continue
					}
					cfg.BucketBytes = 4 * 1024
				}
				var got [8]int
				err := local.Run(testCtx(t), w, func(ctx context.Context, c comm.Comm) error {
					opt, err := zero.NewAdam(ctx, c, newParams(t, shapes...), cfg)
					if err != nil {
						return err
					}
					defer opt.Close()
					got[c.Rank()] = opt.StateFloats()
					return nil
				})
				require.NoError(t, err)
				r := 0 // rank 0 owns a full partition
				ratio := float64(got[r]) / float64(adam)
				t.Logf("W=%d %-9v bucket %4d: %6d floats, %.3f of optim.Adam's %d (%.2f/W)", w, cfg.ReduceScatter, cfg.BucketBytes, got[r], ratio, adam, ratio*float64(w))
				b := min(part, optim.DefaultBucketBytes/4/w) // default bucket per rank
				if small {
					b = 1024 / w
				}
				switch cfg.ReduceScatter {
				case zero.ReduceFP32:
					assert.LessOrEqual(t, got[r], 2*part+(w+1)*b, "W=%d %v", w, cfg.ReduceScatter)
				case zero.ReduceInt8, zero.ReduceInt4:
					groups := (b + quant.DefaultGroupSize - 1) / quant.DefaultGroupSize // scales of a partition
					assert.LessOrEqual(t, got[r], 2*part+(w+3)*b+2*groups, "W=%d %v", w, cfg.ReduceScatter)
				case zero.ReduceCoalesced:
					s := part + len(shapes)
					assert.LessOrEqual(t, got[r], 2*s+(2*w+1)*(s+1), "W=%d %v", w, cfg.ReduceScatter)
				}
				if small {
					assert.Less(t, ratio, 2/float64(w), "W=%d %v", w, cfg.ReduceScatter)
				}
			}
		}
	}
}

// TestResumeIsBitExact: training 4 steps, saving every rank's checkpoint
// to a file, loading them into fresh optimizers in a new group (whose
// parameters start elsewhere) and training 4 more ends bit for bit where 8
// uninterrupted steps do.
func TestResumeIsBitExact(t *testing.T) {
	for _, cfg := range allModes(t) {
		t.Run(cfg.ReduceScatter.String(), func(t *testing.T) {
			const w = 4
			want := run(t, runSpec{w: w, to: 8, mk: zeroOpt(cfg)})
			half := run(t, runSpec{w: w, to: 4, mk: zeroOpt(cfg)})
			dir := t.TempDir()
			for r, ck := range half.cks {
				require.NoError(t, optim.SaveFile(filepath.Join(dir, fmt.Sprint(r)), ck))
			}
			got := run(t, runSpec{w: w, from: 5, to: 8, mk: zeroOpt(cfg), load: func(r int) *optim.Checkpoint {
				ck, err := optim.LoadFile(filepath.Join(dir, fmt.Sprint(r)))
				require.NoError(t, err)
				return ck
			}})
			for r := range w {
				assert.Equal(t, bits(want.vals[r]), bits(got.vals[r]), "rank %d", r)
				assert.Equal(t, want.cks[r], got.cks[r], "rank %d", r)
			}
		})
	}
}

// TestLoadRefuses: another world size, rank, reduce mode or algorithm is
// refused with a clear error, and a refused Load changes nothing.
func TestLoadRefuses(t *testing.T) {
	cfg := zero.DefaultConfig()
	four := run(t, runSpec{w: 4, to: 2, mk: zeroOpt(cfg)})
	two := run(t, runSpec{w: 2, to: 2, mk: zeroOpt(cfg)})
	adam := run(t, runSpec{w: 2, to: 2, mk: adamOpt(cfg.AdamConfig)})
	int8 := cfg
	int8.ReduceScatter = zero.ReduceInt8
	other := run(t, runSpec{w: 2, to: 2, mk: zeroOpt(int8)})
	cases := []struct {
		name string
		ck   func(r int) *optim.Checkpoint
		msg  string
	}{
		{"world", func(r int) *optim.Checkpoint { return four.cks[r] }, "made on 4 ranks, this group has 2"},
		{"world with errors reset", func(r int) *optim.Checkpoint { return four.cks[r].ResetErrors() }, "re-shard explicitly"},
		{"rank", func(r int) *optim.Checkpoint { return two.cks[1-r] }, "each rank holds its own shard"},
		{"mode", func(r int) *optim.Checkpoint { return other.cks[r] }, "reduce-scatter mode int8"},
		{"algorithm", func(r int) *optim.Checkpoint { return adam.cks[r] }, `algorithm "adam"`},
		{"nil", func(r int) *optim.Checkpoint { return nil }, "nil checkpoint"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := local.Run(testCtx(t), 2, func(ctx context.Context, c comm.Comm) error {
				ps := newParams(t, testShapes...)
				opt, err := zero.NewAdam(ctx, c, ps, cfg)
				if err != nil {
					return err
				}
				before, err := opt.State()
				if err != nil {
					return err
				}
				err = opt.Load(tc.ck(c.Rank()))
				assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
				assert.ErrorContains(t, err, tc.msg)
				after, err := opt.State()
				if err != nil {
					return err
				}
				assert.Equal(t, before, after, "a refused Load changed the state")
				return nil
			})
			require.NoError(t, err)
		})
	}
}

// TestReshard moves training from 4 ranks to 2 with Consolidate and
// compares with optim.Adam doing the same (its checkpoints hold whole
// moments and load on any group as they are): bit for bit, in every
// direction of mode change (fp32 before, coalesced after).
func TestReshard(t *testing.T) {
	cfg := zero.DefaultConfig()
	adam := run(t, runSpec{w: 4, to: 3, mk: adamOpt(cfg.AdamConfig)})
	adamCk := adam.cks[0]
	want := run(t, runSpec{w: 2, from: 4, to: 6, mk: adamOpt(cfg.AdamConfig), load: func(int) *optim.Checkpoint { return adamCk }})

	four := run(t, runSpec{w: 4, to: 3, mk: zeroOpt(cfg)})
	ck, err := zero.Consolidate([]*optim.Checkpoint{four.cks[2], four.cks[0], four.cks[3], four.cks[1]})
	require.NoError(t, err)
	assert.Equal(t, int64(1), ck.Ints[zero.IntConsolidated])
	for _, mode := range []zero.Reduce{zero.ReduceFP32, zero.ReduceCoalesced} {
		c := cfg
		c.ReduceScatter = mode
		got := run(t, runSpec{w: 2, from: 4, to: 6, mk: zeroOpt(c), load: func(int) *optim.Checkpoint { return ck }})
		for r := range 2 {
			assert.Equal(t, bits(want.vals[0]), bits(got.vals[r]), "%v rank %d", mode, r)
		}
	}

	// Consolidate refuses incomplete or inconsistent sets.
	_, err = zero.Consolidate(four.cks[:3])
	assert.ErrorContains(t, err, "of 4 ranks among 3 checkpoints")
	_, err = zero.Consolidate([]*optim.Checkpoint{four.cks[0], four.cks[0], four.cks[2], four.cks[3]})
	assert.ErrorContains(t, err, "rank 0 is missing or given twice")
	later := run(t, runSpec{w: 4, to: 4, mk: zeroOpt(cfg)})
	_, err = zero.Consolidate([]*optim.Checkpoint{four.cks[0], later.cks[1], four.cks[2], four.cks[3]})
	assert.ErrorContains(t, err, "different steps")
	_, err = zero.Consolidate([]*optim.Checkpoint{ck})
	assert.Error(t, err)
	_, err = zero.Consolidate(adam.cks)
	assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
}

// TestMismatchAcrossRanks: parameter lists or configurations that differ
// across ranks are reported on every rank at construction.
func TestMismatchAcrossRanks(t *testing.T) {
	cases := []struct {
		name string
		mk   func(r int) ([]*optim.Param, zero.Config)
		msg  string
	}{
		{"count", func(r int) ([]*optim.Param, zero.Config) {
			if r == 2 {
				return newParams(t, []int{3}, []int{4}, []int{5}), zero.DefaultConfig()
			}
			return newParams(t, []int{3}, []int{4}), zero.DefaultConfig()
		}, "rank 2 has 3 tensors of 12 elements in all, rank 0 has 2 of 7"},
		{"shape", func(r int) ([]*optim.Param, zero.Config) {
			if r == 1 {
				return newParams(t, []int{4, 3}), zero.DefaultConfig()
			}
			return newParams(t, []int{3, 4}), zero.DefaultConfig()
		}, "names or shapes differ across ranks (rank 1 and rank 0"},
		{"invalid on one rank", func(r int) ([]*optim.Param, zero.Config) {
			cfg := zero.DefaultConfig()
			if r == 3 {
				cfg.LR = -1
			}
			return newParams(t, []int{3, 4}), cfg
		}, "rank 3 was given an invalid configuration"},
		{"nil parameter on one rank", func(r int) ([]*optim.Param, zero.Config) {
			ps := newParams(t, []int{3, 4})
			if r == 1 {
				ps[0] = nil
			}
			return ps, zero.DefaultConfig()
		}, "rank 1 was given an invalid configuration or invalid parameters"},
		{"config", func(r int) ([]*optim.Param, zero.Config) {
			cfg := zero.DefaultConfig()
			cfg.BucketBytes = 32 * (r + 1)
			return newParams(t, []int{3, 4}), cfg
		}, "configurations differ across ranks (rank 1 and rank 0)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			errs := make([]error, 4)
			_ = local.Run(testCtx(t), 4, func(ctx context.Context, c comm.Comm) error {
				ps, cfg := tc.mk(c.Rank())
				_, errs[c.Rank()] = zero.NewAdam(ctx, c, ps, cfg)
				return nil
			})
			for r, err := range errs {
				assert.ErrorContains(t, err, tc.msg, "rank %d", r)
			}
		})
	}
}

// TestRejectsBadInput: invalid configurations and parameters are refused
// before any communication.
func TestRejectsBadInput(t *testing.T) {
	ctx := testCtx(t)
	ps := newParams(t, []int{3})
	for _, mod := range []func(*zero.Config){
		func(c *zero.Config) { c.LR = -1 },
		func(c *zero.Config) { c.Beta2 = 1 },
		func(c *zero.Config) { c.ReduceScatter = 9 },
		func(c *zero.Config) { c.AdamConfig.Reduce = optim.ReduceFP16 },
		func(c *zero.Config) { c.BucketBytes = -1 },
		func(c *zero.Config) { c.BucketBytes = 3 },
		func(c *zero.Config) { c.GroupSize = -1 },
		func(c *zero.Config) { c.RanksPerNode = -2 },
	} {
		cfg := zero.DefaultConfig()
		mod(&cfg)
		_, err := zero.NewAdam(ctx, nil, ps, cfg)
		assert.Error(t, err)
	}
	_, err := zero.NewAdam(ctx, nil, []*optim.Param{ps[0], ps[0]}, zero.DefaultConfig())
	assert.ErrorContains(t, err, "used twice")
	_, err = zero.NewAdam(ctx, nil, []*optim.Param{nil}, zero.DefaultConfig())
	assert.Error(t, err)

	// A tensor replaced by one of another size after construction.
	opt, err := zero.NewAdam(ctx, nil, ps, zero.DefaultConfig())
	require.NoError(t, err)
	*ps[0] = *optim.NewParam("p0", 4)
	assert.ErrorContains(t, opt.Step(ctx), "no longer holds the 3 elements")
}

func TestParseReduce(t *testing.T) {
	for _, m := range []zero.Reduce{zero.ReduceFP32, zero.ReduceCoalesced, zero.ReduceInt8, zero.ReduceInt4} {
		got, err := zero.ParseReduce(m.String())
		require.NoError(t, err)
		assert.Equal(t, m, got)
	}
	_, err := zero.ParseReduce("fp8")
	assert.ErrorContains(t, err, `unknown reduce mode "fp8"`)
	assert.Equal(t, "Reduce(7)", zero.Reduce(7).String())
}

// TestSchedule: a learning-rate schedule set through optim.LRSetter gives
// the same result as in optim.Adam, and survives a checkpoint and a
// consolidation.
func TestSchedule(t *testing.T) {
	sched, err := optim.CosineDecay(0.02, 0.001, 6)
	require.NoError(t, err)
	withSched := func(mk newOpt) newOpt {
		return func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			o, err := mk(ctx, c, ps)
			if err != nil {
				return nil, err
			}
			return o, o.(optim.LRSetter).SetSchedule(sched)
		}
	}
	cfg := zero.DefaultConfig()
	want := run(t, runSpec{w: 2, to: 6, mk: withSched(adamOpt(cfg.AdamConfig))})
	got := run(t, runSpec{w: 2, to: 6, mk: withSched(zeroOpt(cfg))})
	assert.Equal(t, bits(want.vals[0]), bits(got.vals[1]))

	half := run(t, runSpec{w: 2, to: 3, mk: withSched(zeroOpt(cfg))})
	ck, err := zero.Consolidate(half.cks)
	require.NoError(t, err)
	resumed := run(t, runSpec{w: 2, from: 4, to: 6, mk: withSched(zeroOpt(cfg)), load: func(int) *optim.Checkpoint { return ck }})
	assert.Equal(t, bits(want.vals[0]), bits(resumed.vals[0]))

	// Without the schedule the checkpoint is refused (optim.Frame's rule).
	err = local.Run(testCtx(t), 2, func(ctx context.Context, c comm.Comm) error {
		opt, err := zero.NewAdam(ctx, c, newParams(t, testShapes...), cfg)
		if err != nil {
			return err
		}
		assert.ErrorContains(t, opt.Load(half.cks[c.Rank()]), "learning-rate schedule")
		require.NoError(t, opt.SetLR(0.5))
		assert.Equal(t, float32(0.5), opt.LR())
		return nil
	})
	require.NoError(t, err)
}
