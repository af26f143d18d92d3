package conformance

import (
	"context"
	"fmt"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/signpack"
)

// RunSignpack checks a signpack case: packing the input gives the packed
// bytes exactly, and unpacking them gives the signs of the input.
func RunSignpack(c *Case) error {
	in := Floats(c.Input)
	if len(c.Packed) != signpack.PackedLen(len(in)) {
		return fmt.Errorf("case has %d packed bytes for %d inputs", len(c.Packed), len(in))
	}
	got := make([]byte, len(c.Packed))
	signpack.Pack(got, in)
	for i, b := range c.Packed {
		if int(got[i]) != b {
			return fmt.Errorf("packed[%d] = %#02x, want %#02x", i, got[i], b)
		}
	}
	signs := make([]float32, len(in))
	signpack.Unpack(signs, got)
	for i, v := range in {
		want := float32(1)
		if v < 0 {
			want = -1
		}
		if signs[i] != want {
			return fmt.Errorf("unpacked[%d] = %g, want %g (input %g)", i, signs[i], want, v)
		}
	}
	return nil
}

// RunOnebitRank replays an onebit trace as rank cm.Rank() of cm, whose size
// must be the case's world: every step's output and this rank's error
// buffers after the step must match the trace. Every rank of cm must call
// it together.
func RunOnebitRank(ctx context.Context, cm comm.Comm, c *Case) error {
	if cm.Size() != c.World {
		return fmt.Errorf("case needs %d ranks, communicator has %d", c.World, cm.Size())
	}
	if p := onebit.PaddedLen(c.Numel, c.World); p != c.Padded {
		return fmt.Errorf("padded length %d, want %d", p, c.Padded)
	}
	r := cm.Rank()
	st, err := onebit.NewState(c.Numel, c.World)
	if err != nil {
		return err
	}
	buf := make([]float32, c.Numel)
	for k, step := range c.Steps {
		if len(step.Inputs) != c.World {
			return fmt.Errorf("step %d: %d inputs for %d ranks", k, len(step.Inputs), c.World)
		}
		copy(buf, Floats(step.Inputs[r]))
		if err := onebit.AllReduce(ctx, cm, buf, st); err != nil {
			return fmt.Errorf("step %d: %w", k, err)
		}
		if err := CompareFloats(fmt.Sprintf("step %d: output", k), buf, step.Output); err != nil {
			return err
		}
		if err := CompareFloats(fmt.Sprintf("step %d: rank %d worker_error", k, r), st.WorkerError, step.WorkerError[r]); err != nil {
			return err
		}
		if err := CompareFloats(fmt.Sprintf("step %d: rank %d server_error", k, r), st.ServerError, step.ServerError[r]); err != nil {
			return err
		}
	}
	return nil
}
