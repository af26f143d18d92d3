package onebit_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// TestConvergenceReduceModes is TestConvergence for the gradient
// averaging modes: exact Adam, and 1-bit Adam whose warm-up averages in
// the mode, trained with fp16, bf16 and two-level averaging (2 nodes of
// 2 ranks) on the same run as TestConvergence, must end within 0.5%
// (relative) of the final training loss and within 0.3 points of the
// accuracy of the same optimizer with fp32 averaging. It logs the table.
func TestConvergenceReduceModes(t *testing.T) {
	if testing.Short() || cvRace {
		t.Skip("the convergence run takes seconds; skipped in -short mode and under the race detector")
	}
	s := cvDefault
	var table strings.Builder
	fmt.Fprintf(&table, "\n%d ranks, %d-%d-%d network, %d steps of %d samples per rank, shards skewed %.1f, labels %.0f%% random, lr 0.005\n",
		s.World, s.In, s.Hidden, s.Classes, s.Steps, s.Batch, s.Skew, 100*s.Flip)
	fmt.Fprintf(&table, "bytes/step: mean bytes rank 0 sent per step; vs fp32: the fp32 run's total volume over this one\n")
	fmt.Fprintf(&table, "%-26s %9s %8s %9s %12s %8s %8s\n", "optimizer", "loss", "acc %", "Δloss %", "bytes/step", "vs fp32", "skipped")
	for _, opt := range []struct {
		name string
		mk   func(mode optim.ReduceMode) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)
	}{
		{"optim.Adam", func(mode optim.ReduceMode) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := optim.DefaultAdamConfig()
			cfg.LR = 0.005
			cfg.Reduce = mode
			cfg.RanksPerNode = 2
			return func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				return optim.NewAdam(context.Background(), c, ps, cfg)
			}
		}},
		{"onebit.Adam", func(mode optim.ReduceMode) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := onebit.DefaultAdamConfig()
			cfg.LR = 0.005
			cfg.FreezeStep = 100
			cfg.Reduce = mode
			cfg.RanksPerNode = 2
			return func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				return onebit.NewAdam(context.Background(), c, ps, cfg)
			}
		}},
	} {
		base := cvTrain(t, s, opt.mk(optim.ReduceFP32))
		row := func(mode optim.ReduceMode, r cvResult) {
			fmt.Fprintf(&table, "%-26s %9.6f %8.2f %+9.3f %12.1f %7.2fx %8d\n", opt.name+" "+mode.String(), r.loss, 100*r.acc,
				100*(r.loss-base.loss)/base.loss, float64(r.stats.BytesSent)/float64(r.stats.Steps),
				float64(base.stats.BytesSent)/float64(r.stats.BytesSent), r.stats.Skipped)
		}
		row(optim.ReduceFP32, base)
		for _, mode := range []optim.ReduceMode{optim.ReduceFP16, optim.ReduceBF16, optim.ReduceTwoLevel} {
			r := cvTrain(t, s, opt.mk(mode))
			row(mode, r)
			name := opt.name + " " + mode.String()
			assert.Equal(t, s.Steps, r.stats.Steps, name)
			assert.Zero(t, r.stats.Skipped, name)
			// Measured: at most 0.067% of loss and 0.06 points of
			// accuracy from fp32 (1-bit Adam bf16); the bounds leave a
			// margin of about 0.4% and 0.25 points.
			assert.InEpsilon(t, base.loss, r.loss, 0.005, "%s: final loss %.4f, fp32 %.4f", name, r.loss, base.loss)
			assert.InDelta(t, base.acc, r.acc, 0.003, "%s: accuracy %.4f, fp32 %.4f", name, r.acc, base.acc)
			if mode != optim.ReduceTwoLevel && opt.name == "optim.Adam" {
				// Half the gradient bytes; the finite-gradient flag is
				// the same in both.
				assert.Less(t, 1.9*float64(r.stats.BytesSent), float64(base.stats.BytesSent), name)
			}
		}
	}
	t.Log(table.String())
}
