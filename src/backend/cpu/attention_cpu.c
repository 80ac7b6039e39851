/* attention_cpu.c - fused attention on the CPU: softmax(q k^T * scale [+ causal
 * mask]) v without the Tq x Tk matrix. Work items are (batch, block of BQ
 * queries); each walks the keys in blocks of BK, keeping per query row the
 * running maximum m, the running sum l of exp(s - m) and the unnormalized
 * output, rescaled by exp(m_old - m_new) whenever the maximum grows (online
 * softmax). Blocks a causal mask hides entirely are never visited, nor keys
 * past a row's length (kl_sdpa_lengths: the causal diagonal then ends at the
 * length, and a query row with no allowed key gives 0). The two
 * products of a block (S = q k^T * scale, acc += P v) are single-threaded
 * BLAS calls inside the chunks of kiln's thread pool (blas.c, pool.c). f16, bf16 and f32 compute
 * in float, f64 in double; the result rounds once.
 */
#include <cblas.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "backend/cpu/cpu.h"

typedef struct attn_job {
	const kl_attn_step *a;
	kl_dtype dt;
	const void *q, *k, *v, *lens;
	void *o;
	int64_t len_div; /* flat batch entries a length row */
	_Atomic bool ok;
} attn_job;

#define BQ 64
#define BK 128

static const void *at(const void *p, kl_dtype dt, int64_t off)
{
	return (const char *)p + off * (int64_t)kl_dtype_size(dt);
}

/* rows x cols of (base + off) with strides rs, cs into a dense tile; with
 * transposed set the tile is cols x rows */
#define ATTN_KERNEL(NAME, T, NATIVE, LOAD, STORE, EXP, EXP_ROW, F64)                               \
	static void load_##NAME(T *dst, const void *src, kl_dtype dt, int64_t off, int64_t rows,   \
	                        int64_t cols, int64_t rs, int64_t cs)                              \
	{                                                                                          \
		if (cols == 0) /* empty: its strides are not addresses */                          \
			return;                                                                    \
		for (int64_t r = 0; r < rows; r++)                                                 \
			LOAD(dst + r * cols, at(src, dt, off + r * rs), dt, cs, cols);             \
	}                                                                                          \
                                                                                                   \
	/* an operand tile for BLAS: read in place when it is already T with unit  \
	 * column stride and rows at least cols apart (its leading dimension *ld), \
	 * else copied into dst (leading dimension cols) */                        \
	static const T *tile_##NAME(T *dst, const void *src, kl_dtype dt, int64_t off,             \
	                            int64_t rows, int64_t cols, int64_t rs, int64_t cs,            \
	                            int64_t *ld)                                                   \
	{                                                                                          \
		if (dt == NATIVE && cols > 0 && cs == 1 && (rows <= 1 || rs >= cols) &&            \
		    rs <= INT32_MAX) {                                                             \
			*ld = rows <= 1 ? cols : rs;                                               \
			return (const T *)at(src, dt, off);                                        \
		}                                                                                  \
		load_##NAME(dst, src, dt, off, rows, cols, rs, cs);                                \
		*ld = cols;                                                                        \
		return dst;                                                                        \
	}                                                                                          \
                                                                                                   \
	static void chunk_##NAME(void *arg, int64_t lo, int64_t hi)                                \
	{                                                                                          \
		attn_job *job = arg;                                                               \
		const kl_attn_step *a = job->a;                                                    \
		kl_dtype dt = job->dt;                                                             \
		const void *Q = job->q, *K = job->k, *V = job->v;                                  \
		void *O = job->o;                                                                  \
		int64_t nqb = (a->tq + BQ - 1) / BQ;                                               \
		int64_t D = a->d, DV = a->dv;                                                      \
		{                                                                                  \
			size_t n =                                                                 \
			        (size_t)(BQ * D + BK * D + BK * DV + BQ * BK + BQ * DV + 2 * BQ);  \
			T *buf = malloc(sizeof(T) * n);                                            \
			if (!buf) {                                                                \
				atomic_store(&job->ok, false);                                     \
				return;                                                            \
			}                                                                          \
			T *q = buf, *kb = q + BQ * D, *v = kb + BK * D, *s = v + BK * DV;          \
			T *acc = s + BQ * BK, *m = acc + BQ * DV, *l = m + BQ;                     \
			for (int64_t t = lo; t < hi; t++) {                                        \
				int64_t b = t / nqb, q0 = (t % nqb) * BQ;                          \
				int64_t nq = a->tq - q0 < BQ ? a->tq - q0 : BQ;                    \
				int64_t qo = a->q_off + kl__attn_batch_off(a, a->q_bs, b),                  \
				        ko = a->k_off + kl__attn_batch_off(a, a->k_bs, b),                  \
				        vo = a->v_off + kl__attn_batch_off(a, a->v_bs, b),                  \
				        oo = kl__attn_batch_off(a, a->o_bs, b);                             \
				int64_t end = a->tk; /* the row's keys end here */                 \
				if (job->lens)                                                     \
					end = kl__attn_len_at(a, job->lens, b / job->len_div);     \
				int64_t lag = end - a->tq;                                         \
				int64_t ldq, ldk, ldv;                                             \
				const T *qt = tile_##NAME(q, Q, dt, qo + q0 * a->q_rs, nq, D,     \
				                          a->q_rs, a->q_cs, &ldq);                 \
				for (int64_t i = 0; i < nq; i++) {                                 \
					m[i] = -(T)INFINITY;                                       \
					l[i] = 0;                                                  \
					for (int64_t c = 0; c < DV; c++)                           \
						acc[i * DV + c] = 0;                               \
				}                                                                  \
				/* keys past the last row's limit are masked for every row */      \
				int64_t kend = end;                                                \
				if (a->causal && q0 + nq + lag < kend)                             \
					kend = q0 + nq + lag > 0 ? q0 + nq + lag : 0;              \
				for (int64_t k0 = 0; k0 < kend; k0 += BK) {                        \
					int64_t nk = kend - k0 < BK ? kend - k0 : BK;              \
					const T *kt = tile_##NAME(kb, K, dt, ko + k0 * a->k_rs,    \
					                          nk, D, a->k_rs, a->k_cs, &ldk);  \
					const T *vt = tile_##NAME(v, V, dt, vo + k0 * a->v_rs, nk, \
					                          DV, a->v_rs, a->v_cs, &ldv);     \
					/* S = q k^T * scale: nq x nk, rows BK apart */            \
					kl__blas_gemm(1, F64, CblasNoTrans, CblasTrans, (int)nq,   \
					              (int)nk, (int)D, a->scale, qt, (int)ldq, kt, \
					              (int)ldk, 0.0, s, BK);                       \
					for (int64_t i = 0; i < nq; i++) {                         \
						T *si = s + i * BK;                                \
						int64_t lim =                                      \
						        a->causal ? q0 + i + lag - k0 : nk - 1;    \
						/* the row's max (NaN if any is NaN) and then its  \
						 * exps and their sum, as vector loops */          \
						T bm = -(T)INFINITY;                               \
						int nan = 0;                                       \
						_Pragma("omp simd reduction(max:bm) reduction(|:nan)") \
						for (int64_t j = 0; j < nk; j++) {                 \
							T v_ = j <= lim ? si[j] : -(T)INFINITY;    \
							si[j] = v_;                                \
							bm = v_ > bm ? v_ : bm;                    \
							nan |= v_ != v_;                           \
						}                                                  \
						T mx = nan ? (T)NAN : bm > m[i] ? bm : m[i];       \
						if (mx == -(T)INFINITY) {                          \
							/* nothing allowed yet: no share of P v */ \
							for (int64_t j = 0; j < nk; j++)           \
								si[j] = 0;                         \
							continue;                                  \
						}                                                  \
						T corr = EXP(m[i] - mx);                           \
						T sum = EXP_ROW(si, nk, mx);                       \
						m[i] = mx;                                         \
						l[i] = l[i] * corr + sum;                          \
						T *ai = acc + i * DV;                              \
						KL_SIMD for (int64_t c = 0; c < DV; c++) ai[c] *=  \
						        corr;                                      \
					}                                                          \
					/* acc += P v (P in s) */                                  \
					kl__blas_gemm(1, F64, CblasNoTrans, CblasNoTrans, (int)nq, \
					              (int)DV, (int)nk, 1.0, s, BK, vt, (int)ldv,  \
					              1.0, acc, (int)DV);                          \
				}                                                                  \
				for (int64_t i = 0; i < nq; i++) {                                 \
					T *ai = acc + i * DV;                                      \
					for (int64_t c = 0; c < DV; c++)                           \
						ai[c] = l[i] > 0       ? ai[c] / l[i]             \
						        : job->lens ? (T)0                         \
						                    : (T)NAN;                      \
					STORE(at(O, dt, oo + (q0 + i) * a->o_rs), dt, 1, ai, DV);  \
				}                                                                  \
			}                                                                          \
			free(buf);                                                                 \
		}                                                                                  \
	}                                                                                          \
                                                                                                   \
	static bool run_##NAME(const kl_attn_step *a, kl_dtype dt, const void *Q, const void *K,   \
	                       const void *V, const void *L, void *O)                              \
	{                                                                                          \
		int64_t nb = 1;                                                                    \
		for (int i = 0; i < a->nbatch; i++)                                                \
			nb *= a->batch[i];                                                         \
		attn_job j = {.a = a, .dt = dt, .q = Q, .k = K, .v = V, .lens = L, .o = O,         \
		              .len_div = kl__attn_len_div(a), .ok = true};                         \
		kl__par_for_call(nb *((a->tq + BQ - 1) / BQ), chunk_##NAME, &j);                   \
		return atomic_load(&j.ok);                                                         \
	}

static inline float exp_f32(float x)
{
	return kl__cpu_expf(x);
}

/* s[j] = e^(s[j] - mx) for j < n; returns their sum. The kernel's hot loop,
 * built for the wider vector units too (KL_CPU_CLONES). */
KL_CPU_CLONES float kl__cpu_exp_row_f32(float *s, int64_t n, float mx)
{
	float sum = 0;
	_Pragma("omp simd reduction(+:sum)")
	for (int64_t j = 0; j < n; j++) {
		s[j] = kl__cpu_expf(s[j] - mx);
		sum += s[j];
	}
	return sum;
}

double kl__cpu_exp_row_f64(double *s, int64_t n, double mx)
{
	double sum = 0;
	for (int64_t j = 0; j < n; j++) {
		s[j] = exp(s[j] - mx);
		sum += s[j];
	}
	return sum;
}

#define STORE_F32(p, dt, st, src, n) kl__cpu_store_f32((void *)(p), dt, st, src, n)
#define STORE_F64(p, dt, st, src, n) kl__cpu_store_f64((void *)(p), dt, st, src, n)
ATTN_KERNEL(f32, float, KL_F32, kl__cpu_load_f32, STORE_F32, exp_f32, kl__cpu_exp_row_f32, false)
ATTN_KERNEL(f64, double, KL_F64, kl__cpu_load_f64, STORE_F64, exp, kl__cpu_exp_row_f64, true)

bool kl__cpu_attention(const kl_attn_step *a, kl_dtype dt, const void *q, const void *k,
                       const void *v, const void *lens, void *o)
{
	if (a->tq == 0 || a->dv == 0)
		return true;
	for (int i = 0; i < a->nbatch; i++)
		if (a->batch[i] == 0)
			return true;
	if (a->len < 0)
		lens = NULL;
	return dt == KL_F64 ? run_f64(a, dt, q, k, v, lens, o) : run_f32(a, dt, q, k, v, lens, o);
}

kl_status kl__cpu_sdpa(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	int r = n->ndim;
	bool has_len = (n->a.flags & KL_F_LENGTHS) != 0;
	if (n->nin != 3 + has_len || r < 2 + has_len)
		return kl__err(ctx, KL_EINVAL, "kl_sdpa: malformed node (%d inputs, %d dims)",
		               (int)n->nin, r);
	for (int i = 0; i < 3; i++)
		if (in[i]->dtype != n->dtype || in[i]->ndim != r)
			return kl__err(ctx, KL_EINVAL, "kl_sdpa: input %d does not match the node",
			               i);
	kl_attn_step a;
	memset(&a, 0, sizeof a);
	int64_t os[KL_MAX_DIMS];
	kl__contig_strides(r, out->shape, os);
	a.tq = n->shape[r - 2];
	a.dv = n->shape[r - 1];
	a.tk = in[1]->shape[r - 2];
	a.d = in[0]->shape[r - 1];
	a.q_rs = in[0]->strides[r - 2];
	a.q_cs = in[0]->strides[r - 1];
	a.k_rs = in[1]->strides[r - 2];
	a.k_cs = in[1]->strides[r - 1];
	a.v_rs = in[2]->strides[r - 2];
	a.v_cs = in[2]->strides[r - 1];
	a.o_rs = a.dv;
	a.scale = n->a.s[0];
	a.causal = (n->a.flags & KL_F_CAUSAL) != 0;
	for (int d = 0; d < r - 2; d++) {
		int i = a.nbatch++;
		a.batch[i] = n->shape[d];
		a.q_bs[i] = in[0]->strides[d];
		a.k_bs[i] = in[1]->strides[d];
		a.v_bs[i] = in[2]->strides[d];
		a.o_bs[i] = os[d];
	}
	a.len = -1;
	if (has_len) {
		a.len = 3;
		a.len_inner = a.nbatch - 1; /* every batch dim but the first */
		a.len_st = in[3]->strides[0];
		a.len_dt = in[3]->dtype;
	}
	kl__par_set_threads(ctx->nthreads);
	if (!kl__cpu_attention(&a, (kl_dtype)n->dtype, kl__tensor_data(in[0]),
	                       kl__tensor_data(in[1]), kl__tensor_data(in[2]),
	                       has_len ? kl__tensor_data(in[3]) : NULL, kl__tensor_data(out)))
		return kl__err(ctx, KL_ENOMEM, "kl_sdpa: out of memory for attention tiles");
	return KL_OK;
}
