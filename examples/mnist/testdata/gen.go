//go:build ignore

// gen.go writes the small real MNIST subset the tests use: the first 500
// training and the first 200 test examples of the original files, re-encoded
// as gzipped IDX files under the original names. Run from examples/mnist
// (this is what "go generate" does):
//
//	go run testdata/gen.go -src ../../data/mnist -dst testdata
package main

import (
	"bytes"
	"flag"
	"log"
	"os"
	"path/filepath"

	"github.com/lowbit-ml/lowbit/examples/mnist/idx"
)

func main() {
	src := flag.String("src", "../../data/mnist", "directory holding the original MNIST files")
	dst := flag.String("dst", "testdata", "output directory")
	flag.Parse()
	for _, s := range []struct {
		prefix string
		n      int
	}{{"train", 500}, {"t10k", 200}} {
		images := s.prefix + "-images-idx3-ubyte.gz"
		labels := s.prefix + "-labels-idx1-ubyte.gz"
		set, err := idx.Load(filepath.Join(*src, images), filepath.Join(*src, labels))
		if err != nil {
			log.Fatal(err)
		}
		im := set.Images
		sub := &idx.Images{N: s.n, Rows: im.Rows, Cols: im.Cols, Pixels: im.Pixels[:s.n*im.Rows*im.Cols]}
		var b bytes.Buffer
		if err := idx.WriteImages(&b, sub, true); err != nil {
			log.Fatal(err)
		}
		write(filepath.Join(*dst, images), b.Bytes())
		b.Reset()
		if err := idx.WriteLabels(&b, set.Labels[:s.n], true); err != nil {
			log.Fatal(err)
		}
		write(filepath.Join(*dst, labels), b.Bytes())
	}
}

func write(path string, data []byte) {
	if err := os.WriteFile(path, data, 0o644); err != nil {
		log.Fatal(err)
	}
}
