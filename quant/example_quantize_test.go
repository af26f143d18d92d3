package quant_test

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/quant"
)

func ExampleQuantize() {
	src := []float32{0.5, -1, 0.25, 0.75, 2, -2}
	const bits, group = 4, 3
	codes := make([]byte, quant.CodesLen(len(src), bits))
	scales := make([]float32, quant.NumGroups(len(src), group))
	if err := quant.Quantize(codes, scales, src, bits, group); err != nil {
		panic(err)
	}
	back := make([]float32, len(src))
	if err := quant.DequantizeAdd(back, codes, scales, bits, group); err != nil {
		panic(err)
	}
	// Codes 4 -8 2 | 3 7 -8, two per byte, first in the high nibble; 2
	// is the largest value of its group and clamps to 7*0.25.
	fmt.Printf("packed % x\nscales %v\nback   %v\n", codes, scales, back)
	// Output:
	// packed 48 23 78
	// scales [0.125 0.25]
	// back   [0.5 -1 0.25 0.75 1.75 -2]
}

func ExampleQGZ() {
	// 2 nodes of 2 ranks; rank r holds 8 values, all equal to r+1.
	err := local.Run(context.Background(), 4, func(ctx context.Context, c comm.Comm) error {
		l, err := comm.NewLayout(ctx, c, 0)
		if err != nil {
			return err
		}
		defer l.Close()
		q, err := quant.NewQGZ(ctx, l, 8, quant.QGZConfig{Bits: 8})
		if err != nil {
			return err
		}
		send := make([]float32, 8)
		for i := range send {
			send[i] = float32(c.Rank() + 1)
		}
		recv := make([]float32, q.PartLen())
		if err := q.ReduceScatter(ctx, send, recv); err != nil {
			return err
		}
		if c.Rank() == 0 {
			fmt.Printf("rank 0 owns %d values, mean %.3f (exact 2.5)\n", len(recv), recv[0])
		}
		return nil
	}, local.WithRanksPerNode(2))
	if err != nil {
		fmt.Println(err)
	}
	// Output:
	// rank 0 owns 2 values, mean 2.461 (exact 2.5)
}
