package gomlx

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// MuonSelect returns the names of the parameters Muon updates, out of the
// trainable variables' parameters (named by the variables' paths, in the
// store's order); every other parameter goes to the auxiliary AdamW. It
// must decide from the names and shapes alone, so that every rank selects
// the same (the lowbit optimizer compares the selections of the ranks).
type MuonSelect func(params []*optim.Param) []string

// HiddenMatrices is the default MuonSelect, the recipe's rule that Muon
// updates the hidden weight matrices: a variable gets Muon when it is a
// matrix (exactly 2 dimensions), is not an embedding (no element of its
// path contains "embed", whatever the case: GoMLX's layers.Embedding
// names its table "embeddings", the transformer's scopes are token_embed
// and pos_embed), and is not the output head, taken to be the last such
// matrix in the store's order (the order in which the model function
// created the variables: GoMLX's transformer's /output/dense/weights, a
// classifier's last Dense). Vectors (biases, the gains and offsets of the
// normalizations), scalars, embeddings, the output head and tensors of
// rank 3 or more (convolution kernels, whose matrix is not the first
// dimension by the rest in GoMLX's layout) go to the AdamW. It never
// returns nil: a model without such a matrix gets an empty selection,
// which the Muon constructor refuses rather than silently train AdamW
// alone.
func HiddenMatrices(params []*optim.Param) []string {
	head := -1
	for i, p := range params {
		if len(p.Shape()) == 2 && !isEmbedding(p.Name) {
			head = i
		}
	}
	names := []string{}
	for i, p := range params {
		if i != head && len(p.Shape()) == 2 && !isEmbedding(p.Name) {
			names = append(names, p.Name)
		}
	}
	return names
}

// isEmbedding reports whether an element of the variable path contains
// "embed", whatever the case.
func isEmbedding(path string) bool {
	return strings.Contains(strings.ToLower(path), "embed")
}

// MuonLayout is how a Muon variable's value holds its matrix.
type MuonLayout int

const (
	// InputsFirst is the layout of GoMLX's layers.Dense, [inputs,
	// outputs...] (compute.DenseLayoutInputsOutputs, the default): the
	// matrix is the first dimension (the inputs) by the product of the
	// others (the outputs). Muon gets its transpose, outputs x inputs:
	// the layout of PyTorch's nn.Linear that Muon's recipe assumes, whose
	// update scale max(1, rows/cols)^0.5 grows with the outputs (as
	// Optax's Muon scales its [inputs, outputs] matrices by
	// max(1, outputs/inputs)^0.5). The orthogonalization itself does not
	// depend on the orientation. The default.
	InputsFirst MuonLayout = iota
	// OutputsFirst is [outputs, inputs] (layers.DenseWithLayout's
	// compute.DenseLayoutOutputsInput, the transformer's
	// TransposedProjections): Muon gets the variable as it is, viewed as
	// its first dimension by the product of the others.
	OutputsFirst
)

// String returns the layout's name.
func (l MuonLayout) String() string {
	switch l {
	case InputsFirst:
		return "InputsFirst"
	case OutputsFirst:
		return "OutputsFirst"
	}
	return fmt.Sprintf("MuonLayout(%d)", int(l))
}

// MuonOption configures NewMuon and MuonBuilder.
type MuonOption func(*muonOptions)

type muonOptions struct {
	sel    MuonSelect
	layout MuonLayout
}

// WithMuonSelect replaces HiddenMatrices, the default selection of the
// Muon parameters, with sel (for example one that keeps HiddenMatrices'
// names but one, or lists names of its own).
func WithMuonSelect(sel MuonSelect) MuonOption {
	return func(o *muonOptions) {
		if sel != nil {
			o.sel = sel
		}
	}
}

// WithMuonLayout sets how the Muon variables hold their matrices; the
// default is InputsFirst, GoMLX's layers.Dense layout.
func WithMuonLayout(l MuonLayout) MuonOption {
	return func(o *muonOptions) { o.layout = l }
}

// MuonBuild builds a Muon-family lowbit optimizer over params, updating by
// Muon the parameters named in muon (never nil) and the others by its
// auxiliary AdamW: optim.NewMuon with MuonConfig.Params = muon, or another
// optimizer of Muon's kind. Every rank calls it together (see Builder).
type MuonBuild func(ctx context.Context, c comm.Comm, params []*optim.Param, muon []string) (optim.Optimizer, error)

// NewMuon returns a Builder of exact Muon (optim.NewMuon with cfg) over
// a GoMLX model's variables: MuonBuilder with cfg.Params set to the
// selection. cfg.Params, when not nil, is the selection itself (the
// variables' paths), in place of WithMuonSelect's or HiddenMatrices'. The
// hook's learning rate (GoMLX's, or the optimizer's own) is the Muon
// group's, cfg.LR; the AdamW group's is cfg.AdamLR, fixed (give a
// MuonBuild of your own to MuonBuilder to set it a schedule with
// optim.Muon.SetAdamSchedule).
func NewMuon(cfg optim.MuonConfig, opts ...MuonOption) Builder {
	if cfg.Params != nil {
		names := slices.Clone(cfg.Params)
		opts = append(opts, WithMuonSelect(func([]*optim.Param) []string { return names }))
	}
	return MuonBuilder(func(ctx context.Context, c comm.Comm, params []*optim.Param, muon []string) (optim.Optimizer, error) {
		cfg := cfg
		cfg.Params = muon
		return optim.NewMuon(ctx, c, params, cfg)
	}, opts...)
}

// NewOuterMuon returns a Builder of the outer optimizer (package outer,
// config cfg) whose inner optimizer is exact Muon with config inner over
// a GoMLX model's variables, local to each rank: MuLoCo's setting, as
// outer.NewMuon, with NewMuon's selection and layout (opts; the
// transposes of InputsFirst are inside the outer optimizer, which works
// on the variables' own layout). inner.Params, when not nil, is the
// selection, as NewMuon's. The hook's learning rate is the Muon group's;
// the AdamW group's is inner.AdamLR. The outer optimizer owns the inner
// one (outer.NewFrom).
func NewOuterMuon(cfg outer.Config, inner optim.MuonConfig, opts ...MuonOption) Builder {
	build := NewMuon(inner, opts...)
	return func(ctx context.Context, c comm.Comm, params []*optim.Param) (optim.Optimizer, error) {
		return outer.NewFrom(ctx, c, cfg, func() (optim.Optimizer, error) { return build(ctx, nil, params) })
	}
}

// MuonBuilder returns a Builder that selects the Muon parameters
// (HiddenMatrices, or WithMuonSelect's) and builds the optimizer with
// build. With the InputsFirst layout (the default) build gets, for each
// selected matrix, a parameter of its own holding the transpose (outputs
// x inputs: a variable [in, out...] becomes [out·..., in]), and the
// Builder returns an *optim.Transposed that keeps those copies and the
// variables' parameters in step; with OutputsFirst it returns build's
// optimizer as it is. A selection that names no parameter, or one that
// is not a matrix, is left to build to refuse, on every rank.
func MuonBuilder(build MuonBuild, opts ...MuonOption) Builder {
	o := muonOptions{sel: HiddenMatrices}
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	return func(ctx context.Context, c comm.Comm, params []*optim.Param) (optim.Optimizer, error) {
		names := o.sel(params)
		if names == nil {
			names = []string{} // nil would select every matrix
		}
		switch o.layout {
		case InputsFirst:
		case OutputsFirst:
			return build(ctx, c, params, names)
		default:
			// A config error: New's probe returns it, before any rank
			// reaches a collective.
			return nil, &optim.ConfigError{Config: "lbgomlx.WithMuonLayout", Field: "layout", Value: o.layout, Want: "InputsFirst or OutputsFirst"}
		}
		t, err := optim.NewTransposed(params, names, func(inner []*optim.Param) (optim.Optimizer, error) {
			return build(ctx, c, inner, names)
		})
		if err != nil {
			return nil, err // not a typed nil
		}
		return t, nil
	}
}
