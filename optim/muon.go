package optim

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/comm"
)

// AlgorithmMuon is the checkpoint algorithm name of Muon.
const AlgorithmMuon = "muon"

// Checkpoint names of Muon's own state: the momentum of each matrix
// (followed by the parameter name; the auxiliary AdamW's moments use
// ExpAvgPrefix and ExpAvgSqPrefix), and the learning-rate state of the
// auxiliary AdamW group (FloatLR and IntLRSchedule are the Muon group's).
const (
	MomentumBufferPrefix = "momentum_buffer/"
	FloatAdamLR          = "adam_lr"
	IntAdamLRSchedule    = "adam_lr_schedule"
)

// MuonConfig holds the hyper-parameters of Muon and of its auxiliary
// AdamW. Start from DefaultMuonConfig: the zero value is not the defaults.
type MuonConfig struct {
	// LR is the learning rate of the Muon group, finite and >= 0. Default
	// 0.02.
	LR float32
	// Momentum is the decay of the momentum, in [0, 1). Default 0.95.
	Momentum float32
	// Nesterov orthogonalizes (1-Momentum)*g + Momentum*m instead of m.
	// Default true.
	Nesterov bool
	// NSSteps is the number of Newton-Schulz iterations, 1 to 100. Default
	// 5.
	NSSteps int
	// NSCoefficients are the (a, b, c) of each iteration X = a*X +
	// (b*A + c*A*A)*X, A = X*X^T; finite. Default (3.4445, -4.7750,
	// 2.0315).
	NSCoefficients [3]float32
	// NSEps is added to the Frobenius norm that the momentum is divided
	// by before the iteration; finite and >= 0. Default 1e-7.
	NSEps float32
	// WeightDecay is the decoupled weight decay of the Muon group,
	// p = p*(1 - LR*WeightDecay) - LR*update; finite and >= 0. Default 0.
	WeightDecay float32
	// Params names the parameters that Muon updates: each must have rank
	// 2 or more (a tensor of higher rank is viewed as rows x the product
	// of the other dimensions). Every other parameter is updated by the
	// auxiliary AdamW. Nil selects every parameter of rank 2 or more,
	// the recipe's rule for the hidden matrices: list the names to leave
	// out matrices that the recipe gives to AdamW (embeddings, the output
	// head). A selection that gives Muon no parameter is refused (it would
	// silently be AdamW). Every name at most once. Default nil.
	Params []string
	// AdamLR is the learning rate of the auxiliary AdamW, finite and >= 0.
	// Default 3e-4.
	AdamLR float32
	// AdamBeta1 and AdamBeta2 are its moment decays, each in [0, 1).
	// Defaults 0.9 and 0.95.
	AdamBeta1, AdamBeta2 float32
	// AdamEps is added to sqrt(v_hat); finite and >= 0. Default 1e-10.
	AdamEps float32
	// AdamWeightDecay is its decoupled weight decay; finite and >= 0.
	// Default 0. The auxiliary AdamW always corrects the bias of its
	// moments.
	AdamWeightDecay float32
	// Reduce is how the gradients of every parameter are averaged over the
	// ranks before the update; see ReduceMode. Default ReduceFP32.
	Reduce ReduceMode
	// RanksPerNode is the node size of ReduceTwoLevel (0: ask the
	// communicator); >= 0. Default 0.
	RanksPerNode int
	// Split divides the orthogonalization among the ranks: each rank runs
	// Newton-Schulz only on its share of the matrices (assigned once, at
	// construction, balancing the iteration's cost; the assignment depends
	// only on the shapes and the world size) and one all-gather per step
	// gives every rank every matrix's scaled update, which every rank
	// applies. The parameters and the momenta are bit for bit those
	// without Split (the owner computes what every rank would have), the
	// gradients are averaged as without it, and checkpoints are the same.
	// It costs an all-gather of the updates, (W-1)*S float32s received per
	// rank per step, S the largest share's elements (about N/W of the N
	// elements of the Muon matrices), for 1/W of the orthogonalization's
	// compute: it pays where the step is compute-bound, not on slow links
	// (see docs/muon.md). No effect on one rank. Default false.
	Split bool
}

// DefaultMuonConfig returns the published defaults: Muon lr 0.02, momentum
// 0.95, Nesterov, 5 Newton-Schulz steps with coefficients (3.4445,
// -4.7750, 2.0315), eps 1e-7, no weight decay, Muon for every parameter of
// rank 2 or more; AdamW lr 3e-4, betas (0.9, 0.95), eps 1e-10, no weight
// decay.
func DefaultMuonConfig() MuonConfig {
	return MuonConfig{
		LR: 0.02, Momentum: 0.95, Nesterov: true,
		NSSteps: 5, NSCoefficients: [3]float32{3.4445, -4.7750, 2.0315}, NSEps: 1e-7,
		AdamLR: 3e-4, AdamBeta1: 0.9, AdamBeta2: 0.95, AdamEps: 1e-10,
	}
}

// maxNSSteps bounds MuonConfig.NSSteps.
const maxNSSteps = 100

// Validate reports the first invalid field as a *ConfigError (see the
// fields for what is valid). Whether Params names parameters that exist
// and are matrices depends on the parameters: NewMuon checks that. NewMuon
// returns exactly this error for an invalid config.
func (c MuonConfig) Validate() error {
	const cfg = "optim.MuonConfig"
	finite := func(x float32) bool { return !math.IsNaN(float64(x)) && !math.IsInf(float64(x), 0) }
	switch {
	case checkLR(c.LR) != nil:
		return &ConfigError{cfg, "LR", c.LR, "finite and >= 0"}
	case !(c.Momentum >= 0 && c.Momentum < 1):
		return &ConfigError{cfg, "Momentum", c.Momentum, "in [0, 1)"}
	case c.NSSteps < 1 || c.NSSteps > maxNSSteps:
		return &ConfigError{cfg, "NSSteps", c.NSSteps, fmt.Sprintf("1 to %d", maxNSSteps)}
	case !finite(c.NSCoefficients[0]) || !finite(c.NSCoefficients[1]) || !finite(c.NSCoefficients[2]):
		return &ConfigError{cfg, "NSCoefficients", c.NSCoefficients, "finite"}
	case !nonNegFinite(c.NSEps):
		return &ConfigError{cfg, "NSEps", c.NSEps, "finite and >= 0"}
	case !nonNegFinite(c.WeightDecay):
		return &ConfigError{cfg, "WeightDecay", c.WeightDecay, "finite and >= 0"}
	case checkLR(c.AdamLR) != nil:
		return &ConfigError{cfg, "AdamLR", c.AdamLR, "finite and >= 0"}
	case !(c.AdamBeta1 >= 0 && c.AdamBeta1 < 1):
		return &ConfigError{cfg, "AdamBeta1", c.AdamBeta1, "in [0, 1)"}
	case !(c.AdamBeta2 >= 0 && c.AdamBeta2 < 1):
		return &ConfigError{cfg, "AdamBeta2", c.AdamBeta2, "in [0, 1)"}
	case !nonNegFinite(c.AdamEps):
		return &ConfigError{cfg, "AdamEps", c.AdamEps, "finite and >= 0"}
	case !nonNegFinite(c.AdamWeightDecay):
		return &ConfigError{cfg, "AdamWeightDecay", c.AdamWeightDecay, "finite and >= 0"}
	case !c.Reduce.Valid():
		return &ConfigError{cfg, "Reduce", c.Reduce, "one of " + strings.Join(reduceNames[:], ", ")}
	case c.RanksPerNode < 0:
		return &ConfigError{cfg, "RanksPerNode", c.RanksPerNode, ">= 0"}
	}
	for i, name := range c.Params {
		if slices.Contains(c.Params[:i], name) {
			return &ConfigError{cfg, "Params", c.Params, fmt.Sprintf("every name once (%q is listed twice)", name)}
		}
	}
	return nil
}

// hypers lists the hyperparameters of c that decide a step (the learning
// rates aside, see Hyper), with the fingerprint of which parameters use
// Muon (muon[i] for parameter i).
func (c MuonConfig) hypers(muon []bool) []Hyper {
	sel := make([][]float32, len(muon))
	for i, m := range muon {
		if m {
			sel[i] = []float32{}
		}
	}
	return []Hyper{
		{"momentum", float64(c.Momentum)},
		{"nesterov", HyperBool(c.Nesterov)},
		{"ns_steps", float64(c.NSSteps)},
		{"ns_a", float64(c.NSCoefficients[0])},
		{"ns_b", float64(c.NSCoefficients[1])},
		{"ns_c", float64(c.NSCoefficients[2])},
		{"ns_eps", float64(c.NSEps)},
		{"weight_decay", float64(c.WeightDecay)},
		{"adam_beta1", float64(c.AdamBeta1)},
		{"adam_beta2", float64(c.AdamBeta2)},
		{"adam_eps", float64(c.AdamEps)},
		{"adam_weight_decay", float64(c.AdamWeightDecay)},
		{"muon_params", HyperFingerprint(sel)},
	}
}

// Muon is exact data-parallel Muon (momentum orthogonalized by
// Newton-Schulz) for the matrices, with an auxiliary AdamW for every other
// parameter, in one optimizer and one Step. Every step averages the
// gradients of all parameters over the ranks (in MuonConfig.Reduce, as
// exact Adam does), then on every rank, for each Muon parameter of
// matrix shape rows x cols (the first dimension by the product of the
// others),
//
//	m = mu*m + (1-mu)*g
//	u = (1-mu)*g + mu*m   (Nesterov; else u = m)
//	X = u, transposed when rows > cols
//	X = X / (||X||_F + eps)
//	repeat NSSteps times: A = X X^T; B = b*A + c*A A; X = a*X + B X
//	u = X (transposed back) * max(1, rows/cols)^0.5
//	p = p*(1 - lr*wd) - lr*u
//
// and for every other parameter the AdamW step of Adam (bias-corrected,
// with the AdamW settings of MuonConfig and its own learning rate). A zero
// momentum matrix gives a zero update.
//
// The two groups have their own learning rates: SetLR, SetSchedule and LR
// (the LRSetter a generic training loop calls) drive the Muon group;
// SetAdamLR, SetAdamSchedule and AdamLR the AdamW group. Checkpoints keep
// both.
//
// Every rank computes the same update from the same averaged gradients,
// so the parameters stay identical (bit for bit on ranks of one
// architecture; see docs/muon.md). With MuonConfig.Split each matrix's
// update is computed by one rank and all-gathered, with the same bits.
// Step overwrites the gradients with their average. A step in which some
// rank's gradient is not finite is skipped on every rank; one whose
// momentum would not be finite is an error on every rank that changes
// nothing but the averaged gradients. After an error from the
// communicator the state is undefined: load a checkpoint.
type Muon struct {
	f      *Frame
	cfg    MuonConfig
	params []*Param
	avg    *GradAverager

	mats  []muonMatrix // the Muon group, in construction order
	aux   []int        // indices of the AdamW group's parameters
	m     [][]float32  // per parameter: Muon's momentum, or AdamW's first moment
	v     [][]float32  // per parameter: AdamW's second moment (nil for Muon's)
	work  []*nsWork    // one per matrix shape
	split *muonSplit   // MuonConfig.Split's plan on more than one rank, else nil

	adam *GroupLR // the AdamW group's learning rate
}

// muonMatrix is one parameter of the Muon group.
type muonMatrix struct {
	i          int     // parameter index
	rows, cols int     // the matrix view
	scale      float32 // max(1, rows/cols)^0.5
	ns         *nsWork // nil for a matrix without elements
}

var (
	_ Optimizer      = (*Muon)(nil)
	_ LRSetter       = (*Muon)(nil)
	_ FlagCarrier    = (*Muon)(nil)
	_ MemoryReporter = (*Muon)(nil)
)

// NewMuon returns Muon over params, averaging gradients over c (nil for a
// single process). Every rank of c calls it together, with the same
// parameter names and shapes and the same configuration: it compares them
// with one small all-gather (the only collective it runs), so that a
// difference, or an invalid cfg or parameter on any rank, is an error on
// every rank. An invalid cfg is cfg.Validate's error on the rank that has
// it (joined, on more than one rank, with the agreement's). It allocates
// the momentum of each matrix, AdamW's two moments of every other
// parameter, and the Newton-Schulz work matrices, one set per matrix
// shape; in the fp16, bf16 and two-level reduction modes the first Step
// allocates the flat averaging buffers (see NewAdam). Later steps
// allocate nothing. With MuonConfig.Split on more than one rank it also
// allocates the all-gather's buffers (see StateBytes).
func NewMuon(ctx context.Context, c comm.Comm, params []*Param, cfg MuonConfig, opts ...Option) (*Muon, error) {
	bad := cfg.Validate()
	var muon []bool
	if bad == nil {
		if err := checkParams(params); err != nil {
			bad = fmt.Errorf("optim: Muon: %w", err)
		} else if muon, err = selectMuon(params, cfg.Params); err != nil {
			bad = fmt.Errorf("optim: Muon: %w", err)
		}
	}
	if c != nil && c.Size() > 1 {
		// Every rank takes part, so that one rank's bad input is an error
		// on every rank rather than a hang.
		if err := agreeMuon(ctx, c, params, muon, cfg, bad != nil); err != nil {
			return nil, errors.Join(bad, err)
		}
	}
	if bad != nil {
		return nil, bad
	}
	o := &Muon{
		cfg: cfg, params: slices.Clone(params),
		m: make([][]float32, len(params)), v: make([][]float32, len(params)),
		adam: NewGroupLR("AdamW group", "SetAdamLR", cfg.AdamLR, FloatAdamLR, IntAdamLRSchedule),
	}
	work := map[[2]int]*nsWork{}
	for i, p := range o.params {
		o.m[i] = make([]float32, p.Numel())
		if !muon[i] {
			o.v[i] = make([]float32, p.Numel())
			o.aux = append(o.aux, i)
			continue
		}
		rows, cols := matrixView(p.Shape())
		mt := muonMatrix{i: i, rows: rows, cols: cols, scale: float32(math.Sqrt(max(1, float64(rows)/float64(cols))))}
		if p.Numel() > 0 {
			key := [2]int{min(rows, cols), max(rows, cols)}
			if work[key] == nil {
				work[key] = newNSWork(key[0], key[1])
				o.work = append(o.work, work[key])
			}
			mt.ns = work[key]
		}
		o.mats = append(o.mats, mt)
	}
	avg, err := NewGradAverager(c, o.params, cfg.Reduce, cfg.RanksPerNode)
	if err != nil {
		return nil, err
	}
	o.avg = avg
	if cfg.Split && c != nil && c.Size() > 1 {
		o.split = newMuonSplit(c, o.mats)
	}
	ops := ApplyOptions(opts)
	o.f = NewFrame(FrameConfig{
		Name: "optim: Muon", Algorithm: AlgorithmMuon, Comm: c, Params: o.params, Sizes: o.m,
		LR: cfg.LR, Stage: StageExact, Logger: ops.Logger, Averager: avg,
		Hypers: cfg.hypers(muon), Check: o.adam.Check,
	})
	o.f.Handle(StageExact, o.update)
	return o, nil
}

// matrixView is the matrix a parameter of the given shape (rank >= 2) is
// viewed as: the first dimension by the product of the others.
func matrixView(shape []int) (rows, cols int) {
	rows, cols = shape[0], 1
	for _, d := range shape[1:] {
		cols *= d
	}
	return rows, cols
}

// selectMuon returns, per parameter, whether Muon updates it: the
// parameters named in names, or with nil names every parameter of rank 2
// or more. Its errors carry no prefix and name the parameters at fault
// and those Params could name (at most maxListed of each).
func selectMuon(params []*Param, names []string) ([]bool, error) {
	muon := make([]bool, len(params))
	for i, p := range params {
		muon[i] = names == nil && len(p.Shape()) >= 2
	}
	var unknown []string
	for _, name := range names {
		i := slices.IndexFunc(params, func(p *Param) bool { return p.Name == name })
		if i < 0 {
			unknown = append(unknown, name)
			continue
		}
		if sh := params[i].Shape(); len(sh) < 2 {
			return nil, fmt.Errorf("parameter %q of shape %v is marked for Muon but is not a matrix (Muon needs rank 2 or more; a tensor of higher rank is viewed as rows x the product of the rest; the matrices: %s)",
				name, sh, listNames(matrixNames(params)))
		}
		muon[i] = true
	}
	if len(unknown) > 0 {
		what := "is not a parameter"
		if len(unknown) > 1 {
			what = "are not parameters"
		}
		all := make([]string, len(params))
		for i, p := range params {
			all[i] = p.Name
		}
		return nil, fmt.Errorf("MuonConfig.Params names %s, which %s (the matrices: %s; all %d parameters: %s)",
			listNames(unknown), what, listNames(matrixNames(params)), len(params), listNames(all))
	}
	if !slices.Contains(muon, true) {
		if names == nil {
			return nil, fmt.Errorf("no parameter has rank 2 or more: Muon would update nothing (use Adam)")
		}
		return nil, fmt.Errorf("MuonConfig.Params selects no parameter: Muon would update nothing (use Adam; the matrices it could name: %s)",
			listNames(matrixNames(params)))
	}
	return muon, nil
}

// maxListed bounds the names an error lists.
const maxListed = 10

// listNames formats names for an error: the first maxListed quoted, and
// how many more there are; "none" when there are none.
func listNames(names []string) string {
	if len(names) == 0 {
		return "none"
	}
	var b strings.Builder
	for i, name := range names[:min(len(names), maxListed)] {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%q", name)
	}
	if n := len(names) - maxListed; n > 0 {
		fmt.Fprintf(&b, " and %d more", n)
	}
	return b.String()
}

// matrixNames returns the names of the parameters of rank 2 or more.
func matrixNames(params []*Param) []string {
	var out []string
	for _, p := range params {
		if len(p.Shape()) >= 2 {
			out = append(out, p.Name)
		}
	}
	return out
}

// update is the exact stage's StepFunc.
func (o *Muon) update(ctx context.Context, t int64, lr float32) error {
	if err := o.avg.Average(ctx); err != nil {
		return samePackage{err}
	}
	cfg := o.cfg
	mu := cfg.Momentum
	// Check every momentum before anything changes: the same bytes on
	// every rank, so every rank refuses alike.
	for _, mt := range o.mats {
		if !momentumFinite(o.m[mt.i], o.params[mt.i].GradData(), mu) {
			return fmt.Errorf("the momentum of %q would not be finite (a gradient near the float32 limit, or a non-finite momentum loaded): nothing changed but the averaged gradients", o.params[mt.i].Name)
		}
	}
	decay := float32(1 - float64(lr)*float64(cfg.WeightDecay))
	if o.split != nil {
		if err := o.splitUpdate(ctx, lr, decay); err != nil {
			return err
		}
		o.adamUpdate(t)
		return nil
	}
	for _, mt := range o.mats {
		p := o.params[mt.i]
		m, g := o.m[mt.i], p.GradData()
		Momentum(m, g, mu)
		if mt.ns == nil {
			continue
		}
		loadNS(mt.ns.x, m, g, mt.rows, mt.cols, mu, cfg.Nesterov)
		if !mt.ns.normalize(cfg.NSEps) {
			scale32(p.Data(), decay) // a zero momentum: no update but the decay
			continue
		}
		mt.ns.iterate(cfg.NSCoefficients, cfg.NSSteps)
		applyNS(p.Data(), mt.ns.x, mt.rows, mt.cols, decay, mt.step(lr))
	}
	o.adamUpdate(t)
	return nil
}

// step is the factor of the matrix's orthogonalized update at learning
// rate lr: lr*max(1, rows/cols)^0.5, rounded once to float32.
func (mt muonMatrix) step(lr float32) float32 { return float32(float64(lr) * float64(mt.scale)) }

// adamUpdate is the AdamW group's step t.
func (o *Muon) adamUpdate(t int64) {
	cfg := o.cfg
	alr := o.adam.At(t)
	c1, c2 := BiasCorrection(cfg.AdamBeta1, t), BiasCorrection(cfg.AdamBeta2, t)
	for _, i := range o.aux {
		p := o.params[i]
		AdamStep(p.Data(), o.m[i], o.v[i], p.GradData(), cfg.AdamBeta1, cfg.AdamBeta2, alr, cfg.AdamWeightDecay, c1, c2, cfg.AdamEps)
	}
}

// momentumFinite reports whether the momentum mu*m + (1-mu)*g, and the
// Nesterov term built from it, would be finite, without changing m.
func momentumFinite(m, g []float32, mu float32) bool {
	a := OneMinus(mu)
	g = g[:len(m)]
	var s float32
	for i, mi := range m {
		ag := float32(a * g[i])
		n := float32(mu*mi) + ag
		s += n*0 + (float32(mu*n)+ag)*0
	}
	return s == s
}

// loadNS writes the matrix to orthogonalize into x: the momentum m (rows x
// cols), or with nesterov (1-mu)*g + mu*m, transposed when rows > cols.
func loadNS(x, m, g []float32, rows, cols int, mu float32, nesterov bool) {
	a := OneMinus(mu)
	at := func(k int) float32 {
		if nesterov {
			return float32(a*g[k]) + float32(mu*m[k])
		}
		return m[k]
	}
	if rows <= cols {
		for k := range m {
			x[k] = at(k)
		}
		return
	}
	for r := range rows {
		for c := range cols {
			x[c*rows+r] = at(r*cols + c)
		}
	}
}

// applyNS applies p = p*decay - step*u, u being x (transposed back when
// rows > cols).
func applyNS(p, x []float32, rows, cols int, decay, step float32) {
	if rows <= cols {
		x = x[:len(p)]
		for k, u := range x {
			p[k] = float32(p[k]*decay) - float32(step*u)
		}
		return
	}
	for r := range rows {
		row := p[r*cols : (r+1)*cols]
		for c := range row {
			row[c] = float32(row[c]*decay) - float32(step*x[c*rows+r])
		}
	}
}

// scale32 multiplies x by s in place.
func scale32(x []float32, s float32) {
	if s == 1 {
		return
	}
	for i := range x {
		x[i] *= s
	}
}

// Step applies one update; see Optimizer.
func (o *Muon) Step(ctx context.Context) error { return o.f.Step(ctx) }

// Params returns the parameters in construction order.
func (o *Muon) Params() []*Param { return o.params }

// MuonParams returns the names of the parameters that Muon updates, in
// construction order; every other parameter is the auxiliary AdamW's.
func (o *Muon) MuonParams() []string {
	names := make([]string, len(o.mats))
	for k, mt := range o.mats {
		names[k] = o.params[mt.i].Name
	}
	return names
}

// Stats reports progress and traffic; Stage is always StageExact.
func (o *Muon) Stats() Stats { return o.f.Stats() }

// SetLR fixes the Muon group's learning rate of the following steps,
// replacing its schedule; see LRSetter. The AdamW group's is set by
// SetAdamLR.
func (o *Muon) SetLR(lr float32) error { return o.f.SetLR(lr) }

// SetSchedule makes s choose the Muon group's learning rate of every
// following step (nil: back to the fixed one); see LRSetter. The AdamW
// group's is set by SetAdamSchedule.
func (o *Muon) SetSchedule(s Schedule) error { return o.f.SetSchedule(s) }

// LR returns the Muon group's learning rate of the next step.
func (o *Muon) LR() float32 { return o.f.LR() }

// SetAdamLR fixes the AdamW group's learning rate of the following steps,
// replacing its schedule, as LRSetter.SetLR does for the Muon group.
func (o *Muon) SetAdamLR(lr float32) error {
	if err := o.adam.Set(lr); err != nil {
		return fmt.Errorf("optim: Muon: %w", err)
	}
	return nil
}

// SetAdamSchedule makes s choose the AdamW group's learning rate of every
// following step (nil: back to the fixed one), as LRSetter.SetSchedule
// does for the Muon group.
func (o *Muon) SetAdamSchedule(s Schedule) error {
	if err := o.adam.SetSchedule(s, o.f.Applied()+1); err != nil {
		return fmt.Errorf("optim: Muon: %w", err)
	}
	return nil
}

// AdamLR returns the AdamW group's learning rate of the next step.
func (o *Muon) AdamLR() float32 { return o.adam.At(o.f.Applied() + 1) }

// CarryFlags makes every following Step carry sf in its per-step
// agreement; see FlagCarrier.
func (o *Muon) CarryFlags(sf *StepFlags) error { return o.f.CarryFlags(sf) }

// State returns a checkpoint holding the parameters, the momentum of each
// matrix (MomentumBufferPrefix), AdamW's moments of the other parameters,
// the step counters and both groups' learning-rate state. Every rank's
// checkpoint is the same apart from its Rank field.
func (o *Muon) State() (*Checkpoint, error) {
	ck := o.f.Checkpoint()
	o.adam.Save(ck)
	for i, p := range o.params {
		shape := p.Shape()
		ck.AddTensor(ParamTensorName(p.Name), shape, p.Data())
		if o.v[i] == nil {
			ck.AddTensor(MomentumBufferPrefix+p.Name, shape, o.m[i])
			continue
		}
		ck.AddTensor(ExpAvgPrefix+p.Name, shape, o.m[i])
		ck.AddTensor(ExpAvgSqPrefix+p.Name, shape, o.v[i])
	}
	return ck, nil
}

// Load restores a checkpoint made by Muon.State over the same parameters
// and selection of Muon parameters, any rank's, on a group of any size
// (see Replicated); anything else,
// another optimizer's checkpoint included, is refused with an error
// wrapping ErrIncompatibleCheckpoint and changes nothing. Each group's
// learning rate follows Frame.CheckLoad's rule (the AdamW group's under
// FloatAdamLR and IntAdamLRSchedule).
func (o *Muon) Load(ck *Checkpoint) error {
	st, err := o.f.CheckLoad(ck, StageExact)
	if err != nil {
		return err
	}
	applyALR, err := o.adam.CheckLoad(ck)
	if err != nil {
		return err
	}
	rs := ck.Restore()
	for i, p := range o.params {
		rs.Tensor(ParamTensorName(p.Name), p.Data())
		if o.v[i] == nil {
			rs.Tensor(MomentumBufferPrefix+p.Name, o.m[i])
			continue
		}
		rs.Tensor(ExpAvgPrefix+p.Name, o.m[i])
		rs.Tensor(ExpAvgSqPrefix+p.Name, o.v[i])
	}
	if err := rs.Apply(); err != nil {
		return err
	}
	o.f.Restore(st)
	applyALR(o.f.Logger(), AlgorithmMuon)
	return nil
}

// StateBytes returns the bytes of o's buffers (see MemoryReporter): the
// momentum of each matrix (4 bytes per element), AdamW's two moments of
// every other parameter (8 bytes per element), the Newton-Schulz work
// matrices (for each distinct matrix shape r x c with r <= c: 2rc + 2r^2
// float32s, shared by the matrices of that shape), the gradient
// averager's buffers and, with MuonConfig.Split on W > 1 ranks, the
// all-gather's send and receive buffers, (W+1)*S float32s, S the largest
// rank's share of the Muon matrices' elements.
func (o *Muon) StateBytes() int64 {
	n := Float32Bytes(o.m...) + Float32Bytes(o.v...) + o.avg.StateBytes()
	for _, w := range o.work {
		n += w.bytes()
	}
	if o.split != nil {
		n += Float32Bytes(o.split.send, o.split.recv)
	}
	return n
}

// Close releases the communicators that ReduceTwoLevel averaging split off
// the group (none in the other modes); see Optimizer.Close: not a
// collective, idempotent, every rank calls it, Step fails after it.
func (o *Muon) Close() error {
	o.f.Close()
	return o.avg.Close()
}
