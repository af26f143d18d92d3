package optim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

func sampleCheckpoint() *Checkpoint {
	return &Checkpoint{
		Algorithm: "onebit-adam",
		World:     4,
		Rank:      3,
		Stage:     StageCompression,
		Ints:      map[string]int64{"step": 12, "steps": 13, "skipped": 1, "negative": -5},
		Floats:    map[string]float64{"coeff": 0.25, "lrs": float64(float32(1e-3)), "inf": math.Inf(1)},
		Tensors: []Tensor{
			{Name: "param/w", Shape: []int{2, 3}, Data: []float32{1, -2, 3.5, float32(math.NaN()), 0, float32(math.Copysign(0, -1))}},
			{Name: "param/s", Shape: []int{}, Data: []float32{7}},
			{Name: "param/e", Shape: []int{0, 4}, Data: []float32{}},
			{Name: "worker_error/w", Shape: []int{32}, Data: make([]float32, 32)},
		},
	}
}

func encode(t testing.TB, ck *Checkpoint) []byte {
	t.Helper()
	b, err := ck.MarshalBinary()
	require.NoError(t, err)
	return b
}

func TestCheckpointRoundTrip(t *testing.T) {
	ck := sampleCheckpoint()
	b := encode(t, ck)
	var back Checkpoint
	require.NoError(t, back.UnmarshalBinary(b))
	assert.Equal(t, ck.Algorithm, back.Algorithm)
	assert.Equal(t, ck.World, back.World)
	assert.Equal(t, ck.Rank, back.Rank)
	assert.Equal(t, ck.Stage, back.Stage)
	assert.Equal(t, ck.Ints, back.Ints)
	assert.Equal(t, math.Float64bits(ck.Floats["coeff"]), math.Float64bits(back.Floats["coeff"]))
	assert.Equal(t, len(ck.Floats), len(back.Floats))
	require.Len(t, back.Tensors, len(ck.Tensors))
	for i, want := range ck.Tensors {
		got := back.Tensors[i]
		assert.Equal(t, want.Name, got.Name)
		assert.Equal(t, len(want.Shape), len(got.Shape))
		for j := range want.Shape {
			assert.Equal(t, want.Shape[j], got.Shape[j])
		}
		assert.Equal(t, bits(want.Data), bits(got.Data), want.Name)
	}
	// Encoding is deterministic (maps are written in key order).
	assert.Equal(t, b, encode(t, &back))
}

func TestCheckpointMarshalRefusesInconsistentTensor(t *testing.T) {
	ck := sampleCheckpoint()
	ck.Tensors[0].Shape = []int{4, 4}
	_, err := ck.MarshalBinary()
	assert.ErrorContains(t, err, `"param/w"`)
	ck.Tensors[0].Shape = []int{-2, -3}
	_, err = ck.MarshalBinary()
	assert.ErrorContains(t, err, "negative")
}

func TestCheckpointDecodeRefusesDamage(t *testing.T) {
	b := encode(t, sampleCheckpoint())
	for n := 0; n < len(b); n++ {
		var ck Checkpoint
		err := ck.UnmarshalBinary(b[:n])
		require.ErrorIs(t, err, ErrCorruptCheckpoint, "truncated to %d bytes", n)
		streamAgrees(t, b[:n], &ck, err)
	}
	for i := 0; i < len(b); i++ {
		for bit := 0; bit < 8; bit++ {
			c := append([]byte(nil), b...)
			c[i] ^= 1 << bit
			var ck Checkpoint
			err := ck.UnmarshalBinary(c)
			require.ErrorIs(t, err, ErrCorruptCheckpoint, "bit %d of byte %d flipped", bit, i)
			streamAgrees(t, c, &ck, err)
		}
	}
	var ck Checkpoint
	assert.ErrorContains(t, ck.UnmarshalBinary(append(append([]byte(nil), b...), 0)), "after the")
	assert.ErrorContains(t, ck.UnmarshalBinary([]byte("PK\x03\x04 this is a zip file, not a checkpoint")), "magic")
	// A refused decode leaves the destination alone.
	ck = *sampleCheckpoint()
	require.Error(t, ck.UnmarshalBinary(b[:len(b)-1]))
	assert.Equal(t, "onebit-adam", ck.Algorithm)
}

// A payload with a valid checksum but impossible contents is refused too.
func TestCheckpointDecodeRefusesBadPayload(t *testing.T) {
	ck := &Checkpoint{Algorithm: "adam", World: 1, Tensors: []Tensor{{Name: "param/x", Shape: []int{2}, Data: []float32{1, 2}}}}
	b := encode(t, ck)
	// The tensor's dimension and length fields precede its 8 data bytes.
	numelOff := len(b) - 8 - 8
	dimOff := numelOff - 8
	for _, patch := range []func([]byte){
		func(p []byte) { p[numelOff] = 3 },                      // numel 3 with shape [2]
		func(p []byte) { p[numelOff+7] = 0x80 },                 // huge numel
		func(p []byte) { p[dimOff] = 0xff; p[dimOff+7] = 0x7f }, // huge dimension
		func(p []byte) { p[dimOff+7] = 0xff },                   // negative dimension
		func(p []byte) { p[ckHeaderLen+4+4+8+8] = 0xff },        // stage string length beyond the payload
		func(p []byte) { p[ckHeaderLen+4+4+7] = 0xff },          // negative world size
	} {
		c := append([]byte(nil), b...)
		patch(c)
		fixCRC(c)
		var got Checkpoint
		err := got.UnmarshalBinary(c)
		assert.ErrorIs(t, err, ErrCorruptCheckpoint)
		streamAgrees(t, c, &got, err)
	}
}

func fixCRC(b []byte) {
	payload := b[ckHeaderLen:]
	crc := crc32Castagnoli(payload)
	b[20], b[21], b[22], b[23] = byte(crc), byte(crc>>8), byte(crc>>16), byte(crc>>24)
}

func FuzzCheckpointDecode(f *testing.F) {
	f.Add(encode(f, sampleCheckpoint()))
	f.Add(encode(f, sampleCheckpoint().ResetErrors())) // version 2, with flags
	f.Add(encode(f, &Checkpoint{}))
	f.Add([]byte(ckMagic))
	f.Add(encode(f, &Checkpoint{Algorithm: "onebit-lamb", World: 2, Tensors: []Tensor{ // a dimension beyond 2^31-1
		{Name: "worker_error", Shape: []int{0, math.MaxInt32 + 1}, Data: []float32{}},
	}}))
	f.Fuzz(func(t *testing.T, b []byte) {
		var ck Checkpoint
		err := ck.UnmarshalBinary(b)
		streamAgrees(t, b, &ck, err)
		if err != nil {
			// Also try with the checksum repaired, to reach the payload
			// parser with arbitrary contents.
			if len(b) >= ckHeaderLen {
				c := append([]byte(nil), b...)
				fixCRC(c)
				c[12], c[13], c[14], c[15], c[16], c[17], c[18], c[19] = lenBytes(len(c) - ckHeaderLen)
				err := ck.UnmarshalBinary(c)
				streamAgrees(t, c, &ck, err)
			}
			return
		}
		// What decodes re-encodes to the same bytes.
		again, err := ck.MarshalBinary()
		if err != nil {
			t.Fatalf("decoded checkpoint does not re-encode: %v", err)
		}
		var ck2 Checkpoint
		if err := ck2.UnmarshalBinary(again); err != nil {
			t.Fatalf("re-encoded checkpoint does not decode: %v", err)
		}
	})
}

// streamAgrees checks that decoding b as LoadFile does, streaming it
// through a reader that returns short reads, gives what UnmarshalBinary
// gave: want, or the same error as wantErr.
func streamAgrees(t *testing.T, b []byte, want *Checkpoint, wantErr error) {
	t.Helper()
	got, err := decodeStream(bufio.NewReaderSize(iotest.HalfReader(bytes.NewReader(b)), 16), int64(len(b)))
	if wantErr != nil {
		require.Error(t, err, "UnmarshalBinary refused what the stream decoder accepted: %v", wantErr)
		require.Equal(t, wantErr.Error(), err.Error())
		require.ErrorIs(t, err, ErrCorruptCheckpoint)
		return
	}
	require.NoError(t, err)
	wb, err := want.MarshalBinary()
	require.NoError(t, err)
	gb, err := got.MarshalBinary()
	require.NoError(t, err)
	require.Equal(t, wb, gb)
}

func lenBytes(n int) (a, b, c, d, e, f, g, h byte) {
	u := uint64(n)
	return byte(u), byte(u >> 8), byte(u >> 16), byte(u >> 24), byte(u >> 32), byte(u >> 40), byte(u >> 48), byte(u >> 56)
}

func TestSaveLoadFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "rank0.ckpt")
	ck := sampleCheckpoint()
	require.NoError(t, SaveFile(path, ck))
	back, err := LoadFile(path)
	require.NoError(t, err)
	assert.Equal(t, encode(t, ck), encode(t, back))
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Len(t, entries, 1, "no temporary file left behind")

	_, err = LoadFile(filepath.Join(dir, "missing"))
	assert.ErrorIs(t, err, os.ErrNotExist)
}

func TestLoadFileRefusesDamagedFiles(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ck")
	require.NoError(t, SaveFile(path, sampleCheckpoint()))
	good, err := os.ReadFile(path)
	require.NoError(t, err)

	require.NoError(t, os.WriteFile(path, good[:len(good)/2], 0o644))
	_, err = LoadFile(path)
	assert.ErrorIs(t, err, ErrCorruptCheckpoint)
	assert.ErrorContains(t, err, "truncated")
	assert.ErrorContains(t, err, path)

	flipped := append([]byte(nil), good...)
	flipped[len(flipped)-3] ^= 0x10
	require.NoError(t, os.WriteFile(path, flipped, 0o644))
	_, err = LoadFile(path)
	assert.ErrorIs(t, err, ErrCorruptCheckpoint)
	assert.ErrorContains(t, err, "checksum")

	require.NoError(t, os.WriteFile(path, []byte("{\"json\": true}\n"), 0o644))
	_, err = LoadFile(path)
	assert.ErrorContains(t, err, "not a lowbit checkpoint")
}

func TestSaveFileFailureKeepsPreviousCheckpoint(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "ck")
	require.NoError(t, SaveFile(path, sampleCheckpoint()))
	old, err := os.ReadFile(path)
	require.NoError(t, err)

	next := sampleCheckpoint()
	next.Ints["step"] = 99
	// The write dies halfway, as in a full disk or a crash.
	boom := errors.New("disk full")
	size := len(encode(t, next))
	err = saveFile(path, next, func(w io.Writer) io.Writer {
		return &failingWriter{w: w, left: size / 2, err: boom}
	})
	assert.ErrorIs(t, err, boom)
	now, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, old, now)

	// An encoding failure touches nothing either.
	bad := sampleCheckpoint()
	bad.Tensors[0].Data = bad.Tensors[0].Data[:1]
	assert.Error(t, SaveFile(path, bad))
	now, err = os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, old, now)

	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Len(t, entries, 1, "no temporary file left behind")

	// And a good save still replaces it.
	require.NoError(t, SaveFile(path, next))
	back, err := LoadFile(path)
	require.NoError(t, err)
	assert.Equal(t, int64(99), back.Ints["step"])
}

func TestCheckCompatible(t *testing.T) {
	ps := testParams(t, 1, []int{2, 3}, []int{4})
	opt, err := NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
	require.NoError(t, err)
	ck, err := opt.State()
	require.NoError(t, err)
	require.NoError(t, ck.CheckCompatible(AlgorithmAdam, 1, ps))

	assert.ErrorContains(t, ck.CheckCompatible(AlgorithmLamb, 1, ps), `algorithm "adam"`)
	require.NoError(t, ck.CheckCompatible(AlgorithmAdam, 2, ps), "an exact optimizer's state is the same on every rank")
	onebit := *ck
	onebit.Algorithm = AlgorithmOnebitAdam
	assert.ErrorContains(t, onebit.CheckCompatible(AlgorithmOnebitAdam, 2, ps), "made on 1 ranks, this group has 2")
	other := testParams(t, 1, []int{3, 2}, []int{4})
	assert.ErrorContains(t, ck.CheckCompatible(AlgorithmAdam, 1, other), "shape [2 3] in the checkpoint, [3 2] here")
	assert.ErrorContains(t, ck.CheckCompatible(AlgorithmAdam, 1, ps[:1]), "holds 2 parameters, this optimizer 1")
	renamed := testParams(t, 1, []int{2, 3}, []int{4})
	renamed[1].Name = "other"
	assert.ErrorContains(t, ck.CheckCompatible(AlgorithmAdam, 1, renamed), `"other" is not in the checkpoint`)
	for _, err := range []error{
		ck.CheckCompatible(AlgorithmLamb, 1, ps),
		ck.CheckCompatible(AlgorithmAdam, 1, other),
	} {
		assert.ErrorIs(t, err, ErrIncompatibleCheckpoint)
	}
}

func TestLoadRefusesAndLeavesOptimizerUnchanged(t *testing.T) {
	newOpt := func(alg string, shapes ...[]int) (Optimizer, []*Param) {
		ps := testParams(t, 7, shapes...)
		var opt Optimizer
		var err error
		if alg == AlgorithmAdam {
			opt, err = NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
		} else {
			opt, err = NewLamb(context.Background(), nil, ps, DefaultLambConfig())
		}
		require.NoError(t, err)
		fillGrads(ps, 0, 1)
		require.NoError(t, opt.Step(context.Background()))
		return opt, ps
	}
	opt, _ := newOpt(AlgorithmAdam, []int{4}, []int{2, 2})
	before, err := opt.State()
	require.NoError(t, err)

	lamb, _ := newOpt(AlgorithmLamb, []int{4}, []int{2, 2})
	fromLamb, err := lamb.State()
	require.NoError(t, err)
	shaped, _ := newOpt(AlgorithmAdam, []int{4}, []int{4})
	fromShape, err := shaped.State()
	require.NoError(t, err)
	// Another world size is no refusal: an exact optimizer's state is the
	// same on every rank (TestRankChangeExact).
	missing, err := opt.State()
	require.NoError(t, err)
	missing.Tensors = missing.Tensors[:len(missing.Tensors)-1] // drops exp_avg_sq of the last parameter
	badCounters, err := opt.State()
	require.NoError(t, err)
	badCounters.Ints[IntSkipped] = 5

	for name, ck := range map[string]*Checkpoint{
		"algorithm": fromLamb, "shape": fromShape,
		"missing tensor": missing, "counters": badCounters, "nil": nil,
	} {
		// Change the state so that a partial load would show.
		err := opt.Load(ck)
		assert.ErrorIs(t, err, ErrIncompatibleCheckpoint, name)
		after, err := opt.State()
		require.NoError(t, err)
		assert.Equal(t, before, after, "%s: a refused load changed the optimizer", name)
	}
}

// Stopping an exact optimizer at step k and resuming from per-rank files
// gives bit-identical parameters.
func TestExactResumeIsBitIdentical(t *testing.T) {
	const w, total = 2, 8
	// "adam-bf16": Adam with MomentsBF16, whose rounding's random bits
	// depend on the step counter that the checkpoint keeps.
	for _, alg := range []string{AlgorithmAdam, AlgorithmLamb, "adam-bf16"} {
		for _, k := range []int{1, 4} {
			t.Run(fmt.Sprintf("%s/k=%d", alg, k), func(t *testing.T) {
				dir := t.TempDir()
				mk := func(c comm.Comm, ps []*Param) (Optimizer, error) {
					cfg := DefaultLambConfig()
					cfg.WeightDecay = 0.01
					cfg.MomentsBF16 = alg == "adam-bf16"
					if alg != AlgorithmLamb {
						return NewAdam(context.Background(), c, ps, cfg.AdamConfig)
					}
					return NewLamb(context.Background(), c, ps, cfg)
				}
				run := func(from, to int, load, save bool) [][][]float32 {
					var mu sync.Mutex
					out := make([][][]float32, w)
					err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
						ps := testParams(t, 9, []int{5, 3}, []int{11})
						opt, err := mk(c, ps)
						if err != nil {
							return err
						}
						path := filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", c.Rank()))
						if load {
							ck, err := LoadFile(path)
							if err != nil {
								return err
							}
							if err := opt.Load(ck); err != nil {
								return err
							}
						}
						for s := from; s <= to; s++ {
							fillGrads(ps, c.Rank(), s)
							if err := opt.Step(ctx); err != nil {
								return err
							}
						}
						if save {
							ck, err := opt.State()
							if err != nil {
								return err
							}
							if err := SaveFile(path, ck); err != nil {
								return err
							}
						}
						mu.Lock()
						out[c.Rank()] = snapshot(ps)
						mu.Unlock()
						return nil
					})
					require.NoError(t, err)
					return out
				}
				want := run(1, total, false, false)
				run(1, k, false, true)
				got := run(k+1, total, true, false)
				for r := range want {
					for i := range want[r] {
						assert.Equal(t, bits(want[r][i]), bits(got[r][i]), "rank %d param %d", r, i)
						assert.Equal(t, bits(want[0][i]), bits(want[r][i]), "rank %d param %d differs from rank 0", r, i)
					}
				}
			})
		}
	}
}

// failingWriter passes left bytes on to w, then fails with err.
type failingWriter struct {
	w    io.Writer
	left int
	err  error
}

func (f *failingWriter) Write(p []byte) (int, error) {
	if len(p) > f.left {
		n, _ := f.w.Write(p[:f.left])
		f.left = 0
		return n, f.err
	}
	f.left -= len(p)
	return f.w.Write(p)
}

// A dimension of 2^31 or more is written and read back (issue 25: the
// decoder refused what the encoder wrote). A zero dimension keeps the data
// empty, so nothing large is allocated.
func TestCheckpointLargeDimensionsRoundTrip(t *testing.T) {
	if math.MaxInt == math.MaxInt32 {
		t.Skip("needs 64-bit ints")
	}
	big := 1 << 31
	ck := &Checkpoint{Algorithm: "onebit-lamb", World: math.MaxInt32, Rank: math.MaxInt32 - 1, Tensors: []Tensor{
		{Name: "param/a", Shape: []int{big, 0}, Data: []float32{}},
		{Name: "param/b", Shape: []int{0, math.MaxInt}, Data: []float32{}},
		{Name: "param/c", Shape: []int{1 << 40, 1 << 40, 0}, Data: []float32{}},
	}}
	b := encode(t, ck)
	var back Checkpoint
	require.NoError(t, back.UnmarshalBinary(b))
	for i := range ck.Tensors {
		assert.Equal(t, ck.Tensors[i].Shape, back.Tensors[i].Shape)
	}
	assert.Equal(t, b, encode(t, &back))
	path := filepath.Join(t.TempDir(), "ck")
	require.NoError(t, SaveFile(path, ck))
	fromFile, err := LoadFile(path)
	require.NoError(t, err)
	assert.Equal(t, b, encode(t, fromFile))
}

// A header announcing a tensor of 2^31 elements (a 1-bit LAMB error buffer
// of a model that large) is refused for its missing data, not for its
// dimension: the decoder accepts the size the encoder writes.
func TestCheckpointDecodeLargeTensorHeader(t *testing.T) {
	if math.MaxInt == math.MaxInt32 {
		t.Skip("needs 64-bit ints")
	}
	ck := &Checkpoint{Algorithm: "onebit-lamb", World: 2, Tensors: []Tensor{{Name: "worker_error", Shape: []int{2}, Data: []float32{1, 2}}}}
	b := encode(t, ck)
	numelOff := len(b) - 8 - 8
	dimOff := numelOff - 8
	c := append([]byte(nil), b...)
	binary.LittleEndian.PutUint64(c[dimOff:], 1<<31)
	binary.LittleEndian.PutUint64(c[numelOff:], 1<<31)
	fixCRC(c)
	var got Checkpoint
	err := got.UnmarshalBinary(c)
	require.ErrorIs(t, err, ErrCorruptCheckpoint)
	assert.ErrorContains(t, err, "needs 8589934592 bytes of data")
	assert.NotContains(t, err.Error(), "out of range")
}

// What the format cannot represent is refused when saving, and nothing is
// written.
func TestCheckpointMarshalRefusesUnrepresentable(t *testing.T) {
	for name, ck := range map[string]*Checkpoint{
		"shape overflows int":             {Tensors: []Tensor{{Name: "x", Shape: []int{1 << 32, 1 << 32}, Data: []float32{}}}},
		"shape overflows int, three dims": {Tensors: []Tensor{{Name: "x", Shape: []int{math.MaxInt, 2, 1}, Data: []float32{}}}},
		"negative dimension":              {Tensors: []Tensor{{Name: "x", Shape: []int{-1, 0}, Data: []float32{}}}},
		"too many dimensions":             {Tensors: []Tensor{{Name: "x", Shape: make([]int, maxDims+1), Data: []float32{}}}},
		"world size":                      {World: math.MaxInt32 + 1},
		"negative rank":                   {World: 1, Rank: -1},
	} {
		_, err := ck.MarshalBinary()
		assert.Error(t, err, name)
		path := filepath.Join(t.TempDir(), "ck")
		assert.Error(t, SaveFile(path, ck), name)
		_, err = os.Stat(path)
		assert.ErrorIs(t, err, os.ErrNotExist, name)
	}
	n, ok := numel([]int{math.MaxInt / 2, 3})
	assert.False(t, ok, "overflowing product: %d", n)
	n, ok = numel([]int{3, 0, math.MaxInt})
	assert.True(t, ok)
	assert.Zero(t, n)
}

// SaveFile streams: it writes the same bytes as MarshalBinary, and a
// checkpoint that changes between the size check and the write is caught.
func TestSaveFileStreamsTheEncoding(t *testing.T) {
	ck := sampleCheckpoint()
	big := make([]float32, 3*ckChunk+5)
	for i := range big {
		big[i] = float32(i) * 0.5
	}
	ck.AddTensor("param/big", []int{len(big)}, big)
	path := filepath.Join(t.TempDir(), "ck")
	require.NoError(t, SaveFile(path, ck))
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, encode(t, ck), raw)

	l, err := ck.layout()
	require.NoError(t, err)
	ck.Ints["added"] = 1
	_, err = ck.writePayload(io.Discard, l)
	assert.ErrorContains(t, err, "changed while")
}

// The stream decoder refuses, as damage, input that ends before the size
// it was promised or goes on after it (a file that changed while LoadFile
// read it), and passes on an error of the reader, unwrapped from
// ErrCorruptCheckpoint.
func TestDecodeStreamRefusesChangedInput(t *testing.T) {
	ck := sampleCheckpoint()
	ck.AddTensor("param/big", []int{3*ckChunk + 5}, make([]float32, 3*ckChunk+5))
	b := encode(t, ck)
	size := int64(len(b))
	for _, cut := range []int{1, 10, len(b) / 2, len(b) - 10, len(b)} {
		_, err := decodeStream(bytes.NewReader(b[:len(b)-cut]), size)
		require.ErrorIs(t, err, ErrCorruptCheckpoint, "cut %d", cut)
		assert.ErrorContains(t, err, fmt.Sprintf("ends %d bytes early", cutMissing(len(b), cut)), "cut %d", cut)
	}
	_, err := decodeStream(bytes.NewReader(append(append([]byte(nil), b...), 0)), size)
	require.ErrorIs(t, err, ErrCorruptCheckpoint)
	assert.ErrorContains(t, err, "bytes after the")

	boom := errors.New("device gone")
	for _, at := range []int{0, 5, ckHeaderLen + 3, len(b) / 2, len(b) - 1} {
		r := io.MultiReader(bytes.NewReader(b[:at]), iotest.ErrReader(boom))
		_, err := decodeStream(r, size)
		require.ErrorIs(t, err, boom, "failing after %d bytes", at)
		assert.NotErrorIs(t, err, ErrCorruptCheckpoint, "failing after %d bytes", at)
	}

	got, err := decodeStream(iotest.OneByteReader(bytes.NewReader(b)), size)
	require.NoError(t, err)
	assert.Equal(t, b, encode(t, got))
}

// cutMissing is how many bytes the stream decoder misses when an input of
// n bytes is cut short by cut: those of the header it then reads, or of the
// payload.
func cutMissing(n, cut int) int {
	if n-cut < ckHeaderLen {
		return ckHeaderLen - (n - cut)
	}
	return cut
}

// Damage found by the decoder before the checksum is reported as a
// checksum mismatch, whether the bytes are decoded in memory or streamed
// from a file.
func TestLoadFileReportsDamageAsChecksumMismatch(t *testing.T) {
	b := encode(t, sampleCheckpoint())
	path := filepath.Join(t.TempDir(), "ck")
	// The stage string's length, early in the payload, made huge.
	b[ckHeaderLen+4+len("onebit-adam")+8+8+3] = 0x7f
	require.NoError(t, os.WriteFile(path, b, 0o644))
	_, err := LoadFile(path)
	require.ErrorIs(t, err, ErrCorruptCheckpoint)
	var ck Checkpoint
	want := ck.UnmarshalBinary(b)
	assert.ErrorContains(t, want, "checksum mismatch")
	assert.Equal(t, fmt.Sprintf("optim: loading checkpoint %s: %v", path, want), err.Error())
}

// LoadFile reads what is not a regular file, a pipe here, whole.
func TestLoadFileFromPipe(t *testing.T) {
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	want := encode(t, sampleCheckpoint())
	go func() {
		w.Write(want)
		w.Close()
	}()
	ck, err := readCheckpoint(r)
	require.NoError(t, err)
	assert.Equal(t, want, encode(t, ck))
}

// Restore and CheckCompatible index the tensors once; the index finds what
// a scan of ck.Tensors finds even after the caller changed them, and the
// first of two tensors of one name, as Tensor does.
func TestRestoreIndexFollowsChangedTensors(t *testing.T) {
	ck := sampleCheckpoint()
	rs := ck.Restore()
	w := make([]float32, 6)
	rs.Tensor("param/w", w) // indexes
	ck.Tensors[0], ck.Tensors[3] = ck.Tensors[3], ck.Tensors[0]
	ck.Tensors[1].Name = "param/renamed"
	errs := make([]float32, 32)
	errs[0] = 1
	ck.Tensors[0].Data = errs
	got := make([]float32, 32)
	rs.Tensor("worker_error/w", got) // moved
	s := make([]float32, 1)
	rs.Tensor("param/renamed", s) // renamed
	require.NoError(t, rs.Apply())
	assert.Equal(t, []float32{1, -2, 3.5}, w[:3])
	assert.Equal(t, errs, got)
	assert.Equal(t, []float32{7}, s)

	rs = ck.Restore()
	rs.Tensor("param/renamed", s)
	ck.Tensors = ck.Tensors[:1]
	rs.Tensor("param/renamed", s) // removed
	assert.ErrorContains(t, rs.Apply(), `tensor "param/renamed" is missing`)

	dup := &Checkpoint{Tensors: []Tensor{{Name: "x", Shape: []int{1}, Data: []float32{1}}, {Name: "x", Shape: []int{1}, Data: []float32{2}}}}
	rs = dup.Restore()
	x := make([]float32, 1)
	rs.Tensor("x", x)
	require.NoError(t, rs.Apply())
	assert.Equal(t, dup.Tensor("x").Data, x)
	assert.Equal(t, []float32{1}, x)
}

// Checkpoint.Index, which optim/zero's Load and Consolidate look tensors up
// through, finds what Tensor and TensorData find: the first of two tensors
// of one name, nil and an incompatibility for a missing one, a size check.
func TestCheckpointIndex(t *testing.T) {
	ck := sampleCheckpoint()
	ck.Tensors = append(ck.Tensors, Tensor{Name: "param/w", Shape: []int{1}, Data: []float32{9}})
	idx := ck.Index()
	for _, tn := range ck.Tensors {
		assert.Same(t, ck.Tensor(tn.Name), idx.Tensor(tn.Name), tn.Name)
	}
	assert.Nil(t, idx.Tensor("param/none"))
	w, err := idx.TensorData("param/w", 6)
	require.NoError(t, err)
	assert.Equal(t, []float32{1, -2, 3.5}, w[:3])
	_, err = idx.TensorData("param/w", 1)
	assert.ErrorIs(t, err, ErrIncompatibleCheckpoint)
	_, err = idx.TensorData("param/none", 1)
	assert.ErrorIs(t, err, ErrIncompatibleCheckpoint)
	assert.ErrorContains(t, err, `tensor "param/none" is missing`)
}

// Goroutines may load one checkpoint at once (every rank loading the same
// consolidated checkpoint): looking tensors up changes nothing in it, so
// the race detector finds nothing here.
func TestCheckpointConcurrentLoads(t *testing.T) {
	ps := testParams(t, 1, []int{2, 3}, []int{4}, []int{5})
	opt, err := NewAdam(context.Background(), nil, ps, DefaultAdamConfig())
	require.NoError(t, err)
	ck, err := opt.State()
	require.NoError(t, err)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := testParams(t, 2, []int{2, 3}, []int{4}, []int{5})
			o, err := NewAdam(context.Background(), nil, mine, DefaultAdamConfig())
			assert.NoError(t, err)
			assert.NoError(t, o.Load(ck))
			assert.Equal(t, snapshot(ps), snapshot(mine))
			own := *ck // a copy read beside the others' loads
			assert.NotNil(t, own.Tensor(ParamTensorName(ps[0].Name)))
		}()
	}
	wg.Wait()
}
