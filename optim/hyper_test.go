package optim

import (
	"context"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// Every hyperparameter that decides a step is recorded in the checkpoint,
// and a resume with another value of any of them is refused, naming it and
// both values, with the optimizer left unchanged.
func TestCheckpointRefusesOtherHyperparameters(t *testing.T) {
	changes := map[string]func(*LambConfig){
		"beta1":           func(c *LambConfig) { c.Beta1 = 0.8 },
		"beta2":           func(c *LambConfig) { c.Beta2 = 0.99 },
		"eps":             func(c *LambConfig) { c.Eps = 1e-6 },
		"weight_decay":    func(c *LambConfig) { c.WeightDecay = 0.5 },
		"bias_correction": func(c *LambConfig) { c.BiasCorrection = false },
		"max_coeff":       func(c *LambConfig) { c.MaxCoeff = 5 },
		"min_coeff":       func(c *LambConfig) { c.MinCoeff = 0.02 },
	}
	for _, alg := range []string{AlgorithmAdam, AlgorithmLamb} {
		mk := func(cfg LambConfig) Optimizer {
			ps := testParams(t, 3, []int{4}, []int{2, 3})
			var opt Optimizer
			var err error
			if alg == AlgorithmAdam {
				opt, err = NewAdam(context.Background(), nil, ps, cfg.AdamConfig)
			} else {
				opt, err = NewLamb(context.Background(), nil, ps, cfg)
			}
			require.NoError(t, err)
			fillGrads(ps, 0, 1)
			require.NoError(t, opt.Step(context.Background()))
			return opt
		}
		base := DefaultLambConfig()
		base.WeightDecay = 0.01
		ck, err := mk(base).State()
		require.NoError(t, err)
		want := AdamHypers(base.AdamConfig)
		if alg == AlgorithmLamb {
			want = LambHypers(base)
		}
		recorded := 0
		for k := range ck.Floats {
			if strings.HasPrefix(k, HyperPrefix) {
				recorded++
			}
		}
		assert.Equal(t, len(want), recorded, alg)
		for _, h := range want {
			name := h.Name
			change, ok := changes[name]
			require.True(t, ok, "no test changes %s", name)
			assert.Equal(t, math.Float64bits(h.Value), math.Float64bits(ck.Floats[HyperPrefix+name]), "%s %s", alg, name)
			cfg := base
			change(&cfg)
			other := mk(cfg)
			before, err := other.State()
			require.NoError(t, err)
			err = other.Load(ck)
			require.ErrorIs(t, err, ErrIncompatibleCheckpoint, "%s %s", alg, name)
			assert.ErrorContains(t, err, "made with "+name+" "+FormatHyper(h.Value)+", this optimizer has ", "%s %s", alg, name)
			after, err := other.State()
			require.NoError(t, err)
			assert.Equal(t, before, after, "%s %s: a refused load changed the optimizer", alg, name)

			// Deleting the entry is how to change it on purpose.
			edited := *ck
			edited.Floats = clonedFloats(ck.Floats)
			delete(edited.Floats, HyperPrefix+name)
			require.NoError(t, other.Load(&edited), "%s %s", alg, name)
		}
		// The same values load.
		require.NoError(t, mk(base).Load(ck), alg)
	}
}

func clonedFloats(m map[string]float64) map[string]float64 {
	out := make(map[string]float64, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

// A checkpoint made before hyperparameters were recorded loads: the
// optimizer keeps its own values and logs a warning naming them. One that
// records a hyperparameter the optimizer does not have is refused.
func TestCheckpointWithoutHyperparameters(t *testing.T) {
	ps := testParams(t, 3, []int{5})
	opt, err := NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
	require.NoError(t, err)
	fillGrads(ps, 0, 1)
	require.NoError(t, opt.Step(context.Background()))
	ck, err := opt.State()
	require.NoError(t, err)
	old := *ck
	old.Floats = map[string]float64{}
	for k, v := range ck.Floats {
		if !strings.HasPrefix(k, HyperPrefix) {
			old.Floats[k] = v
		}
	}
	// Through the file format, as an old file would come.
	b, err := old.MarshalBinary()
	require.NoError(t, err)
	var back Checkpoint
	require.NoError(t, back.UnmarshalBinary(b))

	core, logs := observer.New(zapcore.WarnLevel)
	cfg := DefaultAdamConfig()
	cfg.Beta1 = 0.5
	other, err := NewAdam(context.Background(), nil, testParams(t, 3, []int{5}), cfg, WithLogger(zap.New(core)))
	require.NoError(t, err)
	require.NoError(t, other.Load(&back))
	warned := logs.FilterMessageSnippet("does not record these hyperparameters").All()
	require.Len(t, warned, 1)
	assert.Equal(t, []any{"beta1", "beta2", "eps", "weight_decay", "bias_correction"}, warned[0].ContextMap()["hyperparameters"])
	// It keeps its own beta1, and records it from now on.
	now, err := other.State()
	require.NoError(t, err)
	assert.Equal(t, float64(float32(0.5)), now.Floats[HyperPrefix+"beta1"])

	unknown := *ck
	unknown.Floats = clonedFloats(ck.Floats)
	unknown.Floats[HyperPrefix+"momentum"] = 0.9
	err = opt.Load(&unknown)
	require.ErrorIs(t, err, ErrIncompatibleCheckpoint)
	assert.ErrorContains(t, err, "hyperparameter momentum 0.9, which adam does not have")
}

func TestCheckpointHyperFingerprint(t *testing.T) {
	assert.Zero(t, HyperFingerprint(nil))
	assert.Zero(t, HyperFingerprint([][]float32{nil, nil}))
	a := HyperFingerprint([][]float32{nil, {1, 0, 1}})
	assert.NotZero(t, a)
	assert.Equal(t, a, float64(int64(a)), "an integer, exact in a float64")
	assert.Less(t, a, float64(1<<53))
	for _, other := range [][][]float32{
		{{1, 0, 1}, nil},      // another parameter
		{nil, {1, 0, 0}},      // another value
		{nil, {1, 0, 1, 0}},   // another length
		{nil, {1, 0, 1}, {1}}, // one more mask
	} {
		assert.NotEqual(t, a, HyperFingerprint(other), "%v", other)
	}
	assert.Equal(t, a, HyperFingerprint([][]float32{nil, {1, 0, 1}}))
	assert.Equal(t, "0.9", FormatHyper(float64(float32(0.9))))
	assert.Equal(t, "100000", FormatHyper(100000))
	assert.Equal(t, "1e-08", FormatHyper(float64(float32(1e-8))))
}
