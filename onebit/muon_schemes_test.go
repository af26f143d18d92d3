package onebit_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/lowbit-ml/lowbit/optim"
)

// This file is a measurement harness, not a test: it simulates, in one
// process and float32, the ways of averaging the Muon group's update over W
// ranks that issue 61 weighs against each other (docs/muon.md, "Toward a
// 1-bit Muon without the bias"), on the student network of
// muon_converge_test.go (the Muon group's schemes only; its AdamW group
// exact in every scheme) and on docs/muon.md's fixed-point problem. It runs
// only when asked:
//
//	LOWBIT_MUON_SCHEMES=16 go test -run TestMuonSchemes -v ./onebit/
//	LOWBIT_MUON_SCHEMES=4 LOWBIT_MUON_STEPS=600 LOWBIT_MUON_ONLY=polar-avg,tracked-nonest go test -run TestMuonSchemes -v ./onebit/
//	LOWBIT_MUON_FIXED=1 go test -run TestMuonSchemesFixedPoint -v ./onebit/
//
// The schemes (simNames): exact Muon (the averaged gradient's momentum,
// orthogonalized); polar-avg and polar-1bit, each rank's own momentum
// orthogonalized and the polar factors averaged exactly or through the
// two-phase 1-bit exchange with error feedback (today's 1-bit Muon);
// mom-1bit, 1-bit Adam's recipe (a momentum averaged through the 1-bit
// exchange, then orthogonalized); and the tracked schemes: every rank
// keeps h_r, the estimate of its own momentum that the others have seen,
// and sends C(m_r - h_r) (h_r += it, EF21's rule); each chunk's owner keeps
// the mean of the h_r and sends C(mean - M) to all (M += it), so that every
// rank holds the same estimate M of the ranks' mean momentum and
// orthogonalizes it (Nesterov's term from M's increment, or none:
// "-nonest"). The bytes are the 1-bit exchange's: 2(W-1)/W bits per
// element. "-l1" scales a chunk by its mean absolute value instead of its
// root mean square, "-blk" per 128 elements; "-init" sends the first step
// exactly; "-srv-exact" and "-wkr-exact" leave one phase uncompressed.

// simC compresses x (one chunk) to scale*sign: l1 picks mean|x|, else rms.
func simC(dst, x []float32, l1 bool) {
	var s float64
	for _, v := range x {
		if l1 {
			s += math.Abs(float64(v))
		} else {
			s += float64(v) * float64(v)
		}
	}
	var sc float32
	if l1 {
		sc = float32(s / float64(len(x)))
	} else {
		sc = float32(math.Sqrt(s / float64(len(x))))
	}
	for i, v := range x {
		if v >= 0 {
			dst[i] = sc
		} else {
			dst[i] = -sc
		}
	}
}

const simBlock = 128

// simCB compresses x whole or in blocks of simBlock.
func simCB(dst, x []float32, l1, block bool) {
	if !block {
		simC(dst, x, l1)
		return
	}
	for a := 0; a < len(x); a += simBlock {
		b := min(a+simBlock, len(x))
		simC(dst[a:b], x[a:b], l1)
	}
}

type simScheme int

const (
	sExact simScheme = iota
	sPolarAvg
	sPolarEF
	sTracked
	sTrackedL1
	sMomEF
	sTrackedInit
	sTrackedL1Init
	sTrackedServerExact
	sTrackedWorkerExact
	sTrackedNoNest
	sTrackedBlock
	sTrackedBlockNoNest
	sTrackedBlockL1NoNest
)

var simNames = []string{"exact", "polar-avg", "polar-1bit", "tracked-rms", "tracked-l1", "mom-1bit", "tracked-rms-init", "tracked-l1-init", "tracked-srv-exact", "tracked-wkr-exact", "tracked-nonest", "tracked-blk", "tracked-blk-nonest", "tracked-blk-l1-nonest"}

// simState is the state of every simulated rank of one scheme.
type simState struct {
	w      int
	scheme simScheme
	cfg    optim.MuonConfig
	mom    [][][]float32 // rank, matrix
	h      [][][]float32 // tracked: rank's estimate of own momentum
	hbar   [][]float32   // owner's mean (stored full, chunks owned)
	mhat   [][]float32   // shared estimate
	we     [][][]float32 // worker errors
	se     [][]float32
	orth   []*optim.Orthogonalizer
	t      int
}

// chunks cuts n elements into w chunks, as the exchange does.
func chunks(n, w int) [][2]int {
	var out [][2]int
	c := (n + w - 1) / w
	for k := 0; k < w; k++ {
		a, b := k*c, min((k+1)*c, n)
		if a < b {
			out = append(out, [2]int{a, b})
		}
	}
	return out
}

// efAllreduce averages xs (one per rank) with EF two-phase, returns the output.
func efAllreduce(xs [][]float32, we [][]float32, se []float32, w int) []float32 {
	n := len(xs[0])
	out := make([]float32, n)
	cs := make([][]float32, w)
	tmp := make([]float32, n)
	for r := range w {
		cs[r] = make([]float32, n)
		for _, ch := range chunks(n, w) {
			x := tmp[ch[0]:ch[1]]
			for i := range x {
				x[i] = xs[r][ch[0]+i] + we[r][ch[0]+i]
			}
			simC(cs[r][ch[0]:ch[1]], x, false)
			for i := range x {
				we[r][ch[0]+i] = x[i] - cs[r][ch[0]+i]
			}
		}
	}
	for _, ch := range chunks(n, w) {
		c := tmp[ch[0]:ch[1]]
		for i := range c {
			var s float32
			for r := range w {
				s += cs[r][ch[0]+i] / float32(w)
			}
			c[i] = s + se[ch[0]+i]
		}
		simC(out[ch[0]:ch[1]], c, false)
		for i := range c {
			se[ch[0]+i] = c[i] - out[ch[0]+i]
		}
	}
	return out
}

// step applies one step of s.scheme to the matrices mats of every rank's
// parameters ps, their gradients set.
func (s *simState) step(ps [][]*optim.Param, mats []int, rowsCols [][2]int, lr float32) {
	w, cfg := s.w, s.cfg
	s.t++
	for k, pi := range mats {
		rows, cols := rowsCols[k][0], rowsCols[k][1]
		n := rows * cols
		scale := float32(math.Sqrt(max(1, float64(rows)/float64(cols))))
		upd := make([]float32, n)
		switch s.scheme {
		case sExact:
			g := make([]float32, n)
			for r := range w {
				for i, v := range ps[r][pi].GradData() {
					g[i] += v / float32(w)
				}
			}
			optim.Momentum(s.mom[0][k], g, cfg.Momentum)
			s.orth[k].Orthogonalize(upd, s.mom[0][k], g, rows, cols, cfg, 1)
		case sPolarAvg, sPolarEF:
			xs := make([][]float32, w)
			for r := range w {
				g := ps[r][pi].GradData()
				optim.Momentum(s.mom[r][k], g, cfg.Momentum)
				xs[r] = make([]float32, n)
				s.orth[k].Orthogonalize(xs[r], s.mom[r][k], g, rows, cols, cfg, 1)
			}
			if s.scheme == sPolarAvg {
				for r := range w {
					for i, v := range xs[r] {
						upd[i] += v / float32(w)
					}
				}
			} else {
				u := float32(math.Sqrt(float64(max(rows, cols))))
				for r := range w {
					for i := range xs[r] {
						xs[r][i] *= u
					}
				}
				o := efAllreduce(xs, s.we[k], s.se[k], w)
				for i := range o {
					upd[i] = o[i] / u
				}
			}
		case sMomEF:
			// 1-bit Adam recipe: m_r = beta m_shared + (1-beta) g_r; shared = allreduce; NS
			xs := make([][]float32, w)
			for r := range w {
				xs[r] = append([]float32(nil), s.mom[0][k]...)
				optim.Momentum(xs[r], ps[r][pi].GradData(), cfg.Momentum)
			}
			old := append([]float32(nil), s.mom[0][k]...)
			o := efAllreduce(xs, s.we[k], s.se[k], w)
			copy(s.mom[0][k], o)
			nes := make([]float32, n)
			for i := range nes {
				nes[i] = o[i] + cfg.Momentum*(o[i]-old[i])
			}
			c := cfg
			c.Nesterov = false
			s.orth[k].Orthogonalize(upd, nes, nil, rows, cols, c, 1)
		default: // tracked
			l1 := s.scheme == sTrackedL1 || s.scheme == sTrackedL1Init || s.scheme == sTrackedBlockL1NoNest
			block := s.scheme == sTrackedBlock || s.scheme == sTrackedBlockNoNest || s.scheme == sTrackedBlockL1NoNest
			nonest := s.scheme == sTrackedNoNest || s.scheme == sTrackedBlockNoNest || s.scheme == sTrackedBlockL1NoNest
			initExact := (s.scheme == sTrackedInit || s.scheme == sTrackedL1Init) && s.t == 1
			cs := make([][]float32, w)
			for r := range w {
				g := ps[r][pi].GradData()
				optim.Momentum(s.mom[r][k], g, cfg.Momentum)
				cs[r] = make([]float32, n)
				d := make([]float32, n)
				for i := range d {
					d[i] = s.mom[r][k][i] - s.h[r][k][i]
				}
				if initExact || s.scheme == sTrackedWorkerExact {
					copy(cs[r], d)
				} else {
					for _, ch := range chunks(n, w) {
						simCB(cs[r][ch[0]:ch[1]], d[ch[0]:ch[1]], l1, block)
					}
				}
				for i := range d {
					s.h[r][k][i] += cs[r][i]
				}
			}
			y := make([]float32, n)
			for i := range y {
				var a float32
				for r := range w {
					a += cs[r][i] / float32(w)
				}
				s.hbar[k][i] += a
				y[i] = s.hbar[k][i] - s.mhat[k][i]
			}
			sv := make([]float32, n)
			if initExact || s.scheme == sTrackedServerExact {
				copy(sv, y)
			} else {
				for _, ch := range chunks(n, w) {
					simCB(sv[ch[0]:ch[1]], y[ch[0]:ch[1]], l1, block)
				}
			}
			nes := make([]float32, n)
			for i := range sv {
				s.mhat[k][i] += sv[i]
				nes[i] = s.mhat[k][i] + cfg.Momentum*sv[i]
				if nonest {
					nes[i] = s.mhat[k][i]
				}
			}
			c := cfg
			c.Nesterov = false
			s.orth[k].Orthogonalize(upd, nes, nil, rows, cols, c, 1)
		}
		decay := float32(1 - float64(lr)*float64(cfg.WeightDecay))
		st := lr * scale
		for r := range w {
			p := ps[r][pi].Data()
			for i := range p {
				p[i] = p[i]*decay - st*upd[i]
			}
		}
	}
}

// newSim returns the state of scheme on w ranks for matrices of shapes.
func newSim(w int, scheme simScheme, shapes [][2]int) *simState {
	s := &simState{w: w, scheme: scheme, cfg: optim.DefaultMuonConfig()}
	s.mom = make([][][]float32, w)
	s.h = make([][][]float32, w)
	s.we = make([][][]float32, len(shapes))
	for r := range w {
		for _, sh := range shapes {
			s.mom[r] = append(s.mom[r], make([]float32, sh[0]*sh[1]))
			s.h[r] = append(s.h[r], make([]float32, sh[0]*sh[1]))
		}
	}
	for k, sh := range shapes {
		n := sh[0] * sh[1]
		s.hbar = append(s.hbar, make([]float32, n))
		s.mhat = append(s.mhat, make([]float32, n))
		s.se = append(s.se, make([]float32, n))
		for range w {
			s.we[k] = append(s.we[k], make([]float32, n))
		}
		s.orth = append(s.orth, optim.NewOrthogonalizer(sh[0], sh[1]))
	}
	return s
}

// TestMuonSchemes prints the student network's held-out loss under every
// scheme against exact Muon's, three data seeds.
func TestMuonSchemes(t *testing.T) {
	w, _ := strconv.Atoi(os.Getenv("LOWBIT_MUON_SCHEMES"))
	if w == 0 {
		t.Skip("a measurement harness: set LOWBIT_MUON_SCHEMES to the number of ranks to run it")
	}
	steps := 600
	if v, _ := strconv.Atoi(os.Getenv("LOWBIT_MUON_STEPS")); v > 0 {
		steps = v
	}
	for _, seed := range []uint64{0, 1, 2} {
		res := map[simScheme]float64{}
		for sc := range simScheme(len(simNames)) {
			if only := os.Getenv("LOWBIT_MUON_ONLY"); only != "" && sc != sExact && !strings.Contains(","+only+",", ","+simNames[sc]+",") {
				continue
			}
			task := newMLPTask()
			task.seed = seed
			ps := make([][]*optim.Param, w)
			for r := range w {
				ps[r] = mlpParams()
			}
			shapes := [][2]int{{mlpHidden, mlpIn}, {mlpOut, mlpHidden}}
			s := newSim(w, sc, shapes)
			ms, _ := optim.CosineDecay(0.02, 0.0002, int64(steps))
			as, _ := optim.CosineDecay(3e-3, 3e-5, int64(steps))
			// exact AdamW on biases (1,3)
			am := [][]float32{make([]float32, mlpHidden), make([]float32, mlpOut)}
			av := [][]float32{make([]float32, mlpHidden), make([]float32, mlpOut)}
			cfg := optim.DefaultMuonConfig()
			for st := 1; st <= steps; st++ {
				for r := range w {
					task.grad(ps[r], r, st)
				}
				s.step(ps, []int{0, 2}, shapes, ms.LR(int64(st)))
				c1, c2 := optim.BiasCorrection(cfg.AdamBeta1, int64(st)), optim.BiasCorrection(cfg.AdamBeta2, int64(st))
				for j, pi := range []int{1, 3} {
					g := make([]float32, ps[0][pi].Numel())
					for r := range w {
						for i, v := range ps[r][pi].GradData() {
							g[i] += v / float32(w)
						}
					}
					pm, pv := append([]float32(nil), am[j]...), append([]float32(nil), av[j]...)
					for r := range w {
						copy(am[j], pm)
						copy(av[j], pv)
						optim.AdamStep(ps[r][pi].Data(), am[j], av[j], g, cfg.AdamBeta1, cfg.AdamBeta2, as.LR(int64(st)), cfg.AdamWeightDecay, c1, c2, cfg.AdamEps)
					}
				}
			}
			res[sc] = task.loss(ps[0])
		}
		line := fmt.Sprintf("W=%d seed=%d exact %.4f", w, seed, res[sExact])
		for sc := simScheme(1); sc < simScheme(len(simNames)); sc++ {
			if _, ok := res[sc]; !ok {
				continue
			}
			line += fmt.Sprintf(" | %s %+.1f%%", simNames[sc], 100*(res[sc]/res[sExact]-1))
		}
		t.Log(line)
	}
}

// TestMuonSchemesFixedPoint runs docs/muon.md's fixed-point problem: a
// 16x32 matrix on 4 ranks, rank r's gradient w - target_r; the distance
// from the mean of the targets after 200 steps.
func TestMuonSchemesFixedPoint(t *testing.T) {
	if os.Getenv("LOWBIT_MUON_FIXED") == "" {
		t.Skip("a measurement harness: set LOWBIT_MUON_FIXED=1 to run it")
	}
	const w, rows, cols, steps = 4, 16, 32, 200
	rng := rand.New(rand.NewPCG(7, 8))
	targets := make([][]float32, w)
	fit := make([]float32, rows*cols)
	for r := range w {
		targets[r] = mlpInit(rng, rows*cols, 1)
		for i, v := range targets[r] {
			fit[i] += v / w
		}
	}
	for _, sc := range []simScheme{sExact, sPolarAvg, sTracked, sTrackedL1, sTrackedBlockL1NoNest, sTrackedBlock} {
		ps := make([][]*optim.Param, w)
		for r := range w {
			ps[r] = []*optim.Param{optim.NewParam("w", rows, cols)}
		}
		s := newSim(w, sc, [][2]int{{rows, cols}})
		ms, _ := optim.CosineDecay(0.3, 0.003, steps)
		for st := 1; st <= steps; st++ {
			for r := range w {
				g, p := ps[r][0].GradData(), ps[r][0].Data()
				for i := range g {
					g[i] = p[i] - targets[r][i]
				}
			}
			s.step(ps, []int{0}, [][2]int{{rows, cols}}, ms.LR(int64(st)))
		}
		var d float64
		for i, v := range ps[0][0].Data() {
			d += float64(v-fit[i]) * float64(v-fit[i])
		}
		t.Logf("%s: distance from the fit %.4g", simNames[sc], math.Sqrt(d))
	}
}
