/* test_schedule.c - scheduler decisions on whole graphs. A kernel that would
 * store more values than a step may write is split, not left depending on a
 * dead kernel (the one-token DecoderLayer lowered for CUDA, whose skinny
 * products are generated row reductions, and the smallest graph with the
 * same shape of problem), each lowered for the C and the CUDA targets (no
 * GPU needed; with KILN_HAVE_CUDA and NVRTC the CUDA source is compiled for
 * sm_90) and run on the CPU against the float64 reference. Products that
 * read one x with adjacent slices of one weight buffer as one product (the
 * SwiGLU FeedForward's gate and up), and the cases that stay apart.
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
#include <unistd.h>

#include <cmocka.h>

#include "capture/trace.h"
#include "core/core.h"
#include "graph/graph.h"
#include "kiln_nn.h"
#include "kltest.h"
#include "lower/lower.h"
#include "runtime/runtime_int.h"
#include "runtime/compiled.h"

#ifdef KILN_HAVE_CUDA
#include "backend/cuda/device.h"
#endif

static kl_ctx *ctx;

typedef struct counts {
	int kernels, matmuls, attention;
} counts;

static counts count_steps(const kl_program *P)
{
	counts c = {0, 0, 0};
	for (int32_t s = 0; s < P->nsteps; s++) {
		c.kernels += P->steps[s].kind == KL_STEP_KERNEL;
		c.matmuls += P->steps[s].kind == KL_STEP_MATMUL;
		c.attention += P->steps[s].kind == KL_STEP_ATTENTION;
	}
	return c;
}

/* apply's graph on in[] (p: its parameters), traced; fails the test,
 * naming what, when tracing does */
static kl_trace *trace_apply(const char *what, kltest_apply_fn apply, const void *p,
                             kl_tensor *const *in)
{
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *y = apply(in, p);
	kl_trace *tr = kl__trace_end(ctx, 1, &y);
	kl_scope_end(ctx);
	if (!tr)
		fail_msg("%s: trace: %s", what, kl_last_error(ctx));
	return tr;
}

/* Trace apply on in[], lower it for target t with fusion; the program's
 * step counts must be want's and its log must hold each of logs[]
 * (NULL-terminated). Returns the program's source (malloc'd) for NVRTC. */
static char *lower_expect(const char *what, kltest_apply_fn apply, const void *p, int nin,
                          kl_tensor *const *in, kl_target t, counts want, const char *const *logs)
{
	kl_trace *tr = trace_apply(what, apply, p, in);
	(void)nin;
	kl_lower_opts o = {.target = t, .fusion = true};
	kl_program P;
	char err[512];
	kl_status st = kl__lower(&tr->g, &o, &P, err, sizeof err);
	const char *tn = t == KL_TARGET_CUDA ? "CUDA" : "C";
	if (st != KL_OK)
		fail_msg("%s (%s target): lowering failed: %s", what, tn, err);
	if (kl__program_validate(&P, tr->g.ninputs, tr->g.noutputs, err, sizeof err) != KL_OK)
		fail_msg("%s (%s target): invalid program: %s", what, tn, err);
	counts c = count_steps(&P);
	if (c.kernels != want.kernels || c.matmuls != want.matmuls ||
	    c.attention != want.attention) {
		fprintf(stderr, "%s\n", P.fusion_log ? P.fusion_log : "(no log)");
		fail_msg("%s (%s target): %d kernels, %d products, %d attention steps; want %d, "
		         "%d, %d", what, tn, c.kernels, c.matmuls, c.attention, want.kernels,
		         want.matmuls, want.attention);
	}
	for (int i = 0; logs && logs[i]; i++)
		if (!P.fusion_log || !strstr(P.fusion_log, logs[i])) {
			fprintf(stderr, "%s\n", P.fusion_log ? P.fusion_log : "(no log)");
			fail_msg("%s (%s target): the fusion log lacks \"%s\"", what, tn, logs[i]);
		}
	/* every op of a split kernel in a kernel of its own would be the old,
	 * slow way out */
	if (P.fusion_log && strstr(P.fusion_log, "every op becomes a kernel of its own"))
		fail_msg("%s (%s target): a kernel was split into single ops", what, tn);
	char *src = strdup(P.source);
	assert_non_null(src);
	kl__program_free(&P);
	kl__trace_free(tr);
	return src;
}

/* the CUDA source compiles for sm_90 (when NVRTC loads here) */
static void nvrtc_compiles(const char *what, char *src)
{
#ifdef KILN_HAVE_CUDA
	kl_ctx *c = kl_ctx_new(NULL);
	assert_non_null(c);
	if (kl__cuda_load_nvrtc(c) != KL_OK) {
		print_message("test_schedule: %s: NVRTC not loadable, CUDA source not compiled: %s\n",
		              what, kl_last_error(c));
	} else {
		kl_cuda_image im;
		kl_nvrtc_opts no = {.arch = 90};
		if (kl__nvrtc_compile(c, src, "test_schedule", &no, &im) != KL_OK) {
			fprintf(stderr, "%s\n---- log\n%s\n", src, im.log ? im.log : "");
			fail_msg("%s: NVRTC: %s", what, kl_last_error(c));
		}
		assert_memory_equal(im.data, "\177ELF", 4);
		kl__cuda_image_free(&im);
	}
	kl_ctx_free(c);
#else
	(void)what;
#endif
	free(src);
}

/* ---- running on the CPU against the reference ---------------------------------------- */

typedef struct run_arg {
	kltest_apply_fn apply;
	const void *p;
} run_arg;

static kl_status run_body(kl_ctx *c, kl_tensor *const *in, int nin, kl_tensor **out, int nout,
                          void *user)
{
	(void)nin;
	(void)nout;
	const run_arg *a = user;
	out[0] = a->apply(in, a->p);
	return out[0] ? KL_OK : kl_last_status(c);
}

/* kl_compile apply (CPU), call it twice on in[] (NaN-filled blocks of the
 * output's size freed before each call, so that an output the program does
 * not write reads back NaN where the allocator reuses them) and compare with
 * the float64 reference of the same graph */
static void run_vs_reference(const char *what, kltest_apply_fn apply, const void *p, int nin,
                             kl_tensor *const *in, double factor)
{
	int nd;
	int64_t shape[KL_MAX_DIMS];
	kl_dtype dt;
	double *ref = kltest_reference(ctx, what, apply, in, p, &nd, shape, &dt);
	assert_non_null(ref);
	run_arg a = {apply, p};
	kl_fn *f = kl_compile(ctx, run_body, &a, nin, 1, NULL);
	assert_non_null(f);
	for (int call = 0; call < 2; call++) {
		kl_tensor *poison = kl_full(ctx, dt, nd, shape, NAN);
		assert_non_null(poison);
		kl_release(poison);
		kl_tensor *out = NULL;
		if (kl_fn_call(f, in, &out) != KL_OK)
			fail_msg("%s: call %d: %s", what, call, kl_last_error(ctx));
		assert_int_equal(kl_tensor_dtype(out), dt);
		double *got = kltest_read(out);
		assert_non_null(got);
		char w[160];
		snprintf(w, sizeof w, "%s (compiled on the CPU, call %d)", what, call);
		bool ok = kltest_compare(w, dt, nd, shape, got, ref, factor);
		free(got);
		kl_release(out);
		if (!ok)
			fail_msg("%s differs from the reference", w);
	}
	kl_fn_free(f);
	free(ref);
}

/* ---- the smallest graph of the pattern ------------------------------------------------- */

/* s = sum(x, 1); a = s + 1; b = 2a; c = b * b are one kernel (a row
 * reduction and its row chain). sum(c, 0) iterates another space and reads
 * c; b * t and a + b * t run in that kernel and read b and a: the first
 * kernel would store three values. The last of its chain (c) becomes a
 * kernel of its own, which the second kernel then recomputes: two kernels.
 * Before, every op of the first kernel became a kernel of its own, with
 * store marks of the round before: s and a, read by no one then, were
 * dropped while b still read a, and lowering failed with "kernels depend on
 * each other". */
static kl_tensor *ap_split(kl_tensor *const *in, const void *p)
{
	(void)p;
	kl_tensor *s = kl_sum(in[0], 1, (int[]){1}, false);
	kl_tensor *a = kl_add_scalar(s, 1);
	kl_tensor *b = kl_mul_scalar(a, 2);
	kl_tensor *c = kl_mul(b, b);
	kl_tensor *t = kl_sum(c, 1, (int[]){0}, true);
	return kl_add(a, kl_mul(b, t));
}

static void test_split_minimal(void **state)
{
	(void)state;
	static const char *const logs[] = {
	        "split the kernel of sum#1: it would store 3 values (at most 2); mul#4 becomes a "
	        "kernel of its own",
	        "the kernel of sum#5 recomputes mul#4", NULL};
	static const kl_dtype dts[] = {KL_F32, KL_BF16};
	for (int di = 0; di < 2; di++) {
		kl_dtype dt = dts[di];
		kl_tensor *x = kltest_rand(ctx, dt, 2, (int64_t[]){8, 64}, KLTEST_NORMAL,
		                           KLTEST_CONTIG, 11 + (uint64_t)di);
		assert_non_null(x);
		char w[96];
		snprintf(w, sizeof w, "split pattern %s", kl_dtype_name(dt));
		free(lower_expect(w, ap_split, NULL, 1, &x, KL_TARGET_C, (counts){2, 0, 0},
		                  dt == KL_F32 ? logs : NULL));
		nvrtc_compiles(w, lower_expect(w, ap_split, NULL, 1, &x, KL_TARGET_CUDA,
		                               (counts){2, 0, 0}, dt == KL_F32 ? logs : NULL));
		run_vs_reference(w, ap_split, NULL, 1, &x, 8);
		kl_release(x);
	}
}

/* ---- the one-token DecoderLayer ------------------------------------------------------ */

static kl_tensor *ap_decoder(kl_tensor *const *in, const void *p)
{
	return kl_nn_decoder_forward(p, in[0], true);
}

/* DecoderLayer(d_model 2048, 16 heads, ffn 8192, bf16) on one token: for
 * CUDA every product is skinny (a generated row reduction). The out
 * projection's kernel (its reduction, bias, the residual x + h, then
 * rms_norm's cast and x * x) would store three values: x + h (read by the
 * FFN's residual), the cast and its square (read by rms_norm's sum and
 * scale, which cannot recompute them past the reduction). x * x becomes a
 * kernel of its own and rms_norm's kernel recomputes it. */
static void test_decoder_one_token(void **state)
{
	(void)state;
	static const char *const logs[] = {
	        /* every product reads its bf16 x and widens it itself: the norms
	         * store one bf16 vector, not an f32 copy per product */
	        "mul#6(matmul) widens cast#6(matmul) itself: it reads the narrower value",
	        "mul#24(matmul) widens cast#24(matmul) itself: it reads the narrower value",
	        "mul#34(matmul) widens cast#34(matmul) itself: it reads the narrower value",
	        "mul#38(matmul) widens cast#38(matmul) itself: it reads the narrower value",
	        "mul#44(matmul) widens cast#44(matmul) itself: it reads the narrower value",
	        /* the FFN's gate and up stay two reductions (in one kernel) */
	        "a skinny product is a generated row reduction on CUDA", NULL};
	kl_nn_decoder d;
	assert_int_equal(kl_nn_decoder_init(&d, ctx, 2048, 16, 8192, KL_BF16, 3), KL_OK);
	kl_tensor *x = kltest_rand(ctx, KL_BF16, 3, (int64_t[]){1, 1, 2048}, KLTEST_NORMAL,
	                           KLTEST_CONTIG, 21);
	assert_non_null(x);
	/* CUDA: rms_norm + in-projection, out-projection + residual + norm, the
	 * gate and up reductions with silu * up, the down reduction + residual,
	 * and the attention step; no library product */
	nvrtc_compiles("one-token DecoderLayer",
	               lower_expect("one-token DecoderLayer", ap_decoder, &d, 1, &x,
	                            KL_TARGET_CUDA, (counts){6, 0, 1}, logs));
	/* the C target: library products, the FFN's gate and up as one, the
	 * out-projection's and the down projection's residuals in their
	 * epilogues (bf16 products run in f32 copies, epilogue included) */
	static const char *const clogs[] = {"into one product of 16384 columns", NULL};
	free(lower_expect("one-token DecoderLayer", ap_decoder, &d, 1, &x, KL_TARGET_C,
	                  (counts){3, 4, 1}, clogs));
	run_vs_reference("one-token DecoderLayer bf16", ap_decoder, &d, 1, &x, 8);
	kl_release(x);
	kl_nn_free(&d.base);
}

/* ---- products sharing x whose weights are adjacent: one product ------------------------ */

static kl_tensor *ap_ffn(kl_tensor *const *in, const void *p)
{
	return kl_nn_ffn_forward(p, in[0]);
}

/* The SwiGLU FeedForward slices gate_up in its forward: gate and up are one
 * product of 2 * ffn columns (then silu * up, then down): 2 products and a
 * kernel instead of 3 and a kernel, on both targets; the values those of the
 * float64 reference. */
static void test_merge_ffn(void **state)
{
	(void)state;
	static const char *const logs[] = {
	        "merged matmul#9, matmul#5 (all read input#4) into one product of 160 columns: "
	        "their weights are adjacent rows [0, 160) of input#0",
	        NULL};
	static const kl_dtype dts[] = {KL_F32, KL_BF16};
	for (int di = 0; di < 2; di++) {
		kl_dtype dt = dts[di];
		kl_nn_ffn f;
		assert_int_equal(kl_nn_ffn_init(&f, ctx, 32, 80, dt, 7 + (uint64_t)di), KL_OK);
		kl_tensor *x = kltest_rand(ctx, dt, 3, (int64_t[]){2, 5, 32}, KLTEST_NORMAL,
		                           KLTEST_CONTIG, 31 + (uint64_t)di);
		assert_non_null(x);
		char w[96];
		snprintf(w, sizeof w, "FeedForward %s", kl_dtype_name(dt));
		free(lower_expect(w, ap_ffn, &f, 1, &x, KL_TARGET_C, (counts){1, 2, 0}, logs));
		nvrtc_compiles(w, lower_expect(w, ap_ffn, &f, 1, &x, KL_TARGET_CUDA,
		                               (counts){1, 2, 0}, logs));
		run_vs_reference(w, ap_ffn, &f, 1, &x, 8);
		/* eagerly too (two products of views, no copy) */
		if (!kltest_check_op(ctx, w, ap_ffn, 1, &x, &f, 8))
			fail_msg("%s: eager forward differs from the reference", w);
		kl_release(x);
		kl_nn_free(&f.base);
	}
}

/* gate and up from one buffer W of 2f + gap rows (up starts gap rows after
 * gate ends), or (gap < 0) from two buffers */
typedef struct gapped {
	kl_tensor *w, *w2, *wd;
	int64_t f, gap;
} gapped;

static kl_tensor *ap_gapped(kl_tensor *const *in, const void *p)
{
	const gapped *g = p;
	int64_t f = g->f, s = g->gap < 0 ? 0 : f + g->gap;
	kl_tensor *wu = kl_slice(g->gap < 0 ? g->w2 : g->w, 0, s, s + f, 1);
	kl_tensor *a = kl_mul(kl_silu(kl_linear(in[0], kl_slice(g->w, 0, 0, f, 1), NULL)),
	                      kl_linear(in[0], wu, NULL));
	return kl_linear(a, g->wd, NULL);
}

/* ---- the attention step writing a permuted layout ------------------------------------- */

/* out = transpose(sdpa(q, k, v), 1, 2), made dense, [b, t, h*d], times w:
 * the attention step writes [b, t, h, d] itself; no copy kernel */
static kl_tensor *ap_attn_proj(kl_tensor *const *in, const void *p)
{
	(void)p;
	kl_tensor *o = kl_sdpa(in[0], in[1], in[2], true, 0.125);
	kl_tensor *y = kl_reshape(kl_contiguous(kl_transpose(o, 1, 2)), 3, (int64_t[]){2, 16, 128});
	return kl_matmul(y, in[3]);
}

/* the same copy, but the attention's output is read a second time */
static kl_tensor *ap_attn_twice(kl_tensor *const *in, const void *p)
{
	(void)p;
	kl_tensor *o = kl_sdpa(in[0], in[1], in[2], false, 0.125);
	kl_tensor *t = kl_contiguous(kl_transpose(o, 1, 2));
	return kl_add(t, kl_mul_scalar(kl_transpose(o, 1, 2), 2));
}

/* the projection's copy, and a sum over the attention's output besides */
static kl_tensor *ap_attn_proj_sum(kl_tensor *const *in, const void *p)
{
	(void)p;
	kl_tensor *o = kl_sdpa(in[0], in[1], in[2], true, 0.125);
	kl_tensor *y = kl_reshape(kl_contiguous(kl_transpose(o, 1, 2)), 3, (int64_t[]){2, 16, 128});
	return kl_add(kl_matmul(y, in[3]), kl_sum(o, 4, (int[]){0, 1, 2, 3}, false));
}

static void test_attention_layout(void **state)
{
	(void)state;
	kl_tensor *in[4];
	for (int i = 0; i < 3; i++)
		in[i] = kltest_rand(ctx, KL_F32, 4, (int64_t[]){2, 4, 16, 32}, KLTEST_NORMAL,
		                    KLTEST_CONTIG, 40 + i);
	in[3] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){128, 64}, KLTEST_NORMAL, KLTEST_CONTIG, 44);
	for (int i = 0; i < 4; i++)
		assert_non_null(in[i]);
	static const char *const logs[] = {"writes its output in the layout of", NULL};
	free(lower_expect("attention then projection", ap_attn_proj, NULL, 4, in, KL_TARGET_C,
	                  (counts){0, 1, 1}, logs));
	free(lower_expect("attention then projection", ap_attn_proj, NULL, 4, in,
	                  KL_TARGET_CUDA, (counts){0, 1, 1}, logs));
	run_vs_reference("attention then projection", ap_attn_proj, NULL, 4, in, 8);
	/* read twice, the output stays the attention's own, and the kernel reading
	 * it does the transposes */
	static const char *const twice[] = {"the attention step takes no epilogue", NULL};
	free(lower_expect("attention read twice", ap_attn_twice, NULL, 3, in, KL_TARGET_C,
	                  (counts){1, 0, 1}, twice));
	run_vs_reference("attention read twice", ap_attn_twice, NULL, 3, in, 8);
	/* read again after the copy (a sum; in training, the backward and the
	 * weight gradient): the later reader reads the copy's buffer through a
	 * view, so the attention still writes the projection's layout */
	free(lower_expect("attention, projected and summed", ap_attn_proj_sum, NULL, 4, in,
	                  KL_TARGET_C, (counts){2, 1, 1}, logs));
	free(lower_expect("attention, projected and summed", ap_attn_proj_sum, NULL, 4, in,
	                  KL_TARGET_CUDA, (counts){2, 1, 1}, logs));
	run_vs_reference("attention, projected and summed", ap_attn_proj_sum, NULL, 4, in, 8);
	for (int i = 0; i < 4; i++)
		kl_release(in[i]);
}

/* Weights that are not adjacent rows of one buffer stay two products, and
 * the log says why; the values are still the reference's. */
/* ---- a slice that is one part of a concatenation ---------------------------------- */

/* a packed parameter's gradient is the concatenation of its blocks', sliced
 * back into the blocks for the optimizer: each block is read where its
 * product wrote it. in[0..9]: ten [8, 16] rows, in[10]: [16, 16]; p: the
 * slice's [start, stop) over the rows of the 10 products' concatenation
 * (ten parts: a chain of two concatenations) */
static kl_tensor *ap_slice_concat(kl_tensor *const *in, const void *p)
{
	const int64_t *r = p;
	kl_tensor *parts[10];
	for (int i = 0; i < 10; i++)
		parts[i] = kl_matmul(in[i], in[10]);
	return kl_slice(kl_concat(10, parts, 0), 0, r[0], r[1], 1);
}

static void test_slice_of_concat(void **state)
{
	(void)state;
	kl_tensor *in[11];
	for (int i = 0; i < 11; i++)
		assert_non_null(in[i] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){i < 10 ? 8 : 16, 16},
		                                    KLTEST_NORMAL, KLTEST_CONTIG, 60 + (uint64_t)i));
	static const struct {
		int64_t r[2];
		counts want;
	} cases[] = {
	        {{8, 16}, {0, 1, 0}},  /* the second part: its product is the output */
	        {{72, 80}, {0, 1, 0}}, /* the tenth: in the chain's second concatenation */
	        /* across two parts: the concatenation is made (two kernels: the
	         * chain's two links) and the rows copied out of it */
	        {{4, 12}, {2, 10, 0}},
	};
	for (int c = 0; c < 3; c++) {
		char w[64];
		snprintf(w, sizeof w, "rows [%lld, %lld) of ten products", (long long)cases[c].r[0],
		         (long long)cases[c].r[1]);
		free(lower_expect(w, ap_slice_concat, cases[c].r, 11, in, KL_TARGET_C, cases[c].want,
		                  NULL));
		free(lower_expect(w, ap_slice_concat, cases[c].r, 11, in, KL_TARGET_CUDA,
		                  cases[c].want, NULL));
		run_vs_reference(w, ap_slice_concat, cases[c].r, 11, in, 8);
	}
	for (int i = 0; i < 11; i++)
		kl_release(in[i]);
}

/* ---- kernels written in place ---------------------------------------------------- */

/* u = sigmoid(t) + t (p: t transposed in the sum), t = x w: u's kernel
 * reads the product's temp only at the element it stores, and the product
 * after it is t's last reader: u may take t's memory */
static kl_tensor *ap_inplace(kl_tensor *const *in, const void *p)
{
	const bool *tr = p;
	kl_tensor *t = kl_matmul(in[0], in[1]);
	kl_tensor *u = kl_add(kl_sigmoid(t), *tr ? kl_transpose(t, 0, 1) : t);
	return kl_matmul(u, in[2]);
}

static int inplace_steps(const char *what, const bool *tr, kl_tensor *const *in, kl_target t)
{
	kl_trace *trc = trace_apply(what, ap_inplace, tr, in);
	kl_lower_opts o = {.target = t, .fusion = true};
	kl_program P;
	char err[512];
	if (kl__lower(&trc->g, &o, &P, err, sizeof err) != KL_OK)
		fail_msg("%s: lowering failed: %s", what, err);
	int n = 0;
	for (int32_t s = 0; s < P.nsteps; s++)
		if (P.steps[s].inplace) {
			n++;
			/* the two are one memory: neither pointer is restrict (render.c) */
			char decl[64];
			snprintf(decl, sizeof decl, "\tfloat *b%d = (float *)%s[%d];", P.steps[s].reads[0],
			         t == KL_TARGET_CUDA ? "A.b" : "B", P.steps[s].reads[0]);
			if (!strstr(P.source, decl))
				fail_msg("%s: the kernel written in place declares its input otherwise "
				         "(no \"%s\")", what, decl + 1);
			/* reads[0] is the temp it may write over, of the stored dtype and shape */
			const kl_buf *r = &P.bufs[P.steps[s].reads[0]], *w = &P.bufs[P.steps[s].writes[0]];
			assert_int_equal(r->role, KL_BUF_TEMP);
			assert_int_equal(w->role, KL_BUF_TEMP);
			assert_int_equal(r->dtype, w->dtype);
		}
	/* the program with it survives its bytes */
	uint8_t *bytes = NULL;
	size_t len = 0;
	assert_int_equal(kl__program_serialize(&P, &bytes, &len), KL_OK);
	kl_program Q;
	if (kl__program_deserialize(bytes, len, &Q, err, sizeof err) != KL_OK)
		fail_msg("%s: the program does not read back: %s", what, err);
	for (int32_t s = 0; s < P.nsteps; s++)
		assert_int_equal(Q.steps[s].inplace, P.steps[s].inplace);
	kl__program_free(&Q);
	free(bytes);
	if (t == KL_TARGET_CUDA) {
		nvrtc_compiles(what, strdup(P.source));
	}
	kl__program_free(&P);
	kl__trace_free(trc);
	return n;
}

static void test_inplace(void **state)
{
	(void)state;
	kl_tensor *in[3];
	for (int i = 0; i < 3; i++)
		assert_non_null(in[i] = kltest_rand(ctx, KL_F32, 2, (int64_t[]){16, 16},
		                                    KLTEST_NORMAL, KLTEST_CONTIG, 90 + (uint64_t)i));
	static const bool straight = false, transposed = true;
	assert_int_equal(inplace_steps("in place", &straight, in, KL_TARGET_C), 1);
	assert_int_equal(inplace_steps("in place", &straight, in, KL_TARGET_CUDA), 1);
	/* t read at another element than the one stored: never in place */
	assert_int_equal(inplace_steps("transposed", &transposed, in, KL_TARGET_C), 0);
	assert_int_equal(inplace_steps("transposed", &transposed, in, KL_TARGET_CUDA), 0);
	run_vs_reference("in place", ap_inplace, &straight, 3, in, 8);
	run_vs_reference("transposed", ap_inplace, &transposed, 3, in, 8);
	for (int i = 0; i < 3; i++)
		kl_release(in[i]);
}

static void test_merge_refused(void **state)
{
	(void)state;
	int64_t f = 48, d = 32;
	static const char *const gap_log[] = {
	        "their weights are not adjacent in input#0 (rows [0, 48), then [49, 97))", NULL};
	static const char *const two_log[] = {
	        "their weights are slices of different buffers", NULL};
	for (int two = 0; two < 2; two++) {
		gapped g = {.f = f, .gap = two ? -1 : 1};
		g.w = kltest_rand(ctx, KL_F32, 2, (int64_t[]){2 * f + 1, d}, KLTEST_NORMAL,
		                  KLTEST_CONTIG, 41);
		g.w2 = kltest_rand(ctx, KL_F32, 2, (int64_t[]){f, d}, KLTEST_NORMAL, KLTEST_CONTIG,
		                   42);
		g.wd = kltest_rand(ctx, KL_F32, 2, (int64_t[]){d, f}, KLTEST_NORMAL, KLTEST_CONTIG,
		                   43);
		kl_tensor *x = kltest_rand(ctx, KL_F32, 3, (int64_t[]){2, 5, d}, KLTEST_NORMAL,
		                           KLTEST_CONTIG, 44);
		assert_true(g.w && g.w2 && g.wd && x);
		const char *w = two ? "gate and up in two buffers" : "gate and up a row apart";
		free(lower_expect(w, ap_gapped, &g, 1, &x, KL_TARGET_C, (counts){1, 3, 0},
		                  two ? two_log : gap_log));
		free(lower_expect(w, ap_gapped, &g, 1, &x, KL_TARGET_CUDA, (counts){1, 3, 0},
		                  two ? two_log : gap_log));
		run_vs_reference(w, ap_gapped, &g, 1, &x, 8);
		kl_release(x);
		kl_release(g.w);
		kl_release(g.w2);
		kl_release(g.wd);
	}
}

/* The FeedForward's parameters are views of gate_up: kl_nn_save writes each
 * key with its own values, kl_nn_load writes each key into its half. */
static void test_ffn_one_buffer(void **state)
{
	(void)state;
	kl_nn_ffn a, b;
	assert_int_equal(kl_nn_ffn_init(&a, ctx, 16, 24, KL_F32, 1), KL_OK);
	assert_int_equal(kl_nn_ffn_init(&b, ctx, 16, 24, KL_F32, 2), KL_OK);
	char dir[] = "/tmp/kiln-test-schedule-XXXXXX";
	assert_non_null(mkdtemp(dir));
	char path[256];
	snprintf(path, sizeof path, "%s/ffn.safetensors", dir);
	assert_int_equal(kl_nn_save(&a.base, path, "ffn."), KL_OK);
	kl_safetensors *st = kl_safetensors_open(ctx, path);
	assert_non_null(st);
	assert_int_equal(kl_safetensors_count(st), 3);
	const char *keys[2] = {"ffn.gate_proj.weight", "ffn.up_proj.weight"};
	kl_tensor *mine[2] = {a.gate_proj.weight, a.up_proj.weight};
	for (int i = 0; i < 2; i++) {
		kl_tensor *t = kl_safetensors_get(st, keys[i]);
		assert_non_null(t);
		double *got = kltest_read(t), *want = kltest_read(mine[i]);
		assert_true(got && want);
		if (!kltest_compare(keys[i], KL_F32, 2, (int64_t[]){24, 16}, got, want, 0))
			fail_msg("%s: the saved values are not the parameter's", keys[i]);
		free(got);
		free(want);
		kl_release(t);
	}
	assert_int_equal(kl_nn_load(&b.base, st, "ffn."), KL_OK);
	kl_safetensors_close(st);
	/* b's buffer now holds a's gate rows, then a's up rows */
	double *ga = kltest_read(a.gate_up), *gb = kltest_read(b.gate_up);
	double *vb = kltest_read(b.up_proj.weight), *va = kltest_read(a.up_proj.weight);
	assert_true(ga && gb && vb && va);
	if (!kltest_compare("loaded gate_up", KL_F32, 2, (int64_t[]){48, 16}, gb, ga, 0) ||
	    !kltest_compare("loaded up_proj.weight", KL_F32, 2, (int64_t[]){24, 16}, vb, va, 0))
		fail_msg("kl_nn_load did not write each key into its half of gate_up");
	free(ga);
	free(gb);
	free(va);
	free(vb);
	kl_tensor *x = kltest_rand(ctx, KL_F32, 2, (int64_t[]){3, 16}, KLTEST_NORMAL,
	                           KLTEST_CONTIG, 5);
	kl_tensor *ya = kl_nn_ffn_forward(&a, x), *yb = kl_nn_ffn_forward(&b, x);
	double *pa = kltest_read(ya), *pb = kltest_read(yb);
	assert_true(pa && pb);
	if (!kltest_compare("loaded FeedForward", KL_F32, 2, (int64_t[]){3, 16}, pb, pa, 0))
		fail_msg("the loaded FeedForward computes another function");
	free(pa);
	free(pb);
	kl_release(ya);
	kl_release(yb);
	kl_release(x);
	remove(path);
	rmdir(dir);
	kl_nn_free(&a.base);
	kl_nn_free(&b.base);
}

/* A disk cache of this process's own: its key does not cover the compiler's
 * own code, and a plan another build left would hide what this one does. */
/* ---- row grids: the rows a block takes, recorded for the launcher ----------------------- */

static kl_tensor *ap_layer_norm(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_layer_norm(in[0], in[1], in[2], 1e-5);
}

static kl_tensor *ap_rms_norm(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_rms_norm(in[0], in[1], 1e-6);
}

static kl_tensor *ap_skinny(kl_tensor *const *in, const void *p)
{
	(void)p;
	return kl_gelu(kl_linear(in[0], in[1], in[2]));
}

/* the "N rows a block" of the first row loop of kernel name in src (0: none) */
static int32_t source_rows_a_block(const char *src, const char *name)
{
	char sig[64];
	snprintf(sig, sizeof sig, " %s(const kl_args A)", name);
	const char *k = strstr(src, sig);
	if (!k)
		return -1;
	const char *next = strstr(k + 1, "__global__");
	const char *g = strstr(k, "/* row group");
	if (!g || (next && g > next))
		return 0;
	const char *t = strstr(g, " threads, ");
	return t ? (int32_t)atoi(t + strlen(" threads, ")) : -1;
}

/* Lower apply for the CUDA target with dyn (dynamic dims of input 0) and
 * check each kernel step's row grid against its source: row_per is the
 * rows a block of its first row loop, 0 for a pointwise kernel; rowdims
 * multiply to rows (at trace time) and carry a symbol where the rows are
 * dynamic; a row kernel records want_waves waves, a pointwise one none.
 * The C target records none. Returns the row kernels seen. */
static int check_row_grid(const char *what, kltest_apply_fn apply, kl_tensor *const *in,
                          uint32_t dyn, int64_t rows, int32_t want_per, int32_t want_waves)
{
	kl_trace *tr = trace_apply(what, apply, NULL, in);
	uint32_t masks[8] = {dyn};
	int nrow = 0;
	for (int t = 0; t < 2; t++) {
		kl_lower_opts o = {.target = t ? KL_TARGET_C : KL_TARGET_CUDA, .fusion = true,
		                   .dyn_masks = masks};
		kl_program P;
		char err[512];
		if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
			fail_msg("%s: lowering failed: %s", what, err);
		for (int32_t s = 0; s < P.nsteps; s++) {
			const kl_step *sp = &P.steps[s];
			if (sp->kind != KL_STEP_KERNEL)
				continue;
			if (t) {
				if (sp->row_per != 0 || sp->nrowdims != 0 || sp->waves != 0)
					fail_msg("%s: C kernel %d records a row grid", what, (int)s);
				continue;
			}
			int32_t per = source_rows_a_block(P.source, P.kernel_names[sp->kernel]);
			if (sp->row_per != per)
				fail_msg("%s: step %d records %d rows a block, its source %d", what,
				         (int)s, sp->row_per, per);
			if (per == 0) {
				if (sp->waves != 0)
					fail_msg("%s: pointwise step %d records %d waves", what, (int)s,
					         sp->waves);
				continue;
			}
			nrow++;
			if (sp->waves != want_waves)
				fail_msg("%s: step %d: %d waves, want %d", what, (int)s, sp->waves,
				         want_waves);
			int64_t n = 1;
			bool sym = false;
			for (int32_t d = 0; d < sp->nrowdims; d++) {
				n *= sp->rowdims[d].v;
				sym |= sp->rowdims[d].sym != 0;
			}
			if (n != rows || sym != (dyn != 0))
				fail_msg("%s: step %d: rows %lld%s, want %lld%s", what, (int)s,
				         (long long)n, sym ? " (dynamic)" : "", (long long)rows,
				         dyn ? " (dynamic)" : "");
			if (want_per && sp->row_per != want_per)
				fail_msg("%s: step %d: %d rows a block, want %d", what, (int)s,
				         sp->row_per, want_per);
		}
		kl__program_free(&P);
	}
	kl__trace_free(tr);
	return nrow;
}

static void bad_row_per(kl_program *q, int32_t s)
{
	q->steps[s].row_per = 5000;
}
static void bad_row_sym(kl_program *q, int32_t s)
{
	q->steps[s].rowdims[0].sym = q->nsyms + 1;
}
static void bad_row_dims(kl_program *q, int32_t s)
{
	q->steps[s].row_per = 0;
}
static void bad_row_waves(kl_program *q, int32_t s)
{
	q->steps[s].waves = 65;
}
static void bad_row_nowaves(kl_program *q, int32_t s)
{
	q->steps[s].waves = 0;
}

/* a layer norm's x [64, 4096], weight and bias of dtype dt */
static void norm_inputs(kl_dtype dt, uint64_t seed, kl_tensor *out[3])
{
	out[0] = kltest_rand(ctx, dt, 2, (int64_t[]){64, 4096}, KLTEST_NORMAL, KLTEST_CONTIG, seed);
	for (int i = 1; i < 3; i++)
		out[i] = kltest_rand(ctx, dt, 1, (int64_t[]){4096}, KLTEST_NORMAL, KLTEST_CONTIG,
		                     seed + (uint64_t)i);
}

/* a skinny linear's x [8, 256], weight [256, 256] and bias, bf16 */
static void skinny_inputs(uint64_t seed, kl_tensor *out[3])
{
	out[0] = kltest_rand(ctx, KL_BF16, 2, (int64_t[]){8, 256}, KLTEST_NORMAL, KLTEST_CONTIG, seed);
	out[1] = kltest_rand(ctx, KL_BF16, 2, (int64_t[]){256, 256}, KLTEST_NORMAL, KLTEST_CONTIG,
	                     seed + 1);
	out[2] = kltest_rand(ctx, KL_BF16, 1, (int64_t[]){256}, KLTEST_NORMAL, KLTEST_CONTIG, seed + 2);
}

/* Lower apply for the CUDA target: whether its source holds needle */
static bool cuda_source_has(kltest_apply_fn apply, kl_tensor *const *in, const char *needle)
{
	kl_trace *tr = trace_apply(needle, apply, NULL, in);
	kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true};
	kl_program P;
	char err[512];
	if (kl__lower(&tr->g, &o, &P, err, sizeof err) != KL_OK)
		fail_msg("lowering failed: %s", err);
	bool has = strstr(P.source, needle) != NULL;
	kl__program_free(&P);
	kl__trace_free(tr);
	return has;
}

/* A wide row (a block's 4096-wide bf16 norm or softmax row) asks for five
 * blocks an SM; a skinny product's dot rows for none; the knob, when set,
 * for every row kernel. */
static void test_wide_row_bounds(void **state)
{
	(void)state;
	kl_tensor *ln[3], *sk[3], *lf[3];
	norm_inputs(KL_BF16, 41, ln);
	skinny_inputs(44, sk);
	norm_inputs(KL_F32, 47, lf); /* f32 rows of 4096: 64 bytes a thread, not wide */
	const char *keep = getenv("KILN_CUDA_ROW_MINBLOCKS");
	char *saved = keep ? strdup(keep) : NULL;
	unsetenv("KILN_CUDA_ROW_MINBLOCKS");
	assert_true(cuda_source_has(ap_layer_norm, ln, "__launch_bounds__(256, 5)"));
	assert_false(cuda_source_has(ap_skinny, sk, "__launch_bounds__(256, "));
	assert_true(cuda_source_has(ap_skinny, sk, "__launch_bounds__(256)"));
	assert_false(cuda_source_has(ap_layer_norm, lf, "__launch_bounds__(256, "));
	assert_int_equal(setenv("KILN_CUDA_ROW_MINBLOCKS", "2", 1), 0);
	assert_true(cuda_source_has(ap_layer_norm, ln, "__launch_bounds__(256, 2)"));
	assert_true(cuda_source_has(ap_skinny, sk, "__launch_bounds__(256, 2)"));
	if (saved)
		setenv("KILN_CUDA_ROW_MINBLOCKS", saved, 1);
	else
		unsetenv("KILN_CUDA_ROW_MINBLOCKS");
	free(saved);
}

/* Norm rows of 4096 take a block each; a skinny product's short dot rows
 * several a block; the launcher needs rows / row_per blocks, no more. The
 * fields survive the program format and malformed ones are refused. */
static void test_row_grid(void **state)
{
	(void)state;
	kl_tensor *ln[3], *sk[3];
	norm_inputs(KL_BF16, 31, ln);
	/* wide rows: twelve waves; dot rows: one (render_cuda_rows.c, ROW_*WAVES) */
	assert_int_equal(check_row_grid("layer norm", ap_layer_norm, ln, 0, 64, 1, 12), 1);
	kl_tensor *rms[2] = {kltest_rand(ctx, KL_BF16, 3, (int64_t[]){2, 16, 4096}, KLTEST_NORMAL,
	                                 KLTEST_CONTIG, 34),
	                     ln[1]};
	assert_int_equal(check_row_grid("rms norm", ap_rms_norm, rms, 0, 32, 1, 12), 1);
	assert_int_equal(check_row_grid("rms norm, dynamic batch", ap_rms_norm, rms, 1u, 32, 1, 12),
	                 1);
	skinny_inputs(35, sk);
	/* 8 x 256 dot rows of 256: groups smaller than the block */
	assert_int_equal(check_row_grid("skinny linear + gelu", ap_skinny, sk, 0, 8 * 256, 0, 1), 1);

	/* the format: a round trip keeps the grid; bad grids are refused */
	kl_trace *tr = trace_apply("rms norm round trip", ap_rms_norm, NULL, rms);
	uint32_t masks[2] = {1u, 0};
	kl_lower_opts o = {.target = KL_TARGET_CUDA, .fusion = true, .dyn_masks = masks};
	kl_program P;
	assert_int_equal(kl__lower(&tr->g, &o, &P, NULL, 0), KL_OK);
	int32_t rs = -1;
	for (int32_t s = 0; s < P.nsteps; s++)
		if (P.steps[s].row_per > 0)
			rs = s;
	assert_true(rs >= 0);
	uint8_t *bytes;
	size_t len;
	assert_int_equal(kl__program_serialize(&P, &bytes, &len), KL_OK);
	kl_program back;
	char err[256] = "";
	assert_int_equal(kl__program_deserialize(bytes, len, &back, err, sizeof err), KL_OK);
	free(bytes);
	assert_int_equal(back.steps[rs].row_per, P.steps[rs].row_per);
	assert_int_equal(back.steps[rs].waves, P.steps[rs].waves);
	assert_int_equal(back.steps[rs].nrowdims, P.steps[rs].nrowdims);
	for (int32_t d = 0; d < P.steps[rs].nrowdims; d++) {
		assert_int_equal(back.steps[rs].rowdims[d].v, P.steps[rs].rowdims[d].v);
		assert_int_equal(back.steps[rs].rowdims[d].sym, P.steps[rs].rowdims[d].sym);
	}
	kl__program_free(&back);
	static const struct {
		void (*mutate)(kl_program *, int32_t);
		const char *why;
	} bad[] = {{bad_row_per, "row grid of 5000 rows a block"},
	           {bad_row_sym, "row dim 0"},
	           {bad_row_dims, "row grid of 0 rows a block over"},
	           {bad_row_waves, "row grid of 65 waves for"},
	           {bad_row_nowaves, "row grid of 0 waves for"}};
	for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
		kl_step keep = P.steps[rs];
		bad[i].mutate(&P, rs);
		assert_int_equal(kl__program_serialize(&P, &bytes, &len), KL_OK);
		err[0] = 0;
		assert_int_equal(kl__program_deserialize(bytes, len, &back, err, sizeof err),
		                 KL_EFORMAT);
		if (!strstr(err, bad[i].why))
			fail_msg("row grid case %zu: reader said \"%s\", want \"%s\"", i, err,
			         bad[i].why);
		free(bytes);
		P.steps[rs] = keep;
	}
	kl__program_free(&P);
	kl__trace_free(tr);
	for (int i = 0; i < 3; i++) {
		kl_release(ln[i]);
		kl_release(sk[i]);
	}
	kl_release(rms[0]);
}

static char cache_dir[] = "/tmp/kiln-test-schedule-cache-XXXXXX";

static int setup(void **state)
{
	(void)state;
	if (!mkdtemp(cache_dir) || setenv("KILN_CACHE_DIR", cache_dir, 1))
		return -1;
	ctx = kl_ctx_new(NULL);
	return ctx ? 0 : -1;
}

static int teardown(void **state)
{
	(void)state;
	kl_ctx_free(ctx);
	DIR *dp = opendir(cache_dir);
	for (struct dirent *e; dp && (e = readdir(dp));) {
		char p[512];
		if (e->d_name[0] == '.')
			continue;
		snprintf(p, sizeof p, "%s/%s", cache_dir, e->d_name);
		remove(p);
	}
	if (dp)
		closedir(dp);
	rmdir(cache_dir);
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_split_minimal),
	        cmocka_unit_test(test_decoder_one_token),
	        cmocka_unit_test(test_merge_ffn),
	        cmocka_unit_test(test_merge_refused),
	        cmocka_unit_test(test_ffn_one_buffer),
	        cmocka_unit_test(test_attention_layout),
	        cmocka_unit_test(test_slice_of_concat),
	        cmocka_unit_test(test_inplace),
	        cmocka_unit_test(test_row_grid),
	        cmocka_unit_test(test_wide_row_bounds),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
