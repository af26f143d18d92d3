//go:build mpi

// The multi-process tests of package quant (scripts/test-mpi.sh): every
// rank of an mpirun job runs the same tests in the same order, on the
// node-major layout of -ranks-per-node ranks per node (default 2 when the
// world size is even, else 1), so that one machine can stand in for 2x2
// and 3x2 layouts. Each collective must return, bit for bit, what the
// in-process backend returns for the same inputs on the same layout, and
// bad calls must be an error on every rank. Run only these tests with
// -test.run MPI: the others do not need MPI and would run once per rank.

package quant_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/comm/mpi"
	"github.com/lowbit-ml/lowbit/internal/conformance"
	"github.com/lowbit-ml/lowbit/quant"
)

var mpiRanksPerNode = flag.Int("ranks-per-node", 0, "ranks per node of the MPI tests' layout (0: 2 when the world size is even, else 1)")

// mpiWorld is the MPI job's communicator, opened by TestMain.
var mpiWorld comm.Comm

func TestMain(m *testing.M) {
	var err error
	if mpiWorld, err = mpi.Open(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	code := m.Run()
	if err := mpiWorld.Close(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	os.Exit(code)
}

// mpiCtx bounds a test: a hang becomes comm/mpi's watchdog abort, not a
// stuck job.
func mpiCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// mpiRPN is the ranks per node of the tests' layout.
func mpiRPN() int {
	if *mpiRanksPerNode > 0 {
		return *mpiRanksPerNode
	}
	if mpiWorld.Size()%2 == 0 {
		return 2
	}
	return 1
}

// mpiLayout lays the MPI world out node-major.
func mpiLayout(t *testing.T, ctx context.Context) *comm.Layout {
	l, err := comm.NewLayout(ctx, mpiWorld, mpiRPN())
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, l.Close()) })
	t.Logf("rank %d of %v", mpiWorld.Rank(), l)
	return l
}

// mpiInput is rank r's deterministic input of n normal values for call k.
func mpiInput(r, k, n int) []float32 {
	g := rand.New(rand.NewPCG(uint64(r), uint64(1000+k)))
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(g.NormFloat64())
	}
	return x
}

// onLocal runs fn on in-process ranks laid out like the MPI world and
// returns what each rank's fn returned.
func onLocal(t *testing.T, fn func(ctx context.Context, l *comm.Layout) ([]float32, error)) [][]float32 {
	w := mpiWorld.Size()
	outs := make([][]float32, w)
	err := local.Run(mpiCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		l, err := comm.NewLayout(ctx, c, mpiRPN())
		if err != nil {
			return err
		}
		out, err := fn(ctx, l)
		outs[c.Rank()] = out
		return errors.Join(err, l.Close())
	}, local.AllowUnderMPI()) // under mpirun on purpose: the reference
	require.NoError(t, err)
	return outs
}

// requireBits requires got and want to be equal bit for bit (NaN too).
func requireBits(t *testing.T, want, got []float32, what string) {
	t.Helper()
	require.Len(t, got, len(want), what)
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			require.Failf(t, "not bit-identical to the in-process backend",
				"%s: rank %d, element %d: got %g, want %g", what, mpiWorld.Rank(), i, got[i], want[i])
		}
	}
}

// qgzCall runs three qgZ reductions of n elements (inputs differ per call)
// on l and returns the outputs of all three, concatenated.
func qgzCall(ctx context.Context, l *comm.Layout, n int, cfg quant.QGZConfig) ([]float32, error) {
	q, err := quant.NewQGZ(ctx, l, n, cfg)
	if err != nil {
		return nil, err
	}
	var out []float32
	recv := make([]float32, q.PartLen())
	for k := 0; k < 3; k++ {
		if err := q.ReduceScatter(ctx, mpiInput(l.World.Rank(), k, n), recv); err != nil {
			return nil, err
		}
		out = append(out, recv...)
	}
	return out, nil
}

// TestMPIQGZMatchesLocal: the qgZ reduce-scatter under MPI returns what
// the in-process backend returns, bit for bit, for int4 and int8, group
// sizes that do and do not divide the partition, tensor lengths that need
// padding, with and without error feedback.
func TestMPIQGZMatchesLocal(t *testing.T) {
	ctx := mpiCtx(t)
	l := mpiLayout(t, ctx)
	w := mpiWorld.Size()
	for _, bits := range []int{4, 8} {
		for _, g := range []int{32, 100} {
			for _, n := range []int{w * 640, w*640 + 3} {
				for _, ef := range []bool{false, true} {
					cfg := quant.QGZConfig{Bits: bits, GroupSize: g, ErrorFeedback: ef}
					name := fmt.Sprintf("int%d g%d n%d ef=%v", bits, g, n, ef)
					got, err := qgzCall(ctx, l, n, cfg)
					require.NoError(t, err, name)
					want := onLocal(t, func(ctx context.Context, l *comm.Layout) ([]float32, error) {
						return qgzCall(ctx, l, n, cfg)
					})
					requireBits(t, want[mpiWorld.Rank()], got, name)
				}
			}
		}
	}
}

// TestMPIQGZMean: the result is the mean over all ranks (the true mean,
// not ranks-per-node times it), within the quantization error.
func TestMPIQGZMean(t *testing.T) {
	ctx := mpiCtx(t)
	l := mpiLayout(t, ctx)
	w, rank := mpiWorld.Size(), mpiWorld.Rank()
	const n = 1 << 14
	for _, c := range []struct {
		bits int
		tol  float64
	}{{4, 0.3}, {8, 0.02}} {
		q, err := quant.NewQGZ(ctx, l, n, quant.QGZConfig{Bits: c.bits, GroupSize: 256})
		require.NoError(t, err)
		recv := make([]float32, q.PartLen())
		require.NoError(t, q.ReduceScatter(ctx, mpiInput(rank, 0, n), recv))
		mean := make([]float64, n)
		for r := 0; r < w; r++ {
			for i, v := range mpiInput(r, 0, n) {
				mean[i] += float64(v) / float64(w)
			}
		}
		var e, ref float64
		for i, v := range recv {
			if rank*q.PartLen()+i >= n {
				require.Zero(t, v, "the pad comes back as zeros")
				continue
			}
			x := mean[rank*q.PartLen()+i]
			e += (float64(v) - x) * (float64(v) - x)
			ref += x * x
		}
		rel := math.Sqrt(e / ref)
		t.Logf("int%d: relative error %.3g on rank %d", c.bits, rel, rank)
		require.Less(t, rel, c.tol, "int%d", c.bits)
	}
}

// TestMPIQGZBadInput: lengths that differ across ranks, a bad length on
// one rank and configurations that differ are errors on every rank.
func TestMPIQGZBadInput(t *testing.T) {
	if mpiWorld.Size() < 2 {
		t.Skip("needs at least 2 ranks")
	}
	ctx := mpiCtx(t)
	l := mpiLayout(t, ctx)
	last := mpiWorld.Rank() == mpiWorld.Size()-1

	bits := 8
	if last {
		bits = 4
	}
	_, err := quant.NewQGZ(ctx, l, 1000, quant.QGZConfig{Bits: bits})
	require.ErrorContains(t, err, "qgz bits")

	_, err = quant.NewQGZ(ctx, l, 1000, quant.QGZConfig{Bits: 8, GroupSize: -1 - mpiWorld.Rank()%2})
	require.ErrorContains(t, err, "QGZConfig.GroupSize")

	q, err := quant.NewQGZ(ctx, l, 1000, quant.QGZConfig{Bits: 4})
	require.NoError(t, err)
	send := make([]float32, 1000)
	if last {
		send = send[:999]
	}
	err = q.ReduceScatter(ctx, send, make([]float32, q.PartLen()))
	require.ErrorContains(t, err, fmt.Sprintf("rank %d called ReduceScatter with len(send) 999", mpiWorld.Size()-1))
	// The QGZ stays usable.
	require.NoError(t, q.ReduceScatter(ctx, make([]float32, 1000), make([]float32, q.PartLen())))
}

// TestMPIConformance runs the qgz and rsc vectors on sub-communicators of
// the MPI world of their world size (and, for qgz, their layout): the
// 2-rank rsc vector on every pair of ranks, the 2x2 qgz vector on the
// first four ranks, and so on. Vectors larger than the world are skipped.
func TestMPIConformance(t *testing.T) {
	cases, err := conformance.Load(conformance.Dir())
	require.NoError(t, err)
	ctx := mpiCtx(t)
	w, rank := mpiWorld.Size(), mpiWorld.Rank()
	ran := 0
	for _, c := range cases {
		if c.Kind != "qgz" && c.Kind != "rsc" {
			continue
		}
		cw := c.WorldSize()
		require.Positive(t, cw, c.Name)
		if cw > w {
			t.Logf("%s %s: needs %d ranks, the world has %d", c.Kind, c.Name, cw, w)
			continue
		}
		color := rank / cw
		if color >= w/cw {
			color = -1 // an incomplete group sits out
		}
		sub, err := mpiWorld.Split(ctx, color, rank)
		require.NoError(t, err, c.Name)
		if sub == nil {
			continue
		}
		switch c.Kind {
		case "rsc":
			err = conformance.RunRSCRank(ctx, sub, c)
		case "qgz":
			q, qerr := c.QGZ()
			require.NoError(t, qerr)
			var l *comm.Layout
			if l, err = comm.NewLayout(ctx, sub, q.RanksPerNode); err == nil {
				err = errors.Join(conformance.RunQGZRank(ctx, l, c), l.Close())
			}
		}
		require.NoError(t, err, "%s %s on ranks [%d, %d)", c.Kind, c.Name, color*cw, (color+1)*cw)
		require.NoError(t, sub.Close())
		ran++
	}
	t.Logf("rank %d: %d qgz and rsc vectors passed", rank, ran)
}
