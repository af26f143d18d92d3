package optim_test

import (
	"context"
	"fmt"
	"log"
	"math"

	"github.com/lowbit-ml/lowbit/optim"
)

// Fit a 4x8 matrix and a bias to targets with Muon in a single process (no
// communicator): the matrix is Muon's, the bias its auxiliary AdamW's, each
// group on its own learning-rate schedule.
func ExampleMuon() {
	w := optim.NewParam("w", 4, 8)
	b := optim.NewParam("b", 4)
	wantW, wantB := make([]float32, 32), []float32{0.5, -0.25, 1, 0}
	for i := range wantW {
		wantW[i] = float32(math.Sin(float64(i*i+1))) / 2
	}
	opt, err := optim.NewMuon(context.Background(), nil, []*optim.Param{w, b}, optim.DefaultMuonConfig())
	if err != nil {
		log.Fatal(err)
	}
	defer opt.Close() // every holder of an optimizer closes it (not a collective)
	const steps = 300
	muonLR, err := optim.CosineDecay(0.02, 0.0002, steps)
	if err != nil {
		log.Fatal(err)
	}
	adamLR, err := optim.CosineDecay(0.02, 0.0002, steps)
	if err != nil {
		log.Fatal(err)
	}
	if err := opt.SetSchedule(muonLR); err != nil { // the Muon group
		log.Fatal(err)
	}
	if err := opt.SetAdamSchedule(adamLR); err != nil { // the AdamW group
		log.Fatal(err)
	}
	// distance writes the gradient of half the squared distance to the
	// targets and returns the distance.
	distance := func() float64 {
		var ss float64
		for _, p := range []struct{ got, want, grad []float32 }{
			{w.Data(), wantW, w.GradData()}, {b.Data(), wantB, b.GradData()},
		} {
			for i := range p.got {
				p.grad[i] = p.got[i] - p.want[i]
				ss += float64(p.grad[i]) * float64(p.grad[i])
			}
		}
		return math.Sqrt(ss)
	}
	fmt.Println("Muon updates", opt.MuonParams())
	fmt.Printf("distance %.2f", distance())
	for range steps {
		distance()
		if err := opt.Step(context.Background()); err != nil {
			log.Fatal(err)
		}
	}
	fmt.Printf(" -> %.2f after %d steps\n", distance(), opt.Stats().Steps)
	// Output:
	// Muon updates [w]
	// distance 2.33 -> 0.00 after 300 steps
}
