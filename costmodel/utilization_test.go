package costmodel

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// At the rate UtilizationRates returns, the model's utilization of the
// row is the target within 0.5%; a higher target needs a faster link;
// per-rank and shared links, with and without a delayed exchange.
func TestUtilizationRates(t *testing.T) {
	cal, err := Builtin()
	require.NoError(t, err)
	m := cal.Model
	targets := []float64{0.5, 0.8, 0.9, 0.95, 0.99}
	for _, j := range []Job{
		gridJob(t, 16, "10gbit"),
		{Params: 7e9, Ranks: 14, Link: mustRate("1gbit"), BucketBytes: DefaultBucketBytes, StepCompute: 2 * time.Second,
			OuterH: 100, OuterFragments: 4, OuterDelay: 5, CompressBps: 30e9, RTT: 40 * time.Millisecond},
		{Params: 136704, Ranks: 4, Link: mustRate("1mbit"), LinkName: "1mbit", Sharing: Shared, BucketBytes: DefaultBucketBytes,
			StepCompute: 250 * time.Millisecond, OuterH: 25},
	} {
		tab, err := m.UtilizationRates(j, targets)
		require.NoError(t, err)
		require.NotEmpty(t, tab.Rows)
		reached := 0
		for _, r := range tab.Rows {
			require.Len(t, r.Cells, len(targets))
			prev := 0.0
			for i, c := range r.Cells {
				if c.Unreachable {
					assert.Less(t, r.Max, targets[i], r.Collective)
					for _, later := range r.Cells[i:] {
						assert.True(t, later.Unreachable, "%s: a higher target reached after an unreachable one", r.Collective)
					}
					break
				}
				reached++
				assert.GreaterOrEqual(t, c.Rate, prev, "%s: the rate grows with the target", r.Collective)
				prev = c.Rate
				one := j
				one.Collectives, one.Link, one.LinkName = []string{r.Collective}, c.Rate, ""
				one.Ineff = tab.Ineff
				if j.RTT == 0 {
					one.Alpha = tab.Alpha
				}
				p, err := m.Plan(one)
				require.NoError(t, err)
				assert.InDelta(t, targets[i], p.Rows[0].Utilization(), 0.005*targets[i], "%s at %s", r.Collective, FormatRate(c.Rate))
			}
		}
		assert.Greater(t, reached, len(tab.Rows), "most cells are reachable")
	}
}

// A target outside (0, 1) or no compute: an error naming the field.
func TestUtilizationRatesErrors(t *testing.T) {
	cal, err := Builtin()
	require.NoError(t, err)
	j := gridJob(t, 8, "1gbit")
	for _, bad := range [][]float64{nil, {0}, {1}, {-0.5}, {1.5}, {0.9, 2}} {
		_, err := cal.Model.UtilizationRates(j, bad)
		var je *JobError
		if assert.ErrorAs(t, err, &je, "%v", bad) {
			assert.Equal(t, "Utilization", je.Field)
		}
	}
	j.StepCompute = 0
	_, err = cal.Model.UtilizationRates(j, []float64{0.95})
	var je *JobError
	require.ErrorAs(t, err, &je)
	assert.Equal(t, "StepCompute", je.Field)
}
