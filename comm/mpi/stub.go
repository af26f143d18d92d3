//go:build !mpi

package mpi

import "github.com/lowbit-ml/lowbit/comm"

// Built reports whether this binary was built with the mpi build tag, that
// is, whether Open can work.
const Built = false

// Open would initialize MPI and return the world communicator; this binary
// was built without the mpi build tag, so it returns ErrNotBuilt.
func Open(opts ...Option) (comm.Comm, error) {
	_ = newOptions(opts)
	return nil, ErrNotBuilt
}
