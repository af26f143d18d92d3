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
			default:
				t.Skipf("kind %q is not implemented yet", c.Kind)
			}
			seen[c.Kind]++
		})
	}
	require.GreaterOrEqual(t, seen["onebit"], 5, "every onebit vector must run")
	require.GreaterOrEqual(t, seen["signpack"], 2)
}
