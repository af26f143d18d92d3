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
	"github.com/lowbit-ml/lowbit/optim"
)

// The plan command predicts collective and step times with an alpha-beta
// cost model (docs/plan.md). A collective call is the sequence of steps its
// algorithm runs (collectiveModel.steps): local work, then a message
// exchange of some latency-bound rounds and some bytes per rank. A step
// takes
//
//	pre + rounds*alpha + overlap(work, bytes*beta)
//
// with beta = ineff/rate seconds per byte through the bottleneck link. alpha
// (seconds per round) and ineff (time per byte over the nominal line rate's)
// are fitted per link to "lowbit bench --json" sweeps recorded with
// scripts/plan-calibrate.sh; the local work is not fitted but measured: the
// 1-bit allreduce timed without a network.
//
// On the shaped loopback of the calibration (linkSharing shared) one token
// bucket carries every rank's bytes, and it lets through at once the tokens
// it gathered while the link was idle (during local work, latency rounds
// and the benchmark's barrier), up to its burst: the model runs that bucket
// through the steps of back-to-back calls, as lowbit bench makes them.

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
	// each rank sends, less the bucket's tokens. The ranks also share the
	// machine's CPUs.
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

// step is one stage of a collective call: pre seconds of local work, then a
// message exchange of rounds latency-bound rounds in which each rank sends
// bytes; work seconds of local work run alongside the exchange, overlapped
// in pieces when pieces > 1 (pipelining), after it otherwise.
type step struct {
	pre, work float64
	rounds    float64
	bytes     int64
	pieces    int
}

// collectiveModel is the machine-independent cost structure of one
// collective on float32 data.
type collectiveModel struct {
	name, desc string
	// wireBytes is what each of w ranks sends for n float32 elements,
	// counted as comm.Stats counts it (the sum of the steps' bytes).
	wireBytes func(n int64, w int) int64
	// steps is a call on n elements per rank on w ranks, with compute
	// seconds of local work in all (0 for the exact collectives), as its
	// algorithm runs it.
	steps func(n int64, w int, compute float64) []step
	// compresses says whether the call has local compression work: the
	// 1-bit allreduce's time without a network.
	compresses bool
	// fitAs names the collective whose measurements this one borrows ("":
	// its own).
	fitAs string
	// uncalibrated, when set, says what the model does not measure.
	uncalibrated string
}

// planCollectives are the collectives the model knows, in table order.
var planCollectives = []collectiveModel{
	{
		name:      "allreduce",
		desc:      "exact float32 ring allreduce (MPI_Allreduce)",
		wireBytes: func(n int64, w int) int64 { return comm.RingAllReduceBytes(4*n, w) },
		steps: func(n int64, w int, _ float64) []step {
			return []step{{rounds: float64(2 * (w - 1)), bytes: comm.RingAllReduceBytes(4*n, w)}}
		},
	},
	{
		name:       "onebit",
		desc:       "1-bit error-compensated allreduce (onebit.AllReduce)",
		wireBytes:  onebitWireBytes,
		steps:      onebitSteps,
		compresses: true,
	},
	{
		name:      "fp16",
		desc:      "allreduce with float16 on the wire",
		wireBytes: func(n int64, w int) int64 { return comm.RingAllReduceBytes(2*n, w) },
		steps: func(n int64, w int, _ float64) []step {
			return []step{{rounds: float64(2 * (w - 1)), bytes: comm.RingAllReduceBytes(2*n, w)}}
		},
		fitAs:        "allreduce",
		uncalibrated: "not measured: the exact allreduce's model at half the bytes, float16 conversion left out",
	},
}

// The pipelining of onebit.AllReduce (onebit/allreduce.go: pieceTarget,
// maxPieces, State.setPieces): each chunk's packed bytes travel in pieces
// of about 64 KiB per destination, at most 16. TestOnebitPieces checks the
// copy against the collective's behaviour on the local backend.
const (
	onebitPieceTarget = 64 << 10
	onebitMaxPieces   = 16
)

// onebitPieces is K, the pieces each chunk of a call on n elements and w
// ranks travels in (1: not pipelined), as onebit.NewState picks it.
func onebitPieces(n int64, w int) int {
	if w < 2 {
		return 1
	}
	chunkBytes := int64(onebit.PaddedLen(int(n), w)) / int64(w) / 8
	k := max(1, min(chunkBytes/onebitPieceTarget, onebitMaxPieces, chunkBytes))
	pieceBytes := (chunkBytes + k - 1) / k
	if pieceBytes == 0 {
		return 1
	}
	return int((chunkBytes + pieceBytes - 1) / pieceBytes)
}

// onebitWireBytes is what each rank sends in onebit.AllReduce: with N the
// padded length and C = N/W its chunk, the header all-gather of scale and
// length ((W-1)*12), the phase 1 all-to-all of packed signs ((W-1)*C/8;
// when pipelined (W-1)*4 more: the worker scales travel in it), and the
// phase 2 all-gather of server scale and signs ((W-1)*(4+C/8)).
func onebitWireBytes(n int64, w int) int64 {
	if w <= 1 {
		return 0
	}
	c := int64(onebit.PaddedLen(int(n), w)) / int64(w)
	b := int64(w-1) * (2*(c/8) + 16)
	if onebitPieces(n, w) > 1 {
		b += int64(w-1) * 4
	}
	return b
}

// onebitSteps is onebit.AllReduce as it runs now (three collectives, large
// tensors pipelined in K pieces), with its local work split by the passes
// it makes over the padded buffer of N elements (C = N/W):
// the worker norm or the worker residual (N), packing with error feedback
// (N), the server's unpack-and-sum of W chunks (N) and its compression
// (C), unpacking the output (N): 4 + 1/W passes.
//
//   - header: all-gather of scale and length, after the worker norm;
//     pipelined, of the length only, at once;
//   - phase 1: all-to-all of the packed chunks, after packing; pipelined,
//     packing, the worker residual and the server's sum overlap the pieces
//     on the wire, and the worker scales travel in the piece that starts
//     the second half;
//   - phase 2: all-gather of server scale and signs, after the server's
//     compression (and its sum, unpipelined); unpacking the output follows
//     it, or overlaps its pieces when pipelined.
//
// Every collective is counted as W-1 latency-bound rounds (ring all-gather,
// pairwise all-to-all), once per piece.
func onebitSteps(n int64, w int, compute float64) []step {
	if w <= 1 || n <= 0 {
		return nil
	}
	c := int64(onebit.PaddedLen(int(n), w)) / int64(w)
	k := onebitPieces(n, w)
	pass := compute / (4 + 1/float64(w))
	r := float64(w - 1)
	hdr := step{pre: pass, rounds: r, bytes: int64(w-1) * 12}
	p1 := step{rounds: float64(k) * r, bytes: int64(w-1) * (c / 8), pieces: k}
	p2 := step{rounds: float64(k) * r, bytes: int64(w-1) * (4 + c/8), pieces: k, work: pass}
	if k > 1 {
		hdr.pre = 0
		p1.work = 3 * pass
		p1.bytes += int64(w-1) * 4
		p2.pre = pass / float64(w)
	} else {
		p1.pre = pass
		p2.pre = pass * (1 + 1/float64(w))
	}
	return []step{hdr, p1, p2}
}

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
	// BurstBytes is the token bucket's burst (tbf burst): bytes that pass
	// at once after the link was idle long enough to refill it.
	BurstBytes int64         `json:"burst_bytes"`
	Runs       []measuredRun `json:"runs"`
	// Compute are lowbit bench runs of onebit on the local backend:
	// compression without a network, on 1 rank and on each rank count of
	// the runs.
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
	// Spread is (max - min) / median of the repeats' p50s: how well the
	// measurement reproduces.
	Spread  float64
	Repeats int
	// Warmup and Iters are the benchmark's untimed and timed calls.
	Warmup, Iters int
	// Before is what the benchmark ran before this point in the same run
	// (sizes outermost, then collectives, in order): it leaves the token
	// bucket of a shaped link as this point finds it.
	Before []benchedCase
}

// benchedCase is one collective at one size of a lowbit bench run.
type benchedCase struct {
	Collective string
	Bytes      int64 // float32 bytes per rank
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
	calls := map[key][2]int{}
	before := map[key][]benchedCase{}
	for _, r := range m.Runs {
		if r.Bench.Ranks != r.Ranks {
			return nil, fmt.Errorf("measurements: run at %s says %d ranks, its bench %d", r.Rate, r.Ranks, r.Bench.Ranks)
		}
		if _, err := parseRate(r.Rate); err != nil {
			return nil, fmt.Errorf("measurements: %w", err)
		}
		var ran []benchedCase
		for _, row := range r.Bench.Results {
			k := key{row.Collective, r.Rate, r.Ranks, row.Bytes}
			if _, ok := times[k]; !ok {
				order = append(order, k)
				before[k] = slices.Clone(ran)
			}
			ran = append(ran, benchedCase{row.Collective, row.Bytes})
			times[k] = append(times[k], row.TimeP50us/1e6)
			wire[k] = row.WireBytesPerRank
			calls[k] = [2]int{r.Bench.Warmup, r.Bench.Iterations}
		}
	}
	pts := make([]planPoint, 0, len(order))
	for _, k := range order {
		rate, _ := parseRate(k.rate)
		ts := times[k]
		med := median(ts)
		pts = append(pts, planPoint{Collective: k.coll, Rate: rate, RateName: k.rate, Ranks: k.ranks,
			Bytes: k.bytes, Wire: wire[k], Seconds: med, Spread: (slices.Max(ts) - slices.Min(ts)) / med,
			Repeats: len(ts), Warmup: calls[k][0], Iters: calls[k][1], Before: before[k]})
	}
	return pts, nil
}

// computePoint is the time of the 1-bit allreduce without a network on
// Bytes of float32 data per rank.
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

// linkFit is the network part of the model for one link: alpha and beta =
// Ineff/rate.
type linkFit struct {
	Rate     float64 `json:"rate_bytes_per_s"`
	RateName string  `json:"rate"`
	Alpha    float64 `json:"alpha_s"` // seconds per latency-bound round
	Ineff    float64 `json:"ineff"`   // time per byte over the line rate's (1: line rate)
	Points   int     `json:"points"`
	// RMS is the root mean square relative error of the fit on its
	// points.
	RMS float64 `json:"rms_rel_error"`
}

// costModel is a calibrated model: the network fit of each link of one
// backend and link sharing, and the compression speed of one machine.
type costModel struct {
	Backend string      `json:"backend"`
	Sharing linkSharing `json:"link_sharing"`
	// Fits are the link fits by rate name ("1gbit").
	Fits map[string]linkFit `json:"fits"`
	// Compute is the time of the 1-bit allreduce without a network (local
	// backend) by rank count and size, measured on the calibration machine
	// (it differs per machine): compression, and for W > 1 also the
	// in-memory exchange, with the W ranks sharing the machine's CPUs.
	// Interpolated between sizes, at the nearest end's rate outside them.
	Compute map[int][]computePoint `json:"compute"`
	// CompressBps, when positive, replaces the measured 1-rank curve by a
	// fixed rate: float32 bytes per second through a 1-rank call (lowbit
	// plan --compress-rate).
	CompressBps float64 `json:"compress_bytes_per_s,omitempty"`
	CPUs        int     `json:"cpus"`        // of the machine the calibration ran on
	Burst       int64   `json:"burst_bytes"` // of the calibration's shaped link
	Machine     string  `json:"machine"`
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

// setup is where a prediction is made.
type setup struct {
	Ranks   int
	Rate    float64 // link rate, bytes per second
	Sharing linkSharing
	// Burst is the token bucket's burst on a shaped shared link (0: a real
	// link).
	Burst int64
	// Warmup and Iters are the untimed and timed calls of the lowbit bench
	// run predicted on a shaped link (Iters 0: the steady state).
	Warmup, Iters int
	// Before is what that bench run did first, each with Warmup + Iters
	// calls: on a shaped link it drains the bucket this call starts from.
	Before []benchedCase
}

// computeSeconds is the local work of a call of collective c on n elements
// per rank. On the calibration's shared link, with a compute run of that
// rank count, it is that run's time (the ranks' real contention for the
// machine's CPUs). Otherwise one rank alone on the padded buffer (the
// 1-rank curve or --compress-rate), times (4+1/W)/5, the share of its
// passes each of W ranks makes (onebitSteps), on a CPU of its own; on the
// shared machine W ranks take turns on its CPUs.
func (m *costModel) computeSeconds(c collectiveModel, n int64, s setup) float64 {
	if !c.compresses || n <= 0 {
		return 0
	}
	if cv, ok := m.Compute[s.Ranks]; ok && s.Ranks > 1 && s.Sharing == sharedLink && m.CompressBps == 0 {
		return interpolate(cv, 4*n)
	}
	b := 4 * int64(onebit.PaddedLen(int(n), s.Ranks))
	var t float64
	if m.CompressBps > 0 {
		t = float64(b) / m.CompressBps
	} else {
		t = interpolate(m.Compute[1], b)
	}
	t *= (4 + 1/float64(s.Ranks)) / 5
	if s.Sharing == sharedLink && m.CPUs > 0 {
		// Ranks without a compute run of their count on the shared
		// machine: they take turns on its CPUs.
		t *= max(1, float64(s.Ranks)/float64(m.CPUs))
	}
	return t
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
// on the shared link, alpha is scaled by W/cpus.
func (m *costModel) predict(c collectiveModel, n int64, s setup, f linkFit) prediction {
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
func (m *costModel) caseSetupSeconds(n int64, s setup) float64 {
	t := benchSetupPerElement * float64(n)
	if m.CPUs > 0 {
		t *= max(1, float64(s.Ranks)/float64(m.CPUs))
	}
	return t
}

// callFrom is one benchmarked call of c (after its barrier and copy) from
// the bucket's tokens, which it updates.
func (m *costModel) callFrom(c collectiveModel, n int64, s setup, f linkFit, tokens *float64) prediction {
	alpha := m.alphaFor(s, f)
	gap := barrierRounds(s.Ranks)*alpha + m.copySeconds(n, s)
	*tokens = min(float64(s.Burst), *tokens+gap*s.Rate)
	return m.oneCall(c, n, s, f, tokens)
}

// alphaFor is the fitted alpha, scaled by W/cpus with more ranks than the
// calibration machine's CPUs on the shared link.
func (m *costModel) alphaFor(s setup, f linkFit) float64 {
	alpha := f.Alpha
	if s.Sharing == sharedLink && m.CPUs > 0 {
		// More ranks than the machine has CPUs: a round waits for its
		// receiver to be scheduled (oversubscription).
		alpha *= max(1, float64(s.Ranks)/float64(m.CPUs))
	}
	return alpha
}

// oneCall is one call of c from the bucket's tokens, which it updates.
func (m *costModel) oneCall(c collectiveModel, n int64, s setup, f linkFit, tokens *float64) prediction {
	compute := m.computeSeconds(c, n, s)
	steps := c.steps(n, s.Ranks, compute)
	beta := f.Ineff / s.Rate
	share := int64(1)
	if s.Sharing == sharedLink {
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
func (m *costModel) predictFrom(c collectiveModel, n int64, s setup, f linkFit, tokens float64) prediction {
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
func (m *costModel) copySeconds(n int64, s setup) float64 {
	one, _ := findCollective("onebit")
	return m.computeSeconds(one, n, setup{Ranks: 1, Rate: s.Rate, Sharing: perRankLink}) / (4 + 1)
}

// fitFor is the fit of the link named rate, or, for a rate without
// measurements, the calibrated link nearest in rate (ok false).
func (m *costModel) fitFor(rateName string, rate float64) (f linkFit, ok bool) {
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
func (m *costModel) setupFor(p planPoint) setup {
	s := setup{Ranks: p.Ranks, Rate: p.Rate, Sharing: m.Sharing, Warmup: p.Warmup, Iters: p.Iters, Before: p.Before}
	if m.Sharing == sharedLink {
		s.Burst = m.Burst
	}
	return s
}

// predictPoint is the model's time for a measured point, with the fit of
// its link (or the nearest one).
func (m *costModel) predictPoint(p planPoint) float64 {
	c, ok := findCollective(p.Collective)
	if !ok {
		return math.NaN()
	}
	f, _ := m.fitFor(p.RateName, p.Rate)
	return m.predict(c, p.Bytes/4, m.setupFor(p), f).total()
}

// fitModel returns the model fitted to pts: alpha and ineff per link, each
// from the points of that link (of the collectives the model knows).
func fitModel(pts []planPoint, sharing linkSharing, compute map[int][]computePoint, cpus int, burst int64) (*costModel, error) {
	m := &costModel{Backend: "mpi", Sharing: sharing, Fits: map[string]linkFit{}, Compute: compute, CPUs: cpus, Burst: burst}
	byRate := map[string][]planPoint{}
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
		return nil, errors.New("plan: no measured points of a known collective")
	}
	for _, r := range rates {
		f, err := m.fitLink(byRate[r])
		if err != nil {
			return nil, fmt.Errorf("plan: fitting %s: %w", r, err)
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
func (m *costModel) fitLink(ps []planPoint) (linkFit, error) {
	f := linkFit{Rate: ps[0].Rate, RateName: ps[0].RateName, Points: len(ps), Alpha: 50e-6, Ineff: 1}
	var moved int64
	for _, p := range ps {
		c, _ := findCollective(p.Collective)
		moved += c.wireBytes(p.Bytes/4, p.Ranks)
	}
	if moved == 0 {
		return linkFit{}, errors.New("no point moves any bytes")
	}
	resid := func(g linkFit) float64 {
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
	holdout      bool // lowbit plan fit --holdout: each rank count predicted from the others
	params       float64
	ranks        int
	rate         float64
	rateName     string
	sharing      linkSharing
	collectives  []string
	measurements string  // file; "" for the built-in ones
	compressBps  float64 // > 0 overrides the measured rate
	alpha        float64 // > 0 overrides the fitted alpha
	ineff        float64 // > 0 overrides the link efficiency
	bucketBytes  int64
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
	fs.StringVar(&cfg.rateName, "link", "10gbit", "link rate, tc units: 10gbit, 250mbit, 1.25gbps (bytes/s)")
	sharing := fs.String("sharing", string(perRankLink), "per-rank: each rank has a link of this rate (a cluster); shared: one shaped link carries all ranks' traffic and the ranks share the calibration machine's CPUs (the calibration's loopback)")
	list := fs.String("collective", "allreduce,onebit", "comma-separated collectives: allreduce, onebit, fp16 (fp16 is not calibrated)")
	fs.StringVar(&cfg.measurements, "measurements", "", "calibrate from this file of scripts/plan-calibrate.sh (default: the built-in runs recorded on the development machine)")
	fs.Float64Var(&cfg.compressBps, "compress-rate", 0, "float32 bytes/s a 1-rank onebit.AllReduce gets through on your hardware (default: measured on the calibration machine; time yours with lowbit bench --backend local --ranks 1 --collective onebit: bytes/p50)")
	fs.Float64Var(&cfg.alpha, "alpha", 0, "seconds per latency-bound message round (default: fitted on the calibration link nearest in rate)")
	fs.Float64Var(&cfg.ineff, "ineff", 0, "time per byte over the line rate's, 1 = line rate (default: fitted on the calibration link nearest in rate, at least 1 for an uncalibrated link)")
	cfg.bucketBytes = optim.DefaultBucketBytes
	fs.Var(sizeFlag{&cfg.bucketBytes}, "bucket", "fused bucket `size`: the gradient goes in calls of this many bytes (optim.DefaultBucketBytes, like DDP)")
	fs.DurationVar(&cfg.stepCompute, "step-compute", 0, "forward and backward time of one step, added to each step time (no overlap with communication)")
	fs.BoolVar(&cfg.holdout, "holdout", false, "with fit: predict each rank count of each link from a fit to the other rank counts of that link")
	fs.BoolVar(&cfg.asJSON, "json", false, "write JSON")
	fs.Usage = func() {
		fmt.Fprint(out, `usage: lowbit plan [flags]
       lowbit plan fit [--holdout] [--measurements FILE] [--json]

Predicts the gradient communication time of one data-parallel step: a model
of --params float32 parameters on --ranks ranks linked at --link, exchanged
in buckets of --bucket bytes, for each collective, with an alpha-beta model
that follows each collective's algorithm step by step:

  step = local work + rounds*alpha + bytes*ineff/link rate

alpha (per latency-bound round) and ineff (time per byte over the line
rate's) are fitted per link to lowbit bench --json sweeps at 2, 3 and 4
ranks on a loopback shaped to each calibrated rate (scripts/plan-calibrate.sh);
the local work of the 1-bit allreduce is its time without a network,
measured on the calibration machine, which differs per machine
(--compress-rate). See docs/plan.md.

"lowbit plan fit" prints the fitted model and, for each measured point,
the prediction and its relative error; with --holdout each rank count is
predicted by a fit that has not seen it.

`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if cfg.holdout && !cfg.fit {
		return nil, errors.New("--holdout goes with lowbit plan fit")
	}
	if cfg.fit {
		return cfg, nil
	}
	var err error
	if cfg.sharing, err = parseSharing(*sharing); err != nil {
		return nil, err
	}
	if cfg.rate, err = parseRate(cfg.rateName); err != nil {
		return nil, err
	}
	cfg.rateName = strings.ToLower(strings.TrimSpace(cfg.rateName))
	bad := func(v float64) bool { return v < 0 || math.IsInf(v, 0) || math.IsNaN(v) }
	switch {
	case !(cfg.params >= 1) || cfg.params > 1e15:
		return nil, fmt.Errorf("--params must be in [1, 1e15], got %g", cfg.params)
	case cfg.ranks < 2 || cfg.ranks > 1<<20:
		return nil, fmt.Errorf("--ranks must be in [2, %d], got %d", 1<<20, cfg.ranks)
	case bad(cfg.compressBps):
		return nil, fmt.Errorf("--compress-rate must be positive, got %g", cfg.compressBps)
	case bad(cfg.alpha):
		return nil, fmt.Errorf("--alpha must be positive, got %g", cfg.alpha)
	case bad(cfg.ineff):
		return nil, fmt.Errorf("--ineff must be positive, got %g", cfg.ineff)
	case cfg.bucketBytes < 4 || cfg.bucketBytes%4 != 0:
		return nil, fmt.Errorf("--bucket must be a positive multiple of 4 bytes, got %d", cfg.bucketBytes)
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
			return nil, nil, nil, "", fmt.Errorf("plan: %w", err)
		}
		name = file
	}
	meas, err := parseMeasurements(data)
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("plan: %s: %w", name, err)
	}
	pts, err := meas.points()
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("plan: %s: %w", name, err)
	}
	curve, err := meas.computeCurves()
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("plan: %s: %w", name, err)
	}
	m, err := fitModel(pts, linkSharing(meas.LinkSharing), curve, meas.Machine.CPUs, meas.BurstBytes)
	if err != nil {
		return nil, nil, nil, "", fmt.Errorf("plan: %s: %w", name, err)
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
		checks := checkPoints(m, pts)
		if cfg.holdout {
			if checks, err = holdoutChecks(m, pts); err != nil {
				return err
			}
		}
		return writeFit(stdout, m, checks, source, cfg.holdout, cfg.asJSON)
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
	Spread     float64 `json:"repeat_spread"` // (max - min)/median over repeats
	Predicted  float64 `json:"predicted_s"`
	RelError   float64 `json:"rel_error"` // predicted/measured - 1
}

// checkPoints predicts every point of a known collective with m.
func checkPoints(m *costModel, pts []planPoint) []pointCheck {
	var out []pointCheck
	for _, p := range pts {
		if _, ok := findCollective(p.Collective); !ok {
			continue
		}
		pred := m.predictPoint(p)
		out = append(out, pointCheck{Collective: p.Collective, Rate: p.RateName, Ranks: p.Ranks, Bytes: p.Bytes,
			Measured: p.Seconds, Spread: p.Spread, Predicted: pred, RelError: pred/p.Seconds - 1})
	}
	return out
}

// holdoutChecks predicts the points of each link and rank count with a
// model fitted to the other rank counts of that link only.
func holdoutChecks(full *costModel, pts []planPoint) ([]pointCheck, error) {
	type key struct {
		rate  string
		ranks int
	}
	var keys []key
	for _, p := range pts {
		if k := (key{p.RateName, p.Ranks}); !slices.Contains(keys, k) {
			keys = append(keys, k)
		}
	}
	var out []pointCheck
	for _, k := range keys {
		var train, test []planPoint
		for _, p := range pts {
			switch {
			case p.RateName == k.rate && p.Ranks == k.ranks:
				test = append(test, p)
			case p.RateName == k.rate:
				train = append(train, p)
			}
		}
		m, err := fitModel(train, full.Sharing, full.Compute, full.CPUs, full.Burst)
		if err != nil {
			return nil, fmt.Errorf("plan: %s without %d ranks: %w", k.rate, k.ranks, err)
		}
		out = append(out, checkPoints(m, test)...)
	}
	return out, nil
}

func writeFit(w io.Writer, m *costModel, checks []pointCheck, source string, holdout, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			Model   *costModel   `json:"model"`
			Holdout bool         `json:"holdout"`
			Points  []pointCheck `json:"points"`
		}{m, holdout, checks})
	}
	fmt.Fprintf(w, "# lowbit plan fit: %s\n# machine: %s; link sharing: %s, burst %s\n", source, m.Machine, m.Sharing, formatSize(m.Burst))
	names := make([]string, 0, len(m.Fits))
	for n := range m.Fits {
		names = append(names, n)
	}
	slices.SortFunc(names, func(a, b string) int { return int(m.Fits[b].Rate - m.Fits[a].Rate) })
	for _, n := range names {
		f := m.Fits[n]
		fmt.Fprintf(w, "%-8s alpha %s per round, ineff %.3f (beta %.3g ns per byte), %d points, rms error %.1f%%\n",
			n, formatSeconds(f.Alpha), f.Ineff, f.Ineff/f.Rate*1e9, f.Points, 100*f.RMS)
	}
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
	if holdout {
		fmt.Fprintln(w, "\nheld out: each link and rank count predicted by a fit to the other rank counts of that link")
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "collective\trate\tranks\tsize\tmeasured\trepeat spread\tpredicted\terror\t\n")
	worst := 0.0
	for _, c := range checks {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%.0f%%\t%s\t%+.1f%%\t\n", c.Collective, c.Rate, c.Ranks, formatSize(c.Bytes),
			formatSeconds(c.Measured), 100*c.Spread, formatSeconds(c.Predicted), 100*c.RelError)
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
	Calls        int     `json:"calls"` // collective calls per step (buckets times calls per bucket)
	WirePerRank  int64   `json:"wire_bytes_per_rank"`
	LatencyS     float64 `json:"latency_s"`
	TransferS    float64 `json:"transfer_s"`
	CompressS    float64 `json:"compress_s"`
	CommS        float64 `json:"comm_s"`
	StepS        float64 `json:"step_s"`
	SpeedupExact float64 `json:"speedup_vs_exact,omitempty"`
}

// planAssumptions is what a plan's numbers rest on.
type planAssumptions struct {
	Alpha        float64 `json:"alpha_s"`
	AlphaFrom    string  `json:"alpha_from"`
	Ineff        float64 `json:"ineff"`
	IneffFrom    string  `json:"ineff_from"`
	Buckets      int64   `json:"buckets"`
	BucketBytes  int64   `json:"bucket_bytes"`
	CompressBps  float64 `json:"compress_bytes_per_s"` // 1-rank onebit call throughput at the bucket size
	CompressFrom string  `json:"compress_from"`
}

func writePlan(w io.Writer, m *costModel, cfg *planConfig, source string) error {
	n := int64(math.Round(cfg.params))
	s := setup{Ranks: cfg.ranks, Rate: cfg.rate, Sharing: cfg.sharing}
	f, calibratedLink := m.fitFor(cfg.rateName, cfg.rate)
	a := planAssumptions{Alpha: f.Alpha, Ineff: f.Ineff,
		AlphaFrom: "fitted on the calibration's " + f.RateName + " shaped loopback",
		IneffFrom: "fitted on the calibration's " + f.RateName + " shaped loopback"}
	if !calibratedLink && f.Ineff < 1 {
		a.Ineff = 1
		a.IneffFrom = fmt.Sprintf("line rate: the %s loopback fit (%.2f) is below 1, which a real link does not do", f.RateName, f.Ineff)
	}
	if cfg.alpha > 0 {
		a.Alpha, a.AlphaFrom = cfg.alpha, "--alpha"
	}
	if cfg.ineff > 0 {
		a.Ineff, a.IneffFrom = cfg.ineff, "--ineff"
	}
	f.Alpha, f.Ineff = a.Alpha, a.Ineff
	if cfg.sharing == sharedLink {
		s.Burst = m.Burst
	}
	// The gradient goes in buckets of cfg.bucketBytes: full ones and the
	// rest.
	per := cfg.bucketBytes / 4
	full, rest := n/per, n%per
	a.Buckets, a.BucketBytes = full, cfg.bucketBytes
	if rest > 0 {
		a.Buckets++
	}
	one, _ := findCollective("onebit")
	if c1 := m.computeSeconds(one, min(n, per), setup{Ranks: 1, Sharing: perRankLink}); c1 > 0 {
		a.CompressBps = float64(4*onebit.PaddedLen(int(min(n, per)), 1)) / c1
	}
	a.CompressFrom = "measured on the calibration machine, 1 rank, at the bucket size; set --compress-rate to your hardware's"
	if m.CompressBps > 0 {
		a.CompressFrom = "--compress-rate"
	}
	predictStep := func(c collectiveModel) prediction {
		var p prediction
		add := func(q prediction, times int64) {
			p.Wire += q.Wire * times
			p.Bottleneck += q.Bottleneck * times
			p.Latency += q.Latency * float64(times)
			p.Transfer += q.Transfer * float64(times)
			p.Compute += q.Compute * float64(times)
			p.Calls += q.Calls * int(times)
		}
		if full > 0 {
			add(m.predict(c, per, s, f), full)
		}
		if rest > 0 {
			add(m.predict(c, rest, s, f), 1)
		}
		return p
	}
	exactComm := predictStep(planCollectives[0]).total()
	var rows []planRow
	for _, name := range cfg.collectives {
		c, _ := findCollective(name)
		p := predictStep(c)
		r := planRow{Collective: name, Calibrated: c.uncalibrated == "", Calls: p.Calls, WirePerRank: p.Wire,
			LatencyS: p.Latency, TransferS: p.Transfer, CompressS: p.Compute, CommS: p.total(),
			StepS: p.total() + cfg.stepCompute.Seconds()}
		if r.StepS > 0 {
			r.SpeedupExact = (exactComm + cfg.stepCompute.Seconds()) / r.StepS
		}
		rows = append(rows, r)
	}
	if cfg.asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			Params      int64           `json:"params"`
			Ranks       int             `json:"ranks"`
			LinkBps     float64         `json:"link_bytes_per_s"`
			Sharing     string          `json:"link_sharing"`
			StepCompute float64         `json:"step_compute_s"`
			Assumptions planAssumptions `json:"assumptions"`
			Model       *costModel      `json:"model"`
			Rows        []planRow       `json:"collectives"`
		}{n, cfg.ranks, cfg.rate, string(cfg.sharing), cfg.stepCompute.Seconds(), a, m, rows})
	}
	fmt.Fprintf(w, "# lowbit plan: %.4g parameters (%s float32 gradient), %d ranks, %s links (%s)\n",
		cfg.params, bytesDecimal(float64(4*n)), cfg.ranks, formatRate(cfg.rate), cfg.sharing)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "collective\tcalls\tsent/rank\tlatency\ttransfer\tcompress\tstep comm\tspeedup vs exact\t\n")
	for _, r := range rows {
		name := r.Collective
		if !r.Calibrated {
			name += "*"
		}
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%.2fx\t\n", name, r.Calls, bytesDecimal(float64(r.WirePerRank)),
			formatSeconds(r.LatencyS), formatSeconds(r.TransferS), formatSeconds(r.CompressS), formatSeconds(r.StepS), r.SpeedupExact)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	step := "step comm: gradient exchange of one step"
	if cfg.stepCompute > 0 {
		step += fmt.Sprintf(" + %s forward and backward (not overlapped)", cfg.stepCompute)
	}
	fmt.Fprintf(w, "%s; calls: collective calls per step (a pipelined piece counts as one).\n", step)
	for _, r := range rows {
		c, _ := findCollective(r.Collective)
		fmt.Fprintf(w, "%s: %s\n", r.Collective, c.desc)
	}
	fmt.Fprintln(w, "assumptions:")
	fmt.Fprintf(w, "  buckets: %d of %s (--bucket), called one after another; exact and 1-bit alike\n", a.Buckets, formatSize(a.BucketBytes))
	fmt.Fprintf(w, "  alpha:   %s per latency-bound round (%s); ring allreduce 2(W-1) rounds, 1-bit 3 collectives of W-1 rounds (per piece when pipelined)\n", formatSeconds(a.Alpha), a.AlphaFrom)
	fmt.Fprintf(w, "  beta:    %.3f x line rate per byte (%s)\n", a.Ineff, a.IneffFrom)
	if cfg.sharing == perRankLink {
		fmt.Fprintln(w, "  links:   one per rank, full duplex, non-blocking switch; each link carries the bytes its rank sends")
	} else {
		fmt.Fprintf(w, "  links:   one shaped link carries all ranks' bytes (token bucket, burst %s), ranks share the calibration machine's CPUs\n", formatSize(m.Burst))
	}
	if a.CompressBps > 0 {
		fmt.Fprintf(w, "  compress: a 1-rank 1-bit call gets through %.2f GB/s of float32 (%s); each of W ranks makes (4+1/W)/5 of its passes, on a CPU of its own\n", a.CompressBps/1e9, a.CompressFrom)
	}
	fmt.Fprintf(w, "  calibration: %s; %s\n", source, m.Machine)
	for _, r := range rows {
		if r.Calibrated {
			continue
		}
		c, _ := findCollective(r.Collective)
		fmt.Fprintf(w, "%s*: %s\n", r.Collective, c.uncalibrated)
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
