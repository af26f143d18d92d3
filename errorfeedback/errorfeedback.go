// Package errorfeedback holds the error-compensation step of 1-bit
// compression: add the residual kept from earlier steps to the new input,
// compress the sum to its signs and one scale, and keep what the compression
// lost as the next residual.
//
// Over many steps the residuals telescope: the sum of everything emitted
// plus the final residual equals the sum of everything put in, so no
// information is lost for good, only delayed.
package errorfeedback

import (
	"fmt"
	"math"

	"github.com/lowbit-ml/lowbit/signpack"
)

// Residual is the error-feedback state of one tensor on one rank: the part
// of earlier inputs that compression has not yet delivered. Its length is
// the padded length of the tensor. The zero-length Residual is valid and
// compresses nothing.
type Residual []float32

// NewResidual returns a zeroed residual of n elements.
func NewResidual(n int) Residual { return make(Residual, n) }

// Reset zeroes the residual.
func (r Residual) Reset() { clear(r) }

// Compress runs one compensate-compress-update step:
//
//	x     = pad(input) + r       (input is zero beyond its length)
//	scale = ||x||_2 / sqrt(len(r))
//	r     = x - scale*sgn(x)
//
// It writes sgn(x) into packed in the signpack wire format and returns
// scale. The norm is accumulated in float64 and rounded once to float32.
// input may be shorter than r (the pad lanes are zero); packed must hold
// signpack.PackedLen(len(r)) bytes. Compress does not allocate.
func (r Residual) Compress(packed []byte, input []float32) (scale float32, err error) {
	if len(input) > len(r) {
		return 0, fmt.Errorf("errorfeedback: input of %d elements is longer than the residual (%d)", len(input), len(r))
	}
	if len(packed) < signpack.PackedLen(len(r)) {
		return 0, fmt.Errorf("errorfeedback: packed buffer of %d bytes cannot hold %d signs", len(packed), len(r))
	}
	if len(r) == 0 {
		return 0, nil
	}
	return r.compress(packed, input, addSumSquares, sumSquares), nil
}

// Compensate runs the first half of Compress: r = pad(input) + r, and
// returns scale = ||r||_2 / sqrt(len(r)), accumulated in float64 and
// rounded once. r then holds x. The caller finishes the step with
// signpack.PackResidual(packed, r, scale), which packs sgn(x) and leaves
// x - scale*sgn(x) in r; it may do so in pieces (any split into runs of
// whole bytes, that is multiples of 8 elements, gives the same bytes and
// residual), which lets a pipelined collective send the first pieces while
// it packs the rest. Compress is Compensate followed by one PackResidual.
// Compensate does not allocate.
func (r Residual) Compensate(input []float32) (scale float32, err error) {
	if len(input) > len(r) {
		return 0, fmt.Errorf("errorfeedback: input of %d elements is longer than the residual (%d)", len(input), len(r))
	}
	if len(r) == 0 {
		return 0, nil
	}
	return r.compensate(input, addSumSquares, sumSquares), nil
}

func (r Residual) compensate(input []float32,
	addSumSquares func(x, in []float32) float64, sumSquares func(x []float32) float64) float32 {
	ss := addSumSquares(r[:len(input)], input) + sumSquares(r[len(input):])
	return float32(math.Sqrt(ss) / math.Sqrt(float64(len(r))))
}

// compress is Compress after its argument checks, with the norm kernels
// passed in so that the benchmarks can time either set.
func (r Residual) compress(packed []byte, input []float32,
	addSumSquares func(x, in []float32) float64, sumSquares func(x []float32) float64) float32 {
	scale := r.compensate(input, addSumSquares, sumSquares)
	signpack.PackResidual(packed, r, scale)
	return scale
}
