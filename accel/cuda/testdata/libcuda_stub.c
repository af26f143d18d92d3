// A stand-in for libcuda.so.1 for the tests of package accel/cuda: the
// driver entry points the package calls, on host memory ("device"
// pointers are host pointers), with the kernels of kernels/lowbit.cu run
// on the host by simt.cc (g++ builds both into one library).
// stub_cuda_set selects failures. It checks the arguments it can, so that
// the Go side's argument passing is exercised for real.
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
  OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
  INVALID_DEVICE = 101, INVALID_CONTEXT = 201, UNSUPPORTED_PTX = 222, INVALID_HANDLE = 400, NOT_FOUND = 500, LAUNCH_FAILED = 719,
};

static int mode;             // 0 ok, 1 no device, 2 old driver, 3 PTX rejected, 4 old GPU
static long long mem_limit;  // bytes; 0 = unlimited
static long long mem_used;
static int inited;
static int launches;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

void stub_cuda_set(int m, long long limit) {
  pthread_mutex_lock(&mu);
  mode = m;
  mem_limit = limit;
  pthread_mutex_unlock(&mu);
}
int stub_cuda_launches(void) { return launches; }
long long stub_cuda_mem_used(void) { return mem_used; }
static long long host_used; // page-locked host memory (cuMemAllocHost), bytes
long long stub_cuda_host_used(void) { return host_used; }

CUresult cuInit(unsigned int flags) {
  if (flags != 0) return INVALID_VALUE;
  if (mode == 1) return NO_DEVICE;
  inited = 1;
  return OK;
}
CUresult cuDriverGetVersion(int *v) {
  if (!v) return INVALID_VALUE;
  *v = mode == 2 ? 10020 : 12040;
  return OK;
}
CUresult cuDeviceGetCount(int *n) {
  if (!inited) return NOT_INITIALIZED;
  *n = 2;
  return OK;
}
CUresult cuDeviceGet(int *d, int ordinal) {
  if (ordinal < 0 || ordinal >= 2) return INVALID_DEVICE;
  *d = ordinal;
  return OK;
}
CUresult cuDeviceGetName(char *name, int len, int dev) {
  if (!name || len < 16 || dev < 0 || dev > 1) return INVALID_VALUE;
  strncpy(name, "Stub GPU", len);
  return OK;
}
CUresult cuDeviceGetPCIBusId(char *id, int len, int dev) {
  if (!id || len < 13 || dev < 0 || dev > 1) return INVALID_VALUE;
  strncpy(id, dev ? "0000:02:00.0" : "0000:01:00.0", len);
  return OK;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
  if (!v || dev < 0 || dev > 1) return INVALID_VALUE;
  switch (attr) {
  case 16: *v = 4; return OK;                // multiprocessors
  case 75: *v = mode == 4 ? 7 : 9; return OK; // major
  case 76: *v = 0; return OK;                // minor
  }
  return INVALID_VALUE;
}
static int ctx_token;
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
  if (!ctx || dev < 0 || dev > 1) return INVALID_VALUE;
  *ctx = &ctx_token;
  return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { return dev < 0 || dev > 1 ? INVALID_DEVICE : OK; }
CUresult cuCtxSetCurrent(void *ctx) { return ctx == &ctx_token ? OK : INVALID_CONTEXT; }
static int stream_token;
CUresult cuStreamCreate(void **s, unsigned int flags) {
  if (!s || flags != 1) return INVALID_VALUE;
  *s = &stream_token;
  return OK;
}
CUresult cuStreamDestroy_v2(void *s) { return s == &stream_token ? OK : INVALID_HANDLE; }
CUresult cuStreamSynchronize(void *s) { return s == &stream_token ? OK : INVALID_HANDLE; }

// The kernels are those of kernels/lowbit.cu, run on the host by simt.cc.
int simt_kernel(const char *name);
int simt_launch(int k, unsigned grid, unsigned block, void **params, char *err, int errlen);
static char launch_error[256];
const char *stub_cuda_launch_error(void) { return launch_error; }

static int module_token;
static char *module_image;
CUresult cuModuleLoadData(void **m, const void *image) {
  if (!m || !image) return INVALID_VALUE;
  if (mode == 3) return UNSUPPORTED_PTX;
  // The image must be NUL-terminated PTX; cuModuleGetFunction looks the
  // kernels up in it.
  const char *p = image;
  if (!strstr(p, ".visible .entry ")) return 218; // INVALID_PTX
  pthread_mutex_lock(&mu);
  free(module_image);
  module_image = strdup(p);
  pthread_mutex_unlock(&mu);
  *m = &module_token;
  return OK;
}
CUresult cuModuleUnload(void *m) { return m == &module_token ? OK : INVALID_HANDLE; }

// cuModuleGetFunction finds a kernel that both the embedded PTX defines
// and simt.cc can run.
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  if (m != &module_token || !f || !name) return INVALID_HANDLE;
  char entry[300];
  snprintf(entry, sizeof entry, ".visible .entry %s(", name);
  int k = simt_kernel(name);
  pthread_mutex_lock(&mu);
  int found = module_image && strstr(module_image, entry);
  pthread_mutex_unlock(&mu);
  if (!k || !found) return NOT_FOUND;
  *f = (void *)(intptr_t)k;
  return OK;
}

// Allocations carry a header (size, list links) and are followed by
// kGuard guard bytes; after every launch check_guards looks for a kernel
// that wrote past the end of a buffer.
enum { kGuard = 64, kGuardByte = 0xCD };
struct alloc {
  uint64_t n;
  struct alloc *next, *prev;
  uint64_t pad;
};
static struct alloc allocs = {0, &allocs, &allocs, 0};

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  if (!p || n == 0) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  if (mem_limit > 0 && mem_used + (long long)n > mem_limit) {
    pthread_mutex_unlock(&mu);
    return OUT_OF_MEMORY;
  }
  struct alloc *h = malloc(sizeof *h + n + kGuard);
  if (!h) {
    pthread_mutex_unlock(&mu);
    return OUT_OF_MEMORY;
  }
  mem_used += n;
  h->n = n;
  h->next = allocs.next;
  h->prev = &allocs;
  allocs.next->prev = h;
  allocs.next = h;
  unsigned char *data = (unsigned char *)(h + 1);
  memset(data, 0xA5, n); // not zero: Alloc must clear it
  memset(data + n, kGuardByte, kGuard);
  pthread_mutex_unlock(&mu);
  *p = (CUdeviceptr)data;
  return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  if (!p) return INVALID_VALUE;
  struct alloc *h = (struct alloc *)p - 1;
  pthread_mutex_lock(&mu);
  mem_used -= h->n;
  h->prev->next = h->next;
  h->next->prev = h->prev;
  pthread_mutex_unlock(&mu);
  free(h);
  return OK;
}

// Page-locked host memory: malloc'd, with its size in front.
CUresult cuMemAllocHost_v2(void **p, size_t n) {
  if (!p || n == 0) return INVALID_VALUE;
  size_t *h = malloc(sizeof(size_t) * 2 + n);
  if (!h) return OUT_OF_MEMORY;
  h[0] = n;
  __atomic_add_fetch(&host_used, (long long)n, __ATOMIC_SEQ_CST);
  *p = h + 2;
  return OK;
}
CUresult cuMemFreeHost(void *p) {
  if (!p) return INVALID_VALUE;
  size_t *h = (size_t *)p - 2;
  __atomic_sub_fetch(&host_used, (long long)h[0], __ATOMIC_SEQ_CST);
  free(h);
  return OK;
}

// check_guards returns 0, or -1 with the buffer a kernel overran in err;
// the caller holds mu.
static int check_guards(char *err, int errlen) {
  for (struct alloc *h = allocs.next; h != &allocs; h = h->next) {
    unsigned char *g = (unsigned char *)(h + 1) + h->n;
    for (int i = 0; i < kGuard; i++)
      if (g[i] != kGuardByte) {
        snprintf(err, errlen, "a kernel wrote %d bytes past the end of a %llu-byte buffer", i + 1,
                 (unsigned long long)h->n);
        memset(g, kGuardByte, kGuard);
        return -1;
      }
  }
  return 0;
}
CUresult cuMemGetInfo_v2(size_t *free_, size_t *total) {
  if (!free_ || !total) return INVALID_VALUE;
  *total = mem_limit > 0 ? mem_limit : (1ull << 34);
  *free_ = *total - mem_used;
  return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, void *s) {
  if (s != &stream_token || !dst || !src) return INVALID_VALUE;
  memcpy((void *)dst, src, n);
  return OK;
}
CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, void *s) {
  if (s != &stream_token || !dst || !src) return INVALID_VALUE;
  memcpy(dst, (void *)src, n);
  return OK;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) {
  if (s != &stream_token || !dst || !src) return INVALID_VALUE;
  memmove((void *)dst, (void *)src, n);
  return OK;
}
// CUDA_MEMCPY2D, 64-bit layout; memory types 1 host, 2 device.
typedef struct {
  size_t srcXInBytes, srcY;
  unsigned srcMemoryType;
  const void *srcHost;
  CUdeviceptr srcDevice;
  void *srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  unsigned dstMemoryType;
  void *dstHost;
  CUdeviceptr dstDevice;
  void *dstArray;
  size_t dstPitch;
  size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;
CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *m, void *s) {
  if (s != &stream_token || !m || m->srcXInBytes || m->srcY || m->dstXInBytes || m->dstY || m->srcArray ||
      m->dstArray || m->srcPitch < m->WidthInBytes || m->dstPitch < m->WidthInBytes)
    return INVALID_VALUE;
  const unsigned char *src = m->srcMemoryType == 1 ? (const unsigned char *)m->srcHost
                           : m->srcMemoryType == 2 ? (const unsigned char *)m->srcDevice
                                                   : 0;
  unsigned char *dst = m->dstMemoryType == 1 ? (unsigned char *)m->dstHost
                     : m->dstMemoryType == 2 ? (unsigned char *)m->dstDevice
                                             : 0;
  if (!src || !dst) return INVALID_VALUE;
  for (size_t r = 0; r < m->Height; r++) memcpy(dst + r * m->dstPitch, src + r * m->srcPitch, m->WidthInBytes);
  return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *s) {
  if (s != &stream_token || !dst) return INVALID_VALUE;
  memset((void *)dst, v, n);
  return OK;
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, void *f, int block, size_t shmem) {
  if (!blocks || !f || block <= 0 || block > 1024 || shmem) return INVALID_VALUE;
  *blocks = 2048 / block - 1; // as if registers held one block back
  return OK;
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *s, void **params, void **extra) {
  if (s != &stream_token || !params || extra || gx == 0 || gy != 1 || gz != 1 || by != 1 || bz != 1 || shmem)
    return INVALID_VALUE;
  if (bx == 0 || bx > 1024 || bx % 32) return INVALID_VALUE;
  __atomic_add_fetch(&launches, 1, __ATOMIC_SEQ_CST);
  pthread_mutex_lock(&mu);
  int rc = simt_launch((int)(intptr_t)f, gx, bx, params, launch_error, sizeof launch_error);
  if (rc == 0) rc = check_guards(launch_error, sizeof launch_error);
  pthread_mutex_unlock(&mu);
  return rc == 0 ? OK : LAUNCH_FAILED;
}
