package gomlx

import (
	"context"
	"encoding/binary"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/gomlx/compute/dtypes"
	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/compute/shapes"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/layers"
	"github.com/gomlx/gomlx/ml/model"
	"github.com/gomlx/gomlx/ml/model/checkpoint"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// heapPeak runs fn while a goroutine samples the heap (runtime.ReadMemStats
// every millisecond). It returns, relative to the heap in use before fn
// (after a collection): the peak HeapAlloc seen while fn ran, and the heap
// in use after it (after a collection), which is what fn left resident.
func heapPeak(t testing.TB, fn func()) (peak, resident int64) {
	t.Helper()
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	top := base
	var mu sync.Mutex
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		var s runtime.MemStats
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				runtime.ReadMemStats(&s)
				mu.Lock()
				top = max(top, s.HeapAlloc)
				mu.Unlock()
			}
		}
	}()
	fn()
	close(stop)
	<-done
	runtime.ReadMemStats(&ms)
	top = max(top, ms.HeapAlloc)
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return int64(top) - int64(base), int64(ms.HeapAlloc) - int64(base)
}

// bigModel is a one-output linear model plus a vector of n parameters that
// the loss uses through its mean, so that the model (and the lowbit state)
// is large while a step costs little.
func bigModel(n int) func(scope *model.Scope, x *graph.Node) *graph.Node {
	return func(scope *model.Scope, x *graph.Node) *graph.Node {
		out := layers.DenseWithBias(scope.In("out"), x, 1)
		big := scope.In("big").VariableWithShape("w", shapes.Make(dtypes.Float32, n)).NodeValue(x.Graph())
		return graph.Add(out, graph.ReduceAllMean(big))
	}
}

// bigRank is a one-rank training set-up of bigModel with exact Adam (whose
// state, parameters and both moments, is 12 bytes per parameter).
type bigRank struct {
	store   *model.Store
	h       *checkpoint.Handler
	opt     *Optimizer
	trainer *train.Trainer
}

func newBigRank(t testing.TB, dir string, n int) *bigRank {
	t.Helper()
	backend, err := gobackend.New("")
	require.NoError(t, err)
	store := newStore(1)
	h, err := checkpoint.Build(store).Dir(dir).Keep(1).Done()
	require.NoError(t, err)
	opt, err := New(context.Background(), nil, adam, WithManualStep())
	require.NoError(t, err)
	return &bigRank{store: store, h: h, opt: opt,
		trainer: train.NewTrainer(backend, store, bigModel(n), loss.MeanSquaredError, opt, nil, nil)}
}

// step runs one training step.
func (b *bigRank) step(t testing.TB) {
	t.Helper()
	x, y := regression(0, rows)
	m, err := b.trainer.TrainStep(train.Batch{Inputs: []*tensors.Tensor{x}, Labels: []*tensors.Tensor{y}})
	require.NoError(t, err)
	require.NoError(t, b.opt.Step(float64(tensors.ToScalar[float32](m[0]))))
}

// stateMiB is the size of the lowbit state of TestCheckpointMemory:
// LOWBIT_GOMLX_STATE_MIB, 24 by default (the figures of docs/measured.md are
// from 256).
func stateMiB(t testing.TB) int {
	if s := os.Getenv("LOWBIT_GOMLX_STATE_MIB"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(t, err, "LOWBIT_GOMLX_STATE_MIB")
		return n
	}
	return 24
}

// legacySave is Save as it was before the lowbit state had a file of its
// own: the state copied into StateVariable (State, MarshalBinary, a buffer
// with the global step in front, a tensor of it: four copies) and saved
// inside GoMLX's checkpoint, where it then stayed resident in the store.
func legacySave(o *Optimizer, h *checkpoint.Handler) error {
	ck, err := o.opt.State()
	if err != nil {
		return err
	}
	b, err := ck.MarshalBinary()
	if err != nil {
		return err
	}
	buf := make([]byte, 8+len(b))
	binary.LittleEndian.PutUint64(buf, uint64(o.globalStep()))
	copy(buf[8:], b)
	t := tensors.FromFlatDataAndDimensions(buf, len(buf))
	sv := o.store.GetVariable(StateVariable)
	if sv != nil {
		if err := sv.SetValue(t); err != nil {
			return err
		}
	} else if sv, err = o.store.CreateVariable(StateVariable, t); err != nil {
		return err
	}
	sv.SetTrainable(false)
	h.ExcludeVarsFromSaving(o.grads...)
	return h.Save()
}

// TestCheckpointMemory measures the heap a checkpoint costs, for a model
// whose lowbit state (exact Adam: the parameters and both moments) is
// stateMiB: the peak while Save runs and what stays resident after it; the
// peak and the resident heap of a run that loads the checkpoint (a new
// store, Handler and Optimizer, and the first training step) against the
// same run started afresh. The same, in the same run, for the way the
// state was saved before it had a file of its own (legacySave: four copies
// at the peak, one resident afterwards), whose checkpoints still load and
// then leave nothing resident either. A save may cost one copy of the
// state and leave none resident; a load may leave none resident.
func TestCheckpointMemory(t *testing.T) {
	mib := stateMiB(t)
	n := mib << 20 / 12
	state := int64(12 * n)
	dir, legacyDir, fresh := t.TempDir(), t.TempDir(), t.TempDir()
	save := func(dir string, fn func(*Optimizer, *checkpoint.Handler) error) (peak, resident int64) {
		r := newBigRank(t, dir, n)
		r.step(t)
		t0 := time.Now()
		peak, resident = heapPeak(t, func() { require.NoError(t, fn(r.opt, r.h)) })
		t.Logf("save took %s", time.Since(t0))
		runtime.KeepAlive(r)
		require.NoError(t, r.opt.Close())
		return peak, resident
	}
	load := func(dir string, restored bool) (peak, resident int64) {
		var r *bigRank
		t0 := time.Now()
		peak, resident = heapPeak(t, func() { r = newBigRank(t, dir, n); r.step(t) })
		t.Logf("first step took %s", time.Since(t0))
		require.Equal(t, restored, r.opt.Restored())
		assert.Nil(t, r.store.GetVariable(StateVariable), "the legacy state variable stayed in the store")
		require.NoError(t, r.opt.Close())
		return peak, resident
	}
	savePeak, saveResident := save(dir, (*Optimizer).Save)
	legacyPeak, legacyResident := save(legacyDir, legacySave)
	freshPeak, freshResident := load(fresh, false)
	loadPeak, loadResident := load(dir, true)
	legacyLoadPeak, legacyLoadResident := load(legacyDir, true)

	x := func(b int64) string {
		return fmt.Sprintf("%.0f MiB (%.2fx)", float64(b)/(1<<20), float64(b)/float64(state))
	}
	t.Logf("lowbit state %s, %d parameters; beyond the heap before, in MiB and times the state:", x(state), n)
	t.Logf("save:        peak %s, resident after %s", x(savePeak), x(saveResident))
	t.Logf("legacy save: peak %s, resident after %s", x(legacyPeak), x(legacyResident))
	t.Logf("first step afresh:                 peak %s, resident after %s", x(freshPeak), x(freshResident))
	t.Logf("first step from the checkpoint:    peak +%s, resident after +%s (beyond afresh)", x(loadPeak-freshPeak), x(loadResident-freshResident))
	t.Logf("first step from a legacy one:      peak +%s, resident after +%s (beyond afresh)", x(legacyLoadPeak-freshPeak), x(legacyLoadResident-freshResident))

	const slack = 4 << 20
	assert.LessOrEqual(t, savePeak, state*5/4+slack, "a save costs more than one copy of the state")
	assert.LessOrEqual(t, saveResident, state/20+slack, "the save left state resident")
	assert.LessOrEqual(t, loadResident-freshResident, state/10+slack, "the load left state resident")
	assert.LessOrEqual(t, legacyLoadResident-freshResident, state/10+slack, "the legacy load left state resident")
	// The measurement sees what the legacy save cost.
	assert.GreaterOrEqual(t, legacyPeak, 3*state/2, "the legacy save's copies went unseen")
	assert.GreaterOrEqual(t, legacyResident, state*9/10, "the legacy save's resident state went unseen")
}
