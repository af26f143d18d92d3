package optim

import (
	"context"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Orthogonalize with scale 1, applied as its doc says, is Muon's update
// bit for bit, for a wide and a tall (transposed) matrix; a zero input
// gives false and a zeroed dst; a matrix of another shape panics.
func TestOrthogonalizeIsMuonsUpdate(t *testing.T) {
	cfg := DefaultMuonConfig()
	cfg.WeightDecay = 0.1
	ps := testParams(t, 3, []int{6, 10}, []int{10, 6})
	muonGrads(ps, 0, 1)
	opt, err := NewMuon(context.Background(), nil, ps, cfg)
	require.NoError(t, err)
	want := make([][]float32, len(ps))
	for i, p := range ps {
		rows, cols := MatrixView(p.Shape())
		m := make([]float32, p.Numel())
		Momentum(m, p.GradData(), cfg.Momentum)
		dst := make([]float32, p.Numel())
		require.True(t, NewOrthogonalizer(rows, cols).Orthogonalize(dst, m, p.GradData(), rows, cols, cfg, 1))
		decay := float32(1 - float64(cfg.LR)*float64(cfg.WeightDecay))
		step := float32(float64(cfg.LR) * math.Sqrt(max(1, float64(rows)/float64(cols))))
		want[i] = make([]float32, p.Numel())
		for k, x := range p.Data() {
			want[i][k] = float32(x*decay) - float32(step*dst[k])
		}
	}
	require.NoError(t, opt.Step(context.Background()))
	for i, p := range ps {
		assert.Equal(t, bits(want[i]), bits(p.Data()), "parameter %s", p.Name)
	}

	o := NewOrthogonalizer(10, 6)
	dst := []float32{1, 2, 3}
	dst = append(dst, make([]float32, 57)...)
	zero := make([]float32, 60)
	assert.False(t, o.Orthogonalize(dst, zero, zero, 6, 10, cfg, 2))
	assert.Equal(t, zero, dst)
	assert.Panics(t, func() { o.Orthogonalize(dst, zero, zero, 5, 12, cfg, 1) })
	assert.Equal(t, int64(4*(2*6*10+2*6*6)), o.StateBytes())
}
