package outer_test

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// sizes are the parameter sizes of the small tests.
var sizes = []int{7, 13}

// newParams returns parameters of the given sizes with deterministic
// values, the same on every rank.
func newParams(t testing.TB, sizes []int) []*optim.Param {
	var ps []*optim.Param
	for k, n := range sizes {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(math.Cos(float64(3*i+k))) * 0.5
		}
		p, err := optim.NewParamFrom(string(rune('a'+k)), v, n)
		require.NoError(t, err)
		ps = append(ps, p)
	}
	return ps
}

// newShaped returns parameters of the given shapes, named and valued as
// newParams's.
func newShaped(t testing.TB, shapes [][]int) []*optim.Param {
	var sizes []int
	for _, sh := range shapes {
		n := 1
		for _, d := range sh {
			n *= d
		}
		sizes = append(sizes, n)
	}
	ps := newParams(t, sizes)
	for k, p := range ps {
		q, err := optim.NewParamFrom(p.Name, p.Data(), shapes[k]...)
		require.NoError(t, err)
		ps[k] = q
	}
	return ps
}

// innerKind makes the parameters of a test and an outer optimizer with
// one kind of inner optimizer over them.
type innerKind struct {
	params func(t testing.TB) []*optim.Param
	build  func(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, error)
}

// adamInner is outer.NewAdam with innerConfig over newParams(t, sizes).
var adamInner = innerKind{
	params: func(t testing.TB) []*optim.Param { return newParams(t, sizes) },
	build: func(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, error) {
		return outer.NewAdam(ctx, c, ps, cfg, innerConfig())
	},
}

// grad is the gradient element i (flat) of rank r at call t: it depends on
// neither the parameters nor the optimizer, so that a reference can
// replay it.
func grad(r, t, i int) float32 {
	return float32(math.Sin(0.7*float64(i)+1.3*float64(t)+2.1*float64(r))*(1+0.1*float64(r)) + 0.05*float64(i%5) - 0.02*float64(r))
}

// setGrads writes grad(r, t, ·) into the parameters' gradients.
func setGrads(ps []*optim.Param, r, t int) {
	i := 0
	for _, p := range ps {
		g := p.GradData()
		for j := range g {
			g[j] = grad(r, t, i)
			i++
		}
	}
}

// flat returns a copy of the parameters' values, concatenated.
func flat(ps []*optim.Param) []float32 {
	var out []float32
	for _, p := range ps {
		out = append(out, p.Data()...)
	}
	return out
}

// runRanks runs fn on w in-process ranks and fails the test on an error.
func runRanks(t testing.TB, w int, fn func(ctx context.Context, c comm.Comm) error) {
	t.Helper()
	require.NoError(t, local.Run(context.Background(), w, fn))
}

// perRank collects one value per rank.
type perRank[T any] struct {
	mu sync.Mutex
	v  []T
}

func newPerRank[T any](w int) *perRank[T] { return &perRank[T]{v: make([]T, w)} }

func (p *perRank[T]) set(r int, v T) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.v[r] = v
}

// steppedOn builds outer.NewAdam of cfg with innerConfig over ps on c, runs
// calls Steps with grad(rank, call, ·), and waits for the exchange in
// flight (State); the caller closes the optimizer.
func steppedOn(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config, calls int) (*outer.Optimizer, error) {
	o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
	if err != nil {
		return nil, err
	}
	if err := stepCalls(ctx, o, ps, c.Rank(), calls); err != nil {
		o.Close()
		return nil, err
	}
	if _, err := o.State(); err != nil { // waits for the exchange in flight
		o.Close()
		return nil, err
	}
	return o, nil
}

// stepCalls runs calls 1 to calls of o, each a Step with grad(rank,
// call, ·) in ps.
func stepCalls(ctx context.Context, o *outer.Optimizer, ps []*optim.Param, rank, calls int) error {
	for i := 1; i <= calls; i++ {
		setGrads(ps, rank, i)
		if err := o.Step(ctx); err != nil {
			return err
		}
	}
	return nil
}

// exchangeCodecs are the codecs with, for the sparse one, each of its
// exchanges (the other codecs ignore SparseExchange).
var exchangeCodecs = []outer.Config{
	{Codec: outer.CodecFP32}, {Codec: outer.CodecBF16}, {Codec: outer.CodecInt8}, {Codec: outer.CodecOneBit},
	{Codec: outer.CodecSparse}, {Codec: outer.CodecSparse, SparseExchange: outer.SparseTwoPhase},
}

// requireSameGlobals runs calls steps of outer.NewAdam with cfg on w
// ranks (gradients from setGrads) and requires every rank to hold the
// same θ_g, bit for bit, after every call, and θ_g to have moved.
func requireSameGlobals(t *testing.T, w int, cfg outer.Config, calls int) {
	t.Helper()
	globals := newPerRank[[][]float32](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, sizes)
		o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		var gs [][]float32
		for i := 1; i <= calls; i++ {
			setGrads(ps, c.Rank(), i)
			if err := o.Step(ctx); err != nil {
				return err
			}
			gs = append(gs, append([]float32(nil), o.Global()...))
		}
		globals.set(c.Rank(), gs)
		return nil
	})
	for r := 1; r < w; r++ {
		for i := range calls {
			require.Equal(t, bitsOf(globals.v[0][i]), bitsOf(globals.v[r][i]), "call %d: θ_g of rank %d", i+1, r)
		}
	}
	assert.NotEqual(t, globals.v[0][0], globals.v[0][calls-1], "θ_g never moved")
}

// defaultSparse is config(outer.CodecSparse, h, 1, 0) with exchange x and
// the default chunks and density (for parameters of 1 << 14 elements and
// more).
func defaultSparse(h int, x outer.SparseExchange) outer.Config {
	cfg := config(outer.CodecSparse, h, 1, 0)
	d := outer.DefaultConfig()
	cfg.SparseChunk, cfg.Density, cfg.SparseExchange = d.SparseChunk, d.Density, x
	return cfg
}

// exchangeBytes runs cfg.H calls of outer.NewAdam with cfg on w ranks
// over two parameters of 1 << 14 elements and returns the bytes a rank
// sent at the last call. It requires, at every call, the communicator's
// count to be LastStepBytes, and every rank to send as much as rank 0.
func exchangeBytes(t *testing.T, w int, cfg outer.Config) int64 {
	t.Helper()
	got := newPerRank[int64](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		ps := newParams(t, []int{1 << 14, 1 << 14})
		o, err := outer.NewAdam(ctx, c, ps, cfg, innerConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		for i := 1; i <= cfg.H; i++ {
			setGrads(ps, c.Rank(), i)
			before := c.Stats().Total()
			if err := o.Step(ctx); err != nil {
				return err
			}
			b := c.Stats().Total().BytesSent - before.BytesSent
			if b != o.Stats().LastStepBytes {
				return fmt.Errorf("call %d: the communicator counted %d bytes, LastStepBytes %d", i, b, o.Stats().LastStepBytes)
			}
			got.set(c.Rank(), b)
		}
		return nil
	})
	for r := 1; r < w; r++ {
		require.Equal(t, got.v[0], got.v[r], "rank %d sends as much as rank 0", r)
	}
	return got.v[0]
}
