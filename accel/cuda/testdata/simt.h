// simt.h: the CUDA names kernels/lowbit.cu uses, for a host build of that
// file in the tests of package accel/cuda (compiled with -DLOWBIT_SIMT by
// g++, linked into the stand-in libcuda). Every thread of a block is a
// fiber (simt.cc); barriers and warp votes and shuffles are exchanges
// between the fibers, with the instructions' exact semantics, so that the
// real kernel source runs, indexing, bit order and all, on host memory.
#ifndef LOWBIT_SIMT_H
#define LOWBIT_SIMT_H

#include <math.h>

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

#define __global__
#define __device__
#define __shared__ static // one block runs at a time
#define __forceinline__ inline

u32 simt_tid();
u32 simt_ntid();
u32 simt_ctaid();
u32 simt_nctaid();
void simt_bar_sync();
int simt_shfl_down(int v, int delta);
u32 simt_ballot(bool p);
u32 simt_shfl_xor(u32 v, int mask);

static inline u32 tid() { return simt_tid(); }
static inline u32 ntid() { return simt_ntid(); }
static inline u32 ctaid() { return simt_ctaid(); }
static inline u32 nctaid() { return simt_nctaid(); }
static inline void sync_threads() { simt_bar_sync(); }
static inline int shfl_down_i32(int v, int delta) { return simt_shfl_down(v, delta); }
static inline u32 ballot(bool p) { return simt_ballot(p); }
static inline u32 shfl_xor_u32(u32 v, int mask) { return simt_shfl_xor(v, mask); }

// to_wire: brev.b32, then prmt.b32 with selector 0x0123 (a byte swap).
static inline u32 to_wire(u32 word) {
  u32 r = 0;
  for (int i = 0; i < 32; i++)
    if ((word >> i) & 1) r |= 1u << (31 - i);
  return __builtin_bswap32(r);
}

static inline double sqrt_rn(double x) { return sqrt(x); }

#endif
