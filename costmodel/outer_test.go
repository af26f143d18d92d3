package costmodel

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
)

// outerJob is a job with the outer optimizer on a slow per-rank link.
func outerJob(h, frags, delay int) Job {
	return Job{Params: 1 << 20, Ranks: 4, Link: 10e6 / 8, LinkName: "10mbit", BucketBytes: 1 << 20,
		StepCompute: 100 * time.Millisecond, OuterH: h, OuterFragments: frags, OuterDelay: delay}
}

// planRows plans j on the built-in calibration and returns its rows by
// name.
func planRows(t *testing.T, j Job) (*Plan, map[string]Row) {
	t.Helper()
	cal, err := Builtin()
	require.NoError(t, err)
	p, err := cal.Model.Plan(j)
	require.NoError(t, err)
	rows := map[string]Row{}
	for _, r := range p.Rows {
		rows[r.Collective] = r
	}
	return p, rows
}

// planAgreement is the fit a plan of j uses (its Assumptions' alpha and
// ineff) and the agreement's prediction with it.
func planAgreement(t *testing.T, j Job) (prediction, LinkFit) {
	t.Helper()
	cal, err := Builtin()
	require.NoError(t, err)
	p, err := cal.Model.Plan(j)
	require.NoError(t, err)
	f, _ := cal.Model.fitFor(j.LinkName, j.Link)
	f.Alpha, f.Ineff = p.Assumptions.Alpha, p.Assumptions.Ineff
	return cal.Model.predict(agreementCollective, 1, setup{Ranks: j.Ranks, Rate: j.Link, Sharing: PerRank}, f), f
}

// The rows of the outer optimizer are added to the default ones when
// OuterH is set, can be asked for by name, and are absent otherwise.
func TestOuterRowsListed(t *testing.T) {
	j := outerJob(0, 0, 0)
	p, _ := planRows(t, j)
	require.Len(t, p.Rows, 2)
	assert.Nil(t, p.Outer)

	j.OuterH = 10
	p, _ = planRows(t, j)
	var names []string
	for _, r := range p.Rows {
		names = append(names, r.Collective)
	}
	assert.Equal(t, []string{"allreduce", "onebit", "outer-fp32", "outer-bf16", "outer-int8", "outer-1bit", "outer-sparse", "outer-sparse-2p"}, names)
	require.NotNil(t, p.Outer)
	// The sparse codec's defaults: 85 of 4096 entries, 13 bits each, and
	// a float32 scale per chunk: (4 + ceil(85*13/8)) bytes per 4096.
	sparse := &SparsePlan{Density: float64(float32(1.0 / 48)), Chunk: 4096, Bits: 1, Entries: 85, OffsetBits: 12,
		BitsPerElement: 8 * float64(4+139) / 4096}
	assert.Equal(t, OuterPlan{H: 10, Fragments: 1, FragmentParams: 1 << 20, ExchangeEvery: 10, Sparse: sparse}, *p.Outer)
	cal := map[string]bool{}
	for _, r := range p.Rows {
		cal[r.Collective] = r.Calibrated
	}
	assert.Equal(t, map[string]bool{"allreduce": true, "onebit": true, "outer-fp32": true, "outer-bf16": false,
		"outer-int8": false, "outer-1bit": true, "outer-sparse": false, "outer-sparse-2p": false}, cal)

	// A fragment shorter than the sparse codec's chunk, which package
	// outer refuses: the default rows leave the sparse codec's out, and
	// asking for it names the field.
	j.OuterH, j.OuterFragments = 1<<9, 1<<9 // of 2048 elements
	p, _ = planRows(t, j)
	require.Len(t, p.Rows, 6)
	assert.Nil(t, p.Outer.Sparse)
	j.OuterSparseChunk = 2048
	p, _ = planRows(t, j)
	require.Len(t, p.Rows, 8)
	assert.Equal(t, 2048, p.Outer.Sparse.Chunk)
	j.OuterSparseChunk, j.Collectives = 0, []string{"outer-sparse"}
	var je *JobError
	require.ErrorAs(t, j.Validate(), &je)
	assert.Equal(t, "OuterSparseChunk", je.Field)
	assert.Contains(t, je.Reason, "must not exceed the smallest fragment, 2048 elements")
	j.OuterH, j.OuterFragments = 10, 0

	j.Collectives = []string{"outer-int8", "allreduce"}
	p, _ = planRows(t, j)
	require.Len(t, p.Rows, 2)
	assert.Equal(t, "outer-int8", p.Rows[0].Collective)

	var outer []string
	for _, c := range Collectives() {
		if c.Outer {
			outer = append(outer, c.Name)
			assert.NotEmpty(t, c.Desc)
		}
	}
	assert.Equal(t, outerNames(), outer)
}

// With H = 1, one fragment and no delay, an outer row is one exchange per
// step: its codec's collective on the whole model (in buckets for the
// 1-bit codec, one call otherwise) and the agreement.
func TestOuterOneExchangePerStep(t *testing.T) {
	for _, w := range []int{2, 3, 4, 8} {
		j := outerJob(1, 1, 0)
		j.Ranks = w
		j.Params = 1<<20 + 7
		j.Collectives = []string{"allreduce", "onebit", "fp16", "outer-fp32", "outer-bf16", "outer-int8", "outer-1bit"}
		_, rows := planRows(t, j)
		// Buckets of the whole model: the exact rows are one call, as the
		// outer exchange of fp32 and bf16 is.
		whole := j
		whole.BucketBytes = 4 * (j.Params + 1)
		_, one := planRows(t, whole)

		agree, f := planAgreement(t, j)
		assert.Equal(t, int64(4*(w-1)), agree.Wire)
		assert.Equal(t, 1, agree.Calls)
		assert.InDelta(t, float64(w-1)*f.Alpha, agree.Latency, 1e-15)

		for outer, base := range map[string]Row{"outer-fp32": one["allreduce"], "outer-bf16": one["fp16"], "outer-1bit": rows["onebit"]} {
			r := rows[outer]
			assert.Equal(t, base.WirePerRank+agree.Wire, r.WirePerRank, outer)
			assert.Equal(t, base.Calls+1, r.Calls, outer)
			assert.InEpsilon(t, base.LatencyS+agree.Latency, r.LatencyS, 1e-12, outer)
			assert.InEpsilon(t, base.TransferS+agree.Transfer, r.TransferS, 1e-12, outer)
			assert.InDelta(t, base.CompressS, r.CompressS, 1e-15, outer)
			assert.InEpsilon(t, base.CommS+agree.total(), r.CommS, 1e-12, outer)
			assert.InEpsilon(t, r.CommS, r.ExchangeS, 1e-12, outer)
			assert.InEpsilon(t, r.CommS+j.StepCompute.Seconds(), r.StepS, 1e-12, outer)
			assert.InEpsilon(t, rows["allreduce"].StepS/r.StepS, r.SpeedupExact, 1e-12, outer)
			assert.Zero(t, r.HiddenS, outer)
		}
		// int8: all-to-all and all-gather of C = ceil(n/W) codes and
		// ceil(C/256) scales per peer, W-1 rounds each.
		r := rows["outer-int8"]
		c := (j.Params + int64(w) - 1) / int64(w)
		msg := c + 4*((c+255)/256)
		assert.Equal(t, 2*int64(w-1)*msg+agree.Wire, r.WirePerRank)
		assert.Equal(t, 3, r.Calls)
		assert.InEpsilon(t, 3*float64(w-1)*f.Alpha, r.LatencyS, 1e-12)
		assert.InEpsilon(t, float64(r.WirePerRank)*f.Ineff/j.Link, r.TransferS, 1e-12)
		assert.Zero(t, r.CompressS)
		// About 2(W-1)/W * (1 + 4/256) bytes per element.
		assert.InEpsilon(t, 2*float64(w-1)/float64(w)*(1+4.0/256)*float64(j.Params), float64(r.WirePerRank), 1e-3)
	}
}

// The sparse codec's rows with H = 1: the all-gather sends W-1 messages
// per rank, one call of W-1 rounds; the two-phase exchange 2(W-1)
// segments of ceil(chunks/W) chunks, two calls of W-1 rounds each: as
// much at W = 2, less from 3 on, at most 2 messages and 2(W-1) chunks'.
func TestOuterSparseTwoPhaseRow(t *testing.T) {
	for _, w := range []int{2, 3, 4, 8, 16} {
		j := outerJob(1, 1, 0)
		j.Ranks = w
		j.Collectives = []string{"outer-sparse", "outer-sparse-2p"}
		_, rows := planRows(t, j)
		agree, f := planAgreement(t, j)
		const msg = 256 * (4 + 139) // 2^20 elements: 256 chunks of 143 bytes
		per := int64((256 + w - 1) / w)
		ag, tp := rows["outer-sparse"], rows["outer-sparse-2p"]
		assert.Equal(t, int64(w-1)*msg+agree.Wire, ag.WirePerRank, "W %d", w)
		assert.Equal(t, 2*int64(w-1)*per*143+agree.Wire, tp.WirePerRank, "W %d", w)
		assert.Equal(t, 2, ag.Calls)
		assert.Equal(t, 3, tp.Calls)
		assert.InEpsilon(t, 3*float64(w-1)*f.Alpha, tp.LatencyS, 1e-12, "W %d", w)
		assert.InEpsilon(t, float64(tp.WirePerRank)*f.Ineff/j.Link, tp.TransferS, 1e-12, "W %d", w)
		assert.LessOrEqual(t, tp.WirePerRank-agree.Wire, int64(2*msg+2*(w-1)*143), "W %d", w)
		if w > 2 {
			assert.Less(t, tp.WirePerRank, ag.WirePerRank, "W %d", w)
		} else {
			assert.Equal(t, tp.WirePerRank, ag.WirePerRank)
		}
	}
}

// Doubling H halves the exchange's share of the step; fragments keep the
// average bytes and transfer (each fragment exchanged once every H
// steps), and add one exchange's latency and agreement per fragment.
func TestOuterAmortization(t *testing.T) {
	all := func(j Job) Job { j.Collectives = outerNames(); return j }
	_, h1 := planRows(t, all(outerJob(8, 1, 0)))
	_, h2 := planRows(t, all(outerJob(16, 1, 0)))
	_, f4 := planRows(t, all(outerJob(16, 4, 0)))
	for _, name := range outerNames() {
		a, b, c := h1[name], h2[name], f4[name]
		assert.InEpsilon(t, a.CommS/2, b.CommS, 1e-12, name)
		assert.InEpsilon(t, a.LatencyS/2, b.LatencyS, 1e-12, name)
		assert.InEpsilon(t, a.TransferS/2, b.TransferS, 1e-12, name)
		assert.InDelta(t, float64(a.WirePerRank)/2, float64(b.WirePerRank), 0.5, name)
		assert.Equal(t, a.Calls, b.Calls, name)
		assert.InEpsilon(t, a.ExchangeS, b.ExchangeS, 1e-12, name)
		assert.InEpsilon(t, a.StepS-a.CommS, b.StepS-b.CommS, 1e-9, name)

		// 4 fragments of 2^18 elements, every 16 steps each.
		assert.InEpsilon(t, float64(b.WirePerRank), float64(c.WirePerRank), 1e-3, name)
		assert.InEpsilon(t, b.TransferS, c.TransferS, 1e-3, name)
		assert.Greater(t, c.LatencyS, b.LatencyS, name)
		assert.Less(t, c.ExchangeS, b.ExchangeS/3, name)
		assert.Greater(t, c.ExchangeS, b.ExchangeS/5, name)
	}
	// fp32 moves exactly the same bytes but for 3 more agreements per 16
	// steps; its latency is 4 exchanges' instead of one.
	agree := int64(4 * 3)
	assert.InDelta(t, float64(h2["outer-fp32"].WirePerRank+3*agree/16), float64(f4["outer-fp32"].WirePerRank), 1)
	assert.InEpsilon(t, 4*h2["outer-fp32"].LatencyS, f4["outer-fp32"].LatencyS, 1e-12)
}

// Fragments of unequal sizes: the row is the sum over the fragments that
// outer cuts ([floor(f n/F), floor((f+1) n/F))), each once per H steps.
func TestOuterUnevenFragments(t *testing.T) {
	const n, frags, h, w = 1001, 3, 6, 3
	j := outerJob(h, frags, 0)
	j.Params, j.Ranks = n, w
	j.Collectives = []string{"outer-fp32", "outer-int8"}
	p, rows := planRows(t, j)
	assert.Equal(t, int64(334), p.Outer.FragmentParams)
	assert.Equal(t, 2.0, p.Outer.ExchangeEvery)
	var fp32, int8 int64
	for f := range int64(frags) {
		m := (f+1)*n/frags - f*n/frags
		fp32 += comm.RingAllReduceBytes(4*m, w) + 4*(w-1)
		int8 += outerInt8Bytes(m, w) + 4*(w-1)
	}
	assert.Equal(t, (fp32+h/2)/h, rows["outer-fp32"].WirePerRank)
	assert.Equal(t, (int8+h/2)/h, rows["outer-int8"].WirePerRank)
}

// A delayed exchange runs beside Delay steps of compute: what it takes
// beyond Delay*StepCompute is exposed, the rest is hidden (HiddenS), the
// agreement always exposed.
func TestOuterDelayHides(t *testing.T) {
	base := outerJob(8, 2, 0)
	base.Collectives = outerNames()
	_, r0 := planRows(t, base)
	for _, name := range outerNames() {
		x := r0[name].ExchangeS
		a, _ := planAgreement(t, base)
		agree := a.total()
		ex := x - agree // the exchange alone (both fragments are the same size)
		for _, c := range []struct {
			delay   int
			compute time.Duration
		}{{1, 0}, {1, time.Millisecond}, {2, time.Millisecond}, {4, time.Millisecond}, {3, time.Duration(ex / 3 * 1e9)}, {4, time.Hour}} {
			j := base
			j.OuterDelay, j.StepCompute = c.delay, c.compute
			_, r := planRows(t, j)
			got := r[name]
			hidden := min(ex, float64(c.delay)*c.compute.Seconds())
			what := name + " delay " + c.compute.String()
			// 2 exchanges every 8 steps.
			assert.InDelta(t, 2*hidden/8, got.HiddenS, 1e-12, what)
			assert.InDelta(t, r0[name].CommS-2*hidden/8, got.CommS, 1e-12, what)
			assert.InEpsilon(t, got.LatencyS+got.TransferS+got.CompressS, got.CommS, 1e-12, what)
			assert.InEpsilon(t, got.CommS+got.OrthoS+c.compute.Seconds(), got.StepS, 1e-12, what)
			assert.Equal(t, r0[name].WirePerRank, got.WirePerRank, what)
			assert.InEpsilon(t, x, got.ExchangeS, 1e-12, what)
			if c.compute == time.Hour {
				// All hidden but the agreements.
				assert.InEpsilon(t, 2*agree/8, got.CommS, 1e-9, what)
			}
		}
	}
}

// An outer setting that Plan cannot use names its field.
func TestOuterJobValidate(t *testing.T) {
	cal, err := Builtin()
	require.NoError(t, err)
	good := outerJob(12, 3, 4)
	_, err = cal.Model.Plan(good)
	require.NoError(t, err)
	for _, c := range []struct {
		field string
		mut   func(*Job)
	}{
		{"OuterH", func(j *Job) { j.OuterH = -1 }},
		{"OuterH", func(j *Job) { j.OuterH = MaxOuterH + 1 }},
		{"OuterH", func(j *Job) { *j = outerJob(0, 0, 0); j.Collectives = []string{"allreduce", "outer-1bit"} }},
		{"OuterFragments", func(j *Job) { j.OuterFragments = -1 }},
		{"OuterFragments", func(j *Job) { j.OuterFragments = 13 }},
		{"OuterFragments", func(j *Job) { *j = outerJob(0, 2, 0) }},
		{"OuterFragments", func(j *Job) { j.Params = 2 }},
		{"OuterDelay", func(j *Job) { j.OuterDelay = -1 }},
		{"OuterDelay", func(j *Job) { j.OuterDelay = 5 }},
		{"OuterDelay", func(j *Job) { *j = outerJob(0, 0, 1) }},
		{"OuterDelay", func(j *Job) { j.OuterFragments, j.OuterDelay = 0, 13 }},
		{"Collectives", func(j *Job) { j.Collectives = []string{"outer-fp16"} }},
		{"OuterDensity", func(j *Job) { j.OuterDensity = -0.1 }},
		{"OuterDensity", func(j *Job) { j.OuterDensity = 1.5 }},
		{"OuterDensity", func(j *Job) { j.OuterDensity = math.NaN() }},
		{"OuterSparseChunk", func(j *Job) { j.OuterSparseChunk = -1 }},
		{"OuterSparseChunk", func(j *Job) { j.OuterSparseChunk = MaxSparseChunk + 1 }},
		{"OuterSparseChunk", func(j *Job) { j.OuterDensity, j.OuterSparseChunk = 0.01, 99 }},
		{"OuterSparseChunk", func(j *Job) { j.OuterSparseChunk = 20 }}, // the default density: 1/48
		{"OuterSparseBits", func(j *Job) { j.OuterSparseBits = 3 }},
		{"OuterSparseBits", func(j *Job) { j.OuterSparseBits = -1 }},
	} {
		j := good
		c.mut(&j)
		_, err := cal.Model.Plan(j)
		var je *JobError
		if assert.ErrorAs(t, err, &je, c.field) {
			assert.Equal(t, c.field, je.Field, err.Error())
		}
	}
	for _, j := range []Job{outerJob(0, 1, 0), outerJob(1, 0, 0), outerJob(1, 1, 1), outerJob(12, 0, 12), outerJob(MaxOuterH, 1<<20, 1<<10)} {
		_, err := cal.Model.Plan(j)
		assert.NoError(t, err, "%+v", j)
	}
	for _, j := range []Job{{OuterDensity: 1, OuterSparseChunk: 1, OuterSparseBits: 2}, {OuterDensity: 0.01, OuterSparseChunk: 101}} {
		base := outerJob(12, 3, 4)
		base.OuterDensity, base.OuterSparseChunk, base.OuterSparseBits = j.OuterDensity, j.OuterSparseChunk, j.OuterSparseBits
		_, err := cal.Model.Plan(base)
		assert.NoError(t, err, "%+v", j)
	}
	j := outerJob(0, 0, 0)
	j.Collectives = []string{"nope"}
	_, err = cal.Model.Plan(j)
	assert.ErrorContains(t, err, "outer-fp32, outer-bf16, outer-int8, outer-1bit, outer-muon, outer-sparse", "the names Collectives takes")
}

// The outer-muon row (MuLoCo) is outer-1bit's exchange plus Muon's
// orthogonalization of every matrix in every inner step, and brings the
// Plan's MuonPlan with it.
func TestOuterMuonRow(t *testing.T) {
	j := outerJob(10, 1, 0)
	_, rows := planRows(t, j)
	assert.NotContains(t, rows, OptOuterMuon, "without --muon-shape, as Muon's rows")
	j.MuonShape = [2]int64{512, 1024}
	p, rows := planRows(t, j)
	require.NotNil(t, p.Muon, "outer-muon plans Muon's orthogonalization")
	one, mu := rows["outer-1bit"], rows[OptOuterMuon]
	assert.Greater(t, mu.OrthoS, 0.0)
	assert.Equal(t, p.Muon.OrthoS, mu.OrthoS)
	assert.Equal(t, one.CommS, mu.CommS)
	assert.Equal(t, one.WirePerRank, mu.WirePerRank)
	assert.InEpsilon(t, one.StepS+mu.OrthoS, mu.StepS, 1e-12)
	assert.Zero(t, one.OrthoS)
}
