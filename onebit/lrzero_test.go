package onebit_test

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// lrZeroDiffers says whether checkpoint entry name may differ between a
// run at learning rate 0 and the same run at lr > 0: the parameters, the
// learning rates, what depends on the parameters (LAMB's trust ratios, and
// with weight decay its factors), and in 0/1 Adam's phase B what the
// synchronizations recover from the parameters' moves (the momentum, the
// anchors, lrs and the error feedback of u).
func lrZeroDiffers(opt, name string, phaseB bool) bool {
	switch {
	case strings.HasPrefix(name, "param/"), name == optim.FloatLR, name == optim.FloatAdamLR:
		return true
	case strings.Contains(opt, "lamb") && (strings.HasPrefix(name, onebit.FloatCoeffFreezePrefix) ||
		strings.HasPrefix(name, onebit.FloatLastFactorPrefix)):
		return true
	case opt == "zeroone-adam" && phaseB:
		return !strings.HasPrefix(name, optim.ExpAvgSqPrefix)
	case opt == "zeroone-adam":
		return strings.HasPrefix(name, onebit.AnchorPrefix) // the parameters at the end of phase A
	}
	return false
}

// TestLRZero: every optimizer and state mode takes a learning rate of 0
// in its config: on 3 ranks, with weight decay, the parameters stay bit
// for bit where they started at every step, and the state after the same
// steps equals, entry by entry, that of the run at lr 0.01 wherever the
// parameters do not enter it (all of it in 1-bit Adam and 1-bit Muon,
// the exact optimizers and 0/1 Adam's phase A; in phase B the variance).
func TestLRZero(t *testing.T) {
	const phaseA = 12 // 0/1 Adam's VarFreezeStep in ngOptimizers
	init := ngParams(t)
	for name, build := range ngOptimizers() {
		t.Run(name, func(t *testing.T) {
			for _, steps := range []int{phaseA, ngSteps} {
				if steps == phaseA && name != "zeroone-adam" {
					continue
				}
				zero, ckZero := ngRun(t, build, 0, 0.1, nil, 0, steps)
				_, ckOn := ngRun(t, build, 0.01, 0.1, nil, 0, steps)
				for r := range ngWorld {
					for s := range steps {
						for i, p := range zero[r][s] {
							for j, x := range p {
								require.Equal(t, math.Float32bits(init[i].Data()[j]), math.Float32bits(x),
									"rank %d step %d: element %d of %s moved at lr 0", r, s+1, j, init[i].Name)
							}
						}
					}
					a, b := ckZero[r], ckOn[r]
					assert.Equal(t, b.Ints, a.Ints, "rank %d: counters", r)
					for k, f := range b.Floats {
						if !lrZeroDiffers(name, k, steps > phaseA) {
							assert.Equal(t, f, a.Floats[k], "rank %d: %s after %d steps", r, k, steps)
						}
					}
					for _, tn := range b.Tensors {
						if !lrZeroDiffers(name, tn.Name, steps > phaseA) {
							require.NotNil(t, a.Tensor(tn.Name), tn.Name)
							assert.Equal(t, tn.Data, a.Tensor(tn.Name).Data, "rank %d: %s after %d steps", r, tn.Name, steps)
						}
					}
				}
			}
		})
	}
}

// lrZeroUntil is the learning rate 0 up to step until, then lr.
type lrZeroUntil struct {
	until int64
	lr    float32
}

func (s lrZeroUntil) LR(t int64) float32 {
	if t <= s.until {
		return 0
	}
	return s.lr
}

func (s lrZeroUntil) String() string { return fmt.Sprintf("zero-until(%d, %v)", s.until, s.lr) }

// TestLRZeroSchedule: a schedule that starts at 0 (SetSchedule accepts
// it) leaves the parameters where they are until it rises, then they
// train; in 0/1 Adam the synchronizations due while it is 0 (phase B
// from step 13, the schedule 0 up to step 20) have nothing to average and
// do not run the compressed allreduce, and the ranks' anchors agree after
// the next one.
// SetLR(0) is accepted too, and stops the training (1-bit Muon: both
// groups' schedules and SetAdamLR too).
func TestLRZeroSchedule(t *testing.T) {
	const until = 20
	init := ngParams(t)
	for name, build := range ngOptimizers() {
		t.Run(name, func(t *testing.T) {
			hist := make([][][]float32, ngWorld)
			sent := make([][]int64, ngWorld)
			states := make([]*optim.Checkpoint, ngWorld)
			err := local.Run(adamCtx(t), ngWorld, func(ctx context.Context, c comm.Comm) error {
				ps := ngParams(t)
				opt, err := build(ctx, c, ps, 0.01, 0)
				if err != nil {
					return err
				}
				defer opt.Close()
				ls := opt.(optim.LRSetter)
				if err := ls.SetSchedule(lrZeroUntil{until, 0.01}); err != nil {
					return err
				}
				mu, _ := opt.(*onebit.Muon) // dense is its AdamW group's
				if mu != nil {
					if err := mu.SetAdamSchedule(lrZeroUntil{until, 0.01}); err != nil {
						return err
					}
				}
				for s := 1; s <= ngSteps; s++ {
					if s == ngSteps-2 {
						if err := ls.SetLR(0); err != nil {
							return err
						}
						if mu != nil {
							if err := mu.SetAdamLR(0); err != nil {
								return err
							}
						}
					}
					ngGrads(ps, c.Rank(), s)
					if err := opt.Step(ctx); err != nil {
						return fmt.Errorf("step %d: %w", s, err)
					}
					hist[c.Rank()] = append(hist[c.Rank()], append([]float32(nil), ps[1].Data()...))
					sent[c.Rank()] = append(sent[c.Rank()], opt.Stats().LastStepBytes)
				}
				states[c.Rank()], err = opt.State()
				return err
			})
			require.NoError(t, err)
			for r := range ngWorld {
				for s := range ngSteps {
					x := hist[r][s]
					switch {
					case s+1 <= until:
						require.Equal(t, init[1].Data(), x, "rank %d step %d: dense moved at lr 0", r, s+1)
					case s+1 > ngSteps-2:
						require.Equal(t, hist[r][ngSteps-3], x, "rank %d step %d: dense moved after SetLR(0)", r, s+1)
					}
					for _, v := range x {
						require.False(t, math.IsNaN(float64(v)) || math.IsInf(float64(v), 0), "rank %d step %d", r, s+1)
					}
				}
				assert.NotEqual(t, init[1].Data(), hist[r][ngSteps-3], "rank %d: no training after the schedule rose", r)
			}
			if name != "zeroone-adam" {
				return
			}
			synced := sent[0][23] // step 24, the first synchronization after the schedule rose
			for _, s := range []int{13, 14, 15, 16, 18, 20} {
				assert.Less(t, 2*sent[0][s-1], synced, "step %d: a synchronization at lr 0 ran the compressed allreduce", s)
			}
			for _, tn := range states[0].Tensors {
				if strings.HasPrefix(tn.Name, onebit.AnchorPrefix) {
					for r := 1; r < ngWorld; r++ {
						assert.Equal(t, tn.Data, states[r].Tensor(tn.Name).Data, "rank %d's %s", r, tn.Name)
					}
				}
			}
		})
	}
}
