package mpi

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
)

// reduceMax is what MPI_Allreduce with MPI_MAX does to agreement vectors.
func reduceMax(vs [][]int64) []int64 {
	out := append([]int64(nil), vs[0]...)
	for _, v := range vs[1:] {
		for i, x := range v {
			out[i] = max(out[i], x)
		}
	}
	return out
}

func agreeOn(calls []args) (bool, int, [][nFields]int64) {
	vs := make([][]int64, len(calls))
	all := make([][nFields]int64, len(calls))
	for r := range calls {
		vs[r] = make([]int64, agreeLenFor(len(calls)))
		calls[r].encode(vs[r], r, len(calls))
		all[r] = calls[r].fields(r, len(calls))
	}
	ok, inv := decode(reduceMax(vs))
	return ok, inv, all
}

func TestAgreement(t *testing.T) {
	same := args{kind: comm.CAllReduce, send: 10, op: comm.Mean}
	ok, inv, _ := agreeOn([]args{same, same, same})
	assert.True(t, ok)
	assert.Equal(t, 3, inv)

	long := same
	long.send = 12
	ok, inv, all := agreeOn([]args{same, same, long, same})
	assert.False(t, ok)
	assert.Equal(t, 4, inv)
	var me *comm.MismatchError
	require.ErrorAs(t, mismatch(all), &me)
	assert.Equal(t, comm.MismatchError{Collective: comm.CAllReduce, What: "send length", Rank: 2, Got: 12, Want: 10}, *me)

	bad := same
	bad.invalid = errors.New("bad")
	ok, inv, _ = agreeOn([]args{same, bad, bad})
	assert.True(t, ok)
	assert.Equal(t, 1, inv)
	assert.ErrorContains(t, invalidError(comm.CAllReduce, inv), "rank 1 called it with invalid arguments")
}

// A tiny all-gather's send buffers ride in the agreement's slots: after
// the MPI_MAX reduction every rank reads every rank's bytes, whatever their
// values (bytes with the high bit set included); the slots of a call that
// carries none stay zero and do not disturb the fields.
func TestTinyPayload(t *testing.T) {
	assert.Equal(t, agreeLen+4*tinyWords, agreeLenFor(4))
	assert.Equal(t, agreeLen, agreeLenFor(tinyMaxRanks+1))
	assert.True(t, tiny(tinyBytes, tinyMaxRanks))
	assert.False(t, tiny(tinyBytes+1, 2))
	assert.False(t, tiny(0, 2))
	assert.False(t, tiny(1, tinyMaxRanks+1))

	for _, size := range []int{1, 2, 3, 5} {
		for n := 1; n <= tinyBytes; n++ {
			calls := make([]args, size)
			want := make([]byte, size*n)
			vs := make([][]int64, size)
			for r := range calls {
				p := want[r*n : (r+1)*n]
				for i := range p {
					p[i] = byte(255 - 37*r - 11*i)
				}
				calls[r] = args{kind: comm.CAllGather, bytes: true, send: n, recv: size * n, payload: p}
				vs[r] = make([]int64, agreeLenFor(size))
				calls[r].encode(vs[r], r, size)
			}
			v := reduceMax(vs)
			ok, inv := decode(v)
			require.True(t, ok)
			require.Equal(t, size, inv)
			got := make([]byte, size*n)
			payloads(v, got, n)
			require.Equal(t, want, got, "%d ranks, %d bytes", size, n)
		}
	}

	// A rank that writes a payload among ranks in another call: the
	// fields disagree, as without it.
	ok, _, all := agreeOn([]args{
		{kind: comm.CAllGather, bytes: true, send: 8, recv: 16, payload: make([]byte, 8)},
		{kind: comm.CBarrier},
	})
	assert.False(t, ok)
	var me *comm.MismatchError
	require.ErrorAs(t, mismatch(all), &me)
	assert.Equal(t, "kind", me.What)

	v := make([]int64, agreeLenFor(3))
	for i := range v {
		v[i] = -1
	}
	(&args{kind: comm.CBarrier}).encode(v, 1, 3)
	assert.Equal(t, make([]int64, 3*tinyWords), v[agreeLen:], "a call without payload clears the slots")
}

func TestMismatchOrder(t *testing.T) {
	f := func(a args) [nFields]int64 { return a.fields(0, 2) }
	base := args{kind: comm.CBroadcast, send: 4, root: 1}
	cases := []struct {
		other args
		what  string
		got   int
		want  int
	}{
		{args{kind: comm.CBroadcast, bytes: true, send: 4, root: 1}, "kind", int(comm.CBroadcast), int(comm.CBroadcast)},
		{args{kind: comm.CBarrier}, "kind", int(comm.CBarrier), int(comm.CBroadcast)},
		{args{kind: comm.CBroadcast, send: 5, root: 0}, "send length", 5, 4},
		{args{kind: comm.CBroadcast, send: 4, root: 0}, "root", 0, 1},
		{args{kind: comm.CBroadcast, send: 4, recv: 1, root: 1}, "receive length", 1, 0},
		{args{kind: comm.CBroadcast, send: 4, op: comm.Max, root: 1}, "op", int(comm.Max), int(comm.Sum)},
	}
	for _, c := range cases {
		err := mismatch([][nFields]int64{f(base), f(c.other)})
		var me *comm.MismatchError
		require.ErrorAs(t, err, &me, c.what)
		assert.Equal(t, c.what, me.What)
		assert.Equal(t, 1, me.Rank)
		assert.Equal(t, c.got, me.Got, c.what)
		assert.Equal(t, c.want, me.Want, c.what)
	}
}

func TestReduceOrdered(t *testing.T) {
	src := []float32{1, 2, 3, 4, 5, 6}
	dst := make([]float32, 2)
	reduceOrdered(dst, src, 3, comm.Sum)
	assert.Equal(t, []float32{9, 12}, dst)
	reduceOrdered(dst, src, 3, comm.Mean)
	assert.Equal(t, []float32{3, 4}, dst)
	reduceOrdered(dst, []float32{1, 7, 3, 2, 0, 9}, 3, comm.Max)
	assert.Equal(t, []float32{3, 9}, dst)
}

func TestChunk(t *testing.T) {
	var total int
	for r := range 4 {
		lo, hi := chunk(10, 4, r)
		assert.Equal(t, total, lo)
		total = hi
	}
	assert.Equal(t, 10, total)
	lo, hi := chunk(2, 4, 3)
	assert.Equal(t, 2, lo)
	assert.Equal(t, 2, hi)
}

func TestError(t *testing.T) {
	e := &Error{Func: "MPI_Allreduce", Code: 15, Msg: "MPI_ERR_TRUNCATE: message truncated"}
	assert.Equal(t, "MPI_Allreduce failed: MPI_ERR_TRUNCATE: message truncated (MPI error code 15)", e.Error())
}
