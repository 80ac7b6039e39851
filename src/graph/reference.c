/* reference.c - the float64 reference interpreter, the oracle of every test.
 * Each node is computed straight from its mathematical definition in double,
 * then rounded to its dtype; no code is shared with the backends.
 */
#include "graph/reference.h"

#include "graph/optable.h"

#include <stdio.h>
#include <stdlib.h>

#include "core/core.h"
#include "core/sat.h"
#include "core/shape.h"

/* Everything one evaluation needs to report an error and find values. */
typedef struct kl_refstate {
	const kl_graph *g;
	double **val; /* per node: its values (dense, row-major), or NULL */
	bool *owned;  /* val[i] was allocated here (inputs are borrowed) */
	char *err;
	size_t errcap;
	int32_t cur; /* the node being evaluated, for messages */
} kl_refstate;
typedef kl_refstate ref_state;

static kl_status ref_fail(ref_state *st, kl_status s, const char *fmt, ...) KL_PRINTF(3, 4);

static kl_status ref_fail(ref_state *st, kl_status s, const char *fmt, ...)
{
	if (!st->err || st->errcap == 0)
		return s;
	int n = 0;
	if (st->cur >= 0) {
		const kl_node *nd = &st->g->nodes[st->cur];
		const char *name = nd->op < KL_NOPS ? kl__ops[nd->op].name : "?";
		n = snprintf(st->err, st->errcap, "kl__ref_eval: node %d (%s): ", (int)st->cur,
		             name);
		if (n < 0 || (size_t)n >= st->errcap)
			return s;
	} else {
		n = snprintf(st->err, st->errcap, "kl__ref_eval: ");
		if (n < 0 || (size_t)n >= st->errcap)
			return s;
	}
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(st->err + n, st->errcap - (size_t)n, fmt, ap);
	va_end(ap);
	return s;
}

/* ---- integer arithmetic: exact, wrapping like C integers of the width ---- */

static bool is_int(kl_dtype dt)
{
	return dt == KL_I32 || dt == KL_I64;
}

/* The two's-complement value of the low bits of u at dt's width. */
double kl__wrap_to(kl_dtype dt, uint64_t u)
{
	if (dt == KL_I32) {
		uint32_t w = (uint32_t)u;
		int64_t s = w >= 0x80000000u ? (int64_t)w - 0x100000000ll : (int64_t)w;
		return (double)s;
	}
	int64_t s = u >= 0x8000000000000000ull ? -(int64_t)(~u) - 1 : (int64_t)u;
	return (double)s;
}

/* ---- shapes and index walking ------------------------------------------- */

static const char *shp(char *buf, size_t cap, const kl_node *n)
{
	return kl__shape_str(buf, cap, n->ndim, n->shape);
}

/* Row-major strides of an input read as the broadcast shape (ond, oshape):
 * 0 where the input has no such dim or has size 1. */
static void bcast_strides(const kl_node *in, int ond, const int64_t *oshape, int64_t *str)
{
	int64_t s = 1;
	int lead = ond - in->ndim;
	for (int d = ond - 1; d >= 0; d--) {
		int k = d - lead;
		if (k < 0) {
			str[d] = 0;
			continue;
		}
		str[d] = (in->shape[k] == 1 && oshape[d] != 1) ? 0 : s;
		s *= in->shape[k];
	}
}

/* A multi-index walk over a shape, carrying up to 4 linear offsets along. */
typedef struct walk {
	int nd;
	int nops;
	int64_t shape[KL_MAX_DIMS];
	int64_t idx[KL_MAX_DIMS];
	int64_t str[4][KL_MAX_DIMS];
	int64_t off[4];
} walk;

static void walk_init(walk *w, int nd, const int64_t *shape, int nops)
{
	memset(w, 0, sizeof *w);
	w->nd = nd;
	w->nops = nops;
	memcpy(w->shape, shape, sizeof(int64_t) * (size_t)nd);
}

static void walk_next(walk *w)
{
	for (int d = w->nd - 1; d >= 0; d--) {
		w->idx[d]++;
		for (int k = 0; k < w->nops; k++)
			w->off[k] += w->str[k][d];
		if (w->idx[d] < w->shape[d])
			return;
		for (int k = 0; k < w->nops; k++)
			w->off[k] -= w->str[k][d] * w->shape[d];
		w->idx[d] = 0;
	}
}

static int64_t node_numel(const kl_node *n)
{
	return kl__numel(n->ndim, n->shape);
}

/* ---- pointwise ------------------------------------------------------------ */

/* Pointwise ops read their inputs broadcast (numpy rules) to the node's
 * shape, whether or not the front end made the broadcast explicit; each
 * element is the op table's definition (kl__op_eval). */
kl_status kl__ref_pointwise(ref_state *st, const kl_node *n, double *out)
{
	kl_cat cat = kl__ops[n->op].cat;
	bool scal = (cat == KL_CAT_BINARY || cat == KL_CAT_COMPARE) && n->a.scalar_rhs;
	walk w;
	walk_init(&w, n->ndim, n->shape, n->nin);
	const double *src[3] = {0};
	for (int i = 0; i < n->nin; i++) {
		bcast_strides(&st->g->nodes[n->in[i]], n->ndim, n->shape, w.str[i]);
		src[i] = st->val[n->in[i]];
	}
	int64_t total = node_numel(n);
	for (int64_t i = 0; i < total; i++, walk_next(&w)) {
		double v[3] = {0, 0, 0};
		for (int k = 0; k < n->nin; k++)
			v[k] = src[k][w.off[k]];
		if (scal)
			v[1] = n->a.s[0];
		out[i] = kl__op_eval((kl_op)n->op, &n->a, (kl_dtype)n->dtype, v[0], v[1], v[2]);
	}
	return KL_OK;
}

/* ---- reductions ------------------------------------------------------------- */

/* The layout of "reduce the dims in mask": an outer walk over the kept dims
 * and the offsets of one row (the reduced dims) relative to its start. */
typedef struct rows {
	int64_t nrows, rowlen;
	int64_t *inner; /* rowlen offsets */
	walk outer;     /* off[0]: the row's start */
} rows;

static kl_status rows_init(ref_state *st, rows *r, int nd, const int64_t *shape, uint32_t mask)
{
	int64_t str[KL_MAX_DIMS];
	kl__contig_strides(nd, shape, str);
	int64_t oshape[KL_MAX_DIMS], ostr[KL_MAX_DIMS], ishape[KL_MAX_DIMS], istr[KL_MAX_DIMS];
	int ond = 0, ind = 0;
	for (int d = 0; d < nd; d++) {
		if (mask >> d & 1) {
			ishape[ind] = shape[d];
			istr[ind++] = str[d];
		} else {
			oshape[ond] = shape[d];
			ostr[ond++] = str[d];
		}
	}
	r->nrows = kl__numel(ond, oshape);
	r->rowlen = kl__numel(ind, ishape);
	r->inner = malloc(sizeof(int64_t) * (size_t)(r->rowlen > 0 ? r->rowlen : 1));
	if (!r->inner)
		return ref_fail(st, KL_ENOMEM, "out of memory for %lld row offsets",
		                (long long)r->rowlen);
	walk iw;
	walk_init(&iw, ind, ishape, 1);
	memcpy(iw.str[0], istr, sizeof istr);
	for (int64_t j = 0; j < r->rowlen; j++, walk_next(&iw))
		r->inner[j] = iw.off[0];
	walk_init(&r->outer, ond, oshape, 1);
	memcpy(r->outer.str[0], ostr, sizeof ostr);
	return KL_OK;
}

/* Sum with Neumaier compensation: the oracle should be the most exact party. */
double kl__ref_sum(const double *x, int64_t n)
{
	double s = 0, c = 0;
	for (int64_t i = 0; i < n; i++) {
		double t = s + x[i];
		if (fabs(s) >= fabs(x[i]))
			c += (s - t) + x[i];
		else
			c += (x[i] - t) + s;
		s = t;
	}
	/* the compensation is meaningless once the sum left the finite range
	 * (inf - inf would turn a true +-inf into NaN) */
	return isfinite(s) ? s + c : s;
}

/* sum of x[i] * y[i], compensated like kl__ref_sum */
static double sum_exact_dot(const double *x, const double *y, int64_t n)
{
	double acc = 0, c = 0;
	for (int64_t i = 0; i < n; i++) {
		double p = x[i] * y[i], t = acc + p;
		c += fabs(acc) >= fabs(p) ? (acc - t) + p : (p - t) + acc;
		acc = t;
	}
	return acc + c;
}

kl_status kl__ref_reduce(ref_state *st, const kl_node *n, double *out)
{
	const kl_node *x = &st->g->nodes[n->in[0]];
	uint32_t mask = kl__reduce_mask(n, x->ndim);
	char b1[96];
	rows r;
	kl_status s = rows_init(st, &r, x->ndim, x->shape, mask);
	if (s)
		return s;
	if (r.rowlen == 0 && r.nrows > 0 && kl__opdesc[n->op]->no_identity) {
		free(r.inner);
		return ref_fail(st, KL_EINVAL, "reduction of %s over zero elements",
		                shp(b1, sizeof b1, x));
	}
	double *row = malloc(sizeof(double) * (size_t)(r.rowlen > 0 ? r.rowlen : 1));
	if (!row) {
		free(r.inner);
		return ref_fail(st, KL_ENOMEM, "out of memory");
	}
	const double *src = st->val[n->in[0]];
	for (int64_t o = 0; o < r.nrows; o++, walk_next(&r.outer)) {
		for (int64_t j = 0; j < r.rowlen; j++)
			row[j] = src[r.outer.off[0] + r.inner[j]];
		out[o] = kl__opdesc[n->op]->row(n, row, r.rowlen);
	}
	free(row);
	free(r.inner);
	return KL_OK;
}

/* ---- movement ------------------------------------------------------------- */

/* out[i, j] = table[idx[i], j] with i over idx's elements, j over a row */
static kl_status eval_gather(ref_state *st, const kl_node *n, double *out)
{
	char b1[96], b2[96], b3[96];
	if (n->nin != 2)
		return ref_fail(st, KL_EINVAL, "%d inputs, expected 2", n->nin);
	const kl_node *t = &st->g->nodes[n->in[0]], *x = &st->g->nodes[n->in[1]];
	bool ok = t->ndim >= 1 && is_int((kl_dtype)x->dtype) && x->ndim + t->ndim - 1 == n->ndim;
	for (int d = 0; ok && d < x->ndim; d++)
		ok = x->shape[d] == n->shape[d];
	for (int d = 1; ok && d < t->ndim; d++)
		ok = t->shape[d] == n->shape[x->ndim + d - 1];
	if (!ok)
		return ref_fail(st, KL_EINVAL, "table %s, indices %s (%s), node %s",
		                shp(b1, sizeof b1, t), shp(b2, sizeof b2, x),
		                kl_dtype_name((kl_dtype)x->dtype), shp(b3, sizeof b3, n));
	const double *tab = st->val[n->in[0]], *ix = st->val[n->in[1]];
	int64_t nrow = t->shape[0], row = node_numel(t) / (nrow ? nrow : 1);
	int64_t ni = node_numel(x);
	for (int64_t i = 0; i < ni; i++) {
		double v = ix[i];
		if (!(v >= 0 && v < (double)nrow))
			return ref_fail(st, KL_EINVAL, "index %.17g (element %lld) out of range for "
			                "a table of %lld rows", v, (long long)i, (long long)nrow);
		int64_t r = (int64_t)v;
		memcpy(out + i * row, tab + r * row, sizeof(double) * (size_t)row);
	}
	return KL_OK;
}

/* out = base, then out[idx[i], ...] += src[i, ...] for i in order */
kl_status kl__ref_index_add(ref_state *st, const kl_node *n, double *out)
{
	const kl_node *b = &st->g->nodes[n->in[0]], *x = &st->g->nodes[n->in[1]];
	const double *base = st->val[n->in[0]], *ix = st->val[n->in[1]], *src = st->val[n->in[2]];
	int64_t nrow = b->shape[0], row = nrow ? node_numel(b) / nrow : 0;
	memcpy(out, base, sizeof(double) * (size_t)node_numel(b));
	int64_t ni = node_numel(x);
	for (int64_t i = 0; i < ni; i++) {
		double v = ix[i];
		if (!(v >= 0 && v < (double)nrow))
			return ref_fail(st, KL_EINVAL, "index %.17g (element %lld) out of range for "
			                "a base of %lld rows", v, (long long)i, (long long)nrow);
		int64_t r = (int64_t)v;
		for (int64_t j = 0; j < row; j++)
			out[r * row + j] += src[i * row + j];
	}
	return KL_OK;
}

kl_status kl__ref_cache_write(ref_state *st, const kl_node *n, double *out)
{
	const kl_node *c = &st->g->nodes[n->in[0]], *p = &st->g->nodes[n->in[1]],
	              *v = &st->g->nodes[n->in[2]];
	kl_cw_geom G;
	char why[320];
	if (!kl__cache_write_geom(n->a.axis, c->ndim, c->shape, p->ndim, p->shape, v->ndim,
	                          v->shape, &G, why, sizeof why))
		return ref_fail(st, KL_EINVAL, "%s", why);
	const double *base = st->val[n->in[0]], *pos = st->val[n->in[1]], *val = st->val[n->in[2]];
	memcpy(out, base, sizeof(double) * (size_t)node_numel(c));
	for (int64_t i = 0; i < G.rows; i++) {
		double at = pos[i];
		if (!(at >= 0 && at <= (double)(G.cap - G.s)))
			return ref_fail(st, KL_EINVAL, "row %lld: position %.17g outside [0, %lld] (a "
			                "cache of %lld positions, %lld written)", (long long)i, at,
			                (long long)(G.cap - G.s), (long long)G.cap, (long long)G.s);
		for (int64_t a = 0; a < G.outer; a++)
			for (int64_t j = 0; j < G.s; j++)
				memcpy(out + ((i * G.outer + a) * G.cap + (int64_t)at + j) * G.inner,
				       val + ((i * G.outer + a) * G.s + j) * G.inner,
				       sizeof(double) * (size_t)G.inner);
	}
	return KL_OK;
}

kl_status kl__ref_movement(ref_state *st, const kl_node *n, double *out)
{
	char b1[96], b2[96];
	int64_t total = node_numel(n);
	if (n->op == KL_OP_CONCAT) {
		int ax = n->a.axis;
		if (n->nin < 1 || ax < 0 || ax >= n->ndim)
			return ref_fail(st, KL_EINVAL, "%d inputs, axis %d of %d dims", n->nin, ax,
			                n->ndim);
		int64_t at = 0;
		for (int i = 0; i < n->nin; i++) {
			const kl_node *x = &st->g->nodes[n->in[i]];
			bool ok = x->ndim == n->ndim;
			for (int d = 0; ok && d < n->ndim; d++)
				ok = d == ax || x->shape[d] == n->shape[d];
			if (!ok)
				return ref_fail(st, KL_EINVAL, "input %d shape %s does not fit %s",
				                i, shp(b1, sizeof b1, x), shp(b2, sizeof b2, n));
			at += x->shape[ax];
		}
		if (at != n->shape[ax])
			return ref_fail(st, KL_EINVAL,
			                "inputs add up to %lld along axis %d, node has %lld",
			                (long long)at, ax, (long long)n->shape[ax]);
		int64_t outer = kl__numel(ax, n->shape);
		int64_t inner = kl__numel(n->ndim - ax - 1, n->shape + ax + 1);
		int64_t orow = n->shape[ax] * inner;
		at = 0;
		for (int i = 0; i < n->nin; i++) {
			const kl_node *x = &st->g->nodes[n->in[i]];
			const double *src = st->val[n->in[i]];
			int64_t xrow = x->shape[ax] * inner;
			for (int64_t o = 0; o < outer; o++)
				for (int64_t j = 0; j < xrow; j++)
					out[o * orow + at + j] = src[o * xrow + j];
			at += xrow;
		}
		return KL_OK;
	}
	if (n->op == KL_OP_GATHER)
		return eval_gather(st, n, out);
	if (n->nin != 1)
		return ref_fail(st, KL_EINVAL, "%d inputs, expected 1", n->nin);
	const kl_node *x = &st->g->nodes[n->in[0]];
	const double *src = st->val[n->in[0]];
	walk w;
	walk_init(&w, n->ndim, n->shape, 1);
	int64_t xs[KL_MAX_DIMS];
	kl__contig_strides(x->ndim, x->shape, xs);
	switch ((kl_op)n->op) {
	case KL_OP_RESHAPE:
	case KL_OP_CONTIGUOUS:
		if (node_numel(x) != total ||
		    (n->op == KL_OP_CONTIGUOUS && !kl__shape_eq(x->ndim, x->shape, n->ndim, n->shape)))
			return ref_fail(st, KL_EINVAL, "input %s, node %s", shp(b1, sizeof b1, x),
			                shp(b2, sizeof b2, n));
		memcpy(out, src, sizeof(double) * (size_t)total);
		return KL_OK;
	case KL_OP_PERMUTE: {
		uint32_t seen = 0;
		bool ok = x->ndim == n->ndim;
		for (int d = 0; ok && d < n->ndim; d++) {
			int64_t p = n->a.v[d];
			ok = p >= 0 && p < x->ndim && !(seen >> p & 1) &&
			     x->shape[p] == n->shape[d];
			if (ok) {
				seen |= 1u << p;
				w.str[0][d] = xs[p];
			}
		}
		if (!ok)
			return ref_fail(st, KL_EINVAL, "bad permutation of %s to %s",
			                shp(b1, sizeof b1, x), shp(b2, sizeof b2, n));
		break;
	}
	case KL_OP_EXPAND: {
		bool ok = x->ndim <= n->ndim;
		int lead = n->ndim - x->ndim;
		for (int d = 0; ok && d < x->ndim; d++)
			ok = x->shape[d] == 1 || x->shape[d] == n->shape[d + lead];
		if (!ok)
			return ref_fail(st, KL_EINVAL, "cannot expand %s to %s",
			                shp(b1, sizeof b1, x), shp(b2, sizeof b2, n));
		bcast_strides(x, n->ndim, n->shape, w.str[0]);
		break;
	}
	case KL_OP_SLICE: {
		int ax = n->a.axis;
		int64_t start = n->a.v[0], stop = n->a.v[1], step = n->a.v[2], len = -1;
		bool ok = x->ndim == n->ndim && ax >= 0 && ax < n->ndim && start >= 0 &&
		          stop >= start;
		for (int d = 0; ok && d < n->ndim; d++)
			ok = d == ax || x->shape[d] == n->shape[d];
		/* the bounds are normalized already: slicing again must keep them
		 * and give the node's length, so every element read is inside */
		int64_t s0 = start, s1 = stop;
		if (ok)
			ok = kl__slice_len(x->shape[ax], &s0, &s1, step, &len) && s0 == start &&
			     s1 == stop && len == n->shape[ax];
		if (ok)
			ok = kl__slice_stride(xs[ax], step, len, &w.str[0][ax]);
		if (!ok)
			return ref_fail(st, KL_EINVAL,
			                "slice %lld:%lld:%lld on axis %d of %s to %s",
			                (long long)start, (long long)stop, (long long)step, ax,
			                shp(b1, sizeof b1, x), shp(b2, sizeof b2, n));
		for (int d = 0; d < n->ndim; d++)
			if (d != ax)
				w.str[0][d] = xs[d];
		w.off[0] = len > 0 ? start * xs[ax] : 0;
		break;
	}
	default: return ref_fail(st, KL_EINVAL, "not a movement op");
	}
	for (int64_t i = 0; i < total; i++, walk_next(&w))
		out[i] = src[w.off[0]];
	return KL_OK;
}

/* ---- matmul and composites ------------------------------------------------- */

kl_status kl__ref_matmul(ref_state *st, const kl_node *n, double *out)
{
	const kl_node *a = &st->g->nodes[n->in[0]];
	int nd = n->ndim;
	int64_t M = n->shape[nd - 2], N = n->shape[nd - 1], K = a->shape[nd - 1];
	int64_t batch = kl__numel(nd - 2, n->shape);
	const double *A = st->val[n->in[0]], *B = st->val[n->in[1]];
	kl_dtype dt = (kl_dtype)n->dtype;
	for (int64_t bi = 0; bi < batch; bi++) {
		const double *Ab = A + bi * M * K, *Bb = B + bi * K * N;
		double *C = out + bi * M * N;
		for (int64_t i = 0; i < M; i++) {
			for (int64_t j = 0; j < N; j++) {
				if (is_int(dt)) {
					uint64_t acc = 0;
					for (int64_t k = 0; k < K; k++)
						acc += (uint64_t)kl__f2i64(Ab[i * K + k]) *
						       (uint64_t)kl__f2i64(Bb[k * N + j]);
					C[i * N + j] = kl__wrap_to(dt, acc);
				} else {
					double acc = 0, c = 0;
					for (int64_t k = 0; k < K; k++) {
						double p = Ab[i * K + k] * Bb[k * N + j];
						double t = acc + p;
						c += fabs(acc) >= fabs(p) ? (acc - t) + p
						                          : (p - t) + acc;
						acc = t;
					}
					C[i * N + j] = acc + c;
				}
			}
		}
	}
	return KL_OK;
}

/* softmax(q k^T * scale [+ causal mask]) v, in double; a query row with no
 * allowed key is NaN, as the same math written out gives (0 / 0). With
 * lengths (graph/ops.def) row b's keys end at clamp(lengths[b], 0, Tk), the
 * causal diagonal is aligned to that end, and a row with no key gives 0. */
kl_status kl__ref_attention(ref_state *st, const kl_node *n, double *out)
{
	char b1[96], b2[96], b3[96];
	bool has_len = (n->a.flags & KL_F_LENGTHS) != 0;
	if (n->nin != 3 + has_len)
		return ref_fail(st, KL_EINVAL, "%d inputs, expected %d", n->nin, 3 + has_len);
	const kl_node *q = &st->g->nodes[n->in[0]], *k = &st->g->nodes[n->in[1]],
	              *v = &st->g->nodes[n->in[2]];
	int nd = n->ndim;
	bool ok = nd >= 2 && q->ndim == nd && k->ndim == nd && v->ndim == nd;
	for (int d = 0; ok && d < nd - 2; d++)
		ok = q->shape[d] == n->shape[d] && k->shape[d] == n->shape[d] &&
		     v->shape[d] == n->shape[d];
	if (ok)
		ok = q->shape[nd - 2] == n->shape[nd - 2] && k->shape[nd - 1] == q->shape[nd - 1] &&
		     v->shape[nd - 2] == k->shape[nd - 2] && v->shape[nd - 1] == n->shape[nd - 1];
	if (!ok)
		return ref_fail(st, KL_EINVAL, "q %s, k %s and v %s do not give %s",
		                shp(b1, sizeof b1, q), shp(b2, sizeof b2, k), shp(b3, sizeof b3, v),
		                shp(b3, sizeof b3, n));
	int64_t Tq = q->shape[nd - 2], Tk = k->shape[nd - 2], D = q->shape[nd - 1],
	        Dv = v->shape[nd - 1];
	int64_t batch = kl__numel(nd - 2, n->shape);
	bool causal = (n->a.flags & KL_F_CAUSAL) != 0;
	double scale = n->a.s[0];
	double *p = malloc(sizeof(double) * (size_t)(Tk > 0 ? Tk : 1));
	if (!p)
		return ref_fail(st, KL_ENOMEM, "out of memory");
	const double *Q = st->val[n->in[0]], *K = st->val[n->in[1]], *V = st->val[n->in[2]];
	const double *Len = has_len ? st->val[n->in[3]] : NULL;
	int64_t per_row = has_len && n->shape[0] > 0 ? batch / n->shape[0] : 1;
	for (int64_t b = 0; b < batch; b++) {
		const double *Qb = Q + b * Tq * D, *Kb = K + b * Tk * D, *Vb = V + b * Tk * Dv;
		double *O = out + b * Tq * Dv;
		int64_t end = Tk; /* the row's keys end here */
		if (Len) {
			double l = Len[b / per_row];
			end = !(l > 0) ? 0 : l < (double)Tk ? (int64_t)l : Tk;
		}
		for (int64_t i = 0; i < Tq; i++) {
			int64_t last = causal ? i + (end - Tq) : end - 1; /* last allowed key */
			if (last > end - 1)
				last = end - 1;
			double m = -INFINITY;
			for (int64_t j = 0; j <= last; j++) {
				p[j] = scale * sum_exact_dot(Qb + i * D, Kb + j * D, D);
				if (p[j] > m || isnan(p[j]))
					m = isnan(m) ? m : p[j];
			}
			for (int64_t j = 0; j <= last; j++)
				p[j] = exp(p[j] - m);
			double l = last >= 0 ? kl__ref_sum(p, last + 1) : 0;
			for (int64_t c = 0; c < Dv; c++) {
				double acc = 0, cc = 0;
				for (int64_t j = 0; j <= last; j++) {
					double t = p[j] * Vb[j * Dv + c], u = acc + t;
					cc += fabs(acc) >= fabs(t) ? (acc - u) + t : (t - u) + acc;
					acc = u;
				}
				O[i * Dv + c] = last >= 0 ? (acc + cc) / l : Len ? 0 : NAN;
			}
		}
	}
	free(p);
	return KL_OK;
}

/* sdpa_bwd: the three gradients of sdpa from q, k, v, o and do, packed
 * [dq; dk; dv] along dim -2. Per query row i: P = softmax(s q k^T [masked]),
 * dP = do v^T, D_i = do_i . o_i, dS = P * (dP - D_i), dq = s dS k,
 * dk = s dS^T q, dv = P^T do. A query with no allowed key has a NaN row of
 * P (as softmax over nothing): its share of every gradient is NaN. */
kl_status kl__ref_attention_bwd(ref_state *st, const kl_node *n, double *out)
{
	char b1[96], b2[96];
	if (n->nin != 5)
		return ref_fail(st, KL_EINVAL, "%d inputs, expected 5", n->nin);
	const kl_node *x[5];
	for (int i = 0; i < 5; i++)
		x[i] = &st->g->nodes[n->in[i]];
	int nd = n->ndim;
	bool ok = nd >= 2;
	for (int i = 0; ok && i < 5; i++)
		ok = x[i]->ndim == nd && x[i]->shape[nd - 1] == n->shape[nd - 1];
	for (int d = 0; ok && d < nd - 2; d++)
		for (int i = 0; ok && i < 5; i++)
			ok = x[i]->shape[d] == n->shape[d];
	int64_t Tq = ok ? x[0]->shape[nd - 2] : 0, Tk = ok ? x[1]->shape[nd - 2] : 0;
	ok = ok && x[2]->shape[nd - 2] == Tk && x[3]->shape[nd - 2] == Tq &&
	     x[4]->shape[nd - 2] == Tq && n->shape[nd - 2] == Tq + 2 * Tk;
	if (!ok)
		return ref_fail(st, KL_EINVAL, "q %s and k %s do not give %s",
		                shp(b1, sizeof b1, x[0]), shp(b2, sizeof b2, x[1]),
		                shp(b2, sizeof b2, n));
	int64_t D = n->shape[nd - 1], R = Tq + 2 * Tk;
	int64_t batch = kl__numel(nd - 2, n->shape);
	bool causal = (n->a.flags & KL_F_CAUSAL) != 0;
	double scale = n->a.s[0];
	double *p = malloc(sizeof(double) * (size_t)(Tk > 0 ? 2 * Tk : 1));
	if (!p)
		return ref_fail(st, KL_ENOMEM, "out of memory");
	double *ds = p + Tk;
	const double *Q = st->val[n->in[0]], *K = st->val[n->in[1]], *V = st->val[n->in[2]],
	             *O = st->val[n->in[3]], *dO = st->val[n->in[4]];
	for (int64_t i = 0; i < batch * R * D; i++)
		out[i] = 0;
	for (int64_t b = 0; b < batch; b++) {
		const double *Qb = Q + b * Tq * D, *Kb = K + b * Tk * D, *Vb = V + b * Tk * D,
		             *Ob = O + b * Tq * D, *dOb = dO + b * Tq * D;
		double *dq = out + b * R * D, *dk = dq + Tq * D, *dv = dk + Tk * D;
		for (int64_t i = 0; i < Tq; i++) {
			int64_t last = causal ? i + (Tk - Tq) : Tk - 1; /* last allowed key */
			if (last > Tk - 1)
				last = Tk - 1;
			double m = -INFINITY;
			for (int64_t j = 0; j <= last; j++) {
				p[j] = scale * sum_exact_dot(Qb + i * D, Kb + j * D, D);
				if (p[j] > m || isnan(p[j]))
					m = isnan(m) ? m : p[j];
			}
			for (int64_t j = 0; j <= last; j++)
				p[j] = exp(p[j] - m);
			double l = last >= 0 ? kl__ref_sum(p, last + 1) : 0;
			int64_t hi = last;
			if (last < 0) { /* no allowed key: NaN everywhere, as softmax gives */
				hi = Tk - 1;
				for (int64_t j = 0; j <= hi; j++)
					p[j] = NAN;
			} else {
				for (int64_t j = 0; j <= hi; j++)
					p[j] /= l;
			}
			double Di = sum_exact_dot(dOb + i * D, Ob + i * D, D);
			for (int64_t j = 0; j <= hi; j++)
				ds[j] = p[j] * (sum_exact_dot(dOb + i * D, Vb + j * D, D) - Di);
			for (int64_t j = 0; j <= hi; j++)
				for (int64_t c = 0; c < D; c++) {
					dq[i * D + c] += scale * ds[j] * Kb[j * D + c];
					dk[j * D + c] += scale * ds[j] * Qb[i * D + c];
					dv[j * D + c] += p[j] * dOb[i * D + c];
				}
		}
	}
	free(p);
	return KL_OK;
}

kl_status kl__ref_softmax(ref_state *st, const kl_node *n, double *out)
{
	if (n->nin != 1)
		return ref_fail(st, KL_EINVAL, "%d inputs, expected 1", n->nin);
	const kl_node *x = &st->g->nodes[n->in[0]];
	char b1[96], b2[96];
	if (!kl__shape_eq(x->ndim, x->shape, n->ndim, n->shape) ||
	    (n->ndim > 0 && (n->a.axis < 0 || n->a.axis >= n->ndim)))
		return ref_fail(st, KL_EINVAL, "input %s, node %s, axis %d", shp(b1, sizeof b1, x),
		                shp(b2, sizeof b2, n), n->a.axis);
	rows r;
	kl_status s = rows_init(st, &r, n->ndim, n->shape, n->ndim > 0 ? 1u << n->a.axis : 0);
	if (s)
		return s;
	double *e = malloc(sizeof(double) * (size_t)(r.rowlen > 0 ? r.rowlen : 1));
	if (!e) {
		free(r.inner);
		return ref_fail(st, KL_ENOMEM, "out of memory");
	}
	const double *src = st->val[n->in[0]];
	kl_dtype dt = (kl_dtype)n->dtype;
	for (int64_t o = 0; o < r.nrows; o++, walk_next(&r.outer)) {
		int64_t base = r.outer.off[0];
		double m = -INFINITY;
		for (int64_t j = 0; j < r.rowlen; j++) {
			double v = kl__round_to(dt, src[base + r.inner[j]]);
			if (isnan(v) || v > m)
				m = v;
			if (isnan(v))
				break;
		}
		for (int64_t j = 0; j < r.rowlen; j++)
			e[j] = exp(kl__round_to(dt, src[base + r.inner[j]]) - m);
		double sum = kl__ref_sum(e, r.rowlen);
		for (int64_t j = 0; j < r.rowlen; j++) {
			double v = kl__round_to(dt, src[base + r.inner[j]]);
			out[base + r.inner[j]] =
				n->op == KL_OP_SOFTMAX ? e[j] / sum : v - m - log(sum);
		}
	}
	free(e);
	free(r.inner);
	return KL_OK;
}

kl_status kl__ref_norm(ref_state *st, const kl_node *n, double *out)
{
	bool ln = n->op == KL_OP_LAYER_NORM;
	bool hw = n->a.flags & KL_F_HAS_WEIGHT, hb = ln && (n->a.flags & KL_F_HAS_BIAS);
	int want = 1 + hw + hb;
	if (n->nin != want)
		return ref_fail(st, KL_EINVAL, "%d inputs, flags 0x%x want %d", n->nin,
		                (unsigned)n->a.flags, want);
	const kl_node *x = &st->g->nodes[n->in[0]];
	char b1[96], b2[96];
	if (n->ndim < 1 || !kl__shape_eq(x->ndim, x->shape, n->ndim, n->shape))
		return ref_fail(st, KL_EINVAL, "input %s, node %s", shp(b1, sizeof b1, x),
		                shp(b2, sizeof b2, n));
	int64_t D = n->shape[n->ndim - 1];
	for (int i = 1; i < n->nin; i++) {
		const kl_node *p = &st->g->nodes[n->in[i]];
		if (p->ndim != 1 || p->shape[0] != D)
			return ref_fail(st, KL_EINVAL, "%s shape %s, normalized dim is %lld",
			                i == 1 && hw ? "weight" : "bias", shp(b1, sizeof b1, p),
			                (long long)D);
	}
	const double *X = st->val[n->in[0]];
	const double *W = hw ? st->val[n->in[1]] : NULL;
	const double *B = hb ? st->val[n->in[1 + hw]] : NULL;
	double eps = n->a.s[0];
	int64_t nrows = D > 0 ? node_numel(n) / D : 0;
	for (int64_t r = 0; r < nrows; r++) {
		const double *xr = X + r * D;
		double *yr = out + r * D;
		double mean = 0, ms = 0;
		if (ln) {
			mean = kl__ref_sum(xr, D) / (double)D;
			for (int64_t j = 0; j < D; j++)
				ms += (xr[j] - mean) * (xr[j] - mean);
		} else {
			for (int64_t j = 0; j < D; j++)
				ms += xr[j] * xr[j];
		}
		double inv = 1.0 / sqrt(ms / (double)D + eps);
		for (int64_t j = 0; j < D; j++) {
			double y = (xr[j] - mean) * inv;
			if (W)
				y *= W[j];
			if (B)
				y += B[j];
			yr[j] = y;
		}
	}
	return KL_OK;
}

kl_status kl__ref_source(ref_state *st, const kl_node *n, double *out)
{
	int64_t total = node_numel(n);
	uint64_t seed = n->a.seed;
	if (n->nin == 2) /* keyed at run time: i32 words, exact in a double */
		seed = kl__rand_key((int32_t)st->val[n->in[0]][0], (int32_t)st->val[n->in[1]][0]);
	for (int64_t i = 0; i < total; i++) {
		switch ((kl_op)n->op) {
		case KL_OP_FULL: out[i] = n->a.s[0]; break;
		case KL_OP_ARANGE: out[i] = n->a.s[0] + (double)i * n->a.s[1]; break;
		case KL_OP_RAND:
			out[i] = kl__rand_uniform_as((kl_dtype)n->dtype, seed, (uint64_t)i);
			break;
		case KL_OP_RANDN: out[i] = kl__rand_normal(seed, (uint64_t)i); break;
		default: return ref_fail(st, KL_EINVAL, "not a source op");
		}
	}
	return KL_OK;
}

/* ---- the driver ------------------------------------------------------------ */

static kl_status check_node(ref_state *st, int32_t i)
{
	const kl_node *n = &st->g->nodes[i];
	if (n->op >= KL_NOPS)
		return ref_fail(st, KL_EINVAL, "op %d is not in the op table", (int)n->op);
	if (n->dtype >= KL_NDTYPES)
		return ref_fail(st, KL_EINVAL, "dtype %d out of range", (int)n->dtype);
	if (n->ndim > KL_MAX_DIMS || n->nin > KL_NODE_MAX_IN)
		return ref_fail(st, KL_EINVAL, "%d dims, %d inputs", n->ndim, n->nin);
	int bad;
	kl_shape_err e = kl__shape_check(n->ndim, n->shape, &bad);
	if (e != KL_SHAPE_OK) {
		char b[192], why[128];
		return ref_fail(st, KL_EINVAL, "shape %s: %s", shp(b, sizeof b, n),
		                kl__shape_why(why, sizeof why, e, n->ndim, n->shape, bad));
	}
	if (node_numel(n) > ((int64_t)1 << 40))
		return ref_fail(st, KL_EINVAL, "too many elements (%lld)",
		                (long long)node_numel(n));
	for (int k = 0; k < n->nin; k++)
		if (n->in[k] < 0 || n->in[k] >= i)
			return ref_fail(st, KL_EINVAL, "input %d is node %d, not an earlier node",
			                k, (int)n->in[k]);
	return KL_OK;
}

static kl_status eval_node(ref_state *st, int32_t i, const double *const *inputs,
                           const int32_t *input_of)
{
	const kl_node *n = &st->g->nodes[i];
	kl_status s = check_node(st, i);
	if (s)
		return s;
	if (n->op == KL_OP_INPUT) {
		if (input_of[i] < 0)
			return ref_fail(st, KL_EINVAL, "INPUT node not listed in graph inputs");
		st->val[i] = (double *)inputs[input_of[i]];
		st->owned[i] = false;
		return KL_OK;
	}
	const kl_opdesc *d = kl__opdesc[n->op];
	if (d->shape) { /* the op table's arity and shape rule */
		kl_cat cat = kl__ops[n->op].cat;
		int want = kl__ops[n->op].arity;
		if ((cat == KL_CAT_BINARY || cat == KL_CAT_COMPARE) && n->a.scalar_rhs)
			want = 1;
		if (want < 0) /* concat: any number */
			want = n->nin;
		if ((n->op == KL_OP_RAND || n->op == KL_OP_RANDN) && n->nin == 2)
			want = 2; /* keyed at run time */
		if (n->op == KL_OP_LAYER_NORM || n->op == KL_OP_RMS_NORM) /* flags say which follow */
			want = 1 + !!(n->a.flags & KL_F_HAS_WEIGHT) + !!(n->a.flags & KL_F_HAS_BIAS);
		if (n->op == KL_OP_ATTENTION)
			want = 3 + !!(n->a.flags & KL_F_LENGTHS);
		if (n->nin != want)
			return ref_fail(st, KL_EINVAL, "%d inputs, expected %d", n->nin, want);
		int nds[KL_NODE_MAX_IN];
		const int64_t *shs[KL_NODE_MAX_IN];
		for (int k = 0; k < n->nin; k++) {
			nds[k] = st->g->nodes[n->in[k]].ndim;
			shs[k] = st->g->nodes[n->in[k]].shape;
		}
		char why[320];
		if (!d->shape(n, nds, shs, why, sizeof why))
			return ref_fail(st, KL_EINVAL, "%s", why);
	}
	int64_t total = node_numel(n);
	double *out = malloc(sizeof(double) * (size_t)(total > 0 ? total : 1));
	if (!out)
		return ref_fail(st, KL_ENOMEM, "out of memory for %lld values", (long long)total);
	st->val[i] = out;
	st->owned[i] = true;
	s = d->ref(st, n, out);
	if (s)
		return s;
	for (int64_t k = 0; k < total; k++)
		out[k] = kl__round_to((kl_dtype)n->dtype, out[k]);
	return KL_OK;
}

kl_status kl__ref_eval(const kl_graph *g, const double *const *inputs, double **outputs, char *err,
                       size_t errcap)
{
	ref_state st = {.g = g, .err = err, .errcap = errcap, .cur = -1};
	if (err && errcap)
		err[0] = 0;
	if (!g || !outputs || (g->ninputs > 0 && !inputs))
		return ref_fail(&st, KL_EINVAL, "NULL graph, inputs or outputs");
	for (int j = 0; j < g->noutputs; j++)
		outputs[j] = NULL;
	int32_t n = g->n;
	st.val = calloc((size_t)(n > 0 ? n : 1), sizeof *st.val);
	st.owned = calloc((size_t)(n > 0 ? n : 1), sizeof *st.owned);
	int32_t *input_of = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
	int32_t *last = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
	kl_status s = KL_OK;
	if (!st.val || !st.owned || !input_of || !last) {
		s = ref_fail(&st, KL_ENOMEM, "out of memory");
		goto done;
	}
	for (int32_t i = 0; i < n; i++) {
		input_of[i] = -1;
		last[i] = i;
	}
	for (int32_t k = 0; k < g->ninputs; k++) {
		int32_t ni = g->inputs[k];
		if (ni < 0 || ni >= n || g->nodes[ni].op != KL_OP_INPUT || !inputs[k]) {
			s = ref_fail(&st, KL_EINVAL,
			             "graph input %d (node %d) is not an INPUT node "
			             "with values",
			             (int)k, (int)ni);
			goto done;
		}
		input_of[ni] = k;
	}
	for (int32_t i = 0; i < n; i++)
		for (int k = 0; k < g->nodes[i].nin && k < KL_NODE_MAX_IN; k++)
			if (g->nodes[i].in[k] >= 0 && g->nodes[i].in[k] < i)
				last[g->nodes[i].in[k]] = i;
	for (int j = 0; j < g->noutputs; j++) {
		if (g->outputs[j] < 0 || g->outputs[j] >= n) {
			s = ref_fail(&st, KL_EINVAL, "output %d names node %d of %d", j,
			             (int)g->outputs[j], (int)n);
			goto done;
		}
		last[g->outputs[j]] = n;
	}
	for (int32_t i = 0; i < n; i++) {
		st.cur = i;
		s = eval_node(&st, i, inputs, input_of);
		if (s)
			goto done;
		/* drop values no later node reads, so long graphs stay small */
		const kl_node *nd = &g->nodes[i];
		for (int k = 0; k < nd->nin; k++) {
			int32_t p = nd->in[k];
			if (last[p] == i && st.owned[p]) {
				free(st.val[p]);
				st.val[p] = NULL;
				st.owned[p] = false;
			}
		}
	}
	st.cur = -1;
	for (int j = 0; j < g->noutputs; j++) {
		const kl_node *o = &g->nodes[g->outputs[j]];
		int64_t total = node_numel(o);
		outputs[j] = malloc(sizeof(double) * (size_t)(total > 0 ? total : 1));
		if (!outputs[j]) {
			s = ref_fail(&st, KL_ENOMEM, "out of memory for output %d", j);
			goto done;
		}
		memcpy(outputs[j], st.val[g->outputs[j]], sizeof(double) * (size_t)total);
	}
done:
	if (s && outputs) {
		for (int j = 0; g && j < g->noutputs; j++) {
			free(outputs[j]);
			outputs[j] = NULL;
		}
	}
	if (st.val)
		for (int32_t i = 0; i < n; i++)
			if (st.owned && st.owned[i])
				free(st.val[i]);
	free(st.val);
	free(st.owned);
	free(input_of);
	free(last);
	return s;
}
