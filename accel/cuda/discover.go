package cuda

// GPU is one NVIDIA GPU as NVML reports it.
type GPU struct {
	Index       int    // NVML index (PCI order; CUDA's order may differ)
	Name        string //
	PCIBusID    string // e.g. "00000000:1B:00.0"
	TotalMemory uint64 // bytes
	FreeMemory  uint64 // bytes
}

// Devices lists the machine's NVIDIA GPUs through NVML (libnvidia-ml,
// loaded at run time). It needs a cgo build; without cgo, or without the
// NVIDIA driver, it returns an error and no GPUs.
func Devices() ([]GPU, error) { return nvmlDevices() }
