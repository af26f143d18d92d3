package costmodel

import (
	"fmt"
	"math"
	"time"
)

// W machines against one (Job.TokensPerStep): how many tokens per second
// W data-parallel machines get through, each with TokensPerStep tokens per
// step and StepCompute of forward and backward for them, against one
// machine that computes the same steps alone, and at what tokens per
// worker per step they break even.
//
// One machine's step is StepCompute (for Muon's rows, plus the
// orthogonalization of every matrix: one machine runs exact Muon); W
// machines' is the row's step, Row.StepS, its communication not hidden.
// The compute time scales linearly with the tokens per step; the
// communication does not depend on them (but for the outer optimizer's
// delayed exchanges, which hide behind more compute as it grows).

// MaxTokensPerStep is the largest Job.TokensPerStep that Plan accepts.
const MaxTokensPerStep = 1e15

// VsOneRow is one row of a plan's "W machines against one" table.
type VsOneRow struct {
	Collective string `json:"collective"`
	Calibrated bool   `json:"calibrated"`
	// OneStepS is one machine's step: Job.StepCompute, and for Muon's
	// rows the orthogonalization of every Muon matrix (MuonPlan.OrthoS).
	OneStepS float64 `json:"one_step_s"`
	// StepS is the step of each of the W machines (Row.StepS).
	StepS float64 `json:"step_s"`
	// OneTokensPerS is one machine's tokens per second, TokensPerStep /
	// OneStepS, and TokensPerS the W machines', W * TokensPerStep /
	// StepS; Ratio is TokensPerS / OneTokensPerS.
	OneTokensPerS float64 `json:"one_tokens_per_s"`
	TokensPerS    float64 `json:"tokens_per_s"`
	Ratio         float64 `json:"ratio"`
	// BreakEvenTokens is the tokens per worker per step at which the W
	// machines get through as many tokens per second as one (Ratio 1),
	// with the compute time StepCompute/TokensPerStep per token: fewer
	// tokens per step lose, more win. 0: W machines win at any.
	BreakEvenTokens float64 `json:"break_even_tokens"`
}

// VsOne is a plan's "W machines against one" table (Job.TokensPerStep).
type VsOne struct {
	// TokensPerStep is Job.TokensPerStep, the tokens of each worker's
	// step, and StepCompute one machine's forward and backward time for
	// them, in seconds.
	TokensPerStep int64      `json:"tokens_per_step"`
	StepCompute   float64    `json:"step_compute_s"`
	Ranks         int        `json:"ranks"`
	Rows          []VsOneRow `json:"rows"`
	// Pick is the row with the most tokens per second on W machines (the
	// first of equal ones); PickCalibrated, when Pick is not calibrated,
	// is the calibrated row with the most ("" if none).
	Pick           string `json:"pick"`
	PickCalibrated string `json:"pick_calibrated,omitempty"`
}

// vsOne is the VsOne table of plan p of job j (j.TokensPerStep > 0,
// j.StepCompute > 0).
func (m *Model) vsOne(j Job, p *Plan) (*VsOne, error) {
	v := &VsOne{TokensPerStep: j.TokensPerStep, StepCompute: j.StepCompute.Seconds(), Ranks: j.Ranks}
	perToken := v.StepCompute / float64(j.TokensPerStep)
	w := float64(j.Ranks)
	bestAny, bestCal := -1, -1
	for _, r := range p.Rows {
		one := v.StepCompute + oneMachineOrtho(r, p)
		row := VsOneRow{Collective: r.Collective, Calibrated: r.Calibrated, OneStepS: one, StepS: r.StepS,
			OneTokensPerS: float64(j.TokensPerStep) / one, TokensPerS: w * float64(j.TokensPerStep) / r.StepS}
		row.Ratio = row.TokensPerS / row.OneTokensPerS
		compute, err := m.breakEvenCompute(j, p, r)
		if err != nil {
			return nil, err
		}
		row.BreakEvenTokens = compute / perToken
		v.Rows = append(v.Rows, row)
		i := len(v.Rows) - 1
		if bestAny < 0 || row.TokensPerS > v.Rows[bestAny].TokensPerS {
			bestAny = i
		}
		if row.Calibrated && (bestCal < 0 || row.TokensPerS > v.Rows[bestCal].TokensPerS) {
			bestCal = i
		}
	}
	if bestAny >= 0 {
		v.Pick = v.Rows[bestAny].Collective
		if !v.Rows[bestAny].Calibrated && bestCal >= 0 {
			v.PickCalibrated = v.Rows[bestCal].Collective
		}
	}
	return v, nil
}

// oneMachineOrtho is the orthogonalization one machine adds to its step
// for row r of p: every Muon matrix for Muon's rows (one machine runs
// exact Muon, whatever the row's split), nothing for the others.
func oneMachineOrtho(r Row, p *Plan) float64 {
	if p.Muon == nil || (!isMuonRow(r.Collective) && r.Collective != OptOuterMuon) {
		return 0
	}
	return p.Muon.OrthoS
}

// breakEvenCompute is the smallest compute time per step d >= 0 at which
// the W machines of row r of plan p (job j) get through as many tokens
// per second as one: W (d + o1) >= d + oW + comm(d), with o1 and oW the
// orthogonalization of one machine and of each of the W, and comm(d) the
// row's communication at compute d. comm does not depend on d but for an
// outer row with j.OuterDelay > 0, where it does not grow with d (an
// exchange hides behind up to OuterDelay steps of compute): d is then
// found by bisection on the plan at compute d, between 0 and the break
// even with nothing hidden, in nanoseconds (Job.StepCompute's unit).
func (m *Model) breakEvenCompute(j Job, p *Plan, r Row) (float64, error) {
	w := float64(j.Ranks)
	o1 := oneMachineOrtho(r, p)
	// With nothing hidden: the closed form.
	exposed := r.CommS + r.HiddenS
	hi := max(0, (r.OrthoS+exposed-w*o1)/(w-1))
	_, outer := findOuterCodec(r.Collective)
	if !outer || j.OuterDelay == 0 || hi == 0 || hi*1e9 >= math.MaxInt64 {
		return hi, nil
	}
	j.TokensPerStep = 0
	j.Collectives = []string{r.Collective}
	wins := func(d time.Duration) (bool, error) {
		j.StepCompute = d
		q, err := m.Plan(j)
		if err != nil {
			return false, fmt.Errorf("break even of %s at %s of compute: %w", r.Collective, d, err)
		}
		s := d.Seconds()
		return w*(s+o1) >= s+q.Rows[0].OrthoS+q.Rows[0].CommS, nil
	}
	lo, up := time.Duration(0), time.Duration(math.Ceil(hi*1e9))
	if ok, err := wins(lo); err != nil || ok {
		return 0, err
	}
	for up-lo > 1 {
		mid := lo + (up-lo)/2
		ok, err := wins(mid)
		if err != nil {
			return 0, err
		}
		if ok {
			up = mid
		} else {
			lo = mid
		}
	}
	return up.Seconds(), nil
}
