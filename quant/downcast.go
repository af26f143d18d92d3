package quant

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/lowbit-ml/lowbit/comm"
)

// DownCast is the down-cast allreduce: a float32 buffer is averaged over
// the ranks with 16-bit values (FP16 or BF16) on the wire, 2 bytes per
// element each way instead of 4, and float32 arithmetic everywhere else.
//
// One call, on W ranks and n elements (padded with zeros to N, the next
// multiple of W, in chunks of C = N/W):
//  1. narrow the buffer to 16 bits, chunk j for rank j;
//  2. all-to-all: every rank receives its own chunk from every rank;
//  3. widen and sum them in float32, in ascending rank order, divide by W;
//  4. narrow that mean and all-gather the chunks; widen into the buffer.
//
// The partial sums are float32 (an element whose bfloat16 sum overflows
// float32 while its mean does not is summed again in float64): unlike NCCL's half-precision allreduce,
// which adds in 16 bits at every hop of its ring, the only roundings are
// the two narrowings (each rank's input, then the mean), so the error does
// not grow with W. The result is identical on every rank.
//
// Each rank sends (W-1)*(2C+8) bytes in the all-to-all (the 8 carry the
// caller's n, so that buffers whose lengths differ but pad to the same N
// are still caught on every rank) and (W-1)*2C in the all-gather: about
// 4(W-1)/W*n bytes, half of a float32 ring allreduce.
//
// A DownCast keeps its buffers between calls and grows them once: after
// the first call at a given size a call allocates nothing. It is used by
// one goroutine at a time; a rank keeps one per format (or per tensor).
type DownCast struct {
	format Format
	log    *zap.Logger
	stats  DownCastStats

	send  []uint16  // W chunks of header + C narrowed elements
	recv  []uint16  // the chunks received from every rank
	gsend []uint16  // this rank's narrowed mean, C elements
	grecv []uint16  // every rank's, N elements
	acc   []float32 // float32 sums of one block of this rank's chunk
}

// DownCastStats is what a DownCast has done so far, cumulative over its
// calls, on this rank.
type DownCastStats struct {
	Calls int64 // completed AllReduce calls
	// Convert is the time spent narrowing, widening and summing; Comm the
	// time spent in the all-to-all and the all-gather (which includes
	// waiting for the other ranks).
	Convert, Comm time.Duration
	// Overflow counts the finite input elements of this rank that were
	// beyond the format's range and went on the wire as ±Inf (fp16:
	// |x| >= 65520). Their mean is then ±Inf or NaN.
	Overflow int64
}

// DownCastOption configures NewDownCast.
type DownCastOption func(*DownCast)

// WithOverflowLogger makes AllReduce log a warning on every call in which
// elements of this rank's input overflowed the format (see
// DownCastStats.Overflow). The default is a no-op logger.
func WithOverflowLogger(l *zap.Logger) DownCastOption {
	return func(d *DownCast) {
		if l != nil {
			d.log = l
		}
	}
}

// dcHeader is the number of uint16 slots in front of every all-to-all
// chunk: the caller's n, a little-endian uint64.
const dcHeader = 4

// dcRefused is the n in the header of a rank that refuses the call.
const dcRefused = math.MaxUint64

// accBlock is the number of elements summed at a time in float32: the
// sums stay in the first-level cache between the W chunks.
const accBlock = 4096

// NewDownCast returns a down-cast allreduce that puts f on the wire.
// An invalid f makes every AllReduce fail.
func NewDownCast(f Format, opts ...DownCastOption) *DownCast {
	d := &DownCast{format: f, log: zap.NewNop()}
	for _, o := range opts {
		o(d)
	}
	return d
}

// Format is the format d puts on the wire.
func (d *DownCast) Format() Format { return d.format }

// Stats returns the cumulative counts and times of d's calls.
func (d *DownCast) Stats() DownCastStats { return d.stats }

// AllReduce replaces buf, on every rank of c, with the mean over the ranks
// of buf, communicated in 16 bits (see DownCast). Every rank must call it
// with the same len(buf); lengths that differ are an error on every rank.
//
// NaN and ±Inf in an input survive as NaN or ±Inf in the mean; finite
// values beyond the format's range become ±Inf too, and are counted in
// Stats().Overflow (and logged with WithOverflowLogger). With one rank the
// call still rounds: buf becomes its own 16-bit rounding.
func (d *DownCast) AllReduce(ctx context.Context, c comm.Comm, buf []float32) error {
	if c == nil {
		return errors.New("quant: down-cast allreduce: nil communicator")
	}
	f := d.format
	var bad error
	if !f.Valid() {
		// Still take part in the all-to-all, refusing in the header, so
		// that the other ranks return an error rather than wait.
		bad = fmt.Errorf("quant: down-cast allreduce: invalid format %v", f)
	}
	w, n := c.Size(), len(buf)
	chunk := (n + w - 1) / w
	stride := dcHeader + chunk
	d.grow(w, chunk)
	send, recv := d.send[:w*stride], d.recv[:w*stride]

	// 1. Narrow, chunk j (zero-padded) for rank j, each behind the header.
	t0 := time.Now()
	ov := 0
	for j := 0; j < w; j++ {
		s := send[j*stride : (j+1)*stride]
		if bad != nil {
			binary.LittleEndian.PutUint64(bytesOf(s[:dcHeader]), dcRefused)
			clear(s[dcHeader:])
			continue
		}
		binary.LittleEndian.PutUint64(bytesOf(s[:dcHeader]), uint64(n))
		lo := min(j*chunk, n)
		hi := min(lo+chunk, n)
		ov += Narrow(f, s[dcHeader:], buf[lo:hi])
		clear(s[dcHeader+hi-lo:])
	}
	if ov > 0 {
		d.stats.Overflow += int64(ov)
		// Check first: the fields would allocate even for the no-op logger.
		if ce := d.log.Check(zap.WarnLevel, "quant: down-cast allreduce: finite values beyond the format's range went on the wire as Inf"); ce != nil {
			ce.Write(zap.Stringer("format", f), zap.Int("overflow", ov), zap.Int("elements", n), zap.Int("rank", c.Rank()))
		}
	}

	// 2. All-to-all; every rank checks every rank's n.
	t1 := time.Now()
	err := c.AllToAllBytes(ctx, bytesOf(send), bytesOf(recv))
	t2 := time.Now()
	d.stats.Convert += t1.Sub(t0)
	d.stats.Comm += t2.Sub(t1)
	if err != nil {
		return errors.Join(bad, fmt.Errorf("quant: down-cast allreduce: all-to-all: %w", err))
	}
	if bad != nil {
		return bad
	}
	for j := range w {
		if binary.LittleEndian.Uint64(bytesOf(recv[j*stride:j*stride+dcHeader])) == dcRefused {
			return fmt.Errorf("quant: down-cast allreduce: rank %d refused the call (its error says why)", j)
		}
	}
	want := binary.LittleEndian.Uint64(bytesOf(recv[:dcHeader]))
	for j := 1; j < w; j++ {
		if got := binary.LittleEndian.Uint64(bytesOf(recv[j*stride : j*stride+dcHeader])); got != want {
			return fmt.Errorf("quant: down-cast allreduce: %w", &comm.MismatchError{
				Collective: comm.CAllToAll, What: "down-cast tensor length", Rank: j, Got: int(got), Want: int(want)})
		}
	}
	if n == 0 {
		d.stats.Calls++
		return nil
	}

	// 3. Sum this rank's chunk in float32, ascending rank order, block by
	// block; divide by W; narrow the mean.
	gsend := d.gsend[:chunk]
	fw := float32(w)
	for off := 0; off < chunk; off += accBlock {
		acc := d.acc[:min(accBlock, chunk-off)]
		Widen(f, acc, recv[dcHeader+off:])
		for j := 1; j < w; j++ {
			widenAdd(f, acc, recv[j*stride+dcHeader+off:])
		}
		if w > 1 {
			for i := range acc {
				acc[i] /= fw
			}
			if f == BF16 {
				resumWide(acc, recv[dcHeader+off:], stride, w)
			}
		}
		Narrow(f, gsend[off:], acc) // |mean| <= max |input|: nothing new overflows
	}

	// 4. All-gather the means and widen them into buf.
	t3 := time.Now()
	grecv := d.grecv[:w*chunk]
	err = c.AllGatherBytes(ctx, bytesOf(gsend), bytesOf(grecv))
	t4 := time.Now()
	d.stats.Convert += t3.Sub(t2)
	d.stats.Comm += t4.Sub(t3)
	if err != nil {
		return fmt.Errorf("quant: down-cast allreduce: all-gather: %w", err)
	}
	Widen(f, buf, grecv[:n])
	d.stats.Convert += time.Since(t4)
	d.stats.Calls++
	return nil
}

// resumWide redoes in float64 the means in acc that came out ±Inf from
// the float32 sum of w bfloat16 inputs (rank j's at src[j*stride+i]).
// BF16 holds values up to float32's largest, so a float32 sum of finite
// inputs can overflow where their mean cannot (4 ranks x 2e38): those
// elements get the mean of the float64 sum, rounded once to float32. An
// element with an infinite input stays infinite, as in float32; every
// other element keeps the bits of the float32 sum. It costs one scan of
// acc when nothing overflowed.
func resumWide(acc []float32, src []uint16, stride, w int) {
	for i, v := range acc {
		if !math.IsInf(float64(v), 0) {
			continue
		}
		var s float64
		for j := range w {
			s += float64(math.Float32frombits(uint32(src[j*stride+i]) << 16))
		}
		acc[i] = float32(s / float64(w))
	}
}

// grow makes the buffers hold w chunks of chunk elements; they only grow.
func (d *DownCast) grow(w, chunk int) {
	stride := dcHeader + chunk
	if cap(d.send) < w*stride {
		d.send = make([]uint16, w*stride)
		d.recv = make([]uint16, w*stride)
	}
	if cap(d.gsend) < chunk {
		d.gsend = make([]uint16, chunk)
		d.acc = make([]float32, min(chunk, accBlock))
	}
	if cap(d.grecv) < w*chunk {
		d.grecv = make([]uint16, w*chunk)
	}
	d.send, d.recv = d.send[:cap(d.send)], d.recv[:cap(d.recv)]
	d.gsend, d.grecv, d.acc = d.gsend[:cap(d.gsend)], d.grecv[:cap(d.grecv)], d.acc[:cap(d.acc)]
}

// bytesOf is the memory of u as bytes, in host byte order (little-endian
// on amd64 and arm64: the wire format of the 16-bit values).
func bytesOf(u []uint16) []byte {
	if len(u) == 0 {
		return []byte{}
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(u))), 2*len(u))
}
