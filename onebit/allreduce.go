// Package onebit holds the error-compensated 1-bit compressed allreduce and
// the optimizers built on it: 1-bit Adam, 1-bit LAMB and 0/1 Adam.
//
// This file is the collective. It follows the spec page onebit.md step by
// step; the comments name the steps.
package onebit

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/errorfeedback"
	"github.com/lowbit-ml/lowbit/signpack"
)

// PaddedLen returns N, the length a tensor of n elements is handled as on w
// ranks: n rounded up to a multiple of w*lcm(w, 8), so that every rank's
// chunk N/w is a whole number of bytes when packed (w=1: 8, w=2: 16, w=3:
// 72, w=4: 32, w=8: 64).
func PaddedLen(n, w int) int {
	if n <= 0 {
		return 0
	}
	m := w * lcm(w, 8)
	return (n + m - 1) / m * m
}

func lcm(a, b int) int {
	g, h := a, b
	for h != 0 {
		g, h = h, g%h
	}
	return a / g * b
}

// State is the error-feedback state of one tensor on one rank, plus the
// buffers the collective reuses, so that a call allocates nothing. The
// caller owns it: an optimizer keeps one per parameter (or one for a fused
// flat buffer). The zero State is not usable; make one with NewState.
type State struct {
	// WorkerError is this rank's worker residual, PaddedLen(n, w) floats.
	WorkerError errorfeedback.Residual
	// ServerError is this rank's server residual for its own chunk,
	// PaddedLen(n, w)/w floats.
	ServerError errorfeedback.Residual

	numel, world int
	chunkBytes   int // C/8: the packed bytes of one chunk
	pieces       int // K: the pieces each chunk's bytes travel in (1: no pipelining)
	pieceBytes   int // packed bytes of every piece of a chunk but the last

	sendSigns []byte    // packed worker signs, N/8 bytes, piece-major (see sendPiece)
	recvSigns []byte    // phase 1 chunks received, N/8 bytes, piece-major
	server    []float32 // server accumulator c, C floats
	serverMsg []byte    // phase 2 message: server scale (4 bytes), then the packed server chunk (C/8)
	gathered  []byte    // every rank's phase 2 message, W*(4+C/8) bytes, piece-major (see msgPiece)
	header    []byte    // this rank's scale and numel on the wire
	headers   []byte    // every rank's header
	scales    []float32 // every rank's server scale, from piece 0 of phase 2

	// With pieces > 1 a goroutine per call issues the collectives in order
	// while the caller computes: ready hands it a piece (false: give up),
	// done returns each collective's error.
	ready chan bool
	done  chan error
	// The goroutine's function, made once so that starting it allocates
	// nothing, and the call's context and communicator it works with (set
	// only during a pipelined call).
	communicator func()
	ctx          context.Context
	comm         comm.Comm
}

// headerLen is the bytes each rank contributes to a scale all-gather: its
// scale (little-endian float32) and the tensor length it called with
// (little-endian uint64), so that mismatched sizes are caught on every rank
// even when they pad to the same N.
const headerLen = 4 + 8

// pieceTarget is the packed bytes per destination a piece of a pipelined
// call aims at, and maxPieces caps the pieces a chunk travels in. With 4
// ranks, tensors of 16 MiB and more are pipelined; a 64 MiB tensor goes in
// 8 pieces.
const (
	pieceTarget = 64 << 10
	maxPieces   = 16
)

// NewState returns zeroed error buffers and scratch for a tensor of numel
// elements on a group of world ranks.
func NewState(numel, world int) (*State, error) {
	if numel < 0 || world < 1 {
		return nil, fmt.Errorf("onebit: invalid state size: %d elements on %d ranks", numel, world)
	}
	n := PaddedLen(numel, world)
	c := n / world
	st := &State{
		WorkerError: errorfeedback.NewResidual(n),
		ServerError: errorfeedback.NewResidual(c),
		numel:       numel,
		world:       world,
		sendSigns:   make([]byte, n/8),
		recvSigns:   make([]byte, n/8),
		server:      make([]float32, c),
		serverMsg:   make([]byte, 4+c/8),
		gathered:    make([]byte, world*(4+c/8)),
		header:      make([]byte, headerLen),
		headers:     make([]byte, headerLen*world),
		scales:      make([]float32, world),
		chunkBytes:  c / 8,
	}
	st.setPieces(c/8/pieceTarget, world)
	st.communicator = st.communicate
	return st, nil
}

// setPieces cuts every chunk's packed bytes into at most k pieces (at least
// one; one is no pipelining). Pieces are whole bytes, all pieceBytes long
// but the last.
func (st *State) setPieces(k, world int) {
	chunkBytes := st.chunkBytes
	k = max(1, min(k, maxPieces, chunkBytes))
	st.pieceBytes = (chunkBytes + k - 1) / max(k, 1)
	st.pieces = 1
	if st.pieceBytes > 0 {
		st.pieces = (chunkBytes + st.pieceBytes - 1) / st.pieceBytes
	}
	if st.pieces > 1 && world > 1 {
		st.ready = make(chan bool, st.pieces+1)
		st.done = make(chan error, 2*st.pieces)
	} else {
		st.pieces, st.pieceBytes = 1, chunkBytes
		st.ready, st.done = nil, nil
	}
}

// Numel is the tensor length the state was made for.
func (s *State) Numel() int { return s.numel }

// World is the group size the state was made for.
func (s *State) World() int { return s.world }

// Reset zeroes both error buffers.
func (s *State) Reset() {
	s.WorkerError.Reset()
	s.ServerError.Reset()
}

// AllReduce replaces buf, on every rank, with the error-compensated 1-bit
// compressed average of buf over the ranks of c, and updates the error
// buffers in st. Every rank must call it with the same len(buf); st must
// have been made for len(buf) and c.Size(). Every rank ends with the same
// output.
//
// Each rank sends about 2(W-1)/W * N/8 bytes plus 2(W-1) scales and W-1
// lengths: 32 times less than a float32 ring allreduce. On a backend that
// checks every collective's arguments with an extra round trip
// (comm.CheckSkipper: comm/mpi), only the first collective, the header,
// pays it: the header proves that every rank has the same length, and every
// other length derives from it and the group size.
//
// Large tensors are pipelined: each chunk's packed bytes travel in pieces
// (of about 64 KiB per destination, at most 16), so that packing piece k+1
// overlaps sending piece k, the server sums pieces as they arrive, and the
// output is unpacked while the last pieces are still on the wire. The
// arithmetic is the same, element for element, so the output and the error
// buffers are bit-identical to an unpipelined call. A pipelined call runs
// its collectives on a goroutine of its own while the caller's goroutine
// computes; it returns only after that goroutine is done with c.
//
// With one rank the call still compresses (the output is the
// error-compensated sign compression of buf, as in the reference);
// optimizers skip the call when W = 1. With an empty buf it zeroes both
// error buffers and communicates nothing; so a rank with an empty buf among
// ranks with non-empty ones is not detected by this call: the others wait
// for it until their context ends.
func AllReduce(ctx context.Context, c comm.Comm, buf []float32, st *State) error {
	w := c.Size()
	if st == nil {
		return fmt.Errorf("onebit: nil state")
	}
	if st.numel != len(buf) || st.world != w {
		return fmt.Errorf("onebit: state made for %d elements on %d ranks, called with %d elements on %d ranks",
			st.Numel(), st.World(), len(buf), w)
	}
	if len(buf) == 0 {
		st.Reset()
		return nil
	}
	n := len(st.WorkerError)
	chunkLen := n / w

	// Worker side, steps 1-2: x = pad(buf) + worker_error (kept in the
	// worker error buffer until step 3) and worker_scale.
	workerScale, err := st.WorkerError.Compensate(buf)
	if err != nil {
		return fmt.Errorf("onebit: worker compression: %w", err)
	}

	// Phase 1, first half: all-gather of the W worker scales with every
	// rank's numel, checked before any tensor data moves. From here on every
	// length of this call is agreed, and the 2K collectives that follow skip
	// the backend's argument check.
	if err := st.exchangeScales(ctx, c, workerScale); err != nil {
		return fmt.Errorf("onebit: phase 1 scales: %w", err)
	}
	k := st.pieces
	comm.SkipChecks(c, 2*k)
	if k > 1 {
		st.ctx, st.comm = ctx, c
		defer st.release()
		go st.communicator()
	}

	// Worker side, steps 3-4, piece by piece: worker_error = x -
	// worker_scale * sgn(x) and pack sgn(x); then phase 1, second half:
	// all-to-all of the packed chunks (chunk j to rank j), one piece at a
	// time.
	for p := range k {
		for j := range w {
			lo := j*chunkLen + p*st.pieceBytes*8
			signpack.PackResidual(st.sendPiece(p, j), st.WorkerError[lo:lo+st.pieceLen(p)*8], workerScale)
		}
		if err := st.sendPhase1(ctx, c, p); err != nil {
			return st.fail(c, fmt.Errorf("onebit: phase 1 all-to-all: %w", err), false)
		}
	}

	// Server side, step 5, piece by piece as they arrive: c = sum over j,
	// ascending, of (worker_scale_j / W) * unpack(chunk received from j).
	for p := range k {
		if err := st.wait(); err != nil {
			return st.fail(c, fmt.Errorf("onebit: phase 1 all-to-all: %w", err), false)
		}
		lo := p * st.pieceBytes * 8
		acc := st.server[lo : lo+st.pieceLen(p)*8]
		signpack.UnpackScale(acc, st.recvPiece(p, 0), st.scale(0)/float32(w))
		for j := 1; j < w; j++ {
			signpack.UnpackScaleAdd(acc, st.recvPiece(p, j), st.scale(j)/float32(w))
		}
	}

	// Server side, steps 6-9, on the whole chunk: c = c + server_error,
	// server_scale, server_error = c - server_scale * sgn(c), pack sgn(c).
	serverScale, err := st.ServerError.Compress(st.serverMsg[4:], st.server)
	if err != nil {
		return st.fail(c, fmt.Errorf("onebit: server compression: %w", err), true)
	}

	// Phase 2: all-gather of the packed server chunks and of the W server
	// scales, together: each rank's message is its scale and then its
	// packed chunk, sent in the same pieces (the scale rides in piece 0).
	binary.LittleEndian.PutUint32(st.serverMsg[:4], math.Float32bits(serverScale))
	if err := st.sendPhase2(ctx, c); err != nil {
		return st.fail(c, fmt.Errorf("onebit: phase 2 all-gather: %w", err), false)
	}

	// Output, piece by piece as they arrive: element i of chunk j is
	// server_scale_j * unpack(...); the first n elements replace buf.
	for p := range k {
		if err := st.wait(); err != nil {
			return st.fail(c, fmt.Errorf("onebit: phase 2 all-gather: %w", err), false)
		}
		for j := range w {
			signs := st.msgPiece(p, j)
			if p == 0 {
				st.scales[j] = math.Float32frombits(binary.LittleEndian.Uint32(signs))
				signs = signs[4:]
			}
			lo := j*chunkLen + p*st.pieceBytes*8
			if lo >= len(buf) {
				break
			}
			hi := min(lo+len(signs)*8, len(buf))
			signpack.UnpackScale(buf[lo:hi], signs, st.scales[j])
		}
	}
	return nil
}

// pieceLen is the packed bytes per destination of piece p.
func (st *State) pieceLen(p int) int {
	return min(st.pieceBytes, st.chunkBytes-p*st.pieceBytes)
}

// sendPiece is where the packed bytes of piece p of chunk j go. The send
// and receive buffers of phase 1 are piece-major: piece p is one contiguous
// all-to-all buffer of W segments, segment j for (or from) rank j.
func (st *State) sendPiece(p, j int) []byte {
	off := p*st.pieceBytes*st.world + j*st.pieceLen(p)
	return st.sendSigns[off : off+st.pieceLen(p)]
}

// recvPiece is piece p of the chunk received from rank j.
func (st *State) recvPiece(p, j int) []byte {
	off := p*st.pieceBytes*st.world + j*st.pieceLen(p)
	return st.recvSigns[off : off+st.pieceLen(p)]
}

// phase1 returns the send and receive buffers of piece p's all-to-all.
func (st *State) phase1(p int) (send, recv []byte) {
	off, n := p*st.pieceBytes*st.world, st.pieceLen(p)*st.world
	return st.sendSigns[off : off+n], st.recvSigns[off : off+n]
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

// sendPhase1 puts piece p of phase 1 on the wire: at once without
// pipelining, else by handing it to the communicating goroutine.
func (st *State) sendPhase1(ctx context.Context, c comm.Comm, p int) error {
	if st.pieces == 1 {
		send, recv := st.phase1(p)
		return c.AllToAllBytes(ctx, send, recv)
	}
	st.ready <- true
	return nil
}

// sendPhase2 puts phase 2 on the wire, like sendPhase1.
func (st *State) sendPhase2(ctx context.Context, c comm.Comm) error {
	if st.pieces == 1 {
		send, recv := st.phase2(0)
		return c.AllGatherBytes(ctx, send, recv)
	}
	st.ready <- true
	return nil
}

// wait returns when the next collective of a pipelined call is done, with
// its error; without pipelining the collective is done already.
func (st *State) wait() error {
	if st.pieces == 1 {
		return nil
	}
	return <-st.done
}

// communicate is the goroutine of a pipelined call: the K all-to-alls of
// phase 1, then the K all-gathers of phase 2, each piece once the caller
// has made it ready. It stops at the first error (after reporting it) or
// when the caller gives up.
func (st *State) communicate() {
	ctx, c := st.ctx, st.comm
	for p := range st.pieces {
		if !<-st.ready {
			return
		}
		send, recv := st.phase1(p)
		err := c.AllToAllBytes(ctx, send, recv)
		st.done <- err
		if err != nil {
			return
		}
	}
	if !<-st.ready {
		return
	}
	for p := range st.pieces {
		send, recv := st.phase2(p)
		err := c.AllGatherBytes(ctx, send, recv)
		st.done <- err
		if err != nil {
			return
		}
	}
}

// release forgets the context and communicator of a pipelined call once
// the goroutine is done with them.
func (st *State) release() { st.ctx, st.comm = nil, nil }

// fail ends a call that failed after the header and returns err. In a
// pipelined call it first makes sure the communicating goroutine is gone
// and both channels are empty for the next call: a goroutine that reported
// an error has returned, and pieces it never took are drained; a goroutine
// still alive (the caller failed while it waited for phase 2) is told to
// give up. Then it cancels what is left of the promise of agreed
// arguments.
func (st *State) fail(c comm.Comm, err error, alive bool) error {
	if st.pieces > 1 {
		if alive {
			st.ready <- false
		} else {
			for len(st.ready) > 0 {
				<-st.ready
			}
		}
	}
	comm.SkipChecks(c, 0)
	return err
}

// exchangeScales all-gathers this rank's scale together with the tensor
// length it was called with, checks that every rank has the same length,
// and leaves every rank's scale for st.scale.
func (st *State) exchangeScales(ctx context.Context, c comm.Comm, scale float32) error {
	binary.LittleEndian.PutUint32(st.header[0:4], math.Float32bits(scale))
	binary.LittleEndian.PutUint64(st.header[4:12], uint64(st.numel))
	if err := c.AllGatherBytes(ctx, st.header, st.headers); err != nil {
		return err
	}
	want := binary.LittleEndian.Uint64(st.headers[4:])
	for j := 1; j < st.world; j++ {
		if got := binary.LittleEndian.Uint64(st.headers[j*headerLen+4:]); got != want {
			return &comm.MismatchError{Collective: comm.CAllGather, What: "onebit tensor length",
				Rank: j, Got: int(got), Want: int(want)}
		}
	}
	return nil
}

// scale returns rank j's scale from the last exchange.
func (st *State) scale(j int) float32 {
	return math.Float32frombits(binary.LittleEndian.Uint32(st.headers[j*headerLen:]))
}
