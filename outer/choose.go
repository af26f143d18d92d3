package outer

import (
	"fmt"
	"strings"
)

// The outer optimizer's Config for a row of package costmodel's plan
// (costmodel.Model.Choose's choice, lowbit plan's outer-* rows). Package
// outer does not import costmodel (costmodel's tests import outer): a
// program asks costmodel for the choice and hands its row here.

// rowPrefix starts the name of every outer row of costmodel's plan.
const rowPrefix = "outer-"

// ConfigForRow returns the Config of the outer optimizer's row of package
// costmodel's plan (costmodel.Choice.Row where Choice.Outer): the row's
// codec at DefaultConfigFor, with h, fragments and delay as the plan had
// them (costmodel.Job.OuterH, OuterFragments, OuterDelay), and for a sparse
// row its exchange ("outer-sparse": SparseAllGather, "outer-sparse-2p":
// SparseTwoPhase, "outer-sparse-NAME": ParseSparseExchange(NAME)).
// muonInside says that the row's inner optimizer is Muon
// ("outer-muon", the 1-bit codec around Muon): build it with NewMuon (or
// NewFrom over Muon), the others with NewAdam. An unknown row is an error,
// and so is a Config that Validate refuses.
func ConfigForRow(row string, h, fragments, delay int) (cfg Config, muonInside bool, err error) {
	name, ok := strings.CutPrefix(row, rowPrefix)
	if !ok {
		return Config{}, false, fmt.Errorf("outer: %q is not a row of the outer optimizer (want outer-CODEC, such as outer-1bit)", row)
	}
	exchange := SparseAllGather
	switch {
	case name == "muon":
		name, muonInside = "1bit", true
	case strings.HasPrefix(name, "sparse-"):
		x := strings.TrimPrefix(name, "sparse-")
		if x == "2p" {
			x = "twophase"
		}
		if exchange, err = ParseSparseExchange(x); err != nil {
			return Config{}, false, fmt.Errorf("outer: row %q: %w", row, err)
		}
		name = "sparse"
	}
	c, err := ParseCodec(name)
	if err != nil {
		return Config{}, false, fmt.Errorf("outer: row %q: %w", row, err)
	}
	cfg = DefaultConfigFor(c)
	cfg.H, cfg.Fragments, cfg.Delay = h, max(fragments, 1), delay
	if c == CodecSparse {
		cfg.SparseExchange = exchange
	}
	if err := cfg.Validate(); err != nil {
		return Config{}, false, fmt.Errorf("outer: row %q: %w", row, err)
	}
	return cfg, muonInside, nil
}
