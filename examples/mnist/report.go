package main

import (
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/lowbit-ml/lowbit/internal/optnames"
	"github.com/lowbit-ml/lowbit/outer"
)

// printHeader says what is about to be trained.
func printHeader(w io.Writer, o *options, names []string, workers, examples int) {
	steps := examples / o.batch
	fmt.Fprintf(w, "MNIST 784-256-10 MLP: %s; %d workers (%s backend), global batch %d (%d per worker), %d epochs x %d steps, lr %g",
		strings.Join(names, " then "), workers, o.backend, o.batch, o.batch/workers, o.epochs, steps, o.lr)
	for _, n := range names {
		if _, ok := optnames.Baseline[n]; ok && n != diloco {
			fmt.Fprintf(w, ", freeze step %d", o.freezeStep)
			break
		}
	}
	if slices.Contains(names, muon) {
		fmt.Fprintf(w, ", muon: Muon lr %g (-muon-lr) for w1 and w2, AdamW lr %g (-lr) for the biases", o.muonLR, o.lr)
	}
	if slices.Contains(names, diloco) {
		c := o.outer
		fmt.Fprintf(w, ", diloco: H %d, %d fragments, delay %d, %s pseudo-gradients, outer Nesterov lr %g momentum %g", c.H, c.Fragments, c.Delay, c.Codec, c.LR, c.Momentum)
		if c.Codec == outer.CodecSparse && (c.SparseExchange != outer.SparseAllGather || c.SparseBits != 1) {
			fmt.Fprintf(w, " (exchange %s, %d-bit values)", c.SparseExchange, c.SparseBits)
		}
	}
	fmt.Fprintln(w)
}

// progress draws one progress bar per epoch on w: a single line redrawn
// with \r on a terminal, and only the finished line of each epoch otherwise.
type progress struct {
	w        io.Writer
	name     string
	epochs   int
	tty      bool
	quiet    bool
	start    time.Time
	lastDraw time.Time
}

func newProgress(w io.Writer, name string, epochs int, quiet bool) *progress {
	tty := false
	if f, ok := w.(*os.File); ok {
		if fi, err := f.Stat(); err == nil {
			tty = fi.Mode()&os.ModeCharDevice != 0
		}
	}
	return &progress{w: w, name: name, epochs: epochs, tty: tty, quiet: quiet, start: time.Now()}
}

// update is a progressFunc.
func (p *progress) update(epoch, step, steps int, loss float64, last *evalPoint) {
	if p.quiet {
		return
	}
	done := step == steps
	now := time.Now()
	if !done && (!p.tty || now.Sub(p.lastDraw) < 100*time.Millisecond) {
		return
	}
	p.lastDraw = now
	const width = 30
	fill := width * step / steps
	bar := strings.Repeat("=", fill) + strings.Repeat(" ", width-fill)
	if fill < width {
		bar = bar[:fill] + ">" + bar[fill+1:]
	}
	line := fmt.Sprintf("%-12s epoch %d/%d [%s] %4d/%d  loss %.4f  test acc %5.1f%%  %5.1fs",
		p.name, epoch+1, p.epochs, bar, step, steps, loss, 100*last.acc, now.Sub(p.start).Seconds())
	switch {
	case p.tty && done:
		fmt.Fprintf(p.w, "\r%s\n", line)
	case p.tty:
		fmt.Fprintf(p.w, "\r%s", line)
	default:
		fmt.Fprintln(p.w, line)
	}
}

// timeToTarget returns the first evaluation that reached the target
// accuracy.
func timeToTarget(r *result, target float64) (evalPoint, bool) {
	for _, e := range r.evals {
		if e.acc >= target {
			return e, true
		}
	}
	return evalPoint{}, false
}

// printTable writes one row per optimizer with the totals, a second table
// with the same per step, then the compressed optimizer's ratios against
// the exact one where both ran.
func printTable(w io.Writer, results []*result, target float64) {
	// Names are padded so that the first column reads left-aligned.
	width := len("optimizer")
	for _, r := range results {
		width = max(width, len(r.optimizer))
	}
	name := func(s string) string { return fmt.Sprintf("%-*s", width, s) }
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%s\ttest acc\ttrain loss\tto %s\twall\tcompute\tcomm\tcompress\tsent/worker\t\n", name("optimizer"), pct(target))
	for _, r := range results {
		tt := "-"
		if e, ok := timeToTarget(r, target); ok {
			w := secs(e.wall)
			if e.wall < 0 {
				w = "?" // from a checkpoint made before walls were saved
			}
			tt = fmt.Sprintf("%s (step %d)", w, e.step)
		}
		fmt.Fprintf(tw, "%s\t%s\t%.4f\t%s\t%s\t%s\t%s\t%s\t%s\t\n",
			name(r.optimizer), pct(r.test.acc), r.trainLoss, tt, secs(r.wall), secs(r.compute), secs(r.comm),
			secs(r.compress), bytesString(r.bytesSent))
	}
	tw.Flush()

	fmt.Fprintln(w, "\nper step and worker:")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%s\tsteps\tskipped\tfinal stage\tcompute\tcomm\tcompress\tsent (mean)\tsent (last step)\t\n", name("optimizer"))
	for _, r := range results {
		n := time.Duration(max(1, r.steps))
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t\n",
			name(r.optimizer), r.steps, r.skipped, r.stage, ms(r.compute/n), ms(r.comm/n), ms(r.compress/n),
			bytesString(r.bytesSent/float64(max(1, r.steps))), bytesString(r.lastStepBytes))
	}
	tw.Flush()

	fmt.Fprintln(w, "\ntrain loss: mean over the last epoch. wall: training time, evaluations excluded (mean over workers).")
	fmt.Fprintln(w, "compute: forward+backward. comm: inside collectives during Step, waiting for slower workers included.")
	fmt.Fprintln(w, "compress: the rest of Step (compression and the update). sent: bytes a worker put on the wire in Step.")
	for _, r := range results {
		if r.utilization > 0 {
			fmt.Fprintf(w, "%s: compute utilization %s (the share of the wall time not blocked on an exchange).\n", r.optimizer, pct(r.utilization))
		}
		if r.resumedFrom > 0 {
			fmt.Fprintf(w, "%s resumed from step %d: wall, compute, comm, compress and sent cover the resumed part only; to %s counts the training time of every part.\n",
				r.optimizer, r.resumedFrom, pct(target))
		}
	}
	byName := map[string]*result{}
	for _, r := range results {
		byName[r.optimizer] = r
	}
	for _, r := range results {
		b, ok := byName[optnames.Baseline[r.optimizer]]
		if !ok || r.bytesSent == 0 {
			continue
		}
		last := fmt.Sprintf("%.1fx fewer in the last step", ratio(b.lastStepBytes, r.lastStepBytes))
		if r.lastStepBytes == 0 {
			last = "none in the last step" // diloco between exchanges
		}
		fmt.Fprintf(w, "\n%s vs %s: %.1fx fewer bytes sent in total, %s; comm time x%.2f, wall time x%.2f, test accuracy %+.2f points\n",
			r.optimizer, b.optimizer, b.bytesSent/r.bytesSent, last,
			ratio(r.comm.Seconds(), b.comm.Seconds()), ratio(r.wall.Seconds(), b.wall.Seconds()),
			100*(r.test.acc-b.test.acc))
	}
}

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

func pct(x float64) string { return fmt.Sprintf("%.1f%%", 100*x) }

func secs(d time.Duration) string { return fmt.Sprintf("%.1fs", d.Seconds()) }

func ms(d time.Duration) string { return fmt.Sprintf("%.2fms", float64(d)/float64(time.Millisecond)) }

// bytesString prints a byte count with a decimal unit.
func bytesString(b float64) string {
	switch {
	case b >= 1e9:
		return fmt.Sprintf("%.2f GB", b/1e9)
	case b >= 1e6:
		return fmt.Sprintf("%.1f MB", b/1e6)
	case b >= 1e3:
		return fmt.Sprintf("%.1f kB", b/1e3)
	}
	return fmt.Sprintf("%.0f B", b)
}
