// Package hangmatrix is the hang matrix of lowbit's public collectives and
// optimizer steps: for each, a call in which one rank is given bad input
// (a nil or misfitting state, a resized gradient, an invalid format or
// schedule, a step after Close) while the others call correctly. Every
// rank must return an error, promptly, under context.Background(): none
// may wait for the bad rank. The cases run on any backend; the tests run
// them on comm/local (hangmatrix_test.go) and under mpirun
// (hangmatrix_mpi_test.go, scripts/test-mpi.sh).
package hangmatrix

import (
	"context"
	"errors"
	"fmt"
	"time"

	"gorgonia.org/tensor"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
	"github.com/lowbit-ml/lowbit/outer"
	"github.com/lowbit-ml/lowbit/quant"
)

// Case is one row of the matrix.
type Case struct {
	// Name is the collective or optimizer and the bad input.
	Name string
	// Setup prepares the call on every rank (collectives of its own, all
	// ranks correct) and returns it; bad says whether this rank gets the
	// bad input. Every rank calls Setup and then the call together.
	Setup func(ctx context.Context, c comm.Comm, bad bool) (call func(ctx context.Context) error, err error)
}

// n is the tensor length of the collectives' cases.
const n = 1000

// Cases returns the matrix for a group laid out with ranksPerNode ranks per
// node (for the two-level collectives).
func Cases(ranksPerNode int) []Case {
	return []Case{
		{"onebit.AllReduce: nil State", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			st, err := onebit.NewState(n, c.Size())
			if bad {
				st = nil
			}
			buf := make([]float32, n)
			return func(ctx context.Context) error { return onebit.AllReduce(ctx, c, buf, st) }, err
		}},
		{"onebit.AllReduce: State of another length", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			m := n
			if bad {
				m = n + 1
			}
			st, err := onebit.NewState(m, c.Size())
			buf := make([]float32, n)
			return func(ctx context.Context) error { return onebit.AllReduce(ctx, c, buf, st) }, err
		}},
		{"onebit.AllReduce: empty buf", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			m := n
			if bad {
				m = 0
			}
			st, err := onebit.NewState(m, c.Size())
			buf := make([]float32, m)
			return func(ctx context.Context) error { return onebit.AllReduce(ctx, c, buf, st) }, err
		}},
		{"onebit.AllReduceDevice (CPU): State of another length", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			dev := accel.NewCPU()
			m := n
			if bad {
				m = n / 2
			}
			st, err := onebit.NewDeviceState(dev, m, c.Size())
			if err != nil {
				return nil, err
			}
			b, err := dev.Alloc(4 * n)
			if err != nil {
				return nil, err
			}
			return func(ctx context.Context) error { return onebit.AllReduceDevice(ctx, c, accel.Whole(b), st) }, nil
		}},
		{"quant.QGZ.ReduceScatter: send of another length", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			l, err := comm.NewLayout(ctx, c, ranksPerNode)
			if err != nil {
				return nil, err
			}
			q, err := quant.NewQGZ(ctx, l, n, quant.QGZConfig{Bits: 8})
			if err != nil {
				return nil, err
			}
			send := make([]float32, n)
			if bad {
				send = send[:n-1]
			}
			recv := make([]float32, q.PartLen())
			return func(ctx context.Context) error { return q.ReduceScatter(ctx, send, recv) }, nil
		}},
		{"quant.NewQGZ: invalid bits", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			l, err := comm.NewLayout(ctx, c, ranksPerNode)
			if err != nil {
				return nil, err
			}
			bits := 8
			if bad {
				bits = 5
			}
			return func(ctx context.Context) error {
				_, err := quant.NewQGZ(ctx, l, n, quant.QGZConfig{Bits: bits})
				return err
			}, nil
		}},
		{"quant.TwoLevel.AllReduce: buf of another length", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			l, err := comm.NewLayout(ctx, c, ranksPerNode)
			if err != nil {
				return nil, err
			}
			tl, err := quant.NewTwoLevel(l)
			if err != nil {
				return nil, err
			}
			buf := make([]float32, n)
			if bad {
				buf = buf[:n-3]
			}
			return func(ctx context.Context) error { return tl.AllReduce(ctx, buf) }, nil
		}},
		{"quant.Coalesced.ReduceScatter: tensor of another size", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			rc, err := quant.NewCoalesced(ctx, c, []int{n, 7})
			if err != nil {
				return nil, err
			}
			in := [][]float32{make([]float32, n), make([]float32, 7)}
			if bad {
				in[1] = in[1][:6]
			}
			return func(ctx context.Context) error { _, err := rc.ReduceScatter(ctx, in); return err }, nil
		}},
		{"quant.DownCast.AllReduce: invalid format", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			f := quant.FP16
			if bad {
				f = quant.Format(9)
			}
			d := quant.NewDownCast(f)
			buf := make([]float32, n)
			return func(ctx context.Context) error { return d.AllReduce(ctx, c, buf) }, nil
		}},
		{"optim.GradAverager.Average (fp32): resized gradient", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			ps := params(bad)
			g, err := optim.NewGradAverager(c, ps, optim.ReduceFP32, 0)
			return func(ctx context.Context) error { return g.Average(ctx) }, err
		}},
		optimizer("optim.Adam.Step: resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return optim.NewAdam(ctx, c, ps, optim.DefaultAdamConfig())
		}),
		optimizer("optim.Lamb.Step: invalid scheduled learning rate", badSchedule, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return optim.NewLamb(ctx, c, ps, optim.DefaultLambConfig())
		}),
		optimizer("onebit.Adam.Step (compression): resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := onebit.DefaultAdamConfig()
			cfg.FreezeStep = 0
			return onebit.NewAdam(ctx, c, ps, cfg)
		}),
		optimizer("onebit.Adam.Step (StateSharded, warm-up): resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := onebit.DefaultAdamConfig()
			cfg.StateMode = onebit.StateSharded
			return onebit.NewAdam(ctx, c, ps, cfg)
		}),
		optimizer("onebit.Adam.Step (StateCompact, compression): resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := onebit.DefaultAdamConfig()
			cfg.StateMode, cfg.FreezeStep = onebit.StateCompact, 0
			return onebit.NewAdam(ctx, c, ps, cfg)
		}),
		optimizer("onebit.Lamb.Step: resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewLamb(ctx, c, ps, onebit.DefaultLambConfig())
		}),
		optimizer("onebit.ZeroOneAdam.Step: resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewZeroOneAdam(ctx, c, ps, onebit.DefaultZeroOneAdamConfig())
		}),
		optimizer("zero.Adam.Step: resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return zero.NewAdam(ctx, c, ps, zero.DefaultConfig())
		}),
		optimizer("zero.Adam.Step (int8): step after Close", closeIt, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := zero.DefaultConfig()
			cfg.ReduceScatter, cfg.RanksPerNode = zero.ReduceInt8, ranksPerNode
			return zero.NewAdam(ctx, c, ps, cfg)
		}),
		optimizer("outer.Optimizer.Step (fp32, H=2): resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := outer.DefaultConfig()
			cfg.H = 2 // the step under test is an exchange
			return outer.NewAdam(ctx, c, ps, cfg, optim.DefaultAdamConfig())
		}),
		optimizer("outer.Optimizer.Step (1bit, 2 fragments, exchange in flight): resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := outer.DefaultConfig()
			cfg.H, cfg.Fragments, cfg.Delay, cfg.Codec = 2, 2, 1, outer.CodecOneBit
			return outer.NewAdam(ctx, c, ps, cfg, optim.DefaultAdamConfig())
		}),
		optimizer("outer.Optimizer.Step (sparse, 2 fragments, exchange in flight): resized gradient", resize, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := outer.DefaultConfigFor(outer.CodecSparse)
			cfg.H, cfg.Fragments, cfg.Delay, cfg.SparseChunk, cfg.Density = 2, 2, 1, 8, 0.25
			return outer.NewAdam(ctx, c, ps, cfg, optim.DefaultAdamConfig())
		}),
		optimizer("outer.Optimizer.Step (int8, delay 1): step after Close", closeIt, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := outer.DefaultConfig()
			cfg.H, cfg.Delay, cfg.Codec = 2, 1, outer.CodecInt8
			return outer.NewAdam(ctx, c, ps, cfg, optim.DefaultAdamConfig())
		}),
		{"outer.NewAdam: invalid configuration", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			cfg := outer.DefaultConfig()
			if bad {
				cfg.H = 0
			}
			ps := params(false)
			return func(ctx context.Context) error {
				o, err := outer.NewAdam(ctx, c, ps, cfg, optim.DefaultAdamConfig())
				if err == nil {
					o.Close()
				}
				return err
			}, nil
		}},
		failingOuter("outer.Optimizer.Step (fp32, H=4): inner step fails on one rank between exchanges, every rank steps on", noFlags, false),
		failingOuter("outer.Optimizer.Step (fp32, H=4, carried flags): inner step fails on one rank between exchanges, every rank steps on", flagsPerStep, false),
		failingOuter("outer.Optimizer.Step (fp32, H=4, flags carried at the exchanges): inner step fails on one rank between exchanges, every rank steps on", flagsAtExchanges, false),
		failingOuter("outer.Optimizer.Step (1bit, H=4, flags carried at the exchanges): StepFlags.Refuse on one rank between exchanges, every rank steps on", flagsAtExchanges, true),
		refusing("onebit.Adam.Step: StepFlags.Refuse on one rank", func(ctx context.Context, c comm.Comm, ps []*optim.Param) (flagCarrier, error) {
			return onebit.NewAdam(ctx, c, ps, onebit.DefaultAdamConfig())
		}),
		refusing("outer.Optimizer.Step (1bit, H=50, carried flags): StepFlags.Refuse on one rank between exchanges", func(ctx context.Context, c comm.Comm, ps []*optim.Param) (flagCarrier, error) {
			cfg := outer.DefaultConfig()
			cfg.Codec = outer.CodecOneBit
			return outer.NewAdam(ctx, c, ps, cfg, optim.DefaultAdamConfig())
		}),
		optimizer("optim.Adam.Step: StepFlags on one rank only", carryFlags, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return optim.NewAdam(ctx, c, ps, optim.DefaultAdamConfig())
		}),
		{"zero.NewAdam: invalid configuration", func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
			cfg := zero.DefaultConfig()
			if bad {
				cfg.LR = -1
			}
			ps := params(false)
			return func(ctx context.Context) error { _, err := zero.NewAdam(ctx, c, ps, cfg); return err }, nil
		}},
	}
}

// params returns two parameters with gradients; bad resizes the second
// gradient.
func params(bad bool) []*optim.Param {
	ps := []*optim.Param{optim.NewParam("w", 20, 30), optim.NewParam("b", 30)}
	for _, p := range ps {
		for i := range p.GradData() {
			p.GradData()[i] = float32(i%7) * 0.01
		}
	}
	if bad {
		resizeGrad(ps[1])
	}
	return ps
}

func resizeGrad(p *optim.Param) {
	p.Grad = tensor.New(tensor.WithShape(p.Numel()+1), tensor.Of(tensor.Float32))
}

// A spoiler makes one rank's optimizer bad before its step.
type spoiler func(o optim.Optimizer) error

func resize(o optim.Optimizer) error { resizeGrad(o.Params()[1]); return nil }

// badSchedule sets a schedule that SetSchedule accepts (its first answer
// is valid) and whose learning rate at the step itself is negative, which
// the step refuses.
func badSchedule(o optim.Optimizer) error {
	s, ok := o.(optim.LRSetter)
	if !ok {
		return errors.New("not an optim.LRSetter")
	}
	return s.SetSchedule(&fading{})
}

// fading answers 1e-3 once, then -1e-3.
type fading struct{ calls int }

func (f *fading) LR(int64) float32 {
	f.calls++
	if f.calls == 1 {
		return 1e-3
	}
	return -1e-3
}
func (f *fading) String() string { return "fading" }

func closeIt(o optim.Optimizer) error {
	cl, ok := o.(interface{ Close() error })
	if !ok {
		return errors.New("no Close")
	}
	return cl.Close()
}

// carryFlags makes the optimizer carry step flags that the other ranks do
// not: its agreement is longer than theirs.
func carryFlags(o optim.Optimizer) error {
	fc, ok := o.(optim.FlagCarrier)
	if !ok {
		return errors.New("not an optim.FlagCarrier")
	}
	return fc.CarryFlags(&optim.StepFlags{Local: make([]float32, 3)})
}

// flagCarrier is an optimizer that carries step flags.
type flagCarrier interface {
	optim.Optimizer
	optim.FlagCarrier
}

// refusing is the case of an optimizer whose every rank carries step
// flags: one good step on every rank, then the bad rank refuses the step
// under test (StepFlags.Refuse).
func refusing(name string, mk func(ctx context.Context, c comm.Comm, ps []*optim.Param) (flagCarrier, error)) Case {
	return Case{name, func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
		o, err := mk(ctx, c, params(false))
		if err != nil {
			return nil, err
		}
		if err := o.Step(ctx); err != nil {
			return nil, fmt.Errorf("first step: %w", err)
		}
		sf := &optim.StepFlags{Local: make([]float32, 2)}
		if err := o.CarryFlags(sf); err != nil {
			return nil, err
		}
		if bad {
			sf.Refuse = errors.New("this rank cannot take the step")
		}
		return func(ctx context.Context) error { return o.Step(ctx) }, nil
	}}
}

// failingInner is a local Adam whose Step fails once fail is set.
type failingInner struct {
	*optim.Adam
	fail bool
}

func (a *failingInner) Step(ctx context.Context) error {
	if a.fail {
		return errors.New("the inner optimizer failed")
	}
	return a.Adam.Step(ctx)
}

// outerFlags is how failingOuter's optimizer carries step flags.
type outerFlags int

const (
	noFlags          outerFlags = iota
	flagsPerStep                // CarryFlags
	flagsAtExchanges            // CarryFlagsAtExchanges
)

// failingOuter is the case of an outer optimizer (H=4) whose inner
// optimizer fails (or, with refuse, which carries flags, whose StepFlags
// refuses) on the bad rank at the call after the first, between
// exchanges, with or without carried flags; every rank goes on calling
// Step after its error, as a loop that ignores errors would (stepOn). With
// refuse the codec is the 1-bit one, otherwise fp32.
func failingOuter(name string, flags outerFlags, refuse bool) Case {
	return Case{name, func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
		in, err := optim.NewAdam(ctx, nil, params(false), optim.DefaultAdamConfig())
		if err != nil {
			return nil, err
		}
		fi := &failingInner{Adam: in}
		cfg := outer.DefaultConfig()
		cfg.H = 4 // the calls under test are 2, 3 and the exchange at 4
		if refuse {
			cfg.Codec = outer.CodecOneBit
		}
		o, err := outer.New(ctx, c, fi, cfg)
		if err != nil {
			return nil, err
		}
		if err := o.Step(ctx); err != nil {
			return nil, fmt.Errorf("first step: %w", err)
		}
		sf := &optim.StepFlags{Local: make([]float32, 1)}
		switch flags {
		case flagsPerStep:
			err = o.CarryFlags(sf)
		case flagsAtExchanges:
			err = o.CarryFlagsAtExchanges(sf)
		}
		if err != nil {
			return nil, err
		}
		if bad && refuse {
			sf.Refuse = errors.New("this rank cannot take the step")
		} else {
			fi.fail = bad
		}
		return func(ctx context.Context) error { return stepOn(ctx, o, cfg.H-1) }, nil
	}}
}

// stepOn calls Step until one fails (at most n calls), then once more: a
// loop that goes on after an error must get an error at once from every
// later Step, on every rank, without waiting for the others (a rank left
// waiting there is released only when another rank's function returns and
// aborts the group, which the matrix reports). It returns both errors
// joined, or nil (which the matrix reports as a missing error) when no
// Step failed or the one after the failure did not.
func stepOn(ctx context.Context, o optim.Optimizer, n int) error {
	for range n {
		if err := o.Step(ctx); err != nil {
			again := o.Step(ctx)
			if again == nil {
				return nil
			}
			return errors.Join(err, again)
		}
	}
	return nil
}

// optimizer is the case of an optimizer's Step: built on every rank, one
// good step on every rank (so that the bad step is a later one), then spoil
// on the bad rank and the step under test.
func optimizer(name string, spoil spoiler, mk func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)) Case {
	return Case{name, func(ctx context.Context, c comm.Comm, bad bool) (func(context.Context) error, error) {
		o, err := mk(ctx, c, params(false))
		if err != nil {
			return nil, err
		}
		if err := o.Step(ctx); err != nil {
			return nil, fmt.Errorf("first step: %w", err)
		}
		if bad {
			if err := spoil(o); err != nil {
				return nil, err
			}
		}
		return func(ctx context.Context) error { return o.Step(ctx) }, nil
	}}
}

// Run runs case k on this rank: Setup, a barrier, then the call under
// context.Background() (so that only the algorithm, not a deadline, can
// end a wait for the bad rank), timed. It returns the call's error and how
// long it took on this rank.
func Run(ctx context.Context, c comm.Comm, k Case, bad bool) (callErr error, took time.Duration, err error) {
	call, err := k.Setup(ctx, c, bad)
	if err != nil {
		return nil, 0, fmt.Errorf("%s: setup: %w", k.Name, err)
	}
	if err := c.Barrier(ctx); err != nil {
		return nil, 0, fmt.Errorf("%s: barrier: %w", k.Name, err)
	}
	start := time.Now()
	callErr = call(context.Background())
	return callErr, time.Since(start), nil
}
