package costmodel

import (
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
)

// builtinMeasurements are the runs recorded on the development machine by
// scripts/plan-calibrate.sh: the default calibration.
//
//go:embed measured.json
var builtinMeasurements []byte

// BuiltinSource names the built-in calibration in output.
const BuiltinSource = "built-in (costmodel/measured.json)"

// measurements are what scripts/plan-calibrate.sh records: lowbit bench
// --json sweeps on a shaped link at several rates and rank counts, and
// runs of the 1-bit allreduce without a network.
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
	Compute []benchRun `json:"compute"`
}

// measuredRun is one lowbit bench --json sweep on a link shaped to Rate.
type measuredRun struct {
	Rate   string   `json:"rate"` // tc units, as ParseRate reads them
	Ranks  int      `json:"ranks"`
	Repeat int      `json:"repeat"`
	Bench  benchRun `json:"bench"`
}

// benchRun is the part of lowbit bench's --json output the model reads.
type benchRun struct {
	Ranks      int        `json:"ranks"`
	Warmup     int        `json:"warmup"`
	Iterations int        `json:"iterations"`
	Results    []benchRow `json:"results"`
}

// benchRow is one collective at one size of a benchRun.
type benchRow struct {
	Collective       string  `json:"collective"`
	Bytes            int64   `json:"bytes"` // float32 bytes per rank
	TimeP50us        float64 `json:"time_p50_us"`
	WireBytesPerRank int64   `json:"wire_bytes_per_rank"`
}

// parseMeasurements decodes and checks a file of scripts/plan-calibrate.sh.
func parseMeasurements(data []byte) (*measurements, error) {
	var m measurements
	if err := json.Unmarshal(data, &m); err != nil {
		return nil, fmt.Errorf("measurements: %w", err)
	}
	if _, err := ParseSharing(m.LinkSharing); err != nil {
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

// Point is one collective at one size, rank count and rate: the median
// over repeats of lowbit bench's p50.
type Point struct {
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
	Before []BenchedCase
}

// BenchedCase is one collective at one size of a lowbit bench run.
type BenchedCase struct {
	Collective string
	Bytes      int64 // float32 bytes per rank
}

// points groups m's rows by setting and takes the median over repeats.
func (m *measurements) points() ([]Point, error) {
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
	before := map[key][]BenchedCase{}
	for _, r := range m.Runs {
		if r.Bench.Ranks != r.Ranks {
			return nil, fmt.Errorf("measurements: run at %s says %d ranks, its bench %d", r.Rate, r.Ranks, r.Bench.Ranks)
		}
		if _, err := ParseRate(r.Rate); err != nil {
			return nil, fmt.Errorf("measurements: %w", err)
		}
		var ran []BenchedCase
		for _, row := range r.Bench.Results {
			k := key{row.Collective, r.Rate, r.Ranks, row.Bytes}
			if _, ok := times[k]; !ok {
				order = append(order, k)
				before[k] = slices.Clone(ran)
			}
			ran = append(ran, BenchedCase{row.Collective, row.Bytes})
			times[k] = append(times[k], row.TimeP50us/1e6)
			wire[k] = row.WireBytesPerRank
			calls[k] = [2]int{r.Bench.Warmup, r.Bench.Iterations}
		}
	}
	pts := make([]Point, 0, len(order))
	for _, k := range order {
		rate, _ := ParseRate(k.rate)
		ts := times[k]
		med := median(ts)
		pts = append(pts, Point{Collective: k.coll, Rate: rate, RateName: k.rate, Ranks: k.ranks,
			Bytes: k.bytes, Wire: wire[k], Seconds: med, Spread: (slices.Max(ts) - slices.Min(ts)) / med,
			Repeats: len(ts), Warmup: calls[k][0], Iters: calls[k][1], Before: before[k]})
	}
	return pts, nil
}

// ComputePoint is the time of the 1-bit allreduce without a network on
// Bytes of float32 data per rank.
type ComputePoint struct {
	Bytes   int64   `json:"bytes"`
	Seconds float64 `json:"seconds"`
}

// computeCurves is the onebit rows of the compute runs (local backend, no
// network) by rank count: the median per size, by ascending size. It needs
// a 1-rank curve.
func (m *measurements) computeCurves() (map[int][]ComputePoint, error) {
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
	curves := map[int][]ComputePoint{}
	for w, bySize := range times {
		var curve []ComputePoint
		for b, ts := range bySize {
			curve = append(curve, ComputePoint{Bytes: b, Seconds: median(ts)})
		}
		slices.SortFunc(curve, func(a, b ComputePoint) int { return int(a.Bytes - b.Bytes) })
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

// Calibration is a model fitted to a file of measurements, with the
// measured points it was fitted to.
type Calibration struct {
	// Source names the measurements: a file name or BuiltinSource.
	Source string
	Model  *Model
	Points []Point
}

// Builtin is the model fitted to the built-in measurements (recorded on
// the development machine, a 2-core VM, on a shaped loopback).
func Builtin() (*Calibration, error) {
	return Load(builtinMeasurements, BuiltinSource)
}

// LoadFile reads a file of scripts/plan-calibrate.sh and fits the model
// to it.
func LoadFile(path string) (*Calibration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("costmodel: %w", err)
	}
	return Load(data, path)
}

// Load fits the model to measurements data (the JSON that
// scripts/plan-calibrate.sh writes); source names them in errors and
// output.
func Load(data []byte, source string) (*Calibration, error) {
	meas, err := parseMeasurements(data)
	if err != nil {
		return nil, fmt.Errorf("costmodel: %s: %w", source, err)
	}
	pts, err := meas.points()
	if err != nil {
		return nil, fmt.Errorf("costmodel: %s: %w", source, err)
	}
	curve, err := meas.computeCurves()
	if err != nil {
		return nil, fmt.Errorf("costmodel: %s: %w", source, err)
	}
	m, err := Fit(pts, Machine{Sharing: Sharing(meas.LinkSharing), Compute: curve, CPUs: meas.Machine.CPUs, Burst: meas.BurstBytes})
	if err != nil {
		return nil, fmt.Errorf("costmodel: %s: %w", source, err)
	}
	m.Machine = fmt.Sprintf("%s, %d cpus, recorded %s", meas.Machine.Model, meas.Machine.CPUs, meas.Machine.Recorded)
	return &Calibration{Source: source, Model: m, Points: pts}, nil
}

// Check is one measured point against the model.
type Check struct {
	Collective string  `json:"collective"`
	Rate       string  `json:"rate"`
	Ranks      int     `json:"ranks"`
	Bytes      int64   `json:"bytes"`
	Measured   float64 `json:"measured_s"`
	Spread     float64 `json:"repeat_spread"` // (max - min)/median over repeats
	Predicted  float64 `json:"predicted_s"`
	RelError   float64 `json:"rel_error"` // predicted/measured - 1
}

// Check predicts every point of a known collective with m.
func (m *Model) Check(pts []Point) []Check {
	var out []Check
	for _, p := range pts {
		if _, ok := findCollective(p.Collective); !ok {
			continue
		}
		pred := m.PredictPoint(p)
		out = append(out, Check{Collective: p.Collective, Rate: p.RateName, Ranks: p.Ranks, Bytes: p.Bytes,
			Measured: p.Seconds, Spread: p.Spread, Predicted: pred, RelError: pred/p.Seconds - 1})
	}
	return out
}

// Check predicts every point of the calibration with its own model.
func (c *Calibration) Check() []Check { return c.Model.Check(c.Points) }

// HoldOut predicts the points of each link and rank count with a model
// fitted to the other rank counts of that link only: how well the model
// predicts a rank count it has not seen.
func (c *Calibration) HoldOut() ([]Check, error) {
	type key struct {
		rate  string
		ranks int
	}
	var keys []key
	for _, p := range c.Points {
		if k := (key{p.RateName, p.Ranks}); !slices.Contains(keys, k) {
			keys = append(keys, k)
		}
	}
	var out []Check
	for _, k := range keys {
		var train, test []Point
		for _, p := range c.Points {
			switch {
			case p.RateName == k.rate && p.Ranks == k.ranks:
				test = append(test, p)
			case p.RateName == k.rate:
				train = append(train, p)
			}
		}
		m, err := Fit(train, c.Model.machine())
		if err != nil {
			return nil, fmt.Errorf("costmodel: %s without %d ranks: %w", k.rate, k.ranks, err)
		}
		out = append(out, m.Check(test)...)
	}
	return out, nil
}
