package outer_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// muonShapes are the parameters of the Muon tests: two matrices, a
// vector (the auxiliary AdamW's) and a tensor of rank 3 (a 3 x 8 matrix).
var muonShapes = [][]int{{6, 10}, {10, 6}, {5}, {3, 2, 4}}

// muonNumel is the number of elements of muonShapes.
const muonNumel = 60 + 60 + 5 + 24

func muonConfig() optim.MuonConfig {
	m := optim.DefaultMuonConfig()
	m.AdamLR = 0.01
	m.WeightDecay = 0.01
	return m
}

// muonInner is outer.NewMuon with muonConfig over muonShapes.
var muonInner = innerKind{
	params: func(t testing.TB) []*optim.Param { return newShaped(t, muonShapes) },
	build: func(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, error) {
		cfg.SparseWithMuon = true // every codec, the sparse one included (TestSparseMuonRefused)
		return outer.NewMuon(ctx, c, ps, cfg, muonConfig())
	},
}

// TestSparseMuonRefused: the sparse codec around Muon, directly (NewMuon)
// or through optim.Transposed (NewFrom), is refused on every rank, saying
// why and how to insist, unless Config.SparseWithMuon insists; the 1-bit
// codec with Muon and the sparse codec with AdamW are taken.
func TestSparseMuonRefused(t *testing.T) {
	ctx := context.Background()
	try := func(cfg outer.Config, build func(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, error)) []error {
		errs := make([]error, 2)
		_ = local.Run(ctx, 2, func(ctx context.Context, c comm.Comm) error {
			o, err := build(ctx, c, newShaped(t, muonShapes), cfg)
			if err == nil {
				err = o.Close()
			}
			errs[c.Rank()] = err
			return err
		})
		return errs
	}
	transposed := func(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, error) {
		return outer.NewFrom(ctx, c, cfg, func() (optim.Optimizer, error) {
			var names []string
			for _, p := range ps {
				if len(p.Shape()) == 2 {
					names = append(names, p.Name)
				}
			}
			mc := muonConfig()
			return optim.NewTransposed(ps, names, func(inner []*optim.Param) (optim.Optimizer, error) {
				mc.Params = names
				return optim.NewMuon(ctx, nil, inner, mc)
			})
		})
	}
	direct := func(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, error) {
		return outer.NewMuon(ctx, c, ps, cfg, muonConfig())
	}
	sparse := config(outer.CodecSparse, 3, 1, 0)
	for name, build := range map[string]func(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, error){
		"NewMuon": direct, "NewFrom Transposed": transposed,
	} {
		for r, err := range try(sparse, build) {
			require.Error(t, err, "%s: rank %d", name, r)
			assert.Contains(t, err.Error(), "the sparse codec with Muon inside does not suit it", "%s: rank %d", name, r)
			assert.Contains(t, err.Error(), "or set Config.SparseWithMuon to insist", "%s: rank %d", name, r)
		}
		insist := sparse
		insist.SparseWithMuon = true
		assert.Equal(t, []error{nil, nil}, try(insist, build), "%s: SparseWithMuon", name)
		assert.Equal(t, []error{nil, nil}, try(config(outer.CodecOneBit, 3, 1, 0), build), "%s: 1bit", name)
	}
	adam := func(ctx context.Context, c comm.Comm, ps []*optim.Param, cfg outer.Config) (*outer.Optimizer, error) {
		return outer.NewAdam(ctx, c, ps, cfg, innerConfig())
	}
	assert.Equal(t, []error{nil, nil}, try(sparse, adam), "sparse with AdamW")
}

// Muon as the inner optimizer (MuLoCo's setting), on 2 and 3 ranks, with
// every codec, with and without fragments and delay: every rank holds the
// same θ_g and u, and resuming from a checkpoint (mid-period, at an
// exchange, with an exchange in flight) is bit-identical.
func TestMuonInner(t *testing.T) {
	const calls = 10
	initial := flat(newShaped(t, muonShapes))
	for _, w := range []int{2, 3} {
		for _, codec := range allCodecs {
			for _, k := range []checkpointCase{
				{config(codec, 3, 1, 0), []int{3, 4}},
				{config(codec, 4, 2, 1), []int{2, 5}}, // fragment 1 in flight at 2, fragment 0 at 4
			} {
				cfg := k.cfg
				t.Run(fmt.Sprintf("W%d/%s/F%d/D%d", w, codec, cfg.Fragments, cfg.Delay), func(t *testing.T) {
					whole := runResume(t, muonInner, w, cfg, calls, -1)
					global := whole[0][muonNumel:]
					for r := 1; r < w; r++ {
						require.Equal(t, global, whole[r][muonNumel:], "θ_g and u of rank %d", r)
					}
					assert.NotEqual(t, initial, global[:muonNumel], "θ_g never moved")
					for _, at := range k.at {
						assert.Equal(t, whole, runResume(t, muonInner, w, cfg, calls, at), "resumed after call %d", at)
					}
				})
			}
		}
	}
}

// Carried flags with Muon inside: a veto and a refusal at an exchange and
// at its merge stop the call on every rank with nothing changed, and the
// run ends as one that never stopped.
func TestMuonInnerCarryFlags(t *testing.T) {
	const w, calls = 3, 8
	cfg := config(outer.CodecOneBit, 3, 1, 1)
	want := runStopped(t, muonInner, cfg, w, calls, -1, false)
	for _, at := range []int{3, 4} { // an exchange at 3, its merge at 4
		assert.Equal(t, want, runStopped(t, muonInner, cfg, w, calls, at, false), "veto at call %d", at)
		assert.Equal(t, want, runStopped(t, muonInner, cfg, w, calls, at, true), "refusal at call %d", at)
	}
}

// NewMuon's checkpoint is "outer-muon", with Muon's state under inner/;
// SetLR and LR are the Muon group's, the AdamW group's is the inner
// optimizer's, and a checkpoint keeps both.
func TestMuonInnerStateAndLR(t *testing.T) {
	runRanks(t, 2, func(ctx context.Context, c comm.Comm) error {
		ps := newShaped(t, muonShapes)
		o, err := outer.NewMuon(ctx, c, ps, config(outer.CodecInt8, 2, 1, 0), muonConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		mu, ok := o.Inner().(*optim.Muon)
		require.True(t, ok, "inner %T", o.Inner())
		assert.Equal(t, []string{"a", "b", "d"}, mu.MuonParams())
		assert.Equal(t, float32(0.02), o.LR())
		require.NoError(t, o.SetLR(0.03))
		require.NoError(t, mu.SetAdamLR(0.002))
		for i := 1; i <= 3; i++ {
			setGrads(ps, c.Rank(), i)
			require.NoError(t, o.Step(ctx))
		}
		ck, err := o.State()
		require.NoError(t, err)
		assert.Equal(t, "outer-muon", ck.Algorithm)
		assert.Equal(t, float64(float32(0.03)), ck.Floats[outer.InnerPrefix+optim.FloatLR])
		assert.Equal(t, float64(float32(0.002)), ck.Floats[outer.InnerPrefix+optim.FloatAdamLR])
		for _, want := range []string{"a", "b", "d"} {
			assert.NotNil(t, ck.Tensor(outer.InnerPrefix+optim.MomentumBufferPrefix+want), "momentum of %s", want)
		}
		assert.NotNil(t, ck.Tensor(outer.InnerPrefix+optim.ExpAvgSqPrefix+"c"))
		return nil
	})
}

// A parameter marked for Muon that is not a matrix, on one rank, is an
// error on every rank: its own on that rank, one naming it on the others.
func TestMuonInnerBadInputOnEveryRank(t *testing.T) {
	const w = 3
	errs := newPerRank[error](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		m := muonConfig()
		if c.Rank() == 1 {
			m.Params = []string{"a", "c"}
		}
		o, err := outer.NewMuon(ctx, c, newShaped(t, muonShapes), outer.DefaultConfig(), m)
		if err == nil {
			o.Close()
		}
		errs.set(c.Rank(), err)
		return nil
	})
	assertRank1Refused(t, errs.v, `parameter "c" of shape [5] is marked for Muon but is not a matrix`)
}

// transposeFlat writes the transpose of src, rows x cols, into dst.
func transposeFlat(dst, src []float32, rows, cols int) {
	for i := range rows {
		for j := range cols {
			dst[j*rows+i] = src[i*cols+j]
		}
	}
}

// NewFrom over Muon through optim.Transposed, the model's matrices stored
// [inputs, outputs] (lbgomlx.NewOuterMuon's setting), takes exactly the
// steps of NewMuon over the matrices as muonShapes has them, bit for bit
// with the fp32 codec, with and without delay: the resets to θ_g reach
// the transposes. Its checkpoint holds the parameters in their own shape
// and the transposes under outer.InnerPrefix, and a resume from it into
// other values is bit-identical. Close closes the inner optimizer, and
// build's error is an error on every rank.
func TestNewFromTransposedMuon(t *testing.T) {
	const w, calls = 2, 9
	mats := map[int][2]int{0: {6, 10}, 1: {10, 6}, 3: {3, 8}} // rows x cols of a, b and d
	for _, delay := range []int{0, 1} {
		cfg := config(outer.CodecFP32, 3, 1, delay)
		want := runResume(t, muonInner, w, cfg, calls, -1)
		for _, at := range []int{-1, 3, 4} { // an exchange at 3, merged at 4 with delay 1
			got := newPerRank[[]float32](w)
			runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
				ref := newShaped(t, muonShapes)
				// transposed returns the parameters of ref, the matrices
				// transposed, every value v.
				transposed := func(v float32) []*optim.Param {
					ps := make([]*optim.Param, len(ref))
					for k, p := range newShaped(t, muonShapes) {
						if v != 0 {
							for j := range p.Data() {
								p.Data()[j] = v
							}
						}
						rc, ok := mats[k]
						if !ok {
							ps[k] = p
							continue
						}
						d := make([]float32, p.Numel())
						transposeFlat(d, p.Data(), rc[0], rc[1])
						q, err := optim.NewParamFrom(p.Name, d, rc[1], rc[0])
						require.NoError(t, err)
						ps[k] = q
					}
					return ps
				}
				var inner *optim.Transposed
				build := func(ps []*optim.Param) (*outer.Optimizer, error) {
					return outer.NewFrom(ctx, c, cfg, func() (optim.Optimizer, error) {
						m := muonConfig()
						m.Params = []string{"a", "b", "d"}
						var err error
						inner, err = optim.NewTransposed(ps, m.Params, func(in []*optim.Param) (optim.Optimizer, error) {
							return optim.NewMuon(ctx, nil, in, m)
						})
						return inner, err
					})
				}
				ps := transposed(0)
				o, err := build(ps)
				if err != nil {
					return err
				}
				for i := 1; i <= calls; i++ {
					setGrads(ref, c.Rank(), i)
					for k, p := range ref {
						if rc, ok := mats[k]; ok {
							transposeFlat(ps[k].GradData(), p.GradData(), rc[0], rc[1])
						} else {
							copy(ps[k].GradData(), p.GradData())
						}
					}
					if err := o.Step(ctx); err != nil {
						return err
					}
					if i != at {
						continue
					}
					ck, err := o.State()
					require.NoError(t, err)
					assert.Equal(t, []int{10, 6}, ck.Tensor(optim.ParamTensorName("a")).Shape)
					assert.Equal(t, ps[0].Data(), ck.Tensor(optim.ParamTensorName("a")).Data)
					assert.Equal(t, []int{6, 10}, ck.Tensor(outer.InnerPrefix+optim.ParamTensorName("a")).Shape)
					assert.Equal(t, []int{5}, ck.Tensor(optim.ParamTensorName("c")).Shape)
					assert.Nil(t, ck.Tensor(outer.InnerPrefix+optim.ParamTensorName("c")), "c is not transposed")
					b, err := ck.MarshalBinary()
					require.NoError(t, err)
					require.NoError(t, o.Close())
					var back optim.Checkpoint
					require.NoError(t, back.UnmarshalBinary(b))
					ps = transposed(42)
					if o, err = build(ps); err != nil {
						return err
					}
					require.NoError(t, o.Load(&back))
				}
				for k, p := range ps {
					if rc, ok := mats[k]; ok {
						transposeFlat(ref[k].Data(), p.Data(), rc[1], rc[0])
					} else {
						copy(ref[k].Data(), p.Data())
					}
				}
				got.set(c.Rank(), flat(ref))
				require.NoError(t, o.Close())
				assert.Error(t, inner.Step(ctx), "Close closed the inner optimizer")
				return nil
			})
			for r := range w {
				require.Equal(t, want[r][:muonNumel], got.v[r], "delay %d, resumed after %d, rank %d", delay, at, r)
			}
		}
	}

	errs := newPerRank[error](w)
	runRanks(t, w, func(ctx context.Context, c comm.Comm) error {
		o, err := outer.NewFrom(ctx, c, outer.DefaultConfig(), func() (optim.Optimizer, error) {
			if c.Rank() == 1 {
				return nil, errors.New("no inner optimizer here")
			}
			return optim.NewAdam(ctx, nil, newParams(t, sizes), innerConfig())
		})
		if err == nil {
			o.Close()
		}
		errs.set(c.Rank(), err)
		return nil
	})
	assertRank1Refused(t, errs.v, "no inner optimizer here")
}

// assertRank1Refused asserts that every rank's error is there: own on
// rank 1, one naming rank 1 on the others.
func assertRank1Refused(t *testing.T, errs []error, own string) {
	t.Helper()
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		want := "rank 1"
		if r == 1 {
			want = own
		}
		assert.Contains(t, err.Error(), want, "rank %d", r)
	}
}

// FirstMerge is the first Step after which Global can have changed, as the
// optimizer runs it (its first applied exchange), for one and several
// fragments, with and without delay; StepsWarning warns a run shorter
// than that, and Close logs a warning after steps without an exchange.
func TestFirstMergeAndWarning(t *testing.T) {
	for _, fd := range [][3]int{{5, 1, 0}, {5, 1, 2}, {8, 4, 0}, {8, 4, 1}, {7, 3, 2}} {
		cfg := config(outer.CodecFP32, fd[0], fd[1], fd[2])
		ps := newShaped(t, muonShapes)
		o, err := outer.NewAdam(context.Background(), nil, ps, cfg, innerConfig())
		require.NoError(t, err)
		first := 0
		for call := 1; call <= 2*fd[0] && first == 0; call++ {
			for _, p := range ps {
				for i := range p.GradData() {
					p.GradData()[i] = 0.1
				}
			}
			require.NoError(t, o.Step(context.Background()))
			if o.OuterStats().Exchanges > 0 {
				first = call
			}
		}
		require.NoError(t, o.Close())
		assert.Equal(t, first, cfg.FirstMerge(), "H %d, F %d, delay %d", fd[0], fd[1], fd[2])
		assert.Empty(t, cfg.StepsWarning(first), "a run that reaches the first merge")
		assert.Contains(t, cfg.StepsWarning(first-1), fmt.Sprintf("the outer optimizer's first exchange merges at inner step %d (H %d, %d fragment(s), delay %d), after this run's %d steps",
			first, fd[0], fd[1], fd[2], first-1))
	}

	core, logs := observer.New(zap.WarnLevel)
	cfg := config(outer.CodecFP32, 10, 1, 0)
	ps := newShaped(t, muonShapes)
	o, err := outer.NewAdam(context.Background(), nil, ps, cfg, innerConfig(), optim.WithLogger(zap.New(core)))
	require.NoError(t, err)
	for range 3 {
		require.NoError(t, o.Step(context.Background()))
	}
	require.NoError(t, o.Close())
	require.Equal(t, 1, logs.Len())
	assert.Contains(t, logs.All()[0].Message, "closed after inner steps and no exchange: the global parameters (Global) are the initial ones")
	assert.Equal(t, int64(3), logs.All()[0].ContextMap()["inner_steps"])
}
