package onebit

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/lowbit-ml/lowbit/optim"
)

// Regroup makes the checkpoint that rank of a group of world ranks loads to
// continue the run whose every rank saved one of old (old[r] made by rank
// r of a group of len(old)), keeping the error feedback instead of
// resetting it (optim.Checkpoint.ResetErrors):
//
//   - every worker error buffer of the new group is the mean over the old
//     ranks of theirs, element by element (summed in float64, rounded
//     once): what the compressed average still owes the ranks is their
//     mean, and it stays the same to float32 rounding;
//   - the server errors (and the sharded mode's update errors) belong to
//     elements, not ranks: they are cut out of the old ranks' chunks and
//     cut again into the new group's, element for element, unchanged;
//   - the sharded mode's moments (StateSharded) are re-cut the same way,
//     unchanged;
//   - everything else comes from old[rank % len(old)], as after
//     ResetErrors: in the compression stages every rank holds the same
//     state anyway (0/1 Adam's local steps between synchronizations
//     aside, where a new rank continues from that old rank's parameters).
//
// Padding elements start at zero. On one rank there is no compression and
// no error buffer: the mean owed is dropped with them. The result is a new
// checkpoint made, as far as Load can tell, by rank of world ranks; old is
// not changed. Checkpoints of another algorithm than the three 1-bit
// optimizers, of different steps or stages, or with their errors already
// reset, are refused, as is an old set that is not every rank's.
func Regroup(old []*optim.Checkpoint, world, rank int) (*optim.Checkpoint, error) {
	if err := checkRegroup(old, world, rank); err != nil {
		return nil, fmt.Errorf("onebit: Regroup: %w", err)
	}
	src := old[rank%len(old)]
	out := &optim.Checkpoint{
		Algorithm: src.Algorithm, World: world, Rank: rank, Stage: src.Stage,
		Ints: maps.Clone(src.Ints), Floats: maps.Clone(src.Floats),
	}
	g := newRegrouper(old, world, rank)
	for _, t := range src.Tensors {
		switch {
		case optim.IsErrorBuffer(t.Name):
			if world == 1 {
				continue
			}
			n, err := g.sizeOf(t.Name)
			if err != nil {
				return nil, fmt.Errorf("onebit: Regroup: %w", err)
			}
			var data []float32
			if strings.HasPrefix(t.Name, optim.WorkerErrorName) {
				data, err = g.mean(t.Name, n)
			} else {
				data, err = g.rechunk(t.Name, n)
			}
			if err != nil {
				return nil, fmt.Errorf("onebit: Regroup: %w", err)
			}
			out.AddTensor(t.Name, []int{len(data)}, data)
		case g.sharded && (strings.HasPrefix(t.Name, ExpAvgShardPrefix) || strings.HasPrefix(t.Name, ExpAvgSqShardPrefix)):
			// Re-cut below, after the parameters.
		default:
			out.AddTensor(t.Name, t.Shape, t.Data)
		}
	}
	if g.sharded {
		if err := g.moments(out); err != nil {
			return nil, fmt.Errorf("onebit: Regroup: %w", err)
		}
	}
	return out, nil
}

// checkRegroup refuses what Regroup cannot do.
func checkRegroup(old []*optim.Checkpoint, world, rank int) error {
	if len(old) == 0 {
		return fmt.Errorf("no checkpoints")
	}
	if len(old) == 1 {
		return fmt.Errorf("%w: a run on one rank has no error feedback to regroup: load its checkpoint through ResetErrors on the new group (StateFull)",
			optim.ErrIncompatibleCheckpoint)
	}
	if world < 1 || rank < 0 || rank >= world {
		return fmt.Errorf("rank %d of %d ranks", rank, world)
	}
	a := old[0]
	if a == nil {
		return fmt.Errorf("checkpoint 0 is nil")
	}
	switch a.Algorithm {
	case optim.AlgorithmOnebitAdam, optim.AlgorithmOnebitLamb, optim.AlgorithmZeroOneAdam:
	default:
		return fmt.Errorf("%w: algorithm %q has no error feedback to regroup (it loads on any group size as it is)", optim.ErrIncompatibleCheckpoint, a.Algorithm)
	}
	for r, ck := range old {
		switch {
		case ck == nil:
			return fmt.Errorf("checkpoint %d is nil", r)
		case ck.ErrorsReset:
			return fmt.Errorf("%w: checkpoint %d has its error buffers reset already: load it as it is", optim.ErrIncompatibleCheckpoint, r)
		case ck.World != len(old) || ck.Rank != r:
			return fmt.Errorf("%w: checkpoint %d was made by rank %d of %d; Regroup needs every rank's, in rank order (%d given)",
				optim.ErrIncompatibleCheckpoint, r, ck.Rank, ck.World, len(old))
		case ck.Algorithm != a.Algorithm:
			return fmt.Errorf("%w: checkpoint %d is of algorithm %q, checkpoint 0 of %q", optim.ErrIncompatibleCheckpoint, r, ck.Algorithm, a.Algorithm)
		case ck.Ints[optim.IntStep] != a.Ints[optim.IntStep] || ck.Stage != a.Stage:
			return fmt.Errorf("%w: checkpoint %d is at step %d (%s), checkpoint 0 at step %d (%s): not one run's",
				optim.ErrIncompatibleCheckpoint, r, ck.Ints[optim.IntStep], ck.Stage, a.Ints[optim.IntStep], a.Stage)
		case modeOf(ck) != modeOf(a):
			return fmt.Errorf("%w: checkpoint %d was made with StateMode %v, checkpoint 0 with %v", optim.ErrIncompatibleCheckpoint, r, modeOf(ck), modeOf(a))
		}
	}
	return nil
}

// regrouper knows the element counts of a run's buffers.
type regrouper struct {
	old         []*optim.Checkpoint
	world, rank int
	sharded     bool
	names       []string // the parameters, in order
	sizes       []int    // their element counts
	shapes      [][]int
	n           int   // every parameter's elements
	buckets     []int // every bucket's elements (flat order), when the run had buckets
}

func newRegrouper(old []*optim.Checkpoint, world, rank int) *regrouper {
	g := &regrouper{old: old, world: world, rank: rank, sharded: modeOf(old[0]) == StateSharded}
	prefix := optim.ParamTensorName("")
	for _, t := range old[0].Tensors {
		if name, ok := strings.CutPrefix(t.Name, prefix); ok {
			g.names = append(g.names, name)
			g.sizes = append(g.sizes, len(t.Data))
			g.shapes = append(g.shapes, t.Shape)
			g.n += len(t.Data)
		}
	}
	if bytes, ok := old[0].Ints[IntBucketBytes]; ok {
		if bytes == optim.PerParameter {
			g.buckets = g.sizes
		} else {
			per := max(int(bytes)/4, 1)
			for lo := 0; lo < g.n; lo += per {
				g.buckets = append(g.buckets, min(per, g.n-lo))
			}
		}
	}
	return g
}

// sizeOf is the element count of the tensor an error buffer belongs to:
// the fused buffer of every parameter, bucket k, or a parameter.
func (g *regrouper) sizeOf(name string) (int, error) {
	rest := name[strings.IndexByte(name+"/", '/'):]
	if rest == "" {
		return g.n, nil
	}
	rest = rest[1:]
	if ks, ok := strings.CutPrefix(rest, "bucket:"); ok && g.buckets != nil {
		k, err := strconv.Atoi(ks)
		if err != nil || k < 0 || k >= len(g.buckets) {
			return 0, fmt.Errorf("%w: error buffer %q names no bucket of %d", optim.ErrIncompatibleCheckpoint, name, len(g.buckets))
		}
		return g.buckets[k], nil
	}
	if i := slices.Index(g.names, rest); i >= 0 {
		return g.sizes[i], nil
	}
	return 0, fmt.Errorf("%w: error buffer %q names no parameter or bucket", optim.ErrIncompatibleCheckpoint, name)
}

// tensor is rank r's tensor called name, with at least n elements.
func (g *regrouper) tensor(r int, name string, n int) ([]float32, error) {
	t := g.old[r].Tensor(name)
	if t == nil || len(t.Data) < n {
		return nil, fmt.Errorf("%w: checkpoint %d has no tensor %q of %d elements", optim.ErrIncompatibleCheckpoint, r, name, n)
	}
	return t.Data, nil
}

// mean is the new worker error buffer called name of a tensor of n
// elements: the old ranks' mean, padded for the new group.
func (g *regrouper) mean(name string, n int) ([]float32, error) {
	out := make([]float32, PaddedLen(n, g.world))
	sum := make([]float64, n)
	for r := range g.old {
		x, err := g.tensor(r, name, n)
		if err != nil {
			return nil, err
		}
		for i := range sum {
			sum[i] += float64(x[i])
		}
	}
	for i, s := range sum {
		out[i] = float32(s / float64(len(g.old)))
	}
	return out, nil
}

// flat is the buffer called name of a tensor of n elements whose old
// ranks each hold their chunk, put back together.
func (g *regrouper) flat(name string, n int) ([]float32, error) {
	w := len(g.old)
	c := PaddedLen(n, w) / w
	out := make([]float32, n)
	for r := range w {
		lo := r * c
		if lo >= n {
			break
		}
		x, err := g.tensor(r, name, min(c, n-lo))
		if err != nil {
			return nil, err
		}
		copy(out[lo:min(lo+c, n)], x)
	}
	return out, nil
}

// chunk is this rank's chunk of flat, padded for the new group.
func (g *regrouper) chunk(flat []float32) []float32 {
	c := PaddedLen(len(flat), g.world) / g.world
	out := make([]float32, c)
	if lo := g.rank * c; lo < len(flat) {
		copy(out, flat[lo:min(lo+c, len(flat))])
	}
	return out
}

// rechunk is the new rank's chunk of the buffer called name, which the
// old ranks hold chunk by chunk.
func (g *regrouper) rechunk(name string, n int) ([]float32, error) {
	f, err := g.flat(name, n)
	if err != nil {
		return nil, err
	}
	return g.chunk(f), nil
}

// moments writes the sharded mode's moments for the new group into out:
// shards of every bucket, or, on one rank (where the sharded mode runs as
// StateFull), every parameter's moments whole.
func (g *regrouper) moments(out *optim.Checkpoint) error {
	for _, pre := range [...]struct{ shard, whole string }{
		{ExpAvgShardPrefix, optim.ExpAvgPrefix}, {ExpAvgSqShardPrefix, optim.ExpAvgSqPrefix},
	} {
		all := make([]float32, 0, g.n) // the moment of every element, flat
		for k, n := range g.buckets {
			f, err := g.flat(bucketShardName(pre.shard, k), n)
			if err != nil {
				return err
			}
			all = append(all, f...)
		}
		if len(all) != g.n {
			return fmt.Errorf("%w: the moments hold %d elements, the parameters %d", optim.ErrIncompatibleCheckpoint, len(all), g.n)
		}
		if g.world == 1 {
			for i, name := range g.names {
				out.AddTensor(pre.whole+name, g.shapes[i], all[:g.sizes[i]])
				all = all[g.sizes[i]:]
			}
			continue
		}
		for k, n := range g.buckets {
			sh := g.chunk(all[:n])
			out.AddTensor(bucketShardName(pre.shard, k), []int{len(sh)}, sh)
			all = all[n:]
		}
	}
	return nil
}
