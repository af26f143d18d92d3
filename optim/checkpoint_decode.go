package optim

// Reading a Checkpoint (checkpoint.go) from its binary form:
// UnmarshalBinary, and LoadFile, which decodes a file as it reads it.

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"os"
	"strings"
)

// UnmarshalBinary decodes the binary form into ck, replacing its contents.
// Bytes that are not a whole, intact checkpoint of a known version are
// refused with an error wrapping ErrCorruptCheckpoint, and ck is left
// unchanged. It never panics and never allocates more than the input
// can describe; it decodes the bytes where they lie in b, copying nothing
// beside what it returns.
func (ck *Checkpoint) UnmarshalBinary(b []byte) error {
	h, err := checkHeader(b[:min(len(b), ckHeaderLen)], uint64(max(len(b)-ckHeaderLen, 0)))
	if err != nil {
		return err
	}
	payload := b[ckHeaderLen:]
	if got := crc32.Checksum(payload, castagnoli); got != h.crc {
		return checksumError(got, h.crc)
	}
	d := decoder{mem: payload, left: h.size}
	out, err := d.payload(h)
	if err != nil {
		return err
	}
	*ck = out
	return nil
}

// ckHeader is what a valid header says.
type ckHeader struct {
	version uint32
	size    uint64 // payload bytes
	crc     uint32
}

// checkHeader checks the header h of an encoding whose payload, the bytes
// after the header, is avail bytes long. h is shorter than ckHeaderLen
// only when the whole encoding is.
func checkHeader(h []byte, avail uint64) (ckHeader, error) {
	if len(h) < ckHeaderLen {
		if len(h) >= 8 && string(h[:8]) != ckMagic || len(h) < 8 && string(h) != ckMagic[:len(h)] {
			return ckHeader{}, fmt.Errorf("%w: not a lowbit checkpoint (bad magic)", ErrCorruptCheckpoint)
		}
		return ckHeader{}, fmt.Errorf("%w: truncated header (%d bytes, want %d)", ErrCorruptCheckpoint, len(h), ckHeaderLen)
	}
	if string(h[:8]) != ckMagic {
		return ckHeader{}, fmt.Errorf("%w: not a lowbit checkpoint (bad magic %q)", ErrCorruptCheckpoint, h[:8])
	}
	version := binary.LittleEndian.Uint32(h[8:12])
	if version < 1 || version > ckVersion {
		return ckHeader{}, fmt.Errorf("%w: format version %d, this build reads versions 1 to %d", ErrCorruptCheckpoint, version, ckVersion)
	}
	n := binary.LittleEndian.Uint64(h[12:20])
	if n != avail {
		if n > avail {
			return ckHeader{}, fmt.Errorf("%w: truncated: header announces %d payload bytes, file holds %d", ErrCorruptCheckpoint, n, avail)
		}
		return ckHeader{}, fmt.Errorf("%w: %d bytes after the %d-byte payload", ErrCorruptCheckpoint, avail-n, n)
	}
	return ckHeader{version: version, size: n, crc: binary.LittleEndian.Uint32(h[20:24])}, nil
}

func checksumError(got, want uint32) error {
	return fmt.Errorf("%w: checksum mismatch (CRC-32C %08x, header says %08x)", ErrCorruptCheckpoint, got, want)
}

// payload decodes the payload that h describes, whose h.size bytes d
// holds. With d.sum it computes the checksum of what it reads and refuses
// a mismatch; a payload that is damaged in a way the decoder notices first
// is still reported as a checksum mismatch, as UnmarshalBinary, which
// checks the checksum before decoding, reports it. Every allocation is
// bounded by the payload bytes not yet read.
func (d *decoder) payload(h ckHeader) (Checkpoint, error) {
	out := d.checkpoint(h.version)
	if d.err == nil && d.left != 0 {
		d.fail("%d unread bytes at the end of the payload", d.left)
	}
	if !d.sum || d.readErr != nil {
		if d.err != nil {
			return Checkpoint{}, d.err
		}
		return out, nil
	}
	if d.err != nil {
		out = Checkpoint{} // garbage: let the collector have it while the rest is read
		for d.left > 0 && d.readErr == nil {
			d.next(d.left)
		}
		if d.readErr != nil {
			return Checkpoint{}, d.readErr
		}
	}
	if d.crc != h.crc {
		return Checkpoint{}, checksumError(d.crc, h.crc)
	}
	if d.err != nil {
		return Checkpoint{}, d.err
	}
	return out, nil
}

// decoder reads a payload from r, or, with r nil, from mem, the payload
// in memory: left is how many of its bytes remain, and bounds every
// allocation. The first error sticks and every later read returns zero
// values; readErr is set, to the same error, when reading failed rather
// than the bytes read being invalid.
type decoder struct {
	r       io.Reader
	mem     []byte // with r nil, the payload's bytes not read yet
	left    uint64
	sum     bool   // compute crc
	crc     uint32 // CRC-32C of the bytes read
	err     error
	readErr error
	chunk   int    // size of scratch
	scratch []byte // what is read from r, a chunk at a time
	zero    [8]byte
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", ErrCorruptCheckpoint, fmt.Sprintf(format, args...))
	}
}

// buf returns the scratch buffer, a multiple of 4 bytes long.
func (d *decoder) buf() []byte {
	if d.scratch == nil {
		d.scratch = make([]byte, max(d.chunk&^3, 8))
	}
	return d.scratch
}

// next returns the next bytes of the payload, at most n of them (n at
// least 1 and at most d.left), or nil once reading failed: in memory, the
// n bytes themselves, not a copy; from r, as many as the scratch buffer
// holds, read into it (at least 8, a multiple of 4).
func (d *decoder) next(n uint64) []byte {
	if d.r == nil {
		p := d.mem[:n:n]
		d.mem = d.mem[n:]
		d.left -= n
		if d.sum {
			d.crc = crc32.Update(d.crc, castagnoli, p)
		}
		return p
	}
	p := d.buf()[:min(n, uint64(len(d.buf())))]
	if !d.read(p) {
		return nil
	}
	return p
}

// read fills p, which is no longer than d.left, from r.
func (d *decoder) read(p []byte) bool {
	n, err := io.ReadFull(d.r, p)
	if d.sum {
		d.crc = crc32.Update(d.crc, castagnoli, p[:n])
	}
	d.left -= uint64(n)
	if err == nil {
		return true
	}
	d.readErr = readError(err, d.left)
	if d.err == nil {
		d.err = d.readErr
	}
	return false
}

// readError is the error of a read that failed with err, missing bytes
// that the size of the input promised.
func readError(err error, missing uint64) error {
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return fmt.Errorf("%w: truncated: the input ends %d bytes early (did the file change while it was read?)", ErrCorruptCheckpoint, missing)
	}
	return fmt.Errorf("reading the checkpoint: %w", err)
}

// need reports whether n more bytes, for what (followed by suffix), can be
// read, failing when they cannot.
func (d *decoder) need(n uint64, what, suffix string) bool {
	if d.err != nil {
		return false
	}
	if n > d.left {
		d.fail("%s%s needs %d bytes, %d remain", what, suffix, n, d.left)
		return false
	}
	return true
}

// word returns the next n bytes (4 or 8) for what (followed by suffix),
// or 8 zero bytes once an error has stuck.
func (d *decoder) word(n uint64, what, suffix string) []byte {
	if d.need(n, what, suffix) {
		if p := d.next(n); p != nil {
			return p
		}
	}
	return d.zero[:]
}

func (d *decoder) u32(what, suffix string) uint32 {
	return binary.LittleEndian.Uint32(d.word(4, what, suffix))
}

func (d *decoder) u64(what string) uint64 {
	return binary.LittleEndian.Uint64(d.word(8, what, ""))
}

func (d *decoder) str(what string) string {
	n := uint64(d.u32(what, " length"))
	if !d.need(n, what, "") || n == 0 {
		return ""
	}
	var sb strings.Builder
	sb.Grow(int(n))
	for n > 0 {
		p := d.next(n)
		if p == nil {
			return ""
		}
		sb.Write(p)
		n -= uint64(len(p))
	}
	return sb.String()
}

func (d *decoder) int(what string) int {
	v := int64(d.u64(what))
	if d.err == nil && (v < 0 || v > math.MaxInt32) {
		d.fail("%s %d out of range", what, v)
	}
	return int(v)
}

// count reads an entry count and checks that the remaining bytes could
// hold that many entries of at least minSize bytes each.
func (d *decoder) count(what string, minSize uint64) int {
	n := uint64(d.u32(what, " count"))
	if d.err == nil && n*minSize > d.left {
		d.fail("%d entries of %s cannot fit in %d bytes", n, what, d.left)
		return 0
	}
	return int(n)
}

// checkpoint decodes a payload of the given format version.
func (d *decoder) checkpoint(version uint32) Checkpoint {
	var out Checkpoint
	out.Algorithm = d.str("algorithm")
	out.World = d.int("world size")
	out.Rank = d.int("rank")
	out.Stage = Stage(d.str("stage"))
	if version >= 2 {
		flags := d.u32("flags", "")
		if d.err == nil && flags&^flagErrorsReset != 0 {
			d.fail("unknown flags %#x", flags&^flagErrorsReset)
		}
		out.ErrorsReset = flags&flagErrorsReset != 0
	}
	if cnt := d.count("counter", 4+8); cnt > 0 {
		out.Ints = make(map[string]int64, cnt)
		for range cnt {
			k := d.str("counter name")
			out.Ints[k] = int64(d.u64("counter"))
		}
	}
	if cnt := d.count("scalar", 4+8); cnt > 0 {
		out.Floats = make(map[string]float64, cnt)
		for range cnt {
			k := d.str("scalar name")
			out.Floats[k] = math.Float64frombits(d.u64("scalar"))
		}
	}
	if cnt := d.count("tensor", 4+4+8); cnt > 0 {
		out.Tensors = make([]Tensor, 0, cnt)
		for range cnt {
			t := d.tensor()
			if d.err != nil {
				break
			}
			out.Tensors = append(out.Tensors, t)
		}
	}
	return out
}

func (d *decoder) tensor() Tensor {
	var t Tensor
	t.Name = d.str("tensor name")
	dims := d.u32("tensor rank", "")
	if d.err == nil && dims > maxDims {
		d.fail("tensor %q has %d dimensions, at most %d are supported", t.Name, dims, maxDims)
	}
	if d.err != nil {
		return t
	}
	t.Shape = make([]int, dims)
	numel := uint64(1)
	for i := range t.Shape {
		v := int64(d.u64("tensor dimension"))
		if d.err != nil {
			return t
		}
		if v < 0 || uint64(v) > math.MaxInt {
			d.fail("tensor %q: dimension %d out of range", t.Name, v)
			return t
		}
		t.Shape[i] = int(v)
		// Saturate: a product beyond what the file could hold fails below.
		if numel != 0 && uint64(v) > math.MaxInt64/4/numel {
			numel = math.MaxInt64 / 4
		} else {
			numel *= uint64(v)
		}
	}
	n := d.u64("tensor length")
	if d.err != nil {
		return t
	}
	if n != numel {
		d.fail("tensor %q: shape %v holds %d elements, length field says %d", t.Name, t.Shape, numel, n)
		return t
	}
	if n > d.left/4 {
		d.fail("tensor %q needs %d bytes of data, %d remain", t.Name, 4*n, d.left)
		return t
	}
	t.Data = make([]float32, n)
	for x := t.Data; len(x) > 0; {
		p := d.next(4 * uint64(len(x)))
		if p == nil {
			return t
		}
		k := len(p) / 4
		for i := range x[:k] {
			x[i] = math.Float32frombits(binary.LittleEndian.Uint32(p[4*i:]))
		}
		x = x[k:]
	}
	return t
}

// LoadFile reads a checkpoint written by SaveFile. A missing, truncated,
// corrupted or foreign file is refused with an error naming the file (and
// wrapping ErrCorruptCheckpoint when the bytes are at fault).
//
// It decodes the file as it reads it, through a small buffer, checking the
// checksum at the end: its memory peaks at the checkpoint it returns plus
// that buffer, not at twice the checkpoint. A file that is not a regular
// file (a pipe, say), whose size is unknown until it is read, is read
// whole first.
func LoadFile(path string) (*Checkpoint, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("optim: loading checkpoint: %w", err)
	}
	defer f.Close()
	ck, err := readCheckpoint(f)
	if err != nil {
		return nil, fmt.Errorf("optim: loading checkpoint %s: %w", path, err)
	}
	return ck, nil
}

// loadBufferSize is the size of LoadFile's read buffer.
const loadBufferSize = 64 << 10

// readCheckpoint decodes the checkpoint in f, streaming it when f is a
// regular file, whose size then bounds every allocation as the length of
// the input does UnmarshalBinary's.
func readCheckpoint(f *os.File) (*Checkpoint, error) {
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		b, err := io.ReadAll(f)
		if err != nil {
			return nil, err
		}
		ck := new(Checkpoint)
		if err := ck.UnmarshalBinary(b); err != nil {
			return nil, err
		}
		return ck, nil
	}
	return decodeStream(bufio.NewReaderSize(f, loadBufferSize), fi.Size())
}

// decodeStream decodes a checkpoint from r, which holds size bytes: it
// accepts and refuses what UnmarshalBinary does, with the same errors,
// and also refuses, with an error wrapping ErrCorruptCheckpoint, an r
// that ends early or holds more (a file that changed while it was read).
// An error of r is returned wrapped.
func decodeStream(r io.Reader, size int64) (*Checkpoint, error) {
	var hb [ckHeaderLen]byte
	want := int(min(max(size, 0), ckHeaderLen))
	n, err := io.ReadFull(r, hb[:want])
	if err != nil {
		return nil, readError(err, uint64(want-n))
	}
	h, err := checkHeader(hb[:n], uint64(max(size-ckHeaderLen, 0)))
	if err != nil {
		return nil, err
	}
	d := decoder{r: r, left: h.size, sum: true, chunk: int(min(h.size, 4*ckChunk))}
	ck := new(Checkpoint)
	if *ck, err = d.payload(h); err != nil {
		return nil, err
	}
	switch _, err := io.ReadFull(r, hb[:1]); {
	case err == nil:
		return nil, fmt.Errorf("%w: bytes after the %d-byte payload (did the file change while it was read?)", ErrCorruptCheckpoint, h.size)
	case !errors.Is(err, io.EOF):
		return nil, fmt.Errorf("reading the checkpoint: %w", err)
	}
	return ck, nil
}
