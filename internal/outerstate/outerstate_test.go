package outerstate

import (
	"flag"
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/outer"
)

var codecs = []outer.Codec{outer.CodecFP32, outer.CodecBF16, outer.CodecInt8, outer.CodecOneBit, outer.CodecSparse}

// Auto is bfloat16 state with the sparse codec only (its accumulator and
// the inner moments), as the library's defaults; FP32 is float32 with
// every codec; BF16 the moments in bfloat16 with every codec and the
// sparse codec's accumulator.
func TestModes(t *testing.T) {
	for _, c := range codecs {
		sparse := c == outer.CodecSparse
		assert.Equal(t, sparse, Auto.AccumulatorBF16(c), "auto, %s", c)
		assert.Equal(t, sparse, Auto.MomentsBF16(c), "auto, %s", c)
		assert.False(t, FP32.AccumulatorBF16(c), "fp32, %s", c)
		assert.False(t, FP32.MomentsBF16(c), "fp32, %s", c)
		assert.Equal(t, sparse, BF16.AccumulatorBF16(c), "bf16, %s", c)
		assert.True(t, BF16.MomentsBF16(c), "bf16, %s", c)
	}
	assert.Equal(t, Auto, Mode(0), "the zero value")
	for _, m := range []Mode{Auto, FP32, BF16} {
		got, err := Parse(m.String())
		require.NoError(t, err)
		assert.Equal(t, m, got)
	}
	got, err := Parse("BF16")
	require.NoError(t, err)
	assert.Equal(t, BF16, got)
	_, err = Parse("fp16")
	assert.EqualError(t, err, `unknown outer state "fp16" (want one of auto, fp32, bf16)`)
	assert.Equal(t, "Mode(7)", Mode(7).String())
}

// -outer-state sets the mode (auto until given); -outer-bf16 is
// -outer-state bf16 and -outer-bf16=false -outer-state fp32; both together
// are refused.
func TestRegister(t *testing.T) {
	parse := func(args ...string) (Mode, error) {
		fs := flag.NewFlagSet("x", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		m := BF16 // Register resets it
		Register(fs, &m)
		err := fs.Parse(args)
		return m, err
	}
	for args, want := range map[string]Mode{
		"":                  Auto,
		"-outer-state=auto": Auto,
		"-outer-state=fp32": FP32,
		"-outer-state=bf16": BF16,
		"-outer-bf16":       BF16,
		"-outer-bf16=false": FP32,
	} {
		var a []string
		if args != "" {
			a = []string{args}
		}
		m, err := parse(a...)
		require.NoError(t, err, args)
		assert.Equal(t, want, m, args)
	}
	_, err := parse("-outer-state=fp16")
	assert.ErrorContains(t, err, `unknown outer state "fp16"`)
	_, err = parse("-outer-state=fp32", "-outer-bf16")
	assert.ErrorContains(t, err, "give one of -outer-state and -outer-bf16")
	_, err = parse("-outer-bf16", "-outer-state=bf16")
	assert.ErrorContains(t, err, "give one of -outer-state and -outer-bf16")
	m, err := parse("-outer-state=fp32", "-outer-state=bf16")
	require.NoError(t, err, "the last of one flag wins, as for every flag")
	assert.Equal(t, BF16, m)
}
