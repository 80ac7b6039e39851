/* inplace.c - kl_copy, the one public write into an existing tensor's memory
 * (torch's dst.copy_(src)). It bumps the storage's version counter, which is
 * how a compiled function that captured the tensor learns of the write.
 */
#include <stdlib.h>

#include "api/dispatch.h"

/* dst's element i (row-major over its shape) lives at element offset
 * off[i] from the start of its storage; lo/hi: the smallest and largest. */
static void span_of(const kl_tensor *t, int64_t *lo, int64_t *hi)
{
	*lo = *hi = t->offset;
	for (int d = 0; d < t->ndim; d++) {
		int64_t reach = (t->shape[d] - 1) * t->strides[d];
		if (reach < 0)
			*lo += reach;
		else
			*hi += reach;
	}
}

/* Write dense (row-major) host values into dst's memory through its strides:
 * the span of storage it covers is read, patched and written back, so one
 * path serves every device. */
static kl_status write_strided(kl_ctx *ctx, kl_tensor *dst, const unsigned char *dense)
{
	size_t es = kl_dtype_size(dst->dtype);
	int64_t lo, hi, n = kl_numel(dst);
	span_of(dst, &lo, &hi);
	size_t bytes = (size_t)(hi - lo + 1) * es;
	unsigned char *span = malloc(bytes);
	if (!span)
		return kl__err(ctx, KL_ENOMEM, "kl_copy: out of memory for %zu bytes", bytes);
	void *base = (char *)dst->st->data + (size_t)lo * es;
	kl_status st = ctx->be->to_host(ctx, span, base, bytes);
	int64_t idx[KL_MAX_DIMS] = {0};
	for (int64_t i = 0; st == KL_OK && i < n; i++) {
		int64_t at = dst->offset - lo;
		for (int d = 0; d < dst->ndim; d++)
			at += idx[d] * dst->strides[d];
		memcpy(span + (size_t)at * es, dense + (size_t)i * es, es);
		for (int d = dst->ndim - 1; d >= 0 && ++idx[d] == dst->shape[d]; d--)
			idx[d] = 0;
	}
	if (st == KL_OK)
		st = ctx->be->from_host(ctx, base, span, bytes);
	free(span);
	return st;
}

static kl_status copy_traced(kl_ctx *ctx, kl_tensor *dst, kl_tensor *src);
static kl_status copy_now(kl_ctx *ctx, kl_tensor *dst, kl_tensor *src, int64_t n);

kl_status kl_copy(kl_tensor *dst, kl_tensor *src)
{
	if (!dst || !src)
		return kl__err(dst ? dst->ctx : src ? src->ctx : NULL, KL_EINVAL,
		               "kl_copy: %s is NULL", dst ? "src" : "dst");
	kl_ctx *ctx = dst->ctx;
	char a[192], b[192];
	if (src->ctx != ctx)
		return kl__err(ctx, KL_EINVAL, "kl_copy: src belongs to another context");
	if (!kl__trace_holds(ctx, src))
		return kl__err(ctx, KL_ESTATE, "kl_copy: src is a lazy tensor of a finished trace");
	if (!dst->st)
		return kl__err(ctx, KL_ESTATE,
		               "kl_copy: dst is %s: write into a tensor that has memory (an input "
		               "or one reached through user state)",
		               ctx->trace ? "a lazy tensor computed inside this compiled function"
		                          : "a lazy tensor of a finished trace");
	kl__shape_str(a, sizeof a, dst->ndim, dst->shape);
	kl__shape_str(b, sizeof b, src->ndim, src->shape);
	bool fits = src->ndim <= dst->ndim;
	for (int d = 0; fits && d < src->ndim; d++) {
		int64_t s = src->shape[src->ndim - 1 - d], t = dst->shape[dst->ndim - 1 - d];
		fits = s == t || s == 1;
	}
	if (!fits)
		return kl__err(ctx, KL_EINVAL, "kl_copy: src %s does not broadcast to dst %s", b, a);
	for (int d = 0; d < dst->ndim; d++)
		if (dst->shape[d] > 1 && dst->strides[d] == 0)
			return kl__err(ctx, KL_EINVAL,
			               "kl_copy: dst %s (strides %s) repeats elements (a stride-0 "
			               "dim): a write to it is ambiguous",
			               a, kl__shape_str(b, sizeof b, dst->ndim, dst->strides));
	int64_t n = kl_numel(dst);
	if (n == 0)
		return KL_OK;
	/* the copy's own ops are not recorded for autograd */
	bool no_grad = ctx->no_grad;
	ctx->no_grad = true;
	kl_status st = ctx->trace ? copy_traced(ctx, dst, src) : copy_now(ctx, dst, src, n);
	ctx->no_grad = no_grad;
	if (st == KL_OK && !ctx->trace)
		kl__storage_written(dst->st);
	return st;
}

/* Inside a compiled function: src, cast and broadcast to dst, is computed
 * by the graph and written into dst when the graph ends (a graph break or
 * the end of the call), before anything after it runs. */
static kl_status copy_traced(kl_ctx *ctx, kl_tensor *dst, kl_tensor *src)
{
	kl_tensor *v = kl_expand(kl_cast(src, dst->dtype), dst->ndim, dst->shape);
	if (!v)
		return kl_last_status(ctx);
	return kl__trace_write(ctx, dst, v);
}

static kl_status copy_now(kl_ctx *ctx, kl_tensor *dst, kl_tensor *src, int64_t n)
{
	size_t nbytes = (size_t)n * kl_dtype_size(dst->dtype);
	/* src's values as dst holds them, dense, then on the host: reading them
	 * all before the write makes a src that overlaps dst safe */
	unsigned char *host = malloc(nbytes);
	if (!host)
		return kl__err(ctx, KL_ENOMEM, "kl_copy: out of memory for %zu bytes", nbytes);
	int scopes = ctx->nscopes;
	kl_scope_begin(ctx);
	if (ctx->nscopes != scopes + 1) {
		free(host);
		return kl_last_status(ctx);
	}
	kl_tensor *v = kl_contiguous(kl_expand(kl_cast(src, dst->dtype), dst->ndim, dst->shape));
	kl_status st = v ? kl_to_host(v, host, nbytes) : kl_last_status(ctx);
	kl_scope_end(ctx);
	if (st == KL_OK)
		st = kl_is_contiguous(dst) ? ctx->be->from_host(ctx, kl__tensor_data(dst), host, nbytes)
		                           : write_strided(ctx, dst, host);
	free(host);
	return st;
}
