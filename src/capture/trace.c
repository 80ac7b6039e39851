/* trace.c - lazy capture: while ctx->trace is set, ops append nodes to its
 * graph instead of running, and return lazy tensors naming those nodes.
 * Materialized tensors used by the trace become INPUT nodes (once each).
 */
#include <stdlib.h>

#include "capture/trace.h"

kl_status kl__trace_rng_draw(kl_ctx *ctx, kl_tensor *const k[2], uint64_t offset)
{
	kl_trace *tr = ctx->trace;
	if (!tr)
		return KL_OK;
	if (ctx->rng_seed != tr->rng_seed || offset < tr->rng_start) {
		tr->per_call = true; /* reseeded inside the call: not a replay's advance */
		return KL_OK;
	}
	if (tr->nrng == tr->cap_rng) {
		int nc = tr->cap_rng ? 2 * tr->cap_rng : 4;
		kl_tensor **p = realloc(tr->rng_key, sizeof *p * 2 * (size_t)nc);
		if (!p)
			return kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		tr->rng_key = p;
		uint64_t *q = realloc(tr->rng_rel, sizeof *q * (size_t)nc);
		if (!q)
			return kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
		tr->rng_rel = q;
		tr->cap_rng = nc;
	}
	tr->rng_key[2 * tr->nrng] = kl_retain(k[0]);
	tr->rng_key[2 * tr->nrng + 1] = kl_retain(k[1]);
	tr->rng_rel[tr->nrng++] = offset - tr->rng_start;
	return KL_OK;
}

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
	tr->rng_start = ctx->rng_offset;
	tr->rng_seed = ctx->rng_seed;
	kl__graph_init(&tr->g);
	ctx->trace = tr;
	return KL_OK;
}

kl_status kl__trace_continue(kl_ctx *ctx, kl_trace *prev)
{
	kl_status st = kl__trace_begin(ctx);
	if (st != KL_OK) {
		kl__trace_free(prev);
		return st;
	}
	ctx->trace->prev = prev;
	return KL_OK;
}

kl_status kl__trace_materialized(kl_trace *tr, int i, kl_tensor *t)
{
	if (!tr->mat && !(tr->mat = calloc((size_t)(tr->g.n ? tr->g.n : 1), sizeof *tr->mat)))
		return KL_ENOMEM;
	int32_t node = tr->g.outputs[i];
	if (!tr->mat[node])
		tr->mat[node] = kl_retain(t);
	return KL_OK;
}

/* the ended trace (the active one or one it continues) t is lazy in */
static kl_trace *owner_of(const kl_ctx *ctx, const kl_tensor *t)
{
	for (kl_trace *tr = ctx->trace; tr; tr = tr->prev)
		if (tr->id == t->trace_id)
			return tr;
	return NULL;
}

bool kl__trace_holds(const kl_ctx *ctx, const kl_tensor *t)
{
	return t->st || owner_of(ctx, t) != NULL;
}

void kl__trace_free(kl_trace *tr)
{
	while (tr) {
		kl_trace *prev = tr->prev;
		for (int i = 0; i < tr->nin_tensors; i++)
			kl_release(tr->in_tensors[i]);
		for (int32_t i = 0; tr->mat && i < tr->g.n; i++)
			kl_release(tr->mat[i]);
		for (int i = 0; i < tr->nwrites; i++) {
			kl_release(tr->wdst[i]);
			kl_release(tr->wsrc[i]);
		}
		free(tr->wdst);
		free(tr->wsrc);
		for (int i = 0; i < tr->nchk; i++)
			kl_release(tr->chk[i].t);
		free(tr->chk);
		for (int i = 0; i < 2 * tr->nrng; i++)
			kl_release(tr->rng_key[i]);
		free(tr->rng_key);
		free(tr->rng_rel);
		for (int i = 0; i < tr->ndefer; i++) {
			kl_deferred *d = &tr->defer[i];
			if (!d->done)
				d->fn(NULL, d->user, false, NULL);
			if (d->again_user)
				d->free_again(d->again_user);
			for (int k = 0; k < d->nreads; k++)
				kl_release(d->reads[k]);
			for (int k = 0; k < d->nguard; k++)
				kl_release(d->guard[k]);
			free(d->reads);
			free(d->guard);
		}
		free(tr->defer);
		free(tr->mat);
		free(tr->imported);
		free(tr->in_tensors);
		kl__graph_free(&tr->g);
		free(tr);
		tr = prev;
	}
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

static int32_t import_node(kl_ctx *ctx, kl_trace *old, int32_t k);

int32_t kl__trace_node_of(kl_ctx *ctx, kl_tensor *t)
{
	kl_trace *tr = ctx->trace;
	if (!tr) {
		kl__err(ctx, KL_ESTATE, "kl__trace_node_of: no trace is active");
		return -1;
	}
	if (!t->st) {
		kl_trace *own = owner_of(ctx, t);
		if (!own || t->node < 0 || t->node >= own->g.n) {
			kl__err(ctx, KL_ESTATE,
			        "kl_trace: a lazy tensor of a finished trace was used");
			return -1;
		}
		if (own == tr)
			return t->node;
		/* a value an earlier graph left uncomputed: computed in this one */
		int32_t idx = import_node(ctx, own, t->node);
		if (idx >= 0) {
			t->trace_id = tr->id;
			t->node = idx;
		}
		return idx;
	}
	/* a write in place recorded in this trace: dst reads the value written,
	 * another view of that memory would read the old one */
	for (int w = tr->nwrites - 1; w >= 0; w--) {
		kl_tensor *d = tr->wdst[w];
		if (d == t)
			return tr->wsrc[w]->node;
		int64_t lo, hi, dlo, dhi;
		kl__tensor_span(t, &lo, &hi);
		kl__tensor_span(d, &dlo, &dhi);
		if (d->st == t->st && kl_numel(t) > 0 && lo <= dhi && dlo <= hi) {
			char a[128], b[128];
			kl__err(ctx, KL_EINVAL,
			        "a tensor (%s %s) that shares memory with one kl_copy wrote "
			        "earlier in this compiled function (%s %s) was read after the write; "
			        "inside a compiled function a write lands when the graph ends, so read "
			        "the tensor written (kl_copy's dst) itself",
			        kl_dtype_name(t->dtype), kl__shape_str(a, sizeof a, t->ndim, t->shape),
			        kl_dtype_name(d->dtype), kl__shape_str(b, sizeof b, d->ndim, d->shape));
			return -1;
		}
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

/* Copy node k of ended trace old, and the nodes it reads that old did not
 * hand to a tensor, into the active trace; returns the copy of k. Nodes are
 * in topological order, so marking what k needs and copying it in index
 * order rewires every input to an existing copy. */
static int32_t import_node(kl_ctx *ctx, kl_trace *old, int32_t k)
{
	kl_trace *tr = ctx->trace;
	const kl_graph *g = &old->g;
	if (!old->imported && !(old->imported = malloc(sizeof *old->imported * (size_t)g->n)))
		goto nomem;
	if (old->imported_for != tr->id) {
		for (int32_t i = 0; i < g->n; i++)
			old->imported[i] = -1;
		old->imported_for = tr->id;
	}
	if (old->imported[k] >= 0)
		return old->imported[k];
	uint8_t *need = calloc((size_t)k + 1, 1);
	int32_t *stack = malloc(sizeof *stack * ((size_t)k + 1));
	if (!need || !stack) {
		free(need);
		free(stack);
		goto nomem;
	}
	int32_t top = 0;
	stack[top++] = k;
	need[k] = 1;
	while (top > 0) {
		int32_t j = stack[--top];
		const kl_node *n = &g->nodes[j];
		if (old->imported[j] >= 0 || (old->mat && old->mat[j]) || n->op == KL_OP_INPUT)
			continue; /* a leaf: already here, or a materialized tensor */
		for (int q = 0; q < n->nin; q++)
			if (!need[n->in[q]]) {
				need[n->in[q]] = 1;
				stack[top++] = n->in[q];
			}
	}
	free(stack);
	int32_t idx = 0;
	for (int32_t j = 0; j <= k && idx >= 0; j++) {
		if (!need[j] || old->imported[j] >= 0)
			continue;
		const kl_node *n = &g->nodes[j];
		if (old->mat && old->mat[j]) {
			idx = kl__trace_node_of(ctx, old->mat[j]);
		} else if (n->op == KL_OP_INPUT) {
			int32_t i = 0;
			while (i < g->ninputs && g->inputs[i] != j)
				i++;
			idx = kl__trace_node_of(ctx, old->in_tensors[i]);
		} else {
			kl_node c = *n;
			for (int q = 0; q < c.nin; q++)
				c.in[q] = old->imported[c.in[q]];
			if ((idx = kl__graph_add(&tr->g, &c)) < 0)
				kl__err(ctx, KL_ENOMEM, "kl_trace: out of memory");
		}
		old->imported[j] = idx;
	}
	free(need);
	return idx < 0 ? -1 : old->imported[k];
nomem:
	kl__err(ctx, KL_ENOMEM, "kl_trace: out of memory");
	return -1;
}

/* ---- writes in place ------------------------------------------------------------ */

void kl__tensor_span(const kl_tensor *t, int64_t *lo, int64_t *hi)
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

kl_status kl__trace_write(kl_ctx *ctx, kl_tensor *dst, kl_tensor *val)
{
	kl_trace *tr = ctx->trace;
	if (!tr || !dst->st || val->st || val->trace_id != tr->id)
		return kl__err(ctx, KL_ESTATE, "kl_copy: no write to record in this trace");
	if (tr->nwrites == tr->cap_writes) {
		int nc = tr->cap_writes ? tr->cap_writes * 2 : 16;
		kl_tensor **a = realloc(tr->wdst, (size_t)nc * sizeof *a);
		if (a)
			tr->wdst = a;
		kl_tensor **b = a ? realloc(tr->wsrc, (size_t)nc * sizeof *b) : NULL;
		if (!b)
			return kl__err(ctx, KL_ENOMEM, "kl_copy: out of memory recording the write");
		tr->wsrc = b;
		tr->cap_writes = nc;
	}
	tr->wdst[tr->nwrites] = kl_retain(dst);
	tr->wsrc[tr->nwrites] = kl_retain(val);
	tr->nwrites++;
	return KL_OK;
}

kl_status kl__trace_check(kl_ctx *ctx, kl_tensor *t, int64_t hi, int dim, const char *op,
                          const char *what)
{
	kl_trace *tr = ctx->trace;
	if (!tr || !t->st)
		return kl__err(ctx, KL_ESTATE, "%s: no value check to record in this trace", op);
	if (tr->nchk == tr->cap_chk) {
		int nc = tr->cap_chk ? tr->cap_chk * 2 : 4;
		kl_vcheck *c = realloc(tr->chk, (size_t)nc * sizeof *c);
		if (!c)
			return kl__err(ctx, KL_ENOMEM, "%s: out of memory recording a check", op);
		tr->chk = c;
		tr->cap_chk = nc;
	}
	tr->chk[tr->nchk++] = (kl_vcheck){kl_retain(t), hi, dim, op, what};
	return KL_OK;
}

/* Write dense host values into dst's memory through its strides: the span
 * of storage it covers is read, patched and written back, so one path
 * serves every device. */
static kl_status write_strided(kl_ctx *ctx, kl_tensor *dst, const unsigned char *dense)
{
	size_t es = kl_dtype_size(dst->dtype);
	int64_t lo, hi, n = kl_numel(dst);
	kl__tensor_span(dst, &lo, &hi);
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

kl_status kl__write_into(kl_ctx *ctx, kl_tensor *dst, kl_tensor *dense)
{
	int64_t n = kl_numel(dst);
	if (n == 0)
		return KL_OK;
	kl_status st = KL_OK;
	/* a value the graph wrote in place (a cache write) is dst's memory
	 * already: only the version moves */
	bool same = dense->st == dst->st && dense->offset == dst->offset &&
	            dense->ndim == dst->ndim &&
	            !memcmp(dense->shape, dst->shape, sizeof(int64_t) * (size_t)dst->ndim) &&
	            !memcmp(dense->strides, dst->strides, sizeof(int64_t) * (size_t)dst->ndim);
	if (same)
		dense = dst;
	if (dense != dst && kl_is_contiguous(dst)) {
		/* one copy on the device: the backend's CONTIGUOUS writes its
		 * output, which may be any dense tensor of the node's shape */
		kl_node c;
		memset(&c, 0, sizeof c);
		c.op = KL_OP_CONTIGUOUS;
		c.dtype = (uint8_t)dst->dtype;
		c.ndim = (uint8_t)dst->ndim;
		c.nin = 1;
		memcpy(c.shape, dst->shape, sizeof c.shape);
		st = ctx->be->exec(ctx, &c, &dense, dst);
	} else if (dense != dst) {
		size_t nbytes = (size_t)n * kl_dtype_size(dst->dtype);
		unsigned char *host = malloc(nbytes);
		if (!host)
			return kl__err(ctx, KL_ENOMEM, "kl_copy: out of memory for %zu bytes", nbytes);
		st = ctx->be->to_host(ctx, host, kl__tensor_data(dense), nbytes);
		if (st == KL_OK)
			st = write_strided(ctx, dst, host);
		free(host);
	}
	if (st == KL_OK)
		kl__storage_written(dst->st);
	return st;
}

/* ---- actions after the graph ------------------------------------------------------- */

kl_status kl__trace_defer(kl_ctx *ctx, kl_status (*fn)(kl_ctx *, void *, bool, int *),
                          void *user, const char *what, int nreads, kl_tensor *const *reads,
                          int nguard, kl_tensor *const *guard)
{
	kl_trace *tr = ctx->trace;
	kl_deferred d = {.fn = fn, .user = user};
	if (!tr) {
		fn(ctx, user, false, NULL);
		return kl__err(ctx, KL_ESTATE, "kl__trace_defer: no active trace");
	}
	if (tr->ndefer == tr->cap_defer) {
		int nc = tr->cap_defer ? 2 * tr->cap_defer : 4;
		kl_deferred *p = realloc(tr->defer, sizeof *p * (size_t)nc);
		if (!p) {
			fn(ctx, user, false, NULL);
			return kl__err(ctx, KL_ENOMEM, "out of memory");
		}
		tr->defer = p;
		tr->cap_defer = nc;
	}
	d.reads = malloc(sizeof *d.reads * (size_t)(nreads + 1));
	d.guard = malloc(sizeof *d.guard * (size_t)(nguard + 1));
	if (!d.reads || !d.guard) {
		free(d.reads);
		free(d.guard);
		fn(ctx, user, false, NULL);
		return kl__err(ctx, KL_ENOMEM, "out of memory");
	}
	for (int i = 0; i < nreads; i++)
		d.reads[d.nreads++] = kl_retain(reads[i]);
	for (int i = 0; i < nguard; i++)
		d.guard[d.nguard++] = kl_retain(guard[i]);
	snprintf(d.what, sizeof d.what, "%s", what);
	d.mark = tr->g.n;
	tr->defer[tr->ndefer++] = d;
	return KL_OK;
}

kl_status kl__trace_defer_again(kl_ctx *ctx,
                                kl_status (*prepare)(kl_ctx *, void *, kl_tensor *const *),
                                kl_status (*launch)(kl_ctx *, void *, int *), void *user,
                                void (*free_again)(void *))
{
	kl_trace *tr = ctx->trace;
	if (!tr || tr->ndefer == 0 || tr->defer[tr->ndefer - 1].again_user) {
		free_again(user);
		return kl__err(ctx, KL_ESTATE,
		               "kl__trace_defer_again: no deferred action to give it");
	}
	kl_deferred *d = &tr->defer[tr->ndefer - 1];
	d->again_prepare = prepare;
	d->again_launch = launch;
	d->again_user = user;
	d->free_again = free_again;
	return KL_OK;
}

/* whether t's memory is memory d changes */
static bool guarded(const kl_deferred *d, const kl_tensor *t)
{
	for (int k = 0; t && t->st && k < d->nguard; k++)
		if (d->guard[k]->st == t->st)
			return true;
	return false;
}

kl_status kl__trace_check_deferred(kl_ctx *ctx, const kl_trace *tr)
{
	const kl_graph *g = &tr->g;
	if (tr->ndefer == 0 || g->n == 0)
		return KL_OK;
	bool *from = malloc(sizeof *from * (size_t)g->n);
	int32_t *inof = malloc(sizeof *inof * (size_t)g->n);
	if (!from || !inof) {
		free(from);
		free(inof);
		return kl__err(ctx, KL_ENOMEM, "out of memory");
	}
	for (int32_t j = 0; j < g->n; j++)
		inof[j] = -1;
	for (int32_t i = 0; i < g->ninputs; i++)
		inof[g->inputs[i]] = i;
	kl_status st = KL_OK;
	for (int q = 0; q < tr->ndefer && st == KL_OK; q++) {
		const kl_deferred *d = &tr->defer[q];
		/* the nodes that are the guarded memory: its INPUT nodes and the
		 * views made of them */
		for (int32_t j = 0; j < g->n && st == KL_OK; j++) {
			const kl_node *n = &g->nodes[j];
			from[j] = inof[j] >= 0 && guarded(d, tr->in_tensors[inof[j]]);
			for (int k = 0; k < n->nin && !from[j]; k++)
				from[j] = from[n->in[k]] && kl__ops[n->op].cat == KL_CAT_MOVEMENT;
			if (j < d->mark || n->op == KL_OP_INPUT)
				continue;
			for (int k = 0; k < n->nin; k++)
				if (from[n->in[k]]) {
					st = kl__err(ctx, KL_ESTATE,
					             "kl_fn_call: %s (node #%d) reads memory that %s changes, "
					             "after it: inside a compiled function that update runs "
					             "when the graph ends, so this read would see the old "
					             "value (make the update the last use, or read it after "
					             "the call)",
					             kl__ops[n->op].name, (int)j, d->what);
					break;
				}
		}
	}
	free(from);
	free(inof);
	return st;
}

kl_status kl__trace_run_deferred(kl_ctx *ctx, kl_trace *tr, int *launches)
{
	kl_status st = KL_OK;
	for (int q = 0; q < tr->ndefer && st == KL_OK; q++) {
		kl_deferred *d = &tr->defer[q];
		int l = 0;
		d->done = true;
		st = d->fn(ctx, d->user, true, &l);
		*launches += l;
	}
	return st;
}
