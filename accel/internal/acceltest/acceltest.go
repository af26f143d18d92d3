// Package acceltest is the shared test suite of accel.Device
// implementations: every kernel against the host code of errorfeedback and
// signpack on the same inputs (odd lengths, unaligned packed offsets,
// NaN and signed zeros), copies, and the bad inputs every device must
// refuse with an error.
package acceltest

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"unsafe"

	"github.com/lowbit-ml/lowbit/accel"
	"github.com/lowbit-ml/lowbit/errorfeedback"
	"github.com/lowbit-ml/lowbit/signpack"
)

// Tolerance is the relative tolerance of the spec on norms and on the
// floats derived from them.
const Tolerance = 1e-5

// Run runs the suite on dev. With exact, every float must be the host
// code's bit for bit (the CPU device); otherwise the packed signs must be
// identical and the floats within Tolerance (a device that sums the norm
// in another order).
func Run(t *testing.T, dev accel.Device, exact bool) {
	t.Run("kernels", func(t *testing.T) { kernels(t, dev, exact) })
	t.Run("carried", func(t *testing.T) { carried(t, dev, exact) })
	t.Run("chunks", func(t *testing.T) { chunks(t, dev) })
	t.Run("rows", func(t *testing.T) { rows(t, dev) })
	t.Run("copies", func(t *testing.T) { copies(t, dev) })
	t.Run("bad-input", func(t *testing.T) { badInput(t, dev) })
}

// Bytes is the memory of p as bytes.
func Bytes(p []float32) []byte {
	if len(p) == 0 {
		return []byte{}
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&p[0])), 4*len(p))
}

func randn(rng *rand.Rand, n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	return x
}

func must(t *testing.T, err error, what string) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// Compare returns an error naming the first element of got that differs
// from want: bit for bit when exact, else beyond Tolerance (NaN must stay
// NaN, with any payload).
func Compare(what string, want, got []float32, exact bool) error {
	if len(got) != len(want) {
		return fmt.Errorf("%s: length %d, want %d", what, len(got), len(want))
	}
	for i := range want {
		w, g := want[i], got[i]
		if exact {
			if math.Float32bits(w) != math.Float32bits(g) {
				return fmt.Errorf("%s[%d] = %g, want %g bit for bit", what, i, g, w)
			}
			continue
		}
		if math.IsNaN(float64(w)) {
			// NaN stays NaN; its payload is the hardware's (a GPU returns
			// the canonical NaN where x86 keeps the operand's).
			if !math.IsNaN(float64(g)) {
				return fmt.Errorf("%s[%d] = %g, want NaN", what, i, g)
			}
			continue
		}
		if d := math.Abs(float64(g) - float64(w)); d > Tolerance*math.Max(1, math.Abs(float64(w))) {
			return fmt.Errorf("%s[%d] = %g, want %g within %g", what, i, g, w, Tolerance)
		}
	}
	return nil
}

func kernels(t *testing.T, dev accel.Device, exact bool) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{8, 24, 1000, 1024, 4104, 100_000} {
		for _, nIn := range []int{n, n - 5} {
			in := randn(rng, nIn)
			res := randn(rng, n)
			// A NaN makes the scale and every residual NaN: only the
			// shorter input has one, so that the floats of the other
			// are checked.
			if nIn > 2 {
				in[1], res[1] = float32(math.Copysign(0, -1)), 0
				if nIn < n {
					in[0], res[0] = float32(math.NaN()), 0
				}
			}
			if nIn > 3 {
				in[2], res[2] = float32(math.Copysign(0, -1)), 0 // -0 + 0 = +0
			}
			// The host reference.
			wantRes := append(errorfeedback.Residual(nil), res...)
			wantPacked := make([]byte, signpack.PackedLen(n))
			wantScale, err := wantRes.Compress(wantPacked, in)
			must(t, err, "host compress")

			got := compress(t, dev, res, in)
			if string(got.packed) != string(wantPacked) {
				for i := range wantPacked {
					if got.packed[i] != wantPacked[i] {
						t.Fatalf("n=%d input %d: packed[%d] = %#02x, want %#02x", n, nIn, i, got.packed[i], wantPacked[i])
					}
				}
			}
			must(t, Compare(fmt.Sprintf("n=%d residual", n), wantRes, got.res, exact), "compress")
			must(t, Compare(fmt.Sprintf("n=%d scale", n), []float32{wantScale}, []float32{got.scale}, exact), "compress")

			// Unpack from an odd byte offset (a chunk of a W=3 tensor).
			sub := wantPacked[min(3, len(wantPacked)-1):]
			m := len(sub)*8 - 3 // and a length that is not whole bytes
			acc := randn(rng, m)
			for _, add := range []bool{false, true} {
				want := append([]float32(nil), acc...)
				if add {
					signpack.UnpackScaleAdd(want, sub, 0.375)
				} else {
					signpack.UnpackScale(want, sub, 0.375)
				}
				g := unpack(t, dev, acc, sub, 0.375, add)
				must(t, Compare(fmt.Sprintf("n=%d unpack add=%v", n, add), want, g, true), "unpack")
			}
		}
	}
}

// carried checks CompressCarried and SumCompressCarried against the host
// code: x = residual + input and the packed signs bit for bit on every
// device (no norm enters them; NaNs may be a GPU's canonical one), the
// scale and the residual Residuals makes of x bit for bit when exact, else
// within Tolerance. prevScale is 0, 0.75 and NaN.
func carried(t *testing.T, dev accel.Device, exact bool) {
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{8, 24, 1000, 1024, 4104, 100_000} {
		for _, prev := range []float32{0, 0.75, float32(math.NaN())} {
			xPrev := randn(rng, n)
			xPrev[n-1] = float32(math.Copysign(0, -1))
			if prev == 0 {
				xPrev[1] = 0
			} else {
				xPrev[0] = float32(math.NaN()) // a NaN scale: only the signs and x are checked
			}
			res := append(errorfeedback.Residual(nil), xPrev...)
			accel.Residuals(res, prev)

			// CompressCarried, with an input shorter than x (the residual
			// of -0 at the end must stay -0) and as long.
			for _, nIn := range []int{n, n - 5} {
				in := randn(rng, nIn)
				want := hostCompress(t, res, in)
				what := fmt.Sprintf("compress-carried n=%d input %d prev %g", n, nIn, prev)
				got := runCarried(t, dev, xPrev, prev, func(packed, x accel.Span) (float32, error) {
					ib := alloc(t, dev, 4*len(in)+4)
					inSpan := accel.Floats(ib, 1, len(in)) // not the whole buffer
					must(t, dev.CopyIn(inSpan, Bytes(in)), "copy-in")
					return dev.CompressCarried(packed, x, prev, inSpan)
				})
				checkCarried(t, what, got, want, exact)
			}

			// SumCompressCarried of w chunks.
			// Chunks at an odd byte and 4-byte aligned (a GPU loads whole
			// words of the latter).
			for _, cw := range []struct{ w, off int }{{1, 1}, {3, 1}, {1, 0}, {4, 0}, {9, 0}} {
				w := cw.w
				chunks := make([]byte, w*signpack.PackedLen(n))
				for i := range chunks {
					chunks[i] = byte(rng.Uint32())
				}
				scales := make([]float32, w)
				for j := range scales {
					scales[j] = float32(rng.Float64()) / float32(w)
				}
				acc := make([]float32, n)
				for j := range w {
					c := chunks[j*signpack.PackedLen(n) : (j+1)*signpack.PackedLen(n)]
					if j == 0 {
						signpack.UnpackScale(acc, c, scales[0])
					} else {
						signpack.UnpackScaleAdd(acc, c, scales[j])
					}
				}
				want := hostCompress(t, res, acc)
				what := fmt.Sprintf("sum-compress-carried n=%d w=%d chunks at byte %d prev %g", n, w, cw.off, prev)
				got := runCarried(t, dev, xPrev, prev, func(packed, x accel.Span) (float32, error) {
					cb := alloc(t, dev, len(chunks)+1)
					cs := accel.Span{Buf: cb, Off: cw.off, Len: len(chunks)}
					sb := alloc(t, dev, 4*w)
					must(t, dev.CopyIn(cs, chunks), "copy-in")
					must(t, dev.CopyIn(accel.Whole(sb), Bytes(scales)), "copy-in")
					return dev.SumCompressCarried(packed, x, prev, cs, accel.Whole(sb))
				})
				checkCarried(t, what, got, want, exact)
			}
		}
	}
}

// runCarried runs kernel on a copy of xPrev and returns what it left.
func runCarried(t *testing.T, dev accel.Device, xPrev []float32, prev float32,
	kernel func(packed, x accel.Span) (float32, error)) compressed {
	t.Helper()
	n := len(xPrev)
	xb := alloc(t, dev, 4*n)
	pb := alloc(t, dev, signpack.PackedLen(n)+3)
	packed := accel.Span{Buf: pb, Off: 3, Len: signpack.PackedLen(n)} // unaligned
	must(t, dev.CopyIn(accel.Whole(xb), Bytes(xPrev)), "copy-in")
	scale, err := kernel(packed, accel.Whole(xb))
	must(t, err, "carried kernel")
	out := compressed{packed: make([]byte, packed.Len), res: make([]float32, n), scale: scale}
	must(t, dev.CopyOut(out.packed, packed), "copy-out")
	must(t, dev.CopyOut(Bytes(out.res), accel.Whole(xb)), "copy-out")
	return out
}

// hostWant is what the host code computes from a residual and an input:
// x = residual + pad(input), the packed signs of x, the scale and the new
// residual.
type hostWant struct {
	x, res []float32
	packed []byte
	scale  float32
}

func hostCompress(t *testing.T, res, in []float32) hostWant {
	t.Helper()
	w := hostWant{x: append([]float32(nil), res...), res: append([]float32(nil), res...), packed: make([]byte, signpack.PackedLen(len(res)))}
	for i := range in {
		w.x[i] = res[i] + in[i]
	}
	var err error
	w.scale, err = errorfeedback.Residual(w.res).Compress(w.packed, in)
	must(t, err, "host compress")
	return w
}

// checkCarried compares a carried kernel's x (in got.res), signs, scale
// and the residuals of x with the host's.
func checkCarried(t *testing.T, what string, got compressed, want hostWant, exact bool) {
	t.Helper()
	for i := range want.packed {
		if got.packed[i] != want.packed[i] {
			t.Fatalf("%s: packed[%d] = %#02x, want %#02x", what, i, got.packed[i], want.packed[i])
		}
	}
	for i, w := range want.x { // bit for bit, but a GPU's NaNs are canonical
		if g := got.res[i]; math.Float32bits(g) != math.Float32bits(w) && (exact || !math.IsNaN(float64(w)) || !math.IsNaN(float64(g))) {
			t.Fatalf("%s: x[%d] = %g (%#08x), want %g (%#08x)", what, i, g, math.Float32bits(g), w, math.Float32bits(w))
		}
	}
	must(t, Compare(what+" scale", []float32{want.scale}, []float32{got.scale}, exact), "carried")
	accel.Residuals(got.res, got.scale)
	must(t, Compare(what+" residual", want.res, got.res, exact), "carried")
}

type compressed struct {
	packed []byte
	res    []float32
	scale  float32
}

func alloc(t *testing.T, dev accel.Device, n int) accel.Buffer {
	t.Helper()
	b, err := dev.Alloc(n)
	must(t, err, "alloc")
	t.Cleanup(func() { b.Free() })
	return b
}

func compress(t *testing.T, dev accel.Device, res, in []float32) compressed {
	t.Helper()
	rb := alloc(t, dev, 4*len(res))
	ib := alloc(t, dev, 4*len(in)+4) // a span that is not the whole buffer
	pb := alloc(t, dev, signpack.PackedLen(len(res))+3)
	inSpan := accel.Floats(ib, 1, len(in))
	packed := accel.Span{Buf: pb, Off: 3, Len: signpack.PackedLen(len(res))} // unaligned
	must(t, dev.CopyIn(accel.Whole(rb), Bytes(res)), "copy-in")
	must(t, dev.CopyIn(inSpan, Bytes(in)), "copy-in")
	scale, err := dev.Compress(packed, accel.Whole(rb), inSpan)
	must(t, err, "compress")
	out := compressed{packed: make([]byte, packed.Len), res: make([]float32, len(res)), scale: scale}
	must(t, dev.CopyOut(out.packed, packed), "copy-out")
	must(t, dev.CopyOut(Bytes(out.res), accel.Whole(rb)), "copy-out")
	return out
}

func unpack(t *testing.T, dev accel.Device, acc []float32, packed []byte, scale float32, add bool) []float32 {
	t.Helper()
	ab := alloc(t, dev, 4*len(acc))
	pb := alloc(t, dev, len(packed)+1)
	ps := accel.Span{Buf: pb, Off: 1, Len: signpack.PackedLen(len(acc))}
	must(t, dev.CopyIn(accel.Whole(ab), Bytes(acc)), "copy-in")
	must(t, dev.CopyIn(ps, packed[:ps.Len]), "copy-in")
	if add {
		must(t, dev.UnpackScaleAdd(accel.Whole(ab), ps, scale), "unpack-scale-add")
	} else {
		must(t, dev.UnpackScale(accel.Whole(ab), ps, scale), "unpack-scale")
	}
	out := make([]float32, len(acc))
	must(t, dev.CopyOut(Bytes(out), accel.Whole(ab)), "copy-out")
	return out
}

// chunks checks UnpackScaleChunks, where dev has it, against
// signpack.UnpackScale of each chunk with its scale, bit for bit: chunks
// of 8 to 4096 elements, the last one partial or whole, a destination
// that starts 16-byte aligned and one that does not, and chunks that the
// destination does not reach (their scales are never read).
func chunks(t *testing.T, dev accel.Device) {
	cu, ok := dev.(accel.ChunkUnpacker)
	if !ok {
		t.Skipf("%s has no UnpackScaleChunks", dev.Name())
	}
	rng := rand.New(rand.NewPCG(5, 6))
	for _, tc := range []struct{ n, chunk, scales int }{
		{8, 8, 1}, {20, 8, 3}, {1000, 256, 4}, {4096, 1024, 4}, {100_003, 25_008, 5}, {4100, 4096, 2}, {7, 4096, 1},
	} {
		for _, off := range []int{0, 1} {
			packed := make([]byte, signpack.PackedLen(tc.n))
			for i := range packed {
				packed[i] = byte(rng.Uint32())
			}
			scales := randn(rng, tc.scales)
			want := make([]float32, tc.n)
			for j := 0; j*tc.chunk < tc.n; j++ {
				lo, hi := j*tc.chunk, min((j+1)*tc.chunk, tc.n)
				signpack.UnpackScale(want[lo:hi], packed[lo/8:signpack.PackedLen(hi)], scales[j])
			}
			db := alloc(t, dev, 4*(tc.n+off))
			dst := accel.Floats(db, off, tc.n)
			pb := alloc(t, dev, len(packed)+1)
			ps := accel.Span{Buf: pb, Off: 1, Len: len(packed)}
			sb := alloc(t, dev, 4*tc.scales)
			must(t, dev.CopyIn(ps, packed), "copy-in")
			must(t, dev.CopyIn(accel.Whole(sb), Bytes(scales)), "copy-in")
			must(t, cu.UnpackScaleChunks(dst, ps, tc.chunk, accel.Whole(sb)), "unpack-scale-chunks")
			got := make([]float32, tc.n)
			must(t, dev.CopyOut(Bytes(got), dst), "copy-out")
			if err := Compare(fmt.Sprintf("unpack-scale-chunks n=%d chunk=%d at float %d", tc.n, tc.chunk, off), want, got, true); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Bad arguments: a chunk that is not a multiple of 8, too few scales,
	// packed signs of another length.
	db, pb, sb := alloc(t, dev, 4*64), alloc(t, dev, 8), alloc(t, dev, 4*2)
	for _, bad := range []struct {
		packed, scales accel.Span
		chunk          int
		want           string
	}{
		{accel.Whole(pb), accel.Whole(sb), 12, "multiple of 8"},
		{accel.Whole(pb), accel.Whole(sb), 0, "multiple of 8"},
		{accel.Whole(pb), accel.Whole(sb), 16, "2 scales for 4 chunks"},
		{accel.Span{Buf: pb, Len: 7}, accel.Whole(sb), 32, "packed span of 7 bytes"},
	} {
		err := cu.UnpackScaleChunks(accel.Whole(db), bad.packed, bad.chunk, bad.scales)
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("unpack-scale-chunks chunk %d: error %v, want one containing %q", bad.chunk, err, bad.want)
		}
	}
}

// rows checks CopyOutRows and CopyInRows, where dev has them: rows at
// other pitches on each side land where they should and nothing between
// them is written; bad pitches and short sides are errors.
func rows(t *testing.T, dev accel.Device) {
	rc, ok := dev.(accel.RowCopier)
	if !ok {
		t.Skipf("%s has no row copies", dev.Name())
	}
	const width, nrows, devPitch, hostPitch = 5, 4, 9, 7
	b := alloc(t, dev, 40)
	span := accel.Span{Buf: b, Off: 1, Len: 38}
	src := make([]byte, 38)
	for i := range src {
		src[i] = byte(i + 1)
	}
	must(t, dev.CopyIn(span, src), "copy-in")
	out := make([]byte, (nrows-1)*hostPitch+width+2)
	must(t, rc.CopyOutRows(out, hostPitch, span, devPitch, width, nrows), "copy-out-rows")
	want := make([]byte, len(out))
	for r := range nrows {
		copy(want[r*hostPitch:r*hostPitch+width], src[r*devPitch:r*devPitch+width])
	}
	if string(out) != string(want) {
		t.Fatalf("copy-out-rows: % x, want % x", out, want)
	}
	// Back in at the device's pitch into a zeroed span.
	must(t, dev.Zero(span), "zero")
	must(t, rc.CopyInRows(span, devPitch, out, hostPitch, width, nrows), "copy-in-rows")
	must(t, dev.Synchronize(), "synchronize")
	got := make([]byte, 38)
	must(t, dev.CopyOut(got, span), "copy-out")
	back := make([]byte, 38)
	for r := range nrows {
		copy(back[r*devPitch:r*devPitch+width], src[r*devPitch:r*devPitch+width])
	}
	if string(got) != string(back) {
		t.Fatalf("copy-in-rows: % x, want % x", got, back)
	}
	for _, bad := range []struct {
		dst, src, width, rows int
		want                  string
	}{
		{hostPitch, 4, width, nrows, "at pitches"},
		{hostPitch, devPitch, width, 5, "want"},
	} {
		if err := rc.CopyOutRows(out, bad.dst, span, bad.src, bad.width, bad.rows); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("copy-out-rows pitch %d/%d rows %d: error %v, want one containing %q", bad.dst, bad.src, bad.rows, err, bad.want)
		}
	}
}

func copies(t *testing.T, dev accel.Device) {
	a, b := alloc(t, dev, 64), alloc(t, dev, 64)
	got := make([]byte, 64)
	must(t, dev.CopyOut(got, accel.Whole(a)), "copy-out")
	if string(got) != string(make([]byte, 64)) {
		t.Fatalf("Alloc did not return zeroed memory: % x", got)
	}
	src := make([]byte, 64)
	for i := range src {
		src[i] = byte(i + 1)
	}
	must(t, dev.CopyIn(accel.Whole(a), src), "copy-in")
	must(t, dev.Copy(accel.Span{Buf: b, Off: 5, Len: 10}, accel.Span{Buf: a, Off: 20, Len: 10}), "copy")
	must(t, dev.Zero(accel.Span{Buf: a, Off: 0, Len: 32}), "zero")
	must(t, dev.Synchronize(), "synchronize")
	must(t, dev.CopyOut(got, accel.Whole(b)), "copy-out")
	for i, v := range got {
		want := byte(0)
		if i >= 5 && i < 15 {
			want = byte(i - 5 + 21)
		}
		if v != want {
			t.Fatalf("after copy: byte %d = %d, want %d", i, v, want)
		}
	}
	must(t, dev.CopyOut(got, accel.Whole(a)), "copy-out")
	for i, v := range got {
		want := byte(i + 1)
		if i < 32 {
			want = 0
		}
		if v != want {
			t.Fatalf("after zero: byte %d = %d, want %d", i, v, want)
		}
	}
	empty := alloc(t, dev, 0)
	must(t, dev.CopyIn(accel.Whole(empty), nil), "empty copy-in")
	must(t, dev.Zero(accel.Whole(empty)), "empty zero")
}

// badInput: each call must return an error (not panic) and leave the
// device usable.
func badInput(t *testing.T, dev accel.Device) {
	b := alloc(t, dev, 64)
	p3 := alloc(t, dev, 3)
	other, err := accel.NewCPU().Alloc(64)
	must(t, err, "alloc")
	if _, ok := dev.(*accel.CPU); ok {
		other = &foreign{}
	}
	for _, c := range []struct {
		what string
		err  error
	}{
		{"copy-in too long", dev.CopyIn(accel.Whole(b), make([]byte, 65))},
		{"copy-out past the end", dev.CopyOut(make([]byte, 4), accel.Span{Buf: b, Off: 62, Len: 4})},
		{"negative offset", dev.Zero(accel.Span{Buf: b, Off: -1, Len: 4})},
		{"negative length", dev.Zero(accel.Span{Buf: b, Off: 0, Len: -4})},
		{"copy of different lengths", dev.Copy(accel.Span{Buf: b, Len: 8}, accel.Span{Buf: b, Off: 8, Len: 4})},
		{"packed too long", dev.UnpackScale(accel.Whole(b), accel.Whole(p3), 1)},
		{"packed too short", dev.UnpackScaleAdd(accel.Whole(b), accel.Span{Buf: p3, Len: 1}, 1)},
		{"floats not aligned", dev.UnpackScale(accel.Span{Buf: b, Off: 2, Len: 8}, accel.Span{Buf: p3, Len: 1}, 1)},
		{"nil buffer", dev.Zero(accel.Span{Len: 4})},
		{"another device's buffer", dev.Zero(accel.Whole(other))},
		{"input longer than residual", second(dev.Compress(accel.Span{Buf: p3, Len: 1}, accel.Floats(b, 0, 8), accel.Whole(b)))},
		{"compress packed wrong", second(dev.Compress(accel.Whole(p3), accel.Whole(b), accel.Floats(b, 0, 0)))},
		{"negative alloc", second(dev.Alloc(-1))},
		{"carried input longer than x", second(dev.CompressCarried(accel.Span{Buf: p3, Len: 1}, accel.Floats(b, 0, 8), 0, accel.Whole(b)))},
		{"carried packed wrong", second(dev.CompressCarried(accel.Whole(p3), accel.Whole(b), 0, accel.Floats(b, 0, 0)))},
		{"carried x not aligned", second(dev.CompressCarried(accel.Span{Buf: p3, Len: 1}, accel.Span{Buf: b, Off: 2, Len: 32}, 0, accel.Floats(b, 0, 0)))},
		{"sum chunks too short", second(dev.SumCompressCarried(accel.Span{Buf: p3, Len: 1}, accel.Floats(b, 0, 8), 0, accel.Span{Buf: p3, Len: 1}, accel.Floats(b, 8, 2)))},
		{"sum without scales", second(dev.SumCompressCarried(accel.Span{Buf: p3, Len: 1}, accel.Floats(b, 0, 8), 0, accel.Span{Buf: p3, Len: 0}, accel.Floats(b, 8, 0)))},
		{"sum packed wrong", second(dev.SumCompressCarried(accel.Whole(p3), accel.Floats(b, 0, 8), 0, accel.Span{Buf: p3, Len: 1}, accel.Floats(b, 8, 1)))},
	} {
		if c.err == nil {
			t.Errorf("%s: no error", c.what)
		}
	}
	freed, err := dev.Alloc(16)
	must(t, err, "alloc")
	must(t, freed.Free(), "free")
	must(t, freed.Free(), "second free")
	if err := dev.Zero(accel.Whole(freed)); !errors.Is(err, accel.ErrFreed) {
		t.Errorf("use after free: %v, want accel.ErrFreed", err)
	}
	must(t, dev.Zero(accel.Whole(b)), "the device still works")
}

func second[T any](_ T, err error) error { return err }

// foreign is a Buffer of no device.
type foreign struct{}

func (*foreign) Len() int    { return 64 }
func (*foreign) Free() error { return nil }
