/* cpu.c - the CPU backend: 64-byte aligned host memory (large blocks kept for
 * reuse after a free), host copies, and exec, which checks a node's output and
 * hands it to its kernel family (pointwise, reduce, movement, matmul, rows,
 * sources).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu.h"

/* Large blocks are kept after a free and handed out again. A fresh block from
 * the system is untouched pages: the first write to each page faults and the
 * kernel zeroes it, which costs as much as the copy a pointwise op is (64 MiB:
 * 16384 faults). A program that calls the same graph, or runs the same eager
 * ops, again and again frees and asks for the same sizes, so a few cached
 * blocks take that cost off every call but the first. Process-wide, since
 * blocks outlive no context's tensors and contexts may free on any thread. */
#define CACHE_MIN ((size_t)1 << 20)  /* smaller blocks come from malloc's own bins */
#define CACHE_CAP ((size_t)1 << 30)  /* bytes kept, at most */
#define CACHE_SLOTS 32
#define HDR 64 /* a block's size sits in front of it, one cache line */

typedef struct cached_block {
	char *base;
	size_t size;
	uint64_t age; /* the oldest goes first when the cache is full */
} cached_block;

static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static cached_block cache[CACHE_SLOTS];
static int ncached;
static size_t cached_bytes;
static uint64_t cache_clock;

/* The smallest cached block of at least sz and at most sz + sz / 8 bytes. */
static char *cache_take(size_t sz)
{
	char *got = NULL;
	pthread_mutex_lock(&cache_mu);
	int best = -1;
	for (int i = 0; i < ncached; i++)
		if (cache[i].size >= sz && cache[i].size - sz <= sz / 8 &&
		    (best < 0 || cache[i].size < cache[best].size))
			best = i;
	if (best >= 0) {
		got = cache[best].base;
		cached_bytes -= cache[best].size;
		cache[best] = cache[--ncached];
	}
	pthread_mutex_unlock(&cache_mu);
	return got;
}

/* Keeps base (of size bytes) unless it is too big; the oldest blocks make room. */
static void cache_put(char *base, size_t size)
{
	char *drop[CACHE_SLOTS + 1];
	int ndrop = 0;
	pthread_mutex_lock(&cache_mu);
	if (size > CACHE_CAP / 2) {
		drop[ndrop++] = base;
	} else {
		while (ncached && (ncached == CACHE_SLOTS || cached_bytes + size > CACHE_CAP)) {
			int old = 0;
			for (int i = 1; i < ncached; i++)
				if (cache[i].age < cache[old].age)
					old = i;
			drop[ndrop++] = cache[old].base;
			cached_bytes -= cache[old].size;
			cache[old] = cache[--ncached];
		}
		cache[ncached++] = (cached_block){base, size, ++cache_clock};
		cached_bytes += size;
	}
	pthread_mutex_unlock(&cache_mu);
	for (int i = 0; i < ndrop; i++)
		free(drop[i]);
}

static void *cpu_alloc(kl_ctx *ctx, size_t nbytes)
{
	/* a whole number of cache lines: vector loops may read a line's tail */
	size_t sz = (nbytes + 63) & ~(size_t)63;
	if (sz < nbytes || sz > SIZE_MAX - HDR)
		return NULL;
	if (!sz)
		sz = 64;
	char *base = sz >= CACHE_MIN ? cache_take(sz) : NULL;
	if (!base) {
		void *p = NULL;
		if (posix_memalign(&p, 64, sz + HDR) != 0) {
			kl__err(ctx, KL_ENOMEM, "cpu: out of memory allocating %zu bytes", nbytes);
			return NULL;
		}
		base = p;
		memcpy(base, &sz, sizeof(sz));
	} else {
		memcpy(&sz, base, sizeof(sz)); /* a cached block may be a little larger */
	}
	ctx->host_in_use += sz;
	if (ctx->host_in_use > ctx->host_peak)
		ctx->host_peak = ctx->host_in_use;
	return base + HDR;
}

static void cpu_free(kl_ctx *ctx, void *p)
{
	if (!p)
		return;
	char *base = (char *)p - HDR;
	size_t sz;
	memcpy(&sz, base, sizeof(sz));
	ctx->host_in_use -= sz < ctx->host_in_use ? sz : ctx->host_in_use;
	if (sz >= CACHE_MIN)
		cache_put(base, sz);
	else
		free(base);
}

/* The counters live in the context: the block cache is shared by every
 * context of the process, so what a context holds is what it asked for. */
static void cpu_memory(kl_ctx *ctx, kl_memory_usage *out, bool reset_peak)
{
	if (reset_peak)
		ctx->host_peak = ctx->host_in_use;
	*out = (kl_memory_usage){ctx->host_in_use, ctx->host_peak, ctx->host_in_use};
}

static kl_status cpu_copy(kl_ctx *ctx, void *dst, const void *src, size_t nbytes)
{
	if (nbytes)
		memcpy(dst, src, nbytes);
	return KL_OK;
}

static kl_status cpu_exec(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	if (!n || n->op >= KL_NOPS)
		return kl__err(ctx, KL_EINVAL, "cpu exec: op %d is not in the op table",
		               n ? (int)n->op : -1);
	const char *name = kl__cpu_opname(n);
	if (n->dtype >= KL_NDTYPES || n->ndim > KL_MAX_DIMS || n->nin > KL_NODE_MAX_IN)
		return kl__err(ctx, KL_EINVAL, "kl_%s: malformed node (dtype %d, %d dims, %d "
		               "inputs)", name, (int)n->dtype, (int)n->ndim, (int)n->nin);
	if (!out || !out->st || out->dtype != n->dtype || out->ndim != n->ndim)
		return kl__err(ctx, KL_EINVAL, "kl_%s: output tensor does not match the node",
		               name);
	for (int d = 0; d < n->ndim; d++)
		if (out->shape[d] != n->shape[d])
			return kl__err(ctx, KL_EINVAL, "kl_%s: output dim %d is %lld, node has "
			               "%lld", name, d, (long long)out->shape[d],
			               (long long)n->shape[d]);
	if (!kl__strides_contiguous(out->ndim, out->shape, out->strides))
		return kl__err(ctx, KL_EINVAL, "kl_%s: output tensor is not dense", name);
	for (int k = 0; k < n->nin; k++) {
		if (!in || !in[k] || !in[k]->st)
			return kl__err(ctx, KL_EINVAL, "kl_%s: input %d is not materialized", name,
			               k);
		if (in[k]->dtype >= KL_NDTYPES)
			return kl__err(ctx, KL_EUNSUPPORTED, "kl_%s: input %d has unknown dtype %d",
			               name, k, (int)in[k]->dtype);
	}
	switch (kl__ops[n->op].cat) {
	case KL_CAT_BINARY:
	case KL_CAT_COMPARE:
	case KL_CAT_UNARY:
	case KL_CAT_UNARY_FLOAT:
	case KL_CAT_WHERE:
		return kl__cpu_pointwise(ctx, n, in, out);
	case KL_CAT_REDUCE:
		return kl__cpu_reduce(ctx, n, in, out);
	case KL_CAT_CONTRACT:
		return kl__cpu_matmul(ctx, n, in, out);
	case KL_CAT_COMPOSITE:
		if (n->op == KL_OP_ATTENTION)
			return kl__cpu_sdpa(ctx, n, in, out);
		if (n->op == KL_OP_ATTENTION_BWD)
			return kl__cpu_sdpa_bwd(ctx, n, in, out);
		if (n->op == KL_OP_INDEX_ADD)
			return kl__cpu_index_add(ctx, n, in, out);
		if (n->op == KL_OP_CACHE_WRITE)
			return kl__cpu_cache_write(ctx, n, in, out);
		return kl__cpu_rows(ctx, n, in, out);
	case KL_CAT_SOURCE:
		if (n->op == KL_OP_INPUT)
			break;
		return kl__cpu_source(ctx, n, in, out);
	case KL_CAT_MOVEMENT:
		if (n->op == KL_OP_CONTIGUOUS)
			return kl__cpu_contiguous(ctx, n, in, out);
		if (n->op == KL_OP_CONCAT)
			return kl__cpu_concat(ctx, n, in, out);
		if (n->op == KL_OP_GATHER)
			return kl__cpu_gather(ctx, n, in, out);
		break;
	}
	return kl__err(ctx, KL_EUNSUPPORTED, "kl_%s: not an op the cpu backend executes (views and "
	               "inputs never reach exec)", name);
}

const kl_backend kl__cpu_backend = {
	.name = "cpu",
	.alloc = cpu_alloc,
	.free = cpu_free,
	.exec = cpu_exec,
	.to_host = cpu_copy,
	.from_host = cpu_copy,
	.memory = cpu_memory,
	.synchronize = NULL, /* every op has finished when it returns */
	.optim_step = kl__cpu_optim_step,
};
