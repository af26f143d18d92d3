package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// An optimizer step file given by itself is replayed, its line giving the
// largest deviation; a step file of another optimizer is skipped, and one
// whose recording is off beyond the tolerance fails, with the deviation.
func TestConformanceOptimizerFile(t *testing.T) {
	muon := filepath.Join("..", "..", "internal", "conformance", "testdata", "muon_w3.json")
	var out bytes.Buffer
	require.NoError(t, conformanceMain([]string{muon}, &out, io.Discard))
	assert.Regexp(t, `^PASS  optimizer  muon_w3 +muon-aux-adam, 3 ranks, 5 tensors, 10 steps, largest deviation [0-9.e-]+ \(tolerance 1e-05\)\n1 passed, 0 failed, 0 skipped\n$`, out.String())

	out.Reset()
	ds := filepath.Join("..", "..", "onebit", "testdata", "deepspeed", "onebit_adam_w3.json")
	require.NoError(t, conformanceMain([]string{ds}, &out, io.Discard))
	assert.Contains(t, out.String(), `SKIP  optimizer  onebit_adam_w3           optimizer "deepspeed-adam" is not replayed by this command`)

	b, err := os.ReadFile(muon)
	require.NoError(t, err)
	var run map[string]any
	require.NoError(t, json.Unmarshal(b, &run))
	p := run["steps"].([]any)[9].(map[string]any)["params"].([]any)[4].([]any)
	p[2] = p[2].(float64) - 1e-3
	b, err = json.Marshal(run)
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "off.json"), b, 0o644))
	out.Reset()
	err = conformanceMain([]string{dir}, &out, io.Discard)
	require.Error(t, err)
	assert.Contains(t, out.String(), "FAIL  optimizer  muon_w3                  largest deviation 0.001; first beyond the tolerance: step 10: p4[2] = ")
	assert.Contains(t, out.String(), "0 passed, 1 failed, 0 skipped")
}
