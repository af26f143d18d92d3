package onebit

import (
	"math"
	"testing"
)

// FuzzOwnersDecode feeds any bytes to the owners' exchange as a rank's
// segment of three matrices (60, 1030 and 7 elements on 2 ranks), at one
// bit an element or at two: it is refused or decodes into values that are
// not NaN, and never panics.
func FuzzOwnersDecode(f *testing.F) {
	sizes := []int{60, 1030, 7}
	owner := ownersOf(sizes, 2)
	x := make([]float32, 1030)
	for i := range x {
		x[i] = float32(math.Sin(float64(i)))
	}
	mag := make([]float32, ownerChunk)
	layout := func(bits int) (off, size []int, seg int) {
		off, size = make([]int, 3), make([]int, 3)
		used := make([]int, 2)
		for k, n := range sizes {
			off[k], size[k] = used[owner[k]], ownerMessageBytes(n, bits)
			used[owner[k]] += size[k]
		}
		return off, size, max(used[0], used[1])
	}
	for _, bits := range []int{1, 2} {
		off, size, seg := layout(bits)
		good := make([]byte, seg)
		var m []float32
		if bits == 2 {
			m = mag
		}
		for k, n := range sizes {
			if owner[k] == 0 {
				encodeOwner(good[off[k]:][:size[k]], append([]float32(nil), x[:n]...), 7, m)
			}
		}
		f.Add(good, bits == 2)
		f.Add(make([]byte, seg), bits == 2)
	}
	out := make([]float32, 1030)
	f.Fuzz(func(t *testing.T, b []byte, two bool) {
		bits, m := 1, []float32(nil)
		if two {
			bits, m = 2, mag
		}
		off, size, n := layout(bits)
		w := &muonOwners{owner: owner, n: sizes}
		seg := make([]byte, n)
		copy(seg, b)
		if err := w.checkSegment(seg, 0, bits, off, size); err != nil {
			return
		}
		for k, n := range sizes {
			if owner[k] != 0 {
				continue
			}
			decodeOwner(out[:n], seg[off[k]:][:size[k]], 7, m)
			for _, v := range out[:n] {
				if math.IsNaN(float64(v)) {
					t.Fatalf("matrix %d decoded into NaN from an accepted segment", k)
				}
			}
		}
	})
}
