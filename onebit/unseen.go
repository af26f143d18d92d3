package onebit

// unseen lists, per parameter, the elements whose second moment v is
// exactly zero once v is frozen (or, in 0/1 Adam, after each variance
// update): no rank has given them a nonzero gradient since training began,
// since v only grows from zero. A byte or token embedding row whose token
// never occurred in the warm-up is the usual case.
//
// Exact Adam leaves such an element where it is (its m is zero too). The
// compressed allreduce does not: it gives every element of a chunk the
// magnitude of the chunk's scale, and the update divides that by
// sqrt(v)+eps = eps, a step of about lr*scale/1e-8. Error feedback makes
// those steps cancel over time, but each one is enormous, and the element
// is garbage when its token finally shows up (a GPT's loss jumps). So the
// optimizers zero the compressed momentum (or gradient, or accumulator) of
// the unseen elements before the update, as if an exp_avg mask held zero
// there; see the package doc. The lists are derived from v, which every
// checkpoint holds, so they are rebuilt on Load and never saved.
type unseen [][]int32

func newUnseen(params int) unseen { return make(unseen, params) }

// find lists the elements of parameter i whose v is zero, reusing the
// list's memory (a list only shrinks while v is frozen or grows, so later
// calls allocate nothing).
func (u unseen) find(i int, v []float32) {
	l := u[i][:0]
	for j, x := range v {
		if x == 0 {
			l = append(l, int32(j))
		}
	}
	u[i] = l
}

// clear forgets every list: before v holds anything.
func (u unseen) clear() {
	for i := range u {
		u[i] = u[i][:0]
	}
}

// zero sets x[j] to zero for every listed element j of parameter i.
func (u unseen) zero(i int, x []float32) {
	for _, j := range u[i] {
		x[j] = 0
	}
}

// count is the number of listed elements over every parameter.
func (u unseen) count() int {
	n := 0
	for _, l := range u {
		n += len(l)
	}
	return n
}
