package costmodel

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rttJob is a job on a 10 Mbit/s wide-area link with every row: 2Mi
// parameters in two buckets of 1Mi on 4 ranks (chunks of 32 KiB packed:
// the 1-bit calls are not pipelined).
func rttJob(sharing Sharing, frags int) Job {
	return Job{Params: 2 << 20, Ranks: 4, Link: 10e6 / 8, LinkName: "10mbit", Sharing: sharing, BucketBytes: 4 << 20,
		StepCompute: 100 * time.Millisecond, RTT: 50 * time.Millisecond, OuterH: 10, OuterFragments: frags,
		MuonShape: [2]int64{1024, 1024},
		Collectives: []string{"allreduce", "onebit", "fp16", "outer-fp32", "outer-bf16", "outer-int8", "outer-1bit", "outer-sparse",
			OptMuon, OptOnebitMuon}}
}

// With Job.RTT every latency-bound round of every row costs half the
// round trip: each row's latency is its rounds, counted here from the
// algorithms, times 25 ms at an RTT of 50 ms, on either link sharing (on
// the shared link with more ranks than the calibration machine's CPUs
// too: a network's latency is not scaled as the loopback's is). The outer
// rows count the agreement's W-1 rounds in each exchange.
func TestRTTRoundsCostHalfTheRoundTrip(t *testing.T) {
	const w = 4
	const hop = 0.025 // 50 ms / 2
	r := float64(w - 1)
	for _, sharing := range []Sharing{PerRank, Shared} {
		for _, frags := range []int{1, 2} {
			j := rttJob(sharing, frags)
			p, rows := planRows(t, j)
			assert.Equal(t, hop, p.Assumptions.Alpha)
			assert.Equal(t, "Job.RTT 50ms / 2: a round is a one-way hop", p.Assumptions.AlphaFrom)
			assert.Empty(t, p.Assumptions.AlphaNote)
			buckets := 2.0 // of the whole model
			// Per exchange of one fragment: the agreement (an all-gather),
			// then the codec's collective on the fragment; F exchanges
			// every H steps.
			fragBuckets := buckets / float64(frags)
			perStep := float64(frags) / float64(j.OuterH)
			want := map[string]float64{
				"allreduce":    buckets * 2 * r,                 // ring: 2(W-1) rounds a bucket
				"fp16":         buckets * 2 * r,                 // the same ring
				"onebit":       buckets * 3 * r,                 // three collectives of W-1 rounds a bucket
				OptMuon:        buckets * 2 * r,                 // the exact allreduce's exchange
				OptOnebitMuon:  buckets * 3 * r,                 // the 1-bit allreduce's
				"outer-fp32":   perStep * (r + 2*r),             // agreement, one ring allreduce of the fragment
				"outer-bf16":   perStep * (r + 2*r),             // agreement, one ring allreduce of the fragment
				"outer-int8":   perStep * (r + r + r),           // agreement, all-to-all, all-gather
				"outer-1bit":   perStep * (r + fragBuckets*3*r), // agreement, the fragment's 1-bit buckets
				"outer-sparse": perStep * (r + r),               // agreement, one all-gather
			}
			require.Len(t, rows, len(want))
			for name, rounds := range want {
				assert.InDelta(t, rounds*hop, rows[name].LatencyS, 1e-12, "%s, %s, %d fragments", name, sharing, frags)
			}
		}
	}

	// A pipelined 1-bit call: a bucket of 8Mi elements on 4 ranks has
	// chunks of 256 KiB packed, 4 pieces of 64 KiB: 1 + 2*4 collectives.
	j := rttJob(PerRank, 1)
	j.Params, j.BucketBytes, j.Collectives = 8<<20, 32<<20, []string{"onebit"}
	_, rows := planRows(t, j)
	assert.InDelta(t, (1+2*4)*r*hop, rows["onebit"].LatencyS, 1e-12)

	// Job.Alpha at the same figure is scaled on the oversubscribed shared
	// loopback (4 ranks on 2 CPUs): Job.RTT's is not.
	j = rttJob(Shared, 1)
	j.RTT, j.Alpha, j.Collectives = 0, hop, []string{"allreduce"}
	_, rows = planRows(t, j)
	assert.InDelta(t, 2*2*r*hop*2, rows["allreduce"].LatencyS, 1e-12)
}

// A plan on a link below 1 Gbit/s that keeps the calibration's alpha says
// so, naming the field that gives the round trip; at 1 Gbit/s and above,
// or with RTT or Alpha given, it does not.
func TestRTTNoteOnSlowLinks(t *testing.T) {
	for _, c := range []struct {
		link  float64
		rtt   time.Duration
		alpha float64
		note  bool
	}{
		{link: 10e6 / 8, note: true},
		{link: 999e6 / 8, note: true},
		{link: 1e9 / 8},
		{link: 10e9 / 8},
		{link: 10e6 / 8, rtt: 40 * time.Millisecond},
		{link: 10e6 / 8, alpha: 20e-3},
	} {
		j := Job{Params: 1 << 20, Ranks: 4, Link: c.link, BucketBytes: 4 << 20, RTT: c.rtt, Alpha: c.alpha}
		p, _ := planRows(t, j)
		if c.note {
			assert.Contains(t, p.Assumptions.AlphaNote, "loopback's", "%+v", c)
			assert.Contains(t, p.Assumptions.AlphaNote, "give it with Job.RTT", "%+v", c)
		} else {
			assert.Empty(t, p.Assumptions.AlphaNote, "%+v", c)
		}
	}
	j := Job{Params: 1 << 20, Ranks: 4, Link: 10e6 / 8, BucketBytes: 4 << 20, FieldNames: map[string]string{"RTT": "--rtt"}}
	p, _ := planRows(t, j)
	assert.Contains(t, p.Assumptions.AlphaNote, "give it with --rtt (e.g. --rtt 40ms)")
}

// An RTT below 0, above 2 s, or beside Alpha is refused naming the field.
func TestRTTValidate(t *testing.T) {
	base := Job{Params: 1 << 20, Ranks: 4, Link: 10e6 / 8, BucketBytes: 4 << 20}
	for _, j := range []Job{
		{RTT: -time.Millisecond},
		{RTT: 2*time.Second + time.Nanosecond},
		{RTT: 40 * time.Millisecond, Alpha: 1e-5},
	} {
		bad := base
		bad.RTT, bad.Alpha = j.RTT, j.Alpha
		var je *JobError
		if assert.True(t, errors.As(bad.Validate(), &je), "%v", j.RTT) {
			assert.Equal(t, "RTT", je.Field)
		}
	}
	ok := base
	ok.RTT = 2 * time.Second
	assert.NoError(t, ok.Validate())
}
