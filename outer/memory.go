package outer

import (
	"slices"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

var _ optim.MemoryReporter = (*Optimizer)(nil)

// StateBytes returns the bytes of the optimizer's buffers on this rank
// (optim.MemoryReporter): the inner optimizer's (when it reports them),
// θ_g, u (with a momentum), the exchange's buffers (a fragment's for the
// fp32, bf16 and int8 codecs; a bucket's for the 1-bit codec; a chunk's
// for the sparse codec; with a delay, θ_local at the launch and the
// staged θ_g and u of a fragment) and the codec's state: the 1-bit error
// buffers and wire buffers, the int8 messages, the sparse accumulator
// and messages (SparseTwoPhase: W segments each way, and the server
// accumulator of the chunks this rank owns). The parameters and gradients are not counted.
// Everything is allocated at construction. See docs/outer.md, "Memory".
func (o *Optimizer) StateBytes() int64 {
	n := optim.Float32Bytes(o.global, o.mom, o.work, o.xb, o.snap, o.stage)
	if m, ok := o.inner.(optim.MemoryReporter); ok {
		n += m.StateBytes()
	}
	if o.down != nil {
		n += o.down.StateBytes()
	}
	if q := o.i8; q != nil {
		n += int64(cap(q.send)+cap(q.recv)+cap(q.gsend)+cap(q.grecv)) + optim.Float32Bytes(q.chunk, q.acc, q.scales)
	}
	if s := o.sp; s != nil {
		n += optim.Float32Bytes(s.acc, s.mag, s.ef, s.srv) + 2*int64(cap(s.acc16)) + int64(cap(s.send)+cap(s.recv)+cap(s.idx)) + 4*int64(cap(s.offs)) + optim.Float32Bytes(s.vals)
	}
	return n + onebit.StatesBytes(slices.Concat(o.states...)...)
}
