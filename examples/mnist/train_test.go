package main

import (
	"bytes"
	"context"
	"image/png"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/examples/mnist/idx"
	"github.com/lowbit-ml/lowbit/outer"
)

// trainLocal runs cfg on w in-process ranks and returns every rank's result.
func trainLocal(t *testing.T, w int, train, test *dataset, cfg trainConfig) []*result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res := make([]*result, w)
	var mu sync.Mutex
	err := local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		r, err := trainRank(ctx, c, train, test, cfg, nil)
		mu.Lock()
		res[c.Rank()] = r
		mu.Unlock()
		return err
	})
	require.NoError(t, err)
	return res
}

func smallConfig(optimizer string) trainConfig {
	// diloco: the 1-bit codec, 2 fragments with an exchange in flight
	// for 2 steps (launches at every even step, merges 2 later).
	out := outer.DefaultConfig()
	out.H, out.Fragments, out.Delay, out.Codec = 4, 2, 2, outer.CodecOneBit
	return trainConfig{
		optimizer:     optimizer,
		hyper:         hyper{lr: 2e-3, freezeStep: 10, outer: out},
		epochs:        3,
		batch:         32,
		seed:          3,
		evalsPerEpoch: 2,
	}
}

func mean(x []float64) float64 {
	var s float64
	for _, v := range x {
		s += v
	}
	return s / float64(len(x))
}

// TestTrainingLearns trains on the real 500-example subset and checks that
// the loss falls and the test accuracy rises well above chance, for the
// exact and the 1-bit optimizer, and that both start from the same
// parameters on every rank.
func TestTrainingLearns(t *testing.T) {
	train, test := loadTestdata(t)
	var first []*result
	for _, name := range []string{"adam", "onebit-adam"} {
		t.Run(name, func(t *testing.T) {
			res := trainLocal(t, 4, train, test, smallConfig(name))
			r := res[0]
			for _, o := range res[1:] {
				assert.Equal(t, r.initHash, o.initHash, "ranks start alike")
				assert.Equal(t, r.finalHash, o.finalHash, "ranks end alike")
				assert.Equal(t, r.loss, o.loss)
			}
			steps := 3 * (500 / 32)
			require.Len(t, r.loss, steps)
			early, late := mean(r.loss[:5]), mean(r.loss[steps-5:])
			assert.Less(t, late, early/3, "loss falls: first steps %.3f, last steps %.3f", early, late)
			assert.Less(t, r.evals[0].acc, 0.3, "untrained model is near chance")
			assert.Greater(t, r.test.acc, 0.75, "trained model classifies most test digits")
			assert.Positive(t, r.bytesSent)
			first = append(first, r)
		})
	}
	require.Len(t, first, 2)
	assert.Equal(t, first[0].initHash, first[1].initHash, "exact and compressed runs start from identical parameters")
	assert.NotEqual(t, first[0].finalHash, first[1].finalHash)
	assert.Less(t, first[1].bytesSent, first[0].bytesSent/2, "1-bit Adam sends less")
}

// TestWorkersAgree checks the sharding and gradient scaling: with exact Adam
// the global batch's gradient does not depend on how many workers share it,
// so runs on 1 and 4 workers follow the same loss curve (up to rounding).
func TestWorkersAgree(t *testing.T) {
	train, test := loadTestdata(t)
	cfg := smallConfig("adam")
	cfg.epochs = 1
	one := trainLocal(t, 1, train, test, cfg)[0]
	four := trainLocal(t, 4, train, test, cfg)[0]
	assert.Equal(t, one.initHash, four.initHash)
	require.Len(t, four.loss, len(one.loss))
	for i := range one.loss {
		assert.InDelta(t, one.loss[i], four.loss[i], 2e-3*max(1, one.loss[i]), "step %d", i)
	}
	assert.InDelta(t, one.test.acc, four.test.acc, 0.011)
}

func TestRunCompare(t *testing.T) {
	dir := t.TempDir()
	plotPath := filepath.Join(dir, "sub", "curves.png")
	var out, errOut bytes.Buffer
	err := run(context.Background(), []string{
		"-data", "testdata", "-compare", "-optimizer", "onebit-adam", "-workers", "2",
		"-epochs", "1", "-batch", "50", "-freeze-step", "4", "-lr", "2e-3", "-plot", plotPath,
	}, &out, &errOut)
	require.NoError(t, err, errOut.String())
	text := out.String()
	for _, want := range []string{"optimizer", "test acc", "train loss", "compute", "comm", "compress", "sent/worker", "per step and worker", "onebit-adam vs adam"} {
		assert.Contains(t, text, want)
	}
	var rows []string
	for _, line := range strings.Split(text, "\n") {
		f := strings.Fields(line)
		// The main table's rows: the name, then the accuracy as a percentage.
		if len(f) > 2 && (f[0] == "adam" || f[0] == "onebit-adam") && strings.HasSuffix(f[1], "%") {
			rows = append(rows, f[0])
		}
	}
	assert.Equal(t, []string{"adam", "onebit-adam"}, rows)
	// One finished progress line per epoch and run.
	assert.Equal(t, 2, strings.Count(errOut.String(), "epoch 1/1"))

	f, err := os.Open(plotPath)
	require.NoError(t, err)
	defer f.Close()
	img, err := png.Decode(f)
	require.NoError(t, err)
	assert.Greater(t, img.Bounds().Dx(), 500)
}

func TestRunErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-optimizer", "sgd"}, `unknown -optimizer "sgd"`},
		{[]string{"-optimizer", "onebit-adam-sharded", "-reduce", "fp16"}, "onebit-adam-sharded averages in fp32 only"},
		{[]string{"-backend", "tcp"}, `invalid value "tcp" for --backend: want local or mpi`},
		{[]string{"-workers", "0"}, `invalid value "0" for --workers: want 1 to 1024`},
		{[]string{"-lr", "-1"}, `invalid value "-1" for --lr: want a learning rate in (0, 10]`},
		{[]string{"-data", "no/such/dir"}, "run make mnist-data"},
		{[]string{"-data", "testdata", "-batch", "1000"}, "larger than the 500 training examples"},
		{[]string{"-data", "testdata", "-batch", "2", "-workers", "4"}, "smaller than the 4 workers"},
		{[]string{"extra"}, "unexpected arguments"},
		{[]string{"-optimizer", "diloco", "-outer-codec", "int4"}, `invalid value "int4" for --outer-codec: want one of fp32, bf16, int8, 1bit, sparse`},
		{[]string{"-optimizer", "diloco", "-outer-h", "0"}, `invalid value "0" for --outer-h: want >= 1`},
		{[]string{"-optimizer", "diloco", "-outer-h", "10", "-outer-fragments", "4", "-outer-delay", "3"}, `invalid value "3" for --outer-delay: want in [0, H/Fragments = 2]`},
	} {
		err := run(context.Background(), c.args, &bytes.Buffer{}, &bytes.Buffer{})
		require.Error(t, err, "%v", c.args)
		assert.Contains(t, err.Error(), c.want, "%v", c.args)
	}
}

func TestRunOrder(t *testing.T) {
	for _, c := range []struct {
		name    string
		compare bool
		want    []string
	}{
		{"adam", false, []string{"adam"}},
		{"onebit-adam", true, []string{"adam", "onebit-adam"}},
		{"onebit-adam-sharded", false, []string{"onebit-adam-sharded"}},
		{"onebit-adam-sharded", true, []string{"adam", "onebit-adam-sharded"}},
		{"onebit-lamb", true, []string{"lamb", "onebit-lamb"}},
		{"zeroone-adam", true, []string{"adam", "zeroone-adam"}},
		{"adam", true, []string{"adam", "onebit-adam"}},
		{"lamb", true, []string{"lamb", "onebit-lamb"}},
	} {
		got, err := runOrder(c.name, c.compare)
		require.NoError(t, err)
		assert.Equal(t, c.want, got)
	}
	got, err := runOrder("zero-adam,adam,diloco", false)
	require.NoError(t, err)
	assert.Equal(t, []string{"zero-adam", "adam", "diloco"}, got, "a list, in its order")
	for list, want := range map[string]string{
		"adam,sgd":         `unknown -optimizer "sgd" in "adam,sgd"`,
		"adam,lamb,adam":   "names adam twice",
		"adam,onebit-adam": "-compare trains one -optimizer",
	} {
		_, err := runOrder(list, list == "adam,onebit-adam")
		assert.ErrorContains(t, err, want, list)
	}
	_, _, err = reducesOf("adam,onebit-adam-sharded", "fp16")
	assert.ErrorContains(t, err, "onebit-adam-sharded averages in fp32 only", "-reduce must suit every optimizer of a list")
	m, z, err := reducesOf("adam,zero-adam", "fp32")
	require.NoError(t, err)
	wm, wz, _ := parseReduces("zero-adam", "fp32")
	assert.Equal(t, wm, m)
	assert.Equal(t, wz, z)
}

// writeIDX writes what f encodes into dir/name.
func writeIDX(t *testing.T, dir, name string, f func(*bytes.Buffer) error) {
	var b bytes.Buffer
	require.NoError(t, f(&b))
	require.NoError(t, os.WriteFile(filepath.Join(dir, name), b.Bytes(), 0o644))
}

func TestLoadRejectsNonMNIST(t *testing.T) {
	for _, c := range []struct {
		name   string
		images *idx.Images
		labels []byte
		want   string
	}{
		{"small images", &idx.Images{N: 2, Rows: 2, Cols: 2, Pixels: make([]byte, 8)}, []byte{1, 2}, "images are 2 x 2 pixels"},
		{"label 10", &idx.Images{N: 2, Rows: 28, Cols: 28, Pixels: make([]byte, 2*784)}, []byte{1, 10}, "label 10 of example 1 is not a digit"},
		{"no examples", &idx.Images{N: 0, Rows: 28, Cols: 28}, []byte{}, "no examples"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			for _, prefix := range []string{"train", "t10k"} {
				writeIDX(t, dir, prefix+"-images-idx3-ubyte.gz", func(b *bytes.Buffer) error { return idx.WriteImages(b, c.images, true) })
				writeIDX(t, dir, prefix+"-labels-idx1-ubyte.gz", func(b *bytes.Buffer) error { return idx.WriteLabels(b, c.labels, false) })
			}
			_, _, err := loadMNIST(dir)
			require.Error(t, err)
			assert.Contains(t, err.Error(), c.want)
			assert.Contains(t, err.Error(), "training set")
		})
	}
}

// The plain files (the MNIST names without .gz) are read where a directory
// holds them beside the gzipped ones: the same examples, and a damaged
// plain file is an error naming it, not a silent fall-back to the .gz.
func TestLoadPrefersPlainFiles(t *testing.T) {
	train, test, err := loadMNIST("testdata")
	require.NoError(t, err)
	dir := t.TempDir()
	for _, f := range []string{trainImagesFile, trainLabelsFile, testImagesFile, testLabelsFile} {
		b, err := os.ReadFile(filepath.Join("testdata", f))
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, f), b, 0o644))
	}
	writeIDX(t, dir, strings.TrimSuffix(trainImagesFile, ".gz"), func(b *bytes.Buffer) error { return idx.WriteImages(b, train.images, false) })
	writeIDX(t, dir, strings.TrimSuffix(trainLabelsFile, ".gz"), func(b *bytes.Buffer) error { return idx.WriteLabels(b, train.labels, false) })
	plainTrain, plainTest, err := loadMNIST(dir)
	require.NoError(t, err)
	assert.Equal(t, train, plainTrain)
	assert.Equal(t, test, plainTest)

	require.NoError(t, os.Truncate(filepath.Join(dir, strings.TrimSuffix(trainImagesFile, ".gz")), 100))
	_, _, err = loadMNIST(dir)
	require.Error(t, err)
	assert.Contains(t, err.Error(), filepath.Join(dir, strings.TrimSuffix(trainImagesFile, ".gz")))
}
