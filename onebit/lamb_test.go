package onebit_test

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/testnet"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// Helpers shared by the tests of 1-bit LAMB and 0/1 Adam carry the prefix
// lz, so that they cannot collide with other tests of this package.

func lzCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// lzSetup is a small network on w ranks; newOpt builds the optimizer.
func lzSetup(w int, newOpt func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)) testnet.Setup {
	return testnet.Setup{World: w, Seed: 7, In: 8, Hidden: 6, Classes: 3, ShardN: 32, Batch: 8, Empty: true, New: newOpt}
}

// lzParams returns the parameter tensors of a checkpoint by name.
func lzParams(ck *optim.Checkpoint) map[string][]float32 {
	out := map[string][]float32{}
	for _, t := range ck.Tensors {
		if name, ok := strings.CutPrefix(t.Name, optim.ParamTensorName("")); ok {
			out[name] = t.Data
		}
	}
	return out
}

// lzSameParams requires bit-identical parameters in two checkpoints.
func lzSameParams(t *testing.T, want, got *optim.Checkpoint) {
	t.Helper()
	wp, gp := lzParams(want), lzParams(got)
	require.Equal(t, len(wp), len(gp))
	for name, w := range wp {
		g := gp[name]
		require.Len(t, g, len(w), name)
		for i := range w {
			require.Equal(t, math.Float32bits(w[i]), math.Float32bits(g[i]), "%s[%d]: %v vs %v", name, i, w[i], g[i])
		}
	}
}

// lzAllFinite requires every parameter of ck to be finite.
func lzAllFinite(t *testing.T, ck *optim.Checkpoint) {
	t.Helper()
	for name, p := range lzParams(ck) {
		require.True(t, optim.Finite(p), "parameter %s is not finite", name)
	}
}

// lzResume checks that stopping after step k and resuming from per-rank
// checkpoint files gives, bit for bit, the state of a run that never
// stopped.
func lzResume(t *testing.T, s testnet.Setup, steps int64, ks ...int64) {
	t.Helper()
	ctx := lzCtx(t)
	want, err := s.Uninterrupted(ctx, steps, nil)
	require.NoError(t, err)
	for r := 1; r < s.World; r++ {
		lzSameParams(t, want[0], want[r]) // every rank holds the same model
	}
	for _, k := range ks {
		got, err := s.Resumed(ctx, t.TempDir(), k, steps)
		require.NoError(t, err, "k=%d", k)
		for r := range got {
			require.NoError(t, testnet.SameBits(want[r], got[r]), "W=%d k=%d rank %d", s.World, k, r)
		}
	}
}

// lzNaN runs steps on w ranks, poisons the gradient of one rank at each
// step of bad (NaN or Inf), and checks that every such step changes
// nothing but the step counters on every rank, that training continues,
// and that the parameters end finite.
func lzNaN(t *testing.T, s testnet.Setup, steps int64, bad map[int64]int) {
	t.Helper()
	d := s.Data()
	stats := make([]optim.Stats, s.World)
	err := local.Run(lzCtx(t), s.World, func(ctx context.Context, c comm.Comm) error {
		net := testnet.New(s.Seed, s.In, s.Hidden, s.Classes)
		opt, err := s.New(c, net.Params())
		if err != nil {
			return err
		}
		r := c.Rank()
		shard := d.Shard(r*s.ShardN, (r+1)*s.ShardN)
		for step := int64(1); step <= steps; step++ {
			if _, err := net.LossGrad(shard.Batch(step, s.Batch)); err != nil {
				return err
			}
			badRank, isBad := bad[step]
			if isBad && badRank == r {
				g := net.Params()[step%4].GradData()
				g[len(g)/2] = float32([]float64{math.NaN(), math.Inf(1), math.Inf(-1)}[step%3])
			}
			before, err := opt.State()
			if err != nil {
				return err
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if !isBad {
				continue
			}
			after, err := opt.State()
			if err != nil {
				return err
			}
			before.Ints[optim.IntSteps]++
			before.Ints[optim.IntSkipped]++
			if err := testnet.SameBits(before, after); err != nil {
				return fmt.Errorf("skipped step %d changed the state: %w", step, err)
			}
		}
		ck, err := opt.State()
		if err != nil {
			return err
		}
		for name, p := range lzParams(ck) {
			if !optim.Finite(p) {
				return fmt.Errorf("parameter %s is not finite", name)
			}
		}
		stats[r] = opt.Stats()
		return nil
	})
	require.NoError(t, err)
	for r, st := range stats {
		assert.Equal(t, steps, st.Steps, "rank %d", r)
		assert.Equal(t, int64(len(bad)), st.Skipped, "rank %d", r)
	}
}

// lzRefusals checks that Load refuses checkpoints of another algorithm,
// world size, rank or shape, or with a missing buffer, and that the
// optimizer is unchanged afterwards. newOpt builds the optimizer over
// params on c.
func lzRefusals(t *testing.T, algorithm string, newOpt func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)) {
	t.Helper()
	ctx := lzCtx(t)
	s := lzSetup(2, newOpt)
	cks, err := s.Uninterrupted(ctx, 6, nil)
	require.NoError(t, err)
	ck := cks[0]
	require.Equal(t, algorithm, ck.Algorithm)

	cs, err := local.New(2)
	require.NoError(t, err)
	net := testnet.New(99, s.In, s.Hidden, s.Classes)
	opt, err := newOpt(cs[0], append(net.Params(), optim.NewParam("empty", 0)))
	require.NoError(t, err)
	before, err := opt.State()
	require.NoError(t, err)

	refuse := func(name string, ck *optim.Checkpoint, o optim.Optimizer) {
		t.Helper()
		err := o.Load(ck)
		require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint, name)
		t.Logf("%s: %v", name, err)
		after, err := o.State()
		require.NoError(t, err)
		require.NoError(t, testnet.SameBits(before, after), "%s changed the optimizer", name)
	}
	clone := func() *optim.Checkpoint {
		c := *ck
		c.Ints = map[string]int64{}
		for k, v := range ck.Ints {
			c.Ints[k] = v
		}
		c.Tensors = append([]optim.Tensor(nil), ck.Tensors...)
		return &c
	}

	other := clone()
	other.Algorithm = optim.AlgorithmOnebitAdam
	refuse("algorithm", other, opt)
	other = clone()
	other.Rank = 1
	refuse("rank", other, opt)
	other = clone()
	other.Tensors = other.Tensors[:len(other.Tensors)-1]
	refuse("missing buffer", other, opt)
	other = clone()
	delete(other.Ints, optim.IntStep)
	refuse("missing counter", other, opt)
	other = clone()
	other.Stage = "bogus"
	refuse("stage", other, opt)
	other = clone()
	for i, tn := range other.Tensors {
		if tn.Name == optim.ParamTensorName("fc1.bias") {
			other.Tensors[i] = optim.Tensor{Name: tn.Name, Shape: []int{len(tn.Data) - 1}, Data: tn.Data[1:]}
		}
	}
	refuse("shape", other, opt)

	one, err := newOpt(nil, append(net.Params(), optim.NewParam("empty", 0)))
	require.NoError(t, err)
	before, err = one.State()
	require.NoError(t, err)
	refuse("world size", ck, one)

	// And the real thing loads.
	require.NoError(t, opt.Load(ck))
	after, err := opt.State()
	require.NoError(t, err)
	require.NoError(t, testnet.SameBits(ck, after))
}

// lzZeroAllocs checks that Step allocates nothing once the optimizer has
// taken warm steps (one AllocsPerRun on rank 0 while the other ranks step
// alongside; the count is process-wide).
func lzZeroAllocs(t *testing.T, w int, warm int, newOpt func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)) {
	t.Helper()
	cs, err := local.New(w)
	require.NoError(t, err)
	ctx := lzCtx(t)
	opts := make([]optim.Optimizer, w)
	for r := range cs {
		net := testnet.New(3, 8, 6, 3)
		for _, p := range net.Params() {
			for i := range p.GradData() {
				p.GradData()[i] = float32(math.Sin(float64(i + r)))
			}
		}
		opts[r], err = newOpt(cs[r], net.Params())
		require.NoError(t, err)
	}
	const runs = 20
	var wg sync.WaitGroup
	for r := 1; r < w; r++ {
		wg.Go(func() {
			for i := 0; i < warm+runs+1; i++ {
				if err := opts[r].Step(ctx); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	for i := 0; i < warm; i++ {
		require.NoError(t, opts[0].Step(ctx))
	}
	allocs := testing.AllocsPerRun(runs, func() {
		if err := opts[0].Step(ctx); err != nil {
			t.Error(err)
		}
	})
	wg.Wait()
	assert.Zero(t, allocs)
}

func newLamb(cfg onebit.LambConfig) func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
	return func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return onebit.NewLamb(context.Background(), c, ps, cfg)
	}
}

// lambTestConfig is a config whose compression stage starts after
// freeze steps, with weight decay and a mask on fc2.bias.
func lambTestConfig(freeze int) onebit.LambConfig {
	cfg := onebit.DefaultLambConfig()
	cfg.LR = 0.01
	cfg.WeightDecay = 0.01
	cfg.FreezeStep = freeze
	cfg.ExpAvgMask = map[string][]float32{"fc2.bias": {1, 0, 1}}
	return cfg
}

func TestLambWarmupIsExactLamb(t *testing.T) {
	for _, bc := range []bool{true, false} {
		for _, w := range []int{1, 3} {
			t.Run(fmt.Sprintf("bias_correction=%v/W=%d", bc, w), func(t *testing.T) {
				cfg := lambTestConfig(1000)
				cfg.BiasCorrection = bc
				cfg.CoeffBeta = 0.5 // does not matter in warm-up
				cfg.ExpAvgMask = nil
				exact, err := lzSetup(w, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
					return optim.NewLamb(context.Background(), c, ps, cfg.LambConfig)
				}).Uninterrupted(lzCtx(t), 20, nil)
				require.NoError(t, err)
				got, err := lzSetup(w, newLamb(cfg)).Uninterrupted(lzCtx(t), 20, nil)
				require.NoError(t, err)
				for r := range got {
					lzSameParams(t, exact[r], got[r])
				}
			})
		}
	}
}

// TestLambFactorByHand follows the spec's formulas in float64 on a tiny
// model with one rank (no compression: the allreduce is skipped) through
// one warm-up step and three compression steps, and compares parameters,
// coeff_freeze, scaling and last_factor.
func TestLambFactorByHand(t *testing.T) {
	const (
		lr, b1, b2, eps, wd = 0.1, 0.9, 0.99, 1e-8, 0.1
		cb, fmax, fmin, th  = 0.9, 4.0, 0.5, 0.1
	)
	init := [][]float64{{1, -2}, {0.5, 0.25, -1}}
	grads := [][][]float64{ // step, parameter, element
		{{0.1, -0.2}, {1, 2, -3}},
		{{0.3, 0.1}, {-1, 0.5, 0.5}},
		{{-0.2, 0.4}, {2, -1, 0.1}},
		{{0.01, 0.02}, {0.05, -0.02, 0.01}},
	}

	cfg := onebit.DefaultLambConfig()
	cfg.LR, cfg.Beta1, cfg.Beta2, cfg.Eps, cfg.WeightDecay = lr, b1, b2, eps, wd
	cfg.BiasCorrection = false
	cfg.FreezeStep = 1
	ps := []*optim.Param{optim.NewParam("a", 2), optim.NewParam("empty", 0), optim.NewParam("b", 3)}
	for i, j := range []int{0, 2} {
		for k, x := range init[i] {
			ps[j].Data()[k] = float32(x)
		}
	}
	opt, err := onebit.NewLamb(context.Background(), nil, ps, cfg)
	require.NoError(t, err)

	// The spec, in float64.
	n := len(init)
	p, m, v, vf := make([][]float64, n), make([][]float64, n), make([][]float64, n), make([][]float64, n)
	for i := range init {
		p[i] = append([]float64(nil), init[i]...)
		m[i], v[i], vf[i] = make([]float64, len(p[i])), make([]float64, len(p[i])), make([]float64, len(p[i]))
	}
	norm := func(x []float64) float64 {
		s := 0.0
		for _, e := range x {
			s += e * e
		}
		return math.Sqrt(s)
	}
	coeffFreeze, lastFactor, scaling := make([]float64, n), []float64{1, 1}, []float64{1, 1}
	prevFactor := 1.0
	for step, g := range grads {
		if step == 0 { // warm-up
			for i := range p {
				upd := make([]float64, len(p[i]))
				for k := range p[i] {
					m[i][k] = b1*m[i][k] + (1-b1)*g[i][k]
					v[i][k] = b2*v[i][k] + (1-b2)*g[i][k]*g[i][k]
					upd[k] = m[i][k]/(math.Sqrt(v[i][k])+eps) + wd*p[i][k]
				}
				coeff := min(max(norm(p[i])/norm(upd), 0.01), 10)
				coeffFreeze[i] = cb*coeffFreeze[i] + (1-cb)*coeff
				for k := range p[i] {
					p[i][k] -= lr * coeff * upd[k]
				}
				vf[i] = append([]float64(nil), v[i]...)
			}
		} else {
			if step == 1 {
				s := []float64{norm(m[0]) / math.Sqrt(2), norm(m[1]) / math.Sqrt(3)}
				u := (s[0] + s[1]) / 2
				scaling = []float64{u / s[0], u / s[1]}
			}
			for i := range p {
				pre, upd := make([]float64, len(p[i])), make([]float64, len(p[i]))
				factor := 0.0
				for k := range p[i] {
					last := m[i][k]
					m[i][k] = b1*m[i][k] + (1-b1)*g[i][k] // scaling cancels with W = 1
					grec := (m[i][k] - b1*last) / (1 - b1)
					vf[i][k] = b2*vf[i][k] + (1-b2)*grec*grec
					denom := math.Sqrt(v[i][k]) + eps
					pre[k] = m[i][k] / denom
					upd[k] = pre[k] + wd*p[i][k]
					factor = max(factor, denom/(math.Sqrt(vf[i][k])+eps))
				}
				r := min(1, norm(pre)/norm(upd))
				factor = factor*r + (1 - r)
				factor = min(max(factor, fmin), fmax)
				factor = min(max(factor, lastFactor[i]*(1-th)), lastFactor[i]*(1+th))
				lastFactor[i] = factor
				for k := range p[i] {
					p[i][k] -= lr * coeffFreeze[i] * factor * upd[k]
				}
			}
		}

		for i, j := range []int{0, 2} {
			for k := range g[i] {
				ps[j].GradData()[k] = float32(g[i][k])
			}
		}
		require.NoError(t, opt.Step(context.Background()))
		ck, err := opt.State()
		require.NoError(t, err)
		for i, name := range []string{"a", "b"} {
			for k, want := range p[i] {
				assert.InEpsilon(t, want, ck.Tensor(optim.ParamTensorName(name)).Data[k], 1e-5, "step %d %s[%d]", step+1, name, k)
			}
			assert.InEpsilon(t, coeffFreeze[i], ck.Floats[onebit.FloatCoeffFreezePrefix+name], 1e-6, "step %d coeff_freeze %s", step+1, name)
			assert.InEpsilon(t, lastFactor[i], ck.Floats[onebit.FloatLastFactorPrefix+name], 1e-5, "step %d last_factor %s", step+1, name)
			assert.InEpsilon(t, scaling[i], ck.Floats[onebit.FloatScalingPrefix+name], 1e-6, "step %d scaling %s", step+1, name)
		}
		if step == 2 {
			// The factor of a falls faster than the threshold allows.
			assert.InEpsilon(t, 0.9*prevFactor, ck.Floats[onebit.FloatLastFactorPrefix+"a"], 1e-6)
		}
		prevFactor = ck.Floats[onebit.FloatLastFactorPrefix+"a"]
		t.Logf("step %d: stage %s, last_factor a %.6f b %.6f, scaling a %.6f b %.6f",
			step+1, opt.Stage(), lastFactor[0], lastFactor[1], scaling[0], scaling[1])
		assert.Empty(t, ck.Tensor(optim.ParamTensorName("empty")).Data)
	}
	assert.Equal(t, optim.StageCompression, opt.Stats().Stage)
}

func TestLambResumeBitIdentical(t *testing.T) {
	const freeze = 5
	for _, w := range []int{2, 4} {
		t.Run(fmt.Sprintf("W=%d", w), func(t *testing.T) {
			// Warm-up, across the switch (k = freeze-1, freeze, freeze+1),
			// and in compression.
			lzResume(t, lzSetup(w, newLamb(lambTestConfig(freeze))), 12, 2, freeze-1, freeze, freeze+1, 9)
		})
	}
}

func TestLambSkipsNonFiniteSteps(t *testing.T) {
	// Warm-up steps 2 and 4 (4 is the freeze step), compression steps 5
	// and 8, on different ranks.
	lzNaN(t, lzSetup(3, newLamb(lambTestConfig(4))), 12, map[int64]int{2: 1, 4: 0, 5: 2, 8: 1})
}

func TestLambLoadRefuses(t *testing.T) {
	lzRefusals(t, optim.AlgorithmOnebitLamb, newLamb(lambTestConfig(3)))
}

func TestLambZeroAllocs(t *testing.T) {
	for _, tc := range []struct {
		name      string
		w, freeze int
		warm      int
	}{
		{"warmup/W=1", 1, 1000, 2},
		{"warmup/W=2", 2, 1000, 2},
		{"compression/W=1", 1, 1, 3},
		{"compression/W=2", 2, 1, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := lambTestConfig(tc.freeze)
			cfg.ExpAvgMask = nil
			lzZeroAllocs(t, tc.w, tc.warm, newLamb(cfg))
		})
	}
}

func TestLambConfigErrors(t *testing.T) {
	ps := []*optim.Param{optim.NewParam("a", 2, 3)}
	for name, mut := range map[string]func(*onebit.LambConfig){
		"freeze step 0":      func(c *onebit.LambConfig) { c.FreezeStep = 0 },
		"coeff beta 1":       func(c *onebit.LambConfig) { c.CoeffBeta = 1 },
		"factor min 0":       func(c *onebit.LambConfig) { c.FactorMin = 0 },
		"factor min > max":   func(c *onebit.LambConfig) { c.FactorMin, c.FactorMax = 2, 1 },
		"threshold 1":        func(c *onebit.LambConfig) { c.FactorThreshold = 1 },
		"negative lr":        func(c *onebit.LambConfig) { c.LR = -1 },
		"min coeff > max":    func(c *onebit.LambConfig) { c.MinCoeff = 20 },
		"mask of a stranger": func(c *onebit.LambConfig) { c.ExpAvgMask = map[string][]float32{"b": {1}} },
		"short mask":         func(c *onebit.LambConfig) { c.ExpAvgMask = map[string][]float32{"a": {1}} },
		"NaN mask": func(c *onebit.LambConfig) {
			c.ExpAvgMask = map[string][]float32{"a": {1, 1, 1, 1, 1, float32(math.NaN())}}
		},
	} {
		cfg := onebit.DefaultLambConfig()
		mut(&cfg)
		_, err := onebit.NewLamb(context.Background(), nil, ps, cfg)
		assert.Error(t, err, name)
	}
	_, err := onebit.NewLamb(context.Background(), nil, []*optim.Param{optim.NewParam("a", 1), optim.NewParam("a", 2)}, onebit.DefaultLambConfig())
	assert.Error(t, err, "duplicate names")
	_, err = onebit.NewLamb(context.Background(), nil, ps, onebit.DefaultLambConfig())
	assert.NoError(t, err)
}

// TestLambTraffic checks that a compression step sends one fused
// compressed allreduce (plus the finite-gradient flag) and a warm-up step
// an exact allreduce per parameter.
func TestLambTraffic(t *testing.T) {
	const w = 4
	s := lzSetup(w, newLamb(lambTestConfig(2)))
	d := s.Data()
	var warm, compressed int64
	err := local.Run(lzCtx(t), w, func(ctx context.Context, c comm.Comm) error {
		net := testnet.New(1, s.In, s.Hidden, s.Classes)
		opt, err := onebit.NewLamb(ctx, c, net.Params(), lambTestConfig(2))
		if err != nil {
			return err
		}
		if err := testnet.Train(ctx, opt, net, d.Shard(0, s.ShardN), s.Batch, 1, 3, func(step int64) {
			if step == 3 && c.Rank() == 0 {
				compressed = opt.Stats().BytesSent
			}
		}); err != nil {
			return err
		}
		if c.Rank() == 0 {
			warm, compressed = compressed/2, opt.Stats().LastStepBytes
		}
		return nil
	})
	require.NoError(t, err)
	flag := comm.RingAllReduceBytes(4, w)
	net := testnet.New(1, s.In, s.Hidden, s.Classes)
	exact := flag
	for _, p := range net.Params() {
		exact += comm.RingAllReduceBytes(4*int64(p.Numel()), w)
	}
	n := int64(onebit.PaddedLen(net.NumParams(), w))
	assert.Equal(t, exact, warm)
	assert.Equal(t, flag+2*(w-1)*n/8/w+(w-1)*(12+4), compressed)
}

// Two in-process ranks fit a vector of 64 weights to their own targets
// (rank r's are (r+1)*cos(i)) with 1-bit LAMB: ten warm-up steps of
// plain LAMB, then compressed momentum. Both ranks end with the same
// weights, close to the mean target 1.5*cos(i).
func ExampleNewLamb() {
	const n = 64
	var dev [2]float64
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		w := optim.NewParam("w", n)
		for i := range w.Data() {
			w.Data()[i] = 0.5
		}
		cfg := onebit.DefaultLambConfig()
		cfg.LR = 0.05
		cfg.FreezeStep = 10
		opt, err := onebit.NewLamb(ctx, c, []*optim.Param{w}, cfg)
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
			fmt.Printf("stage %s after %d steps\n", opt.Stats().Stage, opt.Stats().Steps)
		}
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("largest distance to the mean target: %.2f on rank 0, %.2f on rank 1\n", dev[0], dev[1])
	// Output:
	// stage compression after 400 steps
	// largest distance to the mean target: 0.04 on rank 0, 0.04 on rank 1
}
