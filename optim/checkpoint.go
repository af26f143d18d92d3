package optim

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
)

// Checkpoint is one rank's optimizer state: everything that decides the next
// step, parameters included. The 1-bit optimizers store each rank's own
// error buffers in it, so a checkpoint is per rank.
//
// SaveFile writes one atomically; LoadFile reads one back and rejects a
// truncated or corrupted file.
type Checkpoint struct {
	Algorithm string // "adam", "lamb", "muon", "onebit-adam", "onebit-lamb", "zeroone-adam"
	World     int    // group size it was made on
	Rank      int    // rank that made it
	Stage     Stage
	// ErrorsReset marks a checkpoint whose error buffers were dropped on
	// request, by ResetErrors, so that it can be loaded on a group of
	// another size or on another rank. Load then starts the error buffers
	// at zero and says so. Default false: a checkpoint is loaded only on
	// the group size and rank that made it.
	ErrorsReset bool

	// Ints holds counters and flags (step, var_interval, ...).
	Ints map[string]int64
	// Floats holds scalar state (LAMB coefficients, lrs, ...); float32
	// values are stored exactly.
	Floats map[string]float64
	// Tensors holds parameters and per-parameter buffers, in a fixed order.
	Tensors []Tensor
}

// Tensor is one named buffer of a checkpoint.
type Tensor struct {
	Name  string // e.g. "param/fc1.weight", "exp_avg/fc1.weight", "worker_error/fc1.weight"
	Shape []int
	Data  []float32
}

// ErrCorruptCheckpoint is wrapped by every error that reports bytes that
// are not a valid checkpoint: a foreign file, a truncated one, a checksum
// mismatch, or an inconsistent payload.
var ErrCorruptCheckpoint = errors.New("optim: not a valid checkpoint")

// ErrIncompatibleCheckpoint is wrapped by every error that refuses a valid
// checkpoint made for another algorithm, world size, rank or set of
// parameters.
var ErrIncompatibleCheckpoint = errors.New("optim: incompatible checkpoint")

// The binary form, all integers little-endian:
//
//	magic    [8]byte  "LOWBITCK"
//	version  uint32   1 or 2
//	length   uint64   payload length in bytes
//	crc      uint32   CRC-32C (Castagnoli) of the payload
//	payload:
//	  algorithm string, world int64, rank int64, stage string,
//	  flags  uint32, in version 2 only: bit 0 is ErrorsReset, the others 0,
//	  ints   uint32 count, then (name string, value int64) by ascending name,
//	  floats uint32 count, then (name string, bits uint64) by ascending name,
//	  tensors uint32 count, then per tensor: name string, rank uint32,
//	    dims int64 each, numel uint64, numel float32 bit patterns.
//
// A string is a uint32 byte length followed by the bytes. MarshalBinary
// writes version 1, which builds that predate version 2 read too, unless a
// flag is set; UnmarshalBinary reads both.
//
// The limits are the same both ways: what MarshalBinary and SaveFile write,
// UnmarshalBinary and LoadFile read, and what the format cannot represent
// is refused when saving, with nothing written. World size and rank are in
// [0, 2^31-1]; strings, and the numbers of counters, scalars and tensors,
// below 2^32; a tensor has at most 64 dimensions, each in [0, the largest
// int] (2^63-1 on 64-bit platforms: a checkpoint with a dimension of 2^31
// or more loads only where an int has 64 bits), whose product is the
// number of elements and fits an int.
const (
	ckMagic     = "LOWBITCK"
	ckVersion   = 2 // the newest version this build reads and writes
	ckHeaderLen = 8 + 4 + 8 + 4
	// flagErrorsReset is bit 0 of the version-2 flags: ErrorsReset.
	flagErrorsReset = 1
	// maxDims bounds a tensor's rank, so that a corrupt rank field cannot
	// ask for a huge allocation.
	maxDims = 64
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Tensor returns the first tensor called name, or nil. It scans
// ck.Tensors: code that looks up every parameter's tensors uses Restore,
// which indexes them once.
func (ck *Checkpoint) Tensor(name string) *Tensor {
	for i := range ck.Tensors {
		if ck.Tensors[i].Name == name {
			return &ck.Tensors[i]
		}
	}
	return nil
}

// tensorIndex finds the tensors of one checkpoint by name in constant
// time. It is built on first use, from ck.Tensors as they are then, and
// belongs to one operation (a Restore, a CheckCompatible): the checkpoint
// itself holds no index, so that it stays a plain value that goroutines
// may read, and copy, concurrently. A hit is checked against the tensor's
// name and anything else falls back to Checkpoint.Tensor, so an index
// made stale by a caller changing ck.Tensors still finds what a scan
// finds.
type tensorIndex struct {
	ck  *Checkpoint
	pos map[string]int // first position of each name
}

func (x *tensorIndex) find(name string) *Tensor {
	if x.pos == nil {
		x.pos = make(map[string]int, len(x.ck.Tensors))
		for i, t := range x.ck.Tensors {
			if _, dup := x.pos[t.Name]; !dup {
				x.pos[t.Name] = i
			}
		}
	}
	ts := x.ck.Tensors
	if i, ok := x.pos[name]; ok && i < len(ts) && ts[i].Name == name {
		return &ts[i]
	}
	return x.ck.Tensor(name)
}

// AddTensor appends a tensor holding copies of shape and data.
func (ck *Checkpoint) AddTensor(name string, shape []int, data []float32) {
	ck.Tensors = append(ck.Tensors, Tensor{Name: name, Shape: slices.Clone(shape), Data: slices.Clone(data)})
	if ck.Tensors[len(ck.Tensors)-1].Data == nil {
		ck.Tensors[len(ck.Tensors)-1].Data = []float32{}
	}
}

// TensorData returns the data of the tensor called name, checking that it
// holds n elements. The slice is the checkpoint's own: copy from it.
func (ck *Checkpoint) TensorData(name string, n int) ([]float32, error) {
	return tensorData(name, ck.Tensor(name), n)
}

// tensorData is TensorData for the tensor t found under name (nil when
// there is none).
func tensorData(name string, t *Tensor, n int) ([]float32, error) {
	if t == nil {
		return nil, fmt.Errorf("%w: tensor %q is missing", ErrIncompatibleCheckpoint, name)
	}
	if len(t.Data) != n {
		return nil, fmt.Errorf("%w: tensor %q holds %d elements, want %d", ErrIncompatibleCheckpoint, name, len(t.Data), n)
	}
	return t.Data, nil
}

// Restore stages copies of a checkpoint's tensors into an optimizer's
// buffers, so that Load checks every tensor before it changes anything:
// Tensor stages one copy, Apply performs all of them or, if any tensor was
// missing or of the wrong size, none.
//
// A Restore indexes the checkpoint's tensors by name once, so that staging
// every tensor of a checkpoint costs time linear in their number.
type Restore struct {
	idx tensorIndex
	ops []restoreCopy
	err error
}

type restoreCopy struct{ dst, src []float32 }

// Restore starts staging copies out of ck.
func (ck *Checkpoint) Restore() *Restore { return &Restore{idx: tensorIndex{ck: ck}} }

// Tensor stages copying the tensor called name, which must hold len(dst)
// elements, into dst. After the first error it does nothing.
func (r *Restore) Tensor(name string, dst []float32) {
	if r.err != nil {
		return
	}
	src, err := tensorData(name, r.idx.find(name), len(dst))
	if err != nil {
		r.err = err
		return
	}
	r.ops = append(r.ops, restoreCopy{dst, src})
}

// Apply performs every staged copy and returns nil, or returns the first
// error of Tensor and copies nothing.
func (r *Restore) Apply() error {
	if r.err != nil {
		return r.err
	}
	for _, op := range r.ops {
		copy(op.dst, op.src)
	}
	return nil
}

// Int returns the counter called name, or an error when it is missing.
func (ck *Checkpoint) Int(name string) (int64, error) {
	v, ok := ck.Ints[name]
	if !ok {
		return 0, fmt.Errorf("%w: counter %q is missing", ErrIncompatibleCheckpoint, name)
	}
	return v, nil
}

// Float returns the scalar called name, or an error when it is missing.
func (ck *Checkpoint) Float(name string) (float64, error) {
	v, ok := ck.Floats[name]
	if !ok {
		return 0, fmt.Errorf("%w: scalar %q is missing", ErrIncompatibleCheckpoint, name)
	}
	return v, nil
}

// ParamTensorName is the checkpoint name of a parameter's value:
// "param/" + name. Optimizer buffers use their own prefixes ("exp_avg/",
// "exp_avg_sq/", "worker_error/", ...).
func ParamTensorName(name string) string { return "param/" + name }

// CheckCompatible reports, with an error wrapping ErrIncompatibleCheckpoint
// that names what differs, whether ck cannot be loaded into an optimizer of
// the given algorithm on world ranks over params: another algorithm,
// another world size (unless ck.ErrorsReset is set), a parameter missing
// from ck, one with another shape, or a parameter in ck that params lack.
// A checkpoint with ErrorsReset set must hold no error buffers (see
// IsErrorBuffer).
func (ck *Checkpoint) CheckCompatible(algorithm string, world int, params []*Param) error {
	if ck == nil {
		return fmt.Errorf("%w: nil checkpoint", ErrIncompatibleCheckpoint)
	}
	if ck.Algorithm != algorithm {
		return fmt.Errorf("%w: made by algorithm %q, this optimizer is %q", ErrIncompatibleCheckpoint, ck.Algorithm, algorithm)
	}
	if ck.World != world && !ck.ErrorsReset {
		return fmt.Errorf("%w: made on %d ranks, this group has %d (Checkpoint.ResetErrors makes a copy that loads on any group size, with the error buffers reset)",
			ErrIncompatibleCheckpoint, ck.World, world)
	}
	if ck.ErrorsReset {
		for _, t := range ck.Tensors {
			if IsErrorBuffer(t.Name) {
				return fmt.Errorf("%w: marked as having its error buffers reset, but holds error buffer %q", ErrIncompatibleCheckpoint, t.Name)
			}
		}
	}
	idx := tensorIndex{ck: ck}
	for _, p := range params {
		t := idx.find(ParamTensorName(p.Name))
		if t == nil {
			return fmt.Errorf("%w: parameter %q is not in the checkpoint", ErrIncompatibleCheckpoint, p.Name)
		}
		if shape := p.Shape(); !slices.Equal(t.Shape, shape) {
			return fmt.Errorf("%w: parameter %q has shape %v in the checkpoint, %v here", ErrIncompatibleCheckpoint, p.Name, t.Shape, shape)
		}
		if len(t.Data) != p.Numel() {
			return fmt.Errorf("%w: parameter %q holds %d elements in the checkpoint, %d here", ErrIncompatibleCheckpoint, p.Name, len(t.Data), p.Numel())
		}
	}
	n := 0
	for _, t := range ck.Tensors {
		if strings.HasPrefix(t.Name, ParamTensorName("")) {
			n++
		}
	}
	if n != len(params) {
		return fmt.Errorf("%w: the checkpoint holds %d parameters, this optimizer %d", ErrIncompatibleCheckpoint, n, len(params))
	}
	return nil
}

// MarshalBinary encodes ck in the binary form described above. It fails,
// writing nothing, for a checkpoint the format cannot represent or that
// UnmarshalBinary would refuse (see the limits above), and for a tensor
// whose shape does not match its data.
func (ck *Checkpoint) MarshalBinary() ([]byte, error) {
	l, err := ck.layout()
	if err != nil {
		return nil, err
	}
	if l.size > math.MaxInt-ckHeaderLen {
		return nil, fmt.Errorf("optim: checkpoint of %d bytes does not fit in memory; use SaveFile, which streams it", l.size)
	}
	b := make([]byte, ckHeaderLen, ckHeaderLen+int(l.size))
	w := &sliceWriter{b: b}
	crc, err := ck.writePayload(w, l)
	if err != nil {
		return nil, err
	}
	putHeader(w.b[:ckHeaderLen], l, crc)
	return w.b, nil
}

// sliceWriter appends to b.
type sliceWriter struct{ b []byte }

func (w *sliceWriter) Write(p []byte) (int, error) {
	w.b = append(w.b, p...)
	return len(p), nil
}

// ckLayout is what the header of an encoded checkpoint says.
type ckLayout struct {
	version, flags uint32
	size           uint64 // payload bytes
}

// putHeader writes the header of a payload with layout l and checksum crc
// into h (ckHeaderLen bytes).
func putHeader(h []byte, l ckLayout, crc uint32) {
	copy(h[0:8], ckMagic)
	binary.LittleEndian.PutUint32(h[8:12], l.version)
	binary.LittleEndian.PutUint64(h[12:20], l.size)
	binary.LittleEndian.PutUint32(h[20:24], crc)
}

// layout checks that ck can be encoded, within the limits UnmarshalBinary
// accepts, and returns its version, flags and payload size.
func (ck *Checkpoint) layout() (ckLayout, error) {
	var l ckLayout
	if ck.ErrorsReset {
		l.flags |= flagErrorsReset
	}
	l.version = 1
	if l.flags != 0 {
		l.version = 2
	}
	if ck.World < 0 || ck.World > math.MaxInt32 || ck.Rank < 0 || ck.Rank > math.MaxInt32 {
		return l, fmt.Errorf("optim: checkpoint world size %d and rank %d must be in [0, %d]", ck.World, ck.Rank, math.MaxInt32)
	}
	size := uint64(4+len(ck.Algorithm)) + 16 + uint64(4+len(ck.Stage)) + 3*4
	if l.version >= 2 {
		size += 4
	}
	strs := []struct {
		what string
		n    int
	}{{"algorithm", len(ck.Algorithm)}, {"stage", len(ck.Stage)}, {"counter count", len(ck.Ints)}, {"scalar count", len(ck.Floats)}, {"tensor count", len(ck.Tensors)}}
	for _, s := range strs {
		if uint64(s.n) > math.MaxUint32 {
			return l, fmt.Errorf("optim: checkpoint %s %d exceeds the format's limit of %d", s.what, s.n, uint64(math.MaxUint32))
		}
	}
	for k := range ck.Ints {
		if uint64(len(k)) > math.MaxUint32 {
			return l, fmt.Errorf("optim: checkpoint counter name of %d bytes exceeds the format's limit of %d", len(k), uint64(math.MaxUint32))
		}
		size += 4 + uint64(len(k)) + 8
	}
	for k := range ck.Floats {
		if uint64(len(k)) > math.MaxUint32 {
			return l, fmt.Errorf("optim: checkpoint scalar name of %d bytes exceeds the format's limit of %d", len(k), uint64(math.MaxUint32))
		}
		size += 4 + uint64(len(k)) + 8
	}
	for _, t := range ck.Tensors {
		if uint64(len(t.Name)) > math.MaxUint32 {
			return l, fmt.Errorf("optim: checkpoint tensor name of %d bytes exceeds the format's limit of %d", len(t.Name), uint64(math.MaxUint32))
		}
		if len(t.Shape) > maxDims {
			return l, fmt.Errorf("optim: checkpoint tensor %q has %d dimensions, at most %d are supported", t.Name, len(t.Shape), maxDims)
		}
		n, ok := numel(t.Shape)
		if !ok {
			for _, d := range t.Shape {
				if d < 0 {
					return l, fmt.Errorf("optim: checkpoint tensor %q has negative dimension in shape %v", t.Name, t.Shape)
				}
			}
			return l, fmt.Errorf("optim: checkpoint tensor %q: shape %v holds more elements than an int can count", t.Name, t.Shape)
		}
		if n != len(t.Data) {
			return l, fmt.Errorf("optim: checkpoint tensor %q: shape %v holds %d elements, data has %d", t.Name, t.Shape, n, len(t.Data))
		}
		size += 4 + uint64(len(t.Name)) + 4 + 8*uint64(len(t.Shape)) + 8 + 4*uint64(len(t.Data))
	}
	l.size = size
	return l, nil
}

// numel is the number of elements of shape, false when a dimension is
// negative or the product overflows an int. A zero dimension makes it 0
// whatever the others are.
func numel(shape []int) (int, bool) {
	n, zero, overflow := 1, false, false
	for _, d := range shape {
		switch {
		case d < 0:
			return 0, false
		case d == 0:
			zero = true
		case overflow:
		case d > math.MaxInt/n:
			overflow = true
		default:
			n *= d
		}
	}
	if zero {
		return 0, true
	}
	return n, !overflow
}

// ckChunk is how many float32s the encoder converts per write.
const ckChunk = 16 << 10

// payloadWriter writes the payload to w, computing its CRC-32C and
// counting its bytes; the first error sticks.
type payloadWriter struct {
	w       io.Writer
	crc     uint32
	n       uint64
	err     error
	small   [8]byte
	scratch []byte
}

func (e *payloadWriter) write(p []byte) {
	if e.err != nil {
		return
	}
	e.crc = crc32.Update(e.crc, castagnoli, p)
	e.n += uint64(len(p))
	_, e.err = e.w.Write(p)
}

func (e *payloadWriter) u32(v uint32) {
	binary.LittleEndian.PutUint32(e.small[:4], v)
	e.write(e.small[:4])
}

func (e *payloadWriter) u64(v uint64) {
	binary.LittleEndian.PutUint64(e.small[:], v)
	e.write(e.small[:])
}

func (e *payloadWriter) str(s string) {
	e.u32(uint32(len(s)))
	for len(s) > 0 && e.err == nil {
		k := min(len(s), len(e.small))
		e.write(e.small[:copy(e.small[:], s[:k])])
		s = s[k:]
	}
}

func (e *payloadWriter) floats(x []float32) {
	if e.scratch == nil {
		e.scratch = make([]byte, 4*ckChunk)
	}
	for len(x) > 0 && e.err == nil {
		k := min(len(x), ckChunk)
		for i, v := range x[:k] {
			binary.LittleEndian.PutUint32(e.scratch[4*i:], math.Float32bits(v))
		}
		e.write(e.scratch[:4*k])
		x = x[k:]
	}
}

// writePayload writes the payload of ck, whose layout is l, to w and
// returns its CRC-32C. It fails when w does, or when ck changed since
// layout measured it.
func (ck *Checkpoint) writePayload(w io.Writer, l ckLayout) (uint32, error) {
	e := &payloadWriter{w: w}
	e.str(ck.Algorithm)
	e.u64(uint64(int64(ck.World)))
	e.u64(uint64(int64(ck.Rank)))
	e.str(string(ck.Stage))
	if l.version >= 2 {
		e.u32(l.flags)
	}
	e.u32(uint32(len(ck.Ints)))
	for _, k := range sortedKeys(ck.Ints) {
		e.str(k)
		e.u64(uint64(ck.Ints[k]))
	}
	e.u32(uint32(len(ck.Floats)))
	for _, k := range sortedKeys(ck.Floats) {
		e.str(k)
		e.u64(math.Float64bits(ck.Floats[k]))
	}
	e.u32(uint32(len(ck.Tensors)))
	for _, t := range ck.Tensors {
		e.str(t.Name)
		e.u32(uint32(len(t.Shape)))
		for _, d := range t.Shape {
			e.u64(uint64(int64(d)))
		}
		e.u64(uint64(len(t.Data)))
		e.floats(t.Data)
	}
	if e.err != nil {
		return 0, e.err
	}
	if e.n != l.size {
		return 0, fmt.Errorf("optim: checkpoint changed while it was being encoded (%d bytes written, %d expected)", e.n, l.size)
	}
	return e.crc, nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// UnmarshalBinary decodes the binary form into ck, replacing its contents.
// Bytes that are not a whole, intact checkpoint of a known version are
// refused with an error wrapping ErrCorruptCheckpoint, and ck is left
// unchanged. It never panics and never allocates more than the input
// can describe.
func (ck *Checkpoint) UnmarshalBinary(b []byte) error {
	h, err := checkHeader(b[:min(len(b), ckHeaderLen)], uint64(max(len(b)-ckHeaderLen, 0)))
	if err != nil {
		return err
	}
	payload := b[ckHeaderLen:]
	if got := crc32.Checksum(payload, castagnoli); got != h.crc {
		return checksumError(got, h.crc)
	}
	out, err := decodePayload(bytes.NewReader(payload), h, false)
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

// decodePayload decodes the payload that h describes from r, which holds
// at least h.size bytes. With verify it computes the checksum of what it
// reads and refuses a mismatch; a payload that is damaged in a way the
// decoder notices first is still reported as a checksum mismatch, as
// UnmarshalBinary, which checks the checksum before decoding, reports it.
// Every allocation is bounded by the payload bytes not yet read.
func decodePayload(r io.Reader, h ckHeader, verify bool) (Checkpoint, error) {
	d := decoder{r: r, left: h.size, sum: verify, chunk: int(min(h.size, 4*ckChunk))}
	out := d.checkpoint(h.version)
	if d.err == nil && d.left != 0 {
		d.fail("%d unread bytes at the end of the payload", d.left)
	}
	if !verify || d.readErr != nil {
		if d.err != nil {
			return Checkpoint{}, d.err
		}
		return out, nil
	}
	if d.err != nil {
		out = Checkpoint{} // garbage: let the collector have it while the rest is read
		for d.left > 0 && d.readErr == nil {
			d.read(d.buf()[:min(d.left, uint64(len(d.buf())))])
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

// decoder reads a payload from r: left is how many of its bytes remain,
// and bounds every allocation. The first error sticks and every later read
// returns zero values; readErr is set, to the same error, when reading
// failed rather than the bytes read being invalid.
type decoder struct {
	r       io.Reader
	left    uint64
	sum     bool   // compute crc
	crc     uint32 // CRC-32C of the bytes read
	err     error
	readErr error
	small   [8]byte
	chunk   int    // size of scratch
	scratch []byte // for tensor data and long strings
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

func (d *decoder) u32(what, suffix string) uint32 {
	if !d.need(4, what, suffix) || !d.read(d.small[:4]) {
		return 0
	}
	return binary.LittleEndian.Uint32(d.small[:4])
}

func (d *decoder) u64(what string) uint64 {
	if !d.need(8, what, "") || !d.read(d.small[:]) {
		return 0
	}
	return binary.LittleEndian.Uint64(d.small[:])
}

func (d *decoder) str(what string) string {
	n := uint64(d.u32(what, " length"))
	if !d.need(n, what, "") || n == 0 {
		return ""
	}
	var sb strings.Builder
	sb.Grow(int(n))
	for n > 0 {
		p := d.buf()[:min(n, uint64(len(d.buf())))]
		if !d.read(p) {
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
		p := d.buf()
		k := min(len(x), len(p)/4)
		if !d.read(p[:4*k]) {
			return t
		}
		for i := range x[:k] {
			x[i] = math.Float32frombits(binary.LittleEndian.Uint32(p[4*i:]))
		}
		x = x[k:]
	}
	return t
}

// SaveFile writes ck to path atomically: it checks that ck can be encoded,
// streams the encoding (computing its checksum on the way) through a
// buffer into a temporary file in the same directory, writes the checksum
// into the header, syncs the file to disk, renames it over path and syncs
// the directory. Beyond ck it allocates only the write buffer, not a copy
// of the encoding. If anything fails the temporary file is removed and
// whatever was at path before is left untouched.
func SaveFile(path string, ck *Checkpoint) error {
	return saveFile(path, ck, nil)
}

// saveBufferSize is the size of SaveFile's write buffer.
const saveBufferSize = 1 << 20

// saveFile is SaveFile with the file's writer wrappable (wrap may be nil),
// so that tests can make the write fail midway.
func saveFile(path string, ck *Checkpoint, wrap func(io.Writer) io.Writer) error {
	if ck == nil {
		return fmt.Errorf("optim: saving checkpoint %s: nil checkpoint", path)
	}
	l, err := ck.layout()
	if err != nil {
		return fmt.Errorf("optim: saving checkpoint %s: %w", path, err)
	}
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	f, err := os.CreateTemp(dir, "."+base+".tmp-*")
	if err != nil {
		return fmt.Errorf("optim: saving checkpoint %s: %w", path, err)
	}
	tmp := f.Name()
	if err := writeSynced(f, ck, l, wrap); err != nil {
		f.Close()
		os.Remove(tmp)
		return fmt.Errorf("optim: saving checkpoint %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("optim: saving checkpoint %s: %w", path, err)
	}
	// The rename is durable once the directory is synced. Some systems
	// cannot sync a directory; the file itself is complete then.
	if d, err := os.Open(dir); err == nil {
		serr := d.Sync()
		d.Close()
		if serr != nil && !errors.Is(serr, os.ErrInvalid) {
			return fmt.Errorf("optim: saved checkpoint %s but syncing its directory failed: %w", path, serr)
		}
	}
	return nil
}

// writeSynced streams ck (of layout l) into f, header first with a zero
// checksum that is then written in place, syncs and closes f.
func writeSynced(f *os.File, ck *Checkpoint, l ckLayout, wrap func(io.Writer) io.Writer) error {
	var w io.Writer = f
	if wrap != nil {
		w = wrap(w)
	}
	bw := bufio.NewWriterSize(w, saveBufferSize)
	var h [ckHeaderLen]byte
	putHeader(h[:], l, 0)
	if _, err := bw.Write(h[:]); err != nil {
		return err
	}
	crc, err := ck.writePayload(bw, l)
	if err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	binary.LittleEndian.PutUint32(h[20:24], crc)
	if _, err := f.WriteAt(h[20:24], 20); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
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
	ck := new(Checkpoint)
	if *ck, err = decodePayload(r, h, true); err != nil {
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
