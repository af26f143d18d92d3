package main

import (
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/optim"
)

// sampleResult is a finished result with every field set, a diverged
// step's NaN and Inf losses included (training's losses are float32s).
func sampleResult() *result {
	return &result{
		optimizer: "onebit-adam", workers: 3, steps: 4, testSize: 100, stage: optim.StagePhaseB, skipped: 1,
		trainLoss: 0.25, test: evalPoint{step: 4, wall: 3 * time.Second, acc: 0.875, loss: 0.125},
		wall: 5 * time.Second, compute: 2 * time.Second, comm: time.Second, compress: 500 * time.Millisecond,
		bytesSent: 1.5e6, lastStepBytes: 4096, loss: []float64{2.5, float64(float32(0.1)), math.NaN(), math.Inf(1)},
		evals:    []evalPoint{{step: 2, wall: time.Second, acc: 0.5, loss: 1.5}, {step: 4, wall: 3 * time.Second, acc: 0.875, loss: 0.125}},
		initHash: 1 << 63, finalHash: 0xdeadbeefcafef00d, resumedFrom: 2, resumedWorld: 2, carried: carryRegroup.String(),
		utilization: 0.75,
	}
}

// A finished result comes back from its file as it was saved, every
// figure, a diverged step's NaN and Inf losses and diloco's utilization
// included.
func TestResultRoundTrip(t *testing.T) {
	dir := t.TempDir()
	cfg := trainConfig{optimizer: "onebit-adam", epochs: 2, batch: 50, seed: 7, evalsPerEpoch: 1}
	want := sampleResult()
	require.NoError(t, saveResult(dir, cfg, want))
	got, err := loadResult(dir, cfg, 3)
	require.NoError(t, err)
	require.Len(t, got.loss, len(want.loss))
	for i, w := range want.loss {
		if math.IsNaN(w) {
			assert.True(t, math.IsNaN(got.loss[i]), "loss %d", i)
			continue
		}
		assert.Equal(t, w, got.loss[i], "loss %d", i)
	}
	got.loss, want.loss = nil, nil
	assert.Equal(t, want, got)

	for _, carried := range []string{"", carryCopy.String(), carryConsolidate.String(), carryOuter.String()} {
		assert.Equal(t, carried, carriedOf(carriedCode(carried)))
	}
}

// A result file that cannot be used is an error, and no file is none.
func TestResultRefused(t *testing.T) {
	cfg := trainConfig{optimizer: "onebit-adam", epochs: 2, batch: 50}
	dir := t.TempDir()
	got, err := loadResult(dir, cfg, 3)
	require.NoError(t, err)
	assert.Nil(t, got, "no file, no result")

	require.NoError(t, saveResult(dir, cfg, sampleResult()))
	other := cfg
	other.batch = 100
	_, err = loadResult(dir, other, 3)
	assert.ErrorContains(t, err, "made by a run with other flags: -batch differs (this run has -batch 100)")
	other = cfg
	other.epochs = 3
	_, err = loadResult(dir, other, 3)
	assert.ErrorContains(t, err, "-epochs differs")
	_, err = loadResult(dir, cfg, 1)
	require.NoError(t, err, "a result made on another number of ranks is kept")

	// Damage anywhere is found (the file's checksum), not decoded into
	// other figures.
	path := resultPath(dir, cfg.optimizer)
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	for _, at := range []int{len(b) / 2, len(b) - 3} {
		bad := append([]byte(nil), b...)
		bad[at] ^= 0x10
		require.NoError(t, os.WriteFile(path, bad, 0o644))
		_, err = loadResult(dir, cfg, 3)
		assert.ErrorIs(t, err, optim.ErrCorruptCheckpoint, "byte %d of %d", at, len(b))
	}

	// Another optimizer's result under this one's name.
	res := sampleResult()
	res.optimizer = "adam"
	require.NoError(t, saveResult(dir, cfg, res))
	require.NoError(t, os.Rename(resultPath(dir, "adam"), path))
	_, err = loadResult(dir, cfg, 3)
	assert.ErrorContains(t, err, "not a result of onebit-adam")

	// A file of the old format (gob) is refused, not misread.
	require.NoError(t, os.WriteFile(path, []byte("\x0f\xff\x81\x03\x01\x01\x0bsavedResult"), 0o644))
	_, err = loadResult(dir, cfg, 3)
	assert.Error(t, err)
	require.NoError(t, removeResult(dir, cfg.optimizer))
	assert.NoFileExists(t, filepath.Join(dir, "onebit-adam.result"))
}
