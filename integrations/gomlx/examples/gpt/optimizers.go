package main

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/comm"
	lbgomlx "github.com/lowbit-ml/lowbit/integrations/gomlx"
	"github.com/lowbit-ml/lowbit/internal/optnames"
	"github.com/lowbit-ml/lowbit/internal/outerstate"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
	"github.com/lowbit-ml/lowbit/outer"
)

// optimizerNames are the optimizers -optimizer takes, in the order -help
// lists them.
var optimizerNames = []string{"adam", "onebit-adam", "onebit-adam-compact", "onebit-adam-sharded", "onebit-adam-sharded-bf16", "zeroone-adam", "lamb", "onebit-lamb", lambCompact, "zero-adam", diloco, muon, onebitMuon}

// The names the examples share (package optnames), under this example's
// short names. muon puts the hidden matrices (lbgomlx.HiddenMatrices:
// attention and feed-forward) under Muon with -muon-lr, and the
// embeddings, the output head, biases and norms under its auxiliary AdamW
// with -lr (optim.NewMuon through lbgomlx.NewMuon; onebitMuon through
// lbgomlx.MuonBuilder, the AdamW group's momenta as 1-bit Adam's). diloco's
// :REDUCE slot names the codec of its exchanges (fp32, bf16, int8, 1bit
// or sparse, the default); -reduce does not apply to it. sharded has a name
// of its own, as :REDUCE names the gradient averaging: its warm-up
// averages in fp32 only.
const (
	lambCompact = optnames.LambCompact
	diloco      = optnames.Diloco
	muon        = optnames.Muon
	onebitMuon  = optnames.OnebitMuon
	sharded     = optnames.Sharded
	compact     = optnames.Compact
	shardedBF16 = optnames.ShardedBF16
)

// runSpec is one training run: an optimizer and its gradient reduction.
type runSpec struct {
	name string
	// reduce is the gradient averaging of the exact optimizers and of the
	// 1-bit optimizers' exact stage: fp32, fp16, bf16 or twolevel.
	reduce optim.ReduceMode
	// scatter is zero-adam's gradient reduce-scatter: fp32, coalesced,
	// int8 or int4.
	scatter zero.Reduce
	// codec is diloco's exchange codec: fp32, bf16, int8, 1bit or sparse.
	codec outer.Codec
	// codecDefault: diloco's codec was not named, so it is the one
	// measured best with the inner optimizer (defaultCodec).
	codecDefault bool
}

// defaultCodec is the codec of a plain diloco run: the one measured best
// with its inner optimizer (docs/outer.md): sparse with Adam, 1bit with
// Muon, whose orthogonalized updates the sparse codec sends poorly.
func defaultCodec(muonInner bool) outer.Codec {
	if muonInner {
		return outer.CodecOneBit
	}
	return outer.CodecSparse
}

// label names the run in tables: the optimizer, and its reduction unless
// it is the default.
func (r runSpec) label() string {
	switch {
	case r.name == "zero-adam":
		return r.name + " " + r.scatter.String()
	case r.name == diloco:
		return r.name + " " + r.codec.String()
	case r.reduce != optim.ReduceFP32:
		return r.name + " " + r.reduce.String()
	}
	return r.name
}

// dirName names the run's checkpoint directories: the optimizer and its
// reduction.
func (r runSpec) dirName() string { return r.name + "-" + r.reduceName() }

// reduceName is the run's reduction as -reduce spells it.
func (r runSpec) reduceName() string {
	switch r.name {
	case "zero-adam":
		return r.scatter.String()
	case diloco:
		return r.codec.String()
	}
	return r.reduce.String()
}

// parseRuns returns the runs -optimizer, -reduce and -compare ask for.
// -optimizer is a comma-separated list of NAME or NAME:REDUCE (REDUCE
// overrides -reduce for that run): "adam,adam:fp16,zero-adam:int4"; for
// diloco REDUCE is the codec of its exchanges ("diloco:1bit"; plain
// "diloco" is sparse, whatever -reduce says, and 1bit once parseFlags
// sees -outer-inner muon: defaultCodec). With -compare (one optimizer
// only) the exact optimizer runs first, then its compressed counterpart,
// from the same seed; -reduce then applies to the exact averaging of both,
// and to zero-adam's reduce-scatter (diloco keeps its codec, Adam takes
// -reduce).
func parseRuns(list, reduce string, compare bool) ([]runSpec, error) {
	entries := strings.Split(list, ",")
	if compare {
		if len(entries) != 1 {
			return nil, fmt.Errorf("-compare takes one -optimizer, got %q", list)
		}
		name, red, _ := strings.Cut(entries[0], ":")
		if red == "" {
			red = reduce
		}
		pair := []string{name, optnames.CompressedOf[name]}
		if b, ok := optnames.Baseline[name]; ok {
			pair = []string{b, name}
		}
		if !slices.Contains(optimizerNames, name) {
			return nil, fmt.Errorf("unknown -optimizer %q (want one of %s)", name, strings.Join(optimizerNames, ", "))
		}
		if pair[1] == "" {
			return nil, fmt.Errorf("-compare: %s has no compressed counterpart; give the runs as a list instead (-optimizer adam,%s)", name, name)
		}
		var runs []runSpec
		for _, n := range pair {
			r := n
			switch {
			case n == diloco:
				r = entries[0] // its codec, not -reduce
			case name == diloco:
				r += ":" + reduce
			case n != "zero-adam" && name == "zero-adam":
				// the exact baseline of zero-adam averages in fp32 unless
				// -reduce names one of the exact modes
				if _, err := optim.ParseReduceMode(red); err != nil {
					r += ":fp32"
				} else {
					r += ":" + red
				}
			default:
				r += ":" + red
			}
			s, err := parseRun(r, reduce)
			if err != nil {
				return nil, err
			}
			runs = append(runs, s)
		}
		return runs, nil
	}
	var runs []runSpec
	for _, e := range entries {
		s, err := parseRun(e, reduce)
		if err != nil {
			return nil, err
		}
		runs = append(runs, s)
	}
	return runs, nil
}

// parseRun parses one NAME[:REDUCE] entry of -optimizer.
func parseRun(entry, reduce string) (runSpec, error) {
	name, red, _ := strings.Cut(strings.TrimSpace(entry), ":")
	if red == "" {
		red = reduce
	}
	if !slices.Contains(optimizerNames, name) {
		return runSpec{}, fmt.Errorf("unknown -optimizer %q (want one of %s)", name, strings.Join(optimizerNames, ", "))
	}
	s := runSpec{name: name}
	if name == diloco {
		// Not -reduce: a codec of its own, by default the one measured
		// best with the inner optimizer (set once the flags are parsed).
		codec := "sparse"
		if _, c, ok := strings.Cut(strings.TrimSpace(entry), ":"); ok && c != "" {
			codec = c
		} else {
			s.codecDefault = true
		}
		cd, err := outer.ParseCodec(codec)
		if err != nil {
			return runSpec{}, fmt.Errorf("unknown codec %q for diloco (want fp32, bf16, int8, 1bit or sparse)", codec)
		}
		s.codec = cd
		return s, nil
	}
	if name == "zero-adam" {
		z, err := zero.ParseReduce(red)
		if err != nil {
			return runSpec{}, fmt.Errorf("unknown reduction %q for zero-adam (want fp32, coalesced, int8 or int4)", red)
		}
		s.scatter = z
		return s, nil
	}
	m, err := optim.ParseReduceMode(red)
	switch {
	case err != nil && red == "sharded":
		return runSpec{}, fmt.Errorf("unknown reduction %q for %s: 1-bit Adam with sharded moments is -optimizer %s", red, name, sharded)
	case err != nil:
		return runSpec{}, fmt.Errorf("unknown reduction %q for %s (want fp32, fp16, bf16 or twolevel)", red, name)
	case (name == sharded || name == shardedBF16) && m != optim.ReduceFP32:
		return runSpec{}, fmt.Errorf("reduction %q for %s: it averages in fp32 only (its warm-up reduce-scatters float32 gradients)", red, name)
	}
	s.reduce = m
	return s, nil
}

// hyper are the optimizer settings the flags choose.
type hyper struct {
	// lr is the learning rate of Adam, LAMB, the 1-bit optimizers,
	// diloco's inner Adam and Muon's auxiliary AdamW (-lr).
	lr float32
	// muonLR is Muon's learning rate (-muon-lr).
	muonLR float32
	// muonSplit is exact Muon's MuonConfig.Split (-muon-split).
	muonSplit bool
	// freezeStep is the exact warm-up of the 1-bit optimizers: FreezeStep
	// of onebit-adam, onebit-adam-sharded and onebit-lamb, VarFreezeStep of
	// zeroone-adam.
	freezeStep int
	// outer is diloco's outer optimizer (-outer-h, -outer-fragments,
	// -outer-delay; its codec is the run's), with the fp32 codec's outer
	// step; outerFor gives a codec's.
	outer outer.Config
	// outerLR and outerMomentum are -outer-lr and -outer-momentum, < 0
	// where the codec's default (outer.DefaultConfigFor) applies.
	outerLR, outerMomentum float64
	// outerState is -outer-state: the precision of the inner AdamW's
	// moments and the sparse codec's accumulator; the zero value,
	// outerstate.Auto, is bfloat16 with the sparse codec.
	outerState outerstate.Mode
	// outerMuon is -outer-inner muon: diloco's inner optimizer is Muon
	// (lbgomlx.NewOuterMuon) at muonLR, its AdamW group at lr.
	outerMuon bool
	// muonState and muonBF16 are -muon-state: onebit-muon's StateMode
	// and MomentumBF16.
	muonState onebit.StateMode
	muonBF16  bool
	// muonWarmupAdamW is -muon-warmup adamw (the default): onebit-muon's
	// WarmupAdamWOnly.
	muonWarmupAdamW bool
	// muonExchange is -muon-exchange: onebit-muon's Exchange.
	muonExchange onebit.MuonExchange
	// ownerBits is -muon-owner-bits: onebit-muon's OwnerBits.
	ownerBits int
}

// outerFor returns diloco's settings with codec c: the flags, and where
// -outer-lr or -outer-momentum were not given, c's measured defaults
// (outer.DefaultConfigFor).
func (h hyper) outerFor(c outer.Codec) outer.Config {
	cfg := h.outer
	def := outer.DefaultConfigFor(c)
	cfg.Codec, cfg.LR, cfg.Momentum = c, def.LR, def.Momentum
	if h.outerLR >= 0 {
		cfg.LR = float32(h.outerLR)
	}
	if h.outerMomentum >= 0 {
		cfg.Momentum = float32(h.outerMomentum)
	}
	cfg.AccumulatorBF16 = h.outerState.AccumulatorBF16(c)
	return cfg
}

// innerMomentsBF16 says whether diloco's inner optimizer keeps its moments
// in bfloat16 with codec c (-outer-state): the inner Adam's only, never
// Muon's.
func (h hyper) innerMomentsBF16(c outer.Codec) bool {
	return !h.outerMuon && h.outerState.MomentsBF16(c)
}

// newOptimizer builds the optimizer of run r over params, communicating on
// c. It is the one place the example chooses a lowbit optimizer.
func newOptimizer(ctx context.Context, r runSpec, h hyper, c comm.Comm, params []*optim.Param) (optim.Optimizer, error) {
	adam := optim.DefaultAdamConfig()
	adam.LR = h.lr
	adam.Reduce = r.reduce
	lamb := optim.DefaultLambConfig()
	lamb.AdamConfig = adam
	switch r.name {
	case "adam":
		return optim.NewAdam(ctx, c, params, adam)
	case "lamb":
		return optim.NewLamb(ctx, c, params, lamb)
	case "onebit-adam", compact, sharded, shardedBF16:
		cfg := onebit.DefaultAdamConfig()
		cfg.AdamConfig = adam
		cfg.FreezeStep = h.freezeStep
		cfg.StateMode, cfg.BF16 = optnames.StateOf(r.name)
		return onebit.NewAdam(ctx, c, params, cfg)
	case "onebit-lamb", lambCompact:
		cfg := onebit.DefaultLambConfig()
		cfg.LambConfig = lamb
		cfg.FreezeStep = h.freezeStep
		if r.name == lambCompact {
			cfg.StateMode = onebit.StateCompact
		}
		return onebit.NewLamb(ctx, c, params, cfg)
	case "zeroone-adam":
		cfg := onebit.DefaultZeroOneAdamConfig()
		cfg.AdamConfig = adam
		cfg.VarFreezeStep = max(1, h.freezeStep)
		return onebit.NewZeroOneAdam(ctx, c, params, cfg)
	case diloco:
		cfg := h.outerFor(r.codec)
		if h.outerMuon {
			cfg.SparseWithMuon = true // diloco:sparse named with muon: asked for, warned of (dilocoWarnings)
			m := optim.DefaultMuonConfig()
			m.LR, m.AdamLR = h.muonLR, h.lr
			return lbgomlx.NewOuterMuon(cfg, m)(ctx, c, params)
		}
		inner := adam
		inner.Reduce = optim.ReduceFP32 // local: the inner Adam never communicates
		inner.MomentsBF16 = h.innerMomentsBF16(r.codec)
		return outer.NewAdam(ctx, c, params, cfg, inner)
	case muon:
		cfg := optim.DefaultMuonConfig()
		cfg.LR, cfg.AdamLR = h.muonLR, h.lr
		cfg.Reduce, cfg.Split = r.reduce, h.muonSplit
		return lbgomlx.NewMuon(cfg)(ctx, c, params)
	case onebitMuon:
		cfg := onebit.DefaultMuonConfig()
		cfg.LR, cfg.AdamLR = h.muonLR, h.lr
		cfg.Reduce = r.reduce
		cfg.FreezeStep = h.freezeStep
		cfg.StateMode, cfg.MomentumBF16 = h.muonState, h.muonBF16
		cfg.WarmupAdamWOnly = h.muonWarmupAdamW
		cfg.Exchange, cfg.OwnerBits = h.muonExchange, h.ownerBits
		return lbgomlx.MuonBuilder(func(ctx context.Context, c comm.Comm, params []*optim.Param, sel []string) (optim.Optimizer, error) {
			cfg := cfg
			cfg.Params = sel
			return onebit.NewMuon(ctx, c, params, cfg)
		})(ctx, c, params)
	case "zero-adam":
		cfg := zero.DefaultConfig()
		cfg.AdamConfig = adam
		cfg.AdamConfig.Reduce = optim.ReduceFP32 // zero-adam reduce-scatters instead
		cfg.ReduceScatter = r.scatter
		return zero.NewAdam(ctx, c, params, cfg)
	}
	return nil, fmt.Errorf("unknown optimizer %q", r.name)
}
