/* movement.c - CPU eager kernels for the movement ops that copy: CONTIGUOUS
 * (a strided view made dense) and CONCAT (inputs laid side by side along an
 * axis). Both are one strided copy: rows of the coalesced shape, memcpy when
 * both sides are contiguous along them. GATHER (rows of a table by index) and
 * INDEX_ADD (its adjoint: rows added into a copy of a base) read indices.
 */
#include <stdlib.h>

#include "backend/cpu/cpu.h"
#include "core/shape.h"
#include "graph/optable.h"

typedef struct cp_plan {
	int nd;
	int64_t shape[KL_MAX_DIMS];
	int64_t st[2][KL_MAX_DIMS]; /* [0] destination, [1] source */
	char *dst;
	const char *src;
	kl_dtype ddt, sdt;
} cp_plan;

#define COPY_ELEMS(TY)                                                                         \
	do {                                                                                   \
		TY *d_ = (TY *)(void *)d;                                                      \
		const TY *s_ = (const TY *)(const void *)s;                                    \
		for (int64_t i = 0; i < len; i++)                                              \
			d_[i * ds] = s_[i * ss];                                               \
	} while (0)

static void copy_row(const cp_plan *p, int64_t row)
{
	int nd = p->nd;
	int64_t doff = 0, soff = 0, rem = row;
	for (int d = nd - 2; d >= 0; d--) {
		int64_t i = rem % p->shape[d];
		rem /= p->shape[d];
		doff += i * p->st[0][d];
		soff += i * p->st[1][d];
	}
	int64_t len = p->shape[nd - 1], ds = p->st[0][nd - 1], ss = p->st[1][nd - 1];
	size_t des = kl_dtype_size(p->ddt), ses = kl_dtype_size(p->sdt);
	char *d = p->dst + doff * (int64_t)des;
	const char *s = p->src + soff * (int64_t)ses;
	if (p->ddt == p->sdt) {
		if (ds == 1 && ss == 1) {
			memcpy(d, s, (size_t)len * des);
			return;
		}
		switch (des) {
		case 1:
			COPY_ELEMS(uint8_t);
			break;
		case 2:
			COPY_ELEMS(uint16_t);
			break;
		case 4:
			COPY_ELEMS(uint32_t);
			break;
		default:
			COPY_ELEMS(uint64_t);
			break;
		}
		return;
	}
	/* dtypes differ: convert through the source's compute type in chunks */
	kl_cpu_ct ct = kl__cpu_ct(p->sdt);
	union {
		double d[KL_CPU_CHUNK];
		int64_t i[KL_CPU_CHUNK];
		float f[KL_CPU_CHUNK];
	} buf;
	for (int64_t i = 0; i < len; i += KL_CPU_CHUNK) {
		int64_t n = len - i < KL_CPU_CHUNK ? len - i : KL_CPU_CHUNK;
		kl__cpu_load_ct(ct, &buf, s + i * ss * (int64_t)ses, p->sdt, ss, n);
		kl__cpu_store_ct(ct, d + i * ds * (int64_t)des, p->ddt, ds, &buf, n);
	}
}

/* A transposed copy (the source contiguous along dim nd-2, not nd-1) walks
 * one side of memory with a large stride whichever dim runs innermost; in
 * square blocks of one cache line's worth of elements both sides stay in
 * cache (larger blocks thrash the sets when strides are powers of two).
 * Task t is a band of tile rows of dims (nd-2, nd-1) within outer index
 * t / bands. */
static int64_t tile_of(size_t es)
{
	return es >= 8 ? 8 : (int64_t)(64 / es);
}

#define COPY_TILE(TY)                                                                          \
	do {                                                                                   \
		TY *d_ = (TY *)(void *)d;                                                      \
		const TY *s_ = (const TY *)(const void *)s;                                    \
		for (int64_t j = j0; j < j1; j++)                                              \
			for (int64_t i = i0; i < i1; i++)                                      \
				d_[i * ds0 + j * ds1] = s_[i * ss0 + j * ss1];                 \
	} while (0)

static void copy_band(const cp_plan *p, int64_t t)
{
	int nd = p->nd;
	size_t es = kl_dtype_size(p->ddt);
	int64_t R = p->shape[nd - 2], C = p->shape[nd - 1], T = tile_of(es);
	int64_t bands = (R + T - 1) / T;
	int64_t rem = t / bands, i0 = (t % bands) * T;
	int64_t i1 = i0 + T < R ? i0 + T : R;
	int64_t doff = 0, soff = 0;
	for (int d = nd - 3; d >= 0; d--) {
		int64_t i = rem % p->shape[d];
		rem /= p->shape[d];
		doff += i * p->st[0][d];
		soff += i * p->st[1][d];
	}
	char *d = p->dst + doff * (int64_t)es;
	const char *s = p->src + soff * (int64_t)es;
	int64_t ds0 = p->st[0][nd - 2], ds1 = p->st[0][nd - 1];
	int64_t ss0 = p->st[1][nd - 2], ss1 = p->st[1][nd - 1];
	for (int64_t j0 = 0; j0 < C; j0 += T) {
		int64_t j1 = j0 + T < C ? j0 + T : C;
		switch (es) {
		case 1:
			COPY_TILE(uint8_t);
			break;
		case 2:
			COPY_TILE(uint16_t);
			break;
		case 4:
			COPY_TILE(uint32_t);
			break;
		default:
			COPY_TILE(uint64_t);
			break;
		}
	}
}

/* Move the dim along which the source is contiguous next to the innermost
 * one, for copy_band; false when the copy is not a transpose. */
static bool make_transposed(cp_plan *p)
{
	int nd = p->nd;
	if (nd < 2 || p->ddt != p->sdt || p->st[1][nd - 1] == 1 || p->shape[nd - 1] < 8)
		return false;
	int u = -1;
	for (int d = 0; d < nd - 1; d++)
		if (p->st[1][d] == 1 && p->shape[d] >= 8)
			u = d;
	if (u < 0)
		return false;
	/* the order the elements are visited in does not matter to a copy */
	int64_t sz = p->shape[u], s0 = p->st[0][u], s1 = p->st[1][u];
	for (int d = u; d < nd - 2; d++) {
		p->shape[d] = p->shape[d + 1];
		p->st[0][d] = p->st[0][d + 1];
		p->st[1][d] = p->st[1][d + 1];
	}
	p->shape[nd - 2] = sz;
	p->st[0][nd - 2] = s0;
	p->st[1][nd - 2] = s1;
	return true;
}

static void bands_chunk(void *arg, int64_t lo, int64_t hi)
{
	for (int64_t t = lo; t < hi; t++)
		copy_band(arg, t);
}

static void rows_chunk(void *arg, int64_t lo, int64_t hi)
{
	for (int64_t r = lo; r < hi; r++)
		copy_row(arg, r);
}

/* elements [lo, hi) of a plan that is one row */
static void long_row_chunk(void *arg, int64_t lo, int64_t hi)
{
	cp_plan q = *(const cp_plan *)arg;
	q.shape[q.nd - 1] = hi - lo;
	q.dst += lo * q.st[0][q.nd - 1] * (int64_t)kl_dtype_size(q.ddt);
	q.src += lo * q.st[1][q.nd - 1] * (int64_t)kl_dtype_size(q.sdt);
	copy_row(&q, 0);
}

/* Copy (converting if the dtypes differ) the elements of shape from src
 * (strides sst) to dst (strides dstr). */
static void strided_copy(kl_ctx *ctx, void *dst, kl_dtype ddt, const int64_t *dstr, const void *src,
                         kl_dtype sdt, const int64_t *sst, int ndim, const int64_t *shape)
{
	int64_t total = kl__numel(ndim, shape);
	if (total == 0)
		return;
	cp_plan p;
	memcpy(p.shape, shape, sizeof(int64_t) * (size_t)ndim);
	memcpy(p.st[0], dstr, sizeof(int64_t) * (size_t)ndim);
	memcpy(p.st[1], sst, sizeof(int64_t) * (size_t)ndim);
	p.nd = kl__cpu_coalesce(ndim, p.shape, 2, p.st);
	p.dst = dst;
	p.src = src;
	p.ddt = ddt;
	p.sdt = sdt;
	int nt = kl__cpu_threads(ctx);
	if (make_transposed(&p)) {
		int64_t R = p.shape[p.nd - 2], T = tile_of(kl_dtype_size(ddt));
		int64_t tasks = total / (R * p.shape[p.nd - 1]) * ((R + T - 1) / T);
		kl__par_for(nt > 1 && total >= KL_CPU_PAR_MIN ? nt : 1, tasks, bands_chunk, &p);
		return;
	}
	int64_t rows = total / p.shape[p.nd - 1];
	if (nt > 1 && total >= KL_CPU_PAR_MIN && rows > 1) {
		kl__par_for(nt, rows, rows_chunk, &p);
	} else if (nt > 1 && total >= 4 * KL_CPU_PAR_MIN && rows == 1) {
		/* one long row: split it */
		kl__par_for(nt, p.shape[p.nd - 1], long_row_chunk, &p);
	} else {
		for (int64_t r = 0; r < rows; r++)
			copy_row(&p, r);
	}
}

kl_status kl__cpu_contiguous(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	if (n->nin != 1 || !in[0] || !in[0]->st)
		return kl__err(ctx, KL_EINVAL,
		               "kl_contiguous: cpu kernel expects one materialized "
		               "input");
	const kl_tensor *x = in[0];
	if (!kl__shape_eq(x->ndim, x->shape, n->ndim, n->shape)) {
		char b1[96], b2[96];
		return kl__err(ctx, KL_EINVAL, "kl_contiguous: input %s, node %s",
		               kl__shape_str(b1, sizeof b1, x->ndim, x->shape),
		               kl__shape_str(b2, sizeof b2, n->ndim, n->shape));
	}
	int64_t ost[KL_MAX_DIMS];
	kl__contig_strides(n->ndim, n->shape, ost);
	strided_copy(ctx, kl__tensor_data(out), out->dtype, ost, kl__tensor_data(x), x->dtype,
	             x->strides, x->ndim, x->shape);
	return KL_OK;
}

kl_status kl__cpu_concat(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	int ax = n->a.axis;
	char b1[96], b2[96];
	if (n->nin < 1 || ax < 0 || ax >= n->ndim)
		return kl__err(ctx, KL_EINVAL, "kl_concat: %d inputs, axis %d of %d dims", n->nin,
		               ax, (int)n->ndim);
	int64_t at = 0;
	for (int i = 0; i < n->nin; i++) {
		const kl_tensor *x = in[i];
		if (!x || !x->st)
			return kl__err(ctx, KL_EINVAL, "kl_concat: input %d is not materialized",
			               i);
		bool ok = x->ndim == n->ndim;
		for (int d = 0; ok && d < n->ndim; d++)
			ok = d == ax || x->shape[d] == n->shape[d];
		if (!ok)
			return kl__err(ctx, KL_EINVAL,
			               "kl_concat: input %d shape %s does not fit "
			               "%s",
			               i, kl__shape_str(b1, sizeof b1, x->ndim, x->shape),
			               kl__shape_str(b2, sizeof b2, n->ndim, n->shape));
		at += x->shape[ax];
	}
	if (at != n->shape[ax])
		return kl__err(ctx, KL_EINVAL,
		               "kl_concat: inputs add up to %lld along axis %d, "
		               "node has %lld",
		               (long long)at, ax, (long long)n->shape[ax]);
	char *o = kl__tensor_data(out);
	size_t oes = kl_dtype_size(out->dtype);
	int64_t ost[KL_MAX_DIMS];
	kl__contig_strides(n->ndim, n->shape, ost);
	at = 0;
	for (int i = 0; i < n->nin; i++) {
		const kl_tensor *x = in[i];
		strided_copy(ctx, o + at * ost[ax] * (int64_t)oes, out->dtype, ost,
		             kl__tensor_data(x), x->dtype, x->strides, x->ndim, x->shape);
		at += x->shape[ax];
	}
	return KL_OK;
}

/* The index of element e (row-major over idx's shape) read through its strides. */
static int64_t gather_index(const kl_tensor *idx, int64_t e)
{
	int64_t off = 0;
	for (int d = idx->ndim - 1; d >= 0; d--) {
		int64_t i = e % idx->shape[d];
		e /= idx->shape[d];
		off += i * idx->strides[d];
	}
	const char *p = kl__tensor_data(idx);
	if (idx->dtype == KL_I32)
		return ((const int32_t *)(const void *)p)[off];
	return ((const int64_t *)(const void *)p)[off];
}

kl_status kl__cpu_gather(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	char b1[96], b2[96], b3[96];
	if (n->nin != 2 || !in[0] || !in[1] || !in[0]->st || !in[1]->st)
		return kl__err(ctx, KL_EINVAL,
		               "kl_gather: cpu kernel expects two materialized "
		               "inputs");
	const kl_tensor *tab = in[0], *idx = in[1];
	bool ok = tab->ndim >= 1 && (idx->dtype == KL_I32 || idx->dtype == KL_I64) &&
	          idx->ndim + tab->ndim - 1 == n->ndim && tab->dtype == out->dtype;
	for (int d = 0; ok && d < idx->ndim; d++)
		ok = idx->shape[d] == n->shape[d];
	for (int d = 1; ok && d < tab->ndim; d++)
		ok = tab->shape[d] == n->shape[idx->ndim + d - 1];
	if (!ok)
		return kl__err(ctx, KL_EINVAL,
		               "kl_gather: table %s %s and indices %s %s do not "
		               "give %s",
		               kl__shape_str(b1, sizeof b1, tab->ndim, tab->shape),
		               kl_dtype_name(tab->dtype),
		               kl__shape_str(b2, sizeof b2, idx->ndim, idx->shape),
		               kl_dtype_name(idx->dtype),
		               kl__shape_str(b3, sizeof b3, n->ndim, n->shape));
	int64_t nidx = kl__numel(idx->ndim, idx->shape), rows = tab->shape[0];
	/* every index is checked before anything is written */
	for (int64_t e = 0; e < nidx; e++) {
		int64_t v = gather_index(idx, e);
		if (v < 0 || v >= rows)
			return kl__err(ctx, KL_EINVAL,
			               "kl_gather: index %lld (element %lld) out of "
			               "range for a table of %lld rows",
			               (long long)v, (long long)e, (long long)rows);
	}
	/* one row of the table: shape [1] for a 1-D table (strided_copy of one element) */
	int rnd = tab->ndim - 1 > 0 ? tab->ndim - 1 : 1;
	int64_t rshape[KL_MAX_DIMS], rst[KL_MAX_DIMS], ost[KL_MAX_DIMS];
	rshape[0] = 1;
	rst[0] = 1;
	for (int d = 1; d < tab->ndim; d++) {
		rshape[d - 1] = tab->shape[d];
		rst[d - 1] = tab->strides[d];
	}
	kl__contig_strides(rnd, rshape, ost);
	int64_t rowlen = kl__numel(rnd, rshape);
	size_t es = kl_dtype_size(tab->dtype);
	char *o = kl__tensor_data(out);
	const char *t = kl__tensor_data(tab);
	for (int64_t e = 0; e < nidx; e++) {
		int64_t v = gather_index(idx, e);
		strided_copy(ctx, o + e * rowlen * (int64_t)es, out->dtype, ost,
		             t + v * tab->strides[0] * (int64_t)es, tab->dtype, rst, rnd, rshape);
	}
	return KL_OK;
}

/* index_add: out = base, then out[idx[e], ...] += src[e, ...] for e in
 * order, summed in double and rounded once: the same bits every run. */
kl_status kl__cpu_index_add(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	const kl_tensor *base = in[0], *idx = in[1], *src = in[2];
	char b1[96], b2[96], b3[96];
	if (n->nin != 3 || idx->ndim + base->ndim - 1 != src->ndim || base->dtype != out->dtype ||
	    src->dtype != out->dtype || (idx->dtype != KL_I32 && idx->dtype != KL_I64) ||
	    !kl__index_add_shapes_ok(out->ndim, out->shape, base->ndim, base->shape, idx->ndim,
	                             idx->shape, src->ndim, src->shape))
		return kl__err(ctx, KL_EINVAL,
		               "kl_index_add: base %s, indices %s and source %s do "
		               "not match",
		               kl__shape_str(b1, sizeof b1, base->ndim, base->shape),
		               kl__shape_str(b2, sizeof b2, idx->ndim, idx->shape),
		               kl__shape_str(b3, sizeof b3, src->ndim, src->shape));
	int64_t rows = base->shape[0], total = kl__numel(base->ndim, base->shape);
	int64_t row = rows ? total / rows : 0, nidx = kl__numel(idx->ndim, idx->shape);
	for (int64_t e = 0; e < nidx; e++) {
		int64_t v = gather_index(idx, e);
		if (v < 0 || v >= rows)
			return kl__err(ctx, KL_EINVAL,
			               "kl_index_add: index %lld (element %lld) out "
			               "of range for a base of %lld rows",
			               (long long)v, (long long)e, (long long)rows);
	}
	double *acc = malloc(sizeof(double) * (size_t)(total > 0 ? total : 1));
	if (!acc)
		return kl__err(ctx, KL_ENOMEM, "kl_index_add: out of memory for %lld values",
		               (long long)total);
	/* element k of t (row-major over its shape) through its strides */
	const kl_tensor *ts[2] = {base, src};
	int64_t cnt[2] = {total, nidx * row};
	for (int s = 0; s < 2; s++) {
		const kl_tensor *t = ts[s];
		const char *p = kl__tensor_data(t);
		for (int64_t k = 0; k < cnt[s]; k++) {
			int64_t off = 0, r = k;
			for (int d = t->ndim - 1; d >= 0; d--) {
				off += (r % t->shape[d]) * t->strides[d];
				r /= t->shape[d];
			}
			double x = kl__load(p, t->dtype, off);
			if (s == 0)
				acc[k] = x;
			else
				acc[gather_index(idx, k / row) * row + k % row] += x;
		}
	}
	char *o = kl__tensor_data(out);
	for (int64_t k = 0; k < total; k++)
		kl__store(o, out->dtype, k, acc[k]);
	free(acc);
	return KL_OK;
}

/* ---- cache_write ----------------------------------------------------------------- */

static int64_t cw_pos(const void *pos, kl_dtype pdt, int64_t i)
{
	return pdt == KL_I32 ? ((const int32_t *)pos)[i] : ((const int64_t *)pos)[i];
}

typedef struct cw_job {
	const kl_cw_geom *g;
	size_t es;
	kl_dtype pdt;
	void *cache;
	const void *pos, *val;
	size_t run;
} cw_job;

/* (row, outer) pairs [lo, hi): each one run of s positions */
static void cw_chunk(void *arg, int64_t lo, int64_t hi)
{
	const cw_job *j = arg;
	const kl_cw_geom *g = j->g;
	for (int64_t f = lo; f < hi; f++) {
		int64_t i = f / g->outer, a = f % g->outer, p = cw_pos(j->pos, j->pdt, i);
		memcpy((char *)j->cache + (size_t)((f * g->cap + p) * g->inner) * j->es,
		       (const char *)j->val + (size_t)(i * g->vrs + a * g->s * g->inner) * j->es,
		       j->run);
	}
}

int64_t kl__cpu_cache_rows(const kl_cw_geom *g, size_t es, kl_dtype pdt, void *cache,
                           const void *pos, const void *val)
{
	/* every position first: a call that fails writes nothing */
	for (int64_t i = 0; i < g->rows; i++) {
		int64_t p = cw_pos(pos, pdt, i);
		if (p < 0 || p > g->cap - g->s)
			return i;
	}
	size_t run = (size_t)(g->s * g->inner) * es; /* one row's s positions: contiguous */
	if (run == 0)
		return -1;
	cw_job j = {g, es, pdt, cache, pos, val, run};
	kl__par_for(g->rows * g->outer > 64 ? kl__par_threads() : 1, g->rows * g->outer, cw_chunk,
	            &j);
	return -1;
}

kl_status kl__cache_write_range_err(kl_ctx *ctx, const kl_cw_geom *g, int axis, int64_t row,
                                    int64_t pos)
{
	return kl__err(ctx, KL_EINVAL,
	               "kl_cache_write: row %lld writes %lld position%s at %lld, "
	               "outside the cache: positions along dim %d must lie in [0, %lld] (capacity "
	               "%lld)",
	               (long long)row, (long long)g->s, g->s == 1 ? "" : "s", (long long)pos, axis,
	               (long long)(g->cap - g->s), (long long)g->cap);
}

/* eager: every operand dense (the front end makes them so); out is the
 * cache itself (kl_cache_write) or a new tensor (kl_cache_update) */
kl_status kl__cpu_cache_write(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	kl_cw_geom g;
	char why[400];
	for (int i = 0; i < 3; i++)
		if (!kl__strides_contiguous(in[i]->ndim, in[i]->shape, in[i]->strides))
			return kl__err(ctx, KL_EINVAL, "kl_cache_write: operand %d is not dense",
			               i);
	if (!kl__cache_write_geom(n->a.axis, in[0]->ndim, in[0]->shape, in[1]->ndim, in[1]->shape,
	                          in[2]->ndim, in[2]->shape, &g, why, sizeof why) ||
	    in[2]->dtype != out->dtype || in[0]->dtype != out->dtype)
		return kl__err(ctx, KL_EINVAL, "kl_cache_write: %s", why);
	size_t es = kl_dtype_size(out->dtype);
	void *o = kl__tensor_data(out);
	const void *pos = kl__tensor_data(in[1]);
	for (int64_t i = 0; i < g.rows; i++) {
		int64_t p = cw_pos(pos, in[1]->dtype, i);
		if (p < 0 || p > g.cap - g.s)
			return kl__cache_write_range_err(ctx, &g, n->a.axis, i, p);
	}
	if (o != kl__tensor_data(in[0]))
		memcpy(o, kl__tensor_data(in[0]), (size_t)kl__numel(out->ndim, out->shape) * es);
	kl__cpu_cache_rows(&g, es, in[1]->dtype, o, pos, kl__tensor_data(in[2]));
	return KL_OK;
}
