package costmodel

import (
	"errors"
	"fmt"
	"math"
	"slices"
)

// Optimizer names, as StateBytes and lowbit plan know them.
const (
	OptAdam        = "adam"         // optim.Adam, exact float32 averaging
	OptLamb        = "lamb"         // optim.Lamb, exact float32 averaging
	OptZeroAdam    = "zero-adam"    // zero.Adam, float32 reduce-scatter
	OptOnebitAdam  = "onebit-adam"  // onebit.Adam
	OptOnebitLamb  = "onebit-lamb"  // onebit.Lamb
	OptZeroOneAdam = "zeroone-adam" // onebit.ZeroOneAdam
	// OptOnebitAdamSharded is onebit.Adam with StateMode
	// onebit.StateSharded (docs/sharded.md): the moments of the rank's
	// own chunk of every bucket, the error buffers and wire buffers of
	// every bucket's State.
	OptOnebitAdamSharded = "onebit-adam-sharded"
	// OptOnebitAdamCompact is onebit.Adam with StateMode
	// onebit.StateCompact: StateFull's steps, bit for bit, with the
	// momentum kept as the packed signs the compressed allreduce gathers
	// (in the wire buffers of every bucket's State) and, in the warm-up,
	// in the worker error buffers: no float32 m.
	OptOnebitAdamCompact = "onebit-adam-compact"
	// OptOnebitAdamShardedBF16 is OptOnebitAdamSharded with AdamConfig.BF16
	// = onebit.BF16WorkerError|onebit.BF16Variance: the worker errors and
	// the frozen v in bfloat16 in the compression stage (none and float32
	// in the warm-up), and a float32 staging block for the warm-up.
	OptOnebitAdamShardedBF16 = "onebit-adam-sharded-bf16"
	// OptOnebitLambCompact is onebit.Lamb with StateMode
	// onebit.StateCompact: StateFull's steps, bit for bit, with m kept as
	// the packed signs the compressed allreduce gathers and m_last as a
	// copy of them, and no scratch buffer: v, v_fresh and the fused
	// State, the copy and two unpacking blocks.
	OptOnebitLambCompact = "onebit-lamb-compact"
)

// StateOptimizers lists the optimizers lowbit plan prints, in its order:
// those StateBytes knows but OptLamb, whose state depends on the largest
// tensor, which a plan does not know. Exact Muon's state depends on which
// parameters are matrices and of which shapes: MuonStateBytes and
// OnebitMuonStateBytes; Job.StateTable lists them with these.
func StateOptimizers() []string {
	return []string{OptAdam, OptZeroAdam, OptOnebitAdam, OptOnebitAdamCompact, OptOnebitAdamSharded, OptOnebitAdamShardedBF16, OptOnebitLamb, OptOnebitLambCompact, OptZeroOneAdam}
}

// StateBytes returns the bytes of optimizer state that rank 0 of world
// ranks holds at its peak for a model whose parameter tensors have the
// given numbers of float32 elements, with fused buckets of bucketBytes (0:
// optim.DefaultBucketBytes), in each optimizer's default configuration (no
// exp_avg masks, float32 gradient averaging; 0/1 Adam's buckets one per
// parameter, its default; the sharded 1-bit Adam's buffers all float32
// unless the name says bf16): what the optimizer's StateBytes method
// (optim.MemoryReporter) reports after its first compression step (the
// sharded and compact 1-bit Adam report it from construction on). The
// sharded 1-bit Adam with bfloat16 buffers has two layouts, the warm-up's
// and the compression stage's: its figure is the larger of the two, its
// peak over a run (the compression stage's on more than one rank). The
// figures follow the allocations of each optimizer's code; onebit's
// memory test checks them against StateBytes. Rank 0 holds the most:
// ZeRO's last rank may own fewer elements.
func StateBytes(optimizer string, tensors []int64, world int, bucketBytes int64) (int64, error) {
	var n int64
	for _, k := range tensors {
		if k < 0 {
			return 0, fmt.Errorf("costmodel: invalid state size: a tensor of %d elements", k)
		}
		n += k
	}
	if world < 1 || bucketBytes < 0 {
		return 0, fmt.Errorf("costmodel: invalid state size: %d ranks, buckets of %d bytes", world, bucketBytes)
	}
	if bucketBytes == 0 {
		bucketBytes = DefaultBucketBytes
	}
	switch optimizer {
	case OptAdam:
		return 8 * n, nil
	case OptLamb:
		return 8*n + 4*slices.Max(append([]int64{0}, tensors...)), nil
	case OptZeroAdam:
		if world == 1 {
			return 8 * n, nil
		}
		w := int64(world)
		part := (n + w - 1) / w
		if part == 0 {
			return 0, nil
		}
		b := min(max(bucketBytes/4/w, 1), part)
		rounds := (part + b - 1) / b
		b = (part + rounds - 1) / rounds
		owned := min(part, n)
		return 8*owned + 4*(w+1)*b, nil
	case OptOnebitAdam:
		if !fits(n, world, max(bucketBytes/4, 1)) {
			return 0, errTooLarge
		}
		return 8*n + bucketStates(n, world, bucketBytes, false), nil
	case OptOnebitAdamSharded:
		if !fits(n, world, max(bucketBytes/4, 1)) {
			return 0, errTooLarge
		}
		if world == 1 {
			// Nothing to shard: it runs as OptOnebitAdam does.
			return 8 * n, nil
		}
		return shardedStates(n, world, bucketBytes), nil
	case OptOnebitAdamShardedBF16:
		if !fits(n, world, max(bucketBytes/4, 1)) {
			return 0, errTooLarge
		}
		if world == 1 {
			// Nothing to shard: it runs as OptOnebitAdam does, in float32.
			return 8 * n, nil
		}
		warm, comp := shardedBF16States(n, world, bucketBytes)
		return max(warm, comp), nil
	case OptOnebitAdamCompact:
		if !fits(n, world, max(bucketBytes/4, 1)) {
			return 0, errTooLarge
		}
		if world == 1 {
			// It runs as OptOnebitAdam does.
			return 8 * n, nil
		}
		// v; the buffer shared by the warm-up's m and every bucket's
		// worker error (each bucket's padded length, as a State's worker
		// error buffer: counted once, in the States); the rest of every
		// bucket's State, whose gathered signs keep m.
		return 4*n + bucketStates(n, world, bucketBytes, true), nil
	case OptOnebitLamb:
		if !fits(n, world, n) {
			return 0, errTooLarge
		}
		if world == 1 {
			return 16 * n, nil
		}
		return 16*n + onebitState(n, int64(world)), nil
	case OptOnebitLambCompact:
		if !fits(n, world, n) {
			return 0, errTooLarge
		}
		if world == 1 || n == 0 {
			return 16 * n, nil // it runs as StateFull
		}
		// v, v_fresh, the fused State (whose gathered signs keep m); the
		// copy of the gathered messages and their scales (m_last); two
		// unpacking blocks of at most lambBlockLen floats.
		w := int64(world)
		c := onebitPaddedLen(n, world) / w
		block := min(lambBlockLen, c, n)
		return 8*n + onebitState(n, w) + w*(4+c/8) + 4*w + 2*4*block, nil
	case OptZeroOneAdam:
		if !fits(n, world, 1) {
			return 0, errTooLarge
		}
		if world == 1 {
			return 12 * n, nil
		}
		states := make([]stateCount, len(tensors))
		for i, k := range tensors {
			states[i] = stateCount{onebitParts(k, int64(world)), 1}
		}
		return 16*n + statesBytes(false, states), nil
	}
	return 0, fmt.Errorf("costmodel: unknown optimizer %q", optimizer)
}

// MuonStateBytes returns the bytes of exact Muon's state (optim.Muon's
// StateBytes, with float32 gradient averaging; the same on every rank) for
// the Muon parameters, given as matrices of rows x cols elements (a tensor
// of higher rank as its first dimension by the product of the others), and
// other float32 elements updated by its auxiliary AdamW: the momentum of
// every matrix, 4 bytes per element; the Newton-Schulz work matrices, for
// each distinct shape r x c with r <= c (a matrix and its transpose share
// them), 4(2rc + 2r²) bytes; AdamW's two moments, 8 bytes per other
// element.
func MuonStateBytes(matrices [][2]int64, other int64) (int64, error) {
	if other < 0 {
		return 0, fmt.Errorf("costmodel: invalid state size: %d elements of AdamW", other)
	}
	n := 8 * other
	seen := map[[2]int64]bool{}
	for _, m := range matrices {
		if m[0] < 0 || m[1] < 0 {
			return 0, fmt.Errorf("costmodel: invalid state size: a %d x %d matrix", m[0], m[1])
		}
		r, c := min(m[0], m[1]), max(m[0], m[1])
		n += 4 * r * c
		if r > 0 && !seen[[2]int64{r, c}] {
			seen[[2]int64{r, c}] = true
			n += 4 * (2*r*c + 2*r*r)
		}
	}
	return n, nil
}

// DefaultBucketBytes is optim.DefaultBucketBytes, what a bucketBytes of 0
// means to StateBytes (costmodel does not import optim; onebit's memory
// test checks that they agree).
const DefaultBucketBytes = 25 << 20

// errTooLarge refuses a state whose size in bytes overflows an int64.
var errTooLarge = errors.New("costmodel: optimizer state too large to count in bytes")

// fits reports whether the 1-bit state of n elements in buckets of per
// elements on world ranks has a size that an int64 holds: each bucket
// pads to a multiple of world*lcm(world, 8) and keeps about 6 bytes per
// padded element, plus 40*world bytes of messages and norms.
func fits(n int64, world int, per int64) bool {
	w := float64(world)
	pad := float64(onebitPadUnit(world))
	buckets := math.Ceil(float64(n) / float64(max(per, 1)))
	padded := float64(n) + buckets*pad
	return 30*float64(n)+8*padded+buckets*300*w < 1<<62
}

// cutBucketStates is bucketStates of a flat buffer of a+b elements whose
// buckets are also cut after element a (1-bit Muon's layout with
// onebit.MuonConfig.WarmupAdamWOnly: the Muon group's elements, then the
// AdamW group's), the two parts' States sharing one set of wire buffers.
func cutBucketStates(a, b int64, world int, bucketBytes int64, keep bool) int64 {
	if world < 2 {
		return 0
	}
	w := int64(world)
	per := max(bucketBytes/4, 1)
	return statesBytes(keep, []stateCount{{onebitParts(per, w), a / per}, {onebitParts(a%per, w), 1},
		{onebitParts(per, w), b / per}, {onebitParts(b%per, w), 1}})
}

// bucketStates is the bytes of the onebit.State of every bucket of a flat
// buffer of n elements cut in buckets of bucketBytes; keep: see
// statesBytes.
func bucketStates(n int64, world int, bucketBytes int64, keep bool) int64 {
	return cutBucketStates(n, 0, world, bucketBytes, keep)
}

// shardedStates is the bytes the sharded mode of 1-bit Adam keeps per
// bucket of a flat buffer of n elements cut in buckets of bucketBytes on
// world > 1 ranks (onebit/sharded.go, newSharded): the bucket's
// onebit.State and the rank's shards of m and v, C = N/world floats each.
func shardedStates(n int64, world int, bucketBytes int64) int64 {
	w := int64(world)
	per := max(bucketBytes/4, 1)
	bucket := func(k int64) stateParts {
		p := onebitParts(k, w)
		if k > 0 {
			p.own += 2 * 4 * (onebitPaddedLen(k, world) / w)
		}
		return p
	}
	return statesBytes(false, []stateCount{{bucket(per), n / per}, {bucket(n % per), 1}})
}

// shardedBF16States is the bytes the sharded mode of 1-bit Adam with
// BF16WorkerError|BF16Variance keeps on world > 1 ranks (onebit/sharded.go,
// newSharded and setCompressing) in the warm-up and in the compression
// stage. Per bucket of N padded elements, C = N/world: the bucket's
// onebit.State without its worker error buffer and the rank's shard of m
// (C floats), then v, C floats in the warm-up and C bfloat16 in the
// compression stage, and the worker error, N bfloat16 in the compression
// stage only. Both add the float32 staging block of the warm-up's
// exchanges, as long as the largest bucket's padded length but at most
// stagingBlock elements per rank.
func shardedBF16States(n int64, world int, bucketBytes int64) (warm, comp int64) {
	if n <= 0 {
		return 0, 0
	}
	w := int64(world)
	per := max(bucketBytes/4, 1)
	bucket := func(k int64) (warm, comp stateParts) {
		if k <= 0 {
			return
		}
		padded := onebitPaddedLen(k, world)
		c := padded / w
		rest := onebitParts(k, w)
		rest.own += -4*padded + 4*c
		warm, comp = rest, rest
		warm.own += 4 * c
		comp.own += 2*c + 2*padded
		return warm, comp
	}
	fullWarm, fullComp := bucket(per)
	lastWarm, lastComp := bucket(n % per)
	largest := per // the padded length grows with the length
	if n < per {
		largest = n
	}
	block := 4 * min(onebitPaddedLen(largest, world), stagingBlock*w)
	warm = statesBytes(false, []stateCount{{fullWarm, n / per}, {lastWarm, 1}})
	comp = statesBytes(false, []stateCount{{fullComp, n / per}, {lastComp, 1}})
	return warm + block, comp + block
}

// Constants of onebit's compressed allreduce (onebit/allreduce.go,
// onebit/header.go) and errorfeedback.Norm.
const (
	sumBlock      = 16 << 10  // server accumulator block
	progressBlock = 256 << 10 // the blocks of the residual passes, whose signs go to a sink
	headerLen     = 8
	normBytes     = 32*8 + 8 // errorfeedback.Norm: 32 float64 lanes and a count
	// stagingBlock is the elements per rank of the float32 block that
	// stages the sharded mode's warm-up exchanges when its worker errors
	// are bfloat16 (onebit/sharded.go).
	stagingBlock = 16 << 10
	// lambBlockLen is the floats of the blocks 1-bit LAMB's compact mode
	// unpacks its momenta in (onebit/lamb_compact.go).
	lambBlockLen = 4 << 10
)

// stateParts is one onebit.State of numel elements on w ranks, in bytes,
// split into what the State keeps for itself (own: the worker error, N
// floats with N = onebit.PaddedLen(numel, w); the server error, N/w; the
// header and headers, scales and norms) and the wire buffers, which the
// buckets of one optimizer share (onebit's buckets.shareWire): the server
// accumulator, the packed signs sent (N/8 + 4w bytes, which the phase 2 message
// reuses), the signs received (which the gathered phase 2 messages reuse:
// w*(4+C/8) bytes), the sink of the signs the residual passes pack again
// (min(progressBlock, N)/8), and piece mid of a pipelined call.
type stateParts struct {
	own, acc, send, recv, sink, midSend, midRecv int64
}

func onebitParts(numel, w int64) stateParts {
	if numel <= 0 {
		return stateParts{}
	}
	n := onebitPaddedLen(numel, int(w))
	c := n / w
	cb := c / 8
	p := stateParts{
		own:  4*n + 4*c + (1+w)*headerLen + 2*4*w + w*normBytes, // errors, headers, scales, norms
		acc:  4 * min(c, sumBlock),
		send: n/8 + 4*w, // each segment followed by the worker scale
		recv: w * (4 + cb),
		sink: min(progressBlock, n) / 8,
	}
	if pieces, pb := onebitPiecing(numel, int(w)); pieces > 1 {
		mid := int64(pieces) / 2
		midLen := min(pb, cb-mid*pb)
		p.midSend, p.midRecv = w*(midLen+4), w*(midLen+4)
	}
	return p
}

// onebitState is the bytes of one onebit.State of numel elements on w
// ranks: its own buffers and its wire buffers.
func onebitState(numel, w int64) int64 {
	return statesBytes(false, []stateCount{{onebitParts(numel, w), 1}})
}

// stateCount is count States alike.
type stateCount struct {
	p     stateParts
	count int64
}

// statesBytes is the bytes of the States of one optimizer's buckets: each
// State's own buffers, and each wire buffer once, as long as the longest
// bucket's; with keep, the received signs, which keep the gathered
// messages from one call to the next (StateCompact's momentum), are every
// State's own.
func statesBytes(keep bool, states []stateCount) int64 {
	var own int64
	var wire stateParts
	for _, s := range states {
		if s.count == 0 {
			continue
		}
		own += s.count * s.p.own
		if keep {
			own += s.count * s.p.recv
		} else {
			wire.recv = max(wire.recv, s.p.recv)
		}
		wire.acc, wire.send = max(wire.acc, s.p.acc), max(wire.send, s.p.send)
		wire.sink, wire.midSend, wire.midRecv = max(wire.sink, s.p.sink), max(wire.midSend, s.p.midSend), max(wire.midRecv, s.p.midRecv)
	}
	return own + wire.acc + wire.send + wire.recv + wire.sink + wire.midSend + wire.midRecv
}
