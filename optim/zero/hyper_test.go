package zero_test

import (
	"maps"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

// Sharded Adam records Adam's hyperparameters in its checkpoints (and
// Consolidate keeps them), and a resume with another value of any of them
// is refused, naming it, with the optimizer left unchanged.
func TestCheckpointRefusesOtherHyperparameters(t *testing.T) {
	changes := map[string]func(*zero.Config){
		"beta1":           func(c *zero.Config) { c.Beta1 = 0.8 },
		"beta2":           func(c *zero.Config) { c.Beta2 = 0.99 },
		"eps":             func(c *zero.Config) { c.Eps = 1e-6 },
		"weight_decay":    func(c *zero.Config) { c.WeightDecay = 0.5 },
		"bias_correction": func(c *zero.Config) { c.BiasCorrection = false },
	}
	build := func(t *testing.T, cfg zero.Config) *zero.Adam {
		ps := newParams(t, testShapes...)
		opt, err := zero.NewAdam(testCtx(t), nil, ps, cfg)
		require.NoError(t, err)
		for s := 1; s <= 2; s++ {
			fillGrads(ps, 0, s)
			require.NoError(t, opt.Step(testCtx(t)))
		}
		return opt
	}
	base := zero.DefaultConfig()
	base.WeightDecay = 0.01
	ck, err := build(t, base).State()
	require.NoError(t, err)
	consolidated, err := zero.Consolidate([]*optim.Checkpoint{ck})
	require.NoError(t, err)
	var recorded []string
	for k := range ck.Floats {
		if name, ok := strings.CutPrefix(k, optim.HyperPrefix); ok {
			recorded = append(recorded, name)
		}
	}
	assert.ElementsMatch(t, recorded, []string{"beta1", "beta2", "eps", "weight_decay", "bias_correction"})
	for _, name := range recorded {
		cfg := base
		changes[name](&cfg)
		other := build(t, cfg)
		before, err := other.State()
		require.NoError(t, err)
		for _, c := range []*optim.Checkpoint{ck, consolidated} {
			err = other.Load(c)
			require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint, name)
			assert.ErrorContains(t, err, "made with "+name+" ", name)
			after, err := other.State()
			require.NoError(t, err)
			assert.Equal(t, before, after, "%s: a refused load changed the optimizer", name)
		}
		edited := *ck
		edited.Floats = maps.Clone(ck.Floats)
		delete(edited.Floats, optim.HyperPrefix+name)
		require.NoError(t, other.Load(&edited), name)
	}
	require.NoError(t, build(t, base).Load(ck))
	require.NoError(t, build(t, base).Load(consolidated))
}
