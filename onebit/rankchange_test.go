package onebit_test

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
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// TestRankChange is the 1-bit optimizers' rows of docs/gomlx.md's table
// "Changing the number of ranks", each from 4 ranks to 2 and from 2 to 3
// in the compression stage (0/1 Adam: its local steps): a rank's own
// checkpoint is refused, the error naming onebit.Regroup first and
// ResetErrors as the lossy way, with what it drops; onebit.Regroup's
// checkpoint loads with nothing reset (no warning, the error buffers not
// zero, 1-bit Muon's momenta the old ranks' mean); a ResetErrors copy
// loads with a warning that says what restarted and what was carried, or,
// in StateSharded, is refused naming onebit.Regroup; the new group trains
// on.
func TestRankChange(t *testing.T) {
	adam := func(mode onebit.StateMode) func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error) {
		cfg := adamConfigForResume(2)
		cfg.StateMode = mode
		return func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error) {
			return onebit.NewAdam(context.Background(), c, ps, cfg, opts...)
		}
	}
	lamb := func(mode onebit.StateMode) func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error) {
		cfg := onebit.DefaultLambConfig()
		cfg.FreezeStep, cfg.LR, cfg.WeightDecay, cfg.StateMode = 2, 0.01, 0.01, mode
		return func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error) {
			return onebit.NewLamb(context.Background(), c, ps, cfg, opts...)
		}
	}
	zo := onebit.DefaultZeroOneAdamConfig()
	zo.VarFreezeStep, zo.LocalStepScaler = 2, 2
	for _, row := range []struct {
		name         string // the table's row
		mk           func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error)
		resetRefused bool // ResetErrors is no way there
	}{
		{"1-bit Adam StateFull", adam(onebit.StateFull), false},
		{"1-bit Adam StateCompact", adam(onebit.StateCompact), false},
		{"1-bit Adam StateSharded", adam(onebit.StateSharded), true},
		{"1-bit LAMB StateFull", lamb(onebit.StateFull), false},
		{"1-bit LAMB StateCompact", lamb(onebit.StateCompact), false},
		{"0/1 Adam", func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error) {
			return onebit.NewZeroOneAdam(context.Background(), c, ps, zo, opts...)
		}, false},
		{"1-bit Muon", func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error) {
			return onebit.NewMuon(context.Background(), c, ps, muonTestConfig(2), opts...)
		}, false},
	} {
		for _, move := range [][2]int{{4, 2}, {2, 3}} {
			from, to := move[0], move[1]
			t.Run(fmt.Sprintf("%s/%dto%d", row.name, from, to), func(t *testing.T) {
				old, _ := regroupRun(t, from, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) { return row.mk(c, ps) }, nil, 1, 4)
				muon := old[0].Algorithm == onebit.AlgorithmMuon
				require.NotEqual(t, optim.StageWarmup, old[0].Stage)
				err := local.Run(adamCtx(t), to, func(ctx context.Context, c comm.Comm) error {
					r := c.Rank()
					core, logs := observer.New(zapcore.WarnLevel)
					ps := adamParams(t, []int{3, 7}, []int{13}, []int{1})
					opt, err := row.mk(c, ps, optim.WithLogger(zap.New(core)))
					if err != nil {
						return err
					}
					defer opt.Close()
					warnings := func() []observer.LoggedEntry { return logs.TakeAll() }

					// A rank's own checkpoint: refused, naming the
					// lossless way first.
					err = opt.Load(old[r%from])
					assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
					msg := fmt.Sprint(err)
					assert.Contains(t, msg, fmt.Sprintf("made on %d ranks, this group has %d; onebit.Regroup(", from, to))
					assert.Contains(t, msg, "ResetErrors is the lossy way: it drops the error feedback")
					assert.Less(t, strings.Index(msg, "onebit.Regroup"), strings.Index(msg, "ResetErrors"))
					if muon {
						assert.Contains(t, msg, "keeps the momenta of the one rank that made the checkpoint")
					}

					// Regroup: lossless.
					ck, err := onebit.Regroup(old, to, r)
					if err != nil {
						return err
					}
					if err := opt.Load(ck); err != nil {
						return err
					}
					assert.Empty(t, warnings(), "nothing reset")
					got, err := opt.State()
					if err != nil {
						return err
					}
					assert.True(t, someErrorNonZero(got), "the error feedback is carried")
					if muon {
						for _, tn := range ck.Tensors {
							if strings.HasPrefix(tn.Name, optim.MomentumBufferPrefix) {
								assert.Equal(t, narrow(meanOf(old, tn.Name, len(tn.Data))), got.Tensor(tn.Name).Data, "%s: the old ranks' mean", tn.Name)
							}
						}
					}

					// ResetErrors: lossy, and the warning says what was
					// carried.
					err = opt.Load(old[r%from].ResetErrors())
					if row.resetRefused {
						assert.ErrorContains(t, err, "onebit.Regroup re-cuts them")
					} else {
						if err != nil {
							return err
						}
						got, err := opt.State()
						if err != nil {
							return err
						}
						assert.False(t, someErrorNonZero(got), "the error feedback restarts from zero")
						if ws := warnings(); assert.Len(t, ws, 1) {
							assert.Contains(t, ws[0].Message, "the error feedback starts again from zero")
							assert.Contains(t, ws[0].Message, "carried")
							assert.Contains(t, ws[0].Message, "onebit.Regroup of every old rank's checkpoint keeps the error feedback")
							assert.Equal(t, muon, strings.Contains(ws[0].Message, "not the ranks' mean"))
							assert.Equal(t, int64(r%from), ws[0].ContextMap()["made_by_rank"])
						}
					}

					adamGrads(ps, r%3, 5)
					return opt.Step(ctx)
				})
				require.NoError(t, err)
			})
		}
		// Another rank's checkpoint of the same group size: refused,
		// naming the rank's own and the lossless way (the sharded modes
		// name theirs: onebit.Regroup re-cuts them).
		t.Run(row.name+"/other-rank", func(t *testing.T) {
			old, _ := regroupRun(t, 2, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) { return row.mk(c, ps) }, nil, 1, 4)
			err := local.Run(adamCtx(t), 2, func(ctx context.Context, c comm.Comm) error {
				opt, err := row.mk(c, adamParams(t, []int{3, 7}, []int{13}, []int{1}))
				if err != nil {
					return err
				}
				defer opt.Close()
				err = opt.Load(old[1-c.Rank()])
				assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
				assert.ErrorContains(t, err, fmt.Sprintf("made by rank %d", 1-c.Rank()))
				assert.ErrorContains(t, err, "onebit.Regroup")
				if !row.resetRefused {
					assert.ErrorContains(t, err, "this rank's own checkpoint")
				}
				return nil
			})
			require.NoError(t, err)
		})
	}
}

// narrow is x rounded to float32.
func narrow(x []float64) []float32 {
	out := make([]float32, len(x))
	for i, v := range x {
		out[i] = float32(v)
	}
	return out
}
