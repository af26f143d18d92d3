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
