//go:build !amd64 || purego

package errorfeedback

// addSumSquares sets x[i] += in[i] and returns the float64 sum of the new
// x[i] squared.
func addSumSquares(x, in []float32) float64 { return addSumSquaresGeneric(x, in) }

// sumSquares returns the float64 sum of x[i] squared.
func sumSquares(x []float32) float64 { return sumSquaresGeneric(x) }

// fastPath names the norm kernels Compress uses on this build.
func fastPath() string { return "generic" }

// lanesFast is the lanes kernel Norm uses.
func lanesFast(acc *[lanes]float64, x, in []float32) { lanesGeneric(acc, x, in) }

// packLanesFast does nothing here: Norm.CompensatePack takes its portable
// path.
func packLanesFast(acc *[lanes]float64, dst []byte, x, in []float32) int { return 0 }

// sumPackLanesFast does nothing here: Norm.CompensatePackSigns takes its
// portable path.
func sumPackLanesFast(acc *[lanes]float64, dst []byte, x []float32, srcs [][]byte, scales []float32) int {
	return 0
}
