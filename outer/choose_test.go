package outer_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/costmodel"
	"github.com/lowbit-ml/lowbit/outer"
)

// Every outer row of the cost model has a Config, its codec's defaults
// with the plan's H, fragments and delay: a row added to the model fails
// here until ConfigForRow knows it.
func TestConfigForRowEveryPlanRow(t *testing.T) {
	n := 0
	for _, c := range costmodel.Collectives() {
		if !c.Outer {
			continue
		}
		n++
		cfg, muon, err := outer.ConfigForRow(c.Name, 25, 5, 5)
		require.NoError(t, err, c.Name)
		assert.Equal(t, 25, cfg.H, c.Name)
		assert.Equal(t, 5, cfg.Fragments, c.Name)
		assert.Equal(t, 5, cfg.Delay, c.Name)
		assert.Equal(t, c.Name == costmodel.OptOuterMuon, muon, c.Name)
		want := strings.TrimPrefix(c.Name, "outer-")
		switch {
		case c.Name == costmodel.OptOuterMuon:
			want = "1bit"
		case strings.HasPrefix(want, "sparse"):
			want = "sparse"
		}
		assert.Equal(t, want, cfg.Codec.String(), c.Name)
		def := outer.DefaultConfigFor(cfg.Codec)
		assert.Equal(t, def.LR, cfg.LR, c.Name)
		assert.Equal(t, def.Momentum, cfg.Momentum, c.Name)
	}
	assert.GreaterOrEqual(t, n, 7)
	cfg, _, err := outer.ConfigForRow("outer-sparse-2p", 10, 1, 0)
	require.NoError(t, err)
	assert.Equal(t, outer.SparseTwoPhase, cfg.SparseExchange)
	cfg, _, err = outer.ConfigForRow("outer-sparse", 10, 0, 0)
	require.NoError(t, err)
	assert.Equal(t, outer.SparseAllGather, cfg.SparseExchange)
	assert.Equal(t, 1, cfg.Fragments)
}

// A row that is not the outer optimizer's, an unknown codec or exchange,
// or settings Validate refuses: an error that names the row.
func TestConfigForRowErrors(t *testing.T) {
	for _, tc := range []struct {
		row             string
		h, frags, delay int
	}{
		{"onebit", 25, 1, 0}, {"outer-fp16", 25, 1, 0}, {"outer-sparse-ring", 25, 1, 0},
		{"outer-1bit", 0, 1, 0}, {"outer-1bit", 10, 20, 0}, {"outer-1bit", 10, 2, 9},
	} {
		_, _, err := outer.ConfigForRow(tc.row, tc.h, tc.frags, tc.delay)
		if assert.Error(t, err, tc.row) {
			assert.Contains(t, err.Error(), tc.row)
		}
	}
}

// A program picks the optimizer and codec for its job with package
// costmodel, then builds the outer optimizer's Config from the choice:
// Muon on 8 ranks with 100 Mbit/s links each, local steps accepted (H 25):
// the 1-bit codec with Muon inside (build it with outer.NewMuon).
func ExampleConfigForRow() {
	cal, err := costmodel.Builtin()
	if err != nil {
		panic(err)
	}
	link, _ := costmodel.ParseRate("100mbit")
	job := costmodel.Job{Params: 124e6, Ranks: 8, Link: link, BucketBytes: 25 << 20,
		StepCompute: 500 * time.Millisecond, OuterH: 25, MuonFlops: 400e12}
	choice, err := cal.Model.Choose(job, costmodel.ChooseOptions{Muon: true})
	if err != nil {
		panic(err)
	}
	if !choice.Outer {
		fmt.Println("no local steps:", choice.Row)
		return
	}
	cfg, muonInside, err := outer.ConfigForRow(choice.Row, job.OuterH, job.OuterFragments, job.OuterDelay)
	if err != nil {
		panic(err)
	}
	fmt.Println(choice.Row, cfg.Codec, cfg.H, cfg.LR, muonInside)
	// Output: outer-muon 1bit 25 1 true
}
