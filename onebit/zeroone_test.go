package onebit_test

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/testnet"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

func newZeroOne(cfg onebit.ZeroOneAdamConfig) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
	return func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return onebit.NewZeroOneAdam(context.Background(), c, ps, cfg)
	}
}

// zeroOneTestConfig has a short phase A and fast-growing intervals:
// variance steps 1, 2, 4, 6, then phase B from step 7 with local
// intervals 1 (steps 7, 8), 2 (9, 10) and 4 from step 11 on.
func zeroOneTestConfig() onebit.ZeroOneAdamConfig {
	cfg := onebit.DefaultZeroOneAdamConfig()
	cfg.LR = 0.01
	cfg.WeightDecay = 0.01
	cfg.VarFreezeStep = 6
	cfg.VarUpdateScaler = 2
	cfg.LocalStepScaler = 2
	cfg.LocalStepClipper = 4
	cfg.ExpAvgMask = map[string][]float32{"fc2.bias": {1, 0, 1}}
	return cfg
}

// TestZeroOneScheduleByHand checks the two interval schedules on one
// rank against a table worked out by hand for kappa = 2, var_freeze_step
// = 20, local_step_scaler = 3 and H = 4, and that v changes exactly on
// variance steps and u is emptied exactly on synchronization steps.
func TestZeroOneScheduleByHand(t *testing.T) {
	cfg := onebit.DefaultZeroOneAdamConfig()
	cfg.VarFreezeStep, cfg.VarUpdateScaler, cfg.LocalStepScaler, cfg.LocalStepClipper = 20, 2, 3, 4
	// After step t: {var_interval, var_counter} in phase A,
	// {local_interval, local_counter} in phase B.
	want := map[int64][2]int64{
		1: {1, 1}, 2: {2, 0}, 3: {2, 0}, 4: {2, 1}, 5: {2, 1}, 6: {4, 0}, 7: {4, 0}, 8: {4, 1},
		9: {4, 1}, 10: {4, 1}, 11: {4, 1}, 12: {8, 0}, 13: {8, 0}, 14: {8, 0}, 15: {8, 0}, 16: {8, 1},
		17: {8, 1}, 18: {8, 1}, 19: {8, 1}, 20: {8, 1},
		21: {1, 1}, 22: {1, 2}, 23: {2, 0}, 24: {2, 1}, 25: {2, 2}, 26: {4, 0},
		27: {4, 1}, 28: {4, 2}, 29: {4, 0}, 30: {4, 1}, 31: {4, 2}, 32: {4, 0},
	}
	varSteps := map[int64]bool{1: true, 2: true, 4: true, 6: true, 8: true, 12: true, 16: true}
	syncSteps := map[int64]bool{21: true, 22: true, 23: true, 24: true, 26: true, 28: true, 32: true}

	net := testnet.New(5, 8, 6, 3)
	d := testnet.Generate(5, 32, 8, 3)
	opt, err := onebit.NewZeroOneAdam(context.Background(), nil, net.Params(), cfg)
	require.NoError(t, err)
	prev, err := opt.State()
	require.NoError(t, err)
	for step := int64(1); step <= 32; step++ {
		require.NoError(t, testnet.Train(context.Background(), opt, net, d, 8, step, step, nil))
		vi, vc, li, lc := opt.Intervals()
		if step <= 20 {
			assert.Equal(t, want[step], [2]int64{vi, vc}, "var interval and counter after step %d", step)
			assert.Equal(t, [2]int64{1, 0}, [2]int64{li, lc}, "local interval and counter after step %d", step)
		} else {
			assert.Equal(t, [2]int64{8, 1}, [2]int64{vi, vc}, "var interval and counter after step %d", step)
			assert.Equal(t, want[step], [2]int64{li, lc}, "local interval and counter after step %d", step)
		}
		ck, err := opt.State()
		require.NoError(t, err)
		vChanged := !lzEqualFloats(prev.Tensor(optim.ExpAvgSqPrefix+"fc1.weight").Data, ck.Tensor(optim.ExpAvgSqPrefix+"fc1.weight").Data)
		assert.Equal(t, varSteps[step], vChanged, "v changed at step %d", step)
		if step >= 20 {
			// u = p - anchor is empty after the switch and after every
			// synchronization, and only then.
			uEmpty := lzEqualFloats(ck.Tensor(onebit.AnchorPrefix+"fc1.weight").Data, ck.Tensor(optim.ParamTensorName("fc1.weight")).Data)
			assert.Equal(t, step == 20 || syncSteps[step], uEmpty, "u is empty after step %d", step)
		}
		wantStage := optim.StagePhaseA
		if step >= 20 {
			wantStage = optim.StagePhaseB
		}
		assert.Equal(t, wantStage, opt.Stats().Stage, "stage after step %d", step)
		prev = ck
	}
	assert.Equal(t, int64(7), prev.Ints[onebit.IntVarUpdates])
}

func lzEqualFloats(a, b []float32) bool {
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return len(a) == len(b)
}

// TestZeroOneTraffic checks on 4 ranks which steps communicate what:
// variance steps an exact allreduce per parameter, other phase-A steps a
// compressed allreduce of the gradient, phase-B synchronization steps a
// compressed allreduce of u, and other phase-B steps only the
// finite-gradient flag.
func TestZeroOneTraffic(t *testing.T) {
	t.Run("per parameter", func(t *testing.T) { zeroOneTraffic(t, optim.PerParameter) })
	t.Run("one fused bucket", func(t *testing.T) { zeroOneTraffic(t, 0) })
}

func zeroOneTraffic(t *testing.T, bucketBytes int) {
	const w = 4
	cfg := zeroOneTestConfig()
	cfg.BucketBytes = bucketBytes
	s := lzSetup(w, newZeroOne(cfg))
	d := s.Data()
	bytes := make([]int64, 17)
	err := local.Run(lzCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		net := testnet.New(1, s.In, s.Hidden, s.Classes)
		opt, err := onebit.NewZeroOneAdam(ctx, c, net.Params(), cfg)
		if err != nil {
			return err
		}
		r := c.Rank()
		for step := int64(1); step <= 16; step++ {
			if err := testnet.Train(ctx, opt, net, d.Shard(r*s.ShardN, (r+1)*s.ShardN), s.Batch, step, step, nil); err != nil {
				return err
			}
			if r == 0 {
				bytes[step] = opt.Stats().LastStepBytes
			}
		}
		return nil
	})
	require.NoError(t, err)
	flag := comm.RingAllReduceBytes(4, w)
	var exact, compressed, total int64
	onebitBytes := func(n int) int64 { return 2*(w-1)*int64(onebit.PaddedLen(n, w))/8/w + (w-1)*(12+4) }
	for _, p := range testnet.New(1, s.In, s.Hidden, s.Classes).Params() {
		exact += comm.RingAllReduceBytes(4*int64(p.Numel()), w)
		compressed += onebitBytes(p.Numel())
		total += int64(p.Numel())
	}
	if bucketBytes != optim.PerParameter {
		compressed = onebitBytes(int(total)) // one collective for the whole model
	}
	for step := int64(1); step <= 16; step++ {
		want := flag
		switch step {
		case 1, 2, 4, 6: // variance steps
			want += exact
		case 3, 5: // phase A, compressed gradient
			want += compressed
		case 7, 8, 10, 12, 16: // phase B synchronizations
			want += compressed
		}
		assert.Equal(t, want, bytes[step], "bytes sent at step %d", step)
	}
}

// TestZeroOneAllVarianceStepsIsAdam: while every step is a variance step
// (kappa larger than the run), 0/1 Adam is exact Adam, bit for bit, on
// any number of ranks.
func TestZeroOneAllVarianceStepsIsAdam(t *testing.T) {
	for _, bc := range []bool{true, false} {
		for _, w := range []int{1, 3} {
			t.Run(fmt.Sprintf("bias_correction=%v/W=%d", bc, w), func(t *testing.T) {
				cfg := zeroOneTestConfig()
				cfg.BiasCorrection = bc
				cfg.VarFreezeStep, cfg.VarUpdateScaler = 1000, 1000
				exact, err := lzSetup(w, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
					return optim.NewAdam(context.Background(), c, ps, cfg.AdamConfig)
				}).Uninterrupted(lzCtx(t), 20, nil)
				require.NoError(t, err)
				got, err := lzSetup(w, newZeroOne(cfg)).Uninterrupted(lzCtx(t), 20, nil)
				require.NoError(t, err)
				for r := range got {
					lzSameParams(t, exact[r], got[r])
				}
			})
		}
	}
}

func TestZeroOneResumeBitIdentical(t *testing.T) {
	for _, w := range []int{2, 4} {
		t.Run(fmt.Sprintf("W=%d", w), func(t *testing.T) {
			// Phase A after a variance step (2) and after a compressed
			// one (3), across the switch at step 6 (k = 5, 6, 7), and in
			// phase B between synchronizations (9, 11: u is not empty).
			lzResume(t, lzSetup(w, newZeroOne(zeroOneTestConfig())), 16, 2, 3, 5, 6, 7, 9, 11)
		})
	}
	t.Run("W=3 fused buckets", func(t *testing.T) {
		cfg := zeroOneTestConfig()
		cfg.BucketBytes = 512
		lzResume(t, lzSetup(3, newZeroOne(cfg)), 16, 3, 6, 9)
	})
}

func TestZeroOneSkipsNonFiniteSteps(t *testing.T) {
	// Phase A: variance step 2 and compressed step 3 (after the skip, 3
	// is still the third step); the switch step; phase B.
	lzNaN(t, lzSetup(3, newZeroOne(zeroOneTestConfig())), 16, map[int64]int{2: 1, 3: 0, 7: 2, 10: 1, 12: 0})
}

func TestZeroOneLoadRefuses(t *testing.T) {
	lzRefusals(t, optim.AlgorithmZeroOneAdam, newZeroOne(zeroOneTestConfig()))
}

func TestZeroOneZeroAllocs(t *testing.T) {
	for _, w := range []int{1, 2} {
		for _, warm := range []int{0, 4, 10} { // phase A from the start, phase A, phase B
			t.Run(fmt.Sprintf("W=%d/warm=%d", w, warm), func(t *testing.T) {
				cfg := zeroOneTestConfig()
				cfg.ExpAvgMask = nil
				lzZeroAllocs(t, w, warm, newZeroOne(cfg))
			})
		}
	}
}

func TestZeroOneConfigErrors(t *testing.T) {
	ps := []*optim.Param{optim.NewParam("a", 2, 3)}
	for name, mut := range map[string]func(*onebit.ZeroOneAdamConfig){
		"var freeze step 0":   func(c *onebit.ZeroOneAdamConfig) { c.VarFreezeStep = 0 },
		"var update scaler 0": func(c *onebit.ZeroOneAdamConfig) { c.VarUpdateScaler = 0 },
		"local step scaler 0": func(c *onebit.ZeroOneAdamConfig) { c.LocalStepScaler = 0 },
		"clipper 0":           func(c *onebit.ZeroOneAdamConfig) { c.LocalStepClipper = 0 },
		"beta 1":              func(c *onebit.ZeroOneAdamConfig) { c.Beta1 = 1 },
		"mask of a stranger":  func(c *onebit.ZeroOneAdamConfig) { c.ExpAvgMask = map[string][]float32{"b": {1}} },
		"short mask":          func(c *onebit.ZeroOneAdamConfig) { c.ExpAvgMask = map[string][]float32{"a": {1}} },
	} {
		cfg := onebit.DefaultZeroOneAdamConfig()
		mut(&cfg)
		_, err := onebit.NewZeroOneAdam(context.Background(), nil, ps, cfg)
		assert.Error(t, err, name)
	}
	_, err := onebit.NewZeroOneAdam(context.Background(), nil, []*optim.Param{nil}, onebit.DefaultZeroOneAdamConfig())
	assert.Error(t, err, "nil parameter")
	_, err = onebit.NewZeroOneAdam(context.Background(), nil, ps, onebit.DefaultZeroOneAdamConfig())
	assert.NoError(t, err)
}

// Two in-process ranks fit a vector of 64 weights to their own targets
// (rank r's are (r+1)*cos(i)) with 0/1 Adam: phase A up to step 20, then
// local steps with a synchronization every 1, 2 and then 4 steps. After a
// synchronization both ranks hold the same weights, close to the mean
// target 1.5*cos(i).
func ExampleNewZeroOneAdam() {
	const n = 64
	var dev [2]float64
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		w := optim.NewParam("w", n)
		cfg := onebit.DefaultZeroOneAdamConfig()
		cfg.LR = 0.02
		cfg.VarFreezeStep = 20
		cfg.LocalStepScaler = 10
		cfg.LocalStepClipper = 4
		opt, err := onebit.NewZeroOneAdam(ctx, c, []*optim.Param{w}, cfg)
		if err != nil {
			return err
		}
		defer opt.Close() // every holder of an optimizer closes it (not a collective)
		for range 400 {
			for i := range n { // the gradient of (w-target)^2/2
				w.GradData()[i] = w.Data()[i] - float32(c.Rank()+1)*float32(math.Cos(float64(i)))
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		for i, x := range w.Data() {
			dev[c.Rank()] = max(dev[c.Rank()], math.Abs(float64(x)-1.5*math.Cos(float64(i))))
		}
		if c.Rank() == 0 {
			_, _, every, _ := opt.Intervals()
			fmt.Printf("%s after %d steps, synchronizing every %d steps\n", opt.Stats().Stage, opt.Stats().Steps, every)
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("largest distance to the mean target: %.2f on rank 0, %.2f on rank 1\n", dev[0], dev[1])
	// Output:
	// phase-b after 400 steps, synchronizing every 4 steps
	// largest distance to the mean target: 0.12 on rank 0, 0.12 on rank 1
}
