package main

import (
	"context"
	"errors"
	"fmt"
	"iter"
	"math"
	"os"
	"path/filepath"
	"time"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ui/commandline"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/timed"
	lbgomlx "github.com/lowbit-ml/lowbit/integrations/gomlx"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// evalPoint is one validation of a run.
type evalPoint struct {
	Step    int     `json:"step"`
	Tokens  int64   `json:"tokens"`
	TrainS  float64 `json:"train_s"` // training time so far, validations excluded
	ValLoss float64 `json:"val_loss"`
	// BytesSent is what a rank sent in the optimizer's Step so far (the
	// mean over the ranks of optim.Stats.BytesSent, the sent/rank column
	// at this step); a resumed run counts from its resume.
	BytesSent float64 `json:"bytes_sent_per_rank"`
	// LateLoss is the validation loss on the positions whose next byte is
	// one of -late-bytes (late.go), nil without them.
	LateLoss *float64 `json:"late_val_loss,omitempty"`
}

// result is one run, as every rank agrees on it (averaged over the ranks
// where they differ).
type result struct {
	spec      runSpec
	workers   int
	steps     int
	resumedAt int // the step a checkpoint resumed the run at, 0 for none
	tokens    int64
	// final is the final evaluation, over the whole validation text
	// (finalEval); valLoss is its loss, nats per byte, and curveLoss that
	// of the curve's last evaluation (-val-windows windows).
	final      finalResult
	valLoss    float64
	curveLoss  float64
	trainLoss  float64       // mean of the last tenth of the steps
	wall       time.Duration // training time: the steps, validations excluded
	commTime   time.Duration // in collectives during the steps
	bytes      float64       // sent per rank in the optimizer's Step, all steps
	lastBytes  float64       // in the last step
	skipped    int64
	evals      []evalPoint
	target     float64
	targetStep int
	targetTime time.Duration // training time to the first validation at or below target
	// outer holds diloco's outer statistics, nil for the other
	// optimizers.
	outer *outerResult
}

// outerResult is what a diloco run reports beyond the other runs.
type outerResult struct {
	exchanges, skipped int64
	// utilization is the compute utilization, averaged over the ranks:
	// the share of the optimizer's wall time not spent blocked on the
	// exchanges (outer.OuterStats.Utilization).
	utilization float64
}

// outerStatser is the outer optimizer's statistics (outer.Optimizer).
type outerStatser interface{ OuterStats() outer.OuterStats }

// reached reports whether the run reached the target validation loss.
func (r *result) reached() bool { return r.targetStep > 0 }

// modelParam is the store parameter that records the model's size.
const modelParam = "gpt_model"

// progressFunc reports a validation of a run as it happens (rank 0 only).
type progressFunc func(r runSpec, steps int, e evalPoint, trainLoss float64)

// batches is a train.Dataset: this rank's shard of the global batch of
// every step from start on (the batch of a step depends on the seed and
// the step only, so a resumed run reads what the uninterrupted one would).
type batches struct {
	b       *batcher
	context int
	start   int // the first step to yield, 1-based
}

func (d *batches) Name() string { return "gpt-train" }

func (d *batches) Iter() iter.Seq2[train.Batch, error] {
	return func(yield func(train.Batch, error) bool) {
		shard := d.b.hi - d.b.lo
		for step := d.start; ; step++ {
			x, y := d.b.next(step)
			xt := tensors.FromFlatDataAndDimensions(x, shard, d.context)
			yt := tensors.FromFlatDataAndDimensions(y, shard, d.context, 1)
			if !yield(train.Batch{Inputs: []*tensors.Tensor{xt}, Labels: []*tensors.Tensor{yt}}, nil) {
				return
			}
		}
	}
}

// trainRank is one rank's training run; every rank calls it together, with
// the same corpus and options (run has checked the corpus fills a batch).
// It is an ordinary GoMLX train.Loop: the lines marked lowbit are all that
// make it data-parallel.
func trainRank(ctx context.Context, c comm.Comm, r runSpec, o *options, data *corpus, progress progressFunc) (*result, error) {
	w, rank := c.Size(), c.Rank()
	if o.batch < w {
		return nil, fmt.Errorf("-batch %d is smaller than the %d ranks", o.batch, w)
	}
	// ops_sequential: GoMLX's parallel op scheduler shares one worker pool
	// per backend; with several ranks in one process each rank gets its
	// own backend and runs its ops in order (docs/gpt.md, "What the
	// transformer found").
	backend, err := gobackend.New("ops_sequential")
	if err != nil {
		return nil, err
	}
	defer backend.Finalize()
	store := model.NewStore()
	// Rank 0's seed decides the initial weights; the other ranks' differ on
	// purpose, and the Optimizer broadcasts rank 0's.
	store.RootScope().SetParam(model.ParamInitialSeed, int64(o.seed)+int64(rank))
	tc := timed.New(c)
	h := o.hyper()
	var opts []lbgomlx.Option
	if !o.quiet {
		opts = append(opts, lbgomlx.WithWarnings(os.Stderr)) // lowbit: print what a user must know
	}
	opt, err := lbgomlx.New(ctx, tc, func(ctx context.Context, c comm.Comm, params []*optim.Param) (optim.Optimizer, error) { // lowbit
		return newOptimizer(ctx, r, h, c, params)
	}, opts...)
	if err != nil {
		return nil, err
	}
	defer opt.Close()
	var ckpt *checkpoint.Handler
	if o.checkpoint != "" {
		// Each rank its own directory: the lowbit state is per rank.
		dir := filepath.Join(o.checkpoint, fmt.Sprintf("%s-rank-%d", r.dirName(), rank))
		// A collective: every rank resumes from the newest step all hold.
		// On another number of ranks than made the checkpoint it carries
		// the lowbit state over by the optimizer's way (RankChange).
		if ckpt, err = opt.Checkpoint(checkpoint.Build(store).Keep(2), dir); err != nil {
			return nil, fmt.Errorf("-checkpoint: %w", err)
		}
		if ch, ok := opt.RankChange(); ok && rank == 0 && o.out != nil {
			fmt.Fprintf(o.out, "%s: resumed on %d ranks from the checkpoint of step %d made on %d ranks: %s\n", r.label(), ch.ToRanks, ch.Step, ch.FromRanks, ch.Path)
			if ch.Checked != "" {
				fmt.Fprintf(o.out, "%s: %s\n", r.label(), ch.Checked)
			}
		}
	}
	// The model's size is a parameter of the store, saved with every
	// checkpoint: one of another size is refused here, before anything
	// is trained or written.
	if v, ok := store.RootScope().GetParam(modelParam); ok && v != o.model.String() {
		return nil, fmt.Errorf("-checkpoint %s holds a model of %v; this run asks for %s: name another -checkpoint directory or the same model size flags",
			o.checkpoint, v, o.model)
	}
	store.RootScope().SetParam(modelParam, o.model.String())
	trainer := train.NewTrainer(backend, store, logitsFn(o.model), loss.SparseCategoricalCrossEntropyLogits, opt, nil, nil)
	loop := train.NewLoop(trainer)
	opt.AttachToLoop(loop) // lowbit: the host step after every TrainStep
	loop.OnStep("gpt resume lr", lbgomlx.HookPriority-1, resumeLR(opt, r, o, rank))
	if o.progress && rank == 0 {
		commandline.AttachProgressBar(loop)
	}
	if ckpt != nil {
		// Every -checkpoint-every global steps and at the last one, so
		// that runs resume at the same steps whenever they were started.
		save := opt.SaveOnStepFn(ckpt) // lowbit: was ckpt.SaveOnStepFn
		loop.OnStep("checkpoint", 100, func(l *train.Loop, metrics []*tensors.Tensor) error {
			if step := l.LoopStep + 1; step%o.checkpointEvery == 0 || step == o.steps {
				return save(l, metrics)
			}
			return nil
		})
	}
	done := int(trainer.GlobalStep())
	if done > o.steps {
		return nil, fmt.Errorf("-checkpoint %s: the checkpoint is at step %d, past -steps %d", o.checkpoint, done, o.steps)
	}

	tokensPerStep := int64(o.batch) * int64(o.model.context)
	// The validation graph: the summed loss of this rank's windows.
	eval, err := model.NewExec(backend, store, sumLossFn(o.model))
	if err != nil {
		return nil, err
	}
	vx, vy, vn := valWindows(data.val, o.model.context, o.valWindows, rank, w)
	late, err := newLateEval(backend, store, o.model, data.late, vx, vy, vn) // nil without -late-bytes
	if err != nil {
		return nil, err
	}
	fin, err := newFinalEval(backend, store, o.model, data.val, o.finalWindows, rank, w)
	if err != nil {
		return nil, err
	}
	totalWindows := min(o.valWindows, len(data.val)-o.model.context)
	sums := make([]float32, 2)
	// validate evaluates this rank's variables; evaluate, below, the
	// model every rank agrees on. The same collective averages sent, the
	// bytes this rank sent so far, over the ranks.
	validate := func(sent float32) (loss, meanSent float64, err error) {
		sums[0], sums[1] = 0, sent
		if vn > 0 {
			out, err := eval.Exec(tensors.FromFlatDataAndDimensions(vx, vn, o.model.context),
				tensors.FromFlatDataAndDimensions(vy, vn, o.model.context, 1))
			if err != nil {
				return 0, 0, fmt.Errorf("validation: %w", err)
			}
			sums[0] = tensors.ToScalar[float32](out[0])
		}
		if err := c.AllReduce(ctx, sums, comm.Sum); err != nil {
			return 0, 0, err
		}
		return float64(sums[0]) / float64(totalWindows*o.model.context), float64(sums[1]) / float64(w), nil
	}
	// evaluate validates the model every rank agrees on: the variables
	// themselves, but for diloco, whose ranks' variables differ between
	// exchanges, its global parameters (lowbit: WithGlobalValues).
	evaluate := func(step int) (e evalPoint, err error) {
		e = evalPoint{Step: step, Tokens: int64(step) * tokensPerStep}
		var sent float32
		if lo := opt.Optimizer(); lo != nil { // nil before the first step
			sent = float32(lo.Stats().BytesSent)
		}
		err = opt.WithGlobalValues(func() error {
			var err error
			if e.ValLoss, e.BytesSent, err = validate(sent); err != nil {
				return err
			}
			e.LateLoss, err = late.loss(ctx, c)
			return err
		})
		return e, err
	}

	res := &result{spec: r, workers: w, steps: o.steps, target: o.target, resumedAt: done}
	evalEvery := o.evalEvery
	if evalEvery <= 0 {
		evalEvery = max(1, o.steps/20)
	}
	lastN := max(1, o.steps/10)
	var window []float64
	var evalTime time.Duration
	var start time.Time
	trainTime := func() time.Duration { return time.Since(start) - evalTime }
	recent := math.NaN()
	loop.OnStep("gpt validation", 200, func(l *train.Loop, metrics []*tensors.Tensor) error {
		step := l.LoopStep + 1 // the steps done, this one included
		if lv := float64(tensors.ToScalar[float32](metrics[0])); !math.IsNaN(lv) && !math.IsInf(lv, 0) {
			window = append(window, lv)
			if len(window) > lastN {
				window = window[1:]
			}
			recent = mean(window)
		}
		if step%evalEvery != 0 && step != o.steps {
			return nil
		}
		t0 := time.Now()
		tt := trainTime()
		e, err := evaluate(step)
		if err != nil {
			return err
		}
		e.TrainS = tt.Seconds()
		res.evals = append(res.evals, e)
		if !res.reached() && o.target > 0 && e.ValLoss <= o.target {
			res.targetStep, res.targetTime = step, tt
		}
		if progress != nil && rank == 0 {
			progress(r, o.steps, e, recent)
		}
		evalTime += time.Since(t0)
		if o.stopAtTarget && res.reached() {
			// Every rank sees the same validation loss (summed over
			// the ranks), so every rank stops at this step.
			res.steps = step
			return errStopAtTarget
		}
		return nil
	})
	start = time.Now()
	if done < o.steps {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if _, err := loop.RunToGlobalStep(&batches{b: data.batcher(o.model.context, o.batch, rank, w, o.seed, o.ownData()),
			context: o.model.context, start: done + 1}, o.steps); err != nil && !(o.stopAtTarget && res.reached()) {
			return nil, err
		}
	}
	wall := trainTime()
	if len(res.evals) == 0 {
		// Resumed at the last step: validate what the checkpoint holds
		// (for diloco this rank's own parameters, which are the global
		// ones when the last step was an exchange merged at once).
		e, err := evaluate(done)
		if err != nil {
			return nil, err
		}
		res.evals = append(res.evals, e)
	}
	// The final evaluation, of the model every rank agrees on (diloco's
	// global parameters), outside the training time.
	if err := opt.WithGlobalValues(func() error {
		var err error
		res.final, err = fin.eval(ctx, c)
		return err
	}); err != nil {
		return nil, err
	}
	var st optim.Stats
	var outs outer.OuterStats
	lo := opt.Optimizer()
	if lo != nil {
		st = lo.Stats()
	}
	ost, isOuter := lo.(outerStatser)
	if isOuter {
		outs = ost.OuterStats()
	}
	agg := []float32{float32(mean(window)), float32(wall.Seconds()), float32(tc.Elapsed().Seconds()), float32(st.BytesSent), float32(st.LastStepBytes),
		float32(outs.Utilization())}
	if err := c.AllReduce(ctx, agg, comm.Sum); err != nil {
		return nil, err
	}
	fw := float64(w)
	last := res.evals[len(res.evals)-1]
	res.valLoss, res.curveLoss = res.final.loss, last.ValLoss
	res.tokens = last.Tokens
	res.trainLoss = float64(agg[0]) / fw
	res.wall = time.Duration(float64(agg[1]) / fw * float64(time.Second))
	res.commTime = time.Duration(float64(agg[2]) / fw * float64(time.Second))
	res.bytes, res.lastBytes = float64(agg[3])/fw, float64(agg[4])/fw
	res.skipped = st.Skipped
	if isOuter {
		res.outer = &outerResult{exchanges: outs.Exchanges, skipped: outs.Skipped, utilization: float64(agg[5]) / fw}
	}
	return res, nil
}

// errStopAtTarget ends a run of -stop-at-target from its validation hook.
var errStopAtTarget = errors.New("gpt: the target validation loss is reached")

func mean(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}

// resumeLR returns the hook that applies the examples' learning-rate rule
// to a run resumed from a checkpoint, before its first lowbit step (it
// runs just before the lowbit hook, once the first training graph has
// loaded the state): Load restored the checkpoint's fixed learning rate,
// as PyTorch's load_state_dict does; -lr given on the command line wins and
// is set with SetLR. Muon has two: -muon-lr is its Muon group's (SetLR),
// -lr its AdamW group's (SetAdamLR), each with the same rule. Either way
// rank 0 prints which learning rates the run continues with and where
// they came from.
func resumeLR(opt *lbgomlx.Optimizer, r runSpec, o *options, rank int) train.OnStepFn {
	first := true
	return func(l *train.Loop, _ []*tensors.Tensor) error {
		if !first || !opt.Restored() {
			first = false
			return nil
		}
		first = false
		ls, ok := opt.Optimizer().(optim.LRSetter)
		if in, isWrapper := opt.Optimizer().(interface{ Inner() optim.Optimizer }); !ok && isWrapper {
			// A wrapping optimizer that is no optim.LRSetter itself:
			// its inner optimizer's learning rate.
			ls, ok = in.Inner().(optim.LRSetter)
		}
		if !ok {
			return fmt.Errorf("%s cannot change its learning rate (not an optim.LRSetter)", r.label())
		}
		h := o.hyper()
		var line string
		if a := adamGroup(opt.Optimizer()); a != nil {
			mu, err := resumeOne("muon lr", "-muon-lr", o.muonLRSet, h.muonLR, ls.LR, ls.SetLR)
			if err != nil {
				return err
			}
			ad, err := resumeOne("adam lr", "-lr", o.lrSet, h.lr, a.AdamLR, a.SetAdamLR)
			if err != nil {
				return err
			}
			line = mu + ", " + ad
		} else {
			var err error
			if line, err = resumeOne("lr", "-lr", o.lrSet, h.lr, ls.LR, ls.SetLR); err != nil {
				return err
			}
		}
		if rank == 0 && o.out != nil {
			fmt.Fprintf(o.out, "%s: resumed at step %d: %s\n", r.label(), l.LoopStep, line)
		}
		return nil
	}
}

// resumeOne applies the resume's rule to one learning rate, called name
// and set by flag: the flag's value lr when it was given (set), else the
// checkpoint's, which get returns; it says which.
func resumeOne(name, flag string, set bool, lr float32, get func() float32, put func(float32) error) (string, error) {
	if !set {
		return fmt.Sprintf("%s %v from the checkpoint", name, get()), nil
	}
	line := fmt.Sprintf("%s %v from %s (the checkpoint had %v)", name, lr, flag, get())
	if err := put(lr); err != nil {
		return "", fmt.Errorf("%s: %w", flag, err)
	}
	return line, nil
}

// adamGrouper is an optimizer with an auxiliary AdamW group of its own
// learning rate: Muon.
type adamGrouper interface {
	AdamLR() float32
	SetAdamLR(float32) error
}

// adamGroup returns opt, or the optimizer it wraps (Inner), as an
// adamGrouper; nil when neither is one.
func adamGroup(opt optim.Optimizer) adamGrouper {
	for opt != nil {
		if a, ok := opt.(adamGrouper); ok {
			return a
		}
		in, ok := opt.(interface{ Inner() optim.Optimizer })
		if !ok {
			return nil
		}
		opt = in.Inner()
	}
	return nil
}
