package costmodel

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/lowbit-ml/lowbit/size"
)

// Job describes a data-parallel training job whose gradient exchange Plan
// predicts.
type Job struct {
	// Params is the number of float32 gradient elements (model
	// parameters) each rank exchanges per step, at least 1.
	Params int64
	// Ranks is the data-parallel world size W, at least 2.
	Ranks int
	// Link is the link rate in bytes per second (ParseRate), and
	// LinkName its tc name ("10gbit"): a calibrated link of that name is
	// used as fitted; otherwise the calibrated link nearest in rate is
	// carried over, with ineff at least 1.
	Link     float64
	LinkName string
	// Sharing is how the ranks share the link ("": PerRank).
	Sharing Sharing
	// BucketBytes is the size of the fused buckets the gradient is
	// exchanged in (calls one after another), a positive multiple of 4.
	BucketBytes int64
	// Collectives lists the collectives to predict by name (Collectives);
	// nil: allreduce and onebit, and with OuterH > 0 also the outer
	// optimizer's rows outer-fp32, outer-bf16, outer-int8, outer-1bit and
	// outer-sparse (see OuterSparseChunk). An outer row needs OuterH > 0.
	Collectives []string
	// StepCompute is the forward and backward time of one step, added to
	// each step (no overlap with communication, but for the outer
	// optimizer's delayed exchanges: OuterDelay).
	StepCompute time.Duration
	// CompressBps, Alpha and Ineff, when positive, replace the
	// calibration's compression rate (float32 bytes per second through a
	// 1-rank onebit call), seconds per latency-bound round and time per
	// byte over the line rate's.
	CompressBps, Alpha, Ineff float64
	// RTT, when positive, is the link's round-trip time (a wide-area
	// link's: tens of milliseconds): every latency-bound round of every
	// collective, the outer optimizer's agreement included, costs RTT/2,
	// one message's one-way hop, in place of the calibration's alpha (a
	// loopback's), on either link sharing (rtt.go). At most 2 s; not with
	// Alpha, which sets the same figure.
	RTT time.Duration
	// OuterH, OuterFragments and OuterDelay are the outer optimizer's
	// settings (package outer: Config.H, Fragments and Delay), for its
	// rows: every rank takes OuterH inner steps without communicating,
	// the parameters are cut into OuterFragments near-equal fragments
	// (0 and 1: one), each exchanged once every OuterH steps at staggered
	// steps, and with OuterDelay > 0 an exchange runs beside that many
	// steps of StepCompute. OuterH in [0, MaxOuterH], 0: no outer
	// optimizer (OuterFragments at most 1 and OuterDelay 0 then);
	// OuterFragments in [0, OuterH] and at most Params; OuterDelay in
	// [0, OuterH/OuterFragments]. The 1-bit codec's buckets are
	// BucketBytes.
	OuterH, OuterFragments, OuterDelay int
	// OuterDensity, OuterSparseChunk and OuterSparseBits are the sparse
	// codec's settings (outer.Config.Density, SparseChunk and SparseBits;
	// 0: its defaults, DefaultSparseDensity, DefaultSparseChunk and
	// DefaultSparseBits), for the outer-sparse row: Density in (0, 1],
	// SparseChunk in [1/Density, MaxSparseChunk] and at most the smallest
	// fragment, SparseBits 1 or 2. With Collectives nil the outer-sparse
	// row is among the default outer rows only where its chunk fits the
	// smallest fragment (package outer refuses a longer one).
	OuterDensity     float64
	OuterSparseChunk int
	OuterSparseBits  int
	// MuonShape, MuonParams and MuonFlops describe the model to Muon's
	// rows (muon.go): the Muon matrices' rows x cols (zero:
	// DefaultMuonShape(Params)), the elements in them (0, or more than
	// Params: all of Params;
	// as many whole matrices as it holds, the rest goes to the auxiliary
	// AdamW) and the FLOP/s of the Newton-Schulz products on one rank (0:
	// DefaultMuonFlops). With Collectives nil and MuonShape set, the rows
	// muon and onebit-muon follow allreduce and onebit.
	MuonShape  [2]int64
	MuonParams int64
	MuonFlops  float64
	// TokensPerStep, when positive, asks the plan how W machines compare
	// with one (Plan.VsOne, vsone.go): the tokens (or examples) of each
	// worker's step, whose forward and backward take StepCompute, which
	// must then be positive. At most MaxTokensPerStep.
	TokensPerStep int64
	// FieldNames, when not nil, gives the names the plan's sentences
	// (Assumptions' AlphaFrom, IneffFrom and CompressFrom) call the fields
	// of Job by, keyed by field name: a front end's spelling of them, such
	// as lowbit plan's flags ("Alpha": "--alpha"). A field it does not
	// name is "Job." and its name ("Job.Alpha").
	FieldNames map[string]string
}

// fieldName is what the plan's sentences call field field of j (see
// FieldNames).
func (j Job) fieldName(field string) string {
	if name, ok := j.FieldNames[field]; ok {
		return name
	}
	return "Job." + field
}

// Row is one collective's predicted step.
//
// A row of the outer optimizer (outer-fp32, outer-bf16, outer-int8,
// outer-1bit, outer-sparse) is the average step over OuterH steps, in which each of
// the OuterFragments fragments is exchanged once (its agreement, then the
// codec's collective): WirePerRank is the average bytes per step, and
// LatencyS, TransferS and CompressS are the exchanges' terms divided by
// OuterH, less the overlap of a delayed exchange (HiddenS). Calls is
// there the calls of one exchange of the largest fragment, agreement
// included (one every Plan.Outer.ExchangeEvery steps on average).
type Row struct {
	Collective   string  `json:"collective"`
	Calibrated   bool    `json:"calibrated"`
	Calls        int     `json:"calls"` // collective calls per step (buckets times calls per bucket); outer rows: per exchange
	WirePerRank  int64   `json:"wire_bytes_per_rank"`
	LatencyS     float64 `json:"latency_s"`
	TransferS    float64 `json:"transfer_s"`
	CompressS    float64 `json:"compress_s"`
	CommS        float64 `json:"comm_s"` // LatencyS + TransferS + CompressS
	StepS        float64 `json:"step_s"` // CommS + Job.StepCompute
	SpeedupExact float64 `json:"speedup_vs_exact,omitempty"`
	// ExchangeS (outer rows) is the time of one exchange of the largest
	// fragment, agreement included, before any overlap.
	ExchangeS float64 `json:"exchange_s,omitempty"`
	// OrthoS (Muon's rows) is the orthogonalization of every Muon matrix
	// on one rank, per step (Plan.Muon): in StepS, not in CommS.
	OrthoS float64 `json:"ortho_s,omitempty"`
	// HiddenS (outer rows with OuterDelay > 0) is the exchange time per
	// step, on average, that runs beside the OuterDelay steps of compute
	// after its launch (at most OuterDelay*StepCompute per exchange):
	// left out of CommS.
	HiddenS float64 `json:"hidden_s,omitempty"`
}

// Assumptions is what a plan's numbers rest on, each with where it comes
// from: the calibration (a sentence saying which part of it), or the Job
// field that replaced it ("Job.Alpha", "Job.Ineff", "Job.CompressBps", or
// the names Job.FieldNames gives them; Job.RTT's alpha is "Job.RTT 40ms /
// 2: ...").
type Assumptions struct {
	Alpha     float64 `json:"alpha_s"`
	AlphaFrom string  `json:"alpha_from"`
	// AlphaNote, when not empty, says that Alpha is the calibration
	// loopback's on a link slow enough to be a wide-area one, and which
	// field gives the link's round trip (Job.RTT).
	AlphaNote    string  `json:"alpha_note,omitempty"`
	Ineff        float64 `json:"ineff"`
	IneffFrom    string  `json:"ineff_from"`
	Buckets      int64   `json:"buckets"`
	BucketBytes  int64   `json:"bucket_bytes"`
	CompressBps  float64 `json:"compress_bytes_per_s"` // 1-rank onebit call throughput at the bucket size
	CompressFrom string  `json:"compress_from"`
}

// Plan is the predicted gradient exchange of one step of a Job.
type Plan struct {
	Params      int64       `json:"params"`
	Ranks       int         `json:"ranks"`
	LinkBps     float64     `json:"link_bytes_per_s"`
	Sharing     string      `json:"link_sharing"`
	StepCompute float64     `json:"step_compute_s"`
	Assumptions Assumptions `json:"assumptions"`
	// Model is the model the plan used (with Job.CompressBps applied).
	Model *Model `json:"model"`
	Rows  []Row  `json:"collectives"`
	// Outer is the outer optimizer's settings (nil: Job.OuterH 0).
	Outer *OuterPlan `json:"outer,omitempty"`
	// Muon is how Muon's rows see the model (nil: no Muon row).
	Muon *MuonPlan `json:"muon,omitempty"`
	// VsOne is W machines against one, row by row (nil:
	// Job.TokensPerStep 0).
	VsOne *VsOne `json:"vs_one,omitempty"`
}

// Plan predicts the gradient exchange of one step of j: the gradient goes
// in buckets of j.BucketBytes, each bucket one call of each collective.
func (m *Model) Plan(j Job) (*Plan, error) {
	if err := j.Validate(); err != nil {
		return nil, err
	}
	if j.Sharing == "" {
		j.Sharing = PerRank
	}
	if j.Collectives == nil {
		j.Collectives = j.DefaultCollectives()
	}
	if j.CompressBps > 0 {
		cp := *m
		cp.CompressBps = j.CompressBps
		m = &cp
	}
	n := j.Params
	s := setup{Ranks: j.Ranks, Rate: j.Link, Sharing: j.Sharing}
	f, calibratedLink := m.fitFor(j.LinkName, j.Link)
	a := Assumptions{Alpha: f.Alpha, Ineff: f.Ineff,
		AlphaFrom: "fitted on the calibration's " + f.RateName + " shaped loopback",
		IneffFrom: "fitted on the calibration's " + f.RateName + " shaped loopback"}
	if !calibratedLink && f.Ineff < 1 {
		a.Ineff = 1
		a.IneffFrom = fmt.Sprintf("line rate: the %s loopback fit (%.2f) is below 1, which a real link does not do", f.RateName, f.Ineff)
	}
	if j.Alpha > 0 {
		a.Alpha, a.AlphaFrom = j.Alpha, j.fieldName("Alpha")
	}
	if j.Ineff > 0 {
		a.Ineff, a.IneffFrom = j.Ineff, j.fieldName("Ineff")
	}
	j.roundTrip(&a, &s)
	a.AlphaNote = j.alphaNote()
	f.Alpha, f.Ineff = a.Alpha, a.Ineff
	if j.Sharing == Shared {
		s.Burst = m.Burst
	}
	// The gradient goes in buckets of j.BucketBytes: full ones and the
	// rest.
	per := j.BucketBytes / 4
	full, rest := n/per, n%per
	a.Buckets, a.BucketBytes = full, j.BucketBytes
	if rest > 0 {
		a.Buckets++
	}
	one, _ := findCollective("onebit")
	if c1 := m.computeSeconds(one, min(n, per), setup{Ranks: 1, Sharing: PerRank}); c1 > 0 {
		a.CompressBps = float64(4*onebitPaddedLen(min(n, per), 1)) / c1
	}
	a.CompressFrom = "measured on the calibration machine, 1 rank, at the bucket size; set " + j.fieldName("CompressBps") + " to your hardware's"
	if m.CompressBps > 0 {
		a.CompressFrom = j.fieldName("CompressBps")
	}
	// predictN is a step's calls of c on n elements in buckets.
	predictN := func(c collective, n int64) prediction {
		var p prediction
		full, rest := n/per, n%per
		if full > 0 {
			p.add(m.predict(c, per, s, f), full)
		}
		if rest > 0 {
			p.add(m.predict(c, rest, s, f), 1)
		}
		return p
	}
	predictStep := func(c collective) prediction { return predictN(c, n) }
	compute := j.StepCompute.Seconds()
	exactComm := predictStep(collectives[0]).total()
	var rows []Row
	var mp *MuonPlan
	for _, name := range j.Collectives {
		if oc, ok := findOuterCodec(name); ok {
			if oc.muon {
				mp = muonPlan(j)
			}
			rows = append(rows, m.outerRow(oc, j, s, f, exactComm+compute))
			continue
		}
		if isMuonRow(name) {
			mp = muonPlan(j)
			via := collectives[0]
			if name == OptOnebitMuon {
				via, _ = findCollective("onebit")
			}
			p := predictStep(via)
			if name == OptOnebitMuonOwners {
				// The AdamW group's buckets through the 1-bit allreduce,
				// the Muon group through its owners.
				one, _ := findCollective("onebit")
				p = predictN(one, mp.Other)
				p.add(m.predict(ownersCollective(mp), mp.Matrices*mp.Shape[0]*mp.Shape[1], s, f), 1)
			}
			if name == OptMuonSplit && j.Ranks > 1 {
				// The all-gather of the orthogonalized updates: each
				// rank's share padded to the largest.
				p.add(m.predict(allGatherCollective, int64(j.Ranks)*splitShare(mp.Matrices, j.Ranks)*mp.Shape[0]*mp.Shape[1], s, f), 1)
			}
			rows = append(rows, muonRow(name, p, mp, compute, exactComm+compute))
			continue
		}
		c, _ := findCollective(name)
		p := predictStep(c)
		r := Row{Collective: name, Calibrated: c.uncalibrated == "", Calls: p.Calls, WirePerRank: p.Wire,
			LatencyS: p.Latency, TransferS: p.Transfer, CompressS: p.Compute, CommS: p.total(),
			StepS: p.total() + compute}
		if r.StepS > 0 {
			r.SpeedupExact = (exactComm + compute) / r.StepS
		}
		rows = append(rows, r)
	}
	plan := &Plan{Params: n, Ranks: j.Ranks, LinkBps: j.Link, Sharing: string(j.Sharing), StepCompute: compute,
		Assumptions: a, Model: m, Rows: rows, Outer: outerPlan(j, slices.ContainsFunc(j.Collectives, isSparseRow)), Muon: mp}
	if j.TokensPerStep > 0 {
		var err error
		if plan.VsOne, err = m.vsOne(j, plan); err != nil {
			return nil, err
		}
	}
	return plan, nil
}

// DefaultCollectives is what a nil Job.Collectives plans: allreduce and
// onebit, Muon's rows with MuonShape, then with OuterH > 0 the outer
// optimizer's rows (the sparse codec's only where its chunk fits the
// smallest fragment, OptOuterMuon only with MuonShape).
func (j Job) DefaultCollectives() []string {
	names := []string{"allreduce", "onebit"}
	if j.MuonShape != [2]int64{} {
		names = append(names, OptMuon, OptMuonSplit, OptOnebitMuon)
	}
	return append(names, j.defaultOuterRows()...)
}

// Limits of a Job that Plan accepts.
const (
	MaxParams = 1e15
	MaxRanks  = 1 << 20
)

// JobError is a Job that Plan refuses: Field names the Job field at
// fault.
type JobError struct {
	Field  string
	Reason string
}

func (e *JobError) Error() string { return e.Field + ": " + e.Reason }

// Validate reports the first field of j that Plan cannot use, as a
// *JobError.
func (j Job) Validate() error {
	bad := func(v float64) bool { return v < 0 || math.IsInf(v, 0) || math.IsNaN(v) }
	fail := func(field, format string, args ...any) error {
		return &JobError{Field: field, Reason: fmt.Sprintf(format, args...)}
	}
	switch {
	case j.Params < 1 || j.Params > MaxParams:
		return fail("Params", "must be in [1, %s] parameters, got %s", size.FormatCount(MaxParams), size.FormatCount(j.Params))
	case j.Ranks < 2 || j.Ranks > MaxRanks:
		return fail("Ranks", "must be in [2, %d], got %d", MaxRanks, j.Ranks)
	case !(j.Link > 0) || math.IsInf(j.Link, 0):
		return fail("Link", "must be a positive rate, got %g", j.Link)
	case j.Sharing != "" && j.Sharing != Shared && j.Sharing != PerRank:
		return fail("Sharing", "unknown link sharing %q (want %s or %s)", j.Sharing, Shared, PerRank)
	case bad(j.CompressBps) || j.CompressBps > 1e15:
		return fail("CompressBps", "must be in [0, 1e15] bytes per second, got %g", j.CompressBps)
	case bad(j.Alpha) || j.Alpha > 1:
		return fail("Alpha", "must be in [0, 1] seconds per round, got %g", j.Alpha)
	case j.RTT < 0 || j.RTT.Seconds() > maxRTT:
		return fail("RTT", "must be in [0, %gs], got %s", maxRTT, j.RTT)
	case j.RTT > 0 && j.Alpha > 0:
		return fail("RTT", "sets the latency of a round as %s does: give one of them", j.fieldName("Alpha"))
	case bad(j.Ineff) || j.Ineff > 1000:
		return fail("Ineff", "must be in [0, 1000], got %g", j.Ineff)
	case j.BucketBytes < 4 || j.BucketBytes%4 != 0:
		return fail("BucketBytes", "must be a positive multiple of 4 bytes, got %d", j.BucketBytes)
	case j.StepCompute < 0:
		return fail("StepCompute", "must not be negative, got %s", j.StepCompute)
	case j.TokensPerStep < 0 || j.TokensPerStep > MaxTokensPerStep:
		return fail("TokensPerStep", "must be in [0, %s] tokens per worker per step, got %d", size.FormatCount(MaxTokensPerStep), j.TokensPerStep)
	case j.TokensPerStep > 0 && j.StepCompute == 0:
		return fail("StepCompute", "must be positive with %s: one machine's forward and backward time for its tokens", j.fieldName("TokensPerStep"))
	case j.Collectives != nil && len(j.Collectives) == 0:
		return fail("Collectives", "no collective to plan")
	}
	for _, name := range j.Collectives {
		_, ok := findCollective(name)
		if _, outer := findOuterCodec(name); !ok && !outer && !isMuonRow(name) {
			var names []string
			for _, c := range Collectives() {
				names = append(names, c.Name)
			}
			return fail("Collectives", "unknown collective %q (want %s)", name, strings.Join(names, ", "))
		}
	}
	if err := j.validateMuon(fail); err != nil {
		return err
	}
	return j.validateOuter(fail)
}
