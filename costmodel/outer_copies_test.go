package costmodel

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
	"github.com/lowbit-ml/lowbit/quant"
)

// The int8 codec's constants and message length are outer's
// (outer.Int8GroupSize, outer/int8.go's int8MsgLen from package quant's
// NumGroups and CodesLen).
func TestOuterCopiesMatch(t *testing.T) {
	require.Equal(t, outer.Int8GroupSize, outerInt8GroupSize)
	for _, c := range []int{0, 1, 7, 255, 256, 257, 1000, 1 << 20, 123456789} {
		want := 4*quant.NumGroups(c, outer.Int8GroupSize) + quant.CodesLen(c, 8)
		assert.Equal(t, int64(want), outerInt8MsgLen(int64(c)), "%d elements", c)
	}
	sp := outer.DefaultConfigFor(outer.CodecSparse)
	assert.Equal(t, sp.Density, float32(DefaultSparseDensity))
	assert.Equal(t, sp.SparseChunk, DefaultSparseChunk)
	assert.Equal(t, sp.SparseBits, DefaultSparseBits)
	bad := sp
	bad.SparseChunk = MaxSparseChunk
	assert.NoError(t, bad.Validate())
	bad.SparseChunk++
	assert.Error(t, bad.Validate(), "MaxSparseChunk is outer's largest chunk")
	for _, name := range outerNames() {
		oc, ok := findOuterCodec(name)
		require.True(t, ok)
		_, err := outer.ParseCodec(oc.codec)
		assert.NoError(t, err, "%s is a codec of package outer", oc.codec)
	}
}

// The bytes of the outer rows are what package outer sends (comm/local's
// count of each exchange, agreement included): exactly for fp32, int8 and
// 1bit; for bf16, which the fp16 model predicts, less quant.DownCast's
// 8-byte header per peer and its chunk padding.
func TestOuterBytesMatchOptimizer(t *testing.T) {
	const bucket = 1 << 10 // bytes: several 1-bit buckets per fragment
	for _, w := range []int{2, 3, 4} {
		for _, sizes := range [][]int{{1000}, {4097, 3}} {
			for _, frags := range []int{1, 2, 3} {
				n := 0
				for _, s := range sizes {
					n += s
				}
				h := frags
				j := Job{Params: int64(n), Ranks: w, Link: 1e9, LinkName: "10gbit", BucketBytes: bucket,
					OuterH: h, OuterFragments: frags, Collectives: denseOuterNames()}
				_, rows := planRows(t, j)
				for _, name := range denseOuterNames() {
					oc, _ := findOuterCodec(name)
					codec, err := outer.ParseCodec(oc.codec)
					require.NoError(t, err)
					what := fmt.Sprintf("%s, %d ranks, %v elements, %d fragments", name, w, sizes, frags)
					got := outerBytesPerPeriod(t, w, sizes, h, func(cfg *outer.Config) {
						cfg.Fragments, cfg.Codec, cfg.BucketBytes = frags, codec, bucket
					})
					want := rows[name].WirePerRank * int64(h)
					if name == "outer-bf16" {
						// quant.DownCast: (W-1) chunks of C = ceil(m/W)
						// bfloat16 behind an 8-byte header in the
						// all-to-all, (W-1) chunks in the all-gather.
						var extra int64
						for f := range frags {
							m := int64((f+1)*n/frags - f*n/frags)
							c := (m + int64(w) - 1) / int64(w)
							extra += int64(w-1)*(8+2*c) + int64(w-1)*2*c - comm.RingAllReduceBytes(2*m, w)
						}
						want += extra
					}
					assert.InDelta(t, want, got, float64(h)/2, what)
				}
			}
		}
	}
}

// denseOuterNames are the outer rows but the sparse codec's.
func denseOuterNames() []string {
	var names []string
	for _, name := range outerNames() {
		if !isSparseRow(name) {
			names = append(names, name)
		}
	}
	return names
}

// The bytes of the outer-sparse row are what package outer's sparse codec
// sends (comm/local's count of each exchange, agreement included), to the
// byte, for 1- and 2-bit values, densities whose k rounds down and up,
// chunks of a power of two and not (the offset bits), fragments whose last
// chunk is shorter, on 2, 3 and 4 ranks: the formula and the encoder cannot
// drift apart.
//
// The shared-index exchange (outer-sparse-shared) likewise, and on 5 to
// 16 ranks too (many of them owning no chunk).
func TestOuterSparseBytesMatchOptimizer(t *testing.T) {
	type settings struct {
		density     float32
		chunk, bits int
	}
	all := []settings{{1.0 / 48, 96, 1}, {1.0 / 48, 64, 2}, {0.1, 50, 2}, {0.3, 33, 1}, {1, 7, 1}}
	names := map[outer.SparseExchange]string{outer.SparseAllGather: "outer-sparse", outer.SparseTwoPhase: "outer-sparse-2p", outer.SparseShared: "outer-sparse-shared", outer.SparseVoted: "outer-sparse-voted"}
	for w := 5; w <= 16; w++ {
		for _, sp := range all[:2] {
			for _, x := range []outer.SparseExchange{outer.SparseShared, outer.SparseVoted} {
				sizes, h := []int{4097, 3}, 2
				j := Job{Params: 4100, Ranks: w, Link: 1e9, LinkName: "10gbit", BucketBytes: 1 << 10, OuterH: h, OuterFragments: 1,
					Collectives: []string{names[x]}, OuterDensity: float64(sp.density), OuterSparseChunk: sp.chunk, OuterSparseBits: sp.bits}
				_, rows := planRows(t, j)
				got := outerBytesPerPeriod(t, w, sizes, h, func(cfg *outer.Config) {
					*cfg = outer.DefaultConfigFor(outer.CodecSparse)
					cfg.H, cfg.SparseExchange = h, x
					cfg.Density, cfg.SparseChunk, cfg.SparseBits = sp.density, sp.chunk, sp.bits
				})
				assert.InDelta(t, rows[names[x]].WirePerRank*int64(h), got, float64(h)/2, "%s %+v, %d ranks", x, sp, w)
			}
		}
	}
	for _, sp := range all {
		for _, w := range []int{2, 3, 4} {
			for _, sizes := range [][]int{{1000}, {4097, 3}} {
				for _, frags := range []int{1, 3} {
					n := 0
					for _, s := range sizes {
						n += s
					}
					h := 2 * frags
					j := Job{Params: int64(n), Ranks: w, Link: 1e9, LinkName: "10gbit", BucketBytes: 1 << 10,
						OuterH: h, OuterFragments: frags, Collectives: []string{"outer-sparse", "outer-sparse-2p", "outer-sparse-shared", "outer-sparse-voted"},
						OuterDensity: float64(sp.density), OuterSparseChunk: sp.chunk, OuterSparseBits: sp.bits}
					_, rows := planRows(t, j)
					for _, x := range []outer.SparseExchange{outer.SparseAllGather, outer.SparseTwoPhase, outer.SparseShared, outer.SparseVoted} {
						got := outerBytesPerPeriod(t, w, sizes, h, func(cfg *outer.Config) {
							*cfg = outer.DefaultConfigFor(outer.CodecSparse)
							cfg.H, cfg.Fragments, cfg.SparseExchange = h, frags, x
							cfg.Density, cfg.SparseChunk, cfg.SparseBits = sp.density, sp.chunk, sp.bits
						})
						name := names[x]
						want := rows[name].WirePerRank * int64(h)
						assert.InDelta(t, want, got, float64(h)/2, "%s %+v, %d ranks, %v elements, %d fragments", name, sp, w, sizes, frags)
					}
				}
			}
		}
	}
}

// outerBytesPerPeriod runs the outer optimizer on w in-process ranks for
// h steps with outer.DefaultConfig changed by set (each fragment
// exchanged once at least) and returns what rank 0 sent in them.
func outerBytesPerPeriod(t *testing.T, w int, sizes []int, h int, set func(*outer.Config)) int64 {
	t.Helper()
	sent := make([]int64, w)
	err := local.Run(context.Background(), w, func(ctx context.Context, c comm.Comm) error {
		var ps []*optim.Param
		for k, n := range sizes {
			v := make([]float32, n)
			for i := range v {
				v[i] = float32(i%7) * 0.1
			}
			p, err := optim.NewParamFrom(fmt.Sprintf("p%d", k), v, n)
			if err != nil {
				return err
			}
			ps = append(ps, p)
		}
		cfg := outer.DefaultConfig()
		cfg.H = h
		set(&cfg)
		o, err := outer.NewAdam(ctx, c, ps, cfg, optim.DefaultAdamConfig())
		if err != nil {
			return err
		}
		defer o.Close()
		for step := range h {
			for _, p := range ps {
				g := p.GradData()
				for i := range g {
					g[i] = float32((i+step+c.Rank())%5) - 2
				}
			}
			if err := o.Step(ctx); err != nil {
				return err
			}
			sent[c.Rank()] += o.Stats().LastStepBytes
		}
		return nil
	})
	require.NoError(t, err)
	return sent[0]
}
