package costmodel

import (
	"fmt"
	"math"
)

// The link rate for a compute utilization (Model.UtilizationRates,
// docs/plan.md "The bandwidth for a target utilization"): for each row, the
// slowest link at which compute is busy a given share of the step, in the
// format of Streaming DiLoCo's bandwidth table.

// Utilization is the share of r's step that computes: the forward and
// backward (Job.StepCompute) and for Muon's rows the orthogonalization,
// against the step with the communication compute does not hide (CommS;
// an outer row's delayed exchange is hidden up to OuterDelay steps).
func (r Row) Utilization() float64 {
	if r.StepS <= 0 {
		return 0
	}
	return (r.StepS - r.CommS) / r.StepS
}

// Bounds of the link rates UtilizationRates searches, bytes per second:
// 1 bit/s to 8 Pbit/s.
const (
	minUtilRate = 1.0 / 8
	maxUtilRate = 1e15
)

// UtilizationCell is the link rate at which one row reaches one target.
type UtilizationCell struct {
	// Rate is the slowest link rate, bytes per second, at which the
	// row's utilization is at least the target (to a part in 1e6); 0
	// where Unreachable.
	Rate float64 `json:"link_bytes_per_s"`
	// Unreachable says that even at 8 Pbit/s the row's latency-bound
	// rounds and compression keep it below the target.
	Unreachable bool `json:"unreachable,omitempty"`
}

// UtilizationRow is one row of a UtilizationTable.
type UtilizationRow struct {
	Collective string `json:"collective"`
	Calibrated bool   `json:"calibrated"`
	// Cells are the rates for the table's Targets, in their order.
	Cells []UtilizationCell `json:"cells"`
	// AtLink is the row's utilization at Job.Link, and Max at 8 Pbit/s
	// (its latency and compression alone).
	AtLink float64 `json:"utilization_at_link"`
	Max    float64 `json:"utilization_max"`
}

// UtilizationTable is the link rate each row needs for each target.
type UtilizationTable struct {
	Targets []float64 `json:"targets"`
	// Alpha and Ineff are the latency per round and the time per byte
	// over the line rate's that every rate is predicted with: Job.Link's
	// (its calibrated fit, or Job.Alpha, Job.RTT, Job.Ineff), so that
	// only the rate changes.
	Alpha float64          `json:"alpha_s"`
	Ineff float64          `json:"ineff"`
	Rows  []UtilizationRow `json:"rows"`
}

// UtilizationRates solves, for each row of j's plan (j.Collectives, nil
// for the default rows) and each target in (0, 1), the slowest link rate
// at which the row's Utilization is the target: by bisection over the
// rate's logarithm, with everything else of j as it is and the latency
// and the time per byte over the line rate's fixed at j.Link's (the fit of
// the calibrated link nearest in rate would otherwise change with the
// rate). j.StepCompute must be positive. The outer rows' delayed
// exchanges hide as Plan has them.
func (m *Model) UtilizationRates(j Job, targets []float64) (*UtilizationTable, error) {
	if len(targets) == 0 {
		return nil, &JobError{Field: "Utilization", Reason: "no target utilization"}
	}
	for _, u := range targets {
		if !(u > 0 && u < 1) {
			return nil, &JobError{Field: "Utilization", Reason: fmt.Sprintf("must be a share in (0, 1), such as 0.95, got %g", u)}
		}
	}
	if j.StepCompute <= 0 {
		return nil, &JobError{Field: "StepCompute", Reason: "must be positive for a utilization: compute is busy for it"}
	}
	j.TokensPerStep = 0
	p, err := m.Plan(j)
	if err != nil {
		return nil, err
	}
	fixed := j
	fixed.LinkName = ""
	fixed.Ineff = p.Assumptions.Ineff
	if j.RTT == 0 {
		fixed.Alpha = p.Assumptions.Alpha
	}
	t := &UtilizationTable{Targets: targets, Alpha: p.Assumptions.Alpha, Ineff: p.Assumptions.Ineff}
	for _, r := range p.Rows {
		one := fixed
		one.Collectives = []string{r.Collective}
		util := func(rate float64) (float64, error) {
			one.Link = rate
			q, err := m.Plan(one)
			if err != nil {
				return 0, fmt.Errorf("%s at %s: %w", r.Collective, FormatRate(rate), err)
			}
			return q.Rows[0].Utilization(), nil
		}
		row := UtilizationRow{Collective: r.Collective, Calibrated: r.Calibrated, AtLink: r.Utilization()}
		if row.Max, err = util(maxUtilRate); err != nil {
			return nil, err
		}
		for _, target := range targets {
			c, err := solveRate(util, target, row.Max)
			if err != nil {
				return nil, err
			}
			row.Cells = append(row.Cells, c)
		}
		t.Rows = append(t.Rows, row)
	}
	return t, nil
}

// solveRate is the slowest rate in [minUtilRate, maxUtilRate] at which
// util reaches target, util at maxUtilRate being top; it takes util to
// grow with the rate.
func solveRate(util func(float64) (float64, error), target, top float64) (UtilizationCell, error) {
	if top < target {
		return UtilizationCell{Unreachable: true}, nil
	}
	lo, hi := math.Log(minUtilRate), math.Log(maxUtilRate)
	if u, err := util(minUtilRate); err != nil || u >= target {
		return UtilizationCell{Rate: minUtilRate}, err
	}
	for hi-lo > 1e-6 {
		mid := (lo + hi) / 2
		u, err := util(math.Exp(mid))
		if err != nil {
			return UtilizationCell{}, err
		}
		if u >= target {
			hi = mid
		} else {
			lo = mid
		}
	}
	return UtilizationCell{Rate: math.Exp(hi)}, nil
}
