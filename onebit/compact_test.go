package onebit_test

import (
	"fmt"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

func compactConfig(freeze, bucketBytes int) onebit.AdamConfig {
	cfg := adamConfigForResume(freeze)
	cfg.StateMode, cfg.BucketBytes = onebit.StateCompact, bucketBytes
	return cfg
}

// StateCompact takes StateFull's steps bit for bit (warm-up, the switch,
// compression; masks, weight decay, buckets that cut parameters, one per
// parameter, pipelined or not) and writes the same checkpoints, but for
// the mode it records.
func TestCompactIsFullBitForBit(t *testing.T) {
	const total = 9
	for _, w := range []int{2, 3, 4} {
		for _, bb := range []int{0, 24, optim.PerParameter} {
			for _, freeze := range []int{0, 3} {
				t.Run(fmt.Sprintf("W=%d/buckets=%d/freeze=%d", w, bb, freeze), func(t *testing.T) {
					full := adamConfigForResume(freeze)
					full.BucketBytes = bb
					fullDir, compactDir := t.TempDir(), t.TempDir()
					want := adamRun(t, w, full, fullDir, 1, total, false, true)
					got := adamRun(t, w, compactConfig(freeze, bb), compactDir, 1, total, false, true)
					require.Equal(t, want, got)
					for r := range w {
						name := fmt.Sprintf("rank%d.ckpt", r)
						a, err := optim.LoadFile(filepath.Join(fullDir, name))
						require.NoError(t, err)
						b, err := optim.LoadFile(filepath.Join(compactDir, name))
						require.NoError(t, err)
						assert.Equal(t, int64(onebit.StateCompact), b.Ints[onebit.IntStateMode])
						delete(b.Ints, onebit.IntStateMode)
						assert.Equal(t, a, b, "rank %d's checkpoint", r)
					}
				})
			}
		}
	}
}

// A StateCompact run resumes bit-identically from its own checkpoints and
// from StateFull's, and StateFull from StateCompact's, at every stage.
func TestCompactResumeAndConvert(t *testing.T) {
	const w, freeze, total = 3, 3, 9
	full := adamConfigForResume(freeze)
	full.BucketBytes = 24
	compact := compactConfig(freeze, 24)
	want := adamRun(t, w, full, t.TempDir(), 1, total, false, false)
	for _, k := range []int{1, freeze, freeze + 1, freeze + 3} {
		for _, tc := range []struct {
			name       string
			save, load onebit.AdamConfig
		}{
			{"compact", compact, compact},
			{"full into compact", full, compact},
			{"compact into full", compact, full},
		} {
			t.Run(fmt.Sprintf("%s/k=%d", tc.name, k), func(t *testing.T) {
				dir := t.TempDir()
				adamRun(t, w, tc.save, dir, 1, k, false, true)
				got := adamRun(t, w, tc.load, dir, k+1, total, true, false)
				assert.Equal(t, want, got)
			})
		}
	}
}

// A checkpoint whose momentum is not ±scale per chunk (times the masks)
// cannot be held packed: StateCompact refuses it, saying what to do, and
// changes nothing; so does a bad mode.
func TestCompactRefusesAMomentumItCannotPack(t *testing.T) {
	const w, freeze, k = 2, 2, 4
	dir := t.TempDir()
	adamRun(t, w, compactConfig(freeze, 0), dir, 1, k, false, true)
	for r := range w {
		path := filepath.Join(dir, fmt.Sprintf("rank%d.ckpt", r))
		ck, err := optim.LoadFile(path)
		require.NoError(t, err)
		ck.Tensor(optim.ExpAvgPrefix + "w0").Data[4] *= 1.5
		require.NoError(t, optim.SaveFile(path, ck))
	}
	_, err := tryAdamRun(t, w, compactConfig(freeze, 0), dir, k+1, k+1, true, false)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not a compressed one")
	assert.Contains(t, err.Error(), "StateFull")
	// StateFull takes it as it is.
	_, err = tryAdamRun(t, w, adamConfigForResume(freeze), dir, k+1, k+1, true, false)
	require.NoError(t, err)
}
