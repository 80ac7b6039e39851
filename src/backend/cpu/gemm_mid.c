/* gemm_mid.c - kiln's own f32 product for medium shapes on AVX-512:
 * C = alpha A B + beta C with A m x k (k contiguous) and B either a weight
 * stored row by row, n x k (the Linear layer's x W^T), or k x n.
 *
 * Why: the CPU FFN's products (512x1408x512, 512x512x1408) went to
 * OpenBLAS 0.3.21, whose SkylakeX kernel ran them at about 92 GFLOP/s a
 * core on the 2-core Zen 4 (ONNX Runtime's MLAS: about 110).
 *
 * How: B is packed per call, a block at a time (the whole depth up to
 * GM_KC, columns for about GM_BBLOCK bytes), into panels of GM_NR (32)
 * columns, each panel k-major (32 floats per step of k), zero past n; a
 * row-major weight is transposed 16 x 16 in registers on the way. A tile of
 * GM_MR (12) rows of C by one panel keeps 12 x 2 zmm accumulators over the
 * block's k: each step loads the panel's two vectors once and broadcasts
 * one float of each of the 12 rows of A, read where it lies (A's rows stay
 * near while the panels of the block stream past them from L2; where the
 * rows are a multiple of 4 KiB apart, all in one L1 set, a row block is
 * copied first). A row block sweeps every panel of the
 * B block before the next row block starts; on the block's last k the row
 * block's columns go through the epilogue (residual, bias, activation)
 * while they are in L1. Threads take shares of C's columns (each packs only
 * its share of B), or of its rows when there are few columns.
 *
 * Built only for AVX-512 (GCC's target attribute; picked at run time):
 * elsewhere kl__gemm_mid_fits says no and products stay with OpenBLAS.
 */
#include <stdlib.h>

#include "backend/cpu/cpu.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define GM_ON 1
#endif

#ifdef GM_ON
#define GM_MR 12
#define GM_NV 2 /* vectors of 16 a row */
#define GM_NR (16 * GM_NV)
#ifndef GM_KC
#define GM_KC 2048
#endif
#ifndef GM_BBLOCK
#define GM_BBLOCK (512 * 1024)
#endif
#define GM_NC_MIN 64
#define GM_NC_MAX 768
#define GM_TARGET __attribute__((target("arch=x86-64-v4")))

typedef float gm_v16 __attribute__((vector_size(64)));
typedef int gm_v16i __attribute__((vector_size(64)));

typedef struct gm_job {
	kl_gemm_small g;
	bool w_kn;   /* B stored k x n (else n x k) */
	bool rows;   /* threads split C's rows (else its columns) */
	int pieces;
	int kb, nc;  /* B's blocks: kb deep, nc columns */
	bool acopy;  /* A's rows alias in L1: each row block copied first */
	float *pack; /* pieces x kb x nc floats, 64-byte aligned */
	/* B packed ahead (kl__gemm_mid_pack): panel p of GM_NR columns at
	 * pre + p GM_NR k, k-major; NULL: each block packed here */
	const float *pre;
} gm_job;

static bool gm_avx512(void)
{
	static int have; /* 0 unknown, 1 no, 2 yes; a race stores the same value */
	int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
	if (!h) {
		__builtin_cpu_init();
		h = __builtin_cpu_supports("x86-64-v4") ? 2 : 1;
		__atomic_store_n(&have, h, __ATOMIC_RELAXED);
	}
	return h == 2;
}

/* 16 rows of 16 floats (row stride ld) into 16 rows of 16 (row stride
 * GM_NR), transposed: four rounds, round s swapping the off-diagonal s x s
 * blocks of each 2s x 2s block (rows i and i + s trade their lanes with
 * bit s set in i's for those with it clear in i + s's) */
#define GM_SWAP(S, LO0, LO1, LO2, LO3, LO4, LO5, LO6, LO7, HI0, HI1, HI2, HI3, HI4, HI5, HI6,  \
                HI7)                                                                        \
	for (int i = 0; i < 16; i++)                                                        \
		if (!(i & (S))) {                                                           \
			gm_v16 x = v[i], y = v[i + (S)];                                    \
			v[i] = __builtin_shuffle(x, y, (gm_v16i){LO0, LO1, LO2, LO3, LO4, LO5, LO6, \
			                                         LO7, HI0, HI1, HI2, HI3, HI4, HI5,  \
			                                         HI6, HI7});                        \
			v[i + (S)] = __builtin_shuffle(                                     \
			        x, y, (gm_v16i){LO0 + (S), LO1 + (S), LO2 + (S), LO3 + (S),     \
			                        LO4 + (S), LO5 + (S), LO6 + (S), LO7 + (S),     \
			                        HI0 + (S), HI1 + (S), HI2 + (S), HI3 + (S),     \
			                        HI4 + (S), HI5 + (S), HI6 + (S), HI7 + (S)});   \
		}

GM_TARGET static inline void gm_transpose16(const float *s, size_t ld, float *d, bool pf)
{
	gm_v16 v[16];
	for (int i = 0; i < 16; i++) {
		memcpy(&v[i], s + (size_t)i * ld, sizeof v[i]);
		/* the row's line 4 blocks on, where the row has one (the 32
		 * rows of a panel are 32 streams, more than the hardware
		 * follows: 1-4% of the FFN's products) */
		if (pf)
			__builtin_prefetch(s + (size_t)i * ld + 64);
	}
	GM_SWAP(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30)
	GM_SWAP(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29)
	GM_SWAP(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27)
	GM_SWAP(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
	for (int i = 0; i < 16; i++)
		memcpy(d + (size_t)i * GM_NR, &v[i], sizeof v[i]);
}
#undef GM_SWAP

/* B's depth [p0, p0 + kc) by columns [j0, j0 + nc) into panels of GM_NR
 * columns, k-major, zero past nc */
GM_TARGET static void gm_pack(const gm_job *jb, float *dst, int p0, int kc, int j0, int nc)
{
	const kl_gemm_small *g = &jb->g;
	size_t ld = (size_t)g->ldw;
	for (int jp = 0; jp < nc; jp += GM_NR) {
		int w = nc - jp < GM_NR ? nc - jp : GM_NR;
		float *d = dst + (size_t)jp * (size_t)kc;
		if (jb->w_kn) {
			const float *s = g->W + (size_t)p0 * ld + (size_t)(j0 + jp);
			for (int p = 0; p < kc; p++) {
				const float *sp = s + (size_t)p * ld;
				float *dp = d + (size_t)p * GM_NR;
				for (int c = 0; c < w; c++)
					dp[c] = sp[c];
				for (int c = w; c < GM_NR; c++)
					dp[c] = 0;
			}
			continue;
		}
		const float *s = g->W + (size_t)(j0 + jp) * ld + (size_t)p0;
		int p = 0;
		if (w == GM_NR)
			for (; p + 16 <= kc; p += 16)
				for (int h = 0; h < GM_NR; h += 16)
					gm_transpose16(s + (size_t)h * ld + (size_t)p, ld,
					               d + (size_t)p * GM_NR + (size_t)h,
					               p + 80 <= kc);
		for (int c = 0; c < w; c++)
			for (int q = p; q < kc; q++)
				d[(size_t)q * GM_NR + (size_t)c] = s[(size_t)c * ld + (size_t)q];
		for (int c = w; c < GM_NR; c++)
			for (int q = 0; q < kc; q++)
				d[(size_t)q * GM_NR + (size_t)c] = 0;
	}
}

/* how a tile is stored: the first block of k over C (beta 0: C is not
 * read, it may hold NaN), or another block of k added to it */
enum { GM_SET, GM_SET_BETA, GM_ADD };

/* C's tile, fetched for writing while the sums run */
#define GM_PREFETCH_C(MR)                                                                   \
	for (int r = 0; r < MR; r++)                                                        \
		for (int v = 0; v < GM_NV; v++)                                             \
			__builtin_prefetch(c + (size_t)r * ldc + 16 * v, 1);

/* rows [0, MR) of C (row stride ldc) by columns [0, nr) of one panel b:
 * the sums over kc of a[r][p] * b[p][c] */
#define GM_TILE(NAME, MR)                                                                   \
	GM_TARGET static void NAME(int kc, const float *a, size_t lda, const float *b,      \
	                           float *c, size_t ldc, int nr, float alpha, float beta,   \
	                           int mode)                                                \
	{                                                                                   \
		gm_v16 s[MR][GM_NV];                                                        \
		_Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)                       \
		        _Pragma("GCC unroll 4") for (int v = 0; v < GM_NV; v++) s[r][v] =   \
		                (gm_v16){0};                                                \
		GM_PREFETCH_C(MR)                                                           \
		for (int p = 0; p < kc; p++) {                                              \
			gm_v16 bv[GM_NV];                                                   \
			_Pragma("GCC unroll 4") for (int v = 0; v < GM_NV; v++)             \
			        memcpy(&bv[v], b + (size_t)p * GM_NR + 16 * v, sizeof bv[v]); \
			_Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)               \
			{                                                                   \
				float x = a[(size_t)r * lda + (size_t)p];                   \
				_Pragma("GCC unroll 4") for (int v = 0; v < GM_NV; v++)     \
				        s[r][v] += x * bv[v];                               \
			}                                                                   \
		}                                                                           \
		if (nr == GM_NR) {                                                          \
			_Pragma("GCC unroll 12") for (int r = 0; r < MR; r++)               \
			        _Pragma("GCC unroll 4") for (int v = 0; v < GM_NV; v++)     \
			{                                                                   \
				float *cp = c + (size_t)r * ldc + 16 * v;                   \
				gm_v16 o, y = alpha * s[r][v];                              \
				if (mode != GM_SET) {                                       \
					memcpy(&o, cp, sizeof o);                           \
					y += (mode == GM_ADD ? 1.0f : beta) * o;            \
				}                                                           \
				memcpy(cp, &y, sizeof y);                                   \
			}                                                                   \
			return;                                                             \
		}                                                                           \
		for (int r = 0; r < MR; r++) {                                              \
			float t[GM_NR], *cp = c + (size_t)r * ldc;                          \
			memcpy(t, s[r], sizeof t);                                          \
			for (int q = 0; q < nr; q++) {                                      \
				float v = alpha * t[q];                                     \
				cp[q] = mode == GM_SET    ? v                               \
				        : mode == GM_ADD ? cp[q] + v                        \
				                          : v + beta * cp[q];               \
			}                                                                   \
		}                                                                           \
	}

GM_TILE(gm_tile_big, GM_MR)
GM_TILE(gm_tile8, 8)
GM_TILE(gm_tile4, 4)
GM_TILE(gm_tile2, 2)
GM_TILE(gm_tile1, 1)

/* rows [i0, i0 + mr) (mr <= GM_MR) by one panel: the 12-row tile, the
 * last rows in tiles of 8, 4, 2 and 1 */
GM_TARGET static void gm_rows(int mr, int kc, const float *a, size_t lda, const float *b,
                              float *c, size_t ldc, int nr, float alpha, float beta, int mode)
{
	if (mr == GM_MR) {
		gm_tile_big(kc, a, lda, b, c, ldc, nr, alpha, beta, mode);
		return;
	}
	int i = 0;
#define GM_PART(T, R)                                                                        \
	if (mr - i >= (R)) {                                                                 \
		T(kc, a + (size_t)i * lda, lda, b, c + (size_t)i * ldc, ldc, nr, alpha, beta, mode); \
		i += (R);                                                                    \
	}
#if GM_MR > 8
	GM_PART(gm_tile8, 8)
#endif
	GM_PART(gm_tile4, 4)
	GM_PART(gm_tile2, 2)
	GM_PART(gm_tile1, 1)
#undef GM_PART
}

/* C's rows [i0, i1) by columns [j0, j1) through the epilogue:
 * C = act(C + rbeta R + bias) */
static void gm_epilogue(const kl_gemm_small *g, int i0, int i1, int j0, int j1)
{
	enum { CH = 256 };
	float t[CH];
	for (int i = i0; i < i1; i++) {
		float *c = g->C + (size_t)i * (size_t)g->ldc;
		if (g->R) {
			const float *r = g->R + (size_t)i * (size_t)g->ldr;
			float rb = g->rbeta;
			KL_SIMD
			for (int j = j0; j < j1; j++)
				c[j] += rb * r[j];
		}
		if (g->bias) {
			const float *b = g->bias;
			KL_SIMD
			for (int j = j0; j < j1; j++)
				c[j] += b[j];
		}
		if (g->act != KL_OP_INPUT)
			for (int j = j0; j < j1; j += CH) {
				int len = j1 - j < CH ? j1 - j : CH;
				memcpy(t, c + j, (size_t)len * sizeof(float));
				kl__cpu_unary_f32(g->act, t, c + j, len);
			}
	}
}

/* C's rows [i0, i1) by columns [j0, j1), B packed into pack */
GM_TARGET static void gm_block(const gm_job *jb, int i0, int i1, int j0, int j1, float *pack)
{
	float *abuf = jb->pre ? pack : pack + (size_t)jb->kb * (size_t)jb->nc;
	const kl_gemm_small *g = &jb->g;
	int k = g->k;
	bool epi = g->R || g->bias || g->act != KL_OP_INPUT;
	size_t lda = (size_t)g->lda, ldc = (size_t)g->ldc;
	int kb = jb->kb;
	for (int jc = j0; jc < j1; jc += jb->nc) {
		int nc = j1 - jc < jb->nc ? j1 - jc : jb->nc;
		for (int pc = 0; pc < k; pc += kb) {
			int kc = k - pc < kb ? k - pc : kb;
			int mode = pc > 0 ? GM_ADD : g->beta == 0 ? GM_SET : GM_SET_BETA;
			bool last = pc + kc >= k;
			if (!jb->pre)
				gm_pack(jb, pack, pc, kc, jc, nc);
			for (int i = i0; i < i1; i += GM_MR) {
				int mr = i1 - i < GM_MR ? i1 - i : GM_MR;
				const float *a = g->A + (size_t)i * lda + (size_t)pc;
				size_t la = lda;
				if (jb->acopy) {
					la = (size_t)kb + 16;
					for (int r = 0; r < mr; r++)
						memcpy(abuf + (size_t)r * la, a + (size_t)r * lda,
						       (size_t)kc * sizeof(float));
					a = abuf;
				}
				float *c = g->C + (size_t)i * ldc + (size_t)jc;
				for (int jr = 0; jr < nc; jr += GM_NR) {
					int nr = nc - jr < GM_NR ? nc - jr : GM_NR;
					const float *b =
					        jb->pre ? jb->pre + (size_t)(jc + jr) * (size_t)k +
					                          (size_t)pc * GM_NR
					                : pack + (size_t)jr * (size_t)kc;
					gm_rows(mr, kc, a, la, b, c + jr, ldc, nr, g->alpha, g->beta,
					        mode);
				}
				if (last && epi)
					gm_epilogue(g, i, i + mr, jc, jc + nc);
			}
		}
	}
}

/* [lo, hi) of n items for piece t of nt, in multiples of align */
static void gm_share(int n, int t, int nt, int align, int *lo, int *hi)
{
	int64_t per = ((int64_t)n + nt - 1) / nt;
	per = (per + align - 1) / align * align;
	int64_t a = (int64_t)t * per < n ? (int64_t)t * per : n;
	*lo = (int)a;
	*hi = (int)(a + per < n ? a + per : n);
}

/* a thread's packed B (none when packed ahead) and copy of A's rows */
static size_t gm_piece_floats(const gm_job *jb)
{
	size_t a = jb->acopy ? (size_t)GM_MR * ((size_t)jb->kb + 16) : 0;
	size_t b = jb->pre ? 0 : (size_t)jb->kb * (size_t)jb->nc;
	return (b + a + 15) / 16 * 16;
}

static void gm_chunk(void *arg, int64_t p0, int64_t p1)
{
	const gm_job *jb = arg;
	const kl_gemm_small *g = &jb->g;
	for (int64_t p = p0; p < p1; p++) {
		int lo, hi;
		float *pack = jb->pack + (size_t)p * gm_piece_floats(jb);
		if (jb->rows) {
			gm_share(g->m, (int)p, jb->pieces, GM_MR, &lo, &hi);
			if (lo < hi)
				gm_block(jb, lo, hi, 0, g->n, pack);
		} else {
			gm_share(g->n, (int)p, jb->pieces, GM_NR, &lo, &hi);
			if (lo < hi)
				gm_block(jb, 0, g->m, lo, hi, pack);
		}
	}
}
#endif

bool kl__gemm_mid_fits(int m, int n, int k)
{
#ifdef GM_ON
	if (!gm_avx512())
		return false;
	/* measured on the 2-core Zen 4 against OpenBLAS 0.3.21 (2 threads,
	 * ms): ahead at 512x1408x512 3.46 against 3.86, 512x512x1408 3.47 /
	 * 3.80, 1024^3 11.2 / 11.8, 2048x1536x1536 46.4 / 48.7, 512x512x64
	 * 0.31 / 0.33, 96x256x256 0.126 / 0.140; behind at 256x256x64 0.057 /
	 * 0.048, 64^3, and 2048^3 95.7 / 89.7 (A, 16 MiB, streamed from L3
	 * once for every block of B): at most 2^22 multiply-adds and A of
	 * 2^22 floats or more stay with OpenBLAS. So do k under 32 (2048x256x24
	 * 0.238 / 0.145, 128x8192x16 0.536 / 0.476; 128x8192x32 0.445 / 0.535)
	 * and n under 64 (1024x48x1024 0.669 / 0.555, the second panel half
	 * empty; 1024x64x1024 1.30 / 1.37), and k past GM_KC, where C is
	 * read again for each block of k (256x768x3072: 6.71 / 6.35) */
	int64_t mk = (int64_t)m * k;
	return m >= 16 && n >= 64 && k >= 32 && k <= GM_KC && mk * n > (1 << 22) &&
	       mk < (1 << 22);
#else
	(void)m;
	(void)n;
	(void)k;
	return false;
#endif
}

size_t kl__gemm_mid_packed_floats(int n, int k)
{
#ifdef GM_ON
	return ((size_t)n + GM_NR - 1) / GM_NR * GM_NR * (size_t)k;
#else
	(void)n;
	(void)k;
	return 0; /* nothing is packed where gemm_mid is not built */
#endif
}

bool kl__gemm_mid_pack(const kl_gemm_small *g, bool w_kn, float *dst)
{
#ifdef GM_ON
	if (!gm_avx512())
		return false;
	gm_job jb = {.g = *g, .w_kn = w_kn};
	/* a panel at a time, the whole depth: panel p lands at p GM_NR k */
	for (int j = 0; j < g->n; j += GM_NR)
		gm_pack(&jb, dst + (size_t)j * (size_t)g->k, 0, g->k, j,
		        g->n - j < GM_NR ? g->n - j : GM_NR);
	return true;
#else
	(void)g;
	(void)w_kn;
	(void)dst;
	return false;
#endif
}

bool kl__gemm_mid_packed_fits(int m, int n, int k)
{
#ifdef GM_ON
	/* with B packed ahead, measured against gemm_small and against this
	 * product packing per call on the 2-core Zen 4 (2 threads, us, +bias;
	 * then +bias+GELU): 8x256x256 10.2 / 11.2 / 17.3, 8.0 / 9.9 / 14.5;
	 * 64x768x256 144 / 165 / 168; 128x768x256 277 / 333 / 301;
	 * 128x2048x256 662 / 890 / 722, 863 / 1021 / 914; 128x256x1024 330 /
	 * 352 / 360; 512x1408x512 3553 / 4411 / 3726. Ahead or even at every
	 * row count from 4 (few-row tiles past that); the limits of k and of A
	 * are kl__gemm_mid_fits's. */
	int64_t mk = (int64_t)m * k;
	return gm_avx512() && m >= 4 && n >= 64 && k >= 32 && k <= GM_KC && mk < (1 << 22);
#else
	(void)m;
	(void)n;
	(void)k;
	return false;
#endif
}

bool kl__gemm_mid_par(int nt, const kl_gemm_small *g, bool w_kn, const float *pre)
{
#ifdef GM_ON
	if (!gm_avx512())
		return false;
	gm_job jb = {.g = *g, .w_kn = w_kn, .pre = pre};
	bool par = nt > 1 && !kl__par_active();
	int pieces = par ? nt : 1;
	/* columns in panels, two a thread at least; else rows */
	jb.rows = par && g->n < 2 * GM_NR * nt;
	jb.pieces = pieces;
	/* k in equal blocks of at most GM_KC; columns so that a block of B
	 * takes about GM_BBLOCK */
	int nkb = (g->k + GM_KC - 1) / GM_KC;
	jb.kb = (g->k + nkb - 1) / nkb;
	int nc = (int)(GM_BBLOCK / sizeof(float) / (size_t)jb.kb) / GM_NR * GM_NR;
	jb.nc = nc < GM_NC_MIN ? GM_NC_MIN : nc > GM_NC_MAX ? GM_NC_MAX : nc;
	jb.nc = (jb.nc + GM_NR - 1) / GM_NR * GM_NR;
	jb.acopy = g->lda % 1024 == 0;
	size_t bytes = (size_t)pieces * gm_piece_floats(&jb) * sizeof(float);
	jb.pack = aligned_alloc(64, bytes ? bytes : 64);
	if (!jb.pack)
		return false;
	kl__par_for(par ? nt : 1, pieces, gm_chunk, &jb);
	free(jb.pack);
	return true;
#else
	(void)nt;
	(void)g;
	(void)w_kn;
	(void)pre;
	return false;
#endif
}
