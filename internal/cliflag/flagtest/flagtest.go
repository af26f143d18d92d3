// Package flagtest checks that a command's flags refuse bad values the way
// package cliflag makes them: one line naming the flag and the value, exit
// status 2, no panic. Commands of lowbit and its examples call it from
// their tests.
package flagtest

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
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
	"github.com/lowbit-ml/lowbit/size"
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

// CountInputs are counts as the field writes model sizes, with the values
// they mean: every count flag is given each of them by Counts.
var CountInputs = []struct {
	In   string
	Want int64
}{{"7B", 7e9}, {"1.3B", 1.3e9}, {"70B", 70e9}, {"340M", 340e6}, {"137k", 137e3}}

// NotCounts are inputs every count flag refuses: sizes in bytes or bits,
// fractions, negative counts, spaces, misspellings, counts beyond int64.
var NotCounts = []string{"64MiB", "64MB", "1GB", "2KiB", "64Mb", "1.5", "1.0001k", "-7B", "7 B", "7Q", "1e30"}

// CountFlag is a count flag of a command (one whose help names its value
// `count`, a size.CountValue), for Counts.
type CountFlag struct {
	// Min and Max bound the flag's value (Max 0: no upper bound).
	Min, Max int64
	// Value parses args, a command line that sets the flag, as the
	// command does and returns the flag's value.
	Value func(args []string) (int64, error)
}

// helpFlags returns the flags that parse's help text for -h lists, each
// with the name of its value ("count" for -params count, "" for a flag
// without one).
func helpFlags(t *testing.T, parse func(args []string, stderr io.Writer) error) map[string]string {
	t.Helper()
	var help bytes.Buffer
	require.ErrorIs(t, parse([]string{"-h"}, &help), flag.ErrHelp)
	flags := map[string]string{}
	for _, line := range strings.Split(help.String(), "\n") {
		if !strings.HasPrefix(line, "  -") {
			continue
		}
		f := strings.Fields(strings.TrimPrefix(line, "  -"))
		flags[f[0]] = ""
		if len(f) > 1 {
			flags[f[0]] = f[1]
		}
	}
	require.NotEmpty(t, flags, "flags read from -h")
	return flags
}

// Counts checks the count flags of a command. The flags whose help names
// their value `count` (read from the help text parse prints for -h) are
// those of flags, so that a new count flag is not left untested. Each
// takes each of CountInputs as the value it means where that is in the
// flag's bounds, and refuses it as out of range otherwise; each refuses
// each of NotCounts with size.ParseCount's error. Every refusal is one
// line, a usage error (cliflag.IsUsage) naming the flag and the value.
func Counts(t *testing.T, parse func(args []string, stderr io.Writer) error, flags map[string]CountFlag) {
	t.Helper()
	var named []string
	for name, value := range helpFlags(t, parse) {
		if value == "count" {
			named = append(named, name)
		}
	}
	var tested []string
	for name := range flags {
		tested = append(tested, name)
	}
	require.ElementsMatch(t, named, tested, "the flags whose value is a `count`")
	for name, f := range flags {
		refused := func(v string, err error, reason string) {
			t.Helper()
			if !assert.Error(t, err, "-%s %s", name, v) {
				return
			}
			assert.True(t, cliflag.IsUsage(err), "-%s %s: %v is not a usage error", name, v, err)
			assert.NotContains(t, err.Error(), "\n", "-%s %s: one line", name, v)
			assert.True(t, strings.HasPrefix(err.Error(), fmt.Sprintf("invalid value %q for --%s: %s", v, name, reason)),
				"-%s %s: got %q, want the reason %q", name, v, err, reason)
		}
		for _, c := range CountInputs {
			got, err := f.Value([]string{"-" + name, c.In})
			if c.Want >= f.Min && (f.Max == 0 || c.Want <= f.Max) {
				if assert.NoError(t, err, "-%s %s", name, c.In) {
					assert.Equal(t, c.Want, got, "-%s %s", name, c.In)
				}
				continue
			}
			bounds := fmt.Sprintf("%s is below the least value %s", c.In, size.FormatCount(f.Min))
			if f.Max > 0 {
				bounds = fmt.Sprintf("%s is out of range [%s, %s]", c.In, size.FormatCount(f.Min), size.FormatCount(f.Max))
			}
			refused(c.In, err, bounds)
		}
		for _, v := range NotCounts {
			_, err := f.Value([]string{"-" + name, v})
			_, want := size.ParseCount(v)
			require.Error(t, want, v)
			refused(v, err, want.Error())
		}
	}
}

// Sizes checks that every flag of a command whose help names its value
// `size` (a size in bytes, a size.Value) refuses a count of billions
// (1.3B: B is bytes in a size) and bits (64Mb) with size.Parse's error, on
// one line that names the flag and the value.
func Sizes(t *testing.T, parse func(args []string, stderr io.Writer) error) {
	t.Helper()
	for name, value := range helpFlags(t, parse) {
		if value != "size" {
			continue
		}
		for _, v := range []string{"1.3B", "64Mb"} {
			err := parse([]string{"-" + name, v}, io.Discard)
			_, want := size.Parse(v)
			require.Error(t, want, v)
			if assert.Error(t, err, "-%s %s", name, v) {
				assert.True(t, cliflag.IsUsage(err), "-%s %s: %v is not a usage error", name, v, err)
				assert.NotContains(t, err.Error(), "\n", "-%s %s: one line", name, v)
				assert.True(t, strings.HasPrefix(err.Error(), fmt.Sprintf("invalid value %q for --%s: %s", v, name, want)),
					"-%s %s: got %q", name, v, err)
			}
		}
	}
}

// OptionCount is a count flag of a command whose parser returns its
// options (see Options): its bounds, as in CountFlag, and Get reads its
// value from the parsed options.
type OptionCount[O any] struct {
	Min, Max int64
	Get      func(O) int64
}

// Options is Counts followed by Sizes for a command whose parser returns
// its options, as every example's parseFlags does.
func Options[O any](t *testing.T, parse func(args []string, stderr io.Writer) (O, error), counts map[string]OptionCount[O]) {
	t.Helper()
	plain := func(args []string, stderr io.Writer) error {
		_, err := parse(args, stderr)
		return err
	}
	flags := make(map[string]CountFlag, len(counts))
	for name, c := range counts {
		flags[name] = CountFlag{Min: c.Min, Max: c.Max, Value: func(args []string) (int64, error) {
			o, err := parse(args, io.Discard)
			if err != nil {
				return 0, err
			}
			return c.Get(o), nil
		}}
	}
	Counts(t, plain, flags)
	Sizes(t, plain)
}
