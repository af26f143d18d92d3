package main

import (
	"fmt"
	"html"
	"math"
	"path/filepath"
	"strings"

	"github.com/lowbit-ml/lowbit/internal/optnames"
)

// curveColors are the line colours of the runs, in order.
var curveColors = []string{"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"}

// curveDashes are the dash patterns of the runs past the colours: the
// eleventh run is blue again, dashed.
var curveDashes = []string{"", "8,4", "2,3"}

// curveStyle is the stroke of run i's curve.
func curveStyle(i int) string {
	st := fmt.Sprintf(`stroke="%s" stroke-width="2"`, curveColors[i%len(curveColors)])
	if d := curveDashes[(i/len(curveColors))%len(curveDashes)]; d != "" {
		st += fmt.Sprintf(` stroke-dasharray="%s"`, d)
	}
	return st
}

// writePlot draws the validation loss against the tokens trained on, one
// curve per run, as an SVG file (no dependency: the plot is a few lines
// and a grid). A dashed line marks the freeze step of the 1-bit
// optimizers, a dotted one the target.
func writePlot(path string, o *options, results []*result) error {
	const (
		width, height = 900, 520
		left, right   = 70, 220 // the legend is on the right
		top, bottom   = 40, 50
	)
	pw, ph := float64(width-left-right), float64(height-top-bottom)
	xMax := 1.0
	yMin, yMax := math.Inf(1), math.Inf(-1)
	for _, r := range results {
		for _, e := range r.evals {
			if e.Step == 0 || math.IsNaN(e.ValLoss) || math.IsInf(e.ValLoss, 0) {
				continue // the untrained model's loss squashes the axis
			}
			xMax = max(xMax, float64(e.Tokens))
			yMin, yMax = min(yMin, e.ValLoss), max(yMax, e.ValLoss)
		}
	}
	if math.IsInf(yMin, 0) {
		yMin, yMax = 0, 1
	}
	if yMax-yMin < 1e-3 {
		yMin, yMax = yMin-0.5, yMax+0.5
	}
	pad := (yMax - yMin) * 0.05
	yMin, yMax = yMin-pad, yMax+pad
	px := func(x float64) float64 { return float64(left) + pw*x/xMax }
	py := func(y float64) float64 { return float64(top) + ph*(yMax-y)/(yMax-yMin) }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="14">validation loss of a byte-level GPT (%s), %d ranks</text>`+"\n", left, html.EscapeString(o.model.String()), results[0].workers)
	// Grid and ticks.
	for i := 0; i <= 5; i++ {
		y := yMin + (yMax-yMin)*float64(i)/5
		fmt.Fprintf(&b, `<line x1="%d" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, float64(left)+pw, py(y), py(y))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%.3f</text>`+"\n", left-6, py(y)+4, y)
		x := xMax * float64(i) / 5
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%.1f" stroke="#ddd"/>`+"\n", px(x), px(x), top, float64(top)+ph)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", px(x), float64(top)+ph+18, tokens(x))
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%.1f" fill="none" stroke="black"/>`+"\n", left, top, pw, ph)
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">tokens (bytes) trained on, all ranks</text>`+"\n", float64(left)+pw/2, height-12)
	fmt.Fprintf(&b, `<text transform="translate(16 %.1f) rotate(-90)" text-anchor="middle">validation loss (nats per byte)</text>`+"\n", float64(top)+ph/2)

	legend := 0
	legendLine := func(style, label string) {
		y := top + 10 + 20*legend
		fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%d" y2="%d" %s/>`+"\n", width-right+15, width-right+45, y, y, style)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", width-right+52, y+4, html.EscapeString(label))
		legend++
	}
	compressed := false
	for i, r := range results {
		var pts []string
		for _, e := range r.evals {
			if e.Step == 0 || math.IsNaN(e.ValLoss) || math.IsInf(e.ValLoss, 0) {
				continue
			}
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(float64(e.Tokens)), py(e.ValLoss)))
		}
		style := curveStyle(i)
		if len(pts) > 0 {
			fmt.Fprintf(&b, `<polyline fill="none" %s points="%s"/>`+"\n", style, strings.Join(pts, " "))
		}
		legendLine(style, r.spec.label())
		if _, ok := optnames.Baseline[r.spec.name]; ok && r.spec.name != "zero-adam" {
			compressed = true
		}
	}
	if fs := o.hyper().freezeStep; compressed && fs <= o.steps {
		x := px(float64(int64(fs) * int64(o.batch) * int64(o.model.context)))
		style := `stroke="#808080" stroke-dasharray="6,4"`
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%.1f" %s/>`+"\n", x, x, top, float64(top)+ph, style)
		legendLine(style, fmt.Sprintf("freeze step %d", fs))
	}
	if o.target > yMin && o.target < yMax {
		style := `stroke="#404040" stroke-dasharray="2,3"`
		fmt.Fprintf(&b, `<line x1="%d" x2="%.1f" y1="%.1f" y2="%.1f" %s/>`+"\n", left, float64(left)+pw, py(o.target), py(o.target), style)
		legendLine(style, fmt.Sprintf("target %.3g", o.target))
	}
	b.WriteString("</svg>\n")
	return writeFile(path, []byte(b.String()))
}

// tokens formats a token count for an axis.
func tokens(x float64) string {
	switch {
	case x >= 1e6:
		return fmt.Sprintf("%.1fM", x/1e6)
	case x >= 1e3:
		return fmt.Sprintf("%.0fk", x/1e3)
	}
	return fmt.Sprintf("%.0f", x)
}

// bytesPlotPath is the file of the plot against bytes that -plot path
// also writes: path with "-bytes" before its extension (out/gpt.svg,
// out/gpt-bytes.svg).
func bytesPlotPath(path string) string {
	ext := filepath.Ext(path)
	return strings.TrimSuffix(path, ext) + "-bytes" + ext
}

// writeBytesPlot draws the validation loss against the bytes each rank
// sent so far (evalPoint.BytesSent), one curve per run, as an SVG file.
// The x axis is logarithmic, in whole decades: the optimizers send up to
// a thousand times less than Adam. A log axis has no place for 0: the
// evaluations at which a run had sent nothing yet are left out of its
// curve, and a run that sent nothing at all (1 rank) is named in the
// legend as such, without a curve.
func writeBytesPlot(path string, o *options, results []*result) error {
	const (
		width, height = 900, 520
		left, right   = 70, 260 // the legend is on the right
		top, bottom   = 40, 50
	)
	pw, ph := float64(width-left-right), float64(height-top-bottom)
	drawn := func(e evalPoint) bool {
		return e.Step > 0 && e.BytesSent > 0 && !math.IsNaN(e.ValLoss) && !math.IsInf(e.ValLoss, 0)
	}
	xMin, xMax := math.Inf(1), math.Inf(-1)
	yMin, yMax := math.Inf(1), math.Inf(-1)
	for _, r := range results {
		for _, e := range r.evals {
			if !drawn(e) {
				continue
			}
			xMin, xMax = min(xMin, e.BytesSent), max(xMax, e.BytesSent)
			yMin, yMax = min(yMin, e.ValLoss), max(yMax, e.ValLoss)
		}
	}
	if math.IsInf(xMin, 0) { // nothing sent: an empty plot, its legend says why
		xMin, xMax, yMin, yMax = 1, 1e3, 0, 1
	}
	// Whole decades, at least one.
	d0, d1 := math.Floor(math.Log10(xMin)), math.Ceil(math.Log10(xMax))
	if d1 <= d0 {
		d1 = d0 + 1
	}
	if yMax-yMin < 1e-3 {
		yMin, yMax = yMin-0.5, yMax+0.5
	}
	pad := (yMax - yMin) * 0.05
	yMin, yMax = yMin-pad, yMax+pad
	px := func(x float64) float64 { return float64(left) + pw*(math.Log10(x)-d0)/(d1-d0) }
	py := func(y float64) float64 { return float64(top) + ph*(yMax-y)/(yMax-yMin) }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="14">loss against bytes sent per rank, byte-level GPT (%s), %d ranks</text>`+"\n",
		left, html.EscapeString(o.model.String()), results[0].workers)
	for i := 0; i <= 5; i++ {
		y := yMin + (yMax-yMin)*float64(i)/5
		fmt.Fprintf(&b, `<line x1="%d" x2="%.1f" y1="%.1f" y2="%.1f" stroke="#ddd"/>`+"\n", left, float64(left)+pw, py(y), py(y))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%.3f</text>`+"\n", left-6, py(y)+4, y)
	}
	for d := d0; d <= d1; d++ {
		x := math.Pow(10, d)
		fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%d" y2="%.1f" stroke="#ddd"/>`+"\n", px(x), px(x), top, float64(top)+ph)
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>`+"\n", px(x), float64(top)+ph+18, decadeBytes(d))
		for k := 2.0; k < 10 && d < d1; k++ { // the minor ticks of a log axis
			fmt.Fprintf(&b, `<line x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f" stroke="black"/>`+"\n", px(k*x), px(k*x), float64(top)+ph-4, float64(top)+ph)
		}
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%.1f" height="%.1f" fill="none" stroke="black"/>`+"\n", left, top, pw, ph)
	fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">bytes sent per rank in the optimizer's steps so far (mean over the ranks; log scale)</text>`+"\n", float64(left)+pw/2, height-12)
	fmt.Fprintf(&b, `<text transform="translate(16 %.1f) rotate(-90)" text-anchor="middle">validation loss (nats per byte)</text>`+"\n", float64(top)+ph/2)

	for i, r := range results {
		var pts []string
		for _, e := range r.evals {
			if drawn(e) {
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", px(e.BytesSent), py(e.ValLoss)))
			}
		}
		style := curveStyle(i)
		label := r.spec.label()
		switch {
		case len(pts) == 0:
			label += " (sent nothing)"
		case len(pts) == 1:
			// One point makes no line: a dot.
			fmt.Fprintf(&b, `<circle cx="%s" r="3" fill="%s"/>`+"\n", strings.Replace(pts[0], ",", `" cy="`, 1), curveColors[i%len(curveColors)])
		default:
			fmt.Fprintf(&b, `<polyline fill="none" %s points="%s"/>`+"\n", style, strings.Join(pts, " "))
		}
		y := top + 10 + 20*i
		if len(pts) > 0 {
			fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%d" y2="%d" %s/>`+"\n", width-right+15, width-right+45, y, y, style)
		}
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", width-right+52, y+4, html.EscapeString(label))
	}
	if o.target > yMin && o.target < yMax {
		style := `stroke="#404040" stroke-dasharray="2,3"`
		fmt.Fprintf(&b, `<line x1="%d" x2="%.1f" y1="%.1f" y2="%.1f" %s/>`+"\n", left, float64(left)+pw, py(o.target), py(o.target), style)
		y := top + 10 + 20*len(results)
		fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%d" y2="%d" %s/>`+"\n", width-right+15, width-right+45, y, y, style)
		fmt.Fprintf(&b, `<text x="%d" y="%d">target %.3g</text>`+"\n", width-right+52, y+4, o.target)
	}
	b.WriteString("</svg>\n")
	return writeFile(path, []byte(b.String()))
}

// decadeBytes formats 10^d bytes for an axis: 1 B, 10 kB, 100 MB, 1 GB.
func decadeBytes(d float64) string {
	units := []string{"B", "kB", "MB", "GB", "TB", "PB"}
	i := int(max(0, min(d, 15))) / 3
	return fmt.Sprintf("%g %s", math.Pow(10, d-float64(3*i)), units[i])
}
