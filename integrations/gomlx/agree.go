package gomlx

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/gomlx/gomlx/ml/train/optimizer"
	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// The first training graph runs two agreements, each one allgather of a
// small fixed-size record (and, only when the records differ, one more
// exchange that names the difference, after which every rank fails):
//
//   - agreeOnModel, before anything else is communicated: every rank's
//     trainable variables (a fingerprint of their paths and shapes) and
//     GoMLX's global step;
//   - agreeOnSettings, once the lowbit optimizer is built and its state
//     restored: what decides training (settings: whether a lowbit state
//     was restored, the optimizer, its stage and counters, the learning
//     rate and its source, every recorded hyperparameter, WithMeanMetrics)
//     and the trainable variables' values (a hash: after the broadcast
//     they are rank 0's, after a restore each rank's checkpoint's).

// gatherRecords all-gathers every rank's agreement record (mine, one
// rank's alone on one rank) and returns them in rank order; with localErr
// it still takes part, then returns localErr (joined with the all-gather's
// error, if any).
func (o *Optimizer) gatherRecords(mine []byte, localErr error) ([]byte, error) {
	all := make([]byte, len(mine)*o.size())
	copy(all, mine)
	if o.size() > 1 {
		if err := o.c.AllGatherBytes(o.ctx, mine, all); err != nil {
			return nil, errors.Join(localErr, fmt.Errorf("lbgomlx: the first training step's agreement: %w", err))
		}
	}
	if localErr != nil {
		return nil, localErr
	}
	return all, nil
}

// agreeOnModel checks that every rank has the same trainable variables and
// is at the same global step. A rank with localErr returns it; the others
// an error naming it.
func (o *Optimizer) agreeOnModel(localErr error) error {
	const rec = 16
	mine := make([]byte, rec)
	if localErr == nil {
		binary.LittleEndian.PutUint64(mine, o.fingerprint())
		binary.LittleEndian.PutUint64(mine[8:], uint64(o.globalStep()))
	}
	size := o.size()
	all, err := o.gatherRecords(mine, localErr)
	if err != nil {
		return err
	}
	differ := false
	for r := range size {
		switch fp := binary.LittleEndian.Uint64(all[rec*r:]); {
		case fp == 0:
			return fmt.Errorf("lbgomlx: rank %d failed at the first training step (its error says why)", r)
		case fp != binary.LittleEndian.Uint64(all):
			differ = true
		}
	}
	if differ {
		lists, err := o.exchangeText(o.describeVars())
		if err != nil {
			return fmt.Errorf("lbgomlx: the ranks have other trainable variables; exchanging them: %w", err)
		}
		return varsError(lists)
	}
	return checkSteps(all, rec, size)
}

// checkSteps refuses ranks whose models are at different global steps:
// every rank loaded its own newest checkpoint, and they are not of the
// same step. all holds each rank's record of rec bytes, the step at 8.
func checkSteps(all []byte, rec, size int) error {
	steps := make([]int64, size)
	same := true
	for r := range size {
		steps[r] = int64(binary.LittleEndian.Uint64(all[rec*r+8:]))
		same = same && steps[r] == steps[0]
	}
	if same {
		return nil
	}
	var b strings.Builder
	for r, s := range steps {
		if r > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "rank %d at %d", r, s)
	}
	return fmt.Errorf("lbgomlx: the ranks' models are at different global steps (%s): each rank loaded its own newest checkpoint. "+
		"Build every rank's checkpoint.Handler with Optimizer.Checkpoint, which resumes every rank from the newest step they all hold, "+
		"or delete every rank's checkpoints to start afresh", b.String())
}

// fingerprint hashes the paths and shapes of the trainable variables.
func (o *Optimizer) fingerprint() uint64 {
	h := fnv.New64a()
	h.Write([]byte(o.describeVars()))
	s := h.Sum64()
	if s == 0 {
		s = 1 // 0 means a failed rank
	}
	return s
}

// describeVars lists the trainable variables, one "path shape" line each.
func (o *Optimizer) describeVars() string {
	var b strings.Builder
	for i, v := range o.vars {
		fmt.Fprintf(&b, "%s %s\n", v.Path(), o.shapes[i])
	}
	return b.String()
}

// varsError names how each rank's trainable variables (lists, as
// describeVars writes them) differ from rank 0's: at most a few
// differences per rank.
func varsError(lists []string) error {
	type entry struct{ path, shape string }
	parse := func(s string) []entry {
		var out []entry
		for line := range strings.Lines(s) {
			path, shape, _ := strings.Cut(strings.TrimSuffix(line, "\n"), " ")
			out = append(out, entry{path, shape})
		}
		return out
	}
	const most = 3
	first := parse(lists[0])
	var diffs []string
	for r := 1; r < len(lists); r++ {
		if lists[r] == lists[0] {
			continue
		}
		other := parse(lists[r])
		shapeOf := func(es []entry, path string) (string, bool) {
			for _, e := range es {
				if e.path == path {
					return e.shape, true
				}
			}
			return "", false
		}
		var d []string
		for _, e := range first {
			switch s, ok := shapeOf(other, e.path); {
			case !ok:
				d = append(d, fmt.Sprintf("%s %s is on rank 0, not on rank %d", e.path, e.shape, r))
			case s != e.shape:
				d = append(d, fmt.Sprintf("%s is %s on rank 0 and %s on rank %d", e.path, e.shape, s, r))
			}
		}
		for _, e := range other {
			if _, ok := shapeOf(first, e.path); !ok {
				d = append(d, fmt.Sprintf("%s %s is on rank %d, not on rank 0", e.path, e.shape, r))
			}
		}
		if len(d) == 0 {
			d = append(d, fmt.Sprintf("rank %d holds the same variables in another order", r))
		}
		if len(d) > most {
			d = append(d[:most], fmt.Sprintf("%d more", len(d)-most))
		}
		diffs = append(diffs, d...)
	}
	return fmt.Errorf("lbgomlx: the ranks have other trainable variables (every rank must build the same model): %s", strings.Join(diffs, "; "))
}

// exchangeText gives every rank every rank's s (see allGatherVar).
func (o *Optimizer) exchangeText(s string) ([]string, error) {
	all, err := o.allGatherVar([]byte(s), false)
	if err != nil {
		return nil, err
	}
	out := make([]string, len(all))
	for r, b := range all {
		out[r] = string(b)
	}
	return out, nil
}

// allGatherVar gives every rank every rank's mine, whatever its length, in
// rank order: an allgather of the lengths, then one of the bytes, padded
// to the longest. A rank that has nothing to send (absent true) takes part
// and is nil in the result; every other rank's entry is not nil, even
// empty.
func (o *Optimizer) allGatherVar(mine []byte, absent bool) ([][]byte, error) {
	size := o.size()
	if absent {
		mine = nil
	} else if mine == nil {
		mine = []byte{}
	}
	if size == 1 {
		return [][]byte{mine}, nil
	}
	n := int64(len(mine))
	if absent {
		n = -1
	}
	lens := make([]byte, 8*size)
	if err := o.c.AllGatherBytes(o.ctx, binary.LittleEndian.AppendUint64(nil, uint64(n)), lens); err != nil {
		return nil, err
	}
	most := 0
	for r := range size {
		most = max(most, int(int64(binary.LittleEndian.Uint64(lens[8*r:]))))
	}
	padded := make([]byte, most)
	copy(padded, mine)
	all := make([]byte, most*size)
	if most > 0 {
		if err := o.c.AllGatherBytes(o.ctx, padded, all); err != nil {
			return nil, err
		}
	}
	out := make([][]byte, size)
	for r := range size {
		if k := int64(binary.LittleEndian.Uint64(lens[8*r:])); k >= 0 {
			out[r] = all[most*r : most*r+int(k) : most*r+int(k)]
		}
	}
	return out, nil
}

// settings is what this rank's training is decided by, as agreeOnSettings
// compares it.
type settings struct {
	// text holds one "name: value" line per setting.
	text string
	// values hashes the trainable variables' values, perVar each one's.
	values uint64
	perVar []uint64
	// mayDiffer is set when the ranks' values may differ: 0/1 Adam's
	// phase B takes local steps between its synchronizations.
	mayDiffer bool
	// global is set when values hashes the lowbit optimizer's global
	// parameters (a GlobalHolder) rather than this rank's own.
	global bool
}

// settings collects this rank's settings, once the lowbit optimizer is
// built and its state restored (ck, nil for none): the optimizer's own
// record of them (its State, whose tensors are dropped at once) and the
// learning rate's source. It refuses a lowbit optimizer whose learning
// rate cannot follow GoMLX's setting (see lrConflict).
func (o *Optimizer) settings(ck *optim.Checkpoint) (*settings, error) {
	st, err := o.opt.State()
	if err != nil {
		return nil, fmt.Errorf("lbgomlx: the lowbit optimizer's settings: %w", err)
	}
	st.Tensors = nil
	// The learning rate, its schedule, the step counters and the
	// gradient reduction are the innermost optimizer's (the outer
	// optimizer's SetLR sets its inner one's).
	in := innermost(st)
	if err := lrConflict(o.lrSrc, o.lrParam, in.Ints[optim.IntLRSchedule] != 0, o.lrs != nil); err != nil {
		return nil, err
	}
	var b strings.Builder
	add := func(name, format string, args ...any) {
		fmt.Fprintf(&b, "%s: %s\n", name, fmt.Sprintf(format, args...))
	}
	add("lowbit optimizer", "%s on %d ranks", st.Algorithm, st.World)
	if o.restored {
		add("lowbit state", "restored from its checkpoint of global step %d", o.globalStep())
	} else {
		add("lowbit state", "none restored (the lowbit optimizer starts afresh)")
	}
	add("lowbit stage", "%s", st.Stage)
	add("lowbit steps", "%d applied (%d skipped)", in.Ints[optim.IntStep], in.Ints[optim.IntSkipped])
	add("learning rate from", "%s", o.lrSrc)
	switch o.lrSrc {
	case lrStore:
		lr, err := storeLR(o.lrVar)
		if err != nil {
			return nil, err
		}
		add("learning rate", "%v", lr)
	case lrGraph:
		add("learning rate", "computed by the graph from learning_rate %s", o.lrParam)
	default:
		if fp := in.Ints[optim.IntLRSchedule]; fp != 0 {
			add("learning rate", "the lowbit optimizer's schedule (fingerprint %016x)", uint64(fp))
		} else {
			add("learning rate", "%v", float32(in.Floats[optim.FloatLR]))
		}
	}
	if alr, ok := in.Floats[optim.FloatAdamLR]; ok {
		// Muon's AdamW group: its learning rate is the lowbit optimizer's
		// own (the hook's is the Muon group's), compared here only.
		if fp := in.Ints[optim.IntAdamLRSchedule]; fp != 0 {
			add("AdamW group's learning rate", "the lowbit optimizer's schedule (fingerprint %016x)", uint64(fp))
		} else {
			add("AdamW group's learning rate", "%v", float32(alr))
		}
	}
	if mode, ok := in.Ints[optim.IntGradReduce]; ok {
		add("gradient reduction", "%s", optim.ReduceMode(mode))
	}
	for _, name := range slices.Sorted(maps.Keys(st.Floats)) {
		// A wrapping optimizer (outer.Optimizer) records its inner one's
		// hyperparameters under a prefix of its own ("inner/hyper/...").
		if isHyper(name) {
			add(name, "%s", optim.FormatHyper(st.Floats[name]))
		}
	}
	add("WithMeanMetrics", "%t", o.meanMetrics)
	if ck != nil && o.rank() == 0 {
		o.warnUnchecked(ck, st)
	}
	s := &settings{text: b.String(), mayDiffer: st.Stage == optim.StagePhaseB}
	if g := o.global(); g != nil {
		// The ranks' own parameters differ between exchanges; the global
		// ones must not.
		cut, err := o.splitGlobal(g)
		if err != nil {
			return nil, err
		}
		s.values, s.perVar = hashValues(cut)
		s.global = true
		return s, nil
	}
	data := make([][]float32, len(o.params))
	for i, p := range o.params {
		data[i] = p.Data()
	}
	s.values, s.perVar = hashValues(data)
	return s, nil
}

// innermost returns the counters and scalars of a lowbit optimizer's
// checkpoint ck that its innermost optimizer recorded, seen through the
// optimizers that wrap another: outer.Optimizer records its inner
// optimizer's under outer.InnerPrefix, and its learning rate (SetLR, LR),
// schedule, step counters and gradient reduction are that optimizer's.
// It is ck itself for an optimizer that wraps none; otherwise a checkpoint
// of those Ints and Floats only, their names without the prefix. Every
// check of a learning rate, a schedule or a step counter in a checkpoint
// reads it there.
func innermost(ck *optim.Checkpoint) *optim.Checkpoint {
	for {
		in := &optim.Checkpoint{Algorithm: ck.Algorithm, Stage: ck.Stage, Ints: map[string]int64{}, Floats: map[string]float64{}}
		for name, v := range ck.Ints {
			if rest, ok := strings.CutPrefix(name, outer.InnerPrefix); ok {
				in.Ints[rest] = v
			}
		}
		for name, v := range ck.Floats {
			if rest, ok := strings.CutPrefix(name, outer.InnerPrefix); ok {
				in.Floats[rest] = v
			}
		}
		if len(in.Ints) == 0 && len(in.Floats) == 0 {
			return ck
		}
		ck = in
	}
}

// isHyper reports whether the checkpoint entry name is a recorded
// hyperparameter: optim.HyperPrefix at the top, or under a wrapping
// optimizer's prefix ("inner/hyper/...").
func isHyper(name string) bool {
	return strings.HasPrefix(name, optim.HyperPrefix) || strings.Contains(name, "/"+optim.HyperPrefix)
}

// splitGlobal cuts the lowbit optimizer's flat global parameters g into
// one slice per trainable variable.
func (o *Optimizer) splitGlobal(g []float32) ([][]float32, error) {
	cut := make([][]float32, len(o.params))
	off := 0
	for i, p := range o.params {
		m := len(p.Data())
		if off+m > len(g) {
			return nil, fmt.Errorf("lbgomlx: the lowbit optimizer's global parameters hold %d elements, fewer than the trainable variables", len(g))
		}
		cut[i] = g[off : off+m]
		off += m
	}
	if off != len(g) {
		return nil, fmt.Errorf("lbgomlx: the lowbit optimizer's global parameters hold %d elements, the trainable variables %d", len(g), off)
	}
	return cut, nil
}

// warnUnchecked warns about the hyperparameters the loaded checkpoint ck
// does not record (made before they were recorded: the optimizer keeps
// its own values, unchecked) and about a gradient reduction mode other
// than the checkpoint's (the resumed run is not bit-identical). st is the
// optimizer's own record.
func (o *Optimizer) warnUnchecked(ck, st *optim.Checkpoint) {
	var missing []string
	for name := range st.Floats {
		if _, ok := ck.Floats[name]; !ok && isHyper(name) {
			missing = append(missing, strings.Replace(name, optim.HyperPrefix, "", 1))
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		o.warn(fmt.Sprintf("the restored checkpoint does not record the hyperparameters %s (made before they were recorded): "+
			"the optimizer keeps its own values, unchecked", strings.Join(missing, ", ")), zap.Strings("hyperparameters", missing))
	}
	if m, ok := innermost(ck).Ints[optim.IntGradReduce]; ok && m != innermost(st).Ints[optim.IntGradReduce] {
		o.warn(fmt.Sprintf("the restored checkpoint was made with gradient reduction %s, this optimizer uses %s: the resumed run is not bit-identical",
			optim.ReduceMode(m), optim.ReduceMode(innermost(st).Ints[optim.IntGradReduce])))
	}
}

// hashValues hashes the trainable variables' values (data, one slice per
// variable), all of them and each one.
func hashValues(data [][]float32) (uint64, []uint64) {
	all := fnv.New64a()
	per := make([]uint64, len(data))
	var buf [4]byte
	for i, d := range data {
		h := fnv.New64a()
		for _, x := range d {
			binary.LittleEndian.PutUint32(buf[:], math.Float32bits(x))
			h.Write(buf[:])
		}
		per[i] = h.Sum64()
		all.Write(binary.LittleEndian.AppendUint64(nil, per[i]))
	}
	return all.Sum64(), per
}

// agreeOnSettings checks that every rank's settings (set) are the same,
// and its trainable variables' values too unless they may differ. A rank
// with localErr returns it; the others an error naming it.
func (o *Optimizer) agreeOnSettings(set *settings, localErr error) error {
	const rec = 32
	mine := make([]byte, rec)
	if localErr == nil {
		mine[0] = 1
		h := fnv.New64a()
		h.Write([]byte(set.text))
		binary.LittleEndian.PutUint64(mine[8:], h.Sum64())
		binary.LittleEndian.PutUint64(mine[16:], set.values)
		if set.mayDiffer {
			mine[24] = 1
		}
	}
	size := o.size()
	all, err := o.gatherRecords(mine, localErr)
	if err != nil {
		return err
	}
	settingsDiffer, valuesDiffer, mayDiffer := false, false, false
	for r := range size {
		rr := all[rec*r:]
		if rr[0] != 1 {
			return fmt.Errorf("lbgomlx: rank %d failed at the first training step (its error says why)", r)
		}
		settingsDiffer = settingsDiffer || binary.LittleEndian.Uint64(rr[8:]) != binary.LittleEndian.Uint64(mine[8:])
		valuesDiffer = valuesDiffer || binary.LittleEndian.Uint64(rr[16:]) != set.values
		mayDiffer = mayDiffer || rr[24] != 0
	}
	if settingsDiffer {
		texts, err := o.exchangeText(set.text)
		if err != nil {
			return fmt.Errorf("lbgomlx: the ranks' settings differ; exchanging them: %w", err)
		}
		return settingsError(texts)
	}
	if valuesDiffer && !mayDiffer {
		return o.valuesError(set)
	}
	return nil
}

// settingsError names every setting whose value differs between the
// ranks (texts, as settings writes them), with each rank's value.
func settingsError(texts []string) error {
	var names []string
	values := make([]map[string]string, len(texts))
	for r, t := range texts {
		values[r] = map[string]string{}
		for line := range strings.Lines(t) {
			name, value, _ := strings.Cut(strings.TrimSuffix(line, "\n"), ": ")
			if !slices.Contains(names, name) {
				names = append(names, name)
			}
			values[r][name] = value
		}
	}
	stateDiffers := false
	for r := range texts {
		stateDiffers = stateDiffers || values[r]["lowbit state"] != values[0]["lowbit state"]
	}
	var diffs []string
	for _, name := range names {
		var distinct []string
		ranks := map[string][]int{}
		for r := range texts {
			v, ok := values[r][name]
			if !ok {
				v = "(not set)"
			}
			if _, seen := ranks[v]; !seen {
				distinct = append(distinct, v)
			}
			ranks[v] = append(ranks[v], r)
		}
		if len(distinct) < 2 {
			continue
		}
		if stateDiffers && (name == "lowbit stage" || name == "lowbit steps") {
			continue // follows from the state
		}
		parts := make([]string, len(distinct))
		for i, v := range distinct {
			parts[i] = fmt.Sprintf("%s on %s", v, formatRanks(ranks[v]))
		}
		diffs = append(diffs, fmt.Sprintf("%s: %s", name, strings.Join(parts, " and ")))
	}
	hint := "give every rank the same optimizer, settings and learning rate"
	if stateDiffers {
		hint = "a rank whose checkpoint directory holds no lowbit state (" + StateFilePrefix + "*" + StateFileSuffix +
			") of the step the others restored: put back that rank's state file, or delete every rank's checkpoints to start afresh"
	}
	return fmt.Errorf("lbgomlx: the ranks disagree on what decides training, so none trains: %s. To fix: %s", strings.Join(diffs, "; "), hint)
}

// formatRanks writes "rank 1" or "ranks 0, 2, 3".
func formatRanks(ranks []int) string {
	if len(ranks) == 1 {
		return "rank " + strconv.Itoa(ranks[0])
	}
	s := make([]string, len(ranks))
	for i, r := range ranks {
		s[i] = strconv.Itoa(r)
	}
	return "ranks " + strings.Join(s, ", ")
}

// valuesError names the first trainable variable whose values differ
// between the ranks, after an allgather of every variable's hash.
func (o *Optimizer) valuesError(set *settings) error {
	size := o.size()
	n := len(set.perVar)
	mine := make([]byte, 8*n)
	for i, h := range set.perVar {
		binary.LittleEndian.PutUint64(mine[8*i:], h)
	}
	all := make([]byte, len(mine)*size)
	if err := o.c.AllGatherBytes(o.ctx, mine, all); err != nil {
		return fmt.Errorf("lbgomlx: the ranks' trainable variables differ; exchanging their hashes: %w", err)
	}
	for i := range n {
		var groups []string
		ranks := map[uint64][]int{}
		var order []uint64
		for r := range size {
			h := binary.LittleEndian.Uint64(all[len(mine)*r+8*i:])
			if _, seen := ranks[h]; !seen {
				order = append(order, h)
			}
			ranks[h] = append(ranks[h], r)
		}
		if len(order) < 2 {
			continue
		}
		for _, h := range order {
			groups = append(groups, fmt.Sprintf("%s (hash %016x)", formatRanks(ranks[h]), h))
		}
		what := "after the broadcast of rank 0's values"
		if o.restored {
			what = "after each rank restored its own checkpoint: the ranks' checkpoints are not of the same run (or one was changed); " +
				"put back the same run's checkpoints, or delete every rank's checkpoints to start afresh"
		}
		if set.global {
			what = "in the lowbit optimizer's global parameters (Global), which every rank must hold alike, " + what
		}
		return fmt.Errorf("lbgomlx: the ranks' trainable variables hold different values, so none trains: %q differs between %s, %s",
			o.vars[i].Path(), strings.Join(groups, " and "), what)
	}
	return errors.New("lbgomlx: the ranks' trainable variables hold different values, so none trains")
}

// unusedSettings are GoMLX's optimizer parameters that the lowbit
// optimizer does not read, with what to do instead.
var unusedSettings = []struct{ param, instead string }{
	{optimizer.ParamClipStepByValue, "lowbit does not clip steps: 1-bit Adam bounds its update ratio, LAMB its trust ratio (MaxCoeff, MinCoeff)"},
	{optimizer.ParamAdamEpsilon, "set Eps in the lowbit optimizer's config"},
	{optimizer.ParamAdamWeightDecay, "set WeightDecay in the lowbit optimizer's config"},
	{optimizer.ParamAdamBackoffSteps, "lowbit has no back-off steps; a warm-up is a schedule: optim.LinearWarmup with SetSchedule, or GoMLX's cosineschedule with its warm-up"},
}

// warnUnusedSettings warns, on rank 0, about GoMLX optimizer parameters
// the store sets that the lowbit optimizer does not use.
func (o *Optimizer) warnUnusedSettings() {
	if o.rank() != 0 {
		return
	}
	root := o.store.RootScope()
	for _, u := range unusedSettings {
		v, ok := root.GetParam(u.param)
		if !ok || v == nil || isZero(v) {
			continue
		}
		o.warn(fmt.Sprintf("the store sets GoMLX's optimizer parameter %s = %v, which the lowbit optimizer does not use: %s", u.param, v, u.instead),
			zap.String("param", u.param))
	}
}

// isZero reports whether v is a zero number, false or "".
func isZero(v any) bool {
	switch x := v.(type) {
	case float64:
		return x == 0
	case float32:
		return x == 0
	case int:
		return x == 0
	case int64:
		return x == 0
	case bool:
		return !x
	case string:
		return x == ""
	}
	return false
}
