//go:build !cgo

package cuda

import "errors"

// errNoNVML: go-nvml needs cgo, so a CGO_ENABLED=0 build reads memory from
// the CUDA driver instead and cannot list devices through NVML.
var errNoNVML = errors.New("cuda: NVML needs a cgo build (this one has CGO_ENABLED=0)")

func nvmlMemory(string) (free, total uint64, err error) { return 0, 0, errNoNVML }

func nvmlDevices() ([]GPU, error) { return nil, errNoNVML }
