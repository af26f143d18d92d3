//go:build mpi

// The down-cast and two-level allreduces under mpirun (see
// qgz_mpi_test.go for the set-up).

package quant_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/quant"
)

// downCastCall runs two down-cast allreduces of n elements on c and
// returns both results, concatenated. Rank 0's input carries NaN, +Inf
// and a value beyond fp16's range.
func downCastCall(ctx context.Context, c comm.Comm, f quant.Format, n int) ([]float32, error) {
	d := quant.NewDownCast(f)
	var out []float32
	for k := 0; k < 2; k++ {
		buf := mpiInput(c.Rank(), k, n)
		if c.Rank() == 0 && n >= 3 {
			buf[0], buf[1], buf[2] = float32(math.NaN()), float32(math.Inf(1)), 1e6
		}
		if err := d.AllReduce(ctx, c, buf); err != nil {
			return nil, err
		}
		out = append(out, buf...)
	}
	return out, nil
}

// TestMPIDownCastMatchesLocal: the fp16 and bf16 allreduces under MPI
// return what the in-process backend returns, bit for bit (NaN and Inf
// included), and lengths that differ across ranks are an error on every
// rank.
func TestMPIDownCastMatchesLocal(t *testing.T) {
	ctx := mpiCtx(t)
	w := mpiWorld.Size()
	for _, f := range []quant.Format{quant.FP16, quant.BF16} {
		for _, n := range []int{1, 7 * w, 10007} {
			name := fmt.Sprintf("%v n=%d", f, n)
			got, err := downCastCall(ctx, mpiWorld, f, n)
			require.NoError(t, err, name)
			want := onLocal(t, func(ctx context.Context, l *comm.Layout) ([]float32, error) {
				return downCastCall(ctx, l.World, f, n)
			})
			requireBits(t, want[mpiWorld.Rank()], got, name)
			if n >= 3 {
				require.True(t, math.IsNaN(float64(got[0])), name)
				require.True(t, math.IsInf(float64(got[1]), 1), name)
			}
		}
	}
	if w < 2 {
		return
	}
	n := 10
	if mpiWorld.Rank() == w-1 {
		n = 9
	}
	err := quant.NewDownCast(quant.FP16).AllReduce(ctx, mpiWorld, make([]float32, n))
	var me *comm.MismatchError
	require.True(t, errors.As(err, &me), "%v", err)
}

// twoLevelCall runs a two-level allreduce of n elements (in pieces, when
// pieces > 0) and a two-level reduce-scatter of W*k elements on l and
// returns both results, concatenated.
func twoLevelCall(ctx context.Context, l *comm.Layout, n, k, pieces int) ([]float32, error) {
	tl, err := quant.NewTwoLevel(l)
	if err != nil {
		return nil, err
	}
	quant.SetTwoLevelPieces(tl, pieces)
	buf := mpiInput(l.World.Rank(), 0, n)
	if err := tl.AllReduce(ctx, buf); err != nil {
		return nil, err
	}
	recv := make([]float32, k)
	if err := tl.ReduceScatter(ctx, mpiInput(l.World.Rank(), 1, l.World.Size()*k), recv); err != nil {
		return nil, err
	}
	return append(buf, recv...), nil
}

// TestMPITwoLevelMatchesLocal: the two-level allreduce and reduce-scatter
// under MPI return what the in-process backend returns on the same layout,
// bit for bit, and are within 1e-6 relative of MPI's exact allreduce; so
// does the pipelined allreduce (node and rail collectives overlapping on
// two goroutines), against the unpipelined one on the in-process backend.
func TestMPITwoLevelMatchesLocal(t *testing.T) {
	ctx := mpiCtx(t)
	l := mpiLayout(t, ctx)
	w := mpiWorld.Size()
	for _, c := range []struct{ n, pieces int }{{1, 0}, {7 * w, 0}, {10007, 0}, {10007, 3}, {40000, 8}} {
		n := c.n
		const k = 333
		name := fmt.Sprintf("%v n=%d pieces=%d", l, n, c.pieces)
		got, err := twoLevelCall(ctx, l, n, k, c.pieces)
		require.NoError(t, err, name)
		want := onLocal(t, func(ctx context.Context, l *comm.Layout) ([]float32, error) {
			return twoLevelCall(ctx, l, n, k, 0)
		})
		requireBits(t, want[mpiWorld.Rank()], got, name)

		exact := mpiInput(mpiWorld.Rank(), 0, n)
		require.NoError(t, mpiWorld.AllReduce(ctx, exact, comm.Mean), name)
		var e, r float64
		for i, x := range exact {
			d := float64(got[i]) - float64(x)
			e += d * d
			r += float64(x) * float64(x)
		}
		require.LessOrEqual(t, math.Sqrt(e/r), 1e-6, "%s: against MPI's allreduce", name)
	}
	// A length that differs on one rank is an error on every rank.
	tl, err := quant.NewTwoLevel(l)
	require.NoError(t, err)
	n := 12
	if mpiWorld.Rank() == w-1 && w > 1 {
		n = 13
	}
	err = tl.AllReduce(ctx, make([]float32, n))
	if w > 1 {
		require.ErrorContains(t, err, "two-level tensor length mismatch")
	} else {
		require.NoError(t, err)
	}
}
