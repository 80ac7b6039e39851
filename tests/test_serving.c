/* test_serving.c - state that lives on the device (issue 23): KV-cache
 * writes at run-time positions (kl_cache_write in place, kl_cache_update)
 * eagerly and inside compiled graphs, where the step writes only the new
 * rows into the cache's own memory and one variant serves every position
 * and batch size; attention over caches with a valid length per row
 * (kl_sdpa_lengths); bad positions and lengths as clear errors that write
 * nothing. Every result is compared with a float64 model computed here.
 * Runs on CUDA device 0 with KILN_TEST_DEVICE=cuda (test_serving_cuda).
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

#include "kltest.h"
#include "runtime/runtime_int.h"
#ifdef KILN_HAVE_CUDA
#include "runtime/cuda/exec_cuda.h"
#endif

static kl_ctx *ctx;

/* ---- a float64 model ---------------------------------------------------------------- */

enum { R = 4, H = 2, T = 8, D = 3 };

/* cache [R, H, T, D]: rows 0..n-1 of val [n, H, s, D] at pos[i] */
static void model_write(double *cache, const double *val, const int64_t *pos, int n, int s)
{
	for (int i = 0; i < n; i++)
		for (int h = 0; h < H; h++)
			for (int j = 0; j < s; j++)
				for (int d = 0; d < D; d++)
					cache[((i * H + h) * T + pos[i] + j) * D + d] =
					        val[((i * H + h) * s + j) * D + d];
}

/* cache [r, h, t, d] gets scale * val [r, h, s, d] at pos[i] (any sizes) */
static void model_rows(double *cache, const double *val, const int64_t *pos, double scale,
                       int r, int h, int t, int s, int d)
{
	for (int i = 0; i < r; i++)
		for (int a = 0; a < h; a++)
			for (int j = 0; j < s; j++)
				for (int k = 0; k < d; k++)
					cache[((i * h + a) * t + pos[i] + j) * d + k] =
					        scale * val[((i * h + a) * s + j) * d + k];
}

/* o [R, H, tq, D] = attention of q [R, H, tq, D] over kc, vc with lengths */
static void model_attn(double *o, const double *q, const double *kc, const double *vc,
                       const int64_t *len, int tq, bool causal)
{
	double sc = 1.0 / sqrt((double)D);
	for (int b = 0; b < R; b++)
		for (int h = 0; h < H; h++)
			for (int i = 0; i < tq; i++) {
				double s[T], m = -INFINITY, z = 0;
				int n = 0;
				for (int j = 0; j < T; j++) {
					bool ok = j < len[b] && (!causal || j <= i + len[b] - tq);
					s[j] = -INFINITY;
					if (!ok)
						continue;
					double acc = 0;
					for (int d = 0; d < D; d++)
						acc += q[((b * H + h) * tq + i) * D + d] *
						       kc[((b * H + h) * T + j) * D + d];
					s[j] = acc * sc;
					m = s[j] > m ? s[j] : m;
					n++;
				}
				for (int j = 0; j < T; j++)
					z += isinf(s[j]) ? 0 : exp(s[j] - m);
				for (int d = 0; d < D; d++) {
					double acc = 0;
					for (int j = 0; n && j < T; j++)
						acc += isinf(s[j]) ? 0
						                   : exp(s[j] - m) / z *
						                             vc[((b * H + h) * T + j) * D + d];
					o[((b * H + h) * tq + i) * D + d] = acc;
				}
			}
}

static kl_tensor *from(kl_dtype dt, int nd, const int64_t *sh, const double *v)
{
	kl_tensor *t = kltest_from_values(ctx, dt, nd, sh, v, KLTEST_CONTIG);
	assert_non_null(t);
	return t;
}

static kl_tensor *positions(const int64_t *p, int n)
{
	double v[R];
	for (int i = 0; i < n; i++)
		v[i] = (double)p[i];
	return from(KL_I64, 1, (int64_t[]){n}, v);
}

static bool same_values(kl_tensor *t, const double *ref, int64_t n, const char *what)
{
	double *v = kltest_read(t);
	assert_non_null(v);
	bool ok = kltest_compare(what, kl_tensor_dtype(t), 1, (int64_t[]){n}, v, ref, 2);
	free(v);
	return ok;
}

static void fill(double *v, int64_t n, uint64_t *seed)
{
	for (int64_t i = 0; i < n; i++)
		v[i] = kltest_uniform(seed) * 2 - 1;
}

/* ---- eager ----------------------------------------------------------------------- */

static void test_cache_write_eager(void **state)
{
	(void)state;
	uint64_t seed = 7;
	double ref[R * H * T * D], val[R * H * 2 * D];
	fill(ref, R * H * T * D, &seed);
	fill(val, R * H * 2 * D, &seed);
	kl_tensor *cache = from(KL_F32, 4, (int64_t[]){R, H, T, D}, ref);
	kl_tensor *v = from(KL_F32, 4, (int64_t[]){3, H, 2, D}, val);
	int64_t pos[3] = {0, 6, 3};
	kl_tensor *p = positions(pos, 3);
	/* the functional form leaves the cache alone */
	double want[R * H * T * D];
	memcpy(want, ref, sizeof want);
	model_write(want, val, pos, 3, 2);
	kl_tensor *copy = kl_cache_update(cache, 2, p, v);
	assert_non_null(copy);
	assert_true(same_values(copy, want, R * H * T * D, "kl_cache_update"));
	assert_true(same_values(cache, ref, R * H * T * D, "cache after kl_cache_update"));
	/* in place, axis counted from the end */
	assert_int_equal(kl_cache_write(cache, -2, p, v), KL_OK);
	assert_true(same_values(cache, want, R * H * T * D, "kl_cache_write"));
	kl_release(copy);
	kl_release(cache);
	kl_release(v);
	kl_release(p);
}

/* ---- compiled: a decode step over caches reached through user state ---------------- */

typedef struct decode {
	kl_tensor *kc, *vc;
	bool read_old; /* also return the sum of the k cache before the write */
} decode;

/* in: q [R, H, 1, D], k and v [n, H, 1, D] (n <= R new tokens), pos [n],
 * lengths [R]; out: attention [R, H, 1, D] (and the old k cache's sum) */
static kl_status decode_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                             int nout, void *user)
{
	(void)nin;
	decode *d = user;
	if (d->read_old && !(out[1] = kl_sum(d->kc, 0, NULL, false)))
		return kl_last_status(c);
	kl_status st = kl_cache_write(d->kc, 2, in[3], in[1]);
	if (st == KL_OK)
		st = kl_cache_write(d->vc, 2, in[3], in[2]);
	if (st != KL_OK)
		return st;
	out[0] = kl_sdpa_lengths(in[0], d->kc, d->vc, in[4], false, 0);
	(void)nout;
	return out[0] ? KL_OK : kl_last_status(c);
}

static void expect_msg(const char *what, const char *a, const char *b, const char *c2)
{
	const char *e = kl_last_error(ctx);
	if (!strstr(e, a) || !strstr(e, b) || !strstr(e, c2))
		fail_msg("%s: the error \"%s\" does not name %s, %s and %s", what, e, a, b, c2);
}

static char *explain_str(kl_fn *f)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *m = open_memstream(&buf, &len);
	assert_non_null(m);
	assert_int_equal(kl_explain(f, m), KL_OK);
	fclose(m);
	return buf;
}

static void run_decode(bool read_old, bool full)
{
	uint64_t seed = 11 + read_old;
	double kc[R * H * T * D] = {0}, vc[R * H * T * D] = {0};
	decode d = {.kc = from(KL_F32, 4, (int64_t[]){R, H, T, D}, kc),
	            .vc = from(KL_F32, 4, (int64_t[]){R, H, T, D}, vc),
	            .read_old = read_old};
	/* the new tokens' rows and the positions are dynamic: one variant */
	kl_fn *f = kl_compile(ctx, decode_body, &d, 5, read_old ? 2 : 1,
	                      &(kl_compile_opts){.fullgraph = full,
	                                         .ndynamic_dims = 4,
	                                         .dynamic_dims = (uint32_t[]){0, 1, 1, 1}});
	assert_non_null(f);
	int64_t len[R] = {0, 0, 0, 0};
	/* each step: rows 0..n-1 get one token at their current length */
	static const int ns[] = {4, 3, 4, 2, 4, 1, 3};
	for (size_t step = 0; step < sizeof ns / sizeof ns[0]; step++) {
		int n = ns[step];
		double q[R * H * D], k[R * H * D], v[R * H * D], o[R * H * D];
		fill(q, R * H * D, &seed);
		fill(k, n * H * D, &seed);
		fill(v, n * H * D, &seed);
		double old = 0;
		for (int i = 0; i < R * H * T * D; i++)
			old += kc[i];
		int64_t pos[R];
		memcpy(pos, len, sizeof pos);
		model_write(kc, k, pos, n, 1);
		model_write(vc, v, pos, n, 1);
		for (int i = 0; i < n; i++)
			len[i]++;
		model_attn(o, q, kc, vc, len, 1, false);
		kl_tensor *in[5] = {from(KL_F32, 4, (int64_t[]){R, H, 1, D}, q),
		                    from(KL_F32, 4, (int64_t[]){n, H, 1, D}, k),
		                    from(KL_F32, 4, (int64_t[]){n, H, 1, D}, v), positions(pos, n),
		                    positions(len, R)};
		kl_tensor *out[2] = {NULL, NULL};
		assert_int_equal(kl_fn_call(f, in, out), KL_OK);
		char what[128];
		snprintf(what, sizeof what, "decode step %zu (%d new rows)%s", step, n,
		         full ? ", fullgraph" : "");
		assert_true(same_values(out[0], o, R * H * D, what));
		assert_true(same_values(d.kc, kc, R * H * T * D, "k cache"));
		assert_true(same_values(d.vc, vc, R * H * T * D, "v cache"));
		if (read_old)
			assert_true(same_values(out[1], &old, 1, "the k cache before the write"));
		for (int i = 0; i < 5; i++)
			kl_release(in[i]);
		kl_release(out[0]);
		kl_release(out[1]);
		if (step == 3) {
			/* a write from outside (a row moved, as a server does when a
			 * request leaves): the next calls read it, still replaying */
			kl_tensor *src = kl_slice(d.vc, 0, 0, 1, 1), *dst = kl_slice(d.vc, 0, 3, 4, 1);
			assert_int_equal(kl_copy(dst, src), KL_OK);
			kl_release(src);
			kl_release(dst);
			memcpy(vc + 3 * H * T * D, vc, sizeof(double) * H * T * D);
		}
	}
	/* lengths the caches cannot hold, with good positions: the call fails
	 * naming the length and writes neither cache (on CUDA the lengths are
	 * checked on the device, before the writes of the same call) */
	for (int bad = 0; bad < 2; bad++) {
		double q[R * H * D], k[R * H * D];
		fill(q, R * H * D, &seed);
		fill(k, 2 * H * D, &seed);
		int64_t pos[2] = {len[0], len[1]}, l2[R];
		memcpy(l2, len, sizeof l2);
		l2[2] = bad ? -3 : T + 2;
		kl_tensor *in[5] = {from(KL_F32, 4, (int64_t[]){R, H, 1, D}, q),
		                    from(KL_F32, 4, (int64_t[]){2, H, 1, D}, k),
		                    from(KL_F32, 4, (int64_t[]){2, H, 1, D}, k), positions(pos, 2),
		                    positions(l2, R)};
		kl_tensor *out[2] = {NULL, NULL};
		char want[32];
		snprintf(want, sizeof want, "lengths[2] = %lld", (long long)l2[2]);
		kl_clear_error(ctx);
		assert_int_equal(kl_fn_call(f, in, out), KL_EINVAL);
		expect_msg("decode with a bad length", "kl_sdpa_lengths", want, "disagrees");
		assert_null(out[0]);
		assert_true(same_values(d.kc, kc, R * H * T * D, "k cache after a bad length"));
		assert_true(same_values(d.vc, vc, R * H * T * D, "v cache after a bad length"));
		for (int i = 0; i < 5; i++)
			kl_release(in[i]);
	}
	kl_fn_stats fs;
	assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
	assert_int_equal(fs.compiles, 1); /* every position and row count: one variant */
	/* fullgraph: the writes in place are repeated by the replay, fn
	 * traced once */
	if (full)
		assert_int_equal(fs.replays, (long)(sizeof ns / sizeof ns[0]) - 1);
	char *ex0 = explain_str(f);
	if (full && !strstr(ex0, "repeating its 2 writes in place"))
		fail_msg("kl_explain does not say the replay repeats the writes:\n%s", ex0);
	free(ex0);
	char *ex = explain_str(f);
	if (!strstr(ex, "cache write") || !strstr(ex, "in place"))
		fail_msg("the cache writes are not steps written in place:\n%s", ex);
	free(ex);
	kl_fn_free(f);
	kl_release(d.kc);
	kl_release(d.vc);
}

static void test_cache_write_compiled(void **state)
{
	(void)state;
	run_decode(false, false);
}

/* fullgraph: the plan replays without running fn although fn writes the
 * caches in place (the replay repeats the writes) */
static void test_cache_write_fullgraph(void **state)
{
	(void)state;
	run_decode(false, true);
	run_decode(true, true);
}

/* reading the cache before the write in the same graph sees the old values
 * (the write waits for that read, or copies) */
static void test_cache_write_reads_old(void **state)
{
	(void)state;
	run_decode(true, false);
}

/* The values of cache writes as views: k and v slices of one packed
 * [n, 1, 2 H D] input (rows 2 H D apart, v at an offset) and of a packed
 * value the graph computes; the writes read them where they lie (no copy
 * step) and land where the float64 model puts them. */
typedef struct packed {
	kl_tensor *kc, *vc;
	bool computed; /* the packed rows are in[0] * 2 (a buffer of the graph) */
} packed;

static kl_tensor *head_view(kl_tensor *p, int part, int64_t n)
{
	kl_tensor *s = kl_slice(p, 2, part * H * D, (part + 1) * H * D, 1);
	kl_tensor *r = kl_reshape(s, 4, (int64_t[]){n, 1, H, D});
	return kl_permute(r, (int[]){0, 2, 1, 3});
}

static kl_status packed_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                             int nout, void *user)
{
	(void)nin, (void)nout;
	packed *w = user;
	kl_tensor *p = w->computed ? kl_mul_scalar(in[0], 2) : in[0];
	int64_t n = kl_shape(in[0])[0];
	kl_status st = kl_cache_write(w->kc, 2, in[1], head_view(p, 0, n));
	if (st == KL_OK)
		st = kl_cache_write(w->vc, 2, in[1], head_view(p, 1, n));
	if (st != KL_OK)
		return st;
	out[0] = kl_sum(w->vc, 0, NULL, false);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void test_cache_write_views(void **state)
{
	(void)state;
	uint64_t seed = 91;
	for (int computed = 0; computed < 2; computed++) {
		double kc[R * H * T * D] = {0}, vc[R * H * T * D] = {0};
		packed w = {from(KL_F32, 4, (int64_t[]){R, H, T, D}, kc),
		            from(KL_F32, 4, (int64_t[]){R, H, T, D}, vc), computed};
		kl_fn *f = kl_compile(ctx, packed_body, &w, 2, 1,
		                      &(kl_compile_opts){.fullgraph = true});
		assert_non_null(f);
		int64_t pos[3] = {0, 0, 0};
		for (int step = 0; step < 3; step++) {
			enum { N = 3 };
			double p[N * 2 * H * D], k[N * H * D], v[N * H * D];
			fill(p, N * 2 * H * D, &seed);
			for (int i = 0; i < N; i++)
				for (int h = 0; h < H; h++)
					for (int d = 0; d < D; d++) {
						double sc = computed ? 2 : 1;
						k[(i * H + h) * D + d] = sc * p[i * 2 * H * D + h * D + d];
						v[(i * H + h) * D + d] = sc * p[i * 2 * H * D + H * D + h * D + d];
					}
			model_write(kc, k, pos, N, 1);
			model_write(vc, v, pos, N, 1);
			kl_tensor *in[2] = {from(KL_F32, 3, (int64_t[]){N, 1, 2 * H * D}, p),
			                    positions(pos, N)};
			kl_tensor *out = NULL;
			if (kl_fn_call(f, in, &out) != KL_OK)
				fail_msg("step %d: %s", step, kl_last_error(ctx));
			char what[64];
			snprintf(what, sizeof what, "k cache, step %d%s", step,
			         computed ? ", computed values" : "");
			assert_true(same_values(w.kc, kc, R * H * T * D, what));
			assert_true(same_values(w.vc, vc, R * H * T * D, what));
			kl_release(out);
			kl_release(in[0]);
			kl_release(in[1]);
			for (int i = 0; i < N; i++)
				pos[i] += 1 + i;
		}
		char *ex = explain_str(f);
		if (strstr(ex, "contiguous#") || strstr(ex, "copy"))
			fail_msg("the values were copied before the writes:\n%s", ex);
		free(ex);
		kl_fn_free(f);
		kl_release(w.kc);
		kl_release(w.vc);
	}
}

/* fullgraph with kl_copy: into a tensor fn reaches through user state and
 * into one passed as an input; each call's replay writes it again */
typedef struct acc {
	kl_tensor *s; /* [4] */
	bool as_input;
} acc;

static kl_status acc_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin, (void)nout;
	acc *a = user;
	kl_tensor *s = a->as_input ? in[1] : a->s;
	kl_tensor *next = kl_add(s, in[0]);
	kl_status st = kl_copy(s, next);
	if (st != KL_OK)
		return st;
	out[0] = kl_mul_scalar(next, 2);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void test_copy_fullgraph(void **state)
{
	(void)state;
	for (int as_input = 0; as_input < 2; as_input++) {
		double zero[4] = {0}, sum[4] = {0}, x[4], twice[4];
		uint64_t seed = 500;
		acc a = {from(KL_F32, 1, (int64_t[]){4}, zero), as_input};
		kl_fn *f = kl_compile(ctx, acc_body, &a, 1 + as_input, 1,
		                      &(kl_compile_opts){.fullgraph = true});
		assert_non_null(f);
		for (int k = 0; k < 5; k++) {
			fill(x, 4, &seed);
			for (int i = 0; i < 4; i++) {
				sum[i] += x[i];
				twice[i] = 2 * sum[i];
			}
			kl_tensor *in[2] = {from(KL_F32, 1, (int64_t[]){4}, x), a.s}, *out = NULL;
			if (kl_fn_call(f, in, &out) != KL_OK)
				fail_msg("call %d: %s", k, kl_last_error(ctx));
			assert_true(same_values(out, twice, 4, "the returned sum"));
			assert_true(same_values(a.s, sum, 4, "the state written by kl_copy"));
			kl_release(out);
			kl_release(in[0]);
		}
		kl_fn_stats fs;
		assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
		assert_int_equal(fs.compiles, 1);
		assert_int_equal(fs.replays, 4);
		kl_fn_free(f);
		kl_release(a.s);
	}
}

/* ---- bad input -------------------------------------------------------------------- */

typedef struct one_write {
	kl_tensor *cache;
} one_write;

static kl_status write_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                            int nout, void *user)
{
	(void)nin, (void)nout;
	one_write *w = user;
	kl_status st = kl_cache_write(w->cache, 1, in[0], in[1]);
	if (st != KL_OK)
		return st;
	out[0] = kl_sum(w->cache, 0, NULL, false);
	return out[0] ? KL_OK : kl_last_status(c);
}


static void test_cache_write_errors(void **state)
{
	(void)state;
	double zero[3 * 5 * 2] = {0}, ones[2 * 2 * 2];
	for (int i = 0; i < 8; i++)
		ones[i] = 1;
	one_write w = {.cache = from(KL_F32, 3, (int64_t[]){3, 5, 2}, zero)};
	kl_tensor *v = from(KL_F32, 3, (int64_t[]){2, 2, 2}, ones);
	/* positions past capacity (5 - 2 = 3 is the last start) and negative */
	const int64_t bad[][2] = {{1, 4}, {-1, 0}};
	kl_fn *f = kl_compile(ctx, write_body, &w, 2, 1, NULL);
	assert_non_null(f);
	for (int k = 0; k < 2; k++) {
		kl_tensor *p = positions(bad[k], 2);
		char at[32];
		snprintf(at, sizeof at, "at %lld", (long long)bad[k][k ? 0 : 1]);
		kl_clear_error(ctx);
		assert_int_equal(kl_cache_write(w.cache, 1, p, v), KL_EINVAL);
		expect_msg("eager", "kl_cache_write", at, "[0, 3]");
		assert_true(same_values(w.cache, zero, 30, "cache after a refused write"));
		kl_tensor *out = NULL;
		kl_clear_error(ctx);
		assert_int_equal(kl_fn_call(f, (kl_tensor *[]){p, v}, &out), KL_EINVAL);
		assert_null(out);
		expect_msg("compiled", "kl_cache_write", at, "[0, 3]");
		kl_release(p);
	}
	/* nothing was written by either refused call, on any row */
	assert_true(same_values(w.cache, zero, 30, "cache after refused compiled writes"));
	/* a good call through the same compiled function still works */
	kl_tensor *p = positions((int64_t[]){3, 0}, 2), *out = NULL;
	assert_int_equal(kl_fn_call(f, (kl_tensor *[]){p, v}, &out), KL_OK);
	double eight = 8;
	assert_true(same_values(out, &eight, 1, "the sum after a good write"));
	kl_release(out);
	/* shapes, dtypes and the cache itself */
	kl_tensor *pf = kl_cast(p, KL_F32), *wide = from(KL_F32, 3, (int64_t[]){2, 6, 2}, zero),
	          *rows = from(KL_F32, 3, (int64_t[]){4, 1, 2}, zero);
	kl_clear_error(ctx);
	assert_int_equal(kl_cache_write(w.cache, 1, pf, v), KL_EINVAL);
	expect_msg("float positions", "kl_cache_write", "positions", "i32 or i64");
	kl_clear_error(ctx);
	assert_int_equal(kl_cache_write(w.cache, 1, p, wide), KL_EINVAL);
	expect_msg("too many positions", "kl_cache_write", "[3,5,2]", "[2,6,2]");
	kl_clear_error(ctx);
	assert_int_equal(kl_cache_write(w.cache, 1, p, rows), KL_EINVAL);
	expect_msg("too many rows", "kl_cache_write", "[4,1,2]", "do not fit");
	kl_tensor *view = kl_slice(w.cache, 1, 0, 5, 2);
	kl_clear_error(ctx);
	assert_int_equal(kl_cache_write(view, 1, p, v), KL_EINVAL);
	expect_msg("strided cache", "kl_cache_write", "not dense", "[3,3,2]");
	kl_clear_error(ctx);
	assert_int_equal(kl_cache_write(w.cache, 0, p, v), KL_EINVAL);
	expect_msg("position dim 0", "kl_cache_write", "position dim 0", "row dim first");
	kl_release(view);
	kl_release(pf);
	kl_release(wide);
	kl_release(rows);
	kl_release(p);
	kl_release(v);
	kl_fn_free(f);
	kl_release(w.cache);
}

/* A refused write leaves every cache as it was, on every row, eagerly and
 * compiled (two caches written in one graph; the values span several CUDA
 * blocks and the bad position is on the last row, so no block or row may
 * run ahead of the check). */
typedef struct two_caches {
	kl_tensor *a, *b;
} two_caches;

static kl_status two_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin, (void)nout;
	two_caches *w = user;
	kl_status st = kl_cache_write(w->a, 2, in[0], in[1]);
	if (st == KL_OK)
		st = kl_cache_write(w->b, 2, in[0], kl_mul_scalar(in[1], 2));
	if (st != KL_OK)
		return st;
	out[0] = kl_sum(w->b, 0, NULL, false);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void test_refused_write_untouched(void **state)
{
	(void)state;
	enum { RR = 6, HH = 2, TT = 40, SS = 3, DD = 16, NC = RR * HH * TT * DD,
	       NV = RR * HH * SS * DD };
	uint64_t seed = 99;
	double *ca = malloc(sizeof(double) * NC), *cb = malloc(sizeof(double) * NC),
	       *val = malloc(sizeof(double) * NV);
	assert_true(ca && cb && val);
	fill(ca, NC, &seed);
	fill(cb, NC, &seed);
	fill(val, NV, &seed);
	two_caches w = {from(KL_F32, 4, (int64_t[]){RR, HH, TT, DD}, ca),
	                from(KL_F32, 4, (int64_t[]){RR, HH, TT, DD}, cb)};
	kl_tensor *v = from(KL_F32, 4, (int64_t[]){RR, HH, SS, DD}, val);
	/* rows 0..4 fit, row 5 starts past the last start TT - SS = 37 */
	int64_t pos[RR] = {0, 5, 37, 12, 30, 38};
	double pv[RR];
	for (int i = 0; i < RR; i++)
		pv[i] = (double)pos[i];
	kl_tensor *p = from(KL_I64, 1, (int64_t[]){RR}, pv);
	kl_clear_error(ctx);
	assert_int_equal(kl_cache_write(w.a, 2, p, v), KL_EINVAL);
	expect_msg("eager, last row", "kl_cache_write", "row 5", "at 38");
	assert_true(same_values(w.a, ca, NC, "cache a after a refused eager write"));
	kl_clear_error(ctx);
	assert_null(kl_cache_update(w.a, 2, p, v));
	expect_msg("kl_cache_update", "kl_cache_update", "row 5", "[0, 37]");
	for (int full = 0; full < 2; full++) {
		kl_fn *f = kl_compile(ctx, two_body, &w, 2, 1, &(kl_compile_opts){.fullgraph = full});
		assert_non_null(f);
		kl_tensor *out = NULL;
		kl_clear_error(ctx);
		assert_int_equal(kl_fn_call(f, (kl_tensor *[]){p, v}, &out), KL_EINVAL);
		expect_msg("compiled", "kl_cache_write", "row 5", "at 38");
		assert_null(out);
		assert_true(same_values(w.a, ca, NC, "cache a after a refused compiled write"));
		assert_true(same_values(w.b, cb, NC, "cache b after a refused compiled write"));
		/* good positions through the same function write both caches,
		 * and a refused call after good ones writes nothing */
		int64_t good[RR] = {0, 5, 37, 12, 30, 1};
		double gv[RR];
		for (int i = 0; i < RR; i++)
			gv[i] = (double)good[i];
		kl_tensor *g = from(KL_I64, 1, (int64_t[]){RR}, gv);
		for (int rep = 0; rep < 3; rep++) {
			model_rows(ca, val, good, 1.0, RR, HH, TT, SS, DD);
			model_rows(cb, val, good, 2.0, RR, HH, TT, SS, DD);
			double sb = 0;
			for (int i = 0; i < NC; i++)
				sb += cb[i];
			assert_int_equal(kl_fn_call(f, (kl_tensor *[]){g, v}, &out), KL_OK);
			assert_true(same_values(out, &sb, 1, "the sum of cache b after a good write"));
			kl_release(out);
			out = NULL;
			assert_true(same_values(w.a, ca, NC, "cache a after a good compiled write"));
			kl_clear_error(ctx);
			assert_int_equal(kl_fn_call(f, (kl_tensor *[]){p, v}, &out), KL_EINVAL);
			expect_msg("compiled after good calls", "kl_cache_write", "row 5", "at 38");
			assert_true(same_values(w.a, ca, NC, "cache a after a refused call"));
			assert_true(same_values(w.b, cb, NC, "cache b after a refused call"));
		}
		kl_release(g);
		kl_fn_free(f);
	}
	kl_release(p);
	kl_release(v);
	kl_release(w.a);
	kl_release(w.b);
	free(ca);
	free(cb);
	free(val);
}

/* ---- attention over caches with lengths ------------------------------------------- */

static kl_tensor *sdpa_len_apply(kl_tensor *const *in, const void *param)
{
	return kl_sdpa_lengths(in[0], in[1], in[2], in[3], param != NULL, 0);
}

static kl_status sdpa_len_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                               int nout, void *user)
{
	(void)nin, (void)nout;
	out[0] = sdpa_len_apply(in, user);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void test_sdpa_lengths(void **state)
{
	(void)state;
	uint64_t seed = 21;
	for (int causal = 0; causal < 2; causal++) {
		int tq = causal ? 2 : 1;
		double q[R * H * 2 * D], k[R * H * T * D], v[R * H * T * D], o[R * H * 2 * D];
		fill(q, R * H * tq * D, &seed);
		fill(k, R * H * T * D, &seed);
		fill(v, R * H * T * D, &seed);
		/* a row with no key (zeros), a full one, two partial ones */
		int64_t len[R] = {causal ? 2 : 0, T, 3, 5};
		model_attn(o, q, k, v, len, tq, causal);
		kl_tensor *in[4] = {from(KL_F32, 4, (int64_t[]){R, H, tq, D}, q),
		                    from(KL_F32, 4, (int64_t[]){R, H, T, D}, k),
		                    from(KL_F32, 4, (int64_t[]){R, H, T, D}, v), positions(len, R)};
		const void *param = causal ? "causal" : NULL;
		kl_tensor *e = sdpa_len_apply(in, param);
		assert_non_null(e);
		assert_true(same_values(e, o, R * H * tq * D, "kl_sdpa_lengths eager"));
		kl_fn *f = kl_compile(ctx, sdpa_len_body, (void *)param, 4, 1, NULL);
		kl_tensor *out = NULL;
		assert_int_equal(kl_fn_call(f, in, &out), KL_OK);
		assert_true(same_values(out, o, R * H * tq * D, "kl_sdpa_lengths compiled"));
		/* the op's own graph against the float64 reference interpreter */
		assert_true(kltest_check_op(ctx, "kl_sdpa_lengths", sdpa_len_apply, 4, in, param, 4));
		kl_release(out);
		kl_release(e);
		kl_fn_free(f);
		/* a length the cache cannot hold */
		int64_t over[R] = {1, T + 1, 2, 2};
		kl_tensor *l2 = positions(over, R);
		kl_tensor *in2[4] = {in[0], in[1], in[2], l2};
		char want[64];
		snprintf(want, sizeof want, "holds %d keys", T);
		assert_true(KLTEST_EXPECT_ERROR(ctx, sdpa_len_apply(in2, param), "kl_sdpa_lengths",
		                                "lengths[1] = 9", want));
		/* compiled: checked before the graph runs at every call, replays
		 * included; a negative length too */
		int64_t neg[R] = {1, 2, -1, 2};
		kl_tensor *l3 = positions(neg, R);
		kl_tensor *in3[4] = {in[0], in[1], in[2], l3};
		for (int full = 0; full < 2; full++) {
			f = kl_compile(ctx, sdpa_len_body, (void *)param, 4, 1,
			               &(kl_compile_opts){.fullgraph = full});
			for (int rep = 0; rep < 3; rep++) {
				out = NULL;
				assert_int_equal(kl_fn_call(f, in, &out), KL_OK);
				assert_true(same_values(out, o, R * H * tq * D, "compiled, good lengths"));
				kl_release(out);
				kl_clear_error(ctx);
				assert_int_equal(kl_fn_call(f, in2, &out), KL_EINVAL);
				expect_msg("compiled, a length past the keys", "kl_sdpa_lengths",
				           "lengths[1] = 9", want);
				kl_clear_error(ctx);
				assert_int_equal(kl_fn_call(f, in3, &out), KL_EINVAL);
				expect_msg("compiled, a negative length", "kl_sdpa_lengths",
				           "lengths[2] = -1", want);
			}
			kl_fn_stats fs;
			assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
			assert_int_equal(fs.compiles, 1);
			if (full)
				assert_true(fs.replays >= 2);
			kl_fn_free(f);
		}
		kl_release(l3);
		kl_release(l2);
		for (int i = 0; i < 4; i++)
			kl_release(in[i]);
	}
}

/* ---- one-row products -------------------------------------------------------------- */

/* A decode step's [b, 1, d] @ W^T is one product of b rows, not b products
 * of one row: with a residual epilogue, and with A the last row of a
 * [b, T, d] sequence (row stride T * d); b dynamic. */
static kl_tensor *row_apply(kl_tensor *const *in, const void *param)
{
	if (param) { /* the last position of in[0] [b, T, d] */
		int64_t t = kl_shape(in[0])[1];
		return kl_linear(kl_slice(in[0], 1, t - 1, t, 1), in[1], in[2]);
	}
	return kl_add(kl_linear(kl_rms_norm(in[0], NULL, 1e-5), in[1], in[2]), in[3]);
}

static kl_status row_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin, (void)nout;
	out[0] = row_apply(in, user);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void test_one_row_fold(void **state)
{
	(void)state;
	kl_scope_begin(ctx);
	for (int sliced = 0; sliced < 2; sliced++) {
		const void *param = sliced ? "sliced" : NULL;
		kl_fn *f = kl_compile(ctx, row_body, (void *)param, sliced ? 3 : 4, 1,
		                      &(kl_compile_opts){.ndynamic_dims = sliced ? 3 : 4,
		                                         .dynamic_dims = (uint32_t[]){KL_DIM(0), 0, 0,
		                                                                      KL_DIM(0)}});
		assert_non_null(f);
		for (int64_t b = 6; b >= 2; b -= 2) {
			kl_tensor *in[4] = {
			        kltest_rand(ctx, KL_F32, 3, (int64_t[]){b, sliced ? 5 : 1, 24},
			                    KLTEST_NORMAL, KLTEST_CONTIG, 40 + (uint64_t)b),
			        kltest_rand(ctx, KL_F32, 2, (int64_t[]){40, 24}, KLTEST_NORMAL,
			                    KLTEST_CONTIG, 41),
			        kltest_rand(ctx, KL_F32, 1, (int64_t[]){40}, KLTEST_NORMAL, KLTEST_CONTIG,
			                    42),
			        kltest_rand(ctx, KL_F32, 3, (int64_t[]){b, 1, 40}, KLTEST_NORMAL,
			                    KLTEST_CONTIG, 43 + (uint64_t)b)};
			int nd;
			int64_t sh[KL_MAX_DIMS];
			kl_dtype dt;
			double *ref = kltest_reference(ctx, "one-row product", row_apply, in, param, &nd,
			                               sh, &dt);
			assert_non_null(ref);
			kl_tensor *out = NULL;
			if (kl_fn_call(f, in, &out) != KL_OK)
				fail_msg("batch %lld: %s", (long long)b, kl_last_error(ctx));
			char what[128];
			snprintf(what, sizeof what, "one-row product%s at batch %lld",
			         sliced ? " (last row of a sequence)" : "", (long long)b);
			assert_true(same_values(out, ref, b * 40, what));
			free(ref);
			kl_release(out);
		}
		kl_fn_stats fs;
		assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
		assert_int_equal(fs.compiles, 1);
		char *ex = explain_str(f);
		if (strstr(ex, "bmm") || !strstr(ex, "matmul 6x40x24"))
			fail_msg("the one-row products are not one product of b rows:\n%s", ex);
		free(ex);
		kl_fn_free(f);
	}
	kl_scope_end(ctx);
}

/* ---- shape buckets ------------------------------------------------------------------ */

typedef struct mlp {
	kl_tensor *w, *bias;
} mlp;

/* rows independent of each other: y = softmax(x W^T + b), s = colsum(x2); and
 * the weight returned whole */
static kl_status mlp_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin, (void)nout;
	mlp *m = user;
	out[0] = kl_softmax(kl_linear(in[0], m->w, m->bias), -1);
	out[1] = kl_sum(in[1], 1, (int[]){0}, false); /* [b] */
	out[2] = kl_mul_scalar(m->bias, 2);
	return out[0] && out[1] && out[2] ? KL_OK : kl_last_status(c);
}

static void test_bucket_padding(void **state)
{
	(void)state;
	kl_scope_begin(ctx);
	mlp m = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 6}, KLTEST_NORMAL, KLTEST_CONTIG, 3),
	         kltest_rand(ctx, KL_F32, 1, (int64_t[]){5}, KLTEST_NORMAL, KLTEST_CONTIG, 4)};
	kl_fn *f = kl_compile(ctx, mlp_body, &m, 2, 3,
	                      &(kl_compile_opts){.nbuckets = 4,
	                                         .buckets = (int64_t[]){1, 2, 4, 8},
	                                         .bucket_in_dims = (int[]){0, 1},
	                                         .bucket_out_dims = (int[]){0, 0, -1}});
	assert_non_null(f);
	long padded = 0;
	/* traced first at 8 (a dim first traced at 1 would be specialised) */
	for (int64_t b = 8; b >= 1; b--) {
		kl_tensor *in[2] = {
		        kltest_rand(ctx, KL_F32, 2, (int64_t[]){b, 6}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    10 + (uint64_t)b),
		        kltest_rand(ctx, KL_F32, 2, (int64_t[]){3, b}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    20 + (uint64_t)b)};
		kl_tensor *want[3], *got[3];
		assert_int_equal(mlp_body(ctx, in, 2, want, 3, &m), KL_OK); /* eager, unpadded */
		if (kl_fn_call(f, in, got) != KL_OK)
			fail_msg("batch %lld: %s", (long long)b, kl_last_error(ctx));
		padded += b != 1 && b != 2 && b != 4 && b != 8;
		for (int j = 0; j < 3; j++) {
			assert_int_equal(kl_ndim(got[j]), kl_ndim(want[j]));
			for (int d = 0; d < kl_ndim(got[j]); d++)
				assert_int_equal(kl_shape(got[j])[d], kl_shape(want[j])[d]);
			double *w = kltest_read(want[j]);
			char what[64];
			snprintf(what, sizeof what, "output %d at batch %lld", j, (long long)b);
			assert_true(same_values(got[j], w, kl_numel(want[j]), what));
			free(w);
			kl_release(got[j]);
		}
	}
	kl_fn_stats fs;
	assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
	assert_int_equal(fs.padded_calls, padded);
	assert_int_equal(fs.compiles, 1);
	char *ex = explain_str(f);
	if (!strstr(ex, "buckets (batch padded up to the nearest): 4 sizes, 1..8"))
		fail_msg("kl_explain does not state the buckets:\n%s", ex);
	free(ex);
	/* above the largest bucket; batches that disagree */
	kl_tensor *big[2] = {kl_zeros(ctx, KL_F32, 2, (int64_t[]){9, 6}),
	                     kl_zeros(ctx, KL_F32, 2, (int64_t[]){3, 9})};
	kl_tensor *out[3];
	kl_clear_error(ctx);
	assert_int_equal(kl_fn_call(f, big, out), KL_EINVAL);
	expect_msg("over the buckets", "batch 9", "input 0 dim 0", "largest bucket 8");
	kl_tensor *odd[2] = {big[0], kl_zeros(ctx, KL_F32, 2, (int64_t[]){3, 4})};
	kl_clear_error(ctx);
	assert_int_equal(kl_fn_call(f, odd, out), KL_EINVAL);
	expect_msg("batches differ", "batch dims differ", "input 0 dim 0 is 9", "input 1 dim 1 is 4");
	kl_fn_free(f);
	/* the default list, and bad options */
	f = kl_compile(ctx, mlp_body, &m, 2, 3,
	               &(kl_compile_opts){.nbuckets = KL_BUCKETS_DEFAULT,
	                                  .bucket_in_dims = (int[]){0, 1},
	                                  .bucket_out_dims = (int[]){0, 0, -1}});
	assert_non_null(f);
	ex = explain_str(f);
	if (!strstr(ex, "51 sizes, 1..512"))
		fail_msg("the default buckets:\n%s", ex);
	free(ex);
	kl_fn_free(f);
	kl_clear_error(ctx);
	assert_null(kl_compile(ctx, mlp_body, &m, 2, 3,
	                       &(kl_compile_opts){.nbuckets = 2, .buckets = (int64_t[]){4, 2},
	                                          .bucket_in_dims = (int[]){0, 1},
	                                          .bucket_out_dims = (int[]){0, 0, -1}}));
	expect_msg("descending", "kl_compile", "buckets", "ascending");
	kl_clear_error(ctx);
	assert_null(kl_compile(ctx, mlp_body, &m, 2, 3,
	                       &(kl_compile_opts){.nbuckets = 2, .buckets = (int64_t[]){2, 4}}));
	expect_msg("no dims", "kl_compile", "bucket_in_dims", "batch dim");
	kl_scope_end(ctx);
}

/* ---- the recompile limit on bucket variants ------------------------------------------ */

typedef struct rows_of {
	kl_tensor *c; /* [16, 3] */
} rows_of;

/* x [b, 3] + the first b rows of c: the slice's bounds specialise the
 * batch dim, so each bucket is a variant of its own */
static kl_status rows_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin, (void)nout;
	rows_of *r = user;
	int64_t b = kl_shape(in[0])[0];
	out[0] = kl_add(in[0], kl_slice(r->c, 0, 0, b, 1));
	return out[0] ? KL_OK : kl_last_status(c);
}

/* one call of f at batch b, checked against x + c's rows in float64 */
static void rows_call(kl_fn *f, const double *cv, int64_t b)
{
	double x[16 * 3], want[16 * 3];
	uint64_t seed = 300 + (uint64_t)b;
	fill(x, b * 3, &seed);
	for (int64_t i = 0; i < b * 3; i++)
		want[i] = x[i] + cv[i];
	kl_tensor *in = from(KL_F32, 2, (int64_t[]){b, 3}, x), *out = NULL;
	if (kl_fn_call(f, &in, &out) != KL_OK)
		fail_msg("batch %lld: %s", (long long)b, kl_last_error(ctx));
	char what[96];
	snprintf(what, sizeof what, "bucketed call at batch %lld", (long long)b);
	assert_true(same_values(out, want, b * 3, what));
	kl_release(out);
	kl_release(in);
}

static void test_bucket_recompile_limit(void **state)
{
	(void)state;
	double cv[16 * 3];
	uint64_t seed = 77;
	fill(cv, 16 * 3, &seed);
	rows_of r = {from(KL_F32, 2, (int64_t[]){16, 3}, cv)};
	/* a limit below the bucket count: the warning names the dim, the
	 * buckets and the limit that fits; compiled buckets keep serving */
	kl_fn *f = kl_compile(ctx, rows_body, &r, 1, 1,
	                      &(kl_compile_opts){.recompile_limit = 2, .nbuckets = 5,
	                                         .buckets = (int64_t[]){1, 2, 4, 8, 16},
	                                         .bucket_in_dims = (int[]){0},
	                                         .bucket_out_dims = (int[]){0}});
	assert_non_null(f);
	rows_call(f, cv, 1);
	rows_call(f, cv, 2);
	const char *reason = kl_fn_recompile_reason(f, 0);
	assert_non_null(reason);
	if (!strstr(reason, "input 0 dim 0") || !strstr(reason, "buckets 1, 2, 4, 8, 16"))
		fail_msg("the recompile reason does not name the bucket dim: %s", reason);
	fflush(stderr);
	FILE *tmp = tmpfile();
	assert_non_null(tmp);
	int saved = dup(2);
	assert_true(saved >= 0 && dup2(fileno(tmp), 2) >= 0);
	rows_call(f, cv, 3); /* bucket 4: past the limit, eager */
	rows_call(f, cv, 5); /* bucket 8: eager, no second warning */
	fflush(stderr);
	assert_true(dup2(saved, 2) >= 0);
	close(saved);
	char msg[2048] = {0};
	rewind(tmp);
	size_t got = fread(msg, 1, sizeof msg - 1, tmp);
	fclose(tmp);
	msg[got] = 0;
	const char *want[] = {"recompile limit (2 variants)", "input 0 dim 0",
	                      "buckets 1, 2, 4, 8, 16 (5 sizes)", "specialises it",
	                      "recompile_limit to at least 5"};
	for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
		if (!strstr(msg, want[k]))
			fail_msg("the recompile-limit warning does not say \"%s\":\n%s", want[k], msg);
	if (strstr(strstr(msg, "warning") + 1, "warning"))
		fail_msg("warned twice:\n%s", msg);
	kl_fn_stats fs;
	assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
	assert_true(fs.over_limit);
	assert_int_equal(fs.eager_calls, 2);
	rows_call(f, cv, 2); /* a compiled bucket still serves */
	assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
	assert_int_equal(fs.eager_calls, 2);
	assert_int_equal(fs.compiles, 2);
	kl_fn_free(f);
	/* the default limit leaves room for every bucket (12 > 8) */
	int64_t bk[12];
	for (int k = 0; k < 12; k++)
		bk[k] = k + 1;
	f = kl_compile(ctx, rows_body, &r, 1, 1,
	               &(kl_compile_opts){.nbuckets = 12, .buckets = bk,
	                                  .bucket_in_dims = (int[]){0},
	                                  .bucket_out_dims = (int[]){0}});
	assert_non_null(f);
	for (int64_t b = 12; b >= 1; b--)
		rows_call(f, cv, b);
	assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
	assert_false(fs.over_limit);
	assert_int_equal(fs.compiles, 12);
	assert_int_equal(fs.eager_calls, 0);
	kl_fn_free(f);
	kl_release(r.c);
}

/* which graph serves a call of a plan with dynamic dims (graph_slots.c):
 * its own sizes' slot, a new one below the limit, else the least recently
 * used one */
static void test_graph_slots_pick(void **state)
{
	(void)state;
	enum { MAX = 3 };
	int64_t keys[MAX * KL_GSLOT_KEY] = {0};
	uint64_t used[MAX] = {0}, tick = 0;
	int n = 0;
	kl_gslot_pick_how how;
	/* sizes (b, t): three new, a hit, then a fourth evicts the oldest use */
	const int64_t calls[][2] = {{1, 5}, {2, 5}, {4, 5}, {1, 5}, {8, 5}, {1, 5}, {2, 5}};
	const int want_slot[] = {0, 1, 2, 0, 1, 0, 2};
	const kl_gslot_pick_how want_how[] = {KL_GSLOT_NEW, KL_GSLOT_NEW, KL_GSLOT_NEW,
	                                      KL_GSLOT_HIT, KL_GSLOT_EVICT, KL_GSLOT_HIT,
	                                      KL_GSLOT_EVICT};
	for (int c = 0; c < 7; c++) {
		int i = kl__gslot_pick(keys, used, n, MAX, 2, calls[c], &how);
		if (i != want_slot[c] || how != want_how[c])
			fail_msg("call %d (%lld, %lld): slot %d how %d, want slot %d how %d", c,
			         (long long)calls[c][0], (long long)calls[c][1], i, (int)how,
			         want_slot[c], (int)want_how[c]);
		if (how == KL_GSLOT_NEW)
			n++;
		memcpy(keys + (size_t)i * KL_GSLOT_KEY, calls[c], sizeof calls[c]);
		used[i] = ++tick;
	}
	/* the second symbol alone differs: a different slot */
	int i = kl__gslot_pick(keys, used, n, MAX, 2, (const int64_t[]){1, 6}, &how);
	assert_int_equal(how, KL_GSLOT_EVICT);
	assert_int_not_equal(i, 0);
	setenv("KILN_CUDA_GRAPHS_MAX", "5", 1);
	assert_int_equal(kl__gslot_limit(), 5);
	setenv("KILN_CUDA_GRAPHS_MAX", "0", 1);
	assert_int_equal(kl__gslot_limit(), KL_GSLOT_DEFAULT);
	unsetenv("KILN_CUDA_GRAPHS_MAX");
}

/* reduce-overhead with shape buckets: the plan's batch dim is dynamic, and
 * on CUDA each bucket gets its own graph (warm-up, capture, then replays;
 * kl_fn_stats.graph_captures), every result equal to the eager unpadded
 * call; with KILN_CUDA_GRAPHS_MAX=2 the least recently used bucket's graph
 * is given up and captured again when its bucket returns. On the CPU the
 * same calls run as the default mode (no graphs). */
static void test_bucket_graphs(void **state)
{
	(void)state;
	bool cuda = kl_ctx_device(ctx) == KL_CUDA;
	kl_scope_begin(ctx);
	mlp m = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 6}, KLTEST_NORMAL, KLTEST_CONTIG, 5),
	         kltest_rand(ctx, KL_F32, 1, (int64_t[]){5}, KLTEST_NORMAL, KLTEST_CONTIG, 6)};
	for (int limited = 0; limited < 2; limited++) {
		if (limited)
			setenv("KILN_CUDA_GRAPHS_MAX", "2", 1);
		kl_fn *f = kl_compile(ctx, mlp_body, &m, 2, 3,
		                      &(kl_compile_opts){.mode = KL_MODE_REDUCE_OVERHEAD,
		                                         .nbuckets = 4,
		                                         .buckets = (int64_t[]){1, 2, 4, 8},
		                                         .bucket_in_dims = (int[]){0, 1},
		                                         .bucket_out_dims = (int[]){0, 0, -1}});
		assert_non_null(f);
		/* buckets 8, 4, 2, 1 each called 3 times, then 8 and 4 again */
		const int64_t bs[] = {8, 7, 8, 3, 4, 4, 2, 2, 2, 1, 1, 1, 8, 5, 4};
		long replays0 = 0;
#ifdef KILN_HAVE_CUDA
		kl_cuda_counters cc;
		kl__cuda_counters(&cc);
		replays0 = cc.replays;
#endif
		for (size_t c = 0; c < sizeof bs / sizeof bs[0]; c++) {
			int64_t b = bs[c];
			kl_tensor *in[2] = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){b, 6},
			                                KLTEST_NORMAL, KLTEST_CONTIG, 40 + c),
			                    kltest_rand(ctx, KL_F32, 2, (int64_t[]){3, b},
			                                KLTEST_NORMAL, KLTEST_CONTIG, 60 + c)};
			kl_tensor *want[3], *got[3];
			assert_int_equal(mlp_body(ctx, in, 2, want, 3, &m), KL_OK);
			if (kl_fn_call(f, in, got) != KL_OK)
				fail_msg("batch %lld: %s", (long long)b, kl_last_error(ctx));
			for (int j = 0; j < 3; j++) {
				double *w = kltest_read(want[j]);
				char what[80];
				snprintf(what, sizeof what, "call %zu, output %d at batch %lld%s", c, j,
				         (long long)b, limited ? " (2 graphs kept)" : "");
				assert_int_equal(kl_numel(got[j]), kl_numel(want[j]));
				assert_true(same_values(got[j], w, kl_numel(want[j]), what));
				free(w);
				kl_release(got[j]);
			}
		}
		kl_fn_stats fs;
		assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
		assert_int_equal(fs.compiles, 1);
		/* one warm-up a bucket's graph, then a capture (its second call;
		 * a re-capture when a buffer a library call holds moved, at most
		 * one a buffer); kept 2: 8 comes back after 2 and 1 took the
		 * places (warm-up, capture), then 4 (warm-up). Every call but a
		 * warm-up launches its graph (the capturing call too). KILN_LOGS=
		 * cudagraphs says what happened. */
		long want = !cuda ? 0 : limited ? 5 : 4, warm = limited ? 6 : 4;
		if (fs.graph_captures < want || fs.graph_captures > 2 * want)
			fail_msg("%s%s: %ld graph captures, want %ld", cuda ? "cuda" : "cpu",
			         limited ? " (2 graphs kept)" : "", fs.graph_captures, want);
#ifdef KILN_HAVE_CUDA
		kl__cuda_counters(&cc);
		long nc = (long)(sizeof bs / sizeof bs[0]);
		/* at most every call but the warm-ups; at least every call but a
		 * warm-up and one more call a bucket (a re-capture after a library
		 * call's buffer moved goes through a warm-up again) */
		long nl = (long)(cc.replays - replays0);
		if (cuda && (nl > nc - warm || nl < nc - 2 * warm))
			fail_msg("cuda%s: %ld graph launches in %ld calls, want %ld..%ld",
			         limited ? " (2 graphs kept)" : "", nl, nc, nc - 2 * warm, nc - warm);
		if (cuda)
			print_message("bucket graphs%s: %ld captures, %ld launches in %ld calls\n",
			              limited ? " (2 graphs kept)" : "", (long)fs.graph_captures, nl, nc);
#else
		(void)replays0, (void)warm;
#endif
		kl_fn_free(f);
	}
	unsetenv("KILN_CUDA_GRAPHS_MAX");
	kl_scope_end(ctx);
}

/* kl_fn_warmup: every bucket compiled (and on CUDA captured) ahead of
 * time; the calls after it at any batch compile and capture nothing, and
 * their results equal the eager unpadded call's */
static void test_bucket_warmup(void **state)
{
	(void)state;
	bool cuda = kl_ctx_device(ctx) == KL_CUDA;
	kl_scope_begin(ctx);
	mlp m = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){5, 6}, KLTEST_NORMAL, KLTEST_CONTIG, 7),
	         kltest_rand(ctx, KL_F32, 1, (int64_t[]){5}, KLTEST_NORMAL, KLTEST_CONTIG, 8)};
	kl_fn *f = kl_compile(ctx, mlp_body, &m, 2, 3,
	                      &(kl_compile_opts){.mode = KL_MODE_REDUCE_OVERHEAD,
	                                         .nbuckets = 4,
	                                         .buckets = (int64_t[]){1, 2, 4, 8},
	                                         .bucket_in_dims = (int[]){0, 1},
	                                         .bucket_out_dims = (int[]){0, 0, -1}});
	assert_non_null(f);
	/* example inputs at batch 3: buckets 1 and 2 take their first rows,
	 * 4 and 8 pad them */
	kl_tensor *ex[2] = {
	        kltest_rand(ctx, KL_F32, 2, (int64_t[]){3, 6}, KLTEST_NORMAL, KLTEST_CONTIG, 9),
	        kltest_rand(ctx, KL_F32, 2, (int64_t[]){3, 3}, KLTEST_NORMAL, KLTEST_CONTIG, 10)};
	kl_clear_error(ctx);
	assert_int_equal(kl_fn_warmup(f, ex, 16), KL_EINVAL);
	expect_msg("max_batch over the buckets", "kl_fn_warmup", "max_batch 16", "largest bucket 8");
	kl_tensor *odd[2] = {ex[0], kl_zeros(ctx, KL_F32, 2, (int64_t[]){3, 2})};
	kl_clear_error(ctx);
	assert_int_equal(kl_fn_warmup(f, odd, 0), KL_EINVAL);
	expect_msg("batches differ", "kl_fn_warmup", "batch dims differ", "input 1 dim 1 is 2");
	if (kl_fn_warmup(f, ex, 0) != KL_OK)
		fail_msg("kl_fn_warmup: %s", kl_last_error(ctx));
	kl_fn_stats w;
	assert_int_equal(kl_fn_get_stats(f, &w), KL_OK);
	assert_int_equal(w.compiles, 1);
	assert_int_equal(w.calls, cuda ? 12 : 4);
	if (cuda && w.graph_captures < 4)
		fail_msg("kl_fn_warmup captured %ld graphs for 4 buckets", w.graph_captures);
	for (int64_t b = 8; b >= 1; b--) {
		kl_tensor *in[2] = {
		        kltest_rand(ctx, KL_F32, 2, (int64_t[]){b, 6}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    70 + (uint64_t)b),
		        kltest_rand(ctx, KL_F32, 2, (int64_t[]){3, b}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    80 + (uint64_t)b)};
		kl_tensor *want[3], *got[3];
		assert_int_equal(mlp_body(ctx, in, 2, want, 3, &m), KL_OK);
		if (kl_fn_call(f, in, got) != KL_OK)
			fail_msg("batch %lld: %s", (long long)b, kl_last_error(ctx));
		for (int j = 0; j < 3; j++) {
			double *wv = kltest_read(want[j]);
			char what[80];
			snprintf(what, sizeof what, "after warm-up, output %d at batch %lld", j,
			         (long long)b);
			assert_int_equal(kl_numel(got[j]), kl_numel(want[j]));
			assert_true(same_values(got[j], wv, kl_numel(want[j]), what));
			free(wv);
			kl_release(got[j]);
		}
	}
	kl_fn_stats fs;
	assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
	assert_int_equal(fs.compiles, 1);
	assert_int_equal(fs.recompiles, 0);
	if (fs.graph_captures != w.graph_captures)
		fail_msg("%ld CUDA graph captures after kl_fn_warmup", fs.graph_captures -
		         w.graph_captures);
	kl_fn_free(f);
	/* a function without buckets */
	f = kl_compile(ctx, mlp_body, &m, 2, 3, NULL);
	kl_clear_error(ctx);
	assert_int_equal(kl_fn_warmup(f, ex, 0), KL_EINVAL);
	expect_msg("no buckets", "kl_fn_warmup", "no buckets", "nbuckets");
	kl_fn_free(f);
	kl_scope_end(ctx);
}

/* a graph break splits a call into pieces: under reduce-overhead on CUDA
 * each graph is a CUDA graph of its own, the host work between them, and
 * kl_explain lists the pieces */
static kl_status break_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                            int nout, void *user)
{
	(void)nin, (void)nout, (void)user;
	kl_tensor *y = kl_mul_scalar(in[0], 2);
	double s = 0;
	kl_status st = y ? kl_item(kl_sum(y, 0, NULL, false), &s) : kl_last_status(c);
	if (st != KL_OK)
		return st;
	out[0] = kl_add_scalar(y, s);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void test_graph_pieces(void **state)
{
	(void)state;
	bool cuda = kl_ctx_device(ctx) == KL_CUDA;
	kl_fn *f = kl_compile(ctx, break_body, NULL, 1, 1,
	                      &(kl_compile_opts){.mode = KL_MODE_REDUCE_OVERHEAD});
	assert_non_null(f);
	for (int k = 0; k < 4; k++) {
		double x[6], want[6], sum = 0;
		uint64_t seed = 500 + (uint64_t)k;
		fill(x, 6, &seed);
		for (int i = 0; i < 6; i++)
			sum += 2 * x[i];
		for (int i = 0; i < 6; i++)
			want[i] = 2 * x[i] + sum;
		kl_tensor *in = from(KL_F32, 2, (int64_t[]){2, 3}, x), *out = NULL;
		if (kl_fn_call(f, &in, &out) != KL_OK)
			fail_msg("call %d: %s", k, kl_last_error(ctx));
		assert_true(same_values(out, want, 6, "a call over a graph break"));
		kl_release(out);
		kl_release(in);
	}
	char *ex = explain_str(f);
	if (cuda && (!strstr(ex, "pieces: CUDA graph 0 | host: ") || !strstr(ex, "| CUDA graph 1") ||
	             !strstr(ex, "CUDA graph (piece 2 of 2)")))
		fail_msg("kl_explain does not list the pieces:\n%s", ex);
	if (!cuda && strstr(ex, "pieces:"))
		fail_msg("pieces on the CPU:\n%s", ex);
	free(ex);
	kl_fn_free(f);
}

int main(void)
{
	ctx = kltest_ctx_from_env("test_serving");
	if (!ctx)
		return 1;
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_cache_write_eager),
	        cmocka_unit_test(test_cache_write_compiled),
	        cmocka_unit_test(test_cache_write_reads_old),
	        cmocka_unit_test(test_cache_write_fullgraph),
	        cmocka_unit_test(test_copy_fullgraph),
	        cmocka_unit_test(test_cache_write_views),
	        cmocka_unit_test(test_cache_write_errors),
	        cmocka_unit_test(test_refused_write_untouched),
	        cmocka_unit_test(test_sdpa_lengths),
	        cmocka_unit_test(test_one_row_fold),
	        cmocka_unit_test(test_bucket_padding),
	        cmocka_unit_test(test_bucket_recompile_limit),
	        cmocka_unit_test(test_graph_slots_pick),
	        cmocka_unit_test(test_bucket_graphs),
	        cmocka_unit_test(test_bucket_warmup),
	        cmocka_unit_test(test_graph_pieces),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	kl_ctx_free(ctx);
	return rc;
}
