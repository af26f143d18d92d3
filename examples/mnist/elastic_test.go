package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// dilocoConfig is smallConfig's diloco with codec and, with muon, Muon
// inside; exchanges in flight for one step (Delay 1: fragment launches at
// every even step, merged at the next), so that the odd steps are
// between exchanges.
func dilocoConfig(codec outer.Codec, muon bool) trainConfig {
	cfg := smallConfig(diloco)
	cfg.hyper.outer.Codec, cfg.hyper.outer.Delay = codec, 1
	d := outer.DefaultConfigFor(codec)
	cfg.hyper.outer.LR, cfg.hyper.outer.Momentum = d.LR, d.Momentum
	cfg.hyper.outerMuon = muon
	cfg.hyper.muonLR = defaultMuonLR
	cfg.hyper.outer.SparseWithMuon = muon && codec == outer.CodecSparse
	return cfg
}

// TestResumeOtherWorldDiloco: the outer optimizer resumes on another
// number of ranks (3 -> 2 and 2 -> 3, alternating) through outer.Regroup,
// with the 1-bit and the sparse codec, AdamW and Muon inside: it continues from the
// stop step, every new rank holds what outer.Regroup makes of every old
// rank's checkpoint (θ_g and u bit for bit, the sparse accumulator the old
// ranks' mean, the 1-bit codec's error buffers as outer.Regroup makes
// them), rank 0 names the path and the carried-state check's line, nothing
// restarts from zero, and the run ends close to the uninterrupted one.
func TestResumeOtherWorldDiloco(t *testing.T) {
	train, test := loadTestdata(t)
	for _, codec := range []outer.Codec{outer.CodecOneBit, outer.CodecSparse} {
		for _, muon := range []bool{false, true} {
			ws := [2]int{3, 2}
			if muon != (codec == outer.CodecSparse) {
				ws = [2]int{2, 3}
			}
			{
				inner := "adam"
				if muon {
					inner = "muon"
				}
				t.Run(fmt.Sprintf("%v/%s/%dto%d", codec, inner, ws[0], ws[1]), func(t *testing.T) {
					const stop = 17 // odd: between exchanges
					cfg := dilocoConfig(codec, muon)
					cfg.epochs = 2
					whole, saved, loaded, res, warn := resumeOnOther(t, diloco, ws, stop, train, test, cfg)
					out := warn.String()
					assert.Contains(t, out, fmt.Sprintf("checkpoint of step %d was made on %d ranks, this run has %d: continuing, %s", stop, ws[0], ws[1], carryOuter))
					assert.Regexp(t, `mnist: -resume: diloco carried: [1-9][0-9]* buffers checked against the old ranks', max rel diff [0-9.e-]+`, out)
					assert.NotContains(t, out, "restarted from zero")
					assert.NotContains(t, out, "error buffers dropped")
					assert.Regexp(t, fmt.Sprintf(`mnist: first step %d at [0-9]{19}\n`, stop+1), out)
					for r, ck := range loaded {
						require.NotNil(t, ck, "rank %d", r)
						want, err := outer.Regroup(saved, ws[1], r)
						require.NoError(t, err)
						for _, name := range []string{outer.TensorGlobal, outer.TensorMomentum} {
							if want.Tensor(name) == nil { // no momentum (outer.Config.Momentum 0)
								assert.Nil(t, ck.Tensor(name), "rank %d: %s", r, name)
								continue
							}
							require.NotNil(t, ck.Tensor(name), "rank %d: %s", r, name)
							assert.Equal(t, want.Tensor(name).Data, ck.Tensor(name).Data, "rank %d: %s", r, name)
						}
						if codec == outer.CodecOneBit {
							errs := 0
							for _, tn := range want.Tensors {
								if optim.IsErrorBuffer(tn.Name) {
									require.NotNil(t, ck.Tensor(tn.Name), "rank %d: %s", r, tn.Name)
									assert.Equal(t, tn.Data, ck.Tensor(tn.Name).Data, "rank %d: %s carried", r, tn.Name)
									errs++
								}
							}
							assert.Positive(t, errs, "rank %d: the 1-bit codec's error buffers", r)
						}
						if codec == outer.CodecSparse {
							acc := ck.Tensor(outer.AccumulatorName)
							require.NotNil(t, acc, "rank %d", r)
							mean := want.Tensor(outer.TensorRegroupedAccumulator).Data
							require.Len(t, acc.Data, len(mean))
							var diff float64
							for i, v := range mean {
								// The accumulator is kept in bfloat16 or
								// float32: to its rounding.
								diff = max(diff, float64(abs32(acc.Data[i]-v))/(float64(abs32(v))+1e-6))
							}
							assert.Less(t, diff, 1e-2, "rank %d: the accumulator is the old ranks' mean", r)
						}
					}
					assert.InDelta(t, whole.test.acc, res[0].test.acc, 0.05, "accuracy close to the uninterrupted run's")
				})
			}
		}
	}
}

func abs32(x float32) float32 {
	if x < 0 {
		return -x
	}
	return x
}

// TestResumeOtherWorldInFlight: a diloco checkpoint taken with an
// exchange in flight regroups onto another number of ranks like any other
// (outer.Regroup carries the exchange's result and each rank's parameters
// at its launch): the resume continues from that step, the carried-state
// check passes, and the run ends close to the uninterrupted one.
func TestResumeOtherWorldInFlight(t *testing.T) {
	train, test := loadTestdata(t)
	cfg := dilocoConfig(outer.CodecOneBit, false)
	cfg.epochs = 2
	whole, _ := trainRanks(t, 2, train, test, cfg, nil)
	cfg.checkpoint = checkpointConfig{dir: t.TempDir(), every: 10}
	_, errs := trainRanks(t, 3, train, test, cfg, stopOn(0, 20)) // even: in flight
	require.NoError(t, errs[0])
	cfg.checkpoint.resume = true
	var warn syncBuffer
	cfg.warn = &warn
	res, errs := trainRanks(t, 2, train, test, cfg, nil)
	require.NoError(t, errs[0])
	assert.Equal(t, 20, res[0].resumedFrom, "the step with the exchange in flight")
	out := warn.String()
	assert.NotContains(t, out, "falls back")
	assert.Contains(t, out, "checkpoint of step 20 was made on 3 ranks, this run has 2: continuing, "+carryOuter.String())
	assert.Regexp(t, `mnist: -resume: diloco carried: [1-9][0-9]* buffers checked against the old ranks'`, out)
	assert.InDelta(t, whole[0].test.acc, res[0].test.acc, 0.05, "accuracy close to the uninterrupted run's")
}

// TestResumeTwoRuns: a directory that holds the checkpoints of two runs
// (here a run on 3 ranks, then another started from step 0 on 2 ranks in
// the same directory) is refused by -resume on every rank, rank 0 naming
// both runs' files: never a mix of two runs.
func TestResumeTwoRuns(t *testing.T) {
	train, test := loadTestdata(t)
	cfg := smallConfig("onebit-adam")
	cfg.checkpoint = checkpointConfig{dir: t.TempDir(), every: 5}
	_, errs := trainRanks(t, 3, train, test, cfg, stopOn(0, 12))
	require.NoError(t, errs[0])
	_, errs = trainRanks(t, 2, train, test, cfg, stopOn(0, 7))
	require.NoError(t, errs[0])
	cfg.checkpoint.resume = true
	errs = resumeErrors(t, 2, train, test, cfg)
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "holds checkpoints of onebit-adam from", "rank %d", r)
		assert.Contains(t, err.Error(), "resuming would mix them", "rank %d", r)
	}
	assert.Contains(t, errs[0].Error(), "onebit-adam.rank2.0.ckpt", "rank 0 names the first run's files")
	assert.Contains(t, errs[0].Error(), "onebit-adam.rank1.1.ckpt")
	assert.Equal(t, 2, strings.Count(errs[0].Error(), "run "), "two runs named")
}

// TestResumeIncompleteSet: where the newest file of one old rank is
// missing or damaged, a resume on another number of ranks continues from
// the newest step every old rank holds (the older set), saying so.
func TestResumeIncompleteSet(t *testing.T) {
	train, test := loadTestdata(t)
	for _, damage := range []string{"missing", "damaged"} {
		t.Run(damage, func(t *testing.T) {
			cfg := smallConfig("onebit-adam")
			cfg.checkpoint = checkpointConfig{dir: t.TempDir(), every: 5}
			_, errs := trainRanks(t, 3, train, test, cfg, stopOn(0, 15))
			require.NoError(t, errs[0])
			newest := filepath.Join(cfg.checkpoint.dir, "onebit-adam.rank2.1.ckpt") // step 15: slot 15/5 % 2
			ck, err := optim.LoadFile(newest)
			require.NoError(t, err)
			require.EqualValues(t, 15, ck.Ints[ckptStep])
			if damage == "missing" {
				require.NoError(t, os.Remove(newest))
			} else {
				b, err := os.ReadFile(newest)
				require.NoError(t, err)
				b[len(b)/2] ^= 0x5a
				require.NoError(t, os.WriteFile(newest, b, 0o644))
			}
			cfg.checkpoint.resume = true
			var warn syncBuffer
			cfg.warn = &warn
			res, errs := trainRanks(t, 2, train, test, cfg, nil)
			require.NoError(t, errs[0])
			assert.Equal(t, 10, res[0].resumedFrom, "the newest step every old rank holds")
			assert.Equal(t, 3, res[0].resumedWorld)
			assert.Contains(t, warn.String(), "carried: ")
		})
	}
}

// TestCheckCarried: the carried-state check passes what onebit.Regroup
// and outer.Regroup make of saved states and fails a state that did not
// carry them: a worker error off by one element, a sparse accumulator
// dropped (ResetErrors instead of outer.Regroup).
func TestCheckCarried(t *testing.T) {
	train, test := loadTestdata(t)
	save := func(cfg trainConfig, name string) []*optim.Checkpoint {
		cfg.checkpoint = checkpointConfig{dir: t.TempDir(), every: 5}
		_, errs := trainRanks(t, 3, train, test, cfg, stopOn(0, 15))
		require.NoError(t, errs[0])
		return savedStates(t, cfg.checkpoint.dir, name, 3, 15)
	}
	old := save(smallConfig("onebit-adam"), "onebit-adam")
	news := make([]*optim.Checkpoint, 2)
	for r := range news {
		var err error
		news[r], err = onebit.Regroup(old, 2, r)
		require.NoError(t, err)
	}
	rep, err := checkCarried(carryRegroup, old, news)
	require.NoError(t, err)
	assert.Positive(t, rep.checked)
	assert.Less(t, rep.maxRel, 1e-6)
	var we *optim.Tensor
	for i := range news[1].Tensors {
		if strings.HasPrefix(news[1].Tensors[i].Name, optim.WorkerErrorName) {
			we = &news[1].Tensors[i]
			break
		}
	}
	require.NotNil(t, we)
	we.Data[5] += 1
	_, err = checkCarried(carryRegroup, old, news)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the state was not carried")

	cfg := dilocoConfig(outer.CodecSparse, false)
	old = save(cfg, diloco)
	for r := range news {
		var err error
		news[r], err = outer.Regroup(old, 2, r)
		require.NoError(t, err)
	}
	_, err = checkCarried(carryOuter, old, news)
	require.NoError(t, err)
	for r := range news {
		news[r] = old[r].ResetErrors()
	}
	_, err = checkCarried(carryOuter, old, news)
	require.Error(t, err, "the sparse accumulator dropped")
	assert.Contains(t, err.Error(), outer.TensorRegroupedAccumulator)

	// unpadded: a lower bound of the real length.
	for _, n := range []int{1, 10, 266, 203530} {
		assert.LessOrEqual(t, unpadded(onebit.PaddedLen(n, 4), 4, onebit.PaddedLen(n, 3), 3), n)
	}
}
