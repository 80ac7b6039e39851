/* test_epilogue.c - matrix-product epilogues: which consumers of a product
 * the scheduler folds into it (a scale, a [n] bias, a residual of the
 * product's shape, relu / gelu / gelu_tanh), the reasons it logs when it
 * refuses, the CPU executor's epilogue pass through kl_compile against the
 * float64 reference, cuBLASLt's epilogues on a GPU (skipped with the reason
 * without one), and the program format's new fields: a round trip, and
 * malformed programs rejected with a reason.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "capture/trace.h"
#include "core/core.h"
#include "graph/graph.h"
#include "kltest.h"
#include "lower/lower.h"
#include "runtime/runtime_int.h"
#include "runtime/compiled.h"

enum {
	E_BIAS_RELU,      /* relu(linear(x, w, b)) */
	E_BIAS_GELU_TANH, /* gelu_tanh(linear(x, w, b)) */
	E_BIAS_GELU,      /* gelu(linear(x, w, b)): erf GELU */
	E_BIAS_RESID,     /* linear(x, w, b) + r */
	E_SCALE_RESID,    /* (x @ w^T) * 0.125 + r */
	E_RESID_RELU,     /* relu(r + x @ w^T) */
	E_OUT_INTER,      /* y = linear(x, w, b) is an output, relu(y) another */
	E_TWO_USERS,      /* y = x @ w^T; relu(y) + y */
	E_ACT_THEN_BIAS,  /* relu(x @ w^T) + b: a bias after the activation */
	E_BIAS_THEN_SCALE, /* (linear(x, w, b)) * 2: a scale after the bias */
	E_BMM_SCALE_MASK, /* q @ k^T * 0.25 + mask over a batch that does not collapse */
	E_NKINDS
};

typedef struct ecase {
	int kind;
	int which; /* the output apply() builds (E_OUT_INTER has two) */
} ecase;

/* in: x [.., S, K], w [N, K], b [N], r [.., S, N] (E_BMM_SCALE_MASK: q
 * [B, S, K], k [B, S, K], unused, mask [B, S, S]) */
static kl_tensor *build(kl_tensor *const *in, const ecase *c, kl_tensor **second)
{
	kl_tensor *x = in[0], *w = in[1], *b = in[2], *r = in[3];
	switch (c->kind) {
	case E_BIAS_RELU:
		return kl_relu(kl_linear(x, w, b));
	case E_BIAS_GELU_TANH:
		return kl_gelu_tanh(kl_linear(x, w, b));
	case E_BIAS_GELU:
		return kl_gelu(kl_linear(x, w, b));
	case E_BIAS_RESID:
		return kl_add(kl_linear(x, w, b), r);
	case E_SCALE_RESID:
		return kl_add(kl_mul_scalar(kl_linear(x, w, NULL), 0.125), r);
	case E_RESID_RELU:
		return kl_relu(kl_add(r, kl_linear(x, w, NULL)));
	case E_OUT_INTER: {
		kl_tensor *y = kl_linear(x, w, b);
		if (second)
			*second = kl_relu(y);
		return y;
	}
	case E_TWO_USERS: {
		kl_tensor *y = kl_linear(x, w, NULL);
		return kl_add(kl_relu(y), y);
	}
	case E_ACT_THEN_BIAS:
		return kl_add(kl_relu(kl_linear(x, w, NULL)), b);
	case E_BIAS_THEN_SCALE:
		return kl_mul_scalar(kl_linear(x, w, b), 2.0);
	case E_BMM_SCALE_MASK:
		return kl_add(kl_mul_scalar(kl_matmul(x, kl_transpose(w, 1, 2)), 0.25), r);
	default:
		return NULL;
	}
}

static kl_tensor *apply(kl_tensor *const *in, const void *p)
{
	const ecase *c = p;
	kl_tensor *second = NULL;
	kl_tensor *y = build(in, c, c->which ? &second : NULL);
	return c->which ? second : y;
}

static kl_status body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                      void *user)
{
	(void)nin;
	const ecase *c = user;
	out[0] = build(in, c, nout > 1 ? &out[1] : NULL);
	return out[0] && (nout < 2 || out[1]) ? KL_OK : kl_last_status(ctx);
}

static int nouts(int kind)
{
	return kind == E_OUT_INTER ? 2 : 1;
}

/* what each case lowers to, per target */
typedef struct expect {
	int kernels, matmuls;
	const char *what;   /* the product step's description, or NULL */
	const char *reason; /* a line of the fusion log, or NULL */
} expect;

static expect expected(int kind, kl_target t, kl_dtype dt)
{
	/* f16/bf16 on the C target fold as f32 does: the product and its
	 * epilogue run on f32 copies (matmul_step.c), rounded once */
	(void)dt;
	switch (kind) {
	case E_BIAS_RELU:
		return (expect){0, 1, "+bias+relu", NULL};
	case E_BIAS_GELU_TANH:
		return (expect){0, 1, "+bias+gelu_tanh", NULL};
	case E_BIAS_GELU:
		if (t == KL_TARGET_CUDA)
			return (expect){1, 1, "+bias", "gelu (erf) stays a generated kernel"};
		return (expect){0, 1, "+bias+gelu", NULL};
	case E_BIAS_RESID:
		return (expect){0, 1, "+bias+residual", NULL};
	case E_SCALE_RESID:
		return (expect){0, 1, "*alpha+residual", NULL};
	case E_RESID_RELU:
		return (expect){0, 1, "+residual+relu", NULL};
	case E_OUT_INTER:
		return (expect){1, 1, "+bias", "is a graph output, stored before any epilogue"};
	case E_TWO_USERS:
		return (expect){1, 1, NULL, "has 2 users"};
	case E_ACT_THEN_BIAS:
		return (expect){1, 1, "+relu", "the bias cannot follow"};
	case E_BIAS_THEN_SCALE:
		return (expect){1, 1, "+bias", "a scale cannot follow"};
	case E_BMM_SCALE_MASK:
		return (expect){0, 1, "bmm 2x", NULL};
	default:
		return (expect){-1, -1, NULL, NULL};
	}
}

/* rows of the unbatched cases (test_cpu_one_row makes it 1) */
static int64_t g_rows = 8;

/* inputs of case kind: M rows (over batch dims when batched), K, N */
static void make_inputs(kl_ctx *ctx, int kind, kl_dtype dt, bool batched, uint64_t seed,
                        kltest_layout rlay, kl_tensor **in)
{
	const int64_t B = 2, S = 3, K = 24, N = 40;
	if (kind == E_BMM_SCALE_MASK) {
		in[0] = kltest_rand(ctx, dt, 3, (int64_t[]){B, S, K}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    seed);
		in[1] = kltest_rand(ctx, dt, 3, (int64_t[]){B, S, K}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    seed + 1);
		in[2] = kltest_rand(ctx, dt, 1, (int64_t[]){S}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    seed + 2);
		in[3] = kltest_rand(ctx, dt, 3, (int64_t[]){B, S, S}, KLTEST_NORMAL, rlay, seed + 3);
	} else {
		int64_t xs[3] = {B, S, K}, rs[3] = {B, S, N};
		int nd = batched ? 3 : 2;
		if (!batched) {
			xs[0] = g_rows;
			xs[1] = K;
			rs[0] = g_rows;
			rs[1] = N;
		}
		in[0] = kltest_rand(ctx, dt, nd, xs, KLTEST_NORMAL, KLTEST_CONTIG, seed);
		in[1] = kltest_rand(ctx, dt, 2, (int64_t[]){N, K}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    seed + 1);
		in[2] = kltest_rand(ctx, dt, 1, (int64_t[]){N}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    seed + 2);
		in[3] = kltest_rand(ctx, dt, nd, rs, KLTEST_NORMAL, rlay, seed + 3);
	}
	for (int i = 0; i < 4; i++)
		assert_non_null(in[i]);
}

static void release4(kl_tensor **in)
{
	for (int i = 0; i < 4; i++)
		kl_release(in[i]);
}

static const kl_step *product_step(const kl_program *P)
{
	for (int i = 0; i < P->nsteps; i++)
		if (P->steps[i].kind == KL_STEP_MATMUL)
			return &P->steps[i];
	return NULL;
}

/* ---- what the scheduler folds, per target ----------------------------------------- */

static void lower_case(kl_ctx *ctx, int kind, kl_dtype dt, kl_target t, bool batched,
                       kltest_layout rlay, expect want)
{
	kl_tensor *in[4];
	make_inputs(ctx, kind, dt, batched, 7, rlay, in);
	ecase c = {kind, 0};
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *outs[2] = {NULL, NULL};
	outs[0] = build(in, &c, nouts(kind) > 1 ? &outs[1] : NULL);
	kl_trace *tr = kl__trace_end(ctx, nouts(kind), outs);
	kl_scope_end(ctx);
	assert_non_null(tr);
	kl_lower_opts o = {.target = t, .fusion = true};
	kl_program P;
	char err[256];
	kl_status st = kl__lower(&tr->g, &o, &P, err, sizeof err);
	if (st != KL_OK)
		fprintf(stderr, "%s\n", err);
	assert_int_equal(st, KL_OK);
	int k = 0, m = 0;
	for (int i = 0; i < P.nsteps; i++)
		P.steps[i].kind == KL_STEP_KERNEL ? k++ : m++;
	const kl_step *mm = product_step(&P);
	bool ok = k == want.kernels && m == want.matmuls && mm &&
	          (!want.what || strstr(mm->what, want.what)) &&
	          (!want.reason || (P.fusion_log && strstr(P.fusion_log, want.reason)));
	if (!ok) {
		fprintf(stderr, "FAIL case %d %s target %s: %d kernels, %d products; want %d, %d, "
		        "\"%s\", \"%s\"\n", kind, kl_dtype_name(dt), t == KL_TARGET_C ? "C" : "CUDA",
		        k, m, want.kernels, want.matmuls, want.what ? want.what : "",
		        want.reason ? want.reason : "");
		for (int i = 0; i < P.nsteps; i++)
			fprintf(stderr, "  step %d: %s\n", i, P.steps[i].what);
		fprintf(stderr, "%s", P.fusion_log ? P.fusion_log : "(no log)\n");
	}
	assert_true(ok);
	/* the generated source of a CUDA program is not run here: it only has
	 * to hold no kernel for what the product took */
	kl__program_free(&P);
	kl__trace_free(tr);
	release4(in);
}

static void test_folding_decisions(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	for (int kind = 0; kind < E_NKINDS; kind++) {
		lower_case(ctx, kind, KL_F32, KL_TARGET_C, false, KLTEST_CONTIG,
		           expected(kind, KL_TARGET_C, KL_F32));
		lower_case(ctx, kind, KL_F32, KL_TARGET_CUDA, true, KLTEST_CONTIG,
		           expected(kind, KL_TARGET_CUDA, KL_F32));
		lower_case(ctx, kind, KL_BF16, KL_TARGET_CUDA, false, KLTEST_CONTIG,
		           expected(kind, KL_TARGET_CUDA, KL_BF16));
	}
	/* f16 and bf16 on the CPU fold every case as f32 does */
	for (int kind = 0; kind < E_NKINDS; kind++) {
		lower_case(ctx, kind, KL_BF16, KL_TARGET_C, false, KLTEST_CONTIG,
		           expected(kind, KL_TARGET_C, KL_BF16));
		lower_case(ctx, kind, KL_F16, KL_TARGET_C, true, KLTEST_CONTIG,
		           expected(kind, KL_TARGET_C, KL_F16));
	}
	/* f64 on CUDA: cuBLASLt's bias epilogue is not used, the residual is */
	lower_case(ctx, E_BIAS_RELU, KL_F64, KL_TARGET_CUDA, false, KLTEST_CONTIG,
	           (expect){1, 1, NULL, "used for f16/bf16/f32 products only"});
	lower_case(ctx, E_SCALE_RESID, KL_F64, KL_TARGET_CUDA, false, KLTEST_CONTIG,
	           (expect){0, 1, "*alpha+residual", NULL});
	/* a residual whose columns are not unit-stride stays a kernel */
	lower_case(ctx, E_BIAS_RESID, KL_F32, KL_TARGET_C, false, KLTEST_PERMUTED,
	           (expect){1, 1, "+bias", "column stride"});
	/* with fusion off nothing folds */
	kl_tensor *in[4];
	make_inputs(ctx, E_BIAS_RELU, KL_F32, false, 3, KLTEST_CONTIG, in);
	ecase c = {E_BIAS_RELU, 0};
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *y = build(in, &c, NULL);
	kl_trace *tr = kl__trace_end(ctx, 1, &y);
	kl_scope_end(ctx);
	kl_lower_opts o = {.target = KL_TARGET_C, .fusion = false};
	kl_program P;
	assert_int_equal(kl__lower(&tr->g, &o, &P, NULL, 0), KL_OK);
	assert_int_equal(P.nsteps, 3);
	kl__program_free(&P);
	kl__trace_free(tr);
	release4(in);
	kl_ctx_free(ctx);
}

/* ---- compiled and run, against the reference --------------------------------------- */

static double factor_of(kl_dtype dt)
{
	return dt == KL_BF16 || dt == KL_F16 ? 4 : 2;
}

static int cmp_abs(const void *a, const void *b)
{
	double x = fabs(*(const double *)a), y = fabs(*(const double *)b);
	return x < y ? -1 : x > y;
}

/* After relu about half the results are exact zeros, so kltest_compare's
 * absolute slack (its tolerance times the median magnitude) is zero while a
 * small result near the kink carries the cancellation error of the product
 * before it. Such results are compared with that slack taken from the
 * median of the nonzero results; NaN never passes. */
static bool compare_activated(const char *what, kl_dtype dt, int64_t n, const double *got,
                              const double *ref, double factor)
{
	double *mag = malloc(sizeof(double) * (size_t)(n ? n : 1));
	assert_non_null(mag);
	int64_t nz = 0;
	for (int64_t i = 0; i < n; i++)
		if (ref[i] != 0)
			mag[nz++] = ref[i];
	qsort(mag, (size_t)nz, sizeof(double), cmp_abs);
	double typical = nz ? fabs(mag[nz / 2]) : 1;
	free(mag);
	double rtol = kltest_tol(dt) * factor;
	for (int64_t i = 0; i < n; i++)
		if (!(fabs(got[i] - ref[i]) <= rtol * (fabs(ref[i]) + typical))) {
			fprintf(stderr, "FAIL %s: element %lld: got %.17g, reference %.17g (rtol %g, "
			        "typical %g)\n", what, (long long)i, got[i], ref[i], rtol, typical);
			return false;
		}
	return true;
}

static bool has_activation(int kind)
{
	return kind == E_BIAS_RELU || kind == E_BIAS_GELU_TANH || kind == E_BIAS_GELU ||
	       kind == E_RESID_RELU || kind == E_TWO_USERS || kind == E_ACT_THEN_BIAS ||
	       kind == E_OUT_INTER;
}

/* one case compiled on ctx (CPU or CUDA) with inputs whose values come from
 * the CPU context ref (the reference runs there) */
static void run_case(kl_ctx *ctx, kl_ctx *ref, int kind, kl_dtype dt, bool batched,
                     kl_target t, uint64_t seed)
{
	kl_tensor *rin[4], *in[4];
	make_inputs(ref, kind, dt, batched, seed, KLTEST_CONTIG, rin);
	for (int i = 0; i < 4; i++) {
		if (ctx == ref) {
			in[i] = kl_retain(rin[i]);
			continue;
		}
		double *v = kltest_read(rin[i]);
		assert_non_null(v);
		in[i] = kltest_from_values(ctx, dt, kl_ndim(rin[i]), kl_shape(rin[i]), v,
		                           KLTEST_CONTIG);
		free(v);
		assert_non_null(in[i]);
	}
	ecase c = {kind, 0};
	int no = nouts(kind);
	kl_fn *f = kl_compile(ctx, body, &c, 4, no, NULL);
	assert_non_null(f);
	kl_tensor *out[2] = {NULL, NULL};
	kl_status st = kl_fn_call(f, in, out);
	if (st != KL_OK)
		fprintf(stderr, "case %d %s: %s\n", kind, kl_dtype_name(dt), kl_last_error(ctx));
	assert_int_equal(st, KL_OK);
	expect want = expected(kind, t, dt);
	if (kl_fn_last_kernels(f) != want.kernels + want.matmuls)
		kl_explain(f, stderr);
	assert_int_equal(kl_fn_last_kernels(f), want.kernels + want.matmuls);
	for (int j = 0; j < no; j++) {
		ecase cj = {kind, j};
		char what[96];
		snprintf(what, sizeof what, "epilogue case %d output %d %s on %s", kind, j,
		         kl_dtype_name(dt), ctx == ref ? "cpu" : "cuda");
		int nd;
		int64_t shape[KL_MAX_DIMS];
		kl_dtype rdt;
		double *want_v = kltest_reference(ref, what, apply, rin, &cj, &nd, shape, &rdt);
		assert_non_null(want_v);
		assert_int_equal(kl_tensor_dtype(out[j]), rdt);
		double *got = kltest_read(out[j]);
		assert_non_null(got);
		if (has_activation(kind))
			assert_true(compare_activated(what, rdt, kl__numel(nd, shape), got, want_v,
			                              factor_of(dt)));
		else
			assert_true(kltest_compare(what, rdt, nd, shape, got, want_v,
			                           factor_of(dt)));
		free(got);
		free(want_v);
		kl_release(out[j]);
	}
	/* explain names the epilogue */
	if (want.what && want.kernels == 0) {
		char *buf = NULL;
		size_t len = 0;
		FILE *m = open_memstream(&buf, &len);
		assert_int_equal(kl_explain(f, m), KL_OK);
		fclose(m);
		assert_non_null(strstr(buf, want.what));
		free(buf);
	}
	kl_fn_free(f);
	release4(in);
	release4(rin);
}

static void test_cpu_results(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	uint64_t seed = 100;
	for (int kind = 0; kind < E_NKINDS; kind++) {
		run_case(ctx, ctx, kind, KL_F32, false, KL_TARGET_C, seed += 10);
		run_case(ctx, ctx, kind, KL_F32, true, KL_TARGET_C, seed += 10);
		run_case(ctx, ctx, kind, KL_F64, true, KL_TARGET_C, seed += 10);
	}
	/* f16/bf16: f32 copies of the operands through the f32 path, every
	 * epilogue in f32 before the one rounding (kiln's small product at 8
	 * rows, OpenBLAS then the f32 epilogue for the batched 6 rows x 2) */
	for (int kind = 0; kind < E_NKINDS; kind++)
		for (int h = 0; h < 2; h++) {
			kl_dtype dt = h ? KL_BF16 : KL_F16;
			run_case(ctx, ctx, kind, dt, false, KL_TARGET_C, seed += 10);
			run_case(ctx, ctx, kind, dt, true, KL_TARGET_C, seed += 10);
		}
	kl_ctx_free(ctx);
}

/* the one-row left operand: column 1 of a [K, 3] x as a [1, K] view
 * (elements 3 apart), or a dense copy of it; times a [K, N] weight */
static kl_tensor *apply_row_kn(kl_tensor *const *in, const void *p)
{
	int v = *(const int *)p; /* bit 0: x strided; bit 1: W given as [N, K], transposed */
	kl_tensor *xt = kl_transpose(in[0], 0, 1); /* [3, K] */
	kl_tensor *row = kl_slice(xt, 0, 1, 2, 1); /* [1, K]: elements 3 apart */
	if (!(v & 1))
		row = kl_contiguous(row);
	return kl_matmul(row, v & 2 ? kl_transpose(in[2], 0, 1) : in[1]);
}

static kl_status body_row_kn(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                             int nout, void *user)
{
	(void)ctx;
	(void)nin;
	(void)nout;
	out[0] = apply_row_kn(in, user);
	return out[0] ? KL_OK : KL_EINVAL;
}

/* one row (a decode step): the CPU product becomes a matrix-vector product;
 * every epilogue, f32 and f64, against the reference */
static void test_cpu_one_row(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	uint64_t seed = 900;
	g_rows = 1;
	for (int kind = 0; kind < E_NKINDS; kind++) {
		if (kind == E_BMM_SCALE_MASK)
			continue; /* batched by construction */
		run_case(ctx, ctx, kind, KL_F32, false, KL_TARGET_C, seed += 10);
		run_case(ctx, ctx, kind, KL_F64, false, KL_TARGET_C, seed += 10);
		run_case(ctx, ctx, kind, KL_F16, false, KL_TARGET_C, seed += 10);
		run_case(ctx, ctx, kind, KL_BF16, false, KL_TARGET_C, seed += 10);
	}
	g_rows = 8;
	/* a weight stored k x n (x @ W, not x @ W^T): the other orientation,
	 * and a row of x read at a stride (a column of a wider matrix's view) */
	/* sizes: one block of outputs; several (1000 > 256) split across threads
	 * (300 x 1000 is past the parallel threshold); the weight as [K, N] and
	 * as the transpose of [N, K] (a Linear's), x dense and strided */
	static const int64_t kn[2][2] = {{37, 53}, {300, 1000}};
	static const kl_dtype dts[4] = {KL_F32, KL_F64, KL_F16, KL_BF16};
	for (int di = 0; di < 8; di++) {
		kl_dtype dt = dts[di & 3];
		int64_t K = kn[di >> 2][0], N = kn[di >> 2][1];
		kl_tensor *in[3];
		in[0] = kltest_rand(ctx, dt, 2, (int64_t[]){K, 3}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    seed += 10);
		in[1] = kltest_rand(ctx, dt, 2, (int64_t[]){K, N}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    seed += 10);
		in[2] = kltest_rand(ctx, dt, 2, (int64_t[]){N, K}, KLTEST_NORMAL, KLTEST_CONTIG,
		                    seed += 10);
		for (int v = 0; v < 4; v++) {
			kl_fn *f = kl_compile(ctx, body_row_kn, &v, 3, 1, NULL);
			assert_non_null(f);
			kl_tensor *out = NULL;
			assert_int_equal(kl_fn_call(f, in, &out), KL_OK);
			char what[96];
			snprintf(what, sizeof what, "one row x @ W (%lld x %lld%s) %s, x %s",
			         (long long)K, (long long)N, v & 2 ? ", transposed" : "",
			         kl_dtype_name(dt), v & 1 ? "strided" : "dense");
			int nd;
			int64_t shape[KL_MAX_DIMS];
			kl_dtype rdt;
			double *want = kltest_reference(ctx, what, apply_row_kn, in, &v, &nd, shape,
			                                &rdt);
			double *got = kltest_read(out);
			assert_non_null(want);
			assert_non_null(got);
			assert_int_equal(nd, 2);
			assert_int_equal(shape[0], 1);
			assert_int_equal(shape[1], N);
			assert_true(kltest_compare(what, rdt, nd, shape, got, want, factor_of(dt)));
			free(want);
			free(got);
			kl_release(out);
			kl_fn_free(f);
		}
		for (int i = 0; i < 3; i++)
			kl_release(in[i]);
	}
	kl_ctx_free(ctx);
}

/* ---- the program format ---------------------------------------------------------------- */

static void lower_for_bytes(kl_ctx *ctx, kl_tensor **in, kl_trace **tr, kl_program *P, int kind)
{
	make_inputs(ctx, kind, KL_F32, true, 5, KLTEST_CONTIG, in);
	ecase c = {kind, 0};
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *y = build(in, &c, NULL);
	*tr = kl__trace_end(ctx, 1, &y);
	kl_scope_end(ctx);
	assert_non_null(*tr);
	kl_lower_opts o = {.target = KL_TARGET_C, .fusion = true};
	assert_int_equal(kl__lower(&(*tr)->g, &o, P, NULL, 0), KL_OK);
}

/* serialize p, break it with mutate, expect the reader to refuse it naming why */
static void expect_rejected(const kl_program *p, void (*mutate)(kl_program *), const char *why)
{
	kl_program q = *p;
	q.steps = malloc(sizeof(kl_step) * (size_t)p->nsteps);
	assert_non_null(q.steps);
	memcpy(q.steps, p->steps, sizeof(kl_step) * (size_t)p->nsteps);
	mutate(&q);
	char err[256] = "";
	assert_int_equal(kl__program_validate(&q, -1, -1, err, sizeof err), KL_EFORMAT);
	if (!strstr(err, why))
		fprintf(stderr, "validator said \"%s\", want \"%s\"\n", err, why);
	assert_non_null(strstr(err, why));
	uint8_t *bytes;
	size_t len;
	assert_int_equal(kl__program_serialize(&q, &bytes, &len), KL_OK);
	kl_program back;
	err[0] = 0;
	assert_int_equal(kl__program_deserialize(bytes, len, &back, err, sizeof err), KL_EFORMAT);
	assert_non_null(strstr(err, why));
	free(bytes);
	free(q.steps);
}

static kl_matmul_step *mm_of(kl_program *q)
{
	for (int i = 0; i < q->nsteps; i++)
		if (q->steps[i].kind == KL_STEP_MATMUL)
			return &q->steps[i].mm;
	return NULL;
}

static void bad_act(kl_program *q)
{
	mm_of(q)->act = (kl_mm_act)7;
}
static void bad_bias_id(kl_program *q)
{
	mm_of(q)->bias = q->nbufs + 3;
}
static void bias_is_result(kl_program *q)
{
	kl_matmul_step *mm = mm_of(q);
	mm->bias = mm->c;
}
static void bias_negative(kl_program *q)
{
	mm_of(q)->bias_off = -5;
}
static void resid_not_read(kl_program *q)
{
	for (int i = 0; i < q->nsteps; i++)
		if (q->steps[i].kind == KL_STEP_MATMUL) {
			kl_step *s = &q->steps[i];
			for (int j = 0; j < s->nreads; j++)
				if (s->reads[j] == s->mm.r)
					s->reads[j] = s->reads[--s->nreads];
		}
}
static void resid_short_rows(kl_program *q)
{
	mm_of(q)->r_ld = 1;
}
static void resid_wrong_dtype(kl_program *q)
{
	kl_matmul_step *mm = mm_of(q);
	q->bufs[mm->r].dtype = KL_F64;
}

static void test_program_format(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	kl_tensor *in[4];
	kl_trace *tr;
	kl_program P;
	lower_for_bytes(ctx, in, &tr, &P, E_BIAS_RESID);
	const kl_step *s = product_step(&P);
	assert_non_null(s);
	assert_true(s->mm.has_bias && s->mm.has_r);
	/* a round trip keeps every field */
	uint8_t *bytes;
	size_t len;
	assert_int_equal(kl__program_serialize(&P, &bytes, &len), KL_OK);
	kl_program back;
	char err[256] = "";
	assert_int_equal(kl__program_deserialize(bytes, len, &back, err, sizeof err), KL_OK);
	const kl_step *t = product_step(&back);
	assert_non_null(t);
	assert_true(t->mm.has_bias && t->mm.has_r);
	assert_int_equal(t->mm.bias, s->mm.bias);
	assert_int_equal(t->mm.r, s->mm.r);
	assert_int_equal(t->mm.r_ld, s->mm.r_ld);
	assert_int_equal(t->mm.act, s->mm.act);
	assert_true(t->mm.beta == s->mm.beta);
	kl__program_free(&back);
	/* an entry of the previous format: rejected, with the versions */
	uint8_t *old = malloc(len);
	assert_non_null(old);
	memcpy(old, bytes, len);
	old[8] = 1;
	old[9] = old[10] = old[11] = 0;
	assert_int_equal(kl__program_deserialize(old, len, &back, err, sizeof err), KL_EFORMAT);
	assert_non_null(strstr(err, "version 1"));
	assert_non_null(strstr(err, "before product epilogues"));
	/* every truncation is refused, never read past */
	for (size_t n = 0; n < len; n += 7) {
		assert_int_equal(kl__program_deserialize(bytes, n, &back, err, sizeof err),
		                 KL_EFORMAT);
	}
	free(old);
	free(bytes);
	expect_rejected(&P, bad_act, "activation");
	expect_rejected(&P, bad_bias_id, "out of range");
	expect_rejected(&P, bias_is_result, "bias is its result buffer");
	expect_rejected(&P, bias_negative, "bias offset out of range");
	expect_rejected(&P, resid_not_read, "not among its reads");
	expect_rejected(&P, resid_short_rows, "row stride");
	kl__program_free(&P);
	kl__trace_free(tr);
	release4(in);
	/* a residual of another dtype than the result */
	lower_for_bytes(ctx, in, &tr, &P, E_SCALE_RESID);
	kl_program q = P;
	q.bufs = malloc(sizeof(kl_buf) * (size_t)P.nbufs);
	assert_non_null(q.bufs);
	memcpy(q.bufs, P.bufs, sizeof(kl_buf) * (size_t)P.nbufs);
	resid_wrong_dtype(&q);
	assert_int_equal(kl__program_validate(&q, -1, -1, err, sizeof err), KL_EFORMAT);
	assert_non_null(strstr(err, "residual is f64"));
	free(q.bufs);
	kl__program_free(&P);
	kl__trace_free(tr);
	release4(in);
	kl_ctx_free(ctx);
}

/* ---- on a GPU ---------------------------------------------------------------------- */

static void test_gpu_results(void **state)
{
	(void)state;
	kl_ctx *gpu = kl_ctx_new(&(kl_ctx_opts){.device = KL_CUDA});
	if (!gpu) {
		print_message("test_epilogue: GPU cases skipped: %s\n", kl_last_error(NULL));
		skip();
	}
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	uint64_t seed = 900;
	const kl_dtype dts[2] = {KL_F32, KL_BF16};
	for (int d = 0; d < 2; d++)
		for (int kind = 0; kind < E_NKINDS; kind++) {
			run_case(gpu, ctx, kind, dts[d], false, KL_TARGET_CUDA, seed += 10);
			run_case(gpu, ctx, kind, dts[d], true, KL_TARGET_CUDA, seed += 10);
		}
	kl_ctx_free(ctx);
	kl_ctx_free(gpu);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_folding_decisions),
	        cmocka_unit_test(test_cpu_results),     cmocka_unit_test(test_cpu_one_row),
	        cmocka_unit_test(test_program_format),
	        cmocka_unit_test(test_gpu_results),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
