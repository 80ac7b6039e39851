/* inplace.c - kl_copy, the one public write into an existing tensor's memory
 * (torch's dst.copy_(src)). It bumps the storage's version counter, which is
 * how a compiled function that captured the tensor learns of the write.
 * Inside a compiled function the write is recorded in the trace and lands
 * when the graph ends (capture/trace.c: kl__trace_write, kl__write_into).
 */
#include "api/dispatch.h"

kl_status kl_copy(kl_tensor *dst, kl_tensor *src)
{
	KL_API("kl_copy");
	if (!dst || !src)
		return kl__err(dst ? dst->ctx : src ? src->ctx : NULL, KL_EINVAL,
		               "kl_copy: %s is NULL", dst ? "src" : "dst");
	kl_ctx *ctx = dst->ctx;
	char a[192], b[192];
	if (src->ctx != ctx)
		return kl__err(ctx, KL_EINVAL, "kl_copy: src belongs to another context");
	if (!dst->st)
		return kl__err(ctx, KL_ESTATE,
		               ctx->trace ? "kl_copy: dst is a lazy tensor made inside this compiled "
		                            "function; write into a tensor that existed before the "
		                            "call (or use the value itself)"
		                          : "kl_copy: dst is a lazy tensor of a finished trace");
	if (!kl__trace_holds(ctx, src))
		return kl__err(ctx, KL_ESTATE, "kl_copy: src is a lazy tensor of a finished trace");
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
	if (kl_numel(dst) == 0)
		return KL_OK;
	/* src's values as dst holds them, dense: in a trace a lazy value the
	 * write-back reads when the graph ends; eagerly a tensor that does not
	 * overlap dst, so that a src overlapping dst is read before the write */
	int scopes = ctx->nscopes;
	kl_scope_begin(ctx);
	if (ctx->nscopes != scopes + 1)
		return kl_last_status(ctx);
	bool no_grad = ctx->no_grad; /* the copy's own ops are not recorded for autograd */
	ctx->no_grad = true;
	kl_tensor *v = kl_contiguous(kl_expand(kl_cast(src, dst->dtype), dst->ndim, dst->shape));
	ctx->no_grad = no_grad;
	kl_status st = v ? KL_OK : kl_last_status(ctx);
	if (st == KL_OK && ctx->trace) {
		st = kl__trace_write(ctx, dst, v);
	} else if (st == KL_OK) {
		int64_t lo, hi, dlo, dhi;
		kl__tensor_span(v, &lo, &hi);
		kl__tensor_span(dst, &dlo, &dhi);
		if (v->st == dst->st && lo <= dhi && dlo <= hi && !(v = kl__eager_contiguous(ctx, v)))
			st = kl_last_status(ctx);
		if (st == KL_OK)
			st = kl__write_into(ctx, dst, v);
	}
	kl_scope_end(ctx);
	return st;
}
