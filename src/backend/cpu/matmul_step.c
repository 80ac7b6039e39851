/* matmul_step.c - a plan's matrix-product step on the CPU: BLAS (operands
 * packed to f32 / f64 where BLAS cannot take them as they are; integer
 * products by loops) followed by one pass over the product for its epilogue
 * (residual, bias, activation through the eager unary kernels); kiln's own
 * small product (gemm_small.c) applies the epilogue itself, panel by panel.
 */
#include <cblas.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>

#include "backend/cpu/cpu.h"

/* ---- matrix products ----------------------------------------------------------- */

static void pack_f32(float *dst, const void *src, kl_dtype dt, int64_t off, int64_t rows,
                     int64_t cols, int64_t rs, int64_t cs)
{
	if (cols == 0)
		return; /* an empty operand: its strides may be anything (kl__mm_extent) */
	for (int64_t i = 0; i < rows; i++) {
		float *d = dst + i * cols;
		int64_t base = off + i * rs;
		switch (dt) {
		case KL_F32:
			for (int64_t j = 0; j < cols; j++)
				d[j] = ((const float *)src)[base + j * cs];
			break;
		case KL_F16:
			for (int64_t j = 0; j < cols; j++)
				d[j] = kl__f16_to_f32(((const uint16_t *)src)[base + j * cs]);
			break;
		case KL_BF16:
			for (int64_t j = 0; j < cols; j++)
				d[j] = kl__bf16_to_f32(((const uint16_t *)src)[base + j * cs]);
			break;
		default:
			for (int64_t j = 0; j < cols; j++)
				d[j] = (float)kl__load(src, dt, base + j * cs);
			break;
		}
	}
}

static void unpack_f32(void *dst, kl_dtype dt, int64_t off, int64_t rows, int64_t cols, int64_t ld,
                       const float *src)
{
	for (int64_t i = 0; i < rows; i++) {
		const float *s = src + i * cols;
		int64_t base = off + i * ld;
		switch (dt) {
		case KL_F32:
			memcpy((float *)dst + base, s, (size_t)cols * sizeof(float));
			break;
		case KL_F16:
			for (int64_t j = 0; j < cols; j++)
				((uint16_t *)dst)[base + j] = kl__f32_to_f16(s[j]);
			break;
		case KL_BF16:
			for (int64_t j = 0; j < cols; j++)
				((uint16_t *)dst)[base + j] = kl__f32_to_bf16(s[j]);
			break;
		default:
			for (int64_t j = 0; j < cols; j++)
				kl__store(dst, dt, base + j, s[j]);
			break;
		}
	}
}

static void pack_f64(double *dst, const void *src, kl_dtype dt, int64_t off, int64_t rows,
                     int64_t cols, int64_t rs, int64_t cs)
{
	for (int64_t i = 0; i < rows; i++)
		for (int64_t j = 0; j < cols; j++)
			dst[i * cols + j] = kl__load(src, dt, off + i * rs + j * cs);
}

/* How BLAS can read a rows x cols operand with strides (rs, cs) in place. */
static bool blas_view(int64_t rows, int64_t cols, int64_t rs, int64_t cs, CBLAS_TRANSPOSE *t,
                      int64_t *ld)
{
	if (rows > INT_MAX || cols > INT_MAX || rs > INT_MAX || cs > INT_MAX)
		return false;
	int64_t c1 = cols > 1 ? cols : 1, r1 = rows > 1 ? rows : 1;
	if ((cs == 1 || cols <= 1) && (rows <= 1 || rs >= c1)) {
		*t = CblasNoTrans;
		*ld = rows <= 1 ? c1 : rs;
		return true;
	}
	if ((rs == 1 || rows <= 1) && (cols <= 1 || cs >= r1)) {
		*t = CblasTrans;
		*ld = cols <= 1 ? r1 : cs;
		return true;
	}
	return false;
}

static int64_t int_load(const void *p, kl_dtype dt, int64_t i)
{
	switch (dt) {
	case KL_I32:
		return ((const int32_t *)p)[i];
	case KL_I64:
		return ((const int64_t *)p)[i];
	case KL_BOOL:
		return ((const uint8_t *)p)[i] != 0;
	default:
		return (int64_t)kl__load(p, dt, i);
	}
}

static void int_store(void *p, kl_dtype dt, int64_t i, int64_t v)
{
	switch (dt) {
	case KL_I32:
		((int32_t *)p)[i] = (int32_t)(uint32_t)(uint64_t)v;
		break;
	case KL_I64:
		((int64_t *)p)[i] = v;
		break;
	case KL_BOOL:
		((uint8_t *)p)[i] = v != 0;
		break;
	default:
		kl__store(p, dt, i, (double)v);
		break;
	}
}

static bool is_int(kl_dtype dt)
{
	return dt == KL_I32 || dt == KL_I64 || dt == KL_BOOL;
}

static bool is_f32ish(kl_dtype dt)
{
	return dt == KL_F32 || dt == KL_F16 || dt == KL_BF16;
}

/* the caller's scratch buffer, grown to at least bytes; and the step's
 * weight packed ahead (pk NULL: none kept), valid for key (the step's B as
 * the plan binds it, also while an f16 product runs on its f32 copies) */
typedef struct mm_scratch {
	void **p;
	size_t *cap;
	kl_mm_pack *pk;
	kl_mm_key key;
	size_t *pack_bytes;
} mm_scratch;

static bool key_eq(const kl_mm_key *a, const kl_mm_key *b)
{
	return a->id == b->id && a->version == b->version && a->off == b->off && a->n == b->n &&
	       a->k == b->k && a->rs == b->rs && a->cs == b->cs && a->dtype == b->dtype;
}

/* Whether the step's packed weight holds B this call */
static bool pack_valid(const mm_scratch *c)
{
	return c->pk && c->pk->p && c->pk->key.id && key_eq(&c->pk->key, &c->key);
}

/* Whether a product of m x k by k x n takes the packed weight */
static bool pack_fits(const mm_scratch *c, int64_t m, int64_t n, int64_t k)
{
	return c->pk && m <= INT_MAX && n <= INT_MAX && k <= INT_MAX &&
	       kl__gemm_mid_packed_fits((int)m, (int)n, (int)k);
}

/* The packed weight for g (B as g->W holds it now), packed here when the
 * kept one is stale and this B was seen unchanged at the last call; NULL at
 * a first sight and where none can be kept (past KL_MM_PACK_MAX, out of
 * memory, neither AVX2 nor AVX-512): the product then runs as it would
 * unpacked. */
static const float *pack_get(const mm_scratch *c, const kl_gemm_small *g, bool w_kn)
{
	kl_mm_pack *pk = c->pk;
	if (pack_valid(c))
		return pk->p;
	if (!key_eq(&pk->seen, &c->key)) {
		pk->seen = c->key;
		return NULL;
	}
	size_t need = kl__gemm_mid_packed_floats(g->n, g->k);
	if (need > pk->floats) {
		size_t bytes = (need * sizeof(float) + 63) / 64 * 64;
		if (*c->pack_bytes - pk->floats * sizeof(float) + bytes > KL_MM_PACK_MAX)
			return NULL;
		float *p = aligned_alloc(64, bytes);
		if (!p)
			return NULL;
		*c->pack_bytes -= pk->floats * sizeof(float);
		free(pk->p);
		pk->p = p;
		pk->floats = bytes / sizeof(float);
		*c->pack_bytes += bytes;
	}
	pk->key.id = 0; /* stale until packed */
	if (!kl__gemm_mid_pack(g, w_kn, pk->p))
		return NULL;
	pk->key = c->key;
	return pk->p;
}

void kl__mm_pack_free(kl_mm_pack *pk)
{
	if (pk) {
		free(pk->p);
		memset(pk, 0, sizeof *pk);
	}
}

static void *scratch(const mm_scratch *c, size_t bytes)
{
	if (bytes > *c->cap) {
		void *p = realloc(*c->p, bytes);
		if (!p)
			return NULL;
		*c->p = p;
		*c->cap = bytes;
	}
	return *c->p;
}

typedef struct epi_args {
	const kl_matmul_step *mm;
	kl_dtype dt; /* C's, R's and the bias's */
	kl_op act;   /* KL_OP_INPUT: none */
	void *c;
	const void *r, *bias;
	int64_t co, ro;
} epi_args;

typedef struct mm_args {
	const kl_matmul_step *mm;
	kl_dtype ta, tb, tc;
	const void *a, *b;
	void *c;
	int64_t ao, bo, co;
} mm_args;

static kl_status gemm_one(const mm_scratch *c, const mm_args *x, const epi_args *e, bool *fused);
static void epilogue_rows(const epi_args *e, int nt);

/* ---- f16/bf16 products: f32 copies through the f32 path ------------------------- */

/* A rows x cols block of a 16-bit operand (row stride ld, columns
 * contiguous) widened into dense f32, or f32 narrowed back: one row a
 * call of convert.c's simd loops, the rows over the pool's threads. */
typedef struct half_copy {
	kl_dtype dt;
	bool narrow;
	int64_t cols, ld;
	void *half;  /* at element 0 of the block */
	float *f;    /* dense, cols per row */
} half_copy;

static void half_copy_rows(void *arg, int64_t lo, int64_t hi)
{
	const half_copy *h = arg;
	for (int64_t i = lo; i < hi; i++) {
		uint16_t *p = (uint16_t *)h->half + i * h->ld;
		if (h->narrow)
			kl__cpu_store_f32(p, h->dt, 1, h->f + i * h->cols, h->cols);
		else
			kl__cpu_load_f32(h->f + i * h->cols, p, h->dt, 1, h->cols);
	}
}

static void half_copy_run(kl_dtype dt, bool narrow, void *half, int64_t off, int64_t rows,
                          int64_t cols, int64_t ld, float *f)
{
	half_copy h = {dt, narrow, cols, ld, (uint16_t *)half + off, f};
	bool par = (double)rows * (double)cols >= KL_CPU_PAR_MIN;
	kl__par_for(par ? kl__par_threads() : 1, rows, half_copy_rows, &h);
}

/* The rows x cols block an operand of a product is stored as (rows of
 * contiguous columns), from its logical shape and strides as BLAS views it. */
static void stored_block(CBLAS_TRANSPOSE t, int64_t r, int64_t c, int64_t *sr, int64_t *sc)
{
	*sr = t == CblasNoTrans ? r : c;
	*sc = t == CblasNoTrans ? c : r;
}

/* An f16/bf16 product whose operands BLAS could read in place were they
 * f32: A and B widened into f32 copies of the same layout (a Linear's
 * weight stays [n, k], read transposed), the product, its epilogue and the
 * residual through the f32 path (kiln's small product, which applies the
 * epilogue panel by panel, or OpenBLAS then the f32 epilogue) into an f32
 * C, rounded once into C. The copies are split over the pool's threads and
 * vectorized (half.h's branch-free conversions), where the per-element
 * fallback below had packed B transposed, on one thread. Returns false
 * (nothing done) where the path does not apply. */
static bool gemm_half(const mm_scratch *c, const mm_args *x, const epi_args *e, kl_status *st)
{
	const kl_matmul_step *mm = x->mm;
	int64_t m = mm->m, n = mm->n, k = mm->k;
	kl_dtype dt = x->tc;
	CBLAS_TRANSPOSE tra, trb;
	int64_t lda, ldb;
	if ((dt != KL_F16 && dt != KL_BF16) || x->ta != dt || x->tb != dt || e->dt != dt ||
	    m > INT_MAX || n > INT_MAX || k > INT_MAX || k == 0 ||
	    !blas_view(m, k, mm->a_rs, mm->a_cs, &tra, &lda) ||
	    !blas_view(k, n, mm->b_rs, mm->b_cs, &trb, &ldb))
		return false;
	int64_t ar, ac, br, bc;
	stored_block(tra, m, k, &ar, &ac);
	stored_block(trb, k, n, &br, &bc);
	bool has_r = e->mm->has_r, has_bias = e->mm->has_bias;
	size_t na = (size_t)(ar * ac), nb = (size_t)(br * bc), nc = (size_t)(m * n);
	size_t nr = has_r ? nc : 0, nbias = has_bias ? (size_t)n : 0;
	float *sa = scratch(c, (na + nb + nc + nr + nbias) * sizeof(float));
	if (!sa) {
		*st = KL_ENOMEM;
		return true;
	}
	float *sb = sa + na, *sc = sb + nb, *sr = sc + nc, *sbias = sr + nr;
	half_copy_run(dt, false, (void *)x->a, x->ao, ar, ac, ar > 1 ? lda : ac, sa);
	/* a weight the plan keeps packed is not widened again: the f32 path
	 * below takes the packing (pack_fits on the same shape) */
	if (!(tra == CblasNoTrans && pack_valid(c) && pack_fits(c, m, n, k)))
		half_copy_run(dt, false, (void *)x->b, x->bo, br, bc, br > 1 ? ldb : bc, sb);
	if (mm->beta != 0)
		half_copy_run(dt, false, x->c, x->co, m, n, mm->ldc, sc);
	if (has_r)
		half_copy_run(dt, false, (void *)e->r, e->ro, m, n, e->mm->r_ld, sr);
	if (has_bias)
		half_copy_run(dt, false, (void *)e->bias, e->mm->bias_off, 1, n, n, sbias);
	/* the same step over the f32 copies: dense, at offset 0 */
	kl_matmul_step fm = *mm, fe = *e->mm;
	fm.a_off = fm.b_off = fm.c_off = 0;
	fm.a_rs = tra == CblasNoTrans ? ac : 1;
	fm.a_cs = tra == CblasNoTrans ? 1 : ac;
	fm.b_rs = trb == CblasNoTrans ? bc : 1;
	fm.b_cs = trb == CblasNoTrans ? 1 : bc;
	fm.ldc = n;
	fe = fm;
	fe.has_r = has_r;
	fe.has_bias = has_bias;
	fe.beta = e->mm->beta;
	fe.r_ld = n;
	fe.r_off = 0;
	fe.bias_off = 0;
	fe.act = e->mm->act;
	mm_args fx = {.mm = &fm, .ta = KL_F32, .tb = KL_F32, .tc = KL_F32, .a = sa, .b = sb, .c = sc};
	epi_args fepi = {.mm = &fe, .dt = KL_F32, .act = e->act, .c = sc, .r = sr,
	                 .bias = sbias};
	bool fused = false;
	*st = gemm_one(c, &fx, &fepi, &fused);
	if (*st != KL_OK)
		return true;
	if (!fused && (has_r || has_bias || e->act != KL_OP_INPUT))
		epilogue_rows(&fepi, kl__par_threads());
	half_copy_run(dt, true, x->c, x->co, m, n, mm->ldc, sc);
	return true;
}

/* One product C = alpha A B + beta C at element offsets ao, bo, co. *fused
 * is set when the product applied e's epilogue itself. */
static kl_status gemm_one(const mm_scratch *c, const mm_args *x, const epi_args *e, bool *fused)
{
	const kl_matmul_step *mm = x->mm;
	int64_t m = mm->m, n = mm->n, k = mm->k;
	CBLAS_TRANSPOSE tra, trb;
	int64_t lda, ldb;
	bool same = x->ta == x->tb && x->tb == x->tc;
	bool small = m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && mm->ldc <= INT_MAX;
	if (same && small && (x->tc == KL_F32 || x->tc == KL_F64) &&
	    blas_view(m, k, mm->a_rs, mm->a_cs, &tra, &lda) &&
	    blas_view(k, n, mm->b_rs, mm->b_cs, &trb, &ldb)) {
		int ldc = (int)(mm->ldc > 1 ? mm->ldc : 1);
		if (m == 1 && n > 1 && mm->a_cs >= 1 && mm->a_cs <= INT_MAX) {
			/* one row (a decode step): a matrix-vector product reads the
			 * weight once, where a GEMM packs all of it first */
			CBLAS_TRANSPOSE tv = trb == CblasTrans ? CblasNoTrans : CblasTrans;
			int vr = (int)(trb == CblasTrans ? n : k),
			    vc = (int)(trb == CblasTrans ? k : n);
			size_t es = kl_dtype_size(x->tc);
			kl__blas_gemv(kl__par_threads(), x->tc == KL_F64, tv, vr, vc, mm->alpha,
			              (const char *)x->b + (size_t)x->bo * es, (int)ldb,
			              (const char *)x->a + (size_t)x->ao * es, (int)mm->a_cs,
			              mm->beta, (char *)x->c + (size_t)x->co * es);
			return KL_OK;
		}
		size_t es = kl_dtype_size(x->tc);
		bool own = x->tc == KL_F32 && tra == CblasNoTrans && e->mm->r_ld <= INT_MAX;
		bool packed = own && pack_fits(c, m, n, k);
		bool few_rows = trb == CblasTrans && kl__gemm_small_fits((int)m, (int)n, (int)k);
		bool mid = kl__gemm_mid_fits((int)m, (int)n, (int)k);
		if (own && (packed || few_rows || mid)) {
			/* kiln's own products, the epilogue on each block of C while
			 * it is in L1 (mlp24: GELU's second pass over C had cost a
			 * fifth of the step): a weight the plan keeps packed
			 * (gemm_mid, B packed at the first call), few rows times a
			 * row-major weight (gemm_small), or more rows on AVX2 or AVX-512
			 * (gemm_mid, B packed in panels each call); where none can
			 * run, OpenBLAS below */
			kl_gemm_small g = {
			        .m = (int)m,
			        .n = (int)n,
			        .k = (int)k,
			        .lda = (int)lda,
			        .ldw = (int)ldb,
			        .ldc = ldc,
			        .alpha = (float)mm->alpha,
			        .beta = (float)mm->beta,
			        .A = (const float *)x->a + x->ao,
			        .W = (const float *)x->b + x->bo,
			        .C = (float *)x->c + x->co,
			        .R = e->mm->has_r ? (const float *)e->r + e->ro : NULL,
			        .ldr = (int)e->mm->r_ld,
			        .rbeta = (float)e->mm->beta,
			        .bias = e->mm->has_bias ? (const float *)e->bias + e->mm->bias_off
			                                : NULL,
			        .act = e->act};
			const float *pre = packed ? pack_get(c, &g, trb == CblasNoTrans) : NULL;
			if (pre)
				few_rows = false;
			if (few_rows)
				kl__gemm_small_par(kl__par_threads(), &g);
			if (few_rows || ((pre || mid) && kl__gemm_mid_par(kl__par_threads(), &g,
			                                                   trb == CblasNoTrans, pre))) {
				*fused = true;
				return KL_OK;
			}
		}
		kl__blas_gemm(kl__par_threads(), x->tc == KL_F64, tra, trb, (int)m, (int)n, (int)k,
		              mm->alpha, (const char *)x->a + (size_t)x->ao * es, (int)lda,
		              (const char *)x->b + (size_t)x->bo * es, (int)ldb, mm->beta,
		              (char *)x->c + (size_t)x->co * es, ldc);
		return KL_OK;
	}
	kl_status hst = KL_OK;
	if (gemm_half(c, x, e, &hst)) {
		*fused = true; /* its epilogue too, in f32 before the one rounding */
		return hst;
	}
	if (small && is_f32ish(x->ta) && is_f32ish(x->tb) && is_f32ish(x->tc)) {
		/* unusual strides or mixed f32/f16/bf16: products in f32, rounded once */
		size_t na = (size_t)(m * k), nb = (size_t)(k * n), nc = (size_t)(m * n);
		float *sa = scratch(c, (na + nb + nc) * sizeof(float));
		if (!sa)
			return KL_ENOMEM;
		float *sb = sa + na, *sc = sb + nb;
		pack_f32(sa, x->a, x->ta, x->ao, m, k, mm->a_rs, mm->a_cs);
		pack_f32(sb, x->b, x->tb, x->bo, k, n, mm->b_rs, mm->b_cs);
		if (mm->beta != 0)
			pack_f32(sc, x->c, x->tc, x->co, m, n, mm->ldc, 1);
		kl__blas_gemm(kl__par_threads(), false, CblasNoTrans, CblasNoTrans, (int)m, (int)n,
		              (int)k, mm->alpha, sa, (int)(k > 1 ? k : 1), sb, (int)(n > 1 ? n : 1),
		              mm->beta, sc, (int)(n > 1 ? n : 1));
		unpack_f32(x->c, x->tc, x->co, m, n, mm->ldc, sc);
		return KL_OK;
	}
	if (small && same && x->tc == KL_F64) {
		size_t na = (size_t)(m * k), nb = (size_t)(k * n);
		double *sa = scratch(c, (na + nb) * sizeof(double));
		if (!sa)
			return KL_ENOMEM;
		double *sb = sa + na;
		pack_f64(sa, x->a, x->ta, x->ao, m, k, mm->a_rs, mm->a_cs);
		pack_f64(sb, x->b, x->tb, x->bo, k, n, mm->b_rs, mm->b_cs);
		kl__blas_gemm(kl__par_threads(), true, CblasNoTrans, CblasNoTrans, (int)m, (int)n,
		              (int)k, mm->alpha, sa, (int)(k > 1 ? k : 1), sb, (int)(n > 1 ? n : 1),
		              mm->beta, (double *)x->c + x->co, (int)(mm->ldc > 1 ? mm->ldc : 1));
		return KL_OK;
	}
	if (is_int(x->ta) && is_int(x->tb) && is_int(x->tc)) {
		/* integers wrap like torch's: accumulate modulo 2^64 */
		bool plain = mm->alpha == 1 && mm->beta == 0;
		for (int64_t i = 0; i < m; i++)
			for (int64_t j = 0; j < n; j++) {
				uint64_t acc = 0;
				for (int64_t p = 0; p < k; p++)
					acc += (uint64_t)int_load(x->a, x->ta,
					                          x->ao + i * mm->a_rs +
					                                  p * mm->a_cs) *
					       (uint64_t)int_load(x->b, x->tb,
					                          x->bo + p * mm->b_rs +
					                                  j * mm->b_cs);
				int64_t ci = x->co + i * mm->ldc + j;
				int64_t v = (int64_t)acc;
				if (!plain)
					v = (int64_t)(mm->alpha * (double)v +
					              (mm->beta != 0
					                       ? mm->beta * (double)int_load(
					                                            x->c, x->tc, ci)
					                       : 0.0));
				int_store(x->c, x->tc, ci, v);
			}
		return KL_OK;
	}
	/* mixed dtypes BLAS has no routine for: exact enough in double */
	for (int64_t i = 0; i < m; i++)
		for (int64_t j = 0; j < n; j++) {
			double acc = 0;
			for (int64_t p = 0; p < k; p++)
				acc += kl__load(x->a, x->ta, x->ao + i * mm->a_rs + p * mm->a_cs) *
				       kl__load(x->b, x->tb, x->bo + p * mm->b_rs + j * mm->b_cs);
			int64_t ci = x->co + i * mm->ldc + j;
			double v = mm->alpha * acc;
			if (mm->beta != 0)
				v += mm->beta * kl__load(x->c, x->tc, ci);
			kl__store(x->c, x->tc, ci, v);
		}
	return KL_OK;
}

/* ---- epilogues: C = act(C + beta * R + bias), one row at a time ------------------ */

#define EPI_CHUNK 256

/* One row of C through the epilogue, in C's own type T: beta*R, the bias,
 * then the activation through the eager kernels (from a copy: they do not
 * work in place). */
#define EPI_ROW(NAME, T, UNARY)                                                          \
	static void NAME(const epi_args *e, int64_t i)                                   \
	{                                                                                \
		const kl_matmul_step *mm = e->mm;                                        \
		T *c = (T *)e->c + e->co + i * mm->ldc;                                  \
		int64_t n = mm->n;                                                       \
		if (mm->has_r) {                                                         \
			const T *r = (const T *)e->r + e->ro + i * mm->r_ld;             \
			T beta = (T)mm->beta;                                            \
			KL_SIMD                                                          \
			for (int64_t j = 0; j < n; j++)                                  \
				c[j] += beta * r[j];                                     \
		}                                                                        \
		if (mm->has_bias) {                                                      \
			const T *b = (const T *)e->bias + mm->bias_off;                  \
			KL_SIMD                                                          \
			for (int64_t j = 0; j < n; j++)                                  \
				c[j] += b[j];                                            \
		}                                                                        \
		if (e->act == KL_OP_INPUT)                                               \
			return;                                                          \
		T t[EPI_CHUNK];                                                          \
		for (int64_t j = 0; j < n; j += EPI_CHUNK) {                             \
			int64_t len = n - j < EPI_CHUNK ? n - j : EPI_CHUNK;             \
			memcpy(t, c + j, (size_t)len * sizeof(T));                       \
			UNARY(e->act, t, c + j, len);                                    \
		}                                                                        \
	}

EPI_ROW(epi_row_f32, float, kl__cpu_unary_f32)
EPI_ROW(epi_row_f64, double, kl__cpu_unary_f64)

/* any other dtype: in double, rounded once into C (the scheduler folds
 * epilogues into f32/f64 products only on the CPU; this keeps a program
 * from elsewhere correct) */
static void epi_row_any(const epi_args *e, int64_t i)
{
	const kl_matmul_step *mm = e->mm;
	double t[EPI_CHUNK], u[EPI_CHUNK];
	for (int64_t j0 = 0; j0 < mm->n; j0 += EPI_CHUNK) {
		int64_t len = mm->n - j0 < EPI_CHUNK ? mm->n - j0 : EPI_CHUNK;
		int64_t ci = e->co + i * mm->ldc + j0;
		for (int64_t j = 0; j < len; j++) {
			double v = kl__load(e->c, e->dt, ci + j);
			if (mm->has_r)
				v += mm->beta *
				     kl__load(e->r, e->dt, e->ro + i * mm->r_ld + j0 + j);
			if (mm->has_bias)
				v += kl__load(e->bias, e->dt, mm->bias_off + j0 + j);
			t[j] = v;
		}
		if (e->act != KL_OP_INPUT)
			kl__cpu_unary_f64(e->act, t, u, len);
		for (int64_t j = 0; j < len; j++)
			kl__store(e->c, e->dt, ci + j, e->act != KL_OP_INPUT ? u[j] : t[j]);
	}
}

static void epilogue_chunk(void *arg, int64_t lo, int64_t hi)
{
	const epi_args *e = arg;
	for (int64_t i = lo; i < hi; i++) {
		if (e->dt == KL_F32)
			epi_row_f32(e, i);
		else if (e->dt == KL_F64)
			epi_row_f64(e, i);
		else
			epi_row_any(e, i);
	}
}

static void epilogue_rows(const epi_args *e, int nt)
{
	int64_t m = e->mm->m;
	bool par = (double)m * (double)e->mm->n >= KL_CPU_PAR_MIN;
	kl__par_for(par ? nt : 1, m, epilogue_chunk, (void *)e);
}

kl_status kl__cpu_matmul_step(kl_ctx *ctx, const kl_matmul_step *step, const kl_buf *bufs,
                              void *const *B, void **scratch_p, size_t *scratch_cap,
                              kl_mm_pack *pk, kl_mm_weight w, size_t *pack_bytes)
{
	/* a weight is kept packed only where every product of the step reads
	 * the same B (no batch stride of its own) */
	bool keep = pk && w.id && pack_bytes;
	for (int i = 0; keep && i < step->nbatch; i++)
		keep = step->b_bstride[i] == 0 || step->batch[i] == 1;
	mm_scratch sc = {.p = scratch_p,
	                 .cap = scratch_cap,
	                 .pk = keep ? pk : NULL,
	                 .key = {.id = w.id,
	                         .version = w.version,
	                         .off = step->b_off,
	                         .n = step->n,
	                         .k = step->k,
	                         .rs = step->b_rs,
	                         .cs = step->b_cs,
	                         .dtype = bufs[step->b].dtype},
	                 .pack_bytes = pack_bytes},
	           *c = &sc;
	/* BLAS computes alpha A B (+ beta C in place); a residual is added after */
	kl_matmul_step plain = *step;
	if (step->has_r)
		plain.beta = 0;
	const kl_matmul_step *mm = &plain;
	epi_args e = {.mm = step,
	              .dt = bufs[step->c].dtype,
	              .act = kl__mm_act_op[step->act],
	              .c = B[step->c],
	              .r = step->has_r ? B[step->r] : NULL,
	              .bias = step->has_bias ? B[step->bias] : NULL};
	bool epi = step->has_r || step->has_bias || e.act != KL_OP_INPUT;
	mm_args x = {.mm = mm,
	             .ta = bufs[mm->a].dtype,
	             .tb = bufs[mm->b].dtype,
	             .tc = bufs[mm->c].dtype,
	             .a = B[mm->a],
	             .b = B[mm->b],
	             .c = B[mm->c]};
	if (mm->m == 0 || mm->n == 0)
		return KL_OK;
	int64_t idx[KL_MAX_DIMS] = {0};
	for (;;) {
		x.ao = mm->a_off;
		x.bo = mm->b_off;
		x.co = mm->c_off;
		e.ro = mm->r_off;
		for (int i = 0; i < mm->nbatch; i++) {
			if (mm->batch[i] == 0)
				return KL_OK;
			x.ao += idx[i] * mm->a_bstride[i];
			x.bo += idx[i] * mm->b_bstride[i];
			x.co += idx[i] * mm->c_bstride[i];
			e.ro += idx[i] * mm->r_bstride[i];
		}
		bool fused = false;
		e.co = x.co;
		if (gemm_one(c, &x, &e, &fused) != KL_OK)
			return kl__err(ctx, KL_ENOMEM,
			               "kl_fn_call: out of memory converting a %" PRId64 "x%" PRId64
			               "x%" PRId64 " matmul",
			               mm->m, mm->n, mm->k);
		if (epi && !fused)
			epilogue_rows(&e, kl__par_threads());
		int i = mm->nbatch - 1;
		for (; i >= 0; i--) {
			if (++idx[i] < mm->batch[i])
				break;
			idx[i] = 0;
		}
		if (i < 0)
			return KL_OK;
	}
}
