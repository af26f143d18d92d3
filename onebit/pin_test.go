package onebit_test

// The TestPin* tests pin every step of the spec's three 1-bit optimizers
// (onebit.md): the optimizers run on W ranks of comm/local and, after
// every step, every rank's parameters and moments (and the optimizer's
// other state) must match the references of pin_ref_test.go, which
// simulate all W ranks in float64 from the spec's formulas, the compressed
// allreduce included (skipped for W = 1, where the spec skips it). The
// runs cross every stage switch. Each test's tolerance is argued in its
// comment; it is far below what any step's mutation changes (see the
// report of issue 25: dropping or altering any one step moves some value
// by 1e-3 relative or more).

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// pinTol is the tolerance of every comparison, relative to 1+max|value|
// of the tensor compared (see pinClose). The optimizers compute in float32
// (unit roundoff 6e-8) and the references in float64; over these runs of
// at most 26 steps the measured largest difference is below 2e-6 (it is
// float32 rounding accumulated over the steps and amplified by the
// divisions by sqrt(v)+eps), except for 0/1 Adam's m at a
// synchronization (pinTolZeroOneM). 1e-5 leaves a factor 5 of margin,
// while every mutation of a step (dropping it, swapping an operand, using
// another step's value) moves some value by 1e-3 or more.
const pinTol = 1e-5

// pinTolZeroOneM is the tolerance of 0/1 Adam's m after a
// synchronization, m = -u/lrs: the optimizer keeps u as p - anchor, a
// difference of float32 parameters of magnitude up to 1 (rounding 6e-8)
// that is about lr = 0.01 per local step, so u, and m with it, carry a
// relative error of up to about 1e-5 of the tensor's scale (measured:
// 9.7e-6 at the first synchronization on one rank). 1e-4 leaves a factor
// 10; the mutation m = 0 is off by the whole of m.
const pinTolZeroOneM = 1e-4

// pinClip is the spec's bound on the ratio m_hat/(sqrt(v_hat)+eps) of a
// compression-stage update (onebit's package doc), in float64: left alone
// up to the cap CapFactor*(1-b1)/sqrt((1-b2)*(1-b1^2/b2)), clipped to it up to the
// knee 1000, beyond which it falls as cap*1000/|r| down to 1.
func pinClip(r, b1, b2 float64) float64 {
	const knee = 1000
	c := min(onebit.CapFactor*(1-b1)/math.Sqrt((1-b2)*(1-b1*b1/b2)), knee)
	a := math.Abs(r)
	if !(a > c) {
		return r
	}
	if a > knee {
		c = max(1, c*knee/a)
	}
	return math.Copysign(c, r)
}

// pinCompare checks rank r's checkpoint of step s against the reference:
// parameters, m and v of every parameter.
func pinCompare(t *testing.T, ck *optim.Checkpoint, s, r int, p, m, v pinState, mTol float64) {
	t.Helper()
	for i, pm := range pinModel {
		pinClose(t, pinTol, p[i], ck.Tensor(optim.ParamTensorName(pm.name)).Data, "step %d rank %d param %s", s, r, pm.name)
		pinClose(t, mTol, m[i], ck.Tensor(optim.ExpAvgPrefix+pm.name).Data, "step %d rank %d m %s", s, r, pm.name)
		pinClose(t, pinTol, v[i], ck.Tensor(optim.ExpAvgSqPrefix+pm.name).Data, "step %d rank %d v %s", s, r, pm.name)
	}
}

// TestPinAdam pins 1-bit Adam: the warm-up (exact average, both moments,
// bias-corrected update with decoupled weight decay), the freeze of v and
// of its bias correction at FreezeStep, and the compression stage (local
// momentum, compressed allreduce of the fused momenta or of each
// parameter's, mask, update with the frozen v), on 1 to 4 ranks, with and
// without bias correction.
func TestPinAdam(t *testing.T) {
	const freeze, steps = 4, 12
	for _, tc := range []struct {
		w     int
		bc    bool
		fused bool
	}{{1, true, true}, {1, false, true}, {2, true, true}, {3, false, true}, {3, true, false}, {4, true, true}} {
		t.Run(fmt.Sprintf("W=%d/bias_correction=%v/fused=%v", tc.w, tc.bc, tc.fused), func(t *testing.T) {
			cfg := onebit.DefaultAdamConfig()
			cfg.LR, cfg.Beta1, cfg.Beta2, cfg.WeightDecay, cfg.BiasCorrection = 0.01, 0.9, 0.99, 0.02, tc.bc
			cfg.FreezeStep = freeze
			cfg.ExpAvgMask = pinMask()
			if !tc.fused {
				cfg.BucketBytes = optim.PerParameter
			}
			cks := pinRun(t, tc.w, steps, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				return onebit.NewAdam(context.Background(), c, ps, cfg)
			})

			// The reference.
			w := tc.w
			lr, b1, b2, eps, wd := 0.01, 0.9, 0.99, float64(cfg.Eps), 0.02
			p, m, v := make([]pinState, w), make([]pinState, w), make([]pinState, w)
			for r := range w {
				p[r], m[r], v[r] = newPinState(true), newPinState(false), newPinState(false)
			}
			pc := newPinComm(w, tc.fused)
			c2Frozen := 1.0
			update := func(r int, c1, c2 float64, bounded bool) {
				for i := range pinModel {
					for k := range p[r][i] {
						ratio := m[r][i][k] * c1 / (math.Sqrt(v[r][i][k]*c2) + eps)
						if bounded {
							ratio = pinClip(ratio, b1, b2)
						}
						upd := ratio + wd*p[r][i][k]
						p[r][i][k] -= lr * upd
					}
				}
			}
			for s := 1; s <= steps; s++ {
				g, mean := pinGrads(w, s)
				c1 := pinBC(b1, int64(s), tc.bc)
				if s <= freeze { // warm-up
					c2 := pinBC(b2, int64(s), tc.bc)
					for r := range w {
						for i := range pinModel {
							for k, gk := range mean[i] {
								m[r][i][k] = b1*m[r][i][k] + (1-b1)*gk
								v[r][i][k] = b2*v[r][i][k] + (1-b2)*gk*gk
							}
						}
						update(r, c1, c2, false)
					}
					if s == freeze {
						c2Frozen = c2
					}
				} else { // compression
					for r := range w {
						for i := range pinModel {
							for k, gk := range g[r][i] {
								m[r][i][k] = b1*m[r][i][k] + (1-b1)*gk
							}
						}
					}
					pc.allReduce(pinStates(m))
					for r := range w {
						pinApplyMask(m[r])
						update(r, c1, c2Frozen, true)
					}
				}
				for r := range w {
					wantStage := optim.StageWarmup
					if s >= freeze {
						wantStage = optim.StageCompression
					}
					require.Equal(t, wantStage, cks[s-1][r].Stage, "stage after step %d", s)
					pinCompare(t, cks[s-1][r], s, r, p[r], m[r], v[r], pinTol)
				}
				require.InEpsilon(t, c2Frozen, cks[s-1][0].Floats[onebit.FloatFrozenBiasCorrection2], 1e-6, "frozen bias correction after step %d", s)
			}
		})
	}
}

func pinStates(s []pinState) [][][]float64 {
	out := make([][][]float64, len(s))
	for r := range s {
		out[r] = s[r]
	}
	return out
}

// pinApplyMask multiplies the masked parameter's buffer by pinMask.
func pinApplyMask(x pinState) {
	for i, pm := range pinModel {
		if mask, ok := pinMask()[pm.name]; ok {
			for k := range x[i] {
				x[i][k] *= float64(mask[k])
			}
		}
	}
}

// pinLambCase is one 1-bit LAMB configuration of TestPinLamb.
type pinLambCase struct {
	name                     string
	w                        int
	bc                       bool
	wd                       float64
	minCoeff, maxCoeff       float64
	factorMin, factorMax, th float64
}

// TestPinLamb pins 1-bit LAMB: the warm-up (plain LAMB: trust ratio with
// its clip and its "1 when a norm is 0" rule, coeff_freeze fed only when
// coeff != 1, v_fresh = v kept at freeze_step) and the compression steps
// 1-5 (m_last, scaling_p from the first compression step's momenta,
// m = (b1*m + (1-b1)*g_local)*scaling_p, one compressed allreduce of the
// fused buffer, m /= scaling_p, mask, g_rec, v_fresh, the frozen
// denominator, factor as the largest ratio of denominators with its wd > 0
// blend, its clip to [factor_min, factor_max] and to the threshold around
// last_factor, p -= lr*coeff_freeze*factor*upd), with a parameter of no
// elements. The configurations make each clip bind: the default threshold
// 0.1 (the factor creeps), a threshold of 0.95 with factor_max 0.8 (the
// factor formula, which starts near 1 and falls to about 0.6 here as
// v_fresh takes in the compression noise, and its upper clip), factor_min
// 1.1 (its lower clip),
// max_coeff 0.3 and min_coeff 0.8 (the trust ratio's clips). scaling_p and
// the allreduce only show with W > 1 (with one rank the scaling cancels).
func TestPinLamb(t *testing.T) {
	const freeze, steps = 3, 12
	base := pinLambCase{w: 3, wd: 0.02, minCoeff: 0.01, maxCoeff: 10, factorMin: 0.5, factorMax: 4, th: 0.1}
	var cases []pinLambCase
	add := func(name string, f func(*pinLambCase)) {
		c := base
		c.name = name
		f(&c)
		cases = append(cases, c)
	}
	add("W=1", func(c *pinLambCase) { c.w = 1 })
	add("W=1/bias_correction", func(c *pinLambCase) { c.w, c.bc = 1, true })
	add("W=2/threshold", func(c *pinLambCase) { c.w = 2 })
	add("W=3/bias_correction", func(c *pinLambCase) { c.bc = true })
	add("W=3/factor_max", func(c *pinLambCase) { c.th, c.factorMax = 0.95, 0.8 })
	add("W=4/factor_min", func(c *pinLambCase) { c.w, c.th, c.factorMin = 4, 0.95, 1.1 })
	add("W=3/no_wd/max_coeff", func(c *pinLambCase) { c.wd, c.th, c.maxCoeff = 0, 0.95, 0.3 })
	add("W=2/min_coeff", func(c *pinLambCase) { c.w, c.th, c.minCoeff = 2, 0.95, 0.8 })
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) { pinLamb(t, tc, freeze, steps) })
	}
}

func pinLamb(t *testing.T, tc pinLambCase, freeze, steps int) {
	cfg := onebit.DefaultLambConfig()
	cfg.LR, cfg.Beta1, cfg.Beta2, cfg.WeightDecay, cfg.BiasCorrection = 0.01, 0.9, 0.99, float32(tc.wd), tc.bc
	cfg.MinCoeff, cfg.MaxCoeff = float32(tc.minCoeff), float32(tc.maxCoeff)
	cfg.FactorMin, cfg.FactorMax, cfg.FactorThreshold = float32(tc.factorMin), float32(tc.factorMax), float32(tc.th)
	cfg.CoeffBeta = 0.9
	cfg.FreezeStep = freeze
	cfg.ExpAvgMask = pinMask()
	cks := pinRun(t, tc.w, steps, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return onebit.NewLamb(context.Background(), c, ps, cfg)
	})

	w, n := tc.w, len(pinModel)
	lr, b1, b2, eps, wd, cb := 0.01, 0.9, 0.99, float64(cfg.Eps), tc.wd, 0.9
	p, m, v, vf := make([]pinState, w), make([]pinState, w), make([]pinState, w), make([]pinState, w)
	for r := range w {
		p[r], m[r], v[r], vf[r] = newPinState(true), newPinState(false), newPinState(false), newPinState(false)
	}
	pc := newPinComm(w, true)
	coeffFreeze, lastFactor, scaling := make([]float64, n), make([]float64, n), make([]float64, n)
	for i := range n {
		lastFactor[i], scaling[i] = 1, 1
	}
	frozenAt := int64(0)
	scaled := false
	for s := 1; s <= steps; s++ {
		g, mean := pinGrads(w, s)
		c1 := pinBC(b1, int64(s), tc.bc)
		if s <= freeze {
			c2 := pinBC(b2, int64(s), tc.bc)
			for r := range w {
				for i := range pinModel {
					if pinModel[i].n == 0 {
						continue
					}
					upd := make([]float64, pinModel[i].n)
					for k, gk := range mean[i] {
						m[r][i][k] = b1*m[r][i][k] + (1-b1)*gk
						v[r][i][k] = b2*v[r][i][k] + (1-b2)*gk*gk
						upd[k] = m[r][i][k]*c1/(math.Sqrt(v[r][i][k]*c2)+eps) + wd*p[r][i][k]
					}
					coeff := 1.0
					if pn, un := pinNorm(p[r][i]), pinNorm(upd); pn != 0 && un != 0 {
						coeff = min(max(pn/un, tc.minCoeff), tc.maxCoeff)
					}
					if coeff != 1 && r == 0 {
						coeffFreeze[i] = cb*coeffFreeze[i] + (1-cb)*coeff
					}
					for k := range upd {
						p[r][i][k] -= lr * coeff * upd[k]
					}
				}
				if s == freeze {
					vf[r] = v[r].clone()
				}
			}
			if s == freeze {
				frozenAt = int64(s)
			}
		} else {
			// 2. scaling_p, on the first compression step only, from the
			// momenta (the same on every rank).
			if !scaled {
				sp := make([]float64, n)
				sum, cnt := 0.0, 0
				for i, pm := range pinModel {
					if pm.n == 0 {
						continue
					}
					sp[i] = pinNorm(m[0][i]) / math.Sqrt(float64(pm.n))
					sum += sp[i]
					cnt++
				}
				for i, pm := range pinModel {
					scaling[i] = 1
					if pm.n > 0 && sp[i] != 0 {
						scaling[i] = sum / float64(cnt) / sp[i]
					}
				}
				scaled = true
			}
			// 1. and 3.
			mLast := make([]pinState, w)
			for r := range w {
				mLast[r] = m[r].clone()
				for i := range pinModel {
					for k, gk := range g[r][i] {
						m[r][i][k] = (b1*m[r][i][k] + (1-b1)*gk) * scaling[i]
					}
				}
			}
			// 4.
			pc.allReduce(pinStates(m))
			// 5.
			c2, c2Fresh := pinBC(b2, frozenAt, tc.bc), pinBC(b2, int64(s), tc.bc)
			factors := append([]float64(nil), lastFactor...)
			for r := range w {
				for i := range pinModel {
					for k := range m[r][i] {
						m[r][i][k] /= scaling[i]
					}
				}
				pinApplyMask(m[r])
				for i, pm := range pinModel {
					if pm.n == 0 {
						continue
					}
					pre, upd := make([]float64, pm.n), make([]float64, pm.n)
					factor := 0.0
					for k := range m[r][i] {
						grec := (m[r][i][k] - b1*mLast[r][i][k]) / (1 - b1)
						vf[r][i][k] = b2*vf[r][i][k] + (1-b2)*grec*grec
						denom := math.Sqrt(v[r][i][k]*c2) + eps
						pre[k] = pinClip(m[r][i][k]*c1/denom, b1, b2)
						upd[k] = pre[k] + wd*p[r][i][k]
						factor = max(factor, denom/(math.Sqrt(vf[r][i][k]*c2Fresh)+eps))
					}
					if wd > 0 {
						rr := min(1, pinNorm(pre)/pinNorm(upd))
						factor = factor*rr + (1 - rr)
					}
					factor = min(max(factor, tc.factorMin), tc.factorMax)
					factor = min(max(factor, lastFactor[i]*(1-tc.th)), lastFactor[i]*(1+tc.th))
					factors[i] = factor
					for k := range upd {
						p[r][i][k] -= lr * coeffFreeze[i] * factor * upd[k]
					}
				}
			}
			copy(lastFactor, factors)
		}
		for r := range w {
			ck := cks[s-1][r]
			pinCompare(t, ck, s, r, p[r], m[r], v[r], pinTol)
			if s >= freeze {
				for i, pm := range pinModel {
					pinClose(t, pinTol, vf[r][i], ck.Tensor(onebit.ExpAvgSqFreshPrefix+pm.name).Data, "step %d rank %d v_fresh %s", s, r, pm.name)
				}
			}
			for i, pm := range pinModel {
				for _, x := range []struct {
					what string
					want float64
				}{
					{onebit.FloatCoeffFreezePrefix, coeffFreeze[i]},
					{onebit.FloatLastFactorPrefix, lastFactor[i]},
					{onebit.FloatScalingPrefix, scaling[i]},
				} {
					got := ck.Floats[x.what+pm.name]
					require.InDelta(t, x.want, got, pinTol*(1+math.Abs(x.want)), "step %d rank %d %s%s", s, r, x.what, pm.name)
				}
			}
		}
	}
}

// TestPinZeroOneAdam pins 0/1 Adam. Phase A: variance steps (exact
// average, both moments) on steps that are multiples of var_interval,
// which doubles after every kappa of them; the other steps put the
// gradient through the compressed allreduce, mask it and update m only;
// every step p -= lr*(m/(sqrt(v)+eps) + wd*p). Phase B (both error buffers
// zeroed on entry): local momentum, lrs += lr, the local step into p and
// u, and on steps that are multiples of local_interval the
// synchronization p -= u; u *= sqrt(v)+eps; allreduce; mask; m = -u/lrs;
// p += u/(sqrt(v)+eps); u = 0; lrs = 0, with local_interval doubling every
// local_step_scaler steps up to H. The config (var_freeze_step 10, kappa
// 2, local_step_scaler 3, H 4, 26 steps) gives variance steps 1, 2, 4, 6,
// 8, compressed-gradient steps 3, 5, 7, 9, 10, synchronizations at 11,
// 12, 13, 14, 16, 20 and 24 (the cap at H = 4 keeps 24), and local steps
// in between. With bias correction m is corrected for the step and v for
// its number of updates, and lrs sums lr/(1-b1^t) (the optimizer's
// documented extension; the spec has none).
func TestPinZeroOneAdam(t *testing.T) {
	const steps = 26
	for _, tc := range []struct {
		w     int
		bc    bool
		fused bool
	}{{1, false, false}, {1, true, false}, {2, false, false}, {3, false, true}, {3, true, false}, {4, false, false}} {
		t.Run(fmt.Sprintf("W=%d/bias_correction=%v/fused=%v", tc.w, tc.bc, tc.fused), func(t *testing.T) {
			cfg := onebit.DefaultZeroOneAdamConfig()
			cfg.LR, cfg.Beta1, cfg.Beta2, cfg.WeightDecay, cfg.BiasCorrection = 0.01, 0.9, 0.99, 0.02, tc.bc
			cfg.VarFreezeStep, cfg.VarUpdateScaler, cfg.LocalStepScaler, cfg.LocalStepClipper = 10, 2, 3, 4
			cfg.ExpAvgMask = pinMask()
			if tc.fused {
				cfg.BucketBytes = 0
			}
			cks := pinRun(t, tc.w, steps, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				return onebit.NewZeroOneAdam(context.Background(), c, ps, cfg)
			})
			pinZeroOne(t, cks, tc.w, tc.bc, tc.fused, steps)
		})
	}
}

func pinZeroOne(t *testing.T, cks [][]*optim.Checkpoint, w int, bc, fused bool, steps int) {
	const (
		lr, b1, b2, eps, wd = 0.01, 0.9, 0.99, float64(float32(1e-8)), 0.02
		freeze, kappa       = 10, 2
		scaler, clipper     = 3, 4
	)
	p, m, v, u := make([]pinState, w), make([]pinState, w), make([]pinState, w), make([]pinState, w)
	for r := range w {
		p[r], m[r], v[r], u[r] = newPinState(true), newPinState(false), newPinState(false), newPinState(false)
	}
	pc := newPinComm(w, fused)
	varInterval, varCounter, varUpdates := 1, 0, int64(0)
	localInterval, localCounter := 1, 0
	lrs := 0.0
	var syncs []int
	for s := 1; s <= steps; s++ {
		g, mean := pinGrads(w, s)
		c1 := pinBC(b1, int64(s), bc)
		if s <= freeze { // phase A
			varStep := s%varInterval == 0
			if varStep {
				varUpdates++
			} else {
				gs := make([]pinState, w)
				for r := range w {
					gs[r] = g[r].clone()
				}
				pc.allReduce(pinStates(gs))
				for r := range w {
					pinApplyMask(gs[r])
				}
				g = gs
			}
			c2 := pinBC(b2, varUpdates, bc)
			for r := range w {
				for i := range pinModel {
					for k := range p[r][i] {
						if varStep {
							gk := mean[i][k]
							m[r][i][k] = b1*m[r][i][k] + (1-b1)*gk
							v[r][i][k] = b2*v[r][i][k] + (1-b2)*gk*gk
						} else {
							m[r][i][k] = b1*m[r][i][k] + (1-b1)*g[r][i][k]
						}
						p[r][i][k] -= lr * (pinClip(m[r][i][k]*c1/(math.Sqrt(v[r][i][k]*c2)+eps), b1, b2) + wd*p[r][i][k])
					}
				}
			}
			if varStep {
				varCounter++
				if varCounter == kappa {
					varCounter = 0
					varInterval *= 2
				}
			}
			if s == freeze {
				pc.reset()
			}
		} else { // phase B
			c2 := pinBC(b2, varUpdates, bc)
			lrs += lr * c1
			for r := range w {
				for i := range pinModel {
					for k := range p[r][i] {
						m[r][i][k] = b1*m[r][i][k] + (1-b1)*g[r][i][k]
						upd := pinClip(m[r][i][k]*c1/(math.Sqrt(v[r][i][k]*c2)+eps), b1, b2) + wd*p[r][i][k]
						p[r][i][k] -= lr * upd
						u[r][i][k] -= lr * upd
					}
				}
			}
			if s%localInterval == 0 {
				syncs = append(syncs, s)
				for r := range w {
					for i := range pinModel {
						for k := range p[r][i] {
							p[r][i][k] -= u[r][i][k]
							u[r][i][k] *= math.Sqrt(v[r][i][k]*c2) + eps
						}
					}
				}
				pc.allReduce(pinStates(u))
				for r := range w {
					pinApplyMask(u[r])
					for i := range pinModel {
						for k := range p[r][i] {
							m[r][i][k] = -u[r][i][k] / lrs
							p[r][i][k] += lrs * pinClip(u[r][i][k]/(math.Sqrt(v[r][i][k]*c2)+eps)/lrs, b1, b2)
							u[r][i][k] = 0
						}
					}
				}
				lrs = 0
			}
			localCounter++
			if localCounter == scaler {
				localCounter = 0
				localInterval = min(clipper, 2*localInterval)
			}
		}
		for r := range w {
			ck := cks[s-1][r]
			pinCompare(t, ck, s, r, p[r], m[r], v[r], pinTolZeroOneM)
			wantStage := optim.StagePhaseA
			if s >= freeze {
				wantStage = optim.StagePhaseB
			}
			require.Equal(t, wantStage, ck.Stage, "stage after step %d", s)
			require.Equal(t, []int64{int64(varInterval), int64(varCounter), varUpdates, int64(localInterval), int64(localCounter)},
				[]int64{ck.Ints[onebit.IntVarInterval], ck.Ints[onebit.IntVarCounter], ck.Ints[onebit.IntVarUpdates],
					ck.Ints[onebit.IntLocalInterval], ck.Ints[onebit.IntLocalCounter]}, "intervals and counters after step %d", s)
			require.InDelta(t, lrs, ck.Floats[onebit.FloatLRS], 1e-6*(1+lrs), "lrs after step %d", s)
		}
	}
	require.Equal(t, []int{11, 12, 13, 14, 16, 20, 24}, syncs)
}
