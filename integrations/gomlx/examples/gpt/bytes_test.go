package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBytesAtEvaluations: every evaluation of the JSON curve carries the
// bytes a rank sent so far, growing from one evaluation to the next and
// ending at the run's bytes_sent_per_rank; the Markdown report has them in
// a table, and -plot also writes the plot against bytes, one curve per run.
func TestBytesAtEvaluations(t *testing.T) {
	dir := t.TempDir()
	md, svg := filepath.Join(dir, "gpt.md"), filepath.Join(dir, "gpt.svg")
	runs, _ := runJSON(t, tiny("-optimizer", "adam,onebit-adam", "-steps", "12", "-eval-every", "3", "-freeze-step", "3",
		"-markdown", md, "-plot", svg)...)
	require.Len(t, runs, 2)
	for _, r := range runs {
		require.Len(t, r.Curve, 4, r.Optimizer)
		prev := 0.0
		for _, e := range r.Curve {
			assert.Greater(t, e.BytesSent, prev, "%s at step %d", r.Optimizer, e.Step)
			prev = e.BytesSent
		}
		assert.InEpsilon(t, r.BytesSentPerRank, prev, 1e-6, "%s: the last evaluation's bytes are the run's", r.Optimizer)
	}
	adam, onebit := runs[0].Curve, runs[1].Curve
	assert.Equal(t, adam[0].BytesSent, onebit[0].BytesSent, "the same exact warm-up")
	assert.Greater(t, adam[3].BytesSent-adam[0].BytesSent, 10*(onebit[3].BytesSent-onebit[0].BytesSent), "1-bit Adam sends less after its warm-up")

	b, err := os.ReadFile(md)
	require.NoError(t, err)
	assert.Contains(t, string(b), "| step | tokens | adam | onebit-adam |")
	assert.Contains(t, string(b), "| 12 | 3072 |")
	assert.Contains(t, string(b), human(adam[3].BytesSent))

	b, err = os.ReadFile(filepath.Join(dir, "gpt-bytes.svg"))
	require.NoError(t, err)
	plot := string(b)
	assert.Equal(t, 2, strings.Count(plot, "<polyline"), "one curve per run")
	assert.Contains(t, plot, ">adam<")
	assert.Contains(t, plot, ">onebit-adam<")
	assert.Contains(t, plot, "log scale")
	assert.FileExists(t, svg)
}

// TestBytesOneRank: a run on 1 rank sends nothing: its evaluations carry 0
// bytes, and the plot against bytes, which has no place for 0 on its log
// axis, names the run as having sent nothing and draws no curve.
func TestBytesOneRank(t *testing.T) {
	dir := t.TempDir()
	svg := filepath.Join(dir, "one.svg")
	runs, _ := runJSON(t, tiny("-workers", "1", "-optimizer", "adam", "-steps", "4", "-eval-every", "2", "-plot", svg)...)
	require.Len(t, runs, 1)
	require.Len(t, runs[0].Curve, 2)
	for _, e := range runs[0].Curve {
		assert.Zero(t, e.BytesSent)
	}
	b, err := os.ReadFile(filepath.Join(dir, "one-bytes.svg"))
	require.NoError(t, err)
	assert.NotContains(t, string(b), "<polyline")
	assert.Contains(t, string(b), "adam (sent nothing)")
}

// TestWriteBytesPlot draws runs of known points: a curve per run that sent
// something, without its evaluations at 0 bytes (the log axis has no 0),
// a dot for a run with one point, and whole decades around the bytes.
func TestWriteBytesPlot(t *testing.T) {
	o, err := parseFlags(tiny(), nil)
	require.NoError(t, err)
	results := []*result{
		{spec: runSpec{name: "adam"}, workers: 4, evals: []evalPoint{
			{Step: 0, ValLoss: 5.5}, {Step: 10, ValLoss: 4, BytesSent: 2e6}, {Step: 20, ValLoss: 3, BytesSent: 4e6}}},
		{spec: runSpec{name: "diloco"}, workers: 4, evals: []evalPoint{
			{Step: 10, ValLoss: 4.2}, {Step: 20, ValLoss: 3.2, BytesSent: 3e3}, {Step: 30, ValLoss: 3.1, BytesSent: 6e3}}},
		{spec: runSpec{name: "lamb"}, workers: 4, evals: []evalPoint{{Step: 20, ValLoss: 3.5, BytesSent: 5e5}}},
		{spec: runSpec{name: "muon"}, workers: 4, evals: []evalPoint{{Step: 20, ValLoss: 3.5}}},
	}
	path := filepath.Join(t.TempDir(), "plot", "x.svg")
	require.NoError(t, writeBytesPlot(path, o, results))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	plot := string(b)
	assert.Equal(t, 2, strings.Count(plot, "<polyline"))
	assert.Equal(t, 1, strings.Count(plot, "<circle"))
	assert.Contains(t, plot, "muon (sent nothing)")
	for _, tick := range []string{">1 kB<", ">10 kB<", ">100 kB<", ">1 MB<", ">10 MB<"} {
		assert.Contains(t, plot, tick)
	}
	assert.NotContains(t, plot, ">100 B<")
	assert.NotContains(t, plot, ">100 MB<")
	assert.NotContains(t, plot, "NaN")
}

func TestBytesPlotPath(t *testing.T) {
	assert.Equal(t, filepath.Join("out", "gpt-bytes.svg"), bytesPlotPath(filepath.Join("out", "gpt.svg")))
	assert.Equal(t, "a.b-bytes.SVG", bytesPlotPath("a.b.SVG"))
}

func TestDecadeBytes(t *testing.T) {
	for d, want := range map[float64]string{-1: "0.1 B", 0: "1 B", 2: "100 B", 3: "1 kB", 7: "10 MB", 9: "1 GB", 12: "1 TB", 16: "10 PB"} {
		assert.Equal(t, want, decadeBytes(d), "10^%v", d)
	}
}
