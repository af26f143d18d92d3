package outer

// SparseShared: the sparse codec's exchange with the offsets agreed first
// and the values sent without them (docs/outer.md, "The shared-index
// exchange").

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/quant"
)

// sharedIdxLen is the bytes of a chunk of l elements' offsets: k(l)
// offsets of obits bits each, ascending, padded to a byte with zero bits.
func (s *sparseCodec) sharedIdxLen(l int) int { return (s.k(l)*s.obits + 7) / 8 }

// sharedValLen is the bytes of a chunk of l elements' values in phase 1:
// vbits float32 scales, then k(l) values of vbits bits each.
func (s *sparseCodec) sharedValLen(l int) int { return 4*s.vbits + (s.k(l)*s.vbits+7)/8 }

// sharedAvgLen is the bytes of a chunk of l elements' average in phase 2:
// one float32 scale, then k(l) int8 codes.
func (s *sparseCodec) sharedAvgLen(l int) int { return 4 + s.k(l) }

// runBytes is the bytes of the chunks of owner j's run (of w, in a
// fragment of m elements), per(l) bytes a chunk of l elements.
func (s *sparseCodec) runBytes(m, w, j int, per func(l int) int) int {
	lo, hi := sparseRun(m, s.chunk, w, j)
	n := 0
	for a := lo; a < hi; a += s.chunk {
		n += per(min(a+s.chunk, hi) - a)
	}
	return n
}

// sharedSegs returns the segment lengths of the shared exchange of a
// fragment of m elements over w ranks: the offsets', phase 1's and phase
// 2's, each the largest run's (rank 0's), to which the others' are padded
// with zeros.
func (s *sparseCodec) sharedSegs(m, w int) (idx, val, avg int) {
	return s.runBytes(m, w, 0, s.sharedIdxLen), s.runBytes(m, w, 0, s.sharedValLen), s.runBytes(m, w, 0, s.sharedAvgLen)
}

// newShared sizes s's buffers for SparseShared: fragments of at most
// largest elements over w ranks.
func (s *sparseCodec) newShared(largest, w int) {
	s.shared = true
	idx, val, avg := s.sharedSegs(largest, w)
	s.send = make([]byte, max(w*idx, w*val, avg))
	s.recv = make([]byte, w*max(idx, val, avg))
	if s.vote {
		s.score = make([]float32, s.chunk)
	}
	s.idx = make([]byte, w*idx)
	s.offs = make([]int32, s.k(s.chunk))
	s.vals = make([]float32, s.k(s.chunk))
}

// chunkAcc returns the accumulator of the fragment's elements [a, b) (the
// fragment from flat element first) as float32: the accumulator itself,
// or in bfloat16 a widened copy in s.ef, which store writes back.
func (s *sparseCodec) chunkAcc(first, a, b int) []float32 {
	if s.acc16 == nil {
		return s.acc[first+a : first+b]
	}
	x := s.ef[:b-a]
	quant.Widen(quant.BF16, x, s.acc16[first+a:first+b])
	return x
}

// store writes back what chunkAcc returned, rounded to bfloat16 when the
// accumulator is kept so.
func (s *sparseCodec) store(first, a int, x []float32) {
	if s.acc16 != nil {
		quant.Narrow(quant.BF16, s.acc16[first+a:first+a+len(x)], x)
	}
}

// takeDelta is e = decay*e + delta for the chunk x, the fragment's
// elements [a, a+len(x)).
func (s *sparseCodec) takeDelta(a int, x []float32, delta func(lo int, x []float32)) {
	d := s.mag[:len(x)]
	delta(a, d)
	for i, v := range d {
		x[i] = s.decay*x[i] + v
	}
}

// encodeOffsets writes the offsets of the k(len(x)) entries of x of
// largest magnitude (ties to the lower offset), ascending, into dst
// (sharedIdxLen bytes), which it returns the length of. x is not changed.
func (s *sparseCodec) encodeOffsets(dst []byte, x []float32) int {
	l, k := len(x), s.k(len(x))
	mag := s.mag[:l]
	for i, v := range x {
		mag[i] = abs32(v)
	}
	thr := kthLargest(mag, k)
	ties := k
	for _, a := range mag {
		if a > thr {
			ties--
		}
	}
	n := s.sharedIdxLen(l)
	bw := bitWriter{buf: dst[:n]}
	s.selected(x, thr, ties, func(i int, _ float32) { bw.write(uint64(i), s.obits) })
	bw.flush()
	return n
}

// readOffsets reads the k(l) offsets of a chunk of l elements from msg
// into s.offs, checking that they ascend within the chunk and that the
// bits after them are zero.
func (s *sparseCodec) readOffsets(msg []byte, l int) ([]int32, error) {
	k := s.k(l)
	offs := s.offs[:k]
	br := bitReader{buf: msg}
	prev := -1
	for i := range offs {
		off := int(br.read(s.obits))
		if off <= prev || off >= l {
			return nil, fmt.Errorf("%w: offset %d after %d in a chunk of %d", errSparseMessage, off, prev, l)
		}
		offs[i], prev = int32(off), off
	}
	if rest := k * s.obits % 8; rest != 0 && msg[len(msg)-1]>>rest != 0 {
		return nil, fmt.Errorf("%w: padding bits of the offsets are %#x", errSparseMessage, msg[len(msg)-1]>>rest)
	}
	return offs, nil
}

// encodeValues writes the values of x at offs into dst (sharedValLen
// bytes) as the all-gather's messages encode the entries they send (sign
// and the mean magnitude, or with 2 bits the means of those below and at
// or above it), without offsets, and subtracts what they stand for from
// x. It returns the bytes written.
func (s *sparseCodec) encodeValues(dst []byte, x []float32, offs []int32) int {
	mags := s.mag[:len(offs)] // free here: x is the accumulator or s.ef
	for j, i := range offs {
		mags[j] = abs32(x[i])
	}
	lo, hi, cut := s.magnitudes(mags)
	if s.vbits == 2 {
		binary.LittleEndian.PutUint32(dst[4:], math.Float32bits(hi))
	}
	binary.LittleEndian.PutUint32(dst, math.Float32bits(lo))
	n := s.sharedValLen(len(x))
	bw := bitWriter{buf: dst[4*s.vbits : n]}
	for _, i := range offs {
		v := x[i]
		code, sent := uint64(0), lo
		if abs32(v) >= cut {
			code, sent = 2, hi
		}
		if math.Signbit(float64(v)) {
			code |= 1
			sent = -sent
		}
		bw.write(code, s.vbits)
		x[i] -= sent
	}
	bw.flush()
	return n
}

// checkScales checks the n float32 scales at the start of msg: finite and
// not negative.
func checkScales(msg []byte, n int) error {
	for j := range n {
		v := math.Float32frombits(binary.LittleEndian.Uint32(msg[4*j:]))
		if !(v >= 0) || math.IsInf(float64(v), 1) {
			return fmt.Errorf("%w: scale %d is %v", errSparseMessage, j, v)
		}
	}
	return nil
}

// addValues adds the values of a phase-1 message (sharedValLen bytes,
// checked) to vals, one per offset.
func (s *sparseCodec) addValues(vals []float32, msg []byte) {
	sc := [2]float32{math.Float32frombits(binary.LittleEndian.Uint32(msg))}
	if s.vbits == 2 {
		sc[1] = math.Float32frombits(binary.LittleEndian.Uint32(msg[4:]))
	}
	br := bitReader{buf: msg[4*s.vbits:]}
	for i := range vals {
		code := br.read(s.vbits)
		v := sc[0]
		if code&2 != 0 {
			v = sc[1]
		}
		if code&1 != 0 {
			v = -v
		}
		vals[i] += v
	}
}

// encodeAverage writes x (the average plus the server accumulator at a
// chunk's offsets) into dst as int8 (the int8 codec's formula, one scale)
// and keeps the rounding in srv at those offsets: srv[off] = x - sent.
// It returns the bytes written, sharedAvgLen.
func encodeAverage(dst []byte, x []float32, offs []int32, srv []float32) int {
	var amax float32
	for _, v := range x {
		amax = max(amax, abs32(v))
	}
	var qs float32
	if amax > 0 {
		qs = min(127/amax, math.MaxFloat32)
	}
	sc := amax / 127
	binary.LittleEndian.PutUint32(dst, math.Float32bits(sc))
	for i, v := range x {
		code := symCode(v * qs)
		dst[4+i] = byte(int8(code))
		srv[offs[i]] = v - float32(code)*sc
	}
	return 4 + len(x)
}

// checkAverage checks a phase-2 chunk message: its scale finite and not
// negative, no code -128.
func checkAverage(msg []byte) error {
	if err := checkScales(msg, 1); err != nil {
		return err
	}
	for i, b := range msg[4:] {
		if b == 0x80 {
			return fmt.Errorf("%w: code %d is -128", errSparseMessage, i)
		}
	}
	return nil
}

// checkPadding checks that the bytes of seg after the first n are zero.
func checkPadding(seg []byte, n int) error {
	for i, b := range seg[n:] {
		if b != 0 {
			return fmt.Errorf("%w: padding byte %d of %d is %#x", errSparseMessage, i, len(seg)-n, b)
		}
	}
	return nil
}

// checkRuns checks the w segments of seg bytes in recv, segment j holding
// owner j's run of a fragment of m elements, chunk by chunk with check
// (per(l) bytes a chunk of l elements), then zeros.
func (s *sparseCodec) checkRuns(recv []byte, seg, m int, per func(l int) int, check func(msg []byte, l int) error) error {
	w := len(recv) / seg
	for j := range w {
		lo, hi := sparseRun(m, s.chunk, w, j)
		sr, at := recv[j*seg:(j+1)*seg], 0
		for a := lo; a < hi; a += s.chunk {
			l := min(a+s.chunk, hi) - a
			if err := check(sr[at:at+per(l)], l); err != nil {
				return fmt.Errorf("segment of rank %d, chunk at element %d: %w", j, a, err)
			}
			at += per(l)
		}
		if err := checkPadding(sr, at); err != nil {
			return fmt.Errorf("segment of rank %d: %w", j, err)
		}
	}
	return nil
}

// allReduceShared is allReduce with SparseShared, for fragment f (the
// server accumulator's):
//  0. every owner takes delta into its accumulator for the chunks of its
//     run (e = decay*e + delta) and writes the offsets of each chunk's
//     top k entries; an all-gather gives every rank every owner's
//     offsets (the owners' are the only ones, so every rank has the same);
//  1. every rank takes delta into the other chunks, encodes its values at
//     the agreed offsets of every chunk (no offsets: scales and value
//     bits), subtracting what they stand for from e; an all-to-all gives
//     each owner its run's values from every rank;
//  2. the owner sums them in rank order, divides by W, adds its server
//     accumulator at the offsets and sends that in int8, keeping the
//     rounding; an all-gather gives every rank the same bytes, which it
//     decodes into the average, applied chunk by chunk in order.
//
// Every message is checked before it changes anything; padding must be
// zero.
func (s *sparseCodec) allReduceShared(ctx context.Context, c comm.Comm, f, first, m int, delta func(lo int, x []float32), apply func(lo int, avg []float32)) error {
	w, me := c.Size(), c.Rank()
	segI, segV, segA := s.sharedSegs(m, w)
	mlo, mhi := sparseRun(m, s.chunk, w, me)
	var out []byte
	if s.vote {
		var err error
		if out, err = s.vote0(ctx, c, first, m, delta); err != nil {
			return err
		}
	} else {
		at := 0
		out = s.send[:segI]
		for a := mlo; a < mhi; a += s.chunk {
			x := s.chunkAcc(first, a, min(a+s.chunk, mhi))
			s.takeDelta(a, x, delta)
			at += s.encodeOffsets(out[at:], x)
			s.store(first, a, x)
		}
		clear(out[at:])
	}
	idx := s.idx[:w*segI]
	if err := c.AllGatherBytes(ctx, out, idx); err != nil {
		return fmt.Errorf("sparse offsets all-gather: %w", err)
	}
	if err := s.checkOffsets(idx, segI, m); err != nil {
		return fmt.Errorf("offsets: %w", err)
	}
	// Phase 1.
	send := s.send[:w*segV]
	for j := range w {
		lo, hi := sparseRun(m, s.chunk, w, j)
		sj, at, iat := send[j*segV:(j+1)*segV], 0, j*segI
		for a := lo; a < hi; a += s.chunk {
			b := min(a+s.chunk, hi)
			x := s.chunkAcc(first, a, b)
			if j != me && !s.vote {
				s.takeDelta(a, x, delta)
			}
			offs, _ := s.readOffsets(idx[iat:iat+s.sharedIdxLen(b-a)], b-a) // checked above
			at += s.encodeValues(sj[at:], x, offs)
			s.store(first, a, x)
			iat += s.sharedIdxLen(b - a)
		}
		clear(sj[at:])
	}
	recv := s.recv[:w*segV]
	if err := c.AllToAllBytes(ctx, send, recv); err != nil {
		return fmt.Errorf("sparse all-to-all: %w", err)
	}
	for r := range w {
		sr, at := recv[r*segV:(r+1)*segV], 0
		for a := mlo; a < mhi; a += s.chunk {
			l := min(a+s.chunk, mhi) - a
			if err := checkScales(sr[at:], s.vbits); err != nil {
				return fmt.Errorf("phase 1: segment of rank %d, chunk at element %d: %w", r, a, err)
			}
			at += s.sharedValLen(l)
		}
		if err := checkPadding(sr, at); err != nil {
			return fmt.Errorf("phase 1: segment of rank %d: %w", r, err)
		}
	}
	// Phase 2.
	srv := s.srv[s.srvAt[f] : s.srvAt[f]+mhi-mlo]
	out = s.send[:segA]
	at, iat, vat := 0, me*segI, 0
	fw := float32(w)
	for a := mlo; a < mhi; a += s.chunk {
		l := min(a+s.chunk, mhi) - a
		offs, _ := s.readOffsets(idx[iat:iat+s.sharedIdxLen(l)], l)
		vals := s.vals[:len(offs)]
		clear(vals)
		for r := range w {
			s.addValues(vals, recv[r*segV+vat:r*segV+vat+s.sharedValLen(l)])
		}
		x := srv[a-mlo : a-mlo+l]
		for i, o := range offs {
			vals[i] = vals[i]/fw + x[o]
		}
		at += encodeAverage(out[at:], vals, offs, x)
		iat += s.sharedIdxLen(l)
		vat += s.sharedValLen(l)
	}
	clear(out[at:])
	recv = s.recv[:w*segA]
	if err := c.AllGatherBytes(ctx, out, recv); err != nil {
		return fmt.Errorf("sparse all-gather: %w", err)
	}
	if err := s.checkAverages(recv, segA, m); err != nil {
		return fmt.Errorf("phase 2: %w", err)
	}
	s.applyShared(idx, segI, recv, segA, m, apply)
	return nil
}

// checkOffsets checks the w owners' offsets of a fragment of m elements,
// segments of segI bytes in idx.
func (s *sparseCodec) checkOffsets(idx []byte, segI, m int) error {
	return s.checkRuns(idx, segI, m, s.sharedIdxLen, func(msg []byte, l int) error {
		_, err := s.readOffsets(msg, l)
		return err
	})
}

// checkAverages checks the w owners' averages of a fragment of m
// elements, segments of segA bytes in recv.
func (s *sparseCodec) checkAverages(recv []byte, segA, m int) error {
	return s.checkRuns(recv, segA, m, s.sharedAvgLen, func(msg []byte, _ int) error { return checkAverage(msg) })
}

// applyShared decodes the owners' averages (segments of segA bytes in
// recv) at their offsets (segments of segI bytes in idx), both checked,
// and calls apply with each chunk's, in order.
func (s *sparseCodec) applyShared(idx []byte, segI int, recv []byte, segA, m int, apply func(lo int, avg []float32)) {
	w := len(idx) / segI
	for j := range w {
		lo, hi := sparseRun(m, s.chunk, w, j)
		at, iat := j*segA, j*segI
		for a := lo; a < hi; a += s.chunk {
			l := min(a+s.chunk, hi) - a
			offs, _ := s.readOffsets(idx[iat:iat+s.sharedIdxLen(l)], l)
			avg := s.mag[:l]
			clear(avg)
			sc := math.Float32frombits(binary.LittleEndian.Uint32(recv[at:]))
			for i, o := range offs {
				avg[o] = float32(int8(recv[at+4+i])) * sc
			}
			apply(a, avg)
			at += s.sharedAvgLen(l)
			iat += s.sharedIdxLen(l)
		}
	}
}

// vote0 is SparseVoted's step 0: every rank takes delta into its
// accumulator for every chunk and sends each owner the offsets of its top
// k entries of each of the owner's chunks (an all-to-all); the owner
// tallies them per chunk and writes the k offsets most ranks named (ties
// to its own larger magnitude, then the lower offset) into the segment it
// returns, for the all-gather.
func (s *sparseCodec) vote0(ctx context.Context, c comm.Comm, first, m int, delta func(lo int, x []float32)) ([]byte, error) {
	w, me := c.Size(), c.Rank()
	segI, _, _ := s.sharedSegs(m, w)
	send := s.send[:w*segI]
	for j := range w {
		lo, hi := sparseRun(m, s.chunk, w, j)
		sj, at := send[j*segI:(j+1)*segI], 0
		for a := lo; a < hi; a += s.chunk {
			x := s.chunkAcc(first, a, min(a+s.chunk, hi))
			s.takeDelta(a, x, delta)
			at += s.encodeOffsets(sj[at:], x)
			s.store(first, a, x)
		}
		clear(sj[at:])
	}
	recv := s.recv[:w*segI]
	if err := c.AllToAllBytes(ctx, send, recv); err != nil {
		return nil, fmt.Errorf("sparse votes all-to-all: %w", err)
	}
	mlo, mhi := sparseRun(m, s.chunk, w, me)
	for r := range w {
		sr, at := recv[r*segI:(r+1)*segI], 0
		for a := mlo; a < mhi; a += s.chunk {
			l := min(a+s.chunk, mhi) - a
			if _, err := s.readOffsets(sr[at:at+s.sharedIdxLen(l)], l); err != nil {
				return nil, fmt.Errorf("votes: segment of rank %d, chunk at element %d: %w", r, a, err)
			}
			at += s.sharedIdxLen(l)
		}
		if err := checkPadding(sr, at); err != nil {
			return nil, fmt.Errorf("votes: segment of rank %d: %w", r, err)
		}
	}
	out, at := s.send[:segI], 0 // the votes' send is free now
	for a := mlo; a < mhi; a += s.chunk {
		l := min(a+s.chunk, mhi) - a
		score := s.score[:l]
		clear(score)
		for r := range w {
			offs, _ := s.readOffsets(recv[r*segI+at:r*segI+at+s.sharedIdxLen(l)], l) // checked above
			for _, o := range offs {
				score[o]++
			}
		}
		x := s.chunkAcc(first, a, a+l)
		var amax float32
		for _, v := range x {
			amax = max(amax, abs32(v))
		}
		if amax > 0 {
			// Below half a vote: ties among equal tallies only.
			for i, v := range x {
				score[i] += abs32(v) / (2 * amax)
			}
		}
		at += s.encodeOffsets(out[at:], score)
	}
	clear(out[at:])
	return out, nil
}
