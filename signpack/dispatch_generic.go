//go:build !amd64 || purego

package signpack

func pack(dst []byte, src []float32)                          { packGeneric(dst, src) }
func packResidual(dst []byte, x []float32, scale float32)     { packResidualGeneric(dst, x, scale) }
func unpackScale(dst []float32, src []byte, scale float32)    { unpackScaleGeneric(dst, src, scale) }
func unpackScaleAdd(acc []float32, src []byte, scale float32) { unpackScaleAddGeneric(acc, src, scale) }

// unpackScaleStream has no non-temporal stores on this build.
func unpackScaleStream(dst []float32, src []byte, scale float32) { unpackScaleGeneric(dst, src, scale) }
func streams([]float32) bool                                     { return false }

// readBaseline reads every element of p (the memory-bandwidth baseline of
// the benchmarks) and returns the OR of their bits.
func readBaseline(p []float32) uint32 { return readGeneric(p) }

// fastPath names the kernels pack and friends use on this build.
func fastPath() string { return "generic" }
