package outer_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"gorgonia.org/tensor"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

func config(codec outer.Codec, h, frags, delay int) outer.Config {
	cfg := outer.DefaultConfig()
	cfg.H, cfg.Fragments, cfg.Delay, cfg.Codec = h, frags, delay, codec
	if codec == outer.CodecSparse {
		// Chunks that fit the small tests' fragments: 2 of 4 entries.
		cfg.SparseChunk, cfg.Density = 4, 0.5
	}
	return cfg
}

func innerConfig() optim.AdamConfig {
	a := optim.DefaultAdamConfig()
	a.LR = 0.01
	return a
}

var allCodecs = []outer.Codec{outer.CodecFP32, outer.CodecBF16, outer.CodecInt8, outer.CodecOneBit, outer.CodecSparse}

// Every rank holds the same θ_g and u after every exchange, with every
// codec, with and without fragments and delay.
func TestGlobalIdenticalOnEveryRank(t *testing.T) {
	const w, calls = 3, 17
	for _, codec := range allCodecs {
		cfgs := []outer.Config{config(codec, 4, 1, 0), config(codec, 6, 3, 2)}
		if codec == outer.CodecSparse {
			cfgs = append(cfgs, twoPhase(cfgs[0]), twoPhase(cfgs[1]))
		}
		for _, cfg := range cfgs {
			t.Run(fmt.Sprintf("%s/F%d/D%d/%s", codec, cfg.Fragments, cfg.Delay, cfg.SparseExchange), func(t *testing.T) {
				globals := newPerRank[[]float32](w)
				moms := newPerRank[[]float32](w)
				stats := newPerRank[outer.OuterStats](w)
				runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
					o, err := steppedOn(ctx, c, newParams(t, []int{300, 41}), cfg, calls)
					if err != nil {
						return err
					}
					globals.set(c.Rank(), append([]float32(nil), o.Global()...))
					moms.set(c.Rank(), append([]float32(nil), o.Momentum()...))
					stats.set(c.Rank(), o.OuterStats())
					return o.Close()
				})
				for r := 1; r < w; r++ {
					require.Equal(t, globals.v[0], globals.v[r], "θ_g of rank %d", r)
					require.Equal(t, moms.v[0], moms.v[r], "u of rank %d", r)
				}
				assert.NotEqual(t, flat(newParams(t, []int{300, 41})), globals.v[0], "θ_g never moved")
				assert.Positive(t, stats.v[0].Exchanges)
			})
		}
	}
}

// Bytes each rank sends per outer step, per codec: fp32 > bf16 > int8 >
// 1bit, the 1-bit codec about 32 times less than fp32.
func TestBytesPerCodec(t *testing.T) {
	const w, h = 4, 3
	bytes := map[outer.Codec]int64{}
	for _, codec := range allCodecs {
		got := newPerRank[int64](w)
		runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
			ps := newParams(t, []int{1 << 14, 1 << 14})
			cfg := config(codec, h, 1, 0)
			if codec == outer.CodecSparse {
				cfg = defaultSparse(h, outer.SparseAllGather)
			}
			o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
			if err != nil {
				return err
			}
			defer o.Close()
			for i := 1; i <= h; i++ {
				setGrads(ps, c.Rank(), i)
				if err := o.Step(ctx); err != nil {
					return err
				}
				if i < h && o.Stats().LastStepBytes != 0 {
					return fmt.Errorf("inner step %d sent %d bytes", i, o.Stats().LastStepBytes)
				}
			}
			got.set(c.Rank(), o.Stats().LastStepBytes)
			return nil
		})
		bytes[codec] = got.v[0]
		t.Logf("codec %s: %d bytes sent per rank per outer step (4 ranks, 32768 float32 elements = 131072 bytes)", codec, got.v[0])
	}
	n := int64(1 << 15)
	assert.Equal(t, 2*3*4*n/4+3*4, bytes[outer.CodecFP32]) // ring allreduce + the 4-byte agreement
	assert.Greater(t, bytes[outer.CodecFP32], bytes[outer.CodecBF16])
	assert.Greater(t, bytes[outer.CodecBF16], bytes[outer.CodecInt8])
	assert.Greater(t, bytes[outer.CodecInt8], bytes[outer.CodecOneBit])
	ratio := float64(bytes[outer.CodecFP32]) / float64(bytes[outer.CodecOneBit])
	t.Logf("fp32/1bit: %.1fx", ratio)
	assert.Greater(t, ratio, 28.0)
	// The sparse codec's all-gather: 8 chunks of 4096, each a 4-byte scale
	// and 85 entries of 12 + 1 bits (139 bytes), to 3 peers.
	assert.Equal(t, 3*8*(4+139)+3*4, int(bytes[outer.CodecSparse]))
	t.Logf("fp32/sparse: %.1fx", float64(bytes[outer.CodecFP32])/float64(bytes[outer.CodecSparse]))
}

// checkpointCase is a configuration resumed at several points.
type checkpointCase struct {
	cfg outer.Config
	at  []int // calls after which the checkpoint is taken
}

// Resuming from a checkpoint (through its binary form, into a fresh
// optimizer) continues bit for bit as a run that never stopped: mid-period,
// right at an exchange, and with an exchange in flight.
func TestResumeBitIdentical(t *testing.T) {
	const w, calls = 3, 22
	for _, k := range []checkpointCase{
		{config(outer.CodecFP32, 4, 1, 0), []int{2, 4, 8}},
		{config(outer.CodecOneBit, 4, 1, 0), []int{3, 8}},
		{config(outer.CodecOneBit, 6, 2, 3), []int{3, 4, 6, 7, 9}}, // in flight at 3-5 and 6-8
		{config(outer.CodecInt8, 6, 3, 1), []int{2, 4, 5}},
		{config(outer.CodecBF16, 5, 2, 2), []int{2, 3, 5, 6}}, // in flight at 2-3, 5-6
		{config(outer.CodecSparse, 4, 1, 0), []int{3, 8}},
		{config(outer.CodecSparse, 6, 2, 3), []int{3, 4, 6, 7, 9}},
		// No momentum (the 1-bit and sparse codecs' default): no u kept.
		{noMomentum(config(outer.CodecSparse, 6, 2, 3)), []int{3, 4, 7}},
		{noMomentum(config(outer.CodecOneBit, 6, 2, 3)), []int{3, 4, 7}},
		{noMomentum(config(outer.CodecFP32, 6, 2, 2)), []int{3, 4}},
		// The two-phase exchange: its server accumulators too.
		{twoPhase(config(outer.CodecSparse, 4, 1, 0)), []int{3, 8}},
		{twoPhase(noMomentum(config(outer.CodecSparse, 6, 2, 3))), []int{3, 4, 6, 7, 9}},
		// The sparse accumulator in bfloat16.
		{func() outer.Config {
			c := noMomentum(config(outer.CodecSparse, 4, 1, 0))
			c.AccumulatorBF16 = true
			return c
		}(), []int{3, 8}},
	} {
		for _, at := range k.at {
			cfg := k.cfg
			t.Run(fmt.Sprintf("%s/F%d/D%d/mu%g/at%d", cfg.Codec, cfg.Fragments, cfg.Delay, cfg.Momentum, at), func(t *testing.T) {
				whole := runResume(t, adamInner, w, cfg, calls, -1)
				resumed := runResume(t, adamInner, w, cfg, calls, at)
				for r := range w {
					require.Equal(t, whole[r], resumed[r], "rank %d", r)
				}
			})
		}
	}
}

// twoPhase is cfg with the sparse codec's two-phase exchange.
func twoPhase(cfg outer.Config) outer.Config {
	cfg.SparseExchange = outer.SparseTwoPhase
	return cfg
}

// noMomentum is cfg with Momentum 0.
func noMomentum(cfg outer.Config) outer.Config {
	cfg.Momentum = 0
	return cfg
}

// Without a momentum u is not kept: Momentum is nil, StateBytes holds
// no u, and the checkpoint holds none (pending or not). A checkpoint that
// holds one with momentum 0 (an earlier version's) loads, u ignored; a
// checkpoint of another momentum is refused either way, and one with a
// momentum that lacks u is refused.
func TestNoMomentumKeepsNoU(t *testing.T) {
	with := config(outer.CodecSparse, 6, 2, 3)
	without := noMomentum(with)
	o := stepped(t, without, 3) // fragment 1 in flight
	assert.Nil(t, o.Momentum())
	assert.Equal(t, stepped(t, with, 3).StateBytes()-4*20, o.StateBytes(), "u's 4 bytes per element")
	ck, err := o.State()
	require.NoError(t, err)
	require.EqualValues(t, 1, ck.Ints[outer.IntPending])
	assert.Nil(t, ck.Tensor(outer.TensorMomentum))
	assert.Nil(t, ck.Tensor(outer.TensorPendingMomentum))
	whole, err := stepped(t, without, 5).State()
	require.NoError(t, err)

	// An earlier version's checkpoint: u and the pending u, ignored.
	old := ck.Clone()
	old.AddTensor(outer.TensorMomentum, []int{20}, make([]float32, 20))
	old.AddTensor(outer.TensorPendingMomentum, []int{10}, make([]float32, 10))
	for i := range old.Tensor(outer.TensorMomentum).Data {
		old.Tensor(outer.TensorMomentum).Data[i] = float32(i) - 7
	}
	o2 := stepped(t, without, 0)
	require.NoError(t, o2.Load(old))
	for i := 4; i <= 5; i++ {
		setGrads(o2.Params(), 0, i)
		require.NoError(t, o2.Step(context.Background()))
	}
	got, err := o2.State()
	require.NoError(t, err)
	assert.Equal(t, whole.Tensor(outer.TensorGlobal).Data, got.Tensor(outer.TensorGlobal).Data, "u was not ignored")

	err = stepped(t, with, 0).Load(ck)
	require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
	assert.ErrorContains(t, err, "made with outer_momentum 0, this optimizer has 0.9")
	ckWith, err := stepped(t, with, 3).State()
	require.NoError(t, err)
	err = stepped(t, without, 0).Load(ckWith)
	require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
	assert.ErrorContains(t, err, "made with outer_momentum 0.9, this optimizer has 0")
	lacking := ckWith.Clone()
	lacking.Tensors = slices.DeleteFunc(lacking.Tensors, func(t optim.Tensor) bool { return t.Name == outer.TensorMomentum })
	require.ErrorIs(t, stepped(t, with, 0).Load(lacking), optim.ErrIncompatibleCheckpoint)
}

// runResume runs calls steps of an outer optimizer with inner optimizer
// k on w ranks and returns every rank's parameters, θ_g and u at the end;
// with at >= 0, it checkpoints after call at, closes the optimizer, and
// continues in a fresh one (made with other initial values, to prove they
// come from the checkpoint).
func runResume(t *testing.T, k innerKind, w int, cfg outer.Config, calls, at int) [][]float32 {
	out := newPerRank[[]float32](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		ps := k.params(t)
		o, err := k.build(ctx, c, ps, cfg)
		if err != nil {
			return err
		}
		for i := 1; i <= calls; i++ {
			setGrads(ps, c.Rank(), i)
			if err := o.Step(ctx); err != nil {
				return err
			}
			if i != at {
				continue
			}
			ck, err := o.State()
			if err != nil {
				return err
			}
			b, err := ck.MarshalBinary()
			if err != nil {
				return err
			}
			if err := o.Close(); err != nil {
				return err
			}
			var back optim.Checkpoint
			if err := back.UnmarshalBinary(b); err != nil {
				return err
			}
			ps = k.params(t)
			for _, p := range ps {
				for j := range p.Data() {
					p.Data()[j] = 42
				}
			}
			if o, err = k.build(ctx, c, ps, cfg); err != nil {
				return err
			}
			if err := o.Load(&back); err != nil {
				return err
			}
		}
		if _, err := o.State(); err != nil {
			return err
		}
		res := append(flat(ps), o.Global()...)
		res = append(res, o.Momentum()...)
		out.set(c.Rank(), res)
		return o.Close()
	})
	return out.v
}

// Bad settings are refused with a *optim.ConfigError.
func TestConfigValidate(t *testing.T) {
	require.NoError(t, outer.DefaultConfig().Validate())
	for _, k := range []struct {
		field  string
		change func(*outer.Config)
	}{
		{"H", func(c *outer.Config) { c.H = 0 }},
		{"Fragments", func(c *outer.Config) { c.Fragments = 0 }},
		{"Fragments", func(c *outer.Config) { c.H, c.Fragments = 4, 5 }},
		{"Delay", func(c *outer.Config) { c.H, c.Fragments, c.Delay = 10, 2, 6 }},
		{"Delay", func(c *outer.Config) { c.Delay = -1 }},
		{"Codec", func(c *outer.Config) { c.Codec = 9 }},
		{"LR", func(c *outer.Config) { c.LR = -1 }},
		{"Momentum", func(c *outer.Config) { c.Momentum = 1 }},
		{"BucketBytes", func(c *outer.Config) { c.BucketBytes = optim.PerParameter }},
		{"Scale", func(c *outer.Config) { c.Scale = 7 }},
		{"Density", func(c *outer.Config) { c.Codec, c.Density = outer.CodecSparse, 0 }},
		{"Density", func(c *outer.Config) { c.Codec, c.Density = outer.CodecSparse, 1.5 }},
		{"Density", func(c *outer.Config) { c.Codec, c.Density = outer.CodecSparse, float32(math.NaN()) }},
		{"SparseChunk", func(c *outer.Config) { c.Codec, c.SparseChunk = outer.CodecSparse, 47 }}, // below 1/Density = 48
		{"SparseChunk", func(c *outer.Config) { c.Codec, c.SparseChunk = outer.CodecSparse, 0 }},
		{"SparseBits", func(c *outer.Config) { c.Codec, c.SparseBits = outer.CodecSparse, 3 }},
		{"Decay", func(c *outer.Config) { c.Codec, c.Decay = outer.CodecSparse, -0.1 }},
		{"Decay", func(c *outer.Config) { c.Codec, c.Decay = outer.CodecSparse, 1.01 }},
		{"SparseExchange", func(c *outer.Config) { c.Codec, c.SparseExchange = outer.CodecSparse, 4 }},
		{"SparseExchange", func(c *outer.Config) { c.Codec, c.SparseExchange = outer.CodecSparse, -1 }},
		{"SparseServerDensity", func(c *outer.Config) { c.Codec, c.SparseServerDensity = outer.CodecSparse, 1.5 }},
		{"SparseServerDensity", func(c *outer.Config) { c.Codec, c.SparseServerDensity = outer.CodecSparse, -0.5 }},
		{"SparseServerDensity", func(c *outer.Config) { c.Codec, c.SparseServerDensity = outer.CodecSparse, float32(math.NaN()) }},
	} {
		cfg := outer.DefaultConfig()
		k.change(&cfg)
		if k.field == "SparseChunk" || k.field == "Density" || k.field == "SparseBits" || k.field == "Decay" || strings.HasPrefix(k.field, "SparseS") || k.field == "SparseExchange" {
			other := cfg
			other.Codec = outer.CodecFP32
			require.NoError(t, other.Validate(), "another codec ignores %s", k.field)
		}
		var ce *optim.ConfigError
		err := cfg.Validate()
		require.ErrorAs(t, err, &ce, k.field)
		assert.Equal(t, k.field, ce.Field)
		assert.True(t, strings.HasPrefix(err.Error(), "outer: Config."+k.field), err.Error())
	}
	c, err := outer.ParseCodec("1BIT")
	require.NoError(t, err)
	assert.Equal(t, outer.CodecOneBit, c)
	for _, c := range allCodecs {
		back, err := outer.ParseCodec(c.String())
		require.NoError(t, err)
		assert.Equal(t, c, back)
	}
	_, err = outer.ParseCodec("fp8")
	assert.ErrorContains(t, err, `outer: unknown codec "fp8"`)
	for _, x := range []outer.SparseExchange{outer.SparseAllGather, outer.SparseTwoPhase, outer.SparseShared, outer.SparseVoted} {
		back, err := outer.ParseSparseExchange(strings.ToUpper(x.String()))
		require.NoError(t, err)
		assert.Equal(t, x, back)
	}
	_, err = outer.ParseSparseExchange("ring")
	assert.ErrorContains(t, err, `outer: unknown sparse exchange "ring" (want one of allgather, twophase, shared, voted)`)
	assert.Equal(t, "SparseExchange(5)", outer.SparseExchange(5).String())
}

// Bad input on one rank at construction is an error on every rank, the
// others naming it.
func TestNewBadInputOnEveryRank(t *testing.T) {
	const w = 3
	for _, k := range []struct {
		name string
		mk   func(ctx context.Context, c comm.Comm, bad bool) error
		want string
	}{
		{"invalid config", newChanged(t, outer.DefaultConfig(), func(cfg *outer.Config) { cfg.H = 0 }), "outer: Config.H = 0"},
		{"more fragments than elements", newChanged(t, config(outer.CodecFP32, 30, 25, 0), nil), "25 fragments of 20 parameter elements"},
		{"sparse chunks longer than a fragment", func(ctx context.Context, c comm.Comm, bad bool) error {
			cfg := config(outer.CodecSparse, 4, 3, 0)
			cfg.SparseChunk = 7 // the fragments have 6 and 7 elements
			_, err := outer.NewAdam(ctx, c, newParams(t, sizes), cfg, innerConfig())
			return err
		}, "sparse chunks of 7 elements, but a fragment has 6"},
		{"another sparse density", newChanged(t, config(outer.CodecSparse, 4, 1, 0), func(cfg *outer.Config) { cfg.Density = 0.75 }),
			"rank 1 has Density 0.75, rank 0 has 0.5"},
		{"another sparse exchange", newChanged(t, config(outer.CodecSparse, 4, 1, 0), func(cfg *outer.Config) { cfg.SparseExchange = outer.SparseTwoPhase }),
			"rank 1 has SparseExchange twophase, rank 0 has allgather"},
		{"the shared exchange on one rank", newChanged(t, twoPhase(config(outer.CodecSparse, 4, 1, 0)), func(cfg *outer.Config) { cfg.SparseExchange = outer.SparseShared }),
			"rank 1 has SparseExchange shared, rank 0 has twophase"},
		{"another accumulator precision", newChanged(t, config(outer.CodecSparse, 4, 1, 0), func(cfg *outer.Config) { cfg.AccumulatorBF16 = true }),
			"rank 1 has AccumulatorBF16 true, rank 0 has false"},
		{"another second-phase density", newChanged(t, twoPhase(config(outer.CodecSparse, 4, 1, 0)), func(cfg *outer.Config) { cfg.SparseServerDensity = 0.75 }),
			"rank 1 has SparseServerDensity 0.75, rank 0 has 0.5"},
		{"another H", newChanged(t, outer.DefaultConfig(), func(cfg *outer.Config) { cfg.H = 7 }), "has H 7, rank 0 has 50"},
		{"another codec", newChanged(t, outer.DefaultConfig(), func(cfg *outer.Config) { cfg.Codec = outer.CodecInt8 }), "rank 1 has Codec int8, rank 0 has fp32"},
		{"another Nesterov", newChanged(t, outer.DefaultConfig(), func(cfg *outer.Config) { cfg.Nesterov = false }), "rank 1 has Nesterov false, rank 0 has true"},
		{"another LR", newChanged(t, outer.DefaultConfig(), func(cfg *outer.Config) { cfg.LR = 0.3 }), "rank 1 has LR 0.3, rank 0 has 0.7"},
		{"another Momentum", newChanged(t, outer.DefaultConfig(), func(cfg *outer.Config) { cfg.Momentum = 0.5 }), "rank 1 has Momentum 0.5, rank 0 has 0.9"},
		{"another Scale", newChanged(t, outer.DefaultConfig(), func(cfg *outer.Config) { cfg.Scale = onebit.ScaleMeanAbs }),
			"rank 1 has Scale onebit.ScaleMeanAbs, rank 0 has onebit.ScaleRMS"},
		{"inner optimizer that communicates", func(ctx context.Context, c comm.Comm, bad bool) error {
			ps := newParams(t, sizes)
			var ic comm.Comm
			if bad {
				ic = c
			}
			in, err := optim.NewAdam(ctx, ic, ps, innerConfig())
			if err != nil {
				return err
			}
			defer in.Close()
			_, err = outer.New(ctx, c, in, outer.DefaultConfig())
			return err
		}, "the inner optimizer runs on 3 ranks"},
	} {
		t.Run(k.name, func(t *testing.T) {
			errs := newPerRank[error](w)
			runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
				errs.set(c.Rank(), k.mk(ctx, c, c.Rank() == 1))
				return nil
			})
			for r, err := range errs.v {
				require.Error(t, err, "rank %d", r)
				assert.NotErrorIs(t, err, comm.ErrAborted)
				if k.name == "more fragments than elements" || k.name == "sparse chunks longer than a fragment" || r == 1 || strings.HasPrefix(k.name, "another ") {
					assert.Contains(t, err.Error(), k.want, "rank %d", r)
				} else {
					assert.Contains(t, err.Error(), "rank 1", "rank %d", r)
				}
			}
		})
	}
}

// newChanged returns a constructor for TestNewBadInputOnEveryRank: it
// makes an outer optimizer of cfg, changed by change (if not nil) on the
// bad rank, closes it, and returns NewAdam's error.
func newChanged(t testing.TB, cfg outer.Config, change func(*outer.Config)) func(ctx context.Context, c comm.Comm, bad bool) error {
	return func(ctx context.Context, c comm.Comm, bad bool) error {
		cfg := cfg
		if bad && change != nil {
			change(&cfg)
		}
		o, err := outer.NewAdam(ctx, c, newParams(t, sizes), cfg, innerConfig())
		if err == nil {
			o.Close()
		}
		return err
	}
}

// An inner optimizer that communicates at a step (one that checkpoints as
// local but sends bytes) makes that step fail on every rank.
func TestInnerThatCommunicatesAtAStep(t *testing.T) {
	errs := newPerRank[error](2)
	runRanks(t, 2, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		in, err := optim.NewAdam(ctx, nil, ps, innerConfig())
		if err != nil {
			return err
		}
		chatty := &chattyInner{Adam: in, c: c}
		o, err := outer.New(ctx, c, chatty, config(outer.CodecFP32, 2, 1, 0))
		if err != nil {
			return err
		}
		defer o.Close()
		setGrads(ps, c.Rank(), 1)
		chatty.on = true
		errs.set(c.Rank(), o.Step(ctx))
		return nil
	})
	for _, err := range errs.v {
		assert.ErrorContains(t, err, "the inner optimizer communicated")
	}
}

// chattyInner is Adam whose Stats claim traffic once on is set.
type chattyInner struct {
	*optim.Adam
	c  comm.Comm
	on bool
}

func (a *chattyInner) Stats() optim.Stats {
	s := a.Adam.Stats()
	if a.on {
		s.BytesSent = 8
	}
	return s
}

// A rank whose inner step fails between exchanges waits for the next
// exchange to tell the others: every rank's Step there fails, the others
// naming it, and θ_g is unchanged. Every later Step fails until Load.
func TestFailureReachesEveryRankAtTheNextExchange(t *testing.T) {
	const w, h = 3, 4
	for _, delay := range []int{0, 2} {
		t.Run(fmt.Sprintf("D%d", delay), func(t *testing.T) {
			errs := newPerRank[error](w)
			failedAt := newPerRank[int](w)
			runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
				ps := newParams(t, sizes)
				o, err := outer.NewAdam(ctx, c, ps, config(outer.CodecOneBit, h, 1, delay), innerConfig())
				if err != nil {
					return err
				}
				defer o.Close()
				var ck *optim.Checkpoint
				for i := 1; i <= 3*h; i++ {
					setGrads(ps, c.Rank(), i)
					if i == h+2 {
						if ck, err = o.State(); err != nil {
							return err
						}
						if c.Rank() == 1 {
							ps[1].Grad = tensor.New(tensor.WithShape(ps[1].Numel()+1), tensor.Of(tensor.Float32))
						}
					}
					before := append([]float32(nil), o.Global()...)
					if err := o.Step(ctx); err != nil {
						errs.set(c.Rank(), err)
						failedAt.set(c.Rank(), i)
						if !assert.Equal(t, before, o.Global()) {
							return errors.New("θ_g changed")
						}
						if err := o.Step(ctx); err == nil {
							return errors.New("a step after the failure succeeded")
						}
						if _, err := o.State(); err == nil {
							return errors.New("State after the failure succeeded")
						}
						if c.Rank() == 1 {
							ps[1].Grad = tensor.New(tensor.WithShape(ps[1].Numel()), tensor.Of(tensor.Float32))
						}
						if err := o.Load(ck); err != nil {
							return err
						}
						setGrads(ps, c.Rank(), h+2)
						return o.Step(ctx) // back on track
					}
				}
				return errors.New("no step failed")
			})
			for r := range w {
				require.Error(t, errs.v[r])
				assert.NotErrorIs(t, errs.v[r], comm.ErrAborted)
				if r == 1 {
					assert.Contains(t, errs.v[r].Error(), "no longer holds")
					assert.Equal(t, h+2, failedAt.v[r])
				} else {
					assert.Contains(t, errs.v[r].Error(), "rank 1 failed")
					assert.Equal(t, 2*h, failedAt.v[r], "others fail at the next exchange")
				}
			}
		})
	}
}

// A non-finite pseudo-gradient on one rank skips the outer step on every
// rank: θ_g and u unchanged, every rank restarts from θ_g. (The +Inf put
// in a parameter here becomes NaN in the inner AdamW's weight decay:
// TestInfPseudoGradientSkipsOnEveryRank has pseudo-gradients of ±Inf.)
func TestNonFiniteSkipsOnEveryRank(t *testing.T) {
	const w, h = 2, 3
	out := newPerRank[[]float32](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, err := outer.NewAdam(ctx, c, ps, config(outer.CodecFP32, h, 1, 0), innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		g0 := append([]float32(nil), o.Global()...)
		for i := 1; i <= h; i++ {
			setGrads(ps, c.Rank(), i)
			if i == h && c.Rank() == 1 {
				ps[0].Data()[0] = float32(posInf())
			}
			if err := o.Step(ctx); err != nil {
				return err
			}
		}
		if !assert.Equal(t, g0, o.Global()) || !assert.Equal(t, g0, flat(ps)) {
			return errors.New("state changed")
		}
		out.set(c.Rank(), []float32{float32(o.OuterStats().Skipped), float32(o.OuterStats().Exchanges)})
		return nil
	})
	assert.Equal(t, []float32{1, 0}, out.v[0])
	assert.Equal(t, []float32{1, 0}, out.v[1])
}

// Load refuses a checkpoint of other settings, naming both values, and
// changes nothing.
func TestLoadRefusesOtherSettings(t *testing.T) {
	base := config(outer.CodecOneBit, 6, 2, 1)
	o := stepped(t, base, 5)
	before, err := o.State()
	require.NoError(t, err)
	for _, k := range []struct {
		change func(*outer.Config)
		want   string
	}{
		{func(c *outer.Config) { c.H = 8 }, "made with outer_h 8, this optimizer has 6"},
		{func(c *outer.Config) { c.Codec = outer.CodecInt8 }, "made with outer_codec int8, this optimizer has 1bit"},
		{func(c *outer.Config) { c.Fragments = 3 }, "made with outer_fragments 3, this optimizer has 2"},
		{func(c *outer.Config) { c.Delay = 2 }, "made with outer_delay 2, this optimizer has 1"},
		{func(c *outer.Config) { c.Momentum = 0.5 }, "made with outer_momentum 0.5, this optimizer has 0.9"},
		{func(c *outer.Config) { c.LR = 0.5 }, "made with outer_lr 0.5, this optimizer has 0.7"},
		{func(c *outer.Config) { c.Nesterov = false }, "made with outer_nesterov false, this optimizer has true"},
		{func(c *outer.Config) { c.Scale = onebit.ScaleMeanAbs }, "made with outer_scale onebit.ScaleMeanAbs, this optimizer has onebit.ScaleRMS"},
		{func(c *outer.Config) { c.Codec, c.SparseChunk, c.Density = outer.CodecSparse, 4, 0.5 }, "made with outer_codec sparse, this optimizer has 1bit"},
	} {
		cfg := base
		k.change(&cfg)
		ck, err := stepped(t, cfg, 3).State()
		require.NoError(t, err)
		requireLoadRefused(t, o, ck, k.want)
	}
	// A damaged inner part is refused by the inner optimizer: nothing
	// changes either.
	bad, err := o.State()
	require.NoError(t, err)
	bad.Floats[outer.InnerPrefix+optim.HyperPrefix+"beta1"] = 0.5
	require.ErrorContains(t, o.Load(bad), "inner optimizer")
	after, err := o.State()
	require.NoError(t, err)
	require.Equal(t, before, after)
	// The 1-bit error buffers are error buffers for optim.
	n := 0
	for _, ts := range before.Tensors {
		if optim.IsErrorBuffer(ts.Name) {
			n++
		}
	}
	assert.Zero(t, n, "one rank has no error buffers")
}

// stepped returns an outer optimizer of cfg on one process after calls
// Steps; the test's cleanup closes it.
func stepped(t *testing.T, cfg outer.Config, calls int) *outer.Optimizer {
	t.Helper()
	ctx := context.Background()
	ps := newParams(t, sizes)
	o, err := outer.NewAdam(ctx, nil, ps, cfg, innerConfig())
	require.NoError(t, err)
	t.Cleanup(func() { o.Close() })
	for i := 1; i <= calls; i++ {
		setGrads(ps, 0, i)
		require.NoError(t, o.Step(ctx))
	}
	return o
}

// requireLoadRefused requires o to refuse ck with
// optim.ErrIncompatibleCheckpoint and an error containing want, and to
// be unchanged.
func requireLoadRefused(t *testing.T, o *outer.Optimizer, ck *optim.Checkpoint, want string, msgAndArgs ...any) {
	t.Helper()
	before, err := o.State()
	require.NoError(t, err)
	err = o.Load(ck)
	require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint, msgAndArgs...)
	assert.ErrorContains(t, err, want, msgAndArgs...)
	after, err := o.State()
	require.NoError(t, err)
	require.Equal(t, before, after, "Load changed the optimizer")
}

// A checkpoint whose pending exchange is past its merge (the merge was due
// at or before the call the checkpoint was made after) is refused, saying
// so, and changes nothing.
func TestLoadRefusesPendingPastItsMerge(t *testing.T) {
	o := stepped(t, config(outer.CodecFP32, 6, 2, 2), 3) // fragment 1 launches at 3 and merges at 5
	ck, err := o.State()
	require.NoError(t, err)
	require.Equal(t, int64(1), ck.Ints[outer.IntPending])
	require.Equal(t, int64(3), ck.Ints[outer.IntLaunchedAt])
	ck.Ints[outer.IntCalls] = 4
	require.NoError(t, o.Load(ck), "merge still ahead")
	for _, calls := range []int64{5, 6} {
		ck.Ints[outer.IntCalls] = calls
		err := o.Load(ck)
		require.ErrorIs(t, err, optim.ErrIncompatibleCheckpoint)
		assert.ErrorContains(t, err, fmt.Sprintf("pending exchange past its merge: fragment 1, launched at step 3, merges at step 5, and the checkpoint was made after step %d", calls))
		assert.Equal(t, int64(4), o.Stats().Steps, "the refused Load changed the optimizer")
	}
}

// The error buffers of a multi-rank 1-bit run are named so that
// optim.IsErrorBuffer and ResetErrors find them; a reset checkpoint loads
// on a group of another size.
func TestErrorBuffersAndResetErrors(t *testing.T) {
	t.Run("1bit", func(t *testing.T) {
		checkErrorBuffers(t, config(outer.CodecOneBit, 2, 2, 0), []string{outer.WorkerErrorName(0, 0), outer.ServerErrorName(0, 0), outer.WorkerErrorName(1, 0), outer.ServerErrorName(1, 0)})
	})
	t.Run("sparse", func(t *testing.T) {
		checkErrorBuffers(t, config(outer.CodecSparse, 2, 2, 0), []string{outer.AccumulatorName})
	})
}

func checkErrorBuffers(t *testing.T, cfg outer.Config, want []string) {
	cks := states(t, 3, 4, cfg)
	var names []string
	for _, ts := range cks[1].Tensors {
		if optim.IsErrorBuffer(ts.Name) {
			names = append(names, ts.Name)
		}
	}
	assert.Equal(t, want, names)
	runRanks(t, 3, func(ctx context.Context, c comm.Comm) error {
		o, err := outer.NewAdam(ctx, c, newParams(t, sizes), cfg, innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		err = o.Load(cks[(c.Rank()+1)%3])
		if !assert.ErrorContains(t, err, "this is rank") {
			return errors.New("loaded another rank's error buffers")
		}
		return o.Load(cks[c.Rank()])
	})
	runRanks(t, 2, func(ctx context.Context, c comm.Comm) error {
		o, err := outer.NewAdam(ctx, c, newParams(t, sizes), cfg, innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		if err := o.Load(cks[c.Rank()]); err == nil {
			return errors.New("loaded a checkpoint of 3 ranks on 2")
		}
		if err := o.Load(cks[c.Rank()].ResetErrors()); err != nil {
			return err
		}
		if !assert.Equal(t, cks[0].Tensor(outer.TensorGlobal).Data, o.Global()) {
			return errors.New("θ_g not restored")
		}
		return o.Step(ctx)
	})
}

// Close is idempotent, waits for the exchange in flight and leaves no
// goroutine behind; a Step after it fails.
func TestCloseIdempotentNoLeak(t *testing.T) {
	before := runtime.NumGoroutine()
	errs := newPerRank[error](2)
	runRanks(t, 2, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, err := outer.NewAdam(ctx, c, ps, config(outer.CodecInt8, 4, 2, 2), innerConfig())
		if err != nil {
			return err
		}
		// Fragment 1 launches at call 2: in flight after call 3.
		if err := stepCalls(ctx, o, ps, c.Rank(), 3); err != nil {
			return err
		}
		if err := o.Close(); err != nil {
			return err
		}
		if err := o.Close(); err != nil {
			return err
		}
		if _, err := o.State(); err != nil {
			return err
		}
		errs.set(c.Rank(), o.Step(ctx)) // call 4: the next exchange: every rank refuses
		return nil
	})
	for _, err := range errs.v {
		assert.ErrorIs(t, err, optim.ErrClosed)
	}
	deadline := time.Now().Add(2 * time.Second)
	for runtime.NumGoroutine() > before && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	assert.LessOrEqual(t, runtime.NumGoroutine(), before)
}

// Step allocates nothing in steady state (one process; exchanges
// included; the sparse codec also with the bfloat16 accumulator and inner
// moments).
func TestStepAllocatesNothing(t *testing.T) {
	compact := config(outer.CodecSparse, 3, 1, 0)
	compact.AccumulatorBF16 = true
	for i, cfg := range []outer.Config{config(outer.CodecOneBit, 3, 1, 0), config(outer.CodecFP32, 4, 2, 1), config(outer.CodecSparse, 3, 1, 0), compact} {
		ctx := context.Background()
		ps := newParams(t, sizes)
		inner := innerConfig()
		inner.MomentsBF16 = i == 3
		o, err := outer.NewAdam(ctx, nil, ps, cfg, inner)
		require.NoError(t, err)
		setGrads(ps, 0, 1)
		for range 2 * cfg.H {
			require.NoError(t, o.Step(ctx))
		}
		allocs := testing.AllocsPerRun(3*cfg.H, func() {
			if err := o.Step(ctx); err != nil {
				panic(err)
			}
		})
		assert.Zero(t, allocs, "F%d D%d", cfg.Fragments, cfg.Delay)
		require.NoError(t, o.Close())
	}
}

// Two ranks on comm/local, synchronous and delayed exchanges (a
// goroutine per launch): the allocations per Step of both ranks, comm/local
// included, are reported (0 when measured).
func TestStepAllocationsTwoRanks(t *testing.T) {
	for _, cfg := range []outer.Config{config(outer.CodecOneBit, 2, 1, 0), config(outer.CodecOneBit, 2, 2, 1), config(outer.CodecSparse, 2, 1, 0), twoPhase(config(outer.CodecSparse, 2, 1, 0))} {
		cs, err := local.New(2)
		require.NoError(t, err)
		ctx := context.Background()
		var opts [2]*outer.Optimizer
		done := make(chan error, 2)
		for r := range 2 {
			go func() {
				ps := newParams(t, sizes)
				setGrads(ps, r, 1)
				o, err := outer.NewAdam(ctx, cs[r], ps, cfg, innerConfig())
				opts[r] = o
				done <- err
			}()
		}
		require.NoError(t, <-done)
		require.NoError(t, <-done)
		stopped := make(chan struct{})
		go func() {
			defer close(stopped)
			for {
				if err := opts[1].Step(ctx); err != nil {
					return
				}
			}
		}()
		allocs := testing.AllocsPerRun(20, func() {
			if err := opts[0].Step(ctx); err != nil {
				panic(err)
			}
		})
		t.Logf("F%d D%d: allocations per Step on 2 ranks (both ranks, comm/local included): %v", cfg.Fragments, cfg.Delay, allocs)
		cs[0].Close() // aborts the group: rank 1's loop ends
		<-stopped
		cs[1].Close()
		opts[0].Close()
		opts[1].Close()
	}
}

func posInf() float64 { return 1 / zero }

var zero = 0.0

// New wraps any local inner optimizer (here LAMB): the checkpoint is
// "outer-lamb" and a resume is bit-identical.
func TestNewWrapsLamb(t *testing.T) {
	const w, calls, at = 2, 9, 5
	cfg := config(outer.CodecInt8, 3, 1, 0)
	run := func(stop int) [][]float32 {
		out := newPerRank[[]float32](w)
		runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
			mk := func(ps []*optim.Param) (*outer.Optimizer, *optim.Lamb, error) {
				in, err := optim.NewLamb(ctx, nil, ps, optim.DefaultLambConfig())
				if err != nil {
					return nil, nil, err
				}
				o, err := outer.New(ctx, c, in, cfg)
				return o, in, err
			}
			ps := newParams(t, sizes)
			o, in, err := mk(ps)
			if err != nil {
				return err
			}
			for i := 1; i <= calls; i++ {
				setGrads(ps, c.Rank(), i)
				if err := o.Step(ctx); err != nil {
					return err
				}
				if i == stop {
					ck, err := o.State()
					if err != nil {
						return err
					}
					if ck.Algorithm != "outer-lamb" {
						return fmt.Errorf("algorithm %q", ck.Algorithm)
					}
					o.Close()
					in.Close()
					ps = newParams(t, sizes)
					if o, in, err = mk(ps); err != nil {
						return err
					}
					if err := o.Load(ck); err != nil {
						return err
					}
				}
			}
			out.set(c.Rank(), append(flat(ps), o.Global()...))
			o.Close()
			return in.Close()
		})
		return out.v
	}
	assert.Equal(t, run(-1), run(at))
}

// StateBytes counts the inner optimizer's state and the outer buffers:
// with the sparse codec at W = 4, 1 fragment, momentum 0.9, on n
// elements: inner AdamW 8n, θ_g and u 8n, the accumulator 4n, and the
// messages and a chunk's scratch (small); no buffer of a fragment's.
func TestStateBytes(t *testing.T) {
	const w = 4
	n := 1 << 14
	for _, codec := range allCodecs {
		got := newPerRank[int64](w)
		runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
			cfg := config(codec, 4, 1, 0)
			if codec == outer.CodecSparse {
				cfg = defaultSparse(4, outer.SparseAllGather)
			}
			o, err := outer.NewAdam(ctx, c, newParams(t, []int{n / 2, n / 2}), cfg, innerConfig())
			if err != nil {
				return err
			}
			defer o.Close()
			got.set(c.Rank(), o.StateBytes())
			return nil
		})
		per := float64(got.v[0]) / float64(n)
		t.Logf("%s: %.2f bytes per parameter", codec, per)
		assert.GreaterOrEqual(t, per, 20.0, "%s: inner Adam, θ_g, u and the exchange buffer", codec)
		if codec == outer.CodecSparse {
			// 4 chunks of 4096 sent as 143 bytes each, this rank's message
			// and the W gathered; a chunk's scratch.
			assert.Equal(t, int64(20*n+4*143*(1+w)+4*4096), got.v[0])
		}
	}
}
