//go:build race

package onebit_test

// cvRace is true under the race detector, which makes the convergence
// run too slow to be worth it: the concurrency it exercises is covered by
// the resume and non-finite tests.
const cvRace = true
