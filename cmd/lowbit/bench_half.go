package main

import (
	"context"
	"fmt"
	"slices"
	"strconv"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/quant"
)

// The collectives of package quant's down-cast and two-level allreduces:
//
//   - fp16, bf16: quant.DownCast, the mean with 16-bit values on the wire
//     and float32 sums; their rows add the time per call rank 0 spent
//     converting and communicating (convert_us, comm_us);
//   - twolevel: quant.TwoLevel's allreduce on the layout given by
//     --ranks-per-node (0: the backend's, see comm.NewLayout); its row
//     has the bytes rank 0 sent inside its node and across nodes.
//
// All three replace the float32 allreduce: effbusBW and the compression
// ratio are against its ring (busBW is effbusBW over the ratio).
var halfCollectives = []string{"fp16", "bf16", "twolevel"}

func init() { benchCollectives = append(benchCollectives, halfCollectives...) }

// --check's bounds on the relative error of the 16-bit collectives: two
// roundings to 11 (fp16) or 8 (bf16) significant bits. Measured on the
// check's data, 2 to 8 ranks, 256 B to 16 MiB: at most 2.96e-4 (fp16) and
// 2.43e-3 (bf16); the bounds leave a margin of about 35%. twolevel is
// exact (measured at most 4.2e-8) and keeps the exact collectives' bound.
const (
	fp16Tolerance = 4e-4
	bf16Tolerance = 3.2e-3
)

// isHalfBench reports whether name is a collective of this file.
func isHalfBench(name string) bool { return slices.Contains(halfCollectives, name) }

// halfInConfig reports whether cfg runs a collective of this file or a
// qgz one, which adds the convert_us, comm_us, intra_node_bytes_per_rank
// and cross_node_bytes_per_rank columns to the CSV.
func halfInConfig(cfg *benchConfig) bool {
	return slices.ContainsFunc(cfg.collectives, func(name string) bool {
		return isHalfBench(name) || name == "qgz4" || name == "qgz8"
	})
}

// newHalfBenchCase makes the case of fp16, bf16 or twolevel for elems
// float32 per rank on c. twolevel builds its layout of rpn ranks per node
// here (a collective call on c); close releases it.
func newHalfBenchCase(ctx context.Context, name string, c comm.Comm, rpn, elems, warmup int) (*benchCase, error) {
	w, rank := c.Size(), c.Rank()
	input := make([]float32, elems)
	fillInput(input, rank, 0)
	buf := make([]float32, elems)
	bc := &benchCase{
		elems: elems,
		check: func() (float64, float64) {
			return sqDist(buf, func(i int) float64 { return meanInput(w, i) })
		},
		exactWire: comm.RingAllReduceBytes(4*int64(elems), w),
	}
	switch name {
	case "fp16", "bf16":
		f, tol := quant.FP16, fp16Tolerance
		if name == "bf16" {
			f, tol = quant.BF16, bf16Tolerance
		}
		d := quant.NewDownCast(f)
		bc.tolerance = tol
		bc.run = func(ctx context.Context) error { return d.AllReduce(ctx, c, buf) }
		// The times of the timed iterations: prepare snapshots the stats
		// before the first one.
		var start quant.DownCastStats
		prepared := 0
		bc.prepare = func() {
			copy(buf, input)
			if prepared == warmup {
				start = d.Stats()
			}
			prepared++
		}
		bc.extraCols = func(row *benchRow) {
			s := d.Stats()
			calls := float64(max(s.Calls-start.Calls, 1))
			cv := float64((s.Convert - start.Convert).Microseconds()) / calls
			cm := float64((s.Comm - start.Comm).Microseconds()) / calls
			row.ConvertUs, row.CommUs = &cv, &cm
		}
		return bc, nil
	case "twolevel":
		l, err := comm.NewLayout(ctx, c, rpn)
		if err != nil {
			return nil, err
		}
		t, err := quant.NewTwoLevel(l)
		if err != nil {
			l.Close()
			return nil, err
		}
		bc.prepare = func() { copy(buf, input) }
		bc.run = func(ctx context.Context) error { return t.AllReduce(ctx, buf) }
		bc.traffic = func() (intra, inter int64) {
			s := t.Stats()
			return s.IntraBytes, s.InterBytes
		}
		bc.layout = l.String()
		bc.fp16Ring = comm.RingAllReduceBytes(2*int64(elems), w)
		bc.close = l.Close
		return bc, nil
	}
	return nil, fmt.Errorf("unknown collective %q", name)
}

// halfTableColumns renders row's conversion and communication times for
// the table ("" when the row has none).
func halfTableColumns(row benchRow) string {
	if row.ConvertUs == nil || row.CommUs == nil {
		return ""
	}
	return fmt.Sprintf("  [convert %.1f us, comm %.1f us]", *row.ConvertUs, *row.CommUs)
}

// halfCSVHeader names the CSV columns halfCSVFields fills.
var halfCSVHeader = []string{"convert_us", "comm_us", "intra_node_bytes_per_rank", "cross_node_bytes_per_rank"}

// halfCSVFields renders row's conversion and communication times and
// intra- and cross-node bytes for the CSV (empty where not measured).
func halfCSVFields(row benchRow) []string {
	rec := make([]string, len(halfCSVHeader))
	if row.ConvertUs != nil && row.CommUs != nil {
		rec[0] = csvFloat(*row.ConvertUs)
		rec[1] = csvFloat(*row.CommUs)
	}
	if row.WireIntraPerRank != nil {
		rec[2] = strconv.FormatInt(*row.WireIntraPerRank, 10)
	}
	if row.WireInterPerRank != nil {
		rec[3] = strconv.FormatInt(*row.WireInterPerRank, 10)
	}
	return rec
}
