package onebit_test

import (
	"context"
	"maps"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// hyperCase builds one optimizer with the base config, or with the change
// of the named hyperparameter applied.
type hyperCase struct {
	name    string
	changes []string
	build   func(t *testing.T, change string) optim.Optimizer
}

// Every hyperparameter that decides a step of a 1-bit optimizer is
// recorded in its checkpoint, and a resume with another value of any of
// them is refused, naming it, with the optimizer left unchanged; the same
// values load.
func TestCheckpointRefusesOtherHyperparameters(t *testing.T) {
	mask := func(v float32) map[string][]float32 { return map[string][]float32{"w0": {1, v, 1, 1}} }
	adamChange := func(c *optim.AdamConfig, change string) bool {
		switch change {
		case "beta1":
			c.Beta1 = 0.8
		case "beta2":
			c.Beta2 = 0.99
		case "eps":
			c.Eps = 1e-6
		case "weight_decay":
			c.WeightDecay = 0.5
		case "bias_correction":
			c.BiasCorrection = false
		default:
			return false
		}
		return true
	}
	adamNames := []string{"beta1", "beta2", "eps", "weight_decay", "bias_correction"}
	step := func(t *testing.T, opt optim.Optimizer, err error) optim.Optimizer {
		require.NoError(t, err)
		for s := 1; s <= 3; s++ {
			adamGrads(opt.Params(), 0, s)
			require.NoError(t, opt.Step(context.Background()))
		}
		return opt
	}
	shapes := [][]int{{4}, {2, 3}}
	cases := []hyperCase{
		{"1-bit Adam", append(adamNames, "freeze_step", "exp_avg_mask"), func(t *testing.T, change string) optim.Optimizer {
			cfg := onebit.DefaultAdamConfig()
			cfg.FreezeStep, cfg.WeightDecay, cfg.ExpAvgMask = 2, 0.01, mask(0)
			if !adamChange(&cfg.AdamConfig, change) {
				switch change {
				case "freeze_step":
					cfg.FreezeStep = 5
				case "exp_avg_mask":
					cfg.ExpAvgMask = mask(1)
				}
			}
			opt, err := onebit.NewAdam(context.Background(), nil, adamParams(t, shapes...), cfg)
			return step(t, opt, err)
		}},
		{"1-bit LAMB", append(adamNames, "max_coeff", "min_coeff", "freeze_step", "coeff_beta", "factor_max", "factor_min", "factor_threshold", "exp_avg_mask"),
			func(t *testing.T, change string) optim.Optimizer {
				cfg := onebit.DefaultLambConfig()
				cfg.FreezeStep, cfg.WeightDecay, cfg.ExpAvgMask = 2, 0.01, mask(0)
				if !adamChange(&cfg.AdamConfig, change) {
					switch change {
					case "max_coeff":
						cfg.MaxCoeff = 5
					case "min_coeff":
						cfg.MinCoeff = 0.02
					case "freeze_step":
						cfg.FreezeStep = 5
					case "coeff_beta":
						cfg.CoeffBeta = 0.8
					case "factor_max":
						cfg.FactorMax = 3
					case "factor_min":
						cfg.FactorMin = 0.25
					case "factor_threshold":
						cfg.FactorThreshold = 0.2
					case "exp_avg_mask":
						cfg.ExpAvgMask = mask(1)
					}
				}
				opt, err := onebit.NewLamb(context.Background(), nil, adamParams(t, shapes...), cfg)
				return step(t, opt, err)
			}},
		{"0/1 Adam", append(adamNames, "var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper", "exp_avg_mask"),
			func(t *testing.T, change string) optim.Optimizer {
				cfg := onebit.DefaultZeroOneAdamConfig()
				cfg.VarFreezeStep, cfg.WeightDecay, cfg.ExpAvgMask = 2, 0.01, mask(0)
				cfg.VarUpdateScaler, cfg.LocalStepScaler, cfg.LocalStepClipper = 2, 4, 4
				if !adamChange(&cfg.AdamConfig, change) {
					switch change {
					case "var_freeze_step":
						cfg.VarFreezeStep = 5
					case "var_update_scaler":
						cfg.VarUpdateScaler = 3
					case "local_step_scaler":
						cfg.LocalStepScaler = 5
					case "local_step_clipper":
						cfg.LocalStepClipper = 8
					case "exp_avg_mask":
						cfg.ExpAvgMask = mask(1)
					}
				}
				opt, err := onebit.NewZeroOneAdam(context.Background(), nil, adamParams(t, shapes...), cfg)
				return step(t, opt, err)
			}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ck, err := c.build(t, "").State()
			require.NoError(t, err)
			var recorded []string
			for k := range ck.Floats {
				if name, ok := strings.CutPrefix(k, optim.HyperPrefix); ok {
					recorded = append(recorded, name)
				}
			}
			assert.ElementsMatch(t, c.changes, recorded, "the test changes every recorded hyperparameter")
			for _, name := range c.changes {
				other := c.build(t, name)
				before, err := other.State()
				require.NoError(t, err)
				require.NotEqual(t, before.Floats[optim.HyperPrefix+name], ck.Floats[optim.HyperPrefix+name], name)
				err = other.Load(ck)
				require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint, name)
				assert.ErrorContains(t, err, "made with "+name+" ", name)
				assert.ErrorContains(t, err, "this optimizer has ", name)
				after, err := other.State()
				require.NoError(t, err)
				assert.Equal(t, before, after, "%s: a refused load changed the optimizer", name)

				// Deleting the entry is how to change it on purpose.
				edited := *ck
				edited.Floats = maps.Clone(ck.Floats)
				delete(edited.Floats, optim.HyperPrefix+name)
				require.NoError(t, other.Load(&edited), name)
			}
			require.NoError(t, c.build(t, "").Load(ck))
		})
	}
}
