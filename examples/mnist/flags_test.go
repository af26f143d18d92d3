package main

import (
	"io"
	"testing"

	"github.com/lowbit-ml/lowbit/internal/cliflag/flagtest"
)

// TestBadFlagValues gives every flag of the example an empty, a negative,
// a huge and a misspelled value: each is refused before anything runs with
// a one-line usage error, or accepted where the value is valid; nothing
// panics. Names of files and directories are checked when the run opens
// them.
func TestBadFlagValues(t *testing.T) {
	flagtest.BadValues(t, func(args []string, stderr io.Writer) error {
		_, err := parseFlags(args, stderr)
		return err
	}, 16, "plot", "data", "cpuprofile", "checkpoint")
}

// TestBadFlagExit: the binary prints one line for a bad value and exits 2.
func TestBadFlagExit(t *testing.T) {
	flagtest.Exit(t, "mnist", []string{"-batch", "64Q"}, []string{"-workers", "0"}, []string{"-backend", "tcp"},
		[]string{"-nosuch"}, []string{"stray"})
}

// TestCountFlags: -batch, a count of examples, takes counts as the field
// writes them where they are in its bounds (137k; 7B is refused as out of
// range) and refuses sizes in bytes (64MiB) with one line.
func TestCountFlags(t *testing.T) {
	flagtest.Options(t, parseFlags, map[string]flagtest.OptionCount[*options]{
		"batch": {Min: 1, Max: 1 << 20, Get: func(o *options) int64 { return int64(o.batch) }},
	})
}
