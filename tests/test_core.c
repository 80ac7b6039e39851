/* test_core.c - the core layer: tensor lifetime (refcounts, views, scopes,
 * context teardown), error messages, creation ops, the random generator,
 * dtype conversions and promotion, the printer, and lazy traces.
 */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "api/dispatch.h"
#include "core/core.h"
#include "graph/graph.h"

/* ---- helpers ----------------------------------------------------------------- */

static kl_ctx *new_ctx(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	return ctx;
}

static int count_live(const kl_ctx *ctx)
{
	int n = 0;
	for (const kl_tensor *t = ctx->live; t; t = t->next)
		n++;
	return n;
}

static kl_tensor *from_f32(kl_ctx *ctx, int ndim, const int64_t *shape, const float *v)
{
	kl_tensor *t = kl_from_host(ctx, KL_F32, ndim, shape, v,
	                            sizeof(float) * (size_t)kl__numel(ndim, shape));
	assert_non_null(t);
	return t;
}

/* t's values as doubles (malloc'd), through kl_to_host in its own dtype */
static double *read_all(kl_tensor *t)
{
	assert_non_null(t);
	int64_t n = kl_numel(t);
	size_t sz = kl_dtype_size(kl_tensor_dtype(t));
	void *raw = malloc((size_t)n * sz + 1);
	double *out = malloc((size_t)n * sizeof *out + 1);
	assert_true(raw && out);
	assert_int_equal(kl_to_host(t, raw, (size_t)n * sz), KL_OK);
	for (int64_t i = 0; i < n; i++)
		out[i] = kl__load(raw, kl_tensor_dtype(t), i);
	free(raw);
	return out;
}

static void expect_values(kl_tensor *t, int n, const double *want)
{
	assert_int_equal(kl_numel(t), n);
	double *v = read_all(t);
	for (int i = 0; i < n; i++)
		if (!(v[i] == want[i] || (isnan(v[i]) && isnan(want[i])))) {
			fprintf(stderr, "element %d: got %.17g want %.17g\n", i, v[i], want[i]);
			fail();
		}
	free(v);
}

static void expect_err(kl_ctx *ctx, kl_status st, const char *text)
{
	if (kl_last_status(ctx) != st || !strstr(kl_last_error(ctx), text)) {
		fprintf(stderr, "want %s containing \"%s\", got %s \"%s\"\n", kl_status_name(st),
		        text, kl_status_name(kl_last_status(ctx)), kl_last_error(ctx));
		fail();
	}
	kl_clear_error(ctx);
}

/* ---- contexts and versions ----------------------------------------------------- */

static void test_ctx_and_version(void **state)
{
	(void)state;
	assert_string_equal(kl_version(), "0.1.0");
	assert_string_equal(kl_status_name(KL_OK), "KL_OK");
	assert_string_equal(kl_status_name(KL_ESTATE), "KL_ESTATE");
	assert_string_equal(kl_status_name(KL_EUNSUPPORTED), "KL_EUNSUPPORTED");

	/* Without a GPU (or without the CUDA backend) a CUDA context fails with
	 * a message that says what is missing; on a GPU machine it opens. */
	kl_ctx *gpu = kl_ctx_new(&(kl_ctx_opts){.device = KL_CUDA});
	if (gpu) {
		kl_ctx_free(gpu);
	} else {
		assert_int_equal(kl_last_status(NULL), KL_EDEVICE);
		assert_non_null(strstr(kl_last_error(NULL), "kl_ctx_new: "));
		assert_non_null(strstr(kl_last_error(NULL), "CUDA"));
	}
	assert_null(kl_ctx_new(&(kl_ctx_opts){.device = (kl_device)7}));
	assert_int_equal(kl_last_status(NULL), KL_EINVAL);
	assert_null(kl_ctx_new(&(kl_ctx_opts){.nthreads = -1}));
	assert_int_equal(kl_last_status(NULL), KL_EINVAL);

	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = KL_CPU, .nthreads = 3});
	assert_non_null(ctx);
	assert_int_equal(ctx->nthreads, 3);
	assert_int_equal(kl_ctx_threads(ctx), 3);
	assert_int_equal(kl_ctx_threads(NULL), 1);
	assert_int_equal(kl_ctx_device(ctx), KL_CPU);
	assert_string_equal(kl_last_error(ctx), "");
	assert_int_equal(kl_last_status(ctx), KL_OK);
	kl_ctx_free(ctx);
	ctx = new_ctx();
	assert_true(ctx->nthreads >= 1);
	kl_ctx_free(ctx);
	kl_ctx_free(NULL);
}

static void test_logs(void **state)
{
	(void)state;
	assert_int_equal(kl__parse_logs(NULL), 0);
	assert_int_equal(kl__parse_logs(""), 0);
	assert_int_equal(kl__parse_logs("fusion"), KL_LOG_FUSION);
	assert_int_equal(kl__parse_logs("fusion,cache"), KL_LOG_FUSION | KL_LOG_CACHE);
	assert_int_equal(kl__parse_logs("bogus, graph_breaks"), KL_LOG_GRAPH_BREAKS);
	unsigned all = kl__parse_logs("all");
	assert_int_equal(all, 0x1ffu);
	assert_int_equal(kl__parse_logs("startup"), KL_LOG_STARTUP);
	assert_int_equal(kl__parse_logs("cache,startup"), KL_LOG_CACHE | KL_LOG_STARTUP);
	assert_int_equal(kl__parse_logs("start"), 0); /* not a prefix match */
	assert_int_equal(kl__parse_logs("graph"), KL_LOG_GRAPH); /* not a prefix match */
}

/* ---- lifetime ------------------------------------------------------------------- */

static void test_refcounts_and_views(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	float v[6] = {0, 1, 2, 3, 4, 5};
	kl_tensor *a = from_f32(ctx, 2, (int64_t[]){2, 3}, v);
	assert_int_equal(count_live(ctx), 1);
	assert_ptr_equal(kl_retain(a), a);
	assert_int_equal(a->refs, 2);
	kl_release(a);
	assert_int_equal(count_live(ctx), 1);

	/* a view keeps the storage after its base is gone */
	kl_tensor *row = kl_slice(a, 0, 1, 2, 1);
	kl_tensor *col = kl_slice(a, 1, -1, 100, 1);
	assert_non_null(row);
	assert_non_null(col);
	assert_ptr_equal(row->st, a->st);
	assert_int_equal(a->st->refs, 3);
	kl_release(a);
	assert_int_equal(row->st->refs, 2);
	expect_values(row, 3, (double[]){3, 4, 5});
	expect_values(col, 2, (double[]){2, 5});
	kl_release(row);
	expect_values(col, 2, (double[]){2, 5});
	kl_release(col);
	assert_int_equal(count_live(ctx), 0);
	kl_release(NULL);
	kl_ctx_free(ctx);
}

static void test_scopes(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_tensor *outside = kl_zeros(ctx, KL_F32, 1, (int64_t[]){4});
	kl_scope_begin(ctx);
	kl_tensor *a = kl_full(ctx, KL_F32, 1, (int64_t[]){4}, 2.0);
	kl_tensor *b = kl_add(a, outside);
	kl_tensor *keep = kl_retain(kl_mul(a, b));
	kl_scope_begin(ctx); /* nested: its tensors go first */
	kl_tensor *inner = kl_neg(keep);
	assert_non_null(inner);
	kl_scope_end(ctx);
	assert_int_equal(count_live(ctx), 4);
	/* composites free their intermediates without leaving the scope a
	 * dangling entry */
	kl_tensor *x = kl_full(ctx, KL_F32, 2, (int64_t[]){2, 3}, 1.0);
	kl_tensor *w = kl_full(ctx, KL_F32, 2, (int64_t[]){4, 3}, 1.0);
	kl_tensor *y = kl_linear(x, w, NULL);
	(void)y;
	kl_scope_end(ctx);
	assert_int_equal(count_live(ctx), 2);
	expect_values(keep, 4, (double[]){4, 4, 4, 4});
	kl_release(keep);
	kl_release(outside);
	assert_int_equal(count_live(ctx), 0);
	kl_scope_end(ctx); /* unbalanced: an error, not a crash */
	expect_err(ctx, KL_ESTATE, "kl_scope_end: no scope is open");
	kl_ctx_free(ctx);
}

static void test_ctx_free_with_live_tensors(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_tensor *a = kl_arange(ctx, KL_F32, 0, 12, 1);
	kl_tensor *b = kl_reshape(a, 2, (int64_t[]){3, 4});
	kl_tensor *c = kl_transpose(b, 0, 1);
	kl_tensor *d = kl_contiguous(c);
	assert_non_null(d);
	kl_scope_begin(ctx);
	assert_non_null(kl_empty(ctx, KL_I64, 2, (int64_t[]){5, 5}));
	/* left open on purpose: kl_ctx_free frees everything (ASan checks) */
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	assert_non_null(kl_add(a, a));
	kl_ctx_free(ctx);
}

/* kl_memory_stats counts what the context's allocator hands out: a tensor
 * adds its storage (rounded to whole cache lines), a view adds nothing,
 * release gives it back, and the peak holds until kl_memory_reset_peak. */
static void test_memory_stats(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_memory_usage u0, u;
	assert_int_equal(kl_memory_stats(ctx, &u0), KL_OK);
	assert_true(u0.peak >= u0.in_use);
	/* 3 MiB + a ragged tail: above the host block cache's threshold */
	int64_t n = (3 << 20) / 4 + 7;
	kl_tensor *a = kl_randn(ctx, KL_F32, 1, &n, 5);
	assert_non_null(a);
	size_t need = ((size_t)n * 4 + 63) & ~(size_t)63;
	assert_int_equal(kl_memory_stats(ctx, &u), KL_OK);
	assert_true(u.in_use >= u0.in_use + need && u.in_use <= u0.in_use + need + need / 8);
	assert_true(u.peak >= u.in_use);
	assert_int_equal(u.reserved, u.in_use);
	size_t with_a = u.in_use;
	kl_tensor *v = kl_reshape(a, 2, (int64_t[]){1, n});
	assert_int_equal(kl_memory_stats(ctx, &u), KL_OK);
	assert_int_equal(u.in_use, with_a);
	/* a temporary made and dropped inside a scope still shows in the peak */
	kl_scope_begin(ctx);
	assert_non_null(kl_add(a, a));
	kl_scope_end(ctx);
	assert_int_equal(kl_memory_stats(ctx, &u), KL_OK);
	assert_int_equal(u.in_use, with_a);
	assert_true(u.peak >= with_a + need);
	kl_release(v);
	kl_release(a);
	assert_int_equal(kl_memory_stats(ctx, &u), KL_OK);
	assert_int_equal(u.in_use, u0.in_use);
	assert_true(u.peak >= with_a + need);
	assert_int_equal(kl_memory_reset_peak(ctx), KL_OK);
	assert_int_equal(kl_memory_stats(ctx, &u), KL_OK);
	assert_int_equal(u.peak, u.in_use);
	/* a second context counts only its own */
	kl_ctx *other = new_ctx();
	kl_tensor *b = kl_zeros(other, KL_F64, 1, &n);
	assert_non_null(b);
	kl_memory_usage uo;
	assert_int_equal(kl_memory_stats(ctx, &u), KL_OK);
	assert_int_equal(kl_memory_stats(other, &uo), KL_OK);
	assert_int_equal(u.in_use, u0.in_use);
	assert_true(uo.in_use >= (size_t)n * 8);
	kl_release(b);
	kl_ctx_free(other);
	/* bad arguments */
	assert_int_equal(kl_memory_stats(NULL, &u), KL_EINVAL);
	assert_int_equal(kl_memory_stats(ctx, NULL), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "kl_memory_stats: out is NULL"));
	assert_int_equal(kl_memory_reset_peak(NULL), KL_EINVAL);
	kl_ctx_free(ctx);
}

/* ---- errors ---------------------------------------------------------------------- */

static void test_errors(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_tensor *a = kl_zeros(ctx, KL_F32, 2, (int64_t[]){4, 3});
	kl_tensor *b = kl_zeros(ctx, KL_F32, 1, (int64_t[]){5});
	kl_tensor *h = kl_zeros(ctx, KL_F16, 2, (int64_t[]){3, 2});
	kl_tensor *i32 = kl_zeros(ctx, KL_I32, 1, (int64_t[]){3});

	assert_null(kl_add(a, b));
	expect_err(ctx, KL_EINVAL, "kl_add: shapes [4,3] and [5] do not broadcast");
	assert_null(kl_add(a, NULL));
	expect_err(ctx, KL_EINVAL, "kl_add: input 1 is NULL");
	/* with no context anywhere, the thread-local message */
	assert_null(kl_mul(NULL, NULL));
	assert_string_equal(kl_last_error(NULL), "kl_mul: input 0 is NULL");

	/* a chain reports the first failure */
	assert_null(kl_relu(kl_add(kl_mul(a, b), a)));
	assert_int_equal(kl_last_status(ctx), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "kl_add: input 0 is NULL (after: kl_mul: "
	                                           "shapes [4,3] and [5] do not broadcast)"));
	kl_clear_error(ctx);

	int ax = 3;
	kl_tensor *s23 = kl_zeros(ctx, KL_F32, 2, (int64_t[]){2, 3});
	assert_null(kl_sum(s23, 1, &ax, false));
	expect_err(ctx, KL_EINVAL, "kl_sum: axis 3 out of range for shape [2,3]");
	int rep[2] = {1, -1};
	assert_null(kl_sum(s23, 2, rep, false));
	expect_err(ctx, KL_EINVAL, "kl_sum: axis -1 repeated");
	assert_null(kl_matmul(a, h));
	expect_err(ctx, KL_EINVAL, "kl_matmul: dtypes f32 and f16 differ");
	assert_null(kl_matmul(a, a));
	expect_err(ctx, KL_EINVAL, "kl_matmul: shapes [4,3] and [4,3] do not match");
	assert_null(kl_mean(i32, 0, NULL, false));
	expect_err(ctx, KL_EINVAL, "kl_mean: dtype i32 is not floating point");
	assert_null(kl_var(i32, 0, NULL, 1, false));
	expect_err(ctx, KL_EINVAL, "kl_var: dtype i32 is not floating point");
	kl_tensor *e = kl_zeros(ctx, KL_F32, 2, (int64_t[]){0, 3});
	assert_null(kl_max(e, 1, (int[]){0}, false));
	expect_err(ctx, KL_EINVAL, "kl_max: reduction over an empty axis 0 of shape [0,3]");
	assert_null(kl_argmax(e, 0, false));
	expect_err(ctx, KL_EINVAL, "kl_argmax: reduction over an empty axis");
	assert_null(kl_reshape(a, 2, (int64_t[]){5, 2}));
	expect_err(ctx, KL_EINVAL, "kl_reshape: cannot reshape [4,3] (12 elements) to [5,2]");
	assert_null(kl_reshape(a, 2, (int64_t[]){-1, 5}));
	expect_err(ctx, KL_EINVAL, "kl_reshape: cannot reshape [4,3] (12 elements) to [-1,5]: the -1");
	assert_null(kl_slice(a, 0, 0, 2, 0));
	expect_err(ctx, KL_EINVAL, "kl_slice: step 0 must be >= 1");
	assert_null(kl_expand(a, 2, (int64_t[]){4, 6}));
	expect_err(ctx, KL_EINVAL, "kl_expand: cannot expand [4,3] to [4,6]");
	assert_null(kl_permute(a, (int[]){0, 0}));
	expect_err(ctx, KL_EINVAL, "kl_permute:");
	assert_null(kl_concat(2, (kl_tensor *[]){a, h}, 0));
	expect_err(ctx, KL_EINVAL, "kl_concat: shapes [4,3] and [3,2]");
	assert_null(kl_neg(kl_zeros(ctx, KL_BOOL, 1, (int64_t[]){2})));
	expect_err(ctx, KL_EINVAL, "kl_neg: dtype bool is not supported");
	assert_null(kl_softmax(i32, 0));
	expect_err(ctx, KL_EINVAL, "kl_softmax: dtype i32 is not floating point");
	assert_null(kl_layer_norm(a, b, NULL, 1e-5));
	expect_err(ctx, KL_EINVAL, "kl_layer_norm: weight [5] does not match x [4,3]");
	assert_null(kl_linear(a, h, NULL));
	expect_err(ctx, KL_EINVAL, "kl_linear: x [4,3] and weight [3,2] do not match");
	assert_null(kl_zeros(ctx, KL_F32, 2, (int64_t[]){2, -1}));
	expect_err(ctx, KL_EINVAL, "kl_zeros: shape [2,-1]: dim 1 is -1");
	assert_null(kl_rand(ctx, KL_I32, 1, (int64_t[]){2}, 1));
	expect_err(ctx, KL_EINVAL, "kl_rand: dtype i32 is not floating point");
	assert_null(kl_arange(ctx, KL_F32, 0, 5, 0));
	expect_err(ctx, KL_EINVAL, "kl_arange:");
	assert_null(kl_arange(ctx, KL_F32, 5, 0, 1));
	expect_err(ctx, KL_EINVAL, "kl_arange: step 1 does not lead from 5 to 0");
	double d;
	assert_int_equal(kl_item(a, &d), KL_EINVAL);
	expect_err(ctx, KL_EINVAL, "kl_item: shape [4,3] has 12 elements");
	float buf[4];
	assert_int_equal(kl_to_host(a, buf, sizeof buf), KL_EINVAL);
	expect_err(ctx, KL_EINVAL, "kl_to_host: nbytes 16 does not match f32 [4,3] (48 bytes)");
	assert_int_equal(kl_dim(a, 2), -1);
	expect_err(ctx, KL_EINVAL, "kl_dim: axis 2 out of range for shape [4,3]");
	assert_int_equal(kl_dim(a, -1), 3);

	/* a successful call does not clear an earlier error */
	assert_null(kl_add(a, b));
	kl_tensor *ok = kl_add(a, a);
	assert_non_null(ok);
	expect_err(ctx, KL_EINVAL, "do not broadcast");

	/* inputs of two contexts */
	kl_ctx *other = new_ctx();
	kl_tensor *o = kl_zeros(other, KL_F32, 2, (int64_t[]){4, 3});
	assert_null(kl_add(a, o));
	expect_err(ctx, KL_EINVAL, "kl_add: inputs 0 and 1 belong to different contexts");
	assert_null(kl_where(o, a, a));
	expect_err(other, KL_EINVAL, "kl_where: inputs 0 and 1 belong to different contexts");
	kl_ctx_free(other);
	kl_ctx_free(ctx);
}

/* ---- creation ---------------------------------------------------------------------- */

static void test_creation(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_scope_begin(ctx);
	for (int dt = 0; dt < KL_NDTYPES; dt++) {
		kl_tensor *z = kl_zeros(ctx, (kl_dtype)dt, 2, (int64_t[]){2, 3});
		assert_non_null(z);
		assert_int_equal(kl_tensor_dtype(z), dt);
		assert_int_equal(kl_ndim(z), 2);
		assert_true(kl_is_contiguous(z));
		expect_values(z, 6, (double[]){0, 0, 0, 0, 0, 0});
		kl_tensor *f = kl_full(ctx, (kl_dtype)dt, 1, (int64_t[]){3}, -2.75);
		double w = kl__round_to((kl_dtype)dt, -2.75);
		expect_values(f, 3, (double[]){w, w, w});
		kl_tensor *e = kl_empty(ctx, (kl_dtype)dt, 3, (int64_t[]){2, 0, 4});
		assert_int_equal(kl_numel(e), 0);
		assert_int_equal(kl_to_host(e, NULL, 0), KL_OK);
	}
	kl_tensor *s = kl_scalar(ctx, KL_F64, 3.25);
	assert_int_equal(kl_ndim(s), 0);
	assert_int_equal(kl_numel(s), 1);
	double v = 0;
	assert_int_equal(kl_item(s, &v), KL_OK);
	assert_true(v == 3.25);
	assert_int_equal(kl_item(kl_scalar(ctx, KL_I32, 1e12), &v), KL_OK);
	assert_true(v == 2147483647.0); /* saturates */

	expect_values(kl_arange(ctx, KL_F32, 0, 5, 1), 5, (double[]){0, 1, 2, 3, 4});
	expect_values(kl_arange(ctx, KL_F64, 1, 2, 0.25), 4, (double[]){1, 1.25, 1.5, 1.75});
	expect_values(kl_arange(ctx, KL_I64, 5, 0, -2), 3, (double[]){5, 3, 1});
	expect_values(kl_arange(ctx, KL_I32, 0, 1, 0.3), 4, (double[]){0, 0, 0, 0});
	assert_int_equal(kl_numel(kl_arange(ctx, KL_F32, 3, 3, 1)), 0);

	uint8_t raw[4] = {0, 1, 7, 0};
	kl_tensor *bt = kl_from_host(ctx, KL_BOOL, 1, (int64_t[]){4}, raw, sizeof raw);
	uint8_t back[4];
	assert_int_equal(kl_to_host(bt, back, 4), KL_OK);
	assert_memory_equal(back, ((uint8_t[]){0, 1, 1, 0}), 4);
	uint16_t hbits[2] = {0x3c00, 0xc000}; /* 1, -2 */
	expect_values(kl_from_host(ctx, KL_F16, 1, (int64_t[]){2}, hbits, sizeof hbits), 2, (double[]){1, -2});
	assert_null(kl_from_host(ctx, KL_F32, 1, (int64_t[]){2}, NULL, 8));
	expect_err(ctx, KL_EINVAL, "kl_from_host: data is NULL");
	assert_null(kl_empty(ctx, KL_F32, 9, (int64_t[]){1, 1, 1, 1, 1, 1, 1, 1, 1}));
	expect_err(ctx, KL_EINVAL, "kl_empty: ndim 9 out of range");
	assert_null(kl_zeros(NULL, KL_F32, 0, NULL));
	assert_string_equal(kl_last_error(NULL), "kl_zeros: ctx is NULL");
	kl_scope_end(ctx);
	assert_int_equal(count_live(ctx), 0);
	kl_ctx_free(ctx);
}

/* ---- random numbers ---------------------------------------------------------------- */

static void test_philox_known_answer(void **state)
{
	(void)state;
	/* Random123's known-answer vector for Philox4x32-10, zero key and counter */
	uint32_t o[4];
	kl__philox(0, 0, o);
	assert_int_equal(o[0], 0x6627e8d5u);
	assert_int_equal(o[1], 0xe169c58du);
	assert_int_equal(o[2], 0xbc57ac4cu);
	assert_int_equal(o[3], 0x9b00dbd8u);
}

static void test_rand(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	enum { N = 100000 };
	int64_t shape[1] = {N};
	kl_tensor *u1 = kl_rand(ctx, KL_F32, 1, shape, 42);
	kl_tensor *u2 = kl_rand(ctx, KL_F32, 1, shape, 42);
	kl_tensor *u3 = kl_rand(ctx, KL_F32, 1, shape, 43);
	double *a = read_all(u1), *b = read_all(u2), *c = read_all(u3);
	int same = 0;
	double sum = 0;
	for (int i = 0; i < N; i++) {
		assert_true(a[i] == b[i]);
		assert_true(a[i] >= 0 && a[i] < 1);
		assert_true(a[i] == kl__rand_uniform(42, (uint64_t)i)); /* 24 bits: exact in f32 */
		same += a[i] == c[i];
		sum += a[i];
	}
	assert_true(same < 50);
	assert_true(fabs(sum / N - 0.5) < 0.01);
	free(a);
	free(b);
	free(c);

	kl_tensor *n = kl_randn(ctx, KL_F64, 2, (int64_t[]){100, 1000}, 7);
	double *x = read_all(n);
	double m = 0, s2 = 0;
	for (int i = 0; i < N; i++) {
		assert_true(isfinite(x[i]));
		assert_true(x[i] == kl__rand_normal(7, (uint64_t)i));
		m += x[i];
	}
	m /= N;
	for (int i = 0; i < N; i++)
		s2 += (x[i] - m) * (x[i] - m);
	double sd = sqrt(s2 / (N - 1));
	assert_true(fabs(m) < 0.02);
	assert_true(fabs(sd - 1) < 0.02);
	free(x);
	/* in 16-bit floats, draws that would round up to 1 stay below it */
	int hit_edge = 0;
	for (uint64_t i = 0; i < 200000; i++) {
		double h16 = kl__rand_uniform_as(KL_F16, 5, i),
		       b16 = kl__rand_uniform_as(KL_BF16, 5, i);
		assert_true(h16 >= 0 && h16 < 1 && h16 == kl__round_to(KL_F16, h16));
		assert_true(b16 >= 0 && b16 < 1 && b16 == kl__round_to(KL_BF16, b16));
		assert_true(kl__rand_uniform_as(KL_F32, 5, i) == kl__rand_uniform(5, i));
		hit_edge += b16 == 1.0 - 0x1p-8;
	}
	assert_true(hit_edge > 0);
	/* f16 draws are the f64 ones rounded */
	kl_tensor *h = kl_randn(ctx, KL_F16, 1, (int64_t[]){64}, 7);
	double *hv = read_all(h);
	for (int i = 0; i < 64; i++)
		assert_true(hv[i] == kl__round_to(KL_F16, kl__rand_normal(7, (uint64_t)i)));
	free(hv);
	kl_ctx_free(ctx);
}

/* ---- dtypes -------------------------------------------------------------------------- */

static void test_f16_roundtrip_all(void **state)
{
	(void)state;
	for (uint32_t u = 0; u < 65536; u++) {
		uint16_t h = (uint16_t)u;
		float f = kl__f16_to_f32(h);
		uint16_t back = kl__f32_to_f16(f);
		bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
		if (nan) {
			assert_true(isnan(f));
			/* sign and payload kept, quieted */
			assert_int_equal(back, h | 0x200);
		} else {
			assert_int_equal(back, h);
			/* exact value: sign * 2^e * mantissa */
			int e = (h >> 10) & 0x1f, mnt = h & 0x3ff;
			double want = e == 0    ? ldexp(mnt, -24)
			              : e == 31 ? INFINITY
			                        : ldexp(1024 + mnt, e - 25);
			if (h & 0x8000)
				want = -want;
			assert_true((double)f == want);
			assert_true(!signbit(f) == !signbit(want));
		}
	}
}

/* the correctly rounded value of x in a binary format with `mant` stored
 * mantissa bits, minimum normal exponent emin and largest finite maxf,
 * computed in double (exact for f32 inputs) */
static double ref_round(double x, int mant, int emin, double maxf)
{
	if (isnan(x) || isinf(x) || x == 0)
		return x;
	int e;
	frexp(fabs(x), &e); /* |x| = f * 2^e, f in [0.5, 1) */
	e -= 1;
	if (e < emin)
		e = emin;
	double ulp = ldexp(1.0, e - mant);
	double r = nearbyint(x / ulp) * ulp; /* ties to even (default mode) */
	if (fabs(r) > maxf)
		return copysign(INFINITY, x);
	return r;
}

static void test_f32_to_half_sweep(void **state)
{
	(void)state;
	const double f16max = 65504.0, bf16max = ldexp(255.0, 120); /* (2 - 2^-7) * 2^127 */
	/* every 257th f32 pattern (both signs, all exponents) plus the exact
	 * ties around each f16 value */
	for (uint64_t u = 0; u < 0x100000000ull; u += 257) {
		uint32_t bits = (uint32_t)u;
		float f;
		memcpy(&f, &bits, 4);
		/* the round trips (generated C's kl_rh, kl_rbf) are the narrowing
		 * then the widening, bit for bit, NaN payloads included */
		float r16 = kl__f16_to_f32(kl__f32_to_f16(f)), rb = kl__bf16_to_f32(kl__f32_to_bf16(f));
		assert_int_equal(kl__f32_bits(kl__f32_round_f16(f)), kl__f32_bits(r16));
		assert_int_equal(kl__f32_bits(kl__f32_round_bf16(f)), kl__f32_bits(rb));
		if (isnan(f)) {
			assert_true(isnan(r16));
			assert_true(isnan(rb));
			continue;
		}
		double w16 = ref_round(f, 10, -14, f16max);
		double g16 = kl__f16_to_f32(kl__f32_to_f16(f));
		if (!(g16 == w16 && !signbit(g16) == !signbit(w16))) {
			fprintf(stderr, "f16(%a): got %a want %a\n", (double)f, g16, w16);
			fail();
		}
		double wb = ref_round(f, 7, -126, bf16max);
		double gb = kl__bf16_to_f32(kl__f32_to_bf16(f));
		if (!(gb == wb && !signbit(gb) == !signbit(wb))) {
			fprintf(stderr, "bf16(%a): got %a want %a\n", (double)f, gb, wb);
			fail();
		}
	}
	for (uint32_t h = 0; h < 0x7c00; h++) {
		double lo = kl__f16_to_f32((uint16_t)h), hi = kl__f16_to_f32((uint16_t)(h + 1));
		float mid = (float)((lo + hi) / 2); /* exact in f32 */
		uint16_t want = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
		assert_int_equal(kl__f32_to_f16(mid), want);
		assert_int_equal(kl__f32_to_f16(-mid), want | 0x8000);
		/* the ties and their neighbours through the round trip too */
		for (int d = -1; d <= 1; d++) {
			float m = kl__bits_f32(kl__f32_bits(mid) + (uint32_t)d);
			float w = kl__f16_to_f32(kl__f32_to_f16(m));
			assert_int_equal(kl__f32_bits(kl__f32_round_f16(m)), kl__f32_bits(w));
			assert_int_equal(kl__f32_bits(kl__f32_round_f16(-m)), kl__f32_bits(-w));
		}
	}
	for (uint32_t h = 0; h < 0x7f80; h++) { /* bf16's ties: every finite value's */
		float mid = kl__bits_f32((h << 16) | 0x8000u);
		for (int d = -1; d <= 1; d++) {
			float m = kl__bits_f32(kl__f32_bits(mid) + (uint32_t)d);
			float w = kl__bf16_to_f32(kl__f32_to_bf16(m));
			assert_int_equal(kl__f32_bits(kl__f32_round_bf16(m)), kl__f32_bits(w));
			assert_int_equal(kl__f32_bits(kl__f32_round_bf16(-m)), kl__f32_bits(-w));
		}
	}
	/* doubles round once, not through f32 (1 + 2^-11 + 2^-40 is above the
	 * tie, but rounds to the tie in f32) */
	assert_true(kl__round_to(KL_F16, 1 + 0x1p-11 + 0x1p-40) == 1 + 0x1p-10);
	assert_true(kl__round_to(KL_BF16, 1 + 0x1p-8 + 0x1p-40) == 1 + 0x1p-7);
	assert_true(kl__round_to(KL_F16, 1 + 0x1p-11) == 1);
	assert_true(kl__round_to(KL_F16, 1e300) == INFINITY);
	assert_true(kl__round_to(KL_F16, -1e-300) == 0 && signbit(kl__round_to(KL_F16, -1e-300)));
	for (int i = 0; i < 20000; i++) {
		double x = ldexp(kl__rand_normal(99, (uint64_t)i), (int)(i % 50) - 30);
		assert_true(kl__round_to(KL_F16, x) == ref_round(x, 10, -14, f16max));
		assert_true(kl__round_to(KL_BF16, x) == ref_round(x, 7, -126, bf16max));
	}
}

static void test_store_load(void **state)
{
	(void)state;
	int32_t i32[8];
	int64_t i64[6];
	uint8_t b[4];
	const double in32[8] = {1e10, -1e10, NAN, 2.7, -2.7, INFINITY, -INFINITY, 2147483647.5};
	const int32_t want32[8] = {INT32_MAX, INT32_MIN, 0, 2, -2, INT32_MAX, INT32_MIN, INT32_MAX};
	for (int i = 0; i < 8; i++) {
		kl__store(i32, KL_I32, i, in32[i]);
		assert_int_equal(i32[i], want32[i]);
		assert_true(kl__load(i32, KL_I32, i) == kl__round_to(KL_I32, in32[i]));
	}
	const double in64[6] = {1e300, -1e300, NAN, 9.2e18, -3.99, 0x1p63};
	const int64_t want64[6] = {INT64_MAX, INT64_MIN, 0, INT64_C(9200000000000000000),
	                           -3,        INT64_MAX};
	for (int i = 0; i < 6; i++) {
		kl__store(i64, KL_I64, i, in64[i]);
		assert_true(i64[i] == want64[i]);
	}
	const double inb[4] = {0.5, NAN, 0, -0.0};
	const uint8_t wantb[4] = {1, 1, 0, 0};
	for (int i = 0; i < 4; i++) {
		kl__store(b, KL_BOOL, i, inb[i]);
		assert_int_equal(b[i], wantb[i]);
		assert_true(kl__load(b, KL_BOOL, i) == wantb[i]);
	}
	uint16_t h[1];
	kl__store(h, KL_F16, 0, 0.1);
	assert_int_equal(h[0], 0x2e66);
	kl__store(h, KL_BF16, 0, 0.1);
	assert_int_equal(h[0], 0x3dcd);
	assert_true(kl__round_to(KL_F32, 0.1) == (double)0.1f);
	assert_string_equal(kl_dtype_name(KL_BF16), "bf16");
	assert_string_equal(kl_dtype_name(KL_BOOL), "bool");
	assert_int_equal(kl_dtype_size(KL_F16), 2);
	assert_int_equal(kl_dtype_size(KL_I64), 8);
	assert_true(kl_dtype_is_float(KL_BF16));
	assert_false(kl_dtype_is_float(KL_I32));
}

static void test_promotion(void **state)
{
	(void)state;
	/* torch.promote_types over f32 f64 f16 bf16 i32 i64 bool */
	enum { F32, F64, F16, BF16, I32, I64, B };
	static const int want[7][7] = {
	        /* F32 */ {F32, F64, F32, F32, F32, F32, F32},
	        /* F64 */ {F64, F64, F64, F64, F64, F64, F64},
	        /* F16 */ {F32, F64, F16, F32, F16, F16, F16},
	        /* BF16 */ {F32, F64, F32, BF16, BF16, BF16, BF16},
	        /* I32 */ {F32, F64, F16, BF16, I32, I64, I32},
	        /* I64 */ {F32, F64, F16, BF16, I64, I64, I64},
	        /* B */ {F32, F64, F16, BF16, I32, I64, B},
	};
	for (int a = 0; a < 7; a++)
		for (int b = 0; b < 7; b++)
			assert_int_equal(kl_promote_types((kl_dtype)a, (kl_dtype)b), want[a][b]);

	/* op-level rules, checked on the nodes of a trace (no kernels run) */
	kl_ctx *ctx = new_ctx();
	int64_t s[1] = {2};
	kl_tensor *bo = kl_zeros(ctx, KL_BOOL, 1, s), *i = kl_zeros(ctx, KL_I32, 1, s);
	kl_tensor *h = kl_zeros(ctx, KL_F16, 1, s), *f = kl_zeros(ctx, KL_F32, 1, s);
	kl_tensor *l = kl_zeros(ctx, KL_I64, 1, s);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_scope_begin(ctx);
	struct {
		kl_tensor *t;
		kl_dtype want;
	} cases[] = {
	        {kl_add_scalar(bo, 1), KL_I64},
	        {kl_add_scalar(bo, 1.5), KL_F32},
	        {kl_add_scalar(i, 2), KL_I32},
	        {kl_mul_scalar(i, 0.5), KL_F32},
	        {kl_add_scalar(h, 2.5), KL_F16},
	        {kl_div_scalar(i, 2), KL_F32},
	        {kl_div(i, l), KL_F32},
	        {kl_div(h, h), KL_F16},
	        {kl_add(i, l), KL_I64},
	        {kl_add(bo, bo), KL_BOOL},
	        {kl_add(i, h), KL_F16},
	        {kl_lt(i, f), KL_BOOL},
	        {kl_eq_scalar(h, 0.5), KL_BOOL},
	        {kl_exp(i), KL_F32},
	        {kl_sigmoid(bo), KL_F32},
	        {kl_exp(h), KL_F16},
	        {kl_neg(i), KL_I32},
	        {kl_relu(l), KL_I64},
	        {kl_where(i, i, h), KL_F16},
	        {kl_clamp(i, 0, 3), KL_I32},
	        {kl_clamp(i, 0.5, INFINITY), KL_F32},
	        {kl_clamp(h, -1, 1), KL_F16},
	        {kl_sum(bo, 0, NULL, false), KL_I64},
	        {kl_sum(i, 0, NULL, false), KL_I64},
	        {kl_sum(h, 0, NULL, false), KL_F16},
	        {kl_max(i, 0, NULL, false), KL_I32},
	        {kl_argmax(h, 0, false), KL_I64},
	        {kl_cast(f, KL_BF16), KL_BF16},
	        {kl_pow_scalar(i, 2), KL_I32},
	        {kl_pow_scalar(i, 0.5), KL_F32},
	        {kl_concat(2, (kl_tensor *[]){i, h}, 0), KL_F16},
	        {kl_layer_norm(h, f, NULL, 1e-5), KL_F16},
	};
	for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
		if (!cases[k].t || kl_tensor_dtype(cases[k].t) != cases[k].want) {
			fprintf(stderr, "case %zu: got %s want %s (%s)\n", k,
			        cases[k].t ? kl_dtype_name(kl_tensor_dtype(cases[k].t)) : "NULL",
			        kl_dtype_name(cases[k].want), kl_last_error(ctx));
			fail();
		}
	}
	assert_null(kl_clamp(bo, 0, 1));
	expect_err(ctx, KL_EINVAL, "kl_clamp: dtype bool");
	assert_null(kl_sub(bo, bo));
	expect_err(ctx, KL_EINVAL, "kl_sub: dtypes bool and bool");
	kl_scope_end(ctx);
	kl__trace_free(kl__trace_end(ctx, 0, NULL));
	kl_ctx_free(ctx);
}

/* ---- printer ------------------------------------------------------------------------- */

static char *print_to_string(kl_tensor *t)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	assert_non_null(f);
	assert_int_equal(kl_print(t, f), KL_OK);
	fclose(f);
	return buf;
}

static void expect_print(kl_tensor *t, const char *want)
{
	char *got = print_to_string(t);
	if (strcmp(got, want)) {
		fprintf(stderr, "got:\n%s\nwant:\n%s\n", got, want);
		fail();
	}
	free(got);
}

static void test_printer(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_scope_begin(ctx);
	int64_t s22[2] = {2, 2};
	kl_tensor *a = from_f32(ctx, 2, s22, (float[]){1, -2.5f, 3, 4});
	expect_print(a, "tensor([[ 1.0000, -2.5000],\n        [ 3.0000,  4.0000]], size=[2,2], dtype=f32)\n");
	/* a transposed view prints in its logical order */
	expect_print(kl_transpose(a, 0, 1),
	             "tensor([[ 1.0000,  3.0000],\n        [-2.5000,  4.0000]], size=[2,2], dtype=f32)\n");
	expect_print(kl_arange(ctx, KL_I32, -1, 3, 1), "tensor([-1,  0,  1,  2], size=[4], dtype=i32)\n");
	expect_print(kl_arange(ctx, KL_F32, 1, 3, 1), "tensor([1., 2.], size=[2], dtype=f32)\n");
	uint8_t bv[2] = {1, 0};
	expect_print(kl_from_host(ctx, KL_BOOL, 1, (int64_t[]){2}, bv, sizeof bv),
	             "tensor([ true, false], size=[2], dtype=bool)\n");
	expect_print(kl_scalar(ctx, KL_F64, 3.5), "tensor(3.5000, size=[], dtype=f64)\n");
	expect_print(kl_zeros(ctx, KL_F32, 2, (int64_t[]){0, 3}),
	             "tensor([], size=[0,3], dtype=f32)\n");
	expect_print(from_f32(ctx, 1, (int64_t[]){2}, (float[]){1e-5f, 1}),
	             "tensor([1.0000e-05, 1.0000e+00], size=[2], dtype=f32)\n");
	expect_print(from_f32(ctx, 1, (int64_t[]){3}, (float[]){NAN, INFINITY, 0.5f}),
	             "tensor([   nan,    inf, 0.5000], size=[3], dtype=f32)\n");
	/* 2x2x2: blank line between the outer blocks */
	expect_print(kl_reshape(kl_arange(ctx, KL_I64, 0, 8, 1), 3, (int64_t[]){2, 2, 2}),
	             "tensor([[[0, 1],\n         [2, 3]],\n\n        [[4, 5],\n         [6, 7]]], "
	             "size=[2,2,2], dtype=i64)\n");
	/* over 1000 elements: 3 edge items per dim */
	expect_print(kl_arange(ctx, KL_I32, 0, 2000, 1),
	             "tensor([   0,    1,    2,  ..., 1997, 1998, 1999], size=[2000], dtype=i32)\n");
	expect_print(kl_reshape(kl_arange(ctx, KL_I32, 0, 1100, 1), 2, (int64_t[]){100, 11}),
	             "tensor([[   0,    1,    2,  ...,    8,    9,   10],\n"
	             "        [  11,   12,   13,  ...,   19,   20,   21],\n"
	             "        [  22,   23,   24,  ...,   30,   31,   32],\n"
	             "        ...,\n"
	             "        [1067, 1068, 1069,  ..., 1075, 1076, 1077],\n"
	             "        [1078, 1079, 1080,  ..., 1086, 1087, 1088],\n"
	             "        [1089, 1090, 1091,  ..., 1097, 1098, 1099]], size=[100,11], dtype=i32)\n");
	/* long rows wrap at 80 columns */
	char *w = print_to_string(kl_arange(ctx, KL_I32, 0, 40, 1));
	size_t first_line = strcspn(w, "\n");
	assert_true(w[first_line] == '\n');
	assert_true(first_line <= 80);
	free(w);
	assert_int_equal(kl_print(a, NULL), KL_EINVAL);
	kl_clear_error(ctx);
	kl_scope_end(ctx);
	kl_ctx_free(ctx);
}

/* ---- eager dispatch and movement ------------------------------------------------------- */

/* wraps the real backend to check what exec receives */
static const kl_backend *real_be;
static int exec_calls;
static kl_node last_node;
static int64_t last_in_strides[KL_NODE_MAX_IN][KL_MAX_DIMS];
static int64_t last_in_shape[KL_NODE_MAX_IN][KL_MAX_DIMS];

static kl_status spy_exec(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	exec_calls++;
	last_node = *n;
	for (int i = 0; i < n->nin; i++) {
		memcpy(last_in_strides[i], in[i]->strides, sizeof last_in_strides[i]);
		memcpy(last_in_shape[i], in[i]->shape, sizeof last_in_shape[i]);
	}
	assert_true(kl_is_contiguous(out));
	return real_be->exec(ctx, n, in, out);
}

static void test_eager_dispatch(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	real_be = ctx->be;
	kl_backend spy = *ctx->be;
	spy.exec = spy_exec;
	ctx->be = &spy;
	kl_scope_begin(ctx);
	kl_tensor *a = from_f32(ctx, 2, (int64_t[]){2, 3}, (float[]){0, 1, 2, 3, 4, 5});
	kl_tensor *b = from_f32(ctx, 1, (int64_t[]){3}, (float[]){10, 20, 30});
	exec_calls = 0;
	kl_tensor *c = kl_add(a, b);
	assert_int_equal(exec_calls, 1);
	/* the backend sees b broadcast to [2,3] with a zero stride */
	assert_int_equal(last_in_shape[1][0], 2);
	assert_int_equal(last_in_strides[1][0], 0);
	assert_int_equal(last_in_strides[1][1], 1);
	expect_values(c, 6, (double[]){10, 21, 32, 13, 24, 35});
	expect_values(kl_mul_scalar(a, 2), 6, (double[]){0, 2, 4, 6, 8, 10});

	/* views run no kernel */
	exec_calls = 0;
	kl_tensor *t = kl_transpose(a, 0, 1);
	kl_tensor *e = kl_expand(b, 3, (int64_t[]){4, 2, -1});
	kl_tensor *sl = kl_slice(a, 1, -2, 3, 1);
	kl_tensor *r = kl_reshape(a, 2, (int64_t[]){3, -1});
	kl_tensor *cg = kl_contiguous(a);
	assert_int_equal(exec_calls, 0);
	assert_ptr_equal(t->st, a->st);
	assert_int_equal(t->strides[0], 1);
	assert_int_equal(t->strides[1], 3);
	assert_int_equal(e->strides[0], 0);
	assert_int_equal(e->strides[1], 0);
	assert_int_equal(e->shape[0], 4);
	assert_int_equal(sl->offset, 1);
	assert_int_equal(sl->shape[1], 2);
	assert_int_equal(r->shape[1], 2);
	assert_ptr_equal(r->st, a->st);
	assert_ptr_equal(cg->st, a->st);
	assert_ptr_not_equal(cg, a);
	expect_values(sl, 4, (double[]){1, 2, 4, 5});
	expect_values(e, 24, (double[]){10, 20, 30, 10, 20, 30, 10, 20, 30, 10, 20, 30,
	                                10, 20, 30, 10, 20, 30, 10, 20, 30, 10, 20, 30});
	/* a reshape the strides forbid copies (one CONTIGUOUS) */
	exec_calls = 0;
	kl_tensor *rt = kl_reshape(t, 1, (int64_t[]){6});
	assert_int_equal(exec_calls, 1);
	assert_int_equal(last_node.op, KL_OP_CONTIGUOUS);
	assert_ptr_not_equal(rt->st, a->st);
	expect_values(rt, 6, (double[]){0, 3, 1, 4, 2, 5});
	/* a transposed view with a unit dim reshapes as a view */
	kl_tensor *col = kl_slice(t, 1, 0, 1, 1); /* [3,1] */
	exec_calls = 0;
	kl_tensor *flat = kl_reshape(col, 1, (int64_t[]){3});
	assert_int_equal(exec_calls, 0);
	assert_int_equal(flat->strides[0], 1);
	expect_values(flat, 3, (double[]){0, 1, 2});
	/* python slicing */
	kl_tensor *ar = kl_arange(ctx, KL_F32, 0, 10, 1);
	expect_values(kl_slice(ar, 0, 1, 8, 3), 3, (double[]){1, 4, 7});
	expect_values(kl_slice(ar, 0, -3, 100, 1), 3, (double[]){7, 8, 9});
	assert_int_equal(kl_numel(kl_slice(ar, 0, 7, 2, 1)), 0);
	assert_int_equal(kl_numel(kl_slice(ar, 0, -100, -50, 1)), 0);
	expect_values(kl_slice(ar, 0, -100, 2, 1), 2, (double[]){0, 1});
	/* a non-contiguous to_host gathers through the backend */
	exec_calls = 0;
	expect_values(t, 6, (double[]){0, 3, 1, 4, 2, 5});
	assert_int_equal(exec_calls, 1);
	double v;
	assert_int_equal(kl_item(kl_slice(sl, 0, 1, 2, 1), &v), KL_EINVAL);
	expect_err(ctx, KL_EINVAL, "kl_item: shape [1,2] has 2 elements, not 1");
	assert_int_equal(kl_item(kl_slice(kl_slice(t, 0, 2, 3, 1), 1, 1, 2, 1), &v), KL_OK);
	assert_true(v == 5);
	kl_scope_end(ctx);
	ctx->be = real_be;
	kl_ctx_free(ctx);
}

/* the front end's matmul shape rules, checked on small exact values */
static void test_matmul_front(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_scope_begin(ctx);
	kl_tensor *m = kl_reshape(kl_arange(ctx, KL_F32, 0, 6, 1), 2, (int64_t[]){2, 3});
	kl_tensor *v = kl_arange(ctx, KL_F32, 0, 3, 1);
	kl_tensor *mv = kl_matmul(m, v);
	assert_int_equal(kl_ndim(mv), 1);
	expect_values(mv, 2, (double[]){5, 14});
	kl_tensor *vv = kl_matmul(v, v);
	assert_int_equal(kl_ndim(vv), 0);
	expect_values(vv, 1, (double[]){5});
	kl_tensor *vm = kl_matmul(kl_arange(ctx, KL_F32, 1, 3, 1), m); /* [2] @ [2,3] */
	assert_int_equal(kl_ndim(vm), 1);
	expect_values(vm, 3, (double[]){6, 9, 12});
	/* batch dims broadcast: [2,1,2,3] @ [3,3,1] -> [2,3,2,1] */
	kl_tensor *bm =
	        kl_expand(kl_reshape(m, 4, (int64_t[]){1, 1, 2, 3}), 4, (int64_t[]){2, 1, 2, 3});
	kl_tensor *bw = kl_full(ctx, KL_F32, 3, (int64_t[]){3, 3, 1}, 1.0);
	kl_tensor *bo = kl_matmul(bm, bw);
	assert_int_equal(kl_ndim(bo), 4);
	assert_int_equal(kl_dim(bo, 0), 2);
	assert_int_equal(kl_dim(bo, 1), 3);
	assert_int_equal(kl_dim(bo, 2), 2);
	assert_int_equal(kl_dim(bo, 3), 1);
	expect_values(bo, 12, (double[]){3, 12, 3, 12, 3, 12, 3, 12, 3, 12, 3, 12});
	/* linear: x @ w^T + bias */
	kl_tensor *w = kl_reshape(kl_arange(ctx, KL_F32, 0, 12, 1), 2, (int64_t[]){4, 3});
	kl_tensor *bias = kl_arange(ctx, KL_F32, 0, 4, 1);
	kl_tensor *y = kl_linear(m, w, bias);
	assert_int_equal(kl_dim(y, 0), 2);
	assert_int_equal(kl_dim(y, 1), 4);
	expect_values(y, 8, (double[]){5, 15, 25, 35, 14, 51, 88, 125});
	assert_null(kl_matmul(v, kl_scalar(ctx, KL_F32, 1)));
	expect_err(ctx, KL_EINVAL, "kl_matmul: shapes [3] and []: both need at least 1 dim");
	kl_scope_end(ctx);
	assert_int_equal(count_live(ctx), 0);
	kl_ctx_free(ctx);
}

/* ---- traces -------------------------------------------------------------------------------- */

static kl_trace *trace_mul_add_relu(kl_ctx *ctx, int64_t n)
{
	kl_scope_begin(ctx);
	kl_tensor *a = kl_zeros(ctx, KL_F32, 2, (int64_t[]){n, 3});
	kl_tensor *b = kl_zeros(ctx, KL_F32, 2, (int64_t[]){n, 3});
	kl_tensor *c = kl_zeros(ctx, KL_F32, 1, (int64_t[]){3});
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *y = kl_relu(kl_add(kl_mul(a, b), c));
	assert_non_null(y);
	assert_null(y->st);
	kl_trace *tr = kl__trace_end(ctx, 1, &y);
	assert_non_null(tr);
	kl_scope_end(ctx);
	return tr;
}

static void test_trace_nodes_and_hash(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_trace *t1 = trace_mul_add_relu(ctx, 4);
	const kl_graph *g = &t1->g;
	assert_int_equal(g->n, 6);
	assert_int_equal(g->ninputs, 3);
	int ninput = 0;
	for (int i = 0; i < g->n; i++)
		ninput += g->nodes[i].op == KL_OP_INPUT;
	assert_int_equal(ninput, 3);
	/* INPUT nodes appear where a tensor is first used */
	assert_int_equal(g->nodes[2].op, KL_OP_MUL);
	assert_int_equal(g->nodes[3].op, KL_OP_INPUT);
	assert_int_equal(g->nodes[4].op, KL_OP_ADD);
	assert_int_equal(g->nodes[5].op, KL_OP_RELU);
	assert_int_equal(g->nodes[4].in[0], 2);
	/* implicit broadcasting: the ADD reads the [3] input as it is */
	const kl_node *cin = &g->nodes[g->nodes[4].in[1]];
	assert_int_equal(cin->op, KL_OP_INPUT);
	assert_int_equal(cin->ndim, 1);
	assert_int_equal(cin->strides[0], 1);
	assert_int_equal(g->nodes[4].ndim, 2);
	assert_int_equal(g->noutputs, 1);
	assert_int_equal(g->outputs[0], 5);
	assert_int_equal(t1->nin_tensors, 3);
	/* the trace holds its inputs: they outlived the scope */
	assert_int_equal(count_live(ctx), 3);

	kl_trace *t2 = trace_mul_add_relu(ctx, 4);
	kl_trace *t3 = trace_mul_add_relu(ctx, 5);
	assert_true(kl__graph_hash(&t1->g) == kl__graph_hash(&t2->g));
	assert_true(kl__graph_hash(&t1->g) != kl__graph_hash(&t3->g));
	kl_graph cp;
	assert_int_equal(kl__graph_copy(&cp, &t1->g), 0);
	assert_true(kl__graph_hash(&cp) == kl__graph_hash(&t1->g));
	cp.nodes[3].op = KL_OP_SUB;
	assert_true(kl__graph_hash(&cp) != kl__graph_hash(&t1->g));
	kl__graph_free(&cp);

	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	kl__graph_print(&t1->g, f);
	fclose(f);
	assert_non_null(strstr(buf, "%5 = relu(%4) f32[4,3]"));
	assert_non_null(strstr(buf, "input() f32[3] strides=[1]"));
	free(buf);
	kl__trace_free(t1);
	kl__trace_free(t2);
	kl__trace_free(t3);
	assert_int_equal(count_live(ctx), 0);
	kl_ctx_free(ctx);
}

static int hook_calls;
static kl_status refuse_hook(kl_ctx *ctx, const char *op, int n, kl_tensor *const *ts)
{
	(void)n;
	(void)ts;
	hook_calls++;
	return kl__err(ctx, KL_ESTATE, "%s: refused by the test hook", op);
}

static void test_trace_rules(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_scope_begin(ctx);
	kl_tensor *a = kl_zeros(ctx, KL_F32, 3, (int64_t[]){2, 3, 4});
	kl_tensor *w = kl_zeros(ctx, KL_F32, 2, (int64_t[]){4, 5});
	kl_tensor *v = kl_zeros(ctx, KL_F32, 1, (int64_t[]){4});
	kl_tensor *lw = kl_zeros(ctx, KL_F32, 2, (int64_t[]){7, 4});
	kl_tensor *lb = kl_zeros(ctx, KL_F32, 1, (int64_t[]){7});
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	assert_int_equal(kl__trace_begin(ctx), KL_ESTATE);
	kl_clear_error(ctx);
	/* movement ops are nodes; a tensor used twice is one INPUT */
	kl_tensor *p = kl_permute(a, (int[]){2, 0, 1});
	kl_tensor *s = kl_slice(p, -1, 1, 3, 1);
	kl_tensor *r = kl_reshape(a, 2, (int64_t[]){6, 4});
	kl_tensor *m = kl_matmul(a, w);  /* w expands to [2,4,5] */
	kl_tensor *mv = kl_matmul(a, v); /* [2,3,4] @ [4] -> [2,3] */
	kl_tensor *cat = kl_concat(10, (kl_tensor *[]){v, v, v, v, v, v, v, v, v, v}, 0);
	kl_tensor *ln = kl_layer_norm(a, v, v, 1e-5);
	kl_tensor *lin = kl_linear(a, lw, lb);
	assert_true(p && s && r && m && mv && cat && ln && lin);
	assert_int_equal(s->shape[2], 2);
	assert_int_equal(m->ndim, 3);
	assert_int_equal(m->shape[2], 5);
	assert_int_equal(mv->ndim, 2);
	assert_int_equal(mv->shape[1], 3);
	assert_int_equal(cat->shape[0], 40);
	assert_int_equal(lin->shape[2], 7);
	/* a sync point without a hook fails; with one, the hook is asked */
	double d;
	kl_tensor *one = kl_sum(a, 0, NULL, false);
	assert_int_equal(kl_item(one, &d), KL_ESTATE);
	expect_err(ctx, KL_ESTATE, "kl_item: sync point inside a trace");
	ctx->sync_hook = refuse_hook;
	hook_calls = 0;
	assert_int_equal(kl_item(one, &d), KL_ESTATE);
	assert_int_equal(hook_calls, 1);
	expect_err(ctx, KL_ESTATE, "kl_item: refused by the test hook");
	ctx->sync_hook = NULL;

	kl_trace *tr = kl__trace_end(ctx, 1, &m);
	assert_non_null(tr);
	const kl_graph *g = &tr->g;
	int nin = 0, nexp = 0, nmm = 0, nconcat = 0;
	for (int i = 0; i < g->n; i++) {
		const kl_node *n = &g->nodes[i];
		nin += n->op == KL_OP_INPUT;
		nconcat += n->op == KL_OP_CONCAT;
		if (n->op == KL_OP_EXPAND)
			nexp++;
		if (n->op == KL_OP_MATMUL) {
			nmm++;
			const kl_node *x = &g->nodes[n->in[0]], *y = &g->nodes[n->in[1]];
			assert_int_equal(x->ndim, y->ndim);
			for (int k = 0; k < x->ndim - 2; k++)
				assert_int_equal(x->shape[k], y->shape[k]);
		}
		if (n->op == KL_OP_SLICE) {
			assert_int_equal(n->a.axis, 2);
			assert_int_equal(n->a.v[0], 1);
			assert_int_equal(n->a.v[1], 3);
			assert_int_equal(n->a.v[2], 1);
		}
		if (n->op == KL_OP_LAYER_NORM) {
			assert_int_equal(n->nin, 3);
			assert_int_equal(n->a.flags, KL_F_HAS_WEIGHT | KL_F_HAS_BIAS);
		}
		for (int k = 0; k < n->nin; k++)
			assert_true(n->in[k] >= 0 && n->in[k] < i);
	}
	assert_int_equal(nin, 5); /* a, w, v, linear's weight and bias */
	assert_int_equal(nmm, 3);
	assert_true(nexp >= 2);
	assert_int_equal(nconcat, 2); /* 8 + (1 + 2): a chain */
	assert_int_equal(g->noutputs, 1);

	/* lazy tensors of a finished trace are refused, with or without a
	 * new trace */
	assert_null(kl_relu(m));
	expect_err(ctx, KL_ESTATE, "kl_relu: input 0 is a lazy tensor of a finished trace");
	assert_int_equal(kl_to_host(one, &d, sizeof(float)), KL_ESTATE);
	kl_clear_error(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	assert_null(kl_add(m, m));
	expect_err(ctx, KL_ESTATE, "kl_add: input 0 is a lazy tensor of a finished trace");
	kl__trace_free(kl__trace_end(ctx, 0, NULL));
	assert_null(kl__trace_end(ctx, 0, NULL));
	expect_err(ctx, KL_ESTATE, "kl__trace_end: no trace is active");
	kl__trace_free(tr);
	kl_scope_end(ctx);
	assert_int_equal(count_live(ctx), 0);
	kl_ctx_free(ctx);
}

/* a graph break with nothing to run: end the trace, start the next */
static kl_status break_hook(kl_ctx *ctx, const char *op, int n, kl_tensor *const *ts)
{
	(void)op;
	(void)n;
	(void)ts;
	hook_calls++;
	kl__trace_free(kl__trace_end(ctx, 0, NULL));
	return kl__trace_begin(ctx);
}

static kl_status host_cb(kl_ctx *ctx, kl_tensor *const *ts, int n, void *user)
{
	(void)ctx;
	assert_int_equal(n, 1);
	assert_non_null(ts[0]->st);
	*(int *)user += 1;
	return KL_OK;
}

static kl_status failing_cb(kl_ctx *ctx, kl_tensor *const *ts, int n, void *user)
{
	(void)ctx;
	(void)ts;
	(void)n;
	(void)user;
	return KL_EIO;
}

static void test_sync_points(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_scope_begin(ctx);
	kl_tensor *m = kl_reshape(kl_arange(ctx, KL_F32, 0, 6, 1), 2, (int64_t[]){2, 3});
	kl_tensor *t = kl_transpose(m, 0, 1);
	kl_tensor *row = kl_slice(t, 0, 0, 1, 1);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	ctx->sync_hook = break_hook;
	hook_calls = 0;
	/* the gather of a strided tensor runs at once even though a (new)
	 * trace is active after the break */
	expect_values(t, 6, (double[]){0, 3, 1, 4, 2, 5});
	assert_int_equal(hook_calls, 1);
	assert_non_null(ctx->trace);
	int seen = 0;
	assert_int_equal(kl_host_call(ctx, host_cb, &t, 1, &seen), KL_OK);
	assert_int_equal(seen, 1);
	assert_int_equal(hook_calls, 2);
	char *p = print_to_string(row);
	assert_string_equal(p, "tensor([[0., 3.]], size=[1,2], dtype=f32)\n");
	free(p);
	assert_int_equal(hook_calls, 3);
	/* a lazy tensor the hook did not materialize is refused */
	kl_tensor *lazy = kl_neg(m);
	double d;
	assert_int_equal(kl_item(kl_sum(lazy, 0, NULL, false), &d), KL_ESTATE);
	expect_err(ctx, KL_ESTATE, "kl_item: input 0 is a lazy tensor of a finished trace");
	ctx->sync_hook = NULL;
	kl__trace_free(kl__trace_end(ctx, 0, NULL));
	assert_int_equal(kl_host_call(ctx, failing_cb, NULL, 0, NULL), KL_EIO);
	expect_err(ctx, KL_EIO, "kl_host_call: the callback returned KL_EIO");
	assert_int_equal(kl_host_call(ctx, NULL, NULL, 0, NULL), KL_EINVAL);
	expect_err(ctx, KL_EINVAL, "kl_host_call: fn is NULL");
	kl_scope_end(ctx);
	assert_int_equal(count_live(ctx), 0);
	kl_ctx_free(ctx);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_ctx_and_version),
	        cmocka_unit_test(test_logs),
	        cmocka_unit_test(test_refcounts_and_views),
	        cmocka_unit_test(test_scopes),
	        cmocka_unit_test(test_ctx_free_with_live_tensors),
	        cmocka_unit_test(test_memory_stats),
	        cmocka_unit_test(test_errors),
	        cmocka_unit_test(test_creation),
	        cmocka_unit_test(test_philox_known_answer),
	        cmocka_unit_test(test_rand),
	        cmocka_unit_test(test_f16_roundtrip_all),
	        cmocka_unit_test(test_f32_to_half_sweep),
	        cmocka_unit_test(test_store_load),
	        cmocka_unit_test(test_promotion),
	        cmocka_unit_test(test_printer),
	        cmocka_unit_test(test_eager_dispatch),
	        cmocka_unit_test(test_matmul_front),
	        cmocka_unit_test(test_trace_nodes_and_hash),
	        cmocka_unit_test(test_trace_rules),
	        cmocka_unit_test(test_sync_points),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
