package onebit

import (
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

// gradsInto copies the gradients of elements [lo, lo+len(x)) of bucket k
// into x, zero for padding.
func (l *layout) gradsInto(k, lo int, x []float32) {
	clear(x)
	hi := lo + len(x)
	segs := l.segs[k]
	for i := l.segsFrom(k, lo); i < len(segs) && segs[i].lo < hi; i++ {
		sg := segs[i]
		a, b := max(sg.lo, lo), min(sg.hi, hi)
		copy(x[a-lo:b-lo], l.params[sg.param].GradData()[sg.off+a-sg.lo:sg.off+b-sg.lo])
	}
}

// addGrads adds the gradients of elements [lo, lo+len(x)) of bucket k
// into x (step 1: x = pad(g) + worker_error, rounded as the compressed
// allreduce rounds it).
func (l *layout) addGrads(k, lo int, x []float32) {
	hi := lo + len(x)
	segs := l.segs[k]
	for i := l.segsFrom(k, lo); i < len(segs) && segs[i].lo < hi; i++ {
		sg := segs[i]
		a, b := max(sg.lo, lo), min(sg.hi, hi)
		g := l.params[sg.param].GradData()[sg.off+a-sg.lo : sg.off+b-sg.lo]
		xs := x[a-lo : b-lo]
		for j := range xs {
			xs[j] = xs[j] + g[j]
		}
	}
}
