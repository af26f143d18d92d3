package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/quant"
)

func TestBenchQuantCollectives(t *testing.T) {
	cfg, err := parseBenchFlags(strings.Fields(
		"--b 4K --e 16K --f 4 --w 1 --n 2 --collective reducescatter,qgz4,qgz8,rsc --ranks 8 --ranks-per-node 4 --check --json"), io.Discard)
	require.NoError(t, err)
	require.Equal(t, 4, cfg.rpn)
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = runBench(ctx, cfg, &out)
	require.NoError(t, err)
	var res benchResult
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	require.Len(t, res.Results, 8)
	exact := map[int64]int64{}
	for _, row := range res.Results {
		require.NotNil(t, row.RelError, row.Collective)
		switch row.Collective {
		case "reducescatter":
			exact[row.Bytes] = row.WireBytesPerRank
		case "qgz4", "qgz8":
			require.NotNil(t, row.WireIntraPerRank)
			require.NotNil(t, row.WireInterPerRank)
			require.NotNil(t, row.WireFP16Ring)
			assert.Equal(t, "2 nodes x 4 ranks", row.Layout)
			assert.Equal(t, row.WireBytesPerRank, *row.WireIntraPerRank+*row.WireInterPerRank)
			// Cross-node, 2 nodes: one partition of P = n/W elements, as
			// codes (bits/8 bytes each), scales and a 16-byte header.
			bits := map[string]int{"qgz4": 4, "qgz8": 8}[row.Collective]
			p := row.ElementsPerRank / 8
			want := 16 + quant.CodesLen(p, bits) + 4*quant.NumGroups(p, quant.DefaultGroupSize)
			assert.Equal(t, int64(want), *row.WireInterPerRank, row.Collective)
			assert.Greater(t, row.CompressionRatio, map[string]float64{"qgz4": 5, "qgz8": 2.5}[row.Collective])
			assert.Less(t, *row.RelError, map[string]float64{"qgz4": qgz4Tolerance, "qgz8": qgz8Tolerance}[row.Collective])
		case "rsc":
			assert.Less(t, *row.RelError, exactTolerance)
			assert.Nil(t, row.WireIntraPerRank)
		}
	}
	for _, row := range res.Results {
		if row.Collective == "qgz4" || row.Collective == "qgz8" || row.Collective == "rsc" {
			assert.InDelta(t, float64(exact[row.Bytes])/float64(row.WireBytesPerRank), row.CompressionRatio, 1e-9)
		}
	}

	// The table names the split.
	cfg.format = "table"
	cfg.collectives = []string{"qgz4"}
	cfg.sizes = cfg.sizes[:1]
	out.Reset()
	_, err = runBench(ctx, cfg, &out)
	require.NoError(t, err)
	assert.Contains(t, out.String(), "intra-node")
	assert.Contains(t, out.String(), "cross-node")
	assert.Contains(t, out.String(), "fp16 ring")
}

func TestBenchQuantBadLayout(t *testing.T) {
	cfg, err := parseBenchFlags(strings.Fields("--b 4K --e 4K --w 0 --n 1 --collective qgz8 --ranks 6 --ranks-per-node 4"), io.Discard)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	_, err = runBench(ctx, cfg, io.Discard)
	require.ErrorContains(t, err, "does not divide")
	require.Less(t, time.Since(start), 30*time.Second)
}
