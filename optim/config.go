package optim

import (
	"fmt"
	"math"
)

// AdamConfig holds the hyper-parameters of Adam/AdamW. Start from
// DefaultAdamConfig and change what you need: the zero value is not the
// defaults (it turns bias correction off and sets the learning rate to 0).
type AdamConfig struct {
	// LR is the learning rate. Default 1e-3.
	LR float32
	// Beta1 and Beta2 are the decay rates of the first and second moments,
	// each in [0, 1). Defaults 0.9 and 0.999.
	Beta1, Beta2 float32
	// Eps is added to sqrt(v_hat) in the denominator. Default 1e-8.
	Eps float32
	// WeightDecay is decoupled weight decay (AdamW style): wd*p is added
	// to the update, not to the gradient. Default 0.
	WeightDecay float32
	// BiasCorrection divides m by 1-beta1^t and v by 1-beta2^t. Default
	// true.
	BiasCorrection bool
	// Reduce is how gradients are averaged over the ranks in the exact
	// stages (every step of Adam and LAMB, the warm-up of the 1-bit
	// optimizers, the variance steps of 0/1 Adam); see ReduceMode.
	// Default ReduceFP32, the zero value.
	Reduce ReduceMode
	// RanksPerNode is the node size of ReduceTwoLevel; 0 asks the
	// communicator (see comm.NewLayout). Default 0. Other modes ignore
	// it.
	RanksPerNode int
}

// DefaultAdamConfig returns lr 1e-3, betas (0.9, 0.999), eps 1e-8, no
// weight decay, bias correction on.
func DefaultAdamConfig() AdamConfig {
	return AdamConfig{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, BiasCorrection: true}
}

// Validate reports the first invalid field: a learning rate that is not
// finite and > 0, an eps or weight decay that is negative or not finite, a
// beta outside [0, 1), an unknown reduction mode or a negative
// RanksPerNode.
func (c AdamConfig) Validate() error {
	if err := CheckLR(c.LR); err != nil {
		return err
	}
	if !(c.Beta1 >= 0 && c.Beta1 < 1) || !(c.Beta2 >= 0 && c.Beta2 < 1) {
		return fmt.Errorf("optim: betas (%v, %v) must be in [0, 1)", c.Beta1, c.Beta2)
	}
	if !nonNegFinite(c.Eps) {
		return fmt.Errorf("optim: eps %v must be finite and >= 0", c.Eps)
	}
	if !nonNegFinite(c.WeightDecay) {
		return fmt.Errorf("optim: weight decay %v must be finite and >= 0", c.WeightDecay)
	}
	if !c.Reduce.Valid() {
		return fmt.Errorf("optim: unknown gradient reduction mode %v", c.Reduce)
	}
	if c.RanksPerNode < 0 {
		return fmt.Errorf("optim: ranks per node %d must be >= 0", c.RanksPerNode)
	}
	return nil
}

func nonNegFinite(x float32) bool {
	return x >= 0 && !math.IsInf(float64(x), 1)
}

// LambConfig holds the hyper-parameters of LAMB: Adam's, plus the bounds of
// the trust ratio coeff = ||p|| / ||update||.
type LambConfig struct {
	AdamConfig
	// MaxCoeff and MinCoeff clip the trust ratio, 0 <= MinCoeff <= MaxCoeff.
	// Defaults 10 and 0.01.
	MaxCoeff, MinCoeff float32
}

// DefaultLambConfig returns DefaultAdamConfig with MaxCoeff 10 and MinCoeff
// 0.01.
func DefaultLambConfig() LambConfig {
	return LambConfig{AdamConfig: DefaultAdamConfig(), MaxCoeff: 10, MinCoeff: 0.01}
}

// Validate reports the first invalid field.
func (c LambConfig) Validate() error {
	if err := c.AdamConfig.Validate(); err != nil {
		return err
	}
	if !(c.MinCoeff >= 0 && c.MinCoeff <= c.MaxCoeff) || math.IsInf(float64(c.MaxCoeff), 1) {
		return fmt.Errorf("optim: trust ratio bounds [%v, %v] must satisfy 0 <= min <= max < +Inf", c.MinCoeff, c.MaxCoeff)
	}
	return nil
}
