package optim

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
)

// What agreeMuon compares, one uint64 each, after a flag that says the
// rank found its own input invalid.
const (
	agreeOnParams   = iota // names and shapes of the parameters, in order
	agreeOnMuon            // which parameters Muon updates
	agreeOnSettings        // every field of the config but Params, Split included
	agreeOnFields
)

// agreeMuon checks, with one all-gather of a small digest, that no rank
// found its input bad (bad) and that every rank has the same parameters,
// the same selection of Muon parameters (muon, nil when bad) and the same
// settings; every rank returns the same error otherwise.
func agreeMuon(ctx context.Context, c comm.Comm, params []*Param, muon []bool, cfg MuonConfig, bad bool) error {
	return AgreeMuon(ctx, c, "optim: Muon", params, muon, cfg, nil, bad)
}

// AgreeMuon is NewMuon's agreement for an optimizer built on Muon (name
// prefixes its errors, "onebit: Muon" say): one all-gather of a 32-byte
// digest per rank, after which every rank returns the same error unless
// no rank found its own input bad (bad) and every rank has the same
// parameter names and shapes, the same selection muon (nil when bad), the
// same cfg (every field but Params) and the same extra settings, each as
// a uint64. Every rank of c (more than one) calls it together.
func AgreeMuon(ctx context.Context, c comm.Comm, name string, params []*Param, muon []bool, cfg MuonConfig, extra []uint64, bad bool) error {
	mine := make([]byte, 8*(1+agreeOnFields)) // its own allocation, as cgo backends need
	if bad {
		mine[0] = 1
	} else {
		h := newDigest()
		for _, p := range params {
			h.str(p.Name)
			sh := p.Shape()
			h.u64(uint64(len(sh)))
			for _, d := range sh {
				h.u64(uint64(d))
			}
		}
		binary.LittleEndian.PutUint64(mine[8*(1+agreeOnParams):], h.sum())
		h = newDigest()
		for i, m := range muon {
			if m {
				h.u64(uint64(i))
			}
		}
		binary.LittleEndian.PutUint64(mine[8*(1+agreeOnMuon):], h.sum())
		h = newDigest()
		for _, x := range []float32{cfg.LR, cfg.Momentum, cfg.NSCoefficients[0], cfg.NSCoefficients[1], cfg.NSCoefficients[2],
			cfg.NSEps, cfg.WeightDecay, cfg.AdamLR, cfg.AdamBeta1, cfg.AdamBeta2, cfg.AdamEps, cfg.AdamWeightDecay} {
			h.u64(uint64(math.Float32bits(x)))
		}
		h.u64(uint64(HyperBool(cfg.Nesterov)))
		h.u64(uint64(HyperBool(cfg.Split)))
		for _, v := range []int{cfg.NSSteps, int(cfg.Reduce), cfg.RanksPerNode} {
			h.u64(uint64(v))
		}
		for _, v := range extra {
			h.u64(v)
		}
		binary.LittleEndian.PutUint64(mine[8*(1+agreeOnSettings):], h.sum())
	}
	n := len(mine)
	all := make([]byte, n*c.Size())
	if err := c.AllGatherBytes(ctx, mine, all); err != nil {
		return fmt.Errorf("%s: comparing parameters and settings across ranks: %w", name, err)
	}
	for r := range c.Size() {
		if all[r*n] != 0 {
			return fmt.Errorf("%s: rank %d was given an invalid configuration or invalid parameters (its error says which)", name, r)
		}
	}
	what := [agreeOnFields]string{
		agreeOnParams:   "the parameters (names, shapes or order) differ",
		agreeOnMuon:     "the parameters that use Muon differ",
		agreeOnSettings: "the settings differ (every field of the config must be the same on every rank)",
	}
	for f := range agreeOnFields {
		at := 8 * (1 + f)
		for r := 1; r < c.Size(); r++ {
			if binary.LittleEndian.Uint64(all[r*n+at:]) != binary.LittleEndian.Uint64(all[at:]) {
				return fmt.Errorf("%s: ranks disagree: %s between rank %d and rank 0", name, what[f], r)
			}
		}
	}
	return nil
}

// digest is a 64-bit FNV-1a hash of a sequence of values.
type digest struct{ h uint64 }

func newDigest() *digest { return &digest{h: 14695981039346656037} }

func (d *digest) u64(v uint64) {
	for range 8 {
		d.h ^= v & 0xff
		d.h *= 1099511628211
		v >>= 8
	}
}

func (d *digest) str(s string) {
	d.u64(uint64(len(s)))
	for i := 0; i < len(s); i++ {
		d.h ^= uint64(s[i])
		d.h *= 1099511628211
	}
}

func (d *digest) sum() uint64 { return d.h }
