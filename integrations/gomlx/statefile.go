package gomlx

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// restoreLocal loads into the lowbit optimizer the state of the model's
// global step: from the StateVariable of an older checkpoint (which it
// then removes from the store, so that it neither stays resident nor is
// saved again), or from the state file of that step. It returns the
// checkpoint loaded, nil when none was.
func (o *Optimizer) restoreLocal() (*optim.Checkpoint, error) {
	gs := o.globalStep()
	var ck *optim.Checkpoint
	if c := o.carry; c != nil {
		// Made by Checkpoint from a group of another size.
		o.carry = nil
		if gs != c.step {
			return nil, fmt.Errorf("lbgomlx: the model is at global step %d, the lowbit state Checkpoint made for another number of ranks at step %d: %w",
				gs, c.step, optim.ErrIncompatibleCheckpoint)
		}
		if sv := o.store.GetVariable(StateVariable); sv != nil {
			if err := o.store.DeleteVariable(StateVariable); err != nil {
				return nil, fmt.Errorf("lbgomlx: removing %s: %w", StateVariable, err)
			}
		}
		ck = c.ck
	} else if sv := o.store.GetVariable(StateVariable); sv != nil {
		var err error
		ck, err = o.legacyState(sv, gs)
		if derr := o.store.DeleteVariable(StateVariable); err == nil && derr != nil {
			err = fmt.Errorf("lbgomlx: removing %s: %w", StateVariable, derr)
		}
		if err != nil {
			return nil, err
		}
	} else {
		var err error
		if ck, err = o.stateFile(gs); err != nil || ck == nil {
			return nil, err
		}
	}
	lrBefore, adamBefore := float32(0), float32(0)
	if o.lrs != nil {
		lrBefore = o.lrs.LR()
	}
	ag := adamGroup(o.opt)
	if ag != nil {
		adamBefore = ag.AdamLR()
	}
	if err := o.opt.Load(ck); err != nil {
		return nil, fmt.Errorf("lbgomlx: restoring the lowbit state of global step %d: %w", gs, err)
	}
	o.restored = true
	o.warnLoaded(ck, gs, lrBefore)
	if ag != nil {
		o.warnAdamLR(ck, gs, adamBefore)
	}
	return ck, o.writeBack()
}

// warnLoaded warns, on rank 0, about what the load of ck changed that a
// user must know: the checkpoint's learning rate replaced the optimizer's
// own (lowbit's rule, as PyTorch's), or its error feedback was reset.
func (o *Optimizer) warnLoaded(ck *optim.Checkpoint, gs int64, lrBefore float32) {
	if o.rank() != 0 {
		return
	}
	in := innermost(ck) // the outer optimizer's learning rate is its inner one's
	if lr, ok := in.Floats[optim.FloatLR]; ok && o.lrSrc == lrLowbit && in.Ints[optim.IntLRSchedule] == 0 && float32(lr) != lrBefore {
		o.warn(fmt.Sprintf("resumed at global step %d with the checkpoint's learning rate %v instead of the optimizer's %v (its config's LR): "+
			"the lowbit optimizer's Load restores it, as PyTorch's load_state_dict does. To train on with another, set it in the store "+
			"(store.SetParam(optimizer.ParamLearningRate, lr)): the hook hands GoMLX's learning rate to the optimizer every step",
			gs, float32(lr), lrBefore),
			zap.Int64("global_step", gs), zap.Float64("checkpoint_lr", lr), zap.Float32("replaced_lr", lrBefore))
	}
	if lost := resetLoss(ck); lost != "" {
		o.warn(fmt.Sprintf("resumed at global step %d from a checkpoint whose error buffers were reset (made on %d ranks, by rank %d): %s",
			gs, ck.World, ck.Rank, lost),
			zap.Int64("global_step", gs), zap.Int("made_on_world", ck.World), zap.Int("made_by_rank", ck.Rank))
	}
}

// resetLoss says what the load of ck restarted from zero and what it
// carried, when ck's error buffers were reset and it had some to lose; ""
// when nothing restarted: an exact optimizer's or zero.Adam's checkpoint
// (no error feedback), outer.Regroup's of the outer optimizer with the
// sparse codec (the old ranks' mean of the accumulators) or with a codec
// that keeps no error feedback.
func resetLoss(ck *optim.Checkpoint) string {
	if !ck.ErrorsReset {
		return ""
	}
	const byRank = "the rank that made it"
	switch alg := ck.Algorithm; {
	case alg == optim.AlgorithmOnebitAdam, alg == optim.AlgorithmOnebitLamb, alg == optim.AlgorithmZeroOneAdam:
		return "the error feedback starts again from zero; the parameters, moments and counters of " + byRank + " are carried " +
			"(onebit.Regroup of every old rank's state keeps the error feedback: docs/gomlx.md, \"Changing the number of ranks\")"
	case alg == onebit.AlgorithmMuon:
		return "the error feedback starts again from zero; the parameters, AdamW moments and counters of " + byRank + " are carried, and its momenta alone, " +
			"not the ranks' mean (onebit.Regroup of every old rank's state keeps the error feedback and takes the momenta's mean: " +
			"docs/gomlx.md, \"Changing the number of ranks\")"
	case strings.HasPrefix(alg, outer.AlgorithmPrefix):
		carried := "θ_g and u, and the inner optimizer's state and local parameters of " + byRank + ", are carried"
		switch {
		case ck.Tensor(outer.TensorRegroupedAccumulator) != nil:
			return ""
		case ck.Floats[optim.HyperPrefix+"outer_codec"] == float64(outer.CodecSparse):
			return "the sparse accumulator starts again from zero (outer.Regroup of every old rank's state carries their mean); " + carried
		case ck.Floats[optim.HyperPrefix+"outer_codec"] == float64(outer.CodecOneBit):
			return "the 1-bit codec's error feedback starts again from zero (outer.Regroup of every old rank's state carries it); " + carried
		}
	}
	return ""
}

// adamGroup is the auxiliary AdamW group of a Muon-family optimizer
// (exact or 1-bit Muon), whose learning rate is its own, seen through the
// optimizers that wrap another (Inner); nil when opt has none.
func adamGroup(opt optim.Optimizer) interface{ AdamLR() float32 } {
	for opt != nil {
		if a, ok := opt.(interface{ AdamLR() float32 }); ok {
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

// warnAdamLR warns, on rank 0, when the load of ck replaced the AdamW
// group's fixed learning rate, before the load, with another: the hook's
// learning rate is the Muon group's only, so the AdamW group's stays the
// checkpoint's unless the program sets it after the load.
func (o *Optimizer) warnAdamLR(ck *optim.Checkpoint, gs int64, before float32) {
	in := innermost(ck)
	lr, ok := in.Floats[optim.FloatAdamLR]
	if o.rank() != 0 || !ok || in.Ints[optim.IntAdamLRSchedule] != 0 || float32(lr) == before {
		return
	}
	o.warn(fmt.Sprintf("resumed at global step %d with the checkpoint's AdamW group learning rate %v instead of the optimizer's %v (its config's AdamLR): "+
		"the lowbit optimizer's Load restores it. To train on with another, call the Muon optimizer's SetAdamLR once Restored() is true, "+
		"before the first lowbit step (a train.Loop hook of priority below HookPriority, as the GPT example's resumeLR)",
		gs, float32(lr), before),
		zap.Int64("global_step", gs), zap.Float64("checkpoint_adam_lr", lr), zap.Float32("replaced_adam_lr", before))
}

// legacyState decodes the state an older checkpoint held in sv, in place.
func (o *Optimizer) legacyState(sv *model.Variable, gs int64) (*optim.Checkpoint, error) {
	val, err := sv.Value()
	if err != nil {
		return nil, fmt.Errorf("lbgomlx: %s: %w", StateVariable, err)
	}
	ck := new(optim.Checkpoint)
	var derr error
	if err := tensors.ConstFlatData(val, func(b []uint8) {
		if len(b) < 8 {
			derr = fmt.Errorf("lbgomlx: %s holds %d bytes: %w", StateVariable, len(b), optim.ErrCorruptCheckpoint)
			return
		}
		if step := int64(binary.LittleEndian.Uint64(b)); step != gs {
			derr = fmt.Errorf("lbgomlx: the checkpoint's lowbit state is from global step %d, its model from step %d (save with Optimizer.Save, not Handler.Save): %w",
				step, gs, optim.ErrIncompatibleCheckpoint)
			return
		}
		if err := ck.UnmarshalBinary(b[8:]); err != nil {
			derr = fmt.Errorf("lbgomlx: %s: %w", StateVariable, err)
		}
	}); err != nil {
		return nil, fmt.Errorf("lbgomlx: %s: %w", StateVariable, err)
	}
	if derr != nil {
		return nil, derr
	}
	return ck, nil
}

// stateFile reads the state file of global step gs from the directory of
// the store's checkpoint.Handler. It returns nil, with no error, when no
// checkpoint was loaded (a fresh start, whatever state files the
// directory holds) or when the loaded checkpoint has no lowbit state at
// all (a warning says the lowbit optimizer starts afresh).
func (o *Optimizer) stateFile(gs int64) (*optim.Checkpoint, error) {
	h, _ := o.store.Loader().(*checkpoint.Handler)
	dir := h.Dir()
	if dir == "" {
		if gs > 0 && o.rank() == 0 {
			o.warn(fmt.Sprintf("the model is at global step %d but no checkpoint directory holds its lowbit state: the lowbit optimizer starts afresh", gs),
				zap.Int64("global_step", gs))
		}
		return nil, nil
	}
	path := filepath.Join(dir, stateFileName(gs))
	ck, err := optim.LoadFile(path)
	if err == nil {
		return ck, nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("lbgomlx: %w", err)
	}
	list, err := h.ListCheckpoints()
	if err != nil || len(list) == 0 {
		return nil, nil // nothing was loaded: a fresh start
	}
	steps, err := stateSteps(dir)
	if err != nil {
		return nil, fmt.Errorf("lbgomlx: %w", err)
	}
	if len(steps) > 0 {
		return nil, missingState(dir, gs, steps, list)
	}
	if gs > 0 {
		o.warn(fmt.Sprintf("the model's checkpoint of global step %d in %s holds no lowbit state (%s): the lowbit optimizer starts afresh",
			gs, dir, stateFileName(gs)), zap.Int64("global_step", gs), zap.String("dir", dir))
	}
	return nil, nil
}

// missingState is the error for a directory whose model checkpoint of
// global step gs, the one loaded, has no state file beside it while state
// files of other steps (ascending) are there. It says what the directory
// shows: where a model checkpoint of another step has its state file
// beside it, its checkpoints were saved with Optimizer.Save, which writes
// the state file before the model, so this one was removed or lost since
// (or this checkpoint alone was saved with checkpoint.Handler.Save);
// where none has, they were saved with Handler.Save.
func missingState(dir string, gs int64, steps []int64, models []string) error {
	newest := steps[len(steps)-1]
	paired := int64(-1)
	for _, base := range models {
		if s, ok := checkpointStep(base); ok && s != gs && slices.Contains(steps, s) {
			paired = max(paired, s)
		}
	}
	what := fmt.Sprintf("the checkpoint's lowbit state is from global step %d, its model from step %d: %s holds no %s", newest, gs, dir, stateFileName(gs))
	if paired >= 0 {
		return fmt.Errorf("lbgomlx: %s. Its checkpoint of step %d has its lowbit state beside it, as Optimizer.Save writes it (the state file first, then the model), "+
			"so the state file of step %d was removed or lost after it was written (or that checkpoint alone was saved with checkpoint.Handler.Save). "+
			"Restore %s, or set the model's checkpoint of step %d aside to resume from step %d: %w",
			what, paired, gs, stateFileName(gs), gs, paired, optim.ErrIncompatibleCheckpoint)
	}
	return fmt.Errorf("lbgomlx: %s, and no model checkpoint there has its lowbit state beside it: they were saved with checkpoint.Handler.Save, "+
		"which writes the model only (save with Optimizer.Save), or their state files were removed: %w", what, optim.ErrIncompatibleCheckpoint)
}

// Save saves a checkpoint of this rank with h: the lowbit optimizer's
// state of the current global step to its state file in h's directory
// (written atomically, see StateFilePrefix), then the model with
// checkpoint.Handler.Save, without the gradient variables; then it removes
// the state files of the steps whose GoMLX checkpoint h no longer keeps.
// The state is streamed to its file: beyond the optimizer it costs one
// copy of the state (optim.Optimizer's State) while Save runs, and nothing
// afterwards. It is not a collective: each rank saves its own state, to
// its own directory. A Save to h at the global step of the last Save to h,
// with no step since, writes nothing: a last Save after a RunSteps whose
// train.EveryNSteps already saved its last step adds no second checkpoint.
//
// Before the first training step of this process (no lowbit optimizer
// yet) Save works as GoMLX's Handler.Save does then: it saves the
// variables there are. When the store's variables came from a checkpoint
// with a lowbit state (its state file, of the loaded global step, in the
// directory of the Handler Checkpoint returned or of the store's loader),
// that state is saved with them: it is already in h's directory when h
// loaded it, or it is copied there. Otherwise (a fresh start) no lowbit
// state is saved: there is none yet, and a run resumed from that
// checkpoint starts the lowbit optimizer afresh.
func (o *Optimizer) Save(h *checkpoint.Handler) error {
	if h == nil {
		return errors.New("lbgomlx: Save: nil checkpoint.Handler")
	}
	dir := h.Dir()
	if dir == "" {
		return fmt.Errorf("lbgomlx: Save: %s has no directory to save the lowbit state to", h)
	}
	if o.opt == nil {
		return o.saveUnbuilt(h)
	}
	at := [2]int64{o.globalStep(), o.opt.Stats().Steps}
	if last, ok := o.saved[h]; ok && last == at {
		return nil // saved already, nothing trained since
	}
	if err := o.saveState(filepath.Join(dir, stateFileName(at[0]))); err != nil {
		return err
	}
	h.ExcludeVarsFromSaving(o.grads...)
	if err := h.Save(); err != nil {
		return fmt.Errorf("lbgomlx: Save: %w", err)
	}
	if o.saved == nil {
		o.saved = map[*checkpoint.Handler][2]int64{}
	}
	o.saved[h] = at
	o.pruneStates(h)
	return nil
}

// saveUnbuilt is Save before the lowbit optimizer is built.
func (o *Optimizer) saveUnbuilt(h *checkpoint.Handler) error {
	if o.failed != nil {
		return fmt.Errorf("lbgomlx: Save after the first training graph failed: %w", o.failed)
	}
	srcDir, step := o.loadedDir, o.loadedStep
	if o.store != nil {
		src, _ := o.store.Loader().(*checkpoint.Handler)
		srcDir, step = src.Dir(), globalStepOf(o.store)
	}
	switch {
	case o.carry != nil && srcDir == h.Dir():
		// The state of another number of ranks is in memory; the
		// directory keeps the old group's, which a rerun regroups again.
	case o.carry != nil:
		if err := optim.SaveFile(filepath.Join(h.Dir(), stateFileName(o.carry.step)), o.carry.ck); err != nil {
			return fmt.Errorf("lbgomlx: Save: %w", err)
		}
	case srcDir != "" && srcDir != h.Dir() && step >= 0:
		name := stateFileName(step)
		if err := copyFile(filepath.Join(srcDir, name), filepath.Join(h.Dir(), name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("lbgomlx: Save: copying the loaded lowbit state: %w", err)
		}
	}
	h.ExcludeVarsFromSaving(o.grads...)
	if err := h.Save(); err != nil {
		return fmt.Errorf("lbgomlx: Save: %w", err)
	}
	o.pruneStates(h)
	return nil
}

// copyFile copies src to dst atomically (a temporary file, synced, then
// renamed).
func copyFile(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(dst), 0o770); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), filepath.Base(dst)+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err = io.Copy(tmp, in); err != nil {
		return err
	}
	if err = tmp.Sync(); err != nil {
		return err
	}
	if err = tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}

// saveState writes the lowbit state to path; the checkpoint State returns
// is garbage once it returns.
func (o *Optimizer) saveState(path string) error {
	ck, err := o.opt.State()
	if err != nil {
		return fmt.Errorf("lbgomlx: Save: %w", err)
	}
	if err := optim.SaveFile(path, ck); err != nil {
		return fmt.Errorf("lbgomlx: Save: %w", err)
	}
	return nil
}

// pruneStates removes the state files of the steps of which h's directory
// holds no GoMLX checkpoint any more (checkpoint.Config.Keep removed
// them). A failure is logged, not returned: the checkpoint is saved.
func (o *Optimizer) pruneStates(h *checkpoint.Handler) {
	list, err := h.ListCheckpoints()
	if err == nil {
		kept := map[int64]bool{}
		for _, base := range list {
			if s, ok := checkpointStep(base); ok {
				kept[s] = true
			}
		}
		var steps []int64
		if steps, err = stateSteps(h.Dir()); err == nil {
			for _, s := range steps {
				if !kept[s] {
					if rerr := os.Remove(filepath.Join(h.Dir(), stateFileName(s))); rerr != nil && !errors.Is(rerr, fs.ErrNotExist) {
						err = rerr
					}
				}
			}
		}
	}
	if err != nil {
		o.log.Warn("removing lowbit state files of checkpoints no longer kept", zap.String("dir", h.Dir()), zap.Error(err))
	}
}

// SaveOnStepFn returns a train.OnStepFn that calls Save(h): use it where a
// GoMLX program uses h.SaveOnStepFn, e.g. with train.EveryNSteps (which
// runs at the last step of a RunSteps only when it is a multiple of N:
// call Save(h) once more after the loop, which writes nothing when that
// step is saved already).
func (o *Optimizer) SaveOnStepFn(h *checkpoint.Handler) train.OnStepFn {
	return func(*train.Loop, []*tensors.Tensor) error { return o.Save(h) }
}
