package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/timed"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// trainConfig is what one training run needs besides the data.
type trainConfig struct {
	optimizer     string
	hyper         hyper
	epochs        int
	batch         int // global batch size, split over the ranks
	seed          uint64
	evalsPerEpoch int // test-set evaluations per epoch, for the curves
	checkpoint    checkpointConfig
	// lrSet is whether -lr was given on the command line: a resumed run
	// then continues with hyper.lr, otherwise with the checkpoint's
	// learning rate (see resumeLR).
	lrSet bool
	// muonLRSet is the same for -muon-lr (hyper.muonLR), muon's Muon
	// group's learning rate.
	muonLRSet bool
	// stop, when not nil, is asked at every step boundary of a run with
	// -checkpoint (but the one it starts at and the last) whether this
	// process was asked to stop (SIGTERM, SIGINT). The ranks agree on it in
	// the next step's agreement (any rank's yes stops all at the same
	// step), save a checkpoint of that step and return a preempted result.
	stop func(rank, step int) bool
	// resumed, when not nil, is called on every rank right after -resume
	// loaded a checkpoint into opt, before the first step (testing).
	resumed func(rank int, opt optim.Optimizer)
	// warn receives the warnings of this rank (a corrupt checkpoint, a
	// fall-back, a resume on another number of ranks); nil discards them.
	warn io.Writer
	// started are the times the command started, had read the data and
	// had its communicator (zero when not measured): the line of the first
	// step of a run with -checkpoint says how long each part took.
	started startup
}

// startup is when the command's parts before training ended.
type startup struct{ start, data, comm time.Time }

// since says, for the line of the first step, how long each part took from
// the command's start: the data, the communicator, the optimizer's build
// and resume, the first step.
func (s startup) since(resumed, now time.Time) string {
	if s.start.IsZero() {
		return ""
	}
	sec := func(a, b time.Time) float64 { return b.Sub(a).Seconds() }
	return fmt.Sprintf(" (%.2f s from the command's start: data %.2f s, communicator %.2f s, model and -resume %.2f s, first step %.2f s)",
		sec(s.start, now), sec(s.start, s.data), sec(s.data, s.comm), sec(s.comm, resumed), sec(resumed, now))
}

// evalPoint is one evaluation on the test set.
type evalPoint struct {
	step int           // optimizer steps taken before it
	wall time.Duration // training time until then (evaluations excluded)
	acc  float64       // test accuracy in [0, 1]
	loss float64       // mean test loss
	// bytes is what a rank sent in the optimizer's Step until then, the
	// mean over the ranks of optim.Stats.BytesSent, across resumes; -1
	// when unknown (from a checkpoint or result made before it was kept).
	bytes float64
}

// result is what one training run reports; every rank gets the same.
type result struct {
	optimizer string
	workers   int
	steps     int
	testSize  int // examples in the test set
	stage     optim.Stage
	skipped   int64
	trainLoss float64 // mean training loss over the last epoch
	test      evalPoint
	// Per-rank means: training wall time, and inside it the time in
	// forward/backward, in collectives during Step, and in the rest of
	// Step (compression and the update).
	wall, compute, comm, compress time.Duration
	bytesSent                     float64   // per-rank mean of optimizer Stats.BytesSent
	lastStepBytes                 float64   // per-rank mean of Stats.LastStepBytes
	loss                          []float64 // mean training loss of every step's global batch
	evals                         []evalPoint
	// Hashes of this rank's parameters before the first and after the last
	// step; training checks that they agree across ranks.
	initHash, finalHash uint64
	resumedFrom         int // the checkpoint step -resume continued from, 0 for none
	// resumedWorld is the number of ranks that made the checkpoint -resume
	// continued from (0 for none).
	resumedWorld int
	// carried says how that resume carried the state over from another
	// number of ranks (carry.String); "" for none.
	carried string
	// preempted is the step after which the run stopped on request (stop),
	// with its checkpoint saved; 0 for a run that finished. A preempted
	// result holds nothing else.
	preempted int
	// utilization is diloco's compute utilization (outer.OuterStats),
	// the mean over the ranks; 0 for the other optimizers.
	utilization float64
}

// errStopRequested is the Veto of a step that some rank was asked to stop
// before: Step returns it on every rank with nothing changed.
var errStopRequested = errors.New("mnist: stop requested")

// progressFunc is told about every step of a run (on rank 0 only): the
// epoch, the step in it, the mean loss of this rank's shards in the epoch so
// far and the latest evaluation.
type progressFunc func(epoch, step, stepsPerEpoch int, loss float64, last *evalPoint)

// shard returns the bounds of rank r's share of n items over w ranks.
func shard(n, w, r int) (lo, hi int) { return r * n / w, (r + 1) * n / w }

// trainRank is one rank's part of a data-parallel training run: every rank
// of c calls it with the same arguments. Each global batch of cfg.batch
// examples is cut into one shard per rank; a rank computes the gradient of
// its shard's summed loss scaled by W/batch, so that the average over the
// ranks that the optimizer takes is the gradient of the global batch's mean
// loss.
func trainRank(ctx context.Context, c comm.Comm, train, test *dataset, cfg trainConfig, progress progressFunc) (res *result, err error) {
	w, rank := c.Size(), c.Rank()
	if cfg.batch < w {
		return nil, fmt.Errorf("batch %d is smaller than the %d workers", cfg.batch, w)
	}
	stepsPerEpoch := train.len() / cfg.batch
	if stepsPerEpoch == 0 {
		return nil, fmt.Errorf("batch %d is larger than the %d training examples", cfg.batch, train.len())
	}
	if cfg.epochs < 1 {
		return nil, fmt.Errorf("epochs must be at least 1, got %d", cfg.epochs)
	}
	lo, hi := shard(cfg.batch, w, rank)
	model := newMLP(cfg.seed, hi-lo)
	initHash, same, err := paramsHash(ctx, c, model.params())
	if err != nil {
		return nil, err
	}
	if !same {
		return nil, errors.New("ranks start from different parameters")
	}
	tc := timed.New(c)
	opt, err := newOptimizer(ctx, cfg.optimizer, tc, model.params(), cfg.hyper)
	if err != nil {
		return nil, err
	}
	defer func() {
		// Every rank releases what the optimizer split off the group
		// (not a collective).
		if cerr := opt.Close(); cerr != nil && err == nil {
			res, err = nil, fmt.Errorf("closing the optimizer: %w", cerr)
		}
	}()

	total := cfg.epochs * stepsPerEpoch
	evalEvery := max(1, stepsPerEpoch/max(1, cfg.evalsPerEpoch))
	res = &result{optimizer: cfg.optimizer, workers: w, steps: total, testSize: test.len(), initHash: initHash}
	lossHist := make([]float32, total)
	scale := float32(w) / float32(cfg.batch)
	labels := make([]byte, hi-lo)
	evalIdx := make([]int, 250)
	tlo, thi := shard(test.len(), w, rank)

	var evalTime, computeTime, stepTime time.Duration
	// before is the training time of the runs this one resumed from.
	var before time.Duration
	start := time.Now()
	elapsed := func() time.Duration { return before + time.Since(start) - evalTime }
	// An optimizer whose ranks run apart between exchanges (diloco) is
	// evaluated on the parameters every rank agrees on, its global ones.
	global, apart := opt.(interface{ Global() []float32 })
	var local []float32 // the rank's own parameters while the global ones are evaluated
	// sentBefore is what this rank had sent in Step when the checkpoint
	// this run resumed from was made (-1: unknown): the optimizer's Stats
	// count from the resume. sent is what it has sent until now.
	var sentBefore int64
	sent := func() int64 {
		if sentBefore < 0 {
			return -1
		}
		return sentBefore + opt.Stats().BytesSent
	}
	evaluate := func(step int) error {
		t0 := time.Now()
		if apart {
			local = flatParams(local, model.params())
			setParams(model.params(), global.Global())
		}
		correct, loss := model.evaluate(test, tlo, thi, evalIdx)
		if apart {
			setParams(model.params(), local)
		}
		// The bytes of every rank, and how many ranks do not know theirs.
		buf := []float32{float32(correct), float32(loss), float32(max(sent(), 0)), float32(min(sent(), 0))}
		if err := c.AllReduce(ctx, buf, comm.Sum); err != nil {
			return err
		}
		n := float64(test.len())
		bytes := float64(buf[2]) / float64(w)
		if buf[3] < 0 {
			bytes = -1
		}
		res.evals = append(res.evals, evalPoint{
			step:  step,
			wall:  elapsed(),
			acc:   float64(buf[0]) / n,
			loss:  float64(buf[1]) / n,
			bytes: bytes,
		})
		evalTime += time.Since(t0)
		return nil
	}
	ckpt := newCheckpointer(cfg, rank, w)
	warn := cfg.warn
	if warn == nil {
		warn = io.Discard
	}
	step := 0
	back, err := ckpt.restore(ctx, c, opt, total, warn)
	restoredAt := time.Now()
	if err != nil {
		return nil, err
	}
	if back != nil {
		step = back.step
		res.resumedFrom, res.resumedWorld, res.carried = back.step, back.fromWorld, back.carried.String()
		copy(lossHist, back.lossHist)
		res.evals = back.evals
		sentBefore = back.sent
		before = back.elapsed
		ckpt.gen, ckpt.run = back.gen, back.run
		line, err := resumeLR(opt, back, cfg.hyper.lr, cfg.lrSet)
		if err != nil {
			return nil, err
		}
		if m := muonOf(opt); m != nil {
			ml, err := resumeMuonLR(m, cfg.hyper.muonLR, cfg.muonLRSet)
			if err != nil {
				return nil, err
			}
			line += ", " + ml
		}
		if rank == 0 {
			fmt.Fprintf(warn, "mnist: -resume: %s: %s\n", cfg.optimizer, line)
		}
		if opt.Stats().Stage == optim.StagePhaseB {
			// 0/1 Adam's local steps: say whether the run resumes between
			// two synchronizations (the ranks' parameters then differ).
			if _, same, err := paramsHash(ctx, c, model.params()); err != nil {
				return nil, err
			} else if !same && rank == 0 {
				fmt.Fprintf(warn, "mnist: -resume: %s continues between two synchronizations (local steps: the ranks' parameters differ)\n", cfg.optimizer)
			}
		}
		if cfg.resumed != nil {
			cfg.resumed(rank, opt)
		}
	}
	// The stop request rides in every Step's own agreement (the optimizer's
	// per-step allreduce, optim.StepFlags): one latency-bound collective
	// per step, not two. A rank asked to stop at the boundary after step s
	// says so in step s+1's agreement; the Veto then refuses step s+1 on
	// every rank alike, before anything changes, and every rank saves the
	// state after step s.
	var flags *optim.StepFlags
	if ckpt != nil && cfg.stop != nil {
		fc, ok := opt.(optim.FlagCarrier)
		if !ok {
			return nil, fmt.Errorf("%s cannot carry the stop request in its step agreement (not an optim.FlagCarrier)", cfg.optimizer)
		}
		flags = &optim.StepFlags{Local: []float32{0}, Veto: func(agreed []float32) error {
			if agreed[0] != 0 {
				return errStopRequested
			}
			return nil
		}}
		if err := fc.CarryFlags(flags); err != nil {
			return nil, fmt.Errorf("carrying the stop request: %w", err)
		}
	}
	if ckpt != nil && ckpt.run == 0 {
		// A run from step 0 (or from files made before run identities):
		// a new identity, the same on every rank.
		if ckpt.run, err = drawRun(ctx, c); err != nil {
			return nil, err
		}
	}
	first := step // the boundary this run starts at: no stop is asked there
	savedAt := -1 // the step of this run's last save
	if step == 0 {
		if err := evaluate(0); err != nil {
			return nil, err
		}
	}

	perm := make([]int, train.len())
	for i := range perm {
		perm[i] = i
	}
	for epoch := range cfg.epochs {
		// The same permutation on every rank: the seed and the epoch decide it.
		rng := rand.New(rand.NewPCG(cfg.seed, uint64(epoch)+1))
		rng.Shuffle(len(perm), func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
		var epochLoss float64
		for s := range stepsPerEpoch {
			if epoch*stepsPerEpoch+s < step {
				// Done before the checkpoint this run resumed from.
				epochLoss += float64(lossHist[epoch*stepsPerEpoch+s])
				continue
			}
			idx := perm[s*cfg.batch+lo : s*cfg.batch+hi]
			for i, j := range idx {
				labels[i] = train.labels[j]
			}
			if flags != nil {
				flags.Local[0] = 0
				if step > first && cfg.stop(rank, step) {
					flags.Local[0] = 1
				}
			}
			t0 := time.Now()
			n := model.load(train, idx)
			loss := model.lossGrad(n, labels, scale)
			t1 := time.Now()
			if err := opt.Step(ctx); errors.Is(err, errStopRequested) {
				// Every rank refused step+1 alike: stop after step.
				if savedAt != step {
					if err := ckpt.save(ctx, c, opt, step, total, lossHist, res.evals, elapsed(), sent()); err != nil {
						return nil, err
					}
				}
				// Every rank's file is on disk before any rank reports.
				if err := c.Barrier(ctx); err != nil {
					return nil, err
				}
				return &result{optimizer: cfg.optimizer, workers: w, steps: total, preempted: step}, nil
			} else if err != nil {
				return nil, fmt.Errorf("step %d: %w", step+1, err)
			}
			computeTime += t1.Sub(t0)
			stepTime += time.Since(t1)
			lossHist[step] = float32(loss) * scale
			epochLoss += float64(lossHist[step])
			step++
			if step == first+1 && ckpt != nil && rank == 0 {
				// When the run's first step is done, in wall-clock time:
				// scripts/soak-elastic.sh measures the time from an
				// interruption to the first new step (restart, load,
				// regroup) with it.
				now := time.Now()
				fmt.Fprintf(warn, "mnist: first step %d at %d%s\n", step, now.UnixNano(), cfg.started.since(restoredAt, now))
			}
			if step%evalEvery == 0 || step == total {
				if err := evaluate(step); err != nil {
					return nil, err
				}
			}
			if ckpt.due(step, total) {
				if err := ckpt.save(ctx, c, opt, step, total, lossHist, res.evals, elapsed(), sent()); err != nil {
					return nil, err
				}
				savedAt = step
			}
			if progress != nil {
				progress(epoch, s+1, stepsPerEpoch, epochLoss/float64(s+1), &res.evals[len(res.evals)-1])
			}
		}
	}
	wall := time.Since(start) - evalTime // this run's part only
	if err := model.checkParams(); err != nil {
		return nil, err
	}
	finalHash, same, err := paramsHash(ctx, c, model.params())
	if err != nil {
		return nil, err
	}
	// 0/1 Adam's local steps and diloco's inner steps leave the ranks apart
	// between synchronizations; every other optimizer keeps them identical
	// after every step.
	if !same && opt.Stats().Stage != optim.StagePhaseB && !apart {
		return nil, errors.New("ranks' parameters diverged")
	}

	// Average the per-step losses and the timings over the ranks.
	if err := c.AllReduce(ctx, lossHist, comm.Mean); err != nil {
		return nil, err
	}
	st := opt.Stats()
	commTime := tc.Elapsed()
	var util float32
	if od, ok := opt.(*outer.Optimizer); ok {
		// diloco's exchanges run between Steps too: its comm is the time
		// Step was blocked on them.
		os := od.OuterStats()
		commTime, util = os.Exchange, float32(os.Utilization())
	}
	sums := []float32{
		float32(wall.Seconds()), float32(computeTime.Seconds()),
		float32(commTime.Seconds()), float32((stepTime - commTime).Seconds()),
		float32(st.BytesSent), float32(st.LastStepBytes), util,
	}
	if err := c.AllReduce(ctx, sums, comm.Mean); err != nil {
		return nil, err
	}
	sec := func(x float32) time.Duration { return time.Duration(float64(x) * float64(time.Second)) }
	res.wall, res.compute, res.comm, res.compress = sec(sums[0]), sec(sums[1]), sec(sums[2]), sec(sums[3])
	res.bytesSent, res.lastStepBytes = float64(sums[4]), float64(sums[5])
	res.utilization = float64(sums[6])
	res.stage, res.skipped = st.Stage, st.Skipped
	res.loss = make([]float64, total)
	for i, v := range lossHist {
		res.loss[i] = float64(v)
	}
	var last float64
	for _, v := range res.loss[total-stepsPerEpoch:] {
		last += v
	}
	res.trainLoss = last / float64(stepsPerEpoch)
	res.test = res.evals[len(res.evals)-1]
	res.finalHash = finalHash
	return res, nil
}

// drawRun returns a run identity (ckptRun) rank 0 draws, on every rank:
// a random non-zero number.
func drawRun(ctx context.Context, c comm.Comm) (int64, error) {
	b := make([]byte, 8)
	if c.Rank() == 0 {
		binary.LittleEndian.PutUint64(b, rand.Uint64()>>1|1)
	}
	if err := c.BroadcastBytes(ctx, b, 0); err != nil {
		return 0, fmt.Errorf("agreeing on the run's identity: %w", err)
	}
	return int64(binary.LittleEndian.Uint64(b)), nil
}

// paramsHash returns a hash of this rank's parameters and whether every rank
// holds bit-identical ones.
func paramsHash(ctx context.Context, c comm.Comm, params []*optim.Param) (hash uint64, same bool, err error) {
	h := fnv.New64a()
	var b [4]byte
	for _, p := range params {
		for _, v := range p.Data() {
			binary.LittleEndian.PutUint32(b[:], math.Float32bits(v))
			h.Write(b[:])
		}
	}
	mine := make([]byte, 8)
	binary.LittleEndian.PutUint64(mine, h.Sum64())
	all := make([]byte, 8*c.Size())
	if err := c.AllGatherBytes(ctx, mine, all); err != nil {
		return 0, false, err
	}
	for r := range c.Size() {
		if string(all[8*r:8*r+8]) != string(mine) {
			return h.Sum64(), false, nil
		}
	}
	return h.Sum64(), true, nil
}

// flatParams returns the values of params, in order, in dst (grown to
// fit).
func flatParams(dst []float32, params []*optim.Param) []float32 {
	dst = dst[:0]
	for _, p := range params {
		dst = append(dst, p.Data()...)
	}
	return dst
}

// setParams copies the flat values from into params, in order.
func setParams(params []*optim.Param, from []float32) {
	off := 0
	for _, p := range params {
		off += copy(p.Data(), from[off:])
	}
}
