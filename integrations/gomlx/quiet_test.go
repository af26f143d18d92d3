package gomlx

import (
	"context"
	"encoding/binary"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/graph"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/train"
	"github.com/gomlx/gomlx/ml/train/loss"
	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/outer"
)

// quietRank is what one rank of runQuiet reports.
type quietRank struct {
	// Per step whose lowbit hook returned: the bytes this rank sent and
	// the collectives it made in the hook, and the global parameters
	// after it.
	sent   [][2]int64
	global [][]float32
	// Per step whose lowbit hook ran: this rank's trainable variables
	// before and after it.
	before, after [][][]float32
	errs          []error // of each RunSteps
	steps         int64   // the lowbit optimizer's Stats
	skipped       int64
	globalStep    int64
	exchanges     int64
	quiet         bool // the flags were carried at the exchanges only
}

// runQuiet trains steps on w in-process ranks with train.Loop (or, with
// manual, a loop of TrainStep and Step) and the outer optimizer of build,
// over a counting communicator, each rank on its own shard. The loss is
// the mean squared error plus log(gate), gate 1 but at badLoss (rank, step
// from 1), where it is 0: a loss of -Inf whose gradient is finite (the
// log's is stopped). A rank whose loop stops with an error runs it again
// up to steps (train.Loop stops on a non-finite loss); hook, if not nil,
// adds hooks to rank r's loop.
func runQuiet(t *testing.T, w, steps int, build Builder, manual bool, badLoss [2]int, hook func(r int, m *rankModel)) []*quietRank {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res := make([]*quietRank, w)
	var mu sync.Mutex
	_ = local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		r := c.Rank()
		cc := newCountingComm(c, 0)
		backend, err := gobackend.New("")
		require.NoError(t, err)
		defer backend.Finalize()
		var opts []Option
		if manual {
			opts = append(opts, WithManualStep())
		}
		opt, err := New(ctx, cc, build, opts...)
		require.NoError(t, err)
		defer opt.Close()
		store := newStore(int64(100 + r))
		lossFn := func(labels, pred []*graph.Node) *graph.Node {
			mse := loss.MeanSquaredError(labels[:1], pred)
			return graph.Add(mse, graph.StopGradient(graph.Log(graph.ReduceAllSum(labels[1]))))
		}
		m := &rankModel{store: store, opt: opt}
		m.trainer = train.NewTrainer(backend, store, mlp(16), lossFn, opt, nil, nil)
		out := &quietRank{}
		var bytes, calls int64
		pre := func() {
			out.before = append(out.before, trainable(t, store))
			bytes, calls = c.Stats().Total().BytesSent, cc.Count().Calls
		}
		post := func() {
			out.after = append(out.after, trainable(t, store))
			out.sent = append(out.sent, [2]int64{c.Stats().Total().BytesSent - bytes, cc.Count().Calls - calls})
			out.global = append(out.global, slices.Clone(opt.Global()))
		}
		ds := &shard{rank: r, world: w, edit: func(s int, b train.Batch) train.Batch {
			gate := float32(1)
			if r == badLoss[0] && s+1 == badLoss[1] {
				gate = 0
			}
			b.Labels = append(b.Labels, tensors.FromFlatDataAndDimensions([]float32{gate}, 1))
			return b
		}}
		if manual {
			var err error
			for range steps {
				batch, _ := iterFirst(ds)
				var metrics []*tensors.Tensor
				if metrics, err = m.trainer.TrainStep(batch); err != nil {
					break
				}
				pre()
				if err = opt.Step(float64(tensors.ToScalar[float32](metrics[0]))); err != nil {
					out.after = append(out.after, trainable(t, store))
					break
				}
				post()
			}
			out.errs = append(out.errs, err)
		} else {
			m.loop = train.NewLoop(m.trainer)
			opt.AttachToLoop(m.loop)
			m.loop.OnStep("before lowbit", HookPriority-1, func(*train.Loop, []*tensors.Tensor) error { pre(); return nil })
			m.loop.OnStep("after lowbit", HookPriority+1, func(*train.Loop, []*tensors.Tensor) error { post(); return nil })
			if hook != nil {
				hook(r, m)
			}
			for range 2 {
				left := steps - int(optimizerGlobalStep(store))
				if left <= 0 {
					break
				}
				_, err := m.loop.RunSteps(ds, left)
				out.errs = append(out.errs, err)
				if err == nil || len(out.after) < len(out.before) {
					break // done, or stopped in the lowbit hook: not a loss the loop refused
				}
			}
		}
		if o := opt.Optimizer(); o != nil {
			st := o.Stats()
			out.steps, out.skipped = st.Steps, st.Skipped
			out.exchanges = o.(*outer.Optimizer).OuterStats().Exchanges
		}
		out.globalStep = optimizerGlobalStep(store)
		out.quiet = opt.sf != nil && opt.quiet
		mu.Lock()
		res[r] = out
		mu.Unlock()
		return nil
	})
	return res
}

// iterFirst returns the next batch of ds.
func iterFirst(ds train.Dataset) (train.Batch, error) {
	for b, err := range ds.Iter() {
		return b, err
	}
	return train.Batch{}, nil
}

// TestOuterQuietBetweenExchanges: with the outer optimizer, the hook's
// flags ride in the exchanges' agreements only: a step that does not
// exchange sends nothing, neither a byte nor a collective, through
// AttachToLoop and through a manual Step, on 3 ranks; the exchanges' steps
// communicate, and the flags are carried (no allreduce of the hook's own).
func TestOuterQuietBetweenExchanges(t *testing.T) {
	const w, h, steps = 3, 4, 12
	for _, tc := range []struct {
		name   string
		build  Builder
		manual bool
	}{
		{"fp32 loop", outerAdam(h, 1, 0, outer.CodecFP32), false},
		{"fp32 manual", outerAdam(h, 1, 0, outer.CodecFP32), true},
		{"1bit 2 fragments loop", outerAdam(h, 2, 0, outer.CodecOneBit), false}, // exchanges at 2, 4, 6, ...
		{"muon sparse loop", outerMuon(h, outer.CodecSparse), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			every := h
			if tc.name == "1bit 2 fragments loop" {
				every = h / 2
			}
			runs := runQuiet(t, w, steps, tc.build, tc.manual, [2]int{-1, -1}, nil)
			for r, run := range runs {
				assert.True(t, run.quiet, "rank %d: the flags are not carried at the exchanges only", r)
				require.Equal(t, []error{nil}, run.errs, "rank %d", r)
				require.Len(t, run.sent, steps, "rank %d", r)
				for s, sent := range run.sent {
					if (s+1)%every != 0 {
						assert.Equal(t, [2]int64{0, 0}, sent, "rank %d, step %d: bytes and collectives between exchanges", r, s+1)
					} else {
						assert.Positive(t, sent[0], "rank %d, step %d: an exchange's bytes", r, s+1)
					}
				}
			}
		})
	}
}

// TestOuterQuietFailure: a rank that fails to read its gradients between
// exchanges (a trainable variable added on rank 1 before step 2's hook)
// stops there with its own error, which the others hear of at the next
// exchange (step 4): every rank stops with an error, the others' naming
// rank 1 and its step, no hang, every rank at the same lowbit step count.
func TestOuterQuietFailure(t *testing.T) {
	const w, h = 3, 4
	runs := runQuiet(t, w, 8, outerAdam(h, 1, 0, outer.CodecFP32), false, [2]int{-1, -1}, func(r int, m *rankModel) {
		if r != 1 {
			return
		}
		m.loop.OnStep("add a variable", HookPriority-1, func(l *train.Loop, _ []*tensors.Tensor) error {
			if l.LoopStep == 1 {
				m.store.RootScope().In("extra").VariableWithValue("b", float32(0))
			}
			return nil
		})
	})
	for r, run := range runs {
		require.Len(t, run.errs, 1, "rank %d", r)
		require.Error(t, run.errs[0], "rank %d", r)
		assert.NotErrorIs(t, run.errs[0], comm.ErrAborted, "rank %d", r)
		assert.Equal(t, int64(4), run.steps, "rank %d: lowbit steps after the failure", r)
		if r == 1 {
			assert.Contains(t, run.errs[0].Error(), "trainable variables changed")
			assert.Len(t, run.sent, 1, "rank 1's hook returns at step 2")
			continue
		}
		assert.Contains(t, run.errs[0].Error(), "rank 1 failed at step 2", "rank %d", r)
		assert.Contains(t, run.errs[0].Error(), "another rank failed to get its gradients", "rank %d", r)
		assert.Len(t, run.sent, 3, "rank %d: steps 1-3 went on, step 4 heard of it", r)
	}
}

// TestOuterQuietNonFiniteLoss: a loss of -Inf on rank 1 at step 2 (its
// gradient finite) skips rank 1's own inner step only (its variables do
// not change, Stats().Skipped counts it), the others step on; train.Loop
// stops on that loss on rank 1, whose loop run again goes on with the
// others; every rank ends at step 8 with the same global parameters.
func TestOuterQuietNonFiniteLoss(t *testing.T) {
	const w, h, steps = 3, 4, 8
	for _, manual := range []bool{false, true} {
		runs := runQuiet(t, w, steps, outerAdam(h, 1, 0, outer.CodecFP32), manual, [2]int{1, 2}, nil)
		for r, run := range runs {
			if r == 1 && !manual {
				require.Len(t, run.errs, 2, "rank 1: the loop stops on the loss, then goes on")
				assert.ErrorContains(t, run.errs[0], "infinity")
				assert.NoError(t, run.errs[1])
			} else {
				require.Equal(t, []error{nil}, run.errs, "rank %d, manual %v", r, manual)
			}
			assert.Equal(t, int64(steps), run.steps, "rank %d", r)
			assert.Equal(t, int64(steps), run.globalStep, "rank %d", r)
			assert.Equal(t, int64(steps/h), run.exchanges, "rank %d", r)
			skipped := int64(0)
			if r == 1 {
				skipped = 1
				assert.Equal(t, run.before[1], run.after[1], "rank 1's variables changed in its skipped step")
			}
			assert.Equal(t, skipped, run.skipped, "rank %d", r)
			assert.NotEqual(t, run.before[2], run.after[2], "rank %d's variables did not change at step 3", r)
			assert.Equal(t, runs[0].global[steps-1], run.global[steps-1], "rank %d's global parameters", r)
		}
	}
}

// TestOuterQuietLearningRates: GoMLX's learning rate changed on rank 1
// only before step 3 (between exchanges) is found at the next exchange,
// step 4, on every rank: an error naming both values, the exchange not
// run (the global parameters as before it), every rank at step 4.
func TestOuterQuietLearningRates(t *testing.T) {
	runs := runSpecs(t, 2, 8, func(r int) rankSpec {
		return rankSpec{build: builderLR("outer", 0.01), params: map[string]any{optimizer.ParamLearningRate: 0.05},
			hook: func(m *rankModel) {
				m.loop.OnStep("change lr", HookPriority-1, func(l *train.Loop, _ []*tensors.Tensor) error {
					if l.LoopStep == 2 && r == 1 {
						return m.store.GetVariable("/optimizers/learning_rate").SetValue(tensors.FromScalar(float32(0.5)))
					}
					return nil
				})
			}}
	})
	for r, run := range runs {
		require.Error(t, run.err, "rank %d", r)
		assert.Contains(t, run.err.Error(), "lbgomlx: global step 4: the ranks' learning rates differ, from 0.05 to 0.5", "rank %d", r)
		assert.Contains(t, run.err.Error(), "the exchange of this step did not run on any rank", "rank %d", r)
		assert.Len(t, run.losses, 3, "rank %d: steps 1-3 recorded", r)
		o := run.opt.Optimizer().(*outer.Optimizer)
		assert.Equal(t, int64(4), o.Stats().Steps, "rank %d", r)
		assert.Zero(t, o.OuterStats().Exchanges, "rank %d", r)
		assert.Equal(t, binary.LittleEndian.AppendUint64(nil, 4), run.final["/global_step"], "rank %d: global step", r)
	}
}
