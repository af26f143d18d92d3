package optim

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// transposedParams returns the parameters of the Transposed tests, in the
// [inputs, outputs] layout: two matrices, a vector and a rank-3 tensor
// (the matrix 3 x 8).
func transposedParams(t *testing.T) []*Param {
	var ps []*Param
	for k, sh := range [][]int{{4, 12}, {12}, {12, 3}, {3, 2, 4}} {
		p := NewParam(string(rune('a'+k)), sh...)
		for i := range p.Data() {
			p.Data()[i] = float32((i*7+k*3)%11)/11 - 0.5
		}
		ps = append(ps, p)
	}
	return ps
}

// setTransposedGrads writes step's gradients into ps, in the layout of
// transposedParams; transposed: into the transposes of a, c and d.
func setTransposedGrads(ps []*Param, step int, transposed bool) {
	for k, p := range ps {
		g := make([]float32, p.Numel())
		for i := range g {
			g[i] = float32((i*5+k+step*3)%13)/13 - 0.4
		}
		if sh := p.Shape(); transposed && len(sh) == 2 {
			transposeInto(p.GradData(), g, sh[1], sh[0]) // p is the transpose: g is sh[1] x sh[0]
		} else {
			copy(p.GradData(), g)
		}
	}
}

// Muon through Transposed over [inputs, outputs] matrices takes exactly
// the steps of Muon over their transposes, bit for bit, and not those of
// Muon over the matrices as they are (the scale max(1, rows/cols)^0.5
// differs); values written into the given parameters between steps (an
// outer optimizer's reset) are the next step's; its checkpoint holds the
// transposes, and Load puts the values back into the given parameters.
func TestTransposedMatchesMuonOverTransposes(t *testing.T) {
	ctx := context.Background()
	names := []string{"a", "c", "d"}
	cfg := DefaultMuonConfig()
	cfg.Params = names
	ps := transposedParams(t)
	tr, err := NewTransposed(ps, names, func(inner []*Param) (Optimizer, error) { return NewMuon(ctx, nil, inner, cfg) })
	require.NoError(t, err)
	defer tr.Close()
	assert.Equal(t, ps, tr.Params())

	ref := transposedParams(t)
	for i, p := range ref {
		if sh := p.Shape(); len(sh) > 1 {
			q := NewParam(p.Name, p.Numel()/sh[0], sh[0])
			transposeInto(q.Data(), p.Data(), sh[0], p.Numel()/sh[0])
			ref[i] = q
		}
	}
	want, err := NewMuon(ctx, nil, ref, cfg)
	require.NoError(t, err)
	defer want.Close()
	asIs := transposedParams(t)
	plain, err := NewMuon(ctx, nil, asIs, cfg)
	require.NoError(t, err)
	defer plain.Close()

	for step := range 3 {
		if step == 2 {
			// A caller writes the values between steps.
			written := transposedParams(t)
			for i, p := range written {
				for j := range p.Data() {
					p.Data()[j] *= -0.5
				}
				copy(ps[i].Data(), p.Data())
				copy(asIs[i].Data(), p.Data())
				if sh := ref[i].Shape(); len(sh) == 2 {
					transposeInto(ref[i].Data(), p.Data(), sh[1], sh[0])
				} else {
					copy(ref[i].Data(), p.Data())
				}
			}
		}
		setTransposedGrads(ps, step, false)
		setTransposedGrads(asIs, step, false)
		setTransposedGrads(ref, step, true)
		require.NoError(t, tr.Step(ctx))
		require.NoError(t, want.Step(ctx))
		require.NoError(t, plain.Step(ctx))
	}
	for i, p := range ps {
		got := make([]float32, p.Numel())
		if sh := ref[i].Shape(); len(sh) == 2 && p.Name != "b" {
			transposeInto(got, ref[i].Data(), sh[0], sh[1])
		} else {
			copy(got, ref[i].Data())
		}
		assert.Equal(t, got, p.Data(), p.Name)
	}
	assert.NotEqual(t, asIs[0].Data(), ps[0].Data(), "a: the scale does not depend on the layout")
	assert.Equal(t, want.StateBytes()+8*(48+36+24), tr.StateBytes())
	assert.Equal(t, want.LR(), tr.LR())

	ck, err := tr.State()
	require.NoError(t, err)
	assert.Equal(t, []int{12, 4}, ck.Tensor(ParamTensorName("a")).Shape)
	fresh := transposedParams(t)
	again, err := NewTransposed(fresh, names, func(inner []*Param) (Optimizer, error) { return NewMuon(ctx, nil, inner, cfg) })
	require.NoError(t, err)
	defer again.Close()
	require.NoError(t, again.Load(ck))
	for i, p := range ps {
		assert.Equal(t, p.Data(), fresh[i].Data(), p.Name)
	}
	assert.ErrorIs(t, plain.Load(ck), ErrIncompatibleCheckpoint, "a checkpoint of the transposes")
}

// A transposed matrix whose parameter was resized: the step is skipped
// (the inner optimizer sees a NaN gradient, as every rank would), this
// rank's Step says why, nothing changes. The builder's error comes back
// as it is, and the builder runs even when nothing is transposed.
func TestTransposedBadInput(t *testing.T) {
	ctx := context.Background()
	ps := transposedParams(t)
	cfg := DefaultMuonConfig()
	tr, err := NewTransposed(ps, []string{"a"}, func(inner []*Param) (Optimizer, error) { return NewMuon(ctx, nil, inner, cfg) })
	require.NoError(t, err)
	defer tr.Close()
	setTransposedGrads(ps, 0, false)
	ps[0].Value = NewParam("a", 5).Value
	before := append([]float32(nil), ps[2].Data()...)
	err = tr.Step(ctx)
	assert.ErrorContains(t, err, `optim: Transposed: parameter "a" no longer holds the 48 elements it had at construction: the step was skipped on every rank`)
	assert.Equal(t, int64(1), tr.Stats().Skipped)
	assert.Equal(t, before, ps[2].Data())

	bad := errors.New("no")
	called := false
	_, err = NewTransposed(ps, nil, func([]*Param) (Optimizer, error) { called = true; return nil, bad })
	assert.Same(t, bad, err)
	assert.True(t, called)
	_, err = NewTransposed(ps, nil, func([]*Param) (Optimizer, error) { return nil, nil })
	assert.ErrorContains(t, err, "the builder returned no optimizer")
}
