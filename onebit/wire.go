package onebit

// Where the bytes of the 1-bit compressed allreduce (allreduce.go) lie on
// the wire: the piece-major send and receive buffers of phase 1, the
// worker scales after each segment of the piece that carries them, and
// the phase 2 messages as gathered.

import (
	"encoding/binary"
	"iter"
	"math"
)

// gatheredPiece is piece p of rank j's gathered phase 2 message: the
// signs of elements [lo, hi) of the tensor (padding left out: lo >= hi
// for a piece of padding only).
type gatheredPiece struct {
	j, lo, hi int
	signs     []byte
}

// gatheredPieces yields the gathered pieces of the last call, rank by
// rank.
func (st *State) gatheredPieces() iter.Seq[gatheredPiece] {
	return func(yield func(gatheredPiece) bool) {
		chunkLen := len(st.ServerError)
		for j := range st.world {
			for p := range st.pieces {
				signs := st.msgPiece(p, j)
				if p == 0 {
					signs = signs[4:]
				}
				lo := j*chunkLen + p*st.pieceBytes*8
				if !yield(gatheredPiece{j, lo, min(lo+len(signs)*8, st.numel), signs}) {
					return
				}
			}
		}
	}
}

// pieceLen is the packed bytes per destination of piece p.
func (st *State) pieceLen(p int) int {
	return min(st.pieceBytes, st.chunkBytes-p*st.pieceBytes)
}

// sendPiece is where the packed bytes of piece p of chunk j go. The send
// and receive buffers of phase 1 are piece-major: piece p is one contiguous
// all-to-all buffer of W segments, segment j for (or from) rank j. In the
// piece that carries the worker scales (scaled) every segment is followed
// by the sender's worker scale.
func (st *State) sendPiece(p, j int) []byte {
	n := st.pieceLen(p)
	if send, _, ok := st.scaled(p); ok {
		return send[j*(n+4) : j*(n+4)+n]
	}
	off := p*st.pieceBytes*st.world + j*n
	return st.sendSigns[off : off+n]
}

// recvPiece is piece p of the chunk received from rank j.
func (st *State) recvPiece(p, j int) []byte {
	n := st.pieceLen(p)
	if _, recv, ok := st.scaled(p); ok {
		return recv[j*(n+4) : j*(n+4)+n]
	}
	off := p*st.pieceBytes*st.world + j*n
	return st.recvSigns[off : off+n]
}

// scaled returns the send and receive buffers of piece p if its segments
// carry the worker scales (ok): the one piece of a whole-chunk call, in
// sendSigns and recvSigns, or piece mid of a pipelined call, in buffers of
// its own (the pieces before it are still in flight in sendSigns).
func (st *State) scaled(p int) (send, recv []byte, ok bool) {
	switch {
	case st.pieces == 1:
		n := st.world * (st.chunkBytes + 4)
		return st.sendSigns[:n], st.recvSigns[:n], true
	case p == st.mid:
		return st.midSend, st.midRecv, true
	}
	return nil, nil, false
}

// phase1 returns the send and receive buffers of piece p's all-to-all.
func (st *State) phase1(p int) (send, recv []byte) {
	if send, recv, ok := st.scaled(p); ok {
		return send, recv
	}
	off, n := p*st.pieceBytes*st.world, st.pieceLen(p)*st.world
	return st.sendSigns[off : off+n], st.recvSigns[off : off+n]
}

// putWorkerScale writes this rank's worker scale after every segment of
// the piece that carries the scales.
func (st *State) putWorkerScale(scale float32) {
	send, _, _ := st.scaled(st.mid)
	n := st.pieceLen(st.mid)
	for j := range st.world {
		binary.LittleEndian.PutUint32(send[j*(n+4)+n:], math.Float32bits(scale))
	}
}

// getWorkerScales reads every rank's worker scale from the piece that
// carries them, as received, into st.wscales.
func (st *State) getWorkerScales() {
	_, recv, _ := st.scaled(st.mid)
	n := st.pieceLen(st.mid)
	for j := range st.world {
		st.wscales[j] = math.Float32frombits(binary.LittleEndian.Uint32(recv[j*(n+4)+n:]))
	}
}

// msgOff and msgLen place piece p of a phase 2 message: piece 0 is the
// scale and the first packed bytes.
func (st *State) msgOff(p int) int {
	if p == 0 {
		return 0
	}
	return 4 + p*st.pieceBytes
}

func (st *State) msgLen(p int) int {
	if p == 0 {
		return 4 + st.pieceLen(0)
	}
	return st.pieceLen(p)
}

// phase2 returns the send and receive buffers of piece p's all-gather; the
// receive buffer is piece-major like phase 1's.
func (st *State) phase2(p int) (send, recv []byte) {
	off, n := st.msgOff(p), st.msgLen(p)
	return st.serverMsg[off : off+n], st.gathered[off*st.world : (off+n)*st.world]
}

// msgPiece is piece p of rank j's phase 2 message, as gathered.
func (st *State) msgPiece(p, j int) []byte {
	off, n := st.msgOff(p)*st.world+j*st.msgLen(p), st.msgLen(p)
	return st.gathered[off : off+n]
}

// msgScale is rank j's server scale in its gathered phase 2 message.
func (st *State) msgScale(j int) float32 {
	return math.Float32frombits(binary.LittleEndian.Uint32(st.msgPiece(0, j)))
}

// sendRows, recvRows and gatheredRows give piece p of the phase 1 send and
// receive buffers and of the gathered phase 2 messages as W rows of
// pieceLen(p) packed bytes, row j for rank j: the first row and the pitch
// between rows (AllReduceDevice copies each to or from a device in one
// strided copy).
func (st *State) sendRows(p int) ([]byte, int) {
	if send, _, ok := st.scaled(p); ok {
		return send, st.pieceLen(p) + 4
	}
	return st.sendSigns[p*st.pieceBytes*st.world:], st.pieceLen(p)
}

func (st *State) recvRows(p int) ([]byte, int) {
	if _, recv, ok := st.scaled(p); ok {
		return recv, st.pieceLen(p) + 4
	}
	return st.recvSigns[p*st.pieceBytes*st.world:], st.pieceLen(p)
}

func (st *State) gatheredRows(p int) ([]byte, int) {
	b := st.gathered[st.msgOff(p)*st.world:]
	if p == 0 {
		b = b[4:] // after rank 0's scale
	}
	return b, st.msgLen(p)
}
