/* cpu.c - the CPU backend: 64-byte aligned host memory, host copies, and
 * exec, which checks a node's output and hands it to its kernel family
 * (pointwise, reduce, movement, matmul, rows, sources).
 */
#include <stdlib.h>

#include "backend/cpu/cpu.h"

static void *cpu_alloc(kl_ctx *ctx, size_t nbytes)
{
	/* a whole number of cache lines: vector loops may read a line's tail */
	size_t sz = (nbytes + 63) & ~(size_t)63;
	if (sz < nbytes)
		return NULL;
	void *p = NULL;
	if (posix_memalign(&p, 64, sz ? sz : 64) != 0) {
		kl__err(ctx, KL_ENOMEM, "cpu: out of memory allocating %zu bytes", nbytes);
		return NULL;
	}
	return p;
}

static void cpu_free(kl_ctx *ctx, void *p)
{
	free(p);
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
		return kl__cpu_rows(ctx, n, in, out);
	case KL_CAT_SOURCE:
		if (n->op == KL_OP_INPUT)
			break;
		return kl__cpu_source(ctx, n, out);
	case KL_CAT_MOVEMENT:
		if (n->op == KL_OP_CONTIGUOUS)
			return kl__cpu_contiguous(ctx, n, in, out);
		if (n->op == KL_OP_CONCAT)
			return kl__cpu_concat(ctx, n, in, out);
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
};
