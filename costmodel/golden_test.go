package costmodel

import (
	"encoding/json"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// golden is testdata/golden.json: lowbit plan's figures on the built-in
// calibration, recorded with the command before the model became this
// package.
type golden struct {
	Plans []struct {
		Args string `json:"args"`
		Job  struct {
			Params                    int64
			Ranks                     int
			Link                      float64
			LinkName                  string
			Sharing                   Sharing
			BucketBytes               int64
			Collectives               []string
			StepCompute               string
			CompressBps, Alpha, Ineff float64
		} `json:"job"`
		Assumptions Assumptions `json:"assumptions"`
		Rows        []Row       `json:"collectives"`
	} `json:"plans"`
	Fits    map[string]LinkFit `json:"fits"`
	Check   []Check            `json:"check"`
	Holdout []Check            `json:"holdout"`
}

// closeTo asserts a figure equal to the recorded one up to float64
// rounding of a reordered sum.
func closeTo(t *testing.T, want, got float64, what string) {
	t.Helper()
	if want == 0 {
		assert.Zero(t, got, what)
		return
	}
	assert.InEpsilon(t, want, got, 1e-12, what)
}

// The predictions on the built-in calibration are the ones lowbit plan
// printed before the model moved here: the plans of nine jobs (per-rank
// and shared links, calibrated and uncalibrated rates, overrides, odd
// buckets), the fitted links, and every point's prediction in "lowbit plan
// fit" and "lowbit plan fit --holdout".
func TestGoldenPredictions(t *testing.T) {
	data, err := os.ReadFile("testdata/golden.json")
	require.NoError(t, err)
	var g golden
	require.NoError(t, json.Unmarshal(data, &g))
	require.Len(t, g.Plans, 9)

	cal, err := Builtin()
	require.NoError(t, err)
	require.Len(t, cal.Model.Fits, len(g.Fits))
	for name, want := range g.Fits {
		got := cal.Model.Fits[name]
		closeTo(t, want.Alpha, got.Alpha, name+" alpha")
		closeTo(t, want.Ineff, got.Ineff, name+" ineff")
		closeTo(t, want.RMS, got.RMS, name+" rms")
		assert.Equal(t, want.Points, got.Points, name)
	}
	for _, gp := range g.Plans {
		d, err := time.ParseDuration(gp.Job.StepCompute)
		require.NoError(t, err)
		j := Job{Params: gp.Job.Params, Ranks: gp.Job.Ranks, Link: gp.Job.Link, LinkName: gp.Job.LinkName,
			Sharing: gp.Job.Sharing, BucketBytes: gp.Job.BucketBytes, Collectives: gp.Job.Collectives,
			StepCompute: d, CompressBps: gp.Job.CompressBps, Alpha: gp.Job.Alpha, Ineff: gp.Job.Ineff}
		p, err := cal.Model.Plan(j)
		require.NoError(t, err, gp.Args)
		a, wa := p.Assumptions, gp.Assumptions
		closeTo(t, wa.Alpha, a.Alpha, gp.Args)
		closeTo(t, wa.Ineff, a.Ineff, gp.Args)
		closeTo(t, wa.CompressBps, a.CompressBps, gp.Args)
		assert.Equal(t, wa.Buckets, a.Buckets, gp.Args)
		assert.Equal(t, wa.AlphaFrom, a.AlphaFrom, gp.Args)
		assert.Equal(t, wa.IneffFrom, a.IneffFrom, gp.Args)
		assert.Equal(t, wa.CompressFrom, a.CompressFrom, gp.Args)
		require.Len(t, p.Rows, len(gp.Rows), gp.Args)
		for i, want := range gp.Rows {
			got := p.Rows[i]
			what := gp.Args + ": " + want.Collective
			assert.Equal(t, want.Collective, got.Collective, what)
			assert.Equal(t, want.Calibrated, got.Calibrated, what)
			assert.Equal(t, want.Calls, got.Calls, what)
			assert.Equal(t, want.WirePerRank, got.WirePerRank, what)
			closeTo(t, want.LatencyS, got.LatencyS, what+" latency")
			closeTo(t, want.TransferS, got.TransferS, what+" transfer")
			closeTo(t, want.CompressS, got.CompressS, what+" compress")
			closeTo(t, want.StepS, got.StepS, what+" step")
			closeTo(t, want.SpeedupExact, got.SpeedupExact, what+" speedup")
		}
	}
	checkSame := func(want, got []Check, what string) {
		require.Len(t, got, len(want), what)
		for i := range want {
			assert.Equal(t, want[i].Collective, got[i].Collective, what)
			assert.Equal(t, want[i].Ranks, got[i].Ranks, what)
			assert.Equal(t, want[i].Bytes, got[i].Bytes, what)
			closeTo(t, want[i].Measured, got[i].Measured, what)
			closeTo(t, want[i].Predicted, got[i].Predicted, what)
		}
	}
	checkSame(g.Check, cal.Check(), "fit")
	ho, err := cal.HoldOut()
	require.NoError(t, err)
	checkSame(g.Holdout, ho, "holdout")
}

// Job.FieldNames gives the plan's sentences a front end's names of the
// fields that replaced, or would replace, a fitted figure; a field it
// does not name stays Job.<field>.
func TestPlanFieldNames(t *testing.T) {
	cal, err := Builtin()
	require.NoError(t, err)
	j := Job{Params: 340e6, Ranks: 8, Link: 1.25e9, LinkName: "10gbit", BucketBytes: 25 << 20,
		Alpha: 1e-5, Ineff: 1.2, CompressBps: 2e10, FieldNames: map[string]string{"Alpha": "--alpha", "Ineff": "-i"}}
	p, err := cal.Model.Plan(j)
	require.NoError(t, err)
	assert.Equal(t, "--alpha", p.Assumptions.AlphaFrom)
	assert.Equal(t, "-i", p.Assumptions.IneffFrom)
	assert.Equal(t, "Job.CompressBps", p.Assumptions.CompressFrom)

	j.CompressBps, j.FieldNames = 0, map[string]string{"CompressBps": "the rate"}
	p, err = cal.Model.Plan(j)
	require.NoError(t, err)
	assert.Equal(t, "Job.Alpha", p.Assumptions.AlphaFrom)
	assert.Contains(t, p.Assumptions.CompressFrom, "; set the rate to your hardware's")
}

// A Job that Plan cannot use names its field.
func TestJobValidate(t *testing.T) {
	cal, err := Builtin()
	require.NoError(t, err)
	good := Job{Params: 340e6, Ranks: 8, Link: 1.25e9, LinkName: "10gbit", BucketBytes: 25 << 20}
	_, err = cal.Model.Plan(good)
	require.NoError(t, err)
	for field, mut := range map[string]func(*Job){
		"Params":      func(j *Job) { j.Params = 0 },
		"Ranks":       func(j *Job) { j.Ranks = 1 },
		"Link":        func(j *Job) { j.Link = 0 },
		"Sharing":     func(j *Job) { j.Sharing = "both" },
		"CompressBps": func(j *Job) { j.CompressBps = -1 },
		"Alpha":       func(j *Job) { j.Alpha = -1 },
		"Ineff":       func(j *Job) { j.Ineff = -1 },
		"BucketBytes": func(j *Job) { j.BucketBytes = 6 },
		"StepCompute": func(j *Job) { j.StepCompute = -time.Second },
		"Collectives": func(j *Job) { j.Collectives = []string{"allreduce", "qgz"} },
	} {
		j := good
		mut(&j)
		_, err := cal.Model.Plan(j)
		var je *JobError
		require.ErrorAs(t, err, &je, field)
		assert.Equal(t, field, je.Field)
	}
	j := good
	j.Params = 7000e12
	_, err = cal.Model.Plan(j)
	require.EqualError(t, err, "Params: must be in [1, 1000T] parameters, got 7000T", "a parameter count is written as counts are (size.FormatCount)")
}
