// Package onebit holds the error-compensated 1-bit compressed allreduce and
// the optimizers built on it: 1-bit Adam, 1-bit LAMB, 0/1 Adam and 1-bit
// Muon.
//
// AllReduce averages a float32 buffer over the ranks of a comm.Comm while
// sending one bit per element (plus a scale per chunk); the error the
// compression leaves is kept in a State, one per tensor and rank, and fed
// into the next call. AllReduceDevice does the same on device buffers
// (package accel) with a DeviceState, in the same wire format, so host and
// device ranks mix. The collective follows the spec page onebit.md step by
// step (allreduce.go).
//
// Adam (1-bit Adam), Lamb (1-bit LAMB), ZeroOneAdam (0/1 Adam) and Muon
// (1-bit Muon: each rank's momentum orthogonalized, the updates averaged
// through the exchange; docs/muon.md) are optim.Optimizers built on it;
// each type's documentation gives its algorithm. Adam, ZeroOneAdam and
// Muon compress in fused buckets of their config's BucketBytes
// (optim.PerParameter: one tensor at a time), with the error buffers of
// bucket k named BucketWorkerErrorName(k) and BucketServerErrorName(k) in
// checkpoints; Lamb compresses the momenta of the whole model as one
// buffer.
//
// # Memory
//
// Adam keeps its state in one of three modes (AdamConfig.StateMode), with
// the bytes per parameter of each on 4 ranks (TestStateBytes, a million
// parameters): StateFull, both moments whole on every rank and the error
// buffers of the compressed momentum (13.3; exact Adam needs 8);
// StateCompact, the same steps bit for bit with the momentum kept as the
// bits and scales the allreduce gathers (9.3); StateSharded, the moments
// sharded over the ranks, the gradient compressed on its way to each
// chunk's owner and the owner's update on its way back, each with its own
// error feedback (docs/sharded.md: 4 + 12/W and the wire buffers, 7.3; 5.1
// with AdamConfig.BF16's bfloat16 worker error and variance). Lamb keeps
// its state in StateFull (21.3) or StateCompact (13.5: m and the last
// step's m as packed signs, the update computed twice instead of kept).
// Every mode's
// buckets share one set of wire buffers, so on a model of many buckets the
// figures lose most of their wire buffers' 0.25 (64M parameters: 13.04,
// 9.15, 7.04 and 4.54). Regroup
// carries the error feedback of every mode, and of Lamb, ZeroOneAdam and
// Muon, to another number of ranks, from and to one rank included. Muon
// keeps 13 bytes per element of a Muon matrix on 4 ranks in StateFull
// (this rank's momentum, its slot of the exchange, the error buffers), 7
// in StateCompact (no slot, the worker error in bfloat16) and 5 with
// MuonConfig.MomentumBF16, besides the wire buffers and the Newton-Schulz
// work matrices (docs/muon.md).
//
// # Elements with no variance
//
// Deliberately differs from the reference: the ratio
// r = m_hat/(sqrt(v_hat)+eps) of every compression-stage update (1-bit Adam
// and 1-bit LAMB after FreezeStep, every step of 0/1 Adam: phase A, its
// local steps and its synchronizations) is bounded element by element
// (optim.RatioBound, ratioBound in late.go):
//
//   - |r| up to the cap, CapFactor times the largest ratio exact Adam ever
//     reaches (optim.AdamRatioBound: 7.27 at betas 0.9 and 0.999, so a cap
//     of 72.7), is left alone: every ordinary element, and the DeepSpeed
//     step runs and the conformance vectors, are untouched;
//   - beyond the cap, up to KneeRatio (1000), r is clipped to the cap: no
//     element steps farther than CapFactor times what exact Adam could;
//   - beyond the knee, where v_hat is a millionth of the square of the
//     compressed momentum or less, v no longer tells the element's scale,
//     and the bound falls continuously as cap*KneeRatio/|r| down to 1, the
//     ratio exact Adam takes under a steady gradient.
//
// An element whose v is tiny, or first given gradient after the warm-up
// (the embedding row of a token first seen then), thus steps by lr in the
// direction of its compressed momentum: it trains at about exact Adam's
// rate (on the probe of TestLateElementsTrain, 1.94 against exact Adam's
// 1.99 in 200 steps for 1-bit Adam, 0.65 for 1-bit LAMB, 3.4 for 0/1
// Adam). The reference divides its compression noise by eps instead, and
// takes steps of about lr*scale/1e-8 (a byte-level GPT's loss jumps when
// such a token first shows up). The rule is a function of the step's
// values alone: nothing is added to the state or to checkpoints.
//
// # Elements with no gradient
//
// Deliberately differs from the reference, too: an element whose gradient
// has been zero on every rank at every step does not move (with weight
// decay, it decays exactly as exact Adam decays it), in every optimizer
// and mode (1-bit Muon's AdamW group included), as in exact Adam. The compressed momentum alone would move it:
// 1-bit compression gives every element of a chunk ±scale, and the error
// feedback only cancels that noise over time (before this rule the rows
// of bytes that never occur in the GPT example, integrations/gomlx/
// examples/gpt -late-bytes, moved by 0.0017 RMS in 300 steps under 1-bit
// Adam and 0.040 under 0/1 Adam, whose local steps carry the momentum of
// a synchronization, against initial values of 0.089 RMS). So:
//
//   - an element whose v is exactly zero (no gradient has reached its
//     variance: the warm-up's, or 0/1 Adam's variance steps) takes the
//     ratio 0 in every compression-stage update (optim.RatioBound.Of),
//     StateSharded's decompressed updates included; 0/1 Adam also keeps
//     its momentum at zero (the compressed gradient of phase A is not
//     added to it, and a synchronization sets it to zero);
//   - at every compressed step while some element's v is zero, every rank
//     writes a bit per such element, whether it gave it gradient (in 0/1
//     Adam's phase B, since the last synchronization: the bits travel at
//     synchronizations), the bits are or-ed over the ranks (one
//     AllGatherBytes of a bit per such element; none when there is none,
//     the usual case), and each element some rank gave gradient has its v
//     set to 2^-100 at the end of the step, on every rank alike: from the
//     next step on it trains by the bound above, as a v of zero did
//     before the rule;
//   - the elements whose v is zero are kept as a bit per element (N/8
//     bytes, only while some element is left), so that a step visits them
//     without reading v; StateSharded, whose ranks hold v of their own
//     chunks only, gathers it from the owners once after the warm-up and
//     after each Load (N/8 bytes in all).
//
// Every decision depends on v and on the gathered bits, the same on every
// rank: the ranks stay bit-identical, and a checkpoint (which holds v)
// resumes bit-identically. An element whose gradient is too small for
// float32 to square into v (below about 1e-22) counts as one without
// gradient until the compression stage sees it. Adam with FreezeStep 0
// (v zero everywhere) thus moves nothing in its first step, and from the
// second on takes sign steps of lr where the first gave gradient.
package onebit
