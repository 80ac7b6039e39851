/* pointwise.c - CPU eager kernels for the pointwise ops (binary, compare,
 * unary, where, cast, clamp) over operands of any dtype and any strides.
 *
 * One engine serves all of them: dims are coalesced, the output is walked in
 * chunks along its innermost dim, each operand chunk is either read in place
 * (contiguous and already in the compute type), a scalar (stride 0), or
 * converted into a stack buffer; the op then runs as a tight loop over
 * plain arrays that the compiler vectorizes.
 */
#include <math.h>
#include <stdatomic.h>

#include "backend/cpu/cpu.h"
#include "graph/optable.h"

/* glibc's vector math (libmvec, from 2.22 on x86-64; -lm brings it in as
 * needed): declared simd, the loops below call its 8- and 16-lane logf,
 * sinf and cosf in each target clone, where they called the scalar ones
 * per element (4096^2 f32 on 2 threads: log 56.7 ms, sin 74.4 ms). Within
 * 4 ulp (glibc's manual), as the float64 reference in the tests allows. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__)
#if __GLIBC_PREREQ(2, 22)
#pragma omp declare simd notinbranch
float logf(float);
#pragma omp declare simd notinbranch
float sinf(float);
#pragma omp declare simd notinbranch
float cosf(float);
#endif
#endif

#define CHUNK KL_CPU_CHUNK

static const double kl_sqrt1_2 = 0.70710678118654752440;
static const double kl_sqrt2_pi = 0.79788456080286535588; /* sqrt(2/pi) */

typedef struct pw_plan {
	kl_op op;
	kl_cpu_ct ct;     /* what the op computes in */
	kl_cpu_ct in_ct;  /* compare: what the operands are compared in */
	int nin;          /* tensor operands */
	int ndim;
	int64_t shape[KL_MAX_DIMS];
	int64_t st[3][KL_MAX_DIMS]; /* operand strides (the output is dense) */
	const char *base[3];
	kl_dtype dt[3];
	size_t es[3];
	char *out;
	kl_dtype odt;
	size_t oes;
	bool rhs_scalar; /* binary/compare with attrs.s[0] as rhs */
	const kl_attrs *at;
	kl_attrs at0; /* zero attributes, for the epilogue entry points */
	float sf[2];     /* attrs scalars in each compute type */
	double sd[2];
	int64_t si[2];
} pw_plan;

/* An operand's chunk: a pointer to n values of the compute type, or to one
 * value when the operand does not move along the chunk. */
typedef struct pw_val {
	const void *p;
	bool scalar;
} pw_val;

typedef union pw_buf {
	float f[CHUNK];
	double d[CHUNK];
	int64_t i[CHUNK];
	uint8_t b[CHUNK];
} pw_buf;

static pw_val pw_fetch(const pw_plan *w, int k, kl_cpu_ct ct, int64_t off, int64_t stride,
                       int64_t n, pw_buf *buf)
{
	const char *p = w->base[k] + off * (int64_t)w->es[k];
	if (stride == 0) {
		kl__cpu_load_ct(ct, buf, p, w->dt[k], 0, 1);
		return (pw_val){buf, true};
	}
	if (stride == 1 && w->dt[k] == kl__cpu_ct_dtype(ct))
		return (pw_val){p, false};
	kl__cpu_load_ct(ct, buf, p, w->dt[k], stride, n);
	return (pw_val){buf, false};
}

/* where's condition as bytes, nonzero meaning true */
static pw_val pw_fetch_mask(const pw_plan *w, int64_t off, int64_t stride, int64_t n,
                            pw_buf *buf)
{
	const char *p = w->base[0] + off * (int64_t)w->es[0];
	if (w->dt[0] == KL_BOOL && stride == 1)
		return (pw_val){p, false};
	int64_t m = stride == 0 ? 1 : n;
	switch (w->dt[0]) {
	case KL_BOOL:
		for (int64_t i = 0; i < m; i++)
			buf->b[i] = ((const uint8_t *)p)[i * stride] != 0;
		break;
	case KL_I32:
		for (int64_t i = 0; i < m; i++)
			buf->b[i] = ((const int32_t *)p)[i * stride] != 0;
		break;
	case KL_I64:
		for (int64_t i = 0; i < m; i++)
			buf->b[i] = ((const int64_t *)p)[i * stride] != 0;
		break;
	case KL_F64:
		for (int64_t i = 0; i < m; i++)
			buf->b[i] = ((const double *)p)[i * stride] != 0;
		break;
	default: {
		/* f32, f16, bf16: NaN is nonzero, so it selects in[1] */
		float tmp[CHUNK];
		kl__cpu_load_f32(tmp, p, w->dt[0], stride, m);
		for (int64_t i = 0; i < m; i++)
			buf->b[i] = tmp[i] != 0;
		break;
	}
	}
	return (pw_val){buf, stride == 0};
}

/* ---- binary ----------------------------------------------------------------- */

/* The four broadcast shapes of a binary chunk; EXPR uses a and b. */
#define BIN_LOOP(T, OT, EXPR)                                                                  \
	do {                                                                                   \
		const T *A_ = A.p, *B_ = B.p;                                                  \
		OT *O_ = O;                                                                    \
		if (A.scalar && B.scalar) {                                                    \
			T a = A_[0], b = B_[0];                                                \
			OT r_ = (OT)(EXPR);                                                    \
			KL_SIMD                                                         \
			for (int64_t i = 0; i < n; i++)                                        \
				O_[i] = r_;                                                    \
		} else if (A.scalar) {                                                         \
			T a = A_[0];                                                           \
			KL_SIMD                                                         \
			for (int64_t i = 0; i < n; i++) {                                      \
				T b = B_[i];                                                   \
				O_[i] = (OT)(EXPR);                                            \
			}                                                                      \
		} else if (B.scalar) {                                                         \
			T b = B_[0];                                                           \
			KL_SIMD                                                         \
			for (int64_t i = 0; i < n; i++) {                                      \
				T a = A_[i];                                                   \
				O_[i] = (OT)(EXPR);                                            \
			}                                                                      \
		} else {                                                                       \
			KL_SIMD                                                         \
			for (int64_t i = 0; i < n; i++) {                                      \
				T a = A_[i], b = B_[i];                                        \
				O_[i] = (OT)(EXPR);                                            \
			}                                                                      \
		}                                                                              \
	} while (0)

/* NaN-propagating max/min (torch.maximum): a NaN on either side wins */
#define KL_FMAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define KL_FMIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))

static bool bin_f32(kl_op op, pw_val A, pw_val B, float *restrict O, int64_t n)
{
	switch (op) {
	case KL_OP_ADD: BIN_LOOP(float, float, a + b); break;
	case KL_OP_SUB: BIN_LOOP(float, float, a - b); break;
	case KL_OP_MUL: BIN_LOOP(float, float, a * b); break;
	case KL_OP_DIV: BIN_LOOP(float, float, a / b); break;
	case KL_OP_POW: BIN_LOOP(float, float, powf(a, b)); break;
	case KL_OP_MAXIMUM: BIN_LOOP(float, float, KL_FMAX(a, b)); break;
	case KL_OP_MINIMUM: BIN_LOOP(float, float, KL_FMIN(a, b)); break;
	default: return false;
	}
	return true;
}

static bool bin_f64(kl_op op, pw_val A, pw_val B, double *restrict O, int64_t n)
{
	switch (op) {
	case KL_OP_ADD: BIN_LOOP(double, double, a + b); break;
	case KL_OP_SUB: BIN_LOOP(double, double, a - b); break;
	case KL_OP_MUL: BIN_LOOP(double, double, a * b); break;
	case KL_OP_DIV: BIN_LOOP(double, double, a / b); break;
	case KL_OP_POW: BIN_LOOP(double, double, pow(a, b)); break;
	case KL_OP_MAXIMUM: BIN_LOOP(double, double, KL_FMAX(a, b)); break;
	case KL_OP_MINIMUM: BIN_LOOP(double, double, KL_FMIN(a, b)); break;
	default: return false;
	}
	return true;
}

/* Integer power by squaring, wrapping like the rest of integer arithmetic.
 * A negative exponent gives 1/base^-e truncated: only +-1 survive. */
static int64_t ipow(int64_t base, int64_t e)
{
	if (e < 0) {
		if (base == 1)
			return 1;
		if (base == -1)
			return (e & 1) ? -1 : 1;
		return 0;
	}
	uint64_t r = 1, b = (uint64_t)base;
	uint64_t ue = (uint64_t)e;
	while (ue) {
		if (ue & 1)
			r *= b;
		b *= b;
		ue >>= 1;
	}
	return (int64_t)r;
}

/* wrap-around int64 arithmetic without signed-overflow UB */
#define IADD(a, b) ((int64_t)((uint64_t)(a) + (uint64_t)(b)))
#define ISUB(a, b) ((int64_t)((uint64_t)(a) - (uint64_t)(b)))
#define IMUL(a, b) ((int64_t)((uint64_t)(a) * (uint64_t)(b)))

static kl_status bin_i64(kl_op op, pw_val A, pw_val B, int64_t *restrict O, int64_t n)
{
	switch (op) {
	case KL_OP_ADD: BIN_LOOP(int64_t, int64_t, IADD(a, b)); break;
	case KL_OP_SUB: BIN_LOOP(int64_t, int64_t, ISUB(a, b)); break;
	case KL_OP_MUL: BIN_LOOP(int64_t, int64_t, IMUL(a, b)); break;
	case KL_OP_POW: BIN_LOOP(int64_t, int64_t, ipow(a, b)); break;
	case KL_OP_MAXIMUM: BIN_LOOP(int64_t, int64_t, a > b ? a : b); break;
	case KL_OP_MINIMUM: BIN_LOOP(int64_t, int64_t, a < b ? a : b); break;
	default: return KL_EUNSUPPORTED; /* div never has an integer result */
	}
	return KL_OK;
}

#define CMP_CASES(T)                                                                           \
	switch (op) {                                                                          \
	case KL_OP_EQ: BIN_LOOP(T, uint8_t, a == b); break;                                    \
	case KL_OP_NE: BIN_LOOP(T, uint8_t, a != b); break;                                    \
	case KL_OP_LT: BIN_LOOP(T, uint8_t, a < b); break;                                     \
	case KL_OP_LE: BIN_LOOP(T, uint8_t, a <= b); break;                                    \
	case KL_OP_GT: BIN_LOOP(T, uint8_t, a > b); break;                                     \
	case KL_OP_GE: BIN_LOOP(T, uint8_t, a >= b); break;                                    \
	default: return false;                                                                 \
	}

static bool cmp_run(kl_op op, kl_cpu_ct ct, pw_val A, pw_val B, uint8_t *restrict O, int64_t n)
{
	if (ct == KL_CT_F32) {
		CMP_CASES(float)
	} else if (ct == KL_CT_F64) {
		CMP_CASES(double)
	} else {
		CMP_CASES(int64_t)
	}
	return true;
}

/* ---- unary ------------------------------------------------------------------
 * gelu and gelu_tanh avoid 1 + erf(x) and 1 + tanh(u), which cancel to
 * nothing for negative x: 1 + erf(z) = erfc(-z) and 1 + tanh(u) =
 * 2 sigmoid(2u) are the same functions, accurate on both sides. */

#define UN_LOOP(T, EXPR)                                                                       \
	do {                                                                                   \
		const T *A_ = A;                                                               \
		KL_SIMD                                                                 \
		for (int64_t i = 0; i < n; i++) {                                              \
			T a = A_[i];                                                           \
			O[i] = (EXPR);                                                         \
		}                                                                              \
	} while (0)

/* min(max(a, lo), hi) as torch.clamp: NaN stays NaN, lo > hi gives hi */
#define KL_CLAMP(a, lo, hi) ((a) != (a) ? (a) : (a) < (lo) ? ((lo) > (hi) ? (hi) : (lo)) \
                                 : (a) > (hi) ? (hi) : (a))

static inline float sigmoidf_(float a)
{
	/* exp of a non-positive argument only: no overflow at either end */
	float e = kl__cpu_expf(-fabsf(a));
	float r = 1.0f / (1.0f + e);
	return a >= 0 ? r : e * r;
}

static inline double sigmoid_(double a)
{
	double e = exp(-fabs(a));
	double r = 1.0 / (1.0 + e);
	return a >= 0 ? r : e * r;
}

KL_CPU_CLONES static bool un_f32(const pw_plan *w, const float *A, float *restrict O,
                                 int64_t n)
{
	const float c1 = (float)kl_sqrt1_2, c2 = (float)kl_sqrt2_pi;
	float lo = w->sf[0], hi = w->sf[1];
	switch (w->op) {
	case KL_OP_NEG: UN_LOOP(float, -a); break;
	case KL_OP_ABS: UN_LOOP(float, fabsf(a)); break;
	case KL_OP_EXP: UN_LOOP(float, kl__cpu_expf(a)); break;
	case KL_OP_LOG: UN_LOOP(float, logf(a)); break;
	case KL_OP_SQRT: UN_LOOP(float, sqrtf(a)); break;
	case KL_OP_RSQRT: UN_LOOP(float, 1.0f / sqrtf(a)); break;
	case KL_OP_SIN: UN_LOOP(float, sinf(a)); break;
	case KL_OP_COS: UN_LOOP(float, cosf(a)); break;
	case KL_OP_TANH: UN_LOOP(float, kl__cpu_tanhf(a)); break;
	case KL_OP_SIGMOID: UN_LOOP(float, sigmoidf_(a)); break;
	case KL_OP_RELU: UN_LOOP(float, a < 0 ? 0.0f : a); break;
	case KL_OP_GELU: UN_LOOP(float, 0.5f * a * kl__cpu_erfcf(-a * c1)); break;
	case KL_OP_GELU_TANH:
		UN_LOOP(float, a * sigmoidf_(2.0f * c2 * (a + 0.044715f * a * a * a)));
		break;
	case KL_OP_SILU: UN_LOOP(float, a * sigmoidf_(a)); break;
	case KL_OP_CAST: UN_LOOP(float, a); break;
	case KL_OP_CLAMP: UN_LOOP(float, KL_CLAMP(a, lo, hi)); break;
	default: return false;
	}
	return true;
}

static bool un_f64(const pw_plan *w, const double *A, double *restrict O, int64_t n)
{
	double lo = w->sd[0], hi = w->sd[1];
	switch (w->op) {
	case KL_OP_NEG: UN_LOOP(double, -a); break;
	case KL_OP_ABS: UN_LOOP(double, fabs(a)); break;
	case KL_OP_EXP: UN_LOOP(double, exp(a)); break;
	case KL_OP_LOG: UN_LOOP(double, log(a)); break;
	case KL_OP_SQRT: UN_LOOP(double, sqrt(a)); break;
	case KL_OP_RSQRT: UN_LOOP(double, 1.0 / sqrt(a)); break;
	case KL_OP_SIN: UN_LOOP(double, sin(a)); break;
	case KL_OP_COS: UN_LOOP(double, cos(a)); break;
	case KL_OP_TANH: UN_LOOP(double, tanh(a)); break;
	case KL_OP_SIGMOID: UN_LOOP(double, sigmoid_(a)); break;
	case KL_OP_RELU: UN_LOOP(double, a < 0 ? 0.0 : a); break;
	case KL_OP_GELU: UN_LOOP(double, 0.5 * a * erfc(-a * kl_sqrt1_2)); break;
	case KL_OP_GELU_TANH:
		UN_LOOP(double, a * sigmoid_(2.0 * kl_sqrt2_pi * (a + 0.044715 * a * a * a)));
		break;
	case KL_OP_SILU: UN_LOOP(double, a * sigmoid_(a)); break;
	case KL_OP_CAST: UN_LOOP(double, a); break;
	case KL_OP_CLAMP: UN_LOOP(double, KL_CLAMP(a, lo, hi)); break;
	default: return false;
	}
	return true;
}

static kl_status un_i64(const pw_plan *w, const int64_t *A, int64_t *restrict O, int64_t n)
{
	int64_t lo = w->si[0], hi = w->si[1];
	switch (w->op) {
	case KL_OP_NEG: UN_LOOP(int64_t, ISUB(0, a)); break;
	case KL_OP_ABS: UN_LOOP(int64_t, a < 0 ? ISUB(0, a) : a); break;
	case KL_OP_RELU: UN_LOOP(int64_t, a < 0 ? 0 : a); break;
	case KL_OP_CAST: UN_LOOP(int64_t, a); break;
	case KL_OP_CLAMP: UN_LOOP(int64_t, KL_CLAMP(a, lo, hi)); break;
	default: return KL_EUNSUPPORTED;
	}
	return KL_OK;
}

void kl__cpu_unary_f32(kl_op op, const float *a, float *restrict o, int64_t n)
{
	pw_plan w;
	memset(&w, 0, sizeof w);
	w.op = op;
	if (!un_f32(&w, a, o, n))
		for (int64_t i = 0; i < n; i++)
			o[i] = (float)kl__op_eval(op, &w.at0, KL_F32, a[i], 0, 0);
}

void kl__cpu_unary_f64(kl_op op, const double *a, double *restrict o, int64_t n)
{
	pw_plan w;
	memset(&w, 0, sizeof w);
	w.op = op;
	if (!un_f64(&w, a, o, n))
		for (int64_t i = 0; i < n; i++)
			o[i] = kl__op_eval(op, &w.at0, KL_F64, a[i], 0, 0);
}

/* ---- where ------------------------------------------------------------------ */

#define WHERE_LOOP(T)                                                                          \
	do {                                                                                   \
		const T *A_ = A.p, *B_ = B.p;                                                  \
		T *O_ = O;                                                                     \
		const uint8_t *C_ = C.p;                                                       \
		int64_t ci = C.scalar ? 0 : 1, ai = A.scalar ? 0 : 1, bi = B.scalar ? 0 : 1;   \
		/* both sides loaded unconditionally: a select, not a branch */             \
		if (!C.scalar && !A.scalar && !B.scalar) {                                     \
			KL_SIMD                                                                \
			for (int64_t i = 0; i < n; i++) {                                      \
				T a_ = A_[i], b_ = B_[i];                                      \
				O_[i] = C_[i] ? a_ : b_;                                       \
			}                                                                      \
		} else {                                                                       \
			KL_SIMD                                                                \
			for (int64_t i = 0; i < n; i++) {                                      \
				T a_ = A_[i * ai], b_ = B_[i * bi];                            \
				O_[i] = C_[i * ci] ? a_ : b_;                                  \
			}                                                                      \
		}                                                                              \
	} while (0)

static void where_run(kl_cpu_ct ct, pw_val C, pw_val A, pw_val B, void *O, int64_t n)
{
	if (ct == KL_CT_F32)
		WHERE_LOOP(float);
	else if (ct == KL_CT_F64)
		WHERE_LOOP(double);
	else
		WHERE_LOOP(int64_t);
}

/* ---- the engine --------------------------------------------------------------- */

bool kl__cpu_pw_generic_only;

/* An op the loops above do not spell: the op table's float64 math, element
 * by element, as the reference defines it (slower, never silently wrong). */
static void pw_generic(const pw_plan *w, const int64_t *off, const int64_t *inner, int64_t n,
                       char *o)
{
	double v[3][CHUNK] = {{0}}, r[CHUNK];
	for (int k = 0; k < w->nin; k++)
		kl__cpu_load_f64(v[k], w->base[k] + off[k] * (int64_t)w->es[k], w->dt[k], inner[k],
		                 n);
	for (int64_t i = 0; i < n; i++)
		r[i] = kl__op_eval(w->op, w->at, w->odt, v[0][i],
		                   w->rhs_scalar ? w->at->s[0] : v[1][i], v[2][i]);
	kl__cpu_store_f64(o, w->odt, 1, r, n);
}

/* One chunk: n output elements from operand offsets off[] (elements) with
 * innermost strides inner[]. */
static kl_status pw_chunk(const pw_plan *w, const int64_t *off, const int64_t *inner, int64_t n,
                          char *o, pw_buf *bufs)
{
	if (kl__cpu_pw_generic_only) {
		pw_generic(w, off, inner, n, o);
		return KL_OK;
	}
	kl_cpu_ct ct = w->ct;
	kl_cat cat = kl__ops[w->op].cat;
	bool direct = w->odt == kl__cpu_ct_dtype(ct);
	void *res = direct ? (void *)o : (void *)&bufs[3];
	kl_status st = KL_OK;

	if (cat == KL_CAT_COMPARE) {
		pw_val A = pw_fetch(w, 0, w->in_ct, off[0], inner[0], n, &bufs[0]);
		pw_val B;
		if (w->rhs_scalar)
			B = (pw_val){w->in_ct == KL_CT_F32 ? (const void *)&w->sf[0]
			             : w->in_ct == KL_CT_F64 ? (const void *)&w->sd[0]
			                                     : (const void *)&w->si[0],
			             true};
		else
			B = pw_fetch(w, 1, w->in_ct, off[1], inner[1], n, &bufs[1]);
		if (!cmp_run(w->op, w->in_ct, A, B, (uint8_t *)o, n))
			pw_generic(w, off, inner, n, o);
		return KL_OK;
	}
	if (cat == KL_CAT_BINARY) {
		pw_val A = pw_fetch(w, 0, ct, off[0], inner[0], n, &bufs[0]);
		pw_val B;
		if (w->rhs_scalar)
			B = (pw_val){ct == KL_CT_F32 ? (const void *)&w->sf[0]
			             : ct == KL_CT_F64 ? (const void *)&w->sd[0]
			                               : (const void *)&w->si[0],
			             true};
		else
			B = pw_fetch(w, 1, ct, off[1], inner[1], n, &bufs[1]);
		bool fast = ct == KL_CT_F32   ? bin_f32(w->op, A, B, res, n)
		            : ct == KL_CT_F64 ? bin_f64(w->op, A, B, res, n)
		                              : bin_i64(w->op, A, B, res, n) == KL_OK;
		if (!fast) {
			pw_generic(w, off, inner, n, o);
			return KL_OK;
		}
	} else if (cat == KL_CAT_WHERE) {
		pw_val C = pw_fetch_mask(w, off[0], inner[0], n, &bufs[0]);
		pw_val A = pw_fetch(w, 1, ct, off[1], inner[1], n, &bufs[1]);
		pw_val B = pw_fetch(w, 2, ct, off[2], inner[2], n, &bufs[2]);
		where_run(ct, C, A, B, res, n);
	} else if (w->op == KL_OP_CAST && direct) {
		/* the output dtype is the compute type: convert straight into it */
		kl__cpu_load_ct(ct, o, w->base[0] + off[0] * (int64_t)w->es[0], w->dt[0], inner[0],
		                n);
		return KL_OK;
	} else {
		pw_val A = pw_fetch(w, 0, ct, off[0], inner[0], n, &bufs[0]);
		if (w->op == KL_OP_CAST && ct == KL_CT_I64 && w->odt == KL_I32) {
			/* a cast narrows integers by saturating, like kl__store */
			const int64_t *a = A.p;
			int32_t *d = (int32_t *)(void *)o;
			for (int64_t i = 0; i < n; i++)
				d[i] = kl__sati32(a[A.scalar ? 0 : i]);
			return KL_OK;
		}
		if (w->op == KL_OP_CAST && !A.scalar) {
			kl__cpu_store_ct(ct, o, w->odt, 1, A.p, n);
			return KL_OK;
		}
		int64_t m = A.scalar ? 1 : n; /* a broadcast operand: compute once */
		bool fast = ct == KL_CT_F32   ? un_f32(w, A.p, res, m)
		            : ct == KL_CT_F64 ? un_f64(w, A.p, res, m)
		                              : un_i64(w, A.p, res, m) == KL_OK;
		if (!fast) {
			pw_generic(w, off, inner, n, o);
			return KL_OK;
		}
		if (A.scalar && m < n) {
			size_t cs = kl__cpu_ct_size(ct);
			for (int64_t i = 1; i < n; i++)
				memcpy((char *)res + i * (int64_t)cs, res, cs);
		}
	}
	if (st != KL_OK)
		return st;
	if (!direct)
		kl__cpu_store_ct(ct, o, w->odt, 1, res, n);
	return KL_OK;
}

/* output elements [lo, hi) of the flat (dense) output */
static kl_status pw_range(const pw_plan *w, int64_t lo, int64_t hi)
{
	pw_buf bufs[4];
	int nd = w->ndim;
	int nops = w->nin;
	int64_t idx[KL_MAX_DIMS];
	int64_t rem = lo;
	for (int d = nd - 1; d >= 0; d--) {
		idx[d] = rem % w->shape[d];
		rem /= w->shape[d];
	}
	int64_t inner[3];
	for (int k = 0; k < nops; k++)
		inner[k] = w->st[k][nd - 1];
	while (lo < hi) {
		int64_t n = w->shape[nd - 1] - idx[nd - 1];
		if (n > hi - lo)
			n = hi - lo;
		if (n > CHUNK)
			n = CHUNK;
		int64_t off[3];
		for (int k = 0; k < nops; k++) {
			off[k] = 0;
			for (int d = 0; d < nd; d++)
				off[k] += idx[d] * w->st[k][d];
		}
		kl_status st = pw_chunk(w, off, inner, n, w->out + lo * (int64_t)w->oes, bufs);
		if (st != KL_OK)
			return st;
		lo += n;
		idx[nd - 1] += n;
		for (int d = nd - 1; d > 0 && idx[d] == w->shape[d]; d--) {
			idx[d] = 0;
			idx[d - 1]++;
		}
	}
	return KL_OK;
}

static bool is_integral(double v)
{
	return v == v && v >= -9.2e18 && v <= 9.2e18 && v == (double)(int64_t)v;
}

typedef struct pw_job {
	const pw_plan *w;
	_Atomic int st;
} pw_job;

static void pw_part(void *arg, int64_t lo, int64_t hi)
{
	pw_job *j = arg;
	kl_status s = pw_range(j->w, lo, hi);
	if (s != KL_OK)
		atomic_store(&j->st, (int)s);
}

kl_status kl__cpu_pointwise(kl_ctx *ctx, const kl_node *n, kl_tensor *const *in, kl_tensor *out)
{
	const char *name = kl__cpu_opname(n);
	kl_cat cat = kl__ops[n->op].cat;
	pw_plan w;
	memset(&w, 0, sizeof w);
	w.op = (kl_op)n->op;
	w.odt = (kl_dtype)n->dtype;
	w.oes = kl_dtype_size(w.odt);
	w.out = kl__tensor_data(out);
	w.rhs_scalar = (cat == KL_CAT_BINARY || cat == KL_CAT_COMPARE) && n->a.scalar_rhs;
	w.at = &n->a;

	int want = cat == KL_CAT_WHERE                              ? 3
	           : (cat == KL_CAT_BINARY || cat == KL_CAT_COMPARE) ? 2
	                                                             : 1;
	if (w.rhs_scalar)
		want = 1;
	if (n->nin != want)
		return kl__err(ctx, KL_EINVAL, "kl_%s: cpu kernel expects %d tensor inputs, got %d",
		               name, want, n->nin);
	w.nin = want;
	for (int k = 0; k < want; k++) {
		const kl_tensor *t = in[k];
		if (!t || !t->st)
			return kl__err(ctx, KL_EINVAL, "kl_%s: input %d is not materialized", name,
			               k);
		if (t->ndim != n->ndim)
			return kl__err(ctx, KL_EINVAL, "kl_%s: input %d has %d dims, node has %d",
			               name, k, t->ndim, (int)n->ndim);
		for (int d = 0; d < n->ndim; d++)
			if (t->shape[d] != n->shape[d])
				return kl__err(ctx, KL_EINVAL, "kl_%s: input %d dim %d is %lld, "
				               "node has %lld", name, k, d, (long long)t->shape[d],
				               (long long)n->shape[d]);
		if (t->dtype >= KL_NDTYPES)
			return kl__err(ctx, KL_EUNSUPPORTED, "kl_%s: input %d has an unknown dtype",
			               name, k);
		w.base[k] = kl__tensor_data(t);
		w.dt[k] = t->dtype;
		w.es[k] = kl_dtype_size(t->dtype);
		memcpy(w.st[k], t->strides, sizeof(int64_t) * (size_t)n->ndim);
	}

	/* what the op computes in */
	if (n->op == KL_OP_CAST)
		w.ct = kl__cpu_ct(w.dt[0]);
	else if (cat == KL_CAT_COMPARE) {
		/* Compare exactly, as the reference does in double: float formats
		 * meet exactly in float, integers in int64; a float against an
		 * integer or against the (unrounded) scalar needs double. */
		w.ct = KL_CT_I64;
		kl_cpu_ct c0 = kl__cpu_ct(w.dt[0]);
		kl_cpu_ct c1 = w.rhs_scalar ? (is_integral(n->a.s[0]) ? KL_CT_I64 : KL_CT_F64)
		                            : kl__cpu_ct(w.dt[1]);
		w.in_ct = c0 == c1 ? c0 : KL_CT_F64;
	} else
		w.ct = kl__cpu_ct(w.odt);
	if (cat == KL_CAT_COMPARE && w.odt != KL_BOOL)
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_%s: comparison result must be bool, node "
		               "is %s", name, kl_dtype_name(w.odt));
	if (w.ct == KL_CT_I64 && (cat == KL_CAT_UNARY_FLOAT || n->op == KL_OP_DIV))
		return kl__err(ctx, KL_EUNSUPPORTED, "kl_%s: result dtype %s is not a float dtype",
		               name, kl_dtype_name(w.odt));
	for (int j = 0; j < 2; j++) {
		/* an arithmetic scalar is first rounded to the result dtype, as
		 * the reference does; a comparison's scalar stays exact */
		double s = n->a.s[j];
		double r = cat == KL_CAT_COMPARE ? s : kl__round_to(w.odt, s);
		w.sf[j] = (float)r;
		w.sd[j] = r;
		w.si[j] = kl__f2i64(cat == KL_CAT_COMPARE ? s : r);
	}

	int64_t total = kl__numel(n->ndim, n->shape);
	if (total == 0)
		return KL_OK;
	int64_t oshape[KL_MAX_DIMS] = {0};
	memcpy(oshape, n->shape, sizeof(int64_t) * (size_t)n->ndim);
	w.ndim = kl__cpu_coalesce(n->ndim, oshape, w.nin, w.st);
	memcpy(w.shape, oshape, sizeof oshape);

	int nt = kl__cpu_threads(ctx);
	kl_status st = KL_OK;
	if (nt > 1 && total >= KL_CPU_PAR_MIN) {
		pw_job j = {&w, KL_OK};
		kl__par_for(nt, total, pw_part, &j);
		st = (kl_status)atomic_load(&j.st);
	} else {
		st = pw_range(&w, 0, total);
	}
	if (st != KL_OK)
		return kl__err(ctx, st, "kl_%s: not supported for dtype %s on the cpu", name,
		               kl_dtype_name(w.odt));
	return KL_OK;
}
