package outer

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/quant"
)

// sparseCodec is CodecSparse's exchange (SparseLoCo-style, docs/outer.md):
// every rank keeps an error accumulator e of its pseudo-gradients over the
// flat parameters, e = Decay*e + delta at each exchange of a fragment; per
// chunk of the fragment (Config.SparseChunk elements, the last one
// shorter) it sends the k entries of e of largest magnitude, k =
// ceil(Density * chunk length), each as its offset within the chunk and a
// value of SparseBits bits, and keeps e minus what it sent. The messages,
// all of one length, are all-gathered; every rank decodes them in rank
// order into one sum and divides it by W: the same bytes in the same
// order, so the same average on every rank.
//
// A chunk's message is its scales (little-endian float32: one with 1-bit
// values, the magnitude of every entry sent; two with 2-bit values, the
// magnitudes of the entries below and above the mean magnitude of those
// sent, each the mean of its group), then its k entries as a little-endian
// bit stream, each entry offBits bits of offset (ascending within the
// chunk) and SparseBits bits of value (bit 0 the sign, set for negative;
// with 2 bits, bit 1 selects the upper magnitude), padded to a whole byte.
type sparseCodec struct {
	chunk   int     // elements per chunk
	density float64 // share of a chunk's entries sent
	vbits   int     // value bits: 1 or 2
	obits   int     // offset bits: enough for chunk-1
	decay   float32

	acc []float32 // the error accumulator e, flat over every parameter element; nil in bfloat16
	// acc16 is e in bfloat16 (Config.AccumulatorBF16), and ef a chunk of
	// it widened to float32; both nil otherwise.
	acc16 []uint16
	ef    []float32
	// send is this rank's message, as long as the largest fragment's;
	// recv the W messages. With SparseTwoPhase, W segments each.
	send, recv []byte
	// srv is SparseTwoPhase's server accumulator: per fragment, over the
	// run of chunks this rank owns, the error of its re-encodings of their
	// average (fragment f's at srvAt[f]); nil with SparseAllGather.
	srv   []float32
	srvAt []int
	// server encodes and decodes the second phase's messages
	// (SparseServerDensity): s itself, or a codec of another density
	// sharing s's scratch; nil with SparseAllGather.
	server *sparseCodec
	// shared is set with SparseShared, whose buffers are idx (the W
	// owners' offsets, all-gathered), offs (a chunk's offsets, decoded)
	// and vals (a chunk's values at them); srv is then its server
	// accumulator, as with SparseTwoPhase.
	shared bool
	// vote is set with SparseVoted: the owners pick the offsets the
	// ranks named most (score, a chunk's tally).
	vote  bool
	score []float32
	idx   []byte
	offs  []int32
	vals  []float32
	// mag is a chunk's scratch: its pseudo-gradients, then their
	// magnitudes for the selection; after the all-gather, its average.
	mag []float32
}

func newSparseCodec(cfg Config, n, largest, w int) *sparseCodec {
	s := &sparseCodec{
		chunk: cfg.SparseChunk, density: float64(cfg.Density), vbits: cfg.SparseBits,
		obits: max(1, bits.Len(uint(cfg.SparseChunk-1))), decay: cfg.Decay,
		mag: make([]float32, cfg.SparseChunk),
	}
	if cfg.AccumulatorBF16 {
		s.acc16, s.ef = make([]uint16, n), make([]float32, cfg.SparseChunk)
	} else {
		s.acc = make([]float32, n)
	}
	if cfg.SparseExchange == SparseShared || cfg.SparseExchange == SparseVoted {
		s.vote = cfg.SparseExchange == SparseVoted
		s.newShared(largest, w)
		return s
	}
	if cfg.SparseExchange == SparseTwoPhase {
		s.server = s
		if d := cfg.serverDensity(); d != cfg.Density {
			srv := *s
			srv.density = float64(d)
			s.server = &srv
		}
		// Phase 1 sends W segments, the owners' runs padded to the
		// largest, and receives W; phase 2 sends one segment (of its
		// own density) from send and receives W into recv.
		seg1, seg2 := s.segLen(largest, w), s.server.segLen(largest, w)
		s.send, s.recv = make([]byte, max(w*seg1, seg2)), make([]byte, w*max(seg1, seg2))
		return s
	}
	msg := s.msgLen(largest)
	s.send, s.recv = make([]byte, msg), make([]byte, w*msg)
	return s
}

// accumulator returns a float32 copy of the accumulator, flat.
func (s *sparseCodec) accumulator() []float32 {
	if s.acc16 == nil {
		return slices.Clone(s.acc)
	}
	e := make([]float32, len(s.acc16))
	quant.Widen(quant.BF16, e, s.acc16)
	return e
}

// setAccumulator sets the accumulator to e (nil: zero), rounded to
// bfloat16 when it is kept so.
func (s *sparseCodec) setAccumulator(e []float32) {
	switch {
	case s.acc16 == nil && e == nil:
		clear(s.acc)
	case s.acc16 == nil:
		copy(s.acc, e)
	case e == nil:
		clear(s.acc16)
	default:
		quant.Narrow(quant.BF16, s.acc16, e)
	}
}

// k is the number of entries sent of a chunk of l elements: density * l
// rounded to the nearest integer, at least 1 and at most l.
func (s *sparseCodec) k(l int) int {
	return max(1, min(l, int(math.Round(s.density*float64(l)))))
}

// scales is the number of float32 scales of a chunk's message.
func (s *sparseCodec) scales() int { return s.vbits }

// chunkLen is the bytes of the message of a chunk of l elements.
func (s *sparseCodec) chunkLen(l int) int {
	return 4*s.scales() + (s.k(l)*(s.obits+s.vbits)+7)/8
}

// msgLen is the bytes of the message of a fragment of m elements.
func (s *sparseCodec) msgLen(m int) int {
	full, rest := m/s.chunk, m%s.chunk
	n := full * s.chunkLen(s.chunk)
	if rest > 0 {
		n += s.chunkLen(rest)
	}
	return n
}

// allReduce exchanges the fragment of m elements from flat element first
// over c's ranks, a chunk at a time and with no buffer of the fragment's:
// delta(lo, x) writes the pseudo-gradients of the fragment's elements
// [lo, lo+len(x)) into x, which the accumulator e takes (e = decay*e +
// delta) before the chunk's message is encoded; once every rank's
// message is in and known good, apply(lo, avg) takes the average of what
// the ranks sent of elements [lo, lo+len(avg)), chunk by chunk in order
// (avg is the codec's scratch, valid during the call).
func (s *sparseCodec) allReduce(ctx context.Context, c comm.Comm, first, m int, delta func(lo int, x []float32), apply func(lo int, avg []float32)) error {
	w := c.Size()
	msg := s.msgLen(m)
	send := s.send[:msg]
	s.accumulate(send, first, 0, m, delta)
	recv := s.recv[:w*msg]
	if err := c.AllGatherBytes(ctx, send, recv); err != nil {
		return fmt.Errorf("sparse all-gather: %w", err)
	}
	for r := range w {
		if err := s.decode(nil, m, recv[r*msg:(r+1)*msg]); err != nil {
			return fmt.Errorf("sparse message of rank %d: %w", r, err)
		}
	}
	fw := float32(w)
	at := 0
	for lo := 0; lo < m; lo += s.chunk {
		hi := min(lo+s.chunk, m)
		n := s.chunkLen(hi - lo)
		avg := s.mag[:hi-lo]
		clear(avg)
		for r := range w {
			s.decodeChunk(avg, hi-lo, recv[r*msg+at:r*msg+at+n]) // checked above
		}
		for i := range avg {
			avg[i] /= fw
		}
		apply(lo, avg)
		at += n
	}
	return nil
}

// accumulate takes the pseudo-gradients of the fragment's elements [lo,
// hi) (lo at a chunk's start; the fragment starts at flat element first)
// into the accumulator, e = decay*e + delta, a chunk at a time, and
// writes their messages into dst in order, subtracting what they stand
// for from e. It returns the bytes written, msgLen(hi-lo).
func (s *sparseCodec) accumulate(dst []byte, first, lo, hi int, delta func(lo int, x []float32)) int {
	at := 0
	for a := lo; a < hi; a += s.chunk {
		b := min(a+s.chunk, hi)
		d := s.mag[:b-a]
		delta(a, d)
		var x []float32
		if s.acc16 != nil {
			x = s.ef[:b-a]
			quant.Widen(quant.BF16, x, s.acc16[first+a:first+b])
		} else {
			x = s.acc[first+a : first+b]
		}
		for i, v := range d {
			x[i] = s.decay*x[i] + v
		}
		at += s.encode(dst[at:at+s.chunkLen(b-a)], x)
		if s.acc16 != nil {
			quant.Narrow(quant.BF16, s.acc16[first+a:first+b], x)
		}
	}
	return at
}

// encode writes the message of chunk x into dst (chunkLen(len(x)) bytes)
// and subtracts what it stands for from x. It returns len(dst).
func (s *sparseCodec) encode(dst []byte, x []float32) int {
	l, k := len(x), s.k(len(x))
	mag := s.mag[:l]
	for i, v := range x {
		mag[i] = abs32(v)
	}
	thr := kthLargest(mag, k) // reorders mag
	ties := k                 // the entries of magnitude thr sent: k less those above it
	for _, a := range mag {
		if a > thr {
			ties--
		}
	}
	sent := mag[:0] // the magnitudes of the entries sent, over mag's
	s.selected(x, thr, ties, func(_ int, v float32) { sent = append(sent, abs32(v)) })
	lo, hi, cut := s.magnitudes(sent)
	if s.vbits == 2 {
		binary.LittleEndian.PutUint32(dst[4:], math.Float32bits(hi))
	}
	binary.LittleEndian.PutUint32(dst, math.Float32bits(lo))
	bw := bitWriter{buf: dst[4*s.scales():]}
	s.selected(x, thr, ties, func(i int, v float32) {
		code, sent := uint64(0), lo
		if abs32(v) >= cut {
			code, sent = 2, hi
		}
		if math.Signbit(float64(v)) {
			code |= 1
			sent = -sent
		}
		bw.write(uint64(i), s.obits)
		bw.write(code, s.vbits)
		x[i] -= sent
	})
	bw.flush()
	return s.chunkLen(l)
}

// magnitudes returns what a message sends for its entries of magnitudes
// mags, in the order they are sent: at 1 bit their mean as lo and hi, cut
// +Inf; at 2 bits cut is that mean, lo and hi the means of the entries
// below and at or above it (hi when none is below). An entry of magnitude
// at least cut is sent as hi, the others as lo.
func (s *sparseCodec) magnitudes(mags []float32) (lo, hi, cut float32) {
	var sum float64
	for _, a := range mags {
		sum += float64(a)
	}
	lo = float32(sum / float64(len(mags)))
	hi, cut = lo, float32(math.Inf(1))
	if s.vbits != 2 {
		return lo, hi, cut
	}
	cut = lo
	var sl, sh float64
	var nl, nh int
	for _, a := range mags {
		if a >= cut {
			sh, nh = sh+float64(a), nh+1
		} else {
			sl, nl = sl+float64(a), nl+1
		}
	}
	hi = float32(sh / float64(nh)) // nh >= 1: the largest is at least the mean
	lo = hi
	if nl > 0 {
		lo = float32(sl / float64(nl))
	}
	return lo, hi, cut
}

// selected calls fn with the offset and value of each entry of x that a
// message sends, in ascending order: those whose magnitude exceeds thr,
// and the first ties of those equal to it.
func (s *sparseCodec) selected(x []float32, thr float32, ties int, fn func(i int, v float32)) {
	for i, v := range x {
		a := abs32(v)
		if a > thr || a == thr && ties > 0 {
			if a == thr {
				ties--
			}
			fn(i, v)
		}
	}
}

// errSparseMessage is wrapped by every error of a malformed message.
var errSparseMessage = errors.New("malformed sparse message")

// decodeAdd adds what msg (a fragment's message) stands for to dst, the
// fragment. It rejects a message whose scales are not finite and
// non-negative, or whose offsets fall outside their chunk or do not
// ascend, with dst partly updated.
func (s *sparseCodec) decodeAdd(dst []float32, msg []byte) error {
	return s.decode(dst, len(dst), msg)
}

// decode is decodeAdd of a fragment of m elements; with dst nil it only
// checks msg.
func (s *sparseCodec) decode(dst []float32, m int, msg []byte) error {
	if len(msg) != s.msgLen(m) {
		return fmt.Errorf("%w: %d bytes for %d elements, want %d", errSparseMessage, len(msg), m, s.msgLen(m))
	}
	at := 0
	for lo := 0; lo < m; lo += s.chunk {
		hi := min(lo+s.chunk, m)
		n := s.chunkLen(hi - lo)
		if err := s.decodeChunk(part(dst, lo, hi), hi-lo, msg[at:at+n]); err != nil {
			return fmt.Errorf("chunk at element %d: %w", lo, err)
		}
		at += n
	}
	return nil
}

// decodeChunk adds what msg stands for to dst, a chunk of l elements;
// with dst nil it only checks msg.
func (s *sparseCodec) decodeChunk(dst []float32, l int, msg []byte) error {
	var sc [2]float32
	for j := range s.scales() {
		v := math.Float32frombits(binary.LittleEndian.Uint32(msg[4*j:]))
		if !(v >= 0) || math.IsInf(float64(v), 1) {
			return fmt.Errorf("%w: scale %d is %v", errSparseMessage, j, v)
		}
		sc[j] = v
	}
	br := bitReader{buf: msg[4*s.scales():]}
	prev := -1
	for range s.k(l) {
		off := int(br.read(s.obits))
		code := br.read(s.vbits)
		if off <= prev || off >= l {
			return fmt.Errorf("%w: offset %d after %d in a chunk of %d", errSparseMessage, off, prev, l)
		}
		prev = off
		if dst == nil {
			continue
		}
		v := sc[0]
		if code&2 != 0 {
			v = sc[1]
		}
		if code&1 != 0 {
			v = -v
		}
		dst[off] += v
	}
	return nil
}

// kthLargest returns the k-th largest of a (1 <= k <= len(a)), reordering
// a (quickselect, median of three pivots; no allocation).
func kthLargest(a []float32, k int) float32 {
	lo, hi := 0, len(a)-1
	want := k - 1 // index in descending order
	for lo < hi {
		mid := lo + (hi-lo)/2
		// Median of three to a[hi].
		if a[mid] > a[lo] {
			a[mid], a[lo] = a[lo], a[mid]
		}
		if a[hi] > a[lo] {
			a[hi], a[lo] = a[lo], a[hi]
		}
		if a[mid] > a[hi] {
			a[mid], a[hi] = a[hi], a[mid]
		}
		p := a[hi]
		// Three-way partition, descending: > p, == p, < p.
		i, j, t := lo, lo, hi
		for j <= t {
			switch {
			case a[j] > p:
				a[i], a[j] = a[j], a[i]
				i++
				j++
			case a[j] < p:
				a[j], a[t] = a[t], a[j]
				t--
			default:
				j++
			}
		}
		switch {
		case want < i:
			hi = i - 1
		case want > t:
			lo = t + 1
		default:
			return p
		}
	}
	return a[want]
}

func abs32(v float32) float32 { return math.Float32frombits(math.Float32bits(v) &^ (1 << 31)) }

// bitWriter appends little-endian bit fields to buf.
type bitWriter struct {
	buf  []byte
	acc  uint64
	n    int // bits in acc
	next int // next byte of buf
}

func (w *bitWriter) write(v uint64, nbits int) {
	w.acc |= v << w.n
	w.n += nbits
	for w.n >= 8 {
		w.buf[w.next] = byte(w.acc)
		w.next++
		w.acc >>= 8
		w.n -= 8
	}
}

func (w *bitWriter) flush() {
	if w.n > 0 {
		w.buf[w.next] = byte(w.acc)
		w.next++
	}
	clear(w.buf[w.next:])
}

// bitReader reads what bitWriter wrote; past the end of buf it reads
// zeros (the caller's length check keeps it within).
type bitReader struct {
	buf  []byte
	acc  uint64
	n    int
	next int
}

func (r *bitReader) read(nbits int) uint64 {
	for r.n < nbits {
		var b byte
		if r.next < len(r.buf) {
			b = r.buf[r.next]
		}
		r.acc |= uint64(b) << r.n
		r.next++
		r.n += 8
	}
	v := r.acc & (1<<nbits - 1)
	r.acc >>= nbits
	r.n -= nbits
	return v
}
