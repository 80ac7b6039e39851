/* test_schedule.c - scheduler decisions on whole graphs: a kernel that would
 * store more values than a step may write is split, not left depending on a
 * dead kernel (the one-token DecoderLayer lowered for CUDA, whose skinny
 * products are generated row reductions, and the smallest graph with the
 * same shape of problem), each lowered for the C and the CUDA targets (no
 * GPU needed; with KILN_HAVE_CUDA and NVRTC the CUDA source is compiled for
 * sm_90) and run on the CPU against the float64 reference.
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

#include "core/core.h"
#include "kiln_nn.h"
#include "kltest.h"
#include "lower/lower.h"
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

/* Trace apply on in[], lower it for target t with fusion; the program's
 * step counts must be want's and its log must hold each of logs[]
 * (NULL-terminated). Returns the program's source (malloc'd) for NVRTC. */
static char *lower_expect(const char *what, kltest_apply_fn apply, const void *p, int nin,
                          kl_tensor *const *in, kl_target t, counts want, const char *const *logs)
{
	kl_scope_begin(ctx);
	assert_int_equal(kl__trace_begin(ctx), KL_OK);
	kl_tensor *y = apply(in, p);
	kl_trace *tr = kl__trace_end(ctx, 1, &y);
	kl_scope_end(ctx);
	if (!tr)
		fail_msg("%s: trace: %s", what, kl_last_error(ctx));
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
	        "split the kernel of mul#35(matmul): it would store 3 values (at most 2); "
	        "mul#40(rms_norm) becomes a kernel of its own",
	        "the kernel of sum#40(rms_norm) recomputes mul#40(rms_norm)", NULL};
	kl_nn_decoder d;
	assert_int_equal(kl_nn_decoder_init(&d, ctx, 2048, 16, 8192, KL_BF16, 3), KL_OK);
	kl_tensor *x = kltest_rand(ctx, KL_BF16, 3, (int64_t[]){1, 1, 2048}, KLTEST_NORMAL,
	                           KLTEST_CONTIG, 21);
	assert_non_null(x);
	/* CUDA: rms_norm + in-projection, out-projection + residual + norm, the
	 * gate and up reductions with silu * up, the down reduction + residual,
	 * and the attention step */
	nvrtc_compiles("one-token DecoderLayer",
	               lower_expect("one-token DecoderLayer", ap_decoder, &d, 1, &x,
	                            KL_TARGET_CUDA, (counts){6, 0, 1}, logs));
	/* the C target: library products */
	free(lower_expect("one-token DecoderLayer", ap_decoder, &d, 1, &x, KL_TARGET_C,
	                  (counts){5, 5, 1}, NULL));
	run_vs_reference("one-token DecoderLayer bf16", ap_decoder, &d, 1, &x, 8);
	kl_release(x);
	kl_nn_free(&d.base);
}

static int setup(void **state)
{
	(void)state;
	ctx = kl_ctx_new(NULL);
	return ctx ? 0 : -1;
}

static int teardown(void **state)
{
	(void)state;
	kl_ctx_free(ctx);
	return 0;
}

int main(void)
{
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_split_minimal),
	        cmocka_unit_test(test_decoder_one_token),
	};
	return cmocka_run_group_tests(tests, setup, teardown);
}
