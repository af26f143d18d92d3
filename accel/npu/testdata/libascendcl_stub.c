// A stand-in for the ACL entry points package accel/npu calls (runtime and
// operator library in one), on host memory: "device" pointers are host
// pointers. It checks arguments the way the CANN documentation describes
// and returns its error codes, so that loading, argument passing, the
// two-phase workspace calls and error codes are exercised for real. The
// sign-bits operators use the bit order of the documentation's example
// (first element in the least significant bit).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int aclError;
enum { ACL_FLOAT = 0, ACL_UINT8 = 4, ACL_FORMAT_ND = 2 };
enum { OK = 0, INVALID_PARAM = 100000, NULLPTR = 161001, PARAM_INVALID = 161002, MEM_ALLOC = 207001 };

typedef struct {
  int64_t dims[8], strides[8];
  uint64_t ndims;
  int dtype;
  void *data;
} aclTensor;

typedef struct {
  int op; // 1 pack, 2 unpack
  const aclTensor *self, *out;
  uint64_t ws;
  int used;
} aclOpExecutor;

static int inited, device = -1, streams, live_tensors, live_executors, fail_next;
static long long mem_limit, mem_used;
static char msg[256];
static int stream_token;

void stub_acl_set(long long limit, int fail) { mem_limit = limit; fail_next = fail; }
long long stub_acl_counts(void) { return (long long)live_tensors * 1000000 + live_executors * 1000 + streams; }
long long stub_acl_mem_used(void) { return mem_used; }

static aclError fail(aclError code, const char *m) {
  snprintf(msg, sizeof msg, "%s", m);
  return code;
}
const char *aclGetRecentErrMsg(void) { return msg[0] ? msg : NULL; }

aclError aclInit(const char *config) {
  if (config) return fail(INVALID_PARAM, "stub: config path not expected");
  if (inited) return fail(100002, "stub: repeated initialisation");
  inited = 1;
  return OK;
}
aclError aclFinalize(void) {
  if (!inited) return fail(100000, "stub: not initialised");
  inited = 0;
  return OK;
}
aclError aclrtSetDevice(int32_t id) {
  if (!inited) return fail(100000, "stub: aclInit not called");
  if (id < 0 || id > 1) return fail(107001, "stub: invalid device id");
  device = id;
  return OK;
}
aclError aclrtResetDevice(int32_t id) {
  if (id != device) return fail(107001, "stub: reset of a device not set");
  device = -1;
  return OK;
}
aclError aclrtMalloc(void **p, size_t n, int policy) {
  if (!p || n == 0 || policy < 0 || policy > 2) return fail(INVALID_PARAM, "stub: bad malloc arguments");
  if (device < 0) return fail(107002, "stub: no device set");
  if (mem_limit > 0 && mem_used + (long long)n > mem_limit) return fail(MEM_ALLOC, "stub: out of device memory");
  uint64_t *h = malloc(n + 16);
  h[0] = n;
  mem_used += n;
  *p = h + 2;
  return OK;
}
aclError aclrtFree(void *p) {
  if (!p) return fail(INVALID_PARAM, "stub: free of NULL");
  uint64_t *h = (uint64_t *)p - 2;
  mem_used -= h[0];
  free(h);
  return OK;
}
aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int kind) {
  if (!dst || !src || count > destMax || kind < 0 || kind > 3) return fail(INVALID_PARAM, "stub: bad memcpy arguments");
  memcpy(dst, src, count);
  return OK;
}
aclError aclrtCreateStream(void **s) {
  if (!s || device < 0) return fail(INVALID_PARAM, "stub: bad stream arguments");
  streams++;
  *s = &stream_token;
  return OK;
}
aclError aclrtDestroyStream(void *s) {
  if (s != &stream_token) return fail(INVALID_PARAM, "stub: unknown stream");
  streams--;
  return OK;
}
aclError aclrtSynchronizeStream(void *s) { return s == &stream_token ? OK : fail(INVALID_PARAM, "stub: unknown stream"); }

aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, int dataType, const int64_t *stride,
                           int64_t offset, int format, const int64_t *storageDims, uint64_t storageDimsNum,
                           void *tensorData) {
  if (!viewDims || viewDimsNum == 0 || viewDimsNum > 8 || !stride || offset != 0 || format != ACL_FORMAT_ND ||
      !storageDims || storageDimsNum != viewDimsNum || !tensorData) {
    fail(INVALID_PARAM, "stub: bad tensor arguments");
    return NULL;
  }
  aclTensor *t = calloc(1, sizeof *t);
  int64_t want = 1;
  for (int i = (int)viewDimsNum - 1; i >= 0; i--) {
    if (stride[i] != want || storageDims[i] != viewDims[i]) {
      free(t);
      fail(INVALID_PARAM, "stub: tensor not contiguous");
      return NULL;
    }
    want *= viewDims[i];
    t->dims[i] = viewDims[i];
  }
  t->ndims = viewDimsNum;
  t->dtype = dataType;
  t->data = tensorData;
  live_tensors++;
  return t;
}
int aclDestroyTensor(const aclTensor *t) {
  if (!t) return NULLPTR;
  live_tensors--;
  free((void *)t);
  return OK;
}
static int64_t numel(const aclTensor *t) {
  int64_t n = 1;
  for (uint64_t i = 0; i < t->ndims; i++) n *= t->dims[i];
  return n;
}

// Two-phase operators: phase 1 checks and returns a workspace size (64
// bytes, which phase 2 insists on) and a one-shot executor.
static int new_exec(int op, const aclTensor *self, const aclTensor *out, uint64_t *ws, aclOpExecutor **ex) {
  aclOpExecutor *e = calloc(1, sizeof *e);
  e->op = op, e->self = self, e->out = out, e->ws = 64;
  *ws = e->ws;
  *ex = e;
  live_executors++;
  return OK;
}
int aclnnSignBitsPackGetWorkspaceSize(const aclTensor *self, int64_t size, aclTensor *out, uint64_t *ws,
                                      aclOpExecutor **ex) {
  if (fail_next) { int c = fail_next; fail_next = 0; return fail(c, "stub: injected failure"); }
  if (!self || !out || !ws || !ex) return fail(NULLPTR, "stub: null pointer");
  if (self->dtype != ACL_FLOAT || out->dtype != ACL_UINT8 || self->ndims != 1 || size <= 0 || out->ndims != 2 ||
      out->dims[0] != size || numel(out) != (numel(self) + 7) / 8)
    return fail(PARAM_INVALID, "stub: invalid sign-bits pack arguments");
  return new_exec(1, self, out, ws, ex);
}
int aclnnSignBitsUnpackGetWorkspaceSize(const aclTensor *self, int64_t size, int dtype, aclTensor *out, uint64_t *ws,
                                        aclOpExecutor **ex) {
  if (fail_next) { int c = fail_next; fail_next = 0; return fail(c, "stub: injected failure"); }
  if (!self || !out || !ws || !ex) return fail(NULLPTR, "stub: null pointer");
  if (self->dtype != ACL_UINT8 || self->ndims != 1 || dtype != ACL_FLOAT || out->dtype != dtype || size <= 0 ||
      (numel(self) * 8) % size != 0 || out->ndims != 2 || out->dims[0] != size || numel(out) != numel(self) * 8)
    return fail(PARAM_INVALID, "stub: invalid sign-bits unpack arguments");
  return new_exec(2, self, out, ws, ex);
}
static int run(int op, void *ws, uint64_t wsSize, aclOpExecutor *e, void *stream) {
  if (!e || e->op != op || e->used) return fail(PARAM_INVALID, "stub: bad or reused executor");
  if (stream != &stream_token) return fail(INVALID_PARAM, "stub: unknown stream");
  if (!ws || wsSize != e->ws) return fail(PARAM_INVALID, "stub: workspace missing or of the wrong size");
  e->used = 1;
  if (op == 1) {
    const float *x = e->self->data;
    uint8_t *p = e->out->data;
    int64_t n = numel(e->self);
    memset(p, 0, (n + 7) / 8);
    for (int64_t i = 0; i < n; i++)
      if (!(x[i] < 0)) p[i / 8] |= 1 << (i % 8);
  } else {
    const uint8_t *p = e->self->data;
    float *x = e->out->data;
    int64_t n = numel(e->out);
    for (int64_t i = 0; i < n; i++) x[i] = (p[i / 8] >> (i % 8)) & 1 ? 1.0f : -1.0f;
  }
  free(e);
  live_executors--;
  return OK;
}
int aclnnSignBitsPack(void *ws, uint64_t wsSize, aclOpExecutor *e, void *stream) { return run(1, ws, wsSize, e, stream); }
int aclnnSignBitsUnpack(void *ws, uint64_t wsSize, aclOpExecutor *e, void *stream) { return run(2, ws, wsSize, e, stream); }
