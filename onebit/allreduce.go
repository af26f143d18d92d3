package onebit

// The 1-bit compressed allreduce on host buffers. It follows the spec page
// onebit.md step by step; the comments name the steps. This file holds the
// State, AllReduce and the whole-chunk path with the steps both paths
// share; the pipelined path is in pipeline.go, the header in header.go,
// where the bytes lie on the wire in wire.go, and the choice between the
// paths in tune.go.

import (
	"context"
	"encoding/binary"
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
//
// Both are variables so that the race detector's run of the started tests
// can start smaller tensors and progress them as often (SetStartSizes in
// export_test.go); progressBlock is a multiple of sumBlock.
var (
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
