package optim

// MemoryReporter is implemented by optimizers that can say how much memory
// their own state takes on this rank.
type MemoryReporter interface {
	// StateBytes returns the bytes of every buffer the optimizer allocated
	// and keeps, as allocated so far: moments, the error buffers of every
	// bucket, fused, staging and packing buffers, the gradient averager's
	// buffers. The parameters and gradients it was given are not counted,
	// nor are bookkeeping values whose size does not grow with the model.
	// Buffers allocated lazily (on the first step of a stage) are counted
	// once they exist, so the figure can grow over the first steps; it
	// never shrinks.
	StateBytes() int64
}

var (
	_ MemoryReporter = (*Adam)(nil)
	_ MemoryReporter = (*Lamb)(nil)
	_ MemoryReporter = (*GradAverager)(nil)
)

// Float32Bytes returns the bytes of the backing arrays of bufs, cap(b)*4
// for each b: what they occupy in memory, not what they hold.
func Float32Bytes(bufs ...[]float32) int64 {
	var n int64
	for _, b := range bufs {
		n += 4 * int64(cap(b))
	}
	return n
}

// StateBytes returns the bytes of m's buffers; see MemoryReporter.
func (a *Adam) StateBytes() int64 { return a.e.stateBytes() }

// StateBytes returns the bytes of l's buffers; see MemoryReporter.
func (l *Lamb) StateBytes() int64 { return l.e.stateBytes() }

func (e *exact) stateBytes() int64 {
	n := Float32Bytes(e.scratch) + e.avg.StateBytes()
	n += Float32Bytes(e.m...) + Float32Bytes(e.v...)
	for i := range e.m16 {
		n += 2 * int64(cap(e.m16[i])+cap(e.v16[i]))
	}
	return n
}

// StateBytes returns the bytes of the buffers g allocated, once the first
// Average made them: the flat gradient buffer of the fp16, bf16 and
// two-level modes and the fp16 and bf16 collective's wire buffers
// (ReduceFP32 averages in place and allocates none). The buffers of the
// two-level collective (quant.TwoLevel) are not counted yet. A nil g
// holds nothing.
func (g *GradAverager) StateBytes() int64 {
	if g == nil {
		return 0
	}
	return Float32Bytes(g.flat) + g.down.StateBytes()
}
