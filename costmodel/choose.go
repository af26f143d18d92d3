package costmodel

import (
	"fmt"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/size"
)

// The optimizer and codec for a job (Model.Choose, docs/plan.md "The
// choice for the job"): of the rows a plan predicts, those the job allows
// (its optimizer family, local steps only with OuterH > 0, the memory
// budget, the quality rules the measurements established), the fastest
// per step by the model, or an earlier row of the preference order
// within ChooseTolerance of it.

// ChooseTolerance is how much slower per step (a share) a row earlier in
// the preference order may be than the fastest allowed row and still be
// chosen: fewer approximations (an exact or per-step exchange rather than
// a compressed one or local steps) for at most 2% more time per step.
const ChooseTolerance = 0.02

// ChooseOptions is what Model.Choose needs beyond a Job.
type ChooseOptions struct {
	// Muon says that the update rule is Muon: the candidates are Muon's
	// rows (muon, muon-split, onebit-muon) and the outer optimizer with
	// Muon inside (OptOuterMuon); without it AdamW's (allreduce, fp16,
	// onebit: Adam, Adam with 16-bit averaging, 1-bit Adam) and the outer
	// optimizer around AdamW, one row per codec.
	Muon bool
	// Memory is the bytes of one rank for optimizer state, parameters and
	// gradients (Job.StateTable's row plus 8 bytes per parameter); 0: no
	// limit.
	Memory int64
}

// Candidate is one row that Model.Choose considered.
type Candidate struct {
	// Row is the plan's row (Row.Collective).
	Row string `json:"row"`
	// State is the state table's row it is counted as (StateRow.Optimizer:
	// the first of the row's configurations that fits Memory, such as
	// onebit-adam-compact for onebit), and Bytes that state with the
	// parameters and gradients, 8 bytes per parameter.
	State string `json:"state,omitempty"`
	Bytes int64  `json:"bytes,omitempty"`
	// StepS is the row's predicted step (Row.StepS); 0 where excluded
	// before the plan.
	StepS float64 `json:"step_s,omitempty"`
	// Excluded, when not empty, says why the row may not be chosen;
	// OverMemory that it is ChooseOptions.Memory.
	Excluded   string `json:"excluded,omitempty"`
	OverMemory bool   `json:"over_memory,omitempty"`
}

// Choice is Model.Choose's answer.
type Choice struct {
	// Row is the chosen row (Row.Collective), State the state table's row
	// it is counted as (Candidate.State), StepS its predicted step.
	Row   string  `json:"row"`
	State string  `json:"state"`
	StepS float64 `json:"step_s"`
	// Outer says that Row is one of the outer optimizer's rows: Codec is
	// then its codec as outer.ParseCodec names it, and outer.ConfigForRow
	// gives its outer.Config.
	Outer bool   `json:"outer"`
	Codec string `json:"codec,omitempty"`
	// Fastest is the fastest allowed row (the best fixed choice of the
	// cell: docs/plan.md) and FastestStepS its step; Next is the fastest
	// allowed row after Row ("" if none), NextStepS its step.
	Fastest      string  `json:"fastest"`
	FastestStepS float64 `json:"fastest_step_s"`
	Next         string  `json:"next,omitempty"`
	NextStepS    float64 `json:"next_step_s,omitempty"`
	// Reason is why, in one line.
	Reason string `json:"reason"`
	// Candidates are every row considered, in the preference order.
	Candidates []Candidate `json:"candidates"`
	// Plan is the plan of the allowed rows.
	Plan *Plan `json:"-"`
}

// qualityRule is a row that the measurements say not to choose although
// the model predicts its step: the training it gives is worse.
type qualityRule struct {
	// applies says whether the rule excludes outer codec oc for j.
	applies func(oc outerCodec, j Job, o ChooseOptions) bool
	// why says why, citing the measurement.
	why string
}

// qualityRules are the measurements' rules for the outer optimizer's rows
// (docs/plan.md, "The choice for the job", cites each).
var qualityRules = []qualityRule{
	{
		// Any sparse exchange, present or added later, with Muon inside.
		applies: func(oc outerCodec, _ Job, o ChooseOptions) bool { return o.Muon && oc.codec == "sparse" },
		why: "Muon inside: the sparse codec misses the tighter target the 1-bit codec reaches, orthogonalized updates having " +
			"entries of similar size (docs/outer.md, \"The tighter target: Muon inside\")",
	},
	{
		// The shared-index exchanges (outer.SparseShared, SparseVoted): W
		// independent bytes, but measured worse than the all-gather.
		applies: func(oc outerCodec, _ Job, _ ChooseOptions) bool {
			return oc.name == "outer-sparse-shared" || oc.name == "outer-sparse-voted"
		},
		why: "the shared-index exchanges end above the all-gather's loss where measured (GPT example, 16 ranks, 150 steps: " +
			"shared +8.2%, voted +3.1%) (docs/outer.md, \"The shared-index exchange\")",
	},
	{
		// Any sparse exchange but the all-gather (outer-sparse), present
		// or added later, at 4 ranks or fewer.
		applies: func(oc outerCodec, j Job, _ ChooseOptions) bool {
			return oc.codec == "sparse" && oc.name != "outer-sparse" && j.Ranks <= 4
		},
		why: "at W <= 4 the all-gather is the sparse exchange measured best: the two-phase one ends 5.2% above its loss at about half " +
			"its bytes, and the all-gather sends less than the 1-bit codec there (docs/outer.md, \"The two-phase exchange\")",
	},
}

// chooseRow is a row Choose may consider and the state table's rows it
// may be counted as, the first fitting one taken.
type chooseRow struct {
	name   string
	states []string
	outer  *outerCodec
}

// perStepRows are the rows without local steps of each family, in the
// preference order: exact, then 16-bit, then 1-bit.
func perStepRows(muon bool) []chooseRow {
	if muon {
		return []chooseRow{
			{name: OptMuon, states: []string{OptMuon}},
			{name: OptMuonSplit, states: []string{OptMuon}},
			{name: OptOnebitMuon, states: []string{OptOnebitMuon, OptOnebitMuonCompactBF16}},
		}
	}
	return []chooseRow{
		// ZeRO's reduce-scatter and all-gather send the ring allreduce's
		// bytes.
		{name: "allreduce", states: []string{OptAdam, OptZeroAdam}},
		{name: "fp16", states: []string{OptAdam}},
		// The compact and sharded modes send what the full mode sends
		// (docs/sharded.md).
		{name: "onebit", states: []string{OptOnebitAdam, OptOnebitAdamCompact, OptOnebitAdamSharded, OptOnebitAdamShardedBF16}},
	}
}

// outerStateFor is the state table row an outer row is counted as: its
// own, else the default row of its codec, else the fp32 codec's (the bf16
// codec's buffers are not modelled; they are the fp32 codec's or fewer).
func outerStateFor(oc outerCodec, table []StateRow) string {
	for _, name := range []string{oc.name, "outer-" + oc.codec, "outer-fp32"} {
		if slices.ContainsFunc(table, func(r StateRow) bool { return r.Optimizer == name }) {
			return name
		}
	}
	return ""
}

// Choose picks the optimizer and codec for j: of the rows of o's family
// (ChooseOptions.Muon) and, with j.OuterH > 0 (the job accepts local
// steps), the outer optimizer's rows at j's OuterH, OuterFragments and
// OuterDelay (every row of the model, one per codec, so that a row added
// to the model is considered), those not excluded by o.Memory or a
// quality rule, the first in the preference order (per-step rows: exact,
// 16-bit, 1-bit; then the outer rows in the plan's order) whose step is
// within ChooseTolerance of the fastest. j.Collectives and
// j.TokensPerStep are ignored. It fails when j is invalid or no row is
// allowed.
func (m *Model) Choose(j Job, o ChooseOptions) (*Choice, error) {
	if o.Memory < 0 {
		return nil, &JobError{Field: "Memory", Reason: fmt.Sprintf("must not be negative, got %d", o.Memory)}
	}
	j.TokensPerStep = 0
	j.Collectives = []string{"allreduce"}
	if err := j.Validate(); err != nil {
		return nil, err
	}
	rows := perStepRows(o.Muon)
	var excluded []Candidate
	if j.OuterH > 0 {
		for i := range outerCodecs {
			oc := outerCodecs[i]
			r := chooseRow{name: oc.name, outer: &oc}
			why := ruleFor(oc, j, o)
			switch {
			case oc.muon != o.Muon && !(o.Muon && oc.codec == "sparse"):
				// The other family's row (the sparse codec with Muon
				// inside is excluded by its rule, saying why).
				continue
			case why == "" && oc.codec == "sparse" && !j.sparseFits():
				why = "its chunk (Job.OuterSparseChunk) is longer than the smallest fragment"
			}
			if why != "" {
				excluded = append(excluded, Candidate{Row: oc.name, Excluded: why})
				continue
			}
			rows = append(rows, r)
		}
	}
	table := j.StateTable()
	bytesOf := map[string]int64{}
	for _, s := range table {
		if s.Err == nil {
			bytesOf[s.Optimizer] = s.Bytes + 8*j.Params
		}
	}
	var cands []Candidate
	for _, r := range rows {
		states := r.states
		if r.outer != nil {
			states = []string{outerStateFor(*r.outer, table)}
		}
		c := Candidate{Row: r.name}
		for _, s := range states {
			b, ok := bytesOf[s]
			if !ok {
				continue
			}
			if c.State == "" || o.Memory > 0 && c.Bytes > o.Memory && b <= o.Memory {
				c.State, c.Bytes = s, b
			}
		}
		switch {
		case o.Memory > 0 && c.State == "":
			c.Excluded = "its state is too large to count"
		case o.Memory > 0 && c.Bytes > o.Memory:
			c.Excluded = fmt.Sprintf("needs %s for %s with params and grads, over the %s budget", bytesDecimal(c.Bytes), c.State, size.Format(o.Memory))
			c.OverMemory = true
		}
		cands = append(cands, c)
	}
	var names []string
	for _, c := range cands {
		if c.Excluded == "" {
			names = append(names, c.Row)
		}
	}
	if len(names) == 0 {
		return nil, &JobError{Field: "Memory", Reason: fmt.Sprintf("no optimizer fits %s: %s", size.Format(o.Memory), summarize(cands, o.Memory))}
	}
	j.Collectives = names
	p, err := m.Plan(j)
	if err != nil {
		return nil, err
	}
	step := map[string]float64{}
	for _, r := range p.Rows {
		step[r.Collective] = r.StepS
	}
	fastest := ""
	for i := range cands {
		c := &cands[i]
		if c.Excluded != "" {
			continue
		}
		c.StepS = step[c.Row]
		if fastest == "" || c.StepS < step[fastest] {
			fastest = c.Row
		}
	}
	ch := &Choice{Fastest: fastest, FastestStepS: step[fastest], Plan: p}
	for _, c := range cands {
		if c.Excluded == "" && c.StepS <= step[fastest]*(1+ChooseTolerance) {
			ch.Row, ch.State, ch.StepS = c.Row, c.State, c.StepS
			break
		}
	}
	for _, c := range cands {
		if c.Excluded == "" && c.Row != ch.Row && (ch.Next == "" || c.StepS < ch.NextStepS) {
			ch.Next, ch.NextStepS = c.Row, c.StepS
		}
	}
	if oc, ok := findOuterCodec(ch.Row); ok {
		ch.Outer, ch.Codec = true, oc.codec
	}
	ch.Candidates = append(cands, excluded...)
	ch.Reason = ch.reason(o)
	return ch, nil
}

// ruleFor is why a quality rule excludes oc for j ("" if none does).
func ruleFor(oc outerCodec, j Job, o ChooseOptions) string {
	for _, r := range qualityRules {
		if r.applies(oc, j, o) {
			return r.why
		}
	}
	return ""
}

// reason is ch's one line: the row, its step against the next fastest's
// (or the fastest's, when an earlier row of the preference order was
// taken within the tolerance), the memory, and the rows excluded.
func (ch *Choice) reason(o ChooseOptions) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %s/step", ch.Row, formatStep(ch.StepS))
	switch {
	case ch.Row != ch.Fastest:
		fmt.Fprintf(&b, ", within %.1f%% of the fastest (%s %s) and earlier in the preference order (fewer approximations)",
			100*(ch.StepS/ch.FastestStepS-1), ch.Fastest, formatStep(ch.FastestStepS))
	case ch.Next != "":
		fmt.Fprintf(&b, ", %s the next (%s %s)", ratioText(ch.NextStepS, ch.StepS), ch.Next, formatStep(ch.NextStepS))
	default:
		b.WriteString(", the only row allowed")
	}
	if ch.State != "" && ch.State != ch.Row {
		fmt.Fprintf(&b, ", as %s", ch.State)
	}
	if o.Memory > 0 {
		for _, c := range ch.Candidates {
			if c.Row == ch.Row {
				fmt.Fprintf(&b, ", fits %s (%s)", size.Format(o.Memory), bytesDecimal(c.Bytes))
			}
		}
	}
	if s := summarize(ch.Candidates, o.Memory); s != "" {
		b.WriteString("; excluded: " + s)
	}
	return b.String()
}

// ratioText is how many times slower next is than t ("2.31x",
// "1.004x").
func ratioText(next, t float64) string {
	if t <= 0 {
		return "slower than"
	}
	r := next / t
	if r < 1.01 {
		return fmt.Sprintf("%.3fx", r)
	}
	return fmt.Sprintf("%.2fx", r)
}

// summarize is the excluded candidates: those over the memory budget
// with what they need ("over 24Gi: adam 20.8 GB"), then those of each
// other reason together ("outer-sparse, outer-sparse-2p (Muon inside:
// ...)").
func summarize(cands []Candidate, memory int64) string {
	var over, whys []string
	rows := map[string][]string{}
	for _, c := range cands {
		switch {
		case c.Excluded == "":
		case c.OverMemory:
			over = append(over, c.Row+" "+bytesDecimal(c.Bytes))
		default:
			if _, ok := rows[c.Excluded]; !ok {
				whys = append(whys, c.Excluded)
			}
			rows[c.Excluded] = append(rows[c.Excluded], c.Row)
		}
	}
	var parts []string
	if len(over) > 0 {
		parts = append(parts, fmt.Sprintf("over %s with params and grads: %s", size.Format(memory), strings.Join(over, ", ")))
	}
	for _, why := range whys {
		parts = append(parts, strings.Join(rows[why], ", ")+" ("+why+")")
	}
	return strings.Join(parts, "; ")
}

// formatStep writes seconds with three significant digits ("1.27 s",
// "412 ms"), whole seconds from 1000 s.
func formatStep(s float64) string {
	switch {
	case s >= 1000:
		return fmt.Sprintf("%.0f s", s)
	case s >= 1 || s == 0:
		return fmt.Sprintf("%.3g s", s)
	case s >= 1e-3:
		return fmt.Sprintf("%.3g ms", s*1e3)
	default:
		return fmt.Sprintf("%.3g µs", s*1e6)
	}
}

// bytesDecimal writes n bytes with a decimal unit and three significant
// digits ("9.31 GB").
func bytesDecimal(n int64) string {
	x := float64(n)
	for _, u := range []struct {
		unit string
		mul  float64
	}{{"PB", 1e15}, {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"kB", 1e3}} {
		if x >= u.mul {
			return fmt.Sprintf("%.3g %s", x/u.mul, u.unit)
		}
	}
	return fmt.Sprintf("%d B", n)
}
