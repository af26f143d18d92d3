package main

import (
	"context"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/optim"
)

// muonConfig is smallConfig's muon: the weight matrices by Muon with lr
// 0.02, the biases by AdamW with lr 2e-3.
func muonConfig() trainConfig {
	cfg := smallConfig(muon)
	cfg.hyper.muonLR = 0.02
	return cfg
}

// TestMuonLearns: -optimizer muon trains the MLP on 2 ranks: the loss
// falls, the test accuracy rises well above chance, every rank ends with
// the same parameters, and Muon updates w1 and w2 (transposed: the model
// stores them as [inputs, outputs]), AdamW the biases.
func TestMuonLearns(t *testing.T) {
	train, test := loadTestdata(t)
	cfg := muonConfig()
	cfg.epochs = 1 // Muon's step costs about 0.6 GFLOP per rank here
	res := trainLocal(t, 2, train, test, cfg)
	r := res[0]
	assert.Equal(t, r.finalHash, res[1].finalHash, "ranks end alike")
	steps := 500 / 32
	require.Len(t, r.loss, steps)
	early, late := mean(r.loss[:3]), mean(r.loss[steps-3:])
	t.Logf("muon: loss %.3f -> %.3f, test accuracy %.3f", early, late, r.test.acc)
	assert.Less(t, late, early/3, "loss falls: first steps %.3f, last steps %.3f", early, late)
	assert.Greater(t, r.test.acc, 0.6, "trained model classifies most test digits")

	ps := newMLP(1, 1).params()
	opt, err := newOptimizer(t.Context(), muon, nil, ps, muonConfig().hyper)
	require.NoError(t, err)
	defer opt.Close()
	m, ok := muonOf(opt).(*optim.Muon)
	require.True(t, ok, "%T", opt)
	assert.Equal(t, []string{"w1", "w2"}, m.MuonParams())
	assert.Equal(t, float32(0.02), m.LR())
	assert.Equal(t, float32(2e-3), m.AdamLR())
	ck, err := opt.State()
	require.NoError(t, err)
	assert.Equal(t, []int{numHidden, numInputs}, ck.Tensor(optim.ParamTensorName("w1")).Shape, "Muon holds w1 transposed")

	order, err := runOrder(muon, true)
	require.NoError(t, err)
	assert.Equal(t, []string{muon, onebitMuon}, order, "-compare pairs muon with 1-bit Muon")
}

// TestOnebitMuonLearns: -optimizer onebit-muon trains the MLP on 2 ranks
// through its exact warm-up (5 steps) into its compression stage: the loss
// falls, every rank ends with the same parameters, and a compressed step
// sends far fewer bytes than exact Muon's.
func TestOnebitMuonLearns(t *testing.T) {
	train, test := loadTestdata(t)
	cfg := muonConfig()
	cfg.epochs = 1
	exact := trainLocal(t, 2, train, test, cfg)[0]
	cfg.optimizer = onebitMuon
	cfg.hyper.freezeStep = 5
	res := trainLocal(t, 2, train, test, cfg)
	r := res[0]
	assert.Equal(t, r.finalHash, res[1].finalHash, "ranks end alike")
	assert.Equal(t, optim.StageCompression, r.stage)
	steps := len(r.loss)
	early, late := mean(r.loss[:3]), mean(r.loss[steps-3:])
	t.Logf("onebit-muon: loss %.3f -> %.3f (muon %.3f), last step %.0f bytes (muon %.0f)", early, late, mean(exact.loss[steps-3:]), r.lastStepBytes, exact.lastStepBytes)
	assert.Less(t, late, early/2, "loss falls: first steps %.3f, last steps %.3f", early, late)
	assert.Greater(t, exact.lastStepBytes, 20*r.lastStepBytes, "a compressed step against exact Muon's")
}

// TestMuonResumeLR: a muon run stopped at step 2 of 5 resumes with both
// groups' learning rates from the checkpoint, bit-identically to the
// uninterrupted run, unless -lr (the AdamW group's) or -muon-lr (the Muon
// group's) is given, whose value then wins; rank 0 says which in one line.
func TestMuonResumeLR(t *testing.T) {
	train, test := loadTestdata(t)
	dilocoMuon := muonConfig()
	dilocoMuon.optimizer, dilocoMuon.hyper.outerMuon = "diloco", true
	for _, base := range []trainConfig{muonConfig(), dilocoMuon} {
		t.Run(base.optimizer, func(t *testing.T) {
			cfg := base
			cfg.epochs, cfg.batch = 1, 100
			cfg.checkpoint = checkpointConfig{dir: t.TempDir(), every: 2}
			want := trainLocal(t, 2, train, test, cfg)[0].finalHash

			stopped := t.TempDir()
			cfg.checkpoint.dir = stopped
			res, errs := trainRanks(t, 2, train, test, cfg, stopOn(1, 2))
			require.NoError(t, errs[0])
			require.Equal(t, 2, res[0].preempted)
			for _, c := range []struct {
				name             string
				lr, muonLR       float32
				lrSet, muonLRSet bool
				line             string
				same             bool // ends bit-identical to the uninterrupted run
			}{
				{"checkpoint", 1e-3, 0.05, false, false, "lr 0.002 from the checkpoint, muon lr 0.02 from the checkpoint", true},
				{"-muon-lr", 1e-3, 0.01, false, true, "lr 0.002 from the checkpoint, muon lr 0.01 from -muon-lr (the checkpoint had 0.02)", false},
				{"-lr", 1e-3, 0.02, true, false, "lr 0.001 from -lr (the checkpoint had 0.002), muon lr 0.02 from the checkpoint", false},
			} {
				t.Run(c.name, func(t *testing.T) {
					rc := cfg
					rc.hyper.lr, rc.lrSet = c.lr, c.lrSet
					rc.hyper.muonLR, rc.muonLRSet = c.muonLR, c.muonLRSet
					got := checkResumeLR(t, train, test, rc, stopped, 2, cfg.optimizer+": "+c.line)
					if c.same {
						assert.Equal(t, want, got, "the checkpoint's learning rates: bit-identical to the uninterrupted run")
					} else {
						assert.NotEqual(t, want, got, "the flag changed a learning rate")
					}
				})
			}
		})
	}
}

// TestOnebitMuonFlags: -muon-state and -muon-warmup reach onebit-muon. On
// 4 ranks compact-bf16 keeps 8 bytes fewer per weight-matrix element than
// full (momentum 4 -> 2, the slot 4 -> 0, the worker error 4 -> 2), less
// its scratch matrix (as long as w1, most of the elements here); a
// warm-up step sends the weight matrices at 1
// bit with the default adamw, at 32 with all; other values are refused.
func TestOnebitMuonFlags(t *testing.T) {
	const w = 4
	// run is rank 0's StateBytes and bytes of a step of onebit-muon, in
	// its warm-up, as the flags args build it on w ranks.
	run := func(args string) (state int64, sent int64) {
		o, err := parseFlags(append([]string{"-optimizer", onebitMuon}, strings.Fields(args)...), io.Discard)
		require.NoError(t, err, args)
		err = local.Run(t.Context(), w, func(ctx context.Context, c comm.Comm) error {
			ps := newMLP(1, 1).params()
			opt, err := newOptimizer(ctx, onebitMuon, c, ps, o.hyper())
			if err != nil {
				return err
			}
			defer opt.Close()
			for _, p := range ps {
				for k := range p.GradData() {
					p.GradData()[k] = float32(k%7-3) * 1e-3 * float32(c.Rank()+1)
				}
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if c.Rank() == 0 {
				state, sent = opt.(interface{ StateBytes() int64 }).StateBytes(), opt.Stats().LastStepBytes
			}
			return nil
		})
		require.NoError(t, err, args)
		return state, sent
	}
	full, adamw := run("")
	compact, _ := run("-muon-state compact-bf16")
	_, all := run("-muon-warmup all")
	matrices := float64(numInputs*numHidden + numHidden*numClasses)
	t.Logf("on %d ranks: state per weight-matrix element full %.2f, compact-bf16 %.2f bytes; a warm-up step sends %d bytes (adamw), %d (all)",
		w, float64(full)/matrices, float64(compact)/matrices, adamw, all)
	assert.InDelta(t, 8-4*numInputs*numHidden/matrices, float64(full-compact)/matrices, 0.2)
	assert.Less(t, 20*adamw, all)
	for _, bad := range []string{"-muon-state sharded", "-muon-state=", "-muon-warmup muon"} {
		_, err := parseFlags(strings.Fields(bad), io.Discard)
		assert.Error(t, err, bad)
	}
}
