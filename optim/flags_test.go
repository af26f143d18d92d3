package optim_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/commtest"
	"github.com/lowbit-ml/lowbit/optim"
)

// TestStepFlags: flags carried by an optimizer's Step are agreed (the
// maximum over ranks) in the step's own agreement, with no collective of
// their own; Refuse on one rank fails the step on every rank with nothing
// changed; a Veto stops the step on every rank with nothing changed.
func TestStepFlags(t *testing.T) {
	const w = 3
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	errLocal := errors.New("rank 1 cannot read its gradients")
	errVeto := errors.New("vetoed")
	err := local.Run(ctx, w, func(ctx context.Context, c0 comm.Comm) error {
		c := commtest.Transparent{Counting: commtest.New(c0, 0)}
		p := optim.NewParam("w", 4)
		opt, err := optim.NewAdam(ctx, c, []*optim.Param{p}, optim.DefaultAdamConfig())
		if err != nil {
			return err
		}
		defer opt.Close()
		sf := &optim.StepFlags{Local: make([]float32, 2)}
		require.NoError(t, opt.CarryFlags(sf))
		require.Len(t, sf.Agreed, 2)
		grads := func() {
			for i := range p.GradData() {
				p.GradData()[i] = float32(c.Rank()+i) * 0.1
			}
		}

		// Step 1: the maximum of every rank's flags, one agreement plus
		// the gradient averaging (one allreduce per parameter).
		grads()
		sf.Local[0], sf.Local[1] = float32(c.Rank()), 0
		if c.Rank() == 2 {
			sf.Local[1] = 7
		}
		before := c.Count()
		require.NoError(t, opt.Step(ctx))
		assert.Equal(t, []float32{2, 7}, sf.Agreed, "rank %d", c.Rank())
		assert.Equal(t, commtest.Count{Calls: 2, Agreements: 1}, c.Count().Sub(before), "rank %d: the flags cost no collective of their own", c.Rank())
		require.EqualValues(t, 1, opt.Stats().Steps)

		// Step 2: rank 1 refuses.
		grads()
		snapshot := append([]float32(nil), p.Data()...)
		if c.Rank() == 1 {
			sf.Refuse = errLocal
		}
		err = opt.Step(ctx)
		sf.Refuse = nil
		if c.Rank() == 1 {
			require.ErrorIs(t, err, errLocal)
		} else {
			require.ErrorContains(t, err, "rank 1 refused the step")
		}
		assert.Equal(t, snapshot, p.Data(), "rank %d: nothing changes on a refusal", c.Rank())
		require.EqualValues(t, 1, opt.Stats().Steps)

		// Step 3: a veto on the agreed flags, on every rank alike.
		grads()
		sf.Local[0] = 0
		if c.Rank() == 0 {
			sf.Local[0] = 1
		}
		sf.Veto = func(agreed []float32) error {
			if agreed[0] != 0 {
				return fmt.Errorf("%w: flag %g", errVeto, agreed[0])
			}
			return nil
		}
		require.ErrorIs(t, opt.Step(ctx), errVeto, "rank %d", c.Rank())
		assert.Equal(t, snapshot, p.Data(), "rank %d: nothing changes on a veto", c.Rank())
		require.EqualValues(t, 1, opt.Stats().Steps)

		// Step 4: no flag set, the step goes ahead; then flags off.
		sf.Local[0] = 0
		require.NoError(t, opt.Step(ctx))
		require.EqualValues(t, 2, opt.Stats().Steps)
		require.NoError(t, opt.CarryFlags(nil))
		require.NoError(t, opt.Step(ctx))
		return nil
	})
	require.NoError(t, err)
}

// TestStepFlagsOneRank: without a communicator Agreed is Local.
func TestStepFlagsOneRank(t *testing.T) {
	p := optim.NewParam("w", 2)
	opt, err := optim.NewAdam(context.Background(), nil, []*optim.Param{p}, optim.DefaultAdamConfig())
	require.NoError(t, err)
	sf := &optim.StepFlags{Local: []float32{3}}
	require.NoError(t, opt.CarryFlags(sf))
	require.NoError(t, opt.Step(context.Background()))
	assert.Equal(t, []float32{3}, sf.Agreed)
}
