// Command mnist trains a GoMLX model on MNIST data-parallel with lowbit:
// a 784-128-10 perceptron built with GoMLX layers, run by GoMLX's pure-Go
// backend, its gradients averaged over the ranks by a lowbit optimizer
// through package github.com/lowbit-ml/lowbit/integrations/gomlx. It trains
// once per optimizer in -optimizers (default adam, then onebit-adam) from
// the same seed and prints a comparison.
//
// From integrations/gomlx, after "make mnist-data" at the repository root:
//
//	go run ./examples/mnist -workers 4
//
// With -backend mpi this process is one rank of an mpirun job:
//
//	go build -tags mpi -o mnist-gomlx ./examples/mnist
//	mpirun --allow-run-as-root --oversubscribe -np 4 ./mnist-gomlx -backend mpi
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"iter"
	"math/rand/v2"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/layers/activation"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ui/commandline"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/comm/mpi"
	"github.com/lowbit-ml/lowbit/examples/mnist/idx"
	lbgomlx "github.com/lowbit-ml/lowbit/integrations/gomlx"
	"github.com/lowbit-ml/lowbit/internal/cliflag"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/size"
)

const (
	pixels  = 28 * 28
	classes = 10
	// The pixel mean and standard deviation of the MNIST training set.
	pixelMean, pixelStd = 0.1307, 0.3081
)

type options struct {
	backend    string
	workers    int
	optimizers []string
	data       string
	steps      int
	batch      int
	lr         float64
	freezeStep int
	seed       uint64

	checkpoint      string // directory of the GoMLX checkpoints, "" for none
	checkpointEvery int
	progress        bool
	// allowInprocess is -allow-inprocess-under-mpi: -backend local even
	// where the environment says this process is one rank of an MPI job.
	allowInprocess bool
}

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{batch: 128}
	var opts string
	fs := flag.NewFlagSet("mnist", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.backend, "backend", "local", "local (goroutine ranks) or mpi (one rank of an mpirun job; build with -tags mpi)")
	fs.IntVar(&o.workers, "workers", 4, "in-process ranks (-backend local)")
	fs.BoolVar(&o.allowInprocess, "allow-inprocess-under-mpi", false, "run -backend local's in-process ranks even where the environment says this process is one rank of an MPI job (mpirun without -backend mpi): each of the job's processes then trains on its own")
	fs.StringVar(&opts, "optimizers", "adam,onebit-adam", "comma-separated lowbit optimizers to train with, one after the other: adam, onebit-adam")
	fs.StringVar(&o.data, "data", "../../data/mnist", "directory of the four MNIST IDX files")
	fs.IntVar(&o.steps, "steps", 600, "training steps")
	fs.Var(&size.CountValue[int]{P: &o.batch, Min: 1, Max: 1 << 20}, "batch", "global batch: `count` of examples, split over the ranks (128, 1k, 1Ki)")
	fs.Float64Var(&o.lr, "lr", 1e-3, "learning rate")
	fs.IntVar(&o.freezeStep, "freeze-step", 200, "exact warm-up steps of onebit-adam")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the shuffling and of rank 0's initial weights")
	fs.StringVar(&o.checkpoint, "checkpoint", "", "directory of GoMLX checkpoints (with the lowbit state), one subdirectory per optimizer and rank; a run resumes from what it holds")
	fs.IntVar(&o.checkpointEvery, "checkpoint-every", 100, "steps between checkpoints (with -checkpoint)")
	fs.BoolVar(&o.progress, "progress", false, "show GoMLX's progress bar (commandline.AttachProgressBar) on rank 0")
	if err := cliflag.Parse(fs, args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, cliflag.Usagef("unexpected arguments %q", fs.Args())
	}
	o.optimizers = strings.Split(opts, ",")
	for _, n := range o.optimizers {
		if n != "adam" && n != "onebit-adam" {
			return nil, cliflag.Bad(fs, "optimizers", "unknown optimizer %q (want adam, onebit-adam)", n)
		}
	}
	bad := func(name, format string, args ...any) (*options, error) {
		return nil, cliflag.Bad(fs, name, format, args...)
	}
	switch {
	case o.backend != "local" && o.backend != "mpi":
		return bad("backend", "want local or mpi")
	case o.workers < 1 || o.workers > 1024:
		return bad("workers", "want 1 to 1024")
	case o.steps < 1 || o.steps > 10_000_000:
		return bad("steps", "want 1 to 10000000")
	case o.freezeStep < 0 || o.freezeStep > 10_000_000:
		return bad("freeze-step", "want 0 to 10000000")
	case o.checkpointEvery < 1 || o.checkpointEvery > 10_000_000:
		return bad("checkpoint-every", "want 1 to 10000000")
	case !(o.lr > 0) || o.lr > 10:
		return bad("lr", "want a learning rate in (0, 10]")
	}
	return o, nil
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	switch {
	case err == nil || errors.Is(err, flag.ErrHelp):
	case cliflag.IsUsage(err):
		fmt.Fprintf(os.Stderr, "mnist: %v; see mnist -h\n", err)
		os.Exit(2)
	default:
		fmt.Fprintln(os.Stderr, "mnist:", err)
		os.Exit(1)
	}
}

// dataset is one MNIST split as model inputs: standardized pixels and
// int32 labels.
type dataset struct {
	x      []float32 // n*pixels
	labels []int32
}

func load(dir, images, labels string) (*dataset, error) {
	set, err := idx.Load(filepath.Join(dir, images), filepath.Join(dir, labels))
	if err != nil {
		return nil, fmt.Errorf("%w (run make mnist-data at the repository root, or pass -data DIR)", err)
	}
	if set.Images.Rows*set.Images.Cols != pixels || set.Len() == 0 {
		return nil, fmt.Errorf("%s: not 28 x 28 MNIST images", images)
	}
	d := &dataset{x: make([]float32, len(set.Images.Pixels)), labels: make([]int32, set.Len())}
	for i, p := range set.Images.Pixels {
		d.x[i] = (float32(p)/255 - pixelMean) / pixelStd
	}
	for i, l := range set.Labels {
		if l >= classes {
			return nil, fmt.Errorf("%s: label %d is not a digit", labels, l)
		}
		d.labels[i] = int32(l)
	}
	return d, nil
}

// rows returns the inputs and labels of the examples idx as tensors.
func (d *dataset) rows(idx []int) (x, y *tensors.Tensor) {
	xs := make([]float32, len(idx)*pixels)
	ys := make([]int32, len(idx))
	for i, j := range idx {
		copy(xs[i*pixels:], d.x[j*pixels:(j+1)*pixels])
		ys[i] = d.labels[j]
	}
	return tensors.FromFlatDataAndDimensions(xs, len(idx), pixels), tensors.FromFlatDataAndDimensions(ys, len(idx), 1)
}

// logits is the model: 784-128-10, ReLU.
func logits(scope *model.Scope, x *graph.Node) *graph.Node {
	h := activation.Relu(layers.DenseWithBias(scope.In("hidden"), x, 128))
	return layers.DenseWithBias(scope.In("out"), h, classes)
}

// newOptimizer is the lowbit optimizer called name.
func newOptimizer(name string, o *options) lbgomlx.Builder {
	return func(ctx context.Context, c comm.Comm, params []*optim.Param) (optim.Optimizer, error) {
		adam := optim.DefaultAdamConfig()
		adam.LR = float32(o.lr)
		if name == "adam" {
			return optim.NewAdam(ctx, c, params, adam)
		}
		cfg := onebit.DefaultAdamConfig()
		cfg.AdamConfig = adam
		cfg.FreezeStep = o.freezeStep
		return onebit.NewAdam(ctx, c, params, cfg)
	}
}

// shards is a train.Dataset: this rank's shard of every global batch of
// an endless shuffled pass over the training set, the same order on every
// rank.
type shards struct {
	data   *dataset
	lo, hi int // this rank's rows of a global batch
	batch  int
	seed   uint64
	skip   int // global batches to pass over first: the steps a resumed run has done
}

func (s *shards) Name() string { return "mnist-train" }

func (s *shards) Iter() iter.Seq2[train.Batch, error] {
	return func(yield func(train.Batch, error) bool) {
		perm := make([]int, len(s.data.labels))
		for i := range perm {
			perm[i] = i
		}
		rng := rand.New(rand.NewPCG(s.seed, 0)) // the same on every rank
		pos := len(perm)
		for step := 0; ; step++ {
			if pos+s.batch > len(perm) {
				rng.Shuffle(len(perm), func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
				pos = 0
			}
			if step < s.skip {
				pos += s.batch
				continue
			}
			x, y := s.data.rows(perm[pos+s.lo : pos+s.hi])
			pos += s.batch
			if !yield(train.Batch{Inputs: []*tensors.Tensor{x}, Labels: []*tensors.Tensor{y}}, nil) {
				return
			}
		}
	}
}

// result is one rank's report of one training run, averaged over the ranks.
type result struct {
	optimizer  string
	acc, loss  float64 // test accuracy, mean training loss of the last 50 steps
	wall       time.Duration
	bytes      float64 // mean bytes a rank sent in Step
	lastBytes  float64 // in the last step
	stage      optim.Stage
	skipped    int64
	workers    int
	trainCount int
	resumed    int64 // the global step the run resumed from, 0 for a fresh one
}

// trainRank is one rank's training run; every rank calls it together.
func trainRank(ctx context.Context, c comm.Comm, name string, o *options, trainSet, test *dataset) (*result, error) {
	w, rank := c.Size(), c.Rank()
	if o.batch < w || o.batch > len(trainSet.labels) {
		return nil, fmt.Errorf("-batch %d must be between the %d ranks and the %d training examples", o.batch, w, len(trainSet.labels))
	}
	backend, err := gobackend.New("")
	if err != nil {
		return nil, err
	}
	defer backend.Finalize()
	store := model.NewStore()
	// Rank 0's seed decides the initial weights; the other ranks' differ on
	// purpose, and the Optimizer broadcasts rank 0's.
	store.RootScope().SetParam(model.ParamInitialSeed, int64(o.seed)+int64(rank))

	// An ordinary GoMLX training loop; the lowbit lines are marked.
	opts := []lbgomlx.Option{lbgomlx.WithWarnings(os.Stderr)} // lowbit: print what a user must know
	if o.progress {
		opts = append(opts, lbgomlx.WithMeanMetrics()) // lowbit: the progress bar shows the mean loss over the ranks
	}
	opt, err := lbgomlx.New(ctx, c, newOptimizer(name, o), opts...) // lowbit: the optimizer
	if err != nil {
		return nil, err
	}
	defer opt.Close()
	var h *checkpoint.Handler
	if o.checkpoint != "" {
		// Each rank its own directory: the lowbit state is per rank. A
		// collective: every rank resumes from the newest step all hold.
		dir := filepath.Join(o.checkpoint, fmt.Sprintf("%s-rank-%d", name, rank))
		if h, err = opt.Checkpoint(checkpoint.Build(store).Keep(2), dir); err != nil { // lowbit: instead of Dir(dir)...Done()
			return nil, err
		}
	}
	trainer := train.NewTrainer(backend, store, logits, loss.SparseCategoricalCrossEntropyLogits, opt, nil, nil)
	resumed := trainer.GlobalStep() // the checkpoint's step: a resume
	loop := train.NewLoop(trainer)
	opt.AttachToLoop(loop) // lowbit: the host step after every TrainStep
	if o.progress && rank == 0 {
		commandline.AttachProgressBar(loop)
	}
	var last []float64
	loop.OnStep("last losses", 0, func(l *train.Loop, metrics []*tensors.Tensor) error {
		if o.steps-l.LoopStep <= 50 {
			last = append(last, float64(tensors.ToScalar[float32](metrics[0])))
		}
		return nil
	})
	if h != nil {
		train.EveryNSteps(loop, o.checkpointEvery, "checkpoint", 100, opt.SaveOnStepFn(h)) // lowbit: instead of h.SaveOnStepFn
	}
	ds := &shards{data: trainSet, lo: rank * o.batch / w, hi: (rank + 1) * o.batch / w, batch: o.batch, seed: o.seed,
		skip: int(trainer.GlobalStep())}
	start := time.Now()
	if _, err := loop.RunToGlobalStep(ds, o.steps); err != nil {
		return nil, err
	}
	wall := time.Since(start)
	if h != nil {
		// The last step: EveryNSteps saves it only if it is a multiple of
		// -checkpoint-every (Save then writes nothing more).
		if err := opt.Save(h); err != nil {
			return nil, err
		}
	}

	// Test accuracy: each rank scores its share of the test set with the
	// trained variables, through a GoMLX graph of its own.
	eval, err := model.NewExec(backend, store, func(scope *model.Scope, x, y *graph.Node) *graph.Node {
		pred := graph.ArgMax(logits(scope, x), -1, y.DType())
		right := graph.Equal(pred, graph.Reshape(y, y.Shape().Dimensions[0]))
		return graph.ReduceAllSum(graph.ConvertDType(right, pred.DType()))
	})
	if err != nil {
		return nil, err
	}
	tlo, thi := rank*len(test.labels)/w, (rank+1)*len(test.labels)/w
	var correct int32
	if thi > tlo {
		ix := make([]int, thi-tlo)
		for i := range ix {
			ix[i] = tlo + i
		}
		out, err := eval.Exec(test.rows(ix))
		if err != nil {
			return nil, err
		}
		correct = tensors.ToScalar[int32](out[0])
	}
	var lastLoss float64
	for _, l := range last {
		lastLoss += l / float64(len(last))
	}
	st := opt.Optimizer().Stats()
	sums := []float32{float32(correct), float32(lastLoss), float32(wall.Seconds()), float32(st.BytesSent), float32(st.LastStepBytes)}
	if err := c.AllReduce(ctx, sums, comm.Sum); err != nil {
		return nil, err
	}
	fw := float64(w)
	return &result{
		optimizer: name, workers: w, trainCount: len(trainSet.labels),
		acc: float64(sums[0]) / float64(len(test.labels)), loss: float64(sums[1]) / fw,
		wall: time.Duration(float64(sums[2]) / fw * float64(time.Second)), bytes: float64(sums[3]) / fw,
		lastBytes: float64(sums[4]) / fw, stage: st.Stage, skipped: st.Skipped, resumed: resumed,
	}, nil
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	if o.backend == "local" && !o.allowInprocess {
		if err := local.CheckNotUnderMPI(); err != nil {
			return fmt.Errorf("-backend local: %w; give -backend mpi (a binary built with -tags mpi), or -allow-inprocess-under-mpi to run in-process ranks anyway", err)
		}
	}
	train, err := load(o.data, "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz")
	if err != nil {
		return fmt.Errorf("training set: %w", err)
	}
	test, err := load(o.data, "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
	if err != nil {
		return fmt.Errorf("test set: %w", err)
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
		for _, name := range o.optimizers {
			r, err := trainRank(ctx, c, name, o, train, test)
			if err != nil {
				return fmt.Errorf("%s: rank %d: %w", name, c.Rank(), err)
			}
			results = append(results, r)
		}
	} else {
		for _, name := range o.optimizers {
			var mu sync.Mutex
			var r0 *result
			err := local.Run(ctx, o.workers, func(ctx context.Context, c comm.Comm) error {
				r, err := trainRank(ctx, c, name, o, train, test)
				if err == nil && c.Rank() == 0 {
					mu.Lock()
					r0 = r
					mu.Unlock()
				}
				return err
			}, localOpts(o.allowInprocess)...)
			if err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			results = append(results, r0)
		}
	}
	report(stdout, o, results)
	return nil
}

func report(w io.Writer, o *options, results []*result) {
	r0 := results[0]
	for _, r := range results {
		if r.resumed > 0 {
			fmt.Fprintf(w, "%s: resumed from global step %d (%s)\n", r.optimizer, r.resumed, o.checkpoint)
		}
	}
	fmt.Fprintf(w, "GoMLX MNIST 784-128-10 on %d %s ranks (GoMLX pure-Go backend), %d training examples, global batch %d, %d steps, lr %g, freeze step %d\n",
		r0.workers, o.backend, r0.trainCount, o.batch, o.steps, o.lr, o.freezeStep)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "optimizer\ttest acc\ttrain loss\twall\tsent/rank\tlast step\tstage\tskipped\t")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%.1f%%\t%.4f\t%.1fs\t%s\t%s\t%s\t%d\t\n", r.optimizer, 100*r.acc, r.loss,
			r.wall.Seconds(), kb(r.bytes), kb(r.lastBytes), r.stage, r.skipped)
	}
	tw.Flush()
	if len(results) == 2 && results[1].bytes > 0 {
		fmt.Fprintf(w, "%s vs %s: %.1fx fewer bytes sent, %.1fx fewer in the last step, test accuracy %+.1f points\n",
			results[1].optimizer, results[0].optimizer, results[0].bytes/results[1].bytes,
			results[0].lastBytes/results[1].lastBytes, 100*(results[1].acc-results[0].acc))
	}
}

// kb formats a byte count in kB or MB.
func kb(b float64) string {
	if b >= 1e6 {
		return fmt.Sprintf("%.1f MB", b/1e6)
	}
	return fmt.Sprintf("%.1f kB", b/1e3)
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
