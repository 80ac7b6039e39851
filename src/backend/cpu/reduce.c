/* reduce.c - CPU eager kernels for sum, mean, max, min, var and argmax over
 * any set of axes of an input of any dtype and strides.
 *
 * Dims are coalesced into kept and reduced groups. When the innermost
 * reduced dim is contiguous each output reduces a row (row mode); otherwise
 * a kept dim becomes a lane of up to RB outputs that are accumulated side by
 * side while the reduced dims are walked once (column mode), so reducing
 * the leading axis of a matrix streams memory instead of striding it.
 * Float inputs accumulate in double; integer sum/max/min in int64, wrapping.
 */
#include <math.h>
#include <stdlib.h>

#include "backend/cpu/cpu.h"
#include "graph/optable.h"

#define CHUNK KL_CPU_CHUNK
#define RB 2048 /* lanes of one column-mode task: long rows keep the prefetcher busy */

#define KL_FMAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define KL_FMIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))

typedef struct rd_plan {
	kl_op op;
	bool idom; /* accumulate in int64 (integer/bool sum, max, min, argmax) */
	int32_t corr;
	const char *base;
	kl_dtype dt;
	size_t es;
	/* kept dims: sizes, input strides, output strides (dense, kept order) */
	int nk;
	int64_t ks[KL_MAX_DIMS], kst[KL_MAX_DIMS], kost[KL_MAX_DIMS];
	/* reduced dims, walked in this order, the last one innermost */
	int nr;
	int64_t rs[KL_MAX_DIMS], rst[KL_MAX_DIMS];
	int64_t nred, nout;
	char *out;
	kl_dtype odt;
	size_t oes;
	/* column mode: kept dim `lane` is spread over lanes; the other kept dims
	 * (g*) index groups */
	bool col;
	int lane;
	int ng;
	int64_t gs[KL_MAX_DIMS], gst[KL_MAX_DIMS], gost[KL_MAX_DIMS];
	int64_t ngroups, nblocks;
} rd_plan;

typedef struct rd_acc {
	double d[RB];
	int64_t i[RB];
	int64_t arg[RB]; /* argmax: index of the best so far, -1 before any */
} rd_acc;

typedef union rd_buf {
	double d[CHUNK];
	int64_t i[CHUNK];
} rd_buf;

static void acc_init(const rd_plan *p, rd_acc *a, int64_t w, int pass)
{
	double d0 = 0;
	int64_t i0 = 0;
	if (pass == 0 && p->op == KL_OP_MAX) {
		d0 = -INFINITY;
		i0 = INT64_MIN;
	} else if (pass == 0 && p->op == KL_OP_MIN) {
		d0 = INFINITY;
		i0 = INT64_MAX;
	}
	for (int64_t j = 0; j < w; j++) {
		a->d[j] = d0;
		a->i[j] = i0;
		a->arg[j] = -1;
	}
}

/* is b (a later candidate) a better argmax than a? NaN beats numbers, the
 * first of equals wins */
static inline bool better_d(double b, double a)
{
	return b > a || (b != b && a == a);
}

/* Float-domain folds, generated for double chunks and for f32 rows read in
 * place (converted to double as they are summed). ROW_D folds n values of
 * one row chunk (reduced indices pos...) into lane 0; COL_D folds one value
 * per lane (w lanes, reduced index pos) into the lanes. */
#define ROW_D(NAME, TX)                                                                        \
	static void NAME(const rd_plan *p, int pass, double mean, const TX *x, int64_t n,      \
	                 int64_t pos, rd_acc *a)                                               \
	{                                                                                      \
		double s = 0, m = p->op == KL_OP_MIN ? INFINITY : -INFINITY;                   \
		int nan = 0;                                                                   \
		if (pass == 1) {                                                               \
			_Pragma("omp simd reduction(+:s)") for (int64_t i = 0; i < n; i++)        \
			{                                                                         \
				double dv = (double)x[i] - mean;                               \
				s += dv * dv;                                                  \
			}                                                                      \
			a->d[0] += s;                                                          \
			return;                                                                \
		}                                                                              \
		switch (p->op) {                                                               \
		case KL_OP_MAX:                                                                \
			_Pragma("omp simd reduction(max:m) reduction(|:nan)") for (int64_t i = 0; \
			                                                           i < n; i++)    \
			{                                                                         \
				double v = x[i];                                               \
				m = v > m ? v : m;                                             \
				nan |= v != v;                                                 \
			}                                                                      \
			a->d[0] = KL_FMAX(a->d[0], nan ? NAN : m);                             \
			break;                                                                 \
		case KL_OP_MIN:                                                                \
			_Pragma("omp simd reduction(min:m) reduction(|:nan)") for (int64_t i = 0; \
			                                                           i < n; i++)    \
			{                                                                         \
				double v = x[i];                                               \
				m = v < m ? v : m;                                             \
				nan |= v != v;                                                 \
			}                                                                      \
			a->d[0] = KL_FMIN(a->d[0], nan ? NAN : m);                             \
			break;                                                                 \
		case KL_OP_ARGMAX:                                                             \
			for (int64_t i = 0; i < n; i++) {                                      \
				if (a->arg[0] < 0 || better_d(x[i], a->d[0])) {                \
					a->d[0] = x[i];                                        \
					a->arg[0] = pos + i;                                   \
				}                                                              \
			}                                                                      \
			break;                                                                 \
		default:                                                                       \
			_Pragma("omp simd reduction(+:s)") for (int64_t i = 0; i < n; i++) s +=   \
			        (double)x[i];                                                     \
			a->d[0] += s;                                                          \
			break;                                                                 \
		}                                                                              \
	}

#define COL_D(NAME, TX)                                                                        \
	static void NAME(const rd_plan *p, int pass, const double *mean, const TX *x, int64_t w, \
	                 int64_t pos, rd_acc *a)                                                 \
	{                                                                                      \
		double *d = a->d;                                                              \
		if (pass == 1) {                                                               \
			KL_SIMD                                                                \
			for (int64_t j = 0; j < w; j++) {                                      \
				double dv = (double)x[j] - mean[j];                            \
				d[j] += dv * dv;                                               \
			}                                                                      \
			return;                                                                \
		}                                                                              \
		switch (p->op) {                                                               \
		case KL_OP_MAX:                                                                \
			KL_SIMD                                                                \
			for (int64_t j = 0; j < w; j++) {                                      \
				double v = x[j];                                               \
				d[j] = KL_FMAX(d[j], v);                                       \
			}                                                                      \
			break;                                                                 \
		case KL_OP_MIN:                                                                \
			KL_SIMD                                                                \
			for (int64_t j = 0; j < w; j++) {                                      \
				double v = x[j];                                               \
				d[j] = KL_FMIN(d[j], v);                                       \
			}                                                                      \
			break;                                                                 \
		case KL_OP_ARGMAX:                                                             \
			for (int64_t j = 0; j < w; j++) {                                      \
				if (a->arg[j] < 0 || better_d(x[j], d[j])) {                   \
					d[j] = x[j];                                           \
					a->arg[j] = pos;                                       \
				}                                                              \
			}                                                                      \
			break;                                                                 \
		default:                                                                       \
			KL_SIMD                                                                \
			for (int64_t j = 0; j < w; j++)                                        \
				d[j] += (double)x[j];                                          \
			break;                                                                 \
		}                                                                              \
	}

ROW_D(row_d64, double)
ROW_D(row_d32, float)
COL_D(col_d64, double)
COL_D(col_d32, float)

/* integer-domain folds: wrapping sums, exact max/min/argmax */
static void row_i64(const rd_plan *p, const int64_t *x, int64_t n, int64_t pos, rd_acc *a)
{
	switch (p->op) {
	case KL_OP_MAX: {
		int64_t m = a->i[0];
		_Pragma("omp simd reduction(max:m)") for (int64_t i = 0; i < n; i++) m =
		        x[i] > m ? x[i] : m;
		a->i[0] = m;
		break;
	}
	case KL_OP_MIN: {
		int64_t m = a->i[0];
		_Pragma("omp simd reduction(min:m)") for (int64_t i = 0; i < n; i++) m =
		        x[i] < m ? x[i] : m;
		a->i[0] = m;
		break;
	}
	case KL_OP_ARGMAX:
		for (int64_t i = 0; i < n; i++) {
			if (a->arg[0] < 0 || x[i] > a->i[0]) {
				a->i[0] = x[i];
				a->arg[0] = pos + i;
			}
		}
		break;
	default: {
		uint64_t s = 0; /* unsigned: wraps without UB */
		_Pragma("omp simd reduction(+:s)") for (int64_t i = 0; i < n; i++) s +=
		        (uint64_t)x[i];
		a->i[0] = (int64_t)((uint64_t)a->i[0] + s);
		break;
	}
	}
}

static void col_i64(const rd_plan *p, const int64_t *x, int64_t w, int64_t pos, rd_acc *a)
{
	int64_t *s = a->i;
	switch (p->op) {
	case KL_OP_MAX:
		KL_SIMD
		for (int64_t j = 0; j < w; j++)
			s[j] = x[j] > s[j] ? x[j] : s[j];
		break;
	case KL_OP_MIN:
		KL_SIMD
		for (int64_t j = 0; j < w; j++)
			s[j] = x[j] < s[j] ? x[j] : s[j];
		break;
	case KL_OP_ARGMAX:
		for (int64_t j = 0; j < w; j++) {
			if (a->arg[j] < 0 || x[j] > s[j]) {
				s[j] = x[j];
				a->arg[j] = pos;
			}
		}
		break;
	default:
		KL_SIMD
		for (int64_t j = 0; j < w; j++)
			s[j] = (int64_t)((uint64_t)s[j] + (uint64_t)x[j]);
		break;
	}
}

/* How a chunk of the input is read: in place as double/int64, in place as
 * f32 (float domain only), or converted into a buffer. */
typedef enum { RD_BUF, RD_NATIVE, RD_F32 } rd_read;

static rd_read read_mode(const rd_plan *p, int64_t stride)
{
	if (stride != 1)
		return RD_BUF;
	if (p->dt == (p->idom ? KL_I64 : KL_F64))
		return RD_NATIVE;
	return !p->idom && p->dt == KL_F32 ? RD_F32 : RD_BUF;
}

static const void *read_chunk(const rd_plan *p, rd_read mode, const char *ptr, int64_t stride,
                              int64_t n, rd_buf *buf)
{
	if (mode != RD_BUF)
		return ptr;
	if (p->idom)
		kl__cpu_load_i64(buf->i, ptr, p->dt, stride, n);
	else
		kl__cpu_load_f64(buf->d, ptr, p->dt, stride, n);
	return buf;
}

static void row_chunk(const rd_plan *p, rd_read mode, int pass, double mean, const void *v,
                      int64_t n, int64_t pos, rd_acc *a)
{
	if (p->idom)
		row_i64(p, v, n, pos, a);
	else if (mode == RD_F32)
		row_d32(p, pass, mean, v, n, pos, a);
	else
		row_d64(p, pass, mean, v, n, pos, a);
}

static void col_chunk(const rd_plan *p, rd_read mode, int pass, const double *mean, const void *v,
                      int64_t w, int64_t pos, rd_acc *a)
{
	if (p->idom)
		col_i64(p, v, w, pos, a);
	else if (mode == RD_F32)
		col_d32(p, pass, mean, v, w, pos, a);
	else
		col_d64(p, pass, mean, v, w, pos, a);
}

/* Fold the partial b (covering later reduced indices) into a. */
static void acc_merge(const rd_plan *p, int pass, rd_acc *a, const rd_acc *b, int64_t w)
{
	for (int64_t j = 0; j < w; j++) {
		if (pass == 1 || p->op == KL_OP_SUM || p->op == KL_OP_MEAN || p->op == KL_OP_VAR) {
			a->d[j] += b->d[j];
			a->i[j] = (int64_t)((uint64_t)a->i[j] + (uint64_t)b->i[j]);
		} else if (p->op == KL_OP_MAX) {
			a->d[j] = KL_FMAX(a->d[j], b->d[j]);
			a->i[j] = b->i[j] > a->i[j] ? b->i[j] : a->i[j];
		} else if (p->op == KL_OP_MIN) {
			a->d[j] = KL_FMIN(a->d[j], b->d[j]);
			a->i[j] = b->i[j] < a->i[j] ? b->i[j] : a->i[j];
		} else if (b->arg[j] >= 0) {
			bool take = a->arg[j] < 0 ||
			            (p->idom ? b->i[j] > a->i[j] : better_d(b->d[j], a->d[j]));
			if (take) {
				a->d[j] = b->d[j];
				a->i[j] = b->i[j];
				a->arg[j] = b->arg[j];
			}
		}
	}
}

/* reduced indices [lo, hi) of the row at input offset koff */
static void row_span(const rd_plan *p, int64_t koff, int64_t lo, int64_t hi, int pass, double mean,
                     rd_acc *a)
{
	if (lo >= hi)
		return;
	rd_buf buf;
	int nr = p->nr;
	int64_t idx[KL_MAX_DIMS], rem = lo;
	for (int d = nr - 1; d >= 0; d--) {
		idx[d] = rem % p->rs[d];
		rem /= p->rs[d];
	}
	int64_t len = p->rs[nr - 1], s = p->rst[nr - 1];
	rd_read mode = read_mode(p, s);
	while (lo < hi) {
		int64_t n = len - idx[nr - 1];
		if (n > hi - lo)
			n = hi - lo;
		if (n > CHUNK)
			n = CHUNK;
		int64_t off = koff;
		for (int d = 0; d < nr; d++)
			off += idx[d] * p->rst[d];
		const void *v = read_chunk(p, mode, p->base + off * (int64_t)p->es, s, n, &buf);
		row_chunk(p, mode, pass, mean, v, n, lo, a);
		lo += n;
		idx[nr - 1] += n;
		for (int d = nr - 1; d > 0 && idx[d] == p->rs[d]; d--) {
			idx[d] = 0;
			idx[d - 1]++;
		}
	}
}

/* reduced indices [lo, hi) of w lanes starting at input offset koff */
static void col_span(const rd_plan *p, int64_t koff, int64_t w, int64_t lo, int64_t hi, int pass,
                     const double *mean, rd_acc *a)
{
	if (lo >= hi)
		return;
	rd_buf buf;
	int nr = p->nr;
	int64_t idx[KL_MAX_DIMS], rem = lo;
	for (int d = nr - 1; d >= 0; d--) {
		idx[d] = rem % p->rs[d];
		rem /= p->rs[d];
	}
	int64_t s = p->kst[p->lane];
	rd_read mode = read_mode(p, s);
	for (int64_t r = lo; r < hi; r++) {
		int64_t off = koff;
		for (int d = 0; d < nr; d++)
			off += idx[d] * p->rst[d];
		const void *v = read_chunk(p, mode, p->base + off * (int64_t)p->es, s, w, &buf);
		col_chunk(p, mode, pass, mean, v, w, r, a);
		idx[nr - 1]++;
		for (int d = nr - 1; d > 0 && idx[d] == p->rs[d]; d--) {
			idx[d] = 0;
			idx[d - 1]++;
		}
	}
}

/* Where task t reads (koff), writes (ooff, ostride) and how many lanes. */
static int64_t task_geom(const rd_plan *p, int64_t t, int64_t *koff, int64_t *ooff,
                         int64_t *ostride)
{
	*koff = 0;
	*ooff = 0;
	if (!p->col) {
		int64_t rem = t;
		for (int d = p->nk - 1; d >= 0; d--) {
			*koff += (rem % p->ks[d]) * p->kst[d];
			rem /= p->ks[d];
		}
		*ooff = t;
		*ostride = 1;
		return 1;
	}
	int64_t g = t / p->nblocks, c0 = (t % p->nblocks) * RB;
	for (int d = p->ng - 1; d >= 0; d--) {
		int64_t i = g % p->gs[d];
		g /= p->gs[d];
		*koff += i * p->gst[d];
		*ooff += i * p->gost[d];
	}
	*koff += c0 * p->kst[p->lane];
	*ooff += c0 * p->kost[p->lane];
	*ostride = p->kost[p->lane];
	int64_t w = p->ks[p->lane] - c0;
	return w < RB ? w : RB;
}

static void span(const rd_plan *p, int64_t koff, int64_t w, int64_t lo, int64_t hi, int pass,
                 const double *mean, rd_acc *a)
{
	if (p->col)
		col_span(p, koff, w, lo, hi, pass, mean, a);
	else
		row_span(p, koff, lo, hi, pass, mean[0], a);
}

/* One pass of task t over all reduced indices into a; with part != NULL
 * the reduced range is split over nt threads (part: nt partial accs). */
typedef struct pass_job {
	const rd_plan *p;
	int64_t koff, w;
	int pass;
	const double *mean;
	rd_acc *part;
	int nt;
} pass_job;

/* parts [t0, t1) of nt: each its share of the reduced range, its own acc */
static void pass_chunk(void *arg, int64_t t0, int64_t t1)
{
	const pass_job *j = arg;
	const rd_plan *p = j->p;
	for (int64_t t = t0; t < t1; t++) {
		acc_init(p, &j->part[t], j->w, j->pass);
		span(p, j->koff, j->w, p->nred * t / j->nt, p->nred * (t + 1) / j->nt, j->pass,
		     j->mean, &j->part[t]);
	}
}

static void task_pass(const rd_plan *p, int64_t koff, int64_t w, int pass, const double *mean,
                      rd_acc *a, rd_acc *part, int nt)
{
	acc_init(p, a, w, pass);
	if (!part) {
		span(p, koff, w, 0, p->nred, pass, mean, a);
		return;
	}
	pass_job j = {p, koff, w, pass, mean, part, nt};
	kl__par_for(nt, nt, pass_chunk, &j);
	for (int t = 0; t < nt; t++)
		acc_merge(p, pass, a, &part[t], w);
}

static void task_run(const rd_plan *p, int64_t t, rd_acc *part, int nt)
{
	rd_acc a;
	double mean[RB], res[RB];
	int64_t koff, ooff, ostride;
	int64_t w = task_geom(p, t, &koff, &ooff, &ostride);
	for (int64_t j = 0; j < w; j++)
		mean[j] = 0;
	task_pass(p, koff, w, 0, mean, &a, part, nt);
	char *o = p->out + ooff * (int64_t)p->oes;
	if (p->op == KL_OP_ARGMAX) {
		kl__cpu_store_i64(o, p->odt, ostride, a.arg, w);
		return;
	}
	if (p->idom) {
		kl__cpu_store_i64(o, p->odt, ostride, a.i, w);
		return;
	}
	double n = (double)p->nred;
	if (p->op == KL_OP_VAR) {
		/* two passes: the mean first, then squared deviations from it */
		for (int64_t j = 0; j < w; j++)
			mean[j] = a.d[j] / n;
		task_pass(p, koff, w, 1, mean, &a, part, nt);
		double div = n - (double)p->corr;
		if (div < 0)
			div = 0;
		for (int64_t j = 0; j < w; j++)
			res[j] = a.d[j] / div;
	} else if (p->op == KL_OP_MEAN) {
		for (int64_t j = 0; j < w; j++)
			res[j] = a.d[j] / n;
	} else {
		for (int64_t j = 0; j < w; j++)
			res[j] = a.d[j];
	}
	kl__cpu_store_f64(o, p->odt, ostride, res, w);
}

static void tasks_chunk(void *arg, int64_t lo, int64_t hi)
{
	for (int64_t t = lo; t < hi; t++)
		task_run(arg, t, NULL, 1);
}

/* Any reduction through the op table's row function, in double: the eager
 * path of a reduction the loops above do not know (a new reduction runs
 * before it gets a loop of its own), and every reduction while
 * kl__cpu_rd_generic_only is set (the table walk holds this path to the
 * reference too). */
bool kl__cpu_rd_generic_only;

static bool rd_has_loop(kl_op op)
{
	return op == KL_OP_SUM || op == KL_OP_MEAN || op == KL_OP_MAX || op == KL_OP_MIN ||
	       op == KL_OP_VAR || op == KL_OP_ARGMAX;
}

static kl_status rd_generic(kl_ctx *ctx, const rd_plan *p, const kl_node *n, const char *name)
{
	const kl_opdesc *d = kl__opdesc[p->op];
	if (!d->row)
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_%s: the op table gives no row rule", name);
	double *row = malloc(sizeof(double) * (size_t)(p->nred > 0 ? p->nred : 1));
	if (!row)
		return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory for a row of %lld", name,
		               (long long)p->nred);
	int64_t inner = p->rs[p->nr - 1], ist = p->rst[p->nr - 1];
	for (int64_t o = 0; o < p->nout; o++) {
		int64_t off = 0, q = o;
		for (int k = p->nk - 1; k >= 0; k--) {
			off += q % p->ks[k] * p->kst[k];
			q /= p->ks[k];
		}
		for (int64_t j = 0; j < p->nred; j += inner) {
			int64_t roff = off;
			q = j / inner;
			for (int k = p->nr - 2; k >= 0; k--) {
				roff += q % p->rs[k] * p->rst[k];
				q /= p->rs[k];
			}
			kl__cpu_load_f64(row + j, p->base + roff * (int64_t)p->es, p->dt, ist,
			                 inner);
		}
		double v = d->row(n, row, p->nred);
		kl__cpu_store_f64(p->out + o * (int64_t)p->oes, p->odt, 1, &v, 1);
	}
	free(row);
	return KL_OK;
}

kl_status kl__cpu_reduce(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	const char *name = kl__cpu_opname(n);
	if (n->nin != 1 || !in[0] || !in[0]->st)
		return kl__err(ctx, KL_EINVAL, "kl_%s: cpu kernel expects one materialized input",
		               name);
	const kl_tensor *x = in[0];
	rd_plan p;
	memset(&p, 0, sizeof p);
	p.op = (kl_op)n->op;
	p.dt = x->dtype;
	p.es = kl_dtype_size(x->dtype);
	p.base = kl__tensor_data(x);
	p.odt = (kl_dtype)n->dtype;
	p.oes = kl_dtype_size(p.odt);
	p.out = kl__tensor_data(out);
	p.corr = n->a.correction;
	bool intin = kl__cpu_ct(x->dtype) == KL_CT_I64;
	p.idom = intin && p.op != KL_OP_MEAN && p.op != KL_OP_VAR;
	if (p.op == KL_OP_ARGMAX && p.odt != KL_I64)
		return kl__err(ctx, KL_EINVAL, "kl_%s: result must be i64, node is %s", name,
		               kl_dtype_name(p.odt));

	uint32_t mask = n->a.axes;
	if (p.op == KL_OP_ARGMAX) {
		if (n->a.axis < 0 || n->a.axis >= (x->ndim > 0 ? x->ndim : 1))
			return kl__err(ctx, KL_EINVAL, "kl_%s: axis %d out of range for %d dims",
			               name, (int)n->a.axis, x->ndim);
		mask = x->ndim > 0 ? 1u << n->a.axis : 0;
	} else if (mask == 0) {
		/* the front end never reduces no dim; 0 means all, as in the reference */
		mask = (uint32_t)((1ull << x->ndim) - 1);
	}
	if (x->ndim < 32 && (mask >> x->ndim) != 0)
		return kl__err(ctx, KL_EINVAL, "kl_%s: axes mask 0x%x names dims past %d", name,
		               (unsigned)mask, x->ndim);

	/* split into kept and reduced dims, merging neighbours that walk memory
	 * contiguously and dropping dims of size 1 */
	int64_t sz[KL_MAX_DIMS], sv[KL_MAX_DIMS];
	bool red[KL_MAX_DIMS];
	int m = 0;
	p.nred = 1;
	p.nout = 1;
	for (int d = 0; d < x->ndim; d++) {
		bool r = (mask >> d) & 1u;
		if (r)
			p.nred *= x->shape[d];
		else
			p.nout *= x->shape[d];
		if (x->shape[d] == 1)
			continue;
		if (m > 0 && red[m - 1] == r && sv[m - 1] == x->strides[d] * x->shape[d]) {
			sz[m - 1] *= x->shape[d];
			sv[m - 1] = x->strides[d];
			continue;
		}
		sz[m] = x->shape[d];
		sv[m] = x->strides[d];
		red[m] = r;
		m++;
	}
	if (p.nout != kl__numel(n->ndim, n->shape))
		return kl__err(ctx, KL_EINVAL, "kl_%s: node has %lld elements, reducing gives %lld",
		               name, (long long)kl__numel(n->ndim, n->shape), (long long)p.nout);
	if (p.nout == 0)
		return KL_OK;
	if (p.nred == 0 && (p.op == KL_OP_MAX || p.op == KL_OP_MIN || p.op == KL_OP_ARGMAX))
		return kl__err(ctx, KL_EINVAL, "kl_%s: reduction over an empty dim has no identity",
		               name);
	for (int d = 0; d < m; d++) {
		if (red[d]) {
			p.rs[p.nr] = sz[d];
			p.rst[p.nr++] = sv[d];
		} else {
			p.ks[p.nk] = sz[d];
			p.kst[p.nk++] = sv[d];
		}
	}
	if (p.nr == 0) {
		p.rs[0] = 1;
		p.rst[0] = 0;
		p.nr = 1;
	}
	int64_t os = 1;
	for (int d = p.nk - 1; d >= 0; d--) {
		p.kost[d] = os;
		os *= p.ks[d];
	}
	if (kl__cpu_rd_generic_only || !rd_has_loop(p.op))
		return rd_generic(ctx, &p, n, name);

	/* column mode unless the innermost reduced dim is a long contiguous row */
	bool rowgood = p.rst[p.nr - 1] == 1 && p.rs[p.nr - 1] >= 64;
	if (!rowgood && p.nk > 0) {
		int lane = p.nk - 1;
		for (int d = 0; d < p.nk; d++)
			if (p.kst[d] == 1)
				lane = d;
		if (p.ks[lane] >= 8) {
			p.col = true;
			p.lane = lane;
			for (int d = 0; d < p.nk; d++) {
				if (d == lane)
					continue;
				p.gs[p.ng] = p.ks[d];
				p.gst[p.ng] = p.kst[d];
				p.gost[p.ng++] = p.kost[d];
			}
			p.nblocks = (p.ks[lane] + RB - 1) / RB;
			p.ngroups = p.nout / p.ks[lane];
		}
	}

	int64_t ntasks = p.col ? p.ngroups * p.nblocks : p.nout;
	int nt = kl__cpu_threads(ctx);
	double work = (double)p.nout * (double)p.nred;
	if (nt > 1 && work >= KL_CPU_PAR_MIN && ntasks >= nt) {
		kl__par_for(nt, ntasks, tasks_chunk, &p);
	} else if (nt > 1 && p.nred >= KL_CPU_PAR_MIN) {
		rd_acc *part = malloc(sizeof(rd_acc) * (size_t)nt);
		if (!part)
			return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory for %d partial sums",
			               name, nt);
		for (int64_t t = 0; t < ntasks; t++)
			task_run(&p, t, part, nt);
		free(part);
	} else {
		for (int64_t t = 0; t < ntasks; t++)
			task_run(&p, t, NULL, 1);
	}
	return KL_OK;
}
