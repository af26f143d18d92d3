package outer

import (
	"encoding/binary"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func testSparse(chunk int, density float32, vbits int) *sparseCodec {
	cfg := DefaultConfig()
	cfg.Codec, cfg.SparseChunk, cfg.Density, cfg.SparseBits = CodecSparse, chunk, density, vbits
	return newSparseCodec(cfg, 0, 3*chunk, 1)
}

// sparseChunks are the (chunk, density, bits) cases of the codec tests:
// the default, a short chunk whose offsets take 3 bits, and 2-bit values.
var sparseChunks = []struct {
	chunk   int
	density float32
	bits    int
}{{4096, 1.0 / 64, 1}, {4096, 1.0 / 48, 2}, {7, 0.3, 1}, {7, 0.3, 2}, {100, 1, 2}}

// What a message stands for plus what the encoder keeps is what it was
// given (error feedback telescopes), the entries sent are the k of
// largest magnitude, their offsets ascend, and the values are sign times
// one scale (1 bit) or one of two (2 bits).
func TestSparseEncodeTelescopes(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, tc := range sparseChunks {
		s := testSparse(tc.chunk, tc.density, tc.bits)
		for _, m := range []int{tc.chunk, 2*tc.chunk + tc.chunk/3 + 1} {
			x := make([]float32, m)
			for i := range x {
				x[i] = float32(rng.NormFloat64()) * float32(1+i%5)
			}
			if m > 20 {
				x[3], x[4] = 0, float32(math.Copysign(0, -1)) // zeros, one negative
			}
			before := slices.Clone(x)
			msg := make([]byte, s.msgLen(m))
			at := 0
			for lo := 0; lo < m; lo += s.chunk {
				hi := min(lo+s.chunk, m)
				at += s.encode(msg[at:], x[lo:hi])
			}
			require.Equal(t, len(msg), at)
			sent := make([]float32, m)
			require.NoError(t, s.decodeAdd(sent, msg))
			for i := range x {
				require.InDelta(t, before[i], x[i]+sent[i], 1e-6*(1+math.Abs(float64(before[i]))), "chunk %d bits %d element %d", tc.chunk, tc.bits, i)
			}
			for lo := 0; lo < m; lo += s.chunk {
				hi := min(lo+s.chunk, m)
				k := s.k(hi - lo)
				var scales []float32
				least := float32(math.Inf(1))
				for i := lo; i < hi; i++ {
					if sent[i] != 0 {
						least = min(least, abs32(before[i]))
						if !slices.Contains(scales, abs32(sent[i])) {
							scales = append(scales, abs32(sent[i]))
						}
						assert.Equal(t, math.Signbit(float64(before[i])), math.Signbit(float64(sent[i])), "element %d: the sign", i)
					}
				}
				nz := 0
				for i := lo; i < hi; i++ {
					if sent[i] != 0 {
						nz++
					} else {
						assert.LessOrEqual(t, abs32(before[i]), least, "element %d not sent, larger than one sent", i)
					}
				}
				assert.Equal(t, k, nz, "chunk at %d: entries sent", lo)
				assert.LessOrEqual(t, len(scales), tc.bits, "chunk at %d: magnitudes", lo)
			}
		}
	}
}

// k rounds density * length: 0.4 of 5 is 2 (not 3 from float32's 0.4 a
// little above 0.4), at least 1, at most the chunk.
func TestSparseK(t *testing.T) {
	assert.Equal(t, 2, testSparse(5, 0.4, 1).k(5))
	assert.Equal(t, 1, testSparse(5, 0.4, 1).k(1))
	assert.Equal(t, 64, testSparse(4096, 1.0/64, 1).k(4096))
	assert.Equal(t, 41, testSparse(4096, 0.01, 1).k(4096))
	assert.Equal(t, 3, testSparse(3, 1, 1).k(3))
}

// Malformed messages are refused: a wrong length, scales that are
// negative or not finite, offsets that do not ascend or leave the chunk.
func TestSparseDecodeRejects(t *testing.T) {
	s := testSparse(8, 0.25, 2) // k = 2, offsets of 3 bits, 2 scales
	x := []float32{1, -2, 3, -4, 0.5, 0.25, 6, 7}
	msg := make([]byte, s.msgLen(8))
	s.encode(msg, slices.Clone(x))
	dst := make([]float32, 8)
	require.NoError(t, s.decodeAdd(dst, msg))
	assert.Equal(t, []float32{0, 0, 0, 0, 0, 0, 6, 7}, dst) // 6 and 7 sent: 6 below their mean, 7 above

	bad := func(edit func(m []byte)) error {
		m := slices.Clone(msg)
		edit(m)
		return s.decodeAdd(make([]float32, 8), m)
	}
	assert.ErrorIs(t, s.decodeAdd(make([]float32, 8), msg[:len(msg)-1]), errSparseMessage)
	for _, v := range []float32{float32(math.NaN()), float32(math.Inf(1)), -1} {
		assert.ErrorIs(t, bad(func(m []byte) { binary.LittleEndian.PutUint32(m[4:], math.Float32bits(v)) }), errSparseMessage, "scale %v", v)
	}
	// Entries: 3 bits of offset, 2 of value: offsets 6 and 7 are bits 0-2
	// and 5-7 of the first byte after the scales.
	assert.ErrorIs(t, bad(func(m []byte) { m[8] = m[8]&^0xe0 | 6<<5 }), errSparseMessage, "offsets 6, 6")
	assert.ErrorIs(t, bad(func(m []byte) { m[8] = m[8]&^0x07 | 7 }), errSparseMessage, "offsets 7, 7")
	s2 := testSparse(5, 0.4, 1) // chunk of 5: offsets 5-7 fit in 3 bits but leave it
	m2 := make([]byte, s2.msgLen(5))
	s2.encode(m2, []float32{1, 2, 3, 4, 5})
	m2[4] |= 7 << 4 // second offset: 7
	assert.ErrorIs(t, s2.decodeAdd(make([]float32, 5), m2), errSparseMessage)
}

// Encoding and decoding allocate nothing.
func TestSparseNoAllocs(t *testing.T) {
	s := testSparse(4096, 1.0/64, 2)
	x := make([]float32, 3*4096)
	for i := range x {
		x[i] = float32(math.Sin(float64(i)))
	}
	msg := make([]byte, s.msgLen(len(x)))
	dst := make([]float32, len(x))
	allocs := testing.AllocsPerRun(5, func() {
		at := 0
		for lo := 0; lo < len(x); lo += s.chunk {
			at += s.encode(msg[at:], x[lo:min(lo+s.chunk, len(x))])
		}
		if err := s.decodeAdd(dst, msg); err != nil {
			panic(err)
		}
	})
	assert.Zero(t, allocs)
}

// kthLargest agrees with a sort, ties and all.
func TestKthLargest(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for range 200 {
		n := 1 + rng.IntN(50)
		a := make([]float32, n)
		for i := range a {
			a[i] = float32(rng.IntN(8)) // many ties
		}
		k := 1 + rng.IntN(n)
		sorted := slices.Clone(a)
		slices.Sort(sorted)
		want := sorted[n-k]
		require.Equal(t, want, kthLargest(a, k), "%v k %d", sorted, k)
	}
}

// Any bytes decode to an error or to at most k entries per chunk, never a
// panic.
func FuzzSparseDecode(f *testing.F) {
	s := testSparse(7, 0.3, 2)
	good := make([]byte, s.msgLen(10))
	x := []float32{1, -2, 3, -4, 5, -6, 7, 8, -9, 10}
	s.encode(good, x[:7])
	s.encode(good[s.chunkLen(7):], x[7:])
	f.Add(good)
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, msg []byte) {
		dst := make([]float32, 10)
		if err := s.decodeAdd(dst, msg); err != nil {
			return
		}
		checkDecoded(t, dst, s.k(7)+s.k(3))
	})
}

// checkDecoded fails t when dst holds a value that is not finite or more
// than most non-zero entries.
func checkDecoded(t *testing.T, dst []float32, most int) {
	t.Helper()
	nz := 0
	for _, v := range dst {
		if v != 0 {
			nz++
		}
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			t.Fatalf("decoded %v", dst)
		}
	}
	if nz > most {
		t.Fatalf("%d entries", nz)
	}
}
