package outer

import (
	"fmt"
	"math"
	"strings"

	"github.com/lowbit-ml/lowbit/optim"
)

// TensorRegroupedAccumulator holds, in a checkpoint made by Regroup, the
// mean of the old ranks' sparse accumulators (CodecSparse), which Load
// takes as this rank's accumulator. It is not an error buffer for
// optim.IsErrorBuffer: Regroup's checkpoints have their error buffers
// reset (ErrorsReset), and this one is what they keep of them.
const TensorRegroupedAccumulator = "outer/regrouped_accumulator"

// Regroup makes the checkpoint of rank rank of a group of world ranks
// from old, the checkpoints of every rank of a run of the outer optimizer
// (old[r] made by rank r, all of one step), so that the run resumes on
// another number of ranks:
//   - on as many ranks as made old, it is a deep copy of old[rank]: each
//     rank's own state, bit for bit;
//   - on another number, it is old[rank % len(old)].ResetErrors() (the
//     inner optimizer's state and the parameters of that rank, θ_g and u,
//     which are the same on every rank) with, for CodecSparse, the mean of
//     every old rank's accumulator (TensorRegroupedAccumulator), which Load
//     takes as the accumulator of every new rank, as onebit.Regroup keeps
//     the mean of the 1-bit worker errors. With SparseTwoPhase the old
//     owners' server accumulators are folded into that mean (each added
//     at the elements its rank owned): the error the owners kept of the
//     average then travels through both phases again, the new ranks'
//     server accumulators start from zero, and nothing depends on which
//     new rank owns what (the owners change with the group size), while
//     the sum of everything not yet applied, the mean of the worker
//     accumulators plus the server accumulators, is kept. The 1-bit
//     codec's error buffers restart from zero (their layout depends on
//     the group size).
//
// A checkpoint with an exchange in flight is refused on another number of
// ranks (its pending result is per rank): take one between exchanges.
// Other checkpoints, mismatched ranks or steps, and a rank outside [0,
// world) are refused with an error wrapping optim.ErrIncompatibleCheckpoint.
// old is not changed.
func Regroup(old []*optim.Checkpoint, world, rank int) (*optim.Checkpoint, error) {
	if err := checkRegroup(old, world, rank); err != nil {
		return nil, fmt.Errorf("outer: regroup: %w", err)
	}
	if world == len(old) {
		return old[rank].Clone(), nil
	}
	out := old[rank%len(old)].ResetErrors()
	if old[0].Tensor(AccumulatorName) != nil {
		n := len(old[0].Tensor(AccumulatorName).Data)
		sum := make([]float64, n)
		for _, ck := range old {
			for i, v := range ck.Tensor(AccumulatorName).Data {
				sum[i] += float64(v)
			}
		}
		for i := range sum {
			sum[i] /= float64(len(old))
		}
		if old[0].Tensor(ServerAccumulatorName) != nil {
			foldServer(old, sum)
		}
		mean := make([]float32, n)
		for i, s := range sum {
			mean[i] = float32(s)
		}
		out.AddTensor(TensorRegroupedAccumulator, []int{n}, mean)
	}
	return out, nil
}

// foldServer adds the server accumulators of old (SparseTwoPhase), each
// over the runs its rank owned, to mean, flat over every element.
func foldServer(old []*optim.Checkpoint, mean []float64) {
	bounds, chunk := sparseLayout(old[0], len(mean))
	for r, ck := range old {
		srv, at := ck.Tensor(ServerAccumulatorName).Data, 0
		for f := range len(bounds) - 1 {
			lo, hi := sparseRun(bounds[f+1]-bounds[f], chunk, len(old), r)
			for i, v := range srv[at : at+hi-lo] {
				mean[bounds[f]+lo+i] += float64(v)
			}
			at += hi - lo
		}
	}
}

// sparseLayout returns the fragments' bounds over n elements and the
// sparse chunk of the settings ck records (outer_fragments,
// outer_sparse_chunk), as the optimizer makes them; nil bounds when they
// are missing or out of range.
func sparseLayout(ck *optim.Checkpoint, n int) (bounds []int, chunk int) {
	fv, cv := ck.Floats[optim.HyperPrefix+"outer_fragments"], ck.Floats[optim.HyperPrefix+"outer_sparse_chunk"]
	if !(fv >= 1 && fv <= float64(n) && cv >= 1 && cv <= 1<<24) || fv != math.Trunc(fv) || cv != math.Trunc(cv) {
		return nil, 0
	}
	F := int(fv)
	bounds = make([]int, F+1)
	for f := range F + 1 {
		bounds[f] = int(int64(f) * int64(n) / int64(F))
	}
	return bounds, int(cv)
}

// serverLen is the length of the server accumulator of rank r of w over
// the fragments bounds.
func serverLen(bounds []int, chunk, w, r int) int {
	n := 0
	for f := range len(bounds) - 1 {
		lo, hi := sparseRun(bounds[f+1]-bounds[f], chunk, w, r)
		n += hi - lo
	}
	return n
}

func checkRegroup(old []*optim.Checkpoint, world, rank int) error {
	bad := optim.ErrIncompatibleCheckpoint
	switch {
	case len(old) == 0:
		return fmt.Errorf("%w: no checkpoints", bad)
	case world < 1:
		return fmt.Errorf("%w: a group of %d ranks", bad, world)
	case rank < 0 || rank >= world:
		return fmt.Errorf("%w: rank %d of a group of %d", bad, rank, world)
	}
	a := old[0]
	for r, ck := range old {
		switch {
		case ck == nil:
			return fmt.Errorf("%w: checkpoint %d is nil", bad, r)
		case !strings.HasPrefix(ck.Algorithm, AlgorithmPrefix):
			return fmt.Errorf("%w: checkpoint %d is algorithm %q's, not the outer optimizer's (onebit.Regroup regroups the 1-bit optimizers)", bad, r, ck.Algorithm)
		case ck.Algorithm != a.Algorithm:
			return fmt.Errorf("%w: checkpoint %d is algorithm %q's, checkpoint 0 %q's", bad, r, ck.Algorithm, a.Algorithm)
		case ck.World != len(old) || ck.Rank != r:
			return fmt.Errorf("%w: checkpoint %d was made by rank %d of %d, want rank %d of %d (old[r] made by rank r of the whole group)", bad, r, ck.Rank, ck.World, r, len(old))
		case ck.Ints[IntCalls] != a.Ints[IntCalls]:
			return fmt.Errorf("%w: checkpoint %d is of step %d, checkpoint 0 of step %d", bad, r, ck.Ints[IntCalls], a.Ints[IntCalls])
		case (ck.Tensor(AccumulatorName) == nil) != (a.Tensor(AccumulatorName) == nil):
			return fmt.Errorf("%w: checkpoint %d and checkpoint 0 differ in holding a sparse accumulator", bad, r)
		case ck.Tensor(AccumulatorName) != nil && len(ck.Tensor(AccumulatorName).Data) != len(a.Tensor(AccumulatorName).Data):
			return fmt.Errorf("%w: checkpoint %d's sparse accumulator has %d elements, checkpoint 0's %d", bad, r,
				len(ck.Tensor(AccumulatorName).Data), len(a.Tensor(AccumulatorName).Data))
		case (ck.Tensor(ServerAccumulatorName) == nil) != (a.Tensor(ServerAccumulatorName) == nil):
			return fmt.Errorf("%w: checkpoint %d and checkpoint 0 differ in holding a server accumulator", bad, r)
		}
	}
	if srv := a.Tensor(ServerAccumulatorName); srv != nil && world != len(old) {
		acc := a.Tensor(AccumulatorName)
		if acc == nil {
			return fmt.Errorf("%w: a server accumulator without a sparse accumulator", bad)
		}
		bounds, chunk := sparseLayout(a, len(acc.Data))
		if bounds == nil {
			return fmt.Errorf("%w: the fragments and sparse chunk of checkpoint 0 are not recorded or out of range", bad)
		}
		for r, ck := range old {
			if got, want := len(ck.Tensor(ServerAccumulatorName).Data), serverLen(bounds, chunk, len(old), r); got != want {
				return fmt.Errorf("%w: checkpoint %d's server accumulator has %d elements, rank %d of %d owns %d", bad, r, got, r, len(old), want)
			}
		}
	}
	if world != len(old) && a.Ints[IntPending] >= 0 {
		return fmt.Errorf("%w: step %d has the exchange of fragment %d in flight, which a group of another size cannot take over: regroup a checkpoint taken between exchanges",
			bad, a.Ints[IntCalls], a.Ints[IntPending])
	}
	return nil
}
