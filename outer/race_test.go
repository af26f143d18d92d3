//go:build race

package outer_test

// raceOn is true under the race detector, where TestMemoryPerParameter,
// which counts bytes, is skipped.
const raceOn = true
