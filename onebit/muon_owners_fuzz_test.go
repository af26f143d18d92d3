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
	layouts := map[bool]ownerLayout{false: newOwnerLayout(sizes, owner, 2, 1), true: newOwnerLayout(sizes, owner, 2, 2)}
	for two, l := range layouts {
		good := make([]byte, l.seg)
		var m []float32
		if two {
			m = mag
		}
		for k, n := range sizes {
			if owner[k] == 0 {
				encodeOwner(l.message(good, owner, k), append([]float32(nil), x[:n]...), 7, m)
			}
		}
		f.Add(good, two)
		f.Add(make([]byte, l.seg), two)
	}
	out := make([]float32, 1030)
	f.Fuzz(func(t *testing.T, b []byte, two bool) {
		l, m := layouts[two], []float32(nil)
		if two {
			m = mag
		}
		seg := make([]byte, l.seg)
		copy(seg, b)
		if err := l.check(seg, 0, owner, sizes); err != nil {
			return
		}
		for k, n := range sizes {
			if owner[k] != 0 {
				continue
			}
			decodeOwner(out[:n], l.message(seg, owner, k), 7, m)
			for _, v := range out[:n] {
				if math.IsNaN(float64(v)) {
					t.Fatalf("matrix %d decoded into NaN from an accepted segment", k)
				}
			}
		}
	})
}
