package optim

import (
	"context"
	"fmt"
	"math"
	"slices"
)

// Transposed runs an optimizer over the transposes of some matrix
// parameters: Muon's recipe assumes PyTorch's layout, [outputs, inputs],
// and scales the orthogonalized update by max(1, rows/cols)^0.5, so a
// model that stores its weights as [inputs, outputs] (GoMLX's layers.Dense,
// JAX, a hand-written x*W) gives Muon their transposes to take the
// recipe's steps. A parameter of shape [d0, d1, ...] named for
// transposition is the matrix d0 x (d1·...), and its transpose has shape
// [d1·..., d0]; the orthogonalization itself does not depend on the
// orientation.
//
// The inner optimizer holds a parameter of its own for each transposed
// matrix (same name) and the given parameters for the others. Each Step
// copies the values and gradients of the transposed matrices into the
// transposes, runs the inner Step and copies the values back; Load copies
// them back too. So a caller that writes the given parameters' values
// between steps (an outer optimizer that resets them to its global
// parameters, outer.New over a Transposed) is followed. The inner
// optimizer's checkpoints hold the transposes
// (param/NAME of the transposed shape), so that a checkpoint made without
// the transposition is refused. It costs 8 bytes per element of the
// transposed matrices (the copies of the values and gradients, counted in
// StateBytes) and three copies of them per step.
type Transposed struct {
	opt    Optimizer
	params []*Param // the parameters given
	inner  []*Param // what opt holds: a transpose for each transposed matrix
	mats   []transposedMatrix
}

// transposedMatrix is one transposed matrix: the given parameter, rows x
// cols, and its transpose, cols x rows.
type transposedMatrix struct {
	outer, inner *Param
	rows, cols   int
}

var (
	_ Optimizer      = (*Transposed)(nil)
	_ LRSetter       = (*Transposed)(nil)
	_ FlagCarrier    = (*Transposed)(nil)
	_ MemoryReporter = (*Transposed)(nil)
)

// NewTransposed returns a Transposed that runs the optimizer build makes
// over params, each parameter of rank 2 or more that names lists replaced
// by its transpose (a name that is not a parameter, one of rank 1, or a
// parameter the optimizers refuse, is left as it is for build's
// constructor to refuse). It returns build's error, if
// any, as it is. build is called in any case, so that a constructor that
// is a collective runs on every rank.
func NewTransposed(params []*Param, names []string, build func(params []*Param) (Optimizer, error)) (*Transposed, error) {
	t := &Transposed{params: slices.Clone(params), inner: slices.Clone(params)}
	for i, p := range params {
		if p == nil || p.Value == nil || p.Grad == nil || len(p.Data()) != p.Numel() || len(p.GradData()) != p.Numel() {
			continue
		}
		sh := p.Shape()
		if len(sh) < 2 || !slices.Contains(names, p.Name) {
			continue
		}
		rows := sh[0]
		cols := p.Numel() / max(rows, 1)
		q := NewParam(p.Name, cols, rows)
		m := transposedMatrix{outer: p, inner: q, rows: rows, cols: cols}
		transposeInto(q.Data(), p.Data(), rows, cols)
		t.inner[i] = q
		t.mats = append(t.mats, m)
	}
	opt, err := build(slices.Clone(t.inner))
	if err != nil {
		return nil, err
	}
	if opt == nil {
		return nil, fmt.Errorf("optim: NewTransposed: the builder returned no optimizer")
	}
	t.opt = opt
	return t, nil
}

// transposeInto writes the transpose of src, rows x cols, into dst, cols x
// rows. Both hold rows*cols elements.
func transposeInto(dst, src []float32, rows, cols int) {
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

// Inner returns the optimizer MuonBuild made (an *Muon for NewMuon:
// its SetAdamLR, SetAdamSchedule and AdamLR set the AdamW group's learning
// rate).
func (t *Transposed) Inner() Optimizer { return t.opt }

// Step copies the values and gradients of the transposed matrices into
// their transposes, runs the inner optimizer's Step, and copies the values
// of the transposes back into the given parameters. A transposed matrix
// whose parameter no longer holds its elements gets a NaN gradient, so
// that the inner Step skips the step on every rank, and this rank's Step
// returns an error naming it.
func (t *Transposed) Step(ctx context.Context) error {
	var bad error
	for _, m := range t.mats {
		n := m.rows * m.cols
		if len(m.outer.Data()) != n || len(m.outer.GradData()) != n {
			bad = fmt.Errorf("optim: Transposed: parameter %q no longer holds the %d elements it had at construction: the step was skipped on every rank", m.outer.Name, n)
			if n > 0 {
				m.inner.GradData()[0] = float32(math.NaN())
			}
			continue
		}
		transposeInto(m.inner.GradData(), m.outer.GradData(), m.rows, m.cols)
	}
	t.push()
	err := t.opt.Step(ctx)
	t.pull()
	if bad != nil {
		return bad
	}
	return err
}

// push copies the given parameters' values into the transposes.
func (t *Transposed) push() {
	for _, m := range t.mats {
		if len(m.outer.Data()) == m.rows*m.cols {
			transposeInto(m.inner.Data(), m.outer.Data(), m.rows, m.cols)
		}
	}
}

// pull copies the transposes' values back into the given parameters.
func (t *Transposed) pull() {
	for _, m := range t.mats {
		if len(m.outer.Data()) == m.rows*m.cols {
			transposeInto(m.outer.Data(), m.inner.Data(), m.cols, m.rows)
		}
	}
}

// Params returns the parameters given to NewTransposed.
func (t *Transposed) Params() []*Param { return t.params }

// Stats returns the inner optimizer's.
func (t *Transposed) Stats() Stats { return t.opt.Stats() }

// State returns the inner optimizer's checkpoint: the transposed matrices
// in it are the transposes (see Transposed), of the given parameters'
// values, copied in first (a caller may have written them since the
// last Step).
func (t *Transposed) State() (*Checkpoint, error) {
	t.push()
	return t.opt.State()
}

// Load restores a checkpoint made by State (the inner optimizer's Load)
// and copies the values into the given parameters.
func (t *Transposed) Load(ck *Checkpoint) error {
	if err := t.opt.Load(ck); err != nil {
		return err
	}
	t.pull()
	return nil
}

// Close closes the inner optimizer.
func (t *Transposed) Close() error { return t.opt.Close() }

// SetLR sets the inner optimizer's learning rate (Muon's group's); see
// LRSetter. It fails when the inner optimizer is not one.
func (t *Transposed) SetLR(lr float32) error {
	ls, err := t.lrSetter()
	if err != nil {
		return err
	}
	return ls.SetLR(lr)
}

// SetSchedule sets the inner optimizer's schedule; see SetLR.
func (t *Transposed) SetSchedule(s Schedule) error {
	ls, err := t.lrSetter()
	if err != nil {
		return err
	}
	return ls.SetSchedule(s)
}

// LR returns the inner optimizer's learning rate of the next step (0 when
// it is not an LRSetter).
func (t *Transposed) LR() float32 {
	if ls, err := t.lrSetter(); err == nil {
		return ls.LR()
	}
	return 0
}

func (t *Transposed) lrSetter() (LRSetter, error) {
	ls, ok := t.opt.(LRSetter)
	if !ok {
		return nil, fmt.Errorf("optim: Transposed: %T cannot change its learning rate (not an LRSetter)", t.opt)
	}
	return ls, nil
}

// CarryFlags makes the inner optimizer carry sf (FlagCarrier); it
// fails when the inner optimizer is not a FlagCarrier.
func (t *Transposed) CarryFlags(sf *StepFlags) error {
	fc, ok := t.opt.(FlagCarrier)
	if !ok {
		return fmt.Errorf("lbgomlx: %T carries no flags (not an FlagCarrier)", t.opt)
	}
	return fc.CarryFlags(sf)
}

// StateBytes returns the inner optimizer's StateBytes (0 when it reports
// none) and the transposes' values and gradients, 8 bytes per element of
// the transposed matrices.
func (t *Transposed) StateBytes() int64 {
	var n int64
	if mr, ok := t.opt.(MemoryReporter); ok {
		n = mr.StateBytes()
	}
	for _, m := range t.mats {
		n += 8 * int64(m.rows*m.cols)
	}
	return n
}
