package main

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/gomlx/compute"
	"github.com/gomlx/compute/gobackend"
	"github.com/gomlx/gomlx/core/tensors"
	"github.com/gomlx/gomlx/ml/model"

	"github.com/lowbit-ml/lowbit/comm"
	lbgomlx "github.com/lowbit-ml/lowbit/integrations/gomlx"
	"github.com/lowbit-ml/lowbit/optim"
)

// evalPoint is one validation of a run.
type evalPoint struct {
	Step    int     `json:"step"`
	Tokens  int64   `json:"tokens"`
	TrainS  float64 `json:"train_s"` // training time so far, validations excluded
	ValLoss float64 `json:"val_loss"`
}

// result is one run, as every rank agrees on it (averaged over the ranks
// where they differ).
type result struct {
	spec         runSpec
	workers      int
	steps        int
	tokens       int64
	valLoss      float64 // nats per byte
	trainLoss    float64 // mean of the last tenth of the steps
	wall         time.Duration // training time: the steps, validations excluded
	commTime     time.Duration // in collectives during the steps
	bytes        float64       // sent per rank in the optimizer's Step, all steps
	lastBytes    float64       // in the last step
	stage        optim.Stage
	skipped      int64
	evals        []evalPoint
	target       float64
	targetStep   int
	targetTime   time.Duration // training time to the first validation at or below target; 0 if none
	targetTokens int64
}

// reached reports whether the run reached the target validation loss.
func (r *result) reached() bool { return r.targetStep > 0 }

// trainer is the one place the lowbit integration plugs into the loop:
// one data-parallel step on this rank's shard, the optimizer's statistics,
// and the clean-up. It is integrations/gomlx's Trainer.
type trainer interface {
	Step(ctx context.Context, inputs ...any) (float32, error)
	Optimizer() optim.Optimizer
	Close() error
}

func newTrainer(c comm.Comm, backend compute.Backend, store *model.Store, m modelConfig, r runSpec, h hyper) (trainer, error) {
	return lbgomlx.New(c, backend, store, lossFn(m), func(ctx context.Context, c comm.Comm, params []*optim.Param) (optim.Optimizer, error) {
		return newOptimizer(ctx, r, h, c, params)
	})
}

// progressFunc reports a validation of a run as it happens (rank 0 only).
type progressFunc func(r runSpec, steps int, e evalPoint, trainLoss float64)

// trainRank is one rank's training run; every rank calls it together, with
// the same corpus and options.
func trainRank(ctx context.Context, c comm.Comm, r runSpec, o *options, data *corpus, progress progressFunc) (*result, error) {
	w, rank := c.Size(), c.Rank()
	if o.batch < w {
		return nil, fmt.Errorf("-batch %d is smaller than the %d ranks", o.batch, w)
	}
	if err := data.check(o.batch, o.model.context); err != nil {
		return nil, err
	}
	backend, err := gobackend.New("")
	if err != nil {
		return nil, err
	}
	defer backend.Finalize()
	store := model.NewStore()
	// Rank 0's seed decides the initial weights; the other ranks' differ on
	// purpose, and the Trainer broadcasts rank 0's.
	store.RootScope().SetParam(model.ParamInitialSeed, int64(o.seed)+int64(rank))
	tc := newTimedComm(c)
	tr, err := newTrainer(tc, backend, store, o.model, r, o.hyper())
	if err != nil {
		return nil, err
	}
	defer tr.Close()

	// The validation graph: the summed loss of this rank's windows.
	eval, err := model.NewExec(backend, store, sumLossFn(o.model))
	if err != nil {
		return nil, err
	}
	vx, vy, vn := valWindows(data.val, o.model.context, o.valWindows, rank, w)
	var vxT, vyT *tensors.Tensor
	if vn > 0 {
		vxT = tensors.FromFlatDataAndDimensions(vx, vn, o.model.context)
		vyT = tensors.FromFlatDataAndDimensions(vy, vn, o.model.context, 1)
	}
	totalWindows := float32(min(o.valWindows, len(data.val)-o.model.context))
	sums := make([]float32, 2)
	validate := func() (float64, error) {
		sums[0], sums[1] = 0, 0
		if vn > 0 {
			out, err := eval.Exec(vxT, vyT)
			if err != nil {
				return 0, fmt.Errorf("validation: %w", err)
			}
			sums[0] = tensors.ToScalar[float32](out[0])
			for _, t := range out {
				_ = t.FinalizeAll()
			}
		}
		if err := c.AllReduce(ctx, sums[:1], comm.Sum); err != nil {
			return 0, err
		}
		return float64(sums[0]) / float64(totalWindows*float32(o.model.context)), nil
	}

	res := &result{spec: r, workers: w, steps: o.steps, target: o.target}
	bat := newBatcher(data.train, o.model.context, o.batch, rank, w, o.seed)
	shard := bat.hi - bat.lo
	tokensPerStep := int64(o.batch) * int64(o.model.context)
	evalEvery := o.evalEvery
	if evalEvery <= 0 {
		evalEvery = max(1, o.steps/20)
	}
	lastN := max(1, o.steps/10)
	var trainTime time.Duration
	var lastLoss, recent float64
	record := func(step int) error {
		vl, err := validate()
		if err != nil {
			return err
		}
		e := evalPoint{Step: step, Tokens: int64(step) * tokensPerStep, TrainS: trainTime.Seconds(), ValLoss: vl}
		res.evals = append(res.evals, e)
		if step > 0 && !res.reached() && o.target > 0 && vl <= o.target {
			res.targetStep, res.targetTime, res.targetTokens = step, trainTime, e.Tokens
		}
		if progress != nil && rank == 0 {
			progress(r, o.steps, e, recent)
		}
		return nil
	}
	if err := record(0); err != nil {
		return nil, err
	}
	var window []float64
	for step := 1; step <= o.steps; step++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		x, y := bat.next(step)
		xt := tensors.FromFlatDataAndDimensions(x, shard, o.model.context)
		yt := tensors.FromFlatDataAndDimensions(y, shard, o.model.context, 1)
		t0 := time.Now()
		l, err := tr.Step(ctx, xt, yt)
		trainTime += time.Since(t0)
		xt.FinalizeAll()
		yt.FinalizeAll()
		if err != nil {
			return nil, fmt.Errorf("step %d: %w", step, err)
		}
		if !math.IsNaN(float64(l)) && !math.IsInf(float64(l), 0) {
			window = append(window, float64(l))
			if len(window) > lastN {
				window = window[1:]
			}
		}
		recent = mean(window)
		if step == o.steps {
			lastLoss = recent
		}
		if step%evalEvery == 0 || step == o.steps {
			if err := record(step); err != nil {
				return nil, err
			}
		}
	}
	st := tr.Optimizer().Stats()
	agg := []float32{float32(lastLoss), float32(trainTime.Seconds()), float32(tc.elapsed().Seconds()), float32(st.BytesSent), float32(st.LastStepBytes)}
	if err := c.AllReduce(ctx, agg, comm.Sum); err != nil {
		return nil, err
	}
	fw := float64(w)
	last := res.evals[len(res.evals)-1]
	res.valLoss = last.ValLoss
	res.tokens = last.Tokens
	res.trainLoss = float64(agg[0]) / fw
	res.wall = time.Duration(float64(agg[1]) / fw * float64(time.Second))
	res.commTime = time.Duration(float64(agg[2]) / fw * float64(time.Second))
	res.bytes, res.lastBytes = float64(agg[3])/fw, float64(agg[4])/fw
	res.stage, res.skipped = st.Stage, st.Skipped
	return res, nil
}

func mean(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}
