package conformance

import (
	"context"
	"fmt"
	"math"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// KindOptimizer is the kind given to an optimizer step file: a recorded
// data-parallel optimizer run, every rank's gradients and the parameters
// after every step. Such a file has no "kind"; its "optimizer" field names
// the run's optimizer.
const KindOptimizer = "optimizer"

// OptimizerMuon is the optimizer of a step file that RunOptimizerRank
// replays: data-parallel Muon with an auxiliary Adam, in float64 (the
// format of muon_w3.json).
const OptimizerMuon = "muon-aux-adam"

// OptimizerTolerance is how far a replayed parameter may be from the
// recorded one: |got - want| <= OptimizerTolerance * max(1, |want|), the
// spec's tolerance (see Close).
const OptimizerTolerance = 1e-5

// OptimizerRun is an optimizer step file of Muon with an auxiliary Adam:
// Muon for the parameters whose UseMuon is true (shape [rows, cols]),
// Adam, bias-corrected, for the others, the gradients of every rank
// averaged exactly before each step.
type OptimizerRun struct {
	Optimizer       string      `json:"optimizer"`
	World           int         `json:"world"`
	Shapes          [][]int     `json:"shapes"`
	UseMuon         []bool      `json:"use_muon"`
	LR              float64     `json:"lr"`
	Momentum        float64     `json:"momentum"`
	Nesterov        bool        `json:"nesterov"`
	WeightDecay     float64     `json:"weight_decay"`
	NSSteps         int         `json:"ns_steps"`
	NSCoefficients  [3]float64  `json:"ns_coefficients"`
	NSEps           float64     `json:"ns_eps"`
	AdamLR          float64     `json:"adam_lr"`
	AdamBetas       [2]float64  `json:"adam_betas"`
	AdamEps         float64     `json:"adam_eps"`
	AdamWeightDecay float64     `json:"adam_weight_decay"`
	Init            [][]float64 `json:"init"`
	Steps           []struct {
		Grads  [][][]float64 `json:"grads"` // [rank][param][element]
		Params [][]float64   `json:"params"`
	} `json:"steps"`
}

// Replays reports whether RunOptimizerRank replays c: an optimizer step
// file of OptimizerMuon. Other optimizers' step files (DeepSpeed's 1-bit
// optimizers, replayed by package onebit's tests) are not replayed here.
func Replays(c *Case) bool {
	r, err := c.OptimizerRun()
	return err == nil && r.Optimizer == OptimizerMuon
}

// OptimizerRun decodes c as an optimizer step file and checks that its
// lengths are consistent.
func (c *Case) OptimizerRun() (*OptimizerRun, error) {
	r := &OptimizerRun{}
	if err := c.decode(KindOptimizer, r); err != nil {
		return nil, err
	}
	if r.Optimizer != OptimizerMuon {
		return r, nil
	}
	n := len(r.Shapes)
	if r.World < 1 || len(r.UseMuon) != n || len(r.Init) != n || len(r.Steps) == 0 {
		return nil, fmt.Errorf("optimizer case %s: world %d, %d shapes, %d use_muon, %d init, %d steps",
			c.Name, r.World, n, len(r.UseMuon), len(r.Init), len(r.Steps))
	}
	numel := make([]int, n)
	for i, sh := range r.Shapes {
		numel[i] = 1
		for _, d := range sh {
			numel[i] *= d
		}
		if len(r.Init[i]) != numel[i] {
			return nil, fmt.Errorf("optimizer case %s: init[%d] holds %d values for shape %v", c.Name, i, len(r.Init[i]), sh)
		}
	}
	for s, st := range r.Steps {
		ok := len(st.Grads) == r.World && len(st.Params) == n
		for i := 0; ok && i < n; i++ {
			ok = len(st.Params[i]) == numel[i]
			for k := 0; ok && k < r.World; k++ {
				ok = len(st.Grads[k]) == n && len(st.Grads[k][i]) == numel[i]
			}
		}
		if !ok {
			return nil, fmt.Errorf("optimizer case %s: step %d: gradients or parameters do not match the %d ranks and shapes %v", c.Name, s+1, r.World, r.Shapes)
		}
	}
	return r, nil
}

// muonConfig is the run's configuration as an optim.MuonConfig, the
// parameters named "p0", "p1", ... in order.
func (r *OptimizerRun) muonConfig() optim.MuonConfig {
	cfg := optim.DefaultMuonConfig()
	cfg.LR, cfg.Momentum, cfg.Nesterov = float32(r.LR), float32(r.Momentum), r.Nesterov
	cfg.WeightDecay, cfg.NSSteps, cfg.NSEps = float32(r.WeightDecay), r.NSSteps, float32(r.NSEps)
	for k, x := range r.NSCoefficients {
		cfg.NSCoefficients[k] = float32(x)
	}
	cfg.AdamLR, cfg.AdamBeta1, cfg.AdamBeta2 = float32(r.AdamLR), float32(r.AdamBetas[0]), float32(r.AdamBetas[1])
	cfg.AdamEps, cfg.AdamWeightDecay = float32(r.AdamEps), float32(r.AdamWeightDecay)
	cfg.Params = []string{}
	for i, m := range r.UseMuon {
		if m {
			cfg.Params = append(cfg.Params, fmt.Sprintf("p%d", i))
		}
	}
	return cfg
}

// RunOptimizerRank replays an optimizer step file of OptimizerMuon as rank
// cm.Rank() of cm, whose size must be the run's world: lowbit's optim.Muon
// is given this rank's gradients of every step and its parameters are
// compared with the recorded ones after every step. It returns the largest
// |got - want| of any parameter after any step, and an error naming the
// first element beyond OptimizerTolerance (after replaying every step).
// Every rank of cm calls it together. Each of mods, if any, changes the
// configuration built from the file before the replay (to replay it with
// optim.MuonConfig.Split, say); every rank passes the same.
func RunOptimizerRank(ctx context.Context, cm comm.Comm, c *Case, mods ...func(*optim.MuonConfig)) (float64, error) {
	r, err := c.OptimizerRun()
	if err != nil {
		return 0, err
	}
	if r.Optimizer != OptimizerMuon {
		return 0, fmt.Errorf("%w: optimizer %q (this command replays %q)", ErrNotImplemented, r.Optimizer, OptimizerMuon)
	}
	if cm.Size() != r.World {
		return 0, fmt.Errorf("case needs %d ranks, communicator has %d", r.World, cm.Size())
	}
	params := make([]*optim.Param, len(r.Shapes))
	for i, sh := range r.Shapes {
		p, err := optim.NewParamFrom(fmt.Sprintf("p%d", i), floats32(r.Init[i]), slices.Clone(sh)...)
		if err != nil {
			return 0, err
		}
		params[i] = p
	}
	cfg := r.muonConfig()
	for _, mod := range mods {
		mod(&cfg)
	}
	opt, err := optim.NewMuon(ctx, cm, params, cfg)
	if err != nil {
		return 0, err
	}
	defer opt.Close()
	var worst float64
	var bad error
	for s, st := range r.Steps {
		for i, p := range params {
			for k, g := range st.Grads[cm.Rank()][i] {
				p.GradData()[k] = float32(g)
			}
		}
		if err := opt.Step(ctx); err != nil {
			return worst, fmt.Errorf("step %d: %w", s+1, err)
		}
		for i, p := range params {
			for k, got := range p.Data() {
				want := st.Params[i][k]
				d := math.Abs(float64(got) - want)
				worst = max(worst, d)
				if bad == nil && !(d <= OptimizerTolerance*math.Max(1, math.Abs(want))) {
					bad = fmt.Errorf("step %d: p%d[%d] = %g, want %g (off by %.3g, tolerance %g)", s+1, i, k, got, want, d, OptimizerTolerance)
				}
			}
		}
	}
	if bad != nil {
		return worst, fmt.Errorf("largest deviation %.3g; first beyond the tolerance: %w", worst, bad)
	}
	return worst, nil
}

func floats32(x []float64) []float32 {
	out := make([]float32, len(x))
	for i, v := range x {
		out[i] = float32(v)
	}
	return out
}
