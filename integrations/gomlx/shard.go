package gomlx

import (
	"fmt"
	"iter"

	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/train"

	"github.com/lowbit-ml/lowbit/comm"
)

// Shard returns the train.Dataset of this rank's part of every global
// batch ds yields, for train.Loop: of each tensor of a batch's Inputs and
// Labels, the rows [r*n/W, (r+1)*n/W) of its first axis, for a tensor of n
// rows, W ranks in c and this rank r (a scalar is passed whole). A global
// batch of fewer rows than ranks is an error; one whose rows do not split
// evenly gives the ranks shards one row apart, which the lowbit optimizer
// averages with equal weights (give an incomplete last batch the same
// size, or drop it: GoMLX's BatchSize(n, true)).
//
// Every rank's ds must yield the same global batches in the same order: a
// generator of its own, or GoMLX's dataset.InMemory(...) shuffled from
// the same seed on every rank (WithRand) and Infinite(true), so that
// train.Loop never reaches its end.
//
// start, when not nil, gives the global step to start from: every Iter
// (each RunSteps) reads and drops that many global batches of a fresh
// ds.Iter() first, so that global step s trains on global batch s whether
// the process started afresh or resumed from a checkpoint. Pass the
// trainer's GlobalStep:
//
//	ds := lbgomlx.Shard(globalBatches, c, trainer.GlobalStep)
//
// (With GoMLX's shuffled InMemory, whose every Iter draws a new order, a
// resumed run replays the order of the first Iter of the run it resumes:
// call RunSteps or RunToGlobalStep once per process.) The dropped batches
// are read; a dataset that can seek is started where it should faster by
// itself (and then given a nil start).
func Shard(ds train.Dataset, c comm.Comm, start func() int64) train.Dataset {
	s := &shardDataset{ds: ds, start: start, world: 1}
	if c != nil {
		s.rank, s.world = c.Rank(), c.Size()
	}
	return s
}

type shardDataset struct {
	ds          train.Dataset
	start       func() int64
	rank, world int
}

func (s *shardDataset) Name() string {
	return fmt.Sprintf("%s (shard %d of %d)", s.ds.Name(), s.rank, s.world)
}

func (s *shardDataset) Iter() iter.Seq2[train.Batch, error] {
	return func(yield func(train.Batch, error) bool) {
		var skip int64
		if s.start != nil {
			skip = s.start()
		}
		n := int64(0)
		for b, err := range s.ds.Iter() {
			if err != nil {
				yield(train.Batch{}, err)
				return
			}
			if n < skip {
				n++
				s.release(b)
				continue
			}
			part, err := s.slice(b)
			s.release(b)
			if !yield(part, err) || err != nil {
				return
			}
		}
		if n < skip {
			yield(train.Batch{}, fmt.Errorf("lbgomlx: Shard: %s ended after %d global batches, before global step %d", s.ds.Name(), n, skip))
		}
	}
}

// release finalizes the tensors of a batch ds yielded, unless ds keeps
// them (GoMLX's FinalizeYieldsAfterUse).
func (s *shardDataset) release(b train.Batch) {
	if f, ok := s.ds.(interface{ FinalizeYieldsAfterUse() bool }); ok && !f.FinalizeYieldsAfterUse() {
		return
	}
	_ = b.Finalize()
}

// slice returns this rank's rows of every tensor of b, as new tensors.
func (s *shardDataset) slice(b train.Batch) (train.Batch, error) {
	out := train.Batch{Spec: b.Spec, Inputs: make([]*tensors.Tensor, len(b.Inputs)), Labels: make([]*tensors.Tensor, len(b.Labels))}
	for _, part := range []struct {
		name     string
		from, to []*tensors.Tensor
	}{{"input", b.Inputs, out.Inputs}, {"label", b.Labels, out.Labels}} {
		for i, t := range part.from {
			var err error
			if part.to[i], err = s.rows(t); err != nil {
				return train.Batch{}, fmt.Errorf("lbgomlx: Shard: %s %d of %s: %w", part.name, i, s.ds.Name(), err)
			}
		}
	}
	return out, nil
}

// rows returns this rank's rows of t.
func (s *shardDataset) rows(t *tensors.Tensor) (*tensors.Tensor, error) {
	shape := t.Shape().Clone()
	if shape.Rank() == 0 {
		return t.Clone()
	}
	n := shape.Dimensions[0]
	if n < s.world {
		return nil, fmt.Errorf("a global batch of %d rows for %d ranks", n, s.world)
	}
	lo, hi := s.rank*n/s.world, (s.rank+1)*n/s.world
	shape.Dimensions[0] = hi - lo
	out := tensors.FromShape(shape)
	var err error
	if cerr := t.ConstBytes(func(src []byte) {
		row := len(src) / n
		err = out.MutableBytes(func(dst []byte) { copy(dst, src[lo*row:hi*row]) })
	}); cerr != nil {
		return nil, cerr
	}
	return out, err
}
