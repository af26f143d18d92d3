package optim

import (
	"context"
	"errors"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/lowbit-ml/lowbit/internal/configtest"
)

// badCase is one invalid value of one field of a config C.
type badCase[C any] = configtest.Bad[C]

// checkConfig runs configtest.Check with the fields of ConfigError.
func checkConfig[C any](t *testing.T, name string, valid C, validate func(C) error, build func(C) error, anyValue []string, cases []badCase[C]) {
	t.Helper()
	configtest.Check(t, name, valid, validate, build, func(err error) (string, string, bool) {
		var ce *ConfigError
		if !errors.As(err, &ce) {
			return "", "", false
		}
		return ce.Config, ce.Field, true
	}, anyValue, cases)
}

// adamCases are the bad values of the fields of AdamConfig, for any config
// C that embeds it (get returns the embedded AdamConfig).
func adamCases[C any](get func(*C) *AdamConfig) []badCase[C] {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	set := func(field string, f func(*AdamConfig)) badCase[C] {
		return badCase[C]{Field: field, Mod: func(c *C) { f(get(c)) }}
	}
	return []badCase[C]{
		set("LR", func(a *AdamConfig) { a.LR = -0.001 }),
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
		[]string{"BiasCorrection", "MomentsBF16"},
		adamCases(func(c *AdamConfig) *AdamConfig { return c }))
}

func TestLambConfigValidate(t *testing.T) {
	params := []*Param{NewParam("w", 3)}
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	cases := adamCases(func(c *LambConfig) *AdamConfig { return &c.AdamConfig })
	cases = append(cases,
		badCase[LambConfig]{Field: "MaxCoeff", Mod: func(c *LambConfig) { c.MaxCoeff = inf }},
		badCase[LambConfig]{Field: "MaxCoeff", Mod: func(c *LambConfig) { c.MaxCoeff = nan }},
		badCase[LambConfig]{Field: "MaxCoeff", Mod: func(c *LambConfig) { c.MaxCoeff, c.MinCoeff = -1, -2 }},
		badCase[LambConfig]{Field: "MinCoeff", Mod: func(c *LambConfig) { c.MinCoeff = -0.01 }},
		badCase[LambConfig]{Field: "MinCoeff", Mod: func(c *LambConfig) { c.MinCoeff = c.MaxCoeff * 2 }},
		badCase[LambConfig]{Field: "MinCoeff", Mod: func(c *LambConfig) { c.MinCoeff = nan }},
		badCase[LambConfig]{Field: "MomentsBF16", Mod: func(c *LambConfig) { c.MomentsBF16 = true }},
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
