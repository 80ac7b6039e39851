/* merge.c - products that share their left operand and whose weights are
 * adjacent slices of one buffer become one wider product.
 *
 * x @ W[a:b]^T and x @ W[b:c]^T (a SwiGLU's gate and up projections, or Q,
 * K and V, when their weights are row blocks of one [n, d] buffer) are
 * x @ W[a:c]^T with the two results side by side in its columns: one library
 * call reading x once, whose consumers read column slices of its output.
 * Nothing is copied: the wider weight is a view of the same buffer. Decided
 * here, on the traced graph (so only slices made inside the traced function
 * are seen, which is what makes it safe: the graph itself says that the
 * weights are adjacent); built by decompose.c. Every pair of products that
 * read the same left operand and stay apart is logged with the reason.
 * Skinny products (decompose.c: generated row reductions on CUDA) are left
 * alone: the scheduler already fuses the reductions that read one x into
 * one kernel, which a wider reduction read through slices would undo.
 */
#include <stdlib.h>

#include "lower/lower_int.h"

/* a product's right operand as [batch..., k, n] = expand(permute?(W[start:stop])) */
typedef struct wslice {
	int32_t base;      /* the buffer's node (2-d) */
	int axis;          /* of base: the rows (transposed) or the columns sliced */
	int64_t start, stop;
	bool perm;         /* W^T: the slice is of rows */
	bool expand;       /* broadcast to the product's batch dims */
} wslice;

static bool weight_slice(const kl_graph *g, int32_t b, wslice *w, char *why, size_t cap)
{
	const kl_node *x = &g->nodes[b];
	memset(w, 0, sizeof(*w));
	if (x->op == KL_OP_EXPAND) {
		const kl_node *in = &g->nodes[x->in[0]];
		if (in->ndim != 2 || x->shape[x->ndim - 2] != in->shape[0] ||
		    x->shape[x->ndim - 1] != in->shape[1]) {
			snprintf(why, cap, "its weight broadcasts a matrix of another shape");
			return false;
		}
		w->expand = true;
		b = x->in[0];
		x = in;
	}
	if (x->op == KL_OP_PERMUTE && x->ndim == 2 && x->a.v[0] == 1 && x->a.v[1] == 0) {
		w->perm = true;
		b = x->in[0];
		x = &g->nodes[b];
	}
	if (x->op != KL_OP_SLICE || x->ndim != 2 || x->a.v[2] != 1) {
		snprintf(why, cap, "its weight is not a unit-step slice of a matrix");
		return false;
	}
	/* the slice must cut the product's output columns */
	if (x->a.axis != (w->perm ? 0 : 1)) {
		snprintf(why, cap, "its weight is sliced along its inner dim, not its output columns");
		return false;
	}
	w->base = x->in[0];
	w->axis = x->a.axis;
	w->start = x->a.v[0];
	w->stop = x->a.v[0] + x->shape[x->a.axis];
	return true;
}

/* would the product of shape [..., rows, n] with inner dim k be a skinny
 * one (decompose.c) */
static bool skinny(const kl_lctx *L, const kl_node *s, int64_t n, int64_t k)
{
	int64_t rows = 1;
	for (int d = 0; d < s->ndim - 1; d++)
		rows *= s->shape[d];
	return kl__skinny_product(L, (kl_dtype)s->dtype, rows, n, k);
}

/* can products i and j (sharing in[0]) be one? w: their weights */
static bool pair_ok(const kl_lctx *L, int32_t i, int32_t j, char *why, size_t cap)
{
	const kl_graph *g = L->src;
	const kl_node *a = &g->nodes[i], *b = &g->nodes[j];
	wslice wa, wb;
	if (!weight_slice(g, a->in[1], &wa, why, cap) || !weight_slice(g, b->in[1], &wb, why, cap))
		return false;
	if (a->dtype != b->dtype || g->nodes[a->in[1]].dtype != a->dtype ||
	    g->nodes[b->in[1]].dtype != b->dtype) {
		snprintf(why, cap, "their dtypes differ");
		return false;
	}
	if (a->ndim != b->ndim || wa.perm != wb.perm || wa.expand != wb.expand) {
		snprintf(why, cap, "their weights are read through different views");
		return false;
	}
	for (int d = 0; d < a->ndim - 1; d++)
		if (a->shape[d] != b->shape[d]) {
			snprintf(why, cap, "their rows differ");
			return false;
		}
	if (wa.base != wb.base) {
		snprintf(why, cap, "their weights are slices of different buffers");
		return false;
	}
	return true;
}

const char *kl__src_label(const kl_lctx *L, int32_t n, char *buf, size_t cap)
{
	snprintf(buf, cap, "%s#%d", kl__ops[L->src->nodes[n].op].name, (int)n);
	return buf;
}

static int cmp_start(const void *x, const void *y)
{
	const int64_t *a = x, *b = y;
	return a[0] < b[0] ? -1 : a[0] > b[0];
}

kl_status kl__merge_plan(kl_lctx *L)
{
	const kl_graph *g = L->src;
	L->mlead = malloc(sizeof(int32_t) * ((size_t)g->n + 1));
	L->mcol = malloc(sizeof(int64_t) * ((size_t)g->n + 1));
	L->mspan = malloc(sizeof(int64_t) * 2 * ((size_t)g->n + 1));
	/* per candidate: (start, node) sorted */
	int64_t *run = malloc(sizeof(int64_t) * 2 * ((size_t)g->n + 1));
	uint8_t *done = calloc((size_t)g->n + 1, 1);
	if (!L->mlead || !L->mcol || !L->mspan || !run || !done) {
		free(run);
		free(done);
		return KL_ENOMEM;
	}
	for (int32_t i = 0; i < g->n; i++) {
		L->mlead[i] = -1;
		L->mcol[i] = 0;
	}
	char why[256], l1[64], l2[64], l3[64], l4[64];
	for (int32_t i = 0; i < g->n && L->o->fusion; i++) {
		const kl_node *s = &g->nodes[i];
		if (s->op != KL_OP_MATMUL || done[i] || (L->am && L->am[i].q >= 0))
			continue;
		/* the products after i that read i's x and could join it */
		int nr = 0;
		wslice wi;
		bool iw = weight_slice(g, s->in[1], &wi, why, sizeof(why));
		for (int32_t j = i; j < g->n; j++) {
			const kl_node *t = &g->nodes[j];
			if (t->op != KL_OP_MATMUL || done[j] || t->in[0] != s->in[0] ||
			    (L->am && L->am[j].q >= 0))
				continue;
			if (j != i && (!iw || !pair_ok(L, i, j, why, sizeof(why)))) {
				kl__lower_logf(L, "did not merge %s with %s (both read %s): %s",
				               kl__src_label(L, i, l1, sizeof(l1)),
				               kl__src_label(L, j, l2, sizeof(l2)),
				               kl__src_label(L, s->in[0], l3, sizeof(l3)), why);
				continue;
			}
			wslice wj;
			if (!weight_slice(g, t->in[1], &wj, why, sizeof(why)))
				continue; /* i alone: nothing to merge */
			run[2 * nr] = wj.start;
			run[2 * nr + 1] = j;
			nr++;
		}
		if (nr < 2)
			continue;
		qsort(run, (size_t)nr, 2 * sizeof(int64_t), cmp_start);
		/* maximal runs of adjacent slices */
		for (int r0 = 0; r0 < nr;) {
			int r1 = r0 + 1;
			int64_t k = g->nodes[s->in[0]].shape[g->nodes[s->in[0]].ndim - 1];
			wslice w0, wr;
			weight_slice(g, g->nodes[run[2 * r0 + 1]].in[1], &w0, why, sizeof(why));
			int64_t stop = w0.stop;
			for (; r1 < nr; r1++) {
				weight_slice(g, g->nodes[run[2 * r1 + 1]].in[1], &wr, why, sizeof(why));
				if (wr.start != stop)
					break;
				stop = wr.stop;
			}
			int32_t a = (int32_t)run[2 * r0 + 1];
			if (r1 < nr) {
				int32_t b = (int32_t)run[2 * r1 + 1];
				weight_slice(g, g->nodes[b].in[1], &wr, why, sizeof(why));
				kl__lower_logf(L, "did not merge %s with %s (both read %s): their weights "
				               "are not adjacent in %s (%s [%lld, %lld), then [%lld, %lld))",
				               kl__src_label(L, (int32_t)run[2 * (r1 - 1) + 1], l1, sizeof(l1)),
				               kl__src_label(L, b, l2, sizeof(l2)),
				               kl__src_label(L, s->in[0], l3, sizeof(l3)),
				               kl__src_label(L, w0.base, l4, sizeof(l4)),
				               w0.perm ? "rows" : "columns", (long long)w0.start,
				               (long long)stop, (long long)wr.start, (long long)wr.stop);
			}
			bool ok = r1 - r0 >= 2;
			int32_t lead = a;
			for (int q = r0; q < r1; q++)
				if ((int32_t)run[2 * q + 1] < lead)
					lead = (int32_t)run[2 * q + 1];
			const char *no = NULL;
			if (ok && w0.base > lead)
				no = "the weight buffer is made after the first product";
			else if (ok && skinny(L, s, stop - w0.start, k))
				no = "a skinny product is a generated row reduction on CUDA, and the "
				     "scheduler fuses reductions of one x into one kernel already";
			if (ok && no) {
				kl__lower_logf(L, "did not merge the products of %s with adjacent weights "
				               "from %s: %s",
				               kl__src_label(L, s->in[0], l1, sizeof(l1)),
				               kl__src_label(L, a, l2, sizeof(l2)), no);
				ok = false;
			}
			if (ok) {
				kl_sb names = {0};
				L->mspan[2 * lead] = w0.start;
				L->mspan[2 * lead + 1] = stop;
				for (int q = r0; q < r1; q++) {
					int32_t m = (int32_t)run[2 * q + 1];
					weight_slice(g, g->nodes[m].in[1], &wr, why, sizeof(why));
					L->mlead[m] = lead;
					L->mcol[m] = wr.start - w0.start;
					done[m] = 1;
					kl__sb_printf(&names, "%s%s", q > r0 ? ", " : "",
					              kl__src_label(L, m, l1, sizeof(l1)));
				}
				kl__lower_logf(L, "merged %s (all read %s) into one product of %lld "
				               "columns: their weights are adjacent %s [%lld, %lld) of %s",
				               names.s ? names.s : "",
				               kl__src_label(L, s->in[0], l1, sizeof(l1)),
				               (long long)(stop - w0.start), w0.perm ? "rows" : "columns",
				               (long long)w0.start, (long long)stop,
				               kl__src_label(L, w0.base, l2, sizeof(l2)));
				kl__sb_free(&names);
			}
			r0 = r1;
		}
		done[i] = 1;
	}
	free(run);
	free(done);
	return KL_OK;
}
