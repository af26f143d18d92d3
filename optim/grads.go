package optim

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
)

// AllFinite reports whether every gradient of params is finite (no NaN, no
// Inf) on every rank of c: each rank checks its own gradients, then one
// allreduce (comm.Max) of a one-element flag makes every rank reach the same
// answer. c may be nil or of size 1; then only the local gradients are
// checked and nothing is communicated. Every rank must call it together.
//
// AllFinite allocates the flag on every call; an optimizer that must not
// allocate in Step keeps a FiniteGuard instead.
func AllFinite(ctx context.Context, c comm.Comm, params []*Param) (bool, error) {
	var g FiniteGuard
	return g.Check(ctx, c, params)
}

// FiniteGuard is AllFinite with its one-float communication buffer kept
// between calls, so that Check allocates nothing. The zero value is ready
// to use. A FiniteGuard is used by one goroutine at a time.
type FiniteGuard struct {
	// flag is allocated on its own, on first use: a buffer that shares an
	// allocation with Go pointers cannot be passed to a cgo backend such as
	// comm/mpi (see comm.Comm).
	flag []float32
}

// Check is AllFinite (see there) using g's buffer.
func (g *FiniteGuard) Check(ctx context.Context, c comm.Comm, params []*Param) (bool, error) {
	ok, _, err := g.check(ctx, c, params, false, nil)
	if err != nil {
		return false, fmt.Errorf("optim: %w", err)
	}
	return ok, nil
}

// Flag values of the agreement: 0 for finite gradients, 1 for a
// non-finite one, refusedFlag+W-1-r when rank r refuses the step, so that
// the maximum names the lowest refusing rank.
const refusedFlag = 2

// check is Check that also carries a refusal and the caller's flags: a
// rank that cannot take the step (refuse) still takes part in the
// allreduce, and every rank learns, in by, the lowest rank that refused
// (-1 when none did). When flags is not nil, its Local values travel in
// the same allreduce and their maximum over the ranks is written to
// flags.Agreed once it succeeded. It allocates nothing after the first
// call with flags of a given length and adds nothing to the wire but the
// flags. Its errors carry no package prefix: Check and the Frame add
// theirs.
func (g *FiniteGuard) check(ctx context.Context, c comm.Comm, params []*Param, refuse bool, flags *StepFlags) (ok bool, by int, err error) {
	bad := false
	if !refuse {
		for _, p := range params {
			if p != nil && !Finite(p.GradData()) {
				bad = true
				break
			}
		}
	}
	if c == nil || c.Size() <= 1 {
		if flags != nil {
			copy(flags.Agreed, flags.Local)
		}
		if refuse {
			return false, 0, nil
		}
		return !bad, -1, nil
	}
	n := 1
	if flags != nil {
		n += len(flags.Local)
	}
	if cap(g.flag) < n {
		g.flag = make([]float32, n)
	}
	g.flag = g.flag[:n]
	w := c.Size()
	switch {
	case refuse:
		g.flag[0] = float32(refusedFlag + w - 1 - c.Rank())
	case bad:
		g.flag[0] = 1
	default:
		g.flag[0] = 0
	}
	if flags != nil {
		copy(g.flag[1:], flags.Local)
	}
	if err := c.AllReduce(ctx, g.flag, comm.Max); err != nil {
		return false, -1, fmt.Errorf("agreeing on finite gradients: %w", err)
	}
	if flags != nil {
		copy(flags.Agreed, g.flag[1:])
	}
	if f := int(g.flag[0]); f >= refusedFlag {
		return false, w - 1 - (f - refusedFlag), nil
	}
	return g.flag[0] == 0, -1, nil
}

// Finite reports whether every element of x is finite. It does not branch
// per element: x*0 is 0 for a finite x and NaN for NaN or ±Inf, and a NaN
// survives the sum.
func Finite(x []float32) bool {
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+4 <= len(x); i += 4 {
		s0 += x[i] * 0
		s1 += x[i+1] * 0
		s2 += x[i+2] * 0
		s3 += x[i+3] * 0
	}
	for ; i < len(x); i++ {
		s0 += x[i] * 0
	}
	s := s0 + s1 + s2 + s3
	return s == s
}

// AverageGrads replaces every gradient of params by its mean over the ranks
// of c, with one exact allreduce (comm.Mean) per parameter; every rank ends
// with the same gradients. It does nothing when c is nil or c.Size() == 1.
// Every rank must call it with the same parameter shapes, in the same order.
// A nil entry takes part as an empty gradient, so that it is an error on
// every rank (a comm.MismatchError) unless every rank has nil there.
func AverageGrads(ctx context.Context, c comm.Comm, params []*Param) error {
	if c == nil || c.Size() <= 1 {
		return nil
	}
	for i, p := range params {
		if p == nil {
			if err := c.AllReduce(ctx, nil, comm.Mean); err != nil {
				return fmt.Errorf("optim: averaging gradient %d (nil on this rank): %w", i, err)
			}
			continue
		}
		if err := c.AllReduce(ctx, p.GradData(), comm.Mean); err != nil {
			return fmt.Errorf("optim: averaging gradient of %q: %w", p.Name, err)
		}
	}
	return nil
}
