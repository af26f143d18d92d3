package optim

import (
	"context"
	"math"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

func TestFinite(t *testing.T) {
	assert.True(t, Finite(nil))
	assert.True(t, Finite([]float32{0, -0, 1, -math.MaxFloat32, math.SmallestNonzeroFloat32}))
	for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1)), float32(math.Inf(-1))} {
		for n := 1; n <= 9; n++ {
			for pos := 0; pos < n; pos++ {
				x := make([]float32, n)
				x[pos] = bad
				assert.False(t, Finite(x), "%v at %d of %d", bad, pos, n)
			}
		}
	}
}

func TestAllFiniteAgreesAcrossRanks(t *testing.T) {
	ps := testParams(t, 1, []int{3})
	ok, err := AllFinite(context.Background(), nil, ps)
	require.NoError(t, err)
	assert.True(t, ok)
	ps[0].GradData()[2] = float32(math.Inf(-1))
	ok, err = AllFinite(context.Background(), nil, ps)
	require.NoError(t, err)
	assert.False(t, ok)

	for _, badRank := range []int{-1, 0, 3} {
		var mu sync.Mutex
		var answers []bool
		err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
			ps := testParams(t, 1, []int{5}, []int{2})
			if c.Rank() == badRank {
				ps[1].GradData()[1] = float32(math.NaN())
			}
			ok, err := AllFinite(ctx, c, ps)
			mu.Lock()
			answers = append(answers, ok)
			mu.Unlock()
			return err
		})
		require.NoError(t, err)
		assert.Equal(t, []bool{badRank < 0, badRank < 0, badRank < 0, badRank < 0}, answers, "bad rank %d", badRank)
	}
}

func TestAverageGrads(t *testing.T) {
	ps := testParams(t, 1, []int{3})
	copy(ps[0].GradData(), []float32{1, 2, 3})
	require.NoError(t, AverageGrads(context.Background(), nil, ps))
	assert.Equal(t, []float32{1, 2, 3}, ps[0].GradData())
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 1, []int{3})
		copy(ps[0].GradData(), []float32{1, 2, 3})
		if c.Rank() == 1 {
			copy(ps[0].GradData(), []float32{3, 4, -3})
		}
		if err := AverageGrads(ctx, c, ps); err != nil {
			return err
		}
		assert.Equal(t, []float32{2, 3, 0}, ps[0].GradData())
		return nil
	})
	require.NoError(t, err)
}

// A nil parameter on one rank is an error on every rank, never a silent
// pairing of one rank's gradient with another's neighbour: here rank 1's
// list is shifted by one, and the gradients have equal lengths.
func TestAverageGradsNilParam(t *testing.T) {
	errs := make([]error, 2)
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		ps := testParams(t, 1, []int{3}, []int{3})
		if c.Rank() == 1 {
			ps = []*Param{nil, ps[0], ps[1]}
		} else {
			ps = append(ps, nil)
		}
		errs[c.Rank()] = AverageGrads(ctx, c, ps)
		return nil
	})
	require.NoError(t, err)
	for r, e := range errs {
		var mm *comm.MismatchError
		assert.ErrorAs(t, e, &mm, "rank %d", r)
	}
	assert.ErrorContains(t, errs[1], "nil on this rank")
}

// One rank's NaN gradient makes every rank skip that step and change
// nothing; training then continues and stays identical across ranks.
func TestExactOptimizersSkipNonFiniteSteps(t *testing.T) {
	const w, steps, bad = 4, 6, 3
	for _, alg := range []string{AlgorithmAdam, AlgorithmLamb} {
		t.Run(alg, func(t *testing.T) {
			var mu sync.Mutex
			final := make([][][]float32, w)
			err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
				ps := testParams(t, 5, []int{8}, []int{3, 3})
				var opt Optimizer
				var err error
				if alg == AlgorithmAdam {
					opt, err = NewAdam(ctx, c, ps, DefaultAdamConfig())
				} else {
					opt, err = NewLamb(ctx, c, ps, DefaultLambConfig())
				}
				if err != nil {
					return err
				}
				for s := 1; s <= steps; s++ {
					fillGrads(ps, c.Rank(), s)
					if s == bad && c.Rank() == 2 {
						ps[1].GradData()[4] = float32(math.NaN())
					}
					before, err := opt.State()
					if err != nil {
						return err
					}
					if err := opt.Step(ctx); err != nil {
						return err
					}
					if s == bad {
						after, err := opt.State()
						if err != nil {
							return err
						}
						before.Ints[IntSteps]++
						before.Ints[IntSkipped]++
						assert.Equal(t, before, after, "rank %d: the skipped step changed the state", c.Rank())
					}
				}
				st := opt.Stats()
				assert.Equal(t, int64(1), st.Skipped, "rank %d", c.Rank())
				assert.Equal(t, int64(steps), st.Steps, "rank %d", c.Rank())
				mu.Lock()
				final[c.Rank()] = snapshot(ps)
				mu.Unlock()
				return nil
			})
			require.NoError(t, err)
			for r := range final {
				for i := range final[r] {
					assert.True(t, Finite(final[r][i]))
					assert.Equal(t, bits(final[0][i]), bits(final[r][i]))
				}
			}
		})
	}
}
