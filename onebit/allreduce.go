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

	sendSigns   []byte    // packed worker signs, N/8 bytes: W chunks of C/8
	recvSigns   []byte    // chunks received in phase 1, N/8 bytes
	serverMsg   []byte    // phase 2 message: packed server signs of this rank's chunk (C/8 bytes), then its scale
	allServer   []byte    // every rank's phase 2 message, gathered: W records of C/8+4 bytes
	server      []float32 // server accumulator c, C floats
	header      []byte    // this rank's scale and numel on the wire
	headers     []byte    // every rank's header
}

// headerLen is the bytes each rank contributes to a scale all-gather: its
// scale (little-endian float32) and the tensor length it called with
// (little-endian uint64), so that mismatched sizes are caught on every rank
// even when they pad to the same N.
const headerLen = 4 + 8

// NewState returns zeroed error buffers and scratch for a tensor of numel
// elements on a group of world ranks.
func NewState(numel, world int) (*State, error) {
	if numel < 0 || world < 1 {
		return nil, fmt.Errorf("onebit: invalid state size: %d elements on %d ranks", numel, world)
	}
	n := PaddedLen(numel, world)
	c := n / world
	return &State{
		WorkerError: errorfeedback.NewResidual(n),
		ServerError: errorfeedback.NewResidual(c),
		numel:       numel,
		world:       world,
		sendSigns:   make([]byte, n/8),
		recvSigns:   make([]byte, n/8),
		serverMsg:   make([]byte, c/8+4),
		allServer:   make([]byte, (c/8+4)*world),
		server:      make([]float32, c),
		header:      make([]byte, headerLen),
		headers:     make([]byte, headerLen*world),
	}, nil
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
// lengths: 32 times less than a float32 ring allreduce. It makes three
// collectives: the header all-gather, the phase 1 all-to-all and one phase
// 2 all-gather of signs and scale together. On a backend that checks every
// collective's arguments with an extra round trip (comm.CheckSkipper:
// comm/mpi), only the header pays it: the header proves that every rank has
// the same length, and every other length derives from it and the group
// size. So a call costs four round trips on MPI, not eight. With one rank the call still
// compresses (the output is the error-compensated sign compression of buf,
// as in the reference); optimizers skip the call when W = 1. With an empty
// buf it zeroes both error buffers and communicates nothing; so a rank with
// an empty buf among ranks with non-empty ones is not detected by this call:
// the others wait for it until their context ends.
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
	chunkBytes := chunkLen / 8

	// Worker side, steps 1-4: x = pad(buf) + worker_error, scale, new
	// worker_error, pack sgn(x). The W chunks of the packed bytes are the
	// W consecutive chunkBytes-long pieces of sendSigns.
	workerScale, err := st.WorkerError.Compress(st.sendSigns, buf)
	if err != nil {
		return fmt.Errorf("onebit: worker compression: %w", err)
	}

	// Phase 1: all-gather of the W worker scales (with every rank's numel,
	// checked before any tensor data moves), then all-to-all of the packed
	// chunks, chunk j to rank j. Once the header is through, every length
	// of this call is agreed: the two collectives that follow skip the
	// backend's argument check (comm.CheckSkipper).
	if err := st.exchangeScales(ctx, c, workerScale); err != nil {
		return fmt.Errorf("onebit: phase 1 scales: %w", err)
	}
	comm.SkipChecks(c, 2)
	if err := c.AllToAllBytes(ctx, st.sendSigns, st.recvSigns); err != nil {
		comm.SkipChecks(c, 0)
		return fmt.Errorf("onebit: phase 1 all-to-all: %w", err)
	}

	// Server side, steps 5-9, for this rank's chunk only:
	// c = sum over j, ascending, of (worker_scale_j / W) * unpack(chunk_j);
	// then c = c + server_error, server_scale, new server_error, pack sgn(c).
	signpack.UnpackScale(st.server, st.recvSigns[:chunkBytes], st.scale(0)/float32(w))
	for j := 1; j < w; j++ {
		signpack.UnpackScaleAdd(st.server, st.recvSigns[j*chunkBytes:(j+1)*chunkBytes], st.scale(j)/float32(w))
	}
	serverScale, err := st.ServerError.Compress(st.serverMsg[:chunkBytes], st.server)
	if err != nil {
		comm.SkipChecks(c, 0)
		return fmt.Errorf("onebit: server compression: %w", err)
	}

	// Phase 2: all-gather of the packed server chunks and of the W server
	// scales, in one collective: each rank's message is its packed chunk
	// followed by its scale.
	binary.LittleEndian.PutUint32(st.serverMsg[chunkBytes:], math.Float32bits(serverScale))
	if err := c.AllGatherBytes(ctx, st.serverMsg, st.allServer); err != nil {
		return fmt.Errorf("onebit: phase 2 all-gather: %w", err)
	}

	// Output: element i of chunk j is server_scale_j * unpack(...); the
	// first n elements replace buf.
	rec := chunkBytes + 4
	for j := 0; j < w; j++ {
		lo := j * chunkLen
		if lo >= len(buf) {
			break
		}
		hi := min(lo+chunkLen, len(buf))
		msg := st.allServer[j*rec : (j+1)*rec]
		scale := math.Float32frombits(binary.LittleEndian.Uint32(msg[chunkBytes:]))
		signpack.UnpackScale(buf[lo:hi], msg[:chunkBytes], scale)
	}
	return nil
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
