package onebit_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// regroupCase is an optimizer whose checkpoints Regroup carries from one
// group size to another.
type regroupCase struct {
	name string
	mk   func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)
}

// regroupAdam is 1-bit Adam as the regroup tests run it: the warm-up ends
// at step 2, weight decay, a mask on w1, mode and buckets of bb bytes.
func regroupAdam(mode onebit.StateMode, bb int) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
	cfg := adamConfigForResume(2)
	cfg.StateMode, cfg.BucketBytes = mode, bb
	return func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return onebit.NewAdam(context.Background(), c, ps, cfg)
	}
}

// byMode makes an optimizer's constructor for a StateMode.
type byMode func(onebit.StateMode) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)

// regroupAdamIn is regroupAdam with buckets of bb bytes, by mode.
func regroupAdamIn(bb int) byMode {
	return func(mode onebit.StateMode) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return regroupAdam(mode, bb)
	}
}

// regroupLamb is 1-bit LAMB as the regroup tests run it: the warm-up ends
// at step 2, weight decay, a mask on w1, mode.
func regroupLamb(mode onebit.StateMode) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
	cfg := onebit.DefaultLambConfig()
	cfg.FreezeStep, cfg.LR, cfg.WeightDecay, cfg.StateMode = 2, 0.01, 0.01, mode
	cfg.ExpAvgMask = adamConfigForResume(2).ExpAvgMask
	return newLamb(cfg)
}

func regroupCases() []regroupCase {
	zo := onebit.DefaultZeroOneAdamConfig()
	zo.VarFreezeStep, zo.LocalStepScaler = 2, 2
	bf16 := func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := shardedBF16(2, onebit.BF16WorkerError|onebit.BF16Variance)
		return onebit.NewAdam(context.Background(), c, ps, cfg)
	}
	return []regroupCase{
		{"1-bit Adam", regroupAdam(onebit.StateFull, 0)},
		{"1-bit Adam, buckets of 24 bytes", regroupAdam(onebit.StateFull, 24)},
		{"1-bit Adam, per parameter", regroupAdam(onebit.StateFull, optim.PerParameter)},
		{"1-bit Adam compact", regroupAdam(onebit.StateCompact, 0)},
		{"1-bit Adam compact, buckets of 24 bytes", regroupAdam(onebit.StateCompact, 24)},
		{"1-bit Adam compact, buckets of 44 bytes", regroupAdam(onebit.StateCompact, 44)},
		{"1-bit Adam sharded", regroupAdam(onebit.StateSharded, 0)},
		{"1-bit Adam sharded, buckets of 24 bytes", regroupAdam(onebit.StateSharded, 24)},
		{"1-bit Adam sharded bf16", bf16},
		{"1-bit LAMB", regroupLamb(onebit.StateFull)},
		{"1-bit LAMB compact", regroupLamb(onebit.StateCompact)},
		{"0/1 Adam", newZeroOne(zo)},
		{"1-bit Muon", regroupMuon},
	}
}

// regroupRun runs w ranks of mk from cks (nil: from the start) for steps
// steps (gradients of adamGrads from step first) and returns every rank's
// checkpoint and parameters.
func regroupRun(t *testing.T, w int, mk func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error),
	cks []*optim.Checkpoint, first, steps int) ([]*optim.Checkpoint, [][][]uint32) {
	t.Helper()
	out := make([]*optim.Checkpoint, w)
	params := make([][][]uint32, w)
	var mu sync.Mutex
	err := local.Run(adamCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		ps := adamParams(t, []int{3, 7}, []int{13}, []int{1})
		opt, err := mk(c, ps)
		if err != nil {
			return err
		}
		if cks != nil {
			if err := opt.Load(cks[c.Rank()]); err != nil {
				return err
			}
		}
		for s := first; s < first+steps; s++ {
			adamGrads(ps, c.Rank()%3, s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		ck, err := opt.State()
		if err != nil {
			return err
		}
		mu.Lock()
		defer mu.Unlock()
		out[c.Rank()], params[c.Rank()] = ck, adamBits(ps)
		return nil
	})
	require.NoError(t, err)
	return out, params
}

// regroupAll is Regroup for every rank of a group of world.
func regroupAll(t *testing.T, old []*optim.Checkpoint, world int) []*optim.Checkpoint {
	t.Helper()
	out := make([]*optim.Checkpoint, world)
	for r := range out {
		ck, err := onebit.Regroup(old, world, r)
		require.NoError(t, err)
		require.Equal(t, world, ck.World)
		require.Equal(t, r, ck.Rank)
		require.False(t, ck.ErrorsReset)
		out[r] = ck
	}
	return out
}

// byElement puts back together, element by element, the buffers called
// name that every rank holds a chunk of (server and update errors,
// sharded moments): the first n elements.
func byElement(cks []*optim.Checkpoint, name string, n int) []float32 {
	var all []float32
	for _, ck := range cks {
		all = append(all, ck.Tensor(name).Data...)
	}
	w := len(cks)
	c := onebit.PaddedLen(n, w) / w
	out := make([]float32, 0, n)
	for r := range w {
		lo := r * c
		if lo >= n {
			break
		}
		out = append(out, all[r*c:r*c+min(c, n-lo)]...)
	}
	return out
}

// meanOf is the float64 mean over the ranks of the buffers called name,
// first n elements.
func meanOf(cks []*optim.Checkpoint, name string, n int) []float64 {
	out := make([]float64, n)
	for _, ck := range cks {
		for i, x := range ck.Tensor(name).Data[:n] {
			out[i] += float64(x)
		}
	}
	for i := range out {
		out[i] /= float64(len(cks))
	}
	return out
}

// chunked reports whether the checkpoint tensor called name is held by
// every rank chunk by chunk.
func chunked(name string) bool {
	return strings.HasPrefix(name, optim.ServerErrorName) ||
		strings.HasPrefix(name, onebit.ExpAvgShardPrefix) || strings.HasPrefix(name, onebit.ExpAvgSqShardPrefix)
}

// numelOf is the elements of the tensor a per-rank buffer belongs to: for
// these runs, a bucket's from the length of rank 0's worker error or
// chunk on w ranks is not enough, so it is found from the known layouts.
func numelOf(t *testing.T, ck *optim.Checkpoint, name string) int {
	t.Helper()
	const total = 35 // adamParams(3x7, 13, 1)
	rest := name[strings.IndexByte(name+"/", '/'):]
	if rest == "" {
		return total
	}
	rest = rest[1:]
	if k, ok := strings.CutPrefix(rest, "bucket:"); ok {
		per := int(ck.Ints[onebit.IntBucketBytes]) / 4
		if ck.Ints[onebit.IntBucketBytes] == 0 || per >= total {
			return total
		}
		var idx int
		_, err := fmt.Sscan(k, &idx)
		require.NoError(t, err)
		return min(per, total-idx*per)
	}
	return map[string]int{"w0": 21, "w1": 13, "w2": 1}[rest]
}

// Regrouping 4 ranks' checkpoints for 3 ranks and back for 4 keeps the
// invariants of Regroup's doc: the mean worker error to float32 rounding,
// the server errors and sharded moments element for element; and the
// regrouped checkpoints load and train on without a reset.
func TestRegroupKeepsTheErrorFeedback(t *testing.T) {
	for _, tc := range regroupCases() {
		t.Run(tc.name, func(t *testing.T) {
			four, _ := regroupRun(t, 4, tc.mk, nil, 1, 6)
			three := regroupAll(t, four, 3)
			back := regroupAll(t, three, 4)
			checked := 0
			for _, tn := range four[0].Tensors {
				if !optim.IsErrorBuffer(tn.Name) && !chunked(tn.Name) {
					continue
				}
				n := numelOf(t, four[0], tn.Name)
				checked++
				if chunked(tn.Name) {
					want := byElement(four, tn.Name, n)
					assert.Equal(t, want, byElement(three, tn.Name, n), "%s on 3 ranks", tn.Name)
					assert.Equal(t, want, byElement(back, tn.Name, n), "%s back on 4 ranks", tn.Name)
					continue
				}
				want := meanOf(four, tn.Name, n)
				for _, got := range [][]float64{meanOf(three, tn.Name, n), meanOf(back, tn.Name, n)} {
					for i := range want {
						require.InDelta(t, want[i], got[i], math.Abs(want[i])*0x1p-23+1e-30, "%s[%d]", tn.Name, i)
					}
				}
				for _, ck := range three {
					pad := ck.Tensor(tn.Name).Data[n:]
					assert.Equal(t, make([]float32, len(pad)), pad, "padding starts at zero")
				}
			}
			assert.Positive(t, checked)
			// The regrouped checkpoints load on 3 ranks and train on.
			cks, params := regroupRun(t, 3, tc.mk, three, 7, 3)
			assert.Equal(t, int64(9), cks[0].Ints[optim.IntStep])
			if !strings.HasPrefix(tc.name, "0/1") {
				assert.Equal(t, params[0], params[1])
				assert.Equal(t, params[0], params[2])
			}
		})
	}
}

// Regroup refuses what it cannot do, saying why.
func TestRegroupRefusals(t *testing.T) {
	mk := regroupCases()[0].mk
	two, _ := regroupRun(t, 2, mk, nil, 1, 4)
	other, _ := regroupRun(t, 2, mk, nil, 1, 3)
	exact, _ := regroupRun(t, 2, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewAdam(context.Background(), c, ps, optim.DefaultAdamConfig())
	}, nil, 1, 1)
	for _, tc := range []struct {
		name string
		old  []*optim.Checkpoint
		msg  string
	}{
		{"a rank missing", two[:1], "every rank's"},
		{"out of order", []*optim.Checkpoint{two[1], two[0]}, "rank order"},
		{"steps differ", []*optim.Checkpoint{two[0], other[1]}, "not one run's"},
		{"errors reset", []*optim.Checkpoint{two[0].ResetErrors(), two[1]}, "reset already"},
		{"exact Adam", exact, "no error feedback"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := onebit.Regroup(tc.old, 3, 0)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.msg)
		})
	}
	_, err := onebit.Regroup(two, 3, 3)
	require.Error(t, err)
	ck := two[0]
	ck.Tensors = append([]optim.Tensor(nil), ck.Tensors...)
	for i := range ck.Tensors {
		if optim.IsErrorBuffer(ck.Tensors[i].Name) {
			ck.Tensors[i].Data = ck.Tensors[i].Data[:1]
		}
	}
	_, err = onebit.Regroup([]*optim.Checkpoint{ck, two[1]}, 3, 0)
	require.Error(t, err)
	assert.True(t, errors.Is(err, optim.ErrIncompatibleCheckpoint))
}

// checkpointBits is a checkpoint's content, float bits for floats and
// tensors by name, for comparisons bit for bit.
type checkpointBits struct {
	Algorithm   string
	World, Rank int
	Stage       optim.Stage
	ErrorsReset bool
	Ints        map[string]int64
	Floats      map[string]uint64
	Tensors     map[string][]uint32 // shape, then data
}

// ckBits is ck's checkpointBits.
func ckBits(ck *optim.Checkpoint) checkpointBits {
	b := checkpointBits{Algorithm: ck.Algorithm, World: ck.World, Rank: ck.Rank, Stage: ck.Stage, ErrorsReset: ck.ErrorsReset,
		Ints: map[string]int64{}, Floats: map[string]uint64{}, Tensors: map[string][]uint32{}}
	maps.Copy(b.Ints, ck.Ints)
	for k, v := range ck.Floats {
		b.Floats[k] = math.Float64bits(v)
	}
	for _, t := range ck.Tensors {
		var x []uint32
		for _, d := range t.Shape {
			x = append(x, uint32(d))
		}
		b.Tensors[t.Name] = append(append(x, math.MaxUint32), bitsOf(t.Data)...)
	}
	return b
}

// A compact run resumes in StateCompact on another number of ranks with
// its error feedback, whatever the buckets (the default: one bucket of the
// 35 elements, in chunks of 24 on 2 and 3 ranks, 16 on 4, 40 on 5; 84
// bytes: buckets of 21 and 14 elements, cutting parameters; one per
// parameter): the regrouped checkpoints load in StateCompact and train on
// exactly as StateFull does from them, bit for bit (parameters and the
// checkpoints that follow), for 1-bit Adam and 1-bit LAMB. The new chunks
// can pack the momentum only where each lies within one old chunk (2 to 3
// ranks and back with the default size); elsewhere StateCompact holds it
// as float32 for a step.
func TestRegroupCompactResumesCompact(t *testing.T) {
	for _, tc := range []struct {
		name string
		mk   byMode
	}{
		{"1-bit Adam", regroupAdamIn(0)},
		{"1-bit Adam, buckets of 84 bytes", regroupAdamIn(84)},
		{"1-bit Adam, per parameter", regroupAdamIn(optim.PerParameter)},
		{"1-bit LAMB", regroupLamb},
	} {
		for _, ws := range [][2]int{{2, 3}, {3, 2}, {4, 3}, {4, 1}, {2, 5}} {
			t.Run(fmt.Sprintf("%s/%d to %d", tc.name, ws[0], ws[1]), func(t *testing.T) {
				old, _ := regroupRun(t, ws[0], tc.mk(onebit.StateCompact), nil, 1, 6)
				cks := regroupAll(t, old, ws[1])
				if ws[1] > 1 {
					assert.Equal(t, int64(1), cks[0].Ints[onebit.IntForeignMomentum])
					kept := false
					for _, tn := range cks[0].Tensors {
						if strings.HasPrefix(tn.Name, optim.WorkerErrorName) {
							kept = kept || slices.ContainsFunc(tn.Data, func(x float32) bool { return x != 0 })
						}
					}
					assert.True(t, kept, "the worker errors are kept")
				}
				full, fullParams := regroupRun(t, ws[1], tc.mk(onebit.StateFull), cks, 7, 4)
				compact, compactParams := regroupRun(t, ws[1], tc.mk(onebit.StateCompact), cks, 7, 4)
				require.Equal(t, fullParams, compactParams)
				for r := range compact {
					delete(compact[r].Ints, onebit.IntStateMode)
					assert.Equal(t, ckBits(full[r]), ckBits(compact[r]), "rank %d's checkpoint", r)
				}
			})
		}
	}
}

// StateCompact holding a regrouped momentum as float32 says so in its
// checkpoints until its next step, and takes them back: a checkpoint taken
// right after the Load loads again; StateBytes is back to its value before
// the Load after the next step.
func TestRegroupCompactStateWhileLoose(t *testing.T) {
	for _, tc := range []struct {
		name string
		mk   byMode
	}{
		{"1-bit Adam", regroupAdamIn(0)},
		{"1-bit LAMB", regroupLamb},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// 35 elements: chunks of 24 on 2 ranks (and 3), of 16 on 4.
			old, _ := regroupRun(t, 2, tc.mk(onebit.StateCompact), nil, 1, 6)
			cks := regroupAll(t, old, 4)
			_, want := regroupRun(t, 4, tc.mk(onebit.StateFull), cks, 7, 2)
			got := make([][][]uint32, 4)
			require.NoError(t, local.Run(adamCtx(t), 4, func(ctx context.Context, c comm.Comm) error {
				ps := adamParams(t, []int{3, 7}, []int{13}, []int{1})
				opt, err := tc.mk(onebit.StateCompact)(c, ps)
				if err != nil {
					return err
				}
				built := opt.(optim.MemoryReporter).StateBytes()
				if err := opt.Load(cks[c.Rank()]); err != nil {
					return err
				}
				again, err := opt.State()
				if err != nil {
					return err
				}
				if again.Ints[onebit.IntForeignMomentum] != 1 {
					return fmt.Errorf("the checkpoint of a loose momentum does not say so")
				}
				if err := opt.Load(again); err != nil {
					return err
				}
				for s := 7; s < 9; s++ {
					adamGrads(ps, c.Rank()%3, s)
					if err := opt.Step(ctx); err != nil {
						return err
					}
				}
				if after := opt.(optim.MemoryReporter).StateBytes(); after != built {
					return fmt.Errorf("StateBytes %d after construction, %d after the steps", built, after)
				}
				got[c.Rank()] = adamBits(ps)
				return nil
			}))
			assert.Equal(t, want, got)
		})
	}
}

// Regroup to the same number of ranks is a copy of each rank's own
// checkpoint, bit for bit, in every optimizer and mode (one rank
// included), and a resume through it is the resume without it.
func TestRegroupSameWorldIsACopy(t *testing.T) {
	for _, tc := range regroupCases() {
		t.Run(tc.name, func(t *testing.T) {
			for _, w := range []int{1, 3} {
				old, _ := regroupRun(t, w, tc.mk, nil, 1, 6)
				same := regroupAll(t, old, w)
				for r := range w {
					require.Equal(t, ckBits(old[r]), ckBits(same[r]), "W=%d rank %d", w, r)
				}
				wantCks, want := regroupRun(t, w, tc.mk, old, 7, 3)
				gotCks, got := regroupRun(t, w, tc.mk, same, 7, 3)
				require.Equal(t, want, got, "W=%d: the resume through Regroup", w)
				for r := range w {
					require.Equal(t, ckBits(wantCks[r]), ckBits(gotCks[r]), "W=%d rank %d after the resume", w, r)
				}
			}
		})
	}
}

// A run on one rank grows to more ranks and back, in every optimizer and
// mode (StateSharded included, which runs as StateFull on one rank): the
// new ranks' error buffers start at zero (there were none), the sharded
// moments are the one rank's whole ones cut into shards, bit for bit; the
// checkpoints load on the new group and train on (the same parameters on
// every rank but in 0/1 Adam's local steps), the modes with a full
// momentum exactly as after ResetErrors; and Regroup back to one rank
// gives the one rank's checkpoint back, bit for bit.
func TestRegroupFromOneRank(t *testing.T) {
	for _, tc := range regroupCases() {
		t.Run(tc.name, func(t *testing.T) {
			one, _ := regroupRun(t, 1, tc.mk, nil, 1, 6)
			sharded := one[0].Ints[onebit.IntStateMode] == int64(onebit.StateSharded)
			for _, w := range []int{2, 3} {
				cks := regroupAll(t, one, w)
				for _, ck := range cks {
					for _, tn := range ck.Tensors {
						if optim.IsErrorBuffer(tn.Name) {
							require.Equal(t, make([]float32, len(tn.Data)), tn.Data, "%s starts at zero", tn.Name)
						}
					}
				}
				if sharded {
					for _, pre := range []struct{ shard, whole string }{
						{onebit.ExpAvgShardPrefix, optim.ExpAvgPrefix}, {onebit.ExpAvgSqShardPrefix, optim.ExpAvgSqPrefix},
					} {
						var whole []float32
						for _, p := range []string{"w0", "w1", "w2"} {
							whole = append(whole, one[0].Tensor(pre.whole+p).Data...)
						}
						var shards []float32
						for k := 0; k < int(cks[0].Ints[onebit.IntBuckets]); k++ {
							name := pre.shard + "bucket:" + strconv.Itoa(k)
							shards = append(shards, byElement(cks, name, numelOf(t, cks[0], name))...)
						}
						assert.Equal(t, bitsOf(whole), bitsOf(shards), "%s on %d ranks", pre.shard, w)
					}
				}
				grown, params := regroupRun(t, w, tc.mk, cks, 7, 3)
				if !strings.HasPrefix(tc.name, "0/1") {
					for r := 1; r < w; r++ {
						assert.Equal(t, params[0], params[r], "W=%d: rank %d's parameters", w, r)
					}
				}
				if !sharded {
					reset := make([]*optim.Checkpoint, w)
					for r := range reset {
						reset[r] = one[0].ResetErrors()
					}
					_, want := regroupRun(t, w, tc.mk, reset, 7, 3)
					assert.Equal(t, want, params, "W=%d: as after ResetErrors", w)
				}
				back, err := onebit.Regroup(cks, 1, 0)
				require.NoError(t, err)
				assert.Equal(t, ckBits(one[0]), ckBits(back), "back on one rank from %d", w)
				// The grown run shrinks back to one rank and trains on.
				shrunk, err := onebit.Regroup(grown, 1, 0)
				require.NoError(t, err)
				regroupRun(t, 1, tc.mk, []*optim.Checkpoint{shrunk}, 10, 2)
			}
		})
	}
}

// Regroup refuses the checkpoints of the optimizers without error
// feedback of their own to regroup, saying what loads them on another
// number of ranks, and that advice works: the outer optimizer (a 1-bit
// codec's, whose error buffers outer.Regroup carries) loads
// outer.Regroup(old, W', r) on rank r of a group of another size W',
// exact Adam old[r % W] as it is.
func TestRegroupOtherAlgorithms(t *testing.T) {
	outerAdam := func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		cfg := outer.DefaultConfig()
		cfg.H, cfg.Codec = 2, outer.CodecOneBit
		return outer.NewAdam(context.Background(), c, ps, cfg, optim.DefaultAdamConfig())
	}
	exact := func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return optim.NewAdam(context.Background(), c, ps, optim.DefaultAdamConfig())
	}
	for _, tc := range []struct {
		name string
		mk   func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)
		msg  []string
	}{
		{"outer", outerAdam, []string{`"outer-adam" is the outer optimizer's`, "outer.Regroup", "the error feedback carried", "docs/outer.md"}},
		{"exact Adam", exact, []string{"no error feedback", "loads as it is on any group size"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			two, _ := regroupRun(t, 2, tc.mk, nil, 1, 3)
			for _, w := range []int{2, 3} {
				_, err := onebit.Regroup(two, w, 0)
				require.Error(t, err)
				assert.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
				for _, m := range tc.msg {
					assert.Contains(t, err.Error(), m)
				}
				assert.NotContains(t, err.Error(), "as it is)")
			}
			reset := make([]*optim.Checkpoint, 3)
			for r := range reset {
				reset[r] = two[r%2]
				if tc.name == "outer" {
					var err error
					reset[r], err = outer.Regroup(two, 3, r)
					require.NoError(t, err)
				}
			}
			cks, _ := regroupRun(t, 3, tc.mk, reset, 4, 2)
			steps := cks[0].Ints[optim.IntStep]
			if tc.name == "outer" {
				steps = cks[0].Ints[outer.IntCalls]
			}
			assert.Equal(t, int64(5), steps)
		})
	}
}
