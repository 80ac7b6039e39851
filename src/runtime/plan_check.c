/* plan_check.c - a plan against the traced graph it claims to implement.
 *
 * kl__program_validate checks a plan on its own (ids in range, operands inside
 * their buffers as the plan sizes them). A plan read from outside (the disk
 * cache, later an AOT package) must also be a plan *of this graph*: the
 * executor allocates outputs and temps by the plan's shapes, while the
 * kernels write what the graph's shapes say. So before anything is allocated
 * or loaded for it, every buffer is compared with the graph: inputs and
 * outputs exactly (dtype, rank, each dim at the traced sizes), views inside
 * their base, temps no larger than the largest value lowering can make of
 * this graph; steps name nodes of this graph, their row grids stay inside
 * their buffers, and library products reach no further into an input than
 * its traced shape and strides allow.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime/runtime_int.h"


/* a * b, saturating at INT64_MAX (both >= 0) */
static int64_t sat_mul(int64_t a, int64_t b)
{
	int64_t r;
	return __builtin_mul_overflow(a, b, &r) ? INT64_MAX : r;
}

static int64_t numel_sat(int ndim, const int64_t *shape)
{
	int64_t n = 1;
	for (int d = 0; d < ndim; d++)
		n = sat_mul(n, shape[d]);
	return n;
}

/* The largest number of elements a value lowering makes of g may hold: a
 * node's own, or what its decomposition materializes (decompose.c): a
 * product as multiply-and-sum holds [..., m, n, k]; attention's products
 * hold [..., tq, tk, d] and [..., tq, dv, tk]. */
static int64_t largest_value(const kl_graph *g)
{
	int64_t best = 1;
	for (int32_t i = 0; i < g->n; i++) {
		const kl_node *x = &g->nodes[i];
		int64_t n = numel_sat(x->ndim, x->shape);
		if (x->op == KL_OP_MATMUL && x->nin >= 1) {
			const kl_node *a = &g->nodes[x->in[0]];
			n = sat_mul(n, a->ndim ? a->shape[a->ndim - 1] : 1);
		} else if ((x->op == KL_OP_ATTENTION || x->op == KL_OP_ATTENTION_BWD) && x->nin >= 3 &&
		           x->ndim >= 1) {
			/* (the backward's primitives, where a target expands it, hold
			 * the same products; its rows over-count: a bound) */
			const kl_node *q = &g->nodes[x->in[0]], *k = &g->nodes[x->in[1]];
			int64_t rows = numel_sat(x->ndim - 1, x->shape); /* [..., tq] */
			int64_t tk = k->ndim >= 2 ? k->shape[k->ndim - 2] : 1;
			int64_t d = q->ndim ? q->shape[q->ndim - 1] : 1, dv = x->shape[x->ndim - 1];
			n = sat_mul(sat_mul(rows, tk), d > dv ? d : dv);
			int64_t qk = sat_mul(numel_sat(q->ndim, q->shape), tk);
			n = n > qk ? n : qk;
		}
		best = n > best ? n : best;
	}
	return best;
}

/* Dims of bf at the traced sizes; false when a symbol names no graph input dim. */
static bool traced_shape(const kl_program *p, const kl_graph *g, const kl_buf *bf, int64_t *shape)
{
	for (int d = 0; d < bf->ndim; d++) {
		int32_t k = bf->shape[d].sym;
		if (k == 0) {
			shape[d] = bf->shape[d].v;
			continue;
		}
		int32_t in = p->sym_input[k - 1], dim = p->sym_dim[k - 1];
		if (in < 0 || in >= g->ninputs || dim < 0 || dim >= g->nodes[g->inputs[in]].ndim)
			return false;
		shape[d] = g->nodes[g->inputs[in]].shape[dim];
	}
	return true;
}

static const char *role_name(kl_buf_role r)
{
	return r == KL_BUF_INPUT ? "input" : r == KL_BUF_OUTPUT ? "output" : "temp";
}

/* The farthest element an input is addressed at as traced (its strides), or
 * of a dense buffer; -1 when empty. */
static int64_t reach_of(const kl_graph *g, const kl_buf *bf, const int64_t *shape)
{
	int64_t n = numel_sat(bf->ndim, shape);
	if (n == 0)
		return -1;
	if (bf->role != KL_BUF_INPUT)
		return n - 1;
	const kl_node *x = &g->nodes[g->inputs[bf->index]];
	int64_t r = 0;
	for (int d = 0; d < bf->ndim; d++)
		if (shape[d] > 1)
			r += (shape[d] - 1) * x->strides[d];
	return r;
}

kl_status kl__plan_check(const kl_program *p, const kl_graph *g, char *err, size_t cap)
{
	char have[128], want[128];
	kl_status st = kl__program_validate(p, g->ninputs, g->noutputs, err, cap);
	if (st != KL_OK)
		return st;
	int64_t limit = largest_value(g);
	int64_t(*shapes)[KL_MAX_DIMS] = calloc((size_t)(p->nbufs ? p->nbufs : 1), sizeof *shapes);
	if (!shapes)
		return kl__plan_fail(err, cap, "out of memory");
	for (int32_t b = 0; b < p->nbufs && st == KL_OK; b++) {
		const kl_buf *bf = &p->bufs[b];
		int64_t *sh = shapes[b];
		if (!traced_shape(p, g, bf, sh)) {
			st = kl__plan_fail(err, cap, "buffer %d: a dim names no dim of a graph input", (int)b);
			break;
		}
		if (bf->role == KL_BUF_TEMP) {
			int64_t n = numel_sat(bf->ndim, sh);
			if (n > limit)
				st = kl__plan_fail(err, cap,
				         "temp buffer %d is %s, %lld elements; no value of this "
				         "graph holds more than %lld",
				         (int)b, kl__shape_str(have, sizeof have, bf->ndim, sh),
				         (long long)n, (long long)limit);
			continue;
		}
		int32_t id = bf->role == KL_BUF_INPUT ? g->inputs[bf->index] : g->outputs[bf->index];
		const kl_node *x = &g->nodes[id];
		if (bf->dtype != (kl_dtype)x->dtype || bf->ndim != x->ndim ||
		    memcmp(sh, x->shape, sizeof(int64_t) * (size_t)x->ndim) != 0)
			st = kl__plan_fail(err, cap, "%s %d is %s %s in the plan, %s %s in the graph",
			         role_name(bf->role), (int)bf->index, kl_dtype_name(bf->dtype),
			         kl__shape_str(have, sizeof have, bf->ndim, sh),
			         kl_dtype_name((kl_dtype)x->dtype),
			         kl__shape_str(want, sizeof want, x->ndim, x->shape));
	}
	/* views (validate saw to their bases' roles): inside the base as traced */
	for (int32_t b = 0; b < p->nbufs && st == KL_OK; b++) {
		const kl_buf *bf = &p->bufs[b];
		if (bf->alias < 0 || numel_sat(bf->ndim, shapes[b]) == 0)
			continue;
		int64_t ext = bf->view_offset, t;
		bool over = false;
		for (int d = 0; d < bf->ndim; d++)
			over |= __builtin_mul_overflow(shapes[b][d] - 1, bf->view_strides[d], &t) ||
			        __builtin_add_overflow(ext, t, &ext);
		int64_t reach = reach_of(g, &p->bufs[bf->alias], shapes[bf->alias]);
		if (over || ext > reach)
			st = kl__plan_fail(err, cap, "output %d: a view reaching element %lld of buffer %d, "
			         "which ends at %lld",
			         (int)bf->index, (long long)ext, (int)bf->alias, (long long)reach);
	}
	for (int32_t s = 0; s < p->nsteps && st == KL_OK; s++) {
		const kl_step *sp = &p->steps[s];
		for (int i = 0; i < sp->nnodes && st == KL_OK; i++)
			if (sp->nodes[i] >= g->n)
				st = kl__plan_fail(err, cap, "step %d names node %d of a %d-node graph", (int)s,
				         (int)sp->nodes[i], (int)g->n);
		if (st != KL_OK)
			break;
		if (sp->kind == KL_STEP_KERNEL && sp->nrowdims > 0) {
			/* a row grid launches rows / row_per blocks: no more rows than
			 * the largest buffer the step touches has elements */
			int64_t rows = 1, most = 0;
			for (int d = 0; d < sp->nrowdims && st == KL_OK; d++) {
				kl_buf one = {.ndim = 1, .shape = {sp->rowdims[d]}};
				int64_t v;
				if (!traced_shape(p, g, &one, &v))
					st = kl__plan_fail(err, cap, "step %d: row dim %d names no dim of a graph input",
					         (int)s, d);
				else
					rows = sat_mul(rows, v);
			}
			for (int i = 0; i < sp->nreads + sp->nwrites; i++) {
				int32_t b = i < sp->nreads ? sp->reads[i] : sp->writes[i - sp->nreads];
				int64_t n = numel_sat(p->bufs[b].ndim, shapes[b]);
				most = n > most ? n : most;
			}
			if (rows > most)
				st = kl__plan_fail(err, cap, "step %d: a row grid of %lld rows over buffers of "
				         "at most %lld elements", (int)s, (long long)rows,
				         (long long)most);
		} else if (sp->kind == KL_STEP_CACHE_WRITE) {
			/* a cache write reads (and in place writes) inputs as dense */
			int32_t ids[4] = {sp->cw.cache, sp->cw.pos, sp->cw.val, sp->cw.out};
			for (int w = 0; w < 4 && st == KL_OK; w++) {
				if (p->bufs[ids[w]].role != KL_BUF_INPUT)
					continue;
				int64_t ext = kl__cw_extent(&sp->cw, w);
				int64_t reach = reach_of(g, &p->bufs[ids[w]], shapes[ids[w]]);
				if (ext > reach)
					st = kl__plan_fail(err, cap,
					         "step %d: cache write operand %d reaches element %lld of "
					         "input %d, which ends at %lld", (int)s, w, (long long)ext,
					         (int)p->bufs[ids[w]].index, (long long)reach);
			}
		} else if (sp->kind != KL_STEP_KERNEL) {
			/* library calls read an input through its traced strides:
			 * a product's a, b, residual and bias (kl__mm_extent's 0, 1,
			 * 3, 4), attention's q, k and v, the backward's o and do, and
			 * the lengths (kl__attn_extent's 0-2, 4, 5, 6) */
			bool mm = sp->kind == KL_STEP_MATMUL;
			int32_t ids[6] = {sp->mm.a, sp->mm.b, sp->mm.r, sp->mm.bias, -1, -1};
			bool has[6] = {true, true, sp->mm.has_r, sp->mm.has_bias, false, false};
			int which[6] = {0, 1, 3, 4, 0, 0};
			if (!mm) {
				int32_t at[6] = {sp->at.q, sp->at.k, sp->at.v, sp->at.fo, sp->at.go, sp->at.len};
				int aw[6] = {0, 1, 2, 4, 5, 6};
				memcpy(ids, at, sizeof ids);
				memcpy(which, aw, sizeof which);
				has[2] = true;
				has[3] = has[4] = sp->at.bwd != 0;
				has[5] = sp->at.len >= 0;
			}
			for (int w = 0; w < 6 && st == KL_OK; w++) {
				if (!has[w] || p->bufs[ids[w]].role != KL_BUF_INPUT)
					continue;
				const kl_buf *bf = &p->bufs[ids[w]];
				int64_t ext = mm ? kl__mm_extent(&sp->mm, which[w])
				                 : kl__attn_extent(&sp->at, which[w]);
				int64_t reach = reach_of(g, bf, shapes[ids[w]]);
				if (ext > reach)
					st = kl__plan_fail(err, cap,
					         "step %d: %s operand %c reaches element %lld of input "
					         "%d, which ends at %lld",
					         (int)s, mm ? "matmul" : "attention",
					         (mm ? "abrv??" : "qkvOGl")[w], (long long)ext,
					         (int)bf->index, (long long)reach);
			}
		}
	}
	free(shapes);
	return st;
}
