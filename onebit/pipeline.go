package onebit

// The pipelined path of the 1-bit compressed allreduce (allreduce.go):
// each chunk's packed bytes travel in pieces, the collectives of a call
// issued in order by a goroutine of its own or started by the caller,
// while the caller packs, sums and unpacks the pieces around them. The
// steps are onebit.md's, in the same order per element as the whole-chunk
// path, so the outputs are bit-identical.

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/errorfeedback"
)

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
