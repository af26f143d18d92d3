package outer

import (
	"fmt"
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
//     the mean of the 1-bit worker errors. The 1-bit codec's error
//     buffers restart from zero (their layout depends on the group size).
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
		mean := make([]float32, n)
		for i, s := range sum {
			mean[i] = float32(s / float64(len(old)))
		}
		out.AddTensor(TensorRegroupedAccumulator, []int{n}, mean)
	}
	return out, nil
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
		}
	}
	if world != len(old) && a.Ints[IntPending] >= 0 {
		return fmt.Errorf("%w: step %d has the exchange of fragment %d in flight, which a group of another size cannot take over: regroup a checkpoint taken between exchanges",
			bad, a.Ints[IntCalls], a.Ints[IntPending])
	}
	return nil
}
