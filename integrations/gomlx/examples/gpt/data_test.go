package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// letterCorpus writes n files, file k holding only the letter 'a'+k (and
// newlines), size bytes each, and loads them with a fifth held out for
// validation.
func letterCorpus(t *testing.T, n, size int) *corpus {
	t.Helper()
	dir := t.TempDir()
	for k := range n {
		line := strings.Repeat(string(rune('a'+k)), 39) + "\n"
		b := []byte(strings.Repeat(line, size/len(line)+1))[:size]
		require.NoError(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%02d.txt", k)), b, 0o644))
	}
	c, err := loadCorpus(dir, false, 0.2, 7, 0)
	require.NoError(t, err)
	return c
}

// TestRankData: under -rank-data files the training files are dealt out in
// blocks, every rank draws its share of each batch from its own block only,
// the shares make up the global batch's size, the draws repeat for the
// same step and differ between ranks; a split that cannot be made is a
// clear error.
func TestRankData(t *testing.T) {
	c := letterCorpus(t, 10, 2000)
	require.Equal(t, 8, c.trainFiles)
	const w, ctx, batch = 3, 16, 10
	var joined []byte
	letters := make([]map[byte]bool, w)
	for r := range w {
		text, files := c.rankText(r, w)
		assert.Equal(t, (r+1)*8/w-r*8/w, files, "rank %d", r)
		joined = append(joined, text...)
		letters[r] = map[byte]bool{}
		for _, b := range text {
			if b != '\n' {
				letters[r][b] = true
			}
		}
		assert.Len(t, letters[r], files, "rank %d holds its files' letters only", r)
		for q := range r {
			for l := range letters[r] {
				assert.False(t, letters[q][l], "ranks %d and %d share the file of %q", q, r, l)
			}
		}
	}
	assert.Equal(t, c.train, joined, "the blocks, in rank order, are the training text")

	total := 0
	first := make([][]int32, w)
	for r := range w {
		b := c.batcher(ctx, batch, r, w, 1, true)
		again := c.batcher(ctx, batch, r, w, 1, true)
		for step := 1; step <= 5; step++ {
			x, y := b.next(step)
			require.Len(t, y, len(x))
			for _, v := range append(append([]int32{}, x...), y...) {
				if v != '\n' {
					require.True(t, letters[r][byte(v)], "rank %d step %d drew %q, not of its files", r, step, rune(v))
				}
			}
			x = append([]int32{}, x...)
			ax, _ := again.next(step)
			assert.Equal(t, x, ax, "rank %d step %d: the same windows again", r, step)
			if step == 1 {
				first[r] = x
				total += len(x) / ctx
			}
		}
	}
	assert.Equal(t, batch, total, "the ranks' shares make up the global batch")
	assert.NotEqual(t, first[0][:ctx], first[1][:ctx])

	// The shared batches are unchanged by the option's existence.
	shared := c.batcher(ctx, batch, 0, 1, 1, false)
	plain := newBatcher(c.train, ctx, batch, 0, 1, 1)
	sx, _ := shared.next(3)
	px, _ := plain.next(3)
	assert.Equal(t, px, sx)

	require.NoError(t, c.checkRanks(8, ctx))
	err := c.checkRanks(9, ctx)
	require.ErrorIs(t, err, errSmallCorpus)
	assert.ErrorContains(t, err, "-rank-data files gives each of the 9 ranks its own training files, and there are 8")
	small := letterCorpus(t, 10, 20)
	err = small.checkRanks(2, 100)
	require.ErrorIs(t, err, errSmallCorpus)
	assert.ErrorContains(t, err, "rank 0's 4 training files hold 84 bytes, fewer than one sequence of 101")
	require.NoError(t, small.checkRanks(2, 8))
}

// TestRankDataRun: -rank-data files trains, says so in its header, its JSON
// and its Markdown; with -late-bytes, or a value but shared or files, it is
// a one-line usage error.
func TestRankDataRun(t *testing.T) {
	md := filepath.Join(t.TempDir(), "r.md")
	runs, _ := runJSON(t, tiny("-optimizer", "adam", "-steps", "3", "-rank-data", "files", "-final-windows", "16", "-markdown", md)...)
	require.Len(t, runs, 1)
	assert.Equal(t, "files", runs[0].Model.RankData)
	assert.Equal(t, 3, runs[0].Steps)
	b, err := os.ReadFile(md)
	require.NoError(t, err)
	assert.Contains(t, string(b), "its own block of the training files (-rank-data files)")
	var out bytes.Buffer
	args := tiny("-optimizer", "adam", "-steps", "1", "-rank-data", "files", "-final-windows", "16")
	args = slices.DeleteFunc(args, func(a string) bool { return a == "-quiet" })
	require.NoError(t, run(t.Context(), args, &out, io.Discard))
	assert.Contains(t, out.String(), "rank data: each rank draws its share of the batch from its own block of the training files")
	runs, _ = runJSON(t, tiny("-optimizer", "adam", "-steps", "1", "-final-windows", "16")...)
	assert.Equal(t, "shared", runs[0].Model.RankData)

	_, err = parseFlags([]string{"-rank-data", "files", "-late-bytes", "{}"}, io.Discard)
	assert.ErrorContains(t, err, "-rank-data")
	assert.ErrorContains(t, err, "-late-bytes")
	_, err = parseFlags([]string{"-rank-data", "mine"}, io.Discard)
	assert.ErrorContains(t, err, "want shared or files")
}
