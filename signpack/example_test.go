package signpack_test

import (
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/signpack"
)

func ExamplePack() {
	x := []float32{0.5, -1, 0, float32(math.Copysign(0, -1)), float32(math.NaN()), -3, 2, -0.25, 7, -7}
	packed := make([]byte, signpack.PackedLen(len(x)))
	signpack.Pack(packed, x)
	fmt.Printf("%08b\n", packed)

	signs := make([]float32, len(x))
	signpack.UnpackScale(signs, packed, 0.5)
	fmt.Println(signs)
	// Output:
	// [10111010 10000000]
	// [0.5 -0.5 0.5 0.5 0.5 -0.5 0.5 -0.5 0.5 -0.5]
}

func ExamplePackResidual() {
	x := []float32{1.5, -0.25, 0.75, -2}
	packed := make([]byte, signpack.PackedLen(len(x)))
	signpack.PackResidual(packed, x, 1)
	fmt.Printf("%08b %v\n", packed[0], x)
	// Output:
	// 10100000 [0.5 0.75 -0.25 -1]
}
