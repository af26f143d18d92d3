package gomlx

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
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

// MuonBuilder returns a Builder that selects the Muon parameters
// (HiddenMatrices, or WithMuonSelect's) and builds the optimizer with
// build. With the InputsFirst layout (the default) build gets, for each
// selected matrix, a parameter of its own holding the transpose (outputs
// x inputs: a variable [in, out...] becomes [out·..., in]), and the
// Builder returns a *Transposed that keeps those copies and the
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
		t := newTransposed(params, names)
		opt, err := build(ctx, c, t.inner, names)
		if err != nil {
			return nil, err
		}
		t.opt = opt
		return t, nil
	}
}

// Transposed is the lowbit optimizer MuonBuilder returns for the
// InputsFirst layout: it runs the optimizer that MuonBuild made over
// parameters of its own for the Muon matrices, each the transpose of a
// variable's (outputs x inputs), and the variables' parameters for the
// others. Each Step copies the gradients of the Muon matrices into the
// transposes, runs the optimizer's Step and copies the values back; Load
// copies them back too. The optimizer's checkpoints hold the Muon
// matrices transposed (param/NAME of shape [outputs, inputs]), so that a
// checkpoint of the other layout is refused. It costs 8 bytes per element
// of the Muon matrices (the copies of the values and gradients, counted
// in StateBytes) and two copies of them per step, against the
// orthogonalization's many products.
type Transposed struct {
	opt    optim.Optimizer
	params []*optim.Param // the variables' parameters, the Builder's
	inner  []*optim.Param // what opt holds: a transpose for each Muon matrix
	mats   []transposedMatrix
}

// transposedMatrix is one Muon matrix: the variable's parameter, rows x
// cols (the inputs by the outputs), and its transpose.
type transposedMatrix struct {
	outer, inner *optim.Param
	rows, cols   int
}

var (
	_ optim.Optimizer      = (*Transposed)(nil)
	_ optim.LRSetter       = (*Transposed)(nil)
	_ optim.FlagCarrier    = (*Transposed)(nil)
	_ optim.MemoryReporter = (*Transposed)(nil)
)

// newTransposed makes the transposes of the parameters of rank 2 or more
// that names lists (a name that is not a parameter, or one of rank 1, is
// left as it is for the Muon constructor to refuse).
func newTransposed(params []*optim.Param, names []string) *Transposed {
	t := &Transposed{params: params, inner: slices.Clone(params)}
	for i, p := range params {
		sh := p.Shape()
		if len(sh) < 2 || !slices.Contains(names, p.Name) {
			continue
		}
		rows := sh[0]
		cols := p.Numel() / max(rows, 1)
		q := optim.NewParam(p.Name, cols, rows)
		m := transposedMatrix{outer: p, inner: q, rows: rows, cols: cols}
		transpose(q.Data(), p.Data(), rows, cols)
		t.inner[i] = q
		t.mats = append(t.mats, m)
	}
	return t
}

// transpose writes the transpose of src, rows x cols, into dst, cols x
// rows. Both hold rows*cols elements.
func transpose(dst, src []float32, rows, cols int) {
	const tile = 32
	for i0 := 0; i0 < rows; i0 += tile {
		for j0 := 0; j0 < cols; j0 += tile {
			for i := i0; i < min(i0+tile, rows); i++ {
				for j := j0; j < min(j0+tile, cols); j++ {
					dst[j*rows+i] = src[i*cols+j]
				}
			}
		}
	}
}

// Inner returns the optimizer MuonBuild made (an *optim.Muon for NewMuon:
// its SetAdamLR, SetAdamSchedule and AdamLR set the AdamW group's learning
// rate).
func (t *Transposed) Inner() optim.Optimizer { return t.opt }

// Step copies the variables' gradients of the Muon matrices into their
// transposes, runs the inner optimizer's Step, and copies the values of
// the transposes back into the variables' parameters. A Muon matrix whose
// parameter no longer holds its elements gets a NaN gradient, so that
// the inner Step skips the step on every rank, and this rank's Step
// returns an error naming it.
func (t *Transposed) Step(ctx context.Context) error {
	var bad error
	for _, m := range t.mats {
		n := m.rows * m.cols
		if len(m.outer.Data()) != n || len(m.outer.GradData()) != n {
			bad = fmt.Errorf("lbgomlx: parameter %q no longer holds the %d elements it had at construction: the step was skipped on every rank", m.outer.Name, n)
			if n > 0 {
				m.inner.GradData()[0] = float32(math.NaN())
			}
			continue
		}
		transpose(m.inner.GradData(), m.outer.GradData(), m.rows, m.cols)
	}
	err := t.opt.Step(ctx)
	t.pull()
	if bad != nil {
		return bad
	}
	return err
}

// pull copies the transposes' values back into the variables' parameters.
func (t *Transposed) pull() {
	for _, m := range t.mats {
		if len(m.outer.Data()) == m.rows*m.cols {
			transpose(m.outer.Data(), m.inner.Data(), m.cols, m.rows)
		}
	}
}

// Params returns the variables' parameters, as the Builder got them.
func (t *Transposed) Params() []*optim.Param { return t.params }

// Stats returns the inner optimizer's.
func (t *Transposed) Stats() optim.Stats { return t.opt.Stats() }

// State returns the inner optimizer's checkpoint: the Muon matrices in it
// are transposed (see Transposed).
func (t *Transposed) State() (*optim.Checkpoint, error) { return t.opt.State() }

// Load restores a checkpoint made by State (the inner optimizer's Load)
// and copies the values into the variables' parameters.
func (t *Transposed) Load(ck *optim.Checkpoint) error {
	if err := t.opt.Load(ck); err != nil {
		return err
	}
	t.pull()
	return nil
}

// Close closes the inner optimizer.
func (t *Transposed) Close() error { return t.opt.Close() }

// SetLR sets the inner optimizer's learning rate (Muon's group's); see
// optim.LRSetter. It fails when the inner optimizer is not one.
func (t *Transposed) SetLR(lr float32) error {
	ls, err := t.lrSetter()
	if err != nil {
		return err
	}
	return ls.SetLR(lr)
}

// SetSchedule sets the inner optimizer's schedule; see SetLR.
func (t *Transposed) SetSchedule(s optim.Schedule) error {
	ls, err := t.lrSetter()
	if err != nil {
		return err
	}
	return ls.SetSchedule(s)
}

// LR returns the inner optimizer's learning rate of the next step (0 when
// it is not an optim.LRSetter).
func (t *Transposed) LR() float32 {
	if ls, err := t.lrSetter(); err == nil {
		return ls.LR()
	}
	return 0
}

func (t *Transposed) lrSetter() (optim.LRSetter, error) {
	ls, ok := t.opt.(optim.LRSetter)
	if !ok {
		return nil, fmt.Errorf("lbgomlx: %T cannot change its learning rate (not an optim.LRSetter)", t.opt)
	}
	return ls, nil
}

// CarryFlags makes the inner optimizer carry sf (optim.FlagCarrier); it
// fails when the inner optimizer is not a FlagCarrier.
func (t *Transposed) CarryFlags(sf *optim.StepFlags) error {
	fc, ok := t.opt.(optim.FlagCarrier)
	if !ok {
		return fmt.Errorf("lbgomlx: %T carries no flags (not an optim.FlagCarrier)", t.opt)
	}
	return fc.CarryFlags(sf)
}

// StateBytes returns the inner optimizer's StateBytes (0 when it reports
// none) and the transposes' values and gradients, 8 bytes per element of
// the Muon matrices.
func (t *Transposed) StateBytes() int64 {
	var n int64
	if mr, ok := t.opt.(optim.MemoryReporter); ok {
		n = mr.StateBytes()
	}
	for _, m := range t.mats {
		n += 8 * int64(m.rows*m.cols)
	}
	return n
}
