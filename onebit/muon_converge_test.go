package onebit_test

import (
	"context"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// A small convergence problem for 1-bit Muon: a student network
// y = W2 tanh(W1 x + b1) + b2 (W1 64 x 32, W2 10 x 64 by Muon, the biases
// by the auxiliary AdamW) regresses on a fixed teacher of the same form,
// each rank on batches of its own, the loss measured on a held-out set.
const (
	mlpIn, mlpHidden, mlpOut = 32, 64, 10
	mlpBatch                 = 16 // per rank
	mlpTest                  = 256
)

// mlpTask is the teacher and the held-out set.
type mlpTask struct {
	w1, b1, w2, b2 []float32
	testX, testY   []float32
	seed           uint64 // of the training batches
}

func newMLPTask() *mlpTask {
	rng := rand.New(rand.NewPCG(1, 2))
	t := &mlpTask{}
	t.w1, t.b1 = mlpInit(rng, mlpHidden*mlpIn, 1/math.Sqrt(mlpIn)), mlpInit(rng, mlpHidden, 0.5)
	t.w2, t.b2 = mlpInit(rng, mlpOut*mlpHidden, 1.5/math.Sqrt(mlpHidden)), mlpInit(rng, mlpOut, 0.5)
	t.testX = mlpInit(rng, mlpTest*mlpIn, 1)
	t.testY = make([]float32, mlpTest*mlpOut)
	h := make([]float32, mlpHidden)
	for n := range mlpTest {
		mlpForward(t.w1, t.b1, t.w2, t.b2, t.testX[n*mlpIn:(n+1)*mlpIn], h, t.testY[n*mlpOut:(n+1)*mlpOut])
	}
	return t
}

func mlpInit(rng *rand.Rand, n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64() * scale)
	}
	return x
}

// mlpForward computes the hidden activations h and the output y of x.
func mlpForward(w1, b1, w2, b2, x, h, y []float32) {
	for j := range mlpHidden {
		s := b1[j]
		for i, xi := range x {
			s += w1[j*mlpIn+i] * xi
		}
		h[j] = float32(math.Tanh(float64(s)))
	}
	for k := range mlpOut {
		s := b2[k]
		for j, hj := range h {
			s += w2[k*mlpHidden+j] * hj
		}
		y[k] = s
	}
}

// mlpParams returns the student's parameters, the same on every rank.
func mlpParams() []*optim.Param {
	rng := rand.New(rand.NewPCG(3, 4))
	w1 := optim.NewParam("w1", mlpHidden, mlpIn)
	copy(w1.Data(), mlpInit(rng, mlpHidden*mlpIn, 1/math.Sqrt(mlpIn)))
	w2 := optim.NewParam("w2", mlpOut, mlpHidden)
	copy(w2.Data(), mlpInit(rng, mlpOut*mlpHidden, 1/math.Sqrt(mlpHidden)))
	return []*optim.Param{w1, optim.NewParam("b1", mlpHidden), w2, optim.NewParam("b2", mlpOut)}
}

// grad writes the gradient of the mean squared error (halved) of rank r's
// batch of step s into ps.
func (t *mlpTask) grad(ps []*optim.Param, r, s int) {
	rng := rand.New(rand.NewPCG(uint64(r+1)+t.seed<<32, uint64(s)))
	w1, b1, w2, b2 := ps[0].Data(), ps[1].Data(), ps[2].Data(), ps[3].Data()
	g := [4][]float32{ps[0].GradData(), ps[1].GradData(), ps[2].GradData(), ps[3].GradData()}
	for _, x := range g {
		clear(x)
	}
	x, h, y, want, ty := make([]float32, mlpIn), make([]float32, mlpHidden), make([]float32, mlpOut), make([]float32, mlpOut), make([]float32, mlpHidden)
	dh := make([]float32, mlpHidden)
	const inv = 1.0 / mlpBatch
	for range mlpBatch {
		for i := range x {
			x[i] = float32(rng.NormFloat64())
		}
		mlpForward(t.w1, t.b1, t.w2, t.b2, x, ty, want)
		mlpForward(w1, b1, w2, b2, x, h, y)
		clear(dh)
		for k := range mlpOut {
			e := (y[k] - want[k]) * inv
			g[3][k] += e
			for j, hj := range h {
				g[2][k*mlpHidden+j] += e * hj
				dh[j] += e * w2[k*mlpHidden+j]
			}
		}
		for j, hj := range h {
			d := dh[j] * (1 - hj*hj)
			g[1][j] += d
			for i, xi := range x {
				g[0][j*mlpIn+i] += d * xi
			}
		}
	}
}

// loss is the held-out mean squared error (halved) of ps.
func (t *mlpTask) loss(ps []*optim.Param) float64 {
	h, y := make([]float32, mlpHidden), make([]float32, mlpOut)
	var l float64
	for n := range mlpTest {
		mlpForward(ps[0].Data(), ps[1].Data(), ps[2].Data(), ps[3].Data(), t.testX[n*mlpIn:(n+1)*mlpIn], h, y)
		for k, yk := range y {
			d := float64(yk - t.testY[n*mlpOut+k])
			l += d * d / 2
		}
	}
	return l / mlpTest
}

// mlpTrain trains the student for steps steps on w ranks with the
// optimizer mk makes and returns rank 0's held-out loss.
func mlpTrain(t testing.TB, task *mlpTask, w, steps int, mk func(context.Context, comm.Comm, []*optim.Param) (optim.Optimizer, error)) float64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var mu sync.Mutex
	var loss float64
	err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		ps := mlpParams()
		opt, err := mk(ctx, c, ps)
		if err != nil {
			return err
		}
		defer opt.Close()
		for s := 1; s <= steps; s++ {
			task.grad(ps, c.Rank(), s)
			if err := opt.Step(ctx); err != nil {
				return err
			}
		}
		if c.Rank() == 0 {
			mu.Lock()
			loss = task.loss(ps)
			mu.Unlock()
		}
		return nil
	})
	require.NoError(t, err)
	return loss
}

// mlpSchedules sets cosine schedules on both groups of a Muon optimizer
// (exact or 1-bit): 0.02 to 0.0002 for Muon, 3e-3 to 3e-5 for AdamW, so
// that the final loss is not the noise of a constant step.
func mlpSchedules(o interface {
	SetSchedule(optim.Schedule) error
	SetAdamSchedule(optim.Schedule) error
}, steps int) error {
	ms, err := optim.CosineDecay(0.02, 0.0002, int64(steps))
	if err != nil {
		return err
	}
	as, err := optim.CosineDecay(3e-3, 3e-5, int64(steps))
	if err != nil {
		return err
	}
	if err := o.SetSchedule(ms); err != nil {
		return err
	}
	return o.SetAdamSchedule(as)
}

// 1-bit Muon with its defaults trains the student of mlpTask on 4 ranks
// to within 25% of exact Muon's held-out loss in 300 steps (measured:
// 15.5% above with the AdamW group's warm-up only, the default, 12.2% with
// the exact warm-up of both groups; the scheme itself, each rank's
// momentum orthogonalized and the updates averaged exactly, 14.0% above:
// docs/muon.md), and far below where it started.
func TestMuonConverges(t *testing.T) {
	if testing.Short() || cvRace {
		t.Skip("the convergence run takes a second; skipped in -short mode and under the race detector")
	}
	const w, steps = 4, 300
	task := newMLPTask()
	start := task.loss(mlpParams())
	exact := mlpTrain(t, task, w, steps, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		o, err := optim.NewMuon(ctx, c, ps, optim.DefaultMuonConfig())
		if err != nil {
			return nil, err
		}
		return o, mlpSchedules(o, steps)
	})
	got := mlpTrain(t, task, w, steps, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		o, err := onebit.NewMuon(ctx, c, ps, onebit.DefaultMuonConfig())
		if err != nil {
			return nil, err
		}
		return o, mlpSchedules(o, steps)
	})
	t.Logf("held-out loss after %d steps on %d ranks: start %.4f, exact Muon %.4f, 1-bit Muon %.4f (%+.1f%%)", steps, w, start, exact, got, 100*(got/exact-1))
	require.Less(t, got, 1.25*exact)
	require.Less(t, got, start/5)
}

// The compact modes train the student as StateFull does: held-out loss
// after 300 steps on 4 ranks within 1% of StateFull's (measured: +0.01%
// and +0.08% with MomentumBF16; docs/muon.md).
func TestMuonCompactConverges(t *testing.T) {
	if testing.Short() || cvRace {
		t.Skip("the convergence runs take seconds; skipped in -short mode and under the race detector")
	}
	const w, steps = 4, 300
	task := newMLPTask()
	loss := map[string]float64{}
	for _, mode := range muonModes[:3] { // the state modes; the owners' exchanges: TestMuonOwnersConverges
		cfg := onebit.DefaultMuonConfig()
		var err error
		cfg.StateMode, cfg.MomentumBF16, err = onebit.ParseMuonStateMode(mode)
		require.NoError(t, err)
		loss[mode] = mlpTrain(t, task, w, steps, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			o, err := onebit.NewMuon(ctx, c, ps, cfg)
			if err != nil {
				return nil, err
			}
			return o, mlpSchedules(o, steps)
		})
	}
	full := loss["full"]
	t.Logf("held-out loss after %d steps on %d ranks: StateFull %.4f, StateCompact %.4f (%+.2f%%), with MomentumBF16 %.4f (%+.2f%%)",
		steps, w, full, loss["compact"], 100*(loss["compact"]/full-1), loss["compact-bf16"], 100*(loss["compact-bf16"]/full-1))
	assert.InDelta(t, 1, loss["compact"]/full, 0.01)
	assert.InDelta(t, 1, loss["compact-bf16"]/full, 0.01)
}

// ExchangeOwners keeps the mean's polar factor: on the student network on
// 8 ranks it ends nearer exact Muon than ExchangePolar, whose bias grows
// with the ranks (measured, 600 steps, the defaults: +42.4% / +70.7% /
// +165.9% above exact Muon on 4 / 8 / 16 ranks against +67.4% / +140.8% /
// +357.2%; with the AdamW group exact for the whole run, FreezeStep 600,
// +25.8% / +29.2% / +80.2% against +54.8% / +119.5% / +310.4%:
// docs/muon.md).
func TestMuonOwnersConverges(t *testing.T) {
	if testing.Short() || cvRace {
		t.Skip("the convergence runs take seconds; skipped in -short mode and under the race detector")
	}
	const w, steps = 8, 300
	task := newMLPTask()
	exact := mlpTrain(t, task, w, steps, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		o, err := optim.NewMuon(ctx, c, ps, optim.DefaultMuonConfig())
		if err != nil {
			return nil, err
		}
		return o, mlpSchedules(o, steps)
	})
	gap := map[string]float64{}
	for _, name := range []string{"polar", "owners", "owners2"} {
		cfg := onebit.DefaultMuonConfig()
		if name != "polar" {
			mode := muonModeConfig(t, 0, name)
			cfg.Exchange, cfg.OwnerBits = mode.Exchange, mode.OwnerBits
		}
		gap[name] = mlpTrain(t, task, w, steps, func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			o, err := onebit.NewMuon(ctx, c, ps, cfg)
			if err != nil {
				return nil, err
			}
			return o, mlpSchedules(o, steps)
		})/exact - 1
	}
	t.Logf("held-out loss after %d steps on %d ranks against exact Muon's %.4f: polar %+.1f%%, owners %+.1f%%, owners at two bits %+.1f%%",
		steps, w, exact, 100*gap["polar"], 100*gap["owners"], 100*gap["owners2"])
	require.Less(t, gap["owners"], gap["polar"]/1.5, "the owners' gap to exact Muon is well under the polar exchange's")
	require.Less(t, gap["owners2"], gap["owners"]/2, "two bits to the owners halve it again")
}

// fixedPointTargets are the fixed-point problem's targets of w ranks, n
// elements each (docs/muon.md), and their mean, the fit.
func fixedPointTargets(w, n int) (targets [][]float32, fit []float32) {
	rng := rand.New(rand.NewPCG(7, 8))
	targets, fit = make([][]float32, w), make([]float32, n)
	for r := range w {
		targets[r] = mlpInit(rng, n, 1)
		for i, v := range targets[r] {
			fit[i] += v / float32(w)
		}
	}
	return targets, fit
}

// The fixed-point problem of docs/muon.md: rank r's gradient of a 16 x 32
// matrix is w - target_r, so exact Muon on the averaged gradient heads
// for the mean of the targets; 200 steps on 4 ranks, Muon's rate on a
// cosine from 0.3 to 0.003. ExchangeOwners, whose update is the polar
// factor of an estimate of the mean momentum, ends within 10x exact
// Muon's distance from the mean (issue 61's bound); ExchangePolar, the
// mean of the ranks' polar factors, converges elsewhere (measured: exact
// Muon 0.0087, owners 0.049, at two bits 0.038, polar 4.3; docs/muon.md).
func TestMuonFixedPoint(t *testing.T) {
	const w, rows, cols, steps = 4, 16, 32, 200
	targets, fit := fixedPointTargets(w, rows*cols)
	run := func(mk func(context.Context, comm.Comm, []*optim.Param) (optim.Optimizer, error)) float64 {
		var d float64
		err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
			ps := []*optim.Param{optim.NewParam("w", rows, cols)}
			o, err := mk(ctx, c, ps)
			if err != nil {
				return err
			}
			defer o.Close()
			for s := 1; s <= steps; s++ {
				g, p := ps[0].GradData(), ps[0].Data()
				for i := range g {
					g[i] = p[i] - targets[c.Rank()][i]
				}
				if err := o.Step(ctx); err != nil {
					return err
				}
			}
			if c.Rank() == 0 {
				for i, v := range ps[0].Data() {
					d += float64(v-fit[i]) * float64(v-fit[i])
				}
			}
			return nil
		})
		require.NoError(t, err)
		return math.Sqrt(d)
	}
	sched := func(o interface{ SetSchedule(optim.Schedule) error }) error {
		ms, err := optim.CosineDecay(0.3, 0.003, steps)
		if err != nil {
			return err
		}
		return o.SetSchedule(ms)
	}
	exact := run(func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		o, err := optim.NewMuon(ctx, c, ps, optim.DefaultMuonConfig())
		if err != nil {
			return nil, err
		}
		return o, sched(o)
	})
	dist := map[int]float64{}
	for bits := range 3 { // 0: ExchangePolar; 1, 2: ExchangeOwners at that OwnerBits
		dist[bits] = run(func(ctx context.Context, c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
			cfg := onebit.DefaultMuonConfig()
			if bits > 0 {
				cfg.Exchange, cfg.OwnerBits = onebit.ExchangeOwners, bits
			}
			o, err := onebit.NewMuon(ctx, c, ps, cfg)
			if err != nil {
				return nil, err
			}
			return o, sched(o)
		})
	}
	t.Logf("distance from the mean of the targets after %d steps on %d ranks: exact Muon %.4g, polar %.4g (%.0fx), owners %.4g (%.1fx), owners at two bits %.4g (%.1fx)",
		steps, w, exact, dist[0], dist[0]/exact, dist[1], dist[1]/exact, dist[2], dist[2]/exact)
	assert.LessOrEqual(t, dist[1], 10*exact, "the owners' exchange: within 10x exact Muon's distance")
	assert.LessOrEqual(t, dist[2], 10*exact, "the same at two bits")
	assert.Greater(t, dist[0], 10*exact, "the polar exchange is biased: the test tells the two apart")
}
