//go:build race

package onebit_test

// cvRace is true under the race detector, which makes the convergence
// run too slow to be worth it: the concurrency it exercises is covered by
// the resume and non-finite tests.
const cvRace = true

// raceOn is true under the race detector, where the started tests run
// fewer and smaller cases: they exist under it for the buffers a started
// collective uses while the call computes, which every case touches.
const raceOn = true
