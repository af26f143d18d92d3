package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"

	"github.com/lowbit-ml/lowbit/internal/optnames"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// bitsPerByte converts a loss in nats per byte.
func bitsPerByte(nats float64) float64 { return nats / math.Ln2 }

func hasSuffixFold(s, suffix string) bool {
	return len(s) >= len(suffix) && strings.EqualFold(s[len(s)-len(suffix):], suffix)
}

// printHeader says what is about to be trained.
func printHeader(w io.Writer, o *options, data *corpus, workers int) {
	labels := make([]string, len(o.runs))
	for i, r := range o.runs {
		labels[i] = r.label()
	}
	fmt.Fprintf(w, "GoMLX byte-level GPT (%s) on %d %s ranks (GoMLX pure-Go backend)\n", o.model, workers, o.backend)
	fmt.Fprintf(w, "corpus %s: %d training files (%.1f MB), %d validation files (%.1f MB)",
		data.desc, data.trainFiles, float64(len(data.train))/1e6, data.valFiles, float64(len(data.val))/1e6)
	if data.skipped > 0 {
		fmt.Fprintf(w, ", %d binary files skipped", data.skipped)
	}
	fmt.Fprintln(w)
	h := o.hyper()
	fmt.Fprintf(w, "runs: %s; %d steps of %d sequences (%d tokens), lr %g, freeze step %d, seed %d\n",
		strings.Join(labels, ", "), o.steps, o.batch, o.batch*o.model.context, o.lr, h.freezeStep, o.seed)
	fmt.Fprintln(w, validationDesc(o, data))
	if o.ownData() {
		fmt.Fprintf(w, "rank data: each rank draws its share of the batch from its own block of the training files (-rank-data files)\n")
	}
	if d := lateDesc(o, data); d != "" {
		fmt.Fprintln(w, d)
	}
	if d := outerDesc(o); d != "" {
		fmt.Fprintln(w, d)
	}
	if d := muonDesc(o); d != "" {
		fmt.Fprintln(w, d)
	}
}

// muonDesc describes Muon's two learning rates when a run is muon, "" if
// none is.
func muonDesc(o *options) string {
	for _, r := range o.runs {
		if r.name == muon || r.name == onebitMuon {
			split := ""
			if o.muonSplit {
				split = "; exact Muon's orthogonalization split across the ranks (-muon-split)"
			}
			if o.muonWarmup == "all" {
				split += "; onebit-muon's exact warm-up for both groups (-muon-warmup all)"
			}
			if o.muonExch == "owners" {
				split += fmt.Sprintf("; onebit-muon's owners' exchange: each matrix's owner orthogonalizes an estimate of the ranks' mean momentum, sent to it at %d bit(s) an element (-muon-exchange owners -muon-owner-bits %d)", o.ownerBits, o.ownerBits)
			}
			return fmt.Sprintf("muon: the hidden matrices (attention, feed-forward) by Muon, lr %g (-muon-lr); the embeddings, the output head, biases and norms by AdamW, lr %g (-lr)%s",
				o.muonLR, o.lr, split)
		}
	}
	return ""
}

// validationDesc says what the two evaluations cover: the curve's, every
// -eval-every steps, and the final one (finalEval).
func validationDesc(o *options, data *corpus) string {
	tiles := (len(data.val) - 1) / o.model.context
	final := fmt.Sprintf("all %d windows that tile the validation text (each of its bytes a target once)", tiles)
	if o.finalWindows > 0 && o.finalWindows < tiles {
		final = fmt.Sprintf("%d of the %d windows that tile the validation text, evenly spaced", o.finalWindows, tiles)
	}
	return fmt.Sprintf("validation (windows of %d bytes): the curve on %d windows, the final val loss on %s, with its standard error",
		o.model.context+1, min(o.valWindows, len(data.val)-o.model.context), final)
}

// relStderr is the final validation loss's standard error relative to
// it, in percent.
func (r *result) relStderr() float64 {
	if r.valLoss == 0 {
		return 0
	}
	return 100 * r.final.stderr / r.valLoss
}

// outerDesc describes diloco's settings when a run is diloco, "" if none
// is.
func outerDesc(o *options) string {
	var d string
	seen := map[outer.Codec]bool{}
	h := o.hyper()
	for _, r := range o.runs {
		if r.name != diloco || seen[r.codec] {
			continue
		}
		c := h.outerFor(r.codec)
		if len(seen) == 0 {
			inner := fmt.Sprintf("Adam (lr %g)", o.lr)
			if h.outerMuon {
				inner = fmt.Sprintf("Muon (lr %g, its AdamW's %g)", o.muonLR, o.lr)
			}
			d = fmt.Sprintf("diloco: inner %s, an outer step every %d steps (-outer-h), %d fragments, delay %d",
				inner, c.H, c.Fragments, c.Delay)
			if c.BucketBytes > 0 {
				d += fmt.Sprintf(", 1-bit buckets of %d bytes", c.BucketBytes)
			}
		}
		seen[r.codec] = true
		d += fmt.Sprintf("; %s: outer SGD lr %g momentum %g", r.codec, c.LR, c.Momentum)
		if c.Codec == outer.CodecSparse {
			d += fmt.Sprintf(", %g of each %d-element chunk sent in %d bit(s), accumulator decay %g", c.Density, c.SparseChunk, c.SparseBits, c.Decay)
			if c.SparseExchange != outer.SparseAllGather {
				d += ", exchange " + c.SparseExchange.String()
				if c.SparseServerDensity != 0 {
					d += fmt.Sprintf(" (second phase %g)", c.SparseServerDensity)
				}
			}
		}
		switch moments := h.innerMomentsBF16(r.codec); {
		case c.AccumulatorBF16 && moments:
			d += ", accumulator and inner moments in bfloat16"
		case c.AccumulatorBF16:
			d += ", accumulator in bfloat16"
		case moments:
			d += ", inner moments in bfloat16"
		}
	}
	return d
}

// outerLine says, for a diloco run, how many outer steps it took and its
// compute utilization; "" for the other runs.
func outerLine(r *result) string {
	if r.outer == nil {
		return ""
	}
	return fmt.Sprintf("%s: %d outer steps (%d skipped), compute utilization %.3f (evaluated on the global parameters)",
		r.spec.label(), r.outer.exchanges, r.outer.skipped, r.outer.utilization)
}

// progressPrinter prints a line per validation unless quiet; the ranks of
// the local backend share it, only rank 0 calls it.
func progressPrinter(w io.Writer, quiet bool) progressFunc {
	if quiet {
		return nil
	}
	var mu sync.Mutex
	return func(r runSpec, steps int, e evalPoint, trainLoss float64) {
		mu.Lock()
		defer mu.Unlock()
		tl := "      -"
		if !math.IsNaN(trainLoss) && e.Step > 0 {
			tl = fmt.Sprintf("%7.4f", trainLoss)
		}
		late := ""
		if e.LateLoss != nil {
			late = fmt.Sprintf("  late-byte loss %.4f", *e.LateLoss)
		}
		fmt.Fprintf(w, "%-16s step %5d/%d  tokens %8d  train loss %s  val loss %.4f (%.3f bits/byte)%s  %6.1fs\n",
			r.label(), e.Step, steps, e.Tokens, tl, e.ValLoss, bitsPerByte(e.ValLoss), late, e.TrainS)
	}
}

// report prints the results table and, for each compressed run, how it
// compares with its exact baseline in the same table.
func report(w io.Writer, o *options, results []*result) {
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "optimizer\tval loss\ts.e.\t%sbits/byte\tcurve val\ttrain loss\tsteps\ttokens\ttrain time\tcomm\tto %.3g\tsent/rank\tlast step\tskipped\t\n", lateHeader(o), o.target)
	for _, r := range results {
		tt := "-"
		if o.target <= 0 {
			tt = "no target"
		} else if r.reached() {
			tt = fmt.Sprintf("%.1fs (step %d)", r.targetTime.Seconds(), r.targetStep)
		} else {
			tt = "not reached"
		}
		fmt.Fprintf(tw, "%s\t%.4f\t±%.2f%%\t%s%.4f\t%.4f\t%.4f\t%d\t%d\t%.1fs\t%.0f%%\t%s\t%s\t%s\t%d\t\n",
			r.spec.label(), r.valLoss, r.relStderr(), lateCell(o, r), bitsPerByte(r.valLoss), r.curveLoss, r.trainLoss, r.steps, r.tokens,
			r.wall.Seconds(), 100*r.commShare(), tt, human(r.bytes), human(r.lastBytes), r.skipped)
	}
	tw.Flush()
	for _, r := range results {
		if l := outerLine(r); l != "" {
			fmt.Fprintln(w, l)
		}
	}
	for _, r := range results {
		b := findBaseline(results, r)
		if b == nil {
			continue
		}
		fmt.Fprintf(w, "%s vs %s: validation loss %+.2f%%, %.1fx fewer bytes sent per rank",
			r.spec.label(), b.spec.label(), 100*(r.valLoss-b.valLoss)/b.valLoss, b.bytes/max(r.bytes, 1))
		if rl, bl := r.lateLoss(), b.lateLoss(); rl != nil && bl != nil {
			fmt.Fprintf(w, ", late-byte loss %+.2f%%", 100*(*rl-*bl) / *bl)
		}
		if r.reached() && b.reached() {
			fmt.Fprintf(w, ", time to %.3g %.2fx", o.target, b.targetTime.Seconds()/r.targetTime.Seconds())
		}
		fmt.Fprintln(w)
	}
}

// commShare is the share of the training time spent in collectives.
func (r *result) commShare() float64 {
	if r.wall <= 0 {
		return 0
	}
	return r.commTime.Seconds() / r.wall.Seconds()
}

// findBaseline returns the run of r's exact counterpart with fp32
// averaging in results, or nil (for an exact optimizer, or if it was not
// run).
func findBaseline(results []*result, r *result) *result {
	b, ok := optnames.Baseline[r.spec.name]
	if !ok {
		if r.spec.reduce == optim.ReduceFP32 {
			return nil
		}
		b = r.spec.name // adam fp16 against adam fp32
	}
	for _, x := range results {
		if x.spec.name == b && x.spec.reduce == optim.ReduceFP32 && x != r {
			return x
		}
	}
	return nil
}

// human formats a byte count.
func human(b float64) string {
	switch {
	case b >= 1e9:
		return fmt.Sprintf("%.2f GB", b/1e9)
	case b >= 1e6:
		return fmt.Sprintf("%.1f MB", b/1e6)
	default:
		return fmt.Sprintf("%.1f kB", b/1e3)
	}
}

// jsonRun is one run in the -json file.
type jsonRun struct {
	Optimizer      string  `json:"optimizer"`
	Reduce         string  `json:"reduce"`
	ValLoss        float64 `json:"val_loss"`
	ValBitsPerByte float64 `json:"val_bits_per_byte"`
	// ValStderr is val_loss's standard error (nats per byte), from the
	// spread of the final evaluation's windows, ValWindows of them;
	// CurveValLoss the last evaluation of the curve (-val-windows
	// windows). val_loss is the final evaluation's.
	ValStderr        float64     `json:"val_loss_stderr"`
	ValWindows       int         `json:"val_windows"`
	CurveValLoss     float64     `json:"curve_val_loss"`
	TrainLoss        float64     `json:"train_loss"`
	Steps            int         `json:"steps"`
	ResumedAt        int         `json:"resumed_at"` // the checkpoint's step, 0: not resumed
	Tokens           int64       `json:"tokens"`
	WallS            float64     `json:"wall_s"`
	CommS            float64     `json:"comm_s"`
	Target           float64     `json:"target"`
	TimeToTargetS    *float64    `json:"time_to_target_s"` // null: not reached
	StepsToTarget    *int        `json:"steps_to_target"`
	BytesSentPerRank float64     `json:"bytes_sent_per_rank"`
	LastStepBytes    float64     `json:"last_step_bytes"`
	Skipped          int64       `json:"skipped"`
	Workers          int         `json:"workers"`
	Backend          string      `json:"backend"`
	Model            jsonModel   `json:"model"`
	Curve            []evalPoint `json:"curve"`

	// LateBytes, LateFrom and LateValLoss: -late-bytes, the step they first
	// occur in training and the last late-byte validation loss (absent: no
	// late byte in the validation windows); all absent without -late-bytes.
	LateBytes   string   `json:"late_bytes,omitempty"`
	LateFrom    int      `json:"late_from,omitempty"`
	LateValLoss *float64 `json:"late_val_loss,omitempty"`

	// Outer is diloco's outer optimizer, absent for the other runs.
	Outer *jsonOuter `json:"outer,omitempty"`
}

// jsonOuter is a diloco run's outer settings and statistics.
type jsonOuter struct {
	H           int     `json:"h"`
	Fragments   int     `json:"fragments"`
	Delay       int     `json:"delay"`
	BucketBytes int     `json:"bucket_bytes"` // 0: outer's default`
	Codec       string  `json:"codec"`
	LR          float64 `json:"lr"`                   // the outer learning rate
	Momentum    float64 `json:"momentum"`             // the outer momentum
	BF16State   bool    `json:"bf16_state,omitempty"` // the sparse accumulator or the inner Adam's moments in bfloat16 (-outer-state)
	Inner       string  `json:"inner"`                // the inner optimizer (-outer-inner): adam or muon
	Exchanges   int64   `json:"exchanges"`
	Skipped     int64   `json:"skipped_exchanges"`
	Utilization float64 `json:"utilization"` // mean over the ranks
}

type jsonModel struct {
	DModel  int `json:"d_model"`
	Layers  int `json:"layers"`
	Heads   int `json:"heads"`
	FFN     int `json:"ffn"`
	Context int `json:"context"`
	Batch   int `json:"batch"`
	// RankData is -rank-data: shared, or files (each rank its own files).
	RankData string `json:"rank_data"`
}

func writeJSON(path string, o *options, results []*result) error {
	runs := make([]jsonRun, len(results))
	for i, r := range results {
		j := jsonRun{
			Optimizer: r.spec.name, Reduce: r.spec.reduceName(),
			ValLoss: r.valLoss, ValBitsPerByte: bitsPerByte(r.valLoss), TrainLoss: r.trainLoss,
			ValStderr: r.final.stderr, ValWindows: r.final.windows, CurveValLoss: r.curveLoss,
			Steps: r.steps, ResumedAt: r.resumedAt, Tokens: r.tokens, WallS: r.wall.Seconds(), CommS: r.commTime.Seconds(),
			Target: o.target, BytesSentPerRank: r.bytes, LastStepBytes: r.lastBytes, Skipped: r.skipped,
			Workers: r.workers, Backend: o.backend, Curve: r.evals,
			Model: jsonModel{o.model.dModel, o.model.layers, o.model.heads, o.model.ffn, o.model.context, o.batch, o.rankData},
		}
		if r.reached() {
			t, s := r.targetTime.Seconds(), r.targetStep
			j.TimeToTargetS, j.StepsToTarget = &t, &s
		}
		if o.late.chars != "" {
			j.LateBytes, j.LateFrom, j.LateValLoss = o.late.chars, o.lateFrom(), r.lateLoss()
		}
		if r.outer != nil {
			h := o.hyper()
			c := h.outerFor(r.spec.codec)
			j.Outer = &jsonOuter{H: c.H, Fragments: c.Fragments, Delay: c.Delay, BucketBytes: c.BucketBytes, Codec: r.spec.codec.String(),
				LR: float64(c.LR), Momentum: float64(c.Momentum), BF16State: c.AccumulatorBF16 || h.innerMomentsBF16(r.spec.codec),
				Inner: o.outerInner, Exchanges: r.outer.exchanges, Skipped: r.outer.skipped, Utilization: r.outer.utilization}
		}
		if math.IsNaN(j.TrainLoss) {
			j.TrainLoss = -1 // JSON has no NaN: every step was skipped
		}
		runs[i] = j
	}
	b, err := json.MarshalIndent(runs, "", "  ")
	if err != nil {
		return err
	}
	return writeFile(path, append(b, '\n'))
}

// writeMarkdown writes the results table as Markdown (docs/measured.md's tables).
func writeMarkdown(path string, o *options, data *corpus, results []*result) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%s; %d ranks (%s backend); %d steps of %d sequences of %d bytes (%d tokens per run); lr %g, freeze step %d, seed %d; corpus %d training files (%.1f MB), %d validation files.\n\n",
		o.model, results[0].workers, o.backend, o.steps, o.batch, o.model.context, results[0].tokens, o.lr, o.hyper().freezeStep, o.seed,
		data.trainFiles, float64(len(data.train))/1e6, data.valFiles)
	lateCol, lateSep := "", ""
	if d := lateDesc(o, data); d != "" {
		fmt.Fprintf(&b, "%s; the late-byte loss is the validation loss on the positions whose next byte is one of them.\n\n", strings.ToUpper(d[:1])+d[1:])
		lateCol, lateSep = " late-byte loss |", "---:|"
	}
	fmt.Fprintf(&b, "%s.\n\n", strings.ToUpper(validationDesc(o, data)[:1])+validationDesc(o, data)[1:])
	if o.ownData() {
		fmt.Fprintf(&b, "Each rank drew its share of every batch from its own block of the training files (-rank-data files).\n\n")
	}
	fmt.Fprintf(&b, "| optimizer | val loss | s.e. |%s bits/byte | curve val | vs exact | train loss | sent/rank | time to target | skipped |\n", lateCol)
	fmt.Fprintf(&b, "|---|---:|---:|%s---:|---:|---:|---:|---:|---:|---:|\n", lateSep)
	for _, r := range results {
		vs := ""
		if bl := findBaseline(results, r); bl != nil {
			vs = fmt.Sprintf("%+.2f%%", 100*(r.valLoss-bl.valLoss)/bl.valLoss)
		}
		tt := "not reached"
		if r.reached() {
			tt = fmt.Sprintf("%.1fs (step %d)", r.targetTime.Seconds(), r.targetStep)
		} else if o.target <= 0 {
			tt = "-"
		}
		late := ""
		if lateCol != "" {
			late = " " + formatLate(r.lateLoss()) + " |"
		}
		fmt.Fprintf(&b, "| %s | %.4f | ±%.2f%% |%s %.4f | %.4f | %s | %.4f | %s | %s | %d |\n",
			r.spec.label(), r.valLoss, r.relStderr(), late, bitsPerByte(r.valLoss), r.curveLoss, vs, r.trainLoss, human(r.bytes), tt, r.skipped)
	}
	writeBytesTable(&b, results)
	if d := muonDesc(o); d != "" {
		fmt.Fprintf(&b, "\n%s.\n", strings.ToUpper(d[:1])+d[1:])
	}
	if d := outerDesc(o); d != "" {
		fmt.Fprintf(&b, "\n%s.\n", strings.ToUpper(d[:1])+d[1:])
		for _, r := range results {
			if l := outerLine(r); l != "" {
				fmt.Fprintf(&b, "%s.\n", l)
			}
		}
	}
	return writeFile(path, []byte(b.String()))
}

// writeBytesTable writes the curve's validation loss and the bytes sent
// per rank so far at each evaluation, a row per step and a column per run
// (the points of the -plot against bytes); "-" where a run was not
// evaluated at that step.
func writeBytesTable(b *strings.Builder, results []*result) {
	var steps []int
	at := make([]map[int]evalPoint, len(results))
	for i, r := range results {
		at[i] = map[int]evalPoint{}
		for _, e := range r.evals {
			if _, ok := at[i][e.Step]; !ok {
				steps = append(steps, e.Step)
			}
			at[i][e.Step] = e
		}
	}
	slices.Sort(steps)
	steps = slices.Compact(steps)
	fmt.Fprintf(b, "\nValidation loss of the curve and bytes sent per rank so far (mean over the ranks) at each evaluation:\n\n| step | tokens |")
	for _, r := range results {
		fmt.Fprintf(b, " %s |", r.spec.label())
	}
	fmt.Fprintf(b, "\n|---:|---:|%s\n", strings.Repeat("---:|", len(results)))
	for _, s := range steps {
		var tokens int64
		var cells strings.Builder
		for i := range results {
			e, ok := at[i][s]
			if !ok {
				cells.WriteString(" - |")
				continue
			}
			tokens = e.Tokens
			fmt.Fprintf(&cells, " %.4f, %s |", e.ValLoss, human(e.BytesSent))
		}
		fmt.Fprintf(b, "| %d | %d |%s\n", s, tokens, cells.String())
	}
}

func writeFile(path string, b []byte) error {
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	return os.WriteFile(path, b, 0o644)
}
