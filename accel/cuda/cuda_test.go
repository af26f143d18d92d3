package cuda_test

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/accel/cuda"
	"github.com/lowbit-ml/lowbit/accel/internal/acceltest"
	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/internal/conformance"
	"github.com/lowbit-ml/lowbit/onebit"
)

var f32bytes = acceltest.Bytes

func randn(rng *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	return x
}

func TestEmbeddedPTX(t *testing.T) {
	assert.Greater(t, cuda.PTXSize, 1000)
	src, err := os.ReadFile("lowbit.ptx")
	require.NoError(t, err)
	assert.Equal(t, len(src), cuda.PTXSize)
}

// TestPTXUpToDate: the tests run kernels/lowbit.cu on the host (the
// stand-in libcuda), a GPU runs the committed lowbit.ptx; the two must be
// the same kernels. It rebuilds the PTX as `make ptx` does and compares.
func TestPTXUpToDate(t *testing.T) {
	clang, err := exec.LookPath("clang-14")
	if err != nil {
		t.Skip("cuda: clang-14 not found, skipping the check that lowbit.ptx is built from kernels/lowbit.cu (apt-get install clang-14)")
	}
	out := filepath.Join(t.TempDir(), "lowbit.ptx")
	msg, err := exec.Command(clang, "--cuda-device-only", "-nocudainc", "-nocudalib", "--cuda-gpu-arch=sm_80",
		"-Xclang", "-target-feature", "-Xclang", "+ptx70", "-S", "-O3", "-o", out, filepath.Join("kernels", "lowbit.cu")).CombinedOutput()
	require.NoError(t, err, "clang-14: %s", msg)
	built, err := os.ReadFile(out)
	require.NoError(t, err)
	committed, err := os.ReadFile("lowbit.ptx")
	require.NoError(t, err)
	require.True(t, bytes.Equal(built, committed), "lowbit.ptx is not what kernels/lowbit.cu compiles to: run make ptx")
}

// TestOpenNoDriver: without the driver library Open fails with an error
// that says so; nothing panics.
func TestOpenNoDriver(t *testing.T) {
	_, err := cuda.Open(cuda.WithLibrary(filepath.Join(t.TempDir(), "libcuda.so.1")))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cannot load the CUDA driver library")

	// The default library: on a machine without a GPU, the same clear error.
	if d, err := cuda.Open(); err == nil {
		d.Close()
	} else {
		assert.Contains(t, err.Error(), "cuda: ")
	}
}

// TestOpenMissingSymbol: a library that lacks an entry point (a driver too
// old) is refused by name.
func TestOpenMissingSymbol(t *testing.T) {
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("cuda: gcc not found, skipping")
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "old.c")
	require.NoError(t, os.WriteFile(src, []byte("int cuInit(unsigned f) { return 0; }\n"), 0o600))
	lib := filepath.Join(dir, "libold.so")
	out, err := exec.Command(gcc, "-shared", "-fPIC", "-o", lib, src).CombinedOutput()
	require.NoError(t, err, "%s", out)
	_, err = cuda.Open(cuda.WithLibrary(lib))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "lacks cuDriverGetVersion")
}

func TestOpenFailures(t *testing.T) {
	s := buildStub(t)
	defer s.mode(stubOK, 0)
	for _, tc := range []struct {
		mode int
		want string
	}{
		{stubNoDevice, "no CUDA-capable device"},
		{stubOldDriver, "the driver supports CUDA 10.2; the embedded PTX (ISA 7.0) needs CUDA 11.0"},
		{stubRejectPTX, "cannot load the embedded PTX"},
		{stubOldGPU, "compute capability 7.0; the kernels need 8.0"},
	} {
		s.mode(tc.mode, 0)
		_, err := cuda.Open(cuda.WithLibrary(s.path), cuda.WithOrdinal(0))
		require.Error(t, err, "mode %d", tc.mode)
		assert.Contains(t, err.Error(), tc.want)
	}
	s.mode(stubRejectPTX, 0)
	_, err := cuda.Open(cuda.WithLibrary(s.path), cuda.WithOrdinal(0))
	var ce *cuda.Error
	require.ErrorAs(t, err, &ce)
	assert.Equal(t, 222, ce.Code)
	assert.Contains(t, err.Error(), "CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
	assert.Zero(t, s.memUsed(), "a failed Open frees what it allocated")

	s.mode(stubOK, 0)
	_, err = cuda.Open(cuda.WithLibrary(s.path), cuda.WithOrdinal(5))
	assert.ErrorContains(t, err, "device 5 requested (local rank or WithOrdinal) but 2 CUDA devices are visible")
	t.Setenv(cuda.LocalRankEnv, "x")
	_, err = cuda.Open(cuda.WithLibrary(s.path))
	assert.ErrorContains(t, err, "is not a local rank")
	t.Setenv(cuda.LocalRankEnv, "1")
	d, err := cuda.Open(cuda.WithLibrary(s.path))
	require.NoError(t, err)
	assert.Equal(t, 1, d.Info().Ordinal)
	assert.Equal(t, "0000:02:00.0", d.Info().PCIBusID)
	require.NoError(t, d.Close())
}

func openStub(t *testing.T, s *stub) *cuda.Device {
	t.Helper()
	s.mode(stubOK, 0)
	d, err := cuda.Open(cuda.WithLibrary(s.path), cuda.WithOrdinal(0))
	require.NoError(t, err)
	t.Cleanup(func() { d.Close() })
	return d
}

// TestStubKernels drives every kernel launch through the stand-in driver,
// which runs C versions of the kernels on host memory: the parameters the
// package passes (pointers, offsets, lengths, scales, grid) must give the
// CPU device's results.
func TestStubKernels(t *testing.T) {
	s := buildStub(t)
	d := openStub(t, s)
	before := s.launches()
	acceltest.Run(t, d, false)
	assert.Greater(t, s.launches(), before)
	assert.Equal(t, "cuda:0 Stub GPU", d.Name())
	assert.NotEmpty(t, d.Info().MemorySource)
}

func TestStubBadInput(t *testing.T) {
	s := buildStub(t)
	d := openStub(t, s)
	b, err := d.Alloc(64)
	require.NoError(t, err)
	zero := make([]byte, 64)
	got := make([]byte, 64)
	require.NoError(t, d.CopyOut(got, accel.Whole(b)))
	assert.Equal(t, zero, got, "Alloc returns zeroed memory")

	packed, err := d.Alloc(3)
	require.NoError(t, err)
	assert.ErrorContains(t, d.CopyIn(accel.Whole(b), make([]byte, 65)), "copy-in of 65 bytes into a 64-byte span")
	assert.ErrorContains(t, d.CopyOut(make([]byte, 4), accel.Span{Buf: b, Off: 62, Len: 4}), "out of a 64-byte buffer")
	assert.ErrorContains(t, d.UnpackScale(accel.Whole(b), accel.Whole(packed), 1), "packed span of 3 bytes for 16 elements")
	assert.ErrorContains(t, d.UnpackScale(accel.Span{Buf: b, Off: 2, Len: 8}, accel.Whole(packed), 1), "not whole float32")
	_, err = d.Compress(accel.Whole(packed), accel.Floats(b, 0, 8), accel.Whole(b))
	assert.ErrorContains(t, err, "longer than the residual")
	cpuBuf, err := accel.NewCPU().Alloc(64)
	require.NoError(t, err)
	assert.ErrorContains(t, d.Zero(accel.Whole(cpuBuf)), "not of a cuda buffer")
	_, err = d.Alloc(-1)
	assert.Error(t, err)

	// Out of device memory: a clear error, and the device still works.
	s.mode(stubOK, s.memUsed()+1000)
	_, err = d.Alloc(4096)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "out of device memory allocating 4096 bytes")
	var ce *cuda.Error
	require.ErrorAs(t, err, &ce)
	assert.True(t, ce.IsOutOfMemory())
	s.mode(stubOK, 0)
	require.NoError(t, d.Zero(accel.Whole(b)))

	// Freed buffers and a closed device.
	require.NoError(t, b.Free())
	require.NoError(t, b.Free())
	assert.ErrorIs(t, d.Zero(accel.Whole(b)), accel.ErrFreed)
	require.NoError(t, d.Close())
	assert.ErrorIs(t, d.Zero(accel.Whole(packed)), accel.ErrFreed)
	_, err = d.Alloc(8)
	assert.ErrorIs(t, err, accel.ErrFreed)
	require.NoError(t, d.Close())
	assert.Zero(t, s.memUsed(), "Close frees every buffer")
}

// TestStubHostMemory: AllocHost returns zeroed page-locked memory that
// the copies move, Free returns it (a second Free is a no-op), Close frees
// what is left, and a DeviceState stages through such memory and frees it
// at its Close.
func TestStubHostMemory(t *testing.T) {
	s := buildStub(t)
	d := openStub(t, s)
	h, err := d.AllocHost(1000)
	require.NoError(t, err)
	assert.Equal(t, make([]byte, 1000), h.Bytes())
	assert.EqualValues(t, 1000, s.hostUsed())
	for i := range h.Bytes() {
		h.Bytes()[i] = byte(i)
	}
	b, err := d.Alloc(1000)
	require.NoError(t, err)
	require.NoError(t, d.CopyIn(accel.Whole(b), h.Bytes()))
	back, err := d.AllocHost(1000)
	require.NoError(t, err)
	require.NoError(t, d.CopyOut(back.Bytes(), accel.Whole(b)))
	assert.Equal(t, h.Bytes(), back.Bytes())
	require.NoError(t, h.Free())
	require.NoError(t, h.Free())
	assert.Nil(t, h.Bytes())
	assert.EqualValues(t, 1000, s.hostUsed())
	_, err = d.AllocHost(-1)
	assert.Error(t, err)

	st, err := onebit.NewDeviceState(d, 10_000, 4)
	require.NoError(t, err)
	assert.Greater(t, s.hostUsed(), int64(1000), "the state stages through page-locked memory")
	require.NoError(t, st.Close())
	assert.EqualValues(t, 1000, s.hostUsed())

	require.NoError(t, d.Close())
	assert.Zero(t, s.hostUsed(), "Close frees page-locked memory that was not freed")
	require.NoError(t, back.Free())
	_, err = d.AllocHost(8)
	assert.ErrorIs(t, err, accel.ErrFreed)
}

// TestStubAllocs: the device's operations allocate nothing (the driver's
// arguments live in memory the device keeps), so that a training step on
// the device path allocates nothing in the device.
func TestStubAllocs(t *testing.T) {
	s := buildStub(t)
	d := openStub(t, s)
	b, err := d.Alloc(4 * 1024)
	require.NoError(t, err)
	p, err := d.Alloc(4 * 128)
	require.NoError(t, err)
	x, packed := accel.Floats(b, 0, 512), accel.Span{Buf: p, Len: 64}
	h, err := d.AllocHost(64)
	require.NoError(t, err)
	host := make([]byte, 64)
	for name, op := range map[string]func() error{
		"Zero":               func() error { return d.Zero(x) },
		"CopyIn":             func() error { return d.CopyIn(packed, host) },
		"CopyIn page-locked": func() error { return d.CopyIn(packed, h.Bytes()) },
		"CopyOut":            func() error { return d.CopyOut(host, packed) },
		"CopyOutRows":        func() error { return d.CopyOutRows(host, 16, packed, 16, 8, 4) },
		"CopyInRows":         func() error { return d.CopyInRows(packed, 16, host, 16, 8, 4) },
		"Copy":               func() error { return d.Copy(accel.Floats(b, 512, 16), accel.Floats(b, 0, 16)) },
		"UnpackScale":        func() error { return d.UnpackScale(x, packed, 1) },
		"CompressCarried":    func() error { _, err := d.CompressCarried(packed, x, 0.5, x); return err },
		"Synchronize":        d.Synchronize,
	} {
		require.NoError(t, op(), name)
		assert.Zero(t, testing.AllocsPerRun(20, func() { op() }), "%s allocates", name)
	}
}

// TestStubAllReduce runs onebit.AllReduceDevice through the stand-in
// driver on 3 ranks against onebit.AllReduce: identical signs (so
// outputs equal to the float tolerance of the scales) and errors within
// the spec's tolerance.
func TestStubAllReduce(t *testing.T) {
	s := buildStub(t)
	s.mode(stubOK, 0)
	checkAllReduce(t, 3, 1001, func() (accel.Device, error) {
		return cuda.Open(cuda.WithLibrary(s.path), cuda.WithOrdinal(0))
	})
}

func checkAllReduce(t *testing.T, w, n int, open func() (accel.Device, error)) {
	ctx := context.Background()
	err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		dev, err := open()
		if err != nil {
			return err
		}
		defer dev.Close()
		host, err := onebit.NewState(n, w)
		if err != nil {
			return err
		}
		st, err := onebit.NewDeviceState(dev, n, w)
		if err != nil {
			return err
		}
		b, err := dev.Alloc(4 * n)
		if err != nil {
			return err
		}
		rng := rand.New(rand.NewPCG(7, uint64(c.Rank())))
		worker := make([]float32, len(host.WorkerError))
		server := make([]float32, len(host.ServerError))
		for k := 0; k < 3; k++ {
			in := randn(rng, n)
			want := append([]float32(nil), in...)
			if err := onebit.AllReduce(ctx, c, want, host); err != nil {
				return err
			}
			if err := dev.CopyIn(accel.Whole(b), f32bytes(in)); err != nil {
				return err
			}
			if err := onebit.AllReduceDevice(ctx, c, accel.Whole(b), st); err != nil {
				return err
			}
			got := make([]float32, n)
			if err := dev.CopyOut(f32bytes(got), accel.Whole(b)); err != nil {
				return err
			}
			if err := st.Errors(worker, server); err != nil {
				return err
			}
			for i := range want {
				if math.Signbit(float64(want[i])) != math.Signbit(float64(got[i])) {
					return fmt.Errorf("rank %d step %d: output[%d] = %g, host %g: signs differ", c.Rank(), k, i, got[i], want[i])
				}
			}
			for _, cmp := range []struct {
				what      string
				want, got []float32
			}{{"output", want, got}, {"worker error", host.WorkerError, worker}, {"server error", host.ServerError, server}} {
				if err := acceltest.Compare(fmt.Sprintf("rank %d step %d %s", c.Rank(), k, cmp.what), cmp.want, cmp.got, false); err != nil {
					return err
				}
			}
		}
		return st.Close()
	})
	require.NoError(t, err)
}

// openGPU opens the real driver or skips the test with one line.
func openGPU(t testing.TB) *cuda.Device {
	t.Helper()
	d, err := cuda.Open()
	if err != nil {
		t.Skipf("cuda: no usable GPU, skipping: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// TestGPUKernels checks the PTX kernels on a real GPU against the CPU
// device.
func TestGPUKernels(t *testing.T) {
	d := openGPU(t)
	t.Logf("%s: compute capability %d.%d, %d SMs, driver %d, memory from %s",
		d.Name(), d.Info().Major, d.Info().Minor, d.Info().SMs, d.Info().DriverVersion, d.Info().MemorySource)
	acceltest.Run(t, d, false)
}

// TestGPUAllReduce runs the device allreduce on a real GPU (every rank on
// the same device) against the host one.
func TestGPUAllReduce(t *testing.T) {
	openGPU(t)
	for _, w := range []int{1, 3, 4} {
		checkAllReduce(t, w, 100_003, func() (accel.Device, error) { return cuda.Open() })
	}
}

// TestGPUOutOfMemory: asking for more than the GPU has is an error, and
// the device keeps working.
func TestGPUOutOfMemory(t *testing.T) {
	d := openGPU(t)
	_, err := d.Alloc(int(d.Info().TotalMemory) + 1<<30)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "out of device memory")
	b, err := d.Alloc(4096)
	require.NoError(t, err)
	require.NoError(t, b.Free())
}

func TestDevices(t *testing.T) {
	gpus, err := cuda.Devices()
	if err != nil {
		t.Skipf("cuda: no NVML, skipping: %v", err)
	}
	for _, g := range gpus {
		assert.NotEmpty(t, g.PCIBusID)
	}
}

// TestGPUConformance replays the onebit conformance vectors through
// onebit.AllReduceDevice on the GPU (every rank on the same device):
// outputs and both error buffers within the spec's tolerance of the
// independent reference.
func TestGPUConformance(t *testing.T) {
	openGPU(t)
	checkConformance(t, func() (accel.Device, error) { return cuda.Open() })
}

// TestStubConformance runs the conformance vectors through the kernel
// source on the stand-in driver.
func TestStubConformance(t *testing.T) {
	s := buildStub(t)
	s.mode(stubOK, 0)
	checkConformance(t, func() (accel.Device, error) {
		return cuda.Open(cuda.WithLibrary(s.path), cuda.WithOrdinal(0))
	})
}

// checkConformance runs every onebit conformance vector with
// onebit.AllReduceDevice on the devices open gives, one per rank.
func checkConformance(t *testing.T, open func() (accel.Device, error)) {
	// The test runs in the package folder (also a copied test binary, run
	// from accel/cuda of a checkout).
	cases, err := conformance.Load(filepath.Join("..", "..", "internal", "conformance", "testdata"))
	require.NoError(t, err)
	ran := 0
	for _, cs := range cases {
		if cs.Kind != "onebit" {
			continue
		}
		ran++
		t.Run(cs.Name, func(t *testing.T) {
			err := local.Run(context.Background(), cs.World, func(ctx context.Context, c comm.Comm) error {
				r := c.Rank()
				dev, err := open()
				if err != nil {
					return err
				}
				defer dev.Close()
				st, err := onebit.NewDeviceState(dev, cs.Numel, cs.World)
				if err != nil {
					return err
				}
				b, err := dev.Alloc(4 * cs.Numel)
				if err != nil {
					return err
				}
				worker := make([]float32, st.WorkerError().Elems())
				server := make([]float32, st.ServerError().Elems())
				for k, step := range cs.Steps {
					if err := dev.CopyIn(accel.Whole(b), f32bytes(conformance.Floats(step.Inputs[r]))); err != nil {
						return err
					}
					if err := onebit.AllReduceDevice(ctx, c, accel.Whole(b), st); err != nil {
						return fmt.Errorf("step %d: %w", k, err)
					}
					out := make([]float32, cs.Numel)
					if err := dev.CopyOut(f32bytes(out), accel.Whole(b)); err != nil {
						return err
					}
					if err := st.Errors(worker, server); err != nil {
						return err
					}
					for _, cmp := range []struct {
						what string
						got  []float32
						want []conformance.Float
					}{{"output", out, step.Output}, {"worker error", worker, step.WorkerError[r]}, {"server error", server, step.ServerError[r]}} {
						if err := conformance.CompareFloats(fmt.Sprintf("rank %d step %d %s", r, k, cmp.what), cmp.got, cmp.want); err != nil {
							return err
						}
					}
				}
				return st.Close()
			})
			require.NoError(t, err)
		})
	}
	require.GreaterOrEqual(t, ran, 5, "every onebit vector must run")
}
