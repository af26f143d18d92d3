package onebit_test

import (
	"context"
	"errors"
	"math"
	"reflect"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// badCase is one invalid value of one field of a config C.
type badCase[C any] struct {
	field string
	mod   func(*C)
}

// checkConfig: every field of C (promoted ones included) has a bad case
// or is listed in anyValue; every bad case is refused by validate with an
// *optim.ConfigError of config name naming the field, and by build with
// the same error; the valid config passes both.
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
		var ce, be *optim.ConfigError
		require.True(t, errors.As(verr, &ce), "%s.%s: Validate gave %v, want a *optim.ConfigError", name, c.field, verr)
		assert.Equal(t, name, ce.Config, "%s.%s: %v", name, c.field, verr)
		assert.Equal(t, c.field, ce.Field, "%s.%s: %v", name, c.field, verr)
		berr := build(cfg)
		require.True(t, errors.As(berr, &be), "%s.%s: the constructor gave %v, want a *optim.ConfigError", name, c.field, berr)
		assert.Equal(t, verr.Error(), berr.Error(), "%s.%s: the constructor's error is Validate's", name, c.field)
	}
	for _, f := range reflect.VisibleFields(reflect.TypeOf(valid)) {
		if f.Anonymous && f.Type.Kind() == reflect.Struct {
			continue
		}
		assert.True(t, covered[f.Name], "%s.%s has no bad case and is not listed as taking any value", name, f.Name)
	}
}

// adamCases are bad values of the fields of optim.AdamConfig, embedded in
// C (get returns it).
func adamCases[C any](get func(*C) *optim.AdamConfig) []badCase[C] {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	set := func(field string, f func(*optim.AdamConfig)) badCase[C] {
		return badCase[C]{field, func(c *C) { f(get(c)) }}
	}
	return []badCase[C]{
		set("LR", func(a *optim.AdamConfig) { a.LR = 0 }),
		set("LR", func(a *optim.AdamConfig) { a.LR = inf }),
		set("Beta1", func(a *optim.AdamConfig) { a.Beta1 = 1 }),
		set("Beta2", func(a *optim.AdamConfig) { a.Beta2 = nan }),
		set("Eps", func(a *optim.AdamConfig) { a.Eps = -1 }),
		set("WeightDecay", func(a *optim.AdamConfig) { a.WeightDecay = inf }),
		set("Reduce", func(a *optim.AdamConfig) { a.Reduce = 99 }),
		set("RanksPerNode", func(a *optim.AdamConfig) { a.RanksPerNode = -1 }),
	}
}

// configParams is a valid parameter list for the config tests, with a
// parameter "w" of 3 elements (the masks' target).
func configParams() []*optim.Param { return []*optim.Param{optim.NewParam("w", 3)} }

var nanMask = map[string][]float32{"w": {1, float32(math.NaN()), 1}}

func TestAdamConfigValidate(t *testing.T) {
	valid := onebit.DefaultAdamConfig()
	valid.ExpAvgMask = map[string][]float32{"w": {1, 0, 1}}
	cases := adamCases(func(c *onebit.AdamConfig) *optim.AdamConfig { return &c.AdamConfig })
	cases = append(cases,
		badCase[onebit.AdamConfig]{"FreezeStep", func(c *onebit.AdamConfig) { c.FreezeStep = -1 }},
		badCase[onebit.AdamConfig]{"ExpAvgMask", func(c *onebit.AdamConfig) { c.ExpAvgMask = nanMask }},
		badCase[onebit.AdamConfig]{"BucketBytes", func(c *onebit.AdamConfig) { c.BucketBytes = 3 }},
		badCase[onebit.AdamConfig]{"BucketBytes", func(c *onebit.AdamConfig) { c.BucketBytes = -2 }},
	)
	checkConfig(t, "onebit.AdamConfig", valid, onebit.AdamConfig.Validate,
		func(c onebit.AdamConfig) error {
			_, err := onebit.NewAdam(context.Background(), nil, configParams(), c)
			return err
		}, []string{"BiasCorrection"}, cases)
	// The conventions' special values are valid.
	for _, b := range []int{0, optim.PerParameter, 4} {
		valid.BucketBytes = b
		assert.NoError(t, valid.Validate(), "BucketBytes %d", b)
	}
}

func TestLambConfigValidate(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	cases := adamCases(func(c *onebit.LambConfig) *optim.AdamConfig { return &c.AdamConfig })
	type L = onebit.LambConfig
	cases = append(cases,
		badCase[L]{"MaxCoeff", func(c *L) { c.MaxCoeff = inf }},
		badCase[L]{"MinCoeff", func(c *L) { c.MinCoeff = c.MaxCoeff + 1 }},
		badCase[L]{"FreezeStep", func(c *L) { c.FreezeStep = 0 }},
		badCase[L]{"CoeffBeta", func(c *L) { c.CoeffBeta = 1 }},
		badCase[L]{"CoeffBeta", func(c *L) { c.CoeffBeta = nan }},
		badCase[L]{"FactorMax", func(c *L) { c.FactorMax = inf }},
		badCase[L]{"FactorMax", func(c *L) { c.FactorMax, c.FactorMin = 0, 0 }},
		badCase[L]{"FactorMin", func(c *L) { c.FactorMin = 0 }},
		badCase[L]{"FactorMin", func(c *L) { c.FactorMin = c.FactorMax * 2 }},
		badCase[L]{"FactorThreshold", func(c *L) { c.FactorThreshold = 1 }},
		badCase[L]{"FactorThreshold", func(c *L) { c.FactorThreshold = -0.1 }},
		badCase[L]{"ExpAvgMask", func(c *L) { c.ExpAvgMask = nanMask }},
	)
	checkConfig(t, "onebit.LambConfig", onebit.DefaultLambConfig(), onebit.LambConfig.Validate,
		func(c onebit.LambConfig) error {
			_, err := onebit.NewLamb(context.Background(), nil, configParams(), c)
			return err
		}, []string{"BiasCorrection"}, cases)
}

func TestZeroOneAdamConfigValidate(t *testing.T) {
	cases := adamCases(func(c *onebit.ZeroOneAdamConfig) *optim.AdamConfig { return &c.AdamConfig })
	type Z = onebit.ZeroOneAdamConfig
	cases = append(cases,
		badCase[Z]{"VarFreezeStep", func(c *Z) { c.VarFreezeStep = 0 }},
		badCase[Z]{"VarUpdateScaler", func(c *Z) { c.VarUpdateScaler = 0 }},
		badCase[Z]{"LocalStepScaler", func(c *Z) { c.LocalStepScaler = -1 }},
		badCase[Z]{"LocalStepClipper", func(c *Z) { c.LocalStepClipper = 0 }},
		badCase[Z]{"ExpAvgMask", func(c *Z) { c.ExpAvgMask = nanMask }},
		badCase[Z]{"BucketBytes", func(c *Z) { c.BucketBytes = 1 }},
	)
	checkConfig(t, "onebit.ZeroOneAdamConfig", onebit.DefaultZeroOneAdamConfig(), onebit.ZeroOneAdamConfig.Validate,
		func(c onebit.ZeroOneAdamConfig) error {
			_, err := onebit.NewZeroOneAdam(context.Background(), nil, configParams(), c)
			return err
		}, []string{"BiasCorrection"}, cases)
}
