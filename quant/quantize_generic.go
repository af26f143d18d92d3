//go:build !amd64 || purego

package quant

// fast is the portable path on builds without assembly.
var fast = generic
