// Package zero is sharded data-parallel Adam in the style of ZeRO stages 1
// and 2 (Rajbhandari et al. 2020): each of the W ranks keeps the Adam
// moments of its own 1/W of the parameters only, so optimizer memory per
// rank falls as 1/W.
//
// Every step reduce-scatters the gradients, so that each rank receives the
// mean gradient of the part it owns (exact float32, coalesced per tensor,
// or quantized to int8 or int4 with the hierarchical qgZ reduce-scatter of
// package quant), updates that part with Adam, and all-gathers the updated
// parameters, so that every rank ends the step with the whole model.
//
// Adam implements optim.Optimizer. Its checkpoints are per rank (each holds
// the rank's own shard of the moments); Consolidate joins the checkpoints of
// every rank into one that loads on a group of any size.
package zero

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// Algorithm is the checkpoint algorithm name of Adam.
const Algorithm = "zero-adam"

// Adam is sharded data-parallel Adam, AdamW when the weight decay is not
// zero. On W ranks with n parameter elements in all, rank r owns:
//
//   - in the flat modes (ReduceFP32, ReduceInt8, ReduceInt4), the
//     contiguous chunk [r*P, (r+1)*P) of the parameters laid end to end in
//     construction order, P = ceil(n/W) (trailing ranks may own less, or
//     nothing);
//   - in ReduceCoalesced, chunk r of every tensor of n_i elements,
//     [r*ceil(n_i/W), (r+1)*ceil(n_i/W)), as quant.Coalesced lays it out.
//
// It keeps m and v for those elements only. Step checks that every rank's
// gradient is finite (a step with a NaN or Inf anywhere is skipped on every
// rank), reduce-scatters the gradients so that each rank holds the mean
// gradient of what it owns, applies optim.AdamStep to its own elements, and
// all-gathers the parameters. The flat modes go bucket by bucket (see
// Config.BucketBytes) so that no buffer as large as the model is needed.
//
// With ReduceFP32 the result is that of optim.Adam whenever the mean the
// communicator's ReduceScatter computes is bit for bit the one its
// AllReduce computes (true of comm/local, which sums in rank order in both):
// the update is element-wise and uses the same kernel. On one rank every
// mode is plain Adam and communicates nothing.
//
// Step leaves the gradients as the training loop wrote them. After an
// error from the communicator the state is undefined: load a checkpoint.
type Adam struct {
	c      comm.Comm
	world  int
	rank   int
	params []*optim.Param
	cfg    Config

	n    int   // parameter elements in all
	offs []int // offs[i]: flat offset of parameter i; offs[len(params)] == n
	segs []segment
	m, v []float32 // the owned elements' moments, in segment order

	// Flat modes on more than one rank.
	part   int // P: partition length
	base   int // r*P: flat offset of this rank's partition
	bucket int // elements per rank per reduce-scatter call
	stage  []float32
	chunk  []float32
	rs     flatReducer // the reduce-scatter of a bucket
	// fixed: rs takes full buckets only; the last, shorter one is padded
	// with zeros (qgZ is made for one length).
	fixed bool
	// qgzFloats counts the float32 work buffers of the qgZ reduce-scatters.
	qgzFloats int

	// ReduceCoalesced on more than one rank.
	co *coalesced

	sub   []comm.Comm // communicators Adam made (qgZ layout), counted in Stats
	close func() error
	// The traffic on sub, which the frame does not see: in all, and in
	// the last step.
	subSent, subLast int64

	f     *optim.Frame
	sizes [][]float32 // the parameters' values at construction, for the frame's size check
}

var (
	_ optim.Optimizer   = (*Adam)(nil)
	_ optim.LRSetter    = (*Adam)(nil)
	_ optim.FlagCarrier = (*Adam)(nil)
)

// segment is the part of one parameter this rank owns: elements [lo, hi)
// of parameter i, whose moments are m[off:off+hi-lo].
type segment struct {
	lo, hi, off int
}

// flatReducer reduce-scatters one staged bucket: send holds W slices of
// len(recv) elements; recv receives the mean of slice Rank().
type flatReducer interface {
	reduceScatter(ctx context.Context, send, recv []float32) error
}

type exactReducer struct{ c comm.Comm }

func (e exactReducer) reduceScatter(ctx context.Context, send, recv []float32) error {
	return e.c.ReduceScatter(ctx, send, recv, comm.Mean)
}

// NewAdam returns sharded Adam over params on the ranks of c (nil for a
// single process). Every rank of c must call it, with the same parameter
// names and shapes and the same configuration: a difference is reported on
// every rank (an invalid cfg as cfg.Validate's error on the rank that has
// it, joined with the agreement's error on more than one rank). It
// allocates this rank's moments and the staging buffers;
// Step allocates nothing after the first call.
func NewAdam(ctx context.Context, c comm.Comm, params []*optim.Param, cfg Config, opts ...optim.Option) (*Adam, error) {
	bad := cfg.Validate()
	if bad == nil {
		if err := optim.CheckParams(params); err != nil {
			bad = fmt.Errorf("zero: Adam: %w", err)
		}
	}
	if c != nil && c.Size() > 1 {
		// Every rank takes part, so that a rank's bad input is an error on
		// every rank rather than a hang.
		if err := agree(ctx, c, params, cfg, bad != nil); err != nil {
			return nil, errors.Join(bad, err)
		}
	}
	if bad != nil {
		return nil, bad
	}
	o := optim.ApplyOptions(opts)
	a := &Adam{
		c:      c,
		world:  1,
		params: slices.Clone(params),
		cfg:    cfg,
		offs:   make([]int, len(params)+1),
		segs:   make([]segment, len(params)),
	}
	if c != nil {
		a.world, a.rank = c.Size(), c.Rank()
	}
	for i, p := range params {
		a.offs[i+1] = a.offs[i] + p.Numel()
	}
	a.n = a.offs[len(params)]
	var err error
	switch {
	case a.world == 1:
		for i, p := range params {
			a.segs[i] = segment{0, p.Numel(), a.offs[i]}
		}
	case cfg.ReduceScatter == ReduceCoalesced:
		err = a.initCoalesced(ctx)
	default:
		err = a.initFlat(ctx)
	}
	if err != nil {
		return nil, err
	}
	owned := 0
	for _, s := range a.segs {
		owned += s.hi - s.lo
	}
	a.m = make([]float32, owned)
	a.v = make([]float32, owned)
	a.sizes = make([][]float32, len(params))
	for i, p := range a.params {
		a.sizes[i] = p.Data()
	}
	a.f = optim.NewFrame(optim.FrameConfig{
		Name: "zero: Adam", Algorithm: Algorithm, Comm: c, Params: a.params, Sizes: a.sizes,
		LR: cfg.LR, Stage: optim.StageExact, Logger: o.Logger, Hypers: optim.AdamHypers(cfg.AdamConfig),
	})
	a.f.Handle(optim.StageExact, a.update)
	return a, nil
}

// initFlat lays out the flat modes: the partitions, the owned segments, the
// buckets and their reducers.
func (a *Adam) initFlat(ctx context.Context) error {
	w := a.world
	a.part = (a.n + w - 1) / w
	a.base = a.rank * a.part
	lo, hi := min(a.base, a.n), min(a.base+a.part, a.n)
	for i := range a.params {
		s := segment{lo: max(lo, a.offs[i]) - a.offs[i], hi: min(hi, a.offs[i+1]) - a.offs[i]}
		if s.hi < s.lo {
			s.lo, s.hi = 0, 0
		}
		s.off = max(0, a.offs[i]+s.lo-lo)
		if s.hi == s.lo {
			s.off = 0
		}
		a.segs[i] = s
	}
	if a.part == 0 {
		return nil
	}
	var l *comm.Layout
	if a.cfg.ReduceScatter.quantized() {
		var err error
		if l, err = comm.NewLayout(ctx, a.c, a.cfg.RanksPerNode); err != nil {
			return fmt.Errorf("zero: Adam: %w", err)
		}
	}
	b := a.bucketLen(a.part)
	a.bucket = b
	a.stage = make([]float32, w*b)
	a.chunk = make([]float32, b)
	if l == nil {
		a.rs = exactReducer{a.c}
		return nil
	}
	a.fixed = true
	return a.initQGZ(ctx, l, b)
}

// bucketLen returns the elements per rank of one bucket over a partition
// of part > 0 elements: Config.BucketBytes/(4W) (BucketBytes 0:
// optim.DefaultBucketBytes), at least 1 and at most part, evened out so
// that the buckets are as few as that allows and all but the last of the
// same length.
func (a *Adam) bucketLen(part int) int {
	w := a.world
	bytes := a.cfg.BucketBytes
	if bytes == 0 {
		bytes = optim.DefaultBucketBytes
	}
	b := bytes / 4 / w
	b = min(max(b, 1), part)
	rounds := (part + b - 1) / b
	return (part + rounds - 1) / rounds
}

// agree checks, with one all-gather of a small digest, that no rank found
// its input bad and that every rank has the same parameter list and
// configuration; every rank returns the same error otherwise.
func agree(ctx context.Context, c comm.Comm, params []*optim.Param, cfg Config, bad bool) error {
	const size = 40
	h := fnv.New64a()
	numel := 0
	var buf [8]byte
	put := func(v uint64) {
		binary.LittleEndian.PutUint64(buf[:], v)
		h.Write(buf[:])
	}
	if bad {
		params = nil
	}
	for _, p := range params {
		put(uint64(len(p.Name)))
		h.Write([]byte(p.Name))
		shape := p.Shape()
		put(uint64(len(shape)))
		for _, d := range shape {
			put(uint64(d))
		}
		numel += p.Numel()
	}
	shapes := h.Sum64()
	h.Reset()
	for _, v := range []int{int(cfg.ReduceScatter), cfg.BucketBytes, cfg.GroupSize} {
		put(uint64(v))
	}
	ac := cfg.AdamConfig
	for _, f := range []float32{ac.LR, ac.Beta1, ac.Beta2, ac.Eps, ac.WeightDecay} {
		put(uint64(math.Float32bits(f)))
	}
	if ac.BiasCorrection {
		put(1)
	} else {
		put(0)
	}
	mine := make([]byte, size)
	binary.LittleEndian.PutUint64(mine[0:], uint64(len(params)))
	binary.LittleEndian.PutUint64(mine[8:], uint64(numel))
	binary.LittleEndian.PutUint64(mine[16:], shapes)
	binary.LittleEndian.PutUint64(mine[24:], h.Sum64())
	if bad {
		mine[32] = 1
	}
	all := make([]byte, size*c.Size())
	if err := c.AllGatherBytes(ctx, mine, all); err != nil {
		return fmt.Errorf("zero: Adam: comparing parameters across ranks: %w", err)
	}
	field := func(r, i int) uint64 { return binary.LittleEndian.Uint64(all[r*size+8*i:]) }
	for r := 0; r < c.Size(); r++ {
		if field(r, 4) != 0 {
			return fmt.Errorf("zero: Adam: rank %d was given an invalid configuration or invalid parameters", r)
		}
	}
	for r := 1; r < c.Size(); r++ {
		switch {
		case field(r, 0) != field(0, 0) || field(r, 1) != field(0, 1):
			return fmt.Errorf("zero: Adam: parameter lists differ across ranks: rank %d has %d tensors of %d elements in all, rank 0 has %d of %d",
				r, field(r, 0), field(r, 1), field(0, 0), field(0, 1))
		case field(r, 2) != field(0, 2):
			return fmt.Errorf("zero: Adam: parameter names or shapes differ across ranks (rank %d and rank 0, %d tensors of %d elements each)",
				r, field(0, 0), field(0, 1))
		case field(r, 3) != field(0, 3):
			return fmt.Errorf("zero: Adam: configurations differ across ranks (rank %d and rank 0): reduce mode, bucket size, group size and Adam hyper-parameters must agree", r)
		}
	}
	return nil
}

// Close releases the communicators Adam made for itself (the node layout
// of the int8 and int4 modes). It does not close the communicator given to
// NewAdam. See optim.Optimizer.Close: not a collective, idempotent, every
// rank calls it, Step fails after it.
func (a *Adam) Close() error {
	a.f.Close()
	if a.close == nil {
		return nil
	}
	f := a.close
	a.close = nil
	a.rs = nil
	return f()
}

// Params returns the parameters in construction order.
func (a *Adam) Params() []*optim.Param { return a.params }

// Stats reports progress and traffic; Stage is always optim.StageExact.
// BytesSent counts every communicator the optimizer uses, the node and
// cross-node ones of the int8 and int4 modes included.
func (a *Adam) Stats() optim.Stats {
	s := a.f.Stats()
	s.BytesSent += a.subSent
	s.LastStepBytes += a.subLast
	return s
}

// SetLR implements optim.LRSetter.
func (a *Adam) SetLR(lr float32) error { return a.f.SetLR(lr) }

// CarryFlags makes every following Step carry sf in its per-step
// agreement; see optim.FlagCarrier.
func (a *Adam) CarryFlags(sf *optim.StepFlags) error { return a.f.CarryFlags(sf) }

// SetSchedule implements optim.LRSetter.
func (a *Adam) SetSchedule(s optim.Schedule) error { return a.f.SetSchedule(s) }

// LR implements optim.LRSetter.
func (a *Adam) LR() float32 { return a.f.LR() }

// ReduceScatter returns the reduce-scatter mode.
func (a *Adam) ReduceScatter() Reduce { return a.cfg.ReduceScatter }

// StateFloats returns how many float32s of optimizer state this rank holds:
// the moments of its own elements plus the buffers that the reduce-scatter
// and all-gather stage data in: the staging bucket in the flat modes, and
// the qgZ reduce-scatter's float32 work buffers (partial sums, scales) in
// the int8 and int4 modes (its byte buffers of codes are not counted); the
// coalesced flat buffer, its output and the all-gather buffers in
// ReduceCoalesced. optim.Adam holds 2n for n parameter elements.
func (a *Adam) StateFloats() int {
	n := len(a.m) + len(a.v) + len(a.stage) + len(a.chunk) + a.qgzFloats
	if a.co != nil {
		n += a.co.floats()
	}
	return n
}

func (a *Adam) subBytes() int64 {
	var b int64
	for _, s := range a.sub {
		b += optim.CommBytes(s)
	}
	return b
}

// Step applies one update; see optim.Optimizer. It runs in an optim.Frame:
// size check, learning rate, the skip on non-finite gradients, counters.
func (a *Adam) Step(ctx context.Context) error {
	a.subLast = 0
	return a.f.Step(ctx)
}

// update is the frame's StepFunc: step t with learning rate lr.
func (a *Adam) update(ctx context.Context, t int64, lr float32) error {
	before := a.subBytes()
	defer func() {
		a.subLast = a.subBytes() - before
		a.subSent += a.subLast
	}()
	c1, c2 := float32(1), float32(1)
	if a.cfg.BiasCorrection {
		c1, c2 = optim.BiasCorrection(a.cfg.Beta1, t), optim.BiasCorrection(a.cfg.Beta2, t)
	}
	switch {
	case a.world == 1:
		for i, p := range a.params {
			a.adam(i, p.GradData(), lr, c1, c2)
		}
		return nil
	case a.co != nil:
		return a.stepCoalesced(ctx, lr, c1, c2)
	default:
		return a.stepFlat(ctx, lr, c1, c2)
	}
}

// adam applies Adam to the owned segment of parameter i, whose mean
// gradient is g (len(g) == hi-lo).
func (a *Adam) adam(i int, g []float32, lr, c1, c2 float32) {
	s := a.segs[i]
	k := s.hi - s.lo
	if k == 0 {
		return
	}
	cfg := a.cfg
	optim.AdamStep(a.params[i].Data()[s.lo:s.hi], a.m[s.off:s.off+k], a.v[s.off:s.off+k], g,
		cfg.Beta1, cfg.Beta2, lr, cfg.WeightDecay, c1, c2, cfg.Eps)
}

// stepFlat runs the flat modes bucket by bucket: bucket k covers elements
// [k*B, k*B+b) of every partition.
func (a *Adam) stepFlat(ctx context.Context, lr, c1, c2 float32) error {
	w, b := a.world, a.bucket
	cfg := a.cfg
	for off := 0; off < a.part; off += b {
		b = min(b, a.part-off)
		if a.fixed {
			// The last bucket: every slice padded with zeros to a full one.
			pb := a.bucket
			for j := range w {
				a.gather(a.stage[j*pb:j*pb+b], j*a.part+off, true)
				clear(a.stage[j*pb+b : (j+1)*pb])
			}
			if err := a.rs.reduceScatter(ctx, a.stage, a.chunk); err != nil {
				return fmt.Errorf("reduce-scatter of the gradients: %w", err)
			}
		} else {
			for j := range w {
				a.gather(a.stage[j*b:(j+1)*b], j*a.part+off, true)
			}
			if err := a.rs.reduceScatter(ctx, a.stage[:w*b], a.chunk[:b]); err != nil {
				return fmt.Errorf("reduce-scatter of the gradients: %w", err)
			}
		}
		stage, chunk := a.stage[:w*b], a.chunk[:b]
		// Adam on this rank's real elements of the bucket.
		flo, fhi := a.base+off, min(a.base+off+b, a.n)
		for x := flo; x < fhi; {
			i := a.seek(x)
			pd := a.params[i].Data()
			lo, hi := x-a.offs[i], min(fhi, a.offs[i+1])-a.offs[i]
			mo := x - a.base
			optim.AdamStep(pd[lo:hi], a.m[mo:mo+hi-lo], a.v[mo:mo+hi-lo], chunk[x-flo:],
				cfg.Beta1, cfg.Beta2, lr, cfg.WeightDecay, c1, c2, cfg.Eps)
			x += hi - lo
		}
		a.gather(chunk, flo, false)
		if err := a.c.AllGather(ctx, chunk, stage); err != nil {
			return fmt.Errorf("all-gather of the parameters: %w", err)
		}
		for j := range w {
			if j != a.rank {
				a.scatter(stage[j*b:(j+1)*b], j*a.part+off)
			}
		}
	}
	return nil
}

// seek returns the index of the parameter that holds flat element x, or
// len(params) when x >= n. Empty parameters are never returned.
func (a *Adam) seek(x int) int {
	i, _ := slices.BinarySearch(a.offs, x+1)
	return i - 1
}

// gather copies flat elements [x, x+len(dst)) of the gradients (grad) or
// the values into dst, with zeros past the end of the parameters.
func (a *Adam) gather(dst []float32, x int, grad bool) {
	for i := a.seek(x); len(dst) > 0 && i < len(a.params); i++ {
		src := a.params[i].Data()
		if grad {
			src = a.params[i].GradData()
		}
		k := copy(dst, src[x-a.offs[i]:])
		dst = dst[k:]
		x += k
	}
	clear(dst)
}

// scatter copies src into the values of flat elements [x, x+len(src)),
// dropping what falls past the end of the parameters.
func (a *Adam) scatter(src []float32, x int) {
	for i := a.seek(x); len(src) > 0 && i < len(a.params); i++ {
		k := copy(a.params[i].Data()[x-a.offs[i]:], src)
		src = src[k:]
		x += k
	}
}
