package main

import (
	"bytes"
	"fmt"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
// "lowbit plan: invalid value "34OM" for --params: ... (e.g. --params 1.3G); see lowbit plan -h".
func TestBadFlagValueExample(t *testing.T) {
	var out, errOut bytes.Buffer
	assert.Equal(t, 2, run([]string{"plan", "--params", "34OM"}, &out, &errOut))
	assert.Regexp(t, `^lowbit plan: invalid value "34OM" for --params: .*\(e\.g\. --params 1\.3G\); see lowbit plan -h\n$`, errOut.String())
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
