/* autograd.c - reverse-mode autodiff for the public API: the tape, and
 * kl_backward, which differentiates it with the graph layer's sweep
 * (graph/autodiff.c) and runs the gradient nodes through kl__dispatch.
 *
 * The tape is a kl_graph per context plus, per node, the tensor behind it
 * (one reference held) and the version of that tensor's memory when it was
 * recorded. A tensor that requires grad and has no node yet enters as an
 * INPUT node (a leaf when it was marked with kl_set_requires_grad, else a
 * constant the backward reads). Because every op goes through kl__dispatch,
 * ops inside a compiled function are recorded the same way (their tensors
 * are lazy), and kl_backward there appends the gradient nodes to the trace:
 * forward, backward and the update become one graph.
 */
#include <stdio.h>
#include <stdlib.h>

#include "api/autograd.h"
#include "api/dispatch.h"
#include "graph/autodiff.h"
#include "graph/build.h"
#include "runtime/compiled.h"

#define VER_LAZY UINT64_MAX
#define BWD_CACHE 8 /* compiled backward graphs kept per context */

typedef struct kl_tape {
	kl_graph g;
	kl_tensor **ts; /* per node: its tensor (one reference), NULL once consumed */
	uint64_t *ver;  /* per node: its memory's version when recorded (VER_LAZY:
	                 * a lazy tensor's, kept in its tape_ver when it gets storage) */
	bool *rg;       /* per node: requires grad */
	int32_t cap;
	int32_t nlive;    /* nodes holding a tensor */
	int32_t prune_at; /* prune when the tape reaches this many nodes */
	/* the compiled backward graphs (run_grad_graph), by compile key */
	struct {
		uint64_t key;
		kl_compiled *c;
	} bwd[BWD_CACHE];
	int nbwd, next_bwd;
	long bwd_compiles, bwd_hits;
} kl_tape;

/* kl_explain's part: the backward graphs compiled so far */
static void explain_backward(kl_ctx *ctx, FILE *out, const char *indent)
{
	const kl_tape *tp = ctx->tape;
	if (!tp || tp->nbwd == 0)
		return;
	fprintf(out,
	        "%sbackward graphs compiled by kl_backward (%ld compiles, %ld reuses), newest "
	        "last:\n",
	        indent, tp->bwd_compiles, tp->bwd_hits);
	char in2[64];
	snprintf(in2, sizeof in2, "%s  ", indent);
	for (int i = 0; i < tp->nbwd; i++)
		kl__compiled_explain(tp->bwd[(tp->next_bwd + i) % tp->nbwd].c, out, in2);
}

static kl_tape *tape_of(kl_ctx *ctx)
{
	if (!ctx->tape) {
		ctx->tape = calloc(1, sizeof(kl_tape));
		ctx->explain_backward = explain_backward;
	}
	return ctx->tape;
}

bool kl__requires_grad(const kl_tensor *t)
{
	if (t->requires_grad)
		return true;
	const kl_tape *tp = t->ctx->tape;
	return tp && t->tape_node >= 0 && t->tape_node < tp->g.n && tp->rg[t->tape_node];
}

void kl__tape_free(kl_ctx *ctx)
{
	kl_tape *tp = ctx->tape;
	if (!tp)
		return;
	kl__graph_free(&tp->g);
	for (int i = 0; i < tp->nbwd; i++)
		kl__compiled_free(tp->bwd[i].c);
	free(tp->ts);
	free(tp->ver);
	free(tp->rg);
	free(tp);
	ctx->tape = NULL;
	ctx->explain_backward = NULL;
}

/* room in the per-node arrays for need nodes */
static bool tape_room(kl_tape *tp, int32_t need)
{
	if (need <= tp->cap)
		return true;
	int32_t nc = tp->cap ? tp->cap : 64;
	while (nc < need)
		nc *= 2;
	kl_tensor **ts = realloc(tp->ts, sizeof *ts * (size_t)nc);
	if (ts)
		tp->ts = ts;
	uint64_t *ver = realloc(tp->ver, sizeof *ver * (size_t)nc);
	if (ver)
		tp->ver = ver;
	bool *r = realloc(tp->rg, sizeof *r * (size_t)nc);
	if (r)
		tp->rg = r;
	if (!ts || !ver || !r)
		return false;
	for (int32_t i = tp->cap; i < nc; i++)
		tp->ts[i] = NULL;
	tp->cap = nc;
	return true;
}

/* node n for tensor t (held; NULL: none yet), requiring grad or not */
static int32_t tape_add(kl_tape *tp, const kl_node *n, kl_tensor *t, bool rg)
{
	if (!tape_room(tp, tp->g.n + 1))
		return -1;
	int32_t i = kl__graph_add(&tp->g, n);
	if (i < 0)
		return -1;
	tp->ts[i] = t ? kl_retain(t) : NULL;
	tp->ver[i] = !t ? 0 : t->st ? t->st->version : VER_LAZY;
	tp->rg[i] = rg;
	tp->nlive += t != NULL;
	if (t)
		t->tape_node = i;
	return i;
}

static int32_t node_of(kl_tape *tp, kl_tensor *t)
{
	if (t->tape_node >= 0)
		return t->tape_node;
	kl_node n;
	memset(&n, 0, sizeof n);
	n.op = KL_OP_INPUT;
	n.dtype = (uint8_t)t->dtype;
	n.ndim = (uint8_t)t->ndim;
	memcpy(n.shape, t->shape, sizeof n.shape);
	t->tape_leaf = true;
	return tape_add(tp, &n, t, t->requires_grad);
}

static void consume(kl_tape *tp, int32_t i);

/* Drop what no backward can reach any more, as torch frees a graph whose
 * outputs died: a node is kept when the program still holds its tensor
 * (a reference besides the tape's) or a kept node reads it; the rest is
 * consumed and the kept nodes renumbered. Inputs of kept nodes that an
 * earlier backward consumed stay as empty nodes (a backward through them
 * says so). Called when the tape has doubled since the last prune, so its
 * cost is amortized over the ops recorded. */
static void prune(kl_tape *tp)
{
	int32_t n = tp->g.n;
	if (n == 0)
		return;
	int32_t *map = malloc(sizeof *map * (size_t)n);
	if (!map)
		return; /* only costs memory until the next backward */
	for (int32_t i = 0; i < n; i++)
		map[i] = 0;
	for (int32_t i = n - 1; i >= 0; i--) {
		const kl_node *nd = &tp->g.nodes[i];
		kl_tensor *t = tp->ts[i];
		if (t && nd->op != KL_OP_INPUT && t->refs > 1)
			map[i] = 1;
		if (map[i])
			for (int k = 0; k < nd->nin; k++)
				map[nd->in[k]] = 1;
	}
	int32_t m = 0;
	for (int32_t i = 0; i < n; i++) {
		if (!map[i]) {
			consume(tp, i);
			map[i] = -1;
			continue;
		}
		kl_node c = tp->g.nodes[i];
		for (int k = 0; k < c.nin; k++)
			c.in[k] = map[c.in[k]];
		tp->g.nodes[m] = c;
		tp->ts[m] = tp->ts[i];
		tp->ver[m] = tp->ver[i];
		tp->rg[m] = tp->rg[i];
		if (tp->ts[m])
			tp->ts[m]->tape_node = m;
		map[i] = m++;
	}
	for (int32_t i = m; i < n; i++)
		tp->ts[i] = NULL;
	tp->g.n = m;
	free(map);
}

kl_status kl__tape_record(kl_ctx *ctx, kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	bool any = false;
	uint16_t stop = 0;
	for (int i = 0; i < n->nin; i++) {
		any |= kl__requires_grad(in[i]);
		if (!stop)
			stop = in[i]->grad_stop;
	}
	if (!any || ctx->no_grad) {
		out->grad_stop = ctx->no_grad ? 0 : stop;
		return KL_OK;
	}
	if (!kl_dtype_is_float((kl_dtype)n->dtype)) {
		out->grad_stop = (uint16_t)(n->op + 1);
		return KL_OK;
	}
	kl_tape *tp = tape_of(ctx);
	if (!tp)
		return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory recording the op for autograd",
		               kl__ops[n->op].name);
	if (tp->g.n >= tp->prune_at) {
		prune(tp);
		tp->prune_at = tp->g.n * 2 > 256 ? tp->g.n * 2 : 256;
	}
	kl_node c = *n;
	for (int i = 0; i < n->nin; i++) {
		c.in[i] = node_of(tp, in[i]);
		if (c.in[i] < 0)
			return kl__err(ctx, KL_ENOMEM,
			               "kl_%s: out of memory recording the op for autograd",
			               kl__ops[n->op].name);
	}
	memset(c.strides, 0, sizeof c.strides);
	if (tape_add(tp, &c, out, true) < 0)
		return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory recording the op for autograd",
		               kl__ops[n->op].name);
	return KL_OK;
}

/* ---- kl_backward ------------------------------------------------------------------- */

/* Drop node i's tensor from the tape (the loss's graph is consumed). */
static void consume(kl_tape *tp, int32_t i)
{
	kl_tensor *t = tp->ts[i];
	if (!t)
		return;
	if (t->tape_node == i)
		t->tape_node = -1;
	tp->ts[i] = NULL;
	tp->nlive--;
	kl_release(t);
}

static const char *desc(const kl_tensor *t, char *b, size_t cap)
{
	char sh[192];
	snprintf(b, cap, "%s %s", kl__shape_str(sh, sizeof sh, t->ndim, t->shape),
	         kl_dtype_name(t->dtype));
	return b;
}

/* Set or accumulate leaf's .grad with g (a tensor of leaf's shape). */
static kl_status give_grad(kl_ctx *ctx, kl_tensor *leaf, kl_tensor *g)
{
	kl_tensor *v = g;
	if (leaf->grad)
		v = kl_add(leaf->grad, g);
	else if (g->st && !kl_is_contiguous(g))
		/* a dense .grad, as torch's (recorded when the backward is) */
		v = ctx->no_grad ? kl__eager_contiguous(ctx, g) : kl_contiguous(g);
	if (!v)
		return kl_last_status(ctx);
	if (v == g)
		kl_retain(v);
	else
		kl_retain(v), kl__tensor_discard(v);
	kl_release(leaf->grad);
	leaf->grad = v;
	return KL_OK;
}

/* backward on a leaf: its gradient is the cotangent */
static kl_status leaf_backward(kl_ctx *ctx, kl_tensor *loss, kl_tensor *cot)
{
	kl_tensor *c = cot ? cot : kl_full(ctx, loss->dtype, loss->ndim, loss->shape, 1.0);
	if (!c)
		return kl_last_status(ctx);
	kl_status st = give_grad(ctx, loss, c);
	if (!cot)
		kl__tensor_discard(c);
	return st;
}

static kl_status check_args(kl_ctx *ctx, kl_tensor *loss, kl_tensor *cot)
{
	char a[256], b[256];
	if (!kl_dtype_is_float(loss->dtype))
		return kl__err(ctx, KL_EINVAL, "kl_backward: loss %s is not floating point",
		               desc(loss, a, sizeof a));
	if (!cot) {
		if (kl_numel(loss) != 1)
			return kl__err(ctx, KL_EINVAL,
			               "kl_backward: loss %s has %lld elements: pass a cotangent of its "
			               "shape, or reduce the loss to one element",
			               desc(loss, a, sizeof a), (long long)kl_numel(loss));
		return KL_OK;
	}
	if (cot->ctx != ctx)
		return kl__err(ctx, KL_EINVAL, "kl_backward: the cotangent belongs to another context");
	bool same = cot->dtype == loss->dtype && cot->ndim == loss->ndim;
	for (int d = 0; same && d < loss->ndim; d++)
		same = cot->shape[d] == loss->shape[d];
	if (!same)
		return kl__err(ctx, KL_EINVAL,
		               "kl_backward: cotangent %s does not match loss %s (it needs the loss's "
		               "shape and dtype)",
		               desc(cot, a, sizeof a), desc(loss, b, sizeof b));
	if (!kl__trace_holds(ctx, cot))
		return kl__err(ctx, KL_ESTATE,
		               "kl_backward: the cotangent is a lazy tensor of a finished trace");
	return KL_OK;
}

/* Every node the loss's node reads, directly or not, checked: alive (not
 * consumed by an earlier backward), usable now, and unwritten since it was
 * recorded. anc[i] is set for each. */
static kl_status check_tape(kl_ctx *ctx, kl_tape *tp, int32_t root, bool *anc, int *nleaves)
{
	char a[256], d[256];
	anc[root] = true;
	*nleaves = 0;
	for (int32_t i = root; i >= 0; i--) {
		if (!anc[i])
			continue;
		const kl_node *n = &tp->g.nodes[i];
		for (int k = 0; k < n->nin; k++)
			anc[n->in[k]] = true;
		kl_tensor *t = tp->ts[i];
		if (!t)
			return kl__err(ctx, KL_ESTATE,
			               "kl_backward: part of this loss's graph (%s, %s) was consumed by "
			               "an earlier kl_backward (each graph is differentiated once)",
			               kl__ops[n->op].name, kl__node_desc(&tp->g, i, d, sizeof d));
		/* a lazy value of a compiled forward that it did not keep (the
		 * partition's choice) is computed again by the backward graph */
		bool again = !t->st && !ctx->trace && n->op != KL_OP_INPUT && tp->ver[i] == VER_LAZY;
		if (!again && !kl__trace_holds(ctx, t))
			return kl__err(ctx, KL_ESTATE,
			               "kl_backward: %s (%s) was computed inside a compiled function "
			               "that has returned: call kl_backward inside that function",
			               kl__ops[n->op].name, desc(t, a, sizeof a));
		uint64_t ver = tp->ver[i] == VER_LAZY ? t->tape_ver : tp->ver[i];
		if (t->st && t->st->version != ver)
			return kl__err(ctx, KL_ESTATE,
			               "kl_backward: %s %s (tape %s) was written in place (kl_copy) "
			               "after the forward used it (version %llu -> %llu): its gradient "
			               "needs the old value",
			               n->op == KL_OP_INPUT ? "input" : kl__ops[n->op].name,
			               desc(t, a, sizeof a), kl__node_desc(&tp->g, i, d, sizeof d),
			               (unsigned long long)ver,
			               (unsigned long long)t->st->version);
		*nleaves += n->op == KL_OP_INPUT && t->requires_grad;
	}
	return KL_OK;
}

/* Run the gradient nodes [base, g.n) that the leaves' gradients need, each
 * through kl__dispatch (eager now, or appended to the active trace). */
static kl_status run_grad_nodes(kl_ctx *ctx, kl_tape *tp, int32_t base, int nl,
                                const int32_t *grads)
{
	int32_t end = tp->g.n;
	bool *need = calloc((size_t)(end - base + 1), sizeof *need);
	if (!need)
		return kl__err(ctx, KL_ENOMEM, "kl_backward: out of memory");
	for (int j = 0; j < nl; j++)
		if (grads[j] >= base)
			need[grads[j] - base] = true;
	for (int32_t i = end - 1; i >= base; i--)
		if (need[i - base])
			for (int k = 0; k < tp->g.nodes[i].nin; k++)
				if (tp->g.nodes[i].in[k] >= base)
					need[tp->g.nodes[i].in[k] - base] = true;
	kl_status st = KL_OK;
	for (int32_t i = base; i < end && st == KL_OK; i++) {
		if (!need[i - base] || tp->ts[i])
			continue;
		kl_node c = tp->g.nodes[i];
		kl_tensor *in[KL_NODE_MAX_IN];
		for (int k = 0; k < c.nin; k++)
			in[k] = tp->ts[c.in[k]];
		kl_tensor *r = kl__dispatch(ctx, &c, in);
		if (!r)
			st = kl_last_status(ctx);
		tp->ts[i] = r; /* owned here (and by the open scope, if any) */
	}
	free(need);
	return st;
}

/* create_graph: the gradient nodes [base, g.n) run as ops recorded on the
 * tape like any forward (grad mode on), so the gradients they give the
 * leaves are differentiable. The nodes are taken off the tape first (the
 * ops append their own); the forward tensors they read are held through
 * the run, since recording may prune and renumber the tape. */
static kl_status run_grad_recorded(kl_ctx *ctx, kl_tape *tp, int32_t base, int nl,
                                   const int32_t *leaves, const int32_t *grads)
{
	int32_t end = tp->g.n, ng = end - base;
	kl_node *gn = malloc(sizeof *gn * (size_t)(ng + 1));
	kl_tensor **loc = calloc((size_t)ng + 1, sizeof *loc);
	kl_tensor **fw = calloc((size_t)base + 1, sizeof *fw);
	kl_tensor **lt = calloc((size_t)nl + 1, sizeof *lt);
	bool *need = calloc((size_t)ng + 1, sizeof *need);
	kl_status st = KL_OK;
	if (!gn || !loc || !fw || !lt || !need)
		st = kl__err(ctx, KL_ENOMEM, "kl_backward_ex: out of memory");
	if (st == KL_OK)
		memcpy(gn, tp->g.nodes + base, sizeof *gn * (size_t)ng);
	for (int j = 0; st == KL_OK && j < nl; j++) {
		lt[j] = kl_retain(tp->ts[leaves[j]]);
		if (grads[j] >= base)
			need[grads[j] - base] = true;
		else if (grads[j] >= 0 && !fw[grads[j]])
			fw[grads[j]] = kl_retain(tp->ts[grads[j]]);
	}
	for (int32_t i = ng - 1; st == KL_OK && i >= 0; i--)
		for (int k = 0; need[i] && k < gn[i].nin; k++) {
			int32_t x = gn[i].in[k];
			if (x >= base) {
				need[x - base] = true;
			} else if (!fw[x]) {
				if (!tp->ts[x])
					st = kl__err(ctx, KL_ESTATE,
					             "kl_backward_ex: create_graph: a value "
					             "the backward reads was freed");
				else
					fw[x] = kl_retain(tp->ts[x]);
			}
		}
	/* the gradient nodes leave the tape: only the cotangent input holds a
	 * tensor there */
	for (int32_t i = base; i < end; i++) {
		if (st == KL_OK && tp->ts[i])
			loc[i - base] = kl_retain(tp->ts[i]);
		if (tp->ts[i]) {
			kl_release(tp->ts[i]);
			tp->ts[i] = NULL;
			tp->nlive--;
		}
	}
	tp->g.n = base;
	bool prev = ctx->no_grad;
	ctx->no_grad = false;
	for (int32_t i = 0; i < ng && st == KL_OK; i++) {
		if (!need[i] || loc[i])
			continue;
		kl_node c = gn[i];
		kl_tensor *in[KL_NODE_MAX_IN];
		for (int k = 0; k < c.nin; k++)
			in[k] = c.in[k] >= base ? loc[c.in[k] - base] : fw[c.in[k]];
		kl_tensor *r = kl__dispatch(ctx, &c, in);
		if (!r)
			st = kl_last_status(ctx);
		else
			loc[i] = kl_retain(r), kl__tensor_discard(r);
	}
	for (int j = 0; st == KL_OK && j < nl; j++)
		if (grads[j] >= 0)
			st = give_grad(ctx, lt[j],
			               grads[j] >= base ? loc[grads[j] - base] : fw[grads[j]]);
	ctx->no_grad = prev;
	for (int32_t i = 0; loc && i < ng; i++)
		kl_release(loc[i]);
	for (int32_t i = 0; fw && i < base; i++)
		kl_release(fw[i]);
	for (int j = 0; lt && j < nl; j++)
		kl_release(lt[j]);
	free(gn);
	free(loc);
	free(fw);
	free(lt);
	free(need);
	return st;
}

/* An INPUT node for materialized t (its dtype, shape and strides), added to
 * g's inputs; its index, or -1 when out of memory. */
static int32_t graph_input(kl_graph *g, const kl_tensor *t)
{
	kl_node c;
	memset(&c, 0, sizeof c);
	c.op = KL_OP_INPUT;
	c.dtype = (uint8_t)t->dtype;
	c.ndim = (uint8_t)t->ndim;
	memcpy(c.shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
	memcpy(c.strides, t->strides, sizeof(int64_t) * (size_t)t->ndim);
	int32_t i = kl__graph_add(g, &c);
	return i < 0 || kl__graph_add_input(g, i) ? -1 : i;
}

/* The backward of a compiled forward, as one compiled graph: the gradient
 * nodes [base, end) the leaves need, the forward values the forward did not
 * keep (computed again from what it kept), each leaf's existing .grad added
 * in (the accumulation fused into the kernel that makes the gradient). The
 * graph's inputs are the tape's materialized tensors it reads. Compiled
 * once per structure (kept in the tape's small cache). Leaves the new .grad
 * of each leaf set. */
static kl_status run_grad_graph(kl_ctx *ctx, kl_tape *tp, int32_t base, int nl,
                                const int32_t *leaves, const int32_t *grads)
{
	int32_t end = tp->g.n;
	int32_t *map = malloc(sizeof *map * (size_t)end);
	bool *need = calloc((size_t)end, sizeof *need);
	kl_tensor **in = malloc(sizeof *in * (size_t)(end + nl + 1));
	kl_tensor **out = calloc((size_t)nl + 1, sizeof *out);
	int32_t *outnode = malloc(sizeof *outnode * (size_t)(nl + 1));
	kl_graph g;
	kl__graph_init(&g);
	kl_status st = map && need && in && out && outnode ? KL_OK : KL_ENOMEM;
	int nin = 0, nout = 0;
	for (int j = 0; st == KL_OK && j < nl; j++)
		if (grads[j] >= 0)
			need[grads[j]] = true;
	/* computed here: the gradient nodes and the values not kept */
	for (int32_t i = st == KL_OK ? end - 1 : -1; i >= 0; i--)
		if (need[i] && (i >= base || !tp->ts[i] || !tp->ts[i]->st))
			for (int k = 0; k < tp->g.nodes[i].nin; k++)
				need[tp->g.nodes[i].in[k]] = true;
	for (int32_t i = 0; st == KL_OK && i < end; i++) {
		map[i] = -1;
		if (!need[i])
			continue;
		kl_tensor *t = tp->ts[i];
		if (t && t->st) {
			if ((map[i] = graph_input(&g, t)) < 0)
				st = KL_ENOMEM;
			else
				in[nin++] = t;
			continue;
		}
		kl_node c = tp->g.nodes[i];
		for (int k = 0; k < c.nin; k++)
			c.in[k] = map[c.in[k]];
		if ((map[i] = kl__graph_add(&g, &c)) < 0)
			st = KL_ENOMEM;
	}
	for (int j = 0; st == KL_OK && j < nl; j++) {
		if (grads[j] < 0)
			continue;
		kl_tensor *leaf = tp->ts[leaves[j]], *old = leaf->grad;
		int32_t r = map[grads[j]];
		if (old && old->st && old->dtype == leaf->dtype && old->ndim == leaf->ndim) {
			/* accumulate: .grad + this gradient, in the graph */
			int32_t ai = graph_input(&g, old);
			if (ai < 0) {
				st = KL_ENOMEM;
				break;
			}
			in[nin++] = old;
			kl_node b = g.nodes[ai];
			memset(b.strides, 0, sizeof b.strides);
			b.op = KL_OP_ADD;
			b.nin = 2;
			b.in[0] = ai;
			b.in[1] = r;
			if ((r = kl__graph_add(&g, &b)) < 0) {
				st = KL_ENOMEM;
				break;
			}
		}
		if (kl__graph_add_output(&g, r)) {
			st = KL_ENOMEM;
			break;
		}
		outnode[nout++] = j;
	}
	if (st == KL_ENOMEM)
		kl__err(ctx, st, "kl_backward: out of memory");
	kl_compiled *cc = NULL;
	uint64_t key = 0;
	kl_compile_cfg cfg = {.mode = KL_MODE_DEFAULT, .fusion = true, .name = "backward"};
	if (st == KL_OK)
		st = kl__compile_key(ctx, &g, &cfg, &key);
	for (int i = 0; st == KL_OK && i < tp->nbwd && !cc; i++)
		if (tp->bwd[i].key == key)
			cc = tp->bwd[i].c;
	if (st == KL_OK && cc) {
		tp->bwd_hits++;
	} else if (st == KL_OK) {
		double t0 = kl__now_ms();
		cc = kl__compile(ctx, &g, &cfg);
		if (!cc) {
			st = kl_last_status(ctx);
		} else {
			int slot = tp->nbwd;
			if (slot < BWD_CACHE)
				tp->nbwd++;
			else
				kl__compiled_free(tp->bwd[slot = tp->next_bwd++ % BWD_CACHE].c);
			tp->bwd[slot].key = key;
			tp->bwd[slot].c = cc;
			tp->bwd_compiles++;
			kl__log(ctx, KL_LOG_STARTUP,
			        "kl_backward: backward graph of %d nodes (%d inputs, %d gradients) "
			        "compiled in %.3f ms",
			        g.n, nin, nout, kl__now_ms() - t0);
		}
	}
	if (st == KL_OK)
		st = kl__compiled_run(ctx, cc, in, out);
	for (int q = 0; st == KL_OK && q < nout; q++) {
		kl_tensor *leaf = tp->ts[leaves[outnode[q]]];
		kl_release(leaf->grad);
		leaf->grad = out[q];
		out[q] = NULL;
	}
	for (int q = 0; out && q < nout; q++)
		kl_release(out[q]);
	kl__graph_free(&g);
	free(map);
	free(need);
	free(in);
	free(out);
	free(outnode);
	return st;
}

/* kl_backward and kl_backward_ex (the public frame names the errors);
 * retain: the loss's graph stays on the tape for another backward */
static kl_status backward(kl_tensor *loss, kl_tensor *cotangent, bool retain, bool create)
{
	if (!loss)
		return kl__err(cotangent ? cotangent->ctx : NULL, KL_EINVAL, "kl_backward: loss is NULL");
	kl_ctx *ctx = loss->ctx;
	char a[256];
	kl_status st = check_args(ctx, loss, cotangent);
	if (st != KL_OK)
		return st;
	kl_tape *tp = ctx->tape;
	bool on_tape = tp && loss->tape_node >= 0 && tp->rg[loss->tape_node];
	if (!on_tape && loss->requires_grad) {
		bool prev = ctx->no_grad;
		ctx->no_grad = !create;
		st = leaf_backward(ctx, loss, cotangent);
		ctx->no_grad = prev;
		return st;
	}
	if (!on_tape) {
		if (loss->grad_stop)
			return kl__err(ctx, KL_EINVAL,
			               "kl_backward: no tensor that requires grad reaches loss %s: the "
			               "path stops at %s, which has no gradient",
			               desc(loss, a, sizeof a), kl__ops[loss->grad_stop - 1].name);
		return kl__err(ctx, KL_EINVAL,
		               "kl_backward: no tensor that requires grad reaches loss %s (mark "
		               "parameters with kl_set_requires_grad before the forward, with grad "
		               "mode on)",
		               desc(loss, a, sizeof a));
	}
	int32_t root = loss->tape_node, base = tp->g.n;
	bool *anc = calloc((size_t)base, sizeof *anc);
	if (!anc)
		return kl__err(ctx, KL_ENOMEM, "kl_backward: out of memory");
	int nl = 0;
	int32_t *leaves = NULL, *grads = NULL;
	st = check_tape(ctx, tp, root, anc, &nl);
	if (st == KL_OK) {
		leaves = malloc(sizeof *leaves * (size_t)(nl ? nl : 1));
		grads = malloc(sizeof *grads * (size_t)(nl ? nl : 1));
		if (!leaves || !grads)
			st = kl__err(ctx, KL_ENOMEM, "kl_backward: out of memory");
	}
	nl = 0;
	for (int32_t i = 0; st == KL_OK && i <= root; i++)
		if (anc[i] && tp->g.nodes[i].op == KL_OP_INPUT && tp->ts[i]->requires_grad)
			leaves[nl++] = i;
	bool prev = ctx->no_grad;
	ctx->no_grad = true; /* the gradient ops are not recorded */
	int32_t cot = -1;
	if (st == KL_OK) {
		/* the cotangent: the caller's tensor as an input, or a node of ones */
		kl_node n;
		memset(&n, 0, sizeof n);
		n.op = cotangent ? KL_OP_INPUT : KL_OP_FULL;
		n.dtype = (uint8_t)loss->dtype;
		n.ndim = (uint8_t)loss->ndim;
		memcpy(n.shape, loss->shape, sizeof n.shape);
		n.a.s[0] = cotangent ? 0.0 : 1.0;
		int32_t keep = cotangent ? cotangent->tape_node : -1;
		cot = tape_add(tp, &n, cotangent, false);
		if (cotangent)
			cotangent->tape_node = keep; /* its own node, if any, stays its */
		if (cot < 0)
			st = kl__err(ctx, KL_ENOMEM, "kl_backward: out of memory");
	}
	if (st == KL_OK) {
		char err[512];
		st = kl__autodiff(&tp->g, base, 1, &root, &cot, nl, leaves, grads, err, sizeof err);
		if (st != KL_OK)
			kl__err(ctx, st, "kl_backward: %s", err);
	}
	if (st == KL_OK && !tape_room(tp, tp->g.n))
		st = kl__err(ctx, KL_ENOMEM, "kl_backward: out of memory");
	/* the forward was compiled (its values were recorded lazily): the
	 * backward is compiled too, one graph; else (eager, or inside a trace,
	 * where the gradient ops join the trace) op by op */
	bool compiled = false;
	for (int32_t i = 0; !ctx->trace && i < base; i++)
		compiled |= anc[i] && tp->ver[i] == VER_LAZY;
	if (st == KL_OK && create && (compiled || ctx->trace))
		st = kl__err(ctx, KL_EUNSUPPORTED,
		             "kl_backward_ex: create_graph %s is not supported (the backward "
		             "is recorded op by op, eagerly); loss %s",
		             ctx->trace ? "inside a compiled function" : "after a compiled forward",
		             desc(loss, a, sizeof a));
	if (st == KL_OK && create) {
		st = run_grad_recorded(ctx, tp, base, nl, leaves, grads);
		ctx->no_grad = prev;
		if (tp->nlive == 0)
			tp->g.n = 0;
		free(anc);
		free(leaves);
		free(grads);
		return st;
	}
	if (st == KL_OK && compiled)
		st = run_grad_graph(ctx, tp, base, nl, leaves, grads);
	else if (st == KL_OK)
		st = run_grad_nodes(ctx, tp, base, nl, grads);
	for (int j = 0; st == KL_OK && !compiled && j < nl; j++)
		if (grads[j] >= 0)
			st = give_grad(ctx, tp->ts[leaves[j]], tp->ts[grads[j]]);
	ctx->no_grad = prev;
	/* the gradient nodes go; the loss's graph is consumed */
	for (int32_t i = tp->g.n - 1; i >= base; i--) {
		if (i >= tp->cap || !tp->ts[i])
			continue;
		if (i == cot && cotangent)
			kl_release(tp->ts[i]), tp->nlive--;
		else
			kl__tensor_discard(tp->ts[i]);
		tp->ts[i] = NULL;
	}
	tp->g.n = base;
	if (st == KL_OK && !retain)
		for (int32_t i = 0; i < base; i++)
			if (anc[i])
				consume(tp, i);
	if (tp->nlive == 0)
		tp->g.n = 0;
	else
		prune(tp);
	free(anc);
	free(leaves);
	free(grads);
	return st;
}

kl_status kl_backward(kl_tensor *loss, kl_tensor *cotangent)
{
	KL_API("kl_backward");
	return backward(loss, cotangent, false, false);
}

kl_status kl_backward_ex(kl_tensor *loss, kl_tensor *cotangent, const kl_backward_opts *opts)
{
	KL_API("kl_backward_ex");
	kl_backward_opts o = opts ? *opts : (kl_backward_opts){0};
	/* torch: create_graph keeps the graph (retain_graph defaults to it) */
	return backward(loss, cotangent, o.retain_graph || o.create_graph, o.create_graph);
}

/* ---- the rest of the public API ------------------------------------------------------ */

kl_status kl_set_requires_grad(kl_tensor *t, bool on)
{
	KL_API("kl_set_requires_grad");
	if (!t)
		return kl__err(NULL, KL_EINVAL, "kl_set_requires_grad: t is NULL");
	char a[256];
	if (on && !kl_dtype_is_float(t->dtype))
		return kl__err(t->ctx, KL_EINVAL,
		               "kl_set_requires_grad: %s: only floating-point tensors can require "
		               "gradients",
		               desc(t, a, sizeof a));
	const kl_tape *tp = t->ctx->tape;
	if (tp && t->tape_node >= 0 && tp->g.nodes[t->tape_node].op != KL_OP_INPUT)
		return kl__err(t->ctx, KL_EINVAL,
		               "kl_set_requires_grad: %s is the result of %s, not a leaf (use "
		               "kl_detach for a leaf of its value)",
		               desc(t, a, sizeof a), kl__ops[tp->g.nodes[t->tape_node].op].name);
	t->requires_grad = on;
	if (tp && t->tape_node >= 0)
		((kl_tape *)t->ctx->tape)->rg[t->tape_node] = on;
	return KL_OK;
}

bool kl_requires_grad(const kl_tensor *t)
{
	return t && kl__requires_grad(t);
}

kl_tensor *kl_grad(const kl_tensor *t)
{
	return t ? t->grad : NULL;
}

void kl_grad_clear(kl_tensor *t)
{
	if (!t)
		return;
	kl_release(t->grad);
	t->grad = NULL;
}

kl_tensor *kl_detach(kl_tensor *t)
{
	KL_API("kl_detach");
	if (!t) {
		kl__err(NULL, KL_EINVAL, "kl_detach: t is NULL");
		return NULL;
	}
	kl_ctx *ctx = t->ctx;
	if (!kl__trace_holds(ctx, t)) {
		kl__err(ctx, KL_ESTATE, "kl_detach: t is a lazy tensor of a finished trace");
		return NULL;
	}
	if (t->st)
		return kl__tensor_view(t, t->ndim, t->shape, t->strides, t->offset);
	kl_tensor *d = kl__tensor_new(ctx, t->dtype, t->ndim, t->shape);
	if (d) {
		d->trace_id = t->trace_id;
		d->node = t->node;
	}
	return d;
}

bool kl_set_grad_enabled(kl_ctx *ctx, bool on)
{
	if (!ctx)
		return false;
	bool prev = !ctx->no_grad;
	ctx->no_grad = !on;
	return prev;
}
