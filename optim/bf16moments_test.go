package optim

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func bf16Config() AdamConfig {
	cfg := DefaultAdamConfig()
	cfg.MomentsBF16 = true
	return cfg
}

// Stochastic rounding is unbiased exactly: over the 2^16 values of r the
// rounded values average to x, for x of either sign, normal or
// subnormal; a bfloat16 value is kept for every r; NaN, ±Inf and the
// largest finite values are handled.
func TestStochasticBF16(t *testing.T) {
	for _, x := range []float32{1 + 1.0/(1<<20), -3.14159, 0.1, 1e-3, -2.5e-7, 1e-40, 123456.7, 0.999} {
		sum := 0.0
		for r := range uint32(1 << 16) {
			sum += float64(widenBF16(stochasticBF16(x, r)))
		}
		assert.Equal(t, float64(x), sum/(1<<16), "%v: the mean of the roundings", x)
		lo, hi := widenBF16(stochasticBF16(x, 0)), widenBF16(stochasticBF16(x, 0xffff))
		assert.LessOrEqual(t, math.Abs(float64(lo)), math.Abs(float64(x)), "%v: r 0 truncates", x)
		assert.GreaterOrEqual(t, math.Abs(float64(hi)), math.Abs(float64(x)), "%v: r 0xffff rounds away from zero", x)
	}
	for _, x := range []float32{0, 1, -1.5, 0.09375, float32(math.Inf(1)), float32(math.Inf(-1))} {
		for _, r := range []uint32{0, 1, 0x8000, 0xffff} {
			assert.Equal(t, x, widenBF16(stochasticBF16(x, r)), "%v is a bfloat16", x)
		}
	}
	assert.True(t, math.IsNaN(float64(widenBF16(stochasticBF16(float32(math.NaN()), 0xffff)))))
	nan := math.Float32frombits(0x7f800001) // a NaN whose payload is in the dropped bits
	assert.True(t, math.IsNaN(float64(widenBF16(stochasticBF16(nan, 0)))))
	for _, x := range []float32{math.MaxFloat32, -math.MaxFloat32} {
		got := widenBF16(stochasticBF16(x, 0xffff))
		assert.False(t, math.IsInf(float64(got), 0), "%v rounded to infinity", x)
		assert.InEpsilon(t, x, got, 1.0/128)
	}
	// The random bits: about half of each of the 32 set.
	var ones [32]int
	const n = 1 << 14
	for i := range n {
		r := roundingBits(roundingSeed(7, 1), i)
		for b := range 32 {
			ones[b] += int(r >> b & 1)
		}
	}
	for b, k := range ones {
		assert.InDelta(t, n/2, k, 4*math.Sqrt(n/4), "bit %d", b)
	}
	assert.NotEqual(t, roundingSeed(1, 0), roundingSeed(2, 0))
	assert.NotEqual(t, roundingSeed(1, 0), roundingSeed(1, 1))
}

// Every step of Adam with bfloat16 moments against a float64 reference
// fed the same moments: each new moment is one of the two bfloat16 values
// around the float64 one (stochastic rounding picks one; the float32
// evaluation may move the float64 value across a bfloat16 by a float32
// rounding, so a value one bfloat16 step beyond counts only where the
// float64 value lies within 2^-20 of a bfloat16), and the parameter takes
// the float64 step computed from the rounded moments, to float32
// rounding.
func TestAdamMomentsBF16MatchesFloat64Reference(t *testing.T) {
	for _, tc := range adamCasesRef {
		t.Run(tc.name, func(t *testing.T) {
			cfg := bf16Config()
			tc.cfg(&cfg)
			ps := testParams(t, 1, []int{7, 9}, []int{5})
			opt, err := NewAdam(context.Background(), nil, ps, cfg)
			require.NoError(t, err)
			e := opt.e
			b1, b2 := float64(cfg.Beta1), float64(cfg.Beta2)
			up, down := 0, 0
			for s := 1; s <= 30; s++ {
				fillGrads(ps, 0, s)
				bc1, bc2 := 1.0, 1.0
				if cfg.BiasCorrection {
					bc1, bc2 = 1-math.Pow(b1, float64(s)), 1-math.Pow(b2, float64(s))
				}
				type before struct{ p, m, v, g []float64 }
				old := make([]before, len(ps))
				for k, p := range ps {
					for i := range p.Data() {
						old[k].p = append(old[k].p, float64(p.Data()[i]))
						old[k].m = append(old[k].m, float64(widenBF16(e.m16[k][i])))
						old[k].v = append(old[k].v, float64(widenBF16(e.v16[k][i])))
						old[k].g = append(old[k].g, float64(p.GradData()[i]))
					}
				}
				require.NoError(t, opt.Step(context.Background()))
				for k, p := range ps {
					for i := range p.Data() {
						o := old[k]
						m := b1*o.m[i] + (1-b1)*o.g[i]
						v := b2*o.v[i] + (1-b2)*o.g[i]*o.g[i]
						gm, gv := widenBF16(e.m16[k][i]), widenBF16(e.v16[k][i])
						for _, c := range []struct {
							name      string
							want, got float64
						}{{"m", m, float64(gm)}, {"v", v, float64(gv)}} {
							requireBracket(t, c.want, c.got, "step %d param %d element %d: %s", s, k, i, c.name)
							if math.Abs(c.got) > math.Abs(c.want) {
								up++
							} else if math.Abs(c.got) < math.Abs(c.want) {
								down++
							}
						}
						u := (float64(gm)/bc1)/(math.Sqrt(float64(gv)/bc2)+float64(cfg.Eps)) + float64(cfg.WeightDecay)*o.p[i]
						want := o.p[i] - float64(cfg.LR)*u
						require.InDelta(t, want, float64(p.Data()[i]), 1e-6*(1+math.Abs(want)), "step %d param %d element %d: p", s, k, i)
					}
				}
			}
			// Stochastic rounding goes both ways.
			assert.Greater(t, up, 100)
			assert.Greater(t, down, 100)
		})
	}
}

// requireBracket checks that got is a bfloat16 next to want: the one
// below or above it in magnitude (either where want is one), or one
// further where want lies within 2^-20 relative of a bfloat16 (the
// float32 evaluation's rounding).
func requireBracket(t *testing.T, want, got float64, msg string, args ...any) {
	t.Helper()
	require.Zero(t, math.Float32bits(float32(got))&0xffff, append([]any{msg}, args...)...)
	x := float32(want)
	lo, hi := widenBF16(stochasticBF16(x, 0)), widenBF16(stochasticBF16(x, 0xffff))
	if float64(lo) == got || float64(hi) == got {
		return
	}
	slack := math.Abs(want) * (1.0 / (1 << 20))
	for _, y := range []float64{want - slack, want + slack} {
		x := float32(y)
		if float64(widenBF16(stochasticBF16(x, 0))) == got || float64(widenBF16(stochasticBF16(x, 0xffff))) == got {
			return
		}
	}
	require.Failf(t, "not a bfloat16 neighbour", "got %v, want one around %v: "+fmt.Sprintf(msg, args...), got, want)
}

// v follows its recursion, unstalled: after a gradient of 1 for 500 steps
// and 0.1 for 2000, v decays from about 0.39 to 0.062 by 0.1% a step,
// each step below half a bfloat16 spacing; rounded to nearest, v would
// stay where it was. The mean of the bfloat16 v over 4096 elements is
// within 2% of the float64 recursion (its stochastic noise is about 5% of
// v per element), and m is exact at 0.1 where it settles.
func TestAdamMomentsBF16VarianceDoesNotStall(t *testing.T) {
	const n = 4096
	p := NewParam("w", n)
	cfg := bf16Config()
	cfg.LR = 0
	opt, err := NewAdam(context.Background(), nil, []*Param{p}, cfg)
	require.NoError(t, err)
	v := 0.0
	for s := 1; s <= 2500; s++ {
		g := float32(1)
		if s > 500 {
			g = 0.1
		}
		for i := range p.GradData() {
			p.GradData()[i] = g
		}
		require.NoError(t, opt.Step(context.Background()))
		v = 0.999*v + 0.001*float64(g)*float64(g)
	}
	mean := 0.0
	for _, h := range opt.e.v16[0] {
		mean += float64(widenBF16(h)) / n
	}
	t.Logf("v: float64 %.5f, bfloat16 mean %.5f (rounded to nearest it stalls: 0.25 measured)", v, mean)
	assert.InEpsilon(t, v, mean, 0.02)
	assert.Less(t, v, 0.07, "the test's premise: v has decayed far from 0.39")
	for _, h := range opt.e.m16[0][:8] {
		assert.InEpsilon(t, 0.1, widenBF16(h), 1.0/128)
	}
}

// StateBytes: 4 bytes per parameter for the moments, half the float32
// mode's.
func TestAdamMomentsBF16StateBytes(t *testing.T) {
	ps := testParams(t, 3, []int{64, 3}, []int{10})
	full, err := NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
	require.NoError(t, err)
	half, err := NewAdam(context.Background(), nil, ps, bf16Config())
	require.NoError(t, err)
	assert.Equal(t, int64(8*202), full.StateBytes())
	assert.Equal(t, int64(4*202), half.StateBytes())
}

// A checkpoint records the mode and holds bfloat16 values; one of the
// other mode is refused both ways, naming both settings, and changes
// nothing; LAMB refuses the mode. (TestExactResumeIsBitIdentical resumes
// bfloat16 moments on 2 ranks.)
func TestAdamMomentsBF16RefusesTheOtherMode(t *testing.T) {
	ctx := context.Background()
	states := map[bool]*Checkpoint{}
	for _, bf := range []bool{false, true} {
		cfg := DefaultAdamConfig()
		cfg.MomentsBF16 = bf
		ps := testParams(t, 4, []int{6})
		opt, err := NewAdam(ctx, nil, ps, cfg)
		require.NoError(t, err)
		fillGrads(ps, 0, 1)
		require.NoError(t, opt.Step(ctx))
		states[bf], err = opt.State()
		require.NoError(t, err)
	}
	assert.Equal(t, int64(1), states[true].Ints[IntMomentsBF16])
	assert.NotContains(t, states[false].Ints, IntMomentsBF16)
	for _, name := range []string{ExpAvgPrefix, ExpAvgSqPrefix} {
		tn := states[true].Tensor(name + "a-param")
		require.NotNil(t, tn, name)
		for i, x := range tn.Data {
			assert.Zero(t, math.Float32bits(x)&0xffff, "%s element %d: %v is not a bfloat16", name, i, x)
			assert.NotZero(t, x, "%s element %d", name, i)
		}
	}
	for _, bf := range []bool{false, true} {
		cfg := DefaultAdamConfig()
		cfg.MomentsBF16 = bf
		ps := testParams(t, 5, []int{6})
		opt, err := NewAdam(ctx, nil, ps, cfg)
		require.NoError(t, err)
		before, err := opt.State()
		require.NoError(t, err)
		err = opt.Load(states[!bf])
		assert.ErrorIs(t, err, ErrIncompatibleCheckpoint)
		assert.ErrorContains(t, err, fmt.Sprintf("made with MomentsBF16 %v, this optimizer has %v", !bf, bf))
		after, err := opt.State()
		require.NoError(t, err)
		assert.Equal(t, before, after, "a refused Load changed the optimizer")
		require.NoError(t, opt.Load(states[bf]))
	}
	bad := *states[true]
	bad.Ints = map[string]int64{}
	for k, v := range states[true].Ints {
		bad.Ints[k] = v
	}
	bad.Ints[IntMomentsBF16] = 2
	opt, err := NewAdam(ctx, nil, testParams(t, 5, []int{6}), bf16Config())
	require.NoError(t, err)
	assert.ErrorContains(t, opt.Load(&bad), "moments_bf16 = 2")

	lc := DefaultLambConfig()
	lc.MomentsBF16 = true
	_, err = NewLamb(ctx, nil, testParams(t, 5, []int{6}), lc)
	var ce *ConfigError
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, "MomentsBF16", ce.Field)
	assert.ErrorContains(t, err, "optim: LambConfig.MomentsBF16 = true")
}
