/* convert.c - CPU backend plumbing shared by every kernel family: strided
 * loads of any dtype into a dense compute-type chunk and stores back, dim
 * coalescing, the thread count.
 */
#include "backend/cpu/cpu.h"

int kl__cpu_threads(const kl_ctx *ctx)
{
	int nt = ctx ? ctx->nthreads : 0;
	if (nt <= 0)
		nt = kl__cpu_cores();
	return nt > 0 ? nt : 1;
}

const char *kl__cpu_opname(const kl_node *n)
{
	return n->op < KL_NOPS ? kl__ops[n->op].name : "?";
}

/* The loop over i in [0, n) of every conversion. Strided access is spelled
 * i * st_; a unit stride gets its own copy of the loop with st_ a constant
 * 1, which vectorizes as plain vector loads instead of gathers. */
#define KL_STRIDED_LOOP(STRIDE, BODY)                                                          \
	do {                                                                                   \
		if ((STRIDE) == 1) {                                                           \
			const int64_t st_ = 1;                                                 \
			KL_SIMD                                                                \
			for (int64_t i = 0; i < n; i++)                                        \
				BODY;                                                          \
		} else {                                                                       \
			const int64_t st_ = (STRIDE);                                          \
			KL_SIMD                                                                \
			for (int64_t i = 0; i < n; i++)                                        \
				BODY;                                                          \
		}                                                                              \
	} while (0)

/* One loop per source dtype; CONV turns the loaded value v (a float, double
 * or int64_t) into the destination type. */
#define KL_LOAD_CASES(CONV)                                                                    \
	switch (dt) {                                                                          \
	case KL_F32:                                                                           \
		KL_STRIDED_LOOP(stride, {                                                      \
			float v = ((const float *)src)[i * st_];                               \
			dst[i] = CONV;                                                         \
		});                                                                            \
		break;                                                                         \
	case KL_F64:                                                                           \
		KL_STRIDED_LOOP(stride, {                                                      \
			double v = ((const double *)src)[i * st_];                             \
			dst[i] = CONV;                                                         \
		});                                                                            \
		break;                                                                         \
	case KL_F16:                                                                           \
		KL_STRIDED_LOOP(stride, {                                                      \
			float v = kl__f16_to_f32(((const uint16_t *)src)[i * st_]);               \
			dst[i] = CONV;                                                         \
		});                                                                            \
		break;                                                                         \
	case KL_BF16:                                                                          \
		KL_STRIDED_LOOP(stride, {                                                      \
			float v = kl__bf16_to_f32(((const uint16_t *)src)[i * st_]);               \
			dst[i] = CONV;                                                         \
		});                                                                            \
		break;                                                                         \
	case KL_I32:                                                                           \
		KL_STRIDED_LOOP(stride, {                                                      \
			int64_t v = ((const int32_t *)src)[i * st_];                           \
			dst[i] = CONV;                                                         \
		});                                                                            \
		break;                                                                         \
	case KL_I64:                                                                           \
		KL_STRIDED_LOOP(stride, {                                                      \
			int64_t v = ((const int64_t *)src)[i * st_];                           \
			dst[i] = CONV;                                                         \
		});                                                                            \
		break;                                                                         \
	case KL_BOOL:                                                                          \
		KL_STRIDED_LOOP(stride, {                                                      \
			int64_t v = ((const uint8_t *)src)[i * st_] != 0;                      \
			dst[i] = CONV;                                                         \
		});                                                                            \
		break;                                                                         \
	default:                                                                               \
		break;                                                                         \
	}

/* Dense f16 <-> f32 by the F16C instructions (vcvtph2ps, vcvtps2ph rounding
 * to nearest even: half.h's values, but for a signalling NaN's quiet bit),
 * 8 a time, where the CPU has them (x86-64-v3; GCC's target attribute, as
 * gemm_small.c): the f16 products' operand copies and the eager kernels'
 * chunks, which the branch-free conversions left at 2-3x f32's time. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#define KL_F16C 1

__attribute__((target("arch=x86-64-v3"))) static void f16c_load(float *dst, const uint16_t *src,
                                                                int64_t n)
{
	int64_t i = 0;
	for (; i + 8 <= n; i += 8)
		_mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
	for (; i < n; i++)
		dst[i] = kl__f16_to_f32(src[i]);
}

__attribute__((target("arch=x86-64-v3"))) static void f16c_store(uint16_t *dst, const float *src,
                                                                 int64_t n)
{
	int64_t i = 0;
	for (; i + 8 <= n; i += 8)
		_mm_storeu_si128((__m128i *)(dst + i),
		                 _mm256_cvtps_ph(_mm256_loadu_ps(src + i),
		                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
	for (; i < n; i++)
		dst[i] = kl__f32_to_f16(src[i]);
}

static bool has_f16c(void)
{
	static int v = -1; /* a race stores the same value twice */
	int h = __atomic_load_n(&v, __ATOMIC_RELAXED);
	if (h < 0) {
		__builtin_cpu_init();
		h = __builtin_cpu_supports("x86-64-v3") != 0;
		__atomic_store_n(&v, h, __ATOMIC_RELAXED);
	}
	return h;
}
#endif

void kl__cpu_load_f32(float *dst, const void *src, kl_dtype dt, int64_t stride, int64_t n)
{
#ifdef KL_F16C
	if (dt == KL_F16 && stride == 1 && has_f16c()) {
		f16c_load(dst, src, n);
		return;
	}
#endif
	KL_LOAD_CASES((float)v);
}

void kl__cpu_load_f64(double *dst, const void *src, kl_dtype dt, int64_t stride, int64_t n)
{
	KL_LOAD_CASES((double)v);
}

/* floats reach int64 only through casts and odd mixes: saturate like kl__store */
#define KL_TO_I64(v)                                \
	(_Generic((v), float                        \
	          : kl__f2i64((double)(v)), double  \
	          : kl__f2i64((double)(v)), default \
	          : (int64_t)(v)))

void kl__cpu_load_i64(int64_t *dst, const void *src, kl_dtype dt, int64_t stride, int64_t n)
{
	KL_LOAD_CASES(KL_TO_I64(v));
}

void kl__cpu_load_ct(kl_cpu_ct ct, void *dst, const void *src, kl_dtype dt, int64_t stride,
                     int64_t n)
{
	if (ct == KL_CT_F32)
		kl__cpu_load_f32(dst, src, dt, stride, n);
	else if (ct == KL_CT_F64)
		kl__cpu_load_f64(dst, src, dt, stride, n);
	else
		kl__cpu_load_i64(dst, src, dt, stride, n);
}

/* One loop per destination dtype; the source value is src[i]. Float to
 * integer saturates, integer to i32 wraps, anything to bool is v != 0. */
#define KL_STORE_CASES(TO_I64, TO_I32, TO_F16, TO_BF16)                                        \
	switch (dt) {                                                                          \
	case KL_F32:                                                                           \
		KL_STRIDED_LOOP(stride, ((float *)dst)[i * st_] = (float)src[i]);              \
		break;                                                                         \
	case KL_F64:                                                                           \
		KL_STRIDED_LOOP(stride, ((double *)dst)[i * st_] = (double)src[i]);            \
		break;                                                                         \
	case KL_F16:                                                                           \
		KL_STRIDED_LOOP(stride, ((uint16_t *)dst)[i * st_] = TO_F16(src[i]));          \
		break;                                                                         \
	case KL_BF16:                                                                          \
		KL_STRIDED_LOOP(stride, ((uint16_t *)dst)[i * st_] = TO_BF16(src[i]));         \
		break;                                                                         \
	case KL_I32:                                                                           \
		KL_STRIDED_LOOP(stride, ((int32_t *)dst)[i * st_] = TO_I32(src[i]));           \
		break;                                                                         \
	case KL_I64:                                                                           \
		KL_STRIDED_LOOP(stride, ((int64_t *)dst)[i * st_] = TO_I64(src[i]));           \
		break;                                                                         \
	case KL_BOOL:                                                                          \
		KL_STRIDED_LOOP(stride, ((uint8_t *)dst)[i * st_] = src[i] != 0);              \
		break;                                                                         \
	default:                                                                               \
		break;                                                                         \
	}

void kl__cpu_store_f32(void *dst, kl_dtype dt, int64_t stride, const float *src, int64_t n)
{
#ifdef KL_F16C
	if (dt == KL_F16 && stride == 1 && has_f16c()) {
		f16c_store(dst, src, n);
		return;
	}
#endif
	KL_STORE_CASES(kl__f2i64, kl__f2i32, kl__f32_to_f16, kl__f32_to_bf16);
}

void kl__cpu_store_f64(void *dst, kl_dtype dt, int64_t stride, const double *src, int64_t n)
{
	KL_STORE_CASES(kl__f2i64, kl__f2i32, kl__f64_to_f16, kl__f64_to_bf16);
}

#define KL_ID_I64(v) (v)
#define KL_I64_F16(v) kl__f64_to_f16((double)(v))
#define KL_I64_BF16(v) kl__f64_to_bf16((double)(v))

void kl__cpu_store_i64(void *dst, kl_dtype dt, int64_t stride, const int64_t *src, int64_t n)
{
	/* int64 -> f16 rounds once, through double (exact below 2^53) */
	KL_STORE_CASES(KL_ID_I64, kl__cpu_wrap_i32, KL_I64_F16, KL_I64_BF16);
}

void kl__cpu_store_ct(kl_cpu_ct ct, void *dst, kl_dtype dt, int64_t stride, const void *src,
                      int64_t n)
{
	if (ct == KL_CT_F32)
		kl__cpu_store_f32(dst, dt, stride, src, n);
	else if (ct == KL_CT_F64)
		kl__cpu_store_f64(dst, dt, stride, src, n);
	else
		kl__cpu_store_i64(dst, dt, stride, src, n);
}

int kl__cpu_coalesce(int ndim, int64_t *shape, int nops, int64_t (*st)[KL_MAX_DIMS])
{
	int nd = 0;
	for (int d = 0; d < ndim; d++) {
		if (shape[d] == 1)
			continue;
		if (nd > 0) {
			/* dim d continues dim nd-1 for every operand: merge */
			bool merge = true;
			for (int k = 0; k < nops; k++)
				if (st[k][nd - 1] != st[k][d] * shape[d])
					merge = false;
			if (merge) {
				shape[nd - 1] *= shape[d];
				for (int k = 0; k < nops; k++)
					st[k][nd - 1] = st[k][d];
				continue;
			}
		}
		shape[nd] = shape[d];
		for (int k = 0; k < nops; k++)
			st[k][nd] = st[k][d];
		nd++;
	}
	if (nd == 0) {
		shape[0] = 1;
		for (int k = 0; k < nops; k++)
			st[k][0] = 0;
		nd = 1;
	}
	return nd;
}
