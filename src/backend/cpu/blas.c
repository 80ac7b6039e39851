/* blas.c - kiln's products through OpenBLAS, split over kiln's OpenMP team.
 *
 * OpenBLAS's pthreads build runs a thread pool of its own. Beside kiln's
 * OpenMP team, whose threads spin for a while after each parallel region, the
 * two pools fight over the cores of a small machine: on 2 cores the CPU
 * DecoderLayer (2x64x256, f32, compiled) took 3.46 ms with both and 2.37 ms
 * with OpenMP's threads passive, and kl_profile put a 50-MFLOP product at
 * 9.9 ms. So while a kiln context is alive OpenBLAS runs single-threaded
 * (kl__blas_hold / kl__blas_release: its thread count is set to 1 by the
 * first context and put back by the last one freed; setting it per product
 * cost about a millisecond a call, OpenBLAS resizing its buffers), and a
 * product is one call per thread of kiln's team on its own block of C's
 * rows (or columns, when it has few rows). Called inside a
 * parallel region (the eager batched products), a product is one call.
 */
#include <cblas.h>
#include <omp.h>
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

/* Multiply-adds below which one call beats a parallel region. */
#define GEMM_PAR_MIN (1 << 17)

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

void kl__blas_gemm(int nt, bool f64, int ta_, int tb_, int m, int n, int k, double alpha,
                   const void *A, int lda, const void *B, int ldb, double beta, void *C, int ldc)
{
	CBLAS_TRANSPOSE ta = (CBLAS_TRANSPOSE)ta_, tb = (CBLAS_TRANSPOSE)tb_;
	if (nt <= 1 || omp_in_parallel() || (double)m * n * k < GEMM_PAR_MIN ||
	    (m < 2 * nt && n < 16 * nt)) {
		gemm_block(f64, ta, tb, k, alpha, A, lda, B, ldb, beta, C, ldc, 0, m, 0, n);
		return;
	}
	/* rows where there are 64 or more (and two a thread): each thread packs
	 * all of B, which the rows repay; the columns (each thread packing its
	 * share of B) for fewer rows. On 2 cores: columns for every product
	 * took the CPU FFN (512 rows) 13.2-13.6 ms against 11.4-12.1, rows for
	 * every product took mlp24 (8 rows) 437 us against 376-385 */
	bool rows = m >= 2 * nt && (m >= 64 || n < 16 * nt);
#pragma omp parallel num_threads(nt)
	{
		int t = omp_get_thread_num(), lo, hi;
		share(rows ? m : n, t, omp_get_num_threads(), rows ? 4 : 16, &lo, &hi);
		if (lo < hi)
			gemm_block(f64, ta, tb, k, alpha, A, lda, B, ldb, beta, C, ldc,
			           rows ? lo : 0, rows ? hi : m, rows ? 0 : lo, rows ? n : hi);
	}
}

void kl__blas_gemv(int nt, bool f64, int tw_, int rows, int cols, double alpha, const void *W,
                   int ldw, const void *x, int incx, double beta, void *y)
{
	/* y (contiguous) = alpha op(W) x + beta y; W is rows x cols. Split over
	 * y's elements: W's rows (no transpose) or columns (transposed). */
	CBLAS_TRANSPOSE tw = (CBLAS_TRANSPOSE)tw_;
	int ny = tw == CblasNoTrans ? rows : cols;
	if (nt <= 1 || omp_in_parallel() || (double)rows * cols < GEMM_PAR_MIN || ny < 64 * nt) {
		if (f64)
			cblas_dgemv(CblasRowMajor, tw, rows, cols, alpha, W, ldw, x, incx, beta, y,
			            1);
		else
			cblas_sgemv(CblasRowMajor, tw, rows, cols, (float)alpha, W, ldw, x, incx,
			            (float)beta, y, 1);
		return;
	}
#pragma omp parallel num_threads(nt)
	{
		int t = omp_get_thread_num(), lo, hi;
		share(ny, t, omp_get_num_threads(), 16, &lo, &hi);
		if (lo < hi) {
			bool plain = tw == CblasNoTrans;
			size_t wo = plain ? (size_t)lo * (size_t)ldw : (size_t)lo;
			int r = plain ? hi - lo : rows, c = plain ? cols : hi - lo;
			if (f64)
				cblas_dgemv(CblasRowMajor, tw, r, c, alpha, (const double *)W + wo,
				            ldw, x, incx, beta, (double *)y + lo, 1);
			else
				cblas_sgemv(CblasRowMajor, tw, r, c, (float)alpha,
				            (const float *)W + wo, ldw, x, incx, (float)beta,
				            (float *)y + lo, 1);
		}
	}
}
