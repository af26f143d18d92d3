// Package cuda is the accel.Device of NVIDIA GPUs: the kernels of the
// 1-bit compressed allreduce in PTX, run through the CUDA driver API.
//
// Nothing of CUDA is needed to build it: the driver library
// (libcuda.so.1) is loaded at run time with purego, so the module builds
// with CGO_ENABLED=0 and on machines without a GPU, where Open returns an
// error that says what is missing. The kernels live in kernels/lowbit.cu;
// `make ptx` compiles them to lowbit.ptx with clang (no CUDA toolkit), and
// that committed PTX is embedded in the package and handed to the driver
// with cuModuleLoadData, which compiles it for the GPU. The PTX is ISA 7.0
// for sm_80: it needs a driver for CUDA 11.0 or later and a GPU of compute
// capability 8.0 (A100) or later; Open checks both and says which is
// lacking.
//
// Open chooses the device by the process's local rank
// (OMPI_COMM_WORLD_LOCAL_RANK, so one process per GPU under mpirun) unless
// WithOrdinal names one. Devices lists the GPUs and their memory through
// NVML (github.com/NVIDIA/go-nvml, libnvidia-ml loaded at run time), and
// Open records the chosen GPU's memory from NVML; go-nvml needs cgo, so a
// CGO_ENABLED=0 build reads the memory from the driver instead.
//
// The kernels are bandwidth-minded. The carried kernels that
// onebit.AllReduceDevice uses (CompressCarried, SumCompressCarried) are
// one pass each: every warp loads 32 coalesced rows of 32 floats, forms
// each element's residual from the carried value and adds the input (for
// the server, the scaled signs of the W received chunks, summed in
// registers), stores the new value, packs each row with a warp ballot
// (bit-reversed per byte into the wire format), stores its 32 packed words
// in one coalesced 128-byte write, and adds the squares into per-block
// float64 partial sums that a one-block kernel turns into the scale; the
// grid is one wave of resident blocks (cuOccupancyMaxActiveBlocksPerMultiprocessor).
// Compress is two passes: compensate-and-norm with coalesced loads, then
// pack-with-residual as above; the unpack kernels are grid-stride loops
// with coalesced float stores.
//
// The tests run kernels/lowbit.cu itself on the host when no GPU is there:
// testdata/simt.h and simt.cc emulate the thread hierarchy (a fiber per
// thread, barriers, warp ballots and shuffles) inside a stand-in libcuda.
package cuda
