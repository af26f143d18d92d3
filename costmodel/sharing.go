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

// ParseRate parses a link rate: bit, kbit, mbit, gbit, tbit (tc's units,
// case-insensitive, optionally followed by /s: 250mbit, 10Gbit/s) are bits
// per second, B/s, kB/s, MB/s, GB/s, TB/s (a capital B) bytes per second,
// with decimal prefixes. It returns bytes per second.
//
// It refuses tc's bps, kbps, mbps, gbps and tbps, which tc reads as bytes
// per second and most people as bits (100Mbps would be 800 Mbit/s): the
// error names the rate in both readings and how to write each.
func ParseRate(s string) (float64, error) {
	t := strings.TrimSpace(s)
	lower := strings.ToLower(t)
	units := []struct {
		suffix string
		bytes  float64
		exact  bool // the suffix's case matters (B for bytes)
	}{
		{"tbit/s", 1e12 / 8, false}, {"gbit/s", 1e9 / 8, false}, {"mbit/s", 1e6 / 8, false}, {"kbit/s", 1e3 / 8, false}, {"bit/s", 1.0 / 8, false},
		{"tbit", 1e12 / 8, false}, {"gbit", 1e9 / 8, false}, {"mbit", 1e6 / 8, false}, {"kbit", 1e3 / 8, false}, {"bit", 1.0 / 8, false},
		{"TB/s", 1e12, true}, {"GB/s", 1e9, true}, {"MB/s", 1e6, true}, {"kB/s", 1e3, true}, {"KB/s", 1e3, true}, {"B/s", 1, true},
	}
	for _, u := range units {
		in := lower
		if u.exact {
			in = t
		}
		if num, ok := strings.CutSuffix(in, u.suffix); ok {
			v, err := strconv.ParseFloat(num, 64)
			if err != nil || !(v > 0) || math.IsInf(v, 0) {
				break
			}
			return v * u.bytes, nil
		}
	}
	for _, p := range []struct {
		suffix string
		mult   float64
	}{{"tbps", 1e12}, {"gbps", 1e9}, {"mbps", 1e6}, {"kbps", 1e3}, {"bps", 1}} {
		num, ok := strings.CutSuffix(lower, p.suffix)
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(num, 64)
		if err != nil || !(v > 0) || math.IsInf(v, 0) {
			break
		}
		unit := strings.TrimSuffix(p.suffix, "bps")
		written := t[max(0, len(t)-len(p.suffix)):]
		return 0, fmt.Errorf("link rate %q: ambiguous unit: most people read %s as bits per second (%s), tc as bytes per second (%s); write %s%sbit for the first or %s%sB/s for the second",
			s, written, formatBits(v*p.mult), formatBits(8*v*p.mult), num, unit, num, strings.ToUpper(unit))
	}
	return 0, fmt.Errorf("link rate %q: want a positive number with a unit, such as 10gbit, 250mbit, 100Mbit/s (bits per second) or 1.25GB/s (bytes per second)", s)
}

// FormatRate writes a link rate of bytesPerSecond bytes per second as
// bits per second with a decimal prefix, as ParseRate's errors and lowbit
// plan's headers write it: "100 Mbit/s", "1.25 Gbit/s".
func FormatRate(bytesPerSecond float64) string { return formatBits(8 * bytesPerSecond) }

// formatBits writes a rate of b bits per second with a decimal prefix.
func formatBits(b float64) string {
	switch {
	case b >= 1e12:
		return strconv.FormatFloat(b/1e12, 'g', 4, 64) + " Tbit/s"
	case b >= 1e9:
		return strconv.FormatFloat(b/1e9, 'g', 4, 64) + " Gbit/s"
	case b >= 1e6:
		return strconv.FormatFloat(b/1e6, 'g', 4, 64) + " Mbit/s"
	case b >= 1e3:
		return strconv.FormatFloat(b/1e3, 'g', 4, 64) + " kbit/s"
	}
	return strconv.FormatFloat(b, 'g', 4, 64) + " bit/s"
}
