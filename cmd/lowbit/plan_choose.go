package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/lowbit-ml/lowbit/costmodel"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
	"github.com/lowbit-ml/lowbit/size"
)

// lowbit plan --choose (costmodel.Model.Choose) and --utilization
// (costmodel.Model.UtilizationRates): docs/plan.md, "The choice for the
// job" and "The bandwidth for a target utilization".

// shares is --utilization: comma-separated shares in (0, 1).
type shares struct{ p *[]float64 }

func (s shares) String() string {
	if s.p == nil {
		return ""
	}
	parts := make([]string, len(*s.p))
	for i, v := range *s.p {
		parts[i] = strconv.FormatFloat(v, 'g', -1, 64)
	}
	return strings.Join(parts, ",")
}

func (s shares) Set(v string) error {
	var out []float64
	for part := range strings.SplitSeq(v, ",") {
		x, err := strconv.ParseFloat(strings.TrimSpace(part), 64)
		if err != nil || !(x > 0 && x < 1) {
			return fmt.Errorf("want compute utilization targets in (0, 1), comma-separated, such as 0.95 or 0.5,0.9,0.95,0.99")
		}
		out = append(out, x)
	}
	*s.p = out
	return nil
}

// registerChooseFlags adds --choose, --muon and --utilization to fs.
func registerChooseFlags(fs *flag.FlagSet, cfg *planConfig) {
	fs.BoolVar(&cfg.choose, "choose", false, "first pick the optimizer and codec for the job (docs/plan.md, \"The choice for the job\"): the fastest row per step of those allowed (with --outer-h the outer optimizer's rows too: local steps accepted; --memory; --muon; the measurements' quality rules), or an earlier one within 2%, and why in one line")
	fs.BoolVar(&cfg.muon, "muon", false, "with --choose: the update rule is Muon (rows muon, muon-split, onebit-muon and with --outer-h the outer optimizer with Muon inside, outer-muon); the sparse codec is excluded with Muon inside (docs/outer.md, \"The tighter target\")")
	fs.Var(shares{&cfg.utilization}, "utilization", "first print, for each row, the link rate at which compute is busy this share of the step (comma-separated targets in (0, 1): 0.95 or 0.5,0.9,0.95,0.99), alpha and beta as at --link; needs --step-compute")
}

// checkChoose refuses a command line whose --choose, --muon or
// --utilization cannot be served, naming the flag at fault.
func checkChoose(fs *flag.FlagSet, cfg *planConfig) error {
	switch {
	case cfg.fit && (cfg.choose || len(cfg.utilization) > 0):
		return cliflag.Usagef("--choose and --utilization go with lowbit plan, not lowbit plan fit")
	case cfg.muon && !cfg.choose:
		return cliflag.Bad(fs, "muon", "goes with --choose")
	case len(cfg.utilization) > 0 && cfg.job.StepCompute <= 0:
		err := cliflag.Bad(fs, "step-compute", "--utilization needs the compute of a step, more than 0: the time it keeps busy")
		var e *cliflag.Error
		if errors.As(err, &e) {
			e.Example = "1s"
		}
		return err
	}
	return nil
}

// writeChoice prints the choice for the job (--choose): its line, then
// every row considered.
func writeChoice(w io.Writer, ch *costmodel.Choice, cfg *planConfig) error {
	fmt.Fprintf(w, "# lowbit plan --choose: %s parameters, %d ranks, %s links (%s)", size.FormatCount(cfg.job.Params), cfg.job.Ranks,
		costmodel.FormatRate(cfg.job.Link), cfg.job.Sharing)
	if cfg.job.OuterH > 0 {
		fmt.Fprintf(w, ", local steps accepted (--outer-h %d)", cfg.job.OuterH)
	} else {
		fmt.Fprint(w, ", no local steps (no --outer-h)")
	}
	if cfg.muon {
		fmt.Fprint(w, ", Muon")
	}
	if cfg.memory > 0 {
		fmt.Fprintf(w, ", --memory %s", size.Format(cfg.memory))
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "choice: %s\n", ch.Reason)
	if ch.Outer {
		fmt.Fprintf(w, "outer.ConfigForRow(%q, %d, %d, %d) gives its outer.Config (codec %s at outer.DefaultConfigFor)\n",
			ch.Row, cfg.job.OuterH, max(1, cfg.job.OuterFragments), cfg.job.OuterDelay, ch.Codec)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "row\tstep\tvs chosen\tstate as\twith params and grads\tnote")
	for _, c := range ch.Candidates {
		step, vs, note := "-", "-", ""
		switch {
		case c.Excluded != "":
			note = "excluded: " + c.Excluded
		case c.Row == ch.Row:
			note = "chosen"
		case c.Row == ch.Fastest:
			note = "fastest"
		}
		if c.Excluded == "" {
			step, vs = formatSeconds(c.StepS), fmt.Sprintf("%.2fx", c.StepS/ch.StepS)
			if r := c.StepS / ch.StepS; r < 1.1 {
				vs = fmt.Sprintf("%.3fx", r)
			}
		}
		mem := "-"
		if c.State != "" {
			mem = bytesDecimal(float64(c.Bytes))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", c.Row, step, vs, cmpOr(c.State, "-"), mem, note)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintln(w, "rows in the preference order (exact, 16-bit, 1-bit, then the outer optimizer's rows in the plan's order); the choice: the first allowed row within 2% of the fastest; the plan's step times assume what the plan below does, and a lossy codec or local steps may need more steps to the same loss, which the plan does not model.")
	if err == nil {
		_, err = fmt.Fprintln(w)
	}
	return err
}

// flagError names the flag of a *costmodel.JobError's field in place of
// the field ("--memory: ..."); other errors as they are.
func flagError(err error) error {
	var je *costmodel.JobError
	if errors.As(err, &je) {
		if name, ok := planFlags[je.Field]; ok {
			return fmt.Errorf("--%s: %s", name, je.Reason)
		}
	}
	return err
}

// cmpOr is s, or or when s is empty.
func cmpOr(s, or string) string {
	if s == "" {
		return or
	}
	return s
}

// writeUtilization prints, for each row, the link rate at which compute is
// busy each --utilization target (Streaming DiLoCo's table: rows the
// methods, columns the targets).
func writeUtilization(w io.Writer, t *costmodel.UtilizationTable, cfg *planConfig) error {
	j := cfg.job
	fmt.Fprintf(w, "# lowbit plan --utilization: %s parameters, %d ranks (%s links), %s of compute per step, link rate (Gbit/s) at which compute is busy each share of the step\n",
		size.FormatCount(j.Params), j.Ranks, j.Sharing, j.StepCompute)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	head := "collective\t"
	for _, u := range t.Targets {
		head += strconv.FormatFloat(100*u, 'g', -1, 64) + "%\t"
	}
	fmt.Fprintln(tw, head+"at "+costmodel.FormatRate(j.Link)+"\tat most\t")
	for _, r := range t.Rows {
		name := r.Collective
		if !r.Calibrated {
			name += "*"
		}
		line := name + "\t"
		for _, c := range r.Cells {
			if c.Unreachable {
				line += "never\t"
				continue
			}
			line += formatGbit(c.Rate) + "\t"
		}
		fmt.Fprintf(tw, "%s%.1f%%\t%.1f%%\t\n", line, 100*r.AtLink, 100*r.Max)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "utilization: (step - comm) / step, compute being --step-compute and Muon's orthogonalization, comm what compute does not hide (the outer rows' delayed exchanges hide up to --outer-delay steps); each rate solved by bisection with alpha %s per round and beta %.3f x line rate (--link's); never: latency-bound rounds and compression alone keep it below (at most: its utilization on an unlimited link); at %s: at --link.\n\n",
		formatSeconds(t.Alpha), t.Ineff, costmodel.FormatRate(j.Link))
	return err
}

// formatGbit writes a rate of bytes per second in Gbit/s, three
// significant digits.
func formatGbit(bytesPerSecond float64) string {
	g := 8 * bytesPerSecond / 1e9
	if g >= 1000 {
		return strconv.FormatFloat(g, 'f', 0, 64)
	}
	return strconv.FormatFloat(g, 'g', 3, 64)
}
