// Package idx reads and writes the IDX files in which the MNIST data set is
// distributed: a big-endian header (magic number, then one uint32 per
// dimension) followed by the data. Files may be gzip-compressed; readers
// detect this from the gzip magic bytes, so plain and .gz files are read
// alike.
//
// Only unsigned-byte data (type code 0x08) is supported, which is what MNIST
// uses: images are 3-dimensional (count, rows, columns; magic 0x00000803)
// and labels 1-dimensional (count; magic 0x00000801). Every reader checks the
// magic number, the dimension sizes and that the data is exactly as long as
// the header says, and reports anything else as an error: a truncated,
// foreign or corrupted file never causes a panic or a huge allocation.
package idx

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// The magic numbers of the two kinds of MNIST file.
const (
	MagicImages = 0x00000803 // unsigned bytes, 3 dimensions
	MagicLabels = 0x00000801 // unsigned bytes, 1 dimension
)

// MaxBytes is the largest data section a reader accepts (1 GiB); a header
// claiming more is rejected before anything is allocated.
const MaxBytes = 1 << 30

// ErrFormat is wrapped by every error that describes a malformed file (as
// opposed to an I/O error of the underlying reader).
var ErrFormat = errors.New("idx: malformed file")

// Images is a stack of N grey-scale images of Rows x Cols bytes, stored
// image after image, row after row (the IDX order).
type Images struct {
	N, Rows, Cols int
	Pixels        []byte // len N*Rows*Cols
}

// Image returns the pixels of image i (a sub-slice of Pixels).
func (im *Images) Image(i int) []byte {
	n := im.Rows * im.Cols
	return im.Pixels[i*n : (i+1)*n : (i+1)*n]
}

// Set is a labelled data set: Labels[i] belongs to image i.
type Set struct {
	Images *Images
	Labels []byte
}

// Len is the number of examples.
func (s *Set) Len() int { return len(s.Labels) }

// formatError returns an error wrapping ErrFormat.
func formatError(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrFormat}, args...)...)
}

// decompress returns a reader of r's content, gunzipping it when it starts
// with the gzip magic bytes.
func decompress(r io.Reader) (io.Reader, func() error, error) {
	br := bufio.NewReader(r)
	head, err := br.Peek(2)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, nil, fmt.Errorf("idx: reading header: %w", err)
	}
	if len(head) == 2 && head[0] == 0x1f && head[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, nil, formatError("bad gzip header: %v", err)
		}
		zr.Multistream(false)
		return zr, zr.Close, nil
	}
	return br, func() error { return nil }, nil
}

// read decodes one IDX array whose magic number must be magic; it returns
// its dimensions and data.
func read(r io.Reader, magic uint32) ([]int, []byte, error) {
	src, closeFn, err := decompress(r)
	if err != nil {
		return nil, nil, err
	}
	defer closeFn()

	var hdr [4]byte
	if _, err := io.ReadFull(src, hdr[:]); err != nil {
		return nil, nil, readError("magic number", err)
	}
	got := binary.BigEndian.Uint32(hdr[:])
	if got != magic {
		return nil, nil, formatError("magic number 0x%08x, want 0x%08x (%s)", got, magic, describe(magic))
	}
	ndim := int(magic & 0xff)
	dims := make([]int, ndim)
	total := int64(1)
	for i := range dims {
		if _, err := io.ReadFull(src, hdr[:]); err != nil {
			return nil, nil, readError(fmt.Sprintf("size of dimension %d", i), err)
		}
		d := binary.BigEndian.Uint32(hdr[:])
		if d > MaxBytes {
			return nil, nil, formatError("dimension %d has size %d, more than %d", i, d, MaxBytes)
		}
		dims[i] = int(d)
		total *= int64(d)
		if total > MaxBytes {
			return nil, nil, formatError("dimensions %v hold more than %d bytes", dims[:i+1], MaxBytes)
		}
	}
	// ReadAll grows its buffer as data arrives, so a header that lies about
	// the size costs no more memory than the file really holds. Reaching the
	// end of a gzip stream verifies its checksum.
	data, err := io.ReadAll(io.LimitReader(src, total+1))
	if err != nil {
		return nil, nil, readError("data", err)
	}
	switch {
	case int64(len(data)) < total:
		return nil, nil, formatError("truncated: dimensions %v need %d data bytes, file has %d", dims, total, len(data))
	case int64(len(data)) > total:
		return nil, nil, formatError("trailing data after the %d bytes that dimensions %v need", total, dims)
	}
	return dims, data, nil
}

// readError describes a failure to read part of a file.
func readError(what string, err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return formatError("truncated while reading the %s", what)
	}
	if errors.Is(err, gzip.ErrChecksum) || errors.Is(err, gzip.ErrHeader) {
		return formatError("corrupt gzip stream while reading the %s: %v", what, err)
	}
	return fmt.Errorf("idx: reading the %s: %w", what, err)
}

func describe(magic uint32) string {
	switch magic {
	case MagicImages:
		return "an IDX image file"
	case MagicLabels:
		return "an IDX label file"
	}
	return "IDX"
}

// ReadImages decodes an image file (magic 0x00000803), plain or gzipped.
func ReadImages(r io.Reader) (*Images, error) {
	dims, data, err := read(r, MagicImages)
	if err != nil {
		return nil, err
	}
	if dims[1] == 0 || dims[2] == 0 {
		return nil, formatError("images of %d x %d pixels", dims[1], dims[2])
	}
	return &Images{N: dims[0], Rows: dims[1], Cols: dims[2], Pixels: data}, nil
}

// ReadLabels decodes a label file (magic 0x00000801), plain or gzipped.
func ReadLabels(r io.Reader) ([]byte, error) {
	_, data, err := read(r, MagicLabels)
	return data, err
}

// ReadImagesFile reads an image file; errors name the file.
func ReadImagesFile(path string) (*Images, error) {
	var im *Images
	err := withFile(path, func(r io.Reader) (err error) {
		im, err = ReadImages(r)
		return err
	})
	return im, err
}

// ReadLabelsFile reads a label file; errors name the file.
func ReadLabelsFile(path string) ([]byte, error) {
	var l []byte
	err := withFile(path, func(r io.Reader) (err error) {
		l, err = ReadLabels(r)
		return err
	})
	return l, err
}

func withFile(path string, fn func(io.Reader) error) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := fn(f); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

// Load reads an image file and its label file and checks that they hold the
// same number of examples.
func Load(imagesPath, labelsPath string) (*Set, error) {
	im, err := ReadImagesFile(imagesPath)
	if err != nil {
		return nil, err
	}
	l, err := ReadLabelsFile(labelsPath)
	if err != nil {
		return nil, err
	}
	if im.N != len(l) {
		return nil, formatError("%s holds %d images but %s holds %d labels", imagesPath, im.N, labelsPath, len(l))
	}
	return &Set{Images: im, Labels: l}, nil
}

// WriteImages encodes im as an IDX image file, gzip-compressed when gz is
// true.
func WriteImages(w io.Writer, im *Images, gz bool) error {
	if im.N < 0 || im.Rows <= 0 || im.Cols <= 0 || len(im.Pixels) != im.N*im.Rows*im.Cols {
		return fmt.Errorf("idx: %d images of %d x %d pixels need %d bytes, have %d",
			im.N, im.Rows, im.Cols, im.N*im.Rows*im.Cols, len(im.Pixels))
	}
	return write(w, MagicImages, []int{im.N, im.Rows, im.Cols}, im.Pixels, gz)
}

// WriteLabels encodes labels as an IDX label file, gzip-compressed when gz
// is true.
func WriteLabels(w io.Writer, labels []byte, gz bool) error {
	return write(w, MagicLabels, []int{len(labels)}, labels, gz)
}

func write(w io.Writer, magic uint32, dims []int, data []byte, gz bool) error {
	var buf bytes.Buffer
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], magic)
	buf.Write(hdr[:])
	for _, d := range dims {
		binary.BigEndian.PutUint32(hdr[:], uint32(d))
		buf.Write(hdr[:])
	}
	buf.Write(data)
	if !gz {
		_, err := w.Write(buf.Bytes())
		return err
	}
	zw, err := gzip.NewWriterLevel(w, gzip.BestCompression)
	if err != nil {
		return err
	}
	if _, err := zw.Write(buf.Bytes()); err != nil {
		return err
	}
	return zw.Close()
}
