/* tensor.c - tensor handles and their storage: reference counts, the
 * context's live list and the open scope, views, inspection, and the two
 * creation ops that always materialize at once (kl_empty, kl_from_host).
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/core.h"

static int scope_push(kl_ctx *ctx, kl_tensor *t)
{
	kl_scope *s = &ctx->scopes[ctx->nscopes - 1];
	if (s->n == s->cap) {
		int nc = s->cap ? s->cap * 2 : 32;
		kl_tensor **items = realloc(s->items, (size_t)nc * sizeof *items);
		if (!items)
			return -1;
		s->items = items;
		s->cap = nc;
	}
	s->items[s->n++] = t;
	t->scoped++;
	return 0;
}

kl_tensor *kl__tensor_new(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape)
{
	kl_tensor *t = calloc(1, sizeof *t);
	if (!t) {
		kl__err(ctx, KL_ENOMEM, "kl_tensor: out of memory");
		return NULL;
	}
	t->ctx = ctx;
	t->refs = 1;
	t->dtype = dt;
	t->ndim = ndim;
	if (ndim > 0)
		memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
	kl__contig_strides(ndim, t->shape, t->strides);
	t->node = -1;
	t->tape_node = -1;
	if (ctx->nscopes > 0 && scope_push(ctx, t)) {
		free(t);
		kl__err(ctx, KL_ENOMEM, "kl_tensor: out of memory");
		return NULL;
	}
	t->next = ctx->live;
	if (ctx->live)
		ctx->live->prev = t;
	ctx->live = t;
	return t;
}

static void tensor_destroy(kl_tensor *t)
{
	kl_ctx *ctx = t->ctx;
	if (t->prev)
		t->prev->next = t->next;
	else
		ctx->live = t->next;
	if (t->next)
		t->next->prev = t->prev;
	kl_release(t->grad);
	if (t->st && --t->st->refs == 0) {
		if (!t->st->borrowed)
			ctx->be->free(ctx, t->st->data);
		free(t->st);
	}
	free(t);
}

uint64_t kl__storage_id(void)
{
	static _Atomic uint64_t next;
	return atomic_fetch_add(&next, 1) + 1;
}

kl_tensor *kl__tensor_borrow(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, void *data,
                             size_t nbytes)
{
	kl_storage *st = calloc(1, sizeof *st);
	kl_tensor *t = st ? kl__tensor_new(ctx, dt, ndim, shape) : NULL;
	if (!t) {
		free(st);
		if (kl_last_status(ctx) == KL_OK)
			kl__err(ctx, KL_ENOMEM, "kl_tensor: out of memory");
		return NULL;
	}
	st->refs = 1;
	st->device = ctx->device;
	st->data = data;
	st->nbytes = nbytes;
	st->borrowed = true;
	st->id = kl__storage_id();
	t->st = st;
	return t;
}

kl_tensor *kl__tensor_alloc(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape)
{
	size_t nbytes;
	kl_shape_err e = kl__shape_check(ndim, shape, NULL);
	if (e != KL_SHAPE_OK || !kl__shape_nbytes(ndim, shape, kl_dtype_size(dt), &nbytes)) {
		/* callers check shapes first; this is the backstop for any that
		 * did not (a plan's output shape, say) */
		char b[192], why[128];
		kl__err(ctx, KL_EINVAL, "kl_tensor: cannot allocate %s %s: %s", kl_dtype_name(dt),
		        kl__shape_str(b, sizeof b, ndim, shape),
		        kl__shape_why(why, sizeof why, e, ndim, shape, -1));
		return NULL;
	}
	kl_storage *st = calloc(1, sizeof *st);
	/* a 1-byte block for empty tensors keeps data non-NULL everywhere */
	void *data = st ? ctx->be->alloc(ctx, nbytes ? nbytes : 1) : NULL;
	if (!data) {
		free(st);
		char b[192];
		kl__err(ctx, KL_ENOMEM, "kl_tensor: out of memory allocating %zu bytes for %s %s",
		        nbytes, kl_dtype_name(dt), kl__shape_str(b, sizeof b, ndim, shape));
		return NULL;
	}
	st->refs = 1;
	st->device = ctx->device;
	st->data = data;
	st->nbytes = nbytes;
	st->id = kl__storage_id();
	kl_tensor *t = kl__tensor_new(ctx, dt, ndim, shape);
	if (!t) {
		ctx->be->free(ctx, data);
		free(st);
		return NULL;
	}
	t->st = st;
	return t;
}

kl_tensor *kl__tensor_view(kl_tensor *base, int ndim, const int64_t *shape, const int64_t *strides,
                           int64_t offset)
{
	kl_tensor *t = kl__tensor_new(base->ctx, base->dtype, ndim, shape);
	if (!t)
		return NULL;
	if (ndim > 0)
		memcpy(t->strides, strides, (size_t)ndim * sizeof *strides);
	t->offset = offset;
	t->st = base->st;
	if (t->st)
		t->st->refs++;
	return t;
}

void kl__tensor_discard(kl_tensor *t)
{
	if (!t)
		return;
	kl_ctx *ctx = t->ctx;
	if (ctx->nscopes > 0) {
		/* it was made last or nearly so: search from the newest entry */
		kl_scope *s = &ctx->scopes[ctx->nscopes - 1];
		for (int i = s->n - 1; i >= 0; i--)
			if (s->items[i] == t) {
				memmove(s->items + i, s->items + i + 1,
				        (size_t)(s->n - 1 - i) * sizeof *s->items);
				s->n--;
				t->scoped--;
				break;
			}
	}
	kl_release(t);
}

bool kl__strides_contiguous(int ndim, const int64_t *shape, const int64_t *strides)
{
	int64_t expect = 1;
	if (kl__numel(ndim, shape) == 0)
		return true;
	for (int i = ndim - 1; i >= 0; i--) {
		/* a size-1 dim is never stepped along, so its stride is free */
		if (shape[i] != 1 && strides[i] != expect)
			return false;
		expect *= shape[i];
	}
	return true;
}

/* ---- public: lifetime and inspection --------------------------------------- */

kl_tensor *kl_retain(kl_tensor *t)
{
	if (t)
		t->refs++;
	return t;
}

void kl_release(kl_tensor *t)
{
	if (t && --t->refs == 0)
		tensor_destroy(t);
}

kl_ctx *kl_tensor_ctx(const kl_tensor *t)
{
	return t ? t->ctx : NULL;
}

/* Accessors on NULL return a harmless value (KL_NDTYPES, -1, NULL) rather
 * than crash, since NULL is how every failed op reports. */
kl_dtype kl_tensor_dtype(const kl_tensor *t)
{
	return t ? t->dtype : KL_NDTYPES;
}

int kl_ndim(const kl_tensor *t)
{
	return t ? t->ndim : -1;
}

const int64_t *kl_shape(const kl_tensor *t)
{
	return t ? t->shape : NULL;
}

const int64_t *kl_strides(const kl_tensor *t)
{
	return t ? t->strides : NULL;
}

int64_t kl_dim(const kl_tensor *t, int axis)
{
	if (!t)
		return -1;
	int a = axis < 0 ? axis + t->ndim : axis;
	if (a < 0 || a >= t->ndim) {
		char b[192];
		kl__err(t->ctx, KL_EINVAL, "kl_dim: axis %d out of range for shape %s", axis,
		        kl__shape_str(b, sizeof b, t->ndim, t->shape));
		return -1;
	}
	return t->shape[a];
}

int64_t kl_numel(const kl_tensor *t)
{
	return t ? kl__numel(t->ndim, t->shape) : -1;
}

bool kl_is_contiguous(const kl_tensor *t)
{
	return t && kl__strides_contiguous(t->ndim, t->shape, t->strides);
}

/* ---- creation that materializes at once ------------------------------------ */

/* dtype and shape of a tensor made from nothing (kl_empty, kl_from_host) */
static kl_status check_new(kl_ctx *ctx, const char *op, kl_dtype dt, int ndim, const int64_t *shape)
{
	if ((unsigned)dt >= KL_NDTYPES)
		return kl__err(ctx, KL_EINVAL, "%s: unknown dtype %d", op, (int)dt);
	if (ndim < 0 || ndim > KL_MAX_DIMS)
		return kl__err(ctx, KL_EINVAL, "%s: ndim %d out of range [0,%d]", op, ndim,
		               KL_MAX_DIMS);
	if (ndim > 0 && !shape)
		return kl__err(ctx, KL_EINVAL, "%s: shape is NULL for ndim %d", op, ndim);
	int bad;
	kl_shape_err e = kl__shape_check(ndim, shape, &bad);
	if (e != KL_SHAPE_OK) {
		char b[192], why[128];
		return kl__err(ctx, KL_EINVAL, "%s: shape %s: %s", op,
		               kl__shape_str(b, sizeof b, ndim, shape),
		               kl__shape_why(why, sizeof why, e, ndim, shape, bad));
	}
	return KL_OK;
}

kl_status kl_shape_nbytes(kl_dtype dt, int ndim, const int64_t *shape, size_t *nbytes)
{
	KL_API("kl_shape_nbytes");
	if (!nbytes)
		return kl__err(NULL, KL_EINVAL, "kl_shape_nbytes: nbytes is NULL");
	kl_status s = check_new(NULL, "kl_shape_nbytes", dt, ndim, shape);
	if (s != KL_OK)
		return s;
	/* a checked shape's numel * 8 is at most 2^62: this cannot fail */
	kl__shape_nbytes(ndim, shape, kl_dtype_size(dt), nbytes);
	return KL_OK;
}

kl_tensor *kl_empty(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape)
{
	KL_API("kl_empty");
	if (!ctx) {
		kl__err(NULL, KL_EINVAL, "kl_empty: ctx is NULL");
		return NULL;
	}
	if (check_new(ctx, "kl_empty", dt, ndim, shape))
		return NULL;
	return kl__tensor_alloc(ctx, dt, ndim, shape);
}

kl_tensor *kl_from_host(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, const void *data,
                        size_t data_bytes)
{
	KL_API("kl_from_host");
	if (!ctx) {
		kl__err(NULL, KL_EINVAL, "kl_from_host: ctx is NULL");
		return NULL;
	}
	if (check_new(ctx, "kl_from_host", dt, ndim, shape))
		return NULL;
	size_t nbytes;
	kl__shape_nbytes(ndim, shape, kl_dtype_size(dt), &nbytes); /* checked above */
	if (data_bytes != nbytes) {
		char b[192];
		kl__err(ctx, KL_EINVAL,
		        "kl_from_host: the buffer holds %zu bytes but %s %s needs %zu", data_bytes,
		        kl_dtype_name(dt), kl__shape_str(b, sizeof b, ndim, shape), nbytes);
		return NULL;
	}
	if (!data && nbytes) {
		kl__err(ctx, KL_EINVAL, "kl_from_host: data is NULL");
		return NULL;
	}
	kl_tensor *t = kl__tensor_alloc(ctx, dt, ndim, shape);
	if (!t || !nbytes)
		return t;
	uint8_t *norm = NULL;
	if (dt == KL_BOOL) {
		/* the contract is one byte 0/1; normalize anything else so that
		 * kernels may rely on it */
		const uint8_t *src = data;
		norm = malloc(nbytes);
		if (!norm) {
			kl__tensor_discard(t);
			kl__err(ctx, KL_ENOMEM, "kl_from_host: out of memory");
			return NULL;
		}
		for (size_t i = 0; i < nbytes; i++)
			norm[i] = src[i] != 0;
		data = norm;
	}
	kl_status st = ctx->be->from_host(ctx, t->st->data, data, nbytes);
	free(norm);
	if (st != KL_OK) {
		kl__tensor_discard(t);
		return NULL;
	}
	return t;
}
