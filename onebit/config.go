package onebit

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/optim"
)

// samePackage wraps an error that this package's exported API returned
// (prefixed "onebit: ", AllReduce's say) for a caller in this package that
// wraps it under its own prefix (the optimizer's, "onebit: 1-bit LAMB
// step 3: ..."): it reads without the inner prefix, so that the package's
// prefix appears once, and unwraps to err.
type samePackage struct{ err error }

func (e samePackage) Error() string { return strings.TrimPrefix(e.err.Error(), "onebit: ") }
func (e samePackage) Unwrap() error { return e.err }

// configErrorIn returns err with the *optim.ConfigError it holds (if any)
// relabelled as an error of config, for the fields a config embeds from
// optim's; other errors are returned as they are.
func configErrorIn(err error, config string) error {
	var ce *optim.ConfigError
	if !errors.As(err, &ce) {
		return err
	}
	c := *ce
	c.Config = config
	return &c
}

// checkMasks refuses a mask with a NaN or Inf element (which parameter it
// names, and its length, are checked against the parameters by the
// constructor).
func checkMasks(config string, masks map[string][]float32) error {
	names := make([]string, 0, len(masks))
	for name := range masks {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if !optim.Finite(masks[name]) {
			return &optim.ConfigError{Config: config, Field: "ExpAvgMask",
				Value: fmt.Sprintf("[%q] with a non-finite element", name), Want: "finite masks"}
		}
	}
	return nil
}

// checkBucketBytes refuses a bucket size outside the convention of
// optim.DefaultBucketBytes.
func checkBucketBytes(config string, b int) error {
	if b != optim.PerParameter && (b < 0 || (b > 0 && b < 4)) {
		return &optim.ConfigError{Config: config, Field: "BucketBytes", Value: b,
			Want: fmt.Sprintf("0 (optim.DefaultBucketBytes, %d), optim.PerParameter (-1) or at least 4", optim.DefaultBucketBytes)}
	}
	return nil
}

// Validate reports the first invalid field as an *optim.ConfigError: those
// of optim.AdamConfig.Validate, MomentsBF16 set (see
// optim.AdamConfig.RefuseMomentsBF16), a negative FreezeStep, a mask with a
// non-finite element, or a BucketBytes outside the convention of
// optim.DefaultBucketBytes. NewAdam returns exactly this error.
func (c AdamConfig) Validate() error {
	const cfg = "onebit.AdamConfig"
	if err := c.AdamConfig.Validate(); err != nil {
		return configErrorIn(err, cfg)
	}
	if err := c.RefuseMomentsBF16(cfg); err != nil {
		return err
	}
	if c.FreezeStep < 0 {
		return &optim.ConfigError{Config: cfg, Field: "FreezeStep", Value: c.FreezeStep, Want: ">= 0"}
	}
	if err := checkMasks(cfg, c.ExpAvgMask); err != nil {
		return err
	}
	switch {
	case c.StateMode != StateFull && c.StateMode != StateSharded && c.StateMode != StateCompact:
		return &optim.ConfigError{Config: cfg, Field: "StateMode", Value: c.StateMode, Want: "StateFull, StateSharded or StateCompact"}
	case c.StateMode == StateSharded && c.Reduce != optim.ReduceFP32:
		return &optim.ConfigError{Config: cfg, Field: "Reduce", Value: c.Reduce,
			Want: "ReduceFP32 with StateSharded (its warm-up reduce-scatters float32 gradients)"}
	case c.BF16&^(BF16WorkerError|BF16Variance) != 0:
		return &optim.ConfigError{Config: cfg, Field: "BF16", Value: c.BF16, Want: "a set of BF16WorkerError and BF16Variance"}
	case c.BF16 != 0 && c.StateMode != StateSharded:
		return &optim.ConfigError{Config: cfg, Field: "BF16", Value: c.BF16, Want: "0 unless StateMode is StateSharded"}
	}
	return checkBucketBytes(cfg, c.BucketBytes)
}

// Validate reports the first invalid field as an *optim.ConfigError: those
// of optim.LambConfig.Validate, a FreezeStep below 1, a CoeffBeta or
// FactorThreshold outside [0, 1), a FactorMax that is not finite and > 0,
// a FactorMin outside (0, FactorMax], a StateMode other than StateFull and
// StateCompact, or a mask with a non-finite element. NewLamb returns
// exactly this error.
func (c LambConfig) Validate() error {
	const cfg = "onebit.LambConfig"
	if err := c.LambConfig.Validate(); err != nil {
		return configErrorIn(err, cfg)
	}
	bad := func(field string, v any, want string) error {
		return &optim.ConfigError{Config: cfg, Field: field, Value: v, Want: want}
	}
	switch {
	case c.FreezeStep < 1:
		return bad("FreezeStep", c.FreezeStep, ">= 1")
	case !(c.CoeffBeta >= 0 && c.CoeffBeta < 1):
		return bad("CoeffBeta", c.CoeffBeta, "in [0, 1)")
	case !(c.FactorMax > 0) || math.IsInf(float64(c.FactorMax), 1):
		return bad("FactorMax", c.FactorMax, "finite and > 0")
	case !(c.FactorMin > 0 && c.FactorMin <= c.FactorMax):
		return bad("FactorMin", c.FactorMin, fmt.Sprintf("in (0, FactorMax = %v]", c.FactorMax))
	case !(c.FactorThreshold >= 0 && c.FactorThreshold < 1):
		return bad("FactorThreshold", c.FactorThreshold, "in [0, 1)")
	case c.StateMode != StateFull && c.StateMode != StateCompact:
		return bad("StateMode", c.StateMode, "StateFull or StateCompact (1-bit LAMB has no StateSharded)")
	}
	return checkMasks(cfg, c.ExpAvgMask)
}

// Validate reports the first invalid field as an *optim.ConfigError: those
// of optim.AdamConfig.Validate, MomentsBF16 set, a VarFreezeStep, VarUpdateScaler,
// LocalStepScaler or LocalStepClipper below 1, a mask with a non-finite
// element, or a BucketBytes outside the convention of
// optim.DefaultBucketBytes. NewZeroOneAdam returns exactly this error.
func (c ZeroOneAdamConfig) Validate() error {
	const cfg = "onebit.ZeroOneAdamConfig"
	if err := c.AdamConfig.Validate(); err != nil {
		return configErrorIn(err, cfg)
	}
	if err := c.RefuseMomentsBF16(cfg); err != nil {
		return err
	}
	for _, f := range []struct {
		name string
		v    int
	}{
		{"VarFreezeStep", c.VarFreezeStep},
		{"VarUpdateScaler", c.VarUpdateScaler},
		{"LocalStepScaler", c.LocalStepScaler},
		{"LocalStepClipper", c.LocalStepClipper},
	} {
		if f.v < 1 {
			return &optim.ConfigError{Config: cfg, Field: f.name, Value: f.v, Want: ">= 1"}
		}
	}
	if err := checkMasks(cfg, c.ExpAvgMask); err != nil {
		return err
	}
	return checkBucketBytes(cfg, c.BucketBytes)
}
