//go:build amd64 && !purego

package errorfeedback

import "golang.org/x/sys/cpu"

// The amd64 fast path. The assembly kernels in norm_amd64.s process whole
// blocks of 32 elements with AVX2 and FMA; the portable kernels finish the
// tail and stand in for them on CPUs without AVX2 or FMA.

// block is the number of elements one iteration of an assembly kernel
// handles.
const block = 32

// useAVX2 reports whether the CPU and the operating system support AVX2 and
// FMA. It is detected once and never changes.
var useAVX2 = cpu.X86.HasAVX2 && cpu.X86.HasFMA

// addSumSquares sets x[i] += in[i] and returns the float64 sum of the new
// x[i] squared.
func addSumSquares(x, in []float32) float64 {
	if useAVX2 {
		return addSumSquaresFast(x, in)
	}
	return addSumSquaresGeneric(x, in)
}

// sumSquares returns the float64 sum of x[i] squared.
func sumSquares(x []float32) float64 {
	if useAVX2 {
		return sumSquaresFast(x)
	}
	return sumSquaresGeneric(x)
}

// The *Fast functions require AVX2 and FMA: the assembly handles the whole
// blocks and the generic kernels the rest. The float32 additions are the
// same as the generic kernels'; the float64 sums differ from theirs only in
// the order of summation (the squares of float32 values are exact in
// float64, fused or not).

func addSumSquaresFast(x, in []float32) float64 {
	in = in[:len(x)]
	var s float64
	if nb := len(x) / block; nb > 0 {
		s = addSumSquaresAVX2(&x[0], &in[0], nb)
		x, in = x[nb*block:], in[nb*block:]
	}
	return s + addSumSquaresGeneric(x, in)
}

func sumSquaresFast(x []float32) float64 {
	var s float64
	if nb := len(x) / block; nb > 0 {
		s = sumSquaresAVX2(&x[0], nb)
		x = x[nb*block:]
	}
	return s + sumSquaresGeneric(x)
}

// fastPath names the norm kernels Compress uses on this CPU.
func fastPath() string {
	if useAVX2 {
		return "avx2"
	}
	return "generic"
}

// Implemented in norm_amd64.s.

// addSumSquaresAVX2 sets x[i] += in[i] for blocks*32 elements and returns
// the float64 sum of the new x[i] squared.
//
//go:noescape
func addSumSquaresAVX2(x, in *float32, blocks int) float64

// sumSquaresAVX2 returns the float64 sum of the squares of blocks*32
// elements of x.
//
//go:noescape
func sumSquaresAVX2(x *float32, blocks int) float64

// lanesFast is the lanes kernel Norm uses: AVX2 and FMA where the CPU has
// them.
func lanesFast(acc *[lanes]float64, x, in []float32) {
	if !useAVX2 || len(x) < lanes {
		lanesGeneric(acc, x, in)
		return
	}
	_ = in[len(x)-1]
	addSumSquaresLanesAVX2(acc, &x[0], &in[0], len(x)/lanes)
}

// addSumSquaresLanesAVX2 is addSumSquaresAVX2 that starts from and leaves
// its 32 partial sums in acc (element i of a block in acc[i]).
//
//go:noescape
func addSumSquaresLanesAVX2(acc *[lanes]float64, x, in *float32, blocks int)

// packLanesFast is Norm.CompensatePack's kernel for whole blocks of 32
// elements starting at lane 0: it returns how many elements it did (none
// without AVX2 and FMA).
func packLanesFast(acc *[lanes]float64, dst []byte, x, in []float32) int {
	nb := min(len(x), len(in)) / lanes
	if !useAVX2 || nb == 0 {
		return 0
	}
	_ = dst[nb*lanes/8-1]
	compensatePackAVX2(acc, &x[0], &in[0], &dst[0], nb)
	return nb * lanes
}

// compensatePackAVX2 is addSumSquaresLanesAVX2 that also packs the signs
// of the sums into blocks*4 bytes of dst, as signpack.Pack would.
//
//go:noescape
func compensatePackAVX2(acc *[lanes]float64, x, in *float32, dst *byte, blocks int)

// sumPackLanesFast is Norm.CompensatePackSigns's kernel for whole blocks
// of 32 elements starting at lane 0: it returns how many elements it did
// (none without AVX2 and FMA).
func sumPackLanesFast(acc *[lanes]float64, dst []byte, x []float32, srcs [][]byte, scales []float32) int {
	nb := len(x) / lanes
	if !useAVX2 || nb == 0 || len(srcs) == 0 {
		return 0
	}
	_ = dst[nb*lanes/8-1]
	_ = scales[len(srcs)-1]
	for _, s := range srcs {
		_ = s[nb*lanes/8-1]
	}
	sumCompensatePackAVX2(acc, &x[0], &dst[0], &srcs[0], &scales[0], len(srcs), nb)
	return nb * lanes
}

// sumCompensatePackAVX2 is compensatePackAVX2 with in formed from the
// packed signs of every srcs[j] (nsrc of them), each scaled by scales[j],
// added in order of j.
//
//go:noescape
func sumCompensatePackAVX2(acc *[lanes]float64, x *float32, dst *byte, srcs *[]byte, scales *float32, nsrc, blocks int)
