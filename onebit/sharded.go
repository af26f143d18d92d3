package onebit

// The sharded mode of 1-bit Adam, step by step as docs/sharded.md gives
// it: every rank keeps the moments of its own chunk of every bucket, the
// gradients travel compressed to the chunks' owners (phase 1 of the
// compressed allreduce, with the worker error feedback), and the owners'
// update ratios travel back compressed (phase 2, with an update error of
// the owner's chunk in place of the server error).

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/quant"
)

// StateMode chooses how 1-bit Adam (AdamConfig.StateMode) and 1-bit LAMB
// (LambConfig.StateMode: StateFull and StateCompact) keep their optimizer
// state.
type StateMode int

const (
	// StateFull keeps both moments of every parameter on every rank, with
	// the error buffers of the compressed allreduce of the momentum (the
	// spec page onebit.md): about 13.3 bytes per parameter on 4 ranks
	// for 1-bit Adam, 21.3 for 1-bit LAMB.
	StateFull StateMode = iota
	// StateSharded keeps the moments of the rank's own 1/W of every bucket
	// and compresses the gradient on its way to the owner and the owner's
	// update on its way back, each with its own error feedback
	// (docs/sharded.md): 4 + 12/W bytes per parameter and the packed wire
	// buffers, 7.3 on 4 ranks, with the wire bytes of StateFull (1-bit
	// Adam only). It needs
	// the float32 gradient averaging of the warm-up (optim.ReduceFP32).
	// On one rank there is nothing to shard: it runs as StateFull.
	StateSharded
	// StateCompact runs StateFull's steps, bit for bit, keeping the
	// momentum in the packed form the compressed allreduce gathers it in
	// (one bit per element and a scale per chunk) instead of float32, and
	// the warm-up's float32 momentum in the buffer that becomes the worker
	// error buffer: about 9.3 bytes per parameter on 4 ranks. 1-bit LAMB
	// keeps its momentum and the last step's the same way and computes
	// its update twice instead of storing it: about 13.5 on 4 ranks. Its
	// checkpoints are StateFull's: either mode loads the other's. On one
	// rank it runs as StateFull.
	StateCompact
)

// String returns the mode's Go name.
func (m StateMode) String() string {
	switch m {
	case StateFull:
		return "StateFull"
	case StateSharded:
		return "StateSharded"
	case StateCompact:
		return "StateCompact"
	}
	return "StateMode(" + strconv.Itoa(int(m)) + ")"
}

// ParseStateMode parses the name of a state mode of 1-bit Adam with its
// bfloat16 buffers, as a command line spells it: "" or "full" (StateFull),
// "compact" (StateCompact), "sharded" (StateSharded) or "sharded-bf16"
// (StateSharded with BF16WorkerError|BF16Variance).
func ParseStateMode(s string) (StateMode, BF16State, error) {
	switch s {
	case "", "full":
		return StateFull, 0, nil
	case "compact":
		return StateCompact, 0, nil
	case "sharded":
		return StateSharded, 0, nil
	case "sharded-bf16":
		return StateSharded, BF16WorkerError | BF16Variance, nil
	}
	return 0, 0, fmt.Errorf("onebit: unknown state mode %q (want full, compact, sharded or sharded-bf16)", s)
}

// Checkpoint entries of the sharded mode.
const (
	// IntStateMode records the StateMode of the optimizer that made a
	// checkpoint; a checkpoint without it was made in StateFull.
	IntStateMode = "state_mode"
	// ExpAvgShardPrefix and ExpAvgSqShardPrefix, followed by "bucket:" and
	// the bucket's index, name the rank's shards of m and v in the
	// sharded mode.
	ExpAvgShardPrefix   = "exp_avg_shard/"
	ExpAvgSqShardPrefix = "exp_avg_sq_shard/"
)

// BF16State chooses which buffers of the sharded mode are kept in
// bfloat16 (8 bits of mantissa, float32's range), rounded to nearest even
// whenever they are written; a set of the flags below. The zero value
// keeps every buffer in float32.
type BF16State uint8

const (
	// BF16WorkerError keeps the worker error buffer, the one full-size
	// buffer of the sharded mode, in bfloat16: 2 bytes per parameter
	// instead of 4. Each compression step widens a bucket's residual into
	// a float32 staging buffer (one, as long as the largest bucket,
	// shared by all), runs the step there and narrows the new residual
	// back: the rounding loses about 2^-9 of the residual each step.
	BF16WorkerError BF16State = 1 << iota
	// BF16Variance keeps the frozen variance in bfloat16 from the end of
	// the warm-up on (the warm-up updates it in float32: its increments
	// are below bfloat16's resolution).
	BF16Variance
)

// String lists the flags set, joined by "|" ("0" for none).
func (b BF16State) String() string {
	var out []string
	if b&BF16WorkerError != 0 {
		out = append(out, "BF16WorkerError")
	}
	if b&BF16Variance != 0 {
		out = append(out, "BF16Variance")
	}
	if rest := b &^ (BF16WorkerError | BF16Variance); rest != 0 {
		out = append(out, "BF16State("+strconv.Itoa(int(rest))+")")
	}
	if len(out) == 0 {
		return "0"
	}
	return strings.Join(out, "|")
}

// IntBF16 records the BF16State of the optimizer that made a checkpoint;
// a checkpoint without it was made with every buffer in float32. The
// checkpoint holds the buffers as float32 either way (widened exactly).
const IntBF16 = "state_bf16"

// modeOf reads the state mode a checkpoint was made in.
func modeOf(ck *optim.Checkpoint) StateMode {
	return StateMode(ck.Ints[IntStateMode])
}

// checkMode refuses a checkpoint made in another state mode or precision
// than want and bf, naming both.
func checkMode(ck *optim.Checkpoint, want StateMode, bf BF16State) error {
	fullFormat := func(m StateMode) bool { return m == StateFull || m == StateCompact }
	if got := modeOf(ck); got != want && !(fullFormat(got) && fullFormat(want)) {
		return fmt.Errorf("%w: made with StateMode %v, this optimizer has %v (the state is kept differently: use the same StateMode)",
			optim.ErrIncompatibleCheckpoint, got, want)
	}
	if got := BF16State(ck.Ints[IntBF16]); got != bf {
		return fmt.Errorf("%w: made with BF16 %v, this optimizer has %v (the state is rounded differently: use the same BF16)",
			optim.ErrIncompatibleCheckpoint, got, bf)
	}
	return nil
}

// sharded is the state and the step of the sharded mode on more than one
// rank.
type sharded struct {
	layout
	rank   int
	owned  []int       // per bucket: the elements of the own chunk that are not padding
	m, v   [][]float32 // per bucket: the own chunk's moments, views into mflat and vflat
	mask   [][]float32 // per bucket: the own chunk's masks, nil when unmasked
	mflat  []float32   //
	vflat  []float32   //
	mskBuf []float32   // every bucket's masks, when any parameter is masked
	owner  []func(int, []float32)

	// staging holds the warm-up's exchanges, a piece of every chunk at a
	// time: the worker error buffers (which the warm-up has no use for)
	// in float32, a block of its own with BF16WorkerError.
	staging [][]float32
	// With BF16 flags set: the worker errors in bfloat16 (compression
	// stage only; every bucket's State forms x from them through a
	// bf16Worker, and has no WorkerError); the frozen variance in bfloat16
	// (compression stage only, v and vflat being nil then).
	bf16   BF16State
	block  []float32
	we     [][]uint16
	weFlat []uint16
	vb     [][]uint16
	vbFlat []uint16
	chunks []int // every bucket's chunk length
	padded []int // every bucket's padded length
	// compressing is set from the end of the warm-up on: before, the error
	// buffers stage the warm-up's exchanges and hold no state.
	compressing bool

	// The numbers of the step in progress, read by the owners' hooks.
	beta1, eps, c1, c2 float32
	bound              optim.RatioBound

	// late: the elements whose v is zero, which take no step (late.go).
	late shardLate
}

// newSharded cuts the parameters into buckets of bytes (as StateFull
// does) on world > 1 ranks and allocates rank's shards.
func newSharded(params []*optim.Param, masks [][]float32, world, rank, bytes int, bf BF16State) (*sharded, error) {
	b, err := newBuckets(params, world, bytes, false)
	if err != nil {
		return nil, err
	}
	s := &sharded{layout: newLayout(params, b), rank: rank, bf16: bf}
	nb := len(b.states)
	s.owned = make([]int, nb)
	chunks := make([]int, nb)
	s.padded = make([]int, nb)
	for k, st := range b.states {
		c := len(st.ServerError)
		chunks[k] = c
		s.padded[k] = len(st.WorkerError)
		s.owned[k] = max(0, min(c, st.numel-rank*c))
	}
	s.chunks = chunks
	s.staging = make([][]float32, nb)
	if bf&BF16WorkerError != 0 && nb > 0 {
		s.block = make([]float32, min(slices.Max(s.padded), stagingBlock*world))
		for k, st := range b.states {
			st.WorkerError = nil
			st.worker = bf16Worker{s, k}
			s.staging[k] = s.block[:min(len(s.block), s.padded[k])]
		}
	} else {
		for k, st := range b.states {
			s.staging[k] = st.WorkerError
		}
	}
	s.mflat, s.m = flatten[float32](chunks)
	s.vflat, s.v = flatten[float32](chunks)
	s.mask = make([][]float32, nb)
	masked := false
	for _, mk := range masks {
		masked = masked || mk != nil
	}
	if masked {
		s.mskBuf, s.mask = flatten[float32](chunks)
		for i := range s.mskBuf {
			s.mskBuf[i] = 1
		}
	}
	// The masks of the own chunks.
	for k, segs := range s.segs {
		c := chunks[k]
		for _, sg := range segs {
			if masks[sg.param] == nil {
				continue
			}
			for e := max(sg.lo, rank*c); e < min(sg.hi, (rank+1)*c); e++ {
				s.mask[k][e-rank*c] = masks[sg.param][sg.off+e-sg.lo]
			}
		}
	}
	s.owner = make([]func(int, []float32), nb)
	for k, st := range b.states {
		s.owner[k] = func(off int, c []float32) { s.update(k, off, c) }
		st.owner, st.keep, st.meanAbs = s.owner[k], true, true
	}
	return s, nil
}

// stagingBlock is the elements per rank of a piece of the warm-up's
// exchanges when the worker errors, kept in bfloat16, cannot stage them.
const stagingBlock = 16 << 10

// bf16Worker forms x for bucket k from its bfloat16 worker error.
type bf16Worker struct {
	s *sharded
	k int
}

func (b bf16Worker) form(x []float32, lo int) {
	quant.Widen(quant.BF16, x, b.s.we[b.k][lo:lo+len(x)])
	b.s.addGrads(b.k, lo, x)
}

func (b bf16Worker) keep(r []float32, lo int) {
	quant.Narrow(quant.BF16, b.s.we[b.k][lo:lo+len(r)], r)
}

// apply descends the parameters of bucket k by the update u of its
// elements [lo, lo+len(u)): p -= lr * (u + wd*p), rounded as
// optim.AdamUpdate rounds it.
func (s *sharded) apply(k, lo int, u []float32, lr, wd float32) {
	if s.late.zero != nil {
		s.clearLate(k, lo, u)
	}
	for sp := range s.spans(k, lo, lo+len(u)) {
		p, us := sp.of(s.params[sp.sg.param].Data()), sp.at(u, lo)
		for j := range p {
			d := us[j] + float32(wd*p[j])
			p[j] -= float32(lr * d)
		}
	}
}

// ratio is the owner's exact Adam ratio (m*c1)/(sqrt(v*c2)+eps) into
// dst, rounded as optim.AdamUpdate rounds it.
func ratio(dst, m, v []float32, c1, c2, eps float32) {
	v = v[:len(m)]
	dst = dst[:len(m)]
	for i := range m {
		d := float32(math.Sqrt(float64(v[i]*c2))) + eps
		dst[i] = float32(m[i]*c1) / d
	}
}

// update is steps 5-6 on a block of the own chunk of bucket k (elements
// [off, off+len(c)) of the chunk), called by the compressed allreduce
// between its steps 5 and 6: c, the averaged compressed gradient,
// updates m, and is replaced by the bounded ratio the owner's update
// takes (0 for padding and where v is zero).
func (s *sharded) update(k, off int, c []float32) {
	valid := max(0, min(len(c), s.owned[k]-off))
	m := s.m[k][off : off+valid]
	optim.Momentum(m, c[:valid], s.beta1)
	if s.mask[k] != nil {
		optim.Mul(m, s.mask[k][off:off+valid])
	}
	if s.vb != nil {
		v := s.vb[k][off : off+valid]
		for i := range m {
			vi := math.Float32frombits(uint32(v[i]) << 16)
			d := float32(math.Sqrt(float64(vi*s.c2))) + s.eps
			c[i] = s.bound.Of(float32(m[i]*s.c1)/d, vi)
		}
	} else {
		v := s.v[k][off : off+valid]
		for i := range m {
			d := float32(math.Sqrt(float64(v[i]*s.c2))) + s.eps
			c[i] = s.bound.Of(float32(m[i]*s.c1)/d, v[i])
		}
	}
	clear(c[valid:])
}

// warmup is an exact Adam step with sharded moments (steps 1-6 of the
// warm-up): per bucket, the mean gradient reduce-scattered to the owners,
// the owners' moments and ratios, the ratios all-gathered, the update. The
// exchanges go through the bucket's staging buffer, in pieces of every
// chunk as long as it allows (the whole chunk unless the worker errors
// are in bfloat16): the same sums, element by element, either way.
func (s *sharded) warmup(ctx context.Context, c comm.Comm, cfg optim.AdamConfig, lr, c1, c2 float32) error {
	nb := len(s.bkt.states)
	w := c.Size()
	for k, st := range s.bkt.states {
		u, chunk, own := st.ServerError, len(st.ServerError), s.owned[k]
		per := len(s.staging[k]) / w
		for lo := 0; lo < chunk; lo += per {
			n := min(per, chunk-lo)
			x := s.staging[k][:w*n]
			for j := range w {
				s.gradsInto(k, j*chunk+lo, x[j*n:(j+1)*n])
			}
			g := u[lo : lo+n]
			if err := c.ReduceScatter(ctx, x, g, comm.Mean); err != nil {
				return fmt.Errorf("bucket %d of %d: gradient reduce-scatter: %w", k, nb, err)
			}
			mine := max(0, min(n, own-lo))
			m, v := s.m[k][lo:lo+mine], s.v[k][lo:lo+mine]
			optim.AdamMoments(m, v, g, cfg.Beta1, cfg.Beta2)
			ratio(g, m, v, c1, c2, cfg.Eps)
			clear(g[mine:])
			if err := c.AllGather(ctx, g, x); err != nil {
				return fmt.Errorf("bucket %d of %d: update all-gather: %w", k, nb, err)
			}
			for j := range w {
				a := j*chunk + lo
				s.apply(k, a, x[j*n:j*n+max(0, min(n, st.numel-a))], lr, cfg.WeightDecay)
			}
		}
	}
	return nil
}

// freeze ends the warm-up: the buffers that staged its exchanges start
// the compression stage as the error buffers, at zero.
func (s *sharded) freeze() {
	s.bkt.reset()
	s.setCompressing(true)
}

// setCompressing lays the state out for the compression stage (on) or
// the warm-up: with BF16Variance, v in bfloat16 (narrowed from float32)
// or in float32 (widened, exactly); with BF16WorkerError, bfloat16 worker
// errors at zero, or none (the warm-up has none). The float32 variance is
// released before the bfloat16 worker errors are made, so that the
// switch does not raise the optimizer's peak memory.
func (s *sharded) setCompressing(on bool) {
	s.compressing = on
	s.late.known, s.late.zero = false, nil
	if s.bf16&BF16Variance != 0 {
		switch {
		case on && s.vb == nil:
			s.vbFlat, s.vb = flatten[uint16](s.chunks)
			quant.Narrow(quant.BF16, s.vbFlat, s.vflat)
			s.vflat, s.v = nil, nil
		case !on && s.v == nil:
			s.vflat, s.v = flatten[float32](s.chunks)
			quant.Widen(quant.BF16, s.vflat, s.vbFlat)
			s.vbFlat, s.vb = nil, nil
		}
	}
	if s.bf16&BF16WorkerError != 0 {
		switch {
		case on && s.we == nil:
			s.weFlat, s.we = flatten[uint16](s.padded)
		case !on:
			s.weFlat, s.we = nil, nil
		}
	}
}

func sum(xs []int) int {
	n := 0
	for _, x := range xs {
		n += x
	}
	return n
}

// compressed is a compression-stage step (steps 1-8): per bucket, the
// gradient added into the worker error, the compressed allreduce with the
// owners' update as its server step, and the decompressed update applied;
// an element whose v is zero takes no step, and has its v marked at the
// end of the step if some rank gave it gradient (see unseen).
func (s *sharded) compressed(ctx context.Context, c comm.Comm, cfg optim.AdamConfig, lr, c1, c2 float32) error {
	s.beta1, s.eps, s.c1, s.c2 = cfg.Beta1, cfg.Eps, c1, c2
	s.bound = ratioBound(cfg.Beta1, cfg.Beta2)
	if !s.late.known {
		if err := s.gatherLate(ctx, c); err != nil {
			return err
		}
	}
	late := s.late.n > 0
	if late {
		s.packLate()
		if err := s.late.exchange(ctx, c); err != nil {
			return err
		}
	}
	if err := s.compressBuckets(ctx, c, cfg, lr); err != nil {
		return err
	}
	if late {
		s.markLate()
	}
	return nil
}

// compressBuckets is steps 1-8 on every bucket.
func (s *sharded) compressBuckets(ctx context.Context, c comm.Comm, cfg optim.AdamConfig, lr float32) error {
	nb := len(s.bkt.states)
	for k, st := range s.bkt.states {
		if st.worker == nil {
			s.addGrads(k, 0, st.WorkerError)
		}
		if err := st.allReduce(ctx, c, nil); err != nil {
			return fmt.Errorf("bucket %d of %d: %w", k, nb, samePackage{err})
		}
		s.applyGathered(k, st, lr, cfg.WeightDecay)
	}
	return nil
}

// applyGathered is step 8 on bucket k: every chunk's update, as gathered
// in phase 2, decompressed a block at a time and applied.
func (s *sharded) applyGathered(k int, st *State, lr, wd float32) {
	for lo, u := range st.outputs() {
		s.apply(k, lo, u, lr, wd)
	}
}

// bucketShardName names bucket k's entry under prefix.
func bucketShardName(prefix string, k int) string { return prefix + "bucket:" + strconv.Itoa(k) }

// save adds the mode, the precision, the bucket layout, the shards and
// the error buffers to ck, all in float32 (bfloat16 ones widened).
func (s *sharded) save(ck *optim.Checkpoint) {
	ck.Ints[IntStateMode] = int64(StateSharded)
	if s.bf16 != 0 {
		ck.Ints[IntBF16] = int64(s.bf16)
	}
	var we, ue [][]float32
	switch {
	case !s.compressing:
		// Zero: in the warm-up the buffers only stage its exchanges.
		_, we = flatten[float32](s.padded)
		_, ue = flatten[float32](s.chunks)
	case s.we != nil:
		// The bfloat16 worker errors, widened.
		_, we = flatten[float32](s.padded)
		for k := range we {
			quant.Widen(quant.BF16, we[k], s.we[k])
		}
	}
	s.bkt.save(ck, we, ue)
	for k := range s.bkt.states {
		ck.AddTensor(bucketShardName(ExpAvgShardPrefix, k), []int{len(s.m[k])}, s.m[k])
		if s.vb != nil {
			v := make([]float32, len(s.vb[k]))
			quant.Widen(quant.BF16, v, s.vb[k])
			ck.AddTensor(bucketShardName(ExpAvgSqShardPrefix, k), []int{len(v)}, v)
		} else {
			ck.AddTensor(bucketShardName(ExpAvgSqShardPrefix, k), []int{len(s.v[k])}, s.v[k])
		}
	}
}

// check refuses a checkpoint whose shards are not this rank's: made by
// another rank, on another group size or with other buckets.
func (s *sharded) check(ck *optim.Checkpoint, world int) error {
	if ck.World != world || ck.Rank != s.rank {
		return fmt.Errorf("%w: made by rank %d of %d, this is rank %d of %d (sharded moments are per rank, which ResetErrors does not change: onebit.Regroup re-cuts them for another group or rank)",
			optim.ErrIncompatibleCheckpoint, ck.Rank, ck.World, s.rank, world)
	}
	size, count := ck.Ints[IntBucketBytes], ck.Ints[IntBuckets]
	if size != int64(s.bkt.bytes) || count != int64(len(s.bkt.states)) {
		return fmt.Errorf("%w: made with %d buckets of %d bytes, this optimizer has %d of %d (the shards follow the buckets: use the same BucketBytes)",
			optim.ErrIncompatibleCheckpoint, count, size, len(s.bkt.states), s.bkt.bytes)
	}
	return nil
}

// restore stages the shards and error buffers of ck for rs (after
// check). The buffers kept in bfloat16 are staged into float32 ones made
// here; finish, after rs.Apply, lays the state out for ck's stage and
// narrows them.
func (s *sharded) restore(ck *optim.Checkpoint, rs *optim.Restore) (finish func(compressing bool)) {
	var v, we [][]float32
	if s.bf16&BF16Variance != 0 {
		_, v = flatten[float32](s.chunks)
	}
	if s.bf16&BF16WorkerError != 0 {
		_, we = flatten[float32](s.padded)
	}
	for k, st := range s.bkt.states {
		rs.Tensor(bucketShardName(ExpAvgShardPrefix, k), s.m[k])
		if v != nil {
			rs.Tensor(bucketShardName(ExpAvgSqShardPrefix, k), v[k])
		} else {
			rs.Tensor(bucketShardName(ExpAvgSqShardPrefix, k), s.v[k])
		}
		if ck.ErrorsReset {
			continue
		}
		wn, sn := s.bkt.errorNames(k)
		if we != nil {
			rs.Tensor(wn, we[k])
		} else {
			rs.Tensor(wn, st.WorkerError)
		}
		rs.Tensor(sn, st.ServerError)
	}
	return func(compressing bool) {
		if v != nil {
			// Lay v out as float32, take the checkpoint's, then switch.
			s.vbFlat, s.vb = nil, nil
			s.vflat, s.v = flatten[float32](s.chunks)
			for k := range v {
				copy(s.v[k], v[k])
			}
		}
		if we != nil {
			s.weFlat, s.we = nil, nil
		}
		s.setCompressing(compressing)
		if s.we != nil {
			for k := range we {
				quant.Narrow(quant.BF16, s.we[k], we[k])
			}
		}
	}
}

// stateBytes is the bytes of the shards, the masks, every bucket's State
// and, with BF16 flags, the bfloat16 buffers and the warm-up's staging
// block.
func (s *sharded) stateBytes() int64 {
	n := optim.Float32Bytes(s.mflat, s.vflat, s.mskBuf, s.block) + s.bkt.stateBytes() + s.late.bytes()
	return n + 2*int64(cap(s.weFlat)+cap(s.vbFlat))
}
