package outer

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/optim"
)

// Checkpoint names of the outer optimizer's state. The inner optimizer's
// checkpoint is embedded: its parameter tensors (optim.ParamTensorName,
// this rank's θ_local) as they are, every other tensor, counter and scalar
// under InnerPrefix; its stage is the checkpoint's Stage. An inner
// parameter tensor of another shape than the parameter's (the transpose
// an optim.Transposed keeps) goes under InnerPrefix too, and the
// parameter's own values, in its own shape, are the parameter tensor.
const (
	InnerPrefix    = "inner/"
	TensorGlobal   = "outer/global"   // θ_g, flat
	TensorMomentum = "outer/momentum" // u, flat
	TensorLaunch   = "outer/launch"   // θ_local of the pending fragment at its launch
	// TensorPendingGlobal and TensorPendingMomentum are the new θ_g and u
	// of the pending fragment, which its merge applies.
	TensorPendingGlobal   = "outer/pending_global"
	TensorPendingMomentum = "outer/pending_momentum"
	IntCalls              = "outer/calls"   // Step calls (inner steps)
	IntPending            = "outer/pending" // fragment launched and not yet merged, -1 none
	IntLaunchedAt         = "outer/launched_at"
	IntExchanges          = "outer/exchanges"
	IntSkipped            = "outer/skipped_exchanges"
	IntBucketBytes        = "outer/bucket_bytes" // CodecOneBit's bucket size in effect
	errorBufferSuffix     = "outer:f%d:b%d"
)

// AccumulatorName names CodecSparse's error accumulator (flat, every
// parameter element): optim.WorkerErrorName + "/outer:accumulator", which
// optim.IsErrorBuffer recognises (so that Checkpoint.ResetErrors drops it,
// and the accumulator restarts from zero).
const AccumulatorName = optim.WorkerErrorName + "/outer:accumulator"

// ServerAccumulatorName names SparseTwoPhase's server accumulator (this
// rank's: per fragment, over the run of chunks it owns, concatenated):
// optim.ServerErrorName + "/outer:server_accumulator", which
// optim.IsErrorBuffer recognises (Checkpoint.ResetErrors drops it).
const ServerAccumulatorName = optim.ServerErrorName + "/outer:server_accumulator"

// WorkerErrorName and ServerErrorName name the 1-bit error buffers of
// bucket k of fragment f: optim.WorkerErrorName (ServerErrorName) + "/" +
// "outer:f<f>:b<k>", which optim.IsErrorBuffer recognises (so that
// Checkpoint.ResetErrors drops them).
func WorkerErrorName(f, k int) string {
	return optim.WorkerErrorName + "/" + fmt.Sprintf(errorBufferSuffix, f, k)
}

// ServerErrorName: see WorkerErrorName.
func ServerErrorName(f, k int) string {
	return optim.ServerErrorName + "/" + fmt.Sprintf(errorBufferSuffix, f, k)
}

// State returns a checkpoint of everything that decides the next step on
// this rank: the inner optimizer's checkpoint (θ_local, its moments and
// counters), θ_g, u (with a momentum: Config.Momentum 0 keeps none), the
// 1-bit error buffers or the sparse accumulator (and SparseTwoPhase's
// server accumulator), the call counter, the
// exchange counters, and the pending exchange. An exchange in flight is
// waited for (not merged): the checkpoint holds its result (the new θ_g
// and u of the fragment) and the parameters at its launch, so that a
// resumed run merges it at the same step. The settings that decide the steps are recorded as
// hyperparameters (optim.HyperPrefix + "outer_h", "outer_fragments",
// "outer_delay", "outer_codec", "outer_lr", "outer_momentum",
// "outer_nesterov", "outer_scale"). It refuses after a failure (see Step).
func (o *Optimizer) State() (*optim.Checkpoint, error) {
	o.settle()
	if o.broken != nil {
		return nil, fmt.Errorf("outer: state: a step failed, the state is not one a run can resume from: %w", o.broken)
	}
	ick, err := o.inner.State()
	if err != nil {
		return nil, fmt.Errorf("outer: inner optimizer's state: %w", err)
	}
	ck := &optim.Checkpoint{
		Algorithm: o.algorithm, World: o.world, Rank: o.rank, Stage: ick.Stage,
		Ints: map[string]int64{
			IntCalls: o.calls, IntPending: int64(o.pending), IntLaunchedAt: o.launchedAt,
			IntExchanges: o.outerSteps, IntSkipped: o.outerSkipped,
		},
		Floats: map[string]float64{},
	}
	for k, v := range ick.Ints {
		ck.Ints[InnerPrefix+k] = v
	}
	for k, v := range ick.Floats {
		ck.Floats[InnerPrefix+k] = v
	}
	for _, h := range o.cfg.hypers() {
		ck.Floats[optim.HyperPrefix+h.Name] = h.Value
	}
	byName := make(map[string]*optim.Param, len(o.params))
	for _, p := range o.params {
		byName[optim.ParamTensorName(p.Name)] = p
	}
	for _, t := range ick.Tensors {
		p, isParam := byName[t.Name]
		switch {
		case !strings.HasPrefix(t.Name, optim.ParamTensorName("")):
			t.Name = InnerPrefix + t.Name
		case isParam && !slices.Equal(t.Shape, p.Shape()):
			// The inner optimizer's own layout (a transpose): kept
			// for it, the parameter's values in the parameter's shape.
			ck.AddTensor(t.Name, p.Shape(), p.Data())
			t.Name = InnerPrefix + t.Name
		}
		ck.Tensors = append(ck.Tensors, t) // ick is ours: no copy needed
	}
	ck.AddTensor(TensorGlobal, []int{o.n}, o.global)
	if o.mom != nil {
		ck.AddTensor(TensorMomentum, []int{o.n}, o.mom)
	}
	if o.pending >= 0 {
		m := o.bounds[o.pending+1] - o.bounds[o.pending]
		ck.AddTensor(TensorLaunch, []int{m}, o.snap[:m])
		ck.AddTensor(TensorPendingGlobal, []int{m}, o.stage[:m])
		if o.mom != nil {
			ck.AddTensor(TensorPendingMomentum, []int{m}, o.work[:m])
		}
	}
	if o.sp != nil {
		ck.Tensors = append(ck.Tensors, optim.Tensor{Name: AccumulatorName, Shape: []int{o.n}, Data: o.sp.accumulator()})
		if o.sp.keepsServer() {
			ck.AddTensor(ServerAccumulatorName, []int{len(o.sp.srv)}, o.sp.srv)
		}
	}
	if o.states != nil {
		ck.Ints[IntBucketBytes] = int64(o.bbytes)
		for f, sts := range o.states {
			for k, st := range sts {
				ck.AddTensor(WorkerErrorName(f, k), []int{len(st.WorkerError)}, st.WorkerError)
				ck.AddTensor(ServerErrorName(f, k), []int{len(st.ServerError)}, st.ServerError)
			}
		}
	}
	return ck, nil
}

// optionalHyper says whether a setting is recorded only when not 0
// (Config.hypers), so that the checkpoints of 0 are as they were before
// the setting existed (AccumulatorBF16 false, the float32 accumulator of
// earlier versions, although DefaultConfigFor(CodecSparse) sets it).
func optionalHyper(name string) bool {
	return name == "outer_accumulator_bf16" || name == "outer_sparse_exchange" || name == "outer_sparse_server_density"
}

// formatHyper prints a recorded setting as the constructor's agreement
// does: the codec and the scale by name, Nesterov as true or false.
func formatHyper(name string, v float64) string {
	if v == math.Trunc(v) && math.Abs(v) < 1<<31 {
		switch name {
		case "outer_codec":
			return Codec(v).String()
		case "outer_scale":
			return formatScale(int64(v))
		case "outer_nesterov", "outer_accumulator_bf16":
			return strconv.FormatBool(v != 0)
		case "outer_sparse_exchange":
			return SparseExchange(v).String()
		}
	}
	return optim.FormatHyper(v)
}

// Load restores a checkpoint made by State of an outer optimizer of the
// same inner algorithm, world size (unless ck.ErrorsReset: the 1-bit error
// buffers then restart from zero), parameters and settings (H, Fragments,
// Delay, Codec, LR, Momentum, Nesterov; a difference is refused naming
// both values: a checkpoint made with a momentum does not load into an
// optimizer without, nor the other way round). With Momentum 0 a
// checkpoint's u, if it holds one (as those of earlier versions do), is
// ignored: it takes no part in the steps. Anything else is refused with an error wrapping
// optim.ErrIncompatibleCheckpoint, and changes nothing. An exchange in
// flight is waited for and dropped. Load clears the failure of an earlier
// exchange. It does not communicate: every rank loads its own checkpoint.
func (o *Optimizer) Load(ck *optim.Checkpoint) error {
	o.settle()
	if err := o.load(ck); err != nil {
		return fmt.Errorf("outer: load: %w", err)
	}
	return nil
}

func (o *Optimizer) load(ck *optim.Checkpoint) error {
	bad := optim.ErrIncompatibleCheckpoint
	if err := ck.CheckCompatible(o.algorithm, o.world, o.params); err != nil {
		return err
	}
	own := o.cfg.hypers()
	recorded := map[string]bool{}
	for _, h := range own {
		recorded[h.Name] = true
		v, ok := ck.Floats[optim.HyperPrefix+h.Name]
		if !ok && optionalHyper(h.Name) {
			// Recorded only when not 0: the checkpoint was made with
			// 0.
			ok, v = true, 0
		}
		if !ok {
			return fmt.Errorf("%w: setting %s is not recorded", bad, h.Name)
		}
		if math.Float64bits(v) != math.Float64bits(h.Value) {
			return fmt.Errorf("%w: made with %s %s, this optimizer has %s", bad, h.Name, formatHyper(h.Name, v), formatHyper(h.Name, h.Value))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(ck.Floats)) { // the first by name, on every rank
		name, ok := strings.CutPrefix(k, optim.HyperPrefix)
		switch {
		case !ok:
		case !strings.HasPrefix(name, "outer_"):
			return fmt.Errorf("%w: made with hyperparameter %s, which the outer optimizer does not have", bad, name)
		case !recorded[name]:
			// A setting recorded only when not its default
			// (optionalHyper).
			return fmt.Errorf("%w: made with %s %s, this optimizer has %s", bad, name, formatHyper(name, ck.Floats[k]), formatHyper(name, 0))
		}
	}
	var ints [5]int64
	for i, name := range []string{IntCalls, IntPending, IntLaunchedAt, IntExchanges, IntSkipped} {
		v, err := ck.Int(name)
		if err != nil {
			return err
		}
		ints[i] = v
	}
	calls, pending, launchedAt := ints[0], ints[1], ints[2]
	if calls < 0 || ints[3] < 0 || ints[4] < 0 {
		return fmt.Errorf("%w: negative counters", bad)
	}
	if pending >= 0 {
		switch merge := launchedAt + int64(o.cfg.Delay); {
		case o.cfg.Delay == 0 || pending >= int64(o.cfg.Fragments):
			return fmt.Errorf("%w: an exchange of fragment %d pending, which %d fragments with delay %d cannot have", bad, pending, o.cfg.Fragments, o.cfg.Delay)
		case launchedAt < 1 || launchedAt > calls || o.launchAt(launchedAt) != int(pending):
			return fmt.Errorf("%w: inconsistent pending exchange: fragment %d launched at step %d, %d steps taken", bad, pending, launchedAt, calls)
		case calls >= merge:
			return fmt.Errorf("%w: pending exchange past its merge: fragment %d, launched at step %d, merges at step %d, and the checkpoint was made after step %d", bad, pending, launchedAt, merge, calls)
		}
	} else if pending != -1 {
		return fmt.Errorf("%w: pending fragment %d", bad, pending)
	}
	global, err := ck.TensorData(TensorGlobal, o.n)
	if err != nil {
		return err
	}
	// With Momentum 0 u is not kept: the momentum tensors of a checkpoint
	// made with momentum 0 by an earlier version (which kept u, unused)
	// are ignored. A checkpoint of another momentum is refused above.
	var mom []float32
	if o.mom != nil {
		if mom, err = ck.TensorData(TensorMomentum, o.n); err != nil {
			return err
		}
	}
	var launch, pendingG, pendingU []float32
	if pending >= 0 {
		m := o.bounds[pending+1] - o.bounds[pending]
		if launch, err = ck.TensorData(TensorLaunch, m); err != nil {
			return err
		}
		if pendingG, err = ck.TensorData(TensorPendingGlobal, m); err != nil {
			return err
		}
		if o.mom != nil {
			if pendingU, err = ck.TensorData(TensorPendingMomentum, m); err != nil {
				return err
			}
		}
	}
	var errs [][2][]float32
	reset := ck.ErrorsReset
	perRank := o.states != nil || o.sp != nil
	if perRank && !reset && ck.Rank != o.rank {
		return fmt.Errorf("%w: made by rank %d, this is rank %d (the error buffers are per rank: load the rank's own, or outer.Regroup of every rank's; ck.ResetErrors() restarts them from zero)", bad, ck.Rank, o.rank)
	}
	var acc, srv []float32
	switch {
	case o.sp != nil && !reset:
		if acc, err = ck.TensorData(AccumulatorName, o.n); err != nil {
			return err
		}
		if o.sp.keepsServer() {
			if srv, err = ck.TensorData(ServerAccumulatorName, len(o.sp.srv)); err != nil {
				return err
			}
		}
	case o.sp != nil && ck.Tensor(TensorRegroupedAccumulator) != nil:
		if acc, err = ck.TensorData(TensorRegroupedAccumulator, o.n); err != nil {
			return err
		}
	}
	if o.states != nil && !reset {
		if b, ok := ck.Ints[IntBucketBytes]; !ok || b != int64(o.bbytes) {
			return fmt.Errorf("%w: made with 1-bit buckets of %d bytes, this optimizer has %d (load ck.ResetErrors() to restart the error feedback)", bad, b, o.bbytes)
		}
		for f, sts := range o.states {
			for k, st := range sts {
				we, err := ck.TensorData(WorkerErrorName(f, k), len(st.WorkerError))
				if err != nil {
					return err
				}
				se, err := ck.TensorData(ServerErrorName(f, k), len(st.ServerError))
				if err != nil {
					return err
				}
				errs = append(errs, [2][]float32{we, se})
			}
		}
	}
	ick := &optim.Checkpoint{
		Algorithm: strings.TrimPrefix(o.algorithm, AlgorithmPrefix), World: 1, Rank: 0, Stage: ck.Stage,
		Ints: map[string]int64{}, Floats: map[string]float64{},
	}
	for k, v := range ck.Ints {
		if name, ok := strings.CutPrefix(k, InnerPrefix); ok {
			ick.Ints[name] = v
		}
	}
	for k, v := range ck.Floats {
		if name, ok := strings.CutPrefix(k, InnerPrefix); ok {
			ick.Floats[name] = v
		}
	}
	idx := ck.Index()
	for _, t := range ck.Tensors {
		switch {
		case strings.HasPrefix(t.Name, optim.ParamTensorName("")):
			if idx.Tensor(InnerPrefix+t.Name) == nil { // else the inner optimizer's layout of it, below
				ick.Tensors = append(ick.Tensors, t)
			}
		case strings.HasPrefix(t.Name, InnerPrefix):
			t.Name = strings.TrimPrefix(t.Name, InnerPrefix)
			ick.Tensors = append(ick.Tensors, t)
		}
	}
	// Everything of ours is checked: the inner optimizer's Load checks its
	// part and changes nothing when it refuses; after it nothing fails.
	if err := o.inner.Load(ick); err != nil {
		return fmt.Errorf("inner optimizer: %w", err)
	}
	copy(o.global, global)
	copy(o.mom, mom)
	if launch != nil {
		copy(o.snap, launch)
		copy(o.stage, pendingG)
		copy(o.work, pendingU) // nil without momentum
	}
	if o.sp != nil {
		o.sp.setAccumulator(acc)
		if o.sp.keepsServer() {
			copy(o.sp.srv, srv)
			if srv == nil {
				clear(o.sp.srv)
			}
		}
	}
	i := 0
	for _, sts := range o.states {
		for _, st := range sts {
			if reset {
				st.Reset()
				continue
			}
			copy(st.WorkerError, errs[i][0])
			copy(st.ServerError, errs[i][1])
			i++
		}
	}
	if reset {
		o.logReset(ck, acc != nil)
	} else if from := ck.Ints[IntRegroupedFrom]; from > 0 {
		o.log.Info("loaded a regrouped checkpoint: the 1-bit codec's error feedback is carried (each worker error the old ranks' mean, the server errors re-cut), nothing restarts from zero; "+carriedState,
			zap.String("algorithm", o.algorithm), zap.Int64("made_on_world", from), zap.Int64("made_by_rank", int64(o.rank)%from))
	}
	o.calls, o.pending, o.launchedAt = calls, int(pending), launchedAt
	o.outerSteps, o.outerSkipped = ints[3], ints[4]
	o.innerBytes = o.inner.Stats().BytesSent
	o.broken = nil
	o.log.Info("loaded checkpoint", zap.String("algorithm", o.algorithm), zap.Int64("step", calls))
	return nil
}

// carriedState is what a regrouped checkpoint carries besides the error
// feedback, as Load logs it.
const carriedState = "θ_g and u (the same on every rank), any exchange in flight, and the inner optimizer's state and local parameters of the rank that made it (made_by_rank) are carried"

// logReset says, after the Load of a checkpoint whose error buffers were
// reset (Regroup's on another number of ranks, or Checkpoint.ResetErrors),
// what was carried and what restarted: a warning where some error
// feedback restarted from zero, else an informational line. regrouped
// says that the sparse accumulator is Regroup's mean of the old ranks'.
func (o *Optimizer) logReset(ck *optim.Checkpoint, regrouped bool) {
	fields := []zap.Field{zap.String("algorithm", o.algorithm), zap.Int("made_on_world", ck.World), zap.Int("made_by_rank", ck.Rank)}
	switch {
	case o.sp != nil && regrouped:
		o.log.Info("loaded a regrouped checkpoint: the sparse accumulator is the old ranks' mean (with their server accumulators, SparseTwoPhase), nothing restarts from zero; "+carriedState, fields...)
	case o.sp != nil:
		o.log.Warn("loaded a checkpoint whose error buffers were reset: the sparse accumulator restarts from zero (outer.Regroup of every old rank's checkpoint carries their mean); "+carriedState, fields...)
	case o.states != nil:
		o.log.Warn("loaded a checkpoint whose error buffers were reset: the 1-bit codec's error feedback restarts from zero (outer.Regroup of every old rank's checkpoint carries it); "+carriedState, fields...)
	default:
		o.log.Info("loaded a checkpoint whose error buffers were reset (this codec keeps none, nothing restarts from zero): "+carriedState, fields...)
	}
}
