package optim

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/quant"
)

// ReduceMode is how an exact stage averages gradients over the ranks: the
// exact optimizers' every step, the warm-up of 1-bit Adam and 1-bit LAMB,
// and the variance steps of 0/1 Adam. The zero value is ReduceFP32.
type ReduceMode int

// The reduction modes. Their numbers are what checkpoints record (see
// IntGradReduce) and do not change.
const (
	// ReduceFP32 is an exact float32 allreduce (comm.Mean) per
	// parameter, as before reduction modes existed. The default.
	ReduceFP32 ReduceMode = iota
	// ReduceFP16 sends the gradients as IEEE half precision: the
	// gradients of all parameters, packed into one flat buffer, go
	// through quant.DownCast (rounded to fp16, reduce-scattered with
	// float32 sums in rank order divided by the group size, rounded to
	// fp16 again and all-gathered): about half the bytes of ReduceFP32.
	// A gradient of magnitude 65520 or more overflows: the step is then
	// skipped on every rank, as for a non-finite gradient.
	ReduceFP16
	// ReduceBF16 is ReduceFP16 with bfloat16 (float32's range, 8 bits of
	// precision).
	ReduceBF16
	// ReduceTwoLevel is the hierarchical float32 allreduce of the flat
	// buffer over a comm.Layout (quant.TwoLevel): a reduce-scatter inside
	// each node, an exchange across the nodes on each rail, and the
	// all-gathers back. Exact float32 sums (in another order than
	// ReduceFP32's), with far fewer bytes crossing machines.
	ReduceTwoLevel
	numReduceModes
)

var reduceNames = [numReduceModes]string{"fp32", "fp16", "bf16", "twolevel"}

// String returns "fp32", "fp16", "bf16" or "twolevel".
func (m ReduceMode) String() string {
	if m.Valid() {
		return reduceNames[m]
	}
	return fmt.Sprintf("ReduceMode(%d)", int(m))
}

// Valid reports whether m is one of the defined modes.
func (m ReduceMode) Valid() bool { return m >= 0 && m < numReduceModes }

// ParseReduceMode returns the mode called s ("fp32", "fp16", "bf16" or
// "twolevel").
func ParseReduceMode(s string) (ReduceMode, error) {
	for i, n := range reduceNames {
		if n == s {
			return ReduceMode(i), nil
		}
	}
	return 0, fmt.Errorf("optim: unknown reduction mode %q (want one of %q)", s, reduceNames[:])
}

// IntGradReduce is the checkpoint name of the reduction mode (its
// number). A checkpoint without it was made in ReduceFP32.
const IntGradReduce = "grad_reduce"

// GradAverager averages the gradients of a fixed list of parameters over
// the ranks of a communicator in one ReduceMode, in place, so that every
// rank ends with the same gradients. Except in ReduceFP32 the gradients
// travel in one flat buffer, one collective per step rather than one per
// parameter. Buffers are allocated on the first call (the two-level
// layout is built then, a collective); later calls allocate nothing.
//
// After averaging on more than one rank, Average checks that the result
// is finite (the same bytes on every rank, so every rank agrees without
// communicating) and returns an error wrapping ErrSkipStep when it is
// not. A GradAverager is used by one goroutine at a time.
type GradAverager struct {
	c            comm.Comm
	params       []*Param
	mode         ReduceMode
	ranksPerNode int

	n    int       // total elements
	flat []float32 // the gradients of every parameter, one after the other

	down   *quant.DownCast // ReduceFP16, ReduceBF16
	layout *comm.Layout    // ReduceTwoLevel
	two    *quant.TwoLevel // ReduceTwoLevel
	closed bool
}

// NewGradAverager returns an averager of params' gradients over c (nil or
// one rank: Average does nothing) in mode. ranksPerNode is the node size
// of ReduceTwoLevel, 0 to ask the backend (see comm.NewLayout); other
// modes ignore it.
func NewGradAverager(c comm.Comm, params []*Param, mode ReduceMode, ranksPerNode int) (*GradAverager, error) {
	if !mode.Valid() {
		return nil, fmt.Errorf("optim: invalid reduction mode %d", int(mode))
	}
	if ranksPerNode < 0 {
		return nil, fmt.Errorf("optim: ranks per node %d must be >= 0", ranksPerNode)
	}
	g := &GradAverager{c: c, params: params, mode: mode, ranksPerNode: ranksPerNode}
	for _, p := range params {
		g.n += p.Numel()
	}
	return g, nil
}

// Mode is the averager's reduction mode.
func (g *GradAverager) Mode() ReduceMode { return g.mode }

// Average replaces every gradient by its mean over the ranks; every rank
// calls it together, with the same parameter shapes.
func (g *GradAverager) Average(ctx context.Context) error {
	if g.closed {
		return fmt.Errorf("%w (gradient averager)", ErrClosed)
	}
	if g.c == nil || g.c.Size() <= 1 {
		return nil
	}
	if g.mode == ReduceFP32 {
		if err := AverageGrads(ctx, g.c, g.params); err != nil {
			return err
		}
		for _, p := range g.params {
			if !Finite(p.GradData()) {
				return fmt.Errorf("%w: the averaged gradient of %q is not finite", ErrSkipStep, p.Name)
			}
		}
		return nil
	}
	if err := g.alloc(ctx); err != nil {
		return err
	}
	off := 0
	for _, p := range g.params {
		off += copy(g.flat[off:], p.GradData())
	}
	var err error
	if g.down != nil {
		err = g.down.AllReduce(ctx, g.c, g.flat)
	} else {
		err = g.two.AllReduce(ctx, g.flat)
	}
	if err != nil {
		return fmt.Errorf("optim: averaging gradients (%s): %w", g.mode, err)
	}
	if !Finite(g.flat[:g.n]) {
		return fmt.Errorf("%w: the gradient averaged in %s is not finite (overflow)", ErrSkipStep, g.mode)
	}
	off = 0
	for _, p := range g.params {
		off += copy(p.GradData(), g.flat[off:])
	}
	return nil
}

// alloc allocates the flat buffer and the collective on first use (the
// two-level layout is a collective of its own). The flat buffer is its
// own allocation, as cgo backends need (see comm.Comm).
func (g *GradAverager) alloc(ctx context.Context) error {
	if g.flat != nil {
		return nil
	}
	switch g.mode {
	case ReduceFP16:
		g.down = quant.NewDownCast(quant.FP16)
	case ReduceBF16:
		g.down = quant.NewDownCast(quant.BF16)
	case ReduceTwoLevel:
		l, err := comm.NewLayout(ctx, g.c, g.ranksPerNode)
		if err != nil {
			return fmt.Errorf("optim: two-level averaging: %w", err)
		}
		two, err := quant.NewTwoLevel(l)
		if err != nil {
			l.Close()
			return fmt.Errorf("optim: two-level averaging: %w", err)
		}
		g.layout, g.two = l, two
	}
	g.flat = make([]float32, g.n)
	return nil
}

// bytesSent is what this rank sent on the communicators of its own (the
// two-level layout's), which the group's Stats do not count.
func (g *GradAverager) bytesSent() int64 {
	if g == nil || g.layout == nil {
		return 0
	}
	return CommBytes(g.layout.Intra) + CommBytes(g.layout.Inter)
}

// Close releases the two-level layout's communicators, if any. It is not
// a collective and is idempotent; Average fails after it.
func (g *GradAverager) Close() error {
	g.closed = true
	if g.layout == nil {
		return nil
	}
	err := g.layout.Close()
	g.layout, g.two, g.flat = nil, nil, nil
	return err
}

// modeOf reads the mode a checkpoint was made with (ReduceFP32 when it
// does not say) and refuses an unknown one.
func modeOf(ck *Checkpoint) (ReduceMode, error) {
	v, ok := ck.Ints[IntGradReduce]
	if !ok {
		return ReduceFP32, nil
	}
	if m := ReduceMode(v); int64(m) == v && m.Valid() {
		return m, nil
	}
	return 0, fmt.Errorf("%w: unknown gradient reduction mode %d", ErrIncompatibleCheckpoint, v)
}
