package main

import (
	"bytes"
	"fmt"
	"io"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/costmodel"
	"github.com/lowbit-ml/lowbit/internal/cliflag/flagtest"
)

// commandFlags lists the flags "lowbit CMD -h" prints.
func commandFlags(t *testing.T, cmd string) []string {
	t.Helper()
	var out, errOut bytes.Buffer
	require.Equal(t, 0, run([]string{cmd, "-h"}, &out, &errOut), cmd)
	var names []string
	for _, m := range regexp.MustCompile(`(?m)^  -([\w-]+)`).FindAllStringSubmatch(errOut.String(), -1) {
		names = append(names, m[1])
	}
	require.NotEmpty(t, names, "%s -h: %s", cmd, errOut.String())
	return names
}

// Every flag of every command, given an empty, a negative, a huge and a
// misspelled value, gets one line on stderr naming the flag and the value
// and pointing at -h, and exit status 2: no usage dump, no panic, nothing
// run.
func TestBadFlagValues(t *testing.T) {
	const huge = "99999999999999999999"
	// misspelled is a near miss of a good value, per flag (default: 1O,
	// a letter O for a zero).
	misspelled := map[string]string{
		"backend": "lcoal", "collective": "allredcue", "link": "10gbt", "sharing": "shraed", "device": "cdua",
		"b": "64Mo", "e": "64Mo", "bucket": "25Mb", "params": "340N", "size": "64mb", "step-compute": "5sec", "timeout": "2mins",
		"json": "ture", "csv": "ture", "check": "ture", "holdout": "ture",
	}
	// accepted are values a flag takes as they are (any file name):
	// nothing to refuse.
	accepted := map[string][]string{
		"bench/cpuprofile":  {"", "-1", huge, "1O"},
		"bench/trace":       {"", "-1", huge, "1O"},
		"bench/device":      {""},
		"plan/measurements": {"", "-1", huge, "1O"},
	}
	extra := map[string][]string{"conformance": {"testdata"}}
	for _, cmd := range []string{"bench", "conformance", "demo", "plan"} {
		for _, name := range commandFlags(t, cmd) {
			mis := misspelled[name]
			if mis == "" {
				mis = "1O"
			}
			for _, v := range []string{"", "-1", huge, mis} {
				key := cmd + "/" + name
				if strings.Contains(strings.Join(accepted[key], "\x00")+"\x00", v+"\x00") && len(accepted[key]) > 0 {
					continue
				}
				args := append([]string{cmd, fmt.Sprintf("--%s=%s", name, v)}, extra[cmd]...)
				var out, errOut bytes.Buffer
				code := run(args, &out, &errOut)
				msg := errOut.String()
				assert.Equal(t, 2, code, "%q: %s", args, msg)
				assert.Equal(t, 1, strings.Count(msg, "\n"), "%q: one line, got %q", args, msg)
				assert.Contains(t, msg, "--"+name, "%q names the flag", args)
				assert.Contains(t, msg, fmt.Sprintf("%q", v), "%q names the value", args)
				assert.Contains(t, msg, "lowbit "+cmd+" -h", "%q points at -h", args)
				assert.Empty(t, out.String(), "%q printed results", args)
			}
		}
	}
}

// A bad value names a good one: a size flag's error reads like
// "lowbit plan: invalid value "34OM" for --params: ... (e.g. --params 1.3B); see lowbit plan -h".
func TestBadFlagValueExample(t *testing.T) {
	var out, errOut bytes.Buffer
	assert.Equal(t, 2, run([]string{"plan", "--params", "34OM"}, &out, &errOut))
	assert.Regexp(t, `^lowbit plan: invalid value "34OM" for --params: .*\(e\.g\. --params 1\.3B\); see lowbit plan -h\n$`, errOut.String())
	errOut.Reset()
	assert.Equal(t, 2, run([]string{"bench", "--ranks", "x"}, &out, &errOut))
	assert.Equal(t, "lowbit bench: invalid value \"x\" for --ranks: not a whole number (e.g. --ranks 4); see lowbit bench -h\n", errOut.String())
	errOut.Reset()
	assert.Equal(t, 2, run([]string{"demo", "--nope"}, &out, &errOut))
	assert.Equal(t, "lowbit demo: flag provided but not defined: -nope; see lowbit demo -h\n", errOut.String())
	errOut.Reset()
	assert.Equal(t, 2, run([]string{"nope"}, &out, &errOut))
	assert.Contains(t, errOut.String(), "usage: lowbit COMMAND")
}

// parsers are the flag parsing of each command, for package flagtest;
// demo and conformance parse inside their run, which a refused value or -h
// stops before anything runs.
var parsers = map[string]func(args []string, stderr io.Writer) error{
	"bench": func(args []string, stderr io.Writer) error {
		_, err := parseBenchFlags(args, stderr)
		return err
	},
	"conformance": func(args []string, stderr io.Writer) error { return conformanceMain(args, io.Discard, stderr) },
	"demo":        func(args []string, stderr io.Writer) error { return demoMain(args, io.Discard, stderr) },
	"plan": func(args []string, stderr io.Writer) error {
		_, err := parsePlanFlags(args, stderr)
		return err
	},
}

// Every count flag of every command (--params) takes counts as the field
// writes them (7B, 1.3B, 70B, 340M, 137k) and refuses sizes in bytes,
// fractions and the rest with one line; a command without count flags
// has none whose help says `count`. Every size flag in bytes (--bucket,
// -b, -e, --size) refuses 1.3B, 1.3 bytes.
func TestCountFlags(t *testing.T) {
	counts := map[string]map[string]flagtest.CountFlag{
		"plan": {"params": {Min: 1, Max: costmodel.MaxParams, Value: func(args []string) (int64, error) {
			cfg, err := parsePlanFlags(args, io.Discard)
			if err != nil {
				return 0, err
			}
			return cfg.job.Params, nil
		}}, "muon-params": {Min: 0, Max: costmodel.MaxParams, Value: func(args []string) (int64, error) {
			cfg, err := parsePlanFlags(args, io.Discard)
			if err != nil {
				return 0, err
			}
			return cfg.job.MuonParams, nil
		}}, "tokens-per-step": {Min: 1, Max: costmodel.MaxTokensPerStep, Value: func(args []string) (int64, error) {
			cfg, err := parsePlanFlags(append(args, "--vs-one", "--step-compute", "40ms"), io.Discard)
			if err != nil {
				return 0, err
			}
			return cfg.job.TokensPerStep, nil
		}}},
	}
	for _, c := range commands {
		parse, ok := parsers[c.name]
		require.True(t, ok, "no parser for lowbit %s", c.name)
		t.Run(c.name, func(t *testing.T) {
			flagtest.Counts(t, parse, counts[c.name])
			flagtest.Sizes(t, parse)
		})
	}
}

// What lowbit prints for counts and sizes given one for the other: the
// whole line, for each input.
func TestCountFlagLines(t *testing.T) {
	for _, c := range []struct {
		args []string
		line string // stderr, or the first line of stdout where it ran
	}{
		{[]string{"plan", "--params", "7B", "--ranks", "8"}, "# lowbit plan: 7B parameters (28.00 GB float32 gradient), 8 ranks, 10 Gbit/s links (per-rank)"},
		{[]string{"plan", "--params", "1.3B"}, "# lowbit plan: 1.3B parameters (5.20 GB float32 gradient), 64 ranks, 10 Gbit/s links (per-rank)"},
		{[]string{"plan", "--params", "70B"}, "# lowbit plan: 70B parameters (280.00 GB float32 gradient), 64 ranks, 10 Gbit/s links (per-rank)"},
		{[]string{"plan", "--params", "340M"}, "# lowbit plan: 340M parameters (1.36 GB float32 gradient), 64 ranks, 10 Gbit/s links (per-rank)"},
		{[]string{"plan", "--params", "137k"}, "# lowbit plan: 137k parameters (548.0 kB float32 gradient), 64 ranks, 10 Gbit/s links (per-rank)"},
		{[]string{"plan", "--params", "6.7b"}, "# lowbit plan: 6.7B parameters (26.80 GB float32 gradient), 64 ranks, 10 Gbit/s links (per-rank)"},
		{[]string{"plan", "--params", "1.3e9"}, "# lowbit plan: 1.3B parameters (5.20 GB float32 gradient), 64 ranks, 10 Gbit/s links (per-rank)"},
		{[]string{"plan", "--params", "1Mi"}, "# lowbit plan: 1048576 parameters (4.2 MB float32 gradient), 64 ranks, 10 Gbit/s links (per-rank)"},
		{[]string{"plan", "--params", "123456789"}, "# lowbit plan: 123456789 parameters (493.8 MB float32 gradient), 64 ranks, 10 Gbit/s links (per-rank)"},
		{[]string{"plan", "--params", "64MiB"}, `lowbit plan: invalid value "64MiB" for --params: invalid count "64MiB": MiB is a size in bytes, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k) (e.g. --params 1.3B); see lowbit plan -h`},
		{[]string{"plan", "--params", "28GB"}, `lowbit plan: invalid value "28GB" for --params: invalid count "28GB": GB is a size in bytes, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k) (e.g. --params 1.3B); see lowbit plan -h`},
		{[]string{"plan", "--params", "64Mb"}, `lowbit plan: invalid value "64Mb" for --params: invalid count "64Mb": Mb is a size in bits, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k) (e.g. --params 1.3B); see lowbit plan -h`},
		{[]string{"plan", "--params", "1.5"}, `lowbit plan: invalid value "1.5" for --params: invalid count "1.5": not a whole number (e.g. --params 1.3B); see lowbit plan -h`},
		{[]string{"plan", "--params", "-7B"}, `lowbit plan: invalid value "-7B" for --params: invalid count "-7B": must not be negative (e.g. --params 1.3B); see lowbit plan -h`},
		{[]string{"plan", "--params", "7 B"}, `lowbit plan: invalid value "7 B" for --params: invalid count "7 B": want a count such as 7B, 1.3B, 340M or 137k (e.g. --params 1.3B); see lowbit plan -h`},
		{[]string{"plan", "--params", "2000T"}, `lowbit plan: invalid value "2000T" for --params: 2000T is out of range [1, 1000T] (e.g. --params 1.3B); see lowbit plan -h`},
		{[]string{"plan", "--params", "4096000B"}, `lowbit plan: invalid value "4096000B" for --params: 4096000B is out of range [1, 1000T] (B is billion in a count) (e.g. --params 1.3B); see lowbit plan -h`},
		{[]string{"plan", "--params", "0"}, `lowbit plan: invalid value "0" for --params: 0 is out of range [1, 1000T] (e.g. --params 1.3B); see lowbit plan -h`},
		{[]string{"plan", "--bucket", "1.3B"}, `lowbit plan: invalid value "1.3B" for --bucket: invalid size "1.3B": B means bytes in a size, and 1.3 bytes is not a whole number (1.3 billion bytes is 1.3G) (e.g. --bucket 25Mi); see lowbit plan -h`},
		{[]string{"bench", "--b", "1.3B"}, `lowbit bench: invalid value "1.3B" for --b: invalid size "1.3B": B means bytes in a size, and 1.3 bytes is not a whole number (1.3 billion bytes is 1.3G) (e.g. --b 1Ki); see lowbit bench -h`},
		{[]string{"demo", "--size", "0.5B"}, `lowbit demo: invalid value "0.5B" for --size: invalid size "0.5B": B means bytes in a size, and 0.5 bytes is not a whole number (0.5 billion bytes is 0.5G) (e.g. --size 64Mi); see lowbit demo -h`},
	} {
		var out, errOut bytes.Buffer
		code := run(c.args, &out, &errOut)
		if strings.HasPrefix(c.line, "#") {
			require.Equal(t, 0, code, "%q: %s", c.args, errOut.String())
			first, _, _ := strings.Cut(out.String(), "\n")
			assert.Equal(t, c.line, first, "%q", c.args)
			continue
		}
		assert.Equal(t, 2, code, "%q", c.args)
		assert.Equal(t, c.line+"\n", errOut.String(), "%q", c.args)
		assert.Empty(t, out.String(), "%q", c.args)
	}
}
