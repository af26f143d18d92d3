package outer_test

import (
	"context"
	"fmt"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// liveHeap is the live heap after a collection.
func liveHeap() int64 {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// memCase is one row of TestMemoryPerParameter, with the most bytes per
// parameter it may hold beyond the parameters and gradients (inner AdamW
// included), by StateBytes and by the heap.
type memCase struct {
	codec       outer.Codec
	frags       int
	delay       int
	state, heap float64
	accBF16     bool // Config.AccumulatorBF16
	momentsBF16 bool // the inner AdamW's optim.AdamConfig.MomentsBF16
	// exchange is the sparse codec's (Config.SparseExchange).
	exchange outer.SparseExchange
}

// memMeasure builds the outer optimizer of cfg on w ranks of comm/local
// over n parameter elements per rank, runs H calls (every fragment
// exchanges once) and returns rank 0's StateBytes and the growth of the
// live heap since the parameters were made, divided by w, both per
// parameter. inner is the inner AdamW's config.
func memMeasure(t *testing.T, w, n int, cfg outer.Config, inner optim.AdamConfig) (state, heap float64) {
	t.Helper()
	cs, err := local.New(w)
	require.NoError(t, err)
	defer func() {
		for _, c := range cs {
			c.Close()
		}
	}()
	params := make([][]*optim.Param, w)
	for r := range w {
		params[r] = newParams(t, []int{n / 2, n - n/2})
	}
	opts := make([]*outer.Optimizer, w)
	each := func(fn func(r int, c comm.Comm) error) {
		t.Helper()
		errs := make(chan error, w)
		for r := range w {
			go func() { errs <- fn(r, cs[r]) }()
		}
		for range w {
			require.NoError(t, <-errs)
		}
	}
	base := liveHeap()
	ctx := context.Background()
	each(func(r int, c comm.Comm) error {
		o, err := outer.NewAdam(ctx, c, params[r], cfg, inner)
		opts[r] = o
		return err
	})
	each(func(r int, c comm.Comm) error {
		for i := 1; i <= cfg.H; i++ {
			setGrads(params[r], r, i)
			if err := opts[r].Step(ctx); err != nil {
				return err
			}
		}
		_, err := opts[r].State() // waits for the exchange in flight
		return err
	})
	heapBytes := liveHeap() - base
	state = float64(opts[0].StateBytes()) / float64(n)
	for _, o := range opts {
		require.NoError(t, o.Close())
	}
	runtime.KeepAlive(params)
	return state, float64(heapBytes) / float64(w*n)
}

// The bytes per parameter each codec keeps at W = 8, beyond the
// parameters and gradients, inner AdamW (8) included: by StateBytes and by
// the live heap (docs/outer.md, "Memory"). Each codec at its
// DefaultConfigFor (no momentum for the 1-bit and sparse codecs; each
// row sets AccumulatorBF16 and the inner MomentsBF16 itself); the
// 1-bit codec's buckets of 16 KiB stand for the default 25 MiB on a model
// of billions of parameters (the bucket's scratch is then small beside
// the fragment).
func TestMemoryPerParameter(t *testing.T) {
	if raceOn {
		// It counts bytes (the instrumentation would count too); the
		// concurrency of its steps is the other tests'.
		t.Skip("counts memory: run without the race detector")
	}
	const w, n = 8, 1 << 16
	// Bounds: measured (StateBytes; heap) and a margin for the heap. Before
	// the buffers were cut (u with momentum 0, a fragment's exchange
	// buffer, per-bucket wire buffers) the 1-bit codec held 25.94 and 22.94
	// (F 1, 4), the sparse codec 24.56 and 21.33.
	for _, k := range []memCase{
		// fp32, bf16, int8: inner AdamW 8, θ_g 4, u 4 (momentum 0.9), the
		// fragment's exchange buffer 4 (1 of 4 with F 4), the codec's
		// wire buffers.
		{outer.CodecFP32, 1, 0, 20.1, 20.8, false, false, outer.SparseAllGather},
		{outer.CodecFP32, 4, 0, 17.1, 17.6, false, false, outer.SparseAllGather},
		{outer.CodecBF16, 1, 0, 26.6, 27.1, false, false, outer.SparseAllGather},
		{outer.CodecInt8, 1, 0, 24.2, 24.9, false, false, outer.SparseAllGather},
		{outer.CodecInt8, 4, 0, 18.1, 18.6, false, false, outer.SparseAllGather},
		// 1bit: AdamW 8, θ_g 4, the worker error 4, the server error 4/W,
		// a bucket's x and the wire buffers shared by every bucket.
		{outer.CodecOneBit, 1, 0, 17.4, 18.3, false, false, outer.SparseAllGather},
		{outer.CodecOneBit, 4, 0, 17.4, 18.3, false, false, outer.SparseAllGather},
		// With a delay, θ_local at the launch and the staged θ_g of a
		// fragment: 2 * 4/F.
		{outer.CodecOneBit, 4, 1, 19.4, 20.3, false, false, outer.SparseAllGather},
		// sparse: AdamW 8, θ_g 4, the accumulator 4, the messages
		// (W + 1 of a fragment's, about 0.034 bytes per element each) and
		// a chunk's scratch.
		{outer.CodecSparse, 1, 0, 16.6, 17, false, false, outer.SparseAllGather},
		{outer.CodecSparse, 4, 0, 16.4, 16.8, false, false, outer.SparseAllGather},
		{outer.CodecSparse, 4, 1, 18.4, 18.8, false, false, outer.SparseAllGather},
		// The accumulator in bfloat16: 2 bytes less, a chunk's float32
		// more (0.25 here, nothing on a large model).
		{outer.CodecSparse, 1, 0, 14.9, 15.2, true, false, outer.SparseAllGather},
		{outer.CodecSparse, 4, 0, 14.6, 15, true, false, outer.SparseAllGather},
		// The inner AdamW's moments in bfloat16 (optim.AdamConfig.
		// MomentsBF16): 4 bytes less. With the bfloat16 accumulator the
		// sparse codec meets the 12-byte goal (issue 51): 10.9 here,
		// about 10.6 on a large model. The 1-bit codec keeps 13.4 (its
		// float32 worker error): short of 12.
		{outer.CodecSparse, 1, 0, 10.9, 11.2, true, true, outer.SparseAllGather},
		{outer.CodecSparse, 4, 0, 10.6, 11, true, true, outer.SparseAllGather},
		{outer.CodecSparse, 1, 0, 12.6, 13, false, true, outer.SparseAllGather},
		{outer.CodecOneBit, 1, 0, 13.4, 14.3, false, true, outer.SparseAllGather},
		{outer.CodecOneBit, 4, 0, 13.4, 14.3, false, true, outer.SparseAllGather},
		// The sparse codec's two-phase exchange: the server accumulator
		// of rank 0's run, 2 of 16 chunks (4/W = 0.5), and W segments
		// sent and W received of 2 chunks' messages each (0.07) instead
		// of W + 1 messages (0.31).
		{outer.CodecSparse, 1, 0, 16.9, 17.1, false, false, outer.SparseTwoPhase},
	} {
		t.Run(fmt.Sprintf("%s/%s/F%d/D%d/bf16acc%t/bf16moments%t", k.codec, k.exchange, k.frags, k.delay, k.accBF16, k.momentsBF16), func(t *testing.T) {
			cfg := outer.DefaultConfigFor(k.codec)
			cfg.H, cfg.Fragments, cfg.Delay, cfg.AccumulatorBF16 = 4, k.frags, k.delay, k.accBF16
			cfg.SparseExchange = k.exchange
			cfg.BucketBytes = 16 << 10
			inner := innerConfig()
			inner.MomentsBF16 = k.momentsBF16
			state, heap := memMeasure(t, w, n, cfg, inner)
			t.Logf("%s F%d D%d bf16 accumulator %t, bf16 moments %t: %.2f bytes per parameter by StateBytes, %.2f by the heap",
				k.codec, k.frags, k.delay, k.accBF16, k.momentsBF16, state, heap)
			assert.LessOrEqual(t, state, k.state, "StateBytes")
			assert.LessOrEqual(t, heap, k.heap, "heap")
			if k.momentsBF16 && k.accBF16 {
				// Issue 51's goal: at most 12 bytes per parameter at W = 8.
				assert.LessOrEqual(t, state, 12.0, "StateBytes: the 12-byte goal")
				assert.LessOrEqual(t, heap, 12.0, "heap: the 12-byte goal")
			}
		})
	}
}

// Issue 51's goal at the defaults: DefaultConfigFor(CodecSparse) keeps
// the accumulator in bfloat16 and DefaultAdamConfigFor(CodecSparse) the
// inner AdamW's moments, and together they hold at most 12 bytes per
// parameter at W = 8 beyond the parameters and gradients, by StateBytes
// and by the heap. The other codecs' defaults keep float32 state.
func TestSparseDefaultsAtMostTwelveBytes(t *testing.T) {
	for _, c := range allCodecs {
		sparse := c == outer.CodecSparse
		assert.Equal(t, sparse, outer.DefaultConfigFor(c).AccumulatorBF16, "%s: AccumulatorBF16", c)
		inner := outer.DefaultAdamConfigFor(c)
		assert.Equal(t, sparse, inner.MomentsBF16, "%s: MomentsBF16", c)
		inner.MomentsBF16 = false
		assert.Equal(t, optim.DefaultAdamConfig(), inner, "%s: otherwise optim.DefaultAdamConfig", c)
	}
	assert.False(t, outer.DefaultConfig().AccumulatorBF16, "DefaultConfig: the fp32 codec's")
	if raceOn {
		t.Skip("counts memory: run without the race detector")
	}
	cfg := outer.DefaultConfigFor(outer.CodecSparse)
	cfg.H = 4 // the buffers do not depend on H: fewer steps
	state, heap := memMeasure(t, 8, 1<<16, cfg, outer.DefaultAdamConfigFor(outer.CodecSparse))
	t.Logf("sparse at its defaults: %.2f bytes per parameter by StateBytes, %.2f by the heap", state, heap)
	assert.LessOrEqual(t, state, 12.0, "StateBytes")
	assert.LessOrEqual(t, heap, 12.0, "heap")
}
