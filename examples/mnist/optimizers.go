package main

import (
	"fmt"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// optimizerNames are the values of -optimizer, in the order -help lists
// them.
var optimizerNames = []string{"adam", "lamb", "onebit-adam", "onebit-lamb", "zeroone-adam"}

// baseline is the exact optimizer a compressed one is compared with.
var baseline = map[string]string{
	"onebit-adam":  "adam",
	"onebit-lamb":  "lamb",
	"zeroone-adam": "adam",
}

// compressedOf is the compressed optimizer an exact one is compared with.
var compressedOf = map[string]string{
	"adam": "onebit-adam",
	"lamb": "onebit-lamb",
}

// runOrder returns the optimizers one invocation trains: name alone, or
// with -compare the exact one and then the compressed one.
func runOrder(name string, compare bool) ([]string, error) {
	if !slices.Contains(optimizerNames, name) {
		return nil, fmt.Errorf("unknown -optimizer %q (want one of %v)", name, optimizerNames)
	}
	if !compare {
		return []string{name}, nil
	}
	if b, ok := baseline[name]; ok {
		return []string{b, name}, nil
	}
	return []string{name, compressedOf[name]}, nil
}

// hyper are the optimizer settings the flags choose.
type hyper struct {
	lr float32
	// freezeStep is the warm-up of the 1-bit optimizers: FreezeStep of
	// onebit-adam and onebit-lamb, VarFreezeStep of zeroone-adam.
	freezeStep int
}

// newOptimizer builds the named optimizer over params, communicating on c.
func newOptimizer(name string, c comm.Comm, params []*optim.Param, h hyper) (optim.Optimizer, error) {
	adam := optim.DefaultAdamConfig()
	adam.LR = h.lr
	lamb := optim.DefaultLambConfig()
	lamb.LR = h.lr
	switch name {
	case "adam":
		return optim.NewAdam(c, params, adam)
	case "lamb":
		return optim.NewLamb(c, params, lamb)
	case "onebit-adam":
		cfg := onebit.DefaultAdamConfig()
		cfg.AdamConfig = adam
		cfg.FreezeStep = h.freezeStep
		return onebit.NewAdam(c, params, cfg)
	case "onebit-lamb":
		cfg := onebit.DefaultLambConfig()
		cfg.LambConfig = lamb
		cfg.FreezeStep = h.freezeStep
		return onebit.NewLamb(c, params, cfg)
	case "zeroone-adam":
		cfg := onebit.DefaultZeroOneAdamConfig()
		cfg.AdamConfig = adam
		cfg.VarFreezeStep = max(1, h.freezeStep)
		return onebit.NewZeroOneAdam(c, params, cfg)
	}
	return nil, fmt.Errorf("unknown optimizer %q", name)
}
