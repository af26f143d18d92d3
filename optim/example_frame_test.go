package optim_test

import (
	"context"
	"fmt"
	"log"
	"math"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/optim"
)

// sgd is plain data-parallel SGD written on optim.Frame, as a new
// optimizer would be: the frame does the size check, the learning rate
// and its schedule, the skip on non-finite gradients, the counters and
// the traffic; the optimizer registers its update and adds its state to
// the frame's checkpoint.
type sgd struct {
	f      *optim.Frame
	params []*optim.Param
	sizes  [][]float32
}

func newSGD(c comm.Comm, params []*optim.Param, lr float32) *sgd {
	o := &sgd{params: params}
	for _, p := range params {
		o.sizes = append(o.sizes, p.Data())
	}
	o.f = optim.NewFrame(optim.FrameConfig{
		Name: "example: SGD", Algorithm: "sgd", Comm: c,
		Params: params, Sizes: o.sizes, LR: lr, Stage: optim.StageExact,
	})
	o.f.Handle(optim.StageExact, o.update)
	return o
}

func (o *sgd) update(ctx context.Context, t int64, lr float32) error {
	if err := optim.AverageGrads(ctx, o.f.Comm(), o.params); err != nil {
		return err
	}
	for _, p := range o.params {
		optim.Descend(p.Data(), p.GradData(), lr)
	}
	return nil
}

func (o *sgd) Step(ctx context.Context) error     { return o.f.Step(ctx) }
func (o *sgd) Params() []*optim.Param             { return o.params }
func (o *sgd) Stats() optim.Stats                 { return o.f.Stats() }
func (o *sgd) SetLR(lr float32) error             { return o.f.SetLR(lr) }
func (o *sgd) SetSchedule(s optim.Schedule) error { return o.f.SetSchedule(s) }
func (o *sgd) LR() float32                        { return o.f.LR() }

// Close has nothing to release: the SGD made no communicator of its own.
func (o *sgd) Close() error { return nil }

func (o *sgd) State() (*optim.Checkpoint, error) {
	ck := o.f.Checkpoint()
	for _, p := range o.params {
		ck.AddTensor(optim.ParamTensorName(p.Name), p.Shape(), p.Data())
	}
	return ck, nil
}

func (o *sgd) Load(ck *optim.Checkpoint) error {
	st, err := o.f.CheckLoad(ck, optim.StageExact)
	if err != nil {
		return fmt.Errorf("example: SGD: %w", err)
	}
	rs := ck.Restore()
	for _, p := range o.params {
		rs.Tensor(optim.ParamTensorName(p.Name), p.Data())
	}
	if err := rs.Apply(); err != nil {
		return fmt.Errorf("example: SGD: %w", err)
	}
	o.f.Restore(st)
	return nil
}

// An optimizer built on Frame: SGD on (w-3)^2 with a warm-up and a cosine
// decay, one bad step skipped.
func ExampleFrame() {
	w, err := optim.NewParamFrom("w", []float32{0}, 1)
	if err != nil {
		log.Fatal(err)
	}
	var opt interface {
		optim.Optimizer
		optim.LRSetter
	} = newSGD(nil, []*optim.Param{w}, 0.1)
	cosine, err := optim.CosineDecay(0.2, 0.01, 90)
	if err != nil {
		log.Fatal(err)
	}
	sched, err := optim.LinearWarmup(10, cosine)
	if err != nil {
		log.Fatal(err)
	}
	if err := opt.SetSchedule(sched); err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	for step := 1; step <= 101; step++ {
		w.GradData()[0] = 2 * (w.Data()[0] - 3)
		if step == 50 {
			w.GradData()[0] = float32(math.Inf(1)) // skipped
		}
		if err := opt.Step(ctx); err != nil {
			log.Fatal(err)
		}
	}
	st := opt.Stats()
	fmt.Printf("w = %.3f, %d steps, %d skipped, last lr %.3f\n", w.Data()[0], st.Steps, st.Skipped, opt.LR())
	// Output: w = 3.000, 101 steps, 1 skipped, last lr 0.010
}
