// Package flagtest checks that a command's flags refuse bad values the way
// package cliflag makes them: one line naming the flag and the value, exit
// status 2, no panic. Commands of lowbit and its examples call it from
// their tests.
package flagtest

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/internal/cliflag"
)

// Values are the values BadValues gives every flag: empty, negative, huge,
// beyond int64, misspelled.
var Values = []string{"", "-1", "1e300", "99999999999999999999", "12x"}

// BadValues gives every flag of a command (read from the help text parse
// prints for -h, so that a new flag is covered without editing the test)
// each of Values. Each is refused with a one-line usage error
// (cliflag.IsUsage), or accepted where it is a valid value; "" and "12x"
// are never valid. The flags named in free take free text (files,
// directories) and are left out. parse is the command's flag parsing,
// writing its help to stderr; minFlags guards against a help text that
// lists none.
func BadValues(t *testing.T, parse func(args []string, stderr io.Writer) error, minFlags int, free ...string) {
	t.Helper()
	var help bytes.Buffer
	require.ErrorIs(t, parse([]string{"-h"}, &help), flag.ErrHelp)
	var names []string
	for _, line := range strings.Split(help.String(), "\n") {
		if f, ok := strings.CutPrefix(strings.TrimSpace(line), "-"); ok {
			names = append(names, strings.Fields(f)[0])
		}
	}
	require.GreaterOrEqual(t, len(names), minFlags, "flags read from -h")
	refused := 0
	for _, name := range names {
		if slices.Contains(free, name) {
			continue
		}
		for _, v := range Values {
			args := []string{"-" + name + "=" + v}
			err := parse(args, io.Discard)
			if err == nil {
				assert.NotContains(t, []string{"", "12x"}, v, "%v accepted", args)
				continue
			}
			refused++
			assert.True(t, cliflag.IsUsage(err), "%v: %v is not a usage error", args, err)
			assert.NotContains(t, err.Error(), "\n", "%v: one line", args)
		}
	}
	assert.Greater(t, refused, 3*(len(names)-len(free)), "most values are refused")
}

// Exit builds the command in the current directory and runs it with each
// of argss: every run prints nothing on stdout, one line on stderr that
// ends with "see NAME -h", and exits 2.
func Exit(t *testing.T, name string, argss ...[]string) {
	t.Helper()
	if testing.Short() {
		t.Skip("builds the command")
	}
	bin := filepath.Join(t.TempDir(), name)
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Stderr = os.Stderr
	require.NoError(t, build.Run())
	for _, args := range argss {
		var stdout, stderr bytes.Buffer
		cmd := exec.Command(bin, args...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		var ee *exec.ExitError
		require.True(t, errors.As(cmd.Run(), &ee), "%v: want exit status 2", args)
		assert.Equal(t, 2, ee.ExitCode(), "%v", args)
		assert.Empty(t, stdout.String(), "%v", args)
		assert.Equal(t, 1, strings.Count(stderr.String(), "\n"), "%v: %q", args, stderr.String())
		assert.Contains(t, stderr.String(), "see "+name+" -h", "%v", args)
	}
}
