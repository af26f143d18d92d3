package main

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"

	"github.com/lowbit-ml/lowbit/internal/optnames"
)

// curveColors are the line colours of the runs, in order.
var curveColors = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, // blue
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, // red
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}, // green
	color.RGBA{R: 0xff, G: 0x7f, B: 0x0e, A: 0xff}, // orange
	color.RGBA{R: 0x94, G: 0x67, B: 0xbd, A: 0xff}, // purple
	color.RGBA{R: 0x8c, G: 0x56, B: 0x4b, A: 0xff}, // brown
	color.RGBA{R: 0xe3, G: 0x77, B: 0xc2, A: 0xff}, // pink
	color.RGBA{R: 0x7f, G: 0x7f, B: 0x7f, A: 0xff}, // grey
	color.RGBA{R: 0xbc, G: 0xbd, B: 0x22, A: 0xff}, // olive
	color.RGBA{R: 0x17, G: 0xbe, B: 0xcf, A: 0xff}, // cyan
}

// curveDashes are the dash patterns of the runs past the colours: the
// eleventh run is blue again, dashed.
var curveDashes = [][]vg.Length{nil, {vg.Points(6), vg.Points(3)}, {vg.Points(2), vg.Points(2)}}

// curveStyle sets the colour and dashes of run i's line.
func curveStyle(l *plotter.Line, i int) {
	l.Color, l.Width = curveColors[i%len(curveColors)], vg.Points(1.5)
	l.Dashes = curveDashes[(i/len(curveColors))%len(curveDashes)]
}

// writePlot draws two panels side by side into a PNG file: the training
// loss (a moving average over the steps) and the test accuracy, both
// against the optimizer step, one line per run. A dashed line marks the
// freeze step of the compressed optimizers.
func writePlot(path string, results []*result, o *options) error {
	lossPlot := plot.New()
	lossPlot.Title.Text = "training loss (moving average)"
	lossPlot.X.Label.Text = "step"
	lossPlot.Y.Label.Text = "cross-entropy"
	lossPlot.Y.Scale = plot.LogScale{}
	lossPlot.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	lossPlot.Add(plotter.NewGrid())

	accPlot := plot.New()
	if len(results) > 0 {
		accPlot.Title.Text = fmt.Sprintf("test accuracy (%d images)", results[0].testSize)
	}
	accPlot.X.Label.Text = "step"
	accPlot.Y.Label.Text = "accuracy (%)"
	accPlot.Add(plotter.NewGrid())
	accPlot.Legend.Left = false
	accPlot.Legend.Top = false
	lossPlot.Legend.Top = true

	minAcc, maxLoss, minLoss := 100.0, 0.0, math.Inf(1)
	compressed := false
	for i, r := range results {
		col := curveColors[i%len(curveColors)]
		window := max(1, len(r.loss)/60)
		pts := make(plotter.XYs, 0, len(r.loss)/window+1)
		for s := 0; s+window <= len(r.loss); s += window {
			var sum float64
			for _, v := range r.loss[s : s+window] {
				sum += v
			}
			y := sum / float64(window)
			if math.IsNaN(y) || math.IsInf(y, 0) || y <= 0 {
				continue // a diverged run: its curve ends here
			}
			pts = append(pts, plotter.XY{X: float64(s + window), Y: y})
			maxLoss, minLoss = max(maxLoss, y), min(minLoss, y)
		}
		l, err := plotter.NewLine(pts)
		if err != nil {
			return err
		}
		curveStyle(l, i)
		lossPlot.Add(l)
		lossPlot.Legend.Add(r.optimizer, l)

		var acc plotter.XYs
		for _, e := range r.evals {
			if e.step == 0 {
				continue // the untrained model's 10% squashes the axis
			}
			acc = append(acc, plotter.XY{X: float64(e.step), Y: 100 * e.acc})
			minAcc = min(minAcc, 100*e.acc)
		}
		if len(acc) == 0 {
			continue
		}
		al, sc, err := plotter.NewLinePoints(acc)
		if err != nil {
			return err
		}
		curveStyle(al, i)
		sc.Color, sc.Shape = col, draw.CircleGlyph{}
		accPlot.Add(al, sc)
		accPlot.Legend.Add(r.optimizer, al, sc)
		if _, ok := optnames.Baseline[r.optimizer]; ok {
			compressed = true
		}
	}
	accPlot.Y.Min, accPlot.Y.Max = math.Floor(minAcc)-0.5, 100
	if maxLoss > 0 {
		lossPlot.Y.Min, lossPlot.Y.Max = minLoss*0.8, maxLoss*1.25
	}
	if compressed && o.freezeStep > 0 {
		for _, p := range []*plot.Plot{lossPlot, accPlot} {
			y0, y1 := p.Y.Min, p.Y.Max
			if y0 <= 0 {
				continue
			}
			l, err := plotter.NewLine(plotter.XYs{{X: float64(o.freezeStep), Y: y0}, {X: float64(o.freezeStep), Y: y1}})
			if err != nil {
				return err
			}
			l.Color, l.Dashes = color.Gray{Y: 0x80}, []vg.Length{vg.Points(4), vg.Points(3)}
			p.Add(l)
			p.Legend.Add(fmt.Sprintf("freeze step %d", o.freezeStep), l)
		}
	}

	for _, p := range []*plot.Plot{lossPlot, accPlot} {
		p.X.Tick.Marker = relabel{plot.DefaultTicks{}, "%.0f"}
	}
	accPlot.Y.Tick.Marker = relabel{plot.DefaultTicks{}, "%.1f"}

	return writePanels(path, lossPlot, accPlot)
}

// writePanels draws two plots side by side into a PNG file.
func writePanels(path string, left, right *plot.Plot) error {
	const w, h = 12 * vg.Inch, 4.5 * vg.Inch
	img := vgimg.New(w, h)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Millimeter * 4, PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 4}
	plots := [][]*plot.Plot{{left, right}}
	canvases := plot.Align(plots, tiles, dc)
	left.Draw(canvases[0][0])
	right.Draw(canvases[0][1])

	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := (vgimg.PngCanvas{Canvas: img}).WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// relabel is a plot.Ticker that formats the labels of another one.
type relabel struct {
	plot.Ticker
	format string
}

// Ticks returns the ticks of the wrapped ticker with labels printed by the
// format.
func (r relabel) Ticks(min, max float64) []plot.Tick {
	ts := r.Ticker.Ticks(min, max)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = fmt.Sprintf(r.format, ts[i].Value)
		}
	}
	return ts
}

// bytesPlotPath is the file of the plot against bytes that -plot path
// also writes: path with "-bytes" before its extension (out/mnist.png,
// out/mnist-bytes.png).
func bytesPlotPath(path string) string {
	ext := filepath.Ext(path)
	return strings.TrimSuffix(path, ext) + "-bytes" + ext
}

// writeBytesPlot draws two panels side by side into a PNG file: the test
// loss and the test accuracy against the bytes each rank sent so far
// (evalPoint.bytes), one line per run. The x axis is logarithmic, in
// whole decades: the optimizers send up to a thousand times less than
// Adam. A log axis has no place for 0: the evaluations at which a run had
// sent nothing yet (the one before the first step) are left out of its
// line, and a run that sent nothing at all (1 rank) is named in the
// legend as such, without a line; so are the evaluations whose bytes are
// unknown (from a checkpoint or result made before they were kept).
func writeBytesPlot(path string, results []*result) error {
	lossPlot := plot.New()
	lossPlot.Title.Text = "test loss"
	lossPlot.Y.Label.Text = "cross-entropy"
	lossPlot.Y.Scale = plot.LogScale{}
	lossPlot.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	accPlot := plot.New()
	accPlot.Title.Text = "test accuracy"
	if len(results) > 0 {
		accPlot.Title.Text = fmt.Sprintf("test accuracy (%d images)", results[0].testSize)
	}
	accPlot.Y.Label.Text = "accuracy (%)"
	accPlot.Legend.Left, accPlot.Legend.Top = false, false
	lossPlot.Legend.Top = true
	for _, p := range []*plot.Plot{lossPlot, accPlot} {
		p.X.Label.Text = "bytes sent per rank so far (mean over the ranks; log scale)"
		p.X.Scale = plot.LogScale{}
		p.X.Tick.Marker = bytesTicks{}
		p.Add(plotter.NewGrid())
	}

	xMin, xMax := math.Inf(1), math.Inf(-1)
	minAcc, minLoss, maxLoss := 100.0, math.Inf(1), math.Inf(-1)
	for i, r := range results {
		var loss, acc plotter.XYs
		for _, e := range r.evals {
			if !(e.bytes > 0) {
				continue // nothing sent yet, or unknown
			}
			xMin, xMax = min(xMin, e.bytes), max(xMax, e.bytes)
			acc = append(acc, plotter.XY{X: e.bytes, Y: 100 * e.acc})
			minAcc = min(minAcc, 100*e.acc)
			if e.loss > 0 && !math.IsInf(e.loss, 0) {
				loss = append(loss, plotter.XY{X: e.bytes, Y: e.loss})
				minLoss, maxLoss = min(minLoss, e.loss), max(maxLoss, e.loss)
			}
		}
		if len(acc) == 0 {
			lossPlot.Legend.Add(r.optimizer + " (sent nothing)")
			accPlot.Legend.Add(r.optimizer + " (sent nothing)")
			continue
		}
		for _, c := range []struct {
			p   *plot.Plot
			pts plotter.XYs
		}{{lossPlot, loss}, {accPlot, acc}} {
			if len(c.pts) == 0 {
				continue
			}
			l, sc, err := plotter.NewLinePoints(c.pts)
			if err != nil {
				return err
			}
			curveStyle(l, i)
			sc.Color, sc.Shape = l.Color, draw.CircleGlyph{}
			c.p.Add(l, sc)
			c.p.Legend.Add(r.optimizer, l, sc)
		}
	}
	if math.IsInf(xMin, 0) { // nothing sent: empty panels, their legends say why
		xMin, xMax = 1, 1e3
	}
	d0, d1 := math.Floor(math.Log10(xMin)), math.Ceil(math.Log10(xMax))
	if d1 <= d0 {
		d1 = d0 + 1
	}
	for _, p := range []*plot.Plot{lossPlot, accPlot} {
		p.X.Min, p.X.Max = math.Pow(10, d0), math.Pow(10, d1)
	}
	if math.IsInf(minLoss, 0) {
		minLoss, maxLoss = 0.1, 1
	}
	lossPlot.Y.Min, lossPlot.Y.Max = minLoss*0.8, maxLoss*1.25
	accPlot.Y.Min, accPlot.Y.Max = math.Floor(minAcc)-0.5, 100
	accPlot.Y.Tick.Marker = relabel{plot.DefaultTicks{}, "%.1f"}
	return writePanels(path, lossPlot, accPlot)
}

// bytesTicks is a plot.Ticker for a log axis of bytes: a labelled tick at
// each power of ten (1 kB, 10 MB) and unlabelled ones between.
type bytesTicks struct{}

// Ticks returns the ticks between min and max, both above 0.
func (bytesTicks) Ticks(min, max float64) []plot.Tick {
	var ts []plot.Tick
	for d := math.Floor(math.Log10(min)); d <= math.Ceil(math.Log10(max)); d++ {
		x := math.Pow(10, d)
		ts = append(ts, plot.Tick{Value: x, Label: decadeBytes(d)})
		for k := 2.0; k < 10; k++ {
			ts = append(ts, plot.Tick{Value: k * x})
		}
	}
	return ts
}

// decadeBytes formats 10^d bytes for an axis: 1 B, 10 kB, 100 MB, 1 GB.
func decadeBytes(d float64) string {
	units := []string{"B", "kB", "MB", "GB", "TB", "PB"}
	i := int(max(0, min(d, 15))) / 3
	return fmt.Sprintf("%g %s", math.Pow(10, d-float64(3*i)), units[i])
}
