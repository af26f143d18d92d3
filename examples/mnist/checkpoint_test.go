package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
)

// The resume test runs this test binary as the mnist command, so that a run
// can be killed for real (SIGKILL, no deferred cleanup) and resumed.
const asCommandEnv = "LOWBIT_MNIST_AS_COMMAND"

func TestMain(m *testing.M) {
	if os.Getenv(asCommandEnv) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

var finalHashRE = regexp.MustCompile(`(?m)^(\S+) final parameters: fnv64 ([0-9a-f]{16})$`)

// finalHashes returns "optimizer=hash" for every run in a command's output.
func finalHashes(t *testing.T, out string) []string {
	t.Helper()
	var h []string
	for _, m := range finalHashRE.FindAllStringSubmatch(out, -1) {
		h = append(h, m[1]+"="+m[2])
	}
	require.NotEmpty(t, h, "no final parameter hash in:\n%s", out)
	return h
}

// TestResumeAfterKill kills a training run right after a mid-training
// checkpoint, resumes it, and checks that it ends with parameters
// bit-identical to those of an uninterrupted run. 1-bit Adam is in its
// compression stage when killed (freeze step 4, kill at step 12 of 20), so
// the per-rank error buffers must come back exactly too.
func TestResumeAfterKill(t *testing.T) {
	common := []string{
		"-data", "testdata", "-workers", "2", "-epochs", "2", "-batch", "50",
		"-freeze-step", "4", "-lr", "2e-3", "-evals", "2", "-checkpoint-every", "4", "-quiet",
	}
	for _, name := range []string{"adam", "onebit-adam"} {
		t.Run(name, func(t *testing.T) {
			args := append([]string{"-optimizer", name}, common...)
			var whole bytes.Buffer
			require.NoError(t, run(context.Background(), append(args, "-checkpoint", t.TempDir()), &whole, &bytes.Buffer{}))
			want := finalHashes(t, whole.String())

			dir := t.TempDir()
			cmd := exec.Command(os.Args[0], append(args, "-checkpoint", dir, "-kill-at", "12")...)
			cmd.Env = append(os.Environ(), asCommandEnv+"=1")
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			require.True(t, errors.As(err, &exit), "the run must be killed, got %v:\n%s", err, out)
			ws, ok := exit.Sys().(syscall.WaitStatus)
			require.True(t, ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL, "killed by SIGKILL: %v\n%s", err, out)
			assert.NotContains(t, string(out), "final parameters", "the killed run did not finish")
			for r := range 2 {
				assert.FileExists(t, filepath.Join(dir, name+".rank"+strconv.Itoa(r)+".1.ckpt"), "step 12's checkpoint (slot 12/4%2)")
			}

			var resumed bytes.Buffer
			require.NoError(t, run(context.Background(), append(args, "-checkpoint", dir, "-resume"), &resumed, &bytes.Buffer{}))
			assert.Contains(t, resumed.String(), name+" resumed from step 12 of 20", "it continued from the kill, not from the start")
			assert.NotContains(t, whole.String(), "resumed from")
			assert.Equal(t, want, finalHashes(t, resumed.String()), "resumed run ends bit-identical to the uninterrupted one")

			// Resuming a finished run trains nothing and prints the same
			// report, from the result kept next to the checkpoints.
			var again, warns bytes.Buffer
			require.NoError(t, run(context.Background(), append(args, "-checkpoint", dir, "-resume"), &again, &warns))
			assert.Equal(t, resumed.String(), again.String())
			assert.Contains(t, warns.String(), "mnist: -resume: "+name+" had finished: its result is kept from "+filepath.Join(dir, name+".result"))
		})
	}
}

// TestResumeDisagreement: ranks whose checkpoints do not match get the same
// clear error on every rank, and so does a directory without checkpoints.
func TestResumeDisagreement(t *testing.T) {
	train, test := loadTestdata(t)
	dir := t.TempDir()
	cfg := smallConfig("onebit-adam")
	cfg.epochs = 1
	cfg.checkpoint = checkpointConfig{dir: dir, every: 5}
	trainLocal(t, 2, train, test, cfg)

	cfg.checkpoint.resume = true
	for _, slot := range []string{"0", "1"} {
		require.NoError(t, os.Remove(filepath.Join(dir, "onebit-adam.rank1."+slot+".ckpt")))
	}
	errs := resumeErrors(t, 2, train, test, cfg)
	for r, err := range errs {
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "no checkpoint of onebit-adam in "+dir+" that every rank holds", "rank %d", r)
	}

	cfg.checkpoint.dir = t.TempDir()
	for r, err := range resumeErrors(t, 2, train, test, cfg) {
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "no checkpoint", "rank %d", r)
	}
}

// TestResumeOtherFlags: checkpoints made with other training flags (here
// -freeze-step, -seed; -workers is TestResumeOtherWorld's, -lr
// TestResumeLR's) are refused on every rank, with the flag named, and
// change nothing.
func TestResumeOtherFlags(t *testing.T) {
	train, test := loadTestdata(t)
	dir := t.TempDir()
	cfg := smallConfig("onebit-adam")
	cfg.epochs = 1
	cfg.checkpoint = checkpointConfig{dir: dir, every: 5}
	trainLocal(t, 2, train, test, cfg)
	cfg.checkpoint.resume = true

	other := cfg
	other.hyper.freezeStep = 4
	for r, err := range resumeErrors(t, 2, train, test, other) {
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "made by a run with other flags: -freeze-step differs (this run has -freeze-step 4)", "rank %d", r)
	}
	other = cfg
	other.seed++
	for r, err := range resumeErrors(t, 2, train, test, other) {
		require.Error(t, err, "rank %d", r)
		assert.Contains(t, err.Error(), "-seed differs", "rank %d", r)
	}
	// The same flags still resume.
	for r, err := range resumeErrors(t, 2, train, test, cfg) {
		require.NoError(t, err, "rank %d", r)
	}
}

// TestResumeLR: a resume continues with the checkpoint's learning rate
// unless -lr was given on the command line, whose value then wins (SetLR
// after Load); either way rank 0 says which learning rate it uses and
// where it came from, in one line. The checkpoint's learning rate
// continues bit-identically to the uninterrupted run; another -lr does
// not.
func TestResumeLR(t *testing.T) {
	train, test := loadTestdata(t)
	cfg := smallConfig("onebit-adam") // lr 2e-3
	cfg.epochs = 2
	cfg.checkpoint = checkpointConfig{dir: t.TempDir(), every: 5}
	want := trainLocal(t, 2, train, test, cfg)[0].finalHash

	stopped := t.TempDir()
	cfg.checkpoint.dir = stopped
	res, errs := trainRanks(t, 2, train, test, cfg, stopOn(1, 17))
	require.NoError(t, errs[0])
	require.Equal(t, 17, res[0].preempted)
	for _, c := range []struct {
		name     string
		lr       float32
		explicit bool
		line     string
		same     bool // ends bit-identical to the uninterrupted run
	}{
		{"checkpoint", 1e-3, false, "lr 0.002 from the checkpoint", true},
		{"explicit", 1e-5, true, "lr 1e-05 from -lr (the checkpoint had 0.002)", false},
		{"explicit same", 2e-3, true, "lr 0.002 from -lr (the checkpoint had 0.002)", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			rc := cfg
			rc.hyper.lr, rc.lrSet = c.lr, c.explicit
			got := checkResumeLR(t, train, test, rc, stopped, 17, "onebit-adam: "+c.line)
			if c.same {
				assert.Equal(t, want, got, "the checkpoint's learning rate: bit-identical to the uninterrupted run")
			} else {
				assert.NotEqual(t, want, got, "-lr %v changed the learning rate", c.lr)
			}
		})
	}
}

// checkResumeLR resumes rc on 2 ranks from a copy of the checkpoints in
// stopped, made at step at: every rank resumes from at, and rank 0 says
// line (after "mnist: -resume: ") in its one line about the learning
// rate. It returns rank 0's final parameter hash.
func checkResumeLR(t *testing.T, train, test *dataset, rc trainConfig, stopped string, at int, line string) uint64 {
	t.Helper()
	rc.checkpoint.dir = t.TempDir()
	require.NoError(t, os.CopyFS(rc.checkpoint.dir, os.DirFS(stopped)))
	rc.checkpoint.resume = true
	var warn syncBuffer
	rc.warn = &warn
	res, errs := trainRanks(t, 2, train, test, rc, nil)
	for r := range 2 {
		require.NoError(t, errs[r], "rank %d", r)
		assert.Equal(t, at, res[r].resumedFrom, "rank %d", r)
	}
	assert.Contains(t, warn.String(), "mnist: -resume: "+line+"\n")
	assert.Equal(t, 1, strings.Count(warn.String(), ": lr "), "one line, from rank 0:\n%s", warn.String())
	return res[0].finalHash
}

// TestResumeLRDiloco: the outer optimizer's learning rate is its inner
// Adam's, which its checkpoint records under outer.InnerPrefix: a resume
// says it continues with the checkpoint's, as Load restored it, not that
// the checkpoint records none.
func TestResumeLRDiloco(t *testing.T) {
	train, test := loadTestdata(t)
	cfg := smallConfig(diloco) // lr 2e-3
	cfg.epochs = 1
	cfg.checkpoint = checkpointConfig{dir: t.TempDir(), every: 4}
	_, errs := trainRanks(t, 2, train, test, cfg, stopOn(0, 8))
	require.NoError(t, errs[0])
	cfg.checkpoint.resume = true
	cfg.hyper.lr = 1e-3 // the default of -lr, not given
	var warn syncBuffer
	cfg.warn = &warn
	res, errs := trainRanks(t, 2, train, test, cfg, nil)
	for r := range 2 {
		require.NoError(t, errs[r], "rank %d", r)
		assert.Equal(t, 8, res[r].resumedFrom, "rank %d", r)
	}
	assert.Contains(t, warn.String(), "mnist: -resume: diloco: lr 0.002 from the checkpoint\n")
}

func TestCheckpointFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-resume"}, "--resume: needs -checkpoint DIR"},
		{[]string{"-checkpoint", "d", "-checkpoint-every", "0"}, `invalid value "0" for --checkpoint-every: want at least 1`},
		{[]string{"-checkpoint", "d", "-checkpoint-every", "4", "-kill-at", "6"}, `invalid value "6" for --kill-at: want a multiple of -checkpoint-every (4)`},
	} {
		_, err := parseFlags(c.args, &bytes.Buffer{})
		require.Error(t, err, "%v", c.args)
		assert.Contains(t, err.Error(), c.want, "%v", c.args)
	}
}

// resumeErrors runs cfg on w in-process ranks and returns each rank's error.
func resumeErrors(t *testing.T, w int, train, test *dataset, cfg trainConfig) []error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	errs := make([]error, w)
	var mu sync.Mutex
	_ = local.Run(ctx, w, func(ctx context.Context, c comm.Comm) error {
		_, err := trainRank(ctx, c, train, test, cfg, nil)
		mu.Lock()
		errs[c.Rank()] = err
		mu.Unlock()
		return err
	})
	return errs
}
