package optim

import (
	"errors"
	"fmt"
	"math"
	"strings"
)

// ConfigError is the error of every config's Validate in lowbit (optim,
// onebit, optim/zero), and every optimizer constructor returns its
// config's Validate error unchanged: one source of truth for what is
// valid. Its message carries the config's package prefix once, e.g.
// "onebit: AdamConfig.FreezeStep = -1: want >= 0".
type ConfigError struct {
	// Config is the config type with its package, e.g. "onebit.AdamConfig".
	Config string
	// Field is the invalid field as a user writes it on that type
	// (promoted fields by their own name: "Beta1", not
	// "AdamConfig.Beta1").
	Field string
	// Value is the field's value.
	Value any
	// Want says what a valid value is.
	Want string
}

func (e *ConfigError) Error() string {
	pkg, typ, ok := strings.Cut(e.Config, ".")
	if !ok {
		pkg, typ = "optim", e.Config
	}
	return fmt.Sprintf("%s: %s.%s = %v: want %s", pkg, typ, e.Field, e.Value, e.Want)
}

// samePackage wraps an error that this package's exported API returned
// (prefixed "optim: ") for a caller in this package that wraps it under its
// own prefix (a Frame's name, "optim: Adam"): it reads without the inner
// prefix, so that the package's prefix appears once, and unwraps to err.
type samePackage struct{ err error }

func (e samePackage) Error() string { return strings.TrimPrefix(e.err.Error(), "optim: ") }
func (e samePackage) Unwrap() error { return e.err }

// configErrorIn returns err with the *ConfigError it holds (if any)
// relabelled as an error of config: what a config that embeds another
// returns for the embedded one's fields. Other errors are returned as
// they are. (onebit and optim/zero have their own copy.)
func configErrorIn(err error, config string) error {
	var ce *ConfigError
	if !errors.As(err, &ce) {
		return err
	}
	c := *ce
	c.Config = config
	return &c
}

// Buckets. Every optimizer that fuses what it communicates (onebit.Adam,
// onebit.ZeroOneAdam, zero.Adam) has a config field BucketBytes with one
// meaning: what a rank communicates (the float32 elements of all
// parameters, or of what stands for them: gradients, momenta,
// accumulators) is laid end to end in construction order as one flat
// buffer, and that buffer is cut into consecutive buckets of BucketBytes
// bytes (BucketBytes/4 elements; the last bucket may be shorter). Each
// bucket is one call of the optimizer's collective (with its own error
// feedback in the 1-bit optimizers; zero.Adam reduce-scatters a bucket in
// one call, each rank receiving the mean of its 1/W of it). The unit is
// bytes, as in PyTorch DDP's bucket_cap_mb and lowbit plan's --bucket; the
// zero value means DefaultBucketBytes; PerParameter makes one bucket of
// each parameter where an optimizer supports it (the 1-bit ones); any
// other value must be at least 4. Every rank must use the same value.
// 1-bit LAMB has no BucketBytes: its compression stage scales each
// parameter's momentum so that the momenta of the whole model share the
// one scale of a single compressed allreduce of the fused buffer (the
// spec's design, which a cut into buckets would change); that allreduce
// pipelines large buffers by itself.
const (
	// DefaultBucketBytes is the bucket size that BucketBytes 0 selects:
	// 25 MiB, like PyTorch DDP.
	DefaultBucketBytes = 25 << 20
	// PerParameter, as BucketBytes, makes every parameter a bucket of its
	// own (one collective, one scale and one error feedback per
	// parameter); the 1-bit optimizers accept it, zero.Adam does not.
	PerParameter = -1
)

// AdamConfig holds the hyper-parameters of Adam/AdamW. Start from
// DefaultAdamConfig and change what you need: the zero value is not the
// defaults (it turns bias correction off and sets the learning rate to 0).
type AdamConfig struct {
	// LR is the learning rate, finite and >= 0. Default 1e-3. At 0 (as
	// PyTorch allows: a warm-up that starts at 0) every step updates the
	// moments and counters as at any other learning rate and leaves the
	// parameters bit for bit where they are.
	LR float32
	// Beta1 and Beta2 are the decay rates of the first and second moments,
	// each in [0, 1). Defaults 0.9 and 0.999.
	Beta1, Beta2 float32
	// Eps is added to sqrt(v_hat) in the denominator; finite and >= 0.
	// Default 1e-8.
	Eps float32
	// WeightDecay is decoupled weight decay (AdamW style): wd*p is added
	// to the update, not to the gradient; finite and >= 0. Default 0.
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
	// communicator (see comm.NewLayout); >= 0. Default 0. Other modes
	// ignore it.
	RanksPerNode int
	// MomentsBF16 keeps both moments, m and v, in bfloat16: 4 bytes per
	// parameter instead of 8. Each step widens them to float32, updates
	// them there as the float32 mode does, and rounds them back to
	// bfloat16 stochastically (unbiased: v's steady increments, 0.1% of v
	// per step at beta2 0.999, lie below bfloat16's resolution and would
	// be lost to rounding to nearest), with random bits drawn from the
	// step counter, the parameter's index and the element's index: every
	// rank rounds alike, and a resumed run continues bit for bit. The
	// update then uses the rounded moments. Checkpoints hold the moments
	// as float32 (their bfloat16 values) and record the mode (see
	// IntMomentsBF16); a checkpoint of the other mode is refused. Adam
	// only: LAMB and the optimizers of onebit and optim/zero refuse it.
	// Default false (outer.DefaultAdamConfigFor sets it for the outer
	// optimizer's sparse codec). See the package doc, "Compact moments".
	MomentsBF16 bool
}

// DefaultAdamConfig returns lr 1e-3, betas (0.9, 0.999), eps 1e-8, no
// weight decay, bias correction on.
func DefaultAdamConfig() AdamConfig {
	return AdamConfig{LR: 1e-3, Beta1: 0.9, Beta2: 0.999, Eps: 1e-8, BiasCorrection: true}
}

// Validate reports the first invalid field as a *ConfigError: a learning
// rate that is negative or not finite, a beta outside [0, 1), an eps or
// weight decay that is negative or not finite, an unknown reduction mode
// or a negative RanksPerNode. NewAdam returns exactly this error.
// MomentsBF16 is valid here; the configs that embed AdamConfig for other
// optimizers refuse it in their own Validate.
func (c AdamConfig) Validate() error {
	const cfg = "optim.AdamConfig"
	switch {
	case checkLR(c.LR) != nil:
		return &ConfigError{cfg, "LR", c.LR, "finite and >= 0"}
	case !(c.Beta1 >= 0 && c.Beta1 < 1):
		return &ConfigError{cfg, "Beta1", c.Beta1, "in [0, 1)"}
	case !(c.Beta2 >= 0 && c.Beta2 < 1):
		return &ConfigError{cfg, "Beta2", c.Beta2, "in [0, 1)"}
	case !nonNegFinite(c.Eps):
		return &ConfigError{cfg, "Eps", c.Eps, "finite and >= 0"}
	case !nonNegFinite(c.WeightDecay):
		return &ConfigError{cfg, "WeightDecay", c.WeightDecay, "finite and >= 0"}
	case !c.Reduce.Valid():
		return &ConfigError{cfg, "Reduce", c.Reduce, "one of " + strings.Join(reduceNames[:], ", ")}
	case c.RanksPerNode < 0:
		return &ConfigError{cfg, "RanksPerNode", c.RanksPerNode, ">= 0"}
	}
	return nil
}

// RefuseMomentsBF16 is the Validate error of a config that embeds
// AdamConfig for an optimizer that keeps float32 moments (LambConfig,
// onebit's and optim/zero's configs; config names the type, e.g.
// "optim.LambConfig"): a *ConfigError when c.MomentsBF16 is set, nil
// otherwise.
func (c AdamConfig) RefuseMomentsBF16(config string) error {
	if !c.MomentsBF16 {
		return nil
	}
	return &ConfigError{config, "MomentsBF16", true, "false (only optim.Adam keeps its moments in bfloat16)"}
}

func nonNegFinite(x float32) bool {
	return x >= 0 && !math.IsInf(float64(x), 1)
}

// LambConfig holds the hyper-parameters of LAMB: Adam's, plus the bounds of
// the trust ratio coeff = ||p|| / ||update||.
type LambConfig struct {
	AdamConfig
	// MaxCoeff and MinCoeff clip the trust ratio, 0 <= MinCoeff <=
	// MaxCoeff < +Inf. Defaults 10 and 0.01.
	MaxCoeff, MinCoeff float32
}

// DefaultLambConfig returns DefaultAdamConfig with MaxCoeff 10 and MinCoeff
// 0.01.
func DefaultLambConfig() LambConfig {
	return LambConfig{AdamConfig: DefaultAdamConfig(), MaxCoeff: 10, MinCoeff: 0.01}
}

// Validate reports the first invalid field as a *ConfigError: those of
// AdamConfig.Validate, a MaxCoeff that is not finite and >= 0, or a
// MinCoeff outside [0, MaxCoeff], or MomentsBF16 set (LAMB keeps float32
// moments). NewLamb returns exactly this error.
func (c LambConfig) Validate() error {
	const cfg = "optim.LambConfig"
	if err := c.AdamConfig.Validate(); err != nil {
		return configErrorIn(err, cfg)
	}
	switch {
	case !nonNegFinite(c.MaxCoeff):
		return &ConfigError{cfg, "MaxCoeff", c.MaxCoeff, "finite and >= 0"}
	case !(c.MinCoeff >= 0 && c.MinCoeff <= c.MaxCoeff):
		return &ConfigError{cfg, "MinCoeff", c.MinCoeff, fmt.Sprintf("in [0, MaxCoeff = %v]", c.MaxCoeff)}
	}
	return c.RefuseMomentsBF16(cfg)
}
