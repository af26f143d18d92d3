package timed_test

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/comm/timed"
)

// Each rank wraps its communicator and reads how long its collectives took.
func Example() {
	err := local.Run(context.Background(), 2, func(ctx context.Context, c comm.Comm) error {
		tc := timed.New(c)
		buf := []float32{float32(c.Rank() + 1)}
		if err := tc.AllReduce(ctx, buf, comm.Sum); err != nil {
			return err
		}
		if c.Rank() == 0 {
			fmt.Println("sum:", buf[0], "time counted:", tc.Elapsed() > 0)
		}
		return nil
	})
	fmt.Println("error:", err)
	// Output:
	// sum: 3 time counted: true
	// error: <nil>
}
