package main

import (
	"cmp"
	_ "embed"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
)

// The plan command predicts collective and step times with an alpha-beta
// cost model:
//
//	t = rounds(W)*alpha + bottleneck bytes * ineff / rate + compression bytes / compress rate * cpu share
//
// where rounds and the bytes come from each collective's algorithm (the
// collectives table), the link rate is given, and alpha (seconds per
// latency-bound round), ineff (measured time per byte over the nominal
// line rate's: 1 is line rate) and the compression rate are fitted to
// "lowbit bench --json" sweeps recorded with scripts/plan-calibrate.sh.
//
// The bottleneck bytes depend on how the ranks share the network
// (linkSharing): on a shaped loopback every rank's traffic goes through one
// token bucket, so the bottleneck carries W times each rank's wire bytes;
// on a cluster with a link per rank, each link carries that rank's bytes.

func init() {
	register(command{
		name:  "plan",
		usage: "predict collective and step times from an alpha-beta model fitted to lowbit bench runs",
		run: func(args []string, stdout io.Writer) error {
			err := planMain(args, stdout, os.Stderr)
			if errors.Is(err, flag.ErrHelp) {
				return nil
			}
			return err
		},
	})
}

// defaultMeasurements are the runs recorded on the development machine
// by scripts/plan-calibrate.sh: the model's default calibration.
//
//go:embed testdata/plan/measured.json
var defaultMeasurements []byte

// defaultMeasurementsName names defaultMeasurements in output.
const defaultMeasurementsName = "built-in (cmd/lowbit/testdata/plan/measured.json)"

// linkSharing says how the ranks share the network.
type linkSharing string

const (
	// sharedLink: one link carries the traffic of all ranks (the shaped
	// loopback of scripts/plan-calibrate.sh and bench-net.sh: a tbf qdisc
	// on lo caps the total); time per byte applies to W times the bytes
	// each rank sends. The ranks also share the machine's CPUs.
	sharedLink linkSharing = "shared"
	// perRankLink: every rank has a link of the given rate to itself (a
	// cluster with one NIC per rank, full duplex, non-blocking switch);
	// time per byte applies to the bytes each rank sends. Every rank has
	// its own CPU for compression.
	perRankLink linkSharing = "per-rank"
)

func parseSharing(s string) (linkSharing, error) {
	switch linkSharing(s) {
	case sharedLink, perRankLink:
		return linkSharing(s), nil
	}
	return "", fmt.Errorf("unknown link sharing %q (want %s or %s)", s, sharedLink, perRankLink)
}

// collectiveModel is the machine-independent cost structure of one
// collective on float32 data: what it sends, in how many latency-bound
// rounds, and how many bytes go through compression. A new collective
// (qgZ, ...) slots in as one more entry of planCollectives; until it is
// calibrated it uses the pooled network fit and, if it compresses, the
// 1-bit compression rate.
type collectiveModel struct {
	name, desc string
	// wireBytes is what each of w ranks sends for n float32 elements,
	// counted as comm.Stats counts it.
	wireBytes func(n int64, w int) int64
	// rounds is the number of latency-bound message rounds.
	rounds func(w int) float64
	// computeBytes is the float32 bytes one rank alone would run through
	// compression for n elements on w ranks (0: none); computeShare is
	// the fraction of that work each of w ranks does.
	computeBytes func(n int64, w int) int64
	computeShare func(w int) float64
	// fitAs names the collective whose network fit this one borrows
	// until it has its own measurements ("": its own, or the pooled fit).
	fitAs string
	// uncalibrated, when set, says what the model does not measure.
	uncalibrated string
}

// planCollectives are the collectives the model knows, in table order.
var planCollectives = []collectiveModel{
	{
		name:         "allreduce",
		desc:         "exact float32 ring allreduce",
		wireBytes:    func(n int64, w int) int64 { return comm.RingAllReduceBytes(4*n, w) },
		rounds:       func(w int) float64 { return float64(2 * (w - 1)) },
		computeBytes: func(int64, int) int64 { return 0 },
		computeShare: func(int) float64 { return 0 },
	},
	{
		name:         "onebit",
		desc:         "1-bit error-compensated allreduce (onebit.AllReduce)",
		wireBytes:    onebitWireBytes,
		rounds:       func(w int) float64 { return float64(3 * (w - 1)) },
		computeBytes: func(n int64, w int) int64 { return 4 * int64(onebit.PaddedLen(int(n), w)) },
		computeShare: onebitComputeShare,
	},
	{
		name: "fp16",
		desc: "allreduce with float16 on the wire",
		wireBytes: func(n int64, w int) int64 {
			return comm.RingAllReduceBytes(2*n, w)
		},
		rounds:       func(w int) float64 { return float64(2 * (w - 1)) },
		computeBytes: func(int64, int) int64 { return 0 },
		computeShare: func(int) float64 { return 0 },
		fitAs:        "allreduce",
		uncalibrated: "not measured: allreduce's network fit at half the bytes, conversion time left out",
	},
}

// onebitWireBytes is what each rank sends in onebit.AllReduce: with N the
// padded length and C = N/W its chunk, the header all-gather ((W-1)*12),
// the phase 1 all-to-all of packed signs ((W-1)*C/8) and the phase 2
// all-gather of server signs and scale ((W-1)*(C/8+4)).
func onebitWireBytes(n int64, w int) int64 {
	if w <= 1 {
		return 0
	}
	c := int64(onebit.PaddedLen(int(n), w)) / int64(w)
	return int64(w-1) * (2*(c/8) + 16)
}

// onebitComputeShare is the share of one rank's compression work (what
// the 1-rank compute runs time) that each of w ranks does: the worker half
// (error feedback, scale, packing) runs on the whole padded buffer, the
// server half (unpacking W chunks, their sum, recompressing its chunk)
// mostly on 1/W of it. So (1+1/W)/2.
func onebitComputeShare(w int) float64 { return (1 + 1/float64(w)) / 2 }

func findCollective(name string) (collectiveModel, bool) {
	for _, c := range planCollectives {
		if c.name == name {
			return c, true
		}
	}
	return collectiveModel{}, false
}

// measurements is what scripts/plan-calibrate.sh records.
type measurements struct {
	Machine struct {
		CPUs     int    `json:"cpus"`
		Model    string `json:"model"`
		Recorded string `json:"recorded"`
	} `json:"machine"`
	LinkSharing string `json:"link_sharing"`
	// BurstBytes is the token bucket's burst: bytes that pass at once
	// after the link was idle long enough to refill it (tbf burst).
	BurstBytes int64         `json:"burst_bytes"`
	Runs       []measuredRun `json:"runs"`
	// Compute are lowbit bench runs of onebit on the local backend with
	// one rank: compression without a network.
	Compute []benchResult `json:"compute"`
}

// measuredRun is one lowbit bench --json sweep on a link shaped to Rate.
type measuredRun struct {
	Rate   string      `json:"rate"`
	Ranks  int         `json:"ranks"`
	Repeat int         `json:"repeat"`
	Bench  benchResult `json:"bench"`
}

func parseMeasurements(data []byte) (*measurements, error) {
	var m measurements
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("measurements: %w", err)
	}
	if _, err := parseSharing(m.LinkSharing); err != nil {
		return nil, fmt.Errorf("measurements: %w", err)
	}
	if len(m.Runs) == 0 {
		return nil, errors.New("measurements: no runs")
	}
	if m.BurstBytes < 0 {
		return nil, fmt.Errorf("measurements: negative burst %d", m.BurstBytes)
	}
	if m.Machine.CPUs < 1 {
		return nil, fmt.Errorf("measurements: machine has %d cpus", m.Machine.CPUs)
	}
	return &m, nil
}

// planPoint is one collective at one size, rank count and rate: the median
// over repeats of lowbit bench's p50.
type planPoint struct {
	Collective string
	Rate       float64 // link rate, bytes per second
	RateName   string  // as given to tc
	Ranks      int
	Bytes      int64   // float32 bytes per rank
	Wire       int64   // bytes each rank sent, as recorded
	Seconds    float64 // median over repeats of the p50
	Repeats    int
}

// points groups m's rows by setting and takes the median over repeats.
func (m *measurements) points() ([]planPoint, error) {
	type key struct {
		coll  string
		rate  string
		ranks int
		bytes int64
	}
	var order []key
	times := map[key][]float64{}
	wire := map[key]int64{}
	for _, r := range m.Runs {
		if r.Bench.Ranks != r.Ranks {
			return nil, fmt.Errorf("measurements: run at %s says %d ranks, its bench %d", r.Rate, r.Ranks, r.Bench.Ranks)
		}
		if _, err := parseRate(r.Rate); err != nil {
			return nil, fmt.Errorf("measurements: %w", err)
		}
		for _, row := range r.Bench.Results {
			k := key{row.Collective, r.Rate, r.Ranks, row.Bytes}
			if _, ok := times[k]; !ok {
				order = append(order, k)
			}
			times[k] = append(times[k], row.TimeP50us/1e6)
			wire[k] = row.WireBytesPerRank
		}
	}
	pts := make([]planPoint, 0, len(order))
	for _, k := range order {
		rate, _ := parseRate(k.rate)
		pts = append(pts, planPoint{Collective: k.coll, Rate: rate, RateName: k.rate, Ranks: k.ranks,
			Bytes: k.bytes, Wire: wire[k], Seconds: median(times[k]), Repeats: len(times[k])})
	}
	return pts, nil
}

// computePoint is the time one rank alone takes to 1-bit compress Bytes of
// float32 data (worker and server halves, no network): the median over the
// compute runs.
type computePoint struct {
	Bytes   int64   `json:"bytes"`
	Seconds float64 `json:"seconds"`
}

// computeCurves is the onebit rows of the compute runs (local backend, no
// network) by rank count: the median per size, by ascending size. It needs
// a 1-rank curve.
func (m *measurements) computeCurves() (map[int][]computePoint, error) {
	times := map[int]map[int64][]float64{}
	for _, r := range m.Compute {
		if r.Ranks < 1 {
			return nil, fmt.Errorf("measurements: compute run on %d ranks", r.Ranks)
		}
		for _, row := range r.Results {
			if row.Collective == "onebit" && row.Bytes > 0 && row.TimeP50us > 0 {
				if times[r.Ranks] == nil {
					times[r.Ranks] = map[int64][]float64{}
				}
				times[r.Ranks][row.Bytes] = append(times[r.Ranks][row.Bytes], row.TimeP50us/1e6)
			}
		}
	}
	if len(times[1]) == 0 {
		return nil, errors.New("measurements: no 1-rank onebit compute run")
	}
	curves := map[int][]computePoint{}
	for w, bySize := range times {
		var curve []computePoint
		for b, ts := range bySize {
			curve = append(curve, computePoint{Bytes: b, Seconds: median(ts)})
		}
		slices.SortFunc(curve, func(a, b computePoint) int { return int(a.Bytes - b.Bytes) })
		curves[w] = curve
	}
	return curves, nil
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n == 0 {
		return math.NaN()
	}
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// linkFit is the network part of the model for one collective (or all
// pooled): t = rounds*Alpha + B*Ineff/rate + B*Gamma for B bottleneck bytes.
type linkFit struct {
	Alpha float64 `json:"alpha_s"` // seconds per latency-bound round
	Ineff float64 `json:"ineff"`   // time per byte over the line rate's (1: line rate)
	// Gamma is host time per bottleneck byte whatever the rate (copies,
	// TCP on the loopback, reduction arithmetic), on the calibration
	// machine whose CPUs all ranks share; only shared-link predictions
	// use it.
	Gamma float64 `json:"gamma_s_per_byte"`
	// Burst is the bytes a call gets through a shaped link at once: the
	// tokens its bucket holds when the call starts. Between 0 (calls back
	// to back keep the bucket empty) and the tbf burst (an idle link); the
	// fit picks it. Only for the shaped, shared link.
	Burst  int64 `json:"burst_bytes"`
	Points int   `json:"points"`
}

// costModel is a calibrated model: the network fits of one backend and
// link sharing, and the compression speed of one machine.
type costModel struct {
	Backend string             `json:"backend"`
	Sharing linkSharing        `json:"link_sharing"`
	Fits    map[string]linkFit `json:"fits"`
	Pooled  linkFit            `json:"pooled"`
	// Compute is the time of the 1-bit allreduce without a network (local
	// backend) by rank count and size, measured on the calibration machine
	// (it differs per machine): compression, and for W > 1 also the
	// in-memory exchange, with the W ranks sharing the machine's CPUs.
	// Interpolated between sizes, at the largest size's rate beyond it.
	Compute map[int][]computePoint `json:"compute"`
	// CompressBps, when positive, replaces Compute by a fixed rate in
	// float32 bytes per second (lowbit plan --compress-rate).
	CompressBps float64 `json:"compress_bytes_per_s,omitempty"`
	CPUs        int     `json:"cpus"`        // of the machine the calibration ran on
	Burst       int64   `json:"burst_bytes"` // of the calibration's shaped link
	Machine     string  `json:"machine"`
}

// prediction is one collective's predicted time, split into its terms.
type prediction struct {
	Wire       int64 // bytes each rank sends
	Bottleneck int64 // bytes through the slowest link, less a burst
	Latency    float64
	Transfer   float64 // bytes at the link rate
	Host       float64 // per-byte host overhead
	Compute    float64
}

func (p prediction) total() float64 { return p.Latency + p.Transfer + p.Host + p.Compute }

// setup is where a prediction is made.
type setup struct {
	Ranks   int
	Rate    float64 // link rate, bytes per second
	Sharing linkSharing
	// CPUShare is how many ranks share one CPU's compression throughput
	// (at least 1): W/cpus for ranks on one machine, 1 with a CPU (or
	// accelerator) per rank.
	CPUShare float64
	// Burst is the bytes a shaped link lets through at once per call (a
	// refilled token bucket); 0 for a real link.
	Burst int64
}

// fitModel returns the model fitted to pts, per collective and pooled (see
// fitPoints). The compute term, from the compute curve, is subtracted
// before fitting.
func fitModel(pts []planPoint, sharing linkSharing, compute map[int][]computePoint, cpus int, burst int64) (*costModel, error) {
	m := &costModel{Backend: "mpi", Sharing: sharing, Fits: map[string]linkFit{}, Compute: compute, CPUs: cpus, Burst: burst}
	byColl := map[string][]planPoint{}
	var used []planPoint
	for _, p := range pts {
		if _, ok := findCollective(p.Collective); !ok {
			continue // a collective the model does not know: not fitted
		}
		byColl[p.Collective] = append(byColl[p.Collective], p)
		used = append(used, p)
	}
	if len(used) == 0 {
		return nil, errors.New("plan: no measured points of a known collective")
	}
	for name, ps := range byColl {
		f, err := m.fitBurst(ps)
		if err != nil {
			return nil, fmt.Errorf("plan: fitting %s: %w", name, err)
		}
		m.Fits[name] = f
	}
	f, err := m.fitBurst(used)
	if err != nil {
		return nil, fmt.Errorf("plan: pooled fit: %w", err)
	}
	m.Pooled = f
	return m, nil
}

// fitBurst fits the points (fitPoints) with each effective burst of 0,
// 1/16, 1/8, 1/4, 1/2 and all of m.Burst, and keeps the best fit.
func (m *costModel) fitBurst(ps []planPoint) (linkFit, error) {
	var best linkFit
	bestRes := math.Inf(1)
	var firstErr error
	for _, div := range []int64{0, 16, 8, 4, 2, 1} {
		b := int64(0)
		if div > 0 {
			b = m.Burst / div
		}
		if div > 0 && b == 0 {
			continue
		}
		f, res, err := m.fitPoints(ps, b)
		if err != nil {
			firstErr = cmp.Or(firstErr, err)
			continue
		}
		if res < bestRes {
			best, bestRes = f, res
		}
	}
	if math.IsInf(bestRes, 1) {
		return linkFit{}, firstErr
	}
	return best, nil
}

// fitPoints fits alpha, ineff and gamma by non-negative least squares on
// relative errors: it minimises sum ((R alpha + X ineff + B gamma - y)/t)^2
// over the points, with R the rounds, B the bottleneck bytes, X = B/rate, t
// the measured time and y = t less the compute term. Weighting by 1/t makes
// latency-bound small sizes and bandwidth-bound large ones count alike.
// With two link rates X and B are told apart: ineff is what scales with
// the rate, gamma what does not.
// It returns the fit and its sum of squared relative errors.
func (m *costModel) fitPoints(ps []planPoint, burst int64) (linkFit, float64, error) {
	const k = 3
	var ata [k][k]float64
	var atb [k]float64
	var moved, yy float64
	for _, p := range ps {
		c, _ := findCollective(p.Collective)
		if p.Seconds <= 0 || p.Ranks < 2 {
			continue
		}
		s := m.setupFor(p)
		s.Burst = burst
		n := p.Bytes / 4
		b := float64(bottleneckBytes(c.wireBytes(n, p.Ranks), s))
		moved += b
		row := [k]float64{c.rounds(p.Ranks) / p.Seconds, b / s.Rate / p.Seconds, b / p.Seconds}
		y := (p.Seconds - m.computeSeconds(c, n, s)) / p.Seconds
		for i := range k {
			for j := range k {
				ata[i][j] += row[i] * row[j]
			}
			atb[i] += row[i] * y
		}
		yy += y * y
	}
	if moved == 0 {
		return linkFit{}, 0, errors.New("no point moves any bytes")
	}
	// Non-negative least squares by trying every set of free
	// coefficients (the others zero) and keeping the best feasible one.
	best, bestRes := [k]float64{}, math.Inf(1)
	for mask := 1; mask < 1<<k; mask++ {
		x, ok := solveSubset(ata, atb, mask)
		if !ok {
			continue
		}
		feasible := true
		for i := range k {
			feasible = feasible && x[i] >= 0
		}
		// The residual up to a constant: x'AtA x - 2 x'Atb.
		var res float64
		for i := range k {
			for j := range k {
				res += x[i] * ata[i][j] * x[j]
			}
			res -= 2 * x[i] * atb[i]
		}
		if feasible && res < bestRes {
			best, bestRes = x, res
		}
	}
	f := linkFit{Alpha: best[0], Ineff: best[1], Gamma: best[2], Burst: burst, Points: len(ps)}
	if !(f.Ineff > 0 || f.Gamma > 0) {
		return linkFit{}, 0, errors.New("fitted time per byte is zero: the measurements do not depend on the size")
	}
	return f, bestRes + yy, nil
}

// solveSubset solves the normal equations restricted to the coefficients
// in mask (the others zero) by Gaussian elimination.
func solveSubset(ata [3][3]float64, atb [3]float64, mask int) ([3]float64, bool) {
	var idx []int
	for i := range 3 {
		if mask&(1<<i) != 0 {
			idx = append(idx, i)
		}
	}
	n := len(idx)
	a := make([][]float64, n)
	for r, i := range idx {
		a[r] = make([]float64, n+1)
		for c, j := range idx {
			a[r][c] = ata[i][j]
		}
		a[r][n] = atb[i]
	}
	for col := range n {
		piv := col
		for r := col + 1; r < n; r++ {
			if math.Abs(a[r][col]) > math.Abs(a[piv][col]) {
				piv = r
			}
		}
		if math.Abs(a[piv][col]) < 1e-300 {
			return [3]float64{}, false
		}
		a[col], a[piv] = a[piv], a[col]
		for r := range n {
			if r == col {
				continue
			}
			f := a[r][col] / a[col][col]
			for c := col; c <= n; c++ {
				a[r][c] -= f * a[col][c]
			}
		}
	}
	var x [3]float64
	for r, i := range idx {
		x[i] = a[r][n] / a[r][r]
	}
	return x, true
}

// setupFor is the setup a measured point was taken in: ranks on one
// machine of m.CPUs cpus, the calibration's link (the burst is the fit's).
func (m *costModel) setupFor(p planPoint) setup {
	s := setup{Ranks: p.Ranks, Rate: p.Rate, Sharing: m.Sharing, CPUShare: 1}
	if m.Sharing == sharedLink {
		s.CPUShare = max(1, float64(p.Ranks)/float64(m.CPUs))
	}
	return s
}

// bottleneckBytes is what the slowest link carries, less its burst.
func bottleneckBytes(wire int64, s setup) int64 {
	b := wire
	if s.Sharing == sharedLink {
		b *= int64(s.Ranks)
	}
	return max(0, b-s.Burst)
}

// computeSeconds is the compression time of collective c on n elements
// per rank. With the ranks sharing the calibration machine (shared link)
// and a compute run of that rank count, it is that run's time (the ranks'
// real contention for the CPUs and memory). Otherwise it is one rank's
// time on the work c.computeBytes, times the share each rank does, times
// the ranks that share a CPU (CPUShare).
func (m *costModel) computeSeconds(c collectiveModel, n int64, s setup) float64 {
	b := c.computeBytes(n, s.Ranks)
	if b == 0 {
		return 0
	}
	if cv, ok := m.Compute[s.Ranks]; ok && s.Ranks > 1 && s.Sharing == sharedLink && m.CompressBps == 0 {
		return interpolate(cv, b)
	}
	var t float64
	if m.CompressBps > 0 {
		t = float64(b) / m.CompressBps
	} else {
		t = interpolate(m.Compute[1], b)
	}
	return t * c.computeShare(s.Ranks) * s.CPUShare
}

// interpolate is the time of b bytes on curve cv: linear between measured
// sizes, at the nearest end's rate outside them.
func interpolate(cv []computePoint, b int64) float64 {
	if len(cv) == 0 {
		return 0
	}
	rate := func(p computePoint) float64 { return float64(b) * p.Seconds / float64(p.Bytes) }
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

// compressBps is the compression speed used for large tensors.
func (m *costModel) compressBps() float64 {
	if m.CompressBps > 0 {
		return m.CompressBps
	}
	cv := m.Compute[1]
	if len(cv) == 0 {
		return 0
	}
	last := cv[len(cv)-1]
	return float64(last.Bytes) / last.Seconds
}

// fitFor is c's own fit (or that of c.fitAs), else the pooled one; ok
// reports whether c is calibrated: fitted to its own measurements.
func (m *costModel) fitFor(c collectiveModel) (f linkFit, ok bool) {
	name := c.name
	if c.fitAs != "" {
		name = c.fitAs
	}
	f, own := m.Fits[name]
	if !own {
		return m.Pooled, false
	}
	return f, c.fitAs == "" && c.uncalibrated == ""
}

// predict is the time of collective c on n float32 elements per rank.
func (m *costModel) predict(c collectiveModel, n int64, s setup) prediction {
	if s.Ranks < 2 {
		return prediction{}
	}
	f, _ := m.fitFor(c)
	if s.Sharing == sharedLink && s.Burst == 0 {
		s.Burst = f.Burst
	}
	p := prediction{Wire: c.wireBytes(n, s.Ranks)}
	p.Bottleneck = bottleneckBytes(p.Wire, s)
	p.Latency = c.rounds(s.Ranks) * f.Alpha
	p.Transfer = float64(p.Bottleneck) * f.Ineff / s.Rate
	if s.Sharing == sharedLink {
		// On the loopback the CPUs move every byte; a NIC does not
		// need the ranks' CPUs for that, so per-rank links leave it out.
		p.Host = float64(p.Bottleneck) * f.Gamma
	}
	p.Compute = m.computeSeconds(c, n, s)
	return p
}

// parseRate parses a link rate with tc's units: bit, kbit, mbit, gbit,
// tbit are bits per second, bps, kbps, mbps, gbps, tbps bytes per second
// (decimal prefixes, case-insensitive). It returns bytes per second.
func parseRate(s string) (float64, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	units := []struct {
		suffix string
		bytes  float64
	}{
		{"tbit", 1e12 / 8}, {"gbit", 1e9 / 8}, {"mbit", 1e6 / 8}, {"kbit", 1e3 / 8}, {"bit", 1.0 / 8},
		{"tbps", 1e12}, {"gbps", 1e9}, {"mbps", 1e6}, {"kbps", 1e3}, {"bps", 1},
	}
	for _, u := range units {
		if num, ok := strings.CutSuffix(t, u.suffix); ok {
			v, err := strconv.ParseFloat(num, 64)
			if err != nil || !(v > 0) || math.IsInf(v, 0) {
				break
			}
			return v * u.bytes, nil
		}
	}
	return 0, fmt.Errorf("invalid link rate %q: want a positive number with a tc unit, such as 10gbit, 250mbit or 1.25gbps (bytes/s)", s)
}

// formatRate writes bytes per second as bits per second.
func formatRate(bps float64) string {
	b := bps * 8
	switch {
	case b >= 1e12:
		return strconv.FormatFloat(b/1e12, 'g', 4, 64) + " Tbit/s"
	case b >= 1e9:
		return strconv.FormatFloat(b/1e9, 'g', 4, 64) + " Gbit/s"
	case b >= 1e6:
		return strconv.FormatFloat(b/1e6, 'g', 4, 64) + " Mbit/s"
	}
	return strconv.FormatFloat(b/1e3, 'g', 4, 64) + " kbit/s"
}

// formatSeconds writes a duration in seconds with three significant
// digits and a readable unit.
func formatSeconds(s float64) string {
	switch {
	case s == 0:
		return "0"
	case s < 1e-3:
		return strconv.FormatFloat(s*1e6, 'f', 0, 64) + "µs"
	case s < 1:
		ms := s * 1e3
		prec := 2
		if ms >= 100 {
			prec = 0
		} else if ms >= 10 {
			prec = 1
		}
		return strconv.FormatFloat(ms, 'f', prec, 64) + "ms"
	}
	return strconv.FormatFloat(s, 'f', 2, 64) + "s"
}

// planConfig is a parsed lowbit plan command line.
type planConfig struct {
	fit          bool // lowbit plan fit: print the fit and each point's error
	params       float64
	ranks        int
	rate         float64
	sharing      linkSharing
	collectives  []string
	measurements string  // file; "" for the built-in ones
	compressBps  float64 // > 0 overrides the measured rate
	stepCompute  time.Duration
	asJSON       bool
}

func parsePlanFlags(args []string, out io.Writer) (*planConfig, error) {
	cfg := &planConfig{}
	if len(args) > 0 && args[0] == "fit" {
		cfg.fit = true
		args = args[1:]
	}
	fs := flag.NewFlagSet("plan", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Float64Var(&cfg.params, "params", 1.3e9, "model parameters: float32 gradient elements (1.3e9 accepted)")
	fs.IntVar(&cfg.ranks, "ranks", 64, "data-parallel ranks W (at least 2)")
	link := fs.String("link", "10gbit", "link rate, tc units: 10gbit, 250mbit, 1.25gbps (bytes/s)")
	sharing := fs.String("sharing", string(perRankLink), "per-rank: each rank has a link of this rate (a cluster); shared: one link carries all ranks' traffic and the ranks share the calibration machine's CPUs (the shaped loopback)")
	list := fs.String("collective", "allreduce,onebit", "comma-separated collectives: allreduce, onebit, fp16 (fp16 is not calibrated)")
	fs.StringVar(&cfg.measurements, "measurements", "", "calibrate from this file of scripts/plan-calibrate.sh (default: the built-in runs recorded on the development machine)")
	fs.Float64Var(&cfg.compressBps, "compress-rate", 0, "1-bit compression throughput in float32 bytes/s per rank (default: measured on the calibration machine; time yours with lowbit bench --backend local --ranks 1 --collective onebit)")
	fs.DurationVar(&cfg.stepCompute, "step-compute", 0, "forward and backward time of one step, added to each step time")
	fs.BoolVar(&cfg.asJSON, "json", false, "write JSON")
	fs.Usage = func() {
		fmt.Fprint(out, `usage: lowbit plan [flags]
       lowbit plan fit [--measurements FILE] [--json]

Predicts the gradient communication time of one data-parallel step: a model
of --params float32 parameters on --ranks ranks linked at --link, for each
collective, with an alpha-beta model

  t = rounds(W)*alpha + bottleneck bytes * ineff / link rate + compression

alpha (per latency-bound round) and ineff (time per byte over the line
rate's) are fitted by least squares to lowbit bench --json sweeps at several
rank counts and shaped link rates (scripts/plan-calibrate.sh records them);
compression is bytes / the 1-bit compression rate measured on the
calibration machine, which differs per machine (--compress-rate). Bottleneck
bytes are each rank's wire bytes with --sharing per-rank, W times them with
--sharing shared (the shaped loopback the calibration runs on).

"lowbit plan fit" prints the fitted model and, for each measured point,
the prediction and its relative error.

`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if cfg.fit {
		return cfg, nil
	}
	var err error
	if cfg.sharing, err = parseSharing(*sharing); err != nil {
		return nil, err
	}
	if cfg.rate, err = parseRate(*link); err != nil {
		return nil, err
	}
	switch {
	case !(cfg.params >= 1) || cfg.params > 1e15:
		return nil, fmt.Errorf("--params must be in [1, 1e15], got %g", cfg.params)
	case cfg.ranks < 2 || cfg.ranks > 1<<20:
		return nil, fmt.Errorf("--ranks must be in [2, %d], got %d", 1<<20, cfg.ranks)
	case cfg.compressBps < 0 || math.IsInf(cfg.compressBps, 0) || math.IsNaN(cfg.compressBps):
		return nil, fmt.Errorf("--compress-rate must be positive, got %g", cfg.compressBps)
	case cfg.stepCompute < 0:
		return nil, fmt.Errorf("--step-compute must not be negative, got %s", cfg.stepCompute)
	}
	for name := range strings.SplitSeq(*list, ",") {
		name = strings.TrimSpace(name)
		if _, ok := findCollective(name); !ok {
			var names []string
			for _, c := range planCollectives {
				names = append(names, c.name)
			}
			return nil, fmt.Errorf("unknown collective %q (want %s)", name, strings.Join(names, ", "))
		}
		if !slices.Contains(cfg.collectives, name) {
			cfg.collectives = append(cfg.collectives, name)
		}
	}
	return cfg, nil
}

// loadModel reads the measurements (file or built-in) and fits the model.
func loadModel(file string) (*costModel, *measurements, []planPoint, string, error) {
	data, name := defaultMeasurements, defaultMeasurementsName
	if file != "" {
		var err error
		if data, err = os.ReadFile(file); err != nil {
			return nil, nil, nil, "", err
		}
		name = file
	}
	meas, err := parseMeasurements(data)
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("%s: %w", name, err)
	}
	pts, err := meas.points()
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("%s: %w", name, err)
	}
	curve, err := meas.computeCurves()
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("%s: %w", name, err)
	}
	m, err := fitModel(pts, linkSharing(meas.LinkSharing), curve, meas.Machine.CPUs, meas.BurstBytes)
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("%s: %w", name, err)
	}
	m.Machine = fmt.Sprintf("%s, %d cpus, recorded %s", meas.Machine.Model, meas.Machine.CPUs, meas.Machine.Recorded)
	return m, meas, pts, name, nil
}

func planMain(args []string, stdout, stderr io.Writer) error {
	cfg, err := parsePlanFlags(args, stderr)
	if err != nil {
		return err
	}
	m, _, pts, source, err := loadModel(cfg.measurements)
	if err != nil {
		return err
	}
	if cfg.fit {
		return writeFit(stdout, m, pts, source, cfg.asJSON)
	}
	if cfg.compressBps > 0 {
		m.CompressBps = cfg.compressBps
	}
	return writePlan(stdout, m, cfg, source)
}

// pointCheck is one measured point against the model.
type pointCheck struct {
	Collective string  `json:"collective"`
	Rate       string  `json:"rate"`
	Ranks      int     `json:"ranks"`
	Bytes      int64   `json:"bytes"`
	Measured   float64 `json:"measured_s"`
	Predicted  float64 `json:"predicted_s"`
	RelError   float64 `json:"rel_error"` // predicted/measured - 1
}

func checkPoints(m *costModel, pts []planPoint) []pointCheck {
	var out []pointCheck
	for _, p := range pts {
		c, ok := findCollective(p.Collective)
		if !ok {
			continue
		}
		pred := m.predict(c, p.Bytes/4, m.setupFor(p)).total()
		out = append(out, pointCheck{Collective: p.Collective, Rate: p.RateName, Ranks: p.Ranks, Bytes: p.Bytes,
			Measured: p.Seconds, Predicted: pred, RelError: pred/p.Seconds - 1})
	}
	return out
}

func writeFit(w io.Writer, m *costModel, pts []planPoint, source string, asJSON bool) error {
	checks := checkPoints(m, pts)
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			Model  *costModel   `json:"model"`
			Points []pointCheck `json:"points"`
		}{m, checks})
	}
	fmt.Fprintf(w, "# lowbit plan fit: %s\n# machine: %s; link sharing: %s\n", source, m.Machine, m.Sharing)
	names := make([]string, 0, len(m.Fits))
	for n := range m.Fits {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		f := m.Fits[n]
		fmt.Fprintf(w, "%-10s alpha %s per round, ineff %.3f, host %.3g ns per byte, burst %s, %d points\n",
			n, formatSeconds(f.Alpha), f.Ineff, f.Gamma*1e9, formatSize(f.Burst), f.Points)
	}
	f := m.Pooled
	fmt.Fprintf(w, "%-10s alpha %s per round, ineff %.3f, host %.3g ns per byte, burst %s, %d points\n",
		"pooled", formatSeconds(f.Alpha), f.Ineff, f.Gamma*1e9, formatSize(f.Burst), f.Points)
	ranks := make([]int, 0, len(m.Compute))
	for r := range m.Compute {
		ranks = append(ranks, r)
	}
	slices.Sort(ranks)
	for _, r := range ranks {
		fmt.Fprintf(w, "1-bit allreduce without network, %d ranks on %d cpus:", r, m.CPUs)
		for _, p := range m.Compute[r] {
			fmt.Fprintf(w, " %s %s;", formatSize(p.Bytes), formatSeconds(p.Seconds))
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "collective\trate\tranks\tsize\tmeasured\tpredicted\terror\t\n")
	worst := 0.0
	for _, c := range checks {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%+.1f%%\t\n", c.Collective, c.Rate, c.Ranks, formatSize(c.Bytes),
			formatSeconds(c.Measured), formatSeconds(c.Predicted), 100*c.RelError)
		worst = max(worst, math.Abs(c.RelError))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "largest error: %.1f%% over %d points\n", 100*worst, len(checks))
	return err
}

// planRow is one collective's predicted step.
type planRow struct {
	Collective   string  `json:"collective"`
	Calibrated   bool    `json:"calibrated"`
	WirePerRank  int64   `json:"wire_bytes_per_rank"`
	Bottleneck   int64   `json:"bottleneck_bytes"`
	LatencyS     float64 `json:"latency_s"`
	TransferS    float64 `json:"transfer_s"` // at the link rate, plus host time per byte on a shared link
	CompressS    float64 `json:"compress_s"`
	CommS        float64 `json:"comm_s"`
	StepS        float64 `json:"step_s"`
	SpeedupExact float64 `json:"speedup_vs_exact,omitempty"`
}

func writePlan(w io.Writer, m *costModel, cfg *planConfig, source string) error {
	n := int64(math.Round(cfg.params))
	s := setup{Ranks: cfg.ranks, Rate: cfg.rate, Sharing: cfg.sharing, CPUShare: 1}
	if cfg.sharing == sharedLink {
		s.CPUShare = max(1, float64(cfg.ranks)/float64(m.CPUs))
	}
	exact := m.predict(planCollectives[0], n, s).total() + cfg.stepCompute.Seconds()
	var rows []planRow
	for _, name := range cfg.collectives {
		c, _ := findCollective(name)
		p := m.predict(c, n, s)
		_, calibrated := m.fitFor(c)
		r := planRow{Collective: name, Calibrated: calibrated, WirePerRank: p.Wire, Bottleneck: p.Bottleneck,
			LatencyS: p.Latency, TransferS: p.Transfer + p.Host, CompressS: p.Compute, CommS: p.total(),
			StepS: p.total() + cfg.stepCompute.Seconds()}
		if r.StepS > 0 {
			r.SpeedupExact = exact / r.StepS
		}
		rows = append(rows, r)
	}
	if cfg.asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			Params      int64      `json:"params"`
			Ranks       int        `json:"ranks"`
			LinkBps     float64    `json:"link_bytes_per_s"`
			Sharing     string     `json:"link_sharing"`
			StepCompute float64    `json:"step_compute_s"`
			Model       *costModel `json:"model"`
			Rows        []planRow  `json:"collectives"`
		}{n, cfg.ranks, cfg.rate, string(cfg.sharing), cfg.stepCompute.Seconds(), m, rows})
	}
	fmt.Fprintf(w, "# lowbit plan: %.4g parameters (%s float32 gradient), %d ranks, %s links (%s)\n",
		cfg.params, bytesDecimal(float64(4*n)), cfg.ranks, formatRate(cfg.rate), cfg.sharing)
	fmt.Fprintf(w, "# calibration: %s; %s\n", source, m.Machine)
	fmt.Fprintf(w, "# 1-bit compression at %.2f GB/s per rank", m.compressBps()/1e9)
	if cfg.compressBps == 0 {
		fmt.Fprint(w, " (measured on the calibration machine: yours differs, set --compress-rate)")
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "collective\tbytes/rank\tlatency\ttransfer\tcompress\tstep\tspeedup vs exact\t\n")
	for _, r := range rows {
		name := r.Collective
		if !r.Calibrated {
			name += "*"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%.2fx\t\n", name, bytesDecimal(float64(r.WirePerRank)),
			formatSeconds(r.LatencyS), formatSeconds(r.TransferS), formatSeconds(r.CompressS), formatSeconds(r.StepS), r.SpeedupExact)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if cfg.sharing == perRankLink {
		fmt.Fprintln(w, "transfer: at the link rate times the fitted inefficiency; the calibration's per-byte host time (loopback TCP on shared CPUs) is left out.")
	}
	note := "step: gradient communication"
	if cfg.stepCompute > 0 {
		note += fmt.Sprintf(" + %s forward and backward", cfg.stepCompute)
	}
	fmt.Fprintln(w, note+"; bytes/rank: what each rank sends.")
	for _, r := range rows {
		if r.Calibrated {
			continue
		}
		c, _ := findCollective(r.Collective)
		why := c.uncalibrated
		if why == "" {
			why = "no measurements: the pooled network fit"
		}
		fmt.Fprintf(w, "%s*: %s\n", r.Collective, why)
	}
	return nil
}

// bytesDecimal writes a byte count with a decimal unit.
func bytesDecimal(b float64) string {
	switch {
	case b >= 1e12:
		return fmt.Sprintf("%.2f TB", b/1e12)
	case b >= 1e9:
		return fmt.Sprintf("%.2f GB", b/1e9)
	case b >= 1e6:
		return fmt.Sprintf("%.1f MB", b/1e6)
	case b >= 1e3:
		return fmt.Sprintf("%.1f kB", b/1e3)
	}
	return fmt.Sprintf("%.0f B", b)
}
