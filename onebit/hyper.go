package onebit

import "github.com/lowbit-ml/lowbit/optim"

// The hyperparameters each optimizer records in its checkpoints (see
// optim.Hyper): optim's Adam or LAMB ones, the stage schedule and the
// factor bounds, and exp_avg_mask, a fingerprint of the masks
// (optim.HyperFingerprint, 0 without any). BucketBytes is not among them:
// the error buffers' bucket layout is checked on its own.

func (c AdamConfig) hypers(masks [][]float32) []optim.Hyper {
	return append(optim.AdamHypers(c.AdamConfig),
		optim.Hyper{Name: "freeze_step", Value: float64(c.FreezeStep)},
		optim.Hyper{Name: "exp_avg_mask", Value: optim.HyperFingerprint(masks)},
	)
}

func (c LambConfig) hypers(masks [][]float32) []optim.Hyper {
	return append(optim.LambHypers(c.LambConfig),
		optim.Hyper{Name: "freeze_step", Value: float64(c.FreezeStep)},
		optim.Hyper{Name: "coeff_beta", Value: float64(c.CoeffBeta)},
		optim.Hyper{Name: "factor_max", Value: float64(c.FactorMax)},
		optim.Hyper{Name: "factor_min", Value: float64(c.FactorMin)},
		optim.Hyper{Name: "factor_threshold", Value: float64(c.FactorThreshold)},
		optim.Hyper{Name: "exp_avg_mask", Value: optim.HyperFingerprint(masks)},
	)
}

func (c ZeroOneAdamConfig) hypers(masks [][]float32) []optim.Hyper {
	return append(optim.AdamHypers(c.AdamConfig),
		optim.Hyper{Name: "var_freeze_step", Value: float64(c.VarFreezeStep)},
		optim.Hyper{Name: "var_update_scaler", Value: float64(c.VarUpdateScaler)},
		optim.Hyper{Name: "local_step_scaler", Value: float64(c.LocalStepScaler)},
		optim.Hyper{Name: "local_step_clipper", Value: float64(c.LocalStepClipper)},
		optim.Hyper{Name: "exp_avg_mask", Value: optim.HyperFingerprint(masks)},
	)
}
