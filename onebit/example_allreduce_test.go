package onebit_test

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
)

// Four in-process ranks average a buffer with the 1-bit compressed
// allreduce. Each rank keeps its error state between calls; every rank ends
// with the same output.
func ExampleAllReduce() {
	const ranks, n = 4, 8
	outputs := make([][]float32, ranks)
	err := local.Run(context.Background(), ranks, func(ctx context.Context, c comm.Comm) error {
		st, err := onebit.NewState(n, c.Size()) // one per tensor, reused every step
		if err != nil {
			return err
		}
		buf := make([]float32, n)
		for i := range buf {
			buf[i] = float32(c.Rank()+1) * float32(i-3)
		}
		if err := onebit.AllReduce(ctx, c, buf, st); err != nil {
			return err
		}
		outputs[c.Rank()] = buf
		return nil
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("%.3f\n", outputs[0])
	fmt.Println("same on every rank:", fmt.Sprint(outputs[0]) == fmt.Sprint(outputs[3]))
	// Output:
	// [-2.932 -2.932 -2.932 2.932 2.932 2.932 2.932 2.932]
	// same on every rank: true
}
