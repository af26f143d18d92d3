package quant_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/quant"
)

func runRanks(t *testing.T, w int, fn func(ctx context.Context, c comm.Comm) error) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return local.Run(ctx, w, fn)
}

// rscValue is element i of tensor k on rank r.
func rscValue(r, k, i int) float32 { return float32(r*1000+k*100+i) / 8 }

func TestCoalesced(t *testing.T) {
	sizes := []int{49, 1, 16, 15, 0, 3, 100}
	for _, w := range []int{1, 2, 3, 4, 7} {
		t.Run(fmt.Sprint(w), func(t *testing.T) {
			require.NoError(t, runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
				rs, err := quant.NewCoalesced(context.Background(), c, sizes)
				if err != nil {
					return err
				}
				r := c.Rank()
				inputs := make([][]float32, len(sizes))
				for k, n := range sizes {
					inputs[k] = make([]float32, n)
					for i := range inputs[k] {
						inputs[k][i] = rscValue(r, k, i)
					}
				}
				for call := 0; call < 2; call++ {
					outs, err := rs.ReduceScatter(ctx, inputs)
					if err != nil {
						return err
					}
					if len(outs) != len(sizes) {
						return fmt.Errorf("%d outputs", len(outs))
					}
					flat := rs.Flat()
					slot := 0
					for k, n := range sizes {
						c := (n + w - 1) / w
						lo, hi := rs.Owned(k)
						if wantLo := min(r*c, n); lo != wantLo || hi != min(wantLo+c, n) {
							return fmt.Errorf("tensor %d: owned [%d, %d)", k, lo, hi)
						}
						if len(outs[k]) != hi-lo {
							return fmt.Errorf("tensor %d: %d outputs for [%d, %d)", k, len(outs[k]), lo, hi)
						}
						if len(outs[k]) > 0 && &outs[k][0] != &flat[slot] {
							return fmt.Errorf("tensor %d: output is not a view into Flat", k)
						}
						for i, got := range outs[k] {
							var want float32
							for q := 0; q < w; q++ {
								want += rscValue(q, k, lo+i)
							}
							want /= float32(w)
							if d := got - want; d > 1e-3 || d < -1e-3 {
								return fmt.Errorf("tensor %d element %d: %g, want %g", k, lo+i, got, want)
							}
						}
						for i := hi - lo; i < c; i++ {
							if flat[slot+i] != 0 {
								return fmt.Errorf("tensor %d: pad %d is %g", k, i, flat[slot+i])
							}
						}
						slot += c
					}
					if slot != len(flat) {
						return fmt.Errorf("flat has %d elements, want %d", len(flat), slot)
					}
				}
				allocs := testing.AllocsPerRun(5, func() { _, _ = rs.ReduceScatter(ctx, inputs) })
				if w == 1 && allocs != 0 {
					return fmt.Errorf("%v allocations per call", allocs)
				}
				return nil
			}))
		})
	}
}

func TestCoalescedBadInput(t *testing.T) {
	every := func(t *testing.T, w int, want string, fn func(ctx context.Context, c comm.Comm) error) {
		checkNoLeak(t)
		errs := make([]error, w)
		_ = runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
			errs[c.Rank()] = fn(ctx, c)
			return nil
		})
		for r, err := range errs {
			require.ErrorContains(t, err, want, "rank %d", r)
		}
	}
	t.Run("tensor count", func(t *testing.T) {
		every(t, 3, "tensor count mismatch", func(ctx context.Context, c comm.Comm) error {
			sizes := []int{4, 5}
			if c.Rank() == 2 {
				sizes = append(sizes, 1)
			}
			_, err := quant.NewCoalesced(ctx, c, sizes)
			return err
		})
	})
	t.Run("shapes", func(t *testing.T) {
		every(t, 3, "rank 1 has tensor sizes that differ", func(ctx context.Context, c comm.Comm) error {
			sizes := []int{4, 5}
			if c.Rank() == 1 {
				sizes = []int{5, 4}
			}
			_, err := quant.NewCoalesced(ctx, c, sizes)
			return err
		})
	})
	t.Run("negative", func(t *testing.T) {
		every(t, 2, "negative size", func(ctx context.Context, c comm.Comm) error {
			_, err := quant.NewCoalesced(ctx, c, []int{4, -1 * c.Rank()})
			return err
		})
	})
	t.Run("call", func(t *testing.T) {
		every(t, 3, "tensor", func(ctx context.Context, c comm.Comm) error {
			rs, err := quant.NewCoalesced(ctx, c, []int{4, 5})
			if err != nil {
				return err
			}
			inputs := [][]float32{make([]float32, 4), make([]float32, 5)}
			if c.Rank() == 0 {
				inputs[1] = inputs[1][:3]
			}
			_, err = rs.ReduceScatter(ctx, inputs)
			if err == nil {
				return nil
			}
			inputs[1] = make([]float32, 5)
			if _, err2 := rs.ReduceScatter(ctx, inputs); err2 != nil {
				return fmt.Errorf("call after the bad one: %w", err2)
			}
			return err
		})
	})
	t.Run("nil", func(t *testing.T) {
		_, err := quant.NewCoalesced(context.Background(), nil, []int{1})
		require.ErrorContains(t, err, "quant: coalesced")
	})
}
