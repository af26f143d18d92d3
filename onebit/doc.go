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
package onebit
