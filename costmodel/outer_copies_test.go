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
					OuterH: h, OuterFragments: frags, Collectives: outerNames()}
				_, rows := planRows(t, j)
				for _, name := range outerNames() {
					oc, _ := findOuterCodec(name)
					codec, err := outer.ParseCodec(oc.codec)
					require.NoError(t, err)
					what := fmt.Sprintf("%s, %d ranks, %v elements, %d fragments", name, w, sizes, frags)
					got := outerBytesPerPeriod(t, w, sizes, codec, h, frags, bucket)
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

// outerBytesPerPeriod runs the outer optimizer on w in-process ranks for
// h steps (each fragment exchanged once) and returns what rank 0 sent in
// them.
func outerBytesPerPeriod(t *testing.T, w int, sizes []int, codec outer.Codec, h, frags, bucket int) int64 {
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
		cfg.H, cfg.Fragments, cfg.Codec, cfg.BucketBytes = h, frags, codec, bucket
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
