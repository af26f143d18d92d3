//go:build !amd64 || purego

package signpack

func pack(dst []byte, src []float32)                          { packGeneric(dst, src) }
func packResidual(dst []byte, x []float32, scale float32)     { packResidualGeneric(dst, x, scale) }
func unpackScale(dst []float32, src []byte, scale float32)    { unpackScaleGeneric(dst, src, scale) }
func unpackScaleAdd(acc []float32, src []byte, scale float32) { unpackScaleAddGeneric(acc, src, scale) }
