package cuda

import (
	"fmt"

	"github.com/ebitengine/purego"
)

// result is a CUresult of the driver API.
type result uintptr

// The CUresult codes the package tells apart (cuda.h).
const (
	errSuccess              result = 0
	errInvalidValue         result = 1
	errOutOfMemory          result = 2
	errNotInitialized       result = 3
	errDeinitialized        result = 4
	errNoDevice             result = 100
	errInvalidDevice        result = 101
	errInvalidImage         result = 200
	errInvalidContext       result = 201
	errNoBinaryForGPU       result = 209
	errInvalidPTX           result = 218
	errUnsupportedPTX       result = 222
	errJITCompilerNotFound  result = 221
	errInvalidHandle        result = 400
	errNotFound             result = 500
	errIllegalAddress       result = 700
	errLaunchOutOfResources result = 701
	errLaunchFailed         result = 719
	errInsufficientDriver   result = 35
	errSystemDriverMismatch result = 803
	errCompatNotSupported   result = 804
)

var resultNames = map[result]string{
	errInvalidValue:         "CUDA_ERROR_INVALID_VALUE",
	errOutOfMemory:          "CUDA_ERROR_OUT_OF_MEMORY",
	errNotInitialized:       "CUDA_ERROR_NOT_INITIALIZED",
	errDeinitialized:        "CUDA_ERROR_DEINITIALIZED",
	errInsufficientDriver:   "CUDA_ERROR_INSUFFICIENT_DRIVER",
	errNoDevice:             "CUDA_ERROR_NO_DEVICE",
	errInvalidDevice:        "CUDA_ERROR_INVALID_DEVICE",
	errInvalidImage:         "CUDA_ERROR_INVALID_IMAGE",
	errInvalidContext:       "CUDA_ERROR_INVALID_CONTEXT",
	errNoBinaryForGPU:       "CUDA_ERROR_NO_BINARY_FOR_GPU",
	errInvalidPTX:           "CUDA_ERROR_INVALID_PTX",
	errJITCompilerNotFound:  "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
	errUnsupportedPTX:       "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
	errInvalidHandle:        "CUDA_ERROR_INVALID_HANDLE",
	errNotFound:             "CUDA_ERROR_NOT_FOUND",
	errIllegalAddress:       "CUDA_ERROR_ILLEGAL_ADDRESS",
	errLaunchOutOfResources: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
	errLaunchFailed:         "CUDA_ERROR_LAUNCH_FAILED",
	errSystemDriverMismatch: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
	errCompatNotSupported:   "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
}

// Error is an error code returned by the CUDA driver.
type Error struct {
	Func string // the driver function, for example "cuMemAlloc_v2"
	Code int    // its CUresult
}

func (e *Error) Error() string {
	name, ok := resultNames[result(e.Code)]
	if !ok {
		name = "CUresult"
	}
	return fmt.Sprintf("%s: %s (%d)", e.Func, name, e.Code)
}

// IsOutOfMemory reports whether the driver ran out of device memory.
func (e *Error) IsOutOfMemory() bool { return result(e.Code) == errOutOfMemory }

// driver holds the entry points of libcuda that the package calls,
// resolved once with dlsym.
type driver struct {
	lib  uintptr
	path string

	cuInit                                      uintptr
	cuDriverGetVersion                          uintptr
	cuDeviceGetCount                            uintptr
	cuDeviceGet                                 uintptr
	cuDeviceGetName                             uintptr
	cuDeviceGetPCIBusId                         uintptr
	cuDeviceGetAttribute                        uintptr
	cuDevicePrimaryCtxRetain                    uintptr
	cuDevicePrimaryCtxRelease                   uintptr
	cuCtxSetCurrent                             uintptr
	cuStreamCreate                              uintptr
	cuStreamDestroy                             uintptr
	cuStreamSynchronize                         uintptr
	cuModuleLoadData                            uintptr
	cuModuleUnload                              uintptr
	cuModuleGetFunction                         uintptr
	cuMemAlloc                                  uintptr
	cuMemFree                                   uintptr
	cuMemGetInfo                                uintptr
	cuMemAllocHost                              uintptr
	cuMemFreeHost                               uintptr
	cuMemcpyHtoDAsync                           uintptr
	cuMemcpyDtoHAsync                           uintptr
	cuMemcpyDtoDAsync                           uintptr
	cuMemcpy2DAsync                             uintptr
	cuMemsetD8Async                             uintptr
	cuLaunchKernel                              uintptr
	cuOccupancyMaxActiveBlocksPerMultiprocessor uintptr
}

// symbols maps each driver field to its exported name. The _v2 names are
// the ones cuda.h has mapped the plain names to since CUDA 4.0 / 11.0.
func (d *driver) symbols() []struct {
	name string
	fn   *uintptr
} {
	return []struct {
		name string
		fn   *uintptr
	}{
		{"cuInit", &d.cuInit},
		{"cuDriverGetVersion", &d.cuDriverGetVersion},
		{"cuDeviceGetCount", &d.cuDeviceGetCount},
		{"cuDeviceGet", &d.cuDeviceGet},
		{"cuDeviceGetName", &d.cuDeviceGetName},
		{"cuDeviceGetPCIBusId", &d.cuDeviceGetPCIBusId},
		{"cuDeviceGetAttribute", &d.cuDeviceGetAttribute},
		{"cuDevicePrimaryCtxRetain", &d.cuDevicePrimaryCtxRetain},
		{"cuDevicePrimaryCtxRelease_v2", &d.cuDevicePrimaryCtxRelease},
		{"cuCtxSetCurrent", &d.cuCtxSetCurrent},
		{"cuStreamCreate", &d.cuStreamCreate},
		{"cuStreamDestroy_v2", &d.cuStreamDestroy},
		{"cuStreamSynchronize", &d.cuStreamSynchronize},
		{"cuModuleLoadData", &d.cuModuleLoadData},
		{"cuModuleUnload", &d.cuModuleUnload},
		{"cuModuleGetFunction", &d.cuModuleGetFunction},
		{"cuMemAlloc_v2", &d.cuMemAlloc},
		{"cuMemFree_v2", &d.cuMemFree},
		{"cuMemGetInfo_v2", &d.cuMemGetInfo},
		{"cuMemAllocHost_v2", &d.cuMemAllocHost},
		{"cuMemFreeHost", &d.cuMemFreeHost},
		{"cuMemcpyHtoDAsync_v2", &d.cuMemcpyHtoDAsync},
		{"cuMemcpyDtoHAsync_v2", &d.cuMemcpyDtoHAsync},
		{"cuMemcpyDtoDAsync_v2", &d.cuMemcpyDtoDAsync},
		{"cuMemcpy2DAsync_v2", &d.cuMemcpy2DAsync},
		{"cuMemsetD8Async", &d.cuMemsetD8Async},
		{"cuLaunchKernel", &d.cuLaunchKernel},
		{"cuOccupancyMaxActiveBlocksPerMultiprocessor", &d.cuOccupancyMaxActiveBlocksPerMultiprocessor},
	}
}

// loadDriver opens the driver library at path and resolves every entry
// point. A missing library or symbol is an error, never a panic.
func loadDriver(path string) (*driver, error) {
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return nil, fmt.Errorf("cuda: cannot load the CUDA driver library %s (no NVIDIA driver on this machine?): %w", path, err)
	}
	d := &driver{lib: lib, path: path}
	for _, s := range d.symbols() {
		fn, err := purego.Dlsym(lib, s.name)
		if err != nil || fn == 0 {
			purego.Dlclose(lib)
			return nil, fmt.Errorf("cuda: %s lacks %s: the NVIDIA driver is too old (need CUDA 11.0 or later)", path, s.name)
		}
		*s.fn = fn
	}
	return d, nil
}

// call calls fn with args and turns a non-zero CUresult into an *Error.
// Like purego.SyscallN it keeps the objects that pointer arguments
// (converted to uintptr in the call expression) point to alive and in
// place until it returns.
//
//go:uintptrescapes
func call(name string, fn uintptr, args ...uintptr) error {
	r, _, _ := purego.SyscallN(fn, args...)
	if res := result(int32(r)); res != errSuccess {
		return &Error{Func: name, Code: int(res)}
	}
	return nil
}
