package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"strings"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// checkpointConfig is what -checkpoint, -checkpoint-every, -resume and
// -kill-at ask for. The zero value checkpoints nothing.
type checkpointConfig struct {
	dir    string // "" for no checkpoints
	every  int    // save after every this many steps (and after the last)
	resume bool   // continue from the newest checkpoint every rank holds
	// killAt, when positive, makes every rank kill its own process with
	// SIGKILL right after the checkpoint of step killAt is on disk on every
	// rank: the crash the resume test recovers from.
	killAt int
}

// Names of what the example stores in an optimizer checkpoint besides the
// optimizer's own state. They are removed before the optimizer sees it.
const (
	ckptPrefix    = "mnist/"
	ckptStep      = ckptPrefix + "step"  // steps done
	ckptLoss      = ckptPrefix + "loss"  // per-step training loss so far
	ckptEvals     = ckptPrefix + "evals" // (step, acc, loss) of each evaluation
	ckptTotal     = ckptPrefix + "total" // steps of the whole run
	ckptSetting   = ckptPrefix + "flag"  // + a flag's name: its value (see settings)
	ckptEvalWidth = 3
)

// checkpointer saves and restores one rank's training state: the optimizer's
// checkpoint (parameters, moments, error buffers, counters) plus the step,
// the loss history and the evaluations. Each rank writes two files in turn,
// DIR/OPT.rankR.0.ckpt and DIR/OPT.rankR.1.ckpt, each atomically
// (optim.SaveFile), so that a crash during a save leaves the previous one
// intact on every rank, and resuming picks the newest step that every rank
// holds.
type checkpointer struct {
	cfg      checkpointConfig
	name     string // optimizer name
	rank     int
	settings []setting
}

// setting is one flag that decides the training trajectory, as a checkpoint
// records it: a run resumes only from checkpoints made with the same flags.
type setting struct {
	flag  string
	value int64  // as stored
	show  string // as the user wrote it
}

// settings lists the flags besides -optimizer (in the file name) and
// -epochs (the run's step count, checked apart) that a resumed run must
// share with the run that saved the checkpoint.
func settings(cfg trainConfig, world int) []setting {
	h := cfg.hyper
	return []setting{
		{"-workers", int64(world), fmt.Sprint(world)},
		{"-batch", int64(cfg.batch), fmt.Sprint(cfg.batch)},
		{"-seed", int64(cfg.seed), fmt.Sprint(cfg.seed)},
		{"-lr", int64(math.Float32bits(h.lr)), fmt.Sprint(h.lr)},
		{"-freeze-step", int64(h.freezeStep), fmt.Sprint(h.freezeStep)},
		{"-reduce", int64(h.reduce), h.reduce.String()},
		{"-reduce (zero-adam)", int64(h.scatter), h.scatter.String()},
		{"-evals", int64(cfg.evalsPerEpoch), fmt.Sprint(cfg.evalsPerEpoch)},
	}
}

// newCheckpointer returns rank's checkpointer of the run cfg on world
// ranks, nil when cfg asks for no checkpoints.
func newCheckpointer(cfg trainConfig, rank, world int) *checkpointer {
	if cfg.checkpoint.dir == "" {
		return nil
	}
	return &checkpointer{cfg: cfg.checkpoint, name: cfg.optimizer, rank: rank, settings: settings(cfg, world)}
}

// mismatch describes the first setting of ck that differs from this run's,
// "" when all agree.
func (k *checkpointer) mismatch(ck *optim.Checkpoint) string {
	for _, s := range k.settings {
		v, err := ck.Int(ckptSetting + s.flag)
		if err != nil {
			return fmt.Sprintf("records no %s", s.flag)
		}
		if v != s.value {
			return fmt.Sprintf("made by a run with other flags: %s differs (this run has %s %s)", s.flag, s.flag, s.show)
		}
	}
	return ""
}

func (k *checkpointer) path(slot int) string {
	return filepath.Join(k.cfg.dir, fmt.Sprintf("%s.rank%d.%d.ckpt", k.name, k.rank, slot))
}

// due reports whether the state after step (1-based) is to be saved.
func (k *checkpointer) due(step, total int) bool {
	return k != nil && (step%k.cfg.every == 0 || step == total)
}

// save writes the state after step to the older of the two files, then,
// if step is the -kill-at step, waits until every rank has saved and kills
// this process.
func (k *checkpointer) save(ctx context.Context, c comm.Comm, opt optim.Optimizer, step, total int, lossHist []float32, evals []evalPoint) error {
	ck, err := opt.State()
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	ck.Ints[ckptStep] = int64(step)
	ck.Ints[ckptTotal] = int64(total)
	for _, s := range k.settings {
		ck.Ints[ckptSetting+s.flag] = s.value
	}
	ck.AddTensor(ckptLoss, []int{step}, lossHist[:step])
	ev := make([]float32, 0, ckptEvalWidth*len(evals))
	for _, e := range evals {
		ev = append(ev, float32(e.step), float32(e.acc), float32(e.loss))
	}
	ck.AddTensor(ckptEvals, []int{len(evals), ckptEvalWidth}, ev)
	if err := os.MkdirAll(k.cfg.dir, 0o755); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	// Alternate between the slots by step, so that a resumed run goes on
	// overwriting the older file.
	slot := (step / k.cfg.every) % 2
	if step%k.cfg.every != 0 {
		slot = 1 - (step/k.cfg.every)%2 // the final, off-grid save
	}
	if err := optim.SaveFile(k.path(slot), ck); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	if k.cfg.killAt > 0 && step == k.cfg.killAt {
		// Every rank's file is on disk before any process dies.
		if err := c.Barrier(ctx); err != nil {
			return err
		}
		p, err := os.FindProcess(os.Getpid())
		if err == nil {
			err = p.Kill()
		}
		return fmt.Errorf("-kill-at %d: could not kill the process: %v", step, err)
	}
	return nil
}

// restored is the training state a checkpoint gives back.
type restored struct {
	step     int
	lossHist []float32
	evals    []evalPoint
}

// restore loads, on every rank, the newest checkpoint step that every rank
// holds, into opt; it returns nil when -resume is off. Every rank calls it
// together. Ranks that disagree (one has no checkpoint, another has) get
// the same error.
func (k *checkpointer) restore(ctx context.Context, c comm.Comm, opt optim.Optimizer, total int) (*restored, error) {
	if k == nil || !k.cfg.resume {
		return nil, nil
	}
	// Read both slots; a missing or damaged file is just not a candidate.
	var cks [2]*optim.Checkpoint
	var steps [2]int64
	var problems []string
	for slot := range 2 {
		steps[slot] = -1
		ck, err := optim.LoadFile(k.path(slot))
		if err != nil {
			if !errors.Is(err, fs.ErrNotExist) {
				problems = append(problems, err.Error())
			}
			continue
		}
		s, err := ck.Int(ckptStep)
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", k.path(slot), err))
			continue
		}
		if tt, err := ck.Int(ckptTotal); err != nil || tt != int64(total) {
			problems = append(problems, fmt.Sprintf("%s: made for a run of %d steps, this run has %d", k.path(slot), tt, total))
			continue
		}
		if m := k.mismatch(ck); m != "" {
			problems = append(problems, fmt.Sprintf("%s: %s", k.path(slot), m))
			continue
		}
		cks[slot], steps[slot] = ck, s
	}
	// The newest step every rank holds: the minimum over the ranks of each
	// rank's newest, which every rank must then hold too.
	newest := max(steps[0], steps[1])
	agree := []float32{-float32(newest)} // Max of -newest is -min
	if err := c.AllReduce(ctx, agree, comm.Max); err != nil {
		return nil, err
	}
	common := int64(-agree[0])
	slot := -1
	for s := range 2 {
		if cks[s] != nil && steps[s] == common {
			slot = s
		}
	}
	missing := []float32{0}
	if slot < 0 {
		missing[0] = 1
	}
	if err := c.AllReduce(ctx, missing, comm.Max); err != nil {
		return nil, err
	}
	if missing[0] != 0 {
		msg := fmt.Sprintf("-resume: no checkpoint of %s in %s that every rank holds (this rank holds steps %v)", k.name, k.cfg.dir, holds(steps))
		if len(problems) > 0 {
			msg += ": " + strings.Join(problems, "; ")
		}
		return nil, errors.New(msg)
	}
	ck := cks[slot]
	res := &restored{step: int(common)}
	var err error
	if res.lossHist, err = ck.TensorData(ckptLoss, res.step); err != nil {
		return nil, fmt.Errorf("-resume: %s: %w", k.path(slot), err)
	}
	ev := ck.Tensor(ckptEvals)
	if ev == nil || len(ev.Data)%ckptEvalWidth != 0 {
		return nil, fmt.Errorf("-resume: %s: no valid %s", k.path(slot), ckptEvals)
	}
	for i := 0; i < len(ev.Data); i += ckptEvalWidth {
		res.evals = append(res.evals, evalPoint{step: int(ev.Data[i]), acc: float64(ev.Data[i+1]), loss: float64(ev.Data[i+2])})
	}
	// The optimizer gets its own state only.
	own := *ck
	own.Ints = make(map[string]int64, len(ck.Ints))
	for n, v := range ck.Ints {
		if !strings.HasPrefix(n, ckptPrefix) {
			own.Ints[n] = v
		}
	}
	own.Tensors = nil
	for _, t := range ck.Tensors {
		if !strings.HasPrefix(t.Name, ckptPrefix) {
			own.Tensors = append(own.Tensors, t)
		}
	}
	if err := opt.Load(&own); err != nil {
		return nil, fmt.Errorf("-resume: %s: %w", k.path(slot), err)
	}
	return res, nil
}

// holds lists the steps a rank's two files hold.
func holds(steps [2]int64) []int64 {
	var h []int64
	for _, s := range steps {
		if s >= 0 {
			h = append(h, s)
		}
	}
	return h
}
