/* dispatch.c - kl__dispatch: where every op built by ops.c goes, either into the
 * active trace as a node (returning a lazy tensor) or, eagerly, through the
 * backend's exec into a fresh dense tensor. Eager movement ops become views.
 */
#include <stdlib.h>

#include "api/dispatch.h"
#include "api/autograd.h"

/* torch's view rule (computeStride): a reshape is a view when every run of
 * old dims that is contiguous in memory maps onto a run of new dims. */
static bool view_strides(int ondim, const int64_t *oshape, const int64_t *ostrides, int nndim,
                         const int64_t *nshape, int64_t *nstrides)
{
	if (kl__numel(ondim, oshape) == 0 || ondim == 0) {
		kl__contig_strides(nndim, nshape, nstrides);
		return true;
	}
	int vd = nndim - 1;
	int64_t chunk_base = ostrides[ondim - 1], tnumel = 1, vnumel = 1;
	for (int td = ondim - 1; td >= 0; td--) {
		tnumel *= oshape[td];
		if (td == 0 || (oshape[td - 1] != 1 && ostrides[td - 1] != tnumel * chunk_base)) {
			while (vd >= 0 && (vnumel < tnumel || nshape[vd] == 1)) {
				nstrides[vd] = vnumel * chunk_base;
				vnumel *= nshape[vd];
				vd--;
			}
			if (vnumel != tnumel)
				return false;
			if (td > 0) {
				chunk_base = ostrides[td - 1];
				tnumel = 1;
				vnumel = 1;
			}
		}
	}
	return vd == -1;
}

static kl_tensor *eager_exec(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in)
{
	kl_tensor *out = kl__tensor_alloc(ctx, (kl_dtype)n->dtype, n->ndim, n->shape);
	if (!out)
		return NULL;
	kl_tensor views[KL_NODE_MAX_IN];
	kl_tensor *args[KL_NODE_MAX_IN];
	for (int i = 0; i < n->nin; i++)
		args[i] = in[i];
	if (kl__op_pointwise((kl_op)n->op)) {
		/* Broadcast views of exactly the node's shape, so that no backend
		 * broadcasts by itself. They are private copies of the headers
		 * (not counted, not in any scope): exec only reads them. */
		for (int i = 0; i < n->nin; i++) {
			views[i] = *in[i];
			views[i].ndim = n->ndim;
			memcpy(views[i].shape, n->shape, sizeof views[i].shape);
			kl__broadcast_strides(in[i]->ndim, in[i]->shape, in[i]->strides, n->ndim,
			                      n->shape, views[i].strides);
			views[i].prev = views[i].next = NULL;
			args[i] = &views[i];
		}
	}
	kl_status st = ctx->be->exec(ctx, n, args, out);
	if (st != KL_OK) {
		if (ctx->status == KL_OK)
			kl__err(ctx, st, "kl_%s: the %s backend failed (%s)", kl__ops[n->op].name,
			        ctx->be->name, kl_status_name(st));
		kl__tensor_discard(out);
		return NULL;
	}
	return out;
}

kl_tensor *kl__eager_contiguous(kl_ctx *ctx, kl_tensor *a)
{
	kl_node c;
	memset(&c, 0, sizeof c);
	c.op = KL_OP_CONTIGUOUS;
	c.dtype = (uint8_t)a->dtype;
	c.ndim = (uint8_t)a->ndim;
	c.nin = 1;
	memcpy(c.shape, a->shape, sizeof c.shape);
	return eager_exec(ctx, &c, &a);
}

kl_status kl__index_scan(kl_ctx *ctx, const char *op, const kl_tensor *idx, int64_t n,
                         bool has_skip, int64_t skip, int64_t *bad, int64_t *val)
{
	*bad = -1;
	*val = 0;
	int64_t nidx = kl__numel(idx->ndim, idx->shape);
	if (!idx->st || nidx == 0)
		return KL_OK;
	/* the elements' offsets span [lo, hi] from the tensor's own */
	int64_t lo = 0, hi = 0;
	for (int d = 0; d < idx->ndim; d++) {
		int64_t span = (idx->shape[d] - 1) * idx->strides[d];
		if (span < 0)
			lo += span;
		else
			hi += span;
	}
	size_t es = kl_dtype_size(idx->dtype), bytes = (size_t)(hi - lo + 1) * es;
	const char *p = (const char *)kl__tensor_data(idx) + lo * (int64_t)es;
	void *copy = NULL;
	if (idx->st->device != KL_CPU) {
		if (!(copy = malloc(bytes)))
			return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory reading back %zu bytes of "
			               "indices", op, bytes);
		kl_status st = ctx->be->to_host(ctx, copy, p, bytes);
		if (st != KL_OK) {
			free(copy);
			return st;
		}
		p = copy;
	}
	for (int64_t e = 0; e < nidx; e++) {
		int64_t off = -lo, r = e;
		for (int d = idx->ndim - 1; d >= 0; d--) {
			off += (r % idx->shape[d]) * idx->strides[d];
			r /= idx->shape[d];
		}
		int64_t v = idx->dtype == KL_I32 ? ((const int32_t *)(const void *)p)[off]
		                                 : ((const int64_t *)(const void *)p)[off];
		if ((v < 0 || v >= n) && !(has_skip && v == skip)) {
			*bad = e;
			*val = v;
			break;
		}
	}
	free(copy);
	return KL_OK;
}

/* Movement ops in eager mode: views of the input's storage, except a reshape
 * whose layout forbids it, which copies to dense first (torch's reshape). */
static kl_tensor *eager_view(kl_ctx *ctx, kl_node *n, kl_tensor *a)
{
	int64_t strides[KL_MAX_DIMS];
	int64_t offset = a->offset;
	switch (n->op) {
	case KL_OP_PERMUTE:
		for (int i = 0; i < n->ndim; i++)
			strides[i] = a->strides[n->a.v[i]];
		break;
	case KL_OP_EXPAND:
		kl__broadcast_strides(a->ndim, a->shape, a->strides, n->ndim, n->shape, strides);
		break;
	case KL_OP_SLICE: {
		int ax = n->a.axis;
		memcpy(strides, a->strides, sizeof strides);
		/* start < size along ax when the slice is not empty, so the offset
		 * stays inside the base; an empty slice starts where the base does */
		if (n->shape[ax] > 0)
			offset += n->a.v[0] * a->strides[ax];
		if (!kl__slice_stride(a->strides[ax], n->a.v[2], n->shape[ax], &strides[ax])) {
			kl__err(ctx, KL_EINVAL, "kl_slice: step %lld overflows stride %lld",
			        (long long)n->a.v[2], (long long)a->strides[ax]);
			return NULL;
		}
		break;
	}
	default: /* RESHAPE */
		if (!view_strides(a->ndim, a->shape, a->strides, n->ndim, n->shape, strides)) {
			kl_tensor *d = kl__eager_contiguous(ctx, a);
			if (!d)
				return NULL;
			/* d is fresh and private: reshaping it in place is safe */
			d->ndim = n->ndim;
			memcpy(d->shape, n->shape, sizeof d->shape);
			kl__contig_strides(n->ndim, n->shape, d->strides);
			return d;
		}
		break;
	}
	return kl__tensor_view(a, n->ndim, n->shape, strides, offset);
}

static kl_tensor *dispatch_run(kl_ctx *ctx, kl_node *n, kl_tensor *const *in)
{
	const char *name = kl__ops[n->op].name;
	for (int i = 0; i < n->nin; i++) {
		if (!in[i] || in[i]->ctx != ctx) {
			kl__err(ctx, KL_EINVAL, "kl_%s: input %d is %s", name, i,
			        in[i] ? "from another context" : "NULL");
			return NULL;
		}
		if (!kl__trace_holds(ctx, in[i])) {
			kl__err(ctx, KL_ESTATE,
			        "kl_%s: input %d is a lazy tensor of a finished trace", name, i);
			return NULL;
		}
	}
	/* every node's shape, whatever op computed it (a broadcast, an expand,
	 * a concat, a product), is held to kiln's shape rule here, once */
	int bad;
	kl_shape_err e = kl__shape_check(n->ndim, n->shape, &bad);
	if (e != KL_SHAPE_OK) {
		char b[192], why[128];
		kl__err(ctx, KL_EINVAL, "kl_%s: result shape %s: %s", name,
		        kl__shape_str(b, sizeof b, n->ndim, n->shape),
		        kl__shape_why(why, sizeof why, e, n->ndim, n->shape, bad));
		return NULL;
	}
	for (int d = n->ndim; d < KL_MAX_DIMS; d++)
		n->shape[d] = 0;
	memset(n->strides, 0, sizeof n->strides);

	if (ctx->trace) {
		kl_trace *tr = ctx->trace;
		for (int i = 0; i < n->nin; i++) {
			n->in[i] = kl__trace_node_of(ctx, in[i]);
			if (n->in[i] < 0)
				return NULL;
		}
		for (int i = n->nin; i < KL_NODE_MAX_IN; i++)
			n->in[i] = 0;
		int32_t idx = kl__graph_add(&tr->g, n);
		if (idx < 0) {
			kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory recording the node", name);
			return NULL;
		}
		kl_tensor *t = kl__tensor_new(ctx, (kl_dtype)n->dtype, n->ndim, n->shape);
		if (!t) {
			tr->g.n--;
			return NULL;
		}
		t->trace_id = tr->id;
		t->node = idx;
		return t;
	}

	/* eager: n->in[i] are positions in in[], there being no graph */
	for (int i = 0; i < KL_NODE_MAX_IN; i++)
		n->in[i] = i < n->nin ? i : 0;
	switch (n->op) {
	case KL_OP_RESHAPE:
	case KL_OP_PERMUTE:
	case KL_OP_EXPAND:
	case KL_OP_SLICE:
		return eager_view(ctx, n, in[0]);
	default:
		return eager_exec(ctx, n, in);
	}
}

/* Run or record the node, then put it on the autograd tape when one of its
 * inputs requires grad (api/autograd.c): eager and traced ops alike. */
kl_tensor *kl__dispatch(kl_ctx *ctx, kl_node *n, kl_tensor *const *in)
{
	kl_tensor *r = dispatch_run(ctx, n, in);
	if (r && n->nin > 0 && kl__tape_record(ctx, n, in, r) != KL_OK) {
		kl__tensor_discard(r);
		return NULL;
	}
	return r;
}
