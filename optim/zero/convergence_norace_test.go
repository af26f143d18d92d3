//go:build !race

package zero_test

// cvRace is true under the race detector (see convergence_race_test.go).
const cvRace = false
