/* attention_cuda.c - attention steps on the GPU: picks a kernel of
 * attention_src.c for the step's dtype, head dim and layout, compiles that
 * variant once per device (NVRTC, kept until the device closes) and launches
 * it on the stream. f16/bf16 with head dim 64 or 128, dense rows and 16-byte
 * aligned operands take a tensor-core kernel: wgmma on sm_90 (compiled for
 * sm_90a), mma.sync elsewhere; few query rows (decode) take kl_attn_rows'
 * warp per (row, split of the keys), or with KILN_CUDA_ATTN_DEC=1 kl_attn_dec
 * (kl_attn_dec1 at any strides: a block per (row, split), not yet run on a
 * GPU, so not the default), the splits merged by kl_attn_combine; everything
 * else takes the general kernel. KILN_ATTENTION_KERNEL=simple|mma|wgmma forces one (a forced kernel
 * that cannot take the step falls back as above). The mma.sync and
 * kl_attn_wgmma grids are x = batch (up to 2^31 - 1), y = query blocks (up
 * to 65535), the
 * heaviest causal block first: the scheduler hands out every batch's
 * heaviest block before any lighter one. On sm_90 the wgmma kernel is
 * kl_attn_fa3 (attention_fa3_src.c: a producer warpgroup loads Q, K and V
 * with TMA into mbarrier-guarded stages, the two consumer warpgroups take
 * turns on the tensor cores) where each of q, k and v fits a 3-d tensor map
 * (tma_map) and the work items (batch, query block) number under 2^31 less
 * two SM counts, else kl_attn_wgmma with two warpgroups a block (cp.async
 * loads by the consumers themselves). kl_attn_fa3 is persistent: a 1-d grid
 * of min(items, SMs) blocks (one fits an SM), block x taking one item of
 * each round of grid items in the same heaviest-first order (x, then
 * 2 grid - 1 - x, 2 grid + x, ...: a heavy causal item, then a light one),
 * so that one item's epilogue and the next one's first loads overlap.
 * KILN_CUDA_ATTN_WG=0 takes the two-warpgroup kernel always,
 * KILN_CUDA_ATTN_WG=1 the one with one warpgroup per block (KL_AT_BM 64:
 * two blocks per SM whose softmax and products interleave). H200, B4 H16
 * T1024 D128 bf16: fa3 447 TFLOP/s, causal 51.1 us (run 16; 458 and 52.8
 * us before it was persistent), two warpgroups 372, causal 61 us.
 * The backward (attention_bwd_src.c) has two shapes: KILN_CUDA_ATTN_BWD
 * unset or fused, kl_attnb_kv adds each block's dQ into an f32 accumulator
 * that kl_attnb_dq scales; split, kl_attnb_kv_split gives only dK and dV and
 * kl_attnb_dq_split recomputes P and dS per query block for dQ (fewer
 * registers each, no accumulator, a second pass over the scores).
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/device.h"

/* kl_at_args of attention_src.c, field for field */
typedef struct kl_at_args {
	CUdeviceptr q, k, v, o, ws;
	long long tq, tk, d, dv;
	long long q_rs, q_cs, k_rs, k_cs, v_rs, v_cs, o_rs;
	long long rows;
	long long batch[6], q_bs[6], k_bs[6], v_bs[6], o_bs[6];
	double scale;
	float scale_log2;
	int nb, causal, nsplit;
	int tn0, tn1; /* kl_attn_fa3: its tensor maps' two inner batch dims */
	/* lengths (kl_sdpa_lengths), read on the device: element len_off +
	 * (b / len_div) * len_st of len (0: none), i32 when len_i32 */
	CUdeviceptr len;
	long long len_off, len_st, len_div;
	int len_i32;
	CUdeviceptr lse; /* kl_attn_wgmma, kl_attn_fa3: each row's L here too (0: not) */
	int dg, dc;      /* kl_attn_dec, kl_attn_dec1: lanes a key, chunks a lane */
} kl_at_args;

#define BM 64    /* query rows per block, mma.sync kernel */
#define BN 64    /* keys per tile, mma.sync kernel */
/* the wgmma kernel's shapes: two warpgroups a block (KILN_CUDA_ATTN_WG=0),
 * one (1), kl_attn_fa3 (unset or 2: two consumer warpgroups and a producer
 * warpgroup). Query rows per block = keys per tile (KL_AT_BM in its source),
 * threads per block (KL_AT_TH), K and V tiles in flight (KL_AT_WS), the
 * bytes of kl_attn_fa3's mbarriers (KL_AT_BB: Q's full and empty ones, a
 * full and an empty one per stage) and the shared memory they take (Q, K, V, alignment,
 * barriers); the launch and the source's defines both come from here */
enum { WG_TWO, WG_ONE, WG_FA3 };
#define WG_BM(k) ((k) == WG_ONE ? 64 : 128)
#define WG_THREADS(k) ((k) == WG_ONE ? 128 : (k) == WG_FA3 ? 384 : 256)
#define WG_STAGES 3
#define WG_BAR_BYTES ((2 * WG_STAGES + 2) * 8)
/* kl_attn_fa3's registers a thread after setmaxnreg (KL_AT_PR, KL_AT_CR):
 * the producer warpgroup's and the consumers'. The consumers' increase
 * waits until the block's pool holds it, so the kernel is launched only
 * where ptxas gave it at least the mean (fa3_regs_ok, when it loads).
 * ptxas fits the producer's code in its count: at 24, the batch
 * coordinates of the five-dim tensor maps spilled a register at d = 64 */
#define WG_FA3_PRODUCER_REGS 32
#define WG_FA3_CONSUMER_REGS 232
#define WG_SMEM(d, k)                                                          \
	((size_t)(1 + 2 * WG_STAGES) * WG_BM(k) * (size_t)(d) * 2 + 1024 + \
	 ((k) == WG_FA3 ? WG_BAR_BYTES : 0))

enum {
	VAR_GENERAL,
	VAR_D64,
	VAR_D128,
	VAR_WG64,
	VAR_WG128,
	VAR_WG1_64,
	VAR_WG1_128,
	VAR_FA3_64,
	VAR_FA3_128,
	NVAR
};
/* per variant: head dim (0: any), wgmma kernel (0 none, 1 two warpgroups a
 * block, 2 one, 3 kl_attn_fa3) */
static const int var_hd[NVAR] = {0, 64, 128, 64, 128, 64, 128, 64, 128};
static const int var_wg[NVAR] = {0, 0, 0, 1, 1, 2, 2, 3, 3};

/* the wgmma shape (WG_TWO, WG_ONE, WG_FA3) of a variant with var_wg > 0 */
static int var_shape(int var)
{
	return var_wg[var] == 3 ? WG_FA3 : var_wg[var] == 2 ? WG_ONE : WG_TWO;
}

/* the dynamic shared memory a variant's block takes */
static unsigned var_smem(int var)
{
	if (var_wg[var])
		return (unsigned)WG_SMEM(var_hd[var], var_shape(var));
	return var == VAR_GENERAL ? 0u : (unsigned)((BM + 4 * BN) * var_hd[var] * 2);
}

/* the backward's kernels in its module; fused mode launches pre, kv, dq,
 * split mode pre, kv_split, dq_split, wgmma mode dd and lse (pre's work:
 * D and the dq accumulator zeroed; L from the forward's wgmma kernel without
 * its P V), wg, dq (the last three only in the sm_90a module) */
enum { BWD_PRE, BWD_KV, BWD_DQ, BWD_KV_SPLIT, BWD_DQ_SPLIT, BWD_WG, BWD_DD, BWD_LSE, BWD_NFN };

typedef struct kl_cuda_attn {
	kl_cuda_module *mod[4][NVAR];
	CUfunction fn[4][NVAR][4]; /* general: rows, combine, dec, dec1; else the kernel */
	CUdeviceptr ws;
	size_t ws_cap;
	/* outgrown workspaces: a captured CUDA graph may still address one, so
	 * they live until the device closes (sizes double: few of them) */
	CUdeviceptr old[48];
	int nold;
	/* kl_attn_fa3 got fewer registers than its setmaxnreg pair moves: it
	 * is not launched (found once, when its module loads) */
	bool fa3_short[4][NVAR];
	/* the backward's modules, [f16, bf16][head dim 64, 128], and their
	 * kernels (BWD_PRE ... BWD_LSE; NULL where the module has none) */
	kl_cuda_module *bmod[2][2];
	CUfunction bfn[2][2][BWD_NFN];
} kl_cuda_attn;

static int dt_code(kl_dtype dt)
{
	switch (dt) {
	case KL_F32: return 0;
	case KL_F64: return 1;
	case KL_F16: return 2;
	case KL_BF16: return 3;
	default: return -1;
	}
}

/* keys a lane group of kl_attn_dec (vec) or kl_attn_dec1 takes a round, per
 * dtype code: its K and V chunks in flight a lane are 2 x keys x chunks
 * (at most 8 / VEC of 16 bytes for kl_attn_dec, 8 elements for kl_attn_dec1),
 * kept to ~64 registers */
static int dec_unroll(int c, bool vec)
{
	return c == 1 ? 2 : vec && c != 0 ? 8 : 4;
}

char *kl__cuda_attention_source(kl_dtype dt, int head_dim, int wgmma)
{
	int c = dt_code(dt);
	if (c < 0 || (head_dim != 0 && ((head_dim != 64 && head_dim != 128) || c < 2)) ||
	    wgmma < 0 || wgmma > 3 || (wgmma && head_dim == 0))
		return NULL;
	/* kl_attn_fa3's source only where it is compiled: the other variants'
	 * sources (and module cache keys) stay as they were */
	const char *fa3 = wgmma == 3 ? kl__cuda_attention_fa3_src : "";
	int k = wgmma == 3 ? WG_FA3 : wgmma == 2 ? WG_ONE : WG_TWO;
	size_t n = strlen(kl__cuda_attention_src) + strlen(fa3) + 256;
	char *s = malloc(n);
	if (s)
		snprintf(s, n,
		         "#define KL_AT_DT %d\n#define KL_AT_D %d\n#define KL_AT_WG %d\n"
		         "#define KL_AT_BM %d\n#define KL_AT_TH %d\n#define KL_AT_WS %d\n"
		         "#define KL_AT_DU %d\n#define KL_AT_DS %d\n%s",
		         c, head_dim, wgmma == 3 ? 2 : wgmma ? 1 : 0, WG_BM(k), WG_THREADS(k),
		         WG_STAGES, dec_unroll(c, true), dec_unroll(c, false), kl__cuda_attention_src);
	if (s && wgmma == 3) {
		size_t u = strlen(s);
		snprintf(s + u, n - u, "#define KL_AT_BB %d\n#define KL_AT_PR %d\n#define KL_AT_CR %d\n%s",
		         WG_BAR_BYTES, WG_FA3_PRODUCER_REGS, WG_FA3_CONSUMER_REGS, fa3);
	}
	return s;
}

/* does kl_attn_fa3 start with the registers its setmaxnreg pair moves? (a
 * smaller count would leave the consumers' increase waiting forever) */
static bool fa3_regs_ok(kl_ctx *ctx, CUfunction f)
{
	int regs = 0;
	if (kl__cu.cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, f) != CUDA_SUCCESS)
		return false;
	int need = (WG_FA3_PRODUCER_REGS + 2 * WG_FA3_CONSUMER_REGS + 2) / 3;
	if (regs < need)
		kl__log(ctx, KL_LOG_FUSION,
		        "kl_sdpa: kl_attn_fa3 has %d registers a thread, its setmaxnreg pair needs "
		        "%d: the two-warpgroup wgmma kernel",
		        regs, need);
	return regs >= need;
}

static kl_status get_fns(kl_ctx *ctx, kl_cuda_dev *d, int c, int var, CUfunction *out)
{
	if (!d->attn && !(d->attn = calloc(1, sizeof *d->attn)))
		return kl__err(ctx, KL_ENOMEM, "kl_sdpa: out of memory");
	kl_cuda_attn *A = d->attn;
	if (!A->mod[c][var]) {
		static const kl_dtype dts[4] = {KL_F32, KL_F64, KL_F16, KL_BF16};
		bool wg = var_wg[var] != 0;
		char *src = kl__cuda_attention_source(dts[c], var_hd[var], var_wg[var]);
		if (!src)
			return kl__err(ctx, KL_ENOMEM, "kl_sdpa: out of memory");
		kl_cuda_module *m = NULL;
		kl_status st = kl__cuda_module_cached(ctx, d, src, "kiln_attention.cu", wg, &m);
		free(src);
		if (st != KL_OK)
			return st;
		CUfunction f[4] = {NULL, NULL, NULL, NULL};
		if (var == VAR_GENERAL) {
			static const char *const names[4] = {"kl_attn_rows", "kl_attn_combine",
			                                     "kl_attn_dec", "kl_attn_dec1"};
			for (int i = 0; i < 4 && st == KL_OK; i++)
				st = kl__cuda_module_fn(ctx, m, names[i], &f[i]);
		} else {
			st = kl__cuda_module_fn(ctx, m,
			                        var_wg[var] == 3 ? "kl_attn_fa3"
			                        : wg          ? "kl_attn_wgmma"
			                                      : "kl_attn_mma",
			                        &f[0]);
		}
		/* the tensor-core kernels' shared memory, opted in once here */
		if (st == KL_OK && var != VAR_GENERAL)
			st = kl__cuda_fn_smem(ctx, d, f[0], var_smem(var));
		/* two one-warpgroup blocks per SM need all of its shared memory:
		 * ask for the largest carveout (a hint the driver may overrule) and
		 * say how many blocks fit (KILN_LOGS=fusion) */
		if (st == KL_OK && var_wg[var] == 2) {
			st = KL_CU(ctx, cuFuncSetAttribute, f[0],
			           CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
			           CU_SHAREDMEM_CARVEOUT_MAX_SHARED);
			int nb = 0;
			if (st == KL_OK && kl__cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(
			                           &nb, f[0], WG_THREADS(WG_ONE), var_smem(var)) ==
			                           CUDA_SUCCESS)
				kl__log(ctx, KL_LOG_FUSION,
				        "kl_sdpa: wgmma kernel, one warpgroup a block, head dim %d: %d "
				        "blocks per SM%s",
				        var_hd[var], nb, nb < 2 ? " (wants 2: no overlap)" : "");
		}
		if (st != KL_OK) {
			kl__cuda_module_free(m);
			return st;
		}
		if (var_wg[var] == 3)
			A->fa3_short[c][var] = !fa3_regs_ok(ctx, f[0]);
		A->mod[c][var] = m;
		memcpy(A->fn[c][var], f, sizeof f);
	}
	memcpy(out, A->fn[c][var], sizeof A->fn[c][var]);
	return KL_OK;
}

void kl__cuda_attention_release(kl_cuda_dev *d)
{
	kl_cuda_attn *A = d->attn;
	if (!A)
		return;
	for (int c = 0; c < 4; c++)
		for (int v = 0; v < NVAR; v++)
			kl__cuda_module_free(A->mod[c][v]);
	for (int c = 0; c < 2; c++)
		for (int v = 0; v < 2; v++)
			kl__cuda_module_free(A->bmod[c][v]);
	if (A->ws)
		kl__cuda_free(NULL, d, A->ws);
	for (int i = 0; i < A->nold; i++)
		kl__cuda_free(NULL, d, A->old[i]);
	free(A);
	d->attn = NULL;
}

/* the workspace (split-key partials, the backward's row statistics and dq
 * accumulator: steps on one stream take turns) at least need bytes */
static kl_status ensure_ws(kl_ctx *ctx, kl_cuda_dev *d, size_t need, const char *what)
{
	kl_cuda_attn *A = d->attn;
	if (need <= A->ws_cap)
		return KL_OK;
	if (d->capturing)
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_sdpa: %s would grow during CUDA graph capture", what);
	/* rounded up to 2 MiB and at least 5/4 of the last, not to a power of
	 * two: the training step's backward needs 34 MB (its dq accumulator),
	 * which a power of two made 64 MiB held for good; growing by 5/4 or more
	 * keeps the grown-from ones (old[], which captured graphs may still
	 * address) few */
	size_t cap = ((need + ((size_t)2 << 20) - 1) >> 21) << 21;
	if (A->ws && cap < A->ws_cap / 4 * 5)
		cap = A->ws_cap / 4 * 5;
	if (A->ws && A->nold == (int)(sizeof A->old / sizeof A->old[0]))
		return kl__err(ctx, KL_ENOMEM, "kl_sdpa: %s grew too often", what);
	CUdeviceptr p = 0;
	kl_status st = kl__cuda_malloc(ctx, d, cap, &p);
	if (st != KL_OK)
		return st;
	if (A->ws)
		A->old[A->nold++] = A->ws;
	A->ws = p;
	A->ws_cap = cap;
	return KL_OK;
}

static bool al16(CUdeviceptr p)
{
	return (p & 15) == 0;
}

typedef enum { PICK_ANY, PICK_SIMPLE, PICK_MMA, PICK_WGMMA } kl_attn_pick;

static kl_attn_pick forced(kl_ctx *ctx)
{
	const char *e = getenv("KILN_ATTENTION_KERNEL");
	if (!e || !*e)
		return PICK_ANY;
	if (!strcmp(e, "simple"))
		return PICK_SIMPLE;
	if (!strcmp(e, "mma"))
		return PICK_MMA;
	if (!strcmp(e, "wgmma"))
		return PICK_WGMMA;
	kl__log(ctx, KL_LOG_FUSION, "KILN_ATTENTION_KERNEL=%.32s ignored (simple, mma or wgmma)", e);
	return PICK_ANY;
}

/* KILN_CUDA_ATTN_WG: the wgmma kernel's shape: unset or 2 kl_attn_fa3
 * (WG_FA3), 0 two warpgroups (WG_TWO), 1 one (WG_ONE) */
static int wg_shape(kl_ctx *ctx)
{
	const char *e = getenv("KILN_CUDA_ATTN_WG");
	if (!e || !*e || !strcmp(e, "2"))
		return WG_FA3;
	if (!strcmp(e, "0"))
		return WG_TWO;
	if (!strcmp(e, "1"))
		return WG_ONE;
	kl__log(ctx, KL_LOG_FUSION, "KILN_CUDA_ATTN_WG=%.32s ignored (0, 1 or 2)", e);
	return WG_FA3;
}

/* can a tensor-core kernel take a? (pointers already at their offsets) */
static int mma_variant(kl_ctx *ctx, const kl_cuda_dev *d, const kl_at_args *a,
                       const kl_attn_step *s, kl_dtype dt)
{
	kl_attn_pick pick = forced(ctx);
	/* grid: x = batch, y = query blocks of BM (the wgmma kernel's are larger);
	 * lengths: only kl_attn_rows stops at each row's length (so far) */
	if (pick == PICK_SIMPLE || s->len >= 0 || (dt != KL_F16 && dt != KL_BF16) || s->d != s->dv ||
	    (s->d != 64 && s->d != 128) || s->q_cs != 1 || s->k_cs != 1 || s->v_cs != 1 ||
	    s->tq < 2 || a->rows / s->tq > 0x7fffffff || (s->tq + BM - 1) / BM > 65535)
		return -1;
	if (!al16(a->q) || !al16(a->k) || !al16(a->v) || !al16(a->o) || s->q_rs % 8 ||
	    s->k_rs % 8 || s->v_rs % 8 || s->o_rs % 8)
		return -1;
	for (int i = 0; i < s->nbatch; i++)
		if (s->q_bs[i] % 8 || s->k_bs[i] % 8 || s->v_bs[i] % 8 || s->o_bs[i] % 8)
			return -1;
	/* wgmma is sm_90a only; its block wants 7 tiles of 128 rows (64 with
	 * one warpgroup) of shared memory; it folds the scale into the exponent
	 * (so takes only a positive one). kl_attn_fa3 also wants its tensor
	 * maps, which the launch builds (and falls back without). */
	int k = wg_shape(ctx);
	bool wg = d->cc_major == 9 && d->cc_minor == 0 && pick != PICK_MMA && s->scale > 0 &&
	          (size_t)d->smem_per_block_optin >= WG_SMEM(s->d, k);
	if (wg && k == WG_ONE)
		return s->d == 64 ? VAR_WG1_64 : VAR_WG1_128;
	if (wg && k == WG_FA3)
		return s->d == 64 ? VAR_FA3_64 : VAR_FA3_128;
	if (wg)
		return s->d == 64 ? VAR_WG64 : VAR_WG128;
	return s->d == 64 ? VAR_D64 : VAR_D128;
}

/* kl_attn_fa3's batch dims: those of size > 1, innermost first, adjacent
 * ones merged where q, k and v each store them as one (the outer's stride
 * the inner's times its size). A tensor map has five dims: (d, t) and up
 * to three of these; n[] their sizes (1 past the last), idx[] the step's
 * batch dim each starts at (its innermost). False where more than three
 * remain. */
typedef struct fa_dims {
	int nd;
	int64_t n[3];
	int idx[3];
} fa_dims;

static bool fa_batch_dims(const kl_attn_step *s, fa_dims *f)
{
	memset(f, 0, sizeof *f);
	for (int j = 0; j < 3; j++)
		f->n[j] = 1;
	int last = -1; /* the step's dim the current map dim ends at (outermost) */
	for (int i = s->nbatch - 1; i >= 0; i--) {
		if (s->batch[i] == 1)
			continue;
		if (f->nd > 0 && s->q_bs[i] == s->q_bs[last] * s->batch[last] &&
		    s->k_bs[i] == s->k_bs[last] * s->batch[last] &&
		    s->v_bs[i] == s->v_bs[last] * s->batch[last] &&
		    f->n[f->nd - 1] <= INT64_MAX / s->batch[i]) {
			f->n[f->nd - 1] *= s->batch[i];
		} else {
			if (f->nd == 3)
				return false;
			f->idx[f->nd] = i;
			f->n[f->nd++] = s->batch[i];
		}
		last = i;
	}
	return true;
}

/* kl_attn_fa3's tensor map of one operand (base p, t rows of d elements,
 * row stride rs, batch strides bs): dims (d, t, and the batch dims f) with
 * strides (rs, bs of each batch dim's innermost), box 64 x WG_BM rows x 1 x
 * 1 x 1 (one 64-column panel of a tile, 128 bytes a row, the 128-byte
 * swizzle wgmma reads). Only reads go through it, so rows and batches may
 * interleave in memory (q, k and v as views of one [b, t, 3, h, d] product:
 * a head's stride under the row's). The driver's rules: strides positive
 * multiples of 16 bytes under 2^40 bytes, dims at most 2^32. False where
 * that does not hold or the driver refuses the map. */
static bool tma_map(CUtensorMap *m, kl_dtype dt, CUdeviceptr p, int64_t t, int64_t d, int64_t rs,
                    const int64_t *bs, const fa_dims *f)
{
	const int64_t lim = (int64_t)1 << 39; /* 2^40 bytes */
	cuuint64_t dim[5] = {(cuuint64_t)d, (cuuint64_t)t, 1, 1, 1};
	cuuint64_t str[4] = {(cuuint64_t)rs * 2, 0, 0, 0};
	if (rs < d || rs >= lim || (rs * 2) % 16 || t > ((int64_t)1 << 32))
		return false;
	for (int j = 0; j < 3; j++) {
		/* a dim of size 1 takes the row stride: any valid one does */
		int64_t b = j < f->nd ? bs[f->idx[j]] : rs;
		if (b <= 0 || b >= lim || (b * 2) % 16 || f->n[j] > ((int64_t)1 << 32))
			return false;
		dim[2 + j] = (cuuint64_t)f->n[j];
		str[1 + j] = (cuuint64_t)b * 2;
	}
	cuuint32_t box[5] = {64, WG_BM(WG_FA3), 1, 1, 1}, es[5] = {1, 1, 1, 1, 1};
	return kl__cu.cuTensorMapEncodeTiled(
	               m, dt == KL_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
	               5, (void *)(uintptr_t)p, dim, str, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
	               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
	               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

static atomic_long n_fa3, n_fa3_fallbacks, n_lse_reused;

void kl__cuda_attn_counts(long *fa3, long *fa3_fallbacks, long *lse_reused)
{
	*fa3 = atomic_load(&n_fa3);
	*fa3_fallbacks = atomic_load(&n_fa3_fallbacks);
	*lse_reused = atomic_load(&n_lse_reused);
}

/* the forward kernels' arguments for step s (no lengths) with q, k, v and o
 * the buffers' bases (o at its step offset); returns the batch count */
static int64_t at_args(kl_at_args *a, const kl_attn_step *s, kl_dtype dt, CUdeviceptr q,
                       CUdeviceptr k, CUdeviceptr v, CUdeviceptr o)
{
	memset(a, 0, sizeof *a);
	size_t es = kl_dtype_size(dt);
	a->q = q + (CUdeviceptr)(s->q_off * (int64_t)es);
	a->k = k + (CUdeviceptr)(s->k_off * (int64_t)es);
	a->v = v + (CUdeviceptr)(s->v_off * (int64_t)es);
	a->o = o;
	a->tq = s->tq;
	a->tk = s->tk;
	a->d = s->d;
	a->dv = s->dv;
	a->q_rs = s->q_rs;
	a->q_cs = s->q_cs;
	a->k_rs = s->k_rs;
	a->k_cs = s->k_cs;
	a->v_rs = s->v_rs;
	a->v_cs = s->v_cs;
	a->o_rs = s->o_rs;
	a->nb = s->nbatch;
	int64_t nbt = 1;
	for (int i = 0; i < s->nbatch; i++) {
		a->batch[i] = s->batch[i];
		a->q_bs[i] = s->q_bs[i];
		a->k_bs[i] = s->k_bs[i];
		a->v_bs[i] = s->v_bs[i];
		a->o_bs[i] = s->o_bs[i];
		nbt *= s->batch[i];
	}
	a->rows = nbt * s->tq;
	a->scale = s->scale;
	a->scale_log2 = (float)(s->scale * 1.4426950408889634);
	a->causal = s->causal;
	a->nsplit = 1;
	return nbt;
}

/* KILN_CUDA_ATTN_DEC: the decode kernels (kl_attn_dec, kl_attn_dec1) where
 * the query rows are fewer than the SMs' warps: 1 (splits of the keys picked
 * below), N > 1 N splits a row (capped at the keys), for tuning; unset or 0
 * kl_attn_rows' warp per (row, split) until kl_attn_dec has passed
 * test_cuda_decode on a GPU (it has only been compiled, 2026-12-08) */
static int dec_mode(kl_ctx *ctx)
{
	const char *e = getenv("KILN_CUDA_ATTN_DEC");
	if (!e || !*e)
		return 0;
	char *end;
	long n = strtol(e, &end, 10);
	if (*end || n < 0 || n > 1024) {
		kl__log(ctx, KL_LOG_FUSION, "KILN_CUDA_ATTN_DEC=%.32s ignored (0, 1 or splits)", e);
		return 0;
	}
	return (int)n;
}

/* can kl_attn_dec take a's K and V in 16-byte chunks? (unit column stride,
 * whole chunks a row, every row and batch start 16-byte aligned) */
static bool dec_vec(const kl_at_args *a, size_t es)
{
	int64_t vec = 16 / (int64_t)es;
	if (a->k_cs != 1 || a->v_cs != 1 || a->d % vec || a->dv % vec || !al16(a->k) ||
	    !al16(a->v) || (a->k_rs * (int64_t)es) % 16 || (a->v_rs * (int64_t)es) % 16)
		return false;
	for (int i = 0; i < a->nb; i++)
		if (a->batch[i] > 1 &&
		    ((a->k_bs[i] * (int64_t)es) % 16 || (a->v_bs[i] * (int64_t)es) % 16))
			return false;
	return true;
}

/* the decode step: a block of kl_attn_dec or kl_attn_dec1 per (row, split
 * of the keys): as many splits as make 4 blocks an SM (all in flight at
 * once, ~110 registers a thread), but no split under a quarter of a round
 * (4 warps x 32 / dg groups x KL_AT_DU or KL_AT_DS keys); a long cache
 * gives each split several rounds. Then kl_attn_combine where there are
 * several. H100, 16 rows of 1024 keys, head dim 128 bf16: a round is 64
 * keys, 33 splits of 31 */
static kl_status decode_step(kl_ctx *ctx, kl_cuda_dev *d, kl_at_args *a, const kl_attn_step *s,
                             kl_dtype dt, const CUfunction *f, int mode)
{
	size_t es = kl_dtype_size(dt);
	bool vec = dec_vec(a, es);
	int64_t per = vec ? 16 / (int64_t)es : 1; /* elements a chunk */
	int64_t nch = ((s->d > s->dv ? s->d : s->dv) + per - 1) / per;
	int g = 1;
	while (g < 32 && g < nch)
		g *= 2;
	a->dg = g;
	a->dc = (int)((nch + g - 1) / g);
	int64_t round = 4 * (32 / g) * dec_unroll(dt_code(dt), vec), tk = s->tk > 0 ? s->tk : 1;
	int64_t sms = d->sm_count > 0 ? d->sm_count : 1;
	int64_t most = (tk + round / 4 - 1) / (round / 4);
	int64_t ns = mode > 1 ? mode : (4 * sms + a->rows - 1) / a->rows;
	ns = mode > 1 || ns < most ? ns : most;
	ns = ns < tk ? ns : tk;
	a->nsplit = (int)(ns < 1 ? 1 : ns);
	kl_status st;
	if (a->nsplit > 1) {
		size_t need = (size_t)a->rows * (size_t)a->nsplit * (size_t)(s->dv + 2) *
		              (dt == KL_F64 ? 8 : 4);
		if ((st = ensure_ws(ctx, d, need, "the split-key workspace")) != KL_OK)
			return st;
		a->ws = d->attn->ws;
	}
	void *argv[1] = {a};
	unsigned block[3] = {128, 1, 1};
	unsigned grid[3] = {(unsigned)a->nsplit, (unsigned)a->rows, 1};
	st = kl__cuda_launch(ctx, d, f[vec ? 2 : 3], grid, block, 0, argv, KL_LAUNCH_PDL);
	if (st == KL_OK && a->nsplit > 1) {
		unsigned g2[3] = {(unsigned)a->rows, 1, 1}; /* kl_attn_combine: a block a row */
		st = kl__cuda_launch(ctx, d, f[1], g2, block, 0, argv, KL_LAUNCH_PDL);
	}
	return st;
}

kl_status kl__cuda_attention_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_attn_step *s,
                                  kl_dtype dt, CUdeviceptr q, CUdeviceptr k, CUdeviceptr v,
                                  CUdeviceptr len, CUdeviceptr o, CUdeviceptr lse,
                                  bool *lse_written)
{
	if (lse_written)
		*lse_written = false;
	int c = dt_code(dt);
	if (c < 0 || s->nbatch > 6)
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_sdpa: dtype %s or %d batch dims on CUDA",
		               kl_dtype_name(dt), s->nbatch);
	if (s->d > 256 || s->dv > 256)
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_sdpa: head dims %lld and %lld: the CUDA kernels take at most 256",
		               (long long)s->d, (long long)s->dv);
	kl_at_args a;
	int64_t nbt = at_args(&a, s, dt, q, k, v, o);
	if (s->len >= 0) {
		a.len = len;
		a.len_off = s->len_off;
		a.len_st = s->len_st;
		a.len_div = kl__attn_len_div(s);
		a.len_i32 = s->len_dt == KL_I32;
	}
	if (a.rows == 0 || s->dv == 0)
		return KL_OK;
	void *argv[1] = {&a};
	CUfunction f[4];
	int var = mma_variant(ctx, d, &a, s, dt);
	kl_status st;
	if (var == VAR_FA3_64 || var == VAR_FA3_128) {
		/* q, k and v each as a tensor map (its coordinates, rows up to a
		 * tile past the end, stay in int); else the two-warpgroup kernel */
		CUtensorMap maps[3];
		const int64_t room = INT32_MAX - 2 * WG_BM(WG_FA3);
		fa_dims fd;
		if (s->tq < room && s->tk < room && fa_batch_dims(s, &fd) && fd.n[0] <= INT32_MAX &&
		    fd.n[1] <= INT32_MAX && fd.n[2] <= INT32_MAX &&
		    tma_map(&maps[0], dt, a.q, s->tq, s->d, s->q_rs, s->q_bs, &fd) &&
		    tma_map(&maps[1], dt, a.k, s->tk, s->d, s->k_rs, s->k_bs, &fd) &&
		    tma_map(&maps[2], dt, a.v, s->tk, s->d, s->v_rs, s->v_bs, &fd)) {
			a.tn0 = (int)fd.n[0];
			a.tn1 = (int)fd.n[1];
			if ((st = get_fns(ctx, d, c, var, f)) != KL_OK)
				return st;
			if (d->attn->fa3_short[c][var])
				goto two_wg;
			/* persistent: one block an SM (its shared memory takes the
			 * SM's) walks the items (batch, query block), one of each
			 * round of grid items; the items, and the step of up to two
			 * rounds past the last, are an int in the kernel */
			int64_t items = nbt * ((s->tq + WG_BM(WG_FA3) - 1) / WG_BM(WG_FA3));
			int64_t sms = d->sm_count > 0 ? d->sm_count : 1;
			if (items > INT32_MAX - 2 * sms) {
				kl__log(ctx, KL_LOG_FUSION,
				        "kl_sdpa: kl_attn_fa3: %lld work items (batches times query "
				        "blocks) exceed an int: the two-warpgroup wgmma kernel",
				        (long long)items);
				goto two_wg;
			}
			void *fargv[4] = {&a, &maps[0], &maps[1], &maps[2]};
			unsigned grid[3] = {(unsigned)(items < sms ? items : sms), 1, 1};
			unsigned block[3] = {WG_THREADS(WG_FA3), 1, 1};
			atomic_fetch_add(&n_fa3, 1);
			a.lse = lse;
			if (lse_written)
				*lse_written = lse != 0;
			return kl__cuda_launch(ctx, d, f[0], grid, block, var_smem(var), fargv,
			                       KL_LAUNCH_PDL);
		}
		kl__log(ctx, KL_LOG_FUSION,
		        "kl_sdpa: kl_attn_fa3: q, k or v does not fit a tensor map (strides "
		        "q %lld k %lld v %lld a row, or over three batch dims that do not "
		        "merge): the two-warpgroup wgmma kernel",
		        (long long)s->q_rs, (long long)s->k_rs, (long long)s->v_rs);
	two_wg:
		atomic_fetch_add(&n_fa3_fallbacks, 1);
		var = var == VAR_FA3_64 ? VAR_WG64 : VAR_WG128;
	}
	if (var == VAR_WG64 || var == VAR_WG128 || var == VAR_WG1_64 || var == VAR_WG1_128) {
		if ((st = get_fns(ctx, d, c, var, f)) != KL_OK)
			return st;
		int sh = var_shape(var);
		unsigned grid[3] = {(unsigned)nbt, (unsigned)((s->tq + WG_BM(sh) - 1) / WG_BM(sh)), 1};
		unsigned block[3] = {WG_THREADS(sh), 1, 1};
		a.lse = lse;
		if (lse_written)
			*lse_written = lse != 0;
		return kl__cuda_launch(ctx, d, f[0], grid, block, var_smem(var), argv, KL_LAUNCH_PDL);
	}
	if (var > 0) {
		if ((st = get_fns(ctx, d, c, var, f)) != KL_OK)
			return st;
		unsigned grid[3] = {(unsigned)nbt, (unsigned)((s->tq + BM - 1) / BM), 1};
		unsigned block[3] = {128, 1, 1};
		return kl__cuda_launch(ctx, d, f[0], grid, block, var_smem(var), argv, KL_LAUNCH_PDL);
	}
	if ((st = get_fns(ctx, d, c, VAR_GENERAL, f)) != KL_OK)
		return st;
	int64_t sms = d->sm_count > 0 ? d->sm_count : 1;
	int dec = dec_mode(ctx);
	if (dec != 0 && a.rows < sms * 32 && a.rows <= 65535)
		return decode_step(ctx, d, &a, s, dt, f, dec);
	/* few rows (decode, KILN_CUDA_ATTN_DEC=0): split the keys (16 or more
	 * a split) so that every SM has warps */
	int64_t want = sms * 32;
	if (a.rows < want && s->tk > 16) {
		int64_t ns = (s->tk + 15) / 16, room = want / a.rows;
		ns = ns < room ? ns : room;
		a.nsplit = (int)(ns < 1 ? 1 : ns > 64 ? 64 : ns);
	}
	if (a.nsplit > 1) {
		size_t need = (size_t)a.rows * (size_t)a.nsplit * (size_t)(s->dv + 2) *
		              (dt == KL_F64 ? 8 : 4);
		if ((st = ensure_ws(ctx, d, need, "the split-key workspace")) != KL_OK)
			return st;
		a.ws = d->attn->ws;
	}
	unsigned block[3] = {128, 1, 1};
	int64_t items = a.rows * a.nsplit;
	if ((items + 3) / 4 > 0x7fffffff)
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_sdpa: %lld query rows exceed one grid",
		               (long long)a.rows);
	unsigned grid[3] = {(unsigned)((items + 3) / 4), 1, 1};
	st = kl__cuda_launch(ctx, d, f[0], grid, block, 0, argv, KL_LAUNCH_PDL);
	if (st == KL_OK && a.nsplit > 1) {
		unsigned g2[3] = {(unsigned)a.rows, 1, 1}; /* kl_attn_combine: a block a row */
		st = kl__cuda_launch(ctx, d, f[1], g2, block, 0, argv, KL_LAUNCH_PDL);
	}
	return st;
}

/* ---- the backward (attention_bwd_src.c) ----------------------------------------------- */

/* kl_atb_args of attention_bwd_src.c, field for field */
typedef struct kl_atb_args {
	CUdeviceptr q, k, v, o, g;
	CUdeviceptr dqo, dko, dvo;
	CUdeviceptr lse, dd, dq;
	long long tq, tk;
	long long q_rs, k_rs, v_rs, o_rs, g_rs, dq_rs, dk_rs, dv_rs;
	long long batch[6], q_bs[6], k_bs[6], v_bs[6], o_bs[6], g_bs[6], dq_bs[6], dk_bs[6],
	        dv_bs[6];
	float scale, scale_log2;
	int nb, causal;
	int zero_dq;
} kl_atb_args;

#define BWD_SMEM_PRE(d) ((unsigned)(2 * 64 * (d) * 2))
/* kl_attnb_kv: K and V tiles of 64 rows, two each of Q and dO of QB rows
 * (64, 32 at head dim 128), dS^T (64 x 64 16-bit), two each of L and D of QB
 * rows, the f32 dq piece (QB rows of d + 8) */
#define BWD_QB(d) ((d) == 128 ? 32 : 64)
#define BWD_SMEM_KV(d)                                                                             \
	((unsigned)(2 * 64 * (d) * 2 + 4 * BWD_QB(d) * (d) * 2 + 64 * 64 * 2 + 4 * BWD_QB(d) * 4 +  \
	            BWD_QB(d) * ((d) + 8) * 4))
/* kl_attnb_kv_split: the same less dS^T and the dq piece */
#define BWD_SMEM_KV_SPLIT(d)                                                                       \
	((unsigned)(2 * 64 * (d) * 2 + 4 * BWD_QB(d) * (d) * 2 + 4 * BWD_QB(d) * 4))
/* kl_attnb_dq_split: Q and dO tiles of 64 rows, two each of K and V */
#define BWD_SMEM_DQ_SPLIT(d) ((unsigned)(6 * 64 * (d) * 2))
/* kl_attnb_wg (attention_bwd_wg_src.c): K and V tiles of 128 rows, two each
 * of Q and dO of 64, dS^T (128 x 64 16-bit), two each of L and D of 64 rows,
 * a warpgroup's dQ piece each (64 rows of 72 floats), and the 1024 bytes of
 * the tiles' alignment */
#define BWD_SMEM_WG(d)                                                                             \
	((unsigned)(2 * 128 * (d) * 2 + 4 * 64 * (d) * 2 + 128 * 64 * 2 + 4 * 64 * 4 +                \
	            2 * 64 * 72 * 4 + 1024))

typedef enum { BWD_FUSED, BWD_SPLIT, BWD_WGMMA } kl_bwd_mode;

/* does device d take kl_attnb_wg? (sm_90a, its shared memory) */
static bool bwd_wg_ok(const kl_cuda_dev *d, int64_t hd)
{
	return d->cc_major == 9 && d->cc_minor == 0 &&
	       (size_t)d->smem_per_block_optin >= BWD_SMEM_WG(hd);
}

/* is wgmma the default where it can run? (H100, B4 H16 T1024 D128 bf16
 * forward + backward: 560 us against fused's 1000) */
#define BWD_WG_DEFAULT 1

/* KILN_CUDA_ATTN_BWD: the backward's shape: wgmma (kl_attnb_wg, where the
 * device takes it and the scale is positive, as the forward's wgmma kernel
 * wants; the default there when BWD_WG_DEFAULT), fused (dQ added into an f32 accumulator from
 * kl_attnb_kv, then scaled by kl_attnb_dq; the default elsewhere), split (dQ
 * from a kernel of its own over the keys, kl_attnb_dq_split, beside
 * kl_attnb_kv without its dQ work, kl_attnb_kv_split) */
static kl_bwd_mode bwd_mode(kl_ctx *ctx, const kl_cuda_dev *d, const kl_attn_step *s)
{
	const char *e = getenv("KILN_CUDA_ATTN_BWD");
	bool wg = bwd_wg_ok(d, s->d) && s->scale > 0;
	kl_bwd_mode def = wg && BWD_WG_DEFAULT ? BWD_WGMMA : BWD_FUSED;
	if (!e || !*e)
		return def;
	if (!strcmp(e, "fused"))
		return BWD_FUSED;
	if (!strcmp(e, "split"))
		return BWD_SPLIT;
	if (!strcmp(e, "wgmma") && wg)
		return BWD_WGMMA;
	kl__log(ctx, KL_LOG_FUSION,
	        "KILN_CUDA_ATTN_BWD=%.32s ignored (fused, split, or wgmma on sm_90)", e);
	return def;
}

char *kl__cuda_attention_bwd_source(kl_dtype dt, int head_dim, bool wgmma)
{
	if ((dt != KL_F16 && dt != KL_BF16) || (head_dim != 64 && head_dim != 128))
		return NULL;
	char *fwd = kl__cuda_attention_source(dt, head_dim, wgmma ? 1 : 0);
	if (!fwd)
		return NULL;
	const char *wg = wgmma ? kl__cuda_attention_bwd_wg_src : "";
	size_t n = strlen(fwd) + strlen(kl__cuda_attention_bwd_src) + strlen(wg) + 1;
	char *s = malloc(n);
	if (s)
		snprintf(s, n, "%s%s%s", fwd, kl__cuda_attention_bwd_src, wg);
	free(fwd);
	return s;
}

static kl_status get_bwd_fns(kl_ctx *ctx, kl_cuda_dev *d, kl_dtype dt, int64_t hd,
                             CUfunction *out)
{
	if (!d->attn && !(d->attn = calloc(1, sizeof *d->attn)))
		return kl__err(ctx, KL_ENOMEM, "kl_sdpa: out of memory");
	kl_cuda_attn *A = d->attn;
	int c = dt == KL_BF16, v = hd == 128;
	if (!A->bmod[c][v]) {
		/* on sm_90 the module is built for sm_90a with kl_attnb_wg too */
		bool wg = bwd_wg_ok(d, hd);
		char *src = kl__cuda_attention_bwd_source(dt, (int)hd, wg);
		if (!src)
			return kl__err(ctx, KL_ENOMEM, "kl_sdpa: out of memory");
		kl_cuda_module *m = NULL;
		kl_status st = kl__cuda_module_cached(ctx, d, src, "kiln_attention_bwd.cu", wg, &m);
		free(src);
		static const char *const names[BWD_NFN] = {
		        "kl_attnb_pre",      "kl_attnb_kv", "kl_attnb_dq", "kl_attnb_kv_split",
		        "kl_attnb_dq_split", "kl_attnb_wg", "kl_attnb_dd", "kl_attn_wgmma_lse"};
		CUfunction f[BWD_NFN] = {NULL};
		for (int i = 0; i < (wg ? BWD_NFN : BWD_WG) && st == KL_OK; i++)
			st = kl__cuda_module_fn(ctx, m, names[i], &f[i]);
		if (st == KL_OK && wg)
			st = kl__cuda_fn_smem(ctx, d, f[BWD_WG], BWD_SMEM_WG(hd));
		if (st == KL_OK && wg)
			st = kl__cuda_fn_smem(ctx, d, f[BWD_LSE], (unsigned)WG_SMEM(hd, WG_TWO));
		if (st == KL_OK)
			st = kl__cuda_fn_smem(ctx, d, f[BWD_PRE], BWD_SMEM_PRE(hd));
		if (st == KL_OK)
			st = kl__cuda_fn_smem(ctx, d, f[BWD_KV], BWD_SMEM_KV(hd));
		if (st == KL_OK)
			st = kl__cuda_fn_smem(ctx, d, f[BWD_KV_SPLIT], BWD_SMEM_KV_SPLIT(hd));
		if (st == KL_OK)
			st = kl__cuda_fn_smem(ctx, d, f[BWD_DQ_SPLIT], BWD_SMEM_DQ_SPLIT(hd));
		if (st != KL_OK) {
			kl__cuda_module_free(m);
			return st;
		}
		A->bmod[c][v] = m;
		memcpy(A->bfn[c][v], f, sizeof f);
	}
	memcpy(out, A->bfn[c][v], sizeof A->bfn[c][v]);
	return KL_OK;
}

kl_status kl__cuda_attention_bwd_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_attn_step *s,
                                      kl_dtype dt, CUdeviceptr q, CUdeviceptr k, CUdeviceptr v,
                                      CUdeviceptr o, CUdeviceptr g, CUdeviceptr out,
                                      CUdeviceptr lse)
{
	if (!kl__attn_bwd_cuda_takes(dt, s->d) || s->dv != s->d || s->nbatch > 6)
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_sdpa backward: dtype %s, head dims %lld and %lld, %d batch dims: the "
		               "CUDA kernels take f16/bf16, head dim 64 or 128, up to 6 batch dims",
		               kl_dtype_name(dt), (long long)s->d, (long long)s->dv, s->nbatch);
	kl_atb_args a;
	memset(&a, 0, sizeof a);
	size_t es = kl_dtype_size(dt);
	a.q = q + (CUdeviceptr)(s->q_off * (int64_t)es);
	a.k = k + (CUdeviceptr)(s->k_off * (int64_t)es);
	a.v = v + (CUdeviceptr)(s->v_off * (int64_t)es);
	a.o = o + (CUdeviceptr)(s->fo_off * (int64_t)es);
	a.g = g + (CUdeviceptr)(s->go_off * (int64_t)es);
	/* each gradient where the step puts it (kl_attn_step: the packed
	 * [dq; dk; dv], or a packed qkv product's gradient) */
	a.dqo = out + (CUdeviceptr)(s->dq_off * (int64_t)es);
	a.dko = out + (CUdeviceptr)(s->dk_off * (int64_t)es);
	a.dvo = out + (CUdeviceptr)(s->dv_off * (int64_t)es);
	a.tq = s->tq;
	a.tk = s->tk;
	a.q_rs = s->q_rs;
	a.k_rs = s->k_rs;
	a.v_rs = s->v_rs;
	a.o_rs = s->fo_rs;
	a.g_rs = s->go_rs;
	a.dq_rs = s->o_rs;
	a.dk_rs = s->dk_rs;
	a.dv_rs = s->dv_rs;
	a.nb = s->nbatch;
	int64_t nbt = 1;
	/* loads of 16 bytes; the gradients' stores of two elements (4 bytes) */
	bool rows16 = al16(a.q) && al16(a.k) && al16(a.v) && al16(a.g) && s->q_rs % 8 == 0 &&
	              s->k_rs % 8 == 0 && s->v_rs % 8 == 0 && s->go_rs % 8 == 0 &&
	              (s->d <= 1 || (s->q_cs == 1 && s->k_cs == 1 && s->v_cs == 1));
	bool pairs = (a.dqo & 3) == 0 && (a.dko & 3) == 0 && (a.dvo & 3) == 0 && s->o_rs % 2 == 0 &&
	             s->dk_rs % 2 == 0 && s->dv_rs % 2 == 0;
	for (int i = 0; i < s->nbatch; i++) {
		a.batch[i] = s->batch[i];
		a.q_bs[i] = s->q_bs[i];
		a.k_bs[i] = s->k_bs[i];
		a.v_bs[i] = s->v_bs[i];
		a.o_bs[i] = s->fo_bs[i];
		a.g_bs[i] = s->go_bs[i];
		a.dq_bs[i] = s->o_bs[i];
		a.dk_bs[i] = s->dk_bs[i];
		a.dv_bs[i] = s->dv_bs[i];
		nbt *= s->batch[i];
		rows16 &= s->q_bs[i] % 8 == 0 && s->k_bs[i] % 8 == 0 && s->v_bs[i] % 8 == 0 &&
		          s->go_bs[i] % 8 == 0;
		pairs &= s->o_bs[i] % 2 == 0 && s->dk_bs[i] % 2 == 0 && s->dv_bs[i] % 2 == 0;
	}
	a.scale = (float)s->scale;
	a.scale_log2 = (float)(s->scale * 1.4426950408889634);
	a.causal = s->causal;
	if (nbt == 0 || s->tq + s->tk == 0)
		return KL_OK;
	if (!rows16)
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_sdpa backward: q, k, v or do rows not 16-byte aligned with unit "
		               "column stride (strides q %lld k %lld v %lld do %lld a row): the CUDA "
		               "kernels load them 16 bytes at a time",
		               (long long)s->q_rs, (long long)s->k_rs, (long long)s->v_rs,
		               (long long)s->go_rs);
	if (!pairs)
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_sdpa backward: a row of dq, dk or dv starts on an odd element "
		               "(offsets %lld, %lld, %lld; rows %lld, %lld, %lld apart): the CUDA "
		               "kernels store two elements at a time",
		               (long long)s->dq_off, (long long)s->dk_off, (long long)s->dv_off,
		               (long long)s->o_rs, (long long)s->dk_rs, (long long)s->dv_rs);
	int64_t nqb = (s->tq + 63) / 64, nkb = (s->tk + 63) / 64;
	if (nbt > 0x7fffffff || nqb > 65535 || nkb > 65535)
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_sdpa backward: batch %lld, %lld queries, %lld keys exceed the CUDA "
		               "grid (2^31 - 1 batches, 65535 blocks of 64 rows)",
		               (long long)nbt, (long long)s->tq, (long long)s->tk);
	CUfunction f[BWD_NFN] = {NULL};
	kl_status st = get_bwd_fns(ctx, d, dt, s->d, f);
	if (st != KL_OK)
		return st;
	/* split mode needs L and D only: its dQ never leaves the registers */
	kl_bwd_mode mode = bwd_mode(ctx, d, s);
	bool split = mode == BWD_SPLIT;
	size_t rows = (size_t)nbt * (size_t)s->tq;
	if ((st = ensure_ws(ctx, d, rows * (size_t)(2 + (split ? 0 : s->d)) * 4 + 64,
	                    "the attention backward's workspace")) != KL_OK)
		return st;
	a.lse = d->attn->ws;
	a.dd = a.lse + rows * 4;
	if (!split) {
		a.dq = a.dd + rows * 4;
		a.dq = (a.dq + 15) & ~(CUdeviceptr)15;
		a.zero_dq = 1;
	}
	void *argv[1] = {&a};
	unsigned block[3] = {128, 1, 1};
	if (s->tq > 0 && mode == BWD_WGMMA) {
		/* D and the zeroed dq accumulator, a warp a row; L as the forward
		 * wrote it, else from the forward's wgmma kernel without P V (two
		 * warpgroups, 128 rows a block, as kl_attn_wgmma) */
		long long n = (long long)rows;
		void *argv2[2] = {&a, &n};
		unsigned grid[3] = {(unsigned)((n + 7) / 8), 1, 1}, b256[3] = {256, 1, 1};
		if (n / 8 >= 0x7fffffff)
			return kl__err(ctx, KL_EUNSUPPORTED,
			               "kl_sdpa backward: %lld query rows exceed one grid", n);
		if ((st = kl__cuda_launch(ctx, d, f[BWD_DD], grid, b256, 0, argv2, KL_LAUNCH_PDL)) !=
		    KL_OK)
			return st;
		if (lse) {
			/* the forward wrote L this call (kl_attn_fa3 or kl_attn_wgmma) */
			a.lse = lse;
			atomic_fetch_add(&n_lse_reused, 1);
		} else {
			kl_at_args fa;
			at_args(&fa, s, dt, q, k, v, 0);
			fa.ws = a.lse;
			unsigned g2[3] = {(unsigned)nbt,
			                  (unsigned)((s->tq + WG_BM(WG_TWO) - 1) / WG_BM(WG_TWO)), 1};
			unsigned b2[3] = {WG_THREADS(WG_TWO), 1, 1};
			void *fargv[1] = {&fa};
			if ((st = kl__cuda_launch(ctx, d, f[BWD_LSE], g2, b2,
			                          (unsigned)WG_SMEM(s->d, WG_TWO), fargv,
			                          KL_LAUNCH_PDL)) != KL_OK)
				return st;
		}
	} else if (s->tq > 0) {
		unsigned grid[3] = {(unsigned)nbt, (unsigned)nqb, 1};
		if ((st = kl__cuda_launch(ctx, d, f[BWD_PRE], grid, block, BWD_SMEM_PRE(s->d), argv,
		                          KL_LAUNCH_PDL)) != KL_OK)
			return st;
	}
	if (s->tk > 0 && mode == BWD_WGMMA) {
		/* one dim: a batch entry's key blocks side by side (kl_attnb_wg) */
		int64_t nb = nbt * ((s->tk + 127) / 128);
		if (nb > 0x7fffffff)
			return kl__err(ctx, KL_EUNSUPPORTED,
			               "kl_sdpa backward: batch %lld x %lld blocks of 128 keys exceed "
			               "one grid",
			               (long long)nbt, (long long)((s->tk + 127) / 128));
		unsigned grid[3] = {(unsigned)nb, 1, 1};
		unsigned b256[3] = {256, 1, 1};
		if ((st = kl__cuda_launch(ctx, d, f[BWD_WG], grid, b256, BWD_SMEM_WG(s->d), argv,
		                          KL_LAUNCH_PDL)) != KL_OK)
			return st;
	} else if (s->tk > 0) {
		unsigned grid[3] = {(unsigned)nbt, (unsigned)nkb, 1};
		if ((st = kl__cuda_launch(ctx, d, f[split ? BWD_KV_SPLIT : BWD_KV], grid, block,
		                          split ? BWD_SMEM_KV_SPLIT(s->d) : BWD_SMEM_KV(s->d), argv,
		                          KL_LAUNCH_PDL)) != KL_OK)
			return st;
	}
	if (split) {
		if (s->tq == 0)
			return KL_OK;
		unsigned grid[3] = {(unsigned)nbt, (unsigned)nqb, 1};
		return kl__cuda_launch(ctx, d, f[BWD_DQ_SPLIT], grid, block,
		                       BWD_SMEM_DQ_SPLIT(s->d), argv, KL_LAUNCH_PDL);
	}
	long long n = (long long)rows * s->d;
	if (n == 0)
		return KL_OK;
	if ((n + 255) / 256 > 0x7fffffff)
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_sdpa backward: %lld dq elements exceed one grid",
		               n);
	void *argv2[2] = {&a, &n};
	/* 8 elements a thread where the head dim allows (kl_attnb_dq) */
	long long per = s->d % 8 == 0 ? 8 : 1;
	unsigned grid[3] = {(unsigned)((n / per + 255) / 256), 1, 1};
	unsigned b256[3] = {256, 1, 1};
	return kl__cuda_launch(ctx, d, f[BWD_DQ], grid, b256, 0, argv2, KL_LAUNCH_PDL);
}
