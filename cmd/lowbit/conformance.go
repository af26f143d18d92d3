package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
	"github.com/lowbit-ml/lowbit/internal/conformance"
	"github.com/lowbit-ml/lowbit/size"
)

func init() {
	register(command{
		name:  "conformance",
		usage: "run a conformance JSON file, or every one in DIR, against lowbit",
		run:   conformanceMain,
	})
}

// conformanceMain runs the case in FILE, or every case in DIR, and prints
// one line per case, then "N passed, M failed, K skipped". Kinds lowbit
// does not implement yet are skipped, never passed. An optimizer step file
// (muon_w3.json) is replayed step by step and its line gives the largest
// deviation of any parameter after any step. With --backend mpi (under
// mpirun -np W) only the cases of world size W run, and rank 0 prints.
func conformanceMain(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("conformance", flag.ContinueOnError)
	fs.SetOutput(stderr)
	backend := fs.String("backend", "local", "communication backend: "+backends)
	timeout := fs.Duration("timeout", 2*time.Minute, "deadline for each case")
	rpn := fs.Int("ranks-per-node", 0, "mpi backend: ranks per node of the qgz layout (0: the ranks that share memory); "+
		"the local backend lays out each qgz case as the case says")
	fs.Usage = func() {
		fmt.Fprintln(fs.Output(), "usage: lowbit conformance [--backend local|mpi] [--ranks-per-node K] [--timeout D] FILE|DIR")
		fs.PrintDefaults()
	}
	if err := cliflag.Parse(fs, args); err != nil {
		return err
	}
	switch {
	case fs.NArg() != 1:
		return cliflag.Usagef("want exactly one file or directory, got %q", fs.Args())
	case *backend != "local" && *backend != "mpi":
		return cliflag.Bad(fs, "backend", "unknown backend (want %s)", backends)
	case *timeout <= 0:
		return cliflag.Bad(fs, "timeout", "want a positive duration")
	case *rpn < 0 || *rpn > maxLocalRanks:
		return cliflag.Bad(fs, "ranks-per-node", "want 0 (the ranks that share memory) to %d", maxLocalRanks)
	}
	cases, err := conformance.Load(fs.Arg(0))
	if err != nil {
		return err
	}
	var tally conformanceTally
	switch *backend {
	case "local":
		for _, c := range cases {
			tally.report(stdout, c, runCaseLocal(c, *timeout))
		}
	default:
		// One process is one rank of the whole world: every case of the
		// world's size runs on it, and rank 0 reports.
		err := runRanks(context.Background(), *backend, 0, func(ctx context.Context, cm comm.Comm) error {
			out := stdout
			if cm.Rank() != 0 {
				out = io.Discard
				stdout = io.Discard // the summary too
			}
			for _, c := range cases {
				res, err := runCaseOn(ctx, cm, c, *timeout, *rpn)
				if err != nil {
					return err
				}
				tally.report(out, c, res)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	fmt.Fprintf(stdout, "%d passed, %d failed, %d skipped\n", tally.passed, tally.failed, tally.skipped)
	if tally.failed > 0 {
		return fmt.Errorf("%d of %d cases failed", tally.failed, len(cases))
	}
	return nil
}

// caseResult is the outcome of one case: skip reason or error, and what
// the PASS line adds to the case's description.
type caseResult struct {
	skip string
	err  error
	note string
}

type conformanceTally struct{ passed, failed, skipped int }

func (t *conformanceTally) report(w io.Writer, c *conformance.Case, r caseResult) {
	switch {
	case r.skip != "":
		t.skipped++
		fmt.Fprintf(w, "SKIP  %-10s %-24s %s\n", c.Kind, c.Name, r.skip)
	case r.err != nil:
		t.failed++
		fmt.Fprintf(w, "FAIL  %-10s %-24s %v\n", c.Kind, c.Name, r.err)
	default:
		t.passed++
		fmt.Fprintf(w, "PASS  %-10s %-24s %s%s\n", c.Kind, c.Name, describe(c), r.note)
	}
}

func describe(c *conformance.Case) string {
	switch c.Kind {
	case "onebit":
		return fmt.Sprintf("%d ranks, %s elements, %d steps", c.World, size.FormatCount(int64(c.Numel)), len(c.Steps))
	case "signpack":
		return fmt.Sprintf("%s elements", size.FormatCount(int64(len(c.Input))))
	case "quant":
		if q, err := c.Quant(); err == nil {
			return fmt.Sprintf("int%d, groups of %d, %s elements", q.Bits, q.GroupSize, size.FormatCount(int64(len(q.Input))))
		}
	case "qgz":
		if q, err := c.QGZ(); err == nil {
			return fmt.Sprintf("%d nodes x %d ranks, int%d, groups of %d, %s elements", q.Nodes, q.RanksPerNode, q.Bits, q.GroupSize, size.FormatCount(int64(q.Numel)))
		}
	case "rsc":
		if q, err := c.RSC(); err == nil {
			return fmt.Sprintf("%d ranks, %s tensors", q.World, size.FormatCount(int64(len(q.Shapes))))
		}
	case conformance.KindOptimizer:
		if r, err := c.OptimizerRun(); err == nil {
			return fmt.Sprintf("%s, %d ranks, %d tensors, %d steps", r.Optimizer, r.World, len(r.Shapes), len(r.Steps))
		}
	}
	return ""
}

func notImplemented(c *conformance.Case) caseResult {
	if c.Kind == conformance.KindOptimizer {
		return caseResult{skip: fmt.Sprintf("optimizer %q is not replayed by this command (only %q)", c.Optimizer, conformance.OptimizerMuon)}
	}
	return caseResult{skip: fmt.Sprintf("kind %q not implemented yet", c.Kind)}
}

// deviation is the note of a replayed optimizer step file.
func deviation(worst float64) string {
	return fmt.Sprintf(", largest deviation %.3g (tolerance %g)", worst, conformance.OptimizerTolerance)
}

// runCaseLocal runs one case on in-process ranks of the case's world size.
func runCaseLocal(c *conformance.Case, timeout time.Duration) caseResult {
	switch c.Kind {
	case "signpack":
		return caseResult{err: conformance.RunSignpack(c)}
	case "quant":
		return caseResult{err: conformance.RunQuant(c)}
	case "onebit", "rsc":
		w := c.WorldSize()
		if w < 1 {
			return caseResult{err: fmt.Errorf("invalid world size %d", w)}
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		err := runRanks(ctx, "local", w, func(ctx context.Context, cm comm.Comm) error {
			if c.Kind == "rsc" {
				return conformance.RunRSCRank(ctx, cm, c)
			}
			return conformance.RunOnebitRank(ctx, cm, c)
		})
		return caseResult{err: err}
	case conformance.KindOptimizer:
		if !conformance.Replays(c) {
			break
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		var worst float64
		errs := make([]error, c.WorldSize())
		err := runRanks(ctx, "local", len(errs), func(ctx context.Context, cm comm.Comm) error {
			d, err := conformance.RunOptimizerRank(ctx, cm, c)
			if cm.Rank() == 0 {
				worst = d
			}
			errs[cm.Rank()] = err
			return err
		})
		if err != nil && sameErrors(errs) {
			err = errs[0] // the ranks replay the same run: say it once
		}
		return caseResult{err: err, note: deviation(worst)}
	case "qgz":
		q, err := c.QGZ()
		if err != nil {
			return caseResult{err: err}
		}
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		err = runRanks(ctx, "local", q.Nodes*q.RanksPerNode, func(ctx context.Context, cm comm.Comm) error {
			l, err := comm.NewLayout(ctx, cm, q.RanksPerNode)
			if err != nil {
				return err
			}
			return errors.Join(conformance.RunQGZRank(ctx, l, c), l.Close())
		})
		return caseResult{err: err}
	}
	return notImplemented(c)
}

// sameErrors reports whether every error of errs says the same as the
// first, which is not nil.
func sameErrors(errs []error) bool {
	for _, err := range errs {
		if err == nil || err.Error() != errs[0].Error() {
			return false
		}
	}
	return true
}

// runCaseOn runs one case as this rank of cm. Every rank reaches the same
// verdict: a failure on any rank fails the case everywhere. The returned
// error is for failures of the communicator itself. qgz cases run on the
// layout of rpn ranks per node (0: the ranks that share memory) and are
// skipped when it is not theirs.
func runCaseOn(ctx context.Context, cm comm.Comm, c *conformance.Case, timeout time.Duration, rpn int) (caseResult, error) {
	var err error
	var note string
	if c.Kind == conformance.KindOptimizer && !conformance.Replays(c) {
		return notImplemented(c), nil
	}
	switch c.Kind {
	case "signpack":
		err = conformance.RunSignpack(c)
	case "quant":
		err = conformance.RunQuant(c)
	case "onebit", "rsc", "qgz", conformance.KindOptimizer:
		if w := c.WorldSize(); w != cm.Size() {
			return caseResult{skip: fmt.Sprintf("needs %d ranks, the world has %d", w, cm.Size())}, nil
		}
		cctx, cancel := context.WithTimeout(ctx, timeout)
		switch c.Kind {
		case "onebit":
			err = conformance.RunOnebitRank(cctx, cm, c)
		case "rsc":
			err = conformance.RunRSCRank(cctx, cm, c)
		case conformance.KindOptimizer:
			var worst float64
			worst, err = conformance.RunOptimizerRank(cctx, cm, c)
			note = deviation(worst)
		case "qgz":
			// A bad layout is the same error on every rank: the case fails.
			l, lerr := comm.NewLayout(cctx, cm, rpn)
			if lerr != nil {
				err = fmt.Errorf("layout: %w", lerr)
				break
			}
			q, _ := c.QGZ() // WorldSize decoded it
			if l.RanksPerNode != q.RanksPerNode {
				cancel()
				return caseResult{skip: fmt.Sprintf("needs %d ranks per node, the layout has %d (--ranks-per-node)",
					q.RanksPerNode, l.RanksPerNode)}, l.Close()
			}
			err = errors.Join(conformance.RunQGZRank(cctx, l, c), l.Close())
		}
		cancel()
		if errors.Is(err, comm.ErrAborted) || errors.Is(err, comm.ErrClosed) {
			return caseResult{}, err
		}
	default:
		return notImplemented(c), nil
	}
	flag := []float32{0}
	if err != nil {
		flag[0] = float32(cm.Rank() + 1)
	}
	if aerr := cm.AllReduce(ctx, flag, comm.Max); aerr != nil {
		return caseResult{}, aerr
	}
	if err == nil && flag[0] != 0 {
		err = fmt.Errorf("failed on rank %d", int(flag[0])-1)
	}
	return caseResult{err: err, note: note}, nil
}
