package onebit_test

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/lowbit-ml/lowbit/onebit"
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
//
// The configured schemes (simVars, issue 61's second round) follow; simVar
// documents their fields. "trk-…" is tracking with chunk owners as above;
// "own-…" has whole-matrix owners: the owner of a matrix keeps the exact
// mean of what the ranks sent (EF21 tracking of their momenta, or
// "-gradef", C(g_r + e_r) with error feedback into a momentum the owner
// keeps), orthogonalizes it with no second compression before
// Newton-Schulz (EF21-Muon's order), and sends the new model compressed:
// "-efupd" C(lr·update + e) with error feedback at the owner, "-ef21p" the
// owner's exact model X as C(X − W) (EF21-P), "-exactmodel" uncompressed (a
// bound). "dion-rR-B" is Dion on the mean through two linear all-reduces of
// rank R at B bits. Suffixes: "-rms" (else "-l1") the scale of the signs,
// "-nest" Nesterov's term from the estimate's increment, "-rot" a random
// sign flip and Walsh-Hadamard transform before each compression (shared
// seed, no bits), "-gG" a tracking gain G, "-syncK" an exact (fp32)
// synchronization of the estimates every K steps, "-wN" / "-sN" N bits
// on the workers' / owners' phase (2: Lloyd-Max's four levels, 3-8: a
// uniform grid), "-wt" three levels (1.6 bits), "-w1.33" two bits on every
// third chunk in turn, "-s1/K" the owners' phase sending a chunk every K
// steps in turn, "-fin" the last step's model exact. "own-allexact[-nest]" compress nothing
// (controls: "-nest" equals exact Muon). The summary line gives each
// scheme's mean over the seeds, its worst seed and simBits, its bits per
// Muon-matrix element per step at that W. More variables:
//
//	LOWBIT_MUON_SEEDS=0,1,2   data seeds (the fixed point: rotation seeds)
//	LOWBIT_MUON_DIAG=1        how far an own- scheme's Newton-Schulz input is from exact Muon's
//	LOWBIT_MUON_ONLY=…        also picks the fixed point's schemes
//
// For example, the best candidate within 2.1 bits at W = 8 against exact
// Muon at 8 ranks, and the 1-bit ones on the fixed point:
//
//	LOWBIT_MUON_SCHEMES=8 LOWBIT_MUON_ONLY=own-rms-ef21p-nest-rot-w1.33 go test -run 'TestMuonSchemes$' -v ./onebit/
//	LOWBIT_MUON_FIXED=1 LOWBIT_MUON_SEEDS=0,1,2 LOWBIT_MUON_ONLY=own-rms-efupd-nest-rot,own-rms-ef21p-nest-rot go test -run TestMuonSchemesFixedPoint -v ./onebit/

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

// sVar is the first of the schemes simVars configures (simNames after
// the fixed ones).
const sVar = sTrackedBlockL1NoNest + 1

var simNames = append([]string{"exact", "polar-avg", "polar-1bit", "tracked-rms", "tracked-l1", "mom-1bit", "tracked-rms-init", "tracked-l1-init", "tracked-srv-exact", "tracked-wkr-exact", "tracked-nonest", "tracked-blk", "tracked-blk-nonest", "tracked-blk-l1-nonest"}, simVarNames()...)

// simState is the state of every simulated rank of one scheme.
type simState struct {
	w       int
	scheme  simScheme
	cfg     optim.MuonConfig
	mom     [][][]float32 // rank, matrix
	h       [][][]float32 // tracked: rank's estimate of own momentum
	hbar    [][]float32   // owner's mean (stored full, chunks owned)
	mhat    [][]float32   // shared estimate
	we      [][][]float32 // worker errors
	se      [][]float32
	orth    []*optim.Orthogonalizer
	t       int
	v       simVar      // the configured schemes (sVar and after)
	x       [][]float32 // owner's exact model (model mEF21P)
	eo      [][]float32 // owner's error of the model phase (mEFUpd)
	dq      [][]float32 // Dion's Q, cols x rank
	shadow  [][]float32 // exact momentum of the mean gradient (diagnostic)
	relErr  []float64   // per step, ||u - exact u|| / ||exact u|| (vOwner)
	rotSeed uint64      // varies the rotations (the fixed point's seeds)
	last    int         // the run's last step (simVar.final)
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
		if s.scheme >= sVar {
			s.varStep(ps, pi, k, rows, cols, lr, scale)
			continue
		}
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
		s.x = append(s.x, make([]float32, n))
		s.eo = append(s.eo, make([]float32, n))
	}
	if scheme >= sVar {
		s.v = simVars[scheme-sVar]
		if s.v.gain == 0 {
			s.v.gain = 1
		}
		if s.v.rank > 0 {
			rng := rand.New(rand.NewPCG(3, 4))
			for _, sh := range shapes {
				q := mlpInit(rng, sh[1]*s.v.rank, 1)
				dionColNorm(q, sh[1], s.v.rank)
				s.dq = append(s.dq, q)
			}
		}
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
	seeds := []uint64{0, 1, 2}
	if v := os.Getenv("LOWBIT_MUON_SEEDS"); v != "" {
		seeds = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.ParseUint(f, 10, 64)
			if err != nil {
				t.Fatalf("LOWBIT_MUON_SEEDS: %v", err)
			}
			seeds = append(seeds, n)
		}
	}
	shapes := [][2]int{{mlpHidden, mlpIn}, {mlpOut, mlpHidden}}
	rel := map[simScheme][]float64{}
	for _, seed := range seeds {
		res := map[simScheme]float64{}
		for sc := range simScheme(len(simNames)) {
			if !simWanted(sc) {
				continue
			}
			task := newMLPTask()
			task.seed = seed
			ps := make([][]*optim.Param, w)
			for r := range w {
				ps[r] = mlpParams()
			}
			s := newSim(w, sc, shapes)
			s.last = steps
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
			if os.Getenv("LOWBIT_MUON_DIAG") != "" && len(s.relErr) > 0 {
				var a, b float64
				for i, e := range s.relErr {
					if i < len(s.relErr)/2 {
						a += e / float64(len(s.relErr)/2)
					} else {
						b += e / float64(len(s.relErr)-len(s.relErr)/2)
					}
				}
				t.Logf("%s seed %d: W1's orthogonalized input off the exact by %.3f (first half of the run), %.3f (second half)", simNames[sc], seed, a, b)
			}
		}
		line := fmt.Sprintf("W=%d seed=%d exact %.4f", w, seed, res[sExact])
		for sc := simScheme(1); sc < simScheme(len(simNames)); sc++ {
			if _, ok := res[sc]; !ok {
				continue
			}
			r := 100 * (res[sc]/res[sExact] - 1)
			rel[sc] = append(rel[sc], r)
			line += fmt.Sprintf(" | %s %+.1f%%", simNames[sc], r)
		}
		t.Log(line)
	}
	for sc := simScheme(1); sc < simScheme(len(simNames)); sc++ {
		rs := rel[sc]
		if len(rs) == 0 {
			continue
		}
		var mean float64
		worst := rs[0]
		for _, r := range rs {
			mean += r / float64(len(rs))
			worst = max(worst, r)
		}
		t.Logf("W=%d steps=%d %-22s mean %+6.1f%% worst %+6.1f%% seeds %s  bits/elem %.3g", w, steps, simNames[sc], mean, worst, fmtPcts(rs), simBits(sc, w, shapes))
	}
}

// simWanted says whether LOWBIT_MUON_ONLY (a comma-separated list of
// simNames; all when unset) asks for sc; exact Muon always runs.
func simWanted(sc simScheme) bool {
	only := os.Getenv("LOWBIT_MUON_ONLY")
	return sc == sExact || only == "" || strings.Contains(","+only+",", ","+simNames[sc]+",")
}

func fmtPcts(rs []float64) string {
	var b []string
	for _, r := range rs {
		b = append(b, fmt.Sprintf("%+.1f", r))
	}
	return strings.Join(b, "/")
}

// TestMuonSchemesFixedPoint runs docs/muon.md's fixed-point problem: a
// 16x32 matrix on 4 ranks, rank r's gradient w - target_r; the distance
// from the mean of the targets after 200 steps.
func TestMuonSchemesFixedPoint(t *testing.T) {
	if os.Getenv("LOWBIT_MUON_FIXED") == "" {
		t.Skip("a measurement harness: set LOWBIT_MUON_FIXED=1 to run it")
	}
	const w, rows, cols, steps = 4, 16, 32, 200
	targets, fit := fixedPointTargets(w, rows*cols)
	list := []simScheme{sExact, sPolarAvg, sTracked, sTrackedL1, sTrackedBlockL1NoNest, sTrackedBlock}
	if os.Getenv("LOWBIT_MUON_ONLY") != "" {
		list = nil
		for sc := range simScheme(len(simNames)) {
			if simWanted(sc) {
				list = append(list, sc)
			}
		}
	}
	rotSeeds := []uint64{0}
	if v := os.Getenv("LOWBIT_MUON_SEEDS"); v != "" {
		rotSeeds = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.ParseUint(f, 10, 64)
			if err != nil {
				t.Fatalf("LOWBIT_MUON_SEEDS: %v", err)
			}
			rotSeeds = append(rotSeeds, n)
		}
	}
	for _, rs := range rotSeeds {
		for _, sc := range list {
			ps := make([][]*optim.Param, w)
			for r := range w {
				ps[r] = []*optim.Param{optim.NewParam("w", rows, cols)}
			}
			s := newSim(w, sc, [][2]int{{rows, cols}})
			s.rotSeed = rs
			s.last = steps
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
			t.Logf("rotation seed %d: %s: distance from the fit %.4g", rs, simNames[sc], math.Sqrt(d))
		}
	}
}

// The configured schemes (issue 61's second round, docs/muon.md): simVar
// says what each does, simVars lists them under their names.
const (
	vTrack = iota // tracking with chunk owners (as tracked-nonest)
	vOwner        // whole-matrix owners orthogonalize the exact mean estimate
	vDion         // Dion: low-rank power iteration on the mean, linear reductions
)

// The owner's phase of vOwner: how the ranks learn the new model.
const (
	mEFUpd = iota // C(lr*update + e) broadcast, error feedback at the owner
	mEF21P        // the owner keeps the model X, broadcasts C(X - W) (EF21-P)
	mExact        // the update uncompressed (a bound: 32 bits)
	mPred         // EF21-P around the prediction decay*W - lr*(the last direction applied)
)

// simVar is one configured scheme.
type simVar struct {
	name   string
	kind   int
	l1     bool    // scale by mean|x| (else rms)
	gain   float32 // tracking gain of h_r and of the owners' estimate (0: 1)
	sync   int     // every sync steps the estimates (and model) exactly
	wbits  int     // 1, 2 or 32 (exact): the workers' phase
	sbits  int     // the same for the owners' phase
	nest   bool    // Nesterov's term from the estimate's increment
	gradEF bool    // vOwner: workers send C(g_r + e_r), the owner keeps the momentum
	model  int     // vOwner: mEFUpd, mEF21P or mExact
	rank   int     // vDion: the rank
	pbits  int     // vDion: bits of P and R on the wire (32, 16, 8, 4)
	rot    bool    // a random rotation before each compression (simQChunks)
	rotW   bool    // the same, the workers' phase only
	// w2Every > 0: the workers send a chunk at 2 bits every w2Every steps
	// (in turn), at 1 bit otherwise; sEvery > 0: the owners' phase sends a
	// chunk every sEvery steps (in turn), nothing otherwise.
	w2Every, sEvery int
	wHi             int // the bits of w2Every's chunks (0: 2)
	// dgain: mPred's direction D moves by dgain times what was sent over
	// lr (1 diverges: D takes up the model's error over lr).
	dgain float32
	// smooth > 0: the owner orthogonalizes an average of its input,
	// u = smooth*u_prev + (1-smooth)*u (mExact or mEF21P only: it keeps the
	// average where mEFUpd keeps its error)
	smooth float32
	// final: the owners' phase of the last step is exact (mEF21P: every
	// rank's model is then the owner's X), once a run.
	final bool
}

var simVars = []simVar{
	// (d) a tracking gain below 1, chunk owners.
	{name: "trk-l1", kind: vTrack, l1: true, wbits: 1, sbits: 1},
	{name: "trk-l1-g0.5", kind: vTrack, l1: true, gain: 0.5, wbits: 1, sbits: 1},
	{name: "trk-l1-g0.7", kind: vTrack, l1: true, gain: 0.7, wbits: 1, sbits: 1},
	// (b) a periodic exact synchronization of the estimates.
	{name: "trk-l1-sync100", kind: vTrack, l1: true, sync: 100, wbits: 1, sbits: 1},
	{name: "trk-l1-sync25", kind: vTrack, l1: true, sync: 25, wbits: 1, sbits: 1},
	// (c) two bits on one phase (does not fit 2.1 bits at W=8: 2.63).
	{name: "trk-l1-w2", kind: vTrack, l1: true, wbits: 2, sbits: 1},
	{name: "trk-l1-s2", kind: vTrack, l1: true, wbits: 1, sbits: 2},
	// (e) EF21-Muon: whole-matrix owners orthogonalize the mean estimate
	// uncompressed; the new model reaches the ranks compressed with error
	// feedback (mEFUpd) or by EF21-P (mEF21P).
	{name: "own-efupd", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEFUpd},
	{name: "own-efupd-nest", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEFUpd, nest: true},
	{name: "own-ef21p", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEF21P},
	{name: "own-exactmodel", kind: vOwner, l1: true, wbits: 1, sbits: 32, model: mExact},
	{name: "own-gradef", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEFUpd, gradEF: true},
	{name: "own-gradef-nest", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEFUpd, gradEF: true, nest: true},
	{name: "own-gradef-ef21p", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEF21P, gradEF: true},
	{name: "own-gradef-exactmodel", kind: vOwner, l1: true, wbits: 1, sbits: 32, model: mExact, gradEF: true},
	{name: "own-efupd-sync100", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEFUpd, sync: 100},
	{name: "own-gradef-sync100", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEFUpd, gradEF: true, sync: 100},
	{name: "own-efupd-g0.7", kind: vOwner, l1: true, gain: 0.7, wbits: 1, sbits: 1, model: mEFUpd},
	{name: "own-efupd-w2", kind: vOwner, l1: true, wbits: 2, sbits: 1, model: mEFUpd},
	{name: "own-gradef-w2", kind: vOwner, l1: true, wbits: 2, sbits: 1, model: mEFUpd, gradEF: true},
	// Random rotations before the compressors.
	{name: "trk-rms-rot", kind: vTrack, wbits: 1, sbits: 1, rot: true},
	{name: "trk-l1-rot", kind: vTrack, l1: true, wbits: 1, sbits: 1, rot: true},
	{name: "own-efupd-rot", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEFUpd, rot: true},
	{name: "own-efupd-nest-rot", kind: vOwner, l1: true, wbits: 1, sbits: 1, model: mEFUpd, nest: true, rot: true},
	{name: "own-rms-efupd-nest", kind: vOwner, wbits: 1, sbits: 1, model: mEFUpd, nest: true},
	{name: "own-exactmodel-rot", kind: vOwner, l1: true, wbits: 1, sbits: 32, model: mExact, rot: true},
	// Combinations.
	{name: "own-rms-efupd-nest-rot", kind: vOwner, wbits: 1, sbits: 1, model: mEFUpd, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot", kind: vOwner, wbits: 1, sbits: 1, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-gradef-nest-rot", kind: vOwner, wbits: 1, sbits: 1, model: mEFUpd, gradEF: true, nest: true, rot: true},
	{name: "own-rms-efupd-nest-rot-sync100", kind: vOwner, wbits: 1, sbits: 1, model: mEFUpd, nest: true, rot: true, sync: 100},
	{name: "trk-rms-nest-rot", kind: vTrack, wbits: 1, sbits: 1, nest: true, rot: true},
	{name: "own-efupd-nest-w2", kind: vOwner, l1: true, wbits: 2, sbits: 1, model: mEFUpd, nest: true},
	{name: "own-efupd-nest-w2s2", kind: vOwner, l1: true, wbits: 2, sbits: 2, model: mEFUpd, nest: true},
	// How many bits the workers' phase needs (beyond the budget: bounds).
	{name: "own-rms-exactmodel-nest-rot", kind: vOwner, wbits: 1, sbits: 32, model: mExact, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rotw", kind: vOwner, wbits: 1, sbits: 1, model: mEF21P, nest: true, rotW: true},
	{name: "own-rms-ef21p-nest-rot-w2", kind: vOwner, wbits: 2, sbits: 1, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-w3", kind: vOwner, wbits: 3, sbits: 1, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-w4", kind: vOwner, wbits: 4, sbits: 1, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-w8", kind: vOwner, wbits: 8, sbits: 1, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-w2-s2", kind: vOwner, wbits: 2, sbits: 2, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-w3-s2", kind: vOwner, wbits: 3, sbits: 2, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-w4-s2", kind: vOwner, wbits: 4, sbits: 2, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-w4-s4", kind: vOwner, wbits: 4, sbits: 4, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-efupd-nest-rot-w4", kind: vOwner, wbits: 4, sbits: 1, model: mEFUpd, nest: true, rot: true},
	{name: "own-rms-gradef-nest-rot-w4", kind: vOwner, wbits: 4, sbits: 1, model: mEF21P, gradEF: true, nest: true, rot: true},
	{name: "own-rms-exactmodel-nest-rot-w4", kind: vOwner, wbits: 4, sbits: 32, model: mExact, nest: true, rot: true},
	// Within 2.1 bits at W=8: more bits on the workers' phase, fewer on
	// the owners'.
	{name: "own-rms-ef21p-nest-rot-w2-s1/3", kind: vOwner, wbits: 2, sbits: 1, sEvery: 3, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-w2-s1/2", kind: vOwner, wbits: 2, sbits: 1, sEvery: 2, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-w1.33", kind: vOwner, wbits: 1, w2Every: 3, sbits: 1, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-wt", kind: vOwner, wbits: simTernary, sbits: 1, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-wt-s1/2", kind: vOwner, wbits: simTernary, sbits: 1, sEvery: 2, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-efupd-nest-rot-w2-s1/3", kind: vOwner, wbits: 2, sbits: 1, sEvery: 3, model: mEFUpd, nest: true, rot: true},
	{name: "own-rms-gradef-nest-rot-w2-s1/3", kind: vOwner, wbits: 2, sbits: 1, sEvery: 3, model: mEF21P, gradEF: true, nest: true, rot: true},
	{name: "own-rms-gradef-nest-rot-w2", kind: vOwner, wbits: 2, sbits: 1, model: mEF21P, gradEF: true, nest: true, rot: true},
	// Three levels on every second workers' chunk (1.3 bits), and the
	// gradients' variant of -w1.33.
	{name: "own-rms-ef21p-nest-rot-wt1/2", kind: vOwner, wbits: 1, w2Every: 2, wHi: simTernary, sbits: 1, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-gradef-nest-rot-w1.33", kind: vOwner, wbits: 1, w2Every: 3, sbits: 1, model: mEF21P, gradEF: true, nest: true, rot: true},
	{name: "own-rms-efupd-nest-rot-w1.33", kind: vOwner, wbits: 1, w2Every: 3, sbits: 1, model: mEFUpd, nest: true, rot: true},
	// EF21-P around a prediction from the last applied direction.
	{name: "own-rms-pred1-nest-rot", kind: vOwner, wbits: 1, sbits: 1, model: mPred, dgain: 1, nest: true, rot: true},
	{name: "own-rms-pred0.5-nest-rot", kind: vOwner, wbits: 1, sbits: 1, model: mPred, dgain: 0.5, nest: true, rot: true},
	{name: "own-rms-pred0.2-nest-rot", kind: vOwner, wbits: 1, sbits: 1, model: mPred, dgain: 0.2, nest: true, rot: true},
	{name: "own-rms-pred0.1-nest-rot", kind: vOwner, wbits: 1, sbits: 1, model: mPred, dgain: 0.1, nest: true, rot: true},
	{name: "own-rms-pred0.2-nest-rot-w4", kind: vOwner, wbits: 4, sbits: 1, model: mPred, dgain: 0.2, nest: true, rot: true},
	{name: "own-rms-pred0.2-nest-rot-w1.33", kind: vOwner, wbits: 1, w2Every: 3, sbits: 1, model: mPred, dgain: 0.2, nest: true, rot: true},
	{name: "own-rms-pred0.2-nest-rot-w2", kind: vOwner, wbits: 2, sbits: 1, model: mPred, dgain: 0.2, nest: true, rot: true},
	{name: "own-rms-pred0.2-nest-rot-w2-s1/3", kind: vOwner, wbits: 2, sbits: 1, sEvery: 3, model: mPred, dgain: 0.2, nest: true, rot: true},
	{name: "own-rms-pred0.2-nest-rot-w2-s1/2", kind: vOwner, wbits: 2, sbits: 1, sEvery: 2, model: mPred, dgain: 0.2, nest: true, rot: true},
	{name: "own-rms-pred0.2-nest-rot-w3-s1/3", kind: vOwner, wbits: 3, sbits: 1, sEvery: 3, model: mPred, dgain: 0.2, nest: true, rot: true},
	// An extra average of the owners' input, and exact Muon with the same.
	{name: "own-allexact-nest-smooth0.5", kind: vOwner, wbits: 32, sbits: 32, model: mExact, nest: true, smooth: 0.5},
	{name: "own-rms-ef21p-nest-rot-w1.33-smooth0.5", kind: vOwner, wbits: 1, w2Every: 3, sbits: 1, model: mEF21P, nest: true, rot: true, smooth: 0.5},
	// A tracking gain above 1 (the rms scale's signs carry 0.8 of x along x).
	{name: "own-rms-ef21p-nest-rot-w1.33-g1.25", kind: vOwner, wbits: 1, w2Every: 3, sbits: 1, gain: 1.25, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-g1.25", kind: vOwner, wbits: 1, sbits: 1, gain: 1.25, model: mEF21P, nest: true, rot: true},
	{name: "own-rms-ef21p-nest-rot-g1.5", kind: vOwner, wbits: 1, sbits: 1, gain: 1.5, model: mEF21P, nest: true, rot: true},
	// The last step's model exact (once a run).
	{name: "own-rms-ef21p-nest-rot-fin", kind: vOwner, wbits: 1, sbits: 1, model: mEF21P, nest: true, rot: true, final: true},
	{name: "own-rms-ef21p-nest-rot-w1.33-fin", kind: vOwner, wbits: 1, w2Every: 3, sbits: 1, model: mEF21P, nest: true, rot: true, final: true},
	{name: "own-rms-ef21p-nest-rot-w4-fin", kind: vOwner, wbits: 4, sbits: 1, model: mEF21P, nest: true, rot: true, final: true},
	// Controls: nothing compressed (exact Muon with and without Nesterov).
	{name: "own-allexact-nest", kind: vOwner, wbits: 32, sbits: 32, model: mExact, nest: true},
	{name: "own-allexact", kind: vOwner, wbits: 32, sbits: 32, model: mExact},
	{name: "own-gradef-allexact-nest", kind: vOwner, wbits: 32, sbits: 32, model: mExact, gradEF: true, nest: true},
	// (a) Dion.
	{name: "dion-r1-bf16", kind: vDion, rank: 1, pbits: 16},
	{name: "dion-r2-int8", kind: vDion, rank: 2, pbits: 8},
	{name: "dion-r4-int4", kind: vDion, rank: 4, pbits: 4},
	{name: "dion-r4-fp32", kind: vDion, rank: 4, pbits: 32},
	{name: "dion-r8-fp32", kind: vDion, rank: 8, pbits: 32},
	{name: "dion-r16-fp32", kind: vDion, rank: 16, pbits: 32},
}

func simVarNames() []string {
	var out []string
	for _, v := range simVars {
		out = append(out, v.name)
	}
	return out
}

// simBits is the bits per Muon-matrix element per step that scheme sc sends
// per rank on w ranks, the matrices of shapes: a phase of the 1-bit exchange
// is (w-1)/w elements at its bits (a scale per chunk not counted: onebit's
// buckets make it small), an all-reduce 2(w-1)/w at its bits; a
// synchronization every K steps an fp32 all-reduce over K.
func simBits(sc simScheme, w int, shapes [][2]int) float64 {
	f := float64(w-1) / float64(w)
	switch {
	case sc == sExact || sc == sPolarAvg:
		return 2 * f * 32
	case sc == sTrackedServerExact || sc == sTrackedWorkerExact:
		return f * 33
	case sc < sVar:
		return 2 * f
	}
	v := simVars[sc-sVar]
	if v.kind == vDion {
		var n, lr float64
		for _, sh := range shapes {
			n += float64(sh[0] * sh[1])
			lr += float64(v.rank * (sh[0] + sh[1]))
		}
		return 2 * f * float64(v.pbits) * lr / n
	}
	wb, sb := simWireBits(v.wbits), simWireBits(v.sbits)
	if v.w2Every > 0 {
		wb = (simWireBits(cmp.Or(v.wHi, 2)) + float64(v.w2Every-1)) / float64(v.w2Every)
	}
	if v.sEvery > 0 {
		sb /= float64(v.sEvery)
	}
	b := f * (wb + sb)
	if v.sync > 0 {
		b += 2 * f * 32 / float64(v.sync)
	}
	return b
}

// simQ compresses x (one chunk) to bits: 1 is sign times a scale (l1:
// mean|x|, else rms), 2 is the four levels of Lloyd-Max's quantizer for a
// Gaussian at x's rms, 32 is x itself.
func simQ(dst, x []float32, bits int, l1 bool) {
	switch bits {
	case 1:
		simC(dst, x, l1)
	case 2:
		var s float64
		for _, v := range x {
			s += float64(v) * float64(v)
		}
		sd := float32(math.Sqrt(s / float64(len(x))))
		for i, v := range x {
			a := float32(0.4528) * sd
			if float32(math.Abs(float64(v))) > 0.9816*sd {
				a = 1.510 * sd
			}
			if v < 0 {
				a = -a
			}
			dst[i] = a
		}
	case simTernary:
		// {-a, 0, a}, a zero below 0.612 rms (Lloyd-Max for a Gaussian)
		var s float64
		for _, v := range x {
			s += float64(v) * float64(v)
		}
		sd := float32(math.Sqrt(s / float64(len(x))))
		for i, v := range x {
			switch {
			case v > 0.612*sd:
				dst[i] = 1.224 * sd
			case v < -0.612*sd:
				dst[i] = -1.224 * sd
			default:
				dst[i] = 0
			}
		}
	case 3, 4, 5, 6, 8:
		// a uniform mid-rise quantizer at x's rms, Max's steps for a Gaussian
		var s float64
		for _, v := range x {
			s += float64(v) * float64(v)
		}
		step := float32(map[int]float64{3: 0.586, 4: 0.3352, 5: 0.1881, 6: 0.1041, 8: 0.03}[bits] * math.Sqrt(s/float64(len(x))))
		top := float32(int(1)<<(bits-1)) - 0.5
		for i, v := range x {
			if step == 0 {
				dst[i] = 0
				continue
			}
			q := float32(math.Floor(float64(v/step))) + 0.5
			dst[i] = max(-top, min(top, q)) * step
		}
	default:
		copy(dst, x)
	}
}

// simTernary as a number of bits is the three-level quantizer of simQ,
// 1.6 bits on the wire (five to a byte).
const simTernary = 158

// simWireBits is what bits costs on the wire.
func simWireBits(bits int) float64 {
	if bits == simTernary {
		return 1.6
	}
	return float64(bits)
}

// simQChunks compresses x chunk by chunk as the exchange cuts it over w.
// With rot nonzero each chunk is first rotated by random signs (seeded by
// rot, shared by sender and receivers) and Walsh-Hadamard transforms on
// power-of-two pieces, compressed, and rotated back: no bits more, the
// compressor's error spread evenly.
func simQChunks(dst, x []float32, w, bits int, l1 bool, rot uint64) {
	simQSched(dst, x, w, func(int) int { return bits }, l1, rot)
}

// simQSched is simQChunks with chunk j at bits(j) bits, 0 for a chunk not
// sent this step (zero in dst).
func simQSched(dst, x []float32, w int, bitsOf func(j int) int, l1 bool, rot uint64) {
	for j, ch := range chunks(len(x), w) {
		bits := bitsOf(j)
		if bits == 0 {
			clear(dst[ch[0]:ch[1]])
			continue
		}
		if rot == 0 {
			simQ(dst[ch[0]:ch[1]], x[ch[0]:ch[1]], bits, l1)
			continue
		}
		y := append([]float32(nil), x[ch[0]:ch[1]]...)
		rng := rand.New(rand.NewPCG(rot, uint64(ch[0])))
		signs := make([]float32, len(y))
		for i := range signs {
			signs[i] = 1
			if rng.Uint64()&1 == 1 {
				signs[i] = -1
			}
			y[i] *= signs[i]
		}
		simHadamard(y)
		q := make([]float32, len(y))
		simQ(q, y, bits, l1)
		simHadamard(q)
		for i := range q {
			dst[ch[0]+i] = q[i] * signs[i]
		}
	}
}

// simHadamard applies the orthonormal Walsh-Hadamard transform (its own
// inverse) to x's pieces, the largest power of two first.
func simHadamard(x []float32) { onebit.Hadamard(x) }

// simRound rounds x to bits on the wire: 32 as is, 16 to bfloat16 (nearest
// even), else a symmetric uniform grid at the absolute maximum of each
// block of 64 elements, nearest.
func simRound(x []float32, bits int) {
	switch {
	case bits >= 32:
	case bits == 16:
		for i, v := range x {
			b := math.Float32bits(v)
			b += 0x7fff + (b>>16)&1
			x[i] = math.Float32frombits(b &^ 0xffff)
		}
	default:
		lv := float32(int(1)<<(bits-1) - 1)
		for a := 0; a < len(x); a += 64 {
			blk := x[a:min(a+64, len(x))]
			var m float32
			for _, v := range blk {
				m = max(m, float32(math.Abs(float64(v))))
			}
			if m == 0 {
				continue
			}
			for i, v := range blk {
				blk[i] = float32(math.Round(float64(v/m*lv))) / lv * m
			}
		}
	}
}

// rot is the rotation seed of phase ph, matrix k, rank r (0: none).
func (s *simState) rot(ph, k, r int) uint64 {
	if !s.v.rot && !(s.v.rotW && ph == 1) {
		return 0
	}
	return uint64(s.t)<<20 | uint64(ph)<<16 | uint64(k)<<8 | uint64(r) | 1<<40 | s.rotSeed<<44
}

// ownerBits is the owners' phase's bits of chunk j this step.
func (s *simState) ownerBits() func(j int) int {
	return func(j int) int {
		if s.v.sEvery > 0 && (s.t+j)%s.v.sEvery != 0 {
			return 0
		}
		return s.v.sbits
	}
}

// varStep applies the configured scheme to matrix k (parameter pi).
func (s *simState) varStep(ps [][]*optim.Param, pi, k, rows, cols int, lr, scale float32) {
	w, cfg, v := s.w, s.cfg, s.v
	n := rows * cols
	decay := float32(1 - float64(lr)*float64(cfg.WeightDecay))
	if v.kind == vDion {
		s.dionStep(ps, pi, k, rows, cols, lr*scale, decay)
		return
	}
	beta := cfg.Momentum
	sync := v.sync > 0 && s.t%v.sync == 0
	// Workers' phase: the owners' mean estimate hbar of the ranks' momenta
	// (or, gradEF, of their gradients, into the owner's momentum).
	inc := make([]float32, n) // mean of what the ranks sent
	c, d := make([]float32, n), make([]float32, n)
	for r := range w {
		g := ps[r][pi].GradData()
		if v.gradEF {
			for i := range d {
				d[i] = g[i] + s.we[k][r][i]
			}
		} else {
			optim.Momentum(s.mom[r][k], g, beta)
			for i := range d {
				d[i] = s.mom[r][k][i] - s.h[r][k][i]
			}
		}
		if sync {
			copy(c, d)
		} else {
			simQSched(c, d, w, func(j int) int {
				if v.w2Every > 0 {
					if (s.t+j)%v.w2Every == 0 {
						return cmp.Or(v.wHi, 2)
					}
					return 1
				}
				return v.wbits
			}, v.l1, s.rot(1, k, r))
		}
		if v.gradEF {
			for i := range d {
				s.we[k][r][i] = d[i] - c[i]
			}
		} else {
			gn := v.gain
			if sync {
				gn = 1
			}
			for i := range c {
				c[i] *= gn
				s.h[r][k][i] += c[i]
			}
		}
		for i := range c {
			inc[i] += c[i] / float32(w)
		}
	}
	u := make([]float32, n)
	if v.gradEF {
		// the owner's momentum of the mean of what was sent
		for i := range inc {
			s.hbar[k][i] = beta*s.hbar[k][i] + (1-beta)*inc[i]
			u[i] = s.hbar[k][i]
			if v.nest {
				u[i] = (1-beta)*inc[i] + beta*s.hbar[k][i]
			}
		}
	} else {
		for i := range inc {
			s.hbar[k][i] += inc[i]
		}
	}
	upd := make([]float32, n)
	nc := cfg
	nc.Nesterov = false
	switch v.kind {
	case vTrack:
		// Owners' phase: C(hbar - M) to all, M += gain*it.
		y := make([]float32, n)
		for i := range y {
			y[i] = s.hbar[k][i] - s.mhat[k][i]
		}
		sv := make([]float32, n)
		if sync {
			copy(sv, y)
		} else {
			simQChunks(sv, y, w, v.sbits, v.l1, s.rot(2, k, 0))
			for i := range sv {
				sv[i] *= v.gain
			}
		}
		for i := range sv {
			s.mhat[k][i] += sv[i]
			u[i] = s.mhat[k][i]
			if v.nest {
				u[i] += beta * sv[i]
			}
		}
		s.orth[k].Orthogonalize(upd, u, nil, rows, cols, nc, 1)
		for r := range w {
			p := ps[r][pi].Data()
			for i := range p {
				p[i] = p[i]*decay - lr*scale*upd[i]
			}
		}
		return
	}
	// vOwner: the owner orthogonalizes its exact estimate.
	if !v.gradEF {
		for i := range u {
			u[i] = s.hbar[k][i]
			if v.nest {
				u[i] += beta * inc[i]
			}
		}
	}
	if k == 0 {
		// diagnostic: how far u is from the exact (Nesterov) momentum
		if s.shadow == nil {
			s.shadow = [][]float32{make([]float32, n)}
		}
		var num, den float64
		for i := range u {
			var g float32
			for r := range w {
				g += ps[r][pi].GradData()[i] / float32(w)
			}
			s.shadow[0][i] = beta*s.shadow[0][i] + (1-beta)*g
			e := s.shadow[0][i]
			if v.nest {
				e = (1-beta)*g + beta*e
			}
			num += float64(u[i]-e) * float64(u[i]-e)
			den += float64(e) * float64(e)
		}
		s.relErr = append(s.relErr, math.Sqrt(num/den))
	}
	if v.smooth > 0 {
		// an extra average of the owner's input (a different optimizer:
		// compare with own-allexact-nest-smooth*)
		for i := range u {
			s.eo[k][i] = v.smooth*s.eo[k][i] + (1-v.smooth)*u[i]
			u[i] = s.eo[k][i]
		}
	}
	s.orth[k].Orthogonalize(upd, u, nil, rows, cols, nc, 1)
	p0 := ps[0][pi].Data()
	sent := make([]float32, n)
	switch v.model {
	case mExact:
		for i := range sent {
			sent[i] = lr * scale * upd[i]
		}
	case mEFUpd:
		// every rank: W = decay*W - C(lr*upd + e)
		for i := range d {
			d[i] = lr*scale*upd[i] + s.eo[k][i]
		}
		if sync {
			copy(sent, d)
		} else {
			simQSched(sent, d, w, s.ownerBits(), v.l1, s.rot(2, k, 0))
		}
		for i := range d {
			s.eo[k][i] = d[i] - sent[i]
		}
	case mEF21P:
		if s.t == 1 {
			copy(s.x[k], p0)
		}
		for i := range d {
			s.x[k][i] = s.x[k][i]*decay - lr*scale*upd[i]
			d[i] = s.x[k][i] - p0[i]
		}
		if sync || v.final && s.t == s.last {
			copy(sent, d)
		} else {
			simQSched(sent, d, w, s.ownerBits(), v.l1, s.rot(2, k, 0))
		}
		for r := range w {
			p := ps[r][pi].Data()
			for i := range p {
				p[i] += sent[i]
			}
		}
		return
	case mPred:
		// EF21-P around a prediction: every rank predicts the model as
		// decay*W - lr*D, D the direction it last applied; the owner sends
		// C(X - prediction), every rank sets W = prediction + it and D =
		// D - it/(lr*scale).
		if s.t == 1 {
			copy(s.x[k], p0)
		}
		lrs := lr * scale
		pred := make([]float32, n)
		for i := range d {
			s.x[k][i] = s.x[k][i]*decay - lrs*upd[i]
			pred[i] = p0[i]*decay - lrs*s.eo[k][i]
			d[i] = s.x[k][i] - pred[i]
		}
		if sync || v.final && s.t == s.last {
			copy(sent, d)
		} else {
			simQSched(sent, d, w, s.ownerBits(), v.l1, s.rot(2, k, 0))
		}
		for i := range sent {
			s.eo[k][i] -= v.dgain * sent[i] / lrs
		}
		for r := range w {
			p := ps[r][pi].Data()
			for i := range p {
				p[i] = pred[i] + sent[i]
			}
		}
		return
	}
	for r := range w {
		p := ps[r][pi].Data()
		for i := range p {
			p[i] = p[i]*decay - sent[i]
		}
	}
}

// dionStep is Dion (arXiv 2504.05295, Algorithm 1) on the mean of the
// ranks' buffers through linear reductions: every rank r keeps its buffer
// M_r; B_r = M_r + G_r; P = mean_r(B_r Q) (an all-reduce, rounded to pbits
// on the wire), orthonormalized; R = mean_r(B_r^T P) (the same); M_r = B_r
// - (1-mu) P R^T (error feedback: what the rank leaves stays); Q =
// column-normalized R; the update P Q^T.
func (s *simState) dionStep(ps [][]*optim.Param, pi, k, rows, cols int, st, decay float32) {
	w, rk, mu := s.w, s.v.rank, s.cfg.Momentum
	q := s.dq[k]
	pbar, rbar := make([]float32, rows*rk), make([]float32, cols*rk)
	tmp := make([]float32, max(rows, cols)*rk)
	for r := range w {
		b, g := s.mom[r][k], ps[r][pi].GradData()
		for i := range b {
			b[i] += g[i]
		}
		pr := tmp[:rows*rk]
		clear(pr)
		for i := range rows {
			for j := range cols {
				bij := b[i*cols+j]
				for c := range rk {
					pr[i*rk+c] += bij * q[j*rk+c]
				}
			}
		}
		simRound(pr, s.v.pbits)
		for i := range pr {
			pbar[i] += pr[i] / float32(w)
		}
	}
	simRound(pbar, s.v.pbits)
	dionOrthonormal(pbar, rows, rk)
	for r := range w {
		b := s.mom[r][k]
		rr := tmp[:cols*rk]
		clear(rr)
		for i := range rows {
			for j := range cols {
				bij := b[i*cols+j]
				for c := range rk {
					rr[j*rk+c] += bij * pbar[i*rk+c]
				}
			}
		}
		simRound(rr, s.v.pbits)
		for i := range rr {
			rbar[i] += rr[i] / float32(w)
		}
	}
	simRound(rbar, s.v.pbits)
	for r := range w {
		b := s.mom[r][k]
		for i := range rows {
			for j := range cols {
				var a float32
				for c := range rk {
					a += pbar[i*rk+c] * rbar[j*rk+c]
				}
				b[i*cols+j] -= (1 - mu) * a
			}
		}
	}
	copy(q, rbar)
	dionColNorm(q, cols, rk)
	for r := range w {
		p := ps[r][pi].Data()
		for i := range rows {
			for j := range cols {
				var a float32
				for c := range rk {
					a += pbar[i*rk+c] * q[j*rk+c]
				}
				p[i*cols+j] = p[i*cols+j]*decay - st*a
			}
		}
	}
}

// dionColNorm scales each column of x (n x rk, row-major) to unit norm.
func dionColNorm(x []float32, n, rk int) {
	for c := range rk {
		var s float64
		for i := range n {
			s += float64(x[i*rk+c]) * float64(x[i*rk+c])
		}
		if s == 0 {
			continue
		}
		f := float32(1 / math.Sqrt(s))
		for i := range n {
			x[i*rk+c] *= f
		}
	}
}

// dionOrthonormal orthonormalizes the columns of x (n x rk) by modified
// Gram-Schmidt in float64.
func dionOrthonormal(x []float32, n, rk int) {
	for c := range rk {
		for p := range c {
			var d float64
			for i := range n {
				d += float64(x[i*rk+c]) * float64(x[i*rk+p])
			}
			for i := range n {
				x[i*rk+c] -= float32(d) * x[i*rk+p]
			}
		}
		var s float64
		for i := range n {
			s += float64(x[i*rk+c]) * float64(x[i*rk+c])
		}
		if s > 0 {
			f := float32(1 / math.Sqrt(s))
			for i := range n {
				x[i*rk+c] *= f
			}
		}
	}
}
