/* gemm_small.c - kiln's own f32 product for few rows against a weight stored
 * row by row: C = alpha A W^T + beta C with A m x k (m small) and W n x k,
 * both with k contiguous (the Linear layer's x W^T).
 *
 * Why: OpenBLAS packs all of W before it multiplies, which a product of 8
 * rows cannot repay: mlp24's 8x256x256 steps ran at 47 GFLOP/s on one core
 * of the 2-core machine, 4x256x1024 at 12. Here each C element is a dot
 * product of an A row and a W row, read where they lie: a block of MR rows
 * of A and NR rows of W keeps MR x NR vector accumulators over k, every W
 * vector loaded once and used MR times, and the accumulators' lanes are
 * summed by one shuffle tree per 8. A (a few KiB) stays in L1 and a block's
 * W rows stay there while every row block of A passes over them, so W is
 * read once. The block is sized per instruction set (registers): AVX-512
 * 4 x 4 of 16 lanes, AVX2+FMA 4 x 3 of 8 lanes (the 4 x 4 block of 8 lanes
 * this file had, built once for every clone, spilled on AVX2 and ran 72
 * GFLOP/s on AVX-512: 100 now); the functions are built for each with GCC's
 * target attribute (target_clones builds one body, one block size) and one
 * is picked at the first call. The multiply-adds are FMAs (CMakeLists.txt).
 * A product step's epilogue (residual, bias, activation) runs on each panel
 * of 64 columns as soon as it is done, from L1, on the thread that computed
 * it. OpenBLAS is ahead somewhere past 128 rows (kl__gemm_small_fits).
 */
#include "backend/cpu/cpu.h"

#if defined(__GNUC__) || defined(__clang__)
#define GS_VEC 1
typedef float gs_v8 __attribute__((vector_size(32)));
typedef float gs_v16 __attribute__((vector_size(64)));
typedef int gs_v8i __attribute__((vector_size(32)));
#if defined(__clang__)
#define GS_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define GS_SHUF(a, b, ...) __builtin_shuffle(a, b, (gs_v8i){__VA_ARGS__})
#endif
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

/* GCC on x86-64 Linux (where KL_CPU_CLONES builds clones): a kernel per
 * instruction set, picked at the first call */
#if defined(GS_VEC) && defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) &&     \
        defined(__linux__)
#define GS_TARGETS 1
#endif

bool kl__gemm_small_fits(int m, int n, int k)
{
#ifdef GS_VEC
	/* measured against OpenBLAS on one core: ahead from 2 rows to 32, and
	 * only once k fills a few vectors. With the 4 x 4 AVX-512 block and the
	 * fused epilogue also at 128 rows (the small DecoderLayer's products on
	 * 2 threads, a loaded machine: 128x768x256 +bias 553-573 us against
	 * 675-691, 128x256x1024 +residual 700 against 1018-1050), not at 512
	 * (swiglu_ffn 13.0 ms against 11.5) */
	return m >= 2 && m <= 128 && n >= 4 && k >= 32;
#else
	(void)m;
	(void)n;
	(void)k;
	return false;
#endif
}

#ifdef GS_VEC
/* A 16-lane vector folded onto 8 lanes (lane i + lane i + 8), and an 8-lane
 * one as it is: macros, since a vector returned by value changes the ABI */
#define GS_FOLD16(v) (GS_SHUF16_LO(v) + GS_SHUF16_HI(v))
#define GS_SHUF16_LO(v) __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
#define GS_SHUF16_HI(v) __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
#define GS_FOLD8(v) (v)

/* C's rows [i, i + mr) and columns [j, j + nr) from their sums s (row r,
 * column c at s[r * ns + c]) */
static inline __attribute__((always_inline)) void gs_put(const kl_gemm_small *g, int i, int j,
                                                         int mr, int nr, const float *s, int ns)
{
	for (int r = 0; r < mr; r++) {
		float *cp = g->C + (size_t)(i + r) * (size_t)g->ldc + (size_t)j;
		for (int c = 0; c < nr; c++) {
			float v = g->alpha * s[r * ns + c];
			/* beta 0: C may hold NaN */
			cp[c] = g->beta == 0 ? v : v + g->beta * cp[c];
		}
	}
}

/* Columns of a panel are finished before the next is started: the
 * epilogue then reads them from L1 */
#define GS_PANEL 64

/* C's columns [j0, j1) (at most GS_PANEL) through the epilogue, row by row */
static void gs_epilogue(const kl_gemm_small *g, int j0, int j1)
{
	int len = j1 - j0;
	float t[GS_PANEL];
	for (int i = 0; i < g->m; i++) {
		float *c = g->C + (size_t)i * (size_t)g->ldc + (size_t)j0;
		if (g->R) {
			const float *r = g->R + (size_t)i * (size_t)g->ldr + (size_t)j0;
			float rb = g->rbeta;
			KL_SIMD
			for (int j = 0; j < len; j++)
				c[j] += rb * r[j];
		}
		if (g->bias) {
			const float *b = g->bias + j0;
			KL_SIMD
			for (int j = 0; j < len; j++)
				c[j] += b[j];
		}
		if (g->act != KL_OP_INPUT) {
			memcpy(t, c, (size_t)len * sizeof(float));
			kl__cpu_unary_f32(g->act, t, c, len);
		}
	}
}

/* One block: the MR x NR sums of rows a[r] and w[c] over k into s (r-major),
 * VT vectors of L lanes along k, FOLD taking one down to 8 lanes. A short
 * block's extra a[] and w[] repeat a real row (their sums are not stored). */
#define GS_BLOCK(NAME, VT, L, MR, NR, FOLD)                                                 \
	static inline __attribute__((always_inline)) void NAME(                             \
	        const float *const *a, const float *const *w, int k, float *s)              \
	{                                                                                   \
		VT acc[MR][NR];                                                             \
		_Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                        \
		        _Pragma("GCC unroll 4") for (int c = 0; c < NR; c++) acc[r][c] =    \
		                (VT){0};                                                    \
		int p = 0;                                                                  \
		for (; p + L <= k; p += L) {                                                \
			VT b[NR], x;                                                        \
			_Pragma("GCC unroll 4") for (int c = 0; c < NR; c++)                \
			        memcpy(&b[c], w[c] + p, sizeof(VT));                        \
			_Pragma("GCC unroll 8") for (int r = 0; r < MR; r++)                \
			{                                                                   \
				memcpy(&x, a[r] + p, sizeof(VT));                           \
				_Pragma("GCC unroll 4") for (int c = 0; c < NR; c++)        \
				        acc[r][c] += x * b[c];                              \
			}                                                                   \
		}                                                                           \
		enum { N_ = MR * NR, G_ = (N_ + 7) / 8 };                                   \
		gs_v8 f[G_ * 8];                                                            \
		_Pragma("GCC unroll 32") for (int q = 0; q < G_ * 8; q++) f[q] =            \
		        q < N_ ? FOLD(acc[q / NR][q % NR]) : (gs_v8){0};                    \
		_Pragma("GCC unroll 4") for (int q = 0; q < G_; q++)                        \
		{                                                                           \
			gs_v8 o;                                                            \
			GS_REDUCE8(o, f[8 * q], f[8 * q + 1], f[8 * q + 2], f[8 * q + 3],   \
			           f[8 * q + 4], f[8 * q + 5], f[8 * q + 6], f[8 * q + 7]); \
			memcpy(s + 8 * q, &o, sizeof o);                                    \
		}                                                                           \
		for (; p < k; p++)                                                          \
			for (int r = 0; r < MR; r++)                                        \
				for (int c = 0; c < NR; c++)                                \
					s[r * NR + c] += a[r][p] * w[c][p];                 \
	}

/* C's columns [j0, j1): panels of GS_PANEL columns, in them blocks of NR
 * columns, in those blocks of MR rows (BIG), then of MR / 2 (SMALL, for the
 * last rows); each panel through the epilogue once it is done */
#define GS_DRIVER(NAME, ATTR, MR, NR, BIG, SMALL)                                           \
	ATTR static void NAME(const kl_gemm_small *g, int j0, int j1)                       \
	{                                                                                   \
		int m = g->m, k = g->k;                                                     \
		bool epi = g->R || g->bias || g->act != KL_OP_INPUT;                        \
		float s[MR * NR + 8];                                                       \
		for (int jp = j0; jp < j1; jp += GS_PANEL) {                                \
			int je = j1 - jp < GS_PANEL ? j1 : jp + GS_PANEL;                   \
			for (int j = jp; j < je; j += NR) {                                 \
				int nr = je - j < NR ? je - j : NR;                         \
				const float *w[NR];                                         \
				for (int c = 0; c < NR; c++)                                \
					w[c] = g->W + (size_t)(j + (c < nr ? c : 0)) *      \
					                      (size_t)g->ldw;               \
				int i = 0;                                                  \
				for (; i + MR <= m; i += MR) {                              \
					const float *a[MR];                                 \
					for (int r = 0; r < MR; r++)                        \
						a[r] = g->A + (size_t)(i + r) * (size_t)g->lda; \
					BIG(a, w, k, s);                                    \
					gs_put(g, i, j, MR, nr, s, NR);                     \
				}                                                           \
				for (; i < m; i += MR / 2) {                                \
					int mr = m - i < MR / 2 ? m - i : MR / 2;           \
					const float *a[MR / 2];                             \
					for (int r = 0; r < MR / 2; r++)                    \
						a[r] = g->A + (size_t)(i + (r < mr ? r : 0)) * \
						                      (size_t)g->lda;       \
					SMALL(a, w, k, s);                                  \
					gs_put(g, i, j, mr, nr, s, NR);                     \
				}                                                           \
			}                                                                   \
			if (epi)                                                            \
				gs_epilogue(g, jp, je);                                     \
		}                                                                           \
	}

GS_BLOCK(gs_block_4x2_v8, gs_v8, 8, 4, 2, GS_FOLD8)
GS_BLOCK(gs_block_2x2_v8, gs_v8, 8, 2, 2, GS_FOLD8)
GS_DRIVER(gs_generic, , 4, 2, gs_block_4x2_v8, gs_block_2x2_v8)

#ifdef GS_TARGETS
/* measured on the Zen 4 (8x256x256, W in L2, one core): AVX-512 4 x 4 of 16
 * lanes 100 GFLOP/s, 8 x 4 86, 8 x 3 71, 6 x 4 69, 4 x 5 80; AVX2 4 x 3 of
 * 8 lanes 81, 4 x 2 68, 4 x 4 (spilling) 48 */
GS_BLOCK(gs_block_4x4_v16, gs_v16, 16, 4, 4, GS_FOLD16)
GS_BLOCK(gs_block_2x4_v16, gs_v16, 16, 2, 4, GS_FOLD16)
GS_DRIVER(gs_avx512, __attribute__((target("arch=x86-64-v4"))), 4, 4, gs_block_4x4_v16,
          gs_block_2x4_v16)
GS_BLOCK(gs_block_4x3_v8, gs_v8, 8, 4, 3, GS_FOLD8)
GS_BLOCK(gs_block_2x3_v8, gs_v8, 8, 2, 3, GS_FOLD8)
GS_DRIVER(gs_avx2, __attribute__((target("arch=x86-64-v3"))), 4, 3, gs_block_4x3_v8,
          gs_block_2x3_v8)
#endif

typedef void (*gs_fn)(const kl_gemm_small *g, int j0, int j1);

static gs_fn gs_pick(void)
{
#ifdef GS_TARGETS
	__builtin_cpu_init();
	if (__builtin_cpu_supports("x86-64-v4"))
		return gs_avx512;
	if (__builtin_cpu_supports("x86-64-v3"))
		return gs_avx2;
#endif
	return gs_generic;
}
#endif

void kl__gemm_small(const kl_gemm_small *g, int j0, int j1)
{
#ifdef GS_VEC
	/* a race here stores the same pointer twice */
	static gs_fn fn;
	gs_fn f = __atomic_load_n(&fn, __ATOMIC_RELAXED);
	if (!f) {
		f = gs_pick();
		__atomic_store_n(&fn, f, __ATOMIC_RELAXED);
	}
	f(g, j0, j1);
#else
	(void)g;
	(void)j0;
	(void)j1;
#endif
}
