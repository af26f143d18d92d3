package mpi

import (
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
)

// args is one rank's side of a collective call, as the ranks agree on it
// before any data moves.
type args struct {
	kind       comm.Collective
	bytes      bool // byte variant
	started    bool // started (comm.Starter), not blocking
	send, recv int  // buffer lengths (0 where the collective has no such buffer)
	op         comm.Op
	root       int
	invalid    error // this rank's own argument error, found before communicating
	// payload is the send buffer of a tiny all-gather, which rides in the
	// agreement (see tinyBytes); nil for every other call.
	payload []byte
}

// The fields of the agreement vector.
const (
	fKind    = iota // 4*kind + 2*started + bytes
	fSend           // send length
	fRecv           // receive length
	fOp             // operator
	fRoot           // root
	fInvalid        // rank if this rank's arguments are invalid, else the group size
	nFields
)

// agreeLen is the length of the agreement vector: the fields, then the
// fields negated, so that one MPI_MAX reduction yields the maximum and the
// minimum of each.
const agreeLen = 2 * nFields

// Tiny all-gathers ride in the agreement: an all-gather of at most
// tinyBytes per rank, in a group of at most tinyMaxRanks, needs no
// collective of its own. Every agreement vector carries, after its fields,
// a slot of tinyWords words per rank; a rank in a tiny all-gather writes
// its send buffer into its own slot, 4 bytes per word (so that every word
// is non-negative), the other slots stay 0, and the MPI_MAX reduction that
// agrees on the arguments hands every rank every slot. The slots are there
// in every agreement, whatever the call, so that the reduction has the
// same length on every rank even when the ranks disagree; they are read
// only when the ranks agree on a tiny all-gather. (onebit's header, 12
// bytes per rank, is one: its call then costs one round trip less.)
const (
	tinyWords    = 4
	tinyBytes    = 4 * tinyWords
	tinyMaxRanks = 64 // beyond, the slots would make every agreement longer than 2 KiB
)

// agreeLenFor is the length of the agreement vector of a group of size
// ranks: agreeLen, and the tiny all-gathers' slots where the group has
// them.
func agreeLenFor(size int) int {
	if size > tinyMaxRanks {
		return agreeLen
	}
	return agreeLen + size*tinyWords
}

// tiny reports whether an all-gather of n bytes per rank rides in the
// agreement of a group of size ranks.
func tiny(n, size int) bool {
	return n > 0 && n <= tinyBytes && size <= tinyMaxRanks
}

// fields returns a's agreement fields as rank of a group of size ranks.
func (a *args) fields(rank, size int) [nFields]int64 {
	var f [nFields]int64
	f[fKind] = 4 * int64(a.kind)
	if a.started {
		f[fKind] += 2
	}
	if a.bytes {
		f[fKind]++
	}
	f[fSend] = int64(a.send)
	f[fRecv] = int64(a.recv)
	f[fOp] = int64(a.op)
	f[fRoot] = int64(a.root)
	f[fInvalid] = int64(size)
	if a.invalid != nil {
		f[fInvalid] = int64(rank)
	}
	return f
}

// encode writes a's agreement vector, ready for an MPI_MAX allreduce, to v
// (len agreeLenFor(size)): the fields, negated, and the slots, zero but
// for a tiny all-gather's payload in this rank's.
func (a *args) encode(v []int64, rank, size int) {
	f := a.fields(rank, size)
	for i, x := range f {
		v[i] = x
		v[nFields+i] = -x
	}
	clear(v[agreeLen:])
	if a.payload != nil {
		slot := v[agreeLen+rank*tinyWords : agreeLen+(rank+1)*tinyWords]
		for i, b := range a.payload {
			slot[i/4] |= int64(b) << (8 * (i % 4))
		}
	}
}

// payloads copies the n bytes of every rank's slot of a reduced agreement
// vector v into recv (n bytes per rank, in rank order).
func payloads(v []int64, recv []byte, n int) {
	for i := range recv {
		j, k := i/n, i%n
		recv[i] = byte(v[agreeLen+j*tinyWords+k/4] >> (8 * (k % 4)))
	}
}

// decode reads a reduced agreement vector: whether every rank passed the
// same kind, lengths, op and root, and the lowest rank whose arguments were
// invalid (the group size when none was).
func decode(v []int64) (agree bool, invalid int) {
	agree = true
	for i := range fInvalid {
		if v[i] != -v[nFields+i] {
			agree = false
		}
	}
	return agree, int(-v[nFields+fInvalid])
}

// invalidError is the error of a rank whose own arguments were valid when
// the lowest rank with invalid ones is r.
func invalidError(kind comm.Collective, r int) error {
	return fmt.Errorf("mpi: %s: rank %d called it with invalid arguments (its error says which)", kind, r)
}

// mismatch returns the error every rank reports when the ranks disagree,
// given every rank's agreement fields in rank order (all[j] is rank j's).
// It checks in the order comm/local does, so both backends name the same
// field and rank.
func mismatch(all [][nFields]int64) error {
	f0 := all[0]
	kind0 := comm.Collective(f0[fKind] / 4)
	way := func(f int64) string {
		if f/2%2 == 1 {
			return "started"
		}
		return "blocking"
	}
	for j := 1; j < len(all); j++ {
		f := all[j]
		mm := func(what string, got, want int64) error {
			return &comm.MismatchError{Collective: kind0, What: what, Rank: j, Got: int(got), Want: int(want)}
		}
		switch {
		case f[fKind] != f0[fKind]:
			kind := comm.Collective(f[fKind] / 4)
			return fmt.Errorf("mpi: rank %d called %s (bytes=%v, %s) while rank 0 called %s (bytes=%v, %s): %w",
				j, kind, f[fKind]%2 == 1, way(f[fKind]), kind0, f0[fKind]%2 == 1, way(f0[fKind]),
				mm("kind", int64(kind), int64(kind0)))
		case f[fSend] != f0[fSend]:
			return mm("send length", f[fSend], f0[fSend])
		case f[fRecv] != f0[fRecv]:
			return mm("receive length", f[fRecv], f0[fRecv])
		case f[fOp] != f0[fOp]:
			return mm("op", f[fOp], f0[fOp])
		case f[fRoot] != f0[fRoot]:
			return mm("root", f[fRoot], f0[fRoot])
		}
	}
	// The reduction said the ranks disagree but the gathered fields do
	// not: the two collectives saw different arguments, which cannot
	// happen unless memory was corrupted.
	return fmt.Errorf("mpi: %s: argument agreement is inconsistent across ranks", kind0)
}

// chunk returns the bounds of rank r's part when n elements are cut into
// size parts of ceil(n/size), as comm/local cuts an AllReduce.
func chunk(n, size, r int) (lo, hi int) {
	per := (n + size - 1) / size
	lo = min(r*per, n)
	hi = min(lo+per, n)
	return lo, hi
}

// reduceOrdered writes into dst the reduction, with op and in ascending
// rank order, of the size consecutive pieces of len(dst) in src, exactly as
// comm/local reduces: dst = src_0, dst op= src_j for j = 1..size-1, then
// for Mean dst /= size.
func reduceOrdered(dst, src []float32, size int, op comm.Op) {
	k := len(dst)
	copy(dst, src[:k])
	for j := 1; j < size; j++ {
		s := src[j*k : (j+1)*k]
		if op == comm.Max {
			for i, v := range s {
				if v > dst[i] {
					dst[i] = v
				}
			}
			continue
		}
		for i, v := range s {
			dst[i] += v
		}
	}
	if op == comm.Mean {
		divide(dst, size)
	}
}

// divide divides every element of x by n, as comm/local does for Mean.
func divide(x []float32, n int) {
	d := float32(n)
	for i := range x {
		x[i] /= d
	}
}
