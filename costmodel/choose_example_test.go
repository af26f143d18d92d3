package costmodel_test

import (
	"fmt"
	"time"

	"github.com/lowbit-ml/lowbit/costmodel"
)

// Muon on 16 ranks with a 100 Mbit/s link each, local steps accepted (H
// 25), 40 GiB per rank: the outer optimizer with Muon inside and the
// 1-bit codec; the sparse rows are excluded with Muon inside.
func ExampleModel_Choose() {
	cal, err := costmodel.Builtin()
	if err != nil {
		panic(err)
	}
	link, _ := costmodel.ParseRate("100mbit")
	job := costmodel.Job{Params: 1.3e9, Ranks: 16, Link: link, BucketBytes: 25 << 20,
		StepCompute: time.Second, OuterH: 25, CompressBps: 30e9, MuonFlops: 400e12}
	choice, err := cal.Model.Choose(job, costmodel.ChooseOptions{Muon: true, Memory: 40 << 30})
	if err != nil {
		panic(err)
	}
	fmt.Println(choice.Row, choice.Codec)
	fmt.Println(choice.Reason)
	// Output:
	// outer-muon 1bit
	// outer-muon: 2.13 s/step, 12.11x the next (onebit-muon 25.8 s), fits 40Gi (26.4 GB); excluded: outer-sparse, outer-sparse-2p, outer-sparse-shared, outer-sparse-voted (Muon inside: the sparse codec misses the tighter target the 1-bit codec reaches, orthogonalized updates having entries of similar size (docs/outer.md, "The tighter target: Muon inside"))
}
