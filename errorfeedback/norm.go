package errorfeedback

import (
	"math"

	"github.com/lowbit-ml/lowbit/signpack"
)

// lanes is the number of float64 partial sums a Norm keeps.
const lanes = 32

// Norm accumulates the float64 sum of squares of a run of float32 values
// that arrives in pieces, such as one chunk of a tensor that a pipelined
// collective compresses piece by piece. Element i of the run is summed into
// lane i mod 32, each lane in the order of the run, and Sum adds the lanes
// in a fixed order; so the result depends only on the run, never on where it
// was cut, and the fast and the portable kernels give the same bits (the
// square of a float32 is exact in float64, fused or not). The zero Norm is
// an empty run. A Norm does not allocate.
type Norm struct {
	acc [lanes]float64
	n   int // elements added so far: the lane of the next one is n % lanes
}

// Reset empties the run.
func (m *Norm) Reset() { *m = Norm{} }

// Compensate appends x[i] + in[i] to the run for every i < len(x), where in
// is zero beyond its length (x[i] is then taken as it is), and stores the
// sums into x: the compensate half of the compress step, for one piece.
func (m *Norm) Compensate(x, in []float32) { m.add(x, in, lanesFast) }

// CompensatePack is Compensate followed by signpack.Pack(dst, x) of the
// sums, in one pass over x and in where the CPU allows (AVX2 and FMA, a
// run cut at multiples of 32): the first pass of a compress step whose
// scale is not known yet. dst must hold signpack.PackedLen(len(x)) bytes;
// CompensatePack panics otherwise, as Pack does.
func (m *Norm) CompensatePack(dst []byte, x, in []float32) {
	m.compensatePack(dst, x, in, packLanesFast)
}

// CompensatePackSigns is CompensatePack with in formed from packed signs:
// in[i] = s_0(i) + s_1(i) + ... + s_k-1(i), added in that order, where
// s_j(i) is scales[j] if element i's bit in srcs[j] is 1 and -scales[j]
// if it is 0 (signpack's order of bits): what signpack.UnpackScale of
// srcs[0] and signpack.UnpackScaleAdd of each srcs[j] after it would
// leave in a buffer, bit for bit, without the buffer. It is the server's
// sum of the 1-bit allreduce (the chunks received, scaled, added to the
// server error), in one pass where the CPU allows (AVX2 and FMA, a run cut
// at multiples of 32). len(scales) must be len(srcs), and dst and every
// srcs[j] must hold signpack.PackedLen(len(x)) bytes; it panics otherwise.
// With no srcs, in is zero.
func (m *Norm) CompensatePackSigns(dst []byte, x []float32, srcs [][]byte, scales []float32) {
	m.compensatePackSigns(dst, x, srcs, scales, sumPackLanesFast)
}

// sumKernel runs CompensatePackSigns's fused pass over whole blocks from
// lane 0 and returns how many elements it did.
type sumKernel func(acc *[lanes]float64, dst []byte, x []float32, srcs [][]byte, scales []float32) int

func (m *Norm) compensatePackSigns(dst []byte, x []float32, srcs [][]byte, scales []float32, fast sumKernel) {
	n := signpack.PackedLen(len(x))
	if len(dst) < n || len(scales) != len(srcs) {
		panic("errorfeedback: CompensatePackSigns: packed buffer too short or scales not one per source")
	}
	for _, s := range srcs {
		if len(s) < n {
			panic("errorfeedback: CompensatePackSigns: packed source too short")
		}
	}
	if len(srcs) == 0 {
		m.CompensatePack(dst, x, nil)
		return
	}
	done := 0
	if m.n%lanes == 0 {
		done = fast(&m.acc, dst, x, srcs, scales)
		m.n += done
	}
	// The rest (or all, without the fast kernel) an element at a time.
	for i := done; i < len(x); i++ {
		v := signed(srcs[0], i, scales[0])
		for j := 1; j < len(srcs); j++ {
			v += signed(srcs[j], i, scales[j])
		}
		m.addOne(&x[i], x[i]+v)
	}
	signpack.Pack(dst[done/8:], x[done:])
}

// signed is scale if element i's bit in packed is 1, -scale if it is 0:
// the sign bit of scale flipped, as signpack's unpacking does.
func signed(packed []byte, i int, scale float32) float32 {
	bits := math.Float32bits(scale)
	if packed[i/8]>>(7-i%8)&1 == 0 {
		bits ^= 1 << 31
	}
	return math.Float32frombits(bits)
}

// packKernel runs the fused pass over whole blocks from lane 0 and returns
// how many elements it did.
type packKernel func(acc *[lanes]float64, dst []byte, x, in []float32) int

func (m *Norm) compensatePack(dst []byte, x, in []float32, fast packKernel) {
	if len(dst) < signpack.PackedLen(len(x)) {
		panic("errorfeedback: CompensatePack: packed buffer too short")
	}
	if len(in) > len(x) {
		in = in[:len(x)]
	}
	done := 0
	if m.n%lanes == 0 {
		done = fast(&m.acc, dst, x, in)
		m.n += done
	}
	rest := x[done:]
	m.add(rest, in[min(done, len(in)):], lanesFast)
	signpack.Pack(dst[done/8:], rest)
}

// Sum returns the sum of squares of the run so far.
func (m *Norm) Sum() float64 {
	var s [lanes / 2]float64
	for i := range s {
		s[i] = m.acc[i] + m.acc[i+lanes/2]
	}
	for h := lanes / 4; h >= 1; h /= 2 {
		for i := 0; i < h; i++ {
			s[i] += s[i+h]
		}
	}
	return s[0]
}

// ScaleOf turns a sum of squares over n elements into the 1-bit scale
// ||x||_2 / sqrt(n), rounded once to float32 (0 for n = 0).
func ScaleOf(sumSquares float64, n int) float32 {
	if n == 0 {
		return 0
	}
	return float32(math.Sqrt(sumSquares) / math.Sqrt(float64(n)))
}

// lanesKernel adds blocks*32 elements of x + in (in must be as long),
// starting at lane 0, into acc and stores the sums into x.
type lanesKernel func(acc *[lanes]float64, x, in []float32)

func (m *Norm) add(x, in []float32, blocks lanesKernel) {
	if len(in) > len(x) {
		in = in[:len(x)]
	}
	i := 0
	// Up to the next lane 0, one element at a time.
	for ; i < len(in) && m.n%lanes != 0; i++ {
		m.addOne(&x[i], x[i]+in[i])
	}
	if nb := (len(in) - i) / lanes; nb > 0 && m.n%lanes == 0 {
		blocks(&m.acc, x[i:i+nb*lanes], in[i:i+nb*lanes])
		i += nb * lanes
		m.n += nb * lanes
	}
	for ; i < len(in); i++ {
		m.addOne(&x[i], x[i]+in[i])
	}
	for ; i < len(x); i++ {
		m.addOne(&x[i], x[i])
	}
}

// addOne stores v at p and appends it to the run.
func (m *Norm) addOne(p *float32, v float32) {
	*p = v
	m.acc[m.n%lanes] += float64(v) * float64(v)
	m.n++
}

// lanesGeneric is the portable lanes kernel.
func lanesGeneric(acc *[lanes]float64, x, in []float32) {
	in = in[:len(x)]
	for b := 0; b+lanes <= len(x); b += lanes {
		xs, is := x[b:b+lanes:b+lanes], in[b:b+lanes:b+lanes]
		for l := range lanes {
			v := xs[l] + is[l]
			xs[l] = v
			acc[l] += float64(v) * float64(v)
		}
	}
}
