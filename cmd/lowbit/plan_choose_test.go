package main

import (
	"bytes"
	"encoding/json"
	"io"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/costmodel"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
)

// --choose prints the choice and its reason in one line, the rows
// considered, then the plan; with --muon the sparse rows are excluded,
// saying why, and the choice is the 1-bit codec with Muon inside.
func TestPlanChoose(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, planMain(strings.Fields("--params 1.3B --ranks 16 --link 100mbit --step-compute 1s --compress-rate 30e9 --outer-h 25 --choose --muon --muon-flops 400e12"), &out, io.Discard))
	s := out.String()
	require.True(t, strings.HasPrefix(s, "# lowbit plan --choose: 1.3B parameters, 16 ranks, 100 Mbit/s links (per-rank), local steps accepted (--outer-h 25), Muon\n"), s)
	lines := strings.Split(s, "\n")
	assert.Regexp(t, `^choice: outer-muon: [0-9.]+ s/step, [0-9.]+x the next \(onebit-muon [0-9.]+ s\); excluded: outer-sparse(, outer-sparse-[\w-]+)* \(Muon inside: .*"The tighter target: Muon inside"\)\)$`, lines[1])
	assert.Equal(t, `outer.ConfigForRow("outer-muon", 25, 1, 0) gives its outer.Config (codec 1bit at outer.DefaultConfigFor)`, lines[2])
	assert.Contains(t, s, "\n# lowbit plan: 1.3B parameters", "the plan follows")

	out.Reset()
	require.NoError(t, planMain(strings.Fields("--params 1.3B --ranks 16 --link 100mbit --step-compute 1s --choose --json"), &out, io.Discard))
	var res struct {
		Choice costmodel.Choice `json:"choice"`
		Plan   costmodel.Plan   `json:"plan"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &res))
	assert.Equal(t, "onebit", res.Choice.Row, "no local steps without --outer-h")
	assert.False(t, res.Choice.Outer)
	assert.Equal(t, 16, res.Plan.Ranks)

	// Nothing fits the budget: an error that says so.
	err := planMain(strings.Fields("--params 1.3B --memory 1Gi --choose"), io.Discard, io.Discard)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "--choose: --memory: no optimizer fits 1Gi")
}

// --utilization prints a rate per row and target; at the printed rate the
// plan's utilization is the target (to the printed digits).
func TestPlanUtilization(t *testing.T) {
	var out bytes.Buffer
	args := "--params 7B --ranks 14 --link 1gbit --step-compute 2s --compress-rate 30e9 --outer-h 100 --utilization 0.9,0.95 --collective allreduce,outer-int8"
	require.NoError(t, planMain(strings.Fields(args), &out, io.Discard))
	lines := strings.Split(out.String(), "\n")
	require.True(t, strings.HasPrefix(lines[0], "# lowbit plan --utilization: 7B parameters, 14 ranks (per-rank links), 2s of compute per step"), lines[0])
	assert.Equal(t, []string{"collective", "90%", "95%", "at", "1", "Gbit/s", "at", "most"}, strings.Fields(lines[1]))
	row := strings.Fields(lines[3])
	require.Equal(t, "outer-int8*", row[0], lines[3])
	gbit, err := strconv.ParseFloat(row[2], 64)
	require.NoError(t, err)

	// The footer's alpha and beta, as the solve had them.
	m := regexp.MustCompile(`alpha (\S+) per round and beta ([0-9.]+) x`).FindStringSubmatch(out.String())
	require.Len(t, m, 3, out.String())
	out.Reset()
	require.NoError(t, planMain(strings.Fields("--params 7B --ranks 14 --link "+strconv.FormatFloat(gbit, 'g', -1, 64)+"gbit --alpha "+m[1]+" --ineff "+m[2]+" --step-compute 2s --compress-rate 30e9 --outer-h 100 --collective outer-int8 --json"), &out, io.Discard))
	var p costmodel.Plan
	require.NoError(t, json.Unmarshal(out.Bytes(), &p))
	assert.InDelta(t, 0.95, p.Rows[0].Utilization(), 0.005)
}

// --utilization outside (0, 1), --muon without --choose, --utilization
// without compute: one line naming the flag.
func TestPlanChooseFlagErrors(t *testing.T) {
	for args, name := range map[string]string{
		"--step-compute 1s --utilization 0":        "--utilization",
		"--step-compute 1s --utilization 1":        "--utilization",
		"--step-compute 1s --utilization 1.5":      "--utilization",
		"--step-compute 1s --utilization -0.5":     "--utilization",
		"--step-compute 1s --utilization 0.9,2":    "--utilization",
		"--step-compute 1s --utilization NaN":      "--utilization",
		"--step-compute 1s --utilization 95%":      "--utilization",
		"--utilization 0.95":                       "--step-compute",
		"--muon":                                   "--muon",
		"--step-compute 0s --utilization 0.5,0.95": "--step-compute",
	} {
		err := planMain(strings.Fields(args), io.Discard, io.Discard)
		if assert.Error(t, err, args) {
			assert.True(t, cliflag.IsUsage(err), "%s: %v", args, err)
			assert.Contains(t, err.Error(), name, args)
			assert.NotContains(t, err.Error(), "\n", args)
		}
	}
	_, err := parsePlanFlags([]string{"fit", "--choose"}, io.Discard)
	assert.True(t, cliflag.IsUsage(err), "%v", err)
}
