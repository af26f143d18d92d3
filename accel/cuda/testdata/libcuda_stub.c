// A stand-in for libcuda.so.1 for the tests of package accel/cuda: the
// driver entry points the package calls, on host memory ("device"
// pointers are host pointers), with the four kernels emulated in C by name.
// stub_cuda_set selects failures. It checks the arguments it can, so that
// the Go side's argument passing is exercised for real.
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
  OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
  INVALID_DEVICE = 101, INVALID_CONTEXT = 201, UNSUPPORTED_PTX = 222, INVALID_HANDLE = 400, NOT_FOUND = 500,
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

static int module_token;
CUresult cuModuleLoadData(void **m, const void *image) {
  if (!m || !image) return INVALID_VALUE;
  if (mode == 3) return UNSUPPORTED_PTX;
  // The image must be NUL-terminated PTX that defines the kernels.
  const char *p = image;
  if (!strstr(p, ".entry lowbit_pack_residual(")) return 218; // INVALID_PTX
  *m = &module_token;
  return OK;
}
CUresult cuModuleUnload(void *m) { return m == &module_token ? OK : INVALID_HANDLE; }

static const char *kernels[] = {"lowbit_compensate_norm", "lowbit_pack_residual", "lowbit_unpack_scale",
                                "lowbit_unpack_scale_add"};
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  if (m != &module_token || !f || !name) return INVALID_HANDLE;
  for (intptr_t i = 0; i < 4; i++)
    if (!strcmp(name, kernels[i])) {
      *f = (void *)(i + 1);
      return OK;
    }
  return NOT_FOUND;
}

// Allocations carry an 8-byte header with their size.
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  if (!p || n == 0) return INVALID_VALUE;
  pthread_mutex_lock(&mu);
  if (mem_limit > 0 && mem_used + (long long)n > mem_limit) {
    pthread_mutex_unlock(&mu);
    return OUT_OF_MEMORY;
  }
  mem_used += n;
  pthread_mutex_unlock(&mu);
  uint64_t *h = malloc(n + 16);
  if (!h) return OUT_OF_MEMORY;
  h[0] = n;
  memset(h + 2, 0xA5, n); // not zero: Alloc must clear it
  *p = (CUdeviceptr)(h + 2);
  return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  if (!p) return INVALID_VALUE;
  uint64_t *h = (uint64_t *)p - 2;
  pthread_mutex_lock(&mu);
  mem_used -= h[0];
  pthread_mutex_unlock(&mu);
  free(h);
  return OK;
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
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void *s) {
  if (s != &stream_token || !dst) return INVALID_VALUE;
  memset((void *)dst, v, n);
  return OK;
}

// The kernels, emulated block by block with the grid-stride loops of
// lowbit.cu (sums in a different order; the results agree within the
// spec's tolerance).
static void k_norm(unsigned gx, unsigned bx, void **a) {
  float *r = *(float **)a[0];
  const float *in = *(const float **)a[1];
  long long nin = *(long long *)a[2], n = *(long long *)a[3];
  double *parts = *(double **)a[4];
  long long stride = (long long)gx * bx;
  for (unsigned b = 0; b < gx; b++) {
    double s = 0;
    for (unsigned t = 0; t < bx; t++)
      for (long long i = (long long)b * bx + t; i < n; i += stride) {
        float x = r[i];
        if (i < nin) x = x + in[i];
        r[i] = x;
        s += (double)x * (double)x;
      }
    parts[b] = s;
  }
}
static void k_pack(void **a) {
  unsigned char *p = *(unsigned char **)a[0];
  float *x = *(float **)a[1];
  long long n = *(long long *)a[2];
  const double *parts = *(const double **)a[3];
  int nparts = *(int *)a[4];
  float *out = *(float **)a[5];
  double s = 0;
  for (int k = 0; k < nparts; k++) s += parts[k];
  float scale = (float)(sqrt(s) / sqrt((double)n));
  *out = scale;
  for (long long i = 0; i < n; i += 8) {
    unsigned char b = 0;
    for (long long j = i; j < i + 8 && j < n; j++) {
      if (x[j] < 0) x[j] += scale;
      else { b |= 0x80 >> (j - i); x[j] -= scale; }
    }
    p[i / 8] = b;
  }
}
static void k_unpack(void **a, int add) {
  float *d = *(float **)a[0];
  const unsigned char *p = *(const unsigned char **)a[1];
  long long n = *(long long *)a[2];
  float scale = *(float *)a[3];
  for (long long i = 0; i < n; i++) {
    float v = (p[i >> 3] >> (7 - (i & 7))) & 1 ? scale : -scale;
    d[i] = add ? d[i] + v : v;
  }
}
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *s, void **params, void **extra) {
  if (s != &stream_token || !params || extra || gx == 0 || gy != 1 || gz != 1 || by != 1 || bz != 1 || shmem)
    return INVALID_VALUE;
  if (bx == 0 || bx > 1024 || bx % 32) return INVALID_VALUE;
  __atomic_add_fetch(&launches, 1, __ATOMIC_SEQ_CST);
  switch ((intptr_t)f) {
  case 1: if (gx > 1024) return INVALID_VALUE; k_norm(gx, bx, params); return OK;
  case 2: k_pack(params); return OK;
  case 3: k_unpack(params, 0); return OK;
  case 4: k_unpack(params, 1); return OK;
  }
  return INVALID_HANDLE;
}
