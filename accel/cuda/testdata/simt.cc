// simt.cc: runs the kernels of kernels/lowbit.cu on the host for the
// stand-in libcuda (libcuda_stub.c). A launch runs its blocks one after
// the other; the threads of a block are fibers (ucontext), resumed in a
// new random order in every round (so that a missing barrier shows as a
// thread that reads shared memory before another has written it). A fiber runs until it reaches a barrier (bar.sync), a warp vote
// or shuffle, or its end; when every live thread of the block waits at
// the barrier they all go on, and when all 32 lanes of a warp wait at a
// warp operation the scheduler computes every lane's result. A warp
// operation that not every lane reaches, or threads left waiting, is a
// failed launch (CUDA would hang or be undefined).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include "lowbit.cu"

namespace {

enum State { RUN, BAR, WARP, DONE };
enum WarpOp { OP_BALLOT, OP_SHFL_DOWN, OP_SHFL_XOR };

struct Fiber {
  ucontext_t ctx;
  char *stack;
  State state;
  WarpOp op;
  int value, delta; // operands
  unsigned result;
};

const size_t kStack = 256 << 10;
Fiber *fibers;
unsigned cap;
Fiber *cur;
unsigned cur_tid, g_ctaid, g_nctaid, g_ntid;
ucontext_t sched;
void (*g_body)(void **);
void **g_params;
unsigned order[1024];
unsigned long long rng = 0x9E3779B97F4A7C15ull; // fixed seed: runs repeat

unsigned next_rand() {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return (unsigned)(rng >> 32);
}

void fiber_main(int t) {
  g_body(g_params);
  fibers[t].state = DONE; // returns to sched through uc_link
}

void wait(State s) {
  Fiber *f = cur;
  f->state = s;
  swapcontext(&f->ctx, &sched);
}

// run_block runs one block to its end; it returns NULL or what went wrong.
const char *run_block() {
  for (unsigned t = 0; t < g_ntid; t++) {
    Fiber &f = fibers[t];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStack;
    f.ctx.uc_link = &sched;
    makecontext(&f.ctx, (void (*)())fiber_main, 1, (int)t);
    f.state = RUN;
  }
  for (unsigned t = 0; t < g_ntid; t++) order[t] = t;
  for (;;) {
    for (unsigned i = g_ntid - 1; i > 0; i--) {
      unsigned j = next_rand() % (i + 1), x = order[i];
      order[i] = order[j];
      order[j] = x;
    }
    for (unsigned i = 0; i < g_ntid; i++)
      if (unsigned t = order[i]; fibers[t].state == RUN) {
        cur = &fibers[t];
        cur_tid = t;
        swapcontext(&sched, &fibers[t].ctx);
      }
    bool released = false, live = false, at_bar = true;
    for (unsigned w = 0; w < g_ntid / 32; w++) {
      Fiber *lane = &fibers[32 * w];
      int waiting = 0;
      for (int l = 0; l < 32; l++) waiting += lane[l].state == WARP;
      if (waiting == 0) continue;
      if (waiting != 32) return "a warp vote or shuffle that not every lane of the warp reached";
      for (int l = 0; l < 32; l++)
        if (lane[l].op != lane[0].op || lane[l].delta != lane[0].delta)
          return "the lanes of a warp reached different warp operations";
      unsigned votes = 0;
      for (int l = 0; l < 32; l++) votes |= (unsigned)(lane[l].value != 0) << l;
      for (int l = 0; l < 32; l++) {
        if (lane[0].op == OP_BALLOT) {
          lane[l].result = votes;
        } else if (lane[0].op == OP_SHFL_XOR) {
          lane[l].result = (unsigned)lane[l ^ (lane[l].delta & 31)].value; // shfl.sync.bfly, clamp 0x1f
        } else {
          int src = l + lane[l].delta; // shfl.sync.down with clamp 0x1f
          lane[l].result = (unsigned)(src < 32 ? lane[src].value : lane[l].value);
        }
        lane[l].state = RUN;
      }
      released = true;
    }
    if (released) continue;
    for (unsigned t = 0; t < g_ntid; t++) {
      if (fibers[t].state != DONE) live = true;
      if (fibers[t].state != DONE && fibers[t].state != BAR) at_bar = false;
    }
    if (!live) return NULL;
    if (!at_bar) return "threads left waiting (deadlock)";
    for (unsigned t = 0; t < g_ntid; t++)
      if (fibers[t].state == BAR) fibers[t].state = RUN;
  }
}

#define P(T, i) (*(T *)p[i])
void k_compensate_norm(void **p) {
  lowbit_compensate_norm(P(float *, 0), P(const float *, 1), P(i64, 2), P(i64, 3), P(double *, 4));
}
void k_pack_residual(void **p) {
  lowbit_pack_residual(P(unsigned char *, 0), P(float *, 1), P(i64, 2), P(const double *, 3), P(int, 4),
                       P(float *, 5));
}
void k_unpack_scale(void **p) {
  lowbit_unpack_scale(P(float *, 0), P(const unsigned char *, 1), P(i64, 2), P(float, 3));
}
void k_unpack_scale_add(void **p) {
  lowbit_unpack_scale_add(P(float *, 0), P(const unsigned char *, 1), P(i64, 2), P(float, 3));
}
void k_unpack_chunks(void **p) {
  lowbit_unpack_chunks(P(float *, 0), P(const unsigned char *, 1), P(i64, 2), P(i64, 3), P(const float *, 4),
                       P(u32, 5));
}
void k_carry_pack(void **p) {
  lowbit_carry_pack(P(unsigned char *, 0), P(float *, 1), P(i64, 2), P(float, 3), P(const float *, 4), P(i64, 5),
                    P(double *, 6));
}
void k_sum_carry_pack(void **p) {
  lowbit_sum_carry_pack(P(unsigned char *, 0), P(float *, 1), P(i64, 2), P(float, 3),
                        P(const unsigned char *, 4), P(i64, 5), P(const float *, 6), P(int, 7), P(double *, 8));
}
void k_scale(void **p) { lowbit_scale(P(const double *, 0), P(int, 1), P(i64, 2), P(float *, 3)); }
#undef P

struct Kernel {
  const char *name;
  void (*run)(void **);
} kernels[] = {
    {"lowbit_compensate_norm", k_compensate_norm},
    {"lowbit_pack_residual", k_pack_residual},
    {"lowbit_unpack_scale", k_unpack_scale},
    {"lowbit_unpack_scale_add", k_unpack_scale_add},
    {"lowbit_unpack_chunks", k_unpack_chunks},
    {"lowbit_carry_pack", k_carry_pack},
    {"lowbit_sum_carry_pack", k_sum_carry_pack},
    {"lowbit_scale", k_scale},
};
const int nkernels = sizeof kernels / sizeof kernels[0];

} // namespace

u32 simt_tid() { return cur_tid; }
u32 simt_ntid() { return g_ntid; }
u32 simt_ctaid() { return g_ctaid; }
u32 simt_nctaid() { return g_nctaid; }
void simt_bar_sync() { wait(BAR); }
int simt_shfl_down(int v, int delta) {
  cur->op = OP_SHFL_DOWN;
  cur->value = v;
  cur->delta = delta;
  wait(WARP);
  return (int)cur->result;
}
u32 simt_shfl_xor(u32 v, int mask) {
  cur->op = OP_SHFL_XOR;
  cur->value = (int)v;
  cur->delta = mask;
  wait(WARP);
  return cur->result;
}
u32 simt_ballot(bool p) {
  cur->op = OP_BALLOT;
  cur->value = p;
  cur->delta = 0;
  wait(WARP);
  return cur->result;
}

// simt_kernel returns 1 + the index of the kernel called name, or 0.
extern "C" int simt_kernel(const char *name) {
  for (int i = 0; i < nkernels; i++)
    if (!strcmp(name, kernels[i].name)) return i + 1;
  return 0;
}

// simt_launch runs kernel k (from simt_kernel) on grid blocks of block
// threads; it returns 0, or -1 with the reason in err.
extern "C" int simt_launch(int k, unsigned grid, unsigned block, void **params, char *err, int errlen) {
  if (k < 1 || k > nkernels || block == 0 || block % 32 || block > 1024) {
    snprintf(err, errlen, "bad launch");
    return -1;
  }
  if (block > cap) {
    for (unsigned t = 0; t < cap; t++) free(fibers[t].stack);
    free(fibers);
    fibers = (Fiber *)calloc(block, sizeof(Fiber));
    for (unsigned t = 0; t < block; t++) fibers[t].stack = (char *)malloc(kStack);
    cap = block;
  }
  g_body = kernels[k - 1].run;
  g_params = params;
  g_ntid = block;
  g_nctaid = grid;
  for (unsigned b = 0; b < grid; b++) {
    g_ctaid = b;
    if (const char *why = run_block()) {
      snprintf(err, errlen, "%s: block %u: %s", kernels[k - 1].name, b, why);
      return -1;
    }
  }
  return 0;
}
