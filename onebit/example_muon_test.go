package onebit_test

import (
	"context"
	"fmt"
	"log"
	"math"
	"slices"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/comm/local"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// Four in-process ranks fit a 16 x 32 matrix and a bias, each rank to
// noisy samples of its own around a common target. The matrix is Muon's,
// the bias the auxiliary AdamW's. Each rank orthogonalizes its own
// momentum, and the updates travel as 1-bit signs with error feedback,
// every rank applying the same average. The first 100 steps (the default
// FreezeStep) are the AdamW group's warm-up (the default
// WarmupAdamWOnly): the bias's gradients are averaged exactly; after
// them its momentum travels at 1 bit too.
func ExampleMuon() {
	const world, steps = 4, 200
	fit := func(i int) float64 { return math.Sin(float64(i * 7)) }
	sample := func(rank, step, i int) float32 { // the fit and noise
		return float32(fit(i) + 0.3*math.Sin(float64(i*13+rank*5+step*11)))
	}
	var dist [world][2]float64 // to the fit, before and after
	var params [world][]float32
	var bytes [world][2]int64 // sent in the first step and in the last
	var stats [world]optim.Stats
	err := local.Run(context.Background(), world, func(ctx context.Context, c comm.Comm) error {
		ps := []*optim.Param{optim.NewParam("w", 16, 32), optim.NewParam("b", 32)}
		cfg := onebit.DefaultMuonConfig()
		cfg.AdamLR = 0.01
		opt, err := onebit.NewMuon(ctx, c, ps, cfg) // every rank together
		if err != nil {
			return err
		}
		defer opt.Close()
		muonLR, err := optim.CosineDecay(0.3, 0.001, steps)
		if err != nil {
			return err
		}
		if err := opt.SetSchedule(muonLR); err != nil { // the Muon group's; SetAdamLR sets AdamW's
			return err
		}
		distance := func() float64 {
			var s float64
			for _, p := range ps {
				for i, x := range p.Data() {
					s += (float64(x) - fit(i)) * (float64(x) - fit(i))
				}
			}
			return math.Sqrt(s)
		}
		dist[c.Rank()][0] = distance()
		for step := range steps {
			for _, p := range ps {
				for i, x := range p.Data() {
					p.GradData()[i] = x - sample(c.Rank(), step, i)
				}
			}
			if err := opt.Step(ctx); err != nil {
				return err
			}
			if step == 0 {
				bytes[c.Rank()][0] = opt.Stats().LastStepBytes
			}
		}
		dist[c.Rank()][1] = distance()
		bytes[c.Rank()][1] = opt.Stats().LastStepBytes
		params[c.Rank()] = append(slices.Clone(ps[0].Data()), ps[1].Data()...)
		stats[c.Rank()] = opt.Stats()
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	same := true
	for r := range world {
		same = same && slices.Equal(params[0], params[r])
	}
	fmt.Println("the same parameters on every rank:", same)
	fmt.Println("stage:", stats[0].Stage)
	fmt.Printf("distance to the fit: %.0f before, below 0.5 after: %v\n", dist[0][0], dist[0][1] < 0.5)
	fmt.Printf("bytes sent by rank 0: %d in the first step, %d in the last\n", bytes[0][0], bytes[0][1])
	// Output:
	// the same parameters on every rank: true
	// stage: compression
	// distance to the fit: 16 before, below 0.5 after: true
	// bytes sent by rank 0: 342 in the first step, 204 in the last
}
