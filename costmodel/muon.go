package costmodel

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Muon (optim.Muon, docs/muon.md) and 1-bit Muon (onebit.Muon) in a plan.
// Both update the Muon matrices with momentum orthogonalized by
// Newton-Schulz and every other parameter with an auxiliary AdamW, in the
// same step. A step of exact Muon averages the gradients with the exact
// allreduce, then every rank orthogonalizes every matrix (the same
// arithmetic on the same bytes on every rank: no split across ranks). A
// step of 1-bit Muon after its warm-up (onebit.MuonConfig.FreezeStep, 100
// by default, in which it is exact Muon) orthogonalizes every matrix from
// the rank's own momentum and exchanges the results, and the AdamW group's
// momentum, with the 1-bit allreduce in fused buckets, as 1-bit Adam does.
//
// A plan sees the model as Job.Params float32 elements: the Muon group is
// whole matrices of one shape (Job.MuonShape, default DefaultMuonShape)
// as many as Job.MuonParams holds (default all of Params), and the rest
// goes to AdamW.

// Optimizer names of Muon's rows (Job.Collectives and the state table).
const (
	OptMuon       = "muon"        // optim.Muon, exact float32 averaging
	OptMuonSplit  = "muon-split"  // optim.Muon with MuonConfig.Split
	OptOnebitMuon = "onebit-muon" // onebit.Muon after its warm-up
	// OptOnebitMuonOwners is onebit.Muon with MuonConfig.Exchange
	// ExchangeOwners after its warm-up: opt-in (Job.Collectives names
	// it), not among the default rows.
	OptOnebitMuonOwners = "onebit-muon-owners"
)

// muonNSSteps is optim.DefaultMuonConfig's NSSteps, copied so that the
// cost model does not import the optimizers; TestMuonCopiesMatch checks
// the copy.
const muonNSSteps = 5

// DefaultMuonFlops is the rate of the Newton-Schulz products, float32
// FLOP per second on one rank, that a plan assumes without Job.MuonFlops:
// gonum's Sgemm on one core of the development VM (2-core AMD EPYC), 1.26
// G multiply-adds in 137 ms (docs/muon.md, "Cost of the
// orthogonalization").
const DefaultMuonFlops = 18e9

// NSFlops is the float32 operations (a multiply-add is two) of one
// orthogonalization of a rows x cols matrix by Muon's Newton-Schulz
// iteration, optim's: the matrix viewed as r x c with r = min(rows, cols)
// and c = max(rows, cols), each of the muonNSSteps iterations computes
// the symmetric A = X Xᵀ (its upper triangle: about r²c/2 multiply-adds),
// the symmetric A A (about r³/2) and B X (r²c): steps·(3r²c + r³). The
// normalization, the elementwise terms (O(rc)) and the diagonal's extra
// half are left out.
func NSFlops(rows, cols int64) float64 {
	r, c := float64(min(rows, cols)), float64(max(rows, cols))
	return muonNSSteps * (3*r*r*c + r*r*r)
}

// DefaultMuonShape is the Muon matrices' shape a plan of params parameters
// assumes without Job.MuonShape: square, d x d, with d the width of a
// GPT-3-like model of that size (12d² parameters per block, d/100 blocks:
// d = (100·params/12)^(1/3)), rounded to a multiple of 64 (at least 64).
// GPT-3's 125M, 1.3B and 6.7B have d 768, 2048 and 4096; this gives 1024,
// 2240 and 3840. A real model's feed-forward matrices are d x 4d, whose
// orthogonalization costs 25% less per element than a d x d matrix's.
func DefaultMuonShape(params int64) [2]int64 {
	d := int64(math.Round(math.Cbrt(100*float64(params)/12)/64)) * 64
	d = max(d, 64)
	return [2]int64{d, d}
}

// ParseShape parses a matrix shape written rows x cols ("2048x8192"),
// both positive.
func ParseShape(s string) ([2]int64, error) {
	r, c, ok := strings.Cut(strings.ToLower(strings.TrimSpace(s)), "x")
	rows, err1 := strconv.ParseInt(r, 10, 64)
	cols, err2 := strconv.ParseInt(c, 10, 64)
	if !ok || err1 != nil || err2 != nil || rows < 1 || cols < 1 {
		return [2]int64{}, fmt.Errorf("want a matrix shape rows x cols of positive whole numbers, such as 2048x8192")
	}
	return [2]int64{rows, cols}, nil
}

// MuonPlan is how a plan sees the model for Muon's rows.
type MuonPlan struct {
	// Shape is the Muon matrices' rows x cols, Matrices how many there are
	// and Other the elements left to AdamW.
	Shape    [2]int64 `json:"shape"`
	Matrices int64    `json:"matrices"`
	Other    int64    `json:"adamw_params"`
	// Flops is the Newton-Schulz work of a step on one rank, and Rate
	// the FLOP/s it runs at (Job.MuonFlops or DefaultMuonFlops).
	Flops float64 `json:"ns_flops"`
	Rate  float64 `json:"ns_flops_per_s"`
	// OrthoS is Flops/Rate: the orthogonalization's seconds per step.
	OrthoS float64 `json:"ortho_s"`
	// SplitOrthoS is the same under MuonConfig.Split on Job.Ranks ranks:
	// the most loaded rank's share of the matrices (the muon-split row).
	SplitOrthoS float64 `json:"split_ortho_s"`
}

// muonPlan is the MuonPlan of j.
func muonPlan(j Job) *MuonPlan {
	shape := j.MuonShape
	if shape == [2]int64{} {
		shape = DefaultMuonShape(j.Params)
	}
	muon := j.Params
	if j.MuonParams > 0 {
		muon = min(j.MuonParams, j.Params)
	}
	p := &MuonPlan{Shape: shape, Matrices: muon / (shape[0] * shape[1]), Rate: DefaultMuonFlops}
	p.Other = j.Params - p.Matrices*shape[0]*shape[1]
	if j.MuonFlops > 0 {
		p.Rate = j.MuonFlops
	}
	p.Flops = float64(p.Matrices) * NSFlops(shape[0], shape[1])
	p.OrthoS = p.Flops / p.Rate
	p.SplitOrthoS = float64(splitShare(p.Matrices, max(j.Ranks, 1))) * NSFlops(shape[0], shape[1]) / p.Rate
	return p
}

// isMuonRow reports whether name is one of Muon's rows.
func isMuonRow(name string) bool {
	return name == OptMuon || name == OptMuonSplit || name == OptOnebitMuon || name == OptOnebitMuonOwners
}

// ownerChunk is onebit's chunk of ExchangeOwners' messages, copied so that
// the cost model does not import the optimizers; TestOwnersBytesMatchOptimizer
// checks the bytes against the optimizer's.
const ownerChunk = 1024

// ownerMessageBytes is the bytes of ExchangeOwners' message of a matrix of
// n elements: a float32 scale per chunk, then the packed signs.
func ownerMessageBytes(n int64) int64 {
	return 4*((n+ownerChunk-1)/ownerChunk) + (n+7)/8
}

// ownersCollective is ExchangeOwners' exchange of the Muon group of mp in a
// step: an all-to-all to the matrices' owners and an all-gather from them,
// each of W segments of the most loaded owner's messages (the plan's
// matrices are of one shape, so ceil(matrices/W) of them; the other
// owners' segments padded to it), W-1 latency-bound rounds each, (W-1)
// segments sent per rank each. It borrows the exact allreduce's fit; the
// rotations and the packing are not timed.
func ownersCollective(mp *MuonPlan) collective {
	seg := func(w int) int64 { return splitShare(mp.Matrices, w) * ownerMessageBytes(mp.Shape[0]*mp.Shape[1]) }
	return collective{
		name: "owners",
		desc: "ExchangeOwners' all-to-all to the Muon matrices' owners and all-gather from them, 1 bit an element",
		wireBytes: func(_ int64, w int) int64 {
			if w <= 1 {
				return 0
			}
			return 2 * int64(w-1) * seg(w)
		},
		steps: func(_ int64, w int, _ float64) []step {
			if w <= 1 {
				return nil
			}
			b := int64(w-1) * seg(w)
			return []step{{rounds: float64(w - 1), bytes: b}, {rounds: float64(w - 1), bytes: b}}
		},
		fitAs:        "allreduce",
		uncalibrated: "the owners' exchange borrows the exact allreduce's fit; its rotations and packing are not timed",
	}
}

// allGatherCollective is the all-gather of MuonConfig.Split: each of W
// ranks contributes ceil(n/W) float32s (n the Muon matrices' elements; the
// plan's matrices are of one shape, so the largest share is whole
// matrices: see splitShare) and receives the others', W-1 latency-bound
// rounds of a ring, (W-1)·4·share bytes sent per rank. It borrows the
// exact allreduce's fit.
var allGatherCollective = collective{
	name: "allgather",
	desc: "ring all-gather of float32 shares",
	wireBytes: func(n int64, w int) int64 {
		if w <= 1 || n <= 0 {
			return 0
		}
		return int64(w-1) * 4 * ((n + int64(w) - 1) / int64(w))
	},
	steps: func(n int64, w int, _ float64) []step {
		if w <= 1 || n <= 0 {
			return nil
		}
		return []step{{rounds: float64(w - 1), bytes: int64(w-1) * 4 * ((n + int64(w) - 1) / int64(w))}}
	},
	fitAs: "allreduce",
}

// splitShare is the matrices a rank orthogonalizes under
// MuonConfig.Split on w ranks, the most loaded one's: the plan's matrices
// are all of one shape, so optim's balancing gives ceil(matrices/w).
func splitShare(matrices int64, w int) int64 {
	return (matrices + int64(w) - 1) / int64(w)
}

// muonRow is the row of Muon's optimizer name from the prediction of its
// exchange (the exact or the 1-bit allreduce of every bucket) and the
// orthogonalization of mp.
func muonRow(name string, p prediction, mp *MuonPlan, compute, exactStep float64) Row {
	r := Row{Collective: name, Calibrated: true, Calls: p.Calls, WirePerRank: p.Wire,
		LatencyS: p.Latency, TransferS: p.Transfer, CompressS: p.Compute, CommS: p.total(), OrthoS: mp.OrthoS}
	switch name {
	case OptMuonSplit:
		r.OrthoS = mp.SplitOrthoS
	case OptOnebitMuonOwners:
		r.OrthoS, r.Calibrated = mp.SplitOrthoS, false // each owner orthogonalizes its own matrices
	}
	r.StepS = r.CommS + r.OrthoS + compute
	if r.StepS > 0 {
		r.SpeedupExact = exactStep / r.StepS
	}
	return r
}

// validateMuon reports the first Muon field of j that Plan cannot use.
func (j Job) validateMuon(fail func(field, format string, args ...any) error) error {
	s := j.MuonShape
	switch {
	case s != [2]int64{} && (s[0] < 1 || s[1] < 1 || s[0] > MaxParams/s[1]):
		return fail("MuonShape", "must be two positive dimensions whose product is at most %s, got %d x %d", "1e15", s[0], s[1])
	case j.MuonParams < 0 || j.MuonParams > MaxParams:
		return fail("MuonParams", "must be in [0, %s] (0, or more than Params: all of Params), got %d", "1e15", j.MuonParams)
	case !(j.MuonFlops >= 0) || math.IsInf(j.MuonFlops, 0) || j.MuonFlops > 1e18:
		return fail("MuonFlops", "must be in [0, 1e18] FLOP/s (0: DefaultMuonFlops), got %g", j.MuonFlops)
	}
	return nil
}

// muonState is MuonStateBytes of count matrices of rows x cols and other
// elements of AdamW, in closed form.
func muonState(shape [2]int64, count, other int64) int64 {
	r, c := min(shape[0], shape[1]), max(shape[0], shape[1])
	n := 8*other + 4*count*r*c
	if count > 0 && r > 0 {
		n += 4 * (2*r*c + 2*r*r)
	}
	return n
}

// OnebitMuonStateBytes returns the bytes of 1-bit Muon's state
// (onebit.Muon's StateBytes, float32 gradient averaging, buckets of
// bucketBytes, 0: DefaultBucketBytes; one bucket per parameter is not
// modelled) on rank 0 of world ranks, for the Muon matrices (rows x cols
// each) and the AdamW parameters (other, their elements per tensor): this
// rank's momentum of every matrix (4 bytes per element), the exchange
// buffer (4 per element of every parameter), the AdamW variance (4 per
// AdamW element), a float32 per parameter tensor, the Newton-Schulz work
// matrices (one set per distinct shape, as MuonStateBytes), and the
// onebit.State of every bucket of the flat buffer with their shared wire
// buffers, as 1-bit Adam's (none on one rank), the buckets laid out as
// onebit.DefaultMuonConfig's WarmupAdamWOnly lays them: the matrices'
// elements first, the AdamW group's after them, the buckets also cut
// where the two meet.
func OnebitMuonStateBytes(matrices [][2]int64, other []int64, world int, bucketBytes int64) (int64, error) {
	if world < 1 || bucketBytes < 0 {
		return 0, fmt.Errorf("costmodel: invalid state size: %d ranks, buckets of %d bytes", world, bucketBytes)
	}
	var mat, aux int64
	for _, m := range matrices {
		if m[0] < 0 || m[1] < 0 || (m[1] > 0 && m[0] > MaxParams/m[1]) {
			return 0, fmt.Errorf("costmodel: invalid state size: a %d x %d matrix", m[0], m[1])
		}
		mat += m[0] * m[1]
	}
	for _, k := range other {
		if k < 0 {
			return 0, fmt.Errorf("costmodel: invalid state size: a tensor of %d elements", k)
		}
		aux += k
	}
	if bucketBytes == 0 {
		bucketBytes = DefaultBucketBytes
	}
	n := mat + aux
	if !fits(n, world, max(bucketBytes/4, 1)) {
		return 0, errTooLarge
	}
	exact, err := MuonStateBytes(matrices, 0)
	if err != nil {
		return 0, err
	}
	// exact is the momenta and the work matrices.
	return exact + 4*n + 4*aux + 4*int64(len(matrices)+len(other)) + cutBucketStates(mat, aux, world, bucketBytes, false), nil
}

// OptOnebitMuonCompactBF16 is the state row of 1-bit Muon in its smallest
// mode: onebit.MuonConfig's StateCompact with MomentumBF16
// (OnebitMuonCompactStateBytes).
const OptOnebitMuonCompactBF16 = "onebit-muon-compact-bf16"

// OnebitMuonCompactStateBytes is OnebitMuonStateBytes for
// onebit.MuonConfig's StateCompact (momentumBF16: with MomentumBF16) in
// its compression stage, the larger of its two layouts: no exchange
// buffer for the matrices (the AdamW group's m stays, 4 bytes per AdamW
// element), the worker errors in bfloat16 (2 bytes per padded element of
// every bucket instead of 4), the momenta in bfloat16 with momentumBF16
// (2 per element of a matrix instead of 4), plus a float32 scratch matrix
// as long as the largest matrix, a float32 step per parameter tensor and
// a block of 4Ki floats. On one rank the mode runs as StateFull: the
// figure is OnebitMuonStateBytes.
func OnebitMuonCompactStateBytes(matrices [][2]int64, other []int64, world int, bucketBytes int64, momentumBF16 bool) (int64, error) {
	full, err := OnebitMuonStateBytes(matrices, other, world, bucketBytes)
	if err != nil || world < 2 {
		return full, err
	}
	var mat, most int64
	for _, m := range matrices {
		mat += m[0] * m[1]
		most = max(most, m[0]*m[1])
	}
	var aux int64
	for _, k := range other {
		aux += k
	}
	if bucketBytes == 0 {
		bucketBytes = DefaultBucketBytes
	}
	return full + muonCompactDelta(mat, aux, most, int64(len(matrices)+len(other)), world, bucketBytes, momentumBF16), nil
}

// muonCompactDelta is what StateCompact changes in 1-bit Muon's
// StateFull state of mat matrix elements (the largest matrix most) and
// aux AdamW elements in tensors tensors (see
// OnebitMuonCompactStateBytes), on world > 1 ranks.
func muonCompactDelta(mat, aux, most, tensors int64, world int, bucketBytes int64, momentumBF16 bool) int64 {
	per := max(bucketBytes/4, 1)
	var padded int64
	for _, n := range []int64{mat, aux} { // the buckets are cut where the AdamW group begins
		padded += n/per*onebitPaddedLen(per, world) + onebitPaddedLen(n%per, world)
	}
	d := -4*mat - 2*padded + 4*most + 4*tensors + 4*compactBlock
	if momentumBF16 {
		d -= 2 * mat
	}
	return d
}

// compactBlock is the float32 block of onebit's compact 1-bit Muon.
const compactBlock = 4 << 10

// onebitMuonState is OnebitMuonStateBytes of count matrices of one shape
// and other AdamW elements in one tensor, in closed form.
func onebitMuonState(shape [2]int64, count, other int64, world int, bucketBytes int64) (int64, error) {
	n := count*shape[0]*shape[1] + other
	if !fits(n, world, max(bucketBytes/4, 1)) {
		return 0, errTooLarge
	}
	tensors := count
	if other > 0 {
		tensors++
	}
	return muonState(shape, count, 0) + 4*n + 4*other + 4*tensors + cutBucketStates(n-other, other, world, bucketBytes, false), nil
}
