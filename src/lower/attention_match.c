/* attention_match.c - finds attention written out by hand in the caller's graph, so
 * that decompose.c replaces it with one sdpa node (an attention step).
 *
 * What is matched, from the final product back (all of one float dtype, the
 * intermediates used once and no graph outputs):
 *
 *     s = matmul(q, transpose(k, -2, -1))        q [..., Tq, D], k [..., Tk, D]
 *     s = mul_scalar(s, c) | div_scalar(s, c)    optional scale (1 when absent)
 *     s = where(mask, s, full(-inf))             optional mask, or
 *     s = add(s, bias) | add(bias, s)            an additive mask of 0 / -inf
 *     p = softmax(s, -1)
 *     o = matmul(p, v)                           v [..., Tk, Dv]
 *
 * The scale and the mask may come in either order. A mask must be a constant
 * (no graph input reaches it: aranges, fulls, comparisons, views), such as
 * kl_ge(kl_reshape(kl_arange(T), [T,1]), kl_reshape(kl_arange(T), [1,T])),
 * the form kl_nn's MultiheadAttention builds. It is evaluated here with the
 * reference interpreter and must be everywhere true (no mask) or exactly the
 * causal pattern "key j allowed iff j <= i + (Tk - Tq)"; anything else stays
 * unfused, with the reason in the fusion log.
 */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>

#include "graph/reference.h"
#include "lower/lower_int.h"

typedef struct mctx {
	kl_lctx *L;
	const kl_graph *g;
	int32_t *uses; /* per src node: inputs naming it, plus outputs */
	uint8_t *seen; /* scratch for cone walks */
} mctx;

static const kl_node *src(const mctx *m, int32_t n)
{
	return &m->g->nodes[n];
}

static const char *slab(const mctx *m, int32_t n, char *buf, size_t cap)
{
	snprintf(buf, cap, "%s#%d", kl__ops[src(m, n)->op].name, (int)n);
	return buf;
}

/* does a graph input reach n? */
static bool depends_on_input(mctx *m, int32_t n)
{
	memset(m->seen, 0, (size_t)m->g->n);
	int32_t *stack = malloc(sizeof(int32_t) * ((size_t)m->g->n + 1));
	if (!stack)
		return true;
	int32_t sp = 0;
	bool dep = false;
	stack[sp++] = n;
	m->seen[n] = 1;
	while (sp > 0 && !dep) {
		const kl_node *x = src(m, stack[--sp]);
		if (x->op == KL_OP_INPUT) {
			dep = true;
			break;
		}
		for (int i = 0; i < x->nin; i++)
			if (!m->seen[x->in[i]]) {
				m->seen[x->in[i]] = 1;
				stack[sp++] = x->in[i];
			}
	}
	free(stack);
	return dep;
}

/* The values of constant node n (row-major, n's shape) through the reference
 * interpreter on a copy of its cone; NULL when out of memory or it fails. */
static double *const_values(mctx *m, int32_t n)
{
	(void)depends_on_input(m, n); /* marks the cone in seen[] */
	kl_graph c;
	kl__graph_init(&c);
	int32_t *map = malloc(sizeof(int32_t) * ((size_t)n + 1));
	double *vals = NULL;
	bool ok = map != NULL;
	for (int32_t i = 0; i <= n && ok; i++) {
		if (!m->seen[i])
			continue;
		kl_node x = *src(m, i);
		for (int j = 0; j < x.nin; j++)
			x.in[j] = map[x.in[j]];
		map[i] = kl__graph_add(&c, &x);
		ok = map[i] >= 0;
	}
	if (ok && kl__graph_add_output(&c, map[n]) == 0) {
		char err[128];
		if (kl__ref_eval(&c, NULL, &vals, err, sizeof err) != KL_OK)
			vals = NULL;
	}
	free(map);
	kl__graph_free(&c);
	return vals;
}

/* Checks constant mask node k against the scores' [..., Tq, Tk]: additive
 * (0 allowed, -inf masked) or boolean. Sets *causal; false with a reason. */
static bool mask_kind(mctx *m, int32_t k, bool additive, int64_t tq, int64_t tk, bool *causal,
                      char *why, size_t cap)
{
	char l[64];
	const kl_node *x = src(m, k);
	if (depends_on_input(m, k)) {
		snprintf(why, cap, "the mask %s depends on graph inputs (only constant masks fuse)",
		         slab(m, k, l, sizeof l));
		return false;
	}
	if (kl__numel(x->ndim, x->shape) > ((int64_t)1 << 26)) {
		snprintf(why, cap, "the mask %s is too large to inspect", slab(m, k, l, sizeof l));
		return false;
	}
	double *v = const_values(m, k);
	if (!v) {
		snprintf(why, cap, "the mask %s could not be evaluated", slab(m, k, l, sizeof l));
		return false;
	}
	/* the mask's last two dims against (Tq, Tk), right-aligned; 1 broadcasts */
	int nd = x->ndim;
	int64_t mi = nd >= 2 ? x->shape[nd - 2] : 1, mj = nd >= 1 ? x->shape[nd - 1] : 1;
	int64_t total = kl__numel(nd, x->shape), plane = mi * mj;
	bool all = true, tri = true, valid = true;
	for (int64_t e = 0; e < total && valid; e++) {
		int64_t r = plane ? e % plane : 0;
		int64_t i0 = mi == 1 ? 0 : r / mj, i1 = mi == 1 ? tq - 1 : i0;
		int64_t j0 = mj == 1 ? 0 : r % mj, j1 = mj == 1 ? tk - 1 : j0;
		bool allowed;
		if (additive) {
			valid = v[e] == 0 || v[e] == -INFINITY;
			allowed = v[e] == 0;
		} else {
			valid = !isnan(v[e]);
			allowed = v[e] != 0;
		}
		all &= allowed;
		/* causal wants allowed exactly where j <= i + tk - tq, for every (i, j) covered */
		for (int64_t i = i0; i <= i1 && tri; i++)
			for (int64_t j = j0; j <= j1 && tri; j++)
				tri = allowed == (j <= i + (tk - tq));
	}
	free(v);
	if (!valid) {
		snprintf(why, cap, "the %s mask %s holds values other than %s",
		         additive ? "additive" : "boolean", slab(m, k, l, sizeof l),
		         additive ? "0 and -inf" : "true and false");
		return false;
	}
	if (!all && !tri) {
		snprintf(why, cap, "the mask %s is neither causal (key j allowed iff j <= i + Tk - Tq) "
		         "nor all allowed", slab(m, k, l, sizeof l));
		return false;
	}
	*causal = !all;
	return true;
}

/* every value of constant node n is -inf */
static bool all_neg_inf(mctx *m, int32_t n)
{
	if (depends_on_input(m, n) || kl__numel(src(m, n)->ndim, src(m, n)->shape) > (1 << 26))
		return false;
	double *v = const_values(m, n);
	if (!v)
		return false;
	bool ok = true;
	for (int64_t i = 0; i < kl__numel(src(m, n)->ndim, src(m, n)->shape) && ok; i++)
		ok = v[i] == -INFINITY;
	free(v);
	return ok;
}

static bool only_use(const mctx *m, int32_t n, char *why, size_t cap)
{
	char l[64];
	if (m->uses[n] == 1)
		return true;
	snprintf(why, cap, "%s has another user or is a graph output", slab(m, n, l, sizeof l));
	return false;
}

static bool swaps_last_two(const kl_node *p)
{
	if (p->op != KL_OP_PERMUTE || p->ndim < 2)
		return false;
	for (int i = 0; i < p->ndim - 2; i++)
		if (p->a.v[i] != i)
			return false;
	return p->a.v[p->ndim - 2] == p->ndim - 1 && p->a.v[p->ndim - 1] == p->ndim - 2;
}

/* Is o the end of an attention pattern? Returns false silently when o is no
 * candidate (not matmul(softmax(...), v)); with why set when it is one that
 * cannot fuse. */
static bool match_one(mctx *m, int32_t o, kl_attn_match *am, char *why, size_t cap)
{
	const kl_node *x = src(m, o);
	why[0] = 0;
	if (x->op != KL_OP_MATMUL || x->nin != 2 || x->ndim < 2)
		return false;
	int32_t p = x->in[0], v = x->in[1];
	const kl_node *sm = src(m, p);
	if (sm->op != KL_OP_SOFTMAX || sm->a.axis != sm->ndim - 1)
		return false;
	int nd = x->ndim;
	kl_dtype dt = (kl_dtype)x->dtype;
	int32_t chain[8] = {o, p};
	int n = 2;
	if (!only_use(m, p, why, cap))
		return false;
	int64_t tq = sm->shape[nd - 2], tk = sm->shape[nd - 1];
	double scale = 1;
	bool scaled = false, masked = false, causal = false;
	int32_t s = sm->in[0];
	for (;;) {
		const kl_node *y = src(m, s);
		if (y->dtype != dt || y->ndim != nd) {
			snprintf(why, cap, "the scores change dtype or rank on the way");
			return false;
		}
		if ((y->op == KL_OP_MUL || y->op == KL_OP_DIV) && y->a.scalar_rhs && !scaled) {
			if (!only_use(m, s, why, cap))
				return false;
			scale = y->op == KL_OP_MUL ? y->a.s[0] : 1.0 / y->a.s[0];
			if (!isfinite(scale)) {
				snprintf(why, cap, "the scale %g is not finite", scale);
				return false;
			}
			scaled = true;
			chain[n++] = s;
			s = y->in[0];
			continue;
		}
		if ((y->op == KL_OP_WHERE || (y->op == KL_OP_ADD && !y->a.scalar_rhs)) && !masked) {
			if (!only_use(m, s, why, cap))
				return false;
			int32_t sc, mk;
			bool add = y->op == KL_OP_ADD;
			if (add) {
				/* the scores are the operand of the scores' shape that an input reaches */
				bool a0 = src(m, y->in[0])->ndim == nd && depends_on_input(m, y->in[0]);
				sc = a0 ? y->in[0] : y->in[1];
				mk = a0 ? y->in[1] : y->in[0];
			} else {
				sc = y->in[1];
				mk = y->in[0];
				if (!all_neg_inf(m, y->in[2])) {
					snprintf(why, cap, "where's fill %s is not a constant -inf",
					         slab(m, y->in[2], (char[64]){0}, 64));
					return false;
				}
			}
			if (!mask_kind(m, mk, add, tq, tk, &causal, why, cap))
				return false;
			masked = true;
			chain[n++] = s;
			s = sc;
			continue;
		}
		break;
	}
	const kl_node *sc = src(m, s);
	if (sc->op != KL_OP_MATMUL) {
		snprintf(why, cap, "the softmax's input is %s, not a scaled and masked product q k^T",
		         slab(m, s, (char[64]){0}, 64));
		return false;
	}
	if (!only_use(m, s, why, cap))
		return false;
	int32_t q = sc->in[0], kt = sc->in[1];
	if (!swaps_last_two(src(m, kt))) {
		snprintf(why, cap, "the scores' right operand %s is not k transposed (-2, -1)",
		         slab(m, kt, (char[64]){0}, 64));
		return false;
	}
	int32_t k = src(m, kt)->in[0];
	const kl_node *Q = src(m, q), *K = src(m, k), *V = src(m, v);
	bool ok = Q->ndim == nd && K->ndim == nd && V->ndim == nd;
	for (int d = 0; ok && d < nd - 2; d++)
		ok = Q->shape[d] == x->shape[d] && K->shape[d] == x->shape[d] &&
		     V->shape[d] == x->shape[d];
	if (!ok || Q->dtype != dt || K->dtype != dt || V->dtype != dt) {
		snprintf(why, cap, "q, k and v differ in rank, batch dims or dtype");
		return false;
	}
	if (!kl_dtype_is_float(dt)) {
		snprintf(why, cap, "dtype %s is not floating point", kl_dtype_name(dt));
		return false;
	}
	am->q = q;
	am->k = k;
	am->v = v;
	am->scale = scale;
	am->causal = causal;
	chain[n++] = s;
	chain[n++] = kt;
	memcpy(am->chain, chain, sizeof chain);
	am->nchain = n;
	return true;
}

kl_status kl__attention_match(kl_lctx *L)
{
	const kl_graph *g = L->src;
	L->am = malloc(sizeof(kl_attn_match) * ((size_t)g->n + 1));
	mctx m = {.L = L, .g = g};
	m.uses = calloc((size_t)g->n + 1, sizeof(int32_t));
	m.seen = calloc((size_t)g->n + 1, 1);
	if (!L->am || !m.uses || !m.seen) {
		free(m.uses);
		free(m.seen);
		snprintf(L->err, L->errcap, "kl__lower: out of memory matching attention");
		return KL_ENOMEM;
	}
	for (int32_t i = 0; i < g->n; i++) {
		L->am[i].q = -1;
		for (int j = 0; j < g->nodes[i].nin; j++)
			m.uses[g->nodes[i].in[j]]++;
	}
	for (int32_t j = 0; j < g->noutputs; j++)
		m.uses[g->outputs[j]]++;
	if (!L->o->no_attention)
		for (int32_t i = 0; i < g->n; i++) {
			char why[320], l[64];
			if (match_one(&m, i, &L->am[i], why, sizeof why))
				kl__lower_logf(L, "attention: fused %d nodes ending at %s into one sdpa "
				               "step (%s, scale %.6g)", L->am[i].nchain,
				               slab(&m, i, l, sizeof l),
				               L->am[i].causal ? "causal" : "no mask", L->am[i].scale);
			else if (why[0])
				kl__lower_logf(L, "attention: not fused at %s: %s",
				               slab(&m, i, l, sizeof l), why);
		}
	free(m.uses);
	free(m.seen);
	return KL_OK;
}

bool kl__attention_layout(const kl_lctx *L, int32_t at, int32_t c, int64_t *os, char *why,
                          size_t cap)
{
	const kl_node *x = kl__nd(L, c);
	const kl_node *a = kl__nd(L, at);
	if (x->op != KL_OP_CONTIGUOUS) {
		snprintf(why, cap, "the attention step takes no epilogue, only a copy into another "
		                   "layout");
		return false;
	}
	if (L->nuse[at] != 1 || L->out_of[at] >= 0) {
		snprintf(why, cap, "the attention's output has other readers");
		return false;
	}
	/* c's input: reshapes (and copies that stayed views), over one
	 * permutation of the attention's output */
	int32_t v = x->in[0];
	while ((kl__nd(L, v)->op == KL_OP_RESHAPE || kl__nd(L, v)->op == KL_OP_CONTIGUOUS) &&
	       !L->mat[v] && L->nuse[v] == 1)
		v = kl__nd(L, v)->in[0];
	const kl_node *p = kl__nd(L, v);
	int r = a->ndim;
	if (p->op != KL_OP_PERMUTE || L->mat[v] || L->nuse[v] != 1 || p->in[0] != at ||
	    p->ndim != r || p->a.v[r - 1] != r - 1) {
		snprintf(why, cap, "the copy reads the attention's output through more than a "
		                   "permutation that keeps the last dim");
		return false;
	}
	if (x->dtype != a->dtype) {
		snprintf(why, cap, "the copy changes the dtype");
		return false;
	}
	if (os) {
		/* a reshape keeps the row-major order, so c's buffer holds p's
		 * elements densely in p's order: dim p->a.v[i] of the attention
		 * output steps by the dense stride of p's dim i */
		int64_t ps[KL_MAX_DIMS];
		kl__contig_strides(r, p->shape, ps);
		for (int i = 0; i < r; i++)
			os[p->a.v[i]] = ps[i];
	}
	return true;
}

bool kl__attention_bwd_layout(const kl_lctx *L, int32_t at, int32_t c, kl_bwd_layout *lay,
                              char *why, size_t cap)
{
	const kl_node *x = kl__nd(L, c), *a = kl__nd(L, at);
	int r = a->ndim;
	if (x->op != KL_OP_CONCAT) {
		snprintf(why, cap,
		         "the attention backward takes no epilogue, only the "
		         "concatenation of its gradients");
		return false;
	}
	if (x->dtype != a->dtype) {
		snprintf(why, cap, "the concatenation changes the dtype");
		return false;
	}
	if (x->nin != 3 || L->nuse[at] != 3 || L->out_of[at] >= 0) {
		snprintf(why, cap,
		         "the gradients have readers besides one concatenation of the three");
		return false;
	}
	int64_t tq = kl__nd(L, a->in[0])->shape[r - 2], tk = kl__nd(L, a->in[1])->shape[r - 2];
	int64_t cut[4] = {0, tq, tq + tk, tq + 2 * tk};
	int64_t cst[KL_MAX_DIMS];
	kl__contig_strides(x->ndim, x->shape, cst);
	int ax = x->a.axis;
	int64_t pos = 0; /* where part i starts along the concatenation's axis */
	bool seen[3] = {false, false, false};
	for (int i = 0; i < 3; i++) {
		/* part i's views, from the concatenation's input down to the
		 * slice of one gradient's rows that the rule made */
		int32_t chain[8], v = x->in[i];
		int n = 0;
		while (v != at && n < 8) {
			const kl_node *y = kl__nd(L, v);
			bool view = y->op == KL_OP_RESHAPE || y->op == KL_OP_PERMUTE ||
			            y->op == KL_OP_SLICE || y->op == KL_OP_CONTIGUOUS;
			if (!view || L->mat[v] || L->nuse[v] != 1 || L->out_of[v] >= 0)
				break;
			chain[n++] = v;
			v = y->in[0];
		}
		const kl_node *s = n > 0 ? kl__nd(L, chain[n - 1]) : NULL;
		int g = -1;
		if (v == at && s && s->op == KL_OP_SLICE && s->a.axis == r - 2 && s->a.v[2] == 1 &&
		    tq > 0 && tk > 0)
			for (int k = 0; k < 3; k++)
				if (s->a.v[0] == cut[k] && s->a.v[1] == cut[k + 1])
					g = k;
		for (int k = 0; k < n - 1 && g >= 0; k++)
			if (kl__nd(L, chain[k])->op == KL_OP_SLICE)
				g = -1;
		if (g < 0 || seen[g]) {
			snprintf(why, cap,
			         "part %d of the concatenation is not one of the gradients "
			         "(dq, dk, dv) whole, through a permutation and reshapes",
			         i);
			return false;
		}
		seen[g] = true;
		/* The view read the other way: the gradient's index (its own
		 * dims, [batch..., rows, d]) through each view up to the part,
		 * then into the concatenation's dense buffer, which must be a
		 * plain stride per dim (reshapes merge or split dims whole). */
		kl_ixa ia;
		kl__ixa_init(&ia);
		int32_t I[KL_MAX_DIMS], J[KL_MAX_DIMS];
		for (int d = 0; d < r; d++) {
			ia.var_hi[d] = s->shape[d] - 1;
			I[d] = s->shape[d] == 1 ? kl__ix_const(&ia, 0) : kl__ix_var(&ia, d);
		}
		bool ok = true;
		for (int k = n - 2; k >= 0 && ok; k--) {
			const kl_node *m = kl__nd(L, chain[k]), *in = kl__nd(L, m->in[0]);
			if (m->op == KL_OP_PERMUTE)
				for (int d = 0; d < m->ndim; d++)
					J[d] = I[m->a.v[d]];
			else if (m->op == KL_OP_RESHAPE)
				ok = kl__reshape_ix(&ia, m->ndim, m->shape, in->ndim, in->shape, I,
				                    J);
			else
				memcpy(J, I, sizeof J);
			memcpy(I, J, sizeof I);
		}
		kl_mono ms[KL_MAX_DIMS];
		for (int d = 0; d < x->ndim; d++)
			ms[d] = (kl_mono){.c = cst[d], .ns = 0};
		kir_addr ad;
		int64_t st[KL_MAX_DIMS] = {0}, off = 0;
		if (ok)
			I[ax] = kl__ix_addc(&ia, I[ax], pos);
		ok = ok && !ia.failed && kl__ix_linearize(&ia, x->ndim, I, ms, &ad) && ad.ns == 0;
		if (ok) {
			const kl_ix *e = kl__ix_get(&ia, ad.ix);
			off = e->c;
			for (int t = 0; t < e->nt && ok; t++) {
				const kl_atom *am = &ia.atoms[e->at[t]];
				ok = am->kind == KL_AT_VAR;
				if (ok)
					st[am->var] = e->k[t];
			}
		}
		kl__ixa_free(&ia);
		if (!ok) {
			snprintf(why, cap, "the concatenation holds %s at no plain strides",
			         (const char *[]){"dq", "dk", "dv"}[g]);
			return false;
		}
		if (s->shape[r - 1] > 1 && st[r - 1] != 1) {
			snprintf(why, cap,
			         "the concatenation holds the rows of %s with their elements "
			         "%lld apart",
			         (const char *[]){"dq", "dk", "dv"}[g], (long long)st[r - 1]);
			return false;
		}
		/* one row: any stride serves; the step's rows are d apart at least */
		if (s->shape[r - 2] == 1)
			st[r - 2] = s->shape[r - 1];
		if (lay) {
			lay->off[g] = off;
			memcpy(lay->st[g], st, sizeof st);
		}
		pos += kl__nd(L, x->in[i])->shape[ax];
	}
	return true;
}
