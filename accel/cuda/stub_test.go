package cuda_test

import (
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/ebitengine/purego"
	"github.com/stretchr/testify/require"
)

// stub is the stand-in driver library (testdata/libcuda_stub.c), built
// with gcc into the test's temporary folder.
type stub struct {
	path   string
	set    uintptr // void stub_cuda_set(int mode, long long mem_limit)
	launch uintptr // int stub_cuda_launches(void)
	used   uintptr // long long stub_cuda_mem_used(void)
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
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skip("cuda: gcc not found, skipping the tests that need the stand-in libcuda")
	}
	path := filepath.Join(t.TempDir(), "libcuda_stub.so")
	out, err := exec.Command(gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", path,
		filepath.Join("testdata", "libcuda_stub.c"), "-lm").CombinedOutput()
	require.NoError(t, err, "building the stand-in libcuda: %s", out)
	lib, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	require.NoError(t, err)
	s := &stub{path: path}
	for name, fn := range map[string]*uintptr{"stub_cuda_set": &s.set, "stub_cuda_launches": &s.launch, "stub_cuda_mem_used": &s.used} {
		*fn, err = purego.Dlsym(lib, name)
		require.NoError(t, err)
	}
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
