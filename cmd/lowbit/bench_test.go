package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/comm/mpi"
)

func TestSizeSweep(t *testing.T) {
	got, err := sizeSweep(1<<10, 64<<10, 4)
	require.NoError(t, err)
	assert.Equal(t, []int64{1 << 10, 4 << 10, 16 << 10, 64 << 10}, got)
	got, err = sizeSweep(1<<20, 5<<20, 2) // the end need not be on the series
	require.NoError(t, err)
	assert.Equal(t, []int64{1 << 20, 2 << 20, 4 << 20}, got)
	got, err = sizeSweep(4096, 4096, 1)
	require.NoError(t, err)
	assert.Equal(t, []int64{4096}, got)

	for _, c := range [][3]int64{{0, 8, 2}, {8, 4, 2}, {6, 64, 2}, {8, 64, 1}} {
		_, err := sizeSweep(c[0], c[1], c[2])
		assert.Error(t, err, c)
	}
}

func TestParseBenchFlags(t *testing.T) {
	cfg, err := parseBenchFlags(strings.Fields("-b 1Ki --e 16Ki --f 4 --w 0 -n 3 --collective onebit,allgather --ranks 3 --check --csv"), io.Discard)
	require.NoError(t, err)
	assert.Equal(t, []int64{1 << 10, 4 << 10, 16 << 10}, cfg.sizes)
	assert.Equal(t, []string{"bf16", "onebit", "allgather"}, cfg.collectives, "bf16 joins onebit")
	assert.Equal(t, 0, cfg.warmup)
	assert.Equal(t, 3, cfg.iters)
	assert.Equal(t, 3, cfg.ranks)
	assert.True(t, cfg.check)
	assert.Equal(t, "csv", cfg.format)
	assert.Equal(t, "local", cfg.backend)

	// The bf16 down-cast allreduce is a row of every sweep with allreduce
	// or onebit, after allreduce, unless named or turned off.
	for args, want := range map[string][]string{
		"":                                   {"allreduce", "bf16", "onebit"},
		"--bf16=false":                       {"allreduce", "onebit"},
		"--collective onebit,allreduce":      {"onebit", "allreduce", "bf16"},
		"--collective bf16,onebit,allreduce": {"bf16", "onebit", "allreduce"},
		"--collective allreduce":             {"allreduce", "bf16"},
		"--collective alltoall,qgz4":         {"alltoall", "qgz4"},
		"--collective allreduce,onebit --bf16=true": {"allreduce", "bf16", "onebit"},
	} {
		cfg, err := parseBenchFlags(strings.Fields(args), io.Discard)
		require.NoError(t, err, args)
		assert.Equal(t, want, cfg.collectives, args)
	}

	cfg, err = parseBenchFlags([]string{"--backend", "mpi"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 0, cfg.ranks, "mpi takes the world size unless --ranks is given")
	cfg, err = parseBenchFlags([]string{"--backend", "mpi", "--ranks", "4"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 4, cfg.ranks)

	for _, args := range []string{
		"--collective allreduce,broadcast", "--b 1X", "--b 64Ki --e 1Ki", "--n 0", "--json --csv", "--f 1", "extra",
	} {
		_, err := parseBenchFlags(strings.Fields(args), io.Discard)
		assert.Error(t, err, args)
	}
	_, err = parseBenchFlags([]string{"-h"}, io.Discard)
	assert.ErrorIs(t, err, flag.ErrHelp)
}

// --op sum makes allreduce and reducescatter sum, as nccl-tests does by
// default; it takes only the exact collectives and adds no bf16 row.
func TestParseBenchOp(t *testing.T) {
	cfg, err := parseBenchFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, comm.Mean, cfg.op, "the default averages")
	cfg, err = parseBenchFlags(strings.Fields("--op sum --collective allreduce,reducescatter,alltoall,allgather"), io.Discard)
	require.NoError(t, err)
	assert.Equal(t, comm.Sum, cfg.op)
	assert.Equal(t, []string{"allreduce", "reducescatter", "alltoall", "allgather"}, cfg.collectives, "no bf16 row")

	for args, want := range map[string]string{
		"--op max --collective allreduce":           `unknown reduction "max"`,
		"--op sum":                                  "sum: onebit always averages",
		"--op sum --collective allreduce,bf16":      "sum: bf16 always averages",
		"--op sum --collective qgz4":                "sum: qgz4 always averages",
		"--op sum --collective onebit --bf16=false": "sum: onebit always averages",
	} {
		_, err := parseBenchFlags(strings.Fields(args), io.Discard)
		require.Error(t, err, args)
		assert.Contains(t, err.Error(), want, args)
		assert.Contains(t, err.Error(), "-op", args)
	}
}

// With --op sum the exact collectives' results are sums: --check, which
// compares them with the float64 sum, passes (it fails on means, 1/W of
// it), and the report names the reduction.
func TestBenchOpSum(t *testing.T) {
	for _, op := range []string{"sum", "mean"} {
		cfg, err := parseBenchFlags(strings.Fields(
			"--b 4Ki --e 4Ki --w 0 --n 2 --ranks 4 --check --json --collective allreduce,reducescatter --bf16=false --op "+op), io.Discard)
		require.NoError(t, err)
		var out bytes.Buffer
		_, err = runBench(context.Background(), cfg, &out)
		require.NoError(t, err, op)
		var res benchResult
		require.NoError(t, json.Unmarshal(out.Bytes(), &res))
		assert.Equal(t, op, res.Op)
		require.Len(t, res.Results, 2)
		for _, row := range res.Results {
			require.NotNil(t, row.RelError, row.Collective)
			assert.Less(t, *row.RelError, 1e-6, "%s %s", op, row.Collective)
		}
	}

	// The check tells a sum from a mean: a mean checked as a sum is 3/4 off
	// on 4 ranks.
	cs, err := local.New(4)
	require.NoError(t, err)
	errs := make(chan error, 4)
	rel := make([]float64, 4)
	for r, c := range cs {
		go func() {
			bc, err := newBenchCase("allreduce", c, 1024, comm.Sum)
			if err == nil {
				bc.prepare()
				err = c.AllReduce(context.Background(), bc.result, comm.Mean)
				e, ref := bc.check()
				rel[r] = e / ref
			}
			errs <- err
		}()
	}
	for range cs {
		require.NoError(t, <-errs)
	}
	for _, x := range rel {
		assert.InDelta(t, 0.75*0.75, x, 1e-6)
	}
}

func TestFormatting(t *testing.T) {
	rel := 0.5
	row := benchRow{Collective: "onebit", Bytes: 64 << 20, ElementsPerRank: 16 << 20,
		TimeP50Us: 1500, TimeP95Us: 2000, TimeMinUs: 1000, TimeMaxUs: 2500,
		AlgBWGBps: 44.7392426666, BusBWGBps: 2.1, EffBusBWGBps: 67.1, WireBytesPerRank: 3145800, CompressionRatio: 31.99}
	assert.Equal(t, []string{"onebit", "67108864", "16777216", "1500", "2000", "1000", "2500",
		"44.7392426666", "2.1", "67.1", "3145800", "31.99"}, csvRecord(row))
	line := formatRow(row)
	for _, s := range []string{"onebit", "64Mi", "16777216", "1500.0", "44.739", "   2.100", "  67.100", "3145800", "31.99x"} {
		assert.Contains(t, line, s)
	}
	row.RelError = &rel
	assert.Equal(t, "0.5", csvRecord(row)[12])
	assert.Contains(t, formatRow(row), "5.00e-01")
	row.CompressionRatio = 0 // one rank: nothing on the wire
	assert.Contains(t, formatRow(row), " - ")

	// The header is part of the interface: scripts parse it.
	var buf bytes.Buffer
	rep := &benchReporter{w: &buf, cfg: &benchConfig{format: "csv"}, res: &benchResult{}}
	require.NoError(t, rep.begin())
	assert.Equal(t, "collective,bytes,elements_per_rank,time_p50_us,time_p95_us,time_min_us,time_max_us,"+
		"algbw_gbps,busbw_gbps,effbusbw_gbps,wire_bytes_per_rank,compression_ratio\n", buf.String())
	buf.Reset()
	rep.cfg.format = "table"
	require.NoError(t, rep.begin())
	assert.Regexp(t, `algBW +busBW +effbusBW +wire B/rank`, buf.String())
}

func TestSummarize(t *testing.T) {
	// Two ranks, two iterations: times 1..4 µs, rank 1 sent more.
	const w, iters = 2, 2
	gathered := make([]byte, w*8*(iters+3))
	put := func(j, i int, v uint64) {
		for b := 0; b < 8; b++ {
			gathered[j*8*(iters+3)+8*i+b] = byte(v >> (8 * b))
		}
	}
	put(0, 0, 4000)
	put(0, 1, 1000)
	put(1, 0, 3000)
	put(1, 1, 2000)
	put(0, 2, 1000)
	put(1, 2, 1200)
	row := summarize("allgather", 1000, w, iters, gathered, make([]int64, w*iters), 0)
	assert.Equal(t, int64(4000), row.Bytes)
	assert.Equal(t, 2.0, row.TimeP50Us)
	assert.Equal(t, 4.0, row.TimeP95Us)
	assert.Equal(t, 1.0, row.TimeMinUs)
	assert.Equal(t, 4.0, row.TimeMaxUs)
	assert.InDelta(t, 2.0, row.AlgBWGBps, 1e-12)    // 4000 B / 2 µs
	assert.InDelta(t, 1.0, row.BusBWGBps, 1e-12)    // (W-1)/W
	assert.InDelta(t, 1.0, row.EffBusBWGBps, 1e-12) // an exact row's busBW
	assert.Equal(t, int64(1200), row.WireBytesPerRank)
	assert.Equal(t, 1.0, row.CompressionRatio)

	// onebit replaces the float32 ring allreduce, which sends 2(W-1)/W of
	// 4000 B: effbusBW is its busBW at onebit's p50, busBW that of the
	// 1200 B onebit sent (1200 B / 2 µs), and their ratio the compression.
	row = summarize("onebit", 1000, w, iters, gathered, make([]int64, w*iters), 0)
	assert.InDelta(t, 4000.0/1200, row.CompressionRatio, 1e-12)
	assert.InDelta(t, 2.0, row.EffBusBWGBps, 1e-12) // 2 GB/s * 2(W-1)/W
	assert.InDelta(t, 0.6, row.BusBWGBps, 1e-12)
	assert.InDelta(t, row.EffBusBWGBps, row.BusBWGBps*row.CompressionRatio, 1e-12)

	// The case's exact wire bytes decide the ratio; the collective
	// replaced decides effbusBW's factor: the allreduce's for bf16, the
	// reduce-scatter's for qgz4.
	row = summarize("bf16", 1000, w, iters, gathered, make([]int64, w*iters), 2400)
	assert.InDelta(t, 2.0, row.CompressionRatio, 1e-12)
	assert.InDelta(t, 2.0, row.EffBusBWGBps, 1e-12)
	assert.InDelta(t, 1.0, row.BusBWGBps, 1e-12)
	row = summarize("qgz4", 1000, w, iters, gathered, make([]int64, w*iters), 2400)
	assert.InDelta(t, 1.0, row.EffBusBWGBps, 1e-12) // 2 GB/s * (W-1)/W
	assert.InDelta(t, 0.5, row.BusBWGBps, 1e-12)

	// One rank: nothing on the wire, no bus.
	row = summarize("onebit", 1000, 1, iters, gathered, make([]int64, iters), 0)
	assert.Zero(t, row.BusBWGBps)
	assert.Zero(t, row.EffBusBWGBps)
}

func TestBenchEndToEnd(t *testing.T) {
	cfg, err := parseBenchFlags(strings.Fields(
		"--b 4Ki --e 64Ki --f 16 --w 0 --n 1 --ranks 4 --check --collective allreduce,onebit,alltoall,allgather,reducescatter"),
		io.Discard)
	require.NoError(t, err)
	var out bytes.Buffer
	res, err := runBench(context.Background(), cfg, &out)
	require.NoError(t, err)
	require.Len(t, res.Results, 12, "bf16 joins allreduce")
	assert.Equal(t, 4, res.Ranks)

	wire := map[string]int64{}
	for _, row := range res.Results {
		require.NotNil(t, row.RelError, row.Collective)
		// effbusBW: the exact float32 collective's busBW at the row's
		// p50; busBW: effbusBW over the compression ratio.
		factor := 0.75 // (W-1)/W
		if row.Collective == "allreduce" || row.Collective == "onebit" || row.Collective == "bf16" {
			factor = 1.5 // 2(W-1)/W
		}
		assert.InEpsilon(t, row.AlgBWGBps*factor, row.EffBusBWGBps, 1e-12, row.Collective)
		assert.InEpsilon(t, row.EffBusBWGBps, row.BusBWGBps*row.CompressionRatio, 1e-12, row.Collective)
		switch row.Collective {
		case "onebit":
			assert.Less(t, *row.RelError, 1.0, "onebit at %d", row.Bytes)
			assert.Greater(t, *row.RelError, 0.0)
		case "bf16":
			assert.Less(t, *row.RelError, bf16Tolerance, "bf16 at %d", row.Bytes)
			assert.InDelta(t, 2, row.CompressionRatio, 0.05, "bf16 at %d", row.Bytes)
			assert.Greater(t, row.EffBusBWGBps, 1.9*row.BusBWGBps, "bf16 at %d", row.Bytes)
		default:
			assert.Less(t, *row.RelError, 1e-6, "%s at %d", row.Collective, row.Bytes)
			assert.Equal(t, 1.0, row.CompressionRatio)
		}
		assert.Positive(t, row.TimeP50Us)
		assert.LessOrEqual(t, row.TimeMinUs, row.TimeP50Us)
		assert.LessOrEqual(t, row.TimeP95Us, row.TimeMaxUs)
		if row.Bytes == 64<<10 {
			wire[row.Collective] = row.WireBytesPerRank
		}
	}
	// Measured, not computed: a ring allreduce of 64 KiB on 4 ranks sends
	// 2*3/4*64 KiB; the 1-bit one about 32 times less.
	assert.Equal(t, int64(98304), wire["allreduce"])
	assert.Equal(t, int64(49152), wire["alltoall"])
	assert.GreaterOrEqual(t, float64(wire["allreduce"])/float64(wire["onebit"]), 20.0)

	text := out.String()
	assert.Contains(t, text, "speedup onebit vs allreduce: ")
	assert.Equal(t, 2, strings.Count(text, "speedup onebit vs allreduce: "))
	assert.Equal(t, 2, strings.Count(text, ", speedup onebit vs bf16: "))
	require.Len(t, res.Speedups, 2)
	p50 := map[[2]any]float64{}
	for _, row := range res.Results {
		p50[[2]any{row.Collective, row.Bytes}] = row.TimeP50Us
	}
	for _, sp := range res.Speedups {
		assert.Equal(t, p50[[2]any{"allreduce", sp.Bytes}]/p50[[2]any{"onebit", sp.Bytes}], sp.Speedup)
		assert.Equal(t, p50[[2]any{"bf16", sp.Bytes}]/p50[[2]any{"onebit", sp.Bytes}], sp.VsBF16)
	}
}

func TestBenchOddRanksAndJSON(t *testing.T) {
	// Three ranks: chunked collectives cut the size to a multiple of 3.
	cfg, err := parseBenchFlags(strings.Fields(
		"--b 1Ki --e 1Ki --w 1 --n 2 --ranks 3 --check --json --collective alltoall,reducescatter,allgather,onebit"), io.Discard)
	require.NoError(t, err)
	var out bytes.Buffer
	_, err = runBench(context.Background(), cfg, &out)
	require.NoError(t, err)
	var res benchResult
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	require.Len(t, res.Results, 5)
	for _, row := range res.Results[:3] {
		assert.Equal(t, 255, row.ElementsPerRank, row.Collective)
		require.NotNil(t, row.RelError)
		assert.Less(t, *row.RelError, 1e-6, row.Collective)
	}
	// bf16 joins onebit before it; without allreduce the speedup is over
	// bf16 alone.
	assert.Equal(t, "bf16", res.Results[3].Collective)
	assert.Equal(t, "onebit", res.Results[4].Collective)
	assert.Equal(t, 256, res.Results[4].ElementsPerRank)
	require.Len(t, res.Speedups, 1)
	assert.Zero(t, res.Speedups[0].Speedup)
	assert.Equal(t, res.Results[3].TimeP50Us/res.Results[4].TimeP50Us, res.Speedups[0].VsBF16)
	assert.NotContains(t, out.String(), "onebit_vs_allreduce")
	assert.Contains(t, out.String(), "onebit_vs_bf16")
}

func TestTimedLoopAllocatesNothing(t *testing.T) {
	cs, err := local.New(2)
	require.NoError(t, err)
	ctx := context.Background()
	const runs = 20
	for _, name := range []string{"allreduce", "onebit", "alltoall"} {
		cases := make([]*benchCase, 2)
		for r := range cases {
			cases[r], err = newBenchCase(name, cs[r], 1024, comm.Mean)
			require.NoError(t, err)
		}
		times := [2][]int64{make([]int64, 3), make([]int64, 3)}
		done := make(chan error, 1)
		go func() {
			for i := 0; i < runs+1; i++ { // AllocsPerRun calls once more to warm up
				if _, err := timeCase(ctx, cs[1], cases[1], 1, times[1]); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
		allocs := testing.AllocsPerRun(runs, func() {
			if _, err := timeCase(ctx, cs[0], cases[0], 1, times[0]); err != nil {
				t.Error(err)
			}
		})
		require.NoError(t, <-done)
		assert.Zero(t, allocs, name)
	}
}

func TestRunRanks(t *testing.T) {
	ctx := context.Background()
	err := runRanks(ctx, "tcp", 2, func(context.Context, comm.Comm) error { return nil })
	assert.ErrorContains(t, err, `unknown backend "tcp"`)
	assert.Error(t, runRanks(ctx, "local", 0, func(context.Context, comm.Comm) error { return nil }))

	// A failing rank must not leave its peers blocked in a collective.
	boom := errors.New("boom")
	err = runRanks(ctx, "local", 3, func(ctx context.Context, c comm.Comm) error {
		if c.Rank() == 1 {
			return boom
		}
		return c.Barrier(ctx)
	})
	assert.ErrorIs(t, err, boom)

	sizes := make(chan int, 4)
	require.NoError(t, runRanks(ctx, "local", 4, func(ctx context.Context, c comm.Comm) error {
		sizes <- c.Size()
		return c.Barrier(ctx)
	}))
	close(sizes)
	for s := range sizes {
		assert.Equal(t, 4, s)
	}

	if !mpi.Built {
		err := runRanks(ctx, "mpi", 0, func(context.Context, comm.Comm) error { return nil })
		assert.Error(t, err, "a binary without the mpi tag must explain itself")
	}
}

// --csv adds the memory bound's columns and the cut of the onebit rows;
// --pieces fixes the cut, else the calls settle on one after their
// warm-up (at least onebit.TuningCalls calls, whatever --w says).
func TestBenchPiecesCSV(t *testing.T) {
	for _, tc := range []struct {
		flag string
		want []string
	}{{"--pieces 2", []string{"2"}}, {"--pieces 1", []string{"1"}}, {"", []string{"1", "2"}}} {
		cfg, err := parseBenchFlags(strings.Fields("--b 8Mi --e 8Mi --w 0 --n 1 --ranks 2 --csv --bf16=false --collective allreduce,onebit "+tc.flag), io.Discard)
		require.NoError(t, err)
		var out bytes.Buffer
		_, err = runBench(context.Background(), cfg, &out)
		require.NoError(t, err)
		recs, err := csv.NewReader(&out).ReadAll()
		require.NoError(t, err)
		require.Len(t, recs, 3, tc.flag)
		col := map[string]int{}
		for i, h := range recs[0] {
			col[h] = i
		}
		for _, h := range boundCSVHeader {
			require.Contains(t, col, h, tc.flag)
		}
		assert.Empty(t, recs[1][col["pieces"]], "allreduce %s", tc.flag)
		assert.Empty(t, recs[1][col["mem_bound_us"]], "allreduce %s", tc.flag)
		assert.Contains(t, tc.want, recs[2][col["pieces"]], "onebit %s", tc.flag)
		assert.Equal(t, "false", recs[2][col["started"]], "onebit %s: comm/local starts no collectives", tc.flag)
		assert.NotEmpty(t, recs[2][col["mem_bound_share"]], "onebit %s", tc.flag)
	}
}
