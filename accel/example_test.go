package accel_test

import (
	"encoding/binary"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/accel"
)

// One error-feedback compression step on a device: the CPU device here;
// accel/cuda's Device runs the same calls on a GPU.
func Example() {
	var dev accel.Device = accel.NewCPU()
	defer dev.Close()

	input := []float32{0.5, -2, 1, -0.25, 3, 0, -1, 0.75, 2}
	residual, _ := dev.Alloc(4 * 16) // the padded length: 16 floats, zero
	in, _ := dev.Alloc(4 * len(input))
	packed, _ := dev.Alloc(accel.PackedLen(16))

	raw := make([]byte, 4*len(input))
	for i, v := range input {
		binary.LittleEndian.PutUint32(raw[4*i:], math.Float32bits(v))
	}
	if err := dev.CopyIn(accel.Whole(in), raw); err != nil {
		fmt.Println(err)
		return
	}
	scale, err := dev.Compress(accel.Whole(packed), accel.Whole(residual), accel.Whole(in))
	if err != nil {
		fmt.Println(err)
		return
	}
	signs := make([]byte, 2)
	if err := dev.CopyOut(signs, accel.Whole(packed)); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("scale %.4f, signs %08b\n", scale, signs)
	// Output:
	// scale 1.1145, signs [10101101 11111111]
}
