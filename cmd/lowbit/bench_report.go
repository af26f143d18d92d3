package main

// The report of lowbit bench: one row per collective and size, summarized
// from every rank's samples, written by rank 0 as a table, CSV or JSON.

import (
	"encoding/binary"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/size"
)

// benchRow is one collective at one size.
type benchRow struct {
	Collective       string   `json:"collective"`
	Bytes            int64    `json:"bytes"`
	ElementsPerRank  int      `json:"elements_per_rank"`
	TimeP50Us        float64  `json:"time_p50_us"`
	TimeP95Us        float64  `json:"time_p95_us"`
	TimeMinUs        float64  `json:"time_min_us"`
	TimeMaxUs        float64  `json:"time_max_us"`
	AlgBWGBps        float64  `json:"algbw_gbps"`
	BusBWGBps        float64  `json:"busbw_gbps"`    // EffBusBWGBps over CompressionRatio: the bytes the row sent
	EffBusBWGBps     float64  `json:"effbusbw_gbps"` // the exact float32 collective's busBW at the row's p50
	WireBytesPerRank int64    `json:"wire_bytes_per_rank"`
	WireIntraPerRank *int64   `json:"wire_intra_node_bytes_per_rank,omitempty"` // qgz: rank 0's bytes inside its node
	WireInterPerRank *int64   `json:"wire_cross_node_bytes_per_rank,omitempty"` // qgz: rank 0's bytes across nodes
	Layout           string   `json:"layout,omitempty"`                         // qgz: nodes x ranks per node
	WireFP16Ring     *int64   `json:"wire_fp16_ring_bytes_per_rank,omitempty"`  // qgz: an fp16 ring's bytes, 2(W-1)/W*2n
	CompressionRatio float64  `json:"compression_ratio"`
	RelError         *float64 `json:"rel_error,omitempty"` // with --check
	tolerance        float64  // --check bound when not the default

	// fp16, bf16 (bench_half.go): rank 0's conversion and communication
	// time per call.
	ConvertUs *float64 `json:"convert_us,omitempty"`
	CommUs    *float64 `json:"comm_us,omitempty"`

	// onebit on host buffers (bench_bound.go): the bytes each rank reads
	// and writes in memory per call, the streaming bandwidth each rank
	// measured with all streaming at once, the time the bytes take at it,
	// and that time over the p50.
	MemBytesPerRank *int64   `json:"mem_bytes_per_rank,omitempty"`
	StreamGBps      *float64 `json:"stream_gbps,omitempty"`
	MemBoundUs      *float64 `json:"mem_bound_us,omitempty"`
	MemBoundShare   *float64 `json:"mem_bound_share,omitempty"`
	// Pieces is the pieces per chunk of rank 0's last timed call (1:
	// whole chunks; see onebit.State.SetPieces).
	Pieces *int `json:"pieces,omitempty"`
	// Started is whether rank 0's last timed call started its
	// collectives (onebit.State.Started).
	Started *bool `json:"started,omitempty"`
}

// benchSpeedup compares onebit with allreduce and bf16 at one size; a
// speedup is 0 (and left out of the JSON) where its baseline did not run.
type benchSpeedup struct {
	Bytes   int64   `json:"bytes"`
	Speedup float64 `json:"onebit_vs_allreduce,omitempty"` // allreduce p50 / onebit p50
	VsBF16  float64 `json:"onebit_vs_bf16,omitempty"`      // bf16 p50 / onebit p50
}

// benchResult is what one run measured, as --json writes it.
type benchResult struct {
	Backend    string         `json:"backend"`
	Ranks      int            `json:"ranks"`
	Op         string         `json:"op"` // allreduce's and reducescatter's reduction (--op): mean or sum
	Warmup     int            `json:"warmup"`
	Iterations int            `json:"iterations"`
	Results    []benchRow     `json:"results"`
	Speedups   []benchSpeedup `json:"speedups,omitempty"`
}

// summarize turns the gathered payloads (per rank: iters times in ns, wire
// bytes, two check sums) into a row; samples is scratch of w*iters.
// exactWire is the wire bytes per rank of the exact float32 collective the
// row replaces, where the case knows it (0: onebit's is the ring
// allreduce's, an exact collective's its own).
func summarize(name string, elems, w, iters int, gathered []byte, samples []int64, exactWire int64) benchRow {
	stride := 8 * (iters + 3)
	var wire int64
	for j := 0; j < w; j++ {
		p := gathered[j*stride:]
		for i := 0; i < iters; i++ {
			samples[j*iters+i] = int64(binary.LittleEndian.Uint64(p[8*i:]))
		}
		wire = max(wire, int64(binary.LittleEndian.Uint64(p[8*iters:])))
	}
	slices.Sort(samples)
	us := func(ns int64) float64 { return float64(ns) / 1e3 }
	bytes := int64(elems) * 4
	row := benchRow{
		Collective:       name,
		Bytes:            bytes,
		ElementsPerRank:  elems,
		TimeP50Us:        us(percentile(samples, 0.50)),
		TimeP95Us:        us(percentile(samples, 0.95)),
		TimeMinUs:        us(samples[0]),
		TimeMaxUs:        us(samples[len(samples)-1]),
		WireBytesPerRank: wire,
	}
	if row.TimeP50Us > 0 {
		row.AlgBWGBps = float64(bytes) / (row.TimeP50Us * 1e3) // bytes/ns = GB/s
	}
	exact := wire
	switch {
	case exactWire > 0:
		exact = exactWire
	case name == "onebit":
		exact = comm.RingAllReduceBytes(bytes, w)
	}
	if wire > 0 {
		row.CompressionRatio = float64(exact) / float64(wire)
	}
	row.EffBusBWGBps = row.AlgBWGBps * busFactor(replaces(name), w)
	row.BusBWGBps = row.EffBusBWGBps
	if replaces(name) != name && row.CompressionRatio > 0 {
		row.BusBWGBps = row.EffBusBWGBps / row.CompressionRatio
	}
	return row
}

// replaces names the exact float32 collective that collective name
// replaces, whose bytes effbusBW counts: name itself for an exact one.
func replaces(name string) string {
	switch name {
	case "onebit", "fp16", "bf16", "twolevel":
		return "allreduce"
	case "qgz4", "qgz8", "rsc":
		return "reducescatter"
	}
	return name
}

// percentile is the nearest-rank percentile of sorted samples.
func percentile(sorted []int64, p float64) int64 {
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[max(0, min(i, len(sorted)-1))]
}

// busFactor converts the algorithm bandwidth of the exact collective name
// on w ranks to its bus bandwidth, as nccl-tests does: 2(W-1)/W for
// allreduce, (W-1)/W for reducescatter, allgather and alltoall.
func busFactor(name string, w int) float64 {
	if name == "allreduce" {
		return 2 * float64(w-1) / float64(w)
	}
	return float64(w-1) / float64(w)
}

// benchReporter writes rank 0's report as rows arrive.
type benchReporter struct {
	w      io.Writer
	cfg    *benchConfig
	res    *benchResult
	csv    *csv.Writer
	size   []benchRow // rows of the current size
	failed []string   // --check failures
	traced []*tracedSize
}

func (r *benchReporter) begin() error {
	switch r.cfg.format {
	case "csv":
		r.csv = csv.NewWriter(r.w)
		h := strings.Split(csvHeader, ",")
		if r.cfg.check {
			h = append(h, "rel_error")
		}
		if halfInConfig(r.cfg) {
			h = append(h, halfCSVHeader...)
		}
		if boundInConfig(r.cfg) {
			h = append(h, boundCSVHeader...)
		}
		r.csv.Write(h)
		r.csv.Flush()
		return r.csv.Error()
	case "table":
		_, err := fmt.Fprintf(r.w, "# lowbit bench: backend %s, %d ranks, op %s, %d warm-up and %d timed iterations; "+
			"times over all ranks and timed iterations\n%s\n",
			r.cfg.backend, r.res.Ranks, r.cfg.op, r.cfg.warmup, r.cfg.iters, tableHeader(r.cfg.check))
		return err
	}
	return nil
}

func tableHeader(check bool) string {
	h := fmt.Sprintf("%-13s %6s %11s %11s %11s %11s %11s %9s %9s %9s %12s %7s",
		"collective", "size", "elems/rank", "p50(us)", "p95(us)", "min(us)", "max(us)",
		"algBW", "busBW", "effbusBW", "wire B/rank", "ratio")
	if check {
		h += fmt.Sprintf(" %9s", "rel.err")
	}
	return h
}

// formatRow renders one row of the human table.
func formatRow(row benchRow) string {
	ratio := "-"
	if row.CompressionRatio > 0 {
		ratio = fmt.Sprintf("%.2fx", row.CompressionRatio)
	}
	s := fmt.Sprintf("%-13s %6s %11s %11.1f %11.1f %11.1f %11.1f %9.3f %9.3f %9.3f %12d %7s",
		row.Collective, size.Format(row.Bytes), size.FormatCount(int64(row.ElementsPerRank)),
		row.TimeP50Us, row.TimeP95Us, row.TimeMinUs, row.TimeMaxUs,
		row.AlgBWGBps, row.BusBWGBps, row.EffBusBWGBps, row.WireBytesPerRank, ratio)
	if row.RelError != nil {
		s += fmt.Sprintf(" %9.2e", *row.RelError)
	}
	if row.WireIntraPerRank != nil && row.WireInterPerRank != nil {
		s += fmt.Sprintf("  [%s: intra-node %d B, cross-node %d B; fp16 ring %d B]",
			row.Layout, *row.WireIntraPerRank, *row.WireInterPerRank, *row.WireFP16Ring)
	}
	return s + halfTableColumns(row) + memBoundColumns(row)
}

// csvFloat renders a float field of the CSV output, in full precision.
func csvFloat(v float64) string { return strconv.FormatFloat(v, 'f', -1, 64) }

// csvRecord renders one row as CSV fields, in csvHeader's order.
func csvRecord(row benchRow) []string {
	f := csvFloat
	rec := []string{
		row.Collective, strconv.FormatInt(row.Bytes, 10), strconv.Itoa(row.ElementsPerRank),
		f(row.TimeP50Us), f(row.TimeP95Us), f(row.TimeMinUs), f(row.TimeMaxUs),
		f(row.AlgBWGBps), f(row.BusBWGBps), f(row.EffBusBWGBps), strconv.FormatInt(row.WireBytesPerRank, 10), f(row.CompressionRatio),
	}
	if row.RelError != nil {
		rec = append(rec, strconv.FormatFloat(*row.RelError, 'g', 6, 64))
	}
	return rec
}

func (r *benchReporter) row(row benchRow) error {
	r.res.Results = append(r.res.Results, row)
	r.size = append(r.size, row)
	if row.RelError != nil {
		tol := exactTolerance
		if row.Collective == "onebit" {
			tol = onebitTolerance
		}
		if row.tolerance > 0 {
			tol = row.tolerance
		}
		if !(*row.RelError <= tol) { // NaN fails too
			r.failed = append(r.failed, fmt.Sprintf("%s at %s: relative error %.3g above %g",
				row.Collective, size.Format(row.Bytes), *row.RelError, tol))
		}
	}
	switch r.cfg.format {
	case "csv":
		rec := csvRecord(row)
		if halfInConfig(r.cfg) {
			rec = append(rec, halfCSVFields(row)...)
		}
		if boundInConfig(r.cfg) {
			rec = append(rec, boundCSVFields(row)...)
		}
		r.csv.Write(rec)
		r.csv.Flush()
		return r.csv.Error()
	case "table":
		_, err := fmt.Fprintln(r.w, formatRow(row))
		return err
	}
	return nil
}

// endSize closes a size: the speedup of onebit over allreduce and over
// bf16, those that ran.
func (r *benchReporter) endSize(sz int64) error {
	rows := r.size
	r.size = r.size[:0]
	var exact, bf16, compressed float64
	for _, row := range rows {
		switch row.Collective {
		case "allreduce":
			exact = row.TimeP50Us
		case "bf16":
			bf16 = row.TimeP50Us
		case "onebit":
			compressed = row.TimeP50Us
		}
	}
	if compressed == 0 || exact == 0 && bf16 == 0 {
		return nil
	}
	sp := benchSpeedup{Bytes: sz, Speedup: exact / compressed, VsBF16: bf16 / compressed}
	r.res.Speedups = append(r.res.Speedups, sp)
	if r.cfg.format != "table" {
		return nil
	}
	var vs []string
	if sp.Speedup > 0 {
		vs = append(vs, fmt.Sprintf("speedup onebit vs allreduce: %.2fx", sp.Speedup))
	}
	if sp.VsBF16 > 0 {
		vs = append(vs, fmt.Sprintf("speedup onebit vs bf16: %.2fx", sp.VsBF16))
	}
	_, err := fmt.Fprintf(r.w, "%-13s %6s %s\n", "", size.Format(sz), strings.Join(vs, ", "))
	return err
}

func (r *benchReporter) end() error {
	if r.cfg.trace != "" {
		if err := writeChromeTrace(r.cfg.trace, r.traced); err != nil {
			return err
		}
	}
	if r.cfg.format != "json" {
		return nil
	}
	enc := json.NewEncoder(r.w)
	enc.SetIndent("", "  ")
	return enc.Encode(r.res)
}
