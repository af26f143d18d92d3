package npu_test

import (
	"fmt"

	"github.com/lowbit-ml/lowbit/accel/npu"
)

// Packed bytes from aclnnSignBitsPack (the documentation's example) turned
// into lowbit's wire format before they go to the communicator.
func ExampleToWire() {
	packed := []byte{159, 15} // signs of 5 4 3 2 0 -1 -2 4 | 3 2 1 0 -1 -2
	npu.ToWire(packed)
	fmt.Printf("%08b\n", packed)
	// Output: [11111001 11110000]
}
