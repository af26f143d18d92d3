// Package onebit holds the error-compensated 1-bit compressed allreduce and
// the optimizers built on it: 1-bit Adam, 1-bit LAMB and 0/1 Adam.
//
// AllReduce averages a float32 buffer over the ranks of a comm.Comm while
// sending one bit per element (plus a scale per chunk); the error the
// compression leaves is kept in a State, one per tensor and rank, and fed
// into the next call. AllReduceDevice does the same on device buffers
// (package accel) with a DeviceState, in the same wire format, so host and
// device ranks mix. The collective follows the spec page onebit.md step by
// step (allreduce.go).
//
// Adam (1-bit Adam), Lamb (1-bit LAMB) and ZeroOneAdam (0/1 Adam) are
// optim.Optimizers built on it; each type's documentation gives its
// algorithm. Adam and ZeroOneAdam compress in fused buckets of their
// config's BucketBytes (optim.PerParameter: one tensor at a time), with the
// error buffers of bucket k named BucketWorkerErrorName(k) and
// BucketServerErrorName(k) in checkpoints; Lamb compresses the momenta of
// the whole model as one buffer.
//
// Deliberately differs from the reference: elements whose second moment v
// is exactly zero when the optimizer starts compressing (no rank gave them
// a nonzero gradient in the warm-up, such as the embedding rows of tokens
// that never occurred) are held still, as exact Adam holds them: their
// compressed momentum (0/1 Adam: their compressed gradient or accumulator)
// is zeroed before the update, as an exp_avg mask of zero would. The
// reference divides the compression's noise there by eps and takes steps
// of about lr*scale/1e-8; a byte-level GPT's loss jumps when such a token
// first shows up. Such an element stays still until v changes: for the
// rest of training in 1-bit Adam and 1-bit LAMB (v is frozen), until the
// next variance update in 0/1 Adam. Adam with FreezeStep 0 (no warm-up, v
// zero everywhere) is left as the reference has it.
package onebit
