package conformance_test

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/conformance"
	"github.com/lowbit-ml/lowbit/optim"
)

func TestVectors(t *testing.T) {
	cases, err := conformance.Load(conformance.Dir())
	require.NoError(t, err)
	seen := map[string]int{}
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			switch c.Kind {
			case "signpack":
				require.NoError(t, conformance.RunSignpack(c))
			case "onebit":
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				require.NoError(t, local.Run(ctx, c.World, func(ctx context.Context, cm comm.Comm) error {
					return conformance.RunOnebitRank(ctx, cm, c)
				}))
			case "quant":
				require.NoError(t, conformance.RunQuant(c))
			case "qgz":
				q, err := c.QGZ()
				require.NoError(t, err)
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				require.NoError(t, local.Run(ctx, q.Nodes*q.RanksPerNode, func(ctx context.Context, cm comm.Comm) error {
					l, err := comm.NewLayout(ctx, cm, 0)
					if err != nil {
						return err
					}
					defer l.Close()
					return conformance.RunQGZRank(ctx, l, c)
				}, local.WithRanksPerNode(q.RanksPerNode)))
			case "rsc":
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				require.NoError(t, local.Run(ctx, c.WorldSize(), func(ctx context.Context, cm comm.Comm) error {
					return conformance.RunRSCRank(ctx, cm, c)
				}))
			case conformance.KindOptimizer:
				require.True(t, conformance.Replays(c), "optimizer %q", c.Optimizer)
				worst := replayOptimizer(t, c)
				require.NoError(t, worst.err)
				t.Logf("largest deviation %.3g", worst.dev)
				// Split orthogonalization: the same bits, so the same deviation.
				split := replayOptimizer(t, c, func(cfg *optim.MuonConfig) { cfg.Split = true })
				require.NoError(t, split.err, "with Split")
				require.Equal(t, worst.dev, split.dev, "with Split")
			default:
				t.Skipf("kind %q is not implemented yet", c.Kind)
			}
			seen[c.Kind]++
		})
	}
	require.GreaterOrEqual(t, seen["onebit"], 5, "every onebit vector must run")
	require.GreaterOrEqual(t, seen["signpack"], 2)
	require.GreaterOrEqual(t, seen["quant"], 2)
	require.GreaterOrEqual(t, seen["qgz"], 2)
	require.GreaterOrEqual(t, seen["rsc"], 1)
	require.GreaterOrEqual(t, seen[conformance.KindOptimizer], 1)
}

type replay struct {
	dev float64
	err error
}

// replayOptimizer replays an optimizer step file on its world of local
// ranks, its configuration changed by mods, and returns rank 0's largest
// deviation and the run's error.
func replayOptimizer(t *testing.T, c *conformance.Case, mods ...func(*optim.MuonConfig)) replay {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	devs := make([]float64, c.WorldSize())
	err := local.Run(ctx, c.WorldSize(), func(ctx context.Context, cm comm.Comm) error {
		var err error
		devs[cm.Rank()], err = conformance.RunOptimizerRank(ctx, cm, c, mods...)
		return err
	})
	for r, d := range devs {
		require.Equal(t, devs[0], d, "rank %d deviates otherwise than rank 0", r)
	}
	return replay{devs[0], err}
}

// A recorded parameter moved by 2e-5 fails the replay, at that step and
// element, and the largest deviation reports it.
func TestOptimizerReplayFails(t *testing.T) {
	path := filepath.Join(conformance.Dir(), "muon_w3.json")
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var run map[string]any
	require.NoError(t, json.Unmarshal(b, &run))
	step := run["steps"].([]any)[6].(map[string]any)
	p1 := step["params"].([]any)[1].([]any)
	p1[17] = p1[17].(float64) + 2e-5
	b, err = json.Marshal(run)
	require.NoError(t, err)
	bad := filepath.Join(t.TempDir(), "muon_bad.json")
	require.NoError(t, os.WriteFile(bad, b, 0o644))
	cases, err := conformance.Load(bad)
	require.NoError(t, err)
	require.Len(t, cases, 1)
	require.Equal(t, conformance.KindOptimizer, cases[0].Kind)
	got := replayOptimizer(t, cases[0])
	require.Error(t, got.err)
	assert.ErrorContains(t, got.err, "step 7: p1[17] = ")
	assert.InDelta(t, 2e-5, got.dev, 1e-6)
}
