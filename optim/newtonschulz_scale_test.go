package optim

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A finite momentum whose Frobenius norm exceeds float32's range is
// orthogonalized as at any other scale: Muon's update (and
// Orthogonalize's) at scale 3.4e38 is the one at scale 1, to float32's
// rounding, not zero (the divisor, rounded to float32, was +Inf).
func TestMuonHugeMomentum(t *testing.T) {
	const huge = 3.4e38
	shapes := [][]int{{40, 50}, {50, 40}}
	grads := func(ps []*Param, scale float32) {
		muonGrads(ps, 0, 1)
		for _, p := range ps {
			for k, g := range p.GradData() {
				p.GradData()[k] = g * scale
			}
		}
	}
	for _, tc := range []struct {
		mu       float32
		nesterov bool
	}{{0, false}, {0.95, true}} {
		cfg := DefaultMuonConfig()
		cfg.Momentum, cfg.Nesterov = tc.mu, tc.nesterov
		var got [2][][]float32
		for s, scale := range []float32{1, huge} {
			ps := testParams(t, 5, shapes...)
			opt, err := NewMuon(context.Background(), nil, ps, cfg)
			require.NoError(t, err)
			grads(ps, scale)
			if s == 1 { // the momentum's norm overflows float32 indeed
				for _, p := range ps {
					m := make([]float32, p.Numel())
					Momentum(m, p.GradData(), cfg.Momentum)
					x := make([]float32, p.Numel())
					loadNS(x, m, p.GradData(), 1, p.Numel(), cfg.Momentum, cfg.Nesterov)
					require.True(t, math.IsInf(float64(float32(math.Sqrt(SumSquares(x)))), 1), "%+v", tc)
				}
			}
			require.NoError(t, opt.Step(context.Background()))
			for _, p := range ps {
				got[s] = append(got[s], p.Data())
			}

			// Orthogonalize, given the gradient as the momentum.
			ps = testParams(t, 5, shapes...)
			grads(ps, scale)
			for i, p := range ps {
				rows, cols := MatrixView(p.Shape())
				dst := make([]float32, p.Numel())
				require.True(t, NewOrthogonalizer(rows, cols).Orthogonalize(dst, p.GradData(), p.GradData(), rows, cols, cfg, 1))
				got[s] = append(got[s], dst)
				if s == 0 {
					continue
				}
				want, moved := got[0][len(shapes)+i], 0.0
				for k, x := range dst {
					require.InDelta(t, want[k], x, 1e-5, "%+v: Orthogonalize %s[%d]", tc, p.Name, k)
					moved = max(moved, math.Abs(float64(x)))
				}
				assert.Greater(t, moved, 0.1, "%+v: %s: the update is not zero", tc, p.Name)
			}
		}
		for i := range shapes {
			before := testParams(t, 5, shapes...)[i].Data()
			for k, x := range got[1][i] {
				require.InDelta(t, got[0][i][k], x, 1e-6, "%+v: Muon param %d[%d]", tc, i, k)
			}
			assert.NotEqual(t, before, got[1][i], "%+v: param %d did not move", tc, i)
		}
	}
}

// NSEps is added to the norm that the momentum is divided by: with an eps
// far above the norm, the normalized matrix is small and the iteration
// scales it by about a^NSSteps. Muon's step, the Orthogonalizer's and the
// float64 reference agree, and differ from eps 0.
func TestMuonNSEps(t *testing.T) {
	const eps = 1e4
	cfg := DefaultMuonConfig()
	cfg.NSEps = eps
	cfg.LR = 0.5
	shapes := [][]int{{6, 10}, {10, 6}}
	ps := testParams(t, 2, shapes...)
	opt, err := NewMuon(context.Background(), nil, ps, cfg)
	require.NoError(t, err)
	ref := newRefMuon(cfg, ps, []bool{true, true})
	muonGrads(ps, 0, 1)
	ref.step(grads64(ps))
	for _, p := range ps {
		rows, cols := MatrixView(p.Shape())
		m := make([]float32, p.Numel())
		Momentum(m, p.GradData(), cfg.Momentum)
		u := make([]float32, p.Numel())
		for k := range u {
			u[k] = float32(OneMinus(cfg.Momentum)*p.GradData()[k]) + float32(cfg.Momentum*m[k])
		}
		norm := math.Sqrt(SumSquares(u))
		require.Less(t, norm, 1.0)
		// A small X: B X is of order |X|^3, X grows by a per step.
		a5 := math.Pow(float64(cfg.NSCoefficients[0]), float64(cfg.NSSteps))
		for _, e := range []float32{eps, 0} {
			c := cfg
			c.NSEps = e
			dst := make([]float32, p.Numel())
			require.True(t, NewOrthogonalizer(rows, cols).Orthogonalize(dst, m, p.GradData(), rows, cols, c, 1))
			if e == 0 {
				assert.Greater(t, math.Sqrt(SumSquares(dst)), 1.0, "eps 0: %s: the norm of an orthogonalized matrix", p.Name)
				continue
			}
			for k, x := range dst {
				want := a5 * float64(u[k]) / (norm + eps)
				require.InDelta(t, want, float64(x), 1e-3*math.Abs(want)+1e-7, "eps %g: Orthogonalize %s[%d]", e, p.Name, k)
			}
		}
	}
	require.NoError(t, opt.Step(context.Background()))
	for i, p := range ps {
		for k, x := range p.Data() {
			require.InDelta(t, ref.p[i][k], float64(x), 1e-6, "Muon %s[%d]", p.Name, k)
		}
	}
}
