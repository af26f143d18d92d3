package main

import (
	"fmt"
	"math"
	"strings"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// carriedTolerance bounds the relative difference carriedCheck accepts
// between a carried buffer and the old ranks' (their mean, or their
// concatenation): the regrouping functions sum in float64 and round once,
// so the difference is float32 rounding, about 6e-8 of the largest
// element.
const carriedTolerance = 1e-5

// carriedReport is what checkCarried found: how many buffers it compared
// with the old ranks', the largest relative difference and its buffer,
// and how many error buffers the regrouping dropped (the outer
// optimizer's 1-bit codec's onto one rank, which keeps none).
type carriedReport struct {
	checked int
	maxRel  float64
	worst   string
	reset   int
}

// String is the line a resume prints after "carried: ".
func (r carriedReport) String() string {
	s := fmt.Sprintf("%d buffers checked against the old ranks', max rel diff %.3g", r.checked, r.maxRel)
	if r.worst != "" && r.maxRel > 0 {
		s += " (" + r.worst + ")"
	}
	if r.reset > 0 {
		s += fmt.Sprintf("; %d error buffers dropped (the outer optimizer's 1-bit codec on one rank keeps none)", r.reset)
	}
	return s
}

// how checkCarried compares a buffer with the old ranks'.
const (
	byMean   = iota // every rank holds the whole buffer: the ranks' means agree
	byConcat        // the ranks hold cuts of one buffer: their concatenations agree
)

// checkCarried checks what a resume on another number of ranks carried:
// news are the states the new ranks load (one for zero-adam, the
// consolidation every rank loads), old the states the old ranks saved.
// Each buffer the regrouping promises to keep is compared element by
// element over the elements both hold: the error feedback's worker errors,
// 1-bit Muon's momenta, the outer optimizer's θ_g, u, 1-bit worker errors
// and sparse accumulator by their means over the ranks; the server errors
// (the outer optimizer's 1-bit codec's too) and the
// sharded moments (zero-adam's too) by the concatenation of the ranks'
// cuts. It fails where a buffer differs by more than carriedTolerance of
// the old buffer's largest element, or where a buffer the old ranks saved
// is missing.
func checkCarried(how carry, old, news []*optim.Checkpoint) (carriedReport, error) {
	var rep carriedReport
	compare := func(name, oldName string, kind int) error {
		a, err := combine(old, oldName, kind)
		if err != nil {
			return err
		}
		b, err := combine(news, name, kind)
		if err != nil {
			return err
		}
		// The elements past the parameters' are padding, which the
		// regrouping starts at zero (no parameter owes them anything).
		n := min(len(a), len(b))
		if real := realLen(old[0], oldName); real >= 0 {
			n = min(n, real)
		} else {
			n = min(n, unpadded(len(a), len(old), len(b), len(news)))
		}
		var diff, scale float64
		at := 0
		for i := range n {
			if d := math.Abs(a[i] - b[i]); d > diff {
				diff, at = d, i
			}
			scale = max(scale, math.Abs(a[i]))
		}
		rel := 0.0
		if diff > 0 {
			rel = diff / max(scale, math.SmallestNonzeroFloat32)
		}
		rep.checked++
		if rel > rep.maxRel {
			rep.maxRel, rep.worst = rel, name
		}
		if rel > carriedTolerance {
			return fmt.Errorf("-resume: the carried %s differs from the old ranks' by %.3g (relative, at element %d: %g, the old ranks' %g; at most %g expected): the state was not carried", name, rel, at, b[at], a[at], carriedTolerance)
		}
		return nil
	}
	switch how {
	case carryRegroup:
		muon := old[0].Algorithm == onebit.AlgorithmMuon
		for _, t := range old[0].Tensors {
			switch n := t.Name; {
			case strings.HasPrefix(n, optim.WorkerErrorName), muon && strings.HasPrefix(n, optim.MomentumBufferPrefix):
				if err := compare(n, n, byMean); err != nil {
					return rep, err
				}
			case strings.HasPrefix(n, optim.ServerErrorName), strings.HasPrefix(n, onebit.ExpAvgShardPrefix), strings.HasPrefix(n, onebit.ExpAvgSqShardPrefix):
				if len(news) > 1 || news[0].Tensor(n) != nil {
					if err := compare(n, n, byConcat); err != nil {
						return rep, err
					}
				}
			}
		}
	case carryConsolidate:
		for _, t := range old[0].Tensors {
			if n := t.Name; strings.HasPrefix(n, optim.ExpAvgPrefix) || strings.HasPrefix(n, optim.ExpAvgSqPrefix) {
				if err := compare(n, n, byConcat); err != nil {
					return rep, err
				}
			}
		}
	case carryOuter:
		for _, n := range []string{outer.TensorGlobal, outer.TensorMomentum} {
			if old[0].Tensor(n) != nil {
				if err := compare(n, n, byMean); err != nil {
					return rep, err
				}
			}
		}
		if old[0].Tensor(outer.AccumulatorName) != nil {
			if old[0].Tensor(outer.ServerAccumulatorName) != nil {
				// SparseTwoPhase: the old owners' server accumulators are
				// folded into the mean; compare the totals.
				if err := compareTotals(&rep, old, news); err != nil {
					return rep, err
				}
			} else if err := compare(outer.TensorRegroupedAccumulator, outer.AccumulatorName, byMean); err != nil {
				return rep, err
			}
		}
		for _, t := range old[0].Tensors {
			n := t.Name
			switch {
			case !optim.IsErrorBuffer(n) || n == outer.AccumulatorName || n == outer.ServerAccumulatorName:
			case news[0].Tensor(n) == nil:
				rep.reset++ // onto one rank
			case strings.HasPrefix(n, optim.WorkerErrorName):
				if err := compare(n, n, byMean); err != nil {
					return rep, err
				}
			default:
				if err := compare(n, n, byConcat); err != nil {
					return rep, err
				}
			}
		}
	}
	return rep, nil
}

// compareTotals checks that the sum of the new ranks' mean regrouped
// accumulator equals the old ranks' mean accumulator's sum plus their
// server accumulators' (SparseTwoPhase).
func compareTotals(rep *carriedReport, old, news []*optim.Checkpoint) error {
	var want, abs, got float64
	for _, ck := range old {
		for _, v := range ck.Tensor(outer.AccumulatorName).Data {
			want += float64(v) / float64(len(old))
			abs += math.Abs(float64(v)) / float64(len(old))
		}
		for _, v := range ck.Tensor(outer.ServerAccumulatorName).Data {
			want += float64(v)
			abs += math.Abs(float64(v))
		}
	}
	for _, ck := range news {
		t := ck.Tensor(outer.TensorRegroupedAccumulator)
		if t == nil {
			return fmt.Errorf("-resume: the regrouped state holds no %s: the sparse accumulator was not carried", outer.TensorRegroupedAccumulator)
		}
		for _, v := range t.Data {
			got += float64(v) / float64(len(news))
		}
	}
	rel := math.Abs(got-want) / max(abs, math.SmallestNonzeroFloat32)
	rep.checked++
	if rel > rep.maxRel {
		rep.maxRel, rep.worst = rel, outer.TensorRegroupedAccumulator
	}
	if rel > carriedTolerance {
		return fmt.Errorf("-resume: the carried sparse accumulator's total differs from the old ranks' by %.3g (relative): the state was not carried", rel)
	}
	return nil
}

// realLen is the number of parameter elements the buffer called name of
// ck covers, before its padding: the parameter's where the name ends in
// one (worker_error/w1, momentum_buffer/w1), every parameter's for the
// only worker error buffer of a checkpoint (1-bit LAMB's, or 1-bit Adam's
// one bucket), -1 where it cannot tell.
func realLen(ck *optim.Checkpoint, name string) int {
	if _, p, ok := strings.Cut(name, "/"); ok {
		if t := ck.Tensor(optim.ParamTensorName(p)); t != nil {
			return len(t.Data)
		}
	}
	workers, params := 0, 0
	for _, t := range ck.Tensors {
		if strings.HasPrefix(t.Name, optim.WorkerErrorName) {
			workers++
		}
		if strings.HasPrefix(t.Name, optim.ParamTensorName("")) {
			params += len(t.Data)
		}
	}
	if workers == 1 {
		return params
	}
	return -1
}

// unpadded is a lower bound of the real length of a buffer that holds la
// elements padded for wa ranks (onebit.PaddedLen) and lb padded for wb:
// the elements before it are a parameter's on both sides, whatever the
// real length (a bucket's, which the check does not know); the last
// fewer than W·lcm(W, 8) real elements may be left out.
func unpadded(la, wa, lb, wb int) int {
	return max(1, la-onebit.PaddedLen(1, wa)+1, lb-onebit.PaddedLen(1, wb)+1)
}

// combine is the buffer called name over the ranks of cks: the
// element-wise mean (byMean) or the concatenation in rank order
// (byConcat), in float64.
func combine(cks []*optim.Checkpoint, name string, kind int) ([]float64, error) {
	var out []float64
	for r, ck := range cks {
		t := ck.Tensor(name)
		if t == nil {
			return nil, fmt.Errorf("-resume: rank %d's state holds no %s: the state was not carried", r, name)
		}
		if kind == byConcat {
			for _, v := range t.Data {
				out = append(out, float64(v))
			}
			continue
		}
		if r == 0 {
			out = make([]float64, len(t.Data))
		}
		for i := range min(len(out), len(t.Data)) {
			out[i] += float64(t.Data[i]) / float64(len(cks))
		}
		out = out[:min(len(out), len(t.Data))]
	}
	return out, nil
}
