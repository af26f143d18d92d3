package gomlx

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/optim"
)

// Checkpoint returns cfg.Dir(dir).Done(), the checkpoint.Handler of this
// rank's checkpoint directory dir, after every rank agreed on the step to
// resume from. cfg is checkpoint.Build(store) with any options but a
// directory or an embedded checkpoint (Keep, ExcludeParams, ...). It is a
// collective: every rank calls it together, with its own directory, before
// the first training step, in place of checkpoint.Config.Done.
//
// The ranks exchange the global steps of the checkpoints their directories
// hold (a checkpoint counts when its .json is whole JSON and its .bin is
// there) and every rank resumes from the newest step they all hold. A rank
// whose directory holds newer checkpoints (its own last save, when the
// ranks stopped between their saves) first moves them, with their lowbit
// state files, into the subdirectory SetAsideDir, so that GoMLX loads the
// common step; a warning (see Optimizer.Warnings) says so, on rank 0 with
// every rank's newest step and on each rank that moved files with their
// names. When no
// rank holds a checkpoint, every rank starts afresh. When the ranks hold
// checkpoints but none of the same step, every rank returns an error
// naming each rank's steps and moves nothing. An error on one rank (its
// directory cannot be listed, a file cannot be moved, GoMLX cannot load
// the checkpoint) is returned on every rank.
//
// Checkpoint also resumes on another number of ranks than made the
// checkpoints, by itself, where every rank's directory is one prefix
// followed by its rank (".../run-rank-3" on rank 3) on a file system every
// rank sees, so that rank 0 finds the other ranks' directories, old and
// new. The newest global step of which every rank of the group that made
// it holds a whole GoMLX checkpoint and its lowbit state file (the state
// files say the group's size and each its rank) wins when it is newer
// than the newest step this group's ranks all hold, or when that step's
// state files are not this group's. Then every rank makes its lowbit
// state from the old ranks' by the optimizer's way, checks what it
// carries, and loads it at the first training graph (see RankChange for
// the ways: onebit.Regroup, zero.Consolidate, outer.Regroup or the copy);
// a rank whose directory holds no checkpoint of the step gets a copy of
// old rank 0's GoMLX checkpoint (the variables are the same on every
// rank); newer checkpoints are set aside. Rank 0 warns once, naming the
// way and what the check found, and names the files that made newer steps
// incomplete. Nothing of the old group's files is changed: until the
// first Save of a later step a rerun does the same again, so a crash in
// between loses nothing. Files of another group or another run make no
// group (their state files disagree on the group's size, the rank or the
// algorithm); with no group, the error names them.
func (o *Optimizer) Checkpoint(cfg *checkpoint.Config, dir string) (*checkpoint.Handler, error) {
	var localErr error
	var held []heldCheckpoint
	switch {
	case cfg == nil:
		localErr = errors.New("lbgomlx: Checkpoint: nil checkpoint.Config")
	case dir == "":
		localErr = errors.New("lbgomlx: Checkpoint: empty checkpoint directory")
	case o.closed:
		localErr = fmt.Errorf("lbgomlx: Checkpoint: %w", optim.ErrClosed)
	case o.store != nil:
		localErr = errors.New("lbgomlx: Checkpoint after the first training graph: build the Handler before the first step")
	default:
		held, localErr = listCheckpoints(dir)
	}
	all, err := o.exchangeSteps(heldSteps(held), localErr != nil)
	if err != nil {
		return nil, errors.Join(localErr, err)
	}
	if localErr != nil {
		return nil, localErr
	}
	for r, steps := range all {
		if steps == nil {
			return nil, fmt.Errorf("lbgomlx: Checkpoint: rank %d could not list its checkpoints (its error says why)", r)
		}
	}
	common, err := commonStep(all)
	// A newer checkpoint of a group of another size, or one where the
	// state files of the newest step every rank holds are not this
	// group's: resume on this number of ranks from the old group's.
	plan, fits, perr := o.agreeRankPlan(dir, common)
	if perr != nil {
		return nil, perr
	}
	if plan != nil && plan.Step >= 0 && plan.World != o.size() && (err != nil || plan.Step > common || !fits) {
		return o.changeRanks(cfg, dir, held, plan)
	}
	if err != nil {
		if plan != nil && len(plan.Problems) > 0 {
			err = fmt.Errorf("%w; and no global step is held by every rank of the group that made it (%s)", err, strings.Join(plan.Problems, "; "))
		}
		return nil, err
	}
	var moved []string
	if common >= 0 {
		moved, localErr = setAside(dir, held, common)
	}
	h, err := o.loadAll(cfg, dir, common, localErr, func(by int) error {
		return fmt.Errorf("lbgomlx: Checkpoint: rank %d failed to load its checkpoint of global step %d (its error says why)", by, common)
	})
	if err != nil {
		return nil, err
	}
	o.logResume(all, common, dir, moved)
	o.loadedDir, o.loadedStep = dir, common
	return h, nil
}

// logResume says which step the ranks resume from.
func (o *Optimizer) logResume(all [][]int64, common int64, dir string, moved []string) {
	if len(moved) > 0 {
		to := filepath.Join(dir, SetAsideDir)
		o.warn(fmt.Sprintf("rank %d moved its checkpoints newer than global step %d, the newest step every rank holds, into %s: %s",
			o.rank(), common, to, strings.Join(moved, ", ")),
			zap.Int("rank", o.rank()), zap.Int64("global_step", common), zap.String("to", to), zap.Strings("files", moved))
	}
	if o.rank() != 0 {
		return
	}
	newest := make([]int64, len(all))
	older := false
	for r, steps := range all {
		newest[r] = -1
		if len(steps) > 0 {
			newest[r] = steps[len(steps)-1]
		}
		older = older || newest[r] > common
	}
	switch {
	case common < 0:
		o.log.Info("no rank holds a checkpoint: starting afresh")
	case older:
		o.warn(fmt.Sprintf("resuming from an older checkpoint: global step %d, the newest step every rank holds (the ranks' newest: %v)", common, newest),
			zap.Int64("global_step", common), zap.Int64s("newest_step_by_rank", newest))
	default:
		o.log.Info("resuming from the newest checkpoint, held by every rank", zap.Int64("global_step", common))
	}
}

// exchangeSteps gives every rank the ascending steps each rank holds; a
// rank that failed (failed true) sends none and is nil in the result (see
// allGatherVar).
func (o *Optimizer) exchangeSteps(steps []int64, failed bool) ([][]int64, error) {
	mine := make([]byte, 8*len(steps))
	for i, s := range steps {
		binary.LittleEndian.PutUint64(mine[8*i:], uint64(s))
	}
	recv, err := o.allGatherVar(mine, failed)
	if err != nil {
		return nil, fmt.Errorf("lbgomlx: Checkpoint: exchanging the checkpoint steps: %w", err)
	}
	all := make([][]int64, len(recv))
	for r, b := range recv {
		if b == nil {
			continue
		}
		all[r] = make([]int64, len(b)/8)
		for i := range all[r] {
			all[r][i] = int64(binary.LittleEndian.Uint64(b[8*i:]))
		}
	}
	return all, nil
}

// firstFailed tells every rank the lowest rank that failed (-1 for none),
// in one allgather of a byte per rank.
func (o *Optimizer) firstFailed(failed bool) (int, error) {
	size := o.size()
	mine := []byte{0}
	if failed {
		mine[0] = 1
	}
	all := mine
	if size > 1 {
		all = make([]byte, size)
		if err := o.c.AllGatherBytes(o.ctx, mine, all); err != nil {
			return -1, fmt.Errorf("lbgomlx: Checkpoint: agreeing on the load: %w", err)
		}
	}
	return slices.Index(all, 1), nil
}

// commonStep returns the newest step every rank holds, -1 when no rank
// holds any, or an error naming each rank's steps when the ranks hold
// checkpoints but none of the same step.
func commonStep(all [][]int64) (int64, error) {
	someHeld := false
	for _, steps := range all {
		someHeld = someHeld || len(steps) > 0
	}
	if !someHeld {
		return -1, nil
	}
	first := all[0]
	for i := len(first) - 1; i >= 0; i-- {
		s, everywhere := first[i], true
		for _, steps := range all[1:] {
			if _, found := slices.BinarySearch(steps, s); !found {
				everywhere = false
				break
			}
		}
		if everywhere {
			return s, nil
		}
	}
	var b strings.Builder
	someNone := false
	for r, steps := range all {
		if r > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "rank %d: %s", r, formatSteps(steps))
		someNone = someNone || len(steps) == 0
	}
	more := ""
	if someNone {
		more = " (Checkpoint resumes on another number of ranks by itself where every rank's directory is one prefix followed by its rank, " +
			"as run-rank-3, on a file system every rank sees, and every rank of the old group holds its checkpoint of one step; " +
			"otherwise, to resume on more ranks than made the checkpoints, give each new rank a copy of rank 0's directory, " +
			"its newest lowbit state made from every old rank's by onebit.Regroup (the 1-bit optimizers), outer.Regroup (the outer optimizer) " +
			"or zero.Consolidate (zero.Adam), or left as it is (the exact optimizers): docs/gomlx.md, \"Changing the number of ranks\")"
	}
	return -1, fmt.Errorf("lbgomlx: no checkpoint of a global step that every rank holds (%s), so the ranks cannot resume together: "+
		"delete every rank's checkpoint directory (or move its %s* and %s* files away) to start afresh, or put back the missing ranks' checkpoints%s",
		b.String(), gomlxPrefix, StateFilePrefix, more)
}

// formatSteps writes steps for an error message: "none", "steps 5, 6", or
// the last few of many.
func formatSteps(steps []int64) string {
	if len(steps) == 0 {
		return "none"
	}
	const show = 5
	var b strings.Builder
	b.WriteString("steps ")
	if len(steps) > show {
		fmt.Fprintf(&b, "(%d in all) ..., ", len(steps))
		steps = steps[len(steps)-show:]
	}
	for i, s := range steps {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(strconv.FormatInt(s, 10))
	}
	return b.String()
}

// gomlxPrefix, gomlxJSON and gomlxBin are the parts of GoMLX's checkpoint
// file names (checkpoint.Handler.ListCheckpoints): a checkpoint is the
// pair base+gomlxJSON, base+gomlxBin, base starting with gomlxPrefix and
// ending in "-step-" and the global step, or "-initial" for step 0.
const (
	gomlxPrefix = "checkpoint-"
	gomlxJSON   = checkpoint.JsonNameSuffix
	gomlxBin    = checkpoint.BinDataSuffix
)

var stepSuffix = regexp.MustCompile(`-step-(\d+)$`)

// checkpointStep returns the global step of the GoMLX checkpoint base.
func checkpointStep(base string) (int64, bool) {
	if strings.HasSuffix(base, "-initial") {
		return 0, true
	}
	m := stepSuffix.FindStringSubmatch(base)
	if m == nil {
		return 0, false
	}
	s, err := strconv.ParseInt(m[1], 10, 64)
	return s, err == nil
}

// heldCheckpoint is one GoMLX checkpoint of a directory.
type heldCheckpoint struct {
	base  string
	step  int64
	whole bool // its step is known, its .json is JSON and its .bin is there
}

// listCheckpoints returns the GoMLX checkpoints of dir in the order GoMLX
// loads them (the last one is loaded); a missing dir holds none.
func listCheckpoints(dir string) ([]heldCheckpoint, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("lbgomlx: listing the checkpoints of %s: %w", dir, err)
	}
	var out []heldCheckpoint
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasPrefix(name, gomlxPrefix) || !strings.HasSuffix(name, gomlxJSON) {
			continue
		}
		c := heldCheckpoint{base: strings.TrimSuffix(name, gomlxJSON)}
		var ok bool
		if c.step, ok = checkpointStep(c.base); ok {
			js, err := os.ReadFile(filepath.Join(dir, name))
			_, serr := os.Stat(filepath.Join(dir, c.base+gomlxBin))
			c.whole = err == nil && serr == nil && json.Valid(js)
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b heldCheckpoint) int { return strings.Compare(a.base, b.base) })
	return out, nil
}

// heldSteps returns the ascending distinct steps of the whole checkpoints.
func heldSteps(held []heldCheckpoint) []int64 {
	var steps []int64
	for _, c := range held {
		if c.whole {
			steps = append(steps, c.step)
		}
	}
	slices.Sort(steps)
	return slices.Compact(steps)
}

// setAside moves into dir/SetAsideDir every GoMLX checkpoint that GoMLX
// would load before the newest whole checkpoint of step, and the state
// files of later steps, and returns the names of the files moved.
func setAside(dir string, held []heldCheckpoint, step int64) ([]string, error) {
	last := -1
	for i, c := range held {
		if c.whole && c.step == step {
			last = i
		}
	}
	var names []string
	for _, c := range held[last+1:] {
		for _, suffix := range []string{gomlxJSON, gomlxBin} {
			if _, err := os.Stat(filepath.Join(dir, c.base+suffix)); err == nil {
				names = append(names, c.base+suffix)
			}
		}
	}
	states, err := stateSteps(dir)
	if err != nil {
		return nil, fmt.Errorf("lbgomlx: %w", err)
	}
	for _, s := range states {
		if s > step {
			names = append(names, stateFileName(s))
		}
	}
	if len(names) == 0 {
		return nil, nil
	}
	to := filepath.Join(dir, SetAsideDir)
	if err := os.MkdirAll(to, 0o770); err != nil {
		return nil, fmt.Errorf("lbgomlx: setting checkpoints aside: %w", err)
	}
	for i, name := range names {
		if err := os.Rename(filepath.Join(dir, name), filepath.Join(to, name)); err != nil {
			return names[:i], fmt.Errorf("lbgomlx: setting checkpoints newer than global step %d aside: %w", step, err)
		}
	}
	return names, nil
}

// stateFileName is the name of the state file of global step s.
func stateFileName(s int64) string {
	return fmt.Sprintf("%s%08d%s", StateFilePrefix, s, StateFileSuffix)
}

// stateSteps returns the ascending steps of the state files in dir.
func stateSteps(dir string) ([]int64, error) {
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("listing the lowbit state files of %s: %w", dir, err)
	}
	var steps []int64
	for _, e := range entries {
		rest, okPrefix := strings.CutPrefix(e.Name(), StateFilePrefix)
		digits, okSuffix := strings.CutSuffix(rest, StateFileSuffix)
		if !okPrefix || !okSuffix || e.IsDir() {
			continue
		}
		if s, err := strconv.ParseInt(digits, 10, 64); err == nil && s >= 0 {
			steps = append(steps, s)
		}
	}
	slices.Sort(steps)
	return steps, nil
}

// loadAll loads the GoMLX checkpoint of global step step from dir on
// every rank whose localErr is nil, a collective: a failure on one rank
// is an error on every rank, this rank's own (localErr or its loading
// error) where it failed, otherwise failed(the first rank that did).
func (o *Optimizer) loadAll(cfg *checkpoint.Config, dir string, step int64, localErr error, failed func(by int) error) (*checkpoint.Handler, error) {
	var h *checkpoint.Handler
	if localErr == nil {
		var err error
		if h, err = cfg.Dir(dir).Done(); err != nil {
			localErr = fmt.Errorf("lbgomlx: loading the checkpoint of global step %d from %s: %w", step, dir, err)
		}
	}
	by, err := o.firstFailed(localErr != nil)
	switch {
	case err != nil:
		return nil, errors.Join(localErr, err)
	case localErr != nil:
		return nil, localErr
	case by >= 0:
		return nil, failed(by)
	}
	return h, nil
}
