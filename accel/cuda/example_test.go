package cuda_test

import (
	"fmt"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/accel/cuda"
)

// Open the GPU of this process's local rank, and fall back to the CPU
// device where there is none. (No Output: the result depends on the
// machine.)
func ExampleOpen() {
	var dev accel.Device
	if d, err := cuda.Open(); err == nil {
		dev = d
	} else {
		fmt.Println("no GPU:", err)
		dev = accel.NewCPU()
	}
	defer dev.Close()
	fmt.Println("running on", dev.Name())
}
