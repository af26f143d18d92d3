package gomlx

import (
	"bytes"
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// TestOuterNoExchangeWarned: a run whose steps end before the outer
// optimizer's first exchange (H above them) leaves its global model the
// initial one: Close warns, on rank 0, with the steps and the first
// exchange's; a run that exchanged does not.
func TestOuterNoExchangeWarned(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, tc := range []struct {
		h, steps int
		warned   bool
	}{{10, 3, true}, {2, 3, false}} {
		var mu sync.Mutex
		var warnings [2]bytes.Buffer
		require.NoError(t, local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
			r := c.Rank()
			m := newRankModel(t, ctx, c, newStore(int64(r)), 16, outerAdam(tc.h, 1, 0, outer.CodecFP32))
			var buf bytes.Buffer
			WithWarnings(&buf)(m.opt)
			if _, err := m.loop.RunSteps(&shard{rank: r, world: 2}, tc.steps); err != nil {
				return err
			}
			err := m.opt.Close()
			mu.Lock()
			warnings[r] = buf
			mu.Unlock()
			return err
		}))
		const want = "the outer optimizer took 3 inner steps and no exchange: its first merges at inner step 10 (H 10, 1 fragment(s), delay 0), " +
			"so its global model is the initial one"
		if tc.warned {
			assert.Contains(t, warnings[0].String(), want)
		} else {
			assert.NotContains(t, warnings[0].String(), "no exchange", "H %d", tc.h)
		}
		assert.NotContains(t, warnings[1].String(), "no exchange", "rank 1 does not warn")
	}
}

// TestOuterMuonSparseRefused: NewOuterMuon with the sparse codec, which
// does not suit Muon inside (docs/outer.md), fails on every rank, saying
// how to insist (outer.Config.SparseWithMuon), before any training step.
func TestOuterMuonSparseRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cfg := outer.DefaultConfigFor(outer.CodecSparse)
	cfg.H, cfg.SparseChunk, cfg.Density = 4, 16, 0.25
	errs := make([]error, 2)
	_ = local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
		ps := []*optim.Param{optim.NewParam("/hidden/dense/weights", 8, 16), optim.NewParam("/hidden/dense/biases", 16),
			optim.NewParam("/out/dense/weights", 16, 4)}
		_, err := NewOuterMuon(cfg, muonConfig())(ctx, c, ps)
		errs[c.Rank()] = err
		return err
	})
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "set Config.SparseWithMuon to insist", "rank %d", r)
	}
}
