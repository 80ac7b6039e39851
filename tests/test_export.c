/* test_export.c - export and AOT packages (issue 25): eager = compiled =
 * package for an MLP, a softmax-norm block and the DecoderLayer with a
 * dynamic batch and sequence dim; a sync point refused at export; bad
 * packages (truncated, bit-flipped, foreign, wrong format version, wrong
 * target, wrong ELF machine, manifest against plan) and bad inputs (dtype,
 * rank, static size, a dim out of range, tied dims unequal) each refused
 * with its reason; a package run in a process whose toolchain is gone
 * compiles nothing.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "backend/cpu/cpu.h"
#include "kiln_nn.h"
#include "kltest.h"
#include "runtime/compiled.h"
#include "runtime/package.h"

static kl_ctx *ctx;
static char dir[256];

static void path_of(char *buf, size_t cap, const char *name)
{
	snprintf(buf, cap, "%s/%s", dir, name);
}

/* ---- workloads -------------------------------------------------------------------- */

typedef struct mlp {
	kl_tensor *w1, *b1, *w2;
} mlp;

static kl_status mlp_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin;
	(void)nout;
	const mlp *m = user;
	kl_tensor *h = kl_gelu(kl_add(kl_matmul(in[0], kl_transpose(m->w1, 0, 1)), m->b1));
	out[0] = kl_matmul(h, kl_transpose(m->w2, 0, 1));
	return out[0] ? KL_OK : kl_last_status(c);
}

/* softmax over the last dim, scaled by a row norm: row reductions */
static kl_status rows_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	kl_tensor *s = kl_softmax(in[0], -1);
	out[0] = kl_mul(s, kl_add(in[1], in[0]));
	out[1] = kl_sum(in[0], 1, (int[]){-1}, true);
	return out[0] && out[1] ? KL_OK : kl_last_status(c);
}

typedef struct dec {
	kl_nn_decoder d;
	bool causal;
} dec;

static kl_status dec_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin;
	(void)nout;
	const dec *m = user;
	out[0] = kl_nn_decoder_forward(&m->d, in[0], m->causal);
	return out[0] ? KL_OK : kl_last_status(c);
}

/* x + arange(T) over the last dim: the arange's length is a number taken
 * from x's shape, so T cannot stay a symbol */
static kl_status arange_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                             int nout, void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	int64_t T = kl_dim(in[0], 1);
	out[0] = kl_add(in[0], kl_arange(c, KL_F32, 0, (double)T, 1));
	return out[0] ? KL_OK : kl_last_status(c);
}

static kl_status host_noop(kl_ctx *c, kl_tensor *const *ts, int n, void *user)
{
	(void)c;
	(void)ts;
	(void)n;
	(void)user;
	return KL_OK;
}

/* dropout from the context's generator: a package would replay one mask */
static kl_status rng_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin, (void)nout, (void)user;
	out[0] = kl_dropout_rng(kl_exp(in[0]), 0.5, true);
	return out[0] ? KL_OK : kl_last_status(c);
}

static kl_status sync_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	kl_tensor *a = kl_exp(kl_add(in[0], in[0]));
	kl_status st = kl_host_call(c, host_noop, &a, 1, NULL);
	if (st != KL_OK)
		return st;
	out[0] = kl_mul(a, in[0]);
	return out[0] ? KL_OK : kl_last_status(c);
}

static kl_tensor *randn(kl_dtype dt, int ndim, const int64_t *shape, uint64_t seed)
{
	return kltest_rand(ctx, dt, ndim, shape, KLTEST_NORMAL, KLTEST_CONTIG, seed);
}

/* a == b within the dtype's tolerance (times factor) */
static bool same(const char *what, kl_tensor *a, kl_tensor *b, double factor)
{
	if (!a || !b)
		return false;
	int na = kl_ndim(a), nb = kl_ndim(b);
	const int64_t *sa = kl_shape(a), *sb = kl_shape(b);
	if (na != nb || memcmp(sa, sb, sizeof(int64_t) * (size_t)na) != 0) {
		fprintf(stderr, "%s: shapes differ\n", what);
		return false;
	}
	double *x = kltest_read(a), *y = kltest_read(b);
	bool ok = x && y && kltest_compare(what, kl_tensor_dtype(a), na, sa, x, y, factor);
	free(x);
	free(y);
	return ok;
}

/* Export fn, package it, load it (path and buffer) and compare the package
 * with eager at each of the sizes in sizes[] (for input 0's dim 0). */
typedef kl_tensor *(*make_inputs_fn)(int64_t size, int i, uint64_t seed);

static void roundtrip(const char *name, kl_fn_body fn, void *user, int nin, int nout,
                      kl_tensor *const *ex, const kl_export_opts *o, int nsizes,
                      kl_tensor *(*make)(int64_t a, int64_t b, int i, uint64_t seed),
                      const int64_t (*sizes)[2], double factor)
{
	char path[512];
	path_of(path, sizeof path, name);
	kl_exported *e = kl_export(ctx, fn, user, nin, nout, ex, o);
	if (!e)
		fprintf(stderr, "%s: %s\n", name, kl_last_error(ctx));
	assert_non_null(e);
	assert_int_equal(kl_exported_package(e, path), KL_OK);
	kl_exported_free(e);
	kl_package *p = kl_package_load(ctx, path);
	if (!p)
		fprintf(stderr, "%s: %s\n", name, kl_last_error(ctx));
	assert_non_null(p);
	assert_int_equal(kl_package_ninputs(p), nin);
	assert_int_equal(kl_package_noutputs(p), nout);
	kl_compile_opts co = {.dynamic = KL_DYNAMIC_ALL};
	kl_fn *f = kl_compile(ctx, fn, user, nin, nout, &co);
	assert_non_null(f);
	for (int s = 0; s < nsizes; s++) {
		kl_tensor *in[4], *eo[4] = {0}, *co_[4] = {0}, *po[4] = {0};
		for (int i = 0; i < nin; i++)
			in[i] = make(sizes[s][0], sizes[s][1], i, 100 + (uint64_t)s * 7 + (uint64_t)i);
		kl_scope_begin(ctx);
		assert_int_equal(fn(ctx, in, nin, eo, nout, user), KL_OK);
		for (int k = 0; k < nout; k++)
			eo[k] = kl_retain(eo[k]);
		kl_scope_end(ctx);
		assert_int_equal(kl_fn_call(f, in, co_), KL_OK);
		kl_status st = kl_package_run(p, in, po);
		if (st != KL_OK)
			fprintf(stderr, "%s: %s\n", name, kl_last_error(ctx));
		assert_int_equal(st, KL_OK);
		for (int k = 0; k < nout; k++) {
			assert_true(same(name, co_[k], eo[k], factor));
			assert_true(same(name, po[k], eo[k], factor));
			kl_release(eo[k]);
			kl_release(co_[k]);
			kl_release(po[k]);
		}
		for (int i = 0; i < nin; i++)
			kl_release(in[i]);
	}
	kl_fn_free(f);
	kl_package_free(p);
}

static kl_tensor *mlp_in(int64_t a, int64_t b, int i, uint64_t seed)
{
	(void)b;
	(void)i;
	return randn(KL_F32, 2, (int64_t[]){a, 24}, seed);
}

static mlp make_mlp(void)
{
	mlp m = {randn(KL_F32, 2, (int64_t[]){40, 24}, 1), randn(KL_F32, 1, (int64_t[]){40}, 2),
	         randn(KL_F32, 2, (int64_t[]){16, 40}, 3)};
	return m;
}

static void free_mlp(mlp *m)
{
	kl_release(m->w1);
	kl_release(m->b1);
	kl_release(m->w2);
}

static void test_mlp_roundtrip(void **state)
{
	(void)state;
	mlp m = make_mlp();
	kl_tensor *ex = mlp_in(8, 0, 0, 9);
	kl_dim_spec ds = {0, 0, "batch", 1, 300};
	kl_tensor *ps[3] = {m.w1, m.b1, m.w2};
	const char *names[3] = {"fc1.weight", "fc1.bias", "fc2.weight"};
	kl_export_opts o = {.ndims = 1, .dims = &ds, .nparams = 3, .params = ps, .param_names = names};
	const int64_t sizes[][2] = {{8, 0}, {1, 0}, {37, 0}, {300, 0}};
	roundtrip("mlp.klp", mlp_body, &m, 1, 1, &ex, &o, 4, mlp_in, sizes, 4.0);
	/* the text form names the parameters and the dim */
	kl_exported *e = kl_export(ctx, mlp_body, &m, 1, 1, &ex, &o);
	assert_non_null(e);
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);
	assert_int_equal(kl_exported_print(e, f), KL_OK);
	fclose(f);
	assert_non_null(strstr(buf, "fc1.weight"));
	assert_non_null(strstr(buf, "batch in [1, 300]"));
	free(buf);
	kl_exported_free(e);
	kl_release(ex);
	free_mlp(&m);
}

static kl_tensor *rows_in(int64_t a, int64_t b, int i, uint64_t seed)
{
	(void)i;
	return randn(KL_F32, 3, (int64_t[]){a, b, 33}, seed);
}

static void test_rows_roundtrip(void **state)
{
	(void)state;
	kl_tensor *ex[2] = {rows_in(3, 5, 0, 1), rows_in(3, 5, 1, 2)};
	/* the same names tie the dims of both inputs */
	kl_dim_spec ds[4] = {{0, 0, "b", 1, 64}, {0, 1, "t", 1, 64}, {1, 0, "b", 1, 64},
	                     {1, 1, "t", 1, 64}};
	kl_export_opts o = {.ndims = 4, .dims = ds};
	const int64_t sizes[][2] = {{3, 5}, {1, 1}, {7, 64}, {64, 2}};
	roundtrip("rows.klp", rows_body, NULL, 2, 2, ex, &o, 4, rows_in, sizes, 4.0);
	kl_release(ex[0]);
	kl_release(ex[1]);
}

static kl_tensor *dec_in(int64_t a, int64_t b, int i, uint64_t seed)
{
	(void)i;
	return randn(KL_F32, 3, (int64_t[]){a, b, 32}, seed);
}

static void export_decoder(bool causal)
{
	dec m = {.causal = causal};
	assert_int_equal(kl_nn_decoder_init(&m.d, ctx, 32, 4, 64, KL_F32, 7), KL_OK);
	kl_nn_param np[16];
	int n = kl_nn_params(&m.d.base, np, 16);
	kl_tensor *ps[16];
	const char *names[16];
	for (int i = 0; i < n; i++) {
		ps[i] = *np[i].slot;
		names[i] = np[i].name;
	}
	kl_tensor *ex = dec_in(2, 6, 0, 3);
	kl_dim_spec ds[2] = {{0, 0, "batch", 1, 16}, {0, 1, "seq", 1, 128}};
	kl_export_opts o = {.ndims = 2, .dims = ds, .nparams = n, .params = ps, .param_names = names};
	const int64_t sizes[][2] = {{2, 6}, {1, 1}, {5, 17}, {16, 128}};
	roundtrip(causal ? "dec_causal.klp" : "dec.klp", dec_body, &m, 1, 1, &ex, &o, 4, dec_in,
	          sizes, 8.0);
	kl_release(ex);
	kl_nn_free(&m.d.base);
}

static void test_decoder_roundtrip(void **state)
{
	(void)state;
	export_decoder(false);
}

/* The causal DecoderLayer's mask is kl_sdpa's causal flag: its sequence dim
 * stays symbolic like the batch, and the package runs every size in range. */
static void test_decoder_causal(void **state)
{
	(void)state;
	export_decoder(true);
}

/* A dim that reaches an op needing a number (kl_arange's length) cannot stay
 * dynamic: export names the dim, the input and the op; the other dim may. */
static void test_dim_reaches_arange(void **state)
{
	(void)state;
	kl_tensor *ex = randn(KL_F32, 2, (int64_t[]){3, 5}, 4);
	kl_dim_spec ds[2] = {{0, 0, "rows", 1, 16}, {0, 1, "cols", 1, 64}};
	kl_export_opts o = {.ndims = 2, .dims = ds};
	kl_clear_error(ctx);
	assert_null(kl_export(ctx, arange_body, NULL, 1, 1, &ex, &o));
	assert_non_null(strstr(kl_last_error(ctx), "dim cols (input 'input0' dim 1) cannot stay "
	                                           "dynamic: it reaches kl_arange"));
	o.ndims = 1;
	kl_exported *e = kl_export(ctx, arange_body, NULL, 1, 1, &ex, &o);
	if (!e)
		fail_msg("kl_export with a dynamic row count: %s", kl_last_error(ctx));
	kl_exported_free(e);
	kl_release(ex);
}

static void test_sync_point_refused(void **state)
{
	(void)state;
	kl_tensor *ex = randn(KL_F32, 1, (int64_t[]){8}, 1);
	kl_clear_error(ctx);
	kl_exported *e = kl_export(ctx, sync_body, NULL, 1, 1, &ex, NULL);
	assert_null(e);
	const char *msg = kl_last_error(ctx);
	assert_non_null(strstr(msg, "kl_export"));
	assert_non_null(strstr(msg, "kl_host_call"));
	assert_non_null(strstr(msg, "after 2 ops"));
	/* a dim out of its declared range at export */
	kl_dim_spec ds = {0, 0, "n", 10, 20};
	kl_export_opts o = {.ndims = 1, .dims = &ds};
	assert_null(kl_export(ctx, mlp_body, NULL, 1, 1, &ex, &o));
	assert_non_null(strstr(kl_last_error(ctx), "dim n"));
	/* a draw from the context's generator is refused, naming it */
	assert_null(kl_export(ctx, rng_body, NULL, 1, 1, &ex, NULL));
	assert_non_null(strstr(kl_last_error(ctx), "kl_dropout_rng"));
	kl_release(ex);
}

/* ---- bad packages -------------------------------------------------------------------- */

static uint8_t *read_file(const char *path, size_t *len)
{
	FILE *f = fopen(path, "rb");
	assert_non_null(f);
	fseek(f, 0, SEEK_END);
	long n = ftell(f);
	fseek(f, 0, SEEK_SET);
	uint8_t *b = malloc((size_t)n);
	assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
	fclose(f);
	*len = (size_t)n;
	return b;
}

static uint64_t rd64(const uint8_t *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
	return v;
}

static void wr64(uint8_t *p, uint64_t v)
{
	memcpy(p, &v, 8);
}

/* Recompute every checksum, so that a mutation reaches the check behind
 * them. */
static void reseal(uint8_t *b, size_t len)
{
	(void)len;
	for (int s = 0; s < 4; s++) {
		uint8_t *e = b + 64 + 32 * s;
		wr64(e + 24, kl__pkg_sum(b + rd64(e + 8), rd64(e + 16)));
	}
	uint64_t h = kl__hash_bytes(KL_HASH_SEED, b, 56);
	wr64(b + 56, kl__hash_bytes(h, b + 64, 128));
}

static void expect_refused(const uint8_t *b, size_t len, const char *why)
{
	kl_clear_error(ctx);
	kl_package *p = kl_package_load_buffer(ctx, b, len);
	if (p || !strstr(kl_last_error(ctx), why))
		fprintf(stderr, "expected '%s', got '%s'\n", why, p ? "(loaded)" : kl_last_error(ctx));
	assert_null(p);
	assert_non_null(strstr(kl_last_error(ctx), why));
}

static uint8_t *section(uint8_t *b, int s, size_t *n)
{
	uint8_t *e = b + 64 + 32 * s;
	*n = rd64(e + 16);
	return b + rd64(e + 8);
}

static void test_bad_packages(void **state)
{
	(void)state;
	char path[512];
	path_of(path, sizeof path, "mlp.klp");
	size_t len;
	uint8_t *good = read_file(path, &len);
	uint8_t *b = malloc(len);
	/* the good one loads from memory */
	kl_package *p = kl_package_load_buffer(ctx, good, len);
	assert_non_null(p);
	kl_package_free(p);
	/* truncated, at every cut through the header and some beyond */
	for (size_t cut = 0; cut < len; cut += cut < 256 ? 1 : len / 37) {
		kl_clear_error(ctx);
		assert_null(kl_package_load_buffer(ctx, good, cut));
		assert_non_null(strstr(kl_last_error(ctx), "bad package"));
	}
	expect_refused(good, len - 1, "truncated");
	/* bit flips: every section names itself (the MLP has no generated
	 * kernels: its products and their epilogues are library steps) */
	const char *names[4] = {"manifest", "plan", "kernels", "weights"};
	for (int s = 0; s < 4; s++) {
		if (s == 2)
			continue;
		memcpy(b, good, len);
		size_t n;
		uint8_t *q = section(b, s, &n);
		q[n / 2] ^= 0x10;
		expect_refused(b, len, names[s]);
	}
	memcpy(b, good, len);
	b[70] ^= 1; /* the table */
	expect_refused(b, len, "header checksum");
	/* foreign: an ELF file, a text file */
	memcpy(b, good, len);
	memcpy(b, "\x7f" "ELF\2\1\1\0", 8);
	expect_refused(b, len, "not a kiln package");
	expect_refused((const uint8_t *)"hello, world, this is no package at all, not even close "
	                                "and then some more text to pass two hundred bytes of "
	                                "length so that the magic is what refuses it: a b c d e "
	                                "f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6",
	               200, "not a kiln package");
	/* another format version */
	memcpy(b, good, len);
	b[8] = 9;
	reseal(b, len);
	expect_refused(b, len, "format version 9");
	/* another target */
	memcpy(b, good, len);
	memcpy(b + 32, "cpu-riscv64\0\0\0\0", 16);
	reseal(b, len);
	expect_refused(b, len, "target cpu-riscv64");
	/* kernels built for a CPU feature this host lacks (a bit past the
	 * known ones, so that every host lacks it) */
	memcpy(b, good, len);
	wr64(b + 48, rd64(b + 48) | 1ull << 63);
	reseal(b, len);
	expect_refused(b, len, "CPU features this host lacks: bit 63");
	/* manifest against plan: input 0's dtype, a parameter's shape */
	memcpy(b, good, len);
	size_t mn;
	uint8_t *m = section(b, 0, &mn);
	/* target str, ndims, dim "batch" (name, min, max), nin, input name */
	size_t at = 4 + 10 + 4 + 4 + 5 + 16 + 4 + 4 + 6;
	assert_int_equal(m[at], KL_F32);
	m[at] = KL_F64;
	reseal(b, len);
	expect_refused(b, len, "input 'input0' is f64");
	memcpy(b, good, len);
	m = section(b, 0, &mn);
	m[at + 8] = 9; /* input0 dim 0's traced size: a static dim now */
	m[at + 8 + 8] = 0xff, m[at + 8 + 9] = 0xff, m[at + 8 + 10] = 0xff, m[at + 8 + 11] = 0xff;
	reseal(b, len);
	expect_refused(b, len, "symbol 1");
	free(b);
	free(good);
	/* a package with generated kernels: flipped, another machine, not ELF,
	 * built for another plan */
	path_of(path, sizeof path, "rows.klp");
	good = read_file(path, &len);
	b = malloc(len);
	size_t kn;
	memcpy(b, good, len);
	uint8_t *k = section(b, 2, &kn);
	assert_true(kn > 64);
	k[kn / 2] ^= 4;
	expect_refused(b, len, "kernels section's checksum");
	memcpy(b, good, len);
	k = section(b, 2, &kn);
	k[18] = (uint8_t)(k[18] == 62 ? 183 : 62);
	reseal(b, len);
	expect_refused(b, len, "ELF machine");
	memcpy(b, good, len);
	k = section(b, 2, &kn);
	k[0] = 0;
	reseal(b, len);
	expect_refused(b, len, "not an ELF file");
	memcpy(b, good, len);
	size_t pn;
	uint8_t *pl = section(b, 1, &pn);
	/* the plan's last bytes: a step's cost figures, which the kernels'
	 * plan digest covers */
	pl[pn - 3] ^= 1;
	reseal(b, len);
	kl_clear_error(ctx);
	kl_package *q = kl_package_load_buffer(ctx, b, len);
	if (q)
		kl_package_free(q);
	assert_null(q);
	free(b);
	free(good);
}

static void test_bad_inputs(void **state)
{
	(void)state;
	char path[512];
	path_of(path, sizeof path, "rows.klp");
	kl_package *p = kl_package_load(ctx, path);
	assert_non_null(p);
	kl_tensor *out[2] = {0};
	kl_tensor *a = rows_in(3, 5, 0, 1), *b = rows_in(3, 5, 1, 2);
	kl_tensor *wrong_dt = randn(KL_F64, 3, (int64_t[]){3, 5, 33}, 3);
	kl_tensor *wrong_rank = randn(KL_F32, 2, (int64_t[]){3, 5}, 3);
	kl_tensor *wrong_static = randn(KL_F32, 3, (int64_t[]){3, 5, 32}, 3);
	kl_tensor *too_big = randn(KL_F32, 3, (int64_t[]){65, 5, 33}, 3);
	kl_tensor *untied = randn(KL_F32, 3, (int64_t[]){3, 6, 33}, 3);
	kl_tensor *strided = kl_retain(kl_transpose(a, 0, 1));
	struct {
		kl_tensor *x;
		const char *why;
	} cases[] = {{wrong_dt, "is f64"},        {wrong_rank, "rank 3"},
	             {wrong_static, "dim 2 is 32"}, {too_big, "dim 0 (b) is 65, outside its range [1, 64]"},
	             {untied, "dim t is 6"},      {strided, "dense"}};
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		kl_clear_error(ctx);
		kl_tensor *in[2] = {a, cases[i].x};
		if (cases[i].x == strided)
			in[0] = strided, in[1] = b;
		assert_int_not_equal(kl_package_run(p, in, out), KL_OK);
		if (!strstr(kl_last_error(ctx), cases[i].why))
			fprintf(stderr, "want '%s': %s\n", cases[i].why, kl_last_error(ctx));
		assert_non_null(strstr(kl_last_error(ctx), cases[i].why));
		assert_null(out[0]);
	}
	kl_release(a);
	kl_release(b);
	kl_release(wrong_dt);
	kl_release(wrong_rank);
	kl_release(wrong_static);
	kl_release(too_big);
	kl_release(untied);
	kl_release(strided);
	kl_package_free(p);
}

/* A child process with no compiler anywhere it looks runs the package and
 * compiles nothing. */
static void test_no_toolchain(void **state)
{
	(void)state;
	char path[512];
	path_of(path, sizeof path, "dec.klp");
	fflush(NULL);
	pid_t pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		execl("/proc/self/exe", "test_export", "--no-toolchain", path, (char *)NULL);
		_exit(127);
	}
	int status = 0;
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
}

/* The child of test_no_toolchain (a fresh process: fork alone would carry
 * the parent's OpenMP threads' state and its counters). */
static int no_toolchain_child(const char *path)
{
	setenv("PATH", "/nonexistent", 1);
	setenv("CC", "/nonexistent/cc", 1);
	kl_ctx *c = kl_ctx_new(NULL);
	kl_package *p = c ? kl_package_load(c, path) : NULL;
	int rc = p ? 0 : 2;
	for (int64_t t = 1; rc == 0 && t < 40; t += 13) {
		kl_tensor *x = kl_randn(c, KL_F32, 3, (int64_t[]){2, t, 32}, 5), *y = NULL;
		if (kl_package_run(p, &x, &y) != KL_OK)
			rc = 3;
		kl_release(x);
		kl_release(y);
	}
	if (rc)
		fprintf(stderr, "child: %s\n", kl_last_error(c));
	if (kl__jit_compiles() != 0 || kl__rt_lowerings() != 0) {
		fprintf(stderr, "child: %ld compiles, %ld lowerings\n", kl__jit_compiles(),
		        kl__rt_lowerings());
		rc = 4;
	}
	kl_package_free(p);
	kl_ctx_free(c);
	return rc;
}

int main(int argc, char **argv)
{
	if (argc == 3 && !strcmp(argv[1], "--no-toolchain"))
		return no_toolchain_child(argv[2]);
	ctx = kltest_ctx_from_env("test_export");
	if (!ctx)
		return 1;
	const char *tmp = getenv("TMPDIR");
	snprintf(dir, sizeof dir, "%s/kiln-export-XXXXXX", tmp && tmp[0] == '/' ? tmp : "/tmp");
	if (!mkdtemp(dir))
		return 1;
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_mlp_roundtrip),
	        cmocka_unit_test(test_rows_roundtrip),
	        cmocka_unit_test(test_decoder_roundtrip),
	        cmocka_unit_test(test_decoder_causal),
	        cmocka_unit_test(test_dim_reaches_arange),
	        cmocka_unit_test(test_sync_point_refused),
	        cmocka_unit_test(test_bad_packages),
	        cmocka_unit_test(test_bad_inputs),
	        cmocka_unit_test(test_no_toolchain),
	};
	int rc = cmocka_run_group_tests(tests, NULL, NULL);
	char cmd[400];
	snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
	if (system(cmd) != 0)
		rc = rc ? rc : 1;
	kl_ctx_free(ctx);
	return rc;
}
