package size_test

import (
	"flag"
	"fmt"
	"io"
	"math"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/size"
)

func TestParse(t *testing.T) {
	for in, want := range map[string]int64{
		"0": 0, "4096": 4096, " 12 ": 12, "4096B": 4096, "7B": 7, "70B": 70,
		"1k": 1000, "1K": 1000, "340M": 340e6, "340m": 340e6, "1.5G": 1.5e9, "2T": 2e12, "1P": 1e15,
		"1Ki": 1024, "64Mi": 64 << 20, "64mi": 64 << 20, "1.5Ki": 1536, "2Gi": 2 << 30, "1Ti": 1 << 40, "1Pi": 1 << 50,
		"64MB": 64e6, "64MiB": 64 << 20, "1.3e9": 1.3e9, "1.3E+9": 1.3e9, "2.5e-3M": 2500, ".5k": 500,
		"9223372036854775807": math.MaxInt64,
	} {
		got, err := size.Parse(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	for _, in := range []string{
		"", " ", "-1", "-1K", "1.5", "1.0001k", "1e-3", "64Mb", "64mb", "1b", "7b", "x", "K", "Mi", "1X", "1KK", "1 K",
		"0x10", "1/2", "+5", "1e", "1e99999", "1.2.3", "9223372036854775808", "8192Pi", "1e30", "NaN", "Inf", "1,000",
		"1.3B", "0.5B", "1BB",
	} {
		_, err := size.Parse(in)
		assert.Error(t, err, "%q", in)
	}
}

// Each refusal of Parse is one line that says what is wrong.
func TestParseErrors(t *testing.T) {
	for in, want := range map[string]string{
		"":        `empty size: want a size such as 340M, 64Mi, 1.5G or 4096`,
		"34OM":    `invalid size "34OM": want a size such as 340M, 64Mi, 1.5G or 4096`,
		"-4":      `invalid size "-4": must not be negative`,
		"1.5":     `invalid size "1.5": not a whole number`,
		"64Mb":    `invalid size "64Mb": b means bits; write B for bytes, or no unit (such as 340M, 64Mi, 1.5G or 4096)`,
		"1e30":    `invalid size "1e30": too large (at most 9223372036854775807)`,
		"1.3B":    `invalid size "1.3B": B means bytes in a size, and 1.3 bytes is not a whole number (1.3 billion bytes is 1.3G)`,
		"0.5B":    `invalid size "0.5B": B means bytes in a size, and 0.5 bytes is not a whole number (0.5 billion bytes is 0.5G)`,
		"1.5KiB":  `invalid size "1.5KiB": not a whole number`,
		"1.0001k": `invalid size "1.0001k": not a whole number`,
	} {
		if in == "1.5KiB" {
			continue // 1536: whole
		}
		_, err := size.Parse(in)
		require.Error(t, err, "%q", in)
		assert.Equal(t, want, err.Error(), "%q", in)
	}
}

// countCases are counts as the field writes them, with their values.
var countCases = map[string]int64{
	"7B": 7e9, "1.3B": 1.3e9, "70B": 70e9, "340M": 340e6, "137k": 137e3, "137K": 137e3,
	"175B": 175e9, "6.7b": 6.7e9, "1.5T": 1.5e12, "2P": 2e15, "0.5k": 500, "4096B": 4096e9,
	"0": 0, "4096": 4096, " 12 ": 12, "1.3e9": 1.3e9, "1.3G": 1.3e9, "340m": 340e6, "1.75e11": 1.75e11,
	"1Ki": 1024, "64Mi": 64 << 20, "1.5Ki": 1536, "1Gi": 1 << 30,
	"1e-3B": 1e6, "9223372036854775807": math.MaxInt64, "9223372036.854775807B": math.MaxInt64,
}

func TestParseCount(t *testing.T) {
	for in, want := range countCases {
		got, err := size.ParseCount(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
}

// Each input ParseCount refuses, with its one-line error: bytes and bits
// are named as such, never read as a count.
func TestParseCountErrors(t *testing.T) {
	for in, want := range map[string]string{
		"":                    `empty count: want a count such as 7B, 1.3B, 340M or 137k`,
		"  ":                  `empty count: want a count such as 7B, 1.3B, 340M or 137k`,
		"64MiB":               `invalid count "64MiB": MiB is a size in bytes, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k)`,
		"64MB":                `invalid count "64MB": MB is a size in bytes, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k)`,
		"1GB":                 `invalid count "1GB": GB is a size in bytes, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k)`,
		"2kB":                 `invalid count "2kB": kB is a size in bytes, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k)`,
		"1.5TiB":              `invalid count "1.5TiB": TiB is a size in bytes, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k)`,
		"64Mb":                `invalid count "64Mb": Mb is a size in bits, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k)`,
		"64mib":               `invalid count "64mib": mib is a size in bits, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k)`,
		"1.5":                 `invalid count "1.5": not a whole number`,
		"1.0001k":             `invalid count "1.0001k": not a whole number`,
		"1.3e-9B":             `invalid count "1.3e-9B": not a whole number`,
		"-7B":                 `invalid count "-7B": must not be negative`,
		"-1":                  `invalid count "-1": must not be negative`,
		"1e30":                `invalid count "1e30": too large (at most 9223372036854775807)`,
		"9.3B":                "",
		"10B":                 "",
		"9223372036854775808": `invalid count "9223372036854775808": too large (at most 9223372036854775807)`,
		"9300000000B":         `invalid count "9300000000B": too large (at most 9223372036854775807)`,
		"340N":                `invalid count "340N": want a count such as 7B, 1.3B, 340M or 137k`,
		"7 B":                 `invalid count "7 B": want a count such as 7B, 1.3B, 340M or 137k`,
		"1BB":                 `invalid count "1BB": want a count such as 7B, 1.3B, 340M or 137k`,
		"B":                   `invalid count "B": want a count such as 7B, 1.3B, 340M or 137k`,
		"7Bn":                 `invalid count "7Bn": want a count such as 7B, 1.3B, 340M or 137k`,
		"1,000":               `invalid count "1,000": want a count such as 7B, 1.3B, 340M or 137k`,
		"0x10":                `invalid count "0x10": want a count such as 7B, 1.3B, 340M or 137k`,
		"1/2B":                `invalid count "1/2B": want a count such as 7B, 1.3B, 340M or 137k`,
		"NaN":                 `invalid count "NaN": want a count such as 7B, 1.3B, 340M or 137k`,
		"+5":                  `invalid count "+5": want a count such as 7B, 1.3B, 340M or 137k`,
	} {
		got, err := size.ParseCount(in)
		if want == "" {
			require.NoError(t, err, "%q", in) // whole: 9.3B, 10B
			assert.Positive(t, got)
			continue
		}
		require.Error(t, err, "%q", in)
		assert.Equal(t, want, err.Error(), "%q", in)
	}
}

func TestFormatRoundTrips(t *testing.T) {
	for n, want := range map[int64]string{
		0: "0", 12: "12", 1000: "1K", 1024: "1Ki", 4096: "4Ki", 25 << 20: "25Mi", 1.3e9: "1.3G",
		340e6: "340M", 1536: "1536", 123456789: "123456789", 1 << 50: "1Pi", math.MaxInt64: "9223372036854775807",
	} {
		assert.Equal(t, want, size.Format(n), n)
		back, err := size.Parse(size.Format(n))
		require.NoError(t, err)
		assert.Equal(t, n, back)
	}
}

func TestFormatCount(t *testing.T) {
	for n, want := range map[int64]string{
		7e9: "7B", 1.3e9: "1.3B", 70e9: "70B", 340e6: "340M", 137e3: "137k", 175e9: "175B", 6.738e9: "6.738B",
		1.5e12: "1.5T", 1e15: "1000T", 0: "0", 12: "12", 999: "999", 1000: "1k", 1500: "1500", 12500: "12500",
		137500: "137500", 1024: "1024", 1 << 20: "1048576", 1234567: "1234567", 1.234e9: "1.234B", 25e6: "25M",
		-7: "-7", math.MaxInt64: "9223372036854775807", 9223372e12: "9223372T",
	} {
		assert.Equal(t, want, size.FormatCount(n), n)
		if n < 0 {
			continue
		}
		back, err := size.ParseCount(size.FormatCount(n))
		require.NoError(t, err, n)
		assert.Equal(t, n, back, n)
	}
}

// FuzzFormatCount: every count FormatCount writes, ParseCount reads back
// to the same value, and so for sizes; every count ParseCount accepts
// formats and parses back to itself.
func FuzzFormatCount(f *testing.F) {
	for in := range countCases {
		f.Add(in, int64(len(in)))
	}
	for _, n := range []int64{0, 1, 999, 1000, 1001, 137e3, 1.3e9, 7e9, 1 << 40, math.MaxInt64, 9223372e12} {
		f.Add("64MiB", n)
	}
	f.Fuzz(func(t *testing.T, s string, n int64) {
		if n >= 0 {
			back, err := size.ParseCount(size.FormatCount(n))
			require.NoError(t, err, n)
			require.Equal(t, n, back, n)
			back, err = size.Parse(size.Format(n))
			require.NoError(t, err, n)
			require.Equal(t, n, back, n)
		}
		if v, err := size.ParseCount(s); err == nil {
			require.GreaterOrEqual(t, v, int64(0))
			back, err := size.ParseCount(size.FormatCount(v))
			require.NoError(t, err, s)
			require.Equal(t, v, back, s)
		}
		_, _ = size.Parse(s)
	})
}

func TestValue(t *testing.T) {
	var bucket int64
	var batch int
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Var(&size.Value[int64]{P: &bucket, Min: 4}, "bucket", "")
	fs.Var(&size.Value[int]{P: &batch, Min: 1, Max: 1 << 20}, "batch", "")
	require.NoError(t, fs.Parse([]string{"--bucket", "25Mi", "--batch", "1Ki"}))
	assert.Equal(t, int64(25<<20), bucket)
	assert.Equal(t, 1024, batch)
	for _, args := range [][]string{{"--bucket", "2"}, {"--batch", "0"}, {"--batch", "2Mi"}, {"--bucket", "-4"}, {"--bucket", ""}} {
		err := fs.Parse(args)
		assert.Error(t, err, args)
	}
	assert.Equal(t, 1024, batch, "a refused value leaves the flag as it was")
	assert.Equal(t, "1Ki", (&size.Value[int]{P: &batch}).String())
	assert.Equal(t, "", (&size.Value[int]{}).String())
}

func TestCountValue(t *testing.T) {
	var params int64
	var batch int
	p := &size.CountValue[int64]{P: &params, Min: 1, Max: 1e15}
	b := &size.CountValue[int]{P: &batch, Min: 1, Max: 1 << 20}
	for in, want := range map[string]int64{"7B": 7e9, "1.3B": 1.3e9, "70B": 70e9, "340M": 340e6, "137k": 137e3, "1000T": 1e15} {
		require.NoError(t, p.Set(in), in)
		assert.Equal(t, want, params, in)
		assert.Equal(t, size.FormatCount(want), p.String(), in)
	}
	require.NoError(t, p.Set("1.3e9"))
	assert.Equal(t, "1.3B", p.String())
	require.NoError(t, b.Set("1Ki"))
	assert.Equal(t, 1024, batch)
	assert.Equal(t, "1024", b.String())
	require.NoError(t, b.Set("137k"))
	assert.Equal(t, "137k", b.String())
	for in, want := range map[string]string{
		"0":      "0 is out of range [1, 1048576]",
		"7B":     "7B is out of range [1, 1048576] (B is billion in a count)",
		"340M":   "340M is out of range [1, 1048576]",
		"4096B":  "4096B is out of range [1, 1048576] (B is billion in a count)",
		"64MiB":  `invalid count "64MiB": MiB is a size in bytes, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k)`,
		"1.5":    `invalid count "1.5": not a whole number`,
		" 2Mi  ": "2Mi is out of range [1, 1048576]",
	} {
		err := b.Set(in)
		require.Error(t, err, in)
		assert.Equal(t, want, err.Error(), in)
	}
	assert.Equal(t, 137000, batch, "a refused value leaves the flag as it was")
	err := (&size.CountValue[int64]{P: &params, Min: 1}).Set("0")
	require.Error(t, err)
	assert.Equal(t, "0 is below the least value 1", err.Error())
	assert.Equal(t, "", (&size.CountValue[int]{}).String())
}

func ExampleParse() {
	for _, s := range []string{"340M", "64Mi", "1.5G", "4096", "1.5Ki", "64MiB", "7B"} {
		n, err := size.Parse(s)
		fmt.Println(s, n, err)
	}
	for _, s := range []string{"64Mb", "1.3B"} {
		_, err := size.Parse(s)
		fmt.Println(err)
	}
	// Output:
	// 340M 340000000 <nil>
	// 64Mi 67108864 <nil>
	// 1.5G 1500000000 <nil>
	// 4096 4096 <nil>
	// 1.5Ki 1536 <nil>
	// 64MiB 67108864 <nil>
	// 7B 7 <nil>
	// invalid size "64Mb": b means bits; write B for bytes, or no unit (such as 340M, 64Mi, 1.5G or 4096)
	// invalid size "1.3B": B means bytes in a size, and 1.3 bytes is not a whole number (1.3 billion bytes is 1.3G)
}

func ExampleParseCount() {
	for _, s := range []string{"7B", "1.3B", "70B", "340M", "137k", "1Ki"} {
		n, err := size.ParseCount(s)
		fmt.Println(s, n, err)
	}
	_, err := size.ParseCount("64MiB")
	fmt.Println(err)
	// Output:
	// 7B 7000000000 <nil>
	// 1.3B 1300000000 <nil>
	// 70B 70000000000 <nil>
	// 340M 340000000 <nil>
	// 137k 137000 <nil>
	// 1Ki 1024 <nil>
	// invalid count "64MiB": MiB is a size in bytes, and a count is meant here (B alone is billion: 7B, 1.3B, 340M or 137k)
}

func ExampleFormat() {
	fmt.Println(size.Format(25<<20), size.Format(1.3e9), size.Format(4096), size.Format(1536))
	// Output: 25Mi 1.3G 4Ki 1536
}

func ExampleFormatCount() {
	fmt.Println(size.FormatCount(7e9), size.FormatCount(1.3e9), size.FormatCount(340e6), size.FormatCount(137e3), size.FormatCount(1234567))
	// Output: 7B 1.3B 340M 137k 1234567
}
