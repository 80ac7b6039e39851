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

static char *explain_str(kl_fn *f)
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
	        cmocka_unit_test(test_explain_after_failure),
	        cmocka_unit_test(test_synchronize),
	        cmocka_unit_test(test_cache_dir_open_to_others),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
