package main

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/optnames"
	"github.com/lowbit-ml/lowbit/internal/outerstate"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
	"github.com/lowbit-ml/lowbit/outer"
)

// optimizerNames are the values of -optimizer, in the order -help lists
// them.
var optimizerNames = []string{"adam", "lamb", "onebit-adam", "onebit-adam-compact", "onebit-adam-sharded", "onebit-adam-sharded-bf16", "onebit-lamb", lambCompact, "zeroone-adam", "zero-adam", diloco, muon, onebitMuon}

// The names the examples share (package optnames), under this example's
// short names. muon puts the two weight matrices, w1 and w2, under Muon
// with -muon-lr and the biases under its auxiliary AdamW with -lr; the
// model stores its weights as [inputs, outputs] (x*W), so Muon gets their
// transposes (optim.NewTransposed), the layout its recipe's scale
// max(1, rows/cols)^0.5 assumes. diloco evaluates the model every rank
// agrees on, the global parameters (the ranks' own differ between
// exchanges). sharded's checkpoints resume on another number of ranks
// through onebit.Regroup, which re-cuts the moment shards.
const (
	lambCompact = optnames.LambCompact
	diloco      = optnames.Diloco
	muon        = optnames.Muon
	onebitMuon  = optnames.OnebitMuon
	sharded     = optnames.Sharded
	compact     = optnames.Compact
	shardedBF16 = optnames.ShardedBF16
)

// runOrder returns the optimizers one invocation trains: name alone, or
// with -compare the exact one and then the compressed one; name may also
// list several optimizers, comma-separated, trained in that order (not
// with -compare).
func runOrder(name string, compare bool) ([]string, error) {
	if names := strings.Split(name, ","); len(names) > 1 {
		if compare {
			return nil, fmt.Errorf("-compare trains one -optimizer and its counterpart; name every optimizer in -optimizer instead of %q", name)
		}
		for i, n := range names {
			if !slices.Contains(optimizerNames, n) {
				return nil, fmt.Errorf("unknown -optimizer %q in %q (want a comma-separated list of %v)", n, name, optimizerNames)
			}
			if slices.Contains(names[:i], n) {
				return nil, fmt.Errorf("-optimizer %q names %s twice", name, n)
			}
		}
		return names, nil
	}
	if !slices.Contains(optimizerNames, name) {
		return nil, fmt.Errorf("unknown -optimizer %q (want one of %v)", name, optimizerNames)
	}
	if !compare {
		return []string{name}, nil
	}
	if b, ok := optnames.Baseline[name]; ok {
		return []string{b, name}, nil
	}
	if optnames.CompressedOf[name] == "" {
		return nil, fmt.Errorf("-compare: %s has no compressed counterpart", name)
	}
	return []string{name, optnames.CompressedOf[name]}, nil
}

// hyper are the optimizer settings the flags choose.
type hyper struct {
	// lr is the learning rate of every optimizer but muon's Muon group:
	// muon's auxiliary AdamW's (-lr).
	lr float32
	// muonLR is muon's Muon group's learning rate (-muon-lr).
	muonLR float32
	// freezeStep is the warm-up of the 1-bit optimizers: FreezeStep of
	// onebit-adam, onebit-adam-sharded and onebit-lamb, VarFreezeStep of
	// zeroone-adam.
	freezeStep int
	// reduce is the gradient averaging of the exact optimizers and of the
	// 1-bit optimizers' exact stage (-reduce).
	reduce optim.ReduceMode
	// scatter is zero-adam's gradient reduce-scatter (-reduce).
	scatter zero.Reduce
	// localStepScaler is zeroone-adam's LocalStepScaler
	// (-local-step-scaler); 0 for the library's default.
	localStepScaler int
	// outer is diloco's outer optimizer (-outer-h, -outer-fragments,
	// -outer-delay, -outer-codec); its inner Adam takes lr.
	outer outer.Config
	// outerState is -outer-state: the precision of diloco's state, the
	// inner Adam's moments (optim.AdamConfig.MomentsBF16) and the sparse
	// codec's accumulator (outer.Config.AccumulatorBF16); the zero value,
	// outerstate.Auto, is bfloat16 with the sparse codec.
	outerState outerstate.Mode
	// outerMuon is -outer-inner muon: diloco's inner optimizer is Muon
	// (muon's selection, layout and learning rates), not AdamW.
	outerMuon bool
	// muonState and muonBF16 are -muon-state: onebit-muon's StateMode and
	// MomentumBF16; muonWarmupAdamW is -muon-warmup adamw (the default):
	// its WarmupAdamWOnly.
	muonState       onebit.StateMode
	muonBF16        bool
	muonWarmupAdamW bool
}

// validMuonState says whether s names a state mode of onebit-muon as
// -muon-state takes it (ParseMuonStateMode's "" for full is not a value
// to give).
func validMuonState(s string) bool {
	_, _, err := onebit.ParseMuonStateMode(s)
	return s != "" && err == nil
}

// reduceNames are the values of -reduce.
var reduceNames = []string{"fp32", "fp16", "bf16", "twolevel"}

// parseReduce returns the mode -reduce names.
func parseReduce(s string) (optim.ReduceMode, error) {
	m, err := optim.ParseReduceMode(s)
	if err != nil {
		return 0, fmt.Errorf("unknown -reduce %q (want one of %v)", s, reduceNames)
	}
	return m, nil
}

// zeroReduceNames are the values of -reduce for zero-adam.
var zeroReduceNames = []string{"fp32", "coalesced", "int8", "int4"}

// reducesOf is parseReduces for -optimizer list, one optimizer or several
// (comma-separated): -reduce must suit each of several; the modes are
// zero-adam's where it is one of them (as with -compare -optimizer
// zero-adam, whose Adam averages as zero-adam's -reduce says).
func reducesOf(list, s string) (optim.ReduceMode, zero.Reduce, error) {
	names := strings.Split(list, ",")
	if len(names) == 1 {
		return parseReduces(list, s)
	}
	for _, n := range names {
		if _, _, err := parseReduces(n, s); err != nil {
			return 0, 0, err
		}
	}
	if slices.Contains(names, "zero-adam") {
		return parseReduces("zero-adam", s)
	}
	return parseReduces(names[0], s)
}

// parseReduces returns what -reduce s means when -optimizer is name: the
// gradient averaging of the exact optimizers and zero-adam's
// reduce-scatter. For zero-adam s is one of zeroReduceNames, and the exact
// baseline of -compare averages in fp32 unless s is also one of its modes.
// onebit-adam-sharded takes fp32 only (its warm-up reduce-scatters float32
// gradients).
func parseReduces(name, s string) (optim.ReduceMode, zero.Reduce, error) {
	if name != "zero-adam" {
		m, err := parseReduce(s)
		if mode, _ := optnames.StateOf(name); err == nil && mode == onebit.StateSharded && m != optim.ReduceFP32 {
			return 0, 0, fmt.Errorf("-reduce %s: %s averages in fp32 only (its warm-up reduce-scatters float32 gradients)", s, name)
		}
		return m, 0, err
	}
	z, err := zero.ParseReduce(s)
	if err != nil {
		return 0, 0, fmt.Errorf("unknown -reduce %q for zero-adam (want one of %v)", s, zeroReduceNames)
	}
	m, err := optim.ParseReduceMode(s)
	if err != nil {
		m = optim.ReduceFP32
	}
	return m, z, nil
}

// newOptimizer builds the named optimizer over params, communicating on c.
func newOptimizer(ctx context.Context, name string, c comm.Comm, params []*optim.Param, h hyper) (optim.Optimizer, error) {
	adam := optim.DefaultAdamConfig()
	adam.LR = h.lr
	adam.Reduce = h.reduce
	lamb := optim.DefaultLambConfig()
	lamb.AdamConfig = adam
	switch name {
	case "adam":
		return optim.NewAdam(ctx, c, params, adam)
	case "lamb":
		return optim.NewLamb(ctx, c, params, lamb)
	case "onebit-adam", compact, sharded, shardedBF16:
		cfg := onebit.DefaultAdamConfig()
		cfg.AdamConfig = adam
		cfg.FreezeStep = h.freezeStep
		cfg.StateMode, cfg.BF16 = optnames.StateOf(name)
		return onebit.NewAdam(ctx, c, params, cfg)
	case "onebit-lamb", lambCompact:
		cfg := onebit.DefaultLambConfig()
		cfg.LambConfig = lamb
		cfg.FreezeStep = h.freezeStep
		if name == lambCompact {
			cfg.StateMode = onebit.StateCompact
		}
		return onebit.NewLamb(ctx, c, params, cfg)
	case "zeroone-adam":
		cfg := onebit.DefaultZeroOneAdamConfig()
		cfg.AdamConfig = adam
		cfg.VarFreezeStep = max(1, h.freezeStep)
		if h.localStepScaler > 0 {
			cfg.LocalStepScaler = h.localStepScaler
		}
		return onebit.NewZeroOneAdam(ctx, c, params, cfg)
	case diloco:
		oc := h.outer
		adam.MomentsBF16 = h.outerState.MomentsBF16(oc.Codec)
		oc.AccumulatorBF16 = h.outerState.AccumulatorBF16(oc.Codec)
		if !h.outerMuon {
			return outer.NewAdam(ctx, c, params, oc, adam)
		}
		// Muon inside (MuLoCo's setting): local, on no communicator, over
		// the transposes of the weight matrices as -optimizer muon.
		return outer.NewFrom(ctx, c, oc, func() (optim.Optimizer, error) {
			cfg := optim.DefaultMuonConfig()
			cfg.LR, cfg.AdamLR = h.muonLR, h.lr
			t, err := optim.NewTransposed(params, matricesOf(params), func(ps []*optim.Param) (optim.Optimizer, error) {
				return optim.NewMuon(ctx, nil, ps, cfg)
			})
			if err != nil {
				return nil, err // not a typed nil
			}
			return t, nil
		})
	case muon, onebitMuon:
		cfg := optim.DefaultMuonConfig() // Params nil: every matrix, w1 and w2
		cfg.LR, cfg.AdamLR, cfg.Reduce = h.muonLR, h.lr, h.reduce
		t, err := optim.NewTransposed(params, matricesOf(params), func(ps []*optim.Param) (optim.Optimizer, error) {
			if name == onebitMuon {
				ocfg := onebit.DefaultMuonConfig()
				ocfg.MuonConfig, ocfg.FreezeStep = cfg, h.freezeStep
				ocfg.StateMode, ocfg.MomentumBF16, ocfg.WarmupAdamWOnly = h.muonState, h.muonBF16, h.muonWarmupAdamW
				return onebit.NewMuon(ctx, c, ps, ocfg)
			}
			return optim.NewMuon(ctx, c, ps, cfg)
		})
		if err != nil {
			return nil, err // not a typed nil
		}
		return t, nil
	case "zero-adam":
		cfg := zero.DefaultConfig()
		cfg.AdamConfig = adam
		cfg.AdamConfig.Reduce = optim.ReduceFP32 // zero-adam reduce-scatters instead
		cfg.ReduceScatter = h.scatter
		return zero.NewAdam(ctx, c, params, cfg)
	}
	return nil, fmt.Errorf("unknown optimizer %q", name)
}

// matricesOf names the parameters of params that are matrices: what
// Muon takes (w1 and w2).
func matricesOf(params []*optim.Param) []string {
	var matrices []string
	for _, p := range params {
		if len(p.Shape()) >= 2 {
			matrices = append(matrices, p.Name)
		}
	}
	return matrices
}
