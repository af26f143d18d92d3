package main

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"unicode/utf8"
)

// corpus is the text the model learns: the bytes of the training files and
// of the validation files, each file followed by a newline.
type corpus struct {
	desc       string // what was read, for the header
	train, val []byte
	// trainStarts are the offsets in train where each training file
	// begins (the files in their seeded order, each followed by '\n').
	trainStarts []int
	trainFiles  int
	valFiles    int
	skipped     int // binary files left out
	// late are the training windows free of -late-bytes (late.go), nil
	// without it.
	late *lateWindows
}

// defaultCorpus is the directory the default corpus is read from: the Go
// standard library's source, $GOROOT/src, where GOROOT is the environment
// variable if set, else what go env GOROOT says.
func defaultCorpus() (string, error) {
	root := os.Getenv("GOROOT")
	if root == "" {
		out, err := exec.Command("go", "env", "GOROOT").Output()
		root = strings.TrimSpace(string(out))
		if err != nil || root == "" {
			return "", fmt.Errorf("finding the default corpus: go env GOROOT failed (%v); set GOROOT or pass -corpus DIR", err)
		}
	}
	return filepath.Join(root, "src"), nil
}

// isText reports whether b looks like text: valid UTF-8 without NUL bytes.
func isText(b []byte) bool {
	return bytes.IndexByte(b, 0) < 0 && utf8.Valid(b)
}

// loadCorpus reads the text files under dir, in a fixed order, and splits
// them into training and validation files: valFrac of the files (at least
// one), chosen by a shuffle seeded by seed, are validation files. With
// goSource only the non-test .go files are read (the default corpus);
// otherwise every regular file, binary ones (a NUL byte or invalid UTF-8)
// skipped. maxBytes caps the bytes read (0: no cap): files are taken in the
// shuffled order until the cap is reached, so the cap keeps the split's
// proportions. Every rank calls it with the same arguments and gets the
// same corpus.
func loadCorpus(dir string, goSource bool, valFrac float64, seed uint64, maxBytes int64) (*corpus, error) {
	fi, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("corpus: %w", err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("corpus: %s is not a directory", dir)
	}
	var files []string
	err = filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			// testdata holds fixtures, often binary or generated; hidden
			// directories are VCS metadata.
			if path != dir && (strings.HasPrefix(name, ".") || (goSource && name == "testdata")) {
				return filepath.SkipDir
			}
			return nil
		}
		if !d.Type().IsRegular() {
			return nil
		}
		if goSource && (!strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go")) {
			return nil
		}
		files = append(files, path)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("corpus: reading %s: %w", dir, err)
	}
	if len(files) == 0 {
		if goSource {
			return nil, fmt.Errorf("corpus: no non-test .go files under %s", dir)
		}
		return nil, fmt.Errorf("corpus: %s holds no files", dir)
	}
	slices.Sort(files) // WalkDir's order is lexical already; this makes it explicit
	rng := rand.New(rand.NewPCG(seed, 0x636f72707573))
	rng.Shuffle(len(files), func(i, j int) { files[i], files[j] = files[j], files[i] })

	c := &corpus{desc: dir}
	var texts [][]byte
	var total int64
	for _, f := range files {
		if maxBytes > 0 && total >= maxBytes {
			break
		}
		b, err := os.ReadFile(f)
		if err != nil {
			return nil, fmt.Errorf("corpus: %w", err)
		}
		if len(b) == 0 {
			continue
		}
		if !isText(b) {
			c.skipped++
			continue
		}
		texts = append(texts, b)
		total += int64(len(b)) + 1
	}
	if len(texts) == 0 {
		return nil, fmt.Errorf("corpus: %s holds no text files (%d binary, the rest empty)", dir, c.skipped)
	}
	if len(texts) < 2 {
		return nil, fmt.Errorf("corpus: %s holds one text file; the split into training and validation is by file, so it needs at least 2", dir)
	}
	nVal := max(1, int(float64(len(texts))*valFrac+0.5))
	nVal = min(nVal, len(texts)-1)
	for i, t := range texts {
		if i < nVal {
			c.val = append(append(c.val, t...), '\n')
			c.valFiles++
		} else {
			c.trainStarts = append(c.trainStarts, len(c.train))
			c.train = append(append(c.train, t...), '\n')
			c.trainFiles++
		}
	}
	return c, nil
}

// errSmallCorpus is returned when the corpus cannot fill a batch.
var errSmallCorpus = errors.New("corpus too small")

// check reports a corpus that cannot fill one global batch of sequences of
// context+1 bytes (training) or one validation window.
func (c *corpus) check(batch, context int) error {
	if need := batch * (context + 1); len(c.train) < need {
		return fmt.Errorf("%w: the %d training files hold %d bytes, fewer than one global batch (%d sequences of %d bytes: %d)",
			errSmallCorpus, c.trainFiles, len(c.train), batch, context+1, need)
	}
	if len(c.val) < context+1 {
		return fmt.Errorf("%w: the %d validation files hold %d bytes, fewer than one sequence of %d", errSmallCorpus, c.valFiles, len(c.val), context+1)
	}
	return nil
}

// rankText returns the training text of rank of workers under -rank-data
// files: the rank's block of the training files in their seeded order,
// files [rank·n/workers, (rank+1)·n/workers) of n, and how many files it
// holds.
func (c *corpus) rankText(rank, workers int) (text []byte, files int) {
	n := len(c.trainStarts)
	lo, hi := rank*n/workers, (rank+1)*n/workers
	end := len(c.train)
	if hi < n {
		end = c.trainStarts[hi]
	}
	if lo >= hi {
		return nil, 0
	}
	return c.train[c.trainStarts[lo]:end], hi - lo
}

// checkRanks reports a -rank-data files split that cannot be made: fewer
// training files than ranks, or a rank whose files cannot fill one window
// of context+1 bytes.
func (c *corpus) checkRanks(workers, context int) error {
	if c.trainFiles < workers {
		return fmt.Errorf("%w: -rank-data files gives each of the %d ranks its own training files, and there are %d",
			errSmallCorpus, workers, c.trainFiles)
	}
	for r := range workers {
		if t, files := c.rankText(r, workers); len(t) < context+1 {
			return fmt.Errorf("%w: under -rank-data files rank %d's %d training files hold %d bytes, fewer than one sequence of %d",
				errSmallCorpus, r, files, len(t), context+1)
		}
	}
	return nil
}

// batcher cuts training batches out of the training bytes: the global
// batch of a step is batch windows at offsets drawn from a generator
// seeded by the seed and the step, the same on every rank; a rank takes
// its own shard, windows [lo, hi). With own set (-rank-data files) text
// is the rank's own training files and the rank draws its hi-lo windows
// from them with a generator of its own.
type batcher struct {
	text    []byte
	context int
	batch   int
	lo, hi  int
	seed    uint64
	own     bool
	rank    int
	x, y    []int32 // the shard, reused
	offsets []int
	late    *lateWindows // windows drawn before late.from, nil for any
}

func newBatcher(text []byte, context, batch, rank, workers int, seed uint64) *batcher {
	lo, hi := rank*batch/workers, (rank+1)*batch/workers
	return &batcher{
		text: text, context: context, batch: batch, lo: lo, hi: hi, seed: seed,
		x: make([]int32, (hi-lo)*context), y: make([]int32, (hi-lo)*context),
		offsets: make([]int, batch),
	}
}

// next returns this rank's shard of the global batch of step: inputs and
// next bytes, both (hi-lo) x context. The slices are reused by the next
// call. Before step late.from the windows are drawn from those free of the
// late bytes only.
func (b *batcher) next(step int) (x, y []int32) {
	rng := rand.New(rand.NewPCG(b.seed, uint64(step)+1))
	offsets := b.offsets
	if b.own {
		// A stream per rank and step; rank 0's is not the shared one.
		rng = rand.New(rand.NewPCG(b.seed^0x72616e6b64617461, uint64(step)<<16|uint64(b.rank)))
		offsets = b.offsets[b.lo:b.hi]
	}
	span := len(b.text) - b.context
	for i := range offsets {
		if b.late != nil && step < b.late.from {
			offsets[i] = b.late.draw(rng)
		} else {
			offsets[i] = rng.IntN(span)
		}
	}
	for i, off := range b.offsets[b.lo:b.hi] {
		w := b.text[off : off+b.context+1]
		for j := range b.context {
			b.x[i*b.context+j] = int32(w[j])
			b.y[i*b.context+j] = int32(w[j+1])
		}
	}
	return b.x, b.y
}

// valWindows returns the validation windows of a rank: n windows of
// context+1 bytes evenly spaced over the validation text (fewer if the
// text is short), split over the ranks; every rank computes the same list.
func valWindows(text []byte, context, n, rank, workers int) (x, y []int32, count int) {
	span := len(text) - context // offsets 0..span-1 are valid
	n = min(n, span)
	lo, hi := rank*n/workers, (rank+1)*n/workers
	for i := lo; i < hi; i++ {
		off := int(int64(i) * int64(span) / int64(n))
		w := text[off : off+context+1]
		for j := range context {
			x = append(x, int32(w[j]))
			y = append(y, int32(w[j+1]))
		}
	}
	return x, y, hi - lo
}
