package zero

import "github.com/lowbit-ml/lowbit/optim"

var _ optim.MemoryReporter = (*Adam)(nil)

// StateBytes returns the bytes of every buffer a allocated and keeps (see
// optim.MemoryReporter): the moments of its own elements, the staging
// bucket and chunk of the flat modes, every buffer of the qgZ
// reduce-scatter in the int8 and int4 modes (its byte codes too, which
// StateFloats leaves out), and the coalesced mode's buffers.
func (a *Adam) StateBytes() int64 {
	n := 4 * int64(a.StateFloats()-a.qgzFloats)
	if q, ok := a.rs.(qgzReducer); ok {
		n += q.q.StateBytes()
	}
	return n
}
