package outer_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// failingInner is a local Adam whose Step fails while fail is set, and
// that writes put into its first parameter's first element after a step
// when put is not 0 (then clears it).
type failingInner struct {
	*optim.Adam
	fail bool
	put  float32
	// flags are the flags runFailing carries, nil none.
	flags *optim.StepFlags
}

var errInnerFailed = errors.New("the inner optimizer failed")

func (a *failingInner) Step(ctx context.Context) error {
	if a.fail {
		return errInnerFailed
	}
	if err := a.Adam.Step(ctx); err != nil {
		return err
	}
	if a.put != 0 {
		a.Params()[0].Data()[0], a.put = a.put, 0
	}
	return nil
}

// newFailing returns an outer optimizer over a failingInner on params.
func newFailing(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, *failingInner, error) {
	in, err := optim.NewAdam(ctx, nil, ps, innerConfig())
	if err != nil {
		return nil, nil, err
	}
	fi := &failingInner{Adam: in}
	o, err := outer.New(ctx, c, fi, cfg)
	if err != nil {
		in.Close()
		return nil, nil, err
	}
	return o, fi, nil
}

// runRanksWithin is runRanks under a deadline: a rank left waiting ends
// the run (comm/local aborts the group) instead of blocking the test.
func runRanksWithin(t *testing.T, w int, d time.Duration, fn func(ctx context.Context, c comm.Comm) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	require.NoError(t, local.Run(ctx, w, fn))
}

// A rank whose Step fails (its inner optimizer fails, or its gradient
// changed size, or, with flags carried at the exchanges, it refuses the
// call) tells the others as a failure, with or without carried flags:
// every rank's Step fails at the agreement that hears of it (the
// others naming the rank and the call it failed at), every rank ends with
// the same call count, and every later Step fails at once on every rank,
// sending nothing, so that a loop that goes on after an error never
// blocks. A Load then puts the run back on track: it ends as one that
// never failed.
func TestFailureLeavesEveryRankFailed(t *testing.T) {
	const w, h, calls, after = 3, 4, 12, 3
	for _, k := range []struct {
		cfg   outer.Config
		flags flagMode
		spoil spoilMode
		at    int // the call that fails on rank 1
		heard int // the call whose Step fails on the other ranks
		steps int // every rank's Stats().Steps after the failure
	}{
		{config(outer.CodecFP32, h, 1, 0), noFlags, innerFails, 2, 4, 4},
		{config(outer.CodecFP32, h, 1, 0), perStep, innerFails, 2, 3, 2}, // the case: heard at the next call's flags agreement
		{config(outer.CodecFP32, h, 1, 0), perStep, innerFails, 4, 4, 4}, // an exchange call: heard at its agreement
		{config(outer.CodecFP32, h, 1, 0), perStep, resized, 2, 2, 1},    // before the inner step: heard at the same call
		{config(outer.CodecOneBit, h, 2, 1), noFlags, innerFails, 3, 4, 4},
		{config(outer.CodecOneBit, h, 2, 1), perStep, innerFails, 3, 4, 3},
		{config(outer.CodecOneBit, h, 2, 1), perStep, innerFails, 6, 6, 6},
		{config(outer.CodecOneBit, h, 2, 1), perStep, resized, 5, 5, 4},
		{config(outer.CodecInt8, h, 1, 2), perStep, innerFails, 5, 6, 5}, // exchange in flight
		{config(outer.CodecInt8, h, 1, 2), noFlags, resized, 5, 8, 8},
		// Flags carried at the exchanges: heard at the next exchange's
		// agreement, as without flags; a refusal is a failure.
		{config(outer.CodecFP32, h, 1, 0), atExchanges, innerFails, 2, 4, 4},
		{config(outer.CodecFP32, h, 1, 0), atExchanges, refused, 2, 4, 4},
		{config(outer.CodecFP32, h, 1, 0), atExchanges, refused, 4, 4, 4},
		{config(outer.CodecOneBit, h, 2, 1), atExchanges, refused, 5, 6, 6},
		{config(outer.CodecOneBit, h, 2, 1), atExchanges, resized, 3, 4, 4},
		{config(outer.CodecInt8, h, 1, 2), atExchanges, refused, 5, 8, 8}, // exchange in flight
		// The sparse codec's two-phase exchange, in flight and not.
		{twoPhase(config(outer.CodecSparse, h, 2, 1)), perStep, innerFails, 3, 4, 3},
		{twoPhase(config(outer.CodecSparse, h, 1, 2)), noFlags, resized, 5, 8, 8},
		{twoPhase(config(outer.CodecSparse, h, 2, 1)), atExchanges, refused, 5, 6, 6},
	} {
		name := fmt.Sprintf("%s/%s/F%d/D%d/%s/%s/at%d", k.cfg.Codec, k.cfg.SparseExchange, k.cfg.Fragments, k.cfg.Delay, k.flags, k.spoil, k.at)
		t.Run(name, func(t *testing.T) {
			want := runFailing(t, w, k.cfg, calls, k.flags, nil)
			first := newPerRank[error](w)
			firstAt := newPerRank[int](w)
			steps := newPerRank[int64](w)
			later := newPerRank[[]error](w)
			got := runFailing(t, w, k.cfg, calls, k.flags, func(ctx context.Context, c comm.Comm, o *outer.Optimizer, fi *failingInner, ps []*optim.Param, i int, err error) (bool, error) {
				if err == nil {
					if c.Rank() == 1 && i == k.at-1 {
						// Spoil call at on rank 1.
						switch k.spoil {
						case resized:
							ps[1].Grad = tensor.New(tensor.WithShape(ps[1].Numel()+1), tensor.Of(tensor.Float32))
						case refused:
							fi.flags.Refuse = errRefused
						default:
							fi.fail = true
						}
					}
					return false, nil
				}
				first.set(c.Rank(), err)
				firstAt.set(c.Rank(), i)
				steps.set(c.Rank(), o.Stats().Steps)
				var errs []error
				for range after {
					sent := o.Stats().BytesSent
					e := o.Step(ctx)
					if e == nil {
						return false, errors.New("a Step after the failure succeeded")
					}
					if o.Stats().BytesSent != sent {
						return false, errors.New("a Step after the failure communicated")
					}
					errs = append(errs, e)
				}
				later.set(c.Rank(), errs)
				if _, err := o.State(); err == nil {
					return false, errors.New("State after the failure succeeded")
				}
				if c.Rank() == 1 {
					fi.fail = false
					if fi.flags != nil {
						fi.flags.Refuse = nil
					}
					ps[1].Grad = tensor.New(tensor.WithShape(ps[1].Numel()), tensor.Of(tensor.Float32))
				}
				return true, nil // load the checkpoint of call at-1 and go on from call at
			}, k.at)
			for r := range w {
				require.Error(t, first.v[r], "rank %d", r)
				assert.NotErrorIs(t, first.v[r], comm.ErrAborted, "rank %d", r)
				assert.Equal(t, int64(k.steps), steps.v[r], "rank %d: call count after the failure", r)
				named := fmt.Sprintf("rank 1 failed at step %d", k.at)
				if r == 1 {
					assert.Equal(t, k.at, firstAt.v[r], "rank 1 fails at its own failing call")
					switch k.spoil {
					case resized:
						assert.ErrorContains(t, first.v[r], fmt.Sprintf("outer: step %d: parameter \"b\"", k.at))
					case refused:
						assert.ErrorIs(t, first.v[r], errRefused)
						assert.ErrorContains(t, first.v[r], fmt.Sprintf("outer: step %d:", k.at))
					default:
						assert.ErrorIs(t, first.v[r], errInnerFailed)
						assert.ErrorContains(t, first.v[r], fmt.Sprintf("outer: step %d: inner step", k.at))
					}
				} else {
					assert.Equal(t, k.heard, firstAt.v[r], "rank %d hears of the failure", r)
					assert.ErrorContains(t, first.v[r], named, "rank %d", r)
					assert.NotContains(t, first.v[r].Error(), "refused", "rank %d: a failure is not a refusal", r)
				}
				for _, e := range later.v[r] {
					assert.ErrorContains(t, e, fmt.Sprintf("outer: step %d: an earlier step failed", k.steps+1), "rank %d", r)
					if r == 1 {
						assert.ErrorContains(t, e, fmt.Sprintf("outer: step %d:", k.at), "rank 1")
					} else {
						assert.ErrorContains(t, e, named, "rank %d", r)
					}
				}
			}
			assert.Equal(t, want, got, "the run after Load differs from one that never failed")
		})
	}
}

// onStep is called after each Step of runFailing with its error; it
// returns whether to load the checkpoint taken after call loadAt-1 and go
// on from call loadAt.
type onStep func(ctx context.Context, c comm.Comm, o *outer.Optimizer, fi *failingInner, ps []*optim.Param, i int, err error) (reload bool, _ error)

// flagMode is how runFailing carries a step flag.
type flagMode int

const (
	noFlags     flagMode = iota
	perStep              // CarryFlags
	atExchanges          // CarryFlagsAtExchanges
)

func (m flagMode) String() string {
	return [...]string{"no-flags", "flags-per-step", "flags-at-exchanges"}[m]
}

// spoilMode is how TestFailureLeavesEveryRankFailed spoils a call.
type spoilMode int

const (
	innerFails spoilMode = iota // the inner optimizer's Step fails
	resized                     // a gradient changes size
	refused                     // StepFlags.Refuse is set
)

func (m spoilMode) String() string { return [...]string{"inner-fails", "resized", "refused"}[m] }

var errRefused = errors.New("no gradients here")

// runFailing runs calls Steps on w ranks over failingInner optimizers,
// carrying a step flag as flags says, and returns every rank's parameters
// and θ_g at the end. Without on, a Step error fails the run.
func runFailing(t *testing.T, w int, cfg outer.Config, calls int, flags flagMode, on onStep, loadAt ...int) [][]float32 {
	out := newPerRank[[]float32](w)
	runRanksWithin(t, w, 10*time.Second, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, fi, err := newFailing(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		defer fi.Close()
		defer o.Close()
		if flags != noFlags {
			fi.flags = &optim.StepFlags{Local: []float32{float32(c.Rank())}}
			carry := o.CarryFlags
			if flags == atExchanges {
				carry = o.CarryFlagsAtExchanges
			}
			if err := carry(fi.flags); err != nil {
				return err
			}
		}
		var ck *optim.Checkpoint
		on := on // this rank's: it stops after the reload
		for i := 1; i <= calls; i++ {
			setGrads(ps, c.Rank(), i)
			err := o.Step(ctx)
			if on == nil {
				if err != nil {
					return err
				}
				continue
			}
			reload, herr := on(ctx, c, o, fi, ps, i, err)
			if herr != nil {
				return fmt.Errorf("call %d: %w", i, herr)
			}
			if err == nil && i == loadAt[0]-1 {
				if ck, err = o.State(); err != nil {
					return err
				}
			}
			if reload {
				if err := o.Load(ck); err != nil {
					return err
				}
				i = loadAt[0] - 1
				on = nil
			}
		}
		if _, err := o.State(); err != nil { // waits for the exchange in flight
			return err
		}
		out.set(c.Rank(), append(flat(ps), o.Global()...))
		return nil
	})
	return out.v
}

// A pseudo-gradient of +Inf or -Inf (not NaN) on one rank skips the outer
// step on every rank, as a NaN does: θ_g and u unchanged, every rank
// restarts the fragment from θ_g.
func TestInfPseudoGradientSkipsOnEveryRank(t *testing.T) {
	const w, h = 2, 3
	for _, inf := range []float32{float32(math.Inf(1)), float32(math.Inf(-1))} {
		t.Run(fmt.Sprint(inf), func(t *testing.T) {
			out := newPerRank[[]float32](w)
			runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
				ps := newParams(t, sizes)
				o, fi, err := newFailing(ctx, c, ps, config(outer.CodecFP32, h, 1, 0))
				if err != nil {
					return err
				}
				defer fi.Close()
				defer o.Close()
				g0 := append([]float32(nil), o.Global()...)
				for i := 1; i <= h; i++ {
					setGrads(ps, c.Rank(), i)
					if i == h && c.Rank() == 1 {
						fi.put = inf // after the inner step: the pseudo-gradient is -inf
					}
					if err := o.Step(ctx); err != nil {
						return err
					}
				}
				if !assert.Equal(t, g0, o.Global()) || !assert.Equal(t, g0, flat(ps)) || !assert.Equal(t, make([]float32, len(g0)), o.Momentum()) {
					return errors.New("state changed")
				}
				out.set(c.Rank(), []float32{float32(o.OuterStats().Skipped), float32(o.OuterStats().Exchanges)})
				return nil
			})
			assert.Equal(t, [][]float32{{1, 0}, {1, 0}}, out.v, "skipped and applied exchanges per rank")
		})
	}
}

// With a delay, the exchange in flight runs on the optimizer's own
// context: a loop that gives each Step a context of its own and cancels
// it once Step returns (an ordinary Go habit) trains exactly as one that
// does not.
func TestStepContextCancelledAfterReturn(t *testing.T) {
	for _, w := range []int{2, 3} {
		for _, cfg := range []outer.Config{
			config(outer.CodecFP32, 4, 2, 2),
			config(outer.CodecOneBit, 6, 3, 2),
			config(outer.CodecInt8, 4, 1, 3),
			twoPhase(config(outer.CodecSparse, 6, 2, 3)),
		} {
			t.Run(fmt.Sprintf("W%d/%s/%s/F%d/D%d", w, cfg.Codec, cfg.SparseExchange, cfg.Fragments, cfg.Delay), func(t *testing.T) {
				run := func(cancelEach bool) [][]float32 {
					out := newPerRank[[]float32](w)
					runRanksWithin(t, w, 10*time.Second, func(ctx context.Context, c comm.Comm) error {
						ps := newParams(t, sizes)
						o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
						if err != nil {
							return err
						}
						defer o.Close()
						var cancels []context.CancelFunc // the Steps' contexts not cancelled yet
						defer func() {
							for _, cancel := range cancels {
								cancel()
							}
						}()
						for i := 1; i <= 14; i++ {
							setGrads(ps, c.Rank(), i)
							stepCtx, cancel := context.WithCancel(ctx)
							cancels = append(cancels, cancel)
							err := o.Step(stepCtx)
							if cancelEach {
								cancel()
							}
							if err != nil {
								return fmt.Errorf("step %d: %w", i, err)
							}
						}
						if _, err := o.State(); err != nil {
							return err
						}
						out.set(c.Rank(), append(append(flat(ps), o.Global()...), o.Momentum()...))
						return nil
					})
					return out.v
				}
				assert.Equal(t, run(false), run(true))
			})
		}
	}
}
