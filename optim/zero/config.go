package zero

import (
	"fmt"

	"github.com/lowbit-ml/lowbit/optim"
)

// Reduce selects how Step reduce-scatters the gradients (Config.ReduceScatter).
type Reduce int

// The reduce-scatter modes.
const (
	// ReduceFP32 reduce-scatters the flat float32 gradient buffer with an
	// exact comm.Comm.ReduceScatter (comm.Mean): rank r owns the contiguous
	// chunk r of the flat, padded buffer. The default.
	ReduceFP32 Reduce = iota
	// ReduceCoalesced reduce-scatters every parameter at once with
	// quant.Coalesced (exact float32, one call): rank r owns chunk r of each
	// tensor. It needs one flat buffer as large as the model (see
	// Adam.StateFloats).
	ReduceCoalesced
	// ReduceInt8 reduce-scatters the flat buffer with the hierarchical
	// quantized qgZ reduce-scatter of package quant, int8 codes on the wire.
	ReduceInt8
	// ReduceInt4 is ReduceInt8 with int4 codes.
	ReduceInt4
)

var reduceNames = [...]string{"fp32", "coalesced", "int8", "int4"}

// String returns the mode's name: "fp32", "coalesced", "int8" or "int4".
func (r Reduce) String() string {
	if r >= 0 && int(r) < len(reduceNames) {
		return reduceNames[r]
	}
	return fmt.Sprintf("Reduce(%d)", int(r))
}

// Valid reports whether r is one of the defined modes.
func (r Reduce) Valid() bool { return r >= 0 && int(r) < len(reduceNames) }

// ParseReduce returns the mode called s (see Reduce.String).
func ParseReduce(s string) (Reduce, error) {
	for i, n := range reduceNames {
		if s == n {
			return Reduce(i), nil
		}
	}
	return 0, fmt.Errorf("zero: unknown reduce mode %q (want fp32, coalesced, int8 or int4)", s)
}

// quantized reports whether r uses the qgZ reduce-scatter.
func (r Reduce) quantized() bool { return r == ReduceInt8 || r == ReduceInt4 }

// bits is the code width of a quantized mode.
func (r Reduce) bits() int {
	if r == ReduceInt4 {
		return 4
	}
	return 8
}

// Config holds the hyper-parameters of sharded Adam and how it
// communicates. Start from DefaultConfig.
type Config struct {
	// AdamConfig holds lr, betas, eps, weight decay (decoupled, AdamW
	// style) and bias correction, with optim's defaults. Its RanksPerNode
	// lays the ranks out node-major for the int8 and int4 modes (see
	// comm.NewLayout; 0 asks the communicator). Its Reduce, the allreduce
	// mode of the exact optimizers, must stay optim.ReduceFP32 (the zero
	// value): sharded Adam reduce-scatters, as ReduceScatter says.
	optim.AdamConfig
	// ReduceScatter is the gradient reduce-scatter. Default ReduceFP32.
	ReduceScatter Reduce
	// BucketSize bounds the number of gradient elements one reduce-scatter
	// call takes in the modes with a flat buffer (fp32, int8, int4), and the
	// parameter elements one all-gather call returns in every mode: Step
	// stages the data bucket by bucket, W slices of at most BucketSize/W
	// elements each, instead of copying the whole model into one flat
	// buffer. Every rank must use the same value. Default 0: buckets whose
	// staging and work buffers hold about as many float32s as one moment
	// of this rank, so that the optimizer's memory stays about three of its
	// 1/W shares of the moments (see Adam.StateFloats), at the price of
	// about W+1 (fp32) or W+Nodes+2 (int8, int4) calls of each collective
	// per step. Larger buckets mean fewer, larger calls.
	BucketSize int
	// GroupSize is the quantization group of the int8 and int4 modes (0:
	// the default of package quant). Ignored by the other modes.
	GroupSize int
}

// DefaultConfig returns optim.DefaultAdamConfig with the exact float32
// reduce-scatter and the default bucket.
func DefaultConfig() Config {
	return Config{AdamConfig: optim.DefaultAdamConfig()}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	if err := c.AdamConfig.Validate(); err != nil {
		return err
	}
	if c.AdamConfig.Reduce != optim.ReduceFP32 {
		return fmt.Errorf("zero: AdamConfig.Reduce is %v, but sharded Adam has no allreduce: choose the gradient reduce-scatter with Config.ReduceScatter", c.AdamConfig.Reduce)
	}
	if !c.ReduceScatter.Valid() {
		return fmt.Errorf("zero: invalid reduce-scatter mode %v", c.ReduceScatter)
	}
	if c.BucketSize < 0 {
		return fmt.Errorf("zero: bucket size %d must be >= 0", c.BucketSize)
	}
	if c.GroupSize < 0 {
		return fmt.Errorf("zero: group size %d must be >= 0", c.GroupSize)
	}
	return nil
}
