package optim

import (
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
	Algorithm string // "adam", "lamb", "onebit-adam", "onebit-lamb", "zeroone-adam"
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

// Tensor returns the tensor called name, or nil.
func (ck *Checkpoint) Tensor(name string) *Tensor {
	for i := range ck.Tensors {
		if ck.Tensors[i].Name == name {
			return &ck.Tensors[i]
		}
	}
	return nil
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
	t := ck.Tensor(name)
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
type Restore struct {
	ck  *Checkpoint
	ops []restoreCopy
	err error
}

type restoreCopy struct{ dst, src []float32 }

// Restore starts staging copies out of ck.
func (ck *Checkpoint) Restore() *Restore { return &Restore{ck: ck} }

// Tensor stages copying the tensor called name, which must hold len(dst)
// elements, into dst. After the first error it does nothing.
func (r *Restore) Tensor(name string, dst []float32) {
	if r.err != nil {
		return
	}
	src, err := r.ck.TensorData(name, len(dst))
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
	for _, p := range params {
		t := ck.Tensor(ParamTensorName(p.Name))
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

// MarshalBinary encodes ck in the binary form described above. It fails
// for a tensor whose shape does not match its data.
func (ck *Checkpoint) MarshalBinary() ([]byte, error) {
	var flags uint32
	if ck.ErrorsReset {
		flags |= flagErrorsReset
	}
	version := uint32(1)
	if flags != 0 {
		version = 2
	}
	size := 8 + 4 + len(ck.Algorithm) + 4 + len(ck.Stage) + 4 + 16*3
	for k := range ck.Ints {
		size += 4 + len(k) + 8
	}
	for k := range ck.Floats {
		size += 4 + len(k) + 8
	}
	for _, t := range ck.Tensors {
		if len(t.Shape) > maxDims {
			return nil, fmt.Errorf("optim: checkpoint tensor %q has %d dimensions, at most %d are supported", t.Name, len(t.Shape), maxDims)
		}
		n := 1
		for _, d := range t.Shape {
			if d < 0 {
				return nil, fmt.Errorf("optim: checkpoint tensor %q has negative dimension in shape %v", t.Name, t.Shape)
			}
			n *= d
		}
		if n != len(t.Data) {
			return nil, fmt.Errorf("optim: checkpoint tensor %q: shape %v holds %d elements, data has %d", t.Name, t.Shape, n, len(t.Data))
		}
		size += 4 + len(t.Name) + 4 + 8*len(t.Shape) + 8 + 4*len(t.Data)
	}
	b := make([]byte, ckHeaderLen, ckHeaderLen+size)
	b = appendString(b, ck.Algorithm)
	b = binary.LittleEndian.AppendUint64(b, uint64(int64(ck.World)))
	b = binary.LittleEndian.AppendUint64(b, uint64(int64(ck.Rank)))
	b = appendString(b, string(ck.Stage))
	if version >= 2 {
		b = binary.LittleEndian.AppendUint32(b, flags)
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(ck.Ints)))
	for _, k := range sortedKeys(ck.Ints) {
		b = appendString(b, k)
		b = binary.LittleEndian.AppendUint64(b, uint64(ck.Ints[k]))
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(ck.Floats)))
	for _, k := range sortedKeys(ck.Floats) {
		b = appendString(b, k)
		b = binary.LittleEndian.AppendUint64(b, math.Float64bits(ck.Floats[k]))
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(ck.Tensors)))
	for _, t := range ck.Tensors {
		b = appendString(b, t.Name)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(t.Shape)))
		for _, d := range t.Shape {
			b = binary.LittleEndian.AppendUint64(b, uint64(int64(d)))
		}
		b = binary.LittleEndian.AppendUint64(b, uint64(len(t.Data)))
		for _, x := range t.Data {
			b = binary.LittleEndian.AppendUint32(b, math.Float32bits(x))
		}
	}
	payload := b[ckHeaderLen:]
	copy(b[0:8], ckMagic)
	binary.LittleEndian.PutUint32(b[8:12], version)
	binary.LittleEndian.PutUint64(b[12:20], uint64(len(payload)))
	binary.LittleEndian.PutUint32(b[20:24], crc32.Checksum(payload, castagnoli))
	return b, nil
}

func appendString(b []byte, s string) []byte {
	b = binary.LittleEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
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
	if len(b) < ckHeaderLen {
		if len(b) >= 8 && string(b[:8]) != ckMagic || len(b) < 8 && string(b) != ckMagic[:len(b)] {
			return fmt.Errorf("%w: not a lowbit checkpoint (bad magic)", ErrCorruptCheckpoint)
		}
		return fmt.Errorf("%w: truncated header (%d bytes, want %d)", ErrCorruptCheckpoint, len(b), ckHeaderLen)
	}
	if string(b[:8]) != ckMagic {
		return fmt.Errorf("%w: not a lowbit checkpoint (bad magic %q)", ErrCorruptCheckpoint, b[:8])
	}
	version := binary.LittleEndian.Uint32(b[8:12])
	if version < 1 || version > ckVersion {
		return fmt.Errorf("%w: format version %d, this build reads versions 1 to %d", ErrCorruptCheckpoint, version, ckVersion)
	}
	n := binary.LittleEndian.Uint64(b[12:20])
	payload := b[ckHeaderLen:]
	if n != uint64(len(payload)) {
		if n > uint64(len(payload)) {
			return fmt.Errorf("%w: truncated: header announces %d payload bytes, file holds %d", ErrCorruptCheckpoint, n, len(payload))
		}
		return fmt.Errorf("%w: %d bytes after the %d-byte payload", ErrCorruptCheckpoint, uint64(len(payload))-n, n)
	}
	if got, want := crc32.Checksum(payload, castagnoli), binary.LittleEndian.Uint32(b[20:24]); got != want {
		return fmt.Errorf("%w: checksum mismatch (CRC-32C %08x, header says %08x)", ErrCorruptCheckpoint, got, want)
	}
	d := decoder{b: payload}
	var out Checkpoint
	out.Algorithm = d.str("algorithm")
	out.World = d.int("world size")
	out.Rank = d.int("rank")
	out.Stage = Stage(d.str("stage"))
	if version >= 2 {
		flags := d.u32("flags")
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
	if d.err == nil && len(d.b) != 0 {
		d.fail("%d unread bytes at the end of the payload", len(d.b))
	}
	if d.err != nil {
		return d.err
	}
	*ck = out
	return nil
}

// decoder reads the payload; the first error sticks and every later read
// returns zero values.
type decoder struct {
	b   []byte
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: %s", ErrCorruptCheckpoint, fmt.Sprintf(format, args...))
	}
}

func (d *decoder) take(n uint64, what string) []byte {
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b)) {
		d.fail("%s needs %d bytes, %d remain", what, n, len(d.b))
		return nil
	}
	s := d.b[:n]
	d.b = d.b[n:]
	return s
}

func (d *decoder) u32(what string) uint32 {
	s := d.take(4, what)
	if s == nil {
		return 0
	}
	return binary.LittleEndian.Uint32(s)
}

func (d *decoder) u64(what string) uint64 {
	s := d.take(8, what)
	if s == nil {
		return 0
	}
	return binary.LittleEndian.Uint64(s)
}

func (d *decoder) str(what string) string {
	n := d.u32(what + " length")
	return string(d.take(uint64(n), what))
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
	n := uint64(d.u32(what + " count"))
	if d.err == nil && n*minSize > uint64(len(d.b)) {
		d.fail("%d entries of %s cannot fit in %d bytes", n, what, len(d.b))
		return 0
	}
	return int(n)
}

func (d *decoder) tensor() Tensor {
	var t Tensor
	t.Name = d.str("tensor name")
	dims := d.u32("tensor rank")
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
		if v < 0 || v > math.MaxInt32 {
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
	if n > uint64(len(d.b))/4 {
		d.fail("tensor %q needs %d bytes of data, %d remain", t.Name, 4*n, len(d.b))
		return t
	}
	raw := d.take(4*n, "tensor data")
	t.Data = make([]float32, n)
	for i := range t.Data {
		t.Data[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
	}
	return t
}

// SaveFile writes ck to path atomically: it encodes ck, writes it to a
// temporary file in the same directory, syncs it to disk, renames it over
// path and syncs the directory. If anything fails the temporary file is
// removed and whatever was at path before is left untouched.
func SaveFile(path string, ck *Checkpoint) error {
	return saveFile(path, ck, func(w io.Writer, b []byte) error {
		_, err := w.Write(b)
		return err
	})
}

// saveFile is SaveFile with the write of the encoded bytes injectable, so
// that tests can make it fail midway.
func saveFile(path string, ck *Checkpoint, write func(io.Writer, []byte) error) error {
	if ck == nil {
		return fmt.Errorf("optim: saving checkpoint %s: nil checkpoint", path)
	}
	b, err := ck.MarshalBinary()
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
	if err := writeSynced(f, b, write); err != nil {
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

// writeSynced writes b to f, syncs and closes it.
func writeSynced(f *os.File, b []byte, write func(io.Writer, []byte) error) error {
	if err := write(f, b); err != nil {
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
func LoadFile(path string) (*Checkpoint, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("optim: loading checkpoint: %w", err)
	}
	ck := new(Checkpoint)
	if err := ck.UnmarshalBinary(b); err != nil {
		return nil, fmt.Errorf("optim: loading checkpoint %s: %w", path, err)
	}
	return ck, nil
}
