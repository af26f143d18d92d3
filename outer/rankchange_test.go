package outer_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// TestRankChange is the outer optimizer's rows of docs/gomlx.md's table
// "Changing the number of ranks", one per codec, each from 4 ranks to 2
// and from 2 to 3 between exchanges: a rank's own checkpoint is refused,
// the error naming outer.Regroup and what it carries; Regroup's checkpoint
// loads, θ_g and u carried bit for bit, the local parameters old rank
// r % W's, the sparse accumulator the old ranks' mean (a line that says
// so, no warning), the 1-bit codec's error buffers carried (a line that
// says so, no warning; TestRegroupOneBitCarriesTheErrorFeedback checks
// them); a ResetErrors copy of a sparse run's
// checkpoint warns that its accumulator restarts from zero.
func TestRankChange(t *testing.T) {
	for _, row := range []struct {
		name string // the table's row
		cfg  outer.Config
		log  string // the line Load logs after Regroup's checkpoint
		warn bool   // at Warn level
	}{
		{"fp32", config(outer.CodecFP32, 2, 1, 0), "this codec keeps none, nothing restarts from zero", false},
		{"int8", config(outer.CodecInt8, 2, 1, 0), "this codec keeps none, nothing restarts from zero", false},
		{"bf16", config(outer.CodecBF16, 2, 1, 0), "this codec keeps none, nothing restarts from zero", false},
		{"sparse", config(outer.CodecSparse, 2, 1, 0), "the sparse accumulator is the old ranks' mean", false},
		{"sparse two-phase", twoPhase(config(outer.CodecSparse, 2, 2, 0)), "the sparse accumulator is the old ranks' mean", false},
		{"sparse shared", shared(config(outer.CodecSparse, 2, 2, 0)), "the sparse accumulator is the old ranks' mean", false},
		{"1-bit", config(outer.CodecOneBit, 2, 1, 0), "the 1-bit codec's error feedback is carried", false},
	} {
		for _, move := range [][2]int{{4, 2}, {2, 3}} {
			from, to := move[0], move[1]
			t.Run(fmt.Sprintf("%s/%dto%d", row.name, from, to), func(t *testing.T) {
				old := states(t, from, 5, row.cfg)
				require.Equal(t, int64(-1), old[0].Ints[outer.IntPending])
				runRanks(t, to, func(ctx context.Context, c comm.Comm) error {
					r := c.Rank()
					core, logs := observer.New(zapcore.InfoLevel)
					o, err := outer.NewAdam(ctx, c, newParams(t, sizes), row.cfg, innerConfig(), optim.WithLogger(zap.New(core)))
					if err != nil {
						return err
					}
					defer o.Close()
					resets := func() []observer.LoggedEntry {
						defer logs.TakeAll()
						return logs.FilterMessageSnippet("error buffers were reset").All()
					}

					err = o.Load(old[r%from])
					assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
					assert.ErrorContains(t, err, fmt.Sprintf("made on %d ranks, this group has %d; outer.Regroup(", from, to))

					ck, err := outer.Regroup(old, to, r)
					if err != nil {
						return err
					}
					if err := o.Load(ck); err != nil {
						return err
					}
					got, err := o.State()
					if err != nil {
						return err
					}
					for _, name := range []string{outer.TensorGlobal, outer.TensorMomentum, optim.ParamTensorName("a"), optim.ParamTensorName("b")} {
						want := old[r%from].Tensor(name)
						require.NotNil(t, want, name)
						assert.Equal(t, bitsOf(want.Data), bitsOf(got.Tensor(name).Data), "%s carried", name)
					}
					if acc := ck.Tensor(outer.TensorRegroupedAccumulator); acc != nil {
						assert.Equal(t, bitsOf(acc.Data), bitsOf(got.Tensor(outer.AccumulatorName).Data), "the accumulators' mean carried")
					}
					for _, tn := range got.Tensors {
						switch {
						case !optim.IsErrorBuffer(tn.Name) || tn.Name == outer.AccumulatorName:
						case row.cfg.Codec == outer.CodecOneBit:
							assert.Equal(t, bitsOf(ck.Tensor(tn.Name).Data), bitsOf(tn.Data), "%s loaded as regrouped", tn.Name)
							if strings.HasPrefix(tn.Name, optim.WorkerErrorName) {
								assert.NotEqual(t, make([]float32, len(tn.Data)), tn.Data, "%s carried, not zero", tn.Name)
							}
						default:
							assert.Equal(t, make([]float32, len(tn.Data)), tn.Data, "%s starts at zero", tn.Name)
						}
					}
					lines := logs.FilterMessageSnippet(row.log).All()
					if assert.Len(t, lines, 1) {
						assert.Contains(t, lines[0].Message, "θ_g and u (the same on every rank), any exchange in flight, and the inner optimizer's state and local parameters of the rank that made it (made_by_rank) are carried")
						assert.Equal(t, row.warn, lines[0].Level == zapcore.WarnLevel)
						assert.Equal(t, int64(r%from), lines[0].ContextMap()["made_by_rank"])
					}
					for _, e := range logs.TakeAll() {
						assert.False(t, e.Level == zapcore.WarnLevel && !row.warn, "warned: %s", e.Message)
					}

					if row.cfg.Codec == outer.CodecSparse {
						if err := o.Load(old[r%from].ResetErrors()); err != nil {
							return err
						}
						if ws := resets(); assert.Len(t, ws, 1) {
							assert.Equal(t, zapcore.WarnLevel, ws[0].Level)
							assert.True(t, strings.Contains(ws[0].Message, "the sparse accumulator restarts from zero (outer.Regroup of every old rank's checkpoint carries their mean)"), ws[0].Message)
						}
					}
					for i := 6; i <= 7; i++ {
						setGrads(o.Params(), r, i)
						if err := o.Step(ctx); err != nil {
							return err
						}
					}
					return nil
				})
			})
		}
	}
}
