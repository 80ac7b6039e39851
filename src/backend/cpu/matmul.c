/* matmul.c - CPU eager matrix product over batch dims: f32/f64 through
 * OpenBLAS gemm (reading transposed views in place through the transpose
 * flags), f16/bf16 through an f32 gemm on converted copies, integers by
 * plain loops that wrap like every integer op.
 */
#include <cblas.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "backend/cpu/cpu.h"
#include "graph/optable.h"

/* Up to this many multiply-adds OpenBLAS runs a gemm on one thread anyway
 * (its GEMM_MULTITHREAD_THRESHOLD); such batches run in parallel, one gemm
 * per thread, instead of one after another. Bigger gemms thread inside. */
#define MM_SMALL (64 * 64 * 64)

typedef struct mm_plan {
	int64_t M, N, K;
	int nb;
	int64_t bshape[KL_MAX_DIMS], ast[KL_MAX_DIMS], bst[KL_MAX_DIMS];
	int64_t batch;
	const char *a, *b;
	kl_dtype adt, bdt;
	int64_t ars, acs, brs, bcs; /* row / col strides of A (M x K) and B (K x N) */
	char *out;
	kl_dtype odt;
	kl_cpu_ct ct; /* F32 (f32, f16, bf16), F64, or I64 */
	/* per operand: read in place through a gemm layout, else a dense copy */
	bool a_direct, b_direct, a_trans, b_trans;
	int64_t lda, ldb;
	int nt; /* kiln's threads, for each product's split */
} mm_plan;

/* Can BLAS read a rows x cols matrix with these strides in place? Row-major
 * gemm reads it untransposed when columns are unit-stride, transposed when
 * rows are; a dim of size 1 is never stepped along, so its stride is free. */
static bool mat_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, bool *trans, int64_t *ld)
{
	int64_t mc = cols > 1 ? cols : 1, mr = rows > 1 ? rows : 1;
	if ((cols <= 1 || cs == 1) && (rows <= 1 || rs >= mc)) {
		*trans = false;
		*ld = rows <= 1 ? mc : rs;
	} else if ((rows <= 1 || rs == 1) && (cols <= 1 || cs >= mr)) {
		*trans = true;
		*ld = cols <= 1 ? mr : cs;
	} else {
		return false;
	}
	return *ld <= INT_MAX;
}

/* rows x cols of dtype dt at src (strides rs, cs) into a dense row-major
 * compute-type array */
static void mat_load(kl_cpu_ct ct, void *dst, const char *src, kl_dtype dt, int64_t rows,
                     int64_t cols, int64_t rs, int64_t cs)
{
	size_t es = kl_dtype_size(dt), des = kl__cpu_ct_size(ct);
	for (int64_t i = 0; i < rows; i++)
		kl__cpu_load_ct(ct, (char *)dst + i * cols * (int64_t)des,
		                src + i * rs * (int64_t)es, dt, cs, cols);
}

typedef struct mm_scratch {
	void *a, *b, *c;
	int64_t last_a, last_b; /* batch offsets whose copies a and b hold */
} mm_scratch;

static void gemm_int(const mm_plan *p, const int64_t *A, const int64_t *B, int64_t *C)
{
	int64_t M = p->M, N = p->N, K = p->K;
	for (int64_t i = 0; i < M; i++) {
		uint64_t *c = (uint64_t *)(void *)(C + i * N);
		for (int64_t j = 0; j < N; j++)
			c[j] = 0;
		for (int64_t k = 0; k < K; k++) {
			uint64_t a = (uint64_t)A[i * K + k];
			const int64_t *b = B + k * N;
			KL_SIMD
			for (int64_t j = 0; j < N; j++)
				c[j] += a * (uint64_t)b[j];
		}
	}
}

static void mm_batch(const mm_plan *p, int64_t bi, mm_scratch *s)
{
	int64_t aoff = 0, boff = 0, rem = bi;
	for (int d = p->nb - 1; d >= 0; d--) {
		int64_t i = rem % p->bshape[d];
		rem /= p->bshape[d];
		aoff += i * p->ast[d];
		boff += i * p->bst[d];
	}
	int64_t M = p->M, N = p->N, K = p->K;
	size_t oes = kl_dtype_size(p->odt);
	char *out = p->out + bi * M * N * (int64_t)oes;
	const char *ap = p->a + aoff * (int64_t)kl_dtype_size(p->adt);
	const char *bp = p->b + boff * (int64_t)kl_dtype_size(p->bdt);
	const void *A = ap, *B = bp;
	if (!p->a_direct) {
		if (s->last_a != aoff)
			mat_load(p->ct, s->a, ap, p->adt, M, K, p->ars, p->acs);
		s->last_a = aoff;
		A = s->a;
	}
	if (!p->b_direct) {
		if (s->last_b != boff)
			mat_load(p->ct, s->b, bp, p->bdt, K, N, p->brs, p->bcs);
		s->last_b = boff;
		B = s->b;
	}
	if (p->ct == KL_CT_I64) {
		gemm_int(p, A, B, s->c);
		kl__cpu_store_i64(out, p->odt, 1, s->c, M * N);
		return;
	}
	bool cdirect = p->odt == kl__cpu_ct_dtype(p->ct);
	void *C = cdirect ? (void *)out : s->c;
	int lda = (int)(p->a_direct ? p->lda : (K > 1 ? K : 1));
	int ldb = (int)(p->b_direct ? p->ldb : (N > 1 ? N : 1));
	enum CBLAS_TRANSPOSE ta = p->a_direct && p->a_trans ? CblasTrans : CblasNoTrans;
	enum CBLAS_TRANSPOSE tb = p->b_direct && p->b_trans ? CblasTrans : CblasNoTrans;
	kl__blas_gemm(p->nt, p->ct != KL_CT_F32, ta, tb, (int)M, (int)N, (int)K, 1.0, A, lda, B,
	              ldb, 0.0, C, (int)N);
	if (!cdirect)
		kl__cpu_store_ct(p->ct, out, p->odt, 1, C, M * N);
}


static bool scratch_alloc(const mm_plan *p, mm_scratch *s)
{
	size_t es = kl__cpu_ct_size(p->ct);
	s->a = s->b = s->c = NULL;
	s->last_a = s->last_b = -1;
	if (!p->a_direct && !(s->a = malloc(es * (size_t)(p->M * p->K))))
		return false;
	if (!p->b_direct && !(s->b = malloc(es * (size_t)(p->K * p->N))))
		return false;
	bool cdirect = p->ct != KL_CT_I64 && p->odt == kl__cpu_ct_dtype(p->ct);
	if (!cdirect && !(s->c = malloc(es * (size_t)(p->M * p->N))))
		return false;
	return true;
}

static void scratch_free(mm_scratch *s)
{
	free(s->a);
	free(s->b);
	free(s->c);
}

typedef struct mm_job {
	const mm_plan *p;
	_Atomic bool oom;
} mm_job;

/* batch entries [lo, hi), with scratch of their own */
static void batch_chunk(void *arg, int64_t lo, int64_t hi)
{
	mm_job *j = arg;
	mm_scratch s;
	if (!scratch_alloc(j->p, &s)) {
		atomic_store(&j->oom, true);
		scratch_free(&s);
		return;
	}
	for (int64_t bi = lo; bi < hi; bi++)
		mm_batch(j->p, bi, &s);
	scratch_free(&s);
}

kl_status kl__cpu_matmul(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	char b1[96], b2[96], b3[96];
	if (n->nin != 2 || !in[0] || !in[1] || !in[0]->st || !in[1]->st)
		return kl__err(ctx, KL_EINVAL,
		               "kl_matmul: cpu kernel expects two materialized "
		               "inputs");
	const kl_tensor *a = in[0], *b = in[1];
	int nd = n->ndim;
	if (!kl__matmul_shapes_ok(nd, n->shape, a->ndim, a->shape, b->ndim, b->shape))
		return kl__err(ctx, KL_EINVAL, "kl_matmul: operands %s and %s do not give %s",
		               kl__shape_str(b1, sizeof b1, a->ndim, a->shape),
		               kl__shape_str(b2, sizeof b2, b->ndim, b->shape),
		               kl__shape_str(b3, sizeof b3, n->ndim, n->shape));
	mm_plan p;
	memset(&p, 0, sizeof p);
	p.M = n->shape[nd - 2];
	p.N = n->shape[nd - 1];
	p.K = a->shape[nd - 1];
	p.nb = nd - 2;
	memcpy(p.bshape, n->shape, sizeof(int64_t) * (size_t)p.nb);
	memcpy(p.ast, a->strides, sizeof(int64_t) * (size_t)p.nb);
	memcpy(p.bst, b->strides, sizeof(int64_t) * (size_t)p.nb);
	p.batch = kl__numel(p.nb, p.bshape);
	p.a = kl__tensor_data(a);
	p.b = kl__tensor_data(b);
	p.adt = a->dtype;
	p.bdt = b->dtype;
	p.ars = a->strides[nd - 2];
	p.acs = a->strides[nd - 1];
	p.brs = b->strides[nd - 2];
	p.bcs = b->strides[nd - 1];
	p.out = kl__tensor_data(out);
	p.odt = (kl_dtype)n->dtype;
	p.ct = kl__cpu_ct(p.odt);
	if (p.M > INT_MAX || p.N > INT_MAX || p.K > INT_MAX)
		return kl__err(ctx, KL_EUNSUPPORTED,
		               "kl_matmul: %lldx%lldx%lld exceeds the BLAS "
		               "int range",
		               (long long)p.M, (long long)p.N, (long long)p.K);
	int64_t total = p.batch * p.M * p.N;
	if (total == 0)
		return KL_OK;
	if (p.K == 0) {
		/* an empty sum: zero bits are 0 in every dtype */
		memset(p.out, 0, (size_t)total * kl_dtype_size(p.odt));
		return KL_OK;
	}
	if (p.ct != KL_CT_I64) {
		kl_dtype nat = kl__cpu_ct_dtype(p.ct);
		p.a_direct = p.adt == nat && mat_layout(p.M, p.K, p.ars, p.acs, &p.a_trans, &p.lda);
		p.b_direct = p.bdt == nat && mat_layout(p.K, p.N, p.brs, p.bcs, &p.b_trans, &p.ldb);
	}

	int nt = kl__cpu_threads(ctx);
	p.nt = nt;
	double per = (double)p.M * (double)p.N * (double)p.K;
	bool oom = false;
	if (nt > 1 && p.batch > 1 && per <= MM_SMALL && per * (double)p.batch >= KL_CPU_PAR_MIN) {
		mm_job j = {&p, false};
		kl__par_for(nt, p.batch, batch_chunk, &j);
		oom = atomic_load(&j.oom);
	} else {
		mm_scratch s;
		if (scratch_alloc(&p, &s)) {
			for (int64_t bi = 0; bi < p.batch; bi++)
				mm_batch(&p, bi, &s);
		} else {
			oom = true;
		}
		scratch_free(&s);
	}
	if (oom)
		return kl__err(ctx, KL_ENOMEM,
		               "kl_matmul: out of memory for %lldx%lldx%lld "
		               "scratch",
		               (long long)p.M, (long long)p.N, (long long)p.K);
	return KL_OK;
}
