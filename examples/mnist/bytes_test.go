package main

import (
	"bytes"
	"context"
	"image"
	"image/color"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/optim"
)

// TestBytesAtEvaluations: every evaluation carries the bytes a rank sent
// so far, 0 before the first step and growing from one evaluation to the
// next up to the run's bytes sent; a run on 1 rank sends nothing.
func TestBytesAtEvaluations(t *testing.T) {
	train, test := loadTestdata(t)
	for _, w := range []int{2, 1} {
		r := trainLocal(t, w, train, test, smallConfig("onebit-adam"))[0]
		require.Len(t, r.evals, 8) // before the first step, every 7 steps, the last
		assert.Zero(t, r.evals[0].bytes, "before the first step")
		for i, e := range r.evals[1:] {
			if w == 1 {
				assert.Zero(t, e.bytes, "1 rank, step %d", e.step)
				continue
			}
			assert.Greater(t, e.bytes, r.evals[i].bytes, "step %d", e.step)
		}
		assert.InEpsilon(t, max(r.bytesSent, 1), max(r.evals[len(r.evals)-1].bytes, 1), 1e-6, "%d ranks", w)
	}
}

// TestBytesAcrossResume: a resumed run's evaluations count the bytes sent
// before the interruption too (the optimizer's own count starts at the
// resume), and end where the uninterrupted run's do (within the 4 bytes
// per step of the stop request that the interrupted run's steps carried).
func TestBytesAcrossResume(t *testing.T) {
	train, test := loadTestdata(t)
	cfg := smallConfig("adam")
	whole := trainLocal(t, 2, train, test, cfg)[0]
	cfg.checkpoint = checkpointConfig{dir: t.TempDir(), every: 5}
	res, errs := trainRanks(t, 2, train, test, cfg, stopOn(0, 30))
	require.NoError(t, errs[0])
	require.Equal(t, 30, res[0].preempted)
	cfg.checkpoint.resume = true
	r := trainLocal(t, 2, train, test, cfg)[0]
	require.Equal(t, 30, r.resumedFrom)
	require.Len(t, r.evals, len(whole.evals))
	for i, e := range r.evals {
		assert.InEpsilon(t, max(whole.evals[i].bytes, 1), max(e.bytes, 1), 1e-5, "step %d", e.step)
	}
}

// TestResultBytes: a result file keeps the bytes of every evaluation; one
// made before it kept them reads them as unknown (-1).
func TestResultBytes(t *testing.T) {
	dir := t.TempDir()
	cfg := trainConfig{optimizer: "onebit-adam", epochs: 2, batch: 50, seed: 7, evalsPerEpoch: 1}
	want := sampleResult()
	want.evals[0].bytes, want.evals[1].bytes, want.test.bytes = 0.75e6, 1.5e6, 1.5e6
	require.NoError(t, saveResult(dir, cfg, want))
	got, err := loadResult(dir, cfg, 3)
	require.NoError(t, err)
	assert.Equal(t, want.evals, got.evals)

	ck := readResultFile(t, dir, cfg.optimizer)
	for k := range ck.Floats {
		if strings.HasSuffix(k, "/bytes") {
			delete(ck.Floats, k)
		}
	}
	writeResultFile(t, dir, cfg.optimizer, ck)
	got, err = loadResult(dir, cfg, 3)
	require.NoError(t, err)
	for _, e := range got.evals {
		assert.Equal(t, -1.0, e.bytes)
	}
}

// TestWriteBytesPlot: -plot also draws test loss and accuracy against the
// bytes sent, a line in each panel for every run that sent something (its
// colour is in the picture), and a run that sent nothing only named in the
// legends (its colour is not: no line, no point).
func TestWriteBytesPlot(t *testing.T) {
	run := func(name string, bytes ...float64) *result {
		r := &result{optimizer: name, testSize: 100}
		for i, b := range bytes {
			r.evals = append(r.evals, evalPoint{step: 10 * i, acc: 0.5 + 0.1*float64(i), loss: 1 / float64(i+1), bytes: b})
		}
		return r
	}
	path := filepath.Join(t.TempDir(), "sub", "m-bytes.png")
	require.NoError(t, writeBytesPlot(path, []*result{
		run("adam", 0, 1e6, 2e6, 3e6),
		run("onebit-adam", 0, 1e5, 1.2e5, 1.4e5),
		run("diloco", 0, 0, 0, 0),
		run("lamb", -1, -1),
	}))
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	img, err := png.Decode(f)
	require.NoError(t, err)
	assert.Greater(t, img.Bounds().Dx(), 500)
	assert.True(t, hasColor(img, curveColors[0]), "adam's line")
	assert.True(t, hasColor(img, curveColors[1]), "onebit-adam's line")
	assert.False(t, hasColor(img, curveColors[2]), "diloco sent nothing: no line")
	assert.False(t, hasColor(img, curveColors[3]), "lamb's bytes are unknown: no line")

	// Nothing sent by any run: empty panels, no error.
	require.NoError(t, writeBytesPlot(path, []*result{run("adam", 0, 0)}))
	assert.Equal(t, filepath.Join("out", "mnist-bytes.png"), bytesPlotPath(filepath.Join("out", "mnist.png")))
}

// TestRunPlotBytes: -plot with a list of optimizers writes both PNG files.
func TestRunPlotBytes(t *testing.T) {
	dir := t.TempDir()
	var out, errOut bytes.Buffer
	require.NoError(t, run(context.Background(), []string{
		"-data", "testdata", "-optimizer", "adam,zeroone-adam", "-workers", "2", "-quiet",
		"-epochs", "1", "-batch", "50", "-freeze-step", "4", "-plot", filepath.Join(dir, "m.png"),
	}, &out, &errOut), errOut.String())
	assert.Contains(t, out.String(), "zeroone-adam vs adam")
	for _, name := range []string{"m.png", "m-bytes.png"} {
		f, err := os.Open(filepath.Join(dir, name))
		require.NoError(t, err)
		_, err = png.Decode(f)
		f.Close()
		assert.NoError(t, err, name)
	}
}

// hasColor says whether some pixel of img is c.
func hasColor(img image.Image, c color.Color) bool {
	r0, g0, b0, _ := c.RGBA()
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			r, g, b, _ := img.At(x, y).RGBA()
			if r == r0 && g == g0 && b == b0 {
				return true
			}
		}
	}
	return false
}

func TestDecadeBytes(t *testing.T) {
	for d, want := range map[float64]string{-1: "0.1 B", 0: "1 B", 2: "100 B", 3: "1 kB", 7: "10 MB", 9: "1 GB", 12: "1 TB", 16: "10 PB"} {
		assert.Equal(t, want, decadeBytes(d), "10^%v", d)
	}
}

func readResultFile(t *testing.T, dir, name string) *optim.Checkpoint {
	t.Helper()
	ck, err := optim.LoadFile(resultPath(dir, name))
	require.NoError(t, err)
	return ck
}

func writeResultFile(t *testing.T, dir, name string, ck *optim.Checkpoint) {
	t.Helper()
	require.NoError(t, optim.SaveFile(resultPath(dir, name), ck))
}
