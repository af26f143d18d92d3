//go:build !amd64 || purego

package quant

func narrowFP16(dst []uint16, src []float32) int { return narrowFP16Generic(dst, src) }
func narrowBF16(dst []uint16, src []float32) int { return narrowBF16Generic(dst, src) }
func widenFP16(dst []float32, src []uint16)      { widenFP16Generic(dst, src) }
func widenBF16(dst []float32, src []uint16)      { widenBF16Generic(dst, src) }
func widenAddFP16(acc []float32, src []uint16)   { widenAddFP16Generic(acc, src) }
func widenAddBF16(acc []float32, src []uint16)   { widenAddBF16Generic(acc, src) }

// readBaseline reads every element of p (the memory-bandwidth baseline of
// the benchmarks) and returns the OR of their bits.
func readBaseline(p []float32) uint32 { return readGeneric(p) }

// halfPath names the kernels of each format on this build.
func halfPath(Format) string { return "generic" }
