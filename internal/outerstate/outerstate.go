// Package outerstate is the examples' -outer-state flag: the precision of
// the outer optimizer's state, the sparse codec's error accumulator
// (outer.Config.AccumulatorBF16) and the inner AdamW's moments
// (optim.AdamConfig.MomentsBF16).
package outerstate

import (
	"flag"
	"fmt"
	"strconv"
	"strings"

	"github.com/lowbit-ml/lowbit/outer"
)

// Mode is a value of -outer-state. The zero value is Auto.
type Mode int

// The modes.
const (
	// Auto is each codec's default (outer.DefaultConfigFor,
	// outer.DefaultAdamConfigFor): bfloat16 with the sparse codec,
	// float32 with the others.
	Auto Mode = iota
	// FP32 keeps the accumulator and the moments in float32.
	FP32
	// BF16 keeps the inner moments in bfloat16 with every codec, and the
	// sparse codec's accumulator too: the smallest state.
	BF16
	numModes
)

var names = [numModes]string{"auto", "fp32", "bf16"}

// String returns the mode's name as Parse reads it.
func (m Mode) String() string {
	if m >= 0 && m < numModes {
		return names[m]
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Parse returns the mode called s: "auto", "fp32" or "bf16"
// (case-insensitive).
func Parse(s string) (Mode, error) {
	for i, n := range names {
		if strings.EqualFold(s, n) {
			return Mode(i), nil
		}
	}
	return 0, fmt.Errorf("unknown outer state %q (want one of %s)", s, strings.Join(names[:], ", "))
}

// AccumulatorBF16 says whether m keeps codec c's error accumulator in
// bfloat16 (outer.Config.AccumulatorBF16): only the sparse codec has one.
func (m Mode) AccumulatorBF16(c outer.Codec) bool {
	switch m {
	case FP32:
		return false
	case BF16:
		return c == outer.CodecSparse
	}
	return outer.DefaultConfigFor(c).AccumulatorBF16
}

// MomentsBF16 says whether m keeps the inner AdamW's moments in bfloat16
// with codec c (optim.AdamConfig.MomentsBF16).
func (m Mode) MomentsBF16(c outer.Codec) bool {
	switch m {
	case FP32:
		return false
	case BF16:
		return true
	}
	return outer.DefaultAdamConfigFor(c).MomentsBF16
}

// Usage is -outer-state's usage text.
const Usage = "diloco: the precision of the outer optimizer's state, the sparse codec's error accumulator (outer.Config.AccumulatorBF16) and the inner AdamW's moments (optim.AdamConfig.MomentsBF16): " +
	"auto (each codec's default, outer.DefaultConfigFor and outer.DefaultAdamConfigFor: bfloat16 with the sparse codec, 10.3 bytes per parameter at W = 8 instead of 16.3; float32 with the others), " +
	"fp32 (float32 with every codec; a checkpoint made with float32 state resumes with it) or bf16 (the smallest: the moments in bfloat16 with every codec, the sparse codec's accumulator too)"

// Register defines on fs the flag -outer-state, into *m (Auto until it
// is given), and -outer-bf16, its older spelling: -outer-bf16 is
// -outer-state bf16, -outer-bf16=false -outer-state fp32. Giving both is
// an error of fs.Parse.
func Register(fs *flag.FlagSet, m *Mode) {
	*m = Auto
	v := &value{m: m}
	fs.Var(v, "outer-state", Usage)
	fs.BoolFunc("outer-bf16", "diloco: -outer-state bf16 (its older spelling; -outer-bf16=false: -outer-state fp32)", func(s string) error {
		b, err := strconv.ParseBool(s)
		if err != nil {
			return err
		}
		mode := FP32
		if b {
			mode = BF16
		}
		return v.set("outer-bf16", mode)
	})
}

// value is -outer-state's flag.Value; given is the flag that set it.
type value struct {
	m     *Mode
	given string
}

func (v *value) String() string {
	if v == nil || v.m == nil {
		return Auto.String()
	}
	return v.m.String()
}

func (v *value) Set(s string) error {
	m, err := Parse(s)
	if err != nil {
		return err
	}
	return v.set("outer-state", m)
}

// set stores m, given by the flag called name, unless the other flag
// was given.
func (v *value) set(name string, m Mode) error {
	if v.given != "" && v.given != name {
		return fmt.Errorf("-outer-bf16 is -outer-state bf16's older spelling: give one of -outer-state and -outer-bf16")
	}
	v.given, *v.m = name, m
	return nil
}
