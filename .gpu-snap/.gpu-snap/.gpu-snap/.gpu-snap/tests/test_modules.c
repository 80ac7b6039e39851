/* test_modules.c - the kl_nn modules (kiln_nn.h): each module's forward
 * against the float64 reference of its own op graph (f32 and bf16), the
 * seed's DecoderLayer against the outputs PyTorch wrote to
 * tests/fixtures/decoder_small_{f32,bf16}.safetensors (tests/make_fixture.py),
 * eagerly and through kl_compile, PyTorch-style initialization, parameter
 * names, and kl_nn_load's errors. KILN_TEST_DEVICE=cuda runs it all on CUDA
 * device 0 (skipped, 77, without one).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "kiln.h"
#include "kiln_nn.h"
#include "kltest.h"

#ifndef KILN_FIXTURE_DIR
#define KILN_FIXTURE_DIR "tests/fixtures"
#endif

static kl_ctx *ctx;
static int fails;

static int setup(void **state)
{
	(void)state;
	ctx = kltest_ctx_from_env("test_modules");
	return ctx ? 0 : -1;
}

static int teardown(void **state)
{
	(void)state;
	kl_ctx_free(ctx);
	return 0;
}

static int reset(void **state)
{
	(void)state;
	fails = 0;
	kl_clear_error(ctx);
	return 0;
}

static void ok(bool c, const char *what)
{
	if (!c) {
		fprintf(stderr, "FAIL %s (%s)\n", what, kl_last_error(ctx));
		fails++;
	}
}

/* got (released here) must have want's dtype and shape and hold its values
 * within kltest_compare's tolerance for dt times factor */
static void expect_close(const char *what, kl_tensor *got, kl_tensor *want, double factor)
{
	if (!got || !want) {
		fprintf(stderr, "FAIL %s: %s result: %s\n", what, got ? "no expected" : "no",
		        kl_last_error(ctx));
		fails++;
		kl_release(got);
		return;
	}
	if (kl_ndim(got) != kl_ndim(want) || kl_tensor_dtype(got) != kl_tensor_dtype(want) ||
	    memcmp(kl_shape(got), kl_shape(want), sizeof(int64_t) * (size_t)kl_ndim(got))) {
		fprintf(stderr, "FAIL %s: dtype/shape differ\n", what);
		fails++;
		kl_release(got);
		return;
	}
	double *g = kltest_read(got), *w = kltest_read(want);
	if (!g || !w || !kltest_compare(what, kl_tensor_dtype(got), kl_ndim(got), kl_shape(got), g,
	                                w, factor))
		fails++;
	free(g);
	free(w);
	kl_release(got);
}

/* ---- each module against the reference of its graph ---------------------------- */

typedef struct mcase {
	kl_nn_module *m;
	int mode; /* MHA: 0 self, 1 cross (key/value differ), 2 causal self */
} mcase;

static kl_tensor *ap_module(kl_tensor *const *in, const void *p)
{
	const mcase *c = p;
	switch (c->m->kind) {
	case KL_NN_LINEAR: return kl_nn_linear_forward((const kl_nn_linear *)c->m, in[0]);
	case KL_NN_RMSNORM: return kl_nn_rmsnorm_forward((const kl_nn_rmsnorm *)c->m, in[0]);
	case KL_NN_LAYERNORM: return kl_nn_layernorm_forward((const kl_nn_layernorm *)c->m, in[0]);
	case KL_NN_EMBEDDING: return kl_nn_embedding_forward((const kl_nn_embedding *)c->m, in[0]);
	case KL_NN_FFN: return kl_nn_ffn_forward((const kl_nn_ffn *)c->m, in[0]);
	case KL_NN_DECODER:
		return kl_nn_decoder_forward((const kl_nn_decoder *)c->m, in[0], c->mode == 2);
	case KL_NN_MHA: {
		const kl_nn_mha *a = (const kl_nn_mha *)c->m;
		if (c->mode == 1)
			return kl_nn_mha_forward(a, in[0], in[1], in[2], false);
		return kl_nn_mha_forward(a, in[0], in[0], in[0], c->mode == 2);
	}
	}
	return NULL;
}

static kl_tensor *rnd(kl_dtype dt, int nd, const int64_t *shape, kltest_layout l, uint64_t s)
{
	kl_tensor *t = kltest_rand(ctx, dt, nd, shape, KLTEST_NORMAL, l, s);
	assert_non_null(t);
	return t;
}

/* check module m on inputs in[] (released here); factor as kltest_compare */
static void check_module(const char *what, kl_nn_module *m, int mode, int nin, kl_tensor **in,
                         double factor)
{
	mcase c = {m, mode};
	if (!kltest_check_op(ctx, what, ap_module, nin, in, &c, factor))
		fails++;
	for (int i = 0; i < nin; i++)
		kl_release(in[i]);
}

static void test_modules_vs_reference(void **state)
{
	(void)state;
	static const kl_dtype dts[] = {KL_F32, KL_BF16};
	char w[96];
	for (int di = 0; di < 2; di++) {
		kl_dtype dt = dts[di];
		const char *dn = kl_dtype_name(dt);
		for (int bias = 0; bias < 2; bias++) {
			kl_nn_linear l;
			assert_int_equal(kl_nn_linear_init(&l, ctx, 24, 10, bias, dt, 5), KL_OK);
			kl_tensor *in[1] = {rnd(dt, 3, (int64_t[]){2, 5, 24}, KLTEST_PERMUTED, 1)};
			snprintf(w, sizeof w, "Linear %s bias %d", dn, bias);
			check_module(w, &l.base, 0, 1, in, 4);
			kl_nn_free(&l.base);
		}
		kl_nn_rmsnorm r;
		assert_int_equal(kl_nn_rmsnorm_init(&r, ctx, 48, -1, dt), KL_OK);
		kl_tensor *in[3] = {rnd(dt, 3, (int64_t[]){2, 3, 48}, KLTEST_STRIDED, 2)};
		snprintf(w, sizeof w, "RMSNorm %s", dn);
		check_module(w, &r.base, 0, 1, in, 4);
		kl_nn_free(&r.base);

		kl_nn_layernorm ln;
		assert_int_equal(kl_nn_layernorm_init(&ln, ctx, 40, 1e-5, true, dt), KL_OK);
		in[0] = rnd(dt, 2, (int64_t[]){7, 40}, KLTEST_CONTIG, 3);
		snprintf(w, sizeof w, "LayerNorm %s", dn);
		check_module(w, &ln.base, 0, 1, in, 4);
		kl_nn_free(&ln.base);

		kl_nn_embedding e;
		assert_int_equal(kl_nn_embedding_init(&e, ctx, 50, 16, dt, 4), KL_OK);
		double iv[12];
		for (int i = 0; i < 12; i++)
			iv[i] = (i * 17 + 3) % 50;
		in[0] = kltest_from_values(ctx, KL_I64, 2, (int64_t[]){3, 4}, iv, KLTEST_CONTIG);
		snprintf(w, sizeof w, "Embedding %s", dn);
		check_module(w, &e.base, 0, 1, in, 0);
		kl_nn_free(&e.base);

		kl_nn_mha a;
		assert_int_equal(kl_nn_mha_init(&a, ctx, 32, 4, dt, 6), KL_OK);
		for (int mode = 0; mode < 3; mode++) {
			int nin = mode == 1 ? 3 : 1;
			in[0] = rnd(dt, 3, (int64_t[]){2, 6, 32}, KLTEST_CONTIG, 10 + (uint64_t)mode);
			if (mode == 1) {
				in[1] = rnd(dt, 3, (int64_t[]){2, 9, 32}, KLTEST_PERMUTED, 20);
				in[2] = rnd(dt, 3, (int64_t[]){2, 9, 32}, KLTEST_CONTIG, 21);
			}
			snprintf(w, sizeof w, "MultiheadAttention %s mode %d", dn, mode);
			check_module(w, &a.base, mode, nin, in, 8);
		}
		kl_nn_free(&a.base);

		kl_nn_ffn f;
		assert_int_equal(kl_nn_ffn_init(&f, ctx, 32, 80, dt, 7), KL_OK);
		in[0] = rnd(dt, 3, (int64_t[]){2, 5, 32}, KLTEST_CONTIG, 30);
		snprintf(w, sizeof w, "FeedForward %s", dn);
		check_module(w, &f.base, 0, 1, in, 8);
		kl_nn_free(&f.base);

		kl_nn_decoder d;
		assert_int_equal(kl_nn_decoder_init(&d, ctx, 32, 4, 64, dt, 8), KL_OK);
		for (int mode = 0; mode < 3; mode += 2) {
			in[0] = rnd(dt, 3, (int64_t[]){2, 7, 32}, KLTEST_CONTIG, 40 + (uint64_t)mode);
			snprintf(w, sizeof w, "DecoderLayer %s causal %d", dn, mode == 2);
			check_module(w, &d.base, mode, 1, in, 8);
		}
		kl_nn_free(&d.base);
	}
	assert_int_equal(fails, 0);
}

/* ---- PyTorch's DecoderLayer ------------------------------------------------------ */

typedef struct body_arg {
	const kl_nn_decoder *d;
	bool causal;
} body_arg;

static kl_status decoder_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                              int nout, void *user)
{
	(void)nin;
	(void)nout;
	const body_arg *a = user;
	out[0] = kl_nn_decoder_forward(a->d, in[0], a->causal);
	return out[0] ? KL_OK : kl_last_status(c);
}

static void check_fixture(const char *tag, kl_dtype dt, double factor)
{
	char path[512], w[128];
	snprintf(path, sizeof path, "%s/decoder_small_%s.safetensors", KILN_FIXTURE_DIR, tag);
	kl_safetensors *st = kl_safetensors_open(ctx, path);
	if (!st)
		fail_msg("%s: %s", path, kl_last_error(ctx));
	int64_t dm = atoll(kl_safetensors_metadata(st, "d_model"));
	int64_t nh = atoll(kl_safetensors_metadata(st, "n_heads"));
	int64_t ff = atoll(kl_safetensors_metadata(st, "ffn_dim"));
	assert_true(dm == 64 && nh == 4 && ff == 256);
	kl_nn_decoder d;
	assert_int_equal(kl_nn_decoder_init(&d, ctx, dm, nh, ff, dt, 99), KL_OK);
	if (kl_nn_load(&d.base, st, "") != KL_OK)
		fail_msg("%s: kl_nn_load: %s", tag, kl_last_error(ctx));
	/* the module's parameters are exactly the file's state-dict keys */
	kl_nn_param ps[16];
	int np = kl_nn_params(&d.base, ps, 16);
	ok(np == kl_safetensors_count(st) - 3, "every fixture weight is a parameter");
	kl_tensor *x = kl_safetensors_get(st, "x");
	kl_tensor *y = kl_safetensors_get(st, "y"), *yc = kl_safetensors_get(st, "y_causal");
	assert_true(x && y && yc);
	for (int causal = 0; causal < 2; causal++) {
		kl_tensor *want = causal ? yc : y;
		snprintf(w, sizeof w, "DecoderLayer %s causal %d vs PyTorch (eager)", tag, causal);
		expect_close(w, kl_nn_decoder_forward(&d, x, causal), want, factor);
		for (int mode = 0; mode < 2; mode++) {
			body_arg a = {&d, causal};
			kl_compile_opts o = {.mode = mode ? KL_MODE_REDUCE_OVERHEAD : KL_MODE_DEFAULT};
			kl_fn *f = kl_compile(ctx, decoder_body, &a, 1, 1, &o);
			assert_non_null(f);
			for (int call = 0; call < 2; call++) {
				kl_tensor *out = NULL;
				snprintf(w, sizeof w, "DecoderLayer %s causal %d vs PyTorch (compiled, "
				         "mode %d, call %d)", tag, causal, mode, call);
				kl_status s = kl_fn_call(f, &x, &out);
				ok(s == KL_OK, w);
				expect_close(w, out, want, factor);
			}
			kl_fn_free(f);
		}
	}
	kl_release(x);
	kl_release(y);
	kl_release(yc);
	kl_safetensors_close(st);
	kl_nn_free(&d.base);
}

static void test_decoder_vs_pytorch(void **state)
{
	(void)state;
	/* f32: 1e-4 relative (kltest's f32 tolerance 1e-5 times 10); bf16: 1e-2 */
	check_fixture("f32", KL_F32, 10.0);
	check_fixture("bf16", KL_BF16, 1.0);
	assert_int_equal(fails, 0);
}

/* ---- initialization, names, load and save --------------------------------------- */

static double *values(kl_tensor *t, int64_t *n)
{
	*n = kl_numel(t);
	double *v = kltest_read(t);
	assert_non_null(v);
	return v;
}

static void test_init(void **state)
{
	(void)state;
	kl_nn_linear a, b, c;
	assert_int_equal(kl_nn_linear_init(&a, ctx, 100, 30, true, KL_F32, 1), KL_OK);
	assert_int_equal(kl_nn_linear_init(&b, ctx, 100, 30, true, KL_F32, 1), KL_OK);
	assert_int_equal(kl_nn_linear_init(&c, ctx, 100, 30, true, KL_F32, 2), KL_OK);
	int64_t n;
	double *wa = values(a.weight, &n), *wb = values(b.weight, &n), *wc = values(c.weight, &n);
	double bound = 0.1, lo = 1, hi = -1, mean = 0;
	int same = 0, diff = 0;
	for (int64_t i = 0; i < n; i++) {
		lo = wa[i] < lo ? wa[i] : lo;
		hi = wa[i] > hi ? wa[i] : hi;
		mean += wa[i] / (double)n;
		same += wa[i] == wb[i];
		diff += wa[i] != wc[i];
	}
	/* uniform in +-1/sqrt(in): fills the range, centred, seeded */
	ok(lo >= -bound && hi < bound && lo < -0.09 && hi > 0.09, "Linear weight range");
	ok(fabs(mean) < 0.01, "Linear weight mean");
	ok(same == n && diff > n - 5, "Linear init is a function of the seed");
	free(wa);
	free(wb);
	free(wc);
	double *bv = values(a.bias, &n);
	bool in = true;
	for (int64_t i = 0; i < n; i++)
		in &= bv[i] >= -bound && bv[i] < bound;
	ok(in, "Linear bias range");
	free(bv);
	kl_nn_free(&a.base);
	kl_nn_free(&b.base);
	kl_nn_free(&c.base);
	ok(a.weight == NULL && a.base.kind == 0, "kl_nn_free clears the module");
	kl_nn_free(&a.base); /* twice is fine */

	kl_nn_mha m;
	assert_int_equal(kl_nn_mha_init(&m, ctx, 64, 8, KL_BF16, 3), KL_OK);
	double *ib = values(m.in_proj_bias, &n);
	double s = 0;
	for (int64_t i = 0; i < n; i++)
		s += fabs(ib[i]);
	free(ib);
	double *ob = values(m.out_proj.bias, &n);
	for (int64_t i = 0; i < n; i++)
		s += fabs(ob[i]);
	free(ob);
	ok(s == 0 && n == 64, "MultiheadAttention biases start at zero");
	double *iw = values(m.in_proj_weight, &n);
	double xb = sqrt(6.0 / (64 + 192)), mx = 0;
	for (int64_t i = 0; i < n; i++)
		mx = fabs(iw[i]) > mx ? fabs(iw[i]) : mx;
	free(iw);
	ok(mx <= xb * (1 + 0x1p-8) && mx > 0.9 * xb, "in_proj_weight is xavier-uniform");
	ok(kl_tensor_dtype(m.in_proj_weight) == KL_BF16, "parameters in the module's dtype");
	kl_nn_free(&m.base);

	kl_nn_embedding e;
	assert_int_equal(kl_nn_embedding_init(&e, ctx, 200, 50, KL_F32, 4), KL_OK);
	double *ev = values(e.weight, &n), m1 = 0, m2 = 0;
	for (int64_t i = 0; i < n; i++) {
		m1 += ev[i] / (double)n;
		m2 += ev[i] * ev[i] / (double)n;
	}
	free(ev);
	ok(fabs(m1) < 0.05 && fabs(m2 - 1) < 0.05, "Embedding weight is standard normal");
	kl_nn_free(&e.base);

	kl_nn_rmsnorm r;
	assert_int_equal(kl_nn_rmsnorm_init(&r, ctx, 8, -1, KL_F32), KL_OK);
	double *rv = values(r.weight, &n);
	bool ones = true;
	for (int64_t i = 0; i < n; i++)
		ones &= rv[i] == 1.0;
	free(rv);
	ok(ones, "RMSNorm weight starts at one");
	kl_nn_free(&r.base);

	/* bad arguments are errors, never crashes */
	kl_nn_linear bad;
	ok(KLTEST_EXPECT_ERROR(ctx, kl_nn_linear_init(&bad, ctx, 0, 3, true, KL_F32, 1) ? NULL : NULL,
	                       "kl_nn_linear_init", "in_features 0"),
	   "Linear in_features 0");
	kl_nn_free(&bad.base);
	kl_clear_error(ctx);
	ok(kl_nn_mha_init(&m, ctx, 30, 4, KL_F32, 1) == KL_EINVAL &&
	           strstr(kl_last_error(ctx), "30") && strstr(kl_last_error(ctx), "4"),
	   "MHA d_model not a multiple of n_heads");
	kl_clear_error(ctx);
	ok(kl_nn_ffn_init(NULL, ctx, 4, 8, KL_F32, 1) == KL_EINVAL, "FFN NULL module");
	kl_clear_error(ctx);
	ok(kl_nn_embedding_init(&e, ctx, 4, 8, KL_I32, 1) == KL_EINVAL &&
	           strstr(kl_last_error(ctx), "i32"),
	   "Embedding int dtype");
	kl_nn_decoder zero;
	memset(&zero, 0, sizeof zero);
	kl_tensor *x = rnd(KL_F32, 3, (int64_t[]){1, 2, 8}, KLTEST_CONTIG, 1);
	ok(KLTEST_EXPECT_ERROR(ctx, kl_nn_decoder_forward(&zero, x, false),
	                       "kl_nn_decoder_forward", "not initialized"),
	   "forward of an uninitialized module");
	kl_nn_mha mh;
	assert_int_equal(kl_nn_mha_init(&mh, ctx, 8, 2, KL_F32, 1), KL_OK);
	kl_tensor *k = rnd(KL_F32, 3, (int64_t[]){1, 3, 8}, KLTEST_CONTIG, 2);
	ok(KLTEST_EXPECT_ERROR(ctx, kl_nn_mha_forward(&mh, x, k, k, true), "kl_nn_mha_forward",
	                       "causal", "2", "3"),
	   "causal with T != S");
	kl_tensor *x2 = rnd(KL_F32, 2, (int64_t[]){2, 8}, KLTEST_CONTIG, 3);
	ok(KLTEST_EXPECT_ERROR(ctx, kl_nn_mha_forward(&mh, x2, x2, x2, false),
	                       "kl_nn_mha_forward", "[2,8]", "batch first"),
	   "MHA needs 3-D inputs");
	kl_release(x);
	kl_release(x2);
	kl_release(k);
	kl_nn_free(&mh.base);
	assert_int_equal(fails, 0);
}

static void test_names_load_save(void **state)
{
	(void)state;
	kl_nn_decoder d;
	assert_int_equal(kl_nn_decoder_init(&d, ctx, 16, 2, 32, KL_F32, 1), KL_OK);
	static const char *const want[] = {
		"norm1.weight", "norm2.weight", "attn.in_proj_weight", "attn.in_proj_bias",
		"attn.out_proj.weight", "attn.out_proj.bias", "ffn.gate_proj.weight",
		"ffn.up_proj.weight", "ffn.down_proj.weight"};
	kl_nn_param ps[16];
	int n = kl_nn_params(&d.base, ps, 16);
	ok(n == 9, "DecoderLayer has 9 parameters");
	for (int i = 0; i < n && i < 9; i++)
		ok(strcmp(ps[i].name, want[i]) == 0, want[i]);
	ok(ps[2].shape[0] == 48 && ps[2].shape[1] == 16 && ps[8].shape[0] == 16 &&
	           ps[8].shape[1] == 32,
	   "parameter shapes");

	/* save under a prefix, load into a differently seeded layer: same outputs */
	char dir[] = "/tmp/kiln-test-modules-XXXXXX";
	assert_non_null(mkdtemp(dir));
	char path[256], path2[256];
	snprintf(path, sizeof path, "%s/stack.safetensors", dir);
	snprintf(path2, sizeof path2, "%s/bad.safetensors", dir);
	assert_int_equal(kl_nn_save(&d.base, path, "layers.1."), KL_OK);
	kl_nn_decoder e;
	assert_int_equal(kl_nn_decoder_init(&e, ctx, 16, 2, 32, KL_F32, 2), KL_OK);
	kl_safetensors *st = kl_safetensors_open(ctx, path);
	assert_non_null(st);
	ok(KLTEST_EXPECT_ERROR(ctx, kl_nn_load(&e.base, st, "layers.0.") ? NULL : NULL,
	                       "kl_nn_load", "missing key", "layers.0.norm1.weight"),
	   "missing key");
	assert_int_equal(kl_nn_load(&e.base, st, "layers.1."), KL_OK);
	kl_safetensors_close(st);
	kl_tensor *x = rnd(KL_F32, 3, (int64_t[]){2, 5, 16}, KLTEST_CONTIG, 9);
	expect_close("saved and loaded DecoderLayer", kl_nn_decoder_forward(&e, x, true),
	             kl_nn_decoder_forward(&d, x, true), 0);

	/* a wrong shape or a non-float tensor: an error naming the key, nothing changed */
	kl_tensor *good = kl_retain(e.ffn.up_proj.weight);
	kl_tensor *ts[3] = {kl_zeros(ctx, KL_F32, 2, (int64_t[]){32, 16}),
	                    kl_zeros(ctx, KL_F32, 2, (int64_t[]){16, 32}),
	                    kl_zeros(ctx, KL_I32, 2, (int64_t[]){16, 32})};
	const char *names[3] = {"up_proj.weight", "gate_proj.weight", "down_proj.weight"};
	assert_int_equal(kl_safetensors_save(ctx, path2, 3, names, ts), KL_OK);
	st = kl_safetensors_open(ctx, path2);
	assert_non_null(st);
	ok(KLTEST_EXPECT_ERROR(ctx, kl_nn_load(&e.ffn.base, st, NULL) ? NULL : NULL, "kl_nn_load",
	                       "gate_proj.weight", "[16,32]", "[32,16]"),
	   "wrong shape");
	kl_safetensors_close(st);
	ok(e.ffn.up_proj.weight == good, "a failed load changes nothing");
	kl_tensor *ts2[3] = {ts[0], ts[0], ts[2]};
	assert_int_equal(kl_safetensors_save(ctx, path2, 3, names, ts2), KL_OK);
	st = kl_safetensors_open(ctx, path2);
	assert_non_null(st);
	ok(KLTEST_EXPECT_ERROR(ctx, kl_nn_load(&e.ffn.base, st, NULL) ? NULL : NULL, "kl_nn_load",
	                       "down_proj.weight", "i32", "float"),
	   "wrong dtype");
	kl_safetensors_close(st);
	ok(e.ffn.up_proj.weight == good, "a failed load changes nothing (dtype)");
	kl_release(good);
	for (int i = 0; i < 3; i++)
		kl_release(ts[i]);
	/* bf16 data loads into an f32 module by casting, as torch's copy_ */
	kl_nn_rmsnorm r;
	assert_int_equal(kl_nn_rmsnorm_init(&r, ctx, 16, -1, KL_F32), KL_OK);
	kl_tensor *hw = kl_cast(kl_full(ctx, KL_F32, 1, (int64_t[]){16}, 0.5), KL_BF16);
	const char *wn = "weight";
	assert_int_equal(kl_safetensors_save(ctx, path2, 1, &wn, &hw), KL_OK);
	st = kl_safetensors_open(ctx, path2);
	assert_non_null(st);
	ok(kl_nn_load(&r.base, st, "") == KL_OK && kl_tensor_dtype(r.weight) == KL_F32,
	   "bf16 into f32");
	double v = 0;
	kl_tensor *w0 = kl_slice(r.weight, 0, 3, 4, 1);
	ok(kl_item(w0, &v) == KL_OK && v == 0.5, "bf16 into f32 value");
	kl_release(w0);
	kl_safetensors_close(st);
	kl_release(hw);
	kl_nn_free(&r.base);
	kl_release(x);
	unlink(path);
	unlink(path2);
	rmdir(dir);
	kl_nn_free(&d.base);
	kl_nn_free(&e.base);
	assert_int_equal(fails, 0);
}

/* ---- Embedding and the modules under kl_compile ------------------------------------ */

typedef struct emb_arg {
	const kl_nn_embedding *e;
	const kl_nn_layernorm *ln;
} emb_arg;

static kl_status emb_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)c;
	(void)nin;
	(void)nout;
	const emb_arg *a = user;
	out[0] = kl_nn_layernorm_forward(a->ln, kl_mul_scalar(kl_nn_embedding_forward(a->e, in[0]),
	                                                       3.0));
	return out[0] ? KL_OK : KL_EINVAL;
}

static void test_compiled_embedding(void **state)
{
	(void)state;
	kl_nn_embedding e;
	kl_nn_layernorm ln;
	assert_int_equal(kl_nn_embedding_init(&e, ctx, 30, 24, KL_F32, 1), KL_OK);
	assert_int_equal(kl_nn_layernorm_init(&ln, ctx, 24, 1e-5, true, KL_F32), KL_OK);
	emb_arg a = {&e, &ln};
	kl_fn *f = kl_compile(ctx, emb_body, &a, 1, 1, NULL);
	assert_non_null(f);
	for (int call = 0; call < 3; call++) {
		double iv[10];
		for (int i = 0; i < 10; i++)
			iv[i] = (double)((i * 7 + call * 11) % 30);
		kl_tensor *ix = kltest_from_values(ctx, call == 2 ? KL_I32 : KL_I64, 2,
		                                   (int64_t[]){2, 5}, iv, KLTEST_CONTIG);
		kl_tensor *out = NULL;
		ok(kl_fn_call(f, &ix, &out) == KL_OK, "compiled embedding call");
		kl_tensor *want = NULL;
		ok(emb_body(ctx, &ix, 1, &want, 1, &a) == KL_OK, "eager embedding");
		expect_close("compiled Embedding + LayerNorm vs eager", out, want, 1);
		kl_release(want);
		kl_release(ix);
	}
	kl_fn_free(f);
	kl_nn_free(&e.base);
	kl_nn_free(&ln.base);
	assert_int_equal(fails, 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup(test_modules_vs_reference, reset),
		cmocka_unit_test_setup(test_decoder_vs_pytorch, reset),
		cmocka_unit_test_setup(test_init, reset),
		cmocka_unit_test_setup(test_names_load_save, reset),
		cmocka_unit_test_setup(test_compiled_embedding, reset),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
