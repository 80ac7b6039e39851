/* blas.c - kiln's products through OpenBLAS, split over kiln's thread pool.
 *
 * OpenBLAS's pthreads build runs a thread pool of its own. Beside the
 * OpenMP team kiln had then, whose threads spin for a while after each parallel region, the
 * two pools fight over the cores of a small machine: on 2 cores the CPU
 * DecoderLayer (2x64x256, f32, compiled) took 3.46 ms with both and 2.37 ms
 * with OpenMP's threads passive, and kl_profile put a 50-MFLOP product at
 * 9.9 ms. So while a kiln context is alive OpenBLAS runs single-threaded
 * (kl__blas_hold / kl__blas_release: its thread count is set to 1 by the
 * first context and put back by the last one freed; setting it per product
 * cost about a millisecond a call, OpenBLAS resizing its buffers), and a
 * product is one call per thread of kiln's pool (pool.c) on its own block of
 * C's rows (or columns, when it has few rows). Called inside a chunk of a
 * parallel region (the eager batched products), a product is one call.
 */
#include <cblas.h>
#include <pthread.h>

#include "backend/cpu/cpu.h"

static pthread_mutex_t hold_lock = PTHREAD_MUTEX_INITIALIZER;
static int holders, saved_threads;

void kl__blas_hold(void)
{
	pthread_mutex_lock(&hold_lock);
	if (holders++ == 0) {
		saved_threads = openblas_get_num_threads();
		if (saved_threads != 1)
			openblas_set_num_threads(1);
	}
	pthread_mutex_unlock(&hold_lock);
}

void kl__blas_release(void)
{
	pthread_mutex_lock(&hold_lock);
	if (holders > 0 && --holders == 0 && saved_threads != 1)
		openblas_set_num_threads(saved_threads);
	pthread_mutex_unlock(&hold_lock);
}

/* Multiply-adds below which one call beats a parallel region; kiln's small
 * product (about twice OpenBLAS's rate on such shapes) needs more: mlp24's
 * 8x256x256 steps (2^19) took the call 385-389 us on one thread, 207-322 us
 * split in two (Zen 4, 2 cores). */
#define GEMM_PAR_MIN (1 << 17)
#define SMALL_PAR_MIN (1 << 18)

/* [lo, hi) of n items for thread t of nt, in multiples of align. */
static void share(int n, int t, int nt, int align, int *lo, int *hi)
{
	int64_t per = ((int64_t)n + nt - 1) / nt;
	per = (per + align - 1) / align * align;
	int64_t a = (int64_t)t * per < n ? (int64_t)t * per : n;
	*lo = (int)a;
	*hi = (int)(a + per < n ? a + per : n);
}

static void gemm_block(bool f64, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int k, double alpha,
                       const void *A, int lda, const void *B, int ldb, double beta, void *C,
                       int ldc, int r0, int r1, int c0, int c1)
{
	/* rows [r0, r1) of op(A) and of C, columns [c0, c1) of op(B) and of C */
	size_t ao = ta == CblasNoTrans ? (size_t)r0 * (size_t)lda : (size_t)r0;
	size_t bo = tb == CblasNoTrans ? (size_t)c0 : (size_t)c0 * (size_t)ldb;
	size_t co = (size_t)r0 * (size_t)ldc + (size_t)c0;
	if (f64)
		cblas_dgemm(CblasRowMajor, ta, tb, r1 - r0, c1 - c0, k, alpha,
		            (const double *)A + ao, lda, (const double *)B + bo, ldb, beta,
		            (double *)C + co, ldc);
	else
		cblas_sgemm(CblasRowMajor, ta, tb, r1 - r0, c1 - c0, k, (float)alpha,
		            (const float *)A + ao, lda, (const float *)B + bo, ldb, (float)beta,
		            (float *)C + co, ldc);
}

typedef struct gemm_job {
	bool f64, rows;
	CBLAS_TRANSPOSE ta, tb;
	int m, n, k, lda, ldb, ldc, pieces;
	double alpha, beta;
	const void *A, *B;
	void *C;
} gemm_job;

static void gemm_chunk(void *arg, int64_t p0, int64_t p1)
{
	const gemm_job *j = arg;
	for (int64_t p = p0; p < p1; p++) {
		int lo, hi;
		share(j->rows ? j->m : j->n, (int)p, j->pieces, j->rows ? 4 : 16, &lo, &hi);
		if (lo < hi)
			gemm_block(j->f64, j->ta, j->tb, j->k, j->alpha, j->A, j->lda, j->B, j->ldb,
			           j->beta, j->C, j->ldc, j->rows ? lo : 0, j->rows ? hi : j->m,
			           j->rows ? 0 : lo, j->rows ? j->n : hi);
	}
}

typedef struct small_job {
	kl_gemm_small g;
	int pieces;
} small_job;

static void small_chunk(void *arg, int64_t p0, int64_t p1)
{
	const small_job *j = arg;
	for (int64_t p = p0; p < p1; p++) {
		int lo, hi;
		share(j->g.n, (int)p, j->pieces, 4, &lo, &hi);
		if (lo < hi)
			kl__gemm_small(&j->g, lo, hi);
	}
}

void kl__gemm_small_par(int nt, const kl_gemm_small *g)
{
	/* one share of C's columns a thread (in multiples of 4) when there is
	 * enough of it. On the busy 2-core machine (load 10-12) mlp24's
	 * 8x256x256 steps (6-12 us each) once took the call 0.45-0.49 ms on
	 * one thread, 0.46-0.70 ms split in two and 0.92-1.18 ms in eight
	 * pieces; with the pool's busy fallback (pool.c) and the epilogue
	 * split with the product, two threads win from SMALL_PAR_MIN. */
	small_job j = {.g = *g};
	bool par = nt > 1 && !kl__par_active() && (double)g->m * g->n * g->k >= SMALL_PAR_MIN &&
	           g->n >= 32 * nt;
	j.pieces = par ? nt : 1;
	kl__par_for(par ? nt : 1, j.pieces, small_chunk, &j);
}

void kl__blas_gemm(int nt, bool f64, int ta_, int tb_, int m, int n, int k, double alpha,
                   const void *A, int lda, const void *B, int ldb, double beta, void *C, int ldc)
{
	CBLAS_TRANSPOSE ta = (CBLAS_TRANSPOSE)ta_, tb = (CBLAS_TRANSPOSE)tb_;
	bool few_rows = tb == CblasTrans && kl__gemm_small_fits(m, n, k);
	if (!f64 && ta == CblasNoTrans && (few_rows || kl__gemm_mid_fits(m, n, k))) {
		/* kiln's own products: few rows times a row-major weight (x W^T,
		 * gemm_small), or a few hundred rows or more on AVX-512 (gemm_mid;
		 * where it cannot run, OpenBLAS below) */
		kl_gemm_small g = {.m = m,
		                   .n = n,
		                   .k = k,
		                   .lda = lda,
		                   .ldw = ldb,
		                   .ldc = ldc,
		                   .alpha = (float)alpha,
		                   .beta = (float)beta,
		                   .A = A,
		                   .W = B,
		                   .C = C};
		if (few_rows)
			kl__gemm_small_par(nt, &g);
		if (few_rows || kl__gemm_mid_par(nt, &g, tb == CblasNoTrans, NULL))
			return;
	}
	if (nt <= 1 || kl__par_active() || (double)m * n * k < GEMM_PAR_MIN ||
	    (m < 2 * nt && n < 16 * nt)) {
		gemm_block(f64, ta, tb, k, alpha, A, lda, B, ldb, beta, C, ldc, 0, m, 0, n);
		return;
	}
	/* rows where there are 64 or more (and two a thread): each thread packs
	 * all of B, which the rows repay; the columns (each thread packing its
	 * share of B) for fewer rows. On 2 cores: columns for every product
	 * took the CPU FFN (512 rows) 13.2-13.6 ms against 11.4-12.1, rows for
	 * every product took mlp24 (8 rows) 437 us against 376-385. One piece
	 * a thread, claimed by whichever thread gets to it (pool.c). */
	gemm_job j = {.f64 = f64,
	              .rows = m >= 2 * nt && (m >= 64 || n < 16 * nt),
	              .ta = ta,
	              .tb = tb,
	              .m = m,
	              .n = n,
	              .k = k,
	              .lda = lda,
	              .ldb = ldb,
	              .ldc = ldc,
	              .pieces = nt,
	              .alpha = alpha,
	              .beta = beta,
	              .A = A,
	              .B = B,
	              .C = C};
	kl__par_for(nt, nt, gemm_chunk, &j);
}

typedef struct gemv_job {
	bool f64;
	CBLAS_TRANSPOSE tw;
	int rows, cols, ldw, incx, ny, pieces;
	double alpha, beta;
	const void *W, *x;
	void *y;
} gemv_job;

static void gemv_chunk(void *arg, int64_t p0, int64_t p1)
{
	const gemv_job *j = arg;
	for (int64_t p = p0; p < p1; p++) {
		int lo, hi;
		share(j->ny, (int)p, j->pieces, 16, &lo, &hi);
		if (lo >= hi)
			continue;
		bool plain = j->tw == CblasNoTrans;
		size_t wo = plain ? (size_t)lo * (size_t)j->ldw : (size_t)lo;
		int r = plain ? hi - lo : j->rows, c = plain ? j->cols : hi - lo;
		if (j->f64)
			cblas_dgemv(CblasRowMajor, j->tw, r, c, j->alpha, (const double *)j->W + wo,
			            j->ldw, j->x, j->incx, j->beta, (double *)j->y + lo, 1);
		else
			cblas_sgemv(CblasRowMajor, j->tw, r, c, (float)j->alpha,
			            (const float *)j->W + wo, j->ldw, j->x, j->incx, (float)j->beta,
			            (float *)j->y + lo, 1);
	}
}

void kl__blas_gemv(int nt, bool f64, int tw_, int rows, int cols, double alpha, const void *W,
                   int ldw, const void *x, int incx, double beta, void *y)
{
	/* y (contiguous) = alpha op(W) x + beta y; W is rows x cols. Split over
	 * y's elements: W's rows (no transpose) or columns (transposed), in
	 * pieces of 64 or more, a few a thread. */
	CBLAS_TRANSPOSE tw = (CBLAS_TRANSPOSE)tw_;
	int ny = tw == CblasNoTrans ? rows : cols;
	if (nt <= 1 || kl__par_active() || (double)rows * cols < GEMM_PAR_MIN || ny < 64 * nt) {
		if (f64)
			cblas_dgemv(CblasRowMajor, tw, rows, cols, alpha, W, ldw, x, incx, beta, y,
			            1);
		else
			cblas_sgemv(CblasRowMajor, tw, rows, cols, (float)alpha, W, ldw, x, incx,
			            (float)beta, y, 1);
		return;
	}
	int pieces = ny / 64 < 4 * nt ? ny / 64 : 4 * nt;
	gemv_job j = {.f64 = f64,
	              .tw = tw,
	              .rows = rows,
	              .cols = cols,
	              .ldw = ldw,
	              .incx = incx,
	              .ny = ny,
	              .pieces = pieces,
	              .alpha = alpha,
	              .beta = beta,
	              .W = W,
	              .x = x,
	              .y = y};
	kl__par_for(nt, pieces, gemv_chunk, &j);
}
