/* test_dynamic.c - dynamic dims (issue 23) on an ordinary GPT-2 block
 * (d 768, 12 heads, f32, CPU): the batch dim and then the sequence dim
 * dynamic run as one variant across 8 sizes with results equal to eager;
 * marking every dim dynamic specialises only the dims that must be static
 * (the hidden size meets the weights) and says so; kl_explain and the C API
 * report symbolic and specialised dims and every recompile's reason; the
 * recompile limit keeps compiled variants serving their shapes; bad
 * options are clear errors.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "capture/capture.h"
#include "kltest.h"

static kl_ctx *new_ctx(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	return ctx;
}

/* kl_explain's text (malloc'd) */
static char *explain_str(kl_fn *f)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *m = open_memstream(&buf, &len);
	assert_non_null(m);
	kl_status st = kl_explain(f, m);
	fclose(m);
	assert_int_equal(st, KL_OK);
	char *s = strdup(buf ? buf : "");
	free(buf);
	return s;
}

static char *capture_stderr(void (*fn)(void *), void *arg)
{
	fflush(stderr);
	char path[] = "/tmp/kiln-test-dynamic-XXXXXX";
	int fd = mkstemp(path);
	assert_true(fd >= 0);
	unlink(path);
	int saved = dup(2);
	dup2(fd, 2);
	fn(arg);
	fflush(stderr);
	dup2(saved, 2);
	close(saved);
	off_t n = lseek(fd, 0, SEEK_END);
	char *s = calloc((size_t)n + 1, 1);
	assert_int_equal(pread(fd, s, (size_t)n, 0), n);
	close(fd);
	return s;
}

/* ---- the GPT-2 block ---------------------------------------------------------------- */

typedef struct gpt2 {
	int64_t d, h;
	bool hand; /* attention written by hand (matmul, scale, softmax, matmul), not kl_sdpa */
	kl_tensor *ln1_w, *ln1_b, *w_qkv, *b_qkv, *w_o, *b_o, *ln2_w, *ln2_b, *w_fc, *b_fc, *w_pr,
	        *b_pr;
} gpt2;

static kl_tensor *param(kl_ctx *ctx, int ndim, const int64_t *shape, double scale, uint64_t seed)
{
	kl_tensor *r = kltest_rand(ctx, KL_F32, ndim, shape, KLTEST_NORMAL, KLTEST_CONTIG, seed);
	kl_tensor *t = kl_mul_scalar(r, scale);
	kl_release(r);
	assert_non_null(t);
	return t;
}

static void gpt2_init(gpt2 *m, kl_ctx *ctx, int64_t d, int64_t h)
{
	memset(m, 0, sizeof *m);
	m->d = d;
	m->h = h;
	double s = 1.0 / sqrt((double)d);
	m->ln1_w = param(ctx, 1, (int64_t[]){d}, 0.5, 11);
	m->ln1_b = param(ctx, 1, (int64_t[]){d}, 0.1, 12);
	m->w_qkv = param(ctx, 2, (int64_t[]){3 * d, d}, s, 13);
	m->b_qkv = param(ctx, 1, (int64_t[]){3 * d}, 0.1, 14);
	m->w_o = param(ctx, 2, (int64_t[]){d, d}, s, 15);
	m->b_o = param(ctx, 1, (int64_t[]){d}, 0.1, 16);
	m->ln2_w = param(ctx, 1, (int64_t[]){d}, 0.5, 17);
	m->ln2_b = param(ctx, 1, (int64_t[]){d}, 0.1, 18);
	m->w_fc = param(ctx, 2, (int64_t[]){4 * d, d}, s, 19);
	m->b_fc = param(ctx, 1, (int64_t[]){4 * d}, 0.1, 20);
	m->w_pr = param(ctx, 2, (int64_t[]){d, 4 * d}, 0.5 * s, 21);
	m->b_pr = param(ctx, 1, (int64_t[]){d}, 0.1, 22);
}

static void gpt2_free(gpt2 *m)
{
	kl_tensor *ts[] = {m->ln1_w, m->ln1_b, m->w_qkv, m->b_qkv, m->w_o,  m->b_o,
	                   m->ln2_w, m->ln2_b, m->w_fc,  m->b_fc,  m->w_pr, m->b_pr};
	for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
		kl_release(ts[i]);
}

/* [B, T, d] -> [B, h, T, d / h] */
static kl_tensor *heads(kl_tensor *qkv, int part, int64_t B, int64_t T, int64_t d, int64_t h)
{
	kl_tensor *s = kl_slice(qkv, 2, part * d, (part + 1) * d, 1);
	kl_tensor *r = kl_reshape(s, 4, (int64_t[]){B, T, h, d / h});
	return kl_permute(r, (int[]){0, 2, 1, 3});
}

/* x + attn(ln1(x)), then + mlp(ln2(.)): GPT-2's block, causal (kl_sdpa) or,
 * hand-written, without a mask */
static kl_tensor *gpt2_forward(const gpt2 *m, kl_tensor *x)
{
	int64_t B = kl_dim(x, 0), T = kl_dim(x, 1), d = m->d, h = m->h;
	kl_tensor *a = kl_layer_norm(x, m->ln1_w, m->ln1_b, 1e-5);
	kl_tensor *qkv = kl_linear(a, m->w_qkv, m->b_qkv);
	kl_tensor *q = heads(qkv, 0, B, T, d, h), *k = heads(qkv, 1, B, T, d, h),
	          *v = heads(qkv, 2, B, T, d, h);
	kl_tensor *o;
	if (m->hand) {
		kl_tensor *sc = kl_mul_scalar(kl_matmul(q, kl_transpose(k, 2, 3)),
		                              1.0 / sqrt((double)(d / h)));
		o = kl_matmul(kl_softmax(sc, -1), v);
	} else {
		o = kl_sdpa(q, k, v, true, KL_SDPA_DEFAULT_SCALE);
	}
	o = kl_reshape(kl_permute(o, (int[]){0, 2, 1, 3}), 3, (int64_t[]){B, T, d});
	kl_tensor *x1 = kl_add(x, kl_linear(o, m->w_o, m->b_o));
	kl_tensor *f = kl_linear(kl_layer_norm(x1, m->ln2_w, m->ln2_b, 1e-5), m->w_fc, m->b_fc);
	f = kl_linear(kl_gelu_tanh(f), m->w_pr, m->b_pr);
	return kl_add(x1, f);
}

static kl_status gpt2_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin;
	(void)nout;
	out[0] = gpt2_forward(user, in[0]);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

/* One call of f on x [B, T, d], compared with the same block run eagerly. */
static void check_call(kl_ctx *ctx, kl_fn *f, gpt2 *m, int64_t B, int64_t T, uint64_t seed)
{
	int64_t shape[3] = {B, T, m->d};
	kl_tensor *x = kltest_rand(ctx, KL_F32, 3, shape, KLTEST_NORMAL, KLTEST_CONTIG, seed);
	kl_tensor *out = NULL;
	kl_status st = kl_fn_call(f, &x, &out);
	if (st != KL_OK)
		fprintf(stderr, "kl_fn_call at B %lld T %lld: %s\n", (long long)B, (long long)T,
		        kl_last_error(ctx));
	assert_int_equal(st, KL_OK);
	kl_scope_begin(ctx);
	kl_tensor *ref = gpt2_forward(m, x);
	assert_non_null(ref);
	double *r = kltest_read(ref), *o = kltest_read(out);
	char what[64];
	snprintf(what, sizeof what, "gpt2 block B %lld T %lld", (long long)B, (long long)T);
	assert_true(kltest_compare(what, KL_F32, 3, shape, o, r, 20));
	free(r);
	free(o);
	kl_scope_end(ctx);
	kl_release(out);
	kl_release(x);
}

static const int64_t batch_sizes[8] = {2, 5, 1, 3, 8, 4, 7, 6};
static const int64_t seq_sizes[8] = {128, 33, 1, 64, 7, 100, 16, 2};

/* The block with dims `mask` of x dynamic over 8 sizes of dim `which`: one
 * variant, one compile, results equal to eager. */
static void run_sizes(kl_ctx *ctx, gpt2 *m, uint32_t mask, int which, int64_t fixed,
                      bool fullgraph)
{
	kl_fn *f = kl_compile(ctx, gpt2_body, m, 1, 1,
	                      &(kl_compile_opts){.fullgraph = fullgraph,
	                                         .ndynamic_dims = 1,
	                                         .dynamic_dims = (uint32_t[]){mask}});
	assert_non_null(f);
	for (int i = 0; i < 8; i++) {
		int64_t B = which == 0 ? batch_sizes[i] : fixed;
		int64_t T = which == 1 ? seq_sizes[i] : fixed;
		check_call(ctx, f, m, B, T, 100 + (uint64_t)i);
	}
	char *ex = explain_str(f);
	if (!strstr(ex, "variants: 1;") || !strstr(ex, "compiles: 1;"))
		fprintf(stderr, "%s", ex);
	assert_non_null(strstr(ex, "variants: 1;"));
	assert_non_null(strstr(ex, "compiles: 1;"));
	/* the plan keeps its library products and, with kl_sdpa, fused attention */
	assert_non_null(strstr(ex, "blas matmul"));
	assert_non_null(strstr(ex, "attn attention"));
	assert_null(strstr(ex, "generated, dynamic"));
	/* which dims are symbolic */
	assert_non_null(strstr(ex, which == 0 ? "input 0 dim 0: symbolic" : "input 0 dim 1: symbolic"));
	free(ex);
	kl_fn_free(f);
}

static void test_gpt2_batch_dynamic(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	gpt2 m;
	gpt2_init(&m, ctx, 768, 12);
	run_sizes(ctx, &m, 1u, 0, 32, false);
	gpt2_free(&m);
	kl_ctx_free(ctx);
}

static void test_gpt2_seq_dynamic(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	gpt2 m;
	gpt2_init(&m, ctx, 768, 12);
	run_sizes(ctx, &m, 2u, 1, 2, true);
	/* the same attention written by hand matches the fused step too */
	m.hand = true;
	run_sizes(ctx, &m, 2u, 1, 2, false);
	gpt2_free(&m);
	kl_ctx_free(ctx);
}

/* .dynamic = KL_DYNAMIC_ALL on the block: the hidden size meets the weights
 * and is specialised, batch and sequence stay symbolic (one variant over
 * three sequence lengths and two batch sizes), and kl_explain says which
 * and why. */
static void test_gpt2_all_dynamic(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	gpt2 m;
	gpt2_init(&m, ctx, 768, 12);
	kl_fn *f = kl_compile(ctx, gpt2_body, &m, 1, 1,
	                      &(kl_compile_opts){.dynamic = KL_DYNAMIC_ALL});
	assert_non_null(f);
	check_call(ctx, f, &m, 2, 128, 1);
	check_call(ctx, f, &m, 2, 64, 2);
	check_call(ctx, f, &m, 2, 17, 3);
	check_call(ctx, f, &m, 3, 17, 4);
	char *ex = explain_str(f);
	if (!strstr(ex, "variants: 1;"))
		fprintf(stderr, "%s", ex);
	assert_non_null(strstr(ex, "variants: 1;"));
	assert_non_null(strstr(ex, "input 0 dim 0: symbolic"));
	assert_non_null(strstr(ex, "input 0 dim 1: symbolic"));
	assert_non_null(strstr(ex, "input 0 dim 2: specialised to 768"));
	assert_null(strstr(ex, "every input dim"));
	free(ex);
	kl_fn_free(f);
	gpt2_free(&m);
	kl_ctx_free(ctx);
}

/* ---- a small function: sizes 0 and 1, the limit, the API ---------------------------- */

typedef struct small {
	kl_tensor *w, *b; /* [16, 24], [16] */
} small;

/* softmax(x @ w^T + b) * 2, layer-normed rows: a product, a row kernel, a pointwise one */
static kl_tensor *small_forward(const small *m, kl_tensor *x)
{
	kl_tensor *y = kl_softmax(kl_linear(x, m->w, m->b), -1);
	return kl_mul_scalar(kl_layer_norm(y, NULL, NULL, 1e-5), 2);
}

static kl_status small_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                            int nout, void *user)
{
	(void)nin;
	(void)nout;
	out[0] = small_forward(user, in[0]);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static void small_call(kl_ctx *ctx, kl_fn *f, small *m, int64_t rows, uint64_t seed)
{
	int64_t shape[2] = {rows, 24};
	kl_tensor *x = kltest_rand(ctx, KL_F32, 2, shape, KLTEST_NORMAL, KLTEST_CONTIG, seed);
	kl_tensor *out = NULL;
	assert_int_equal(kl_fn_call(f, &x, &out), KL_OK);
	assert_int_equal(kl_dim(out, 0), rows);
	kl_scope_begin(ctx);
	kl_tensor *ref = small_forward(m, x);
	double *r = kltest_read(ref), *o = kltest_read(out);
	assert_true(kltest_compare("small", KL_F32, 2, (int64_t[]){rows, 16}, o, r, 10));
	free(r);
	free(o);
	kl_scope_end(ctx);
	kl_release(out);
	kl_release(x);
}

static void small_init(small *m, kl_ctx *ctx)
{
	m->w = param(ctx, 2, (int64_t[]){16, 24}, 0.3, 31);
	m->b = param(ctx, 1, (int64_t[]){16}, 0.1, 32);
}

/* A dim traced at 6 serves 0, 1 and others from the same variant and the
 * same compiled graph, fullgraph or not. */
static void test_sizes_0_and_1(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	small m;
	small_init(&m, ctx);
	for (int full = 0; full < 2; full++) {
		kl_fn *f = kl_compile(ctx, small_body, &m, 1, 1,
		                      &(kl_compile_opts){.fullgraph = full,
		                                         .ndynamic_dims = 1,
		                                         .dynamic_dims = (uint32_t[]){KL_DIM(0)}});
		const int64_t rows[6] = {6, 0, 1, 9, 1, 0};
		for (int i = 0; i < 6; i++)
			small_call(ctx, f, &m, rows[i], 40 + (uint64_t)i);
		kl_fn_stats st;
		assert_int_equal(kl_fn_get_stats(f, &st), KL_OK);
		assert_int_equal(st.calls, 6);
		assert_int_equal(st.compiles, 1);
		assert_int_equal(st.recompiles, 0);
		assert_int_equal(st.variants, 1);
		assert_int_equal(st.eager_calls, 0);
		assert_null(kl_fn_recompile_reason(f, 0));
		kl_dim_state ds;
		const char *why = NULL;
		assert_int_equal(kl_fn_dim_state(f, 0, 0, 0, &ds, &why), KL_OK);
		assert_int_equal(ds, KL_DIM_SYMBOLIC);
		assert_string_equal(why, "");
		assert_int_equal(kl_fn_dim_state(f, 0, 0, 1, &ds, NULL), KL_OK);
		assert_int_equal(ds, KL_DIM_STATIC);
		kl_fn_free(f);
	}
	kl_release(m.w);
	kl_release(m.b);
	kl_ctx_free(ctx);
}

/* The hidden size marked dynamic meets the weight: specialised alone, with
 * its reason in kl_fn_dim_state and kl_explain; the batch stays symbolic. */
static void test_specialised_reason(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	small m;
	small_init(&m, ctx);
	kl_fn *f = kl_compile(ctx, small_body, &m, 1, 1,
	                      &(kl_compile_opts){.ndynamic_dims = 1,
	                                         .dynamic_dims = (uint32_t[]){KL_DIM(0) | KL_DIM(1)}});
	small_call(ctx, f, &m, 5, 1);
	small_call(ctx, f, &m, 3, 2);
	kl_dim_state ds;
	const char *why = NULL;
	assert_int_equal(kl_fn_dim_state(f, 0, 0, 0, &ds, &why), KL_OK);
	assert_int_equal(ds, KL_DIM_SYMBOLIC);
	assert_int_equal(kl_fn_dim_state(f, 0, 0, 1, &ds, &why), KL_OK);
	assert_int_equal(ds, KL_DIM_SPECIALIZED);
	assert_non_null(strstr(why, "static dim of a f32 [16,24] tensor"));
	char *ex = explain_str(f);
	assert_non_null(strstr(ex, "input 0 dim 0: symbolic"));
	assert_non_null(strstr(ex, "input 0 dim 1: specialised to 24: it meets a static dim"));
	free(ex);
	/* bad arguments name the call */
	assert_int_equal(kl_fn_dim_state(f, 1, 0, 0, &ds, &why), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "kl_fn_dim_state"));
	assert_non_null(strstr(kl_last_error(ctx), "variant 1"));
	assert_int_equal(kl_fn_dim_state(f, 0, 0, 2, &ds, &why), KL_EINVAL);
	assert_int_equal(kl_fn_dim_state(NULL, 0, 0, 0, &ds, &why), KL_EINVAL);
	assert_int_equal(kl_fn_get_stats(f, NULL), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "kl_fn_get_stats: out is NULL"));
	kl_fn_free(f);
	kl_release(m.w);
	kl_release(m.b);
	kl_ctx_free(ctx);
}

typedef struct limit_args {
	kl_ctx *ctx;
	kl_fn *f;
	small *m;
} limit_args;

static void limit_calls(void *p)
{
	limit_args *a = p;
	/* limit 2: rows 4 and 5 compile, 6 and 7 run eagerly, 4 and 5 again
	 * replay their compiled variants */
	const int64_t rows[6] = {4, 5, 6, 4, 7, 5};
	for (int i = 0; i < 6; i++)
		small_call(a->ctx, a->f, a->m, rows[i], 60 + (uint64_t)i);
}

static void test_recompile_limit(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	small m;
	small_init(&m, ctx);
	for (int full = 0; full < 2; full++) {
		kl_fn *f = kl_compile(ctx, small_body, &m, 1, 1,
		                      &(kl_compile_opts){.fullgraph = full, .recompile_limit = 2});
		limit_args a = {ctx, f, &m};
		char *log = capture_stderr(limit_calls, &a);
		const char *w = strstr(log, "kiln: warning: ");
		assert_non_null(w);
		assert_null(strstr(w + 1, "kiln: warning: "));
		assert_non_null(strstr(w, "guard 'input 0 dim 0' kept failing"));
		assert_non_null(strstr(w, "kl_compile_opts.dynamic_dims[0] |= 1u << 0"));
		assert_non_null(strstr(w, "compiled variants keep serving their shapes"));
		free(log);
		kl_fn_stats st;
		assert_int_equal(kl_fn_get_stats(f, &st), KL_OK);
		assert_true(st.over_limit);
		assert_int_equal(st.compiles, 2);
		assert_int_equal(st.recompiles, 1);
		assert_int_equal(st.variants, 2);
		assert_int_equal(st.eager_calls, 2); /* rows 6 and 7 only */
		assert_int_equal(st.calls, 6);
		if (full)
			assert_int_equal(st.replays, 2); /* rows 4 and 5 again */
		const char *r = kl_fn_recompile_reason(f, 0);
		assert_non_null(r);
		assert_non_null(strstr(r, "input 0 dim 0: 4 -> 5"));
		assert_non_null(strstr(r, "dynamic_dims[0] |= 1u << 0"));
		assert_null(kl_fn_recompile_reason(f, 1));
		assert_null(kl_fn_recompile_reason(f, -1));
		/* a compiled shape after the limit still launches its plan's steps,
		 * not one kernel per op */
		small_call(ctx, f, &m, 4, 70);
		int compiled = kl_fn_last_kernels(f);
		small_call(ctx, f, &m, 6, 71);
		int eager = kl_fn_last_kernels(f);
		assert_true(compiled >= 1 && compiled < eager);
		assert_int_equal(kl_fn_get_stats(f, &st), KL_OK);
		assert_int_equal(st.eager_calls, 3);
		assert_int_equal(st.compiles, 2);
		kl_fn_free(f);
	}
	kl_release(m.w);
	kl_release(m.b);
	kl_ctx_free(ctx);
}

static void test_option_errors(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	small m = {0};
	/* .dynamic = 1: refused, saying what to write and which bit is which */
	assert_null(kl_compile(ctx, small_body, &m, 1, 1, &(kl_compile_opts){.dynamic = 1}));
	assert_int_equal(kl_last_status(ctx), KL_EINVAL);
	const char *e = kl_last_error(ctx);
	assert_non_null(strstr(e, "kl_compile: dynamic is 1"));
	assert_non_null(strstr(e, "KL_DYNAMIC_ALL"));
	assert_non_null(strstr(e, "bit d = dim d"));
	assert_non_null(strstr(e, "dynamic_dims"));
	assert_null(kl_compile(ctx, small_body, &m, 1, 1,
	                       &(kl_compile_opts){.ndynamic_dims = 1,
	                                          .dynamic_dims = (uint32_t[]){1u << 9}}));
	assert_non_null(strstr(kl_last_error(ctx), "dim >= 8"));
	assert_null(kl_compile(ctx, small_body, &m, 1, 1,
	                       &(kl_compile_opts){.ndynamic_dims = 2,
	                                          .dynamic_dims = (uint32_t[]){1, 1}}));
	assert_non_null(strstr(kl_last_error(ctx), "ndynamic_dims"));
	assert_null(kl_compile(ctx, small_body, &m, 1, 1,
	                       &(kl_compile_opts){.ndynamic_dims = 1}));
	assert_non_null(strstr(kl_last_error(ctx), "dynamic_dims set"));
	kl_ctx_free(ctx);
}

/* Where the user's own code fixes the dim (a kl_arange of the traced
 * length), the dim is specialised with that reason, in the user's words:
 * never an internal node name, never a failed call. */
typedef struct pos_args {
	kl_tensor *w; /* [8] */
} pos_args;

static kl_tensor *pos_forward(const pos_args *p, kl_tensor *x)
{
	kl_ctx *ctx = kl_tensor_ctx(x);
	int64_t T = kl_dim(x, 1);
	kl_tensor *pos = kl_reshape(kl_arange(ctx, KL_F32, 0, (double)T, 1), 2,
	                            (int64_t[]){T, 1});
	return kl_add(kl_mul(x, p->w), pos);
}

static kl_status pos_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin;
	(void)nout;
	out[0] = pos_forward(user, in[0]);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static void test_user_static_reason(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	pos_args p = {param(ctx, 1, (int64_t[]){8}, 1, 5)};
	kl_fn *f = kl_compile(ctx, pos_body, &p, 1, 1,
	                      &(kl_compile_opts){.ndynamic_dims = 1,
	                                         .dynamic_dims = (uint32_t[]){KL_DIM(0) | KL_DIM(1)}});
	for (int i = 0; i < 3; i++) {
		int64_t shape[3] = {2 + i, 5, 8};
		kl_tensor *x = kltest_rand(ctx, KL_F32, 3, shape, KLTEST_NORMAL, KLTEST_CONTIG, 7);
		kl_tensor *out;
		assert_int_equal(kl_fn_call(f, &x, &out), KL_OK);
		kl_scope_begin(ctx);
		double *r = kltest_read(pos_forward(&p, x)), *o = kltest_read(out);
		assert_true(kltest_compare("pos", KL_F32, 3, shape, o, r, 1));
		free(r);
		free(o);
		kl_scope_end(ctx);
		kl_release(out);
		kl_release(x);
	}
	kl_fn_stats st;
	assert_int_equal(kl_fn_get_stats(f, &st), KL_OK);
	assert_int_equal(st.variants, 1); /* the batch stayed symbolic */
	kl_dim_state ds;
	const char *why;
	assert_int_equal(kl_fn_dim_state(f, 0, 0, 1, &ds, &why), KL_OK);
	assert_int_equal(ds, KL_DIM_SPECIALIZED);
	assert_non_null(strstr(why, "kl_arange"));
	assert_non_null(strstr(why, "a number fn passed"));
	assert_null(strstr(why, "#"));
	assert_int_equal(kl_fn_dim_state(f, 0, 0, 0, &ds, &why), KL_OK);
	assert_int_equal(ds, KL_DIM_SYMBOLIC);
	kl_fn_free(f);
	kl_release(p.w);
	kl_ctx_free(ctx);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_gpt2_batch_dynamic),
	        cmocka_unit_test(test_gpt2_seq_dynamic),
	        cmocka_unit_test(test_gpt2_all_dynamic),
	        cmocka_unit_test(test_sizes_0_and_1),
	        cmocka_unit_test(test_specialised_reason),
	        cmocka_unit_test(test_recompile_limit),
	        cmocka_unit_test(test_option_errors),
	        cmocka_unit_test(test_user_static_reason),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
