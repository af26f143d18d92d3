//go:build mpi

// These tests run under mpirun (scripts/test-mpi.sh): every rank runs the
// same tests in the same order. They pass at any number of ranks and skip
// what needs more than one.

package mpi_test

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/comm/mpi"
	"github.com/lowbit-ml/lowbit/internal/conformance"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// world and ordered are opened once by TestMain: the default communicator
// and one WithOrderedReduce.
var world, ordered comm.Comm

func TestMain(m *testing.M) {
	if s := os.Getenv(scenarioEnv); s != "" {
		os.Exit(runScenario(s))
	}
	var err error
	if world, err = mpi.Open(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if ordered, err = mpi.Open(mpi.WithOrderedReduce()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	code := m.Run()
	if err := errors.Join(ordered.Close(), world.Close()); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	os.Exit(code)
}

// testCtx bounds a test: a hang becomes a watchdog abort, not a stuck job.
func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func needRanks(t *testing.T, n int) {
	if world.Size() < n {
		t.Skipf("needs at least %d ranks, the MPI job has %d", n, world.Size())
	}
}

// modes are the two reduction modes under test.
func modes() []struct {
	name string
	c    comm.Comm
} {
	return []struct {
		name string
		c    comm.Comm
	}{{"native", world}, {"ordered", ordered}}
}

// small is rank r's integer-valued input i: sums of them are exact in
// float32 in any order, so expected values are exact too.
func small(r, i int) float32 { return float32((r*7+i*3)%11 - 5) }

// expected reduces small over w ranks for element i.
func expected(w, i int, op comm.Op) float32 {
	acc := small(0, i)
	for r := 1; r < w; r++ {
		if op == comm.Max {
			acc = max(acc, small(r, i))
		} else {
			acc += small(r, i)
		}
	}
	if op == comm.Mean {
		acc /= float32(w)
	}
	return acc
}

func TestRankSize(t *testing.T) {
	require.GreaterOrEqual(t, world.Size(), 1)
	require.GreaterOrEqual(t, world.Rank(), 0)
	require.Less(t, world.Rank(), world.Size())
	assert.Equal(t, world.Size(), ordered.Size())
	assert.Equal(t, world.Rank(), ordered.Rank())
	assert.True(t, mpi.Built)
}

func TestAllReduce(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	for _, m := range modes() {
		for _, op := range []comm.Op{comm.Sum, comm.Mean, comm.Max} {
			for _, n := range []int{0, 1, 5, 64, 1001, 4099} {
				buf := make([]float32, n)
				for i := range buf {
					buf[i] = small(r, i)
				}
				require.NoError(t, m.c.AllReduce(ctx, buf, op), "%s %v n=%d", m.name, op, n)
				for i, v := range buf {
					require.Equal(t, expected(w, i, op), v, "%s %v n=%d element %d", m.name, op, n, i)
				}
			}
		}
	}
}

func TestReduceScatter(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	for _, m := range modes() {
		for _, op := range []comm.Op{comm.Sum, comm.Mean, comm.Max} {
			for _, k := range []int{0, 1, 7, 300} {
				send := make([]float32, w*k)
				for i := range send {
					send[i] = small(r, i)
				}
				recv := make([]float32, k)
				require.NoError(t, m.c.ReduceScatter(ctx, send, recv, op), "%s %v k=%d", m.name, op, k)
				for i, v := range recv {
					require.Equal(t, expected(w, r*k+i, op), v, "%s %v k=%d element %d", m.name, op, k, i)
				}
			}
		}
	}
}

// Mean is Sum followed by the division by W, bit for bit as Go (and
// comm/local) divides: the C layer's vectorized division, fused into the
// reduction's call, must round every element, tails of 1 to 3 elements
// past its vectors included, as a scalar float32 division does. Inputs
// with fractions, and some tiny ones, whose quotients round.
func TestMeanDividesLikeGo(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	rng := rand.New(rand.NewPCG(7, uint64(r)))
	input := func(n int) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64())
			if i%7 == 3 {
				x[i] *= 1e-38 // sums near the subnormal range
			}
		}
		return x
	}
	for _, n := range []int{1, 3, 4, 5, 8, 9, 1001, 4099} {
		x := input(n)
		sum, mean := slices.Clone(x), slices.Clone(x)
		require.NoError(t, world.AllReduce(ctx, sum, comm.Sum))
		require.NoError(t, world.AllReduce(ctx, mean, comm.Mean))
		for i := range sum {
			require.Equal(t, math.Float32bits(sum[i]/float32(w)), math.Float32bits(mean[i]), "allreduce n=%d element %d", n, i)
		}

		send := input(w * n)
		rsum, rmean := make([]float32, n), make([]float32, n)
		require.NoError(t, world.ReduceScatter(ctx, send, rsum, comm.Sum))
		require.NoError(t, world.ReduceScatter(ctx, send, rmean, comm.Mean))
		for i := range rsum {
			require.Equal(t, math.Float32bits(rsum[i]/float32(w)), math.Float32bits(rmean[i]), "reducescatter n=%d element %d", n, i)
		}
	}
}

// All-gathers of up to 16 bytes per rank ride in the argument agreement;
// the lengths cover both sides of that limit, in both variants.
func TestAllGather(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	for _, n := range []int{0, 1, 3, 4, 5, 13, 16, 17, 40} {
		send := make([]float32, n)
		bsend := make([]byte, n)
		for i := range send {
			send[i] = small(r, i)
			bsend[i] = byte(r*31 + i)
		}
		recv := make([]float32, w*n)
		brecv := make([]byte, w*n)
		require.NoError(t, world.AllGather(ctx, send, recv))
		require.NoError(t, world.AllGatherBytes(ctx, bsend, brecv))
		for j := range w {
			for i := range n {
				require.Equal(t, small(j, i), recv[j*n+i])
				require.Equal(t, byte(j*31+i), brecv[j*n+i])
			}
		}
	}
}

func TestAllToAll(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	// Element i of rank j's chunk for rank r encodes (j, r, i).
	val := func(from, to, i int) int { return from*1000 + to*100 + i }
	for _, k := range []int{0, 1, 9} {
		send := make([]float32, w*k)
		bsend := make([]byte, w*k)
		for to := range w {
			for i := range k {
				send[to*k+i] = float32(val(r, to, i))
				bsend[to*k+i] = byte(val(r, to, i))
			}
		}
		recv := make([]float32, w*k)
		brecv := make([]byte, w*k)
		require.NoError(t, world.AllToAll(ctx, send, recv))
		require.NoError(t, world.AllToAllBytes(ctx, bsend, brecv))
		for from := range w {
			for i := range k {
				require.Equal(t, float32(val(from, r, i)), recv[from*k+i])
				require.Equal(t, byte(val(from, r, i)), brecv[from*k+i])
			}
		}
	}
}

// The started collectives move what the blocking ones move, progressed by
// Test while the caller works; while one is in flight the communicator
// refuses every other call, Close included, and after it is done it works
// again; the traffic is counted once it is done.
// Test on a started collective polls without Open MPI's yield of the core
// (the caller works between its tests) and leaves the setting as it found
// it, so that waits still yield where mpirun set mpi_yield_when_idle.
func TestStartedTestKeepsYield(t *testing.T) {
	ctx := testCtx(t)
	prev := mpi.SetYield(true)
	if prev < 0 {
		t.Skip("this MPI has no opal_progress_set_yield_when_idle")
	}
	defer mpi.SetYield(prev == 1)
	s := world.(comm.Starter)
	for _, on := range []bool{true, false} {
		mpi.SetYield(on)
		send, recv := make([]byte, 1<<16), make([]byte, world.Size()<<16)
		req, err := s.StartAllGatherBytes(ctx, send, recv)
		require.NoError(t, err)
		for done := false; !done; {
			done, err = req.Test()
			require.NoError(t, err)
		}
		require.NoError(t, req.Wait())
		want := 0
		if on {
			want = 1
		}
		assert.Equal(t, want, mpi.SetYield(on), "yield %v after Test", on)
	}
}

func TestStarted(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	s, ok := world.(comm.Starter)
	require.True(t, ok, "comm/mpi is a comm.Starter")
	val := func(from, to, i int) byte { return byte(from*31 + to*7 + i) }
	for _, k := range []int{0, 1, 9, 300_000} {
		send, recv := make([]byte, w*k), make([]byte, w*k)
		for to := range w {
			for i := range k {
				send[to*k+i] = val(r, to, i)
			}
		}
		before := world.Stats()
		req, err := s.StartAllToAllBytes(ctx, send, recv)
		require.NoError(t, err, "k=%d", k)
		if k > 0 {
			err := world.Barrier(ctx)
			require.ErrorContains(t, err, "in flight", "k=%d", k)
			assert.ErrorContains(t, world.Close(), "in flight", "k=%d", k)
		}
		for {
			done, err := req.Test()
			require.NoError(t, err)
			if done {
				break
			}
		}
		done, err := req.Test()
		assert.True(t, done)
		assert.NoError(t, err)
		assert.NoError(t, req.Wait())
		for from := range w {
			for i := range k {
				require.Equal(t, val(from, r, i), recv[from*k+i], "k=%d from %d", k, from)
			}
		}
		got := world.Stats().Sub(before).PerCollective[comm.CAllToAll]
		assert.Equal(t, comm.Traffic{Calls: 1, BytesSent: int64(k * (w - 1)), BytesRecv: int64(k * (w - 1))}, got, "k=%d", k)

		gsend, grecv := send[:k], make([]byte, w*k)
		req, err = s.StartAllGatherBytes(ctx, gsend, grecv)
		require.NoError(t, err, "k=%d", k)
		require.NoError(t, req.Wait(), "k=%d", k)
		for j := range w {
			for i := range k {
				require.Equal(t, val(j, 0, i), grecv[j*k+i], "k=%d rank %d", k, j)
			}
		}
		require.NoError(t, world.Barrier(ctx), "k=%d: usable again", k)
	}
}

// Several started collectives travel at once and end in any order: each
// moves its own data; the communicator takes blocking calls again once all
// are done.
func TestStartedInFlight(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	s := world.(comm.Starter)
	const n, k = 6, 40_000
	sends, recvs := make([][]byte, n), make([][]byte, n)
	reqs := make([]comm.Request, n)
	// Some with contexts of their own, which the watchdog adds to the
	// first one's guard; ending them once the collectives are done must
	// not abort the job.
	var cancels []context.CancelFunc
	for i := range n {
		cctx := ctx
		if i%3 == 1 {
			var cancel context.CancelFunc
			cctx, cancel = context.WithCancel(ctx)
			cancels = append(cancels, cancel)
		}
		if i%2 == 0 {
			sends[i], recvs[i] = make([]byte, w*k), make([]byte, w*k)
			for j := range sends[i] {
				sends[i][j] = byte(i*13 + r*5 + j)
			}
			var err error
			reqs[i], err = s.StartAllToAllBytes(cctx, sends[i], recvs[i])
			require.NoError(t, err)
		} else {
			sends[i], recvs[i] = make([]byte, k), make([]byte, w*k)
			for j := range sends[i] {
				sends[i][j] = byte(i*13 + r*5 + j)
			}
			var err error
			reqs[i], err = s.StartAllGatherBytes(cctx, sends[i], recvs[i])
			require.NoError(t, err)
		}
	}
	require.ErrorContains(t, world.Barrier(ctx), "in flight")
	for i := n - 1; i >= 0; i-- { // the last first
		require.NoError(t, reqs[i].Wait(), "collective %d", i)
	}
	for i := range n {
		for from := range w {
			for j := range k {
				want := byte(i*13 + from*5 + r*k + j) // all-to-all: chunk r of rank from's send
				if i%2 == 1 {
					want = byte(i*13 + from*5 + j) // all-gather: rank from's send
				}
				require.Equal(t, want, recvs[i][from*k+j], "collective %d from rank %d byte %d", i, from, j)
			}
		}
	}
	for _, cancel := range cancels {
		cancel()
	}
	time.Sleep(10 * time.Millisecond) // time for a guard that outlived them to abort
	require.NoError(t, world.Barrier(ctx))
}

// A tiny all-gather started rides in the agreement alone: it travels
// while the caller works and matches the blocking one on other ranks (the
// same exchange); while it is in flight every other call is refused; a
// length that differs is a mismatch on every rank, from Wait where it was
// started, and the communicator stays usable.
func TestStartedTiny(t *testing.T) {
	needRanks(t, 2)
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	s := world.(comm.Starter)
	send, recv := []byte{byte(r), 7, byte(3 * r)}, make([]byte, 3*w)
	before := world.Stats()
	if r == 1 {
		require.NoError(t, world.AllGatherBytes(ctx, send, recv))
	} else {
		req, err := s.StartAllGatherBytes(ctx, send, recv)
		require.NoError(t, err)
		require.ErrorContains(t, world.Barrier(ctx), "in flight")
		_, err = s.StartAllToAllBytes(ctx, make([]byte, w), make([]byte, w))
		require.ErrorContains(t, err, "in flight")
		for done := false; !done; {
			done, err = req.Test()
			require.NoError(t, err)
		}
		require.NoError(t, req.Wait())
	}
	for j := range w {
		assert.Equal(t, []byte{byte(j), 7, byte(3 * j)}, recv[3*j:3*j+3], "rank %d", j)
	}
	got := world.Stats().Sub(before).PerCollective[comm.CAllGather]
	assert.Equal(t, comm.Traffic{Calls: 1, BytesSent: int64(3 * (w - 1)), BytesRecv: int64(3 * (w - 1))}, got)

	k := 4
	if r == 1 {
		k = 5
	}
	req, err := s.StartAllGatherBytes(ctx, make([]byte, k), make([]byte, k*w))
	require.NoError(t, err)
	var me *comm.MismatchError
	require.ErrorAs(t, req.Wait(), &me)
	require.ErrorAs(t, req.Wait(), &me, "again")
	require.NoError(t, world.Barrier(ctx), "usable after the mismatch")
}

// A rank that calls the blocking variant where the others start it is a
// mismatch on every rank, not a hang.
func TestStartedAgainstBlocking(t *testing.T) {
	needRanks(t, 2)
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	send, recv := make([]byte, w*8), make([]byte, w*8)
	var err error
	if r == 1 {
		err = world.AllToAllBytes(ctx, send, recv)
	} else {
		_, err = world.(comm.Starter).StartAllToAllBytes(ctx, send, recv)
	}
	var me *comm.MismatchError
	require.ErrorAs(t, err, &me)
	assert.Contains(t, err.Error(), "blocking")
	assert.Contains(t, err.Error(), "started")
	require.NoError(t, world.Barrier(ctx))
}

// A started collective whose lengths differ across ranks is an error on
// every rank, as the blocking one is, and bad local arguments are refused
// before anything starts.
func TestStartedMismatch(t *testing.T) {
	needRanks(t, 2)
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	s := world.(comm.Starter)
	k := 4
	if r == 1 {
		k = 5
	}
	_, err := s.StartAllToAllBytes(ctx, make([]byte, w*k), make([]byte, w*k))
	var me *comm.MismatchError
	require.ErrorAs(t, err, &me)
	_, err = s.StartAllGatherBytes(ctx, make([]byte, 3), make([]byte, 3*w+1))
	require.ErrorContains(t, err, "receive length")
	require.NoError(t, world.Barrier(ctx))
}

func TestBroadcast(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	for root := range w {
		for _, n := range []int{0, 1, 100} {
			buf := make([]float32, n)
			bbuf := make([]byte, n)
			for i := range buf {
				buf[i] = small(r, i)
				bbuf[i] = byte(r + i)
			}
			require.NoError(t, world.Broadcast(ctx, buf, root))
			require.NoError(t, world.BroadcastBytes(ctx, bbuf, root))
			for i := range n {
				require.Equal(t, small(root, i), buf[i])
				require.Equal(t, byte(root+i), bbuf[i])
			}
		}
	}
}

func TestBarrier(t *testing.T) {
	ctx := testCtx(t)
	before := world.Stats()
	for range 5 {
		require.NoError(t, world.Barrier(ctx))
	}
	assert.Equal(t, int64(5), world.Stats().Sub(before).PerCollective[comm.CBarrier].Calls)
}

func TestSplit(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()

	// Color by parity, key reversing the order: the new group of a parity
	// is its old ranks in descending order.
	sub, err := world.Split(ctx, r%2, -r)
	require.NoError(t, err)
	require.NotNil(t, sub)
	var members []int
	for j := w - 1; j >= 0; j-- {
		if j%2 == r%2 {
			members = append(members, j)
		}
	}
	require.Equal(t, len(members), sub.Size())
	require.Equal(t, members[sub.Rank()], r)

	got := make([]float32, sub.Size())
	require.NoError(t, sub.AllGather(ctx, []float32{float32(r)}, got))
	for i, m := range members {
		assert.Equal(t, float32(m), got[i], "member %d", i)
	}
	sum := []float32{float32(r)}
	require.NoError(t, sub.AllReduce(ctx, sum, comm.Sum))
	want := 0
	for _, m := range members {
		want += m
	}
	assert.Equal(t, float32(want), sum[0])
	require.NoError(t, sub.Close())
	assert.ErrorIs(t, sub.AllReduce(ctx, sum, comm.Sum), comm.ErrClosed)

	// A negative color joins no group.
	color := 0
	if r == 0 {
		color = -1
	}
	rest, err := world.Split(ctx, color, 0)
	require.NoError(t, err)
	if r == 0 {
		require.Nil(t, rest)
		return
	}
	require.NotNil(t, rest)
	assert.Equal(t, w-1, rest.Size())
	assert.Equal(t, r-1, rest.Rank())
	require.NoError(t, rest.Barrier(ctx))
	require.NoError(t, rest.Close())
}

// TestLayout lays the job out by node: explicitly (2 ranks per node where
// the size allows) and as MPI_COMM_TYPE_SHARED sees it (every rank of this
// job shares one machine), and checks who is in each sub-communicator.
func TestLayout(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	check := func(l *comm.Layout, nodes, rpn int) {
		t.Helper()
		require.Equal(t, nodes, l.Nodes)
		require.Equal(t, rpn, l.RanksPerNode)
		require.Equal(t, r/rpn, l.Node)
		require.Equal(t, r%rpn, l.Local)
		in := make([]float32, rpn)
		require.NoError(t, l.Intra.AllGather(ctx, []float32{float32(r)}, in))
		for i, v := range in {
			assert.Equal(t, float32(l.Node*rpn+i), v, "intra member %d", i)
		}
		out := make([]float32, nodes)
		require.NoError(t, l.Inter.AllGather(ctx, []float32{float32(r)}, out))
		for i, v := range out {
			assert.Equal(t, float32(i*rpn+l.Local), v, "inter member %d", i)
		}
		require.NoError(t, l.Close())
	}

	shared, err := comm.NewLayout(ctx, world, 0)
	require.NoError(t, err)
	check(shared, 1, w)

	rpn := 1
	if w%2 == 0 {
		rpn = 2
	}
	explicit, err := comm.NewLayout(ctx, world, rpn)
	require.NoError(t, err)
	check(explicit, w/rpn, rpn)

	if w > 1 {
		// A size that does not divide: the same clear error on every rank.
		_, err := comm.NewLayout(ctx, world, w+1)
		require.ErrorContains(t, err, "does not divide the group size")
		// Ranks that disagree.
		_, err = comm.NewLayout(ctx, world, 1+r%2)
		require.ErrorContains(t, err, "ranks disagree on ranks per node")
	}
}

// traffic runs a fixed sequence of calls on c.
func traffic(ctx context.Context, c comm.Comm) error {
	w, r := c.Size(), c.Rank()
	sub, err := c.Split(ctx, 0, r)
	if err != nil {
		return err
	}
	if err := sub.Close(); err != nil {
		return err
	}
	return errors.Join(
		c.AllReduce(ctx, make([]float32, 10), comm.Sum),
		c.AllReduce(ctx, make([]float32, 7), comm.Mean),
		c.ReduceScatter(ctx, make([]float32, 5*w), make([]float32, 5), comm.Max),
		c.AllGather(ctx, make([]float32, 3), make([]float32, 3*w)),
		c.AllGatherBytes(ctx, make([]byte, 5), make([]byte, 5*w)),
		c.AllToAll(ctx, make([]float32, 2*w), make([]float32, 2*w)),
		c.AllToAllBytes(ctx, make([]byte, 3*w), make([]byte, 3*w)),
		c.Broadcast(ctx, make([]float32, 4), w-1),
		c.BroadcastBytes(ctx, make([]byte, 6), 0),
		c.Barrier(ctx),
	)
}

func TestStatsMatchLocal(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	want := make([]comm.Stats, w)
	require.NoError(t, local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		err := traffic(ctx, c)
		want[c.Rank()] = c.Stats()
		return err
	}, local.AllowUnderMPI())) // under mpirun on purpose: the reference
	for _, m := range modes() {
		before := m.c.Stats()
		require.NoError(t, traffic(ctx, m.c))
		assert.Equal(t, want[r], m.c.Stats().Sub(before), m.name)
	}
}

func TestOnebitConformance(t *testing.T) {
	ctx := testCtx(t)
	cases, err := conformance.Load(conformance.Dir())
	require.NoError(t, err)
	ran := 0
	for _, c := range cases {
		if c.Kind != "onebit" || c.World != world.Size() {
			continue
		}
		t.Run(c.Name, func(t *testing.T) {
			require.NoError(t, conformance.RunOnebitRank(ctx, world, c))
		})
		ran++
	}
	if ran == 0 {
		t.Skipf("no onebit vector for %d ranks", world.Size())
	}
}

// randomInputs returns w random vectors of n values, rank j's the same on
// every rank for the same seed. Only world rank 0, which runs the
// in-process reference (onLocal), makes all of them; rank r makes its own,
// in[r], and leaves the others nil.
func randomInputs(seed uint64, w, n int) [][]float32 {
	in := make([][]float32, w)
	for j := range in {
		if world.Rank() != 0 && j != world.Rank() {
			continue
		}
		rng := rand.New(rand.NewPCG(seed, 42+uint64(j)))
		in[j] = make([]float32, n)
		for i := range in[j] {
			in[j][i] = float32(rng.NormFloat64() * math.Exp(rng.NormFloat64()))
		}
	}
	return in
}

// onLocal runs fn on every rank of an in-process group of w ranks and
// returns rank r's result. Only world rank 0 runs the group: it broadcasts
// each rank's result, so that a job of w processes on a few cores runs one
// in-process group instead of w copies of it. A failure of the group fails
// the test on every rank.
func onLocal(t *testing.T, ctx context.Context, w, r int, fn func(ctx context.Context, c comm.Comm) ([]float32, error)) []float32 {
	t.Helper()
	outs := make([][]float32, w)
	var runErr error
	if r == 0 {
		var mu sync.Mutex
		runErr = local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
			got, err := fn(ctx, c)
			mu.Lock()
			outs[c.Rank()] = got
			mu.Unlock()
			return err
		}, local.AllowUnderMPI()) // under mpirun on purpose: the reference
	}
	// The header: whether the group failed, then each rank's length.
	hdr := make([]byte, 8*(w+1))
	if r == 0 {
		if runErr != nil {
			hdr[0] = 1
		}
		for j, o := range outs {
			binary.LittleEndian.PutUint64(hdr[8*(j+1):], uint64(len(o)))
		}
	}
	require.NoError(t, world.BroadcastBytes(ctx, hdr, 0))
	require.NoError(t, runErr)
	require.Zero(t, hdr[0], "the in-process reference failed on world rank 0")
	for j := range w {
		n := int(binary.LittleEndian.Uint64(hdr[8*(j+1):]))
		if r != 0 {
			outs[j] = make([]float32, n)
		}
		if n > 0 {
			require.NoError(t, world.Broadcast(ctx, outs[j], 0))
		}
	}
	return outs[r]
}

// requireBits checks got against want bit for bit.
func requireBits(t *testing.T, want, got []float32, msg string) {
	t.Helper()
	require.Len(t, got, len(want), msg)
	for i := range want {
		if math.Float32bits(want[i]) != math.Float32bits(got[i]) {
			require.Failf(t, "not bit-identical", "%s: element %d: mpi %g (%#08x), local %g (%#08x)",
				msg, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
		}
	}
}

// requireClose checks got against want to float32 rounding of a sum over
// w terms.
func requireClose(t *testing.T, want, got []float32, w int, msg string) {
	t.Helper()
	require.Len(t, got, len(want), msg)
	for i := range want {
		tol := 1e-6 * float64(w) * (math.Abs(float64(want[i])) + 1)
		require.InDelta(t, want[i], got[i], tol, "%s: element %d", msg, i)
	}
}

func TestAllReduceMatchesLocal(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	for step, n := range []int{1, 33, 1000, 4097} {
		in := randomInputs(uint64(step), w, n)
		for _, op := range []comm.Op{comm.Sum, comm.Mean, comm.Max} {
			want := onLocal(t, ctx, w, r, func(ctx context.Context, c comm.Comm) ([]float32, error) {
				buf := append([]float32(nil), in[c.Rank()]...)
				return buf, c.AllReduce(ctx, buf, op)
			})
			for _, m := range modes() {
				got := append([]float32(nil), in[r]...)
				require.NoError(t, m.c.AllReduce(ctx, got, op))
				msg := fmt.Sprintf("%s allreduce %v n=%d", m.name, op, n)
				// MPI's own summation order equals rank order only on
				// two ranks; its Max is exact on any number.
				if m.c == ordered || w <= 2 || op == comm.Max {
					requireBits(t, want, got, msg)
				} else {
					requireClose(t, want, got, w, msg)
				}
			}
		}
	}
}

func TestReduceScatterMatchesLocal(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	for step, k := range []int{1, 17, 1000} {
		in := randomInputs(uint64(100+step), w, w*k)
		for _, op := range []comm.Op{comm.Sum, comm.Mean, comm.Max} {
			want := onLocal(t, ctx, w, r, func(ctx context.Context, c comm.Comm) ([]float32, error) {
				recv := make([]float32, k)
				return recv, c.ReduceScatter(ctx, in[c.Rank()], recv, op)
			})
			for _, m := range modes() {
				got := make([]float32, k)
				require.NoError(t, m.c.ReduceScatter(ctx, in[r], got, op))
				msg := fmt.Sprintf("%s reducescatter %v k=%d", m.name, op, k)
				if m.c == ordered || w <= 2 || op == comm.Max {
					requireBits(t, want, got, msg)
				} else {
					requireClose(t, want, got, w, msg)
				}
			}
		}
	}
}

func TestOnebitMatchesLocal(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	const steps = 4
	// 4M+3 elements (16 MiB) are pipelined on 2 to 4 ranks (two to four
	// pieces per chunk): the caller starts each piece's collectives
	// (comm.Starter) and moves their data while it computes, or, with
	// overlap off, a goroutine runs them; pieces 1 is the same tensor in
	// whole chunks, whose collectives are started too (tensors of less
	// than 1M elements run them blocking).
	for _, tc := range []struct {
		n, pieces int
		overlap   bool
	}{
		{100, 0, true}, {1000, 0, true}, {4097, 0, true},
		{4<<20 + 3, 0, true}, {4<<20 + 3, 0, false}, {4<<20 + 3, 1, true},
	} {
		n := tc.n
		if n > 1<<20 && w < 2 {
			continue
		}
		// The in-process group keeps one state per rank across steps, as
		// the MPI rank keeps its own.
		states := make([]*onebit.State, w)
		for j := range states {
			if r == 0 { // only world rank 0 runs the in-process group (onLocal)
				var err error
				states[j], err = onebit.NewState(n, w)
				require.NoError(t, err)
			}
		}
		st, err := onebit.NewState(n, w)
		require.NoError(t, err)
		st.SetPieces(tc.pieces)
		st.SetOverlap(tc.overlap)
		for step := range steps {
			if n > 1<<20 && step >= 1 {
				break // one pipelined step; the local tests carry error feedback over steps
			}
			in := randomInputs(uint64(1000*n+step), w, n)
			// The output, then the state's worker and server errors.
			want := onLocal(t, ctx, w, r, func(ctx context.Context, c comm.Comm) ([]float32, error) {
				buf := append([]float32(nil), in[c.Rank()]...)
				err := onebit.AllReduce(ctx, c, buf, states[c.Rank()])
				return append(append(buf, states[c.Rank()].WorkerError...), states[c.Rank()].ServerError...), err
			})
			got := append([]float32(nil), in[r]...)
			require.NoError(t, onebit.AllReduce(ctx, world, got, st))
			msg := fmt.Sprintf("onebit n=%d pieces=%d overlap=%v step %d", n, tc.pieces, tc.overlap, step)
			nw := len(st.WorkerError)
			require.Len(t, want, n+nw+len(st.ServerError), msg)
			requireBits(t, want[:n], got, msg+" output")
			requireBits(t, want[n:n+nw], st.WorkerError, msg+" worker error")
			requireBits(t, want[n+nw:], st.ServerError, msg+" server error")
		}
	}
}

// 1-bit Adam takes the same steps under mpirun as on in-process ranks in
// each of its state modes (the ordered communicator sums in rank order, as
// comm/local does): warm-up and compression, in several buckets, the
// sharded mode's reduce-scatter and all-gather and its bfloat16 buffers
// included; every 11th element never gets a gradient (the bits of such
// elements are all-gathered at every compression step, after the sharded
// mode's gather of which they are).
func TestOnebitAdamModesMatchLocal(t *testing.T) {
	ctx := testCtx(t)
	w, r := world.Size(), world.Rank()
	const steps = 5
	for _, tc := range []struct {
		mode onebit.StateMode
		bf   onebit.BF16State
		n    int
	}{
		{onebit.StateFull, 0, 5000}, {onebit.StateCompact, 0, 5000}, {onebit.StateSharded, 0, 5000},
		{onebit.StateSharded, onebit.BF16WorkerError | onebit.BF16Variance, 5000},
		// One bucket of 1M+5 elements: its calls start their collectives.
		{onebit.StateFull, 0, 1<<20 + 5},
		{onebit.StateSharded, onebit.BF16WorkerError | onebit.BF16Variance, 1<<20 + 5},
	} {
		n := tc.n
		cfg := onebit.DefaultAdamConfig()
		cfg.LR, cfg.FreezeStep, cfg.BucketBytes = 0.01, 2, 4*1500
		if n > 5000 {
			cfg.BucketBytes = 4 * n
		}
		cfg.StateMode, cfg.BF16 = tc.mode, tc.bf
		run := func(ctx context.Context, c comm.Comm) ([]float32, error) {
			p := optim.NewParam("w", n)
			for i := range p.Data() {
				p.Data()[i] = float32(math.Sin(float64(i)))
			}
			opt, err := onebit.NewAdam(ctx, c, []*optim.Param{p}, cfg)
			if err != nil {
				return nil, err
			}
			for s := range steps {
				for i := range p.GradData() {
					p.GradData()[i] = float32(math.Cos(float64(s*7919+c.Rank()*104729+3*i))) * float32(1+c.Rank())
					if i%11 == 0 {
						p.GradData()[i] = 0
					}
				}
				if err := opt.Step(ctx); err != nil {
					return nil, err
				}
			}
			for i := 0; i < n; i += 11 {
				if x := float32(math.Sin(float64(i))); p.Data()[i] != x {
					return nil, fmt.Errorf("element %d never had a gradient and moved from %v to %v", i, x, p.Data()[i])
				}
			}
			return p.Data(), nil
		}
		want := onLocal(t, ctx, w, r, run)
		got, err := run(ctx, ordered)
		require.NoError(t, err)
		requireBits(t, want, got, fmt.Sprintf("%v %v n=%d", tc.mode, tc.bf, n))
	}
}

func TestMismatch(t *testing.T) {
	needRanks(t, 2)
	ctx := testCtx(t)
	r := world.Rank()
	pick := func(first, others int) int {
		if r == 0 {
			return first
		}
		return others
	}
	requireMismatch := func(err error, what string, got, want int) {
		t.Helper()
		var me *comm.MismatchError
		require.ErrorAs(t, err, &me)
		assert.Equal(t, what, me.What)
		assert.Equal(t, 1, me.Rank)
		assert.Equal(t, got, me.Got)
		assert.Equal(t, want, me.Want)
	}

	for _, m := range modes() {
		err := m.c.AllReduce(ctx, make([]float32, pick(8, 9)), comm.Sum)
		requireMismatch(err, "send length", 9, 8)
		assert.Contains(t, err.Error(), "rank 1 has 9, rank 0 has 8")

		err = m.c.ReduceScatter(ctx, make([]float32, world.Size()*pick(2, 3)), make([]float32, pick(2, 3)), comm.Sum)
		requireMismatch(err, "send length", world.Size()*3, world.Size()*2)
	}

	err := world.AllReduce(ctx, make([]float32, 4), comm.Op(pick(int(comm.Sum), int(comm.Max))))
	requireMismatch(err, "op", int(comm.Max), int(comm.Sum))

	err = world.Broadcast(ctx, make([]float32, 4), pick(0, 1))
	requireMismatch(err, "root", 1, 0)

	err = world.AllGather(ctx, make([]float32, pick(3, 4)), make([]float32, world.Size()*pick(3, 4)))
	requireMismatch(err, "send length", 4, 3)

	// A tiny all-gather (its bytes in the agreement) against one that is
	// not, and against another collective.
	err = world.AllGatherBytes(ctx, make([]byte, pick(16, 17)), make([]byte, world.Size()*pick(16, 17)))
	requireMismatch(err, "send length", 17, 16)
	if r == 0 {
		err = world.Barrier(ctx)
	} else {
		err = world.AllGatherBytes(ctx, make([]byte, 4), make([]byte, 4*world.Size()))
	}
	requireMismatch(err, "kind", int(comm.CAllGather), int(comm.CBarrier))

	err = world.AllToAllBytes(ctx, make([]byte, world.Size()*pick(1, 2)), make([]byte, world.Size()*pick(1, 2)))
	requireMismatch(err, "send length", 2*world.Size(), world.Size())

	// Float and byte variants of one collective are different kinds.
	if r == 0 {
		err = world.AllGather(ctx, make([]float32, 2), make([]float32, 2*world.Size()))
	} else {
		err = world.AllGatherBytes(ctx, make([]byte, 2), make([]byte, 2*world.Size()))
	}
	requireMismatch(err, "kind", int(comm.CAllGather), int(comm.CAllGather))

	// So are different collectives.
	if r == 0 {
		err = world.Barrier(ctx)
	} else {
		err = world.AllReduce(ctx, make([]float32, 2), comm.Sum)
	}
	requireMismatch(err, "kind", int(comm.CAllReduce), int(comm.CBarrier))

	// Invalid arguments on one rank fail the call on every rank.
	k := 2
	if r == 1 {
		k = 1 // send is not Size() x recv on rank 1 only
	}
	err = world.ReduceScatter(ctx, make([]float32, world.Size()*2), make([]float32, k), comm.Sum)
	require.Error(t, err)
	if r == 1 {
		assert.Contains(t, err.Error(), "is not")
	} else {
		assert.Contains(t, err.Error(), "rank 1 called it with invalid arguments")
	}

	// Mismatches leave the communicators usable.
	for _, m := range modes() {
		buf := []float32{1}
		require.NoError(t, m.c.AllReduce(ctx, buf, comm.Sum))
		assert.Equal(t, float32(world.Size()), buf[0])
	}
}

func TestInvalidArgs(t *testing.T) {
	ctx := testCtx(t)
	w := world.Size()
	assert.ErrorContains(t, world.AllReduce(ctx, make([]float32, 2), comm.Op(9)), "invalid op")
	assert.ErrorContains(t, world.AllGather(ctx, make([]float32, 2), make([]float32, 2*w+1)), "receive length")
	assert.ErrorContains(t, world.AllToAll(ctx, make([]float32, w), make([]float32, w+1)), "differs")
	if w > 1 {
		assert.ErrorContains(t, world.AllToAllBytes(ctx, make([]byte, w+1), make([]byte, w+1)), "not a multiple")
	}
	assert.ErrorContains(t, world.Broadcast(ctx, nil, w), "out of range")
	assert.ErrorContains(t, world.Broadcast(ctx, nil, -1), "out of range")
	require.NoError(t, world.Barrier(ctx))
}

func TestContextDone(t *testing.T) {
	c, err := mpi.Open()
	require.NoError(t, err)
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err = c.AllReduce(ctx, make([]float32, 4), comm.Sum)
	assert.ErrorIs(t, err, context.Canceled)
	assert.ErrorIs(t, err, comm.ErrAborted)
	// The communicator is broken from then on.
	err = c.Barrier(context.Background())
	assert.ErrorIs(t, err, comm.ErrAborted)
	assert.ErrorIs(t, err, context.Canceled)
}

func TestClose(t *testing.T) {
	c, err := mpi.Open()
	require.NoError(t, err)
	require.NoError(t, c.Close())
	require.NoError(t, c.Close())
	assert.ErrorIs(t, c.AllReduce(context.Background(), make([]float32, 4), comm.Sum), comm.ErrClosed)
	_, err = c.Split(context.Background(), 0, 0)
	assert.ErrorIs(t, err, comm.ErrClosed)
}

func TestNoAllocs(t *testing.T) {
	ctx := testCtx(t) // a context with a deadline arms the watchdog
	w := world.Size()
	buf := make([]float32, 1000*w)
	out := make([]float32, 1000)
	bsend := make([]byte, 64*w)
	brecv := make([]byte, 64*w)
	for _, m := range modes() {
		small, err := onebit.NewState(len(buf), w) // whole chunks, blocking collectives
		require.NoError(t, err)
		large := make([]float32, 1<<20)
		st, err := onebit.NewState(len(large), w) // whole chunks, started collectives
		require.NoError(t, err)
		st.SetPieces(1)
		calls := []struct {
			name string
			f    func() error
		}{
			{"onebit", func() error { return onebit.AllReduce(ctx, m.c, buf, small) }},
			{"onebit started", func() error { return onebit.AllReduce(ctx, m.c, large, st) }},
			{"allreduce", func() error { return m.c.AllReduce(ctx, buf, comm.Mean) }},
			{"allreduce background", func() error { return m.c.AllReduce(context.Background(), buf, comm.Sum) }},
			{"reducescatter", func() error { return m.c.ReduceScatter(ctx, buf, out, comm.Sum) }},
			{"allgather", func() error { return m.c.AllGatherBytes(ctx, bsend[:64], brecv) }},
			{"alltoall", func() error { return m.c.AllToAllBytes(ctx, bsend, brecv) }},
			{"broadcast", func() error { return m.c.Broadcast(ctx, buf, 0) }},
			{"barrier", func() error { return m.c.Barrier(ctx) }},
			{"started alltoall", func() error {
				req, err := m.c.(comm.Starter).StartAllToAllBytes(ctx, bsend, brecv)
				if err != nil {
					return err
				}
				_, _ = req.Test()
				return req.Wait()
			}},
		}
		for _, call := range calls {
			require.NoError(t, call.f(), "%s %s", m.name, call.name) // grows buffers
			allocs := testing.AllocsPerRun(20, func() { _ = call.f() })
			assert.Zero(t, allocs, "%s %s", m.name, call.name)
		}
	}
}

// Benchmarks run under mpirun with a fixed iteration count, so that every
// rank makes the same calls, for example:
//
//	mpirun -np 4 ./mpi.test -test.run '^$' -test.bench . -test.benchtime 5x
//
// They compare, in one run, the exact allreduce in both reduction modes with
// the 1-bit compressed allreduce built on AllToAllBytes and AllGatherBytes.
func BenchmarkAllReduce(b *testing.B) {
	ctx := context.Background()
	w := world.Size()
	for _, mib := range []int{1, 64} {
		n := mib << 20 / 4
		buf := make([]float32, n)
		for i := range buf {
			buf[i] = float32(i%7) - 3
		}
		for _, m := range modes() {
			b.Run(fmt.Sprintf("%s/%dMiB", m.name, mib), func(b *testing.B) {
				b.SetBytes(int64(n) * 4)
				for b.Loop() {
					if err := m.c.AllReduce(ctx, buf, comm.Mean); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
		b.Run(fmt.Sprintf("onebit/%dMiB", mib), func(b *testing.B) {
			st, err := onebit.NewState(n, w)
			if err != nil {
				b.Fatal(err)
			}
			b.SetBytes(int64(n) * 4)
			for b.Loop() {
				if err := onebit.AllReduce(ctx, world, buf, st); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// Open MPI installs its signal handlers only where none is set, so the Go
// runtime's stay: a nil dereference is still a recoverable Go panic.
func TestGoPanicsAfterOpen(t *testing.T) {
	var p *int
	panicked := func() (ok bool) {
		defer func() { ok = recover() != nil }()
		_ = *p
		return false
	}()
	assert.True(t, panicked)
}

// BenchmarkBarrier measures one collective's fixed cost: a barrier is only
// the argument agreement (and the watchdog's arming, with a deadline).
func BenchmarkBarrier(b *testing.B) {
	deadline, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	for _, ctx := range []struct {
		name string
		ctx  context.Context
	}{{"background", context.Background()}, {"deadline", deadline}} {
		b.Run(ctx.name, func(b *testing.B) {
			for b.Loop() {
				if err := world.Barrier(ctx.ctx); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
