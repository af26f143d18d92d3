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
)

// StateOptimizers lists the optimizers lowbit plan prints, in its order:
// those StateBytes knows but OptLamb, whose state depends on the largest
// tensor, which a plan does not know.
func StateOptimizers() []string {
	return []string{OptAdam, OptZeroAdam, OptOnebitAdam, OptOnebitLamb, OptZeroOneAdam}
}

// StateBytes returns the bytes of optimizer state that rank 0 of world
// ranks holds at its peak for a model whose parameter tensors have the
// given numbers of float32 elements, with fused buckets of bucketBytes (0:
// optim.DefaultBucketBytes), in each optimizer's default configuration (no
// exp_avg masks, float32 gradient averaging; 0/1 Adam's buckets one per
// parameter, its default): what the optimizer's StateBytes method
// (optim.MemoryReporter) reports after its first compression step. The
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
		return 8*n + bucketStates(n, world, bucketBytes), nil
	case OptOnebitLamb:
		if !fits(n, world, n) {
			return 0, errTooLarge
		}
		if world == 1 {
			return 16 * n, nil
		}
		return 16*n + onebitState(n, int64(world)), nil
	case OptZeroOneAdam:
		if !fits(n, world, 1) {
			return 0, errTooLarge
		}
		if world == 1 {
			return 12 * n, nil
		}
		var s int64
		for _, k := range tensors {
			s += onebitState(k, int64(world))
		}
		return 16*n + s, nil
	}
	return 0, fmt.Errorf("costmodel: unknown optimizer %q", optimizer)
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

// bucketStates is the bytes of the onebit.State of every bucket of a flat
// buffer of n elements cut in buckets of bucketBytes.
func bucketStates(n int64, world int, bucketBytes int64) int64 {
	if world < 2 {
		return 0
	}
	per := max(bucketBytes/4, 1)
	return n/per*onebitState(per, int64(world)) + onebitState(n%per, int64(world))
}

// Constants of onebit's compressed allreduce (onebit/allreduce.go) and
// errorfeedback.Norm.
const (
	sumBlock  = 16 << 10 // server accumulator block
	headerLen = 4 + 8
	normBytes = 32*8 + 8 // errorfeedback.Norm: 32 float64 lanes and a count
)

// onebitState is the bytes of one onebit.State of numel elements on w
// ranks: the worker error (N floats, N = onebit.PaddedLen(numel, w)), the
// server error (N/w), the server accumulator, the packed signs sent and
// received (N/8 each), the phase 2 messages, headers, scales and norms,
// and the pieces of a pipelined call.
func onebitState(numel, w int64) int64 {
	if numel <= 0 {
		return 0
	}
	n := onebitPaddedLen(numel, int(w))
	c := n / w
	cb := c / 8
	s := 4*n + 4*c + 4*min(c, sumBlock) // worker error, server error, accumulator
	s += 2 * n / 8                      // signs sent and received
	s += (1 + w) * (4 + cb)             // server message, gathered messages
	s += (1 + w) * headerLen            // header, headers
	s += 2 * 4 * w                      // worker and server scales
	s += w * normBytes                  // norms
	if pieces, pb := onebitPiecing(numel, int(w)); pieces > 1 {
		mid := int64(pieces) / 2
		midLen := min(pb, cb-mid*pb)
		s += pb + 2*w*(midLen+4) // scratch, midSend, midRecv
	}
	return s
}
