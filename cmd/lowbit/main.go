// Command lowbit is lowbit's command-line tool:
//
//	lowbit conformance [--backend local|mpi] DIR   check conformance vectors
//	lowbit bench [flags]                           PARAM-style collective benchmark
//	lowbit demo                                    exact vs compressed allreduce
//	lowbit plan [flags]                            predicted collective and step times (alpha-beta model)
//
// Run "lowbit COMMAND -h" for a command's flags. With --backend mpi, start
// the tool under mpirun; a binary built without the mpi tag says how to
// build one that has it.
package main

import (
	"fmt"
	"io"
	"os"
	"slices"
)

// command is one subcommand; each lives in its own file and registers
// itself in init.
type command struct {
	name, usage string
	run         func(args []string, stdout io.Writer) error
}

var commands []command

func register(c command) { commands = append(commands, c) }

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: lowbit COMMAND [flags]")
	slices.SortFunc(commands, func(a, b command) int {
		if a.name < b.name {
			return -1
		}
		return 1
	})
	for _, c := range commands {
		fmt.Fprintf(w, "  %-12s %s\n", c.name, c.usage)
	}
}

func main() {
	if len(os.Args) < 2 {
		usage(os.Stderr)
		os.Exit(2)
	}
	for _, c := range commands {
		if c.name == os.Args[1] {
			if err := c.run(os.Args[2:], os.Stdout); err != nil {
				fmt.Fprintln(os.Stderr, "lowbit "+c.name+":", err)
				os.Exit(1)
			}
			return
		}
	}
	usage(os.Stderr)
	os.Exit(2)
}
