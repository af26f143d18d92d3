package quant_test

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/quant"
)

// Narrowing rounds to the nearest 16-bit value; widening is exact.
// Overflow is counted, not silent.
func ExampleNarrow() {
	src := []float32{1, 0.1, 65504, 70000}
	h := make([]uint16, len(src))
	overflow := quant.Narrow(quant.FP16, h, src)
	back := make([]float32, len(h))
	quant.Widen(quant.FP16, back, h)
	fmt.Printf("%#04x\n%v\noverflow: %d\n", h, back, overflow)
	// Output:
	// [0x3c00 0x2e66 0x7bff 0x7c00]
	// [1 0.099975586 65504 +Inf]
	// overflow: 1
}

// Four ranks average a buffer with fp16 on the wire.
func ExampleDownCast() {
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
		d := quant.NewDownCast(quant.FP16)
		buf := []float32{float32(c.Rank()), 1.0 / 3, 1000}
		if err := d.AllReduce(ctx, c, buf); err != nil {
			return err
		}
		if c.Rank() == 0 {
			fmt.Println(buf, d.Stats().Calls)
		}
		return nil
	})
	fmt.Println(err)
	// Output:
	// [1.5 0.33325195 1000] 1
	// <nil>
}

// Two "machines" of two ranks each average a buffer; each rank sends a
// quarter of it across machines in each direction's half.
func ExampleTwoLevel() {
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
		l, err := comm.NewLayout(ctx, c, 2) // 2 ranks per machine
		if err != nil {
			return err
		}
		defer l.Close()
		t, err := quant.NewTwoLevel(l)
		if err != nil {
			return err
		}
		buf := []float32{float32(c.Rank()), 1, 2, 3, 4, 5, 6, 7}
		if err := t.AllReduce(ctx, buf); err != nil {
			return err
		}
		if c.Rank() == 0 {
			fmt.Println(l, buf, t.Stats().InterBytes)
		}
		return nil
	})
	fmt.Println(err)
	// Output:
	// 2 nodes x 2 ranks [1.5 1 2 3 4 5 6 7] 16
	// <nil>
}
