// Package npu binds the Ascend Computing Language (ACL) at run time, for
// the pieces the 1-bit compressed allreduce needs on a Huawei Ascend NPU:
// device memory, host<->device copies, a stream, and the sign-bits
// operators aclnnSignBitsPack and aclnnSignBitsUnpack.
//
// The runtime (libascendcl.so) and the operator library (libopapi.so) are
// loaded with purego when Open is called, so the package builds anywhere,
// with CGO_ENABLED=0, and Open returns an error on machines without CANN.
//
// UNVERIFIED: no Ascend hardware was available when this binding was
// written. The signatures follow the CANN documentation; the tests exercise
// the binding against a stand-in C library (see README.md).
//
// Bit order: the documentation's example of aclnnSignBitsPack (inputs 5,
// 4, 3, 2, 0, -1, -2, 4 pack to 159) puts the first element in the least
// significant bit, the reverse of lowbit's wire format. SignBitsPack and
// SignBitsUnpack keep the device's order; ToWire and FromWire convert
// packed bytes on the host, where they cross to the communicator anyway.
// The documentation also says the pack operator's input must not contain
// NaN, which lowbit's format packs as +1.
package npu

import (
	"errors"
	"fmt"
	"math/bits"
	"os"
	"runtime"
	"strconv"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// The default libraries Open loads.
const (
	DefaultRuntimeLibrary = "libascendcl.so"
	DefaultOpLibrary      = "libopapi.so"
)

// LocalRankEnv is the variable Open reads the device id from unless
// WithDevice is given (Open MPI sets it for every process it starts).
const LocalRankEnv = "OMPI_COMM_WORLD_LOCAL_RANK"

// ACL constants (acl_base.h, acl_rt.h).
const (
	aclFloat   = 0 // ACL_FLOAT
	aclUint8   = 4 // ACL_UINT8
	aclFormND  = 2 // ACL_FORMAT_ND
	hugeFirst  = 0 // ACL_MEM_MALLOC_HUGE_FIRST
	hostToDev  = 1 // ACL_MEMCPY_HOST_TO_DEVICE
	devToHost  = 2 // ACL_MEMCPY_DEVICE_TO_HOST
	devToDev   = 3 // ACL_MEMCPY_DEVICE_TO_DEVICE
	packedRows = 1 // the "size" argument: one row of packed bytes
)

var codeNames = map[int]string{
	100000: "ACL_ERROR_INVALID_PARAM",
	161001: "ACLNN_ERR_PARAM_NULLPTR",
	161002: "ACLNN_ERR_PARAM_INVALID",
	207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
}

// Error is a non-zero aclError or aclnnStatus.
type Error struct {
	Func    string // the ACL function
	Code    int    // its return code
	Message string // aclGetRecentErrMsg, when the library has it
}

func (e *Error) Error() string {
	s := fmt.Sprintf("%s returned %d", e.Func, e.Code)
	if name, ok := codeNames[e.Code]; ok {
		s += " (" + name + ")"
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

type config struct {
	runtime, ops string
	device       int
}

// Option configures Open.
type Option func(*config)

// WithLibraries loads the ACL runtime and operator libraries from the
// given paths (they may be the same library).
func WithLibraries(runtime, ops string) Option {
	return func(c *config) { c.runtime, c.ops = runtime, ops }
}

// WithDevice selects NPU id instead of the local rank's.
func WithDevice(id int) Option { return func(c *config) { c.device = id } }

// api holds the resolved entry points.
type api struct {
	aclInit, aclFinalize, aclrtSetDevice, aclrtResetDevice  uintptr
	aclrtMalloc, aclrtFree, aclrtMemcpy                     uintptr
	aclrtCreateStream, aclrtDestroyStream, aclrtSynchronize uintptr
	aclCreateTensor, aclDestroyTensor                       uintptr
	packWorkspace, pack, unpackWorkspace, unpack            uintptr
	aclGetRecentErrMsg                                      uintptr // optional
}

// Device is one Ascend NPU with one stream. It is safe for concurrent use;
// its operations are serialized.
type Device struct {
	mu     sync.Mutex
	fn     api
	libs   []uintptr
	id     int
	stream uintptr
	inited bool

	workspace     uintptr // device memory for the operators, grown on demand
	workspaceSize uint64

	out  *outArgs // pinned out-parameters
	pin  runtime.Pinner
	bufs map[*Buffer]struct{}

	closed bool
}

type outArgs struct {
	ptr      uintptr
	ws       uint64
	executor uintptr
	dims     [2]int64
	strides  [2]int64
}

// Buffer is device memory from aclrtMalloc.
type Buffer struct {
	dev *Device
	ptr uintptr
	n   int
}

// Len is the buffer's length in bytes.
func (b *Buffer) Len() int { return b.n }

// Open loads the ACL libraries, initialises ACL, selects the NPU (the
// local rank's, LocalRankEnv, 0 when unset, or WithDevice's) and creates a
// stream. Every failure is an error; nothing panics.
func Open(opts ...Option) (*Device, error) {
	cfg := config{runtime: DefaultRuntimeLibrary, ops: DefaultOpLibrary, device: -1}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.device < 0 {
		cfg.device = 0
		if s := os.Getenv(LocalRankEnv); s != "" {
			r, err := strconv.Atoi(s)
			if err != nil || r < 0 {
				return nil, fmt.Errorf("npu: %s=%q is not a local rank", LocalRankEnv, s)
			}
			cfg.device = r
		}
	}
	d := &Device{id: cfg.device, out: new(outArgs), bufs: map[*Buffer]struct{}{}}
	d.pin.Pin(d.out)
	if err := d.load(cfg); err != nil {
		d.unload()
		return nil, err
	}
	if err := d.init(); err != nil {
		return nil, errors.Join(err, d.release())
	}
	return d, nil
}

func (d *Device) load(cfg config) error {
	var handles []uintptr
	for _, path := range []string{cfg.runtime, cfg.ops} {
		h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err != nil {
			return fmt.Errorf("npu: cannot load %s (is the Ascend CANN toolkit installed and on LD_LIBRARY_PATH?): %w", path, err)
		}
		d.libs = append(d.libs, h)
		handles = append(handles, h)
	}
	f := &d.fn
	for _, s := range []struct {
		name     string
		fn       *uintptr
		optional bool
	}{
		{"aclInit", &f.aclInit, false}, {"aclFinalize", &f.aclFinalize, false},
		{"aclrtSetDevice", &f.aclrtSetDevice, false}, {"aclrtResetDevice", &f.aclrtResetDevice, false},
		{"aclrtMalloc", &f.aclrtMalloc, false}, {"aclrtFree", &f.aclrtFree, false},
		{"aclrtMemcpy", &f.aclrtMemcpy, false},
		{"aclrtCreateStream", &f.aclrtCreateStream, false}, {"aclrtDestroyStream", &f.aclrtDestroyStream, false},
		{"aclrtSynchronizeStream", &f.aclrtSynchronize, false},
		{"aclCreateTensor", &f.aclCreateTensor, false}, {"aclDestroyTensor", &f.aclDestroyTensor, false},
		{"aclnnSignBitsPackGetWorkspaceSize", &f.packWorkspace, false}, {"aclnnSignBitsPack", &f.pack, false},
		{"aclnnSignBitsUnpackGetWorkspaceSize", &f.unpackWorkspace, false}, {"aclnnSignBitsUnpack", &f.unpack, false},
		{"aclGetRecentErrMsg", &f.aclGetRecentErrMsg, true},
	} {
		for _, h := range handles {
			if p, err := purego.Dlsym(h, s.name); err == nil && p != 0 {
				*s.fn = p
				break
			}
		}
		if *s.fn == 0 && !s.optional {
			return fmt.Errorf("npu: neither %s nor %s has %s (CANN too old for the sign-bits operators?)", cfg.runtime, cfg.ops, s.name)
		}
	}
	return nil
}

func (d *Device) unload() {
	for _, h := range d.libs {
		purego.Dlclose(h)
	}
	d.libs = nil
}

func (d *Device) init() error {
	if err := d.call("aclInit", d.fn.aclInit, 0); err != nil {
		return err
	}
	d.inited = true
	if err := d.call("aclrtSetDevice", d.fn.aclrtSetDevice, uintptr(d.id)); err != nil {
		return fmt.Errorf("%w (device %d)", err, d.id)
	}
	if err := d.call("aclrtCreateStream", d.fn.aclrtCreateStream, uintptr(unsafe.Pointer(&d.out.ptr))); err != nil {
		return err
	}
	d.stream = d.out.ptr
	return nil
}

// call calls fn and turns a non-zero return code into an *Error.
//
//go:uintptrescapes
func (d *Device) call(name string, fn uintptr, args ...uintptr) error {
	r, _, _ := purego.SyscallN(fn, args...)
	if code := int(int32(r)); code != 0 {
		return fmt.Errorf("npu: %w", &Error{Func: name, Code: code, Message: d.recentError()})
	}
	return nil
}

// recentError is aclGetRecentErrMsg's message, or "".
func (d *Device) recentError() string {
	if d.fn.aclGetRecentErrMsg == 0 {
		return ""
	}
	r, _, _ := purego.SyscallN(d.fn.aclGetRecentErrMsg)
	if r == 0 {
		return ""
	}
	var b []byte
	for p := (*byte)(unsafe.Add(unsafe.Pointer(nil), r)); len(b) < 1024 && *p != 0; p = (*byte)(unsafe.Add(unsafe.Pointer(p), 1)) {
		b = append(b, *p)
	}
	return string(b)
}

func (d *Device) lock() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return errors.New("npu: device closed")
	}
	return nil
}

// ID is the NPU's device id.
func (d *Device) ID() int { return d.id }

// Alloc returns n bytes of device memory.
func (d *Device) Alloc(n int) (*Buffer, error) {
	if n <= 0 {
		return nil, fmt.Errorf("npu: alloc of %d bytes", n)
	}
	if err := d.lock(); err != nil {
		return nil, err
	}
	defer d.mu.Unlock()
	if err := d.call("aclrtMalloc", d.fn.aclrtMalloc, uintptr(unsafe.Pointer(&d.out.ptr)), uintptr(n), hugeFirst); err != nil {
		return nil, fmt.Errorf("%w (allocating %d bytes)", err, n)
	}
	b := &Buffer{dev: d, ptr: d.out.ptr, n: n}
	d.bufs[b] = struct{}{}
	return b, nil
}

// Free releases the buffer; a second Free is a no-op.
func (b *Buffer) Free() error {
	d := b.dev
	if d == nil {
		return nil
	}
	if err := d.lock(); err != nil {
		b.dev = nil
		return nil
	}
	defer d.mu.Unlock()
	delete(d.bufs, b)
	b.dev = nil
	return d.call("aclrtFree", d.fn.aclrtFree, b.ptr)
}

// check validates a byte range of b on d.
func (d *Device) check(what string, b *Buffer, off, n int) error {
	switch {
	case b == nil || b.dev == nil:
		return fmt.Errorf("npu: %s: nil or freed buffer", what)
	case b.dev != d:
		return fmt.Errorf("npu: %s: buffer of another device", what)
	case off < 0 || n < 0 || off > b.n || n > b.n-off:
		return fmt.Errorf("npu: %s: bytes [%d, %d+%d) out of a %d-byte buffer", what, off, off, n, b.n)
	}
	return nil
}

// CopyIn copies src to dst from byte off (aclrtMemcpy, synchronous).
func (d *Device) CopyIn(dst *Buffer, off int, src []byte) error {
	if err := d.lock(); err != nil {
		return err
	}
	defer d.mu.Unlock()
	if err := d.check("copy-in", dst, off, len(src)); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	return d.call("aclrtMemcpy", d.fn.aclrtMemcpy, dst.ptr+uintptr(off), uintptr(dst.n-off),
		uintptr(unsafe.Pointer(&src[0])), uintptr(len(src)), hostToDev)
}

// CopyOut copies len(dst) bytes of src from byte off into dst.
func (d *Device) CopyOut(dst []byte, src *Buffer, off int) error {
	if err := d.lock(); err != nil {
		return err
	}
	defer d.mu.Unlock()
	if err := d.check("copy-out", src, off, len(dst)); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	return d.call("aclrtMemcpy", d.fn.aclrtMemcpy, uintptr(unsafe.Pointer(&dst[0])), uintptr(len(dst)),
		src.ptr+uintptr(off), uintptr(len(dst)), devToHost)
}

// Synchronize waits for the stream.
func (d *Device) Synchronize() error {
	if err := d.lock(); err != nil {
		return err
	}
	defer d.mu.Unlock()
	return d.call("aclrtSynchronizeStream", d.fn.aclrtSynchronize, d.stream)
}

// tensor creates a contiguous ND tensor descriptor over ptr.
func (d *Device) tensor(ptr uintptr, dtype int, dims ...int64) (uintptr, error) {
	o := d.out
	copy(o.dims[:], dims)
	stride := int64(1)
	for i := len(dims) - 1; i >= 0; i-- {
		o.strides[i] = stride
		stride *= dims[i]
	}
	r, _, _ := purego.SyscallN(d.fn.aclCreateTensor,
		uintptr(unsafe.Pointer(&o.dims[0])), uintptr(len(dims)), uintptr(dtype),
		uintptr(unsafe.Pointer(&o.strides[0])), 0, aclFormND,
		uintptr(unsafe.Pointer(&o.dims[0])), uintptr(len(dims)), ptr)
	if r == 0 {
		return 0, fmt.Errorf("npu: aclCreateTensor returned NULL: %s", d.recentError())
	}
	return r, nil
}

// run makes the two-phase call of an aclnn operator: getWorkspace fills
// the workspace size and the executor, then the operator runs on the
// stream with a workspace of that size, and the call waits for it.
func (d *Device) run(name string, getWorkspace func() error, op uintptr) error {
	if err := getWorkspace(); err != nil {
		return err
	}
	ws, exec := d.out.ws, d.out.executor
	if ws > d.workspaceSize {
		if d.workspace != 0 {
			d.call("aclrtFree", d.fn.aclrtFree, d.workspace)
			d.workspace, d.workspaceSize = 0, 0
		}
		if err := d.call("aclrtMalloc", d.fn.aclrtMalloc, uintptr(unsafe.Pointer(&d.out.ptr)), uintptr(ws), hugeFirst); err != nil {
			return fmt.Errorf("%w (%s workspace of %d bytes)", err, name, ws)
		}
		d.workspace, d.workspaceSize = d.out.ptr, ws
	}
	wsPtr := d.workspace
	if ws == 0 {
		wsPtr = 0
	}
	if err := d.call(name, op, wsPtr, uintptr(ws), exec, d.stream); err != nil {
		return err
	}
	return d.call("aclrtSynchronizeStream", d.fn.aclrtSynchronize, d.stream)
}

// SignBitsPack packs the signs of the n float32 values of src into the
// PackedLen(n) bytes of dst with aclnnSignBitsPack, in the device's bit
// order (see ToWire), and waits for it.
func (d *Device) SignBitsPack(dst, src *Buffer, n int) error {
	if err := d.lock(); err != nil {
		return err
	}
	defer d.mu.Unlock()
	nb := (n + 7) / 8
	if n <= 0 {
		return fmt.Errorf("npu: sign-bits pack of %d elements", n)
	}
	if err := d.check("sign-bits pack input", src, 0, 4*n); err != nil {
		return err
	}
	if err := d.check("sign-bits pack output", dst, 0, nb); err != nil {
		return err
	}
	self, err := d.tensor(src.ptr, aclFloat, int64(n))
	if err != nil {
		return err
	}
	defer purego.SyscallN(d.fn.aclDestroyTensor, self)
	out, err := d.tensor(dst.ptr, aclUint8, packedRows, int64(nb))
	if err != nil {
		return err
	}
	defer purego.SyscallN(d.fn.aclDestroyTensor, out)
	return d.run("aclnnSignBitsPack", func() error {
		return d.call("aclnnSignBitsPackGetWorkspaceSize", d.fn.packWorkspace, self, packedRows, out,
			uintptr(unsafe.Pointer(&d.out.ws)), uintptr(unsafe.Pointer(&d.out.executor)))
	}, d.fn.pack)
}

// SignBitsUnpack writes +1 or -1 into the n float32 values of dst from
// the n/8 packed bytes of src (device bit order) with aclnnSignBitsUnpack,
// and waits for it. n must be a multiple of 8: the operator unpacks whole
// bytes.
func (d *Device) SignBitsUnpack(dst, src *Buffer, n int) error {
	if err := d.lock(); err != nil {
		return err
	}
	defer d.mu.Unlock()
	if n <= 0 || n%8 != 0 {
		return fmt.Errorf("npu: sign-bits unpack of %d elements: need a positive multiple of 8", n)
	}
	nb := n / 8
	if err := d.check("sign-bits unpack input", src, 0, nb); err != nil {
		return err
	}
	if err := d.check("sign-bits unpack output", dst, 0, 4*n); err != nil {
		return err
	}
	self, err := d.tensor(src.ptr, aclUint8, int64(nb))
	if err != nil {
		return err
	}
	defer purego.SyscallN(d.fn.aclDestroyTensor, self)
	out, err := d.tensor(dst.ptr, aclFloat, packedRows, int64(n))
	if err != nil {
		return err
	}
	defer purego.SyscallN(d.fn.aclDestroyTensor, out)
	return d.run("aclnnSignBitsUnpack", func() error {
		return d.call("aclnnSignBitsUnpackGetWorkspaceSize", d.fn.unpackWorkspace, self, packedRows, aclFloat, out,
			uintptr(unsafe.Pointer(&d.out.ws)), uintptr(unsafe.Pointer(&d.out.executor)))
	}, d.fn.unpack)
}

// ToWire converts packed bytes from the device's bit order (first element
// in the least significant bit) to lowbit's wire format (first element in
// the most significant bit), in place.
func ToWire(p []byte) {
	for i, b := range p {
		p[i] = bits.Reverse8(b)
	}
}

// FromWire converts packed bytes from the wire format to the device's bit
// order, in place.
func FromWire(p []byte) { ToWire(p) }

// Close frees the buffers still allocated and the workspace, destroys the
// stream, resets the device and finalizes ACL.
func (d *Device) Close() error {
	if err := d.lock(); err != nil {
		return nil
	}
	defer d.mu.Unlock()
	err := d.release()
	d.closed = true
	return err
}

func (d *Device) release() error {
	var errs []error
	for b := range d.bufs {
		errs = append(errs, d.call("aclrtFree", d.fn.aclrtFree, b.ptr))
		b.dev = nil
	}
	clear(d.bufs)
	if d.workspace != 0 {
		errs = append(errs, d.call("aclrtFree", d.fn.aclrtFree, d.workspace))
		d.workspace, d.workspaceSize = 0, 0
	}
	if d.stream != 0 {
		errs = append(errs, d.call("aclrtDestroyStream", d.fn.aclrtDestroyStream, d.stream))
		d.stream = 0
	}
	if d.inited {
		errs = append(errs, d.call("aclrtResetDevice", d.fn.aclrtResetDevice, uintptr(d.id)))
		errs = append(errs, d.call("aclFinalize", d.fn.aclFinalize))
		d.inited = false
	}
	d.pin.Unpin()
	d.unload()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("npu: close: %w", err)
	}
	return nil
}
