package cuda

import (
	_ "embed"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"strconv"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"

	"github.com/lowbit-ml/lowbit/accel"
)

// ptx is the PTX of kernels/lowbit.cu, built by `make ptx` (ISA 7.0,
// sm_80): it needs a driver for CUDA 11.0 or later and a GPU of compute
// capability 8.0 or later.
//
//go:embed lowbit.ptx
var ptx string

// PTXSize is the size in bytes of the embedded PTX.
var PTXSize = len(ptx)

// The device attributes the package reads (CUdevice_attribute).
const (
	attrMultiprocessorCount  = 16
	attrComputeCapabilityMaj = 75
	attrComputeCapabilityMin = 76
)

// minDriverVersion is the oldest driver API version (CUDA 11.0) that
// accepts PTX ISA 7.0; minCapability is the compute capability the PTX
// targets (sm_80), times 10.
const (
	minDriverVersion = 11000
	minCapability    = 80
)

// Launch geometry. maxParts bounds the blocks of the norm kernel (and the
// float64 partial sums every pack block adds up again).
const (
	blockSize = 256
	maxParts  = 1024
)

// DefaultLibrary is the driver library Open loads unless told otherwise.
const DefaultLibrary = "libcuda.so.1"

// LocalRankEnv is the variable Open reads the local rank from, which
// selects the device: Open MPI sets it for every process it starts.
const LocalRankEnv = "OMPI_COMM_WORLD_LOCAL_RANK"

type config struct {
	library string
	ordinal int // < 0: from the local rank
}

// Option configures Open.
type Option func(*config)

// WithLibrary loads the driver from path instead of DefaultLibrary (tests
// use it to load a stand-in).
func WithLibrary(path string) Option { return func(c *config) { c.library = path } }

// WithOrdinal selects CUDA device i (in the driver's numbering, which
// honours CUDA_VISIBLE_DEVICES) instead of the one of the local rank.
func WithOrdinal(i int) Option { return func(c *config) { c.ordinal = i } }

// Info describes the device a Device runs on.
type Info struct {
	Ordinal       int    // CUDA device number
	Name          string // e.g. "NVIDIA H100 80GB HBM3"
	PCIBusID      string // e.g. "0000:1b:00.0"
	Major, Minor  int    // compute capability
	SMs           int    // multiprocessors
	DriverVersion int    // CUDA driver API version, 1000*major + 10*minor
	TotalMemory   uint64 // bytes, from NVML when it is available
	FreeMemory    uint64 // bytes at Open, from NVML when it is available
	MemorySource  string // "nvml" or "cuda"
}

// Device is an accel.Device on one NVIDIA GPU, through the CUDA driver
// library loaded at run time (no cgo, no CUDA toolkit at build time). Its
// operations are ordered on one non-blocking stream of the device's
// primary context. A Device is safe for concurrent use; its operations are
// serialized.
type Device struct {
	mu   sync.Mutex
	drv  *driver
	info Info

	dev                                   int32
	ctx                                   uintptr
	stream                                uintptr
	module                                uintptr
	fnNorm, fnPack, fnUnpack, fnUnpackAdd uintptr
	fnCarry, fnSumCarry, fnScale          uintptr
	fnUnpackChunks                        uintptr
	carryPerSM, sumCarryPerSM             int // resident blocks per multiprocessor

	scratch     uint64 // device: maxParts float64 partial sums, then the float32 scale
	scaleOffset uint64

	pin  runtime.Pinner
	args *launchArgs
	bufs map[*buffer]struct{}
	host map[*hostBuffer]struct{}

	closed bool
}

// launchArgs is pinned host memory for kernel parameters and the driver's
// out-parameters, so that a launch allocates nothing.
type launchArgs struct {
	vals  [9]uint64
	sys   [11]uintptr    // arguments of Device.sys
	host  unsafe.Pointer // the host memory of the copy in the call (Device.hostAddr)
	ptrs  [9]unsafe.Pointer
	out   uint64 // CUdeviceptr, CUmodule, CUfunction, CUcontext, CUstream
	i32   int32
	free  uint64
	total uint64
	scale float32
	name  [256]byte
	rows  memcpy2D
}

// memcpy2D is the driver's CUDA_MEMCPY2D (cuda.h, 64-bit layout).
type memcpy2D struct {
	srcXInBytes, srcY uint64
	srcMemoryType     uint32
	_                 uint32
	srcHost           uintptr
	srcDevice         uint64
	srcArray          uintptr
	srcPitch          uint64
	dstXInBytes, dstY uint64
	dstMemoryType     uint32
	_                 uint32
	dstHost           uintptr
	dstDevice         uint64
	dstArray          uintptr
	dstPitch          uint64
	widthInBytes      uint64
	height            uint64
}

// CUmemorytype values.
const (
	memoryHost   = 1
	memoryDevice = 2
)

var (
	_ accel.Device        = (*Device)(nil)
	_ accel.ChunkUnpacker = (*Device)(nil)
	_ accel.HostAllocator = (*Device)(nil)
	_ accel.RowCopier     = (*Device)(nil)
)

// localRank reads LocalRankEnv; unset means 0.
func localRank() (int, error) {
	s, ok := os.LookupEnv(LocalRankEnv)
	if !ok || s == "" {
		return 0, nil
	}
	r, err := strconv.Atoi(s)
	if err != nil || r < 0 {
		return 0, fmt.Errorf("cuda: %s=%q is not a local rank", LocalRankEnv, s)
	}
	return r, nil
}

// Open loads the CUDA driver, selects the device of this process's local
// rank (LocalRankEnv, 0 when unset) or the one WithOrdinal names, and loads
// the embedded kernels. Every failure is an error that says what is
// missing: no driver library, no device, a driver too old for the PTX, a
// GPU older than sm_80.
func Open(opts ...Option) (*Device, error) {
	cfg := config{library: DefaultLibrary, ordinal: -1}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.ordinal < 0 {
		r, err := localRank()
		if err != nil {
			return nil, err
		}
		cfg.ordinal = r
	}
	drv, err := loadDriver(cfg.library)
	if err != nil {
		return nil, err
	}
	d := &Device{drv: drv, args: new(launchArgs), bufs: map[*buffer]struct{}{}, host: map[*hostBuffer]struct{}{}}
	d.pin.Pin(d.args)
	for i := range d.args.ptrs {
		d.args.ptrs[i] = unsafe.Pointer(&d.args.vals[i])
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := d.open(cfg.ordinal); err != nil {
		return nil, errors.Join(err, d.release())
	}
	return d, nil
}

func (d *Device) open(ordinal int) error {
	drv, a := d.drv, d.args
	if err := call("cuInit", drv.cuInit, 0); err != nil {
		var ce *Error
		if errors.As(err, &ce) && result(ce.Code) == errNoDevice {
			return fmt.Errorf("cuda: no CUDA-capable device: %w", err)
		}
		return fmt.Errorf("cuda: driver initialisation failed: %w", err)
	}
	if err := call("cuDriverGetVersion", drv.cuDriverGetVersion, uintptr(unsafe.Pointer(&a.i32))); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	d.info.DriverVersion = int(a.i32)
	if d.info.DriverVersion < minDriverVersion {
		return fmt.Errorf("cuda: the driver supports CUDA %d.%d; the embedded PTX (ISA 7.0) needs CUDA 11.0 or later: update the NVIDIA driver",
			d.info.DriverVersion/1000, d.info.DriverVersion%1000/10)
	}
	if err := call("cuDeviceGetCount", drv.cuDeviceGetCount, uintptr(unsafe.Pointer(&a.i32))); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	if n := int(a.i32); ordinal >= n {
		return fmt.Errorf("cuda: device %d requested (local rank or WithOrdinal) but %d CUDA devices are visible", ordinal, n)
	}
	if err := call("cuDeviceGet", drv.cuDeviceGet, uintptr(unsafe.Pointer(&a.i32)), uintptr(ordinal)); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	d.dev = a.i32
	d.info.Ordinal = ordinal
	if err := call("cuDeviceGetName", drv.cuDeviceGetName, uintptr(unsafe.Pointer(&a.name[0])), uintptr(len(a.name)-1), uintptr(d.dev)); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	d.info.Name = cString(a.name[:])
	if err := call("cuDeviceGetPCIBusId", drv.cuDeviceGetPCIBusId, uintptr(unsafe.Pointer(&a.name[0])), uintptr(len(a.name)-1), uintptr(d.dev)); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	d.info.PCIBusID = cString(a.name[:])
	for _, at := range []struct {
		attr int
		v    *int
	}{{attrComputeCapabilityMaj, &d.info.Major}, {attrComputeCapabilityMin, &d.info.Minor}, {attrMultiprocessorCount, &d.info.SMs}} {
		if err := call("cuDeviceGetAttribute", drv.cuDeviceGetAttribute, uintptr(unsafe.Pointer(&a.i32)), uintptr(at.attr), uintptr(d.dev)); err != nil {
			return fmt.Errorf("cuda: %w", err)
		}
		*at.v = int(a.i32)
	}
	if cc := 10*d.info.Major + d.info.Minor; cc < minCapability {
		return fmt.Errorf("cuda: %s has compute capability %d.%d; the kernels need 8.0 or later", d.info.Name, d.info.Major, d.info.Minor)
	}
	if d.info.SMs < 1 {
		d.info.SMs = 1
	}

	if err := call("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain, uintptr(unsafe.Pointer(&a.out)), uintptr(d.dev)); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	d.ctx = uintptr(a.out)
	if err := call("cuCtxSetCurrent", drv.cuCtxSetCurrent, d.ctx); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	const streamNonBlocking = 1
	if err := call("cuStreamCreate", drv.cuStreamCreate, uintptr(unsafe.Pointer(&a.out)), streamNonBlocking); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	d.stream = uintptr(a.out)
	d.fillMemory()
	if err := d.loadModule(); err != nil {
		return err
	}
	d.scaleOffset = 8 * maxParts
	if err := call("cuMemAlloc_v2", drv.cuMemAlloc, uintptr(unsafe.Pointer(&a.out)), uintptr(d.scaleOffset+8)); err != nil {
		return fmt.Errorf("cuda: scratch memory: %w", err)
	}
	d.scratch = a.out
	return nil
}

// loadModule loads the embedded PTX and finds the kernels. The driver
// compiles the PTX for the GPU here; a driver that cannot (too old for the
// ISA, no JIT compiler) gives an error that says so.
func (d *Device) loadModule() error {
	image := make([]byte, len(ptx)+1) // NUL-terminated, as cuModuleLoadData wants PTX
	copy(image, ptx)
	err := call("cuModuleLoadData", d.drv.cuModuleLoadData, uintptr(unsafe.Pointer(&d.args.out)), uintptr(unsafe.Pointer(&image[0])))
	runtime.KeepAlive(image)
	if err != nil {
		var ce *Error
		errors.As(err, &ce)
		switch result(ce.Code) {
		case errUnsupportedPTX, errInvalidPTX, errNoBinaryForGPU, errInvalidImage:
			return fmt.Errorf("cuda: the driver (CUDA %d.%d) cannot load the embedded PTX (ISA 7.0, sm_80) on %s; a driver for CUDA 11.0 or later is needed: %w",
				d.info.DriverVersion/1000, d.info.DriverVersion%1000/10, d.info.Name, err)
		case errJITCompilerNotFound:
			return fmt.Errorf("cuda: the driver has no PTX JIT compiler (libnvidia-ptxjitcompiler): %w", err)
		}
		return fmt.Errorf("cuda: loading the kernels: %w", err)
	}
	d.module = uintptr(d.args.out)
	for _, k := range []struct {
		name string
		fn   *uintptr
	}{
		{"lowbit_compensate_norm", &d.fnNorm}, {"lowbit_pack_residual", &d.fnPack},
		{"lowbit_unpack_scale", &d.fnUnpack}, {"lowbit_unpack_scale_add", &d.fnUnpackAdd},
		{"lowbit_carry_pack", &d.fnCarry}, {"lowbit_sum_carry_pack", &d.fnSumCarry}, {"lowbit_scale", &d.fnScale},
		{"lowbit_unpack_chunks", &d.fnUnpackChunks},
	} {
		name := append([]byte(k.name), 0)
		err := call("cuModuleGetFunction", d.drv.cuModuleGetFunction, uintptr(unsafe.Pointer(&d.args.out)), d.module, uintptr(unsafe.Pointer(&name[0])))
		runtime.KeepAlive(name)
		if err != nil {
			return fmt.Errorf("cuda: kernel %s: %w", k.name, err)
		}
		*k.fn = uintptr(d.args.out)
	}
	for _, k := range []struct {
		name   string
		fn     uintptr
		blocks *int
	}{{"lowbit_carry_pack", d.fnCarry, &d.carryPerSM}, {"lowbit_sum_carry_pack", d.fnSumCarry, &d.sumCarryPerSM}} {
		err := call("cuOccupancyMaxActiveBlocksPerMultiprocessor", d.drv.cuOccupancyMaxActiveBlocksPerMultiprocessor,
			uintptr(unsafe.Pointer(&d.args.i32)), k.fn, blockSize, 0)
		if err != nil {
			return fmt.Errorf("cuda: kernel %s: %w", k.name, err)
		}
		*k.blocks = max(1, int(d.args.i32))
	}
	return nil
}

// fillMemory records the device's memory at Open: from NVML where this
// build and machine have it, else from the driver.
func (d *Device) fillMemory() {
	if free, total, err := nvmlMemory(d.info.PCIBusID); err == nil {
		d.info.FreeMemory, d.info.TotalMemory, d.info.MemorySource = free, total, "nvml"
		return
	}
	if free, total, err := d.memGetInfo(); err == nil {
		d.info.FreeMemory, d.info.TotalMemory, d.info.MemorySource = free, total, "cuda"
	}
}

func (d *Device) memGetInfo() (free, total uint64, err error) {
	err = call("cuMemGetInfo_v2", d.drv.cuMemGetInfo, uintptr(unsafe.Pointer(&d.args.free)), uintptr(unsafe.Pointer(&d.args.total)))
	return d.args.free, d.args.total, err
}

func cString(b []byte) string {
	for i, c := range b {
		if c == 0 {
			return string(b[:i])
		}
	}
	return string(b)
}

// Info describes the device.
func (d *Device) Info() Info { return d.info }

// Name is "cuda:ORDINAL NAME".
func (d *Device) Name() string { return fmt.Sprintf("cuda:%d %s", d.info.Ordinal, d.info.Name) }

// enter locks the device and makes its context current on this OS thread
// (driver contexts are per thread; goroutines move between threads); leave
// undoes it.
func (d *Device) enter() error {
	d.mu.Lock()
	if d.closed {
		d.mu.Unlock()
		return fmt.Errorf("cuda: device closed: %w", accel.ErrFreed)
	}
	runtime.LockOSThread()
	d.args.sys[0] = d.ctx
	if err := d.sys("cuCtxSetCurrent", d.drv.cuCtxSetCurrent, 1); err != nil {
		runtime.UnlockOSThread()
		d.mu.Unlock()
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// hostAddr is the address of b's first byte for a driver argument. It
// also holds b in d.args until leave: so b stays alive through the call,
// and, stored in the heap, b cannot be on a goroutine stack that moves
// while the driver holds its address.
func (d *Device) hostAddr(b []byte) uintptr {
	d.args.host = unsafe.Pointer(unsafe.SliceData(b))
	return uintptr(d.args.host)
}

// sys calls fn with the first n arguments in d.args.sys, which the caller
// has set, and turns a non-zero CUresult into an *Error. Unlike call it
// allocates nothing (the arguments live in d.args); host memory whose
// address an argument holds goes through hostAddr. The caller holds the
// lock.
func (d *Device) sys(name string, fn uintptr, n int) error {
	r, _, _ := purego.SyscallN(fn, d.args.sys[:n]...)
	if res := result(int32(r)); res != errSuccess {
		return &Error{Func: name, Code: int(res)}
	}
	return nil
}

func (d *Device) leave() {
	d.args.host = nil
	runtime.UnlockOSThread()
	d.mu.Unlock()
}

// buffer is device memory from cuMemAlloc.
type buffer struct {
	dev *Device
	ptr uint64
	n   int
}

func (b *buffer) Len() int { return b.n }

// Free releases the memory; a second Free is a no-op.
func (b *buffer) Free() error {
	d := b.dev
	if d == nil {
		return nil
	}
	err := d.enter()
	if err != nil {
		b.dev = nil // the device is closed and has freed it
		return nil
	}
	defer d.leave()
	delete(d.bufs, b)
	b.dev = nil
	if b.ptr == 0 {
		return nil
	}
	ptr := b.ptr
	b.ptr = 0
	if err := call("cuMemFree_v2", d.drv.cuMemFree, uintptr(ptr)); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// Alloc returns n zeroed bytes of device memory. Running out of device
// memory is an error that gives the free and total memory.
func (d *Device) Alloc(n int) (accel.Buffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("cuda: alloc of %d bytes", n)
	}
	err := d.enter()
	if err != nil {
		return nil, err
	}
	defer d.leave()
	b := &buffer{dev: d, n: n}
	if n > 0 {
		if err := call("cuMemAlloc_v2", d.drv.cuMemAlloc, uintptr(unsafe.Pointer(&d.args.out)), uintptr(n)); err != nil {
			var ce *Error
			if errors.As(err, &ce) && ce.IsOutOfMemory() {
				free, total, _ := d.memGetInfo()
				return nil, fmt.Errorf("cuda: out of device memory allocating %d bytes on %s (%d of %d bytes free): %w",
					n, d.Name(), free, total, err)
			}
			return nil, fmt.Errorf("cuda: allocating %d bytes: %w", n, err)
		}
		b.ptr = d.args.out
		if err := call("cuMemsetD8Async", d.drv.cuMemsetD8Async, uintptr(b.ptr), 0, uintptr(n), d.stream); err != nil {
			call("cuMemFree_v2", d.drv.cuMemFree, uintptr(b.ptr))
			return nil, fmt.Errorf("cuda: %w", err)
		}
	}
	d.bufs[b] = struct{}{}
	return b, nil
}

// hostBuffer is page-locked host memory from cuMemAllocHost.
type hostBuffer struct {
	dev   *Device
	bytes []byte
}

func (h *hostBuffer) Bytes() []byte { return h.bytes }

// Free releases the memory; a second Free is a no-op.
func (h *hostBuffer) Free() error {
	d := h.dev
	if d == nil {
		return nil
	}
	err := d.enter()
	if err != nil {
		h.dev, h.bytes = nil, nil // the device is closed and has freed it
		return nil
	}
	defer d.leave()
	delete(d.host, h)
	p := unsafe.SliceData(h.bytes)
	h.dev, h.bytes = nil, nil
	if p == nil {
		return nil
	}
	if err := call("cuMemFreeHost", d.drv.cuMemFreeHost, uintptr(unsafe.Pointer(p))); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// AllocHost returns n zeroed bytes of page-locked host memory
// (cuMemAllocHost), which CopyIn and CopyOut move by DMA. Close frees it
// if Free has not.
func (d *Device) AllocHost(n int) (accel.HostBuffer, error) {
	if n < 0 {
		return nil, fmt.Errorf("cuda: host alloc of %d bytes", n)
	}
	err := d.enter()
	if err != nil {
		return nil, err
	}
	defer d.leave()
	h := &hostBuffer{dev: d}
	if n > 0 {
		var p unsafe.Pointer
		if err := call("cuMemAllocHost_v2", d.drv.cuMemAllocHost, uintptr(unsafe.Pointer(&p)), uintptr(n)); err != nil {
			return nil, fmt.Errorf("cuda: allocating %d bytes of page-locked host memory: %w", n, err)
		}
		h.bytes = unsafe.Slice((*byte)(p), n)
		clear(h.bytes)
	}
	d.host[h] = struct{}{}
	return h, nil
}

// ptrOf checks s and returns the device address of its first byte.
func (d *Device) ptrOf(what string, s accel.Span, floats bool) (uint64, error) {
	b, ok := s.Buf.(*buffer)
	if !ok || b == nil {
		return 0, fmt.Errorf("cuda: %s: span of a %T, not of a cuda buffer", what, s.Buf)
	}
	if b.dev == nil {
		return 0, fmt.Errorf("cuda: %s: %w", what, accel.ErrFreed)
	}
	if b.dev != d {
		return 0, fmt.Errorf("cuda: %s: buffer of another device", what)
	}
	check := accel.CheckSpan
	if floats {
		check = accel.CheckFloats
	}
	if err := check(what, s, b.n); err != nil {
		return 0, err
	}
	return b.ptr + uint64(s.Off), nil
}

// CopyIn copies src into dst and waits for the copy, except from
// page-locked memory of AllocHost, which the copy reads by DMA after
// CopyIn has returned (see accel.HostAllocator).
func (d *Device) CopyIn(dst accel.Span, src []byte) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("copy-in destination", dst, false)
	if err != nil {
		return err
	}
	if len(src) != dst.Len {
		return fmt.Errorf("cuda: copy-in of %d bytes into a %d-byte span", len(src), dst.Len)
	}
	if len(src) == 0 {
		return nil
	}
	a := &d.args.sys
	a[0], a[1], a[2], a[3] = uintptr(p), d.hostAddr(src), uintptr(len(src)), d.stream
	err = d.sys("cuMemcpyHtoDAsync_v2", d.drv.cuMemcpyHtoDAsync, 4)
	if err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	if d.pageLocked(src) {
		return nil
	}
	return d.sync()
}

// pageLocked reports whether b lies in page-locked memory of AllocHost;
// the caller holds the lock.
func (d *Device) pageLocked(b []byte) bool {
	lo := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	for h := range d.host {
		p := uintptr(unsafe.Pointer(unsafe.SliceData(h.bytes)))
		if lo >= p && lo+uintptr(len(b)) <= p+uintptr(len(h.bytes)) {
			return true
		}
	}
	return false
}

// CopyOut copies src into dst and waits for the copy.
func (d *Device) CopyOut(dst []byte, src accel.Span) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("copy-out source", src, false)
	if err != nil {
		return err
	}
	if len(dst) != src.Len {
		return fmt.Errorf("cuda: copy-out of a %d-byte span into %d bytes", src.Len, len(dst))
	}
	if len(dst) == 0 {
		return nil
	}
	a := &d.args.sys
	a[0], a[1], a[2], a[3] = d.hostAddr(dst), uintptr(p), uintptr(len(dst)), d.stream
	if err = d.sys("cuMemcpyDtoHAsync_v2", d.drv.cuMemcpyDtoHAsync, 4); err != nil {
		err = fmt.Errorf("cuda: %w", err)
	} else {
		err = d.sync()
	}
	return err
}

// CopyOutRows copies rows of width bytes from the device span src (row r
// at byte r*srcPitch) to dst (at r*dstPitch) in one cuMemcpy2DAsync, and
// waits for it.
func (d *Device) CopyOutRows(dst []byte, dstPitch int, src accel.Span, srcPitch, width, rows int) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("copy-out-rows source", src, false)
	if err != nil {
		return err
	}
	if err := accel.CheckRows("copy-out-rows", len(dst), dstPitch, src.Len, srcPitch, width, rows); err != nil {
		return err
	}
	if rows == 0 || width == 0 {
		return nil
	}
	d.args.rows = memcpy2D{srcMemoryType: memoryDevice, srcDevice: p, srcPitch: uint64(srcPitch),
		dstMemoryType: memoryHost, dstHost: d.hostAddr(dst), dstPitch: uint64(dstPitch),
		widthInBytes: uint64(width), height: uint64(rows)}
	d.args.sys[0], d.args.sys[1] = uintptr(unsafe.Pointer(&d.args.rows)), d.stream
	err = d.sys("cuMemcpy2DAsync_v2", d.drv.cuMemcpy2DAsync, 2)
	if err == nil {
		err = d.sync()
	}
	if err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// CopyInRows copies rows of width bytes from src (row r at byte
// r*srcPitch) to the device span dst (at r*dstPitch) in one
// cuMemcpy2DAsync, and waits for it unless src is page-locked memory of
// AllocHost (see CopyIn).
func (d *Device) CopyInRows(dst accel.Span, dstPitch int, src []byte, srcPitch, width, rows int) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("copy-in-rows destination", dst, false)
	if err != nil {
		return err
	}
	if err := accel.CheckRows("copy-in-rows", dst.Len, dstPitch, len(src), srcPitch, width, rows); err != nil {
		return err
	}
	if rows == 0 || width == 0 {
		return nil
	}
	d.args.rows = memcpy2D{srcMemoryType: memoryHost, srcHost: d.hostAddr(src), srcPitch: uint64(srcPitch),
		dstMemoryType: memoryDevice, dstDevice: p, dstPitch: uint64(dstPitch),
		widthInBytes: uint64(width), height: uint64(rows)}
	d.args.sys[0], d.args.sys[1] = uintptr(unsafe.Pointer(&d.args.rows)), d.stream
	err = d.sys("cuMemcpy2DAsync_v2", d.drv.cuMemcpy2DAsync, 2)
	if err == nil && !d.pageLocked(src[:(rows-1)*srcPitch+width]) {
		err = d.sync()
	}
	if err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// Copy copies src into dst on the device.
func (d *Device) Copy(dst, src accel.Span) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	q, err := d.ptrOf("copy destination", dst, false)
	if err != nil {
		return err
	}
	p, err := d.ptrOf("copy source", src, false)
	if err != nil {
		return err
	}
	if dst.Len != src.Len {
		return fmt.Errorf("cuda: copy of a %d-byte span into a %d-byte span", src.Len, dst.Len)
	}
	if dst.Len == 0 {
		return nil
	}
	a := &d.args.sys
	a[0], a[1], a[2], a[3] = uintptr(q), uintptr(p), uintptr(dst.Len), d.stream
	if err := d.sys("cuMemcpyDtoDAsync_v2", d.drv.cuMemcpyDtoDAsync, 4); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// Zero clears dst.
func (d *Device) Zero(dst accel.Span) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	p, err := d.ptrOf("zero", dst, false)
	if err != nil {
		return err
	}
	if dst.Len == 0 {
		return nil
	}
	a := &d.args.sys
	a[0], a[1], a[2], a[3] = uintptr(p), 0, uintptr(dst.Len), d.stream
	if err := d.sys("cuMemsetD8Async", d.drv.cuMemsetD8Async, 4); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// launch starts fn on grid blocks of blockSize threads with the first
// nargs parameters in d.args.vals.
func (d *Device) launch(name string, fn uintptr, grid int) error {
	d.args.sys = [11]uintptr{fn, uintptr(grid), 1, 1, blockSize, 1, 1, 0, d.stream, uintptr(unsafe.Pointer(&d.args.ptrs[0])), 0}
	if err := d.sys("cuLaunchKernel", d.drv.cuLaunchKernel, 11); err != nil {
		return fmt.Errorf("cuda: launching %s: %w", name, err)
	}
	return nil
}

// gridFor is the number of blocks for work items of blockSize-thread
// blocks, at most perSM blocks per multiprocessor (the kernels loop).
func (d *Device) gridFor(items int, perSM int) int {
	g := (items + blockSize - 1) / blockSize
	return max(1, min(g, perSM*d.info.SMs))
}

// Compress runs the compensate-and-norm kernel, then the pack-with-residual
// kernel (which sums the norm's partial sums itself), and waits for the
// scale.
func (d *Device) Compress(packed, residual, input accel.Span) (float32, error) {
	err := d.enter()
	if err != nil {
		return 0, err
	}
	defer d.leave()
	r, err := d.ptrOf("compress residual", residual, true)
	if err != nil {
		return 0, err
	}
	in, err := d.ptrOf("compress input", input, true)
	if err != nil {
		return 0, err
	}
	p, err := d.ptrOf("compress packed", packed, false)
	if err != nil {
		return 0, err
	}
	n, nIn := residual.Len/4, input.Len/4
	if nIn > n {
		return 0, fmt.Errorf("cuda: compress: input of %d elements is longer than the residual (%d)", nIn, n)
	}
	if err := accel.CheckKernel("compress", packed.Len, n); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, nil
	}
	parts := min(d.gridFor(n, 8), maxParts)
	a := &d.args.vals
	a[0], a[1], a[2], a[3], a[4] = r, in, uint64(nIn), uint64(n), d.scratch
	if err := d.launch("lowbit_compensate_norm", d.fnNorm, parts); err != nil {
		return 0, err
	}
	groups := (n + 1023) / 1024
	warpsPerBlock := blockSize / 32
	packGrid := max(1, min((groups+warpsPerBlock-1)/warpsPerBlock, 4*d.info.SMs))
	a[0], a[1], a[2], a[3], a[4], a[5] = p, r, uint64(n), d.scratch, uint64(parts), d.scratch+d.scaleOffset
	if err := d.launch("lowbit_pack_residual", d.fnPack, packGrid); err != nil {
		return 0, err
	}
	sa := &d.args.sys
	sa[0], sa[1], sa[2], sa[3] = uintptr(unsafe.Pointer(&d.args.scale)), uintptr(d.scratch+d.scaleOffset), 4, d.stream
	if err := d.sys("cuMemcpyDtoHAsync_v2", d.drv.cuMemcpyDtoHAsync, 4); err != nil {
		return 0, fmt.Errorf("cuda: %w", err)
	}
	if err := d.sync(); err != nil {
		return 0, err
	}
	return d.args.scale, nil
}

// CompressCarried runs the one-pass carry-and-pack kernel, then the
// one-block kernel that sums its partial norms, and waits for the scale.
func (d *Device) CompressCarried(packed, carried accel.Span, prevScale float32, input accel.Span) (float32, error) {
	err := d.enter()
	if err != nil {
		return 0, err
	}
	defer d.leave()
	x, p, err := d.kernelArgs("compress-carried", "compress-carried x", "compress-carried packed", carried, packed)
	if err != nil {
		return 0, err
	}
	in, err := d.ptrOf("compress-carried input", input, true)
	if err != nil {
		return 0, err
	}
	n, nIn := carried.Len/4, input.Len/4
	if nIn > n {
		return 0, fmt.Errorf("cuda: compress-carried: input of %d elements is longer than x (%d)", nIn, n)
	}
	if n == 0 {
		return 0, nil
	}
	a := &d.args.vals
	a[0], a[1], a[2], a[3], a[4], a[5] = p, x, uint64(n), uint64(math.Float32bits(prevScale)), in, uint64(nIn)
	return d.carry("lowbit_carry_pack", d.fnCarry, d.carryPerSM, n, 6)
}

// SumCompressCarried runs the one-pass kernel that sums the chunks, carries
// and packs, then the one-block norm kernel, and waits for the scale.
func (d *Device) SumCompressCarried(packed, carried accel.Span, prevScale float32, chunks, scales accel.Span) (float32, error) {
	err := d.enter()
	if err != nil {
		return 0, err
	}
	defer d.leave()
	x, p, err := d.kernelArgs("sum-compress-carried", "sum-compress-carried x", "sum-compress-carried packed", carried, packed)
	if err != nil {
		return 0, err
	}
	c, err := d.ptrOf("sum-compress-carried chunks", chunks, false)
	if err != nil {
		return 0, err
	}
	sc, err := d.ptrOf("sum-compress-carried scales", scales, true)
	if err != nil {
		return 0, err
	}
	n, w := carried.Len/4, scales.Len/4
	if err := accel.CheckSum("sum-compress-carried", chunks.Len, w, n); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, nil
	}
	a := &d.args.vals
	a[0], a[1], a[2], a[3] = p, x, uint64(n), uint64(math.Float32bits(prevScale))
	a[4], a[5], a[6], a[7] = c, uint64(accel.PackedLen(n)), sc, uint64(w)
	return d.carry("lowbit_sum_carry_pack", d.fnSumCarry, d.sumCarryPerSM, n, 8)
}

// kernelArgs checks a kernel's float32 span and the packed signs of its
// elements and returns their device addresses.
func (d *Device) kernelArgs(op, xName, packedName string, x, packed accel.Span) (xp, pp uint64, err error) {
	if xp, err = d.ptrOf(xName, x, true); err != nil {
		return 0, 0, err
	}
	if pp, err = d.ptrOf(packedName, packed, false); err != nil {
		return 0, 0, err
	}
	return xp, pp, accel.CheckKernel(op, packed.Len, x.Len/4)
}

// carry launches a carry-and-pack kernel over n elements, whose
// parameters are in d.args.vals up to the partial sums (parameter
// partials, which carry sets), then lowbit_scale, and waits for the
// scale. The grid is at most one wave of resident blocks (perSM on each
// multiprocessor), so that no block of the grid-stride loop starts late.
// The caller holds the lock.
func (d *Device) carry(kernel string, fn uintptr, perSM, n, partials int) (float32, error) {
	groups := (n + 1023) / 1024
	warpsPerBlock := blockSize / 32
	grid := max(1, min((groups+warpsPerBlock-1)/warpsPerBlock, perSM*d.info.SMs, maxParts))
	a := &d.args.vals
	a[partials] = d.scratch
	if err := d.launch(kernel, fn, grid); err != nil {
		return 0, err
	}
	a[0], a[1], a[2], a[3] = d.scratch, uint64(grid), uint64(n), d.scratch+d.scaleOffset
	if err := d.launch("lowbit_scale", d.fnScale, 1); err != nil {
		return 0, err
	}
	sa := &d.args.sys
	sa[0], sa[1], sa[2], sa[3] = uintptr(unsafe.Pointer(&d.args.scale)), uintptr(d.scratch+d.scaleOffset), 4, d.stream
	if err := d.sys("cuMemcpyDtoHAsync_v2", d.drv.cuMemcpyDtoHAsync, 4); err != nil {
		return 0, fmt.Errorf("cuda: %w", err)
	}
	if err := d.sync(); err != nil {
		return 0, err
	}
	return d.args.scale, nil
}

// UnpackScale writes ±scale into dst from the packed signs.
func (d *Device) UnpackScale(dst, packed accel.Span, scale float32) error {
	return d.unpack("lowbit_unpack_scale", d.fnUnpack, "unpack-scale destination", "unpack-scale packed", dst, packed, scale)
}

// UnpackScaleAdd adds ±scale into acc from the packed signs.
func (d *Device) UnpackScaleAdd(acc, packed accel.Span, scale float32) error {
	return d.unpack("lowbit_unpack_scale_add", d.fnUnpackAdd, "unpack-scale-add accumulator", "unpack-scale-add packed", acc, packed, scale)
}

func (d *Device) unpack(kernel string, fn uintptr, dstName, packedName string, dst, packed accel.Span, scale float32) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	x, p, err := d.kernelArgs(kernel, dstName, packedName, dst, packed)
	if err != nil {
		return err
	}
	n := dst.Len / 4
	if n == 0 {
		return nil
	}
	a := &d.args.vals
	a[0], a[1], a[2], a[3] = x, p, uint64(n), uint64(math.Float32bits(scale))
	return d.launch(kernel, fn, d.gridFor(n, 8))
}

// UnpackScaleChunks writes ±scales[j] into chunk j of dst from the packed
// signs, in one launch: blocks per chunk, chunk after chunk, each reading
// its chunk's scale from device memory.
func (d *Device) UnpackScaleChunks(dst, packed accel.Span, chunk int, scales accel.Span) error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	const op = "unpack-scale-chunks"
	x, p, err := d.kernelArgs(op, "unpack-scale-chunks destination", "unpack-scale-chunks packed", dst, packed)
	if err != nil {
		return err
	}
	sc, err := d.ptrOf("unpack-scale-chunks scales", scales, true)
	if err != nil {
		return err
	}
	n := dst.Len / 4
	if err := accel.CheckChunks(op, packed.Len, n, chunk, scales.Len/4); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	chunks := (n + chunk - 1) / chunk
	per := max(1, (d.gridFor(n, 8)+chunks-1)/chunks)
	if chunks > math.MaxInt32/per {
		return fmt.Errorf("cuda: %s: %d chunks", op, chunks)
	}
	a := &d.args.vals
	a[0], a[1], a[2], a[3], a[4], a[5] = x, p, uint64(n), uint64(chunk), sc, uint64(per)
	return d.launch("lowbit_unpack_chunks", d.fnUnpackChunks, per*chunks)
}

// sync waits for the stream; the caller holds the lock.
func (d *Device) sync() error {
	d.args.sys[0] = d.stream
	if err := d.sys("cuStreamSynchronize", d.drv.cuStreamSynchronize, 1); err != nil {
		return fmt.Errorf("cuda: %w", err)
	}
	return nil
}

// Synchronize waits for every operation called so far.
func (d *Device) Synchronize() error {
	err := d.enter()
	if err != nil {
		return err
	}
	defer d.leave()
	return d.sync()
}

// Close frees every buffer still allocated, the kernels, the stream and the
// context reference. Using the device or its buffers afterwards is an
// error.
func (d *Device) Close() error {
	err := d.enter()
	if err != nil {
		return nil // already closed
	}
	defer d.leave()
	err = d.release()
	d.closed = true
	return err
}

// release frees what open acquired, in reverse order; it tolerates a
// half-opened device.
func (d *Device) release() error {
	var errs []error
	drv := d.drv
	if d.stream != 0 {
		errs = append(errs, call("cuStreamSynchronize", drv.cuStreamSynchronize, d.stream))
	}
	for b := range d.bufs {
		if b.ptr != 0 {
			errs = append(errs, call("cuMemFree_v2", drv.cuMemFree, uintptr(b.ptr)))
		}
		b.ptr, b.dev = 0, nil
	}
	clear(d.bufs)
	for h := range d.host {
		if h.bytes != nil {
			errs = append(errs, call("cuMemFreeHost", drv.cuMemFreeHost, uintptr(unsafe.Pointer(unsafe.SliceData(h.bytes)))))
		}
		h.bytes, h.dev = nil, nil
	}
	clear(d.host)
	if d.scratch != 0 {
		errs = append(errs, call("cuMemFree_v2", drv.cuMemFree, uintptr(d.scratch)))
		d.scratch = 0
	}
	if d.module != 0 {
		errs = append(errs, call("cuModuleUnload", drv.cuModuleUnload, d.module))
		d.module = 0
	}
	if d.stream != 0 {
		errs = append(errs, call("cuStreamDestroy_v2", drv.cuStreamDestroy, d.stream))
		d.stream = 0
	}
	if d.ctx != 0 {
		errs = append(errs, call("cuDevicePrimaryCtxRelease_v2", drv.cuDevicePrimaryCtxRelease, uintptr(d.dev)))
		d.ctx = 0
	}
	d.pin.Unpin()
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("cuda: close: %w", err)
	}
	return nil
}
