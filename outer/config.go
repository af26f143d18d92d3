package outer

import (
	"fmt"
	"math"
	"strings"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// Codec is how the pseudo-gradients (or, for CodecOneBit, the outer
// momenta) travel in an exchange.
type Codec int

// The codecs. The zero value is CodecFP32.
const (
	// CodecFP32 averages the pseudo-gradients with an exact float32
	// allreduce: 2(W-1)/W * 4 bytes per element.
	CodecFP32 Codec = iota
	// CodecBF16 averages them with bfloat16 on the wire and float32 sums
	// (quant.DownCast): about 2(W-1)/W * 2 bytes per element.
	CodecBF16
	// CodecInt8 averages them with symmetric int8 codes (-127 to 127,
	// scale amax/127, so that ±amax come back exactly as ±127*scale) and
	// one float32 scale per group of Int8GroupSize elements, in two phases
	// (all-to-all, owner sums in float32, all-gather): about
	// 2(W-1)/W * (1 + 4/256) bytes per element.
	CodecInt8
	// CodecOneBit compresses the outer momentum, mu*u + delta, with
	// lowbit's error-compensated 1-bit allreduce (onebit.AllReduce, error
	// buffers kept across exchanges): about 2(W-1)/W / 8 bytes per
	// element.
	CodecOneBit
	numCodecs
)

var codecNames = [numCodecs]string{"fp32", "bf16", "int8", "1bit"}

// String returns the codec's name as ParseCodec reads it.
func (c Codec) String() string {
	if c.Valid() {
		return codecNames[c]
	}
	return fmt.Sprintf("Codec(%d)", int(c))
}

// Valid reports whether c is one of the defined codecs.
func (c Codec) Valid() bool { return c >= 0 && c < numCodecs }

// ParseCodec returns the codec called s: "fp32", "bf16", "int8" or
// "1bit" (case-insensitive).
func ParseCodec(s string) (Codec, error) {
	for i, n := range codecNames {
		if strings.EqualFold(s, n) {
			return Codec(i), nil
		}
	}
	return 0, fmt.Errorf("outer: unknown codec %q (want one of %s)", s, strings.Join(codecNames[:], ", "))
}

// Int8GroupSize is the number of elements that share one float32 scale in
// CodecInt8.
const Int8GroupSize = 256

// Config holds the settings of the outer optimizer. Start from
// DefaultConfig: the zero value is not valid (H is 0).
type Config struct {
	// H is the number of inner steps (Step calls) per outer step of each
	// fragment, >= 1. Default 50.
	H int
	// Fragments is the number of fragments the parameters are cut into
	// (Streaming DiLoCo), in [1, H]; fragment f exchanges at the calls t
	// with t = f*H/Fragments (mod H), so that exchanges are staggered.
	// It must not exceed the number of parameter elements (checked by the
	// constructor). Default 1.
	Fragments int
	// Delay is the number of inner steps between launching a fragment's
	// exchange and merging its result, in [0, H/Fragments] (integer
	// division): the exchange runs in the background meanwhile, and at
	// most one exchange is ever in flight. 0 exchanges and merges within
	// the launching Step. Default 0.
	Delay int
	// Codec is how pseudo-gradients travel. Default CodecFP32.
	Codec Codec
	// LR is the outer learning rate, finite and > 0. Default 0.7.
	LR float32
	// Momentum is the outer momentum, in [0, 1). Default 0.9.
	Momentum float32
	// Nesterov selects the Nesterov step (PyTorch SGD nesterov=True)
	// rather than heavy ball. Default true.
	Nesterov bool
	// BucketBytes is the bucket size of CodecOneBit within a fragment: 0
	// for optim.DefaultBucketBytes, or >= 4 (optim.PerParameter is not
	// supported: fragments cut across parameters). Other codecs ignore it.
	BucketBytes int
	// Scale is the 1-bit codec's scales (onebit.State.SetScale):
	// onebit.ScaleRMS, onebit.md's, or onebit.ScaleMeanAbs, the mean of
	// |x|, which measured better on the GPT example and worse on MNIST and
	// the convergence test (docs/outer.md). Other codecs ignore it.
	// Default onebit.ScaleRMS.
	Scale onebit.Scale
}

// DefaultConfig returns H 50, one fragment, no delay, CodecFP32, outer
// Nesterov SGD with learning rate 0.7 and momentum 0.9 (DiLoCo's
// defaults).
func DefaultConfig() Config {
	return Config{H: 50, Fragments: 1, Codec: CodecFP32, LR: 0.7, Momentum: 0.9, Nesterov: true}
}

// Validate reports the first invalid field as a *optim.ConfigError. The
// constructors return exactly this error.
func (c Config) Validate() error {
	const cfg = "outer.Config"
	switch {
	case c.H < 1:
		return &optim.ConfigError{Config: cfg, Field: "H", Value: c.H, Want: ">= 1"}
	case c.Fragments < 1 || c.Fragments > c.H:
		return &optim.ConfigError{Config: cfg, Field: "Fragments", Value: c.Fragments, Want: fmt.Sprintf("in [1, H = %d]", c.H)}
	case c.Delay < 0 || c.Delay > c.H/c.Fragments:
		return &optim.ConfigError{Config: cfg, Field: "Delay", Value: c.Delay,
			Want: fmt.Sprintf("in [0, H/Fragments = %d] (one exchange in flight at a time)", c.H/c.Fragments)}
	case !c.Codec.Valid():
		return &optim.ConfigError{Config: cfg, Field: "Codec", Value: c.Codec, Want: "one of " + strings.Join(codecNames[:], ", ")}
	case !(c.LR > 0) || math.IsInf(float64(c.LR), 1):
		return &optim.ConfigError{Config: cfg, Field: "LR", Value: c.LR, Want: "finite and > 0"}
	case !(c.Momentum >= 0 && c.Momentum < 1):
		return &optim.ConfigError{Config: cfg, Field: "Momentum", Value: c.Momentum, Want: "in [0, 1)"}
	case c.Scale != onebit.ScaleRMS && c.Scale != onebit.ScaleMeanAbs:
		return &optim.ConfigError{Config: cfg, Field: "Scale", Value: c.Scale, Want: "onebit.ScaleRMS or onebit.ScaleMeanAbs"}
	case c.BucketBytes != 0 && c.BucketBytes < 4:
		return &optim.ConfigError{Config: cfg, Field: "BucketBytes", Value: c.BucketBytes, Want: "0 (optim.DefaultBucketBytes) or >= 4"}
	}
	return nil
}

// hypers are the settings that decide the next steps, recorded in every
// checkpoint (optim.HyperPrefix + name) and checked on Load.
func (c Config) hypers() []optim.Hyper {
	return []optim.Hyper{
		{Name: "outer_h", Value: float64(c.H)},
		{Name: "outer_fragments", Value: float64(c.Fragments)},
		{Name: "outer_delay", Value: float64(c.Delay)},
		{Name: "outer_codec", Value: float64(c.Codec)},
		{Name: "outer_lr", Value: float64(c.LR)},
		{Name: "outer_momentum", Value: float64(c.Momentum)},
		{Name: "outer_nesterov", Value: optim.HyperBool(c.Nesterov)},
		{Name: "outer_scale", Value: float64(c.Scale)},
	}
}
