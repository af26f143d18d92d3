// Command lowbit is lowbit's command-line tool:
//
//	lowbit conformance [--backend local|mpi] DIR   check conformance vectors
//	lowbit bench [flags]                           PARAM-style collective benchmark
//	lowbit demo                                    exact vs compressed allreduce
//	lowbit plan [flags]                            predicted collective and step times (alpha-beta model)
//
// Run "lowbit COMMAND -h" for a command's flags. Sizes in bytes (--bucket,
// -b, --size, ...) take SI or binary units: 340M, 64Mi, 1.5G, 4096B.
// Counts (--params) are written as model sizes are: 7B, 1.3B, 340M, 137k,
// where B is billion (package size). A bad command line prints one line
// and exits with status 2; a command that fails exits with 1. With
// --backend mpi, start the tool under mpirun; a binary built without the
// mpi tag says how to build one that has it.
package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/internal/cliflag"
)

// command is one subcommand; each lives in its own file and registers
// itself in init. run writes its results to stdout and its usage (-h) to
// stderr; a bad command line is a *cliflag.Error.
type command struct {
	name, usage string
	run         func(args []string, stdout, stderr io.Writer) error
}

var commands []command

func register(c command) { commands = append(commands, c) }

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: lowbit COMMAND [flags]")
	slices.SortFunc(commands, func(a, b command) int { return strings.Compare(a.name, b.name) })
	for _, c := range commands {
		fmt.Fprintf(w, "  %-12s %s\n", c.name, c.usage)
	}
}

// run runs the command line args (without the program name) and returns
// the exit status.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) < 1 {
		usage(stderr)
		return 2
	}
	for _, c := range commands {
		if c.name != args[0] {
			continue
		}
		err := c.run(args[1:], stdout, stderr)
		switch {
		case err == nil || errors.Is(err, flag.ErrHelp):
			return 0
		case cliflag.IsUsage(err):
			fmt.Fprintf(stderr, "lowbit %s: %s; see lowbit %s -h\n", c.name, oneLine(err), c.name)
			return 2
		}
		fmt.Fprintln(stderr, "lowbit "+c.name+":", err)
		return 1
	}
	usage(stderr)
	return 2
}

// oneLine keeps a usage error on one line whatever its value holds.
func oneLine(err error) string {
	return strings.NewReplacer("\n", `\n`, "\r", `\r`).Replace(err.Error())
}

func main() { os.Exit(run(os.Args[1:], os.Stdout, os.Stderr)) }
