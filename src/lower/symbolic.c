/* symbolic.c - which dims of a graph are symbols (dynamic input dims and
 * every dim that must equal one) and which must stay static.
 *
 * Every dim of every node is a slot; ops say which slots are equal (a
 * pointwise op's output dim and its inputs' non-broadcast dims, a
 * permutation's dims, the two K dims of a matrix product, ...) and which
 * must be static (the 1/n of a mean, a slice's bounds, a reshape that mixes
 * a dim with others). Union-find over the slots then gives each class one
 * symbol or none; a class that holds a symbol and must be static is the
 * reason compiling dynamically is refused. Dims of size 0 or 1 never join a
 * class: they are specialized, as Dynamo does.
 */
#include <stdlib.h>

#include "lower/lower_int.h"

typedef struct uf {
	const kl_graph *g;
	int32_t *parent;
	int32_t *origin;  /* per root: smallest "input * 8 + dim" holding a symbol, or -1 */
	int32_t *fixed;   /* per slot: node that needs it static, or -1 */
} uf;

static int32_t find(uf *u, int32_t s)
{
	while (u->parent[s] != s) {
		u->parent[s] = u->parent[u->parent[s]];
		s = u->parent[s];
	}
	return s;
}

static int64_t val(const uf *u, int32_t n, int d)
{
	return u->g->nodes[n].shape[d];
}

static void join(uf *u, int32_t n1, int d1, int32_t n2, int d2)
{
	if (val(u, n1, d1) < 2 || val(u, n1, d1) != val(u, n2, d2))
		return;
	int32_t a = find(u, n1 * KL_MAX_DIMS + d1), b = find(u, n2 * KL_MAX_DIMS + d2);
	if (a == b)
		return;
	int32_t oa = u->origin[a], ob = u->origin[b];
	u->parent[b] = a;
	if (oa < 0 || (ob >= 0 && ob < oa))
		u->origin[a] = ob;
}

static void fix(uf *u, int32_t n, int d, int32_t by)
{
	if (val(u, n, d) >= 2 && u->fixed[n * KL_MAX_DIMS + d] < 0)
		u->fixed[n * KL_MAX_DIMS + d] = by;
}

static void fix_all(uf *u, int32_t n, int32_t by)
{
	for (int d = 0; d < u->g->nodes[n].ndim; d++)
		fix(u, n, d, by);
}

/* right-aligned broadcast: input dims that are not 1 equal the output's */
static void align(uf *u, int32_t out, int32_t in)
{
	const kl_node *o = &u->g->nodes[out], *x = &u->g->nodes[in];
	int off = o->ndim - x->ndim;
	for (int d = 0; d < x->ndim; d++)
		if (off + d >= 0)
			join(u, in, d, out, off + d);
}

static void same(uf *u, int32_t a, int32_t b)
{
	for (int d = 0; d < u->g->nodes[a].ndim && d < u->g->nodes[b].ndim; d++)
		join(u, a, d, b, d);
}

static void reshape(uf *u, int32_t n)
{
	const kl_node *o = &u->g->nodes[n];
	int32_t in = o->in[0];
	const kl_node *x = &u->g->nodes[in];
	if (kl__numel(x->ndim, x->shape) == 0)
		return;
	int i = 0, j = 0;
	while (i < x->ndim || j < o->ndim) {
		if (i < x->ndim && x->shape[i] == 1) {
			i++;
			continue;
		}
		if (j < o->ndim && o->shape[j] == 1) {
			j++;
			continue;
		}
		if (i >= x->ndim || j >= o->ndim)
			return;
		int i0 = i, j0 = j;
		int64_t pin = x->shape[i++], pout = o->shape[j++];
		while (pin != pout && i <= x->ndim && j <= o->ndim) {
			if (pin < pout && i < x->ndim)
				pin *= x->shape[i++];
			else if (j < o->ndim)
				pout *= o->shape[j++];
			else
				break;
		}
		if (i - i0 == 1 && j - j0 == 1) {
			join(u, in, i0, n, j0);
			continue;
		}
		for (int a = i0; a < i; a++)
			fix(u, in, a, n);
		for (int b = j0; b < j; b++)
			fix(u, n, b, n);
	}
}

static void rules(uf *u, int32_t n, const uint8_t *fixed_red)
{
	const kl_node *x = &u->g->nodes[n];
	kl_op op = (kl_op)x->op;
	switch (kl__ops[op].cat) {
	case KL_CAT_SOURCE:
		if (op == KL_OP_ARANGE)
			fix_all(u, n, n);
		return;
	case KL_CAT_BINARY:
	case KL_CAT_COMPARE:
	case KL_CAT_UNARY:
	case KL_CAT_UNARY_FLOAT:
	case KL_CAT_WHERE:
		for (int i = 0; i < x->nin; i++)
			align(u, n, x->in[i]);
		return;
	case KL_CAT_REDUCE: {
		int32_t in = x->in[0];
		bool stat = op == KL_OP_MEAN || op == KL_OP_VAR || (fixed_red && fixed_red[n]);
		int j = 0;
		for (int d = 0; d < u->g->nodes[in].ndim; d++) {
			if (x->a.axes & (1u << d)) {
				if (stat)
					fix(u, in, d, n);
				if (x->a.keepdim)
					j++;
			} else {
				join(u, in, d, n, j++);
			}
		}
		return;
	}
	case KL_CAT_COMPOSITE:
		if (op == KL_OP_CACHE_WRITE) {
			/* the result is the cache; values match it but for their rows
			 * and positions, which may vary alone; one position a row */
			int32_t c = x->in[0], p = x->in[1], v = x->in[2];
			same(u, c, n);
			for (int d = 1; d < x->ndim; d++)
				if (d != x->a.axis)
					join(u, v, d, c, d);
			join(u, p, 0, v, 0);
			return;
		}
		if (op == KL_OP_ATTENTION) {
			int32_t q = x->in[0], k = x->in[1], v = x->in[2];
			int r = x->ndim;
			for (int d = 0; d < r - 2; d++) {
				join(u, q, d, n, d);
				join(u, k, d, n, d);
				join(u, v, d, n, d);
			}
			join(u, q, r - 2, n, r - 2);
			join(u, q, r - 1, k, r - 1);
			join(u, k, r - 2, v, r - 2);
			join(u, v, r - 1, n, r - 1);
			bool has_len = (x->a.flags & KL_F_LENGTHS) != 0;
			if (has_len)
				join(u, x->in[3], 0, n, 0);
			/* a causal attention or one with lengths that is decomposed
			 * (CUDA, head dims above 256) builds its mask from aranges of
			 * the sequence lengths */
			if (((x->a.flags & KL_F_CAUSAL) || has_len) &&
			    (u->g->nodes[q].shape[r - 1] > 256 || x->shape[r - 1] > 256)) {
				if (x->a.flags & KL_F_CAUSAL)
					fix(u, n, r - 2, n);
				fix(u, k, r - 2, n);
			}
			return;
		}
		if (op == KL_OP_ATTENTION_BWD) {
			/* q, o, do [..., Tq, D]; k, v [..., Tk, D]; the node
			 * [..., Tq + 2 Tk, D]: a sum of sizes, so the sequence
			 * dims stay static */
			int r = x->ndim;
			for (int i = 0; i < 5; i++) {
				for (int d = 0; d < r - 2; d++)
					join(u, x->in[i], d, n, d);
				join(u, x->in[i], r - 1, n, r - 1);
				fix(u, x->in[i], r - 2, n);
			}
			fix(u, n, r - 2, n);
			return;
		}
		same(u, x->in[0], n);
		if (op == KL_OP_LAYER_NORM || op == KL_OP_RMS_NORM) {
			fix(u, n, x->ndim - 1, n);
			for (int i = 1; i < x->nin; i++)
				join(u, x->in[i], 0, n, x->ndim - 1);
		}
		return;
	case KL_CAT_CONTRACT: {
		int32_t a = x->in[0], b = x->in[1];
		int k = x->ndim;
		if (k >= KL_MAX_DIMS) { /* no room to lower it as a generated product */
			fix_all(u, n, n);
			fix_all(u, a, n);
			fix_all(u, b, n);
		}
		for (int d = 0; d < k - 2; d++) {
			join(u, a, d, n, d);
			join(u, b, d, n, d);
		}
		join(u, a, k - 2, n, k - 2);
		join(u, b, k - 1, n, k - 1);
		join(u, a, k - 1, b, k - 2);
		return;
	}
	default:
		break;
	}
	switch (op) {
	case KL_OP_RESHAPE:
		reshape(u, n);
		return;
	case KL_OP_PERMUTE:
		for (int d = 0; d < x->ndim; d++)
			join(u, x->in[0], (int)x->a.v[d], n, d);
		return;
	case KL_OP_EXPAND:
		align(u, n, x->in[0]);
		return;
	case KL_OP_SLICE:
		same(u, x->in[0], n);
		fix(u, x->in[0], x->a.axis, n);
		fix(u, n, x->a.axis, n);
		return;
	case KL_OP_CONCAT:
		for (int i = 0; i < x->nin; i++) {
			same(u, x->in[i], n);
			fix(u, x->in[i], x->a.axis, n);
		}
		fix(u, n, x->a.axis, n);
		return;
	case KL_OP_CONTIGUOUS:
		same(u, x->in[0], n);
		return;
	case KL_OP_GATHER: { /* idx's dims lead, the table's row dims follow */
		int k = u->g->nodes[x->in[1]].ndim;
		for (int d = 0; d < k; d++)
			join(u, x->in[1], d, n, d);
		for (int d = 1; d < u->g->nodes[x->in[0]].ndim; d++)
			join(u, x->in[0], d, n, k + d - 1);
		return;
	}
	default:
		return;
	}
}

static int cmp_i32(const void *a, const void *b)
{
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
	return (x > y) - (x < y);
}

/* A dynamic dim that reaches a slot which needs a static size: input
 * `input`'s dim `dim` meets dim `slot_dim` of node `by`. */
typedef struct conflict {
	int32_t input, dim, by, slot_node, slot_dim;
} conflict;

/* Symbols of g under masks; -1 with *cf set (or err: out of memory, a
 * non-dense dynamic input, too many symbols) when a dynamic dim cannot stay
 * one. */
static int symbolize(const kl_graph *g, const uint32_t *masks, const uint8_t *fixed_red,
                     int32_t *sym, int32_t *sym_input, int32_t *sym_dim, conflict *cf, char *err,
                     size_t errcap)
{
	cf->input = -1;
	size_t ns = (size_t)g->n * KL_MAX_DIMS;
	memset(sym, 0, sizeof(*sym) * ns);
	if (!masks)
		return 0;
	uf u = {.g = g};
	u.parent = malloc(sizeof(int32_t) * (ns + 1));
	u.origin = malloc(sizeof(int32_t) * (ns + 1));
	u.fixed = malloc(sizeof(int32_t) * (ns + 1));
	int32_t *roots = malloc(sizeof(int32_t) * (ns + 1));
	int rc = -1;
	if (!u.parent || !u.origin || !u.fixed || !roots) {
		snprintf(err, errcap, "out of memory");
		goto done;
	}
	for (size_t s = 0; s < ns; s++) {
		u.parent[s] = (int32_t)s;
		u.origin[s] = -1;
		u.fixed[s] = -1;
	}
	for (int32_t i = 0; i < g->ninputs; i++) {
		int32_t n = g->inputs[i];
		const kl_node *x = &g->nodes[n];
		bool any = false;
		for (int d = 0; d < x->ndim; d++) {
			if (x->shape[d] < 2)
				continue;
			if (masks[i] & (1u << d)) {
				u.origin[n * KL_MAX_DIMS + d] = i * KL_MAX_DIMS + d;
				any = true;
			} else {
				u.fixed[n * KL_MAX_DIMS + d] = n;
			}
		}
		if (any) {
			int64_t st[KL_MAX_DIMS];
			kl__contig_strides(x->ndim, x->shape, st);
			for (int d = 0; d < x->ndim; d++)
				if (x->shape[d] != 1 && x->strides[d] != st[d]) {
					snprintf(err, errcap,
					         "input %d is not contiguous: a dynamic input must be", i);
					goto done;
				}
		}
	}
	for (int32_t n = 0; n < g->n; n++)
		rules(&u, n, fixed_red);
	/* a class with a symbol that something needs static */
	for (size_t s = 0; s < ns; s++) {
		if (u.fixed[s] < 0)
			continue;
		int32_t r = find(&u, (int32_t)s);
		if (u.origin[r] < 0)
			continue;
		*cf = (conflict){u.origin[r] / KL_MAX_DIMS, u.origin[r] % KL_MAX_DIMS, u.fixed[s],
		                 (int32_t)(s / KL_MAX_DIMS), (int)(s % KL_MAX_DIMS)};
		goto done;
	}
	/* number the symbols by where they come from */
	int nr = 0;
	for (size_t s = 0; s < ns; s++) {
		int32_t r = find(&u, (int32_t)s);
		if (u.origin[r] < 0 || (int32_t)s / KL_MAX_DIMS >= g->n ||
		    (int)(s % KL_MAX_DIMS) >= g->nodes[s / KL_MAX_DIMS].ndim)
			continue;
		bool seen = false;
		for (int i = 0; i < nr && !seen; i++)
			seen = roots[i] == u.origin[r];
		if (!seen)
			roots[nr++] = u.origin[r];
	}
	if (nr > KL_MAX_DIMS * 4) {
		snprintf(err, errcap, "%d dynamic dims: at most %d", nr, KL_MAX_DIMS * 4);
		goto done;
	}
	qsort(roots, (size_t)nr, sizeof(int32_t), cmp_i32);
	for (int k = 0; k < nr; k++) {
		sym_input[k] = roots[k] / KL_MAX_DIMS;
		sym_dim[k] = roots[k] % KL_MAX_DIMS;
	}
	for (size_t s = 0; s < ns; s++) {
		if ((int)(s % KL_MAX_DIMS) >= g->nodes[s / KL_MAX_DIMS].ndim)
			continue;
		int32_t o = u.origin[find(&u, (int32_t)s)];
		if (o < 0)
			continue;
		for (int k = 0; k < nr; k++)
			if (roots[k] == o)
				sym[s] = k + 1;
	}
	rc = nr;
done:
	free(u.parent);
	free(u.origin);
	free(u.fixed);
	free(roots);
	return rc;
}

/* Why node cf->by needs a static size where the dynamic dim meets it, in
 * the words of the call the user made (graph nodes of the caller's trace
 * are public calls; the lowered graph's are named by the call they came
 * from through orig). */
static void describe(const kl_graph *g, const conflict *cf, const kl_graph *src,
                     const int32_t *orig, char *buf, size_t cap)
{
	int32_t by = orig ? orig[cf->by] : cf->by;
	const kl_graph *ng = orig ? src : g;
	const kl_node *x = &ng->nodes[by];
	char sh[128];
	kl__shape_str(sh, sizeof sh, x->ndim, x->shape);
	const char *why = "which needs a static size there";
	switch ((kl_op)x->op) {
	case KL_OP_INPUT:
		snprintf(buf, cap,
		         "it meets a static dim of a %s %s tensor (a weight, or an input whose dim "
		         "is not marked dynamic)",
		         kl_dtype_name((kl_dtype)x->dtype), sh);
		return;
	case KL_OP_ARANGE:
		why = "whose length is a number fn passed (it is baked into the graph)";
		break;
	case KL_OP_MEAN:
	case KL_OP_VAR:
		why = "which divides by the count of the reduced dim";
		break;
	case KL_OP_SLICE:
	case KL_OP_CONCAT:
		why = "whose bounds along the dim are numbers fn passed";
		break;
	case KL_OP_RESHAPE:
		why = "which merges or splits the dim with others";
		break;
	case KL_OP_LAYER_NORM:
	case KL_OP_RMS_NORM:
		why = "which normalizes over the dim";
		break;
	default:
		break;
	}
	snprintf(buf, cap, "it reaches kl_%s (result %s %s), %s", kl__ops[x->op].name,
	         kl_dtype_name((kl_dtype)x->dtype), sh, why);
}

int kl__graph_symbolize(const kl_graph *g, const uint32_t *dyn_masks, int32_t *sym,
                        int32_t *sym_input, int32_t *sym_dim, char *err, size_t errcap)
{
	conflict cf;
	int n = symbolize(g, dyn_masks, NULL, sym, sym_input, sym_dim, &cf, err, errcap);
	if (n < 0 && cf.input >= 0) {
		char why[224];
		describe(g, &cf, NULL, NULL, why, sizeof why);
		snprintf(err, errcap, "dynamic dim %d of input %d needs a static size: %s", cf.dim,
		         cf.input, why);
	}
	return n;
}

kl_status kl__graph_specialize(const kl_graph *g, const uint32_t *dyn_masks, uint32_t *out,
                               kl_spec *spec, int cap, int *nspec, char *err, size_t errcap)
{
	*nspec = 0;
	for (int32_t i = 0; i < g->ninputs; i++)
		out[i] = dyn_masks ? dyn_masks[i] : 0;
	if (!dyn_masks)
		return KL_OK;
	size_t ns = (size_t)g->n * KL_MAX_DIMS;
	int32_t *sym = malloc(sizeof(int32_t) * (ns + 1));
	int32_t si[KL_MAX_DIMS * 4 + 1], sd[KL_MAX_DIMS * 4 + 1];
	if (!sym) {
		snprintf(err, errcap, "out of memory");
		return KL_ENOMEM;
	}
	kl_status st = KL_OK;
	/* each round specialises one dim: at most every input dim once */
	for (int round = 0; round <= g->ninputs * KL_MAX_DIMS; round++) {
		conflict cf;
		err[0] = 0;
		if (symbolize(g, out, NULL, sym, si, sd, &cf, err, errcap) >= 0)
			break;
		if (cf.input < 0) {
			st = KL_EUNSUPPORTED; /* not a static need: err says what */
			break;
		}
		out[cf.input] &= ~(1u << cf.dim);
		if (*nspec < cap) {
			kl_spec *sp = &spec[(*nspec)++];
			sp->input = cf.input;
			sp->dim = cf.dim;
			sp->value = g->nodes[g->inputs[cf.input]].shape[cf.dim];
			describe(g, &cf, NULL, NULL, sp->why, sizeof sp->why);
		}
	}
	free(sym);
	return st;
}

kl_status kl__symbolize_lowered(kl_lctx *L)
{
	L->sym = calloc((size_t)L->g.n * KL_MAX_DIMS + 1, sizeof(int32_t));
	uint8_t *fixed_red = calloc((size_t)L->g.n + 1, 1);
	if (!L->sym || !fixed_red) {
		free(fixed_red);
		snprintf(L->err, L->errcap, "kl__lower: out of memory");
		return KL_ENOMEM;
	}
	/* sums that came from a mean, var or norm divide by their count */
	for (int32_t n = 0; n < L->g.n; n++) {
		kl_op so = (kl_op)L->src->nodes[L->orig[n]].op;
		fixed_red[n] = so == KL_OP_MEAN || so == KL_OP_VAR || so == KL_OP_LAYER_NORM ||
		               so == KL_OP_RMS_NORM;
	}
	char why[256] = "";
	conflict cf;
	int ns = symbolize(&L->g, L->o->dyn_masks, fixed_red, L->sym, L->sym_input, L->sym_dim, &cf,
	                   why, sizeof(why));
	free(fixed_red);
	if (ns < 0 && cf.input >= 0)
		describe(&L->g, &cf, L->src, L->orig, why, sizeof why);
	if (ns < 0) {
		snprintf(L->err, L->errcap,
		         "kl__lower: cannot keep dims dynamic: dynamic dim %d of input %d: %s",
		         cf.dim, cf.input, why);
		return KL_EUNSUPPORTED;
	}
	L->nsyms = ns;
	return KL_OK;
}
