package idx

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The real MNIST subset shipped with the example (see ../testdata/gen.go).
var (
	trainImages = filepath.Join("..", "testdata", "train-images-idx3-ubyte.gz")
	trainLabels = filepath.Join("..", "testdata", "train-labels-idx1-ubyte.gz")
	testImages  = filepath.Join("..", "testdata", "t10k-images-idx3-ubyte.gz")
	testLabels  = filepath.Join("..", "testdata", "t10k-labels-idx1-ubyte.gz")
)

func TestLoadRealSubset(t *testing.T) {
	set, err := Load(trainImages, trainLabels)
	require.NoError(t, err)
	assert.Equal(t, 500, set.Len())
	assert.Equal(t, 500, set.Images.N)
	assert.Equal(t, 28, set.Images.Rows)
	assert.Equal(t, 28, set.Images.Cols)
	assert.Len(t, set.Images.Image(499), 28*28)
	// The first five training labels of MNIST.
	assert.Equal(t, []byte{5, 0, 4, 1, 9}, set.Labels[:5])
	for _, l := range set.Labels {
		assert.Less(t, l, byte(10))
	}
	test, err := Load(testImages, testLabels)
	require.NoError(t, err)
	assert.Equal(t, 200, test.Len())
	assert.Equal(t, []byte{7, 2, 1, 0, 4}, test.Labels[:5])
}

func gunzip(t *testing.T, path string) []byte {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	zr, err := gzip.NewReader(f)
	require.NoError(t, err)
	b, err := io.ReadAll(zr)
	require.NoError(t, err)
	return b
}

func gz(b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	zw.Write(b)
	zw.Close()
	return buf.Bytes()
}

func TestPlainAndGzipAgree(t *testing.T) {
	raw := gunzip(t, trainImages)
	a, err := ReadImages(bytes.NewReader(raw))
	require.NoError(t, err)
	f, err := os.Open(trainImages)
	require.NoError(t, err)
	defer f.Close()
	b, err := ReadImages(f)
	require.NoError(t, err)
	assert.Equal(t, a, b)
	// The header is the real one: magic, 500 images of 28 x 28.
	assert.Equal(t, []byte{0, 0, 8, 3, 0, 0, 1, 0xf4, 0, 0, 0, 28, 0, 0, 0, 28}, raw[:16])
}

func TestRoundTrip(t *testing.T) {
	im := &Images{N: 2, Rows: 2, Cols: 3, Pixels: []byte{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}}
	for _, compress := range []bool{false, true} {
		var b bytes.Buffer
		require.NoError(t, WriteImages(&b, im, compress))
		got, err := ReadImages(&b)
		require.NoError(t, err)
		assert.Equal(t, im, got)

		b.Reset()
		require.NoError(t, WriteLabels(&b, []byte{3, 1, 4}, compress))
		l, err := ReadLabels(&b)
		require.NoError(t, err)
		assert.Equal(t, []byte{3, 1, 4}, l)
	}
	assert.Error(t, WriteImages(io.Discard, &Images{N: 2, Rows: 2, Cols: 2, Pixels: []byte{1}}, false))
}

func header(magic uint32, dims ...uint32) []byte {
	b := binary.BigEndian.AppendUint32(nil, magic)
	for _, d := range dims {
		b = binary.BigEndian.AppendUint32(b, d)
	}
	return b
}

func TestCorrupt(t *testing.T) {
	rawImages := gunzip(t, trainImages)
	rawLabels := gunzip(t, trainLabels)
	realGz, err := os.ReadFile(trainImages)
	require.NoError(t, err)
	flipped := bytes.Clone(realGz)
	flipped[len(flipped)-6] ^= 0xff // inside the CRC-32 of the gzip trailer

	cases := []struct {
		name   string
		data   []byte
		labels bool   // read as a label file
		want   string // part of the error
	}{
		{"empty", nil, false, "truncated while reading the magic number"},
		{"labels read as images", rawLabels, false, "magic number 0x00000801, want 0x00000803"},
		{"images read as labels", rawImages, true, "magic number 0x00000803, want 0x00000801"},
		{"bad magic", append(header(0x00000d03, 1, 1, 1), 0), false, "magic number 0x00000d03"},
		{"truncated header", rawImages[:10], false, "truncated while reading the size of dimension 1"},
		{"truncated data", rawImages[:len(rawImages)-1], false, "truncated: dimensions [500 28 28] need 392000 data bytes, file has 391999"},
		{"truncated gzip data", gz(rawImages[:1000]), false, "truncated: dimensions [500 28 28]"},
		{"truncated gzip stream", realGz[:len(realGz)/2], false, "truncated while reading the data"},
		{"bad gzip checksum", flipped, false, "corrupt gzip stream"},
		{"trailing data", append(bytes.Clone(rawLabels), 7), true, "trailing data"},
		{"foreign gzip content", gz([]byte("this is a text file, not an IDX file at all")), false, "magic number 0x74686973"},
		{"foreign plain content", []byte("%PDF-1.4 not mnist"), false, "magic number"},
		{"huge claimed size", header(MagicImages, 1<<30, 28, 28), false, "hold more than"},
		{"zero-size images", header(MagicImages, 0, 0, 28), false, "images of 0 x 28 pixels"},
		{"gzip magic only", []byte{0x1f, 0x8b}, false, "bad gzip header"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var err error
			if c.labels {
				_, err = ReadLabels(bytes.NewReader(c.data))
			} else {
				_, err = ReadImages(bytes.NewReader(c.data))
			}
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrFormat)
			assert.Contains(t, err.Error(), c.want)
		})
	}
}

func TestLoadCountMismatch(t *testing.T) {
	_, err := Load(trainImages, testLabels)
	require.Error(t, err)
	assert.ErrorIs(t, err, ErrFormat)
	assert.Contains(t, err.Error(), "holds 500 images but")
	assert.Contains(t, err.Error(), "holds 200 labels")
}

func TestLoadMissingFile(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "nope.gz"), trainLabels)
	require.Error(t, err)
	assert.ErrorIs(t, err, os.ErrNotExist)
}

func TestErrorNamesFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "bad-images.gz")
	require.NoError(t, os.WriteFile(path, gz([]byte("nonsense")), 0o644))
	_, err := ReadImagesFile(path)
	require.Error(t, err)
	assert.Contains(t, err.Error(), path)
}

func FuzzReadImages(f *testing.F) {
	f.Add(header(MagicImages, 1, 2, 2))
	f.Add(append(header(MagicImages, 1, 1, 2), 1, 2))
	f.Add(gz(append(header(MagicLabels, 2), 1, 2)))
	f.Fuzz(func(t *testing.T, b []byte) {
		im, err := ReadImages(bytes.NewReader(b))
		if err == nil {
			require.Len(t, im.Pixels, im.N*im.Rows*im.Cols)
		}
		_, _ = ReadLabels(bytes.NewReader(b))
	})
}
