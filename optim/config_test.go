package optim

import (
	"context"
	"errors"
	"math"
	"reflect"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fieldNames returns the names of the fields of struct type t that a user
// sets, promoted fields included, embedded structs themselves excluded.
func fieldNames(t reflect.Type) []string {
	var names []string
	for _, f := range reflect.VisibleFields(t) {
		if f.Anonymous && f.Type.Kind() == reflect.Struct {
			continue
		}
		names = append(names, f.Name)
	}
	return names
}

// badCase is one invalid value of one field.
type badCase[C any] struct {
	field string
	mod   func(*C)
}

// checkConfig runs the table of a config type C: every field either has at
// least one bad case or is listed in anyValue (a field every value of
// which is valid); each bad case is refused by validate with a
// *ConfigError naming the field and by build with the very same error; the
// valid config passes both.
func checkConfig[C any](t *testing.T, name string, valid C, validate func(C) error, build func(C) error, anyValue []string, cases []badCase[C]) {
	t.Helper()
	require.NoError(t, validate(valid), "%s: the valid config", name)
	require.NoError(t, build(valid), "%s: the valid config", name)
	covered := map[string]bool{}
	for _, f := range anyValue {
		covered[f] = true
	}
	for _, c := range cases {
		covered[c.field] = true
		cfg := valid
		c.mod(&cfg)
		verr := validate(cfg)
		require.Error(t, verr, "%s.%s: Validate", name, c.field)
		var ce *ConfigError
		require.True(t, errors.As(verr, &ce), "%s.%s: %v is not a *ConfigError", name, c.field, verr)
		assert.Equal(t, name, ce.Config, "%s.%s: %v", name, c.field, verr)
		assert.Equal(t, c.field, ce.Field, "%s.%s: %v", name, c.field, verr)
		berr := build(cfg)
		require.Error(t, berr, "%s.%s: the constructor", name, c.field)
		var be *ConfigError
		require.True(t, errors.As(berr, &be), "%s.%s: the constructor's %v is not a *ConfigError", name, c.field, berr)
		assert.Equal(t, verr.Error(), berr.Error(), "%s.%s: the constructor's error is Validate's", name, c.field)
		assert.Equal(t, ce.Field, be.Field, "%s.%s", name, c.field)
	}
	for _, f := range fieldNames(reflect.TypeOf(valid)) {
		assert.True(t, covered[f], "%s.%s has no bad case and is not listed as taking any value", name, f)
	}
}

// adamCases are the bad values of the fields of AdamConfig, for any config
// C that embeds it (get returns the embedded AdamConfig).
func adamCases[C any](get func(*C) *AdamConfig) []badCase[C] {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	set := func(field string, f func(*AdamConfig)) badCase[C] {
		return badCase[C]{field, func(c *C) { f(get(c)) }}
	}
	return []badCase[C]{
		set("LR", func(a *AdamConfig) { a.LR = 0 }),
		set("LR", func(a *AdamConfig) { a.LR = -1 }),
		set("LR", func(a *AdamConfig) { a.LR = nan }),
		set("LR", func(a *AdamConfig) { a.LR = inf }),
		set("Beta1", func(a *AdamConfig) { a.Beta1 = 1 }),
		set("Beta1", func(a *AdamConfig) { a.Beta1 = -0.1 }),
		set("Beta1", func(a *AdamConfig) { a.Beta1 = nan }),
		set("Beta2", func(a *AdamConfig) { a.Beta2 = 1 }),
		set("Beta2", func(a *AdamConfig) { a.Beta2 = -0.1 }),
		set("Beta2", func(a *AdamConfig) { a.Beta2 = nan }),
		set("Eps", func(a *AdamConfig) { a.Eps = -1e-8 }),
		set("Eps", func(a *AdamConfig) { a.Eps = inf }),
		set("Eps", func(a *AdamConfig) { a.Eps = nan }),
		set("WeightDecay", func(a *AdamConfig) { a.WeightDecay = -0.1 }),
		set("WeightDecay", func(a *AdamConfig) { a.WeightDecay = inf }),
		set("WeightDecay", func(a *AdamConfig) { a.WeightDecay = nan }),
		set("Reduce", func(a *AdamConfig) { a.Reduce = numReduceModes }),
		set("Reduce", func(a *AdamConfig) { a.Reduce = -1 }),
		set("RanksPerNode", func(a *AdamConfig) { a.RanksPerNode = -1 }),
	}
}

func TestAdamConfigValidate(t *testing.T) {
	params := []*Param{NewParam("w", 3)}
	checkConfig(t, "optim.AdamConfig", DefaultAdamConfig(),
		AdamConfig.Validate,
		func(c AdamConfig) error { _, err := NewAdam(context.Background(), nil, params, c); return err },
		[]string{"BiasCorrection"},
		adamCases(func(c *AdamConfig) *AdamConfig { return c }))
}

func TestLambConfigValidate(t *testing.T) {
	params := []*Param{NewParam("w", 3)}
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	cases := adamCases(func(c *LambConfig) *AdamConfig { return &c.AdamConfig })
	cases = append(cases,
		badCase[LambConfig]{"MaxCoeff", func(c *LambConfig) { c.MaxCoeff = inf }},
		badCase[LambConfig]{"MaxCoeff", func(c *LambConfig) { c.MaxCoeff = nan }},
		badCase[LambConfig]{"MaxCoeff", func(c *LambConfig) { c.MaxCoeff, c.MinCoeff = -1, -2 }},
		badCase[LambConfig]{"MinCoeff", func(c *LambConfig) { c.MinCoeff = -0.01 }},
		badCase[LambConfig]{"MinCoeff", func(c *LambConfig) { c.MinCoeff = c.MaxCoeff * 2 }},
		badCase[LambConfig]{"MinCoeff", func(c *LambConfig) { c.MinCoeff = nan }},
	)
	checkConfig(t, "optim.LambConfig", DefaultLambConfig(),
		LambConfig.Validate,
		func(c LambConfig) error { _, err := NewLamb(context.Background(), nil, params, c); return err },
		[]string{"BiasCorrection"}, cases)
}

// TestConfigErrorMessage: the message names the config, the field, the
// value and what is wanted, with the package prefix once.
func TestConfigErrorMessage(t *testing.T) {
	cfg := DefaultLambConfig()
	cfg.Beta2 = 1
	assert.EqualError(t, cfg.Validate(), "optim: LambConfig.Beta2 = 1: want in [0, 1)")
}
