/* gemm_mid.c - kiln's own f32 product for medium shapes on AVX-512 and
 * AVX2: C = alpha A B + beta C with A m x k (k contiguous) and B either a
 * weight stored row by row, n x k (the Linear layer's x W^T), or k x n.
 *
 * Why: the CPU FFN's products (512x1408x512, 512x512x1408) went to
 * OpenBLAS 0.3.21, whose SkylakeX kernel ran them at about 92 GFLOP/s a
 * core on the 2-core Zen 4 (ONNX Runtime's MLAS: about 110); on the Zen 3
 * (AVX2), the DecoderLayer's 128-row products ran at 79 GFLOP/s on two
 * cores through OpenBLAS's Haswell kernel.
 *
 * How: B is packed per call, a block at a time (the whole depth up to
 * GM_KC, columns for about GM_BBLOCK bytes), into panels of two vectors'
 * columns (32 on AVX-512, 16 on AVX2), each panel k-major, zero past n; a
 * row-major weight is transposed a vector square at a time in registers
 * on the way. A tile of MR rows of C by one panel (12 on AVX-512, 6 on
 * AVX2) keeps MR x 2 accumulators over the block's k: each step loads the
 * panel's two vectors once and broadcasts one float of each of the MR
 * rows of A, read where it lies (A's rows stay near while the panels of
 * the block stream past them from L2; where the rows are a multiple of 4
 * KiB apart, all in one L1 set, a row block is copied first). A row block
 * sweeps every panel of the B block before the next row block starts; on
 * the block's last k the row block's columns go through the epilogue
 * (residual, bias, activation) while they are in L1. Threads take shares
 * of C's columns (each packs only its share of B), or of its rows when
 * there are few columns.
 *
 * The vector-width half is gemm_mid_isa.h, built twice (GCC's target
 * attribute) and picked at run time; without AVX2 and FMA
 * kl__gemm_mid_fits says no and products stay with OpenBLAS.
 */
#include <stdlib.h>

#include "backend/cpu/cpu.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define GM_ON 1
#endif

#ifdef GM_ON
#ifndef GM_KC
#define GM_KC 2048
#endif
#ifndef GM_BBLOCK
#define GM_BBLOCK (512 * 1024)
#endif
#define GM_NC_MIN 64
#define GM_NC_MAX 768

struct gm_isa;

typedef struct gm_job {
	kl_gemm_small g;
	const struct gm_isa *isa;
	bool w_kn;   /* B stored k x n (else n x k) */
	bool rows;   /* threads split C's rows (else its columns) */
	int pieces;
	int kb, nc;  /* B's blocks: kb deep, nc columns */
	bool acopy;  /* A's rows alias in L1: each row block copied first */
	float *pack; /* pieces x kb x nc floats, 64-byte aligned */
	/* B packed ahead (kl__gemm_mid_pack): panel p of nr columns at
	 * pre + p nr k, k-major; NULL: each block packed here */
	const float *pre;
} gm_job;

/* one instruction set's half (gemm_mid_isa.h): a panel is nr columns, a
 * tile mr rows */
typedef struct gm_isa {
	int nr, mr;
	void (*pack)(const gm_job *jb, float *dst, int p0, int kc, int j0, int nc);
	void (*block)(const gm_job *jb, int i0, int i1, int j0, int j1, float *pack);
} gm_isa;

/* how a tile is stored: the first block of k over C (beta 0: C is not
 * read, it may hold NaN), or another block of k added to it */
enum { GM_SET, GM_SET_BETA, GM_ADD };

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

#define GMI(x) x##_v4
#define GMI_VW 16
#define GMI_MR 12
#define GMI_TARGET __attribute__((target("arch=x86-64-v4")))
#include "backend/cpu/gemm_mid_isa.h"
#undef GMI
#undef GMI_VW
#undef GMI_MR
#undef GMI_TARGET

/* 6 x 2 ymm accumulators, the panel's two and a broadcast: 15 of 16 */
#define GMI(x) x##_v3
#define GMI_VW 8
#define GMI_MR 6
#define GMI_TARGET __attribute__((target("arch=x86-64-v3")))
#include "backend/cpu/gemm_mid_isa.h"
#undef GMI
#undef GMI_VW
#undef GMI_MR
#undef GMI_TARGET

static int gm_forced; /* kl__gemm_mid_force_isa: 0 (none forced), 1 (off), 3 or 4 */

/* the widest half this CPU runs (or the one a test forced); NULL: none */
static const gm_isa *gm_pick(void)
{
	static int have; /* 0 unknown, 1 none, 3 or 4; a race stores the same value */
	int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
	if (!h) {
		__builtin_cpu_init();
		h = __builtin_cpu_supports("x86-64-v4")   ? 4
		    : __builtin_cpu_supports("x86-64-v3") ? 3
		                                          : 1;
		__atomic_store_n(&have, h, __ATOMIC_RELAXED);
	}
	int f = __atomic_load_n(&gm_forced, __ATOMIC_RELAXED);
	if (f && f <= h)
		h = f;
	return h == 4 ? &gm_isa_v4 : h == 3 ? &gm_isa_v3 : NULL;
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
	size_t a = jb->acopy ? (size_t)jb->isa->mr * ((size_t)jb->kb + 16) : 0;
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
			gm_share(g->m, (int)p, jb->pieces, jb->isa->mr, &lo, &hi);
			if (lo < hi)
				jb->isa->block(jb, lo, hi, 0, g->n, pack);
		} else {
			gm_share(g->n, (int)p, jb->pieces, jb->isa->nr, &lo, &hi);
			if (lo < hi)
				jb->isa->block(jb, 0, g->m, lo, hi, pack);
		}
	}
}
#endif

bool kl__gemm_mid_fits(int m, int n, int k)
{
#ifdef GM_ON
	if (!gm_pick())
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
	/* the widest panel's rounding, whichever half packs */
	return ((size_t)n + 31) / 32 * 32 * (size_t)k;
#else
	(void)n;
	(void)k;
	return 0; /* nothing is packed where gemm_mid is not built */
#endif
}

bool kl__gemm_mid_pack(const kl_gemm_small *g, bool w_kn, float *dst)
{
#ifdef GM_ON
	const gm_isa *isa = gm_pick();
	if (!isa)
		return false;
	gm_job jb = {.g = *g, .isa = isa, .w_kn = w_kn};
	/* every column, the whole depth: panel p lands at p nr k */
	isa->pack(&jb, dst, 0, g->k, 0, g->n);
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
	return gm_pick() && m >= 4 && n >= 64 && k >= 32 && k <= GM_KC && mk < (1 << 22);
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
	const gm_isa *isa = gm_pick();
	if (!isa)
		return false;
	gm_job jb = {.g = *g, .isa = isa, .w_kn = w_kn, .pre = pre};
	int nr = isa->nr;
	bool par = nt > 1 && !kl__par_active();
	int pieces = par ? nt : 1;
	/* columns in panels, two a thread at least; else rows */
	jb.rows = par && g->n < 2 * nr * nt;
	jb.pieces = pieces;
	/* k in equal blocks of at most GM_KC; columns so that a block of B
	 * takes about GM_BBLOCK */
	int nkb = (g->k + GM_KC - 1) / GM_KC;
	jb.kb = (g->k + nkb - 1) / nkb;
	int nc = (int)(GM_BBLOCK / sizeof(float) / (size_t)jb.kb) / nr * nr;
	jb.nc = nc < GM_NC_MIN ? GM_NC_MIN : nc > GM_NC_MAX ? GM_NC_MAX : nc;
	jb.nc = (jb.nc + nr - 1) / nr * nr;
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

int kl__gemm_mid_force_isa(int level)
{
#ifdef GM_ON
	__atomic_store_n(&gm_forced, level == 1 || level == 3 || level == 4 ? level : 0,
	                 __ATOMIC_RELAXED);
	const gm_isa *isa = gm_pick();
	return !isa ? 0 : isa == &gm_isa_v4 ? 4 : 3;
#else
	(void)level;
	return 0;
#endif
}
