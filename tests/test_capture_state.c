/* test_capture_state.c - what a compiled function does with the program's
 * state around it (issue 18): tensors reached through user state and
 * replaced or written in place between calls (with and without fullgraph,
 * in every CPU mode); scopes inside a function with a graph break (the plan
 * and its kernel count stay those of the same body without scopes);
 * kl_explain after a failed first call; kl_ctx_synchronize; a cache
 * directory open to others, refused with one warning.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/core.h"
#include "kltest.h"
#include "runtime/compiled.h"

static kl_ctx *new_ctx(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	return ctx;
}

/* Run fn(arg) with stderr captured into a malloc'd string. */
static char *capture_stderr(void (*fn)(void *), void *arg)
{
	fflush(stderr);
	char path[] = "/tmp/kiln-test-state-XXXXXX";
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

/* noinline: once inlined, GCC takes open_memstream's buffer for a dangling local */
__attribute__((noinline)) static char *explain_str(kl_fn *f)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *m = open_memstream(&buf, &len);
	assert_int_equal(kl_explain(f, m), KL_OK);
	fclose(m);
	return buf;
}

/* every element of t equals want (within f32 rounding of want) */
static void expect_all(kl_tensor *t, double want, const char *what)
{
	assert_non_null(t);
	double *v = kltest_read(t);
	assert_non_null(v);
	for (int64_t i = 0; i < kl_numel(t); i++)
		if (!(fabs(v[i] - want) <= 1e-6 * (1 + fabs(want))))
			fail_msg("%s: element %lld is %.9g, want %.9g", what, (long long)i, v[i],
			         want);
	free(v);
}

/* ---- tensors reached through user state (item 2) -------------------------------- */

typedef struct params {
	kl_tensor *w;
	int traces; /* how many times fn ran */
} params;

static kl_status body_scaled(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                             int nout, void *user)
{
	(void)nin;
	(void)nout;
	params *p = user;
	p->traces++;
	out[0] = kl_mul(in[0], p->w);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

typedef struct scaled_call {
	kl_fn *f;
	kl_tensor *x, *out;
	kl_status st;
} scaled_call;

static void call_scaled(void *p)
{
	scaled_call *c = p;
	c->out = NULL;
	c->st = kl_fn_call(c->f, &c->x, &c->out);
}

/* Call f on x with the recompiles log captured; out = x * w must equal want
 * everywhere. Returns the log. */
static char *expect_call(scaled_call *c, double want, const char *what)
{
	kl_ctx *ctx = kl_tensor_ctx(c->x);
	unsigned saved = ctx->logs;
	ctx->logs |= KL_LOG_RECOMPILES;
	char *log = capture_stderr(call_scaled, c);
	ctx->logs = saved;
	if (c->st != KL_OK)
		fail_msg("%s: %s", what, kl_last_error(ctx));
	expect_all(c->out, want, what);
	kl_release(c->out);
	return log;
}

/* out = x * p->w with x all 1s: the result shows which weight was used. */
static void check_user_weights(kl_ctx *ctx, const kl_compile_opts *o, const char *mode)
{
	char what[128];
	int64_t n4[1] = {4}, n5[1] = {5};
	params p = {.w = kl_full(ctx, KL_F32, 1, n4, 2)};
	scaled_call c = {.f = kl_compile(ctx, body_scaled, &p, 1, 1, o),
	                 .x = kl_full(ctx, KL_F32, 1, n4, 1)};
	assert_non_null(c.f);
	snprintf(what, sizeof what, "%s: first call", mode);
	free(expect_call(&c, 2, what));
	snprintf(what, sizeof what, "%s: second call", mode);
	free(expect_call(&c, 2, what));
	int traces = p.traces;
	if (o->fullgraph)
		assert_int_equal(traces, 1); /* replayed: fn did not run */

	/* the weight replaced by a new tensor of 3s: the next call sees it */
	kl_release(p.w);
	p.w = kl_full(ctx, KL_F32, 1, n4, 3);
	long compiles = kl__jit_compiles();
	snprintf(what, sizeof what, "%s: weight replaced", mode);
	char *log = expect_call(&c, 3, what);
	assert_int_equal(kl__jit_compiles(), compiles); /* same graph: no compile */
	if (o->fullgraph) {
		assert_non_null(strstr(log, "captured tensor 0 (f32 [4], reached through user state) "
		                            "is no longer held by the program: tracing fn again"));
		assert_non_null(strstr(log, "the same graph, its plan re-bound"));
	}
	free(log);
	/* and replays again from then on */
	traces = p.traces;
	snprintf(what, sizeof what, "%s: after the replacement", mode);
	free(expect_call(&c, 3, what));
	if (o->fullgraph)
		assert_int_equal(p.traces, traces);

	/* written in place: 5s through kl_copy (a broadcast scalar) */
	kl_tensor *five = kl_scalar(ctx, KL_F64, 5);
	assert_int_equal(kl_copy(p.w, five), KL_OK);
	kl_release(five);
	snprintf(what, sizeof what, "%s: weight written in place", mode);
	log = expect_call(&c, 5, what);
	if (o->fullgraph)
		assert_non_null(strstr(log, "was written in place (version 0 -> 1): tracing fn "
		                            "again"));
	free(log);
	/* through a view of it: half of the weight becomes 7 */
	kl_tensor *half = kl_slice(p.w, 0, 2, 4, 1), *seven = kl_scalar(ctx, KL_F32, 7);
	assert_int_equal(kl_copy(half, seven), KL_OK);
	kl_release(half);
	kl_release(seven);
	snprintf(what, sizeof what, "%s: weight written through a view", mode);
	c.st = KL_ESTATE;
	call_scaled(&c);
	assert_int_equal(c.st, KL_OK);
	double *v = kltest_read(c.out);
	assert_true(v[0] == 5 && v[1] == 5 && v[2] == 7 && v[3] == 7);
	free(v);
	kl_release(c.out);

	/* replaced by one of another shape: x broadcasts against [5,4]... here
	 * x is [4] and w [5,4]: a recompile, logged with the graph diff */
	kl_release(p.w);
	p.w = kl_full(ctx, KL_F32, 2, (int64_t[]){5, 4}, 6);
	snprintf(what, sizeof what, "%s: weight of another shape", mode);
	log = expect_call(&c, 6, what);
	if (o->fullgraph) {
		assert_non_null(strstr(log, "is no longer held by the program"));
		assert_non_null(strstr(log, "recompile #2 of "));
		assert_non_null(strstr(log, "its graph changed and was recompiled"));
	}
	free(log);
	(void)n5;
	kl_fn_free(c.f);
	/* the function held the old weights only while it lived: all released */
	kl_release(p.w);
	kl_release(c.x);
}

static void test_user_weights(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	check_user_weights(ctx, &(kl_compile_opts){.fullgraph = true}, "fullgraph");
	check_user_weights(ctx, &(kl_compile_opts){0}, "default");
	check_user_weights(ctx, &(kl_compile_opts){.fullgraph = true, .mode = KL_MODE_REDUCE_OVERHEAD},
	                   "fullgraph reduce-overhead");
	check_user_weights(ctx, &(kl_compile_opts){.mode = KL_MODE_REDUCE_OVERHEAD},
	                   "reduce-overhead");
	kl_memory_usage mu;
	assert_int_equal(kl_memory_stats(ctx, &mu), KL_OK);
	assert_int_equal(mu.in_use, 0);
	kl_ctx_free(ctx);
}

/* the fullgraph guard counts the program's references, not the functions':
 * two compiled functions sharing a weight both see it replaced */
static void test_shared_weight(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	int64_t n4[1] = {4};
	params p = {.w = kl_full(ctx, KL_F32, 1, n4, 2)};
	kl_compile_opts o = {.fullgraph = true};
	scaled_call a = {.f = kl_compile(ctx, body_scaled, &p, 1, 1, &o),
	                 .x = kl_full(ctx, KL_F32, 1, n4, 1)};
	scaled_call b = {.f = kl_compile(ctx, body_scaled, &p, 1, 1, &o), .x = a.x};
	free(expect_call(&a, 2, "a"));
	free(expect_call(&b, 2, "b"));
	kl_release(p.w);
	p.w = kl_full(ctx, KL_F32, 1, n4, 3);
	free(expect_call(&a, 3, "a after the replacement"));
	free(expect_call(&b, 3, "b after the replacement"));
	kl_fn_free(a.f);
	kl_fn_free(b.f);
	kl_release(p.w);
	kl_release(a.x);
	kl_ctx_free(ctx);
}

/* kl_copy: broadcasting, casting, strided destinations, overlap, errors */
static void test_copy(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	int64_t s23[2] = {2, 3};
	kl_tensor *d = kl_zeros(ctx, KL_F32, 2, s23);
	kl_tensor *row = kl_arange(ctx, KL_I64, 0, 3, 1);
	assert_int_equal(kl_copy(d, row), KL_OK); /* [3] i64 -> [2,3] f32 */
	double *v = kltest_read(d);
	for (int i = 0; i < 6; i++)
		assert_true(v[i] == i % 3);
	free(v);
	/* into a transposed view: d^T = [[0,1],[2,3],[4,5]] */
	kl_tensor *t = kl_transpose(d, 0, 1);
	kl_tensor *src = kl_reshape(kl_arange(ctx, KL_F32, 0, 6, 1), 2, (int64_t[]){3, 2});
	assert_int_equal(kl_copy(t, src), KL_OK);
	v = kltest_read(d);
	const double want[6] = {0, 2, 4, 1, 3, 5};
	for (int i = 0; i < 6; i++)
		assert_true(v[i] == want[i]);
	free(v);
	/* src overlapping dst: d = d^T^T of a copy made first, d[0] <- d[1] */
	kl_tensor *r0 = kl_slice(d, 0, 0, 1, 1), *r1 = kl_slice(d, 0, 1, 2, 1);
	assert_int_equal(kl_copy(r0, r1), KL_OK);
	v = kltest_read(d);
	for (int i = 0; i < 3; i++)
		assert_true(v[i] == v[i + 3]);
	free(v);
	/* errors name the call, the shapes and the reason; nothing is written */
	kl_tensor *bad = kl_zeros(ctx, KL_F32, 1, (int64_t[]){4});
	assert_int_equal(kl_copy(d, bad), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "kl_copy: src [4] does not broadcast to dst [2,3]"));
	kl_tensor *ex = kl_expand(kl_zeros(ctx, KL_F32, 2, (int64_t[]){1, 3}), 2, s23);
	assert_int_equal(kl_copy(ex, d), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "repeats elements"));
	assert_int_equal(kl_copy(NULL, d), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "kl_copy: dst is NULL"));
	kl_tensor *all[8] = {d, row, t, src, r0, r1, bad, ex};
	for (int i = 0; i < 8; i++)
		kl_release(all[i]);
	kl_ctx_free(ctx);
}

/* kl_copy inside a compiled function: w = x (recorded), then fn reads w
 * (the new value: out[0] = w * 2), and with how == 1 a view of w's memory
 * (an error: it would see the old value); how == 2 breaks the graph after
 * the write (kl_item), which lands then, and writes w again after it */
typedef struct copy_body {
	params p;
	kl_tensor *view; /* how == 1: a view of w's memory made before the call */
	int how;
	double seen; /* how == 2: the value kl_item read after the break */
} copy_body;

static kl_status body_copy_inside(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                  int nout, void *user)
{
	(void)nin;
	(void)nout;
	copy_body *b = user;
	kl_status st = kl_copy(b->p.w, in[0]);
	if (st != KL_OK)
		return st;
	if (b->how == 1)
		out[0] = kl_neg(b->view);
	else if (b->how == 2) {
		st = kl_item(kl_sum(b->p.w, 0, NULL, false), &b->seen);
		if (st == KL_OK)
			st = kl_copy(b->p.w, kl_mul_scalar(b->p.w, 3.0));
		out[0] = kl_mul_scalar(b->p.w, 2.0);
	} else {
		out[0] = kl_mul_scalar(b->p.w, 2.0);
	}
	return st != KL_OK ? st : out[0] ? KL_OK : kl_last_status(ctx);
}

static void test_copy_inside_compiled(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	for (int fg = 0; fg < 2; fg++) {
		copy_body b = {.p = {.w = kl_zeros(ctx, KL_F32, 1, (int64_t[]){4})}};
		kl_fn *f = kl_compile(ctx, body_copy_inside, &b, 1, 1,
		                      &(kl_compile_opts){.fullgraph = fg == 1});
		for (int call = 1; call <= 3; call++) {
			kl_tensor *x = kl_full(ctx, KL_F32, 1, (int64_t[]){4}, call), *out = NULL;
			assert_int_equal(kl_fn_call(f, &x, &out), KL_OK);
			expect_all(b.p.w, call, "w after the call: x written into it");
			expect_all(out, 2.0 * call, "fn read w after its write: the new value");
			kl_release(out);
			kl_release(x);
		}
		/* the same graph each call: compiled once; fullgraph replays it
		 * without fn, repeating the write */
		char *ex = explain_str(f);
		assert_non_null(strstr(ex, "compiles: 1;"));
		assert_non_null(strstr(ex, fg ? "(2 replayed" : "(0 replayed"));
		free(ex);
		/* a view overlapping what was written, read after the write (a
		 * new function: a replay would not see how change in user) */
		kl_fn_free(f);
		f = kl_compile(ctx, body_copy_inside, &b, 1, 1, &(kl_compile_opts){.fullgraph = fg == 1});
		b.how = 1;
		b.view = kl_slice(b.p.w, 0, 1, 3, 1);
		kl_tensor *x = kl_full(ctx, KL_F32, 1, (int64_t[]){4}, 7), *out = NULL;
		assert_int_equal(kl_fn_call(f, &x, &out), KL_EINVAL);
		assert_non_null(strstr(kl_last_error(ctx), "kl_neg: a tensor (f32 [2]) that shares "
		                                           "memory with one kl_copy wrote"));
		expect_all(b.p.w, 3, "a failed call writes nothing");
		kl_release(x);
		kl_release(b.view);
		kl_fn_free(f);
		kl_release(b.p.w);
	}
	/* a graph break lands the writes before it; the next graph reads them */
	copy_body b = {.p = {.w = kl_zeros(ctx, KL_F32, 1, (int64_t[]){4})}, .how = 2};
	kl_fn *f = kl_compile(ctx, body_copy_inside, &b, 1, 1, NULL);
	kl_tensor *x = kl_full(ctx, KL_F32, 1, (int64_t[]){4}, 2), *out = NULL;
	assert_int_equal(kl_fn_call(f, &x, &out), KL_OK);
	assert_true(b.seen == 8.0);
	expect_all(b.p.w, 6, "w = 3 * x after the break");
	expect_all(out, 12, "out = 2 * w");
	kl_release(out);
	kl_fn_free(f);
	kl_release(x);
	kl_release(b.p.w);
	kl_ctx_free(ctx);
}

/* ---- scopes inside a function with a graph break (item 5) --------------------------- */

enum { NO_SCOPE, SCOPE_ACROSS_BREAK, SCOPE_BEFORE_BREAK, USE_AFTER, KEEP, PRODUCT };

typedef struct scoped_body {
	int how;
	double total;
	kl_tensor *kept; /* KEEP: a tensor fn retains for after the call */
} scoped_body;

/* y = relu(a*b + c); kl_item(mean(y)) breaks the graph; then a result that
 * reads y (USE_AFTER, KEEP) or not */
static kl_status body_scoped(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                             int nout, void *user)
{
	(void)nin;
	(void)nout;
	scoped_body *b = user;
	if (b->how == SCOPE_ACROSS_BREAK || b->how == SCOPE_BEFORE_BREAK)
		kl_scope_begin(ctx);
	kl_tensor *y = kl_relu(kl_add(kl_mul(in[0], in[1]), in[2]));
	kl_tensor *m = kl_mean(y, 0, NULL, false);
	if (b->how == SCOPE_BEFORE_BREAK) {
		kl_retain(m);
		kl_scope_end(ctx);
	}
	if (b->how == KEEP)
		b->kept = kl_retain(kl_exp(y));
	kl_status st = kl_item(m, &b->total);
	if (b->how == SCOPE_BEFORE_BREAK)
		kl_release(m);
	if (b->how == SCOPE_ACROSS_BREAK)
		kl_scope_end(ctx);
	if (st != KL_OK)
		return st;
	out[0] = b->how == USE_AFTER || b->how == KEEP ? kl_mul_scalar(y, b->total)
	                                               : kl_mul_scalar(in[0], b->total);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static kl_tensor *apply_y(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_relu(kl_add(kl_mul(in[0], in[1]), in[2]));
}

static kl_tensor *apply_after(kl_tensor *const *in, const void *p)
{
	const scoped_body *b = p;
	kl_tensor *base = b->how == USE_AFTER || b->how == KEEP ? apply_y(in, NULL) : in[0];
	return kl_mul_scalar(base, b->total);
}

static kl_tensor *apply_mean_y(kl_tensor *const *in, const void *p)
{
	return kl_mean(apply_y(in, p), 0, NULL, false);
}

static kl_tensor *apply_exp_y(kl_tensor *const *in, const void *p)
{
	return kl_exp(apply_y(in, p));
}

static void check_values(kl_ctx *ctx, kl_tensor *t, kltest_apply_fn apply, kl_tensor *const *in,
                         const void *p, const char *what)
{
	int nd;
	int64_t shape[KL_MAX_DIMS];
	kl_dtype dt;
	double *ref = kltest_reference(ctx, what, apply, in, p, &nd, shape, &dt);
	double *got = kltest_read(t);
	assert_non_null(ref);
	assert_non_null(got);
	assert_int_equal(kl_numel(t), kl__numel(nd, shape));
	assert_true(kltest_compare(what, dt, nd, shape, got, ref, 4));
	free(ref);
	free(got);
}

static int call_scoped(kl_ctx *ctx, kl_tensor *const *in, scoped_body *b, char **explain)
{
	kl_fn *f = kl_compile(ctx, body_scoped, b, 3, 1, NULL);
	kl_tensor *out = NULL;
	assert_int_equal(kl_fn_call(f, in, &out), KL_OK);
	int kernels = kl_fn_last_kernels(f);
	/* the item saw mean(y), the result is what the body says */
	kl_tensor *m = kl_scalar(ctx, KL_F64, b->total);
	check_values(ctx, m, apply_mean_y, in, b, "the mean kl_item read");
	kl_release(m);
	check_values(ctx, out, apply_after, in, b, "the result after the break");
	kl_release(out);
	*explain = explain_str(f);
	kl_fn_free(f);
	return kernels;
}

static void test_scopes_across_a_break(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	int64_t shape[2] = {64, 96};
	kl_tensor *in[3];
	for (int i = 0; i < 3; i++)
		in[i] = kltest_rand(ctx, KL_F32, 2, shape, KLTEST_NORMAL, KLTEST_CONTIG, 90 + (uint64_t)i);
	char *ex;
	/* whether or where fn opens a scope, the plan is the same: graph 0 one
	 * kernel (relu(a*b+c) and its mean, nothing else written), graph 1 one */
	const int hows[3] = {NO_SCOPE, SCOPE_ACROSS_BREAK, SCOPE_BEFORE_BREAK};
	for (int h = 0; h < 3; h++) {
		scoped_body b = {.how = hows[h]};
		int kernels = call_scoped(ctx, in, &b, &ex);
		if (kernels != 2)
			fail_msg("scopes case %d: %d kernels, want 2:\n%s", h, kernels, ex);
		assert_non_null(strstr(ex, "graph 0: 4 ops, ended by a graph break: kl_item"));
		assert_non_null(strstr(ex, "outputs 4 B)")); /* graph 0 writes only the mean */
		free(ex);
	}
	/* y used after the break: graph 0 still writes only the mean; graph 1
	 * computes y again from a, b, c, fused into its use */
	scoped_body b = {.how = USE_AFTER};
	assert_int_equal(call_scoped(ctx, in, &b, &ex), 2);
	assert_non_null(strstr(ex, "outputs 4 B)"));
	free(ex);
	/* a value fn keeps past the call (a reference of its own) is computed */
	b = (scoped_body){.how = KEEP};
	call_scoped(ctx, in, &b, &ex);
	free(ex);
	assert_non_null(b.kept);
	assert_non_null(b.kept->st);
	check_values(ctx, b.kept, apply_exp_y, in, &b, "a tensor kept past the call");
	kl_release(b.kept);
	for (int i = 0; i < 3; i++)
		kl_release(in[i]);
	kl_ctx_free(ctx);
}

/* a matrix product alive at the break is written out, not computed twice */
static kl_status body_product(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                              int nout, void *user)
{
	(void)nin;
	(void)nout;
	double *total = user;
	kl_tensor *h = kl_matmul(in[0], in[1]);
	kl_status st = kl_item(kl_sum(h, 0, NULL, false), total);
	if (st != KL_OK)
		return st;
	out[0] = kl_relu(h);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static kl_tensor *apply_product(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_relu(kl_matmul(in[0], in[1]));
}

static void test_product_across_a_break(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_tensor *in[2] = {
	        kltest_rand(ctx, KL_F32, 2, (int64_t[]){32, 48}, KLTEST_NORMAL, KLTEST_CONTIG, 7),
	        kltest_rand(ctx, KL_F32, 2, (int64_t[]){48, 16}, KLTEST_NORMAL, KLTEST_CONTIG, 8)};
	double total = 0;
	kl_fn *f = kl_compile(ctx, body_product, &total, 2, 1, NULL);
	kl_tensor *out = NULL;
	assert_int_equal(kl_fn_call(f, in, &out), KL_OK);
	check_values(ctx, out, apply_product, in, NULL, "relu of the product after the break");
	kl_release(out);
	char *ex = explain_str(f);
	const char *g1 = strstr(ex, "graph 1: ");
	assert_non_null(g1);
	assert_non_null(strstr(g1, "0 library calls")); /* no second product */
	free(ex);
	kl_fn_free(f);
	kl_release(in[0]);
	kl_release(in[1]);
	kl_ctx_free(ctx);
}

/* ---- kl_explain after a failed first call ------------------------------------ */

typedef struct flaky {
	bool fail;
} flaky;

static kl_status body_flaky(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	(void)nin;
	(void)nout;
	if (((flaky *)user)->fail)
		return kl_set_error(ctx, KL_EINVAL, "body_flaky: asked to fail");
	out[0] = kl_relu(kl_add_scalar(in[0], 1));
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static void test_explain_after_failure(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	kl_tensor *x = kl_full(ctx, KL_F32, 1, (int64_t[]){8}, 2);
	flaky fl = {.fail = true};
	kl_fn *f = kl_compile(ctx, body_flaky, &fl, 1, 1, NULL);
	char *ex = explain_str(f);
	assert_non_null(strstr(ex, "not called yet"));
	free(ex);
	kl_tensor *out = NULL;
	assert_int_equal(kl_fn_call(f, &x, &out), KL_EINVAL);
	assert_null(out);
	assert_int_equal(kl_fn_last_kernels(f), -1);
	ex = explain_str(f);
	assert_null(strstr(ex, "-1 kernels"));
	assert_non_null(strstr(ex, "1 failed); compiles: 0; variants: 0;"));
	assert_non_null(strstr(ex, "the last call failed; none has succeeded yet"));
	free(ex);
	/* the next call compiles once, and says so */
	fl.fail = false;
	assert_int_equal(kl_fn_call(f, &x, &out), KL_OK);
	expect_all(out, 3, "after a failed first call");
	kl_release(out);
	ex = explain_str(f);
	assert_non_null(strstr(ex, "calls: 2 (0 replayed without calling fn, 0 eager, 1 failed); "
	                           "compiles: 1; variants: 1; last call launched 1 kernels"));
	free(ex);
	/* a failure after a success keeps the success's count, and says so */
	fl.fail = true;
	assert_int_equal(kl_fn_call(f, &x, &out), KL_EINVAL);
	assert_int_equal(kl_fn_last_kernels(f), 1);
	ex = explain_str(f);
	assert_non_null(strstr(ex, "compiles: 1; variants: 1; the last call failed; the last that "
	                           "succeeded launched 1 kernels"));
	free(ex);
	kl_fn_free(f);
	kl_release(x);
	kl_ctx_free(ctx);
}

/* ---- kl_ctx_synchronize ---------------------------------------------------------- */

static kl_status body_sync(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	kl_tensor *a = kl_mul_scalar(in[0], 2);
	kl_status st = kl_ctx_synchronize(ctx);
	if (st != KL_OK)
		return st;
	out[0] = kl_add_scalar(a, 1);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static void test_synchronize(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	assert_int_equal(kl_ctx_synchronize(ctx), KL_OK);
	assert_int_equal(kl_ctx_synchronize(NULL), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(NULL), "kl_ctx_synchronize: ctx is NULL"));
	kl_tensor *x = kl_full(ctx, KL_F32, 1, (int64_t[]){5}, 3);
	kl_tensor *y = kl_exp(x);
	assert_int_equal(kl_ctx_synchronize(ctx), KL_OK);
	expect_all(y, exp(3.0), "eager, then synchronize");
	kl_release(y);
	/* inside a compiled function: a graph break; with fullgraph an error */
	kl_fn *f = kl_compile(ctx, body_sync, NULL, 1, 1, NULL);
	kl_tensor *out = NULL;
	assert_int_equal(kl_fn_call(f, &x, &out), KL_OK);
	expect_all(out, 7, "synchronize inside a compiled function");
	kl_release(out);
	char *ex = explain_str(f);
	assert_non_null(strstr(ex, "ended by a graph break: kl_ctx_synchronize"));
	free(ex);
	kl_fn_free(f);
	f = kl_compile(ctx, body_sync, NULL, 1, 1, &(kl_compile_opts){.fullgraph = true});
	assert_int_equal(kl_fn_call(f, &x, &out), KL_ESTATE);
	assert_non_null(strstr(kl_last_error(ctx), "kl_ctx_synchronize is a sync point inside a "
	                                           "fullgraph function"));
	kl_fn_free(f);
	kl_release(x);
	kl_ctx_free(ctx);
}

/* ---- a cache directory open to others ---------------------------------------------- */

static kl_status body_cache(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	(void)nin;
	(void)nout;
	out[0] = kl_mul_scalar(kl_sigmoid(in[0]), *(const double *)user);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

typedef struct cache_call {
	kl_ctx *ctx;
	kl_tensor *x;
	double k;
	kl_status st;
} cache_call;

static void compile_and_call(void *p)
{
	cache_call *c = p;
	kl_fn *f = kl_compile(c->ctx, body_cache, &c->k, 1, 1, NULL);
	kl_tensor *out = NULL;
	c->st = kl_fn_call(f, &c->x, &out);
	if (c->st == KL_OK)
		expect_all(out, c->k / (1 + exp(-1.0)), "compiled without a disk cache");
	kl_release(out);
	kl_fn_free(f);
}

static int count_entries(const char *dir)
{
	char cmd[512];
	snprintf(cmd, sizeof cmd, "ls -A '%s' | wc -l", dir);
	FILE *p = popen(cmd, "r");
	int n = -1;
	assert_non_null(p);
	assert_int_equal(fscanf(p, "%d", &n), 1);
	pclose(p);
	return n;
}

static void test_cache_dir_open_to_others(void **state)
{
	(void)state;
	char dir[] = "/tmp/kiln-test-cache-XXXXXX";
	assert_non_null(mkdtemp(dir));
	assert_int_equal(chmod(dir, 0775), 0); /* writable by the group */
	const char *saved = getenv("KILN_CACHE_DIR");
	char *old = saved ? strdup(saved) : NULL;
	setenv("KILN_CACHE_DIR", dir, 1);
	kl_ctx *ctx = new_ctx();
	cache_call c = {ctx, kl_full(ctx, KL_F32, 1, (int64_t[]){4}, 1), 3.25, KL_OK};
	char *log = capture_stderr(compile_and_call, &c);
	assert_int_equal(c.st, KL_OK);
	assert_non_null(strstr(log, "kiln: warning: not caching compiled code on disk: "));
	assert_non_null(strstr(log, dir));
	assert_non_null(strstr(log, "is writable by its group (owner"));
	assert_non_null(strstr(log, "mode 775"));
	free(log);
	assert_int_equal(count_entries(dir), 0); /* nothing was written there */
	/* once a process: another compile in the same directory says nothing */
	c.k = 4.5;
	log = capture_stderr(compile_and_call, &c);
	assert_int_equal(c.st, KL_OK);
	assert_null(strstr(log, "kiln: warning"));
	free(log);
	assert_int_equal(count_entries(dir), 0);
	kl_release(c.x);
	kl_ctx_free(ctx);
	if (old) {
		setenv("KILN_CACHE_DIR", old, 1);
		free(old);
	} else {
		unsetenv("KILN_CACHE_DIR");
	}
	assert_int_equal(rmdir(dir), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_user_weights),
	        cmocka_unit_test(test_shared_weight),
	        cmocka_unit_test(test_copy),
	        cmocka_unit_test(test_copy_inside_compiled),
	        cmocka_unit_test(test_scopes_across_a_break),
	        cmocka_unit_test(test_product_across_a_break),
	        cmocka_unit_test(test_explain_after_failure),
	        cmocka_unit_test(test_synchronize),
	        cmocka_unit_test(test_cache_dir_open_to_others),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
