package optim

// Writing a Checkpoint (checkpoint.go) in its binary form: MarshalBinary,
// and SaveFile, which streams the encoding into a file atomically.

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
)

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
