package onebit_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/testnet"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// rehomeCase trains an optimizer on from ranks for k steps, checkpoints
// every rank (in stage), and loads the checkpoints on to ranks (new rank r
// takes old rank (r+1) % from's, another rank's), training on to steps.
type rehomeCase struct {
	name      string
	algorithm string
	stage     optim.Stage
	from, to  int
	k, steps  int64
	newOpt    func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error)
}

func rehomeCases() []rehomeCase {
	adamCfg := onebit.DefaultAdamConfig()
	adamCfg.LR = 0.01
	adamCfg.WeightDecay = 0.01
	adamCfg.FreezeStep = 3
	adamCfg.ExpAvgMask = map[string][]float32{"fc2.bias": {1, 0, 1}}
	newAdam := func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error) {
		return onebit.NewAdam(context.Background(), c, ps, adamCfg, opts...)
	}
	newLamb := func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error) {
		return onebit.NewLamb(context.Background(), c, ps, lambTestConfig(3), opts...)
	}
	newZeroOne := func(c comm.Comm, ps []*optim.Param, opts ...optim.Option) (optim.Optimizer, error) {
		return onebit.NewZeroOneAdam(context.Background(), c, ps, zeroOneTestConfig(), opts...)
	}
	return []rehomeCase{
		{"adam/4to2", optim.AlgorithmOnebitAdam, optim.StageCompression, 4, 2, 6, 10, newAdam},
		{"adam/2to3", optim.AlgorithmOnebitAdam, optim.StageCompression, 2, 3, 6, 10, newAdam},
		{"lamb/4to2", optim.AlgorithmOnebitLamb, optim.StageCompression, 4, 2, 6, 10, newLamb},
		{"lamb/4to1", optim.AlgorithmOnebitLamb, optim.StageCompression, 4, 1, 6, 10, newLamb},
		// Phase B at step 9 lies between synchronizations (9 is not a
		// multiple of the interval 2); steps 10 and 12 synchronize.
		{"zeroone/4to2", optim.AlgorithmZeroOneAdam, optim.StagePhaseB, 4, 2, 9, 12, newZeroOne},
	}
}

// A checkpoint made on one group size is refused on another, and loads
// there once its error buffers are reset on request: the error buffers
// start at zero, everything else is the checkpoint's, a warning says so,
// and training carries on with finite parameters that are identical on
// every rank.
func TestLoadResetErrorsOnAnotherWorldSize(t *testing.T) {
	for _, tc := range rehomeCases() {
		t.Run(tc.name, func(t *testing.T) {
			ctx := lzCtx(t)
			old := lzSetup(tc.from, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				return tc.newOpt(c, ps)
			})
			cks, err := old.Uninterrupted(ctx, tc.k, nil)
			require.NoError(t, err)
			for _, ck := range cks {
				require.Equal(t, tc.algorithm, ck.Algorithm)
				require.Equal(t, tc.stage, ck.Stage)
			}

			s := old
			s.World = tc.to
			d := s.Data()
			var mu sync.Mutex
			final := make([]*optim.Checkpoint, tc.to)
			err = local.Run(ctx, tc.to, func(ctx context.Context, c comm.Comm) error {
				r := c.Rank()
				core, logs := observer.New(zapcore.InfoLevel)
				net := testnet.New(s.Seed+1000, s.In, s.Hidden, s.Classes)
				opt, err := tc.newOpt(c, append(net.Params(), optim.NewParam("empty", 0)), optim.WithLogger(zap.New(core)))
				if err != nil {
					return err
				}
				// Train this group too, so that its error buffers are not
				// zero before the load.
				shard := d.Shard(r*s.ShardN, (r+1)*s.ShardN)
				if err := testnet.Train(ctx, opt, net, shard, s.Batch, 1, tc.k, nil); err != nil {
					return err
				}
				before, err := opt.State()
				if err != nil {
					return err
				}
				if tc.to > 1 && !someErrorNonZero(before) {
					return fmt.Errorf("the error buffers are zero before the load: the test shows nothing")
				}
				ck := cks[(r+1)%tc.from]

				// Without asking, the checkpoint is refused and nothing
				// changes.
				err = opt.Load(ck)
				if err == nil {
					return fmt.Errorf("a checkpoint of %d ranks loaded on %d", tc.from, tc.to)
				}
				assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
				assert.ErrorContains(t, err, fmt.Sprintf("made on %d ranks, this group has %d", tc.from, tc.to))
				if err := sameState(before, opt); err != nil {
					return fmt.Errorf("a refused load changed the optimizer: %w", err)
				}

				// Asked for, it loads.
				reset := ck.ResetErrors()
				for _, tn := range reset.Tensors {
					assert.False(t, optim.IsErrorBuffer(tn.Name), tn.Name)
				}
				if err := opt.Load(reset); err != nil {
					return err
				}
				assert.True(t, reset.ErrorsReset)
				got, err := opt.State()
				if err != nil {
					return err
				}
				// Error buffers: sized for this group, zero.
				nErr := 0
				for _, tn := range got.Tensors {
					if !optim.IsErrorBuffer(tn.Name) {
						continue
					}
					nErr++
					want := before.Tensor(tn.Name)
					if assert.NotNil(t, want, tn.Name) {
						assert.Equal(t, want.Shape, tn.Shape, tn.Name)
					}
					for i, x := range tn.Data {
						if x != 0 {
							return fmt.Errorf("error buffer %s[%d] is %v after the reset", tn.Name, i, x)
						}
					}
				}
				if tc.to > 1 {
					assert.Positive(t, nErr, "a %d-rank optimizer has error buffers", tc.to)
				}
				// Everything else: the checkpoint's, bit for bit.
				rest := got.ResetErrors()
				rest.World, rest.Rank = ck.World, ck.Rank
				if err := testnet.SameBits(reset, rest); err != nil {
					return fmt.Errorf("the loaded state differs from the checkpoint: %w", err)
				}
				// And it said so.
				warns := logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet("error buffers were reset").All()
				if assert.Len(t, warns, 1) {
					f := warns[0].ContextMap()
					assert.Equal(t, int64(tc.from), f["made_on_world"])
					assert.Equal(t, int64(tc.to), f["world"])
					assert.Equal(t, int64(r), f["rank"])
					assert.Equal(t, tc.algorithm, f["algorithm"])
				}

				if err := testnet.Train(ctx, opt, net, shard, s.Batch, tc.k+1, tc.steps, nil); err != nil {
					return err
				}
				out, err := opt.State()
				mu.Lock()
				final[r] = out
				mu.Unlock()
				return err
			})
			require.NoError(t, err)
			for r := range final {
				assert.Equal(t, tc.steps, final[r].Ints[optim.IntStep], "rank %d", r)
				lzAllFinite(t, final[r])
				if r > 0 {
					// 0/1 Adam too: its last step synchronizes.
					lzSameParams(t, final[0], final[r])
				}
			}
		})
	}
}

// someErrorNonZero reports whether some error buffer of ck holds a
// non-zero value.
func someErrorNonZero(ck *optim.Checkpoint) bool {
	for _, tn := range ck.Tensors {
		if optim.IsErrorBuffer(tn.Name) {
			for _, x := range tn.Data {
				if x != 0 {
					return true
				}
			}
		}
	}
	return false
}

// sameState reports how opt's state differs from want.
func sameState(want *optim.Checkpoint, opt optim.Optimizer) error {
	got, err := opt.State()
	if err != nil {
		return err
	}
	return testnet.SameBits(want, got)
}

// ResetErrors lifts the world-size check only: a reset checkpoint of
// another algorithm or of other shapes is still refused, and leaves the
// optimizer unchanged.
func TestLoadResetErrorsStillRefusesAlgorithmAndShapes(t *testing.T) {
	for _, tc := range rehomeCases() {
		if tc.to != 2 {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			ctx := lzCtx(t)
			old := lzSetup(tc.from, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				return tc.newOpt(c, ps)
			})
			cks, err := old.Uninterrupted(ctx, 2, nil)
			require.NoError(t, err)
			reset := cks[0].ResetErrors()

			cs, err := local.New(tc.to)
			require.NoError(t, err)
			net := testnet.New(99, old.In, old.Hidden, old.Classes)
			opt, err := tc.newOpt(cs[0], append(net.Params(), optim.NewParam("empty", 0)))
			require.NoError(t, err)
			before, err := opt.State()
			require.NoError(t, err)

			otherAlg := *reset
			otherAlg.Algorithm = optim.AlgorithmAdam
			if tc.algorithm == optim.AlgorithmOnebitAdam {
				otherAlg.Algorithm = optim.AlgorithmZeroOneAdam
			}
			otherShape := *reset
			otherShape.Tensors = append([]optim.Tensor(nil), reset.Tensors...)
			for i, tn := range otherShape.Tensors {
				if tn.Name == optim.ParamTensorName("fc1.bias") {
					otherShape.Tensors[i] = optim.Tensor{Name: tn.Name, Shape: []int{len(tn.Data) - 1}, Data: tn.Data[1:]}
				}
			}
			withBuffers := *cks[0]
			withBuffers.ErrorsReset = true // the flag without the buffers dropped

			for name, bad := range map[string]struct {
				ck   *optim.Checkpoint
				want string
			}{
				"algorithm":    {&otherAlg, "made by algorithm"},
				"shape":        {&otherShape, `parameter "fc1.bias" has shape`},
				"with buffers": {&withBuffers, "holds error buffer"},
			} {
				err := opt.Load(bad.ck)
				assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint, name)
				assert.ErrorContains(t, err, bad.want, name)
				assert.NoError(t, sameState(before, opt), "%s: a refused load changed the optimizer", name)
			}
		})
	}
}
