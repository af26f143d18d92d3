package costmodel

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// The copies of Muon's settings are the optimizers'.
func TestMuonCopiesMatch(t *testing.T) {
	assert.Equal(t, optim.DefaultMuonConfig().NSSteps, muonNSSteps)
	assert.Equal(t, onebit.DefaultMuonConfig().NSSteps, muonNSSteps)
}

// muonShapes are Muon matrices and AdamW tensors of a small model: shapes
// that repeat, a transpose, a tensor of rank 3, an empty matrix.
var muonShapes = [][]int{{24, 40}, {40, 24}, {24, 40}, {32, 32}, {3, 4, 10}, {0, 5}, {40}, {7}, {100}}

// The state of exact Muon and of 1-bit Muon, by MuonStateBytes,
// OnebitMuonStateBytes and OnebitMuonCompactStateBytes (both compact
// modes, in the compression stage), is the optimizers' StateBytes to the
// byte, on 2, 4 and 8 ranks, in buckets that cut the model in several
// places and in one bucket; and the closed forms the plan uses agree with
// them.
func TestMuonStateBytesMatchOptimizers(t *testing.T) {
	var matrices [][2]int64
	var other []int64
	var aux int64
	for _, sh := range muonShapes {
		if len(sh) < 2 {
			other = append(other, int64(sh[0]))
			aux += int64(sh[0])
			continue
		}
		cols := 1
		for _, d := range sh[1:] {
			cols *= d
		}
		matrices = append(matrices, [2]int64{int64(sh[0]), int64(cols)})
	}
	for _, w := range []int{2, 4, 8} {
		for _, bucket := range []int{1 << 10, 3000, optim.DefaultBucketBytes} {
			exact, err := MuonStateBytes(matrices, aux)
			require.NoError(t, err)
			oneBit, err := OnebitMuonStateBytes(matrices, other, w, int64(bucket))
			require.NoError(t, err)
			var compact [2]int64
			for k, bf16 := range []bool{false, true} {
				compact[k], err = OnebitMuonCompactStateBytes(matrices, other, w, int64(bucket), bf16)
				require.NoError(t, err)
			}
			got := make([][4]int64, w)
			err = local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
				params := func() []*optim.Param {
					var ps []*optim.Param
					for i, sh := range muonShapes {
						ps = append(ps, optim.NewParam(fmt.Sprintf("p%d", i), sh...))
					}
					return ps
				}
				m, err := optim.NewMuon(ctx, c, params(), optim.DefaultMuonConfig())
				if err != nil {
					return err
				}
				defer m.Close()
				cfg := onebit.DefaultMuonConfig()
				cfg.BucketBytes = bucket
				o, err := onebit.NewMuon(ctx, c, params(), cfg)
				if err != nil {
					return err
				}
				defer o.Close()
				got[c.Rank()] = [4]int64{m.StateBytes(), o.StateBytes()}
				for k, bf16 := range []bool{false, true} {
					cfg.StateMode, cfg.MomentumBF16, cfg.FreezeStep = onebit.StateCompact, bf16, 0
					oc, err := onebit.NewMuon(ctx, c, params(), cfg)
					if err != nil {
						return err
					}
					got[c.Rank()][2+k] = oc.StateBytes()
					if err := oc.Close(); err != nil {
						return err
					}
				}
				return nil
			})
			require.NoError(t, err)
			what := fmt.Sprintf("%d ranks, buckets of %d bytes", w, bucket)
			assert.Equal(t, got[0][0], exact, "exact Muon, "+what)
			assert.Equal(t, got[0][1], oneBit, "1-bit Muon, "+what)
			assert.Equal(t, got[0][2], compact[0], "1-bit Muon StateCompact, "+what)
			assert.Equal(t, got[0][3], compact[1], "1-bit Muon StateCompact with MomentumBF16, "+what)
		}
	}
	// The closed forms of one shape repeated and one AdamW tensor.
	for _, w := range []int{1, 2, 4, 8} {
		mats := [][2]int64{{24, 40}, {24, 40}, {24, 40}}
		want, err := MuonStateBytes(mats, 123)
		require.NoError(t, err)
		assert.Equal(t, want, muonState([2]int64{24, 40}, 3, 123))
		want, err = OnebitMuonStateBytes(mats, []int64{123}, w, 1<<10)
		require.NoError(t, err)
		got, err := onebitMuonState([2]int64{24, 40}, 3, 123, w, 1<<10)
		require.NoError(t, err)
		assert.Equal(t, want, got, "%d ranks", w)
		want, err = OnebitMuonCompactStateBytes(mats, []int64{123}, w, 1<<10, true)
		require.NoError(t, err)
		if w > 1 {
			assert.Equal(t, want, got+muonCompactDelta(3*24*40, 123, 24*40, 4, w, 1<<10, true), "%d ranks", w)
		} else {
			assert.Equal(t, want, got, "one rank: StateFull")
		}
	}
	_, err := OnebitMuonStateBytes([][2]int64{{-1, 2}}, nil, 4, 0)
	assert.Error(t, err)
	_, err = OnebitMuonStateBytes(nil, []int64{-1}, 4, 0)
	assert.Error(t, err)
	_, err = OnebitMuonStateBytes(nil, nil, 0, 0)
	assert.Error(t, err)
}

// The outer optimizer's own buffers, by OuterStateBytes, are
// outer.Optimizer.StateBytes less its inner AdamW's 8 bytes per parameter,
// to the byte, for every codec it models, 1 to 4 ranks, fragments and
// delay. Package outer's buffers are being made smaller: this test fails
// until outerBuffers follows them.
func TestOuterStateBytesMatchOptimizer(t *testing.T) {
	n := int64(outerTestParams)
	for _, codec := range outerStateCodecs {
		cd, err := outer.ParseCodec(strings.TrimSuffix(codec, "-2p"))
		require.NoError(t, err)
		for _, w := range []int{1, 2, 3, 4} {
			for _, fd := range [][2]int{{1, 0}, {3, 0}, {2, 1}} {
				j := Job{Params: n, Ranks: w, OuterFragments: fd[0], OuterDelay: fd[1], BucketBytes: 1 << 10,
					OuterSparseChunk: 96, OuterSparseBits: 2}
				want, err := OuterStateBytes(codec, j)
				require.NoError(t, err)
				cfg := outer.DefaultConfigFor(cd)
				cfg.H, cfg.Fragments, cfg.Delay, cfg.BucketBytes = 4, fd[0], fd[1], 1<<10
				cfg.SparseChunk, cfg.SparseBits = 96, 2
				if codec == "sparse-2p" {
					cfg.SparseExchange = outer.SparseTwoPhase
				}
				got := outerStateBytesOf(t, w, cfg, optim.DefaultAdamConfig())
				if cd == outer.CodecSparse {
					// At DefaultConfigFor the accumulator is bfloat16.
					require.True(t, cfg.AccumulatorBF16)
				}
				assert.Equal(t, got-8*n, want, "%s, %d ranks, %d fragments, delay %d", codec, w, fd[0], fd[1])
			}
		}
	}
	_, err := OuterStateBytes("bf16", Job{Params: 10, Ranks: 2})
	assert.ErrorContains(t, err, "unknown outer codec")
	_, err = OuterStateBytes("fp32", Job{Params: 10, Ranks: 0})
	assert.Error(t, err)
}

// The Newton-Schulz work of a matrix: 5 iterations of X Xᵀ, A A and B X.
func TestNSFlops(t *testing.T) {
	assert.Equal(t, 5*(3*64.0*64*256+64.0*64*64), NSFlops(64, 256))
	assert.Equal(t, NSFlops(64, 256), NSFlops(256, 64), "a matrix and its transpose")
	assert.Equal(t, 20*1024.0*1024*1024, NSFlops(1024, 1024), "20 d FLOP per element of a square matrix")
	// docs/muon.md's second model: 4 blocks of q, k, v, o (128 x 128)
	// and the feed-forward matrices (128 x 512, 512 x 128): 0.88 G
	// multiply-adds with the symmetric products (1.26 G without).
	flops := 4 * (4*NSFlops(128, 128) + 2*NSFlops(128, 512))
	assert.InDelta(t, 0.88e9, flops/2, 0.01e9)
	for params, d := range map[int64]int64{124e6: 1024, 1.3e9: 2240, 6.7e9: 3840, 1: 64} {
		assert.Equal(t, [2]int64{d, d}, DefaultMuonShape(params), "%d parameters", params)
	}
}

// Muon's rows: the exact (muon) or 1-bit (onebit-muon) allreduce of every
// bucket, as the allreduce and onebit rows, and the orthogonalization of
// every matrix on top; they follow the default rows when MuonShape is set.
func TestMuonRows(t *testing.T) {
	j := Job{Params: 1 << 26, Ranks: 4, Link: 1e9 / 8, LinkName: "1gbit", BucketBytes: 25 << 20, StepCompute: 100 * time.Millisecond,
		MuonShape: [2]int64{1024, 4096}, MuonParams: 60 << 20, MuonFlops: 1e12}
	p, rows := planRows(t, j)
	var names []string
	for _, r := range p.Rows {
		names = append(names, r.Collective)
	}
	assert.Equal(t, []string{"allreduce", "onebit", "muon", "muon-split", "onebit-muon"}, names)
	require.NotNil(t, p.Muon)
	// 15 matrices of 4Mi elements; 4Mi elements to AdamW; split on 4
	// ranks, the most loaded rank orthogonalizes 4 of them.
	assert.Equal(t, MuonPlan{Shape: [2]int64{1024, 4096}, Matrices: 15, Other: 4 << 20, Rate: 1e12,
		Flops: 15 * NSFlops(1024, 4096), OrthoS: 15 * NSFlops(1024, 4096) / 1e12,
		SplitOrthoS: 4 * NSFlops(1024, 4096) / 1e12}, *p.Muon)
	// muon-split: muon's allreduce plus an all-gather of 4 matrices' worth
	// from each rank (3 rounds, 3 shares sent), its share of the
	// orthogonalization.
	sp, mu := rows["muon-split"], rows["muon"]
	assert.Equal(t, mu.WirePerRank+3*4*4*1024*4096, sp.WirePerRank)
	assert.Equal(t, mu.Calls+1, sp.Calls)
	assert.Greater(t, sp.CommS, mu.CommS)
	assert.InEpsilon(t, sp.CommS+p.Muon.SplitOrthoS+0.1, sp.StepS, 1e-12)
	assert.InEpsilon(t, p.Muon.OrthoS*4/15, sp.OrthoS, 1e-12)
	for name, via := range map[string]string{"muon": "allreduce", "onebit-muon": "onebit"} {
		r, base := rows[name], rows[via]
		assert.Equal(t, base.WirePerRank, r.WirePerRank, name)
		assert.Equal(t, base.Calls, r.Calls, name)
		assert.Equal(t, base.CommS, r.CommS, name)
		assert.InEpsilon(t, base.StepS+p.Muon.OrthoS, r.StepS, 1e-12, name)
		assert.InEpsilon(t, rows["allreduce"].StepS/r.StepS, r.SpeedupExact, 1e-12, name)
		assert.Positive(t, r.OrthoS)
	}
	for _, r := range []Row{rows["allreduce"], rows["onebit"]} {
		assert.Zero(t, r.OrthoS, r.Collective)
	}

	// Without MuonShape: asked for by name, the default shape.
	j.MuonShape, j.MuonParams, j.Collectives = [2]int64{}, 0, []string{"muon"}
	p, _ = planRows(t, j)
	require.Len(t, p.Rows, 1)
	assert.Equal(t, DefaultMuonShape(1<<26), p.Muon.Shape)
	j.Collectives = nil
	p, _ = planRows(t, j)
	assert.Len(t, p.Rows, 2)
	assert.Nil(t, p.Muon)

	cal, err := Builtin()
	require.NoError(t, err)
	for field, mut := range map[string]func(*Job){
		"MuonShape":  func(j *Job) { j.MuonShape = [2]int64{0, 5} },
		"MuonParams": func(j *Job) { j.MuonParams = -1 },
		"MuonFlops":  func(j *Job) { j.MuonFlops = -1 },
	} {
		bad := j
		mut(&bad)
		_, err := cal.Model.Plan(bad)
		var je *JobError
		if assert.ErrorAs(t, err, &je, field) {
			assert.Equal(t, field, je.Field)
		}
	}
}

// Every outer row of the state table is the optimizer's own StateBytes,
// to the byte: each codec at outer.DefaultConfigFor around an AdamW at
// outer.DefaultAdamConfigFor (the sparse codec's accumulator and the
// moments in bfloat16), and outer-sparse-fp32 with float32 state.
func TestOuterStateRowsMatchOptimizer(t *testing.T) {
	for _, w := range []int{1, 2, 3} {
		for _, fd := range [][2]int{{1, 0}, {2, 1}} {
			j := Job{Params: outerTestParams, Ranks: w, OuterH: 4, OuterFragments: fd[0], OuterDelay: fd[1], BucketBytes: 1 << 10,
				OuterSparseChunk: 96, OuterSparseBits: 2}
			rows := map[string]int64{}
			for _, r := range j.StateTable() {
				if strings.HasPrefix(r.Optimizer, "outer-") && r.Optimizer != OptOuterMuon { // TestOuterMuonStateRowMatchesOptimizer
					require.NoError(t, r.Err, r.Optimizer)
					rows[r.Optimizer] = r.Bytes
				}
			}
			require.Len(t, rows, 6, "outer-fp32, -int8, -1bit, -sparse, -sparse-2p, -sparse-fp32: %v", rows)
			for name, want := range rows {
				codec, _, _ := strings.Cut(strings.TrimPrefix(name, "outer-"), "-")
				cd, err := outer.ParseCodec(codec)
				require.NoError(t, err, name)
				cfg, ac := outer.DefaultConfigFor(cd), outer.DefaultAdamConfigFor(cd)
				cfg.H, cfg.Fragments, cfg.Delay, cfg.BucketBytes = 4, fd[0], fd[1], 1<<10
				cfg.SparseChunk, cfg.SparseBits = 96, 2
				switch name {
				case "outer-sparse-2p":
					cfg.SparseExchange = outer.SparseTwoPhase
				case OptOuterSparseFP32:
					cfg.AccumulatorBF16, ac.MomentsBF16 = false, false
				}
				assert.Equal(t, outerStateBytesOf(t, w, cfg, ac), want, "%s: %d ranks, %d fragments, delay %d", name, w, fd[0], fd[1])
			}
		}
	}
}

// outerTestSizes are the tensors of the outer optimizer the memory tests
// build, outerTestParams their elements.
var outerTestSizes = []int{700, 301, 23}

const outerTestParams = 700 + 301 + 23

// outerStateBytesOf is rank 0's outer.Optimizer.StateBytes on w
// in-process ranks, for parameters of outerTestSizes.
func outerStateBytesOf(t *testing.T, w int, cfg outer.Config, ac optim.AdamConfig) int64 {
	t.Helper()
	got := make([]int64, w)
	err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		var ps []*optim.Param
		for k, s := range outerTestSizes {
			ps = append(ps, optim.NewParam(fmt.Sprintf("p%d", k), s))
		}
		o, err := outer.NewAdam(ctx, c, ps, cfg, ac)
		if err != nil {
			return err
		}
		defer o.Close()
		got[c.Rank()] = o.StateBytes()
		return nil
	})
	require.NoError(t, err)
	return got[0]
}

// The outer-muon row of the state table (MuLoCo) is outer.NewMuon's own
// StateBytes, to the byte: the 1-bit codec at outer.DefaultConfigFor
// around exact Muon over whole matrices of the job's shape and one AdamW
// tensor of the rest.
func TestOuterMuonStateRowMatchesOptimizer(t *testing.T) {
	const rows, cols, matrices, rest = 24, 40, 3, 123
	for _, w := range []int{1, 2, 3} {
		j := Job{Params: matrices*rows*cols + rest, Ranks: w, OuterH: 4, BucketBytes: 1 << 10, MuonShape: [2]int64{rows, cols}}
		var want int64 = -1
		for _, r := range j.StateTable() {
			if r.Optimizer == OptOuterMuon {
				require.NoError(t, r.Err)
				want = r.Bytes
			}
		}
		require.NotEqual(t, int64(-1), want, "no %s row", OptOuterMuon)
		cfg := outer.DefaultConfigFor(outer.CodecOneBit)
		cfg.H, cfg.BucketBytes = 4, 1<<10
		got := make([]int64, w)
		err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
			var ps []*optim.Param
			for k := range matrices {
				ps = append(ps, optim.NewParam(fmt.Sprintf("m%d", k), rows, cols))
			}
			ps = append(ps, optim.NewParam("bias", rest))
			o, err := outer.NewMuon(ctx, c, ps, cfg, optim.DefaultMuonConfig())
			if err != nil {
				return err
			}
			defer o.Close()
			got[c.Rank()] = o.StateBytes()
			return nil
		})
		require.NoError(t, err)
		assert.Equal(t, got[0], want, "%d ranks", w)
	}
}

// The onebit-muon-owners row (opt-in): the AdamW group's buckets through
// the 1-bit allreduce, the Muon group's two collectives of segments padded
// to the most loaded owner's, each owner's share of the orthogonalization;
// its Muon bytes are the optimizer's, to the byte, on 2 to 6 ranks (5
// matrices of two chunks each, one of them short: owners of two, of one
// and of none).
func TestOnebitMuonOwnersRow(t *testing.T) {
	j := Job{Params: 1 << 26, Ranks: 4, Link: 1e9 / 8, LinkName: "1gbit", BucketBytes: 25 << 20, StepCompute: 100 * time.Millisecond,
		MuonShape: [2]int64{1024, 4096}, MuonParams: 60 << 20, MuonFlops: 1e12,
		Collectives: []string{"onebit", OptOnebitMuonOwners}}
	p, rows := planRows(t, j)
	r := rows[OptOnebitMuonOwners]
	// 15 matrices of 4Mi elements on 4 ranks: segments of 4 matrices, 3
	// sent per rank in each of the two collectives; the AdamW group's 4Mi
	// elements in one bucket.
	msg := int64(4*4096 + (4<<20)/8)
	adamw := onebitWireBytes(4<<20, 4)
	assert.Equal(t, adamw+2*3*4*msg, r.WirePerRank)
	assert.InEpsilon(t, p.Muon.SplitOrthoS, r.OrthoS, 1e-12)
	assert.False(t, r.Calibrated)
	assert.InEpsilon(t, p.Muon.OrthoS*4/15, r.OrthoS, 1e-12, "4 of the 15 matrices on the most loaded owner")

	for w := 2; w <= 6; w++ {
		const rows, cols, k = 24, 80, 5 // 1920 elements: two chunks, one short
		jw := Job{Params: k * rows * cols, Ranks: w, Link: 1e9, LinkName: "10gbit", BucketBytes: 1 << 20,
			MuonShape: [2]int64{rows, cols}, Collectives: []string{OptOnebitMuonOwners}}
		_, got := planRows(t, jw)
		sent := make([]int64, w)
		err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
			var ps []*optim.Param
			for i := range k {
				ps = append(ps, optim.NewParam(fmt.Sprint("m", i), rows, cols))
			}
			cfg := onebit.DefaultMuonConfig()
			cfg.Exchange, cfg.FreezeStep = onebit.ExchangeOwners, 0
			o, err := onebit.NewMuon(ctx, c, ps, cfg)
			if err != nil {
				return err
			}
			defer o.Close()
			for s := range 2 {
				for _, p := range ps {
					for i := range p.GradData() {
						p.GradData()[i] = float32((i+s+c.Rank())%5) - 2
					}
				}
				if err := o.Step(ctx); err != nil {
					return err
				}
			}
			sent[c.Rank()] = o.Stats().LastStepBytes
			return nil
		})
		require.NoError(t, err)
		// The optimizer's step also runs the frame's agreement, one float
		// allreduced, which no row of the plan counts.
		assert.Equal(t, got[OptOnebitMuonOwners].WirePerRank, sent[0]-comm.RingAllReduceBytes(4, w), "%d ranks", w)
	}
}
