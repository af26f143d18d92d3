package main

import (
	"context"
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/size"
)

func init() {
	register(command{
		name:  "bench",
		usage: "PARAM-style collective benchmark: exact collectives and the 1-bit allreduce",
		run: func(args []string, stdout, stderr io.Writer) error {
			cfg, err := parseBenchFlags(args, stderr)
			if err != nil {
				return err
			}
			_, err = runBench(context.Background(), cfg, stdout)
			return err
		},
	})
}

// Limits of lowbit bench's flags: what one machine can hold and time.
const (
	maxBenchBytes = 64 << 30 // bytes per rank
	maxBenchIters = 1_000_000
	maxLocalRanks = 4096
)

// The collectives lowbit bench knows, in the order -h lists them.
var benchCollectives = []string{"allreduce", "onebit", "alltoall", "allgather", "reducescatter", "qgz4", "qgz8", "rsc"}

// csvHeader is the first line of --csv output (a rel_error column is
// appended with --check).
const csvHeader = "collective,bytes,elements_per_rank,time_p50_us,time_p95_us,time_min_us,time_max_us," +
	"algbw_gbps,busbw_gbps,effbusbw_gbps,wire_bytes_per_rank,compression_ratio"

// Relative errors above which --check fails. Exact collectives must agree
// with a float64 reference to float32 rounding (measured: at most 5e-8 on
// 2 to 8 ranks, 256 B to 16 MiB). onebit is checked on the mean of
// onebitCheckCalls calls with the same input from zeroed error buffers:
// with error feedback that mean converges to the mean of the inputs (the
// error buffers hold what is still owed), so the check sees a wrong scale,
// a lost chunk or broken error feedback, which one call's output (0.58 to
// 0.88 off by design on this data) hides. Measured on the check's data
// (1 to 8 and 16 ranks, 64 B to 16 MiB): 0.02 to 0.045 from 1 KiB up, and
// at most 0.103 (7 ranks, 64 B: 16 elements padded to 392, whose pad lanes
// take their share of the scale); onebitTolerance 0.15 leaves a margin of
// 45% over the worst, while an all-zero result (1.0), a halved one (0.5)
// or one rank's chunk zeroed (at least 0.25 on up to 16 ranks) fails (see
// TestBenchCheckCatchesCorruptResults).
const (
	exactTolerance  = 1e-5
	onebitTolerance = 0.15
	// onebitCheckCalls is the number of calls the onebit check averages.
	onebitCheckCalls = 64
)

// benchConfig is a parsed lowbit bench command line.
type benchConfig struct {
	sizes       []int64 // bytes of float32 data per rank, ascending
	warmup      int
	iters       int
	collectives []string
	backend     string
	ranks       int  // local: rank count; mpi: required world size, <= 0 for any
	check       bool // compare results with a reference and report the relative error
	format      string
	cpuProfile  string  // write a CPU profile here (mpi: one per rank, suffixed .rankN)
	rpn         int     // qgz4, qgz8: ranks per node of the layout (0: the backend's nodes)
	device      string  // onebit on device-resident buffers (bench_device.go); "" for host buffers
	trace       string  // write a Chrome trace of the onebit calls here (bench_trace.go); "" for none
	pieces      int     // onebit on host buffers: State.SetPieces (0: the calls choose)
	blocking    bool    // onebit on host buffers: State.SetOverlap(false)
	op          comm.Op // --op: the reduction of allreduce and reducescatter, comm.Mean (the default) or comm.Sum
}

// The collectives --op sum applies to: the exact ones (alltoall and
// allgather reduce nothing). The others average by construction.
var sumCollectives = []string{"allreduce", "reducescatter", "alltoall", "allgather"}

// sizeSweep returns begin, begin*factor, ... up to end.
func sizeSweep(begin, end, factor int64) ([]int64, error) {
	switch {
	case begin <= 0 || end <= 0:
		return nil, fmt.Errorf("sizes must be positive (--b %d, --e %d)", begin, end)
	case begin%4 != 0 || end%4 != 0:
		return nil, fmt.Errorf("sizes are bytes of float32 data and must be multiples of 4 (--b %d, --e %d)", begin, end)
	case end < begin:
		return nil, fmt.Errorf("end size %s is below begin size %s", size.Format(end), size.Format(begin))
	case factor < 2 && end != begin:
		return nil, fmt.Errorf("size factor --f must be at least 2, got %d", factor)
	}
	var sizes []int64
	for s := begin; s <= end; s *= factor {
		sizes = append(sizes, s)
		if factor < 2 || s > end/factor {
			break
		}
	}
	return sizes, nil
}

// parseBenchFlags parses lowbit bench's arguments; usage goes to out.
func parseBenchFlags(args []string, out io.Writer) (*benchConfig, error) {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(out)
	begin, end := int64(1<<10), int64(64<<20)
	fs.Var(&size.Value[int64]{P: &begin, Min: 4, Max: maxBenchBytes}, "b", "begin `size`: bytes of float32 data per rank (1Ki, 64Mi, 1G)")
	fs.Var(&size.Value[int64]{P: &end, Min: 4, Max: maxBenchBytes}, "e", "end `size` (inclusive)")
	factor := fs.Int64("f", 4, "size factor between steps")
	warmup := fs.Int("w", 2, "warm-up iterations per collective and size")
	iters := fs.Int("n", 10, "timed iterations per collective and size")
	list := fs.String("collective", "allreduce,onebit", "comma-separated collectives: "+strings.Join(benchCollectives, ","))
	withBF16 := fs.Bool("bf16", true, "with allreduce or onebit in --collective, time the bf16 down-cast allreduce too, after allreduce (false: only what --collective names)")
	backend := fs.String("backend", "local", "communication backend: "+backends)
	ranks := fs.Int("ranks", 4, "ranks of the local backend (with mpi: the world size mpirun must have started)")
	check := fs.Bool("check", false, "check each result against the exact computation and report the relative error")
	asJSON := fs.Bool("json", false, "write JSON")
	asCSV := fs.Bool("csv", false, "write CSV")
	cpuProfile := fs.String("cpuprofile", "", "write a CPU profile of the run to `file` (mpi backend: file.rankN per rank)")
	device := fs.String("device", "", deviceFlagHelp)
	trace := fs.String("trace", "", "write a per-phase timeline of every timed onebit call on every rank to `file` (Chrome trace-event JSON) and print a per-phase summary")
	pieces := fs.Int("pieces", 0, "onebit on host buffers: cut every chunk into at most this many pieces (1: whole; 0: the calls choose by their times)")
	overlap := fs.Bool("overlap", true, "onebit on host buffers, on a backend that starts collectives (mpi): compute while they travel where the calls choose to (false: run them blocking, for same-run comparisons)")
	opName := fs.String("op", "mean", "reduction of allreduce and reducescatter: mean (comm.Mean, nccl-tests' -o avg) or sum (comm.Sum, nccl-tests' default)")
	rpn := fs.Int("ranks-per-node", 0, "qgz4, qgz8, twolevel: ranks per node of the node-major layout (0: the ranks that share a machine; local backend: all)")
	fs.Usage = func() {
		fmt.Fprint(out, `usage: lowbit bench [flags]

Times collectives over a sweep of sizes, PARAM/nccl-tests style. A size is
the bytes of float32 data each rank holds: the buffer of allreduce and
onebit, the send (= receive) buffer of alltoall, the receive buffer of
allgather and the send buffer of reducescatter (the last three are cut to
a multiple of the rank count). allreduce and reducescatter average
(comm.Mean), like onebit; --op sum makes them sum (comm.Sum, nccl-tests'
default reduction: on the mpi backend the bare MPI_Allreduce, without
the division by W), and then takes only the exact collectives (allreduce,
reducescatter, alltoall, allgather) and adds no bf16 row. Each rank times
each iteration after a barrier; p50/p95/min/max are over all ranks and
timed iterations. Wire bytes are
what each rank sent per iteration according to comm.Stats (the most of any
rank); the compression ratio is the wire bytes of the exact float32
collective the row replaces over them (1 for the exact rows). The three
bandwidths, in GB/s (decimal), read as nccl-tests' (docs/tools.md maps
every column):

  algBW     size/p50
  effbusBW  algBW*F, F the nccl-tests bus factor of the exact float32
            collective the row replaces: 2(W-1)/W for allreduce and the
            collectives that replace it (onebit, fp16, bf16, twolevel),
            (W-1)/W for reducescatter and those that replace it (qgz4,
            qgz8, rsc), for alltoall and for allgather. It is the busbw
            nccl-tests would print for that float32 collective had it
            taken the row's p50: a compressed row reads as the exact one.
  busBW     effbusBW/ratio: the bus bandwidth of the bytes the row sent.
            On an exact row it is effbusBW, nccl-tests' busbw; on fp16
            and bf16 (ratio 2 but for a small header per chunk) it is
            nccl-tests' busbw of the same allreduce on 16-bit data.

When --collective names allreduce or onebit and not bf16, every size also
times bf16, the down-cast allreduce, right after allreduce (or before
onebit), so that the 1-bit allreduce is compared with both the float32 and
the bf16 one in the same run; --bf16=false leaves it out. With onebit and
allreduce or bf16, each size ends with the speedup of onebit over each
(the ratio of p50s).

--check compares each result with a float64 reference computed from every
rank's (deterministic) input and fails when an exact collective is off by
more than 1e-5 relative, or onebit by more than 0.15. onebit is checked on
the mean of 64 extra calls with the same input from zeroed error buffers:
with error feedback, only the running sum of its outputs tracks the inputs'
(one call alone is 0.6 to 0.9 off by design).

Beside each onebit row (host buffers) the table prints a memory bound: the
bytes each rank must read and write in memory for one call (8n + 16N + 16C
+ 6N/8 + 2C/8 for n elements padded to N, C = N/W), the time they take at
the streaming bandwidth each rank measured just before and just after
the timed calls, the faster of the two (each rank updating 128 MiB in
place, all ranks at once, best of 10 passes; ranks on one machine), the
share of that bound the p50 reached, whether rank 0's last call sent its
chunks whole or in pieces and whether it started its collectives (on the
mpi backend a call of 1M elements and more may start them and compute
while they travel; the calls choose by the times of earlier ones: see
onebit.AllReduce); --csv adds the columns mem_bytes_per_rank, stream_gbps,
mem_bound_us, mem_bound_share, pieces and started when onebit runs on host
buffers. onebit warms up with at least onebit.TuningCalls calls (18),
whatever --w says, so that its timed calls run the way its calls settled
on; --pieces fixes the cut instead, and --overlap=false runs the
collectives blocking, for a same-run comparison.

--trace FILE records the phases of every timed onebit call on every rank
(compress, header, worker error, all-to-all, server reduce and compress,
all-gather, decompress, and the waits) and writes them to FILE as Chrome
trace-event JSON (chrome://tracing or ui.perfetto.dev open it), one
process per rank; the table adds, per size and rank, the p50 over calls of
each phase's total time in a call.

qgz4 and qgz8 are the hierarchical quantized reduce-scatter (int4, int8) on
a node-major layout of --ranks-per-node ranks per node; their rows add the
bytes each rank sent inside its node and across nodes, and an fp16 ring's
for comparison; --check fails them above 0.16 and 0.0095 relative error. rsc is
the coalesced reduce-scatter of a list of odd-sized tensors that fill the
size. All three average and compare with a float32 reduce-scatter.

fp16 and bf16 are the down-cast allreduce (16-bit values on the wire, float32
sums); their rows add rank 0's time per call spent converting and spent
communicating, in columns of their own; --check fails them above 4e-4 and
3.2e-3. twolevel is the two-level (Fairring-style) allreduce on the layout of
--ranks-per-node, with the bytes sent inside the node and across nodes. All
three compare with the float32 allreduce. In CSV the conversion time and
the node split are the columns convert_us, comm_us,
intra_node_bytes_per_rank and cross_node_bytes_per_rank.

With --backend mpi start it under mpirun (a binary built with -tags mpi).

`)
		fs.PrintDefaults()
	}
	if err := cliflag.Parse(fs, args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, cliflag.Usagef("unexpected arguments: %q", fs.Args())
	}
	switch {
	case *warmup < 0 || *warmup > maxBenchIters:
		return nil, cliflag.Bad(fs, "w", "want 0 to %d warm-up iterations", maxBenchIters)
	case *iters < 1 || *iters > maxBenchIters:
		return nil, cliflag.Bad(fs, "n", "want 1 to %d timed iterations", maxBenchIters)
	case *ranks < 0 || *ranks > maxLocalRanks || *ranks == 0 && *backend == "local":
		return nil, cliflag.Bad(fs, "ranks", "want 1 to %d ranks", maxLocalRanks)
	case *pieces < 0 || *pieces > 64:
		return nil, cliflag.Bad(fs, "pieces", "want 0 (the calls choose) to 64 (at most 4 are used)")
	case *rpn < 0 || *rpn > maxLocalRanks:
		return nil, cliflag.Bad(fs, "ranks-per-node", "want 0 (the ranks that share a machine) to %d", maxLocalRanks)
	case *opName != "mean" && *opName != "sum":
		return nil, cliflag.Bad(fs, "op", "unknown reduction %q (want mean or sum)", *opName)
	case *backend != "local" && *backend != "mpi":
		return nil, cliflag.Bad(fs, "backend", "unknown backend (want %s)", backends)
	case begin%4 != 0:
		return nil, cliflag.Bad(fs, "b", "bytes of float32 data: want a multiple of 4")
	case end%4 != 0:
		return nil, cliflag.Bad(fs, "e", "bytes of float32 data: want a multiple of 4")
	case end < begin:
		return nil, cliflag.Bad(fs, "e", "below the begin size --b %s", size.Format(begin))
	case *factor < 2 && end != begin:
		return nil, cliflag.Bad(fs, "f", "want a factor of at least 2")
	}
	sizes, err := sizeSweep(begin, end, *factor)
	if err != nil {
		return nil, cliflag.Usagef("%s", err)
	}
	cfg := &benchConfig{sizes: sizes, warmup: *warmup, iters: *iters, backend: *backend,
		ranks: *ranks, check: *check, format: "table", cpuProfile: *cpuProfile, rpn: *rpn, device: *device, trace: *trace, pieces: *pieces, blocking: !*overlap, op: comm.Mean}
	if *opName == "sum" {
		cfg.op = comm.Sum
	}
	for name := range strings.SplitSeq(*list, ",") {
		name = strings.TrimSpace(name)
		if !slices.Contains(benchCollectives, name) {
			return nil, cliflag.Bad(fs, "collective", "unknown collective %q (want %s)", name, strings.Join(benchCollectives, ", "))
		}
		cfg.collectives = append(cfg.collectives, name)
	}
	if cfg.op == comm.Sum {
		for _, name := range cfg.collectives {
			if !slices.Contains(sumCollectives, name) {
				return nil, cliflag.Bad(fs, "op", "sum: %s always averages; --op sum takes %s", name, strings.Join(sumCollectives, ", "))
			}
		}
	} else if *withBF16 {
		cfg.collectives = withBF16Baseline(cfg.collectives)
	}
	switch {
	case *asJSON && *asCSV:
		return nil, cliflag.Usagef("--json and --csv exclude each other")
	case *asJSON:
		cfg.format = "json"
	case *asCSV:
		cfg.format = "csv"
	}
	if cfg.backend == "mpi" {
		ranksSet := false
		fs.Visit(func(f *flag.Flag) { ranksSet = ranksSet || f.Name == "ranks" })
		if !ranksSet {
			cfg.ranks = 0
		}
	}
	if err := checkDeviceFlag(cfg); err != nil {
		return nil, cliflag.Bad(fs, "device", "%s", err)
	}
	return cfg, nil
}

// withBF16Baseline adds bf16, the down-cast allreduce, to collectives that
// name allreduce or onebit and not bf16: right after allreduce, or where
// allreduce is not named, right before onebit.
func withBF16Baseline(collectives []string) []string {
	if slices.Contains(collectives, "bf16") {
		return collectives
	}
	if i := slices.Index(collectives, "allreduce"); i >= 0 {
		return slices.Insert(collectives, i+1, "bf16")
	}
	if i := slices.Index(collectives, "onebit"); i >= 0 {
		return slices.Insert(collectives, i, "bf16")
	}
	return collectives
}

// runBench runs the benchmark described by cfg; rank 0 writes the report to
// stdout and its rows are returned. With --check a result off by more than
// the tolerance makes it fail after the whole sweep has run.
func runBench(ctx context.Context, cfg *benchConfig, stdout io.Writer) (*benchResult, error) {
	res := &benchResult{Backend: cfg.backend, Op: cfg.op.String(), Warmup: cfg.warmup, Iterations: cfg.iters}
	var failed []string
	err := runRanks(ctx, cfg.backend, cfg.ranks, func(ctx context.Context, c comm.Comm) (err error) {
		if cfg.cpuProfile != "" && (c.Rank() == 0 || cfg.backend != "local") {
			stop, err := startCPUProfile(cfg.cpuProfile, cfg.backend, c.Rank())
			if err != nil {
				return err
			}
			defer func() { err = errors.Join(err, stop()) }()
		}
		var rep *benchReporter
		if c.Rank() == 0 {
			res.Ranks = c.Size()
			rep = &benchReporter{w: stdout, cfg: cfg, res: res}
			if err := rep.begin(); err != nil {
				return err
			}
		}
		if err := benchRank(ctx, c, cfg, rep); err != nil {
			return err
		}
		if rep == nil {
			return nil
		}
		failed = rep.failed
		return rep.end()
	})
	if err != nil {
		return nil, err
	}
	if len(failed) > 0 {
		return res, fmt.Errorf("check failed: %s", strings.Join(failed, "; "))
	}
	return res, nil
}

// startCPUProfile profiles this process into name (with the mpi backend,
// where each rank is a process, name.rankN) until stop is called.
func startCPUProfile(name, backend string, rank int) (stop func() error, err error) {
	if backend != "local" {
		name = fmt.Sprintf("%s.rank%d", name, rank)
	}
	f, err := os.Create(name)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() error {
		pprof.StopCPUProfile()
		return f.Close()
	}, nil
}

// benchRank is one rank's share of the sweep; rep is non-nil on rank 0.
func benchRank(ctx context.Context, c comm.Comm, cfg *benchConfig, rep *benchReporter) error {
	w := c.Size()
	times := make([]int64, cfg.iters)
	payload := make([]byte, 8*(cfg.iters+3))
	gathered := make([]byte, w*len(payload))
	samples := make([]int64, w*cfg.iters)
	var probe streamProbe // the memory bound's bandwidth, measured before and after each onebit case
	for _, sz := range cfg.sizes {
		for _, name := range cfg.collectives {
			var bc *benchCase
			var err error
			if isQuantBench(name) {
				bc, err = newQuantBenchCase(ctx, name, c, cfg.rpn, int(sz/4))
			} else if isHalfBench(name) {
				bc, err = newHalfBenchCase(ctx, name, c, cfg.rpn, int(sz/4), cfg.warmup)
			} else if name == "onebit" && cfg.device != "" {
				bc, err = newDeviceBenchCase(cfg.device, c, int(sz/4))
			} else {
				bc, err = newBenchCase(name, c, int(sz/4), cfg.op)
			}
			if err != nil {
				return fmt.Errorf("%s at %s: %w", name, size.Format(sz), err)
			}
			var streamBW float64 // bytes/s per rank, all streaming at once; 0: not measured
			if bc.state != nil {
				if streamBW, err = probe.measure(ctx, c); err != nil {
					return fmt.Errorf("%s at %s: measuring the streaming bandwidth: %w", name, size.Format(sz), err)
				}
			}
			if bc.state != nil && cfg.pieces > 0 {
				bc.state.SetPieces(cfg.pieces)
			}
			if bc.state != nil {
				bc.state.SetOverlap(!cfg.blocking)
			}
			if cfg.trace != "" && bc.state != nil {
				bc.tracer = newBenchTracer()
				bc.state.SetTracer(bc.tracer)
			}
			warmup := cfg.warmup
			if name == "onebit" {
				// Time the way the calls settle on (whole chunks or
				// pieces), not the opening that tries both.
				warmup = max(warmup, onebit.TuningCalls)
			}
			wire, err := timeCase(ctx, c, bc, warmup, times)
			if err != nil {
				return fmt.Errorf("%s at %s: %w", name, size.Format(sz), err)
			}
			if bc.state != nil {
				// Again after the timed calls, the faster counting: the
				// machine's bandwidth changes with its neighbours' load,
				// and a bound from a slow moment is no bound.
				after, err := probe.measure(ctx, c)
				if err != nil {
					return fmt.Errorf("%s at %s: measuring the streaming bandwidth: %w", name, size.Format(sz), err)
				}
				streamBW = max(streamBW, after)
			}
			var traced *tracedSize
			if bc.tracer != nil {
				bc.state.SetTracer(nil)
				ranks, err := gatherTrace(ctx, c, bc.tracer.events)
				if err != nil {
					return fmt.Errorf("%s at %s: gathering the trace: %w", name, size.Format(sz), err)
				}
				traced = &tracedSize{bytes: sz, ranks: ranks}
				for _, e := range ranks[0] {
					traced.pipelined = traced.pipelined || e.piece > 0
				}
			}
			var errSq, refSq float64
			if cfg.check {
				if bc.checkRun != nil {
					if err := bc.checkRun(ctx); err != nil {
						return fmt.Errorf("%s at %s: check run: %w", name, size.Format(sz), err)
					}
				}
				errSq, refSq = bc.check()
			}
			// Every rank's times, wire bytes and check sums go to every
			// rank (the Comm has no gather to one root); rank 0 reports.
			for i, t := range times {
				binary.LittleEndian.PutUint64(payload[8*i:], uint64(t))
			}
			binary.LittleEndian.PutUint64(payload[8*cfg.iters:], uint64(wire))
			binary.LittleEndian.PutUint64(payload[8*cfg.iters+8:], math.Float64bits(errSq))
			binary.LittleEndian.PutUint64(payload[8*cfg.iters+16:], math.Float64bits(refSq))
			if err := c.AllGatherBytes(ctx, payload, gathered); err != nil {
				return fmt.Errorf("%s at %s: gathering times: %w", name, size.Format(sz), err)
			}
			if bc.close != nil {
				if err := bc.close(); err != nil {
					return fmt.Errorf("%s at %s: %w", name, size.Format(sz), err)
				}
			}
			if rep == nil {
				continue
			}
			row := summarize(name, bc.elems, w, cfg.iters, gathered, samples, bc.exactWire)
			bc.annotate(&row)
			if bc.state != nil && streamBW > 0 {
				setMemBound(&row, w, streamBW)
			}
			if bc.state != nil {
				row.Pieces = new(bc.state.Pieces())
				row.Started = new(bc.state.Started())
			}
			if cfg.check {
				var e, r float64
				for j := 0; j < w; j++ {
					p := gathered[j*len(payload)+8*cfg.iters:]
					e += math.Float64frombits(binary.LittleEndian.Uint64(p[8:]))
					r += math.Float64frombits(binary.LittleEndian.Uint64(p[16:]))
				}
				rel := math.Sqrt(e / r)
				row.RelError = &rel
			}
			if err := rep.row(row); err != nil {
				return err
			}
			if traced != nil {
				rep.traced = append(rep.traced, traced)
				if cfg.format == "table" {
					if err := writeTraceSummary(rep.w, traced, cfg.iters); err != nil {
						return err
					}
				}
			}
		}
		if rep != nil {
			if err := rep.endSize(sz); err != nil {
				return err
			}
		}
	}
	return nil
}

// benchCase is one collective at one size on one rank, with its buffers.
type benchCase struct {
	elems   int                             // elements per rank, as reported
	prepare func()                          // restores the input before an iteration; untimed; may be nil
	run     func(ctx context.Context) error // the timed call
	check   func() (errSq, refSq float64)   // squared distance to the exact result, and its squared norm
	// checkRun, when set, makes the result that check inspects (else it
	// inspects the last timed call's).
	checkRun func(ctx context.Context) error
	// result is the buffer check inspects, where a case sets it (onebit
	// on the host, allreduce), so that tests can corrupt it.
	result []float32

	// Set by collectives that run on communicators of their own
	// (bench_qgz.go): traffic returns the bytes sent so far inside the
	// node and across nodes, counted instead of c's; exactWire is the wire
	// bytes of the exact float32 collective (for the compression ratio and
	// busBW);
	// tolerance the --check bound; close releases what the case holds.
	traffic              func() (intra, inter int64)
	exactWire            int64
	tolerance            float64
	layout               string
	close                func() error
	fp16Ring             int64 // an fp16 ring reduce's bytes per rank, to compare
	wireIntra, wireInter int64 // per timed iteration, from traffic

	// extraCols, set by bench_half.go, adds ConvertUs and CommUs to rank
	// 0's row.
	extraCols func(row *benchRow)

	// state is onebit's on host buffers (nil for the other cases), and
	// tracer, with --trace, its tracer during the timed calls.
	state  *onebit.State
	tracer *benchTracer
}

// annotate adds what the case knows beyond summarize to rank 0's row.
func (bc *benchCase) annotate(row *benchRow) {
	if bc.traffic != nil {
		row.WireIntraPerRank, row.WireInterPerRank = &bc.wireIntra, &bc.wireInter
		row.Layout = bc.layout
		row.WireFP16Ring = &bc.fp16Ring
	}
	row.tolerance = bc.tolerance
	if bc.extraCols != nil {
		bc.extraCols(row)
	}
}

// newBenchCase allocates and fills the buffers of collective name for
// elems float32 per rank on c; allreduce and reducescatter reduce with op
// (comm.Mean or comm.Sum), onebit averages.
func newBenchCase(name string, c comm.Comm, elems int, op comm.Op) (*benchCase, error) {
	w, rank := c.Size(), c.Rank()
	switch name {
	case "allreduce", "onebit":
		input := make([]float32, elems)
		fillInput(input, rank, 0)
		buf := make([]float32, elems)
		bc := &benchCase{
			elems:   elems,
			prepare: func() { copy(buf, input) },
			check: func() (float64, float64) {
				return sqDist(buf, func(i int) float64 { return meanInput(w, i) })
			},
		}
		if name == "allreduce" {
			bc.run = func(ctx context.Context) error { return c.AllReduce(ctx, buf, op) }
			bc.check = func() (float64, float64) {
				return sqDist(buf, func(i int) float64 { return reducedInput(w, i, op) })
			}
			bc.result = buf
			return bc, nil
		}
		st, err := onebit.NewState(elems, w)
		if err != nil {
			return nil, err
		}
		bc.run = func(ctx context.Context) error { return onebit.AllReduce(ctx, c, buf, st) }
		bc.result, bc.state = buf, st
		// With error feedback one call's output is not an estimate of the
		// mean, only the running sum of outputs is (the residual carries
		// the rest): check the mean of onebitCheckCalls calls made with
		// the same input from zeroed error buffers.
		var sum []float32
		bc.checkRun = func(ctx context.Context) error {
			st.Reset()
			if sum == nil {
				sum = make([]float32, elems)
			}
			clear(sum)
			for range onebitCheckCalls {
				copy(buf, input)
				if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
					return err
				}
				addTo(sum, buf)
			}
			meanOf(buf, sum, onebitCheckCalls)
			return nil
		}
		return bc, nil
	}

	elems -= elems % w
	if elems == 0 {
		return nil, fmt.Errorf("size too small for %d ranks", w)
	}
	k := elems / w
	switch name {
	case "alltoall":
		send, recv := make([]float32, elems), make([]float32, elems)
		fillInput(send, rank, 0)
		return &benchCase{
			elems: elems,
			run:   func(ctx context.Context) error { return c.AllToAll(ctx, send, recv) },
			check: func() (float64, float64) {
				return sqDist(recv, func(i int) float64 { return float64(inputValue(i/k, rank*k+i%k)) })
			},
		}, nil
	case "allgather":
		send, recv := make([]float32, k), make([]float32, elems)
		fillInput(send, rank, 0)
		return &benchCase{
			elems: elems,
			run:   func(ctx context.Context) error { return c.AllGather(ctx, send, recv) },
			check: func() (float64, float64) {
				return sqDist(recv, func(i int) float64 { return float64(inputValue(i/k, i%k)) })
			},
		}, nil
	case "reducescatter":
		send, recv := make([]float32, elems), make([]float32, k)
		fillInput(send, rank, 0)
		return &benchCase{
			elems: elems,
			run:   func(ctx context.Context) error { return c.ReduceScatter(ctx, send, recv, op) },
			check: func() (float64, float64) {
				return sqDist(recv, func(i int) float64 { return reducedInput(w, rank*k+i, op) })
			},
		}, nil
	}
	return nil, fmt.Errorf("unknown collective %q", name)
}

// timeCase runs warmup untimed and len(times) timed iterations of bc, each
// after a barrier (and a timed one's preparation after a barrier too), and
// stores each timed call's duration in nanoseconds.
// It returns the bytes this rank sent per timed iteration, from comm.Stats.
// The loop allocates nothing but what a --trace tracer records.
func timeCase(ctx context.Context, c comm.Comm, bc *benchCase, warmup int, times []int64) (int64, error) {
	for i := 0; i < warmup; i++ {
		if bc.prepare != nil {
			bc.prepare()
		}
		if err := c.Barrier(ctx); err != nil {
			return 0, err
		}
		if err := bc.run(ctx); err != nil {
			return 0, err
		}
	}
	before := c.Stats()
	var intra0, inter0 int64
	if bc.traffic != nil {
		intra0, inter0 = bc.traffic()
	}
	for i := range times {
		if bc.prepare != nil {
			// After a barrier of its own: a rank that left the last call
			// early would otherwise prepare (64 MiB of copying for onebit
			// at 64 MiB) while the others are still in their timed call.
			if err := c.Barrier(ctx); err != nil {
				return 0, err
			}
			bc.prepare()
		}
		if err := c.Barrier(ctx); err != nil {
			return 0, err
		}
		if bc.tracer != nil {
			bc.tracer.begin(i)
		}
		t0 := time.Now()
		if err := bc.run(ctx); err != nil {
			return 0, err
		}
		t1 := time.Now()
		times[i] = int64(t1.Sub(t0))
		if bc.tracer != nil {
			bc.tracer.end(i, t0, t1)
		}
	}
	if bc.tracer != nil {
		bc.tracer.begin(-1) // record no more calls (--check's)
	}
	if bc.traffic != nil {
		intra, inter := bc.traffic()
		bc.wireIntra = (intra - intra0) / int64(len(times))
		bc.wireInter = (inter - inter0) / int64(len(times))
		return bc.wireIntra + bc.wireInter, nil
	}
	return c.Stats().Sub(before).Total().BytesSent / int64(len(times)), nil
}

// inputValue is element i of rank's benchmark input: a deterministic
// pseudo-random value in [-1, 1), so that any rank can recompute any
// other rank's input for --check without communicating.
func inputValue(rank, i int) float32 {
	z := uint64(rank)*0x9e3779b97f4a7c15 ^ uint64(i)
	z += 0x632be59bd9b4e019
	// splitmix64 finalizer
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	z ^= z >> 31
	return float32(int32(z>>40)-1<<23) * (1.0 / (1 << 23))
}

// fillInput sets dst[i] = inputValue(rank, off+i).
func fillInput(dst []float32, rank, off int) {
	for i := range dst {
		dst[i] = inputValue(rank, off+i)
	}
}

// meanInput is the exact (float64) mean over w ranks of element i.
func meanInput(w, i int) float64 { return reducedInput(w, i, comm.Mean) }

// reducedInput is the exact (float64) reduction with op (comm.Mean or
// comm.Sum) over w ranks of element i.
func reducedInput(w, i int, op comm.Op) float64 {
	var s float64
	for r := 0; r < w; r++ {
		s += float64(inputValue(r, i))
	}
	if op == comm.Mean {
		s /= float64(w)
	}
	return s
}

// addTo adds x to sum element by element.
func addTo(sum, x []float32) {
	for i, v := range x {
		sum[i] += v
	}
}

// meanOf sets dst = sum/n.
func meanOf(dst, sum []float32, n int) {
	for i, v := range sum {
		dst[i] = v / float32(n)
	}
}

// sqDist returns sum (got[i]-want(i))^2 and sum want(i)^2.
func sqDist(got []float32, want func(i int) float64) (errSq, refSq float64) {
	for i, g := range got {
		x := want(i)
		d := float64(g) - x
		errSq += d * d
		refSq += x * x
	}
	return errSq, refSq
}
