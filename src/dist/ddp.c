/* ddp.c - data parallel training on a kl_comm: the parameters broadcast
 * from rank 0, the gradients averaged in buckets before the optimizer's
 * step (torch's DistributedDataParallel, called eagerly after kl_backward).
 *
 * A bucket is a flat tensor of consecutive parameters of one dtype, in
 * reverse order (the order a backward produces gradients), filled by
 * kl_copy into its slices, all-reduced (mean) as one collective, and copied
 * back into each .grad. Public API only, so the same code runs on either
 * backend (on NCCL the bucket is device memory and the copies are the
 * device's).
 */
#include "dist/dist.h"

#include <stdlib.h>
#include <string.h>

typedef struct ddp_bucket {
	int first, count; /* params[first .. first+count) */
	int64_t numel;
	kl_tensor *flat;  /* [numel] in the parameters' dtype */
} ddp_bucket;

struct kl_ddp {
	kl_comm *c;
	kl_tensor **params;
	int n;
	ddp_bucket *buckets;
	int nbuckets;
};

void kl_ddp_free(kl_ddp *d)
{
	if (!d)
		return;
	for (int i = 0; i < d->nbuckets; i++)
		kl_release(d->buckets[i].flat);
	for (int i = 0; i < d->n; i++)
		kl_release(d->params[i]);
	free(d->buckets);
	free(d->params);
	free(d);
}

int kl_ddp_buckets(const kl_ddp *d)
{
	return d ? d->nbuckets : 0;
}

/* params reversed, split into buckets of at most cap bytes (one parameter
 * larger than cap is a bucket of its own) and one dtype */
static kl_status plan_buckets(kl_ddp *d, size_t cap)
{
	d->buckets = calloc((size_t)d->n, sizeof *d->buckets);
	if (!d->buckets)
		return kl_set_error(d->c->ctx, KL_ENOMEM, "kl_ddp_new: out of memory");
	ddp_bucket *b = NULL;
	size_t bytes = 0;
	for (int i = 0; i < d->n; i++) {
		kl_tensor *p = d->params[i];
		size_t pb = (size_t)kl_numel(p) * kl_dtype_size(kl_tensor_dtype(p));
		if (!b || bytes + pb > cap ||
		    kl_tensor_dtype(d->params[b->first]) != kl_tensor_dtype(p)) {
			b = &d->buckets[d->nbuckets++];
			b->first = i;
			bytes = 0;
		}
		b->count++;
		b->numel += kl_numel(p);
		bytes += pb;
	}
	for (int i = 0; i < d->nbuckets; i++) {
		ddp_bucket *bk = &d->buckets[i];
		int64_t shape[1] = {bk->numel};
		bk->flat = kl_empty(d->c->ctx, kl_tensor_dtype(d->params[bk->first]), 1, shape);
		if (!bk->flat)
			return kl_last_status(d->c->ctx);
	}
	return KL_OK;
}

kl_ddp *kl_ddp_new(kl_comm *c, kl_tensor *const *params, int n, size_t bucket_bytes)
{
	if (!c) {
		kl_set_error(NULL, KL_EINVAL, "kl_ddp_new: communicator is NULL");
		return NULL;
	}
	if (n < 0 || (n > 0 && !params)) {
		kl_set_error(c->ctx, KL_EINVAL, "kl_ddp_new: %d parameters at %p (rank %d)", n,
		             (const void *)params, c->rank);
		return NULL;
	}
	kl_ddp *d = calloc(1, sizeof *d);
	if (d)
		d->params = calloc((size_t)n + 1, sizeof *d->params);
	if (!d || !d->params) {
		free(d);
		kl_set_error(c->ctx, KL_ENOMEM, "kl_ddp_new: out of memory");
		return NULL;
	}
	d->c = c;
	for (int i = 0; i < n; i++) {
		/* reversed: the last parameter's gradient is the first a backward makes */
		kl_tensor *p = params[n - 1 - i];
		if (!p || kl_tensor_ctx(p) != c->ctx || !kl_is_contiguous(p) ||
		    kl_tensor_dtype(p) == KL_BOOL) {
			kl_set_error(c->ctx, KL_EINVAL,
			             "kl_ddp_new: parameter %d is %s (rank %d): each must be a dense "
			             "tensor of the communicator's context",
			             n - 1 - i,
			             !p                              ? "NULL"
			             : kl_tensor_ctx(p) != c->ctx    ? "of another context"
			             : kl_tensor_dtype(p) == KL_BOOL ? "bool"
			                                             : "not contiguous",
			             c->rank);
			kl_ddp_free(d);
			return NULL;
		}
		d->params[i] = kl_retain(p);
		d->n++;
	}
	kl_status st = plan_buckets(d, bucket_bytes ? bucket_bytes : (size_t)25 << 20);
	for (int i = 0; st == KL_OK && i < d->n; i++)
		st = kl_comm_broadcast(c, d->params[i], 0);
	if (st != KL_OK) {
		kl_ddp_free(d);
		return NULL;
	}
	return d;
}

kl_status kl_ddp_sync_grads(kl_ddp *d)
{
	if (!d)
		return kl_set_error(NULL, KL_EINVAL, "kl_ddp_sync_grads: ddp is NULL");
	kl_ctx *ctx = d->c->ctx;
	for (int i = 0; i < d->n; i++) {
		kl_tensor *g = kl_grad(d->params[i]);
		if (!g) {
			char buf[64] = "";
			const int64_t *s = kl_shape(d->params[i]);
			size_t u = 0;
			for (int a = 0; a < kl_ndim(d->params[i]) && u < sizeof buf; a++)
				u += (size_t)snprintf(buf + u, sizeof buf - u, "%s%lld", a ? "," : "",
				                      (long long)s[a]);
			return kl_set_error(ctx, KL_ESTATE,
			                    "kl_ddp_sync_grads: rank %d: parameter %d [%s] has no .grad "
			                    "(call kl_backward first)",
			                    d->c->rank, d->n - 1 - i, buf);
		}
	}
	kl_status st = KL_OK;
	bool grad = kl_set_grad_enabled(ctx, false); /* nothing here goes on the tape */
	for (int b = 0; st == KL_OK && b < d->nbuckets; b++) {
		ddp_bucket *bk = &d->buckets[b];
		kl_scope_begin(ctx);
		int64_t off = 0;
		for (int i = bk->first; st == KL_OK && i < bk->first + bk->count; i++) {
			int64_t m = kl_numel(d->params[i]);
			kl_tensor *g = kl_reshape(kl_grad(d->params[i]), 1, &m);
			st = kl_copy(kl_slice(bk->flat, 0, off, off + m, 1), g);
			off += m;
		}
		if (st == KL_OK)
			st = kl_comm_all_reduce(d->c, bk->flat, KL_REDUCE_MEAN);
		off = 0;
		for (int i = bk->first; st == KL_OK && i < bk->first + bk->count; i++) {
			kl_tensor *p = d->params[i];
			int64_t m = kl_numel(p);
			kl_tensor *part = kl_reshape(kl_slice(bk->flat, 0, off, off + m, 1), kl_ndim(p),
			                             kl_shape(p));
			st = kl_copy(kl_grad(p), part);
			off += m;
		}
		kl_scope_end(ctx);
	}
	kl_set_grad_enabled(ctx, grad);
	return st;
}
