package gomlx

import (
	"context"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/commtest"
	"github.com/lowbit-ml/lowbit/optim"
)

// TestOneAgreementPerStep: a step through the Optimizer's hook pays one
// agreement (one comm.Max allreduce), the lowbit optimizer's own, which
// carries the hook's flags, and no collective beyond the optimizer's: step
// for step, the hook makes the collectives the bare lowbit optimizer makes
// on the same parameters. Every lowbit optimizer, in every stage the run
// reaches: 1-bit Adam and LAMB compress from step 4, 0/1 Adam takes local
// steps from step 5.
func TestOneAgreementPerStep(t *testing.T) {
	for _, tc := range []struct {
		name  string
		build Builder
	}{
		{"adam", adam}, {"lamb", lamb}, {"onebit-adam", withFreeze(3)}, {"onebit-lamb", withLambFreeze(3)},
		{"zeroone-adam", zeroOneAdamLocal}, {"zero-adam", zeroAdam}, {"muon", muon},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const steps = 10
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			var mu sync.Mutex
			hooks, bares := make([][]commtest.Count, 2), make([][]commtest.Count, 2)
			err := local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
				r := c.Rank()
				cc := newCountingComm(c, 0)
				m := newRankModel(t, ctx, cc, newStore(int64(r)), 16, tc.build)
				defer m.opt.Close()
				var pre commtest.Count
				var hook []commtest.Count
				m.loop.OnStep("before lowbit", HookPriority-1, func(*train.Loop, []*tensors.Tensor) error {
					pre = cc.Count()
					return nil
				})
				m.loop.OnStep("after lowbit", HookPriority+1, func(*train.Loop, []*tensors.Tensor) error {
					hook = append(hook, cc.Count().Sub(pre))
					return nil
				})
				if _, err := m.loop.RunSteps(&shard{rank: r, world: 2}, steps); err != nil {
					return err
				}
				stats := m.opt.Optimizer().Stats()
				require.Equal(t, int64(steps), stats.Steps)
				require.Zero(t, stats.Skipped)

				// The bare lowbit optimizer, on copies of the parameters.
				params := make([]*optim.Param, len(m.opt.Params()))
				for i, p := range m.opt.Params() {
					var err error
					params[i], err = optim.NewParamFrom(p.Name, append([]float32(nil), p.Data()...), p.Shape()...)
					require.NoError(t, err)
				}
				bare, err := tc.build(ctx, cc, params)
				require.NoError(t, err)
				defer bare.Close()
				var counts []commtest.Count
				for s := range steps {
					for i, p := range params {
						g := p.GradData()
						for j := range g {
							g[j] = float32(0.1 * math.Sin(float64(j+7*i+11*s+13*r)))
						}
					}
					pre := cc.Count()
					require.NoError(t, bare.Step(ctx))
					counts = append(counts, cc.Count().Sub(pre))
				}
				mu.Lock()
				hooks[r], bares[r] = hook, counts
				mu.Unlock()
				return nil
			})
			require.NoError(t, err)
			for r := range 2 {
				require.Len(t, hooks[r], steps, "rank %d", r)
				for s := range steps {
					assert.Equal(t, int64(1), hooks[r][s].Agreements, "rank %d, step %d: agreements", r, s+1)
					assert.Equal(t, bares[r][s], hooks[r][s], "rank %d, step %d: the hook's collectives against the bare optimizer's", r, s+1)
				}
			}
		})
	}
}

// TestAllGatherVar: the variable-length allgather behind the exchange of
// the settings' texts and of the checkpoint steps gives every rank every
// rank's bytes in rank order, whatever their lengths: an empty entry stays
// empty (not nil), a rank with nothing to send is nil; on one rank, its
// own; and ranks that all send nothing still agree.
func TestAllGatherVar(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sent := [][]byte{[]byte("alpha"), {}, nil, []byte("xy")}
	var mu sync.Mutex
	got := make([][][]byte, len(sent))
	require.NoError(t, local.Run(ctx, len(sent), func(ctx context.Context, c comm.Comm) error {
		o := &Optimizer{ctx: ctx, c: c}
		all, err := o.allGatherVar(sent[c.Rank()], sent[c.Rank()] == nil)
		if err != nil {
			return err
		}
		none, err := o.allGatherVar([]byte("ignored"), true)
		if err != nil {
			return err
		}
		assert.Equal(t, make([][]byte, len(sent)), none)
		mu.Lock()
		defer mu.Unlock()
		got[c.Rank()] = all
		return nil
	}))
	for r, all := range got {
		require.Len(t, all, len(sent), "rank %d", r)
		for i, want := range sent {
			assert.Equal(t, want == nil, all[i] == nil, "rank %d's entry of rank %d: nil", r, i)
			assert.Equal(t, string(want), string(all[i]), "rank %d's entry of rank %d", r, i)
		}
	}
	one, err := (&Optimizer{ctx: ctx}).allGatherVar(nil, false)
	require.NoError(t, err)
	require.Len(t, one, 1)
	assert.NotNil(t, one[0], "one rank's empty entry")
	assert.Empty(t, one[0])
}
