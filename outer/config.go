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
	// CodecSparse sends, per chunk of SparseChunk elements, the Density
	// share of the entries of an error accumulator of the pseudo-gradients
	// (Decay) of largest magnitude, each as its offset and a value of
	// SparseBits bits, and keeps what it did not send (SparseLoCo-style;
	// all-gathered): about (W-1) * Density * (log2(SparseChunk) +
	// SparseBits) / 8 bytes per element, 0.10 at W = 4 with the defaults
	// where CodecOneBit sends 0.19.
	CodecSparse
	numCodecs
)

var codecNames = [numCodecs]string{"fp32", "bf16", "int8", "1bit", "sparse"}

// String returns the codec's name as ParseCodec reads it.
func (c Codec) String() string {
	if c.Valid() {
		return codecNames[c]
	}
	return fmt.Sprintf("Codec(%d)", int(c))
}

// Valid reports whether c is one of the defined codecs.
func (c Codec) Valid() bool { return c >= 0 && c < numCodecs }

// ParseCodec returns the codec called s: "fp32", "bf16", "int8", "1bit"
// or "sparse" (case-insensitive).
func ParseCodec(s string) (Codec, error) {
	for i, n := range codecNames {
		if strings.EqualFold(s, n) {
			return Codec(i), nil
		}
	}
	return 0, fmt.Errorf("outer: unknown codec %q (want one of %s)", s, strings.Join(codecNames[:], ", "))
}

// SparseExchange is how CodecSparse's messages travel.
type SparseExchange int

// The sparse codec's exchanges. The zero value is SparseAllGather.
const (
	// SparseAllGather all-gathers every rank's message of the fragment;
	// every rank decodes the W messages into their average: (W-1)
	// messages sent per rank, growing with W.
	SparseAllGather SparseExchange = iota
	// SparseTwoPhase is a compressed allreduce in two phases, like 1-bit
	// Adam's: the chunks of a fragment are cut into W contiguous runs of
	// ceil(chunks/W) chunks, one per owner rank; an all-to-all sends each
	// owner the ranks' messages of its run, the owner averages them, adds
	// its server accumulator (the error of its earlier re-encodings, kept
	// across exchanges, decayed by Decay as the ranks' are), re-selects the top k of each chunk
	// with the same encoding and keeps what it did not send; an all-gather
	// of the owners' runs gives every rank the same average. About
	// 2(W-1)/W messages of the fragment sent per rank while W is much
	// less than its chunks (docs/outer.md, "The two-phase exchange").
	SparseTwoPhase
	// SparseShared agrees on the entries first and then sends values
	// only: the chunks are owned in runs as with SparseTwoPhase; each
	// owner picks the top k offsets of its chunks from its own
	// accumulator and an all-gather gives every rank every owner's offsets;
	// an all-to-all sends each owner every rank's values at its offsets
	// (SparseBits bits each and per-chunk scales, no offsets; each rank
	// keeps what it did not send), the owner averages them (exactly: no
	// re-selection) and adds its server accumulator, and an all-gather of
	// the owners' averages in int8 (one scale per chunk; the server
	// accumulator keeps the rounding) gives every rank the same average.
	// About (W-1)/W of Density*(offset bits + SparseBits + 8) bits per
	// element received per rank, not growing with W (docs/outer.md, "The
	// shared-index exchange").
	SparseShared
	// SparseVoted is SparseShared with the offsets chosen by the ranks'
	// votes (an ARC-Top-k-style sketch): every rank sends each owner the
	// offsets of its own top k entries of the owner's chunks (an
	// all-to-all), and the owner picks the k offsets most ranks named,
	// ties to its own larger magnitude; then as SparseShared. About
	// Density*offset bits per element more.
	SparseVoted
	numSparseExchanges
)

var sparseExchangeNames = [numSparseExchanges]string{"allgather", "twophase", "shared", "voted"}

// String returns the exchange's name as ParseSparseExchange reads it.
func (x SparseExchange) String() string {
	if x.Valid() {
		return sparseExchangeNames[x]
	}
	return fmt.Sprintf("SparseExchange(%d)", int(x))
}

// Valid reports whether x is one of the defined exchanges.
func (x SparseExchange) Valid() bool { return x >= 0 && x < numSparseExchanges }

// ParseSparseExchange returns the exchange called s: "allgather",
// "twophase", "shared" or "voted" (case-insensitive).
func ParseSparseExchange(s string) (SparseExchange, error) {
	for i, n := range sparseExchangeNames {
		if strings.EqualFold(s, n) {
			return SparseExchange(i), nil
		}
	}
	return 0, fmt.Errorf("outer: unknown sparse exchange %q (want one of %s)", s, strings.Join(sparseExchangeNames[:], ", "))
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
	// LR is the outer learning rate, finite and >= 0 (0: θ_g stays where
	// it is, the codecs' state updates as it would). Default 0.7.
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

	// Density is CodecSparse's share of each chunk's entries sent, in
	// (0, 1]. Other codecs ignore it (and the three fields below).
	// Default 1/48 (85 of 4096: within 0.01% of the fp32 codec on the
	// GPT example where 1/64 ended 0.84% above it, docs/outer.md).
	Density float32
	// SparseChunk is CodecSparse's chunk length in elements: at least
	// 1/Density, at most the smallest fragment (checked by the
	// constructor). Default 4096 (12-bit offsets).
	SparseChunk int
	// SparseBits is the bits of each value CodecSparse sends: 1 (the sign,
	// and one magnitude per chunk) or 2 (the sign and one of two
	// magnitudes). Default 1.
	SparseBits int
	// Decay is the decay of CodecSparse's error accumulator, in [0, 1]:
	// e = Decay*e + delta at each exchange. Default 0.95.
	Decay float32
	// AccumulatorBF16 keeps CodecSparse's error accumulator in bfloat16,
	// 2 bytes per element instead of 4: each exchange widens a chunk of e
	// to float32, takes delta into it, sends from it, and rounds what is
	// left back to bfloat16 (to nearest even), a relative error of at most
	// 2^-9 where the decay drops 1 - Decay of e (docs/outer.md, "Memory").
	// Other codecs ignore it. Default true in DefaultConfigFor(CodecSparse)
	// (false in DefaultConfig): with the inner AdamW's moments in bfloat16
	// (DefaultAdamConfigFor) the sparse codec keeps 10.3 bytes per
	// parameter at W = 8 instead of 16.3, and on the GPT example (600
	// steps, three seeds) its validation loss moved by +0.95%, +0.83% and
	// -2.02% against float32 state (-0.09% on average), MNIST's test
	// accuracy by nothing measurable (docs/outer.md, "Defaults per codec").
	// Set it false for float32 state, and to load the checkpoints of one.
	AccumulatorBF16 bool
	// SparseExchange is how CodecSparse's messages travel:
	// SparseAllGather (every rank's to every rank), SparseTwoPhase (to
	// the owner of each run of chunks, which re-encodes their average
	// with a server accumulator, then the owners' to every rank; W
	// independent bytes) or SparseShared (offsets chosen by the owners,
	// then values only, averaged exactly; W independent bytes). Other
	// codecs ignore it. Default SparseAllGather.
	SparseExchange SparseExchange
	// SparseServerDensity is SparseTwoPhase's share of each chunk's
	// entries that the owners send of the average in the second phase,
	// in (0, 1], or 0 for Density. Other exchanges and codecs ignore it.
	// Default 0.
	SparseServerDensity float32
	// SparseWithMuon accepts CodecSparse around a Muon inner optimizer
	// (optim.Muon, directly or through optim.Transposed: NewMuon, NewFrom
	// with a Muon builder, lbgomlx.NewOuterMuon), which the constructors
	// refuse otherwise: Muon's orthogonalized update has entries of
	// similar size, which the largest entries of a chunk carry little of,
	// and on the GPT example it ended at loss 2.8583 against the 1-bit
	// codec's 2.6017 (docs/outer.md, "The tighter target"). Set it to
	// insist. Other codecs and inner optimizers ignore it. Default false.
	SparseWithMuon bool
}

// FirstMerge returns the first Step call, counting from 1, after which the
// global parameters (Optimizer.Global) can have changed: the merge of the
// first exchange, at call H/Fragments + Delay (H + Delay with one
// fragment). A run of fewer inner steps exchanges nothing and leaves them
// the initial ones. c must be valid (Validate).
func (c Config) FirstMerge() int {
	first := c.H
	if c.Fragments > 1 {
		first = c.H / c.Fragments
	}
	return first + c.Delay
}

// StepsWarning returns a warning when a run of steps inner steps, counted
// from the first, ends before FirstMerge (no exchange, the global model
// the initial one), and "" otherwise. Programs that know both their
// number of steps and the config print it before they train. c must be
// valid (Validate).
func (c Config) StepsWarning(steps int) string {
	first := c.FirstMerge()
	if steps >= first {
		return ""
	}
	return fmt.Sprintf("the outer optimizer's first exchange merges at inner step %d (H %d, %d fragment(s), delay %d), after this run's %d steps: "+
		"it exchanges nothing and its global model stays the initial one; lower H (a few exchanges a run at least) or train longer",
		first, c.H, max(1, c.Fragments), c.Delay, steps)
}

// DefaultConfig returns H 50, one fragment, no delay, CodecFP32, outer
// Nesterov SGD with learning rate 0.7 and momentum 0.9 (DiLoCo's
// defaults).
func DefaultConfig() Config {
	return Config{H: 50, Fragments: 1, Codec: CodecFP32, LR: 0.7, Momentum: 0.9, Nesterov: true,
		Density: 1.0 / 48, SparseChunk: 4096, SparseBits: 1, Decay: 0.95}
}

// DefaultConfigFor returns DefaultConfig with codec c and the outer
// step measured to suit it (docs/outer.md, "Defaults per codec"):
//   - CodecFP32, CodecBF16 and CodecInt8: DiLoCo's Nesterov 0.7/0.9;
//   - CodecOneBit: plain averaging, learning rate 1, no momentum (the outer
//     momentum lifts the compression's noise: with DiLoCo's defaults the
//     GPT example ended 14.5% above fp32, with these 0.13%);
//   - CodecSparse: no momentum (the accumulator takes its place),
//     learning rate sparseLR (each entry is sent by a share of the ranks
//     and the average divides by all of them) and the accumulator in
//     bfloat16 (AccumulatorBF16).
//
// An invalid c gives DefaultConfig with Codec c (Validate refuses it).
func DefaultConfigFor(c Codec) Config {
	cfg := DefaultConfig()
	cfg.Codec = c
	switch c {
	case CodecOneBit:
		cfg.LR, cfg.Momentum = 1, 0
	case CodecSparse:
		cfg.LR, cfg.Momentum, cfg.AccumulatorBF16 = sparseLR, 0, true
	}
	return cfg
}

// DefaultAdamConfigFor returns the inner AdamW's config to give NewAdam
// with DefaultConfigFor(c): optim.DefaultAdamConfig, with the moments in
// bfloat16 (optim.AdamConfig.MomentsBF16) for CodecSparse, whose state is
// then at most 12 bytes per parameter at W = 8, the inner AdamW's
// included (docs/outer.md, "Memory"); the other codecs keep float32
// moments.
func DefaultAdamConfigFor(c Codec) optim.AdamConfig {
	cfg := optim.DefaultAdamConfig()
	cfg.MomentsBF16 = c == CodecSparse
	return cfg
}

// sparseLR is CodecSparse's default outer learning rate.
const sparseLR = 4

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
	case !(c.LR >= 0) || math.IsInf(float64(c.LR), 1):
		return &optim.ConfigError{Config: cfg, Field: "LR", Value: c.LR, Want: "finite and >= 0"}
	case !(c.Momentum >= 0 && c.Momentum < 1):
		return &optim.ConfigError{Config: cfg, Field: "Momentum", Value: c.Momentum, Want: "in [0, 1)"}
	case c.Scale != onebit.ScaleRMS && c.Scale != onebit.ScaleMeanAbs:
		return &optim.ConfigError{Config: cfg, Field: "Scale", Value: c.Scale, Want: "onebit.ScaleRMS or onebit.ScaleMeanAbs"}
	case c.BucketBytes != 0 && c.BucketBytes < 4:
		return &optim.ConfigError{Config: cfg, Field: "BucketBytes", Value: c.BucketBytes, Want: "0 (optim.DefaultBucketBytes) or >= 4"}
	}
	if c.Codec != CodecSparse {
		return nil
	}
	switch {
	case !(c.Density > 0 && c.Density <= 1):
		return &optim.ConfigError{Config: cfg, Field: "Density", Value: c.Density, Want: "in (0, 1]"}
	case c.SparseChunk < 1 || float64(c.SparseChunk)*float64(c.Density) < 1:
		return &optim.ConfigError{Config: cfg, Field: "SparseChunk", Value: c.SparseChunk,
			Want: fmt.Sprintf(">= 1/Density = %g, so that every chunk sends at least one entry", math.Ceil(1/float64(c.Density)))}
	case c.SparseChunk > 1<<24:
		return &optim.ConfigError{Config: cfg, Field: "SparseChunk", Value: c.SparseChunk, Want: "<= 16777216 (2^24)"}
	case c.SparseBits != 1 && c.SparseBits != 2:
		return &optim.ConfigError{Config: cfg, Field: "SparseBits", Value: c.SparseBits, Want: "1 or 2"}
	case !(c.Decay >= 0 && c.Decay <= 1):
		return &optim.ConfigError{Config: cfg, Field: "Decay", Value: c.Decay, Want: "in [0, 1]"}
	case !c.SparseExchange.Valid():
		return &optim.ConfigError{Config: cfg, Field: "SparseExchange", Value: c.SparseExchange, Want: "one of " + strings.Join(sparseExchangeNames[:], ", ")}
	case c.SparseServerDensity != 0 && !(c.SparseServerDensity > 0 && c.SparseServerDensity <= 1):
		return &optim.ConfigError{Config: cfg, Field: "SparseServerDensity", Value: c.SparseServerDensity, Want: "0 (Density) or in (0, 1]"}
	}
	return nil
}

// serverDensity is SparseTwoPhase's density of the second phase.
func (c Config) serverDensity() float32 {
	if c.SparseServerDensity == 0 {
		return c.Density
	}
	return c.SparseServerDensity
}

// hypers are the settings that decide the next steps, recorded in every
// checkpoint (optim.HyperPrefix + name) and checked on Load.
func (c Config) hypers() []optim.Hyper {
	h := []optim.Hyper{
		{Name: "outer_h", Value: float64(c.H)},
		{Name: "outer_fragments", Value: float64(c.Fragments)},
		{Name: "outer_delay", Value: float64(c.Delay)},
		{Name: "outer_codec", Value: float64(c.Codec)},
		{Name: "outer_lr", Value: float64(c.LR)},
		{Name: "outer_momentum", Value: float64(c.Momentum)},
		{Name: "outer_nesterov", Value: optim.HyperBool(c.Nesterov)},
		{Name: "outer_scale", Value: float64(c.Scale)},
	}
	if c.Codec == CodecSparse {
		h = append(h,
			optim.Hyper{Name: "outer_density", Value: float64(c.Density)},
			optim.Hyper{Name: "outer_sparse_chunk", Value: float64(c.SparseChunk)},
			optim.Hyper{Name: "outer_sparse_bits", Value: float64(c.SparseBits)},
			optim.Hyper{Name: "outer_decay", Value: float64(c.Decay)})
		if c.AccumulatorBF16 {
			// Recorded only when set: the checkpoints of a float32
			// accumulator are as they were.
			h = append(h, optim.Hyper{Name: "outer_accumulator_bf16", Value: optim.HyperBool(true)})
		}
		if c.SparseExchange != SparseAllGather {
			// Recorded only when not the default, likewise.
			h = append(h, optim.Hyper{Name: "outer_sparse_exchange", Value: float64(c.SparseExchange)})
		}
		if c.SparseExchange == SparseTwoPhase {
			h = append(h, optim.Hyper{Name: "outer_sparse_server_density", Value: float64(c.serverDensity())})
		}
	}
	return h
}
