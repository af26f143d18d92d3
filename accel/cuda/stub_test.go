package cuda_test

import (
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/ebitengine/purego"
	"github.com/stretchr/testify/require"
)

// stub is the stand-in driver library (testdata/libcuda_stub.c), built
// with g++ into the test's temporary folder together with the kernels of
// kernels/lowbit.cu, which testdata/simt.cc runs on the host, a fiber per
// GPU thread: the stand-in runs the real kernel source.
type stub struct {
	path   string
	set    uintptr // void stub_cuda_set(int mode, long long mem_limit)
	launch uintptr // int stub_cuda_launches(void)
	used   uintptr // long long stub_cuda_mem_used(void)
	host   uintptr // long long stub_cuda_host_used(void)
	// lastLaunchError is why the last failed launch failed ("" if none
	// did): const char *stub_cuda_launch_error(void).
	lastLaunchError func() string
}

// The failure modes of the stand-in.
const (
	stubOK = iota
	stubNoDevice
	stubOldDriver
	stubRejectPTX
	stubOldGPU
)

func buildStub(t *testing.T) *stub {
	t.Helper()
	gxx, err := exec.LookPath("g++")
	if err != nil {
		t.Skip("cuda: g++ not found, skipping the tests that run the kernels on the stand-in libcuda (apt-get install g++)")
	}
	path := filepath.Join(t.TempDir(), "libcuda_stub.so")
	out, err := exec.Command(gxx, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wno-unknown-pragmas",
		"-DLOWBIT_SIMT", "-Itestdata", "-Ikernels", "-o", path,
		"-x", "c", filepath.Join("testdata", "libcuda_stub.c"),
		"-x", "c++", filepath.Join("testdata", "simt.cc"), "-lm").CombinedOutput()
	require.NoError(t, err, "building the stand-in libcuda: %s", out)
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	require.NoError(t, err)
	s := &stub{path: path}
	purego.RegisterLibFunc(&s.lastLaunchError, lib, "stub_cuda_launch_error")
	for name, fn := range map[string]*uintptr{"stub_cuda_set": &s.set, "stub_cuda_launches": &s.launch, "stub_cuda_mem_used": &s.used, "stub_cuda_host_used": &s.host} {
		*fn, err = purego.Dlsym(lib, name)
		require.NoError(t, err)
	}
	t.Cleanup(func() {
		if msg := s.lastLaunchError(); msg != "" {
			t.Logf("stand-in libcuda: last failed launch: %s", msg)
		}
	})
	return s
}

func (s *stub) mode(m int, memLimit int64) { purego.SyscallN(s.set, uintptr(m), uintptr(memLimit)) }

func (s *stub) launches() int {
	r, _, _ := purego.SyscallN(s.launch)
	return int(int32(r))
}

func (s *stub) memUsed() int64 {
	r, _, _ := purego.SyscallN(s.used)
	return int64(r)
}

// hostUsed is the page-locked host memory allocated and not freed.
func (s *stub) hostUsed() int64 {
	r, _, _ := purego.SyscallN(s.host)
	return int64(r)
}
