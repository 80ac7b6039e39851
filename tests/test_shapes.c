/* test_shapes.c - shape arithmetic that cannot overflow (core/shape.h) and the
 * errors of issue 19's items 1-5 and 10, each through the public call that
 * used to overflow, read past a buffer or name the wrong op:
 *   1. empty shapes with huge dims ({0, 2^62, 2^62}) through kl_empty,
 *      kl_zeros, kl_from_host, kl_safetensors_open/get and kl_reshape;
 *   2. kl_reshape to a product past int64 ({2^40, 2^40}, [8, 2^61 + 3]);
 *   3. kl_slice with any step up to INT64_MAX (PyTorch's lengths), eager,
 *      compiled and in the reference;
 *   4. kl_ctx_new's bound on nthreads;
 *   5. kl_from_host's byte count;
 *  10. every error names the public call made (kl_zeros, kl_embedding, out
 *      of memory in kl_empty/kl_zeros/kl_add/kl_mul/kl_matmul/kl_contiguous).
 * Run under ASan+UBSan too (halt_on_error), where a signed overflow fails.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/core.h"
#include "backend/cpu/cpu.h"
#include "graph/reference.h"

#define P62 (INT64_C(1) << 62)
#define P40 (INT64_C(1) << 40)

static kl_ctx *new_ctx(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	return ctx;
}

/* the last error of ctx (NULL: this thread's) has status st and starts with
 * prefix and contains each further piece; then it is cleared */
static void expect_err(const kl_ctx *ctx, kl_status st, const char *prefix, const char *part)
{
	const char *msg = kl_last_error(ctx);
	if (kl_last_status(ctx) != st || strncmp(msg, prefix, strlen(prefix)) != 0 ||
	    (part && !strstr(msg, part))) {
		fprintf(stderr, "want %s \"%s...%s\", got %s \"%s\"\n", kl_status_name(st), prefix,
		        part ? part : "", kl_status_name(kl_last_status(ctx)), msg);
		fail();
	}
	kl_clear_error((kl_ctx *)ctx);
}

static kl_tensor *arange_f32(kl_ctx *ctx, int ndim, const int64_t *shape)
{
	int64_t n = kl__numel(ndim, shape);
	kl_tensor *a = kl_arange(ctx, KL_F32, 0, (double)n, 1);
	kl_tensor *r = kl_reshape(a, ndim, shape);
	kl_release(a);
	assert_non_null(r);
	return r;
}

/* ---- the helpers themselves --------------------------------------------------- */

static void test_shape_rule(void **state)
{
	(void)state;
	int bad;
	assert_int_equal(kl__shape_check(0, NULL, &bad), KL_SHAPE_OK);
	assert_int_equal(kl__shape_check(3, (int64_t[]){0, 5, 7}, &bad), KL_SHAPE_OK);
	assert_int_equal(kl__shape_check(1, (int64_t[]){KL_MAX_NUMEL}, &bad), KL_SHAPE_OK);
	assert_int_equal(kl__shape_check(1, (int64_t[]){KL_MAX_NUMEL + 1}, &bad),
	                 KL_SHAPE_TOO_LARGE);
	assert_int_equal(kl__shape_check(3, (int64_t[]){0, P62, P62}, &bad), KL_SHAPE_TOO_LARGE);
	assert_int_equal(kl__shape_check(2, (int64_t[]){P62, 0}, &bad), KL_SHAPE_TOO_LARGE);
	assert_int_equal(kl__shape_check(2, (int64_t[]){3, -2}, &bad), KL_SHAPE_NEGATIVE);
	assert_int_equal(bad, 1);
	assert_int_equal(kl__shape_check(9, (int64_t[9]){0}, &bad), KL_SHAPE_NDIM);
	/* every product of 8 dims of 2^8 (2^64) is caught, in any order */
	int64_t big[8] = {256, 256, 256, 256, 256, 256, 256, 256};
	assert_int_equal(kl__shape_check(8, big, NULL), KL_SHAPE_TOO_LARGE);
	big[3] = 0; /* the other seven make 2^56 */
	assert_int_equal(kl__shape_check(8, big, NULL), KL_SHAPE_OK);
	assert_int_equal(kl__shape_check(3, (int64_t[]){1 << 30, 0, 1 << 30}, NULL),
	                 KL_SHAPE_TOO_LARGE);

	int64_t st[3];
	assert_true(kl__contig_strides(3, (int64_t[]){2, 0, 5}, st));
	assert_int_equal(st[0], 5);
	assert_int_equal(st[1], 5);
	assert_int_equal(st[2], 1);
	assert_false(kl__contig_strides(3, (int64_t[]){0, P62, P62}, st)); /* saturated */
	assert_int_equal(st[0], INT64_MAX);

	size_t nb;
	assert_true(kl__shape_nbytes(2, (int64_t[]){3, 5}, 8, &nb));
	assert_int_equal(nb, 120);
	assert_false(kl__shape_nbytes(3, (int64_t[]){0, P62, P62}, 4, &nb));
	assert_int_equal(kl__numel(3, (int64_t[]){0, P62, P62}), 0);
	assert_int_equal(kl__numel(2, (int64_t[]){P62, P62}), INT64_MAX); /* saturates */

	int64_t p;
	assert_true(kl__dims_product(3, (int64_t[]){P62, P62, 0}, &p));
	assert_int_equal(p, 0);
	assert_false(kl__dims_product(2, (int64_t[]){P40, P40}, &p));

	int64_t out[KL_MAX_DIMS];
	assert_int_equal(kl__reshape_shape(24, 2, (int64_t[]){-1, 4}, out, &bad), KL_SHAPE_OK);
	assert_int_equal(out[0], 6);
	assert_int_equal(kl__reshape_shape(24, 2, (int64_t[]){P40, P40}, out, &bad),
	                 KL_SHAPE_TOO_LARGE);
	assert_int_equal(kl__reshape_shape(24, 2, (int64_t[]){8, (INT64_C(1) << 61) + 3}, out,
	                                   &bad),
	                 KL_SHAPE_TOO_LARGE);
	assert_int_equal(kl__reshape_shape(24, 2, (int64_t[]){-1, -1}, out, &bad), KL_SHAPE_INFER);
	assert_int_equal(kl__reshape_shape(0, 2, (int64_t[]){-1, 0}, out, &bad), KL_SHAPE_INFER);
	assert_int_equal(kl__reshape_shape(24, 2, (int64_t[]){5, 5}, out, &bad),
	                 KL_SHAPE_MISMATCH);
	assert_int_equal(kl__reshape_shape(0, 3, (int64_t[]){0, P62, P62}, out, &bad),
	                 KL_SHAPE_TOO_LARGE);
	assert_int_equal(kl__reshape_shape(24, 2, (int64_t[]){-3, 8}, out, &bad),
	                 KL_SHAPE_NEGATIVE);
	assert_int_equal(bad, 0);
}

/* Lengths and first elements from Python: len(range(size)[start:stop:step]). */
static const struct {
	int64_t size, start, stop, step, len, first;
} slices[] = {
        {1, -1, 3, INT64_MAX, 1, 0},
        {6, 1, INT64_MAX, 1, 5, 1},
        {6, -6, 1, 1, 1, 0},
        {0, 6, 8, 1, 0, -1},
        {4, -7, 5, 1, 4, 0},
        {6, 3, INT64_MAX, 5, 1, 3},
        {4, 8, -8, 2, 0, -1},
        {6, 6, INT64_MAX, 2, 0, -1},
        {6, 0, 8, 1, 6, 0},
        {0, -5, INT64_MAX, 3, 0, -1},
        {6, 5, -INT64_MAX, INT64_MAX, 0, -1},
        {0, -INT64_MAX, -8, INT64_MAX, 0, -1},
        {4, 7, 5, 5, 0, -1},
        {1, 1, 3, 1, 0, -1},
        {6, -5, -8, 1, 0, -1},
        {1, -1, -6, INT64_MAX, 0, -1},
        {1, -8, -1, INT64_MAX - 1, 0, -1},
        {7, -5, -6, 1, 0, -1},
        {6, -5, INT64_MIN, 3, 0, -1},
        {0, 8, 5, 5, 0, -1},
        {6, 7, 6, INT64_MAX - 1, 0, -1},
        {6, -8, 3, 2, 2, 0},
        {4, -5, 0, 3, 0, -1},
        {7, 0, 0, 1, 0, -1},
        {7, -INT64_MAX, -INT64_MAX, INT64_MAX - 1, 0, -1},
        {7, 5, 6, 2, 1, 5},
        {0, INT64_MAX, 0, 5, 0, -1},
        {7, 3, INT64_MIN, 2, 0, -1},
        {6, 1, 7, 1, 5, 1},
        {4, 0, INT64_MAX, INT64_MAX, 1, 0},
        {6, INT64_MIN, INT64_MAX, INT64_MAX - 1, 1, 0},
        {7, -7, INT64_MAX, 3, 3, 0},
        {7, 1, INT64_MAX, 2, 3, 1},
        {7, -3, -1, 1, 2, 4},
        {6, INT64_MIN, INT64_MAX, 1, 6, 0},
        {6, -1, INT64_MAX, INT64_MAX, 1, 5},
        {4, 0, 4, INT64_MAX, 1, 0},
};

static void test_slice_len_matches_python(void **state)
{
	(void)state;
	for (size_t i = 0; i < sizeof slices / sizeof slices[0]; i++) {
		int64_t a = slices[i].start, b = slices[i].stop, len = -7;
		assert_true(kl__slice_len(slices[i].size, &a, &b, slices[i].step, &len));
		if (len != slices[i].len || (len > 0 && a != slices[i].first)) {
			fprintf(stderr, "case %zu: len %lld start %lld, want %lld %lld\n", i,
			        (long long)len, (long long)a, (long long)slices[i].len,
			        (long long)slices[i].first);
			fail();
		}
	}
	int64_t a = 0, b = 4, len;
	assert_false(kl__slice_len(4, &a, &b, 0, &len));
	assert_false(kl__slice_len(4, &a, &b, INT64_MIN, &len));
}

/* ---- 1: empty shapes with huge dims ------------------------------------------- */

static void test_empty_shape_huge_dims(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	const int64_t huge[3] = {0, P62, P62};
	const char *why = "its dims multiply past 2^59";
	assert_null(kl_empty(ctx, KL_F32, 3, huge));
	expect_err(ctx, KL_EINVAL, "kl_empty: shape [0,4611686018427387904,4611686018427387904]",
	           why);
	assert_null(kl_zeros(ctx, KL_F32, 3, huge));
	expect_err(ctx, KL_EINVAL, "kl_zeros: shape [0,", why);
	assert_null(kl_randn(ctx, KL_F32, 3, huge, 1));
	expect_err(ctx, KL_EINVAL, "kl_randn: shape [0,", why);
	assert_null(kl_from_host(ctx, KL_F32, 3, huge, NULL, 0));
	expect_err(ctx, KL_EINVAL, "kl_from_host: shape [0,", why);
	/* a huge dim beside a zero is refused wherever it stands */
	assert_null(kl_empty(ctx, KL_F64, 2, (int64_t[]){P62, 0}));
	expect_err(ctx, KL_EINVAL, "kl_empty: shape [4611686018427387904,0]", why);
	size_t nb = 1;
	assert_int_equal(kl_shape_nbytes(KL_F32, 3, huge, &nb), KL_EINVAL);
	expect_err(NULL, KL_EINVAL, "kl_shape_nbytes: shape [0,", why);

	/* reshape of an empty tensor to such a shape */
	kl_tensor *e = kl_zeros(ctx, KL_F32, 2, (int64_t[]){0, 4});
	assert_non_null(e);
	assert_null(kl_reshape(e, 3, huge));
	expect_err(ctx, KL_EINVAL, "kl_reshape: cannot reshape [0,4] (0 elements) to [0,", why);
	assert_null(kl_reshape(e, 3, (int64_t[]){P62, 0, P62}));
	expect_err(ctx, KL_EINVAL, "kl_reshape: cannot reshape [0,4]", why);
	/* a modest empty shape still works, strides as torch gives them */
	kl_tensor *r = kl_reshape(e, 3, (int64_t[]){2, 0, 3});
	assert_non_null(r);
	assert_int_equal(kl_strides(r)[0], 3);
	assert_int_equal(kl_strides(r)[1], 3);
	assert_int_equal(kl_strides(r)[2], 1);
	kl_tensor *z = kl_empty(ctx, KL_F32, 3, (int64_t[]){0, 1 << 20, 1 << 20});
	assert_non_null(z);
	assert_int_equal(kl_numel(z), 0);
	assert_int_equal(kl_strides(z)[0], INT64_C(1) << 40);

	/* a result shape past the limit, made by broadcasting two expanded views */
	kl_tensor *one = kl_zeros(ctx, KL_F32, 2, (int64_t[]){1, 1});
	kl_tensor *col = kl_expand(one, 2, (int64_t[]){P40, 1});
	kl_tensor *row = kl_expand(one, 2, (int64_t[]){1, P40});
	assert_non_null(col);
	assert_non_null(row);
	assert_null(kl_add(col, row));
	expect_err(ctx, KL_EINVAL, "kl_add: result shape [1099511627776,1099511627776]", why);
	assert_null(kl_expand(one, 3, (int64_t[]){0, P62, P62}));
	expect_err(ctx, KL_EINVAL, "kl_expand: result shape [0,", why);
	assert_null(kl_matmul(col, row));
	expect_err(ctx, KL_EINVAL, "kl_matmul: result shape [1099511627776,1099511627776]", why);
	kl_ctx_free(ctx);
}

/* A safetensors file whose one entry is F32 of the given JSON shape. */
static char *write_st(const char *shape, int64_t end)
{
	char *path = malloc(64);
	assert_non_null(path);
	snprintf(path, 64, "/tmp/kiln_test_shapes_%ld.safetensors", (long)getpid());
	char hdr[256];
	int n = snprintf(hdr, sizeof hdr,
	                 "{\"x\":{\"dtype\":\"F32\",\"shape\":%s,\"data_offsets\":[0,%lld]}}",
	                 shape, (long long)end);
	while (n % 8)
		hdr[n++] = ' ';
	FILE *f = fopen(path, "wb");
	assert_non_null(f);
	unsigned char len[8];
	for (int i = 0; i < 8; i++)
		len[i] = (unsigned char)((uint64_t)n >> (8 * i));
	fwrite(len, 1, 8, f);
	fwrite(hdr, 1, (size_t)n, f);
	float zeros[6] = {0};
	fwrite(zeros, 1, (size_t)end, f);
	fclose(f);
	return path;
}

static void test_safetensors_empty_huge(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	char *path = write_st("[0,4611686018427387904,4611686018427387904]", 0);
	assert_null(kl_safetensors_open(ctx, path));
	expect_err(ctx, KL_EFORMAT, "kl_safetensors_open: ", "tensor 'x': shape [0,");
	unlink(path);
	free(path);
	/* an empty entry of a sane shape still loads */
	path = write_st("[0,3]", 0);
	kl_safetensors *st = kl_safetensors_open(ctx, path);
	assert_non_null(st);
	kl_tensor *t = kl_safetensors_get(st, "x");
	assert_non_null(t);
	assert_int_equal(kl_numel(t), 0);
	kl_safetensors_close(st);
	unlink(path);
	free(path);
	kl_ctx_free(ctx);
}

/* ---- 2: reshape products past int64 ------------------------------------------- */

static void test_reshape_overflow(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_tensor *a = arange_f32(ctx, 2, (int64_t[]){4, 6});
	assert_null(kl_reshape(a, 2, (int64_t[]){P40, P40}));
	expect_err(ctx, KL_EINVAL,
	           "kl_reshape: cannot reshape [4,6] (24 elements) to "
	           "[1099511627776,1099511627776]",
	           "multiply past 2^59");
	/* 8 * (2^61 + 3) wraps to 24 in 64 bits */
	assert_null(kl_reshape(a, 2, (int64_t[]){8, (INT64_C(1) << 61) + 3}));
	expect_err(ctx, KL_EINVAL, "kl_reshape: cannot reshape [4,6] (24 elements) to [8,", NULL);
	/* and with -1: the known dims overflow before the inference */
	assert_null(kl_reshape(a, 3, (int64_t[]){-1, P40, P40}));
	expect_err(ctx, KL_EINVAL, "kl_reshape: cannot reshape [4,6]", "multiply past 2^59");
	kl_tensor *ok = kl_reshape(a, 3, (int64_t[]){2, -1, 3});
	assert_non_null(ok);
	assert_int_equal(kl_shape(ok)[1], 4);
	kl_ctx_free(ctx);
}

/* ---- 3: slices with any step ----------------------------------------------------- */

static kl_status slice_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	(void)ctx;
	(void)nin;
	(void)nout;
	const int64_t *b = user; /* start, stop, step */
	out[0] = kl_mul_scalar(kl_slice(in[0], 0, b[0], b[1], b[2]), 2.0);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static void test_slice_huge_step(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_tensor *a = arange_f32(ctx, 2, (int64_t[]){4, 6});
	/* torch: a[::2**63-1] is a[0:1], shape [1,6] */
	kl_tensor *s = kl_slice(a, 0, 0, INT64_MAX, INT64_MAX);
	assert_non_null(s);
	assert_int_equal(kl_ndim(s), 2);
	assert_int_equal(kl_shape(s)[0], 1);
	assert_int_equal(kl_shape(s)[1], 6);
	float v[6];
	assert_int_equal(kl_to_host(s, v, sizeof v), KL_OK);
	for (int j = 0; j < 6; j++)
		assert_true(v[j] == (float)j);
	/* a reduction over the slice reads row 0 only */
	kl_tensor *sum = kl_sum(s, 0, NULL, false);
	double got;
	assert_int_equal(kl_item(sum, &got), KL_OK);
	assert_true(got == 15.0);

	/* every table case, on a tensor of that size, eagerly */
	for (size_t i = 0; i < sizeof slices / sizeof slices[0]; i++) {
		kl_scope_begin(ctx);
		int64_t n = slices[i].size;
		kl_tensor *x = kl_arange(ctx, KL_F32, 0, (double)n, 1);
		kl_tensor *y = kl_slice(x, 0, slices[i].start, slices[i].stop, slices[i].step);
		assert_non_null(y);
		assert_int_equal(kl_shape(y)[0], slices[i].len);
		float w[8];
		assert_int_equal(kl_to_host(y, w, sizeof(float) * (size_t)slices[i].len), KL_OK);
		for (int64_t j = 0; j < slices[i].len; j++)
			assert_true(w[j] == (float)(slices[i].first + j * slices[i].step));
		kl_scope_end(ctx);
	}

	/* compiled: the kernel reads through the slice's index arithmetic */
	int64_t b[3] = {-3, INT64_MAX, INT64_MAX};
	kl_fn *f = kl_compile(ctx, slice_body, b, 1, 1, NULL);
	assert_non_null(f);
	kl_tensor *out = NULL;
	assert_int_equal(kl_fn_call(f, &a, &out), KL_OK);
	assert_int_equal(kl_shape(out)[0], 1);
	assert_int_equal(kl_to_host(out, v, sizeof v), KL_OK);
	for (int j = 0; j < 6; j++)
		assert_true(v[j] == (float)(2 * (6 + j)));
	kl_release(out);
	kl_fn_free(f);
	kl_ctx_free(ctx);
}

/* The reference refuses a slice node whose length does not follow from its
 * bounds (a forged node), without computing start + (len - 1) * step. */
static void test_reference_slice_node(void **state)
{
	(void)state;
	kl_graph g;
	kl__graph_init(&g);
	kl_node in = {.op = KL_OP_INPUT, .dtype = KL_F64, .ndim = 1, .shape = {4}, .strides = {1}};
	int32_t i0 = kl__graph_add(&g, &in);
	kl__graph_add_input(&g, i0);
	kl_node s = {.op = KL_OP_SLICE, .dtype = KL_F64, .ndim = 1, .nin = 1, .shape = {3}};
	s.a.v[0] = 0;
	s.a.v[1] = 4;
	s.a.v[2] = INT64_MAX; /* takes one element, not three */
	int32_t i1 = kl__graph_add(&g, &s);
	kl__graph_add_output(&g, i1);
	double xv[4] = {1, 2, 3, 4};
	const double *ins[1] = {xv};
	double *outs[1] = {NULL};
	char err[256];
	assert_int_equal(kl__ref_eval(&g, ins, outs, err, sizeof err), KL_EINVAL);
	assert_non_null(strstr(err, "slice 0:4:9223372036854775807"));
	/* the node as kl_slice makes it: [0, 1) by 1 */
	g.nodes[i1].shape[0] = 1;
	g.nodes[i1].a.v[1] = 1;
	g.nodes[i1].a.v[2] = 1;
	assert_int_equal(kl__ref_eval(&g, ins, outs, err, sizeof err), KL_OK);
	assert_true(outs[0][0] == 1.0);
	free(outs[0]);
	/* and an empty-looking shape with huge dims never reaches a loop */
	g.nodes[i1].shape[0] = 0;
	g.nodes[i0].ndim = 3;
	g.nodes[i0].shape[0] = 0;
	g.nodes[i0].shape[1] = P62;
	g.nodes[i0].shape[2] = P62;
	assert_int_equal(kl__ref_eval(&g, ins, outs, err, sizeof err), KL_EINVAL);
	assert_non_null(strstr(err, "multiply past 2^59"));
	kl__graph_free(&g);
}

/* ---- 4: the thread bound -------------------------------------------------------- */

static void test_ctx_nthreads_bound(void **state)
{
	(void)state;
	assert_null(kl_ctx_new(&(kl_ctx_opts){.nthreads = 65536}));
	expect_err(NULL, KL_EINVAL, "kl_ctx_new: nthreads 65536 is outside [0,1024]", NULL);
	assert_null(kl_ctx_new(&(kl_ctx_opts){.nthreads = KL_MAX_THREADS + 1}));
	expect_err(NULL, KL_EINVAL, "kl_ctx_new: nthreads 1025", NULL);
	assert_null(kl_ctx_new(&(kl_ctx_opts){.nthreads = -1}));
	expect_err(NULL, KL_EINVAL, "kl_ctx_new: nthreads -1", NULL);
	/* the bound itself works, ops included */
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.nthreads = KL_MAX_THREADS});
	assert_non_null(ctx);
	kl_tensor *x = kl_arange(ctx, KL_F32, 0, 1 << 16, 1);
	kl_tensor *y = kl_sum(kl_mul(x, x), 0, NULL, false);
	double v;
	assert_int_equal(kl_item(y, &v), KL_OK);
	assert_true(v > 9.3e13 && v < 9.4e13); /* sum of i^2, i < 65536: 9.3822e13 */
	kl_ctx_free(ctx);
}

/* ---- 5: kl_from_host's byte count ----------------------------------------------- */

static void test_from_host_nbytes(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	float v[6] = {1, 2, 3, 4, 5, 6};
	const int64_t sh[2] = {2, 3};
	assert_null(kl_from_host(ctx, KL_F32, 2, sh, v, 20));
	expect_err(ctx, KL_EINVAL, "kl_from_host: the buffer holds 20 bytes but f32 [2,3] needs 24",
	           NULL);
	assert_null(kl_from_host(ctx, KL_F32, 2, sh, v, 28));
	expect_err(ctx, KL_EINVAL, "kl_from_host: the buffer holds 28 bytes", NULL);
	assert_null(kl_from_host(ctx, KL_F64, 2, sh, v, sizeof v));
	expect_err(ctx, KL_EINVAL, "kl_from_host: the buffer holds 24 bytes but f64 [2,3] needs 48",
	           NULL);
	/* a short buffer on the heap: ASan would see any read past its end */
	float *shortbuf = malloc(5 * sizeof(float));
	assert_non_null(shortbuf);
	memcpy(shortbuf, v, 5 * sizeof(float));
	assert_null(kl_from_host(ctx, KL_F32, 2, sh, shortbuf, 5 * sizeof(float)));
	expect_err(ctx, KL_EINVAL, "kl_from_host: the buffer holds 20 bytes", NULL);
	free(shortbuf);
	size_t nb;
	assert_int_equal(kl_shape_nbytes(KL_BF16, 2, sh, &nb), KL_OK);
	assert_int_equal(nb, 12);
	kl_tensor *t = kl_from_host(ctx, KL_F32, 2, sh, v, sizeof v);
	assert_non_null(t);
	float back[6];
	assert_int_equal(kl_to_host(t, back, sizeof back), KL_OK);
	assert_memory_equal(back, v, sizeof v);
	assert_non_null(kl_from_host(ctx, KL_F32, 1, (int64_t[]){0}, NULL, 0));
	kl_ctx_free(ctx);
}

/* ---- 10: errors name the call made ---------------------------------------------- */

static size_t fail_above; /* allocations of more bytes than this fail */
static kl_backend failing;

static void *failing_alloc(kl_ctx *ctx, size_t nbytes)
{
	if (nbytes > fail_above) {
		kl__err(ctx, KL_ENOMEM, "cpu: out of memory allocating %zu bytes", nbytes);
		return NULL;
	}
	return kl__cpu_backend.alloc(ctx, nbytes);
}

static void test_errors_name_the_call(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	assert_null(kl_zeros(ctx, KL_F32, 2, (int64_t[]){2, -1}));
	expect_err(ctx, KL_EINVAL, "kl_zeros: shape [2,-1]: dim 1 is -1", NULL);
	assert_null(kl_zeros(NULL, KL_F32, 0, NULL));
	expect_err(NULL, KL_EINVAL, "kl_zeros: ctx is NULL", NULL);
	assert_null(kl_scalar(ctx, (kl_dtype)99, 1.0));
	expect_err(ctx, KL_EINVAL, "kl_scalar: unknown dtype 99", NULL);

	kl_tensor *w = arange_f32(ctx, 2, (int64_t[]){5, 3});
	kl_tensor *idx = kl_arange(ctx, KL_I64, 3, 7, 1); /* 3..6: 5 and 6 are out of range */
	assert_null(kl_embedding(idx, w));
	expect_err(ctx, KL_EINVAL, "kl_embedding: index 5 (element 2) out of range", NULL);
	kl_tensor *fidx = kl_arange(ctx, KL_F32, 0, 2, 1);
	assert_null(kl_embedding(fidx, w));
	expect_err(ctx, KL_EINVAL, "kl_embedding: indices have dtype f32", NULL);
	assert_null(kl_embedding(NULL, NULL));
	expect_err(NULL, KL_EINVAL, "kl_embedding: input", NULL);
	/* the frame ends with the call: the next error has its own name */
	assert_null(kl_gather(w, fidx));
	expect_err(ctx, KL_EINVAL, "kl_gather: indices have dtype f32", NULL);
	/* kl_linear is built on transpose, matmul and add */
	kl_tensor *x = arange_f32(ctx, 2, (int64_t[]){2, 3});
	assert_null(kl_linear(x, w, kl_zeros(ctx, KL_F32, 1, (int64_t[]){4})));
	expect_err(ctx, KL_EINVAL, "kl_linear: bias [4] does not match", NULL);
	/* a scalar op names its own public function, not the op it shares */
	assert_null(kl_add_scalar(NULL, 1.0));
	expect_err(NULL, KL_EINVAL, "kl_add_scalar: input 0 is NULL", NULL);

	/* out of memory: the op, the shape and the bytes */
	kl_tensor *b = arange_f32(ctx, 2, (int64_t[]){2, 3});
	kl_tensor *m = arange_f32(ctx, 2, (int64_t[]){3, 2});
	kl_tensor *bt = kl_transpose(m, 0, 1); /* a view: no allocation */
	assert_non_null(bt);
	failing = kl__cpu_backend;
	failing.alloc = failing_alloc;
	fail_above = 0;
	ctx->be = &failing;
	static const struct {
		const char *name;
		int which;
	} cases[] = {{"kl_empty", 0}, {"kl_zeros", 1}, {"kl_add", 2},      {"kl_mul", 3},
	             {"kl_matmul", 4}, {"kl_contiguous", 5}, {"kl_linear", 6}};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		kl_tensor *r = NULL;
		const char *what = "24 bytes for f32 [2,3]";
		switch (cases[i].which) {
		case 0: r = kl_empty(ctx, KL_F32, 2, (int64_t[]){2, 3}); break;
		case 1: r = kl_zeros(ctx, KL_F32, 2, (int64_t[]){2, 3}); break;
		case 2: r = kl_add(x, b); break;
		case 3: r = kl_mul(x, b); break;
		case 4:
			r = kl_matmul(x, m);
			what = "16 bytes for f32 [2,2]";
			break;
		case 5: r = kl_contiguous(bt); break;
		case 6:
			r = kl_linear(x, bt, NULL); /* bt is [2,3]: x @ bt^T is [2,2] */
			what = "16 bytes for f32 [2,2]";
			break;
		}
		assert_null(r);
		char want[128];
		snprintf(want, sizeof want, "%s: out of memory allocating %s", cases[i].name, what);
		expect_err(ctx, KL_ENOMEM, want, NULL);
	}
	ctx->be = &kl__cpu_backend;
	kl_ctx_free(ctx);
}

/* On a GPU: an allocation beyond the device's memory is KL_ENOMEM naming the
 * op, the shape and the bytes, never a crash (skipped without a device). */
static void test_cuda_oom_names_the_call(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = KL_CUDA});
	if (!ctx) {
		print_message("test_cuda_oom_names_the_call skipped: %s\n", kl_last_error(NULL));
		skip();
	}
	const int64_t huge[2] = {INT64_C(1) << 20, INT64_C(1) << 20}; /* 4 TiB of f32 */
	assert_null(kl_empty(ctx, KL_F32, 2, huge));
	expect_err(ctx, KL_ENOMEM,
	           "kl_empty: out of memory allocating 4398046511104 bytes for f32 "
	           "[1048576,1048576]",
	           NULL);
	kl_tensor *one = kl_zeros(ctx, KL_F32, 2, (int64_t[]){1, 1});
	kl_tensor *col = kl_expand(one, 2, (int64_t[]){INT64_C(1) << 20, 1});
	kl_tensor *row = kl_expand(one, 2, (int64_t[]){1, INT64_C(1) << 20});
	assert_null(kl_add(col, row));
	expect_err(ctx, KL_ENOMEM, "kl_add: out of memory allocating 4398046511104 bytes", NULL);
	assert_null(kl_zeros(ctx, KL_F32, 2, huge));
	expect_err(ctx, KL_ENOMEM, "kl_zeros: out of memory allocating", NULL);
	/* and the context still works */
	kl_tensor *x = kl_add_scalar(one, 2.0);
	double v;
	assert_int_equal(kl_item(x, &v), KL_OK);
	assert_true(v == 2.0);
	kl_ctx_free(ctx);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_shape_rule),
	        cmocka_unit_test(test_slice_len_matches_python),
	        cmocka_unit_test(test_empty_shape_huge_dims),
	        cmocka_unit_test(test_safetensors_empty_huge),
	        cmocka_unit_test(test_reshape_overflow),
	        cmocka_unit_test(test_slice_huge_step),
	        cmocka_unit_test(test_reference_slice_node),
	        cmocka_unit_test(test_ctx_nthreads_bound),
	        cmocka_unit_test(test_from_host_nbytes),
	        cmocka_unit_test(test_errors_name_the_call),
	        cmocka_unit_test(test_cuda_oom_names_the_call),
	};
	if (getenv("KILN_TEST_FILTER")) /* one test by name, as test_lower does */
		cmocka_set_test_filter(getenv("KILN_TEST_FILTER"));
	return cmocka_run_group_tests(tests, NULL, NULL);
}
