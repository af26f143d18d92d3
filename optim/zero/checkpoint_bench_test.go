package zero_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/optim/zero"
)

// shardedCheckpoints returns the checkpoints that w ranks of a zero.Adam
// over p parameters of n elements each would make: every parameter whole
// on every rank, its moments split into w shards.
func shardedCheckpoints(w, p, n int) []*optim.Checkpoint {
	cks := make([]*optim.Checkpoint, w)
	for r := range cks {
		ck := &optim.Checkpoint{
			Algorithm: zero.Algorithm, World: w, Rank: r, Stage: optim.StageExact,
			Ints:   map[string]int64{optim.IntStep: 3, optim.IntSteps: 3, optim.IntSkipped: 0, zero.IntReduce: 0},
			Floats: map[string]float64{},
		}
		lo, hi := r*n/w, (r+1)*n/w
		data := make([]float32, n)
		for i := range p {
			name := fmt.Sprintf("layer%d.weight", i)
			ck.AddTensor(optim.ParamTensorName(name), []int{n}, data)
			ck.AddTensor(optim.ExpAvgPrefix+name, []int{hi - lo}, data[lo:hi])
			ck.AddTensor(optim.ExpAvgSqPrefix+name, []int{hi - lo}, data[lo:hi])
			ck.Ints[zero.ShardOffsetPrefix+name] = int64(lo)
		}
		cks[r] = ck
	}
	return cks
}

// BenchmarkConsolidate joins the checkpoints of 4 ranks over P parameters:
// O(P*W), so ten times the parameters take about ten times as long
// (ns/param stays flat).
func BenchmarkConsolidate(b *testing.B) {
	for _, p := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("W=4/P=%d", p), func(b *testing.B) {
			cks := shardedCheckpoints(4, p, 8)
			for b.Loop() {
				if _, err := zero.Consolidate(cks); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(p), "ns/param")
		})
	}
}

// BenchmarkLoadConsolidated loads a consolidated checkpoint of P
// parameters into a zero.Adam on one rank: O(P) too.
func BenchmarkLoadConsolidated(b *testing.B) {
	for _, p := range []int{1000, 10000} {
		b.Run(fmt.Sprintf("P=%d", p), func(b *testing.B) {
			ck, err := zero.Consolidate(shardedCheckpoints(1, p, 8))
			require.NoError(b, err)
			ps := make([]*optim.Param, p)
			for i := range ps {
				ps[i] = optim.NewParam(fmt.Sprintf("layer%d.weight", i), 8)
			}
			opt, err := zero.NewAdam(context.Background(), nil, ps, zero.DefaultConfig())
			require.NoError(b, err)
			for b.Loop() {
				if err := opt.Load(ck); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(p), "ns/param")
		})
	}
}
