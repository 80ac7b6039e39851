/* test_attention_bwd.c - the fused attention backward (sdpa_bwd, graph/ops.def):
 * the gradients of kl_sdpa through kl_backward, eagerly and compiled, against
 * the float64 reference of the traced graph (reference.c's sdpa_bwd), on odd
 * sizes (T not a multiple of the 64-row blocks, Tq != Tk), causal or not,
 * head dims 16, 32, 64 and 128, batch dims 0..2, every float dtype; the plan
 * holds one attention step in its backward mode and nothing of Tq x Tk; the
 * primitive expansion lowering gives a target without the step agrees with
 * the fused reference in f64; the step through the program serializer and
 * validator; a training step's attention whose q, k and v are head views of
 * one packed qkv product (either packing, causal or not): dx, dW and dbias
 * against the reference, the step writing d(qkv) where it lies (no gather
 * kernel in the plan; with KILN_TEST_DEVICE=cuda in f16/bf16 at head dims
 * 64 and 128), and its gradients' places through the serializer; the CUDA
 * kernels compiled by NVRTC for sm_90 (no GPU needed;
 * ptxas's register figures printed, no spill); on a GPU (skipped without
 * one) the same gradient checks on CUDA and a timing of B4 H16 T2048 D64 bf16.
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

#include "capture/trace.h"
#include "core/core.h"
#include "graph/graph.h"
#include "graph/reference.h"
#include "kltest.h"
#include "lower/lower.h"
#include "runtime/runtime_int.h"
#ifdef KILN_HAVE_CUDA
#include "backend/cuda/device.h"
#endif

typedef struct bcase {
	int nb;         /* batch dims */
	int64_t b0, b1; /* their sizes */
	int64_t tq, tk, d;
	bool causal;
} bcase;

static const bcase CASES[] = {
        {0, 0, 0, 5, 7, 16, false},    {0, 0, 0, 7, 7, 16, true},
        {1, 3, 0, 33, 70, 64, false},  {1, 2, 0, 45, 100, 64, true},
        {2, 2, 3, 1, 77, 128, false},  {2, 2, 2, 70, 70, 128, true},
        {1, 2, 0, 100, 45, 64, true},  {1, 2, 0, 130, 130, 16, true},
        {2, 1, 2, 65, 129, 64, false}, {1, 2, 0, 200, 300, 128, false},
        {1, 2, 0, 300, 300, 128, true},
};
#define NCASES ((int)(sizeof CASES / sizeof CASES[0]))

typedef struct sdpa_p {
	bool causal;
	double scale;
} sdpa_p;

static void shapes(const bcase *c, int64_t (*sh)[KL_MAX_DIMS], int *nd)
{
	int64_t bs[2] = {c->b0, c->b1};
	*nd = c->nb + 2;
	for (int t = 0; t < 4; t++) {
		for (int i = 0; i < c->nb; i++)
			sh[t][i] = bs[i];
		sh[t][c->nb] = t == 1 || t == 2 ? c->tk : c->tq;
		sh[t][c->nb + 1] = c->d;
	}
}

static double factor_of(kl_dtype dt, bool cuda)
{
	switch (dt) {
	case KL_F32: return 20;
	case KL_F64: return 1000;
	case KL_F16: return cuda ? 8 : 5;
	default: return cuda ? 4 : 2;
	}
}

/* the same for case c: the CUDA kernels round P and dS to 16 bits before
 * their products (as FlashAttention does), so a gradient's error grows as
 * the square root of the terms summed; past 128 of them the factor grows
 * with it (on an H100 every mode gave the same two bf16 dk elements of the
 * causal 300 x 300 case 0.0045 off a reference of 0.0085, over the 0.0038
 * the flat factor allows) */
static double factor_for(const bcase *c, kl_dtype dt, bool cuda)
{
	double n = (double)(c->tq > c->tk ? c->tq : c->tk);
	return factor_of(dt, cuda) * (cuda && n > 128 ? sqrt(n / 128) : 1.0);
}

/* q, k (permuted: strided rows, unless dense), v, and the output's gradient */
static void inputs_in(kl_ctx *ctx, const bcase *c, kl_dtype dt, uint64_t seed, kl_tensor **in,
                      bool dense)
{
	int64_t sh[4][KL_MAX_DIMS];
	int nd;
	shapes(c, sh, &nd);
	for (int t = 0; t < 4; t++) {
		in[t] = kltest_rand(ctx, dt, nd, sh[t], KLTEST_NORMAL,
		                    t == 1 && !dense ? KLTEST_PERMUTED : KLTEST_CONTIG,
		                    seed + (uint64_t)t);
		assert_non_null(in[t]);
	}
}

static void inputs(kl_ctx *ctx, const bcase *c, kl_dtype dt, uint64_t seed, kl_tensor **in)
{
	inputs_in(ctx, c, dt, seed, in, false);
}

static kl_status body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                      void *user)
{
	(void)nin, (void)nout;
	const sdpa_p *p = user;
	kl_tensor *y = kl_sdpa(in[0], in[1], in[2], p->causal, p->scale);
	if (!y)
		return kl_last_status(ctx);
	kl_status st = kl_backward(y, in[3]);
	for (int i = 0; st == KL_OK && i < 3; i++)
		out[i] = kl_grad(in[i]);
	return st;
}

/* the float64 reference of the traced forward and backward: dq, dk, dv */
static bool reference(kl_ctx *ctx, kl_tensor *const *in, const sdpa_p *p, double **ref)
{
	kl_scope_begin(ctx);
	if (kl__trace_begin(ctx) != KL_OK) {
		kl_scope_end(ctx);
		return false;
	}
	kl_tensor *out[3] = {NULL, NULL, NULL};
	kl_status st = body(ctx, in, 4, out, 3, (void *)p);
	kl_trace *tr = kl__trace_end(ctx, st == KL_OK ? 3 : 0, out);
	kl_scope_end(ctx);
	for (int i = 0; i < 3; i++)
		kl_grad_clear(in[i]);
	if (!tr || st != KL_OK)
		return false;
	const kl_graph *g = &tr->g;
	int nat = 0;
	for (int32_t n = 0; n < g->n; n++)
		nat += g->nodes[n].op == KL_OP_ATTENTION_BWD;
	double *iv[8] = {NULL};
	bool ok = nat == 1 && g->ninputs <= 8 && g->noutputs == 3;
	if (nat != 1)
		fprintf(stderr, "FAIL: the traced backward holds %d sdpa_bwd nodes, not 1\n", nat);
	for (int i = 0; ok && i < g->ninputs; i++)
		ok = (iv[i] = kltest_read(tr->in_tensors[i])) != NULL;
	char err[256];
	if (ok && kl__ref_eval(g, (const double *const *)iv, ref, err, sizeof err) != KL_OK) {
		fprintf(stderr, "FAIL: reference: %s\n", err);
		ok = false;
	}
	for (int i = 0; i < 8; i++)
		free(iv[i]);
	kl__trace_free(tr);
	return ok;
}

static bool compare(const char *what, kl_tensor *const *in, kl_tensor **got, double **ref,
                    double factor)
{
	bool ok = true;
	for (int i = 0; i < 3; i++) {
		char w[160];
		snprintf(w, sizeof w, "%s: d%s", what, i == 0 ? "q" : i == 1 ? "k" : "v");
		if (!got[i]) {
			fprintf(stderr, "FAIL %s: no gradient\n", w);
			ok = false;
			continue;
		}
		double *v = kltest_read(got[i]);
		ok &= v && got[i]->dtype == in[i]->dtype &&
		      kltest_compare(w, in[i]->dtype, in[i]->ndim, in[i]->shape, v, ref[i], factor);
		free(v);
	}
	return ok;
}

/* every case in dtype dt on ctx's device, eagerly and compiled */
static int run_cases(kl_ctx *ctx, const kl_dtype *dts, int ndt, bool cuda)
{
	int bad = 0;
	for (int ci = 0; ci < NCASES; ci++)
		for (int di = 0; di < ndt; di++) {
			const bcase *c = &CASES[ci];
			kl_dtype dt = dts[di];
			kl_tensor *in[4];
			inputs(ctx, c, dt, 3000 + (uint64_t)ci * 10, in);
			for (int t = 0; t < 3; t++)
				assert_int_equal(kl_set_requires_grad(in[t], true), KL_OK);
			sdpa_p p = {c->causal, 1.0 / sqrt((double)c->d)};
			double *ref[3] = {NULL, NULL, NULL};
			char what[128];
			snprintf(what, sizeof what, "sdpa backward case %d %s%s", ci, kl_dtype_name(dt),
			         cuda ? " cuda" : "");
			if (!reference(ctx, in, &p, ref)) {
				fprintf(stderr, "FAIL %s: reference: %s\n", what, kl_last_error(ctx));
				bad++;
			} else {
				/* eager */
				char w[160];
				kl_tensor *g[3] = {NULL, NULL, NULL};
				kl_scope_begin(ctx);
				kl_status st = body(ctx, in, 4, g, 3, &p);
				kl_scope_end(ctx);
				snprintf(w, sizeof w, "%s eager", what);
				if (st != KL_OK) {
					fprintf(stderr, "FAIL %s: %s\n", w, kl_last_error(ctx));
					bad++;
				} else {
					for (int t = 0; t < 3; t++)
						g[t] = kl_grad(in[t]);
					bad += !compare(w, in, g, ref, factor_for(c, dt, cuda));
				}
				for (int t = 0; t < 3; t++)
					kl_grad_clear(in[t]);
				/* compiled */
				kl_fn *f = kl_compile(ctx, body, &p, 4, 3, NULL);
				kl_tensor *out[3] = {NULL, NULL, NULL};
				snprintf(w, sizeof w, "%s compiled", what);
				if (!f || kl_fn_call(f, in, out) != KL_OK) {
					fprintf(stderr, "FAIL %s: %s\n", w, kl_last_error(ctx));
					bad++;
				} else {
					bad += !compare(w, in, out, ref, factor_for(c, dt, cuda));
				}
				for (int t = 0; t < 3; t++) {
					kl_release(out[t]);
					kl_grad_clear(in[t]);
				}
				kl_fn_free(f);
			}
			for (int t = 0; t < 3; t++)
				free(ref[t]);
			for (int t = 0; t < 4; t++)
				kl_release(in[t]);
		}
	return bad;
}

static void test_bwd_cpu(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	const kl_dtype dts[4] = {KL_F32, KL_F64, KL_BF16, KL_F16};
	int bad = run_cases(ctx, dts, 4, false);
	kl_ctx_free(ctx);
	assert_int_equal(bad, 0);
}

/* ---- the plan ----------------------------------------------------------------- */

static kl_trace *trace_bwd(kl_ctx *ctx, kl_tensor *const *in, const sdpa_p *p)
{
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *out[3] = {NULL, NULL, NULL};
	assert_int_equal(body(ctx, in, 4, out, 3, (void *)p), KL_OK);
	kl_trace *tr = kl__trace_end(ctx, 3, out);
	kl_scope_end(ctx);
	for (int i = 0; i < 3; i++)
		kl_grad_clear(in[i]);
	assert_non_null(tr);
	return tr;
}

/* run program P (compiled from tr's graph when NULL) on the trace's inputs:
 * the gradients against the reference */
static void run_program(kl_ctx *ctx, kl_trace *tr, const kl_program *given, double factor,
                        kl_compiled **keep)
{
	kl_compile_cfg cfg = {.mode = KL_MODE_DEFAULT, .fusion = true, .name = "attn_bwd",
	                      .given = given};
	kl_compiled *c = kl__compile(ctx, &tr->g, &cfg);
	if (!c)
		fail_msg("kl__compile: %s", kl_last_error(ctx));
	const kl_graph *g = &tr->g;
	kl_tensor *out[3] = {NULL};
	assert_int_equal(kl__compiled_run(ctx, c, tr->in_tensors, out), KL_OK);
	double *iv[8] = {NULL}, *ov[3] = {NULL};
	assert_true(g->ninputs <= 8 && g->noutputs == 3);
	for (int i = 0; i < g->ninputs; i++)
		assert_non_null(iv[i] = kltest_read(tr->in_tensors[i]));
	char err[256];
	assert_int_equal(kl__ref_eval(g, (const double *const *)iv, ov, err, sizeof err), KL_OK);
	for (int j = 0; j < 3; j++) {
		const kl_node *n = &g->nodes[g->outputs[j]];
		double *got = kltest_read(out[j]);
		assert_non_null(got);
		assert_true(kltest_compare("attention backward program", (kl_dtype)n->dtype, n->ndim,
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

static int count_bwd(const kl_program *P)
{
	int n = 0;
	for (int32_t s = 0; s < P->nsteps; s++)
		n += P->steps[s].kind == KL_STEP_ATTENTION && P->steps[s].at.bwd;
	return n;
}

/* one backward step, no buffer of Tq x Tk; the primitive expansion (a target
 * without the step) agrees with the fused op's reference in f64; the program
 * through the serializer, and a corrupted one refused */
static void test_bwd_plan(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	const bcase *c = &CASES[7]; /* [130, 16]: Tq x Tk far above every operand */
	kl_tensor *in[4];
	inputs(ctx, c, KL_F64, 77, in);
	for (int t = 0; t < 3; t++)
		assert_int_equal(kl_set_requires_grad(in[t], true), KL_OK);
	sdpa_p p = {c->causal, 0.3};
	kl_trace *tr = trace_bwd(ctx, in, &p);
	kl_compiled *cc = NULL;
	run_program(ctx, tr, NULL, factor_of(KL_F64, false), &cc);
	const kl_program *P = &cc->prog;
	assert_int_equal(count_bwd(P), 1);
	int64_t big = c->b0 * c->tq * c->tk / 2;
	for (int32_t b = 0; b < P->nbufs; b++) {
		int64_t n = 1;
		for (int d = 0; d < P->bufs[b].ndim; d++)
			n *= P->bufs[b].shape[d].v;
		if (n >= big)
			fail_msg("buffer %d holds %lld elements: a [Tq, Tk] score matrix", (int)b,
			         (long long)n);
	}
	/* through the serializer */
	uint8_t *bytes = NULL;
	size_t len = 0;
	assert_int_equal(kl__program_serialize(P, &bytes, &len), KL_OK);
	kl_program R;
	char err[256];
	assert_int_equal(kl__program_deserialize(bytes, len, &R, err, sizeof err), KL_OK);
	int32_t s = 0;
	while (!(R.steps[s].kind == KL_STEP_ATTENTION && R.steps[s].at.bwd))
		s++;
	assert_memory_equal(&R.steps[s].at, &P->steps[s].at, sizeof R.steps[s].at);
	/* a backward step whose packed result reaches past its buffer, or
	 * that writes an operand it reads, is refused */
	R.steps[s].at.o_rs *= 4;
	assert_int_not_equal(kl__program_validate(&R, cc->nin, cc->nout, err, sizeof err), KL_OK);
	R.steps[s].at.o_rs /= 4;
	int32_t go = R.steps[s].at.go;
	R.steps[s].at.go = R.steps[s].at.o;
	assert_int_not_equal(kl__program_validate(&R, cc->nin, cc->nout, err, sizeof err), KL_OK);
	R.steps[s].at.go = go;
	assert_int_equal(kl__program_validate(&R, cc->nin, cc->nout, err, sizeof err), KL_OK);
	R.steps[s].at.bwd = 2;
	assert_int_not_equal(kl__program_validate(&R, cc->nin, cc->nout, err, sizeof err), KL_OK);
	R.steps[s].at.bwd = 1;
	/* the lengths' inner dims are read without lengths too: out of range is
	 * refused (a fuzzed package indexed batch[] with one) */
	R.steps[s].at.len_inner = -1526726655;
	assert_int_not_equal(kl__program_validate(&R, cc->nin, cc->nout, err, sizeof err), KL_OK);
	assert_non_null(strstr(err, "inner dims"));
	R.steps[s].at.len_inner = R.steps[s].at.nbatch + 1;
	assert_int_not_equal(kl__program_validate(&R, cc->nin, cc->nout, err, sizeof err), KL_OK);
	R.steps[s].at.len_inner = 0;
	assert_int_equal(kl__program_validate(&R, cc->nin, cc->nout, err, sizeof err), KL_OK);
	kl__program_free(&R);
	free(bytes);
	kl__compiled_free(cc);
	/* the primitives, as a target without the step lowers them */
	kl_lower_opts o = {.target = KL_TARGET_C, .fusion = true, .no_attention = true};
	kl_program Q;
	assert_int_equal(kl__lower(&tr->g, &o, &Q, err, sizeof err), KL_OK);
	assert_int_equal(count_bwd(&Q), 0);
	run_program(ctx, tr, &Q, factor_of(KL_F64, false), NULL);
	kl__program_free(&Q);
	kl__trace_free(tr);
	for (int t = 0; t < 4; t++)
		kl_release(in[t]);
	kl_ctx_free(ctx);
}

/* the steps of a compiled forward + backward: the forward attention step
 * and the backward one (-1 where there is none) */
static void attn_steps(const kl_program *P, int32_t *sf, int32_t *sb)
{
	*sf = *sb = -1;
	for (int32_t t = 0; t < P->nsteps; t++)
		if (P->steps[t].kind == KL_STEP_ATTENTION) {
			if (P->steps[t].at.bwd)
				*sb = t;
			else if (*sb < 0)
				*sf = t;
		}
}

/* the backward's L from the forward step over the same q and k
 * (kl__attn_lse_source, which the CUDA runtime pairs): found with dense
 * inputs; not where the backward's q offset or mask differs, past a step
 * that writes k, for a step that is no backward, nor where k is permuted
 * (each step then reads a copy of its own) */
static void test_bwd_lse_source(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	const bcase *c = &CASES[5]; /* [2, 2] batch, 70 x 70, head dim 128, causal */
	for (int dense = 1; dense >= 0; dense--) {
		kl_tensor *in[4];
		inputs_in(ctx, c, KL_F32, 91, in, dense);
		for (int t = 0; t < 3; t++)
			assert_int_equal(kl_set_requires_grad(in[t], true), KL_OK);
		sdpa_p p = {c->causal, 1.0 / sqrt((double)c->d)};
		kl_trace *tr = trace_bwd(ctx, in, &p);
		kl_compiled *cc = NULL;
		run_program(ctx, tr, NULL, factor_of(KL_F32, false), &cc);
		kl_program *W = &cc->prog;
		int32_t sf, sb;
		attn_steps(W, &sf, &sb);
		assert_true(sf >= 0 && sb > sf);
		assert_int_equal(kl__attn_lse_source(W, sb), dense ? sf : -1);
		if (dense) {
			assert_int_equal(kl__attn_lse_source(W, sf), -1);
			W->steps[sb].at.q_off++;
			assert_int_equal(kl__attn_lse_source(W, sb), -1);
			W->steps[sb].at.q_off--;
			W->steps[sb].at.causal ^= 1;
			assert_int_equal(kl__attn_lse_source(W, sb), -1);
			W->steps[sb].at.causal ^= 1;
			/* with a step between them: one that writes k breaks the
			 * pair, one that writes another buffer does not */
			kl_step three[3] = {W->steps[sf], W->steps[sf], W->steps[sb]};
			three[1].kind = KL_STEP_KERNEL;
			three[1].nwrites = 1;
			three[1].writes[0] = W->steps[sb].at.k;
			kl_program S;
			memset(&S, 0, sizeof S);
			S.steps = three;
			S.nsteps = 3;
			assert_int_equal(kl__attn_lse_source(&S, 2), -1);
			three[1].writes[0] = W->steps[sb].at.o;
			assert_int_equal(kl__attn_lse_source(&S, 2), 0);
			assert_int_equal(kl__attn_lse_source(W, sb), sf);
		}
		kl__compiled_free(cc);
		kl__trace_free(tr);
		for (int t = 0; t < 4; t++)
			kl_release(in[t]);
	}
	kl_ctx_free(ctx);
}

/* every dim dynamic: one compiled function at two batch sizes and two
 * sequence lengths (the sequence dims are specialised: the packed result's
 * Tq + 2 Tk is no product of symbols), each against the reference */
static void test_bwd_dynamic(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	sdpa_p p = {true, 0.25};
	kl_compile_opts o = {.dynamic = KL_DYNAMIC_ALL};
	kl_fn *f = kl_compile(ctx, body, &p, 4, 3, &o);
	assert_non_null(f);
	const bcase cs[3] = {{2, 3, 2, 20, 20, 16, true},
	                     {2, 5, 2, 20, 20, 16, true},
	                     {2, 3, 2, 37, 37, 16, true}};
	for (int i = 0; i < 3; i++) {
		kl_tensor *in[4];
		/* k permuted: dynamic inputs are bound dense, and the gradient
		 * still reaches the caller's k (it came back NULL once) */
		inputs(ctx, &cs[i], KL_F32, 500 + (uint64_t)i, in);
		for (int t = 0; t < 3; t++)
			assert_int_equal(kl_set_requires_grad(in[t], true), KL_OK);
		double *ref[3] = {NULL, NULL, NULL};
		assert_true(reference(ctx, in, &p, ref));
		kl_tensor *out[3] = {NULL, NULL, NULL};
		if (kl_fn_call(f, in, out) != KL_OK)
			fail_msg("call %d: %s", i, kl_last_error(ctx));
		assert_true(compare("dynamic", in, out, ref, factor_of(KL_F32, false)));
		/* and each input's .grad after the call */
		kl_tensor *g[3] = {kl_grad(in[0]), kl_grad(in[1]), kl_grad(in[2])};
		for (int t = 0; t < 3; t++)
			assert_non_null(g[t]);
		assert_true(compare("dynamic, .grad after the call", in, g, ref,
		                    factor_of(KL_F32, false)));
		if (i == 0) {
			/* a second call accumulates into the .grad the first left */
			kl_tensor *o2[3] = {NULL, NULL, NULL};
			if (kl_fn_call(f, in, o2) != KL_OK)
				fail_msg("second call: %s", kl_last_error(ctx));
			double *ref2[3];
			for (int t = 0; t < 3; t++) {
				int64_t n = kl_numel(in[t]);
				ref2[t] = malloc(sizeof(double) * (size_t)(n + 1));
				for (int64_t e = 0; e < n; e++)
					ref2[t][e] = 2 * ref[t][e];
				g[t] = kl_grad(in[t]);
			}
			assert_true(compare("dynamic, .grad after two calls", in, g, ref2,
			                    factor_of(KL_F32, false)));
			for (int t = 0; t < 3; t++) {
				kl_release(o2[t]);
				free(ref2[t]);
			}
		}
		for (int t = 0; t < 3; t++) {
			kl_release(out[t]);
			kl_grad_clear(in[t]);
			free(ref[t]);
		}
		for (int t = 0; t < 4; t++)
			kl_release(in[t]);
	}
	kl_fn_free(f);
	kl_ctx_free(ctx);
}

/* ---- a packed qkv product's gradient ------------------------------------------ */

/* A training step's attention: qkv = x W^T + bias [B, T, 3 H D], q, k and v
 * its head views (q | k | v along the last dim, each [H, D]; per_head: each
 * head's q, k, v adjacent, [H, 3 D]), o = sdpa(q, k, v); separate: q, k and
 * v from three products of W's and bias's thirds (nothing packed). */
typedef struct qcase {
	int64_t B, T, H, D, C; /* batch, sequence, heads, head dim, model dim */
	bool causal, per_head, separate;
} qcase;

/* [B, T, H * D] -> [B, H, T, D] (B as x has it: a dynamic batch) */
static kl_tensor *qheads(kl_tensor *x, const qcase *c)
{
	return kl_permute(kl_reshape(x, 4, (int64_t[]){kl_dim(x, 0), c->T, c->H, c->D}),
	                  (int[]){0, 2, 1, 3});
}

/* in: x [B, T, C], W [3 H D, C], bias [3 H D], dO [B, H, T, D]; out: dx,
 * dW, dbias of o through kl_backward(o, dO) */
static kl_status qkv_body(kl_ctx *ctx, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin, (void)nout;
	const qcase *c = user;
	int64_t hd = c->H * c->D;
	kl_tensor *p[3];
	if (c->separate) {
		for (int i = 0; i < 3; i++)
			p[i] = qheads(kl_linear(in[0], kl_slice(in[1], 0, i * hd, (i + 1) * hd, 1),
			                        kl_slice(in[2], 0, i * hd, (i + 1) * hd, 1)),
			              c);
	} else if (c->per_head) {
		kl_tensor *qkv = kl_reshape(kl_linear(in[0], in[1], in[2]), 4,
		                            (int64_t[]){kl_dim(in[0], 0), c->T, c->H, 3 * c->D});
		for (int i = 0; i < 3; i++)
			p[i] = kl_permute(kl_slice(qkv, 3, i * c->D, (i + 1) * c->D, 1),
			                  (int[]){0, 2, 1, 3});
	} else {
		kl_tensor *qkv = kl_linear(in[0], in[1], in[2]);
		for (int i = 0; i < 3; i++)
			p[i] = qheads(kl_slice(qkv, 2, i * hd, (i + 1) * hd, 1), c);
	}
	kl_tensor *o = kl_sdpa(p[0], p[1], p[2], c->causal, 1.0 / sqrt((double)c->D));
	if (!o)
		return kl_last_status(ctx);
	kl_status st = kl_backward(o, in[3]);
	for (int i = 0; st == KL_OK && i < 3; i++)
		out[i] = kl_grad(in[i]);
	return st;
}

/* fresh inputs of case c (W scaled by 1/sqrt(C), so that the scores stay
 * where softmax is not one-hot), x, W and bias requiring gradients */
static void qkv_inputs(kl_ctx *ctx, const qcase *c, kl_dtype dt, uint64_t seed, kl_tensor **in)
{
	int64_t hd = c->H * c->D;
	int64_t sh[4][KL_MAX_DIMS] = {
	        {c->B, c->T, c->C}, {3 * hd, c->C}, {3 * hd}, {c->B, c->H, c->T, c->D}};
	int nd[4] = {3, 2, 1, 4};
	for (int t = 0; t < 4; t++) {
		kl_tensor *r = kltest_rand(ctx, dt, nd[t], sh[t], KLTEST_NORMAL, KLTEST_CONTIG,
		                           seed + (uint64_t)t);
		assert_non_null(r);
		in[t] = t == 1 ? kl_mul_scalar(r, 1.0 / sqrt((double)c->C)) : r;
		assert_non_null(in[t]);
		if (t == 1)
			kl_release(r);
		if (t < 3)
			assert_int_equal(kl_set_requires_grad(in[t], true), KL_OK);
	}
}

/* case c's step traced on in (the gradients cleared after), and the float64
 * reference of its graph into ref[0..3): dx, dW, dbias */
static kl_trace *qkv_trace(kl_ctx *ctx, const qcase *c, kl_tensor *const *in, double **ref)
{
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *g[3] = {NULL, NULL, NULL};
	assert_int_equal(qkv_body(ctx, in, 4, g, 3, (void *)c), KL_OK);
	kl_trace *tr = kl__trace_end(ctx, 3, g);
	kl_scope_end(ctx);
	for (int i = 0; i < 3; i++)
		kl_grad_clear(in[i]);
	assert_non_null(tr);
	const kl_graph *G = &tr->g;
	assert_true(G->ninputs <= 8 && G->noutputs == 3);
	double *iv[8] = {NULL};
	for (int i = 0; i < G->ninputs; i++)
		assert_non_null(iv[i] = kltest_read(tr->in_tensors[i]));
	char err[256];
	if (kl__ref_eval(G, (const double *const *)iv, ref, err, sizeof err) != KL_OK)
		fail_msg("reference: %s", err);
	for (int i = 0; i < 8; i++)
		free(iv[i]);
	return tr;
}

/* What the plan does with d(qkv): want, the attention backward writes it
 * (its buffer is d(qkv) [B, T, 3 H D] itself, "into concat"), the products
 * of dx and dW read it there, and the one kernel that reads it writes only
 * the bias's gradient (3 H D elements): no kernel gathers it from a packed
 * [dq; dk; dv]. Else (q, k, v not of one product) the step writes the
 * packed result as the op defines it. */
static void expect_qkv_plan(const kl_program *P, const qcase *c, bool want, const char *what)
{
	int64_t hd = c->H * c->D, dqkv = c->B * c->T * 3 * hd;
	int nbwd = 0, nread = 0;
	for (int32_t s = 0; s < P->nsteps; s++) {
		const kl_step *sp = &P->steps[s];
		if (sp->kind != KL_STEP_ATTENTION || !sp->at.bwd)
			continue;
		nbwd++;
		const kl_attn_step *a = &sp->at;
		const kl_buf *o = &P->bufs[a->o];
		bool into = strstr(sp->what, "into concat") != NULL;
		if (into != want)
			fail_msg("%s: the backward step is \"%s\"", what, sp->what);
		if (!want) {
			if (o->ndim != 4 || o->shape[2].v != 3 * c->T ||
			    a->dk_off != c->T * a->o_rs || a->dv_off != 2 * c->T * a->o_rs)
				fail_msg("%s: the backward writes no packed [dq; dk; dv]", what);
			continue;
		}
		/* q, k and v read where the product put them, by the forward and
		 * the backward alike: the two pair for L (kl__attn_lse_source) */
		if (kl__attn_lse_source(P, s) < 0)
			fail_msg("%s: the backward step pairs with no forward step for L", what);
		/* d(qkv) [B, T, 3HD], or per head [B, T, H, 3D] (its reshape) */
		int64_t no = 1;
		for (int d = 0; d < o->ndim; d++)
			no *= o->shape[d].v;
		if (o->ndim != (c->per_head ? 4 : 3) || o->shape[0].v != c->B ||
		    o->shape[1].v != c->T || no != dqkv)
			fail_msg("%s: the backward writes buffer %d of %d dims, not d(qkv)", what,
			         a->o, o->ndim);
		/* where the forward packed them: q | k | v, or each head's */
		int64_t kq = c->per_head ? c->D : hd;
		if (a->dq_off != 0 || a->dk_off != kq || a->dv_off != 2 * kq || a->o_rs != 3 * hd ||
		    a->dk_rs != 3 * hd || a->dv_rs != 3 * hd)
			fail_msg("%s: gradients at %lld, %lld, %lld, rows %lld, %lld, %lld apart",
			         what, (long long)a->dq_off, (long long)a->dk_off,
			         (long long)a->dv_off, (long long)a->o_rs, (long long)a->dk_rs,
			         (long long)a->dv_rs);
		for (int32_t t = 0; t < P->nsteps; t++) {
			const kl_step *u = &P->steps[t];
			bool reads = false;
			for (int i = 0; i < u->nreads; i++)
				reads |= u->reads[i] == a->o;
			if (!reads)
				continue;
			nread++;
			for (int i = 0; u->kind == KL_STEP_KERNEL && i < u->nwrites; i++) {
				int64_t n = 1;
				for (int d = 0; d < P->bufs[u->writes[i]].ndim; d++)
					n *= P->bufs[u->writes[i]].shape[d].v;
				if (n >= dqkv)
					fail_msg(
					        "%s: step %d (%s) reads d(qkv) and writes %lld elements",
					        what, (int)t, u->what, (long long)n);
			}
			if (u->kind == KL_STEP_MATMUL && u->mm.a != a->o && u->mm.b != a->o)
				fail_msg("%s: product %d reads d(qkv) other than as an operand",
				         what, (int)t);
		}
	}
	if (nbwd != 1)
		fail_msg("%s: %d attention backward steps", what, nbwd);
	if (want && nread < 3) /* dx's and dW's products and the bias's sum */
		fail_msg("%s: %d steps read d(qkv)", what, nread);
}

/* case c in dtype dt on ctx's device: the traced step compiled, run twice
 * (the temps poisoned with NaN before the second run: a gradient row the
 * step does not write shows), dx, dW and dbias against the float64
 * reference of the traced graph each time; the plan as expect_qkv_plan */
static int qkv_case(kl_ctx *ctx, const qcase *c, kl_dtype dt, uint64_t seed, double factor)
{
	char what[160];
	snprintf(what, sizeof what, "qkv B%lld T%lld H%lld D%lld %s%s%s%s", (long long)c->B,
	         (long long)c->T, (long long)c->H, (long long)c->D, kl_dtype_name(dt),
	         c->causal ? " causal" : "", c->per_head ? " per head" : "",
	         c->separate ? " separate" : "");
	kl_tensor *in[4];
	qkv_inputs(ctx, c, dt, seed, in);
	double *ref[3] = {NULL};
	kl_trace *tr = qkv_trace(ctx, c, in, ref);
	const kl_graph *G = &tr->g;
	kl_compile_cfg cfg = {.mode = KL_MODE_DEFAULT, .fusion = true, .name = "qkv_grad"};
	kl_compiled *cc = kl__compile(ctx, G, &cfg);
	if (!cc)
		fail_msg("%s: kl__compile: %s", what, kl_last_error(ctx));
	expect_qkv_plan(&cc->prog, c, !c->separate, what);
	int bad = 0;
	for (int run = 0; run < 2; run++) {
		if (run && cc->arena && cc->arena_cap) {
#ifdef KILN_HAVE_CUDA
			if (cc->cuda)
				assert_int_equal(kl__cuda_memset(ctx, kl__cuda_dev_of(ctx),
				                                 (CUdeviceptr)(uintptr_t)cc->arena,
				                                 0xFF, cc->arena_cap),
				                 KL_OK);
			else
#endif
				memset(cc->arena, 0xFF, cc->arena_cap);
		}
		kl_tensor *out[3] = {NULL, NULL, NULL};
		if (kl__compiled_run(ctx, cc, tr->in_tensors, out) != KL_OK)
			fail_msg("%s: run %d: %s", what, run, kl_last_error(ctx));
		for (int j = 0; j < 3; j++) {
			const kl_node *n = &G->nodes[G->outputs[j]];
			char w[200];
			snprintf(w, sizeof w, "%s run %d: d%s", what, run,
			         (const char *[]){"x", "W", "bias"}[j]);
			double *got = kltest_read(out[j]);
			assert_non_null(got);
			bad += !kltest_compare(w, (kl_dtype)n->dtype, n->ndim, n->shape, got,
			                       ref[j], factor);
			free(got);
			kl_release(out[j]);
		}
	}
	kl__compiled_free(cc);
	for (int j = 0; j < 3; j++)
		free(ref[j]);
	kl__trace_free(tr);
	for (int t = 0; t < 4; t++)
		kl_release(in[t]);
	return bad;
}

/* The plan lowering makes for CUDA (no GPU needed) of case c in dtype dt:
 * as expect_qkv_plan says (the kernels' alignment met) */
static void qkv_cuda_plan(kl_ctx *ctx, const qcase *c, kl_dtype dt)
{
	char what[96];
	snprintf(what, sizeof what, "qkv for CUDA, D%lld %s%s%s", (long long)c->D,
	         kl_dtype_name(dt), c->per_head ? " per head" : "", c->separate ? " separate" : "");
	kl_tensor *in[4];
	qkv_inputs(ctx, c, dt, 5, in);
	double *ref[3] = {NULL};
	kl_trace *tr = qkv_trace(ctx, c, in, ref);
	kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
	kl_program P;
	char err[256];
	if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
		fail_msg("%s: %s", what, err);
	expect_qkv_plan(&P, c, !c->separate, what);
	kl__program_free(&P);
	kl__trace_free(tr);
	for (int j = 0; j < 3; j++)
		free(ref[j]);
	for (int t = 0; t < 4; t++)
		kl_release(in[t]);
}

/* The packed qkv product's gradient comes out of the attention backward's
 * step, written where d(qkv) holds dq, dk and dv (no gather kernel), causal
 * or not, for either packing; q, k, v of three products keep the packed
 * result. On the CPU in f32 (T 40: not whole blocks of 64), and the plans
 * lowering makes for CUDA (f16 and bf16, head dims 64 and 128); with
 * KILN_TEST_DEVICE=cuda in f16 and bf16 at head dims 64 and 128 (the CUDA
 * kernels' default mode: kl_attnb_wg on sm_90). */
static void test_qkv_grad(void **state)
{
	(void)state;
	kl_ctx *ctx = kltest_ctx_from_env("test_attention_bwd");
	assert_non_null(ctx);
	bool cuda = kl_ctx_device(ctx) == KL_CUDA;
	int bad = 0;
	for (int k = 0; k < 6; k++) {
		bool causal = k & 1, per_head = k / 2 == 1, separate = k / 2 == 2;
		if (!cuda) {
			qcase c = {2, 40, 3, 16, 24, causal, per_head, separate};
			bad += qkv_case(ctx, &c, KL_F32, 700 + (uint64_t)k * 10,
			                factor_of(KL_F32, false));
			qcase g = {2, 80, 2, causal ? 128 : 64, 64, causal, per_head, separate};
			qkv_cuda_plan(ctx, &g, causal ? KL_F16 : KL_BF16);
			continue;
		}
		const kl_dtype dts[2] = {KL_BF16, KL_F16};
		for (int hi = 0; hi < 2; hi++)
			for (int di = 0; di < 2; di++) {
				qcase c = {2, 80, 2, hi ? 128 : 64, 64, causal, per_head, separate};
				bad += qkv_case(ctx, &c, dts[di],
				                900 + (uint64_t)(k * 4 + hi * 2 + di),
				                4 * factor_of(dts[di], true));
			}
	}
	kl_ctx_free(ctx);
	assert_int_equal(bad, 0);
}

/* every dim dynamic: one compiled step at three batch sizes (the sequence
 * dims are specialised, as the backward's are), each call's dx, dW and
 * dbias against the reference: the gradients' places follow the batch
 * (symbolic step fields) */
static void test_qkv_dynamic(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	qcase c = {2, 24, 2, 16, 20, true, false, false};
	kl_compile_opts o = {.dynamic = KL_DYNAMIC_ALL};
	kl_fn *f = kl_compile(ctx, qkv_body, &c, 4, 3, &o);
	assert_non_null(f);
	const int64_t bs[3] = {2, 3, 5};
	for (int i = 0; i < 3; i++) {
		c.B = bs[i];
		kl_tensor *in[4];
		qkv_inputs(ctx, &c, KL_F32, 60 + (uint64_t)i, in);
		double *ref[3] = {NULL};
		kl__trace_free(qkv_trace(ctx, &c, in, ref));
		kl_tensor *out[3] = {NULL, NULL, NULL};
		if (kl_fn_call(f, in, out) != KL_OK)
			fail_msg("batch %lld: %s", (long long)c.B, kl_last_error(ctx));
		for (int j = 0; j < 3; j++) {
			double *got = kltest_read(out[j]);
			assert_non_null(got);
			char w[64];
			snprintf(w, sizeof w, "qkv dynamic, batch %lld: d%s", (long long)c.B,
			         (const char *[]){"x", "W", "bias"}[j]);
			assert_true(kltest_compare(w, KL_F32, kl_ndim(out[j]), kl_shape(out[j]), got,
			                           ref[j], factor_of(KL_F32, false)));
			free(got);
			free(ref[j]);
			kl_release(out[j]);
		}
		for (int t = 0; t < 3; t++)
			kl_grad_clear(in[t]);
		for (int t = 0; t < 4; t++)
			kl_release(in[t]);
	}
	kl_fn_free(f);
	kl_ctx_free(ctx);
}

/* the gradients' places through the program serializer, and a plan whose
 * gradient reaches out of its buffer (or sits before it) refused, naming
 * the gradient; a plan of the format before them refused, saying so */
static void test_qkv_plan_io(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(NULL);
	qcase c = {2, 8, 2, 8, 12, true, false, false};
	kl_tensor *in[4];
	qkv_inputs(ctx, &c, KL_F32, 41, in);
	double *ref[3] = {NULL};
	kl_trace *tr = qkv_trace(ctx, &c, in, ref);
	for (int j = 0; j < 3; j++)
		free(ref[j]);
	kl_compile_cfg cfg = {.mode = KL_MODE_DEFAULT, .fusion = true, .name = "qkv_io"};
	kl_compiled *cc = kl__compile(ctx, &tr->g, &cfg);
	assert_non_null(cc);
	const kl_program *P = &cc->prog;
	expect_qkv_plan(P, &c, true, "qkv plan io");
	uint8_t *bytes = NULL;
	size_t len = 0;
	assert_int_equal(kl__program_serialize(P, &bytes, &len), KL_OK);
	kl_program R;
	char err[256];
	assert_int_equal(kl__program_deserialize(bytes, len, &R, err, sizeof err), KL_OK);
	int32_t s = 0;
	while (!(R.steps[s].kind == KL_STEP_ATTENTION && R.steps[s].at.bwd))
		s++;
	kl_attn_step *a = &R.steps[s].at, keep = *a;
	assert_memory_equal(a, &P->steps[s].at, sizeof *a);
	int64_t n = 1;
	for (int d = 0; d < R.bufs[a->o].ndim; d++)
		n *= R.bufs[a->o].shape[d].v;
	/* each field moved out of o's buffer: refused, the gradient named */
	struct {
		int64_t *f;
		int64_t v;
		const char *name;
	} bad[] = {
	        {&a->dq_off, n - 1, "dq"},
	        {&a->dk_off, n - 2, "dk"},
	        {&a->dv_off, n, "dv"},
	        {&a->dk_rs, 5 * n, "dk"},
	        {&a->dv_rs, n / 2, "dv"},
	        {&a->o_rs, 3 * n, "dq"},
	        {&a->dk_bs[0], n, "dk"},
	        {&a->dv_bs[1], INT64_MAX / 2, "dv"},
	        {&a->dq_off, -1, "out of range"},
	        {&a->dv_rs, 1, "out of range"},
	        {&a->dk_bs[0], -8, "dk"},
	};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		int64_t was = *bad[i].f;
		*bad[i].f = bad[i].v;
		if (kl__program_validate(&R, cc->nin, cc->nout, err, sizeof err) == KL_OK)
			fail_msg("field %zu at %lld accepted", i, (long long)bad[i].v);
		if (!strstr(err, bad[i].name))
			fail_msg("field %zu at %lld: \"%s\" names no %s", i, (long long)bad[i].v,
			         err, bad[i].name);
		*bad[i].f = was;
	}
	assert_memory_equal(a, &keep, sizeof keep);
	assert_int_equal(kl__program_validate(&R, cc->nin, cc->nout, err, sizeof err), KL_OK);
	/* the same refused when read (a plan file is untrusted input) */
	a->dv_off = n;
	uint8_t *b2 = NULL;
	size_t l2 = 0;
	assert_int_equal(kl__program_serialize(&R, &b2, &l2), KL_OK);
	kl_program Q;
	assert_int_equal(kl__program_deserialize(b2, l2, &Q, err, sizeof err), KL_EFORMAT);
	assert_non_null(strstr(err, "dv"));
	free(b2);
	/* format 10, before the gradients' places: refused as such */
	uint8_t v10[4] = {10, 0, 0, 0};
	memcpy(bytes + 8, v10, 4);
	assert_int_equal(kl__program_deserialize(bytes, len, &Q, err, sizeof err), KL_EFORMAT);
	assert_non_null(strstr(err, "gradient layouts"));
	kl__program_free(&R);
	free(bytes);
	kl__compiled_free(cc);
	kl__trace_free(tr);
	for (int t = 0; t < 4; t++)
		kl_release(in[t]);
	kl_ctx_free(ctx);
}

/* ---- CUDA ------------------------------------------------------------------------ */

/* the backward's kernels, every mode's (fused: kl_attnb_pre, kl_attnb_kv,
 * kl_attnb_dq; split: kl_attnb_pre, kl_attnb_kv_split, kl_attnb_dq_split;
 * wgmma: kl_attnb_dd, kl_attn_wgmma_lse, kl_attnb_wg, kl_attnb_dq, the first
 * three only in the module built for sm_90a), compile for sm_90 (and sm_90a) in f16 and bf16 at head dims 64 and
 * 128 with no warning
 * and (but for a few bytes in kl_attnb_kv at head dim 128) no spill, no GPU
 * needed; ptxas's figures printed, each kernel found in them (so in the
 * module), and kl_attnb_kv_split under kl_attnb_kv's registers */
static void test_cuda_bwd_compile(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	kl_ctx *ctx = kl_ctx_new(NULL);
	if (kl__cuda_load_nvrtc(ctx) != KL_OK) {
		print_message("test_attention_bwd: NVRTC not loadable: %s\n", kl_last_error(ctx));
		kl_ctx_free(ctx);
		skip();
	}
	const kl_dtype dts[2] = {KL_F16, KL_BF16};
	const int hds[2] = {64, 128};
	for (int wg = 0; wg < 2; wg++)
	for (int di = 0; di < 2; di++)
		for (int hi = 0; hi < 2; hi++) {
			char *src = kl__cuda_attention_bwd_source(dts[di], hds[hi], wg);
			assert_non_null(src);
			kl_nvrtc_opts o = {.arch = 90, .arch_specific = wg, .ptxas_info = true};
			kl_cuda_image im;
			if (kl__nvrtc_compile(ctx, src, "kiln_attention_bwd.cu", &o, &im) != KL_OK)
				fail_msg("%s d%d: %s\n%s", kl_dtype_name(dts[di]), hds[hi],
				         kl_last_error(ctx), im.log ? im.log : "");
			assert_memory_equal(im.data, "\177ELF", 4);
			if (im.log && strstr(im.log, "warning"))
				fail_msg("%s d%d: warnings:\n%s", kl_dtype_name(dts[di]), hds[hi], im.log);
			const char *names[8] = {"kl_attnb_pre",      "kl_attnb_kv",
			                        "kl_attnb_dq",       "kl_attnb_kv_split",
			                        "kl_attnb_dq_split", "kl_attnb_wg",
			                        "kl_attnb_dd",       "kl_attn_wgmma_lse"};
			int used[8];
			for (int k = 0; k < (wg ? 8 : 5); k++) {
				char key[64];
				/* the whole name: kl_attnb_kv is a prefix of kl_attnb_kv_split */
				snprintf(key, sizeof key, "Function properties for %s\n", names[k]);
				const char *f = im.log ? strstr(im.log, key) : NULL;
				const char *u = f ? strstr(f, "Used ") : NULL;
				const char *nl = f ? strchr(f, '\n') : NULL;
				int frame = -1, sst = -1, sld = -1, regs = -1;
				if (nl)
					sscanf(nl + 1, "%*[^0-9]%d bytes stack frame, %d bytes spill stores, "
					               "%d bytes spill loads", &frame, &sst, &sld);
				if (u)
					sscanf(u, "Used %d registers", &regs);
				used[k] = regs;
				print_message("test_attention_bwd: %s d%d %s: %d registers, %d-byte "
				              "frame, spills %d/%d bytes\n",
				              kl_dtype_name(dts[di]), hds[hi], names[k], regs, frame, sst,
				              sld);
				/* kl_attnb_kv at head dim 128 holds dk and dv (128
				 * registers) beside the tiles' fragments: ptxas fills the
				 * 255 and may spill a word or two (one loop-invariant
				 * value, from L1); more than 16 bytes is a regression */
				int allow = k == 1 && hds[hi] == 128 ? 16 : 0;
				if (regs < 0 || frame > allow || sst > allow || sld > allow)
					fail_msg("%s d%d %s: no ptxas figures, or it spills:\n%s",
					         kl_dtype_name(dts[di]), hds[hi], names[k],
					         im.log ? im.log : "(no log)");
			}
			/* what the split was for: without the dQ work the kv
			 * kernel holds less (its dk and dv still take D
			 * registers a thread) */
			if (used[3] >= used[1])
				fail_msg("%s d%d: kl_attnb_kv_split uses %d registers, kl_attnb_kv %d",
				         kl_dtype_name(dts[di]), hds[hi], used[3], used[1]);
			kl__cuda_image_free(&im);
			free(src);
		}
	assert_null(kl__cuda_attention_bwd_source(KL_F32, 64, false));
	assert_null(kl__cuda_attention_bwd_source(KL_BF16, 96, true));
	kl_ctx_free(ctx);
#else
	print_message("test_attention_bwd: skipped, built without the CUDA backend\n");
	skip();
#endif
}

#ifdef KILN_HAVE_CUDA
static kl_ctx *gpu_ctx(void)
{
	kl_ctx_opts o = {.device = KL_CUDA};
	kl_ctx *ctx = kl_ctx_new(&o);
	if (!ctx)
		print_message("test_attention_bwd: no CUDA device, GPU tests skipped\n");
	return ctx;
}
#endif

/* on a GPU: every case's gradients (f16/bf16 at head dims 64 and 128 through
 * the kernels, the rest through the primitive expansion) in the default mode,
 * four with dense operands whose backward reads L from its forward (on
 * sm_90; KILN_CUDA_ATTN_LSE=0 turns that off),
 * then f16/bf16 again in each mode (KILN_CUDA_ATTN_BWD=wgmma: kl_attnb_wg on
 * sm_90, elsewhere the default; fused: kl_attnb_kv; split: kl_attnb_kv_split
 * and kl_attnb_dq_split; read at each launch) */
static void test_cuda_bwd(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	kl_ctx *ctx = gpu_ctx();
	if (!ctx)
		skip();
	const kl_dtype dts[3] = {KL_BF16, KL_F16, KL_F32};
	unsetenv("KILN_CUDA_ATTN_BWD");
	int bad = run_cases(ctx, dts, 3, true);
	/* dense q, k and v (run_cases permutes k, so the forward and the
	 * backward each read a copy of their own and nothing pairs them), in
	 * bf16 and f16 at head dims 64 and 128: on sm_90 the compiled backward
	 * reads L as its forward wrote it, and the gradients match the f64
	 * reference (case 6, causal with 100 queries over 45 keys, has rows
	 * that see no key: NaN L, NaN gradients as the reference says) */
	const int dense_cases[4] = {3, 5, 2, 6};
	const kl_cuda_dev *d = kl__cuda_dev_of(ctx);
	for (int i = 0; i < 4; i++) {
		const bcase *c = &CASES[dense_cases[i]];
		kl_dtype dt = i % 2 ? KL_F16 : KL_BF16;
		kl_tensor *in[4];
		inputs_in(ctx, c, dt, 4100 + (uint64_t)i, in, true);
		for (int t = 0; t < 3; t++)
			assert_int_equal(kl_set_requires_grad(in[t], true), KL_OK);
		sdpa_p p = {c->causal, 1.0 / sqrt((double)c->d)};
		kl_trace *tr = trace_bwd(ctx, in, &p);
		long fa = 0, fb = 0, lr0 = 0, lr1 = 0;
		kl__cuda_attn_counts(&fa, &fb, &lr0);
		run_program(ctx, tr, NULL, factor_for(c, dt, true), NULL);
		kl__cuda_attn_counts(&fa, &fb, &lr1);
		const char *ke = getenv("KILN_CUDA_ATTN_LSE");
		print_message("test_attention_bwd: dense case %d %s: %ld backward steps read L from "
		              "their forward\n",
		              dense_cases[i], kl_dtype_name(dt), lr1 - lr0);
		if (d->cc_major == 9 && d->cc_minor == 0 && lr1 == lr0 &&
		    !(ke && strcmp(ke, "0") == 0))
			fail_msg("dense case %d: the backward did not read L from its forward on sm_90",
			         dense_cases[i]);
		kl__trace_free(tr);
		for (int t = 0; t < 4; t++)
			kl_release(in[t]);
	}
	const char *modes[3] = {"wgmma", "fused", "split"};
	for (int m = 0; m < 3; m++) {
		setenv("KILN_CUDA_ATTN_BWD", modes[m], 1);
		int b = run_cases(ctx, dts, 2, true);
		if (b)
			print_message("test_attention_bwd: %d %s-mode failures\n", b, modes[m]);
		bad += b;
	}
	unsetenv("KILN_CUDA_ATTN_BWD");
	kl_ctx_free(ctx);
	assert_int_equal(bad, 0);
#else
	skip();
#endif
}

/* on a GPU: forward and backward compiled, bf16: B4 H16 T1024 D128 (the CUDA
 * bench row attention_bwd, `kiln bench --device cuda --workload
 * attention_bwd,attention_bwd_causal`, whose H200 figures before the fused
 * backward were 2.44 ms, causal 2.43, against PyTorch's 0.333 and 0.390) and
 * B4 H16 T2048 D64; wall clock of a call and its wait, best of 20, in each
 * mode of the backward (the default; KILN_CUDA_ATTN_BWD=wgmma, fused and
 * split) */
static void test_cuda_bwd_bench(void **state)
{
	(void)state;
#ifdef KILN_HAVE_CUDA
	kl_ctx *ctx = gpu_ctx();
	if (!ctx)
		skip();
	const char *modes[4] = {"default", "wgmma", "fused", "split"};
	for (int run = 0; run < 16; run++) {
		int causal = run & 1;
		const char *mode = modes[run >> 2];
		if (run >> 2)
			setenv("KILN_CUDA_ATTN_BWD", mode, 1);
		else
			unsetenv("KILN_CUDA_ATTN_BWD");
		int64_t seq = (run & 2) ? 2048 : 1024, hd = (run & 2) ? 64 : 128;
		bcase c = {2, 4, 16, seq, seq, hd, causal != 0};
		kl_tensor *in[4];
		inputs(ctx, &c, KL_BF16, 9, in);
		for (int t = 0; t < 3; t++)
			assert_int_equal(kl_set_requires_grad(in[t], true), KL_OK);
		sdpa_p p = {c.causal, 1.0 / sqrt((double)hd)};
		kl_fn *f = kl_compile(ctx, body, &p, 4, 3, NULL);
		assert_non_null(f);
		kl_tensor *out[3] = {NULL, NULL, NULL};
		double best = 1e30;
		for (int it = 0; it < 20; it++) {
			struct timespec a, b;
			clock_gettime(CLOCK_MONOTONIC, &a);
			assert_int_equal(kl_fn_call(f, in, out), KL_OK);
			assert_int_equal(kl__cuda_sync(ctx, kl__cuda_dev_of(ctx)), KL_OK);
			clock_gettime(CLOCK_MONOTONIC, &b);
			double ms = (double)(b.tv_sec - a.tv_sec) * 1e3 + (double)(b.tv_nsec - a.tv_nsec) / 1e6;
			best = ms < best ? ms : best;
			for (int t = 0; t < 3; t++) {
				kl_release(out[t]);
				out[t] = NULL;
				kl_grad_clear(in[t]);
			}
		}
		print_message("test_attention_bwd: B4 H16 T%lld D%lld bf16%s forward + backward "
		              "(%s): %.3f ms (best of 20)\n",
		              (long long)seq, (long long)hd, c.causal ? " causal" : "", mode, best);
		kl_fn_free(f);
		for (int t = 0; t < 4; t++)
			kl_release(in[t]);
	}
	unsetenv("KILN_CUDA_ATTN_BWD");
	kl_ctx_free(ctx);
#else
	skip();
#endif
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_bwd_plan),         cmocka_unit_test(test_bwd_lse_source),         cmocka_unit_test(test_bwd_cpu),
	        cmocka_unit_test(test_bwd_dynamic),      cmocka_unit_test(test_qkv_grad),
	        cmocka_unit_test(test_qkv_dynamic),      cmocka_unit_test(test_qkv_plan_io),
	        cmocka_unit_test(test_cuda_bwd_compile), cmocka_unit_test(test_cuda_bwd),
	        cmocka_unit_test(test_cuda_bwd_bench),
	};
	/* KILN_TEST_FILTER: one test (ctest's test_attention_bwd_qkv_cuda) */
	const char *filter = getenv("KILN_TEST_FILTER");
	if (filter && *filter)
		cmocka_set_test_filter(filter);
	return cmocka_run_group_tests(tests, NULL, NULL);
}
