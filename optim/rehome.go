package optim

import (
	"maps"
	"slices"
	"strings"
)

// Checkpoint names of the error buffers of the compressed optimizers. The
// error buffers are the only per-rank state of a checkpoint, and the only
// tensors whose size depends on the group size: everything else is the
// same on every rank of a group (0/1 Adam's local steps aside) and sized
// by the parameters alone.
//
// The naming rule, shared by every optimizer and applied by IsErrorBuffer
// and ResetErrors: a tensor is an error buffer when its name is
// WorkerErrorName or ServerErrorName, alone (one buffer for a fused group
// of parameters, as in 1-bit LAMB) or followed by "/" and a parameter name
// (one buffer per parameter, as in 1-bit Adam and 0/1 Adam). Package
// onebit builds its WorkerErrorPrefix, ServerErrorPrefix, FusedWorkerError
// and FusedServerError from these two names, so the rule lives here, with
// the format, and a new optimizer follows it by using them.
const (
	WorkerErrorName = "worker_error"
	ServerErrorName = "server_error"
)

// IsErrorBuffer reports whether the checkpoint tensor called name is an
// error buffer: WorkerErrorName or ServerErrorName, alone or followed by
// "/" and anything.
func IsErrorBuffer(name string) bool {
	for _, base := range [...]string{WorkerErrorName, ServerErrorName} {
		if rest, ok := strings.CutPrefix(name, base); ok && (rest == "" || rest[0] == '/') {
			return true
		}
	}
	return false
}

// Clone returns a deep copy of ck (nil for a nil ck): what Load sees in
// it, nothing shared with ck.
func (ck *Checkpoint) Clone() *Checkpoint {
	if ck == nil {
		return nil
	}
	out := *ck
	out.Ints, out.Floats = maps.Clone(ck.Ints), maps.Clone(ck.Floats)
	out.Tensors = nil
	for _, t := range ck.Tensors {
		out.AddTensor(t.Name, t.Shape, t.Data)
	}
	return &out
}

// ResetErrors is the explicit request to load ck on a group of another
// size, or on another rank, at the price of the error feedback. It returns
// a deep copy of ck without its error buffers (see IsErrorBuffer) and with
// ErrorsReset set; ck itself is unchanged, and a nil ck gives nil.
//
// An optimizer's Load accepts such a checkpoint on any group size and rank
// (the algorithm, the parameter names and shapes, and everything else must
// still match, as for any checkpoint), restores all the rest of the state
// and starts its error buffers, sized for its own group, at zero. The
// 1-bit optimizers log a warning saying so through their logger (see
// WithLogger); ErrorsReset stays set on the checkpoint, in memory and in
// its file, for the caller to see. The exact optimizers need no reset:
// their checkpoints load on any group size as they are (see Replicated),
// and a reset copy of one, which drops nothing, loads the same, without a
// warning. For the 1-bit optimizers onebit.Regroup is the lossless way to
// another number of ranks (see RankChange for every algorithm's).
//
// World and Rank keep saying which group and rank made the checkpoint.
// Every rank of the new group may load any rank's reset checkpoint: in the
// 1-bit optimizers' compression stages (and in 0/1 Adam's phase A) every
// rank holds the same state anyway; in 0/1 Adam's phase B, between two
// synchronizations, a rank continues from the parameters and momentum of
// the rank that made its checkpoint, and the next synchronization averages
// the progress of the new ranks since the last one. What the old ranks'
// error buffers held (a few steps' worth of compression error) is lost,
// which perturbs the following steps slightly; training carries on.
func (ck *Checkpoint) ResetErrors() *Checkpoint {
	if ck == nil {
		return nil
	}
	out := &Checkpoint{
		Algorithm:   ck.Algorithm,
		World:       ck.World,
		Rank:        ck.Rank,
		Stage:       ck.Stage,
		ErrorsReset: true,
		Ints:        maps.Clone(ck.Ints),
		Floats:      maps.Clone(ck.Floats),
	}
	for _, t := range ck.Tensors {
		if IsErrorBuffer(t.Name) {
			continue
		}
		out.Tensors = append(out.Tensors, Tensor{Name: t.Name, Shape: slices.Clone(t.Shape), Data: slices.Clone(t.Data)})
	}
	return out
}

// Algorithm names of the optimizers of other packages, which optim cannot
// import: onebit.AlgorithmMuon, zero.Algorithm and outer.AlgorithmPrefix
// (TestRankChange in each of those packages checks that RankChange knows
// its name).
const (
	algorithmOnebitMuon = "onebit-muon"
	algorithmZeroAdam   = "zero-adam"
	algorithmOuter      = "outer-"
)

// Replicated reports whether the checkpoints of algorithm hold the same
// state on every rank of a group, apart from their Rank field: the exact
// optimizers' (AlgorithmAdam, AlgorithmLamb, AlgorithmMuon), which keep no
// per-rank buffers. Such a checkpoint, any rank's, loads as it is on a
// group of any size: nothing is lost, and CheckCompatible does not compare
// its World with the group's.
func Replicated(algorithm string) bool {
	switch algorithm {
	case AlgorithmAdam, AlgorithmLamb, AlgorithmMuon:
		return true
	}
	return false
}

// RankChange says how a checkpoint of algorithm moves to a group of
// another number of ranks, losslessly where there is a way, and what the
// lossy alternative drops: the advice of CheckCompatible's refusal.
// docs/gomlx.md ("Changing the number of ranks") has the same in a table.
func RankChange(algorithm string) string {
	switch {
	case Replicated(algorithm):
		return "the state is the same on every rank: any rank's checkpoint loads as it is on any group size"
	case algorithm == AlgorithmOnebitAdam, algorithm == AlgorithmOnebitLamb, algorithm == AlgorithmZeroOneAdam:
		return "onebit.Regroup(every old rank's checkpoint, world, rank) makes this rank's, keeping the error feedback " +
			"(each worker error the old ranks' mean, the server errors re-cut); " +
			"Checkpoint.ResetErrors is the lossy way: it drops the error feedback, which restarts from zero"
	case algorithm == algorithmOnebitMuon:
		return "onebit.Regroup(every old rank's checkpoint, world, rank) makes this rank's, keeping the error feedback " +
			"(each worker error the old ranks' mean, the server errors re-cut) and starting every rank from the mean of the ranks' momenta; " +
			"Checkpoint.ResetErrors is the lossy way: it drops the error feedback, which restarts from zero, " +
			"and keeps the momenta of the one rank that made the checkpoint"
	case algorithm == algorithmZeroAdam:
		return "zero.Consolidate(every old rank's checkpoint) joins the shards of the moments into one checkpoint that loads on any group size, nothing lost"
	case strings.HasPrefix(algorithm, algorithmOuter):
		return "outer.Regroup(every old rank's checkpoint, world, rank) makes this rank's: θ_g and u (the same on every rank) " +
			"and the codecs' error feedback (the 1-bit codec's worker errors and the sparse accumulators: their mean) are carried, " +
			"new rank r continues old rank r % W's inner optimizer, local parameters and any exchange in flight " +
			"(the other old ranks' local steps since their last exchange are not carried)"
	}
	return "Checkpoint.ResetErrors makes a copy that loads on any group size, with the error buffers reset"
}
