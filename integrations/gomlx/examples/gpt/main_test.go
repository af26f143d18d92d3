package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	lbgomlx "github.com/lowbit-ml/lowbit/integrations/gomlx"
	"github.com/lowbit-ml/lowbit/internal/cliflag/flagtest"
	"github.com/lowbit-ml/lowbit/internal/outerstate"
	"github.com/lowbit-ml/lowbit/optim"
	"github.com/lowbit-ml/lowbit/outer"
)

// tiny are the flags of a model small enough for a test: 2 local ranks,
// the first MiB of the default corpus, the curve's evaluations on 16
// windows, a final evaluation of 128 (-final-windows 0 for the whole
// validation text, 652 windows).
func tiny(extra ...string) []string {
	return append([]string{"-workers", "2", "-d-model", "32", "-heads", "2", "-ffn", "64", "-context", "32",
		"-batch", "8", "-max-bytes", "1Mi", "-final-windows", "128", "-val-windows", "16", "-quiet"}, extra...)
}

// runJSON runs the example with args and returns its -json runs.
func runJSON(t *testing.T, args ...string) ([]jsonRun, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "runs.json")
	var out bytes.Buffer
	require.NoError(t, run(context.Background(), append(args, "-json", path), &out, io.Discard))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var runs []jsonRun
	require.NoError(t, json.Unmarshal(b, &runs))
	return runs, out.String()
}

// TestConvergence is the example's convergence test: the tiny transformer
// on 2 local ranks, Adam and then 1-bit Adam from the same seed on the same
// tokens, the final validation over the whole validation text. Both must
// learn (validation loss well below the 5.55 nats of a uniform guess over
// 256 bytes), and 1-bit Adam must end within 3% of Adam's validation loss
// while sending at least 3x fewer bytes.
func TestConvergence(t *testing.T) {
	if testing.Short() {
		t.Skip("trains two models")
	}
	runs, _ := runJSON(t, tiny("-compare", "-optimizer", "onebit-adam", "-steps", "150", "-lr", "3e-3", "-final-windows", "0")...)
	require.Len(t, runs, 2)
	adam, onebit := runs[0], runs[1]
	require.Equal(t, "adam", adam.Optimizer)
	require.Equal(t, "onebit-adam", onebit.Optimizer)
	t.Logf("validation loss: adam %.4f, onebit-adam %.4f (%+.2f%%); bytes per rank %.0f vs %.0f",
		adam.ValLoss, onebit.ValLoss, 100*(onebit.ValLoss-adam.ValLoss)/adam.ValLoss, adam.BytesSentPerRank, onebit.BytesSentPerRank)
	for _, r := range runs {
		assert.Less(t, r.ValLoss, math.Log(256)-1.5, "%s learned", r.Optimizer)
		assert.Equal(t, 150, r.Steps)
		assert.Equal(t, int64(150*8*32), r.Tokens)
		assert.Zero(t, r.Skipped)
	}
	assert.InEpsilon(t, adam.ValLoss, onebit.ValLoss, 0.03, "1-bit Adam within 3%% of Adam")
	assert.Greater(t, adam.BytesSentPerRank, 3*onebit.BytesSentPerRank)
}

// TestResume: a run stopped at step 10 with -checkpoint and resumed to step
// 20 ends with the validation loss of the run never stopped, to the bit
// (1-bit Adam, and with its moments sharded over the 2 ranks: both stop in
// their compression stage; diloco with the 1-bit codec, stopped between
// two exchanges, when the ranks' parameters differ; exact Muon; 1-bit Muon
// in its compression stage, also with its smallest state, with the
// exact warm-up of both groups and with the owners' exchange).
func TestResume(t *testing.T) {
	for _, run := range []string{"onebit-adam", "onebit-adam-sharded", "diloco:1bit", "muon", "onebit-muon", "onebit-muon -muon-state compact-bf16", "onebit-muon -muon-warmup all", "onebit-muon -muon-exchange owners"} {
		t.Run(run, func(t *testing.T) {
			name, extra := strings.Fields(run)[0], strings.Fields(run)[1:]
			dir := t.TempDir()
			args := tiny(append([]string{"-optimizer", name, "-freeze-step", "5", "-outer-h", "4", "-checkpoint", dir, "-checkpoint-every", "5"}, extra...)...)
			runJSON(t, append(args, "-steps", "10")...)
			resumed, _ := runJSON(t, append(args, "-steps", "20")...)
			whole, _ := runJSON(t, tiny(append([]string{"-optimizer", name, "-freeze-step", "5", "-outer-h", "4", "-steps", "20"}, extra...)...)...)
			assert.Equal(t, 10, resumed[0].ResumedAt)
			assert.Equal(t, whole[0].ValLoss, resumed[0].ValLoss)
			assert.Equal(t, whole[0].TrainLoss, resumed[0].TrainLoss)
		})
	}
}

// TestResumeOtherRanks: a run checkpointed on 4 ranks resumes on 3 in the
// same -checkpoint directory with nothing else to do: each optimizer's
// lowbit state is carried by its way (lbgomlx.Optimizer.Checkpoint), the
// run says which and what the check of the carried state found, and it
// ends close to the run that stayed on 4 ranks (bit-identity is not
// expected across a change of size).
func TestResumeOtherRanks(t *testing.T) {
	for _, c := range []struct{ name, label, path, checked string }{
		{"onebit-adam", "onebit-adam", "error feedback carried over (onebit.Regroup)", "worker errors"},
		{"onebit-muon", "onebit-muon", "error feedback carried over (onebit.Regroup)", "momenta"},
		{"diloco", "diloco sparse", "outer state regrouped (outer.Regroup)", "sparse accumulators"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			args := tiny("-optimizer", c.name, "-freeze-step", "5", "-outer-h", "5", "-batch", "12", "-checkpoint-every", "5")
			runJSON(t, append(args, "-workers", "4", "-steps", "10", "-checkpoint", dir)...)
			resumed, out := runJSON(t, append(args, "-workers", "3", "-steps", "15", "-checkpoint", dir)...)
			whole, _ := runJSON(t, append(args, "-workers", "4", "-steps", "15")...)
			label := c.label
			assert.Equal(t, 10, resumed[0].ResumedAt)
			assert.Contains(t, out, label+": resumed on 3 ranks from the checkpoint of step 10 made on 4 ranks: "+c.path)
			assert.Contains(t, out, label+": carried state checked: ")
			assert.Contains(t, out, c.checked)
			assert.InEpsilon(t, whole[0].ValLoss, resumed[0].ValLoss, 0.05)
		})
	}
}

// TestParseRuns: the runs -optimizer, -reduce and -compare name, the
// sharded 1-bit Adam among them (fp32 averaging only), and diloco, whose
// REDUCE is its codec (fp32 when none, whatever -reduce says; -compare
// gives its Adam baseline -reduce).
func TestParseRuns(t *testing.T) {
	for _, tc := range []struct {
		list, reduce string
		compare      bool
		want         []string // labels
		err          string
	}{
		{"onebit-adam-sharded", "fp32", false, []string{"onebit-adam-sharded"}, ""},
		{"onebit-adam-sharded", "fp32", true, []string{"adam", "onebit-adam-sharded"}, ""},
		{"adam,onebit-adam,onebit-adam-sharded:fp32,zero-adam:int8", "fp32", false,
			[]string{"adam", "onebit-adam", "onebit-adam-sharded", "zero-adam int8"}, ""},
		{"onebit-adam-sharded:fp16", "fp32", false, nil, `reduction "fp16" for onebit-adam-sharded: it averages in fp32 only`},
		{"onebit-adam-sharded", "bf16", true, nil, `reduction "bf16" for onebit-adam-sharded: it averages in fp32 only`},
		{"onebit-adam:sharded", "fp32", false, nil, "1-bit Adam with sharded moments is -optimizer onebit-adam-sharded"},
		{"adam,diloco,diloco:fp32,diloco:int8,diloco:1bit", "bf16", false,
			[]string{"adam bf16", "diloco sparse", "diloco fp32", "diloco int8", "diloco 1bit"}, ""},
		{"diloco:1bit", "fp32", true, []string{"adam", "diloco 1bit"}, ""},
		{"diloco", "fp16", true, []string{"adam fp16", "diloco sparse"}, ""},
		{"diloco:fp16", "fp32", false, nil, `unknown codec "fp16" for diloco (want fp32, bf16, int8, 1bit or sparse)`},
		{"adam,muon,muon:bf16", "fp32", false, []string{"adam", "muon", "muon bf16"}, ""},
		{"muon", "fp32", true, []string{"muon", "onebit-muon"}, ""},
	} {
		runs, err := parseRuns(tc.list, tc.reduce, tc.compare)
		if tc.err != "" {
			require.Error(t, err, tc.list)
			assert.Contains(t, err.Error(), tc.err, tc.list)
			continue
		}
		require.NoError(t, err, tc.list)
		var got []string
		for _, r := range runs {
			got = append(got, r.label())
		}
		assert.Equal(t, tc.want, got, tc.list)
	}
}

// TestDiloco: the outer optimizer (diloco) against Adam on the tiny
// transformer, 2 ranks, 40 steps, an exchange every 5: both learn, the
// validation (on the global parameters) is finite and close to Adam's,
// each diloco run sends far fewer bytes than Adam, and the report and the
// JSON give its outer steps and compute utilization.
func TestDiloco(t *testing.T) {
	runs, out := runJSON(t, tiny("-optimizer", "adam,diloco:fp32,diloco:1bit,diloco:sparse", "-steps", "40", "-outer-h", "5", "-lr", "3e-3",
		"-outer-sparse-chunk", "512", "-outer-density", "0.25")...)
	require.Len(t, runs, 4)
	adam := runs[0]
	assert.Nil(t, adam.Outer)
	for _, r := range runs[1:] {
		require.Equal(t, "diloco", r.Optimizer)
		require.NotNil(t, r.Outer, r.Reduce)
		t.Logf("diloco %s: validation loss %.4f (adam %.4f), bytes per rank %.0f (adam %.0f), utilization %.3f",
			r.Reduce, r.ValLoss, adam.ValLoss, r.BytesSentPerRank, adam.BytesSentPerRank, r.Outer.Utilization)
		assert.Less(t, r.ValLoss, math.Log(256)-1, "diloco %s learned", r.Reduce)
		assert.InEpsilon(t, adam.ValLoss, r.ValLoss, 0.1, "diloco %s within 10%% of Adam", r.Reduce)
		assert.Equal(t, int64(8), r.Outer.Exchanges, r.Reduce)
		assert.Equal(t, 5, r.Outer.H)
		assert.Equal(t, r.Reduce, r.Outer.Codec)
		codec, err := outer.ParseCodec(r.Reduce)
		require.NoError(t, err)
		def := outer.DefaultConfigFor(codec)
		assert.Equal(t, float64(def.LR), r.Outer.LR, "%s: the codec's default outer learning rate", r.Reduce)
		assert.Equal(t, float64(def.Momentum), r.Outer.Momentum, "%s: the codec's default outer momentum", r.Reduce)
		assert.True(t, r.Outer.Utilization > 0 && r.Outer.Utilization <= 1, "utilization %v", r.Outer.Utilization)
		assert.Greater(t, adam.BytesSentPerRank, 3*r.BytesSentPerRank, r.Reduce)
		assert.Contains(t, out, "diloco "+r.Reduce+": 8 outer steps (0 skipped), compute utilization ")
		assert.Contains(t, out, "diloco "+r.Reduce+" vs adam: validation loss ")
	}
	assert.Greater(t, runs[1].BytesSentPerRank, 10*runs[2].BytesSentPerRank, "1bit against fp32")
	assert.Contains(t, out, "sparse: outer SGD lr 4 momentum 0, 0.25 of each 512-element chunk sent in 1 bit(s), accumulator decay 0.95")
}

// TestDilocoTwoPhase: -outer-sparse-exchange twophase reaches the outer
// optimizer: on 3 ranks the run sends fewer bytes than the all-gather's
// and is not the same run; a name it does not know is refused.
func TestDilocoTwoPhase(t *testing.T) {
	args := tiny("-optimizer", "diloco:sparse", "-workers", "3", "-steps", "10", "-outer-h", "5", "-lr", "3e-3",
		"-outer-sparse-chunk", "512", "-outer-density", "0.25")
	ag, _ := runJSON(t, args...)
	tp, out := runJSON(t, append(args, "-outer-sparse-exchange", "twophase")...)
	require.Len(t, ag, 1)
	require.Len(t, tp, 1)
	assert.Contains(t, out, "accumulator decay 0.95, exchange twophase")
	assert.Less(t, tp[0].BytesSentPerRank, ag[0].BytesSentPerRank)
	assert.NotEqual(t, ag[0].ValLoss, tp[0].ValLoss)
	_, err := parseFlags(append(args, "-outer-sparse-exchange", "ring"), io.Discard)
	assert.ErrorContains(t, err, `unknown sparse exchange "ring"`)
	_, err = parseFlags(append(args, "-outer-server-density", "1.5"), io.Discard)
	assert.ErrorContains(t, err, "outer-server-density")
}

// TestDilocoState: -outer-state reaches the outer optimizer. At its
// default (auto) the sparse codec's run keeps its accumulator and the
// inner AdamW's moments in bfloat16 and the 1-bit codec's run float32
// state: the runs are recorded and described as such. -outer-state fp32
// gives both float32 state: the 1-bit run is the default's, the sparse
// run is not (the rounding changed it) and ends within 10% of it.
func TestDilocoState(t *testing.T) {
	args := tiny("-optimizer", "diloco:sparse,diloco:1bit", "-steps", "30", "-outer-h", "5", "-lr", "3e-3",
		"-outer-sparse-chunk", "512", "-outer-density", "0.25")
	def, out := runJSON(t, args...)
	f32, _ := runJSON(t, append(args, "-outer-state", "fp32")...)
	require.Len(t, def, 2)
	require.Len(t, f32, 2)
	for i := range def {
		require.NotNil(t, def[i].Outer)
		require.NotNil(t, f32[i].Outer)
		assert.Equal(t, def[i].Reduce == "sparse", def[i].Outer.BF16State, def[i].Reduce)
		assert.False(t, f32[i].Outer.BF16State, f32[i].Reduce)
	}
	assert.Contains(t, out, "accumulator decay 0.95, accumulator and inner moments in bfloat16; 1bit: outer SGD lr 1 momentum 0")
	assert.NotContains(t, out, ", inner moments in bfloat16", "1bit: float32 state")
	assert.NotEqual(t, f32[0].ValLoss, def[0].ValLoss, "sparse: bfloat16 state changes the run")
	assert.InEpsilon(t, f32[0].ValLoss, def[0].ValLoss, 0.1, "sparse: within 10%% of the float32 state")
	assert.Equal(t, f32[1].ValLoss, def[1].ValLoss, "1bit: float32 state by default")
}

// TestDilocoMuonInner: -outer-inner muon makes diloco's inner optimizer
// Muon (MuLoCo), described and recorded as such; the run is not the inner
// Adam's and its loss falls; a name other than adam or muon is refused.
func TestDilocoMuonInner(t *testing.T) {
	args := tiny("-optimizer", "diloco:sparse", "-steps", "30", "-outer-h", "5", "-lr", "3e-3",
		"-outer-sparse-chunk", "512", "-outer-density", "0.25")
	ad, _ := runJSON(t, args...)
	mu, out := runJSON(t, append(args, "-outer-inner", "muon")...)
	require.Len(t, ad, 1)
	require.Len(t, mu, 1)
	assert.Contains(t, out, "diloco: inner Muon (lr 0.02, its AdamW's 0.003)")
	assert.Contains(t, out, "accumulator decay 0.95, accumulator in bfloat16")
	require.NotNil(t, mu[0].Outer)
	assert.Equal(t, "muon", mu[0].Outer.Inner)
	assert.Equal(t, "adam", ad[0].Outer.Inner)
	assert.Equal(t, int64(6), mu[0].Outer.Exchanges)
	assert.NotEqual(t, ad[0].ValLoss, mu[0].ValLoss)
	require.NotEmpty(t, mu[0].Curve)
	assert.Less(t, mu[0].ValLoss, mu[0].Curve[0].ValLoss, "the loss falls")
	_, err := parseFlags(append(args, "-outer-inner", "sgd"), io.Discard)
	assert.ErrorContains(t, err, "outer-inner")
	// Plain diloco: the codec measured best with the inner optimizer.
	for inner, want := range map[string]outer.Codec{"adam": outer.CodecSparse, "muon": outer.CodecOneBit} {
		o, err := parseFlags([]string{"-optimizer", "diloco,diloco:int8", "-outer-inner", inner}, io.Discard)
		require.NoError(t, err)
		require.Len(t, o.runs, 2)
		assert.Equal(t, want, o.runs[0].codec, inner)
		assert.Equal(t, outer.CodecInt8, o.runs[1].codec, "%s: a codec named stays", inner)
	}
}

// TestDilocoStateBytes: diloco:sparse at the example's defaults keeps its
// accumulator and the inner AdamW's moments in bfloat16, as with
// -outer-state bf16 or -outer-bf16: at most 12 bytes per parameter on 8
// ranks by StateBytes, 6 fewer than with -outer-state fp32 (less a
// chunk's float32 scratch). With the 1-bit codec -outer-bf16 keeps the
// moments in bfloat16 too (4 bytes fewer), the default does not. The
// comparisons run on 2 ranks (the savings do not depend on W).
func TestDilocoStateBytes(t *testing.T) {
	const n = 1 << 16 // parameter elements
	onRanks := func(w int, args ...string) float64 {
		o, err := parseFlags(args, io.Discard)
		require.NoError(t, err, args)
		require.Len(t, o.runs, 1)
		h := o.hyper()
		var b int64
		require.NoError(t, local.Run(t.Context(), w, func(ctx context.Context, c comm.Comm) error {
			opt, err := newOptimizer(ctx, o.runs[0], h, c, []*optim.Param{optim.NewParam("w", n)})
			if err != nil {
				return err
			}
			defer opt.Close()
			if c.Rank() == 0 {
				b = opt.(optim.MemoryReporter).StateBytes()
			}
			return nil
		}), args)
		return float64(b) / n
	}
	sparse := []string{"-optimizer", "diloco:sparse"}
	def8 := onRanks(8, sparse...)
	t.Logf("diloco:sparse at the defaults: %.2f bytes per parameter at W = 8", def8)
	assert.LessOrEqual(t, def8, 12.0, "issue 51's goal at the example's defaults")
	perParam := func(args ...string) float64 { return onRanks(2, args...) }
	def := perParam(sparse...)
	assert.Equal(t, def, perParam(append(sparse, "-outer-state", "bf16")...))
	assert.Equal(t, def, perParam(append(sparse, "-outer-bf16")...))
	assert.InDelta(t, 6, perParam(append(sparse, "-outer-state", "fp32")...)-def, 0.3)

	oneBit := []string{"-optimizer", "diloco:1bit"}
	assert.Equal(t, perParam(append(oneBit, "-outer-state", "fp32")...), perParam(oneBit...), "1bit: float32 state by default")
	assert.InDelta(t, 4, perParam(oneBit...)-perParam(append(oneBit, "-outer-bf16")...), 0.01)

	assert.True(t, hyper{}.outerFor(outer.CodecSparse).AccumulatorBF16, "the zero hyper: auto")
	assert.False(t, hyper{outerState: outerstate.FP32}.outerFor(outer.CodecSparse).AccumulatorBF16)
	assert.False(t, hyper{outerState: outerstate.BF16}.outerFor(outer.CodecOneBit).AccumulatorBF16)
	_, err := parseFlags(append(sparse, "-outer-state", "fp32", "-outer-bf16"), io.Discard)
	assert.ErrorContains(t, err, "give one of -outer-state and -outer-bf16")
}

// TestCheckpointOfAnotherModel: a checkpoint of another model size is
// refused before anything is trained, and its files stay as they were.
func TestCheckpointOfAnotherModel(t *testing.T) {
	dir := t.TempDir()
	runJSON(t, tiny("-optimizer", "adam", "-steps", "5", "-checkpoint", dir)...)
	before := snapshot(t, dir)
	err := run(context.Background(), tiny("-optimizer", "adam", "-steps", "10", "-checkpoint", dir, "-d-model", "16"), io.Discard, io.Discard)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "holds a model of d_model 32")
	assert.Contains(t, err.Error(), "this run asks for d_model 16")
	assert.Equal(t, before, snapshot(t, dir), "the checkpoint is unchanged")
}

// snapshot maps every file under dir to its contents.
func snapshot(t *testing.T, dir string) map[string]string {
	files := map[string]string{}
	require.NoError(t, filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		files[p] = string(b)
		return err
	}))
	require.NotEmpty(t, files)
	return files
}

// TestTargetNotReached: a -target no run reaches is said in the table and
// is null in the JSON, not a crash or a zero time.
func TestTargetNotReached(t *testing.T) {
	runs, out := runJSON(t, tiny("-optimizer", "adam", "-steps", "4", "-target", "0.01")...)
	assert.Contains(t, out, "not reached")
	assert.Nil(t, runs[0].TimeToTargetS)
	assert.Nil(t, runs[0].StepsToTarget)
	runs, out = runJSON(t, tiny("-optimizer", "adam", "-steps", "4", "-target", "100")...)
	require.NotNil(t, runs[0].TimeToTargetS)
	assert.Equal(t, 1, *runs[0].StepsToTarget)
	assert.NotContains(t, out, "not reached")
}

// TestStopAtTarget: -stop-at-target ends every run (diloco too, evaluated
// on its global parameters) at its first validation at or below the
// target; a run that never reaches it trains every step.
func TestStopAtTarget(t *testing.T) {
	runs, _ := runJSON(t, tiny("-optimizer", "adam,diloco:1bit", "-steps", "12", "-eval-every", "2", "-outer-h", "2",
		"-target", "100", "-stop-at-target")...)
	for _, r := range runs {
		require.NotNil(t, r.StepsToTarget, r.Optimizer)
		assert.Equal(t, 2, *r.StepsToTarget, r.Optimizer)
		assert.Equal(t, 2, r.Steps, "%s stopped at its target", r.Optimizer)
		assert.Len(t, r.Curve, 1)
	}
	runs, _ = runJSON(t, tiny("-optimizer", "adam", "-steps", "4", "-target", "0.01", "-stop-at-target")...)
	assert.Equal(t, 4, runs[0].Steps)
	assert.Nil(t, runs[0].StepsToTarget)
	_, err := parseFlags([]string{"-stop-at-target", "-target", "0"}, io.Discard)
	assert.ErrorContains(t, err, "needs a -target")
}

// TestBadCorpus: a corpus that cannot be trained on is a clear error
// before any rank starts.
func TestBadCorpus(t *testing.T) {
	write := func(dir string, files map[string][]byte) string {
		for name, b := range files {
			require.NoError(t, os.WriteFile(filepath.Join(dir, name), b, 0o644))
		}
		return dir
	}
	text := []byte(strings.Repeat("the quick brown fox jumps over the lazy dog\n", 200))
	for _, tc := range []struct {
		name, dir, want string
	}{
		{"missing", filepath.Join(t.TempDir(), "nosuch"), "no such file or directory"},
		{"a file", write(t.TempDir(), map[string][]byte{"a.txt": text}) + "/a.txt", "is not a directory"},
		{"empty", t.TempDir(), "holds no files"},
		{"binary only", write(t.TempDir(), map[string][]byte{"a.bin": {0, 1, 2, 3}, "b.bin": {0xff, 0xfe, 0}}), "holds no text files (2 binary"},
		{"one text file", write(t.TempDir(), map[string][]byte{"a.txt": text, "b.bin": {0}}), "needs at least 2"},
		{"smaller than a batch", write(t.TempDir(), map[string][]byte{"a.txt": []byte("short\n"), "b.txt": []byte("tiny\n")}), "fewer than one global batch"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := run(context.Background(), tiny("-corpus", tc.dir, "-steps", "1"), io.Discard, io.Discard)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
			assert.Contains(t, err.Error(), "corpus")
		})
	}
}

// TestBadFlagValues gives every flag an empty, a negative, a huge and a
// misspelled value: one-line usage errors, no panic.
func TestBadFlagValues(t *testing.T) {
	flagtest.BadValues(t, func(args []string, stderr io.Writer) error {
		_, err := parseFlags(args, stderr)
		return err
	}, 20, "corpus", "json", "plot", "markdown", "checkpoint", "optimizer", "reduce", "late-bytes")
}

// TestCountFlags: -batch, a count of sequences, takes counts as the field
// writes them where they are in its bounds (137k; 7B is refused as out of
// range) and refuses sizes in bytes (64MiB) with one line.
func TestCountFlags(t *testing.T) {
	flagtest.Options(t, parseFlags, map[string]flagtest.OptionCount[*options]{
		"batch": {Min: 1, Max: 1 << 20, Get: func(o *options) int64 { return int64(o.batch) }},
	})
}

// TestBadFlagExit: the binary prints one line for a bad value and exits 2.
func TestBadFlagExit(t *testing.T) {
	flagtest.Exit(t, "gpt", []string{"-batch", "16Q"}, []string{"-heads", "5"}, []string{"-optimizer", "sgd"},
		[]string{"-plot", "a.png"}, []string{"-nosuch"}, []string{"stray"})
}

// TestResumeLR: a resumed run continues with the checkpoint's learning
// rate unless -lr is given, whose value then wins (SetLR after Load, before
// the first resumed step); either way it says which in one line. The
// checkpoint's learning rate continues bit-identically to the run never
// stopped; another -lr does not, from the one step resumed on.
func TestResumeLR(t *testing.T) {
	if testing.Short() {
		t.Skip("trains four models")
	}
	base := tiny("-optimizer", "adam", "-checkpoint-every", "5")
	stopped := t.TempDir()
	runJSON(t, append(base, "-checkpoint", stopped, "-steps", "10", "-lr", "3e-3")...)
	whole, _ := runJSON(t, append(base, "-steps", "11", "-lr", "3e-3")...)
	for _, c := range []struct {
		name, line string
		flags      []string
		same       bool
	}{
		{"checkpoint", "adam: resumed at step 10: lr 0.003 from the checkpoint\n", nil, true},
		{"explicit", "adam: resumed at step 10: lr 0.0005 from -lr (the checkpoint had 0.003)\n", []string{"-lr", "5e-4"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			require.NoError(t, os.CopyFS(dir, os.DirFS(stopped)))
			resumed, out := runJSON(t, append(append(base, "-checkpoint", dir, "-steps", "11"), c.flags...)...)
			assert.Equal(t, 10, resumed[0].ResumedAt)
			assert.Contains(t, out, c.line)
			assert.Equal(t, 1, strings.Count(out, "resumed at step"), out)
			if c.same {
				assert.Equal(t, whole[0].ValLoss, resumed[0].ValLoss, "the checkpoint's learning rate: bit-identical")
			} else {
				assert.NotEqual(t, whole[0].ValLoss, resumed[0].ValLoss, "-lr's learning rate from the first resumed step on")
			}
		})
	}
}

// TestInprocessUnderMPI: started by mpirun (the environment says this
// process is one rank of a job of 2) without -backend mpi, the example
// refuses to run its in-process ranks, which would make every process of
// the job train on its own and write the same checkpoints, before it
// reads anything; -allow-inprocess-under-mpi goes on (to the bad -corpus).
func TestInprocessUnderMPI(t *testing.T) {
	for _, v := range comm.MPIEnvVars() {
		t.Setenv(v, "")
	}
	t.Setenv("OMPI_COMM_WORLD_SIZE", "2")
	args := []string{"-corpus", filepath.Join(t.TempDir(), "nosuch")}
	err := run(context.Background(), args, io.Discard, io.Discard)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "-backend local: local: this process is one rank of an MPI job of 2 ranks (OMPI_COMM_WORLD_SIZE=2)")
	assert.Contains(t, err.Error(), "give -backend mpi (a binary built with -tags mpi), or -allow-inprocess-under-mpi")
	err = run(context.Background(), append(args, "-allow-inprocess-under-mpi"), io.Discard, io.Discard)
	require.Error(t, err)
	assert.NotContains(t, err.Error(), "MPI job")
	assert.Contains(t, err.Error(), "no such file or directory")
}

// TestMuon: exact Muon (-optimizer muon) on the tiny transformer learns, and
// the header names its two learning rates. On a resume -muon-lr and -lr
// each replace their own group's learning rate from the checkpoint, and
// the run says which (the checkpoint's continue bit-identically: TestResume).
func TestMuon(t *testing.T) {
	var stderr bytes.Buffer
	path := filepath.Join(t.TempDir(), "runs.json")
	var out bytes.Buffer
	dir := t.TempDir()
	args := tiny("-optimizer", "muon", "-checkpoint", dir, "-checkpoint-every", "10", "-json", path)
	require.NoError(t, run(context.Background(), append(args, "-steps", "30", "-lr", "3e-3"), &out, &stderr))
	var runs []jsonRun
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &runs))
	require.Len(t, runs, 1)
	assert.Equal(t, "muon", runs[0].Optimizer)
	assert.Less(t, runs[0].ValLoss, math.Log(256)-1, "muon learned")
	assert.Zero(t, runs[0].Skipped)
	t.Logf("muon, 30 steps: validation loss %.4f", runs[0].ValLoss)

	out.Reset()
	require.NoError(t, run(context.Background(), append(args, "-steps", "31", "-muon-lr", "0.01", "-quiet=false"), &out, io.Discard))
	assert.Contains(t, out.String(), "muon: the hidden matrices (attention, feed-forward) by Muon, lr 0.01 (-muon-lr); the embeddings, the output head, biases and norms by AdamW, lr 0.002 (-lr)")
	assert.Contains(t, out.String(), "muon: resumed at step 30: muon lr 0.01 from -muon-lr (the checkpoint had 0.02), adam lr 0.003 from the checkpoint\n")
	out.Reset()
	require.NoError(t, run(context.Background(), append(args, "-steps", "32", "-lr", "1e-3"), &out, io.Discard))
	assert.Contains(t, out.String(), "muon: resumed at step 31: muon lr 0.01 from the checkpoint, adam lr 0.001 from -lr (the checkpoint had 0.003)\n")
}

// TestMuonSplit: -muon-split reaches exact Muon (optim.MuonConfig.Split):
// the same run, bit for bit (the same losses), with the all-gather's bytes
// on top, and the header says so.
func TestMuonSplit(t *testing.T) {
	args := tiny("-optimizer", "muon", "-steps", "6", "-eval-every", "3")
	whole, _ := runJSON(t, args...)
	split, out := runJSON(t, append(args, "-muon-split", "-quiet=false")...)
	require.Len(t, whole, 1)
	require.Len(t, split, 1)
	assert.Equal(t, whole[0].ValLoss, split[0].ValLoss)
	assert.Equal(t, whole[0].CurveValLoss, split[0].CurveValLoss)
	assert.Greater(t, split[0].BytesSentPerRank, whole[0].BytesSentPerRank, "the all-gather")
	assert.Contains(t, out, "exact Muon's orthogonalization split across the ranks (-muon-split)")
}

// TestMuonWarmupAdamW: -muon-warmup reaches 1-bit Muon
// (onebit.MuonConfig.WarmupAdamWOnly): in a run that ends in the warm-up,
// with the default adamw, the hidden matrices are sent at 1 bit, so fewer
// bytes than with all, the whole model's exact warm-up (on this tiny
// model the embeddings and the head, exact in both, are most of them),
// and the header says which; a value other than all or adamw is refused.
func TestMuonWarmupAdamW(t *testing.T) {
	args := tiny("-optimizer", "onebit-muon", "-steps", "4", "-freeze-step", "10", "-eval-every", "2")
	adamw, _ := runJSON(t, args...)
	all, out := runJSON(t, append(args, "-muon-warmup", "all", "-quiet=false")...)
	require.Len(t, all, 1)
	require.Len(t, adamw, 1)
	t.Logf("bytes sent per rank over 4 warm-up steps: exact %.0f, AdamW group only %.0f", all[0].BytesSentPerRank, adamw[0].BytesSentPerRank)
	assert.Less(t, adamw[0].BytesSentPerRank, 0.75*all[0].BytesSentPerRank)
	assert.NotEqual(t, all[0].ValLoss, adamw[0].ValLoss)
	assert.Contains(t, out, "onebit-muon's exact warm-up for both groups (-muon-warmup all)")
	err := run(context.Background(), append(args, "-muon-warmup", "muon"), io.Discard, io.Discard)
	require.ErrorContains(t, err, "muon-warmup")
}

// TestMuonExchange: -muon-exchange owners reaches 1-bit Muon
// (onebit.MuonConfig.Exchange), and -muon-owner-bits 2 its OwnerBits: a
// run past the warm-up ends elsewhere than the polar exchange's, two bits
// elsewhere again and with more bytes, and the header says which; another
// value, owners with a compact state, or two bits without owners, is
// refused naming the flag.
func TestMuonExchange(t *testing.T) {
	args := tiny("-optimizer", "onebit-muon", "-steps", "6", "-freeze-step", "2", "-eval-every", "3")
	polar, _ := runJSON(t, args...)
	owners, out := runJSON(t, append(args, "-muon-exchange", "owners", "-quiet=false")...)
	require.Len(t, polar, 1)
	require.Len(t, owners, 1)
	assert.NotEqual(t, polar[0].ValLoss, owners[0].ValLoss)
	assert.Contains(t, out, "(-muon-exchange owners -muon-owner-bits 1)")
	two, out := runJSON(t, append(args, "-muon-exchange", "owners", "-muon-owner-bits", "2", "-quiet=false")...)
	require.Len(t, two, 1)
	assert.NotEqual(t, owners[0].ValLoss, two[0].ValLoss)
	assert.Greater(t, two[0].BytesSentPerRank, owners[0].BytesSentPerRank, "two bits to the owners")
	assert.Contains(t, out, "(-muon-exchange owners -muon-owner-bits 2)")
	for _, bad := range [][]string{{"-muon-exchange", "mean"}, {"-muon-exchange", "owners", "-muon-state", "compact"}} {
		err := run(context.Background(), append(args, bad...), io.Discard, io.Discard)
		require.ErrorContains(t, err, "muon-exchange")
	}
	for _, bad := range [][]string{{"-muon-owner-bits", "3"}, {"-muon-owner-bits", "2"}} {
		err := run(context.Background(), append(args, bad...), io.Discard, io.Discard)
		require.ErrorContains(t, err, "muon-owner-bits")
	}
}

// TestDilocoWarnings: diloco whose first exchange comes after -steps (the
// outer optimizer would exchange nothing), and the sparse codec named
// with -outer-inner muon (which package outer refuses unless insisted
// on, as the example does for a codec named), are warned of, once each;
// plain diloco with muon (1bit) at a -steps past its first exchange is not.
func TestDilocoWarnings(t *testing.T) {
	var errOut bytes.Buffer
	o, err := parseFlags([]string{"-optimizer", "diloco:sparse,diloco:1bit", "-outer-inner", "muon", "-steps", "20", "-outer-h", "25"}, &errOut)
	require.NoError(t, err)
	assert.Empty(t, errOut.String(), "parsing prints nothing: run warns once per job (rank 0 under MPI)")
	o.warn(&errOut)
	assert.Equal(t, 1, strings.Count(errOut.String(), "gpt: warning: diloco: the outer optimizer's first exchange merges at inner step 25 (H 25, 1 fragment(s), delay 0), after this run's 20 steps"), errOut.String())
	assert.Equal(t, 1, strings.Count(errOut.String(), "gpt: warning: diloco: the sparse codec with -outer-inner muon ended at loss 2.8583"), errOut.String())
	errOut.Reset()
	o, err = parseFlags([]string{"-optimizer", "diloco", "-outer-inner", "muon", "-steps", "20", "-outer-h", "10"}, &errOut)
	require.NoError(t, err)
	o.warn(&errOut)
	assert.Empty(t, errOut.String())
}

// TestLateBytesMuon: with -late-bytes, 1-bit Muon's AdamW group trains
// the embedding rows of bytes first seen after its variance froze, as
// 1-bit Adam's does (it held them at their initial values for the whole
// run before). Their v is exactly zero at step 14, after the freeze at
// step 5 and before they first occur at step 15; by step 30 it is not,
// and they moved from step 14 on by a fair share of what the rows of the
// bytes seen from the start moved.
func TestLateBytesMuon(t *testing.T) {
	if testing.Short() {
		t.Skip("trains a model")
	}
	dir := t.TempDir()
	args := tiny("-optimizer", "onebit-muon", "-freeze-step", "5", "-late-bytes", "{}", "-checkpoint", dir, "-checkpoint-every", "100")
	runJSON(t, append(args, "-steps", "14")...)
	emb := func(step int) (p, v []float32) {
		t.Helper()
		files, err := filepath.Glob(filepath.Join(dir, "onebit-muon-*-rank-0", fmt.Sprintf("%s%08d%s", lbgomlx.StateFilePrefix, step, lbgomlx.StateFileSuffix)))
		require.NoError(t, err)
		require.Len(t, files, 1, "the state file of step %d", step)
		ck, err := optim.LoadFile(files[0])
		require.NoError(t, err)
		for _, tn := range ck.Tensors {
			if strings.HasPrefix(tn.Name, optim.ParamTensorName("")) && strings.HasSuffix(tn.Name, "token_embed/embeddings") {
				name := strings.TrimPrefix(tn.Name, optim.ParamTensorName(""))
				return tn.Data, ck.Tensor(optim.ExpAvgSqPrefix + name).Data
			}
		}
		t.Fatalf("no token embedding in %s", files[0])
		return nil, nil
	}
	p14, v14 := emb(14)
	runJSON(t, append(args, "-steps", "30")...)
	p30, v30 := emb(30)
	d := len(p14) / 256
	moved := func(b int) (m float64) {
		for j := b * d; j < (b+1)*d; j++ {
			m += math.Abs(float64(p30[j]-p14[j])) / float64(d)
		}
		return m
	}
	var early float64
	for _, b := range []byte("e t=(") {
		require.NotZero(t, v14[int(b)*d], "byte %q is seen from the start", b)
		early += moved(int(b)) / 5
	}
	for _, b := range []byte("{}") {
		for j := int(b) * d; j < (int(b)+1)*d; j++ {
			require.Zero(t, v14[j], "byte %q: v before it first occurs", b)
		}
		require.NotZero(t, v30[int(b)*d], "byte %q: v after it occurred", b)
		t.Logf("byte %q moved %.3g on average from step 14 to 30; bytes seen from the start %.3g", b, moved(int(b)), early)
		assert.Greater(t, moved(int(b)), early/10, "byte %q: its embedding did not train", b)
	}
}
