package costmodel_test

import (
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/costmodel"
)

// A 340M-parameter model on 64 ranks with a 10 Gbit/s NIC each, gradients
// in 25 MiB buckets: the exact allreduce against the 1-bit one.
func ExampleModel_Plan() {
	cal, err := costmodel.Builtin()
	if err != nil {
		panic(err)
	}
	link, _ := costmodel.ParseRate("10gbit")
	p, err := cal.Model.Plan(costmodel.Job{
		Params: 340e6, Ranks: 64, Link: link, LinkName: "10gbit",
		BucketBytes: 25 << 20, CompressBps: 10e9, Alpha: 10e-6,
	})
	if err != nil {
		panic(err)
	}
	for _, r := range p.Rows {
		fmt.Printf("%-9s latency %.3fs transfer %.3fs compress %.3fs: %.2fs per step, %.1fx\n",
			r.Collective, r.LatencyS, r.TransferS, r.CompressS, r.StepS, r.SpeedupExact)
	}
	// Output:
	// allreduce latency 0.066s transfer 2.142s compress 0.000s: 2.21s per step, 1.0x
	// onebit    latency 0.098s transfer 0.067s compress 0.109s: 0.27s per step, 8.0x
}

// How well the built-in calibration predicts a rank count it was not
// fitted to, from 4 MiB per rank up.
func ExampleCalibration_HoldOut() {
	cal, err := costmodel.Builtin()
	if err != nil {
		panic(err)
	}
	checks, err := cal.HoldOut()
	if err != nil {
		panic(err)
	}
	worst := 0.0
	for _, c := range checks {
		if c.Bytes >= 4<<20 {
			worst = max(worst, math.Abs(c.RelError))
		}
	}
	fmt.Printf("%d points, largest error from 4 MiB up: %.0f%%\n", len(checks), 100*worst)
	// Output: 72 points, largest error from 4 MiB up: 20%
}
