// Package samerun times several ways of doing the same work inside one
// benchmark, in alternation, so that each figure has its baseline from the
// same run (the project's rule for performance claims) and noise from other
// work on a shared machine falls on all of them alike.
package samerun

import (
	"slices"
	"testing"
	"time"
)

// maxRounds bounds the kept timings; later rounds are run but not kept.
const maxRounds = 1024

// Medians calls every pass once per iteration of b.Loop, rotating which
// goes first, and returns the median wall time of each pass in seconds.
// It calls b.ReportAllocs and resets the timer first. Use -benchtime 10x or
// more so that the medians mean something.
func Medians(b *testing.B, passes ...func()) []float64 {
	times := make([][]time.Duration, len(passes))
	for k := range times {
		times[k] = make([]time.Duration, 0, maxRounds)
	}
	rounds := 0
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		for j := range passes {
			k := (rounds + j) % len(passes)
			t0 := time.Now()
			passes[k]()
			if rounds < maxRounds {
				times[k] = append(times[k], time.Since(t0))
			}
		}
		rounds++
	}
	b.StopTimer()
	med := make([]float64, len(passes))
	for k, ts := range times {
		if len(ts) == 0 {
			continue
		}
		slices.Sort(ts)
		med[k] = ts[len(ts)/2].Seconds()
	}
	return med
}

// Steps times step as the benchmark's ns/op and base in the same loop, base
// neither in ns/op nor in allocs/op, and reports base's time per call
// ("NAME-ns/op"), the ratio of step to base ("x-NAME") and step's time per
// element of n ("ns/param"), NAME being baseName. base is called once
// before the timing starts; warm step up yourself if it needs it.
func Steps(b *testing.B, n int, baseName string, step, base func() error) {
	if err := base(); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(n) * 4)
	b.ReportAllocs()
	var baseTime time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if err := step(); err != nil {
			b.Fatal(err)
		}
		b.StopTimer()
		t0 := time.Now()
		if err := base(); err != nil {
			b.Fatal(err)
		}
		baseTime += time.Since(t0)
		b.StartTimer()
	}
	b.StopTimer()
	stepNs := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	baseNs := float64(baseTime.Nanoseconds()) / float64(b.N)
	b.ReportMetric(baseNs, baseName+"-ns/op")
	b.ReportMetric(stepNs/baseNs, "x-"+baseName)
	b.ReportMetric(stepNs/float64(n), "ns/param")
}
