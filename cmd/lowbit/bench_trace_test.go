package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// smallStream makes the bandwidth measurement of a test cheap.
func smallStream(t *testing.T) {
	old := streamBytes
	streamBytes = 1 << 20
	t.Cleanup(func() { streamBytes = old })
}

// The byte count against a hand computation.
func TestOnebitMemBytes(t *testing.T) {
	// 64 elements on 4 ranks: N = 64, C = 16. 8n = 512, 16N = 1024,
	// 16C = 256, 6N/8 = 48, 2C/8 = 4.
	assert.Equal(t, int64(512+1024+256+48+4), onebitMemBytes(64, 4))
	// 100 elements on 4 ranks pad to N = 128, C = 32: 8n = 800,
	// 16N = 2048, 16C = 512, 6N/8 = 96, 2C/8 = 8.
	assert.Equal(t, int64(800+2048+512+96+8), onebitMemBytes(100, 4))
	// One rank: N = C = 8. 64 + 128 + 128 + 6 + 2.
	assert.Equal(t, int64(328), onebitMemBytes(8, 1))
	// 64 MiB on 4 ranks: 461 MiB.
	assert.Equal(t, int64(461<<20), onebitMemBytes(16<<20, 4))
	assert.Zero(t, onebitMemBytes(0, 4))
}

func TestMeasureStreamBandwidth(t *testing.T) {
	smallStream(t)
	got := make([]float64, 3)
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
		var probe streamProbe
		bw, err := probe.measure(ctx, c)
		got[c.Rank()] = bw
		return err
	})
	require.NoError(t, err)
	assert.Positive(t, got[0])
	assert.Equal(t, got[0], got[1], "every rank returns the same value")
	assert.Equal(t, got[0], got[2], "every rank returns the same value")
}

func TestMemBoundColumns(t *testing.T) {
	row := benchRow{Collective: "onebit", ElementsPerRank: 16 << 20, TimeP50Us: 100_000}
	setMemBound(&row, 4, 10e9)
	require.NotNil(t, row.MemBoundUs)
	assert.InDelta(t, float64(461<<20)/10e9*1e6, *row.MemBoundUs, 1e-6)
	assert.InDelta(t, *row.MemBoundUs/100_000, *row.MemBoundShare, 1e-12)
	assert.Contains(t, formatRow(row), "memory bound 48339.4 us: 461Mi at 10.00 GB/s, 48% of it reached")
	assert.Empty(t, memBoundColumns(benchRow{}))
}

func TestTraceEventEncoding(t *testing.T) {
	e := traceEvent{ph: phaseCall, piece: -1, call: 12345, start: 1_700_000_000_123_456_789, dur: 42}
	b := make([]byte, traceEventLen)
	e.put(b)
	assert.Equal(t, e, getTraceEvent(b))
}

// chromeFile is what the tests read back of a --trace file.
type chromeFile struct {
	TraceEvents []chromeEvent `json:"traceEvents"`
}

// runTraced runs lowbit bench with --trace on args and returns the table
// and the trace file, decoded.
func runTraced(t *testing.T, args string) (string, chromeFile) {
	smallStream(t)
	name := filepath.Join(t.TempDir(), "trace.json")
	cfg, err := parseBenchFlags(append(strings.Fields(args), "--trace", name), &bytes.Buffer{})
	require.NoError(t, err)
	var out bytes.Buffer
	_, err = runBench(context.Background(), cfg, &out)
	require.NoError(t, err)
	data, err := os.ReadFile(name)
	require.NoError(t, err)
	var f chromeFile
	require.NoError(t, json.Unmarshal(data, &f), "the trace is JSON")
	return out.String(), f
}

// spansOf returns rank pid's complete events of one size and call, by start.
func spansOf(f chromeFile, pid int, sz string, call int) []chromeEvent {
	var out []chromeEvent
	for _, e := range f.TraceEvents {
		if e.Ph == "X" && e.Pid == pid && e.Args["size"] == sz && e.Args["call"] == float64(call) {
			out = append(out, e)
		}
	}
	slices.SortStableFunc(out, func(a, b chromeEvent) int {
		if a.Ts != b.Ts {
			return cmpFloat(a.Ts, b.Ts)
		}
		return cmpFloat(b.Dur, a.Dur) // the enclosing call first
	})
	return out
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// Not pipelined, on the local backend (collectives blocking), every rank's
// trace holds, for every timed call, the call and its phases in order, one
// after the other and inside the call (the output twice: the rank's own
// chunk, then the others'); the table has a summary row per rank.
func TestBenchTraceInOrder(t *testing.T) {
	want := []string{"call", "header", "compress", "all-to-all", "worker-error",
		"server-reduce", "all-gather", "server-compress", "decompress", "decompress"}
	for _, w := range []int{2, 3, 4} {
		table, f := runTraced(t, fmt.Sprintf("--b 4Ki --e 16Ki --f 4 --w 1 --n 3 --collective onebit --bf16=false --ranks %d", w))
		assert.Contains(t, table, "memory bound")
		for _, sz := range []string{"4Ki", "16Ki"} {
			assert.Contains(t, table, "# onebit "+sz+" per phase")
			for pid := range w {
				for call := range 3 {
					spans := spansOf(f, pid, sz, call)
					names := make([]string, len(spans))
					for i, s := range spans {
						names[i] = s.Name
					}
					require.Equal(t, want, names, "%d ranks, rank %d, %s, call %d", w, pid, sz, call)
					whole := spans[0]
					for i, s := range spans[1:] {
						assert.GreaterOrEqual(t, s.Ts, whole.Ts)
						assert.LessOrEqual(t, s.Ts+s.Dur, whole.Ts+whole.Dur+1e-3, "%s inside the call", s.Name)
						if i > 0 {
							prev := spans[i]
							assert.GreaterOrEqual(t, s.Ts, prev.Ts+prev.Dur-1e-3, "%s after %s", s.Name, prev.Name)
						}
					}
				}
			}
		}
		for pid := range w {
			assert.Regexp(t, fmt.Sprintf(`(?m)^%d +[0-9.]+ `, pid), table)
		}
		// No call beyond the timed ones (--check's and the warm-up's are
		// not traced).
		for _, e := range f.TraceEvents {
			if e.Ph == "X" {
				assert.Less(t, e.Args["call"], float64(3))
			}
		}
	}
}

// Pipelined (8 MiB on 2 ranks travels in 2 pieces, fixed with --pieces:
// the tuned calls may send whole chunks), every piece goes through its
// phases in order on every rank.
func TestBenchTracePipelined(t *testing.T) {
	table, f := runTraced(t, "--b 8Mi --e 8Mi --w 0 --n 2 --collective onebit --bf16=false --ranks 2 --pieces 2")
	assert.Contains(t, table, "pipelined:")
	chain := []string{"compress", "all-to-all", "server-reduce", "all-gather", "decompress"}
	for pid := range 2 {
		for call := range 2 {
			end := map[string]map[int]float64{}
			for _, s := range spansOf(f, pid, "8Mi", call) {
				if end[s.Name] == nil {
					end[s.Name] = map[int]float64{}
				}
				if p, ok := s.Args["piece"].(float64); ok {
					end[s.Name][int(p)] = s.Ts + s.Dur
				}
			}
			assert.Len(t, end["header"], 1)
			assert.Len(t, end["worker-error"], 1) // over the whole tensor (piece -1), in one span or more
			assert.Len(t, end["server-compress"], 1)
			assert.NotEmpty(t, end["wait"])
			for p := range 2 {
				assert.GreaterOrEqual(t, end["server-compress"][-1], end["server-reduce"][p]-1e-3,
					"rank %d call %d: step 8 ends before piece %d is summed", pid, call, p)
				for i := 1; i < len(chain); i++ {
					prev, ok1 := end[chain[i-1]][p]
					next, ok2 := end[chain[i]][p]
					require.True(t, ok1 && ok2, "rank %d call %d piece %d: %s and %s", pid, call, p, chain[i-1], chain[i])
					assert.GreaterOrEqual(t, next, prev-1e-3, "rank %d call %d piece %d: %s ends before %s",
						pid, call, p, chain[i], chain[i-1])
				}
			}
		}
	}
}
