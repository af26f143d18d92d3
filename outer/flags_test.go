package outer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/commtest"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// The bytes an exchange sends are counted however it runs: with a delay
// it runs between Steps on a communicator of its own, and a run of the
// same exchanges sends as many bytes as the synchronous one (plus the
// 1-bit collective's nothing: the same collectives, the same sizes).
func TestBytesCountedWithDelay(t *testing.T) {
	const w, h, calls = 3, 4, 12
	for _, x := range exchangeCodecs {
		codec := x.Codec
		sent := map[int]int64{}
		for _, delay := range []int{0, 2} {
			got := newPerRank[int64](w)
			runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
				ps := newParams(t, []int{1 << 12, 100})
				cfg := config(codec, h, 2, delay)
				cfg.SparseExchange = x.SparseExchange
				o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
				if err != nil {
					return err
				}
				if err := stepCalls(ctx, o, ps, c.Rank(), calls); err != nil {
					return err
				}
				if err := o.Close(); err != nil { // waits for the exchange in flight
					return err
				}
				got.set(c.Rank(), o.Stats().BytesSent)
				return nil
			})
			sent[delay] = got.v[0]
		}
		// The last exchange (launched at call 12) is still in flight
		// with delay 2: Close waits for it, and its bytes count.
		assert.Equal(t, sent[0], sent[2], "%s %s: bytes with delay 2 against delay 0", codec, x.SparseExchange)
		assert.NotZero(t, sent[0])
	}
}

// Carried flags are agreed at every Step, before anything changes: a Veto
// (decided from the agreed flags) and a Refuse on one rank stop the Step
// on every rank with nothing changed; the run then goes on as if the
// stopped call had not been made.
func TestCarryFlags(t *testing.T) {
	const w, h, calls = 3, 3, 8
	cfg := config(outer.CodecOneBit, h, 1, 1)
	want := runStopped(t, adamInner, cfg, w, calls, -1, false)
	for _, at := range []int{1, 2, 3, 4} { // an exchange at 3, its merge at 4
		assert.Equal(t, want, runStopped(t, adamInner, cfg, w, calls, at, false), "veto at call %d", at)
		assert.Equal(t, want, runStopped(t, adamInner, cfg, w, calls, at, true), "refusal at call %d", at)
	}
}

// runStopped runs calls Steps of an outer optimizer of config cfg with
// inner optimizer k on w ranks, carrying flags, and returns every rank's
// parameters and θ_g at the end. At call stopAt (-1: none) rank 2 asks
// for a veto (refuse false) or rank 1 refuses (refuse true); it checks
// that every rank's Step fails as it should with nothing changed, and
// makes the same call again.
func runStopped(t *testing.T, k innerKind, cfg outer.Config, w, calls, stopAt int, refuse bool) [][]float32 {
	out := newPerRank[[]float32](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		ps := k.params(t)
		o, err := k.build(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		defer o.Close()
		sf := &optim.StepFlags{Local: []float32{0, float32(c.Rank())}}
		sf.Veto = func(agreed []float32) error {
			if agreed[0] != 0 {
				return errVeto
			}
			return nil
		}
		require.NoError(t, o.CarryFlags(sf))
		stopAt := stopAt // this rank's
		for i := 1; i <= calls; i++ {
			setGrads(ps, c.Rank(), i)
			stopped := i == stopAt
			sf.Local[0] = 0
			if stopped && !refuse && c.Rank() == 2 {
				sf.Local[0] = 1 // one rank asks: every rank vetoes
			}
			if stopped && refuse && c.Rank() == 1 {
				sf.Refuse = errors.New("no gradients here")
			}
			before := append(flat(ps), o.Global()...)
			err := o.Step(ctx)
			sf.Refuse = nil
			if stopped {
				switch {
				case !refuse:
					if !errors.Is(err, errVeto) {
						return fmt.Errorf("rank %d: step %d: %v, want the veto", c.Rank(), i, err)
					}
				case c.Rank() == 1:
					if err == nil || err.Error() != "no gradients here" {
						return fmt.Errorf("rank 1: step %d: %v, want its own refusal", i, err)
					}
				default:
					if err == nil || !assert.Contains(t, err.Error(), "rank 1 refused") {
						return fmt.Errorf("rank %d: step %d: %v, want rank 1's refusal", c.Rank(), i, err)
					}
				}
				if !assert.Equal(t, before, append(flat(ps), o.Global()...), "rank %d: the stopped step changed something", c.Rank()) {
					return errors.New("changed")
				}
				if sf.Agreed[1] != float32(w-1) {
					return fmt.Errorf("rank %d: agreed %v, want the maximum %d", c.Rank(), sf.Agreed, w-1)
				}
				i-- // the same call again
				stopAt = -1
				continue
			}
			if err != nil {
				return err
			}
		}
		out.set(c.Rank(), append(flat(ps), o.Global()...))
		return nil
	})
	return out.v
}

var errVeto = errors.New("stop requested")

// vetoFlag is one flag carried at an outer optimizer's exchanges that
// vetoes an exchange, with errVeto, where any rank set it.
type vetoFlag struct {
	sf    *optim.StepFlags
	asked int // the Veto's calls
}

// newVetoing is outer.NewAdam of cfg over ps on c carrying a vetoFlag at
// its exchanges; the caller closes it.
func newVetoing(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, *vetoFlag, error) {
	o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
	if err != nil {
		return nil, nil, err
	}
	v := &vetoFlag{}
	v.sf = &optim.StepFlags{Local: []float32{0}, Veto: func(agreed []float32) error {
		v.asked++
		if agreed[0] != 0 {
			return errVeto
		}
		return nil
	}}
	if err := o.CarryFlagsAtExchanges(v.sf); err != nil {
		o.Close()
		return nil, nil, err
	}
	return o, v, nil
}

// set sets this rank's flag for the next Step: veto or not.
func (v *vetoFlag) set(veto bool) {
	v.sf.Local[0] = 0
	if veto {
		v.sf.Local[0] = 1
	}
}

// The learning rate is the inner optimizer's: SetLR, SetSchedule and LR
// reach it, and a checkpoint keeps it.
func TestLearningRate(t *testing.T) {
	runRanks(t, 2, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, err := outer.NewAdam(ctx, c, ps, config(outer.CodecFP32, 2, 1, 0), innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		assert.Equal(t, float32(0.01), o.LR())
		require.NoError(t, o.SetLR(0.02))
		assert.Equal(t, float32(0.02), o.LR())
		assert.Equal(t, float32(0.02), o.Inner().(optim.LRSetter).LR())
		assert.Error(t, o.SetLR(-1))
		sched, err := optim.StepDecay(0.04, 0.5, 10)
		require.NoError(t, err)
		require.NoError(t, o.SetSchedule(sched))
		assert.Equal(t, float32(0.04), o.LR())
		return nil
	})
}

// Flags carried at the exchanges (CarryFlagsAtExchanges): a Step that
// launches no exchange sends nothing, neither a byte (the communicator's
// own count, and Stats().LastStepBytes) nor a collective (a counting
// wrapper under the optimizer); an exchange's Step sends what it sends
// without flags plus 4 bytes per flag in its agreement; Agreed is written
// at the exchanges only, the maximum over the ranks; and the run ends
// bit-identical to one that carries no flags. The exchanges run within
// their Steps (no delay) so that every byte sent is a Step's.
func TestCarryFlagsAtExchangesSendsNothingBetween(t *testing.T) {
	const w, h, calls = 3, 4, 12
	for _, cfg := range []outer.Config{
		config(outer.CodecFP32, h, 1, 0),
		config(outer.CodecOneBit, h, 2, 0), // exchanges at the calls 2, 4, 6, ...
		config(outer.CodecSparse, h, 2, 0),
		twoPhase(config(outer.CodecSparse, h, 2, 0)),
	} {
		t.Run(fmt.Sprintf("%s/F%d/%s", cfg.Codec, cfg.Fragments, cfg.SparseExchange), func(t *testing.T) {
			run := func(carry bool) ([][]float32, [][]int64) {
				out := newPerRank[[]float32](w)
				sent := newPerRank[[]int64](w) // per call: bytes, collectives
				runRanksWithin(t, w, 10*time.Second, func(ctx context.Context, c comm.Comm) error {
					cc := commtest.New(c, 0)
					ps := newParams(t, sizes)
					o, err := outer.NewAdam(ctx, cc, ps, cfg, innerConfig())
					if err != nil {
						return err
					}
					defer o.Close()
					sf := &optim.StepFlags{Local: []float32{float32(c.Rank()), 0}, Agreed: make([]float32, 2)}
					if carry {
						require.NoError(t, o.CarryFlagsAtExchanges(sf))
					}
					exchanges := o.OuterStats().Exchanges
					var per []int64
					for i := 1; i <= calls; i++ {
						setGrads(ps, c.Rank(), i)
						sf.Agreed[0], sf.Local[1] = -1, float32(i)
						bytes, calls := c.Stats().Total().BytesSent, cc.Count().Calls
						if err := o.Step(ctx); err != nil {
							return err
						}
						bytes = c.Stats().Total().BytesSent - bytes
						if o.Stats().LastStepBytes != bytes {
							return fmt.Errorf("call %d: LastStepBytes %d, the communicator counted %d", i, o.Stats().LastStepBytes, bytes)
						}
						per = append(per, bytes, cc.Count().Calls-calls)
						exchanged := o.OuterStats().Exchanges != exchanges
						exchanges = o.OuterStats().Exchanges
						switch {
						case !carry:
						case exchanged && sf.Agreed[0] != float32(w-1):
							return fmt.Errorf("call %d, an exchange: agreed %v, want the maximum over the ranks %d", i, sf.Agreed, w-1)
						case exchanged && sf.Agreed[1] != float32(i):
							return fmt.Errorf("call %d, an exchange: agreed %v, want this call's flags", i, sf.Agreed)
						case !exchanged && sf.Agreed[0] != -1:
							return fmt.Errorf("call %d, no exchange: Agreed written (%v)", i, sf.Agreed)
						}
					}
					out.set(c.Rank(), append(flat(ps), o.Global()...))
					sent.set(c.Rank(), per)
					return nil
				})
				return out.v, sent.v
			}
			bare, bareSent := run(false)
			got, gotSent := run(true)
			assert.Equal(t, bare, got, "carrying flags changed the run")
			for r := range w {
				for i := 1; i <= calls; i++ {
					bytes, colls := gotSent[r][2*i-2], gotSent[r][2*i-1]
					if bareSent[r][2*i-2] == 0 {
						assert.Zero(t, bytes, "rank %d, call %d: bytes sent between exchanges", r, i)
						assert.Zero(t, colls, "rank %d, call %d: collectives between exchanges", r, i)
						continue
					}
					// The agreement's all-gather: 4 bytes per flag to each of the W-1 others.
					assert.Equal(t, bareSent[r][2*i-2]+int64(4*2*(w-1)), bytes, "rank %d, call %d: an exchange's bytes", r, i)
					assert.Equal(t, bareSent[r][2*i-1], colls, "rank %d, call %d: an exchange's collectives", r, i)
				}
			}
		})
	}
}

// Flags carried at the exchanges: the Veto is asked at an exchange's call
// only, with the flags agreed there, and a veto there stops the exchange
// on every rank alike: θ_g and u unchanged, every rank keeps its own
// parameters, the call counts, and the run goes on (the fragment's next
// exchange carries both periods' progress). A flag set between exchanges
// only vetoes nothing (no rank hears of it).
func TestCarryFlagsAtExchangesVeto(t *testing.T) {
	const w, h, calls = 3, 4, 10
	cfg := config(outer.CodecFP32, h, 1, 0)
	runRanksWithin(t, w, 10*time.Second, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, veto, err := newVetoing(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		defer o.Close()
		for i := 1; i <= calls; i++ {
			setGrads(ps, c.Rank(), i)
			veto.set(c.Rank() == 2 && (i == 2 || i == 4)) // a non-exchange call, then an exchange's
			g, u := slices.Clone(o.Global()), slices.Clone(o.Momentum())
			err := o.Step(ctx)
			if i != 4 {
				if err != nil {
					return fmt.Errorf("call %d: %w", i, err)
				}
				continue
			}
			if !errors.Is(err, errVeto) {
				return fmt.Errorf("rank %d: call 4: %v, want the veto", c.Rank(), err)
			}
			assert.Equal(t, g, o.Global(), "rank %d: θ_g changed", c.Rank())
			assert.Equal(t, u, o.Momentum(), "rank %d: u changed", c.Rank())
			assert.NotEqual(t, g, flat(ps), "rank %d: the rank's own parameters were reset", c.Rank())
			assert.Equal(t, int64(4), o.Stats().Steps, "rank %d: the vetoed call counts", c.Rank())
			assert.Zero(t, o.OuterStats().Exchanges, "rank %d", c.Rank())
		}
		assert.Equal(t, 2, veto.asked, "rank %d: the Veto is asked at the exchanges' calls only", c.Rank())
		assert.Equal(t, int64(1), o.OuterStats().Exchanges, "rank %d: the exchange at call 8", c.Rank())
		return nil
	})
}
