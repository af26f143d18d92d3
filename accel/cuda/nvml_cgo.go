//go:build cgo

package cuda

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// nvmlMemory returns the free and total memory of the GPU at PCI bus id
// busID from NVML (libnvidia-ml, loaded at run time by go-nvml).
func nvmlMemory(busID string) (free, total uint64, err error) {
	if ret := nvml.Init(); ret != nvml.SUCCESS {
		return 0, 0, fmt.Errorf("cuda: nvml: %s", nvml.ErrorString(ret))
	}
	defer nvml.Shutdown()
	dev, ret := nvml.DeviceGetHandleByPciBusId(busID)
	if ret != nvml.SUCCESS {
		return 0, 0, fmt.Errorf("cuda: nvml: device %s: %s", busID, nvml.ErrorString(ret))
	}
	mem, ret := dev.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return 0, 0, fmt.Errorf("cuda: nvml: memory of %s: %s", busID, nvml.ErrorString(ret))
	}
	return mem.Free, mem.Total, nil
}

// nvmlDevices lists the GPUs NVML sees.
func nvmlDevices() ([]GPU, error) {
	if ret := nvml.Init(); ret != nvml.SUCCESS {
		return nil, fmt.Errorf("cuda: nvml: %s", nvml.ErrorString(ret))
	}
	defer nvml.Shutdown()
	n, ret := nvml.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("cuda: nvml: %s", nvml.ErrorString(ret))
	}
	gpus := make([]GPU, 0, n)
	for i := 0; i < n; i++ {
		dev, ret := nvml.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("cuda: nvml: device %d: %s", i, nvml.ErrorString(ret))
		}
		g := GPU{Index: i}
		g.Name, _ = dev.GetName()
		if pci, ret := dev.GetPciInfo(); ret == nvml.SUCCESS {
			g.PCIBusID = pciString(pci.BusIdLegacy[:])
			if id := pciString(pci.BusId[:]); id != "" {
				g.PCIBusID = id
			}
		}
		if mem, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
			g.TotalMemory, g.FreeMemory = mem.Total, mem.Free
		}
		gpus = append(gpus, g)
	}
	return gpus, nil
}

func pciString[T ~int8 | ~uint8](b []T) string {
	s := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}
