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

// The same compression with the residual carried: the buffer keeps x (the
// value that was packed) and the caller keeps the scale, which the next
// call takes as prevScale; Residuals turns x into the residual Compress
// would have left (errorfeedback.Residual.Compress gives the same scales
// and residuals). Two steps of the same input.
func ExampleResiduals() {
	var dev accel.Device = accel.NewCPU()
	defer dev.Close()

	input := []float32{0.5, -2, 1, -0.25, 3, 0, -1, 0.75, 2}
	carried, _ := dev.Alloc(4 * 16) // x, zero at the start (prevScale 0)
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
	var scale float32
	for step := range 2 {
		var err error
		scale, err = dev.CompressCarried(accel.Whole(packed), accel.Whole(carried), scale, accel.Whole(in))
		if err != nil {
			fmt.Println(err)
			return
		}
		fmt.Printf("step %d: scale %.4f\n", step, scale)
	}
	x := make([]byte, 4*16)
	if err := dev.CopyOut(x, accel.Whole(carried)); err != nil {
		fmt.Println(err)
		return
	}
	residual := make([]float32, 16)
	for i := range residual {
		residual[i] = math.Float32frombits(binary.LittleEndian.Uint32(x[4*i:]))
	}
	accel.Residuals(residual, scale)
	fmt.Printf("residual[:3] %.4f\n", residual[:3])
	// Output:
	// step 0: scale 1.1145
	// step 1: scale 1.8125
	// residual[:3] [1.6980 -1.0729 -0.9271]
}
