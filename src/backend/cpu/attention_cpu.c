/* attention_cpu.c - fused attention on the CPU: softmax(q k^T * scale [+ causal
 * mask]) v without the Tq x Tk matrix. Work items are (batch, block of BQ
 * queries); each walks the keys in blocks of BK, keeping per query row the
 * running maximum m, the running sum l of exp(s - m) and the unnormalized
 * output, rescaled by exp(m_old - m_new) whenever the maximum grows (online
 * softmax). Blocks a causal mask hides entirely are never visited, nor keys
 * past a row's length (kl_sdpa_lengths: the causal diagonal then ends at the
 * length, and a query row with no allowed key gives 0). f32, f16 and bf16
 * (computed in float) run kiln's own register-blocked kernel (below, "f32,
 * f16, bf16"); f64 runs ATTN_KERNEL, whose block products (S = q k^T *
 * scale, acc += P v) are single-threaded BLAS calls inside the chunks of
 * kiln's thread pool (blas.c, pool.c). The result rounds once.
 */
#include <cblas.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

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

#if !defined(__GNUC__) && !defined(__clang__)
static inline float exp_f32(float x)
{
	return kl__cpu_expf(x);
}
#endif

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
#if !defined(__GNUC__) && !defined(__clang__)
ATTN_KERNEL(f32, float, KL_F32, kl__cpu_load_f32, STORE_F32, exp_f32, kl__cpu_exp_row_f32, false)
#endif
ATTN_KERNEL(f64, double, KL_F64, kl__cpu_load_f64, STORE_F64, exp, kl__cpu_exp_row_f64, true)

/* ---- f32, f16, bf16: kiln's own register-blocked kernel ----
 *
 * The scores are built transposed, S^T = K (Q scale)^T, keys down and
 * queries across, so that nothing per key block is transposed: a key row is
 * read where it lies and broadcast one element at a time against the work
 * item's Q^T (packed once, scale folded in), and the softmax then runs across
 * the queries as whole vectors (the row max of S is an element-wise max down
 * S^T). The micro-kernels keep their accumulators in vector registers:
 * S^T as SMR keys x 2 vectors of queries over d, O += P V as PMR queries x 2
 * vectors of O's columns over the block's keys, O first rescaled by the
 * online softmax's correction. Built for AVX-512 (16 lanes, 8 x 2
 * accumulators), AVX2+FMA (8 lanes, 4 x 2) and the baseline (4 lanes); this
 * file contracts a * b + c to FMA (CMakeLists.txt). */
#if defined(__GNUC__) || defined(__clang__)
#define ATT_VEC 1
#define ATT_BQ 64 /* queries a work item */

typedef struct att_buf {
	float *qt, *k, *v, *st, *o, *m, *l, *msub, *corr, *bm;
	int64_t nqp, dvp;
} att_buf;

#define ATT_ROUND(x, m) (((x) + (m) - 1) / (m) * (m))

/* The kernel for one instruction set: TGT its target attribute (empty for the
 * baseline), VW floats a vector, SMR key rows an S^T block, PMR query rows an
 * O block, BK keys a block (its S^T, K and V tiles stay in L1 while P V
 * sweeps them: on the Zen 3, AVX2, 32 keys took 0.92-0.93 of 128's time
 * at 8x256x256x64, 16 and 64 0.90-1.06 and 0.94-0.95, interleaved calls in
 * one process). */
#define ATT_F32_ISA(SUF, TGT, VW, SMR, PMR, BK, EXP2, QPACK)                                                        \
	typedef float att_v_##SUF __attribute__((vector_size(VW * sizeof(float))));                \
	typedef int32_t att_i_##SUF __attribute__((vector_size(VW * sizeof(float))));              \
                                                                                                   \
	/* lanes of x above m, else m's (C has no ?: on vectors) */                \
	TGT static inline __attribute__((always_inline)) att_v_##SUF att_max_##SUF(                \
	        att_v_##SUF x, att_v_##SUF m)                                                      \
	{                                                                                          \
		att_i_##SUF gt = x > m;                                                            \
		return (att_v_##SUF)(((att_i_##SUF)x & gt) | ((att_i_##SUF)m & ~gt));              \
	}                                                                                          \
                                                                                                   \
	/* 2^x for x <= 0 (above 0 while 2^x is finite), NaN to NaN: 2^n 2^f, n  \
	 * = round(x), f in [-1/2, 1/2] through a degree-5 fit (relative error   \
	 * 2.3e-7); 2^n as two factors, so that x below -126 goes to 0 through  \
	 * the subnormals (x clamped at -160, where the product is 0) */   \
	TGT static inline __attribute__((always_inline, unused)) att_v_##SUF att_exp2g_##SUF(              \
	        att_v_##SUF x)                                                                     \
	{                                                                                          \
		const att_v_##SUF lo = (att_v_##SUF){0} - 160.0f;                                  \
		att_i_##SUF under = x < lo; /* NaN is not */                                       \
		x = (att_v_##SUF)(((att_i_##SUF)x & ~under) | ((att_i_##SUF)lo & under));          \
		att_v_##SUF n = (x + 12582912.0f) - 12582912.0f;                                   \
		att_v_##SUF f = x - n;                                                             \
		att_v_##SUF p = f * 1.327647129e-3f + 9.675541893e-3f;                             \
		p = p * f + 5.550713092e-2f;                                                       \
		p = p * f + 2.402212024e-1f;                                                       \
		p = p * f + 6.931469440e-1f;                                                       \
		p = p * f + 1.000000119f;                                                          \
		att_i_##SUF ni = __builtin_convertvector(n, att_i_##SUF);                          \
		att_i_##SUF n1 = ni >> 1, n2 = ni - n1;                                            \
		att_v_##SUF s1 = (att_v_##SUF)((n1 + 127) << 23);                                  \
		att_v_##SUF s2 = (att_v_##SUF)((n2 + 127) << 23);                                  \
		return p * s1 * s2;                                                                \
	}                                                                                          \
                                                                                                   \
	/* S^T rows j0 .. j0 + SMR (key rows kr[]) x queries [i0, i0 + 2 VW), and  \
	 * bm[0, 2 VW) = max(bm, those rows) (NaN left to the exps: it reaches l)  \
	 */                                                                        \
	TGT static inline __attribute__((always_inline)) void att_st_##SUF(                        \
	        const float *const *kr, const float *qt, int64_t ldq, int64_t d, float *st,        \
	        int64_t ldst, float *bm)                                                           \
	{                                                                                          \
		att_v_##SUF a[SMR][2];                                                             \
		_Pragma("GCC unroll 8") for (int r = 0; r < SMR; r++)                              \
		{                                                                                  \
			a[r][0] = (att_v_##SUF){0};                                                \
			a[r][1] = (att_v_##SUF){0};                                                \
		}                                                                                  \
		for (int64_t c = 0; c < d; c++) {                                                  \
			att_v_##SUF x0, x1;                                                        \
			memcpy(&x0, qt + c * ldq, sizeof x0);                                      \
			memcpy(&x1, qt + c * ldq + VW, sizeof x1);                                 \
			_Pragma("GCC unroll 8") for (int r = 0; r < SMR; r++)                      \
			{                                                                          \
				float kv = kr[r][c];                                               \
				a[r][0] += kv * x0;                                                \
				a[r][1] += kv * x1;                                                \
			}                                                                          \
		}                                                                                  \
		att_v_##SUF m0, m1;                                                                \
		memcpy(&m0, bm, sizeof m0);                                                        \
		memcpy(&m1, bm + VW, sizeof m1);                                                   \
		_Pragma("GCC unroll 8") for (int r = 0; r < SMR; r++)                              \
		{                                                                                  \
			memcpy(st + r * ldst, &a[r][0], sizeof a[r][0]);                           \
			memcpy(st + r * ldst + VW, &a[r][1], sizeof a[r][1]);                      \
			m0 = att_max_##SUF(a[r][0], m0);                                           \
			m1 = att_max_##SUF(a[r][1], m1);                                           \
		}                                                                                  \
		memcpy(bm, &m0, sizeof m0);                                                        \
		memcpy(bm + VW, &m1, sizeof m1);                                                   \
	}                                                                                          \
                                                                                                   \
	/* O rows i0 .. i0 + PMR, columns [c0, c0 + 2 VW): O = O corr + P V over nk  \
	 * keys, P read down S^T's columns */                                         \
	TGT static inline __attribute__((always_inline)) void att_pv_##SUF(                        \
	        float *o, int64_t ldo, const float *corr, const float *p, int64_t ldp,             \
	        const float *v, int64_t ldv, int64_t nk)                                           \
	{                                                                                          \
		att_v_##SUF a[PMR][2];                                                             \
		_Pragma("GCC unroll 8") for (int r = 0; r < PMR; r++)                              \
		{                                                                                  \
			memcpy(&a[r][0], o + r * ldo, sizeof a[r][0]);                             \
			memcpy(&a[r][1], o + r * ldo + VW, sizeof a[r][1]);                        \
			a[r][0] *= corr[r];                                                        \
			a[r][1] *= corr[r];                                                        \
		}                                                                                  \
		for (int64_t j = 0; j < nk; j++) {                                                 \
			att_v_##SUF x0, x1;                                                        \
			memcpy(&x0, v + j * ldv, sizeof x0);                                       \
			memcpy(&x1, v + j * ldv + VW, sizeof x1);                                  \
			_Pragma("GCC unroll 8") for (int r = 0; r < PMR; r++)                      \
			{                                                                          \
				float pv = p[j * ldp + r];                                         \
				a[r][0] += pv * x0;                                                \
				a[r][1] += pv * x1;                                                \
			}                                                                          \
		}                                                                                  \
		_Pragma("GCC unroll 8") for (int r = 0; r < PMR; r++)                              \
		{                                                                                  \
			memcpy(o + r * ldo, &a[r][0], sizeof a[r][0]);                             \
			memcpy(o + r * ldo + VW, &a[r][1], sizeof a[r][1]);                        \
		}                                                                                  \
	}                                                                                          \
                                                                                                   \
	TGT static void att_item_##SUF(const attn_job *job, const att_buf *w, int64_t t)           \
	{                                                                                          \
		const kl_attn_step *a = job->a;                                                    \
		kl_dtype dt = job->dt;                                                             \
		int64_t nqb = (a->tq + ATT_BQ - 1) / ATT_BQ, nqp = w->nqp, dvp = w->dvp;           \
		int64_t D = a->d, DV = a->dv;                                                      \
		int64_t b = t / nqb, q0 = (t % nqb) * ATT_BQ;                                      \
		int64_t nq = a->tq - q0 < ATT_BQ ? a->tq - q0 : ATT_BQ;                            \
		int64_t qo = a->q_off + kl__attn_batch_off(a, a->q_bs, b),                         \
		        ko = a->k_off + kl__attn_batch_off(a, a->k_bs, b),                         \
		        vo = a->v_off + kl__attn_batch_off(a, a->v_bs, b),                         \
		        oo = kl__attn_batch_off(a, a->o_bs, b);                                    \
		int64_t end = a->tk; /* the item's keys end here */                                \
		if (job->lens)                                                                     \
			end = kl__attn_len_at(a, job->lens, b / job->len_div);                     \
		int64_t lag = end - a->tq;                                                         \
		/* Q^T scaled, its padding columns 0 */                                            \
		float *qt = w->qt, *st = w->st, *o = w->o, *m = w->m, *l = w->l;                   \
		float scale = (float)(a->scale * ATT_LOG2E); /* scores in base 2 */                \
		if (!(dt == KL_F32 && a->q_cs == 1 &&                                              \
		      QPACK(qt, nqp, at(job->q, dt, qo + q0 * a->q_rs), a->q_rs, nq, D, scale))) {  \
			memset(qt, 0, sizeof(float) * (size_t)(D * nqp));                          \
			for (int64_t i = 0; i < nq; i++) {                                         \
				float *row = w->k; /* free until the key loop */                   \
				kl__cpu_load_f32(row, at(job->q, dt, qo + (q0 + i) * a->q_rs), dt,  \
				                 a->q_cs, D);                                      \
				for (int64_t c = 0; c < D; c++)                                    \
					qt[c * nqp + i] = row[c] * scale;                          \
			}                                                                          \
		}                                                                                  \
		memset(o, 0, sizeof(float) * (size_t)(nqp * dvp));                                 \
		for (int64_t i = 0; i < nqp; i++) {                                                \
			m[i] = -INFINITY;                                                          \
			l[i] = 0;                                                                  \
		}                                                                                  \
		/* keys past the last row's limit are masked for every row */                      \
		int64_t kend = end;                                                                \
		if (a->causal && q0 + nq + lag < kend)                                             \
			kend = q0 + nq + lag > 0 ? q0 + nq + lag : 0;                              \
		bool k_in_place = dt == KL_F32 && a->k_cs == 1;                                    \
		bool v_in_place = dt == KL_F32 && a->v_cs == 1 && dvp == DV;                       \
		for (int64_t k0 = 0; k0 < kend; k0 += (BK)) {                                      \
			int64_t nk = kend - k0 < (BK) ? kend - k0 : (BK);                          \
			const float *kb = w->k, *vb = w->v;                                        \
			int64_t ldk = D, ldv = dvp;                                                \
			if (k_in_place) {                                                          \
				kb = at(job->k, dt, ko + k0 * a->k_rs);                            \
				ldk = a->k_rs;                                                     \
			} else {                                                                   \
				for (int64_t j = 0; j < nk; j++)                                   \
					kl__cpu_load_f32(w->k + j * D,                             \
					                 at(job->k, dt, ko + (k0 + j) * a->k_rs),  \
					                 dt, a->k_cs, D);                          \
			}                                                                          \
			if (v_in_place) {                                                          \
				vb = at(job->v, dt, vo + k0 * a->v_rs);                            \
				ldv = a->v_rs;                                                     \
			} else {                                                                   \
				for (int64_t j = 0; j < nk; j++) {                                 \
					float *vr = w->v + j * dvp;                                \
					kl__cpu_load_f32(vr, at(job->v, dt, vo + (k0 + j) * a->v_rs), \
					                 dt, a->v_cs, DV);                         \
					for (int64_t c = DV; c < dvp; c++)                         \
						vr[c] = 0;                                         \
				}                                                                  \
			}                                                                          \
			/* S^T = K Q^T scale, SMR keys at a time (the last block's           \
			 * missing rows repeat its last key and are never read), and per     \
			 * query the block's max */                                          \
			float *bm = w->bm, *msub = w->msub, *corr = w->corr;                       \
			for (int64_t i = 0; i < nqp; i++)                                          \
				bm[i] = -INFINITY;                                                 \
			for (int64_t j0 = 0; j0 < nk; j0 += SMR) {                                 \
				const float *kr[SMR];                                              \
				for (int r = 0; r < SMR; r++)                                      \
					kr[r] = kb + (j0 + r < nk ? j0 + r : nk - 1) * ldk;        \
				for (int64_t i0 = 0; i0 < nqp; i0 += 2 * VW)                       \
					att_st_##SUF(kr, qt + i0, nqp, D, st + j0 * nqp + i0, nqp, \
					             bm + i0);                                     \
			}                                                                          \
			/* causal: query i sees key k0 + j from i = k0 + j - lag - q0; a    \
			 * block that crosses the diagonal is masked and its max taken again */ \
			if (a->causal && k0 + nk - 1 - lag - q0 > 0) {                             \
				for (int64_t i = 0; i < nqp; i++)                                  \
					bm[i] = -INFINITY;                                         \
				for (int64_t j = 0; j < nk; j++) {                                 \
					float *sj = st + j * nqp;                                  \
					int64_t from = k0 + j - lag - q0;                          \
					from = from < 0 ? 0 : from > nqp ? nqp : from;             \
					for (int64_t i = 0; i < from; i++)                         \
						sj[i] = -INFINITY;                                 \
					_Pragma("omp simd") for (int64_t i = 0; i < nqp; i++)      \
						bm[i] = sj[i] > bm[i] ? sj[i] : bm[i];             \
				}                                                                  \
			}                                                                          \
			/* the new max; a query with no allowed key yet subtracts 0, so     \
			 * that its exps are 0 (not NaN) and its O and l stay 0 */            \
			_Pragma("omp simd") for (int64_t i = 0; i < nqp; i++)                      \
			{                                                                          \
				float mx = bm[i] > m[i] ? bm[i] : m[i];                            \
				float sub = mx == -INFINITY ? 0.0f : mx;                           \
				corr[i] = kl__cpu_expf((m[i] - sub) * ATT_LN2);                    \
				m[i] = mx;                                                         \
				msub[i] = sub;                                                     \
				bm[i] = 0; /* now the block's sum */                              \
			}                                                                          \
			for (int64_t i0 = 0; i0 < nqp; i0 += VW) {                                 \
				att_v_##SUF ms, sum = {0};                                         \
				memcpy(&ms, msub + i0, sizeof ms);                                 \
				for (int64_t j = 0; j < nk; j++) {                                 \
					att_v_##SUF x;                                             \
					memcpy(&x, st + j * nqp + i0, sizeof x);                   \
					x = EXP2(x - ms);                                          \
					memcpy(st + j * nqp + i0, &x, sizeof x);                   \
					sum += x;                                                  \
				}                                                                  \
				memcpy(bm + i0, &sum, sizeof sum);                                 \
			}                                                                          \
			_Pragma("omp simd") for (int64_t i = 0; i < nqp; i++) l[i] =               \
			        l[i] * corr[i] + bm[i];                                            \
			/* O = O corr + P V */                                                     \
			for (int64_t i0 = 0; i0 < nqp; i0 += PMR)                                  \
				for (int64_t c0 = 0; c0 < dvp; c0 += 2 * VW)                       \
					att_pv_##SUF(o + i0 * dvp + c0, dvp, corr + i0, st + i0,   \
					             nqp, vb + c0, ldv, nk);                       \
		}                                                                                  \
		for (int64_t i = 0; i < nq; i++) {                                                 \
			float *oi = o + i * dvp;                                                   \
			float li = l[i];                                                           \
			if (li > 0) { /* times 1 / l: a division a vector was 2% */                \
				float inv = 1.0f / li;                                             \
				_Pragma("omp simd") for (int64_t c = 0; c < DV; c++) oi[c] *= inv; \
			} else {                                                                   \
				for (int64_t c = 0; c < DV; c++)                                   \
					oi[c] = job->lens ? 0.0f : NAN;                            \
			}                                                                          \
			STORE_F32(at(job->o, dt, oo + (q0 + i) * a->o_rs), dt, 1, oi, DV);         \
		}                                                                                  \
	}                                                                                          \
                                                                                                   \
	static void att_chunk_##SUF(void *arg, int64_t lo, int64_t hi)                             \
	{                                                                                          \
		attn_job *job = arg;                                                               \
		att_buf w;                                                                         \
		if (!att_buf_new(&w, job->a, 2 * VW, SMR, BK)) {                                       \
			atomic_store(&job->ok, false);                                             \
			return;                                                                    \
		}                                                                                  \
		for (int64_t t = lo; t < hi; t++)                                                  \
			att_item_##SUF(job, &w, t);                                                \
		free(w.qt);                                                                        \
	}

static bool att_buf_new(att_buf *w, const kl_attn_step *a, int64_t qv, int64_t smr, int64_t kb)
{
	int64_t nq = a->tq < ATT_BQ ? a->tq : ATT_BQ;
	w->nqp = ATT_ROUND(nq, qv);
	w->dvp = ATT_ROUND(a->dv, qv);
	int64_t bk = ATT_ROUND(kb, smr), nqp = w->nqp;
	size_t n = (size_t)(a->d * nqp + kb * a->d + kb * w->dvp + bk * nqp +
	                    nqp * w->dvp + 6 * nqp);
	float *p = malloc(sizeof(float) * n);
	if (!p)
		return false;
	w->qt = p;
	w->k = w->qt + a->d * nqp;
	w->v = w->k + kb * a->d;
	w->st = w->v + kb * w->dvp;
	w->o = w->st + bk * nqp;
	w->m = w->o + nqp * w->dvp;
	w->l = w->m + nqp;
	w->msub = w->l + nqp;
	w->corr = w->msub + nqp;
	w->bm = w->corr + nqp;
	return true;
}

/* Q^T (ld nqp) = the nq x d f32 rows at q (row stride rs) times scale, where
 * an instruction set has a transposing packer and the sizes suit it; false:
 * not done */
static inline bool att_qpack_none(float *qt, int64_t nqp, const void *q, int64_t rs, int64_t nq,
                                  int64_t d, float scale)
{
	(void)qt, (void)nqp, (void)q, (void)rs, (void)nq, (void)d, (void)scale;
	return false;
}

#define ATT_LOG2E 1.4426950408889634
#define ATT_LN2 0.693147180559945309f

#if defined(__x86_64__)
#define ATT_X86 1
#include <immintrin.h>

/* 2^x as att_exp2g's, n and 2^n by AVX-512's round and scale (x clamped at
 * -160 so that f stays finite; NaN passes: max returns its second operand) */
__attribute__((target("avx512f,avx512vl,avx2,fma"))) static inline
        __attribute__((always_inline)) __m512
        att_exp2_avx512(__m512 x)
{
	x = _mm512_max_ps(_mm512_set1_ps(-160.0f), x);
	__m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m512 f = _mm512_sub_ps(x, n);
	__m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(1.327647129e-3f), _mm512_set1_ps(9.675541893e-3f));
	p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713092e-2f));
	p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402212024e-1f));
	p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469440e-1f));
	p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000119f));
	return _mm512_scalef_ps(p, n);
}
/* AVX-512: 16 x 16 tiles transposed in registers (the scalar packer's
 * element-wise stores down Q^T's columns were 3% of the kernel): per 128-bit
 * lane, unpack and shuffle_ps make 4 x 4 transposes (u[4g + k], lane L:
 * column 4L + k of rows 4g .. 4g + 3), and two rounds of shuffle_f32x4
 * gather each column's four lanes */
__attribute__((target("avx512f,avx512vl,avx2,fma"))) static bool
att_qpack_avx512(float *qt, int64_t nqp, const void *q, int64_t rs, int64_t nq, int64_t d,
                 float scale)
{
	if (nq != nqp || nq % 16 || d % 16)
		return false;
	const float *src = q;
	__m512 sc = _mm512_set1_ps(scale);
	for (int64_t i0 = 0; i0 < nq; i0 += 16)
		for (int64_t c0 = 0; c0 < d; c0 += 16) {
			__m512 t[16], u[16];
			for (int r = 0; r < 16; r += 2) {
				__m512 x = _mm512_loadu_ps(src + (i0 + r) * rs + c0);
				__m512 y = _mm512_loadu_ps(src + (i0 + r + 1) * rs + c0);
				t[r] = _mm512_unpacklo_ps(x, y);
				t[r + 1] = _mm512_unpackhi_ps(x, y);
			}
			for (int g = 0; g < 4; g++) {
				__m512 a0 = t[4 * g], b0 = t[4 * g + 1], c = t[4 * g + 2], e = t[4 * g + 3];
				u[4 * g + 0] = _mm512_shuffle_ps(a0, c, 0x44);
				u[4 * g + 1] = _mm512_shuffle_ps(a0, c, 0xEE);
				u[4 * g + 2] = _mm512_shuffle_ps(b0, e, 0x44);
				u[4 * g + 3] = _mm512_shuffle_ps(b0, e, 0xEE);
			}
			for (int k = 0; k < 4; k++) {
				__m512 xl = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
				__m512 xh = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
				__m512 yl = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
				__m512 yh = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
				float *col = qt + (c0 + k) * nqp + i0;
				_mm512_storeu_ps(col, _mm512_mul_ps(_mm512_shuffle_f32x4(xl, yl, 0x88), sc));
				_mm512_storeu_ps(col + 4 * nqp,
				                 _mm512_mul_ps(_mm512_shuffle_f32x4(xh, yh, 0x88), sc));
				_mm512_storeu_ps(col + 8 * nqp,
				                 _mm512_mul_ps(_mm512_shuffle_f32x4(xl, yl, 0xDD), sc));
				_mm512_storeu_ps(col + 12 * nqp,
				                 _mm512_mul_ps(_mm512_shuffle_f32x4(xh, yh, 0xDD), sc));
			}
		}
	return true;
}

ATT_F32_ISA(v4, __attribute__((target("avx512f,avx512vl,avx2,fma"))), 16, 8, 8, 128,
            att_exp2_avx512, att_qpack_avx512)
ATT_F32_ISA(v3, __attribute__((target("avx2,fma"))), 8, 4, 4, 32, att_exp2g_v3, att_qpack_none)
#endif
ATT_F32_ISA(base, , 4, 4, 4, 32, att_exp2g_base, att_qpack_none)

static bool run_f32v(const kl_attn_step *a, kl_dtype dt, const void *Q, const void *K,
                     const void *V, const void *L, void *O)
{
	int64_t nb = 1;
	for (int i = 0; i < a->nbatch; i++)
		nb *= a->batch[i];
	attn_job j = {.a = a, .dt = dt, .q = Q, .k = K, .v = V, .lens = L, .o = O,
	              .len_div = kl__attn_len_div(a), .ok = true};
	/* the widest the CPU has; KILN_ATTENTION_KERNEL=avx2|base forces a
	 * narrower one (the tests run each) */
	const char *force = getenv("KILN_ATTENTION_KERNEL");
	void (*chunk)(void *, int64_t, int64_t) = att_chunk_base;
	(void)force;
#ifdef ATT_X86
	bool base = force && !strcmp(force, "base");
	bool avx2 = force && !strcmp(force, "avx2");
	bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
	if (!base && !avx2 && has_avx2 && __builtin_cpu_supports("avx512f") &&
	    __builtin_cpu_supports("avx512vl"))
		chunk = att_chunk_v4;
	else if (!base && has_avx2)
		chunk = att_chunk_v3;
#endif
	kl__par_for_call(nb * ((a->tq + ATT_BQ - 1) / ATT_BQ), chunk, &j);
	return atomic_load(&j.ok);
}
#endif /* ATT_VEC */

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
	if (dt == KL_F64)
		return run_f64(a, dt, q, k, v, lens, o);
#ifdef ATT_VEC
	return run_f32v(a, dt, q, k, v, lens, o);
#else
	return run_f32(a, dt, q, k, v, lens, o);
#endif
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
