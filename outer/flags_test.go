package outer_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// The bytes an exchange sends are counted however it runs: with a delay
// it runs between Steps on a communicator of its own, and a run of the
// same exchanges sends as many bytes as the synchronous one (plus the
// 1-bit collective's nothing: the same collectives, the same sizes).
func TestBytesCountedWithDelay(t *testing.T) {
	const w, h, calls = 3, 4, 12
	for _, codec := range allCodecs {
		sent := map[int]int64{}
		for _, delay := range []int{0, 2} {
			got := newPerRank[int64](w)
			runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
				ps := newParams(t, []int{1 << 12, 100})
				o, err := outer.NewAdam(ctx, c, ps, config(codec, h, 2, delay), innerConfig())
				if err != nil {
					return err
				}
				for i := 1; i <= calls; i++ {
					setGrads(ps, c.Rank(), i)
					if err := o.Step(ctx); err != nil {
						return err
					}
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
		assert.Equal(t, sent[0], sent[2], "%s: bytes with delay 2 against delay 0", codec)
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
