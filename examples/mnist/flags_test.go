package main

import (
	"bytes"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/internal/cliflag"
)

// TestBadFlagValues gives every flag of the example (read from its own
// FlagSet, so a new flag is covered without editing this test) an empty, a
// negative, a huge and a misspelled value. Each is refused before anything
// runs with a usage error (one line, exit 2 from main), or accepted, for
// the flags whose values are free text (file and directory names) or for
// which the value is valid; nothing panics.
func TestBadFlagValues(t *testing.T) {
	var names []string
	// parseFlags defines its flags on a FlagSet of its own; -h lists them.
	var help bytes.Buffer
	_, err := parseFlags([]string{"-h"}, &help)
	require.ErrorIs(t, err, flag.ErrHelp)
	for _, line := range strings.Split(help.String(), "\n") {
		if f, ok := strings.CutPrefix(strings.TrimSpace(line), "-"); ok {
			names = append(names, strings.Fields(f)[0])
		}
	}
	require.Greater(t, len(names), 15, "flags read from -h")
	refused := 0
	// Values a flag rightly accepts: names of files and directories (checked
	// when the run opens them), booleans, and numbers in range.
	free := map[string]bool{"plot": true, "data": true, "cpuprofile": true, "checkpoint": true}
	for _, name := range names {
		for _, v := range []string{"", "-1", "1e300", "99999999999999999999", "12x"} {
			if free[name] {
				continue
			}
			args := []string{"-" + name + "=" + v}
			_, err := parseFlags(args, &bytes.Buffer{})
			if err == nil {
				// Accepted: a boolean given "" is not, so only numbers in range.
				assert.NotContains(t, []string{"", "12x"}, v, "%v accepted", args)
				continue
			}
			refused++
			assert.True(t, cliflag.IsUsage(err), "%v: %v is not a usage error", args, err)
			assert.NotContains(t, err.Error(), "\n", "%v: one line", args)
		}
	}
	assert.Greater(t, refused, 3*len(names), "most values are refused")
}

// TestBadFlagExit: the binary prints one line for a bad value and exits 2.
func TestBadFlagExit(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the example")
	}
	bin := filepath.Join(t.TempDir(), "mnist")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run())
	for _, args := range [][]string{{"-batch", "64Q"}, {"-workers", "0"}, {"-backend", "tcp"}, {"-nosuch"}, {"stray"}} {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(bin, args...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "%v", args)
		assert.Equal(t, 2, ee.ExitCode(), "%v", args)
		assert.Empty(t, stdout.String(), "%v", args)
		assert.Equal(t, 1, strings.Count(stderr.String(), "\n"), "%v: %q", args, stderr.String())
		assert.Contains(t, stderr.String(), "see mnist -h", "%v", args)
	}
}
