package onebit_test

// The references of the TestPin* tests: the three 1-bit optimizers and
// the error-compensated compressed allreduce written again, in float64,
// straight from the formulas of the spec page onebit.md, simulating every
// rank of the group in one goroutine. They share no code with package
// onebit or with optim's kernels.

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
)

// pinParam is one parameter of the pinned model: its name, size, the
// scale of its gradients (the momenta of the parameters differ by a factor
// 60, so that 1-bit LAMB's scaling_p matters), and whether it starts at
// zero (so that LAMB's first trust ratio is 1 for it).
type pinParam struct {
	name  string
	n     int
	scale float64
	zero  bool
}

// pinModel has a parameter with no elements (which the optimizers must
// ignore) and a masked one ("mask", mask {1, 0, 1}).
var pinModel = []pinParam{{"a", 35, 1, false}, {"empty", 0, 1, false}, {"b", 13, 20, false}, {"mask", 3, 0.3, true}}

func pinMask() map[string][]float32 { return map[string][]float32{"mask": {1, 0, 1}} }

// pinInit is element k of parameter i at the start.
func pinInit(i, k int) float32 {
	if pinModel[i].zero {
		return 0
	}
	return float32(math.Sin(float64(1+100*i+k))) * 0.5
}

// pinGrad is element k of rank r's gradient of parameter i at step t:
// different on every rank, step and element.
func pinGrad(i, r, t, k int) float32 {
	x := math.Cos(float64(t*7919 + r*104729 + i*1009 + 31*k))
	return float32(pinModel[i].scale * x * (1 + 0.5*float64(r)))
}

// pinRun runs steps steps of the optimizer mk builds on w ranks
// (comm/local), with the gradients of pinGrad, and returns every rank's
// checkpoint after every step: cks[t-1][r].
func pinRun(t *testing.T, w, steps int, mk func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error)) [][]*optim.Checkpoint {
	t.Helper()
	cks := make([][]*optim.Checkpoint, steps)
	for s := range cks {
		cks[s] = make([]*optim.Checkpoint, w)
	}
	var mu sync.Mutex
	pinRunEach(t, w, steps, mk, func(s, r int, opt optim.Optimizer) error {
		ck, err := opt.State()
		mu.Lock()
		cks[s-1][r] = ck
		mu.Unlock()
		return err
	})
	return cks
}

// pinRunEach is pinRun calling after(step, rank, opt) after every step
// on every rank (concurrently on the ranks) instead of taking checkpoints.
func pinRunEach(t *testing.T, w, steps int, mk func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error), after func(s, r int, opt optim.Optimizer) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		ps := make([]*optim.Param, len(pinModel))
		for i, pm := range pinModel {
			ps[i] = optim.NewParam(pm.name, pm.n)
			for k := range ps[i].Data() {
				ps[i].Data()[k] = pinInit(i, k)
			}
		}
		opt, err := mk(c, ps)
		if err != nil {
			return err
		}
		r := c.Rank()
		for s := 1; s <= steps; s++ {
			for i, p := range ps {
				for k := range p.GradData() {
					p.GradData()[k] = pinGrad(i, r, s, k)
				}
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if err := after(s, r, opt); err != nil {
				return err
			}
		}
		return nil
	})
	require.NoError(t, err)
}

// pinClose requires got to be want within tol*(1+max|want|), element by
// element: float32 rounding errors scale with the largest value of the
// tensor, not with each element (an element of m that nearly cancels
// carries the rounding error of its larger terms).
func pinClose(t *testing.T, tol float64, want []float64, got []float32, format string, args ...any) {
	t.Helper()
	require.Len(t, got, len(want), fmt.Sprintf(format, args...))
	scale := 0.0
	for _, x := range want {
		scale = max(scale, math.Abs(x))
	}
	bound := tol * (1 + scale)
	for k := range want {
		if d := math.Abs(float64(got[k]) - want[k]); !(d <= bound) {
			require.Failf(t, "differs from the reference", "%s[%d]: got %.9g, reference %.9g (|diff| %.3g, tolerance %.3g)",
				fmt.Sprintf(format, args...), k, got[k], want[k], d, bound)
		}
	}
}

// pinEF is the spec's error-compensated compressed allreduce of one
// n-element tensor on w ranks, in float64: worker and server errors of
// every rank.
type pinEF struct {
	w, n, N        int
	worker, server [][]float64
}

func newPinEF(n, w int) *pinEF {
	l := 8
	for l%w != 0 { // lcm(w, 8)
		l += 8
	}
	q := w * l
	N := (n + q - 1) / q * q
	e := &pinEF{w: w, n: n, N: N, worker: make([][]float64, w), server: make([][]float64, w)}
	for r := range w {
		e.worker[r] = make([]float64, N)
		e.server[r] = make([]float64, N/w)
	}
	return e
}

func (e *pinEF) reset() {
	for r := range e.w {
		clear(e.worker[r])
		clear(e.server[r])
	}
}

func pinSgn(x float64) float64 {
	if x >= 0 || math.IsNaN(x) {
		return 1
	}
	return -1
}

func pinNorm(x []float64) float64 {
	s := 0.0
	for _, v := range x {
		s += v * v
	}
	return math.Sqrt(s)
}

// allReduce replaces in[r] (n elements each) by the collective's output,
// the same on every rank.
func (e *pinEF) allReduce(in [][]float64) {
	if e.n == 0 {
		e.reset()
		return
	}
	w, N, C := e.w, e.N, e.N/e.w
	signs, scales := make([][]float64, w), make([]float64, w)
	for r := range w {
		x := make([]float64, N)
		copy(x, in[r]) // 1. pad, + worker_error
		for i := range x {
			x[i] += e.worker[r][i]
		}
		scales[r] = pinNorm(x) / math.Sqrt(float64(N)) // 2.
		signs[r] = make([]float64, N)
		for i := range x {
			signs[r][i] = pinSgn(x[i])
			e.worker[r][i] = x[i] - scales[r]*signs[r][i] // 3.
		}
	}
	out := make([]float64, N)
	for j := range w { // server j
		c := make([]float64, C)
		for i := range c {
			for r := range w { // 5., ascending r
				c[i] += scales[r] / float64(w) * signs[r][j*C+i]
			}
			c[i] += e.server[j][i] // 6.
		}
		s := pinNorm(c) / math.Sqrt(float64(C)) // 7.
		for i := range c {
			e.server[j][i] = c[i] - s*pinSgn(c[i]) // 8.
			out[j*C+i] = s * pinSgn(c[i])
		}
	}
	for r := range w {
		copy(in[r], out[:e.n])
	}
}

// pinComm is the compressed allreduce of the per-parameter buffers x[r][i]
// of every rank: one fused tensor of all parameters in order (the default
// buckets, all the pinned model fits in one; and 1-bit LAMB's fused
// buffer), or one tensor per parameter (PerParameter).
type pinComm struct {
	w     int
	fused bool
	efs   []*pinEF
}

func newPinComm(w int, fused bool) *pinComm {
	pc := &pinComm{w: w, fused: fused}
	if fused {
		total := 0
		for _, pm := range pinModel {
			total += pm.n
		}
		pc.efs = []*pinEF{newPinEF(total, w)}
		return pc
	}
	for _, pm := range pinModel {
		pc.efs = append(pc.efs, newPinEF(pm.n, w))
	}
	return pc
}

func (pc *pinComm) reset() {
	for _, e := range pc.efs {
		e.reset()
	}
}

func (pc *pinComm) allReduce(x [][][]float64) {
	if pc.w == 1 {
		return // the spec: skipped when W = 1
	}
	if !pc.fused {
		for i := range pinModel {
			in := make([][]float64, pc.w)
			for r := range pc.w {
				in[r] = x[r][i]
			}
			pc.efs[i].allReduce(in)
		}
		return
	}
	in := make([][]float64, pc.w)
	for r := range pc.w {
		for i := range pinModel {
			in[r] = append(in[r], x[r][i]...)
		}
	}
	pc.efs[0].allReduce(in)
	for r := range pc.w {
		off := 0
		for i := range pinModel {
			off += copy(x[r][i], in[r][off:])
		}
	}
}

// pinState is one rank's per-parameter buffers.
type pinState [][]float64

func newPinState(init bool) pinState {
	s := make(pinState, len(pinModel))
	for i, pm := range pinModel {
		s[i] = make([]float64, pm.n)
		if init {
			for k := range s[i] {
				s[i][k] = float64(pinInit(i, k))
			}
		}
	}
	return s
}

func (s pinState) clone() pinState {
	c := make(pinState, len(s))
	for i := range s {
		c[i] = append([]float64(nil), s[i]...)
	}
	return c
}

// pinGrads returns every rank's gradients of step t (as float64 of the
// float32 the optimizer sees) and their exact mean.
func pinGrads(w, t int) (g []pinState, mean pinState) {
	g = make([]pinState, w)
	mean = newPinState(false)
	for r := range w {
		g[r] = newPinState(false)
		for i := range pinModel {
			for k := range g[r][i] {
				g[r][i][k] = float64(pinGrad(i, r, t, k))
				mean[i][k] += g[r][i][k] / float64(w)
			}
		}
	}
	return g, mean
}

func pinBC(beta float64, t int64, on bool) float64 {
	if !on || t < 1 {
		return 1
	}
	return 1 / (1 - math.Pow(beta, float64(t)))
}
