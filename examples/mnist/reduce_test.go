package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// -reduce selects the gradient averaging of the exact optimizers.
func TestRunReduce(t *testing.T) {
	for _, mode := range []string{"fp16", "bf16", "twolevel"} {
		var out, errOut bytes.Buffer
		err := run(context.Background(), []string{
			"-data", "testdata", "-optimizer", "adam", "-workers", "2", "-reduce", mode,
			"-epochs", "1", "-batch", "50", "-lr", "2e-3", "-quiet",
		}, &out, &errOut)
		require.NoError(t, err, "%s: %s", mode, errOut.String())
		assert.Contains(t, out.String(), "adam", mode)
	}
	err := run(context.Background(), []string{"-reduce", "fp8"}, &bytes.Buffer{}, &bytes.Buffer{})
	assert.ErrorContains(t, err, `unknown -reduce "fp8"`)
}
