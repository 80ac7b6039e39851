/* test_gemm_small.c - kiln's small f32 product (backend/cpu/gemm_small.c):
 * the kernel alone and through kl__blas_gemm's dispatch, over fresh random
 * shapes around its block sizes (rows and columns not multiples of 4, k not
 * a multiple of 8, leading dimensions past the row), alpha and beta, against
 * the same product in double; NaN in C is ignored when beta is 0 and NaN in
 * A reaches exactly its row; and the Linear layer through the public ops
 * (matmul by a transposed weight, bias, GELU) against the f64 reference;
 * and the fused epilogue (residual, bias, activation) at edge sizes.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <cblas.h>
#include <cmocka.h>

#include "backend/cpu/cpu.h"
#include "kltest.h"

static uint64_t seed0;

typedef struct gcase {
	int m, n, k, lda, ldw, ldc;
	float alpha, beta;
} gcase;

static float *rand_buf(uint64_t *st, size_t n)
{
	float *p = malloc(n * sizeof *p);
	assert_non_null(p);
	for (size_t i = 0; i < n; i++)
		p[i] = (float)(2 * kltest_uniform(st) - 1);
	return p;
}

/* C (m x ldc, of which n columns) against the product in double; |C| sums
 * bound the f32 rounding: k terms, each within k ulps of its share */
static int check_case(const gcase *g, bool via_blas, uint64_t *st)
{
	float *A = rand_buf(st, (size_t)g->m * (size_t)g->lda);
	float *W = rand_buf(st, (size_t)g->n * (size_t)g->ldw);
	float *C = rand_buf(st, (size_t)g->m * (size_t)g->ldc);
	double *C0 = malloc((size_t)g->m * (size_t)g->ldc * sizeof *C0);
	assert_non_null(C0);
	for (int i = 0; i < g->m * g->ldc; i++)
		C0[i] = C[i];
	if (g->beta == 0) /* must not reach the result */
		for (int i = 0; i < g->m; i++)
			C[(size_t)i * (size_t)g->ldc] = NAN;
	if (via_blas) {
		kl__blas_gemm(3, false, CblasNoTrans, CblasTrans, g->m, g->n, g->k,
		              g->alpha, A, g->lda, W, g->ldw, g->beta, C, g->ldc);
	} else {
		kl_gemm_small s = {.m = g->m,
		                   .n = g->n,
		                   .k = g->k,
		                   .lda = g->lda,
		                   .ldw = g->ldw,
		                   .ldc = g->ldc,
		                   .alpha = g->alpha,
		                   .beta = g->beta,
		                   .A = A,
		                   .W = W,
		                   .C = C};
		kl__gemm_small(&s, 0, g->n);
	}
	int bad = 0;
	for (int i = 0; i < g->m; i++)
		for (int j = 0; j < g->ldc; j++) {
			size_t ci = (size_t)i * (size_t)g->ldc + (size_t)j;
			if (j >= g->n) { /* past the columns: untouched */
				bad += C[ci] != (float)C0[ci];
				continue;
			}
			double ref = 0, mag = 0;
			for (int p = 0; p < g->k; p++) {
				double t = (double)A[(size_t)i * (size_t)g->lda + (size_t)p] *
				           (double)W[(size_t)j * (size_t)g->ldw + (size_t)p];
				ref += t;
				mag += fabs(t);
			}
			ref = g->alpha * ref + (g->beta != 0 ? g->beta * C0[ci] : 0);
			double tol = 1e-6 * (fabs(g->alpha) * mag * (1 + g->k / 64.0) + fabs(g->beta) + 1e-3);
			if (!(fabs(C[ci] - ref) <= tol)) {
				if (bad < 5)
					print_error("%s m %d n %d k %d: C[%d][%d] = %.9g, want %.9g (tol %g)\n",
					            via_blas ? "kl__blas_gemm" : "kl__gemm_small", g->m, g->n,
					            g->k, i, j, (double)C[ci], ref, tol);
				bad++;
			}
		}
	free(A);
	free(W);
	free(C);
	free(C0);
	return bad;
}

static void test_shapes(void **state)
{
	(void)state;
	uint64_t st = seed0;
	int bad = 0;
	/* mlp24's step, the edges of the dispatch, then random shapes */
	const gcase fixed[] = {{8, 256, 256, 256, 256, 256, 1, 0},
	                       {2, 4, 32, 32, 32, 4, 1, 0},
	                       {32, 100, 77, 80, 77, 101, -0.5f, 1},
	                       {5, 7, 9, 9, 9, 7, 2, 0.25f},
	                       {4, 256, 1024, 1024, 1030, 260, 1, 0}};
	for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) {
		bad += check_case(&fixed[i], false, &st);
		bad += check_case(&fixed[i], true, &st);
	}
	for (int t = 0; t < 40; t++) {
		gcase g;
		g.m = 1 + (int)(kltest_uniform(&st) * 40);
		g.n = 1 + (int)(kltest_uniform(&st) * 90);
		g.k = 1 + (int)(kltest_uniform(&st) * 300);
		g.lda = g.k + (int)(kltest_uniform(&st) * 3);
		g.ldw = g.k + (int)(kltest_uniform(&st) * 3);
		g.ldc = g.n + (int)(kltest_uniform(&st) * 3);
		g.alpha = kltest_uniform(&st) < 0.7 ? 1.0f : (float)(4 * kltest_uniform(&st) - 2);
		g.beta = kltest_uniform(&st) < 0.5 ? 0.0f : (float)(2 * kltest_uniform(&st) - 1);
		bad += check_case(&g, false, &st);
		bad += check_case(&g, true, &st); /* kiln's or OpenBLAS's, as it picks */
	}
	assert_int_equal(bad, 0);
}

/* NaN or inf in A row r reaches row r of C only */
static void test_specials(void **state)
{
	(void)state;
	uint64_t st = seed0 ^ 0x5eed;
	int m = 8, n = 12, k = 40;
	float *A = rand_buf(&st, (size_t)(m * k)), *W = rand_buf(&st, (size_t)(n * k));
	float C[8 * 12];
	A[2 * k + 17] = NAN;
	A[5 * k + 39] = INFINITY; /* the scalar tail */
	kl_gemm_small s = {
	        .m = m, .n = n, .k = k, .lda = k, .ldw = k, .ldc = n, .alpha = 1, .A = A, .W = W, .C = C};
	kl__gemm_small(&s, 0, n);
	int bad = 0;
	for (int i = 0; i < m; i++)
		for (int j = 0; j < n; j++) {
			float v = C[i * n + j];
			if (i == 2)
				bad += !isnan(v);
			else if (i == 5)
				bad += !(isinf(v) || isnan(v)); /* inf * w: +-inf */
			else
				bad += !isfinite(v);
		}
	free(A);
	free(W);
	assert_int_equal(bad, 0);
}

/* The fused epilogue, C = act(alpha A W^T + rbeta R + bias), at the edges of
 * the blocks (rows 1-17, 33, 128; odd n and k, n past a panel), with
 * leading dimensions past the row, C filled with NaN before each run, split
 * over 2 threads where kl__gemm_small_par splits, against double */
static void test_epilogue(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = KL_CPU, .nthreads = 2});
	assert_non_null(ctx); /* the pool's threads */
	uint64_t st = seed0 ^ 0xe91;
	const int ns[] = {1, 5, 17, 67, 130}, ks[] = {1, 31, 33, 257};
	const kl_op acts[] = {KL_OP_INPUT, KL_OP_GELU, KL_OP_RELU, KL_OP_GELU_TANH};
	int bad = 0, t = 0;
	for (int m = 1; m <= 130; m = m < 17 ? m + 1 : m == 17 ? 33 : m == 33 ? 128 : 131)
		for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
			for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++, t++) {
				int n = ns[ni], k = ks[ki], lda = k + 3, ldw = k + 1, ldc = n + 2,
				    ldr = n + 5;
				kl_op act = acts[t % 4];
				bool res = t % 3 != 0, bias = t % 2 == 0;
				float *A = rand_buf(&st, (size_t)(m * lda));
				float *W = rand_buf(&st, (size_t)(n * ldw));
				float *R = rand_buf(&st, (size_t)(m * ldr));
				float *b = rand_buf(&st, (size_t)n);
				float *C = malloc((size_t)(m * ldc) * sizeof *C);
				assert_non_null(C);
				for (int i = 0; i < m * ldc; i++)
					C[i] = NAN;
				kl_gemm_small g = {.m = m,
				                   .n = n,
				                   .k = k,
				                   .lda = lda,
				                   .ldw = ldw,
				                   .ldc = ldc,
				                   .alpha = 0.75f,
				                   .A = A,
				                   .W = W,
				                   .C = C,
				                   .R = res ? R : NULL,
				                   .ldr = ldr,
				                   .rbeta = -0.5f,
				                   .bias = bias ? b : NULL,
				                   .act = act};
				kl__gemm_small_par(2, &g);
				for (int i = 0; i < m; i++)
					for (int j = 0; j < ldc; j++) {
						float v = C[i * ldc + j];
						if (j >= n) { /* past the columns: untouched */
							bad += !isnan(v);
							continue;
						}
						double ref = 0, mag = 0;
						for (int p = 0; p < k; p++) {
							double x = (double)A[i * lda + p] *
							           (double)W[j * ldw + p];
							ref += x;
							mag += fabs(x);
						}
						ref *= 0.75;
						if (res)
							ref += -0.5 * R[i * ldr + j];
						if (bias)
							ref += b[j];
						if (act == KL_OP_GELU)
							ref = 0.5 * ref * erfc(-ref / sqrt(2.0));
						else if (act == KL_OP_GELU_TANH)
							ref = 0.5 * ref *
							      (1 + tanh(0.7978845608028654 *
							                (ref + 0.044715 * ref * ref * ref)));
						else if (act == KL_OP_RELU)
							ref = ref < 0 ? 0 : ref;
						double tol = 1e-6 * (mag * (1 + k / 64.0) + 2);
						if (!(fabs(v - ref) <= tol)) {
							if (bad < 5)
								print_error("epilogue m %d n %d k %d act %d: "
								            "C[%d][%d] = %.9g, want %.9g\n",
								            m, n, k, (int)act, i, j,
								            (double)v, ref);
							bad++;
						}
					}
				free(A);
				free(W);
				free(R);
				free(b);
				free(C);
			}
	kl_ctx_free(ctx);
	assert_int_equal(bad, 0);
}

/* x W^T + b, then exact GELU, through the public ops: the shapes that take
 * the small product, eager and compiled, against the f64 reference */
static kl_tensor *linear_gelu(kl_tensor *const *in, const void *param)
{
	(void)param;
	return kl_gelu(kl_add(kl_matmul(in[0], kl_transpose(in[1], 0, 1)), in[2]));
}

static void test_linear(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = KL_CPU, .nthreads = 2});
	assert_non_null(ctx);
	const int64_t shapes[][3] = {{8, 256, 256}, {3, 70, 45}, {17, 33, 129}, {128, 130, 67}};
	bool ok = true;
	for (size_t s = 0; s < 4; s++) {
		int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
		kltest_range r = KLTEST_NORMAL;
		kl_tensor *in[3] = {kltest_rand(ctx, KL_F32, 2, (int64_t[]){m, k}, r, KLTEST_CONTIG,
		                                seed0 + s),
		                    kltest_rand(ctx, KL_F32, 2, (int64_t[]){n, k}, r, KLTEST_CONTIG,
		                                seed0 + 10 + s),
		                    kltest_rand(ctx, KL_F32, 1, (int64_t[]){n}, r, KLTEST_CONTIG,
		                                seed0 + 20 + s)};
		ok &= kltest_check_op_atol(ctx, "linear+gelu", linear_gelu, 3, in, NULL, 4,
		                           1e-6 * (double)k);
		for (int i = 0; i < 3; i++)
			kl_release(in[i]);
	}
	kl_ctx_free(ctx);
	assert_true(ok);
}

int main(void)
{
	const char *e = getenv("KILN_TEST_SEED");
	seed0 = e ? strtoull(e, NULL, 0) : (uint64_t)time(NULL);
	printf("test_gemm_small: seed %llu (KILN_TEST_SEED to repeat)\n", (unsigned long long)seed0);
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_shapes),
		cmocka_unit_test(test_specials),
		cmocka_unit_test(test_epilogue),
		cmocka_unit_test(test_linear),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
