// Command gpt trains a small byte-level GPT data-parallel with lowbit: a
// decoder-only transformer from GoMLX's model zoo (byte and learned
// position embeddings, causal multi-head self-attention, layer norm, two
// blocks by default), run by GoMLX's pure-Go backend, its gradients
// averaged over the ranks by a lowbit optimizer through package
// github.com/lowbit-ml/lowbit/integrations/gomlx.
//
// The text is the Go standard library's source ($(go env GOROOT)/src,
// non-test .go files) unless -corpus names another directory; the files are
// split into training and validation files by a shuffle seeded by -seed,
// the same on every rank, and every rank trains on its own shard of each
// global batch. Each run is validated on the same windows of the
// validation text; the table gives the final validation loss (nats per
// byte and bits per byte), the bytes each rank sent, and the time to the
// -target validation loss.
//
// From integrations/gomlx (GOMLX_BACKEND=go, build tag noxla):
//
//	go run -tags noxla ./examples/gpt -compare -optimizer onebit-adam -workers 4
//
// With -backend mpi this process is one rank of an mpirun job:
//
//	go build -tags noxla,mpi -o gpt ./examples/gpt
//	mpirun -np 4 ./gpt -backend mpi -compare -optimizer onebit-adam
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"syscall"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/comm/mpi"
)

type options struct {
	corpus     string
	goSource   bool // the default corpus: non-test .go files only
	maxBytes   int64
	valFrac    float64
	optimizer  string
	reduce     string
	compare    bool
	runs       []runSpec
	steps      int
	workers    int
	backend    string
	batch      int
	model      modelConfig
	lr         float64
	freezeStep int
	seed       uint64
	target     float64
	evalEvery  int
	valWindows int
	jsonPath   string
	plotPath   string
	mdPath     string
	quiet      bool
}

func (o *options) hyper() hyper {
	fs := o.freezeStep
	if fs < 0 {
		fs = max(1, o.steps/5)
	}
	return hyper{lr: float32(o.lr), freezeStep: fs}
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("gpt", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.corpus, "corpus", "", "directory of text files to learn (default: the non-test .go files under $(go env GOROOT)/src)")
	fs.Int64Var(&o.maxBytes, "max-bytes", 8<<20, "read at most this many bytes of the corpus, files taken in the seeded order (0: all)")
	fs.Float64Var(&o.valFrac, "val-frac", 0.1, "share of the corpus files held out for validation")
	fs.StringVar(&o.optimizer, "optimizer", "onebit-adam", "comma-separated runs NAME or NAME:REDUCE, trained one after the other from the same seed; NAME one of adam, onebit-adam, zeroone-adam, lamb, onebit-lamb, zero-adam")
	fs.StringVar(&o.reduce, "reduce", "fp32", "gradient averaging of the exact optimizers and the 1-bit ones' warm-up: fp32, fp16, bf16, twolevel; for zero-adam its reduce-scatter: fp32, coalesced, int8, int4")
	fs.BoolVar(&o.compare, "compare", false, "train the exact optimizer, then its compressed counterpart (adam and onebit-adam, lamb and onebit-lamb, ...), from the same seed")
	fs.IntVar(&o.steps, "steps", 300, "training steps per run")
	fs.IntVar(&o.workers, "workers", 4, "in-process ranks (-backend local)")
	fs.StringVar(&o.backend, "backend", "local", "local (goroutine ranks) or mpi (one rank of an mpirun job; build with -tags mpi)")
	fs.IntVar(&o.batch, "batch", 16, "global batch in sequences, split over the ranks")
	fs.IntVar(&o.model.dModel, "d-model", 64, "embedding width")
	fs.IntVar(&o.model.layers, "layers", 2, "transformer blocks")
	fs.IntVar(&o.model.heads, "heads", 4, "attention heads")
	fs.IntVar(&o.model.ffn, "ffn", 256, "feed-forward width")
	fs.IntVar(&o.model.context, "context", 64, "sequence length in bytes")
	fs.Float64Var(&o.lr, "lr", 2e-3, "learning rate")
	fs.IntVar(&o.freezeStep, "freeze-step", -1, "exact warm-up steps of the 1-bit optimizers (-1: a fifth of -steps)")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the split, the batches and rank 0's initial weights")
	fs.Float64Var(&o.target, "target", 2.0, "validation loss (nats per byte) for the time-to-target column (0: none)")
	fs.IntVar(&o.evalEvery, "eval-every", 0, "validate every this many steps (0: 20 times per run)")
	fs.IntVar(&o.valWindows, "val-windows", 64, "validation sequences, evenly spaced over the validation text")
	fs.StringVar(&o.jsonPath, "json", "", "write the results as JSON to this file")
	fs.StringVar(&o.plotPath, "plot", "", "draw validation loss against tokens, one curve per run, into this SVG file")
	fs.StringVar(&o.mdPath, "markdown", "", "write the results table as Markdown to this file")
	fs.BoolVar(&o.quiet, "quiet", false, "print only the final table")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	case o.backend != "local" && o.backend != "mpi":
		return nil, fmt.Errorf("unknown -backend %q (want local or mpi)", o.backend)
	case o.workers < 1 || o.steps < 1 || o.batch < 1 || o.valWindows < 1:
		return nil, errors.New("-workers, -steps, -batch and -val-windows must be at least 1")
	case !(o.lr > 0):
		return nil, fmt.Errorf("-lr must be positive, got %v", o.lr)
	case !(o.valFrac > 0 && o.valFrac < 1):
		return nil, fmt.Errorf("-val-frac must be between 0 and 1, got %v", o.valFrac)
	case o.target < 0 || o.maxBytes < 0:
		return nil, errors.New("-target and -max-bytes must not be negative")
	case o.plotPath != "" && !hasSuffixFold(o.plotPath, ".svg"):
		return nil, fmt.Errorf("-plot %s: the plot is SVG; name a .svg file", o.plotPath)
	}
	if err := o.model.validate(); err != nil {
		return nil, err
	}
	runs, err := parseRuns(o.optimizer, o.reduce, o.compare)
	if err != nil {
		return nil, err
	}
	o.runs = runs
	return o, nil
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "gpt:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if o.corpus == "" {
		if o.corpus, err = defaultCorpus(); err != nil {
			return err
		}
		o.goSource = true
	}
	data, err := loadCorpus(o.corpus, o.goSource, o.valFrac, o.seed, o.maxBytes)
	if err != nil {
		return err
	}
	if err := data.check(o.batch, o.model.context); err != nil {
		return err
	}
	var results []*result
	if o.backend == "mpi" {
		c, err := mpi.Open()
		if err != nil {
			return fmt.Errorf("-backend mpi: %w; then start this binary under mpirun -np W", err)
		}
		defer c.Close()
		if c.Rank() != 0 {
			stdout = io.Discard
		}
		printHeader(stdout, o, data, c.Size())
		for _, r := range o.runs {
			res, err := trainRank(ctx, c, r, o, data, progressPrinter(stdout, o.quiet))
			if err != nil {
				return fmt.Errorf("%s: rank %d: %w", r.label(), c.Rank(), err)
			}
			results = append(results, res)
		}
		if c.Rank() != 0 {
			return nil
		}
	} else {
		printHeader(stdout, o, data, o.workers)
		for _, r := range o.runs {
			var mu sync.Mutex
			var r0 *result
			err := local.Run(ctx, o.workers, func(ctx context.Context, c comm.Comm) error {
				res, err := trainRank(ctx, c, r, o, data, progressPrinter(stdout, o.quiet))
				if err == nil && c.Rank() == 0 {
					mu.Lock()
					r0 = res
					mu.Unlock()
				}
				return err
			})
			if err != nil {
				return fmt.Errorf("%s: %w", r.label(), err)
			}
			results = append(results, r0)
		}
	}
	report(stdout, o, results)
	if o.jsonPath != "" {
		if err := writeJSON(o.jsonPath, o, results); err != nil {
			return fmt.Errorf("-json: %w", err)
		}
	}
	if o.mdPath != "" {
		if err := writeMarkdown(o.mdPath, o, data, results); err != nil {
			return fmt.Errorf("-markdown: %w", err)
		}
	}
	if o.plotPath != "" {
		if err := writePlot(o.plotPath, o, results); err != nil {
			return fmt.Errorf("-plot: %w", err)
		}
	}
	return nil
}
