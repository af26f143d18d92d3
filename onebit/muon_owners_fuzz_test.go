package onebit

import (
	"math"
	"testing"
)

// FuzzOwnersDecode feeds any bytes to the owners' exchange as a rank's
// segment of three matrices (60, 1030 and 7 elements on 2 ranks): it is
// refused or decodes into finite values, and never panics.
func FuzzOwnersDecode(f *testing.F) {
	sizes := []int{60, 1030, 7}
	w := &muonOwners{world: 2, owner: ownersOf(sizes, 2), off: make([]int, 3), size: make([]int, 3), n: sizes}
	used := make([]int, 2)
	for k, n := range sizes {
		w.off[k], w.size[k] = used[w.owner[k]], ownerMessageBytes(n)
		used[w.owner[k]] += w.size[k]
	}
	w.seg = max(used[0], used[1])
	good := make([]byte, w.seg)
	x := make([]float32, 1030)
	for i := range x {
		x[i] = float32(math.Sin(float64(i)))
	}
	for k, n := range sizes {
		if w.owner[k] == 0 {
			encodeOwner(good[w.off[k]:][:w.size[k]], x[:n], 7)
		}
	}
	f.Add(good)
	f.Add(make([]byte, w.seg))
	out := make([]float32, 1030)
	f.Fuzz(func(t *testing.T, b []byte) {
		seg := make([]byte, w.seg)
		copy(seg, b)
		if err := w.checkSegment(seg, 0, sizes); err != nil {
			return
		}
		for k, n := range sizes {
			if w.owner[k] != 0 {
				continue
			}
			decodeOwner(out[:n], seg[w.off[k]:][:w.size[k]], 7)
			for _, v := range out[:n] {
				if math.IsNaN(float64(v)) {
					t.Fatalf("matrix %d decoded into NaN from an accepted segment", k)
				}
			}
		}
	})
}
