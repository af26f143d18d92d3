//go:build race

package zero_test

// cvRace is true under the race detector, which makes the convergence
// run too slow to be worth it.
const cvRace = true
