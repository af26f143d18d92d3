package commtest

import (
	"errors"
	"sync"
	"testing"
)

// AllocsOnTwoRanks is testing.AllocsPerRun(runs, ...) of step0, rank 0's
// step of a two-rank group (a collective), while another goroutine calls
// step1, rank 1's, as often (runs+1 times: AllocsPerRun makes one warm-up
// call). Both ranks' allocations are counted, since AllocsPerRun counts
// the process's. It returns the first error of either step, if any.
func AllocsOnTwoRanks(runs int, step0, step1 func() error) (float64, error) {
	var (
		mu   sync.Mutex
		errs []error
	)
	fail := func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range runs + 1 {
			if err := step1(); err != nil {
				fail(err)
				return
			}
		}
	}()
	allocs := testing.AllocsPerRun(runs, func() {
		if err := step0(); err != nil {
			fail(err)
		}
	})
	<-done
	return allocs, errors.Join(errs...)
}
