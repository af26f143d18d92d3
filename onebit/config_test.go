package onebit_test

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/lowbit-ml/lowbit/internal/configtest"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// badCase is one invalid value of one field of a config C.
type badCase[C any] = configtest.Bad[C]

// checkConfig runs configtest.Check with the fields of optim.ConfigError.
func checkConfig[C any](t *testing.T, name string, valid C, validate func(C) error, build func(C) error, anyValue []string, cases []badCase[C]) {
	t.Helper()
	configtest.Check(t, name, valid, validate, build, func(err error) (string, string, bool) {
		var ce *optim.ConfigError
		if !errors.As(err, &ce) {
			return "", "", false
		}
		return ce.Config, ce.Field, true
	}, anyValue, cases)
}

// adamCases are bad values of the fields of optim.AdamConfig, embedded in
// C (get returns it).
func adamCases[C any](get func(*C) *optim.AdamConfig) []badCase[C] {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	set := func(field string, f func(*optim.AdamConfig)) badCase[C] {
		return badCase[C]{Field: field, Mod: func(c *C) { f(get(c)) }}
	}
	return []badCase[C]{
		set("LR", func(a *optim.AdamConfig) { a.LR = -1 }),
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
		badCase[onebit.AdamConfig]{Field: "MomentsBF16", Mod: func(c *onebit.AdamConfig) { c.MomentsBF16 = true }},
		badCase[onebit.AdamConfig]{Field: "FreezeStep", Mod: func(c *onebit.AdamConfig) { c.FreezeStep = -1 }},
		badCase[onebit.AdamConfig]{Field: "ExpAvgMask", Mod: func(c *onebit.AdamConfig) { c.ExpAvgMask = nanMask }},
		badCase[onebit.AdamConfig]{Field: "BucketBytes", Mod: func(c *onebit.AdamConfig) { c.BucketBytes = 3 }},
		badCase[onebit.AdamConfig]{Field: "BucketBytes", Mod: func(c *onebit.AdamConfig) { c.BucketBytes = -2 }},
		badCase[onebit.AdamConfig]{Field: "StateMode", Mod: func(c *onebit.AdamConfig) { c.StateMode = 3 }},
		badCase[onebit.AdamConfig]{Field: "StateMode", Mod: func(c *onebit.AdamConfig) { c.StateMode = -1 }},
		badCase[onebit.AdamConfig]{Field: "Reduce", Mod: func(c *onebit.AdamConfig) {
			c.StateMode, c.Reduce = onebit.StateSharded, optim.ReduceFP16
		}},
		badCase[onebit.AdamConfig]{Field: "BF16", Mod: func(c *onebit.AdamConfig) { c.BF16 = onebit.BF16Variance }},
		badCase[onebit.AdamConfig]{Field: "BF16", Mod: func(c *onebit.AdamConfig) {
			c.StateMode, c.BF16 = onebit.StateSharded, 4
		}},
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
		badCase[L]{Field: "MomentsBF16", Mod: func(c *L) { c.MomentsBF16 = true }},
		badCase[L]{Field: "MaxCoeff", Mod: func(c *L) { c.MaxCoeff = inf }},
		badCase[L]{Field: "MinCoeff", Mod: func(c *L) { c.MinCoeff = c.MaxCoeff + 1 }},
		badCase[L]{Field: "FreezeStep", Mod: func(c *L) { c.FreezeStep = 0 }},
		badCase[L]{Field: "CoeffBeta", Mod: func(c *L) { c.CoeffBeta = 1 }},
		badCase[L]{Field: "CoeffBeta", Mod: func(c *L) { c.CoeffBeta = nan }},
		badCase[L]{Field: "FactorMax", Mod: func(c *L) { c.FactorMax = inf }},
		badCase[L]{Field: "FactorMax", Mod: func(c *L) { c.FactorMax, c.FactorMin = 0, 0 }},
		badCase[L]{Field: "FactorMin", Mod: func(c *L) { c.FactorMin = 0 }},
		badCase[L]{Field: "FactorMin", Mod: func(c *L) { c.FactorMin = c.FactorMax * 2 }},
		badCase[L]{Field: "FactorThreshold", Mod: func(c *L) { c.FactorThreshold = 1 }},
		badCase[L]{Field: "FactorThreshold", Mod: func(c *L) { c.FactorThreshold = -0.1 }},
		badCase[L]{Field: "ExpAvgMask", Mod: func(c *L) { c.ExpAvgMask = nanMask }},
		// 1-bit LAMB has StateFull and StateCompact only.
		badCase[L]{Field: "StateMode", Mod: func(c *L) { c.StateMode = onebit.StateSharded }},
		badCase[L]{Field: "StateMode", Mod: func(c *L) { c.StateMode = 3 }},
		badCase[L]{Field: "StateMode", Mod: func(c *L) { c.StateMode = -1 }},
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
		badCase[Z]{Field: "MomentsBF16", Mod: func(c *Z) { c.MomentsBF16 = true }},
		badCase[Z]{Field: "VarFreezeStep", Mod: func(c *Z) { c.VarFreezeStep = 0 }},
		badCase[Z]{Field: "VarUpdateScaler", Mod: func(c *Z) { c.VarUpdateScaler = 0 }},
		badCase[Z]{Field: "LocalStepScaler", Mod: func(c *Z) { c.LocalStepScaler = -1 }},
		badCase[Z]{Field: "LocalStepClipper", Mod: func(c *Z) { c.LocalStepClipper = 0 }},
		badCase[Z]{Field: "ExpAvgMask", Mod: func(c *Z) { c.ExpAvgMask = nanMask }},
		badCase[Z]{Field: "BucketBytes", Mod: func(c *Z) { c.BucketBytes = 1 }},
	)
	checkConfig(t, "onebit.ZeroOneAdamConfig", onebit.DefaultZeroOneAdamConfig(), onebit.ZeroOneAdamConfig.Validate,
		func(c onebit.ZeroOneAdamConfig) error {
			_, err := onebit.NewZeroOneAdam(context.Background(), nil, configParams(), c)
			return err
		}, []string{"BiasCorrection"}, cases)
}
