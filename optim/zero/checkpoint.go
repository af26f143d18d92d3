package zero

import (
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/optim"
)

// Checkpoint counters of Adam beyond optim's common ones.
const (
	// IntReduce is the Reduce mode the checkpoint was made with.
	IntReduce = "zero_reduce"
	// IntConsolidated is 1 in a checkpoint made by Consolidate.
	IntConsolidated = "zero_consolidated"
	// ShardOffsetPrefix, followed by a parameter name, is the index of the
	// parameter's first element whose moments the checkpoint holds.
	ShardOffsetPrefix = "zero_shard_offset/"
)

// State returns this rank's checkpoint: the frame's header, step counters
// and learning-rate state (see optim.Frame.Checkpoint), every parameter
// (whole, under optim.ParamTensorName), this rank's shard of each
// parameter's moments (under optim.ExpAvgPrefix and optim.ExpAvgSqPrefix,
// one-dimensional, possibly empty, the index of its first element under
// ShardOffsetPrefix) and the reduce-scatter mode (IntReduce).
func (a *Adam) State() (*optim.Checkpoint, error) {
	ck := a.f.Checkpoint()
	ck.Ints[IntReduce] = int64(a.cfg.ReduceScatter)
	for i, p := range a.params {
		s := a.segs[i]
		k := s.hi - s.lo
		ck.AddTensor(optim.ParamTensorName(p.Name), p.Shape(), p.Data())
		ck.AddTensor(optim.ExpAvgPrefix+p.Name, []int{k}, a.m[s.off:s.off+k])
		ck.AddTensor(optim.ExpAvgSqPrefix+p.Name, []int{k}, a.v[s.off:s.off+k])
		ck.Ints[ShardOffsetPrefix+p.Name] = int64(s.lo)
	}
	return ck, nil
}

// Load restores a checkpoint that State made on the same world size, rank,
// reduce-scatter mode and parameters, or one that Consolidate made on any
// world size with any mode (the explicit re-shard: every rank loads the
// same consolidated checkpoint and takes its own shard of the moments).
// Anything else is refused with an error wrapping
// optim.ErrIncompatibleCheckpoint, and the optimizer is left unchanged.
// The learning-rate state follows optim.Frame.CheckLoad. Every rank must
// load a checkpoint of the same step: Load does not communicate.
func (a *Adam) Load(ck *optim.Checkpoint) error {
	if err := a.load(ck); err != nil {
		return fmt.Errorf("zero: Adam: %w", err)
	}
	return nil
}

func (a *Adam) load(ck *optim.Checkpoint) error {
	if ck == nil {
		return fmt.Errorf("%w: nil checkpoint", optim.ErrIncompatibleCheckpoint)
	}
	if ck.Algorithm != Algorithm {
		return fmt.Errorf("%w: made by algorithm %q, this optimizer is %q", optim.ErrIncompatibleCheckpoint, ck.Algorithm, Algorithm)
	}
	world, rank := a.f.World(), a.f.Rank()
	consolidated := ck.Ints[IntConsolidated] == 1
	if consolidated {
		// Any group may load it: check the rest as if this group made it.
		own := *ck
		own.World, own.Rank = world, rank
		ck = &own
	} else {
		if ck.World != world {
			return fmt.Errorf("%w: made on %d ranks, this group has %d; a rank's checkpoint holds only its own shard of the moments: re-shard explicitly by loading zero.Consolidate of every rank's checkpoint",
				optim.ErrIncompatibleCheckpoint, ck.World, world)
		}
		if ck.Rank != rank {
			return fmt.Errorf("%w: made by rank %d, this is rank %d (each rank holds its own shard of the moments: load this rank's own checkpoint, or zero.Consolidate of every rank's, which loads on any rank)",
				optim.ErrIncompatibleCheckpoint, ck.Rank, rank)
		}
		mode, err := ck.Int(IntReduce)
		if err != nil {
			return err
		}
		if Reduce(mode) != a.cfg.ReduceScatter {
			return fmt.Errorf("%w: made with reduce-scatter mode %v, this optimizer uses %v; load zero.Consolidate of every rank's checkpoint to change modes",
				optim.ErrIncompatibleCheckpoint, Reduce(mode), a.cfg.ReduceScatter)
		}
	}
	st, err := a.f.CheckLoad(ck, optim.StageExact)
	if err != nil {
		return err
	}
	type cp struct{ dst, src []float32 }
	ops := make([]cp, 0, 3*len(a.params))
	ts := ck.Index()
	for i, p := range a.params {
		src, err := ts.TensorData(optim.ParamTensorName(p.Name), p.Numel())
		if err != nil {
			return err
		}
		ops = append(ops, cp{p.Data(), src})
		s := a.segs[i]
		k := s.hi - s.lo
		for _, mv := range []struct {
			prefix string
			dst    []float32
		}{{optim.ExpAvgPrefix, a.m}, {optim.ExpAvgSqPrefix, a.v}} {
			dst := mv.dst[s.off : s.off+k]
			if consolidated {
				src, err := ts.TensorData(mv.prefix+p.Name, p.Numel())
				if err != nil {
					return err
				}
				ops = append(ops, cp{dst, src[s.lo:s.hi]})
				continue
			}
			src, err := ts.TensorData(mv.prefix+p.Name, k)
			if err != nil {
				return err
			}
			off, err := ck.Int(ShardOffsetPrefix + p.Name)
			if err != nil {
				return err
			}
			if off != int64(s.lo) && k > 0 {
				return fmt.Errorf("%w: the shard of %q starts at element %d in the checkpoint, this rank owns it from %d",
					optim.ErrIncompatibleCheckpoint, p.Name, off, s.lo)
			}
			ops = append(ops, cp{dst, src})
		}
	}
	for _, op := range ops {
		copy(op.dst, op.src)
	}
	a.f.Restore(st)
	return nil
}

// Consolidate joins the checkpoints that State made on every rank of one
// group, at the same step, into one checkpoint that holds every
// parameter's whole moments (shaped like the parameter, as optim.Adam
// stores them). Adam.Load accepts it on a group of any size and with any
// reduce mode: this is how training moves to another world size. cks may
// come in any order; every rank's must be there exactly once. World and
// Rank of the result say which group made it (Rank 0); IntConsolidated is
// 1. It takes time linear in the size of cks.
func Consolidate(cks []*optim.Checkpoint) (*optim.Checkpoint, error) {
	if len(cks) == 0 {
		return nil, fmt.Errorf("zero: consolidate: no checkpoints")
	}
	w := len(cks)
	byRank := make([]*optim.Checkpoint, w)
	for _, ck := range cks {
		switch {
		case ck == nil:
			return nil, fmt.Errorf("zero: consolidate: nil checkpoint")
		case ck.Algorithm != Algorithm:
			return nil, fmt.Errorf("zero: consolidate: %w: algorithm %q, want %q", optim.ErrIncompatibleCheckpoint, ck.Algorithm, Algorithm)
		case ck.Ints[IntConsolidated] == 1:
			return nil, fmt.Errorf("zero: consolidate: %w: checkpoint is already consolidated", optim.ErrIncompatibleCheckpoint)
		case ck.World != w:
			return nil, fmt.Errorf("zero: consolidate: %w: a checkpoint of rank %d of %d ranks among %d checkpoints", optim.ErrIncompatibleCheckpoint, ck.Rank, ck.World, w)
		case ck.Rank < 0 || ck.Rank >= w || byRank[ck.Rank] != nil:
			return nil, fmt.Errorf("zero: consolidate: %w: rank %d is missing or given twice", optim.ErrIncompatibleCheckpoint, ck.Rank)
		}
		byRank[ck.Rank] = ck
	}
	first := byRank[0]
	if _, err := first.Int(IntReduce); err != nil {
		return nil, fmt.Errorf("zero: consolidate: rank 0: %w", err)
	}
	out := &optim.Checkpoint{
		Algorithm: Algorithm,
		World:     w,
		Stage:     first.Stage,
		Ints:      map[string]int64{IntConsolidated: 1},
		Floats:    map[string]float64{},
	}
	// Counters, modes and the learning-rate state: the same on every rank.
	for name, v := range first.Ints {
		if strings.HasPrefix(name, ShardOffsetPrefix) {
			continue
		}
		for r, ck := range byRank {
			if u, ok := ck.Ints[name]; !ok || u != v {
				return nil, fmt.Errorf("zero: consolidate: %w: counter %q is %d on rank 0 and %d on rank %d (checkpoints of different steps?)",
					optim.ErrIncompatibleCheckpoint, name, v, u, r)
			}
		}
		out.Ints[name] = v
	}
	for name, v := range first.Floats {
		for r, ck := range byRank {
			if u, ok := ck.Floats[name]; !ok || math.Float64bits(u) != math.Float64bits(v) {
				return nil, fmt.Errorf("zero: consolidate: %w: scalar %q is %v on rank 0 and %v on rank %d",
					optim.ErrIncompatibleCheckpoint, name, v, u, r)
			}
		}
		out.Floats[name] = v
	}
	ts := make([]*optim.TensorIndex, w)
	for r, ck := range byRank {
		ts[r] = ck.Index()
	}
	prefix := optim.ParamTensorName("")
	for _, t := range first.Tensors {
		name, ok := strings.CutPrefix(t.Name, prefix)
		if !ok {
			continue
		}
		for r := range byRank {
			u := ts[r].Tensor(t.Name)
			if u == nil || !slices.Equal(u.Shape, t.Shape) || !sameBits(u.Data, t.Data) {
				return nil, fmt.Errorf("zero: consolidate: %w: parameter %q differs between rank 0 and rank %d (checkpoints of different steps?)",
					optim.ErrIncompatibleCheckpoint, name, r)
			}
		}
		out.AddTensor(t.Name, t.Shape, t.Data)
		offName := ShardOffsetPrefix + name
		for _, mp := range []string{optim.ExpAvgPrefix, optim.ExpAvgSqPrefix} {
			mname := mp + name
			full := make([]float32, 0, len(t.Data))
			for r, ck := range byRank {
				off, err := ck.Int(offName)
				if err != nil {
					return nil, fmt.Errorf("zero: consolidate: rank %d: %w", r, err)
				}
				u := ts[r].Tensor(mname)
				if u == nil {
					return nil, fmt.Errorf("zero: consolidate: %w: rank %d lacks %q", optim.ErrIncompatibleCheckpoint, r, mname)
				}
				if len(u.Data) > 0 && off != int64(len(full)) || len(full)+len(u.Data) > len(t.Data) {
					return nil, fmt.Errorf("zero: consolidate: %w: rank %d's shard of %q (%d elements from %d) does not follow the shards of the ranks before it (%d elements)",
						optim.ErrIncompatibleCheckpoint, r, mname, len(u.Data), off, len(full))
				}
				full = append(full, u.Data...)
			}
			if len(full) != len(t.Data) {
				return nil, fmt.Errorf("zero: consolidate: %w: the shards of %q hold %d elements, the parameter %d",
					optim.ErrIncompatibleCheckpoint, mname, len(full), len(t.Data))
			}
			// full is the result's own: no copy, as AddTensor would make.
			out.Tensors = append(out.Tensors, optim.Tensor{Name: mname, Shape: slices.Clone(t.Shape), Data: full})
		}
	}
	return out, nil
}

func sameBits(x, y []float32) bool {
	if len(x) != len(y) {
		return false
	}
	for i := range x {
		if math.Float32bits(x[i]) != math.Float32bits(y[i]) {
			return false
		}
	}
	return true
}
