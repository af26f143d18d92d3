package gomlx

import (
	"context"
	"iter"
	"testing"

	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// numbered is a train.Dataset of global batches: batch i holds rows rows
// whose one input is 1000*i + the row and whose one label is i, and a
// scalar input i. It ends after n batches.
type numbered struct{ rows, n int }

func (d numbered) Name() string { return "numbered" }

func (d numbered) Iter() iter.Seq2[train.Batch, error] {
	return func(yield func(train.Batch, error) bool) {
		for i := range d.n {
			x := make([]float32, d.rows)
			y := make([]int32, d.rows)
			for r := range x {
				x[r], y[r] = float32(1000*i+r), int32(i)
			}
			b := train.Batch{Inputs: []*tensors.Tensor{tensors.FromFlatDataAndDimensions(x, d.rows, 1), tensors.FromScalar(int32(i))},
				Labels: []*tensors.Tensor{tensors.FromFlatDataAndDimensions(y, d.rows)}}
			if !yield(b, nil) {
				return
			}
		}
	}
}

// TestShard: Shard gives each of 3 ranks its rows of every global batch
// (8 rows: 2, 3 and 3), scalars whole, from the global step start gives
// on; a global batch of fewer rows than ranks, or a dataset that ends
// before the start, is an error.
func TestShard(t *testing.T) {
	require.NoError(t, local.Run(context.Background(), 3, func(_ context.Context, c comm.Comm) error {
		r := c.Rank()
		start := int64(2)
		ds := Shard(numbered{rows: 8, n: 5}, c, func() int64 { return start })
		lo, hi := []int{0, 2, 5, 8}[r], []int{0, 2, 5, 8}[r+1]
		var got []int32
		for b, err := range ds.Iter() {
			require.NoError(t, err)
			i := tensors.ToScalar[int32](b.Inputs[1])
			got = append(got, i)
			x, err := tensors.CopyFlatData[float32](b.Inputs[0])
			require.NoError(t, err)
			want := make([]float32, 0, hi-lo)
			for row := lo; row < hi; row++ {
				want = append(want, float32(1000*int(i)+row))
			}
			assert.Equal(t, want, x, "rank %d, batch %d", r, i)
			assert.Equal(t, []int{hi - lo}, b.Labels[0].Shape().Dimensions)
		}
		assert.Equal(t, []int32{2, 3, 4}, got, "rank %d: the global batches from start on", r)

		// errs collects what an iteration yields: the errors, and nil for
		// every batch.
		errs := func(ds train.Dataset) []error {
			var out []error
			for _, err := range ds.Iter() {
				out = append(out, err)
			}
			return out
		}
		start = 7
		ended := errs(ds)
		require.Len(t, ended, 1, "rank %d: one error, no batch", r)
		require.Error(t, ended[0])
		assert.Contains(t, ended[0].Error(), "lbgomlx: Shard: numbered ended after 5 global batches, before global step 7")
		small := errs(Shard(numbered{rows: 2, n: 1}, c, nil))
		require.Len(t, small, 1, "rank %d: one error, no batch", r)
		require.Error(t, small[0])
		assert.Contains(t, small[0].Error(), "a global batch of 2 rows for 3 ranks")
		return nil
	}))
}

// globalSet is a train.Dataset of the whole regression set, every step,
// the inputs of step i shifted by i/10: what every rank reads before
// Shard keeps its rows.
type globalSet struct{}

func (globalSet) Name() string { return "regression" }

func (globalSet) Iter() iter.Seq2[train.Batch, error] {
	return func(yield func(train.Batch, error) bool) {
		for i := 0; ; i++ {
			x, y := regression(0, rows)
			require.NoError(nil, tensors.MutableFlatData(x, func(f []float32) {
				for j := range f {
					f[j] += float32(i) / 10
				}
			}))
			if !yield(train.Batch{Inputs: []*tensors.Tensor{x}, Labels: []*tensors.Tensor{y}}, nil) {
				return
			}
		}
	}
}

// TestShardLoop: 2 ranks training inside train.Loop on Shard(globalSet, c,
// trainer.GlobalStep), in two RunSteps of 3 steps, follow 1 rank on
// globalSet in one RunSteps of 6: the second RunSteps starts at global
// batch 3, not 0.
func TestShardLoop(t *testing.T) {
	run := func(w int, sharded bool) [][]float32 {
		out := make([][]float32, w)
		require.NoError(t, local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
			m := newRankModel(t, ctx, c, newStore(7), 16, adam)
			defer m.opt.Close()
			if !sharded {
				_, err := m.loop.RunSteps(globalSet{}, 6)
				out[c.Rank()] = m.losses
				return err
			}
			ds := Shard(globalSet{}, c, m.trainer.GlobalStep)
			for range 2 {
				if _, err := m.loop.RunSteps(ds, 3); err != nil {
					return err
				}
			}
			out[c.Rank()] = m.losses
			return nil
		}))
		return out
	}
	one, two := run(1, false), run(2, true)
	require.Len(t, one[0], 6)
	for s := range 6 {
		mean := (float64(two[0][s]) + float64(two[1][s])) / 2
		assert.InDelta(t, float64(one[0][s]), mean, 1e-5, "step %d", s+1)
	}
}
