package onebit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// AlgorithmMuon is the checkpoint algorithm name of 1-bit Muon.
const AlgorithmMuon = "onebit-muon"

// MuonConfig holds the hyper-parameters of 1-bit Muon. Start from
// DefaultMuonConfig: the zero value is not the defaults.
type MuonConfig struct {
	// MuonConfig holds Muon's settings and its auxiliary AdamW's, with
	// exact Muon's defaults and meaning (optim.MuonConfig); Reduce and
	// RanksPerNode are how the gradients are averaged in the warm-up.
	optim.MuonConfig
	// FreezeStep is the number of warm-up steps, >= 0: in steps
	// 1..FreezeStep 1-bit Muon is exact Muon (gradients averaged exactly,
	// one momentum, the auxiliary AdamW's variance updated), bit for bit;
	// from step FreezeStep+1 on the AdamW variance is frozen and both
	// groups go through the 1-bit exchange. 0 compresses from the first
	// step, the AdamW group then with v = 0: as in 1-bit Adam (see the
	// package doc on elements with no gradient), it moves nothing in the
	// first step, and from the second on takes steps of about lr (the
	// ratio bound's: signs of its momentum) where the first gave
	// gradient. Without WarmupAdamWOnly that momentum shares buckets
	// with the Muon group's updates and is swamped by their compression
	// noise, which trains badly (+299% on docs/muon.md's problem); with
	// it, a few points behind the default warm-up there. The Muon group
	// itself needs no warm-up: the warm-up is for the AdamW variance, as
	// in 1-bit Adam. Default 100, 1-bit Adam's (docs/muon.md has what was
	// measured).
	FreezeStep int
	// BucketBytes is the size of the fused buckets of the exchange, as in
	// AdamConfig: 0 means optim.DefaultBucketBytes, optim.PerParameter
	// one bucket per parameter.
	BucketBytes int
	// StateMode is how the state is kept on more than one rank: StateFull
	// (the default: every rank's momentum, a float32 slot of the exchange
	// per element and float32 error buffers, 13 bytes per element of a
	// Muon matrix on 4 ranks) or StateCompact (no slot: each update is
	// added into the worker error buffer, kept in bfloat16, before the
	// exchange, and the exchange's output is applied from the packed form
	// it gathers: 7 bytes on 4 ranks, 5 with MomentumBF16; docs/muon.md).
	// StateSharded is not offered. On one rank nothing is exchanged and
	// every mode runs as StateFull (its checkpoints still name the mode).
	StateMode StateMode
	// MomentumBF16, with StateCompact only, keeps each rank's Muon
	// momentum in bfloat16 in the compression stage, rounded
	// stochastically (optim.MomentumBF16; the bits a hash of the step,
	// the rank and the parameter, so that a resumed run rounds as the run
	// that was not interrupted): 2 bytes per element instead of 4. The
	// warm-up keeps it in float32 (exact Muon's); its end rounds it to
	// nearest. With WarmupAdamWOnly it is bfloat16 from the first step.
	MomentumBF16 bool
	// WarmupAdamWOnly makes the warm-up the AdamW group's only: the Muon
	// matrices go through the 1-bit exchange from the first step, as in
	// the compression stage (each rank's own momentum, orthogonalized),
	// and in steps 1..FreezeStep only the AdamW group's gradients are
	// averaged exactly (overwritten with their average) and its variance
	// updated. On more than one rank the exchange then lays out the Muon
	// group's elements first and the AdamW group's after them, the
	// buckets cut where the two meet (IntBucketCut), so that the
	// warm-up's exchange runs the Muon group's buckets only. The Muon
	// group needs no warm-up (docs/muon.md); its exact warm-up sends
	// float32 gradients for FreezeStep steps, which on a slow link is
	// most of a short run's time. DefaultMuonConfig sets it: on the GPT
	// example it ended no worse than the exact warm-up of both groups and
	// sent 2.4 times fewer bytes (docs/muon.md).
	WarmupAdamWOnly bool
	// Exchange is how the Muon group is averaged over the ranks:
	// ExchangePolar (the zero value, DefaultMuonConfig's: each rank's
	// polar factor through the 1-bit allreduce) or ExchangeOwners (the
	// owner of each matrix orthogonalizes an estimate of the ranks' mean
	// momentum; StateFull only). docs/muon.md compares them.
	Exchange MuonExchange
	// OwnerBits is the bits an element of ExchangeOwners' first phase,
	// each rank's message to the owners: 1 (and 0, the zero value) one bit,
	// the signs and a scale per chunk; 2 two bits, Lloyd-Max's four levels
	// at the chunk's root mean square (the owners' phase stays at one
	// bit). Two bits put the owners' estimate of the mean momentum nearer
	// it, at 1.5x the bytes: docs/muon.md has what each measured. Only
	// with ExchangeOwners.
	OwnerBits int
}

// ParseMuonStateMode parses the name of a state mode of 1-bit Muon as a
// command line spells it: "" or "full" (StateFull), "compact"
// (StateCompact) or "compact-bf16" (StateCompact with MomentumBF16).
func ParseMuonStateMode(s string) (mode StateMode, momentumBF16 bool, err error) {
	switch s {
	case "", "full":
		return StateFull, false, nil
	case "compact":
		return StateCompact, false, nil
	case "compact-bf16":
		return StateCompact, true, nil
	}
	return 0, false, fmt.Errorf("onebit: unknown Muon state mode %q (want full, compact or compact-bf16)", s)
}

// DefaultMuonFreezeStep is DefaultMuonConfig's FreezeStep.
const DefaultMuonFreezeStep = 100

// DefaultMuonConfig returns optim.DefaultMuonConfig with FreezeStep
// DefaultMuonFreezeStep and buckets of optim.DefaultBucketBytes.
func DefaultMuonConfig() MuonConfig {
	return MuonConfig{MuonConfig: optim.DefaultMuonConfig(), FreezeStep: DefaultMuonFreezeStep, BucketBytes: optim.DefaultBucketBytes, WarmupAdamWOnly: true}
}

// Validate reports the first invalid field as an *optim.ConfigError: those
// of optim.MuonConfig.Validate, a negative FreezeStep, Split (which 1-bit
// Muon does not take: each rank orthogonalizes its own momentum), a
// BucketBytes outside the convention of optim.DefaultBucketBytes, a
// StateMode other than StateFull and StateCompact, an unknown Exchange,
// ExchangeOwners with another StateMode than StateFull, an OwnerBits other
// than 0, 1 or (with ExchangeOwners) 2, or MomentumBF16 without
// StateCompact. NewMuon returns exactly this error (joined, on more than
// one rank, with the agreement's).
func (c MuonConfig) Validate() error {
	const cfg = "onebit.MuonConfig"
	if err := c.MuonConfig.Validate(); err != nil {
		return configErrorIn(err, cfg)
	}
	if c.FreezeStep < 0 {
		return &optim.ConfigError{Config: cfg, Field: "FreezeStep", Value: c.FreezeStep, Want: ">= 0"}
	}
	if c.Split {
		return &optim.ConfigError{Config: cfg, Field: "Split", Value: c.Split, Want: "false (1-bit Muon orthogonalizes each rank's own momentum: Split does not apply)"}
	}
	if c.StateMode != StateFull && c.StateMode != StateCompact {
		return &optim.ConfigError{Config: cfg, Field: "StateMode", Value: c.StateMode, Want: "StateFull or StateCompact"}
	}
	if c.Exchange != ExchangePolar && c.Exchange != ExchangeOwners {
		return &optim.ConfigError{Config: cfg, Field: "Exchange", Value: c.Exchange, Want: "ExchangePolar or ExchangeOwners"}
	}
	if c.OwnerBits < 0 || c.OwnerBits > 2 || c.OwnerBits == 2 && c.Exchange != ExchangeOwners {
		return &optim.ConfigError{Config: cfg, Field: "OwnerBits", Value: c.OwnerBits, Want: "0 or 1, or 2 with ExchangeOwners"}
	}
	if c.Exchange == ExchangeOwners && c.StateMode != StateFull {
		return &optim.ConfigError{Config: cfg, Field: "StateMode", Value: c.StateMode, Want: "StateFull with ExchangeOwners"}
	}
	if c.MomentumBF16 && c.StateMode != StateCompact {
		return &optim.ConfigError{Config: cfg, Field: "MomentumBF16", Value: c.MomentumBF16, Want: "false unless StateMode is StateCompact"}
	}
	return checkBucketBytes(cfg, c.BucketBytes)
}

// Muon is 1-bit Muon: Muon (optim.Muon) for the matrices and its
// auxiliary AdamW for every other parameter, whose exchange, after the
// warm-up, is the error-compensated 1-bit allreduce (AllReduce) in fused
// buckets, as 1-bit Adam's. docs/muon.md gives the design and what was
// measured.
//
// Warm-up, steps 1..FreezeStep: exact Muon, bit for bit (gradients
// averaged exactly in Reduce, one momentum, the same update on every
// rank), with its exact AdamW; with WarmupAdamWOnly the Muon matrices take
// the compression stage's steps below and only the AdamW group is exact.
// Compression, every later step, on W > 1 ranks, on rank r with its own
// gradient g_r:
//
//   - each Muon matrix (rows x cols): its own momentum
//     m_r = mu*m_r + (1-mu)*g_r, orthogonalized as Muon does (Nesterov
//     term, Newton-Schulz) into X_r, and X_r*sqrt(max(rows, cols)) put
//     into the exchange (a matrix of unit root mean square, whatever its
//     shape);
//   - each AdamW parameter: m = beta1*m + (1-beta1)*g_r from the shared
//     m, times k_p = 1/sqrt(mean(v_hat_p)) (the frozen variance's root
//     mean square, 1 where that is 0), put into the exchange;
//   - one compressed allreduce of every bucket (worker and server error
//     feedback, pipelining and tuning as AllReduce has them);
//   - every rank applies the same average A: p = p*(1-lr*wd) -
//     lr/sqrt(cols)*A for a Muon matrix (Muon's scale
//     max(1, rows/cols)^0.5 over the sqrt(max(rows, cols)) of the
//     exchange); m = A/k_p and 1-bit Adam's update with the frozen
//     variance (its ratio bounded as 1-bit Adam's, see the package doc)
//     for an AdamW parameter: an element whose v is zero takes no step,
//     and has its v marked if some rank gave it gradient, so that it
//     trains from the next step on (the package doc's elements with no
//     gradient: a byte first seen after the warm-up, say).
//
// The compression goes after the orthogonalization: Newton-Schulz lifts
// every singular direction to about 1, so noise compressed into the
// momentum before it comes out as large as the signal. Each rank's Muon
// momentum is its own state; nothing built from a rank's own gradient or
// momentum reaches the parameters but through the exchange, whose output
// is the same on every rank, so every rank holds the same parameters, bit
// for bit, after every step. On one rank nothing is exchanged: the
// compression stage is exact Muon for the matrices and 1-bit Adam's
// (frozen variance, no exchange) for the AdamW group.
//
// A step in which some rank's gradient is not finite is skipped on every
// rank. A momentum that is or would be non-finite is an error on every
// rank: a non-finite one loaded, or in the compression stage one that
// this rank's gradient would make so, is refused by its rank in the
// per-step agreement, nothing changed; in the warm-up one that the
// averaged gradient would make so (a gradient near the float32 limit) is
// found after the averaging, nothing changed but the averaged gradients.
// A zero momentum matrix gives a zero update from its rank (in a bucket
// it shares with other parameters its elements carry the bucket's
// compression noise, which the error feedback cancels over the steps).
// After an error from the communicator the state is undefined: load a
// checkpoint.
type Muon struct {
	f      *optim.Frame
	cfg    MuonConfig
	params []*optim.Param
	avg    *optim.GradAverager
	adam   *optim.GroupLR // the AdamW group's learning rate
	freeze int64
	bound  optim.RatioBound // the AdamW group's ratio bound (1-bit Adam's)

	mats []muonMatrix // the Muon group, in construction order
	aux  []int        // indices of the AdamW group's parameters
	orth []*optim.Orthogonalizer
	mom  [][]float32 // per parameter: this rank's Muon momentum (nil for AdamW's)
	flat []float32   // the exchange: every parameter's slot, in order
	slot [][]float32 // per parameter: its part of flat, AdamW's m for its group
	v    [][]float32 // per parameter: AdamW's second moment (nil for Muon's)
	unit []float32   // per parameter: AdamW's k_p in the compression stage
	auxV [][]float32 // the AdamW group's v, in the order of aux
	late unseen      // the AdamW group's elements whose frozen v is zero
	bkt  *buckets    // the fused buckets of flat (none on one rank)
	c2   float32     // AdamW's frozen variance bias correction

	// StateCompact on more than one rank: flat holds the AdamW group's m
	// only, a Muon matrix's slot is the front of scratch (as long as the
	// largest matrix, where its momentum is widened and its update
	// formed), step is each matrix's step of the compression stage, and
	// cm the compact state (nil in StateFull and on one rank).
	cm      *muonCompact
	scratch []float32
	step    []float32
	// ow is ExchangeOwners' state on more than one rank (nil otherwise).
	ow *muonOwners
	// mixed is WarmupAdamWOnly on more than one rank: the Muon group's
	// matrices are compressed in the warm-up too, through the first
	// bkt.split buckets, and avg averages the AdamW group's gradients only.
	mixed bool
}

// muonMatrix is one parameter of 1-bit Muon's Muon group.
type muonMatrix struct {
	i          int     // parameter index
	rows, cols int     // the matrix view
	scale      float32 // Muon's max(1, rows/cols)^0.5
	unit       float32 // sqrt(max(rows, cols)), the exchange's factor
	orth       *optim.Orthogonalizer
}

var (
	_ optim.Optimizer      = (*Muon)(nil)
	_ optim.LRSetter       = (*Muon)(nil)
	_ optim.FlagCarrier    = (*Muon)(nil)
	_ optim.MemoryReporter = (*Muon)(nil)
)

// NewMuon returns 1-bit Muon over params on the ranks of c (nil for a
// single process). Every rank of c calls it together, with the same
// parameter names and shapes and the same configuration: it compares them
// with one small all-gather (optim.AgreeMuon, the only collective it
// runs), so that a difference, or an invalid cfg or parameter on any rank
// (a parameter marked for Muon that is not a matrix, say), is an error on
// every rank. It allocates every buffer of the state (see StateBytes) but
// the averaging buffers of Reduce's fp16, bf16 and two-level modes, which
// the first warm-up step allocates; later steps allocate nothing.
func NewMuon(ctx context.Context, c comm.Comm, params []*optim.Param, cfg MuonConfig, opts ...optim.Option) (*Muon, error) {
	bad := cfg.Validate()
	var muon []bool
	if bad == nil {
		if err := optim.CheckParams(params); err != nil {
			bad = fmt.Errorf("onebit: Muon: %w", err)
		} else if muon, err = optim.SelectMuon(params, cfg.Params); err != nil {
			bad = fmt.Errorf("onebit: Muon: %w", err)
		}
	}
	if c != nil && c.Size() > 1 {
		extra := []uint64{uint64(cfg.FreezeStep), uint64(int64(cfg.BucketBytes)), uint64(cfg.StateMode), uint64(optim.HyperBool(cfg.MomentumBF16)),
			uint64(optim.HyperBool(cfg.WarmupAdamWOnly)), uint64(cfg.Exchange), uint64(max(cfg.OwnerBits, 1))}
		if err := optim.AgreeMuon(ctx, c, "onebit: Muon", params, muon, cfg.MuonConfig, extra, bad != nil); err != nil {
			return nil, errors.Join(bad, err)
		}
	}
	if bad != nil {
		return nil, bad
	}
	o := &Muon{
		cfg: cfg, params: slices.Clone(params), freeze: int64(cfg.FreezeStep), c2: 1,
		adam:  optim.NewGroupLR("AdamW group", "SetAdamLR", cfg.AdamLR, optim.FloatAdamLR, optim.IntAdamLRSchedule),
		bound: ratioBound(cfg.AdamBeta1, cfg.AdamBeta2),
		mom:   make([][]float32, len(params)), v: make([][]float32, len(params)),
		unit: make([]float32, len(params)),
	}
	multi := c != nil && c.Size() > 1
	compact := cfg.StateMode == StateCompact && multi
	o.mixed = cfg.WarmupAdamWOnly && multi
	owners := cfg.Exchange == ExchangeOwners && multi
	// The exchange's layout: the parameters in order or, with
	// WarmupAdamWOnly, the Muon group's first; cut is where the AdamW
	// group's begin (0 without WarmupAdamWOnly). A run on one rank
	// records it too, for the group that Regroup grows from its
	// checkpoint.
	order, cut := make([]int, 0, len(params)), 0
	if cfg.WarmupAdamWOnly {
		for i, p := range params {
			if muon[i] {
				order, cut = append(order, i), cut+p.Numel()
			}
		}
	}
	for i := range params {
		if !cfg.WarmupAdamWOnly || !muon[i] {
			order = append(order, i)
		}
	}
	sizes := make([]int, len(params))
	ordered := make([]*optim.Param, len(params))
	most := 0
	for k, i := range order {
		p := params[i]
		ordered[k], sizes[k] = p, p.Numel()
		o.unit[i] = 1
		if (compact || owners) && muon[i] {
			sizes[k], most = 0, max(most, p.Numel())
		}
	}
	var parts [][]float32
	o.flat, parts = flatten[float32](sizes)
	o.slot = make([][]float32, len(params))
	for k, i := range order {
		o.slot[i] = parts[k]
	}
	if compact || owners {
		o.scratch = make([]float32, most)
		if compact {
			o.step = make([]float32, len(params))
		}
		for i, p := range params {
			if muon[i] {
				o.slot[i] = o.scratch[:p.Numel():p.Numel()]
			}
		}
	}
	orth := map[[2]int]*optim.Orthogonalizer{}
	for i, p := range o.params {
		if !muon[i] {
			o.v[i] = make([]float32, p.Numel())
			o.aux, o.auxV = append(o.aux, i), append(o.auxV, o.v[i])
			continue
		}
		o.mom[i] = make([]float32, p.Numel())
		rows, cols := optim.MatrixView(p.Shape())
		mt := muonMatrix{
			i: i, rows: rows, cols: cols,
			scale: float32(math.Sqrt(max(1, float64(rows)/float64(cols)))),
			unit:  float32(math.Sqrt(float64(max(rows, cols)))),
		}
		if p.Numel() > 0 {
			key := [2]int{min(rows, cols), max(rows, cols)}
			if orth[key] == nil {
				orth[key] = optim.NewOrthogonalizer(rows, cols)
				o.orth = append(o.orth, orth[key])
			}
			mt.orth = orth[key]
		}
		o.mats = append(o.mats, mt)
	}
	averaged := o.params
	if o.mixed {
		averaged = ordered[len(o.mats):] // the AdamW group's
	}
	avg, err := optim.NewGradAverager(c, averaged, cfg.Reduce, cfg.RanksPerNode)
	if err != nil {
		return nil, fmt.Errorf("onebit: Muon: %w", err)
	}
	o.avg = avg
	start := optim.StageWarmup
	if o.freeze == 0 {
		start = optim.StageCompression
	}
	hypers := append(optim.MuonHypers(cfg.MuonConfig, muon), optim.Hyper{Name: "freeze_step", Value: float64(cfg.FreezeStep)})
	if cfg.WarmupAdamWOnly {
		hypers = append(hypers, optim.Hyper{Name: "warmup_adamw_only", Value: 1})
	}
	if cfg.Exchange == ExchangeOwners {
		hypers = append(hypers, optim.Hyper{Name: HyperOwners, Value: 1}, optim.Hyper{Name: HyperOwnerBits, Value: float64(max(cfg.OwnerBits, 1))})
	}
	o.f = optim.NewFrame(optim.FrameConfig{
		Name: "onebit: Muon", Algorithm: AlgorithmMuon, Comm: c, Params: o.params, Sizes: o.slot,
		LR: cfg.LR, Stage: start, Logger: optim.ApplyOptions(opts).Logger, Averager: avg,
		Hypers: hypers, Check: o.check,
	})
	bucketed := ordered
	if owners {
		// The buckets hold the AdamW group only: the Muon group travels
		// to and from its owners.
		bucketed, cut = nil, 0
		for k, i := range order {
			if !muon[i] {
				bucketed = append(bucketed, ordered[k])
			}
		}
		o.ow = newMuonOwners(o.mats, o.params, o.f.World(), o.f.Rank(), max(cfg.OwnerBits, 1))
	}
	if o.bkt, err = newCutBuckets(bucketed, o.f.World(), cfg.BucketBytes, false, cut); err != nil {
		avg.Close()
		return nil, fmt.Errorf("onebit: Muon: %w", err)
	}
	if compact {
		o.cm = newMuonCompact(o.params, order, o.bkt, cfg.MomentumBF16)
		if start == optim.StageCompression || o.mixed {
			o.cm.setCompressing(true, o.mom, nil)
		}
	}
	o.f.Handle(optim.StageWarmup, o.warmup)
	o.f.Handle(optim.StageCompression, o.compressed)
	o.late.stale = true
	return o, nil
}

// check is the frame's Check, run on this rank before the step's
// agreement, so that a refusal is an error on every rank with nothing
// changed: the AdamW group's scheduled learning rate must be usable, and
// this rank's momenta, which no other rank sees (each rank loads its own
// checkpoint), must be finite: in the compression stage the new ones, from
// this rank's gradient, in the warm-up the old ones (the new ones, from
// the averaged gradients, are checked after the averaging). A gradient
// that is not finite is left to the agreement, which skips the step.
func (o *Muon) check(t int64) error {
	if err := o.adam.Check(t); err != nil {
		return err
	}
	compressing := o.f.Stage() == optim.StageCompression
	local := compressing || o.mixed // each rank's own Muon momenta
	for _, mt := range o.mats {
		p, m := o.params[mt.i], o.mom[mt.i]
		if !local && !optim.Finite(m) {
			return fmt.Errorf("the momentum of %q is not finite on rank %d (a non-finite momentum loaded): nothing changed", p.Name, o.f.Rank())
		}
		finite := func() bool {
			if o.cm != nil && o.cm.mb != nil {
				return optim.MomentumFiniteBF16(o.cm.mb[mt.i], p.GradData(), o.cfg.Momentum)
			}
			return optim.MomentumFinite(m, p.GradData(), o.cfg.Momentum)
		}
		if local && !finite() && optim.Finite(p.GradData()) {
			return fmt.Errorf("the momentum of %q would not be finite on rank %d (a gradient near the float32 limit, or a non-finite momentum loaded): nothing changed", p.Name, o.f.Rank())
		}
	}
	if !compressing || o.f.World() == 1 {
		return nil
	}
	b1, a1 := o.cfg.AdamBeta1, optim.OneMinus(o.cfg.AdamBeta1)
	for _, i := range o.aux {
		p, m, k := o.params[i], o.slot[i], o.unit[i]
		g := p.GradData()[:len(m)]
		var s float32
		for j, mj := range m {
			s += float32((float32(b1*mj)+float32(a1*g[j]))*k) * 0
		}
		if s != s && optim.Finite(g) {
			return fmt.Errorf("the momentum of %q, scaled for the exchange, would not be finite on rank %d (a gradient far above the warm-up's, or a non-finite momentum loaded): nothing changed", p.Name, o.f.Rank())
		}
	}
	return nil
}

// Step applies one update; see optim.Optimizer. In the warm-up it
// overwrites the gradients with their average (with WarmupAdamWOnly the
// AdamW group's only); in the compression stage it leaves them alone.
func (o *Muon) Step(ctx context.Context) error { return o.f.Step(ctx) }

// warmup is exact Muon with its exact AdamW; after step FreezeStep it
// freezes the AdamW variance and enters the compression stage.
func (o *Muon) warmup(ctx context.Context, t int64, lr float32) error {
	if err := o.avg.Average(ctx); err != nil {
		return fmt.Errorf("averaging the gradients: %w", err)
	}
	cfg := o.cfg
	if o.mixed {
		if err := o.warmupMatrices(ctx, t, lr); err != nil {
			return err
		}
	} else {
		for _, mt := range o.mats {
			p := o.params[mt.i]
			if !optim.MomentumFinite(o.mom[mt.i], p.GradData(), cfg.Momentum) {
				return fmt.Errorf("the momentum of %q would not be finite (a gradient near the float32 limit, or a non-finite momentum loaded): nothing changed but the averaged gradients", p.Name)
			}
		}
		o.muonExact(lr)
	}
	c1, c2 := optim.BiasCorrection(cfg.AdamBeta1, t), optim.BiasCorrection(cfg.AdamBeta2, t)
	alr := o.adam.At(t)
	for _, i := range o.aux {
		p := o.params[i]
		optim.AdamStep(p.Data(), o.slot[i], o.v[i], p.GradData(), cfg.AdamBeta1, cfg.AdamBeta2, alr, cfg.AdamWeightDecay, c1, c2, cfg.AdamEps)
	}
	if t >= o.freeze {
		if o.ow != nil && !o.mixed {
			o.ow.sync(o.mats, o.mom)
		}
		o.c2 = c2
		o.setUnits()
		if o.cm != nil && !o.mixed {
			o.cm.setCompressing(true, o.mom, nil)
		}
		o.f.Enter(optim.StageCompression)
		o.late.stale = true
	}
	return nil
}

// muonExact is exact Muon's step of every matrix from the gradients as
// they are (averaged in the warm-up, this rank's own on one rank), the
// orthogonalized update passing through the matrix's slot.
func (o *Muon) muonExact(lr float32) {
	cfg := o.cfg
	decay := float32(1 - float64(lr)*float64(cfg.WeightDecay))
	for _, mt := range o.mats {
		p := o.params[mt.i]
		optim.Momentum(o.mom[mt.i], p.GradData(), cfg.Momentum)
		if mt.orth == nil {
			continue
		}
		mt.orth.Orthogonalize(o.slot[mt.i], o.mom[mt.i], p.GradData(), mt.rows, mt.cols, cfg.MuonConfig, 1)
		descend(p.Data(), o.slot[mt.i], decay, float32(float64(lr)*float64(mt.scale)))
	}
}

// descend applies p = p*decay - step*u, each product rounded to float32
// (optim.Muon's rounding).
func descend(p, u []float32, decay, step float32) {
	u = u[:len(p)]
	for k, x := range u {
		p[k] = float32(p[k]*decay) - float32(step*x)
	}
}

// setUnits sets every AdamW parameter's k_p from its frozen variance: 1
// over the root mean square of v*c2, summed in float64 and rounded once;
// 1 where that is 0 or not a finite float32. An element whose v is the
// mark of one first given gradient in the compression stage (vMark, see
// unseen) counts as 0, as it did when the variance froze, so that a
// resumed run scales as the run that was not interrupted.
func (o *Muon) setUnits() {
	for _, i := range o.aux {
		o.unit[i] = 1
		if len(o.v[i]) == 0 {
			continue
		}
		var s float64
		for _, x := range o.v[i] {
			if x != vMark {
				s += float64(x) * float64(o.c2)
			}
		}
		k := float32(1 / math.Sqrt(s/float64(len(o.v[i]))))
		if k > 0 && !math.IsInf(float64(k), 0) {
			o.unit[i] = k
		}
	}
}

// compressed is a compression-stage step: this rank's momenta,
// orthogonalized for the matrices, through the 1-bit exchange, then the
// same update on every rank. An element of the AdamW group whose v is
// zero takes no step, and has its v marked at the end of the step if
// some rank gave it gradient (see unseen), as in 1-bit Adam.
func (o *Muon) compressed(ctx context.Context, t int64, lr float32) error {
	late := o.late.ready(o.f.World(), o.auxV...)
	if late {
		o.late.start()
		off := 0
		for k, i := range o.aux {
			o.late.pack(off, o.params[i].GradData()[:len(o.auxV[k])])
			off += len(o.auxV[k])
		}
		if err := o.late.exchange(ctx, o.f.Comm()); err != nil {
			return err
		}
	}
	alr := o.adam.At(t)
	var err error
	switch {
	case o.cm != nil:
		err = o.compressedCompact(ctx, t, lr, alr, true)
	default:
		err = o.compressedFull(ctx, t, lr, alr)
	}
	if err == nil && late {
		off := 0
		for _, v := range o.auxV {
			o.late.mark(off, v)
			off += len(v)
		}
		o.late.done()
	}
	return err
}

// compressedFull is compressed's step in StateFull (either exchange) and
// on one rank.
func (o *Muon) compressedFull(ctx context.Context, t int64, lr, alr float32) error {
	cfg := o.cfg
	c1 := optim.BiasCorrection(cfg.AdamBeta1, t)
	for _, i := range o.aux {
		optim.Momentum(o.slot[i], o.params[i].GradData(), cfg.AdamBeta1)
	}
	if o.f.World() == 1 {
		o.muonExact(lr)
	} else {
		// The Muon group through its owners (ExchangeOwners) or, its
		// updates in the buckets, through the 1-bit allreduce.
		if o.ow == nil {
			o.orthogonalizeOwn()
		} else if err := o.stepOwners(ctx, t, lr); err != nil {
			return err
		}
		for _, i := range o.aux {
			scaleBy(o.slot[i], o.unit[i])
		}
		if err := o.bkt.allReduce(ctx, o.f.Comm(), o.flat); err != nil {
			return fmt.Errorf("the exchange: %w", err)
		}
		if o.ow == nil {
			o.descendExchanged(lr)
		}
		for _, i := range o.aux {
			unscaleBy(o.slot[i], o.unit[i])
		}
	}
	for _, i := range o.aux {
		optim.AdamUpdateBounded(o.params[i].Data(), o.slot[i], o.v[i], alr, cfg.AdamWeightDecay, c1, o.c2, cfg.AdamEps, o.bound)
	}
	return nil
}

// warmupMatrices is the Muon group's step in the warm-up of
// WarmupAdamWOnly on more than one rank: the compression stage's, through
// the Muon group's buckets (the first bkt.split).
func (o *Muon) warmupMatrices(ctx context.Context, t int64, lr float32) error {
	if o.cm != nil {
		return o.compressedCompact(ctx, t, lr, 0, false)
	}
	if o.ow != nil {
		return o.stepOwners(ctx, t, lr)
	}
	o.orthogonalizeOwn()
	if err := o.bkt.allReduceFirst(ctx, o.f.Comm(), o.flat, o.bkt.split); err != nil {
		return fmt.Errorf("the exchange: %w", err)
	}
	o.descendExchanged(lr)
	return nil
}

// orthogonalizeOwn updates this rank's momentum of every matrix with its
// own gradient and puts the momentum orthogonalized, times the exchange's
// factor, into the matrix's slot (StateFull).
func (o *Muon) orthogonalizeOwn() {
	cfg := o.cfg
	for _, mt := range o.mats {
		p := o.params[mt.i]
		optim.Momentum(o.mom[mt.i], p.GradData(), cfg.Momentum)
		if mt.orth != nil {
			mt.orth.Orthogonalize(o.slot[mt.i], o.mom[mt.i], p.GradData(), mt.rows, mt.cols, cfg.MuonConfig, mt.unit)
		}
	}
}

// descendExchanged applies the exchange's average in every matrix's slot
// (StateFull): p = p*(1-lr*wd) - lr/sqrt(cols)*A.
func (o *Muon) descendExchanged(lr float32) {
	decay := float32(1 - float64(lr)*float64(o.cfg.WeightDecay))
	for _, mt := range o.mats {
		step := float32(float64(lr) / math.Sqrt(float64(mt.cols)))
		descend(o.params[mt.i].Data(), o.slot[mt.i], decay, step)
	}
}

// scaleBy multiplies x by k in place; unscaleBy divides it by k.
func scaleBy(x []float32, k float32) {
	if k == 1 {
		return
	}
	for j := range x {
		x[j] *= k
	}
}

func unscaleBy(x []float32, k float32) {
	if k == 1 {
		return
	}
	for j := range x {
		x[j] /= k
	}
}

// Params returns the parameters in construction order.
func (o *Muon) Params() []*optim.Param { return o.params }

// MuonParams returns the names of the parameters that Muon updates, in
// construction order; every other parameter is the auxiliary AdamW's.
func (o *Muon) MuonParams() []string {
	names := make([]string, len(o.mats))
	for k, mt := range o.mats {
		names[k] = o.params[mt.i].Name
	}
	return names
}

// Stats reports progress and traffic; Stage is the stage the next step
// runs in (StageWarmup or StageCompression).
func (o *Muon) Stats() optim.Stats { return o.f.Stats() }

// Stage is the stage the next step runs in.
func (o *Muon) Stage() optim.Stage { return o.f.Stage() }

// SetLR fixes the Muon group's learning rate of the following steps,
// replacing its schedule; see optim.LRSetter. The AdamW group's is set by
// SetAdamLR.
func (o *Muon) SetLR(lr float32) error { return o.f.SetLR(lr) }

// SetSchedule makes s choose the Muon group's learning rate of every
// following step (nil: back to the fixed one); see optim.LRSetter.
func (o *Muon) SetSchedule(s optim.Schedule) error { return o.f.SetSchedule(s) }

// LR returns the Muon group's learning rate of the next step.
func (o *Muon) LR() float32 { return o.f.LR() }

// SetAdamLR fixes the AdamW group's learning rate of the following steps,
// replacing its schedule, as SetLR does for the Muon group.
func (o *Muon) SetAdamLR(lr float32) error {
	if err := o.adam.Set(lr); err != nil {
		return fmt.Errorf("onebit: Muon: %w", err)
	}
	return nil
}

// SetAdamSchedule makes s choose the AdamW group's learning rate of every
// following step (nil: back to the fixed one), as SetSchedule does for
// the Muon group.
func (o *Muon) SetAdamSchedule(s optim.Schedule) error {
	if err := o.adam.SetSchedule(s, o.f.Applied()+1); err != nil {
		return fmt.Errorf("onebit: Muon: %w", err)
	}
	return nil
}

// AdamLR returns the AdamW group's learning rate of the next step.
func (o *Muon) AdamLR() float32 { return o.adam.At(o.f.Applied() + 1) }

// CarryFlags makes every following Step carry sf in its per-step
// agreement; see optim.FlagCarrier.
func (o *Muon) CarryFlags(sf *optim.StepFlags) error { return o.f.CarryFlags(sf) }

// State returns this rank's checkpoint: the parameters, this rank's
// momentum of each matrix (optim.MomentumBufferPrefix), the AdamW group's
// moments, the step counters, the stage, the frozen bias correction of
// the AdamW variance, both groups' learning-rate state and, on more than
// one rank, the bucket layout and this rank's worker and server errors of
// every bucket. In the compression stage the momenta differ from rank to
// rank.
func (o *Muon) State() (*optim.Checkpoint, error) {
	ck := o.f.Checkpoint()
	ck.Floats[FloatFrozenBiasCorrection2] = float64(o.c2)
	o.adam.Save(ck)
	saveMuonMode(ck, o.cfg)
	mom := o.mom
	var we [][]float32
	if o.cm != nil {
		mom, we = o.cm.momenta(o.mom), o.cm.workerErrors()
	}
	for i, p := range o.params {
		shape := p.Shape()
		ck.AddTensor(optim.ParamTensorName(p.Name), shape, p.Data())
		if o.v[i] == nil {
			ck.AddTensor(optim.MomentumBufferPrefix+p.Name, shape, mom[i])
			continue
		}
		ck.AddTensor(optim.ExpAvgPrefix+p.Name, shape, o.slot[i])
		ck.AddTensor(optim.ExpAvgSqPrefix+p.Name, shape, o.v[i])
	}
	o.ow.each(o.mats, o.params, func(name string, shape []int, buf []float32) { ck.AddTensor(name, shape, buf) })
	o.bkt.save(ck, we, nil)
	return ck, nil
}

// Load restores a checkpoint made by State of a 1-bit Muon on the same
// world size, rank, parameters, selection of Muon parameters and
// hyperparameters; anything else, another optimizer's checkpoint
// included, is refused with an error wrapping
// optim.ErrIncompatibleCheckpoint, and nothing changes. Each group's
// learning rate follows optim.Frame.CheckLoad's rule: a fixed learning
// rate in ck replaces the optimizer's, with a warning in the log when
// they differ; call SetLR (the Muon group's) or SetAdamLR (the AdamW
// group's) after Load to resume with another.
//
// A checkpoint whose error buffers were reset on request
// (optim.Checkpoint.ResetErrors) loads on any world size and rank: the
// error buffers start at zero, and Load logs a warning that says so. The
// momenta are not error buffers: they stay in it, so a rank that loads
// another rank's reset checkpoint continues from that rank's momenta (in
// the compression stage, one rank's average of its own gradients; use
// Regroup to start every rank from their mean instead). A checkpoint made
// with another BucketBytes is refused unless its errors were reset.
func (o *Muon) Load(ck *optim.Checkpoint) error {
	fs, err := o.f.CheckLoad(ck, optim.StageWarmup, optim.StageCompression)
	if err != nil {
		return fmt.Errorf("onebit: Muon: %w", err)
	}
	if o.f.World() > 1 && ck.Rank != o.f.Rank() && !ck.ErrorsReset {
		return fmt.Errorf("onebit: Muon: %w: made by rank %d, this is rank %d (the momenta and error buffers are per rank: load this rank's own checkpoint, or onebit.Regroup of every rank's, which keeps the error feedback and takes the momenta's mean; ck.ResetErrors() is the lossy way, the error feedback restarting from zero and the momenta that rank's)",
			optim.ErrIncompatibleCheckpoint, ck.Rank, o.f.Rank())
	}
	if err := checkMuonMode(ck, o.cfg); err != nil {
		return fmt.Errorf("onebit: Muon: %w", err)
	}
	if o.cfg.Exchange == ExchangeOwners && !isOwners(ck) {
		return fmt.Errorf("onebit: Muon: %w: made with the polar exchange, this optimizer has the owners' (MuonConfig.Exchange): their states differ; resume with ExchangePolar",
			optim.ErrIncompatibleCheckpoint)
	}
	if err := o.bkt.check(ck); err != nil {
		return fmt.Errorf("onebit: Muon: %w", err)
	}
	c2, err := ck.Float(FloatFrozenBiasCorrection2)
	if err != nil {
		return fmt.Errorf("onebit: Muon: %w", err)
	}
	if float64(float32(c2)) != c2 || math.IsNaN(c2) || math.IsInf(c2, 0) {
		return fmt.Errorf("onebit: Muon: %w: frozen bias correction %v is not a finite float32", optim.ErrIncompatibleCheckpoint, c2)
	}
	applyALR, err := o.adam.CheckLoad(ck)
	if err != nil {
		return fmt.Errorf("onebit: Muon: %w", err)
	}
	rs := ck.Restore()
	mom := o.mom
	var we [][]float32
	if o.cm != nil {
		// Staged in float32, laid out for ck's stage once it all loaded.
		mom = make([][]float32, len(o.params))
		for _, mt := range o.mats {
			mom[mt.i] = make([]float32, o.params[mt.i].Numel())
		}
		if !ck.ErrorsReset {
			_, we = flatten[float32](o.cm.padded)
		}
	}
	for i, p := range o.params {
		rs.Tensor(optim.ParamTensorName(p.Name), p.Data())
		if o.v[i] == nil {
			rs.Tensor(optim.MomentumBufferPrefix+p.Name, mom[i])
			continue
		}
		rs.Tensor(optim.ExpAvgPrefix+p.Name, o.slot[i])
		rs.Tensor(optim.ExpAvgSqPrefix+p.Name, o.v[i])
	}
	o.ow.each(o.mats, o.params, func(name string, _ []int, buf []float32) { rs.Tensor(name, buf) })
	o.restoreErrors(ck, rs, we)
	if err := rs.Apply(); err != nil {
		return fmt.Errorf("onebit: Muon: %w", err)
	}
	if ck.ErrorsReset {
		o.bkt.reset()
		warnErrorsReset(o.f.Logger(), ck, o.f.World(), o.f.Rank())
	}
	if o.cm != nil {
		o.mom = mom
		o.cm.setCompressing(fs.Stage == optim.StageCompression || o.mixed, o.mom, we)
	}
	o.c2 = float32(c2)
	o.late.stale = true
	for i := range o.unit {
		o.unit[i] = 1
	}
	if fs.Stage == optim.StageCompression {
		o.setUnits()
	}
	o.f.Restore(fs)
	applyALR(o.f.Logger(), AlgorithmMuon)
	return nil
}

// StateBytes returns the bytes of every buffer o allocated and keeps (see
// optim.MemoryReporter): this rank's momentum of each matrix (4 bytes per
// element), the exchange buffer (4 per element of every parameter: the
// AdamW group's m, the matrices' outgoing updates), the AdamW variance (4
// per element of its group), the Newton-Schulz work matrices (one set per
// matrix shape, see optim.Orthogonalizer), every bucket's State (worker
// error 4 and server error 4/W per element, padded, and the wire buffers
// the buckets share) and the gradient averager's buffers. On 4 ranks that
// is 13 bytes and the wire buffers' 0.25 per element of a Muon matrix,
// besides the work matrices (docs/muon.md). In StateCompact, on more than
// one rank: the exchange buffer holds the AdamW group's m only, the worker
// errors are bfloat16 (2 per padded element, made at the end of the
// warm-up, or from the start with WarmupAdamWOnly), the momenta bfloat16
// from then on with MomentumBF16, plus a
// scratch matrix as long as the largest, a step per parameter and a block
// of 4Ki floats: 7 bytes per element of a Muon matrix on 4 ranks, 5 with
// MomentumBF16. The figure is the layout of the stage o is in.
func (o *Muon) StateBytes() int64 {
	n := optim.Float32Bytes(o.mom...) + optim.Float32Bytes(o.flat) + optim.Float32Bytes(o.v...) + optim.Float32Bytes(o.unit)
	n += optim.Float32Bytes(o.scratch, o.step)
	for _, w := range o.orth {
		n += w.StateBytes()
	}
	return n + o.bkt.stateBytes() + o.avg.StateBytes() + o.cm.stateBytes() + o.ow.stateBytes()
}

// restoreErrors stages the buckets' error buffers of ck for rs: as
// buckets.restore does, the worker errors into we in StateCompact (which
// narrows them into bfloat16 once they all loaded).
func (o *Muon) restoreErrors(ck *optim.Checkpoint, rs *optim.Restore, we [][]float32) {
	if o.cm == nil {
		o.bkt.restore(ck, rs)
		return
	}
	if ck.ErrorsReset {
		return
	}
	for k, st := range o.bkt.states {
		wn, sn := o.bkt.errorNames(k)
		rs.Tensor(wn, we[k])
		rs.Tensor(sn, st.ServerError)
	}
}

// Close releases the communicators that ReduceTwoLevel averaging split off
// the group (none in the other modes); see optim.Optimizer.Close: not a
// collective, idempotent, every rank calls it, Step fails after it.
func (o *Muon) Close() error {
	o.f.Close()
	return o.avg.Close()
}
