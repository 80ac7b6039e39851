/* rows.c - CPU eager kernels for the row-wise composites: softmax and
 * log_softmax over any axis, layer_norm and rms_norm over the last dim.
 *
 * Each row is read once into the compute type (in place when it already is
 * contiguous f32/f64), reduced in double, and written in one pass; rows run
 * in parallel. A row along a non-last axis is gathered into scratch and its
 * result scattered with the output's stride.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "backend/cpu/cpu.h"

typedef struct rw_plan {
	kl_op op;
	kl_cpu_ct ct;
	const char *x;
	kl_dtype xdt;
	size_t xes;
	int64_t L, xs, ys; /* row length; x and output strides along the row */
	int no;            /* the other dims: rows are their product */
	int64_t os[KL_MAX_DIMS], xst[KL_MAX_DIMS], yst[KL_MAX_DIMS];
	int64_t nrows;
	char *out;
	kl_dtype odt;
	size_t oes;
	double eps;
	const void *w, *b; /* weight and bias as L compute-type values, or NULL */
} rw_plan;

static void row_offsets(const rw_plan *p, int64_t r, int64_t *xoff, int64_t *yoff)
{
	*xoff = 0;
	*yoff = 0;
	for (int d = p->no - 1; d >= 0; d--) {
		int64_t i = r % p->os[d];
		r /= p->os[d];
		*xoff += i * p->xst[d];
		*yoff += i * p->yst[d];
	}
}

/* A norm row whose mean square (double) reached SAFE, where the T path
 * would overflow x - mean or lose inv to a subnormal (f32 rows of +-3e38,
 * f64 rows of +-1e300 whose squares are inf even in double): the row
 * scaled by its largest magnitude m, eps by 1/m^2, all in double. False
 * (nothing written) for a row holding an inf, which the plain path already
 * gives as the reference does. */
#define NORM_SCALED_FN(NAME, T)                                                               \
	static bool norm_scaled_##NAME(const rw_plan *p, const T *x, T *y)                     \
	{                                                                                      \
		int64_t L = p->L;                                                              \
		const T *w = p->w, *b = p->b;                                                  \
		double m = 0, mu = 0, q = 0;                                                   \
		for (int64_t i = 0; i < L; i++)                                                \
			m = fmax(m, fabs((double)x[i]));                                       \
		if (!(m > 0) || isinf(m))                                                      \
			return false;                                                          \
		for (int64_t i = 0; i < L && p->op == KL_OP_LAYER_NORM; i++)                   \
			mu += (double)x[i] / m;                                                \
		mu /= (double)L;                                                               \
		for (int64_t i = 0; i < L; i++)                                                \
			q += ((double)x[i] / m - mu) * ((double)x[i] / m - mu);                \
		double den = q / (double)L + p->eps / m / m;                                   \
		double inv = den > 0 ? 1.0 / sqrt(den) : 0.0; /* every deviation is 0 */       \
		for (int64_t i = 0; i < L; i++) {                                              \
			T v = (T)(((double)x[i] / m - mu) * inv);                              \
			v = w ? v * w[i] : v;                                                  \
			y[i] = b ? v + b[i] : v;                                               \
		}                                                                              \
		return true;                                                                   \
	}

NORM_SCALED_FN(row_f32, float)
NORM_SCALED_FN(row_f64, double)

/* One row function per compute type: T is float or double. Sums run in
 * double either way. SAFE: the mean square below which the T path is
 * exact (inv a normal T, x - mean finite). */
#define ROW_FN(NAME, T, NATIVE, EXPF, LOADF, STOREF, SAFE)                                   \
	KL_CPU_CLONES static void NAME(const rw_plan *p, int64_t r, T *xbuf, T *ybuf)                     \
	{                                                                                      \
		int64_t xoff, yoff, L = p->L;                                                  \
		row_offsets(p, r, &xoff, &yoff);                                               \
		const char *xp = p->x + xoff * (int64_t)p->xes;                                \
		char *yp = p->out + yoff * (int64_t)p->oes;                                    \
		const T *x = (const T *)(const void *)xp;                                      \
		if (p->xdt != NATIVE || p->xs != 1) {                                          \
			LOADF(xbuf, xp, p->xdt, p->xs, L);                                     \
			x = xbuf;                                                              \
		}                                                                              \
		bool direct = p->odt == NATIVE && p->ys == 1;                                  \
		T *y = direct ? (T *)(void *)yp : ybuf;                                        \
		if (p->op == KL_OP_SOFTMAX || p->op == KL_OP_LOG_SOFTMAX) {                    \
			T m = -INFINITY;                                                       \
			int nan = 0;                                                           \
			_Pragma("omp simd reduction(max:m) reduction(|:nan)") for (int64_t i = 0;  \
			                                                           i < L; i++)     \
			{                                                                          \
				m = x[i] > m ? x[i] : m;                                       \
				nan |= x[i] != x[i];                                           \
			}                                                                      \
			if (nan)                                                               \
				m = NAN;                                                       \
			double s = 0;                                                          \
			_Pragma("omp simd reduction(+:s)") for (int64_t i = 0; i < L; i++)         \
			{                                                                          \
				T e = EXPF(x[i] - m);                                          \
				y[i] = e;                                                      \
				s += e;                                                        \
			}                                                                      \
			if (p->op == KL_OP_SOFTMAX) {                                          \
				T inv = (T)(1.0 / s);                                          \
				KL_SIMD                                                        \
				for (int64_t i = 0; i < L; i++)                                \
					y[i] *= inv;                                           \
			} else {                                                               \
				T ls = (T)log(s);                                              \
				KL_SIMD                                                        \
				for (int64_t i = 0; i < L; i++)                                \
					y[i] = (x[i] - m) - ls;                                \
			}                                                                      \
		} else {                                                                       \
			double mean = 0, ss = 0;                                               \
			if (p->op == KL_OP_LAYER_NORM) {                                       \
				double s = 0;                                                  \
				_Pragma("omp simd reduction(+:s)") for (int64_t i = 0; i < L; i++) \
					s += x[i];                                             \
				mean = s / (double)L;                                          \
			}                                                                      \
			_Pragma("omp simd reduction(+:ss)") for (int64_t i = 0; i < L; i++)        \
			{                                                                          \
				double dv = x[i] - mean;                                       \
				ss += dv * dv;                                                 \
			}                                                                      \
			T inv = (T)(1.0 / sqrt(ss / (double)L + p->eps));                      \
			T mu = (T)mean;                                                        \
			const T *w = p->w, *b = p->b;                                          \
			if (!(ss / (double)L < SAFE) && norm_scaled_##NAME(p, x, y)) {         \
				/* written, scaled by the row's largest magnitude */           \
			} else if (w && b) {                                                   \
				KL_SIMD                                                        \
				for (int64_t i = 0; i < L; i++)                                \
					y[i] = (x[i] - mu) * inv * w[i] + b[i];                \
			} else if (w) {                                                        \
				KL_SIMD                                                        \
				for (int64_t i = 0; i < L; i++)                                \
					y[i] = (x[i] - mu) * inv * w[i];                       \
			} else if (b) {                                                        \
				KL_SIMD                                                        \
				for (int64_t i = 0; i < L; i++)                                \
					y[i] = (x[i] - mu) * inv + b[i];                       \
			} else {                                                               \
				KL_SIMD                                                        \
				for (int64_t i = 0; i < L; i++)                                \
					y[i] = (x[i] - mu) * inv;                              \
			}                                                                      \
		}                                                                              \
		if (!direct)                                                                   \
			STOREF(yp, p->odt, p->ys, y, L);                                       \
	}

ROW_FN(row_f32, float, KL_F32, kl__cpu_expf, kl__cpu_load_f32, kl__cpu_store_f32, 0x1p120)
ROW_FN(row_f64, double, KL_F64, exp, kl__cpu_load_f64, kl__cpu_store_f64, 0x1p1000)

/* rows [lo, hi) with scratch for two rows of the compute type */
static void run_rows(const rw_plan *p, int64_t lo, int64_t hi, void *scratch)
{
	size_t es = kl__cpu_ct_size(p->ct);
	char *xb = scratch, *yb = xb + (size_t)p->L * es;
	for (int64_t r = lo; r < hi; r++) {
		if (p->ct == KL_CT_F32)
			row_f32(p, r, (float *)(void *)xb, (float *)(void *)yb);
		else
			row_f64(p, r, (double *)(void *)xb, (double *)(void *)yb);
	}
}

typedef struct rows_job {
	const rw_plan *p;
	size_t scratch;
	_Atomic bool oom;
} rows_job;

static void rows_chunk(void *arg, int64_t lo, int64_t hi)
{
	rows_job *j = arg;
	void *sc = malloc(j->scratch);
	if (!sc) {
		atomic_store(&j->oom, true);
		return;
	}
	run_rows(j->p, lo, hi, sc);
	free(sc);
}

/* weight or bias t ([L], any float dtype and stride) as L compute-type values */
static void *load_param(kl_ctx *ctx, const rw_plan *p, const kl_tensor *t, const char *what,
                        const char *name, kl_status *st)
{
	if (!t || !t->st || t->ndim != 1 || t->shape[0] != p->L) {
		char b[96];
		*st = kl__err(ctx, KL_EINVAL, "kl_%s: %s must be a materialized [%lld], got %s",
		              name, what, (long long)p->L,
		              t ? kl__shape_str(b, sizeof b, t->ndim, t->shape) : "NULL");
		return NULL;
	}
	size_t es = kl__cpu_ct_size(p->ct);
	void *v = malloc(es * (size_t)(p->L > 0 ? p->L : 1));
	if (!v) {
		*st = kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory for the %s", name, what);
		return NULL;
	}
	kl__cpu_load_ct(p->ct, v, kl__tensor_data(t), t->dtype, t->strides[0], p->L);
	return v;
}

kl_status kl__cpu_rows(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	const char *name = kl__cpu_opname(n);
	rw_plan p;
	memset(&p, 0, sizeof p);
	p.op = (kl_op)n->op;
	p.odt = (kl_dtype)n->dtype;
	p.oes = kl_dtype_size(p.odt);
	p.out = kl__tensor_data(out);
	p.eps = n->a.s[0];
	if (!kl_dtype_is_float(p.odt))
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_%s: result dtype %s is not a float dtype",
		               name, kl_dtype_name(p.odt));
	p.ct = kl__cpu_ct(p.odt);
	bool norm = p.op == KL_OP_LAYER_NORM || p.op == KL_OP_RMS_NORM;
	bool hw = norm && (n->a.flags & KL_F_HAS_WEIGHT);
	bool hb = p.op == KL_OP_LAYER_NORM && (n->a.flags & KL_F_HAS_BIAS);
	int want = 1 + hw + hb;
	if (n->nin != want)
		return kl__err(ctx, KL_EINVAL, "kl_%s: %d inputs, flags 0x%x want %d", name, n->nin,
		               (unsigned)n->a.flags, want);
	const kl_tensor *x = in[0];
	if (!x || !x->st)
		return kl__err(ctx, KL_EINVAL, "kl_%s: input is not materialized", name);
	bool same = x->ndim == n->ndim;
	for (int d = 0; same && d < n->ndim; d++)
		same = x->shape[d] == n->shape[d];
	if (!same || (norm && n->ndim < 1)) {
		char b1[96], b2[96];
		return kl__err(ctx, KL_EINVAL, "kl_%s: input %s, node %s", name,
		               kl__shape_str(b1, sizeof b1, x->ndim, x->shape),
		               kl__shape_str(b2, sizeof b2, n->ndim, n->shape));
	}
	int ax = norm ? n->ndim - 1 : n->a.axis;
	if (n->ndim > 0 && (ax < 0 || ax >= n->ndim))
		return kl__err(ctx, KL_EINVAL, "kl_%s: axis %d out of range for %d dims", name, ax,
		               (int)n->ndim);
	p.x = kl__tensor_data(x);
	p.xdt = x->dtype;
	p.xes = kl_dtype_size(x->dtype);
	int64_t ost[KL_MAX_DIMS];
	kl__contig_strides(n->ndim, n->shape, ost);
	p.L = 1;
	p.xs = 0;
	p.ys = 1;
	for (int d = 0; d < n->ndim; d++) {
		if (d == ax) {
			p.L = n->shape[d];
			p.xs = x->strides[d];
			p.ys = ost[d];
			continue;
		}
		p.os[p.no] = n->shape[d];
		p.xst[p.no] = x->strides[d];
		p.yst[p.no++] = ost[d];
	}
	p.nrows = kl__numel(p.no, p.os);
	if (p.nrows == 0 || p.L == 0)
		return KL_OK;

	kl_status st = KL_OK;
	void *wv = NULL, *bv = NULL;
	if (hw && !(wv = load_param(ctx, &p, in[1], "weight", name, &st)))
		return st;
	if (hb && !(bv = load_param(ctx, &p, in[1 + hw], "bias", name, &st))) {
		free(wv);
		return st;
	}
	p.w = wv;
	p.b = bv;

	size_t scratch = 2 * (size_t)p.L * kl__cpu_ct_size(p.ct);
	int nt = kl__cpu_threads(ctx);
	bool oom = false;
	if (nt > 1 && p.nrows > 1 && p.nrows * p.L >= KL_CPU_PAR_MIN) {
		rows_job j = {&p, scratch, false};
		kl__par_for(nt, p.nrows, rows_chunk, &j);
		oom = atomic_load(&j.oom);
	} else {
		void *sc = malloc(scratch);
		if (sc)
			run_rows(&p, 0, p.nrows, sc);
		else
			oom = true;
		free(sc);
	}
	free(wv);
	free(bv);
	if (oom)
		return kl__err(ctx, KL_ENOMEM, "kl_%s: out of memory for a row of %lld", name,
		               (long long)p.L);
	return KL_OK;
}
