package costmodel

import (
	"errors"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
)

// vsOneJob is 1M parameters on 2 ranks at 100 MB/s, alpha 100µs and line
// rate, one bucket: the exact allreduce's comm is 2 rounds and 4 MB,
// 0.2ms + 40ms; 1000 tokens a step in 10ms.
func vsOneJob() Job {
	return Job{Params: 1e6, Ranks: 2, Link: 1e8, LinkName: "800mbit", BucketBytes: 1 << 25,
		Alpha: 1e-4, Ineff: 1, StepCompute: 10 * time.Millisecond, TokensPerStep: 1000}
}

// The table's arithmetic, by hand.
func TestVsOneByHand(t *testing.T) {
	j := vsOneJob()
	j.Collectives = []string{"allreduce", "fp16"}
	p, _ := planRows(t, j)
	require.NotNil(t, p.VsOne)
	v := p.VsOne
	assert.Equal(t, int64(1000), v.TokensPerStep)
	assert.Equal(t, 0.01, v.StepCompute)
	require.Len(t, v.Rows, 2)
	exact, half := v.Rows[0], v.Rows[1]
	// allreduce: comm 2*100µs + 4e6 B / 1e8 B/s = 40.2ms.
	assert.InDelta(t, 0.01, exact.OneStepS, 1e-12)
	assert.InDelta(t, 0.0502, exact.StepS, 1e-12)
	assert.InDelta(t, 1e5, exact.OneTokensPerS, 1e-6)
	assert.InDelta(t, 2000/0.0502, exact.TokensPerS, 1e-6)
	assert.InDelta(t, 0.02/0.0502, exact.Ratio, 1e-12)
	// Break even where the compute equals the comm: 40.2ms at 10µs a
	// token.
	assert.InDelta(t, 4020, exact.BreakEvenTokens, 1e-6)
	// fp16: half the bytes, 20.2ms.
	assert.InDelta(t, 2000/0.0302, half.TokensPerS, 1e-6)
	assert.InDelta(t, 2020, half.BreakEvenTokens, 1e-6)
	assert.False(t, half.Calibrated)
	assert.Equal(t, "fp16", v.Pick)
	assert.Equal(t, "allreduce", v.PickCalibrated)

	// On 3 ranks: the ring's 4 rounds and 4/3 x 4 MB; break even where
	// 2 x compute equals the comm.
	j.Ranks = 3
	p, _ = planRows(t, j)
	c3 := 4e-4 + float64(comm.RingAllReduceBytes(4e6, 3))/1e8
	assert.InDelta(t, 3000/(0.01+c3), p.VsOne.Rows[0].TokensPerS, 1e-6)
	assert.InDelta(t, c3/2/1e-5, p.VsOne.Rows[0].BreakEvenTokens, 1e-6)
}

// An outer row whose exchanges hide behind OuterDelay steps of compute:
// its comm shrinks as the compute grows, and the break even is found by
// bisection. Here by hand: H 10, delay 5, the agreement a = 100µs + 4 B at
// 1e8 B/s and the exchange x = 40.2ms, so that the comm per step is
// (a + max(0, x - 5d))/10 and 2 ranks break even at d = comm: d = (a +
// x)/15 while x > 5d.
func TestVsOneBreakEvenBisection(t *testing.T) {
	j := vsOneJob()
	j.Collectives = []string{"outer-fp32"}
	j.OuterH, j.OuterDelay = 10, 5
	p, rows := planRows(t, j)
	a := 1e-4 + 4/1e8
	assert.InDelta(t, a/10, rows["outer-fp32"].CommS, 1e-12, "10ms x 5 hides the 40.2ms exchange")
	assert.InDelta(t, 2000/(0.01+a/10), p.VsOne.Rows[0].TokensPerS, 1e-6)
	d := (a + 0.0402) / 15
	assert.InDelta(t, d/1e-5, p.VsOne.Rows[0].BreakEvenTokens, 1e-3)

	// Without the delay: the closed form, d = (a + x)/10.
	j.OuterDelay = 0
	p, _ = planRows(t, j)
	assert.InDelta(t, (a+0.0402)/10/1e-5, p.VsOne.Rows[0].BreakEvenTokens, 1e-6)
}

// At every row's break even the W machines' rate is one machine's;
// fewer tokens lose, more win. Muon's rows (one machine orthogonalizes
// too), delayed outer fragments and the calibrated fit included.
func TestVsOneBreakEvenIsEven(t *testing.T) {
	j := Job{Params: 124e6, Ranks: 4, Link: 1e9 / 8, LinkName: "1gbit", BucketBytes: 25 << 20,
		StepCompute: 50 * time.Millisecond, TokensPerStep: 1 << 20, OuterH: 40, OuterFragments: 4, OuterDelay: 5,
		MuonShape: [2]int64{768, 3072}, MuonFlops: 1e12}
	p, _ := planRows(t, j)
	require.NotNil(t, p.VsOne)
	require.Len(t, p.VsOne.Rows, len(p.Rows))
	perToken := j.StepCompute.Seconds() / float64(j.TokensPerStep)
	ratioAt := func(name string, tokens float64) float64 {
		t.Helper()
		k := j
		k.Collectives = []string{name}
		k.TokensPerStep = int64(math.Max(1, math.Round(tokens)))
		k.StepCompute = time.Duration(perToken * float64(k.TokensPerStep) * 1e9)
		q, _ := planRows(t, k)
		return q.VsOne.Rows[0].Ratio
	}
	for _, r := range p.VsOne.Rows {
		assert.InDelta(t, r.TokensPerS/r.OneTokensPerS, r.Ratio, 1e-12, r.Collective)
		if r.BreakEvenTokens == 0 {
			assert.GreaterOrEqual(t, ratioAt(r.Collective, 1), 1.0, r.Collective)
			continue
		}
		require.Greater(t, r.BreakEvenTokens, 1000.0, r.Collective)
		assert.InDelta(t, 1, ratioAt(r.Collective, r.BreakEvenTokens), 2e-3, r.Collective)
		assert.Less(t, ratioAt(r.Collective, 0.9*r.BreakEvenTokens), 1.0, r.Collective)
		assert.Greater(t, ratioAt(r.Collective, 1.1*r.BreakEvenTokens), 1.0, r.Collective)
	}
}

func TestVsOneValidate(t *testing.T) {
	j := vsOneJob()
	j.StepCompute = 0
	var je *JobError
	require.True(t, errors.As(j.Validate(), &je))
	assert.Equal(t, "StepCompute", je.Field)
	j = vsOneJob()
	j.TokensPerStep = -1
	require.True(t, errors.As(j.Validate(), &je))
	assert.Equal(t, "TokensPerStep", je.Field)
	j.TokensPerStep = 0
	p, _ := planRows(t, j)
	assert.Nil(t, p.VsOne, "no table without TokensPerStep")
}
