/* test_attention.c - fused attention: kl_sdpa eagerly and compiled against
 * the float64 reference (odd sizes, Tq != Tk, causal or not, head dims 16,
 * 64, 128, batch dims 0..2, every float dtype); the scheduler's recognition
 * of attention written by hand (one attention step, or a logged refusal);
 * the decomposition for targets without the step; attention steps through
 * the program serializer and validator; every CUDA kernel variant compiled
 * by NVRTC for sm_90 (wgmma for sm_90a; kl_attn_fa3 with no spill and no
 * ptxas performance note); on a GPU (skipped without one) the
 * CUDA kernels against the reference (each forced in turn, the wgmma one
 * with two warpgroups a block, with one, and the TMA-fed kl_attn_fa3), their
 * modules through the disk cache
 * (written, reused, a corrupt entry rebuilt), and a timing of B4 H16 T1024
 * D128 bf16.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>

#include <cmocka.h>

#include "capture/trace.h"
#include "core/core.h"
#include "graph/graph.h"
#include "graph/reference.h"
#include "kltest.h"
#include "lower/lower.h"
#include "runtime/runtime_int.h"
#ifdef KILN_HAVE_CUDA
#include "backend/cuda/device.h"
#include "core/half.h"
#endif

typedef struct acase {
	int nb;            /* batch dims */
	int64_t b0, b1;    /* their sizes */
	int64_t tq, tk, d, dv;
	bool causal;
} acase;

typedef struct sdpa_p {
	bool causal;
	double scale;
} sdpa_p;

static kl_tensor *apply_sdpa(kl_tensor *const *in, const void *param)
{
	const sdpa_p *p = param;
	return kl_sdpa(in[0], in[1], in[2], p->causal, p->scale);
}

static void shapes(const acase *c, int64_t (*sh)[KL_MAX_DIMS], int *nd)
{
	int64_t bs[2] = {c->b0, c->b1};
	*nd = c->nb + 2;
	for (int t = 0; t < 3; t++)
		for (int i = 0; i < c->nb; i++)
			sh[t][i] = bs[i];
	sh[0][c->nb] = c->tq;
	sh[0][c->nb + 1] = c->d;
	sh[1][c->nb] = c->tk;
	sh[1][c->nb + 1] = c->d;
	sh[2][c->nb] = c->tk;
	sh[2][c->nb + 1] = c->dv;
}

static const acase CASES[] = {
        {0, 0, 0, 5, 7, 16, 16, false},   {0, 0, 0, 7, 7, 16, 16, true},
        {1, 3, 0, 33, 70, 64, 64, false}, {1, 2, 0, 45, 100, 64, 48, true},
        {2, 2, 3, 1, 77, 128, 128, false}, {2, 2, 2, 70, 70, 128, 128, true},
        {2, 1, 2, 17, 130, 16, 16, true}, {1, 2, 0, 1, 9, 64, 64, true},
        /* the CPU kernel's query (64) and key (128) blocks crossed, head dims
         * that are no whole vector, Tq > Tk causal (early rows see no key) */
        {1, 1, 0, 130, 257, 24, 20, false}, {1, 2, 0, 130, 257, 40, 72, true},
        {0, 0, 0, 65, 65, 1, 3, true},     {1, 2, 0, 70, 40, 16, 16, true},
};

/* the CUDA kernels the GPU tests force in turn: KILN_ATTENTION_KERNEL, and
 * KILN_CUDA_ATTN_WG (1: wgmma with one warpgroup per block; 2: kl_attn_fa3,
 * TMA loads by a producer warpgroup, the consumers taking turns) */
typedef struct akind {
	const char *name, *kernel, *wg;
} akind;

static const akind KINDS[5] = {
        {"wgmma", "wgmma", "0"},
        {"wgmma-1wg", "wgmma", "1"},
        {"wgmma-fa3", "wgmma", "2"},
        {"mma", "mma", "0"},
        {"simple", "simple", "0"},
};

static void force_kind(const akind *k)
{
	setenv("KILN_ATTENTION_KERNEL", k->kernel, 1);
	setenv("KILN_CUDA_ATTN_WG", k->wg, 1);
}

static void unforce_kind(void)
{
	unsetenv("KILN_ATTENTION_KERNEL");
	unsetenv("KILN_CUDA_ATTN_WG");
}

static double factor_of(kl_dtype dt)
{
	/* f32 1e-4, f64 1e-10, bf16 1e-2, f16 1e-2 relative to kltest_tol */
	switch (dt) {
	case KL_F32: return 10;
	case KL_F64: return 100;
	case KL_F16: return 5;
	default: return 1;
	}
}

/* kl_sdpa of case c (dtype dt, K laid out as klay, inputs seeded seed,
 * seed + 1, seed + 2) on ctx's device against the reference */
static bool check_case(kl_ctx *ctx, const char *what, const acase *c, kl_dtype dt,
                       kltest_layout klay, uint64_t seed, double factor)
{
	int64_t sh[3][KL_MAX_DIMS];
	int nd;
	shapes(c, sh, &nd);
	kl_tensor *in[3];
	for (int t = 0; t < 3; t++)
		in[t] = kltest_rand(ctx, dt, nd, sh[t], KLTEST_NORMAL, t == 1 ? klay : KLTEST_CONTIG,
		                    seed + (uint64_t)t);
	sdpa_p p = {c->causal, 1.0 / sqrt((double)c->d)};
	bool ok = kltest_check_op(ctx, what, apply_sdpa, 3, in, &p, factor);
	for (int t = 0; t < 3; t++)
		kl_release(in[t]);
	return ok;
}

/* kl_sdpa eagerly on ctx's device against the reference */
static int run_eager_cases(kl_ctx *ctx, const kl_dtype *dts, int ndt, kltest_layout lay)
{
	int bad = 0;
	for (size_t ci = 0; ci < sizeof CASES / sizeof CASES[0]; ci++)
		for (int di = 0; di < ndt; di++) {
			char what[96];
			snprintf(what, sizeof what, "sdpa case %zu %s", ci, kl_dtype_name(dts[di]));
			if (!check_case(ctx, what, &CASES[ci], dts[di], lay, 1000 + ci * 10,
			                factor_of(dts[di])))
				bad++;
		}
	return bad;
}

static void test_sdpa_eager_cpu(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	const kl_dtype dts[4] = {KL_F32, KL_F64, KL_BF16, KL_F16};
	assert_int_equal(run_eager_cases(ctx, dts, 4, KLTEST_CONTIG), 0);
	assert_int_equal(run_eager_cases(ctx, dts, 1, KLTEST_STRIDED), 0);
	/* the CPU kernel's narrower builds (AVX2+FMA, baseline) */
	const char *isa[2] = {"avx2", "base"};
	for (int i = 0; i < 2; i++) {
		setenv("KILN_ATTENTION_KERNEL", isa[i], 1);
		assert_int_equal(run_eager_cases(ctx, dts, 1, KLTEST_CONTIG), 0);
		assert_int_equal(run_eager_cases(ctx, dts + 2, 1, KLTEST_STRIDED), 0);
		unsetenv("KILN_ATTENTION_KERNEL");
	}
	kl_ctx_free(ctx);
}

static void test_sdpa_errors(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	kl_tensor *q = kl_zeros(ctx, KL_F32, 3, (int64_t[]){2, 4, 8});
	kl_tensor *k = kl_zeros(ctx, KL_F32, 3, (int64_t[]){2, 5, 8});
	kl_tensor *v = kl_zeros(ctx, KL_F32, 3, (int64_t[]){2, 6, 8});
	kl_tensor *kb = kl_zeros(ctx, KL_F32, 3, (int64_t[]){3, 5, 8});
	kl_tensor *ki = kl_zeros(ctx, KL_I32, 3, (int64_t[]){2, 5, 8});
	bool ok = true;
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_sdpa(q, k, v, false, 1), "kl_sdpa", "[2,4,8]", "[2,5,8]",
	                          "[2,6,8]", "key count 5");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_sdpa(q, kb, kb, false, 1), "kl_sdpa", "batch dims");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_sdpa(ki, ki, ki, false, 1), "kl_sdpa", "floating");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_sdpa(q, k, k, false, NAN), "kl_sdpa", "finite");
	ok &= KLTEST_EXPECT_ERROR(ctx, kl_sdpa(q, NULL, k, false, 1), "kl_sdpa", "NULL");
	assert_true(ok);
	kl_tensor *r = kl_sdpa(q, k, k, true, 0.5);
	assert_non_null(r);
	kl_release(r);
	kl_tensor *all[5] = {q, k, v, kb, ki};
	for (int i = 0; i < 5; i++)
		kl_release(all[i]);
	kl_ctx_free(ctx);
}

/* softmax(q k^T / sqrt(D)) v written out by hand: an oracle for the default
 * scale that does not go through kl_sdpa's own choice of it */
static kl_tensor *apply_attention_by_hand(kl_tensor *const *in, const void *param)
{
	(void)param;
	double d = (double)kl_dim(in[0], -1);
	kl_tensor *s = kl_mul_scalar(kl_matmul(in[0], kl_transpose(in[1], -2, -1)), 1 / sqrt(d));
	return kl_matmul(kl_softmax(s, -1), in[2]);
}

static kl_status body_sdpa_default(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out,
                                   int nout, void *user)
{
	(void)nin;
	(void)nout;
	(void)user;
	out[0] = kl_sdpa(in[0], in[1], in[2], false, KL_SDPA_DEFAULT_SCALE);
	return out[0] ? KL_OK : kl_last_status(ctx);
}

/* KL_SDPA_DEFAULT_SCALE is torch's scale=None: 1/sqrt(head_dim), eagerly and
 * compiled, for head dims 8 and 64 (a scale of 0 used as given would make
 * every row the plain mean of v) */
static void test_sdpa_default_scale(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	assert_non_null(ctx);
	const int64_t dims[2] = {8, 64};
	for (int c = 0; c < 2; c++) {
		int64_t sq[4] = {2, 3, 5, dims[c]}, sk[4] = {2, 3, 7, dims[c]}, sv[4] = {2, 3, 7, 6};
		kl_tensor *in[3] = {kltest_rand(ctx, KL_F32, 4, sq, KLTEST_NORMAL, KLTEST_CONTIG, 10 + c),
		                    kltest_rand(ctx, KL_F32, 4, sk, KLTEST_NORMAL, KLTEST_CONTIG, 20 + c),
		                    kltest_rand(ctx, KL_F32, 4, sv, KLTEST_NORMAL, KLTEST_CONTIG, 30 + c)};
		int nd = 0;
		int64_t shape[KL_MAX_DIMS];
		kl_dtype dt;
		double *ref = kltest_reference(ctx, "attention by hand", apply_attention_by_hand, in,
		                               NULL, &nd, shape, &dt);
		assert_non_null(ref);
		kl_tensor *eager = kl_sdpa(in[0], in[1], in[2], false, KL_SDPA_DEFAULT_SCALE);
		assert_non_null(eager);
		double *got = kltest_read(eager);
		assert_true(kltest_compare("kl_sdpa default scale, eager", dt, nd, shape, got, ref, 4));
		free(got);
		kl_fn *f = kl_compile(ctx, body_sdpa_default, NULL, 3, 1, NULL);
		kl_tensor *out = NULL;
		assert_int_equal(kl_fn_call(f, in, &out), KL_OK);
		got = kltest_read(out);
		assert_true(kltest_compare("kl_sdpa default scale, compiled", dt, nd, shape, got, ref,
		                           4));
		free(got);
		kl_release(out);
		kl_fn_free(f);
		kl_release(eager);
		free(ref);
		for (int i = 0; i < 3; i++)
			kl_release(in[i]);
	}
	kl_ctx_free(ctx);
}

/* ---- compiled ------------------------------------------------------------------ */

typedef int (*build_fn)(kl_ctx *ctx, kl_tensor *const *in, kl_tensor **out, const void *p);

static kl_trace *trace(kl_ctx *ctx, build_fn f, kl_tensor *const *in, const void *p)
{
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *outs[4] = {NULL};
	int nout = f(ctx, in, outs, p);
	kl_trace *tr = kl__trace_end(ctx, nout, outs);
	kl_scope_end(ctx);
	assert_non_null(tr);
	return tr;
}

static int b_sdpa(kl_ctx *ctx, kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)ctx;
	out[0] = apply_sdpa(in, p);
	return 1;
}

static int count_kind(const kl_program *P, kl_step_kind k)
{
	int n = 0;
	for (int32_t s = 0; s < P->nsteps; s++)
		n += P->steps[s].kind == k;
	return n;
}

/* compile tr's graph (or the given program), run it on the trace's inputs
 * and compare every output with the reference of the traced graph */
static void run_compiled(kl_ctx *ctx, kl_trace *tr, const kl_program *given, double factor,
                         kl_compiled **keep)
{
	kl_compile_cfg cfg = {.mode = KL_MODE_DEFAULT, .fusion = true, .name = "attn",
	                      .given = given};
	kl_compiled *c = kl__compile(ctx, &tr->g, &cfg);
	if (!c)
		fail_msg("kl__compile: %s", kl_last_error(ctx));
	const kl_graph *g = &tr->g;
	kl_tensor *out[4] = {NULL};
	assert_int_equal(kl__compiled_run(ctx, c, tr->in_tensors, out), KL_OK);
	double *iv[8];
	double *ov[4] = {NULL};
	for (int i = 0; i < g->ninputs; i++)
		assert_non_null(iv[i] = kltest_read(tr->in_tensors[i]));
	char err[256];
	assert_int_equal(kl__ref_eval(g, (const double *const *)iv, ov, err, sizeof err), KL_OK);
	for (int j = 0; j < g->noutputs; j++) {
		const kl_node *n = &g->nodes[g->outputs[j]];
		double *got = kltest_read(out[j]);
		assert_non_null(got);
		assert_true(kltest_compare("compiled attention", (kl_dtype)n->dtype, n->ndim,
		                           n->shape, got, ov[j], factor));
		free(got);
		free(ov[j]);
		kl_release(out[j]);
	}
	for (int i = 0; i < g->ninputs; i++)
		free(iv[i]);
	if (keep)
		*keep = c;
	else
		kl__compiled_free(c);
}

static void test_sdpa_compiled_cpu(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	const kl_dtype dts[3] = {KL_F32, KL_F64, KL_BF16};
	for (size_t ci = 0; ci < sizeof CASES / sizeof CASES[0]; ci++)
		for (int di = 0; di < 3; di++) {
			const acase *c = &CASES[ci];
			int64_t sh[3][KL_MAX_DIMS];
			int nd;
			shapes(c, sh, &nd);
			kl_tensor *in[3];
			for (int t = 0; t < 3; t++)
				in[t] = kltest_rand(ctx, dts[di], nd, sh[t], KLTEST_NORMAL,
				                    t == 2 ? KLTEST_PERMUTED : KLTEST_CONTIG,
				                    2000 + ci * 10 + t);
			sdpa_p p = {c->causal, 0.3};
			kl_trace *tr = trace(ctx, b_sdpa, in, &p);
			kl_compiled *cc = NULL;
			run_compiled(ctx, tr, NULL, factor_of(dts[di]), &cc);
			assert_int_equal(count_kind(&cc->prog, KL_STEP_ATTENTION), 1);
			kl__compiled_free(cc);
			/* the decomposition a target without the step gets (bf16 left out:
			 * it rounds the scores to bf16, a few % off the exact result) */
			if (dts[di] == KL_BF16) {
				kl__trace_free(tr);
				for (int t = 0; t < 3; t++)
					kl_release(in[t]);
				continue;
			}
			kl_lower_opts o = {.target = KL_TARGET_C, .fusion = true, .no_attention = true};
			kl_program P;
			char err[256];
			assert_int_equal(kl__lower(&tr->g, &o, &P, err, sizeof err), KL_OK);
			assert_int_equal(count_kind(&P, KL_STEP_ATTENTION), 0);
			run_compiled(ctx, tr, &P, 4 * factor_of(dts[di]), NULL);
			kl__program_free(&P);
			kl__trace_free(tr);
			for (int t = 0; t < 3; t++)
				kl_release(in[t]);
		}
	kl_ctx_free(ctx);
}

/* ---- lengths (kl_sdpa_lengths) ------------------------------------------------------ */

typedef struct lcase {
	acase c;            /* b0 = R, the lengths' count (1 to 4) */
	int64_t len[4];
	kl_dtype ldt;
} lcase;

/* a length 0 (no key: 0), Tk, partial ones; causal rows before the length
 * that see no key (len < Tq); a size-1 first dim and a size-1 inner one;
 * the key blocks of the CPU kernels (128) and the query blocks (64) crossed */
static const lcase LCASES[] = {
        {{2, 4, 2, 1, 150, 16, 16, false}, {0, 150, 77, 1}, KL_I32},
        {{2, 4, 2, 70, 150, 16, 8, true}, {0, 150, 70, 20}, KL_I64},
        {{1, 4, 0, 5, 9, 8, 8, true}, {9, 3, 0, 5}, KL_I64},
        {{2, 4, 1, 3, 40, 8, 8, false}, {40, 0, 13, 39}, KL_I32},
        {{2, 1, 3, 2, 30, 8, 8, true}, {17}, KL_I32},
};

typedef struct len_p {
	bool causal;
	double scale;
} len_p;

static kl_tensor *apply_sdpa_len(kl_tensor *const *in, const void *param)
{
	const len_p *p = param;
	return kl_sdpa_lengths(in[0], in[1], in[2], in[3], p->causal, p->scale);
}

static int b_sdpa_len(kl_ctx *ctx, kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)ctx;
	out[0] = apply_sdpa_len(in, p);
	return 1;
}

/* q, k, v and lengths of case lc on ctx's device: k and v NaN past each
 * row's length (the fused kernels must not read them, the decomposition
 * zeroes them) */
static void len_inputs(kl_ctx *ctx, const lcase *lc, kl_dtype dt, uint64_t seed, kl_tensor **in)
{
	int64_t sh[3][KL_MAX_DIMS];
	int nd;
	shapes(&lc->c, sh, &nd);
	for (int t = 0; t < 3; t++) {
		kl_tensor *r = kltest_rand(ctx, KL_F64, nd, sh[t], KLTEST_NORMAL, KLTEST_CONTIG,
		                           seed + (uint64_t)t);
		double *v = kltest_read(r);
		assert_non_null(v);
		kl_release(r);
		int64_t tk = lc->c.tk, w = sh[t][nd - 1], per = 1;
		for (int d = 1; d < nd - 2; d++)
			per *= sh[t][d];
		for (int64_t b = 0; t > 0 && b < lc->c.b0 * per; b++)
			for (int64_t j = lc->len[b / per] > 0 ? lc->len[b / per] : 0; j < tk; j++)
				for (int64_t c = 0; c < w; c++)
					v[(b * tk + j) * w + c] = NAN;
		in[t] = kltest_from_values(ctx, dt, nd, sh[t], v, KLTEST_CONTIG);
		assert_non_null(in[t]);
		free(v);
	}
	double lv[4];
	for (int i = 0; i < lc->c.b0; i++)
		lv[i] = (double)lc->len[i];
	in[3] = kltest_from_values(ctx, lc->ldt, 1, &lc->c.b0, lv, KLTEST_CONTIG);
	assert_non_null(in[3]);
}

/* kl_sdpa_lengths eagerly, compiled as one attention step, and (CPU)
 * decomposed for a target without the step: each against the float64
 * reference; the number of cases that failed */
static int run_length_cases(kl_ctx *ctx, const kl_dtype *dts, int ndt, bool decomposed)
{
	int bad = 0;
	for (size_t ci = 0; ci < sizeof LCASES / sizeof LCASES[0]; ci++)
		for (int di = 0; di < ndt; di++) {
			const lcase *lc = &LCASES[ci];
			kl_tensor *in[4];
			len_inputs(ctx, lc, dts[di], 3000 + ci * 10, in);
			len_p p = {lc->c.causal, 0.4};
			char what[96];
			snprintf(what, sizeof what, "sdpa_lengths case %zu %s", ci,
			         kl_dtype_name(dts[di]));
			if (!kltest_check_op(ctx, what, apply_sdpa_len, 4, in, &p, factor_of(dts[di])))
				bad++;
			kl_trace *tr = trace(ctx, b_sdpa_len, in, &p);
			kl_compiled *cc = NULL;
			run_compiled(ctx, tr, NULL, factor_of(dts[di]), &cc);
			assert_int_equal(count_kind(&cc->prog, KL_STEP_ATTENTION), 1);
			kl__compiled_free(cc);
			if (decomposed) {
				kl_lower_opts o = {.target = KL_TARGET_C, .fusion = true,
				                   .no_attention = true};
				kl_program P;
				char err[256];
				assert_int_equal(kl__lower(&tr->g, &o, &P, err, sizeof err), KL_OK);
				assert_int_equal(count_kind(&P, KL_STEP_ATTENTION), 0);
				run_compiled(ctx, tr, &P, 4 * factor_of(dts[di]), NULL);
				kl__program_free(&P);
			}
			kl__trace_free(tr);
			for (int t = 0; t < 4; t++)
				kl_release(in[t]);
		}
	return bad;
}

static kl_status sdpa_len_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out,
                               int nout, void *user)
{
	(void)nin, (void)nout;
	out[0] = apply_sdpa_len(in, user);
	return out[0] ? KL_OK : kl_last_status(c);
}

/* the batch dim dynamic (q, k, v, lengths): one variant for every batch
 * size, the attention step binding its sizes per call, kl_explain naming
 * the step with lengths; results as eager */
static void sdpa_lengths_dynamic(kl_ctx *ctx)
{
	len_p p = {true, 0.4};
	const uint32_t b0 = KL_DIM(0);
	kl_fn *f = kl_compile(ctx, sdpa_len_body, &p, 4, 1,
	                      &(kl_compile_opts){.ndynamic_dims = 4,
	                                         .dynamic_dims = (uint32_t[]){b0, b0, b0, b0}});
	assert_non_null(f);
	for (int64_t r = 4; r >= 1; r--) {
		lcase lc = {{2, r, 2, 3, 20, 8, 8, true}, {20, 0, 7, 2}, KL_I32};
		if (r < 4)
			lc.len[0] = 11 + r;
		kl_tensor *in[4];
		len_inputs(ctx, &lc, KL_F32, 5000 + (uint64_t)r, in);
		kl_tensor *e = apply_sdpa_len(in, &p), *o = NULL;
		assert_non_null(e);
		assert_int_equal(kl_fn_call(f, in, &o), KL_OK);
		double *ev = kltest_read(e), *ov = kltest_read(o);
		char what[64];
		snprintf(what, sizeof what, "dynamic batch %lld", (long long)r);
		assert_true(kltest_compare(what, KL_F32, 4, kl_shape(e), ov, ev, 10));
		free(ev);
		free(ov);
		kl_release(e);
		kl_release(o);
		for (int t = 0; t < 4; t++)
			kl_release(in[t]);
	}
	kl_fn_stats fs;
	assert_int_equal(kl_fn_get_stats(f, &fs), KL_OK);
	assert_int_equal(fs.compiles, 1);
	char *buf = NULL;
	size_t len = 0;
	FILE *mf = open_memstream(&buf, &len);
	assert_non_null(mf);
	assert_int_equal(kl_explain(f, mf), KL_OK);
	fclose(mf);
	if (!strstr(buf, "causal lengths"))
		fail_msg("kl_explain does not show the attention step with lengths:\n%s", buf);
	free(buf);
	kl_fn_free(f);
}

static void test_sdpa_lengths_cpu(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	const kl_dtype dts[2] = {KL_F32, KL_F64};
	assert_int_equal(run_length_cases(ctx, dts, 2, true), 0);
	sdpa_lengths_dynamic(ctx);
	kl_ctx_free(ctx);
}

/* ---- attention written by hand ----------------------------------------------------- */

enum { M_NONE, M_WHERE, M_ADD, M_WHERE_RETURN_SCORES, M_NOT_CAUSAL, M_WHERE_INPUT };

typedef struct hand_p {
	int mask;
	int64_t B, T, H, Dh;
} hand_p;

/* MultiheadAttention's shape: x [B, T, 3*H*Dh] -> q, k, v [B, H, T, Dh] as
 * reshape + permute views, then the sequence kl_nn writes. in[1] (optional)
 * is a mask given as an input. */
static int b_hand(kl_ctx *ctx, kl_tensor *const *in, kl_tensor **out, const void *pp)
{
	const hand_p *p = pp;
	kl_tensor *x5 = kl_reshape(in[0], 5, (int64_t[]){p->B, p->T, 3, p->H, p->Dh});
	kl_tensor *qkv = kl_permute(x5, (int[]){2, 0, 3, 1, 4}); /* [3, B, H, T, Dh] */
	kl_tensor *part[3];
	for (int i = 0; i < 3; i++)
		part[i] = kl_reshape(kl_slice(qkv, 0, i, i + 1, 1), 4,
		                     (int64_t[]){p->B, p->H, p->T, p->Dh});
	kl_tensor *s = kl_matmul(part[0], kl_transpose(part[1], -2, -1));
	s = kl_mul_scalar(s, 1.0 / sqrt((double)p->Dh));
	kl_tensor *scores = s;
	int64_t T = p->T;
	kl_tensor *i = kl_reshape(kl_arange(ctx, KL_I64, 0, (double)T, 1), 2, (int64_t[]){T, 1});
	kl_tensor *j = kl_reshape(kl_arange(ctx, KL_I64, 0, (double)T, 1), 2, (int64_t[]){1, T});
	switch (p->mask) {
	case M_WHERE:
	case M_WHERE_RETURN_SCORES:
		s = kl_where(kl_ge(i, j), s, kl_full(ctx, KL_F32, 0, NULL, -INFINITY));
		break;
	case M_NOT_CAUSAL:
		s = kl_where(kl_le(i, j), s, kl_full(ctx, KL_F32, 0, NULL, -INFINITY));
		break;
	case M_ADD: {
		kl_tensor *bias = kl_where(kl_ge(i, j), kl_full(ctx, KL_F32, 2, (int64_t[]){T, T}, 0),
		                           kl_full(ctx, KL_F32, 0, NULL, -INFINITY));
		s = kl_add(bias, s);
		break;
	}
	case M_WHERE_INPUT:
		s = kl_where(in[1], s, kl_full(ctx, KL_F32, 0, NULL, -INFINITY));
		break;
	default:
		break;
	}
	out[0] = kl_matmul(kl_softmax(s, -1), part[2]);
	if (p->mask == M_WHERE_RETURN_SCORES) {
		out[1] = scores;
		return 2;
	}
	return 1;
}

static void test_pattern_fused(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	const int masks[3] = {M_NONE, M_WHERE, M_ADD};
	for (int mi = 0; mi < 3; mi++) {
		hand_p p = {masks[mi], 2, 37, 3, 16};
		kl_tensor *x = kltest_rand(ctx, KL_F32, 3, (int64_t[]){p.B, p.T, 3 * p.H * p.Dh},
		                           KLTEST_NORMAL, KLTEST_CONTIG, 77 + mi);
		kl_trace *tr = trace(ctx, b_hand, &x, &p);
		kl_lower_opts o = {.target = KL_TARGET_C, .fusion = true};
		kl_program P;
		char err[256];
		assert_int_equal(kl__lower(&tr->g, &o, &P, err, sizeof err), KL_OK);
		if (P.nsteps != 1 || P.steps[0].kind != KL_STEP_ATTENTION || P.nkernels != 0)
			fail_msg("mask %d: %d steps, %d kernels; log:\n%s", mi, (int)P.nsteps,
			         (int)P.nkernels, P.fusion_log ? P.fusion_log : "");
		assert_int_equal(P.steps[0].at.causal, mi != 0);
		assert_true(fabs(P.steps[0].at.scale - 0.25) < 1e-15);
		assert_non_null(P.fusion_log);
		assert_non_null(strstr(P.fusion_log, "attention: fused"));
		assert_true(P.steps[0].nnodes >= 5);
		kl__program_free(&P);
		kl_compiled *c = NULL;
		run_compiled(ctx, tr, NULL, 10, &c);
		assert_int_equal(c->prog.nsteps, 1);
		kl__compiled_free(c);
		kl__trace_free(tr);
		kl_release(x);
	}
	kl_ctx_free(ctx);
}

static void test_pattern_refused(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	struct {
		int mask;
		const char *why;
	} cases[] = {{M_WHERE_RETURN_SCORES, "another user or is a graph output"},
	             {M_NOT_CAUSAL, "neither causal"},
	             {M_WHERE_INPUT, "depends on graph inputs"}};
	for (int ci = 0; ci < 3; ci++) {
		hand_p p = {cases[ci].mask, 1, 20, 2, 16};
		kl_tensor *in[2] = {
		        kltest_rand(ctx, KL_F32, 3, (int64_t[]){p.B, p.T, 3 * p.H * p.Dh},
		                    KLTEST_NORMAL, KLTEST_CONTIG, 5),
		        kltest_rand(ctx, KL_BOOL, 2, (int64_t[]){p.T, p.T}, KLTEST_NORMAL,
		                    KLTEST_CONTIG, 6)};
		/* no row may be fully masked: the diagonal stays allowed */
		if (cases[ci].mask == M_WHERE_INPUT) {
			double *mv = kltest_read(in[1]);
			for (int64_t r = 0; r < p.T; r++)
				mv[r * p.T + r] = 1;
			kl_release(in[1]);
			in[1] = kltest_from_values(ctx, KL_BOOL, 2, (int64_t[]){p.T, p.T}, mv,
			                           KLTEST_CONTIG);
			free(mv);
		}
		kl_trace *tr = trace(ctx, b_hand, in, &p);
		kl_lower_opts o = {.target = KL_TARGET_C, .fusion = true};
		kl_program P;
		char err[256];
		assert_int_equal(kl__lower(&tr->g, &o, &P, err, sizeof err), KL_OK);
		assert_int_equal(count_kind(&P, KL_STEP_ATTENTION), 0);
		assert_non_null(P.fusion_log);
		if (!strstr(P.fusion_log, "attention: not fused") ||
		    !strstr(P.fusion_log, cases[ci].why))
			fail_msg("case %d: log lacks the reason '%s':\n%s", ci, cases[ci].why,
			         P.fusion_log);
		kl__program_free(&P);
		run_compiled(ctx, tr, NULL, 10, NULL);
		kl__trace_free(tr);
		kl_release(in[0]);
		kl_release(in[1]);
	}
	kl_ctx_free(ctx);
}

/* ---- the program format ------------------------------------------------------------ */

static void test_program_io(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	acase c = {2, 2, 3, 9, 12, 16, 8, true};
	int64_t sh[3][KL_MAX_DIMS];
	int nd;
	shapes(&c, sh, &nd);
	kl_tensor *in[3];
	for (int t = 0; t < 3; t++)
		in[t] = kltest_rand(ctx, KL_F32, nd, sh[t], KLTEST_NORMAL, KLTEST_CONTIG, 9 + t);
	sdpa_p p = {true, 0.5};
	kl_trace *tr = trace(ctx, b_sdpa, in, &p);
	kl_lower_opts o = {.target = KL_TARGET_C, .fusion = true};
	kl_program P, R;
	char err[256];
	assert_int_equal(kl__lower(&tr->g, &o, &P, err, sizeof err), KL_OK);
	uint8_t *bytes;
	size_t len;
	assert_int_equal(kl__program_serialize(&P, &bytes, &len), KL_OK);
	assert_int_equal(kl__program_deserialize(bytes, len, &R, err, sizeof err), KL_OK);
	assert_int_equal(R.nsteps, P.nsteps);
	int32_t s = 0;
	while (P.steps[s].kind != KL_STEP_ATTENTION)
		s++;
	assert_int_equal(R.steps[s].kind, KL_STEP_ATTENTION);
	assert_memory_equal(&R.steps[s].at, &P.steps[s].at, sizeof(kl_attn_step));
	kl__program_free(&R);
	/* a step reaching past its output, a bad buffer id, a non-finite scale */
	kl_attn_step keep = P.steps[s].at;
	P.steps[s].at.tq += 1;
	assert_int_equal(kl__program_validate(&P, -1, -1, err, sizeof err), KL_EFORMAT);
	assert_non_null(strstr(err, "attention operand"));
	P.steps[s].at = keep;
	P.steps[s].at.o = 99;
	assert_int_equal(kl__program_validate(&P, -1, -1, err, sizeof err), KL_EFORMAT);
	P.steps[s].at = keep;
	P.steps[s].at.scale = INFINITY;
	assert_int_equal(kl__program_validate(&P, -1, -1, err, sizeof err), KL_EFORMAT);
	P.steps[s].at = keep;
	assert_int_equal(kl__program_validate(&P, -1, -1, err, sizeof err), KL_OK);
	/* truncated bytes are refused */
	assert_int_equal(kl__program_deserialize(bytes, len - 5, &R, err, sizeof err), KL_EFORMAT);
	free(bytes);
	kl__program_free(&P);
	kl__trace_free(tr);
	for (int t = 0; t < 3; t++)
		kl_release(in[t]);
	kl_ctx_free(ctx);
}

/* ---- CUDA ------------------------------------------------------------------------ */

#ifdef KILN_HAVE_CUDA
static bool nvrtc_ok(void)
{
	kl_ctx *ctx = kl_ctx_new(NULL);
	bool ok = kl__cuda_load_nvrtc(ctx) == KL_OK;
	if (!ok)
		print_message("test_attention: NVRTC not loadable: %s\n", kl_last_error(ctx));
	kl_ctx_free(ctx);
	return ok;
}

/* ptxas's figures for kl_attn_fa3 in a --ptxas-options=-v log: no stack
 * frame, no spill, and no performance note (C75xx: wgmma serialized for
 * want of registers or around other instructions, setmaxnreg ignored);
 * returns the registers ptxas reports for the kernel */
static int fa3_ptxas_clean(const char *log, const char *what)
{
	const char *f = log ? strstr(log, "Function properties for kl_attn_fa3") : NULL;
	const char *nl = f ? strchr(f, '\n') : NULL;
	if (!nl)
		fail_msg("%s: no ptxas figures for kl_attn_fa3 in the log:\n%s", what,
		         log ? log : "(no log)");
	const char *p = nl + 1;
	while (*p && (*p < '0' || *p > '9') && *p != '\n')
		p++;
	int frame = -1, st = -1, ld = -1, regs = -1;
	if (sscanf(p, "%d bytes stack frame, %d bytes spill stores, %d bytes spill loads", &frame,
	           &st, &ld) != 3)
		fail_msg("%s: unreadable ptxas figures for kl_attn_fa3:\n%s", what, log);
	const char *u = strstr(p, "Used ");
	if (!u || sscanf(u, "Used %d registers", &regs) != 1)
		fail_msg("%s: no register count for kl_attn_fa3:\n%s", what, log);
	if (frame != 0 || st != 0 || ld != 0)
		fail_msg("%s: kl_attn_fa3 spills (%d-byte frame, %d bytes stored, %d loaded):\n%s",
		         what, frame, st, ld, log);
	if (strstr(log, "(C75"))
		fail_msg("%s: ptxas performance notes:\n%s", what, log);
	return regs;
}
#endif

/* every variant of the attention kernels compiles for sm_90 (the wgmma ones
 * for sm_90a), with no warning (no GPU needed) */
static void test_cuda_kernels_compile(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	if (!nvrtc_ok())
		skip();
	kl_ctx *ctx = kl_ctx_new(NULL);
	const kl_dtype dts[4] = {KL_F32, KL_F64, KL_F16, KL_BF16};
	const int hds[3] = {0, 64, 128};
	int n = 0;
	/* wg: 0 mma.sync only, 1 and wgmma (two warpgroups a block), 2 and
	 * wgmma with one warpgroup a block (KILN_CUDA_ATTN_WG=1), 3 and
	 * kl_attn_fa3 (KILN_CUDA_ATTN_WG=2) */
	for (int di = 0; di < 4; di++)
		for (int hi = 0; hi < 3; hi++)
			for (int wg = 0; wg < 4; wg++) {
				char *src = kl__cuda_attention_source(dts[di], hds[hi], wg);
				bool exists = hds[hi] == 0 ? !wg : dts[di] == KL_F16 || dts[di] == KL_BF16;
				if (!exists) {
					assert_null(src);
					continue;
				}
				assert_non_null(src);
				/* kl_attn_fa3 with ptxas's figures: its consumers must
				 * get the setmaxnreg budget, not spill */
				kl_nvrtc_opts o = {.arch = 90, .arch_specific = wg != 0,
				                   .ptxas_info = wg == 3};
				kl_cuda_image im;
				if (kl__nvrtc_compile(ctx, src, "kiln_attention.cu", &o, &im) != KL_OK)
					fail_msg("%s d%d wgmma %d: %s\n%s", kl_dtype_name(dts[di]), hds[hi],
					         wg, kl_last_error(ctx), im.log ? im.log : "");
				assert_memory_equal(im.data, "\177ELF", 4);
				if (im.log && strstr(im.log, "warning"))
					fail_msg("%s d%d wgmma %d: warnings:\n%s", kl_dtype_name(dts[di]),
					         hds[hi], wg, im.log);
				if (wg == 3) {
					char what[64];
					snprintf(what, sizeof what, "%s d%d kl_attn_fa3",
					         kl_dtype_name(dts[di]), hds[hi]);
					int regs = fa3_ptxas_clean(im.log, what);
					print_message("test_attention: %s: %d registers, no spill\n", what,
					              regs);
				}
				kl__cuda_image_free(&im);
				free(src);
				n++;
			}
	assert_null(kl__cuda_attention_source(KL_BF16, 128, 4));
	assert_null(kl__cuda_attention_source(KL_BF16, 128, -1));
	print_message("test_attention: %d attention kernel variants compiled for sm_90/sm_90a\n", n);
	kl_ctx_free(ctx);
#else
	print_message("test_attention: skipped, built without the CUDA backend\n");
	skip();
#endif
}

#ifdef KILN_HAVE_CUDA
static kl_ctx *gpu_ctx(void)
{
	kl_ctx_opts o = {.device = KL_CUDA};
	kl_ctx *ctx = kl_ctx_new(&o);
	if (!ctx)
		print_message("test_attention: GPU tests skipped: %s\n", kl_last_error(NULL));
	return ctx;
}
#endif

/* compiled on the GPU: the attention's output transposed to [b, t, h, d]
 * and made dense, which the attention step writes itself (row stride h * d,
 * not d), with each kernel forced; bf16 at head dims 128 and 64, causal and
 * not, and a query count that is not a multiple of a tile */
static int b_sdpa_bthd(kl_ctx *ctx, kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)ctx;
	out[0] = kl_contiguous(kl_transpose(apply_sdpa(in, p), 1, 2));
	return 1;
}

static void layout_cases(kl_ctx *ctx, int nkinds)
{
	static const acase lc[] = {{2, 2, 4, 256, 256, 128, 128, true},
	                           {2, 2, 3, 200, 200, 64, 64, false},
	                           {2, 1, 2, 1, 300, 128, 128, false}};
	for (int ki = 0; ki < nkinds; ki++) {
		if (nkinds > 1)
			force_kind(&KINDS[ki]);
		for (size_t ci = 0; ci < sizeof lc / sizeof lc[0]; ci++) {
			int64_t sh[3][KL_MAX_DIMS];
			int nd;
			shapes(&lc[ci], sh, &nd);
			kl_tensor *in[3];
			for (int t = 0; t < 3; t++)
				in[t] = kltest_rand(ctx, KL_BF16, nd, sh[t], KLTEST_NORMAL, KLTEST_CONTIG,
				                    5000 + ci * 10 + 100 * ki + t);
			sdpa_p p = {lc[ci].causal, 1.0 / sqrt((double)lc[ci].d)};
			kl_trace *tr = trace(ctx, b_sdpa_bthd, in, &p);
			kl_compiled *cc = NULL;
			run_compiled(ctx, tr, NULL, 3 * factor_of(KL_BF16), &cc);
			/* one attention step, no copy kernel (tq = 1: the transpose moves
			 * a unit dim, and the output is dense either way) */
			assert_int_equal(count_kind(&cc->prog, KL_STEP_ATTENTION), 1);
			assert_int_equal(count_kind(&cc->prog, KL_STEP_KERNEL), 0);
			kl__compiled_free(cc);
			kl__trace_free(tr);
			for (int t = 0; t < 3; t++)
				kl_release(in[t]);
		}
	}
	unforce_kind();
}

/* q, k and v as the heads of one packed [b, t, 3 h d] product, as the
 * MultiheadAttention module makes them: batch dims (b, h) whose strides
 * (t * 3 h d, d) do not merge into one, and a row stride of 3 h d. On the
 * GPU with kl_attn_fa3 forced, the step must run it (five-dim tensor maps),
 * not fall back. in[0] is the packed tensor; p->h its heads. */
typedef struct packed_p {
	sdpa_p sd;
	int64_t h, d;
} packed_p;

static kl_tensor *head_view(kl_tensor *qkv, int which, const packed_p *p)
{
	int64_t B = kl_shape(qkv)[0], T = kl_shape(qkv)[1], hd = p->h * p->d;
	kl_tensor *x = kl_slice(qkv, 2, which * hd, (which + 1) * hd, 1);
	return kl_permute(kl_reshape(x, 4, (int64_t[]){B, T, p->h, p->d}), (int[]){0, 2, 1, 3});
}

static int b_sdpa_packed(kl_ctx *ctx, kl_tensor *const *in, kl_tensor **out, const void *p)
{
	(void)ctx;
	const packed_p *pp = p;
	kl_tensor *qkv[3] = {head_view(in[0], 0, pp), head_view(in[0], 1, pp),
	                     head_view(in[0], 2, pp)};
	out[0] = apply_sdpa(qkv, &pp->sd);
	return 1;
}

static void packed_cases(kl_ctx *ctx, int nkinds)
{
	/* b, t, h, d, causal */
	static const struct {
		int64_t b, t, h, d;
		bool causal;
	} pc[] = {{2, 200, 3, 128, false}, {3, 130, 2, 64, true}, {2, 256, 4, 128, true}};
	for (int ki = 0; ki < nkinds; ki++) {
		if (nkinds > 1)
			force_kind(&KINDS[ki]);
		for (size_t ci = 0; ci < sizeof pc / sizeof pc[0]; ci++) {
			int64_t sh[3] = {pc[ci].b, pc[ci].t, 3 * pc[ci].h * pc[ci].d};
			kl_tensor *in[1] = {kltest_rand(ctx, KL_BF16, 3, sh, KLTEST_NORMAL, KLTEST_CONTIG,
			                                6000 + ci * 10 + 100 * ki)};
			packed_p p = {{pc[ci].causal, 1.0 / sqrt((double)pc[ci].d)}, pc[ci].h, pc[ci].d};
			kl_trace *tr = trace(ctx, b_sdpa_packed, in, &p);
			kl_compiled *cc = NULL;
#ifdef KILN_HAVE_CUDA
			long fa0 = 0, fb0 = 0, fa1 = 0, fb1 = 0, lr = 0;
			kl__cuda_attn_counts(&fa0, &fb0, &lr);
#endif
			run_compiled(ctx, tr, NULL, 3 * factor_of(KL_BF16), &cc);
			/* one attention step reading the views in place */
			assert_int_equal(count_kind(&cc->prog, KL_STEP_ATTENTION), 1);
			assert_int_equal(count_kind(&cc->prog, KL_STEP_KERNEL), 0);
#ifdef KILN_HAVE_CUDA
			kl__cuda_attn_counts(&fa1, &fb1, &lr);
			if (nkinds > 1 && !strcmp(KINDS[ki].name, "wgmma-fa3")) {
				const kl_cuda_dev *d = kl__cuda_dev_of(ctx);
				if (fb1 != fb0)
					fail_msg("packed case %zu: kl_attn_fa3 fell back %ld times", ci,
					         fb1 - fb0);
				if (d->cc_major == 9 && d->cc_minor == 0 && fa1 == fa0)
					fail_msg("packed case %zu: kl_attn_fa3 did not run on sm_90", ci);
			}
#endif
			kl__compiled_free(cc);
			kl__trace_free(tr);
			kl_release(in[0]);
		}
	}
	unforce_kind();
}

static void test_sdpa_layout_cpu(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	layout_cases(ctx, 1);
	packed_cases(ctx, 1);
	kl_ctx_free(ctx);
}

static void test_cuda_sdpa_layout(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	kl_ctx *ctx = gpu_ctx();
	if (!ctx)
		skip();
	layout_cases(ctx, (int)(sizeof KINDS / sizeof KINDS[0]));
	packed_cases(ctx, (int)(sizeof KINDS / sizeof KINDS[0]));
	kl_ctx_free(ctx);
#else
	print_message("test_attention: skipped, built without the CUDA backend\n");
	skip();
#endif
}

/* the CUDA kernels (wgmma on sm_90, mma.sync, general, split-key decode)
 * against the reference: bf16/f16 at head dims 64 and 128, causal and not,
 * query and key counts that are not multiples of any tile (Tq < Tk and
 * Tq > Tk), Tq = 1, more and fewer work items than a persistent grid has
 * blocks; each tensor-core kernel forced in turn (KINDS) */
static void test_cuda_sdpa(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	kl_ctx *ctx = gpu_ctx();
	if (!ctx)
		skip();
	static const acase gc[] = {
	        {2, 2, 4, 256, 256, 128, 128, false}, {2, 2, 4, 256, 256, 128, 128, true},
	        {2, 1, 3, 100, 173, 64, 64, false},   {2, 1, 3, 100, 173, 64, 64, true},
	        {2, 2, 2, 1, 1000, 128, 128, false},  {2, 2, 2, 1, 777, 64, 64, true},
	        {1, 3, 0, 70, 90, 80, 80, true},      {0, 0, 0, 65, 64, 128, 128, true},
	        {2, 1, 2, 300, 300, 128, 128, true},  {2, 2, 1, 129, 385, 128, 128, true},
	        {1, 2, 0, 640, 640, 64, 64, true},    {1, 1, 0, 1024, 1024, 128, 128, false},
	        {2, 1, 2, 190, 333, 128, 128, false}, {1, 2, 0, 333, 190, 128, 128, true},
	        {1, 3, 0, 201, 97, 64, 64, false},    {1, 2, 0, 97, 201, 64, 64, true},
	        /* for the persistent kl_attn_fa3 alone (FA3_CASES; one block an
	         * SM, 132 on an H200, walking the (batch, query block) items; the
	         * cases above have fewer items than SMs): 280 causal items of
	         * two tiles, Tq < Tk, the second query block 2 rows; 420 causal
	         * items, Tq > Tk, 116 blocks ending on one or two items with no
	         * key (rows 0-199 see none: NaN) after ones with; 288 non-causal
	         * items */
	        {2, 10, 14, 130, 140, 128, 128, true}, {2, 7, 20, 300, 100, 64, 64, true},
	        {2, 8, 18, 130, 70, 64, 64, false},
	};
	/* the last FA3_CASES run with kl_attn_fa3 forced only: the other
	 * kernels have no rounds of items, and the reference of these many
	 * batches takes seconds */
	enum { FA3_CASES = 3 };
	const size_t ngc = sizeof gc / sizeof gc[0];
	const kl_dtype dts[4] = {KL_BF16, KL_F16, KL_F32, KL_F64};
	/* KILN_SDPA_FEW=1 (gpu-check's compute-sanitizer stages, 10-100x
	 * slower): the first four cases and the first persistent one */
	const char *few_env = getenv("KILN_SDPA_FEW");
	bool few = few_env && !strcmp(few_env, "1");
	int bad = 0;
	for (int ki = 0; ki < (int)(sizeof KINDS / sizeof KINDS[0]); ki++) {
		force_kind(&KINDS[ki]);
		bool fa3 = !strcmp(KINDS[ki].name, "wgmma-fa3");
		for (size_t ci = 0; ci < ngc; ci++)
			for (int di = 0; di < 4; di++) {
				const acase *c = &gc[ci];
				/* f32/f64 take the general kernel whatever is forced */
				if ((ki > 0 && di >= 2) || (ci >= ngc - FA3_CASES && (!fa3 || di >= 2)))
					continue;
				if (few && ci >= 4 && ci != ngc - FA3_CASES)
					continue;
				char what[96];
				snprintf(what, sizeof what, "cuda sdpa (%s) case %zu %s", KINDS[ki].name,
				         ci, kl_dtype_name(dts[di]));
				/* the tensor-core kernels round the probabilities to the
				 * input format for the second product (as every flash
				 * kernel does): a row that sees few keys keeps that
				 * rounding, up to a few bf16 units of its output */
				double f = factor_of(dts[di]) *
				           (dts[di] == KL_BF16 || dts[di] == KL_F16 ? 3 : 1);
				if (!check_case(ctx, what, c, dts[di], KLTEST_CONTIG,
				                3000 + ci * 10 + 1000 * ki, f))
					bad++;
			}
	}
	unforce_kind();
	assert_int_equal(bad, 0);
	kl_ctx_free(ctx);
#else
	print_message("test_attention: skipped, built without the CUDA backend\n");
	skip();
#endif
}

#ifdef KILN_HAVE_CUDA
/* the mod-*.klm entries in dir; with corrupt, each is overwritten with junk
 * of its own length */
static int module_entries(const char *dir, bool corrupt)
{
	DIR *dp = opendir(dir);
	assert_non_null(dp);
	int n = 0;
	struct dirent *e;
	while ((e = readdir(dp))) {
		if (strncmp(e->d_name, "mod-", 4) || !strstr(e->d_name, ".klm"))
			continue;
		n++;
		if (!corrupt)
			continue;
		char path[512];
		snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
		FILE *f = fopen(path, "r+b");
		assert_non_null(f);
		fseek(f, 0, SEEK_END);
		long len = ftell(f);
		rewind(f);
		for (long i = 0; i < len; i++)
			fputc((int)((i * 131) & 0xff), f);
		fclose(f);
	}
	closedir(dp);
	return n;
}
#endif

/* kl_sdpa_lengths on the GPU (kl_attn_rows and the split-key combine read
 * the lengths from device memory): eager and compiled against the
 * reference, every float dtype, NaN keys and values past the lengths */
static void test_cuda_sdpa_lengths(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	kl_ctx *ctx = gpu_ctx();
	if (!ctx)
		skip();
	const kl_dtype dts[4] = {KL_BF16, KL_F16, KL_F32, KL_F64};
	assert_int_equal(run_length_cases(ctx, dts, 4, false), 0);
	sdpa_lengths_dynamic(ctx);
	kl_ctx_free(ctx);
#else
	skip();
#endif
}

/* the decode kernels (kl_attn_dec with 16-byte loads, kl_attn_dec1 at an
 * unaligned K and V, with KILN_CUDA_ATTN_DEC=1; kl_attn_rows' splits unset; forced
 * split counts) called as a plan step on a [B, T, H, D] cache, one query
 * row (or three, causal) per (b, h): lengths T, past T (clamped), 1000 or
 * T - 1, 1 and 0 (0 gives 0), NaN in K and V past each length (never read)
 * and one NaN in V within b = 0 (its column NaN), the output poisoned with
 * NaN first; against a float64 reference, |out - ref| within the output's
 * rounding of |ref| plus 1e-4 (f64 1e-11) of sum p |v| / l */
#ifdef KILN_HAVE_CUDA
typedef struct dcase {
	int64_t tk, d, dv, tq;
	kl_dtype dt;
	int64_t off; /* K and V's element offset: 1 breaks the 16-byte alignment */
	bool causal;
} dcase;

static double dec_round(kl_dtype dt, double x)
{
	switch (dt) {
	case KL_BF16: return kl__bf16_to_f32(kl__f64_to_bf16(x));
	case KL_F16: return kl__f16_to_f32(kl__f64_to_f16(x));
	case KL_F32: return (float)x;
	default: return x;
	}
}

static void dec_store(kl_dtype dt, void *p, int64_t i, double x)
{
	switch (dt) {
	case KL_BF16: ((uint16_t *)p)[i] = kl__f64_to_bf16(x); break;
	case KL_F16: ((uint16_t *)p)[i] = kl__f64_to_f16(x); break;
	case KL_F32: ((float *)p)[i] = (float)x; break;
	default: ((double *)p)[i] = x;
	}
}

static double dec_load(kl_dtype dt, const void *p, int64_t i)
{
	switch (dt) {
	case KL_BF16: return kl__bf16_to_f32(((const uint16_t *)p)[i]);
	case KL_F16: return kl__f16_to_f32(((const uint16_t *)p)[i]);
	case KL_F32: return ((const float *)p)[i];
	default: return ((const double *)p)[i];
	}
}

/* one case under the current KILN_CUDA_ATTN_DEC; the elements that fail */
static int64_t decode_case(kl_ctx *ctx, const dcase *c, uint64_t seed)
{
	enum { B = 5, H = 3 };
	kl_cuda_dev *dev = kl__cuda_dev_of(ctx);
	int64_t tk = c->tk, d = c->d, dv = c->dv, tq = c->tq, off = c->off;
	int32_t lens[B] = {(int32_t)tk, (int32_t)(tk + 5000), (int32_t)(tk > 1000 ? 1000 : tk - 1), 1,
	                   0};
	size_t es = kl_dtype_size(c->dt);
	int64_t nq = B * tq * H * d, nk = B * tk * H * d + off, nv = B * tk * H * dv + off,
	        no = B * tq * H * dv;
	double *q = malloc(sizeof(double) * (size_t)nq), *k = malloc(sizeof(double) * (size_t)nk),
	       *v = malloc(sizeof(double) * (size_t)nv), *ref = malloc(sizeof(double) * (size_t)no),
	       *mag = malloc(sizeof(double) * (size_t)no);
	void *hq = malloc((size_t)nq * es), *hk = malloc((size_t)nk * es),
	     *hv = malloc((size_t)nv * es), *ho = malloc((size_t)no * es);
	assert_true(q && k && v && ref && mag && hq && hk && hv && ho);
	uint64_t rng = seed;
	for (int64_t x = 0; x < nq; x++)
		q[x] = dec_round(c->dt, kltest_uniform(&rng) * 4 - 2);
	for (int64_t x = 0; x < nk; x++)
		k[x] = dec_round(c->dt, kltest_uniform(&rng) * 2 - 1);
	for (int64_t x = 0; x < nv; x++)
		v[x] = dec_round(c->dt, kltest_uniform(&rng) * 2 - 1);
	/* NaN past each length (clamped) in K and V; one in V within b = 0 */
	for (int b = 0; b < B; b++)
		for (int64_t j = lens[b] < tk ? lens[b] : tk; j < tk; j++)
			for (int h = 0; h < H; h++) {
				for (int64_t x = 0; x < d; x++)
					k[off + ((b * tk + j) * H + h) * d + x] = NAN;
				for (int64_t x = 0; x < dv; x++)
					v[off + ((b * tk + j) * H + h) * dv + x] = NAN;
			}
	v[off + ((0 * tk + (tk > 3 ? 3 : 0)) * H + 1) * dv + dv - 1] = NAN;
	double scale = 1 / sqrt((double)d);
	double *sc = malloc(sizeof(double) * (size_t)(tk > 0 ? tk : 1));
	for (int b = 0; b < B; b++)
		for (int64_t i = 0; i < tq; i++)
			for (int h = 0; h < H; h++) {
				int64_t end = lens[b] < tk ? lens[b] : tk, kend = end;
				if (c->causal) {
					int64_t e = i + end - tq + 1;
					kend = e < 0 ? 0 : e < end ? e : end;
				}
				double mx = -INFINITY, l = 0;
				for (int64_t j = 0; j < kend; j++) {
					double t = 0;
					for (int64_t x = 0; x < d; x++)
						t += q[((b * tq + i) * H + h) * d + x] *
						     k[off + ((b * tk + j) * H + h) * d + x];
					sc[j] = t * scale;
					mx = sc[j] > mx ? sc[j] : mx;
				}
				for (int64_t j = 0; j < kend; j++)
					l += (sc[j] = exp(sc[j] - mx));
				for (int64_t x = 0; x < dv; x++) {
					double o = 0, m = 0;
					for (int64_t j = 0; j < kend; j++) {
						double vv = v[off + ((b * tk + j) * H + h) * dv + x];
						o += sc[j] * vv;
						m += sc[j] * fabs(vv);
					}
					int64_t at = ((b * tq + i) * H + h) * dv + x;
					ref[at] = kend > 0 ? o / l : 0;
					mag[at] = kend > 0 ? m / l : 0;
				}
			}
	for (int64_t x = 0; x < nq; x++)
		dec_store(c->dt, hq, x, q[x]);
	for (int64_t x = 0; x < nk; x++)
		dec_store(c->dt, hk, x, k[x]);
	for (int64_t x = 0; x < nv; x++)
		dec_store(c->dt, hv, x, v[x]);
	CUdeviceptr dq, dk, dvp, dO, dl;
	assert_int_equal(kl__cuda_malloc(ctx, dev, (size_t)nq * es, &dq), KL_OK);
	assert_int_equal(kl__cuda_malloc(ctx, dev, (size_t)nk * es, &dk), KL_OK);
	assert_int_equal(kl__cuda_malloc(ctx, dev, (size_t)nv * es, &dvp), KL_OK);
	assert_int_equal(kl__cuda_malloc(ctx, dev, (size_t)no * es, &dO), KL_OK);
	assert_int_equal(kl__cuda_malloc(ctx, dev, sizeof lens, &dl), KL_OK);
	assert_int_equal(kl__cuda_h2d(ctx, dev, dq, hq, (size_t)nq * es), KL_OK);
	assert_int_equal(kl__cuda_h2d(ctx, dev, dk, hk, (size_t)nk * es), KL_OK);
	assert_int_equal(kl__cuda_h2d(ctx, dev, dvp, hv, (size_t)nv * es), KL_OK);
	assert_int_equal(kl__cuda_h2d(ctx, dev, dl, lens, sizeof lens), KL_OK);
	assert_int_equal(kl__cuda_memset(ctx, dev, dO, 0xFF, (size_t)no * es), KL_OK); /* NaN */
	kl_attn_step s;
	memset(&s, 0, sizeof s);
	s.tq = tq;
	s.tk = tk;
	s.d = d;
	s.dv = dv;
	s.nbatch = 2;
	s.batch[0] = B;
	s.batch[1] = H;
	s.q_bs[0] = tq * H * d, s.q_bs[1] = d, s.q_rs = H * d, s.q_cs = 1;
	s.k_bs[0] = tk * H * d, s.k_bs[1] = d, s.k_rs = H * d, s.k_cs = 1, s.k_off = off;
	s.v_bs[0] = tk * H * dv, s.v_bs[1] = dv, s.v_rs = H * dv, s.v_cs = 1, s.v_off = off;
	s.o_bs[0] = tq * H * dv, s.o_bs[1] = dv, s.o_rs = H * dv;
	s.scale = scale;
	s.causal = c->causal;
	s.len = 0;
	s.len_inner = 1;
	s.len_dt = KL_I32;
	s.len_st = 1;
	s.fo = s.go = -1;
	assert_int_equal(kl__cuda_attention_step(ctx, dev, &s, c->dt, dq, dk, dvp, dl, dO, 0, NULL),
	                 KL_OK);
	assert_int_equal(kl__cuda_d2h(ctx, dev, ho, dO, (size_t)no * es), KL_OK);
	double rt = c->dt == KL_BF16 ? 1.0 / 256 : c->dt == KL_F16 ? 1.0 / 1024
	            : c->dt == KL_F32 ? 1e-6 : 1e-12;
	double ea = c->dt == KL_F64 ? 1e-11 : 1e-4;
	int64_t bad = 0;
	for (int64_t x = 0; x < no; x++) {
		double o = dec_load(c->dt, ho, x), r = ref[x];
		bool ok = isnan(r) ? isnan(o) : fabs(o - r) <= rt * fabs(r) + ea * mag[x];
		if (!ok && bad++ < 4)
			print_message("decode tk %lld d %lld/%lld tq %lld %s off %lld%s: [%lld] %.9g, "
			              "want %.9g (scale %.3g)\n",
			              (long long)tk, (long long)d, (long long)dv, (long long)tq,
			              kl_dtype_name(c->dt), (long long)off, c->causal ? " causal" : "",
			              (long long)x, o, r, mag[x]);
	}
	kl__cuda_free(ctx, dev, dq);
	kl__cuda_free(ctx, dev, dk);
	kl__cuda_free(ctx, dev, dvp);
	kl__cuda_free(ctx, dev, dO);
	kl__cuda_free(ctx, dev, dl);
	free(q), free(k), free(v), free(ref), free(mag), free(sc);
	free(hq), free(hk), free(hv), free(ho);
	return bad;
}
#endif

static void test_cuda_decode(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	kl_ctx *ctx = gpu_ctx();
	if (!ctx)
		skip();
	static const dcase dc[] = {
	        {1024, 128, 128, 1, KL_BF16, 0, false}, {1000, 128, 128, 1, KL_BF16, 0, true},
	        {1024, 64, 64, 1, KL_BF16, 0, false},   {1000, 80, 80, 1, KL_BF16, 0, false},
	        {1024, 128, 128, 1, KL_BF16, 1, false}, {1000, 80, 80, 1, KL_BF16, 1, true},
	        {1024, 128, 128, 1, KL_F32, 0, false},  {1000, 64, 64, 1, KL_F32, 0, false},
	        {1000, 80, 80, 1, KL_F32, 1, false},    {1024, 128, 128, 1, KL_F16, 0, false},
	        {1000, 128, 128, 1, KL_F64, 0, false},  {1000, 80, 80, 1, KL_F64, 1, false},
	        {1024, 256, 256, 1, KL_BF16, 0, false}, {1000, 256, 256, 1, KL_F64, 0, false},
	        {1000, 128, 64, 3, KL_BF16, 0, true},   {1000, 128, 128, 3, KL_F32, 1, true},
	        {37, 128, 128, 1, KL_BF16, 0, false},   {1, 128, 128, 1, KL_BF16, 0, false},
	        {5000, 128, 128, 1, KL_BF16, 0, false}, {1000, 24, 16, 1, KL_BF16, 0, false},
	};
	static const char *const modes[] = {NULL, "1", "7", "1000"};
	int64_t bad = 0;
	for (size_t mi = 0; mi < sizeof modes / sizeof modes[0]; mi++) {
		if (modes[mi])
			setenv("KILN_CUDA_ATTN_DEC", modes[mi], 1);
		else
			unsetenv("KILN_CUDA_ATTN_DEC");
		for (size_t ci = 0; ci < sizeof dc / sizeof dc[0]; ci++)
			bad += decode_case(ctx, &dc[ci], 7000 + ci * 2 + mi);
	}
	unsetenv("KILN_CUDA_ATTN_DEC");
	assert_int_equal(bad, 0);
	kl_ctx_free(ctx);
#else
	print_message("test_attention: skipped, built without the CUDA backend\n");
	skip();
#endif
}

/* the attention modules go through the disk cache: a second context (a warm
 * process) loads them instead of compiling; a corrupt entry is rebuilt and
 * the results stay right */
static void test_cuda_attention_cache(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	kl_ctx *probe = gpu_ctx();
	if (!probe)
		skip();
	kl_ctx_free(probe);
	char dir[] = "/tmp/kiln-attn-cache-XXXXXX";
	assert_non_null(mkdtemp(dir));
	const char *old = getenv("KILN_CACHE_DIR");
	char *saved = old ? strdup(old) : NULL;
	setenv("KILN_CACHE_DIR", dir, 1);
	const acase c = {1, 2, 0, 200, 200, 128, 128, true};
	for (int round = 0; round < 3; round++) {
		kl_ctx *ctx = gpu_ctx();
		assert_non_null(ctx);
		char what[64];
		snprintf(what, sizeof what, "cuda sdpa through the cache, round %d", round);
		assert_true(check_case(ctx, what, &c, KL_BF16, KLTEST_CONTIG, 500 + round * 3,
		                       3 * factor_of(KL_BF16)));
		kl_ctx_free(ctx);
		/* round 0 wrote the entry; round 1 read it, then it is spoiled
		 * and round 2 must rebuild it */
		assert_true(module_entries(dir, round == 1) >= 1);
	}
	if (saved) {
		setenv("KILN_CACHE_DIR", saved, 1);
		free(saved);
	} else {
		unsetenv("KILN_CACHE_DIR");
	}
	kl__rmtree_flat(dir);
#else
	print_message("test_attention: skipped, built without the CUDA backend\n");
	skip();
#endif
}

/* B4 H16 T1024 D128 bf16, causal and not, wgmma (two warpgroups a block,
 * one, and kl_attn_fa3) and mma.sync: prints TFLOP/s (causal FLOPs counted
 * as half) */
static void test_cuda_sdpa_bench(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	kl_ctx *ctx = gpu_ctx();
	if (!ctx)
		skip();
	kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	int64_t sh[4] = {4, 16, 1024, 128};
	kl_tensor *in[3];
	for (int t = 0; t < 3; t++)
		in[t] = kltest_rand(ctx, KL_BF16, 4, sh, KLTEST_NORMAL, KLTEST_CONTIG, 40 + t);
	for (int run = 0; run < 8; run++) {
		int causal = run & 1;
		const akind *k = &KINDS[run >> 1]; /* wgmma, wgmma-1wg, wgmma-fa3, mma */
		force_kind(k);
		sdpa_p p = {causal == 1, 1.0 / sqrt(128.0)};
		kl_tensor *r = apply_sdpa(in, &p);
		assert_non_null(r);
		kl_release(r);
		assert_int_equal(kl__cuda_sync(ctx, d), KL_OK);
		CUevent e0, e1;
		assert_int_equal(kl__cuda_event_new(ctx, d, &e0), KL_OK);
		assert_int_equal(kl__cuda_event_new(ctx, d, &e1), KL_OK);
		int reps = 50;
		assert_int_equal(kl__cuda_event_record(ctx, d, e0), KL_OK);
		for (int i = 0; i < reps; i++) {
			r = apply_sdpa(in, &p);
			assert_non_null(r);
			kl_release(r);
		}
		assert_int_equal(kl__cuda_event_record(ctx, d, e1), KL_OK);
		float ms = 0;
		assert_int_equal(kl__cuda_event_ms(ctx, e0, e1, &ms), KL_OK);
		double flops = 4.0 * 4 * 16 * 1024.0 * 1024.0 * 128 * (causal ? 0.5 : 1.0);
		print_message("test_attention: B4 H16 T1024 D128 bf16 %s (%s): %.3f ms, "
		              "%.1f TFLOP/s\n",
		              causal ? "causal" : "non-causal", k->name, ms / reps,
		              flops / (ms / reps * 1e-3) / 1e12);
		kl__cuda_event_free(d, e0);
		kl__cuda_event_free(d, e1);
	}
	unforce_kind();
	for (int t = 0; t < 3; t++)
		kl_release(in[t]);
	kl_ctx_free(ctx);
#else
	print_message("test_attention: skipped, built without the CUDA backend\n");
	skip();
#endif
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_sdpa_eager_cpu),     cmocka_unit_test(test_sdpa_errors),
	        cmocka_unit_test(test_sdpa_default_scale),
	        cmocka_unit_test(test_sdpa_compiled_cpu),  cmocka_unit_test(test_pattern_fused),
	        cmocka_unit_test(test_sdpa_lengths_cpu),   cmocka_unit_test(test_cuda_sdpa_lengths),
	        cmocka_unit_test(test_cuda_decode),
	        cmocka_unit_test(test_pattern_refused),    cmocka_unit_test(test_program_io),
	        cmocka_unit_test(test_cuda_kernels_compile), cmocka_unit_test(test_cuda_sdpa),
	        cmocka_unit_test(test_cuda_attention_cache), cmocka_unit_test(test_cuda_sdpa_bench),
	        cmocka_unit_test(test_sdpa_layout_cpu),    cmocka_unit_test(test_cuda_sdpa_layout),
	};
	if (getenv("KILN_TEST_FILTER")) /* one test by name (gpu-check's sanitizer stages) */
		cmocka_set_test_filter(getenv("KILN_TEST_FILTER"));
	return cmocka_run_group_tests(tests, NULL, NULL);
}
