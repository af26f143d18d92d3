package outer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
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

// The status words of an exchange's agreement.
const (
	statusOK        = 0
	statusNonFinite = 1 // this rank's pseudo-gradient holds a NaN or Inf
	statusRefused   = 2 // this rank failed since the last exchange
)

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

	global, mom []float32 // θ_g and u, flat
	work        []float32 // the exchange's buffer, as long as the largest fragment
	snap        []float32 // θ_local of the fragment in flight at its launch (Delay > 0)
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

	calls                    int64
	outerSteps, outerSkipped int64
	pending                  int   // fragment launched and not merged yet; -1 none
	launchedAt               int64 // the call that launched pending
	inFlight                 bool  // the goroutine of pending is running or has not been waited for
	flight                   chan error
	flightCtx                context.Context
	flightFn                 func()

	broken error // set by a failed exchange: every later Step fails until Load
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
// others.
func NewAdam(ctx context.Context, c comm.Comm, params []*optim.Param, cfg Config, inner optim.AdamConfig, opts ...optim.Option) (*Optimizer, error) {
	var local error
	if err := cfg.Validate(); err != nil {
		local = err
	}
	var in optim.Optimizer
	if local == nil {
		a, err := optim.NewAdam(ctx, nil, params, inner, opts...)
		if err != nil {
			local = err
		} else {
			in = a
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
	o.mom = make([]float32, o.n)
	o.work = make([]float32, largest)
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
		}
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
	return nil
}

// agreeConfig is the constructor's agreement: every rank's refusal flag
// and settings, all-gathered; the first rank that refused or whose
// settings differ from rank 0's is named on every other rank.
func (o *Optimizer) agreeConfig(ctx context.Context, local error) error {
	cfg := o.cfg
	vals := []int64{0, int64(cfg.H), int64(cfg.Fragments), int64(cfg.Delay), int64(cfg.Codec), int64(o.n),
		int64(cfg.BucketBytes), int64(optim.HyperBool(cfg.Nesterov)), int64(math.Float32bits(cfg.LR)), int64(math.Float32bits(cfg.Momentum)), int64(cfg.Scale),
		0, 0, 0, 0}
	if cfg.Codec == CodecSparse {
		copy(vals[11:], []int64{int64(math.Float32bits(cfg.Density)), int64(cfg.SparseChunk), int64(cfg.SparseBits), int64(math.Float32bits(cfg.Decay))})
	}
	names := []string{"", "H", "Fragments", "Delay", "Codec", "parameter elements", "BucketBytes", "Nesterov", "LR bits", "Momentum bits", "Scale",
		"Density bits", "SparseChunk", "SparseBits", "Decay bits"}
	if local != nil {
		vals[0] = 1
	}
	if o.world == 1 {
		return local
	}
	send := make([]byte, 8*len(vals))
	for i, v := range vals {
		binary.LittleEndian.PutUint64(send[8*i:], uint64(v))
	}
	recv := make([]byte, len(send)*o.world)
	if err := o.c.AllGatherBytes(ctx, send, recv); err != nil {
		if local != nil {
			return errors.Join(local, fmt.Errorf("outer: New: telling the other ranks: %w", err))
		}
		return fmt.Errorf("outer: New: agreeing on the settings: %w", err)
	}
	if local != nil {
		return local
	}
	get := func(r, i int) int64 { return int64(binary.LittleEndian.Uint64(recv[len(send)*r+8*i:])) }
	for r := range o.world {
		if get(r, 0) != 0 {
			return fmt.Errorf("outer: New: rank %d refused (its error says why)", r)
		}
	}
	for r := 1; r < o.world; r++ {
		for i := 1; i < len(vals); i++ {
			if get(r, i) != get(0, i) {
				return fmt.Errorf("outer: New: rank %d has %s %d, rank 0 has %d: every rank must use the same settings and parameters",
					r, names[i], get(r, i), get(0, i))
			}
		}
	}
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

// Momentum returns the outer momentum u, flat, like Global.
func (o *Optimizer) Momentum() []float32 { return o.mom }

// Stats reports progress and traffic: Steps counts the Step calls (inner
// steps, skipped ones included), Skipped the inner steps that the inner
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
// exchange calls communicate.
//
// A rank whose inner step fails (or that is closed, or whose parameters
// changed size) does not return at once: it waits for the exchange in
// flight, then takes part in the agreement of the next exchange, refusing
// it, and returns its own error; every other rank's Step at that exchange
// returns an error naming it. Nothing global (θ_g, u, error buffers)
// changes. After such an error, or any error of an exchange, every later
// Step fails: Load a checkpoint to go on.
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
		return fmt.Errorf("outer: step %d: an earlier exchange failed (load a checkpoint to go on): %w", t, o.broken)
	}
	if o.flags != nil {
		if err := o.agreeFlags(ctx, t); err != nil {
			return err
		}
	}
	t0 := time.Now()
	failure := o.innerStep(ctx, t)
	t1 := time.Now()
	o.tInner += t1.Sub(t0)
	if failure != nil {
		err := o.refuse(ctx, t, failure)
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

// agreeFlags is the per-step agreement of the carried flags, before
// anything of call t changes: a rank's Refuse, then the Veto, stop the
// call on every rank with nothing changed.
func (o *Optimizer) agreeFlags(ctx context.Context, t int64) error {
	sf := o.flags
	status := float32(statusOK)
	if sf.Refuse != nil {
		status = statusRefused
	}
	start := time.Now()
	by, _, err := o.agree(ctx, status)
	o.tExch += time.Since(start)
	switch {
	case err != nil && sf.Refuse != nil:
		return errors.Join(sf.Refuse, fmt.Errorf("outer: step %d: telling the other ranks: %w", t, err))
	case err != nil:
		return fmt.Errorf("outer: step %d: %w", t, err)
	case sf.Refuse != nil:
		return sf.Refuse
	case by >= 0:
		return fmt.Errorf("outer: step %d: rank %d refused it (its error says why); nothing changed", t, by)
	case sf.Veto != nil:
		return sf.Veto(sf.Agreed)
	}
	return nil
}

// CarryFlags makes every following Step carry sf (optim.FlagCarrier); nil
// stops carrying. The outer optimizer has no per-step agreement of its
// own: while flags are carried every Step begins with one, before the
// inner step, an all-gather of a status word and the flags per rank
// (4(W-1)(1+len(sf.Local)) bytes sent, one latency-bound round), so that
// Refuse and Veto change nothing on any rank, and so that a rank whose
// inner step fails is heard at the next Step rather than at the next
// exchange. Without flags the Steps between exchanges communicate
// nothing. Every rank calls it before the same Step, with flags of the
// same length. It communicates nothing.
func (o *Optimizer) CarryFlags(sf *optim.StepFlags) error {
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

// innerStep runs this rank's checks and inner step of call t.
func (o *Optimizer) innerStep(ctx context.Context, t int64) error {
	if o.closed {
		return fmt.Errorf("outer: step %d: %w", t, optim.ErrClosed)
	}
	for i, p := range o.params {
		if len(p.Data()) != o.sizes[i] || len(p.GradData()) != o.sizes[i] {
			return fmt.Errorf("outer: step %d: parameter %q: value or gradient no longer holds the %d elements it had at construction", t, p.Name, o.sizes[i])
		}
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

// refuse tells the other ranks, at the next exchange's agreement, that
// this rank failed at call t, and returns failure.
func (o *Optimizer) refuse(ctx context.Context, t int64, failure error) error {
	o.settle()
	at := o.nextLaunch(t)
	o.broken = failure
	if _, _, err := o.agree(ctx, statusRefused); err != nil {
		return errors.Join(failure, fmt.Errorf("outer: telling the other ranks at the exchange of step %d: %w", at, err))
	}
	return failure
}

// agree all-gathers every rank's status word and carried flags (see
// CarryFlags), and writes the flags' maximum over the ranks into Agreed.
// It returns the first rank that refused (-1: none) and whether some
// rank's pseudo-gradient is not finite.
func (o *Optimizer) agree(ctx context.Context, status float32) (by int, nonFinite bool, err error) {
	sf := o.flags
	if o.world == 1 {
		if sf != nil {
			copy(sf.Agreed, sf.Local)
		}
		return -1, status == statusNonFinite, nil
	}
	o.status[0] = status
	if sf != nil {
		copy(o.status[1:], sf.Local)
	}
	// On c, not xc: no exchange is in flight at an agreement, and c is
	// the one communicator Close never closes, so that a Step after
	// Close still reaches the other ranks.
	if err := o.c.AllGather(ctx, o.status, o.statuses); err != nil {
		return -1, false, fmt.Errorf("agreement: %w", err)
	}
	n := len(o.status)
	if sf != nil {
		for i := range sf.Agreed {
			m := o.statuses[1+i]
			for r := 1; r < o.world; r++ {
				m = max(m, o.statuses[r*n+1+i])
			}
			sf.Agreed[i] = m
		}
	}
	by = -1
	for r := range o.world {
		switch o.statuses[r*n] {
		case statusOK:
		case statusNonFinite:
			nonFinite = true
		default:
			if by < 0 {
				by = r
			}
		}
	}
	return by, nonFinite, nil
}

// launch starts the exchange of fragment f at call t: pseudo-gradient,
// agreement, then the exchange itself, here (Delay 0, merged at once) or
// in the background.
func (o *Optimizer) launch(ctx context.Context, t int64, f int) error {
	lo, hi := o.bounds[f], o.bounds[f+1]
	w := o.work[:hi-lo]
	finite := true
	for _, s := range o.spans[f] {
		d := o.params[s.param].Data()[s.at : s.at+s.n]
		g := o.global[s.flat : s.flat+s.n]
		x := w[s.flat-lo : s.flat-lo+s.n]
		for j := range d {
			v := g[j] - d[j]
			x[j] = v
			if v-v != 0 {
				finite = false
			}
		}
		if o.snap != nil {
			copy(o.snap[s.flat-lo:s.flat-lo+s.n], d)
		}
	}
	status := float32(statusOK)
	if !finite {
		status = statusNonFinite
	}
	by, nonFinite, err := o.agree(ctx, status)
	switch {
	case err != nil:
		o.broken = err
		return fmt.Errorf("outer: step %d: exchange of fragment %d: %w", t, f, err)
	case by >= 0:
		o.broken = fmt.Errorf("rank %d failed before the exchange of step %d (its error says why)", by, t)
		return fmt.Errorf("outer: step %d: exchange of fragment %d refused: %w", t, f, o.broken)
	case nonFinite:
		o.outerSkipped++
		o.resetLocal(f)
		o.log.Warn("skipping an outer step: non-finite pseudo-gradient on some rank; every rank restarts the fragment from the global parameters",
			zap.Int64("step", t), zap.Int("fragment", f), zap.Int64("skipped", o.outerSkipped))
		return nil
	}
	if o.cfg.Delay == 0 {
		if err := o.exchange(ctx, f); err != nil {
			o.broken = err
			return fmt.Errorf("outer: step %d: exchange of fragment %d: %w", t, f, err)
		}
		o.resetLocal(f)
		o.outerSteps++
		return nil
	}
	o.pending, o.launchedAt = f, t
	if !o.async {
		err := o.exchange(ctx, f)
		o.xBytes += o.flightBytes
		if err != nil {
			o.broken = err
			return fmt.Errorf("outer: step %d: exchange of fragment %d: %w", t, f, err)
		}
		return nil
	}
	o.flightCtx, o.inFlight = ctx, true
	go o.flightFn()
	return nil
}

// resetLocal sets this rank's parameters of fragment f to θ_g.
func (o *Optimizer) resetLocal(f int) {
	for _, s := range o.spans[f] {
		copy(o.params[s.param].Data()[s.at:s.at+s.n], o.global[s.flat:s.flat+s.n])
	}
}

// settle waits for the exchange in flight, if any, and keeps its error.
func (o *Optimizer) settle() {
	if o.inFlight {
		o.inFlight = false
		err := <-o.flight
		o.xBytes += o.flightBytes
		if err != nil && o.broken == nil {
			o.broken = fmt.Errorf("exchange of fragment %d launched at step %d: %w", o.pending, o.launchedAt, err)
		}
	}
}

// merge waits for the exchange of the pending fragment and merges it:
// θ_local = θ_g + (θ_local - θ_local at launch).
func (o *Optimizer) merge() error {
	o.settle()
	if o.broken != nil {
		return o.broken
	}
	f := o.pending
	lo, hi := o.bounds[f], o.bounds[f+1]
	copy(o.global[lo:hi], o.stage)
	copy(o.mom[lo:hi], o.work)
	for _, s := range o.spans[f] {
		d := o.params[s.param].Data()[s.at : s.at+s.n]
		g := o.global[s.flat : s.flat+s.n]
		sn := o.snap[s.flat-lo : s.flat-lo+s.n]
		for j := range d {
			d[j] = g[j] + (d[j] - sn[j])
		}
	}
	o.pending = -1
	o.outerSteps++
	return nil
}

// exchange averages the pseudo-gradient of fragment f (in work) with the
// codec and takes the outer step: the new θ_g and u of the fragment go in
// place with Delay 0, and into stage and work with Delay > 0 (merge
// applies them). It writes only work, stage, the codec's state and, with
// Delay 0, the fragment's θ_g and u.
func (o *Optimizer) exchange(ctx context.Context, f int) error {
	if o.split {
		// Counted here, on the goroutine that sends them: the caller's
		// Step counts what it sends on c.
		before := optim.CommBytes(o.xc)
		defer func() { o.flightBytes = optim.CommBytes(o.xc) - before }()
	}
	lo, hi := o.bounds[f], o.bounds[f+1]
	w := o.work[:hi-lo]
	g, u := o.global[lo:hi], o.mom[lo:hi]
	gOut, uOut := g, u // the new θ_g and u: in place, or staged for merge
	if o.stage != nil {
		gOut, uOut = o.stage[:hi-lo], w
	}
	lr, mu := o.cfg.LR, o.cfg.Momentum
	if o.cfg.Codec == CodecOneBit {
		// x = mu*u + delta, compressed with error feedback: the average
		// ū is the new momentum; the averaged pseudo-gradient it implies
		// is ū - mu*u.
		for j := range w {
			w[j] = float32(mu*u[j]) + w[j]
		}
		if o.world > 1 {
			b := o.buckets[f]
			for k, st := range o.states[f] {
				if err := onebit.AllReduce(ctx, o.xc, w[b[k]:b[k+1]], st); err != nil {
					return fmt.Errorf("1-bit allreduce, bucket %d of %d: %w", k, len(o.states[f]), err)
				}
			}
		}
		for j, ub := range w {
			step := ub
			if o.cfg.Nesterov {
				step = (ub - float32(mu*u[j])) + float32(mu*ub)
			}
			gOut[j] = g[j] - float32(lr*step)
			uOut[j] = ub
		}
		return nil
	}
	if o.world > 1 {
		var err error
		switch o.cfg.Codec {
		case CodecFP32:
			err = o.xc.AllReduce(ctx, w, comm.Mean)
		case CodecBF16:
			err = o.down.AllReduce(ctx, o.xc, w)
		case CodecInt8:
			err = o.i8.allReduce(ctx, o.xc, w)
		case CodecSparse:
			err = o.sp.allReduce(ctx, o.xc, w, o.sp.acc[lo:hi])
		}
		if err != nil {
			return fmt.Errorf("%s average: %w", o.cfg.Codec, err)
		}
	}
	for j, d := range w {
		m := float32(mu*u[j]) + d
		step := m
		if o.cfg.Nesterov {
			step = d + float32(mu*m)
		}
		gOut[j] = g[j] - float32(lr*step)
		uOut[j] = m
	}
	return nil
}

// Close waits for the exchange in flight, if any (every rank launched it
// together, and it completes without any further call from the peers),
// and closes the inner optimizer when NewAdam made it. It communicates
// nothing and is idempotent; a Step after it fails (on every rank, at the
// next exchange: see Step). Params, Stats and State still work.
func (o *Optimizer) Close() error {
	if o.closed {
		return nil
	}
	o.closed = true
	o.settle()
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
