/* test_random_lower.c - lowering on many graphs: the cross-entropy of issue
 * 18 (fused, it once made kernels that depend on each other), then random
 * graphs from a seeded generator mixing pointwise ops, reductions (keepdim
 * or not, one axis, several, all), gathers with computed indices, one-hot
 * masks, broadcasts, reshapes, permutes, slices, expands, casts, softmax,
 * small products and several outputs sharing intermediates. Each graph is
 * lowered for the C and the CUDA targets (the scheduler's plan must hold for
 * both), compiled with kl_compile (plain or fullgraph), called twice with
 * fresh random inputs (outputs' blocks poisoned with NaN first) and every
 * output compared with the float64 reference of the same trace.
 *
 * The generator is the compiled body itself: it draws its ops from the
 * graph's seed, looking at the shapes of the values it has made, so every
 * trace of one seed is the same graph. Alongside each value it keeps a bound
 * on its magnitude and on how far two correct evaluations may differ (each
 * op's rounding in its dtype, a few ulps for the math library, propagated
 * through the op's derivative): the test's tolerance per output, and what
 * makes comparisons, integer casts and argmax safe to draw (only on values
 * both sides compute exactly).
 *
 * KILN_RANDOM_GRAPHS=N runs N random graphs (default 1000), from seed
 * KILN_RANDOM_SEED (default 1). Shapes, dtypes and op choices come from a
 * small space so that the disk cache (KILN_CACHE_DIR) serves repeated
 * structures; inputs are fresh on every call. A failing seed is printed;
 * fixed ones stay in regress_seeds[].
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "core/core.h"
#include "graph/reference.h"
#include "kltest.h"
#include "lower/lower.h"
#include "runtime/compiled.h"

static kl_ctx *ctx;

/* ---- a body with several outputs against the reference ------------------------------- */

typedef struct multi_check {
	const char *what;
	kl_fn_body body;
	void *user;
	int nin, nout;
	bool fullgraph;
	/* per output: absolute tolerance (NULL: kltest_compare's, with factor) */
	const double *atol;
	double factor;
} multi_check;

/* the trace of body on in[] (NULL on failure, printed) */
static kl_trace *trace_body(const multi_check *m, kl_tensor *const *in)
{
	kl_tensor *out[8] = {0};
	kl_scope_begin(ctx);
	kl_status st = kl__trace_begin(ctx);
	if (st == KL_OK)
		st = m->body(ctx, in, m->nin, out, m->nout, m->user);
	kl_trace *tr = kl__trace_end(ctx, st == KL_OK ? m->nout : 0, out);
	kl_scope_end(ctx);
	if (st != KL_OK || !tr) {
		fprintf(stderr, "FAIL %s: trace: %s\n", m->what, kl_last_error(ctx));
		if (tr)
			kl__trace_free(tr);
		return NULL;
	}
	return tr;
}

/* the float64 reference of every output of tr (malloc'd arrays in ref[]) */
static bool reference_of(const char *what, const kl_trace *tr, double **ref)
{
	const kl_graph *g = &tr->g;
	double *vals[64] = {0};
	bool ok = g->ninputs <= 64 && tr->nin_tensors == g->ninputs;
	for (int k = 0; ok && k < g->ninputs; k++)
		ok = (vals[k] = kltest_read(tr->in_tensors[k])) != NULL;
	char err[512] = "";
	if (ok && kl__ref_eval(g, (const double *const *)vals, ref, err, sizeof err) != KL_OK) {
		fprintf(stderr, "FAIL %s: reference: %s\n", what, err);
		ok = false;
	}
	for (int k = 0; k < g->ninputs && k < 64; k++)
		free(vals[k]);
	return ok;
}

/* |got - ref| <= atol everywhere, NaN only where ref is NaN, infinities equal */
static bool within(const char *what, int64_t n, const double *got, const double *ref, double atol)
{
	for (int64_t i = 0; i < n; i++) {
		double g = got[i], r = ref[i];
		bool ok = isnan(r) ? isnan(g) : isinf(r) ? g == r : fabs(g - r) <= atol;
		if (!ok) {
			fprintf(stderr, "FAIL %s: element %lld is %.9g, the reference %.9g (tolerance "
			        "%.3g)\n", what, (long long)i, g, r, atol);
			return false;
		}
	}
	return true;
}

/* kl_compile m's body, call it twice with inputs from make_inputs (fresh
 * values each call) and compare every output with the reference of its own
 * trace on those inputs. */
typedef bool (*inputs_fn)(void *user, int call, kl_tensor **in);

static bool check_multi(const multi_check *m, inputs_fn make_inputs)
{
	kl_compile_opts o = {.fullgraph = m->fullgraph};
	kl_fn *f = kl_compile(ctx, m->body, m->user, m->nin, m->nout, &o);
	if (!f) {
		fprintf(stderr, "FAIL %s: kl_compile: %s\n", m->what, kl_last_error(ctx));
		return false;
	}
	bool ok = true;
	for (int call = 0; call < 2 && ok; call++) {
		kl_tensor *in[8] = {0}, *out[8] = {0};
		double *ref[8] = {0};
		kl_trace *tr = NULL;
		ok = make_inputs(m->user, call, in) && (tr = trace_body(m, in)) != NULL &&
		     reference_of(m->what, tr, ref);
		for (int k = 0; ok && k < m->nout; k++) {
			const kl_node *x = &tr->g.nodes[tr->g.outputs[k]];
			kl_tensor *p = kl_full(ctx, (kl_dtype)x->dtype, x->ndim, x->shape, NAN);
			ok = p != NULL;
			kl_release(p);
		}
		if (ok && kl_fn_call(f, in, out) != KL_OK) {
			fprintf(stderr, "FAIL %s: call %d: %s\n", m->what, call, kl_last_error(ctx));
			ok = false;
		}
		for (int k = 0; ok && k < m->nout; k++) {
			const kl_node *x = &tr->g.nodes[tr->g.outputs[k]];
			char w[256];
			snprintf(w, sizeof w, "%s, %scall %d, output %d", m->what,
			         m->fullgraph ? "fullgraph, " : "", call, k);
			if (kl_tensor_dtype(out[k]) != (kl_dtype)x->dtype || kl_ndim(out[k]) != x->ndim ||
			    memcmp(kl_shape(out[k]), x->shape, sizeof(int64_t) * (size_t)x->ndim)) {
				fprintf(stderr, "FAIL %s: %s result, the trace says %s\n", w,
				        kl_dtype_name(kl_tensor_dtype(out[k])),
				        kl_dtype_name((kl_dtype)x->dtype));
				ok = false;
				break;
			}
			double *got = kltest_read(out[k]);
			ok = got && (m->atol ? within(w, kl_numel(out[k]), got, ref[k], m->atol[k])
			                     : kltest_compare(w, (kl_dtype)x->dtype, x->ndim, x->shape,
			                                      got, ref[k], m->factor));
			free(got);
		}
		if (!ok && tr)
			kl__graph_print(&tr->g, stderr);
		for (int k = 0; k < m->nout; k++) {
			free(ref[k]);
			kl_release(out[k]);
		}
		for (int k = 0; k < m->nin; k++)
			kl_release(in[k]);
		if (tr)
			kl__trace_free(tr);
	}
	kl_fn_free(f);
	return ok;
}

/* the program body makes for in[], lowered for target t with fusion: it must
 * lower and validate (NULL: fine; else the error, printed) */
static bool lowers(const multi_check *m, kl_tensor *const *in, kl_target t)
{
	kl_trace *tr = trace_body(m, in);
	if (!tr)
		return false;
	kl_lower_opts o = {.target = t, .fusion = true, .log_ctx = ctx}; /* KILN_LOGS=fusion */
	kl_program P;
	char err[512] = "";
	kl_status st = kl__lower(&tr->g, &o, &P, err, sizeof err);
	if (st == KL_OK) {
		st = kl__program_validate(&P, tr->g.ninputs, tr->g.noutputs, err, sizeof err);
		kl__program_free(&P);
	}
	if (st != KL_OK) {
		fprintf(stderr, "FAIL %s (%s target): %s\n", m->what,
		        t == KL_TARGET_CUDA ? "CUDA" : "C", err);
		kl__graph_print(&tr->g, stderr);
	}
	kl__trace_free(tr);
	return st == KL_OK;
}

/* ---- issue 18: softmax cross-entropy and its gradient, by hand ------------------------- */

enum { CE_B = 4, CE_V = 7 };

/* z [B, V] f32, t [B] i64: the mean loss and its gradient, z[t] through kl_gather */
static kl_status body_ce(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                         void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	const int last[1] = {-1};
	kl_tensor *z = in[0], *t = in[1];
	kl_tensor *m = kl_max(z, 1, last, true), *zs = kl_sub(z, m);
	kl_tensor *lse = kl_log(kl_sum(kl_exp(zs), 1, last, true));
	kl_tensor *cols = kl_reshape(kl_arange(c, KL_I64, 0, CE_V, 1), 2, (int64_t[]){1, CE_V});
	kl_tensor *onehot = kl_eq(cols, kl_reshape(t, 2, (int64_t[]){CE_B, 1}));
	kl_tensor *idx = kl_add(kl_mul_scalar(kl_arange(c, KL_I64, 0, CE_B, 1), CE_V), t);
	kl_tensor *zt = kl_gather(kl_reshape(zs, 2, (int64_t[]){CE_B * CE_V, 1}), idx);
	out[0] = kl_mean(kl_sub(lse, zt), 0, NULL, false);
	out[1] = kl_div_scalar(kl_sub(kl_exp(kl_sub(zs, lse)), kl_cast(onehot, KL_F32)), CE_B);
	return out[0] && out[1] ? KL_OK : kl_last_status(c);
}

static bool ce_inputs(void *user, int call, kl_tensor **in)
{
	(void)user;
	double t[CE_B];
	uint64_t s = 1800 + (uint64_t)call;
	for (int i = 0; i < CE_B; i++)
		t[i] = (double)(kltest_next(&s) % CE_V);
	in[0] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){CE_B, CE_V}, KLTEST_NORMAL, KLTEST_CONTIG,
	                    1810 + (uint64_t)call);
	in[1] = kltest_from_values(ctx, KL_I64, 1, (int64_t[]){CE_B}, t, KLTEST_CONTIG);
	return in[0] && in[1];
}

/* Before: the gradient's kernel (exp(zs - lse) - onehot, / B) and the row
 * kernel of max, exp and sum were built so that each read the other
 * ("kernels depend on each other"). Lowered for both targets, then compiled
 * (plain and fullgraph) and run against the reference. */
static void test_cross_entropy(void **state)
{
	(void)state;
	kl_tensor *in[2];
	assert_true(ce_inputs(NULL, 0, in));
	multi_check m = {.what = "cross-entropy with kl_gather", .body = body_ce, .nin = 2,
	                 .nout = 2, .factor = 8};
	assert_true(lowers(&m, in, KL_TARGET_C));
	assert_true(lowers(&m, in, KL_TARGET_CUDA));
	kl_release(in[0]);
	kl_release(in[1]);
	assert_true(check_multi(&m, ce_inputs));
	m.fullgraph = true;
	assert_true(check_multi(&m, ce_inputs));
}

int main(void)
{
	ctx = kltest_ctx_from_env("test_random_lower");
	if (!ctx)
		return 1;
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_cross_entropy),
	};
	int r = cmocka_run_group_tests(tests, NULL, NULL);
	kl_ctx_free(ctx);
	return r;
}
