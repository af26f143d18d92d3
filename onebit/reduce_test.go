package onebit_test

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/testnet"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// reduceOptimizers builds each 1-bit optimizer with its exact stage (the
// warm-up, or 0/1 Adam's variance steps) averaging in mode, and that
// stage lasting the first warm steps.
func reduceOptimizers(mode optim.ReduceMode, warm int) map[string]func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
	adam := onebit.DefaultAdamConfig()
	adam.FreezeStep, adam.Reduce = warm, mode
	lamb := lambTestConfig(warm)
	lamb.Reduce = mode
	zo := zeroOneTestConfig()
	zo.VarFreezeStep, zo.VarUpdateScaler, zo.Reduce = warm, warm+1, mode
	return map[string]func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error){
		"onebit.Adam": func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			return onebit.NewAdam(context.Background(), c, ps, adam)
		},
		"onebit.Lamb":        newLamb(lamb),
		"onebit.ZeroOneAdam": newZeroOne(zo),
	}
}

// The exact stage of every 1-bit optimizer allocates nothing per step in
// the 16-bit and two-level modes once running, on two ranks.
func TestWarmupAllocatesNothingInEveryMode(t *testing.T) {
	const runs = 10
	for _, mode := range []optim.ReduceMode{optim.ReduceFP16, optim.ReduceBF16, optim.ReduceTwoLevel} {
		for name, mk := range reduceOptimizers(mode, 1000) {
			cs, err := local.New(2, local.WithRanksPerNode(1))
			require.NoError(t, err)
			ctx := lzCtx(t)
			opts := make([]optim.Optimizer, 2)
			for r := range cs {
				net := testnet.New(1, 8, 6, 3)
				for _, p := range net.Params() {
					for j := range p.GradData() {
						p.GradData()[j] = float32(r+1) * 0.01 * float32(j%7)
					}
				}
				opts[r], err = mk(cs[r], net.Params())
				require.NoError(t, err)
			}
			var wg sync.WaitGroup
			for r := range cs {
				wg.Go(func() { assert.NoError(t, opts[r].Step(ctx)) })
			}
			wg.Wait()
			done := make(chan struct{})
			go func() {
				defer close(done)
				for range runs + 1 {
					if err := opts[1].Step(ctx); err != nil {
						t.Error(err)
						return
					}
				}
			}()
			allocs := testing.AllocsPerRun(runs, func() {
				if err := opts[0].Step(ctx); err != nil {
					t.Error(err)
				}
			})
			<-done
			assert.Zero(t, allocs, "%s %s", name, mode)
			assert.Zero(t, opts[0].Stats().Skipped, "%s %s", name, mode)
			assert.NotEqual(t, optim.StageCompression, opts[0].Stats().Stage)
			for _, o := range opts {
				require.NoError(t, o.(interface{ Close() error }).Close())
			}
		}
	}
}

// A gradient that overflows fp16 in the exact stage makes every rank skip
// that step and change nothing but the counters; training goes on, and
// the ranks stay identical.
func TestWarmupSkipsFP16Overflow(t *testing.T) {
	for name, mk := range reduceOptimizers(optim.ReduceFP16, 6) {
		t.Run(name, func(t *testing.T) {
			s := lzSetup(3, mk)
			s.Empty = false
			d := s.Data()
			final := make([]*optim.Checkpoint, s.World)
			err := local.Run(lzCtx(t), s.World, func(ctx context.Context, c comm.Comm) error {
				net := testnet.New(s.Seed, s.In, s.Hidden, s.Classes)
				opt, err := mk(c, net.Params())
				if err != nil {
					return err
				}
				r := c.Rank()
				shard := d.Shard(r*s.ShardN, (r+1)*s.ShardN)
				// 11 steps, 10 applied: a synchronization of 0/1 Adam's
				// phase B, after which the ranks agree again.
				for step := int64(1); step <= 11; step++ {
					if _, err := net.LossGrad(shard.Batch(step, s.Batch)); err != nil {
						return err
					}
					if step == 3 && r == 2 {
						net.Params()[0].GradData()[5] = 1e5 // finite, beyond fp16
					}
					ck, err := opt.State()
					if err != nil {
						return err
					}
					if err := opt.Step(ctx); err != nil {
						return err
					}
					if step == 3 {
						after, err := opt.State()
						if err != nil {
							return err
						}
						ck.Ints[optim.IntSteps]++
						ck.Ints[optim.IntSkipped]++
						assert.NoError(t, testnet.SameBits(ck, after), "rank %d: the skipped step changed the state", r)
					}
				}
				assert.Equal(t, int64(1), opt.Stats().Skipped, "rank %d", r)
				final[r], err = opt.State()
				return err
			})
			require.NoError(t, err)
			lzSameParams(t, final[0], final[1])
			lzSameParams(t, final[0], final[2])
			for _, tn := range final[0].Tensors {
				require.True(t, optim.Finite(tn.Data), fmt.Sprint(tn.Name))
			}
		})
	}
}
