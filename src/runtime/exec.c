/* exec.c - the executor: bind a compiled variant's buffers (inputs, fresh
 * outputs or views, arena slots), evaluate its symbols from the input
 * shapes, then run its steps in order: generated kernels through their
 * function pointers, matrix products through BLAS followed by one pass over
 * the product for its epilogue (residual, bias, activation). Also its
 * explain printer.
 */
#include <cblas.h>
#include <inttypes.h>
#include <limits.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cpu/cpu.h" /* attention steps; the eager unary kernels, for product epilogues */
#include "runtime/rt.h"

/* ---- matrix products ----------------------------------------------------------- */

static void pack_f32(float *dst, const void *src, kl_dtype dt, int64_t off, int64_t rows,
                     int64_t cols, int64_t rs, int64_t cs)
{
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

static void *scratch(kl_compiled *c, size_t bytes)
{
	if (bytes > c->scratch_cap) {
		void *p = realloc(c->scratch, bytes);
		if (!p)
			return NULL;
		c->scratch = p;
		c->scratch_cap = bytes;
	}
	return c->scratch;
}

typedef struct mm_args {
	const kl_matmul_step *mm;
	kl_dtype ta, tb, tc;
	const void *a, *b;
	void *c;
	int64_t ao, bo, co;
} mm_args;

/* One product C = alpha A B + beta C at element offsets ao, bo, co. */
static kl_status gemm_one(kl_compiled *c, const mm_args *x)
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
			int vr = (int)(trb == CblasTrans ? n : k), vc = (int)(trb == CblasTrans ? k : n);
			size_t es = kl_dtype_size(x->tc);
			kl__blas_gemv(omp_get_max_threads(), x->tc == KL_F64, tv, vr, vc, mm->alpha,
			              (const char *)x->b + (size_t)x->bo * es, (int)ldb,
			              (const char *)x->a + (size_t)x->ao * es, (int)mm->a_cs, mm->beta,
			              (char *)x->c + (size_t)x->co * es);
			return KL_OK;
		}
		size_t es = kl_dtype_size(x->tc);
		kl__blas_gemm(omp_get_max_threads(), x->tc == KL_F64, tra, trb, (int)m, (int)n, (int)k,
		              mm->alpha, (const char *)x->a + (size_t)x->ao * es, (int)lda,
		              (const char *)x->b + (size_t)x->bo * es, (int)ldb, mm->beta,
		              (char *)x->c + (size_t)x->co * es, ldc);
		return KL_OK;
	}
	if (small && is_f32ish(x->ta) && is_f32ish(x->tb) && is_f32ish(x->tc)) {
		/* f16/bf16 (or unusual strides): products in f32, rounded once */
		size_t na = (size_t)(m * k), nb = (size_t)(k * n), nc = (size_t)(m * n);
		float *sa = scratch(c, (na + nb + nc) * sizeof(float));
		if (!sa)
			return KL_ENOMEM;
		float *sb = sa + na, *sc = sb + nb;
		pack_f32(sa, x->a, x->ta, x->ao, m, k, mm->a_rs, mm->a_cs);
		pack_f32(sb, x->b, x->tb, x->bo, k, n, mm->b_rs, mm->b_cs);
		if (mm->beta != 0)
			pack_f32(sc, x->c, x->tc, x->co, m, n, mm->ldc, 1);
		kl__blas_gemm(omp_get_max_threads(), false, CblasNoTrans, CblasNoTrans, (int)m, (int)n,
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
		kl__blas_gemm(omp_get_max_threads(), true, CblasNoTrans, CblasNoTrans, (int)m, (int)n,
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

typedef struct epi_args {
	const kl_matmul_step *mm;
	kl_dtype dt; /* C's, R's and the bias's */
	kl_op act;   /* KL_OP_INPUT: none */
	void *c;
	const void *r, *bias;
	int64_t co, ro;
} epi_args;

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
				v += mm->beta * kl__load(e->r, e->dt, e->ro + i * mm->r_ld + j0 + j);
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

static void epilogue_rows(const epi_args *e)
{
	int64_t m = e->mm->m;
	bool par = (double)m * (double)e->mm->n >= KL_CPU_PAR_MIN;
#pragma omp parallel for schedule(static) if (par)
	for (int64_t i = 0; i < m; i++) {
		if (e->dt == KL_F32)
			epi_row_f32(e, i);
		else if (e->dt == KL_F64)
			epi_row_f64(e, i);
		else
			epi_row_any(e, i);
	}
}

static kl_op act_op(kl_mm_act a)
{
	switch (a) {
	case KL_MM_ACT_RELU:
		return KL_OP_RELU;
	case KL_MM_ACT_GELU:
		return KL_OP_GELU;
	case KL_MM_ACT_GELU_TANH:
		return KL_OP_GELU_TANH;
	default:
		return KL_OP_INPUT;
	}
}

static kl_status run_matmul(kl_ctx *ctx, kl_compiled *c, const kl_step *sp, void *const *B)
{
	const kl_matmul_step *step = &sp->mm;
	const kl_buf *bufs = c->prog.bufs;
	/* BLAS computes alpha A B (+ beta C in place); a residual is added after */
	kl_matmul_step plain = *step;
	if (step->has_r)
		plain.beta = 0;
	const kl_matmul_step *mm = &plain;
	epi_args e = {.mm = step,
	              .dt = bufs[step->c].dtype,
	              .act = act_op(step->act),
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
		if (gemm_one(c, &x) != KL_OK)
			return kl__err(ctx, KL_ENOMEM,
			               "kl_fn_call: out of memory converting a %" PRId64 "x%" PRId64
			               "x%" PRId64 " matmul",
			               mm->m, mm->n, mm->k);
		if (epi) {
			e.co = x.co;
			epilogue_rows(&e);
		}
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

/* ---- binding and running ------------------------------------------------------- */

static kl_status check_input(kl_ctx *ctx, const kl_compiled *c, const kl_buf *bf,
                             const kl_tensor *t, const int64_t *syms)
{
	int i = bf->index;
	char have[128], want[128];
	int64_t shape[KL_MAX_DIMS];
	for (int d = 0; d < bf->ndim; d++)
		shape[d] = kl__dim_value(&bf->shape[d], syms);
	if (t->dtype != bf->dtype || t->ndim != bf->ndim ||
	    memcmp(t->shape, shape, sizeof(int64_t) * (size_t)bf->ndim) != 0)
		return kl__err(ctx, KL_EINVAL,
		               "kl_fn_call: input %d is %s %s; the compiled graph "
		               "takes %s %s",
		               i, kl_dtype_name(t->dtype),
		               kl__shape_str(have, sizeof have, t->ndim, t->shape),
		               kl_dtype_name(bf->dtype),
		               kl__shape_str(want, sizeof want, bf->ndim, shape));
	bool ok = true;
	if (c->in_dynamic[i])
		ok = kl__strides_contiguous(t->ndim, t->shape, t->strides);
	else
		for (int d = 0; d < t->ndim; d++)
			if (t->shape[d] != 1 && t->strides[d] != c->in_strides[i][d])
				ok = false;
	if (!ok)
		return kl__err(ctx, KL_EINVAL,
		               "kl_fn_call: input %d has strides %s; the compiled "
		               "graph was traced with %s",
		               i, kl__shape_str(have, sizeof have, t->ndim, t->strides),
		               c->in_dynamic[i] ? "dense ones"
		                                : kl__shape_str(want, sizeof want, t->ndim,
		                                                c->in_strides[i]));
	return KL_OK;
}

/* The strides of an output view whose dims are symbols: a view that was
 * dense at trace time is dense at every size; other layouts are refused. */
static bool view_strides(const kl_buf *bf, const int64_t *shape, int64_t *strides)
{
	int64_t traced[KL_MAX_DIMS], tshape[KL_MAX_DIMS];
	bool sym = false;
	for (int d = 0; d < bf->ndim; d++) {
		tshape[d] = bf->shape[d].v;
		sym |= bf->shape[d].sym > 0;
	}
	if (!sym) {
		memcpy(strides, bf->view_strides, sizeof(int64_t) * (size_t)bf->ndim);
		return true;
	}
	kl__contig_strides(bf->ndim, tshape, traced);
	for (int d = 0; d < bf->ndim; d++)
		if (tshape[d] != 1 && traced[d] != bf->view_strides[d])
			return false;
	kl__contig_strides(bf->ndim, shape, strides);
	return true;
}

static kl_status bind_outputs(kl_ctx *ctx, kl_compiled *c, kl_tensor *const *inputs,
                              kl_tensor **outputs, const int64_t *syms, void **B)
{
	const kl_program *p = &c->prog;
	for (int pass = 0; pass < 2; pass++)
		for (int32_t b = 0; b < p->nbufs; b++) {
			const kl_buf *bf = &p->bufs[b];
			if (bf->role != KL_BUF_OUTPUT || (pass == 0) != (bf->alias < 0))
				continue;
			int64_t shape[KL_MAX_DIMS], strides[KL_MAX_DIMS];
			for (int d = 0; d < bf->ndim; d++)
				shape[d] = kl__dim_value(&bf->shape[d], syms);
			kl_tensor *t;
			if (bf->alias < 0) {
				t = kl__tensor_alloc(ctx, bf->dtype, bf->ndim, shape);
			} else {
				const kl_buf *base = &p->bufs[bf->alias];
				kl_tensor *bt = base->role == KL_BUF_INPUT ? inputs[base->index]
				                                           : outputs[base->index];
				if (!view_strides(bf, shape, strides))
					return kl__err(ctx, KL_EUNSUPPORTED,
					               "kl_fn_call: output %d is a "
					               "non-dense view with dynamic dims",
					               (int)bf->index);
				t = kl__tensor_view(bt, bf->ndim, shape, strides,
				                    bt->offset + bf->view_offset);
			}
			if (!t)
				return kl_last_status(ctx);
			outputs[bf->index] = t;
			B[b] = kl__tensor_data(t);
		}
	return KL_OK;
}

static kl_status ensure_plan(kl_ctx *ctx, kl_compiled *c, const int64_t *syms)
{
	if (c->dynamic &&
	    memcmp(syms, c->plan_syms, sizeof(int64_t) * (size_t)c->prog.nsyms) != 0) {
		kl_memplan mp;
		if (kl__memplan_build(&c->prog, syms, &mp) != KL_OK)
			return kl__err(ctx, KL_ENOMEM,
			               "kl_fn_call: out of memory planning buffers");
		kl__memplan_free(&c->plan);
		c->plan = mp;
		memcpy(c->plan_syms, syms, sizeof(int64_t) * (size_t)c->prog.nsyms);
	}
	if (c->cuda) {
		kl_status st = kl__cuda_rt_arena(ctx, c, c->plan.arena_bytes, &c->arena);
		if (st == KL_OK && c->plan.arena_bytes > c->arena_cap)
			c->arena_cap = c->plan.arena_bytes;
		return st;
	}
	if (c->plan.arena_bytes > c->arena_cap || !c->arena) {
		void *a = NULL;
		size_t want = c->plan.arena_bytes ? c->plan.arena_bytes : KL_ARENA_ALIGN;
		if (posix_memalign(&a, KL_ARENA_ALIGN, want) != 0)
			return kl__err(ctx, KL_ENOMEM,
			               "kl_fn_call: out of memory allocating a %zu-byte "
			               "arena",
			               want);
		free(c->arena);
		c->arena = a;
		c->arena_cap = want;
	}
	return KL_OK;
}

/* Step sp of c on the CPU. */
static kl_status cpu_step(kl_ctx *ctx, kl_compiled *c, const kl_step *sp, void **B,
                          const int64_t *syms)
{
	const kl_program *p = &c->prog;
	if (sp->kind == KL_STEP_KERNEL) {
		c->fns[sp->kernel]((void *const *)B, syms);
		return KL_OK;
	}
	if (sp->kind == KL_STEP_ATTENTION)
		return kl__cpu_attention(&sp->at, p->bufs[sp->at.o].dtype, B[sp->at.q], B[sp->at.k],
		                         B[sp->at.v], B[sp->at.o])
		               ? KL_OK
		               : kl__err(ctx, KL_ENOMEM,
		                         "kl_fn_call: out of memory for attention tiles");
	return run_matmul(ctx, c, sp, B);
}

static const char *human(double v, const char *unit, char *buf, size_t cap);
static const char *step_label(const kl_program *p, const kl_step *sp, char *buf, size_t cap);

/* kl_profile: after the call has run every step, each one again alone (the
 * program is functional: a step rewrites only its own outputs, from buffers
 * the call left in place), on the GPU by device events over about 2 ms of
 * plain launches, on the CPU by the host clock over at least 3 runs and
 * 2 ms; then a table to ctx->profile. */
static kl_status profile_steps(kl_ctx *ctx, kl_compiled *c, void **B, const int64_t *syms)
{
	const kl_program *p = &c->prog;
	double *us = calloc((size_t)(p->nsteps > 0 ? p->nsteps : 1), sizeof *us);
	if (!us)
		return kl__err(ctx, KL_ENOMEM, "kl_profile: out of memory");
	kl_status st = KL_OK;
	if (c->cuda) {
		st = kl__cuda_rt_time_steps(ctx, c, (void *const *)B, syms, us);
	} else {
		for (int32_t s = 0; s < p->nsteps && st == KL_OK; s++) {
			double t0 = kl__now_ms(), t1 = t0;
			int n = 0;
			do {
				st = cpu_step(ctx, c, &p->steps[s], B, syms);
				n++;
				t1 = kl__now_ms();
			} while (st == KL_OK && n < 1000 && (n < 3 || t1 - t0 < 2.0));
			us[s] = (t1 - t0) * 1e3 / n;
		}
	}
	if (st == KL_OK) {
		FILE *f = ctx->profile;
		double total = 0;
		for (int32_t s = 0; s < p->nsteps; s++)
			total += us[s];
		fprintf(f, "kiln profile: graph %d: %d steps, each timed alone (%s): %.1f us in all\n",
		        ctx->profile_graph, (int)p->nsteps,
		        c->cuda ? "device events, plain launches" : "host clock", total);
		ctx->profile_segs++;
		fprintf(f, "  %-6s %12s %7s %12s %15s  %s\n", "step", "time", "share", "moved",
		        "computed", "what");
		for (int32_t s = 0; s < p->nsteps; s++) {
			const kl_step *sp = &p->steps[s];
			char b1[32], b2[32], idx[16], label[96];
			double sec = us[s] * 1e-6;
			snprintf(idx, sizeof idx, "[%d]", (int)s);
			fprintf(f, "  %-6s %9.1f us %6.1f%% %10s/s %13s/s  %s\n", idx, us[s],
			        total > 0 ? 100.0 * us[s] / total : 0.0,
			        human(sec > 0 ? sp->bytes / sec : 0, "B", b1, sizeof b1),
			        human(sec > 0 ? sp->flops / sec : 0, "FLOP", b2, sizeof b2),
			        step_label(p, sp, label, sizeof label));
		}
		if (ferror(f))
			st = kl__err(ctx, KL_EIO, "kl_profile: write error");
	}
	free(us);
	return st;
}

kl_status kl__compiled_run(kl_ctx *ctx, kl_compiled *c, kl_tensor *const *inputs,
                           kl_tensor **outputs)
{
	const kl_program *p = &c->prog;
	for (int j = 0; j < c->nout; j++)
		outputs[j] = NULL;
	for (int i = 0; i < c->nin; i++) {
		const kl_tensor *t = inputs[i];
		if (!t || t->ctx != ctx || !t->st)
			return kl__err(ctx, KL_EINVAL, "kl_fn_call: input %d is %s", i,
			               !t              ? "NULL"
			               : t->ctx != ctx ? "of another context"
			                               : "not materialized");
	}
	int64_t syms[KL_MAX_DIMS * 4] = {0};
	for (int32_t k = 0; k < p->nsyms; k++)
		syms[k] = inputs[p->sym_input[k]]->shape[p->sym_dim[k]];
	kl_status st = KL_OK;
	for (int32_t b = 0; b < p->nbufs && st == KL_OK; b++)
		if (p->bufs[b].role == KL_BUF_INPUT)
			st = check_input(ctx, c, &p->bufs[b], inputs[p->bufs[b].index], syms);
	if (st == KL_OK)
		st = ensure_plan(ctx, c, syms);
	void **B = malloc(sizeof(void *) * (size_t)(p->nbufs ? p->nbufs : 1));
	if (st != KL_OK || !B) {
		free(B);
		return st != KL_OK ? st : kl__err(ctx, KL_ENOMEM, "kl_fn_call: out of memory");
	}
	/* outputs are made in a private scope, so that a failure frees them and
	 * success hands the caller plain references */
	int scopes = ctx->nscopes;
	kl_scope_begin(ctx);
	if (ctx->nscopes != scopes + 1) {
		free(B);
		return kl_last_status(ctx);
	}
	for (int32_t b = 0; b < p->nbufs; b++) {
		const kl_buf *bf = &p->bufs[b];
		if (bf->role == KL_BUF_INPUT)
			B[b] = kl__tensor_data(inputs[bf->index]);
		else if (bf->role == KL_BUF_TEMP)
			B[b] = (char *)c->arena + c->plan.off[b];
		else
			B[b] = NULL;
	}
	st = bind_outputs(ctx, c, inputs, outputs, syms, B);
	if (st == KL_OK && c->cuda) {
		st = kl__cuda_rt_run(ctx, c, (void *const *)B, syms);
	} else if (st == KL_OK) {
		if (ctx->nthreads > 0)
			omp_set_num_threads(ctx->nthreads);
		for (int32_t s = 0; s < p->nsteps && st == KL_OK; s++)
			st = cpu_step(ctx, c, &p->steps[s], B, syms);
	}
	if (st == KL_OK && ctx->profile)
		st = profile_steps(ctx, c, B, syms);
	free(B);
	if (st == KL_OK)
		for (int j = 0; j < c->nout; j++)
			kl_retain(outputs[j]);
	kl_scope_end(ctx);
	if (st != KL_OK) {
		for (int j = 0; j < c->nout; j++)
			outputs[j] = NULL;
		return st;
	}
	c->runs++;
	c->last_launches = c->cuda && kl__cuda_rt_replaying(c) ? 1 : (int)p->nsteps;
	c->launches += (uint64_t)c->last_launches;
	return KL_OK;
}

/* ---- explain ------------------------------------------------------------------- */

static const char *human(double v, const char *unit, char *buf, size_t cap)
{
	static const char *const pre[] = {"", "K", "M", "G", "T", "P"};
	int i = 0;
	while (v >= 1000 && i < 5) {
		v /= 1000;
		i++;
	}
	snprintf(buf, cap, i ? "%.3g %s%s" : "%.0f %s%s", v, pre[i], unit);
	return buf;
}

/* A step in words: its kernel's name (or the library call) and what it is. */
static const char *step_label(const kl_program *p, const kl_step *sp, char *buf, size_t cap)
{
	snprintf(buf, cap, "%s %s",
	         sp->kind == KL_STEP_KERNEL      ? p->kernel_names[sp->kernel]
	         : sp->kind == KL_STEP_ATTENTION ? "attn"
	                                         : "blas",
	         sp->what[0] ? sp->what : (sp->kind == KL_STEP_KERNEL ? "kernel" : "matmul"));
	return buf;
}

void kl__compiled_explain(const kl_compiled *c, FILE *f, const char *ind)
{
	const kl_program *p = &c->prog;
	int nk = 0, nm = 0;
	for (int32_t s = 0; s < p->nsteps; s++)
		p->steps[s].kind == KL_STEP_KERNEL ? nk++ : nm++;
	/* library calls: products and attention steps */
	char b1[32], b2[32], b3[32], b4[32];
	fprintf(f, "%s%d steps per call: %d generated kernels, %d library calls%s%s\n", ind,
	        (int)p->nsteps, nk, nm, c->fusion ? "" : " (fusion off)",
	        c->from_cache ? "; plan and binary from the disk cache" : "");
	fprintf(f,
	        "%splanned peak memory: %s (temps %s in %d slots, %s without reuse; outputs "
	        "%s)%s\n",
	        ind, human((double)(c->plan.arena_bytes + c->plan.out_bytes), "B", b1, sizeof b1),
	        human((double)c->plan.arena_bytes, "B", b2, sizeof b2), (int)c->plan.nslots,
	        human((double)c->plan.temp_bytes, "B", b3, sizeof b3),
	        human((double)c->plan.out_bytes, "B", b4, sizeof b4),
	        c->dynamic ? " at the traced sizes" : "");
	for (int32_t s = 0; s < p->nsteps; s++) {
		const kl_step *sp = &p->steps[s];
		char label[96];
		fprintf(f, "%s  [%d] %s:", ind, (int)s, step_label(p, sp, label, sizeof label));
		for (int i = 0; i < sp->nnodes; i++) {
			int32_t id = sp->nodes[i];
			const char *op = id < c->g.n && c->g.nodes[id].op < KL_NOPS
			                         ? kl__ops[c->g.nodes[id].op].name
			                         : "?";
			fprintf(f, " %s#%d", op, (int)id);
		}
		fprintf(f, " | %s moved, %s\n", human(sp->bytes, "B", b1, sizeof b1),
		        human(sp->flops, "FLOP", b2, sizeof b2));
	}
}
