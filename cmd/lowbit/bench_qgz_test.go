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
		"--b 4Ki --e 16Ki --f 4 --w 1 --n 2 --collective reducescatter,qgz4,qgz8,rsc --ranks 8 --ranks-per-node 4 --check --json"), io.Discard)
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
	cfg, err := parseBenchFlags(strings.Fields("--b 4Ki --e 4Ki --w 0 --n 1 --collective qgz8 --ranks 6 --ranks-per-node 4"), io.Discard)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	_, err = runBench(ctx, cfg, io.Discard)
	require.ErrorContains(t, err, "does not divide")
	require.Less(t, time.Since(start), 30*time.Second)
}

func TestBenchHalfCollectives(t *testing.T) {
	cfg, err := parseBenchFlags(strings.Fields(
		"--b 4Ki --e 16Ki --f 4 --w 1 --n 2 --collective allreduce,fp16,bf16,twolevel --ranks 4 --ranks-per-node 2 --check --json"), io.Discard)
	require.NoError(t, err)
	var out bytes.Buffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = runBench(ctx, cfg, &out)
	require.NoError(t, err)
	var res benchResult
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	require.Len(t, res.Results, 8)
	for _, row := range res.Results {
		require.NotNil(t, row.RelError, row.Collective)
		switch row.Collective {
		case "fp16", "bf16":
			require.NotNil(t, row.ConvertUs, row.Collective)
			require.NotNil(t, row.CommUs, row.Collective)
			assert.Greater(t, *row.ConvertUs+*row.CommUs, 0.0, row.Collective)
			assert.InDelta(t, 2, row.CompressionRatio, 0.05, row.Collective) // and a length header per chunk
			assert.Less(t, *row.RelError, map[string]float64{"fp16": fp16Tolerance, "bf16": bf16Tolerance}[row.Collective])
		case "twolevel":
			require.NotNil(t, row.WireIntraPerRank)
			require.NotNil(t, row.WireInterPerRank)
			assert.Equal(t, "2 nodes x 2 ranks", row.Layout)
			// Each half sends (M-1)*K floats across and (D-1)*M*K inside.
			k := int64(row.ElementsPerRank / 4)
			assert.Equal(t, 2*1*k*4, *row.WireInterPerRank)
			assert.Equal(t, 2*1*2*k*4, *row.WireIntraPerRank)
			assert.Less(t, *row.RelError, exactTolerance)
		}
	}

	// The CSV has the conversion time and the node split in columns of
	// their own, for qgz too.
	for _, coll := range []string{"fp16", "qgz4"} {
		cfg.format = "csv"
		cfg.collectives = []string{coll}
		cfg.sizes = cfg.sizes[:1]
		out.Reset()
		_, err = runBench(ctx, cfg, &out)
		require.NoError(t, err)
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		require.Len(t, lines, 2, coll)
		head, rec := strings.Split(lines[0], ","), strings.Split(lines[1], ",")
		require.Len(t, rec, len(head), coll)
		col := map[string]string{}
		for i, h := range head {
			col[h] = rec[i]
		}
		for _, h := range []string{"convert_us", "comm_us", "intra_node_bytes_per_rank", "cross_node_bytes_per_rank", "rel_error"} {
			require.Contains(t, col, h, coll)
		}
		if coll == "fp16" {
			assert.NotEmpty(t, col["convert_us"])
			assert.NotEmpty(t, col["comm_us"])
		} else {
			assert.NotEmpty(t, col["intra_node_bytes_per_rank"])
			assert.NotEmpty(t, col["cross_node_bytes_per_rank"])
		}
	}
}
