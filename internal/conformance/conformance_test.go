package conformance_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/conformance"
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
}
