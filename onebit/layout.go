package onebit

import (
	"iter"
	"sort"

	"github.com/lowbit-ml/lowbit/optim"
)

// layout maps the fused buckets of the parameters' flat buffer back to
// the parameters, for the modes of 1-bit Adam that work bucket by bucket
// on the parameters' own slices (StateSharded, StateCompact).
type layout struct {
	params []*optim.Param
	bkt    *buckets // bounds and one State per bucket, as in StateFull
	segs   [][]segment
}

// segment is a parameter's part of a bucket: elements [lo, hi) of the
// bucket are elements [off, off+hi-lo) of parameter param.
type segment struct {
	param, off, lo, hi int
}

// newLayout lists the segments of every bucket of b.
func newLayout(params []*optim.Param, b *buckets) layout {
	l := layout{params: params, bkt: b, segs: make([][]segment, len(b.states))}
	k, flat := 0, 0
	for i, p := range params {
		for off := 0; off < p.Numel(); {
			lo := flat - b.bounds[k]
			hi := min(b.bounds[k+1]-b.bounds[k], lo+p.Numel()-off)
			l.segs[k] = append(l.segs[k], segment{param: i, off: off, lo: lo, hi: hi})
			off += hi - lo
			flat += hi - lo
			if flat == b.bounds[k+1] {
				k++
			}
		}
	}
	return l
}

// segsFrom is the index of the first segment of bucket k that ends after
// element lo.
func (l *layout) segsFrom(k, lo int) int {
	segs := l.segs[k]
	return sort.Search(len(segs), func(i int) bool { return segs[i].hi > lo })
}

// span is the part [a, b) of a run of bucket elements that segment sg
// covers.
type span struct {
	sg   segment
	a, b int
}

// at is the span's part of x, a slice of the run from element lo.
func (sp span) at(x []float32, lo int) []float32 { return x[sp.a-lo : sp.b-lo] }

// of is the span's part of a per-parameter buffer xs (the parameter's
// values, gradient, v or mask).
func (sp span) of(xs []float32) []float32 {
	return xs[sp.sg.off+sp.a-sp.sg.lo : sp.sg.off+sp.b-sp.sg.lo]
}

// spans yields, in order, the parts of elements [lo, hi) of bucket k that
// each parameter covers (padding is covered by none).
func (l *layout) spans(k, lo, hi int) iter.Seq[span] {
	return func(yield func(span) bool) {
		segs := l.segs[k]
		for i := l.segsFrom(k, lo); i < len(segs) && segs[i].lo < hi; i++ {
			if !yield(span{segs[i], max(segs[i].lo, lo), min(segs[i].hi, hi)}) {
				return
			}
		}
	}
}

// gradsInto copies the gradients of elements [lo, lo+len(x)) of bucket k
// into x, zero for padding.
func (l *layout) gradsInto(k, lo int, x []float32) {
	clear(x)
	for sp := range l.spans(k, lo, lo+len(x)) {
		copy(sp.at(x, lo), sp.of(l.params[sp.sg.param].GradData()))
	}
}

// addGrads adds the gradients of elements [lo, lo+len(x)) of bucket k
// into x (step 1: x = pad(g) + worker_error, rounded as the compressed
// allreduce rounds it).
func (l *layout) addGrads(k, lo int, x []float32) {
	for sp := range l.spans(k, lo, lo+len(x)) {
		g, xs := sp.of(l.params[sp.sg.param].GradData()), sp.at(x, lo)
		for j := range xs {
			xs[j] = xs[j] + g[j]
		}
	}
}
