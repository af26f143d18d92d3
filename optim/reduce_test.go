package optim

import (
	"context"
	"math"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

var allModes = []ReduceMode{ReduceFP32, ReduceFP16, ReduceBF16, ReduceTwoLevel}

func TestReduceModeNames(t *testing.T) {
	for _, m := range allModes {
		back, err := ParseReduceMode(m.String())
		require.NoError(t, err)
		assert.Equal(t, m, back)
	}
	_, err := ParseReduceMode("int8")
	assert.ErrorContains(t, err, `"int8"`)
	assert.False(t, ReduceMode(7).Valid())
	assert.Equal(t, "ReduceMode(-1)", ReduceMode(-1).String())
	cfg := DefaultAdamConfig()
	cfg.Reduce = 9
	assert.ErrorContains(t, cfg.Validate(), "AdamConfig.Reduce = ReduceMode(9)")
	cfg = DefaultAdamConfig()
	cfg.RanksPerNode = -1
	assert.ErrorContains(t, cfg.Validate(), "AdamConfig.RanksPerNode = -1")
}

// Every mode leaves every rank with the same gradients, the mean of the
// ranks' gradients within the format's rounding; the 16-bit modes send
// half the bytes of fp32, in one collective pair per step whatever the
// number of parameters.
func TestGradAveragerModes(t *testing.T) {
	const w = 4
	shapes := [][]int{{7, 5}, {1}, {0}, {33}}
	tol := map[ReduceMode]float64{ReduceFP32: 1e-6, ReduceTwoLevel: 1e-6, ReduceFP16: 2e-3, ReduceBF16: 1.6e-2}
	for _, m := range allModes {
		t.Run(m.String(), func(t *testing.T) {
			want := testParams(t, 0, shapes...)
			for r := 0; r < w; r++ {
				ps := testParams(t, 0, shapes...)
				fillGrads(ps, r, 3)
				for i := range ps {
					for j, g := range ps[i].GradData() {
						want[i].GradData()[j] += g / w
					}
				}
			}
			var mu sync.Mutex
			got := make([][][]float32, w)
			sent := make([]int64, w)
			err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
				ps := testParams(t, 0, shapes...)
				g, err := NewGradAverager(c, ps, m, 0)
				if err != nil {
					return err
				}
				defer g.Close()
				for step := 0; step < 2; step++ {
					fillGrads(ps, c.Rank(), 3)
					before := c.Stats().Total().BytesSent
					if err := g.Average(ctx); err != nil {
						return err
					}
					mu.Lock()
					sent[c.Rank()] = c.Stats().Total().BytesSent - before
					mu.Unlock()
				}
				mu.Lock()
				defer mu.Unlock()
				for _, p := range ps {
					got[c.Rank()] = append(got[c.Rank()], append([]float32(nil), p.GradData()...))
				}
				return nil
			}, local.WithRanksPerNode(2))
			require.NoError(t, err)
			var fp32Bytes int64
			for _, p := range want {
				fp32Bytes += comm.RingAllReduceBytes(4*int64(p.Numel()), w)
			}
			for r := range got {
				for i := range got[r] {
					assert.Equal(t, bits(got[0][i]), bits(got[r][i]), "rank %d differs from rank 0", r)
					for j, x := range got[r][i] {
						wj := float64(want[i].GradData()[j])
						assert.InDelta(t, wj, float64(x), tol[m]*math.Max(1, math.Abs(wj)), "param %d element %d", i, j)
					}
				}
			}
			switch m {
			case ReduceFP16, ReduceBF16:
				// quant.DownCast: 69 halves in chunks of 18, an 8-byte
				// header per chunk in the all-to-all.
				c := int64(18)
				assert.Equal(t, int64(w-1)*(2*c+8)+int64(w-1)*2*c, sent[0])
			case ReduceFP32:
				assert.Equal(t, fp32Bytes, sent[0])
			}
		})
	}
}

// A gradient that overflows fp16 (finite in float32) makes every rank
// skip the step, in fp16 but not in bf16; a NaN is skipped in every mode.
func TestReduceModesSkipNonFiniteSteps(t *testing.T) {
	const w = 3
	for _, m := range allModes {
		for _, bad := range []float32{float32(math.NaN()), 70000} {
			wantSkip := math.IsNaN(float64(bad)) || m == ReduceFP16
			var mu sync.Mutex
			final := make([][][]float32, w)
			err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
				ps := testParams(t, 5, []int{8}, []int{3, 3})
				cfg := DefaultAdamConfig()
				cfg.Reduce = m
				opt, err := NewAdam(ctx, c, ps, cfg)
				if err != nil {
					return err
				}
				for s := 1; s <= 4; s++ {
					fillGrads(ps, c.Rank(), s)
					if s == 2 && c.Rank() == 1 {
						ps[1].GradData()[4] = bad
					}
					before, err := opt.State()
					if err != nil {
						return err
					}
					if err := opt.Step(ctx); err != nil {
						return err
					}
					if s == 2 && wantSkip {
						after, err := opt.State()
						if err != nil {
							return err
						}
						before.Ints[IntSteps]++
						before.Ints[IntSkipped]++
						assert.Equal(t, before, after, "%s, %v: rank %d: the skipped step changed the state", m, bad, c.Rank())
					}
				}
				st := opt.Stats()
				assert.Equal(t, boolInt64(wantSkip), st.Skipped, "%s, %v: rank %d", m, bad, c.Rank())
				mu.Lock()
				final[c.Rank()] = snapshot(ps)
				mu.Unlock()
				return nil
			}, local.WithRanksPerNode(1))
			require.NoError(t, err)
			for r := range final {
				for i := range final[r] {
					assert.True(t, Finite(final[r][i]))
					assert.Equal(t, bits(final[0][i]), bits(final[r][i]))
				}
			}
		}
	}
}

func boolInt64(b bool) int64 {
	if b {
		return 1
	}
	return 0
}

// Checkpoints record the mode; loading one made in another mode warns,
// and an unknown mode is refused.
func TestCheckpointRecordsReduceMode(t *testing.T) {
	ps := testParams(t, 1, []int{3})
	cfg := DefaultAdamConfig()
	cfg.Reduce = ReduceBF16
	opt, err := NewAdam(context.Background(), nil, ps, cfg)
	require.NoError(t, err)
	ck, err := opt.State()
	require.NoError(t, err)
	assert.Equal(t, int64(ReduceBF16), ck.Ints[IntGradReduce])

	core, logs := observer.New(zapcore.WarnLevel)
	other, err := NewAdam(context.Background(), nil, testParams(t, 1, []int{3}), DefaultAdamConfig(), WithLogger(zap.New(core)))
	require.NoError(t, err)
	require.NoError(t, other.Load(ck))
	assert.Equal(t, 1, logs.FilterMessageSnippet("another gradient reduction mode").Len())
	ck.Ints[IntGradReduce] = 42
	assert.ErrorIs(t, other.Load(ck), ErrIncompatibleCheckpoint)
	delete(ck.Ints, IntGradReduce) // an older checkpoint: fp32
	require.NoError(t, other.Load(ck))
	assert.Equal(t, 1, logs.Len())
}

// Exact Adam and LAMB allocate nothing per step in any mode once running,
// on two ranks (measured over both ranks' goroutines), with a schedule.
func TestExactStepAllocatesNothingInEveryMode(t *testing.T) {
	const runs = 10
	sched := mustSchedule(LinearWarmup(5, mustSchedule(CosineDecay(0.01, 0.001, 100))))
	for _, m := range allModes {
		for _, alg := range []string{AlgorithmAdam, AlgorithmLamb} {
			cs, err := local.New(2, local.WithRanksPerNode(1))
			require.NoError(t, err)
			ctx := context.Background()
			opts := make([]Optimizer, 2)
			for r := range cs {
				ps := testParams(t, 1, []int{64, 3}, []int{10})
				fillGrads(ps, r, 1)
				cfg := DefaultLambConfig()
				cfg.Reduce = m
				if alg == AlgorithmAdam {
					opts[r], err = NewAdam(ctx, cs[r], ps, cfg.AdamConfig)
				} else {
					opts[r], err = NewLamb(ctx, cs[r], ps, cfg)
				}
				require.NoError(t, err)
				require.NoError(t, opts[r].(LRSetter).SetSchedule(sched))
			}
			var wg sync.WaitGroup
			for r := range cs {
				wg.Go(func() { assert.NoError(t, opts[r].Step(ctx)) })
			}
			wg.Wait()
			allocs := allocsOnTwoRanks(t, runs, func() error { return opts[0].Step(ctx) }, func() error { return opts[1].Step(ctx) })
			assert.Zero(t, allocs, "%s %s", alg, m)
			assert.Zero(t, opts[0].Stats().Skipped)
		}
	}
}

// TestCloseReleasesLayout: after a two-level step on 2 nodes of 2 ranks,
// Close releases the layout's communicators (collectives on them fail),
// a second Close does nothing, Step fails with ErrClosed, and State still
// works; for Adam and LAMB.
func TestCloseReleasesLayout(t *testing.T) {
	for _, lamb := range []bool{false, true} {
		err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
			ps := testParams(t, 5, []int{8}, []int{3, 3})
			cfg := DefaultAdamConfig()
			cfg.Reduce, cfg.RanksPerNode = ReduceTwoLevel, 2
			var opt Optimizer
			var e *exact
			if lamb {
				l, err := NewLamb(ctx, c, ps, LambConfig{AdamConfig: cfg, MaxCoeff: 10})
				if err != nil {
					return err
				}
				opt, e = l, l.e
			} else {
				a, err := NewAdam(ctx, c, ps, cfg)
				if err != nil {
					return err
				}
				opt, e = a, a.e
			}
			fillGrads(ps, c.Rank(), 1)
			require.NoError(t, opt.Step(ctx))
			layout := e.avg.layout
			require.NotNil(t, layout, "the first step builds the layout")
			require.NoError(t, opt.Close())
			assert.ErrorIs(t, layout.Intra.Barrier(ctx), comm.ErrClosed, "the node communicator is closed")
			assert.ErrorIs(t, layout.Inter.Barrier(ctx), comm.ErrClosed, "the rail communicator is closed")
			require.NoError(t, opt.Close(), "Close is idempotent")
			assert.ErrorIs(t, opt.Step(ctx), ErrClosed)
			_, err := opt.State()
			assert.NoError(t, err)
			return nil
		})
		require.NoError(t, err, "lamb %v", lamb)
	}
}
