//go:build !race

package onebit_test

// cvRace is true under the race detector (see convergence_race_test.go).
const cvRace = false

// raceOn is true under the race detector (see convergence_race_test.go).
const raceOn = false
