// Command mnist trains a 784-256-10 perceptron on MNIST with data-parallel
// workers and compares an exact optimizer with a communication-compressed
// one: this is what "make demo" runs.
//
//	go run ./examples/mnist -compare -optimizer onebit-adam -workers 4 -plot out/mnist.png
//
// Every global batch (-batch examples) is split over -workers ranks; each
// rank computes the gradient of its shard and calls the optimizer's Step,
// which averages over the ranks (exactly, or 1-bit compressed). With
// -backend local the ranks are goroutines of this process; with -backend mpi
// this process is one rank of an "mpirun -np W" job (build with -tags mpi)
// and only rank 0 prints.
//
// At the end a table gives, per optimizer, the test accuracy, the final
// training loss, the time to reach -target test accuracy, the training wall
// time split into compute (forward and backward), communication (time inside
// collectives during Step) and compression (the rest of Step: compression
// and the update), and the bytes each worker sent. -plot writes the training
// loss and test accuracy curves to a PNG file, and beside it
// (FILE-bytes.png) the test loss and accuracy against the bytes sent per
// rank. -optimizer also takes a comma-separated list, trained one after the
// other.
//
// The data are the four MNIST files in -data (default data/mnist, filled by
// "make mnist-data"): train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,
// t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz (gzipped or plain
// IDX files).
package main

//go:generate go run testdata/gen.go -src ../../data/mnist -dst testdata

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
	"github.com/lowbit-ml/lowbit/internal/outerstate"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
	"github.com/lowbit-ml/lowbit/size"
)

// Defaults of the flags, chosen so that "make demo" reaches 97% test
// accuracy with both optimizers in well under 3 minutes on 2 cores.
const (
	defaultWorkers    = 4
	defaultEpochs     = 4
	defaultBatch      = 128
	defaultLR         = 1e-3
	defaultMuonLR     = 0.02 // Muon's published default
	defaultFreezeStep = 200
	defaultSeed       = 1
	defaultEvals      = 3
	defaultTarget     = 0.97

	defaultCheckpointEvery = 100

	// defaultOuterH is diloco's -outer-h: 23 outer steps in the 468 steps
	// of the default run (the library's default, 50, is for longer runs).
	defaultOuterH = 20
)

// options are the parsed flags.
type options struct {
	workers    int
	backend    string
	optimizer  string
	compare    bool
	freezeStep int
	localSteps int // -local-step-scaler
	epochs     int
	batch      int
	lr         float64
	muonLR     float64 // -muon-lr: muon's Muon group's; -lr is its AdamW's
	muonState  string  // -muon-state: onebit-muon's state mode (onebit.ParseMuonStateMode)
	muonWarmup string  // -muon-warmup: onebit-muon's warm-up, "adamw" or "all" (onebit.MuonConfig.WarmupAdamWOnly)
	seed       uint64
	plot       string
	data       string
	evals      int
	target     float64
	quiet      bool
	cpuprofile string
	checkpoint checkpointConfig
	reduce     string
	outer      outer.Config    // diloco's -outer-* flags, codec parsed
	outerState outerstate.Mode // -outer-state (-outer-bf16)
	outerLR    float64         // -outer-lr: -1 for the codec's default
	// -outer-density and -outer-decay, the sparse codec's.
	outerDensity, outerDecay float64
	outerCodec               string // -outer-codec
	outerInner               string // -outer-inner: adam or muon

	// allowInprocess is -allow-inprocess-under-mpi: -backend local even
	// where the environment says this process is one rank of an MPI job.
	allowInprocess bool

	workersSet bool // -workers was given explicitly
	lrSet      bool // -lr was given explicitly: it wins over a checkpoint's
	muonLRSet  bool // -muon-lr was given explicitly: likewise
}

// hyper returns the optimizers' settings that o's flags give.
func (o *options) hyper() hyper {
	reduce, scatter, _ := reducesOf(o.optimizer, o.reduce) // checked by parseFlags
	h := hyper{lr: float32(o.lr), muonLR: float32(o.muonLR), freezeStep: o.freezeStep, reduce: reduce, scatter: scatter,
		localStepScaler: o.localSteps, outer: o.outer, outerState: o.outerState, outerMuon: o.outerInner == "muon", muonWarmupAdamW: o.muonWarmup != "all"}
	h.muonState, h.muonBF16, _ = onebit.ParseMuonStateMode(o.muonState) // checked by parseFlags
	return h
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{}
	fs := flag.NewFlagSet("mnist", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&o.workers, "workers", defaultWorkers, "data-parallel workers (ranks); with -backend mpi the mpirun -np decides")
	fs.StringVar(&o.backend, "backend", "local", "communicator: local (goroutine ranks in this process) or mpi (run under mpirun; build with -tags mpi)")
	fs.BoolVar(&o.allowInprocess, "allow-inprocess-under-mpi", false, "run -backend local's in-process ranks even where the environment says this process is one rank of an MPI job (mpirun without -backend mpi): each of the job's processes then trains on its own")
	fs.StringVar(&o.optimizer, "optimizer", "onebit-adam", "optimizer: "+strings.Join(optimizerNames, ", ")+"; or several, comma-separated, trained one after the other from the same seed")
	fs.BoolVar(&o.compare, "compare", false, "train the exact and the compressed optimizer one after the other from the same seed (adam vs onebit-adam and its state modes (onebit-adam-compact, onebit-adam-sharded, onebit-adam-sharded-bf16), lamb vs onebit-lamb, adam vs zeroone-adam, adam vs zero-adam)")
	fs.IntVar(&o.freezeStep, "freeze-step", defaultFreezeStep, "warm-up steps of onebit-adam (every state mode), onebit-lamb and zeroone-adam (exact steps before compression starts)")
	fs.IntVar(&o.localSteps, "local-step-scaler", onebit.DefaultZeroOneAdamConfig().LocalStepScaler,
		"zeroone-adam: phase-B steps after which the interval between synchronizations doubles (up to 16); with the default, every step of a shorter run synchronizes (no local steps)")
	fs.IntVar(&o.epochs, "epochs", defaultEpochs, "passes over the training set")
	o.batch = defaultBatch
	fs.Var(&size.CountValue[int]{P: &o.batch, Min: 1, Max: 1 << 20}, "batch", "global batch: `count` of examples, split over the workers (128, 4096, 4k, 1Ki)")
	fs.Float64Var(&o.lr, "lr", defaultLR, "learning rate (muon: its AdamW's, for the biases); with -resume, given explicitly, it replaces the checkpoint's (otherwise the checkpoint's is kept)")
	fs.Float64Var(&o.muonLR, "muon-lr", defaultMuonLR, "muon: the learning rate of the weight matrices; with -resume as -lr")
	fs.StringVar(&o.muonState, "muon-state", "full", "onebit-muon: how its state is kept (onebit.MuonConfig.StateMode): full (13 bytes per element of a weight matrix on 4 ranks), compact (no slot, worker errors in bfloat16: 7) or compact-bf16 (the momentum in bfloat16 too: 5)")
	fs.StringVar(&o.muonWarmup, "muon-warmup", "adamw", "onebit-muon: what the exact warm-up (-freeze-step) is for: adamw (the biases' AdamW only, the weight matrices through the 1-bit exchange from the first step: onebit.MuonConfig.WarmupAdamWOnly, the library's default) or all (both groups exact)")
	fs.Uint64Var(&o.seed, "seed", defaultSeed, "seed of the initial weights and of the shuffling")
	fs.StringVar(&o.plot, "plot", "", "write training loss and test accuracy curves to this PNG file, and test loss and accuracy against the bytes sent per rank to the same name with -bytes before .png")
	fs.StringVar(&o.data, "data", "data/mnist", "directory holding the four MNIST IDX files")
	fs.IntVar(&o.evals, "evals", defaultEvals, "test-set evaluations per epoch (for the curves and the time to -target)")
	fs.Float64Var(&o.target, "target", defaultTarget, "test accuracy for the time-to-accuracy column")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress bar")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the training to this file")
	fs.StringVar(&o.checkpoint.dir, "checkpoint", "", "save each rank's training state in this directory every -checkpoint-every steps (atomic, per rank)")
	fs.IntVar(&o.checkpoint.every, "checkpoint-every", defaultCheckpointEvery, "steps between checkpoints")
	fs.BoolVar(&o.checkpoint.resume, "resume", false, "continue from the newest checkpoint in -checkpoint that every rank holds")
	fs.IntVar(&o.checkpoint.killAt, "kill-at", 0, "testing: kill the process (every rank, SIGKILL) right after the checkpoint of this step is saved")
	fs.StringVar(&o.reduce, "reduce", "fp32", "gradient averaging of the exact optimizers and of the 1-bit optimizers' exact stage: "+strings.Join(reduceNames, ", ")+
		" (onebit-adam-sharded and -sharded-bf16: fp32 only)"+
		"; with -optimizer zero-adam its gradient reduce-scatter: "+strings.Join(zeroReduceNames, ", "))
	o.outer = outer.DefaultConfig()
	o.outer.H = defaultOuterH
	fs.IntVar(&o.outer.H, "outer-h", defaultOuterH, "diloco: inner steps per outer step of each fragment")
	fs.IntVar(&o.outer.Fragments, "outer-fragments", o.outer.Fragments, "diloco: fragments of the parameters, exchanged at staggered steps (Streaming DiLoCo)")
	fs.IntVar(&o.outer.Delay, "outer-delay", o.outer.Delay, "diloco: inner steps an exchange runs in the background before its result is merged (0: exchanged within the step)")
	outerstate.Register(fs, &o.outerState)
	fs.Float64Var(&o.outerLR, "outer-lr", -1, "diloco: the outer learning rate (-1: the codec's default, outer.DefaultConfigFor)")
	o.outerDensity, o.outerDecay = float64(o.outer.Density), float64(o.outer.Decay)
	fs.Float64Var(&o.outerDensity, "outer-density", o.outerDensity, "diloco with -outer-codec sparse: share of each chunk's entries sent, in (0, 1]")
	fs.Float64Var(&o.outerDecay, "outer-decay", o.outerDecay, "diloco with -outer-codec sparse: decay of the error accumulator, in [0, 1]")
	fs.IntVar(&o.outer.SparseBits, "outer-sparse-bits", o.outer.SparseBits, "diloco with -outer-codec sparse: bits per value sent, 1 or 2")
	fs.Func("outer-sparse-exchange", "diloco with -outer-codec sparse: how the messages travel: allgather (every rank's to every rank, (W-1) messages sent per rank), "+
		"twophase (to the owners of runs of chunks, which re-select the average), shared (offsets chosen by the owners, then values only, averaged exactly) "+
		"or voted (as shared, the offsets those the most ranks named); none but allgather grows with W (default allgather)", func(s string) error {
		x, err := outer.ParseSparseExchange(s)
		if err != nil {
			return err
		}
		o.outer.SparseExchange = x
		return nil
	})
	fs.StringVar(&o.outerInner, "outer-inner", "adam", "diloco: the inner optimizer: adam (AdamW with -lr) or muon (Muon with -muon-lr over the weight matrices, its AdamW with -lr over the biases: MuLoCo's setting; with the sparse codec only with -outer-sparse-with-muon)")
	fs.BoolVar(&o.outer.SparseWithMuon, "outer-sparse-with-muon", false, "diloco: accept -outer-codec sparse around -outer-inner muon, which the library refuses by default (outer.Config.SparseWithMuon: it converged worse than the 1-bit codec on the GPT example)")
	fs.StringVar(&o.outerCodec, "outer-codec", outer.CodecSparse.String(), "diloco: how the pseudo-gradients travel: fp32, bf16, int8, 1bit, sparse (each with its measured outer learning rate and momentum, outer.DefaultConfigFor)")
	if err := cliflag.Parse(fs, args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, cliflag.Usagef("unexpected arguments %q", fs.Args())
	}
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "workers":
			o.workersSet = true
		case "lr":
			o.lrSet = true
		case "muon-lr":
			o.muonLRSet = true
		}
	})
	bad := func(name, format string, args ...any) (*options, error) {
		return nil, cliflag.Bad(fs, name, format, args...)
	}
	switch {
	case o.backend != "local" && o.backend != "mpi":
		return bad("backend", "want local or mpi")
	case o.workers < 1 || o.workers > maxWorkers:
		return bad("workers", "want 1 to %d", maxWorkers)
	case o.epochs < 1 || o.epochs > maxEpochs:
		return bad("epochs", "want 1 to %d", maxEpochs)
	case !(o.lr > 0) || o.lr > 10:
		return bad("lr", "want a learning rate in (0, 10]")
	case !(o.muonLR > 0) || o.muonLR > 10:
		return bad("muon-lr", "want a learning rate in (0, 10]")
	case o.freezeStep < 0:
		return bad("freeze-step", "want at least 0")
	case !validMuonState(o.muonState):
		return bad("muon-state", "want full, compact or compact-bf16")
	case o.outerInner != "adam" && o.outerInner != "muon":
		return bad("outer-inner", "want adam or muon")
	case o.muonWarmup != "adamw" && o.muonWarmup != "all":
		return bad("muon-warmup", "want adamw or all")
	case o.localSteps < 1:
		return bad("local-step-scaler", "want at least 1")
	case o.evals < 1 || o.evals > maxEvals:
		return bad("evals", "want 1 to %d", maxEvals)
	case !(o.target >= 0 && o.target <= 1):
		return bad("target", "want a test accuracy in [0, 1]")
	case o.checkpoint.every < 1:
		return bad("checkpoint-every", "want at least 1")
	case o.checkpoint.dir == "" && o.checkpoint.resume:
		return bad("resume", "needs -checkpoint DIR")
	case o.checkpoint.dir == "" && o.checkpoint.killAt != 0:
		return bad("kill-at", "needs -checkpoint DIR")
	case o.checkpoint.killAt < 0 || o.checkpoint.killAt%o.checkpoint.every != 0:
		return bad("kill-at", "want a multiple of -checkpoint-every (%d)", o.checkpoint.every)
	}
	codec, err := outer.ParseCodec(o.outerCodec)
	if err != nil {
		return bad("outer-codec", "want one of fp32, bf16, int8, 1bit, sparse")
	}
	def := outer.DefaultConfigFor(codec)
	o.outer.Codec, o.outer.LR, o.outer.Momentum = codec, def.LR, def.Momentum
	o.outer.Density, o.outer.Decay = float32(o.outerDensity), float32(o.outerDecay)
	if o.outerLR != -1 {
		if !(o.outerLR >= 0 && o.outerLR <= 100) {
			return bad("outer-lr", "want -1 (the codec's default) or a learning rate in [0, 100]")
		}
		o.outer.LR = float32(o.outerLR)
	}
	if err := o.outer.Validate(); err != nil {
		var ce *optim.ConfigError
		if errors.As(err, &ce) {
			if name, ok := map[string]string{"H": "outer-h", "Fragments": "outer-fragments", "Delay": "outer-delay", "SparseBits": "outer-sparse-bits",
				"Density": "outer-density", "Decay": "outer-decay", "SparseChunk": "outer-density"}[ce.Field]; ok {
				return bad(name, "want %s", ce.Want)
			}
		}
		return nil, &cliflag.Error{Reason: err.Error()}
	}
	if _, _, err := reducesOf(o.optimizer, o.reduce); err != nil {
		return nil, &cliflag.Error{Reason: err.Error()}
	}
	if _, err := runOrder(o.optimizer, o.compare); err != nil {
		return nil, &cliflag.Error{Reason: err.Error()}
	}
	return o, nil
}

// Bounds of the flags that size the run: beyond them a typo would start a
// run of years or a million goroutines.
const (
	maxWorkers = 1024
	maxEpochs  = 10000
	maxEvals   = 10000
)

// stopGrace bounds a preemption: this long after the first SIGTERM or
// SIGINT the collectives are cancelled, whatever the run is doing (a second
// signal cancels them at once).
const stopGrace = 30 * time.Second

// termAtEnv is a testing hook, like -kill-at: "STEP" makes rank 0 send
// SIGTERM to its own process right after step STEP, "STEP:parent" to its
// parent process (under mpirun: mpirun, which passes it on to every rank).
const termAtEnv = "LOWBIT_MNIST_TERM_AT"

// stepFileEnv is a testing hook for scripts/soak.sh: rank 0 of a run with
// -checkpoint writes the number of steps done into this file (overwritten
// in place) at every step boundary, so that a driver can interrupt the run
// at a chosen step and count the steps an interruption cost.
const stepFileEnv = "LOWBIT_MNIST_STEP_FILE"

// preemption carries SIGTERM and SIGINT to the training: the first asks
// the ranks to stop at the next step boundary with a checkpoint saved (when
// -checkpoint is set; without it, and on a second signal, the context is
// cancelled).
type preemption struct {
	requested    atomic.Bool // a signal arrived
	checkpointed atomic.Bool // the run can save: a signal stops it gently
	cancel       context.CancelFunc
	termAt       int      // termAtEnv's step, 0 for none
	termParent   bool     // termAtEnv's ":parent"
	stepFile     *os.File // stepFileEnv's file, nil for none
}

// watch handles the signals arriving on sigs until it is closed.
func (p *preemption) watch(sigs <-chan os.Signal) {
	for range sigs {
		if p.requested.Swap(true) || !p.checkpointed.Load() {
			p.cancel()
			continue
		}
		time.AfterFunc(stopGrace, p.cancel)
	}
}

// stop is the trainConfig.stop of a run: whether a signal arrived, after
// firing the termAtEnv hook at its step.
func (p *preemption) stop(rank, step int) bool {
	if p.stepFile != nil && rank == 0 {
		_, _ = p.stepFile.WriteAt([]byte(fmt.Sprintf("%10d\n", step)), 0)
	}
	if p.termAt > 0 && step == p.termAt && rank == 0 {
		pid := os.Getpid()
		if p.termParent {
			pid = os.Getppid()
		}
		if err := syscall.Kill(pid, syscall.SIGTERM); err == nil && !p.termParent {
			// Deterministic: this step boundary sees its own signal.
			for i := 0; i < 500 && !p.requested.Load(); i++ {
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
	return p.requested.Load()
}

func main() {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p := &preemption{cancel: cancel}
	if v := os.Getenv(termAtEnv); v != "" {
		at, parent := strings.CutSuffix(v, ":parent")
		n, err := strconv.Atoi(at)
		if err != nil || n < 1 {
			fmt.Fprintf(os.Stderr, "mnist: %s=%q: want STEP or STEP:parent\n", termAtEnv, v)
			os.Exit(2)
		}
		p.termAt, p.termParent = n, parent
	}
	if name := os.Getenv(stepFileEnv); name != "" {
		f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE, 0o644)
		if err != nil {
			fmt.Fprintf(os.Stderr, "mnist: %s: %v\n", stepFileEnv, err)
			os.Exit(2)
		}
		defer f.Close()
		p.stepFile = f
	}
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	go p.watch(sigs)
	err := runPreemptible(ctx, p, os.Args[1:], os.Stdout, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if cliflag.IsUsage(err) {
		fmt.Fprintf(os.Stderr, "mnist: %v; see mnist -h\n", err)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mnist:", err)
		os.Exit(1)
	}
}

// run is the whole command: flags in, table (and plot) out.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return runPreemptible(ctx, nil, args, stdout, stderr)
}

// runPreemptible is run whose training p can stop (nil: never).
func runPreemptible(ctx context.Context, p *preemption, args []string, stdout, stderr io.Writer) error {
	started := startup{start: time.Now()}
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if o.backend == "local" && !o.allowInprocess {
		if err := local.CheckNotUnderMPI(); err != nil {
			return fmt.Errorf("-backend local: %w; give -backend mpi (a binary built with -tags mpi), or -allow-inprocess-under-mpi to run in-process ranks anyway", err)
		}
	}
	names, _ := runOrder(o.optimizer, o.compare)
	if o.cpuprofile != "" {
		f, err := os.Create(o.cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	train, test, err := loadMNIST(o.data)
	if err != nil {
		return err
	}
	started.data = time.Now()
	cfg := trainConfig{
		hyper:         o.hyper(),
		epochs:        o.epochs,
		batch:         o.batch,
		seed:          o.seed,
		evalsPerEpoch: o.evals,
		checkpoint:    o.checkpoint,
		lrSet:         o.lrSet,
		muonLRSet:     o.muonLRSet,
		warn:          stderr,
	}
	if p != nil && o.checkpoint.dir != "" {
		cfg.stop = p.stop
		p.checkpointed.Store(true)
	}

	// trainOne trains one optimizer on every rank and returns this rank's
	// result (rank 0's with the local backend, whose ranks are goroutines
	// of this call); agree gives every rank rank 0's answer.
	var trainOne func(cfg trainConfig, bar *progress) (*result, error)
	var agree func(yes bool) (bool, error)
	var workers int
	rank0 := true
	if o.backend == "mpi" {
		c, err := openMPI()
		if err != nil {
			return err
		}
		defer c.Close()
		if o.workersSet && o.workers != c.Size() {
			return fmt.Errorf("-workers %d disagrees with the %d ranks of the MPI job", o.workers, c.Size())
		}
		workers = c.Size()
		started.comm = time.Now()
		cfg.started = started
		if c.Rank() != 0 {
			// Only rank 0 reports; every rank warns about its own files.
			stdout, stderr = io.Discard, io.Discard
			cfg.warn = os.Stderr
			rank0 = false
		}
		trainOne = func(cfg trainConfig, bar *progress) (*result, error) {
			res, err := trainRank(ctx, c, train, test, cfg, bar.update)
			if err != nil {
				return nil, fmt.Errorf("%s: rank %d: %w", cfg.optimizer, c.Rank(), err)
			}
			return res, nil
		}
		agree = func(yes bool) (bool, error) {
			b := []byte{0}
			if yes {
				b[0] = 1
			}
			if err := c.BroadcastBytes(ctx, b, 0); err != nil {
				return false, err
			}
			return b[0] != 0, nil
		}
	} else {
		workers = o.workers
		trainOne = func(cfg trainConfig, bar *progress) (*result, error) {
			var mu sync.Mutex
			var res0 *result
			err := local.Run(ctx, workers, func(ctx context.Context, c comm.Comm) error {
				var progress progressFunc
				if c.Rank() == 0 {
					progress = bar.update
				}
				res, err := trainRank(ctx, c, train, test, cfg, progress)
				if err == nil && c.Rank() == 0 {
					mu.Lock()
					res0 = res
					mu.Unlock()
				}
				return err
			}, localOpts(o.allowInprocess)...)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", cfg.optimizer, err)
			}
			return res0, nil
		}
		agree = func(yes bool) (bool, error) { return yes, nil }
	}
	printHeader(stdout, o, names, workers, train.len())
	// With -checkpoint, rank 0 keeps each finished optimizer's result in
	// DIR/OPT.result next to its checkpoints. A -resume reuses the results
	// of the optimizers that had finished (in -compare order), resumes the
	// first one that had not, and trains the ones after it from the start:
	// the interrupted run never reached them.
	resuming := o.checkpoint.resume
	if o.checkpoint.dir != "" && rank0 && !resuming {
		// A run from the start makes every older result stale, also those
		// of the optimizers it will not reach if it is interrupted.
		for _, name := range names {
			if err := removeResult(o.checkpoint.dir, name); err != nil {
				return err
			}
		}
	}
	if slices.Contains(names, diloco) && o.batch > 0 {
		// The outer optimizer does not know the run's length: this does.
		if w := o.outer.StepsWarning(o.epochs * (train.len() / o.batch)); w != "" {
			fmt.Fprintf(stderr, "mnist: warning: diloco: %s (-outer-h, -outer-fragments, -outer-delay; -epochs, -batch)\n", w)
		}
	}
	var results []*result
	for i, name := range names {
		cfg.optimizer = name
		var kept *result
		if o.checkpoint.dir != "" && rank0 {
			if resuming {
				if kept, err = loadResult(o.checkpoint.dir, cfg, workers); err != nil {
					fmt.Fprintf(stderr, "mnist: warning: -resume: %v: resuming %s from its checkpoints instead\n", err, name)
				}
			} else if o.checkpoint.resume {
				// After the resumed optimizer: trained from the start below
				// (a run without -resume removed every result above).
				if err := removeResult(o.checkpoint.dir, name); err != nil {
					return err
				}
			}
		}
		have, err := agree(kept != nil)
		if err != nil {
			return err
		}
		if have {
			if rank0 {
				fmt.Fprintf(stderr, "mnist: -resume: %s had finished: its result is kept from %s\n", name, resultPath(o.checkpoint.dir, name))
			}
			results = append(results, kept)
			continue
		}
		cfg.checkpoint.resume = resuming
		// A later optimizer of -compare that the interrupted run had not
		// saved a step of yet starts from the beginning.
		cfg.checkpoint.freshIfNone = resuming && i > 0
		res, err := trainOne(cfg, newProgress(stderr, name, o.epochs, o.quiet))
		if err != nil {
			return err
		}
		resuming = false
		if res.preempted > 0 { // on every rank alike
			if rank0 {
				results = append(results, res)
			}
			break
		}
		if !rank0 {
			continue
		}
		results = append(results, res)
		if o.checkpoint.dir != "" {
			if err := saveResult(o.checkpoint.dir, cfg, res); err != nil {
				return err
			}
		}
	}
	if !rank0 {
		return nil
	}

	if last := results[len(results)-1]; last.preempted > 0 {
		fmt.Fprintf(stdout, "%s preempted at step %d of %d: checkpoint saved in %s; continue with -resume\n",
			last.optimizer, last.preempted, last.steps, o.checkpoint.dir)
		return nil
	}
	printTable(stdout, results, o.target)
	if o.checkpoint.dir != "" {
		// The resume test compares these between runs.
		for _, r := range results {
			if r.resumedFrom > 0 {
				fmt.Fprintf(stdout, "%s resumed from step %d of %d\n", r.optimizer, r.resumedFrom, r.steps)
			}
			if r.resumedWorld > 0 && r.resumedWorld != r.workers {
				fmt.Fprintf(stdout, "%s resumed on %d ranks from a checkpoint of %d ranks: %s\n", r.optimizer, r.workers, r.resumedWorld, r.carried)
			}
			fmt.Fprintf(stdout, "%s final parameters: fnv64 %016x\n", r.optimizer, r.finalHash)
		}
	}
	if o.plot != "" {
		if err := writePlot(o.plot, results, o); err != nil {
			return fmt.Errorf("plot: %w", err)
		}
		if err := writeBytesPlot(bytesPlotPath(o.plot), results); err != nil {
			return fmt.Errorf("plot: %w", err)
		}
		fmt.Fprintf(stdout, "\nplot: %s, against bytes sent: %s\n", o.plot, bytesPlotPath(o.plot))
	}
	return nil
}

// localOpts are local.Run's options: -allow-inprocess-under-mpi lets it
// start in-process ranks in a rank of an MPI job, which it refuses by
// default.
func localOpts(allowUnderMPI bool) []local.Option {
	if allowUnderMPI {
		return []local.Option{local.AllowUnderMPI()}
	}
	return nil
}
