package main

import (
	"cmp"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/bits"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/lowbit-ml/lowbit/costmodel"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
	"github.com/lowbit-ml/lowbit/size"
)

// The plan command prints what package costmodel predicts (docs/plan.md).

func init() {
	register(command{
		name:  "plan",
		usage: "predict collective and step times from an alpha-beta model fitted to lowbit bench runs",
		run:   planMain,
	})
}

// planConfig is a parsed lowbit plan command line.
type planConfig struct {
	fit          bool   // lowbit plan fit: print the fit and each point's error
	holdout      bool   // lowbit plan fit --holdout: each rank count predicted from the others
	measurements string // file; "" for the built-in ones
	asJSON       bool
	job          costmodel.Job
	memory       int64     // --memory: bytes per rank for state, parameters and gradients; 0: not given
	bucketGiven  bool      // --bucket was given: no bucket hint
	hint         string    // bucketHint's line, printed under the table
	vsOne        bool      // --vs-one: W machines against one first
	choose       bool      // --choose: the choice for the job first
	muon         bool      // --muon: with --choose, the update rule is Muon
	utilization  []float64 // --utilization: the link rate for each target first
}

// planFlags maps the fields of costmodel.Job to the flags that set them.
var planFlags = map[string]string{"Params": "params", "Ranks": "ranks", "Link": "link", "Sharing": "sharing",
	"CompressBps": "compress-rate", "Alpha": "alpha", "RTT": "rtt", "Ineff": "ineff", "BucketBytes": "bucket",
	"StepCompute": "step-compute", "Collectives": "collective",
	"OuterH": "outer-h", "OuterFragments": "outer-fragments", "OuterDelay": "outer-delay",
	"OuterDensity": "outer-density", "OuterSparseChunk": "outer-sparse-chunk", "OuterSparseBits": "outer-sparse-bits",
	"MuonShape": "muon-shape", "MuonParams": "muon-params", "MuonFlops": "muon-flops",
	"TokensPerStep": "tokens-per-step", "Memory": "memory", "Utilization": "utilization"}

func parsePlanFlags(args []string, out io.Writer) (*planConfig, error) {
	cfg := &planConfig{}
	if len(args) > 0 && args[0] == "fit" {
		cfg.fit = true
		args = args[1:]
	}
	j := &cfg.job
	j.Params, j.BucketBytes = 1.3e9, optim.DefaultBucketBytes
	// The plan's sentences name the flags that set a figure (--alpha), not
	// the Job fields.
	j.FieldNames = make(map[string]string, len(planFlags))
	for field, name := range planFlags {
		j.FieldNames[field] = "--" + name
	}
	fs := flag.NewFlagSet("plan", flag.ContinueOnError)
	fs.SetOutput(out)
	fs.Var(&size.CountValue[int64]{P: &j.Params, Min: 1, Max: costmodel.MaxParams}, "params", "model parameters: float32 gradient elements (`count`: 7B, 1.3B, 340M, 137k; B is billion)")
	fs.IntVar(&j.Ranks, "ranks", 64, "data-parallel ranks W (at least 2)")
	fs.StringVar(&j.LinkName, "link", "10gbit", "link rate: 10gbit, 250mbit, 100Mbit/s (bits/s; tc's units) or 1.25GB/s (bytes/s); not Mbps, which is bits to most people and bytes to tc")
	sharing := fs.String("sharing", string(costmodel.PerRank), "per-rank: each rank has a link of this rate (a cluster); shared: one shaped link carries all ranks' traffic and the ranks share the calibration machine's CPUs (the calibration's loopback)")
	list := fs.String("collective", "allreduce,onebit", "comma-separated collectives: allreduce, onebit, fp16, and the outer optimizer's rows (with --outer-h) "+
		strings.Join(outerRowNames(), ", ")+"; fp16, outer-bf16, outer-int8 and outer-sparse are not calibrated; with --outer-h and no --collective the outer rows follow the default ones (outer-sparse where --outer-sparse-chunk fits a fragment)")
	fs.StringVar(&cfg.measurements, "measurements", "", "calibrate from this file of scripts/plan-calibrate.sh (default: the built-in runs recorded on the development machine)")
	fs.Float64Var(&j.CompressBps, "compress-rate", 0, "float32 bytes/s a 1-rank onebit.AllReduce gets through on your hardware (default: measured on the calibration machine; time yours with lowbit bench --backend local --ranks 1 --collective onebit: bytes/p50)")
	fs.Var(&seconds{p: &j.Alpha}, "alpha", "`duration` of one latency-bound message round, as --step-compute takes it (10us, 1.5ms; a bare number is seconds: 10e-6) (default: fitted on the calibration link nearest in rate)")
	fs.Var(&optionalDuration{&j.RTT}, "rtt", "round-trip `duration` of the link, as ping gives it (40ms): every latency-bound round of every collective (the ring allreduce's 2(W-1), an all-gather's W-1, the outer optimizer's agreement) costs half of it, a one-way hop, in place of the fitted alpha, a loopback's; not with --alpha")
	fs.Float64Var(&j.Ineff, "ineff", 0, "time per byte over the line rate's, 1 = line rate (default: fitted on the calibration link nearest in rate, at least 1 for an uncalibrated link)")
	fs.Var(&size.Value[int64]{P: &j.BucketBytes, Min: 4, Max: 1 << 40}, "bucket", "fused bucket `size` in bytes: the gradient goes in calls of this many bytes (optim.DefaultBucketBytes, like DDP)")
	fs.DurationVar(&j.StepCompute, "step-compute", 0, "forward and backward time of one step, added to each step time (no overlap with communication, but for the outer optimizer's delayed exchanges: --outer-delay)")
	fs.Var(&optionalSize{size.Value[int64]{P: &cfg.memory, Min: 1, Max: 1 << 60}}, "memory", "memory of one rank, `size` in bytes (24Gi, 80G): say which optimizers' state, parameters and gradients (fp32) fit in it")
	fs.BoolVar(&cfg.holdout, "holdout", false, "with fit: predict each rank count of each link from a fit to the other rank counts of that link")
	fs.IntVar(&j.OuterH, "outer-h", 0, "the outer optimizer (package outer, DiLoCo): inner steps per outer step H; adds its rows, one per codec, each an exchange every H/fragments steps averaged per step (0: no outer rows)")
	fs.IntVar(&j.OuterFragments, "outer-fragments", 1, "with --outer-h: fragments F of the parameters, each exchanged once every H steps, staggered (in [1, H])")
	fs.IntVar(&j.OuterDelay, "outer-delay", 0, "with --outer-h: steps an exchange runs beside, in the background, before its merge (in [0, H/F]): it hides up to this many --step-compute of each exchange")
	sp := outer.DefaultConfigFor(outer.CodecSparse)
	fs.Float64Var(&j.OuterDensity, "outer-density", float64(sp.Density), "with --outer-h, outer-sparse: share of each chunk's entries sent, in (0, 1] (outer.Config.Density)")
	fs.IntVar(&j.OuterSparseChunk, "outer-sparse-chunk", sp.SparseChunk, "with --outer-h, outer-sparse: chunk length in elements, at least 1/density and at most a fragment (outer.Config.SparseChunk)")
	fs.IntVar(&j.OuterSparseBits, "outer-sparse-bits", sp.SparseBits, "with --outer-h, outer-sparse: bits of each value sent, 1 or 2 (outer.Config.SparseBits)")
	shape := fs.String("muon-shape", "", "Muon's rows (muon, muon-split, onebit-muon; given, they follow the default rows; onebit-muon-owners, 1-bit Muon with onebit.ExchangeOwners, only where --collective names it): the `RxC` shape of the Muon matrices, e.g. 2048x8192 (default: square, the width of a GPT-3-like model of --params, costmodel.DefaultMuonShape)")
	fs.Var(&size.CountValue[int64]{P: &j.MuonParams, Min: 0, Max: costmodel.MaxParams}, "muon-params", "Muon's rows: parameters in Muon matrices, as many whole matrices of --muon-shape as it holds; the rest goes to the auxiliary AdamW (`count`; default: all of --params)")
	fs.Float64Var(&j.MuonFlops, "muon-flops", costmodel.DefaultMuonFlops, "Muon's rows: float32 FLOP/s of the Newton-Schulz products on one rank (default: gonum on one core of the calibration machine, docs/muon.md)")
	fs.BoolVar(&cfg.vsOne, "vs-one", false, "first answer how W machines compare with one (docs/plan.md): each row's tokens per second on one machine and on --ranks, their ratio, and the tokens per worker per step at which they break even; needs --tokens-per-step and --step-compute, and adds the fp16 row (2-byte floats on the wire: float16 or bfloat16) to the default ones")
	fs.Var(&optionalCount{size.CountValue[int64]{P: &j.TokensPerStep, Min: 1, Max: costmodel.MaxTokensPerStep}}, "tokens-per-step", "with --vs-one: tokens (or examples) of each worker's step, whose forward and backward on one machine take --step-compute (`count`: 8192, 8k)")
	registerChooseFlags(fs, cfg)
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
ranks on a loopback shaped to each calibrated rate (scripts/plan-calibrate.sh):
a loopback's alpha (tens of µs), which --rtt replaces by half a wide-area
link's round trip;
the local work of the 1-bit allreduce is its time without a network,
measured on the calibration machine, which differs per machine
(--compress-rate). See docs/plan.md.

With --choose it first picks the optimizer and codec for the job and says
why in one line; with --utilization 0.95 it first prints, for each row, the
link rate at which compute is busy that share of the step.

With --vs-one it first answers "W machines of this step time on this link
against one": each row's tokens per second on one machine and on --ranks,
and the tokens per worker per step (--tokens-per-step, whose compute is
--step-compute) at which they break even.

It then prints the optimizer state each rank holds for each optimizer
(bytes per parameter as measured by their StateBytes), and with --memory
which optimizers fit, with fp32 parameters and gradients, in a rank's
memory.

"lowbit plan fit" prints the fitted model and, for each measured point,
the prediction and its relative error; with --holdout each rank count is
predicted by a fit that has not seen it.

`)
		fs.PrintDefaults()
	}
	if err := cliflag.Parse(fs, args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, cliflag.Usagef("unexpected arguments: %q", fs.Args())
	}
	if cfg.memory > 0 && cfg.fit {
		return nil, cliflag.Usagef("--memory goes with lowbit plan, not lowbit plan fit")
	}
	if cfg.holdout && !cfg.fit {
		return nil, cliflag.Usagef("--holdout goes with lowbit plan fit")
	}
	if err := checkVsOne(fs, cfg); err != nil {
		return nil, err
	}
	if err := checkChoose(fs, cfg); err != nil {
		return nil, err
	}
	var err error
	if j.Sharing, err = costmodel.ParseSharing(*sharing); err != nil {
		return nil, cliflag.Bad(fs, "sharing", "want %s or %s", costmodel.Shared, costmodel.PerRank)
	}
	for name := range strings.SplitSeq(*list, ",") {
		if name = strings.TrimSpace(name); !slices.Contains(j.Collectives, name) {
			j.Collectives = append(j.Collectives, name)
		}
	}
	if flagGiven(fs, "muon-shape") {
		if j.MuonShape, err = costmodel.ParseShape(*shape); err != nil {
			return nil, cliflag.Bad(fs, "muon-shape", "%v", err)
		}
	}
	// Job takes 0 for the sparse codec's defaults; the flags show them.
	for name, zero := range map[string]bool{"outer-density": j.OuterDensity == 0, "outer-sparse-chunk": j.OuterSparseChunk == 0, "outer-sparse-bits": j.OuterSparseBits == 0} {
		if zero {
			return nil, cliflag.Bad(fs, name, "must not be 0")
		}
	}
	if !flagGiven(fs, "collective") {
		j.Collectives = j.DefaultCollectives()
		if cfg.vsOne {
			// The 2-byte allreduce, the other baseline of W against one.
			j.Collectives = slices.Insert(j.Collectives, 1, "fp16")
		}
	}
	cfg.bucketGiven = flagGiven(fs, "bucket")
	if j.Link, err = costmodel.ParseRate(j.LinkName); err != nil {
		reason := strings.TrimPrefix(err.Error(), fmt.Sprintf("link rate %q: ", j.LinkName))
		return nil, cliflag.Bad(fs, "link", "%s", reason)
	}
	j.LinkName = strings.ToLower(strings.TrimSpace(j.LinkName))
	if err := j.Validate(); err != nil {
		var je *costmodel.JobError
		if errors.As(err, &je) {
			return nil, cliflag.Bad(fs, planFlags[je.Field], "%s", je.Reason)
		}
		return nil, err
	}
	return cfg, nil
}

// checkVsOne refuses a --vs-one command line that cannot compare W
// machines with one, naming the flag at fault.
func checkVsOne(fs *flag.FlagSet, cfg *planConfig) error {
	j := &cfg.job
	// bad is cliflag.Bad with a good value to show: these flags' defaults
	// (0) are not.
	bad := func(name, example, reason string) error {
		err := cliflag.Bad(fs, name, "%s", reason)
		var e *cliflag.Error
		if errors.As(err, &e) {
			e.Example = example
		}
		return err
	}
	switch {
	case !cfg.vsOne && flagGiven(fs, "tokens-per-step"):
		return bad("tokens-per-step", "", "goes with --vs-one")
	case !cfg.vsOne:
		return nil
	case cfg.fit:
		return cliflag.Usagef("--vs-one goes with lowbit plan, not lowbit plan fit")
	case j.Ranks < 2:
		return bad("ranks", "2", "--vs-one compares W machines with one: want at least 2 (1 compares one machine with itself)")
	case j.TokensPerStep == 0:
		return bad("tokens-per-step", "8192", "--vs-one needs the tokens (or examples) of each worker's step, at least 1")
	case j.StepCompute <= 0:
		return bad("step-compute", "40ms", "--vs-one needs one machine's forward and backward time for --tokens-per-step tokens, more than 0")
	}
	return nil
}

// flagGiven reports whether the command line set flag name of fs.
func flagGiven(fs *flag.FlagSet, name string) bool {
	given := false
	fs.Visit(func(f *flag.Flag) { given = given || f.Name == name })
	return given
}

// outerRowNames are the names of the outer optimizer's rows
// (costmodel.Collectives with Outer set).
func outerRowNames() []string {
	var names []string
	for _, c := range costmodel.Collectives() {
		if c.Outer {
			names = append(names, c.Name)
		}
	}
	return names
}

func planMain(args []string, stdout, stderr io.Writer) error {
	cfg, err := parsePlanFlags(args, stderr)
	if err != nil {
		return err
	}
	cal, err := costmodel.Builtin()
	if cfg.measurements != "" {
		cal, err = costmodel.LoadFile(cfg.measurements)
	}
	if err != nil {
		return err
	}
	if cfg.fit {
		checks := cal.Check()
		if cfg.holdout {
			if checks, err = cal.HoldOut(); err != nil {
				return err
			}
		}
		return writeFit(stdout, cal.Model, checks, cal.Source, cfg.holdout, cfg.asJSON)
	}
	p, err := cal.Model.Plan(cfg.job)
	if err != nil {
		return err
	}
	if !cfg.bucketGiven && !cfg.asJSON {
		if cfg.hint, err = bucketHint(cal.Model, cfg.job, p); err != nil {
			return err
		}
	}
	var choice *costmodel.Choice
	if cfg.choose {
		if choice, err = cal.Model.Choose(cfg.job, costmodel.ChooseOptions{Muon: cfg.muon, Memory: cfg.memory}); err != nil {
			return fmt.Errorf("--choose: %w", flagError(err))
		}
	}
	var util *costmodel.UtilizationTable
	if len(cfg.utilization) > 0 {
		if util, err = cal.Model.UtilizationRates(cfg.job, cfg.utilization); err != nil {
			return fmt.Errorf("--utilization: %w", flagError(err))
		}
	}
	if cfg.asJSON && (choice != nil || util != nil) {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			Choice      *costmodel.Choice           `json:"choice,omitempty"`
			Utilization *costmodel.UtilizationTable `json:"utilization,omitempty"`
			Plan        *costmodel.Plan             `json:"plan"`
		}{choice, util, p})
	}
	if choice != nil && !cfg.asJSON {
		if err := writeChoice(stdout, choice, cfg); err != nil {
			return err
		}
	}
	if util != nil && !cfg.asJSON {
		if err := writeUtilization(stdout, util, cfg); err != nil {
			return err
		}
	}
	if p.VsOne != nil && !cfg.asJSON {
		if err := writeVsOne(stdout, p); err != nil {
			return err
		}
	}
	return writePlan(stdout, p, cfg, cal.Source)
}

// writeVsOne prints p's W machines against one (--vs-one).
func writeVsOne(w io.Writer, p *costmodel.Plan) error {
	v := p.VsOne
	fmt.Fprintf(w, "# lowbit plan --vs-one: %d machines against one: %s parameters, %s links (%s), %s tokens per worker per step, one machine's step %s\n",
		p.Ranks, size.FormatCount(p.Params), costmodel.FormatRate(p.LinkBps), p.Sharing, strconv.FormatInt(v.TokensPerStep, 10), formatSeconds(v.StepCompute))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "collective\t1 machine tok/s\t%d machines tok/s\tratio\tbreak-even tok/worker/step\t\n", p.Ranks)
	for _, r := range v.Rows {
		name := r.Collective
		if !r.Calibrated {
			name += "*"
		}
		even := "any"
		if r.BreakEvenTokens > 0 {
			even = formatTokens(math.Ceil(r.BreakEvenTokens))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.2fx\t%s\t\n", name, formatTokens(r.OneTokensPerS), formatTokens(r.TokensPerS), r.Ratio, even)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	ratio := map[string]float64{}
	for _, r := range v.Rows {
		ratio[r.Collective] = r.Ratio
	}
	line := fmt.Sprintf("pick: %s, %.2fx one machine's tokens per second (the most on %d machines)", v.Pick, ratio[v.Pick], p.Ranks)
	if v.PickCalibrated != "" {
		line += fmt.Sprintf("; not calibrated: the most of the calibrated rows is %s, %.2fx", v.PickCalibrated, ratio[v.PickCalibrated])
	}
	fmt.Fprintln(w, line+".")
	_, err := fmt.Fprintf(w, "1 machine: --tokens-per-step / --step-compute (Muon's rows: plus orthogonalizing every matrix); %d machines: %d x --tokens-per-step / the row's step comm below (comm not overlapped with compute but for --outer-delay); break-even: the tokens per worker per step at which the two rates are equal, compute time in proportion to the tokens (fewer lose, more win). onebit is 1-bit Adam after its warm-up; the outer rows' inner steps and a lossy codec may need more steps to the same loss, which the plan does not model.\n\n",
		p.Ranks, p.Ranks)
	return err
}

// formatTokens writes a count of tokens (or tokens per second) rounded to
// a whole number, in scientific notation from 1e12.
func formatTokens(x float64) string {
	if x >= 1e12 {
		return strconv.FormatFloat(x, 'g', 4, 64)
	}
	return strconv.FormatFloat(math.Round(x), 'f', 0, 64)
}

// bucketedRows are the rows whose collective goes in buckets of --bucket
// and which pay its latency-bound rounds once per bucket.
var bucketedRows = []string{"onebit", costmodel.OptOnebitMuon, "outer-1bit", costmodel.OptOuterMuon}

// bucketHint is the line lowbit plan prints when the default --bucket
// costs the first bucketed row of p (bucketedRows) more than twice the
// comm that larger buckets would, in latency-bound rounds (a long round
// trip, --rtt, or many ranks): it names the smallest bucket, doubling from
// the default up to the whole gradient, within 20% of the best one's comm.
// It is "" where the default costs less than that.
func bucketHint(m *costmodel.Model, j costmodel.Job, p *costmodel.Plan) (string, error) {
	var row *costmodel.Row
	for i := range p.Rows {
		if slices.Contains(bucketedRows, p.Rows[i].Collective) {
			row = &p.Rows[i]
			break
		}
	}
	if row == nil || row.CommS <= 0 || j.BucketBytes >= 4*j.Params {
		return "", nil
	}
	type try struct {
		bucket int64
		comm   float64
	}
	var tries []try
	j.Collectives = []string{row.Collective}
	for b := int64(1) << bits.Len64(uint64(j.BucketBytes)); ; b *= 2 {
		b = min(b, 4*j.Params)
		j.BucketBytes = b
		q, err := m.Plan(j)
		if err != nil {
			return "", fmt.Errorf("plan with --bucket %s: %w", size.Format(b), err)
		}
		tries = append(tries, try{b, q.Rows[0].CommS})
		if b >= 4*j.Params {
			break
		}
	}
	best := slices.MinFunc(tries, func(a, b try) int { return cmp.Compare(a.comm, b.comm) })
	if best.comm > row.CommS/2 {
		return "", nil
	}
	pick := tries[slices.IndexFunc(tries, func(t try) bool { return t.comm <= best.comm*1.2 })]
	return fmt.Sprintf("hint: latency-bound rounds are %.0f%% of %s's comm in the default buckets of %s; --bucket %s predicts %s instead of %s (larger buckets hold more memory: rerun with it for the state table)",
		100*row.LatencyS/row.CommS, row.Collective, size.Format(p.Assumptions.BucketBytes), size.Format(pick.bucket), formatSeconds(pick.comm), formatSeconds(row.CommS)), nil
}

func writeFit(w io.Writer, m *costmodel.Model, checks []costmodel.Check, source string, holdout, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(struct {
			Model   *costmodel.Model  `json:"model"`
			Holdout bool              `json:"holdout"`
			Points  []costmodel.Check `json:"points"`
		}{m, holdout, checks})
	}
	fmt.Fprintf(w, "# lowbit plan fit: %s\n# machine: %s; link sharing: %s, burst %s\n", source, m.Machine, m.Sharing, size.Format(m.Burst))
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
			fmt.Fprintf(w, " %s %s;", size.Format(p.Bytes), formatSeconds(p.Seconds))
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
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%.0f%%\t%s\t%+.1f%%\t\n", c.Collective, c.Rate, c.Ranks, size.Format(c.Bytes),
			formatSeconds(c.Measured), 100*c.Spread, formatSeconds(c.Predicted), 100*c.RelError)
		worst = max(worst, math.Abs(c.RelError))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "largest error: %.1f%% over %d points\n", 100*worst, len(checks))
	return err
}

func writePlan(w io.Writer, p *costmodel.Plan, cfg *planConfig, source string) error {
	if cfg.asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(p)
	}
	described := map[string]costmodel.Collective{}
	for _, c := range costmodel.Collectives() {
		described[c.Name] = c
	}
	a := p.Assumptions
	fmt.Fprintf(w, "# lowbit plan: %s parameters (%s float32 gradient), %d ranks, %s links (%s)\n",
		size.FormatCount(p.Params), bytesDecimal(float64(4*p.Params)), p.Ranks, costmodel.FormatRate(p.LinkBps), p.Sharing)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	ortho, orthoHead := func(costmodel.Row) string { return "" }, ""
	if p.Muon != nil {
		// Muon's rows: the orthogonalization, a column of its own.
		ortho = func(r costmodel.Row) string { return formatSeconds(r.OrthoS) + "\t" }
		orthoHead = "orthogonalize\t"
	}
	fmt.Fprintf(tw, "collective\tcalls\tsent/rank\tlatency\ttransfer\tcompress\t%scomm\tstep comm\tspeedup vs exact\t\n", orthoHead)
	for _, r := range p.Rows {
		name := r.Collective
		if !r.Calibrated {
			name += "*"
		}
		calls := strconv.Itoa(r.Calls)
		if described[r.Collective].Outer && p.Outer != nil {
			// One exchange every ExchangeEvery steps: calls per step on
			// average.
			calls = strconv.FormatFloat(float64(r.Calls)/p.Outer.ExchangeEvery, 'g', 3, 64)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s%s\t%s\t%.2fx\t\n", name, calls, bytesDecimal(float64(r.WirePerRank)), formatSeconds(r.LatencyS),
			formatSeconds(r.TransferS), formatSeconds(r.CompressS), ortho(r), formatSeconds(r.CommS), formatSeconds(r.StepS), r.SpeedupExact)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	step := "step comm: comm (the gradient exchange of one step: latency + transfer + compress)"
	if cfg.job.StepCompute > 0 {
		step += fmt.Sprintf(" + %s forward and backward (not overlapped)", cfg.job.StepCompute)
	}
	fmt.Fprintf(w, "%s; calls: collective calls per step (a pipelined piece counts as one).\n", step)
	if cfg.hint != "" {
		fmt.Fprintln(w, cfg.hint)
	}
	if o := p.Outer; o != nil {
		frags := "1 fragment"
		if o.Fragments > 1 {
			frags = fmt.Sprintf("%d fragments", o.Fragments)
		}
		fmt.Fprintf(w, "outer-*: the outer optimizer (docs/outer.md), H %d, %s, delay %d: no communication in inner steps; one exchange (agreement, then the codec) of %s parameters every %s steps, averaged per step (calls, sent/rank, latency, transfer, compress, comm, step comm)",
			o.H, frags, o.Delay, size.FormatCount(o.FragmentParams), strconv.FormatFloat(o.ExchangeEvery, 'g', 4, 64))
		if o.Delay > 0 {
			fmt.Fprintf(w, "; each exchange runs beside %d steps of compute (%s) and only what exceeds them counts", o.Delay, formatSeconds(o.HideS))
		}
		if sp := o.Sparse; sp != nil {
			fmt.Fprintf(w, "; outer-sparse sends %d of every %d entries (density %.4g), each a %d-bit offset and a %d-bit value, %d float32 scale(s) per chunk: %.3f bits per element per message, W-1 messages per rank",
				sp.Entries, sp.Chunk, sp.Density, sp.OffsetBits, sp.Bits, sp.Bits, sp.BitsPerElement)
			if slices.ContainsFunc(p.Rows, func(r costmodel.Row) bool { return r.Collective == "outer-sparse-2p" }) {
				fmt.Fprint(w, "; outer-sparse-2p sends them in two phases, 2(W-1) segments of ceil(chunks/W) chunks per rank (about 2(W-1)/W messages)")
			}
		}
		fmt.Fprintln(w, ".")
	}
	for _, r := range p.Rows {
		line := r.Collective + ": " + described[r.Collective].Desc
		if described[r.Collective].Outer {
			line += fmt.Sprintf("; one exchange %s (%d calls)", formatSeconds(r.ExchangeS), r.Calls)
			if r.HiddenS > 0 {
				line += fmt.Sprintf(", %s hidden per step on average", formatSeconds(r.HiddenS))
			}
		}
		fmt.Fprintln(w, line)
	}
	fmt.Fprintln(w, "assumptions:")
	fmt.Fprintf(w, "  buckets: %d of %s (--bucket), called one after another; exact and 1-bit alike\n", a.Buckets, size.Format(a.BucketBytes))
	fmt.Fprintf(w, "  alpha:   %s per latency-bound round (%s); ring allreduce 2(W-1) rounds, 1-bit 3 collectives of W-1 rounds (per piece when pipelined)\n", formatSeconds(a.Alpha), a.AlphaFrom)
	if a.AlphaNote != "" {
		fmt.Fprintf(w, "  note:    %s\n", a.AlphaNote)
	}
	fmt.Fprintf(w, "  beta:    %.3f x line rate per byte (%s)\n", a.Ineff, a.IneffFrom)
	if p.Sharing == string(costmodel.PerRank) {
		fmt.Fprintln(w, "  links:   one per rank, full duplex, non-blocking switch; each link carries the bytes its rank sends")
	} else {
		fmt.Fprintf(w, "  links:   one shaped link carries all ranks' bytes (token bucket, burst %s), ranks share the calibration machine's CPUs\n", size.Format(p.Model.Burst))
	}
	if a.CompressBps > 0 {
		fmt.Fprintf(w, "  compress: a 1-rank 1-bit call gets through %.2f GB/s of float32 (%s); each of W ranks makes (4+1/W)/5 of its passes, on a CPU of its own\n", a.CompressBps/1e9, a.CompressFrom)
	}
	if p.Outer != nil {
		fmt.Fprintln(w, "  outer:   inner steps, pseudo-gradients and the outer step take no time beyond --step-compute; the agreement is an all-gather of 4 bytes per rank (W-1 rounds); fp32, bf16 and int8 exchange a fragment in one call, 1bit in buckets of --bucket, sparse in one all-gather")
	}
	if mp := p.Muon; mp != nil {
		fmt.Fprintf(w, "  muon:    %d matrices of %dx%d (--muon-shape, --muon-params), %s parameters to AdamW; every rank orthogonalizes every matrix, 5 Newton-Schulz iterations of 3r²c+r³ FLOP (r x c, r <= c; symmetric products): %.3g FLOP a step at %.3g FLOP/s (--muon-flops); muon-split: each rank its share (%.3g s), plus an all-gather of the updates; onebit-muon is its step after the warm-up, which is exact Muon's; onebit-muon-owners (named) the same with onebit.ExchangeOwners: each owner its share of the orthogonalization, two 1-bit collectives of segments padded to the most loaded owner's\n",
			mp.Matrices, mp.Shape[0], mp.Shape[1], size.FormatCount(mp.Other), mp.Flops, mp.Rate, mp.SplitOrthoS)
	}
	fmt.Fprintf(w, "  calibration: %s; %s\n", source, p.Model.Machine)
	for _, r := range p.Rows {
		if r.Calibrated {
			continue
		}
		fmt.Fprintf(w, "%s*: %s\n", r.Collective, described[r.Collective].Uncalibrated)
	}
	return writeMemory(w, cfg)
}

// writeMemory prints the optimizer state per rank of every optimizer
// (costmodel.Job.StateTable) and, with --memory, whether it fits.
func writeMemory(w io.Writer, cfg *planConfig) error {
	params := cfg.job.Params
	fmt.Fprintf(w, "\noptimizer state per rank (rank 0, fp32, default configs, buckets of %s):\n", size.Format(cfg.job.BucketBytes))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "optimizer\tbytes/param\tstate\twith params and grads\t"
	if cfg.memory > 0 {
		head += "fits in " + size.Format(cfg.memory) + "\t"
	}
	fmt.Fprintln(tw, head)
	for _, row := range cfg.job.StateTable() {
		if row.Err != nil {
			// Padding of a huge number of tiny buckets: more bytes than
			// an int64 counts.
			line := row.Optimizer + "\ttoo large\t\t\t"
			if cfg.memory > 0 {
				line += "no\t"
			}
			fmt.Fprintln(tw, line)
			continue
		}
		total := row.Bytes + 8*params
		line := fmt.Sprintf("%s\t%.2f\t%s\t%s\t", row.Optimizer, float64(row.Bytes)/float64(params), bytesDecimal(float64(row.Bytes)), bytesDecimal(float64(total)))
		if cfg.memory > 0 {
			fits := "no"
			if total <= cfg.memory {
				fits = "yes"
			}
			line += fits + "\t"
		}
		fmt.Fprintln(tw, line)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(w, "state: every buffer the optimizer owns at its peak (moments, error buffers, staging and packing buffers); params and grads: 8 bytes per parameter; activations and the framework's own memory not included. onebit-adam-compact is 1-bit Adam with StateMode StateCompact (the same steps as StateFull, bit for bit); onebit-adam-sharded is 1-bit Adam with StateMode StateSharded (docs/sharded.md), onebit-adam-sharded-bf16 the same with BF16 BF16WorkerError|BF16Variance, at its peak (the compression stage); zeroone-adam counts the model as one tensor (one bucket per parameter adds a little per tensor). muon and onebit-muon: the model as whole matrices of --muon-shape and one AdamW tensor; onebit-muon-compact-bf16 is 1-bit Muon with StateMode StateCompact and MomentumBF16 (docs/muon.md), in its compression stage.")
	if err == nil && cfg.job.OuterH > 0 {
		_, err = fmt.Fprintln(w, "outer-*: the outer optimizer (--outer-h, --outer-fragments, --outer-delay) around outer.NewAdam's AdamW, both at their defaults (outer.DefaultConfigFor, outer.DefaultAdamConfigFor; the AdamW's 8 bytes per parameter included), one row per codec but bf16 (not modelled); the sparse codec's state is bfloat16 by default: its accumulator (Config.AccumulatorBF16) and the AdamW's moments (AdamConfig.MomentsBF16, 4 bytes per parameter); outer-sparse-fp32: the sparse codec with float32 state (both false); outer-muon: the 1bit codec around Muon (MuLoCo), Muon's state counted as the muon row's.")
	}
	return err
}
