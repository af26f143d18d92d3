package outer_test

// A float64 reference of the outer optimizer, written from the design
// (docs/outer.md) and the 1-bit allreduce's spec, sharing no code with
// the implementation: W ranks, inner AdamW per rank, the fragment
// schedule, the delayed merge, the fp32 average, the 1-bit momentum
// compression with error feedback on both sides, and the sparse codec's
// accumulators, top-k selection and 1- or 2-bit values.

import (
	"context"
	"fmt"
	"math"
	"sort"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

type refConfig struct {
	W, H, F, D  int
	oneBit      bool
	meanAbs     bool // the 1-bit codec's scales (Config.Scale)
	lr, mu      float64
	nesterov    bool
	alr, b1, b2 float64 // inner Adam
	eps, wd     float64
	n           int
	// The sparse codec: chunk length, share sent, value bits, decay.
	sparse         bool
	chunk, vbits   int
	density, decay float64
	twoPhase       bool    // outer.SparseTwoPhase
	density2       float64 // its second phase's density
	shared         bool    // outer.SparseShared or SparseVoted
	voted          bool    // outer.SparseVoted
}

type refSim struct {
	c           refConfig
	local, m, v [][]float64
	g, u        []float64
	we, se      [][][]float64 // [rank][fragment]
	pending     int
	launched    int
	snap        [][]float64 // [rank] θ_local of the pending fragment at launch
	acc         [][]float64 // [rank] the sparse codec's accumulator
	srv         []float64   // the two-phase exchange's server accumulators, flat
	t           int
}

func newRef(c refConfig, init []float32) *refSim {
	s := &refSim{c: c, pending: -1}
	s.g = make([]float64, c.n)
	for i, x := range init {
		s.g[i] = float64(x)
	}
	s.u = make([]float64, c.n)
	s.srv = make([]float64, c.n)
	for range c.W {
		s.local = append(s.local, append([]float64(nil), s.g...))
		s.m = append(s.m, make([]float64, c.n))
		s.v = append(s.v, make([]float64, c.n))
		s.snap = append(s.snap, nil)
		s.acc = append(s.acc, make([]float64, c.n))
		we, se := make([][]float64, c.F), make([][]float64, c.F)
		for f := range c.F {
			lo, hi := s.frag(f)
			N := refPadded(hi-lo, c.W)
			we[f], se[f] = make([]float64, N), make([]float64, N/c.W)
		}
		s.we, s.se = append(s.we, we), append(s.se, se)
	}
	return s
}

func (s *refSim) frag(f int) (lo, hi int) { return f * s.c.n / s.c.F, (f + 1) * s.c.n / s.c.F }

// launches returns the fragment launched at call t, or -1.
func (s *refSim) launches(t int) int {
	for f := range s.c.F {
		if t%s.c.H == f*s.c.H/s.c.F {
			return f
		}
	}
	return -1
}

func refPadded(n, w int) int {
	l := w
	for l%8 != 0 {
		l += w
	}
	m := w * l
	return (n + m - 1) / m * m
}

func refSign(x float64) float64 {
	if x >= 0 || math.IsNaN(x) {
		return 1
	}
	return -1
}

// refScale is a 1-bit scale of x: its root mean square, or with meanAbs
// (onebit.ScaleMeanAbs) the mean of |x|.
func refScale(x []float64, meanAbs bool) float64 {
	s := 0.0
	for _, v := range x {
		if meanAbs {
			s += math.Abs(v)
		} else {
			s += v * v
		}
	}
	if meanAbs {
		return s / float64(len(x))
	}
	return math.Sqrt(s / float64(len(x)))
}

// compress is the 1-bit allreduce of the W inputs xs (one per rank) of
// fragment f, with error feedback: the output, the same on every rank.
func (s *refSim) compress(f int, xs [][]float64) []float64 {
	W, m := s.c.W, len(xs[0])
	N := refPadded(m, W)
	C := N / W
	signs := make([][]float64, W)
	scales := make([]float64, W)
	for r := range W {
		x := make([]float64, N)
		copy(x, xs[r])
		for i := range x {
			x[i] += s.we[r][f][i]
		}
		scales[r] = refScale(x, s.c.meanAbs)
		signs[r] = make([]float64, N)
		for i := range x {
			signs[r][i] = refSign(x[i])
			s.we[r][f][i] = x[i] - scales[r]*signs[r][i]
		}
	}
	out := make([]float64, N)
	for r := range W { // server r, chunk r
		c := make([]float64, C)
		for j := range W {
			for i := range c {
				c[i] += scales[j] / float64(W) * signs[j][r*C+i]
			}
		}
		for i := range c {
			c[i] += s.se[r][f][i]
		}
		sc := refScale(c, s.c.meanAbs)
		for i := range c {
			out[r*C+i] = sc * refSign(c[i])
			s.se[r][f][i] = c[i] - out[r*C+i]
		}
	}
	return out[:m]
}

// sparse is the sparse codec's exchange of the pseudo-gradients deltas
// (one per rank) of the fragment at lo: each rank's accumulator decays and
// takes its delta, each chunk sends its top k entries (refSelect), and the
// result is the mean over the ranks of what they sent. With the two-phase
// exchange that mean plus the decayed server accumulator (one per
// element: each element has one owner, whichever rank it is) is selected
// again, chunk by chunk, the server accumulator keeps the rest, and the result is what
// the second selection sent.
func (s *refSim) sparse(lo int, deltas [][]float64) []float64 {
	c := s.c
	m := len(deltas[0])
	if c.shared {
		return s.sparseShared(lo, deltas)
	}
	avg := make([]float64, m)
	for r := range c.W {
		e := s.acc[r][lo : lo+m]
		for i := range e {
			e[i] = c.decay*e[i] + deltas[r][i]
		}
		for a := 0; a < m; a += c.chunk {
			b := min(a+c.chunk, m)
			for i, v := range s.refSelect(e[a:b], c.density) {
				avg[a+i] += v / float64(c.W)
			}
		}
	}
	if !c.twoPhase {
		return avg
	}
	x := s.srv[lo : lo+m]
	out := make([]float64, m)
	for i := range x {
		x[i] = c.decay*x[i] + avg[i]
	}
	for a := 0; a < m; a += c.chunk {
		b := min(a+c.chunk, m)
		copy(out[a:b], s.refSelect(x[a:b], c.density2))
	}
	return out
}

// sparseShared is sparse with outer.SparseShared: every rank's
// accumulator takes its delta; per chunk (owned by rank a/span, span
// ceil(chunks/W) chunks) the owner's top k offsets (ties: the lower) are
// where every rank sends sign times the mean magnitude there (1 bit) or
// the means below and at or above it (2 bits), subtracting it from its
// accumulator; the mean over the ranks plus the owner's server
// accumulator is sent in int8 (scale max/127, codes rounded half to
// even), and the server accumulator keeps the rounding.
func (s *refSim) sparseShared(lo int, deltas [][]float64) []float64 {
	c := s.c
	m := len(deltas[0])
	for r := range c.W {
		e := s.acc[r][lo : lo+m]
		for i := range e {
			e[i] = c.decay*e[i] + deltas[r][i]
		}
	}
	chunks := (m + c.chunk - 1) / c.chunk
	span := (chunks + c.W - 1) / c.W * c.chunk
	out := make([]float64, m)
	for a := 0; a < m; a += c.chunk {
		b := min(a+c.chunk, m)
		owner := a / span
		idx := refTopK(s.acc[owner][lo+a:lo+b], c.density)
		if c.voted {
			// The offsets most ranks' own top k name, ties to the
			// owner's larger magnitude (under half a vote), then the
			// lower offset.
			score := make([]float64, b-a)
			for r := range c.W {
				for _, i := range refTopK(s.acc[r][lo+a:lo+b], c.density) {
					score[i]++
				}
			}
			e := s.acc[owner][lo+a : lo+b]
			amax := 0.0
			for _, v := range e {
				amax = max(amax, math.Abs(v))
			}
			for i, v := range e {
				if amax > 0 {
					score[i] += math.Abs(v) / (2 * amax)
				}
			}
			idx = refTopK(score, c.density)
		}
		avg := make([]float64, len(idx))
		for r := range c.W {
			e := s.acc[r][lo+a : lo+b]
			for j, v := range s.refValues(e, idx) {
				avg[j] += v / float64(c.W)
			}
		}
		x := s.srv[lo+a : lo+b]
		amax := 0.0
		for j, i := range idx {
			avg[j] += x[i]
			amax = max(amax, math.Abs(avg[j]))
		}
		for j, i := range idx {
			q := 0.0
			if amax > 0 {
				q = math.RoundToEven(avg[j] * 127 / amax)
			}
			out[a+i] = q * amax / 127
			x[i] = avg[j] - out[a+i]
		}
	}
	return out
}

// refTopK returns the offsets of the k entries of e of largest magnitude
// (k the density's share of its length; ties: the lower offset),
// ascending.
func refTopK(e []float64, density float64) []int {
	idx := refLargest(e, density)
	sort.Ints(idx)
	return idx
}

// refLargest returns the offsets of the k entries of e of largest
// magnitude (k the density's share of its length), largest first (ties:
// the lower offset first).
func refLargest(e []float64, density float64) []int {
	l := len(e)
	k := max(1, min(l, int(math.Round(density*float64(l)))))
	idx := make([]int, l)
	for i := range idx {
		idx[i] = i
	}
	sort.SliceStable(idx, func(x, y int) bool { return math.Abs(e[idx[x]]) > math.Abs(e[idx[y]]) })
	return idx[:k]
}

// refValues returns what a chunk e sends at offsets idx (summed in that
// order): sign times the mean magnitude sent (1 bit) or the mean of those
// below or at and above it (2 bits), subtracting it from e.
func (s *refSim) refValues(e []float64, idx []int) []float64 {
	mean := 0.0
	for _, i := range idx {
		mean += math.Abs(e[i])
	}
	mean /= float64(len(idx))
	lo, hi := mean, mean
	if s.c.vbits == 2 {
		var sl, sh float64
		var nl, nh int
		for _, i := range idx {
			if math.Abs(e[i]) >= mean {
				sh, nh = sh+math.Abs(e[i]), nh+1
			} else {
				sl, nl = sl+math.Abs(e[i]), nl+1
			}
		}
		hi, lo = sh/float64(nh), sh/float64(nh)
		if nl > 0 {
			lo = sl / float64(nl)
		}
	}
	sent := make([]float64, len(idx))
	for j, i := range idx {
		v := lo
		if s.c.vbits == 2 && math.Abs(e[i]) >= mean {
			v = hi
		}
		if e[i] < 0 {
			v = -v
		}
		e[i] -= v
		sent[j] = v
	}
	return sent
}

// refSelect returns what a chunk e sends, its top k entries by magnitude
// (k the density's share of its length; ties: the lower offset) encoded
// as refValues's, zero elsewhere, and subtracts it from e.
func (s *refSim) refSelect(e []float64, density float64) []float64 {
	idx := refLargest(e, density)
	sent := make([]float64, len(e))
	for j, v := range s.refValues(e, idx) {
		sent[idx[j]] = v
	}
	return sent
}

// step runs call t: every rank's inner step on grad(r, t, ·), then the
// merge and the launch that are due.
func (s *refSim) step() {
	s.t++
	t, c := s.t, s.c
	for r := range c.W {
		c1 := 1 - math.Pow(float64(float32(c.b1)), float64(t))
		c2 := 1 - math.Pow(float64(float32(c.b2)), float64(t))
		for i := range s.local[r] {
			g := float64(grad(r, t, i))
			s.m[r][i] = c.b1*s.m[r][i] + (1-c.b1)*g
			s.v[r][i] = c.b2*s.v[r][i] + (1-c.b2)*g*g
			upd := (s.m[r][i]/c1)/(math.Sqrt(s.v[r][i]/c2)+c.eps) + c.wd*s.local[r][i]
			s.local[r][i] -= c.alr * upd
		}
	}
	if s.pending >= 0 && t == s.launched+c.D {
		lo, hi := s.frag(s.pending)
		for r := range c.W {
			for i := lo; i < hi; i++ {
				s.local[r][i] = s.g[i] + (s.local[r][i] - s.snap[r][i-lo])
			}
		}
		s.pending = -1
	}
	f := s.launches(t)
	if f < 0 {
		return
	}
	lo, hi := s.frag(f)
	deltas := make([][]float64, c.W)
	for r := range c.W {
		deltas[r] = make([]float64, hi-lo)
		for i := lo; i < hi; i++ {
			deltas[r][i-lo] = s.g[i] - s.local[r][i]
		}
		s.snap[r] = append([]float64(nil), s.local[r][lo:hi]...)
	}
	if c.oneBit {
		xs := make([][]float64, c.W)
		for r := range c.W {
			xs[r] = make([]float64, hi-lo)
			for i := range xs[r] {
				xs[r][i] = c.mu*s.u[lo+i] + deltas[r][i]
			}
		}
		ub := xs[0]
		if c.W > 1 {
			ub = s.compress(f, xs)
		}
		for i := lo; i < hi; i++ {
			step := ub[i-lo]
			if c.nesterov {
				step = (ub[i-lo] - c.mu*s.u[i]) + c.mu*ub[i-lo]
			}
			s.g[i] -= c.lr * step
			s.u[i] = ub[i-lo]
		}
	} else {
		var avg []float64
		if c.sparse && c.W > 1 {
			avg = s.sparse(lo, deltas)
		}
		for i := lo; i < hi; i++ {
			d := 0.0
			for r := range c.W {
				d += deltas[r][i-lo]
			}
			d /= float64(c.W)
			if avg != nil {
				d = avg[i-lo]
			}
			s.u[i] = c.mu*s.u[i] + d
			step := s.u[i]
			if c.nesterov {
				step = d + c.mu*s.u[i]
			}
			s.g[i] -= c.lr * step
		}
	}
	if c.D == 0 {
		for r := range c.W {
			copy(s.local[r][lo:hi], s.g[lo:hi])
		}
		return
	}
	s.pending, s.launched = f, t
}

// inFlight says whether an exchange is in flight after call t.
func (s *refSim) inFlight() bool { return s.pending >= 0 }

func TestReference(t *testing.T) {
	for _, w := range []int{2, 3, 4} {
		for _, k := range []struct {
			codec   outer.Codec
			h, f, d int
			scale   onebit.Scale
		}{
			{outer.CodecFP32, 4, 1, 0, 0},
			{outer.CodecFP32, 6, 3, 2, 0},
			{outer.CodecOneBit, 4, 1, 0, onebit.ScaleRMS},
			{outer.CodecOneBit, 6, 2, 3, onebit.ScaleRMS},
			{outer.CodecOneBit, 4, 1, 0, onebit.ScaleMeanAbs},
			{outer.CodecOneBit, 6, 2, 3, onebit.ScaleMeanAbs},
			{outer.CodecBF16, 4, 2, 1, 0},
			{outer.CodecInt8, 4, 2, 1, 0},
			{outer.CodecSparse, 4, 1, 0, 1},
			{outer.CodecSparse, 6, 3, 2, 1},
			{outer.CodecSparse, 4, 1, 0, 2},
			{outer.CodecSparse, 6, 2, 3, 2},
		} {
			// (For CodecSparse, scale is the value bits.)
			// The sparse codec: each exchange, and the two-phase one with
			// a second phase of its own density (3 of each chunk of 5).
			xs := []outer.Config{{}}
			if k.codec == outer.CodecSparse {
				xs = append(xs, outer.Config{SparseExchange: outer.SparseTwoPhase}, outer.Config{SparseExchange: outer.SparseTwoPhase, SparseServerDensity: 0.6},
					outer.Config{SparseExchange: outer.SparseShared}, outer.Config{SparseExchange: outer.SparseVoted})
			}
			for _, x := range xs {
				t.Run(fmt.Sprintf("W%d/%s/H%d/F%d/D%d/scale%d/%s/%g", w, k.codec, k.h, k.f, k.d, k.scale, x.SparseExchange, x.SparseServerDensity), func(t *testing.T) {
					checkReference(t, w, k.codec, k.h, k.f, k.d, k.scale, x)
				})
			}
		}
	}
}

func checkReference(t *testing.T, w int, codec outer.Codec, h, frags, delay int, scale onebit.Scale, x outer.Config) {
	const calls = 20
	cfg := outer.DefaultConfig()
	cfg.H, cfg.Fragments, cfg.Delay, cfg.Codec, cfg.Scale = h, frags, delay, codec, scale
	if codec == outer.CodecSparse {
		// 2 of each chunk of 5 (the last one of a fragment shorter),
		// momentum as DiLoCo's (the sparse codec does not need it, the
		// reference checks it goes through).
		cfg.Scale, cfg.SparseBits = onebit.ScaleRMS, int(scale)
		cfg.SparseChunk, cfg.Density, cfg.Decay = 5, 0.4, 0.9
		cfg.SparseExchange, cfg.SparseServerDensity = x.SparseExchange, x.SparseServerDensity
	}
	acfg := optim.DefaultAdamConfig()
	acfg.LR, acfg.WeightDecay = 0.01, 0.1
	n := 0
	for _, s := range sizes {
		n += s
	}
	rc := refConfig{W: w, H: h, F: frags, D: delay, oneBit: codec == outer.CodecOneBit, meanAbs: scale == onebit.ScaleMeanAbs, lr: float64(cfg.LR), mu: float64(cfg.Momentum),
		nesterov: cfg.Nesterov, alr: float64(acfg.LR), b1: float64(acfg.Beta1), b2: float64(acfg.Beta2), eps: float64(acfg.Eps), wd: float64(acfg.WeightDecay), n: n,
		sparse: codec == outer.CodecSparse, chunk: cfg.SparseChunk, vbits: cfg.SparseBits, density: float64(cfg.Density), decay: float64(cfg.Decay),
		twoPhase: cfg.SparseExchange == outer.SparseTwoPhase, density2: float64(cfg.Density), shared: cfg.SparseExchange == outer.SparseShared || cfg.SparseExchange == outer.SparseVoted,
		voted: cfg.SparseExchange == outer.SparseVoted}
	if cfg.SparseServerDensity != 0 {
		rc.density2 = float64(cfg.SparseServerDensity)
	}
	ref := newRef(rc, flat(newParams(t, sizes)))
	// Real runs: every rank's parameters after every call, and θ_g and u
	// after the calls with no exchange in flight.
	locals := newPerRank[[][]float32](w)
	globals, moms := newPerRank[[][]float32](w), newPerRank[[][]float32](w)
	flights := make([]bool, calls+1)
	{
		s := newRef(rc, flat(newParams(t, sizes)))
		for i := 1; i <= calls; i++ {
			s.t++ // schedule only
			if s.pending >= 0 && s.t == s.launched+delay {
				s.pending = -1
			}
			if f := s.launches(s.t); f >= 0 && delay > 0 {
				s.pending, s.launched = f, s.t
			}
			flights[i] = s.inFlight()
		}
	}
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, err := outer.NewAdam(ctx, c, ps, cfg, acfg)
		if err != nil {
			return err
		}
		defer o.Close()
		var ls, gs, us [][]float32
		for i := 1; i <= calls; i++ {
			setGrads(ps, c.Rank(), i)
			if err := o.Step(ctx); err != nil {
				return err
			}
			ls = append(ls, flat(ps))
			if flights[i] {
				gs, us = append(gs, nil), append(us, nil)
				continue
			}
			gs = append(gs, append([]float32(nil), o.Global()...))
			us = append(us, append([]float32(nil), o.Momentum()...))
		}
		locals.set(c.Rank(), ls)
		globals.set(c.Rank(), gs)
		moms.set(c.Rank(), us)
		return nil
	})
	// fp32 and 1bit: float32 rounding only. bf16 and int8 round the
	// pseudo-gradients (the reference averages them exactly): a looser
	// bound, which a wrong formula still exceeds by far.
	tol := 2e-4
	if codec == outer.CodecBF16 || codec == outer.CodecInt8 {
		tol = 3e-3
	}
	for i := 1; i <= calls; i++ {
		ref.step()
		for r := range w {
			requireClose(t, ref.local[r], locals.v[r][i-1], tol, "call %d rank %d parameters", i, r)
			if !flights[i] {
				requireClose(t, ref.g, globals.v[r][i-1], tol, "call %d rank %d θ_g", i, r)
				requireClose(t, ref.u, moms.v[r][i-1], tol, "call %d rank %d u", i, r)
				require.Equal(t, globals.v[0][i-1], globals.v[r][i-1], "call %d: θ_g of rank %d differs from rank 0's", i, r)
			}
		}
	}
}

func requireClose(t *testing.T, want []float64, got []float32, tol float64, format string, args ...any) {
	t.Helper()
	require.Len(t, got, len(want))
	for i := range want {
		if d := math.Abs(want[i] - float64(got[i])); !(d <= tol*(1+math.Abs(want[i]))) {
			require.Failf(t, "mismatch", format+": element %d: reference %v, got %v", append(args, i, want[i], got[i])...)
		}
	}
}
