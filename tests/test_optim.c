/* test_optim.c - optimizers, losses and training ops, nn parameters:
 *  - SGD (momentum, dampening, nesterov, weight decay) and AdamW (amsgrad or
 *    not) against a float64 reference of torch's update over several steps
 *    of fresh random gradients (some strided, one parameter skipped with a
 *    NULL gradient, the learning rate changed midway), in f32, bf16 and f64,
 *    through the fused eager step, the eager op path and a compiled body;
 *  - a compiled step recompiles nothing when only the learning rate moves;
 *  - state saved and loaded: the next step is bitwise the same;
 *  - mse_loss, cross_entropy (ignore_index, all ignored, bad targets) and
 *    dropout (determinism, mask statistics, scaling, identities) against
 *    references, eagerly and compiled;
 *  - a DecoderLayer's parameter names are the PyTorch fixture's keys, an
 *    optimizer over it updates the packed gate/up buffer, kl_nn_load keeps
 *    an optimizer's parameters, the training flag;
 *  - bad inputs: errors naming the call, the shapes and the value.
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
#include "backend/cpu/cpu.h"

static kl_ctx *g_ctx;

static int setup(void **state)
{
	(void)state;
	g_ctx = kltest_ctx_from_env("test_optim");
	return g_ctx ? 0 : -1;
}

static int teardown(void **state)
{
	(void)state;
	kl_ctx_free(g_ctx);
	return 0;
}

/* v as a tensor of dtype dt holds it (round to nearest even) */
static double round_to(kl_dtype dt, double v)
{
	if (dt == KL_F64 || isnan(v))
		return v;
	float f = (float)v;
	if (dt == KL_F32)
		return f;
	uint32_t u;
	memcpy(&u, &f, 4);
	u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u; /* bf16 */
	memcpy(&f, &u, 4);
	return f;
}

/* ---- the float64 reference of torch's updates -------------------------------------- */

typedef struct refp {
	double *p, *m, *v, *vmax;
	double step;
	int64_t n;
} refp;

static void ref_adamw(refp *r, const double *g, const kl_adamw_opts *o, double lr, kl_dtype dt)
{
	r->step += 1;
	double bc1 = 1 - pow(o->beta1, r->step), bc2 = 1 - pow(o->beta2, r->step);
	double ss = lr / bc1, bc2s = sqrt(bc2);
	for (int64_t i = 0; i < r->n; i++) {
		double p = r->p[i] * (1 - lr * o->weight_decay);
		double m = r->m[i] + (1 - o->beta1) * (g[i] - r->m[i]);
		double v = r->v[i] * o->beta2 + (1 - o->beta2) * g[i] * g[i];
		double vm = o->amsgrad ? fmax(r->vmax[i], v) : v;
		p -= ss * m / (sqrt(vm) / bc2s + o->eps);
		r->p[i] = round_to(dt, p);
		r->m[i] = round_to(dt, m);
		r->v[i] = round_to(dt, v);
		r->vmax[i] = round_to(dt, vm);
	}
}

static void ref_sgd(refp *r, const double *g, const kl_sgd_opts *o, double lr, kl_dtype dt)
{
	for (int64_t i = 0; i < r->n; i++) {
		double d = g[i] + o->weight_decay * r->p[i];
		if (o->momentum != 0) {
			double b = r->step == 0 ? d : r->m[i] * o->momentum + (1 - o->dampening) * d;
			r->m[i] = round_to(dt, b);
			d = o->nesterov ? d + o->momentum * b : b;
		}
		r->p[i] = round_to(dt, r->p[i] - lr * d);
	}
	r->step += 1;
}

/* ---- running an optimizer three ways ----------------------------------------------- */

enum { FUSED, OPS, COMPILED, FULLGRAPH };
static const char *mode_name[] = {"fused", "ops", "compiled", "fullgraph"};

#define NP 5
static const int pnd[NP] = {2, 1, 1, 3, 2};
static const int64_t pshape[NP][3] = {{5, 7}, {33}, {1}, {2, 3, 4}, {0, 3}};

typedef struct step_body {
	kl_optim *o;
	bool skip[NP];
} step_body;

static kl_status body_step(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)ctx;
	(void)out;
	(void)nout;
	step_body *b = user;
	kl_tensor *g[NP];
	for (int i = 0; i < nin; i++)
		g[i] = b->skip[i] ? NULL : in[i];
	return kl_optim_step_grads(b->o, g);
}

typedef struct opt_case {
	kl_dtype dt;
	bool adam;
	kl_adamw_opts a;
	kl_sgd_opts s;
} opt_case;

static bool compare_t(const char *what, kl_tensor *t, const double *ref, int64_t n,
                      kl_dtype dt, double factor)
{
	double *v = kltest_read(t);
	assert_non_null(v);
	bool ok = kltest_compare(what, dt, 1, (int64_t[]){n}, v, ref, factor);
	free(v);
	return ok;
}

/* Four steps of the optimizer (param 1 skipped at step 1, lr halved before
 * step 2) in mode md against the reference; returns the failures. */
static int run_case(const opt_case *c, int md)
{
	kl_ctx *ctx = g_ctx;
	char what[160];
	kl_tensor *ps[NP];
	refp r[NP];
	for (int i = 0; i < NP; i++) {
		ps[i] = kltest_rand(ctx, c->dt, pnd[i], pshape[i], KLTEST_NORMAL, KLTEST_CONTIG,
		                    100 + (uint64_t)i);
		int64_t n = kl_numel(ps[i]);
		r[i] = (refp){.p = kltest_read(ps[i]), .n = n};
		r[i].m = calloc((size_t)n + 1, sizeof(double));
		r[i].v = calloc((size_t)n + 1, sizeof(double));
		r[i].vmax = calloc((size_t)n + 1, sizeof(double));
	}
	kl_adamw_opts a = c->a;
	kl_sgd_opts s = c->s;
	a.unfused = s.unfused = md == OPS;
	kl_optim *o = c->adam ? kl_optim_adamw(ctx, NP, ps, NULL, &a)
	                      : kl_optim_sgd(ctx, NP, ps, NULL, &s);
	assert_non_null(o);
	step_body sb = {.o = o};
	kl_fn *f = md >= COMPILED ? kl_compile(ctx, body_step, &sb, NP, 0,
	                                       &(kl_compile_opts){.fullgraph = md == FULLGRAPH})
	                          : NULL;
	double lr = c->adam ? a.lr : s.lr;
	long compiles = 0;
	for (int step = 0; step < 4; step++) {
		if (step == 2) {
			lr *= 0.5;
			assert_int_equal(kl_optim_set_lr(o, lr), KL_OK);
			compiles = kl__jit_compiles();
		}
		kl_tensor *g[NP], *in[NP];
		for (int i = 0; i < NP; i++) {
			sb.skip[i] = step == 1 && i == 1;
			in[i] = kltest_rand(ctx, c->dt, pnd[i], pshape[i], KLTEST_NORMAL,
			                    i % 2 ? KLTEST_STRIDED : KLTEST_CONTIG,
			                    1000 * (uint64_t)step + (uint64_t)i);
			g[i] = sb.skip[i] ? NULL : in[i];
		}
		kl_status st = md >= COMPILED ? kl_fn_call(f, in, NULL) : kl_optim_step_grads(o, g);
		if (st != KL_OK)
			fail_msg("step %d (%s): %s", step, mode_name[md], kl_last_error(ctx));
		for (int i = 0; i < NP; i++) {
			if (g[i]) {
				double *gv = kltest_read(g[i]);
				if (c->adam)
					ref_adamw(&r[i], gv, &c->a, lr, c->dt);
				else
					ref_sgd(&r[i], gv, &c->s, lr, c->dt);
				free(gv);
			}
			kl_release(in[i]);
		}
	}
	int bad = 0;
	if (md >= COMPILED) {
		/* steps 2 and 3 trace the graph of step 0 with a new lr: no compile */
		if (kl__jit_compiles() != compiles) {
			fprintf(stderr, "compiled %s: %ld compiles after the lr change\n",
			        c->adam ? "adamw" : "sgd", kl__jit_compiles() - compiles);
			bad++;
		}
		kl_fn_free(f);
	}
	double factor = c->dt == KL_F32 ? 0.1 : 1.0; /* f32: 1e-6 relative */
	for (int i = 0; i < NP; i++) {
		const char *nm = c->adam ? "adamw" : "sgd";
		snprintf(what, sizeof what, "%s %s %s param %d", nm, kl_dtype_name(c->dt),
		         mode_name[md], i);
		bad += !compare_t(what, ps[i], r[i].p, r[i].n, c->dt, factor);
		kl_tensor *m = kl_optim_state(o, i, c->adam ? "exp_avg" : "momentum_buffer");
		if (c->adam || c->s.momentum != 0) {
			snprintf(what, sizeof what, "%s %s %s state m %d", nm, kl_dtype_name(c->dt),
			         mode_name[md], i);
			assert_non_null(m);
			assert_int_equal(kl_tensor_dtype(m), c->dt);
			bad += !compare_t(what, m, r[i].m, r[i].n, c->dt, factor);
		}
		if (c->adam) {
			bad += !compare_t(what, kl_optim_state(o, i, "exp_avg_sq"), r[i].v, r[i].n,
			                  c->dt, factor);
			if (c->a.amsgrad)
				bad += !compare_t(what, kl_optim_state(o, i, "max_exp_avg_sq"), r[i].vmax,
				                  r[i].n, c->dt, factor);
		}
		double stp = -1;
		assert_int_equal(kl_item(kl_optim_state(o, i, "step"), &stp), KL_OK);
		if (stp != r[i].step) {
			fprintf(stderr, "%s: step %g, want %g\n", what, stp, r[i].step);
			bad++;
		}
		free(r[i].p);
		free(r[i].m);
		free(r[i].v);
		free(r[i].vmax);
		kl_release(ps[i]);
	}
	kl_optim_free(o);
	return bad;
}

static void test_adamw_reference(void **state)
{
	(void)state;
	int bad = 0;
	kl_dtype dts[3] = {KL_F32, KL_BF16, KL_F64};
	for (int d = 0; d < 3; d++)
		for (int ams = 0; ams < 2; ams++)
			for (int md = 0; md < (dts[d] == KL_F32 ? 4 : 3); md++) {
				opt_case c = {.dt = dts[d], .adam = true, .a = kl_adamw_defaults()};
				c.a.lr = 0.01;
				c.a.weight_decay = 0.05;
				c.a.amsgrad = ams;
				bad += run_case(&c, md);
			}
	assert_int_equal(bad, 0);
}

static void test_sgd_reference(void **state)
{
	(void)state;
	int bad = 0;
	kl_sgd_opts cfg[4] = {
	        {.lr = 0.1},
	        {.lr = 0.05, .momentum = 0.9, .dampening = 0.1, .weight_decay = 0.01},
	        {.lr = 0.05, .momentum = 0.8, .nesterov = true, .weight_decay = 0.05},
	        {.lr = 0.2, .momentum = 0.5},
	};
	kl_dtype dts[3] = {KL_F32, KL_BF16, KL_F64};
	for (int d = 0; d < 3; d++)
		for (int k = 0; k < 4; k++)
			for (int md = 0; md < (dts[d] == KL_F32 ? 4 : 3); md++) {
				opt_case c = {.dt = dts[d], .s = cfg[k]};
				bad += run_case(&c, md);
			}
	assert_int_equal(bad, 0);
}

/* ---- saving, loading, resuming ------------------------------------------------------ */

static char g_dir[] = "/tmp/kiln-test-optim-XXXXXX";

static const char *path_in_dir(const char *name)
{
	static char buf[512];
	snprintf(buf, sizeof buf, "%s/%s", g_dir, name);
	return buf;
}

static kl_tensor *clone(kl_tensor *t)
{
	kl_tensor *c = kl_empty(kl_tensor_ctx(t), kl_tensor_dtype(t), kl_ndim(t), kl_shape(t));
	assert_int_equal(kl_copy(c, t), KL_OK);
	return c;
}

static bool same_bits(kl_tensor *a, kl_tensor *b)
{
	size_t n = (size_t)kl_numel(a) * kl_dtype_size(kl_tensor_dtype(a));
	unsigned char *x = malloc(n + 1), *y = malloc(n + 1);
	if (kl_to_host(a, x, n) != KL_OK || kl_to_host(b, y, n) != KL_OK)
		fail_msg("same_bits: %s", kl_last_error(kl_tensor_ctx(a)));
	bool same = memcmp(x, y, n) == 0;
	free(x);
	free(y);
	return same;
}

static kl_optim *make_opt(bool adam, int n, kl_tensor *const *ps, const char *const *names)
{
	kl_adamw_opts a = kl_adamw_defaults();
	a.amsgrad = true;
	a.lr = 0.02;
	kl_sgd_opts s = {.lr = 0.1, .momentum = 0.9, .dampening = 0.2, .weight_decay = 0.01};
	return adam ? kl_optim_adamw(g_ctx, n, ps, names, &a) : kl_optim_sgd(g_ctx, n, ps, names, &s);
}

static void test_save_load_resume(void **state)
{
	(void)state;
	kl_ctx *ctx = g_ctx;
	assert_non_null(mkdtemp(g_dir));
	const char *names[3] = {"layers.0.w", "layers.0.b", "head.weight"};
	const int64_t shp[3][2] = {{4, 6}, {6, 1}, {3, 4}};
	for (int adam = 0; adam < 2; adam++) {
		kl_dtype dt = adam ? KL_BF16 : KL_F32;
		kl_tensor *ps[3], *grads[3][3];
		for (int i = 0; i < 3; i++) {
			ps[i] = kltest_rand(ctx, dt, 2, shp[i], KLTEST_NORMAL, KLTEST_CONTIG, 7 + (uint64_t)i);
			for (int s = 0; s < 3; s++)
				grads[s][i] = kltest_rand(ctx, dt, 2, shp[i], KLTEST_NORMAL, KLTEST_CONTIG,
				                          50 + 10 * (uint64_t)s + (uint64_t)i);
		}
		kl_optim *o = make_opt(adam, 3, ps, names);
		assert_non_null(o);
		assert_int_equal(kl_optim_step_grads(o, grads[0]), KL_OK);
		assert_int_equal(kl_optim_set_lr(o, 0.03), KL_OK);
		assert_int_equal(kl_optim_step_grads(o, grads[1]), KL_OK);
		const char *path = path_in_dir(adam ? "adamw.safetensors" : "sgd.safetensors");
		assert_int_equal(kl_optim_save(o, path), KL_OK);
		kl_tensor *saved[3];
		for (int i = 0; i < 3; i++)
			saved[i] = clone(ps[i]);
		assert_int_equal(kl_optim_step_grads(o, grads[2]), KL_OK);
		/* a fresh optimizer over the saved parameters, its state loaded */
		kl_optim *o2 = make_opt(adam, 3, saved, names);
		assert_int_equal(kl_optim_load(o2, path), KL_OK);
		double lr = 0;
		assert_int_equal(kl_item(kl_optim_lr(o2), &lr), KL_OK);
		assert_true(lr == 0.03);
		assert_int_equal(kl_optim_step_grads(o2, grads[2]), KL_OK);
		for (int i = 0; i < 3; i++) {
			assert_true(same_bits(ps[i], saved[i]));
			const char *key = adam ? "exp_avg_sq" : "momentum_buffer";
			assert_true(same_bits(kl_optim_state(o, i, key), kl_optim_state(o2, i, key)));
			assert_true(same_bits(kl_optim_state(o, i, "step"), kl_optim_state(o2, i, "step")));
		}
		/* the file holds torch-like keys */
		kl_safetensors *st = kl_safetensors_open(ctx, path);
		assert_non_null(st);
		assert_non_null(kl_safetensors_get(st, "param_groups.0.lr"));
		assert_non_null(kl_safetensors_get(st, adam ? "state.head.weight.exp_avg"
		                                          : "state.head.weight.momentum_buffer"));
		kl_safetensors_close(st);
		kl_optim_free(o2);
		/* the other optimizer's file: a key it does not have */
		kl_optim *o3 = make_opt(!adam, 3, saved, names);
		assert_int_equal(kl_optim_load(o3, path), KL_EINVAL);
		assert_non_null(strstr(kl_last_error(ctx), "kl_optim_load: "));
		assert_non_null(strstr(kl_last_error(ctx), adam ? "is not state of this SGD"
		                                               : "is not state of this AdamW"));
		kl_optim_free(o3);
		/* other shapes: the key, both shapes and dtypes */
		kl_tensor *other[3] = {saved[1], saved[0], saved[2]};
		const char *swapped[3] = {names[0], names[1], names[2]};
		kl_optim *o4 = make_opt(adam, 3, other, swapped);
		assert_int_equal(kl_optim_load(o4, path), KL_EINVAL);
		char want[160];
		snprintf(want, sizeof want, "'state.layers.0.w.%s' is %s [4,6], the optimizer holds %s "
		         "[6,1]", adam ? "exp_avg" : "momentum_buffer", kl_dtype_name(dt),
		         kl_dtype_name(dt));
		if (!strstr(kl_last_error(ctx), want))
			fail_msg("got '%s', want '%s'", kl_last_error(ctx), want);
		kl_optim_free(o4);
		kl_optim *o5 = make_opt(adam, 3, saved, names);
		assert_int_equal(kl_optim_load(o5, path_in_dir("missing.safetensors")), KL_EIO);
		kl_optim_free(o5);
		kl_optim_free(o);
		for (int i = 0; i < 3; i++) {
			kl_release(ps[i]);
			kl_release(saved[i]);
			for (int s = 0; s < 3; s++)
				kl_release(grads[s][i]);
		}
		unlink(path);
	}
	rmdir(g_dir);
}

/* ---- bad input --------------------------------------------------------------------- */

static bool expect_fail(kl_ctx *ctx, const void *got, const char *want)
{
	if (got || !strstr(kl_last_error(ctx), want)) {
		fprintf(stderr, "expected an error with '%s', got %s '%s'\n", want,
		        got ? "a result and" : "", kl_last_error(ctx));
		return false;
	}
	kl_clear_error(ctx);
	return true;
}

static void test_optim_errors(void **state)
{
	(void)state;
	kl_ctx *ctx = g_ctx;
	kl_tensor *w = kl_zeros(ctx, KL_F32, 2, (int64_t[]){2, 3});
	kl_tensor *b = kl_zeros(ctx, KL_F32, 1, (int64_t[]){3});
	kl_tensor *ints = kl_zeros(ctx, KL_I32, 1, (int64_t[]){3});
	kl_tensor *wt = kl_transpose(w, 0, 1);
	kl_tensor *big = kl_zeros(ctx, KL_F32, 1, (int64_t[]){10});
	kl_tensor *lo = kl_slice(big, 0, 0, 6, 1), *hi = kl_slice(big, 0, 4, 10, 1);
	kl_adamw_opts a = kl_adamw_defaults();
	bool ok = true;
	a.lr = -1;
	ok &= expect_fail(ctx, kl_optim_adamw(ctx, 1, &w, NULL, &a),
	                  "kl_optim_adamw: invalid learning rate: -1");
	a = kl_adamw_defaults();
	a.beta1 = 1;
	ok &= expect_fail(ctx, kl_optim_adamw(ctx, 1, &w, NULL, &a),
	                  "kl_optim_adamw: invalid beta parameter at index 0: 1");
	a = kl_adamw_defaults();
	a.eps = NAN;
	ok &= expect_fail(ctx, kl_optim_adamw(ctx, 1, &w, NULL, &a), "invalid epsilon value: nan");
	kl_sgd_opts s = {.lr = 0.1, .nesterov = true};
	ok &= expect_fail(ctx, kl_optim_sgd(ctx, 1, &w, NULL, &s),
	                  "kl_optim_sgd: nesterov momentum requires a momentum and zero dampening "
	                  "(momentum 0, dampening 0)");
	s = (kl_sgd_opts){.lr = 0.1, .momentum = -0.5};
	ok &= expect_fail(ctx, kl_optim_sgd(ctx, 1, &w, NULL, &s), "invalid momentum value: -0.5");
	ok &= expect_fail(ctx, kl_optim_sgd(ctx, 0, &w, NULL, NULL),
	                  "kl_optim_sgd: got an empty parameter list (n 0)");
	kl_tensor *two[2] = {w, ints};
	ok &= expect_fail(ctx, kl_optim_sgd(ctx, 2, two, NULL, NULL),
	                  "kl_optim_sgd: parameter 1 is i32 [3]: only float tensors can be optimized");
	ok &= expect_fail(ctx, kl_optim_adamw(ctx, 1, &wt, NULL, NULL),
	                  "kl_optim_adamw: parameter 0 (f32 [3,2]) is not dense");
	two[1] = w;
	ok &= expect_fail(ctx, kl_optim_adamw(ctx, 2, two, NULL, NULL),
	                  "parameter 1 is parameter 0 again");
	kl_tensor *ov[2] = {lo, hi};
	ok &= expect_fail(ctx, kl_optim_adamw(ctx, 2, ov, NULL, NULL),
	                  "parameter 1 ([6]) overlaps parameter 0 in memory");
	kl_tensor *wb[2] = {w, b};
	const char *dup[2] = {"x", "x"};
	ok &= expect_fail(ctx, kl_optim_adamw(ctx, 2, wb, dup, NULL),
	                  "parameters 0 and 1 are both named 'x'");
	const char *names[2] = {"w", "b"};
	kl_optim *o = kl_optim_adamw(ctx, 2, wb, names, NULL);
	assert_non_null(o);
	kl_tensor *g[2] = {b, NULL};
	assert_int_equal(kl_optim_step_grads(o, g), KL_EINVAL);
	ok &= expect_fail(ctx, NULL, "kl_optim_step_grads: the gradient of parameter 0 ('w') is "
	                             "f32 [3], the parameter f32 [2,3]");
	kl_tensor *gd = kl_zeros(ctx, KL_F64, 2, (int64_t[]){2, 3});
	g[0] = gd;
	assert_int_equal(kl_optim_step_grads(o, g), KL_EINVAL);
	ok &= expect_fail(ctx, NULL, "is f64 [2,3], the parameter f32 [2,3]");
	assert_int_equal(kl_optim_step_grads(o, NULL), KL_EINVAL);
	ok &= expect_fail(ctx, NULL, "kl_optim_step_grads: grads is NULL");
	ok &= expect_fail(ctx, kl_optim_state(o, 1, "momentum_buffer"),
	                  "kl_optim_state: parameter 1 ('b') has no state 'momentum_buffer'");
	ok &= expect_fail(ctx, kl_optim_state(o, 2, "step"),
	                  "kl_optim_state: parameter 2 does not exist (2 parameters)");
	assert_int_equal(kl_optim_set_lr(o, INFINITY), KL_EINVAL);
	ok &= expect_fail(ctx, NULL, "kl_optim_set_lr: invalid learning rate: inf");
	/* a failed step changed nothing */
	double *v = kltest_read(w);
	for (int i = 0; i < 6; i++)
		ok &= v[i] == 0;
	free(v);
	kl_optim_free(o);
	kl_tensor *all[] = {w, b, ints, wt, big, lo, hi, gd};
	for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
		kl_release(all[i]);
	assert_true(ok);
}

/* ---- losses --------------------------------------------------------------------------- */

static kl_tensor *apply_mse(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_mse_loss(in[0], in[1]);
}

static kl_tensor *apply_ce(kl_tensor *const *in, const void *p)
{
	return kl_cross_entropy(in[0], in[1], *(const int64_t *)p);
}

/* cross-entropy's float64 reference, straight from the definition */
static double ref_ce(const double *x, const double *t, int64_t n, int64_t c, int64_t ignore)
{
	double total = 0;
	int64_t count = 0;
	for (int64_t i = 0; i < n; i++) {
		if ((int64_t)t[i] == ignore)
			continue;
		double mx = -INFINITY, s = 0;
		for (int64_t j = 0; j < c; j++)
			mx = fmax(mx, x[i * c + j]);
		for (int64_t j = 0; j < c; j++)
			s += exp(x[i * c + j] - mx);
		total += -(x[i * c + (int64_t)t[i]] - mx - log(s));
		count++;
	}
	return total / (double)count;
}

typedef struct loss_body {
	int64_t ignore;
} loss_body;

/* Inside a compiled function the fused step runs once the graph has run:
 * kl_explain says so, and fn reading a parameter after the step (which
 * would see the old value) is an error naming the read, not a wrong result. */
typedef struct read_after {
	kl_optim *o;
	kl_tensor *p;
	bool read;
} read_after;

static kl_status body_read_after(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                 int nout, void *user)
{
	(void)nin, (void)nout;
	read_after *b = user;
	kl_status st = kl_optim_step_grads(b->o, in);
	if (st == KL_OK)
		out[0] = b->read ? kl_mul(b->p, b->p) : kl_mul(in[0], in[0]);
	return st != KL_OK ? st : out[0] ? KL_OK : kl_last_status(ctx);
}

static void test_step_in_graph(void **state)
{
	(void)state;
	kl_ctx *ctx = g_ctx;
	kl_tensor *p = kltest_rand(ctx, KL_F32, 2, (int64_t[]){4, 6}, KLTEST_NORMAL, KLTEST_CONTIG, 5);
	kl_tensor *g = kltest_rand(ctx, KL_F32, 2, (int64_t[]){4, 6}, KLTEST_NORMAL, KLTEST_CONTIG, 6);
	kl_adamw_opts a = kl_adamw_defaults();
	kl_optim *o = kl_optim_adamw(ctx, 1, &p, NULL, &a);
	assert_non_null(o);
	read_after b = {.o = o, .p = p};
	for (int read = 0; read < 2; read++) {
		b.read = read;
		kl_fn *f = kl_compile(ctx, body_read_after, &b, 1, 1, NULL);
		kl_tensor *y = NULL;
		kl_status st = kl_fn_call(f, &g, &y);
		if (!read) {
			if (st != KL_OK)
				fail_msg("step in a graph: %s", kl_last_error(ctx));
			char *text = NULL;
			size_t len = 0;
			FILE *mem = open_memstream(&text, &len);
			assert_int_equal(kl_explain(f, mem), KL_OK);
			fclose(mem);
			if (!strstr(text, "then, once the graph ran: the fused AdamW step over 1 "
			                  "parameters"))
				fail_msg("kl_explain does not show the deferred step:\n%s", text);
			free(text);
			double stp = 0;
			assert_int_equal(kl_item(kl_optim_state(o, 0, "step"), &stp), KL_OK);
			assert_true(stp == 1);
		} else {
			assert_int_equal(st, KL_ESTATE);
			assert_non_null(strstr(kl_last_error(ctx), "reads memory that the fused AdamW "
			                                           "step over 1 parameters changes"));
			assert_null(y);
			kl_clear_error(ctx);
		}
		kl_release(y);
		kl_fn_free(f);
	}
	kl_optim_free(o);
	kl_release(p);
	kl_release(g);
}

static kl_status body_ce(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                         void *user)
{
	(void)ctx;
	(void)nin;
	(void)nout;
	out[0] = kl_cross_entropy(in[0], in[1], ((loss_body *)user)->ignore);
	out[1] = kl_mse_loss(in[0], in[2]);
	return out[0] && out[1] ? KL_OK : kl_last_status(ctx);
}

static void test_losses(void **state)
{
	(void)state;
	kl_ctx *ctx = g_ctx;
	bool ok = true;
	kl_dtype dts[3] = {KL_F32, KL_BF16, KL_F64};
	for (int d = 0; d < 3; d++) {
		kl_dtype dt = dts[d];
		int64_t n = 9, c = 7, ignore = 3;
		kl_tensor *x = kltest_rand(ctx, dt, 2, (int64_t[]){n, c}, KLTEST_NORMAL,
		                           d == 1 ? KLTEST_STRIDED : KLTEST_CONTIG, 5);
		kl_tensor *y = kltest_rand(ctx, dt, 2, (int64_t[]){n, c}, KLTEST_NORMAL,
		                           KLTEST_PERMUTED, 6);
		double tv[9] = {0, 6, 3, 2, 3, 1, 5, 4, 0};
		kl_tensor *t = kltest_from_values(ctx, d == 2 ? KL_I32 : KL_I64, 1, (int64_t[]){n}, tv,
		                                  KLTEST_CONTIG);
		/* against the graph reference and against the definition */
		ok &= kltest_check_op(ctx, "mse_loss", apply_mse, 2, (kl_tensor *[]){x, y}, NULL, 1.0);
		ok &= kltest_check_op(ctx, "cross_entropy", apply_ce, 2, (kl_tensor *[]){x, t},
		                      &ignore, 1.0);
		double *xv = kltest_read(x), *yv = kltest_read(y), want_mse = 0;
		for (int64_t i = 0; i < n * c; i++)
			want_mse += (xv[i] - yv[i]) * (xv[i] - yv[i]) / (double)(n * c);
		double want_ce = ref_ce(xv, tv, n, c, ignore), got = 0;
		kl_tensor *ce = kl_cross_entropy(x, t, ignore), *mse = kl_mse_loss(x, y);
		assert_int_equal(kl_ndim(ce), 0);
		assert_int_equal(kl_tensor_dtype(ce), dt);
		double tol = kltest_tol(dt) * 4;
		assert_int_equal(kl_item(ce, &got), KL_OK);
		if (!(fabs(got - want_ce) <= tol * fabs(want_ce)))
			ok = false, fprintf(stderr, "%s ce %.9g want %.9g\n", kl_dtype_name(dt), got,
			                    want_ce);
		assert_int_equal(kl_item(mse, &got), KL_OK);
		if (!(fabs(got - want_mse) <= tol * fabs(want_mse)))
			ok = false, fprintf(stderr, "%s mse %.9g want %.9g\n", kl_dtype_name(dt), got,
			                    want_mse);
		/* compiled: the same values */
		loss_body lb = {ignore};
		kl_fn *f = kl_compile(ctx, body_ce, &lb, 3, 2, NULL);
		kl_tensor *out[2];
		assert_int_equal(kl_fn_call(f, (kl_tensor *[]){x, t, y}, out), KL_OK);
		double a, b;
		assert_int_equal(kl_item(out[0], &a), KL_OK);
		assert_int_equal(kl_item(ce, &b), KL_OK);
		ok &= fabs(a - b) <= tol * fabs(b);
		assert_int_equal(kl_item(out[1], &a), KL_OK);
		assert_int_equal(kl_item(mse, &b), KL_OK);
		ok &= fabs(a - b) <= tol * fabs(b);
		kl_release(out[0]);
		kl_release(out[1]);
		kl_fn_free(f);
		/* every row ignored: NaN, as torch */
		kl_tensor *all_ign = kl_full(ctx, KL_I64, 1, (int64_t[]){n}, -100);
		kl_tensor *nanl = kl_cross_entropy(x, all_ign, KL_IGNORE_INDEX);
		assert_int_equal(kl_item(nanl, &got), KL_OK);
		ok &= isnan(got);
		kl_tensor *rel[] = {x, y, t, ce, mse, all_ign, nanl};
		for (size_t i = 0; i < sizeof rel / sizeof rel[0]; i++)
			kl_release(rel[i]);
		free(xv);
		free(yv);
	}
	/* bad input */
	kl_tensor *x = kl_zeros(ctx, KL_F32, 2, (int64_t[]){3, 4});
	kl_tensor *t = kltest_from_values(ctx, KL_I64, 1, (int64_t[]){3}, (double[]){0, 5, 1},
	                                  KLTEST_CONTIG);
	kl_tensor *tf = kl_zeros(ctx, KL_F32, 1, (int64_t[]){3});
	kl_tensor *x3 = kl_zeros(ctx, KL_F32, 1, (int64_t[]){4});
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_cross_entropy(x, t, -100), "kl_cross_entropy: target[1] = 5 "
	                          "is not a class in [0, 4) nor ignore_index -100");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_cross_entropy(x, tf, -100),
	                          "kl_cross_entropy: target is f32 [3]; logits [3,4] need i32 or "
	                          "i64 [3]");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_cross_entropy(x3, t, -100),
	                          "kl_cross_entropy: logits are f32 [4]; need float [N, C]");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_mse_loss(x, x3), "kl_mse_loss: input [3,4] and target [4] "
	                          "differ in shape");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_mse_loss(t, t), "kl_mse_loss: input i64 [3] and target "
	                          "i64 [3] must both be float");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_mse_loss(NULL, x), "kl_mse_loss: input is NULL");
	kl_release(x);
	kl_release(t);
	kl_release(tf);
	kl_release(x3);
	assert_true(ok);
}

/* ---- dropout ---------------------------------------------------------------------------- */

typedef struct drop_body {
	double p;
	uint64_t seed, offset;
} drop_body;

static kl_status body_drop(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                           void *user)
{
	(void)nin;
	(void)nout;
	drop_body *b = user;
	out[0] = kl_dropout(in[0], b->p, b->seed, b->offset, true);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

static void test_dropout(void **state)
{
	(void)state;
	kl_ctx *ctx = g_ctx;
	int64_t n = 200000;
	double p = 0.3;
	kl_tensor *x = kltest_rand(ctx, KL_F32, 2, (int64_t[]){400, 500}, KLTEST_POS,
	                           KLTEST_CONTIG, 9);
	double *xv = kltest_read(x);
	kl_tensor *y1 = kl_dropout(x, p, 42, 7, true), *y2 = kl_dropout(x, p, 42, 7, true);
	kl_tensor *y3 = kl_dropout(x, p, 42, 8, true), *y4 = kl_dropout(x, p, 43, 7, true);
	assert_true(same_bits(y1, y2));
	assert_false(same_bits(y1, y3));
	assert_false(same_bits(y1, y4));
	double *v = kltest_read(y1), *v3 = kltest_read(y3);
	int64_t kept = 0, both = 0;
	float scale = 1.0f / (float)(1.0 - p);
	for (int64_t i = 0; i < n; i++) {
		if (v[i] != 0) {
			kept++;
			both += v3[i] != 0;
			/* a kept element is x / (1 - p), rounded as f32 */
			double want = (double)((float)xv[i] * scale);
			if (fabs(v[i] - want) > 1e-6 * want)
				fail_msg("element %lld: %.9g, want %.9g", (long long)i, v[i], want);
		}
	}
	/* kept with probability 1 - p: within 5 sigma */
	double mean = (double)n * (1 - p), sd = sqrt((double)n * p * (1 - p));
	assert_true(fabs((double)kept - mean) < 5 * sd);
	/* two offsets' masks independent: kept in both about (1 - p)^2 */
	double both_mean = (double)n * (1 - p) * (1 - p);
	assert_true(fabs((double)both - both_mean) < 5 * sqrt(both_mean));
	free(v3);
	/* compiled: the same mask as eagerly */
	drop_body db = {p, 42, 7};
	kl_fn *f = kl_compile(ctx, body_drop, &db, 1, 1, NULL);
	kl_tensor *yc = NULL;
	assert_int_equal(kl_fn_call(f, &x, &yc), KL_OK);
	double *vc = kltest_read(yc);
	for (int64_t i = 0; i < n; i++)
		if ((vc[i] == 0) != (v[i] == 0) || fabs(vc[i] - v[i]) > 1e-6 * fabs(v[i]))
			fail_msg("compiled dropout element %lld: %g, eager %g", (long long)i, vc[i], v[i]);
	free(vc);
	free(v);
	kl_release(yc);
	kl_fn_free(f);
	/* identities and p = 1 */
	kl_tensor *id1 = kl_dropout(x, 0.0, 1, 1, true), *id2 = kl_dropout(x, 0.5, 1, 1, false);
	assert_true(same_bits(id1, x));
	assert_true(same_bits(id2, x));
	kl_tensor *z = kl_dropout(x, 1.0, 1, 1, true);
	double *zv = kltest_read(z);
	for (int64_t i = 0; i < n; i++)
		assert_true(zv[i] == 0);
	free(zv);
	/* bf16: kept elements scaled in bf16, dropped ones zero */
	kl_tensor *xb = kl_cast(x, KL_BF16), *yb = kl_dropout(xb, 0.5, 3, 0, true);
	double *xbv = kltest_read(xb), *ybv = kltest_read(yb);
	for (int64_t i = 0; i < 1000; i++)
		assert_true(ybv[i] == 0 || ybv[i] == 2 * xbv[i]);
	free(xbv);
	free(ybv);
	bool ok = true;
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_dropout(x, 1.5, 1, 1, true),
	                          "kl_dropout: dropout probability has to be between 0 and 1, but "
	                          "got 1.5");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_dropout(x, NAN, 1, 1, true), "but got nan");
	kl_tensor *xi = kl_zeros(ctx, KL_I32, 1, (int64_t[]){3});
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_dropout(xi, 0.5, 1, 1, true),
	                          "kl_dropout: x is i32 [3]; dropout needs a float tensor");
	kl_tensor *rel[] = {x, y1, y2, y3, y4, id1, id2, z, xb, yb, xi};
	for (size_t i = 0; i < sizeof rel / sizeof rel[0]; i++)
		kl_release(rel[i]);
	free(xv);
	assert_true(ok);
}

/* Dropout in a compiled training loop: the mask's Philox key is a value of
 * the call (two i32 inputs of the graph), not of the graph, so a loop that
 * moves the offset every step compiles once. Every step's dropout output is
 * bitwise the eager one for the same (seed, offset), and the gradient
 * d sum(dropout(x * w) * g) / dw = x * g * mask / (1 - p) matches float64,
 * with backward inside the function (one graph), after it (compiled forward
 * + kl_backward: the backward recomputes the mask from the same key), and
 * fullgraph calls (never replayed: the key is the call's). */
typedef struct drop_step {
	double p;
	uint64_t seed, offset;
	kl_tensor *w;
	bool backward; /* kl_backward inside the body */
} drop_step;

static kl_status body_drop_step(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                int nout, void *user)
{
	(void)nin;
	(void)nout;
	drop_step *b = user;
	kl_tensor *h = kl_dropout(kl_mul(in[0], b->w), b->p, b->seed, b->offset, true);
	kl_tensor *loss = kl_sum(kl_mul(h, in[1]), 0, NULL, false);
	if (!h || !loss)
		return kl_last_status(ctx);
	if (b->backward) {
		kl_status st = kl_backward(loss, NULL);
		if (st != KL_OK)
			return st;
	}
	out[0] = loss;
	out[1] = h;
	return KL_OK;
}

static void check_drop_step(kl_ctx *ctx, drop_step *b, kl_tensor *x, kl_tensor *g, kl_tensor *h,
                            bool grads, const char *what)
{
	int64_t n = kl_numel(x);
	kl_tensor *xw = kl_mul(x, b->w);
	kl_tensor *want = kl_dropout(xw, b->p, b->seed, b->offset, true);
	if (!same_bits(h, want))
		fail_msg("%s, offset %llu: dropout differs from eager", what,
		         (unsigned long long)b->offset);
	if (grads) {
		double *xv = kltest_read(x), *gv = kltest_read(g);
		/* the mask alone: dropout of ones */
		kl_tensor *ones = kl_full(ctx, KL_F32, kl_ndim(x), kl_shape(x), 1.0);
		kl_tensor *m = kl_dropout(ones, b->p, b->seed, b->offset, true);
		double *dw = kltest_read(kl_grad(b->w)), *mv = kltest_read(m);
		int64_t kept = 0;
		for (int64_t i = 0; i < n; i++) {
			bool k = mv[i] != 0;
			kept += k;
			double ref = k ? xv[i] * gv[i] / (1.0 - b->p) : 0.0;
			if (!(fabs(dw[i] - ref) <= 1e-5 * fabs(ref) + 1e-30))
				fail_msg("%s, offset %llu: dw[%lld] = %.9g, float64 %.9g", what,
				         (unsigned long long)b->offset, (long long)i, dw[i], ref);
		}
		assert_true(kept > 0 && kept < n);
		free(xv);
		free(gv);
		free(dw);
		free(mv);
		kl_release(ones);
		kl_release(m);
	}
	kl_release(xw);
	kl_release(want);
}

static kl_tensor *apply_drop(kl_tensor *const *in, const void *param)
{
	const drop_step *b = param;
	return kl_dropout(in[0], b->p, b->seed, b->offset, true);
}

static void test_dropout_compiled_loop(void **state)
{
	(void)state;
	kl_ctx *ctx = g_ctx;
	const int steps = 12; /* past the default recompile limit (8) */
	kl_tensor *x = kltest_rand(ctx, KL_F32, 2, (int64_t[]){33, 65}, KLTEST_POS, KLTEST_CONTIG,
	                           21);
	kl_tensor *g = kltest_rand(ctx, KL_F32, 2, (int64_t[]){33, 65}, KLTEST_NORMAL, KLTEST_CONTIG,
	                           22);
	kl_tensor *w = kltest_rand(ctx, KL_F32, 2, (int64_t[]){33, 65}, KLTEST_NORMAL, KLTEST_CONTIG,
	                           23);
	/* traced, the key is two inputs of the graph: the float64 reference
	 * evaluates that graph as eager dropout computes it */
	drop_step rb = {0.4, UINT64_C(0xfedcba9876543210), 5, NULL, false};
	assert_true(kltest_check_op(ctx, "dropout keyed at run time", apply_drop, 1, &x, &rb, 1.0));
	assert_int_equal(kl_set_requires_grad(w, true), KL_OK);
	for (int mode = 0; mode < 3; mode++) {
		/* 0: backward inside; 1: compiled forward, kl_backward after;
		 * 2: fullgraph, forward only */
		drop_step b = {0.4, 1234, 0, w, mode == 0};
		kl_compile_opts o = {.fullgraph = mode == 2};
		kl_fn *f = kl_compile(ctx, body_drop_step, &b, 2, 2, &o);
		assert_non_null(f);
		const char *what = mode == 0 ? "backward inside" : mode == 1 ? "backward after"
		                                                             : "fullgraph";
		for (int s = 0; s < steps; s++) {
			b.offset = (uint64_t)s * 977 + 3;
			kl_grad_clear(w);
			kl_tensor *out[2] = {NULL, NULL};
			kl_tensor *in[2] = {x, g};
			if (mode == 2)
				kl_set_grad_enabled(ctx, false);
			assert_int_equal(kl_fn_call(f, in, out), KL_OK);
			if (mode == 1)
				assert_int_equal(kl_backward(out[0], NULL), KL_OK);
			if (mode == 2)
				kl_set_grad_enabled(ctx, true);
			check_drop_step(ctx, &b, x, g, out[1], mode != 2, what);
			kl_release(out[0]);
			kl_release(out[1]);
		}
		kl_fn_stats st;
		assert_int_equal(kl_fn_get_stats(f, &st), KL_OK);
		if (st.compiles != 1 || st.eager_calls != 0 || st.over_limit)
			fail_msg("%s: %d steps with new offsets: %d compiles, %ld eager calls "
			         "(want 1 and 0); first reason: %s",
			         what, steps, st.compiles, st.eager_calls,
			         kl_fn_recompile_reason(f, 0) ? kl_fn_recompile_reason(f, 0) : "-");
		assert_int_equal(st.replays, 0);
		kl_fn_free(f);
	}
	kl_grad_clear(w);
	kl_release(x);
	kl_release(g);
	kl_release(w);
}

/* Dropout from the context's generator in a training step that replays
 * (issue 20): forward with two dropouts (of the input and of the hidden
 * layer), MSE loss, backward, SGD in place, grads cleared. Run eagerly in
 * f64 and f32, compiled (the body traced every call), fullgraph (the plan
 * replayed from the second call: the replay makes each step's keys from
 * the generator) and fullgraph in reduce-overhead (on CUDA one CUDA graph
 * replayed, its key inputs written before each launch). Every mode
 * reseeds the generator and runs the same steps: each step's input
 * dropout is bitwise the eager one, masks differ from step to step, the
 * weights and losses equal the float64 run within f32 tolerance, the
 * replayed modes equal the traced one bitwise, and the generator has moved
 * by two draws a step. */
typedef struct rng_step {
	kl_tensor *w;
	double p, lr;
	kl_optim *opt; /* NULL: SGD through ops and kl_copy */
} rng_step;

static kl_status body_rng_step(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                               int nout, void *user)
{
	(void)nin;
	(void)nout;
	rng_step *b = user;
	kl_tensor *h = kl_dropout_rng(in[0], b->p, true);
	kl_tensor *y = kl_dropout_rng(kl_tanh(kl_matmul(h, b->w)), b->p, true);
	kl_tensor *d = kl_sub(y, in[1]);
	kl_tensor *loss = kl_mean(kl_mul(d, d), 0, NULL, false);
	if (!loss)
		return kl_last_status(ctx);
	kl_status st = kl_backward(loss, NULL);
	if (st != KL_OK)
		return st;
	if (b->opt) {
		st = kl_optim_step(b->opt);
	} else {
		bool prev = kl_set_grad_enabled(ctx, false);
		st = kl_copy(b->w, kl_sub(b->w, kl_mul_scalar(kl_grad(b->w), b->lr)));
		kl_set_grad_enabled(ctx, prev);
	}
	kl_grad_clear(b->w);
	out[0] = loss;
	out[1] = h;
	return st;
}

static kl_status body_reseed(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                             void *user)
{
	(void)nin, (void)nout, (void)user;
	kl_status st = kl_manual_seed(ctx, 7);
	out[0] = kl_dropout_rng(in[0], 0.5, true);
	return st != KL_OK ? st : out[0] ? KL_OK : kl_last_status(ctx);
}

static void replayed_steps(bool adam)
{
	kl_ctx *ctx = g_ctx;
	enum {
		STEPS = 6,
		MODES = 5
	}; /* eager f64, eager f32, traced, fullgraph, + reduce-overhead */
	const uint64_t seed = UINT64_C(0x5eed0fd40f0);
	kl_tensor *x =
	        kltest_rand(ctx, KL_F32, 2, (int64_t[]){9, 17}, KLTEST_NORMAL, KLTEST_CONTIG, 31);
	kl_tensor *tgt =
	        kltest_rand(ctx, KL_F32, 2, (int64_t[]){9, 5}, KLTEST_NORMAL, KLTEST_CONTIG, 32);
	kl_tensor *w0 =
	        kltest_rand(ctx, KL_F32, 2, (int64_t[]){17, 5}, KLTEST_NORMAL, KLTEST_CONTIG, 33);
	double *loss[MODES][STEPS], *wv[MODES][STEPS];
	kl_tensor *h[MODES][STEPS];
	for (int mode = 0; mode < MODES; mode++) {
		kl_dtype dt = mode == 0 ? KL_F64 : KL_F32;
		rng_step b = {kl_add_scalar(kl_cast(w0, dt), 0.0), 0.3, 0.5, NULL};
		kl_tensor *xs = kl_cast(x, dt), *ts = kl_cast(tgt, dt);
		assert_int_equal(kl_set_requires_grad(b.w, true), KL_OK);
		kl_adamw_opts ao = kl_adamw_defaults();
		ao.lr = 0.05;
		if (adam)
			assert_non_null(b.opt = kl_optim_adamw(ctx, 1, &b.w, NULL, &ao));
		kl_compile_opts o = {.fullgraph = mode >= 3,
		                     .mode = mode == 4 ? KL_MODE_REDUCE_OVERHEAD : KL_MODE_DEFAULT};
		kl_fn *f = mode >= 2 ? kl_compile(ctx, body_rng_step, &b, 2, 2, &o) : NULL;
		assert_int_equal(kl_manual_seed(ctx, seed), KL_OK);
		int first_kernels = -1;
		for (int s = 0; s < STEPS; s++) {
			kl_tensor *in[2] = {xs, ts}, *out[2] = {NULL, NULL};
			if (f) {
				if (kl_fn_call(f, in, out) != KL_OK)
					fail_msg("mode %d step %d: %s", mode, s,
					         kl_last_error(ctx));
			} else {
				kl_scope_begin(ctx);
				assert_int_equal(body_rng_step(ctx, in, 2, out, 2, &b), KL_OK);
				kl_retain(out[0]);
				kl_retain(out[1]);
				kl_scope_end(ctx);
			}
			/* the replay: the plan and the fused step, no body; on CUDA in
			 * reduce-overhead one graph launch holds both (the first call
			 * warms up, the second captures) */
			if (s == 0 && f)
				first_kernels = kl_fn_last_kernels(f);
			int want_k = mode == 4 && kl_ctx_device(ctx) == KL_CUDA ? 1 : first_kernels;
			if (f && mode >= 3 && s > 0 && kl_fn_last_kernels(f) != want_k)
				fail_msg("mode %d step %d: %d launches, want %d", mode, s,
				         kl_fn_last_kernels(f), want_k);
			loss[mode][s] = kltest_read(out[0]);
			wv[mode][s] = kltest_read(b.w);
			h[mode][s] = out[1];
			kl_release(out[0]);
			uint64_t sd, off;
			assert_int_equal(kl_rng_get_state(ctx, &sd, &off), KL_OK);
			if (sd != seed || off != 2 * (uint64_t)(s + 1))
				fail_msg("mode %d step %d: generator at offset %llu, want %d", mode,
				         s, (unsigned long long)off, 2 * (s + 1));
		}
		if (f) {
			kl_fn_stats st;
			assert_int_equal(kl_fn_get_stats(f, &st), KL_OK);
			long want = mode >= 3 ? STEPS - 1 : 0;
			if (st.compiles != 1 || st.replays != want)
				fail_msg("mode %d: %d compiles, %ld replays (want 1 and %ld)", mode,
				         st.compiles, st.replays, want);
			/* a new optimizer in place of the one the replay holds: its
			 * guards fail (the old state is gone), the call traces again */
			if (adam && mode == 3) {
				kl_optim_free(b.opt);
				assert_non_null(b.opt = kl_optim_adamw(ctx, 1, &b.w, NULL, &ao));
				kl_tensor *in[2] = {xs, ts}, *out[2] = {NULL, NULL};
				assert_int_equal(kl_fn_call(f, in, out), KL_OK);
				kl_release(out[0]);
				kl_release(out[1]);
				assert_int_equal(kl_fn_get_stats(f, &st), KL_OK);
				assert_int_equal(st.replays, want);
				double *sv = kltest_read(kl_optim_state(b.opt, 0, "step"));
				assert_true(sv[0] == 1.0);
				free(sv);
			}
			kl_fn_free(f);
		}
		kl_release(xs);
		kl_release(ts);
		kl_release(b.w);
		kl_optim_free(b.opt);
	}
	const int64_t ws[2] = {17, 5};
	for (int s = 0; s < STEPS; s++) {
		/* the mask of step s: the eager dropout of x at the generator's offset 2s */
		kl_tensor *want = kl_dropout(x, 0.3, seed, 2 * (uint64_t)s, true);
		for (int mode = 1; mode < MODES; mode++) {
			if (!same_bits(h[mode][s], want))
				fail_msg("mode %d step %d: the input dropout differs from eager",
				         mode, s);
			char what[64];
			snprintf(what, sizeof what, "w after step %d, mode %d%s", s, mode,
			         adam ? " (AdamW)" : "");
			/* AdamW divides by the gradient's root mean square: an entry
			 * whose gradient is near 0 (near eps) moves by a share of lr
			 * that f32 rounding of the gradient changes */
			assert_true(kltest_compare(what, KL_F32, 2, ws, wv[mode][s], wv[0][s],
			                           adam ? 100 : 1));
			snprintf(what, sizeof what, "loss of step %d, mode %d", s, mode);
			assert_true(kltest_compare(what, KL_F32, 0, NULL, loss[mode][s], loss[0][s],
			                           adam ? 100 : 1));
			/* replayed = traced, bit for bit */
			if (mode >= 3 && (memcmp(wv[mode][s], wv[2][s], sizeof(double) * 85) ||
			                  loss[mode][s][0] != loss[2][s][0]))
				fail_msg(
				        "mode %d step %d: replayed step differs from the traced one",
				        mode, s);
		}
		if (s > 0 && same_bits(h[3][s], h[3][s - 1]))
			fail_msg("step %d drew the mask of step %d", s, s - 1);
		kl_release(want);
	}
	for (int mode = 0; mode < MODES; mode++)
		for (int s = 0; s < STEPS; s++) {
			free(loss[mode][s]);
			free(wv[mode][s]);
			kl_release(h[mode][s]);
		}
	if (adam)
		goto done;
	/* a reseed inside the body: the call's draws are not the generator's
	 * next ones, so the function traces every call */
	kl_fn *f = kl_compile(ctx, body_reseed, NULL, 1, 1, &(kl_compile_opts){.fullgraph = true});
	kl_tensor *want = kl_dropout(x, 0.5, 7, 0, true);
	for (int c = 0; c < 3; c++) {
		kl_tensor *out = NULL;
		assert_int_equal(kl_fn_call(f, &x, &out), KL_OK);
		assert_true(same_bits(out, want));
		kl_release(out);
	}
	kl_fn_stats st;
	assert_int_equal(kl_fn_get_stats(f, &st), KL_OK);
	assert_int_equal(st.replays, 0);
	kl_fn_free(f);
	kl_release(want);
done:
	kl_release(x);
	kl_release(tgt);
	kl_release(w0);
}

static void test_dropout_replayed_steps(void **state)
{
	(void)state;
	replayed_steps(false);
}

/* The same step with the fused AdamW (kl_optim_step inside the body, a
 * deferred action of the graph): a fullgraph variant replays it, the plan
 * then the fused step over the plan's gradients, the step counts moving
 * in the fused update itself. */
static void test_adamw_replayed_steps(void **state)
{
	(void)state;
	replayed_steps(true);
}

/* ---- nn parameters ---------------------------------------------------------------------- */

static void test_nn_parameters(void **state)
{
	(void)state;
	kl_ctx *ctx = g_ctx;
	kl_nn_decoder m;
	assert_int_equal(kl_nn_decoder_init(&m, ctx, 64, 4, 256, KL_F32, 1), KL_OK);
	/* the names are the PyTorch fixture's state-dict keys, in torch's order */
	kl_safetensors *st = kl_safetensors_open(ctx, KILN_FIXTURE_DIR "/decoder_small_f32.safetensors");
	assert_non_null(st);
	kl_nn_param ps[16];
	int n = kl_nn_params(&m.base, ps, 16);
	assert_int_equal(n, 9);
	static const char *torch_order[9] = {
	        "norm1.weight",        "norm2.weight",         "attn.in_proj_weight",
	        "attn.in_proj_bias",   "attn.out_proj.weight", "attn.out_proj.bias",
	        "ffn.gate_proj.weight", "ffn.up_proj.weight",  "ffn.down_proj.weight"};
	for (int i = 0; i < n; i++) {
		assert_string_equal(ps[i].name, torch_order[i]);
		bool in_file = false;
		for (int j = 0; j < kl_safetensors_count(st); j++)
			in_file |= !strcmp(kl_safetensors_name(st, j), ps[i].name);
		if (!in_file)
			fail_msg("'%s' is not a key of the torch fixture", ps[i].name);
	}
	/* an optimizer over the module; kl_nn_load keeps its parameters valid */
	kl_optim *o = kl_nn_adamw(&m.base, "layers.0.", NULL);
	assert_non_null(o);
	assert_int_equal(kl_optim_nparams(o), 9);
	assert_int_equal(kl_nn_load(&m.base, st, NULL), KL_OK);
	for (int i = 0; i < n; i++) {
		kl_tensor *got = kl_safetensors_get(st, ps[i].name), *want = kl_cast(got, KL_F32);
		assert_true(same_bits(kl_optim_param(o, i), want));
		kl_release(got);
		kl_release(want);
	}
	kl_safetensors_close(st);
	/* a step with every gradient one: the packed gate_up buffer the forward
	 * reads moves with its gate and up views */
	kl_tensor *g[9];
	for (int i = 0; i < n; i++) {
		kl_tensor *p = kl_optim_param(o, i);
		g[i] = kl_full(ctx, KL_F32, kl_ndim(p), kl_shape(p), 1.0);
	}
	kl_tensor *gu0 = clone(m.ffn.gate_up);
	assert_int_equal(kl_optim_step_grads(o, g), KL_OK);
	kl_tensor *halves[2] = {m.ffn.gate_proj.weight, m.ffn.up_proj.weight};
	kl_tensor *cat = kl_concat(2, halves, 0);
	assert_true(same_bits(cat, m.ffn.gate_up));
	assert_false(same_bits(gu0, m.ffn.gate_up));
	/* saved under the module's prefixed keys */
	char dir[] = "/tmp/kiln-test-optim-nn-XXXXXX";
	assert_non_null(mkdtemp(dir));
	char path[256];
	snprintf(path, sizeof path, "%s/o.safetensors", dir);
	assert_int_equal(kl_optim_save(o, path), KL_OK);
	kl_safetensors *so = kl_safetensors_open(ctx, path);
	kl_tensor *e = kl_safetensors_get(so, "state.layers.0.ffn.gate_proj.weight.exp_avg");
	assert_non_null(e);
	kl_release(e);
	kl_safetensors_close(so);
	unlink(path);
	rmdir(dir);
	/* the training flag reaches every submodule */
	assert_false(kl_nn_is_training(&m.base));
	assert_int_equal(kl_nn_train(&m.base, true), KL_OK);
	assert_true(kl_nn_is_training(&m.base) && kl_nn_is_training(&m.attn.out_proj.base) &&
	            kl_nn_is_training(&m.ffn.down_proj.base) && kl_nn_is_training(&m.norm2.base));
	assert_int_equal(kl_nn_train(&m.base, false), KL_OK);
	assert_false(kl_nn_is_training(&m.ffn.gate_proj.base));
	kl_nn_linear unset = {0};
	assert_int_equal(kl_nn_train(&unset.base, true), KL_EINVAL);
	assert_non_null(strstr(kl_last_error(NULL), "kl_nn_train: the module is not initialized"));
	assert_null(kl_nn_adamw(&unset.base, NULL, NULL));
	for (int i = 0; i < n; i++)
		kl_release(g[i]);
	kl_release(cat);
	kl_release(gu0);
	kl_optim_free(o);
	kl_nn_free(&m.base);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_adamw_reference),
	        cmocka_unit_test(test_sgd_reference),
	        cmocka_unit_test(test_save_load_resume),
	        cmocka_unit_test(test_optim_errors),
	        cmocka_unit_test(test_losses),
	        cmocka_unit_test(test_dropout),
	        cmocka_unit_test(test_dropout_compiled_loop),
	        cmocka_unit_test(test_dropout_replayed_steps),
	        cmocka_unit_test(test_adamw_replayed_steps),
	        cmocka_unit_test(test_nn_parameters),
	        cmocka_unit_test(test_step_in_graph),
	};
	if (getenv("KILN_TEST_FILTER")) /* one test by name (a GPU run's targeted stage) */
		cmocka_set_test_filter(getenv("KILN_TEST_FILTER"));
	return cmocka_run_group_tests(tests, setup, teardown);
}
