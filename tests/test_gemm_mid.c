/* test_gemm_mid.c - kiln's f32 product for medium shapes on AVX-512 and
 * AVX2 (backend/cpu/gemm_mid.c; each half the CPU runs), alone and
 * through kl__blas_gemm's dispatch: rows, columns and depth around its
 * tiles (12 x 32, 6 x 16), its blocks of B and the 16 x 16 and 8 x 8
 * transposes of the packing (m 1-13, n 1-33 and past a block, k 1-17,
 * past 512 and past one and two blocks of 2048), B stored n x k or
 * k x n, leading dimensions past the row, alpha and beta, on 1-3 threads,
 * against the product in double; C poisoned with NaN where beta is 0, the
 * columns past n untouched; A's rows 4 KiB apart (copied a row block at a
 * time); NaN and inf in A reach their row only and in B their column only;
 * and the fused epilogue (residual, bias, activation); each also with B
 * packed ahead (kl__gemm_mid_pack, the weight's memory NaN afterwards, so
 * the product reads only the packing). Where the machine
 * has neither the product declines (returns false) and the tests say so
 * and pass.
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

typedef struct mcase {
	int m, n, k, lda, ldw, ldc, ldr, nt;
	bool w_kn, via_blas, res, bias;
	bool pre; /* B packed ahead (kl__gemm_mid_pack), as a compiled plan's weight */
	float alpha, beta;
	kl_op act;
} mcase;

static float *rand_buf(uint64_t *st, size_t n)
{
	float *p = malloc((n ? n : 1) * sizeof *p);
	assert_non_null(p);
	for (size_t i = 0; i < n; i++)
		p[i] = (float)(2 * kltest_uniform(st) - 1);
	return p;
}

static double act_ref(kl_op act, double x)
{
	switch (act) {
	case KL_OP_GELU:
		return 0.5 * x * erfc(-x / sqrt(2.0));
	case KL_OP_RELU:
		return x < 0 ? 0 : x;
	case KL_OP_SILU:
		return x / (1 + exp(-x));
	default:
		return x;
	}
}

/* one case against double; returns the number of bad elements (or -1
 * where the product declined) */
static int check_case(const mcase *g, uint64_t *st)
{
	size_t wrows = g->w_kn ? (size_t)g->k : (size_t)g->n;
	float *A = rand_buf(st, (size_t)g->m * (size_t)g->lda);
	uint64_t w_seed = *st;
	float *W = rand_buf(st, wrows * (size_t)g->ldw);
	float *C = rand_buf(st, (size_t)g->m * (size_t)g->ldc);
	float *R = rand_buf(st, (size_t)g->m * (size_t)g->ldr);
	float *b = rand_buf(st, (size_t)g->n);
	double *C0 = malloc((size_t)g->m * (size_t)g->ldc * sizeof *C0);
	assert_non_null(C0);
	for (size_t i = 0; i < (size_t)g->m * (size_t)g->ldc; i++) {
		C0[i] = C[i];
		if (g->beta == 0 && (int)(i % (size_t)g->ldc) < g->n)
			C[i] = NAN; /* must not reach the result */
	}
	bool ran = true;
	if (g->via_blas) {
		kl__blas_gemm(g->nt, false, CblasNoTrans, g->w_kn ? CblasNoTrans : CblasTrans, g->m,
		              g->n, g->k, g->alpha, A, g->lda, W, g->ldw, g->beta, C, g->ldc);
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
		                   .C = C,
		                   .R = g->res ? R : NULL,
		                   .ldr = g->ldr,
		                   .rbeta = -0.5f,
		                   .bias = g->bias ? b : NULL,
		                   .act = g->act};
		float *pk = NULL;
		if (g->pre) {
			size_t nf = kl__gemm_mid_packed_floats(g->n, g->k);
			pk = aligned_alloc(64, (nf * sizeof *pk + 63) / 64 * 64 + 64);
			assert_non_null(pk);
			ran = kl__gemm_mid_pack(&s, g->w_kn, pk);
			/* the weight's own memory is not read again */
			for (size_t i = 0; ran && i < wrows * (size_t)g->ldw; i++)
				((float *)W)[i] = NAN;
		}
		if (!g->pre || ran)
			ran = kl__gemm_mid_par(g->nt, &s, g->w_kn, pk);
		free(pk);
		if (g->pre && ran) { /* the reference below reads the weight */
			uint64_t st2 = w_seed;
			for (size_t i = 0; i < wrows * (size_t)g->ldw; i++)
				W[i] = (float)(2 * kltest_uniform(&st2) - 1);
		}
	}
	int bad = 0;
	for (int i = 0; ran && i < g->m; i++)
		for (int j = 0; j < g->ldc; j++) {
			size_t ci = (size_t)i * (size_t)g->ldc + (size_t)j;
			if (j >= g->n) { /* past the columns: untouched */
				bad += C[ci] != (float)C0[ci];
				continue;
			}
			double ref = 0, mag = 0;
			for (int p = 0; p < g->k; p++) {
				size_t wi = g->w_kn ? (size_t)p * (size_t)g->ldw + (size_t)j
				                    : (size_t)j * (size_t)g->ldw + (size_t)p;
				double t = (double)A[(size_t)i * (size_t)g->lda + (size_t)p] * (double)W[wi];
				ref += t;
				mag += fabs(t);
			}
			ref = g->alpha * ref + (g->beta != 0 ? g->beta * C0[ci] : 0);
			if (g->res)
				ref += -0.5 * R[(size_t)i * (size_t)g->ldr + (size_t)j];
			if (g->bias)
				ref += b[j];
			ref = act_ref(g->act, ref);
			double tol = 1e-6 * (fabs(g->alpha) * mag * (1 + g->k / 64.0) + fabs(g->beta) + 2);
			if (!(fabs(C[ci] - ref) <= tol)) {
				if (bad < 5)
					print_error("%s m %d n %d k %d%s%s nt %d: C[%d][%d] = %.9g, want "
					            "%.9g (tol %g)\n",
					            g->via_blas ? "kl__blas_gemm" : "kl__gemm_mid_par", g->m,
					            g->n, g->k, g->w_kn ? " (B k x n)" : "",
					            g->pre ? " (packed ahead)" : "", g->nt, i, j,
					            (double)C[ci], ref, tol);
				bad++;
			}
		}
	free(A);
	free(W);
	free(C);
	free(R);
	free(b);
	free(C0);
	return ran ? bad : -1;
}

static int rnd(uint64_t *st, int lo, int hi)
{
	return lo + (int)(kltest_uniform(st) * (hi - lo + 1));
}

/* the edges of the tile, the blocks and the packing's transposes, then
 * random shapes, each on 1-3 threads with both layouts of B */
static void test_shapes(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = KL_CPU, .nthreads = 3});
	assert_non_null(ctx); /* the pool's threads */
	uint64_t st = seed0;
	/* the AVX-512 half's tile is 12 x 32 and its transposes 16 x 16; the
	 * AVX2 half's, 6 x 16 and 8 x 8 */
	const int ms[] = {1, 5, 6, 7, 11, 12, 13, 25}, ns[] = {1, 8, 9, 15, 16, 17, 31, 32, 33, 290},
	          ks[] = {1, 7, 8, 9, 15, 16, 17, 530, 1100};
	int bad = 0, t = 0, declined = 0;
	for (size_t mi = 0; mi < sizeof ms / sizeof ms[0]; mi++)
		for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
			for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++, t++) {
				mcase g = {.m = ms[mi], .n = ns[ni], .k = ks[ki]};
				g.lda = g.k + t % 3;
				g.w_kn = t % 2 == 1;
				g.ldw = (g.w_kn ? g.n : g.k) + (t / 2) % 3;
				g.ldc = g.n + t % 2;
				g.ldr = g.n;
				g.nt = 1 + t % 3;
				g.alpha = t % 4 == 3 ? -1.5f : 1.0f;
				g.beta = t % 5 == 2 ? 0.5f : 0.0f;
				g.pre = t % 7 >= 4;
				int r = check_case(&g, &st);
				declined += r < 0;
				bad += r > 0 ? r : 0;
			}
	for (int i = 0; i < 30; i++, t++) {
		mcase g = {.m = rnd(&st, 1, 150), .n = rnd(&st, 1, 300), .k = rnd(&st, 1, 700)};
		g.w_kn = t % 2 == 0;
		g.lda = g.k + rnd(&st, 0, 2);
		g.ldw = (g.w_kn ? g.n : g.k) + rnd(&st, 0, 2);
		g.ldc = g.n + rnd(&st, 0, 2);
		g.ldr = g.n;
		g.nt = rnd(&st, 1, 3);
		g.alpha = kltest_uniform(&st) < 0.7 ? 1.0f : (float)(4 * kltest_uniform(&st) - 2);
		g.beta = kltest_uniform(&st) < 0.5 ? 0.0f : (float)(2 * kltest_uniform(&st) - 1);
		g.via_blas = i % 3 == 0; /* kiln's product or OpenBLAS, as the dispatch picks */
		g.pre = i % 3 == 1;
		int r = check_case(&g, &st);
		declined += r < 0;
		bad += r > 0 ? r : 0;
	}
	/* A's rows 4 KiB apart (a multiple): copied a row block at a time */
	const mcase alias[] = {{.m = 25, .n = 70, .k = 600, .lda = 1024, .ldw = 600, .ldc = 70},
	                       {.m = 13, .n = 33, .k = 1100, .lda = 2048, .ldw = 33, .ldc = 40,
	                        .w_kn = true, .beta = 0.5f}};
	for (size_t i = 0; i < 2; i++) {
		mcase g = alias[i];
		g.nt = 2;
		g.alpha = 1;
		int r = check_case(&g, &st);
		bad += r > 0 ? r : 0;
	}
	/* k past one block (2048): C summed over two, beta once, the
	 * epilogue after the last */
	const mcase deep[] = {{.m = 13, .n = 40, .k = 2100, .lda = 2100, .ldw = 2101, .ldc = 41,
	                       .ldr = 40, .beta = 0.5f, .res = true, .bias = true,
	                       .act = KL_OP_SILU},
	                      {.m = 30, .n = 70, .k = 4500, .lda = 4500, .ldw = 70, .ldc = 70,
	                       .w_kn = true}};
	for (size_t i = 0; i < 4; i++) {
		mcase g = deep[i % 2];
		g.nt = 2;
		g.alpha = 1;
		g.pre = i >= 2;
		int r = check_case(&g, &st);
		bad += r > 0 ? r : 0;
	}
	/* the FFN's shapes through the dispatch */
	const mcase ffn[] = {{.m = 512, .n = 1408, .k = 512, .lda = 512, .ldw = 512, .ldc = 1408},
	                     {.m = 512, .n = 512, .k = 1408, .lda = 1408, .ldw = 1408, .ldc = 512}};
	for (size_t i = 0; i < 2; i++) {
		mcase g = ffn[i];
		g.nt = 2;
		g.alpha = 1;
		g.via_blas = true;
		bad += check_case(&g, &st);
	}
	if (declined)
		print_message("kl__gemm_mid_par declined %d cases (no AVX2 here)\n", declined);
	kl_ctx_free(ctx);
	assert_int_equal(bad, 0);
}

/* The fused epilogue, C = act(alpha A B + rbeta R + bias), C poisoned with
 * NaN first, at rows and columns past the tile and a block of B */
static void test_epilogue(void **state)
{
	(void)state;
	kl_ctx *ctx = kl_ctx_new(&(kl_ctx_opts){.device = KL_CPU, .nthreads = 2});
	assert_non_null(ctx);
	uint64_t st = seed0 ^ 0xe91;
	const kl_op acts[] = {KL_OP_INPUT, KL_OP_GELU, KL_OP_RELU, KL_OP_SILU};
	const int ms[] = {1, 13, 70}, ns[] = {5, 33, 300}, ks[] = {7, 600};
	int bad = 0, t = 0;
	for (size_t mi = 0; mi < 3; mi++)
		for (size_t ni = 0; ni < 3; ni++)
			for (size_t ki = 0; ki < 2; ki++, t++) {
				mcase g = {.m = ms[mi], .n = ns[ni], .k = ks[ki], .nt = 2};
				g.w_kn = t % 2 == 1;
				g.lda = g.k + 3;
				g.ldw = (g.w_kn ? g.n : g.k) + 1;
				g.ldc = g.n + 2;
				g.ldr = g.n + 5;
				g.alpha = 0.75f;
				g.act = acts[t % 4];
				g.res = t % 3 != 0;
				g.bias = t % 2 == 0;
				g.pre = t % 4 >= 2;
				int r = check_case(&g, &st);
				bad += r > 0 ? r : 0;
			}
	kl_ctx_free(ctx);
	assert_int_equal(bad, 0);
}

/* NaN or inf in A's row r reaches row r of C only; in B's column j,
 * column j only (the packing's zero columns past n carry none) */
static void test_specials(void **state)
{
	(void)state;
	uint64_t st = seed0 ^ 0x5eed;
	int m = 30, n = 70, k = 40;
	for (int kn = 0; kn < 2; kn++) {
		float *A = rand_buf(&st, (size_t)(m * k)), *W = rand_buf(&st, (size_t)(n * k));
		float *C = malloc((size_t)(m * n) * sizeof *C);
		assert_non_null(C);
		A[2 * k + 17] = NAN;
		A[25 * k + 39] = INFINITY;
		/* column 66 of B (past two panels) */
		W[kn ? 5 * n + 66 : 66 * k + 5] = NAN;
		kl_gemm_small s = {.m = m,
		                   .n = n,
		                   .k = k,
		                   .lda = k,
		                   .ldw = kn ? n : k,
		                   .ldc = n,
		                   .alpha = 1,
		                   .A = A,
		                   .W = W,
		                   .C = C};
		if (!kl__gemm_mid_par(1, &s, kn, NULL)) {
			free(A);
			free(W);
			free(C);
			skip();
		}
		int bad = 0;
		for (int i = 0; i < m; i++)
			for (int j = 0; j < n; j++) {
				float v = C[i * n + j];
				if (i == 2 || j == 66)
					bad += !isnan(v);
				else if (i == 25)
					bad += !(isinf(v) || isnan(v));
				else
					bad += !isfinite(v);
			}
		free(A);
		free(W);
		free(C);
		assert_int_equal(bad, 0);
	}
}

int main(void)
{
	const char *e = getenv("KILN_TEST_SEED");
	seed0 = e ? strtoull(e, NULL, 0) : (uint64_t)time(NULL);
	printf("test_gemm_mid: seed %llu (KILN_TEST_SEED to repeat)\n", (unsigned long long)seed0);
	const struct CMUnitTest tests[] = {
	        cmocka_unit_test(test_shapes),
	        cmocka_unit_test(test_epilogue),
	        cmocka_unit_test(test_specials),
	};
	/* each half this CPU runs: the widest, then AVX2's where that was
	 * AVX-512's */
	int isa = kl__gemm_mid_force_isa(0), rc = 0;
	printf("test_gemm_mid: the %s half\n", isa == 4 ? "AVX-512" : isa == 3 ? "AVX2" : "no");
	rc |= cmocka_run_group_tests_name("widest", tests, NULL, NULL);
	if (isa == 4) {
		printf("test_gemm_mid: the AVX2 half\n");
		if (kl__gemm_mid_force_isa(3) != 3)
			return 1;
		rc |= cmocka_run_group_tests_name("avx2", tests, NULL, NULL);
		kl__gemm_mid_force_isa(0);
	}
	return rc;
}
