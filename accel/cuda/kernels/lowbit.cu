// Device kernels of the 1-bit compressed allreduce (package accel/cuda).
//
// Built to PTX by `make ptx` with Debian's clang, without the CUDA toolkit:
//
//   clang-14 --cuda-device-only -nocudainc --cuda-gpu-arch=sm_80 -S -O3
//       -o accel/cuda/lowbit.ptx accel/cuda/kernels/lowbit.cu
//
// The PTX is committed and embedded in the Go package; the driver compiles
// it for the GPU at load time. The kernels follow the host code of
// packages errorfeedback and signpack operation for operation, so that
// signs and residuals agree bit for bit with the CPU path given the same
// scale; only the order in which the float64 norm is summed differs.
//
// Wire format of packed signs: one bit per element, 8 elements per byte,
// the first element in the most significant bit; bit 1 means +1 (x >= 0
// or NaN), bit 0 means -1. __ballot_sync puts lane i in bit i of a 32-bit
// word; on a little-endian device byte k of that word holds lanes 8k..8k+7
// with lane 8k in its least significant bit. __brev (here clang's __builtin_bitreverse32, the same brev.b32 instruction) reverses all 32 bits
// (lane 8k+j goes to byte 3-k, bit 7-j) and a byte swap puts byte 3-k
// back at k: the wire format.

#ifdef LOWBIT_SIMT
// The tests run this file on the host, one fiber per thread
// (accel/cuda/testdata/simt.h supplies the names below).
#include "simt.h"
#else
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __forceinline__ __attribute__((always_inline))

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

static __device__ __forceinline__ u32 tid() { return __nvvm_read_ptx_sreg_tid_x(); }
static __device__ __forceinline__ u32 ntid() { return __nvvm_read_ptx_sreg_ntid_x(); }
static __device__ __forceinline__ u32 ctaid() { return __nvvm_read_ptx_sreg_ctaid_x(); }
static __device__ __forceinline__ u32 nctaid() { return __nvvm_read_ptx_sreg_nctaid_x(); }

// sync_threads is __syncthreads with a memory clobber. clang's builtin
// alone does not stop LLVM from moving a load of a __shared__ variable
// that no call can see (GlobalsAA) above the barrier: the other threads
// then read the block's scale before thread 0 has stored it.
static __device__ __forceinline__ void sync_threads() { asm volatile("bar.sync 0;" ::: "memory"); }

// shfl_down_i32 is __shfl_down_sync over the full warp; ballot is
// __ballot_sync over the full warp.
static __device__ __forceinline__ int shfl_down_i32(int v, int delta) {
  return __nvvm_shfl_sync_down_i32(0xffffffffu, v, delta, 0x1f);
}
static __device__ __forceinline__ u32 ballot(bool p) { return __nvvm_vote_ballot_sync(0xffffffffu, p); }
// shfl_xor_u32 is __shfl_xor_sync over the full warp.
static __device__ __forceinline__ u32 shfl_xor_u32(u32 v, int mask) {
  return (u32)__nvvm_shfl_sync_bfly_i32(0xffffffffu, (int)v, mask, 0x1f);
}

// to_wire turns a ballot word into the wire format: bit reversal, then a
// byte swap (see the top of the file).
static __device__ __forceinline__ u32 to_wire(u32 word) { return __nvvm_prmt(__builtin_bitreverse32(word), 0, 0x0123); }

static __device__ __forceinline__ double sqrt_rn(double x) { return __nvvm_sqrt_rn_d(x); }
#endif

typedef struct __attribute__((aligned(16))) {
  float x, y, z, w;
} float4v;

static __device__ __forceinline__ double shfl_down(double v, int delta) {
  u64 b = __builtin_bit_cast(u64, v);
  int lo = shfl_down_i32((int)(u32)b, delta);
  int hi = shfl_down_i32((int)(u32)(b >> 32), delta);
  return __builtin_bit_cast(double, ((u64)(u32)hi << 32) | (u64)(u32)lo);
}

// block_sum returns, in thread 0, the sum of v over the block (blockDim.x a
// multiple of 32, at most 1024), in a fixed order: the result depends only
// on the inputs, never on timing.
static __device__ double block_sum(double v) {
  __shared__ double warp_sums[32];
  for (int d = 16; d > 0; d >>= 1) v += shfl_down(v, d);
  u32 lane = tid() & 31, warp = tid() >> 5;
  if (lane == 0) warp_sums[warp] = v;
  sync_threads();
  double s = 0;
  if (warp == 0) {
    s = lane < (ntid() >> 5) ? warp_sums[lane] : 0.0;
    for (int d = 16; d > 0; d >>= 1) s += shfl_down(s, d);
  }
  sync_threads();
  return s;
}

// lowbit_compensate_norm: x = residual + pad(input), stored in residual,
// and partials[blockIdx.x] = the float64 sum of x*x over the elements the
// block visited (a grid-stride loop, so the partial sums depend only on
// the grid size and n).
extern "C" __global__ void lowbit_compensate_norm(float *__restrict__ residual, const float *__restrict__ input,
                                                  i64 n_input, i64 n, double *__restrict__ partials) {
  i64 stride = (i64)ntid() * nctaid();
  i64 first = (i64)ctaid() * ntid() + tid();
  double s0 = 0, s1 = 0;
  i64 done = 0; // elements [0, done) are handled four at a time
  if (((((u64)residual) | ((u64)input)) & 15) == 0) {
    // 16-byte loads and stores: four elements per thread and iteration.
    i64 quads = n_input >> 2;
    float4v *r4 = (float4v *)residual;
    const float4v *in4 = (const float4v *)input;
    for (i64 q = first; q < quads; q += stride) {
      float4v a = r4[q], b = in4[q];
      a.x = a.x + b.x;
      a.y = a.y + b.y;
      a.z = a.z + b.z;
      a.w = a.w + b.w;
      r4[q] = a;
      s0 += (double)a.x * (double)a.x + (double)a.y * (double)a.y;
      s1 += (double)a.z * (double)a.z + (double)a.w * (double)a.w;
    }
    done = quads << 2;
  }
  for (i64 i = done + first; i < n; i += stride) {
    float a = residual[i];
    if (i < n_input) a = a + input[i];
    residual[i] = a;
    s0 += (double)a * (double)a;
  }
  double s = block_sum(s0 + s1);
  if (tid() == 0) partials[ctaid()] = s;
}

// norm_scale sums the partials in a fixed order (every block gets the same
// value) and returns float32(sqrt(ss) / sqrt(n)), the scale of
// errorfeedback.Residual.Compress.
static __device__ float norm_scale(const double *__restrict__ partials, int nparts, i64 n) {
  __shared__ float scale;
  double s = 0;
  for (int k = tid(); k < nparts; k += ntid()) s += partials[k];
  s = block_sum(s);
  if (tid() == 0) scale = (float)(sqrt_rn(s) / sqrt_rn((double)n));
  sync_threads();
  return scale;
}

// load_rows loads the 32 rows of 32 floats of the group of 1024 elements
// from base, lane by lane (0 beyond n): 32 coalesced loads per warp.
static __device__ __forceinline__ void load_rows(float v[32], const float *__restrict__ x, i64 base, u32 lane, i64 n) {
#pragma unroll
  for (int k = 0; k < 32; k++) {
    i64 idx = base + k * 32 + lane;
    v[k] = idx < n ? x[idx] : 0.0f;
  }
}

// store_words stores the packed signs of group g, lane's ballot word
// (row lane) in the wire format: one coalesced 128-byte store per warp, or
// bytes at an unaligned or partial end.
static __device__ __forceinline__ void store_words(unsigned char *__restrict__ packed, i64 g, u32 lane, u32 mine,
                                                   i64 nbytes, bool aligned) {
  u32 wire = to_wire(mine);
  i64 at = (g << 7) + 4 * (i64)lane; // byte offset of this lane's word
  if (aligned && at + 4 <= nbytes) {
    *(u32 *)(packed + at) = wire;
  } else {
    for (int b = 0; b < 4; b++)
      if (at + b < nbytes) packed[at + b] = (unsigned char)(wire >> (8 * b));
  }
}

// lowbit_pack_residual packs the signs of x (n elements) into packed
// (ceil(n/8) bytes) and replaces x[i] with x[i] - scale (sign +1) or
// x[i] + scale (sign -1), where scale comes from the partial sums of
// lowbit_compensate_norm; block 0 stores it in *scale_out. Each warp
// handles groups of 1024 elements: 32 coalesced loads of 32 floats, 32
// ballots, 32 coalesced stores, and one coalesced 128-byte store of the
// packed words.
extern "C" __global__ void lowbit_pack_residual(unsigned char *__restrict__ packed, float *__restrict__ x, i64 n,
                                                const double *__restrict__ partials, int nparts,
                                                float *__restrict__ scale_out) {
  float scale = norm_scale(partials, nparts, n);
  if (ctaid() == 0 && tid() == 0) *scale_out = scale;
  u32 lane = tid() & 31;
  i64 warps = (i64)nctaid() * (ntid() >> 5);
  i64 groups = (n + 1023) >> 10;
  i64 nbytes = (n + 7) >> 3;
  bool aligned = (((u64)packed) & 3) == 0;
  for (i64 g = (i64)ctaid() * (ntid() >> 5) + (tid() >> 5); g < groups; g += warps) {
    i64 base = g << 10;
    float v[32];
    load_rows(v, x, base, lane, n);
    u32 mine = 0;
#pragma unroll
    for (int k = 0; k < 32; k++) {
      i64 idx = base + k * 32 + lane;
      bool in = idx < n;
      bool neg = v[k] < 0.0f; // false for NaN: NaN packs as +1
      u32 word = ballot(in && !neg);
      if (lane == (u32)k) mine = word;
      if (in) x[idx] = neg ? v[k] + scale : v[k] - scale;
    }
    store_words(packed, g, lane, mine, nbytes, aligned);
  }
}

// lowbit_unpack_scale writes scale or -scale into dst[i] from bit i of
// packed; lowbit_unpack_scale_add adds it. The sign flip is exact, so the
// values are those of signpack.UnpackScale and signpack.UnpackScaleAdd.
//
// With dst 16-byte aligned, a thread handles a quad of four elements (half
// a packed byte) with one 16-byte store, so that a warp's store covers 512
// contiguous bytes; each thread has four quads, a grid stride apart, in
// flight per iteration. Otherwise one element per thread.
static __device__ __forceinline__ float pm(u32 byte, int bit, float scale) {
  return ((byte >> (7 - bit)) & 1) ? scale : -scale;
}

// unpack handles dst[0, n) from packed, thread first of a grid-stride loop
// of stride threads.
template <bool add>
static __device__ __forceinline__ void unpack(float *__restrict__ dst, const unsigned char *__restrict__ packed, i64 n,
                                              float scale, i64 first, i64 stride) {
  i64 done = 0;
  if ((((u64)dst) & 15) == 0) {
    i64 quads = n >> 2;
    float4v *d4 = (float4v *)dst;
    for (i64 q = first; q < quads; q += 4 * stride) {
      u32 b[4];
#pragma unroll
      for (int u = 0; u < 4; u++) {
        i64 qq = q + u * stride;
        b[u] = qq < quads ? packed[qq >> 1] : 0;
      }
#pragma unroll
      for (int u = 0; u < 4; u++) {
        i64 qq = q + u * stride;
        if (qq >= quads) break;
        int at = (int)(qq & 1) * 4; // the quad's first bit in its byte
        float4v v = {pm(b[u], at, scale), pm(b[u], at + 1, scale), pm(b[u], at + 2, scale), pm(b[u], at + 3, scale)};
        if (add) {
          float4v a = d4[qq];
          v.x = a.x + v.x;
          v.y = a.y + v.y;
          v.z = a.z + v.z;
          v.w = a.w + v.w;
        }
        d4[qq] = v;
      }
    }
    done = quads << 2;
  }
  for (i64 i = done + first; i < n; i += stride) {
    float v = pm(packed[i >> 3], (int)(i & 7), scale);
    dst[i] = add ? dst[i] + v : v;
  }
}

extern "C" __global__ void lowbit_unpack_scale(float *__restrict__ dst, const unsigned char *__restrict__ packed,
                                               i64 n, float scale) {
  unpack<false>(dst, packed, n, scale, (i64)ctaid() * ntid() + tid(), (i64)ntid() * nctaid());
}

extern "C" __global__ void lowbit_unpack_scale_add(float *__restrict__ acc, const unsigned char *__restrict__ packed,
                                                   i64 n, float scale) {
  unpack<true>(acc, packed, n, scale, (i64)ctaid() * ntid() + tid(), (i64)ntid() * nctaid());
}

// lowbit_unpack_chunks is the output of the 1-bit allreduce in one launch:
// dst[i] = ±scales[i / chunk] from bit i of packed, for i < n, chunk a
// multiple of 8 (chunk j's signs start at byte j*chunk/8). The grid is per
// blocks for each chunk, chunk after chunk, so that a block reads its
// chunk's scale once; the values are those of lowbit_unpack_scale on each
// chunk with its scale.
extern "C" __global__ void lowbit_unpack_chunks(float *__restrict__ dst, const unsigned char *__restrict__ packed,
                                                i64 n, i64 chunk, const float *__restrict__ scales, u32 per) {
  u32 j = ctaid() / per, b = ctaid() % per;
  i64 lo = (i64)j * chunk;
  if (lo >= n) return;
  i64 len = n - lo < chunk ? n - lo : chunk;
  unpack<false>(dst + lo, packed + (lo >> 3), len, scales[j], (i64)b * ntid() + tid(), (i64)ntid() * per);
}

// The carried kernels (accel.Device.CompressCarried and SumCompressCarried)
// keep a residual in its carried form: the buffer holds x, the value the
// last compression packed, and the host keeps that compression's scale;
// the residual is x - scale for x >= 0 (or NaN) and x + scale otherwise,
// in float32, exactly the value lowbit_pack_residual would have stored.
// Forming it where the next step reads x anyway makes compensate, norm and
// pack one pass: read x and the input, write x and the signs (12 bytes and
// one bit per element, against 20 for the two kernels above). The signs do
// not depend on the scale, so the pass needs no grid-wide sum first; its
// partial sums of squares go to lowbit_scale afterwards.

// transpose32 transposes a 32x32 bit matrix held one row per lane (bit c
// of lane r's word is element (r, c)): afterwards bit r of lane c's word is
// element (r, c). Five exchanges swap the off-diagonal blocks of 16, 8, 4,
// 2 and 1 rows (Hacker's Delight's transpose32, across the warp).
static __device__ __forceinline__ u32 transpose32(u32 x, u32 lane) {
  u32 m = 0x0000ffffu;
#pragma unroll
  for (int j = 16; j > 0; j >>= 1, m ^= m << j) {
    u32 p = shfl_xor_u32(x, j);
    x = (lane & j) ? (x & ~m) | ((p & ~m) >> j) : (x & m) | ((p & m) << j);
  }
  return x;
}

// carry_pack walks each group of 1024 elements in batches of rows (8 rows
// of 32 floats), so that a thread holds 16 floats, not 64: with few
// registers per thread many warps are resident, which a memory-bound pass
// needs to keep enough loads in flight.
#define BATCH 8

// TCACHE is the most chunks whose transposed sign words SumCompressCarried
// keeps between the batches of a group (TCACHE_THREADS threads a block at
// most: device.go's blockSize).
#define TCACHE 8
#define TCACHE_THREADS 256

// load_batch loads rows k0 to k0+BATCH-1 of the group at base, lane by lane
// (0 beyond n): BATCH coalesced loads per warp.
static __device__ __forceinline__ void load_batch(float v[BATCH], const float *__restrict__ x, i64 base, int k0,
                                                  u32 lane, i64 n) {
#pragma unroll
  for (int k = 0; k < BATCH; k++) {
    i64 idx = base + (k0 + k) * 32 + lane;
    v[k] = idx < n ? x[idx] : 0.0f;
  }
}

// An input of carry_pack gives, for rows k0 to k0+BATCH-1 of the group of
// 1024 elements at base, the value each lane adds to its elements
// (rows(r, base, k0, lane, n)), and whether element i gets one at all
// (has(i)).

// dense_input is the input of CompressCarried: in[i] for i < n_in, nothing
// beyond (x = residual there, as in lowbit_compensate_norm: adding 0 would
// turn a residual of -0 into +0).
struct dense_input {
  const float *__restrict__ in;
  i64 n_in;
  __device__ __forceinline__ bool has(i64 i) const { return i < n_in; }
  __device__ __forceinline__ void rows(float r[BATCH], i64 base, int k0, u32 lane, i64) const {
    load_batch(r, in, base, k0, lane, n_in);
  }
};

// signs_input is the input of SumCompressCarried: the server's average of
// w packed chunks (chunk j at byte j*stride), scales[j] times the signs of
// chunk j, summed in float32 in ascending j from the first term: the
// values of lowbit_unpack_scale for chunk 0 followed by
// lowbit_unpack_scale_add for the others.
struct signs_input {
  const unsigned char *__restrict__ chunks;
  i64 stride;
  const float *__restrict__ scales;
  int w;
  bool words; // chunks and stride 4-byte aligned: whole groups load words
  __device__ __forceinline__ bool has(i64) const { return true; }
  __device__ __forceinline__ void rows(float r[BATCH], i64 base, int k0, u32 lane, i64 n) const {
    if (words && base + 1024 <= n) {
      // A whole group: each lane loads one 32-bit word of the chunk's 128
      // bytes (row lane, coalesced), turns it into ballot order and the
      // warp transposes the 32x32 bits, after which bit k of t is the sign
      // of element base + 32k + lane. The next chunk's word is loaded
      // while this one is worked on.
      // With at most TCACHE chunks the first batch keeps each transposed
      // word in shared memory (a slot per thread) for the other three.
      __shared__ u32 tcache[TCACHE][TCACHE_THREADS];
      bool cached = w <= TCACHE && ntid() <= TCACHE_THREADS;
      const unsigned char *__restrict__ at = chunks + (base >> 3) + 4 * lane;
      u32 next = cached && k0 > 0 ? 0 : *(const u32 *)at;
      for (int j = 0; j < w; j++) {
        u32 t;
        if (cached && k0 > 0) {
          t = tcache[j][tid()];
        } else {
          u32 word = next;
          if (j + 1 < w) next = *(const u32 *)(at + (j + 1) * stride);
          t = transpose32(to_wire(word), lane);
          if (cached) tcache[j][tid()] = t;
        }
        t >>= k0;
        float s = scales[j];
#pragma unroll
        for (int k = 0; k < BATCH; k++) {
          float v = (t >> k) & 1 ? s : -s;
          r[k] = j == 0 ? v : r[k] + v;
        }
      }
      return;
    }
    for (int j = 0; j < w; j++) {
      const unsigned char *__restrict__ c = chunks + j * stride;
      float s = scales[j];
#pragma unroll
      for (int k = 0; k < BATCH; k++) {
        i64 idx = base + (k0 + k) * 32 + lane;
        float v = idx < n ? pm(c[idx >> 3], (int)(idx & 7), s) : 0.0f;
        r[k] = j == 0 ? v : r[k] + v;
      }
    }
  }
};

// carry_pack is the one pass: for each element, the residual from the
// carried x and prev (the scale that packed it), plus the input, stored
// back in x, its sign packed, its square summed; partials[blockIdx.x] gets
// the block's float64 sum. Each warp handles groups of 1024 elements as
// lowbit_pack_residual does (coalesced rows of 32 floats, one ballot per
// row, one coalesced store of 32 packed words), BATCH rows at a time.
template <class In>
static __device__ __forceinline__ void carry_pack(unsigned char *__restrict__ packed, float *__restrict__ x, i64 n,
                                                  float prev, In in, double *__restrict__ partials) {
  u32 lane = tid() & 31;
  i64 warps = (i64)nctaid() * (ntid() >> 5);
  i64 groups = (n + 1023) >> 10;
  i64 nbytes = (n + 7) >> 3;
  bool aligned = (((u64)packed) & 3) == 0;
  double s0 = 0, s1 = 0;
  for (i64 g = (i64)ctaid() * (ntid() >> 5) + (tid() >> 5); g < groups; g += warps) {
    i64 base = g << 10;
    u32 mine = 0;
#pragma unroll 1
    for (int k0 = 0; k0 < 32; k0 += BATCH) {
      float v[BATCH], r[BATCH];
      load_batch(v, x, base, k0, lane, n);
      in.rows(r, base, k0, lane, n);
#pragma unroll
      for (int k = 0; k < BATCH; k++) {
        i64 idx = base + (k0 + k) * 32 + lane;
        bool ok = idx < n;
        float e = v[k] < 0.0f ? v[k] + prev : v[k] - prev; // NaN: NaN - prev
        if (ok && in.has(idx)) e = e + r[k];
        u32 word = ballot(ok && !(e < 0.0f)); // NaN packs as +1
        if (lane == (u32)(k0 + k)) mine = word;
        if (ok) {
          x[idx] = e;
          if (k & 1) // BATCH is even: the parity of row k0 + k
            s1 += (double)e * (double)e;
          else
            s0 += (double)e * (double)e;
        }
      }
    }
    store_words(packed, g, lane, mine, nbytes, aligned);
  }
  double s = block_sum(s0 + s1);
  if (tid() == 0) partials[ctaid()] = s;
}

// lowbit_carry_pack: CompressCarried, x = residual(x, prev) + pad(input).
extern "C" __global__ void lowbit_carry_pack(unsigned char *__restrict__ packed, float *__restrict__ x, i64 n,
                                             float prev, const float *__restrict__ input, i64 n_input,
                                             double *__restrict__ partials) {
  dense_input in = {input, n_input};
  carry_pack(packed, x, n, prev, in, partials);
}

// lowbit_sum_carry_pack: SumCompressCarried, x = residual(x, prev) + the
// scaled sum of w packed chunks.
extern "C" __global__ void lowbit_sum_carry_pack(unsigned char *__restrict__ packed, float *__restrict__ x, i64 n,
                                                 float prev, const unsigned char *__restrict__ chunks, i64 stride,
                                                 const float *__restrict__ scales, int w,
                                                 double *__restrict__ partials) {
  signs_input in = {chunks, stride, scales, w, ((((u64)chunks) | (u64)stride) & 3) == 0};
  carry_pack(packed, x, n, prev, in, partials);
}

// lowbit_scale: one block sums the partials of a carry pass in a fixed
// order and stores the scale, float32(sqrt(ss) / sqrt(n)).
extern "C" __global__ void lowbit_scale(const double *__restrict__ partials, int nparts, i64 n,
                                        float *__restrict__ scale_out) {
  float scale = norm_scale(partials, nparts, n);
  if (tid() == 0) *scale_out = scale;
}
