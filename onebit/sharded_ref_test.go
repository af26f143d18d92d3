package onebit_test

// TestPinShardedAdam pins every step of 1-bit Adam's sharded state mode
// (docs/sharded.md) against a reference written again, in float64,
// straight from that page's steps, simulating every rank of the group in
// one goroutine. Like the references of pin_ref_test.go it shares no code
// with package onebit or with optim's kernels; it reuses the pin harness
// (pinModel, pinInit, pinGrad, pinMask, pinRun, pinClose, pinSgn, pinNorm,
// pinBC). TestShardedWireBytesAsFull checks that the sharded mode puts as
// many bytes on the wire per compression step as the full mode.

import (
	"context"
	"fmt"
	"math"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/lowbit-ml/lowbit/comm"
	"github.com/lowbit-ml/lowbit/onebit"
	"github.com/lowbit-ml/lowbit/optim"
)

// shRefBucket is one bucket of the reference: elements [lo, lo+n) of the
// flat buffer of all parameters, padded to N = w*C, and every rank's
// buffers of it (docs/sharded.md, "State").
type shRefBucket struct {
	lo, n, N, C int
	worker      [][]float64 // [r][N]: rank r's worker error
	m, v, ue    [][]float64 // [r][C]: rank r's shards of m and v and its update error
}

// shRef is the reference of the sharded mode on w ranks: the parameters
// (the same on every rank, so kept once), the flat mask and the buckets.
type shRef struct {
	w                   int
	lr, b1, b2, eps, wd float64
	bc                  bool
	freeze              int
	p, mask             []float64
	buckets             []*shRefBucket
	c2Frozen            float64
	capRatio, kneeRatio float64
	paramLo, paramLen   []int // parameter i is p[paramLo[i]:][:paramLen[i]]
}

// shPadded is N: n rounded up to a multiple of w*lcm(w, 8).
func shPadded(n, w int) int {
	l := 8
	for l%w != 0 {
		l += 8
	}
	q := w * l
	return (n + q - 1) / q * q
}

// newShRef makes the reference of a run on w ranks with buckets of
// bucketBytes (0: the default 25 MiB) and the pinned model, its mask
// included. The hyperparameters are the float64 values of the config's
// float32 ones: the ratio bound's cap is a constant that the update
// error feedback sums step after step, so a cap computed from 0.9 rather
// than float32(0.9) drifts by 1e-7 of the cap per clipped step.
func newShRef(w, bucketBytes, freeze int, lr, b1, b2, eps, wd float64, bc bool) *shRef {
	ref := &shRef{w: w, lr: lr, b1: b1, b2: b2, eps: eps, wd: wd, bc: bc, freeze: freeze, c2Frozen: 1}
	for i, pm := range pinModel {
		ref.paramLo = append(ref.paramLo, len(ref.p))
		ref.paramLen = append(ref.paramLen, pm.n)
		for k := range pm.n {
			ref.p = append(ref.p, float64(pinInit(i, k)))
			mk := 1.0
			if mask, ok := pinMask()[pm.name]; ok {
				mk = float64(mask[k])
			}
			ref.mask = append(ref.mask, mk)
		}
	}
	// Buckets of bucketBytes/4 elements of the flat buffer (0: 25 MiB).
	if bucketBytes == 0 {
		bucketBytes = 25 << 20
	}
	per := max(bucketBytes/4, 1)
	for lo := 0; lo < len(ref.p); lo += per {
		n := min(per, len(ref.p)-lo)
		N := shPadded(n, w)
		b := &shRefBucket{lo: lo, n: n, N: N, C: N / w}
		for range w {
			b.worker = append(b.worker, make([]float64, N))
			b.m = append(b.m, make([]float64, b.C))
			b.v = append(b.v, make([]float64, b.C))
			b.ue = append(b.ue, make([]float64, b.C))
		}
		ref.buckets = append(ref.buckets, b)
	}
	// The compression stage's ratio bound (onebit's, as in the full
	// mode): a cap of CapFactor times exact Adam's largest ratio
	// (1-b1)/sqrt((1-b2)*(1-b1^2/b2)) (optim.AdamRatioBound, a float32),
	// at most the knee KneeRatio.
	ref.kneeRatio = onebit.KneeRatio
	ref.capRatio = min(float64(float32(onebit.CapFactor*float64(float32((1-b1)/math.Sqrt((1-b2)*(1-b1*b1/b2)))))), ref.kneeRatio)
	return ref
}

// clip bounds a compression-stage ratio: left alone up to the cap,
// clipped to it up to the knee, beyond which the bound falls as
// cap*knee/|r| down to 1.
func (ref *shRef) clip(r float64) float64 {
	a := math.Abs(r)
	if !(a > ref.capRatio) {
		return r
	}
	c := ref.capRatio
	if a > ref.kneeRatio {
		c = max(1, c*ref.kneeRatio/a)
	}
	return math.Copysign(c, r)
}

// grads returns every rank's flat gradient of step s, as float64 of the
// float32 the optimizer sees.
func (ref *shRef) grads(s int) [][]float64 {
	g := make([][]float64, ref.w)
	for r := range ref.w {
		for i, pm := range pinModel {
			for k := range pm.n {
				g[r] = append(g[r], float64(pinGrad(i, r, s, k)))
			}
		}
	}
	return g
}

// apply is the last step of both stages on every rank:
// p[i] -= lr*(U[i] + wd*p[i]) for the bucket's elements i < n.
func (ref *shRef) apply(b *shRefBucket, U []float64) {
	for i := range b.n {
		p := &ref.p[b.lo+i]
		*p -= ref.lr * (U[i] + ref.wd**p)
	}
}

// step runs step s of the reference.
func (ref *shRef) step(s int) {
	g := ref.grads(s)
	w := ref.w
	c1 := pinBC(ref.b1, int64(s), ref.bc)
	if s <= ref.freeze {
		c2 := pinBC(ref.b2, int64(s), ref.bc)
		for _, b := range ref.buckets {
			U := make([]float64, b.N)
			for j := range w { // owner j
				for i := range b.C {
					e := j*b.C + i // element of the bucket
					if e >= b.n {
						continue // padding: m = v = 0, u = 0
					}
					// 2. reduce-scatter with mean.
					gbar := 0.0
					for r := range w {
						gbar += g[r][b.lo+e]
					}
					gbar /= float64(w)
					// 3. moments.
					b.m[j][i] = ref.b1*b.m[j][i] + (1-ref.b1)*gbar
					b.v[j][i] = ref.b2*b.v[j][i] + (1-ref.b2)*gbar*gbar
					// 4. exact ratio; 5. all-gather.
					U[e] = b.m[j][i] * c1 / (math.Sqrt(b.v[j][i]*c2) + ref.eps)
				}
			}
			ref.apply(b, U) // 6.
		}
		if s == ref.freeze {
			ref.c2Frozen = c2
			for _, b := range ref.buckets {
				for r := range w {
					clear(b.worker[r])
					clear(b.ue[r])
				}
			}
		}
		return
	}
	for _, b := range ref.buckets {
		// Worker side, every rank: 1.-3.
		scales, signs := make([]float64, w), make([][]float64, w)
		for r := range w {
			x := make([]float64, b.N)
			copy(x, g[r][b.lo:b.lo+b.n])
			for i := range x {
				x[i] += b.worker[r][i]
			}
			scales[r] = pinNorm(x) / math.Sqrt(float64(b.N))
			signs[r] = make([]float64, b.N)
			for i := range x {
				signs[r][i] = pinSgn(x[i])
				b.worker[r][i] = x[i] - scales[r]*signs[r][i]
			}
		}
		// Owner side, rank j, its chunk only: 4.-7.
		U := make([]float64, b.N)
		for j := range w {
			y := make([]float64, b.C)
			for i := range b.C {
				e := j*b.C + i
				u := 0.0
				if e < b.n {
					c := 0.0
					for r := range w { // ascending r
						c += scales[r] / float64(w) * signs[r][e]
					}
					b.m[j][i] = (ref.b1*b.m[j][i] + (1-ref.b1)*c) * ref.mask[b.lo+e]
					u = ref.clip(b.m[j][i] * c1 / (math.Sqrt(b.v[j][i]*ref.c2Frozen) + ref.eps))
				}
				y[i] = u + b.ue[j][i]
			}
			scale := 0.0 // 7. the mean of |y| over the chunk
			for _, yi := range y {
				scale += math.Abs(yi)
			}
			scale /= float64(b.C)
			for i := range b.C {
				sg := pinSgn(y[i])
				b.ue[j][i] = y[i] - scale*sg
				U[j*b.C+i] = scale * sg // 8. decompressed on every rank
			}
		}
		ref.apply(b, U)
	}
}

// param returns the reference's parameter i.
func (ref *shRef) param(i int) []float64 {
	return ref.p[ref.paramLo[i] : ref.paramLo[i]+ref.paramLen[i]]
}

// shBucketName names bucket k's tensor what in a checkpoint, as
// docs/sharded.md spells it (what/bucket:k).
func shBucketName(what string, k int) string { return fmt.Sprintf("%s/bucket:%d", what, k) }

// compare checks rank r's checkpoint of step s against the reference:
// parameters, the shards of m and v of every bucket and, from the freeze
// on (in the warm-up the error buffers stage its exchanges), both error
// buffers.
func (ref *shRef) compare(t *testing.T, ck *optim.Checkpoint, s, r int) {
	t.Helper()
	for i, pm := range pinModel {
		pinClose(t, pinTol, ref.param(i), ck.Tensor(optim.ParamTensorName(pm.name)).Data, "step %d rank %d param %s", s, r, pm.name)
	}
	require.Equal(t, int64(1), ck.Ints["state_mode"], "state mode after step %d", s)
	require.Equal(t, int64(len(ref.buckets)), ck.Ints[onebit.IntBuckets], "buckets after step %d", s)
	for k, b := range ref.buckets {
		pinClose(t, pinTol, b.m[r], tensorData(t, ck, shBucketName("exp_avg_shard", k)), "step %d rank %d bucket %d m", s, r, k)
		pinClose(t, pinTol, b.v[r], tensorData(t, ck, shBucketName("exp_avg_sq_shard", k)), "step %d rank %d bucket %d v", s, r, k)
		if s >= ref.freeze {
			pinClose(t, pinTol, b.worker[r], tensorData(t, ck, shBucketName("worker_error", k)), "step %d rank %d bucket %d worker_error", s, r, k)
			pinClose(t, pinTol, b.ue[r], tensorData(t, ck, shBucketName("server_error", k)), "step %d rank %d bucket %d update_error", s, r, k)
		}
	}
}

func tensorData(t *testing.T, ck *optim.Checkpoint, name string) []float32 {
	t.Helper()
	tn := ck.Tensor(name)
	require.NotNil(t, tn, "checkpoint tensor %s", name)
	return tn.Data
}

// TestPinShardedAdam pins the sharded mode of 1-bit Adam: the warm-up
// (reduce-scatter of the mean gradient, the owners' exact moments and
// ratios, all-gather, p -= lr*(U + wd*p)), the freeze of c2 and of the
// staging buffers, and the compression stage (worker error feedback of
// the gradient, the owners' average of the compressed chunks, momentum
// and mask, the bounded ratio with the frozen v, the update error
// feedback, the decompressed update on every rank), on 2, 3 and 4 ranks,
// with one bucket holding every parameter and with buckets of 16
// elements (BucketBytes 64: parameters span buckets, whole chunks are
// padding on 3 and 4 ranks), with and without weight decay and bias
// correction. Betas 0.9 and 0.99 leave every ratio below the bound's cap
// (23.5; at most 19.4 here); the cases with betas 0 and 0.9 clip 8 or 9
// ratios (up to 47 against a cap of 31.6). No ratio reaches the knee.
// After every step every rank's parameters, shards of m and v and (from
// the freeze on: in the warm-up they stage its exchanges) error buffers,
// read under the names of docs/sharded.md, must match the reference
// within pinTol, and the parameters must be bit-identical on every rank.
// pinTol (1e-5 of 1+max|value|, see pin_test.go) holds with a margin: the
// largest difference measured is 3.7e-6, in the update error of the
// W=3, betas 0 and 0.9 case, whose chunk carries ratios of about 30 whose
// float32 rounding (1e-7 of them) the error feedback sums over the 10
// compression steps; elsewhere below 2.7e-6 (parameters 1.1e-7, m 2.4e-7,
// v 2.1e-7). Every mutation of a step tried (update scale over sqrt(N), or
// the RMS of y instead of the mean of |y|,
// worker scale over sqrt(C), no update error, c2 not frozen, no mask, no
// bound, no weight decay, no worker error, sgn(0) = -1, no c1 in the
// compression stage, the owner's sum not divided by W) fails it, by at
// least 5 times the tolerance. No sign decision falls close to zero in
// these runs.
func TestPinShardedAdam(t *testing.T) {
	const freeze, steps = 4, 14
	for _, tc := range []struct {
		w           int
		bucketBytes int
		wd          float64
		bc          bool
		b1, b2      float64
	}{
		{2, 0, 0, true, 0.9, 0.99},
		{2, 64, 0.02, true, 0.9, 0.99},
		{3, 0, 0.02, false, 0.9, 0.99},
		{3, 64, 0, true, 0.9, 0.99},
		{4, 0, 0.02, true, 0.9, 0.99},
		{4, 64, 0.02, false, 0.9, 0.99},
		{2, 0, 0.02, true, 0, 0.9},
		{3, 0, 0, true, 0, 0.9},
	} {
		t.Run(fmt.Sprintf("W=%d/bucket_bytes=%d/wd=%v/bias_correction=%v/betas=%v,%v", tc.w, tc.bucketBytes, tc.wd, tc.bc, tc.b1, tc.b2), func(t *testing.T) {
			cfg := onebit.DefaultAdamConfig()
			cfg.StateMode = onebit.StateSharded
			cfg.LR, cfg.Beta1, cfg.Beta2, cfg.WeightDecay, cfg.BiasCorrection = 0.01, float32(tc.b1), float32(tc.b2), float32(tc.wd), tc.bc
			cfg.FreezeStep = freeze
			cfg.BucketBytes = tc.bucketBytes
			cfg.ExpAvgMask = pinMask()
			cks := pinRun(t, tc.w, steps, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
				return onebit.NewAdam(context.Background(), c, ps, cfg)
			})

			ref := newShRef(tc.w, tc.bucketBytes, freeze, float64(cfg.LR), float64(cfg.Beta1), float64(cfg.Beta2), float64(cfg.Eps), float64(cfg.WeightDecay), tc.bc)
			if tc.bucketBytes == 64 {
				require.Greater(t, len(ref.buckets), 1)
			}
			for s := 1; s <= steps; s++ {
				ref.step(s)
				for r := range tc.w {
					ck := cks[s-1][r]
					wantStage := optim.StageWarmup
					if s >= freeze {
						wantStage = optim.StageCompression
					}
					require.Equal(t, wantStage, ck.Stage, "stage after step %d", s)
					ref.compare(t, ck, s, r)
					for _, pm := range pinModel {
						name := optim.ParamTensorName(pm.name)
						require.Equal(t, cks[s-1][0].Tensor(name).Data, ck.Tensor(name).Data,
							"step %d: rank %d's parameter %s differs from rank 0's", s, r, pm.name)
					}
				}
				require.InEpsilon(t, ref.c2Frozen, cks[s-1][0].Floats[onebit.FloatFrozenBiasCorrection2], 1e-6, "frozen bias correction after step %d", s)
			}
		})
	}
}

// shWireBytes runs steps steps of 1-bit Adam with cfg on w ranks (the
// pinned model and gradients) and returns every rank's
// Stats().LastStepBytes after every step: b[s-1][r].
func shWireBytes(t *testing.T, w, steps int, cfg onebit.AdamConfig) [][]int64 {
	t.Helper()
	out := make([][]int64, steps)
	for s := range out {
		out[s] = make([]int64, w)
	}
	var mu sync.Mutex
	pinRunEach(t, w, steps, func(c comm.Comm, ps []*optim.Param) (optim.Optimizer, error) {
		return onebit.NewAdam(context.Background(), c, ps, cfg)
	}, func(s, r int, opt optim.Optimizer) error {
		mu.Lock()
		out[s-1][r] = opt.Stats().LastStepBytes
		mu.Unlock()
		return nil
	})
	return out
}

// TestShardedWireBytesAsFull: a compression step of the sharded mode puts
// on the wire, on every rank, the bytes of one compressed allreduce of
// every bucket, as the full mode's does (the gradient's phase 1 and the
// update's phase 2 replace the momentum's two phases), with one bucket
// and with many, on 2, 3 and 4 ranks; the first compression step adds the
// all-gather of a bit per element of the own chunks (which have v zero),
// (W-1) times their bytes.
func TestShardedWireBytesAsFull(t *testing.T) {
	const freeze, steps = 2, 5
	for _, w := range []int{2, 3, 4} {
		for _, bucketBytes := range []int{0, 64} {
			t.Run(fmt.Sprintf("W=%d/bucket_bytes=%d", w, bucketBytes), func(t *testing.T) {
				cfg := onebit.DefaultAdamConfig()
				cfg.LR, cfg.Beta1, cfg.Beta2, cfg.WeightDecay = 0.01, 0.9, 0.99, 0.02
				cfg.FreezeStep = freeze
				cfg.BucketBytes = bucketBytes
				cfg.ExpAvgMask = pinMask()
				full := shWireBytes(t, w, steps, cfg)
				cfg.StateMode = onebit.StateSharded
				sharded := shWireBytes(t, w, steps, cfg)
				numel := 0
				for _, pm := range pinModel {
					numel += pm.n
				}
				per, chunks := numel, 0
				if bucketBytes > 0 {
					per = bucketBytes / 4
				}
				for lo := 0; lo < numel; lo += per {
					chunks += onebit.PaddedLen(min(per, numel-lo), w) / w
				}
				gather := int64((w - 1) * ((chunks + 7) / 8))
				for s := freeze + 1; s <= steps; s++ {
					for r := range w {
						assert.Positive(t, full[s-1][r], "full mode's bytes of step %d on rank %d", s, r)
						want := full[s-1][r]
						if s == freeze+1 {
							want += gather
						}
						assert.Equal(t, want, sharded[s-1][r], "bytes sent in compression step %d by rank %d: full mode (and the v-zero bits), sharded mode", s, r)
					}
				}
			})
		}
	}
}
