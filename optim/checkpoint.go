package optim

import (
	"errors"
	"fmt"
	"hash/crc32"
	"slices"
	"strings"

	"github.com/lowbit-ml/lowbit/quant"
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
	// the group size and rank that made it (an exact optimizer's on any,
	// see Replicated).
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
// ck.Tensors: code that looks up every parameter's tensors uses Index or
// Restore, which index them once.
func (ck *Checkpoint) Tensor(name string) *Tensor {
	for i := range ck.Tensors {
		if ck.Tensors[i].Name == name {
			return &ck.Tensors[i]
		}
	}
	return nil
}

// TensorIndex finds the tensors of one checkpoint by name in constant
// time. It is built on first use, from ck.Tensors as they are then, and
// belongs to one operation (a Load, a Restore, a consolidation): the
// checkpoint itself holds no index, so that it stays a plain value that
// goroutines may read, and copy, concurrently. A hit is checked against
// the tensor's name and anything else falls back to Checkpoint.Tensor, so
// an index made stale by a caller changing ck.Tensors still finds what a
// scan finds. A TensorIndex is not safe for concurrent use.
type TensorIndex struct {
	ck  *Checkpoint
	pos map[string]int // first position of each name
}

// Index returns an index of ck's tensors by name, for an operation that
// looks up many of them: looking up every parameter's tensors then takes
// time linear in their number rather than a scan of ck.Tensors each.
func (ck *Checkpoint) Index() *TensorIndex { return &TensorIndex{ck: ck} }

// Tensor returns the first tensor called name, or nil, as
// Checkpoint.Tensor does.
func (x *TensorIndex) Tensor(name string) *Tensor {
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

// TensorData is Checkpoint.TensorData through the index.
func (x *TensorIndex) TensorData(name string, n int) ([]float32, error) {
	return tensorData(name, x.Tensor(name), n)
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
	idx TensorIndex
	ops []restoreCopy
	err error
}

// restoreCopy copies src into dst, or narrows it into dst16 (rounding to
// nearest even) when dst16 is not nil.
type restoreCopy struct {
	dst, src []float32
	dst16    []uint16
}

// Restore starts staging copies out of ck.
func (ck *Checkpoint) Restore() *Restore { return &Restore{idx: TensorIndex{ck: ck}} }

// Tensor stages copying the tensor called name, which must hold len(dst)
// elements, into dst. After the first error it does nothing.
func (r *Restore) Tensor(name string, dst []float32) {
	r.stage(name, restoreCopy{dst: dst}, len(dst))
}

// tensorBF16 is Tensor into a bfloat16 buffer: Apply narrows the tensor's
// values into dst, rounding to nearest even (exactly for the bfloat16
// values a checkpoint of bfloat16 moments holds).
func (r *Restore) tensorBF16(name string, dst []uint16) {
	r.stage(name, restoreCopy{dst16: dst}, len(dst))
}

// stage stages op with the data of the tensor called name as its source,
// which must hold n elements. After the first error it does nothing.
func (r *Restore) stage(name string, op restoreCopy, n int) {
	if r.err != nil {
		return
	}
	op.src, r.err = r.idx.TensorData(name, n)
	if r.err == nil {
		r.ops = append(r.ops, op)
	}
}

// Apply performs every staged copy and returns nil, or returns the first
// error of Tensor and copies nothing.
func (r *Restore) Apply() error {
	if r.err != nil {
		return r.err
	}
	for _, op := range r.ops {
		if op.dst16 != nil {
			quant.Narrow(quant.BF16, op.dst16, op.src)
			continue
		}
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
// another world size (unless ck.ErrorsReset is set or the algorithm's
// state is the same on every rank, see Replicated; the error then says
// how to move the checkpoint, see RankChange), a parameter missing
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
	if ck.World != world && !ck.ErrorsReset && !Replicated(algorithm) {
		return fmt.Errorf("%w: made on %d ranks, this group has %d; %s",
			ErrIncompatibleCheckpoint, ck.World, world, RankChange(algorithm))
	}
	if ck.ErrorsReset {
		for _, t := range ck.Tensors {
			if IsErrorBuffer(t.Name) {
				return fmt.Errorf("%w: marked as having its error buffers reset, but holds error buffer %q", ErrIncompatibleCheckpoint, t.Name)
			}
		}
	}
	idx := ck.Index()
	for _, p := range params {
		t := idx.Tensor(ParamTensorName(p.Name))
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
