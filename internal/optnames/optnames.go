// Package optnames holds the -optimizer names the examples share (the
// MNIST example and the GoMLX GPT example), which exact optimizer each
// compressed one is compared with, and the 1-bit Adam state mode a name
// selects, so that both examples read the same names the same way.
package optnames

import (
	"strings"

	"github.com/lowbit-ml/lowbit/onebit"
)

// The names. Each example documents what it builds for a name; the
// meanings below are the library's.
const (
	// Adam and Lamb are the exact optimizers (optim.NewAdam,
	// optim.NewLamb).
	Adam = "adam"
	Lamb = "lamb"
	// OnebitAdam is 1-bit Adam (onebit.NewAdam) in StateFull, and
	// Compact, Sharded and ShardedBF16 its other state modes: Compact
	// (onebit.StateCompact) takes its steps bit for bit in less memory,
	// Sharded (onebit.StateSharded, docs/sharded.md) shards the moments
	// over the ranks, and ShardedBF16 keeps the sharded mode's worker
	// error and frozen variance in bfloat16
	// (onebit.BF16WorkerError|onebit.BF16Variance).
	OnebitAdam  = "onebit-adam"
	Compact     = "onebit-adam-compact"
	Sharded     = "onebit-adam-sharded"
	ShardedBF16 = "onebit-adam-sharded-bf16"
	// OnebitLamb is 1-bit LAMB (onebit.NewLamb), and LambCompact the
	// same in StateCompact: its steps bit for bit in less memory.
	OnebitLamb  = "onebit-lamb"
	LambCompact = "onebit-lamb-compact"
	// ZeroOneAdam is 0/1 Adam (onebit.NewZeroOneAdam); ZeroAdam the
	// ZeRO-style sharded exact Adam (zero.NewAdam).
	ZeroOneAdam = "zeroone-adam"
	ZeroAdam    = "zero-adam"
	// Diloco is the outer optimizer (package outer, docs/outer.md): inner
	// steps on each rank's own gradients and, every H steps, the
	// pseudo-gradients averaged through a codec and applied by an outer
	// Nesterov SGD.
	Diloco = "diloco"
	// Muon is exact Muon (optim.NewMuon), its matrices by Muon and the rest
	// by its auxiliary AdamW; OnebitMuon is 1-bit Muon (onebit.NewMuon):
	// after its warm-up each rank orthogonalizes its own momentum and the
	// updates go through the error-compensated 1-bit allreduce
	// (docs/muon.md).
	Muon       = "muon"
	OnebitMuon = "onebit-muon"
)

// Baseline maps each compressed or sharded optimizer to the exact one it is
// compared with (-compare, the reports' "vs exact" columns).
var Baseline = map[string]string{
	OnebitAdam:  Adam,
	Sharded:     Adam,
	Compact:     Adam,
	ShardedBF16: Adam,
	OnebitLamb:  Lamb,
	LambCompact: Lamb,
	ZeroOneAdam: Adam,
	ZeroAdam:    Adam,
	Diloco:      Adam,
	OnebitMuon:  Muon,
}

// CompressedOf maps an exact optimizer to the compressed one -compare
// pairs it with.
var CompressedOf = map[string]string{
	Adam: OnebitAdam,
	Lamb: OnebitLamb,
	Muon: OnebitMuon,
}

// StateOf is the state mode and bfloat16 buffers of the 1-bit Adam called
// name (OnebitAdam, Compact, Sharded or ShardedBF16); another name gives
// StateFull.
func StateOf(name string) (onebit.StateMode, onebit.BF16State) {
	mode, bf, _ := onebit.ParseStateMode(strings.TrimPrefix(strings.TrimPrefix(name, OnebitAdam), "-"))
	return mode, bf
}
