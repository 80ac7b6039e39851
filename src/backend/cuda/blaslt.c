/* blaslt.c - matrix products through cuBLASLt: row-major problems expressed
 * as column-major ones (D^T = B^T A^T), epilogues (bias, ReLU, GELU), alpha
 * and beta * C, strided batches; descriptors and the heuristic's choice are
 * cached per shape so that a repeated product costs one cublasLtMatmul call.
 */
#include "backend/cuda/device.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct lt_key {
	int32_t ab, cd, tf32, epi, has_bias;
	kl_lt_geom geo;
	int64_t batch, a_bs, b_bs, c_bs, d_bs, bias_bs;
	uint32_t align[5]; /* our a, b, c, d, bias pointers: alignment in bytes (<= 256) */
} lt_key;

typedef struct lt_plan {
	lt_key key;
	uint64_t hash;
	cublasLtMatmulDesc_t op;
	cublasLtMatrixLayout_t la, lb, lc, ld; /* cuBLASLt's A (our B), B (our A), C, D */
	bool have_algo;
	kl_lt_algo algo; /* the heuristic's first choice */
	bool ran;        /* cublasLtMatmul was called with it (the startup log) */
} lt_plan;

typedef struct kl_lt_state {
	cublasLtHandle_t h;
	CUdeviceptr ws;
	size_t ws_bytes;
	lt_plan *plans;
	int nplans, cap;
} kl_lt_state;

static const char *epi_name(kl_epilogue e)
{
	static const char *const names[] = {"default", "relu",      "gelu",
	                                    "bias",    "relu_bias", "gelu_bias"};
	return (unsigned)e < sizeof names / sizeof names[0] ? names[e] : "?";
}

static kl_status lt_fail(kl_ctx *ctx, cublasStatus_t st, const char *call, const kl_gemm *g)
{
	return kl__err(ctx, st == CUBLAS_STATUS_ALLOC_FAILED ? KL_ENOMEM : KL_EDEVICE,
	               "kl_cuda: %s failed: %s (%s) for %s x %s -> %s [m=%lld n=%lld k=%lld] "
	               "batch %lld, epilogue %s",
	               call, kl__lt.cublasLtGetStatusName(st), kl__lt.cublasLtGetStatusString(st),
	               kl_dtype_name(g->ab), kl_dtype_name(g->ab), kl_dtype_name(g->cd),
	               (long long)g->m, (long long)g->n, (long long)g->k, (long long)g->batch,
	               epi_name(g->epi));
}

/* "bf16 [m=4096 n=8192 k=2048] batch 1, epilogue default" for the startup log */
static const char *gemm_what(const kl_gemm *g, char *buf, size_t cap)
{
	snprintf(buf, cap, "%s->%s [m=%lld n=%lld k=%lld] batch %lld, epilogue %s",
	         kl_dtype_name(g->ab), kl_dtype_name(g->cd), (long long)g->m, (long long)g->n,
	         (long long)g->k, (long long)g->batch, epi_name(g->epi));
	return buf;
}

#define LT_TRY(call, what)                                    \
	do {                                                  \
		cublasStatus_t lt_st_ = (call);               \
		if (lt_st_ != CUBLAS_STATUS_SUCCESS)          \
			return lt_fail(ctx, lt_st_, what, g); \
	} while (0)

/* ---- geometry (no GPU) --------------------------------------------------------------- */

/* Each operand per kl__mm_operand_layout (plan.h): row-wise (cs == 1:
 * column-major cols x rows, ld = rs) or column-wise (rs == 1: column-major
 * rows x cols, ld = cs). */
kl_status kl__lt_geometry(const kl_gemm *g, kl_lt_geom *o, char *why, size_t cap)
{
	memset(o, 0, sizeof *o);
	if (g->m <= 0 || g->n <= 0 || g->k <= 0) {
		snprintf(why, cap, "empty product [m=%lld n=%lld k=%lld]", (long long)g->m,
		         (long long)g->n, (long long)g->k);
		return KL_EINVAL;
	}
	int64_t M = g->m, N = g->n, K = g->k, lda = 0, ldb = 0;
	int la = kl__mm_operand_layout(M, K, g->a_rs, g->a_cs, &lda);
	int lb = kl__mm_operand_layout(K, N, g->b_rs, g->b_cs, &ldb);
	if (la < 0 || lb < 0) {
		snprintf(why, cap,
		         "operand %s strides [%lld,%lld] of a %lldx%lld matrix have no unit stride "
		         "with a leading dimension cuBLASLt accepts (make it contiguous)",
		         la < 0 ? "A" : "B", (long long)(la < 0 ? g->a_rs : g->b_rs),
		         (long long)(la < 0 ? g->a_cs : g->b_cs), (long long)(la < 0 ? M : K),
		         (long long)(la < 0 ? K : N));
		return KL_EUNSUPPORTED;
	}
	int64_t ldd = M == 1 && g->ldd < N ? N : g->ldd;
	int64_t ldc = M == 1 && g->ldc < N ? N : g->ldc;
	if (ldd < N || ldc < N) {
		snprintf(why, cap, "row stride %lld of %s is below its %lld columns",
		         (long long)(ldd < N ? g->ldd : g->ldc), ldd < N ? "D" : "C", (long long)N);
		return KL_EINVAL;
	}
	o->m = N;
	o->n = M;
	o->k = K;
	/* cuBLASLt's A is B^T (N x K): our B stored row-wise is exactly that. */
	o->trans_a = lb;
	o->a_rows = (uint64_t)(lb ? K : N);
	o->a_cols = (uint64_t)(lb ? N : K);
	o->lda = ldb;
	/* cuBLASLt's B is A^T (K x M). */
	o->trans_b = la;
	o->b_rows = (uint64_t)(la ? M : K);
	o->b_cols = (uint64_t)(la ? K : M);
	o->ldb = lda;
	o->ldc = ldc;
	o->ldd = ldd;
	return KL_OK;
}

/* ---- state ----------------------------------------------------------------------------- */

kl_status kl__lt_open(kl_ctx *ctx, kl_cuda_dev *d)
{
	if (d->lt)
		return kl__cuda_bind(ctx, d);
	kl_status s = kl__cuda_load_cublaslt(ctx);
	if (s != KL_OK)
		return s;
	if ((s = kl__cuda_bind(ctx, d)) != KL_OK)
		return s;
	kl_lt_state *st = calloc(1, sizeof *st);
	if (!st)
		return kl__err(ctx, KL_ENOMEM, "kl_cuda: out of host memory");
	double t0 = kl__now_ms();
	cublasStatus_t cs = kl__lt.cublasLtCreate(&st->h);
	if (cs != CUBLAS_STATUS_SUCCESS) {
		free(st);
		return kl__err(ctx, KL_EDEVICE, "kl_cuda: cublasLtCreate failed: %s (%s)",
		               kl__lt.cublasLtGetStatusName(cs),
		               kl__lt.cublasLtGetStatusString(cs));
	}
	double t1 = kl__now_ms();
	/* NVIDIA's advice: 32 MiB of workspace from Hopper on, 4 MiB before. */
	st->ws_bytes = (d->cc_major >= 9 ? 32u : 4u) << 20;
	if ((s = kl__cuda_malloc(ctx, d, st->ws_bytes, &st->ws)) != KL_OK) {
		kl__lt.cublasLtDestroy(st->h);
		free(st);
		return s;
	}
	kl__log(ctx, KL_LOG_STARTUP, "cuBLASLt %zu: cublasLtCreate %.3f ms, %zu MiB workspace %.3f ms",
	        kl__lt.version, t1 - t0, st->ws_bytes >> 20, kl__now_ms() - t1);
	d->lt = st;
	/* cuBLASLt starts itself up (about 0.1 s on an H200) inside its first
	 * heuristic query: ask once here, for a small bf16 product, so that the
	 * cost belongs to opening the device and not to a program's first call.
	 * Nothing is launched; a failure only leaves the cost where it was. */
	double t2 = kl__now_ms();
	kl_gemm g = {.ab = KL_BF16, .cd = KL_BF16, .m = 64, .n = 64, .k = 64, .a_rs = 64,
	             .a_cs = 1, .b_rs = 64, .b_cs = 1, .ldc = 64, .ldd = 64, .batch = 1,
	             .epi = KL_EPI_DEFAULT, .alpha = 1, .beta = 0, .a = st->ws, .b = st->ws,
	             .d = st->ws};
	kl_lt_algo algo;
	int n = 0;
	if (kl__lt_heuristics(ctx, d, &g, 1, &algo, &n) != KL_OK)
		kl_clear_error(ctx);
	kl__log(ctx, KL_LOG_STARTUP, "cuBLASLt start-up (a first heuristic query) %.3f ms",
	        kl__now_ms() - t2);
	return KL_OK;
}

static kl_status lt_state(kl_ctx *ctx, kl_cuda_dev *d, kl_lt_state **out)
{
	kl_status s = kl__lt_open(ctx, d);
	*out = d->lt;
	return s;
}

static void plan_destroy(lt_plan *p)
{
	if (p->op)
		kl__lt.cublasLtMatmulDescDestroy(p->op);
	if (p->la)
		kl__lt.cublasLtMatrixLayoutDestroy(p->la);
	if (p->lb)
		kl__lt.cublasLtMatrixLayoutDestroy(p->lb);
	if (p->lc)
		kl__lt.cublasLtMatrixLayoutDestroy(p->lc);
	if (p->ld)
		kl__lt.cublasLtMatrixLayoutDestroy(p->ld);
}

void kl__lt_release(kl_cuda_dev *d)
{
	kl_lt_state *st = d->lt;
	if (!st)
		return;
	for (int i = 0; i < st->nplans; i++)
		plan_destroy(&st->plans[i]);
	free(st->plans);
	if (kl__cuda_bind(NULL, d) == KL_OK) {
		kl__cu.cuStreamSynchronize(d->stream);
		kl__lt.cublasLtDestroy(st->h);
	}
	kl__cuda_free(NULL, d, st->ws);
	free(st);
	d->lt = NULL;
}

/* ---- plans ----------------------------------------------------------------------------- */

static cudaDataType lt_type(kl_dtype dt)
{
	switch (dt) {
	case KL_F16:
		return CUDA_R_16F;
	case KL_BF16:
		return CUDA_R_16BF;
	case KL_F64:
		return CUDA_R_64F;
	default:
		return CUDA_R_32F;
	}
}

static uint32_t lt_epilogue(kl_epilogue e)
{
	switch (e) {
	case KL_EPI_RELU:
		return CUBLASLT_EPILOGUE_RELU;
	case KL_EPI_GELU:
		return CUBLASLT_EPILOGUE_GELU;
	case KL_EPI_BIAS:
		return CUBLASLT_EPILOGUE_BIAS;
	case KL_EPI_RELU_BIAS:
		return CUBLASLT_EPILOGUE_RELU_BIAS;
	case KL_EPI_GELU_BIAS:
		return CUBLASLT_EPILOGUE_GELU_BIAS;
	default:
		return CUBLASLT_EPILOGUE_DEFAULT;
	}
}

static bool epi_has_bias(kl_epilogue e)
{
	return e == KL_EPI_BIAS || e == KL_EPI_RELU_BIAS || e == KL_EPI_GELU_BIAS;
}

static uint32_t ptr_align(CUdeviceptr p)
{
	uint64_t v = (uint64_t)p | 256u;
	return (uint32_t)(v & (~v + 1));
}

/* Validate g, fill the key; c falls back to d when beta needs no C. */
static kl_status make_key(kl_ctx *ctx, kl_gemm *g, lt_key *k)
{
	char why[256];
	bool half = g->ab == KL_F16 || g->ab == KL_BF16;
	if (!(half || g->ab == KL_F32 || g->ab == KL_F64))
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_matmul: %s matrix products are not supported "
		               "on CUDA (cuBLASLt takes f16, bf16, f32, f64)",
		               kl_dtype_name(g->ab));
	if (!(g->cd == g->ab || (half && g->cd == KL_F32)))
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_matmul: %s inputs with a %s result are not supported on CUDA",
		               kl_dtype_name(g->ab), kl_dtype_name(g->cd));
	if (g->batch < 1 || g->batch > INT32_MAX)
		return kl__err(ctx, KL_EINVAL, "kl_matmul: batch count %lld out of range",
		               (long long)g->batch);
	if (epi_has_bias(g->epi) && !g->bias)
		return kl__err(ctx, KL_EINVAL, "kl_matmul: epilogue %s without a bias vector",
		               epi_name(g->epi));
	if (!g->a || !g->b || !g->d)
		return kl__err(ctx, KL_EINVAL, "kl_matmul: NULL device pointer for %s",
		               !g->a   ? "A"
		               : !g->b ? "B"
		                       : "D");
	if (!g->c) {
		if (g->beta != 0)
			return kl__err(ctx, KL_EINVAL, "kl_matmul: beta %g with no C matrix",
			               g->beta);
		g->c = g->d;
		g->ldc = g->ldd;
		g->c_bs = g->d_bs;
	}
	if (g->c == g->d && (g->ldc != g->ldd || g->c_bs != g->d_bs))
		return kl__err(ctx, KL_EINVAL, "kl_matmul: in-place C == D needs the same layout");
	if (g->batch > 1 && g->d_bs == 0)
		return kl__err(ctx, KL_EINVAL, "kl_matmul: batch of %lld writes one D (stride 0)",
		               (long long)g->batch);
	memset(k, 0, sizeof *k);
	kl_status s = kl__lt_geometry(g, &k->geo, why, sizeof why);
	if (s != KL_OK)
		return kl__err(ctx, s, "kl_matmul: %s", why);
	k->ab = g->ab;
	k->cd = g->cd;
	k->tf32 = g->ab == KL_F32 && g->allow_tf32;
	k->epi = g->epi;
	k->has_bias = epi_has_bias(g->epi);
	k->batch = g->batch;
	if (g->batch > 1) {
		k->a_bs = g->a_bs;
		k->b_bs = g->b_bs;
		k->c_bs = g->c_bs;
		k->d_bs = g->d_bs;
		k->bias_bs = k->has_bias ? g->bias_bs : 0;
	}
	k->align[0] = ptr_align(g->a);
	k->align[1] = ptr_align(g->b);
	k->align[2] = ptr_align(g->c);
	k->align[3] = ptr_align(g->d);
	k->align[4] = k->has_bias ? ptr_align(g->bias) : 0;
	return KL_OK;
}

static cublasStatus_t make_layout(cublasLtMatrixLayout_t *l, cudaDataType t, uint64_t rows,
                                  uint64_t cols, int64_t ld, int64_t batch, int64_t bs)
{
	cublasStatus_t s = kl__lt.cublasLtMatrixLayoutCreate(l, t, rows, cols, ld);
	if (s != CUBLAS_STATUS_SUCCESS || batch <= 1)
		return s;
	int32_t n = (int32_t)batch;
	s = kl__lt.cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n,
	                                            sizeof n);
	if (s == CUBLAS_STATUS_SUCCESS)
		s = kl__lt.cublasLtMatrixLayoutSetAttribute(
		        *l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &bs, sizeof bs);
	return s;
}

static kl_status plan_build(kl_ctx *ctx, const kl_gemm *g, const lt_key *k, lt_plan *p)
{
	cublasComputeType_t compute = k->ab == KL_F64 ? CUBLAS_COMPUTE_64F
	                              : k->tf32       ? CUBLAS_COMPUTE_32F_FAST_TF32
	                                              : CUBLAS_COMPUTE_32F;
	cudaDataType scale = k->ab == KL_F64 ? CUDA_R_64F : CUDA_R_32F;
	const kl_lt_geom *o = &k->geo;
	LT_TRY(kl__lt.cublasLtMatmulDescCreate(&p->op, compute, scale), "cublasLtMatmulDescCreate");
	int32_t ta = o->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
	int32_t tb = o->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
	uint32_t epi = lt_epilogue((kl_epilogue)k->epi);
	LT_TRY(kl__lt.cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
	                                             sizeof ta),
	       "cublasLtMatmulDescSetAttribute(TRANSA)");
	LT_TRY(kl__lt.cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
	                                             sizeof tb),
	       "cublasLtMatmulDescSetAttribute(TRANSB)");
	LT_TRY(kl__lt.cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
	                                             sizeof epi),
	       "cublasLtMatmulDescSetAttribute(EPILOGUE)");
	if (k->has_bias && k->batch > 1) {
		int64_t bbs = k->bias_bs;
		LT_TRY(kl__lt.cublasLtMatmulDescSetAttribute(
		               p->op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &bbs, sizeof bbs),
		       "cublasLtMatmulDescSetAttribute(BIAS_BATCH_STRIDE)");
	}
	cudaDataType tab = lt_type((kl_dtype)k->ab), tcd = lt_type((kl_dtype)k->cd);
	/* cuBLASLt's A is our B and its B our A: their batch strides swap too. */
	LT_TRY(make_layout(&p->la, tab, o->a_rows, o->a_cols, o->lda, k->batch, k->b_bs),
	       "cublasLtMatrixLayoutCreate(A)");
	LT_TRY(make_layout(&p->lb, tab, o->b_rows, o->b_cols, o->ldb, k->batch, k->a_bs),
	       "cublasLtMatrixLayoutCreate(B)");
	LT_TRY(make_layout(&p->lc, tcd, (uint64_t)o->m, (uint64_t)o->n, o->ldc, k->batch, k->c_bs),
	       "cublasLtMatrixLayoutCreate(C)");
	LT_TRY(make_layout(&p->ld, tcd, (uint64_t)o->m, (uint64_t)o->n, o->ldd, k->batch, k->d_bs),
	       "cublasLtMatrixLayoutCreate(D)");
	(void)g;
	return KL_OK;
}

static kl_status set_bias(kl_ctx *ctx, const kl_gemm *g, lt_plan *p)
{
	if (!p->key.has_bias)
		return KL_OK;
	const void *bp = (const void *)(uintptr_t)g->bias;
	LT_TRY(kl__lt.cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp,
	                                             sizeof bp),
	       "cublasLtMatmulDescSetAttribute(BIAS_POINTER)");
	return KL_OK;
}

static uint64_t key_hash(const lt_key *k)
{
	return kl__hash_bytes(KL_HASH_SEED, k, sizeof *k);
}

/* The cached plan for g (made on a miss); g is normalized by make_key. */
static kl_status plan_get(kl_ctx *ctx, kl_cuda_dev *d, kl_gemm *g, kl_lt_state **stp, lt_plan **out)
{
	lt_key k;
	kl_status s = make_key(ctx, g, &k);
	if (s != KL_OK)
		return s;
	kl_lt_state *st = NULL;
	if ((s = lt_state(ctx, d, &st)) != KL_OK)
		return s;
	*stp = st;
	uint64_t h = key_hash(&k);
	for (int i = 0; i < st->nplans; i++) {
		if (st->plans[i].hash == h && memcmp(&st->plans[i].key, &k, sizeof k) == 0) {
			*out = &st->plans[i];
			return set_bias(ctx, g, *out);
		}
	}
	if (st->nplans == st->cap) {
		int cap = st->cap ? st->cap * 2 : 16;
		lt_plan *np = realloc(st->plans, (size_t)cap * sizeof *np);
		if (!np)
			return kl__err(ctx, KL_ENOMEM, "kl_cuda: out of host memory");
		st->plans = np;
		st->cap = cap;
	}
	lt_plan *p = &st->plans[st->nplans];
	memset(p, 0, sizeof *p);
	p->key = k;
	p->hash = h;
	double t0 = kl__now_ms();
	if ((s = plan_build(ctx, g, &k, p)) != KL_OK || (s = set_bias(ctx, g, p)) != KL_OK) {
		plan_destroy(p);
		return s;
	}
	if (ctx->logs & KL_LOG_STARTUP) {
		char what[160];
		kl__log(ctx, KL_LOG_STARTUP, "cuBLASLt %s: descriptors and layouts %.3f ms",
		        gemm_what(g, what, sizeof what), kl__now_ms() - t0);
	}
	st->nplans++;
	*out = p;
	return KL_OK;
}

static kl_status heuristics(kl_ctx *ctx, kl_lt_state *st, const kl_gemm *g, lt_plan *p, int want,
                            kl_lt_algo *out, int *n)
{
	*n = 0;
	cublasLtMatmulPreference_t pref = NULL;
	LT_TRY(kl__lt.cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
	uint64_t ws = st->ws_bytes;
	/* pointer alignments, in cuBLASLt's operand order */
	uint32_t al[4] = {p->key.align[1], p->key.align[0], p->key.align[2], p->key.align[3]};
	cublasLtMatmulPreferenceAttributes_t attr[4] = {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
	                                                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
	                                                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
	                                                CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
	cublasStatus_t cs = kl__lt.cublasLtMatmulPreferenceSetAttribute(
	        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
	for (int i = 0; i < 4 && cs == CUBLAS_STATUS_SUCCESS; i++)
		cs = kl__lt.cublasLtMatmulPreferenceSetAttribute(pref, attr[i], &al[i],
		                                                 sizeof al[i]);
	cublasLtMatmulHeuristicResult_t res[32];
	int got = 0;
	if (want > 32)
		want = 32;
	double t0 = kl__now_ms();
	if (cs == CUBLAS_STATUS_SUCCESS)
		cs = kl__lt.cublasLtMatmulAlgoGetHeuristic(st->h, p->op, p->la, p->lb, p->lc, p->ld,
		                                           pref, want, res, &got);
	kl__lt.cublasLtMatmulPreferenceDestroy(pref);
	if (cs != CUBLAS_STATUS_SUCCESS)
		return lt_fail(ctx, cs, "cublasLtMatmulAlgoGetHeuristic", g);
	if (ctx->logs & KL_LOG_STARTUP) {
		char what[160];
		kl__log(ctx, KL_LOG_STARTUP,
		        "cuBLASLt %s: heuristic (%d of %d candidates asked) %.3f ms",
		        gemm_what(g, what, sizeof what), got, want, kl__now_ms() - t0);
	}
	for (int i = 0; i < got; i++) {
		if (res[i].state != CUBLAS_STATUS_SUCCESS || res[i].workspaceSize > st->ws_bytes)
			continue;
		out[*n].algo = res[i].algo;
		out[*n].workspace = res[i].workspaceSize;
		out[*n].waves = res[i].wavesCount;
		for (int j = 0; j < 4; j++)
			out[*n].align[j] = p->key.align[j];
		(*n)++;
	}
	if (*n == 0)
		return kl__err(
		        ctx, KL_EUNSUPPORTED,
		        "kl_matmul: cuBLASLt has no algorithm for %s x %s -> %s [m=%lld n=%lld "
		        "k=%lld] batch %lld, epilogue %s",
		        kl_dtype_name(g->ab), kl_dtype_name(g->ab), kl_dtype_name(g->cd),
		        (long long)g->m, (long long)g->n, (long long)g->k, (long long)g->batch,
		        epi_name(g->epi));
	return KL_OK;
}

kl_status kl__lt_heuristics(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g0, int want,
                            kl_lt_algo *out, int *n)
{
	*n = 0;
	if (want < 1)
		return kl__err(ctx, KL_EINVAL, "kl_matmul: asked for %d candidate algorithms",
		               want);
	kl_gemm gg = *g0;
	kl_lt_state *st = NULL;
	lt_plan *p = NULL;
	kl_status s = plan_get(ctx, d, &gg, &st, &p);
	if (s != KL_OK)
		return s;
	return heuristics(ctx, st, &gg, p, want, out, n);
}

/* An algorithm found for pointers aligned to algo->align runs on p's
 * pointers only when each is at least as aligned. */
static bool algo_fits(const lt_plan *p, const kl_lt_algo *algo)
{
	for (int j = 0; j < 4; j++)
		if (p->key.align[j] < algo->align[j])
			return false;
	return true;
}

kl_status kl__lt_algo_check(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g0, const kl_lt_algo *algo,
                            char *why, size_t cap)
{
	kl_gemm gg = *g0;
	kl_gemm *g = &gg;
	kl_lt_state *st = NULL;
	lt_plan *p = NULL;
	why[0] = 0;
	kl_status s = plan_get(ctx, d, g, &st, &p);
	if (s != KL_OK) {
		snprintf(why, cap, "%s", kl_last_error(ctx));
		return s;
	}
	if (algo->workspace > st->ws_bytes) {
		snprintf(why, cap, "it needs %zu bytes of workspace, %zu available",
		         algo->workspace, st->ws_bytes);
		return KL_EFORMAT;
	}
	cublasLtMatmulHeuristicResult_t res;
	memset(&res, 0, sizeof res);
	cublasStatus_t cs = kl__lt.cublasLtMatmulAlgoCheck(st->h, p->op, p->la, p->lb, p->lc,
	                                                   p->ld, &algo->algo, &res);
	if (cs != CUBLAS_STATUS_SUCCESS) {
		snprintf(why, cap, "cublasLtMatmulAlgoCheck: %s",
		         kl__lt.cublasLtGetStatusName(cs));
		return KL_EFORMAT;
	}
	if (res.workspaceSize > algo->workspace) {
		snprintf(why, cap, "it needs %zu bytes of workspace, the entry says %zu",
		         res.workspaceSize, algo->workspace);
		return KL_EFORMAT;
	}
	return KL_OK;
}

kl_status kl__lt_matmul(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g0, const kl_lt_algo *algo)
{
	kl_gemm gg = *g0;
	kl_gemm *g = &gg; /* LT_TRY names the problem through `g` */
	/* a few rows (a decode step): kiln's own kernel reads the weight at
	 * the memory's speed (gemv_cuda.c); max-autotune's timed choice, when
	 * given, is cuBLASLt's */
	if (!algo && kl__cuda_gemv_fits(g)) {
		bool done = false;
		kl_status s = kl__cuda_gemv(ctx, d, g, &done);
		if (s != KL_OK || done)
			return s;
	}
	kl_lt_state *st = NULL;
	lt_plan *p = NULL;
	kl_status s = plan_get(ctx, d, g, &st, &p);
	if (s != KL_OK)
		return s;
	if (algo && algo->workspace > st->ws_bytes)
		return kl__err(ctx, KL_EINVAL,
		               "kl_matmul: algorithm needs %zu bytes of workspace, "
		               "%zu available",
		               algo->workspace, st->ws_bytes);
	/* none given, or one chosen for better-aligned pointers than these:
	 * the heuristic's choice for this alignment is the safe one */
	if (!algo || !algo_fits(p, algo)) {
		if (!p->have_algo) {
			int n = 0;
			if ((s = heuristics(ctx, st, g, p, 1, &p->algo, &n)) != KL_OK)
				return s;
			p->have_algo = true;
		}
		algo = &p->algo;
	}
	float af = (float)g->alpha, bf = (float)g->beta;
	const void *alpha = &af, *beta = &bf;
	if (g->ab == KL_F64) {
		alpha = &g->alpha;
		beta = &g->beta;
	}
	double t0 = kl__now_ms();
	LT_TRY(kl__lt.cublasLtMatmul(st->h, p->op, alpha, (const void *)(uintptr_t)g->b, p->la,
	                             (const void *)(uintptr_t)g->a, p->lb, beta,
	                             (const void *)(uintptr_t)g->c, p->lc, (void *)(uintptr_t)g->d,
	                             p->ld, &algo->algo, (void *)(uintptr_t)st->ws, algo->workspace,
	                             d->stream),
	       "cublasLtMatmul");
	if (!p->ran) {
		/* the host side of the first call: the driver loads the kernel it
		 * picked here (lazy module loading), before the launch */
		p->ran = true;
		if (ctx->logs & KL_LOG_STARTUP) {
			char what[160];
			kl__log(ctx, KL_LOG_STARTUP,
			        "cuBLASLt %s: first cublasLtMatmul %.3f ms (host, enqueue)%s",
			        gemm_what(g, what, sizeof what), kl__now_ms() - t0,
			        d->capturing ? ", while capturing" : "");
		}
	}
	return KL_OK;
}

kl_status kl__lt_prepare_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_matmul_step *mm, kl_dtype ab,
                              kl_dtype cd, CUdeviceptr a, CUdeviceptr b, CUdeviceptr c,
                              CUdeviceptr r, CUdeviceptr bias)
{
	kl_gemm g;
	bool lib = false;
	kl_status s = kl__lt_step_gemm(ctx, mm, ab, cd, a, b, c, r, bias, &g, &lib);
	if (s != KL_OK || !lib)
		return s;
	kl_lt_state *st = NULL;
	lt_plan *p = NULL;
	if ((s = plan_get(ctx, d, &g, &st, &p)) != KL_OK || p->have_algo)
		return s;
	int n = 0;
	if ((s = heuristics(ctx, st, &g, p, 1, &p->algo, &n)) != KL_OK)
		return s;
	p->have_algo = true;
	return KL_OK;
}

kl_status kl__lt_time(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g, const kl_lt_algo *algo,
                      int reps, float *ms)
{
	*ms = 0;
	if (reps < 1)
		return kl__err(ctx, KL_EINVAL, "kl_matmul: timing over %d calls", reps);
	if (d->capturing)
		return kl__err(ctx, KL_ESTATE, "kl_matmul: cannot time a product during capture");
	kl_status s = kl__lt_matmul(ctx, d, g, algo);
	if (s != KL_OK)
		return s;
	CUevent e0 = NULL, e1 = NULL;
	if ((s = kl__cuda_event_new(ctx, d, &e0)) != KL_OK ||
	    (s = kl__cuda_event_new(ctx, d, &e1)) != KL_OK)
		goto done;
	if ((s = kl__cuda_event_record(ctx, d, e0)) != KL_OK)
		goto done;
	for (int i = 0; i < reps && s == KL_OK; i++)
		s = kl__lt_matmul(ctx, d, g, algo);
	if (s == KL_OK && (s = kl__cuda_event_record(ctx, d, e1)) == KL_OK &&
	    (s = kl__cuda_event_ms(ctx, e0, e1, ms)) == KL_OK)
		*ms /= (float)reps;
done:
	kl__cuda_event_free(d, e0);
	kl__cuda_event_free(d, e1);
	return s;
}

/* ---- batches over several dims ------------------------------------------------------- */

/* g0 over a grid of batch dims, reduced to one strided batch (the innermost
 * dims that nest, in g) and the outer dims left to loop (ext/st[..][0..outer)). */
typedef struct nd_loop {
	kl_gemm g;
	int outer;
	bool has_c, empty;
	int64_t ext[KL_MAX_DIMS], st[4][KL_MAX_DIMS];
} nd_loop;

static kl_status nd_plan(kl_ctx *ctx, const kl_gemm *g0, int nbatch, const int64_t *batch,
                         const int64_t *a_bs, const int64_t *b_bs, const int64_t *c_bs,
                         const int64_t *d_bs, nd_loop *L)
{
	if (nbatch < 0 || nbatch > KL_MAX_DIMS)
		return kl__err(ctx, KL_EINVAL, "kl_matmul: %d batch dims", nbatch);
	/* dims of extent > 1, outermost first, with their strides per operand */
	int64_t *ext = L->ext;
	int64_t(*st)[KL_MAX_DIMS] = L->st;
	int n = 0;
	L->has_c = g0->c != 0;
	L->empty = false;
	for (int i = 0; i < nbatch; i++) {
		if (batch[i] <= 0) {
			L->empty = true; /* nothing to compute */
			return KL_OK;
		}
		if (batch[i] == 1)
			continue;
		ext[n] = batch[i];
		st[0][n] = a_bs[i];
		st[1][n] = b_bs[i];
		st[2][n] = L->has_c ? c_bs[i] : d_bs[i];
		st[3][n] = d_bs[i];
		n++;
	}
	/* merge dim i into dim i+1 when i steps over exactly all of i+1 */
	int m = n;
	for (int i = n - 2; i >= 0; i--) {
		bool nests = true;
		for (int o = 0; o < 4; o++)
			nests = nests && st[o][i] == st[o][i + 1] * ext[i + 1];
		if (!nests)
			continue;
		ext[i + 1] *= ext[i];
		for (int j = i; j < m - 1; j++) {
			ext[j] = ext[j + 1];
			for (int o = 0; o < 4; o++)
				st[o][j] = st[o][j + 1];
		}
		m--;
	}
	kl_gemm *g = &L->g;
	*g = *g0;
	g->batch = 1;
	g->a_bs = g->b_bs = g->c_bs = g->d_bs = 0;
	g->bias_bs = 0;
	if (m > 0) {
		g->batch = ext[m - 1];
		g->a_bs = st[0][m - 1];
		g->b_bs = st[1][m - 1];
		g->c_bs = st[2][m - 1];
		g->d_bs = st[3][m - 1];
	}
	L->outer = m > 0 ? m - 1 : 0;
	return KL_OK;
}

static kl_status matmul_nd(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g0, int nbatch,
                           const int64_t *batch, const int64_t *a_bs, const int64_t *b_bs,
                           const int64_t *c_bs, const int64_t *d_bs, const kl_lt_algo *algo)
{
	nd_loop L;
	kl_status s = nd_plan(ctx, g0, nbatch, batch, a_bs, b_bs, c_bs, d_bs, &L);
	if (s != KL_OK || L.empty)
		return s;
	/* the outer dims loop */
	int64_t idx[KL_MAX_DIMS] = {0};
	size_t eab = kl_dtype_size(g0->ab), ecd = kl_dtype_size(g0->cd);
	for (;;) {
		int64_t off[4] = {0, 0, 0, 0};
		for (int j = 0; j < L.outer; j++)
			for (int o = 0; o < 4; o++)
				off[o] += idx[j] * L.st[o][j];
		kl_gemm gi = L.g;
		gi.a = g0->a + (CUdeviceptr)(off[0] * (int64_t)eab);
		gi.b = g0->b + (CUdeviceptr)(off[1] * (int64_t)eab);
		gi.c = L.has_c ? g0->c + (CUdeviceptr)(off[2] * (int64_t)ecd) : 0;
		gi.d = g0->d + (CUdeviceptr)(off[3] * (int64_t)ecd);
		if ((s = kl__lt_matmul(ctx, d, &gi, algo)) != KL_OK)
			return s;
		int j = L.outer - 1;
		while (j >= 0 && ++idx[j] == L.ext[j])
			idx[j--] = 0;
		if (j < 0)
			break;
	}
	return KL_OK;
}

/* the cuBLASLt epilogue of a step's activation and bias */
static kl_status step_epilogue(kl_ctx *ctx, const kl_matmul_step *mm, kl_epilogue *out)
{
	switch (mm->act) {
	case KL_MM_ACT_NONE:
		*out = mm->has_bias ? KL_EPI_BIAS : KL_EPI_DEFAULT;
		return KL_OK;
	case KL_MM_ACT_RELU:
		*out = mm->has_bias ? KL_EPI_RELU_BIAS : KL_EPI_RELU;
		return KL_OK;
	case KL_MM_ACT_GELU_TANH:
		*out = mm->has_bias ? KL_EPI_GELU_BIAS : KL_EPI_GELU;
		return KL_OK;
	default:
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_matmul: cuBLASLt has no epilogue for activation %d (its GELU is "
		               "the tanh approximation; erf GELU runs as a generated kernel)",
		               (int)mm->act);
	}
}

kl_status kl__lt_matmul_nd(kl_ctx *ctx, kl_cuda_dev *d, const kl_gemm *g0, int nbatch,
                           const int64_t *batch, const int64_t *a_bs, const int64_t *b_bs,
                           const int64_t *c_bs, const int64_t *d_bs)
{
	return matmul_nd(ctx, d, g0, nbatch, batch, a_bs, b_bs, c_bs, d_bs, NULL);
}

/* The product a runtime step asks for, epilogue included, before its batch
 * dims are merged. */
static kl_status step_gemm(kl_ctx *ctx, const kl_matmul_step *mm, kl_dtype ab, kl_dtype cd,
                           CUdeviceptr a, CUdeviceptr b, CUdeviceptr c, CUdeviceptr r,
                           CUdeviceptr bias, kl_gemm *g)
{
	size_t eab = kl_dtype_size(ab), ecd = kl_dtype_size(cd);
	memset(g, 0, sizeof *g);
	g->ab = ab;
	g->cd = cd;
	g->m = mm->m;
	g->n = mm->n;
	g->k = mm->k;
	g->a_rs = mm->a_rs;
	g->a_cs = mm->a_cs;
	g->b_rs = mm->b_rs;
	g->b_cs = mm->b_cs;
	g->ldc = g->ldd = mm->ldc;
	g->alpha = mm->alpha;
	g->beta = mm->beta;
	g->a = a + (CUdeviceptr)(mm->a_off * (int64_t)eab);
	g->b = b + (CUdeviceptr)(mm->b_off * (int64_t)eab);
	g->d = c + (CUdeviceptr)(mm->c_off * (int64_t)ecd);
	g->c = mm->beta != 0 ? g->d : 0;
	kl_status s = step_epilogue(ctx, mm, &g->epi);
	if (s != KL_OK)
		return s;
	if ((mm->has_r && !r) || (mm->has_bias && !bias))
		return kl__err(ctx, KL_EINVAL, "kl_matmul: NULL %s buffer",
		               mm->has_r && !r ? "residual" : "bias");
	if (mm->has_r) {
		/* D = alpha A B + beta R: cuBLASLt's C is the residual (C != D) */
		g->c = r + (CUdeviceptr)(mm->r_off * (int64_t)ecd);
		g->ldc = mm->r_ld;
	}
	if (mm->has_bias)
		g->bias = bias + (CUdeviceptr)(mm->bias_off * (int64_t)ecd);
	return KL_OK;
}

kl_status kl__lt_step_gemm(kl_ctx *ctx, const kl_matmul_step *mm, kl_dtype ab, kl_dtype cd,
                           CUdeviceptr a, CUdeviceptr b, CUdeviceptr c, CUdeviceptr r,
                           CUdeviceptr bias, kl_gemm *out, bool *lib)
{
	kl_gemm g;
	*lib = false;
	kl_status s = step_gemm(ctx, mm, ab, cd, a, b, c, r, bias, &g);
	if (s != KL_OK)
		return s;
	*out = g;
	if (g.m <= 0 || g.n <= 0 || g.k <= 0)
		return KL_OK;
	nd_loop L;
	s = nd_plan(ctx, &g, mm->nbatch, mm->batch, mm->a_bstride, mm->b_bstride,
	            mm->has_r ? mm->r_bstride : mm->c_bstride, mm->c_bstride, &L);
	if (s != KL_OK || L.empty)
		return s;
	*out = L.g;
	*lib = true;
	return KL_OK;
}

kl_status kl__lt_matmul_step(kl_ctx *ctx, kl_cuda_dev *d, const kl_matmul_step *mm, kl_dtype ab,
                             kl_dtype cd, CUdeviceptr a, CUdeviceptr b, CUdeviceptr c,
                             CUdeviceptr r, CUdeviceptr bias, const kl_lt_algo *algo)
{
	size_t ecd = kl_dtype_size(cd);
	kl_gemm g;
	kl_status s = step_gemm(ctx, mm, ab, cd, a, b, c, r, bias, &g);
	if (s != KL_OK)
		return s;
	bool epi = mm->has_r || mm->has_bias || mm->act != KL_MM_ACT_NONE;
	if (g.m <= 0 || g.n <= 0)
		return KL_OK;
	if (g.k <= 0 && epi)
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_matmul: k = 0 with an epilogue");
	if (g.k <= 0) { /* an empty sum: C = beta * C, which only beta == 0 makes cheap */
		if (mm->beta != 0 && mm->beta != 1)
			return kl__err(ctx, KL_EUNSUPPORTED, "kl_matmul: k = 0 with beta %g",
			               mm->beta);
		if (mm->beta != 0)
			return KL_OK;
		if (mm->nbatch == 0 && g.ldd == g.n)
			return kl__cuda_memset(ctx, d, g.d, 0, (size_t)(g.m * g.n) * ecd);
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_matmul: k = 0 over a strided or batched C");
	}
	return matmul_nd(ctx, d, &g, mm->nbatch, mm->batch, mm->a_bstride, mm->b_bstride,
	                 mm->has_r ? mm->r_bstride : mm->c_bstride, mm->c_bstride, algo);
}
