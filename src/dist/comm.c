/* comm.c - kl_comm: joining the job, the cross-rank check of every call,
 * and the collectives on Open MPI (the CPU backend; NCCL's are nccl.c).
 *
 * Open MPI is linked, not dlopen'ed: its handles (MPI_COMM_WORLD, MPI_FLOAT,
 * MPI_SUM) are addresses of the library's own globals that mpi.h's macros
 * name, so a dlopen would have to copy one MPI's ABI by hand; it is one
 * Debian package (libopenmpi-dev), and only libkiln_dist needs it: libkiln
 * stays free of it. Data moves through host buffers (kl_to_host, then
 * kl_copy back), floats as f32 (f64 as f64), so any device and dtype works.
 *
 * Every collective first runs the check (check_call): each rank sends its
 * call description to rank 0, which waits for all of them up to the
 * timeout, compares them and sends each rank a verdict. Only then does the
 * MPI collective run, non-blocking, waited for up to the timeout too.
 */
#include "dist/dist.h"

#include <mpi.h>

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { TAG_CALL = 0x6b31, TAG_VERDICT = 0x6b32 };
enum { V_OK = 0, V_MISSING = 1, V_MISMATCH = 2 };

static int live_comms;     /* communicators of this process on MPI */
static bool mpi_started;   /* kiln called MPI_Init (so it calls MPI_Finalize) */
static bool mpi_finalized; /* MPI cannot start again in this process */

double kl__dist_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void kl__dist_backoff(int *spins)
{
	long ns = *spins < 50 ? 20000 : *spins < 500 ? 200000 : 1000000;
	struct timespec ts = {0, ns};
	(*spins)++;
	nanosleep(&ts, NULL);
}

const char *kl__dist_kind_name(dist_kind k)
{
	switch (k) {
	case DIST_ALL_REDUCE: return "kl_comm_all_reduce";
	case DIST_BROADCAST: return "kl_comm_broadcast";
	case DIST_ALL_GATHER: return "kl_comm_all_gather";
	case DIST_REDUCE_SCATTER: return "kl_comm_reduce_scatter";
	case DIST_BARRIER: return "kl_comm_barrier";
	default: return "kl_comm (unknown collective)";
	}
}

void kl__dist_call_make(dist_call *c, dist_kind k, uint64_t seq, const kl_tensor *t, int64_t arg)
{
	memset(c, 0, sizeof *c);
	c->v[0] = k;
	c->v[1] = (int64_t)seq;
	c->v[2] = t ? (int64_t)kl_tensor_dtype(t) : -1;
	c->v[3] = arg;
	int nd = t ? kl_ndim(t) : 0;
	c->v[4] = nd;
	for (int i = 0; i < nd && i < KL_MAX_DIMS; i++)
		c->v[5 + i] = kl_shape(t)[i];
}

const char *kl__dist_call_str(const dist_call *c, char *buf, size_t cap)
{
	size_t u = 0;
	int64_t k = c->v[0];
	const char *name = k > 0 && k < DIST_NKINDS ? kl__dist_kind_name((dist_kind)k) : "?";
	u += (size_t)snprintf(buf + u, cap - u, "%s #%lld", name, (long long)c->v[1]);
	if (c->v[2] >= 0 && c->v[2] < KL_NDTYPES && u < cap) {
		u += (size_t)snprintf(buf + u, cap - u, " %s [", kl_dtype_name((kl_dtype)c->v[2]));
		int64_t nd = c->v[4];
		for (int64_t i = 0; i < nd && i < KL_MAX_DIMS && u < cap; i++)
			u += (size_t)snprintf(buf + u, cap - u, "%s%lld", i ? "," : "",
			                      (long long)c->v[5 + i]);
		if (u < cap)
			u += (size_t)snprintf(buf + u, cap - u, "]");
	}
	if ((k == DIST_BROADCAST) && u < cap)
		snprintf(buf + u, cap - u, " root %lld", (long long)c->v[3]);
	else if ((k == DIST_ALL_REDUCE || k == DIST_REDUCE_SCATTER) && u < cap)
		snprintf(buf + u, cap - u, " %s", c->v[3] == KL_REDUCE_MEAN ? "mean" : "sum");
	return buf;
}

kl_status kl__dist_fail(kl_comm *c, dist_kind k, const char *fmt, ...)
{
	char msg[300];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	snprintf(c->why, sizeof c->why, "%s: rank %d of %d: %s", kl__dist_kind_name(k), c->rank,
	         c->size, msg);
	c->broken = true;
	return kl_set_error(c->ctx, KL_ESTATE, "%s", c->why);
}

/* ---- joining ------------------------------------------------------------ */

static bool env_int(const char *name, long *out)
{
	const char *s = getenv(name);
	if (!s || !*s)
		return false;
	char *end = NULL;
	long v = strtol(s, &end, 10);
	if (*end)
		return false;
	*out = v;
	return true;
}

static kl_status mpi_join(kl_comm *c)
{
	if (mpi_finalized)
		return kl_set_error(c->ctx, KL_ESTATE,
		                    "kl_comm_init: MPI was finalized when the last communicator was "
		                    "freed; it cannot start again in this process");
	int started = 0;
	MPI_Initialized(&started);
	if (!started) {
		int provided = 0;
		if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
			return kl_set_error(c->ctx, KL_EDEVICE, "kl_comm_init: MPI_Init_thread failed");
		mpi_started = true;
	}
	MPI_Comm *dup = malloc(sizeof *dup);
	if (!dup)
		return kl_set_error(c->ctx, KL_ENOMEM, "kl_comm_init: out of memory");
	/* errors come back as codes, never abort the job */
	MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
	if (MPI_Comm_dup(MPI_COMM_WORLD, dup) != MPI_SUCCESS) {
		free(dup);
		return kl_set_error(c->ctx, KL_EDEVICE, "kl_comm_init: MPI_Comm_dup failed");
	}
	MPI_Comm_set_errhandler(*dup, MPI_ERRORS_RETURN);
	MPI_Comm_rank(*dup, &c->rank);
	MPI_Comm_size(*dup, &c->size);
	c->mpi = dup;
	live_comms++;
	return KL_OK;
}

static void mpi_leave(kl_comm *c)
{
	if (!c->mpi)
		return;
	MPI_Comm *dup = c->mpi;
	MPI_Comm_free(dup);
	free(dup);
	c->mpi = NULL;
	if (--live_comms == 0 && mpi_started) {
		MPI_Finalize();
		mpi_finalized = true;
		mpi_started = false;
	}
}

kl_comm *kl_comm_init(kl_ctx *ctx, const kl_comm_opts *opts)
{
	if (!ctx) {
		kl_set_error(NULL, KL_EINVAL, "kl_comm_init: ctx is NULL");
		return NULL;
	}
	kl_comm_opts o = {0};
	if (opts)
		o = *opts;
	if (o.timeout_s < 0 || isnan(o.timeout_s)) {
		kl_set_error(ctx, KL_EINVAL, "kl_comm_init: timeout_s %g is negative", o.timeout_s);
		return NULL;
	}
	if (o.timeout_s == 0) {
		const char *s = getenv("KILN_DIST_TIMEOUT");
		char *end = NULL;
		double v = s ? strtod(s, &end) : 0;
		if (s && (*end || !(v > 0))) {
			kl_set_error(ctx, KL_EINVAL,
			             "kl_comm_init: KILN_DIST_TIMEOUT=\"%.40s\" is not a positive "
			             "number of seconds",
			             s);
			return NULL;
		}
		o.timeout_s = s ? v : 300;
	}
	if (o.backend == KL_COMM_AUTO)
		o.backend = kl_ctx_device(ctx) == KL_CUDA ? KL_COMM_NCCL : KL_COMM_MPI;
	if (o.backend != KL_COMM_MPI && o.backend != KL_COMM_NCCL) {
		kl_set_error(ctx, KL_EINVAL, "kl_comm_init: unknown backend %d", (int)o.backend);
		return NULL;
	}
	kl_comm *c = calloc(1, sizeof *c);
	if (!c) {
		kl_set_error(ctx, KL_ENOMEM, "kl_comm_init: out of memory");
		return NULL;
	}
	c->ctx = ctx;
	c->backend = o.backend;
	c->timeout_s = o.timeout_s;
	kl_status st;
	if (o.backend == KL_COMM_MPI) {
		st = mpi_join(c);
		long ws = 0, rk = 0;
		if (st == KL_OK && env_int("WORLD_SIZE", &ws) && ws != c->size) {
			st = kl_set_error(ctx, KL_EINVAL,
			                  "kl_comm_init: WORLD_SIZE=%ld but the MPI job has %d ranks "
			                  "(rank %d)",
			                  ws, c->size, c->rank);
		} else if (st == KL_OK && env_int("RANK", &rk) && rk != c->rank) {
			st = kl_set_error(ctx, KL_EINVAL,
			                  "kl_comm_init: RANK=%ld but MPI made this process rank %d of %d",
			                  rk, c->rank, c->size);
		}
	} else {
		if (kl_ctx_device(ctx) != KL_CUDA)
			st = kl_set_error(ctx, KL_EINVAL,
			                  "kl_comm_init: the NCCL backend needs a CUDA context (this one "
			                  "is on the CPU; use KL_COMM_MPI)");
		else
			st = kl__nccl_init(c, &o);
	}
	if (st != KL_OK) {
		kl_comm_free(c);
		return NULL;
	}
	return c;
}

void kl_comm_free(kl_comm *c)
{
	if (!c)
		return;
	if (c->nccl)
		kl__nccl_free(c);
	mpi_leave(c);
	free(c);
}

int kl_comm_rank(const kl_comm *c)
{
	return c ? c->rank : -1;
}

int kl_comm_size(const kl_comm *c)
{
	return c ? c->size : -1;
}

const char *kl_comm_backend_name(const kl_comm *c)
{
	return !c ? "none" : c->backend == KL_COMM_NCCL ? "nccl" : "mpi";
}

/* ---- the check of every call ---------------------------------------------- */

/* Wait for n requests until the deadline; false on timeout. Each request
 * that completed is MPI_REQUEST_NULL (MPI_Testall would leave them all
 * pending unless every one completed: rank 0 must see who arrived). */
static bool wait_until(MPI_Request *rq, int n, double deadline)
{
	int spins = 0;
	for (;;) {
		int pending = 0;
		for (int i = 0; i < n; i++) {
			int done = 0;
			if (rq[i] == MPI_REQUEST_NULL)
				continue;
			if (MPI_Test(&rq[i], &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
				return false;
			pending += !done;
		}
		if (!pending)
			return true;
		if (kl__dist_now() > deadline)
			return false;
		kl__dist_backoff(&spins);
	}
}

static void cancel_all(MPI_Request *rq, int n)
{
	for (int i = 0; i < n; i++)
		if (rq[i] != MPI_REQUEST_NULL) {
			MPI_Cancel(&rq[i]);
			MPI_Request_free(&rq[i]);
		}
}

/* verdict: code, the rank it is about, that rank's call, rank 0's call */
enum { VERDICT_LEN = 2 + 2 * DIST_HDR_LEN };

static kl_status verdict_error(kl_comm *c, dist_kind k, const dist_call *mine, const int64_t *v)
{
	char a[160], b[160];
	kl__dist_call_str(mine, a, sizeof a);
	if (v[0] == V_MISSING)
		return kl__dist_fail(c, k,
		                     "call %s: rank %lld did not reach it within %g s (it exited, "
		                     "hangs, or is in another collective)",
		                     a, (long long)v[1], c->timeout_s);
	/* the rank that differs hears what rank 0 called; the others, what it did */
	bool me = v[1] == c->rank;
	dist_call other;
	memcpy(other.v, v + 2 + (me ? DIST_HDR_LEN : 0), sizeof other.v);
	kl__dist_call_str(&other, b, sizeof b);
	return kl__dist_fail(c, k, "call %s, but rank %lld called %s", a, me ? 0LL : (long long)v[1],
	                     b);
}

static kl_status check_call(kl_comm *c, dist_kind k, const dist_call *mine)
{
	if (c->size == 1 || c->backend == KL_COMM_NCCL) /* NCCL's check is kl__nccl_run's */
		return KL_OK;
	MPI_Comm comm = *(MPI_Comm *)c->mpi;
	double deadline = kl__dist_now() + c->timeout_s;
	int64_t verdict[VERDICT_LEN];
	memset(verdict, 0, sizeof verdict);
	if (c->rank == 0) {
		int n = c->size - 1;
		dist_call *calls = calloc((size_t)n, sizeof *calls);
		MPI_Request *rq = malloc((size_t)n * sizeof *rq);
		MPI_Request *sq = malloc((size_t)n * sizeof *sq);
		if (!calls || !rq || !sq) {
			free(calls), free(rq), free(sq);
			return kl__dist_fail(c, k, "out of memory");
		}
		for (int r = 1; r < c->size; r++)
			MPI_Irecv(calls[r - 1].v, DIST_HDR_LEN, MPI_INT64_T, r, TAG_CALL, comm, &rq[r - 1]);
		wait_until(rq, n, deadline);
		for (int r = 1; r < c->size && verdict[0] == V_OK; r++) {
			if (rq[r - 1] != MPI_REQUEST_NULL) {
				verdict[0] = V_MISSING;
				verdict[1] = r;
			} else if (memcmp(calls[r - 1].v, mine->v, sizeof mine->v) != 0) {
				verdict[0] = V_MISMATCH;
				verdict[1] = r;
				memcpy(verdict + 2, calls[r - 1].v, sizeof mine->v);
				memcpy(verdict + 2 + DIST_HDR_LEN, mine->v, sizeof mine->v);
			}
		}
		int nsend = 0;
		for (int r = 1; r < c->size; r++)
			if (rq[r - 1] == MPI_REQUEST_NULL) /* arrived: it waits for the verdict */
				MPI_Isend(verdict, VERDICT_LEN, MPI_INT64_T, r, TAG_VERDICT, comm,
				          &sq[nsend++]);
		cancel_all(rq, n);
		/* a small message: sent at once unless the peer is gone */
		if (!wait_until(sq, nsend, kl__dist_now() + c->timeout_s))
			cancel_all(sq, nsend);
		free(calls), free(rq), free(sq);
		if (verdict[0] != V_OK)
			return verdict_error(c, k, mine, verdict);
		return KL_OK;
	}
	MPI_Request q[2];
	MPI_Isend((void *)mine->v, DIST_HDR_LEN, MPI_INT64_T, 0, TAG_CALL, comm, &q[0]);
	MPI_Irecv(verdict, VERDICT_LEN, MPI_INT64_T, 0, TAG_VERDICT, comm, &q[1]);
	/* rank 0 may itself wait a whole timeout for a third rank */
	if (!wait_until(q, 2, deadline + c->timeout_s)) {
		cancel_all(q, 2);
		char a[160];
		return kl__dist_fail(c, k,
		                     "call %s: rank 0, which checks every call, did not answer within "
		                     "%g s (it exited, hangs, or is in another collective)",
		                     kl__dist_call_str(mine, a, sizeof a), 2 * c->timeout_s);
	}
	if (verdict[0] != V_OK)
		return verdict_error(c, k, mine, verdict);
	return KL_OK;
}

/* ---- host staging ---------------------------------------------------------- */

/* the dtype MPI moves t's values in */
static kl_dtype wire_dtype(kl_dtype dt)
{
	return dt == KL_F64 || dt == KL_I32 || dt == KL_I64 ? dt : KL_F32;
}

static MPI_Datatype mpi_type(kl_dtype wire)
{
	switch (wire) {
	case KL_F64: return MPI_DOUBLE;
	case KL_I32: return MPI_INT32_T;
	case KL_I64: return MPI_INT64_T;
	default: return MPI_FLOAT;
	}
}

/* t's values in the wire dtype into a new buffer of `extra` times the size
 * (NULL: the error is set). */
static void *stage_in(kl_comm *c, dist_kind k, kl_tensor *t, int64_t extra, size_t *nbytes)
{
	kl_dtype w = wire_dtype(kl_tensor_dtype(t));
	size_t nb = (size_t)kl_numel(t) * kl_dtype_size(w);
	*nbytes = nb;
	char *buf = malloc(nb * (size_t)extra + 1);
	if (!buf) {
		kl_set_error(c->ctx, KL_ENOMEM, "%s: out of memory staging %zu bytes",
		             kl__dist_kind_name(k), nb * (size_t)extra);
		return NULL;
	}
	/* moving values is not part of any gradient: nothing goes on the tape */
	bool grad = kl_set_grad_enabled(c->ctx, false);
	kl_scope_begin(c->ctx);
	kl_tensor *src = kl_tensor_dtype(t) == w ? t : kl_cast(t, w);
	kl_status st = src ? kl_to_host(src, buf, nb) : kl_last_status(c->ctx);
	kl_scope_end(c->ctx);
	kl_set_grad_enabled(c->ctx, grad);
	if (st != KL_OK) {
		free(buf);
		return NULL;
	}
	return buf;
}

/* buf (wire dtype, dst's shape) into dst */
static kl_status stage_out(kl_comm *c, kl_tensor *dst, const void *buf, size_t nbytes)
{
	kl_dtype w = wire_dtype(kl_tensor_dtype(dst));
	bool grad = kl_set_grad_enabled(c->ctx, false);
	kl_scope_begin(c->ctx);
	kl_tensor *src = kl_from_host(c->ctx, w, kl_ndim(dst), kl_shape(dst), buf, nbytes);
	kl_status st = src ? kl_copy(dst, src) : kl_last_status(c->ctx);
	kl_scope_end(c->ctx);
	kl_set_grad_enabled(c->ctx, grad);
	return st;
}

static void scale_mean(void *buf, kl_dtype w, int64_t n, int size)
{
	if (w == KL_F64) {
		double *d = buf;
		for (int64_t i = 0; i < n; i++)
			d[i] /= size;
	} else if (w == KL_F32) {
		float *f = buf;
		for (int64_t i = 0; i < n; i++)
			f[i] /= (float)size;
	}
}

/* ---- the collectives ------------------------------------------------------- */

static kl_status enter(kl_comm *c, dist_kind k, kl_tensor *t, bool need_t)
{
	if (!c)
		return kl_set_error(NULL, KL_EINVAL, "%s: communicator is NULL", kl__dist_kind_name(k));
	if (c->broken)
		return kl_set_error(c->ctx, KL_ESTATE, "%s: the communicator is broken by an earlier "
		                    "error: %s", kl__dist_kind_name(k), c->why);
	if (need_t && !t)
		return kl_set_error(c->ctx, KL_EINVAL, "%s: tensor is NULL (rank %d)",
		                    kl__dist_kind_name(k), c->rank);
	if (t && kl_tensor_ctx(t) != c->ctx)
		return kl_set_error(c->ctx, KL_EINVAL,
		                    "%s: the tensor belongs to another context than the "
		                    "communicator's (rank %d)",
		                    kl__dist_kind_name(k), c->rank);
	if (t && c->backend == KL_COMM_MPI && kl_numel(t) > INT_MAX / (c->size > 0 ? c->size : 1))
		return kl_set_error(c->ctx, KL_EUNSUPPORTED,
		                    "%s: %lld elements times %d ranks pass MPI's int count (rank %d)",
		                    kl__dist_kind_name(k), (long long)kl_numel(t), c->size, c->rank);
	if (t && kl_tensor_dtype(t) == KL_BOOL)
		return kl_set_error(c->ctx, KL_EUNSUPPORTED, "%s: bool tensors are not supported "
		                    "(rank %d)", kl__dist_kind_name(k), c->rank);
	return KL_OK;
}

/* the MPI collective, waited for up to the timeout */
static kl_status mpi_wait(kl_comm *c, dist_kind k, const dist_call *call, MPI_Request *rq, int rc)
{
	char a[160];
	if (rc != MPI_SUCCESS) {
		char es[MPI_MAX_ERROR_STRING];
		int len = 0;
		MPI_Error_string(rc, es, &len);
		return kl__dist_fail(c, k, "call %s: MPI failed: %s",
		                     kl__dist_call_str(call, a, sizeof a), es);
	}
	if (!wait_until(rq, 1, kl__dist_now() + c->timeout_s)) {
		cancel_all(rq, 1);
		return kl__dist_fail(c, k, "call %s: the data did not arrive within %g s (a rank "
		                     "exited or hangs)", kl__dist_call_str(call, a, sizeof a),
		                     c->timeout_s);
	}
	return KL_OK;
}

static kl_status run_in_place(kl_comm *c, dist_kind k, kl_tensor *t, kl_reduce_op op, int root)
{
	dist_call call;
	kl__dist_call_make(&call, k, c->seq++, t, k == DIST_BROADCAST ? (int64_t)root : (int64_t)op);
	kl_status st = check_call(c, k, &call);
	if (st != KL_OK)
		return st;
	if (c->backend == KL_COMM_NCCL)
		return kl__nccl_run(c, k, &call, t, NULL, op, root);
	if (c->size == 1 || kl_numel(t) == 0)
		return KL_OK;
	size_t nb = 0;
	void *buf = stage_in(c, k, t, 1, &nb);
	if (!buf)
		return kl_last_status(c->ctx);
	kl_dtype w = wire_dtype(kl_tensor_dtype(t));
	MPI_Comm comm = *(MPI_Comm *)c->mpi;
	MPI_Request rq = MPI_REQUEST_NULL;
	int n = (int)kl_numel(t), rc;
	if (k == DIST_ALL_REDUCE)
		rc = MPI_Iallreduce(MPI_IN_PLACE, buf, n, mpi_type(w), MPI_SUM, comm, &rq);
	else
		rc = MPI_Ibcast(buf, n, mpi_type(w), root, comm, &rq);
	st = mpi_wait(c, k, &call, &rq, rc);
	if (st == KL_OK && k == DIST_ALL_REDUCE && op == KL_REDUCE_MEAN)
		scale_mean(buf, w, n, c->size);
	if (st == KL_OK)
		st = stage_out(c, t, buf, nb);
	free(buf);
	return st;
}

kl_status kl_comm_all_reduce(kl_comm *c, kl_tensor *t, kl_reduce_op op)
{
	kl_status st = enter(c, DIST_ALL_REDUCE, t, true);
	if (st != KL_OK)
		return st;
	if (op != KL_REDUCE_SUM && op != KL_REDUCE_MEAN)
		return kl_set_error(c->ctx, KL_EINVAL, "kl_comm_all_reduce: unknown op %d (rank %d)",
		                    (int)op, c->rank);
	if (op == KL_REDUCE_MEAN && kl_tensor_dtype(t) != KL_F32 && kl_tensor_dtype(t) != KL_F64 &&
	    kl_tensor_dtype(t) != KL_F16 && kl_tensor_dtype(t) != KL_BF16)
		return kl_set_error(c->ctx, KL_EINVAL,
		                    "kl_comm_all_reduce: mean of an integer tensor (%s) (rank %d)",
		                    kl_dtype_name(kl_tensor_dtype(t)), c->rank);
	return run_in_place(c, DIST_ALL_REDUCE, t, op, 0);
}

kl_status kl_comm_broadcast(kl_comm *c, kl_tensor *t, int root)
{
	kl_status st = enter(c, DIST_BROADCAST, t, true);
	if (st != KL_OK)
		return st;
	if (root < 0 || root >= c->size)
		return kl_set_error(c->ctx, KL_EINVAL,
		                    "kl_comm_broadcast: root %d is not a rank of %d (rank %d)", root,
		                    c->size, c->rank);
	return run_in_place(c, DIST_BROADCAST, t, KL_REDUCE_SUM, root);
}

kl_status kl_comm_barrier(kl_comm *c)
{
	kl_status st = enter(c, DIST_BARRIER, NULL, false);
	if (st != KL_OK)
		return st;
	dist_call call;
	kl__dist_call_make(&call, DIST_BARRIER, c->seq++, NULL, 0);
	/* every rank reached rank 0's check and got its verdict: that is a barrier */
	if (c->backend == KL_COMM_NCCL)
		return kl__nccl_run(c, DIST_BARRIER, &call, NULL, NULL, KL_REDUCE_SUM, 0);
	return check_call(c, DIST_BARRIER, &call);
}

/* all-gather and reduce-scatter: a new tensor of out_shape */
static kl_tensor *run_gather_scatter(kl_comm *c, dist_kind k, kl_tensor *t, kl_reduce_op op)
{
	int nd = kl_ndim(t);
	if (nd < 1) {
		kl_set_error(c->ctx, KL_EINVAL, "%s: a 0-dim tensor has no dim 0 to %s along (rank %d)",
		             kl__dist_kind_name(k), k == DIST_ALL_GATHER ? "gather" : "scatter",
		             c->rank);
		return NULL;
	}
	int64_t shape[KL_MAX_DIMS];
	memcpy(shape, kl_shape(t), (size_t)nd * sizeof *shape);
	if (k == DIST_REDUCE_SCATTER && shape[0] % c->size != 0) {
		kl_set_error(c->ctx, KL_EINVAL,
		             "kl_comm_reduce_scatter: dim 0 of [%lld,...] is not a multiple of the %d "
		             "ranks (rank %d)",
		             (long long)shape[0], c->size, c->rank);
		return NULL;
	}
	if (k == DIST_ALL_GATHER && shape[0] > KL_MAX_NUMEL / c->size) {
		kl_set_error(c->ctx, KL_EINVAL, "kl_comm_all_gather: dim 0 %lld times %d ranks is too "
		             "large (rank %d)", (long long)shape[0], c->size, c->rank);
		return NULL;
	}
	shape[0] = k == DIST_ALL_GATHER ? shape[0] * c->size : shape[0] / c->size;
	dist_call call;
	kl__dist_call_make(&call, k, c->seq++, t, k == DIST_REDUCE_SCATTER ? op : 0);
	if (check_call(c, k, &call) != KL_OK)
		return NULL;
	if (c->backend == KL_COMM_NCCL) {
		kl_tensor *out = kl_empty(c->ctx, kl_tensor_dtype(t), nd, shape);
		if (out && kl__nccl_run(c, k, &call, t, out, op, 0) != KL_OK) {
			kl_release(out);
			out = NULL;
		}
		return out;
	}
	size_t nb = 0;
	char *in = stage_in(c, k, t, 1, &nb);
	if (!in)
		return NULL;
	size_t onb = k == DIST_ALL_GATHER ? nb * (size_t)c->size : nb / (size_t)c->size;
	char *res = malloc(onb + 1);
	kl_dtype w = wire_dtype(kl_tensor_dtype(t));
	kl_status st;
	if (!res) {
		st = kl_set_error(c->ctx, KL_ENOMEM, "%s: out of memory", kl__dist_kind_name(k));
	} else if (c->size == 1) {
		memcpy(res, in, onb);
		st = KL_OK;
	} else {
		MPI_Comm comm = *(MPI_Comm *)c->mpi;
		MPI_Request rq = MPI_REQUEST_NULL;
		int rc, n = (int)kl_numel(t);
		if (k == DIST_ALL_GATHER)
			rc = MPI_Iallgather(in, n, mpi_type(w), res, n, mpi_type(w), comm, &rq);
		else
			rc = MPI_Ireduce_scatter_block(in, res, n / c->size, mpi_type(w), MPI_SUM, comm,
			                               &rq);
		st = mpi_wait(c, k, &call, &rq, rc);
		if (st == KL_OK && k == DIST_REDUCE_SCATTER && op == KL_REDUCE_MEAN)
			scale_mean(res, w, n / c->size, c->size);
	}
	free(in);
	kl_tensor *out = NULL;
	if (st == KL_OK && w == kl_tensor_dtype(t)) {
		/* the result is made last, so a failure leaves nothing behind */
		out = kl_from_host(c->ctx, w, nd, shape, res, onb);
	} else if (st == KL_OK) {
		kl_tensor *wide = NULL;
		bool grad = kl_set_grad_enabled(c->ctx, false);
		kl_scope_begin(c->ctx);
		if ((wide = kl_from_host(c->ctx, w, nd, shape, res, onb)))
			kl_retain(wide);
		kl_scope_end(c->ctx);
		out = wide ? kl_cast(wide, kl_tensor_dtype(t)) : NULL;
		kl_release(wide);
		kl_set_grad_enabled(c->ctx, grad);
	}
	free(res);
	return out;
}

kl_tensor *kl_comm_all_gather(kl_comm *c, kl_tensor *t)
{
	if (enter(c, DIST_ALL_GATHER, t, true) != KL_OK)
		return NULL;
	return run_gather_scatter(c, DIST_ALL_GATHER, t, KL_REDUCE_SUM);
}

kl_tensor *kl_comm_reduce_scatter(kl_comm *c, kl_tensor *t, kl_reduce_op op)
{
	if (enter(c, DIST_REDUCE_SCATTER, t, true) != KL_OK)
		return NULL;
	if (op != KL_REDUCE_SUM && op != KL_REDUCE_MEAN) {
		kl_set_error(c->ctx, KL_EINVAL, "kl_comm_reduce_scatter: unknown op %d (rank %d)",
		             (int)op, c->rank);
		return NULL;
	}
	return run_gather_scatter(c, DIST_REDUCE_SCATTER, t, op);
}
