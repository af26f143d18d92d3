package main

import (
	"cmp"
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
// included) instead of training it again. Rank 0 writes it after the
// optimizer's last checkpoint, as an optim.Checkpoint of its own algorithm
// (resultAlgorithm and the optimizer's name) with optim.SaveFile:
// atomically (a crash leaves the old file or the new one, never a torn
// one) and checksummed. Its counters and scalars hold the figures and the
// run's flags, each evaluation a row of them; the per-step losses are a
// tensor, float32 as training keeps them. NaN and Inf losses of a diverged
// run survive. A run that trains the optimizer from the start removes the
// file first.

const (
	// resultAlgorithm, then "/" and the optimizer's name, is the
	// algorithm a result file records.
	resultAlgorithm = "mnist-result"
	// resultVersion is the version of the file's entries (1 was a gob
	// file).
	resultVersion = 2
	// resultLoss is the tensor of the per-step losses.
	resultLoss = "loss"
	// resultFlag, then a flag's name, is its value (see resultFlags).
	resultFlag = "flag"
)

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
// in dir (optim.SaveFile: atomically).
func saveResult(dir string, cfg trainConfig, res *result) error {
	ck := &optim.Checkpoint{
		Algorithm: resultAlgorithm + "/" + res.optimizer, World: res.workers, Stage: res.stage,
		Ints: map[string]int64{
			"version": resultVersion, "steps": int64(res.steps), "test_size": int64(res.testSize), "skipped": res.skipped,
			"wall_ns": int64(res.wall), "compute_ns": int64(res.compute), "comm_ns": int64(res.comm), "compress_ns": int64(res.compress),
			"init_hash": int64(res.initHash), "final_hash": int64(res.finalHash),
			"resumed_from": int64(res.resumedFrom), "resumed_world": int64(res.resumedWorld), "carried": carriedCode(res.carried),
			"evals": int64(len(res.evals)),
		},
		Floats: map[string]float64{
			"train_loss": res.trainLoss, "bytes_sent": res.bytesSent, "last_step_bytes": res.lastStepBytes,
			"utilization": res.utilization,
		},
	}
	for _, s := range resultFlags(cfg, res.workers) {
		ck.Ints[resultFlag+s.flag] = s.value
	}
	putEval(ck, "test/", res.test)
	for i, e := range res.evals {
		putEval(ck, fmt.Sprintf("eval/%d/", i), e)
	}
	loss := make([]float32, len(res.loss))
	for i, v := range res.loss {
		loss[i] = float32(v) // training's float32 losses, exactly
	}
	ck.Tensors = []optim.Tensor{{Name: resultLoss, Shape: []int{len(loss)}, Data: loss}}
	err := os.MkdirAll(dir, 0o755)
	if err == nil {
		err = optim.SaveFile(resultPath(dir, res.optimizer), ck)
	}
	if err != nil {
		return fmt.Errorf("saving the result of %s: %w", res.optimizer, err)
	}
	return nil
}

func putEval(ck *optim.Checkpoint, prefix string, e evalPoint) {
	ck.Ints[prefix+"step"], ck.Ints[prefix+"wall_ns"] = int64(e.step), int64(e.wall)
	ck.Floats[prefix+"acc"], ck.Floats[prefix+"loss"], ck.Floats[prefix+"bytes"] = e.acc, e.loss, e.bytes
}

// loadResult reads the result of cfg.optimizer from dir: nil and no error
// when there is none; an error for a file that cannot be used (damaged,
// of another version, or made by a run with other flags).
func loadResult(dir string, cfg trainConfig, world int) (*result, error) {
	path := resultPath(dir, cfg.optimizer)
	if _, err := os.Stat(path); errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	ck, err := optim.LoadFile(path)
	if err != nil {
		return nil, err
	}
	r := resultReader{ck: ck}
	if v := r.int("version"); ck.Algorithm != resultAlgorithm+"/"+cfg.optimizer || v != resultVersion {
		return nil, fmt.Errorf("%s: not a result of %s (algorithm %q, version %d)", path, cfg.optimizer, ck.Algorithm, v)
	}
	for _, s := range resultFlags(cfg, world) {
		if v, ok := ck.Ints[resultFlag+s.flag]; !ok || v != s.value {
			return nil, fmt.Errorf("%s: made by a run with other flags: %s differs (this run has %s %s)", path, s.flag, s.flag, s.show)
		}
	}
	res := &result{
		optimizer: cfg.optimizer, workers: ck.World, steps: int(r.int("steps")), testSize: int(r.int("test_size")),
		stage: ck.Stage, skipped: r.int("skipped"), trainLoss: r.float("train_loss"), test: r.eval("test/"),
		wall: time.Duration(r.int("wall_ns")), compute: time.Duration(r.int("compute_ns")),
		comm: time.Duration(r.int("comm_ns")), compress: time.Duration(r.int("compress_ns")),
		bytesSent: r.float("bytes_sent"), lastStepBytes: r.float("last_step_bytes"), utilization: r.float("utilization"),
		initHash: uint64(r.int("init_hash")), finalHash: uint64(r.int("final_hash")),
		resumedFrom: int(r.int("resumed_from")), resumedWorld: int(r.int("resumed_world")),
		carried: carriedOf(r.int("carried")),
	}
	evals := r.int("evals")
	for i := range min(max(evals, 0), int64(len(ck.Floats))) { // each has two scalars at least
		res.evals = append(res.evals, r.eval(fmt.Sprintf("eval/%d/", i)))
	}
	loss, err := ck.TensorData(resultLoss, res.steps)
	if r.err == nil && err != nil {
		r.err = err
	}
	if r.err == nil && (len(res.evals) == 0 || int64(len(res.evals)) != evals) {
		r.err = fmt.Errorf("%d evaluations", evals)
	}
	if r.err != nil {
		return nil, fmt.Errorf("%s: not a whole result of %s: %w", path, cfg.optimizer, r.err)
	}
	res.loss = make([]float64, len(loss))
	for i, v := range loss {
		res.loss[i] = float64(v)
	}
	return res, nil
}

// resultReader reads the entries of a result file; the first missing one
// is its err.
type resultReader struct {
	ck  *optim.Checkpoint
	err error
}

func (r *resultReader) int(name string) int64 {
	v, err := r.ck.Int(name)
	r.err = cmp.Or(r.err, err)
	return v
}

func (r *resultReader) float(name string) float64 {
	v, err := r.ck.Float(name)
	r.err = cmp.Or(r.err, err)
	return v
}

// eval reads an evaluation; its bytes are -1 (unknown) in a file made
// before they were kept.
func (r *resultReader) eval(prefix string) evalPoint {
	e := evalPoint{step: int(r.int(prefix + "step")), wall: time.Duration(r.int(prefix + "wall_ns")),
		acc: r.float(prefix + "acc"), loss: r.float(prefix + "loss"), bytes: -1}
	if b, err := r.ck.Float(prefix + "bytes"); err == nil {
		e.bytes = b
	}
	return e
}

// carriedCode is how a result file keeps carried, a carry's String or ""
// (no resume on another number of ranks): the carry plus 1, or 0.
func carriedCode(carried string) int64 {
	for c := carryCopy; c <= carryOuter; c++ {
		if c.String() == carried {
			return int64(c) + 1
		}
	}
	return 0
}

// carriedOf is the carried that carriedCode kept as code.
func carriedOf(code int64) string {
	if code < 1 || code > int64(carryOuter)+1 {
		return ""
	}
	return carry(code - 1).String()
}

// removeResult removes the result of optimizer name from dir, if any: a
// run that trains it from the start makes the old one stale.
func removeResult(dir, name string) error {
	// A temporary file a save (optim.SaveFile) killed before its rename
	// left behind.
	tmps, _ := filepath.Glob(filepath.Join(dir, "."+filepath.Base(resultPath(dir, name))+".tmp-*"))
	for _, t := range tmps {
		os.Remove(t)
	}
	if err := os.Remove(resultPath(dir, name)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("removing the stale result of %s: %w", name, err)
	}
	return nil
}
