package gomlx

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/gomlx/gomlx/ml/train/optimizer"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/optim"
)

// muonConfig is exact Muon's defaults with the tests' AdamW learning rate.
func muonConfig() optim.MuonConfig {
	cfg := optim.DefaultMuonConfig()
	cfg.AdamLR = 1e-2
	return cfg
}

// muon is NewMuon's Builder with muonConfig: on mlp(16), Muon updates
// /hidden/dense/weights, the AdamW the rest.
var muon = NewMuon(muonConfig())

// gptParams are the trainable variables of the GPT example's model (GoMLX's
// transformer, 1 block), in the store's order.
func gptParams() []*optim.Param {
	var ps []*optim.Param
	add := func(name string, shape ...int) { ps = append(ps, optim.NewParam(name, shape...)) }
	add("/token_embed/embeddings", 256, 8)
	add("/pos_embed/embeddings", 16, 8)
	for _, w := range []string{"query", "key", "value", "output"} {
		add("/layer_0/attn/MultiHeadAttention/"+w+"/dense/weights", 8, 8)
		add("/layer_0/attn/MultiHeadAttention/"+w+"/dense/biases", 8)
	}
	add("/layer_0/norm1/layer_normalization/gain", 8)
	add("/layer_0/ff1/dense/weights", 8, 32)
	add("/layer_0/ff1/dense/biases", 32)
	add("/layer_0/ff2/dense/weights", 32, 8)
	add("/layer_0/final_norm/layer_normalization/offset", 8)
	add("/output/dense/weights", 8, 256)
	add("/conv/weights", 3, 3, 4, 4)
	return ps
}

// HiddenMatrices gives Muon the 2-D hidden matrices and leaves the
// embeddings, the output head (the last matrix), vectors and tensors of
// rank 4 to the AdamW; never nil.
func TestHiddenMatrices(t *testing.T) {
	assert.Equal(t, []string{
		"/layer_0/attn/MultiHeadAttention/query/dense/weights",
		"/layer_0/attn/MultiHeadAttention/key/dense/weights",
		"/layer_0/attn/MultiHeadAttention/value/dense/weights",
		"/layer_0/attn/MultiHeadAttention/output/dense/weights",
		"/layer_0/ff1/dense/weights",
		"/layer_0/ff2/dense/weights",
	}, HiddenMatrices(gptParams()))
	mlp := []*optim.Param{optim.NewParam("/hidden/dense/weights", 8, 16), optim.NewParam("/hidden/dense/biases", 16),
		optim.NewParam("/out/dense/weights", 16, 1), optim.NewParam("/out/dense/biases", 1)}
	assert.Equal(t, []string{"/hidden/dense/weights"}, HiddenMatrices(mlp))
	got := HiddenMatrices(mlp[2:])
	assert.NotNil(t, got)
	assert.Empty(t, got)
}

// transposeParams returns copies of ps with the parameters named in names
// transposed (rows x the rest becomes the rest x rows).
func transposeParams(t *testing.T, ps []*optim.Param, names ...string) []*optim.Param {
	out := make([]*optim.Param, len(ps))
	for i, p := range ps {
		sh := p.Shape()
		q, err := optim.NewParamFrom(p.Name, p.Data(), sh...)
		require.NoError(t, err)
		if len(sh) == 2 && contains(names, p.Name) {
			q = optim.NewParam(p.Name, sh[1], sh[0])
			transposeTo(q.Data(), p.Data(), sh[0], sh[1])
		}
		out[i] = q
	}
	return out
}

// transposeTo writes the transpose of src, rows x cols, into dst.
func transposeTo(dst, src []float32, rows, cols int) {
	for i := range rows {
		for j := range cols {
			dst[j*rows+i] = src[i*cols+j]
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// NewMuon over GoMLX's [inputs, outputs] matrices takes exactly the steps
// of optim.Muon over their transposes, [outputs, inputs] (PyTorch's
// layout, whose scale max(1, outputs/inputs)^0.5 the recipe means), and
// not those of optim.Muon over the variables as they are (their scale
// would be max(1, inputs/outputs)^0.5); Load puts the values back into
// the variables' parameters.
func TestMuonTransposed(t *testing.T) {
	ctx := context.Background()
	mk := func() []*optim.Param {
		ps := []*optim.Param{optim.NewParam("w1", 4, 12), optim.NewParam("b1", 12), optim.NewParam("w2", 12, 3), optim.NewParam("head", 3, 2)}
		for k, p := range ps {
			for i := range p.Data() {
				p.Data()[i] = float32((i*7+k*3)%11)/11 - 0.5
			}
		}
		return ps
	}
	grads := func(ps []*optim.Param, step int, transposed bool) {
		for k, p := range ps {
			g := make([]float32, p.Numel())
			for i := range g {
				g[i] = float32((i*5+k+step*3)%13)/13 - 0.4
			}
			if sh := p.Shape(); transposed && len(sh) == 2 && p.Name != "head" {
				transposeTo(p.GradData(), g, sh[1], sh[0])
			} else {
				copy(p.GradData(), g)
			}
		}
	}
	ps := mk()
	opt, err := muon(ctx, nil, ps)
	require.NoError(t, err)
	defer opt.Close()
	tr, ok := opt.(*optim.Transposed)
	require.True(t, ok, "%T", opt)
	assert.Equal(t, []string{"w1", "w2"}, tr.Inner().(*optim.Muon).MuonParams())
	assert.Equal(t, ps, opt.Params())

	ref := transposeParams(t, mk(), "w1", "w2")
	cfg := muonConfig()
	cfg.Params = []string{"w1", "w2"}
	want, err := optim.NewMuon(ctx, nil, ref, cfg)
	require.NoError(t, err)
	defer want.Close()
	asIs, err := NewMuon(muonConfig(), WithMuonLayout(OutputsFirst))(ctx, nil, mk())
	require.NoError(t, err)
	defer asIs.Close()
	_, isTransposed := asIs.(*optim.Transposed)
	assert.False(t, isTransposed)

	for step := range 3 {
		grads(ps, step, false)
		grads(asIs.Params(), step, false)
		grads(ref, step, true)
		require.NoError(t, opt.Step(ctx))
		require.NoError(t, want.Step(ctx))
		require.NoError(t, asIs.Step(ctx))
	}
	back := transposeParams(t, ref, "w1", "w2")
	for i, p := range ps {
		assert.Equal(t, back[i].Data(), p.Data(), p.Name)
	}
	assert.NotEqual(t, asIs.Params()[0].Data(), ps[0].Data(), "w1: the scale does not depend on the layout")
	assert.Equal(t, want.StateBytes()+8*(48+36), tr.StateBytes())

	ck, err := opt.State()
	require.NoError(t, err)
	assert.Equal(t, []int{12, 4}, ck.Tensor(optim.ParamTensorName("w1")).Shape)
	fresh := mk()
	again, err := muon(ctx, nil, fresh)
	require.NoError(t, err)
	defer again.Close()
	require.NoError(t, again.Load(ck))
	for i := range ps {
		assert.Equal(t, ps[i].Data(), fresh[i].Data(), ps[i].Name)
	}
	assert.ErrorIs(t, asIs.Load(ck), optim.ErrIncompatibleCheckpoint, "a checkpoint of the other layout")
}

// The selection is overridden by cfg.Params or WithMuonSelect; one that
// names a vector is refused by the Muon constructor; an unknown layout is
// refused by New, at once.
func TestMuonSelectionOverride(t *testing.T) {
	ctx := context.Background()
	ps := gptParams()
	cfg := muonConfig()
	cfg.Params = []string{"/output/dense/weights"}
	opt, err := NewMuon(cfg)(ctx, nil, ps)
	require.NoError(t, err)
	assert.Equal(t, []string{"/output/dense/weights"}, opt.(*optim.Transposed).Inner().(*optim.Muon).MuonParams())
	require.NoError(t, opt.Close())

	opt, err = NewMuon(muonConfig(), WithMuonSelect(func(ps []*optim.Param) []string {
		return HiddenMatrices(ps)[4:] // the feed-forward matrices only
	}))(ctx, nil, ps)
	require.NoError(t, err)
	assert.Equal(t, []string{"/layer_0/ff1/dense/weights", "/layer_0/ff2/dense/weights"}, opt.(*optim.Transposed).Inner().(*optim.Muon).MuonParams())
	require.NoError(t, opt.Close())

	// A selection of nil selects nothing (for optim.MuonConfig, nil would
	// select every matrix, the embeddings and the head among them).
	_, err = NewMuon(muonConfig(), WithMuonSelect(func([]*optim.Param) []string { return nil }))(ctx, nil, ps)
	assert.ErrorContains(t, err, "MuonConfig.Params selects no parameter")
	assert.ErrorContains(t, err, `the matrices it could name: "/token_embed/embeddings", "/pos_embed/embeddings"`, "the error lists the matrices")

	// Unknown names are all named, beside the matrices and the parameters.
	cfg.Params = []string{"/layer_0/ff1/weights", "/output/dense/weights", "ff2"}
	_, err = NewMuon(cfg)(ctx, nil, ps)
	assert.ErrorContains(t, err, `MuonConfig.Params names "/layer_0/ff1/weights", "ff2", which are not parameters (the matrices: "/token_embed/embeddings", "/pos_embed/embeddings"`)
	assert.ErrorContains(t, err, `"/layer_0/ff1/dense/weights"`)
	assert.ErrorContains(t, err, fmt.Sprintf("all %d parameters: ", len(ps)))

	cfg.Params = []string{"/layer_0/ff1/dense/biases"}
	_, err = NewMuon(cfg)(ctx, nil, ps)
	assert.ErrorContains(t, err, `parameter "/layer_0/ff1/dense/biases" of shape [32] is marked for Muon but is not a matrix`)

	_, err = New(ctx, nil, NewMuon(muonConfig(), WithMuonLayout(7)))
	assert.ErrorContains(t, err, "lbgomlx: New: the optimizer's config: lbgomlx: WithMuonLayout.layout = MuonLayout(7): want InputsFirst or OutputsFirst")
	bad := muonConfig()
	bad.LR = -1
	_, err = New(ctx, nil, NewMuon(bad))
	var ce *optim.ConfigError
	assert.ErrorAs(t, err, &ce)
}

// The hook's learning rate is the Muon group's: GoMLX's learning rate
// reaches it (the AdamW group keeps its own), and a GoMLX learning rate
// that differs on one rank stops every rank at the first step.
func TestMuonLearningRate(t *testing.T) {
	runs := runSpecs(t, 2, 3, func(int) rankSpec {
		return rankSpec{build: muon, params: map[string]any{optimizer.ParamLearningRate: 0.05}}
	})
	for r, run := range runs {
		require.NoError(t, run.err, "rank %d", r)
		assert.Equal(t, []float32{0.05, 0.05, 0.05}, run.lrs, "rank %d", r)
		m := run.opt.Optimizer().(*optim.Transposed).Inner().(*optim.Muon)
		assert.Equal(t, float32(0.05), m.LR(), "rank %d", r)
		assert.Equal(t, float32(1e-2), m.AdamLR(), "rank %d", r)
	}
	assert.Equal(t, runs[0].final, runs[1].final)

	runs = runSpecs(t, 2, 3, func(r int) rankSpec {
		return rankSpec{build: muon, params: map[string]any{optimizer.ParamLearningRate: map[bool]float64{false: 0.05, true: 0.5}[r == 1]}}
	})
	for r, run := range runs {
		require.Error(t, run.err, "rank %d", r)
		assert.Contains(t, run.err.Error(), "learning rate: 0.05 on rank 0 and 0.5 on rank 1", "rank %d", r)
		assert.Empty(t, run.losses, "rank %d", r)
	}
}

// A resume whose restored AdamW-group learning rate differs on one rank
// (its state file changed) stops every rank at the first step, naming it:
// the per-step agreement compares the Muon group's only.
func TestMuonAdamLRAgreement(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 2, build: muon})
	state1 := filepath.Join(dir, "rank-1", stateFileName(2))
	ck, err := optim.LoadFile(state1)
	require.NoError(t, err)
	require.Contains(t, ck.Floats, optim.FloatAdamLR)
	ck.Floats[optim.FloatAdamLR] = float64(float32(0.02))
	require.NoError(t, optim.SaveFile(state1, ck))
	files := snapshot(t, dir)
	requireResumeRefused(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 1, build: muon},
		"AdamW group's learning rate: 0.01 on rank 0 and 0.02 on rank 1")
	assert.Equal(t, files, snapshot(t, dir), "a file changed")
}

// A resume whose checkpoint's AdamW group learning rate, 0.01, replaces
// the config's, 0.02, warns on rank 0 as the Muon group's does, saying how
// to keep the config's (SetAdamLR after the load, before the first lowbit
// step); a resume with the same one (the first, to step 3) does not
// warn.
func TestMuonResumeAdamLRWarning(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	dir := t.TempDir()
	resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 2, build: muon})
	cfg := muonConfig()
	cfg.AdamLR = 0.02
	for _, tc := range []struct {
		build Builder
		warns bool
	}{{muon, false}, {NewMuon(cfg), true}} {
		runs := resumeAll(t, ctx, 2, dir, resumeConfig{hidden: 16, steps: 1, build: tc.build})
		require.True(t, runs[0].opt.Restored())
		w := runs[0].opt.Warnings()
		assert.Empty(t, runs[1].opt.Warnings(), "rank 1 repeats rank 0's warnings")
		assert.Equal(t, float32(0.01), adamGroup(runs[0].opt.Optimizer()).AdamLR(), "Load restored the checkpoint's")
		if !tc.warns {
			assert.Empty(t, w)
			continue
		}
		require.Len(t, w, 1, "%q", w)
		assert.Contains(t, w[0], "resumed at global step 3 with the checkpoint's AdamW group learning rate 0.01 instead of the optimizer's 0.02 (its config's AdamLR)")
		assert.Contains(t, w[0], "call the Muon optimizer's SetAdamLR once Restored() is true")
	}
}
