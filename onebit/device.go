package onebit

// This file is the compressed allreduce of allreduce.go on device buffers:
// the same steps, with the tensor, both error buffers and the scratch on an
// accel.Device. Only the packed chunks and the scales cross to the host,
// where the communicator moves them.
//
// The error buffers hold their residuals in the carried form of package
// accel (x and the scale that packed it), so that each compression is one
// pass over its buffer: the worker's compensate, norm and pack
// (CompressCarried), and the server's accumulation of the received chunks
// with its compensate, norm and pack (SumCompressCarried). Errors and
// SetErrors convert to and from residuals, so checkpoints hold AllReduce's
// state.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/comm"
)

// DeviceState is State for AllReduceDevice: the error-feedback state of one
// tensor on one rank, held on a device, with the device and host scratch the
// collective reuses, so that a call allocates nothing. Make one with
// NewDeviceState and free its device memory with Close.
type DeviceState struct {
	dev          accel.Device
	numel, world int
	bufs         []accel.Buffer // every device allocation, for Close

	worker      accel.Span // worker error, carried: N floats
	serverErr   accel.Span // server error, carried: C floats
	sendSigns   accel.Span // packed worker signs, N/8 bytes, chunk after chunk
	recv        accel.Span // recvSigns, then recvScales (one copy from stage)
	recvSigns   accel.Span // chunks received in phase 1, N/8 bytes, rank after rank
	recvScales  accel.Span // their worker scales divided by W, W floats
	serverSigns accel.Span // packed server signs, C/8 bytes
	all         accel.Span // allSigns, then allScales (one copy from stage)
	allSigns    accel.Span // every rank's packed server chunk, N/8 bytes, rank after rank
	allScales   accel.Span // every rank's server scale, W floats

	// workerScale and serverScale are the scales that packed the carried
	// worker and server errors (0 for a residual held as it is).
	workerScale, serverScale float32

	// stage holds N/8 bytes on the host in the device's order (chunk
	// after chunk) on their way between the device and the wire buffers
	// of wire, which are laid out (pieces, headers) exactly as AllReduce's
	// so that device and host ranks work together; in phase 1 the W
	// scales of recvScales (phase 2: of allScales) follow them, from byte
	// scalesAt.
	stage    []byte
	scalesAt int
	host     accel.HostBuffer // page-locked memory holding stage and the wire's buffers, or nil
	wire     State

	// rows is the device's row copies where it has them: the packed
	// signs then move between the device's layout and the wire's buffers
	// in one strided copy per piece, with no pass over them on the host,
	// and stage holds only the W scales. With page-locked memory too, the
	// wire's buffers live in it (host).
	rows accel.RowCopier
}

// NewDeviceState allocates zeroed error buffers and scratch on dev for a
// tensor of numel elements on a group of world ranks.
func NewDeviceState(dev accel.Device, numel, world int) (*DeviceState, error) {
	if dev == nil {
		return nil, fmt.Errorf("onebit: nil device")
	}
	if numel < 0 || world < 1 || uint64(numel) > lenMask {
		return nil, fmt.Errorf("onebit: invalid state size: %d elements on %d ranks (at most 2^40 elements)", numel, world)
	}
	n := PaddedLen(numel, world)
	c := n / world
	scalesAt := (n/8 + 3) &^ 3 // 4-byte aligned
	wireLen := scalesAt + 4*world
	st := &DeviceState{dev: dev, numel: numel, world: world, scalesAt: scalesAt}
	st.wire.initWire(numel, world)
	ha, pinned := dev.(accel.HostAllocator)
	rc, rows := dev.(accel.RowCopier)
	switch {
	case rows && !pinned && numel > 0:
		st.rows, st.stage = rc, make([]byte, 4*world)
	case rows && numel > 0:
		// The wire's buffers move into page-locked memory, after the W
		// scales.
		w := &st.wire
		bufs := []*[]byte{&w.sendSigns, &w.recvSigns, &w.serverMsg, &w.gathered, &w.midSend, &w.midRecv}
		size := (4*world + 63) &^ 63
		for _, b := range bufs {
			size += (len(*b) + 63) &^ 63
		}
		h, err := ha.AllocHost(size)
		if err != nil {
			return nil, fmt.Errorf("onebit: device state for %d elements: %w", numel, err)
		}
		mem := h.Bytes()
		st.host, st.rows, st.stage = h, rc, mem[:4*world:4*world]
		at := (4*world + 63) &^ 63
		for _, b := range bufs {
			if *b == nil {
				continue
			}
			n := len(*b)
			*b = mem[at : at+n : at+n]
			at += (n + 63) &^ 63
		}
	default:
		st.stage = make([]byte, wireLen)
	}
	for _, a := range []struct {
		span  *accel.Span
		bytes int
	}{
		{&st.worker, 4 * n}, {&st.serverErr, 4 * c},
		{&st.sendSigns, n / 8}, {&st.recv, wireLen}, {&st.serverSigns, c / 8}, {&st.all, wireLen},
	} {
		b, err := dev.Alloc(a.bytes)
		if err != nil {
			return nil, errors.Join(fmt.Errorf("onebit: device state for %d elements: %w", numel, err), st.Close())
		}
		st.bufs = append(st.bufs, b)
		*a.span = accel.Whole(b)
	}
	st.recvSigns = st.recv.Sub(0, n/8)
	st.recvScales = st.recv.Sub(scalesAt, wireLen)
	st.allSigns = st.all.Sub(0, n/8)
	st.allScales = st.all.Sub(scalesAt, wireLen)
	return st, nil
}

// Numel is the tensor length the state was made for.
func (s *DeviceState) Numel() int { return s.numel }

// World is the group size the state was made for.
func (s *DeviceState) World() int { return s.world }

// Device is the device the state lives on.
func (s *DeviceState) Device() accel.Device { return s.dev }

// WorkerError is this rank's worker error on the device,
// PaddedLen(numel, world) floats, in the carried form of package accel
// (use Errors for the residuals).
func (s *DeviceState) WorkerError() accel.Span { return s.worker }

// ServerError is this rank's server error on the device, for its own
// chunk: PaddedLen(numel, world)/world floats, in the carried form of
// package accel (use Errors for the residuals).
func (s *DeviceState) ServerError() accel.Span { return s.serverErr }

// Errors copies both residuals to the host (for checkpoints and tests):
// worker must hold PaddedLen(numel, world) floats and server a world-th of
// that. They are the WorkerError and ServerError of AllReduce's State.
func (s *DeviceState) Errors(worker, server []float32) error {
	if err := s.dev.CopyOut(floatBytes(worker), s.worker); err != nil {
		return fmt.Errorf("onebit: worker error: %w", err)
	}
	if err := s.dev.CopyOut(floatBytes(server), s.serverErr); err != nil {
		return fmt.Errorf("onebit: server error: %w", err)
	}
	accel.Residuals(worker, s.workerScale)
	accel.Residuals(server, s.serverScale)
	return nil
}

// SetErrors copies both residuals from the host (to resume from a
// checkpoint); the lengths are those of Errors.
func (s *DeviceState) SetErrors(worker, server []float32) error {
	if err := s.dev.CopyIn(s.worker, floatBytes(worker)); err != nil {
		return fmt.Errorf("onebit: worker error: %w", err)
	}
	s.workerScale = 0 // a residual r is carried as (r, 0)
	if err := s.dev.CopyIn(s.serverErr, floatBytes(server)); err != nil {
		return fmt.Errorf("onebit: server error: %w", err)
	}
	s.serverScale = 0
	return nil
}

// Reset zeroes both error buffers.
func (s *DeviceState) Reset() error {
	s.workerScale, s.serverScale = 0, 0
	if err := s.dev.Zero(s.worker); err != nil {
		return fmt.Errorf("onebit: reset: %w", err)
	}
	if err := s.dev.Zero(s.serverErr); err != nil {
		return fmt.Errorf("onebit: reset: %w", err)
	}
	return nil
}

// Close frees the state's device memory. The state cannot be used
// afterwards.
func (s *DeviceState) Close() error {
	var errs []error
	if s.host != nil && len(s.bufs) > 0 {
		// A copy from the page-locked staging may still be in flight
		// (a call that failed after it was queued).
		if err := s.dev.Synchronize(); !errors.Is(err, accel.ErrFreed) {
			errs = append(errs, err) // a closed device has nothing in flight
		}
	}
	for _, b := range s.bufs {
		errs = append(errs, b.Free())
	}
	s.bufs = nil
	if s.host != nil {
		errs = append(errs, s.host.Free())
		s.host, s.stage = nil, nil
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("onebit: closing device state: %w", err)
	}
	return nil
}

// server runs the server side, steps 5-9, on the device: the received
// chunks (in stage, rank after rank) and their scales divided by W go to
// the device in one copy; one kernel accumulates them in ascending rank
// order (the sums of AllReduce's server), compensates with the server
// error and packs; the packed signs come back to the wire's phase 2
// message after its scale. It returns the server scale.
func (s *DeviceState) server(dev accel.Device, w int) (float32, error) {
	if err := s.received(dev, w); err != nil {
		return 0, fmt.Errorf("onebit: received signs to device: %w", err)
	}
	scale, err := dev.SumCompressCarried(s.serverSigns, s.serverErr, s.serverScale, s.recvSigns, s.recvScales)
	if err != nil {
		return 0, fmt.Errorf("onebit: server compression: %w", err)
	}
	s.serverScale = scale
	if err := dev.CopyOut(s.wire.serverMsg[4:], s.serverSigns); err != nil {
		return 0, fmt.Errorf("onebit: server signs to host: %w", err)
	}
	return scale, nil
}

// received puts the chunks received in phase 1 and their scales divided
// by W on the device: with row copies straight from the wire's buffers,
// else gathered into stage (fromWire) and copied in one piece.
func (s *DeviceState) received(dev accel.Device, w int) error {
	if s.rows == nil {
		s.fromWire(false)
	}
	s.putScales(s.wire.wscales, float32(w))
	if s.rows == nil {
		return dev.CopyIn(s.recv, s.stage[:s.recv.Len])
	}
	st := &s.wire
	for p := range st.pieces {
		src, pitch := st.recvRows(p)
		lo := p * st.pieceBytes
		if err := s.rows.CopyInRows(s.recvSigns.Sub(lo, s.recvSigns.Len), st.chunkBytes, src, pitch, st.pieceLen(p), w); err != nil {
			return err
		}
	}
	return dev.CopyIn(s.recvScales, s.stage[:4*w])
}

// putScales writes v[j]/div, for every rank j, where stage holds the
// scales of a copy to the device: after the signs, or, with row copies,
// alone.
func (s *DeviceState) putScales(v []float32, div float32) {
	at := s.scalesAt
	if s.rows != nil {
		at = 0
	}
	for j, x := range v {
		binary.LittleEndian.PutUint32(s.stage[at+4*j:], math.Float32bits(x/div))
	}
}

// sent puts the packed worker signs (on the device, chunk after chunk)
// into the wire's phase 1 send buffers (piece after piece): with row
// copies, one per piece, else through stage (toWire).
func (s *DeviceState) sent(dev accel.Device) error {
	if s.rows == nil {
		if err := dev.CopyOut(s.stage[:s.sendSigns.Len], s.sendSigns); err != nil {
			return err
		}
		s.toWire()
		return nil
	}
	st := &s.wire
	for p := range st.pieces {
		dst, pitch := st.sendRows(p)
		lo := p * st.pieceBytes
		if err := s.rows.CopyOutRows(dst, pitch, s.sendSigns.Sub(lo, s.sendSigns.Len), st.chunkBytes, st.pieceLen(p), s.world); err != nil {
			return err
		}
	}
	return nil
}

// gathered reads every rank's server scale from the phase 2 messages into
// wire.scales and, with row copies, puts the gathered signs on the device
// (allSigns), one copy per piece; without, it gathers them into stage
// (fromWire) for the caller to copy.
func (s *DeviceState) gathered(dev accel.Device) error {
	st := &s.wire
	if s.rows == nil {
		s.fromWire(true)
		return nil
	}
	for j := range s.world {
		st.scales[j] = st.msgScale(j)
	}
	for p := range st.pieces {
		src, pitch := st.gatheredRows(p)
		lo := p * st.pieceBytes
		if err := s.rows.CopyInRows(s.allSigns.Sub(lo, s.allSigns.Len), st.chunkBytes, src, pitch, st.pieceLen(p), s.world); err != nil {
			return err
		}
	}
	return nil
}

// toWire copies the packed worker chunks from stage (chunk after chunk)
// into the wire's phase 1 send buffer (piece-major).
func (s *DeviceState) toWire() {
	st := &s.wire
	for p := range st.pieces {
		for j := range s.world {
			off := j*st.chunkBytes + p*st.pieceBytes
			copy(st.sendPiece(p, j), s.stage[off:off+st.pieceLen(p)])
		}
	}
}

// fromWire gathers the wire's piece-major phase 1 receive buffer (phase
// 1) or phase 2 messages (phase 2) into stage, rank after rank; phase 2
// also leaves every rank's server scale in wire.scales.
func (s *DeviceState) fromWire(phase2 bool) {
	st := &s.wire
	for p := range st.pieces {
		for j := range s.world {
			var b []byte
			if phase2 {
				b = st.msgPiece(p, j)
				if p == 0 {
					st.scales[j] = math.Float32frombits(binary.LittleEndian.Uint32(b))
					b = b[4:]
				}
			} else {
				b = st.recvPiece(p, j)
			}
			copy(s.stage[j*st.chunkBytes+p*st.pieceBytes:], b)
		}
	}
}

// floatBytes is the memory of p as bytes.
func floatBytes(p []float32) []byte {
	if len(p) == 0 {
		return []byte{}
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&p[0])), 4*len(p))
}

// failedScale is the server scale a rank of AllReduceDevice sends when its
// own server compression failed: a signalling NaN, which no arithmetic
// produces, so no real scale is taken for it.
const failedScale = 0x7f80dead

// AllReduceDevice is AllReduce on a tensor that lives on a device: it
// replaces the numel float32 values of buf, a span on st's device, with the
// error-compensated 1-bit compressed average over the ranks of c, and
// updates the error buffers in st, which live on the same device. The
// algorithm, the wire format (pieces included) and the traffic are
// AllReduce's, so ranks on devices and ranks on the host can be mixed in
// one group; only the packed chunks and the scales are copied to and from
// the host, and only they cross the communicator. The collectives are
// issued one after the other (no overlap with the device's work).
//
// The norms are summed in the device's order: AllReduce sums the worker
// norm chunk by chunk in 32 lanes, a device's Compress sums the whole
// buffer its own way. So on any device, accel.CPU included, the errors and
// the output agree with AllReduce's within the spec's tolerance, and bit
// for bit unless a scale rounds to a neighbouring float32 (with accel.CPU,
// whose float64 sums differ from AllReduce's in the last bits only, that
// is about one scale in 10^8).
// Every rank must call it with the same numel; st must have been made for
// numel and c.Size(). A call allocates nothing. As in AllReduce, bad
// arguments on one rank, and a failure of its device before the header
// (the worker compression), are an error on every rank: that rank still
// takes part in the header, marking the call as refused.
func AllReduceDevice(ctx context.Context, c comm.Comm, buf accel.Span, st *DeviceState) (err error) {
	if c == nil {
		return fmt.Errorf("onebit: nil communicator")
	}
	w := c.Size()
	if st == nil {
		return refuse(ctx, c, fmt.Errorf("onebit: nil state"))
	}
	if buf.Len != 4*st.numel || st.world != w {
		return refuse(ctx, c, fmt.Errorf("onebit: state made for %d elements on %d ranks, called with %d bytes (%d elements) on %d ranks",
			st.numel, st.world, buf.Len, buf.Len/4, w))
	}
	if st.numel == 0 {
		if err := st.Reset(); err != nil {
			return refuse(ctx, c, err)
		}
		if err := st.wire.exchangeHeader(ctx, c); err != nil {
			return fmt.Errorf("onebit: phase 1 header: %w", err)
		}
		return nil
	}
	dev := st.dev
	wire := &st.wire
	wire.beginCall()
	defer func() { wire.endCall(err) }()
	n := st.worker.Elems()
	chunkLen := n / w
	chunkBytes := chunkLen / 8

	// Worker side, steps 1-4, on the device, in one pass.
	workerScale, err := dev.CompressCarried(st.sendSigns, st.worker, st.workerScale, buf)
	if err != nil {
		return refuse(ctx, c, fmt.Errorf("onebit: worker compression: %w", err))
	}
	st.workerScale = workerScale
	if err := st.sent(dev); err != nil {
		return refuse(ctx, c, fmt.Errorf("onebit: worker signs to host: %w", err))
	}

	// Phase 1: the header (with the length check), then the packed chunks
	// in AllReduce's pieces, with the worker scales where AllReduce sends
	// them: after every segment of the only piece of an unpipelined call,
	// of piece mid of a pipelined one. Once the header is through, every
	// length of this call is agreed: the 2K collectives that follow skip
	// the backend's argument check, as in AllReduce; a failure in between
	// cancels that promise.
	k := wire.pieces
	wire.putWorkerScale(workerScale)
	if err := wire.exchangeHeader(ctx, c); err != nil {
		return fmt.Errorf("onebit: phase 1 header: %w", err)
	}
	comm.SkipChecks(c, 2*k)
	for p := range k {
		send, recv := wire.phase1(p)
		if err := c.AllToAllBytes(ctx, send, recv); err != nil {
			comm.SkipChecks(c, 0)
			return fmt.Errorf("onebit: phase 1 all-to-all: %w", err)
		}
	}
	wire.getWorkerScales()
	// A rank whose server side fails still takes part in phase 2, with
	// failedScale in place of its scale, so that its peers return an error
	// naming it instead of waiting for it.
	serverScale, serverErr := st.server(dev, w)
	scaleBits := math.Float32bits(serverScale)
	if serverErr != nil {
		scaleBits = failedScale
	}

	// Phase 2: every rank's scale and packed server chunk, in pieces, as in
	// AllReduce.
	binary.LittleEndian.PutUint32(wire.serverMsg[:4], scaleBits)
	for p := range k {
		send, recv := wire.phase2(p)
		if err := c.AllGatherBytes(ctx, send, recv); err != nil {
			comm.SkipChecks(c, 0)
			return errors.Join(serverErr, fmt.Errorf("onebit: phase 2 all-gather: %w", err))
		}
	}
	if serverErr != nil {
		return serverErr
	}
	for j := range w {
		if math.Float32bits(wire.msgScale(j)) == failedScale {
			return fmt.Errorf("onebit: rank %d failed its server compression (its error says why)", j)
		}
	}
	if err := st.gathered(dev); err != nil {
		return fmt.Errorf("onebit: gathered signs to device: %w", err)
	}

	// Output: chunk j is server_scale_j * unpack(chunk j); the first numel
	// elements replace buf. A device that unpacks every chunk in one
	// operation gets the signs and the scales in one copy.
	if cu, ok := dev.(accel.ChunkUnpacker); ok {
		st.putScales(wire.scales, 1)
		var err error
		if st.rows != nil { // the signs are on the device already
			err = dev.CopyIn(st.allScales, st.stage[:4*w])
		} else {
			err = dev.CopyIn(st.all, st.stage[:st.all.Len])
		}
		if err != nil {
			return fmt.Errorf("onebit: gathered signs to device: %w", err)
		}
		if err := cu.UnpackScaleChunks(buf, st.allSigns.Sub(0, accel.PackedLen(st.numel)), chunkLen, st.allScales); err != nil {
			return fmt.Errorf("onebit: output: %w", err)
		}
		if err := dev.Synchronize(); err != nil {
			return fmt.Errorf("onebit: output: %w", err)
		}
		return nil
	}
	if st.rows == nil { // else the signs are on the device already
		if err := dev.CopyIn(st.allSigns, st.stage[:n/8]); err != nil {
			return fmt.Errorf("onebit: gathered signs to device: %w", err)
		}
	}
	for j := 0; j < w; j++ {
		lo := j * chunkLen
		if lo >= st.numel {
			break
		}
		hi := min(lo+chunkLen, st.numel)
		packed := st.allSigns.Sub(j*chunkBytes, j*chunkBytes+accel.PackedLen(hi-lo))
		if err := dev.UnpackScale(buf.Sub(4*lo, 4*hi), packed, wire.scales[j]); err != nil {
			return fmt.Errorf("onebit: output: %w", err)
		}
	}
	if err := dev.Synchronize(); err != nil {
		return fmt.Errorf("onebit: output: %w", err)
	}
	return nil
}
