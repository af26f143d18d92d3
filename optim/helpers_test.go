package optim

import (
	"hash/crc32"
	"math"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/internal/commtest"
)

// testParams returns parameters of the given shapes with deterministic
// values, named "p0", "p1", ...
func testParams(t testing.TB, seed int, shapes ...[]int) []*Param {
	t.Helper()
	ps := make([]*Param, len(shapes))
	for i, sh := range shapes {
		p := NewParam(string(rune('a'+i))+"-param", sh...)
		for j := range p.Data() {
			p.Data()[j] = float32(math.Sin(float64(seed*1000+i*100+j))) * 0.5
		}
		ps[i] = p
	}
	require.NoError(t, CheckParams(ps))
	return ps
}

// fillGrads writes a deterministic gradient that depends on rank and step.
func fillGrads(ps []*Param, rank, step int) {
	for i, p := range ps {
		g := p.GradData()
		for j := range g {
			g[j] = float32(math.Cos(float64(step*7919+rank*104729+i*31+j*3))) * (1 + float32(rank))
		}
	}
}

func bits(x []float32) []uint32 {
	b := make([]uint32, len(x))
	for i, v := range x {
		b[i] = math.Float32bits(v)
	}
	return b
}

func snapshot(ps []*Param) [][]float32 {
	out := make([][]float32, len(ps))
	for i, p := range ps {
		out[i] = append([]float32(nil), p.Data()...)
	}
	return out
}

func crc32Castagnoli(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// allocsOnTwoRanks is commtest.AllocsOnTwoRanks, a step's error a test
// error.
func allocsOnTwoRanks(t *testing.T, runs int, step0, step1 func() error) float64 {
	t.Helper()
	allocs, err := commtest.AllocsOnTwoRanks(runs, step0, step1)
	if err != nil {
		t.Error(err)
	}
	return allocs
}
