/* attention_bwd_cpu.c - the attention backward on the CPU (sdpa_bwd, an
 * attention step with bwd set): dq, dk, dv of softmax(q k^T * scale [+ causal
 * mask]) v from q, k, v, the forward's output o and its gradient do. A work
 * item is one batch entry: its q, k, v and do converted once into dense
 * compute-type arrays, D_i = do_i . o_i, then per block of 64 query rows,
 * over the keys the block sees (a causal mask ends them at the last row's
 * limit): S = q k^T * scale and each row's softmax P over its allowed keys
 * (whole rows: no log-sum-exp pass, no rescaling), dv += P^T do, dP = do v^T,
 * dS = P * (dP - D), dk += scale dS^T q, dq = scale dS k. What is held is
 * 64 x Tk (P and dS) and the item's operands, never Tq x Tk; dk and dv of
 * the item accumulate in place, so no two items write one row. The products
 * are single-threaded BLAS calls inside the chunks of kiln's thread pool
 * (parallel over the batch entries); f16, bf16 and f32 compute in float, f64
 * in double; each gradient rounds once, into its rows wherever the step puts
 * them (kl_attn_step: the packed [dq; dk; dv], or a packed qkv product's
 * gradient). A query with no allowed key (causal,
 * Tq > Tk) has NaN probabilities, as softmax over nothing: its dq row and
 * every dk, dv are NaN, as the reference says.
 */
#include <cblas.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "backend/cpu/cpu.h"

typedef struct attn_bwd_job {
	const kl_attn_step *a;
	kl_dtype dt;
	const void *q, *k, *v, *o, *go;
	void *out;
	_Atomic bool ok;
} attn_bwd_job;

#define BQ 64

static const void *elem(const void *p, kl_dtype dt, int64_t off)
{
	return (const char *)p + off * (int64_t)kl_dtype_size(dt);
}

/* The compute-type arrays of one work item (tq, tk rows of d) */
#define ATTN_BWD_KERNEL(NAME, T, LOAD, STORE, EXP_ROW, F64)                                        \
	/* rows x cols at (base + off), strides rs, cs, into a dense array */                      \
	static void bload_##NAME(T *dst, const void *src, kl_dtype dt, int64_t off, int64_t rows,  \
	                         int64_t cols, int64_t rs, int64_t cs)                             \
	{                                                                                          \
		if (cols == 0)                                                                     \
			return;                                                                    \
		for (int64_t r = 0; r < rows; r++)                                                 \
			LOAD(dst + r * cols, elem(src, dt, off + r * rs), dt, cs, cols);           \
	}                                                                                          \
                                                                                                   \
	static size_t bwd_need_##NAME(const kl_attn_step *a)                                       \
	{                                                                                          \
		int64_t tq = a->tq, tk = a->tk, D = a->d;                                          \
		return (size_t)(2 * tq * D + 4 * tk * D + BQ * D + tq + 2 * BQ * tk + D + 1);      \
	}                                                                                          \
                                                                                                   \
	static void bwd_item_##NAME(attn_bwd_job *job, int64_t b, T *buf)                          \
	{                                                                                          \
		const kl_attn_step *a = job->a;                                                    \
		kl_dtype dt = job->dt;                                                             \
		int64_t tq = a->tq, tk = a->tk, D = a->d, lag = tk - tq;                           \
		T *q = buf, *dO = q + tq * D, *k = dO + tq * D, *v = k + tk * D;                   \
		T *dk = v + tk * D, *dv = dk + tk * D, *dq = dv + tk * D, *Di = dq + BQ * D;       \
		T *s = Di + tq, *dp = s + BQ * tk, *orow = dp + BQ * tk;                           \
		bload_##NAME(q, job->q, dt, a->q_off + kl__attn_batch_off(a, a->q_bs, b), tq, D, a->q_rs,        \
		             a->q_cs);                                                             \
		bload_##NAME(k, job->k, dt, a->k_off + kl__attn_batch_off(a, a->k_bs, b), tk, D, a->k_rs,        \
		             a->k_cs);                                                             \
		bload_##NAME(v, job->v, dt, a->v_off + kl__attn_batch_off(a, a->v_bs, b), tk, D, a->v_rs,        \
		             a->v_cs);                                                             \
		bload_##NAME(dO, job->go, dt, a->go_off + kl__attn_batch_off(a, a->go_bs, b), tq, D, a->go_rs,   \
		             a->go_cs);                                                            \
		int64_t fo = a->fo_off + kl__attn_batch_off(a, a->fo_bs, b);                                     \
		for (int64_t i = 0; i < tq; i++) {                                                 \
			LOAD(orow, elem(job->o, dt, fo + i * a->fo_rs), dt, a->fo_cs, D);          \
			T acc = 0;                                                                 \
			for (int64_t c = 0; c < D; c++)                                            \
				acc += dO[i * D + c] * orow[c];                                    \
			Di[i] = acc;                                                               \
		}                                                                                  \
		for (int64_t i = 0; i < tk * D; i++)                                               \
			dk[i] = dv[i] = 0;                                                         \
		size_t es = kl_dtype_size(dt);                                                     \
		int64_t qo = a->dq_off + kl__attn_batch_off(a, a->o_bs, b);                        \
		int64_t ko = a->dk_off + kl__attn_batch_off(a, a->dk_bs, b);                       \
		int64_t vo = a->dv_off + kl__attn_batch_off(a, a->dv_bs, b);                       \
		for (int64_t q0 = 0; q0 < tq; q0 += BQ) {                                          \
			int64_t nq = tq - q0 < BQ ? tq - q0 : BQ;                                  \
			/* the keys some row of the block sees: [0, kend) */                       \
			int64_t kend = tk;                                                         \
			if (a->causal && q0 + nq + lag < kend)                                     \
				kend = q0 + nq + lag > 0 ? q0 + nq + lag : 0;                      \
			for (int64_t i = 0; i < nq * D; i++)                                       \
				dq[i] = 0;                                                         \
			if (kend > 0) {                                                            \
				/* P: each row's softmax over its allowed keys, rows tk apart */   \
				kl__blas_gemm(1, F64, CblasNoTrans, CblasTrans, (int)nq,           \
				              (int)kend, (int)D, a->scale, q + q0 * D, (int)D, k,  \
				              (int)D, 0.0, s, (int)tk);                            \
				for (int64_t i = 0; i < nq; i++) {                                 \
					T *si = s + i * tk;                                        \
					int64_t n = a->causal ? q0 + i + lag + 1 : kend;           \
					n = n < 0 ? 0 : n > kend ? kend : n;                       \
					T mx = -(T)INFINITY;                                       \
					int nan = 0;                                               \
					_Pragma("omp simd reduction(max:mx) reduction(|:nan)")     \
					for (int64_t j = 0; j < n; j++) {                          \
						mx = si[j] > mx ? si[j] : mx;                      \
						nan |= si[j] != si[j];                             \
					}                                                          \
					if (nan)                                                   \
						mx = (T)NAN;                                       \
					T sum = n > 0 ? EXP_ROW(si, n, mx) : 0;                    \
					T inv = sum == 0 ? 0 : 1 / sum;                           \
					KL_SIMD for (int64_t j = 0; j < n; j++) si[j] *= inv;      \
					for (int64_t j = n; j < kend; j++)                         \
						si[j] = 0;                                         \
				}                                                                  \
				/* dv += P^T do */                                                 \
				kl__blas_gemm(1, F64, CblasTrans, CblasNoTrans, (int)kend, (int)D, \
				              (int)nq, 1.0, s, (int)tk, dO + q0 * D, (int)D, 1.0,  \
				              dv, (int)D);                                         \
				/* dP = do v^T, then dS = P * (dP - D) in its place */             \
				kl__blas_gemm(1, F64, CblasNoTrans, CblasTrans, (int)nq,           \
				              (int)kend, (int)D, 1.0, dO + q0 * D, (int)D, v,      \
				              (int)D, 0.0, dp, (int)tk);                           \
				for (int64_t i = 0; i < nq; i++) {                                 \
					T *pi = s + i * tk, *di = dp + i * tk, Dr = Di[q0 + i];    \
					KL_SIMD for (int64_t j = 0; j < kend; j++) di[j] =         \
					        pi[j] * (di[j] - Dr);                              \
				}                                                                  \
				/* dk += scale dS^T q, dq = scale dS k */                          \
				kl__blas_gemm(1, F64, CblasTrans, CblasNoTrans, (int)kend, (int)D, \
				              (int)nq, a->scale, dp, (int)tk, q + q0 * D, (int)D,  \
				              1.0, dk, (int)D);                                    \
				kl__blas_gemm(1, F64, CblasNoTrans, CblasNoTrans, (int)nq, (int)D, \
				              (int)kend, a->scale, dp, (int)tk, k, (int)D, 0.0,    \
				              dq, (int)D);                                         \
			}                                                                          \
			for (int64_t i = 0; i < nq; i++) {                                         \
				if (a->causal && q0 + i + lag < 0) /* no key: NaN */               \
					for (int64_t c = 0; c < D; c++)                            \
						dq[i * D + c] = (T)NAN;                            \
				STORE((char *)job->out + (qo + (q0 + i) * a->o_rs) * (int64_t)es,  \
				      dt, 1, dq + i * D, D);                                       \
			}                                                                          \
		}                                                                                  \
		if (a->causal && lag < 0) /* some query sees no key: NaN */                        \
			for (int64_t i = 0; i < tk * D; i++)                                       \
				dk[i] = dv[i] = (T)NAN;                                            \
		for (int64_t j = 0; j < tk; j++) {                                                 \
			STORE((char *)job->out + (ko + j * a->dk_rs) * (int64_t)es, dt, 1,         \
			      dk + j * D, D);                                                      \
			STORE((char *)job->out + (vo + j * a->dv_rs) * (int64_t)es, dt, 1,         \
			      dv + j * D, D);                                                      \
		}                                                                                  \
	}                                                                                          \
                                                                                                   \
	static void bwd_chunk_##NAME(void *arg, int64_t lo, int64_t hi)                            \
	{                                                                                          \
		attn_bwd_job *job = arg;                                                           \
		T *buf = malloc(sizeof(T) * bwd_need_##NAME(job->a));                              \
		if (!buf) {                                                                        \
			atomic_store(&job->ok, false);                                             \
			return;                                                                    \
		}                                                                                  \
		for (int64_t b = lo; b < hi; b++)                                                  \
			bwd_item_##NAME(job, b, buf);                                              \
		free(buf);                                                                         \
	}

#define STORE_F32(p, dt, st, src, n) kl__cpu_store_f32((void *)(p), dt, st, src, n)
#define STORE_F64(p, dt, st, src, n) kl__cpu_store_f64((void *)(p), dt, st, src, n)
ATTN_BWD_KERNEL(f32, float, kl__cpu_load_f32, STORE_F32, kl__cpu_exp_row_f32, false)
ATTN_BWD_KERNEL(f64, double, kl__cpu_load_f64, STORE_F64, kl__cpu_exp_row_f64, true)

bool kl__cpu_attention_bwd(const kl_attn_step *a, kl_dtype dt, const void *q, const void *k,
                           const void *v, const void *o, const void *go, void *out)
{
	int64_t nb = 1;
	for (int i = 0; i < a->nbatch; i++)
		nb *= a->batch[i];
	if (nb == 0 || a->d == 0 || a->tq + a->tk == 0)
		return true;
	attn_bwd_job j = {
	        .a = a, .dt = dt, .q = q, .k = k, .v = v, .o = o, .go = go, .out = out, .ok = true};
	kl__par_for_call(nb, dt == KL_F64 ? bwd_chunk_f64 : bwd_chunk_f32, &j);
	return atomic_load(&j.ok);
}

kl_status kl__cpu_sdpa_bwd(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	int r = n->ndim;
	if (n->nin != 5 || r < 2)
		return kl__err(ctx, KL_EINVAL, "kl_sdpa_bwd: malformed node (%d inputs, %d dims)",
		               (int)n->nin, r);
	for (int i = 0; i < 5; i++)
		if (in[i]->dtype != n->dtype || in[i]->ndim != r)
			return kl__err(ctx, KL_EINVAL, "kl_sdpa_bwd: input %d does not match the node",
			               i);
	kl_attn_step a;
	memset(&a, 0, sizeof a);
	int64_t os[KL_MAX_DIMS];
	kl__contig_strides(r, out->shape, os);
	a.bwd = 1;
	a.len = -1;
	a.tq = in[0]->shape[r - 2];
	a.tk = in[1]->shape[r - 2];
	a.d = a.dv = n->shape[r - 1];
	a.q_rs = in[0]->strides[r - 2];
	a.q_cs = in[0]->strides[r - 1];
	a.k_rs = in[1]->strides[r - 2];
	a.k_cs = in[1]->strides[r - 1];
	a.v_rs = in[2]->strides[r - 2];
	a.v_cs = in[2]->strides[r - 1];
	a.fo_rs = in[3]->strides[r - 2];
	a.fo_cs = in[3]->strides[r - 1];
	a.go_rs = in[4]->strides[r - 2];
	a.go_cs = in[4]->strides[r - 1];
	a.o_rs = a.d;
	a.scale = n->a.s[0];
	a.causal = (n->a.flags & KL_F_CAUSAL) != 0;
	for (int d = 0; d < r - 2; d++) {
		int i = a.nbatch++;
		a.batch[i] = n->shape[d];
		a.q_bs[i] = in[0]->strides[d];
		a.k_bs[i] = in[1]->strides[d];
		a.v_bs[i] = in[2]->strides[d];
		a.fo_bs[i] = in[3]->strides[d];
		a.go_bs[i] = in[4]->strides[d];
		a.o_bs[i] = os[d];
	}
	kl__attn_bwd_packed(&a);
	kl__par_set_threads(ctx->nthreads);
	if (!kl__cpu_attention_bwd(&a, (kl_dtype)n->dtype, kl__tensor_data(in[0]),
	                           kl__tensor_data(in[1]), kl__tensor_data(in[2]),
	                           kl__tensor_data(in[3]), kl__tensor_data(in[4]),
	                           kl__tensor_data(out)))
		return kl__err(ctx, KL_ENOMEM,
		               "kl_sdpa_bwd: out of memory for the attention backward's tiles");
	return KL_OK;
}
