package costmodel

import (
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Sharing says how the ranks share the network.
type Sharing string

const (
	// Shared: one link carries the traffic of all ranks (the shaped
	// loopback of scripts/plan-calibrate.sh and bench-net.sh: a tbf qdisc
	// on lo caps the total); time per byte applies to W times the bytes
	// each rank sends, less the bucket's tokens. The ranks also share the
	// machine's CPUs.
	Shared Sharing = "shared"
	// PerRank: every rank has a link of the given rate to itself (a
	// cluster with one NIC per rank, full duplex, non-blocking switch);
	// time per byte applies to the bytes each rank sends. Every rank has
	// its own CPU for compression.
	PerRank Sharing = "per-rank"
)

// ParseSharing parses "shared" or "per-rank".
func ParseSharing(s string) (Sharing, error) {
	switch Sharing(s) {
	case Shared, PerRank:
		return Sharing(s), nil
	}
	return "", fmt.Errorf("unknown link sharing %q (want %s or %s)", s, Shared, PerRank)
}

// ParseRate parses a link rate with tc's units: bit, kbit, mbit, gbit,
// tbit are bits per second, bps, kbps, mbps, gbps, tbps bytes per second
// (decimal prefixes, case-insensitive). It returns bytes per second.
func ParseRate(s string) (float64, error) {
	t := strings.ToLower(strings.TrimSpace(s))
	units := []struct {
		suffix string
		bytes  float64
	}{
		{"tbit", 1e12 / 8}, {"gbit", 1e9 / 8}, {"mbit", 1e6 / 8}, {"kbit", 1e3 / 8}, {"bit", 1.0 / 8},
		{"tbps", 1e12}, {"gbps", 1e9}, {"mbps", 1e6}, {"kbps", 1e3}, {"bps", 1},
	}
	for _, u := range units {
		if num, ok := strings.CutSuffix(t, u.suffix); ok {
			v, err := strconv.ParseFloat(num, 64)
			if err != nil || !(v > 0) || math.IsInf(v, 0) {
				break
			}
			return v * u.bytes, nil
		}
	}
	return 0, fmt.Errorf("invalid link rate %q: want a positive number with a tc unit, such as 10gbit, 250mbit or 1.25gbps (bytes/s)", s)
}
