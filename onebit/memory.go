package onebit

import (
	"unsafe"

	"github.com/lowbit-ml/lowbit/errorfeedback"
	"github.com/lowbit-ml/lowbit/optim"
)

var (
	_ optim.MemoryReporter = (*Adam)(nil)
	_ optim.MemoryReporter = (*Lamb)(nil)
	_ optim.MemoryReporter = (*ZeroOneAdam)(nil)
	_ optim.MemoryReporter = (*State)(nil)
)

// StateBytes returns the bytes of the buffers st holds: both error
// buffers, the server accumulator, and the packing and wire buffers of the
// collective (signs, messages, headers, scales, the pipelined pieces).
func (st *State) StateBytes() int64 {
	if st == nil {
		return 0
	}
	return st.ownBytes() + distinctBytes(st.wire()...)
}

// StatesBytes returns the bytes of the buffers of states, the wire
// buffers they share (ShareWire) counted once.
func StatesBytes(states ...*State) int64 {
	return (&buckets{states: states}).stateBytes()
}

// ownBytes is the bytes of the buffers st never shares: the error buffers,
// the scales and the norms.
func (st *State) ownBytes() int64 {
	n := optim.Float32Bytes(st.WorkerError, st.ServerError, st.wscales, st.scales)
	return n + int64(cap(st.norms))*int64(unsafe.Sizeof(errorfeedback.Norm{}))
}

// wire is the buffers of st that may share memory with each other or with
// other States' (State.shareWire, buckets.shareWire), as bytes.
func (st *State) wire() [][]byte {
	server := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(st.server))), 4*cap(st.server))
	return [][]byte{st.sendSigns, st.recvSigns, st.serverMsg, st.gathered, st.header, st.headers, st.blockSigns, st.midSend, st.midRecv, server}
}

// stateBytes is the bytes of every bucket's State, the wire buffers they
// share counted once.
func (b *buckets) stateBytes() int64 {
	if b == nil {
		return 0
	}
	var n int64
	var wire [][]byte
	for _, st := range b.states {
		n += st.ownBytes()
		wire = append(wire, st.wire()...)
	}
	return n + distinctBytes(wire...)
}

// StateBytes returns the bytes of every buffer a allocated and keeps: both
// moments, the exp_avg masks, every bucket's State and the gradient
// averager's buffers; see optim.MemoryReporter.
func (a *Adam) StateBytes() int64 {
	if a.sh != nil {
		return a.sh.stateBytes()
	}
	if a.cp != nil {
		return optim.Float32Bytes(a.vflat) + optim.Float32Bytes(a.mask...) + a.cp.stateBytes() + a.avg.StateBytes() + a.late.bytes()
	}
	return optim.Float32Bytes(a.mflat, a.vflat) + optim.Float32Bytes(a.mask...) +
		a.bkt.stateBytes() + a.avg.StateBytes() + a.late.bytes()
}

// StateBytes returns the bytes of every buffer o allocated and keeps: m, v,
// v_fresh, the scratch buffer, the exp_avg masks, the fused State and the
// gradient averager's buffers (not the few scalars kept per parameter);
// in StateCompact, v, v_fresh, the masks, the fused State (whose gathered
// messages hold m), the packed copy of m_last and two unpacking blocks.
// Everything is allocated at construction (the averager's buffers aside,
// see optim.GradAverager): the figure after it is the peak of the run,
// but from the Load of a checkpoint whose error buffers were reset and
// whose m this group cannot pack to the next compression step (m held as
// float32 meanwhile, 4 more bytes per parameter). See
// optim.MemoryReporter.
func (o *Lamb) StateBytes() int64 {
	n := optim.Float32Bytes(o.m, o.v, o.vFresh, o.scratch) + optim.Float32Bytes(o.masks...)
	return n + o.ef.StateBytes() + o.cp.stateBytes() + o.avg.StateBytes() + o.late.bytes()
}

// StateBytes returns the bytes of every buffer o allocated and keeps: m, v,
// the anchors, the fused buffer of the compressed allreduce, the exp_avg
// masks, every bucket's State and the gradient averager's buffers; see
// optim.MemoryReporter.
func (o *ZeroOneAdam) StateBytes() int64 {
	n := optim.Float32Bytes(o.m...) + optim.Float32Bytes(o.v...) + optim.Float32Bytes(o.anchor...)
	n += optim.Float32Bytes(o.flat) + optim.Float32Bytes(o.masks...)
	return n + o.bkt.stateBytes() + o.avg.StateBytes() + o.late.bytes()
}

// distinctBytes is the capacity of the memory under bufs, each backing
// array counted once however many of bufs share it (the host collective
// lets buffers with separate lives share one; see State.shareWire). A
// shared array is counted with the largest capacity seen from its start.
func distinctBytes(bufs ...[]byte) int64 {
	largest := make(map[*byte]int, len(bufs))
	for _, b := range bufs {
		if cap(b) > 0 {
			base := unsafe.SliceData(b[:1])
			largest[base] = max(largest[base], cap(b))
		}
	}
	var n int64
	for _, c := range largest {
		n += int64(c)
	}
	return n
}
