package costmodel

import (
	"slices"
	"strings"
)

// The outer optimizer (package outer, docs/outer.md): every rank takes H
// inner steps without communicating, then the ranks average their
// pseudo-gradients with a codec. With F fragments the parameters are cut
// into F contiguous near-equal fragments, each exchanged once every H
// steps at staggered calls; with a delay τ > 0 an exchange runs in the
// background while τ further inner steps compute. Each exchange is an
// agreement (an all-gather of one float32 status word per rank), then the
// codec's collective on the fragment.

// MaxOuterH is the largest Job.OuterH that Plan accepts.
const MaxOuterH = 1 << 30

// outerInt8GroupSize is outer.Int8GroupSize (elements per float32 scale
// of the int8 codec), copied so that the cost model does not import the
// optimizers; TestOuterCopiesMatch checks the copy.
const outerInt8GroupSize = 256

// outerInt8MsgLen is the bytes of one quantized chunk of c elements in the
// int8 codec (outer/int8.go, int8MsgLen): a float32 scale per group of
// outerInt8GroupSize elements, then one int8 code per element.
func outerInt8MsgLen(c int64) int64 {
	if c <= 0 {
		return 0
	}
	return 4*((c+outerInt8GroupSize-1)/outerInt8GroupSize) + c
}

// outerInt8Bytes is what each of w ranks sends in the int8 codec's
// two-phase allreduce of n elements: with C = ceil(n/W) (the last chunks
// zero padded), W-1 messages of a chunk in the all-to-all and W-1 in the
// all-gather.
func outerInt8Bytes(n int64, w int) int64 {
	if w <= 1 || n <= 0 {
		return 0
	}
	return 2 * int64(w-1) * outerInt8MsgLen((n+int64(w)-1)/int64(w))
}

// int8Collective is the int8 codec's allreduce (not a collective that
// Job.Collectives names on its own): an all-to-all of the quantized
// chunks, then an all-gather of the quantized means, each W-1
// latency-bound rounds, as the 1-bit allreduce's collectives are counted.
// Its quantization, the owner's float32 sums and the dequantization are
// not modelled.
var int8Collective = collective{
	name:      "int8",
	desc:      "two-phase int8 allreduce with a float32 scale per 256 elements (the outer optimizer's int8 codec)",
	wireBytes: outerInt8Bytes,
	steps: func(n int64, w int, _ float64) []step {
		if w <= 1 || n <= 0 {
			return nil
		}
		b := int64(w-1) * outerInt8MsgLen((n+int64(w)-1)/int64(w))
		return []step{{rounds: float64(w - 1), bytes: b}, {rounds: float64(w - 1), bytes: b}}
	},
	fitAs:        "allreduce",
	uncalibrated: "not measured",
}

// agreementCollective is the agreement before each outer exchange: an
// all-gather of one float32 status word per rank, W-1 latency-bound
// rounds (like the 1-bit allreduce's header all-gather), 4(W-1) bytes
// sent per rank whatever n is.
var agreementCollective = collective{
	name: "agreement",
	desc: "all-gather of one float32 status word per rank",
	wireBytes: func(_ int64, w int) int64 {
		if w <= 1 {
			return 0
		}
		return 4 * int64(w-1)
	},
	steps: func(_ int64, w int, _ float64) []step {
		if w <= 1 {
			return nil
		}
		return []step{{rounds: float64(w - 1), bytes: 4 * int64(w-1)}}
	},
}

// outerCodec is one row of the outer optimizer: the codec's name in
// package outer, the collective whose model predicts its exchange, and
// whether the exchange goes in buckets of Job.BucketBytes (the 1-bit
// codec; the others are one call per fragment).
type outerCodec struct {
	name, codec, desc string
	via               func(j Job) collective
	bucketed          bool
	uncalibrated      string
	// state is the codec's name for OuterStateBytes: codec, or
	// "sparse-2p" for the sparse codec's two-phase exchange.
	state string
	// muon: the inner optimizer is Muon (MuLoCo) rather than AdamW: every
	// rank orthogonalizes every matrix of Plan's MuonPlan each inner step.
	muon bool
	// optIn: the row is in a plan only where Job.Collectives names it,
	// not among the default rows and the state table's.
	optIn bool
}

// stateName is oc's name for OuterStateBytes.
func (oc outerCodec) stateName() string {
	if oc.state != "" {
		return oc.state
	}
	return oc.codec
}

// OptOuterMuon is the row of the outer optimizer with Muon inside
// (MuLoCo) and the 1-bit codec, in the time and the state tables.
const OptOuterMuon = "outer-muon"

// outerCodecs are the outer optimizer's rows, in table order.
var outerCodecs = []outerCodec{
	{
		name: "outer-fp32", codec: "fp32",
		desc: "outer optimizer, fp32 codec: exact float32 ring allreduce (comm.Mean) of the pseudo-gradients",
		via:  func(Job) collective { c, _ := findCollective("allreduce"); return c },
	},
	{
		name: "outer-bf16", codec: "bf16",
		desc: "outer optimizer, bf16 codec: bfloat16 on the wire, float32 sums (quant.DownCast)",
		via:  func(Job) collective { c, _ := findCollective("fp16"); return c },
		uncalibrated: "not measured: the fp16 model (the exact allreduce's at half the bytes); quant.DownCast's " +
			"8-byte header per peer, chunk padding and bfloat16 conversion left out",
	},
	{
		name: "outer-int8", codec: "int8",
		desc: "outer optimizer, int8 codec: all-to-all of int8 codes with a float32 scale per 256 elements, owner sums in float32, all-gather",
		via:  func(Job) collective { return int8Collective },
		uncalibrated: "not measured: all-to-all and all-gather of its exact bytes at the fitted alpha and beta, " +
			"W-1 rounds each; quantization and the owner's float32 sums left out",
	},
	{
		name: "outer-1bit", codec: "1bit",
		desc:     "outer optimizer, 1bit codec: onebit.AllReduce of the outer momentum, in buckets of --bucket",
		via:      func(Job) collective { c, _ := findCollective("onebit"); return c },
		bucketed: true,
	},
	{
		name: OptOuterMuon, codec: "1bit", muon: true,
		desc: "outer optimizer, Muon inside (MuLoCo: outer.NewFrom with a Muon builder, lbgomlx.NewOuterMuon), 1bit codec: " +
			"outer-1bit's exchange, and every inner step orthogonalizes every matrix (--muon-shape, --muon-flops)",
		via:      func(Job) collective { c, _ := findCollective("onebit"); return c },
		bucketed: true,
	},
	{
		name: "outer-sparse", codec: "sparse",
		desc: "outer optimizer, sparse codec: all-gather of the top --outer-density of each chunk of --outer-sparse-chunk of an error accumulator, " +
			"an offset within the chunk and --outer-sparse-bits value bits each, float32 scales per chunk",
		via: func(j Job) collective { return sparseOf(j).collective() },
		uncalibrated: "not measured: an all-gather of its exact bytes at the fitted alpha and beta, W-1 rounds; " +
			"the top-k selection, encoding and decoding left out",
	},
	{
		name: "outer-sparse-2p", codec: "sparse", state: "sparse-2p",
		desc: "outer optimizer, sparse codec, two-phase exchange (outer.SparseTwoPhase): all-to-all of the messages to the owners of runs of chunks, " +
			"which re-encode their average with a server accumulator, then all-gather: about 2(W-1)/W messages per rank",
		via: func(j Job) collective { return sparseOf(j).twoPhaseCollective() },
		uncalibrated: "not measured: an all-to-all and an all-gather of its exact bytes at the fitted alpha and beta, W-1 rounds each; " +
			"the top-k selections, encodings and decodings left out",
	},
	{
		name: "outer-sparse-shared", codec: "sparse", state: "sparse-2p",
		desc: "outer optimizer, sparse codec, shared-index exchange (outer.SparseShared): all-gather of the owners' offsets, all-to-all of the values at them " +
			"to the owners, all-gather of their int8 averages: about (W-1)/W of density*(offset bits + value bits + 8) bits per element per rank",
		via:   func(j Job) collective { return sparseOf(j).sharedCollective(false) },
		optIn: true,
		uncalibrated: "not measured: two all-gathers and an all-to-all of its exact bytes at the fitted alpha and beta, W-1 rounds each; " +
			"the top-k selection, encodings and sums left out",
	},
	{
		name: "outer-sparse-voted", codec: "sparse", state: "sparse-2p",
		desc: "outer optimizer, sparse codec, voted shared-index exchange (outer.SparseVoted): all-to-all of every rank's top-k offsets to the owners, " +
			"which pick the most named, then as outer-sparse-shared: about (W-1)/W of density*(2 offset bits + value bits + 8) bits per element per rank",
		via:   func(j Job) collective { return sparseOf(j).sharedCollective(true) },
		optIn: true,
		uncalibrated: "not measured: two all-to-alls and two all-gathers of its exact bytes at the fitted alpha and beta, W-1 rounds each; " +
			"the top-k selections, tallies, encodings and sums left out",
	},
}

func findOuterCodec(name string) (outerCodec, bool) {
	for _, c := range outerCodecs {
		if c.name == name {
			return c, true
		}
	}
	return outerCodec{}, false
}

// OuterPlan is the outer optimizer's settings in a Plan, and what they
// make of its exchanges.
type OuterPlan struct {
	// H, Fragments and Delay are Job.OuterH, OuterFragments (1 for 0)
	// and OuterDelay.
	H         int `json:"h"`
	Fragments int `json:"fragments"`
	Delay     int `json:"delay"`
	// FragmentParams is the float32 elements of the largest fragment,
	// ceil(Params/Fragments), what one exchange carries.
	FragmentParams int64 `json:"fragment_params"`
	// ExchangeEvery is H/Fragments: steps per exchange, on average.
	ExchangeEvery float64 `json:"exchange_every_steps"`
	// HideS is Delay times Job.StepCompute: the compute an exchange in
	// flight runs beside.
	HideS float64 `json:"hide_s"`
	// Sparse is the sparse codec's settings, with the outer-sparse row.
	Sparse *SparsePlan `json:"sparse,omitempty"`
}

// outerRow predicts the row of codec oc for job j (validated, OuterH > 0):
// the exchanges of the F fragments (F-r of floor(n/F) elements, r = n mod
// F of one more), each with its agreement, once every H steps, averaged
// over the H steps. With a delay τ, each exchange (the agreement excepted:
// it runs in the launching step) runs beside τ steps of compute: only what
// exceeds τ*StepCompute is exposed, and the exchange's latency, transfer
// and compression terms are scaled by the share left exposed.
func (m *Model) outerRow(oc outerCodec, j Job, s setup, f LinkFit, exactStep float64) Row {
	c := oc.via(j)
	predictN := func(n int64) prediction {
		if !oc.bucketed {
			return m.predict(c, n, s, f)
		}
		var p prediction
		per := j.BucketBytes / 4
		for _, part := range []struct{ n, times int64 }{{per, n / per}, {n % per, 1}} {
			if part.n == 0 || part.times == 0 {
				continue
			}
			p.add(m.predict(c, part.n, s, f), part.times)
		}
		return p
	}
	agree := m.predict(agreementCollective, 1, s, f)
	frags := int64(max(1, j.OuterFragments))
	h := float64(j.OuterH)
	hide := float64(j.OuterDelay) * j.StepCompute.Seconds()
	q, r := j.Params/frags, j.Params%frags
	row := Row{Collective: oc.name, Calibrated: oc.uncalibrated == ""}
	var wire int64 // bytes per H steps
	for _, cls := range []struct{ n, count int64 }{{q, frags - r}, {q + 1, r}} {
		if cls.count == 0 {
			continue
		}
		x := predictN(cls.n)
		t := x.total()
		hidden := min(t, hide)
		share := 1.0
		if t > 0 {
			share = (t - hidden) / t
		}
		per := float64(cls.count) / h
		row.LatencyS += per * (agree.Latency + share*x.Latency)
		row.TransferS += per * (agree.Transfer + share*x.Transfer)
		row.CompressS += per * (agree.Compute + share*x.Compute)
		row.HiddenS += per * hidden
		wire += cls.count * (agree.Wire + x.Wire)
		// The largest fragment's exchange: the last class present.
		row.Calls = agree.Calls + x.Calls
		row.ExchangeS = agree.total() + t
	}
	row.WirePerRank = (wire + int64(j.OuterH)/2) / int64(j.OuterH)
	row.CommS = row.LatencyS + row.TransferS + row.CompressS
	if oc.muon {
		row.OrthoS = muonPlan(j).OrthoS
	}
	row.StepS = row.CommS + row.OrthoS + j.StepCompute.Seconds()
	if row.StepS > 0 {
		row.SpeedupExact = exactStep / row.StepS
	}
	return row
}

// outerPlan is the OuterPlan of j (nil without OuterH), with the sparse
// codec's settings where sparse (the plan has its row).
func outerPlan(j Job, sparse bool) *OuterPlan {
	if j.OuterH <= 0 {
		return nil
	}
	frags := max(1, j.OuterFragments)
	o := &OuterPlan{H: j.OuterH, Fragments: frags, Delay: j.OuterDelay,
		FragmentParams: (j.Params + int64(frags) - 1) / int64(frags),
		ExchangeEvery:  float64(j.OuterH) / float64(frags), HideS: float64(j.OuterDelay) * j.StepCompute.Seconds()}
	if sparse {
		o.Sparse = sparseOf(j).plan(o.FragmentParams)
	}
	return o
}

// defaultOuterRows are the outer rows of a plan of j whose Collectives is
// nil: none without OuterH; every codec's, the sparse codec's only where
// its chunk fits the smallest fragment, and OptOuterMuon only with
// MuonShape, as Muon's rows (its orthogonalization needs the shape and
// --muon-flops to mean anything).
func (j Job) defaultOuterRows() []string {
	var names []string
	for _, name := range j.outerStateRows() {
		if name != OptOuterMuon || j.MuonShape != [2]int64{} {
			names = append(names, name)
		}
	}
	return names
}

// outerStateRows are the outer rows of j's state table: none without
// OuterH; every codec's but the opt-in rows (outer-sparse-shared), the
// sparse codec's only where its chunk fits the smallest fragment, and
// OptOuterMuon.
func (j Job) outerStateRows() []string {
	if j.OuterH <= 0 {
		return nil
	}
	var names []string
	for _, name := range outerNames() {
		if oc, _ := findOuterCodec(name); oc.optIn {
			continue
		}
		if !isSparseRow(name) || j.sparseFits() {
			names = append(names, name)
		}
	}
	return names
}

// validateOuter reports the first outer field of j that Plan cannot use.
func (j Job) validateOuter(fail func(field, format string, args ...any) error) error {
	frags := max(1, j.OuterFragments)
	switch {
	case j.OuterH < 0 || j.OuterH > MaxOuterH:
		return fail("OuterH", "must be in [0, %d] inner steps per outer step (0: no outer optimizer), got %d", MaxOuterH, j.OuterH)
	case j.OuterFragments < 0:
		return fail("OuterFragments", "must not be negative, got %d", j.OuterFragments)
	case j.OuterH == 0 && j.OuterFragments > 1:
		return fail("OuterFragments", "goes with OuterH (the outer optimizer), which is 0")
	case j.OuterFragments > j.OuterH && j.OuterH > 0:
		return fail("OuterFragments", "must be in [1, OuterH = %d], got %d", j.OuterH, j.OuterFragments)
	case int64(j.OuterFragments) > j.Params:
		return fail("OuterFragments", "must not exceed the %d parameters (one element a fragment at least), got %d", j.Params, j.OuterFragments)
	case j.OuterDelay < 0:
		return fail("OuterDelay", "must not be negative, got %d", j.OuterDelay)
	case j.OuterH == 0 && j.OuterDelay > 0:
		return fail("OuterDelay", "goes with OuterH (the outer optimizer), which is 0")
	case j.OuterDelay > j.OuterH/frags:
		return fail("OuterDelay", "must be in [0, OuterH/OuterFragments = %d] (one exchange in flight at a time), got %d", j.OuterH/frags, j.OuterDelay)
	}
	if j.OuterH == 0 {
		var outer []string
		for _, name := range j.Collectives {
			if _, ok := findOuterCodec(name); ok {
				outer = append(outer, name)
			}
		}
		if len(outer) > 0 {
			return fail("OuterH", "must be at least 1 for the outer optimizer's rows (%s)", strings.Join(outer, ", "))
		}
	}
	return j.validateSparse(slices.ContainsFunc(j.Collectives, isSparseRow), fail)
}

// isSparseRow says whether name is one of the sparse codec's rows.
func isSparseRow(name string) bool {
	return name == "outer-sparse" || name == "outer-sparse-2p" || name == "outer-sparse-shared" || name == "outer-sparse-voted"
}

// outerNames are the names of the outer optimizer's rows.
func outerNames() []string {
	names := make([]string, len(outerCodecs))
	for i, c := range outerCodecs {
		names[i] = c.name
	}
	return names
}
