/* trace.c - lazy capture: while ctx->trace is set, ops append nodes to its
 * graph instead of running, and return lazy tensors naming those nodes.
 * Materialized tensors used by the trace become INPUT nodes (once each).
 */
#include <stdlib.h>

#include "capture/trace.h"

kl_status kl__trace_begin(kl_ctx *ctx)
{
	if (!ctx)
		return kl__err(NULL, KL_EINVAL, "kl__trace_begin: ctx is NULL");
	if (ctx->trace)
		return kl__err(ctx, KL_ESTATE, "kl__trace_begin: a trace is already active");
	kl_trace *tr = calloc(1, sizeof *tr);
	if (!tr)
		return kl__err(ctx, KL_ENOMEM, "kl__trace_begin: out of memory");
	tr->id = ++ctx->next_trace_id;
	kl__graph_init(&tr->g);
	ctx->trace = tr;
	return KL_OK;
}

void kl__trace_free(kl_trace *tr)
{
	if (!tr)
		return;
	for (int i = 0; i < tr->nin_tensors; i++)
		kl_release(tr->in_tensors[i]);
	free(tr->in_tensors);
	kl__graph_free(&tr->g);
	free(tr);
}

/* The trace is ended even when an output is bad (the caller cannot resume
 * it); it is freed and NULL is returned with the error set. */
kl_trace *kl__trace_end(kl_ctx *ctx, int noutputs, kl_tensor *const *outputs)
{
	if (!ctx) {
		kl__err(NULL, KL_EINVAL, "kl__trace_end: ctx is NULL");
		return NULL;
	}
	kl_trace *tr = ctx->trace;
	if (!tr) {
		kl__err(ctx, KL_ESTATE, "kl__trace_end: no trace is active");
		return NULL;
	}
	for (int i = 0; i < noutputs; i++) {
		kl_tensor *t = outputs[i];
		int32_t node = -1;
		if (!t)
			kl__err(ctx, KL_EINVAL, "kl__trace_end: output %d is NULL", i);
		else if (t->ctx != ctx)
			kl__err(ctx, KL_EINVAL,
			        "kl__trace_end: output %d belongs to another context", i);
		else
			node = kl__trace_node_of(ctx, t);
		if (node < 0 || kl__graph_add_output(&tr->g, node)) {
			if (node >= 0)
				kl__err(ctx, KL_ENOMEM, "kl__trace_end: out of memory");
			ctx->trace = NULL;
			kl__trace_free(tr);
			return NULL;
		}
	}
	ctx->trace = NULL;
	return tr;
}

int32_t kl__trace_node_of(kl_ctx *ctx, kl_tensor *t)
{
	kl_trace *tr = ctx->trace;
	if (!tr) {
		kl__err(ctx, KL_ESTATE, "kl__trace_node_of: no trace is active");
		return -1;
	}
	if (!t->st) {
		if (t->trace_id != tr->id || t->node < 0 || t->node >= tr->g.n) {
			kl__err(ctx, KL_ESTATE,
			        "kl_trace: a lazy tensor of a finished trace was used");
			return -1;
		}
		return t->node;
	}
	/* a graph rarely has more than a few dozen inputs: a scan is cheapest */
	for (int i = 0; i < tr->nin_tensors; i++)
		if (tr->in_tensors[i] == t)
			return tr->g.inputs[i];
	if (tr->nin_tensors == tr->cap_in_tensors) {
		int nc = tr->cap_in_tensors ? tr->cap_in_tensors * 2 : 16;
		kl_tensor **p = realloc(tr->in_tensors, (size_t)nc * sizeof *p);
		if (!p) {
			kl__err(ctx, KL_ENOMEM, "kl_trace: out of memory");
			return -1;
		}
		tr->in_tensors = p;
		tr->cap_in_tensors = nc;
	}
	kl_node n;
	memset(&n, 0, sizeof n);
	n.op = KL_OP_INPUT;
	n.dtype = (uint8_t)t->dtype;
	n.ndim = (uint8_t)t->ndim;
	memcpy(n.shape, t->shape, sizeof n.shape);
	memcpy(n.strides, t->strides, sizeof n.strides);
	for (int d = t->ndim; d < KL_MAX_DIMS; d++)
		n.shape[d] = n.strides[d] = 0;
	int32_t idx = kl__graph_add(&tr->g, &n);
	if (idx < 0 || kl__graph_add_input(&tr->g, idx)) {
		if (idx >= 0)
			tr->g.n--;
		kl__err(ctx, KL_ENOMEM, "kl_trace: out of memory");
		return -1;
	}
	/* in_tensors[i] pairs with g.inputs[i] */
	tr->in_tensors[tr->nin_tensors++] = kl_retain(t);
	return idx;
}
