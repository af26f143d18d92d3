//go:build !amd64 || purego

package quant

// fast is the portable path on builds without assembly.
var fast = generic

// quantPath names the quantizer kernels of this build.
func quantPath() string { return "generic" }
