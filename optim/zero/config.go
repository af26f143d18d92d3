package zero

import (
	"errors"
	"fmt"
	"strings"

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
	// ReduceScatter is the gradient reduce-scatter, one of the Reduce
	// modes. Default ReduceFP32.
	ReduceScatter Reduce
	// BucketBytes is the bucket size, in the convention of
	// optim.DefaultBucketBytes: the gradients, laid end to end as one flat
	// buffer, are reduce-scattered BucketBytes bytes (BucketBytes/4
	// elements, W slices of BucketBytes/(4W)) per call in the modes with a
	// flat buffer (fp32, int8, int4), and the parameters are all-gathered
	// as many bytes per call in every mode. Step stages the data bucket by
	// bucket instead of copying the whole model into one flat buffer, so
	// the staging buffers hold about BucketBytes (the W slices) plus
	// BucketBytes/W (this rank's chunk), and the int8 and int4 modes add
	// (Nodes+1)*BucketBytes/W of work buffers: memory beyond this rank's
	// 1/W share of the moments stays under about 1.5*BucketBytes whatever
	// the model's size, at the price of one call of each collective per
	// bucket (at least one per step). 0 means optim.DefaultBucketBytes
	// (25 MiB); otherwise at least 4 (optim.PerParameter is refused: the
	// buckets of sharded Adam cut across parameters). Every rank must use
	// the same value.
	BucketBytes int
	// GroupSize is the quantization group of the int8 and int4 modes (0:
	// the default of package quant); >= 0. Ignored by the other modes.
	GroupSize int
}

// DefaultConfig returns optim.DefaultAdamConfig with the exact float32
// reduce-scatter and the default bucket.
func DefaultConfig() Config {
	return Config{AdamConfig: optim.DefaultAdamConfig()}
}

// Validate reports the first invalid field as an *optim.ConfigError:
// those of optim.AdamConfig.Validate, MomentsBF16 set, a Reduce other than
// optim.ReduceFP32, an unknown ReduceScatter, a BucketBytes other than 0
// or at least 4, or a negative GroupSize. NewAdam returns exactly this
// error (on every rank, see NewAdam).
func (c Config) Validate() error {
	const cfg = "zero.Config"
	if err := c.AdamConfig.Validate(); err != nil {
		var ce *optim.ConfigError
		if errors.As(err, &ce) {
			relabelled := *ce
			relabelled.Config = cfg
			return &relabelled
		}
		return err
	}
	bad := func(field string, v any, want string) error {
		return &optim.ConfigError{Config: cfg, Field: field, Value: v, Want: want}
	}
	if err := c.RefuseMomentsBF16(cfg); err != nil {
		return err
	}
	switch {
	case c.AdamConfig.Reduce != optim.ReduceFP32:
		return bad("Reduce", c.AdamConfig.Reduce, "fp32 (sharded Adam has no allreduce: choose the gradient reduce-scatter with ReduceScatter)")
	case !c.ReduceScatter.Valid():
		return bad("ReduceScatter", c.ReduceScatter, "one of "+strings.Join(reduceNames[:], ", "))
	case c.BucketBytes != 0 && c.BucketBytes < 4:
		return bad("BucketBytes", c.BucketBytes, fmt.Sprintf("0 (optim.DefaultBucketBytes, %d) or at least 4", optim.DefaultBucketBytes))
	case c.GroupSize < 0:
		return bad("GroupSize", c.GroupSize, ">= 0 (0 for quant's default)")
	}
	return nil
}
