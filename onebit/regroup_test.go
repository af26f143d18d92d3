package onebit_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// regroupCase is an optimizer whose checkpoints Regroup carries from one
// group size to another.
type regroupCase struct {
	name string
	mk   func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)
}

func regroupCases() []regroupCase {
	adam := func(mode onebit.StateMode, bb int) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := adamConfigForResume(2)
		cfg.StateMode, cfg.BucketBytes = mode, bb
		return func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewAdam(context.Background(), c, ps, cfg)
		}
	}
	lamb := onebit.DefaultLambConfig()
	lamb.FreezeStep = 2
	zo := onebit.DefaultZeroOneAdamConfig()
	zo.VarFreezeStep, zo.LocalStepScaler = 2, 2
	return []regroupCase{
		{"1-bit Adam", adam(onebit.StateFull, 0)},
		{"1-bit Adam, buckets of 24 bytes", adam(onebit.StateFull, 24)},
		{"1-bit Adam, per parameter", adam(onebit.StateFull, optim.PerParameter)},
		{"1-bit Adam compact", adam(onebit.StateCompact, 24)},
		{"1-bit Adam sharded", adam(onebit.StateSharded, 0)},
		{"1-bit Adam sharded, buckets of 24 bytes", adam(onebit.StateSharded, 24)},
		{"1-bit LAMB", newLamb(lamb)},
		{"0/1 Adam", newZeroOne(zo)},
	}
}

// regroupRun runs w ranks of mk from cks (nil: from the start) for steps
// steps (gradients of adamGrads from step first) and returns every rank's
// checkpoint and parameters.
func regroupRun(t *testing.T, w int, mk func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error),
	cks []*optim.Checkpoint, first, steps int) ([]*optim.Checkpoint, [][][]uint32) {
	t.Helper()
	out := make([]*optim.Checkpoint, w)
	params := make([][][]uint32, w)
	var mu sync.Mutex
	err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, []int{3, 7}, []int{13}, []int{1})
		opt, err := mk(c, ps)
		if err != nil {
			return err
		}
		if cks != nil {
			if err := opt.Load(cks[c.Rank()]); err != nil {
				return err
			}
		}
		for s := first; s < first+steps; s++ {
			adamGrads(ps, c.Rank()%3, s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		ck, err := opt.State()
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		out[c.Rank()], params[c.Rank()] = ck, adamBits(ps)
		return nil
	})
	require.NoError(t, err)
	return out, params
}

// regroupAll is Regroup for every rank of a group of world.
func regroupAll(t *testing.T, old []*optim.Checkpoint, world int) []*optim.Checkpoint {
	t.Helper()
	out := make([]*optim.Checkpoint, world)
	for r := range out {
		ck, err := onebit.Regroup(old, world, r)
		require.NoError(t, err)
		require.Equal(t, world, ck.World)
		require.Equal(t, r, ck.Rank)
		require.False(t, ck.ErrorsReset)
		out[r] = ck
	}
	return out
}

// byElement puts back together, element by element, the buffers called
// name that every rank holds a chunk of (server and update errors,
// sharded moments): the first n elements.
func byElement(cks []*optim.Checkpoint, name string, n int) []float32 {
	var all []float32
	for _, ck := range cks {
		all = append(all, ck.Tensor(name).Data...)
	}
	w := len(cks)
	c := onebit.PaddedLen(n, w) / w
	out := make([]float32, 0, n)
	for r := range w {
		lo := r * c
		if lo >= n {
			break
		}
		out = append(out, all[r*c:r*c+min(c, n-lo)]...)
	}
	return out
}

// meanOf is the float64 mean over the ranks of the buffers called name,
// first n elements.
func meanOf(cks []*optim.Checkpoint, name string, n int) []float64 {
	out := make([]float64, n)
	for _, ck := range cks {
		for i, x := range ck.Tensor(name).Data[:n] {
			out[i] += float64(x)
		}
	}
	for i := range out {
		out[i] /= float64(len(cks))
	}
	return out
}

// chunked reports whether the checkpoint tensor called name is held by
// every rank chunk by chunk.
func chunked(name string) bool {
	return strings.HasPrefix(name, optim.ServerErrorName) ||
		strings.HasPrefix(name, onebit.ExpAvgShardPrefix) || strings.HasPrefix(name, onebit.ExpAvgSqShardPrefix)
}

// numelOf is the elements of the tensor a per-rank buffer belongs to: for
// these runs, a bucket's from the length of rank 0's worker error or
// chunk on w ranks is not enough, so it is found from the known layouts.
func numelOf(t *testing.T, ck *optim.Checkpoint, name string) int {
	t.Helper()
	const total = 35 // adamParams(3x7, 13, 1)
	rest := name[strings.IndexByte(name+"/", '/'):]
	if rest == "" {
		return total
	}
	rest = rest[1:]
	if k, ok := strings.CutPrefix(rest, "bucket:"); ok {
		per := int(ck.Ints[onebit.IntBucketBytes]) / 4
		if ck.Ints[onebit.IntBucketBytes] == 0 || per >= total {
			return total
		}
		var idx int
		_, err := fmt.Sscan(k, &idx)
		require.NoError(t, err)
		return min(per, total-idx*per)
	}
	return map[string]int{"w0": 21, "w1": 13, "w2": 1}[rest]
}

// Regrouping 4 ranks' checkpoints for 3 ranks and back for 4 keeps the
// invariants of Regroup's doc: the mean worker error to float32 rounding,
// the server errors and sharded moments element for element; and the
// regrouped checkpoints load and train on without a reset.
func TestRegroupKeepsTheErrorFeedback(t *testing.T) {
	for _, tc := range regroupCases() {
		t.Run(tc.name, func(t *testing.T) {
			four, _ := regroupRun(t, 4, tc.mk, nil, 1, 6)
			three := regroupAll(t, four, 3)
			back := regroupAll(t, three, 4)
			checked := 0
			for _, tn := range four[0].Tensors {
				if !optim.IsErrorBuffer(tn.Name) && !chunked(tn.Name) {
					continue
				}
				n := numelOf(t, four[0], tn.Name)
				checked++
				if chunked(tn.Name) {
					want := byElement(four, tn.Name, n)
					assert.Equal(t, want, byElement(three, tn.Name, n), "%s on 3 ranks", tn.Name)
					assert.Equal(t, want, byElement(back, tn.Name, n), "%s back on 4 ranks", tn.Name)
					continue
				}
				want := meanOf(four, tn.Name, n)
				for _, got := range [][]float64{meanOf(three, tn.Name, n), meanOf(back, tn.Name, n)} {
					for i := range want {
						require.InDelta(t, want[i], got[i], math.Abs(want[i])*0x1p-23+1e-30, "%s[%d]", tn.Name, i)
					}
				}
				for _, ck := range three {
					pad := ck.Tensor(tn.Name).Data[n:]
					assert.Equal(t, make([]float32, len(pad)), pad, "padding starts at zero")
				}
			}
			assert.Positive(t, checked)
			// The regrouped checkpoints load on 3 ranks and train on.
			cks, params := regroupRun(t, 3, tc.mk, three, 7, 3)
			assert.Equal(t, int64(9), cks[0].Ints[optim.IntStep])
			if !strings.HasPrefix(tc.name, "0/1") {
				assert.Equal(t, params[0], params[1])
				assert.Equal(t, params[0], params[2])
			}
		})
	}
}

// Regroup refuses what it cannot do, saying why.
func TestRegroupRefusals(t *testing.T) {
	mk := regroupCases()[0].mk
	two, _ := regroupRun(t, 2, mk, nil, 1, 4)
	other, _ := regroupRun(t, 2, mk, nil, 1, 3)
	one, _ := regroupRun(t, 1, mk, nil, 1, 3)
	exact, _ := regroupRun(t, 2, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewAdam(context.Background(), c, ps, optim.DefaultAdamConfig())
	}, nil, 1, 1)
	for _, tc := range []struct {
		name string
		old  []*optim.Checkpoint
		msg  string
	}{
		{"a rank missing", two[:1], "one rank"},
		{"out of order", []*optim.Checkpoint{two[1], two[0]}, "rank order"},
		{"steps differ", []*optim.Checkpoint{two[0], other[1]}, "not one run's"},
		{"errors reset", []*optim.Checkpoint{two[0].ResetErrors(), two[1]}, "reset already"},
		{"one rank", one, "one rank"},
		{"exact Adam", exact, "no error feedback"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := onebit.Regroup(tc.old, 3, 0)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.msg)
		})
	}
	_, err := onebit.Regroup(two, 3, 3)
	require.Error(t, err)
	_, err = onebit.Regroup(two, 2, 0)
	require.NoError(t, err, "the same group size is a copy")
	ck := two[0]
	ck.Tensors = append([]optim.Tensor(nil), ck.Tensors...)
	for i := range ck.Tensors {
		if optim.IsErrorBuffer(ck.Tensors[i].Name) {
			ck.Tensors[i].Data = ck.Tensors[i].Data[:1]
		}
	}
	_, err = onebit.Regroup([]*optim.Checkpoint{ck, two[1]}, 3, 0)
	require.Error(t, err)
	assert.True(t, errors.Is(err, optim.ErrIncompatibleCheckpoint))
}
