/* gemm_small.c - kiln's own f32 product for few rows against a weight stored
 * row by row: C = alpha A W^T + beta C with A m x k (m small) and W n x k,
 * both with k contiguous (the Linear layer's x W^T).
 *
 * Why: OpenBLAS packs all of W before it multiplies, which a product of 8
 * rows cannot repay: mlp24's 8x256x256 steps ran at 47 GFLOP/s on one core
 * of the 2-core machine, 4x256x1024 at 12. Here each C element is a dot
 * product of an A row and a W row, read where they lie: a 4 x 4 block of C
 * keeps 16 accumulators of 8 lanes over k (8 loads for 16 multiply-adds), and
 * their lanes are summed by one shuffle tree per 8 accumulators. A (a few
 * KiB) stays in L1 and a block's 4 W rows stay there while every row block
 * of A passes over them, so W is read once. The same shapes: 90 GFLOP/s on
 * 8x256x256, 100 on 4x256x1024; OpenBLAS is ahead from about 64 rows
 * (kl__gemm_small_fits).
 */
#include "backend/cpu/cpu.h"

#if defined(__GNUC__) || defined(__clang__)
#define GS_VEC 1
typedef float gs_v8 __attribute__((vector_size(32)));
typedef int gs_v8i __attribute__((vector_size(32)));
#if defined(__clang__)
#define GS_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define GS_SHUF(a, b, ...) __builtin_shuffle(a, b, (gs_v8i){__VA_ARGS__})
#endif
/* 8 floats from p (no alignment) into the gs_v8 v */
#define GS_LD(v, p) memcpy(&(v), (p), sizeof(gs_v8))
/* out: lane i the sum of the lanes of v<i> */
#define GS_PAIR(x, y)                                                                      \
	(GS_SHUF(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + GS_SHUF(x, y, 1, 9, 3, 11, 5, 13, 7, 15))
#define GS_QUAD(x, y)                                                                      \
	(GS_SHUF(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + GS_SHUF(x, y, 2, 3, 10, 11, 6, 7, 14, 15))
#define GS_REDUCE8(out, v0, v1, v2, v3, v4, v5, v6, v7)                                    \
	do {                                                                               \
		gs_v8 q0_ = GS_QUAD(GS_PAIR(v0, v1), GS_PAIR(v2, v3));                     \
		gs_v8 q1_ = GS_QUAD(GS_PAIR(v4, v5), GS_PAIR(v6, v7));                     \
		(out) = GS_SHUF(q0_, q1_, 0, 1, 2, 3, 8, 9, 10, 11) +                      \
		        GS_SHUF(q0_, q1_, 4, 5, 6, 7, 12, 13, 14, 15);                     \
	} while (0)
#endif

bool kl__gemm_small_fits(int m, int n, int k)
{
#ifdef GS_VEC
	/* measured against OpenBLAS on one core: ahead from 2 rows to 32, and
	 * only once k fills a few vectors */
	return m >= 2 && m <= 32 && n >= 4 && k >= 32;
#else
	(void)m;
	(void)n;
	(void)k;
	return false;
#endif
}

/* C's rows [i, i + mr) and columns [j, j + nr) (mr, nr <= 4) from their
 * sums s[r][c] */
static void put_block(const kl_gemm_small *g, int i, int j, int mr, int nr, float s[4][4])
{
	for (int r = 0; r < mr; r++)
		for (int c = 0; c < nr; c++) {
			float *cp = g->C + (size_t)(i + r) * (size_t)g->ldc + (size_t)(j + c);
			float v = g->alpha * s[r][c];
			*cp = g->beta == 0 ? v : v + g->beta * *cp; /* beta 0: C may hold NaN */
		}
}

KL_CPU_CLONES void kl__gemm_small(const kl_gemm_small *g, int j0, int j1)
{
	int m = g->m, k = g->k;
	for (int j = j0; j < j1; j += 4) {
		int nr = j1 - j < 4 ? j1 - j : 4;
		const float *w[4];
		for (int c = 0; c < 4; c++) /* a short block repeats its first row */
			w[c] = g->W + (size_t)(j + (c < nr ? c : 0)) * (size_t)g->ldw;
		for (int i = 0; i < m; i += 4) {
			int mr = m - i < 4 ? m - i : 4;
			const float *a[4];
			for (int r = 0; r < 4; r++)
				a[r] = g->A + (size_t)(i + (r < mr ? r : 0)) * (size_t)g->lda;
			float s[4][4];
			int p = 0;
#ifdef GS_VEC
			gs_v8 c00 = {0}, c01 = {0}, c02 = {0}, c03 = {0}, c10 = {0}, c11 = {0},
			      c12 = {0}, c13 = {0}, c20 = {0}, c21 = {0}, c22 = {0}, c23 = {0},
			      c30 = {0}, c31 = {0}, c32 = {0}, c33 = {0};
			for (; p + 8 <= k; p += 8) {
				gs_v8 b0, b1, b2, b3, x;
				GS_LD(b0, w[0] + p);
				GS_LD(b1, w[1] + p);
				GS_LD(b2, w[2] + p);
				GS_LD(b3, w[3] + p);
				GS_LD(x, a[0] + p);
				c00 += x * b0, c01 += x * b1, c02 += x * b2, c03 += x * b3;
				GS_LD(x, a[1] + p);
				c10 += x * b0, c11 += x * b1, c12 += x * b2, c13 += x * b3;
				GS_LD(x, a[2] + p);
				c20 += x * b0, c21 += x * b1, c22 += x * b2, c23 += x * b3;
				GS_LD(x, a[3] + p);
				c30 += x * b0, c31 += x * b1, c32 += x * b2, c33 += x * b3;
			}
			/* lanes 2r + c: (row r, column c) of columns 0-1, then 2-3 */
			gs_v8 s01, s23;
			GS_REDUCE8(s01, c00, c01, c10, c11, c20, c21, c30, c31);
			GS_REDUCE8(s23, c02, c03, c12, c13, c22, c23, c32, c33);
			for (int r = 0; r < 4; r++) {
				s[r][0] = s01[2 * r];
				s[r][1] = s01[2 * r + 1];
				s[r][2] = s23[2 * r];
				s[r][3] = s23[2 * r + 1];
			}
#else
			memset(s, 0, sizeof s);
#endif
			for (; p < k; p++)
				for (int r = 0; r < 4; r++)
					for (int c = 0; c < 4; c++)
						s[r][c] += a[r][p] * w[c][p];
			put_block(g, i, j, mr, nr, s);
		}
	}
}
