package optim

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
)

// HyperPrefix, followed by a hyperparameter's name, is the checkpoint
// scalar (Checkpoint.Floats) that records the hyperparameter's value (see
// Hyper).
const HyperPrefix = "hyper/"

// Hyper is one hyperparameter that decides the next step of an optimizer
// (a beta, eps, the weight decay, a freeze step, ...), as a float64: a
// float32 value converted exactly, an integer (exact up to 2^53), a bool
// as 0 or 1, or a fingerprint (see HyperFingerprint). An optimizer lists
// its hyperparameters once, in FrameConfig.Hypers; its Frame writes each
// into every checkpoint, under HyperPrefix + Name, and CheckLoad refuses a
// checkpoint that records another value for one of them.
//
// The learning rate is not a Hyper: it has its own rule (see
// Frame.CheckLoad). Neither are the settings that decide only how the
// gradients travel (the reduction mode, ranks per node, bucket and group
// sizes): changing them on resume is allowed (the reduction mode logs a
// warning; bucket layouts that the error buffers depend on are checked by
// the optimizers that have them).
type Hyper struct {
	Name  string
	Value float64
}

// HyperBool is b as a Hyper value: 1 for true, 0 for false.
func HyperBool(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// HyperFingerprint is a 53-bit fingerprint (FNV-1a, exact in a float64) of
// a set of per-parameter float32 buffers such as masks: 0 when every one is
// nil, otherwise a hash of each buffer's index, length and bits.
func HyperFingerprint(bufs [][]float32) float64 {
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	set := false
	mix := func(v uint64) {
		for range 8 {
			h ^= v & 0xff
			h *= prime
			v >>= 8
		}
	}
	for i, b := range bufs {
		if b == nil {
			continue
		}
		set = true
		mix(uint64(i))
		mix(uint64(len(b)))
		for _, x := range b {
			mix(uint64(math.Float32bits(x)))
		}
	}
	if !set {
		return 0
	}
	return float64(h&(1<<53-1) | 1) // never 0
}

// AdamHypers lists the hyperparameters of c that decide an Adam step:
// beta1, beta2, eps, weight_decay and bias_correction.
func AdamHypers(c AdamConfig) []Hyper {
	return []Hyper{
		{"beta1", float64(c.Beta1)},
		{"beta2", float64(c.Beta2)},
		{"eps", float64(c.Eps)},
		{"weight_decay", float64(c.WeightDecay)},
		{"bias_correction", HyperBool(c.BiasCorrection)},
	}
}

// LambHypers lists AdamHypers and the trust-ratio bounds max_coeff and
// min_coeff.
func LambHypers(c LambConfig) []Hyper {
	return append(AdamHypers(c.AdamConfig), Hyper{"max_coeff", float64(c.MaxCoeff)}, Hyper{"min_coeff", float64(c.MinCoeff)})
}

// writeHypers records the frame's hyperparameters in ck.
func (f *Frame) writeHypers(ck *Checkpoint) {
	for _, h := range f.hypers {
		ck.Floats[HyperPrefix+h.Name] = h.Value
	}
}

// checkHypers compares ck's recorded hyperparameters with the frame's. A
// value that differs, or a recorded hyperparameter the frame does not
// have, is an error naming it with both values. It returns the names of
// the frame's hyperparameters that ck does not record (a checkpoint made
// before they were recorded).
func (f *Frame) checkHypers(ck *Checkpoint) (missing []string, err error) {
	for _, h := range f.hypers {
		v, ok := ck.Floats[HyperPrefix+h.Name]
		if !ok {
			missing = append(missing, h.Name)
			continue
		}
		if math.Float64bits(v) != math.Float64bits(h.Value) {
			return nil, fmt.Errorf("%w: made with %s %s, this optimizer has %s (a hyperparameter that decides the next step; to change it on purpose, delete the checkpoint's %q entry)",
				ErrIncompatibleCheckpoint, h.Name, FormatHyper(v), FormatHyper(h.Value), HyperPrefix+h.Name)
		}
	}
	for _, k := range sortedKeys(ck.Floats) {
		name, ok := strings.CutPrefix(k, HyperPrefix)
		if ok && !slices.ContainsFunc(f.hypers, func(h Hyper) bool { return h.Name == name }) {
			return nil, fmt.Errorf("%w: made with hyperparameter %s %s, which %s does not have (delete the checkpoint's %q entry to load it anyway)",
				ErrIncompatibleCheckpoint, name, FormatHyper(ck.Floats[k]), f.algorithm, k)
		}
	}
	return missing, nil
}

// FormatHyper prints a Hyper value v as the float32 or integer it holds
// when it holds one exactly ("0.9", "100000", "1e-08"), else as a float64.
func FormatHyper(v float64) string {
	switch {
	case v == math.Trunc(v) && math.Abs(v) < 1<<53:
		return strconv.FormatFloat(v, 'f', -1, 64)
	case float64(float32(v)) == v:
		return strconv.FormatFloat(v, 'g', -1, 32)
	default:
		return strconv.FormatFloat(v, 'g', -1, 64)
	}
}
