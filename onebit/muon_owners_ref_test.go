package onebit_test

// The reference of ExchangeOwners for TestMuonMatchesFloat64Reference:
// written again in float64 from onebit.ExchangeOwners' documentation and
// docs/muon.md ("The owners' exchange"), sharing no code with package
// onebit. Its constants are the wire format's: chunks of 1024 elements,
// each rotated by random signs from SplitMix64 and the orthonormal
// Walsh-Hadamard transform on its power-of-two pieces, then sent as its
// root mean square and its signs.

import (
	"math"
	"slices"

	"github.com/lowbit-ml/lowbit/internal/muonref"
	"github.com/lowbit-ml/lowbit/optim"
)

const refOwnerChunk = 1024

// refOwners is ExchangeOwners' state: per rank and matrix the tracking
// estimate h of the rank's momentum, per matrix the owner's mean
// estimate and error feedback, and the owners.
type refOwners struct {
	mats  []int         // the Muon group's parameter indices
	owner []int         // per entry of mats
	trk   [][][]float64 // [rank][param]
	mean  [][]float64   // [param]
	fb    [][]float64   // [param]
}

func newRefOwners(r *refMuon1, ps []*optim.Param) *refOwners {
	o := &refOwners{trk: make([][][]float64, r.w), mean: make([][]float64, len(ps)), fb: make([][]float64, len(ps))}
	var sizes []int
	for i, p := range ps {
		if r.isMuon[i] {
			o.mats, sizes = append(o.mats, i), append(sizes, p.Numel())
			o.mean[i], o.fb[i] = make([]float64, p.Numel()), make([]float64, p.Numel())
		}
	}
	// The largest matrix first, each to the least loaded rank.
	load := make([]int, r.w)
	o.owner = make([]int, len(sizes))
	order := make([]int, len(sizes))
	for k := range order {
		order[k] = k
	}
	slices.SortStableFunc(order, func(a, b int) int { return sizes[b] - sizes[a] })
	for _, k := range order {
		j := slices.Index(load, slices.Min(load))
		o.owner[k], load[j] = j, load[j]+sizes[k]
	}
	for rk := range r.w {
		o.trk[rk] = make([][]float64, len(ps))
		for _, i := range o.mats {
			o.trk[rk][i] = make([]float64, ps[i].Numel())
		}
	}
	return o
}

// refSplitMix is SplitMix64's step.
func refSplitMix(s uint64) (uint64, uint64) {
	s += 0x9e3779b97f4a7c15
	z := s
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return s, z ^ z>>31
}

// refRotationSeed is the seed of matrix k's message in phase ph (1 from
// rank rk, 2 from the owner, rk 0) at step t.
func refRotationSeed(t int, ph, k, rk int) uint64 {
	return uint64(t)<<24 ^ uint64(ph)<<20 ^ uint64(k)<<10 ^ uint64(rk) ^ 0x6f776e657273
}

// refFlip multiplies x by chunk j's random signs of seed.
func refFlip(x []float64, seed uint64, j int) {
	s, _ := refSplitMix(seed + uint64(j))
	for a := 0; a < len(x); a += 64 {
		var bits uint64
		s, bits = refSplitMix(s)
		for i := a; i < min(a+64, len(x)); i++ {
			if bits>>(i-a)&1 == 1 {
				x[i] = -x[i]
			}
		}
	}
}

// refHadamard is the orthonormal Walsh-Hadamard transform of x's pieces,
// the largest power of two first, by its definition: H[a][b] =
// (-1)^popcount(a&b) / sqrt(n).
func refHadamard(x []float64) {
	for len(x) > 0 {
		n := 1
		for n*2 <= len(x) {
			n *= 2
		}
		y := make([]float64, n)
		for a := range n {
			for b := range n {
				v := x[b]
				if popcount(a&b)%2 == 1 {
					v = -v
				}
				y[a] += v
			}
		}
		for a := range n {
			x[a] = y[a] / math.Sqrt(float64(n))
		}
		x = x[n:]
	}
}

func popcount(v int) int {
	c := 0
	for ; v != 0; v &= v - 1 {
		c++
	}
	return c
}

// refCompress is what a message of x carries, decoded: per chunk its root
// mean square s times the signs of the rotated chunk, rotated back; at two
// bits Lloyd-Max's levels for a unit normal instead, 0.4528*s where the
// rotated value's absolute value is under 0.9816*s, 1.510*s elsewhere.
func refCompress(x []float64, seed uint64, bits int) []float64 {
	out := make([]float64, len(x))
	for j := 0; j*refOwnerChunk < len(x); j++ {
		ch := slices.Clone(x[j*refOwnerChunk : min((j+1)*refOwnerChunk, len(x))])
		ss := 0.0
		for _, v := range ch {
			ss += v * v
		}
		sc := math.Sqrt(ss / float64(len(ch)))
		refFlip(ch, seed, j)
		refHadamard(ch)
		for i, v := range ch {
			level := sc
			if bits == 2 {
				level = float64(float32(0.4528)) * sc
				if math.Abs(v) >= float64(float32(0.9816))*sc {
					level = float64(float32(1.510)) * sc
				}
			}
			ch[i] = level
			if v < 0 {
				ch[i] = -level
			}
		}
		refHadamard(ch)
		refFlip(ch, seed, j)
		copy(out[j*refOwnerChunk:], ch)
	}
	return out
}

// step is the Muon group's step t: every rank's momentum, C(m - h) to the
// owner (h += it), the owner's mean estimate, orthogonalized with
// Nesterov's term from its increment, C(lr*scale*update + e) to every
// rank (e keeps the rest), each rank descending by it.
func (o *refOwners) step(r *refMuon1, g [][][]float64) {
	c := r.cfg
	lr, wd, mu := float64(c.LR), float64(c.WeightDecay), float64(c.Momentum)
	coef := [3]float64{float64(c.NSCoefficients[0]), float64(c.NSCoefficients[1]), float64(c.NSCoefficients[2])}
	for k, i := range o.mats {
		n := len(r.p[0][i])
		inc := make([]float64, n)
		for rk := range r.w {
			m, h := r.m[rk][i], o.trk[rk][i]
			d := make([]float64, n)
			for e := range m {
				m[e] = mu*m[e] + (1-mu)*g[rk][i][e]
				d[e] = m[e] - h[e]
			}
			sent := refCompress(d, refRotationSeed(r.t, 1, k, rk), max(c.OwnerBits, 1))
			for e := range h {
				h[e] += sent[e]
				inc[e] += sent[e] / float64(r.w)
			}
		}
		u := make([]float64, n)
		for e := range u {
			o.mean[i][e] += inc[e]
			u[e] = o.mean[i][e]
			if c.Nesterov {
				u[e] += mu * inc[e]
			}
		}
		rows, cols := refView(r.shapes[i])
		x := muonref.Orthogonalize(u, rows, cols, coef, c.NSSteps, float64(c.NSEps))
		scale := math.Sqrt(max(1, float64(rows)/float64(cols)))
		d := make([]float64, n)
		for e := range d {
			d[e] = lr*scale*x[e] + o.fb[i][e]
		}
		sent := refCompress(d, refRotationSeed(r.t, 2, k, 0), 1)
		for e := range d {
			o.fb[i][e] = d[e] - sent[e]
		}
		for rk := range r.w {
			p := r.p[rk][i]
			for e := range p {
				p[e] = p[e]*(1-lr*wd) - sent[e]
			}
		}
	}
}

// sync is the end of an exact warm-up: every estimate the momentum, the
// same on every rank.
func (o *refOwners) sync(r *refMuon1) {
	for _, i := range o.mats {
		for rk := range r.w {
			copy(o.trk[rk][i], r.m[rk][i])
		}
		copy(o.mean[i], r.m[0][i])
		clear(o.fb[i])
	}
}
