package main

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

// curveColors are the line colours of the runs, in order.
var curveColors = []color.Color{
	color.RGBA{R: 0x1f, G: 0x77, B: 0xb4, A: 0xff}, // blue
	color.RGBA{R: 0xd6, G: 0x27, B: 0x28, A: 0xff}, // red
	color.RGBA{R: 0x2c, G: 0xa0, B: 0x2c, A: 0xff}, // green
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
		l.Color, l.Width = col, vg.Points(1.5)
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
		al.Color, al.Width = col, vg.Points(1.5)
		sc.Color, sc.Shape = col, draw.CircleGlyph{}
		accPlot.Add(al, sc)
		accPlot.Legend.Add(r.optimizer, al, sc)
		if _, ok := baseline[r.optimizer]; ok {
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

	const w, h = 12 * vg.Inch, 4.5 * vg.Inch
	img := vgimg.New(w, h)
	dc := draw.New(img)
	tiles := draw.Tiles{Rows: 1, Cols: 2, PadX: vg.Millimeter * 4, PadTop: vg.Millimeter * 2, PadBottom: vg.Millimeter * 2, PadLeft: vg.Millimeter * 2, PadRight: vg.Millimeter * 4}
	plots := [][]*plot.Plot{{lossPlot, accPlot}}
	canvases := plot.Align(plots, tiles, dc)
	lossPlot.Draw(canvases[0][0])
	accPlot.Draw(canvases[0][1])

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
