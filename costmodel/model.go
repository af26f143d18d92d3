// Package costmodel predicts the communication time of data-parallel
// training steps with an alpha-beta model of the collectives lowbit runs
// (docs/plan.md), fitted to measurements: the model behind "lowbit plan".
//
// A collective call is the sequence of steps its algorithm runs: local
// work, then a message exchange of some latency-bound rounds and some bytes
// per rank. A step takes
//
//	pre + rounds*alpha + overlap(work, bytes*beta)
//
// with beta = ineff/rate seconds per byte through the bottleneck link. alpha
// (seconds per round) and ineff (time per byte over the nominal line rate's)
// are fitted per link to "lowbit bench --json" sweeps recorded with
// scripts/plan-calibrate.sh; the local work is not fitted but measured: the
// 1-bit allreduce timed without a network.
//
// On the shaped loopback of the calibration (Shared) one token bucket
// carries every rank's bytes, and it lets through at once the tokens it
// gathered while the link was idle (during local work, latency rounds and
// the benchmark's barrier), up to its burst: the model runs that bucket
// through the steps of back-to-back calls, as lowbit bench makes them.
//
// Use: Builtin or LoadFile fit a Calibration; its Model's Plan predicts a
// Job; Calibration.Check and Calibration.HoldOut compare the model with the
// measured points. Job.RTT replaces the fitted alpha, a loopback's, by half
// a wide-area link's round trip (rtt.go). The package does not import the
// optimizers: it keeps copies of onebit's padding and pipelining rules, of
// the outer optimizer's int8 and sparse message layouts and buffers, and of
// Muon's Newton-Schulz iteration count, checked by its tests. With
// Job.OuterH a plan also has rows for the outer optimizer (package outer),
// one per codec, each an exchange every OuterH/OuterFragments steps
// averaged per step (outer.go, sparse.go); Muon's rows are an optimizer's
// step, its exchange and the orthogonalization (muon.go). Job.StateTable is
// the optimizer state per rank of every optimizer a plan lists. With
// Job.TokensPerStep a plan also compares W machines with one, row by row
// (Plan.VsOne, vsone.go).
package costmodel

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
)

// LinkFit is the network part of the model for one link: alpha and beta =
// Ineff/Rate.
type LinkFit struct {
	Rate     float64 `json:"rate_bytes_per_s"`
	RateName string  `json:"rate"`
	Alpha    float64 `json:"alpha_s"` // seconds per latency-bound round
	Ineff    float64 `json:"ineff"`   // time per byte over the line rate's (1: line rate)
	Points   int     `json:"points"`
	// RMS is the root mean square relative error of the fit on its
	// points.
	RMS float64 `json:"rms_rel_error"`
}

// Model is a calibrated model: the network fit of each link of one
// backend and link sharing, and the compression speed of one machine.
type Model struct {
	Backend string  `json:"backend"`
	Sharing Sharing `json:"link_sharing"`
	// Fits are the link fits by rate name ("1gbit").
	Fits map[string]LinkFit `json:"fits"`
	// Compute is the time of the 1-bit allreduce without a network (local
	// backend) by rank count and size, measured on the calibration machine
	// (it differs per machine): compression, and for W > 1 also the
	// in-memory exchange, with the W ranks sharing the machine's CPUs.
	// Interpolated between sizes, at the nearest end's rate outside them.
	Compute map[int][]ComputePoint `json:"compute"`
	// CompressBps, when positive, replaces the measured 1-rank curve by a
	// fixed rate: float32 bytes per second through a 1-rank call
	// (Job.CompressBps).
	CompressBps float64 `json:"compress_bytes_per_s,omitempty"`
	CPUs        int     `json:"cpus"`        // of the machine the calibration ran on
	Burst       int64   `json:"burst_bytes"` // of the calibration's shaped link
	Machine     string  `json:"machine"`
}

// Machine is what a fit keeps fixed: how the calibration's ranks shared
// its link, their compression times, the machine's CPUs and the token
// bucket's burst of its shaped link.
type Machine struct {
	Sharing Sharing
	Compute map[int][]ComputePoint
	CPUs    int
	Burst   int64
}

func (m *Model) machine() Machine {
	return Machine{Sharing: m.Sharing, Compute: m.Compute, CPUs: m.CPUs, Burst: m.Burst}
}

// prediction is one collective call's predicted time, split into its terms.
type prediction struct {
	Wire       int64 // bytes each rank sends
	Bottleneck int64 // bytes through the slowest link, less the bucket's tokens
	Latency    float64
	Transfer   float64 // bottleneck bytes at beta
	Compute    float64 // local work not hidden behind transfers
	Calls      int     // collective calls (pipelined pieces count alone)
}

func (p prediction) total() float64 { return p.Latency + p.Transfer + p.Compute }

// add adds times calls of q to p.
func (p *prediction) add(q prediction, times int64) {
	p.Wire += q.Wire * times
	p.Bottleneck += q.Bottleneck * times
	p.Latency += q.Latency * float64(times)
	p.Transfer += q.Transfer * float64(times)
	p.Compute += q.Compute * float64(times)
	p.Calls += q.Calls * int(times)
}

// setup is where a prediction is made.
type setup struct {
	Ranks   int
	Rate    float64 // link rate, bytes per second
	Sharing Sharing
	// Burst is the token bucket's burst on a shaped shared link (0: a real
	// link).
	Burst int64
	// NetworkAlpha says that alpha is a network's latency (Job.RTT), which
	// oversubscription does not scale (alphaFor).
	NetworkAlpha bool
	// Warmup and Iters are the untimed and timed calls of the lowbit bench
	// run predicted on a shaped link (Iters 0: the steady state).
	Warmup, Iters int
	// Before is what that bench run did first, each with Warmup + Iters
	// calls: on a shaped link it drains the bucket this call starts from.
	Before []BenchedCase
}

// computeSeconds is the local work of a call of collective c on n elements
// per rank. On the calibration's shared link, with a compute run of that
// rank count, it is that run's time (the ranks' real contention for the
// machine's CPUs). Otherwise one rank alone on the padded buffer (the
// 1-rank curve or Job.CompressBps), times (4+1/W)/5, the share of its
// passes each of W ranks makes (onebitSteps), on a CPU of its own; on the
// shared machine W ranks take turns on its CPUs.
func (m *Model) computeSeconds(c collective, n int64, s setup) float64 {
	if !c.compresses || n <= 0 {
		return 0
	}
	if cv, ok := m.Compute[s.Ranks]; ok && s.Ranks > 1 && s.Sharing == Shared && m.CompressBps == 0 {
		return interpolate(cv, 4*n)
	}
	b := 4 * int64(onebitPaddedLen(n, s.Ranks))
	var t float64
	if m.CompressBps > 0 {
		t = float64(b) / m.CompressBps
	} else {
		t = interpolate(m.Compute[1], b)
	}
	t *= (4 + 1/float64(s.Ranks)) / 5
	if s.Sharing == Shared && m.CPUs > 0 {
		// Ranks without a compute run of their count on the shared
		// machine: they take turns on its CPUs.
		t *= max(1, float64(s.Ranks)/float64(m.CPUs))
	}
	return t
}

// interpolate is the time of b bytes on curve cv: linear between measured
// sizes, at the nearest end's rate outside them.
func interpolate(cv []ComputePoint, b int64) float64 {
	if len(cv) == 0 {
		return 0
	}
	rate := func(p ComputePoint) float64 { return float64(b) * p.Seconds / float64(p.Bytes) }
	if b <= cv[0].Bytes {
		return rate(cv[0])
	}
	for i := 1; i < len(cv); i++ {
		if b <= cv[i].Bytes {
			lo, hi := cv[i-1], cv[i]
			f := float64(b-lo.Bytes) / float64(hi.Bytes-lo.Bytes)
			return lo.Seconds + f*(hi.Seconds-lo.Seconds)
		}
	}
	return rate(cv[len(cv)-1])
}

// overlap is the time of local work a and a transfer x that overlap in k
// pieces: the longer of the two plus one piece of the shorter; without
// pipelining (k <= 1) they add up.
func overlap(a, x float64, k int) float64 {
	if k <= 1 {
		return a + x
	}
	return max(a, x) + min(a, x)/float64(k)
}

// barrierRounds is the latency-bound rounds of the barrier lowbit bench
// makes before each timed call (recursive doubling: ceil(log2 W)).
func barrierRounds(w int) float64 {
	r := 0
	for 1<<r < w {
		r++
	}
	return float64(r)
}

// predict is the time of one call of collective c on n float32 elements
// per rank with the link fit f.
//
// On a shaped shared link (s.Burst > 0) the calls are those of lowbit
// bench: s.Warmup untimed and s.Iters timed calls back to back, each after
// a barrier and after copying the input into the buffer (a fifth of the
// 1-rank call's time: one of its five passes), and the prediction is the
// median of the timed calls, like the benchmark's p50. The bucket is full
// when the benchmark's run starts, gains rate*t tokens (up to the burst)
// in each idle time t (local work, latency rounds, barrier and copy), and
// each step spends W times its bytes from it; what the tokens do not cover
// goes at beta. The collectives the run benchmarked before (s.Before, with
// as many calls each, each after the idle time of its set-up) go first:
// they leave the bucket as this one finds it. Without a count of calls
// (s.Iters == 0) the call is repeated until the bucket's state repeats:
// the steady state. With more ranks than the calibration machine's CPUs
// on the shared link, alpha is scaled by W/cpus (but for Job.RTT's).
func (m *Model) predict(c collective, n int64, s setup, f LinkFit) prediction {
	if s.Ranks < 2 || n <= 0 {
		return prediction{}
	}
	tokens := float64(s.Burst)
	if s.Burst > 0 && s.Iters > 0 {
		refill := func(n int64) {
			tokens = min(float64(s.Burst), tokens+m.caseSetupSeconds(n, s)*s.Rate)
		}
		for _, b := range s.Before {
			bc, ok := findCollective(b.Collective)
			if !ok {
				continue
			}
			refill(b.Bytes / 4)
			for range s.Warmup + s.Iters {
				m.callFrom(bc, b.Bytes/4, s, f, &tokens)
			}
		}
		refill(n)
	}
	return m.predictFrom(c, n, s, f, tokens)
}

// benchSetupPerElement is the time lowbit bench takes to set a case up
// (allocate its buffers and fill its input) per float32 element per rank,
// measured on the calibration machine (4-10 ns for allreduce and onebit
// from 16K to 1M elements on one rank).
const benchSetupPerElement = 8e-9

// caseSetupSeconds is the idle time of a shaped link while lowbit bench
// sets up a case of n elements per rank: the W ranks take turns on the
// calibration machine's CPUs.
func (m *Model) caseSetupSeconds(n int64, s setup) float64 {
	t := benchSetupPerElement * float64(n)
	if m.CPUs > 0 {
		t *= max(1, float64(s.Ranks)/float64(m.CPUs))
	}
	return t
}

// callFrom is one benchmarked call of c (after its barrier and copy) from
// the bucket's tokens, which it updates.
func (m *Model) callFrom(c collective, n int64, s setup, f LinkFit, tokens *float64) prediction {
	alpha := m.alphaFor(s, f)
	gap := barrierRounds(s.Ranks)*alpha + m.copySeconds(n, s)
	*tokens = min(float64(s.Burst), *tokens+gap*s.Rate)
	return m.oneCall(c, n, s, f, tokens)
}

// alphaFor is the fitted alpha, scaled by W/cpus with more ranks than the
// calibration machine's CPUs on the shared link; a network's (Job.RTT)
// as it is.
func (m *Model) alphaFor(s setup, f LinkFit) float64 {
	alpha := f.Alpha
	if s.Sharing == Shared && m.CPUs > 0 && !s.NetworkAlpha {
		// More ranks than the machine has CPUs: a round waits for its
		// receiver to be scheduled (oversubscription).
		alpha *= max(1, float64(s.Ranks)/float64(m.CPUs))
	}
	return alpha
}

// oneCall is one call of c from the bucket's tokens, which it updates.
func (m *Model) oneCall(c collective, n int64, s setup, f LinkFit, tokens *float64) prediction {
	compute := m.computeSeconds(c, n, s)
	steps := c.steps(n, s.Ranks, compute)
	beta := f.Ineff / s.Rate
	share := int64(1)
	if s.Sharing == Shared {
		share = int64(s.Ranks)
	}
	alpha := m.alphaFor(s, f)
	p := prediction{Wire: c.wireBytes(n, s.Ranks)}
	for _, st := range steps {
		lat := st.rounds * alpha
		b := float64(st.bytes * share)
		short := b
		if s.Burst > 0 {
			idle := lat
			if st.pieces <= 1 {
				idle += st.pre
			}
			*tokens = min(float64(s.Burst), *tokens+idle*s.Rate)
			short = max(0, b-*tokens)
			*tokens = max(0, *tokens-b)
		}
		x := short * beta
		busy := st.pre + overlap(st.work, x, st.pieces)
		p.Bottleneck += int64(short)
		p.Latency += lat
		p.Transfer += x
		p.Compute += busy - x
		p.Calls += max(1, st.pieces)
	}
	return p
}

// predictFrom is predict with the bucket holding tokens at the start.
func (m *Model) predictFrom(c collective, n int64, s setup, f LinkFit, tokens float64) prediction {
	if s.Burst == 0 {
		return m.oneCall(c, n, s, f, &tokens)
	}
	if s.Iters == 0 {
		var p prediction
		for range 50 {
			start := tokens
			p = m.callFrom(c, n, s, f, &tokens)
			if math.Abs(tokens-start) < 1 {
				break
			}
		}
		return p
	}
	for range s.Warmup {
		m.callFrom(c, n, s, f, &tokens)
	}
	timed := make([]prediction, s.Iters)
	for i := range timed {
		timed[i] = m.callFrom(c, n, s, f, &tokens)
	}
	slices.SortFunc(timed, func(a, b prediction) int { return cmp.Compare(a.total(), b.total()) })
	if len(timed)%2 == 1 {
		return timed[len(timed)/2]
	}
	lo, hi := timed[len(timed)/2-1], timed[len(timed)/2]
	return prediction{Wire: lo.Wire, Bottleneck: (lo.Bottleneck + hi.Bottleneck) / 2, Latency: (lo.Latency + hi.Latency) / 2,
		Transfer: (lo.Transfer + hi.Transfer) / 2, Compute: (lo.Compute + hi.Compute) / 2, Calls: lo.Calls}
}

// copySeconds is the time lowbit bench takes to copy the input into the
// buffer before a call: one pass over it, a fifth of the 1-rank 1-bit
// call's five passes (measured).
func (m *Model) copySeconds(n int64, s setup) float64 {
	one, _ := findCollective("onebit")
	return m.computeSeconds(one, n, setup{Ranks: 1, Rate: s.Rate, Sharing: PerRank}) / (4 + 1)
}

// fitFor is the fit of the link named rate, or, for a rate without
// measurements, the calibrated link nearest in rate (ok false).
func (m *Model) fitFor(rateName string, rate float64) (f LinkFit, ok bool) {
	if f, ok := m.Fits[rateName]; ok {
		return f, true
	}
	best := math.Inf(1)
	for _, g := range m.Fits {
		if d := math.Abs(math.Log(g.Rate / rate)); d < best {
			f, best = g, d
		}
	}
	return f, false
}

// setupFor is the setup a measured point was taken in.
func (m *Model) setupFor(p Point) setup {
	s := setup{Ranks: p.Ranks, Rate: p.Rate, Sharing: m.Sharing, Warmup: p.Warmup, Iters: p.Iters, Before: p.Before}
	if m.Sharing == Shared {
		s.Burst = m.Burst
	}
	return s
}

// PredictPoint is the model's time for a measured point (one call as
// lowbit bench timed it), with the fit of its link or the nearest one.
func (m *Model) PredictPoint(p Point) float64 {
	c, ok := findCollective(p.Collective)
	if !ok {
		return math.NaN()
	}
	f, _ := m.fitFor(p.RateName, p.Rate)
	return m.predict(c, p.Bytes/4, m.setupFor(p), f).total()
}

// Fit fits a model to pts on machine mc: alpha and ineff per link, each
// from the points of that link (of the collectives the model knows).
func Fit(pts []Point, mc Machine) (*Model, error) {
	m := &Model{Backend: "mpi", Sharing: mc.Sharing, Fits: map[string]LinkFit{}, Compute: mc.Compute, CPUs: mc.CPUs, Burst: mc.Burst}
	byRate := map[string][]Point{}
	var rates []string
	for _, p := range pts {
		c, ok := findCollective(p.Collective)
		if !ok || c.fitAs != "" || p.Ranks < 2 || !(p.Seconds > 0) {
			continue
		}
		if _, seen := byRate[p.RateName]; !seen {
			rates = append(rates, p.RateName)
		}
		byRate[p.RateName] = append(byRate[p.RateName], p)
	}
	if len(rates) == 0 {
		return nil, errors.New("no measured points of a known collective")
	}
	for _, r := range rates {
		f, err := m.fitLink(byRate[r])
		if err != nil {
			return nil, fmt.Errorf("fitting %s: %w", r, err)
		}
		m.Fits[r] = f
	}
	return m, nil
}

// fitLink fits alpha and ineff to the points of one link by minimising the
// sum of squared relative errors, sum ((predicted - t)/t)^2: weighting by
// 1/t makes latency-bound small sizes and bandwidth-bound large ones count
// alike. The prediction is linear in alpha and ineff but for the bucket's
// tokens, which depend on alpha: Gauss-Newton steps with the derivatives
// taken numerically, non-negative, keeping the best fit seen.
func (m *Model) fitLink(ps []Point) (LinkFit, error) {
	f := LinkFit{Rate: ps[0].Rate, RateName: ps[0].RateName, Points: len(ps), Alpha: 50e-6, Ineff: 1}
	var moved int64
	for _, p := range ps {
		c, _ := findCollective(p.Collective)
		moved += c.wireBytes(p.Bytes/4, p.Ranks)
	}
	if moved == 0 {
		return LinkFit{}, errors.New("no point moves any bytes")
	}
	resid := func(g LinkFit) float64 {
		var s float64
		for _, p := range ps {
			c, _ := findCollective(p.Collective)
			e := m.predict(c, p.Bytes/4, m.setupFor(p), g).total()/p.Seconds - 1
			s += e * e
		}
		return s
	}
	best, bestRes := f, resid(f)
	for range 40 {
		var ata [2][2]float64
		var atb [2]float64
		for _, p := range ps {
			c, _ := findCollective(p.Collective)
			s := m.setupFor(p)
			n := p.Bytes / 4
			t0 := m.predict(c, n, s, f).total()
			da, di := 1e-6, 1e-3
			ga, gi := f, f
			ga.Alpha += da
			gi.Ineff += di
			row := [2]float64{(m.predict(c, n, s, ga).total() - t0) / da / p.Seconds,
				(m.predict(c, n, s, gi).total() - t0) / di / p.Seconds}
			y := (p.Seconds - t0) / p.Seconds
			for i := range 2 {
				for j := range 2 {
					ata[i][j] += row[i] * row[j]
				}
				atb[i] += row[i] * y
			}
		}
		det := ata[0][0]*ata[1][1] - ata[0][1]*ata[1][0]
		if math.Abs(det) < 1e-300 {
			break
		}
		next := f
		next.Alpha = max(0, f.Alpha+(atb[0]*ata[1][1]-atb[1]*ata[0][1])/det)
		next.Ineff = max(1e-3, f.Ineff+(ata[0][0]*atb[1]-ata[1][0]*atb[0])/det)
		r := resid(next)
		if r < bestRes {
			best, bestRes = next, r
		}
		if math.Abs(next.Alpha-f.Alpha) < 1e-9 && math.Abs(next.Ineff-f.Ineff) < 1e-6 {
			break
		}
		f = next
	}
	best.RMS = math.Sqrt(bestRes / float64(len(ps)))
	return best, nil
}
