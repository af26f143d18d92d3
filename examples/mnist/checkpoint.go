package main

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
	"github.com/lowbit-ml/lowbit/outer"
)

// checkpointConfig is what -checkpoint, -checkpoint-every, -resume and
// -kill-at ask for. The zero value checkpoints nothing.
type checkpointConfig struct {
	dir    string // "" for no checkpoints
	every  int    // save after every this many steps (and after the last)
	resume bool   // continue from the newest checkpoint every rank holds
	// freshIfNone makes a resume that finds no file of the optimizer on
	// any rank start it from step 0 instead of failing: set for the
	// optimizer of -compare that follows a finished one, which the
	// interrupted run may not have saved a step of yet.
	freshIfNone bool
	// killAt, when positive, makes every rank kill its own process with
	// SIGKILL right after the checkpoint of step killAt is on disk on every
	// rank: the crash the resume test recovers from.
	killAt int
}

// Names of what the example stores in an optimizer checkpoint besides the
// optimizer's own state. They are removed before the optimizer sees it.
const (
	ckptPrefix = "mnist/"
	ckptStep   = ckptPrefix + "step" // steps done
	ckptLoss   = ckptPrefix + "loss" // per-step training loss so far, of this rank's shards
	// ckptLossMean is the per-step training loss so far averaged over the
	// ranks (of the global batch): what a resume on another number of
	// ranks restores on every rank, as it cannot recombine the shards.
	ckptLossMean = ckptPrefix + "loss_mean"
	ckptEvals    = ckptPrefix + "evals" // (step, acc, loss, wall seconds, bytes sent) of each evaluation
	ckptTotal    = ckptPrefix + "total" // steps of the whole run
	ckptSetting  = ckptPrefix + "flag"  // + a flag's name: its value (see settings)
	// ckptElapsed is the training wall time up to the step, evaluations
	// excluded, in nanoseconds, summed over the runs that made it.
	ckptElapsed = ckptPrefix + "elapsed_ns"
	// ckptSent is what this rank sent in the optimizer's Step up to the
	// step, in bytes, over the runs that made it (the optimizer's Stats
	// count from its construction); -1 when a run before did not know.
	ckptSent = ckptPrefix + "sent_bytes"
	// ckptGen is the run's generation: 0 from the start, one more after
	// each resume on another number of ranks. Ranks resume together only
	// from files of the same step and generation, so that files of two
	// trajectories that reached the same step never mix.
	ckptGen = ckptPrefix + "generation"
	// ckptRun is the run's identity: a random number rank 0 draws when a
	// run starts from step 0, kept by every resume (on any number of
	// ranks). A resume refuses a directory that holds files of two runs
	// instead of mixing them; 0 in files made before it was kept.
	ckptRun           = ckptPrefix + "run"
	ckptEvalWidth     = 5
	ckptEvalWidthWall = 4 // files made before the bytes column
	ckptEvalWidthOld  = 3 // files made before the wall column
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
	gen      int64 // this run's generation (ckptGen)
	run      int64 // this run's identity (ckptRun)
	// runs maps, on rank 0 after otherWorld, every run identity (ckptRun)
	// of the usable files it saw to their paths.
	runs map[int64][]string
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
// share with the run that saved the checkpoint. -lr is not among them: the
// learning rate is part of the optimizer's checkpoint, and a resume keeps
// it unless -lr is given (see resumeLR).
func settings(cfg trainConfig, world int) []setting {
	h := cfg.hyper
	s := []setting{
		{"-workers", int64(world), fmt.Sprint(world)},
		{"-batch", int64(cfg.batch), fmt.Sprint(cfg.batch)},
		{"-seed", int64(cfg.seed), fmt.Sprint(cfg.seed)},
		{"-freeze-step", int64(h.freezeStep), fmt.Sprint(h.freezeStep)},
		{"-reduce", int64(h.reduce), h.reduce.String()},
		{"-reduce (zero-adam)", int64(h.scatter), h.scatter.String()},
		{"-evals", int64(cfg.evalsPerEpoch), fmt.Sprint(cfg.evalsPerEpoch)},
	}
	if cfg.optimizer == diloco {
		o := h.outer
		s = append(s,
			setting{"-outer-h", int64(o.H), fmt.Sprint(o.H)},
			setting{"-outer-fragments", int64(o.Fragments), fmt.Sprint(o.Fragments)},
			setting{"-outer-delay", int64(o.Delay), fmt.Sprint(o.Delay)},
			setting{"-outer-codec", int64(o.Codec), o.Codec.String()})
		inner := setting{"-outer-inner", 0, "adam"}
		if h.outerMuon {
			inner = setting{"-outer-inner", 1, "muon"}
		}
		s = append(s, inner)
	}
	return s
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
// "" when all agree. -workers may differ: restore handles that.
func (k *checkpointer) mismatch(ck *optim.Checkpoint) string {
	for _, s := range k.settings {
		v, err := ck.Int(ckptSetting + s.flag)
		if err != nil && s.flag == "-outer-inner" {
			v, err = 0, nil // made before -outer-inner: adam
		}
		if err != nil {
			return fmt.Sprintf("records no %s", s.flag)
		}
		if v != s.value && s.flag != "-workers" {
			return fmt.Sprintf("made by a run with other flags: %s differs (this run has %s %s)", s.flag, s.flag, s.show)
		}
	}
	return ""
}

// path is this rank's file of slot (0 or 1).
func (k *checkpointer) path(slot int) string { return k.pathOf(k.rank, slot) }

// pathOf is rank's file of slot.
func (k *checkpointer) pathOf(rank, slot int) string {
	return filepath.Join(k.cfg.dir, fmt.Sprintf("%s.rank%d.%d.ckpt", k.name, rank, slot))
}

// due reports whether the state after step (1-based) is to be saved on the
// checkpoint grid (every -checkpoint-every steps, and the last).
func (k *checkpointer) due(step, total int) bool {
	return k != nil && (step%k.cfg.every == 0 || step == total)
}

// save writes the state after step to the older of the two files, then,
// if step is the -kill-at step, waits until every rank has saved and kills
// this process.
//
// elapsed is the training wall time up to step, evaluations excluded;
// sent is what this rank sent in Step up to step (-1: unknown).
func (k *checkpointer) save(ctx context.Context, c comm.Comm, opt optim.Optimizer, step, total int, lossHist []float32, evals []evalPoint, elapsed time.Duration, sent int64) error {
	ck, err := opt.State()
	if err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	ck.Ints[ckptStep] = int64(step)
	ck.Ints[ckptTotal] = int64(total)
	ck.Ints[ckptGen] = k.gen
	ck.Ints[ckptRun] = k.run
	ck.Ints[ckptElapsed] = int64(elapsed)
	ck.Ints[ckptSent] = sent
	for _, s := range k.settings {
		ck.Ints[ckptSetting+s.flag] = s.value
	}
	ck.AddTensor(ckptLoss, []int{step}, lossHist[:step])
	mean := make([]float32, step)
	copy(mean, lossHist[:step])
	if err := c.AllReduce(ctx, mean, comm.Mean); err != nil {
		return fmt.Errorf("checkpoint: averaging the loss history: %w", err)
	}
	ck.AddTensor(ckptLossMean, []int{step}, mean)
	ev := make([]float32, 0, ckptEvalWidth*len(evals))
	for _, e := range evals {
		ev = append(ev, float32(e.step), float32(e.acc), float32(e.loss), float32(e.wall.Seconds()), float32(e.bytes))
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
	elapsed  time.Duration // training wall time before step (evaluations excluded)
	gen      int64         // the run's generation (see ckptGen)
	run      int64         // the run's identity (see ckptRun), 0 for unknown
	sent     int64         // what this rank sent in Step before step (-1: unknown)
	// fromWorld is the number of ranks that made the checkpoint: another
	// than this run's when it resumed on another number of ranks (see
	// carriedBy).
	fromWorld int
	// lr is the fixed learning rate the loaded checkpoint records
	// (optim.FloatLR); hasLR is false for a checkpoint that records none.
	lr    float32
	hasLR bool
	// carried is how a resume on another number of ranks carried the
	// state over; check, what checkCarried found of it (rank 0's).
	carried carry
	check   *carriedReport
}

// candidate is one usable checkpoint file of a rank.
type candidate struct {
	path  string
	ck    *optim.Checkpoint
	step  int64
	gen   int64
	world int64 // the -workers it was made with
	run   int64 // the run's identity (ckptRun), 0 for unknown
}

// key orders candidates: by step, then generation. -1 for none.
func (c *candidate) key() int64 {
	if c == nil {
		return -1
	}
	return c.step<<16 | c.gen
}

// load reads and checks one file; a damaged, foreign or mismatched file is
// returned as a problem, a missing one as neither.
func (k *checkpointer) load(path string, total int) (*candidate, string) {
	ck, err := optim.LoadFile(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return nil, ""
		}
		return nil, err.Error()
	}
	c := &candidate{path: path, ck: ck}
	if c.step, err = ck.Int(ckptStep); err != nil {
		return nil, fmt.Sprintf("%s: %v", path, err)
	}
	if tt, err := ck.Int(ckptTotal); err != nil || tt != int64(total) {
		return nil, fmt.Sprintf("%s: made for a run of %d steps, this run has %d", path, tt, total)
	}
	if m := k.mismatch(ck); m != "" {
		return nil, fmt.Sprintf("%s: %s", path, m)
	}
	c.world, _ = ck.Int(ckptSetting + "-workers") // mismatch checked it is there
	c.gen, _ = ck.Int(ckptGen)                    // 0 in files made before generations
	c.run, _ = ck.Int(ckptRun)                    // 0 in files made before run identities
	if c.step < 0 || c.step > int64(total) || c.gen < 0 || c.gen >= 1<<16 || c.world < 1 {
		return nil, fmt.Sprintf("%s: step %d, generation %d or world %d out of range", path, c.step, c.gen, c.world)
	}
	return c, ""
}

// restore loads, on every rank, the newest checkpoint step that every rank
// holds, into opt; it returns nil when -resume is off, and with
// freshIfNone when no rank sees any file of the optimizer (it starts from
// step 0). Every rank calls it together, and every rank gets the same
// answer or the same error.
//
// A rank's own two files are the candidates of a resume on the same number
// of ranks. Rank 0 also looks for a complete set of another number of
// ranks' files (every rank of that run holding the same step and
// generation): a resume from those continues on this run's ranks, the
// 1-bit optimizers' error feedback (and sharded moments) carried over by
// onebit.Regroup, zero-adam's moments re-sharded by zero.Consolidate; it
// needs a directory every rank sees. The newest step wins; at equal steps
// the same number of ranks does.
//
// A file that fails its checksum (or is otherwise unusable) is named in a
// warning on warn, by the rank that read it; rank 0 states the step the run
// falls back to when that is older than some rank's newest file.
func (k *checkpointer) restore(ctx context.Context, c comm.Comm, opt optim.Optimizer, total int, warn io.Writer) (*restored, error) {
	if k == nil || !k.cfg.resume {
		return nil, nil
	}
	w := c.Size()
	k.removeTemps(warn)
	var own [2]*candidate
	var ownRuns [2]int64 // the runs of this rank's files, of any number of ranks
	var problems []string
	for slot := range 2 {
		cand, p := k.load(k.pathOf(k.rank, slot), total)
		if p != "" {
			problems = append(problems, p)
		}
		if cand != nil {
			ownRuns[slot] = cand.run
		}
		if cand != nil && cand.world == int64(w) {
			own[slot] = cand
		}
	}
	for _, p := range problems {
		fmt.Fprintf(warn, "mnist: warning: rank %d: -resume: unusable checkpoint: %s\n", k.rank, p)
	}
	// Every rank learns every rank's two keys, number of problems, number
	// of files of the optimizer (of any number of ranks) and the runs its
	// two files belong to.
	const fields = 6
	mine := make([]byte, 8*fields)
	binary.LittleEndian.PutUint64(mine[0:], uint64(own[0].key()))
	binary.LittleEndian.PutUint64(mine[8:], uint64(own[1].key()))
	binary.LittleEndian.PutUint64(mine[16:], uint64(len(problems)))
	binary.LittleEndian.PutUint64(mine[24:], uint64(k.files()))
	binary.LittleEndian.PutUint64(mine[32:], uint64(ownRuns[0]))
	binary.LittleEndian.PutUint64(mine[40:], uint64(ownRuns[1]))
	all := make([]byte, len(mine)*w)
	if err := c.AllGatherBytes(ctx, mine, all); err != nil {
		return nil, err
	}
	field := func(r, f int) int64 { return int64(binary.LittleEndian.Uint64(all[8*(fields*r+f):])) }
	// The newest key every rank holds on the same number of ranks.
	same, newest, nproblems, nfiles := int64(-1), int64(-1), int64(0), int64(0)
	for r := range w {
		newest = max(newest, field(r, 0), field(r, 1))
		nproblems += field(r, 2)
		nfiles += field(r, 3)
	}
	for _, key := range []int64{field(0, 0), field(0, 1)} {
		held := key >= 0
		for r := 1; r < w && held; r++ {
			held = field(r, 0) == key || field(r, 1) == key
		}
		if held {
			same = max(same, key)
		}
	}
	// Rank 0 looks for a complete set made on another number of ranks,
	// and for files of other runs among every file it sees.
	other := make([]byte, 24)
	if k.rank == 0 {
		key, world := k.otherWorld(total, w)
		binary.LittleEndian.PutUint64(other[0:], uint64(key))
		binary.LittleEndian.PutUint64(other[8:], uint64(world))
		binary.LittleEndian.PutUint64(other[16:], uint64(len(k.runs)))
	}
	if err := c.BroadcastBytes(ctx, other, 0); err != nil {
		return nil, err
	}
	otherKey, otherWorld := int64(binary.LittleEndian.Uint64(other[0:])), int(binary.LittleEndian.Uint64(other[8:]))
	// Files of two runs in one directory: refused, never mixed.
	runs := map[int64]bool{}
	for r := range w {
		for f := 4; f < 6; f++ {
			if id := field(r, f); id != 0 {
				runs[id] = true
			}
		}
	}
	if len(runs) > 1 || binary.LittleEndian.Uint64(other[16:]) > 1 {
		return nil, k.twoRuns()
	}
	if nfiles == 0 && k.cfg.freshIfNone {
		if k.rank == 0 {
			fmt.Fprintf(warn, "mnist: -resume: %s had not saved a checkpoint: it starts from step 0\n", k.name)
		}
		return nil, nil
	}
	if same < 0 && otherKey < 0 {
		msg := fmt.Sprintf("-resume: no checkpoint of %s in %s that every rank holds (this rank holds steps %v)", k.name, k.cfg.dir, holds(own))
		if len(problems) > 0 {
			msg += ": " + strings.Join(problems, "; ")
		} else if nproblems > 0 {
			msg += fmt.Sprintf(" (%d unusable files on other ranks, named in their warnings)", nproblems)
		}
		return nil, errors.New(msg)
	}
	var res *restored
	var err error
	if same>>16 >= otherKey>>16 {
		var cand *candidate
		for _, o := range own {
			if o != nil && o.key() == same {
				cand = o
			}
		}
		res, err = k.apply(opt, cand.path, cand.ck)
	} else {
		res, err = k.reworld(opt, total, otherKey, otherWorld, w)
	}
	// Every rank fails together.
	flag := []float32{0}
	if err != nil {
		flag[0] = 1
	}
	if aerr := c.AllReduce(ctx, flag, comm.Max); aerr != nil {
		return nil, aerr
	}
	if err != nil {
		return nil, err
	}
	if flag[0] != 0 {
		return nil, fmt.Errorf("-resume: loading the checkpoint of step %d failed on another rank", res.step)
	}
	if k.rank == 0 && (nproblems > 0 || newest>>16 > int64(res.step)) {
		why := fmt.Sprintf("%d unusable checkpoint files (named above", nproblems)
		if w > 1 {
			why += "; each rank warns about its own"
		}
		why += ")"
		if nproblems == 0 {
			why = "the newer files are not held by every rank"
		}
		fmt.Fprintf(warn, "mnist: warning: -resume: %s falls back to step %d, the newest step every rank holds (newest file: step %d): %s\n",
			k.name, res.step, max(newest>>16, int64(res.step)), why)
	}
	if k.rank == 0 {
		fmt.Fprintf(warn, "mnist: -resume: %s continues from step %d of %d\n", k.name, res.step, total)
	}
	if res.fromWorld != w && k.rank == 0 {
		fmt.Fprintf(warn, "mnist: -resume: %s checkpoint of step %d was made on %d ranks, this run has %d: continuing, %s\n",
			k.name, res.step, res.fromWorld, w, res.carried)
		if res.check != nil {
			fmt.Fprintf(warn, "mnist: -resume: %s carried: %s\n", k.name, res.check)
		}
	}
	return res, nil
}

// otherWorld is rank 0's search for the newest complete set of files made
// on another number of ranks than w: it returns its key and world, or -1
// and 0.
func (k *checkpointer) otherWorld(total, w int) (key int64, world int) {
	key = -1
	paths, _ := filepath.Glob(filepath.Join(k.cfg.dir, k.name+".rank*.*.ckpt"))
	type set struct {
		key   int64
		world int64
	}
	ranks := map[set]map[int64]bool{}
	k.runs = map[int64][]string{}
	for _, p := range paths {
		var r, slot int64
		if _, err := fmt.Sscanf(strings.TrimPrefix(filepath.Base(p), k.name+".rank"), "%d.%d.ckpt", &r, &slot); err != nil {
			continue
		}
		cand, _ := k.load(p, total)
		if cand != nil && cand.run != 0 {
			k.runs[cand.run] = append(k.runs[cand.run], p)
		}
		if cand == nil || cand.world == int64(w) || r >= cand.world {
			continue
		}
		s := set{cand.key(), cand.world}
		if ranks[s] == nil {
			ranks[s] = map[int64]bool{}
		}
		ranks[s][r] = true
	}
	for s, rs := range ranks {
		if int64(len(rs)) != s.world {
			continue
		}
		if s.key > key {
			key, world = s.key, int(s.world)
		}
	}
	return key, world
}

// twoRuns is the refusal of a directory holding the files of two runs
// (ckptRun): rank 0 names them, by run; the other ranks refer to it.
func (k *checkpointer) twoRuns() error {
	if k.rank != 0 || len(k.runs) < 2 {
		return fmt.Errorf("-resume: %s holds checkpoints of %s from two different runs (rank 0 names the files): resuming would mix them; remove one run's files or give another -checkpoint",
			k.cfg.dir, k.name)
	}
	ids := make([]int64, 0, len(k.runs))
	for id := range k.runs {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	var parts []string
	for _, id := range ids {
		ps := slices.Clone(k.runs[id])
		slices.Sort(ps)
		parts = append(parts, fmt.Sprintf("run %016x: %s", uint64(id), strings.Join(ps, ", ")))
	}
	return fmt.Errorf("-resume: %s holds checkpoints of %s from %d different runs (%s): resuming would mix them; remove one run's files or give another -checkpoint",
		k.cfg.dir, k.name, len(ids), strings.Join(parts, "; "))
}

// carry is how a checkpoint made on another number of ranks continues on
// this run's (see reworld).
type carry int

const (
	// carryCopy: the state is the same on every rank (the exact
	// optimizers): new rank r loads old rank r mod W's as it is, which
	// loads on any number of ranks (optim.Replicated).
	carryCopy carry = iota
	// carryRegroup: the 1-bit optimizers (1-bit Muon too), in every state
	// mode: each new
	// rank loads onebit.Regroup of every old rank's checkpoint, the error
	// feedback kept and sharded moments re-cut.
	carryRegroup
	// carryConsolidate: zero-adam loads zero.Consolidate of every old
	// rank's shard of the moments.
	carryConsolidate
	// carryOuter: the outer optimizer (diloco, every codec, AdamW or Muon
	// inside): each new rank loads outer.Regroup of every old rank's
	// checkpoint: θ_g and u (the same on every rank), the codecs' error
	// feedback (the 1-bit codec's worker errors' mean and server errors
	// re-cut, the sparse codec's accumulators' mean), the inner state,
	// local parameters and any exchange in flight of old rank r mod W.
	carryOuter
)

// carryOf says how a checkpoint ck continues on another number of ranks,
// from the algorithm that made it, not from the optimizer's name: every
// mode of the 1-bit optimizers (onebit-adam-compact, -sharded,
// -sharded-bf16, onebit-lamb-compact, onebit-muon's) records its 1-bit
// algorithm, and goes through onebit.Regroup, which keeps the error
// feedback (and 1-bit Muon's momenta's mean).
func carryOf(ck *optim.Checkpoint) carry {
	switch a := ck.Algorithm; {
	case a == optim.AlgorithmOnebitAdam || a == optim.AlgorithmOnebitLamb || a == optim.AlgorithmZeroOneAdam || a == onebit.AlgorithmMuon:
		return carryRegroup
	case a == zero.Algorithm:
		return carryConsolidate
	case strings.HasPrefix(a, outer.AlgorithmPrefix):
		return carryOuter
	}
	return carryCopy
}

// String says what a resume on another number of ranks carries over.
func (c carry) String() string {
	switch c {
	case carryRegroup:
		return "error feedback carried over (onebit.Regroup)"
	case carryConsolidate:
		return "moments re-sharded (zero.Consolidate)"
	case carryOuter:
		return "global parameters, outer momentum and error feedback carried over, inner state of old rank r mod W (outer.Regroup)"
	}
	return "the same state on every rank"
}

// reworld loads the checkpoint of key made on world ranks into this run of
// w ranks, as carryOf says for the algorithm that made it: the 1-bit
// optimizers (every state mode) load onebit.Regroup of every old rank's
// checkpoint, zero-adam the consolidation of every old rank's shard
// (zero.Consolidate), and the exact optimizers, whose state is the same
// on every rank, old rank (rank mod world)'s checkpoint as it is; diloco
// outer.Regroup of every old rank's checkpoint. Rank 0 checks what the
// regrouping carried (checkCarried) and fails where it does not hold.
func (k *checkpointer) reworld(opt optim.Optimizer, total int, key int64, world, w int) (*restored, error) {
	find := func(r int) (*candidate, error) {
		for slot := range 2 {
			if cand, _ := k.load(k.pathOf(r, slot), total); cand != nil && cand.key() == key && cand.world == int64(world) {
				return cand, nil
			}
		}
		return nil, fmt.Errorf("-resume: rank %d's checkpoint of step %d (made on %d ranks) is not readable from rank %d: resuming on another number of ranks needs a directory every rank sees",
			r, key>>16, world, k.rank)
	}
	all := func() ([]*optim.Checkpoint, error) {
		cks := make([]*optim.Checkpoint, world)
		for r := range world {
			cr, err := find(r)
			if err != nil {
				return nil, err
			}
			cks[r] = k.strip(cr.ck)
		}
		return cks, nil
	}
	cand, err := find(k.rank % world)
	if err != nil {
		return nil, err
	}
	var load *optim.Checkpoint
	var check *carriedReport
	how := carryOf(cand.ck)
	// regroup is onebit.Regroup or outer.Regroup: this rank's state, and
	// on rank 0 every new rank's, which checkCarried compares with the
	// old ranks'.
	regroup := func(f func([]*optim.Checkpoint, int, int) (*optim.Checkpoint, error)) error {
		cks, err := all()
		if err != nil {
			return err
		}
		if load, err = f(cks, w, k.rank); err != nil {
			return fmt.Errorf("-resume: %w (files: %s)", err, k.setNames(key, world, total))
		}
		if k.rank != 0 {
			return nil
		}
		news := make([]*optim.Checkpoint, w)
		for r := range w {
			if news[r], err = f(cks, w, r); err != nil {
				return fmt.Errorf("-resume: %w", err)
			}
		}
		rep, err := checkCarried(how, cks, news)
		check = &rep
		return err
	}
	switch how {
	case carryConsolidate:
		cks, err := all()
		if err != nil {
			return nil, err
		}
		if load, err = zero.Consolidate(cks); err != nil {
			return nil, fmt.Errorf("-resume: %w (files: %s)", err, k.setNames(key, world, total))
		}
		if k.rank == 0 {
			rep, err := checkCarried(how, cks, []*optim.Checkpoint{load})
			if err != nil {
				return nil, err
			}
			check = &rep
		}
	case carryRegroup:
		if err := regroup(onebit.Regroup); err != nil {
			return nil, err
		}
	case carryOuter:
		if err := regroup(outer.Regroup); err != nil {
			return nil, err
		}
	default:
		load = k.strip(cand.ck)
	}
	res, err := k.history(cand.path, cand.ck, true)
	if err != nil {
		return nil, err
	}
	if err := opt.Load(load); err != nil {
		return nil, fmt.Errorf("-resume: %s (made on %d ranks): %w", cand.path, world, err)
	}
	res.lr, res.hasLR = checkpointLR(load)
	res.gen = cand.gen + 1 // a new trajectory: its files must not mix with the old one's
	res.fromWorld = world
	res.carried = how
	res.check = check
	res.run = cand.run
	return res, nil
}

// setNames lists the files of the set of key made on world ranks, for an
// error that refuses them.
func (k *checkpointer) setNames(key int64, world, total int) string {
	var ps []string
	for r := range world {
		for slot := range 2 {
			p := k.pathOf(r, slot)
			if cand, _ := k.load(p, total); cand != nil && cand.key() == key {
				ps = append(ps, p)
			}
		}
	}
	if len(ps) == 0 {
		return fmt.Sprintf("%s.rank0..%d.*.ckpt of step %d in %s", k.name, world-1, key>>16, k.cfg.dir)
	}
	return strings.Join(ps, ", ")
}

// apply loads ck, read from path, into opt: the same number of ranks.
func (k *checkpointer) apply(opt optim.Optimizer, path string, ck *optim.Checkpoint) (*restored, error) {
	res, err := k.history(path, ck, false)
	if err != nil {
		return nil, err
	}
	load := k.strip(ck)
	if err := opt.Load(load); err != nil {
		return nil, fmt.Errorf("-resume: %s: %w", path, err)
	}
	res.lr, res.hasLR = checkpointLR(load)
	res.gen, _ = ck.Int(ckptGen)
	res.run, _ = ck.Int(ckptRun)
	res.fromWorld = int(ck.Ints[ckptSetting+"-workers"])
	return res, nil
}

// checkpointLR returns the fixed learning rate ck records that -lr
// replaces, if any: the optimizer's own; for Muon its AdamW group's; for
// the outer optimizer (diloco), whose learning rate (SetLR, LR) is its
// inner optimizer's, the one it records under outer.InnerPrefix (with
// -outer-inner muon the inner Muon's AdamW group's).
func checkpointLR(ck *optim.Checkpoint) (float32, bool) {
	for _, name := range []string{optim.FloatAdamLR, optim.FloatLR, outer.InnerPrefix + optim.FloatAdamLR, outer.InnerPrefix + optim.FloatLR} {
		if lr, ok := ck.Floats[name]; ok {
			return float32(lr), true
		}
	}
	return 0, false
}

// resumeLR applies the examples' learning-rate rule to opt, which has just
// loaded a checkpoint recording back.lr (if back.hasLR): Load restored the
// checkpoint's learning rate, as PyTorch's load_state_dict does; when -lr
// was given on the command line (explicit) its value lr wins and is set
// with SetLR. It returns the line that says which learning rate the run
// continues with and where it came from.
func resumeLR(opt optim.Optimizer, back *restored, lr float32, explicit bool) (string, error) {
	had := "the checkpoint records none"
	if back.hasLR {
		had = fmt.Sprintf("the checkpoint had %v", back.lr)
	}
	ls, ok := opt.(optim.LRSetter)
	if m := muonOf(opt); m != nil {
		ls, ok = adamGroup{m}, true // -lr is Muon's AdamW group's
	}
	if explicit {
		if !ok {
			return "", fmt.Errorf("-lr %v: the optimizer cannot change its learning rate (not an optim.LRSetter)", lr)
		}
		if err := ls.SetLR(lr); err != nil {
			return "", fmt.Errorf("-lr: %w", err)
		}
		return fmt.Sprintf("lr %v from -lr (%s)", lr, had), nil
	}
	if !back.hasLR {
		// Load kept the optimizer's own: the default of -lr.
		return fmt.Sprintf("lr %v, the default of -lr (%s)", lr, had), nil
	}
	return fmt.Sprintf("lr %v from the checkpoint", back.lr), nil
}

// twoGroups is an optimizer with Muon's two learning rates (optim.Muon):
// SetLR and LR are its Muon group's, SetAdamLR and AdamLR its AdamW
// group's.
type twoGroups interface {
	optim.LRSetter
	AdamLR() float32
	SetAdamLR(lr float32) error
	SetAdamSchedule(s optim.Schedule) error
}

// muonOf returns the Muon that -optimizer muon wraps in opt
// (optim.Transposed), or that diloco with -outer-inner muon steps inside
// (outer.Optimizer's Inner), nil for another optimizer.
func muonOf(opt optim.Optimizer) twoGroups {
	if o, ok := opt.(*outer.Optimizer); ok {
		opt = o.Inner()
	}
	if t, ok := opt.(*optim.Transposed); ok {
		opt = t.Inner()
	}
	m, _ := opt.(twoGroups)
	return m
}

// adamGroup is Muon's AdamW group as an optim.LRSetter, for resumeLR.
type adamGroup struct{ m twoGroups }

func (a adamGroup) SetLR(lr float32) error             { return a.m.SetAdamLR(lr) }
func (a adamGroup) SetSchedule(s optim.Schedule) error { return a.m.SetAdamSchedule(s) }
func (a adamGroup) LR() float32                        { return a.m.AdamLR() }

// resumeMuonLR applies resumeLR's rule to Muon's Muon group, which -muon-lr
// sets: the checkpoint's learning rate, which Load restored, unless
// -muon-lr was given (explicit), whose value lr then wins.
func resumeMuonLR(m twoGroups, lr float32, explicit bool) (string, error) {
	if !explicit {
		return fmt.Sprintf("muon lr %v from the checkpoint", m.LR()), nil
	}
	line := fmt.Sprintf("muon lr %v from -muon-lr (the checkpoint had %v)", lr, m.LR())
	if err := m.SetLR(lr); err != nil {
		return "", fmt.Errorf("-muon-lr: %w", err)
	}
	return line, nil
}

// history reads the example's own part of ck: step, losses, evaluations and
// elapsed time. The losses are this rank's, or with mean (a resume on
// another number of ranks) those averaged over the ranks that saved ck,
// where ck records them (files made before ckptLossMean do not).
func (k *checkpointer) history(path string, ck *optim.Checkpoint, mean bool) (*restored, error) {
	step, err := ck.Int(ckptStep)
	if err != nil {
		return nil, fmt.Errorf("-resume: %s: %w", path, err)
	}
	res := &restored{step: int(step)}
	loss := ckptLoss
	if mean && ck.Tensor(ckptLossMean) != nil {
		loss = ckptLossMean
	}
	if res.lossHist, err = ck.TensorData(loss, res.step); err != nil {
		return nil, fmt.Errorf("-resume: %s: %w", path, err)
	}
	ev := ck.Tensor(ckptEvals)
	width := 0
	if ev != nil && len(ev.Shape) == 2 {
		width = ev.Shape[1]
	}
	if width != ckptEvalWidth && width != ckptEvalWidthWall && width != ckptEvalWidthOld || len(ev.Data)%width != 0 {
		return nil, fmt.Errorf("-resume: %s: no valid %s", path, ckptEvals)
	}
	for i := 0; i < len(ev.Data); i += width {
		e := evalPoint{step: int(ev.Data[i]), acc: float64(ev.Data[i+1]), loss: float64(ev.Data[i+2])}
		e.wall, e.bytes = -1, -1 // unknown
		if width >= ckptEvalWidthWall {
			e.wall = time.Duration(float64(ev.Data[i+3]) * float64(time.Second))
		}
		if width >= ckptEvalWidth {
			e.bytes = float64(ev.Data[i+4])
		}
		res.evals = append(res.evals, e)
	}
	if ns, err := ck.Int(ckptElapsed); err == nil {
		res.elapsed = time.Duration(ns)
	}
	res.sent = -1 // a checkpoint made before it was kept
	if b, err := ck.Int(ckptSent); err == nil {
		res.sent = b
	}
	return res, nil
}

// strip returns ck without the example's own entries: what the optimizer
// loads.
func (k *checkpointer) strip(ck *optim.Checkpoint) *optim.Checkpoint {
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
	return &own
}

// files counts the checkpoint files of the optimizer this rank sees in the
// directory, of any rank and number of ranks.
func (k *checkpointer) files() int {
	paths, _ := filepath.Glob(filepath.Join(k.cfg.dir, k.name+".rank*.*.ckpt"))
	return len(paths)
}

// holds lists the steps a rank's two files hold.
func holds(own [2]*candidate) []int64 {
	h := []int64{}
	for _, c := range own {
		if c != nil {
			h = append(h, c.step)
		}
	}
	return h
}

// removeTemps deletes this rank's temporary files that a process killed
// during a save left behind (optim.SaveFile writes DIR/.NAME.tmp-* and
// renames it over NAME; a SIGKILL before the rename leaves it), so that
// repeated kills do not fill the directory.
func (k *checkpointer) removeTemps(warn io.Writer) {
	for slot := range 2 {
		tmps, _ := filepath.Glob(filepath.Join(k.cfg.dir, "."+filepath.Base(k.path(slot))+".tmp-*"))
		for _, t := range tmps {
			if err := os.Remove(t); err == nil {
				fmt.Fprintf(warn, "mnist: rank %d: -resume: removed %s, left by a save that did not finish\n", k.rank, t)
			}
		}
	}
}
