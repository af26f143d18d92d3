package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/costmodel"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
	"github.com/lowbit-ml/lowbit/optim"
)

func TestPlanCommand(t *testing.T) {
	var out, errOut bytes.Buffer
	require.NoError(t, planMain([]string{"--params", "1.3e9", "--ranks", "64", "--link", "10gbit"}, &out, &errOut))
	s := out.String()
	t.Logf("\n%s", s)
	assert.Contains(t, s, "1.3B parameters (5.20 GB float32 gradient), 64 ranks, 10 Gbit/s links (per-rank)")
	assert.Contains(t, s, "set --compress-rate")
	assert.Contains(t, s, "assumptions:")
	assert.Contains(t, s, "buckets: 199 of 25Mi")
	var rows []string
	for _, l := range strings.Split(s, "\n") {
		if f := strings.Fields(l); len(f) > 0 && (f[0] == "allreduce" || f[0] == "onebit") {
			rows = append(rows, l)
		}
	}
	require.Len(t, rows, 2, s)
	assert.True(t, strings.HasSuffix(strings.TrimSpace(rows[0]), "1.00x"), rows[0])

	out.Reset()
	require.NoError(t, planMain([]string{"--params", "1.3e9", "--ranks", "64", "--link", "10gbit",
		"--collective", "allreduce,onebit,fp16", "--step-compute", "500ms", "--compress-rate", "1e10",
		"--alpha", "10e-6", "--json"}, &out, &errOut))
	var res struct {
		Params      int64                 `json:"params"`
		StepCompute float64               `json:"step_compute_s"`
		Assumptions costmodel.Assumptions `json:"assumptions"`
		Rows        []costmodel.Row       `json:"collectives"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	assert.Equal(t, int64(1.3e9), res.Params)
	assert.Equal(t, 0.5, res.StepCompute)
	assert.Equal(t, 10e-6, res.Assumptions.Alpha)
	assert.GreaterOrEqual(t, res.Assumptions.Ineff, 1.0, "an uncalibrated link is no faster than its line rate")
	assert.Equal(t, int64(199), res.Assumptions.Buckets)
	require.Len(t, res.Rows, 3)
	exact, ob, fp16 := res.Rows[0], res.Rows[1], res.Rows[2]
	per := int64(optim.DefaultBucketBytes / 4)
	n := int64(1.3e9)
	assert.Equal(t, (n/per)*comm.RingAllReduceBytes(4*per, 64)+comm.RingAllReduceBytes(4*(n%per), 64), exact.WirePerRank)
	assert.InDelta(t, 32, float64(exact.WirePerRank)/float64(ob.WirePerRank), 1)
	assert.InDelta(t, float64(exact.WirePerRank)/2, float64(fp16.WirePerRank), 64)
	assert.Equal(t, 199, exact.Calls)
	assert.Equal(t, 3*199, ob.Calls)
	assert.True(t, exact.Calibrated && ob.Calibrated)
	assert.False(t, fp16.Calibrated)
	assert.InDelta(t, 199*2*63*10e-6, exact.LatencyS, 1e-9)
	assert.InDelta(t, 199*3*63*10e-6, ob.LatencyS, 1e-9)
	// --compress-rate: each rank makes (4+1/64)/5 of a 1-rank call's work.
	assert.InDelta(t, 4*1.3e9/1e10*(4+1.0/64)/5, ob.CompressS, 1e-3)
	assert.InDelta(t, exact.CommS+0.5, exact.StepS, 1e-12)
	assert.InDelta(t, 1, exact.SpeedupExact, 1e-12)
	assert.Greater(t, ob.SpeedupExact, 1.0)
	assert.InDelta(t, exact.StepS/ob.StepS, ob.SpeedupExact, 1e-12)

	out.Reset()
	require.NoError(t, planMain([]string{"fit"}, &out, &errOut))
	assert.Contains(t, out.String(), "largest error")
	assert.Contains(t, out.String(), "onebit")
	out.Reset()
	require.NoError(t, planMain([]string{"fit", "--holdout"}, &out, &errOut))
	assert.Contains(t, out.String(), "held out")
}

// With --sharing shared and --link at a calibrated rate the plan is the
// model of a recorded measurement's setup (the steady state of back-to-back
// calls, one bucket).
func TestPlanSharedMatchesRecorded(t *testing.T) {
	cal, err := costmodel.Builtin()
	require.NoError(t, err)
	var p costmodel.Point
	for _, q := range cal.Points {
		if q.Collective == "onebit" && q.RateName == "250mbit" && q.Ranks == 4 && q.Bytes > p.Bytes {
			p = q
		}
	}
	require.NotZero(t, p.Bytes)
	var out, errOut bytes.Buffer
	require.NoError(t, planMain([]string{"--sharing", "shared", "--ranks", "4", "--link", "250mbit",
		"--params", strconv.FormatInt(p.Bytes/4, 10), "--json"}, &out, &errOut))
	var res struct {
		Rows []costmodel.Row `json:"collectives"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	require.Len(t, res.Rows, 2)
	assert.InDelta(t, p.Seconds, res.Rows[1].CommS, 0.25*p.Seconds)
	assert.Equal(t, p.Wire, res.Rows[1].WirePerRank)
}

// The command prints the package's plan as it printed it before the model
// became package costmodel (recorded with the flags below).
func TestPlanCommandJSONUnchanged(t *testing.T) {
	want, err := os.ReadFile("testdata/plan/overrides.json")
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, planMain(strings.Fields("--params 1.3e9 --ranks 64 --link 10gbit --collective allreduce,onebit,fp16 "+
		"--step-compute 500ms --compress-rate 1e10 --alpha 10e-6 --json"), &out, io.Discard))
	assert.Equal(t, string(want), out.String())
}

// --alpha takes a duration, as --step-compute does, and still a bare
// number of seconds (docs/plan.md's examples): 10us and 10e-6 print the
// same plan, to the byte.
func TestPlanAlphaDuration(t *testing.T) {
	want, err := os.ReadFile("testdata/plan/overrides.json")
	require.NoError(t, err)
	for _, alpha := range []string{"10us", "10µs", "0.01ms", "10e-6"} {
		var out bytes.Buffer
		require.NoError(t, planMain(strings.Fields("--params 1.3e9 --ranks 64 --link 10gbit --collective allreduce,onebit,fp16 "+
			"--step-compute 500ms --compress-rate 1e10 --alpha "+alpha+" --json"), &out, io.Discard), alpha)
		assert.Equal(t, string(want), out.String(), alpha)
	}
	cfg, err := parsePlanFlags([]string{"--alpha", "1.5ms"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 1.5e-3, cfg.job.Alpha)
	for _, bad := range []string{"-1us", "fast", "10xs", "2s"} {
		_, err := parsePlanFlags([]string{"--alpha", bad}, io.Discard)
		assert.True(t, cliflag.IsUsage(err), "%s: %v", bad, err)
		assert.Contains(t, err.Error(), "--alpha", bad)
	}
}

// costmodel names the Job fields that replaced a fitted figure, or that
// would; the command has it name its flags instead (Job.FieldNames), in
// the text and in the JSON.
func TestPlanNamesFlags(t *testing.T) {
	args := strings.Fields("--params 340M --ranks 8 --link 10gbit --compress-rate 2e10 --alpha 1e-5 --ineff 1.2")
	var out bytes.Buffer
	require.NoError(t, planMain(args, &out, io.Discard))
	s := out.String()
	assert.Contains(t, s, "(--alpha)")
	assert.Contains(t, s, "(--ineff)")
	assert.Contains(t, s, "(--compress-rate)")
	assert.NotContains(t, s, "Job.")
	out.Reset()
	require.NoError(t, planMain(append(args, "--json"), &out, io.Discard))
	var res struct{ Assumptions costmodel.Assumptions }
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	assert.Equal(t, "--alpha", res.Assumptions.AlphaFrom)
	assert.Equal(t, "--ineff", res.Assumptions.IneffFrom)
	assert.Equal(t, "--compress-rate", res.Assumptions.CompressFrom)

	out.Reset()
	require.NoError(t, planMain(strings.Fields("--params 340M --ranks 8"), &out, io.Discard))
	assert.Contains(t, out.String(), "set --compress-rate to your hardware's")
	assert.NotContains(t, out.String(), "Job.")
}

func TestParsePlanFlagsErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--params", "0"}, {"--params", "-5"}, {"--params", "NaN"}, {"--ranks", "1"}, {"--link", "fast"},
		{"--sharing", "both"}, {"--collective", "allreduce,qgz"}, {"--compress-rate", "-1"},
		{"--alpha", "-1"}, {"--ineff", "NaN"}, {"--bucket", "6"}, {"--holdout"},
		{"--step-compute", "-1s"}, {"extra"}, {"--nope"},
	} {
		_, err := parsePlanFlags(args, &bytes.Buffer{})
		assert.True(t, cliflag.IsUsage(err), "%v: %v", args, err)
	}
	// --link 100Mbps is 100 Mbit/s to most people and 800 to tc: refused.
	_, err := parsePlanFlags([]string{"--link", "100Mbps"}, io.Discard)
	require.True(t, cliflag.IsUsage(err), "%v", err)
	assert.Equal(t, `invalid value "100Mbps" for --link: ambiguous unit: most people read Mbps as bits per second (100 Mbit/s), `+
		`tc as bytes per second (800 Mbit/s); write 100mbit for the first or 100MB/s for the second (e.g. --link 10gbit)`, err.Error())
	cfg, err := parsePlanFlags([]string{"--params", "340M", "--bucket", "64Mi"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, int64(340e6), cfg.job.Params)
	assert.Equal(t, int64(64<<20), cfg.job.BucketBytes)
	var out, errOut bytes.Buffer
	err = planMain([]string{"--measurements", "testdata/plan/does-not-exist.json"}, &out, &errOut)
	assert.Error(t, err)
	assert.False(t, cliflag.IsUsage(err), "a missing file is not a usage error")
}

// The plan prints every optimizer's state per rank from
// costmodel.StateBytes, and with --memory which ones fit with fp32
// parameters and gradients.
func TestPlanMemory(t *testing.T) {
	plan := func(args string) map[string][]string {
		t.Helper()
		var out bytes.Buffer
		require.NoError(t, planMain(strings.Fields(args), &out, io.Discard))
		s := out.String()
		require.Contains(t, s, "optimizer state per rank")
		rows := map[string][]string{}
		for _, l := range strings.Split(s[strings.Index(s, "optimizer state per rank"):], "\n") {
			if f := strings.Fields(l); len(f) > 0 && slices.Contains(costmodel.StateOptimizers(), f[0]) {
				rows[f[0]] = f[1:]
			}
		}
		require.Len(t, rows, len(costmodel.StateOptimizers()), s)
		return rows
	}
	rows := plan("--params 7B --ranks 4")
	assert.Equal(t, []string{"8.00", "56.00", "GB", "112.00", "GB"}, rows[costmodel.OptAdam])
	for name, r := range rows {
		b, err := costmodel.StateBytes(name, []int64{7e9}, 4, optim.DefaultBucketBytes)
		require.NoError(t, err)
		assert.Equal(t, strconv.FormatFloat(float64(b)/7e9, 'f', 2, 64), r[0], name)
		assert.Len(t, r, 5, "%s: no fits column without --memory", name)
	}

	// 7B on 4 ranks: 112 GB with exact Adam, 70 GB with ZeRO-1 Adam,
	// 87.5 GB with the sharded 1-bit Adam in bfloat16, 105.0 GB with the
	// sharded 1-bit Adam, 119.9 GB with the compact one, more with the
	// other 1-bit optimizers.
	zero, bf16 := costmodel.OptZeroAdam, costmodel.OptOnebitAdamShardedBF16
	sharded, compact := costmodel.OptOnebitAdamSharded, costmodel.OptOnebitAdamCompact
	for _, c := range []struct {
		memory string
		fit    []string
	}{
		{"80G", []string{zero}},
		{"74.5Gi", []string{zero}},
		{"87G", []string{zero}},
		{"88G", []string{zero, bf16}},
		{"104G", []string{zero, bf16}},
		{"106G", []string{zero, bf16, sharded}},
		{"112G", []string{costmodel.OptAdam, zero, bf16, sharded}},
		{"119G", []string{costmodel.OptAdam, zero, bf16, sharded}},
		{"120G", []string{costmodel.OptAdam, zero, bf16, sharded, compact}},
		{"24Gi", nil},
		{"1Ti", costmodel.StateOptimizers()},
	} {
		var fit []string
		for name, r := range plan("--params 7B --ranks 4 --memory " + c.memory) {
			require.Len(t, r, 6, c.memory)
			require.Contains(t, []string{"yes", "no"}, r[5])
			if r[5] == "yes" {
				fit = append(fit, name)
			}
		}
		assert.ElementsMatch(t, c.fit, fit, "--memory %s", c.memory)
	}

	// Past what an int64 counts: the row says so, the rest is printed.
	rows = plan("--params 1000T --ranks 1048576 --bucket 4 --memory 1Ti")
	assert.Equal(t, []string{"too", "large", "no"}, rows[costmodel.OptOnebitAdam])
	for _, o := range []string{costmodel.OptOnebitAdamCompact, costmodel.OptOnebitAdamSharded, costmodel.OptOnebitAdamShardedBF16} {
		assert.Equal(t, []string{"too", "large", "no"}, rows[o], o)
	}
	assert.Equal(t, "8.00", rows[costmodel.OptAdam][0])
}

// --memory takes a size in bytes by package size's rules and nothing else; it goes with a plan,
// not with plan fit. Every refusal is one line naming the flag.
func TestPlanMemoryFlag(t *testing.T) {
	for in, want := range map[string]int64{"24Gi": 24 << 30, "80G": 80e9, "512Mi": 512 << 20, "1": 1, "1024Pi": 1 << 60, "1.5Gi": 3 << 29, "24GB": 24e9} {
		cfg, err := parsePlanFlags([]string{"--memory", in}, io.Discard)
		require.NoError(t, err, in)
		assert.Equal(t, want, cfg.memory, in)
	}
	cfg, err := parsePlanFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Zero(t, cfg.memory, "not given")
	for _, in := range []string{"0", "-1", "1.3B", "24Gb", "1025Pi", "lots", ""} {
		_, err := parsePlanFlags([]string{"--memory", in}, io.Discard)
		if assert.Error(t, err, in) {
			assert.True(t, cliflag.IsUsage(err), "%s: %v", in, err)
			assert.NotContains(t, err.Error(), "\n", in)
			assert.Contains(t, err.Error(), "--memory", in)
		}
	}
	var out, errOut bytes.Buffer
	assert.Equal(t, 2, run([]string{"plan", "fit", "--memory", "24Gi"}, &out, &errOut))
	assert.Equal(t, "lowbit plan: --memory goes with lowbit plan, not lowbit plan fit; see lowbit plan -h\n", errOut.String())
	assert.Empty(t, out.String())
}

// outerRows runs lowbit plan with args and returns its table's rows by
// collective name (without the * of an uncalibrated one), each as its
// fields.
func outerRows(t *testing.T, args string) (string, map[string][]string) {
	t.Helper()
	return tableRows(t, args, "", "step comm:")
}

// tableRows runs lowbit plan with args and returns its output and the rows
// of the table between the first line starting with start ("": the
// output's start) and the first line after it containing end, less the
// table's two first lines, by first field (without a trailing *), each as
// its other fields.
func tableRows(t *testing.T, args, start, end string) (string, map[string][]string) {
	t.Helper()
	var out bytes.Buffer
	require.NoError(t, planMain(strings.Fields(args), &out, io.Discard))
	s := out.String()
	table := s[strings.Index(s, start):]
	rows := map[string][]string{}
	for _, l := range strings.Split(table[:strings.Index(table, end)], "\n")[2:] {
		if f := strings.Fields(l); len(f) > 0 {
			rows[strings.TrimSuffix(f[0], "*")] = f[1:]
		}
	}
	return s, rows
}

// --outer-h adds the outer optimizer's rows (one per codec) to the
// default ones; --collective picks among them; the JSON is
// costmodel.Plan's, with the outer settings.
func TestPlanOuterRows(t *testing.T) {
	const args = "--params 124M --ranks 4 --link 10mbit --step-compute 200ms"
	s, rows := outerRows(t, args)
	assert.Len(t, rows, 2)
	assert.NotContains(t, s, "outer")

	s, rows = outerRows(t, args+" --outer-h 50")
	require.Len(t, rows, 8, s)
	for _, name := range []string{"outer-fp32", "outer-bf16", "outer-int8", "outer-1bit", "outer-sparse", "outer-sparse-2p"} {
		require.Contains(t, rows, name, s)
		assert.Contains(t, s, name+": outer optimizer, ")
	}
	assert.Regexp(t, `\n +outer-muon +[0-9.]+ +[0-9.]+ [kMG]?B +[0-9.]+ [kMG]?B\n`, s, "outer-muon's row in the state table")
	assert.Contains(t, s, "outer-bf16*")
	assert.Contains(t, s, "outer-int8*: not measured")
	assert.NotContains(t, s, "outer-fp32*")
	assert.Contains(t, s, "H 50, 1 fragment, delay 0")
	assert.Contains(t, s, "of 124M parameters every 50 steps")
	// 2 calls (agreement and allreduce) every 50 steps.
	assert.Equal(t, "0.04", rows["outer-fp32"][0])
	assert.Equal(t, []string{"14.9", "MB"}, rows["outer-fp32"][1:3], "744 MB every 50 steps (and the agreement)")

	assert.Contains(t, s, "outer-sparse*: not measured")
	assert.Contains(t, s, "outer-sparse sends 85 of every 4096 entries (density 0.02083), each a 12-bit offset and a 1-bit value, 1 float32 scale(s) per chunk: 0.279 bits per element per message")
	// 124M elements: 30274 chunks of 4096 and one of 1536 (32 entries),
	// each 4 bytes of scale and ceil(13k/8) of entries, to 3 peers, every
	// 50 steps.
	assert.Equal(t, []string{"259.7", "kB"}, rows["outer-sparse"][1:3], "3*(30273*(4+139)+(4+52))/50")
	_, two := outerRows(t, args+" --outer-h 50 --outer-sparse-bits 2 --outer-density 0.03 --outer-sparse-chunk 1024")
	assert.Equal(t, []string{"399.6", "kB"}, two["outer-sparse"][1:3], "31 of 1024 entries of 10+2 bits, 2 scales: 3*(121093*(8+47)+(8+35))/50")
	// Two-phase: 2*3 segments of ceil(30274/4) = 7569 chunks of 143
	// bytes, every 50 steps.
	assert.Equal(t, []string{"129.9", "kB"}, rows["outer-sparse-2p"][1:3], "6*7569*143/50")
	assert.Contains(t, s, "outer-sparse-2p sends them in two phases, 2(W-1) segments of ceil(chunks/W) chunks per rank")

	s, rows = outerRows(t, args+" --outer-h 50 --outer-fragments 4 --outer-delay 2")
	require.Len(t, rows, 8, s)
	assert.Contains(t, s, "H 50, 4 fragments, delay 2")
	assert.Contains(t, s, "of 31M parameters every 12.5 steps")
	assert.Contains(t, s, "each exchange runs beside 2 steps of compute (400ms)")
	assert.Contains(t, s, "32.0ms hidden per step on average", "400ms of each of 4 exchanges every 50 steps")
	assert.Equal(t, "0.16", rows["outer-fp32"][0])

	// With --muon-shape, as Muon's rows, the outer optimizer with Muon
	// inside (MuLoCo): outer-1bit's exchange and Muon's orthogonalization.
	s, rows = outerRows(t, args+" --outer-h 50 --muon-shape 1024x1024 --muon-flops 50e12")
	require.Contains(t, rows, "outer-muon", s)
	assert.Contains(t, s, "outer-muon: outer optimizer, Muon inside (MuLoCo")
	assert.Equal(t, rows["outer-1bit"][:6], rows["outer-muon"][:6], "the same exchange")

	_, rows = outerRows(t, args+" --outer-h 50 --collective allreduce,outer-int8")
	assert.Len(t, rows, 2)
	assert.Contains(t, rows, "outer-int8")

	var out bytes.Buffer
	require.NoError(t, planMain(strings.Fields(args+" --outer-h 50 --outer-fragments 4 --outer-delay 2 --json"), &out, io.Discard))
	var res struct {
		Outer *costmodel.OuterPlan `json:"outer"`
		Rows  []costmodel.Row      `json:"collectives"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	require.NotNil(t, res.Outer)
	require.NotNil(t, res.Outer.Sparse)
	assert.Equal(t, 85, res.Outer.Sparse.Entries)
	res.Outer.Sparse = nil
	assert.Equal(t, costmodel.OuterPlan{H: 50, Fragments: 4, Delay: 2, FragmentParams: 31e6, ExchangeEvery: 12.5, HideS: 0.4}, *res.Outer)
	cal, err := costmodel.Builtin()
	require.NoError(t, err)
	link, err := costmodel.ParseRate("10mbit")
	require.NoError(t, err)
	p, err := cal.Model.Plan(costmodel.Job{Params: 124e6, Ranks: 4, Link: link, LinkName: "10mbit", BucketBytes: optim.DefaultBucketBytes,
		StepCompute: 200e6, OuterH: 50, OuterFragments: 4, OuterDelay: 2})
	require.NoError(t, err)
	assert.Equal(t, p.Rows, res.Rows)
	for _, r := range res.Rows[2:] {
		assert.Positive(t, r.ExchangeS, r.Collective)
		assert.InDelta(t, 4*0.4/50, r.HiddenS, 1e-12, r.Collective)
	}

	// Without the outer flags the JSON has no outer fields.
	out.Reset()
	require.NoError(t, planMain(strings.Fields(args+" --json"), &out, io.Discard))
	for _, field := range []string{`"outer"`, `"exchange_s"`, `"hidden_s"`} {
		assert.NotContains(t, out.String(), field)
	}
}

// The outer rows of the example in docs/plan.md, as recorded.
func TestPlanOuterJSONUnchanged(t *testing.T) {
	want, err := os.ReadFile("testdata/plan/outer.json")
	require.NoError(t, err)
	var out bytes.Buffer
	require.NoError(t, planMain(strings.Fields("--params 124M --ranks 4 --link 10mbit --step-compute 200ms "+
		"--outer-h 50 --outer-fragments 4 --outer-delay 2 --json"), &out, io.Discard))
	assert.Equal(t, string(want), out.String())
}

// An outer setting the plan cannot use is refused naming its flag.
func TestPlanOuterFlagErrors(t *testing.T) {
	for args, flagName := range map[string]string{
		"--outer-h -1":                                        "--outer-h",
		"--outer-h 99999999999":                               "--outer-h",
		"--collective allreduce,outer-int8":                   "--outer-h",
		"--outer-fragments 2":                                 "--outer-fragments",
		"--outer-h 4 --outer-fragments 5":                     "--outer-fragments",
		"--outer-h 4 --outer-fragments -1":                    "--outer-fragments",
		"--outer-delay 1":                                     "--outer-delay",
		"--outer-h 50 --outer-fragments 4 --outer-delay 13":   "--outer-delay",
		"--outer-h 50 --outer-delay -2":                       "--outer-delay",
		"--outer-h 5 --collective outer-fp16":                 "--collective",
		"--params 3 --outer-h 5 --outer-fragments 4":          "--outer-fragments",
		"--outer-h 5 --outer-density 0":                       "--outer-density",
		"--outer-h 5 --outer-density 1.5":                     "--outer-density",
		"--outer-h 5 --outer-sparse-chunk 0":                  "--outer-sparse-chunk",
		"--outer-h 5 --outer-sparse-chunk 47":                 "--outer-sparse-chunk",
		"--outer-h 5 --outer-sparse-bits 3":                   "--outer-sparse-bits",
		"--outer-h 5 --outer-sparse-bits 0":                   "--outer-sparse-bits",
		"--params 4000 --outer-h 5 --collective outer-sparse": "--outer-sparse-chunk",
	} {
		_, err := parsePlanFlags(strings.Fields(args), io.Discard)
		if assert.Error(t, err, args) {
			assert.True(t, cliflag.IsUsage(err), "%s: %v", args, err)
			assert.Contains(t, err.Error(), flagName, args)
		}
	}
	cfg, err := parsePlanFlags(strings.Fields("--outer-h 50 --outer-fragments 4 --outer-delay 12"), io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 50, cfg.job.OuterH)
	assert.Equal(t, 4, cfg.job.OuterFragments)
	assert.Equal(t, 12, cfg.job.OuterDelay)
	assert.Equal(t, []string{"allreduce", "onebit", "outer-fp32", "outer-bf16", "outer-int8", "outer-1bit", "outer-sparse", "outer-sparse-2p"}, cfg.job.Collectives)
	// A fragment shorter than the sparse codec's chunk: its row is left
	// out of the default ones.
	cfg, err = parsePlanFlags(strings.Fields("--params 4000 --outer-h 5"), io.Discard)
	require.NoError(t, err)
	assert.Equal(t, []string{"allreduce", "onebit", "outer-fp32", "outer-bf16", "outer-int8", "outer-1bit"}, cfg.job.Collectives)
}

// stateRows runs lowbit plan with args and returns its optimizer state
// table's rows by name, each as its fields.
func stateRows(t *testing.T, args string) (string, map[string][]string) {
	t.Helper()
	return tableRows(t, args, "optimizer state per rank", "state: ")
}

// --muon-shape adds Muon's rows to the time table, with the
// orthogonalization in a column of its own; the state table has Muon's
// rows always, and the outer optimizer's with --outer-h, each
// costmodel.Job.StateTable's figure.
func TestPlanMuonAndStateRows(t *testing.T) {
	const args = "--params 1.3B --ranks 8 --link 100mbit --step-compute 1s --memory 24Gi"
	s, rows := outerRows(t, args)
	assert.Len(t, rows, 2)
	assert.NotContains(t, s, "orthogonalize")

	s, rows = outerRows(t, args+" --muon-shape 2048x2048 --muon-flops 1e15")
	require.Len(t, rows, 5, s)
	assert.Contains(t, s, "orthogonalize")
	// 309 matrices of 2048², 20 d FLOP per element each: 5.31e13 FLOP at
	// 1e15 FLOP/s; split on 8 ranks, 39 of them: 6.7 ms.
	assert.Contains(t, s, "309 matrices of 2048x2048 (--muon-shape, --muon-params), 3960064 parameters to AdamW")
	assert.Equal(t, "53.1ms", rows["muon"][6])
	assert.Equal(t, "6.70ms", rows["muon-split"][6])
	assert.Equal(t, "0", rows["allreduce"][6])
	assert.Equal(t, rows["allreduce"][:6], rows["muon"][:6], "the exact allreduce's exchange")
	assert.Equal(t, rows["onebit"][:6], rows["onebit-muon"][:6], "the 1-bit allreduce's exchange")
	assert.Contains(t, s, "onebit-muon: 1-bit Muon (onebit.NewMuon) after its warm-up")

	_, rows = outerRows(t, args+" --collective allreduce,muon --muon-params 1B")
	assert.Len(t, rows, 2)

	job := costmodel.Job{Params: 1.3e9, Ranks: 8, BucketBytes: optim.DefaultBucketBytes, OuterH: 50}
	s, st := stateRows(t, args+" --outer-h 50")
	for _, want := range job.StateTable() {
		require.NoError(t, want.Err)
		r := st[want.Optimizer]
		require.Len(t, r, 6, "%s: %s", want.Optimizer, s)
		assert.Equal(t, strconv.FormatFloat(float64(want.Bytes)/1.3e9, 'f', 2, 64), r[0], want.Optimizer)
	}
	for _, name := range []string{"muon", "onebit-muon", "outer-fp32", "outer-int8", "outer-1bit", "outer-sparse", "outer-sparse-fp32"} {
		require.Contains(t, st, name, s)
	}
	assert.NotContains(t, st, "outer-bf16")
	assert.Equal(t, []string{"20.00", "26.00", "GB", "36.40", "GB", "no"}, st["outer-fp32"], "θ_g, u and AdamW: 16 bytes per parameter, and the exchange buffer")
	// The sparse codec at its defaults, bfloat16 state (issue 51's goal:
	// at most 12 bytes per parameter at W = 8): θ_g 4, the accumulator 2,
	// AdamW's moments 4, the messages; with float32 state 6 more.
	assert.Equal(t, []string{"10.31", "13.41", "GB", "23.81", "GB", "yes"}, st["outer-sparse"], "bfloat16 state by default")
	assert.Equal(t, []string{"16.31", "21.21", "GB", "31.61", "GB", "no"}, st["outer-sparse-fp32"], "float32 state")
	assert.Contains(t, s, "outer-sparse-fp32: the sparse codec with float32 state")
	assert.Equal(t, "yes", st["muon"][5])
	assert.Contains(t, s, "outer-*: the outer optimizer")
	_, st = stateRows(t, args)
	assert.Contains(t, st, "muon")
	assert.NotContains(t, st, "outer-fp32")

	for _, bad := range []string{"2048", "2048x", "x5", "0x5", "5x-1", "2.5x4", "axb", ""} {
		_, err := parsePlanFlags([]string{"--muon-shape", bad}, io.Discard)
		if assert.Error(t, err, bad) {
			assert.True(t, cliflag.IsUsage(err), "%s: %v", bad, err)
			assert.Contains(t, err.Error(), "--muon-shape", bad)
		}
	}
	cfg, err := parsePlanFlags(strings.Fields("--muon-shape 1024X4096 --muon-params 340M --muon-flops 2e12"), io.Discard)
	require.NoError(t, err)
	assert.Equal(t, [2]int64{1024, 4096}, cfg.job.MuonShape)
	assert.Equal(t, int64(340e6), cfg.job.MuonParams)
	assert.Equal(t, 2e12, cfg.job.MuonFlops)
	assert.Equal(t, []string{"allreduce", "onebit", "muon", "muon-split", "onebit-muon"}, cfg.job.Collectives)
}

// --rtt sets every latency-bound round to half the round trip: at --rtt
// 50ms each row's latency is its rounds, counted here from the
// algorithms, times 25 ms, the agreement of the outer rows included; the
// assumptions say where alpha comes from, and a slow link without --rtt
// (or --alpha) says that it keeps the loopback's latency.
func TestPlanRTT(t *testing.T) {
	// 124M parameters in buckets of 1Mi elements: 119 buckets (the last
	// 268032 elements), none pipelined on 4 ranks; the outer optimizer
	// exchanges the whole model every 50 steps.
	const args = "--params 124M --ranks 4 --link 10mbit --step-compute 200ms --bucket 4Mi --outer-h 50 --muon-shape 1024x1024"
	const buckets, r, hop = 119.0, 3.0, 0.025
	want := map[string]float64{
		"allreduce": buckets * 2 * r, "onebit": buckets * 3 * r, "muon": buckets * 2 * r, "onebit-muon": buckets * 3 * r,
		// Split: muon's allreduce, then one all-gather of the updates.
		"muon-split": buckets*2*r + r,
		// One exchange every 50 steps: the agreement (W-1 rounds), then
		// the codec's collective.
		"outer-fp32": (r + 2*r) / 50, "outer-bf16": (r + 2*r) / 50, "outer-int8": (r + 2*r) / 50,
		"outer-1bit": (r + buckets*3*r) / 50, "outer-muon": (r + buckets*3*r) / 50, "outer-sparse": (r + r) / 50, "outer-sparse-2p": (r + 2*r) / 50,
	}
	var out bytes.Buffer
	require.NoError(t, planMain(strings.Fields(args+" --rtt 50ms --json"), &out, io.Discard))
	var res struct {
		Assumptions costmodel.Assumptions `json:"assumptions"`
		Rows        []costmodel.Row       `json:"collectives"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	require.Len(t, res.Rows, len(want))
	for _, row := range res.Rows {
		assert.InDelta(t, want[row.Collective]*hop, row.LatencyS, 1e-12, row.Collective)
	}
	assert.Equal(t, hop, res.Assumptions.Alpha)
	assert.Empty(t, res.Assumptions.AlphaNote)

	s, rows := outerRows(t, args+" --rtt 50ms")
	assert.Contains(t, s, "  alpha:   25.0ms per latency-bound round (--rtt 50ms / 2: a round is a one-way hop)")
	assert.NotContains(t, s, "note:")
	assert.Equal(t, "17.85s", rows["allreduce"][3], "714 rounds of 25 ms")
	assert.Equal(t, "4.50ms", rows["outer-fp32"][3], "9 rounds of 25 ms every 50 steps")

	s, _ = outerRows(t, args)
	assert.Contains(t, s, "  note:    the latency is the calibration loopback's (alpha above); a link below 1 Gbit/s is often a wide-area one")
	assert.Contains(t, s, "give it with --rtt (e.g. --rtt 40ms)")
	for _, quiet := range []string{" --rtt 40ms", " --alpha 20ms", " --link 1gbit"} {
		s, _ = outerRows(t, args+quiet)
		assert.NotContains(t, s, "note:", quiet)
	}

	for in, want := range map[string]time.Duration{"40ms": 40 * time.Millisecond, "1.5ms": 1500 * time.Microsecond, "2s": 2 * time.Second} {
		cfg, err := parsePlanFlags([]string{"--rtt", in}, io.Discard)
		require.NoError(t, err, in)
		assert.Equal(t, want, cfg.job.RTT, in)
	}
	for in, reason := range map[string]string{"-1ms": "must be in [0, 2s]", "2.5s": "must be in [0, 2s]", "40": "not a duration",
		"fast": "not a duration", "0.04": "not a duration"} {
		_, err := parsePlanFlags([]string{"--rtt", in}, io.Discard)
		if assert.Error(t, err, in) {
			assert.True(t, cliflag.IsUsage(err), "%s: %v", in, err)
			assert.Contains(t, err.Error(), `invalid value "`+in+`" for --rtt: `+reason, in)
			assert.NotContains(t, err.Error(), "e.g.", "no default to offer")
		}
	}
	_, err := parsePlanFlags(strings.Fields("--rtt 40ms --alpha 10us"), io.Discard)
	if assert.Error(t, err) {
		assert.Contains(t, err.Error(), `invalid value "40ms" for --rtt: sets the latency of a round as --alpha does`)
	}
}

// The comm column is each row's exchange alone (costmodel.Row.CommS:
// latency + transfer + compress, less what a delayed outer exchange
// hides), third field from the end of its line, before step comm, with
// Muon's orthogonalization column or without: what a measured time in
// collectives per step compares with.
func TestPlanCommColumn(t *testing.T) {
	for _, args := range []string{
		"--params 124M --ranks 4 --link 10mbit --step-compute 200ms --outer-h 50 --outer-fragments 5 --outer-delay 2",
		"--params 1.3B --ranks 8 --link 1gbit --step-compute 1s --muon-shape 2048x8192 --rtt 20ms",
	} {
		var out bytes.Buffer
		require.NoError(t, planMain(strings.Fields(args+" --json"), &out, io.Discard))
		var res struct {
			Rows []costmodel.Row `json:"collectives"`
		}
		require.NoError(t, json.Unmarshal(out.Bytes(), &res))
		s, _ := outerRows(t, args)
		assert.Contains(t, s, "  comm  step comm  speedup vs exact\n", args)
		assert.Contains(t, s, "step comm: comm (the gradient exchange of one step: latency + transfer + compress) + ", args)
		lines := map[string][]string{}
		for _, l := range strings.Split(s, "\n") {
			// The time table's row: the first line of that name.
			if f := strings.Fields(l); len(f) > 3 && lines[strings.TrimSuffix(f[0], "*")] == nil {
				lines[strings.TrimSuffix(f[0], "*")] = f
			}
		}
		for _, row := range res.Rows {
			f := lines[row.Collective]
			require.NotEmpty(t, f, row.Collective)
			assert.Equal(t, formatSeconds(row.CommS), f[len(f)-3], "%s: %s", args, row.Collective)
			assert.Equal(t, formatSeconds(row.StepS), f[len(f)-2], "%s: %s", args, row.Collective)
			assert.InDelta(t, row.LatencyS+row.TransferS+row.CompressS, row.CommS, 1e-9, row.Collective)
		}
	}
}

// At a 40 ms round trip the default 25Mi buckets cost the 1-bit row four
// times the comm of larger ones, in latency-bound rounds: the plan says
// which --bucket would do better. Not where the default costs little, nor
// where --bucket was given.
func TestPlanBucketHint(t *testing.T) {
	const args = "--params 1.3G --ranks 8 --link 100mbit --rtt 40ms"
	var out bytes.Buffer
	require.NoError(t, planMain(strings.Fields(args), &out, io.Discard))
	assert.Contains(t, out.String(), "\nhint: latency-bound rounds are 78% of onebit's comm in the default buckets of 25Mi; "+
		"--bucket 2Gi predicts 26.84s instead of 107.40s (larger buckets hold more memory: rerun with it for the state table)\n")
	var with bytes.Buffer
	require.NoError(t, planMain(strings.Fields(args+" --bucket 2Gi"), &with, io.Discard))
	assert.Contains(t, with.String(), " 26.84s ")
	assert.NotContains(t, with.String(), "hint:")
	for _, a := range []string{args + " --bucket 25Mi", "--params 1.3G --ranks 64 --link 10gbit", args + " --json"} {
		out.Reset()
		require.NoError(t, planMain(strings.Fields(a), &out, io.Discard))
		assert.NotContains(t, out.String(), "hint:", a)
	}
}

// The two-machine gigabit case of docs/plan.md: 19M parameters, one
// machine's 8,192 tokens a step in 40.8ms (the compute at which the exact
// allreduce is 7x slower per token than one machine). The exact allreduce
// is 7x slower, its break even about 100k tokens; the pick is at least
// 1.3x one machine.
func TestPlanVsOne(t *testing.T) {
	args := "--params 19M --ranks 2 --link 1gbit --outer-h 50 --vs-one --tokens-per-step 8192 --step-compute 40.8ms"
	s, rows := tableRows(t, args, "# lowbit plan --vs-one", "pick:")
	assert.Contains(t, s, "2 machines against one: 19M parameters, 1 Gbit/s links (per-rank), 8192 tokens per worker per step, one machine's step 40.8ms")
	var names []string
	for name := range rows {
		names = append(names, name)
	}
	slices.Sort(names)
	assert.Equal(t, []string{"allreduce", "fp16", "onebit", "outer-1bit", "outer-bf16", "outer-fp32", "outer-int8", "outer-sparse", "outer-sparse-2p"}, names)
	ratio := func(name string) float64 {
		t.Helper()
		f := rows[name]
		require.Len(t, f, 4, name)
		r, err := strconv.ParseFloat(strings.TrimSuffix(f[2], "x"), 64)
		require.NoError(t, err)
		return r
	}
	assert.InDelta(t, 1.0/7, ratio("allreduce"), 0.01)
	assert.Equal(t, "200784", rows["allreduce"][0], "8192 tokens / 40.8ms")
	even, err := strconv.ParseFloat(rows["allreduce"][3], 64)
	require.NoError(t, err)
	assert.InDelta(t, 8192*13, even, 2000, "break even at 2s-1 = 13 times the tokens")
	assert.Less(t, ratio("fp16"), 0.5)
	require.Contains(t, s, "pick: outer-sparse, ")
	assert.GreaterOrEqual(t, ratio("outer-sparse"), 1.3)
	assert.Contains(t, s, "the most of the calibrated rows is outer-1bit")
	assert.GreaterOrEqual(t, ratio("outer-1bit"), 1.3)
	// The plan's own table follows.
	assert.Contains(t, s, "# lowbit plan: 19M parameters")

	var out bytes.Buffer
	require.NoError(t, planMain(append(strings.Fields(args), "--json"), &out, io.Discard))
	var res struct {
		VsOne costmodel.VsOne `json:"vs_one"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	assert.Equal(t, int64(8192), res.VsOne.TokensPerStep)
	assert.Equal(t, "outer-sparse", res.VsOne.Pick)
	assert.Len(t, res.VsOne.Rows, 9)
}

// A --vs-one that cannot compare W machines with one is refused in one
// line that names the flag.
func TestPlanVsOneErrors(t *testing.T) {
	ok := "--params 19M --link 1gbit --vs-one --tokens-per-step 8192 --step-compute 40ms"
	for args, flagName := range map[string]string{
		ok + " --ranks 1":               "--ranks",
		ok + " --tokens-per-step 0":     "--tokens-per-step",
		ok + " --tokens-per-step -5":    "--tokens-per-step",
		ok + " --step-compute 0":        "--step-compute",
		ok + " --step-compute 0s":       "--step-compute",
		ok + " --link 0gbit":            "--link",
		ok + " --link 0":                "--link",
		"--params 19M --vs-one":         "--tokens-per-step",
		"--vs-one --tokens-per-step 8k": "--step-compute",
		"--tokens-per-step 8k":          "--vs-one",
	} {
		err := planMain(strings.Fields(args), io.Discard, io.Discard)
		if assert.Error(t, err, args) {
			assert.True(t, cliflag.IsUsage(err), "%s: %v", args, err)
			assert.Contains(t, err.Error(), flagName, args)
			assert.NotContains(t, err.Error(), "\n", args)
		}
	}
	_, err := parsePlanFlags([]string{"fit", "--vs-one"}, io.Discard)
	assert.True(t, cliflag.IsUsage(err), "%v", err)
}
