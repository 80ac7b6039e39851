/* nccl.c - the CUDA backend of kl_comm: NCCL, loaded with dlopen
 * (libnccl.so.2) like the rest of kiln's CUDA stack, so libkiln_dist builds
 * and runs where NCCL is absent (kl_comm_init then says so).
 *
 * Rank and size come from the environment (RANK/WORLD_SIZE as torchrun
 * sets them, else OMPI_COMM_WORLD_RANK/SIZE); rank 0 makes the NCCL id and
 * hands it over TCP (MASTER_ADDR/MASTER_PORT, rendezvous.c) or writes it to
 * the rendezvous file (a temporary name, then renamed), where the others
 * poll for it up to the timeout. Collectives run on
 * the context's stream; the call waits for the stream (cuStreamQuery,
 * polled) up to the timeout and aborts the NCCL communicator past it, so a
 * missing rank is an error, never a hang. The cross-rank check of each call
 * is an all-gather of the call descriptions through NCCL itself.
 *
 * Not run on a GPU yet: it compiles here (no device); see docs/design.md.
 */
#include "dist/dist.h"

#ifdef KILN_HAVE_CUDA

#include "backend/cuda/device.h"
#include "core/core.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* NCCL's C ABI (nccl.h, stable since 2.x), declared here: the header is not
 * part of the CUDA toolkit. */
typedef struct nccl_comm *nccl_comm_t;
typedef struct {
	char internal[128];
} nccl_id;
enum { NCCL_OK = 0 };
enum { NCCL_I32 = 2, NCCL_I64 = 4, NCCL_F16 = 6, NCCL_F32 = 7, NCCL_F64 = 8, NCCL_BF16 = 9 };
enum { NCCL_SUM = 0, NCCL_AVG = 4 };

typedef struct nccl_api {
	int (*GetUniqueId)(nccl_id *);
	int (*CommInitRank)(nccl_comm_t *, int, nccl_id, int);
	int (*CommDestroy)(nccl_comm_t);
	int (*CommAbort)(nccl_comm_t);
	int (*CommGetAsyncError)(nccl_comm_t, int *);
	const char *(*GetErrorString)(int);
	int (*AllReduce)(const void *, void *, size_t, int, int, nccl_comm_t, CUstream);
	int (*Broadcast)(const void *, void *, size_t, int, int, nccl_comm_t, CUstream);
	int (*AllGather)(const void *, void *, size_t, int, nccl_comm_t, CUstream);
	int (*ReduceScatter)(const void *, void *, size_t, int, int, nccl_comm_t, CUstream);
	CUresult (*StreamQuery)(CUstream);
	CUresult (*CtxSetCurrent)(CUcontext);
} nccl_api;

struct kl_nccl {
	nccl_comm_t comm;
	CUstream stream;
	CUcontext cu;
};

static nccl_api api;
static bool api_loaded;

static kl_status load_api(kl_ctx *ctx)
{
	if (api_loaded)
		return KL_OK;
	void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
	if (!h)
		h = dlopen("libnccl.so", RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		const char *why = dlerror();
		return kl_set_error(ctx, KL_EDEVICE, "kl_comm_init: no NCCL found (libnccl.so.2: %s)",
		                    why ? why : "not found");
	}
	void *cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!cu)
		return kl_set_error(ctx, KL_EDEVICE, "kl_comm_init: no CUDA driver found (libcuda.so.1)");
	struct {
		void *lib;
		const char *name;
		void **slot;
	} syms[] = {
		{h, "ncclGetUniqueId", (void **)&api.GetUniqueId},
		{h, "ncclCommInitRank", (void **)&api.CommInitRank},
		{h, "ncclCommDestroy", (void **)&api.CommDestroy},
		{h, "ncclCommAbort", (void **)&api.CommAbort},
		{h, "ncclCommGetAsyncError", (void **)&api.CommGetAsyncError},
		{h, "ncclGetErrorString", (void **)&api.GetErrorString},
		{h, "ncclAllReduce", (void **)&api.AllReduce},
		{h, "ncclBroadcast", (void **)&api.Broadcast},
		{h, "ncclAllGather", (void **)&api.AllGather},
		{h, "ncclReduceScatter", (void **)&api.ReduceScatter},
		{cu, "cuStreamQuery", (void **)&api.StreamQuery},
		{cu, "cuCtxSetCurrent", (void **)&api.CtxSetCurrent},
	};
	for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
		void *p = dlsym(syms[i].lib, syms[i].name);
		if (!p)
			return kl_set_error(ctx, KL_EDEVICE,
			                    "kl_comm_init: %s lacks %s (NCCL 2.10 or later needed)",
			                    syms[i].lib == h ? "libnccl" : "libcuda", syms[i].name);
		memcpy(syms[i].slot, &p, sizeof p);
	}
	api_loaded = true;
	return KL_OK;
}

static bool env_rank(const char *a, const char *b, long *out)
{
	const char *s = getenv(a);
	if (!s || !*s)
		s = getenv(b);
	if (!s || !*s)
		return false;
	char *end = NULL;
	*out = strtol(s, &end, 10);
	return !*end;
}

/* MASTER_ADDR/MASTER_PORT: over TCP (rendezvous.c) */
static kl_status rendezvous_tcp(kl_comm *c, const char *addr, const char *port_s, nccl_id *id)
{
	char *end = NULL;
	long port = strtol(port_s, &end, 10);
	if (*end || port < 1 || port > 65535)
		return kl_set_error(c->ctx, KL_EINVAL, "kl_comm_init: MASTER_PORT \"%.16s\" is not a "
		                    "port (1-65535)", port_s);
	if (c->rank != 0)
		return kl__dist_tcp_fetch(c->ctx, c->rank, c->size, addr, (int)port, c->timeout_s, id,
		                          sizeof *id);
	int fd = kl__dist_tcp_listen(c->ctx, (int)port, NULL);
	if (fd < 0)
		return kl_last_status(c->ctx);
	int r = api.GetUniqueId(id);
	if (r != NCCL_OK) {
		close(fd);
		return kl_set_error(c->ctx, KL_EDEVICE, "kl_comm_init: ncclGetUniqueId: %s",
		                    api.GetErrorString(r));
	}
	return kl__dist_tcp_serve(c->ctx, fd, c->size, c->timeout_s, id, sizeof *id);
}

/* rank 0 writes the id to a file; the others wait for it */
static kl_status rendezvous(kl_comm *c, const char *path, nccl_id *id)
{
	if (c->rank == 0) {
		int r = api.GetUniqueId(id);
		if (r != NCCL_OK)
			return kl_set_error(c->ctx, KL_EDEVICE, "kl_comm_init: ncclGetUniqueId: %s",
			                    api.GetErrorString(r));
		char tmp[4096];
		if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long)getpid()) >= sizeof tmp)
			return kl_set_error(c->ctx, KL_EINVAL, "kl_comm_init: rendezvous path too long");
		FILE *f = fopen(tmp, "wb");
		bool ok = f && fwrite(id, sizeof *id, 1, f) == 1;
		ok = f && fclose(f) == 0 && ok;
		if (!ok || rename(tmp, path) != 0) {
			unlink(tmp);
			return kl_set_error(c->ctx, KL_EIO, "kl_comm_init: cannot write the rendezvous "
			                    "file %s: %s", path, strerror(errno));
		}
		return KL_OK;
	}
	double deadline = kl__dist_now() + c->timeout_s;
	int spins = 0;
	for (;;) {
		FILE *f = fopen(path, "rb");
		if (f) {
			size_t got = fread(id, 1, sizeof *id, f);
			fclose(f);
			if (got == sizeof *id)
				return KL_OK;
			return kl_set_error(c->ctx, KL_EFORMAT,
			                    "kl_comm_init: rank %d: the rendezvous file %s holds %zu "
			                    "bytes, not an NCCL id's %zu",
			                    c->rank, path, got, sizeof *id);
		}
		if (kl__dist_now() > deadline)
			return kl_set_error(c->ctx, KL_ESTATE,
			                    "kl_comm_init: rank %d of %d: rank 0 did not write the "
			                    "rendezvous file %s within %g s",
			                    c->rank, c->size, path, c->timeout_s);
		kl__dist_backoff(&spins);
	}
}

kl_status kl__nccl_init(kl_comm *c, const kl_comm_opts *opts)
{
	kl_status st = load_api(c->ctx);
	if (st != KL_OK)
		return st;
	long rank = 0, size = 0;
	if (!env_rank("RANK", "OMPI_COMM_WORLD_RANK", &rank) ||
	    !env_rank("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", &size) || size < 1 || rank < 0 ||
	    rank >= size)
		return kl_set_error(c->ctx, KL_EINVAL,
		                    "kl_comm_init: the NCCL backend needs RANK and WORLD_SIZE (as "
		                    "torchrun sets them) with 0 <= RANK < WORLD_SIZE");
	c->rank = (int)rank;
	c->size = (int)size;
	const char *path = opts->rendezvous_file ? opts->rendezvous_file : getenv("KILN_DIST_FILE");
	const char *maddr = getenv("MASTER_ADDR"), *mport = getenv("MASTER_PORT");
	bool tcp = !opts->rendezvous_file && maddr && *maddr && mport && *mport;
	if (!tcp && (!path || !*path))
		return kl_set_error(c->ctx, KL_EINVAL,
		                    "kl_comm_init: the NCCL backend needs MASTER_ADDR and MASTER_PORT "
		                    "(as torchrun sets them) or a rendezvous file "
		                    "(opts.rendezvous_file or KILN_DIST_FILE)");
	struct kl_nccl *n = calloc(1, sizeof *n);
	if (!n)
		return kl_set_error(c->ctx, KL_ENOMEM, "kl_comm_init: out of memory");
	kl_cuda_dev *d = c->ctx->backend_state;
	n->stream = d->stream;
	n->cu = d->cu;
	c->nccl = n;
	nccl_id id;
	st = tcp ? rendezvous_tcp(c, maddr, mport, &id) : rendezvous(c, path, &id);
	if (st != KL_OK)
		return st;
	api.CtxSetCurrent(n->cu);
	int r = api.CommInitRank(&n->comm, c->size, id, c->rank);
	if (r != NCCL_OK) {
		n->comm = NULL;
		return kl_set_error(c->ctx, KL_EDEVICE, "kl_comm_init: rank %d of %d: "
		                    "ncclCommInitRank: %s", c->rank, c->size, api.GetErrorString(r));
	}
	return KL_OK;
}

void kl__nccl_free(kl_comm *c)
{
	struct kl_nccl *n = c->nccl;
	if (n && n->comm) {
		if (c->broken)
			api.CommAbort(n->comm);
		else
			api.CommDestroy(n->comm);
	}
	free(n);
	c->nccl = NULL;
}

static int nccl_dtype(kl_dtype dt)
{
	switch (dt) {
	case KL_F32: return NCCL_F32;
	case KL_F64: return NCCL_F64;
	case KL_F16: return NCCL_F16;
	case KL_BF16: return NCCL_BF16;
	case KL_I32: return NCCL_I32;
	case KL_I64: return NCCL_I64;
	default: return -1;
	}
}

/* wait for the stream up to the timeout; past it the communicator aborts */
static kl_status finish(kl_comm *c, dist_kind k, const dist_call *call, int launched)
{
	struct kl_nccl *n = c->nccl;
	char a[160];
	kl__dist_call_str(call, a, sizeof a);
	if (launched != NCCL_OK)
		return kl__dist_fail(c, k, "call %s: NCCL: %s", a, api.GetErrorString(launched));
	double deadline = kl__dist_now() + c->timeout_s;
	int spins = 0;
	for (;;) {
		CUresult q = api.StreamQuery(n->stream);
		if (q == CUDA_SUCCESS)
			return KL_OK;
		int async = NCCL_OK;
		api.CommGetAsyncError(n->comm, &async);
		if (q != CUDA_ERROR_NOT_READY || async != NCCL_OK)
			return kl__dist_fail(c, k, "call %s: NCCL: %s", a,
			                     async != NCCL_OK ? api.GetErrorString(async)
			                                      : "the stream failed");
		if (kl__dist_now() > deadline)
			return kl__dist_fail(c, k,
			                     "call %s: the other ranks did not complete it within %g s "
			                     "(a rank exited or hangs); the NCCL communicator is aborted",
			                     a, c->timeout_s);
		kl__dist_backoff(&spins);
	}
}

/* every rank's call description, gathered and compared */
static kl_status check(kl_comm *c, dist_kind k, const dist_call *call)
{
	if (c->size == 1)
		return KL_OK;
	int64_t one[2] = {c->size, DIST_HDR_LEN};
	kl_status st = KL_OK;
	int64_t *all = malloc((size_t)c->size * sizeof call->v);
	if (!all)
		return kl__dist_fail(c, k, "out of memory");
	kl_scope_begin(c->ctx);
	kl_tensor *mine = kl_from_host(c->ctx, KL_I64, 1, &one[1], call->v, sizeof call->v);
	kl_tensor *gathered = kl_empty(c->ctx, KL_I64, 2, one);
	if (!mine || !gathered) {
		st = kl_last_status(c->ctx);
	} else {
		int r = api.AllGather(kl__tensor_data(mine), kl__tensor_data(gathered), DIST_HDR_LEN,
		                      NCCL_I64, c->nccl->comm, c->nccl->stream);
		st = finish(c, k, call, r);
		if (st == KL_OK)
			st = kl_to_host(gathered, all, (size_t)c->size * sizeof call->v);
	}
	kl_scope_end(c->ctx);
	for (int r = 0; st == KL_OK && r < c->size; r++) {
		if (memcmp(all + (size_t)r * DIST_HDR_LEN, call->v, sizeof call->v) != 0) {
			dist_call other;
			memcpy(other.v, all + (size_t)r * DIST_HDR_LEN, sizeof other.v);
			char a[160], b[160];
			st = kl__dist_fail(c, k, "call %s, but rank %d called %s",
			                   kl__dist_call_str(call, a, sizeof a), r,
			                   kl__dist_call_str(&other, b, sizeof b));
		}
	}
	free(all);
	return st;
}

kl_status kl__nccl_run(kl_comm *c, dist_kind k, const dist_call *call, kl_tensor *in,
                       kl_tensor *out, kl_reduce_op op, int root)
{
	kl_status st = check(c, k, call);
	if (st != KL_OK || k == DIST_BARRIER)
		return st;
	if (in->st == NULL || !kl_is_contiguous(in) || in->st->device != KL_CUDA)
		return kl_set_error(c->ctx, KL_EINVAL, "%s: rank %d: NCCL needs a dense CUDA tensor",
		                    kl__dist_kind_name(k), c->rank);
	int dt = nccl_dtype(kl_tensor_dtype(in));
	struct kl_nccl *n = c->nccl;
	void *src = kl__tensor_data(in);
	void *dst = out ? kl__tensor_data(out) : src;
	size_t count = (size_t)kl_numel(in);
	int ro = op == KL_REDUCE_MEAN ? NCCL_AVG : NCCL_SUM;
	int r;
	switch (k) {
	case DIST_ALL_REDUCE: r = api.AllReduce(src, dst, count, dt, ro, n->comm, n->stream); break;
	case DIST_BROADCAST: r = api.Broadcast(src, dst, count, dt, root, n->comm, n->stream); break;
	case DIST_ALL_GATHER: r = api.AllGather(src, dst, count, dt, n->comm, n->stream); break;
	default:
		r = api.ReduceScatter(src, dst, count / (size_t)c->size, dt, ro, n->comm, n->stream);
		break;
	}
	st = finish(c, k, call, r);
	if (st == KL_OK)
		kl__storage_written(out ? out->st : in->st);
	return st;
}

#else /* !KILN_HAVE_CUDA */

kl_status kl__nccl_init(kl_comm *c, const kl_comm_opts *opts)
{
	(void)opts;
	return kl_set_error(c->ctx, KL_EUNSUPPORTED,
	                    "kl_comm_init: this kiln was built without CUDA: no NCCL backend");
}

void kl__nccl_free(kl_comm *c)
{
	(void)c;
}

kl_status kl__nccl_run(kl_comm *c, dist_kind k, const dist_call *call, kl_tensor *in,
                       kl_tensor *out, kl_reduce_op op, int root)
{
	(void)call, (void)in, (void)out, (void)op, (void)root;
	return kl_set_error(c->ctx, KL_EUNSUPPORTED, "%s: built without CUDA",
	                    kl__dist_kind_name(k));
}

#endif
