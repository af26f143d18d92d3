package zero_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

// TestRankChange is zero.Adam's row of docs/gomlx.md's table "Changing
// the number of ranks", from 4 ranks to 2 and from 2 to 3: a rank's own
// checkpoint is refused, the error naming zero.Consolidate (and the
// generic check, optim.RankChange, names it too); Consolidate's checkpoint
// loads on every new rank and training goes on bit for bit as exact Adam's
// does from its checkpoint, which loads as it is.
func TestRankChange(t *testing.T) {
	cfg := zero.DefaultConfig()
	for _, move := range [][2]int{{4, 2}, {2, 3}} {
		from, to := move[0], move[1]
		t.Run(fmt.Sprintf("%dto%d", from, to), func(t *testing.T) {
			adam := run(t, runSpec{w: from, to: 3, mk: adamOpt(cfg.AdamConfig)})
			want := run(t, runSpec{w: to, from: 4, to: 6, mk: adamOpt(cfg.AdamConfig), load: func(r int) *optim.Checkpoint { return adam.cks[r%from] }})

			old := run(t, runSpec{w: from, to: 3, mk: zeroOpt(cfg)})
			require.NoError(t, local.Run(testCtx(t), to, func(ctx context.Context, c comm.Comm) error {
				ps := newParams(t, testShapes...)
				opt, err := zero.NewAdam(ctx, c, ps, cfg)
				if err != nil {
					return err
				}
				err = opt.Load(old.cks[c.Rank()%from])
				assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
				assert.ErrorContains(t, err, fmt.Sprintf("made on %d ranks, this group has %d;", from, to))
				assert.ErrorContains(t, err, "zero.Consolidate of every rank's checkpoint")
				assert.ErrorContains(t, old.cks[0].CheckCompatible(zero.Algorithm, to, ps), "zero.Consolidate(every old rank's checkpoint) joins the shards")
				return nil
			}))
			ck, err := zero.Consolidate(old.cks)
			require.NoError(t, err)
			got := run(t, runSpec{w: to, from: 4, to: 6, mk: zeroOpt(cfg), load: func(int) *optim.Checkpoint { return ck }})
			for r := range to {
				assert.Equal(t, bits(want.vals[r]), bits(got.vals[r]), "rank %d", r)
			}
		})
	}
}
