/* buckets.c - shape buckets around a compiled function's calls: kl_fn_call
 * pads a batch up to the nearest bucket and cuts the outputs back
 * (kl_compile_opts.buckets), and kl_fn_warmup calls every bucket ahead of the
 * first request. The call itself is capture.c's kl__fn_call.
 */
#include <stdlib.h>
#include <string.h>

#include "capture/capture.h"

/* The batch of a call of bucketed f: *b (-1: no batched input given) and
 * *first, the first batched input; the batched inputs must agree. */
static kl_status batch_of(kl_fn *f, const char *api, kl_tensor *const *in, int64_t *b,
                          int *first)
{
	kl_ctx *ctx = f->ctx;
	*b = -1;
	*first = -1;
	for (int i = 0; i < f->nin; i++) {
		int d = f->bk_in[i];
		if (d < 0 || !in[i])
			continue;
		if (d >= in[i]->ndim)
			return kl__err(ctx, KL_EINVAL, "%s: %s: input %d has %d dims; its batch dim "
			               "(bucket_in_dims) is %d", api, f->name, i, in[i]->ndim, d);
		if (*first < 0) {
			*first = i;
			*b = in[i]->shape[d];
		} else if (in[i]->shape[d] != *b) {
			return kl__err(ctx, KL_EINVAL, "%s: %s: batch dims differ: input %d dim %d is "
			               "%lld, input %d dim %d is %lld", api, f->name, *first,
			               f->bk_in[*first], (long long)*b, i, d,
			               (long long)in[i]->shape[d]);
		}
	}
	return KL_OK;
}

/* Shape buckets: pad the batched inputs up to the nearest bucket, call, and
 * cut the batched outputs back to the call's batch (views). */
kl_status kl_fn_call(kl_fn *f, kl_tensor *const *in, kl_tensor **out)
{
	if (!f || !f->nbk || !in || (f->nout > 0 && !out) || f->ctx->trace)
		return kl__fn_call(f, in, out);
	kl_ctx *ctx = f->ctx;
	for (int j = 0; j < f->nout; j++)
		out[j] = NULL;
	int64_t b = -1;
	int first = -1;
	kl_status bs = batch_of(f, "kl_fn_call", in, &b, &first);
	if (bs != KL_OK)
		return bs;
	if (first < 0)
		return kl__fn_call(f, in, out);
	int k = 0;
	while (k < f->nbk && f->bk[k] < b)
		k++;
	if (k == f->nbk)
		return kl__err(ctx, KL_EINVAL, "kl_fn_call: %s: batch %lld (input %d dim %d) is "
		               "above the largest bucket %lld: add a bucket or split the batch",
		               f->name, (long long)b, first, f->bk_in[first],
		               (long long)f->bk[f->nbk - 1]);
	int64_t B = f->bk[k];
	if (B == b)
		return kl__fn_call(f, in, out);
	kl_tensor **pin = calloc((size_t)(f->nin ? f->nin : 1), sizeof *pin);
	kl_tensor **pout = calloc((size_t)(f->nout ? f->nout : 1), sizeof *pout);
	kl_status st = pin && pout ? KL_OK : kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	int scopes = ctx->nscopes;
	kl_scope_begin(ctx);
	if (ctx->nscopes != scopes + 1)
		st = kl_last_status(ctx);
	for (int i = 0; st == KL_OK && i < f->nin; i++) {
		int d = f->bk_in[i];
		pin[i] = in[i];
		if (d < 0 || !in[i])
			continue;
		int64_t sh[KL_MAX_DIMS];
		memcpy(sh, in[i]->shape, sizeof sh);
		sh[d] = B - b;
		kl_tensor *parts[2] = {in[i], kl_zeros(ctx, in[i]->dtype, in[i]->ndim, sh)};
		if (!parts[1] || !(pin[i] = kl_concat(2, parts, d)))
			st = kl_last_status(ctx);
	}
	if (st == KL_OK)
		st = kl__fn_call(f, pin, pout);
	for (int j = 0; st == KL_OK && j < f->nout; j++) {
		int d = f->bk_out[j];
		if (d < 0) {
			out[j] = pout[j];
			pout[j] = NULL;
			continue;
		}
		if (d >= pout[j]->ndim || pout[j]->shape[d] != B) {
			char sh[128];
			st = kl__err(ctx, KL_EINVAL, "kl_fn_call: %s: output %d is %s; its batch dim "
			             "(bucket_out_dims) %d should be the bucket %lld", f->name, j,
			             kl__shape_str(sh, sizeof sh, pout[j]->ndim, pout[j]->shape), d,
			             (long long)B);
			break;
		}
		out[j] = kl_retain(kl_slice(pout[j], d, 0, b, 1));
		if (!out[j])
			st = kl_last_status(ctx);
	}
	for (int j = 0; pout && j < f->nout; j++)
		kl_release(pout[j]);
	kl_scope_end(ctx);
	if (st != KL_OK)
		for (int j = 0; out && j < f->nout; j++) {
			kl_release(out[j]);
			out[j] = NULL;
		}
	else
		f->padded_calls++;
	free(pin);
	free(pout);
	return st;
}

kl_status kl_fn_warmup(kl_fn *f, kl_tensor *const *in, int64_t max_batch)
{
	if (!f)
		return kl__err(NULL, KL_EINVAL, "kl_fn_warmup: f is NULL");
	kl_ctx *ctx = f->ctx;
	if (!f->nbk)
		return kl__err(ctx, KL_EINVAL, "kl_fn_warmup: %s has no buckets "
		               "(kl_compile_opts.nbuckets)", f->name);
	if (f->nin > 0 && !in)
		return kl__err(ctx, KL_EINVAL, "kl_fn_warmup: in is NULL");
	if (ctx->trace)
		return kl__err(ctx, KL_ESTATE, "kl_fn_warmup: called inside a trace");
	for (int i = 0; i < f->nin; i++)
		if (!in[i] || in[i]->ctx != ctx || !in[i]->st)
			return kl__err(ctx, KL_EINVAL, "kl_fn_warmup: %s: input %d is %s", f->name, i,
			               !in[i] ? "NULL" : in[i]->ctx != ctx ? "of another context"
			                                                  : "not materialized");
	int64_t b, top = f->bk[f->nbk - 1];
	int first;
	kl_status st = batch_of(f, "kl_fn_warmup", in, &b, &first);
	if (st != KL_OK)
		return st;
	if (first < 0)
		return kl__err(ctx, KL_EINVAL, "kl_fn_warmup: %s: no batched input", f->name);
	if (max_batch > top)
		return kl__err(ctx, KL_EINVAL, "kl_fn_warmup: %s: max_batch %lld is above the "
		               "largest bucket %lld", f->name, (long long)max_batch, (long long)top);
	if (max_batch <= 0)
		max_batch = top;
	/* on CUDA with CUDA graphs a bucket's first call warms its plan up, the
	 * second captures, the third replays; elsewhere one call compiles */
	bool graphs = kl__fn_graphs(f);
	int calls = graphs ? 3 : 1, nb = 0;
	long cap0 = 0, cap1 = 0;
	double ms0 = 0, ms1 = 0, t0 = kl__now_ms();
	kl_fn_stats fs;
	if (kl_fn_get_stats(f, &fs) == KL_OK) {
		cap0 = fs.graph_captures;
		ms0 = fs.capture_ms;
	}
	kl_tensor **pin = calloc((size_t)(f->nin ? f->nin : 1), sizeof *pin);
	kl_tensor **pout = calloc((size_t)(calls * (f->nout ? f->nout : 1)), sizeof *pout);
	if (!pin || !pout)
		st = kl__err(ctx, KL_ENOMEM, "kl_fn_warmup: out of memory");
	/* largest first: a batch traced at size 1 would specialise its dim */
	int hi = f->nbk - 1;
	while (hi >= 0 && f->bk[hi] > max_batch)
		hi--;
	for (int k = hi; st == KL_OK && k >= 0; k--, nb++) {
		int64_t B = f->bk[k], m = B < b ? B : b;
		int scopes = ctx->nscopes;
		kl_scope_begin(ctx);
		if (ctx->nscopes != scopes + 1) {
			st = kl_last_status(ctx);
			break;
		}
		/* each call's batched inputs and outputs are new tensors (the
		 * earlier ones alive until the bucket is done), so each call sees
		 * other addresses, as a serving loop's calls may: the capture then
		 * stages what moves instead of pinning addresses the run moves */
		for (int c = 0; st == KL_OK && c < calls; c++) {
			for (int i = 0; st == KL_OK && i < f->nin; i++) {
				int d = f->bk_in[i];
				pin[i] = in[i];
				if (d < 0)
					continue;
				int64_t sh[KL_MAX_DIMS];
				memcpy(sh, in[i]->shape, sizeof sh);
				sh[d] = B;
				kl_tensor *z = kl_zeros(ctx, in[i]->dtype, in[i]->ndim, sh);
				kl_tensor *to = z ? kl_slice(z, d, 0, m, 1) : NULL;
				kl_tensor *from = to ? kl_slice(in[i], d, 0, m, 1) : NULL;
				st = from ? kl_copy(to, from) : kl_last_status(ctx);
				pin[i] = z;
			}
			if (st == KL_OK)
				st = kl_fn_call(f, pin, pout + c * f->nout);
		}
		for (int j = 0; j < calls * f->nout; j++) {
			kl_release(pout[j]);
			pout[j] = NULL;
		}
		kl_scope_end(ctx);
	}
	free(pin);
	free(pout);
	if (st != KL_OK)
		return st;
	if (kl_fn_get_stats(f, &fs) == KL_OK) {
		cap1 = fs.graph_captures;
		ms1 = fs.capture_ms;
	}
	kl__log(ctx, KL_LOG_CUDAGRAPHS, "kl_fn_warmup: %s: %d buckets (1..%lld) in %.1f ms, %ld "
	        "CUDA graphs captured (%.2f ms capturing)", f->name, nb, (long long)max_batch,
	        kl__now_ms() - t0, cap1 - cap0, ms1 - ms0);
	return KL_OK;
}
