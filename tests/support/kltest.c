/* kltest.c - the shared test helpers (see kltest.h): input generation in
 * every dtype/range/layout, read-back, and the op checker that holds eager
 * results to the float64 reference evaluated on the op's traced graph.
 */
#include "kltest.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capture/trace.h"
#include "core/core.h"
#include "graph/graph.h"
#include "graph/reference.h"

uint64_t kltest_next(uint64_t *state)
{
	uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

double kltest_uniform(uint64_t *state)
{
	return (double)(kltest_next(state) >> 11) * 0x1p-53;
}

static double rand_int(uint64_t *s, int lo, int hi)
{
	return (double)(lo + (int)(kltest_next(s) % (uint64_t)(hi - lo + 1)));
}

static const double special_float[] = {NAN,          INFINITY,      -INFINITY, 0.0,     -0.0,
                                       1e30,         -1e30,         1e-30,     65504.0, -70000.0,
                                       3.5e38,       1e300,         0.5,       -1.5,    2.5,
                                       2147483648.0, -2147483649.0, 9.3e18,    -1e10,   1e-8};

static double gen_value(kl_dtype dt, kltest_range r, uint64_t *s)
{
	if (dt == KL_BOOL)
		return (double)(kltest_next(s) & 1);
	bool fl = kl_dtype_is_float(dt);
	switch (r) {
	case KLTEST_POS: return fl ? 0.25 + 2.75 * kltest_uniform(s) : rand_int(s, 1, 9);
	case KLTEST_SMALLINT: return rand_int(s, -3, 3);
	case KLTEST_SPECIAL:
		if (kltest_next(s) % 4 == 0) {
			if (fl)
				return special_float[kltest_next(s) % (sizeof special_float /
				                                       sizeof special_float[0])];
			double big = dt == KL_I32 ? 2147483647.0 : 9223372036854775807.0;
			const double ints[] = {big, -big - 1, 0, -1, 1};
			return ints[kltest_next(s) % 5];
		}
		break;
	case KLTEST_WIDE:
		if (fl) {
			double m = ldexp(1.0 + kltest_uniform(s), (int)rand_int(s, -12, 12));
			return kltest_next(s) & 1 ? -m : m;
		}
		if (dt == KL_I32)
			return (double)(int32_t)(uint32_t)kltest_next(s);
		return (double)(int64_t)kltest_next(s);
	default: break;
	}
	return fl ? -2.0 + 4.0 * kltest_uniform(s) : rand_int(s, -20, 20);
}

kl_tensor *kltest_rand(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape, kltest_range r,
                       kltest_layout layout, uint64_t seed)
{
	int64_t n = kl__numel(ndim, shape);
	double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
	if (!v) {
		fprintf(stderr, "kltest_rand: out of memory\n");
		return NULL;
	}
	uint64_t s = seed * 0x2545f4914f6cdd1dull + (uint64_t)dt * 7919u + (uint64_t)r * 104729u;
	for (int64_t i = 0; i < n; i++)
		v[i] = gen_value(dt, r, &s);
	kl_tensor *t = kltest_from_values(ctx, dt, ndim, shape, v, layout);
	free(v);
	return t;
}

/* A value no test computes by accident: shows up when a kernel reads an
 * element outside the view it was given. */
static double poison(kl_dtype dt)
{
	switch (dt) {
	case KL_I32: return -123456789.0;
	case KL_I64: return -98765432123.0;
	case KL_BOOL: return 1.0;
	default: return NAN;
	}
}

kl_tensor *kltest_from_values(kl_ctx *ctx, kl_dtype dt, int ndim, const int64_t *shape,
                              const double *vals, kltest_layout layout)
{
	if (ndim == 0)
		layout = KLTEST_CONTIG;
	if (layout == KLTEST_PERMUTED && ndim < 2)
		layout = KLTEST_STRIDED;
	int64_t bshape[KL_MAX_DIMS] = {0};
	if (ndim > 0)
		memcpy(bshape, shape, sizeof(int64_t) * (size_t)ndim);
	if (layout == KLTEST_PERMUTED) {
		for (int d = 0; d < ndim; d++)
			bshape[d] = shape[ndim - 1 - d];
	} else if (layout == KLTEST_STRIDED) {
		bshape[ndim - 1] = 2 * shape[ndim - 1] + 1;
		if (ndim >= 2)
			bshape[0] = shape[0] + 1;
	}
	int64_t n = kl__numel(ndim, shape), bn = kl__numel(ndim, bshape);
	size_t es = kl_dtype_size(dt);
	unsigned char *buf = malloc(es * (size_t)(bn > 0 ? bn : 1));
	if (!buf) {
		fprintf(stderr, "kltest_from_values: out of memory\n");
		return NULL;
	}
	for (int64_t j = 0; j < bn; j++)
		kl__store(buf, dt, j, poison(dt));
	int64_t bstr[KL_MAX_DIMS], idx[KL_MAX_DIMS] = {0};
	kl__contig_strides(ndim, bshape, bstr);
	for (int64_t i = 0; i < n; i++) {
		int64_t off = 0;
		for (int d = 0; d < ndim; d++) {
			if (layout == KLTEST_PERMUTED)
				off += idx[d] * bstr[ndim - 1 - d];
			else if (layout == KLTEST_STRIDED)
				off += (d == ndim - 1 ? 1 + 2 * idx[d] : idx[d] + (d == 0)) *
				       bstr[d];
			else
				off += idx[d] * bstr[d];
		}
		kl__store(buf, dt, off, vals[i]);
		for (int d = ndim - 1; d >= 0; d--) {
			if (++idx[d] < shape[d])
				break;
			idx[d] = 0;
		}
	}
	kl_tensor *base = kl_from_host(ctx, dt, ndim, bshape, buf, es * (size_t)bn);
	free(buf);
	if (!base) {
		fprintf(stderr, "kltest_from_values: kl_from_host failed: %s\n",
		        kl_last_error(ctx));
		return NULL;
	}
	if (layout == KLTEST_CONTIG)
		return base;
	kl_tensor *t = NULL;
	if (layout == KLTEST_PERMUTED) {
		int perm[KL_MAX_DIMS];
		for (int d = 0; d < ndim; d++)
			perm[d] = ndim - 1 - d;
		t = kl_permute(base, perm);
	} else {
		kl_tensor *s1 = kl_slice(base, ndim - 1, 1, 1 + 2 * shape[ndim - 1], 2);
		if (ndim >= 2 && s1) {
			t = kl_slice(s1, 0, 1, 1 + shape[0], 1);
			kl_release(s1);
		} else {
			t = s1;
		}
	}
	kl_release(base);
	if (!t)
		fprintf(stderr, "kltest_from_values: making the view failed: %s\n",
		        kl_last_error(ctx));
	return t;
}

double *kltest_read(kl_tensor *t)
{
	if (!t) {
		fprintf(stderr, "kltest_read: NULL tensor\n");
		return NULL;
	}
	kl_dtype dt = kl_tensor_dtype(t);
	int64_t n = kl_numel(t);
	size_t es = kl_dtype_size(dt);
	unsigned char *buf = malloc(es * (size_t)(n > 0 ? n : 1));
	double *v = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
	if (!buf || !v) {
		free(buf);
		free(v);
		fprintf(stderr, "kltest_read: out of memory\n");
		return NULL;
	}
	kl_status s = kl_to_host(t, buf, es * (size_t)n);
	if (s != KL_OK) {
		fprintf(stderr, "kltest_read: kl_to_host failed (%s): %s\n", kl_status_name(s),
		        kl_last_error(kl_tensor_ctx(t)));
		free(buf);
		free(v);
		return NULL;
	}
	for (int64_t i = 0; i < n; i++)
		v[i] = kl__load(buf, dt, i);
	free(buf);
	return v;
}

double kltest_tol(kl_dtype dt)
{
	switch (dt) {
	case KL_F64: return 1e-12;
	case KL_F32: return 1e-5;
	case KL_F16: return 2e-3;
	case KL_BF16: return 1e-2;
	default: return 0;
	}
}

static void index_str(char *buf, size_t cap, int ndim, const int64_t *shape, int64_t i)
{
	int64_t idx[KL_MAX_DIMS];
	for (int d = ndim - 1; d >= 0; d--) {
		idx[d] = shape[d] > 0 ? i % shape[d] : 0;
		i = shape[d] > 0 ? i / shape[d] : 0;
	}
	kl__shape_str(buf, cap, ndim, idx);
}

/* The k-th smallest of v[0..n-1] (reorders v): Hoare's selection. */
static double select_kth(double *v, int64_t n, int64_t k)
{
	int64_t lo = 0, hi = n - 1;
	while (lo < hi) {
		double pivot = v[lo + (hi - lo) / 2];
		int64_t i = lo, j = hi;
		while (i <= j) {
			while (v[i] < pivot)
				i++;
			while (v[j] > pivot)
				j--;
			if (i <= j) {
				double t = v[i];
				v[i++] = v[j];
				v[j--] = t;
			}
		}
		if (k <= j)
			hi = j;
		else if (k >= i)
			lo = i;
		else
			return v[k];
	}
	return v[k];
}

/* The typical magnitude of the finite values of ref: their median |value|,
 * which a few huge outliers (the specials) do not inflate. */
static double typical_abs(const double *ref, int64_t n)
{
	double *a = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
	if (!a)
		return 0;
	int64_t m = 0;
	for (int64_t i = 0; i < n; i++)
		if (isfinite(ref[i]))
			a[m++] = fabs(ref[i]);
	double med = m ? select_kth(a, m, m / 2) : 0;
	free(a);
	return med;
}

bool kltest_compare(const char *what, kl_dtype dt, int ndim, const int64_t *shape,
                    const double *out, const double *ref, double factor)
{
	return kltest_compare_atol(what, dt, ndim, shape, out, ref, factor, 0);
}

bool kltest_compare_atol(const char *what, kl_dtype dt, int ndim, const int64_t *shape,
                         const double *out, const double *ref, double factor, double atol_min)
{
	int64_t n = kl__numel(ndim, shape);
	bool fl = kl_dtype_is_float(dt);
	double rtol = kltest_tol(dt) * factor;
	/* the norms are of ref / scale and (out - ref) / scale: squares of f64
	 * values near 1e308 (exp of large inputs) would overflow to inf and
	 * make the ratio NaN */
	double ss = 0, dd = 0, scale = 0;
	for (int64_t i = 0; i < n; i++)
		if (isfinite(ref[i]) && fabs(ref[i]) > scale)
			scale = fabs(ref[i]);
	if (scale == 0 || !isfinite(scale))
		scale = 1;
	for (int64_t i = 0; i < n; i++)
		if (isfinite(ref[i]))
			ss += (ref[i] / scale) * (ref[i] / scale);
	double atol = fl ? rtol * typical_abs(ref, n) : 0;
	/* a few units of the format's subnormal spacing: below that a result
	 * cannot be closer than its rounding (f16 2^-24, bf16 2^-133, f32
	 * 2^-149: e.g. a GELU far below zero that one side flushes to -0) */
	double sub = dt == KL_F16 ? 0x1p-24 : dt == KL_BF16 ? 0x1p-133 : dt == KL_F32 ? 0x1p-149 : 0;
	if (atol < 4 * sub)
		atol = 4 * sub;
	if (fl && atol < atol_min)
		atol = atol_min;
	int64_t nbad = 0, worst = -1;
	double wscore = 0;
	for (int64_t i = 0; i < n; i++) {
		double o = out[i], r = ref[i], score;
		if (!fl) {
			score = o == r ? 0 : INFINITY;
		} else if (isnan(r) || isnan(o)) {
			score = isnan(r) && isnan(o) ? 0 : INFINITY;
		} else if (isinf(r) || isinf(o)) {
			score = o == r ? 0 : INFINITY;
		} else {
			double e = fabs(o - r);
			dd += (e / scale) * (e / scale);
			double lim = atol + rtol * fabs(r);
			score = e <= lim ? 0 : e / (lim > 0 ? lim : 1e-300);
		}
		if (score > 0) {
			nbad++;
			if (worst < 0 || score > wscore) {
				worst = i;
				wscore = score;
			}
		}
	}
	bool norm_ok = !fl || ss == 0 ? true : sqrt(dd) / sqrt(ss) <= rtol;
	if (nbad == 0 && norm_ok)
		return true;
	char sb[128], ib[128];
	fprintf(stderr, "FAIL %s: result %s %s: ", what, kl_dtype_name(dt),
	        kl__shape_str(sb, sizeof sb, ndim, shape));
	if (nbad) {
		index_str(ib, sizeof ib, ndim, shape, worst);
		fprintf(stderr,
		        "%lld of %lld elements off; worst at %s (flat %lld): got %.17g, "
		        "reference %.17g (rtol %.3g, atol %.3g)\n",
		        (long long)nbad, (long long)n, ib, (long long)worst, out[worst], ref[worst],
		        rtol, atol);
	} else {
		fprintf(stderr, "relative error %.3g exceeds %.3g\n", sqrt(dd) / sqrt(ss), rtol);
	}
	return false;
}

static void print_tensor_info(const char *label, kl_tensor *t)
{
	char sb[128], tb[128];
	if (!t) {
		fprintf(stderr, "  %s: NULL\n", label);
		return;
	}
	fprintf(stderr, "  %s: %s %s strides %s%s\n", label, kl_dtype_name(kl_tensor_dtype(t)),
	        kl__shape_str(sb, sizeof sb, kl_ndim(t), kl_shape(t)),
	        kl__shape_str(tb, sizeof tb, kl_ndim(t), kl_strides(t)),
	        kl_is_contiguous(t) ? "" : " (non-contiguous)");
}

double *kltest_reference(kl_ctx *ctx, const char *what, kltest_apply_fn apply, kl_tensor *const *in,
                         const void *param, int *ndim, int64_t *shape, kl_dtype *dt)
{
	kl_scope_begin(ctx);
	kl_status s = kl__trace_begin(ctx);
	if (s != KL_OK) {
		kl_scope_end(ctx);
		fprintf(stderr, "FAIL %s: kl__trace_begin: %s\n", what, kl_last_error(ctx));
		return NULL;
	}
	kl_tensor *lazy = apply(in, param);
	kl_trace *tr = kl__trace_end(ctx, lazy ? 1 : 0, &lazy);
	kl_scope_end(ctx);
	if (!lazy || !tr) {
		fprintf(stderr, "FAIL %s: under a trace the op %s: %s\n", what,
		        lazy ? "could not be recorded" : "failed", kl_last_error(ctx));
		if (tr)
			kl__trace_free(tr);
		return NULL;
	}
	const kl_graph *g = &tr->g;
	double *ref = NULL;
	int nin = g->ninputs;
	double **vals = calloc((size_t)(nin > 0 ? nin : 1), sizeof *vals);
	bool ok = vals != NULL && g->noutputs == 1 && tr->nin_tensors == nin;
	if (!ok)
		fprintf(stderr, "FAIL %s: trace has %d outputs, %d inputs, %d input tensors\n",
		        what, (int)g->noutputs, nin, tr->nin_tensors);
	for (int k = 0; ok && k < nin; k++) {
		vals[k] = kltest_read(tr->in_tensors[k]);
		ok = vals[k] != NULL;
	}
	if (ok) {
		char err[512];
		s = kl__ref_eval(g, (const double *const *)vals, &ref, err, sizeof err);
		if (s != KL_OK) {
			fprintf(stderr, "FAIL %s: reference: %s\n", what, err);
			kl__graph_print(g, stderr);
			ref = NULL;
		} else {
			const kl_node *o = &g->nodes[g->outputs[0]];
			*ndim = o->ndim;
			memcpy(shape, o->shape, sizeof(int64_t) * o->ndim);
			*dt = (kl_dtype)o->dtype;
		}
	}
	for (int k = 0; vals && k < nin; k++)
		free(vals[k]);
	free(vals);
	kl__trace_free(tr);
	return ref;
}

bool kltest_check_op(kl_ctx *ctx, const char *what, kltest_apply_fn apply, int nin,
                     kl_tensor *const *in, const void *param, double factor)
{
	return kltest_check_op_atol(ctx, what, apply, nin, in, param, factor, 0);
}

bool kltest_check_op_atol(kl_ctx *ctx, const char *what, kltest_apply_fn apply, int nin,
                          kl_tensor *const *in, const void *param, double factor,
                          double atol_min)
{
	kl_clear_error(ctx);
	kl_scope_begin(ctx);
	kl_tensor *out = apply(in, param);
	if (out)
		kl_retain(out);
	kl_scope_end(ctx);
	bool ok = false;
	double *got = NULL, *ref = NULL;
	char b1[128], b2[128];
	if (!out) {
		fprintf(stderr, "FAIL %s: the op failed: %s\n", what, kl_last_error(ctx));
		goto report;
	}
	int rnd = 0;
	int64_t rshape[KL_MAX_DIMS] = {0};
	kl_dtype rdt = KL_F32;
	ref = kltest_reference(ctx, what, apply, in, param, &rnd, rshape, &rdt);
	if (!ref)
		goto report;
	if (kl_tensor_dtype(out) != rdt || kl_ndim(out) != rnd ||
	    memcmp(kl_shape(out), rshape, sizeof(int64_t) * (size_t)rnd) != 0) {
		fprintf(stderr, "FAIL %s: result is %s %s, the traced graph says %s %s\n", what,
		        kl_dtype_name(kl_tensor_dtype(out)),
		        kl__shape_str(b1, sizeof b1, kl_ndim(out), kl_shape(out)),
		        kl_dtype_name(rdt), kl__shape_str(b2, sizeof b2, rnd, rshape));
		goto report;
	}
	got = kltest_read(out);
	if (!got)
		goto report;
	ok = kltest_compare_atol(what, rdt, rnd, rshape, got, ref, factor, atol_min);
report:
	if (!ok) {
		for (int i = 0; i < nin; i++) {
			snprintf(b1, sizeof b1, "in[%d]", i);
			print_tensor_info(b1, in[i]);
		}
		print_tensor_info("out", out);
	}
	free(got);
	free(ref);
	if (out)
		kl_release(out);
	return ok;
}

bool kltest_expect_error(kl_ctx *ctx, kl_tensor *result, const char *expr, ...)
{
	if (result) {
		char sb[128];
		fprintf(stderr, "FAIL %s: expected an error, got a %s %s tensor\n", expr,
		        kl_dtype_name(kl_tensor_dtype(result)),
		        kl__shape_str(sb, sizeof sb, kl_ndim(result), kl_shape(result)));
		kl_release(result);
		return false;
	}
	const char *msg = kl_last_error(ctx);
	bool ok = true;
	if (kl_last_status(ctx) == KL_OK) {
		fprintf(stderr, "FAIL %s: returned NULL but the status is KL_OK\n", expr);
		ok = false;
	}
	va_list ap;
	va_start(ap, expr);
	for (const char *sub; (sub = va_arg(ap, const char *)) != NULL;) {
		if (!msg || !strstr(msg, sub)) {
			fprintf(stderr, "FAIL %s: error message \"%s\" lacks \"%s\"\n", expr,
			        msg ? msg : "(null)", sub);
			ok = false;
		}
	}
	va_end(ap);
	return ok;
}

kl_ctx *kltest_ctx_from_env(const char *test)
{
	const char *dev = getenv("KILN_TEST_DEVICE");
	if (dev && strcmp(dev, "cuda") == 0) {
		kl_ctx_opts o = {.device = KL_CUDA};
		kl_ctx *c = kl_ctx_new(&o);
		if (!c) {
			printf("%s: CUDA run skipped: %s\n", test, kl_last_error(NULL));
			fflush(stdout);
			exit(77);
		}
		return c;
	}
	return kl_ctx_new(NULL);
}
