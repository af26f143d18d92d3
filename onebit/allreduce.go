package onebit

// The 1-bit compressed allreduce on host buffers. It follows the spec page
// onebit.md step by step; the comments name the steps.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"iter"
	"math"
	"time"

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
	mid          int // pipelined: the worker scales travel with this piece

	// The cut of setPieces, which a tuning State uses on the calls that
	// send pieces (tune.go), and the tuner.
	pipePieces, pipePieceBytes, pipeMid int
	tune                                tuner

	// norms sums the squares of x = pad(buf) + worker_error, one run per
	// chunk, so that a pipelined call, which forms x piece by piece, gets
	// the same worker scale as an unpipelined one.
	norms []errorfeedback.Norm
	// serverNorm sums the squares of the server's c, piece by piece.
	serverNorm errorfeedback.Norm

	sendSigns []byte    // packed worker signs, N/8 + 4W bytes, piece-major (see sendPiece)
	recvSigns []byte    // phase 1 chunks received, N/8 + 4W bytes, piece-major
	server    []float32 // server accumulator c, one block of sumBlock floats (C if less) at a time
	serverMsg []byte    // phase 2 message: server scale (4 bytes), then the packed server chunk (C/8)
	gathered  []byte    // every rank's phase 2 message, W*(4+C/8) bytes, piece-major (see msgPiece)
	header    []byte    // this rank's numel and tuning fields on the wire
	headers   []byte    // every rank's header
	// blockSigns takes the signs the residual passes pack again, a block
	// at a time (the bytes sent may still be in use): min(progressBlock,
	// N)/8 bytes nobody reads.
	blockSigns []byte
	midSend    []byte    // pipelined: piece mid of phase 1, W segments each followed by the worker scale
	midRecv    []byte    // pipelined: piece mid as received, every rank's segment and worker scale
	wscales    []float32 // every rank's worker scale, from phase 1 (see scaled)
	sumSrcs    [][]byte  // the server's sum: the packed bytes of every rank's chunk it adds
	sumScales  []float32 // and their scales, worker_scale_j / W
	scales     []float32 // every rank's server scale, from piece 0 of phase 2

	// With pieces > 1 a goroutine per call issues the collectives in order
	// while the caller computes: ready hands it a piece, and done returns
	// each collective's error. Or, on a comm.Starter (starter, during the
	// call), the caller starts them: reqs[i] is the i-th (the K
	// all-to-alls, then the K all-gathers), begun at began[i]; issued
	// have been started, waited waited for.
	ready          chan struct{}
	done           chan error
	starter        comm.Starter
	reqs           [2 * maxPieces]comm.Request
	began          [2 * maxPieces]time.Time
	issued, waited int
	// early says that doneNext took the goroutine's report of the next
	// collective, earlyErr; wait returns it.
	early    bool
	earlyErr error
	// The goroutine's function, made once so that starting it allocates
	// nothing, and the call's context and communicator it works with (set
	// only during a pipelined call).
	communicator func()
	ctx          context.Context
	comm         comm.Comm

	// tracer, if not nil, receives the phases of every call (trace.go).
	tracer Tracer

	// The sharded mode of 1-bit Adam (sharded.go) runs the collective
	// with two changes. owner, when not nil, is called on every block of
	// the server's c (its offset in the chunk, then the block) after step
	// 5 and before step 6, and replaces c in place with what phase 2 is to
	// carry. keep leaves the output in gathered (read with outputs)
	// instead of unpacking it into buf.
	owner func(off int, c []float32)
	keep  bool
	// meanAbs makes the server scale of step 7 the mean of |c| (the scale
	// that minimizes the squared error of c's sign compression) instead
	// of its root mean square: the sharded mode's choice for its update,
	// whose heavy tail would otherwise set the step of every element.
	meanAbs bool
	// workerMeanAbs makes the worker scale of step 2 the mean of |x| too
	// (SetScale).
	workerMeanAbs bool
	// worker, when not nil, keeps the worker error outside WorkerError
	// (which is then empty): the call forms x a block at a time with it,
	// in the summing block, and hands it each block's new residual.
	worker workerSource

	// blocking keeps the calls on a comm.Starter from starting their
	// collectives (SetOverlap(false)); starts says in this call's header
	// that this rank can start them; started is whether the call started
	// them.
	blocking, starts, started bool
}

// workerSource forms x = pad(input) + worker_error for a State whose
// worker error it keeps itself (the sharded mode's bfloat16 one): the
// call asks for x twice, once to pack its signs and sum its squares, once
// for the residual, and both times it must get the same x.
type workerSource interface {
	// form writes x of elements [lo, lo+len(x)) of the padded tensor.
	form(x []float32, lo int)
	// keep stores the new worker error of elements [lo, lo+len(r)).
	keep(r []float32, lo int)
}

// headerLen is the bytes each rank contributes to the header all-gather:
// a little-endian uint64 whose low 40 bits are the tensor length it called
// with, so that mismatched sizes are caught on every rank even when they
// pad to the same N, and whose high 24 bits are the fields of the choice
// between whole chunks and pieces (tune.go): this call's pieces per chunk,
// whether the rank starts its collectives and how long its previous call
// took. The worker scales travel in phase 1 (see scaled).
const headerLen = 8

// pieceTarget is the packed bytes per destination a piece of a pipelined
// call aims at, and maxPieces caps the pieces a chunk travels in. With 4
// ranks, tensors of 16 MiB and more are pipelined; a 64 MiB tensor goes in
// 4 pieces of 128 KiB per destination. Every piece is a collective of its
// own, at which every rank waits for the slowest: on 4 ranks sharing 2
// cores and a 1 Gbit link, 4 pieces took 103.6 ms at p50 where 8 took
// 108-112 (make bench-net), and the unshaped and 10 Gbit calls were the
// same within their spread.
const (
	pieceTarget = 64 << 10
	maxPieces   = 4
)

// NewState returns zeroed error buffers and scratch for a tensor of numel
// elements on a group of world ranks.
func NewState(numel, world int) (*State, error) {
	if numel < 0 || world < 1 || uint64(numel) > lenMask {
		return nil, fmt.Errorf("onebit: invalid state size: %d elements on %d ranks (at most 2^40 elements)", numel, world)
	}
	n := PaddedLen(numel, world)
	st := &State{
		WorkerError: errorfeedback.NewResidual(n),
		ServerError: errorfeedback.NewResidual(n / world),
		server:      make([]float32, min(n/world, sumBlock)),
	}
	st.initWire(numel, world)
	st.shareWire()
	return st, nil
}

// shareWire lets the buffers of the host collective whose lives do not
// overlap share memory: the phase 2 message is packed once every phase 1
// all-to-all is over (so into the send buffer of phase 1), and the
// gathered messages arrive once the server has summed every received
// chunk (so into the receive buffer of phase 1). It saves N/8 + C/8 bytes
// per call; nothing a call leaves in them is read by the next.
func (st *State) shareWire() {
	c := len(st.ServerError)
	if len(st.sendSigns) >= 4+c/8 {
		st.serverMsg = st.sendSigns[:4+c/8]
	}
	recv := make([]byte, len(st.gathered))
	st.recvSigns = recv[:len(st.recvSigns)]
	st.gathered = recv
}

// initWire sets the sizes and makes the host buffers of the collective
// that do not hold error state: all a DeviceState needs of a State.
func (st *State) initWire(numel, world int) {
	n := PaddedLen(numel, world)
	c := n / world
	st.numel, st.world, st.chunkBytes = numel, world, c/8
	st.norms = make([]errorfeedback.Norm, world)
	st.sendSigns, st.recvSigns = make([]byte, n/8+4*world), make([]byte, n/8+4*world) // a whole-chunk call's scales after its segments
	st.serverMsg, st.gathered = make([]byte, 4+c/8), make([]byte, world*(4+c/8))
	st.header, st.headers = make([]byte, headerLen), make([]byte, headerLen*world)
	st.wscales, st.scales = make([]float32, world), make([]float32, world)
	st.sumSrcs, st.sumScales = make([][]byte, world), make([]float32, world)
	st.blockSigns = make([]byte, min(progressBlock, n)/8)
	st.SetPieces(0)
	st.communicator = st.communicate
}

// setPieces cuts every chunk's packed bytes into at most k pieces (at least
// one; one is no pipelining). Pieces are whole bytes, all pieceBytes long
// but the last. The worker scales travel with piece mid, the first of the
// second half: by then the caller has long packed them all.
func (st *State) setPieces(k, world int) {
	chunkBytes := st.chunkBytes
	k = max(1, min(k, maxPieces, chunkBytes))
	st.pieceBytes = (chunkBytes + k - 1) / max(k, 1)
	st.pieces = 1
	if st.pieceBytes > 0 {
		st.pieces = (chunkBytes + st.pieceBytes - 1) / st.pieceBytes
	}
	if st.pieces > 1 && world > 1 {
		st.mid = st.pieces / 2
		st.midSend = make([]byte, world*(st.pieceLen(st.mid)+4))
		st.midRecv = make([]byte, world*(st.pieceLen(st.mid)+4))
		st.ready = make(chan struct{}, 2*st.pieces)
		st.done = make(chan error, 2*st.pieces+1)
	} else {
		st.pieces, st.pieceBytes, st.mid = 1, chunkBytes, 0
		st.midSend, st.midRecv = nil, nil
		st.ready, st.done = nil, nil
	}
	st.pipePieces, st.pipePieceBytes, st.pipeMid = st.pieces, st.pieceBytes, st.mid
}

// Scale chooses how the compressed allreduce scales the signs it sends.
type Scale int

const (
	// ScaleRMS makes each scale the root mean square of what it scales:
	// the worker scale of this rank's x, the server scale of its chunk's
	// c (onebit.md, DeepSpeed's choice). The default.
	ScaleRMS Scale = iota
	// ScaleMeanAbs makes each scale the mean of |x| (of |c|): the scale
	// that minimizes the squared error of the sign compression, which a
	// heavy tail does not inflate. The worker's costs one more read pass
	// over x per call.
	ScaleMeanAbs
)

// SetScale sets the scales of the following calls (ScaleRMS on a new
// State). It changes what goes on the wire, not its format: every rank of
// a call must set the same.
func (s *State) SetScale(sc Scale) {
	s.meanAbs, s.workerMeanAbs = sc == ScaleMeanAbs, sc == ScaleMeanAbs
}

// SetOverlap sets whether the following whole-chunk calls start their
// collectives on a communicator that can (comm.Starter: comm/mpi) and
// compute while the data travels (on, the default) or run them blocking.
// A call starts them only where every rank's State has it on, so ranks may
// differ; the output and the error buffers are the same bits either way.
// Off, a call in pieces runs its collectives on a goroutine of its own.
// Tensors of less than 1M elements (4 MiB) never start them: there is too
// little to overlap.
func (s *State) SetOverlap(on bool) { s.blocking = !on }

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
// (of about 64 KiB per destination, at most 4), so that packing piece k+1
// overlaps sending piece k, the server sums pieces as they arrive, and the
// output is unpacked while the last pieces are still on the wire. The signs
// of x do not depend on the worker scale, so a pipelined call does not wait
// for it: the header carries only the length, the first pieces go out as
// soon as they are packed, and the worker scales follow in the all-to-all
// of the first piece of the second half, 4 bytes after each segment. The
// arithmetic is the same, element for element (the worker norm is summed
// in the same order, chunk by chunk, either way), so the output and the
// error buffers are bit-identical to an unpipelined call.
//
// On a communicator that starts collectives (comm.Starter: comm/mpi) the
// caller starts each collective as soon as its data is ready and moves the
// data of those in flight (Test) between blocks of 256K elements of its
// work, whole chunks or pieces: a whole-chunk call's all-to-all travels
// while the worker error is updated, its all-gather while the server error
// is updated and the rank's own chunk unpacked. Every rank must be able to
// (the header says; otherwise every rank runs them blocking), and tensors
// of less than 1M elements run them blocking anyway. Elsewhere a pipelined
// call runs its collectives on a goroutine of its own while the caller's
// goroutine computes. Either way a call returns only when it is done with
// c.
//
// Whether pieces pay depends on the link and the CPU: on a slow link they
// hide the compression behind the wire, on a fast one (or shared memory)
// the extra collectives cost more than they hide; and started collectives
// cost more than blocking ones where there is no wire to hide (ranks that
// share memory). So a State large enough for pieces chooses, call by call,
// between pieces, whole chunks with started collectives and whole chunks
// with blocking ones, by how long its earlier calls took, the mean over
// the ranks of each one's time in the call: every call's header carries
// each rank's time of its previous call, so every rank takes the same
// decision (tune.go). The first TuningCalls calls try every way; after
// that whole chunks started run unless another way measured faster beyond
// doubt, and then the fastest, once a confirmation (whole chunks started
// and it in turn, six calls each) has borne that out; two calls in every
// 32 run each of the others, to follow a change. SetPieces fixes the cut instead (whole chunks then
// start their collectives where they can); States whose output stays
// packed (the compact and sharded modes) keep their pieces.
//
// With one rank the call still compresses (the output is the
// error-compensated sign compression of buf, as in the reference);
// optimizers skip the call when W = 1. With an empty buf it zeroes both
// error buffers and communicates only the header, so that a rank with an
// empty buf among ranks with non-empty ones is an error on every rank.
//
// Bad arguments on one rank (a nil State, or one made for another length
// or group size) are an error on every rank, not a hang: the rank that
// finds them still takes part in the header all-gather, with a length that
// marks the call as refused, and returns its own error; every other rank
// returns an error naming it.
//
// A call that returns an error may have changed buf and the error buffers
// (a call that starts its collectives runs its first pass, which adds buf
// into the worker error buffer, while the header that could refuse it
// travels): Reset st, or restore both from a checkpoint, before the next
// call.
func AllReduce(ctx context.Context, c comm.Comm, buf []float32, st *State) error {
	if c == nil {
		return fmt.Errorf("onebit: nil communicator")
	}
	w := c.Size()
	if st == nil {
		return refuse(ctx, c, fmt.Errorf("onebit: nil state"))
	}
	if st.numel != len(buf) || st.world != w {
		return refuse(ctx, c, fmt.Errorf("onebit: state made for %d elements on %d ranks, called with %d elements on %d ranks",
			st.Numel(), st.World(), len(buf), w))
	}
	if len(buf) == 0 {
		st.Reset()
		if err := st.exchangeHeader(ctx, c); err != nil {
			return fmt.Errorf("onebit: phase 1 header: %w", err)
		}
		return nil
	}
	return st.allReduce(ctx, c, buf)
}

// allReduce is AllReduce once its arguments are known to be good and buf
// not empty; with buf nil, x is taken as the worker error buffer holds it
// (the sharded mode adds its input there itself).
func (st *State) allReduce(ctx context.Context, c comm.Comm, buf []float32) (err error) {
	st.beginCall()
	defer func() { st.endCall(err) }()
	for j := range st.norms {
		st.norms[j].Reset()
	}
	st.serverNorm.Reset()
	starter := starterOf(c)
	st.starts = starter != nil && !st.blocking && st.world*len(st.ServerError) >= startMin
	st.started = false
	if st.pieces == 1 {
		return st.allReduceWhole(ctx, c, starter, buf)
	}
	return st.allReducePipelined(ctx, c, starter, buf)
}

// allReducePipelined is allReduce with each chunk's packed bytes in pieces
// (st.pieces > 1). Its collectives run without the caller: started (a
// comm.Starter on every rank, as for whole chunks), the caller moving
// their data with Test between blocks of its work; otherwise on a
// goroutine of its own, to which the caller hands each piece.
func (st *State) allReducePipelined(ctx context.Context, c comm.Comm, starter comm.Starter, buf []float32) error {
	w := st.world
	chunkLen := len(st.ServerError)
	k := st.pieces
	st.ctx, st.comm = ctx, c
	defer st.release()

	// Worker side, steps 1 and 4, piece by piece: x = pad(buf) +
	// worker_error (kept in the worker error buffer until step 3), its
	// squares summed chunk by chunk, and sgn(x) packed; then phase 1,
	// second half: all-to-all of the packed chunks (chunk j to rank j),
	// one piece at a time. The header (the length only: the worker scales
	// travel later) goes once piece 0 is packed, and decides whether the
	// collectives are started. With a goroutine, in the first half the
	// caller stays one piece ahead of the wire: after piece p it waits for
	// the all-to-all of piece p-1, so that on a busy CPU the communicating
	// goroutines of all ranks get the first pieces through rather than
	// wait for every rank's packing. (Packing is faster than the wire: the
	// second half is packed while piece mid-1 is on it.) Started, every
	// piece goes as soon as it is packed.
	arrived := 0 // all-to-alls already waited for
	for p := range k {
		t := st.start()
		for j := range w {
			lo := j*chunkLen + p*st.pieceBytes*8
			hi := lo + st.pieceLen(p)*8
			dst := st.sendPiece(p, j)
			for b := lo; b < hi; b += progressBlock {
				e := min(b+progressBlock, hi)
				st.packX(dst[(b-lo)/8:(e-lo)/8], j, buf, b, e)
				st.poll()
			}
		}
		st.span(PhaseCompress, p, t)
		if p >= st.mid {
			continue
		}
		if p == 0 {
			if err := st.exchangeHeader(ctx, c); err != nil {
				return fmt.Errorf("onebit: phase 1 header: %w", err)
			}
			comm.SkipChecks(c, 2*k)
			st.starter = nil
			if st.allStart() {
				st.starter, st.started = starter, true
			} else {
				go st.communicator()
			}
		}
		if err := st.send(); err != nil {
			return st.fail(c, fmt.Errorf("onebit: phase 1 all-to-all: %w", err))
		}
		if p > 0 && st.starter == nil {
			arrived++
			if err := st.wait(); err != nil {
				return st.fail(c, fmt.Errorf("onebit: phase 1 all-to-all: %w", err))
			}
		}
	}

	// Step 2, worker_scale, and phase 1, first half: the W worker
	// scales travel in the all-to-all of piece mid, each after the
	// segment for its destination; the pieces from mid on go out now.
	workerScale := st.normScale()
	st.putWorkerScale(workerScale)
	for range k - st.mid {
		if err := st.send(); err != nil {
			return st.fail(c, fmt.Errorf("onebit: phase 1 all-to-all: %w", err))
		}
	}

	// Server side, steps 5, 6 and 9, piece by piece as they arrive (the
	// first mid+1 pieces once piece mid has brought the scales): c = sum
	// over j, ascending, of (worker_scale_j / W) * unpack(chunk received
	// from j), then c = c + server_error, and sgn(c) packed into the phase
	// 2 message in the same pass (step 9 before step 8: the signs do not
	// depend on the server scale). While a piece is still on the wire the
	// caller runs step 3 (worker_error = x - worker_scale * sgn(x), the
	// signs packed again into blockSigns: the bytes sent may still be in
	// use), a block at a time, until it has arrived; the rest of step 3
	// waits for phase 2, so that on a fast link the server's work, which
	// phase 2 waits for, is not held up by it.
	msg := st.serverMsg
	left, summed := 0, 0 // the first element of step 3 not done yet; the pieces summed
	for p := range k {
		if p >= arrived {
			left = st.fill(left, workerScale)
			if err := st.wait(); err != nil {
				return st.fail(c, fmt.Errorf("onebit: phase 1 all-to-all: %w", err))
			}
		}
		if p == st.mid {
			st.getWorkerScales()
		}
		for ; p >= st.mid && summed <= p; summed++ {
			st.sumPiece(summed, msg[4+summed*st.pieceBytes:])
		}
	}

	// Server side, step 7: server_scale, from the sum of squares of c
	// that sumPiece kept.
	serverScale := errorfeedback.ScaleOf(st.serverNorm.Sum(), chunkLen)
	if st.meanAbs {
		serverScale = meanAbs(st.ServerError)
	}

	// Phase 2: the all-gather of every rank's message, its scale and then
	// its packed chunk, in the same pieces (the scale rides in piece 0),
	// all started at once. While they travel: the rest of step 3, step 8
	// (server_error = c - server_scale * sgn(c)) and this rank's own chunk
	// of the output, which it has already.
	binary.LittleEndian.PutUint32(msg[:4], math.Float32bits(serverScale))
	for range k {
		if err := st.send(); err != nil {
			return st.fail(c, fmt.Errorf("onebit: phase 2 all-gather: %w", err))
		}
	}
	me := c.Rank()
	unpack := outputKernel(buf)
	st.besidePhase2(buf, me, left, workerScale, serverScale, nil, -1)

	// Output of the other ranks' chunks, piece by piece as they arrive:
	// element i of chunk j is server_scale_j * unpack(...); the first n
	// elements replace buf.
	for p := range k {
		if err := st.wait(); err != nil {
			return st.fail(c, fmt.Errorf("onebit: phase 2 all-gather: %w", err))
		}
		t := st.start()
		for j := range w {
			signs := st.msgPiece(p, j)
			if p == 0 {
				st.scales[j] = math.Float32frombits(binary.LittleEndian.Uint32(signs))
				signs = signs[4:]
			}
			lo := j*chunkLen + p*st.pieceBytes*8
			if st.keep || j == me || lo >= len(buf) {
				continue
			}
			hi := min(lo+len(signs)*8, len(buf))
			for b := lo; b < hi; b += progressBlock {
				e := min(b+progressBlock, hi)
				unpack(buf[b:e], signs[(b-lo)/8:], st.scales[j])
				st.poll()
			}
		}
		st.span(PhaseDecompress, p, t)
	}
	return nil
}

// progressBlock is the elements a started call works on between two
// tests of its collective: 1 MiB of float32, some tens of microseconds of
// a pass. Each test is a pass through Open MPI's progress engine (a poll
// of its sockets over TCP); at 10 Gbit, 64 MiB on 4 ranks, whole chunks
// started, 256K elements took 33.8-37.3 ms where 64K took 36.3-40.6 (6
// interleaved runs, faster in 6) and 16K 36.7-39.7 ms; 1M elements were
// slower again (32.1-44.3 ms against 28.9-38.5 for 256K, 5 interleaved
// runs: the collectives wait). startMin is the padded length from which a
// whole-chunk call starts its collectives: below it the passes they could
// travel behind are short, and the non-blocking collectives' own cost
// shows (4 MPI ranks sharing memory, 4 KiB calls: 26-35 us started
// against 20-25 us blocking; 1 MiB calls at 10 Gbit: the same within
// their spread).
const (
	progressBlock = 256 << 10
	startMin      = 1 << 20
)

// streamMin is the length from which a call writes its output with
// non-temporal stores (signpack.UnpackScaleStream): from 2M elements
// (8 MiB) the outputs of 4 ranks fill the 32 MiB last-level cache of this
// project's machines, and they follow a call's 29 bytes per element of
// other traffic, so whoever reads buf next finds it in memory either way;
// skipping the read for ownership of every line halves the bytes of the
// output pass, which runs beside the other ranks' passes on the same
// memory (1.32x for the pass alone, BenchmarkUnpackStreamVsUnpack).
// Below it the ordinary stores leave the output in the cache.
const streamMin = 2 << 20

// outputKernel returns the kernel that writes the output of a call on
// buf: signpack.UnpackScaleStream from streamMin elements on,
// signpack.UnpackScale below.
func outputKernel(buf []float32) func(dst []float32, src []byte, scale float32) {
	if len(buf) >= streamMin {
		return signpack.UnpackScaleStream
	}
	return signpack.UnpackScale
}

// allReduceWhole is allReduce with whole chunks (st.pieces == 1): each
// chunk's packed bytes in one all-to-all, every rank's message in one
// all-gather.
//
// The header goes first, with the length only, and the worker scales
// follow in the all-to-all, 4 bytes after each segment, as in piece mid
// of a pipelined call: the header agrees on every length of the call
// before any tensor data moves, and needs nothing the first pass makes.
//
// On a communicator that starts its collectives (comm.Starter: comm/mpi's
// non-blocking ones), a tensor of at least startMin elements (padded) has
// each collective travel while a pass that does not need it runs, and the
// caller progresses it (Test) between blocks of that pass, on its own
// goroutine:
//
//   - the header travels during the first pass, so that the all-to-all
//     starts as soon as the pass is done: a rank that arrives late finds
//     the others' headers there, and its own reaches them while they
//     pack (4 ranks on 2 cores, 64 MiB at 10 Gbit: the header ended 3.7-4.5
//     ms after the last rank's first pass where it was exchanged after it,
//     0-1.8 ms now);
//   - the first pass packs sgn(x) too (step 4 before step 3: the signs do
//     not depend on the worker scale), so the all-to-all travels while
//     step 3 updates the worker error;
//   - the server's sum packs sgn(c) too (step 9 before step 8), so the
//     all-gather starts once the server scale is known and travels while
//     step 8 updates the server error and this rank unpacks its own chunk
//     of the output, which it has already;
//   - the other ranks' chunks are unpacked once the all-gather is done.
//
// Nothing spins beside the caller's work, which matters where ranks share
// cores: the pipelined call's goroutine took more than it hid there. The
// ranks start their all-to-all and all-gather only if every one can (a
// flag in the header: MPI's non-blocking collectives do not match blocking
// ones); otherwise every rank runs them blocking, at the same points. (The
// header itself is the same operation started or not: see
// comm/mpi's StartAllGatherBytes.) The arithmetic is the same either way,
// bit for bit.
func (st *State) allReduceWhole(ctx context.Context, c comm.Comm, starter comm.Starter, buf []float32) error {
	w := st.world
	chunkLen := len(st.ServerError)
	n := w * chunkLen

	// Phase 1, first half: the header, every rank's length (checked
	// before any tensor data moves: from there on every length of this
	// call is agreed, and the collectives that follow skip the backend's
	// argument check) and its tuning; started where the collectives may
	// be.
	th := st.start()
	hdr, err := st.startHeader(ctx, c, starter)
	if err != nil {
		return fmt.Errorf("onebit: phase 1 header: %w", err)
	}

	// Worker side, steps 1, 2 and 4: x = pad(buf) + worker_error (kept in
	// the worker error buffer until step 3), its squares summed chunk by
	// chunk, and sgn(x) packed, in one pass; worker_scale = ||x|| /
	// sqrt(N), after every segment of the all-to-all.
	t := st.start()
	for j := range w {
		lo, hi := j*chunkLen, (j+1)*chunkLen
		dst := st.sendPiece(0, j)
		for b := lo; b < hi; b += progressBlock {
			e := min(b+progressBlock, hi)
			st.packX(dst[(b-lo)/8:(e-lo)/8], j, buf, b, e)
			st.progress(hdr)
		}
	}
	workerScale := st.normScale()
	st.putWorkerScale(workerScale)
	st.span(PhaseCompress, 0, t)
	if err := st.endHeader(hdr, th); err != nil {
		return fmt.Errorf("onebit: phase 1 header: %w", err)
	}
	if !st.allStart() {
		starter = nil
	}
	st.started = starter != nil
	comm.SkipChecks(c, 2)

	// Phase 1, second half: the all-to-all of the packed chunks (chunk j
	// to rank j), each followed by the worker scale. Step 3 while it
	// travels: worker_error = x - worker_scale * sgn(x) (the signs packed
	// again, into blockSigns: the bytes sent are in use), a block at a
	// time; started, only until the all-to-all is done: the blocks left
	// run while the all-gather travels, so that neither collective waits
	// while step 3 has work (on a fast link the two windows' own work is
	// shorter than the wire).
	t = st.start()
	req, err := st.allToAll(ctx, c, starter)
	if err != nil {
		return st.fail(c, fmt.Errorf("onebit: phase 1 all-to-all: %w", err))
	}
	tw := st.start()
	left := 0 // the first element of step 3 not done yet
	for done := false; left < n && !(done && st.started); {
		e := min(left+progressBlock, n)
		st.workerResidual(left, e, workerScale)
		left = e
		done, _ = req.Test() // its error comes again from Wait
	}
	st.span(PhaseWorkerError, 0, tw)
	if err := st.finish(req, PhaseAllToAll, t); err != nil {
		return st.fail(c, fmt.Errorf("onebit: phase 1 all-to-all: %w", err))
	}
	st.getWorkerScales()

	// Server side, steps 5-7 and 9: c = sum over j, ascending, of
	// (worker_scale_j / W) * unpack(chunk received from j), then c = c +
	// server_error, sgn(c) packed into the phase 2 message as it goes;
	// server_scale from the sum of squares of c.
	msg := st.serverMsg
	st.sumPiece(0, msg[4:])
	serverScale := errorfeedback.ScaleOf(st.serverNorm.Sum(), chunkLen)
	if st.meanAbs {
		serverScale = meanAbs(st.ServerError)
	}
	binary.LittleEndian.PutUint32(msg[:4], math.Float32bits(serverScale))

	// Phase 2: the all-gather of every rank's message, its scale and then
	// its packed chunk. Step 3's blocks left, step 8 (server_error = c -
	// server_scale * sgn(c)) and this rank's own chunk of the output while
	// it travels.
	t = st.start()
	req, err = st.allGather(ctx, c, starter)
	if err != nil {
		return st.fail(c, fmt.Errorf("onebit: phase 2 all-gather: %w", err))
	}
	me := c.Rank()
	unpack := outputKernel(buf)
	st.besidePhase2(buf, me, left, workerScale, serverScale, req, 0)
	if err := st.finish(req, PhaseAllGather, t); err != nil {
		return st.fail(c, fmt.Errorf("onebit: phase 2 all-gather: %w", err))
	}

	// Output of the other ranks' chunks: element i of chunk j is
	// server_scale_j * unpack(...); the first n elements replace buf.
	t = st.start()
	for j := range w {
		signs := st.msgPiece(0, j)
		st.scales[j] = math.Float32frombits(binary.LittleEndian.Uint32(signs))
		lo := j * chunkLen
		if st.keep || j == me || lo >= len(buf) {
			continue
		}
		unpack(buf[lo:min(lo+chunkLen, len(buf))], signs[4:], st.scales[j])
	}
	st.span(PhaseDecompress, 0, t)
	return nil
}

// starterOf returns c as a comm.Starter that starts collectives, or nil.
// It looks at c itself, not through wrappers (see comm.Starter).
func starterOf(c comm.Comm) comm.Starter {
	if s, ok := c.(comm.Starter); ok && s.Starts() {
		return s
	}
	return nil
}

// allToAll runs the all-to-all of a whole-chunk call: started through s,
// or, with s nil, blocking, its Request done.
func (st *State) allToAll(ctx context.Context, c comm.Comm, s comm.Starter) (comm.Request, error) {
	send, recv := st.phase1(0)
	if s != nil {
		return s.StartAllToAllBytes(ctx, send, recv)
	}
	t := st.start()
	err := c.AllToAllBytes(ctx, send, recv)
	st.span(PhaseAllToAll, 0, t)
	return comm.Done{}, err
}

// allGather runs the all-gather of a whole-chunk call as allToAll does.
func (st *State) allGather(ctx context.Context, c comm.Comm, s comm.Starter) (comm.Request, error) {
	send, recv := st.phase2(0)
	if s != nil {
		return s.StartAllGatherBytes(ctx, send, recv)
	}
	t := st.start()
	err := c.AllGatherBytes(ctx, send, recv)
	st.span(PhaseAllGather, 0, t)
	return comm.Done{}, err
}

// finish waits for a collective of a whole-chunk call begun at t. A
// started one is traced from its start to its end as phase ph, with the
// caller's wait in it as PhaseWait; a blocking one has been traced already.
func (st *State) finish(req comm.Request, ph Phase, t time.Time) error {
	if _, blocking := req.(comm.Done); blocking {
		return nil
	}
	tw := st.start()
	err := req.Wait()
	st.span(PhaseWait, -1, tw)
	st.span(ph, 0, t)
	return err
}

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

// outputs yields the output of the last call of a State that keeps it
// (keep), a block at a time: the first element's index and the block,
// unpacked into the summing block (free between calls); padding left out.
func (st *State) outputs() iter.Seq2[int, []float32] {
	return func(yield func(int, []float32) bool) {
		blk := st.server
		for g := range st.gatheredPieces() {
			for b := g.lo; b < g.hi; b += len(blk) {
				e := min(b+len(blk), g.hi)
				signpack.UnpackScale(blk[:e-b], g.signs[(b-g.lo)/8:(e-g.lo+7)/8], st.scales[g.j])
				if !yield(b, blk[:e-b]) {
					return
				}
			}
		}
	}
}

// inputPart is the part of buf that falls in [lo, hi) of the padded tensor.
func inputPart(buf []float32, lo, hi int) []float32 {
	return buf[min(lo, len(buf)):min(hi, len(buf))]
}

// meanAbs is the mean of |x| (0 for none), summed in float64 in order
// and rounded once.
func meanAbs(x []float32) float32 {
	if len(x) == 0 {
		return 0
	}
	var a float64
	for _, v := range x {
		a += math.Abs(float64(v))
	}
	return float32(a / float64(len(x)))
}

// normScale is the worker scale from the chunks' sums of squares, added in
// chunk order.
func (st *State) normScale() float32 {
	if st.workerMeanAbs {
		return meanAbs(st.WorkerError)
	}
	var ss float64
	for j := range st.norms {
		ss += st.norms[j].Sum()
	}
	return errorfeedback.ScaleOf(ss, len(st.ServerError)*st.world)
}

// sumBlock is the elements sumPiece sums at a time: small enough that c
// is still in the cache when it is compensated.
const sumBlock = 16 << 10

// packX forms x = pad(buf) + worker_error on [lo, hi) of the padded tensor
// (in chunk j), leaves it in the worker error buffer, adds its squares to
// chunk j's norm and packs sgn(x) into dst, in one pass.
func (st *State) packX(dst []byte, j int, buf []float32, lo, hi int) {
	if st.worker != nil {
		st.packSource(dst, j, lo, hi)
		return
	}
	st.norms[j].CompensatePack(dst, st.WorkerError[lo:hi], inputPart(buf, lo, hi))
}

// packSource is packX for a State with a workerSource: x formed a block
// at a time in the summing block (free while the worker side runs), its
// squares added to chunk j's norm and its signs packed into dst.
func (st *State) packSource(dst []byte, j, lo, hi int) {
	blk := st.server
	for b := lo; b < hi; b += len(blk) {
		x := blk[:min(len(blk), hi-b)]
		st.worker.form(x, b)
		st.norms[j].CompensatePack(dst[(b-lo)/8:], x, nil)
	}
}

// workerResidual is step 3 on [lo, hi) of the padded tensor:
// worker_error = x - scale*sgn(x), with the signs packed again into
// blockSigns (nobody reads them).
func (st *State) workerResidual(lo, hi int, scale float32) {
	if st.worker != nil {
		st.residualSource(st.blockSigns, lo, hi, scale)
		return
	}
	signpack.PackResidual(st.blockSigns[:(hi-lo)/8], st.WorkerError[lo:hi], scale)
}

// residualSource is step 3 on [lo, hi) for a State with a workerSource:
// x formed again, worker_error = x - scale*sgn(x) handed back to it; the
// signs are packed again into dst, a buffer nobody reads that holds at
// least a block's.
func (st *State) residualSource(dst []byte, lo, hi int, scale float32) {
	blk := st.server
	for b := lo; b < hi; b += len(blk) {
		x := blk[:min(len(blk), hi-b)]
		st.worker.form(x, b)
		signpack.PackResidual(dst[:len(x)/8], x, scale)
		st.worker.keep(x, b)
	}
}

// sumPiece is the server side, steps 5, 6 and 9, on piece p of the chunks
// received in phase 1: c = sum over j, ascending, of (worker_scale_j / W)
// * unpack(piece p of the chunk from j); then c = c + server_error, kept in
// the server error buffer until step 8, its squares summed in serverNorm
// for step 7, and sgn(c) packed into pack (piece p's bytes from its
// start), all in one pass: errorfeedback.Norm.CompensatePackSigns forms
// each element's sum from the packed bytes themselves (4 ranks, 64 MiB, a
// chunk's server error from memory: 1.33-1.41x faster than unpacking into
// a block, adding and compensating it, BenchmarkServerSumSpeedup). A State
// whose owner reads the sums (the sharded mode) unpacks them into the
// summing block instead, sumBlock elements at a time, so that c is still
// in the cache when it is compensated.
func (st *State) sumPiece(p int, pack []byte) {
	t := st.start()
	defer st.span(PhaseServerReduce, p, t)
	w := st.world
	lo := p * st.pieceBytes * 8
	hi := lo + st.pieceLen(p)*8
	for j := range w {
		st.sumScales[j] = st.wscales[j] / float32(w)
	}
	if st.owner == nil {
		for b := lo; b < hi; b += progressBlock {
			e := min(b+progressBlock, hi)
			for j := range w {
				st.sumSrcs[j] = st.recvPiece(p, j)[(b-lo)/8 : (e-lo)/8]
			}
			st.serverNorm.CompensatePackSigns(pack[(b-lo)/8:(e-lo)/8], st.ServerError[b:e], st.sumSrcs, st.sumScales)
			st.poll() // a pipelined call's started collectives, every progressBlock
		}
		return
	}
	for b := lo; b < hi; b += sumBlock {
		e := min(b+sumBlock, hi)
		acc := st.server[:e-b]
		bytes := func(j int) []byte { return st.recvPiece(p, j)[(b-lo)/8 : (e-lo)/8] }
		signpack.UnpackScale(acc, bytes(0), st.sumScales[0])
		for j := 1; j < w; j++ {
			signpack.UnpackScaleAdd(acc, bytes(j), st.sumScales[j])
		}
		st.owner(b, acc)
		if (b-lo+sumBlock)%progressBlock == 0 {
			st.poll()
		}
		st.serverNorm.CompensatePack(pack[(b-lo)/8:], st.ServerError[b:e], acc)
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

// send hands the next collective of a pipelined call (the K all-to-alls
// of phase 1, then the K all-gathers of phase 2, in order) to the
// goroutine, or starts it.
func (st *State) send() error {
	if st.starter == nil {
		st.ready <- struct{}{}
		return nil
	}
	i, k := st.issued, st.pieces
	st.issued++
	st.began[i] = st.start()
	var err error
	if i < k {
		send, recv := st.phase1(i)
		st.reqs[i], err = st.starter.StartAllToAllBytes(st.ctx, send, recv)
	} else {
		send, recv := st.phase2(i - k)
		st.reqs[i], err = st.starter.StartAllGatherBytes(st.ctx, send, recv)
	}
	if err != nil {
		st.issued-- // never started
	}
	return err
}

// wait returns when the next collective of a pipelined call is done, with
// its error.
func (st *State) wait() error {
	t := st.start()
	if st.starter == nil {
		err := st.earlyErr
		if !st.early {
			err = <-st.done
		}
		st.early, st.earlyErr = false, nil
		st.span(PhaseWait, -1, t)
		return err
	}
	i, k := st.waited, st.pieces
	st.waited++
	err := st.reqs[i].Wait()
	st.span(PhaseWait, -1, t)
	if i < k {
		st.span(PhaseAllToAll, i, st.began[i])
	} else {
		st.span(PhaseAllGather, i-k, st.began[i])
	}
	return err
}

// fill runs step 3 of a pipelined call from element left of the padded
// tensor on, a block at a time, until the next collective to wait for is
// done (or step 3 is), and returns the first element not done.
func (st *State) fill(left int, scale float32) int {
	n := st.world * len(st.ServerError)
	if left >= n || st.doneNext() {
		return left
	}
	t := st.start()
	for left < n {
		e := min(left+progressBlock, n)
		st.workerResidual(left, e, scale)
		left = e
		if st.doneNext() {
			break
		}
	}
	st.span(PhaseWorkerError, -1, t)
	return left
}

// besidePhase2 runs the work of a call that travels beside phase 2, once
// its all-gathers have started: what is left of step 3 (from element left
// of the padded tensor on), step 8 (server_error = c - server_scale *
// sgn(c), the signs packed again into blockSigns) and, unless the output
// stays packed, this rank's own chunk of the output, from the message it
// sent. Between blocks it moves the collectives in flight (progress with
// req); the spans it traces are of piece piece.
func (st *State) besidePhase2(buf []float32, me, left int, workerScale, serverScale float32, req comm.Request, piece int) {
	chunkLen := len(st.ServerError)
	if n := st.world * chunkLen; left < n {
		t := st.start()
		for b := left; b < n; b += progressBlock {
			st.workerResidual(b, min(b+progressBlock, n), workerScale)
			st.progress(req)
		}
		st.span(PhaseWorkerError, piece, t)
	}
	t := st.start()
	for b := 0; b < chunkLen; b += progressBlock {
		e := min(b+progressBlock, chunkLen)
		signpack.PackResidual(st.blockSigns[:(e-b)/8], st.ServerError[b:e], serverScale)
		st.progress(req)
	}
	st.span(PhaseServerCompress, piece, t)
	if lo := me * chunkLen; !st.keep && lo < len(buf) {
		t = st.start()
		unpack, msg := outputKernel(buf), st.serverMsg[4:]
		hi := min(lo+chunkLen, len(buf))
		for b := lo; b < hi; b += progressBlock {
			e := min(b+progressBlock, hi)
			unpack(buf[b:e], msg[(b-lo)/8:], serverScale)
			st.progress(req)
		}
		st.span(PhaseDecompress, piece, t)
	}
}

// progress moves the data of a call's started collectives between blocks
// of its work: req's (a whole-chunk call's, comm.Done where it runs them
// blocking) or, with req nil, a pipelined call's (poll).
func (st *State) progress(req comm.Request) {
	if req == nil {
		st.poll()
		return
	}
	_, _ = req.Test() // its error comes again from Wait
}

// doneNext reports, without waiting, whether the next collective of a
// pipelined call to wait for is done. On the goroutine it takes that
// collective's report, which wait then returns.
func (st *State) doneNext() bool {
	if st.starter == nil {
		if !st.early {
			select {
			case st.earlyErr = <-st.done:
				st.early = true
			default:
			}
		}
		return st.early
	}
	if st.waited >= st.issued {
		return true
	}
	ok, _ := st.reqs[st.waited].Test() // its error comes again from Wait
	return ok
}

// poll moves the data of the started collectives in flight, if any: a
// Test of the oldest not yet done (MPI progresses them all in it).
func (st *State) poll() {
	if st.starter == nil {
		return
	}
	for i := st.waited; i < st.issued; i++ {
		if ok, _ := st.reqs[i].Test(); !ok {
			return
		}
	}
}

// communicate is the goroutine of a pipelined call whose collectives are
// not started: the K all-to-alls of phase 1, then the K all-gathers of
// phase 2, each once the caller has made it ready. It stops at the first
// error, after reporting it.
func (st *State) communicate() {
	ctx, c := st.ctx, st.comm
	for p := range st.pieces {
		<-st.ready
		t := st.start()
		send, recv := st.phase1(p)
		err := c.AllToAllBytes(ctx, send, recv)
		st.span(PhaseAllToAll, p, t)
		st.done <- err
		if err != nil {
			return
		}
	}
	for p := range st.pieces {
		<-st.ready
		t := st.start()
		send, recv := st.phase2(p)
		err := c.AllGatherBytes(ctx, send, recv)
		st.span(PhaseAllGather, p, t)
		st.done <- err
		if err != nil {
			return
		}
	}
}

// release forgets the context, communicator and requests of a pipelined
// call once the goroutine or the caller is done with them.
func (st *State) release() {
	st.ctx, st.comm, st.starter = nil, nil, nil
	clear(st.reqs[:st.issued])
	st.issued, st.waited = 0, 0
	st.early, st.earlyErr = false, nil
}

// fail ends a call that failed and returns err. In a pipelined call the
// communicating goroutine reported the error and has returned; fail drains
// what it never took from the channels, for the next call. Then it cancels
// what is left of the promise of agreed arguments.
func (st *State) fail(c comm.Comm, err error) error {
	if st.pieces > 1 {
		for len(st.ready) > 0 {
			<-st.ready
		}
	}
	comm.SkipChecks(c, 0)
	return err
}

// refusedLen is the tensor length a rank puts in its header when it
// refuses the call (bad arguments, or a failure of its own before the
// header): no real tensor has it.
const refusedLen = math.MaxUint64

// refuse takes part in the header all-gather of a call this rank refuses,
// so that the other ranks return an error instead of waiting for it, and
// returns bad (with the all-gather's error, if it failed too). It
// allocates its header: refusing is not the hot path, and a refusing rank
// may have no State to take one from.
func refuse(ctx context.Context, c comm.Comm, bad error) error {
	w := c.Size()
	hdr, all := make([]byte, headerLen), make([]byte, headerLen*w)
	binary.LittleEndian.PutUint64(hdr, refusedLen)
	if err := c.AllGatherBytes(ctx, hdr, all); err != nil {
		return errors.Join(bad, fmt.Errorf("onebit: telling the other ranks: %w", err))
	}
	return bad
}

// exchangeHeader all-gathers this rank's header, the tensor length it was
// called with and its tuning fields, and checks it (readHeader).
func (st *State) exchangeHeader(ctx context.Context, c comm.Comm) error {
	st.putHeader()
	t := st.start()
	if err := c.AllGatherBytes(ctx, st.header, st.headers); err != nil {
		return err
	}
	st.span(PhaseHeader, 0, t)
	return st.readHeader()
}

// startHeader begins a whole-chunk call's header: started through s where
// this call may start its collectives (the caller moves it with Test
// between blocks of its first pass: see comm/mpi's StartAllGatherBytes),
// else exchanged at once, blocking, its Request done. endHeader finishes
// it.
func (st *State) startHeader(ctx context.Context, c comm.Comm, s comm.Starter) (comm.Request, error) {
	if s == nil || !st.starts {
		return comm.Done{}, st.exchangeHeader(ctx, c)
	}
	st.putHeader()
	return s.StartAllGatherBytes(ctx, st.header, st.headers)
}

// endHeader waits for a header startHeader started at t (finish) and
// checks it; one exchanged at once has been checked already.
func (st *State) endHeader(req comm.Request, t time.Time) error {
	if _, blocking := req.(comm.Done); blocking {
		return nil
	}
	if err := st.finish(req, PhaseHeader, t); err != nil {
		return err
	}
	return st.readHeader()
}

// putHeader writes this rank's header: the tensor length and the tuning
// fields.
func (st *State) putHeader() {
	binary.LittleEndian.PutUint64(st.header, uint64(st.numel)|st.tuning())
}

// readHeader checks the gathered headers (no rank refused the call, every
// rank has the same length) and takes the tuning fields.
func (st *State) readHeader() error {
	for j := range st.world {
		if binary.LittleEndian.Uint64(st.headers[j*headerLen:]) == refusedLen {
			return fmt.Errorf("onebit: rank %d refused the call (bad arguments or a failure of its own; its error says which)", j)
		}
	}
	want := binary.LittleEndian.Uint64(st.headers) & lenMask
	for j := 1; j < st.world; j++ {
		if got := binary.LittleEndian.Uint64(st.headers[j*headerLen:]) & lenMask; got != want {
			return &comm.MismatchError{Collective: comm.CAllGather, What: "onebit tensor length",
				Rank: j, Got: int(got), Want: int(want)}
		}
	}
	return st.takeTuning()
}
