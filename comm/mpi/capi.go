//go:build mpi

package mpi

/*
#cgo pkg-config: ompi-c
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <mpi.h>

// Open MPI's handles (MPI_COMM_WORLD, MPI_FLOAT, ...) are macros over the
// addresses of library globals, which cgo cannot always use: these small
// wrappers take plain ints instead.

enum { lbFloat = 0, lbByte = 1, lbInt64 = 2 };
enum { lbSum = 0, lbMax = 1 };

static MPI_Datatype lb_type(int t) {
	switch (t) {
	case lbFloat: return MPI_FLOAT;
	case lbByte:  return MPI_BYTE;
	}
	return MPI_INT64_T;
}

static MPI_Op lb_op(int op) { return op == lbMax ? MPI_MAX : MPI_SUM; }

static int lb_initialized(void) { int f = 0; MPI_Initialized(&f); return f; }
static int lb_finalized(void)   { int f = 0; MPI_Finalized(&f); return f; }

static int lb_init(int *provided) {
	return MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, provided);
}
static int lb_query_thread(int *provided) { return MPI_Query_thread(provided); }
static int lb_finalize(void) { return MPI_Finalize(); }

static int lb_dup_world(MPI_Comm *out) {
	// Errors of the duplication itself must come back too.
	MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
	return MPI_Comm_dup(MPI_COMM_WORLD, out);
}
static int lb_set_errhandler(MPI_Comm c) { return MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN); }
static int lb_rank_size(MPI_Comm c, int *rank, int *size) {
	int rc = MPI_Comm_rank(c, rank);
	if (rc != MPI_SUCCESS) return rc;
	return MPI_Comm_size(c, size);
}
static int lb_free(MPI_Comm *c) { return MPI_Comm_free(c); }
static int lb_is_null(MPI_Comm c) { return c == MPI_COMM_NULL; }
static int lb_undefined(void) { return MPI_UNDEFINED; }

// lb_divide divides the n floats at x by w > 0, four at a time (GCC's and
// Clang's vector extension: SSE's DIVPS, where Go's compiler makes one
// scalar DIVSS per element); by a power of two it multiplies by 1/w, the
// same number (both round the one real quotient). An IEEE division rounds
// each quotient correctly whatever its width, so the result is bit for
// bit what Go's x[i] /= float32(w) gives (args.go's divide, comm/local's
// Mean).
typedef float lb_f4 __attribute__((vector_size(16)));
static void lb_divide(float *x, size_t n, int w) {
	size_t i = 0;
	float d = (float)w;
	if ((w & (w - 1)) == 0) {
		float r = 1.0f / d; // exact: w is a power of two
		lb_f4 rv = {r, r, r, r};
		for (; i + 4 <= n; i += 4) {
			lb_f4 v;
			memcpy(&v, x + i, sizeof v);
			v *= rv;
			memcpy(x + i, &v, sizeof v);
		}
		for (; i < n; i++) x[i] *= r;
		return;
	}
	lb_f4 dv = {d, d, d, d};
	for (; i + 4 <= n; i += 4) {
		lb_f4 v;
		memcpy(&v, x + i, sizeof v);
		v /= dv;
		memcpy(x + i, &v, sizeof v);
	}
	for (; i < n; i++) x[i] /= d;
}

// lb_allreduce is MPI_Allreduce in place; with divisor > 1 (comm.Mean:
// the float sum, then the division by the rank count) it divides the
// result too, in the same call from Go.
static int lb_allreduce(MPI_Comm c, void *buf, int count, int type, int op, int divisor) {
	int rc = MPI_Allreduce(MPI_IN_PLACE, buf, count, lb_type(type), lb_op(op), c);
	if (rc == MPI_SUCCESS && divisor > 1) lb_divide(buf, (size_t)count, divisor);
	return rc;
}
// lb_reduce_scatter_block is MPI_Reduce_scatter_block on floats, with
// lb_allreduce's divisor.
static int lb_reduce_scatter_block(MPI_Comm c, void *send, void *recv, int count, int op, int divisor) {
	int rc = MPI_Reduce_scatter_block(send, recv, count, MPI_FLOAT, lb_op(op), c);
	if (rc == MPI_SUCCESS && divisor > 1) lb_divide(recv, (size_t)count, divisor);
	return rc;
}
static int lb_allgather(MPI_Comm c, void *send, void *recv, int count, int type) {
	return MPI_Allgather(send, count, lb_type(type), recv, count, lb_type(type), c);
}
static int lb_allgatherv_inplace(MPI_Comm c, void *buf, int *counts, int *displs, int type) {
	return MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts, displs, lb_type(type), c);
}
static int lb_alltoall(MPI_Comm c, void *send, void *recv, int count, int type) {
	return MPI_Alltoall(send, count, lb_type(type), recv, count, lb_type(type), c);
}
static int lb_alltoallv(MPI_Comm c, void *send, int *scounts, int *sdispls,
		void *recv, int *rcounts, int *rdispls, int type) {
	return MPI_Alltoallv(send, scounts, sdispls, lb_type(type), recv, rcounts, rdispls, lb_type(type), c);
}
static int lb_bcast(MPI_Comm c, void *buf, int count, int type, int root) {
	return MPI_Bcast(buf, count, lb_type(type), root, c);
}
static int lb_barrier(MPI_Comm c) { return MPI_Barrier(c); }
static int lb_split(MPI_Comm c, int color, int key, MPI_Comm *out) {
	return MPI_Comm_split(c, color < 0 ? MPI_UNDEFINED : color, key, out);
}

static int lb_split_shared(MPI_Comm c, int key, MPI_Comm *out) {
	return MPI_Comm_split_type(c, MPI_COMM_TYPE_SHARED, key, MPI_INFO_NULL, out);
}
static void lb_error_string(int code, char *out, int cap) {
	char s[MPI_MAX_ERROR_STRING];
	int n = 0;
	if (MPI_Error_string(code, s, &n) != MPI_SUCCESS) n = 0;
	if (n > cap - 1) n = cap - 1;
	for (int i = 0; i < n; i++) out[i] = s[i];
	out[n] = 0;
}

static void lb_abort(int code) { MPI_Abort(MPI_COMM_WORLD, code); }

// lb_world_ranks writes the rank in MPI_COMM_WORLD of each of the n ranks
// of c to out.
static int lb_world_ranks(MPI_Comm c, int n, int *out) {
	MPI_Group g, w;
	int rc = MPI_Comm_group(c, &g);
	if (rc != MPI_SUCCESS) return rc;
	rc = MPI_Comm_group(MPI_COMM_WORLD, &w);
	if (rc == MPI_SUCCESS) {
		int *in = malloc(n * sizeof *in);
		if (in == NULL) {
			rc = MPI_ERR_NO_MEM;
		} else {
			for (int i = 0; i < n; i++) in[i] = i;
			rc = MPI_Group_translate_ranks(g, n, in, w, out);
			free(in);
		}
		MPI_Group_free(&w);
	}
	MPI_Group_free(&g);
	return rc;
}

// lb_state is a communicator's memory that MPI uses after a call returns:
// the agreement vector and request of the non-blocking argument agreement,
// and the roll call's side communicator (a duplicate, so that its messages
// never match the collectives'), its message buffers and requests, one per
// peer.
enum { lbTagAsk = 1, lbTagAnswer = 2 };
enum { lbMsgLen = 3 }; // asked call; answering rank's call; its kind
enum { lbMaxStarted = 16 }; // started data collectives in flight at once

typedef struct {
	MPI_Comm side;
	int rank, size;
	MPI_Request agree_req;
	int agree_done; // set by lb_agree_test (a Go variable would escape)
	int64_t *agree;
	int64_t *ask, *ans;             // size * lbMsgLen each
	MPI_Request *ask_req, *ans_req; // size each
	int64_t in_ask[lbMsgLen], in_ans[lbMsgLen];
	MPI_Request data_req[lbMaxStarted]; // started data collectives (Starter)
	int data_done;                      // set by lb_data_test
} lb_state;

static void lb_state_release(lb_state *s) {
	free(s->agree);
	free(s->ask);
	free(s->ans);
	free(s->ask_req);
	free(s->ans_req);
	free(s);
}

static int lb_state_new(MPI_Comm c, int n, lb_state **out) {
	lb_state *s = calloc(1, sizeof *s);
	if (s == NULL) return MPI_ERR_NO_MEM;
	int rc = MPI_Comm_dup(c, &s->side);
	if (rc != MPI_SUCCESS) {
		free(s);
		return rc;
	}
	MPI_Comm_set_errhandler(s->side, MPI_ERRORS_RETURN);
	MPI_Comm_rank(s->side, &s->rank);
	MPI_Comm_size(s->side, &s->size);
	s->agree_req = MPI_REQUEST_NULL;
	for (int i = 0; i < lbMaxStarted; i++) s->data_req[i] = MPI_REQUEST_NULL;
	s->agree = calloc(n, sizeof *s->agree);
	s->ask = calloc((size_t)s->size * lbMsgLen, sizeof *s->ask);
	s->ans = calloc((size_t)s->size * lbMsgLen, sizeof *s->ans);
	s->ask_req = malloc(s->size * sizeof *s->ask_req);
	s->ans_req = malloc(s->size * sizeof *s->ans_req);
	if (!s->agree || !s->ask || !s->ans || !s->ask_req || !s->ans_req) {
		MPI_Comm_free(&s->side);
		lb_state_release(s);
		return MPI_ERR_NO_MEM;
	}
	for (int i = 0; i < s->size; i++) s->ask_req[i] = s->ans_req[i] = MPI_REQUEST_NULL;
	*out = s;
	return MPI_SUCCESS;
}

// lb_settle reports whether *r is done (MPI_REQUEST_NULL) or completes now.
static int lb_settle(MPI_Request *r) {
	int done = 1;
	if (*r != MPI_REQUEST_NULL && MPI_Test(r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) done = 1;
	return done;
}

// lb_state_free frees s, except its side communicator, which stays
// allocated until MPI is finalized: a roll-call message can reach this
// rank after any moment it could free it (a peer's watchdog may ask at
// any time), and Open MPI 4.1 delivers a message for a freed communicator
// to the next one that reuses its context id (it crashed when that one was
// smaller than the sender's rank). A roll-call message still in flight
// from this rank keeps its buffer: s is then left allocated too.
static void lb_state_free(lb_state *s) {
	int leak = 0;
	for (int i = 0; i < s->size; i++) {
		if (!lb_settle(&s->ask_req[i])) { MPI_Request_free(&s->ask_req[i]); leak = 1; }
		if (!lb_settle(&s->ans_req[i])) { MPI_Request_free(&s->ans_req[i]); leak = 1; }
	}
	if (!lb_settle(&s->agree_req)) { MPI_Request_free(&s->agree_req); leak = 1; }
	// A non-blocking collective's request may not be freed: one still in
	// flight (the communicator refuses to close then) keeps s.
	for (int i = 0; i < lbMaxStarted; i++)
		if (!lb_settle(&s->data_req[i])) leak = 1;
	if (!leak) lb_state_release(s);
}

static int lb_agree_start(MPI_Comm c, lb_state *s, int n) {
	return MPI_Iallreduce(MPI_IN_PLACE, s->agree, n, MPI_INT64_T, MPI_MAX, c, &s->agree_req);
}
// The data collectives a Starter starts on bytes, in request slot i of s.
static int lb_ialltoall(MPI_Comm c, lb_state *s, int i, void *send, void *recv, int count) {
	return MPI_Ialltoall(send, count, MPI_BYTE, recv, count, MPI_BYTE, c, &s->data_req[i]);
}
static int lb_iallgather(MPI_Comm c, lb_state *s, int i, void *send, void *recv, int count) {
	return MPI_Iallgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, c, &s->data_req[i]);
}
// opal_progress_set_yield_when_idle is Open MPI's switch of the
// sched_yield its progress engine makes after a poll that found nothing to
// do (mpi_yield_when_idle, set where ranks outnumber cores), returning the
// previous setting. Weak: an MPI without it links and runs, only yielding.
extern _Bool opal_progress_set_yield_when_idle(_Bool) __attribute__((weak));

// lb_data_test tests a started collective without that yield: the caller
// is not waiting but working between tests, and a yield there hands its
// core to another rank in the middle of its pass.
static int lb_data_test(lb_state *s, int i) {
	s->data_done = 0;
	_Bool y = 0;
	if (opal_progress_set_yield_when_idle) y = opal_progress_set_yield_when_idle(0);
	int rc = MPI_Test(&s->data_req[i], &s->data_done, MPI_STATUS_IGNORE);
	if (opal_progress_set_yield_when_idle) opal_progress_set_yield_when_idle(y);
	return rc;
}
// lb_set_yield sets the yield of opal_progress_set_yield_when_idle and
// returns the previous setting, or -1 where the MPI has no such switch.
static int lb_set_yield(int on) {
	if (!opal_progress_set_yield_when_idle) return -1;
	return opal_progress_set_yield_when_idle(on != 0);
}
static int lb_data_wait(lb_state *s, int i) { return MPI_Wait(&s->data_req[i], MPI_STATUS_IGNORE); }
// lb_agree_test tests the agreement; with yield 0 it does so without the
// yield of a poll that finds nothing to do, as lb_data_test does: the
// caller of a started tiny all-gather (comm/mpi's startTiny) works between
// its polls.
static int lb_agree_test(lb_state *s, int yield) {
	s->agree_done = 0;
	_Bool y = 0;
	if (!yield && opal_progress_set_yield_when_idle) y = opal_progress_set_yield_when_idle(0);
	int rc = MPI_Test(&s->agree_req, &s->agree_done, MPI_STATUS_IGNORE);
	if (!yield && opal_progress_set_yield_when_idle) opal_progress_set_yield_when_idle(y);
	return rc;
}

// lb_answer answers the roll calls that have come in: the rank is waiting
// in call seq, of kind.
static int lb_answer(lb_state *s, int64_t seq, int64_t kind) {
	for (int k = 0; k < s->size; k++) {
		int flag = 0;
		MPI_Status st;
		int rc = MPI_Iprobe(MPI_ANY_SOURCE, lbTagAsk, s->side, &flag, &st);
		if (rc != MPI_SUCCESS || !flag) return rc;
		int j = st.MPI_SOURCE;
		rc = MPI_Recv(s->in_ask, lbMsgLen, MPI_INT64_T, j, lbTagAsk, s->side, MPI_STATUS_IGNORE);
		if (rc != MPI_SUCCESS) return rc;
		if (!lb_settle(&s->ans_req[j])) continue; // the last answer to j is still on its way
		int64_t *m = s->ans + (size_t)j * lbMsgLen;
		m[0] = s->in_ask[0];
		m[1] = seq;
		m[2] = kind;
		rc = MPI_Isend(m, lbMsgLen, MPI_INT64_T, j, lbTagAnswer, s->side, &s->ans_req[j]);
		if (rc != MPI_SUCCESS) return rc;
	}
	return MPI_SUCCESS;
}

// lb_ask asks every other rank which call it is waiting in, for call seq.
static int lb_ask(lb_state *s, int64_t seq) {
	for (int j = 0; j < s->size; j++) {
		if (j == s->rank || !lb_settle(&s->ask_req[j])) continue;
		int64_t *m = s->ask + (size_t)j * lbMsgLen;
		m[0] = seq;
		int rc = MPI_Isend(m, lbMsgLen, MPI_INT64_T, j, lbTagAsk, s->side, &s->ask_req[j]);
		if (rc != MPI_SUCCESS) return rc;
	}
	return MPI_SUCCESS;
}

// lb_collect copies each answer to the roll call for call seq received so
// far into got[j*lbMsgLen...] for its rank j, dropping stale answers.
static int lb_collect(lb_state *s, int64_t seq, int64_t *got) {
	for (;;) {
		int flag = 0;
		MPI_Status st;
		int rc = MPI_Iprobe(MPI_ANY_SOURCE, lbTagAnswer, s->side, &flag, &st);
		if (rc != MPI_SUCCESS || !flag) return rc;
		int j = st.MPI_SOURCE;
		rc = MPI_Recv(s->in_ans, lbMsgLen, MPI_INT64_T, j, lbTagAnswer, s->side, MPI_STATUS_IGNORE);
		if (rc != MPI_SUCCESS) return rc;
		if (s->in_ans[0] != seq) continue;
		for (int i = 0; i < lbMsgLen; i++) got[(size_t)j * lbMsgLen + i] = s->in_ans[i];
	}
}
*/
import "C"

import (
	"unsafe"
)

// handle is an MPI communicator handle.
type handle = C.MPI_Comm

// Data types and operators of the C layer.
const (
	tFloat = C.lbFloat
	tByte  = C.lbByte
	tInt64 = C.lbInt64

	opSum = C.lbSum
	opMax = C.lbMax
)

// maxCount is the largest element count one MPI call takes (a C int).
const maxCount = 1<<31 - 1

// ptr returns the address of s's first element for C (nil for an empty
// slice). The memory holds no Go pointers, so cgo allows passing it.
func ptr[T byte | float32 | int64 | int32](s []T) unsafe.Pointer {
	if len(s) == 0 {
		return nil
	}
	return unsafe.Pointer(unsafe.SliceData(s))
}

func cints(s []int32) *C.int { return (*C.int)(ptr(s)) }

// errorString returns MPI's message for an error code.
func errorString(code C.int) string {
	var b [C.MPI_MAX_ERROR_STRING + 1]C.char
	C.lb_error_string(code, &b[0], C.int(len(b)))
	return C.GoString(&b[0])
}

// mpiError wraps a failed MPI call's code, nil for MPI_SUCCESS.
func mpiError(fn string, rc C.int) error {
	if rc == C.MPI_SUCCESS {
		return nil
	}
	return &Error{Func: fn, Code: int(rc), Msg: errorString(rc)}
}

// The Go side of the C layer. Calls on communicators take the package's
// serialization lock (a no-op under MPI_THREAD_MULTIPLE); setup calls run
// with env.mu held.

func mpiInitialized() bool { return C.lb_initialized() != 0 }
func mpiFinalized() bool   { return C.lb_finalized() != 0 }

// mpiInit calls MPI_Init_thread asking for MPI_THREAD_MULTIPLE and returns
// the level provided.
func mpiInit() (int, error) {
	var p C.int
	err := mpiError("MPI_Init_thread", C.lb_init(&p))
	return int(p), err
}

func mpiQueryThread() (int, error) {
	var p C.int
	err := mpiError("MPI_Query_thread", C.lb_query_thread(&p))
	return int(p), err
}

// The thread levels Open accepts.
const (
	threadSerialized = C.MPI_THREAD_SERIALIZED
	threadMultiple   = C.MPI_THREAD_MULTIPLE
)

func mpiFinalize() error { return mpiError("MPI_Finalize", C.lb_finalize()) }

func cDupWorld() (handle, error) {
	var h handle
	lock()
	rc := C.lb_dup_world(&h)
	unlock()
	return h, mpiError("MPI_Comm_dup", rc)
}

// cSetup sets MPI_ERRORS_RETURN on h and returns its rank and size.
func cSetup(h handle) (rank, size int, err error) {
	var r, s C.int
	lock()
	defer unlock()
	if err := mpiError("MPI_Comm_set_errhandler", C.lb_set_errhandler(h)); err != nil {
		return 0, 0, err
	}
	if err := mpiError("MPI_Comm_rank", C.lb_rank_size(h, &r, &s)); err != nil {
		return 0, 0, err
	}
	return int(r), int(s), nil
}

func cFree(h *handle) error {
	lock()
	defer unlock()
	return mpiError("MPI_Comm_free", C.lb_free(h))
}

// cAllReduce is MPI_Allreduce in place on n elements of type t at p; with
// divisor > 1 (t must then be tFloat) it divides the result by divisor
// afterwards, in the same cgo call (comm.Mean).
func cAllReduce(h handle, p unsafe.Pointer, n int, t, op, divisor int) error {
	lock()
	rc := C.lb_allreduce(h, p, C.int(n), C.int(t), C.int(op), C.int(divisor))
	unlock()
	return mpiError("MPI_Allreduce", rc)
}

// cReduceScatterBlock is MPI_Reduce_scatter_block, with cAllReduce's
// divisor.
func cReduceScatterBlock(h handle, send, recv []float32, op, divisor int) error {
	lock()
	rc := C.lb_reduce_scatter_block(h, ptr(send), ptr(recv), C.int(len(recv)), C.int(op), C.int(divisor))
	unlock()
	return mpiError("MPI_Reduce_scatter_block", rc)
}

// cDivide divides every element of x by n in C (lb_divide), bit for bit
// as divide does, several times faster.
func cDivide(x []float32, n int) {
	if len(x) > 0 {
		C.lb_divide((*C.float)(ptr(x)), C.size_t(len(x)), C.int(n))
	}
}

func cAllGather(h handle, send, recv unsafe.Pointer, n int, t int) error {
	lock()
	rc := C.lb_allgather(h, send, recv, C.int(n), C.int(t))
	unlock()
	return mpiError("MPI_Allgather", rc)
}

func cAllGathervInPlace(h handle, buf []float32, counts, displs []int32) error {
	lock()
	rc := C.lb_allgatherv_inplace(h, ptr(buf), cints(counts), cints(displs), tFloat)
	unlock()
	return mpiError("MPI_Allgatherv", rc)
}

func cAllToAll(h handle, send, recv unsafe.Pointer, n int, t int) error {
	lock()
	rc := C.lb_alltoall(h, send, recv, C.int(n), C.int(t))
	unlock()
	return mpiError("MPI_Alltoall", rc)
}

func cAllToAllv(h handle, send []float32, scounts, sdispls []int32, recv []float32, rcounts, rdispls []int32) error {
	lock()
	rc := C.lb_alltoallv(h, ptr(send), cints(scounts), cints(sdispls), ptr(recv), cints(rcounts), cints(rdispls), tFloat)
	unlock()
	return mpiError("MPI_Alltoallv", rc)
}

func cBcast(h handle, p unsafe.Pointer, n int, t int, root int) error {
	lock()
	rc := C.lb_bcast(h, p, C.int(n), C.int(t), C.int(root))
	unlock()
	return mpiError("MPI_Bcast", rc)
}

// cSplit calls MPI_Comm_split; ok is false for MPI_COMM_NULL (a negative
// color).
func cSplit(h handle, color, key int) (nh handle, ok bool, err error) {
	lock()
	rc := C.lb_split(h, C.int(color), C.int(key), &nh)
	unlock()
	if err := mpiError("MPI_Comm_split", rc); err != nil {
		return nh, false, err
	}
	return nh, C.lb_is_null(nh) == 0, nil
}

// cSplitShared calls MPI_Comm_split_type with MPI_COMM_TYPE_SHARED: the
// ranks that can share memory, that is, the ranks of one machine.
func cSplitShared(h handle, key int) (nh handle, err error) {
	lock()
	rc := C.lb_split_shared(h, C.int(key), &nh)
	unlock()
	return nh, mpiError("MPI_Comm_split_type", rc)
}

// abortJob aborts the MPI job with code; it does not return. It takes no
// lock: another goroutine may be blocked in a collective.
func abortJob(code int) {
	C.lb_abort(C.int(code))
}

// cWorldRanks returns the rank in MPI_COMM_WORLD of each of the n ranks of
// h.
func cWorldRanks(h handle, n int) ([]int, error) {
	out := make([]int32, n)
	lock()
	rc := C.lb_world_ranks(h, C.int(n), cints(out))
	unlock()
	if err := mpiError("MPI_Group_translate_ranks", rc); err != nil {
		return nil, err
	}
	ranks := make([]int, n)
	for i, r := range out {
		ranks[i] = int(r)
	}
	return ranks, nil
}

// cstate is a communicator's C-allocated state (see lb_state).
type cstate = *C.lb_state

// msgLen is the length of a roll-call message.
const msgLen = C.lbMsgLen

// cStateNew duplicates h for the roll call and allocates the state, with an
// agreement vector of n elements.
func cStateNew(h handle, n int) (cstate, error) {
	var s cstate
	lock()
	rc := C.lb_state_new(h, C.int(n), &s)
	unlock()
	return s, mpiError("MPI_Comm_dup", rc)
}

// agreeVec returns the agreement vector of s, in C memory.
func agreeVec(s cstate, n int) []int64 {
	return unsafe.Slice((*int64)(unsafe.Pointer(s.agree)), n)
}

// cStateFree frees s, except what MPI may still use (see lb_state_free).
func cStateFree(s cstate) {
	lock()
	C.lb_state_free(s)
	unlock()
}

// cAgreeStart starts the MPI_MAX allreduce of the agreement vector of s (n
// elements) over h.
func cAgreeStart(h handle, s cstate, n int) error {
	lock()
	rc := C.lb_agree_start(h, s, C.int(n))
	unlock()
	return mpiError("MPI_Iallreduce", rc)
}

// cAgreeTest reports whether the agreement cAgreeStart started is done;
// with yield false its poll keeps the core (lb_agree_test).
func cAgreeTest(s cstate, yield bool) (bool, error) {
	y := C.int(0)
	if yield {
		y = 1
	}
	lock()
	rc := C.lb_agree_test(s, y)
	done := s.agree_done != 0
	unlock()
	return done, mpiError("MPI_Test", rc)
}

// cAnswer answers the roll calls that have come in with the call this rank
// is waiting in.
func cAnswer(s cstate, seq int64, kind int) error {
	lock()
	rc := C.lb_answer(s, C.int64_t(seq), C.int64_t(kind))
	unlock()
	return mpiError("MPI_Iprobe", rc)
}

// cAsk starts a roll call for call seq. It runs on the watchdog's
// goroutine, which must not wait for the serialization lock behind a
// collective that hangs.
func cAsk(s cstate, seq int64) error {
	if !tryLock(rollCallLockWait) {
		return errLockBusy
	}
	rc := C.lb_ask(s, C.int64_t(seq))
	unlock()
	return mpiError("MPI_Isend", rc)
}

// cCollect copies the answers to the roll call for call seq received so
// far into got (msgLen elements per rank).
func cCollect(s cstate, seq int64, got []int64) error {
	if !tryLock(rollCallLockWait) {
		return errLockBusy
	}
	rc := C.lb_collect(s, C.int64_t(seq), (*C.int64_t)(unsafe.Pointer(unsafe.SliceData(got))))
	unlock()
	return mpiError("MPI_Iprobe", rc)
}

// maxStarted is the most started collectives a communicator has in
// flight at once.
const maxStarted = C.lbMaxStarted

// The watchdog takes every started collective in flight with its first.
var _ [alsoMax - maxStarted]struct{}

// cIAllToAll starts MPI_Ialltoall of count bytes per rank over h, its
// request kept in slot i of s. The buffers must stay pinned until it is
// done.
func cIAllToAll(h handle, s cstate, i int, send, recv unsafe.Pointer, count int) error {
	lock()
	rc := C.lb_ialltoall(h, s, C.int(i), send, recv, C.int(count))
	unlock()
	return mpiError("MPI_Ialltoall", rc)
}

// cIAllGather is cIAllToAll for MPI_Iallgather.
func cIAllGather(h handle, s cstate, i int, send, recv unsafe.Pointer, count int) error {
	lock()
	rc := C.lb_iallgather(h, s, C.int(i), send, recv, C.int(count))
	unlock()
	return mpiError("MPI_Iallgather", rc)
}

// cDataTest progresses the data collectives started in s and reports
// whether the one in slot i is done.
func cDataTest(s cstate, i int) (bool, error) {
	lock()
	rc := C.lb_data_test(s, C.int(i))
	done := s.data_done != 0
	unlock()
	return done, mpiError("MPI_Test", rc)
}

// cSetYield sets whether Open MPI's progress engine yields the core after
// a poll that found nothing to do, and returns the previous setting (1 or
// 0), or -1 where the MPI has no such switch.
func cSetYield(on bool) int {
	v := C.int(0)
	if on {
		v = 1
	}
	lock()
	defer unlock()
	return int(C.lb_set_yield(v))
}

// cDataWait waits for the data collective started in slot i of s. Under
// MPI_THREAD_SERIALIZED it holds the serialization lock until the
// collective is done, as a blocking collective does.
func cDataWait(s cstate, i int) error {
	lock()
	rc := C.lb_data_wait(s, C.int(i))
	unlock()
	return mpiError("MPI_Wait", rc)
}
