package local_test

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// Three goroutine ranks sum a value with AllReduce.
func ExampleRun() {
	sums := make([]float32, 3)
	err := local.Run(context.Background(), 3, func(ctx context.Context, c comm.Comm) error {
		buf := []float32{float32(c.Rank() + 1)}
		if err := c.AllReduce(ctx, buf, comm.Sum); err != nil {
			return err
		}
		sums[c.Rank()] = buf[0]
		return nil
	})
	fmt.Println(sums, err)
	// Output: [6 6 6] <nil>
}
