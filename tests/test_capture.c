/* test_capture.c - kl_compile / kl_fn_call: compiled, eager and float64
 * reference agreement on random graphs in every mode; graph breaks and
 * fullgraph refusals; guards, recompiles and the recompile limit; dynamic
 * dims; kernel counts; explain; a warm start in a fresh process.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/core.h"
#include "graph/graph.h"
#include "kltest.h"
#include "runtime/compiled.h"

extern char **environ;

static const char *self_exe = "/proc/self/exe";

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
	char path[] = "/tmp/kiln-test-capture-XXXXXX";
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

static char *explain_str(kl_fn *f)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *m = open_memstream(&buf, &len);
	assert_int_equal(kl_explain(f, m), KL_OK);
	fclose(m);
	return buf;
}

/* Compare t with the reference values of apply on in. */
static void check_against(kl_ctx *ctx, kl_tensor *t, kltest_apply_fn apply, kl_tensor *const *in,
                          const void *param, double factor, const char *what)
{
	int nd;
	int64_t shape[KL_MAX_DIMS];
	kl_dtype dt;
	double *ref = kltest_reference(ctx, what, apply, in, param, &nd, shape, &dt);
	assert_non_null(ref);
	assert_int_equal(kl_tensor_dtype(t), dt);
	assert_int_equal(kl_ndim(t), nd);
	assert_memory_equal(kl_shape(t), shape, sizeof(int64_t) * (size_t)nd);
	double *got = kltest_read(t);
	assert_non_null(got);
	assert_true(kltest_compare(what, dt, nd, shape, got, ref, factor));
	free(got);
	free(ref);
}

/* ---- relu(a * b + c) ---------------------------------------------------------- */

static kl_tensor *apply_fma_relu(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_relu(kl_add(kl_mul(in[0], in[1]), in[2]));
}

typedef struct counter {
	int calls;
	kl_tensor *w; /* reached through user state */
} counter;

static kl_status body_fma_relu(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                               int nout, void *user)
{
	(void)ctx;
	(void)nin;
	(void)nout;
	if (user)
		((counter *)user)->calls++;
	out[0] = apply_fma_relu(in, NULL);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static void make_inputs(kl_ctx *ctx, kl_tensor **in, int n, kl_dtype dt, int nd,
                        const int64_t *shape, uint64_t seed)
{
	for (int i = 0; i < n; i++) {
		in[i] = kltest_rand(ctx, dt, nd, shape, KLTEST_NORMAL, KLTEST_CONTIG,
		                    seed + (uint64_t)i);
		assert_non_null(in[i]);
	}
}

static void release_all(kl_tensor **t, int n)
{
	for (int i = 0; i < n; i++)
		kl_release(t[i]);
}

static void test_kernel_counts(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	int64_t shape[2] = {16, 32};
	kl_tensor *in[3], *out[1];
	make_inputs(ctx, in, 3, KL_F32, 2, shape, 1);

	kl_fn *f = kl_compile(ctx, body_fma_relu, NULL, 3, 1, NULL);
	assert_non_null(f);
	assert_int_equal(kl_fn_last_kernels(f), -1);
	assert_int_equal(kl_fn_call(f, in, out), KL_OK);
	assert_int_equal(kl_fn_last_kernels(f), 1);
	check_against(ctx, out[0], apply_fma_relu, in, NULL, 1, "relu(a*b+c)");
	kl_release(out[0]);
	char *ex = explain_str(f);
	assert_non_null(strstr(ex, "mul#"));
	assert_non_null(strstr(ex, "add#"));
	assert_non_null(strstr(ex, "relu#"));
	assert_non_null(strstr(ex, "planned peak memory"));
	assert_non_null(strstr(ex, "FLOP"));
	assert_non_null(strstr(ex, "input 0: f32 [16,32] strides [32,1]"));
	free(ex);
	kl_fn_free(f);

	/* disabled: every op its own eager kernel */
	f = kl_compile(ctx, body_fma_relu, NULL, 3, 1, &(kl_compile_opts){.disable = true});
	assert_int_equal(kl_fn_call(f, in, out), KL_OK);
	assert_int_equal(kl_fn_last_kernels(f), 3);
	check_against(ctx, out[0], apply_fma_relu, in, NULL, 1, "relu(a*b+c) eager");
	kl_release(out[0]);
	kl_fn_free(f);

	/* the fusion kill switch: compiled, unfused */
	setenv("KILN_DISABLE_FUSION", "1", 1);
	f = kl_compile(ctx, body_fma_relu, NULL, 3, 1, NULL);
	unsetenv("KILN_DISABLE_FUSION");
	assert_int_equal(kl_fn_call(f, in, out), KL_OK);
	assert_int_equal(kl_fn_last_kernels(f), 3);
	check_against(ctx, out[0], apply_fma_relu, in, NULL, 1, "relu(a*b+c) unfused");
	kl_release(out[0]);
	ex = explain_str(f);
	assert_non_null(strstr(ex, "fusion off"));
	free(ex);
	kl_fn_free(f);

	release_all(in, 3);
	kl_ctx_free(ctx);
}

/* ---- random graphs in every mode ----------------------------------------------- */

enum {
	R_UNARY,
	R_BINARY,
	R_SCALAR,
	R_REDUCE,
	R_SOFTMAX,
	R_MATMUL,
	R_TRANSPOSE,
	R_RESHAPE,
	R_SLICECAT,
	R_NORM,
	R_CAST,
	R_NKINDS
};

typedef struct rstep {
	int kind, a, b, sub;
	double s;
} rstep;

typedef struct recipe {
	kl_dtype dt;
	int64_t rb, rn; /* values are [rb, rn]; rn is even */
	bool col;       /* in[1] is [rb,1] rather than [rn] */
	int nsteps;
	rstep st[8];
	int which; /* output to build: 0 the last value, 1 an intermediate */
} recipe;

/* values: 0 = in[0] [B,N], then one [B,N] value per step; in[1] broadcasts,
 * in[2] is an [N,N] weight */
static kl_tensor *rstep_apply(const rstep *s, kl_tensor *x, kl_tensor *y, kl_tensor *const *in,
                              const recipe *r)
{
	int64_t RB = r->rb, RN = r->rn;
	switch (s->kind) {
	case R_UNARY: {
		kl_tensor *(*const ops[])(kl_tensor *) = {kl_neg,  kl_abs,  kl_tanh, kl_sigmoid,
		                                          kl_relu, kl_silu, kl_gelu, kl_sin};
		if (s->sub == 8)
			return kl_exp(kl_tanh(x));
		return ops[s->sub % 8](x);
	}
	case R_BINARY: {
		kl_tensor *(*const ops[])(kl_tensor *, kl_tensor *) = {kl_add, kl_sub, kl_mul,
		                                                       kl_maximum, kl_minimum};
		return ops[s->sub % 5](x, s->b < 0 ? in[1] : y);
	}
	case R_SCALAR:
		return s->sub ? kl_mul_scalar(x, s->s) : kl_add_scalar(x, s->s);
	case R_REDUCE: {
		int axis = s->sub & 1;
		kl_tensor *red = (s->sub >> 1) == 0   ? kl_max(x, 1, &axis, true)
		                 : (s->sub >> 1) == 1 ? kl_mean(x, 1, &axis, true)
		                                      : kl_sum(x, 1, &axis, true);
		return kl_sub(x, red);
	}
	case R_SOFTMAX:
		return s->sub ? kl_log_softmax(x, s->sub == 2 ? 0 : 1) : kl_softmax(x, 1);
	case R_MATMUL:
		return kl_mul_scalar(kl_matmul(x, in[2]), 1.0 / (double)RN);
	case R_TRANSPOSE: {
		kl_tensor *t = kl_transpose(x, 0, 1);
		t = s->sub ? kl_relu(t) : kl_mul_scalar(t, 0.5);
		return kl_transpose(t, 0, 1);
	}
	case R_RESHAPE: {
		kl_tensor *t = kl_reshape(x, 1, (int64_t[]){RB * RN});
		t = kl_add_scalar(t, s->s);
		return kl_reshape(t, 2, (int64_t[]){RB, RN});
	}
	case R_SLICECAT: {
		kl_tensor *lo = kl_slice(x, 1, 0, RN / 2, 1), *hi = kl_slice(x, 1, RN / 2, RN, 1);
		return kl_concat(2, (kl_tensor *[]){hi, kl_neg(lo)}, 1);
	}
	case R_NORM:
		return s->sub ? kl_rms_norm(x, NULL, 1e-5) : kl_layer_norm(x, NULL, NULL, 1e-5);
	case R_CAST:
		return kl_cast(kl_mul_scalar(kl_cast(x, KL_F32), 0.75), r->dt);
	}
	return NULL;
}

static kl_tensor *recipe_build(kl_tensor *const *in, const recipe *r, kl_tensor **inter)
{
	kl_tensor *v[10];
	v[0] = in[0];
	for (int i = 0; i < r->nsteps; i++) {
		const rstep *s = &r->st[i];
		v[i + 1] = rstep_apply(s, v[s->a], s->b >= 0 ? v[s->b] : NULL, in, r);
		if (!v[i + 1])
			return NULL;
	}
	if (inter)
		*inter = v[1 + r->nsteps / 2];
	return v[r->nsteps];
}

static kl_tensor *apply_recipe(kl_tensor *const *in, const void *p)
{
	const recipe *r = p;
	kl_tensor *inter = NULL;
	kl_tensor *last = recipe_build(in, r, &inter);
	return r->which ? inter : last;
}

static kl_status body_recipe(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                             void *user)
{
	(void)nin;
	(void)nout;
	out[0] = recipe_build(in, user, &out[1]);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static recipe random_recipe(uint64_t *rng, kl_dtype dt, int64_t rb, int64_t rn)
{
	recipe r;
	memset(&r, 0, sizeof r);
	r.dt = dt;
	r.rb = rb;
	r.rn = rn;
	r.col = kltest_next(rng) & 1;
	r.nsteps = 4 + (int)(kltest_next(rng) % 4);
	for (int i = 0; i < r.nsteps; i++) {
		rstep *s = &r.st[i];
		s->kind = (int)(kltest_next(rng) % R_NKINDS);
		s->a = (int)(kltest_next(rng) % (uint64_t)(i + 1));
		s->b = (kltest_next(rng) % 3 == 0) ? -1
		                                   : (int)(kltest_next(rng) % (uint64_t)(i + 1));
		s->sub = (int)(kltest_next(rng) % 9);
		s->s = -1.5 + (double)(kltest_next(rng) % 7) * 0.5;
		if (s->kind == R_REDUCE)
			s->sub %= 6;
		if (s->kind == R_SOFTMAX || s->kind == R_TRANSPOSE || s->kind == R_NORM ||
		    s->kind == R_SCALAR)
			s->sub %= s->kind == R_SOFTMAX ? 3 : 2;
		if (s->kind == R_SCALAR && s->s == 0)
			s->s = 2;
	}
	return r;
}

static void test_random_graphs_every_mode(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	const kl_dtype dts[3] = {KL_F32, KL_F16, KL_BF16};
	const kl_mode modes[4] = {KL_MODE_DEFAULT, KL_MODE_REDUCE_OVERHEAD, KL_MODE_MAX_AUTOTUNE,
	                          KL_MODE_MAX_AUTOTUNE_NO_CUDAGRAPHS};
	uint64_t rng = 2024;
	/* odd sizes and ones past a vector width, to reach loop remainders */
	const int64_t sizes[3][2] = {{4, 8}, {3, 34}, {5, 66}};
	for (int gi = 0; gi < 15; gi++) {
		kl_dtype dt = dts[gi % 3];
		const int64_t *bn = sizes[(gi / 3) % 3];
		recipe r = random_recipe(&rng, dt, bn[0], bn[1]);
		kl_tensor *in[3];
		int64_t s0[2] = {bn[0], bn[1]}, s1[2] = {bn[0], 1}, s2[2] = {bn[1], bn[1]};
		in[0] = kltest_rand(ctx, dt, 2, s0, KLTEST_NORMAL, KLTEST_CONTIG,
		                    10 * (uint64_t)gi);
		in[1] = r.col ? kltest_rand(ctx, dt, 2, s1, KLTEST_NORMAL, KLTEST_CONTIG,
		                            10 * gi + 1)
		              : kltest_rand(ctx, dt, 1, s0 + 1, KLTEST_NORMAL, KLTEST_CONTIG,
		                            10 * gi + 1);
		in[2] = kltest_rand(ctx, dt, 2, s2, KLTEST_NORMAL, KLTEST_PERMUTED, 10 * gi + 2);
		double factor = dt == KL_F32 ? 8 : 6;
		char what[96];
		for (int m = 0; m < 6; m++) {
			/* the four modes, eager (disabled), then fullgraph twice (a replay) */
			kl_compile_opts o = {.mode = m < 4 ? modes[m] : KL_MODE_DEFAULT,
			                     .disable = m == 4,
			                     .fullgraph = m == 5};
			kl_fn *f = kl_compile(ctx, body_recipe, &r, 3, 2, &o);
			assert_non_null(f);
			for (int rep = 0; rep < (m == 5 ? 2 : 1); rep++) {
				kl_tensor *out[2];
				kl_status st = kl_fn_call(f, in, out);
				if (st != KL_OK)
					fprintf(stderr, "graph %d mode %d: %s\n", gi, m,
					        kl_last_error(ctx));
				assert_int_equal(st, KL_OK);
				for (int w = 0; w < 2; w++) {
					r.which = w;
					snprintf(what, sizeof what,
					         "graph %d mode %d out %d rep %d", gi, m, w, rep);
					check_against(ctx, out[w], apply_recipe, in, &r, factor,
					              what);
				}
				r.which = 0;
				release_all(out, 2);
			}
			kl_fn_free(f);
		}
		release_all(in, 3);
	}
	kl_ctx_free(ctx);
}

/* ---- graph breaks --------------------------------------------------------------- */

typedef struct brk {
	double seen;
	int host_calls;
	bool no_host; /* kl_item only: two graphs */
} brk;

static kl_tensor *apply_break_ref(kl_tensor *const *in, const void *p)
{
	/* what body_break computes, with the item as a constant */
	const brk *b = p;
	return kl_relu(kl_add(kl_mul_scalar(in[0], b->seen), kl_exp(in[0])));
}

static kl_status host_cb(kl_ctx *ctx, kl_tensor *const *ts, int n, void *user)
{
	(void)ctx;
	brk *b = user;
	b->host_calls++;
	for (int i = 0; i < n; i++)
		if (!ts[i]->st)
			return KL_ESTATE; /* must be materialized by now */
	return KL_OK;
}

/* e = exp(x) is computed before the break and used after it */
static kl_status body_break(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	(void)nin;
	(void)nout;
	brk *b = user;
	kl_tensor *e = kl_exp(in[0]);
	kl_tensor *s = kl_sum(in[0], 0, NULL, false);
	kl_status st = kl_item(s, &b->seen);
	if (st != KL_OK)
		return st;
	if (!b->no_host && (st = kl_host_call(ctx, host_cb, &e, 1, b)) != KL_OK)
		return st;
	out[0] = kl_relu(kl_add(kl_mul_scalar(in[0], b->seen), e));
	out[1] = e;
	return out[0] ? KL_OK : kl_last_status(ctx);
}

typedef struct call_args {
	kl_fn *f;
	kl_tensor **in, **out;
	kl_status st;
} call_args;

static void do_call(void *p)
{
	call_args *a = p;
	a->st = kl_fn_call(a->f, a->in, a->out);
}

static void test_graph_break(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	ctx->logs |= KL_LOG_GRAPH_BREAKS;
	int64_t shape[2] = {5, 7};
	kl_tensor *in[1], *out[2];
	make_inputs(ctx, in, 1, KL_F32, 2, shape, 40);
	brk b = {0};
	kl_fn *f = kl_compile(ctx, body_break, &b, 1, 2, NULL);
	call_args a = {f, in, out, KL_OK};
	char *log = capture_stderr(do_call, &a);
	assert_int_equal(a.st, KL_OK);
	assert_non_null(strstr(log, "graph break at kl_item"));
	assert_non_null(strstr(log, "graph break at kl_host_call"));
	free(log);
	assert_int_equal(b.host_calls, 1);
	double *x = kltest_read(in[0]), sum = 0;
	for (int i = 0; i < 35; i++)
		sum += x[i];
	free(x);
	assert_true(fabs(b.seen - sum) <= 1e-4 * (1 + fabs(sum)));
	check_against(ctx, out[0], apply_break_ref, in, &b, 2, "after the break");
	/* graph 0 computes the sum alone (exp is alive only in fn's scope, so
	 * it is not written out there), graph 1 the exp the host call reads,
	 * graph 2 one fused kernel: one kernel each */
	assert_int_equal(kl_fn_last_kernels(f), 3);
	release_all(out, 2);
	char *ex = explain_str(f);
	assert_non_null(strstr(ex, "graph 0: "));
	assert_non_null(strstr(ex, "ended by a graph break: kl_item"));
	assert_non_null(strstr(ex, "ended by a graph break: kl_host_call"));
	assert_non_null(strstr(ex, "graph 2: "));
	assert_non_null(strstr(ex, "sum#"));
	free(ex);

	/* a second call reuses every graph (the item is baked per call) */
	long before = kl__jit_compiles();
	assert_int_equal(kl_fn_call(f, in, out), KL_OK);
	assert_int_equal(kl__jit_compiles(), before);
	check_against(ctx, out[0], apply_break_ref, in, &b, 2, "second call");
	release_all(out, 2);

	/* other data, another item: the graph after the break bakes a new
	 * scalar, a recompile of that graph alone */
	kl_tensor *in2[1];
	make_inputs(ctx, in2, 1, KL_F32, 2, shape, 41);
	ctx->logs |= KL_LOG_RECOMPILES;
	a = (call_args){f, in2, out, KL_OK};
	log = capture_stderr(do_call, &a);
	assert_int_equal(a.st, KL_OK);
	assert_non_null(strstr(log, "recompile #2 of "));
	assert_non_null(strstr(log, ": graph 2: node "));
	assert_non_null(strstr(log, "(mul) scalar 0: "));
	free(log);
	check_against(ctx, out[0], apply_break_ref, in2, &b, 2, "new item");
	release_all(out, 2);
	kl_release(in2[0]);
	kl_fn_free(f);

	/* kl_item alone: two graphs, and explain says why */
	b.no_host = true;
	f = kl_compile(ctx, body_break, &b, 1, 2, NULL);
	assert_int_equal(kl_fn_call(f, in, out), KL_OK);
	check_against(ctx, out[0], apply_break_ref, in, &b, 2, "two graphs");
	release_all(out, 2);
	ex = explain_str(f);
	assert_non_null(
	        strstr(ex, "graph 0: 2 ops, ended by a graph break: kl_item (after op sum#"));
	/* 3 ops and exp, left uncomputed by graph 0, computed again here */
	assert_non_null(strstr(ex, "graph 1: 4 ops, ended at fn's return"));
	assert_null(strstr(ex, "graph 2"));
	free(ex);
	kl_fn_free(f);
	b.no_host = false;

	/* fullgraph refuses the sync point, and says where */
	f = kl_compile(ctx, body_break, &b, 1, 2, &(kl_compile_opts){.fullgraph = true});
	assert_int_equal(kl_fn_call(f, in, out), KL_ESTATE);
	assert_null(out[0]);
	assert_non_null(strstr(kl_last_error(ctx), "kl_fn_call: kl_item is a sync point inside a "
	                                           "fullgraph function (graph 0, after 2 ops)"));
	assert_null(ctx->trace);
	kl_fn_free(f);
	kl_release(in[0]);
	kl_ctx_free(ctx);
}

/* ---- fullgraph replay ------------------------------------------------------------- */

static kl_tensor *apply_affine(kl_tensor *const *in, const void *p)
{
	const counter *c = p;
	return kl_add(kl_matmul(in[0], c->w), kl_mul_scalar(in[1], 3));
}

static kl_status body_affine(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                             void *user)
{
	(void)nin;
	(void)nout;
	counter *c = user;
	c->calls++;
	out[0] = apply_affine(in, c);
	out[1] = in[1]; /* returned unchanged */
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static void test_fullgraph_replay(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	counter c = {0};
	int64_t xs[2] = {6, 4}, ws[2] = {4, 3}, ys[2] = {6, 3};
	size_t held = 0;
	c.w = kltest_rand(ctx, KL_F32, 2, ws, KLTEST_NORMAL, KLTEST_CONTIG, 50);
	kl_fn *f =
	        kl_compile(ctx, body_affine, &c, 2, 2,
	                   &(kl_compile_opts){.fullgraph = true, .mode = KL_MODE_REDUCE_OVERHEAD});
	for (int call = 0; call < 4; call++) {
		kl_tensor *in[2] = {kltest_rand(ctx, KL_F32, 2, xs, KLTEST_NORMAL, KLTEST_CONTIG,
		                                60 + (uint64_t)call),
		                    kltest_rand(ctx, KL_F32, 2, ys, KLTEST_NORMAL, KLTEST_CONTIG,
		                                70 + (uint64_t)call)};
		kl_tensor *out[2];
		assert_int_equal(kl_fn_call(f, in, out), KL_OK);
		assert_int_equal(c.calls, 1); /* fn ran only for the first trace */
		assert_ptr_equal(out[1], in[1]);
		check_against(ctx, out[0], apply_affine, in, &c, 2, "replay");
		release_all(out, 2);
		release_all(in, 2);
		/* a replay's outputs are the caller's alone: released, nothing stays */
		kl_memory_usage mu;
		assert_int_equal(kl_memory_stats(ctx, &mu), KL_OK);
		if (call == 0)
			held = mu.in_use;
		else if (mu.in_use != held)
			fail_msg("replay %d: %zu bytes in use after its outputs were released, %zu "
			         "after the first call's",
			         call, mu.in_use, held);
	}
	/* another shape: the guard fails, fn is traced again */
	int64_t xs2[2] = {2, 4}, ys2[2] = {2, 3};
	kl_tensor *in[2] = {kltest_rand(ctx, KL_F32, 2, xs2, KLTEST_NORMAL, KLTEST_CONTIG, 80),
	                    kltest_rand(ctx, KL_F32, 2, ys2, KLTEST_NORMAL, KLTEST_CONTIG, 81)};
	kl_tensor *out[2];
	assert_int_equal(kl_fn_call(f, in, out), KL_OK);
	assert_int_equal(c.calls, 2);
	check_against(ctx, out[0], apply_affine, in, &c, 2, "second variant");
	release_all(out, 2);
	release_all(in, 2);
	char *ex = explain_str(f);
	assert_non_null(strstr(ex, "variant 1"));
	assert_non_null(strstr(ex, "replays its plan without calling fn"));
	assert_non_null(strstr(ex, "note: mode reduce-overhead behaves as default on the CPU"));
	assert_non_null(strstr(ex, "matmul#"));
	free(ex);
	kl_fn_free(f);
	kl_release(c.w);
	kl_ctx_free(ctx);
}

/* ---- recompiles, the limit, dynamic dims ---------------------------------------- */

static kl_tensor *apply_affine1(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_add_scalar(kl_mul_scalar(in[0], 2), 1);
}

/* ---- kl_profile ------------------------------------------------------------------ */

static char *profile_str(kl_fn *f, kl_tensor *const *in, kl_status *st)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *m = open_memstream(&buf, &len);
	*st = kl_profile(f, in, m);
	fclose(m);
	return buf;
}

/* The step rows of graph g's table in text: their count, each time positive
 * and finite, the steps numbered from 0 in order; -1 where the table is
 * missing or a row is malformed. */
static int profile_rows(const char *text, int g)
{
	char head[48];
	snprintf(head, sizeof head, "kiln profile: graph %d: ", g);
	const char *t = strstr(text, head);
	if (!t)
		return -1;
	int nsteps = -1;
	if (sscanf(t + strlen(head), "%d steps", &nsteps) != 1)
		return -1;
	int rows = 0;
	for (const char *l = strchr(t, '\n'); l && l[1]; l = strchr(l + 1, '\n')) {
		int idx = -1;
		double us = -1;
		if (strncmp(l + 1, "kiln profile:", 13) == 0)
			break;
		if (sscanf(l + 1, " [%d] %lf us", &idx, &us) != 2)
			continue; /* the column header */
		if (idx != rows || !(us > 0) || !isfinite(us))
			return -1;
		rows++;
	}
	return rows == nsteps ? rows : -1;
}

static void test_profile(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	int64_t shape[2] = {64, 96};
	kl_tensor *in[1], *out[2];
	make_inputs(ctx, in, 1, KL_F32, 2, shape, 50);
	/* two graphs around kl_item: a table each, every step timed */
	brk b = {.no_host = true};
	kl_fn *f = kl_compile(ctx, body_break, &b, 1, 2, NULL);
	kl_status st;
	char *text = profile_str(f, in, &st);
	assert_int_equal(st, KL_OK);
	/* numbered from 0, as kl_explain numbers them */
	assert_true(profile_rows(text, 0) >= 1);
	assert_true(profile_rows(text, 1) >= 1);
	assert_null(strstr(text, "kiln profile: graph 2"));
	assert_non_null(strstr(text, "host clock"));
	free(text);
	assert_null(ctx->profile);
	/* the function still computes what it should, and the profile's call
	 * was a call (compiled once, reused) */
	long before = kl__jit_compiles();
	assert_int_equal(kl_fn_call(f, in, out), KL_OK);
	assert_int_equal(kl__jit_compiles(), before);
	check_against(ctx, out[0], apply_break_ref, in, &b, 2, "after kl_profile");
	release_all(out, 2);
	kl_fn_free(f);

	/* a fullgraph function replays its plan: one table */
	counter c = {0};
	int64_t ws[2] = {96, 32}, ys[2] = {64, 32};
	kl_tensor *ain[2];
	make_inputs(ctx, &c.w, 1, KL_F32, 2, ws, 51);
	make_inputs(ctx, &ain[0], 1, KL_F32, 2, shape, 52);
	make_inputs(ctx, &ain[1], 1, KL_F32, 2, ys, 53);
	f = kl_compile(ctx, body_affine, &c, 2, 2, &(kl_compile_opts){.fullgraph = true});
	assert_int_equal(kl_fn_call(f, ain, out), KL_OK);
	release_all(out, 2);
	text = profile_str(f, ain, &st);
	assert_int_equal(st, KL_OK);
	assert_true(profile_rows(text, 0) >= 1);
	assert_null(strstr(text, "kiln profile: graph 1"));
	assert_non_null(strstr(text, "blas"));
	free(text);
	assert_int_equal(kl_fn_call(f, ain, out), KL_OK);
	check_against(ctx, out[0], apply_affine, ain, &c, 2, "replay after kl_profile");
	release_all(out, 2);
	kl_fn_free(f);

	/* nothing compiled: said, not an error */
	f = kl_compile(ctx, body_affine, &c, 2, 2, &(kl_compile_opts){.disable = true});
	text = profile_str(f, ain, &st);
	assert_int_equal(st, KL_OK);
	assert_non_null(strstr(text, "no compiled step to time (compilation is disabled"));
	free(text);
	/* errors name the call and leave the context as it was */
	assert_int_equal(kl_profile(NULL, ain, stdout), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(NULL), "kl_profile: f is NULL"));
	assert_int_equal(kl_profile(f, ain, NULL), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "kl_profile: out is NULL"));
	assert_int_equal(kl_profile(f, NULL, stdout), KL_EINVAL);
	assert_null(ctx->profile);
	kl_fn_free(f);
	for (int i = 0; i < 2; i++)
		kl_release(ain[i]);
	kl_release(c.w);
	kl_release(in[0]);
	kl_ctx_free(ctx);
}

static kl_status body_affine1(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                              void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	out[0] = apply_affine1(in, NULL);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

typedef struct rc_args {
	kl_fn *f;
	kl_ctx *ctx;
	int n;
	const int64_t *sizes;
	int kernels[8];
} rc_args;

static void do_calls(void *p)
{
	rc_args *a = p;
	for (int i = 0; i < a->n; i++) {
		int64_t s[2] = {a->sizes[i], 3};
		kl_tensor *in = kltest_rand(a->ctx, KL_F32, 2, s, KLTEST_NORMAL, KLTEST_CONTIG,
		                            90 + (uint64_t)i);
		kl_tensor *out;
		assert_int_equal(kl_fn_call(a->f, &in, &out), KL_OK);
		a->kernels[i] = kl_fn_last_kernels(a->f);
		check_against(a->ctx, out, apply_affine1, &in, NULL, 1, "affine");
		kl_release(out);
		kl_release(in);
	}
}

static void test_recompiles_and_limit(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	ctx->logs |= KL_LOG_RECOMPILES;
	kl_fn *f =
	        kl_compile(ctx, body_affine1, NULL, 1, 1, &(kl_compile_opts){.recompile_limit = 3});
	const int64_t sizes[6] = {8, 16, 8, 24, 32, 40};
	rc_args a = {f, ctx, 6, sizes, {0}};
	char *log = capture_stderr(do_calls, &a);
	assert_non_null(strstr(log, "recompile #2 of "));
	assert_non_null(strstr(log, "input 0 dim 0: 8 -> 16"));
	assert_non_null(strstr(log, "recompile #3 of "));
	assert_null(strstr(log, "recompile #4"));
	/* one warning, naming the guard */
	const char *w = strstr(log, "kiln: warning: ");
	assert_non_null(w);
	assert_null(strstr(w + 1, "kiln: warning: "));
	assert_non_null(
	        strstr(w, "recompile limit (3 variants); guard 'input 0 dim 0' kept failing"));
	free(log);
	assert_int_equal(a.kernels[0], 1);
	assert_int_equal(a.kernels[2], 1); /* size 8 again: variant 0 */
	assert_int_equal(a.kernels[3], 1);
	assert_int_equal(a.kernels[4], 2); /* eager: mul_scalar, add_scalar */
	assert_int_equal(a.kernels[5], 2);
	char *ex = explain_str(f);
	assert_non_null(strstr(ex, "over the recompile limit"));
	assert_non_null(strstr(ex, "variants: 3"));
	free(ex);
	kl_fn_free(f);
	kl_ctx_free(ctx);
}

static void test_dynamic_dims(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	const int64_t sizes[4] = {2, 3, 5, 3};
	for (int k = 0; k < 2; k++) {
		kl_compile_opts o = {.recompile_limit = 2};
		uint32_t mask[1] = {1};
		if (k == 0) {
			o.ndynamic_dims = 1;
			o.dynamic_dims = mask;
		} else {
			o.dynamic = KL_DYNAMIC_ALL;
		}
		kl_fn *f = kl_compile(ctx, body_affine1, NULL, 1, 1, &o);
		long before = kl__jit_compiles();
		rc_args a = {f, ctx, 4, sizes, {0}};
		do_calls(&a);
		/* one variant, at most one compile (none when the cache had it) */
		assert_true(kl__jit_compiles() - before <= 1);
		for (int i = 0; i < 4; i++)
			assert_int_equal(a.kernels[i], 1);
		char *ex = explain_str(f);
		assert_non_null(strstr(ex, "variants: 1;"));
		assert_non_null(strstr(ex, "[*,"));
		free(ex);
		kl_fn_free(f);
	}
	kl_ctx_free(ctx);
}

/* ---- errors ---------------------------------------------------------------------- */

static kl_status body_fails(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                            void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	out[0] = kl_add(in[0], in[1]); /* [2,3] + [4]: does not broadcast */
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static kl_status body_null_out(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                               int nout, void *user)
{
	(void)ctx;
	(void)in;
	(void)nin;
	(void)nout;
	(void)user;
	out[0] = NULL;
	return KL_OK;
}

static void test_errors(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	assert_null(kl_compile(ctx, NULL, NULL, 1, 1, NULL));
	assert_non_null(strstr(kl_last_error(ctx), "fn is NULL"));
	assert_null(kl_compile(ctx, body_fails, NULL, 2, 1, &(kl_compile_opts){.mode = 9}));
	assert_null(kl_compile(
	        ctx, body_fails, NULL, 2, 1,
	        &(kl_compile_opts){.ndynamic_dims = 3, .dynamic_dims = (uint32_t[]){1, 1, 1}}));
	assert_int_equal(kl_fn_call(NULL, NULL, NULL), KL_EINVAL);
	int64_t a[2] = {2, 3}, b[1] = {4};
	kl_tensor *in[2] = {kl_zeros(ctx, KL_F32, 2, a), kl_zeros(ctx, KL_F32, 1, b)};
	kl_tensor *out[1] = {in[0]};
	kl_fn *f = kl_compile(ctx, body_fails, NULL, 2, 1, NULL);
	assert_int_equal(kl_fn_call(f, in, out), KL_EINVAL);
	assert_null(out[0]);
	assert_non_null(strstr(kl_last_error(ctx), "[2,3] and [4]"));
	assert_null(ctx->trace);
	assert_null(ctx->sync_hook);
	assert_int_equal(kl_fn_call(f, (kl_tensor *[]){in[0], NULL}, out), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "input 1 is NULL"));
	kl_fn_free(f);
	f = kl_compile(ctx, body_null_out, NULL, 2, 1, NULL);
	assert_int_equal(kl_fn_call(f, in, out), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(ctx), "out[0] is NULL"));
	kl_fn_free(f);
	kl_release(in[0]);
	kl_release(in[1]);
	/* nothing leaked into the context */
	assert_null(ctx->live);
	kl_ctx_free(ctx);
}

/* ---- KILN_LOGS as things happen ------------------------------------------------ */

static kl_status body_scaled(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                             void *user)
{
	(void)nin;
	(void)nout;
	out[0] = kl_add_scalar(kl_mul_scalar(in[0], *(const double *)user), 1);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

typedef struct log_args {
	kl_ctx *ctx;
	double scale;
} log_args;

static void do_scaled(void *p)
{
	log_args *a = p;
	int64_t shape[1] = {33};
	kl_tensor *in = kltest_rand(a->ctx, KL_F32, 1, shape, KLTEST_NORMAL, KLTEST_CONTIG, 3);
	kl_fn *f = kl_compile(a->ctx, body_scaled, &a->scale, 1, 1, NULL);
	kl_tensor *out;
	assert_int_equal(kl_fn_call(f, &in, &out), KL_OK);
	kl_release(out);
	kl_release(in);
	kl_fn_free(f);
}

static void test_logs(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	ctx->logs |= KL_LOG_OUTPUT_CODE | KL_LOG_FUSION | KL_LOG_CACHE;
	/* a scale no earlier run used, so that this graph is compiled now */
	log_args a = {ctx, 1.0 + (double)(getpid() % 100000) / 100000.0};
	char *log = capture_stderr(do_scaled, &a);
	assert_non_null(strstr(log, "[kiln:cache] miss plan-"));
	assert_non_null(strstr(log, "[kiln:cache] wrote plan-"));
	assert_non_null(strstr(log, " graph 0: 3 nodes -> 1 steps"));
	assert_non_null(strstr(log, "[kiln:output_code] fn#"));
	assert_non_null(strstr(log, "(void *const *"));
	free(log);
	/* the second time the cache has it: no code is generated */
	log = capture_stderr(do_scaled, &a);
	assert_non_null(strstr(log, "[kiln:cache] hit plan-"));
	assert_null(strstr(log, "[kiln:output_code]"));
	free(log);
	kl_ctx_free(ctx);
}

/* ---- the disk cache across processes ------------------------------------------- */

static int child_warm(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL);
	if (!ctx)
		return 2;
	int64_t shape[2] = {16, 32};
	kl_tensor *in[3], *out[1];
	make_inputs(ctx, in, 3, KL_F32, 2, shape, 1);
	kl_fn *f = kl_compile(ctx, body_fma_relu, NULL, 3, 1, NULL);
	kl_status st = kl_fn_call(f, in, out);
	fprintf(stderr, "child: status %d compiles %ld lowerings %ld\n", (int)st,
	        kl__jit_compiles(), kl__rt_lowerings());
	int rc = st == KL_OK && kl__jit_compiles() == 0 && kl__rt_lowerings() == 0 ? 0 : 1;
	if (st == KL_OK) {
		check_against(ctx, out[0], apply_fma_relu, in, NULL, 1, "warm");
		kl_release(out[0]);
	}
	kl_fn_free(f);
	release_all(in, 3);
	kl_ctx_free(ctx);
	return rc;
}

static void test_warm_process(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	int64_t shape[2] = {16, 32};
	kl_tensor *in[3], *out[1];
	make_inputs(ctx, in, 3, KL_F32, 2, shape, 1);
	kl_fn *f = kl_compile(ctx, body_fma_relu, NULL, 3, 1, NULL);
	assert_int_equal(kl_fn_call(f, in, out), KL_OK);
	kl_release(out[0]);
	kl_fn_free(f);
	release_all(in, 3);
	kl_ctx_free(ctx);

	int pfd[2];
	assert_int_equal(pipe(pfd), 0);
	posix_spawn_file_actions_t fa;
	posix_spawn_file_actions_init(&fa);
	posix_spawn_file_actions_adddup2(&fa, pfd[1], 2);
	posix_spawn_file_actions_addclose(&fa, pfd[0]);
	setenv("KILN_LOGS", "cache", 1);
	char *argv[] = {(char *)self_exe, "--warm-child", NULL};
	pid_t pid;
	assert_int_equal(posix_spawn(&pid, self_exe, &fa, NULL, argv, environ), 0);
	unsetenv("KILN_LOGS");
	posix_spawn_file_actions_destroy(&fa);
	close(pfd[1]);
	char buf[8192];
	size_t n = 0;
	ssize_t r;
	while ((r = read(pfd[0], buf + n, sizeof buf - 1 - n)) > 0 || (r < 0 && errno == EINTR))
		if (r > 0)
			n += (size_t)r;
	buf[n] = '\0';
	close(pfd[0]);
	int status;
	while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
		;
	if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
		fprintf(stderr, "child stderr:\n%s\n", buf);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	assert_non_null(strstr(buf, "[kiln:cache] hit plan-"));
}

/* Conversions at the edges of a dtype agree between eager and compiled code:
 * an i32 fill past INT32_MAX saturates, and f64 -> f16/bf16 rounds once
 * (1 + 2^-11 + 2^-40 is above the f16 tie, so it rounds up; through float
 * it would land on the tie and round to even, down). */
static kl_status edge_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	out[0] = kl_cast(in[0], KL_F16);
	out[1] = kl_cast(in[0], KL_BF16);
	out[2] = kl_add(kl_full(ctx, KL_I32, 1, (int64_t[]){3}, 1e10), kl_cast(in[1], KL_I32));
	out[3] = kl_add_scalar(kl_full(ctx, KL_I32, 1, (int64_t[]){3}, -1e10), 0);
	for (int i = 0; i < 4; i++)
		if (!out[i])
			return kl_last_status(ctx);
	return KL_OK;
}

static void test_conversion_edges(void **state)
{
	(void)state;
	kl_ctx *ctx = new_ctx();
	double xv[3] = {1 + 0x1p-11 + 0x1p-40, -(1 + 0x1p-11 + 0x1p-40), 1 + 0x1p-8 + 0x1p-45};
	kl_tensor *x = kl_from_host(ctx, KL_F64, 1, (int64_t[]){3}, xv, sizeof xv);
	kl_tensor *z = kl_zeros(ctx, KL_F64, 1, (int64_t[]){3});
	kl_tensor *in[2] = {x, z};
	kl_tensor *eager[4], *comp[4];
	kl_scope_begin(ctx);
	assert_int_equal(edge_body(ctx, in, 2, eager, 4, NULL), KL_OK);
	for (int i = 0; i < 4; i++)
		kl_retain(eager[i]);
	kl_scope_end(ctx);
	kl_fn *f = kl_compile(ctx, edge_body, NULL, 2, 4, NULL);
	assert_non_null(f);
	assert_int_equal(kl_fn_call(f, in, comp), KL_OK);
	uint16_t h[3], e16[3];
	assert_int_equal(kl_to_host(comp[0], h, sizeof h), KL_OK);
	assert_int_equal(kl_to_host(eager[0], e16, sizeof e16), KL_OK);
	for (int i = 0; i < 3; i++) {
		assert_int_equal(h[i], e16[i]);
		assert_int_equal(h[i], kl__f64_to_f16(xv[i]));
	}
	assert_int_equal(h[0], 0x3c01); /* 1 + 2^-10, not 1.0 */
	assert_int_equal(kl_to_host(comp[1], h, sizeof h), KL_OK);
	assert_int_equal(kl_to_host(eager[1], e16, sizeof e16), KL_OK);
	for (int i = 0; i < 3; i++)
		assert_int_equal(h[i], e16[i]);
	assert_int_equal(h[2], kl__f64_to_bf16(xv[2]));
	for (int k = 2; k < 4; k++) {
		int32_t got[3], want[3];
		assert_int_equal(kl_to_host(comp[k], got, sizeof got), KL_OK);
		assert_int_equal(kl_to_host(eager[k], want, sizeof want), KL_OK);
		for (int i = 0; i < 3; i++) {
			assert_int_equal(got[i], want[i]);
			assert_int_equal(got[i], k == 2 ? INT32_MAX : INT32_MIN);
		}
	}
	for (int i = 0; i < 4; i++) {
		kl_release(eager[i]);
		kl_release(comp[i]);
	}
	kl_fn_free(f);
	kl_release(x);
	kl_release(z);
	kl_ctx_free(ctx);
}

int main(int argc, char **argv)
{
	if (argc >= 2 && !strcmp(argv[1], "--warm-child"))
		return child_warm();
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_kernel_counts),
	        cmocka_unit_test(test_random_graphs_every_mode),
	        cmocka_unit_test(test_graph_break),
	        cmocka_unit_test(test_profile),
	        cmocka_unit_test(test_fullgraph_replay),
	        cmocka_unit_test(test_recompiles_and_limit),
	        cmocka_unit_test(test_dynamic_dims),
	        cmocka_unit_test(test_errors),
	        cmocka_unit_test(test_logs),
	        cmocka_unit_test(test_warm_process),
	        cmocka_unit_test(test_conversion_edges),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
