package main

import (
	"bytes"
	"encoding/gob"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/lowbit-ml/lowbit/optim"
)

// A finished optimizer's result is kept next to its checkpoints, in
// DIR/OPT.result, so that a resumed -compare prints the whole table with
// the numbers each optimizer was trained with (its training time and bytes
// included) instead of training it again. Rank 0 writes it atomically
// (a temporary file renamed over it), after the optimizer's last
// checkpoint; a run that trains the optimizer from the start removes it
// first.

// resultVersion is the version of the file's encoding.
const resultVersion = 1

// savedResult is result as the file holds it (gob: NaN and Inf losses of
// a diverged run survive, which JSON would refuse).
type savedResult struct {
	Version int
	// Settings are the run's flags (see resultFlags): a resume with other
	// flags does not take the result.
	Settings map[string]int64

	Optimizer                     string
	Workers, Steps, TestSize      int
	Stage                         string
	Skipped                       int64
	TrainLoss                     float64
	Test                          savedEval
	Wall, Compute, Comm, Compress time.Duration
	BytesSent, LastStepBytes      float64
	Loss                          []float64
	Evals                         []savedEval
	InitHash, FinalHash           uint64
	ResumedFrom, ResumedWorld     int
	Carried                       string // how the resume on ResumedWorld ranks carried the state over
}

type savedEval struct {
	Step      int
	Wall      time.Duration
	Acc, Loss float64
}

// resultPath is the file of optimizer name's result in dir.
func resultPath(dir, name string) string { return filepath.Join(dir, name+".result") }

// resultFlags are the flags a result records and a resume must share:
// the checkpoints' (see settings) but -workers, as a result may come from
// a run on another number of ranks, and -epochs.
func resultFlags(cfg trainConfig, world int) []setting {
	var fl []setting
	for _, s := range settings(cfg, world) {
		if s.flag != "-workers" {
			fl = append(fl, s)
		}
	}
	return append(fl, setting{"-epochs", int64(cfg.epochs), fmt.Sprint(cfg.epochs)})
}

// saveResult writes res, the finished result of cfg.optimizer, to its file
// in cfg.checkpoint.dir atomically: a crash leaves the old file or the new
// one, never a torn one.
func saveResult(dir string, cfg trainConfig, res *result) error {
	sr := savedResult{
		Version: resultVersion, Settings: map[string]int64{},
		Optimizer: res.optimizer, Workers: res.workers, Steps: res.steps, TestSize: res.testSize,
		Stage: string(res.stage), Skipped: res.skipped, TrainLoss: res.trainLoss, Test: saveEval(res.test),
		Wall: res.wall, Compute: res.compute, Comm: res.comm, Compress: res.compress,
		BytesSent: res.bytesSent, LastStepBytes: res.lastStepBytes, Loss: res.loss,
		InitHash: res.initHash, FinalHash: res.finalHash, ResumedFrom: res.resumedFrom, ResumedWorld: res.resumedWorld,
		Carried: res.carried,
	}
	for _, s := range resultFlags(cfg, res.workers) {
		sr.Settings[s.flag] = s.value
	}
	for _, e := range res.evals {
		sr.Evals = append(sr.Evals, saveEval(e))
	}
	var b bytes.Buffer
	if err := gob.NewEncoder(&b).Encode(&sr); err != nil {
		return fmt.Errorf("saving the result of %s: %w", res.optimizer, err)
	}
	path := resultPath(dir, res.optimizer)
	if err := writeAtomic(path, b.Bytes()); err != nil {
		return fmt.Errorf("saving the result of %s: %w", res.optimizer, err)
	}
	return nil
}

func saveEval(e evalPoint) savedEval {
	return savedEval{Step: e.step, Wall: e.wall, Acc: e.acc, Loss: e.loss}
}

// loadResult reads the result of cfg.optimizer from dir: nil and no error
// when there is none; an error for a file that cannot be used (damaged,
// or made by a run with other flags).
func loadResult(dir string, cfg trainConfig, world int) (*result, error) {
	path := resultPath(dir, cfg.optimizer)
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var sr savedResult
	if err := gob.NewDecoder(bytes.NewReader(b)).Decode(&sr); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if sr.Version != resultVersion || sr.Optimizer != cfg.optimizer || len(sr.Loss) != sr.Steps || len(sr.Evals) == 0 {
		return nil, fmt.Errorf("%s: not a result of %s (version %d)", path, cfg.optimizer, sr.Version)
	}
	for _, s := range resultFlags(cfg, world) {
		if v, ok := sr.Settings[s.flag]; !ok || v != s.value {
			return nil, fmt.Errorf("%s: made by a run with other flags: %s differs (this run has %s %s)", path, s.flag, s.flag, s.show)
		}
	}
	res := &result{
		optimizer: sr.Optimizer, workers: sr.Workers, steps: sr.Steps, testSize: sr.TestSize,
		stage: optim.Stage(sr.Stage), skipped: sr.Skipped, trainLoss: sr.TrainLoss, test: loadEval(sr.Test),
		wall: sr.Wall, compute: sr.Compute, comm: sr.Comm, compress: sr.Compress,
		bytesSent: sr.BytesSent, lastStepBytes: sr.LastStepBytes, loss: sr.Loss,
		initHash: sr.InitHash, finalHash: sr.FinalHash, resumedFrom: sr.ResumedFrom, resumedWorld: sr.ResumedWorld,
		carried: sr.Carried,
	}
	for _, e := range sr.Evals {
		res.evals = append(res.evals, loadEval(e))
	}
	return res, nil
}

func loadEval(e savedEval) evalPoint {
	return evalPoint{step: e.Step, wall: e.Wall, acc: e.Acc, loss: e.Loss}
}

// removeResult removes the result of optimizer name from dir, if any: a
// run that trains it from the start makes the old one stale.
func removeResult(dir, name string) error {
	// A temporary file a save killed before its rename left behind.
	tmps, _ := filepath.Glob(filepath.Join(dir, "."+filepath.Base(resultPath(dir, name))+".tmp-*"))
	for _, t := range tmps {
		os.Remove(t)
	}
	if err := os.Remove(resultPath(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing the stale result of %s: %w", name, err)
	}
	return nil
}

// writeAtomic writes b to path through a synced temporary file in the same
// directory renamed over path, then syncs the directory.
func writeAtomic(path string, b []byte) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	if d, err := os.Open(dir); err == nil {
		serr := d.Sync()
		d.Close()
		if serr != nil && !errors.Is(serr, os.ErrInvalid) {
			return fmt.Errorf("syncing %s: %w", dir, serr)
		}
	}
	return nil
}
