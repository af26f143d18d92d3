//go:build race

package outer_test

// raceOn is true under the race detector, where TestMemoryPerParameter,
// which counts bytes, and TestAccumulatorBF16's training are skipped.
const raceOn = true
