package npu_test

import (
	"errors"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"unsafe"

	"github.com/ebitengine/purego"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/accel/npu"
	"github.com/lowbit-ml/lowbit/signpack"
)

func f32bytes(p []float32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(&p[0])), 4*len(p))
}

// stub is the stand-in ACL library (testdata/libascendcl_stub.c), built
// with gcc into the test's temporary folder; it serves as both the runtime
// and the operator library.
type stub struct {
	path             string
	set, counts, mem uintptr
}

func buildStub(t *testing.T) *stub {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("npu: gcc not found, skipping the tests that need the stand-in ACL library")
	}
	path := filepath.Join(t.TempDir(), "libascendcl_stub.so")
	out, err := exec.Command(gcc, "-shared", "-fPIC", "-Wall", "-Werror", "-o", path,
		filepath.Join("testdata", "libascendcl_stub.c")).CombinedOutput()
	require.NoError(t, err, "building the stand-in ACL library: %s", out)
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	require.NoError(t, err)
	s := &stub{path: path}
	for name, fn := range map[string]*uintptr{"stub_acl_set": &s.set, "stub_acl_counts": &s.counts, "stub_acl_mem_used": &s.mem} {
		*fn, err = purego.Dlsym(lib, name)
		require.NoError(t, err)
	}
	return s
}

func (s *stub) configure(memLimit int64, failNext int) {
	purego.SyscallN(s.set, uintptr(memLimit), uintptr(failNext))
}

// live returns the stand-in's live tensors, executors and streams.
func (s *stub) live() (tensors, executors, streams int) {
	r, _, _ := purego.SyscallN(s.counts)
	v := int(r)
	return v / 1000000, v / 1000 % 1000, v % 1000
}

func (s *stub) memUsed() int64 {
	r, _, _ := purego.SyscallN(s.mem)
	return int64(r)
}

func (s *stub) open(t *testing.T, opts ...npu.Option) *npu.Device {
	t.Helper()
	d, err := npu.Open(append([]npu.Option{npu.WithLibraries(s.path, s.path), npu.WithDevice(0)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { d.Close() })
	return d
}

func TestOpenNoLibrary(t *testing.T) {
	dir := t.TempDir()
	_, err := npu.Open(npu.WithLibraries(filepath.Join(dir, "libascendcl.so"), filepath.Join(dir, "libopapi.so")))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cannot load")
	assert.Contains(t, err.Error(), "CANN")
	if d, err := npu.Open(); err == nil { // a machine with CANN
		d.Close()
	} else {
		assert.Contains(t, err.Error(), "npu: ")
	}
}

func TestOpenMissingSymbol(t *testing.T) {
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("npu: gcc not found, skipping")
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "old.c")
	require.NoError(t, os.WriteFile(src, []byte("int aclInit(const char *c) { return 0; }\n"), 0o600))
	lib := filepath.Join(dir, "libold.so")
	out, err := exec.Command(gcc, "-shared", "-fPIC", "-o", lib, src).CombinedOutput()
	require.NoError(t, err, "%s", out)
	_, err = npu.Open(npu.WithLibraries(lib, lib))
	assert.ErrorContains(t, err, "has aclFinalize")
}

// TestPackDocumentedExample: the example of the CANN documentation, 14
// floats packed into 2 bytes, 159 and 15 (first element in the least
// significant bit); ToWire turns them into lowbit's wire format, which is
// signpack.Pack's output.
func TestPackDocumentedExample(t *testing.T) {
	s := buildStub(t)
	d := s.open(t)
	in := []float32{5, 4, 3, 2, 0, -1, -2, 4, 3, 2, 1, 0, -1, -2}
	src, err := d.Alloc(4 * len(in))
	require.NoError(t, err)
	dst, err := d.Alloc(2)
	require.NoError(t, err)
	require.NoError(t, d.CopyIn(src, 0, f32bytes(in)))
	require.NoError(t, d.SignBitsPack(dst, src, len(in)))
	got := make([]byte, 2)
	require.NoError(t, d.CopyOut(got, dst, 0))
	assert.Equal(t, []byte{159, 15}, got)
	npu.ToWire(got)
	want := make([]byte, 2)
	signpack.Pack(want, in)
	assert.Equal(t, want, got)
	tensors, executors, _ := s.live()
	assert.Zero(t, tensors, "tensors destroyed")
	assert.Zero(t, executors, "executors consumed")
}

// TestRoundTrip: random values through pack, the wire format and unpack
// match signpack on the host.
func TestRoundTrip(t *testing.T) {
	s := buildStub(t)
	d := s.open(t)
	rng := rand.New(rand.NewPCG(1, 1))
	for _, n := range []int{8, 64, 1000, 4096} {
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64())
		}
		src, err := d.Alloc(4 * n)
		require.NoError(t, err)
		packed, err := d.Alloc(signpack.PackedLen(n))
		require.NoError(t, err)
		require.NoError(t, d.CopyIn(src, 0, f32bytes(x)))
		require.NoError(t, d.SignBitsPack(packed, src, n))
		wire := make([]byte, signpack.PackedLen(n))
		require.NoError(t, d.CopyOut(wire, packed, 0))
		npu.ToWire(wire)
		want := make([]byte, len(wire))
		signpack.Pack(want, x)
		require.Equal(t, want, wire, "n=%d", n)

		npu.FromWire(wire)
		require.NoError(t, d.CopyIn(packed, 0, wire))
		if n%8 == 0 {
			require.NoError(t, d.SignBitsUnpack(src, packed, n))
			got := make([]float32, n)
			require.NoError(t, d.CopyOut(f32bytes(got), src, 0))
			wantSigns := make([]float32, n)
			signpack.Unpack(wantSigns, want)
			require.Equal(t, wantSigns, got)
		}
		require.NoError(t, src.Free())
		require.NoError(t, packed.Free())
	}
	require.NoError(t, d.Synchronize())
}

// TestErrors: the stand-in's error codes come back as *npu.Error with the
// code and ACL's message; argument errors are caught before any call.
func TestErrors(t *testing.T) {
	s := buildStub(t)
	d := s.open(t)
	src, err := d.Alloc(64)
	require.NoError(t, err)
	dst, err := d.Alloc(2)
	require.NoError(t, err)

	s.configure(0, 161002)
	err = d.SignBitsPack(dst, src, 16)
	var ae *npu.Error
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, 161002, ae.Code)
	assert.Equal(t, "aclnnSignBitsPackGetWorkspaceSize", ae.Func)
	assert.Contains(t, err.Error(), "ACLNN_ERR_PARAM_INVALID")
	assert.Contains(t, err.Error(), "injected failure")
	require.NoError(t, d.SignBitsPack(dst, src, 16), "the device works after a failure")

	s.configure(s.memUsed()+10, 0)
	_, err = d.Alloc(4096)
	require.ErrorAs(t, err, &ae)
	assert.Equal(t, 207001, ae.Code)
	assert.Contains(t, err.Error(), "ACL_ERROR_RT_MEMORY_ALLOCATION")
	s.configure(0, 0)

	assert.ErrorContains(t, d.SignBitsPack(dst, src, 16+1), "out of a 64-byte buffer")
	assert.ErrorContains(t, d.SignBitsPack(dst, src, 0), "of 0 elements")
	assert.ErrorContains(t, d.SignBitsUnpack(src, dst, 12), "multiple of 8")
	assert.ErrorContains(t, d.SignBitsUnpack(src, dst, 24), "out of a 2-byte buffer")
	assert.ErrorContains(t, d.CopyIn(dst, 1, make([]byte, 2)), "out of a 2-byte buffer")
	assert.ErrorContains(t, d.CopyOut(make([]byte, 4), dst, 0), "out of a 2-byte buffer")
	_, err = d.Alloc(0)
	assert.Error(t, err)
	require.NoError(t, src.Free())
	require.NoError(t, src.Free())
	assert.ErrorContains(t, d.CopyIn(src, 0, []byte{1}), "freed buffer")

	require.NoError(t, d.Close())
	assert.ErrorContains(t, d.Synchronize(), "closed")
	assert.Zero(t, s.memUsed(), "Close frees buffers and the workspace")
	_, _, streams := s.live()
	assert.Zero(t, streams)
}

func TestBadDevice(t *testing.T) {
	s := buildStub(t)
	_, err := npu.Open(npu.WithLibraries(s.path, s.path), npu.WithDevice(5))
	var ae *npu.Error
	require.True(t, errors.As(err, &ae), "%v", err)
	assert.Equal(t, "aclrtSetDevice", ae.Func)
	assert.Contains(t, err.Error(), "device 5")
	// A failed Open finalizes ACL: Open works again.
	t.Setenv(npu.LocalRankEnv, "1")
	d := s.open(t, npu.WithDevice(-1))
	assert.Equal(t, 1, d.ID())
}
