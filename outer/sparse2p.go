package outer

// SparseTwoPhase: the sparse codec's exchange as a compressed allreduce in
// two phases (docs/outer.md, "The two-phase exchange").

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
)

// sparseRun returns the elements [lo, hi) of the run of chunks that rank
// j of w owns in a fragment of m elements cut into chunks of chunk
// elements: ceil(chunks/w) chunks per rank from the fragment's start, the
// last ranks owning fewer or none.
func sparseRun(m, chunk, w, j int) (lo, hi int) {
	chunks := (m + chunk - 1) / chunk
	span := (chunks + w - 1) / w * chunk
	return min(j*span, m), min((j+1)*span, m)
}

// twoPhase reports whether s exchanges with SparseTwoPhase (and keeps a
// server accumulator).
func (s *sparseCodec) twoPhase() bool { return s.server != nil }

// keepsServer reports whether s keeps a server accumulator
// (SparseTwoPhase, SparseShared).
func (s *sparseCodec) keepsServer() bool { return s.srvAt != nil }

// segLen is the bytes of an owner's segment in the exchanges of a
// fragment of m elements over w ranks: the message of the largest run
// (rank 0's), to which the others' are padded with zeros.
func (s *sparseCodec) segLen(m, w int) int {
	lo, hi := sparseRun(m, s.chunk, w, 0)
	return s.msgLen(hi - lo)
}

// setServer makes the server accumulator of rank rank of w over the
// fragments bounds (fragment f is flat[bounds[f]:bounds[f+1]]), zero.
func (s *sparseCodec) setServer(bounds []int, w, rank int) {
	s.srvAt = make([]int, len(bounds))
	for f := range len(bounds) - 1 {
		lo, hi := sparseRun(bounds[f+1]-bounds[f], s.chunk, w, rank)
		s.srvAt[f+1] = s.srvAt[f] + hi - lo
	}
	s.srv = make([]float32, s.srvAt[len(bounds)-1])
}

// allReduceTwoPhase is allReduce with SparseTwoPhase, for fragment f (the server
// accumulator's): every rank takes delta into its accumulator and encodes
// every chunk as allReduce does, the chunks of owner j's run into segment
// j; an all-to-all gives each owner its run's messages from every rank;
// the owner decodes and sums them (in rank order), divides by W, adds its
// server accumulator times Decay, encodes the result chunk by chunk (which keeps what
// it does not send in the server accumulator); an all-gather of the
// owners' segments gives every rank the same bytes, which it decodes into
// the average, applied chunk by chunk in order. Every message is checked
// before it changes anything; padding must be zero.
func (s *sparseCodec) allReduceTwoPhase(ctx context.Context, c comm.Comm, f, first, m int, delta func(lo int, x []float32), apply func(lo int, avg []float32)) error {
	w, me := c.Size(), c.Rank()
	seg := s.segLen(m, w)
	send, recv := s.send[:w*seg], s.recv[:w*seg]
	for j := range w {
		lo, hi := sparseRun(m, s.chunk, w, j)
		n := s.accumulate(send[j*seg:], first, lo, hi, delta)
		clear(send[j*seg+n : (j+1)*seg])
	}
	if err := c.AllToAllBytes(ctx, send, recv); err != nil {
		return fmt.Errorf("sparse all-to-all: %w", err)
	}
	lo, hi := sparseRun(m, s.chunk, w, me)
	if err := s.checkSegments(recv, seg, func(int) int { return hi - lo }); err != nil {
		return fmt.Errorf("phase 1: %w", err)
	}
	srv := s.srv[s.srvAt[f] : s.srvAt[f]+hi-lo]
	sv := s.server // phase 2's encoding
	seg2 := sv.segLen(m, w)
	out := s.send[:seg2] // phase 1's send is free now
	fw := float32(w)
	at, at2 := 0, 0
	for a := 0; a < hi-lo; a += s.chunk {
		b := min(a+s.chunk, hi-lo)
		n := s.chunkLen(b - a)
		avg := s.mag[:b-a]
		clear(avg)
		for r := range w {
			s.decodeChunk(avg, b-a, recv[r*seg+at:r*seg+at+n]) // checked above
		}
		x := srv[a:b]
		for i, v := range avg {
			x[i] = v/fw + s.decay*x[i]
		}
		at2 += sv.encode(out[at2:at2+sv.chunkLen(b-a)], x)
		at += n
	}
	clear(out[at2:])
	recv = s.recv[:w*seg2]
	if err := c.AllGatherBytes(ctx, out, recv); err != nil {
		return fmt.Errorf("sparse all-gather: %w", err)
	}
	runLen := func(j int) int {
		lo, hi := sparseRun(m, s.chunk, w, j)
		return hi - lo
	}
	if err := sv.checkSegments(recv, seg2, runLen); err != nil {
		return fmt.Errorf("phase 2: %w", err)
	}
	for j := range w {
		lo, hi := sparseRun(m, s.chunk, w, j)
		at := j * seg2
		for a := lo; a < hi; a += s.chunk {
			b := min(a+s.chunk, hi)
			n := sv.chunkLen(b - a)
			avg := s.mag[:b-a]
			clear(avg)
			sv.decodeChunk(avg, b-a, recv[at:at+n]) // checked above
			apply(a, avg)
			at += n
		}
	}
	return nil
}

// checkSegments checks the w segments of seg bytes in recv: segment r
// the message of a run of runLen(r) elements, then zeros.
func (s *sparseCodec) checkSegments(recv []byte, seg int, runLen func(r int) int) error {
	for r := range len(recv) / seg {
		sr := recv[r*seg : (r+1)*seg]
		n := s.msgLen(runLen(r))
		if err := s.decode(nil, runLen(r), sr[:n]); err != nil {
			return fmt.Errorf("segment of rank %d: %w", r, err)
		}
		for i, b := range sr[n:] {
			if b != 0 {
				return fmt.Errorf("segment of rank %d: %w: padding byte %d of %d is %#x", r, errSparseMessage, i, seg-n, b)
			}
		}
	}
	return nil
}
