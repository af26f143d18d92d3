package cuda

// The Device: opening the driver, the device and its kernels, and closing
// them. Its memory and copies are in memory.go, its kernels in kernels.go.

import (
	_ "embed"
	"errors"
	"fmt"
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
