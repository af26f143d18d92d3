package zero_test

import (
	"context"
	"errors"
	"math"
	"reflect"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

// TestConfigValidate: every field of zero.Config has a bad value that
// Validate refuses with an *optim.ConfigError naming it, and NewAdam with
// the same error; the default config passes both.
func TestConfigValidate(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	cases := []struct {
		field string
		mod   func(*zero.Config)
	}{
		{"LR", func(c *zero.Config) { c.LR = -1 }},
		{"Beta1", func(c *zero.Config) { c.Beta1 = 1 }},
		{"Beta2", func(c *zero.Config) { c.Beta2 = nan }},
		{"Eps", func(c *zero.Config) { c.Eps = inf }},
		{"WeightDecay", func(c *zero.Config) { c.WeightDecay = -1 }},
		{"Reduce", func(c *zero.Config) { c.AdamConfig.Reduce = optim.ReduceFP16 }},
		{"Reduce", func(c *zero.Config) { c.AdamConfig.Reduce = 99 }},
		{"RanksPerNode", func(c *zero.Config) { c.RanksPerNode = -2 }},
		{"MomentsBF16", func(c *zero.Config) { c.MomentsBF16 = true }},
		{"ReduceScatter", func(c *zero.Config) { c.ReduceScatter = 9 }},
		{"BucketBytes", func(c *zero.Config) { c.BucketBytes = optim.PerParameter }},
		{"BucketBytes", func(c *zero.Config) { c.BucketBytes = 3 }},
		{"GroupSize", func(c *zero.Config) { c.GroupSize = -1 }},
	}
	build := func(c zero.Config) error {
		_, err := zero.NewAdam(context.Background(), nil, newParams(t, []int{3}), c)
		return err
	}
	valid := zero.DefaultConfig()
	require.NoError(t, valid.Validate())
	require.NoError(t, build(valid))
	covered := map[string]bool{"BiasCorrection": true}
	for _, c := range cases {
		covered[c.field] = true
		cfg := valid
		c.mod(&cfg)
		verr := cfg.Validate()
		var ce *optim.ConfigError
		require.True(t, errors.As(verr, &ce), "%s: Validate gave %v", c.field, verr)
		assert.Equal(t, "zero.Config", ce.Config, c.field)
		assert.Equal(t, c.field, ce.Field, "%v", verr)
		berr := build(cfg)
		require.Error(t, berr, c.field)
		assert.Equal(t, verr.Error(), berr.Error(), "%s: NewAdam's error is Validate's", c.field)
	}
	for _, f := range reflect.VisibleFields(reflect.TypeOf(valid)) {
		if !(f.Anonymous && f.Type.Kind() == reflect.Struct) {
			assert.True(t, covered[f.Name], "zero.Config.%s has no bad case", f.Name)
		}
	}
}
