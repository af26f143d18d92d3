package outer

import (
	"fmt"
	"math"
	"strings"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// TensorRegroupedAccumulator holds, in a checkpoint made by Regroup, the
// mean of the old ranks' sparse accumulators (CodecSparse), which Load
// takes as this rank's accumulator. It is not an error buffer for
// optim.IsErrorBuffer: Regroup's checkpoints have their error buffers
// reset (ErrorsReset), and this one is what they keep of them.
const TensorRegroupedAccumulator = "outer/regrouped_accumulator"

// IntRegroupedFrom is, in a checkpoint Regroup made of a CodecOneBit run
// for another number of ranks with the error feedback carried, the number
// of ranks that made the old checkpoints; Load says so in its log.
const IntRegroupedFrom = "outer/regrouped_from"

// Regroup makes the checkpoint of rank rank of a group of world ranks
// from old, the checkpoints of every rank of a run of the outer optimizer
// (old[r] made by rank r, all of one step), so that the run resumes on
// another number of ranks:
//   - on as many ranks as made old, it is a deep copy of old[rank]: each
//     rank's own state, bit for bit;
//   - on another number, new rank r continues old rank r % len(old): its
//     inner optimizer's state and local parameters, θ_g and u (the same
//     on every rank), and an exchange in flight (its result, the same on
//     every rank, and that rank's parameters at its launch, which the
//     merge keeps the local steps since against), with the error feedback
//     of every old rank carried:
//   - CodecOneBit's error buffers, bucket by bucket, as onebit.Regroup
//     keeps the 1-bit optimizers' (onebit.RegroupErrors): each new worker
//     error the old ranks' mean, the server errors re-cut into the new
//     group's chunks. From one rank (no error buffers) or onto one (none
//     kept) they start at zero, and the checkpoint is
//     old[rank % len(old)].ResetErrors() with the parameters of that rank;
//   - CodecSparse's accumulator: the mean of every old rank's
//     (TensorRegroupedAccumulator), which Load takes as the accumulator of
//     every new rank, in old[rank % len(old)].ResetErrors(). With
//     SparseTwoPhase the old owners' server accumulators are folded into
//     that mean (each added at the elements its rank owned): the error the
//     owners kept of the average then travels through both phases again,
//     the new ranks' server accumulators start from zero, and nothing
//     depends on which new rank owns what (the owners change with the
//     group size), while the sum of everything not yet applied, the mean
//     of the worker accumulators plus the server accumulators, is kept.
//
// The local steps the other old ranks took since their last exchange are
// not carried (each new rank has one old rank's). Mismatched ranks or
// steps, checkpoints of another optimizer, buffers of another length than
// the run's, and a rank outside [0, world) are refused with an error
// wrapping optim.ErrIncompatibleCheckpoint. old is not changed.
func Regroup(old []*optim.Checkpoint, world, rank int) (*optim.Checkpoint, error) {
	if err := checkRegroup(old, world, rank); err != nil {
		return nil, fmt.Errorf("outer: regroup: %w", err)
	}
	if world == len(old) {
		return old[rank].Clone(), nil
	}
	src := old[rank%len(old)]
	if len(old) > 1 && world > 1 && src.Tensor(WorkerErrorName(0, 0)) != nil {
		out, err := regroupOneBit(old, world, rank)
		if err != nil {
			return nil, fmt.Errorf("outer: regroup: %w", err)
		}
		return out, nil
	}
	out := src.ResetErrors()
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

// regroupOneBit is Regroup's checkpoint for a run of CodecOneBit on more
// than one rank onto another number, more than one: old[rank % len(old)]
// made by rank of world, with every bucket's error buffers regrouped.
func regroupOneBit(old []*optim.Checkpoint, world, rank int) (*optim.Checkpoint, error) {
	bad := optim.ErrIncompatibleCheckpoint
	src := old[rank%len(old)]
	n := 0
	for _, t := range src.Tensors {
		if strings.HasPrefix(t.Name, optim.ParamTensorName("")) {
			n += len(t.Data)
		}
	}
	bounds := fragmentBounds(src, n)
	bb, ok := src.Ints[IntBucketBytes]
	if bounds == nil || !ok || bb < 1 || bb > math.MaxInt32 {
		return nil, fmt.Errorf("%w: the fragments and 1-bit bucket size of checkpoint %d are not recorded or out of range", bad, rank%len(old))
	}
	per := max(int(bb)/4, 1)
	out := src.Clone()
	out.World, out.Rank = world, rank
	out.Ints[IntRegroupedFrom] = int64(len(old))
	kept := out.Tensors[:0]
	for _, t := range out.Tensors {
		if !optim.IsErrorBuffer(t.Name) {
			kept = append(kept, t)
		}
	}
	out.Tensors = kept
	workers, servers := make([][]float32, len(old)), make([][]float32, len(old))
	carried := 0
	for f := range len(bounds) - 1 {
		m := bounds[f+1] - bounds[f]
		for k, lo := 0, 0; lo < m; k, lo = k+1, lo+per {
			wn, sn := WorkerErrorName(f, k), ServerErrorName(f, k)
			for r, ck := range old {
				w, s := ck.Tensor(wn), ck.Tensor(sn)
				if w == nil || s == nil {
					return nil, fmt.Errorf("%w: checkpoint %d holds no error buffers of bucket %d of fragment %d (%s, %s)", bad, r, k, f, wn, sn)
				}
				workers[r], servers[r] = w.Data, s.Data
			}
			we, se, err := onebit.RegroupErrors(workers, servers, min(lo+per, m)-lo, world, rank)
			if err != nil {
				return nil, fmt.Errorf("bucket %d of fragment %d: %w", k, f, err)
			}
			out.AddTensor(wn, []int{len(we)}, we)
			out.AddTensor(sn, []int{len(se)}, se)
			carried += 2
		}
	}
	for _, t := range src.Tensors {
		if optim.IsErrorBuffer(t.Name) {
			carried--
		}
	}
	if carried != 0 {
		return nil, fmt.Errorf("%w: checkpoint %d's error buffers are not those of its fragments and buckets of %d bytes", bad, rank%len(old), bb)
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

// fragmentBounds returns the fragments' bounds over n elements for the
// number of fragments ck records (outer_fragments), as the optimizer
// makes them; nil when it is missing or out of range.
func fragmentBounds(ck *optim.Checkpoint, n int) []int {
	fv := ck.Floats[optim.HyperPrefix+"outer_fragments"]
	if !(fv >= 1 && fv <= float64(n)) || fv != math.Trunc(fv) {
		return nil
	}
	F := int(fv)
	bounds := make([]int, F+1)
	for f := range F + 1 {
		bounds[f] = int(int64(f) * int64(n) / int64(F))
	}
	return bounds
}

// sparseLayout returns the fragments' bounds over n elements and the
// sparse chunk of the settings ck records (outer_fragments,
// outer_sparse_chunk), as the optimizer makes them; nil bounds when they
// are missing or out of range.
func sparseLayout(ck *optim.Checkpoint, n int) (bounds []int, chunk int) {
	cv := ck.Floats[optim.HyperPrefix+"outer_sparse_chunk"]
	bounds = fragmentBounds(ck, n)
	if bounds == nil || !(cv >= 1 && cv <= 1<<24) || cv != math.Trunc(cv) {
		return nil, 0
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
	return nil
}
