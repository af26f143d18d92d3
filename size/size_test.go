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
		"0": 0, "4096": 4096, " 12 ": 12, "4096B": 4096,
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
		"", " ", "-1", "-1K", "1.5", "1.0001k", "1e-3", "64Mb", "64mb", "1b", "x", "K", "Mi", "1X", "1KK", "1 K",
		"0x10", "1/2", "+5", "1e", "1e99999", "1.2.3", "9223372036854775808", "8192Pi", "1e30", "NaN", "Inf", "1,000",
	} {
		_, err := size.Parse(in)
		assert.Error(t, err, "%q", in)
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

func ExampleParse() {
	for _, s := range []string{"340M", "64Mi", "1.5G", "4096", "1.5Ki", "64MiB"} {
		n, err := size.Parse(s)
		fmt.Println(s, n, err)
	}
	_, err := size.Parse("64Mb")
	fmt.Println(err)
	// Output:
	// 340M 340000000 <nil>
	// 64Mi 67108864 <nil>
	// 1.5G 1500000000 <nil>
	// 4096 4096 <nil>
	// 1.5Ki 1536 <nil>
	// 64MiB 67108864 <nil>
	// invalid size "64Mb": b means bits; write B for bytes, or no unit (such as 340M, 64Mi, 1.5G or 4096)
}

func ExampleFormat() {
	fmt.Println(size.Format(25<<20), size.Format(1.3e9), size.Format(4096), size.Format(1536))
	// Output: 25Mi 1.3G 4Ki 1536
}
