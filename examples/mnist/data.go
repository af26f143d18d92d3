package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/lowbit-ml/lowbit/examples/mnist/idx"
)

// The file names of the MNIST layout that -data expects.
const (
	trainImagesFile = "train-images-idx3-ubyte.gz"
	trainLabelsFile = "train-labels-idx1-ubyte.gz"
	testImagesFile  = "t10k-images-idx3-ubyte.gz"
	testLabelsFile  = "t10k-labels-idx1-ubyte.gz"
)

// dataset is one labelled MNIST split, read-only once loaded, so that all
// in-process ranks share it.
type dataset struct {
	images *idx.Images
	labels []byte
}

func (d *dataset) len() int { return len(d.labels) }

func (d *dataset) image(i int) []byte { return d.images.Image(i) }

// inDir is the path of the MNIST file name in dir: the plain file (name
// without ".gz") where dir holds one, else name. A plain file reads in a
// fraction of the time: every restart of a job reads the data again.
func inDir(dir, name string) string {
	plain := filepath.Join(dir, strings.TrimSuffix(name, ".gz"))
	if st, err := os.Stat(plain); err == nil && st.Mode().IsRegular() {
		return plain
	}
	return filepath.Join(dir, name)
}

// loadSplit reads one split from dir and checks that it is MNIST-shaped:
// 28 x 28 images and labels below 10.
func loadSplit(dir, images, labels string) (*dataset, error) {
	set, err := idx.Load(inDir(dir, images), inDir(dir, labels))
	if err != nil {
		return nil, err
	}
	if r, c := set.Images.Rows, set.Images.Cols; r*c != numInputs {
		return nil, fmt.Errorf("%s: images are %d x %d pixels, the model takes 28 x 28", images, r, c)
	}
	if set.Len() == 0 {
		return nil, fmt.Errorf("%s: no examples", images)
	}
	for i, l := range set.Labels {
		if int(l) >= numClasses {
			return nil, fmt.Errorf("%s: label %d of example %d is not a digit", labels, l, i)
		}
	}
	return &dataset{images: set.Images, labels: set.Labels}, nil
}

// loadMNIST reads the training and test splits from dir.
func loadMNIST(dir string) (train, test *dataset, err error) {
	if train, err = loadSplit(dir, trainImagesFile, trainLabelsFile); err != nil {
		return nil, nil, fmt.Errorf("training set: %w (run make mnist-data, or pass -data DIR)", err)
	}
	if test, err = loadSplit(dir, testImagesFile, testLabelsFile); err != nil {
		return nil, nil, fmt.Errorf("test set: %w (run make mnist-data, or pass -data DIR)", err)
	}
	return train, test, nil
}
