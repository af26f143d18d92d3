//go:build !race

package outer_test

// raceOn is true under the race detector (see race_test.go).
const raceOn = false
