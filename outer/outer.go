package outer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/quant"
)

// AlgorithmPrefix starts the checkpoint algorithm name of an outer
// optimizer; the inner optimizer's algorithm follows ("outer-adam" for
// NewAdam).
const AlgorithmPrefix = "outer-"

// span is the part of one parameter that falls in a fragment.
type span struct {
	param int // index in params
	at    int // first element within the parameter
	flat  int // first element within the flat buffer
	n     int
}

// Optimizer is the DiLoCo-style outer optimizer: see the package doc.
// It implements optim.Optimizer. It is used by one goroutine at a time
// (it runs the exchange in flight on a goroutine of its own).
type Optimizer struct {
	cfg         Config
	c           comm.Comm
	xc          comm.Comm // the exchanges' communicator: c, or split off it (Delay > 0)
	split       bool      // xc was split off c: Close closes it
	async       bool      // exchanges run on a goroutine of their own while inner steps go on
	world, rank int
	inner       optim.Optimizer
	owned       bool // inner was made by NewAdam: Close closes it
	algorithm   string
	params      []*optim.Param
	sizes       []int
	n           int
	log         *zap.Logger

	bounds  []int    // fragment f is flat[bounds[f]:bounds[f+1]]
	offsets []int    // fragment f launches at calls t = offsets[f] (mod H)
	spans   [][]span // per fragment

	global []float32 // θ_g, flat
	mom    []float32 // u, flat; nil with Momentum 0 (u takes no part in the steps)
	// direct says that the codec forms the pseudo-gradients itself, a
	// bucket (CodecOneBit, in xb) or a chunk (CodecSparse) at a time,
	// from θ_g and the parameters (or snap): no buffer of a fragment's.
	direct bool
	// work is the exchange's buffer, as long as the largest fragment: the
	// pseudo-gradients of the codecs that average a whole fragment in
	// place (not direct), and the new u of the fragment in flight (Delay
	// > 0, Momentum > 0); nil otherwise.
	work []float32
	xb   []float32 // CodecOneBit: x of one bucket, as long as the largest
	snap []float32 // θ_local of the fragment in flight at its launch (Delay > 0)
	// stage receives the new θ_g of the fragment in flight (Delay > 0),
	// and work its new u: the exchange's goroutine writes nothing the
	// caller reads (Global, Momentum), and merge applies both.
	stage []float32

	down    *quant.DownCast
	i8      *int8Codec
	sp      *sparseCodec      // CodecSparse (W > 1)
	buckets [][]int           // CodecOneBit, per fragment: bucket k is frag[buckets[f][k]:buckets[f][k+1]]
	states  [][]*onebit.State // CodecOneBit, per fragment and bucket (W > 1)
	bbytes  int               // CodecOneBit bucket bytes in effect

	status, statuses []float32 // the agreement: status word, then the carried flags, per rank
	flags            *optim.StepFlags
	// quiet is set while flags are carried at the exchanges only
	// (CarryFlagsAtExchanges): no Step between exchanges communicates.
	quiet bool

	calls                    int64
	outerSteps, outerSkipped int64
	pending                  int   // fragment launched and not merged yet; -1 none
	launchedAt               int64 // the call that launched pending
	inFlight                 bool  // the goroutine of pending is running or has not been waited for
	flight                   chan error
	// flightCtx is the optimizer's own context (Delay > 0), which the
	// exchanges in flight run on: not the launching Step's, which may
	// end as soon as that Step returns. Close cancels it.
	flightCtx  context.Context
	stopFlight context.CancelFunc
	flightFn   func()

	// broken is set by a failure: of this rank's Step, of another rank's
	// (heard at an agreement), or of an exchange. Every later Step fails at
	// once, without communicating, until Load.
	broken error
	closed bool

	innerBytes    int64
	bytes, last   int64
	xBytes        int64 // sent on a split-off xc by exchanges not yet counted in a Step
	flightBytes   int64 // sent on a split-off xc by the last exchange
	start         time.Time
	tInner, tExch time.Duration
}

var (
	_ optim.Optimizer   = (*Optimizer)(nil)
	_ optim.LRSetter    = (*Optimizer)(nil)
	_ optim.FlagCarrier = (*Optimizer)(nil)
)

// NewAdam returns an outer optimizer over params whose inner optimizer is
// AdamW with config inner (optim.NewAdam on no communicator: exact, local,
// each rank on its own gradients). Every rank of c calls it together; it
// communicates (see New). An invalid cfg or inner is refused with its
// Validate error on that rank, and with an error naming that rank on the
// others. inner.MomentsBF16 keeps the AdamW's moments in bfloat16, 4
// bytes per parameter less (docs/outer.md, "Memory"); DefaultAdamConfigFor
// gives the inner config that goes with DefaultConfigFor.
func NewAdam(ctx context.Context, c comm.Comm, params []*optim.Param, cfg Config, inner optim.AdamConfig, opts ...optim.Option) (*Optimizer, error) {
	return newOwned(ctx, c, cfg, opts, func() (optim.Optimizer, error) {
		return optim.NewAdam(ctx, nil, params, inner, opts...)
	})
}

// NewMuon returns an outer optimizer over params whose inner optimizer is
// exact Muon with its auxiliary AdamW, config inner (optim.NewMuon on no
// communicator: local, each rank orthogonalizes the momentum of its own
// gradients), MuLoCo's setting. Every rank of c calls it together; it
// communicates (see New). An invalid cfg or inner, or parameters inner
// cannot take (a parameter marked for Muon that is not a matrix, a
// selection with no Muon parameter), is refused with its error on that
// rank, and with an error naming that rank on the others. SetLR,
// SetSchedule and LR drive the Muon group's learning rate; the AdamW
// group's is the inner optimizer's (Inner().(*optim.Muon).SetAdamLR).
func NewMuon(ctx context.Context, c comm.Comm, params []*optim.Param, cfg Config, inner optim.MuonConfig, opts ...optim.Option) (*Optimizer, error) {
	return newOwned(ctx, c, cfg, opts, func() (optim.Optimizer, error) {
		return optim.NewMuon(ctx, nil, params, inner, opts...)
	})
}

// NewFrom returns an outer optimizer over the inner optimizer that build
// makes on this rank, which it owns: its Close closes it. It is New for
// an inner optimizer that NewAdam and NewMuon do not make (Muon over the
// transposes of a model's matrices, optim.Transposed: lbgomlx's
// NewOuterMuon), with their error handling: build runs only when cfg is
// valid, and a refusal of cfg or build's error is that rank's error and
// one naming it on the others. build's optimizer must be local, as New's
// inner. Every rank of c calls it together; it communicates (see New).
func NewFrom(ctx context.Context, c comm.Comm, cfg Config, build func() (optim.Optimizer, error), opts ...optim.Option) (*Optimizer, error) {
	if build == nil {
		build = func() (optim.Optimizer, error) { return nil, errors.New("outer: NewFrom: nil build") }
	}
	return newOwned(ctx, c, cfg, opts, build)
}

// newOwned returns an outer optimizer whose inner optimizer, made by
// build on this rank when cfg is valid, it owns (closes in Close).
func newOwned(ctx context.Context, c comm.Comm, cfg Config, opts []optim.Option, build func() (optim.Optimizer, error)) (*Optimizer, error) {
	local := cfg.Validate()
	var in optim.Optimizer
	if local == nil {
		switch in, local = build(); {
		case local != nil:
			in = nil // a constructor's typed nil
		case in == nil:
			local = errors.New("outer: nil inner optimizer")
		}
	}
	o, err := newOptimizer(ctx, c, in, cfg, opts, local)
	if err != nil {
		if in != nil {
			in.Close()
		}
		return nil, err
	}
	o.owned = true
	return o, nil
}

// errSparseMuon is the refusal of CodecSparse around Muon
// (Config.SparseWithMuon).
func errSparseMuon() error {
	return errors.New("outer: the sparse codec with Muon inside does not suit it: on the GPT example it ended at loss 2.8583 " +
		"against the 1-bit codec's 2.6017 (docs/outer.md, \"The tighter target\"); take CodecOneBit (DefaultConfigFor(CodecOneBit)), " +
		"or set Config.SparseWithMuon to insist")
}

// isMuon reports whether in is optim.Muon, directly or through
// optim.Transposed.
func isMuon(in optim.Optimizer) bool {
	for {
		switch x := in.(type) {
		case *optim.Muon:
			return true
		case *optim.Transposed:
			in = x.Inner()
		default:
			return false
		}
	}
}

// New returns an outer optimizer wrapping inner, whose Params are the
// parameters. inner must be local: made on no communicator or a one-rank
// one (its checkpoint's World is 1), and it must not communicate in Step
// (a Step in which its Stats().BytesSent grows fails). New does not close
// inner: its caller does, after the outer optimizer's Close.
//
// Every rank of c (nil: one process) calls it together. It communicates:
// one all-gather in which the ranks agree on the config and the number of
// parameter elements (a rank with an invalid config or an unusable inner
// optimizer refuses there, so that every rank returns an error: its own
// on that rank, one naming it on the others), then a broadcast of rank
// 0's parameter values into every rank's parameters, so that every rank
// starts from the same global parameters θ_g. Options: optim.WithLogger.
func New(ctx context.Context, c comm.Comm, inner optim.Optimizer, cfg Config, opts ...optim.Option) (*Optimizer, error) {
	var local error
	if err := cfg.Validate(); err != nil {
		local = err
	}
	if local == nil && inner == nil {
		local = errors.New("outer: nil inner optimizer")
	}
	return newOptimizer(ctx, c, inner, cfg, opts, local)
}

func newOptimizer(ctx context.Context, c comm.Comm, inner optim.Optimizer, cfg Config, opts []optim.Option, local error) (*Optimizer, error) {
	o := &Optimizer{cfg: cfg, c: c, world: 1, inner: inner, pending: -1, log: optim.ApplyOptions(opts).Logger}
	if c != nil {
		o.world, o.rank = c.Size(), c.Rank()
	}
	if local == nil && cfg.Codec == CodecSparse && !cfg.SparseWithMuon && isMuon(inner) {
		local = errSparseMuon()
	}
	if local == nil {
		local = o.build()
	}
	if err := o.agreeConfig(ctx, local); err != nil {
		return nil, err
	}
	o.xc = c
	if o.world > 1 {
		if err := o.c.Broadcast(ctx, o.global, 0); err != nil {
			return nil, fmt.Errorf("outer: New: broadcasting rank 0's parameters: %w", err)
		}
		for f := range o.spans {
			o.resetLocal(f)
		}
		if cfg.Delay > 0 {
			// The exchange in flight must not share a communicator with
			// the caller's collectives between Steps.
			xc, err := c.Split(ctx, 0, o.rank)
			if err != nil {
				return nil, fmt.Errorf("outer: New: splitting the exchanges' communicator: %w", err)
			}
			o.xc, o.split = xc, true
			o.async = comm.CanOverlap(c, xc)
			// The exchanges in flight outlive the Step that launches them:
			// they run on a context of the optimizer's own (the values of
			// New's, not its deadline or cancellation).
			o.flightCtx, o.stopFlight = context.WithCancel(context.WithoutCancel(ctx))
			if !o.async {
				o.log.Info("the communicator cannot run collectives concurrently: delayed exchanges run at their launch, merged after the delay (same results, no overlap)")
			}
		}
	}
	o.innerBytes = o.inner.Stats().BytesSent
	o.start = time.Now()
	return o, nil
}

// build checks inner and makes every buffer; errors carry the package
// prefix.
func (o *Optimizer) build() error {
	ick, err := o.inner.State()
	if err != nil {
		return fmt.Errorf("outer: inner optimizer's state: %w", err)
	}
	if ick.World != 1 {
		return fmt.Errorf("outer: the inner optimizer runs on %d ranks: it must be local (made on no communicator or a one-rank one), the outer optimizer does the communication", ick.World)
	}
	o.algorithm = AlgorithmPrefix + ick.Algorithm
	o.params = slices.Clone(o.inner.Params())
	if err := optim.CheckParams(o.params); err != nil {
		return fmt.Errorf("outer: %w", err)
	}
	for _, p := range o.params {
		o.sizes = append(o.sizes, p.Numel())
		o.n += p.Numel()
	}
	cfg := o.cfg
	if cfg.Fragments > o.n {
		return fmt.Errorf("outer: %d fragments of %d parameter elements: want at most one fragment per element", cfg.Fragments, o.n)
	}
	F := cfg.Fragments
	o.bounds = make([]int, F+1)
	o.offsets = make([]int, F)
	for f := range F + 1 {
		o.bounds[f] = int(int64(f) * int64(o.n) / int64(F))
	}
	for f := range F {
		o.offsets[f] = int(int64(f) * int64(cfg.H) / int64(F))
	}
	largest := 0
	o.spans = make([][]span, F)
	for f := range F {
		lo, hi := o.bounds[f], o.bounds[f+1]
		largest = max(largest, hi-lo)
		off := 0
		for i, sz := range o.sizes {
			a, b := max(lo, off), min(hi, off+sz)
			if a < b {
				o.spans[f] = append(o.spans[f], span{param: i, at: a - off, flat: a, n: b - a})
			}
			off += sz
		}
	}
	o.global = make([]float32, o.n)
	if cfg.Momentum != 0 {
		o.mom = make([]float32, o.n)
	}
	o.direct = cfg.Codec == CodecOneBit || cfg.Codec == CodecSparse && o.world > 1
	if !o.direct || cfg.Delay > 0 && o.mom != nil {
		o.work = make([]float32, largest)
	}
	if cfg.Delay > 0 {
		o.snap = make([]float32, largest)
		o.stage = make([]float32, largest)
		o.flight = make(chan error, 1)
		o.flightFn = func() { o.flight <- o.exchange(o.flightCtx, o.pending) }
	}
	for _, sp := range o.spans {
		for _, s := range sp {
			copy(o.global[s.flat:s.flat+s.n], o.params[s.param].Data()[s.at:s.at+s.n])
		}
	}
	o.status, o.statuses = make([]float32, 1), make([]float32, o.world)
	if o.world > 1 {
		switch cfg.Codec {
		case CodecBF16:
			o.down = quant.NewDownCast(quant.BF16)
		case CodecInt8:
			o.i8 = newInt8Codec(largest, o.world)
		case CodecOneBit:
			if err := o.makeBuckets(); err != nil {
				return err
			}
		case CodecSparse:
			smallest := o.n
			for f := range F {
				smallest = min(smallest, o.bounds[f+1]-o.bounds[f])
			}
			if cfg.SparseChunk > smallest {
				return fmt.Errorf("outer: sparse chunks of %d elements, but a fragment has %d: want SparseChunk at most the smallest fragment", cfg.SparseChunk, smallest)
			}
			o.sp = newSparseCodec(cfg, o.n, largest, o.world)
			if cfg.SparseExchange != SparseAllGather {
				o.sp.setServer(o.bounds, o.world, o.rank)
			}
		}
	}
	if cfg.Codec == CodecOneBit {
		// x of one bucket (one rank: of a fragment, its only bucket).
		per := largest
		if o.world > 1 {
			per = min(per, max(o.bbytes/4, 1))
		}
		o.xb = make([]float32, per)
	}
	return nil
}

// makeBuckets cuts every fragment into buckets of BucketBytes and makes
// their 1-bit states.
func (o *Optimizer) makeBuckets() error {
	o.bbytes = o.cfg.BucketBytes
	if o.bbytes == 0 {
		o.bbytes = optim.DefaultBucketBytes
	}
	per := max(o.bbytes/4, 1)
	o.buckets = make([][]int, o.cfg.Fragments)
	o.states = make([][]*onebit.State, o.cfg.Fragments)
	for f := range o.cfg.Fragments {
		m := o.bounds[f+1] - o.bounds[f]
		for lo := 0; lo < m; lo += per {
			st, err := onebit.NewState(min(lo+per, m)-lo, o.world)
			if err != nil {
				return fmt.Errorf("outer: %w", err)
			}
			st.SetScale(o.cfg.Scale)
			o.buckets[f] = append(o.buckets[f], lo)
			o.states[f] = append(o.states[f], st)
		}
		o.buckets[f] = append(o.buckets[f], m)
	}
	// The buckets' allreduces run one after another (one exchange at a
	// time, bucket by bucket): one set of wire buffers serves them all.
	onebit.ShareWire(slices.Concat(o.states...)...)
	return nil
}

// Params returns the parameters (the inner optimizer's), in order.
func (o *Optimizer) Params() []*optim.Param { return o.params }

// Inner returns the inner optimizer (to set its learning rate, say). Do
// not Step or Load it directly.
func (o *Optimizer) Inner() optim.Optimizer { return o.inner }

// Config returns the optimizer's config.
func (o *Optimizer) Config() Config { return o.cfg }

// Global returns the global parameters θ_g, flat (every parameter's
// elements in order), identical on every rank: the parameters to evaluate
// between exchanges, when each rank's own differ. The slice is the
// optimizer's own: read it between Steps, never write it. An exchange in
// flight does not touch it (its merge does).
func (o *Optimizer) Global() []float32 { return o.global }

// Momentum returns the outer momentum u, flat, like Global; nil when
// Config.Momentum is 0: u then takes no part in the steps, and is not
// kept (nor checkpointed).
func (o *Optimizer) Momentum() []float32 { return o.mom }

// Stats reports progress and traffic: Steps counts the Step calls (inner
// steps, skipped ones included; after a failure it is the same on every
// rank, the calls the group completed before the agreement that heard of
// it), Skipped the inner steps that the inner
// optimizer skipped on this rank (non-finite local gradient), Stage the
// inner optimizer's stage, and BytesSent what this rank sent on c in its
// exchanges.
func (o *Optimizer) Stats() optim.Stats {
	is := o.inner.Stats()
	return optim.Stats{Steps: o.calls, Skipped: is.Skipped, Stage: is.Stage, BytesSent: o.bytes + o.xBytes, LastStepBytes: o.last}
}

// OuterStats is what the outer part of an Optimizer has done since its
// construction (exchange counters since the run started: they are
// checkpointed; times since construction on this rank).
type OuterStats struct {
	// Exchanges counts the outer steps applied, one per fragment exchange.
	Exchanges int64
	// Skipped counts the exchanges skipped because some rank's
	// pseudo-gradient was not finite.
	Skipped int64
	// Inner is the time spent in the inner optimizer's steps, Exchange
	// the time Step spent blocked on communication (agreements,
	// synchronous exchanges, waiting for an exchange in flight at its
	// merge), Wall the time since construction.
	Inner, Exchange, Wall time.Duration
}

// Utilization is the compute utilization: the share of the wall time not
// spent blocked on communication, (Wall - Exchange) / Wall. The time
// between Step calls (the caller's forward and backward passes) counts as
// compute.
func (s OuterStats) Utilization() float64 {
	if s.Wall <= 0 {
		return 1
	}
	return float64(s.Wall-s.Exchange) / float64(s.Wall)
}

// OuterStats reports the outer counters and times.
func (o *Optimizer) OuterStats() OuterStats {
	return OuterStats{Exchanges: o.outerSteps, Skipped: o.outerSkipped, Inner: o.tInner, Exchange: o.tExch, Wall: time.Since(o.start)}
}

// launchAt returns the fragment whose exchange launches at call t, or -1.
func (o *Optimizer) launchAt(t int64) int {
	f, ok := slices.BinarySearch(o.offsets, int(t%int64(o.cfg.H)))
	if !ok {
		return -1
	}
	return f
}

// nextLaunch returns the first call >= t that launches an exchange.
func (o *Optimizer) nextLaunch(t int64) int64 {
	for o.launchAt(t) < 0 {
		t++
	}
	return t
}

// Step runs one inner step on this rank's gradients; at the calls where a
// fragment's exchange is due it also runs the exchange (see the package
// doc). Every rank calls it together, as with every optimizer, but only
// exchange calls communicate (and, while flags are carried with
// CarryFlags, every call; CarryFlagsAtExchanges carries them in the
// exchanges' agreements only).
//
// Contexts: ctx governs the collectives this Step runs itself: the carried
// flags' agreement, an exchange's agreement, and an exchange run within
// the Step (Delay 0, or a delayed exchange on a communicator that cannot
// overlap collectives, which runs at its launch). An exchange in flight
// (Delay > 0) runs, from its launch to its merge, on a context of the
// optimizer's own, which Close cancels (after waiting for it), not on the
// launching Step's ctx: ending a Step's ctx after the Step returned never
// touches it. The Step that merges it waits for it whatever its own ctx
// (as comm.Request.Wait does): the exchange needs no further call from the
// peers, so the wait ends when the exchange does, or when the backend
// reports a failure.
//
// Failures reach every rank, and every rank ends in the same state. A rank
// whose Step fails (its inner step fails, or it is closed, or its
// parameters changed size) tells the others at their next agreement, with
// a status of its own (not a refusal): without carried flags, the
// agreement of the next exchange (the failing Step waits for the exchange
// in flight, then for that agreement: at most H inner steps of the others'
// compute; so too with flags carried at the exchanges, where a Refuse is
// such a failure); with flags carried by CarryFlags, the agreement of this
// call's exchange if one launches now, otherwise the flags' agreement at
// the start of the next call (a rank that fails before its inner step,
// being closed or resized, tells them in this call's flags agreement). The failing rank
// returns its own error; every other rank's Step at that agreement
// returns an error naming it and the call it failed at ("rank 1 failed at
// step 6"). Nothing global (θ_g, u, error buffers) changes. From then on
// every rank is failed, with the same call count (Stats().Steps), and
// every later Step fails at once on every rank, without communicating, so
// that a loop that goes on calling Step after an error never blocks. The
// same holds after any error of an exchange (a communicator error) on the
// ranks that get it. Load a checkpoint to go on: Load clears the failure.
func (o *Optimizer) Step(ctx context.Context) error {
	if ctx == nil {
		ctx = context.Background()
	}
	before := optim.CommBytes(o.c)
	err := o.step(ctx)
	o.last = optim.CommBytes(o.c) - before + o.xBytes
	o.bytes += o.last
	o.xBytes = 0
	return err
}

func (o *Optimizer) step(ctx context.Context) error {
	t := o.calls + 1
	if o.broken != nil {
		return fmt.Errorf("outer: step %d: an earlier step failed (load a checkpoint to go on): %w", t, o.broken)
	}
	switch {
	case o.quiet && o.flags.Refuse != nil:
		// No agreement now: this rank cannot take the call, a failure
		// the others hear of at the next exchange's agreement.
		t1 := time.Now()
		err := o.tellFailure(ctx, t, fmt.Errorf("outer: step %d: this rank refused it: %w", t, o.flags.Refuse))
		o.tExch += time.Since(t1)
		return err
	case o.flags != nil && !o.quiet:
		if err := o.agreeFlags(ctx, t); err != nil {
			return err
		}
	}
	t0 := time.Now()
	failure := o.innerStep(ctx, t)
	t1 := time.Now()
	o.tInner += t1.Sub(t0)
	if failure != nil {
		err := o.tellFailure(ctx, t, failure)
		o.tExch += time.Since(t1)
		return err
	}
	o.calls = t
	defer func() { o.tExch += time.Since(t1) }()
	if o.pending >= 0 && t == o.launchedAt+int64(o.cfg.Delay) {
		if err := o.merge(); err != nil {
			o.broken = err
			return fmt.Errorf("outer: step %d: %w", t, err)
		}
	}
	if f := o.launchAt(t); f >= 0 {
		return o.launch(ctx, t, f)
	}
	return nil
}

// CarryFlags makes every following Step carry sf (optim.FlagCarrier); nil
// stops carrying. The outer optimizer has no per-step agreement of its
// own: while flags are carried this way every Step begins with one, before
// the inner step, an all-gather of a status word and the flags per rank
// (4(W-1)(1+len(sf.Local)) bytes sent, one latency-bound round), so that
// Refuse and Veto change nothing on any rank (a refusal stops one call;
// the run may go on), and so that a rank whose inner step fails is heard,
// as a failure that leaves every rank failed (see Step), at the next Step
// rather than at the next exchange. Without flags, or with flags carried
// at the exchanges only (CarryFlagsAtExchanges), the Steps between
// exchanges communicate nothing. Every rank calls it before the same Step,
// with flags of the same length. It communicates nothing.
func (o *Optimizer) CarryFlags(sf *optim.StepFlags) error {
	o.quiet = false
	return o.carry(sf)
}

// CarryFlagsAtExchanges makes every following Step carry sf in the
// agreements the exchanges run anyway, and nowhere else: the Steps between
// exchanges communicate nothing, as without flags (nil stops carrying).
// What the ranks run apart for, their inner steps, each decides on its own
// flags; what they share, the exchange, waits for every rank's:
//
//   - Refuse, at any call, is this rank's failure to take it: its inner
//     step does not run, and the call fails as a failing inner step does
//     (see Step): Step returns an error wrapping Refuse on this rank (its
//     Step waits for the others' next exchange), the others hear of it at
//     the next exchange's agreement (this call's, if it launches one) with
//     an error naming this rank and the call, and from there every rank is
//     failed, with the same Stats().Steps, until Load.
//   - Agreed is written at each exchange's agreement only (and at the
//     agreement that tells the others of a failure): the maximum over the
//     ranks of Local as set for that call. A flag raised between exchanges
//     reaches the other ranks only if it is still set at the next
//     exchange's call (a stop request stays set until it is acted on).
//   - Veto is called only at an exchange's call, after its agreement (the
//     inner steps of the call are taken on every rank, as at every call)
//     and before the exchange changes anything: Agreed is the same on every
//     rank, so a Veto decided from it alone stops the exchange on every
//     rank alike: θ_g, u and the codec's state do not change, every rank
//     keeps its own parameters (the fragment's next exchange carries the
//     progress of both periods), the call counts (Stats().Steps: the
//     exchanges' clock), and Step returns the Veto's error. To skip this
//     rank's own inner step at any call, give it a non-finite gradient:
//     every lowbit optimizer skips such a step, counted in Stats().Skipped,
//     and changes nothing.
//
// Every rank calls it before the same Step, with flags of the same length
// (a difference is an error of the next exchange's agreement). It
// communicates nothing.
func (o *Optimizer) CarryFlagsAtExchanges(sf *optim.StepFlags) error {
	o.quiet = sf != nil
	return o.carry(sf)
}

// carry sets the carried flags and sizes the agreement's buffers.
func (o *Optimizer) carry(sf *optim.StepFlags) error {
	n := 1
	if sf != nil {
		if len(sf.Agreed) != len(sf.Local) {
			sf.Agreed = make([]float32, len(sf.Local))
		}
		n += len(sf.Local)
	}
	o.status, o.statuses = make([]float32, n), make([]float32, n*o.world)
	o.flags = sf
	return nil
}

// SetLR fixes the inner optimizer's learning rate (optim.LRSetter); the
// outer learning rate is Config.LR. It fails when the inner optimizer is
// not an optim.LRSetter (NewAdam's is).
func (o *Optimizer) SetLR(lr float32) error {
	ls, err := o.innerLR()
	if err == nil {
		err = ls.SetLR(lr)
	}
	if err != nil {
		return fmt.Errorf("outer: inner optimizer: %w", err)
	}
	return nil
}

// SetSchedule sets the inner optimizer's schedule (optim.LRSetter),
// counted in inner steps; see SetLR.
func (o *Optimizer) SetSchedule(sched optim.Schedule) error {
	ls, err := o.innerLR()
	if err == nil {
		err = ls.SetSchedule(sched)
	}
	if err != nil {
		return fmt.Errorf("outer: inner optimizer: %w", err)
	}
	return nil
}

// LR returns the learning rate of the inner optimizer's next step (0 when
// it is not an optim.LRSetter).
func (o *Optimizer) LR() float32 {
	if ls, err := o.innerLR(); err == nil {
		return ls.LR()
	}
	return 0
}

func (o *Optimizer) innerLR() (optim.LRSetter, error) {
	ls, ok := o.inner.(optim.LRSetter)
	if !ok {
		return nil, fmt.Errorf("%T cannot change its learning rate (not an optim.LRSetter)", o.inner)
	}
	return ls, nil
}

// check is this rank's own checks before the inner step of call t.
func (o *Optimizer) check(t int64) error {
	if o.closed {
		return fmt.Errorf("outer: step %d: %w", t, optim.ErrClosed)
	}
	for i, p := range o.params {
		if len(p.Data()) != o.sizes[i] || len(p.GradData()) != o.sizes[i] {
			return fmt.Errorf("outer: step %d: parameter %q: value or gradient no longer holds the %d elements it had at construction", t, p.Name, o.sizes[i])
		}
	}
	return nil
}

// innerStep runs this rank's checks and inner step of call t.
func (o *Optimizer) innerStep(ctx context.Context, t int64) error {
	if err := o.check(t); err != nil {
		return err
	}
	if err := o.inner.Step(ctx); err != nil {
		return fmt.Errorf("outer: step %d: inner step: %w", t, err)
	}
	if b := o.inner.Stats().BytesSent; b != o.innerBytes {
		o.innerBytes = b
		return fmt.Errorf("outer: step %d: the inner optimizer communicated: it must be local (made on no communicator or a one-rank one)", t)
	}
	return nil
}

// Close waits for the exchange in flight, if any (every rank launched it
// together, and it completes without any further call from the peers),
// cancels the optimizer's own context (the one exchanges in flight run
// on), and closes the inner optimizer when NewAdam made it. It
// communicates nothing and is idempotent; a Step after it fails, and the
// other ranks hear of it at their next agreement (see Step). Params, Stats
// and State still work.
func (o *Optimizer) Close() error {
	if o.closed {
		return nil
	}
	o.closed = true
	o.settle()
	if o.calls > 0 && o.outerSteps == 0 && o.outerSkipped == 0 && o.broken == nil {
		o.log.Warn("outer: closed after inner steps and no exchange: the global parameters (Global) are the initial ones",
			zap.Int64("inner_steps", o.calls), zap.Int("first_merge_step", o.cfg.FirstMerge()), zap.Int("h", o.cfg.H))
	}
	if o.stopFlight != nil {
		o.stopFlight() // nothing is in flight now
	}
	var errs []error
	if o.split {
		errs = append(errs, o.xc.Close())
	}
	if o.owned {
		errs = append(errs, o.inner.Close())
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("outer: close: %w", err)
	}
	return nil
}
